"""DeBERTa's disentangled attention inside the Pallas GPU kernel (issue 35): disentangled_attention with
implementation="pallas_gpu" (and None on CUDA).

c2p is the kernel's Shaw key term (q . Kr per query row, picked per tile), p2c a per-key-row term (k . Qr per
key row, picked per tile, its gradient summed by column in the dk/dv kernel); both read the column of a pair
through the scheme's int32 map of the offsets j - i to table rows (row_tables.RowTables).

Interpret mode (Pallas' interpreter on this CPU), float32 at highest precision: outputs <= 1e-6 against
test_disentangled's float64 loop of the formula (where its shapes fit) or the dense engine in float64,
gradients of q, k, v, Kr and Qr <= 1e-5 against the dense engine in float64, normwise. T != S both ways
(the dense engine's bottom-right positions, which the kernel shares), lengths that are not multiples of the
interpreter's 16-wide tiles, grouped-query heads, per-head and shared tables, c2p only / p2c only / both,
DeBERTa-v3's buckets (256, 512), small ones (6, 9) whose saturation is within a tile (one-column tiles), no
buckets; jit (every case), vmap and grad; bf16 inputs within the contract's envelope. The default group runs
one case forward and backward; the others are slow (the interpreted kernels compile slowly).

Lowered for CUDA at T = S = 4096 bf16 (nothing compiled): implementation=None takes the kernel (its Triton
calls, no [T,S] value, no XLA tile loop).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_disentangled import (
    B as LOOP_B,
    H as LOOP_H,
    Hv as LOOP_HV,
    K as LOOP_K,
    N as LOOP_N,
    S as LOOP_S,
    T as LOOP_T,
    disentangled_loop,
)

import jaxattn
from helpers import normwise
from jaxattn._core.call import AttentionCall
from jaxattn._core.row_tables import RowTables
from jaxattn._kernels import decode_gpu, flash_gpu, flex_tpu, tables_gpu, tables_tpu
from jaxattn._schemes.disentangled import _rows_of, _saturation, _table_rows

OUT_TOL, GRAD_TOL = 1e-6, 1e-5
LOOP_SHAPES = (LOOP_B, LOOP_T, LOOP_S, LOOP_N, LOOP_K, LOOP_H, LOOP_HV)

# name: (shapes (B, T, S, N, K, H, Hv), (position_buckets, max_relative_positions), Kr heads, Qr heads,
# options); heads: "per head" ([R,N,H]), "shared" ([R,H]) or None (that term left out)
CASES = {
    # test_disentangled's loop shapes (T < S, GQA), DeBERTa-v3's buckets, both terms
    "v3 both": (LOOP_SHAPES, (256, 512), "per head", "shared", dict()),
    # small buckets: rows saturate from |j - i| = 9 on, inside a 16-wide tile (the one-column adds), T > S
    "small c2p only": ((2, 37, 29, 6, 2, 5, 3), (6, 9), "shared", None, dict()),
    "small p2c only": ((2, 29, 41, 6, 3, 5, 7), (6, 9), None, "per head", dict()),
    # no buckets (row = clip(span - (j - i))), both terms, several tiles each way, causal and key lengths
    "no buckets causal lengths": (
        (2, 23, 37, 4, 2, 3, 5),
        (-1, 7),
        "per head",
        "per head",
        # int32 lengths: one program traced with jax_enable_x64 off (the TPU kernel) and on (the references)
        dict(is_causal=True, key_value_seq_lengths=np.array([37, 20], np.int32)),
    ),
    # positions of their own (the band is the saturation's [-M, M]) and softcap (caps scale * (q.k + c2p + p2c))
    "positions softcap": ((2, 19, 23, 6, 3, 5, 7), (6, 9), "shared", "per head", dict(positions=True, softcap=2.5)),
}
DEFAULT_CASE = "v3 both"


def _setup(name, seed=0):
    """(q, k, v, kr, qr) float32 numpy (kr / qr None where the case leaves the term out), the keywords, and a
    cotangent [B,T,N,Hv]."""
    (B, T, S, N, K, H, Hv), (buckets, max_rel), kr_heads, qr_heads, options = CASES[name]
    rng = np.random.default_rng(seed)
    q, k, v = rng.normal(size=(B, T, N, H)), rng.normal(size=(B, S, K, H)), rng.normal(size=(B, S, K, Hv))
    span, _ = _table_rows(buckets, max_rel)

    def table(heads):
        if heads is None:
            return None
        return rng.normal(size=(2 * span, N, H) if heads == "per head" else (2 * span, H))

    kr, qr = table(kr_heads), table(qr_heads)
    kw = dict(position_buckets=buckets, max_relative_positions=max_rel, precision="highest")
    options = dict(options)
    if options.pop("positions", False):  # gaps, repeats and far offsets (past the saturation both ways)
        kw["query_positions"] = np.sort(rng.integers(0, 60, size=T)).astype(np.int32)
        kw["key_positions"] = rng.integers(-20, 80, size=S).astype(np.int32)
    if "softcap" in options:
        kw["logit_softcap"] = options.pop("softcap")
    kw.update(options)
    w = rng.normal(size=(B, T, N, Hv))
    f32 = lambda x: None if x is None else np.asarray(x, np.float32)  # noqa: E731
    return [f32(x) for x in (q, k, v, kr, qr)], kw, w


def _fn(kr_given, qr_given, **kw):
    """f(q, k, v, *tables) with the case's tables (only those given) as arguments."""

    def f(q, k, v, *tables, **more):
        it = iter(tables)
        kr = next(it) if kr_given else None
        qr = next(it) if qr_given else None
        return jaxattn.disentangled_attention(q, k, v, kr, qr, **kw, **more)

    return f


