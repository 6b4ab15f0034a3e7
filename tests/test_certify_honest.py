"""crosscheck.certify cannot pass by accident (issue 37): gradients with integer-only inputs are really
compared, a requested kind with no rows fails, dtype mismatches are named, params= paths reach nnx's integer
keys, and a float32 bar calibrated from a float64 run sees what the fixed float32 bar cannot."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import crosscheck  # noqa: E402
from crosscheck import certify  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from _certify_port import (  # noqa: E402
    LAYERS as TOY_LAYERS,  # noqa: E402
    forward,
    torch_toy,
    toy_inputs,
)
from _tiny_lm import GRAD_MAP, LAYERS, B, E, T, port, token_ids, torch_tiny_lm, tree_port  # noqa: E402

# --- 1. grads=True with token ids --------------------------------------------------------------------------


def test_token_ids_compare_the_gradient_at_the_first_layer_and_a_cut_gradient_fails_there():
    """TinyLM fed token ids: no floating input, so grads=True compares d loss / d (the embeddings), torch's
    from a forward hook, JAX's by perturbing the sown intermediate. A port that drops the MLP branch's gradient
    passes every forward row and fails that one."""
    model, params = torch_tiny_lm()
    cert = certify(model, port(params, "float64"), token_ids(), dtype="float64", layers=LAYERS, grads=True)
    assert cert.passed, cert.table()
    grad_rows = [r for r in cert.rows if r.kind == "grad"]
    assert [(r.name, r.jax_name, r.shape) for r in grad_rows] == [("grad/embed", "embeddings", (3, 29, 16))]
    assert grad_rows[0].value < 1e-14 and grad_rows[0].scale > 0  # a real gradient, agreeing to rounding
    assert cert.counts == {"layer": 2, "output": 1, "kl": 1, "top1": 1, "top5": 1, "grad": 1}
    assert cert.to_json()["counts"]["grad"] == 1 and "rows compared: layer 2" in cert.table()

    cut = certify(
        model, port(params, "float64", cut_mlp_gradient=True), token_ids(), dtype="float64", layers=LAYERS, grads=True
    )
    assert all(r.passed for r in cut.rows if r.kind != "grad")
    assert cut.first_divergent == "grad/embed" and not cut.passed


def test_token_ids_without_a_map_compare_the_gradient_at_the_first_floating_activation(tmp_path):
    """Neither layers= nor params=: each side finds its own first floating activation (torch: the first module
    output, in forward order, that is floating and depends on a parameter; JAX: the first value its program
    makes from the token ids that equals it) and the loss's gradient there is compared. The port that drops
    the MLP branch's gradient passes every forward row and fails that one; a port whose embedding table is
    off by 1e-6 makes no value equal to torch's embeddings and fails it, saying so. A golden file recorded
    without layers= holds torch's activation and its gradient."""
    model, params = torch_tiny_lm()
    cert = certify(model, port(params, "float64"), token_ids(), dtype="float64", grads=True)
    assert cert.passed, cert.table()
    (row,) = [r for r in cert.rows if r.kind == "grad"]
    assert (row.name, row.shape, row.jax_name.split("@")[0]) == ("grad/embed", (B, T, E), "gather")
    assert row.value < 1e-14 and row.scale > 0  # a real gradient, agreeing to rounding
    assert "'embed' output" in cert.activation and row.jax_name in cert.activation, cert.activation
    assert cert.to_json()["activation"] == cert.activation and cert.activation in cert.table()

    cut = certify(model, port(params, "float64", cut_mlp_gradient=True), token_ids(), dtype="float64", grads=True)
    assert all(r.passed for r in cut.rows if r.kind != "grad") and cut.first_divergent == "grad/embed"
    assert cut.rows[-1].value > 1e-2

    off = jax.tree.map(lambda a: a, params)
    off["embed"]["embedding"] = params["embed"]["embedding"] * (1 + 1e-6)
    wrong = certify(model, port(off, "float64"), token_ids(), dtype="float64", grads=True)
    (row,) = [r for r in wrong.rows if r.kind == "grad"]
    assert not row.passed and "none of the" in row.status and "equals it" in row.status, row.status
    assert "none on JAX's side" in wrong.activation

    golden = crosscheck.record(model, token_ids(), tmp_path / "lm.safetensors", grads=True)
    again = certify(None, port(params), None, golden=golden, grads=True)
    assert again.passed and again.counts["grad"] == 1 and again.rows[-1].name == "grad/embed", again.table()


