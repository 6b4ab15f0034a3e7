"""The kernels' key-tile schedules (plan.schedules, tile_math.schedule): the compact form (runs of tiles per
query tile and per key tile, O(T / Tb + S / Sb) integers) against the general one (key_tile_kinds argsorted,
one integer per tile pair), which the same call gets when it passes the default positions explicitly.

Directly: both walk the same (tile, kind) steps in the same order, for every query tile (forward, dq) and
every key tile (dk/dv), and every tile with an allowed pair (allowed_loop, one pair at a time) is visited, and
a CLEAN one holds only allowed pairs. Through the kernels (Pallas' interpreter): the GPU kernels' outputs and
gradients with either schedule equal each other bit for bit and the float64 reference (<= 1e-12), and the TPU
flex kernel's forward likewise in float32.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jaxattn
from helpers import allowed_loop, arrays, attention_reference, check_forward_and_grads, normwise
from jaxattn._core.call import AttentionCall
from jaxattn._core.masks import CLEAN, MASKED, WITH_MOD
from jaxattn._kernels.flash import plan, tile_math


def _explicit_positions(T, S):
    """The core's default positions written out: the same mask, but the call has positions of its own."""
    return dict(query_positions=jnp.arange(T) + (S - T), key_positions=jnp.arange(S))


def _steps(steps):
    """[(tile, kind), ...] in the order tile_math.visit walks a Listed or Runs schedule (no mask_mod here)."""
    walked, first = [], 0
    for kind in (MASKED, CLEAN):
        count = int(steps.count(kind))
        walked += [(int(steps.tile(kind, first, idx)), kind) for idx in range(count)]
        first += count
    return walked


def _walks(side, transposed, B):
    """{(b, tile): steps} of every program of a prepared call's schedule (the dk/dv one when transposed), for
    each of the B batch entries (a schedule without a batch axis serves them all)."""
    order, counts = (side.t_order, side.t_counts) if transposed else (side.order, side.counts)
    counts = np.broadcast_to(counts, (B, *np.shape(counts)[1:]))
    order = None if order is None else np.broadcast_to(order, (B, *np.shape(order)[1:]))
    walks = {}
    for b in range(B):
        for i in range(counts.shape[2]):
            row = lambda k, b=b, i=i: counts[b, 0, i, k]  # noqa: E731
            listed = None if order is None else lambda idx, b=b, i=i: order[b, 0, i, idx]
            walks[b, i] = _steps(tile_math.schedule(row, listed))
    return walks