def _value_and_grads(f, args, w):
    def loss(*a):
        return jnp.sum(f(*a) * w)

    out = jax.jit(f)(*args)
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)
    return out, grads


def _check(name, implementation="pallas_gpu"):
    (q, k, v, kr, qr), kw, w = _setup(name)
    f = _fn(kr is not None, qr is not None, **kw)
    args = [x for x in (q, k, v, kr, qr) if x is not None]
    kernel = lambda *a: f(*a, implementation=implementation, interpret=True)  # noqa: E731
    dense = lambda *a: f(*a, implementation="dense")  # noqa: E731
    # the Pallas TPU kernel indexes in int32: it runs with jax_enable_x64 off (its float32 is all it takes)
    with jax.enable_x64(implementation != "pallas_tpu"):
        got, got_grads = _value_and_grads(kernel, args, w)
    with jax.enable_x64(True):
        args64 = [np.asarray(x, np.float64) for x in args]
        want, want_grads = _value_and_grads(dense, args64, w)
        if CASES[name][0] == LOOP_SHAPES and not set(kw) - {"position_buckets", "max_relative_positions", "precision"}:
            loop = disentangled_loop(
                *args64[:3],
                *(np.asarray(t, np.float64) if t is not None else None for t in (kr, qr)),
                position_buckets=kw["position_buckets"],
                max_relative_positions=kw["max_relative_positions"],
            )
            assert normwise(want, loop) <= 1e-12  # the dense reference is the formula's
            assert normwise(got, loop) <= OUT_TOL
    assert got.dtype == jnp.float32
    assert normwise(got, want) <= OUT_TOL
    for i, (g, e) in enumerate(zip(got_grads, want_grads, strict=True)):
        assert bool(jnp.all(jnp.isfinite(g))), i
        assert normwise(g, e) <= GRAD_TOL, (i, normwise(g, e))


@pytest.mark.parametrize("name", [n if n == DEFAULT_CASE else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_kernel_matches_the_float64_references(name):
    _check(name)


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=pytest.mark.slow)  # the TPU table terms: test_kernel_shaw.py's default case
        for n in CASES
        if n != "positions softcap"
    ],
)  # positions of their own: refused (no contiguous offsets per tile)
def test_tpu_kernel_matches_the_float64_references(name):
    """flex_tpu's forward (c2p: a window of q . the mapped key rows' lanes rolled into the tile's diagonals;
    p2c: k . a window of the reversed query rows' lanes, rolled per key row and transposed) and its gradient,
    the XLA blockwise backward with both terms as a score_mod (row_tables.as_score_mod), into Kr and Qr."""
    _check(name, implementation="pallas_tpu")


@pytest.mark.parametrize("name", ["no buckets causal lengths", pytest.param("small p2c only", marks=pytest.mark.slow)])
def test_tpu_kernel_with_streamed_keys(name, monkeypatch):
    """The dq kernel's keys streamed from HBM a tile at a time (tables_tpu.key_buffers 0: where one copy of one
    head's keys and values overruns VMEM beside the tables, DeBERTa-v3's training at 16k), forced here on small
    shapes: the same gradients as the float64 references."""
    monkeypatch.setattr(tables_tpu, "key_buffers", lambda *args: 0)
    _check(name, implementation="pallas_tpu")


