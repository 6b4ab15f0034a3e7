"""Blockwise attention equals dense attention: float64, normwise 1e-12, outputs and gradients.

Every axis has its own (prime) size and tiles do not divide T or S, so swapped axes and padding bugs
fail. The property sweep covers batch dims, causal (bottom-right and custom positions), key lengths
(0 included: fully masked rows), grouped-query heads and Shaw tables (shared and per head). The option grid
that every implementation shares (fully masked rows included) is tests/test_contract.py's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxattn
from helpers import arrays, assert_float64, check_forward_and_grads, normwise
from jaxattn import _api as dispatch
from jaxattn._core import softmax
from jaxattn._core.call import GRID_KEYWORDS, AttentionCall
from jaxattn._core.positions import positions as core_positions
from jaxattn._engines import blockwise, tiles

jax.config.update("jax_enable_x64", True)

TOL = 1e-12


@st.composite
def configs(draw):
    batch = draw(st.sampled_from([(), (2,), (2, 3)]))
    T, S = draw(st.sampled_from([1, 5, 11, 13])), draw(st.sampled_from([1, 7, 13, 17]))
    K, G = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 3]))
    return dict(
        batch=batch,
        T=T,
        S=S,
        N=K * G,
        K=K,
        H=draw(st.sampled_from([2, 3])),
        Hv=draw(st.sampled_from([3, 5])),
        block=(draw(st.sampled_from([2, 3, 4, 16])), draw(st.sampled_from([2, 3, 5, 16]))),
        causal=draw(st.booleans()),
        lengths=draw(st.booleans()),
        positions=draw(st.booleans()),
        tables=draw(st.sampled_from([None, "key", "value", "both"])),
        shared=draw(st.booleans()),
        max_distance=draw(st.sampled_from([0, 1, 3])),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.slow  # 12 draws, each its own programs: ~40 s of compiling; the fixed cases below stay in the default run
@settings(max_examples=12, deadline=None)
@given(configs())
def test_blockwise_equals_dense(c):
    batch, T, S, N, K, H, Hv = (c[k] for k in ("batch", "T", "S", "N", "K", "H", "Hv"))
    R = 2 * c["max_distance"] + 1
    q, k, v, tk, tv = arrays(
        c["seed"],
        (*batch, T, N, H),
        (*batch, S, K, H),
        (*batch, S, K, Hv),
        (R, H) if c["shared"] else (R, N, H),
        (R, Hv) if c["shared"] else (R, N, Hv),
    )
    rng = np.random.default_rng(c["seed"] + 1)
    options = {"is_causal": c["causal"]}
    if c["lengths"]:
        options["key_value_seq_lengths"] = jnp.asarray(rng.integers(0, S + 2, size=batch), jnp.int32)
    if c["positions"]:  # shuffled absolute positions shared over the batch: blocks are not monotone
        options["query_positions"] = jnp.asarray(rng.permutation(T) * 2 + S - T, jnp.int32)
        options["key_positions"] = jnp.asarray(rng.permutation(S) * 2, jnp.int32)
    use_key = c["tables"] in ("key", "both")
    use_value = c["tables"] in ("value", "both")

    def attend(implementation):
        def f(q, k, v, tk, tv):
            if c["tables"] is None:
                return jaxattn.dot_product_attention(
                    q, k, v, implementation=implementation, block_size=c["block"], **options
                )
            return jaxattn.shaw_relative_attention(
                q,
                k,
                v,
                tk if use_key else None,
                tv if use_value else None,
                max_distance=c["max_distance"],
                implementation=implementation,
                block_size=c["block"],
                **options,
            )

        return f

    # Gradients that vanish in exact arithmetic come up in this sweep: a key table at max_distance 0 is a per-row
    # logit shift, which softmax ignores (its gradient is ~4e-16 of rounding residue in either path, and the two
    # residues differ by 100% of that), as can one key (S = 1) or empty key lengths. Relative error means nothing
    # there: gradients are measured against a floor of 1, the scale of these unit-normal problems. Outputs, and
    # every fixed case below, stay strictly relative.
    check_forward_and_grads(
        attend("blockwise"), attend("dense"), (q, k, v, tk, tv), (0, 1, 2, 3, 4), tol=TOL, grad_floor=1.0
    )


def test_batched_positions():
    q, k, v = arrays(1, (3, 5, 2, 3), (3, 7, 1, 3), (3, 7, 1, 2))
    rng = np.random.default_rng(2)
    q_pos = jnp.asarray(rng.integers(0, 9, size=(3, 5)), jnp.int32)
    k_pos = jnp.asarray(rng.integers(0, 9, size=(3, 7)), jnp.int32)
    tk = arrays(3, (5, 3))[0]

    def attend(implementation):
        return lambda q, k, v, tk: jaxattn.shaw_relative_attention(
            q,
            k,
            v,
            tk,
            max_distance=2,
            is_causal=True,
            query_positions=q_pos,
            key_positions=k_pos,
            implementation=implementation,
            block_size=(2, 3),
        )

    check_forward_and_grads(attend("blockwise"), attend("dense"), (q, k, v, tk), (0, 1, 2, 3))


# The backward takes the value table's bucket sums of p from the forward when they are no larger than the
# output (R = 2 * max_distance + 1 <= Hv = 5), and forms them again tile by tile otherwise: both paths,
# with several key tiles, causal, key lengths and shuffled query positions.
@pytest.mark.parametrize("max_distance", [pytest.param(1, marks=pytest.mark.slow), 2, 3])  # R = 3, 5 (kept),
# 7 (formed again); R = 3 takes R = 5's path: slow group
def test_value_table_gradient_either_way(max_distance):
    R = 2 * max_distance + 1
    q, k, v, tk, tv = arrays(21, (2, 11, 6, 3), (2, 13, 3, 3), (2, 13, 3, 5), (R, 6, 3), (R, 6, 5))
    rng = np.random.default_rng(22)
    options = dict(
        is_causal=True,
        key_value_seq_lengths=jnp.asarray([13, 6], jnp.int32),
        query_positions=jnp.asarray(rng.permutation(11) + 2),
        key_positions=jnp.arange(13),
    )

    def attend(implementation):
        return lambda q, k, v, tk, tv: jaxattn.shaw_relative_attention(
            q, k, v, tk, tv, max_distance=max_distance, implementation=implementation, block_size=(4, 5), **options
        )

    check_forward_and_grads(attend("blockwise"), attend("dense"), (q, k, v, tk, tv), (0, 1, 2, 3, 4))


def alibi_like(slopes):
    def bias(q_pos, k_pos):
        distance = jnp.abs(k_pos[..., None, :] - q_pos[..., :, None]).astype(slopes.dtype)
        return -slopes[:, None, None] * distance[..., None, :, :]

    return bias


@pytest.mark.parametrize("batched_positions", [pytest.param(False, marks=pytest.mark.slow), True])
def test_position_bias_hook_and_its_gradient(batched_positions):
    q, k, v, slopes = arrays(4, (2, 11, 6, 3), (2, 13, 3, 3), (2, 13, 3, 5), (6,))
    positions = {}
    if batched_positions:
        positions = {
            "query_positions": jnp.tile(jnp.arange(11) + 2, (2, 1)),
            "key_positions": jnp.tile(jnp.arange(13), (2, 1)),
        }
    q_pos, k_pos = core_positions(11, 13, positions.get("query_positions"), positions.get("key_positions"))

    def dense(q, k, v, slopes):
        bias = alibi_like(slopes)(q_pos, k_pos)
        return jaxattn.dot_product_attention(q, k, v, bias=bias, is_causal=True, implementation="dense", **positions)

    def block(q, k, v, slopes):
        return jaxattn.blockwise_attention(
            q, k, v, position_bias=alibi_like(slopes), is_causal=True, block_size=(4, 5), **positions
        )

    check_forward_and_grads(block, dense, (q, k, v, slopes), (0, 1, 2, 3))


def test_combine_partials_is_exact_over_any_split():
    (x, values) = arrays(5, (4, 9), (4, 9, 3))
    allowed = jnp.asarray(np.random.default_rng(6).random((4, 9)) < 0.6).at[0].set(False)

    def partial(cols):
        xs = jnp.where(allowed[:, cols], x[:, cols], -jnp.inf)
        m = xs.max(-1)
        p = jnp.exp(xs - jnp.where(jnp.isfinite(m), m, 0)[:, None])
        return (jnp.einsum("rs,rsf->rf", p, values[:, cols]),), m, p.sum(-1)

    (whole,), lse = softmax.finalize_partial(partial(slice(0, 9)))
    (merged,), lse2 = softmax.finalize_partial(
        softmax.combine_partials(
            softmax.combine_partials(partial(slice(0, 2)), partial(slice(2, 7))), partial(slice(7, 9))
        )
    )
    assert_float64(merged, whole, lse, lse2)
    assert normwise(merged, whole) <= TOL and bool(jnp.all(merged[0] == 0))
    # the engines' lse of an empty row is the finite no_key (no -inf under jax_debug_infs); public_lse: -inf
    assert bool(jnp.all(softmax.public_lse(lse)[0] == -jnp.inf)) and normwise(lse2[1:], lse[1:]) <= TOL


def test_vmap_and_jit_agree():
    q, k, v = arrays(7, (3, 5, 2, 3), (3, 7, 2, 3), (3, 7, 2, 2))

    def f(q, k, v):
        return jaxattn.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise", block_size=2)

    mapped, jitted = jax.vmap(f)(q, k, v), jax.jit(f)(q, k, v)
    assert_float64(mapped, jitted)
    assert normwise(mapped, jitted) <= TOL


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_accumulates_in_float32(dtype):
    """Half inputs give the float64 answer on those inputs, rounded once to the half dtype: the engine
    works in float32 throughout (probabilities included), so output and gradient carry only their final
    rounding. Rounding the probabilities to the half dtype before they meet the values, as the engine
    once did, costs about 13% more error than that and fails here."""
    q, k, v = arrays(8, (2, 37, 4, 16), (2, 41, 2, 16), (2, 41, 2, 16), dtype=np.float32)
    half = [a.astype(dtype) for a in (q, k, v)]
    wide = [a.astype(jnp.float64) for a in half]

    def out_and_dq(impl, dt):
        def f(q, k, v):
            return jaxattn.dot_product_attention(q, k, v, is_causal=True, implementation=impl, block_size=8)

        w = jnp.asarray(np.random.default_rng(9).normal(size=(2, 37, 4, 16)), dtype).astype(dt)  # same numbers
        return jax.jit(lambda *a: (f(*a), jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) * w).astype(jnp.float64))(*a)))

    got = out_and_dq("blockwise", dtype)(*half)
    exact = out_and_dq("dense", jnp.float64)(*wide)
    for g, e in zip(got, exact):
        assert g.dtype == dtype
        rounding = normwise(e.astype(dtype).astype(jnp.float64), e)
        assert 0 < normwise(g.astype(jnp.float64), e) <= 1.02 * rounding


def test_implementation_rule():
    small = jnp.zeros((1, 16, 2, 1))
    large = jnp.zeros((1, 1024, 8, 1))
    plain = AttentionCall()
    assert not dispatch.use_blockwise(None, plain, small, small)
    assert dispatch.use_blockwise(None, plain, large, large)
    # one head's T x S decides, whatever the batch and head counts (so vmap, which hides the batch, agrees)
    edge = int(np.sqrt(dispatch.AUTO_BLOCKWISE_ELEMENTS))
    for batch in ((), (1,), (64, 3)):
        assert dispatch.use_blockwise(None, plain, jnp.zeros((*batch, edge, 1, 1)), jnp.zeros((*batch, edge, 1, 1)))
        below = jnp.zeros((*batch, edge - 1, 8, 1))
        assert not dispatch.use_blockwise(None, plain, below, jnp.zeros((*batch, edge, 8, 1)))
    traced = jax.vmap(lambda q: jnp.asarray(dispatch.use_blockwise(None, plain, q, q)))(jnp.zeros((3, edge, 1, 1)))
    assert bool(jnp.all(traced))
    assert not dispatch.use_blockwise(None, AttentionCall(mask=jnp.ones((1024, 1024), bool)), large, large)
    assert not dispatch.use_blockwise(None, AttentionCall(return_weights=True), large, large)
    assert not dispatch.use_blockwise(None, AttentionCall(dropout_rate=0.1), large, large)
    assert dispatch.use_blockwise(None, AttentionCall(dropout_rate=0.0, is_causal=True), large, large)
    assert dispatch.use_blockwise("blockwise", plain, small, small)
    assert not dispatch.use_blockwise("dense", plain, large, large)


@pytest.mark.parametrize(
    "option", [{"mask": jnp.ones((5, 5), bool)}, {"bias": jnp.zeros((5, 5))}, {"return_weights": True}]
)
def test_blockwise_refuses_grid_options(option):
    q = jnp.ones((5, 2, 3))
    with pytest.raises(ValueError, match="blockwise attention does not take arbitrary masks"):
        jaxattn.dot_product_attention(q, q, q, implementation="blockwise", **option)
    jaxattn.dot_product_attention(q, q, q, implementation=None, **option)  # automatic: falls back to dense


def test_which_grid_keywords_blockwise_attention_refuses():
    """blockwise_attention takes dot_product_attention's grid keywords only to refuse them by name: mask,
    bias, return_weights and dropout_rate (ValueError, in that order); a dropout key alone needs no grid
    (the layers pass theirs either way) and changes nothing; any other keyword is a TypeError."""
    q = jnp.asarray(arrays(3, (5, 2, 3))[0])
    rng = jax.random.key(0)
    refused = {"mask": jnp.ones((5, 5), bool), "bias": jnp.zeros((5, 5)), "return_weights": True, "dropout_rate": 0.1}
    assert (*refused, "dropout_rng") == GRID_KEYWORDS  # the one list (jaxattn._core.call) both refusals read
    for name, value in refused.items():
        with pytest.raises(ValueError, match=f"with {name}: blockwise attention does not take"):
            jaxattn.blockwise_attention(q, q, q, **{name: value})
        with pytest.raises(ValueError, match=f"with {name}: blockwise attention does not take"):
            jaxattn.blockwise_attention(q, q, q, **{name: value, "dropout_rng": rng})
        with pytest.raises(ValueError, match=f"with {name}: blockwise attention does not take"):
            blockwise.tiled(AttentionCall(**{name: value}), q, q, q)  # the path the dispatch and kernels take
    with pytest.raises(ValueError, match="with mask/bias/return_weights/dropout_rate: blockwise"):
        jaxattn.blockwise_attention(q, q, q, **refused)
    alone = jaxattn.blockwise_attention(q, q, q, dropout_rng=rng, dropout_rate=0.0, return_weights=False)
    assert np.array_equal(alone, jaxattn.blockwise_attention(q, q, q))
    for other in ("broadcast_dropout", "implementation", "interpret"):
        with pytest.raises(TypeError, match=other):
            jaxattn.blockwise_attention(q, q, q, **{other: None})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"implementation": "flash"}, "implementation"),
        ({"implementation": "blockwise", "block_size": 0}, "block_size"),
        ({"implementation": "blockwise", "block_size": (2, 2, 2)}, "block_size"),
    ],
)
def test_bad_options(kwargs, match):
    q = jnp.ones((5, 2, 3))
    with pytest.raises(ValueError, match=match):
        jaxattn.dot_product_attention(q, q, q, **kwargs)


def test_position_bias_shape_is_checked():
    q = jnp.ones((5, 2, 3))
    with pytest.raises(ValueError, match="position_bias"):
        jaxattn.blockwise_attention(q, q, q, position_bias=lambda qp, kp: jnp.zeros((3, 5, 5)))


def test_multi_head_passes_implementation_through():
    params = jaxattn.init_relative_multi_head_attention(
        jax.random.key(0), 12, 4, max_distance=2, num_kv_heads=2, dtype=jnp.float64
    )
    (x,) = arrays(9, (2, 7, 12))
    for fn in (jaxattn.multi_head_attention, jaxattn.relative_multi_head_attention):
        relative = fn is jaxattn.relative_multi_head_attention
        p = params if relative else {k: v for k, v in params.items() if k != "relative"}
        dense = jax.jit(lambda p, x: fn(p, x, is_causal=True, implementation="dense"))(p, x)
        block = jax.jit(lambda p, x: fn(p, x, is_causal=True, implementation="blockwise", block_size=3))(p, x)
        assert_float64(block, dense)
        assert normwise(block, dense) <= TOL


# Row groups: blockwise_attention runs the engine over groups of (batch entry, key/value head) rows. The
# default group size (ROW_TILE_BYTES) makes one group of these small shapes, so the tests shrink it until
# every group is one row, or one batch entry with all its heads when a hook needs every head.
ROW_CASES = {
    "gqa-per-head-tables-lengths": dict(tables="per-head", lengths=True, positions=None, hook=False),
    "shared-tables-causal-positions": dict(tables="shared", lengths=False, positions="shared", hook=False),
    "batched-positions-per-head-tables": dict(tables="per-head", lengths=True, positions="batched", hook=False),
    "hook-shared-positions": dict(tables=None, lengths=True, positions=None, hook=True),
    "hook-batched-positions": dict(tables="shared", lengths=False, positions="batched", hook=True),
    "segments-sinks-window-softcap": dict(tables=None, lengths=True, positions=None, hook=False, modern=True),
}


# Four combinations in the slow group: each of their features is in a case or test kept in the default run
# (per-head tables and lengths: gqa-per-head-tables-lengths; positions: shared-tables-causal-positions).
_SLOW_ROWS = {
    "batched-positions-per-head-tables",
    "hook-shared-positions",
    "hook-batched-positions",  # the hook alone: test_position_bias_hook_and_its_gradient
    "segments-sinks-window-softcap",  # these options without tables: tests/test_contract.py
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in _SLOW_ROWS else n for n in sorted(ROW_CASES)]
)
def test_row_groups_equal_dense(name, monkeypatch):
    c = ROW_CASES[name]
    B, T, S, N, K, H, Hv, md = 3, 11, 13, 6, 2, 3, 5, 2
    R = 2 * md + 1
    q, k, v, tk, tv, slopes, sinks = arrays(
        11,
        (B, T, N, H),
        (B, S, K, H),
        (B, S, K, Hv),
        (R, N, H) if c["tables"] == "per-head" else (R, H),
        (R, N, Hv) if c["tables"] == "per-head" else (R, Hv),
        (N,),
        (B, N),
    )
    block = (4, 5)
    monkeypatch.setattr(tiles, "ROW_TILE_BYTES", 4 * (N // K) * block[0] * block[1])  # one row a group
    whole = None if not c["hook"] else "all" if c["positions"] == "batched" else "heads"
    assert tiles.row_groups(B, K, N // K, *block, whole) == {None: (1, 1), "heads": (1, K), "all": (B, K)}[whole]
    rng = np.random.default_rng(12)
    options = {"is_causal": True}
    if c["lengths"]:
        options["key_value_seq_lengths"] = jnp.asarray([0, S, 6], jnp.int32)
    if c["positions"] == "shared":
        options.update(query_positions=jnp.asarray(rng.permutation(T) + 3), key_positions=jnp.arange(S))
    elif c["positions"] == "batched":
        options.update(
            query_positions=jnp.asarray(rng.integers(0, 15, size=(B, T))),
            key_positions=jnp.asarray(rng.integers(0, 15, size=(B, S))),
        )
    if c.get("modern"):  # per-row segment ids and sinks, a window, a softcap: each split by row group
        options.update(
            query_segment_ids=jnp.asarray(rng.integers(0, 2, size=(B, T))),
            key_segment_ids=jnp.asarray(rng.integers(0, 2, size=(B, S))),
            window=(4, 1),
            logit_softcap=3.0,
        )
    q_pos, k_pos = core_positions(T, S, options.get("query_positions"), options.get("key_positions"))
    tables = c["tables"] is not None

    def dense(q, k, v, tk, tv, slopes, sinks):
        bias = alibi_like(slopes)(q_pos, k_pos) if c["hook"] else None
        extra = {"sinks": sinks} if c.get("modern") else {}
        if not tables:
            return jaxattn.dot_product_attention(q, k, v, bias=bias, implementation="dense", **options, **extra)
        return jaxattn.shaw_relative_attention(
            q, k, v, tk, tv, max_distance=md, bias=bias, implementation="dense", **options
        )

    def block_fn(q, k, v, tk, tv, slopes, sinks):
        extra = {"sinks": sinks} if c.get("modern") else {}
        return jaxattn.blockwise_attention(
            q,
            k,
            v,
            key_table=tk if tables else None,
            value_table=tv if tables else None,
            max_distance=md if tables else None,
            position_bias=alibi_like(slopes) if c["hook"] else None,
            block_size=block,
            **options,
            **extra,
        )

    argnums = (0, 1, 2) + ((3, 4) if tables else ()) + ((5,) if c["hook"] else ()) + ((6,) if c.get("modern") else ())
    check_forward_and_grads(block_fn, dense, (q, k, v, tk, tv, slopes, sinks), argnums)
