"""jaxattn.models.swin against transformers' SwinModel / SwinForImageClassification (transformers 5).

Tiny random checkpoints from crosscheck._hf.checkpoints (every parameter random, norms around 1): the "swin"
one is a 28x20 image of 5 channels in 4x4 patches, a 7x5 grid that 3x3 windows do not tile (HF pads it to 9x6
for both the plain and the shifted block), PatchMerging of an odd grid (padded to 8x6 -> 4x3), where the
window clamps to 3 with no shift and pads again (6x3); widths 15 / 30 with 3 / 5 heads, F 39 / 78, 7 labels.
Compared in float64 with HF's float32-only softmax lifted (float64_reference): logits, every stage's hidden
state and the parameter gradients of a loss on the logits, normwise <= 1e-12. A second geometry (patch 2,
window 2, a 12x12 grid: shifted windows on both stages, no padding) and the SwinModel without classifier run in
the slow group. Loading: the released checkpoints' older names, to_pretrained's round trip (bit for bit, and
transformers loads it with no missing or unexpected keys), a one-device mesh; every refusal named.
"""

import dataclasses
import functools
import json
import operator
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crosscheck._hf import checkpoints as hf
from helpers import assert_float64, normwise
from jaxattn.io import load_safetensors
from jaxattn.models import (
    SwinConfig,
    SwinForImageClassification,
    SwinModel,
    from_pretrained,
    swin as swin_module,
    to_pretrained,
)