def _schedules_agree(B, T, S, Tb, Sb, is_causal=False, window=None, chunk_size=None, lengths=None):
    """prepare()'s compact and general schedules of one call walk the same steps, and those steps cover the
    allowed pairs (CLEAN tiles: only allowed pairs, no padding key)."""
    q, k = jnp.zeros((B, T, 1, 2)), jnp.zeros((B, S, 1, 2))
    rule = dict(is_causal=is_causal, window=window, chunk_size=chunk_size, key_value_seq_lengths=lengths)
    call = AttentionCall(block_size=(Tb, Sb), **rule)
    # one program for both schedules: prepare's eager ops one by one compile about 5x longer
    compact, general = jax.jit(
        lambda q, k: tuple(
            plan.prepare(c, q, k, k, True).side for c in (call, call.replace(**_explicit_positions(T, S)))
        )
    )(q, k)
    assert compact.order is None and compact.t_order is None  # the compact form was taken
    assert general.order is not None
    Tn, Sn = -(-T // Tb), -(-S // Sb)
    assert np.shape(compact.counts) in {(1, 1, Tn, 4), (B, 1, Tn, 4)}  # O(Tn), not O(Tn * Sn)
    allowed = allowed_loop(B, 1, T, S, **rule)[:, 0]
    compact, general = jax.tree.map(np.asarray, (compact, general))
    for transposed in (False, True):
        got, expected = _walks(compact, transposed, B), _walks(general, transposed, B)
        assert got == expected
        for (b, i), walk in got.items():
            for tile, kind in walk:
                qi, kj = (tile, i) if transposed else (i, tile)
                if kind == CLEAN:
                    assert allowed[b, qi * Tb : (qi + 1) * Tb, kj * Sb : (kj + 1) * Sb].all(), (b, qi, kj)
                    assert (kj + 1) * Sb <= S, (b, qi, kj)  # no padding key
            visited = {tile for tile, _ in walk}
            for other in range(Tn if transposed else Sn):
                qi, kj = (other, i) if transposed else (i, other)
                if allowed[b, qi * Tb : (qi + 1) * Tb, kj * Sb : (kj + 1) * Sb].any():
                    assert other in visited, (b, qi, kj)


def test_runs_walk_in_the_general_order_by_hand():
    """Runs (a0, c0, c1, a1) = (1, 3, 5, 7): MASKED 1, 2, 5, 6, then CLEAN 3, 4; an empty clean run."""
    assert _steps(tile_math.Runs(1, 3, 5, 7)) == [(1, MASKED), (2, MASKED), (5, MASKED), (6, MASKED)] + [
        (3, CLEAN),
        (4, CLEAN),
    ]
    assert _steps(tile_math.Runs(2, 4, 4, 4)) == [(2, MASKED), (3, MASKED)]
    assert tile_math.Runs(2, 4, 4, 4).count(WITH_MOD) == 0


def _slow(*args):
    return pytest.param(*args, marks=pytest.mark.slow)


@pytest.mark.parametrize(
    "shape, options",
    [
        _slow((1, 37, 37, 4, 8), dict(is_causal=True)),
        _slow((1, 23, 41, 4, 8), dict(is_causal=True)),  # T < S: queries at the bottom right
        _slow((1, 41, 23, 8, 4), dict(is_causal=True)),  # T > S: rows with no key
        ((1, 21, 26, 4, 4), dict(window=(6, 3))),  # masked tiles on both sides of the clean run
        _slow((1, 40, 40, 4, 4), dict(is_causal=True, window=(11, None))),
        _slow((1, 37, 29, 8, 4), dict(chunk_size=6)),
        _slow((2, 29, 31, 4, 8), dict(is_causal=True, lengths=np.array([13, 31]))),
        _slow((3, 19, 17, 2, 3), dict(lengths=np.array([0, 5, 17]))),
        _slow((1, 17, 19, 4, 4), dict()),  # nothing masks but the padding keys
    ],
)
def test_compact_schedule_walks_the_general_schedules_steps(shape, options):
    _schedules_agree(*shape, **options)


@pytest.mark.slow
@settings(max_examples=12, deadline=None)  # ~7 s an example (two prepares compiled): 12 random rules beside the 9 fixed
@given(
    data=st.data(),
    T=st.integers(1, 30),
    S=st.integers(1, 30),
    Tb=st.sampled_from([1, 2, 3, 4, 8]),
    Sb=st.sampled_from([1, 2, 5, 8]),
)
def test_compact_schedule_walks_the_general_schedules_steps_on_random_rules(data, T, S, Tb, Sb):
    side = st.one_of(st.none(), st.integers(0, 12))
    window = data.draw(st.one_of(st.none(), st.tuples(side, side)))
    B = data.draw(st.integers(1, 2))
    lengths = data.draw(st.one_of(st.none(), st.lists(st.integers(0, S), min_size=B, max_size=B).map(np.array)))
    _schedules_agree(
        B,
        T,
        S,
        Tb,
        Sb,
        is_causal=data.draw(st.booleans()),
        window=window if window != (None, None) else None,
        chunk_size=data.draw(st.one_of(st.none(), st.integers(1, 9))),
        lengths=lengths,
    )


# The kernels with either schedule: (batch, T, S, N, K, H, Hv), options, block_size
KERNEL_CASES = {
    "causal": ((1, 23, 23, 2, 2, 5, 3), dict(is_causal=True), (8, 4)),
    "window GQA": ((1, 29, 29, 4, 2, 5, 3), dict(window=(7, 2)), (4, 4)),
    "lengths T<S": ((2, 13, 31, 2, 1, 3, 5), dict(is_causal=True, key_value_seq_lengths=np.array([11, 26])), (4, 8)),
    "chunk T>S": ((1, 31, 19, 3, 3, 5, 3), dict(is_causal=True, chunk_size=7), (8, 4)),
}
SLOW_CASES = set(KERNEL_CASES)  # all: every default-group GPU kernel test runs the compact form already, and
# the default group walks both forms' steps directly (test_compact_schedule_walks_the_general_schedules_steps)


def _kernel_call(options, block_size, positions=None):
    def f(q, k, v):
        return jaxattn.dot_product_attention(
            q, k, v, implementation="pallas_gpu", interpret=True, block_size=block_size, **options, **(positions or {})
        )

    return f


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CASES else n for n in KERNEL_CASES]
)
def test_gpu_kernels_with_either_schedule_equal_the_float64_reference(name):
    (B, T, S, N, K, H, Hv), options, block_size = KERNEL_CASES[name]
    q, k, v = arrays(3, (B, T, N, H), (B, S, K, H), (B, S, K, Hv))
    allowed = allowed_loop(B, N, T, S, **options)

    def reference(q, k, v):
        return attention_reference(q, k, v, allowed)

    compact = _kernel_call(options, block_size)
    general = _kernel_call(options, block_size, _explicit_positions(T, S))
    check_forward_and_grads(compact, reference, (q, k, v), (0, 1, 2))
    # the same tiles in the same order: the same numbers, bit for bit
    w = arrays(5, (B, T, N, Hv))[0]
    both = [
        jax.jit(jax.value_and_grad(lambda *a, f=f: jnp.sum(f(*a) * w), argnums=(0, 1, 2))) for f in (compact, general)
    ]
    (out_c, grads_c), (out_g, grads_g) = (f(q, k, v) for f in both)
    np.testing.assert_array_equal(out_c, out_g)
    for c, g in zip(grads_c, grads_g, strict=True):
        np.testing.assert_array_equal(c, g)


@pytest.mark.slow
def test_tpu_flex_kernel_forward_with_either_schedule():
    """The flex kernel (score_mod: the compact schedule applies; its positions must be the default ones)
    against the same call with explicit positions, and the float64 reference, in float32 (the TPU kernels
    refuse x64)."""
    B, T, S, N, K, H, Hv = 2, 21, 34, 2, 1, 3, 5
    options = dict(is_causal=True, window=(19, None), key_value_seq_lengths=np.array([30, 17]))
    q, k, v = (np.asarray(x, np.float32) for x in arrays(4, (B, T, N, H), (B, S, K, H), (B, S, K, Hv)))

    def penalty(score, b, n, t, s):
        return score - 0.1 * (n + 1) * jnp.abs(t - s).astype(score.dtype)

    def run(**positions):
        return jaxattn.flex_attention(
            q, k, v, score_mod=penalty, implementation="pallas_tpu", interpret=True, **options, **positions
        )

    with jax.enable_x64(False):
        compact, general = run(), run(**_explicit_positions(T, S))
    np.testing.assert_array_equal(compact, general)
    allowed = allowed_loop(B, N, T, S, **options)
    expected = attention_reference(*(x.astype(np.float64) for x in (q, k, v)), allowed, score_mod=penalty)
    assert normwise(compact, expected) <= 1e-6
