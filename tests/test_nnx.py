"""jaxattn.nnx layers: the same numbers as the functional API (plain, nnx.jit, nnx.vmap, nnx.grad), torchref
within docs/design.md, "Tolerances", flax.nnx.MultiHeadAttention's parameters load, dropout through rng streams.

Axes: B=3, T=5, S=7, N=6, H=11, Hv=13, Eq=17, Ek=19, Ev=23, Eo=29 (as tests/test_linen.py).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import crosscheck
import jaxattn
import jaxattn.nnx as jx
import torchref
from helpers import assert_float64, normwise

B, T, S, N, H, Hv, Eq, Ek, Ev, Eo = 3, 5, 7, 6, 11, 13, 17, 19, 23, 29
MAX_DISTANCE = 2
CHEAP_INIT = nn.initializers.normal(0.3)  # eager truncated-normal compiles are slow; any init will do here


def _inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    return (
        rng.standard_normal((B, T, Eq)).astype(dtype),
        rng.standard_normal((B, S, Ek)).astype(dtype),
        rng.standard_normal((B, S, Ev)).astype(dtype),
    )


def _layer(relative, K, dtype, **kw):
    kw = dict(
        head_dim=H,
        key_features=Ek,
        value_features=Ev,
        out_features=Eo,
        num_kv_heads=K,
        value_head_dim=Hv,
        param_dtype=dtype,
        kernel_init=CHEAP_INIT,
        bias_init=CHEAP_INIT,
        rngs=nnx.Rngs(0),
        **kw,
    )
    if relative:
        return jx.RelativeMultiHeadAttention(Eq, N, max_distance=MAX_DISTANCE, **kw)
    return jx.MultiHeadAttention(Eq, N, **kw)


def _functional(relative):
    return jaxattn.relative_multi_head_attention if relative else jaxattn.multi_head_attention


# Pairwise cover: float64 plain GQA in the default run (the linen layer's tests hold the relative kind in the
# default group), the other three in the slow group.
@pytest.mark.parametrize(
    "dtype, relative, K",
    [
        (np.float64, False, 2),
        pytest.param(np.float32, True, 6, marks=pytest.mark.slow),
        pytest.param(np.float64, True, 1, marks=pytest.mark.slow),
        pytest.param(np.float32, False, 3, marks=pytest.mark.slow),
    ],
)
def test_module_equals_functional_exactly(dtype, relative, K):
    q, k, v = _inputs(dtype)
    layer = _layer(relative, K, dtype)
    params = layer.params()
    assert params == nnx.to_pure_dict(nnx.state(layer, nnx.Param))  # the state IS docs/design.md, "The parameter tree"
    assert all(p.dtype == dtype for p in jax.tree.leaves(params))
    lengths = np.array([7, 2, 5])
    got = nnx.jit(lambda m: m(q, k, v, is_causal=True, key_value_seq_lengths=lengths))(layer)
    assert got.dtype == dtype
    np.testing.assert_array_equal(
        got, jax.jit(lambda p: _functional(relative)(p, q, k, v, is_causal=True, key_value_seq_lengths=lengths))(params)
    )

    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(q, k, v, is_causal=True) ** 2)))(layer)
    want_grads = jax.jit(jax.grad(lambda p: jnp.sum(_functional(relative)(p, q, k, v, is_causal=True) ** 2)))(params)
    for got_g, want_g in zip(jax.tree.leaves(nnx.to_pure_dict(grads)), jax.tree.leaves(want_grads)):
        assert got_g.dtype == dtype
        np.testing.assert_array_equal(got_g, want_g)


def test_plain_call_and_nnx_vmap():
    q, k, v = _inputs(np.float64)
    layer = _layer(False, 2, np.float64)
    want = jaxattn.multi_head_attention(layer.params(), q, k, v, is_causal=True)
    np.testing.assert_array_equal(layer(q, k, v, is_causal=True), want)
    per_example = nnx.vmap(lambda m, a, b, c: m(a, b, c, is_causal=True), in_axes=(None, 0, 0, 0))(layer, q, k, v)
    assert_float64(per_example, want)
    assert normwise(per_example, want) <= 1e-14
    # an ensemble: nnx.vmap over layers created with different keys
    ensemble = nnx.vmap(
        lambda key: jx.MultiHeadAttention(Eq, N, head_dim=H, param_dtype=jnp.float64, rngs=nnx.Rngs(key))
    )(jax.random.split(jax.random.key(0), 2))
    outs = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(ensemble, q)
    assert outs.shape == (2, B, T, Eq) and not np.allclose(outs[0], outs[1])
    first = jax.tree.map(lambda p: p[0], nnx.to_pure_dict(nnx.state(ensemble, nnx.Param)))
    assert normwise(outs[0], jaxattn.multi_head_attention(first, q)) <= 1e-14


@pytest.mark.parametrize("relative", [pytest.param(False, marks=pytest.mark.slow), True])
def test_against_torchref_modules(relative):
    torch.manual_seed(0)
    kwargs = dict(
        head_dim=H,
        num_kv_heads=3,
        value_head_dim=Hv,
        key_features=Ek,
        value_features=Ev,
        out_features=Eo,
        dtype=torch.float64,
    )
    ref = (
        torchref.RelativeMultiHeadAttention(Eq, N, max_distance=MAX_DISTANCE, **kwargs)
        if relative
        else torchref.MultiHeadAttention(Eq, N, **kwargs)
    )
    layer = _layer(relative, 3, np.float64)
    nnx.update(layer, crosscheck.params_from_torch(ref))  # a converted torch module drops straight in
    q, k, v = _inputs(np.float64)
    want = ref(*(torch.from_numpy(a) for a in (q, k, v)), is_causal=True).detach().numpy()
    got = layer(q, k, v, is_causal=True)
    assert_float64(got, want)
    assert normwise(got, want) <= 1e-12


@pytest.mark.parametrize("K", [pytest.param(N, marks=pytest.mark.slow), 2])
def test_flax_nnx_parameters_load_into_ours(K):
    # Without dropout flax.nnx attends through jax.nn.dot_product_attention, whose softmax runs in float32
    # even for float64 inputs: flax is the less precise side, hence float32's bar (linen's own layer is
    # float64-exact and is held to 1e-13 in tests/test_linen.py).
    tolerance = 1e-6
    q, k, _ = _inputs(np.float64)
    k = k[..., :Eq]
    flax_layer = nnx.MultiHeadAttention(
        N,
        Eq,
        qkv_features=N * H,
        out_features=Eo,
        num_kv_heads=K,
        param_dtype=jnp.float64,
        decode=False,
        rngs=nnx.Rngs(3),
    )
    ours = jx.MultiHeadAttention(
        Eq,
        N,
        head_dim=H,
        out_features=Eo,
        num_kv_heads=K,
        param_dtype=jnp.float64,
        kernel_init=CHEAP_INIT,
        rngs=nnx.Rngs(0),
    )
    nnx.update(ours, nnx.to_pure_dict(nnx.state(flax_layer, nnx.Param)))
    mask = np.tril(np.ones((T, S), bool), S - T)
    got = ours(q, k, mask=mask)
    assert_float64(got)
    assert normwise(got, flax_layer(q, k, mask=mask)) <= tolerance


def test_dropout_with_rng_streams_and_eval_train():
    q, _, _ = _inputs(np.float64)
    layer = jx.MultiHeadAttention(
        Eq,
        N,
        head_dim=H,
        dropout_rate=0.4,
        param_dtype=jnp.float64,
        kernel_init=CHEAP_INIT,
        rngs=nnx.Rngs(params=0, dropout=1),
    )
    with pytest.raises(ValueError, match="deterministic"):
        layer(q)
    plain = jaxattn.multi_head_attention(layer.params(), q)
    np.testing.assert_array_equal(layer(q, deterministic=True), plain)
    layer.train()
    a, b = layer(q), layer(q)  # the forked "dropout" stream advances: two different masks
    assert not np.allclose(a, b) and not np.allclose(a, plain)
    np.testing.assert_array_equal(layer(q, rngs=nnx.Rngs(dropout=9)), layer(q, rngs=nnx.Rngs(dropout=9)))
    key = jax.random.key(4)
    np.testing.assert_array_equal(
        layer(q, dropout_rng=key), jaxattn.multi_head_attention(layer.params(), q, dropout_rate=0.4, dropout_rng=key)
    )
    layer.eval()
    np.testing.assert_array_equal(layer(q), plain)
    np.testing.assert_array_equal(
        nnx.jit(lambda m: m(q))(layer), jax.jit(jaxattn.multi_head_attention)(layer.params(), q)
    )


@pytest.mark.slow  # linen's test_dtype_and_param_dtype runs the shared code in the default group
def test_dtype_param_dtype_and_initialisers():
    layer = jx.RelativeMultiHeadAttention(
        Eq,
        N,
        H,
        max_distance=1,
        share_heads=True,
        param_dtype=jnp.bfloat16,
        dtype=jnp.float32,
        kernel_init=nn.initializers.ones,
        out_kernel_init=nn.initializers.constant(2.0),
        table_init=nn.initializers.constant(4.0),
        rngs=nnx.Rngs(0),
    )
    params = layer.params()
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
    assert params["relative"]["key"].shape == (3, H)
    np.testing.assert_array_equal(params["query"]["kernel"], 1.0)
    np.testing.assert_array_equal(params["out"]["kernel"], 2.0)
    np.testing.assert_array_equal(params["relative"]["value"], 4.0)
    q = np.random.default_rng(0).standard_normal((B, T, Eq)).astype(np.float32)
    assert layer(q).dtype == jnp.float32


def test_decode_without_cache_raises():
    layer = jx.MultiHeadAttention(Eq, N, head_dim=H, kernel_init=CHEAP_INIT, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="init_cache"):
        layer(np.zeros((1, 2, Eq), np.float32), decode=True)
