"""crosscheck weight conversion: torch.nn.MultiheadAttention and torchref modules <-> jaxattn params.

Every converted module is run on the same float64 numbers by torch and by jaxattn (forward and gradients)
and by an independent numpy einsum form (tests/_einsum_mha.py, forward). Parameter gradients are mapped back through
params_from_torch itself, so the mapping table is what is tested. Sizes are distinct primes: E=15 with N=3
or 5 (H=5 or 3), kdim=7, vdim=11, T=5, S=7, B=2.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from _einsum_mha import einsum_mha

import crosscheck as cc
import jaxattn
import torchref
from helpers import assert_float64, normwise, randomize, shaw_index_loop

E, KDIM, VDIM, T, S, B = 15, 7, 11, 5, 7, 2
TOL = 1e-12


def assert_trees_close(actual, expected, tol=TOL):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    assert_float64(actual, expected)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(actual), jax.tree.leaves(expected)):
        assert normwise(a, b) <= tol, jax.tree_util.keystr(path)


def inputs(Eq, Ek, Ev, seed):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, T, Eq)), rng.normal(size=(B, S, Ek)), rng.normal(size=(B, S, Ev))


# ----------------------------------------------------------------- torch.nn.MultiheadAttention, every option

MHA_CASES = [
    dict(
        bias=bias,
        add_bias_kv=bias_kv,
        add_zero_attn=zero_attn,
        kvdim=kvdim,
        batch_first=batch_first,
        num_heads=3 if bias_kv == zero_attn else 5,
    )
    for bias, bias_kv, zero_attn, kvdim, batch_first in itertools.product([True, False], repeat=5)
]


def case_id(case):
    return "-".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in case.items())


def make_mha(case, seed=0):
    kdim, vdim = (KDIM, VDIM) if case["kvdim"] else (None, None)
    m = torch.nn.MultiheadAttention(
        E,
        case["num_heads"],
        bias=case["bias"],
        add_bias_kv=case["add_bias_kv"],
        add_zero_attn=case["add_zero_attn"],
        kdim=kdim,
        vdim=vdim,
        batch_first=case["batch_first"],
        dtype=torch.float64,
    )
    return randomize(m, seed), (E, kdim or E, vdim or E)


def torch_mha(m, q, k, v, batch_first):
    """torch's forward on batch-first numpy inputs; returns tensors that require grad."""
    q, k, v = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    args = (q, k, v) if batch_first else (q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    out, weights = m(*args, need_weights=True, average_attn_weights=False)
    return (out if batch_first else out.transpose(0, 1)), weights, (q, k, v)


@pytest.mark.parametrize("case", MHA_CASES, ids=case_id)
def test_torch_mha_forward_and_gradients(case):
    """jaxattn's output, per-head weights, and gradients wrt inputs and every parameter, against torch.

    torch's parameter gradients are mapped by params_from_torch, i.e. by the same table as the weights.
    """
    m, dims = make_mha(case)
    q, k, v = inputs(*dims, seed=1)
    params = cc.params_from_torch(m)
    options = cc.call_options_from_torch(m)
    assert options == {"add_zero_attn": case["add_zero_attn"]}
    assert all(leaf.dtype == jnp.float64 for leaf in jax.tree.leaves(params))
    assert ("bias" in params["query"]) == case["bias"] and ("bias_kv" in params) == case["add_bias_kv"]
    extra = case["add_bias_kv"] + case["add_zero_attn"]
    rng = np.random.default_rng(4)
    cot_out, cot_weights = rng.normal(size=(B, T, E)), rng.normal(size=(B, case["num_heads"], T, S + extra))

    expected_out, expected_weights, torch_inputs = torch_mha(m, q, k, v, case["batch_first"])
    ((expected_out * torch.tensor(cot_out)).sum() + (expected_weights * torch.tensor(cot_weights)).sum()).backward()
    torch_param_grads = {name: p.grad for name, p in m.named_parameters()}
    expected_grads = cc.params_from_torch(torch_param_grads, num_heads=case["num_heads"], format="torch")

    fn = lambda *args: jaxattn.multi_head_attention(*args, return_weights=True, **options)  # noqa: E731
    (out, weights), vjp = jax.vjp(fn, params, q, k, v)
    assert weights.shape == (B, case["num_heads"], T, S + extra)
    assert_float64(out, weights, expected_out, expected_weights)
    assert normwise(out, expected_out.detach().numpy()) <= TOL
    assert normwise(weights, expected_weights.detach().numpy()) <= TOL

    grads, *input_grads = vjp((cot_out, cot_weights))
    if case["bias"] and not extra:
        # every key column gets the key bias, a per-query logit shift that softmax ignores: its gradient is
        # zero up to roundoff on both sides, so it is compared absolutely, against the query bias's scale
        scale = np.linalg.norm(expected_grads["query"]["bias"])
        for tree in (grads, expected_grads):
            assert np.linalg.norm(tree["key"].pop("bias")) <= TOL * scale
    assert_trees_close(grads, expected_grads)
    assert_float64(input_grads, [x.grad for x in torch_inputs])
    for grad, x in zip(input_grads, torch_inputs):
        assert normwise(grad, x.grad.numpy()) <= TOL


@pytest.mark.parametrize("case", MHA_CASES, ids=case_id)
def test_torch_mha_einsum_forward(case):
    """The same params through the plain einsum form (numpy): a second route, independent of jaxattn."""
    m, dims = make_mha(case, seed=11)
    q, k, v = inputs(*dims, seed=12)
    params = jax.tree.map(np.asarray, cc.params_from_torch(m))
    out, weights = einsum_mha(params, q, k, v, xp=np, **cc.call_options_from_torch(m))
    expected_out, expected_weights, _ = torch_mha(m, q, k, v, case["batch_first"])
    assert_float64(out, weights, expected_out, expected_weights)
    assert normwise(out, expected_out.detach().numpy()) <= TOL
    assert normwise(weights, expected_weights.detach().numpy()) <= TOL


@pytest.mark.parametrize("case", MHA_CASES[::3], ids=case_id)
def test_torch_mha_round_trip(case):
    m, _ = make_mha(case, seed=5)
    state = m.state_dict()
    back = cc.params_to_torch(cc.params_from_torch(m), format="torch")
    assert list(back) == list(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    m.load_state_dict(back, strict=True)
    from_state = cc.params_from_torch(dict(state), num_heads=case["num_heads"])
    assert_trees_close(from_state, cc.params_from_torch(m), tol=0.0)


def test_seed001_einsum_equals_torch_mha_without_bias():
    """Seed 001: the batch-first einsum MHA reproduces nn.MultiheadAttention(bias=False) with its weights."""
    m = randomize(torch.nn.MultiheadAttention(12, 2, bias=False, batch_first=True, dtype=torch.float64), 6)
    x = np.random.default_rng(7).normal(size=(8, 80, 12))
    params = cc.params_from_torch(m)
    expected = m(*(torch.tensor(x),) * 3)[0].detach().numpy()
    ours = jaxattn.multi_head_attention(params, x)
    assert_float64(ours, expected)
    assert normwise(einsum_mha(params, x, x, x, xp=np)[0], expected) <= TOL
    assert normwise(ours, expected) <= TOL


# ------------------------------------------------------------------------------------------- torchref modules

TORCHREF_CASES = [
    dict(relative=False, bias=True, num_heads=3, num_kv_heads=3, head_dim=5, value_head_dim=5),
    dict(relative=False, bias=False, num_heads=6, num_kv_heads=2, head_dim=7, value_head_dim=11),
    dict(
        relative=True,
        bias=True,
        num_heads=5,
        num_kv_heads=1,
        head_dim=3,
        value_head_dim=13,
        share_heads=False,
        use_key_table=True,
        use_value_table=True,
    ),
    dict(
        relative=True,
        bias=False,
        num_heads=3,
        num_kv_heads=3,
        head_dim=5,
        value_head_dim=5,
        share_heads=True,
        use_key_table=True,
        use_value_table=True,
    ),
    dict(
        relative=True,
        bias=True,
        num_heads=3,
        num_kv_heads=3,
        head_dim=5,
        value_head_dim=7,
        share_heads=False,
        use_key_table=True,
        use_value_table=False,
    ),
    dict(
        relative=True,
        bias=True,
        num_heads=3,
        num_kv_heads=1,
        head_dim=5,
        value_head_dim=7,
        share_heads=True,
        use_key_table=False,
        use_value_table=True,
    ),
]
MAX_DISTANCE = 2


def make_torchref(case, dtype=torch.float64, seed=0):
    case = dict(case)
    relative = case.pop("relative")
    heads = case.pop("num_heads")
    common = dict(key_features=KDIM, value_features=VDIM, out_features=13, dtype=dtype, **case)
    if relative:
        m = torchref.RelativeMultiHeadAttention(E, heads, max_distance=MAX_DISTANCE, **common)
    else:
        m = torchref.MultiHeadAttention(E, heads, **common)
    return randomize(m, seed)


@pytest.mark.parametrize("case", TORCHREF_CASES, ids=case_id)
def test_torchref_round_trip_exact(case):
    m = make_torchref(case)
    state = m.state_dict()
    params = cc.params_from_torch(m)
    back = cc.params_to_torch(params, format="torchref")
    assert list(back) == list(state)
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    make_torchref(case, seed=1).load_state_dict(back, strict=True)
    heads = {k: case[k] for k in ("num_heads", "num_kv_heads", "head_dim", "value_head_dim")}
    assert_trees_close(cc.params_from_torch(dict(state), **heads), params, tol=0.0)


@pytest.mark.parametrize("case", TORCHREF_CASES, ids=case_id)
def test_torchref_forward(case):
    """The head-major feature order and grouped-query sharing survive the conversion."""
    m = make_torchref(case)
    q, k, v = inputs(E, KDIM, VDIM, seed=8)
    expected_out, expected_weights = (x.detach().numpy() for x in m(*map(torch.tensor, (q, k, v)), return_weights=True))
    params = cc.params_from_torch(m)
    assert cc.call_options_from_torch(m) == {}
    run = jaxattn.relative_multi_head_attention if case["relative"] else jaxattn.multi_head_attention
    results = [
        run(params, q, k, v, return_weights=True),
        einsum_mha(params, q, k, v, rel_index=shaw_index_loop(T, S, MAX_DISTANCE), xp=np),
    ]
    for out, weights in results:
        assert_float64(out, weights, expected_out, expected_weights)
        assert normwise(out, expected_out) <= TOL
        assert normwise(weights, expected_weights) <= TOL


def test_params_from_jax_drive_torchref():
    """The way back: params made on the JAX side load into a torchref module and give the same output."""
    rng = np.random.default_rng(10)
    shapes = {"query": (E, 6, 7), "key": (KDIM, 2, 7), "value": (VDIM, 2, 11), "out": (6, 11, 13)}
    params = {
        name: {
            "kernel": jnp.asarray(rng.normal(size=shape)),
            "bias": jnp.asarray(rng.normal(size=shape[1:] if name != "out" else shape[2:])),
        }
        for name, shape in shapes.items()
    }
    state = cc.params_to_torch(params, format="torchref")
    m = torchref.MultiHeadAttention(
        E,
        6,
        7,
        key_features=KDIM,
        value_features=VDIM,
        out_features=13,
        num_kv_heads=2,
        value_head_dim=11,
        dtype=torch.float64,
    )
    m.load_state_dict(state, strict=True)
    assert_trees_close(cc.params_from_torch(state, num_heads=6, num_kv_heads=2), params, tol=0.0)
    q, k, v = inputs(E, KDIM, VDIM, seed=9)
    expected = m(*map(torch.tensor, (q, k, v))).detach().numpy()
    ours = jaxattn.multi_head_attention(params, q, k, v)
    assert_float64(ours, expected)
    assert normwise(ours, expected) <= TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtype_kept_both_ways(dtype):
    m = torch.nn.MultiheadAttention(E, 3, add_bias_kv=True, kdim=KDIM, vdim=VDIM, dtype=dtype)
    params = cc.params_from_torch(m)
    expected = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16}[dtype]
    assert all(leaf.dtype == expected for leaf in jax.tree.leaves(params))
    back = cc.params_to_torch(params, format="torch")
    for name, tensor in m.state_dict().items():
        assert back[name].dtype == dtype and torch.equal(back[name], tensor), name


# -------------------------------------------------------------------------------------------------- errors


def torch_state(**kwargs):
    return dict(torch.nn.MultiheadAttention(E, 3, **kwargs).state_dict())


def test_missing_key_is_named():
    state = torch_state()
    del state["in_proj_weight"]
    with pytest.raises(ValueError, match=r"missing \['in_proj_weight'\], unexpected \[\]"):
        cc.params_from_torch(state, num_heads=3)


def test_missing_key_between_two_layouts_lists_both():
    state = torch_state()
    del state["out_proj.bias"]
    with pytest.raises(ValueError) as err:
        cc.params_from_torch(state, num_heads=3)
    assert "missing ['out_proj.bias']" in str(err.value) and "unexpected ['in_proj_bias']" in str(err.value)


def test_unexpected_key_is_named():
    state = dict(make_torchref(TORCHREF_CASES[0]).state_dict())
    state["extra.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"unexpected \['extra.weight'\]"):
        cc.params_from_torch(state, num_heads=3)


def test_wrapped_state_dict_is_not_guessed():
    state = {"module." + name: t for name, t in torch_state().items()}
    with pytest.raises(ValueError, match="module.in_proj_weight"):
        cc.params_from_torch(state, num_heads=3)


def test_shape_mismatch_names_key_and_both_shapes():
    state = torch_state(kdim=KDIM, vdim=VDIM)
    state["k_proj_weight"] = torch.zeros(14, KDIM)
    with pytest.raises(ValueError, match=r"k_proj_weight: expected shape \(15, 7\), got \(14, 7\)"):
        cc.params_from_torch(state, num_heads=3)
    state = dict(make_torchref(TORCHREF_CASES[2]).state_dict())
    state["rel_key"] = torch.zeros(5, 4, 3)
    with pytest.raises(ValueError, match=r"rel_key: expected shape \(5, 5, 3\) or \(5, 3\), got \(5, 4, 3\)"):
        cc.params_from_torch(state, num_heads=5, num_kv_heads=1, value_head_dim=13)


def test_head_counts_required_for_a_state_dict():
    with pytest.raises(ValueError, match="num_heads="):
        cc.params_from_torch(torch_state())
    with pytest.raises(ValueError, match="not divisible"):
        cc.params_from_torch(torch_state(), num_heads=4)
    with pytest.raises(ValueError, match="read from the module"):
        cc.params_from_torch(torch.nn.MultiheadAttention(E, 3), num_heads=3)


def test_params_side_errors():
    params = cc.params_from_torch(torch.nn.MultiheadAttention(E, 3))
    del params["out"]["bias"]
    with pytest.raises(ValueError, match=r"missing \['out/bias'\]"):
        cc.params_to_torch(params, format="torch")
    params = cc.params_from_torch(torch.nn.MultiheadAttention(E, 3))
    params["query"]["bias"] = jnp.zeros((3, 4))
    with pytest.raises(ValueError, match=r"params\['query/bias'\]: expected shape \(3, 5\), got \(3, 4\)"):
        cc.params_to_torch(params, format="torch")
    params = cc.params_from_torch(make_torchref(TORCHREF_CASES[1]))  # grouped-query: torch MHA has K == N
    with pytest.raises(ValueError, match="K == 6"):
        cc.params_to_torch(params, format="torch")
    params = cc.params_from_torch(torch.nn.MultiheadAttention(E, 3, add_bias_kv=True))
    with pytest.raises(ValueError, match=r"unexpected \['bias_kv/key', 'bias_kv/value'\]"):
        cc.params_to_torch(params, format="torchref")
    with pytest.raises(ValueError, match="format"):
        cc.params_to_torch(params, format="flax")


def test_unsupported_module():
    with pytest.raises(ValueError, match="unsupported module Linear"):
        cc.params_from_torch(torch.nn.Linear(3, 3))


def test_float64_without_x64_is_refused():
    """With x64 off (jax.enable_x64(False): this thread only, this block only), float32 weights convert and
    float64 weights or masks are refused, not silently cast."""
    m = torch.nn.MultiheadAttention(15, 3)
    with jax.enable_x64(False):
        assert not jax.config.jax_enable_x64
        assert all(a.dtype == np.float32 for a in jax.tree.leaves(cc.params_from_torch(m)))
        for convert in (
            lambda: cc.params_from_torch(m.double()),
            lambda: cc.masks_from_torch(torch.zeros(5, 7, dtype=torch.float64)),
        ):
            with pytest.raises(ValueError, match="jax_enable_x64"):
                convert()
    assert jax.config.jax_enable_x64