def test_the_first_floating_activation_is_the_value_the_port_reads_after_its_padding_where():
    """torch's Embedding(padding_idx) gives the pad rows' outputs a gradient (only the table's row gets none);
    a port that stands for it with where(pad, stop_gradient(x), x) after the lookup makes the lookup's value
    twice, and the gradient at the lookup itself is zero on the pad rows. The certificate takes the last of
    that run of equal values, the one the rest of the port reads, and passes."""
    model, params = torch_tiny_lm(padding_idx=0)
    ids = token_ids()
    ids["input_ids"][:, -3:] = 0  # padded ends
    cert = certify(model, port(params, "float64", padding_idx=0), ids, dtype="float64", grads=True)
    (row,) = [r for r in cert.rows if r.kind == "grad"]
    assert cert.passed and row.jax_name.startswith("select_n@") and row.value < 1e-14, cert.table()


def test_a_jitted_lookup_called_twice_is_perturbed_at_its_first_call_only():
    """One embedding looked up twice (the ids, then the ids reversed), through one jit'd function whose program
    both calls share: torch's first floating activation is the first call's output, and JAX's gradient is
    taken at the first call's site alone (perturbing both would add the second call's gradient)."""
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(13, 7), torch.nn.Linear(7, 5)
    model = torch.nn.ModuleDict({"embed": embed, "head": head}).double()

    def torch_fn(input_ids):
        return {"out": model["head"](model["embed"](input_ids) + 2 * model["embed"](input_ids.flip(-1)))}

    table, weight, bias = (jax.numpy.asarray(t.detach().numpy()) for t in (embed.weight, head.weight, head.bias))
    lookup = jax.jit(lambda ids: table[ids])

    def jax_fn(input_ids):
        return {"out": (lookup(input_ids) + 2 * lookup(input_ids[..., ::-1])) @ weight.T + bias}

    ids = {"input_ids": np.random.default_rng(0).integers(0, 13, (3, 11))}
    cert = certify(torch_fn, jax_fn, ids, dtype="float64", grads=True, torch_module=model)
    (row,) = [r for r in cert.rows if r.kind == "grad"]
    assert cert.passed and row.name == "grad/embed" and row.value < 1e-14, cert.table()


def test_token_ids_without_a_map_need_a_torch_module_to_find_the_activation():
    model, params = torch_tiny_lm()
    with pytest.raises(ValueError, match=r"first floating activation.*torch_module="):
        certify(lambda input_ids: model(input_ids), port(params), token_ids(), grads=True)


def test_token_ids_with_a_parameter_map_compare_every_mapped_parameter(tmp_path):
    model, params = torch_tiny_lm()
    cert = certify(model, tree_port(), token_ids(), grads=True, jax_params=params, params=GRAD_MAP)
    assert cert.passed, cert.table()
    assert cert.counts["param_grad"] == len(GRAD_MAP) and "grad" not in cert.counts


