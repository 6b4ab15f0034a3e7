"""jaxattn.linen layers: the same numbers as the functional API, torchref within the bar of docs/design.md,
"Tolerances", flax interop.

Axes have distinct prime sizes: B=3, T=5, S=7, N=6 heads (not prime: it must hold K=2 and K=3 groups),
H=11, Hv=13, Eq=17, Ek=19, Ev=23, Eo=29. float64 runs need x64 (tests/conftest.py turns it on).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import crosscheck
import jaxattn
import jaxattn.linen as jl
import torchref
from helpers import assert_float64, normwise

B, T, S, N, H, Hv, Eq, Ek, Ev, Eo = 3, 5, 7, 6, 11, 13, 17, 19, 23, 29
MAX_DISTANCE = 2


def _inputs(dtype, cross=True, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, Eq)).astype(dtype)
    if not cross:
        return q, None, None
    return q, rng.standard_normal((B, S, Ek)).astype(dtype), rng.standard_normal((B, S, Ev)).astype(dtype)


def _layer(relative, K, **kw):
    common = dict(num_heads=N, head_dim=H, num_kv_heads=K, value_head_dim=Hv, out_features=Eo, **kw)
    if relative:
        return jl.RelativeMultiHeadAttention(max_distance=MAX_DISTANCE, **common)
    return jl.MultiHeadAttention(**common)


def _functional(relative):
    return jaxattn.relative_multi_head_attention if relative else jaxattn.multi_head_attention


# (dtype, relative, K, masking): a pairwise cover (each head layout, masking and dtype with both attention kinds)
# rather than the full product, as every case compiles forward and backward twice; the default group runs two
# of it (one of each kind and dtype), the slow group the rest.
CASES = [
    pytest.param(np.float32, False, 6, "none", marks=pytest.mark.slow),
    (np.float64, False, 2, "causal"),
    pytest.param(np.float64, True, 6, "causal", marks=pytest.mark.slow),
    (np.float32, True, 2, "mask+lengths"),
    pytest.param(np.float64, True, 1, "none", marks=pytest.mark.slow),
    pytest.param(np.float64, False, 6, "mask+lengths", marks=pytest.mark.slow),
    pytest.param(np.float32, True, 2, "causal", marks=pytest.mark.slow),
    pytest.param(np.float32, False, 1, "mask+lengths", marks=pytest.mark.slow),
]


def _masking(masking):
    if masking == "causal":
        return {"is_causal": True}
    if masking == "mask+lengths":
        return {
            "mask": np.random.default_rng(2).random((B, 1, T, S)) < 0.7,
            "key_value_seq_lengths": np.array([7, 4, 1]),
        }
    return {}


def _random_params(layer, *args, dtype, seed=3):
    """Params of the layer's own tree (shapes from eval_shape: nothing compiled), filled from numpy."""
    shapes = jax.eval_shape(layer.init, jax.random.key(0), *args)["params"]
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda s: jnp.asarray((rng.standard_normal(s.shape) * 0.3).astype(dtype)), shapes)


def output_and_grad(f):
    """jit(params -> (f(params), d sum(f^2) / d params)): forward and backward in one compilation."""

    def loss(p):
        out = f(p)
        return jnp.sum(out**2), out

    return jax.jit(lambda p: jax.grad(loss, has_aux=True)(p)[::-1])


@pytest.mark.parametrize("dtype, relative, K, masking", CASES)
def test_module_equals_functional_exactly(dtype, relative, K, masking):
    """Same numbers, forward and gradients, under jit (the eager path is test_self_attention_...)."""
    q, k, v = _inputs(dtype)
    layer = _layer(relative, K, param_dtype=dtype)
    params = _random_params(layer, q, k, v, dtype=dtype)
    options = _masking(masking)
    out, grads = output_and_grad(lambda p: layer.apply({"params": p}, q, k, v, **options))(params)
    want, want_grads = output_and_grad(lambda p: _functional(relative)(p, q, k, v, **options))(params)
    assert out.dtype == dtype and out.shape == (B, T, Eo)
    np.testing.assert_array_equal(out, want)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
        assert got.dtype == dtype
        np.testing.assert_array_equal(got, expected)


