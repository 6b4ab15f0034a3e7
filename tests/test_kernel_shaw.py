"""Shaw's clipped relative tables inside the Pallas GPU kernel (issue 34): shaw_relative_attention,
clipped_relative_attention and Transformer-XL (through shaw_form) with implementation="pallas_gpu".

Interpret mode (Pallas' interpreter on this CPU), float32 at highest precision: outputs <= 1e-6 against the
float64 loop of the formula (helpers.attention_loop with A^K / A^V = the tables at shaw_index_loop's rows, or
test_positions.xl_loop), gradients of q, k, v and both tables <= 1e-5 against the dense engine in float64
(whose forward agrees with the loop to 1e-12), normwise. Every axis its own size, T != S, lengths that are not
multiples of the interpreter's 16-wide tiles, grouped-query heads, per-head and shared tables, key table only,
value table only, max_distance below a tile and above it (and above S), causal and not, positions of their own,
the kernel's other options beside the tables; under jit (every case), vmap and grad; bf16 inputs within the
contract's envelope. The default group runs one case forward and backward; the others are slow (the
interpreted kernels compile slowly).

Lowered for CUDA at T = S = 4096 bf16 (nothing compiled): implementation=None takes the kernel (its Triton
calls, no [T,S] value, no XLA tile loop) for Shaw, the asymmetric clip and Transformer-XL, forward and
forward+backward.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_positions import N as XL_HEADS, xl_loop

import jaxattn
from helpers import assert_float64, attention_loop, normwise, shaw_index_loop, value_and_vjp
from jaxattn._core.call import AttentionCall
from jaxattn._kernels import decode_gpu, flash_gpu, flex_tpu, refs_tpu, tables_gpu, tables_tpu
from jaxattn._kernels.flash import tile_math

OUT_TOL, GRAD_TOL = 1e-6, 1e-5

# name: (batch, T, S, N, K, H, Hv, clip (max_left, max_right), key table heads, value table heads, options)
# heads: "per head" ([R,N,F]), "shared" ([R,F]) or None (no table)
CASES = {
    # both tables, max_distance 3 < a tile (the far tiles read one row: the one-column adds), GQA, causal
    "shaw both causal": ((2,), 19, 23, 6, 3, 5, 7, (3, 3), "per head", "shared", dict(is_causal=True)),
    # key table only, shared, max_distance 20 > a tile, T > S
    "shaw key only": ((2,), 29, 17, 4, 2, 5, 3, (20, 20), "shared", None, dict()),
    # value table only, per head, max_distance 40 > S: every offset its own row
    "shaw value only": ((3,), 13, 31, 6, 2, 3, 5, (40, 40), None, "per head", dict(is_causal=True)),
    # the asymmetric clip (clipped_relative_attention: its tables as symmetric_table of them)
    "clipped asymmetric": ((2,), 23, 37, 6, 3, 5, 7, (9, 2), "per head", "per head", dict()),
    # positions of their own (the band is all of [-m, m]) and key lengths
    "shaw positions": (
        (2,),
        11,
        17,
        4,
        2,
        5,
        3,
        (4, 4),
        "shared",
        "per head",
        dict(positions=True, is_causal=True, key_value_seq_lengths=np.array([17, 9])),
    ),
    # the kernel's other options beside the tables: window, softcap (caps scale * (q.k + q.A^K)), sinks
    "shaw with the other options": (
        (2,),
        19,
        23,
        6,
        3,
        5,
        3,
        (5, 5),
        "per head",
        "shared",
        dict(window=(9, 3), logit_softcap=2.5, sinks=np.array([0.5, -1.0, 0.25, 2.0, -0.5, 1.0], np.float32)),
    ),
}
DEFAULT_CASE = "shaw both causal"


def _positions(T, S, seed=5):
    """Non-contiguous positions shared over the batch: gaps and repeats, far from the defaults."""
    rng = np.random.default_rng(seed)
    qp = np.sort(rng.integers(100, 130, size=T)).astype(np.int32)
    kp = np.sort(rng.integers(95, 140, size=S)).astype(np.int32)
    return qp, kp


def _setup(name):
    batch, T, S, N, K, H, Hv, (left, right), key_heads, value_heads, options = CASES[name]
    rng = np.random.default_rng(11)
    q, k, v, w = (
        rng.normal(size=shape).astype(np.float32)
        for shape in ((*batch, T, N, H), (*batch, S, K, H), (*batch, S, K, Hv), (*batch, T, N, Hv))
    )
    R = left + right + 1

    def table(heads, F):
        if heads is None:
            return None
        return rng.normal(size=(R, N, F) if heads == "per head" else (R, F)).astype(np.float32)

    tables = (table(key_heads, H), table(value_heads, Hv))
    options = dict(options)
    if options.pop("positions", False):
        options["query_positions"], options["key_positions"] = _positions(T, S)
    return (q, k, v), tables, (left, right), options, w


def _scheme(clip, key_table, value_table, **options):
    """f(q, k, v, *the tables in use) through the public scheme function (Shaw when the clip is symmetric)."""
    left, right = clip
    used = [key_table is not None, value_table is not None]

    def f(q, k, v, *tables, **kw):
        it = iter(tables)
        kt, vt = (next(it) if u else None for u in used)
        if left == right:
            return jaxattn.shaw_relative_attention(q, k, v, kt, vt, max_distance=left, **options, **kw)
        return jaxattn.clipped_relative_attention(q, k, v, kt, vt, max_left=left, max_right=right, **options, **kw)

    return f, tuple(t for t in (key_table, value_table) if t is not None)


def _pair_table(table, index, N):
    """The table at each pair's row, [*,T,S,N,F] (a shared table broadcast over heads), float64."""
    if table is None:
        return None
    rows = np.asarray(table, np.float64)[index]
    return rows if table.ndim == 3 else np.broadcast_to(rows[..., None, :], (*index.shape, N, table.shape[-1]))


