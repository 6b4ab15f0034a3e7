"""Relative-position schemes (T5, ALiBi, RoPE, clipped keys, Transformer-XL) against float64 loop references.

References here are the papers' formulas written as plain loops over numpy arrays (no jaxattn, no torchref);
gradients are compared with torchref.positions' autograd. Axis sizes are distinct primes: B=2 T=5 S=7 H=11
Hv=13, N=6 heads with K=3 key/value heads (grouped-query), bottom-right causal T < S.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchref.positions as twin
from helpers import assert_float64, attention_loop, normwise
from jaxattn import (
    alibi_attention,
    alibi_bias,
    alibi_slopes,
    apply_rope,
    blockwise_attention,
    clipped_relative_attention,
    clipped_relative_index,
    relative_sinusoids,
    rope_attention,
    rope_permutation,
    shaw_relative_attention,
    t5_attention,
    t5_position_bias,
    t5_relative_bias,
    t5_relative_position_bucket,
    transformer_xl_attention,
)

B, T, S, N, K, H, Hv = 2, 5, 7, 6, 3, 11, 13
TOL = 1e-12


def qkv(T=T, S=S, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, T, N, H)), rng.normal(size=(B, S, K, H)), rng.normal(size=(B, S, K, Hv))


def query_pos(T=T, S=S):
    return np.arange(T) + (S - T)


# --- float64 loop references ---------------------------------------------------------------------------


def bucket_loop(n, bidirectional, num_buckets, max_distance):
    """Mesh TF's bucket of one int, log in float32 as the trained models."""
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket, n = (num_buckets if n > 0 else 0), abs(n)
    else:
        n = max(-n, 0)
    exact = num_buckets // 2
    if n < exact:
        return bucket + n
    log = np.log(np.float32(n) / np.float32(exact)) / np.float32(math.log(max_distance / exact))
    return bucket + min(exact + int(log * np.float32(num_buckets - exact)), num_buckets - 1)


