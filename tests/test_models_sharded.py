"""Models on a device mesh: from_pretrained(DIR, mesh=..., rules=...), the sharded forward, generate and a
training step, on one process with 8 host devices and on 2 processes x 4 devices.

The multi-device checks run in subprocesses (tests/_models_mesh_checks.py), each on tiny random checkpoints
this session writes with transformers (examples/train_sharded.py's configs: heads and widths that split over
8 devices, vocabulary 128): one run over the meshes (data, model) = (8,1), (2,4), (1,8), and one run of two
processes joined by jax.distributed (gloo) on the (2,4) mesh, "data" across the processes. Every check
compares with the same model on one device in float64: logits normwise <= 1e-12, greedy tokens equal, one
AdamW step's loss, gradients and parameters <= 1e-12, and the parameters' layout after the step. The byte
ranges each process read are counted against the shards its devices hold, its host memory while loading is
measured, and the compiled forward's collectives are named by the mesh axes they run over.

The cheap parts (the byte-range reader, the transforms read by region, the rules and their errors, a
one-device mesh) run in this session, in the default group.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from helpers import assert_float64, normwise, run_processes
from jaxattn import io
from jaxattn.models import from_pretrained, partition_rules, weights as W

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "_models_mesh_checks.py"
sys.path.insert(0, str(HERE.parent / "examples"))
from train_sharded import DEMO  # noqa: E402  (the tiny configs that split over 8 devices)

# Mistral is Llama's layers with a sliding window: Gemma 2 runs the window (and its refusal under sequence
# parallelism) on every mesh, so Mistral's own 3-mesh run (about 65 s of the slow group) repeated both.
FAMILIES = ("gpt2", "llama", "qwen2", "gemma2", "t5")
NEW_FAMILIES = (
    "qwen3",
    "gemma3_text",
    "mixtral",
    "gpt_oss",
    "qwen3_moe",
    "llama4_text",
    "deepseek_v3",
    "qwen3_next",
)  # the (2, 4) mesh only
MESHES = ("8x1", "2x4", "1x8")
TOL = 1e-12
TIMEOUT_S = 1500  # the mesh run takes about 8 minutes on a loaded 2-core machine


def one_device_mesh(*names):
    return Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(names)), names)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{family: directory} of tiny random checkpoints (and "bert"), written once."""
    pytest.importorskip("transformers")
    from crosscheck._hf import checkpoints as hf

    root = tmp_path_factory.mktemp("sharded")
    written = {f: str(hf.write_checkpoint(f, root / f, vocab_size=128, **DEMO[f])) for f in FAMILIES}
    return written


@pytest.fixture(scope="module")
def new_checkpoints(tmp_path_factory):
    """{family: directory} of the newer families' tiny checkpoints (DEMO's: 8 experts), written on first use."""
    pytest.importorskip("transformers")
    from crosscheck._hf import checkpoints as hf

    root = tmp_path_factory.mktemp("sharded_new")

    class Written(dict):
        def __missing__(self, family):
            self[family] = str(hf.write_checkpoint(family, root / family, vocab_size=128, **DEMO[family]))
            return self[family]

    return Written()


# ---------------------------------------------------------------------------------------------------------
# This session: the reader, the transforms by region, the rules (one device).


def test_read_region_reads_exactly_the_box(tmp_path):
    safetensors = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.normal(size=(5, 7, 3)).astype(np.float32),
        "b": rng.normal(size=(4,)),
        "c": np.array(2.5),
        "d": rng.normal(size=(6, 10)).astype(ml_dtypes.bfloat16),
        "e": np.zeros((0, 3), np.float32),
        "f": rng.integers(0, 9, (6, 10)).astype(np.int16),
    }
    path = tmp_path / "x.safetensors"
    safetensors.save_file(tensors, str(path))
    whole, entries = io.load_safetensors(path), io.safetensors_entries(path)
    assert list(entries) == list(whole) and entries["a"].shape == (5, 7, 3)
    for name, x in whole.items():
        for _ in range(12):
            box = []
            for n in x.shape:
                a = int(rng.integers(0, n + 1))
                box.append((a, int(rng.integers(a, n + 1))))
            io.bytes_read.clear()
            got = io.read_region(path, entries[name], box)
            want = x[tuple(slice(a, b) for a, b in box)]
            assert got.dtype == want.dtype and np.array_equal(got, want), (name, box)
            assert io.bytes_read[(str(path), name)] == want.nbytes  # not a byte more
    with pytest.raises(ValueError, match=r"'a': expected a box"):
        io.read_region(path, entries["a"], [(0, 6), (0, 7), (0, 3)])


def test_safetensors_entries_refuses_a_damaged_file(tmp_path):
    safetensors = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "x.safetensors"
    safetensors.save_file({"a": np.ones((4, 4), np.float32)}, str(path))
    raw = path.read_bytes()
    path.write_bytes(raw[:-8])  # truncated
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        io.safetensors_entries(path)
    path.write_bytes((10**9).to_bytes(8, "little") + raw[8:])  # a header longer than the file
    with pytest.raises(ValueError, match="header length"):
        io.safetensors_entries(path)
    with pytest.raises(FileNotFoundError):
        io.safetensors_entries(tmp_path / "missing.safetensors")


