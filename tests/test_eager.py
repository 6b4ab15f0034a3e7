"""Eager calls compiled whole (jaxattn._core.eager): a public function called on concrete arrays runs as one
jitted program per signature, with the results of the function itself; callables, values neither traced
nor hashable, and calls inside jax.jit stay unwrapped."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from helpers import arrays, normwise

B, T, S, N, K, H = 2, 5, 7, 6, 3, 11


def qkv(seed):
    return arrays(seed, (B, T, N, H), (B, S, K, H), (B, S, K, H))


def compiles(caplog, call):
    """(call's result, the programs it compiled)."""
    caplog.clear()
    with caplog.at_level(logging.WARNING), jax.log_compiles():
        out = jax.block_until_ready(call())
    return out, [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]


def test_an_eager_call_is_one_program_with_the_functions_results(caplog):
    q, k, v = qkv(0)
    q = q[:, :, :, :7]  # a shape of its own in this session, so nothing is cached yet
    k, v = k[..., :7], v[..., :7]
    out, programs = compiles(caplog, lambda: jaxattn.dot_product_attention(q, k, v, is_causal=True, window=(3, 0)))
    _, unwrapped = compiles(
        caplog, lambda: jaxattn.dot_product_attention.__wrapped__(q, k, v, is_causal=True, window=(2, 1))
    )
    assert len(programs) == 1 and "jit(call)" in programs[0]
    assert len(unwrapped) > 1  # without the wrapper the same call runs op by op: a program per operation
    jitted = jax.jit(lambda q, k, v: jaxattn.dot_product_attention(q, k, v, is_causal=True, window=(3, 0)))(q, k, v)
    assert np.array_equal(out, jitted)  # the same program
    _, again = compiles(caplog, lambda: jaxattn.dot_product_attention(q, k, v, is_causal=True, window=(3, 0)))
    assert again == []  # the same signature: the cached program


def test_gradients_and_vmap_without_jit_equal_the_jitted_ones():
    q, k, v = qkv(1)

    def loss(q, k, v):
        return jnp.sum(jnp.tanh(jaxattn.dot_product_attention(q, k, v, is_causal=True)))

    eager = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    jitted = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(eager, jitted):
        assert normwise(a, b) <= 1e-15
    mapped = jax.vmap(lambda q, k, v: jaxattn.dot_product_attention(q, k, v, is_causal=True))(q, k, v)
    assert normwise(mapped, jaxattn.dot_product_attention(q, k, v, is_causal=True)) <= 1e-15


def test_inside_jit_the_function_is_called_directly():
    q, k, v = qkv(2)
    jaxpr = jax.make_jaxpr(lambda q, k, v: jaxattn.dot_product_attention(q, k, v))(q, k, v)
    assert "name=call" not in str(jaxpr)


def test_a_callable_is_read_at_every_call():
    """score_mod reads a global: a program cached by the function's identity would keep the first value."""
    q, k, v = qkv(3)
    shift = {"value": 0.0}

    def score_mod(score, b, n, t, s):
        return score + shift["value"] * (s == 0)

    first = jaxattn.flex_attention(q, k, v, score_mod)
    shift["value"] = 5.0
    second = jaxattn.flex_attention(q, k, v, score_mod)
    direct = jaxattn.flex_attention(q, k, v, lambda score, b, n, t, s: score + 5.0 * (s == 0))
    assert normwise(second, direct) <= 1e-15 and normwise(first, second) > 1e-3


def test_static_values_are_keyed_by_type_and_checked_every_time():
    q, k, v = qkv(4)
    jaxattn.dot_product_attention(q, k, v, implementation="blockwise", block_size=2)
    with pytest.raises(ValueError, match="block_size"):
        jaxattn.dot_product_attention(q, k, v, implementation="blockwise", block_size=2.0)  # 2.0 == 2 in Python
    # numpy scalars stand for Python numbers (static), as the checks accept them; a jax scalar is refused
    ok = jaxattn.dot_product_attention(q, k, v, logit_softcap=np.float64(3.0), chunk_size=np.int64(2))
    assert normwise(ok, jaxattn.dot_product_attention(q, k, v, logit_softcap=3.0, chunk_size=2)) == 0
    with pytest.raises(ValueError, match="logit_softcap"):
        jaxattn.dot_product_attention(q, k, v, logit_softcap=jnp.float64(3.0))
    # a list (unhashable) runs unwrapped, as before
    listed = jaxattn.dot_product_attention(q, k, v, is_causal=True, window=[2, 0])
    assert normwise(listed, jaxattn.dot_product_attention(q, k, v, is_causal=True, window=(2, 0))) <= 1e-15


@pytest.mark.slow  # eager MLA, op by op: 8 s; the layers' eager check is tests/test_cache.py::test_decode_errors
def test_decode_caches_keep_their_eager_overflow_check():
    """A cache's index is checked against its length when known (ValueError eagerly, NaN inside jit): calls
    with a cache run unwrapped, so the eager check stays (the layers' and MLA's)."""
    params = jaxattn.init_latent_attention(
        jax.random.key(0), 13, 3, latent_dim=7, rope_dim=4, nope_head_dim=5, value_head_dim=6, dtype=jnp.float64
    )
    x = arrays(5, (2, 3, 13))[0]
    cache = jaxattn.init_latent_cache((2,), 4, 7, 4, jnp.float64)
    _, cache = jaxattn.latent_attention(params, x, cache=cache)  # 3 of 4 slots filled
    with pytest.raises(ValueError, match="room in the cache"):
        jaxattn.latent_attention(params, x[:, :2], cache=cache)
    stepped = jax.jit(lambda p, x, c: jaxattn.latent_attention(p, x, cache=c)[0])(params, x[:, :2], cache)
    assert bool(jnp.all(jnp.isnan(stepped)))  # inside jit: the overflowing example's output is NaN
