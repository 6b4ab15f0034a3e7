"""Swin's and BEiT's 2D relative position bias inside the Pallas GPU kernel (issue 35): window_attention's bias is
a TableBias (the [R,N] table read at WindowIndex, computed in each tile from the tokens' places), its gradient
scattered back into the table by the dq kernel; the windows are the kernel's batch axis, Swin's shifted regions
its segment ids.

Interpret mode (Pallas' interpreter on this CPU), float32 at highest precision: outputs <= 1e-6 and gradients
(q, k, v and the table) <= 1e-5, normwise, against the float64 references of tests/helpers.py: attention_loop
for the outputs, with the bias from test_window_bias.index_loop (the index as a plain loop) and the regions from
its regions_loop (the original Swin slices); attention_reference's jax.grad for the gradients; and the dense
engine in float64 on the same numbers for both. Every axis its own size: maps B = 2, windows nW = 3, non-square
windows (3x7 = 21 tokens, more than one interpreted 16-wide tile, so tiles start inside a window and padding
rows / columns are read; 2x3 and BEiT's cls token), N = 5 query heads over K = 1, H = 7, Hv = 11; shifted and
unshifted. The default group runs one case forward and backward under jit (about 5 s cold on 2 busy cores: the
interpreted kernels compile slowly); the other cases, vmap and float64 are slow.

The Pallas TPU flex kernel's forward (flex_tpu: the window's bias of every pair gathered once outside the kernel,
[N,Tp,Sp], and read per tile) with its XLA blockwise backward, against the same references at the same tolerances
with jax_enable_x64 off for the kernel: one case in the default group (3x5, shifted: one interpreted tile, its
padding rows and columns), the others slow, Swin's 7x7 and 3x7 (tiles that start inside a window) among them.

Lowered for CUDA at a Swin-like shape (64 maps x 16 windows of 7x7, N = 4, H = 32, bf16; nothing is compiled):
the kernel's Triton custom calls, no [B*nW, N, T, T] value (with implementation="pallas_gpu" no [..,T,T] value
at all), forward and forward+backward, shifted and not. Lowered for TPU the same, implementation=None: Mosaic's
custom call, and jaxattn.models' Swin under None.
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_window_bias import index_loop, regions_loop

import jaxattn
from helpers import allowed_loop, attention_loop, attention_reference, normwise
from jaxattn._core.call import AttentionCall
from jaxattn._core.offset_bias import TableBias
from jaxattn._kernels import flex_tpu, pallas_gpu
from jaxattn._kernels.flash import plan

OUT_TOL, GRAD_TOL = 1e-6, 1e-5
B, N, K, H, Hv = 2, 5, 1, 7, 11

# name: (window (Wh, Ww), grid (height, width) of one map, shift (sh, sw) or None, cls_token)
CASES = {
    # 3 windows of 3x7 = 21 tokens: two 16-wide tiles each, the second half padding; rolled by (1, 2)
    "shifted 3x7": ((3, 7), (9, 7), (1, 2), False),
    "unshifted 3x7": ((3, 7), (3, 21), None, False),
    "shifted 2x3": ((2, 3), (6, 3), (1, 1), False),
    # BEiT: a cls token at position 0 with its three rows (no shift: BEiT has none)
    "beit 2x3": ((2, 3), (2, 9), None, True),
    # Swin's window (49 tokens: four 16-wide interpreted tiles, the last with one token) and a 3x5 one
    "shifted 7x7": ((7, 7), (7, 21), (3, 3), False),
    "shifted 3x5": ((3, 5), (9, 5), (1, 2), False),
}
DEFAULT_CASE = "shifted 3x7"
DEFAULT_TPU_CASE = "shifted 3x5"  # one 16-wide interpreted tile and its padding: half the 3x7 case's programs
GPU_CASES = ("shifted 3x7", "unshifted 3x7", "shifted 2x3", "beit 2x3")


def _setup(name, seed=7):
    window, grid, shift, cls_token = CASES[name]
    Wh, Ww = window
    nW = (grid[0] // Wh) * (grid[1] // Ww)
    T = Wh * Ww + cls_token
    rng = np.random.default_rng(seed)
    q, k, v, w = (
        rng.normal(size=shape).astype(np.float32)
        for shape in ((B, nW, T, N, H), (B, nW, T, K, H), (B, nW, T, K, Hv), (B, nW, T, N, Hv))
    )
    table = rng.normal(size=(jaxattn.window_table_rows(window, cls_token=cls_token), N)).astype(np.float32)
    options = {}
    if shift is not None:
        segments = jaxattn.shifted_window_segments(grid, window, shift)  # [nW, T]: broadcast over the maps
        np.testing.assert_array_equal(np.asarray(segments), regions_loop(*grid, Wh, Ww, *shift))
        options = dict(query_segment_ids=segments, key_segment_ids=segments)
    return window, cls_token, options, (q, k, v, table), w


def _loss_and_grads(f, args, w):
    @jax.jit
    def run(*args):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(jnp.asarray(w, out.dtype))

    return run(*args)


def _flat(x):
    """[B, nW, ...] -> [B * nW, ...]: the references' one batch axis."""
    return np.asarray(x).reshape(-1, *np.shape(x)[2:])


