"""T5 and ALiBi inside the Pallas GPU kernel (issue 34): their position bias as an OffsetBias (a function of
j - i alone), gathered per tile from rows computed outside the kernel, its gradient scattered back by offset.
And in the Pallas TPU flex kernel's forward (each tile's bias a slice of those rows moved into place by a strided
roll, refs_tpu.toeplitz_tile; the gradient the XLA blockwise backward's): every case but positions of their own
(refused there), slow; toeplitz_tile against numpy in the default group.

Interpret mode (Pallas' interpreter on this CPU), float32 at highest precision: outputs <= 1e-6 and gradients
(q, k, v and the T5 table / ALiBi slopes) <= 1e-5, normwise, against the float64 references of tests/helpers.py:
attention_loop for the outputs (with the bias from T5's bucket loop of tests/test_positions.py or ALiBi's
slope * (j - i), written out here), attention_reference's jax.grad for the gradients, and the dense engine in
float64 on the same numbers for both. Every axis its own size, T != S, lengths that are not multiples of the
interpreter's 16-wide tiles, grouped-query heads, T5 bidirectional and causal with max_distance below and above
a tile, per-example ALiBi slopes, T5 with positions of its own, and T5 beside score_mod, mask_mod, a window,
softcap and sinks; float64 (exact) and bf16 (a measured envelope). The default group runs one case forward and
backward under jit (9 s cold on 2 busy cores: the interpreted kernels compile slowly); the other cases, vmap,
float64 and bf16 are slow.

Lowered for CUDA at T = S = 4096 bf16 (about a second each: nothing is compiled): the kernel's Triton custom
calls, no [T,S] value computed, no XLA tile loop, forward and forward+backward, for implementation=None (default
group) and "pallas_gpu" (slow).
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_positions import bucket_loop

import jaxattn
from helpers import allowed_loop, attention_loop, attention_reference, normwise
from jaxattn._core.call import AttentionCall
from jaxattn._core.offset_bias import OffsetBias
from jaxattn._kernels import flex_tpu, pallas_gpu, pallas_tpu, refs_tpu
from jaxattn._kernels.flash import plan

OUT_TOL, GRAD_TOL = 1e-6, 1e-5

# name: (batch, T, S, N, K, H, Hv, scheme options, attention options)
CASES = {
    # max_distance 3 < a tile: saturation 6 clips the rows to offsets -6..6, and the corner tiles lie wholly
    # past it (every pair reads row -6 or +6: the dq kernel adds their sum once, _scatter_by_offset)
    "t5 bidirectional": ((2,), 37, 41, 6, 2, 5, 3, dict(bidirectional=True, max_distance=3), dict()),
    # max_distance 40 > a tile and > S: every offset its own row; causal T5
    "t5 causal": ((2,), 13, 29, 6, 3, 7, 5, dict(bidirectional=False, max_distance=40), dict(is_causal=True)),
    "alibi causal": ((3,), 17, 31, 4, 2, 5, 3, dict(bidirectional=False), dict(is_causal=True)),
    # per-example slopes [B,N], key lengths and softcap beside the bias
    "alibi bidirectional batched slopes": (
        (2,),
        23,
        19,
        6,
        3,
        5,
        7,
        dict(bidirectional=True, per_example=True),
        dict(key_value_seq_lengths=np.array([19, 11]), logit_softcap=2.5),
    ),
    # T5 with positions of its own: the saturation bounds the offsets (rows -2 M..2 M, indices clipped)
    "t5 positions": (
        (2,),
        11,
        17,
        4,
        2,
        5,
        3,
        dict(bidirectional=True, max_distance=6),
        dict(positions=True, is_causal=True),
    ),
}


def _score_mod(x, b, n, t, s):  # closes over no array: a GPU runs it too
    return x * 0.7 + 0.01 * (t - s)


def _mask_mod(b, n, t, s):
    return (t - s) % 4 != 1


# every other option of the kernel beside the bias: score_mod (after the bias), mask_mod, window, softcap, sinks
CASES["t5 with the other options"] = (
    (2,),
    19,
    23,
    6,
    3,
    5,
    3,
    dict(bidirectional=True, max_distance=7),
    dict(
        score_mod=_score_mod,
        mask_mod=_mask_mod,
        window=(9, 3),
        logit_softcap=3.0,
        sinks=np.array([0.5, -1.0, 0.25, 2.0, -0.5, 1.0], np.float32),
    ),
)
DEFAULT_CASE = "t5 bidirectional"
NUM_BUCKETS = 10


def _params(scheme, batch, N, options, seed=3):
    rng = np.random.default_rng(seed)
    if scheme == "t5":
        return rng.normal(size=(NUM_BUCKETS, N)).astype(np.float32)
    shape = (*batch, N) if options.get("per_example") else (N,)
    return rng.uniform(0.05, 0.9, size=shape).astype(np.float32)


def _positions(batch, T, S, seed=5):
    """Batched, non-contiguous positions: gaps and repeats, far from the defaults."""
    rng = np.random.default_rng(seed)
    qp = np.sort(rng.integers(100, 160, size=(*batch, T)), axis=-1).astype(np.int32)
    kp = np.sort(rng.integers(90, 170, size=(*batch, S)), axis=-1).astype(np.int32)
    return qp, kp


def _bias_loop(scheme, params, options, qp, kp, N):
    """float64 [B,N,T,S]: T5's table at bucket_loop(j - i) or ALiBi's slope * (j - i) (-|j - i| bidirectional),
    one pair at a time."""
    B, T, S = qp.shape[0], qp.shape[-1], kp.shape[-1]
    bias = np.zeros((B, N, T, S))
    for b in range(B):
        for t in range(T):
            for s in range(S):
                d = int(kp[b, s]) - int(qp[b, t])
                for n in range(N):
                    if scheme == "t5":
                        r = bucket_loop(d, options["bidirectional"], NUM_BUCKETS, options["max_distance"])
                        bias[b, n, t, s] = params[r, n]
                    else:
                        slope = params[b, n] if params.ndim == 2 else params[n]
                        bias[b, n, t, s] = slope * (-abs(d) if options["bidirectional"] else d)
    return bias


def _scheme_fn(scheme, options):
    """f(q, k, v, params, **attention keywords) through the public scheme function."""
    if scheme == "t5":
        kw = dict(bidirectional=options["bidirectional"], max_distance=options["max_distance"])
        return lambda q, k, v, table, **a: jaxattn.t5_attention(q, k, v, table, **kw, **a)
    return lambda q, k, v, slopes, **a: jaxattn.alibi_attention(
        q, k, v, slopes, bidirectional=options["bidirectional"], **a
    )


def _setup(name):
    batch, T, S, N, K, H, Hv, scheme_options, attention_options = CASES[name]
    scheme = name.split()[0]
    rng = np.random.default_rng(11)
    q, k, v, w = (
        rng.normal(size=shape).astype(np.float32)
        for shape in ((*batch, T, N, H), (*batch, S, K, H), (*batch, S, K, Hv), (*batch, T, N, Hv))
    )
    params = _params(scheme, batch, N, scheme_options)
    attention_options = dict(attention_options)
    if attention_options.pop("positions", False):
        qp, kp = _positions(batch, T, S)
        attention_options.update(query_positions=qp, key_positions=kp)
    return scheme, scheme_options, attention_options, (q, k, v, params), w, N


def _loss_and_grads(f, args, w):
    @jax.jit
    def run(*args):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(jnp.asarray(w, out.dtype))

    return run(*args)


def _check(name, dtype=np.float32, tolerances=(OUT_TOL, GRAD_TOL, GRAD_TOL), implementation="pallas_gpu"):
    """The kernel (`implementation`) on `dtype` inputs (the table / slopes: float32, or float64 with float64
    inputs) against the float64 references on the same rounded numbers, normwise: tolerances = (outputs,
    gradients of q, k, v, gradient of the table / slopes)."""
    scheme, scheme_options, options, args, w, N = _setup(name)
    params_dtype = np.float64 if dtype == np.float64 else np.float32
    args = (*(jnp.asarray(x, dtype) for x in args[:3]), jnp.asarray(args[3], params_dtype))
    q, k, v, params = args
    out_tol, grad_tol, param_tol = tolerances
    batch, T, S = q.shape[:-3], q.shape[-3], k.shape[-3]
    f = _scheme_fn(scheme, scheme_options)
    scale = 1.0 if scheme == "t5" else None  # t5_attention's default scale is 1, as T5's

    def kernel(*a):
        return f(*a, implementation=implementation, interpret=True, precision="highest", **options)

    def dense(*a):
        return f(*a, implementation="dense", precision="highest", **options)

    # the Pallas TPU kernels index in int32: they run with jax_enable_x64 off (its float32 is all they take)
    with jax.enable_x64(False) if implementation == "pallas_tpu" else contextlib.nullcontext():
        out, grads = _loss_and_grads(kernel, args, w)
    assert out.dtype == dtype

    # the float64 loop of the formula
    qp = np.broadcast_to(options.get("query_positions", np.arange(T) + S - T), (*batch, T))
    kp = np.broadcast_to(options.get("key_positions", np.arange(S)), (*batch, S))
    bias = _bias_loop(scheme, np.asarray(params, np.float64), scheme_options, qp, kp, N)
    rules = {
        n: options[n]
        for n in ("is_causal", "key_value_seq_lengths", "query_positions", "key_positions", "window", "mask_mod")
        if n in options
    }
    softcap = options.get("logit_softcap")
    extra = {n: options[n] for n in ("score_mod", "sinks") if n in options}
    want, _ = attention_loop(
        *(np.asarray(x, np.float64) for x in (q, k, v)), bias=bias, scale=scale, logit_softcap=softcap, **rules, **extra
    )
    assert normwise(out, want) <= out_tol, normwise(out, want)

    # gradients: attention_reference (helpers) with the bias rebuilt differentiably from the same rows
    allowed = allowed_loop(batch, N, T, S, **rules)
    d = kp[:, None, :] - qp[:, :, None]  # [B,T,S]
    if scheme == "t5":
        buckets = np.vectorize(
            lambda x: bucket_loop(int(x), scheme_options["bidirectional"], NUM_BUCKETS, scheme_options["max_distance"])
        )(d)
        bias_of = lambda p: jnp.moveaxis(p[buckets], -1, -3)  # noqa: E731
    else:
        g = -np.abs(d) if scheme_options["bidirectional"] else d
        bias_of = lambda p: (p[..., :, None, None] if p.ndim == 2 else p[:, None, None]) * g[:, None]  # noqa: E731

    def reference(q, k, v, p):
        positions = {n: rules[n] for n in ("query_positions", "key_positions") if n in rules}
        return attention_reference(
            q, k, v, allowed, bias=bias_of(p), scale=scale, logit_softcap=softcap, **extra, **positions
        )

    wide = tuple(np.asarray(x, np.float64) for x in args)
    want_out, want_grads = _loss_and_grads(reference, wide, w)
    assert normwise(want_out, want) <= 1e-12  # the two references agree
    dense_out, dense_grads = _loss_and_grads(dense, wide, w)
    assert normwise(dense_out, want) <= 1e-12
    for got, ref, eng, arg, what in zip(grads, want_grads, dense_grads, args, ("q", "k", "v", "table / slopes")):
        assert got.dtype == arg.dtype, what
        assert normwise(eng, ref) <= 1e-12, what
        assert normwise(got, ref) <= (param_tol if arg is params else grad_tol), (what, normwise(got, ref))
    return normwise(out, want), [normwise(g, r) for g, r in zip(grads, want_grads)]


@pytest.mark.parametrize("name", [n if n == DEFAULT_CASE else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_kernel_matches_the_float64_loop(name):
    _check(name)


@pytest.mark.slow  # about 10 s each in the interpreter
@pytest.mark.parametrize("name", [n for n in CASES if n != "t5 positions"])  # refused: no contiguous offsets
def test_tpu_kernel_matches_the_float64_loop(name):
    """flex_tpu's forward (each tile's bias a Toeplitz matrix of the rows, toeplitz_tile) and its gradient,
    the XLA blockwise backward, into the table / slopes too (closure-converted out of the hook)."""
    _check(name, implementation="pallas_tpu")


def test_toeplitz_tile_against_numpy():
    """refs_tpu.toeplitz_tile: tile[r, c] = row[start + Tb - 1 - r + c], for starts at, inside and at the end
    of a lane tile (the aligned load and the roll that follows), on tiles of the interpreter's and a TPU's
    size, in the interpreter (the Mosaic lowering: .ci/compile_targets.py's "t5 causal" / "alibi causal")."""
    from jax.experimental import pallas as pl

    rng = np.random.default_rng(7)
    for Tb, Sb in ((16, 40), (128, 128)):
        starts = np.array([0, 5, 127, 128, 131, 300], np.int32)
        E = 300 + refs_tpu.window(Tb, Sb) + 128
        row = rng.normal(size=(1, E)).astype(np.float32)

        def kernel(start_ref, row_ref, out_ref, Tb=Tb, Sb=Sb):
            out_ref[...] = refs_tpu.toeplitz_tile(row_ref, start_ref[pl.program_id(0)], Tb, Sb)

        grid = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(len(starts),),
            in_specs=[pl.BlockSpec((1, E), lambda j, *_: (0, 0))],
            out_specs=pl.BlockSpec((None, Tb, Sb), lambda j, *_: (j, 0, 0)),
        )
        with jax.enable_x64(False):
            got = pl.pallas_call(
                kernel,
                grid_spec=grid,
                out_shape=jax.ShapeDtypeStruct((len(starts), Tb, Sb), jnp.float32),
                interpret=True,
            )(jnp.asarray(starts), jnp.asarray(row))
        r, c = np.mgrid[:Tb, :Sb]
        want = np.stack([row[0, start + Tb - 1 - r + c] for start in starts])
        np.testing.assert_array_equal(np.asarray(got), want)


