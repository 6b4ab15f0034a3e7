"""The Flax layers with window / chunk_size / logit_softcap (attributes), learned sinks (use_sinks) and segment
ids (call arguments): the layer equals the functional API on its own params tree, and token-by-token decoding
with the cache equals one full causal pass (float64, 1e-12)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxattn
import jaxattn.linen as jl
import jaxattn.nnx as jx
from helpers import assert_float64, normwise

B, T, E, N, K, H = 2, 7, 13, 6, 3, 5
TOL = 1e-12
LAYER = dict(window=(3, 0), chunk_size=5, logit_softcap=1.3, use_sinks=True)


def random_sinks(params, seed=1):
    """Replace the zero-initialised sinks by random ones, so they matter."""
    return {**params, "sinks": jnp.asarray(np.random.default_rng(seed).normal(size=(N,)))}


def functional(params, x, **kw):
    return jaxattn.multi_head_attention(params, x, window=(3, 0), chunk_size=5, logit_softcap=1.3, **kw)


def test_linen_layer_is_the_function_and_decodes():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(B, T, E)))
    layer = jl.MultiHeadAttention(num_heads=N, num_kv_heads=K, head_dim=H, param_dtype=jnp.float64, **LAYER)
    params = layer.init(jax.random.key(0), x)["params"]
    assert params["sinks"].shape == (N,)
    params = random_sinks(params)
    seg = jnp.asarray([[0, 0, 0, 1, 1, 1, 1], [2] * 7])
    y = layer.apply({"params": params}, x, is_causal=True, query_segment_ids=seg, key_segment_ids=seg)
    assert_float64(y)
    assert normwise(y, functional(params, x, is_causal=True, query_segment_ids=seg, key_segment_ids=seg)) <= TOL

    full = layer.apply({"params": params}, x, is_causal=True)
    cache = layer.init(jax.random.key(1), jnp.zeros((B, T, E)), decode=True)["cache"]
    step = jax.jit(lambda variables, xs: layer.apply(variables, xs, decode=True, mutable=["cache"]))
    y, state = step({"params": params, "cache": cache}, x[:, :2])  # prefill of 2
    outs = [y]
    for t in range(2, T):
        y, state = step({"params": params, **state}, x[:, t : t + 1])
        outs.append(y)
    assert_float64(outs, full)
    assert normwise(jnp.concatenate(outs, axis=1), full) <= TOL


def test_nnx_layer_is_the_function_and_decodes():
    x = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, E)))
    layer = jx.MultiHeadAttention(E, N, H, num_kv_heads=K, param_dtype=jnp.float64, rngs=nnx.Rngs(0), **LAYER)
    layer.sinks[...] = random_sinks({}, seed=3)["sinks"]
    params = layer.params()
    assert params["sinks"].shape == (N,)
    full = layer(x, is_causal=True)
    assert_float64(full)
    assert normwise(full, functional(params, x, is_causal=True)) <= TOL
    layer.init_cache((B, T, E), jnp.float64)
    outs = [layer(x[:, t : t + 1], decode=True) for t in range(T)]
    assert normwise(jnp.concatenate(outs, axis=1), full) <= TOL


def test_sinks_get_gradients_through_the_layer():
    x = jnp.asarray(np.random.default_rng(4).normal(size=(B, T, E)))
    layer = jl.MultiHeadAttention(num_heads=N, num_kv_heads=K, head_dim=H, param_dtype=jnp.float64, use_sinks=True)
    params = random_sinks(layer.init(jax.random.key(0), x)["params"])
    loss = jax.jit(lambda p: jnp.sum(layer.apply({"params": p}, x, is_causal=True) ** 2))
    g = jax.jit(jax.grad(loss))(params)
    eps = 1e-6  # central difference in float64: error ~ eps^2
    up, down = ({**params, "sinks": params["sinks"].at[2].add(d)} for d in (eps, -eps))
    numeric = float(loss(up) - loss(down)) / (2 * eps)
    assert abs(float(g["sinks"][2]) - numeric) <= 1e-7 * max(1.0, abs(numeric))


def test_learned_sinks_and_keyword_are_exclusive():
    params = jaxattn.init_multi_head_attention(jax.random.key(0), E, num_heads=N, head_dim=H, dtype=jnp.float64)
    params["sinks"] = jnp.zeros((N,))
    x = jnp.zeros((B, T, E))
    with pytest.raises(ValueError, match="sinks"):
        jaxattn.multi_head_attention(params, x, sinks=jnp.zeros((N,)))
    params["sinks"] = jnp.zeros((N + 1,))
    with pytest.raises(ValueError, match=r"params\['sinks'\]"):
        jaxattn.multi_head_attention(params, x)


@pytest.mark.parametrize("flavour", ["linen", pytest.param("nnx", marks=pytest.mark.slow)])
def test_rolling_cache_holds_the_window_only(flavour):
    """window (3, 0): the cache keeps 3 slots, whatever the max length; prefill of 4 with per-example
    lengths, then steps: equal to the full causal pass of each example's real tokens."""
    L = 11
    x = jnp.asarray(np.random.default_rng(5).normal(size=(B, L, E)))
    kw = dict(window=(3, 0), logit_softcap=2.0, use_sinks=True)
    if flavour == "linen":
        layer = jl.MultiHeadAttention(num_heads=N, num_kv_heads=K, head_dim=H, param_dtype=jnp.float64, **kw)
        params = random_sinks(layer.init(jax.random.key(0), x)["params"])
        cache = layer.init(jax.random.key(1), jnp.zeros((B, L, E)), decode=True)["cache"]
        assert cache["cached_key"].shape == (B, 3, K, H)
        state = {"cache": cache}
        apply = jax.jit(
            lambda variables, xs, lengths: layer.apply(
                variables, xs, decode=True, key_value_seq_lengths=lengths, mutable=["cache"]
            )
        )

        def step(xs, lengths=None):
            nonlocal state
            y, state = apply({"params": params, **state}, xs, lengths)
            return y

        full = layer.apply({"params": params}, x, is_causal=True)
    else:
        layer = jx.MultiHeadAttention(E, N, H, num_kv_heads=K, param_dtype=jnp.float64, rngs=nnx.Rngs(0), **kw)
        layer.sinks[...] = random_sinks({}, seed=6)["sinks"]
        layer.init_cache((B, L, E), jnp.float64)
        assert layer.cached_key[...].shape == (B, 3, K, H)
        full = layer(x, is_causal=True)

        def step(xs, lengths=None):
            return layer(xs, decode=True, key_value_seq_lengths=lengths)

    # prefill 4 tokens, example 1 has only 2 real ones: it continues from token 2 (x[1, 2:] shifted in)
    lengths = jnp.asarray([4, 2])
    y0 = step(x[:, :4], lengths)
    assert_float64(y0, full)
    assert normwise(y0[0], full[0, :4]) <= TOL and normwise(y0[1, :2], full[1, :2]) <= TOL
    outs = {0: [y0[0]], 1: [y0[1, :2]]}
    for i in range(L - 4):
        both = jnp.stack([x[0, 4 + i], x[1, 2 + i]])[:, None]
        y = step(both)
        outs[0].append(y[0])
        outs[1].append(y[1])
    assert normwise(jnp.concatenate(outs[0]), full[0, :L]) <= TOL
    assert normwise(jnp.concatenate(outs[1]), full[1, : L - 2]) <= TOL


def test_full_cache_with_chunks_softcap_and_sinks():
    """No window: the ordinary cache (L slots); chunks, softcap and sinks read the cache's absolute positions."""
    x = jnp.asarray(np.random.default_rng(7).normal(size=(B, T, E)))
    layer = jx.MultiHeadAttention(
        E,
        N,
        H,
        num_kv_heads=K,
        param_dtype=jnp.float64,
        rngs=nnx.Rngs(1),
        chunk_size=3,
        logit_softcap=0.9,
        use_sinks=True,
    )
    layer.sinks[...] = random_sinks({}, seed=8)["sinks"]
    full = layer(x, is_causal=True)
    layer.init_cache((B, T, E), jnp.float64)
    assert layer.cached_key[...].shape == (B, T, K, H)
    outs = [layer(x[:, :3], decode=True)] + [layer(x[:, t : t + 1], decode=True) for t in range(3, T)]
    assert_float64(outs, full)
    assert normwise(jnp.concatenate(outs, axis=1), full) <= TOL