def _check(name, implementation="pallas_gpu"):
    (q, k, v), (kt, vt), clip, options, w = _setup(name)
    T, N, S = q.shape[-3], q.shape[-2], k.shape[-3]
    f, tables = _scheme(clip, kt, vt, **options)
    args = (q, k, v, *tables)

    # the Pallas TPU kernel indexes in int32: it runs with jax_enable_x64 off (its float32 is all it takes)
    with jax.enable_x64(False) if implementation == "pallas_tpu" else contextlib.nullcontext():
        out, grads = value_and_vjp(lambda *a: f(*a, implementation=implementation, interpret=True), args, w)
    assert out.dtype == jnp.float32

    # the float64 loop: A^K / A^V = the tables at clip(j - i, -left, right) + left, one pair at a time
    left, right = clip
    D = max(left, right)  # shaw_index_loop's symmetric clip, then the asymmetric one on its rows
    index = np.clip(
        shaw_index_loop(T, S, D, options.get("query_positions"), options.get("key_positions")) - D, -left, right
    )
    index = index + left
    rules = {n: options[n] for n in ("is_causal", "key_value_seq_lengths", "window") if n in options}
    for n in ("query_positions", "key_positions"):
        if n in options:
            rules[n] = options[n]
    extra = {n: options[n] for n in ("logit_softcap", "sinks") if n in options}
    want, _ = attention_loop(
        q, k, v, rel_key=_pair_table(kt, index, N), rel_value=_pair_table(vt, index, N), **rules, **extra
    )
    assert normwise(out, want) <= OUT_TOL, normwise(out, want)

    # gradients: the dense engine in float64 (its forward checked against the loop first)
    wide = tuple(np.asarray(x, np.float64) for x in args)
    dense_out, dense_grads = value_and_vjp(lambda *a: f(*a, implementation="dense"), wide, w)
    assert_float64(dense_out, *dense_grads)
    assert normwise(dense_out, want) <= 1e-12
    names = ("q", "k", "v") + tuple(n for n, t in (("key_table", kt), ("value_table", vt)) if t is not None)
    for got, ref, what in zip(grads, dense_grads, names, strict=True):
        assert got.dtype == jnp.float32, what
        assert normwise(got, ref) <= GRAD_TOL, (what, normwise(got, ref))