def test_the_default_case_has_tiles_past_the_saturation():
    """What the default case covers: interpreted tiles (16 x 16) whose pairs all read one row, and tiles whose
    pairs read several (the dq kernel's two ways of adding the rows' gradient)."""
    batch, T, S, *_, scheme_options, _ = CASES[DEFAULT_CASE]
    M = 2 * scheme_options["max_distance"]
    d = np.arange(S)[None, :] - (np.arange(T) + S - T)[:, None]
    Tp, Sp = -(-T // 16) * 16, -(-S // 16) * 16
    d = np.pad(np.clip(d, -M, M), [(0, Tp - T), (0, Sp - S)], mode="edge")  # padding repeats the last position
    tiles = d.reshape(Tp // 16, 16, Sp // 16, 16).swapaxes(1, 2).reshape(Tp // 16, Sp // 16, -1)
    distinct = np.array([[len(set(tile)) for tile in row] for row in tiles])
    assert (distinct == 1).any() and (distinct > 1).any(), distinct


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5 bidirectional", "alibi bidirectional batched slopes"])
def test_kernel_in_float64_is_exact(name):
    """float64 inputs (the interpreter runs them): every term, the rows' scatter-add included, in float64."""
    _check(name, np.float64, (1e-12, 1e-12, 1e-12))


# bf16 inputs against the float64 reference of the same rounded numbers, measured over CASES: outputs <= 1.9e-3
# (the dense engine in bf16: 2.4e-3), q / k / v gradients <= 5.4e-3 (dense 3.3e-3), table / slopes <= 9.4e-3
# (dense 3.2e-3; ALiBi causal). The kernel's backward takes delta = rowsum(dO * O) from the bf16 output, as
# FlashAttention does: a per-row error that the softmax gradient of q and k mostly cancels, and the slopes'
# sum_{t,s} ds (j - i) does not. The envelope: 5e-3 / 8e-3 (the contract suite's bf16 bars) and 1.5e-2.
BF16_TOLERANCES = (5e-3, 8e-3, 1.5e-2)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("name", ["t5 causal", "alibi causal"])
def test_kernel_in_bf16_within_the_envelope(name, implementation):
    """pallas_tpu (its forward; the XLA blockwise backward), measured: t5 causal outputs 1.8e-3, gradients
    <= 2.5e-3 (table 2.0e-3); per-example ALiBi slopes bidirectional 1.9e-3, <= 2.4e-3 (slopes 6.7e-4)."""
    import ml_dtypes

    _check(name, ml_dtypes.bfloat16, BF16_TOLERANCES, implementation)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["pallas_gpu", "pallas_tpu"])
def test_under_vmap(kernel):
    """vmap over a batch axis the kernel does not see (the Pallas call's batching rule adds a grid axis)."""
    scheme, scheme_options, options, (q, k, v, table), w, N = _setup("t5 causal")
    f = _scheme_fn(scheme, scheme_options)

    def one(impl):
        extra = dict(interpret=True) if impl == kernel else {}

        def loss(q, k, v, table):
            out = jax.vmap(
                lambda q, k, v: f(q, k, v, table, implementation=impl, precision="highest", **extra, **options)
            )(q, k, v)
            return jnp.sum(out * w)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, table)

    with jax.enable_x64(False) if kernel == "pallas_tpu" else contextlib.nullcontext():
        (got, got_grads), (want, want_grads) = one(kernel), one("dense")
    assert normwise(got, want) <= OUT_TOL
    for g, e in zip(got_grads, want_grads):
        assert normwise(g, e) <= GRAD_TOL