# (transform, HF shape, leaf shape, the leaf axes that are a merged HF axis's later letters: a box that cuts
# none of them reads exactly its own bytes; one that does reads the whole merged axis)
@pytest.mark.parametrize(
    "transform,hf_shape,shape,tails",
    [
        (W.Copy(), (6, 4), (6, 4), ()),
        (W.Transpose(), (6, 4), (4, 6), ()),
        (W.Reshape(), (12,), (3, 4), (1,)),
        (W.Steps(W.Transpose(), W.Reshape()), (12, 5), (5, 3, 4), (2,)),
        (W.Steps(W.Transpose(), W.Reshape()), (5, 12), (3, 4, 5), (1,)),
        (W.Reshape(), (12, 5), (3, 4, 5), (1,)),
        (W.Part(1, 3, 1), (5, 36), (5, 3, 4), (2,)),
        (W.Part(2, 3, 0), (36,), (3, 4), (1,)),
        (W.Part(0, 3, 1), (5, 36), (5, 12), ()),
        # the MoE families' steps (jaxattn.models.moe): a stacked [X,out,in] kernel to [X,in,out], Mixtral's fused
        # gate_up_proj [X,2F,E] halves; gpt-oss's interleaved columns (every: the span read, tails = its axis)
        (W.SwapAxes(1, 2), (4, 6, 8), (4, 8, 6), ()),
        (W.Steps(W.Part(1, 2, 1), W.SwapAxes(1, 2)), (4, 12, 8), (4, 8, 6), ()),
        (W.Every(0, 2, 2), (4, 6, 16), (4, 6, 8), (2,)),
        (W.Every(1, 2, 1), (6, 16), (6, 8), (1,)),
        # blocks of w entries (GPT-NeoX's per-head q/k/v rows): no single strided range, the tensor is read whole
        (W.Steps(W.Every(1, 3, 0, w=4), W.Transpose(), W.Reshape()), (24, 5), (5, 2, 4), None),
    ],
)
def test_a_box_of_a_leaf_reads_its_region_of_the_tensor(tmp_path, transform, hf_shape, shape, tails):
    """Transform.region (what the sharded reader reads) against the dense table transform (weights.fill), on
    every box of a grid of cuts."""

    safetensors = pytest.importorskip("safetensors.numpy")
    x = np.arange(np.prod(hf_shape), dtype=np.float64).reshape(hf_shape)
    path = tmp_path / "t.safetensors"
    safetensors.save_file({"t": x}, str(path))
    entry = io.safetensors_entries(path)["t"]
    row = W.row("t", tuple(map(str, hf_shape)), "w", tuple(map(str, shape)), transform)
    leaf = W.fill({"t": x}, [row], {}, {"t": "t.safetensors"})["w"]
    cuts = [[(0, d), (0, d // 2), (d // 2, d), (1, d - 1)] for d in shape]
    for choice in np.ndindex(*[len(c) for c in cuts]):
        box = tuple(cuts[a][k] for a, k in enumerate(choice))
        io.bytes_read.clear()
        got = transform.region(lambda b: io.read_region(path, entry, b), hf_shape, shape, box)
        want = leaf[tuple(slice(a, b) for a, b in box)]
        assert got.dtype == want.dtype and np.array_equal(got, want), box
        read = sum(io.bytes_read.values())
        if tails is None:
            assert read == x.nbytes, (box, read)
            continue
        exact = all(box[a] == (0, shape[a]) for a in tails)
        if isinstance(transform, W.Every):  # the span of the n interleaved slices
            assert want.nbytes <= read <= transform.n * want.nbytes, (box, read, want.nbytes)
        else:
            assert read == want.nbytes if exact else read >= want.nbytes, (box, read, want.nbytes)


def test_a_stacked_row_reads_only_the_experts_of_its_shard(tmp_path):
    """A stacked row (one HF tensor per expert): a box over experts [1, 3) reads only experts 1 and 2, each
    for its own box, and equals the dense table's leaf there."""
    from jaxattn.models import _lazy_checkpoint

    safetensors = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    tensors = {f"e.{j}.w": rng.normal(size=(6, 8)) for j in range(4)}  # [F,E] each
    path = tmp_path / "t.safetensors"
    safetensors.save_file(tensors, str(path))
    entries = io.safetensors_entries(path)
    row = W.stacked("e.{j}.w", ("F", "E"), "w", ("X", "E", "F"), W.Transpose(), over="X")
    dims = {"X": 4, "E": 8, "F": 6}
    leaf = W.fill(tensors, [row], dims, {n: "t.safetensors" for n in tensors})["w"]
    xs = [_lazy_checkpoint.LazyTensor(path, entries[f"e.{j}.w"]) for j in range(4)]
    box = ((1, 3), (4, 8), (0, 6))
    io.bytes_read.clear()
    got = _lazy_checkpoint.stacked_region(xs, W.Transpose(), (4, 8, 6), box)
    assert np.array_equal(got, leaf[1:3, 4:8])
    assert {name: n for (_, name), n in io.bytes_read.items()} == {"e.1.w": 6 * 4 * 8, "e.2.w": 6 * 4 * 8}


def test_rules_tables_name_every_family():
    for model_type in ("bert", "gpt2", "t5", "llama", "qwen2", "mistral", "gemma2", *NEW_FAMILIES, "swin"):
        rules = partition_rules(model_type)
        assert rules[-1] == ("*", P())  # the catch-all replicates
        assert all(isinstance(p, str) and isinstance(s, P) for p, s in rules)
    assert dict(partition_rules("llama"))["*/self_attn/query/kernel"] == P("data", "model", None)
    assert dict(partition_rules("llama"))["*/self_attn/out/kernel"] == P("model", None, "data")
    assert partition_rules("qwen3") == partition_rules("gemma3_text") == partition_rules("llama")
    with pytest.raises(ValueError, match="model_type: expected one of"):
        partition_rules("whisper")


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss", "llama4_text", "deepseek_v3"])
def test_moe_rules_split_experts_before_the_llama_rows(model_type):
    """The expert rows come first (Llama's "*/gate_proj/kernel" would match a 3-D expert kernel): experts by
    X over "model", FSDP over E; the router FSDP over E; the dense rows as Llama's."""
    from jaxattn.models import _partition_rules

    rules = _partition_rules.Rules.of(model_type, one_device_mesh("data", "model"))
    E, X, F = 8, 4, 6
    assert rules.spec("layers_1/mlp/experts/gate_proj/kernel", (X, E, F)) == P("model", "data", None)
    assert rules.spec("layers_1/mlp/experts/up_proj/kernel", (X, E, F)) == P("model", "data", None)
    assert rules.spec("layers_1/mlp/experts/down_proj/kernel", (X, F, E)) == P("model", None, "data")
    assert rules.spec("layers_1/mlp/experts/gate_proj/bias", (X, F)) == P("model", None)
    assert rules.spec("layers_1/mlp/experts/down_proj/bias", (X, E)) == P("model", None)
    assert rules.spec("layers_1/mlp/router/kernel", (E, X)) == P("data", None)
    assert rules.spec("layers_1/mlp/router/bias", (X,)) == P()
    assert rules.spec("layers_1/self_attn/sinks", (4,)) == P("model")
    assert rules.spec("layers_1/self_attn/query/kernel", (E, 4, 2)) == P("data", "model", None)
    assert rules.spec("layers_1/self_attn/q_norm/weight", (2,)) == P()
    assert rules.spec("layers_1/mlp/shared_expert/gate_proj/kernel", (E, F)) == P("data", "model")  # Llama 4's
    assert rules.spec("layers_1/mlp/shared_expert/down_proj/kernel", (F, E)) == P("model", "data")


def test_deepseek_rules_split_mla_heads_and_keep_the_latents_whole():
    """MLA's per-head kernels by head over "model", its projections to the latents FSDP only (every head reads
    the whole latent), the router's correction bias replicated."""
    from jaxattn.models import _partition_rules

    rules = _partition_rules.Rules.of("deepseek_v3", one_device_mesh("data", "model"))
    E, N, Cq, C, R, Hn, Hv, X = 8, 4, 6, 10, 2, 3, 5, 4
    spec = rules.spec
    assert spec("layers_0/self_attn/query/kernel", (E, N, Hn + R)) == P("data", "model", None)
    assert spec("layers_0/self_attn/query_up/kernel", (Cq, N, Hn + R)) == P(None, "model", None)
    assert spec("layers_0/self_attn/key_value_up/kernel", (C, N, Hn + Hv)) == P("data", "model", None)
    assert spec("layers_0/self_attn/out/kernel", (N, Hv, E)) == P("model", None, "data")
    assert spec("layers_0/self_attn/query_down/kernel", (E, Cq)) == P("data", None)
    assert spec("layers_0/self_attn/latent_and_key_rope/kernel", (E, C + R)) == P("data", None)
    assert spec("layers_0/self_attn/latent_norm/scale", (C,)) == P()
    assert spec("layers_1/mlp/score_correction_bias", (X,)) == P()
    assert spec("layers_1/mlp/shared_experts/down_proj/kernel", (6, E)) == P("model", "data")


def test_qwen3_next_rules_split_heads_and_experts():
    """Qwen3-Next's own projections by heads (gated attention) and key / value heads (linear layers), the conv
    by channel and the decay parameters by value head, its experts and shared expert as the MoE rows."""
    from jaxattn.models import _partition_rules

    rules = _partition_rules.Rules.of("qwen3_next", one_device_mesh("data", "model"))
    E, N, K, H, J, P_, M, D, X, F = 8, 4, 2, 6, 2, 10, 4, 3, 4, 6
    assert rules.spec("layers_1/self_attn/q_proj/kernel", (E, N, 2 * H)) == P("data", "model", None)
    assert rules.spec("layers_1/self_attn/k_proj/kernel", (E, K, H)) == P("data", "model", None)
    assert rules.spec("layers_1/self_attn/o_proj/kernel", (N, H, E)) == P("model", None, "data")
    assert rules.spec("layers_0/linear_attn/in_proj_qkvz/kernel", (E, J, P_)) == P("data", "model", None)
    assert rules.spec("layers_0/linear_attn/out_proj/kernel", (M, D, E)) == P("model", None, "data")
    assert rules.spec("layers_0/linear_attn/conv_weight", (2 * J * 5 + M * D, 4)) == P("model", None)
    assert rules.spec("layers_0/linear_attn/A_log", (M,)) == P("model")
    assert rules.spec("layers_0/linear_attn/norm_weight", (D,)) == P()
    assert rules.spec("layers_0/mlp/experts/gate_proj/kernel", (X, E, F)) == P("model", "data", None)
    assert rules.spec("layers_0/mlp/shared_expert/down_proj/kernel", (F, E)) == P("model", "data")
    assert rules.spec("layers_0/mlp/shared_expert_gate/kernel", (E, 1)) == P("data", None)


@pytest.mark.slow  # MoE families' sharded loading (the dense families' stays in the default group)
@pytest.mark.parametrize("family", ["mixtral", pytest.param("gpt_oss", marks=pytest.mark.slow)])
def test_one_device_mesh_loads_moe_params_the_same(new_checkpoints, family):
    """Stacked per-expert rows (Mixtral) and gpt-oss's interleaved gate/up ("every"): on a one-device mesh
    the params equal the unsharded load and so do the logits; every tensor is read whole once, except
    gpt-oss's fused gate_up tensors [...,2F], read once for gate and once for up, each the span from its
    first column to its last (2F - 1 of the 2F columns)."""
    directory = new_checkpoints[family]
    model, params = from_pretrained(directory, dtype="float64")
    io.bytes_read.clear()
    smodel, sparams = from_pretrained(directory, dtype="float64", mesh=one_device_mesh("data", "model"))
    entries = io.safetensors_entries(Path(directory) / "model.safetensors")
    twice = {n for n in entries if n.endswith(("gate_up_proj", "gate_up_proj_bias"))}
    assert (family == "gpt_oss") == bool(twice)
    assert {name: n for (_, name), n in io.bytes_read.items()} == {
        n: 2 * e.nbytes * (e.shape[-1] - 1) // e.shape[-1] if n in twice else e.nbytes for n, e in entries.items()
    }
    assert jax.tree.structure(params) == jax.tree.structure(sparams)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(sparams)):
        assert isinstance(b, jax.Array) and a.dtype == b.dtype and np.array_equal(a, b)
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    got = jax.jit(smodel.apply)({"params": sparams}, ids)
    assert_float64(got)
    assert normwise(got, model.apply({"params": params}, ids)) <= TOL


def test_rules_first_match_wins_and_user_rows_come_first():
    from jaxattn.models import _partition_rules

    mesh = one_device_mesh("data", "model")
    rules = _partition_rules.Rules.of("llama", mesh, {"*/self_attn/*/kernel": P("data")})
    assert rules.spec("layers_3/self_attn/query/kernel", (8, 4, 2)) == P("data")
    assert rules.spec("layers_3/up_proj/kernel", (8, 6)) == P("data", "model")
    assert rules.spec("norm/weight", (8,)) == P()
    only_data = _partition_rules.Rules.of("llama", one_device_mesh("data"))  # "model" dropped from the defaults
    assert only_data.spec("layers_0/self_attn/query/kernel", (8, 4, 2)) == P("data", None, None)


@pytest.mark.parametrize(
    "rules,match",
    [
        (
            [("*", P("expert"))],
            r"rules\[0\] \('\*': P\('expert',\)\): expected axes of the mesh \['data', 'model'\], "
            r"got axis 'expert'",
        ),
        ([("*", "data")], r"rules\[0\]: expected a \(pattern str, PartitionSpec\) pair"),
    ],
)
def test_rules_that_name_no_axis_of_the_mesh_are_refused(rules, match):
    from jaxattn.models import _partition_rules

    with pytest.raises(ValueError, match=match):
        _partition_rules.Rules.of("llama", one_device_mesh("data", "model"), rules)


def test_a_spec_is_checked_against_its_leaf():
    from jaxattn.models import _partition_rules

    mesh = one_device_mesh("data", "model")
    with pytest.raises(
        ValueError,
        match=r"^q \(spec P\(None, None, None, 'data'\), shape \[8,4,2\]\): expected "
        r"at most 3 entries",
    ):
        _partition_rules.check_spec("q", P(None, None, None, "data"), (8, 4, 2), mesh)
    with pytest.raises(ValueError, match=r"expected each mesh axis at most once, got axes \['data', 'data'\]"):
        _partition_rules.check_spec("q", P("data", "data"), (8, 4, 2), mesh)
    with pytest.raises(ValueError, match=r"expected axes of the mesh \['data', 'model'\], got axis 'seq'"):
        _partition_rules.check_spec("q", P("seq"), (8, 4, 2), mesh)


def test_a_rule_that_does_not_divide_a_dimension_is_refused():
    """On a (2, 4) mesh (an AbstractMesh: the check needs only its axes' sizes, not 8 devices), each bad spec
    is a ValueError naming the parameter, the spec and the shape; the family's defaults with the "model" axis
    dropped fit a width of 6."""
    from jax.sharding import AbstractMesh

    from jaxattn.models import _partition_rules

    mesh = AbstractMesh((2, 4), ("data", "model"))
    with pytest.raises(
        ValueError,
        match=r"^layers_0/up_proj/kernel \(spec P\('data', 'model'\), shape \[64,6\]\): "
        r"expected dim 1 \(6\) divisible by 4 \(mesh axes \['model'\]\), got 6 % 4 = 2$",
    ):
        _partition_rules.check_spec("layers_0/up_proj/kernel", P("data", "model"), (64, 6), mesh)
    with pytest.raises(
        ValueError,
        match=r"^q \(spec P\(\('data', 'model'\),\), shape \[12\]\): expected dim 0 "
        r"\(12\) divisible by 8 \(mesh axes \['data', 'model'\]\)",
    ):
        _partition_rules.check_spec("q", P(("data", "model")), (12,), mesh)
    _partition_rules.check_spec("layers_0/up_proj/kernel", P("data", None), (64, 6), mesh)


def test_one_device_mesh_loads_the_same_params(checkpoints):
    """On a one-device mesh every leaf is a jax.Array with the rules' spec, equal to the unsharded load,
    and the whole checkpoint is read exactly once (each byte of every tensor)."""
    directory = checkpoints["gpt2"]
    model, params = from_pretrained(directory, dtype="float64")
    io.bytes_read.clear()
    smodel, sparams = from_pretrained(directory, dtype="float64", mesh=one_device_mesh("data", "model"))
    entries = io.safetensors_entries(Path(directory) / "model.safetensors")
    assert {name: n for (_, name), n in io.bytes_read.items()} == {n: e.nbytes for n, e in entries.items()}
    assert smodel.sharding is not None and model.sharding is None
    assert jax.tree.structure(params) == jax.tree.structure(sparams)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(sparams)):
        assert isinstance(b, jax.Array) and a.dtype == b.dtype and np.array_equal(a, b)
    assert sparams["h_0"]["attn"]["query"]["kernel"].sharding.spec == P("data", "model", None)
    ids = np.array([[5, 6, 7, 8], [9, 10, 11, 12]])
    got = jax.jit(smodel.apply)({"params": sparams}, ids)
    assert_float64(got)
    assert normwise(got, model.apply({"params": params}, ids)) <= TOL


def test_deberta_v2_rules_split_heads_and_keep_the_tables_fsdp():
    """DeBERTa-v2: BERT's layout for its encoder, under "deberta/" in a head too; pos_key / pos_query by head
    as key / query, the relative embeddings and the word embeddings FSDP over E."""
    from jaxattn.models import _partition_rules

    rules = _partition_rules.Rules.of("deberta-v2", one_device_mesh("data", "model"))
    E, N, H, R, F = 8, 4, 2, 6, 10
    for prefix in ("", "deberta/"):
        assert rules.spec(f"{prefix}layer_0/attention/query/kernel", (E, N, H)) == P("data", "model", None)
        assert rules.spec(f"{prefix}layer_1/attention/pos_key/kernel", (E, N, H)) == P("data", "model", None)
        assert rules.spec(f"{prefix}layer_1/attention/pos_query/bias", (N, H)) == P("model", None)
        assert rules.spec(f"{prefix}layer_0/attention/out/kernel", (N, H, E)) == P("model", None, "data")
        assert rules.spec(f"{prefix}layer_0/intermediate/kernel", (E, F)) == P("data", "model")
        assert rules.spec(f"{prefix}layer_0/output/kernel", (F, E)) == P("model", "data")
        assert rules.spec(f"{prefix}rel_embeddings", (R, E)) == P(None, "data")
        assert rules.spec(f"{prefix}rel_embeddings_norm/scale", (E,)) == P()
        assert rules.spec(f"{prefix}embed/word_embeddings/embedding", (97, E)) == P(None, "data")
    assert rules.spec("lm_bias", (97,)) == P()
    assert rules.spec("classifier/kernel", (E, 3)) == P()


@pytest.mark.slow  # ~15 s on 2 cores (a checkpoint written by transformers, two compiles)
def test_deberta_v2_on_a_one_device_mesh_loads_the_same_params(tmp_path):
    """A DeBERTa-v2 masked LM on a one-device mesh: every leaf a jax.Array equal to the unsharded load, the
    float64 logits the same."""
    pytest.importorskip("transformers")
    from crosscheck._hf import checkpoints as hf

    directory = hf.write_checkpoint("deberta-v2", tmp_path / "deberta")
    model, params = from_pretrained(directory, dtype="float64")
    smodel, sparams = from_pretrained(directory, dtype="float64", mesh=one_device_mesh("data", "model"))
    assert smodel.sharding is not None and jax.tree.structure(params) == jax.tree.structure(sparams)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(sparams)):
        assert isinstance(b, jax.Array) and a.dtype == b.dtype and np.array_equal(a, b)
    assert sparams["deberta"]["layer_0"]["attention"]["query"]["kernel"].sharding.spec == P("data", "model", None)
    ids, mask = hf.padded_batch("right")
    got = jax.jit(smodel.apply)({"params": sparams}, ids, mask)
    assert_float64(got)
    assert normwise(got, model.apply({"params": params}, ids, mask)) <= TOL