def test_an_activation_made_inside_a_scan_is_refused_not_compared_as_zero():
    """Perturbing a scan's output would not reach the iterations that use it: refused with the reason."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(13, 7), torch.nn.Linear(7, 5))
    table, weight = jax.numpy.asarray(model[0].weight.detach().numpy()), model[1].weight.detach().numpy()
    bias = model[1].bias.detach().numpy()

    def jax_fn(input_ids):
        x, _ = jax.lax.scan(lambda carry, _: (carry * 1.0, None), table[input_ids], None, length=2)
        return {"out": x @ weight.T + bias}, {"emb": x}

    ids = {"input_ids": np.random.default_rng(0).integers(0, 13, (3, 11))}

    def torch_fn(input_ids):
        return {"out": model(input_ids)}

    assert certify(torch_fn, jax_fn, ids, layers={"0": "emb"}, torch_module=model).passed
    with pytest.raises(ValueError, match=r"'emb' cannot be differentiated: it is made inside a scan"):
        certify(torch_fn, jax_fn, ids, layers={"0": "emb"}, torch_module=model, grads=True)


def test_a_golden_file_holds_the_activation_gradient(tmp_path):
    model, params = torch_tiny_lm()
    golden = crosscheck.record(model, token_ids(), tmp_path / "lm.safetensors", layers=LAYERS, grads=True)
    cert = certify(None, port(params), None, golden=golden, grads=True)
    assert cert.passed and cert.counts["grad"] == 1, cert.table()
    bare = crosscheck.record(model, token_ids(), tmp_path / "bare.safetensors", layers=LAYERS)
    with pytest.raises(ValueError, match="recorded without gradients"):
        certify(None, port(params), None, golden=bare, grads=True)


def test_a_requested_kind_with_no_rows_fails_and_says_so():
    model, params = torch_tiny_lm()
    cert = certify(model, port(params), token_ids(), layers=LAYERS)
    assert cert.passed and cert.requested[0] == "layer"
    empty = type(cert)(
        cert.dtype,
        tuple(r for r in cert.rows if r.kind != "layer"),
        cert.inputs,
        cert.versions,
        requested=cert.requested,
    )
    assert all(r.passed for r in empty.rows) and not empty.passed
    assert empty.first_divergent == "(no layer rows)" and empty.counts["layer"] == 0
    assert any("no layer rows" in note for note in empty.notes) and "no layer rows" in empty.table()


# --- 2. dtypes named ---------------------------------------------------------------------------------------


def test_a_port_computing_in_float32_under_a_float64_certificate_is_named():
    model, weights = torch_toy()
    w32 = {k: v.astype(np.float32) for k, v in weights.items()}
    jax_fn = jax.jit(lambda x: forward(w32, x.astype(np.float32)))
    cert = certify(model, jax_fn, toy_inputs(), dtype="float64", layers=TOY_LAYERS)
    first = next(r for r in cert.rows if not r.passed)
    assert first.name == "proj" and "JAX gives float32 under a float64 certificate" in first.status
    assert any("float32 under a float64 certificate" in note for note in cert.notes), cert.notes
    assert "note: dtype: JAX gave" in cert.table()


def test_bfloat16_weights_are_named_in_the_first_failing_row_and_the_summary():
    model, params = torch_tiny_lm()
    bf16 = jax.tree.map(lambda a: np.asarray(a, jax.numpy.bfloat16), params)
    cert = certify(model, tree_port(), token_ids(), jax_params=bf16, layers=LAYERS)
    first = next(r for r in cert.rows if not r.passed)
    assert "jax_params are bfloat16, the certificate is float32" in first.status, first.status
    assert any("bfloat16" in note for note in cert.notes)


# --- 3. nnx containers with integer keys ------------------------------------------------------------------


def test_params_paths_reach_nnx_list_and_dict_children_and_name_the_real_ones():
    from flax import nnx

    widths = (5, 7, 3)

    class Blocks(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in zip(widths, widths[1:])])
            self.heads = nnx.Dict(out=nnx.Linear(widths[2], 2, use_bias=False, rngs=rngs))

        def __call__(self, x):
            return {"out": self.heads["out"](jax.nn.tanh(self.blocks[1](jax.nn.tanh(self.blocks[0](x)))))}

    net = Blocks(nnx.Rngs(0))
    graphdef, state = nnx.split(net)
    ref = torch.nn.ModuleDict(
        {
            "blocks": torch.nn.ModuleList([torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])]),
            "out": torch.nn.Linear(widths[2], 2, bias=False),
        }
    )
    with torch.no_grad():
        for k, block in enumerate(ref["blocks"]):
            block.weight.copy_(torch.from_numpy(np.asarray(state["blocks"][k]["kernel"][...]).T.copy()))
            block.bias.copy_(torch.from_numpy(np.array(state["blocks"][k]["bias"][...])))
        ref["out"].weight.copy_(torch.from_numpy(np.asarray(state["heads"]["out"]["kernel"][...]).T.copy()))

    def torch_fn(x):
        h = x
        for block in ref["blocks"]:
            h = torch.tanh(block(h))
        return {"out": ref["out"](h)}

    @jax.jit
    def jax_fn(s, x):
        return nnx.merge(graphdef, s)(x)

    x = {"x": np.random.default_rng(0).standard_normal((3, 5))}
    grad_map = {
        "blocks.0.weight": ("blocks/0/kernel", np.transpose),
        "blocks.0.bias": "blocks/0/bias",
        "blocks.1.weight": ("blocks/1/kernel", np.transpose),
        "out.weight": ("heads/out/kernel", np.transpose),
    }
    cert = certify(torch_fn, jax_fn, x, grads=True, jax_params=state, params=grad_map, torch_module=ref)
    assert cert.passed and cert.counts["param_grad"] == 4, cert.table()
    with pytest.raises(ValueError, match=r"no '2' under blocks \(there: \[0, 1\]\)"):
        certify(
            torch_fn,
            jax_fn,
            x,
            grads=True,
            jax_params=state,
            params={"blocks.0.bias": "blocks/2/bias"},
            torch_module=ref,
        )


# --- 6. bars that scale: what float32 can and cannot see --------------------------------------------------


def _norm_then_head(eps_torch=1e-5):
    """x [B,T,E] unit-variance -> LayerNorm(eps) -> Linear: a norm epsilon's effect is ~ (eps difference) / 2
    relative at unit scale, under float32's fixed 1e-5 bar."""
    B, T, E, V = 3, 29, 61, 11

    class NormHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(E, eps=eps_torch)
            self.head = torch.nn.Linear(E, V)

        def forward(self, x):
            return {"out": self.head(self.norm(x))}

    torch.manual_seed(0)
    model = NormHead()
    w = {k: v.detach().numpy().astype(np.float64) for k, v in model.state_dict().items()}

    def port(eps, dtype):
        cast = {k: jax.numpy.asarray(v, dtype) for k, v in w.items()}

        @jax.jit
        def jax_fn(x):
            mean = x.mean(-1, keepdims=True)
            var = ((x - mean) ** 2).mean(-1, keepdims=True)
            h = (x - mean) / jax.numpy.sqrt(var + eps) * cast["norm.weight"] + cast["norm.bias"]
            return {"out": h @ cast["head.weight"].T + cast["head.bias"]}, {"norm": h}

        return jax_fn

    return model, port, {"x": np.random.default_rng(0).standard_normal((B, T, E))}


