"""Key/value cache decoding == one full causal pass (linen and nnx, dot-product and Shaw, float64 and float32).

The scenario: B=3 prompts of different lengths (2, 5, 3) right-padded with garbage into one prefill, then
steps of 1 or 2 tokens (the last one with a per-example count of real tokens), all under jit. Every real
token's output must equal the full causal pass over the true sequence at the same position.
Axes: B=3, E=17, N=6 query heads, K=2 key/value heads, H=11, Hv=13, cache L=13, sequence 11.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxattn
import jaxattn.linen as jl
import jaxattn.nnx as jx
from helpers import normwise
from jaxattn._layers import cache as kv_cache

B, E, N, K, H, Hv, L, SEQ = 3, 17, 6, 2, 11, 13, 13, 11
MAX_DISTANCE = 3
PROMPTS = np.array([2, 5, 3])
STEPS = [(1, [1, 1, 1]), (2, [2, 2, 2]), (1, [1, 1, 1]), (2, [1, 2, 2])]  # (tokens this call, real ones)
TOLERANCE = {np.float64: 1e-12, np.float32: 1e-6}


def _calls(x, rng):
    """(input [B,T,E], real counts [B]) for the prefill and each step; padding rows are random garbage."""
    pos = np.zeros(B, int)
    for width, real in [(PROMPTS.max(), PROMPTS), *((n, np.array(r)) for n, r in STEPS)]:
        inp = rng.standard_normal((B, width, E)).astype(x.dtype)
        for b in range(B):
            inp[b, : real[b]] = x[b, pos[b] : pos[b] + real[b]]
        pos += real
        yield inp, real


def _decode(step, x):
    """Run all calls through `step(inp, real) -> out`; return each example's outputs for its real tokens."""
    rows = [[] for _ in range(B)]
    for inp, real in _calls(x, np.random.default_rng(1)):
        out = np.asarray(step(inp, real))
        for b in range(B):
            rows[b].append(out[b, : real[b]])
    return [np.concatenate(r) for r in rows]


def _assert_matches_full_pass(decoded, full, dtype):
    for b in range(B):
        assert decoded[b].dtype == dtype
        err = normwise(decoded[b], full[b, : len(decoded[b])])
        assert err <= TOLERANCE[dtype], (b, err)
    assert [len(d) for d in decoded] == [7, 11, 9]


def _linen_layer(relative, dtype):
    kw = dict(
        num_heads=N,
        num_kv_heads=K,
        head_dim=H,
        value_head_dim=Hv,
        param_dtype=dtype,
        kernel_init=jax.nn.initializers.normal(0.3),
    )  # cheaper to compile eagerly than truncated normal
    return jl.RelativeMultiHeadAttention(max_distance=MAX_DISTANCE, **kw) if relative else jl.MultiHeadAttention(**kw)


# Each framework with one dtype x attention kind in the default group (float64 relative on linen, float32 relative
# on nnx); the other pairs of the cover in the slow group: every case compiles 4 programs.
@pytest.mark.parametrize(
    "dtype, relative", [(np.float64, True), pytest.param(np.float32, False, marks=pytest.mark.slow)]
)
def test_linen_cached_decoding_equals_full_causal_pass(dtype, relative):
    x = np.random.default_rng(0).standard_normal((B, SEQ, E)).astype(dtype)
    layer = _linen_layer(relative, dtype)
    variables = layer.init(jax.random.key(0), np.zeros((B, L, E), dtype), decode=True)
    params, cache = variables["params"], variables["cache"]
    assert jax.tree.map(jnp.shape, cache) == {
        "cached_key": (B, L, K, H),
        "cached_value": (B, L, K, Hv),
        "cache_index": (B,),
    }
    assert cache["cached_key"].dtype == dtype and cache["cache_index"].dtype == jnp.int32

    @jax.jit
    def step(cache, inp, real):
        return layer.apply(
            {"params": params, "cache": cache}, inp, decode=True, key_value_seq_lengths=real, mutable=["cache"]
        )

    def run(inp, real):
        nonlocal cache
        out, mutated = step(cache, inp, real)
        cache = mutated["cache"]
        return out

    decoded = _decode(run, x)
    np.testing.assert_array_equal(cache["cache_index"], [7, 11, 9])
    fn = jaxattn.relative_multi_head_attention if relative else jaxattn.multi_head_attention
    _assert_matches_full_pass(decoded, jax.jit(lambda p, x: fn(p, x, is_causal=True))(params, x), dtype)


@pytest.mark.parametrize(
    "dtype, relative", [pytest.param(np.float64, False, marks=pytest.mark.slow), (np.float32, True)]
)
def test_nnx_cached_decoding_equals_full_causal_pass(dtype, relative):
    x = np.random.default_rng(0).standard_normal((B, SEQ, E)).astype(dtype)
    kw = dict(num_kv_heads=K, value_head_dim=Hv, param_dtype=dtype, rngs=nnx.Rngs(0))
    layer = (
        jx.RelativeMultiHeadAttention(E, N, H, max_distance=MAX_DISTANCE, **kw)
        if relative
        else jx.MultiHeadAttention(E, N, H, **kw)
    )
    full = jax.jit(
        lambda p, x: (jaxattn.relative_multi_head_attention if relative else jaxattn.multi_head_attention)(
            p, x, is_causal=True
        )
    )(layer.params(), x)
    layer.init_cache((B, L, E))
    step = nnx.jit(lambda m, inp, real: m(inp, decode=True, key_value_seq_lengths=real))
    decoded = _decode(lambda inp, real: step(layer, inp, real), x)
    np.testing.assert_array_equal(layer.cache_index[...], [7, 11, 9])
    _assert_matches_full_pass(decoded, full, dtype)