@pytest.mark.slow  # an 8-device subprocess: DeBERTa-v2's forward on the (2, 4) mesh
def test_deberta_v2_on_a_mesh_equals_one_device(tmp_path):
    """DebertaV2ForMaskedLM and DebertaV2ForSequenceClassification on (data, model) = (2, 4) in float64 (batch 8
    over "data", 4 heads over "model"): logits normwise <= 1e-12 against one device, the layout the rules say."""
    pytest.importorskip("transformers")
    from crosscheck._hf import checkpoints as hf

    masked = hf.write_checkpoint("deberta-v2", tmp_path / "masked")
    classifier = hf.write_checkpoint(
        "deberta-v2", tmp_path / "classifier", architecture="DebertaV2ForSequenceClassification", share_att_key=False
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "families", "2x4", str(masked), str(classifier)],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
        cwd=HERE,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for name in ("masked", "classifier"):
        assert "2x4" in results[name], results[name]
        result = results[name]["2x4"]
        assert "error" not in result, result
        assert result["dtypes"] == ["float64"] and result["forward"] <= TOL, result
        assert result["specs"]["['deberta']['layer_0']['attention']['query']['kernel']"] == "('data', 'model')"
    specs = results["classifier"]["2x4"]["specs"]
    assert specs["['deberta']['layer_1']['attention']['pos_key']['kernel']"] == "('data', 'model')"