def _check(name, dtype=np.float32, tolerances=(OUT_TOL, GRAD_TOL, GRAD_TOL), implementation="pallas_gpu"):
    window, cls_token, options, args, w = _setup(name)
    args = tuple(jnp.asarray(x, dtype) for x in args)
    q, k, v, table = args
    out_tol, grad_tol, table_tol = tolerances
    nW, T = q.shape[1], q.shape[2]

    def kernel(*a):
        options_ = dict(options, implementation=implementation, interpret=True, precision="highest")
        return jaxattn.window_attention(*a, window, cls_token=cls_token, **options_)

    def dense(*a):
        return jaxattn.window_attention(
            *a, window, cls_token=cls_token, implementation="dense", precision="highest", **options
        )

    # the Pallas TPU kernels index in int32: they run with jax_enable_x64 off (its float32 is all they take)
    with jax.enable_x64(False) if implementation == "pallas_tpu" else contextlib.nullcontext():
        out, grads = _loss_and_grads(kernel, args, w)
    assert out.dtype == dtype and out.shape == (B, nW, T, N, Hv)

    # the float64 loop: the bias of the loop's index, the regions as segment ids per (map, window)
    index = index_loop(*window, cls_token)  # [T,T]
    bias = np.moveaxis(np.asarray(table, np.float64)[index], -1, 0)  # [N,T,T], every window's
    rules = {}
    if options:
        segments = np.broadcast_to(np.asarray(options["query_segment_ids"]), (B, nW, T))
        rules = dict(query_segment_ids=_flat(segments), key_segment_ids=_flat(segments))
    want, _ = attention_loop(*(_flat(np.asarray(x, np.float64)) for x in (q, k, v)), bias=bias, **rules)
    want = want.reshape(out.shape)
    assert normwise(out, want) <= out_tol, normwise(out, want)

    # gradients: attention_reference (helpers) with the bias gathered differentiably at the loop's index
    allowed = allowed_loop((B * nW,), N, T, T, **rules)

    def reference(q, k, v, table):
        flat = (x.reshape(-1, *x.shape[2:]) for x in (q, k, v))
        bias = jnp.broadcast_to(jnp.moveaxis(table[index], -1, 0), (B * nW, N, T, T))
        return attention_reference(*flat, allowed, bias=bias).reshape(B, nW, T, N, Hv)

    wide = tuple(jnp.asarray(x, np.float64) for x in args)
    want_out, want_grads = _loss_and_grads(reference, wide, w)
    assert normwise(want_out, want) <= 1e-12  # the two references agree
    dense_out, dense_grads = _loss_and_grads(dense, wide, w)
    assert normwise(dense_out, want) <= 1e-12
    for got, ref, eng, arg, what in zip(grads, want_grads, dense_grads, args, ("q", "k", "v", "table")):
        assert got.dtype == arg.dtype, what
        assert normwise(eng, ref) <= 1e-12, what
        assert normwise(got, ref) <= (table_tol if what == "table" else grad_tol), (what, normwise(got, ref))
    return normwise(out, want), [normwise(g, r) for g, r in zip(grads, want_grads)]


@pytest.mark.parametrize(
    "name", [n if n == DEFAULT_CASE else pytest.param(n, marks=pytest.mark.slow) for n in GPU_CASES]
)
def test_kernel_matches_the_float64_loop(name):
    _check(name)


@pytest.mark.parametrize(
    "name", [n if n == DEFAULT_TPU_CASE else pytest.param(n, marks=pytest.mark.slow) for n in CASES]
)
def test_tpu_kernel_matches_the_float64_loop(name):
    """flex_tpu's forward (the window's bias of every pair, pair_bias_of_grid, read per tile) and its gradient,
    the XLA blockwise backward, into the table too (closure-converted out of the TableBias)."""
    _check(name, implementation="pallas_tpu")