# bf16 inputs (the tables float32) against the float64 dense engine on the same rounded numbers, within the
# contract suite's bf16 bars (as tests/test_kernel_shaw.py's). Measured on the two cases below: outputs <= 2.1e-3
# (the dense engine in bf16: 2.5e-3), gradients of q, k, v and the tables <= 3.5e-3 (dense 3.3e-3).
BF16_TOLERANCES = (5e-3, 8e-3)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("name", ["small p2c only", "no buckets causal lengths"])
def test_kernel_in_bf16_within_the_envelope(name, implementation):
    (q, k, v, kr, qr), kw, w = _setup(name)
    kw.pop("precision")
    f = _fn(kr is not None, qr is not None, **kw)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + [x for x in (kr, qr) if x is not None]
    with jax.enable_x64(implementation != "pallas_tpu"):  # the TPU kernel: x64 off (it indexes in int32)
        out, grads = _value_and_grads(lambda *a: f(*a, implementation=implementation, interpret=True), args, w)
    assert out.dtype == jnp.bfloat16
    with jax.enable_x64(True):
        wide = [np.asarray(x, np.float64) for x in args]
        want, want_grads = _value_and_grads(lambda *a: f(*a, implementation="dense"), wide, w)
    errors = [normwise(out, want)] + [normwise(g, e) for g, e in zip(grads, want_grads, strict=True)]
    assert errors[0] <= BF16_TOLERANCES[0], errors
    assert max(errors[1:]) <= BF16_TOLERANCES[1], errors


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
def test_under_vmap_and_grad(implementation):
    """vmap over a batch axis the kernel does not see, inside jit and grad, both terms: against the dense engine
    in float64."""
    (q, k, v, kr, qr), kw, w = _setup("small p2c only")
    kr = np.random.default_rng(3).normal(size=qr.shape[:1] + qr.shape[-1:]).astype(np.float32)
    f = _fn(True, True, **kw)

    def vmapped(**impl):
        def g(q, k, v, kr, qr):
            return jax.vmap(lambda q, k, v: f(q, k, v, kr, qr, **impl))(q, k, v)

        return g

    args = (q, k, v, kr, qr)
    with jax.enable_x64(implementation != "pallas_tpu"):  # the TPU kernel: x64 off (it indexes in int32)
        got, got_grads = _value_and_grads(vmapped(implementation=implementation, interpret=True), args, w)
    with jax.enable_x64(True):
        want, want_grads = _value_and_grads(
            vmapped(implementation="dense"), [np.asarray(x, np.float64) for x in args], w
        )
    assert normwise(got, want) <= OUT_TOL
    for g, e in zip(got_grads, want_grads, strict=True):
        assert normwise(g, e) <= GRAD_TOL


@pytest.mark.parametrize("buckets", [(256, 512), (6, 9), (64, 128), (2, 5), (-1, 7), (-1, 512)])
def test_rows_saturate_at_the_kernels_band(buckets):
    """_saturation's M: every offset from M on reads row 0, every one from -M down the last row, so clipping
    j - i to [-M, M] (the kernel's band) keeps every row; and M is the first such distance on one side."""
    span, max_step = _table_rows(*buckets)
    M = _saturation(*buckets, span)
    if buckets == (2, 5):  # mid = 1: every step is 0, |bucket| stays 1 and never reaches a clipped row
        assert M is None
        return

    def rows(d):
        return np.asarray(_rows_of(np.asarray(d, np.int32), *buckets, span, max_step))

    far = np.concatenate([np.arange(M, M + 3000), [10**6, 10**9]])
    assert (rows(far) == 0).all() and (rows(-far) == 2 * span - 1).all()
    assert rows(M - 1) != 0 or rows(-(M - 1)) != 2 * span - 1