TOL = 1e-12
# patch 2, window 2 on a 24x24 image: 12x12 then 6x6 grids, both tiled, the odd blocks shifted by 1 on both
TILED = dict(image_size=24, patch_size=2, num_channels=3, embed_dim=14, num_heads=[2, 7], window_size=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return hf.write_checkpoint("swin", tmp_path_factory.mktemp("swin"))


def _pixels(directory, batch=3, seed=0):
    config = json.loads((directory / "config.json").read_text())
    size = config["image_size"]
    height, width = (size, size) if isinstance(size, int) else size
    return np.random.default_rng(seed).normal(size=(batch, config["num_channels"], height, width))


def _torch_run(torch_model, pixels):
    """HF's outputs in float64 (its float32 softmax lifted), with every stage's hidden state."""
    with hf.float64_reference(torch_model, "float64"):
        return torch_model(pixel_values=torch.from_numpy(pixels), output_hidden_states=True)


def _compare_classifier(directory, *, grads: bool = True):
    """float64: our logits, hidden states and (with grads) the parameter gradients of a loss on the logits
    against HF's; returns {what: normwise error}."""
    torch_model = hf.torch_model(directory, "float64")
    model, params = from_pretrained(directory, dtype="float64")
    assert isinstance(model, SwinForImageClassification)
    pixels = _pixels(directory)
    weights = np.random.default_rng(1).normal(size=(pixels.shape[0], model.config.num_labels))

    def loss(p):
        return jnp.sum(model.apply({"params": p}, pixels) * weights)

    value, ours_grads = jax.jit(jax.value_and_grad(loss))(params) if grads else (None, None)
    logits, state = jax.jit(lambda p: model.apply({"params": p}, pixels, mutable=["intermediates"]))(params)
    rows = {k: v[0] for k, v in state["intermediates"]["swin"].items()}
    stages = len(model.config.depths)
    last = f"stage{stages - 1}.block{model.config.depths[-1] - 1}.residual"  # HF's hidden_states: each stage's output
    hidden = [rows["embeddings"], *(rows[f"stage{s}.downsample"] for s in range(stages - 1)), rows[last]]
    assert_float64(logits, ours_grads)
    out = _torch_run(torch_model, pixels)
    errors = {"logits": normwise(logits, out.logits.detach())}
    assert len(hidden) == len(out.hidden_states)
    for k, (ours, theirs) in enumerate(zip(hidden, out.hidden_states)):
        errors[f"hidden_states[{k}]"] = normwise(ours, theirs.detach())
    if not grads:
        return errors
    torch_loss = (out.logits * torch.from_numpy(weights)).sum()
    torch_loss.backward()
    assert abs(float(value) - float(torch_loss.detach())) <= TOL * abs(float(value))
    torch_grads = {n: p.grad.numpy() for n, p in torch_model.named_parameters()}
    theirs = swin_module.params_from_state_dict(torch_grads, model.config, classifier=True)  # our layout
    for path, g in jax.tree_util.tree_leaves_with_path(ours_grads):
        keys = [key.key for key in path]
        theirs_g = functools.reduce(operator.getitem, keys, theirs)
        # the key bias adds q_i . b to every logit of row i, which softmax ignores: its gradient is zero in exact
        # arithmetic and both sides give rounding residue; measured against the query bias's gradient instead
        floor = (
            np.linalg.norm(functools.reduce(operator.getitem, keys[:-2] + ["query", "bias"], theirs))
            if keys[-2:] == ["key", "bias"]
            else 0.0
        )
        errors[f"grad {'/'.join(keys)}"] = normwise(g, theirs_g, floor=floor)
    return errors


def test_classifier_float64_equals_transformers_with_padding_and_clamped_windows(checkpoint):
    """The default group's one forward check against transformers: logits and every stage's hidden state."""
    errors = _compare_classifier(checkpoint, grads=False)
    worst = max(errors.values())
    assert worst <= TOL, {k: v for k, v in errors.items() if not v <= TOL}


@pytest.mark.slow
def test_classifier_float64_gradients_equal_transformers(checkpoint):
    errors = _compare_classifier(checkpoint)
    assert len(errors) > 50 and max(errors.values()) <= TOL, {k: v for k, v in errors.items() if not v <= TOL}


@pytest.mark.slow
def test_classifier_float64_on_tiled_shifted_windows(tmp_path):
    directory = hf.write_checkpoint("swin", tmp_path, seed=3, **TILED)
    errors = _compare_classifier(directory)
    assert max(errors.values()) <= TOL, errors


@pytest.mark.slow
def test_swin_model_without_classifier_float64(checkpoint, tmp_path):
    """A SwinModel checkpoint (no prefix, no classifier): last_hidden_state and pooler_output as HF's AutoModel."""
    hf.torch_model(checkpoint, "float64").swin.save_pretrained(tmp_path)
    model, params = from_pretrained(tmp_path, dtype="float64")
    assert isinstance(model, SwinModel)
    theirs = _torch_run(hf.torch_model(tmp_path, "float64"), _pixels(checkpoint))
    ours = model.apply({"params": params}, _pixels(checkpoint))
    assert_float64(ours["last_hidden_state"], ours["pooler_output"])
    for name in ("last_hidden_state", "pooler_output"):
        assert normwise(ours[name], getattr(theirs, name).detach()) <= TOL, name


@pytest.mark.slow
def test_float32_logits_within_float32_rounding(checkpoint):
    torch_model = hf.torch_model(checkpoint, "float32")
    model, params = from_pretrained(checkpoint)
    pixels = _pixels(checkpoint).astype(np.float32)
    ours = np.asarray(jax.jit(model.apply)({"params": params}, pixels))
    with torch.no_grad():
        theirs = torch_model(pixel_values=torch.from_numpy(pixels)).logits.numpy()
    assert ours.dtype == np.float32
    assert np.abs(ours - theirs).max() <= 1e-5 * max(1.0, np.abs(theirs).max())


# --- loading and writing ----------------------------------------------------------------------------------------


def _tensors(directory):
    return {k: v for f in sorted(directory.glob("model*.safetensors")) for k, v in load_safetensors(f).items()}


def test_round_trip_is_bit_for_bit_and_transformers_loads_it_clean(checkpoint, tmp_path):
    import transformers

    model, params = from_pretrained(checkpoint)
    written = to_pretrained(model, params, tmp_path / "out")
    original, back = _tensors(checkpoint), _tensors(written)
    assert set(back) == set(original)
    assert all(np.array_equal(back[k].view(np.uint8), original[k].view(np.uint8)) for k in original)
    assert json.loads((written / "config.json").read_text()) == json.loads((checkpoint / "config.json").read_text())
    _, info = transformers.AutoModelForImageClassification.from_pretrained(
        str(written), output_loading_info=True, local_files_only=True
    )
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}