@pytest.mark.slow
def test_kernel_in_float64_is_exact():
    """float64 inputs (the interpreter runs them): every term, the table's scatter-add included, in float64."""
    _check("beit 2x3", np.float64, (1e-12, 1e-12, 1e-12))


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["pallas_gpu", "pallas_tpu"])
def test_under_vmap(kernel):
    """vmap over the maps (a batch axis the kernel does not see: the Pallas call's batching rule adds a grid
    axis), the table and the regions shared."""
    window, cls_token, options, (q, k, v, table), w = _setup("shifted 2x3")

    def one(impl):
        extra = dict(interpret=True) if impl == kernel else {}

        def loss(q, k, v, table):
            out = jax.vmap(
                lambda q, k, v: jaxattn.window_attention(
                    q, k, v, table, window, implementation=impl, precision="highest", **extra, **options
                )
            )(q, k, v)
            return jnp.sum(out * w)

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, table)

    with jax.enable_x64(False) if kernel == "pallas_tpu" else contextlib.nullcontext():
        got, got_grads = one(kernel)
    want, want_grads = one("dense")
    assert normwise(got, want) <= OUT_TOL
    for g, e in zip(got_grads, want_grads):
        assert normwise(g, e) <= GRAD_TOL


# ---------------------------------------------------------------------------------------------------------
# what the kernels take and refuse


def test_what_the_kernels_refuse():
    T = 6
    q = k = v = jnp.zeros((4, T, 5, 3), jnp.float32)
    bias = jaxattn.window_position_bias(jnp.zeros((15, 5)), (2, 3))
    assert isinstance(bias, TableBias) and bias.length == T

    def refusal(kernel, interpret=False, q=q, **options):
        return kernel.unsupported(AttentionCall(position_bias=bias, **options), q, q, q, interpret)

    assert refusal(pallas_gpu) is None
    segments = jnp.arange(T) // 3
    assert refusal(pallas_gpu, query_segment_ids=segments, key_segment_ids=segments) is None
    # the index holds for a window's own places: positions of one's own or another length are refused by name
    assert refusal(pallas_gpu, query_positions=jnp.arange(T)).startswith("query_positions")
    assert refusal(pallas_gpu, key_positions=jnp.arange(T)).startswith("key_positions")
    assert refusal(pallas_gpu, q=jnp.zeros((4, T + 1, 5, 3))).startswith("position_bias")
    # the TPU flex kernel reads the window's bias of every pair (with x64 off: it indexes in int32), and
    # refuses what the GPU kernel refuses, by the same names
    with jax.enable_x64(False):
        for interpret in (False, True):
            assert refusal(flex_tpu, interpret) is None
            assert refusal(flex_tpu, interpret, query_segment_ids=segments, key_segment_ids=segments) is None
            assert refusal(flex_tpu, interpret, query_positions=jnp.arange(T)).startswith("query_positions")
            assert refusal(flex_tpu, interpret, q=jnp.zeros((4, T + 1, 5, 3))).startswith("position_bias")
    assert refusal(flex_tpu, True).startswith("jax_enable_x64")
    # an explicit kernel names what it cannot do; None falls back to the XLA engines
    table = jnp.ones((15, 5), jnp.float32)
    with pytest.raises(ValueError, match="return_weights"):
        jaxattn.window_attention(
            q, k, v, table, (2, 3), implementation="pallas_gpu", interpret=True, return_weights=True
        )
    got, weights = jaxattn.window_attention(q, k, v, table, (2, 3), return_weights=True)
    assert weights.shape == (4, 5, T, T)
    assert plan.position_bias_refusal(AttentionCall(), T, T) is None


def test_the_tpu_kernel_bounds_the_bias_of_every_pair():
    """flex_tpu reads a window's bias of every pair, N x Tp x Sp float32 on a TPU's 128-wide grid: within
    MAX_PAIR_BIAS_BYTES (16 MiB) it takes the call, beyond it refuses by name (None falls back to XLA)."""
    assert flex_tpu.MAX_PAIR_BIAS_BYTES == 16 * 2**20

    def refusal(window, N):
        T = window[0] * window[1]
        q = jnp.zeros((1, T, N, 1), jnp.float32)
        bias = jaxattn.window_position_bias(jnp.zeros((jaxattn.window_table_rows(window), N)), window)
        with jax.enable_x64(False):
            return flex_tpu.unsupported(AttentionCall(position_bias=bias), q, q, q, True)

    # 32 x 64 = 2048 tokens: 1 head is 2048 * 2048 * 4 = 16 MiB, 2 heads 32 MiB
    assert refusal((32, 64), 1) is None
    problem = refusal((32, 64), 2)
    assert problem.startswith("position_bias") and "2 heads x 2048 x 2048" in problem and "16 MiB" in problem
    # 2047 tokens pad to the same grid; 12 x 12 (Tp = 256) takes Swin-L's 48 heads: 12 MiB
    assert refusal((23, 89), 2).startswith("position_bias")
    assert refusal((12, 12), 48) is None


