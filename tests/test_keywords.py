"""Segment ids, windows, chunks, logit softcap and sinks (docs/design.md, "Keywords") on the attention functions beyond
dot_product_attention: the relative forms, the position schemes, the multi-head functions; bad keywords; the
key tiles the blockwise engine visits. (dot_product_attention's option grid on every implementation is
tests/test_contract.py.)

References are independent (tests/helpers.py): the allowed pairs decided by Python loops, the
formula written out over the full grid in float64 (its own forward checked against numpy loops in
tests/test_helpers.py), and its jax.grad for gradients. Every axis has its own prime size; tiles divide neither T nor S.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from helpers import allowed_loop, arrays, assert_float64, attention_reference, check_forward_and_grads, normwise

B, T, S, N, K, H, Hv = 2, 7, 11, 6, 3, 5, 3  # N = K * 2: grouped-query heads
TOL = 1e-12


def qkv(seed=0, t=T, s=S):
    return arrays(seed, (B, t, N, H), (B, s, K, H), (B, s, K, Hv))


SEGMENTS_Q = np.array([[0, 0, 1, 1, 1, 2, 2], [5, 5, 5, 5, 7, 7, 7]], np.int32)  # [B,T], sorted (packed docs)
SEGMENTS_K = np.array([[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7]], np.int32)


def sinks_for(case_sinks, seed=3, shape=(N,)):
    return arrays(seed, shape)[0] if case_sinks else None


def test_jit_and_vmap():
    q, k, v = qkv(7)
    sinks = sinks_for(True)
    kw = dict(window=(3, 0), logit_softcap=1.1, query_segment_ids=SEGMENTS_Q, key_segment_ids=SEGMENTS_K)
    for implementation in ("blockwise",):

        def f(q, k, v, qs, ks):
            return jaxattn.dot_product_attention(
                q,
                k,
                v,
                sinks=sinks,
                implementation=implementation,
                block_size=(3, 4),
                **{**kw, "query_segment_ids": qs, "key_segment_ids": ks},
            )

        plain = f(q, k, v, SEGMENTS_Q, SEGMENTS_K)
        assert_float64(plain)
        mapped = jax.vmap(f)(q, k, v, SEGMENTS_Q, SEGMENTS_K)
        jitted = jax.jit(f)(q, k, v, SEGMENTS_Q, SEGMENTS_K)
        assert normwise(mapped, plain) <= TOL and normwise(jitted, plain) <= TOL


# ---------------------------------------------------------------------------------------------------
# The relative functions and position schemes pass the keywords through.


def shaw_rel_logits(q, table, max_distance):
    qp, kp = np.arange(T) + S - T, np.arange(S)
    index = np.clip(kp[None, :] - qp[:, None], -max_distance, max_distance) + max_distance  # [T,S]
    return jnp.einsum("btnh,tsnh->bnts", q, table[index], precision="highest")


@pytest.mark.parametrize("implementation", ["dense", "blockwise"])
def test_shaw_softcap_includes_relative_keys(implementation):
    q, k, v = qkv(8)
    table = arrays(9, (2 * 2 + 1, N, H))[0]
    sinks = sinks_for(True)
    allowed = allowed_loop(B, N, T, S, window=(3, 1))

    def ours(q, k, v, table, sinks):
        return jaxattn.shaw_relative_attention(
            q,
            k,
            v,
            table,
            max_distance=2,
            window=(3, 1),
            logit_softcap=0.9,
            sinks=sinks,
            implementation=implementation,
            block_size=(3, 4),
        )

    def reference(q, k, v, table, sinks):
        return attention_reference(
            q, k, v, allowed, logit_softcap=0.9, sinks=sinks, rel_logits=shaw_rel_logits(q, table, 2)
        )

    check_forward_and_grads(ours, reference, (q, k, v, table, sinks), (0, 1, 2, 3, 4))


def test_relative_attention_softcap_and_sinks():
    q, k, v = qkv(10)
    a_k = arrays(11, (T, S, N, H))[0]
    sinks = sinks_for(True)
    allowed = allowed_loop(B, N, T, S, chunk_size=4)

    def ours(q, k, v, a_k, sinks):
        return jaxattn.relative_attention(q, k, v, a_k, chunk_size=4, logit_softcap=1.2, sinks=sinks)

    def reference(q, k, v, a_k, sinks):
        rel = jnp.einsum("btnh,tsnh->bnts", q, a_k, precision="highest")
        return attention_reference(q, k, v, allowed, logit_softcap=1.2, sinks=sinks, rel_logits=rel)

    check_forward_and_grads(ours, reference, (q, k, v, a_k, sinks), (0, 1, 2, 3, 4))


@pytest.mark.parametrize("implementation", ["blockwise"])
def test_alibi_bias_comes_after_softcap(implementation):
    q, k, v = qkv(12)
    slopes = jnp.asarray(np.linspace(0.1, 0.6, N))
    sinks = sinks_for(True)
    allowed = allowed_loop(B, N, T, S, is_causal=True, window=(4, 0))
    qp, kp = np.arange(T) + S - T, np.arange(S)
    distance = jnp.asarray(kp[None, :] - qp[:, None], jnp.float64)

    def ours(q, k, v, slopes, sinks):
        return jaxattn.alibi_attention(
            q,
            k,
            v,
            slopes,
            is_causal=True,
            window=(4, 0),
            logit_softcap=0.8,
            sinks=sinks,
            implementation=implementation,
            block_size=(3, 4) if implementation == "blockwise" else None,
        )

    def reference(q, k, v, slopes, sinks):
        bias = jnp.broadcast_to(slopes[:, None, None] * distance, (B, N, T, S))
        return attention_reference(q, k, v, allowed, logit_softcap=0.8, bias=bias, sinks=sinks)

    check_forward_and_grads(ours, reference, (q, k, v, slopes, sinks), (0, 1, 2, 3, 4))


SCHEMES = {
    "t5": lambda q, k, v, **kw: jaxattn.t5_attention(
        q, k, v, jnp.linspace(-1, 1, 16 * N).reshape(16, N), max_distance=20, **kw
    ),
    "alibi": lambda q, k, v, **kw: jaxattn.alibi_attention(q, k, v, jaxattn.alibi_slopes(N, dtype=jnp.float64), **kw),
    "rope": lambda q, k, v, **kw: jaxattn.rope_attention(q, k, v, rotary_dim=4, **kw),
    "xl": lambda q, k, v, **kw: jaxattn.transformer_xl_attention(
        q, k, v, jnp.linspace(0, 1, 9 * H).reshape(9, H), max_left=5, **kw
    ),
    "clipped": lambda q, k, v, **kw: jaxattn.clipped_relative_attention(
        q, k, v, jnp.ones((5, H)) * 0.1, max_left=3, max_right=1, **kw
    ),
    "shaw": lambda q, k, v, **kw: jaxattn.shaw_relative_attention(
        q, k, v, jnp.ones((5, H)) * 0.1, max_distance=2, **kw
    ),
}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_schemes_pass_mask_keywords_through(scheme):
    """window / chunk / segments on a scheme equal the same scheme with the equivalent bool mask."""
    q, k, v = qkv(13)
    kw = dict(window=(4, 1), chunk_size=5, query_segment_ids=SEGMENTS_Q, key_segment_ids=SEGMENTS_K)
    allowed = allowed_loop(B, N, T, S, **kw)
    got = SCHEMES[scheme](q, k, v, **kw)
    expected = SCHEMES[scheme](q, k, v, mask=jnp.asarray(allowed))
    assert_float64(got, expected)
    assert normwise(got, expected) <= TOL


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_schemes_take_sinks(scheme):
    """A sink is one more softmax column with zero value: a key of logit `sink` and value 0 on every row."""
    q, k, v = qkv(14)
    sinks = sinks_for(True, shape=(N,))
    got = SCHEMES[scheme](q, k, v, sinks=sinks, is_causal=True)
    assert got.shape == (B, T, N, Hv) and bool(jnp.all(jnp.isfinite(got)))
    without = SCHEMES[scheme](q, k, v, is_causal=True)
    # the sink only rescales each row: out_sink = out * (1 - p_sink), so the ratio lies strictly in (0, 1)
    ratio = np.asarray(got) / np.asarray(without)
    assert np.all((ratio > 0) & (ratio < 1))
    assert np.allclose(ratio, ratio[..., :1], rtol=1e-10)  # one factor per (b, t, n): same over Hv


# ---------------------------------------------------------------------------------------------------
# Multi-head functions


def test_multi_head_attention_keywords():
    E = 13
    params = jaxattn.init_multi_head_attention(
        jax.random.key(0), E, num_heads=N, num_kv_heads=K, head_dim=H, dtype=jnp.float64
    )
    x = arrays(15, (B, T, E))[0]
    sinks = sinks_for(True)
    kw = dict(window=(2, 0), logit_softcap=1.7, query_segment_ids=SEGMENTS_Q, key_segment_ids=SEGMENTS_Q)
    got = jax.jit(lambda p, x, s: jaxattn.multi_head_attention(p, x, sinks=s, **kw))(params, x, sinks)
    q = jnp.einsum("bte,enh->btnh", x, params["query"]["kernel"]) + params["query"]["bias"]
    k = jnp.einsum("bte,ekh->btkh", x, params["key"]["kernel"]) + params["key"]["bias"]
    v = jnp.einsum("bte,ekh->btkh", x, params["value"]["kernel"]) + params["value"]["bias"]
    allowed = allowed_loop(B, N, T, T, window=(2, 0), query_segment_ids=SEGMENTS_Q, key_segment_ids=SEGMENTS_Q)
    z = attention_reference(q, k, v, allowed, logit_softcap=1.7, sinks=sinks)
    expected = jnp.einsum("btnh,nho->bto", z, params["out"]["kernel"]) + params["out"]["bias"]
    assert_float64(got, expected)
    assert normwise(got, expected) <= TOL
    rel = jaxattn.init_relative_multi_head_attention(
        jax.random.key(1), E, num_heads=N, head_dim=H, max_distance=2, dtype=jnp.float64
    )
    y = jax.jit(lambda p, x, s: jaxattn.relative_multi_head_attention(p, x, sinks=s, **kw))(rel, x, sinks)
    assert y.shape == (B, T, E) and bool(jnp.all(jnp.isfinite(y)))


# ---------------------------------------------------------------------------------------------------
# Bad input: a ValueError naming the argument, at trace time.

BAD = [
    (dict(window=(-1, 0)), "window"),
    (dict(window=(1,)), "window"),
    (dict(window=(1.5, 0)), "window"),
    (dict(chunk_size=0), "chunk_size"),
    (dict(chunk_size=-3), "chunk_size"),
    (dict(logit_softcap=0.0), "logit_softcap"),
    (dict(logit_softcap=-1.0), "logit_softcap"),
    (
        dict(query_segment_ids=np.zeros((B, T + 1), np.int32), key_segment_ids=np.zeros((B, S), np.int32)),
        r"query_segment_ids.*\[2,8\]",
    ),
    (
        dict(query_segment_ids=np.zeros((B, T), np.float32), key_segment_ids=np.zeros((B, S), np.int32)),
        "query_segment_ids.*dtype",
    ),
    (
        dict(query_segment_ids=np.zeros((B, T), np.int32), key_segment_ids=np.zeros((3, S), np.int32)),
        r"key_segment_ids.*\[3,11\]",
    ),
    (dict(query_segment_ids=np.zeros((B, T), np.int32)), "key_segment_ids"),
    (dict(sinks=np.zeros((N + 1,))), r"sinks.*\[7\]"),
    (dict(sinks=np.zeros((3, N))), r"sinks.*\[3,6\]"),
    (dict(sinks=np.zeros((N,), np.int32)), "sinks.*dtype"),
]


@pytest.mark.parametrize("implementation", ["dense", "blockwise"])
@pytest.mark.parametrize("kwargs,match", BAD)
def test_bad_keywords(kwargs, match, implementation):
    q, k, v = qkv(16)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(
            lambda q, k, v: jaxattn.dot_product_attention(q, k, v, implementation=implementation, **kwargs), q, k, v
        )


# ---------------------------------------------------------------------------------------------------
# Block-sparse work: which key tiles a query tile visits (jaxattn._core.masks.key_block_schedule).


def visits(rule, i, L=64, block=8, **kw):
    from jaxattn._core.masks import key_block_schedule

    qp = jnp.arange(i * block, (i + 1) * block)
    schedule = key_block_schedule(rule, qp, jnp.arange(L), None, block, L // block, **kw)
    counts = [int(c) for c in schedule.counts]
    visited = sorted(int(j) for j in schedule.order[: sum(counts)])
    return visited, counts  # counts: (with mask_mod, masked, clean)


def test_windows_chunks_and_segments_skip_tiles():
    from jaxattn._core.masks import MaskRule

    # sliding window of 9 (left 8), causal, tiles of 8: the tile before (partly) and the diagonal (partly)
    assert visits(MaskRule(is_causal=True, window=(8, 0)), 5) == ([4, 5], [0, 2, 0])
    assert visits(MaskRule(is_causal=True, window=(8, 0)), 0) == ([0], [0, 1, 0])
    # a window of 24 to the left: two tiles entirely inside it run without a mask
    assert visits(MaskRule(is_causal=True, window=(24, 0)), 5) == ([2, 3, 4, 5], [0, 2, 2])
    # chunks of 16: the two tiles of the query tile's chunk; the earlier one is all allowed
    assert visits(MaskRule(is_causal=True, chunk_size=16), 5) == ([4, 5], [0, 1, 1])
    # 4 documents of 16 (sorted ids): the query tile's own document, both tiles clean (no causal rule)
    docs = jnp.repeat(jnp.arange(4), 16)[None]
    assert visits(MaskRule(), 5, query_segments=docs[:, 40:48], key_segments=docs) == ([4, 5], [0, 0, 2])
    # causal alone: the diagonal masked, everything before it clean
    assert visits(MaskRule(is_causal=True), 3) == ([0, 1, 2, 3], [0, 1, 3])