@pytest.mark.slow
def test_a_config_built_in_python_writes_a_checkpoint_transformers_loads(tmp_path):
    """No config.json behind it (hf_config None): to_pretrained writes the config from the mapping alone."""
    import transformers

    config = SwinConfig(image_size=16, patch_size=2, embed_dim=6, depths=(1, 3), num_heads=(2, 3), window_size=2)
    model = SwinModel(config)
    params = swin_module.init_params(config)
    written = to_pretrained(model, params, tmp_path)
    again, loaded = from_pretrained(written)
    assert again.config == config and isinstance(again, SwinModel)
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), loaded, jax.device_get(params)))
    _, info = transformers.AutoModel.from_pretrained(str(written), output_loading_info=True, local_files_only=True)
    assert info["missing_keys"] == set() and info["unexpected_keys"] == set()


def test_transformers_module_names_and_the_index_buffers_load_too(checkpoint, tmp_path):
    """Files name a block's tensors attention.self.query, attention.output.dense, intermediate.dense, output.dense
    (the Hub's checkpoints, and transformers 5's save_pretrained); its modules name them attention.q_proj ...,
    mlp.fc2 (a state_dict in memory). Both give the same params; older files' relative_position_index buffers
    are checked against window_relative_index and skipped."""
    from safetensors.numpy import save_file

    from jaxattn import window_relative_index

    tensors = _tensors(checkpoint)
    assert "swin.encoder.layers.1.blocks.1.output.dense.weight" in tensors  # what save_pretrained wrote
    state = {n: p.detach().numpy() for n, p in hf.torch_model(checkpoint).state_dict().items()}
    assert "swin.encoder.layers.1.blocks.1.mlp.fc2.weight" in state
    config = from_pretrained(checkpoint)[0].config
    from_state = swin_module.params_from_state_dict(state, config, classifier=True)
    _, expected = from_pretrained(checkpoint)
    assert jax.tree.all(jax.tree.map(np.array_equal, from_state, expected))
    index = np.asarray(window_relative_index(3)).reshape(-1).astype(np.int64)
    buffer = "swin.encoder.layers.0.blocks.0.attention.self.relative_position_index"
    save_file({**tensors, buffer: index}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    _, params = from_pretrained(tmp_path)
    assert jax.tree.all(jax.tree.map(np.array_equal, params, expected))
    save_file({**tensors, buffer: index[::-1].copy()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"relative_position_index.*expected the relative_position_index of a 3x3"):
        from_pretrained(tmp_path)


def test_one_device_mesh_loads_the_same_params(checkpoint):
    from jax.sharding import Mesh, PartitionSpec as P

    from jaxattn.models import partition_rules

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    model, params = from_pretrained(checkpoint, mesh=mesh)
    _, plain = from_pretrained(checkpoint)
    assert model.sharding is not None
    assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), b), params, plain))
    rules = dict(partition_rules("swin"))
    assert rules["*/fc1/kernel"] == P(None, "model") and rules["*/fc2/kernel"] == P("model", None)
    with pytest.raises(ValueError, match="mesh: expected no axis 'seq' for swin"):
        from_pretrained(checkpoint, mesh=Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "seq")))


# a (data, model) = (2, 4) mesh of 8 host devices, in a subprocess (JAX must see the devices before it starts)
_MESH_SCRIPT = """
import os, sys
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_enable_x64", True)
from jax.sharding import Mesh
from jaxattn.models import from_pretrained
directory = sys.argv[1]
pixels = np.random.default_rng(0).normal(size=(8, 3, 24, 24))
weights = np.random.default_rng(1).normal(size=(8, 7))
def loss(model, p, x):
    return jnp.sum(model.apply({"params": p}, x) * weights)
model, params = from_pretrained(directory, dtype="float64")
ref = jax.jit(jax.value_and_grad(lambda p: loss(model, p, pixels)))(params)
mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
smodel, sparams = from_pretrained(directory, dtype="float64", mesh=mesh)
placed = smodel.sharding.place(pixels, "B")
got = jax.jit(jax.value_and_grad(lambda p, x: loss(smodel, p, x)))(sparams, placed)
def normwise(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
# the key biases' gradients are zero in exact arithmetic (softmax ignores a constant per row): residue, left out
errors = [normwise(got[0], ref[0])] + [
    normwise(a, b)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[1]), jax.tree.leaves(ref[1]))
    if "key']['bias" not in jax.tree_util.keystr(path)
]
fc1 = sparams["swin"]["stage_1_block_0"]["fc1"]["kernel"]
print("RESULT", max(errors), str(fc1.sharding.spec), len(fc1.addressable_shards), str(placed.sharding.spec))
"""