def test_explicit_pallas_tpu_runs_a_window_and_names_what_it_refuses():
    """implementation="pallas_tpu" (interpreted) computes window_attention (splash has no position bias:
    the flex kernel takes it), and names an option it cannot express."""
    T, window = 6, (2, 3)
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(4, T, 5, 3)).astype(np.float32) for _ in range(3))
    table = rng.normal(size=(15, 5)).astype(np.float32)
    with jax.enable_x64(False):
        got = jaxattn.window_attention(q, k, v, table, window, implementation="pallas_tpu", interpret=True)
        with pytest.raises(ValueError, match="return_weights"):
            jaxattn.window_attention(
                q, k, v, table, window, implementation="pallas_tpu", interpret=True, return_weights=True
            )
    index = index_loop(*window)
    bias = np.moveaxis(np.asarray(table, np.float64)[index], -1, 0)
    want, _ = attention_loop(*(np.asarray(x, np.float64) for x in (q, k, v)), bias=bias)
    assert normwise(got, want) <= OUT_TOL


def test_the_kernel_reads_the_table_in_its_tiles():
    """The rows handed to the kernel are the table itself ([N,R], no [T,T] gather outside the kernel), and the
    index the tiles evaluate is WindowIndex, equal to the loop's on every pair of the window."""
    table = jnp.arange(3 * 13 * 2, dtype=jnp.float32).reshape(-1, 2)  # window 2x7: R = 3 * 13
    bias = jaxattn.window_position_bias(table, (2, 7))
    rows, index = bias.kernel_table(14, 14, default_positions=True)
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(table).T)
    t = jnp.arange(14, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(index(t, t)), index_loop(2, 7))
    assert hash(index) == hash(type(index)(2, 7, False))  # a static argument of the kernel: hashed by value
    assert bias.kernel_table(14, 14, default_positions=False) is None


# ---------------------------------------------------------------------------------------------------------
# lowered for CUDA at a Swin-like shape

MAPS, WINDOWS, WINDOW = 64, 16, (7, 7)
TRITON = "__gpu$xla.gpu.triton"