# ---------------------------------------------------------------------------------------------------------
# the OffsetBias's promises, and what the kernels refuse


def test_t5_saturation_holds_over_every_offset():
    """T5's OffsetBias promises of_offset(d) == of_offset(clip(d, -M, M)) for M = 2 max_distance: checked on
    every offset up to 2 M (and a few far ones) against the bucket loop, with a table whose rows hold their
    own bucket ids, over small and large max_distance, bidirectional and causal."""
    for num_buckets, max_distance in [(32, 128), (10, 6), (8, 5), (6, 300)]:
        table = jnp.arange(num_buckets, dtype=jnp.float32)[:, None]  # [R,1]: row r holds r
        for bidirectional in (True, False):
            hook = jaxattn.t5_position_bias(table, bidirectional=bidirectional, max_distance=max_distance)
            assert isinstance(hook, OffsetBias) and hook.saturation == 2 * max_distance
            M = hook.saturation
            d = np.concatenate([np.arange(-2 * M, 2 * M + 1), [-(2**30), -10 * M, 10 * M, 2**30]]).astype(np.int32)
            of_offset = jax.jit(lambda d: hook.of_offset(d[None])[0, 0].astype(jnp.int32))
            rows, clipped = np.asarray(of_offset(d)), np.asarray(of_offset(np.clip(d, -M, M)))
            np.testing.assert_array_equal(rows, clipped)
            want = [bucket_loop(int(x), bidirectional, num_buckets, max_distance) for x in d]
            np.testing.assert_array_equal(rows, want)