def rope_loop(x, positions, base, rotary_dim, layout):
    """x [B,T,N,H]: rotate each pair by pos * base ** (-2k / rotary_dim) with an explicit 2x2 matrix."""
    out = np.array(x, np.float64)
    for t, pos in enumerate(positions):
        for k in range(rotary_dim // 2):
            a, b = (k, k + rotary_dim // 2) if layout == "half" else (2 * k, 2 * k + 1)
            angle = pos * base ** (-2.0 * k / rotary_dim)
            rot = np.array([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
            pair = np.stack([x[:, t, :, a], x[:, t, :, b]], -1)  # [B,N,2]
            out[:, t, :, a], out[:, t, :, b] = np.moveaxis(pair @ rot.T, -1, 0)
    return out


def xl_loop(q, k, v, keys, u, w, max_left, is_causal):
    """Transformer-XL: scale * ((q+u).k_s + (q+w).P[clip(j-i)]), its terms built one (b, n, t, s) at a time:
    q.(k_s + P[r]) is attention_loop's logit with rel_key = P[r], and scale * (u.k_s + w.P[r]) its bias."""
    Bq, Tq, Nq, Hq = q.shape
    Sk, G, R = k.shape[1], N // k.shape[2], keys.shape[0]
    qp = query_pos(Tq, Sk)
    rel_key, bias = np.zeros((Tq, Sk, Nq, Hq)), np.zeros((Bq, Nq, Tq, Sk))
    for b in range(Bq):
        for n in range(Nq):
            for t in range(Tq):
                for s in range(Sk):
                    r = min(max(s - qp[t], -max_left), R - 1 - max_left) + max_left
                    rel_key[t, s, n] = keys[r, n]
                    bias[b, n, t, s] = (u[n] @ k[b, s, n // G] + w[n] @ keys[r, n]) / Hq**0.5
    return attention_loop(q, k, v, rel_key=rel_key, bias=bias, is_causal=is_causal)[0]


def paper_rel_shift(x):
    """Transformer-XL's _rel_shift (pad a zero column, reshape, drop a row): [T, klen] -> [T, klen]."""
    Tq, klen = x.shape
    padded = np.concatenate([np.zeros((Tq, 1)), x], axis=1).reshape(klen + 1, Tq)
    return padded[1:].reshape(Tq, klen)


# --- T5 --------------------------------------------------------------------------------------------------


def test_t5_bucket_literal_grids():
    n = np.arange(-8, 9)
    got = np.asarray(t5_relative_position_bucket(n, bidirectional=True, num_buckets=8, max_distance=16))
    #              -8 -7 -6 -5 -4 -3 -2 -1  0  1  2  3  4  5  6  7  8
    np.testing.assert_array_equal(got, [3, 3, 3, 2, 2, 2, 2, 1, 0, 5, 6, 6, 6, 6, 7, 7, 7])
    got = np.asarray(t5_relative_position_bucket(n[1:12], bidirectional=False, num_buckets=8, max_distance=16))
    #              -7 -6 -5 -4 -3 -2 -1  0  1  2  3   (j > i all share bucket 0)
    np.testing.assert_array_equal(got, [5, 5, 4, 4, 3, 2, 1, 0, 0, 0, 0])


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (10, 11), (7, 40)])
def test_t5_bucket_matches_loop(bidirectional, num_buckets, max_distance):
    n = np.arange(-300, 301)
    got = t5_relative_position_bucket(
        n, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    want = [bucket_loop(int(i), bidirectional, num_buckets, max_distance) for i in n]
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), want)
    assert np.asarray(got).min() >= 0 and np.asarray(got).max() < num_buckets


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bias_loop_and_decoding_offsets(bidirectional):
    table = np.random.default_rng(1).normal(size=(9, N))
    bias = t5_relative_bias(table, T, S, bidirectional=bidirectional, max_distance=10)
    want = np.empty((N, T, S))
    for t in range(T):
        for s in range(S):
            want[:, t, s] = table[bucket_loop(s - query_pos()[t], bidirectional, 9, 10)]
    assert bias.dtype == jnp.float64 and bias.shape == (N, T, S)
    np.testing.assert_array_equal(np.asarray(bias), want)
    # decoding T new tokens after S - T cached ones = the last T rows of the full square bias
    full = t5_relative_bias(table, S, S, bidirectional=bidirectional, max_distance=10)
    np.testing.assert_array_equal(np.asarray(bias), np.asarray(full)[:, S - T :])
    moved = t5_relative_bias(
        table,
        T,
        S,
        bidirectional=bidirectional,
        max_distance=10,
        query_positions=np.arange(T) + 40,
        key_positions=np.arange(S) + 40 - (S - T),
    )
    np.testing.assert_array_equal(np.asarray(moved), want)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_attention_matches_loop(bidirectional):
    q, k, v = qkv()
    table = np.random.default_rng(2).normal(size=(8, N))
    out = t5_attention(q, k, v, table, bidirectional=bidirectional, max_distance=9, is_causal=not bidirectional)
    bias = np.asarray(t5_relative_bias(table, T, S, bidirectional=bidirectional, max_distance=9))
    ref, _ = attention_loop(q, k, v, bias=np.broadcast_to(bias, (B, N, T, S)), is_causal=not bidirectional, scale=1.0)
    assert_float64(out)
    assert normwise(out, ref) <= TOL


# --- ALiBi ------------------------------------------------------------------------------------------------


def test_alibi_slopes_literal_and_paper_recursion():
    np.testing.assert_array_equal(alibi_slopes(8, dtype=jnp.float64), [2.0**-k for k in range(1, 9)])
    np.testing.assert_array_equal(alibi_slopes(6, dtype=jnp.float64), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])
    np.testing.assert_array_equal(alibi_slopes(1, dtype=jnp.float64), [2.0**-8])
    want12 = [2.0**-k for k in range(1, 9)] + [2 ** -(k / 2) for k in (1, 3, 5, 7)]
    np.testing.assert_allclose(alibi_slopes(12, dtype=jnp.float64), want12, rtol=1e-15)
    for n in (3, 5, 7, 12, 20, 33):
        np.testing.assert_allclose(alibi_slopes(n, dtype=jnp.float64), twin.alibi_slopes(n).numpy(), rtol=1e-14)
    assert alibi_slopes(5).dtype == jnp.float32


@pytest.mark.parametrize("bidirectional", [False, True])
def test_alibi_bias_and_attention_match_loop(bidirectional):
    slopes = alibi_slopes(N, dtype=jnp.float64)
    bias = alibi_bias(slopes, T, S, bidirectional=bidirectional)
    rel = np.arange(S)[None, :] - query_pos()[:, None]
    want = np.asarray(slopes)[:, None, None] * (-np.abs(rel) if bidirectional else rel)
    assert bias.dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(bias), want)
    q, k, v = qkv()
    out = alibi_attention(q, k, v, slopes, bidirectional=bidirectional, is_causal=not bidirectional)
    ref, _ = attention_loop(q, k, v, bias=np.broadcast_to(want, (B, N, T, S)), is_causal=not bidirectional)
    assert normwise(out, ref) <= TOL


def test_alibi_equals_bloom_key_position_form():
    """BLOOM adds slope * key_pos: it differs by slope * query_pos, a per-row constant, so outputs agree."""
    q, k, v = qkv()
    slopes = alibi_slopes(N, dtype=jnp.float64)
    bloom_bias = np.asarray(slopes)[:, None, None] * np.arange(S)[None, None, :]
    out = alibi_attention(q, k, v, slopes, is_causal=True)
    ref, _ = attention_loop(q, k, v, bias=np.broadcast_to(bloom_bias, (B, N, T, S)), is_causal=True)
    assert normwise(out, ref) <= TOL


# --- RoPE -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [None, 4, 10])
def test_apply_rope_matches_loop(layout, rotary_dim):
    x = qkv()[0] if rotary_dim else qkv()[0][..., :10]  # the full-head default needs an even H (11 is odd)
    positions = np.array([3, 0, 17, 250, 1001])
    got = apply_rope(x, positions, base=500.0, rotary_dim=rotary_dim, layout=layout)
    want = rope_loop(x, positions, 500.0, rotary_dim or 10, layout)
    assert_float64(got)
    assert normwise(got, want) <= TOL
    # offset is arange(T) + offset
    np.testing.assert_array_equal(
        apply_rope(x, offset=7, rotary_dim=rotary_dim, layout=layout),
        apply_rope(x, np.arange(T) + 7, rotary_dim=rotary_dim, layout=layout),
    )


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_attention_is_relative_and_matches_loop(layout):
    q, k, v = qkv()
    out = rope_attention(q, k, v, layout=layout, rotary_dim=6, is_causal=True)
    ref, _ = attention_loop(
        rope_loop(q, query_pos(), 1e4, 6, layout), rope_loop(k, np.arange(S), 1e4, 6, layout), v, is_causal=True
    )
    assert normwise(out, ref) <= TOL
    shifted = rope_attention(
        q,
        k,
        v,
        layout=layout,
        rotary_dim=6,
        is_causal=True,
        query_positions=query_pos() + 123,
        key_positions=np.arange(S) + 123,
    )
    assert normwise(shifted, out) <= 1e-12  # only j - i matters


@pytest.mark.parametrize("source, target", [("interleaved", "half"), ("half", "interleaved")])
def test_rope_permutation_converts_layouts(source, target):
    q, k, v = qkv()
    p = rope_permutation(H, rotary_dim=8, source=source, target=target)
    np.testing.assert_array_equal(p, twin.rope_permutation(H, rotary_dim=8, source=source, target=target).numpy())
    assert sorted(p) == list(range(H))
    x = q
    np.testing.assert_allclose(
        apply_rope(x[..., p], np.arange(T), rotary_dim=8, layout=target),
        np.asarray(apply_rope(x, np.arange(T), rotary_dim=8, layout=source))[..., p],
        rtol=0,
        atol=1e-14,
    )
    # a checkpoint's q/k features permuted per head give the same attention in the other layout
    a = rope_attention(q[..., p], k[..., p], v, rotary_dim=8, layout=target, is_causal=True)
    b = rope_attention(q, k, v, rotary_dim=8, layout=source, is_causal=True)
    assert normwise(a, b) <= TOL


def test_rope_half_precision_angles_in_float32():
    x = jnp.asarray(qkv()[0][..., :10], jnp.bfloat16)
    positions = np.array([1, 257, 1001, 4097, 65537])  # not representable in bf16
    got = apply_rope(x, positions)
    want = apply_rope(x.astype(jnp.float32), positions).astype(jnp.bfloat16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# --- clipped relative keys and Transformer-XL ---------------------------------------------------------------


def test_clipped_index_literal_grid_and_shaw_special_case():
    got = clipped_relative_index(3, 5, max_left=2, max_right=1)
    # query t at t + 2; j - i clipped to [-2, 1], + 2
    np.testing.assert_array_equal(got, [[0, 1, 2, 3, 3], [0, 0, 1, 2, 3], [0, 0, 0, 1, 2]])
    q, k, v = qkv()
    rng = np.random.default_rng(3)
    kt, vt = rng.normal(size=(7, N, H)), rng.normal(size=(7, Hv))
    a = clipped_relative_attention(q, k, v, kt, vt, max_left=3, max_right=3, is_causal=True)
    b = shaw_relative_attention(q, k, v, kt, vt, max_distance=3, is_causal=True)
    assert normwise(a, b) <= TOL


@pytest.mark.parametrize("max_left, max_right", [(4, 1), (0, 2)])
def test_clipped_relative_attention_matches_loop(max_left, max_right):
    q, k, v = qkv()
    rng = np.random.default_rng(4)
    R = max_left + max_right + 1
    kt, vt = rng.normal(size=(R, H)), rng.normal(size=(R, N, Hv))
    out = clipped_relative_attention(q, k, v, kt, vt, max_left=max_left, max_right=max_right)
    index = np.clip(np.arange(S)[None, :] - query_pos()[:, None], -max_left, max_right) + max_left
    rel_key = np.broadcast_to(kt[index][:, :, None], (T, S, N, H))
    ref, _ = attention_loop(q, k, v, rel_key=rel_key, rel_value=vt[index])
    assert normwise(out, ref) <= TOL


@pytest.mark.parametrize("is_causal, max_left, R", [(True, S - 1, S), (False, S - 1, 2 * S - 1), (False, 3, 6)])
def test_transformer_xl_matches_loop(is_causal, max_left, R):
    q, k, v = qkv()
    rng = np.random.default_rng(5)
    keys, u, w = rng.normal(size=(R, N, H)), rng.normal(size=(N, H)), rng.normal(size=(N, H))
    out = transformer_xl_attention(q, k, v, keys, max_left=max_left, pos_bias_u=u, pos_bias_v=w, is_causal=is_causal)
    assert_float64(out)
    assert normwise(out, xl_loop(q, k, v, keys, u, w, max_left, is_causal)) <= TOL


def test_transformer_xl_position_term_equals_the_papers_shift_on_visible_keys():
    """Causal with memory: rows R_{S-1} .. R_0 (the paper's order, i - j descending), T < S."""
    rng = np.random.default_rng(6)
    qv, keys = rng.normal(size=(T, H)), rng.normal(size=(S, H))  # one head; qv = q + v
    index = np.clip(np.arange(S)[None, :] - query_pos()[:, None], -(S - 1), 0) + S - 1
    gathered = np.take_along_axis(qv @ keys.T, index, axis=1)  # what transformer_xl_attention computes
    # paper: BD[t, :] over rows R_{S-1} .. R_0 = our rows 0 .. S-1, then _rel_shift
    shifted = paper_rel_shift(qv @ keys.T)
    visible = np.arange(S)[None, :] <= query_pos()[:, None]
    np.testing.assert_allclose(gathered[visible], shifted[visible], rtol=0, atol=1e-14)


def test_relative_sinusoids_formula():
    got = relative_sinusoids(6, max_left=3, max_right=2, base=100.0, layout="concat", dtype=jnp.float64)
    d = 3 - np.arange(6)  # i - j of rows 0..5
    w = 100.0 ** (-np.arange(0, 6, 2) / 6)
    np.testing.assert_allclose(got, np.concatenate([np.sin(np.outer(d, w)), np.cos(np.outer(d, w))], 1), atol=1e-15)
    inter = np.asarray(
        relative_sinusoids(6, max_left=3, max_right=2, base=100.0, layout="interleaved", dtype=jnp.float64)
    )
    np.testing.assert_array_equal(inter[:, 0::2], np.asarray(got)[:, :3])
    np.testing.assert_array_equal(inter[:, 1::2], np.asarray(got)[:, 3:])


# --- every scheme: jit, vmap, grad (against torchref's autograd), GQA, bottom-right causal T < S -------------

_rng = np.random.default_rng(7)
_TABLES = {
    "t5": _rng.normal(size=(8, N)),
    "slopes": np.asarray(alibi_slopes(N, dtype=jnp.float64)),
    "kt": _rng.normal(size=(6, N, H)),
    "pk": _rng.normal(size=(S, N, H)),
    "u": _rng.normal(size=(N, H)),
    "w": _rng.normal(size=(N, H)),
}

SCHEMES = {  # name: (jaxattn fn, torchref.positions fn, table keys); all causal with T < S and K < N
    "t5": (
        lambda q, k, v, t: t5_attention(q, k, v, t, bidirectional=False, max_distance=9, is_causal=True),
        lambda q, k, v, t: twin.t5_attention(q, k, v, t, bidirectional=False, max_distance=9, is_causal=True),
        ("t5",),
    ),
    "alibi": (
        lambda q, k, v, s: alibi_attention(q, k, v, s, is_causal=True),
        lambda q, k, v, s: twin.alibi_attention(q, k, v, s, is_causal=True),
        ("slopes",),
    ),
    "rope": (
        lambda q, k, v: rope_attention(q, k, v, rotary_dim=6, layout="interleaved", is_causal=True),
        lambda q, k, v: twin.rope_attention(q, k, v, rotary_dim=6, layout="interleaved", is_causal=True),
        (),
    ),
    "clipped": (
        lambda q, k, v, t: clipped_relative_attention(q, k, v, t, max_left=4, max_right=1, is_causal=True),
        lambda q, k, v, t: twin.clipped_relative_attention(q, k, v, t, max_left=4, max_right=1, is_causal=True),
        ("kt",),
    ),
    "xl": (
        lambda q, k, v, p, u, w: transformer_xl_attention(
            q, k, v, p, max_left=S - 1, pos_bias_u=u, pos_bias_v=w, is_causal=True
        ),
        lambda q, k, v, p, u, w: twin.transformer_xl_attention(
            q, k, v, p, max_left=S - 1, pos_bias_u=u, pos_bias_v=w, is_causal=True
        ),
        ("pk", "u", "w"),
    ),
}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_jit_vmap_grad_against_torch_autograd(name):
    jax_fn, torch_fn, table_names = SCHEMES[name]
    args = list(qkv(seed=8)) + [_TABLES[t] for t in table_names]
    cot = np.random.default_rng(9).normal(size=(B, T, N, Hv))

    def loss(*a):
        return jnp.sum(jax_fn(*a) * cot)

    out = jax.jit(jax_fn)(*args)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)
    targs = [torch.tensor(a, requires_grad=True) for a in args]
    t_out = torch_fn(*targs)
    t_grads = torch.autograd.grad((t_out * torch.tensor(cot)).sum(), targs)
    assert_float64(out, grads)
    assert normwise(out, t_out.detach().numpy()) <= TOL
    for g, tg in zip(grads, t_grads):
        assert normwise(g, tg.numpy()) <= TOL
    # vmap over a new leading axis of the queries (keys and tables shared) = one call per slice
    stacked = np.stack([args[0], args[0][::-1]])
    batched = jax.vmap(lambda q: jax_fn(q, *args[1:]))(stacked)
    assert normwise(batched[1], jax_fn(stacked[1], *args[1:])) <= TOL


@pytest.mark.parametrize(
    "scheme, block_size, is_causal", [("t5", (2, 3), True), ("t5", 4, False), ("alibi", (3, 2), True)]
)
def test_blockwise_equals_dense(scheme, block_size, is_causal):
    q, k, v = qkv(T=7, S=11, seed=10)
    if scheme == "t5":
        fn = lambda bs, impl: t5_attention(
            q,
            k,
            v,
            _TABLES["t5"],
            bidirectional=not is_causal,
            max_distance=9,
            is_causal=is_causal,
            implementation=impl,
            block_size=bs,
        )
    else:
        fn = lambda bs, impl: alibi_attention(
            q,
            k,
            v,
            _TABLES["slopes"],
            bidirectional=not is_causal,
            is_causal=is_causal,
            implementation=impl,
            block_size=bs,
        )
    assert normwise(fn(block_size, "blockwise"), fn(None, "dense")) <= TOL


def test_position_bias_hook_is_what_blockwise_attention_takes():
    q, k, v = qkv(seed=11)
    hook = t5_position_bias(_TABLES["t5"], bidirectional=False, max_distance=9)
    a = blockwise_attention(q, k, v, position_bias=hook, scale=1.0, is_causal=True, block_size=2)
    b = t5_attention(q, k, v, _TABLES["t5"], bidirectional=False, max_distance=9, is_causal=True)
    assert normwise(a, b) <= TOL


# --- bad input ------------------------------------------------------------------------------------------------

_q, _k, _v = qkv()
BAD = [
    ("relative_position", lambda: t5_relative_position_bucket(np.array([0.5, 1.0]))),
    ("num_buckets", lambda: t5_relative_position_bucket(np.arange(3), num_buckets=1)),
    ("num_buckets", lambda: t5_relative_position_bucket(np.arange(3), num_buckets=3, bidirectional=True)),
    ("max_distance", lambda: t5_relative_position_bucket(np.arange(3), num_buckets=32, max_distance=8)),
    ("table", lambda: t5_relative_bias(np.zeros((4, 2, 3)), T, S)),
    ("query_positions", lambda: t5_relative_bias(np.zeros((8, N)), T, S, query_positions=np.arange(T) * 1.0)),
    ("num_heads", lambda: alibi_slopes(0)),
    ("num_heads", lambda: alibi_slopes(4.0)),
    ("slopes", lambda: alibi_bias(np.arange(N), T, S)),
    ("positions", lambda: apply_rope(_q[..., :10], np.arange(T) + 0.5)),
    ("positions", lambda: apply_rope(_q[..., :10], np.arange(T + 1))),
    ("rotary_dim", lambda: apply_rope(_q, rotary_dim=5)),
    ("rotary_dim", lambda: apply_rope(_q)),  # H = 11 is odd
    ("rotary_dim", lambda: apply_rope(_q, rotary_dim=12)),
    ("layout", lambda: apply_rope(_q, rotary_dim=4, layout="neox")),
    ("base", lambda: apply_rope(_q, rotary_dim=4, base=0.5)),
    ("offset", lambda: apply_rope(_q, rotary_dim=4, offset=1.5)),
    ("rotary_dim", lambda: rope_permutation(8, rotary_dim=9)),
    ("max_left", lambda: clipped_relative_index(T, S, max_left=-1, max_right=0)),
    ("key_table", lambda: clipped_relative_attention(_q, _k, _v, np.zeros((5, H)), max_left=2, max_right=3)),
    ("position_keys", lambda: transformer_xl_attention(_q, _k, _v, np.zeros((4, N, H)), max_left=4)),
    (
        "pos_bias_u",
        lambda: transformer_xl_attention(_q, _k, _v, np.zeros((S, N, H)), max_left=3, pos_bias_u=np.zeros((K, H))),
    ),
    ("dim", lambda: relative_sinusoids(7, max_left=1, max_right=1)),
    ("implementation", lambda: t5_attention(_q, _k, _v, np.zeros((8, N)), implementation="flash")),
    (
        "implementation",
        lambda: alibi_attention(_q, _k, _v, np.ones(N), implementation="blockwise", mask=np.ones((T, S), bool)),
    ),
]


@pytest.mark.parametrize("argument, call", BAD, ids=[f"{i}-{a}" for i, (a, _) in enumerate(BAD)])
def test_bad_input_raises_value_error_naming_the_argument(argument, call):
    with pytest.raises(ValueError, match=argument):
        call()


def test_errors_are_raised_at_trace_time_under_jit():
    with pytest.raises(ValueError, match="rotary_dim"):
        jax.jit(lambda x: apply_rope(x, rotary_dim=3))(_q)