@pytest.mark.parametrize("name", [n if n == DEFAULT_CASE else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_kernel_matches_the_float64_loop(name):
    _check(name)


@pytest.mark.parametrize(
    "name",
    [n if n == DEFAULT_CASE else pytest.param(n, marks=pytest.mark.slow) for n in CASES if n != "shaw positions"],
)  # positions of their own: refused (no contiguous offsets per tile)
def test_tpu_kernel_matches_the_float64_loop(name):
    """flex_tpu's forward (each tile's key term a window of q . the tables' lanes rolled into its diagonals,
    the value term p rolled back onto the offsets times a window of the value lanes) and its gradient, the
    XLA blockwise backward, into both tables too (closure-converted out of the call)."""
    _check(name, implementation="pallas_tpu")


@pytest.mark.slow  # the default group streams DeBERTa's keys (test_kernel_disentangled.py); the value lanes here
def test_tpu_kernel_with_streamed_keys(monkeypatch):
    """The dq kernel's keys streamed from HBM a tile at a time (tables_tpu.key_buffers 0), with Shaw's value
    lanes beside them: the same gradients."""
    monkeypatch.setattr(tables_tpu, "key_buffers", lambda *args: 0)
    _check(DEFAULT_CASE, implementation="pallas_tpu")


# bf16 inputs (the tables float32) against the float64 dense engine on the same rounded numbers, measured on the
# two cases below: outputs <= 1.8e-3 (the dense engine in bf16: 1.75e-3), gradients of q, k, v and the tables
# <= 3.5e-3 (dense 3.2e-3). The envelope: the contract suite's bf16 bars.
BF16_TOLERANCES = (5e-3, 8e-3)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("name", ["shaw both causal", "clipped asymmetric"])
def test_kernel_in_bf16_within_the_envelope(name, implementation):
    (q, k, v), (kt, vt), clip, options, w = _setup(name)
    f, tables = _scheme(clip, kt, vt, **options)
    args = (*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), *tables)
    with jax.enable_x64(False) if implementation == "pallas_tpu" else contextlib.nullcontext():
        out, grads = value_and_vjp(lambda *a: f(*a, implementation=implementation, interpret=True), args, w)
    assert out.dtype == jnp.bfloat16
    wide = tuple(np.asarray(x, np.float64) for x in args)
    want, want_grads = value_and_vjp(lambda *a: f(*a, implementation="dense"), wide, w)
    assert normwise(out, want) <= BF16_TOLERANCES[0], normwise(out, want)
    for got, ref in zip(grads, want_grads, strict=True):
        assert normwise(got, ref) <= BF16_TOLERANCES[1], normwise(got, ref)


def test_the_default_case_has_one_column_tiles_and_mixed_ones():
    """What the default case covers: interpreted tiles (16 x 16) whose pairs all read one table row (the adds
    by column take the row sums), and tiles whose pairs read several."""
    batch, T, S, *_, (left, right), _, _, _ = CASES[DEFAULT_CASE]
    d = np.arange(S)[None, :] - (np.arange(T) + S - T)[:, None]
    Tp, Sp = -(-T // 16) * 16, -(-S // 16) * 16
    d = np.pad(np.clip(d, -left, right), [(0, Tp - T), (0, Sp - S)], mode="edge")
    tiles = d.reshape(Tp // 16, 16, Sp // 16, 16).swapaxes(1, 2).reshape(Tp // 16, Sp // 16, -1)
    distinct = np.array([[len(set(tile)) for tile in row] for row in tiles])
    assert (distinct == 1).any() and (distinct > 1).any(), distinct


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("per_head, is_causal", [(True, True), (False, False)])
def test_transformer_xl_takes_the_kernel(per_head, is_causal, implementation):
    """Transformer-XL's shaw_form (doubled head dim, a key table [0, P]) runs in the kernels unchanged."""
    B, T, S, N, K, H, Hv, max_left = 2, 19, 23, XL_HEADS, 3, 5, 7, 22
    R = max_left + 5
    rng = np.random.default_rng(7)
    q, k, v, w = (
        rng.normal(size=s).astype(np.float32) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv), (B, T, N, Hv))
    )
    P = rng.normal(size=(R, N, H) if per_head else (R, H)).astype(np.float32)
    u, vb = rng.normal(size=(N, H)).astype(np.float32), rng.normal(size=(N, H)).astype(np.float32)

    def f(q, k, v, P, u, vb, **kw):
        return jaxattn.transformer_xl_attention(
            q, k, v, P, max_left=max_left, pos_bias_u=u, pos_bias_v=vb, is_causal=is_causal, **kw
        )

    args = (q, k, v, P, u, vb)
    with jax.enable_x64(False) if implementation == "pallas_tpu" else contextlib.nullcontext():
        out, grads = value_and_vjp(lambda *a: f(*a, implementation=implementation, interpret=True), args, w)
    keys = np.asarray(P, np.float64) if per_head else np.broadcast_to(np.asarray(P, np.float64)[:, None], (R, N, H))
    want = xl_loop(q, k, v, keys, u, vb, max_left, is_causal)
    assert normwise(out, want) <= OUT_TOL
    _, dense_grads = value_and_vjp(
        lambda *a: f(*a, implementation="dense"), [np.asarray(x, np.float64) for x in args], w
    )
    for got, ref in zip(grads, dense_grads, strict=True):
        assert normwise(got, ref) <= GRAD_TOL


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
def test_under_vmap_and_grad(implementation):
    """vmap over a batch axis the kernel does not see, inside jit and vjp, a key and a value table: against the
    dense engine in float64."""
    (q, k, v), (kt, vt), clip, options, w = _setup("shaw value only")
    kt = np.random.default_rng(2).normal(size=(2 * clip[0] + 1, q.shape[-1])).astype(np.float32)
    f, tables = _scheme(clip, kt, vt, **options)

    def vmapped(implementation, **kw):
        def g(q, k, v, kt, vt):
            return jax.vmap(lambda q, k, v: f(q, k, v, kt, vt, implementation=implementation, **kw))(q, k, v)

        return g

    args = (q, k, v, *tables)
    with jax.enable_x64(False) if implementation == "pallas_tpu" else contextlib.nullcontext():
        got, got_grads = value_and_vjp(vmapped(implementation, interpret=True), args, w)
    want, want_grads = value_and_vjp(vmapped("dense"), [np.asarray(x, np.float64) for x in args], w)
    assert normwise(got, want) <= OUT_TOL
    for g, e in zip(got_grads, want_grads, strict=True):
        assert normwise(g, e) <= GRAD_TOL


@pytest.mark.slow  # the default group's TPU Shaw case runs both through the kernel
def test_tpu_diagonals_and_their_inverse_against_numpy():
    """refs_tpu.diagonals: tile[r, c] = lanes[r, offset + R - 1 - r + c] (rows that differ: QA's lanes), and
    undiagonals, its inverse: out[r, offset + R - 1 - r + c] = tile[r, c] (R - 1 - r rolled in steps),
    for offsets at both ends of a lane tile, on the interpreter's tiles and a TPU's, in the interpreter (the
    Mosaic lowering: .ci/compile_targets.py's "shaw causal")."""
    from jax.experimental import pallas as pl

    rng = np.random.default_rng(3)
    for R, C in ((16, 16), (128, 128), (16, 40), (20, 16)):  # 20: rows in no vreg's 8
        W = refs_tpu.window(R, C)
        offsets = np.array([0, 1, 77, 127], np.int32)
        lanes = rng.normal(size=(R, W)).astype(np.float32)
        tile = rng.normal(size=(R, C)).astype(np.float32)

        def kernel(offset_ref, lanes_ref, tile_ref, diag_ref, undiag_ref, C=C, W=W):
            offset = offset_ref[pl.program_id(0)]
            diag_ref[...] = refs_tpu.diagonals(lanes_ref[...], offset, C)
            undiag_ref[...] = refs_tpu.undiagonals(tile_ref[...], offset, W)

        grid = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(len(offsets),),
            in_specs=[pl.BlockSpec((R, W), lambda j, *_: (0, 0)), pl.BlockSpec((R, C), lambda j, *_: (0, 0))],
            out_specs=[
                pl.BlockSpec((None, R, C), lambda j, *_: (j, 0, 0)),
                pl.BlockSpec((None, R, W), lambda j, *_: (j, 0, 0)),
            ],
        )
        shapes = [jax.ShapeDtypeStruct((len(offsets), R, C), jnp.float32)]
        shapes.append(jax.ShapeDtypeStruct((len(offsets), R, W), jnp.float32))
        with jax.enable_x64(False):
            diag, undiag = pl.pallas_call(kernel, grid_spec=grid, out_shape=shapes, interpret=True)(
                jnp.asarray(offsets), jnp.asarray(lanes), jnp.asarray(tile)
            )
        r, c = np.mgrid[:R, :C]
        for got, got_inverse, offset in zip(np.asarray(diag), np.asarray(undiag), offsets, strict=True):
            np.testing.assert_array_equal(got, lanes[r, offset + R - 1 - r + c])
            want = np.zeros((R, W), np.float32)
            want[r, offset + R - 1 - r + c] = tile
            np.testing.assert_array_equal(got_inverse, want)