def _lowered(fn, *args):
    with jax.enable_x64(False), jaxattn.cross_platform_lowering():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "program, implementation, shifted",
    [("forward+backward", None, True)]  # the forward is in it; the rest repeat it (slow group)
    + [pytest.param("forward", None, True, marks=pytest.mark.slow)]
    + [pytest.param("forward+backward", "pallas_gpu", s, marks=pytest.mark.slow) for s in (False, True)],
)
def test_lowered_for_cuda_is_the_kernel(program, implementation, shifted):
    heads, T = 4, WINDOW[0] * WINDOW[1]
    q = jax.ShapeDtypeStruct((MAPS * WINDOWS, T, heads, 32), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((jaxattn.window_table_rows(WINDOW), heads), jnp.float32)
    options = {}
    if shifted:  # a 28x28 map of 16 windows, rolled by 3: the regions, the same for every map
        segments = jnp.tile(jaxattn.shifted_window_segments((28, 28), WINDOW, 3), (MAPS, 1))
        options = dict(query_segment_ids=segments, key_segment_ids=segments)

    def forward(q, table):
        return jaxattn.window_attention(q, q, q, table, WINDOW, implementation=implementation, **options)

    if program == "forward":
        fn = forward
    else:
        fn = jax.grad(lambda q, t: jnp.sum(forward(q, t).astype(jnp.float32)), argnums=(0, 1))
    text = _lowered(fn, q, table)
    kernels = set(re.findall(r'name = "(jaxattn_flash_\w+)"', text))
    want = {"jaxattn_flash_forward"} | ({"jaxattn_flash_dq", "jaxattn_flash_dkv"} if program != "forward" else set())
    assert TRITON in text and kernels == want, kernels
    assert "stablehlo.while" not in text, "an XLA tile loop"
    # No [B*nW, N, T, T] value (a bias, logits or weights of the batch). Under implementation=None and a
    # gradient the platform switch's XLA branch (the CPU fallback: the dense engine) keeps such residuals, and
    # the CUDA branch returns zero fills of them that nothing reads (test_kernel_relative's long-sequence test
    # says why): those broadcasts of a scalar and their passing between the switch's functions are the only
    # lines allowed.
    if implementation == "pallas_gpu":  # not even one window's [N,T,T] bias: the tiles read the table [N,R]
        assert not re.search(rf"x{T}x{T}x", text), "a [..,T,T] value"
    batch_grid = re.compile(rf"[<x]{MAPS * WINDOWS}x{heads}x{T}x{T}x(f32|bf16|f16|i1|i32)>")
    for line in text.splitlines():
        if not batch_grid.search(line):
            continue
        op = re.search(r"= ([\w.]+)", line)
        assert implementation is None and program != "forward", f"a [B*nW,N,T,T] buffer: {line.strip()[:200]}"
        if op is None or op.group(1) == "call":  # function signatures, returns, calls: plumbing
            continue
        assert op.group(1) == "stablehlo.broadcast_in_dim" and re.search(r": \(tensor<\w+>\) ->", line), line[:200]


def _lowered_for_tpu(fn, *args):
    with jax.enable_x64(False), jaxattn.cross_platform_lowering():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("shifted", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_lowered_for_tpu_is_the_flex_kernel(shifted):
    """ "pallas_tpu" lowered for TPU (forward): Mosaic's call of the flex kernel, no XLA tile loop, and
    no [B*nW, N, T, T] value: the bias is one window's, [N,128,128] on the kernel's grid (whether Mosaic
    compiles it: .ci/compile_targets.py, "swin" / "swin shifted" on v5e and v6e). implementation=None: the XLA
    engines (flex_tpu.declined)."""
    heads, T = 4, WINDOW[0] * WINDOW[1]
    q = jax.ShapeDtypeStruct((MAPS * WINDOWS, T, heads, 32), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((jaxattn.window_table_rows(WINDOW), heads), jnp.float32)
    options = {}
    if shifted:
        segments = jnp.tile(jaxattn.shifted_window_segments((28, 28), WINDOW, 3), (MAPS, 1))
        options = dict(query_segment_ids=segments, key_segment_ids=segments)

    def lowered(implementation):
        return _lowered_for_tpu(
            lambda q, table: jaxattn.window_attention(q, q, q, table, WINDOW, implementation=implementation, **options),
            q,
            table,
        )

    # None declines the kernel on TPU (flex_tpu.declined: its padded tiles hold 4-9x the dense engine's memory)
    assert "tpu_custom_call" not in lowered(None)
    text = lowered("pallas_tpu")
    assert "tpu_custom_call" in text and 'name = "jaxattn_flex_tpu_forward"' in text
    assert "stablehlo.while" not in text, "an XLA tile loop"
    assert not re.search(rf"[<x]{MAPS * WINDOWS}x{heads}x{T}x{T}x", text), "a [B*nW,N,T,T] value"
    assert re.search(rf"tensor<1x{heads}x128x128xf32>", text), "the window's bias on the kernel's grid"


@pytest.mark.slow  # the model's trace: about 10 s
def test_swin_model_lowered_for_tpu_takes_the_flex_kernel():
    """jaxattn.models' Swin (two stages, windows of 4x4, shifted in the second block) with implementation=
    "pallas_tpu", lowered for TPU: every attention call is the flex kernel's (one Mosaic call per block)."""
    from jaxattn.models.swin import SwinConfig, SwinModel, init_params

    config = SwinConfig(
        image_size=32,
        patch_size=2,
        embed_dim=12,
        depths=(2, 2),
        num_heads=(2, 3),
        window_size=4,
        implementation="pallas_tpu",
    )
    model = SwinModel(config)
    with jax.enable_x64(False):  # the kernel refuses 64-bit mode, which init would trace in
        params = jax.eval_shape(lambda: init_params(config))
    pixels = jax.ShapeDtypeStruct((2, 3, 32, 32), jnp.float32)
    text = _lowered_for_tpu(lambda p, x: model.apply({"params": p}, x)["last_hidden_state"], params, pixels)
    assert len(re.findall(r'name = "jaxattn_flex_tpu_forward"', text)) == sum(config.depths)