@pytest.mark.slow  # a model compiled for one more layout: 4 s; the multi-device runs are slow too
def test_sequence_parallel_applies_the_qk_norms(tmp_path):
    """Qwen 3 without windows on a one-device (data, seq, model) mesh: its attention runs on the ring
    (SequenceParallelAttention), q_norm/k_norm included, and equals the unsharded model."""
    from crosscheck._hf import checkpoints as hf
    from jaxattn.linen import MultiHeadAttention
    from jaxattn.models import _activation_layout

    directory = hf.write_checkpoint(
        "qwen3", tmp_path / "qwen3", vocab_size=128, use_sliding_window=False, **DEMO["qwen3"]
    )
    model, params = from_pretrained(directory, dtype="float64")
    smodel, sparams = from_pretrained(directory, dtype="float64", mesh=one_device_mesh("data", "seq", "model"))
    assert _activation_layout.attention_class(smodel.sharding) is not MultiHeadAttention
    ids, mask = np.array([[5, 6, 7, 8, 9, 10], [9, 10, 11, 12, 0, 0]]), np.array([[1] * 6, [1] * 4 + [0] * 2])
    got = jax.jit(smodel.apply)({"params": sparams}, ids, attention_mask=mask)
    want = model.apply({"params": params}, ids, attention_mask=mask)
    assert_float64(got)
    assert normwise(np.asarray(got)[mask == 1], np.asarray(want)[mask == 1]) <= TOL