def test_what_the_kernels_refuse():
    """The GPU kernel takes the terms beside its other options, refuses the full-grid ones by name (explicit)
    and falls back under None; the split-key kernel refuses them, the TPU kernel positions of their own, a
    softcap beside them and a band over flex_tpu.MAX_BAND offsets; other kernels named refuse the tables."""
    (q, k, v, kr, qr), kw, _ = _setup(DEFAULT_CASE)
    kw = {key: kw[key] for key in ("position_buckets", "max_relative_positions")}
    with pytest.raises(ValueError, match="mask: expected not in use with implementation='pallas_gpu'"):
        jaxattn.disentangled_attention(
            q, k, v, kr, qr, mask=np.ones((q.shape[1], k.shape[1]), bool), implementation="pallas_gpu", **kw
        )
    with pytest.raises(ValueError, match="position_keys / queries: expected not in use with implementation='cudnn'"):
        jaxattn.disentangled_attention(q, k, v, kr, qr, implementation="cudnn", **kw)
    table = jnp.zeros((8, 4))
    rows = RowTables(table, table, jnp.zeros(5, jnp.int32), -2, 2, 8)
    x = jnp.zeros((2, 7, 3, 4), jnp.float32)
    call = AttentionCall(row_tables=rows)
    assert flash_gpu.unsupported(call, x, x, x) is None
    assert decode_gpu.decode_unsupported(call, x, x, x, True) == "row_tables"
    with jax.enable_x64(False):  # the TPU kernel refuses 64-bit mode by name
        assert flex_tpu.unsupported(call, x, x, x, True) is None
        assert flex_tpu.unsupported(call.replace(logit_softcap=2.0), x, x, x, True).startswith("logit_softcap")
        far = RowTables(table, table, jnp.zeros(flex_tpu.MAX_BAND + 1, jnp.int32), 0, flex_tpu.MAX_BAND, 8)
        assert flex_tpu.unsupported(AttentionCall(row_tables=far), x, x, x, True).startswith("position_keys")
    positions = flex_tpu.unsupported(call.replace(query_positions=jnp.arange(7)), x, x, x, True)
    assert positions.startswith("query_positions (with position tables")
    wide = RowTables(table, None, jnp.zeros(5, jnp.int32), -2, 2, 2 * tables_gpu.MAX_COLUMNS)
    assert flash_gpu.unsupported(AttentionCall(row_tables=wide), x, x, x).startswith("position_keys / position_queries")


# ---------------------------------------------------------------------------------------------------------
# lowered for CUDA

T_LONG = 4096
TRITON = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize(
    "program, implementation",
    [("forward+backward", None)] + [pytest.param("forward", i, marks=pytest.mark.slow) for i in (None, "pallas_gpu")],
)
def test_lowered_for_cuda_is_the_kernel(program, implementation):
    """DeBERTa-v3 (buckets 256, 512; tables [512,N,H]), bf16, not causal, at T = S = 4096."""
    N, H = 8, 64
    q = jax.ShapeDtypeStruct((1, T_LONG, N, H), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((512, N, H), jnp.bfloat16)

    def forward(q, kr, qr):
        return jaxattn.disentangled_attention(
            q, q, q, kr, qr, position_buckets=256, max_relative_positions=512, implementation=implementation
        )

    fn = forward if program == "forward" else jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)), (0, 1, 2))
    with jax.enable_x64(False), jaxattn.cross_platform_lowering():
        text = jax.jit(fn).trace(q, table, table).lower(lowering_platforms=("cuda",)).as_text()
    kernels = set(re.findall(r'name = "(jaxattn_flash_\w+)"', text))
    want = {"jaxattn_flash_forward"} | ({"jaxattn_flash_dq", "jaxattn_flash_dkv"} if program != "forward" else set())
    assert TRITON in text and kernels == want, kernels
    assert "stablehlo.while" not in text, "an XLA tile loop"
    assert not re.search(rf"[<x]{T_LONG}x{T_LONG}x(f32|bf16|f16|i1|i32)>", text), "a [T,S] buffer"


def test_none_on_cuda_falls_back_for_what_the_kernel_refuses():
    """implementation=None lowered for CUDA: the kernel for plain calls (both terms, c2p only, positions of
    their own), the XLA engines (no Triton call) with a mask or with positions the buckets cannot bound."""
    N, H = 4, 16
    q = jax.ShapeDtypeStruct((1, 64, N, H), jnp.float32)

    def lowered(buckets=(6, 9), with_qr=True, **options):
        def f(q, kr, qr):
            rows = dict(position_buckets=buckets[0], max_relative_positions=buckets[1])
            return jaxattn.disentangled_attention(q, q, q, kr, qr if with_qr else None, **rows, **options)

        table = jax.ShapeDtypeStruct((2 * buckets[0], N, H), jnp.float32)  # 2 span rows
        shapes = (q, table, table)
        with jax.enable_x64(False), jaxattn.cross_platform_lowering():
            return jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()

    assert TRITON in lowered()
    assert TRITON in lowered(with_qr=False)
    assert TRITON in lowered(query_positions=jnp.arange(64) * 3)
    assert TRITON not in lowered(mask=jnp.tril(jnp.ones((64, 64), bool)))
    assert TRITON not in lowered((2, 5), query_positions=jnp.arange(64) * 3)  # |bucket| stays 1: no saturation