@pytest.mark.slow
def test_a_2x4_mesh_gives_the_one_device_loss_and_gradients(tmp_path):
    """from_pretrained(mesh=) on 8 host devices: batch over "data", the MLPs over "model" (F 64 / 128 split by
    4); float64 loss and every gradient (but the key biases': zero in exact arithmetic) within 1e-12 normwise
    of one device."""
    import subprocess
    import sys

    tiled = {**TILED, "embed_dim": 16, "num_heads": [2, 4], "mlp_ratio": 4.0}
    directory = hf.write_checkpoint("swin", tmp_path, **tiled)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    run = subprocess.run(
        [sys.executable, "-c", _MESH_SCRIPT, str(directory)], capture_output=True, text=True, env=env, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = run.stdout.split("RESULT ")[1].strip()
    assert float(line.split()[0]) <= TOL, line
    assert line.split()[1:] == ["P(None,", "'model')", "8", "P('data',)"], line


@pytest.mark.slow
def test_absolute_position_embeddings_float64_and_their_gradient(tmp_path):
    """use_absolute_embeddings: the learned [1,P,E0] table (random, not HF's zero init) added after the norm:
    logits, hidden states and every gradient (the table's included) as HF's; another image size is refused."""
    directory = hf.write_checkpoint("swin", tmp_path, seed=5, use_absolute_embeddings=True)
    model, params = from_pretrained(directory, dtype="float64")
    table = params["swin"]["position_embeddings"]
    assert table.shape == (1, 7 * 5, 15) and np.linalg.norm(table) > 1.0  # the 7x5 grid's patches, width 15
    errors = _compare_classifier(directory)
    assert "grad swin/position_embeddings" in errors and max(errors.values()) <= TOL, errors
    with pytest.raises(ValueError, match=r"pixel_values: expected 28x20 pixels \(config image_size.*got 32x20"):
        model.apply({"params": params}, np.zeros((1, 5, 32, 20)))


# --- refusals -------------------------------------------------------------------------------------------------


def test_bad_pixel_values_name_both_sizes(checkpoint):
    model, params = from_pretrained(checkpoint)
    with pytest.raises(ValueError, match=r"pixel_values: expected 5 channels \(num_channels\).*got 3 channels"):
        model.apply({"params": params}, np.zeros((1, 3, 28, 20), np.float32))
    with pytest.raises(ValueError, match=r"pixel_values: expected a height and width that are multiples of "):
        model.apply({"params": params}, np.zeros((1, 5, 30, 20), np.float32))
    with pytest.raises(ValueError, match=r"multiples of patch_size 4x4, got 30x20"):
        model.apply({"params": params}, np.zeros((1, 5, 30, 20), np.float32))
    with pytest.raises(ValueError, match=r"pixel_values: expected rank 4"):
        model.apply({"params": params}, np.zeros((5, 28, 20), np.float32))
    # 16x8 pixels: a 4x2 grid, smaller than the 3x3 window on one side (transformers 5 fails there too)
    with pytest.raises(ValueError, match=r"at least window_size=3 on each side.*got a 4x2 map"):
        model.apply({"params": params}, np.zeros((1, 5, 16, 8), np.float32))


@pytest.mark.parametrize(
    "change, match",
    [
        ({"use_absolute_embeddings": "yes"}, "use_absolute_embeddings: expected true or false"),
        ({"hidden_act": "relu"}, "hidden_act: expected 'gelu'"),
        ({"qkv_bias": False}, "qkv_bias: expected true"),
        ({"num_heads": [3]}, r"num_heads: expected one entry per stage \(2, as depths\)"),
        ({"num_heads": [4, 5]}, r"num_heads: expected stage 0's heads dividing its width 15"),
        ({"depths": []}, "depths: expected a non-empty list of positive ints"),
        ({"patch_size": [4, 0]}, r"patch_size: expected a positive int or a pair"),
        ({"patch_size": [4]}, r"patch_size: expected a positive int or a pair"),
        ({"mlp_ratio": 0}, r"mlp_ratio: expected a positive number"),
        ({"embed_dim": None}, "embed_dim: missing"),
    ],
)
def test_config_refusals_name_the_key(checkpoint, tmp_path, change, match):
    config = {**json.loads((checkpoint / "config.json").read_text()), **change}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(checkpoint / "model.safetensors")
    with pytest.raises(ValueError, match=match):
        from_pretrained(tmp_path)


def test_merge_patches_is_hfs_concat_order():
    """SwinPatchMerging's channels: [0::2,0::2], [1::2,0::2], [0::2,1::2], [1::2,1::2]; odd sides zero-padded.
    HF's own forward with its norm and reduction taken out gives the bare concat."""
    from transformers.models.swin.modeling_swin import SwinPatchMerging

    B, Y, X, E = 2, 5, 7, 3
    x = np.random.default_rng(0).normal(size=(B, Y, X, E))
    module = SwinPatchMerging(E)
    module.norm, module.reduction = torch.nn.Identity(), torch.nn.Identity()
    theirs = module(torch.from_numpy(x).reshape(B, Y * X, E), (Y, X)).numpy()
    merged = np.asarray(swin_module.merge_patches(jnp.asarray(x)))
    assert merged.shape == (B, 3, 4, 4 * E)
    assert np.array_equal(merged.reshape(B, 12, 4 * E), theirs)
    assert np.array_equal(merged[:, 0, 0], np.concatenate([x[:, 0, 0], x[:, 1, 0], x[:, 0, 1], x[:, 1, 1]], -1))
    assert np.array_equal(
        merged[:, 2, 3], np.concatenate([x[:, 4, 6], 0 * x[:, 4, 6], 0 * x[:, 4, 6], 0 * x[:, 4, 6]], -1)
    )


@pytest.mark.slow  # four programs compiled: 7 s
def test_training_mode_drops_the_attention_branch_by_hfs_rates_and_refuses_attention_dropout():
    """HF's SwinDropPath acts on the attention branch only, at rate drop_path_rate * k / (blocks - 1) for block k:
    with two blocks and rate 1, block 1 keeps none of its attention (its output is its input plus its MLP's
    output), block 0 (rate 0) all of it; rate 0 and no dropout: training mode is inference mode."""
    config = SwinConfig(image_size=8, patch_size=2, num_channels=3, embed_dim=6, depths=(1, 1), num_heads=(2, 3),
                        window_size=2, drop_path_rate=1.0, hidden_dropout_prob=0.0)  # fmt: skip
    model = SwinModel(config)
    params = swin_module.init_params(config)
    pixels = np.random.default_rng(0).normal(size=(3, 3, 8, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"pixel_values: expected a dtype the params' float32 holds .*got float64"):
        model.apply({"params": params}, pixels.astype(np.float64))

    def rows(deterministic, model=model):
        rngs = {"dropout": jax.random.key(1)}
        _, state = model.apply({"params": params}, pixels, deterministic=deterministic, rngs=rngs, mutable=True)
        return {k: np.asarray(v[0]) for k, v in state["intermediates"].items()}

    train, infer = rows(False), rows(True)
    dropped = train["stage0.downsample"] + train["stage1.block0.mlp"]
    np.testing.assert_array_equal(train["stage1.block0.residual"], dropped)
    assert not np.allclose(infer["stage1.block0.residual"], infer["stage0.downsample"] + infer["stage1.block0.mlp"])
    np.testing.assert_array_equal(train["stage0.block0.residual"], infer["stage0.block0.residual"])  # rate 0
    plain = SwinModel(dataclasses.replace(config, drop_path_rate=0.0))
    np.testing.assert_array_equal(rows(False, plain)["final_norm"], rows(True, plain)["final_norm"])
    noisy = SwinModel(dataclasses.replace(config, attention_probs_dropout_prob=0.1))
    with pytest.raises(
        ValueError, match=r"deterministic: expected True, or a config with attention_probs_dropout_prob 0"
    ):
        noisy.apply({"params": params}, pixels, deterministic=False, rngs={"dropout": jax.random.key(1)})