def test_missing_shard_file_names_the_parameter_spec_and_shape(checkpoints, tmp_path):
    """A save_pretrained directory in several shard files, one of them deleted: ValueError naming the first
    parameter it would fill, its spec and shape; without a mesh, FileNotFoundError as before."""
    from crosscheck._hf import checkpoints as hf

    directory = hf.write_checkpoint("llama", tmp_path / "llama", vocab_size=128, **DEMO["llama"])
    import torch  # noqa: F401  (write_checkpoint needs it; re-save in shards)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    model.save_pretrained(str(tmp_path / "sharded"), max_shard_size="100KB")
    files = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(files) >= 3
    missing = files[1]
    names = [
        n
        for n, f in json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())[
            "weight_map"
        ].items()
        if f == missing.name
    ]
    missing.unlink()
    with pytest.raises(
        ValueError,
        match=rf"\(spec P\(.*\), shape \[[\d,]+\]\): expected tensor '.*' from "
        rf"{missing.name}, got no such file",
    ) as error:
        from_pretrained(tmp_path / "sharded", mesh=one_device_mesh("data", "model"))
    assert any(f"'{n}'" in str(error.value) for n in names)
    with pytest.raises(FileNotFoundError, match=missing.name):
        from_pretrained(tmp_path / "sharded")