def test_write_places_tokens_after_each_examples_filled_slots():
    key = jnp.zeros((2, 5, 1, 1))
    index = jnp.array([0, 3])
    new = jnp.array([[1.0, 2.0], [3.0, 4.0]])[..., None, None]  # [B=2, T=2, K=1, H=1]
    cached_key, _, new_index, attend = kv_cache.write(key, key, index, new, new, jnp.array([2, 1]))
    np.testing.assert_array_equal(cached_key[..., 0, 0], [[1, 2, 0, 0, 0], [0, 0, 0, 3, 4]])
    np.testing.assert_array_equal(new_index, [2, 4])
    np.testing.assert_array_equal(attend["query_positions"], [[0, 1], [3, 4]])
    np.testing.assert_array_equal(attend["key_value_seq_lengths"], [2, 4])  # example 1's token 4 is padding


def test_decode_errors():
    layer = _linen_layer(False, np.float32)
    variables = layer.init(jax.random.key(0), np.zeros((B, 4, E), np.float32), decode=True)
    with pytest.raises(ValueError, match="at most L=4 new tokens"):
        layer.apply(variables, np.zeros((B, 5, E), np.float32), decode=True, mutable=["cache"])
    _, filled = layer.apply(variables, np.zeros((B, 3, E), np.float32), decode=True, mutable=["cache"])
    with pytest.raises(ValueError, match="room in the cache"):  # 3 filled + 2 new > 4 slots
        layer.apply({**variables, **filled}, np.zeros((B, 2, E), np.float32), decode=True, mutable=["cache"])
    with pytest.raises(ValueError, match="query_positions"):
        layer.apply(
            variables,
            np.zeros((B, 1, E), np.float32),
            decode=True,
            mutable=["cache"],
            query_positions=np.zeros((B, 1), np.int32),
        )
    with pytest.raises(ValueError, match=r"key_value_seq_lengths \(decode\)"):
        layer.apply(
            variables,
            np.zeros((B, 2, E), np.float32),
            decode=True,
            mutable=["cache"],
            key_value_seq_lengths=np.array([1, 3, 0]),
        )
    torch_like = jl.MultiHeadAttention(
        num_heads=N, head_dim=H, add_zero_attn=True, kernel_init=jax.nn.initializers.normal(0.3)
    )
    variables = torch_like.init(jax.random.key(0), np.zeros((B, 4, E), np.float32), decode=True)
    with pytest.raises(ValueError, match="add_zero_attn"):
        torch_like.apply(variables, np.zeros((B, 1, E), np.float32), decode=True, mutable=["cache"])


def _overflow_calls(first_prompt):
    """Prefill of 3 tokens (example 0 has `first_prompt` real ones), a 2-token step, a 1-token step, cache L=4:
    with first_prompt=3 example 0 overflows at the first step (3 + 2 > 4), examples 1 and 2 never do."""
    rng = np.random.default_rng(5)
    x = [rng.standard_normal((B, T, E)) for T in (3, 2, 1)]
    return list(zip(x, [np.array([first_prompt, 1, 2]), np.array([2, 2, 1]), np.array([0, 1, 1])]))


def _assert_overflow_poisons_only_that_example(run):
    """run(calls) -> list of outputs [B,T,E] under jit; example 0 overflows at step 1 in the first run only."""
    poisoned, clean = run(_overflow_calls(3)), run(_overflow_calls(1))
    assert np.isfinite(poisoned[0]).all()  # the prefill fits
    for step in (1, 2):  # the overflowing step and every later one: NaN for example 0 only
        assert np.isnan(poisoned[step][0]).all()
        np.testing.assert_array_equal(poisoned[step][1:], clean[step][1:])
        assert np.isfinite(clean[step]).all()


def test_linen_cache_overflow_under_jit_gives_nan_for_that_example_only():
    layer = _linen_layer(False, np.float64)
    variables = layer.init(jax.random.key(0), np.zeros((B, 4, E)), decode=True)
    apply = jax.jit(lambda v, x, n: layer.apply(v, x, decode=True, key_value_seq_lengths=n, mutable=["cache"]))

    def run(calls):
        outs, cache = [], variables["cache"]
        for x, n in calls:
            y, mutated = apply({"params": variables["params"], "cache": cache}, x, n)
            outs.append(np.asarray(y))
            cache = mutated["cache"]
        assert int(cache["cache_index"][0]) == (5 if calls[0][1][0] == 3 else 3)  # counts on past L = 4
        return outs

    _assert_overflow_poisons_only_that_example(run)


@pytest.mark.slow  # linen's overflow test runs the shared cache code in the default group
def test_nnx_cache_overflow_under_jit_gives_nan_for_that_example_only():
    step = nnx.jit(lambda m, x, n: m(x, decode=True, key_value_seq_lengths=n, return_weights=True))

    def run(calls):
        layer = jx.MultiHeadAttention(
            E, N, H, num_kv_heads=K, value_head_dim=Hv, param_dtype=np.float64, rngs=nnx.Rngs(0)
        )
        layer.init_cache((B, 4, E))
        outs = []
        for x, n in calls:
            y, weights = step(layer, x, n)
            assert np.isnan(weights[0]).all() == np.isnan(y[0]).all()  # weights poisoned alike
            outs.append(np.asarray(y))
        return outs

    _assert_overflow_poisons_only_that_example(run)