def test_offset_bias_rows_and_range():
    """rows(lo, hi) is the hook on one row of offsets; offset_range covers every offset of the defaults."""
    slopes = jnp.asarray([0.5, 0.25, 0.125])
    hook = jaxattn.alibi_position_bias(slopes, bidirectional=True)
    assert isinstance(hook, OffsetBias) and hook.saturation is None
    np.testing.assert_array_equal(hook.rows(-4, 2), -np.asarray(slopes)[:, None] * np.abs(np.arange(-4, 3)))
    T, S = 5, 9
    lo, hi = hook.offset_range(T, S, default_positions=True)
    d = np.arange(S)[None, :] - (np.arange(T) + S - T)[:, None]
    assert (lo, hi) == (d.min(), d.max()) == (-(S - 1), T - 1)
    assert hook.offset_range(T, S, default_positions=False) is None
    t5 = jaxattn.t5_position_bias(jnp.zeros((8, 3)), max_distance=3)
    assert t5.offset_range(T, S, True) == (-6, 4) and t5.offset_range(T, S, False) == (-6, 6)


def test_what_the_kernels_refuse():
    q = k = v = jnp.zeros((2, 7, 3, 4), jnp.float32)
    alibi = jaxattn.alibi_position_bias(jnp.ones(3))
    t5 = jaxattn.t5_position_bias(jnp.zeros((8, 3)), max_distance=5)
    positions = dict(query_positions=jnp.arange(7), key_positions=jnp.arange(7))

    def refusal(kernel, interpret=False, **options):
        return kernel.unsupported(AttentionCall(**options), q, k, v, interpret)

    assert refusal(pallas_gpu, position_bias=t5) is None
    assert refusal(pallas_gpu, position_bias=alibi, is_causal=True) is None
    assert refusal(pallas_gpu, position_bias=t5, **positions) is None  # the saturation bounds the offsets
    assert refusal(pallas_gpu, position_bias=alibi, **positions).startswith("query_positions")
    assert refusal(pallas_gpu, position_bias=alibi, key_positions=jnp.arange(7)).startswith("key_positions")
    assert refusal(pallas_gpu, position_bias=lambda qp, kp: jnp.zeros(())) == "position_bias"  # not an OffsetBias
    # The TPU flex kernel builds a tile's bias from its contiguous offsets: the core's default positions only
    for interpret in (False, True):
        assert refusal(flex_tpu, interpret, position_bias=t5, **positions).startswith("query_positions")
        assert refusal(flex_tpu, interpret, position_bias=alibi, key_positions=jnp.arange(7)).startswith("key_pos")
        assert refusal(flex_tpu, interpret, position_bias=lambda qp, kp: jnp.zeros(())) == "position_bias"
        with jax.enable_x64(False):
            assert refusal(pallas_tpu, interpret, position_bias=t5) is None  # taken by flex_tpu, not splash
            assert refusal(pallas_tpu, interpret, position_bias=alibi, is_causal=True) is None
    # an explicit kernel names it; None falls back to the XLA engines with the same answer
    with pytest.raises(ValueError, match="query_positions"):
        jaxattn.alibi_attention(q, k, v, jnp.ones(3), implementation="pallas_gpu", interpret=True, **positions)
    with jax.enable_x64(False), pytest.raises(ValueError, match="query_positions"):
        jaxattn.t5_attention(
            q, k, v, jnp.zeros((8, 3)), max_distance=5, implementation="pallas_tpu", interpret=True, **positions
        )
    assert plan.position_bias_refusal(AttentionCall(), 7, 7) is None


