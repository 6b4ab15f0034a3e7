"""jaxattn's attention functions against the float64 loop reference (tests/helpers.py).

Axis sizes are distinct primes (B=2 T=5 S=7 H=11 Hv=13; N=6 with K in 6/3/2/1) so a swapped axis fails.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxattn
from helpers import assert_float64, attention_loop, normwise, shaw_index_loop

B, T, S, N, H, Hv = 2, 5, 7, 6, 11, 13
TOL = 1e-12


def qkv(K=N, T=T, S=S, seed=0, batch=(B,)):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(*batch, T, N, H)), rng.normal(size=(*batch, S, K, H)), rng.normal(size=(*batch, S, K, Hv)))


def random_mask(T=T, S=S, seed=1):
    return np.random.default_rng(seed).random((B, N, T, S)) > 0.3


@pytest.mark.parametrize("K", [6, 3, 2, 1])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_dot_product_matches_loop(K, is_causal, with_mask):
    q, k, v = qkv(K)
    mask = random_mask() if with_mask else None
    out, w = jaxattn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal, return_weights=True)
    ref, ref_w = attention_loop(q, k, v, mask=mask, is_causal=is_causal)
    assert_float64(out, w)
    assert out.shape == (B, T, N, Hv) and w.shape == (B, N, T, S)
    assert normwise(out, ref) <= TOL and normwise(w, ref_w) <= TOL


@pytest.mark.parametrize("T_, S_", [(5, 7), (7, 5), (7, 7), (1, 7)])
def test_bottom_right_causal(T_, S_):
    q, k, v = qkv(3, T=T_, S=S_)
    out, w = jaxattn.dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    ref, ref_w = attention_loop(q, k, v, is_causal=True)
    assert normwise(out, ref) <= TOL
    # The literal rule: query t sees keys s <= t + S - T; rows with no key are exactly zero.
    allowed = np.arange(S_)[None, :] <= np.arange(T_)[:, None] + (S_ - T_)
    np.testing.assert_array_equal(np.asarray(w[0, 0]) > 0, allowed)
    empty = ~allowed.any(-1)
    assert np.all(np.asarray(out)[:, empty] == 0)


def test_causal_literal_grid_T3_S5():
    w = jaxattn.dot_product_attention(*qkv(6, T=3, S=5), is_causal=True, return_weights=True)[1]
    np.testing.assert_array_equal(np.asarray(w[1, 4]) > 0, [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])


def test_bias_and_mask_together_and_scale():
    q, k, v = qkv(2)
    rng = np.random.default_rng(5)
    bias = rng.normal(size=(B, 1, T, S))  # broadcast over heads
    bias[0, 0, 1, 2] = -np.inf  # -inf in an additive mask blocks like mask=False
    mask = random_mask()
    out = jaxattn.dot_product_attention(q, k, v, bias=bias, mask=mask, scale=0.37)
    ref, _ = attention_loop(q, k, v, bias=np.broadcast_to(bias, (B, N, T, S)), mask=mask, scale=0.37)
    assert normwise(out, ref) <= TOL


def test_lengths_and_positions():
    q, k, v = qkv(3)
    lengths = np.array([3, 7])
    qpos, kpos = np.array([4, 1, 6, 2, 3]), np.arange(S) * 2 - 3
    out = jaxattn.dot_product_attention(
        q, k, v, key_value_seq_lengths=lengths, is_causal=True, query_positions=qpos, key_positions=kpos
    )
    ref, _ = attention_loop(
        q, k, v, key_value_seq_lengths=lengths, is_causal=True, query_positions=qpos, key_positions=kpos
    )
    assert normwise(out, ref) <= TOL


def test_fully_masked_rows_zero_with_finite_gradients():
    q, k, v = qkv(3)
    mask = random_mask()
    mask[:, :, 2] = False  # query row 2 sees nothing
    f = lambda q, k, v: jnp.sum(jnp.sin(jaxattn.dot_product_attention(q, k, v, mask=mask)))
    out = jaxattn.dot_product_attention(q, k, v, mask=mask)
    assert np.all(np.asarray(out[:, 2]) == 0)
    grads = jax.grad(f, argnums=(0, 1, 2))(q, k, v)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)
    assert np.all(np.asarray(grads[0][:, 2]) == 0)


@pytest.mark.parametrize("fn", ["dot", "relative", "shaw"])
def test_gradients_against_finite_differences(fn):
    q, k, v = qkv(3, T=3, S=4)
    rng = np.random.default_rng(3)
    a_k, a_v = rng.normal(size=(3, 4, N, H)), rng.normal(size=(3, 4, 1, Hv))
    t_k, t_v = rng.normal(size=(5, N, H)), rng.normal(size=(5, Hv))
    mask = np.ones((3, 4), bool)
    mask[1, 3] = False
    if fn == "dot":
        f = lambda q, k, v: jaxattn.dot_product_attention(q, k, v, mask=mask, is_causal=True)
        check_grads(f, (q, k, v), order=1, modes=["rev"])
    elif fn == "relative":
        f = lambda q, k, v, a, b: jaxattn.relative_attention(q, k, v, a, b, mask=mask)
        check_grads(f, (q, k, v, a_k, a_v), order=1, modes=["rev"])
    else:
        f = lambda q, k, v, a, b: jaxattn.shaw_relative_attention(q, k, v, a, b, max_distance=2, is_causal=True)
        check_grads(f, (q, k, v, t_k, t_v), order=1, modes=["rev"])


@pytest.mark.parametrize("shared", [False, True])
def test_relative_attention_matches_loop(shared):
    q, k, v = qkv(2)
    rng = np.random.default_rng(7)
    heads = 1 if shared else N
    a_k, a_v = rng.normal(size=(T, S, heads, H)), rng.normal(size=(T, S, heads, Hv))
    out = jaxattn.relative_attention(q, k, v, a_k, a_v, is_causal=True)
    ref, _ = attention_loop(
        q,
        k,
        v,
        rel_key=np.broadcast_to(a_k, (T, S, N, H)),
        rel_value=np.broadcast_to(a_v, (T, S, N, Hv)),
        is_causal=True,
    )
    assert normwise(out, ref) <= TOL


def test_relative_position_index_literal_grid():
    # T=3 queries at absolute positions 2,3,4 (bottom-right), S=5 keys, clipped at 2: j - i.
    expected = [[0, 1, 2, 3, 4], [0, 0, 1, 2, 3], [0, 0, 0, 1, 2]]
    np.testing.assert_array_equal(jaxattn.relative_position_index(3, 5, 2), expected)
    np.testing.assert_array_equal(jaxattn.relative_position_index(4, 4, 1), shaw_index_loop(4, 4, 1))
    assert jaxattn.relative_position_index(3, 5, 2).dtype == jnp.int32


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("T_", [5, 7])
def test_shaw_matches_loop_and_gathered_relative(per_head, T_):
    q, k, v = qkv(3, T=T_)
    max_distance, rng = 2, np.random.default_rng(11)
    heads = (N,) if per_head else ()
    t_k, t_v = rng.normal(size=(5, *heads, H)), rng.normal(size=(5, *heads, Hv))
    qpos = np.arange(T_) + 1
    out = jaxattn.shaw_relative_attention(
        q, k, v, t_k, t_v, max_distance=max_distance, is_causal=True, query_positions=qpos
    )
    idx = shaw_index_loop(T_, S, max_distance, query_positions=qpos)
    a_k = np.broadcast_to(t_k[idx] if per_head else t_k[idx][:, :, None], (T_, S, N, H))
    a_v = np.broadcast_to(t_v[idx] if per_head else t_v[idx][:, :, None], (T_, S, N, Hv))
    ref, _ = attention_loop(q, k, v, rel_key=a_k, rel_value=a_v, is_causal=True, query_positions=qpos)
    assert normwise(out, ref) <= TOL
    via_relative = jaxattn.relative_attention(q, k, v, a_k, a_v, is_causal=True, query_positions=qpos)
    assert normwise(out, via_relative) <= TOL


def test_leading_batch_dims_and_unbatched():
    q, k, v = qkv(3, batch=(2, 3))
    out = jaxattn.dot_product_attention(q, k, v, is_causal=True)
    assert out.shape == (2, 3, T, N, Hv)
    for i in range(3):
        single = jaxattn.dot_product_attention(q[1, i], k[1, i], v[1, i], is_causal=True)  # no batch dims
        assert_float64(out, single)
        assert normwise(out[1, i], single) <= TOL


def test_jit_and_vmap_over_any_axis():
    q, k, v = qkv(3, batch=(2, 3))
    f = lambda q, k, v: jaxattn.shaw_relative_attention(q, k, v, np.ones((3, H)), None, max_distance=1, is_causal=True)
    direct = f(q, k, v)
    assert_float64(direct)
    assert normwise(jax.jit(f)(q, k, v), direct) <= TOL
    for axis in (0, 1):
        mapped = jax.vmap(f, in_axes=axis, out_axes=axis)(q, k, v)
        assert normwise(mapped, direct) <= TOL


def test_half_precision_softmax_in_float32():
    q, k, v = qkv(3)
    ref, _ = attention_loop(q, k, v, is_causal=True)
    for dtype in (jnp.bfloat16, jnp.float16):
        out = jaxattn.dot_product_attention(*(jnp.asarray(a, dtype) for a in (q, k, v)), is_causal=True)
        assert out.dtype == dtype
        assert normwise(out, ref) < 2e-2
    # Logits that overflow float16 (|x| > 65504) still give a finite, correct softmax.
    big = jnp.asarray(np.full((1, 2, 1, 1), 300.0), jnp.float16)
    out = jaxattn.dot_product_attention(big, big, jnp.ones((1, 2, 1, 1), jnp.float16), scale=1.0)
    assert np.isfinite(np.asarray(out, np.float32)).all()


def test_dropout():
    q, k, v = qkv(3)
    plain = jaxattn.dot_product_attention(q, k, v)
    f = lambda rng: jaxattn.dot_product_attention(q, k, v, dropout_rate=0.25, dropout_rng=rng, return_weights=True)
    out1, w1 = f(jax.random.key(1))
    out2, _ = f(jax.random.key(1))
    out3, _ = f(jax.random.key(2))
    assert normwise(out1, out2) == 0 and normwise(out1, out3) > 0
    kept = np.asarray(w1) > 0
    assert 0.6 < kept.mean() < 0.9  # about 75% kept
    # Inverted dropout is unbiased: averaging over many keys approaches the plain output.
    mean = jnp.mean(jax.vmap(lambda r: f(r)[0])(jax.random.split(jax.random.key(0), 2000)), axis=0)
    assert normwise(mean, plain) < 0.05
    with pytest.raises(ValueError, match="dropout_rng"):
        jaxattn.dot_product_attention(q, k, v, dropout_rate=0.1)


def test_multi_head_attention_against_explicit_projections():
    rng = np.random.default_rng(2)
    Eq, Ek, Ev, Eo, K = 17, 19, 23, 29, 2
    params = jaxattn.init_multi_head_attention(
        jax.random.key(0),
        Eq,
        N,
        H,
        key_features=Ek,
        value_features=Ev,
        out_features=Eo,
        num_kv_heads=K,
        value_head_dim=Hv,
        dtype=jnp.float64,
        bias_init=jax.nn.initializers.normal(1.0),
    )
    xq, xk, xv = rng.normal(size=(B, T, Eq)), rng.normal(size=(B, S, Ek)), rng.normal(size=(B, S, Ev))
    p = jax.tree.map(np.asarray, params)
    q = np.einsum("bte,enh->btnh", xq, p["query"]["kernel"]) + p["query"]["bias"]
    k = np.einsum("bse,ekh->bskh", xk, p["key"]["kernel"]) + p["key"]["bias"]
    v = np.einsum("bse,ekh->bskh", xv, p["value"]["kernel"]) + p["value"]["bias"]
    z, _ = attention_loop(q, k, v, is_causal=True)
    ref = np.einsum("btnh,nho->bto", z, p["out"]["kernel"]) + p["out"]["bias"]
    out = jaxattn.multi_head_attention(params, xq, xk, xv, is_causal=True)
    assert out.shape == (B, T, Eo) and normwise(out, ref) <= TOL
    assert params["query"]["kernel"].shape == (Eq, N, H) and params["out"]["kernel"].shape == (N, Hv, Eo)


def test_relative_multi_head_attention_self_attention():
    rng = np.random.default_rng(4)
    E = 17
    params = jaxattn.init_relative_multi_head_attention(
        jax.random.key(3),
        E,
        N,
        H,
        max_distance=3,
        num_kv_heads=3,
        dtype=jnp.float64,
        table_init=jax.nn.initializers.normal(1.0),
    )
    x = rng.normal(size=(B, S, E))
    out = jaxattn.relative_multi_head_attention(params, x, is_causal=True)
    p = jax.tree.map(np.asarray, params)
    proj = lambda name, heads: np.einsum("bse,ekh->bskh", x, p[name]["kernel"]) + p[name]["bias"]
    idx = shaw_index_loop(S, S, 3)
    z, _ = attention_loop(
        proj("query", N),
        proj("key", 3),
        proj("value", 3),
        is_causal=True,
        rel_key=p["relative"]["key"][idx],
        rel_value=p["relative"]["value"][idx],
    )
    ref = np.einsum("btnh,nho->bto", z, p["out"]["kernel"]) + p["out"]["bias"]
    assert normwise(out, ref) <= TOL
    assert p["relative"]["key"].shape == (7, N, H) and p["relative"]["value"].shape == (7, N, H)