def test_rules_need_a_mesh(checkpoints):
    with pytest.raises(ValueError, match="rules: expected None without a mesh"):
        from_pretrained(checkpoints["gpt2"], rules=[("*", P())])


# ---------------------------------------------------------------------------------------------------------
# 8 host devices, one subprocess over the three meshes (slow group).

# the forward's all-reduces over "model" on the (1, 8) mesh: one after each row-parallel projection (attention
# out and MLP down per layer; T5's decoder layers add cross-attention's out), one for the lookup in embeddings
# split by vocabulary (GPT-2's are not)
ROW_PARALLEL_ALL_REDUCES = {
    "gpt2": 2 * 2,
    "llama": 2 * 2 + 1,
    "qwen2": 2 * 2 + 1,
    "gemma2": 2 * 2 + 1,
    "t5": 2 * 2 + 3 * 2 + 1,
}


@pytest.fixture(scope="module")
def mesh_results(checkpoints):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "mesh", ",".join(MESHES), *(checkpoints[f] for f in FAMILIES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
        cwd=HERE,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def result_of(results, family, mesh):
    assert "error" not in results[family], results[family]["error"]
    result = results[family][mesh]
    assert "error" not in result, result["error"]
    return result


@pytest.mark.slow  # reads the 8-device subprocess run (_models_mesh_checks.py mesh)
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_model_equals_one_device(mesh_results, family, mesh):
    """Logits normwise <= 1e-12, greedy tokens equal (and the decode cache laid out batch over data, heads
    over model), one AdamW step: loss, gradients and parameters <= 1e-12, parameters and optimizer state
    still laid out as the rules say."""
    result = result_of(mesh_results, family, mesh)
    assert result["dtypes"] == ["float64"]
    assert result["forward"] <= TOL
    assert result["generate"]["equal"], result["generate"]
    cache = result["generate"]["cache"]
    assert sorted(cache) == ["cache_index", "cached_key", "cached_value"], cache
    assert all(entry["as_expected"] for entry in cache.values()), cache
    train = result["train"]
    assert train["loss"] <= TOL and train["grads"] <= TOL and train["params"] <= TOL, train
    assert train["layout_kept"] and train["state_layout_kept"], train


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_parameters_are_laid_out_by_the_rules(mesh_results, family):
    specs = result_of(mesh_results, family, "2x4")["specs"]
    attention = {"gpt2": "['h_0']['attn']", "t5": "['decoder']['block_1']['cross_attention']"}.get(
        family, "['layers_0']['self_attn']"
    )
    assert specs[f"{attention}['query']['kernel']"] == "('data', 'model')"  # [E,N,H]: FSDP, heads
    assert specs[f"{attention}['key']['kernel']"] == "('data', 'model')"
    assert specs[f"{attention}['out']['kernel']"] == "('model', None, 'data')"  # [N,H,E]
    norms = [s for path, s in specs.items() if "norm" in path or "ln_" in path]
    assert norms and set(norms) == {"()"}  # replicated
    mlp_in = {"gpt2": "['h_0']['c_fc']", "t5": "['encoder']['block_0']['ff']['wi_0']"}.get(
        family, "['layers_0']['up_proj']"
    )
    assert specs[f"{mlp_in}['kernel']"] == "('data', 'model')"


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_collectives_are_the_ones_the_rules_imply(mesh_results, family):
    """The compiled sharded forward, by the mesh axes each collective runs over:
    (1,8), tensor parallel: all-reduces over "model" only, one per row-parallel projection (+1 for embeddings
        split by vocabulary);
    (8,1), FSDP: all-gathers over "data" (each weight gathered where it is used) and the embeddings'
        all-to-all from features-split to batch-split over "data"; no all-reduce;
    (2,4): all-reduces over "model" only; no weight is ever all-gathered over "model" (an all-gather whose
        result has a model-split leaf's shape with that split undone).
    """
    tensor = [(op, axes) for op, axes, _ in result_of(mesh_results, family, "1x8")["collectives"]["ops"]]
    assert tensor == [("all-reduce", ["model"])] * ROW_PARALLEL_ALL_REDUCES[family], tensor
    fsdp = result_of(mesh_results, family, "8x1")["collectives"]["ops"]
    assert {op for op, _, _ in fsdp} == {"all-gather", "all-to-all"} and all(axes == ["data"] for _, axes, _ in fsdp)
    assert sum(op == "all-gather" for op, _, _ in fsdp) >= 8  # every kernel of both layers, at least
    both = result_of(mesh_results, family, "2x4")["collectives"]
    reduces = [axes for op, axes, _ in both["ops"] if op == "all-reduce"]
    assert reduces and all(axes == ["model"] for axes in reduces)
    assert any(op == "all-gather" and axes == ["data"] for op, axes, _ in both["ops"])
    for mesh in MESHES:
        assert result_of(mesh_results, family, mesh)["collectives"]["weights_gathered_over_model"] == [], mesh


@pytest.fixture(scope="module")
def new_family_results(new_checkpoints):
    """The newer families on the (2, 4) mesh (_models_mesh_checks.py families: no error or sequence-parallel
    runs), each against one device."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "families", "2x4", *(new_checkpoints[f] for f in NEW_FAMILIES)],
        capture_output=True,
        text=True,
        env=env,
        timeout=TIMEOUT_S,
        cwd=HERE,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # reads the 8-device subprocess run (_models_mesh_checks.py families)
@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_newer_family_on_a_mesh_equals_one_device(new_family_results, family):
    """Qwen 3, Gemma 3, Mixtral, gpt-oss, Qwen3-MoE, Llama 4, DeepSeek V3, Qwen3-Next on (data, model) = (2, 4)
    in float64: logits normwise <= 1e-12, greedy tokens equal, one AdamW step <= 1e-12 with the layout kept; the
    experts laid out by MOE_RULES (X over "model"), and no weight all-gathered over "model" in the compiled forward."""
    result = result_of(new_family_results, family, "2x4")
    assert result["dtypes"] == ["float64"]
    assert result["forward"] <= TOL
    assert result["generate"]["equal"], result["generate"]
    train = result["train"]
    assert train["loss"] <= TOL and train["grads"] <= TOL and train["params"] <= TOL, train
    assert train["layout_kept"] and train["state_layout_kept"], train
    specs = result["specs"]
    if family == "deepseek_v3":  # MLA: heads over "model", the latent projections FSDP; layer 1 the MoE
        assert specs["['layers_0']['self_attn']['query_up']['kernel']"] == "(None, 'model')"
        assert specs["['layers_0']['self_attn']['key_value_up']['kernel']"] == "('data', 'model')"
        assert specs["['layers_0']['self_attn']['latent_and_key_rope']['kernel']"] == "('data',)"
        assert specs["['layers_0']['mlp']['up_proj']['kernel']"] == "('data', 'model')"
        assert specs["['layers_1']['mlp']['experts']['gate_proj']['kernel']"] == "('model', 'data')"
        assert specs["['layers_1']['mlp']['shared_experts']['down_proj']['kernel']"] == "('model', 'data')"
        assert {k: v["spec"] for k, v in result["generate"]["cache"].items()} == {
            "cache_index": "('data',)",
            "cached_latent": "('data',)",
            "cached_rope": "('data',)",
        }
    elif family == "qwen3_next":  # layer 0 linear with the MoE, layer 1 gated attention with a dense SwiGLU
        assert specs["['layers_0']['linear_attn']['in_proj_qkvz']['kernel']"] == "('data', 'model')"
        assert specs["['layers_0']['linear_attn']['out_proj']['kernel']"] == "('model', None, 'data')"
        assert specs["['layers_1']['self_attn']['q_proj']['kernel']"] == "('data', 'model')"
        assert specs["['layers_0']['mlp']['experts']['gate_proj']['kernel']"] == "('model', 'data')"
        assert result["generate"]["cache"]["recurrent_state"]["as_expected"], result["generate"]
    else:
        assert specs["['layers_0']['self_attn']['query']['kernel']"] == "('data', 'model')"
    if family in ("qwen3", "gemma3_text", "qwen3_moe"):
        assert specs["['layers_0']['self_attn']['q_norm']['weight']"] == "()"
    if family == "llama4_text":  # layer 0 dense (its SwiGLU under "mlp"), layer 1 the MoE with a shared expert
        assert specs["['layers_0']['mlp']['up_proj']['kernel']"] == "('data', 'model')"
        assert specs["['layers_1']['mlp']['experts']['gate_proj']['kernel']"] == "('model', 'data')"
        assert specs["['layers_1']['mlp']['shared_expert']['down_proj']['kernel']"] == "('model', 'data')"
    elif family in ("mixtral", "gpt_oss", "qwen3_moe"):
        assert specs["['layers_0']['mlp']['experts']['gate_proj']['kernel']"] == "('model', 'data')"
        assert specs["['layers_0']['mlp']['experts']['down_proj']['kernel']"] == "('model', None, 'data')"
        assert specs["['layers_0']['mlp']['router']['kernel']"] == "('data',)"
    elif family not in ("deepseek_v3", "qwen3_next"):
        assert specs["['layers_0']['up_proj']['kernel']"] == "('data', 'model')"
    assert result["collectives"]["weights_gathered_over_model"] == []
    reduces = [axes for op, axes, t in result["collectives"]["ops"] if op == "all-reduce" and "f64" in t]
    assert reduces and all(axes == ["model"] for axes in reduces), reduces


@pytest.mark.slow
def test_rules_that_do_not_fit_eight_devices_are_refused(mesh_results):
    messages = mesh_results["errors"]
    assert messages["does not divide"] == (
        "layers_0/self_attn/query/kernel (spec P(None, None, ('data', 'model')), shape [64,16,4]): expected dim 2 "
        "(4) divisible by 8 (mesh axes ['data', 'model']), got 4 % 8 = 4"
    )
    assert messages["axis not in the mesh"].startswith("rules[0] ('*': P('expert',)): expected axes of the mesh")
    assert "expected at most 3 entries (one per dim), got 4" in messages["too many entries"]
    assert "expected each mesh axis at most once" in messages["axis twice"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_sequence_parallel_on_the_ring_equals_one_device(mesh_results, family):
    """Mesh (data, seq, model) = (2, 2, 2), right-padded 12-token prompts: the forward, generate (prefill on
    the ring) and one AdamW step (the ring's backward) equal one device; the compiled forward passes key/value
    shares round "seq" (collective-permutes) and all-reduces floats over "model" only; a left-padded row gives NaN
    logits, and generate refuses it."""
    result = mesh_results["sequence_parallel"][family]
    assert "error" not in result, result["error"]
    assert result["forward"] <= TOL and "'seq'" in result["forward_spec"]
    assert result["generate"]["equal"]
    train = result["train"]
    assert train["loss"] <= TOL and train["grads"] <= TOL and train["params"] <= TOL, train
    assert train["layout_kept"] and train["state_layout_kept"]
    ops = result["collectives"]["ops"]
    assert sum(op == "collective-permute" and axes == ["seq"] for op, axes, _ in ops) >= 2 * 2  # 2 layers, D - 1
    # the row-parallel projections' partial sums over "model"; over "seq", only the attention mask's reductions
    # (each row's key count and whether it is right padding, [B] ints / booleans)
    reduces = [(axes, t) for op, axes, t in ops if op == "all-reduce"]
    assert all(axes == ["model"] for axes, t in reduces if "f64" in t), reduces
    assert all(axes == ["seq"] and "f64" not in t for axes, t in reduces if axes != ["model"]), reduces
    assert result["collectives"]["weights_gathered_over_model"] == []
    left = result["left_padded_rows_nan"]
    assert left["rows"] == [False] * 7 + [True]
    assert left["generate"] == (
        "attention_mask: expected right padding (each row's tokens first) with sequence "
        "parallelism (the ring masks keys by count), got rows [7] padded otherwise"
    )


@pytest.mark.slow
def test_sequence_parallel_refuses_what_the_ring_cannot_run(mesh_results):
    refused = {family: r["refused"] for family, r in mesh_results["sequence_parallel"].items() if "refused" in r}
    assert sorted(refused) == ["gemma2", "t5"]
    assert refused["gemma2"].startswith("window: expected None with sequence parallelism")
    assert refused["t5"].startswith("mesh: expected no axis 'seq' for t5")


# ---------------------------------------------------------------------------------------------------------
# 2 processes x 4 devices, jax.distributed over gloo (slow group).

PROCESS_TIMEOUT_S = 1500


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """A larger Llama (8 layers, ~100 MB float32) whose memory while loading is measured."""
    pytest.importorskip("transformers")
    from crosscheck._hf import checkpoints as hf

    return str(
        hf.write_checkpoint(
            "llama",
            tmp_path_factory.mktemp("big") / "llama",
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=64,
        )
    )


@pytest.fixture(scope="module")
def process_results(checkpoints, big_checkpoint):
    """The two processes' reports (tests/helpers.py's run_processes, as tests/test_multiprocess.py's)."""
    return run_processes(
        SCRIPT, 2, big_checkpoint, *(checkpoints[f] for f in FAMILIES), mode=("process",), timeout_s=PROCESS_TIMEOUT_S
    )


@pytest.mark.slow
@pytest.mark.parametrize("process", range(2))
@pytest.mark.parametrize("family", FAMILIES)
def test_across_processes_the_model_equals_one_device(process_results, family, process):
    report = process_results[process]
    assert (report["process_index"], report["process_count"], report["devices"], report["local_devices"]) == (
        process,
        2,
        8,
        4,
    )
    result = report[family]
    assert "error" not in result, result["error"]
    assert result["forward"] <= TOL and result["generate"]["equal"]
    train = result["train"]
    assert train["loss"] <= TOL and train["grads"] <= TOL and train["params"] <= TOL, train
    assert train["layout_kept"] and train["state_layout_kept"]


@pytest.mark.slow
@pytest.mark.parametrize("process", range(2))
@pytest.mark.parametrize("family", FAMILIES)
def test_each_process_reads_only_the_bytes_of_its_shards(process_results, family, process):
    """Per tensor, the bytes this process read are exactly those of the distinct shards its 4 devices hold
    ("data" splits every matrix between the processes, so about half of each; the norm weights, replicated,
    whole), and nothing is read twice."""
    result = process_results[process][family]
    assert result["bytes_read"] == result["bytes_held"]
    assert sum(result["bytes_read"].values()) <= result["checkpoint_bytes"] / 2 + 16 * 1024


@pytest.mark.slow
@pytest.mark.parametrize("process", range(2))
def test_each_process_holds_half_the_checkpoint_while_loading(process_results, process):
    """The larger checkpoint (8 layers, 100 MB): tracemalloc's peak of host arrays while loading it onto the
    mesh is within half the checkpoint + 8 MiB (in fact within one tensor + 8 MiB: shards are read one leaf at
    a time and go to the devices' buffers, which tracemalloc does not see). Its peak RSS growth while loading,
    the devices' buffers included (host memory on CPU), stays within half the checkpoint + the largest tensor
    (the host copies of one leaf's shards live until they are on the devices) + 16 MiB; the unsharded load
    needs more than the whole checkpoint."""
    memory = process_results[process]["memory"]
    half = memory["checkpoint_bytes"] / 2
    assert memory["traced_peak"] <= half + 8 * 2**20, memory  # the bar: tracemalloc's peak, 8 MiB slack
    assert memory["bytes_read"] <= half + 64 * 1024  # the norm weights, replicated, are read whole
    assert memory["device_bytes"] <= half + 256 * 1024  # and held once per device
    assert memory["rss_peak_growth"] <= half + memory["largest_tensor_bytes"] + 16 * 2**20, memory
    assert memory["traced_peak"] <= memory["largest_tensor_bytes"] + 8 * 2**20, memory
    assert memory["unsharded_rss_peak_growth"] > memory["checkpoint_bytes"], memory