# ---------------------------------------------------------------------------------------------------------
# lowered for CUDA

T_LONG = 4096
TRITON = "__gpu$xla.gpu.triton"


def _lowered(fn, *args):
    with jax.enable_x64(False), jaxattn.cross_platform_lowering():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _long_scheme(scheme, implementation):
    def forward(q, params):
        if scheme == "t5":
            return jaxattn.t5_attention(
                q, q, q, params, bidirectional=False, is_causal=True, implementation=implementation
            )
        return jaxattn.alibi_attention(q, q, q, params, is_causal=True, implementation=implementation)

    return forward


@pytest.mark.parametrize(
    "scheme, program, implementation",
    [(s, p, None) for s in ("t5", "alibi") for p in ("forward", "forward+backward")]
    + [pytest.param(s, "forward+backward", "pallas_gpu", marks=pytest.mark.slow) for s in ("t5", "alibi")],
)
def test_lowered_for_cuda_is_the_kernel(scheme, program, implementation):
    N = 8
    q = jax.ShapeDtypeStruct((1, T_LONG, N, 128), jnp.bfloat16)
    params = jax.ShapeDtypeStruct((32, N) if scheme == "t5" else (N,), jnp.float32)
    forward = _long_scheme(scheme, implementation)
    if program == "forward":
        fn = forward
    else:
        fn = jax.grad(lambda q, p: jnp.sum(forward(q, p).astype(jnp.float32)), argnums=(0, 1))
    text = _lowered(fn, q, params)
    kernels = set(re.findall(r'name = "(jaxattn_flash_\w+)"', text))
    want = {"jaxattn_flash_forward"} | ({"jaxattn_flash_dq", "jaxattn_flash_dkv"} if program != "forward" else set())
    assert TRITON in text and kernels == want, kernels
    assert "stablehlo.while" not in text, "an XLA tile loop"
    # No [T,S] value is computed. Under implementation=None and a gradient, JAX's platform switch (a cond)
    # returns the residuals of every branch, each branch filling the others' with zeros: the XLA branch's
    # dense engine (the CPU fallback) keeps [N,T,S] residuals, so the CUDA program holds zero fills of that
    # shape, which nothing reads: XLA removes them (.ci/compile_targets.py's "None t5", compiled for the H100:
    # 8.3 MiB of temp at T = S = 4096, as with implementation="pallas_gpu", 2.0x that at twice the lengths;
    # one [8,T,S] float32 residual alone is 512 MiB). Those fills and their passing between the switch's
    # functions are the only [T,S] lines allowed.
    long_pair = re.compile(rf"[<x]{T_LONG}x{T_LONG}x(f32|bf16|f16|i1|i32)>")
    for line in text.splitlines():
        if not long_pair.search(line):
            continue
        op = re.search(r"= ([\w.]+)", line)
        assert implementation is None and program != "forward", f"a [T,S] buffer: {line.strip()[:200]}"
        if op is None or op.group(1) == "call":  # function signatures, returns, calls: plumbing
            continue
        assert op.group(1) == "stablehlo.broadcast_in_dim" and re.search(r": \(tensor<\w+>\) ->", line), line[:200]