def test_self_attention_defaults_and_weights():
    q, _, _ = _inputs(np.float64, cross=False)
    layer = jl.MultiHeadAttention(num_heads=N, head_dim=H, num_kv_heads=3, param_dtype=jnp.float64)
    params = layer.init(jax.random.key(0), q)["params"]
    assert params["query"]["kernel"].shape == (Eq, N, H) and params["out"]["kernel"].shape == (N, H, Eq)
    out, weights = layer.apply({"params": params}, q, is_causal=True, return_weights=True)
    want, want_weights = jaxattn.multi_head_attention(params, q, is_causal=True, return_weights=True)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(weights, want_weights)
    np.testing.assert_array_equal(np.triu(np.asarray(weights[0, 0]), 1), 0)  # bottom-right causal, T == S


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("relative", [False, True])
def test_against_torchref_modules(dtype, relative):
    torch.manual_seed(0)
    kwargs = dict(
        head_dim=H,
        num_kv_heads=2,
        value_head_dim=Hv,
        key_features=Ek,
        value_features=Ev,
        out_features=Eo,
        dtype=getattr(torch, dtype),
    )
    if relative:
        ref = torchref.RelativeMultiHeadAttention(Eq, N, max_distance=MAX_DISTANCE, **kwargs)
    else:
        ref = torchref.MultiHeadAttention(Eq, N, **kwargs)
    params = jax.tree.map(jnp.asarray, crosscheck.params_from_torch(ref))
    q, k, v = _inputs(dtype)
    lengths = np.array([7, 3, 5])
    want = (
        ref(*(torch.from_numpy(a) for a in (q, k, v)), is_causal=True, key_value_seq_lengths=torch.from_numpy(lengths))
        .detach()
        .numpy()
    )
    layer = _layer(relative, 2, param_dtype=dtype, precision="highest")
    got = jax.jit(lambda p: layer.apply({"params": p}, q, k, v, is_causal=True, key_value_seq_lengths=lengths))(params)
    assert got.dtype == dtype
    assert normwise(got, want) <= (1e-12 if dtype == "float64" else 1e-6)


def test_our_params_run_in_flax_and_flax_params_run_in_ours():
    q, _, _ = _inputs(np.float64, cross=False)
    mask = np.tril(np.ones((T, T), bool))
    ours = jl.MultiHeadAttention(num_heads=N, param_dtype=jnp.float64, head_dim=H)
    theirs = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=N * H, param_dtype=jnp.float64)
    our_params = ours.init(jax.random.key(0), q)["params"]
    their_params = theirs.init(jax.random.key(1), q)["params"]
    assert jax.tree.structure(our_params) == jax.tree.structure(their_params)
    assert jax.tree.map(jnp.shape, our_params) == jax.tree.map(jnp.shape, their_params)
    for params in (our_params, their_params):
        got = ours.apply({"params": params}, q, mask=mask)
        want = theirs.apply({"params": params}, q, mask=mask)
        assert_float64(got, want)
        assert normwise(got, want) <= 1e-13


def test_dropout_the_flax_way():
    q, _, _ = _inputs(np.float64, cross=False)
    layer = jl.MultiHeadAttention(num_heads=N, head_dim=H, dropout_rate=0.4, param_dtype=jnp.float64)
    params = layer.init(jax.random.key(0), q, deterministic=True)["params"]
    with pytest.raises(ValueError, match="deterministic"):
        layer.apply({"params": params}, q)
    plain = jaxattn.multi_head_attention(params, q)
    np.testing.assert_array_equal(layer.apply({"params": params}, q, deterministic=True), plain)
    a = layer.apply({"params": params}, q, deterministic=False, rngs={"dropout": jax.random.key(5)})
    b = layer.apply({"params": params}, q, deterministic=False, rngs={"dropout": jax.random.key(5)})
    c = layer.apply({"params": params}, q, deterministic=False, rngs={"dropout": jax.random.key(6)})
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, c) and not np.allclose(a, plain)
    key = jax.random.key(7)  # an explicit dropout_rng reproduces the functional call exactly
    np.testing.assert_array_equal(
        layer.apply({"params": params}, q, deterministic=False, dropout_rng=key),
        jaxattn.multi_head_attention(params, q, dropout_rate=0.4, dropout_rng=key),
    )
    fixed = jl.MultiHeadAttention(num_heads=N, head_dim=H, dropout_rate=0.4, deterministic=True)
    np.testing.assert_array_equal(fixed.apply({"params": params}, q), plain)


def test_dtype_and_param_dtype():
    q = np.random.default_rng(0).standard_normal((B, T, Eq)).astype(np.float32)
    layer = jl.MultiHeadAttention(num_heads=N, head_dim=H, param_dtype=jnp.bfloat16, dtype=jnp.float32)
    params = layer.init(jax.random.key(0), q)["params"]
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
    out = layer.apply({"params": params}, q)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(
        out, jaxattn.multi_head_attention(jax.tree.map(lambda p: p.astype(jnp.float32), params), q)
    )
    half = jl.MultiHeadAttention(num_heads=N, head_dim=H, param_dtype=jnp.bfloat16)  # dtype None: promote
    assert half.apply({"params": params}, q.astype(jnp.bfloat16)).dtype == jnp.bfloat16


def test_initialisers_can_be_overridden():
    q, k, v = _inputs(np.float32)
    layer = jl.RelativeMultiHeadAttention(
        num_heads=N,
        head_dim=H,
        max_distance=MAX_DISTANCE,
        kernel_init=nn.initializers.ones,
        out_kernel_init=nn.initializers.constant(2.0),
        bias_init=nn.initializers.constant(3.0),
        table_init=nn.initializers.constant(4.0),
        share_heads=True,
    )
    params = layer.init(jax.random.key(0), q, k, v)["params"]
    assert params["relative"]["key"].shape == (2 * MAX_DISTANCE + 1, H)
    for name in ("query", "key", "value"):
        np.testing.assert_array_equal(params[name]["kernel"], 1.0)
    np.testing.assert_array_equal(params["out"]["kernel"], 2.0)
    np.testing.assert_array_equal(params["query"]["bias"], 3.0)
    np.testing.assert_array_equal(params["relative"]["value"], 4.0)