def test_a_norm_epsilon_at_unit_scale_passes_float32_and_fails_float64_and_the_calibrated_float32_bar():
    """LayerNorm epsilon 1e-6 in the port for torch's 1e-5, on unit-variance activations: the rows move by
    ~4.8e-6, under the fixed float32 bar (1e-5), so a float32 certificate passes it; float64 (bar 1e-12) and a
    float32 bar calibrated from torch's own float64 run (10x torch's float32 error there, ~6e-7) fail it. The
    correct port passes all three."""
    model, port, x = _norm_then_head()
    layers = {"norm": "norm"}
    for eps, faithful in ((1e-5, True), (1e-6, False)):
        fixed = certify(model, port(eps, "float32"), x, layers=layers)
        exact = certify(model, port(eps, "float64"), x, dtype="float64", layers=layers)
        calibrated = certify(model, port(eps, "float32"), x, layers=layers, calibrate=True)
        assert fixed.passed, fixed.table()  # float32's fixed bar cannot see the fault
        assert exact.passed == faithful and calibrated.passed == faithful, (exact.table(), calibrated.table())
    assert 2e-6 < fixed.rows[0].value < 1e-5 and exact.first_divergent == calibrated.first_divergent == "norm"
    assert calibrated.rows[0].bar < 1e-6 and "calibrated" in calibrated.table()
    assert calibrated.to_json()["calibration"].startswith("output and layer bars: 10 x")
    with pytest.raises(ValueError, match=r'calibrate: .* expected dtype="float32"'):
        certify(model, port(1e-5, "float64"), x, dtype="float64", calibrate=True)