# ---------------------------------------------------------------------------------------------------------
# the band of rows, and what the kernels refuse


def test_band_covers_every_offset_a_call_reads():
    """band(): with the default positions, the offsets j - i of [-(S - 1), T - 1] clipped to [-m, m]; with
    positions of their own, all of [-m, m]. Checked against the clipped offsets one pair at a time."""
    for T, S, m in [(5, 9, 2), (9, 5, 20), (16, 16, 15), (1, 40, 3)]:
        rows = shaw_index_loop(T, S, m) - m
        b = tables_gpu.band(m, T, S, default_positions=True)
        assert (b.lo, b.hi) == (rows.min(), rows.max())
        assert b.Dp >= b.D and (b.Dp & (b.Dp - 1) == 0 or b.Dp % tile_math.ROW_CHUNK == 0)
        assert tables_gpu.band(m, T, S, default_positions=False)[:2] == (-m, m)
    assert [tables_gpu.padded_columns(D) for D in (1, 7, 33, 64, 65, 129, 257)] == [16, 16, 64, 64, 128, 192, 320]


def test_what_the_kernels_refuse():
    q = k = v = jnp.zeros((2, 7, 3, 4), jnp.float32)
    table = jnp.zeros((7, 4))

    def refusal(kernel, interpret=False, **options):
        return kernel.unsupported(AttentionCall(**options), q, k, v, interpret)

    for tables in (dict(key_table=table), dict(value_table=table), dict(key_table=table, value_table=table)):
        assert refusal(flash_gpu, **tables, max_distance=3) is None
        assert refusal(decode_gpu, **tables, max_distance=3) is None  # decode_gpu.unsupported is the flash kernel's
        assert decode_gpu.decode_unsupported(AttentionCall(**tables, max_distance=3), q, k, v, True) in tables
        for interpret in (False, True):  # the TPU kernel: the default positions' contiguous offsets only
            with jax.enable_x64(False):  # (it refuses 64-bit mode by name)
                assert refusal(flex_tpu, interpret, **tables, max_distance=3) is None
            positions = refusal(flex_tpu, interpret, **tables, max_distance=3, key_positions=jnp.arange(7))
            assert positions.startswith("key_positions (with position tables")
    # a band wider than MAX_COLUMNS rows: positions of their own reach all 2 m + 1 of them
    m = tables_gpu.MAX_COLUMNS
    wide = dict(key_table=jnp.zeros((2 * m + 1, 4)), max_distance=m, query_positions=jnp.arange(7))
    assert refusal(flash_gpu, **wide).startswith("max_distance")
    assert refusal(flash_gpu, **{**wide, "query_positions": None}) is None  # the defaults reach 13 rows
    # an explicit kernel names it; None keeps the XLA engines (the same answer)
    qp = jnp.arange(7)
    with pytest.raises(ValueError, match="max_distance"):
        jaxattn.shaw_relative_attention(
            q, k, v, wide["key_table"], max_distance=m, query_positions=qp, implementation="pallas_gpu", interpret=True
        )
    with pytest.raises(ValueError, match="key_table"):  # a table's shape, named, as the XLA engines do
        jaxattn.shaw_relative_attention(
            q, k, v, jnp.zeros((6, 4)), max_distance=3, implementation="pallas_gpu", interpret=True
        )