def test_default_kernels_use_the_flat_fan_in():
    x = np.zeros((1, 2, 400), np.float32)
    params = jl.MultiHeadAttention(num_heads=4, head_dim=50).init(jax.random.key(0), x)["params"]
    # lecun_normal on [fan_in, fan_out]: std 1/sqrt(400) for query (Eq=400), 1/sqrt(200) for out (N*Hv=200)
    assert abs(np.std(params["query"]["kernel"]) * 20 - 1) < 0.05
    assert abs(np.std(params["out"]["kernel"]) * np.sqrt(200) - 1) < 0.05
    np.testing.assert_array_equal(params["query"]["bias"], 0.0)


def test_torch_extras_bias_kv_and_zero_attn():
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(
        Eq + 1, 6, add_bias_kv=True, add_zero_attn=True, batch_first=True, dtype=torch.float64
    )
    params = jax.tree.map(jnp.asarray, crosscheck.params_from_torch(ref))
    x = np.random.default_rng(0).standard_normal((B, T, Eq + 1))
    want = ref(*(torch.from_numpy(x),) * 3, need_weights=False)[0].detach().numpy()
    layer = jl.MultiHeadAttention(num_heads=6, add_bias_kv=True, add_zero_attn=True, param_dtype=jnp.float64)
    assert jax.tree.structure(layer.init(jax.random.key(0), x)["params"]) == jax.tree.structure(params)
    got = layer.apply({"params": params}, x)
    assert_float64(got, want)
    assert normwise(got, want) <= 1e-12


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: jl.RelativeMultiHeadAttention(num_heads=2), "max_distance"),
        (lambda: jl.MultiHeadAttention(num_heads=4, num_kv_heads=3), "num_kv_heads"),
        (lambda: jl.MultiHeadAttention(num_heads=5), "head_dim"),
        (
            lambda: jl.RelativeMultiHeadAttention(
                num_heads=2, max_distance=1, use_key_table=False, use_value_table=False
            ),
            "use_key_table",
        ),
    ],
)
def test_bad_configuration_raises(make, match):
    with pytest.raises(ValueError, match=match):
        make().init(jax.random.key(0), np.zeros((1, 3, 8), np.float32))


def test_force_fp32_for_softmax_returns_float32_weights_as_flax():
    """flax's force_fp32_for_softmax=True with dtype=bfloat16: the weights come back (and are sown) in float32,
    as flax.linen.MultiHeadDotProductAttention's sown weights. Values: within three bfloat16 roundings of flax's
    (bar 1e-2, as tests/peers/test_flax_linen.py's; flax rounds its logits to bfloat16; measured 2.4e-3), and
    within one bfloat16 rounding (2**-8) of the float64 softmax of the same bfloat16 query and key heads
    (flax's own projections, captured), as flax's are (measured 1.6e-3, flax's 1.9e-3). Unset (None): the
    weights stay in the computation dtype; a float64 layer keeps float64 weights (never narrowed to float32)."""
    kw = dict(num_heads=N, qkv_features=N * H, dtype=jnp.bfloat16, param_dtype=jnp.float32, deterministic=True)
    theirs = nn.MultiHeadDotProductAttention(force_fp32_for_softmax=True, **kw)
    ours = jl.MultiHeadAttention(force_fp32_for_softmax=True, **kw)
    x = _inputs(np.float32, cross=False, seed=3)[0]
    variables = theirs.init(jax.random.key(0), x)
    _, sown = theirs.apply(variables, x, sow_weights=True, capture_intermediates=True, mutable=["intermediates"])
    want = sown["intermediates"]["attention_weights"][0]
    (q,), (k,) = (sown["intermediates"][name]["__call__"] for name in ("query", "key"))
    exact = nn.dot_product_attention_weights(q.astype(jnp.float64), k.astype(jnp.float64))
    (_, got), ours_sown = ours.apply(variables, x, return_weights=True, sow_weights=True, mutable=["intermediates"])
    (got_sown,) = ours_sown["intermediates"]["attention_weights"]
    assert want.dtype == got.dtype == got_sown.dtype == jnp.float32
    np.testing.assert_array_equal(got_sown, got)
    assert normwise(got, want) <= 1e-2, normwise(got, want)
    for weights in (got, want):
        assert normwise(weights, exact) <= 2**-8, normwise(weights, exact)
    assert ours.clone(force_fp32_for_softmax=None).apply(variables, x, return_weights=True)[1].dtype == jnp.bfloat16
    wide = jl.MultiHeadAttention(force_fp32_for_softmax=True, **{**kw, "dtype": jnp.float64})
    assert wide.apply(variables, x, return_weights=True)[1].dtype == jnp.float64