# ---------------------------------------------------------------------------------------------------------
# lowered for CUDA

T_LONG = 4096
TRITON = "__gpu$xla.gpu.triton"


def _lowered(fn, *args):
    with jax.enable_x64(False), jaxattn.cross_platform_lowering():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _long(scheme):
    """forward(q, key table, value table) at implementation=None, causal."""
    if scheme == "shaw":
        return lambda q, kt, vt: jaxattn.shaw_relative_attention(q, q, q, kt, vt, max_distance=64, is_causal=True)
    if scheme == "clipped":
        return lambda q, kt, vt: jaxattn.clipped_relative_attention(
            q, q, q, kt[:72], vt[:72], max_left=64, max_right=7, is_causal=True
        )
    return lambda q, kt, vt: jaxattn.transformer_xl_attention(q, q, q, kt, max_left=64, is_causal=True)


@pytest.mark.parametrize(
    "scheme, program",
    [("shaw", "forward+backward"), pytest.param("shaw", "forward", marks=pytest.mark.slow)]  # fwd+bwd holds fwd
    + [pytest.param(s, p, marks=pytest.mark.slow) for s in ("clipped", "xl") for p in ("forward", "forward+backward")],
)
def test_lowered_for_cuda_is_the_kernel(scheme, program):
    N, H = 8, 64
    q = jax.ShapeDtypeStruct((1, T_LONG, N, H), jnp.bfloat16)
    kt, vt = jax.ShapeDtypeStruct((129, N, H), jnp.bfloat16), jax.ShapeDtypeStruct((129, H), jnp.bfloat16)
    forward = _long(scheme)
    if program == "forward":
        fn = forward
    else:
        fn = jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)), argnums=(0, 1, 2))
    text = _lowered(fn, q, kt, vt)
    kernels = set(re.findall(r'name = "(jaxattn_flash_\w+)"', text))
    want = {"jaxattn_flash_forward"} | ({"jaxattn_flash_dq", "jaxattn_flash_dkv"} if program != "forward" else set())
    assert TRITON in text and kernels == want, kernels
    assert "stablehlo.while" not in text, "an XLA tile loop"
    # no [T,S] value anywhere (the CPU branch of the switch is the blockwise engine at this length: no [T,S]
    # residuals to fill either)
    assert not re.search(rf"[<x]{T_LONG}x{T_LONG}x(f32|bf16|f16|i1|i32)>", text), "a [T,S] buffer"
