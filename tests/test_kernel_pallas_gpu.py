"""The Pallas GPU kernel (jaxattn._kernels.pallas_gpu) beyond the option grid, run by Pallas' interpreter on CPU.

The grid itself (every option, on every implementation, against the float64 loop reference) is
tests/test_contract.py's. Here: the kernel against the dense engine on a BlockMask given as raw tile lists with
empty tiles (slow), under vmap (slow), what `unsupported` names on a GPU (the chip's limits, which the
interpreter lifts), and the CUDA lowering (one Triton custom call per kernel, no XLA tile loop), on this CPU
machine. float32 at highest precision: outputs and lse <= 1e-6, gradients <= 1e-5, normwise.
"""

import contextlib
import functools
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

import jaxattn
from helpers import normwise
from jaxattn._core.call import AttentionCall
from jaxattn._kernels import pallas_gpu
from jaxattn._kernels.flash import plan, sizes

OUT_TOL, GRAD_TOL = 1e-6, 1e-5


def _arrays(seed, *shapes, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=shape).astype(dtype)) for shape in shapes]


def _alibi(slope):
    return lambda score, b, n, t, s: score - slope[n] * jnp.abs(t - s).astype(score.dtype)


def _band(b, n, t, s):
    return (t - s) % 5 != 3


def _case(name):
    """(shapes (batch, T, S, N, K, H, Hv), block, options, differentiable extras {name: array}) of one case: a
    BlockMask from raw tile lists (empty, partial, full tiles per head) with its mask_mod, and a score_mod."""
    rng = np.random.default_rng(7)
    if name == "score_mod_mask_mod_block_mask":
        batch, T, S, N, K, H, Hv = (3,), 19, 23, 6, 2, 5, 3
        kinds = rng.integers(0, 3, (1, N, 3, 3))
        kinds[0, :, 1, 0] = 0  # an empty tile for every head
        block_mask = jaxattn.BlockMask.from_kv_blocks(
            *_tile_lists(kinds), block_size=(8, 8), query_length=T, key_length=S, mask_mod=_band
        )
        return (
            (batch, T, S, N, K, H, Hv),
            None,
            dict(block_mask=block_mask, is_causal=True, return_lse=True),
            {"slope": jnp.asarray(rng.uniform(0.1, 1.0, N), jnp.float32)},
        )
    if name == "block_mask_sub_tiles":  # tiles of 32 x 48: the kernels take 16 x 16 sub-tiles of them (prepare)
        batch, T, S, N, K, H, Hv = (), 67, 101, 3, 1, 5, 3
        kinds = rng.integers(0, 3, (1, N, 3, 3))
        kinds[0, :, 0, 2] = 0  # an empty tile for every head, past its diagonal
        kinds[0, 0, 2, 1] = 2  # a full tile: its sub-tiles skip mask_mod
        block_mask = jaxattn.BlockMask.from_kv_blocks(
            *_tile_lists(kinds), block_size=(32, 48), query_length=T, key_length=S, mask_mod=_band
        )
        return (
            (batch, T, S, N, K, H, Hv),
            None,
            dict(block_mask=block_mask, return_lse=True),
            {"slope": jnp.asarray(rng.uniform(0.1, 1.0, N), jnp.float32)},
        )
    raise KeyError(name)


def _tile_lists(kinds):
    """torch's tile lists (partial then full) from kinds [B,N,Tn,Sn] (0 empty, 1 partial, 2 full)."""

    def listing(selected):
        order = np.argsort(~selected, axis=-1, kind="stable")
        return jnp.asarray(selected.sum(-1), jnp.int32), jnp.asarray(order, jnp.int32)

    return (*listing(kinds == 1), *listing(kinds == 2))


CASES = ["score_mod_mask_mod_block_mask"]


def _attend(impl, block, options, extras):
    """f(q, k, v, extras) -> (out, lse or None) for the kernel ("kernel") or the dense engine ("dense")."""

    def f(q, k, v, extras):
        opts = dict(options, score_mod=_alibi(extras["slope"]))
        if impl == "kernel":
            result = pallas_gpu.attention(AttentionCall(precision="highest", block_size=block, **opts), q, k, v, True)
        else:
            result = jaxattn.flex_attention(q, k, v, implementation="dense", precision="highest", **opts)
        return result if opts.get("return_lse") else (result, None)

    return f


def _run(impl, case):
    """jit of (out, lse, gradients of sum(out * w) + sum(lse * w_lse) over finite lse) for one case, float32."""
    (batch, T, S, N, K, H, Hv), block, options, extras = _case(case)
    q, k, v, w, w_lse = _arrays(
        1, (*batch, T, N, H), (*batch, S, K, H), (*batch, S, K, Hv), (*batch, T, N, Hv), (*batch, N, T)
    )
    f = _attend(impl, block, options, extras)

    @jax.jit
    def both(q, k, v, extras):
        (out, lse), vjp = jax.vjp(f, q, k, v, extras)
        # rows with no allowed key have lse = -inf and no gradient: their cotangent is 0
        d_lse = None if lse is None else jnp.where(jnp.isfinite(lse), w_lse, 0).astype(lse.dtype)
        return out, lse, vjp((w.astype(out.dtype), d_lse))

    return both(q, k, v, extras)


def _compare(got, expected, out_tol, grad_tol):
    (out, lse, grads), (out_e, lse_e, grads_e) = got, expected
    assert normwise(out, out_e) <= out_tol, normwise(out, out_e)
    if lse_e is not None:
        assert bool(jnp.all(jnp.isfinite(lse) == jnp.isfinite(lse_e)))
        finite = jnp.isfinite(lse_e)
        assert normwise(jnp.where(finite, lse, 0), jnp.where(finite, lse_e, 0)) <= out_tol
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_e), strict=True):
        assert bool(jnp.all(jnp.isfinite(g)))
        assert normwise(g, e) <= grad_tol, normwise(g, e)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_dense(case):
    got = _run("kernel", case)
    _compare(got, _run("dense", case), OUT_TOL, GRAD_TOL)


def test_block_mask_sub_tiles_equal_dense():
    # each kernel tile inside one BlockMask tile, with its kind: empty ones skipped, full ones without mask_mod
    _compare(_run("kernel", "block_mask_sub_tiles"), _run("dense", "block_mask_sub_tiles"), OUT_TOL, GRAD_TOL)


@pytest.mark.parametrize(
    "mask_tiles, H, dtype, tiles",
    [
        ((512, 512), 128, jnp.bfloat16, (128, 32)),  # create_block_mask's default at T = 4096: issue 51 §2
        ((128, 128), 128, jnp.bfloat16, (128, 32)),
        ((128, 128), 64, jnp.bfloat16, (128, 64)),
        ((64, 16), 128, jnp.float32, (16, 16)),  # 16 x 64 wanted; 64 does not divide 16: the mask's 16 kept
        ((16, 16), 256, jnp.bfloat16, (16, 16)),
    ],
)
def test_block_mask_tiles_on_a_gpu(mask_tiles, H, dtype, tiles):
    """A BlockMask's tiles hold the GPU kernels' (mask_sub_tiles): the head dim's tiles where they divide the
    mask's. Its 512 x 512 tiles forced onto the backward asked 657408 bytes of an H100's 232448 of shared memory
    at head dim 128 bf16 (.ci/compile_targets.py's "flex block_mask 512 tiles" compiles it)."""
    T = 4096
    block_mask = jaxattn.create_block_mask(lambda b, n, t, s: s <= t, None, None, T, T, block_size=mask_tiles)
    q = jnp.zeros((1, T, 2, H), dtype)
    p = plan.prepare(AttentionCall(block_mask=block_mask), q, q, q, False)
    assert (p.cfg.Tb, p.cfg.Sb) == tiles
    assert p.side.order.shape[-2:] == (T // tiles[0], T // tiles[1])  # one key-tile schedule per kernel tile


# ---------------------------------------------------------------------------------------------------------
# what the kernel refuses


def test_unsupported_names_the_option():
    q, k, v = (jnp.zeros((2, 5, 2, 4), jnp.float32),) * 3

    def unsupported(interpret=False, **options):
        return pallas_gpu.unsupported(AttentionCall(**options), q, k, v, interpret)

    assert unsupported(is_causal=True, window=(3, 0), sinks=jnp.zeros(2)) is None
    assert unsupported(bias=jnp.zeros((5, 5))) == "bias"
    assert unsupported(mask=jnp.ones((5, 5), bool)) == "mask"
    assert unsupported(dropout_rate=0.1) == "dropout_rate"
    assert unsupported(return_weights=True) == "return_weights"
    assert unsupported(key_table=jnp.zeros((3, 4)), max_distance=1) is None  # Shaw tables: tests/test_kernel_shaw.py
    assert unsupported(rel_key=jnp.zeros((5, 5, 1, 4))) == "rel_key"  # per-pair tables stay the XLA engines'
    assert unsupported(position_bias=lambda i, j: 0.0) == "position_bias"
    slope = jnp.ones(2, jnp.float32)
    # Triton cannot index a closed-over array by head or position: on a GPU such a score_mod falls back
    assert unsupported(score_mod=_alibi(slope)) == "score_mod"
    assert unsupported(score_mod=_alibi(slope), interpret=True) is None
    assert unsupported(score_mod=lambda x, b, n, t, s: x * 0.5) is None
    assert unsupported(block_size=(24, 16)) == "block_size"
    with pytest.raises(ValueError, match="implementation.*bias"):
        pallas_gpu.attention(AttentionCall(bias=jnp.zeros((5, 5))), q, k, v, True)
    out, lse = pallas_gpu.attention(AttentionCall(return_lse=True), q, k[:, :0], v[:, :0], True)  # no key: no tile
    assert bool(jnp.all(out == 0)) and out.shape == (2, 5, 2, 4) and bool(jnp.all(lse == -jnp.inf))


# ---------------------------------------------------------------------------------------------------------
# lowering for CUDA (no GPU needed): one Triton custom call per kernel, no XLA tile loop


def _lowered(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


LOWERED = {
    "causal": lambda: dict(is_causal=True),
    # window, segment ids, and a score_mod and BlockMask mask_mod that close over no array (one that does
    # falls back: see unsupported)
    "window_segments_score_mod_block_mask": lambda: dict(
        window=(127, 0),
        query_segment_ids=jnp.zeros((1, 512), jnp.int32),
        key_segment_ids=jnp.zeros((1, 512), jnp.int32),
        score_mod=lambda x, b, n, t, s: x - 0.01 * jnp.abs(t - s).astype(x.dtype),
        block_mask=jaxattn.create_block_mask(lambda b, n, t, s: t >= s, None, None, 512, 512, block_size=(64, 64)),
    ),
}


@pytest.mark.parametrize("name", list(LOWERED))
def test_lowers_to_triton_for_cuda(name):
    options = LOWERED[name]()
    q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16)

    def f(q, k, v):
        return pallas_gpu.attention(AttentionCall(**options), q, k, v)

    forward = _lowered(f, q, q, q)
    backward = _lowered(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2)), q, q, q)
    assert forward.count("__gpu$xla.gpu.triton") == 1  # the forward kernel
    assert backward.count("__gpu$xla.gpu.triton") == 3  # forward, dq, dk/dv
    for text in (forward, backward):
        assert "stablehlo.while" not in text
        assert "512x512" not in text  # no [T,S] array


def test_forward_only_writes_no_lse():
    # lse [B,N,T] float32 is the backward's residual: a forward-only call without return_lse writes none (the
    # custom VJP's primal), a gradient or return_lse does (issue 36 §4)
    q = jax.ShapeDtypeStruct((1, 512, 3, 64), jnp.bfloat16)
    lse = "tensor<1x3x512xf32>"

    def f(q, return_lse=False):
        return pallas_gpu.attention(AttentionCall(is_causal=True, return_lse=return_lse), q, q, q)

    def loss(q):
        return jnp.sum(f(q).astype(jnp.float32))

    assert lse not in _lowered(f, q)
    assert lse in _lowered(lambda q: f(q, True)[1], q)
    assert lse in _lowered(jax.grad(loss), q)


def _triton_memory_ops(f, *args):
    """The program lowered for CUDA (nothing compiled), and (op, operand count, element type) of every tt.load /
    tt.store in the Triton IR of its kernels, as Pallas prints it when debug=True."""
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(io.StringIO()) as printed:
        patch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, debug=True))
        program = _lowered(f, *args)
    ops = re.findall(r"tt\.(load|store) ([^:]*?) : tensor<[0-9x]+!tt\.ptr<(\w+)>>", printed.getvalue())
    return program, [(op, len(operands.split(",")), dtype) for op, operands, dtype in ops]


def _masked(op, operands):
    """tt.load ptr, mask[, other] / tt.store ptr, value, mask: a mask operand past the pointer (and value)."""
    return operands >= (3 if op == "store" else 2)


@pytest.mark.parametrize("lengths", ["not whole tiles", "whole tiles"])
def test_tiles_past_the_arrays_are_masked_not_padded(lengths):
    # q, k, v, out (do, dq, dk, dv) are not padded to whole tiles and power-of-two head dims (32 MiB of copies
    # at [2,2000,8,128] bf16): every bf16 load and store of the forward, dq and dk/dv kernels, those arrays' tiles,
    # carries a mask where a tile can run past its array, and none does where every tile is whole (issue 36
    # §4). The interpreter cannot show a store unmasked (it drops what lands outside an array); the IR can.
    (T, S, H, Hv) = (77, 53, 40, 72) if lengths == "not whole tiles" else (128, 64, 64, 32)
    q = jax.ShapeDtypeStruct((2, T, 4, H), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((2, S, 2, H), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((2, S, 2, Hv), jnp.bfloat16)

    def f(q, k, v):
        return pallas_gpu.attention(AttentionCall(is_causal=True), q, k, v)

    def grads(q, k, v):
        return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2))(q, k, v)

    program, ops = _triton_memory_ops(grads, q, k, v)
    ops = [(op, n) for op, n, dtype in ops if dtype == "bf16"]
    stores = [n for op, n in ops if op == "store"]
    assert len(stores) == 4  # out, dq, dk, dv
    assert len([1 for op, n in ops if op == "load"]) >= 8  # q, k, v in the forward; q, do, k, v in dq and dk/dv
    masked = [_masked(op, n) for op, n in ops]
    assert all(masked) if lengths == "not whole tiles" else not any(masked), ops
    for shape in re.findall(r"tensor<2x(\d+)x\d+x(\d+)xbf16>", program):  # no padded copy of any of them
        assert shape in {(str(T), str(H)), (str(T), str(Hv)), (str(S), str(H)), (str(S), str(Hv))}, shape


# The tiles and warps measured spill-free (docs/kernels.md, "Tiles per head dim": ptxas -v on the forward, dq and
# dk/dv kernels compiled for an H100 and an A100, .ci/ptxas_report.py), stated per row of that table: (Tb, Sb,
# num_warps) for bf16 / fp16 and float32 inputs by padded head dim (up to 64, up to 128, up to 256).
MEASURED = {
    2: [(64, (128, 64, 8)), (128, (128, 32, 8)), (256, (32, 64, 8))],
    4: [(64, (32, 32, 8)), (128, (16, 64, 8)), (256, (16, 16, 8))],
}


def _measured_row(H, itemsize):
    padded = max(16, 1 << (H - 1).bit_length())  # head dims pad to powers of two >= 16
    return next(tiles for bound, tiles in MEASURED[itemsize] if padded <= bound)


@pytest.mark.parametrize("itemsize", [2, 4])
def test_gpu_tiles_follow_the_measured_table(itemsize):
    for H in (8, 16, 48, 64, 65, 80, 96, 128, 160, 192, 256):
        Tb, Sb, warps = _measured_row(H, itemsize)
        Hp = sizes.padded_head(H, interpret=False)
        assert sizes.tile_sizes(None, 4096, 2048, Hp, False, itemsize) == (Tb, Sb), H
        assert sizes.gpu_tiles(Hp, itemsize)[2] == warps, H
        # calls with Shaw's / DeBERTa's per-row tables: at most 64 query rows above head dim 64 (128 x 64 overran
        # the H100's shared memory at head dim 128 in the compile grid's "shaw causal", 247808 of 232448 bytes)
        table_rows = min(Tb, 64) if Hp > 64 else Tb
        assert sizes.tile_sizes(None, 4096, 2048, Hp, False, itemsize, tables=True) == (table_rows, Sb), H
        # shrunk to short sequences (the next power of two, never below 16), and block_size still overrides
        assert sizes.tile_sizes(None, 20, 7, Hp, False, itemsize) == (min(Tb, 32), 16)
        assert sizes.tile_sizes((16, 32), 4096, 2048, Hp, False, itemsize) == (16, 32)
    assert sizes.tile_sizes(None, 4096, 2048, 128, True, itemsize) == (16, 16)  # interpret mode


@pytest.mark.slow
def test_own_tiles_keep_the_head_dim_warps():
    # a kernel passing its own tiles to prepare (pairs_gpu' 16 x 16) keeps the warps it was measured with, JAX's
    # mha rule: 4 up to head dim 64, else 8; the flash kernel's own tiles take the measured table's 8
    for H, own in ((48, 4), (80, 8)):
        q = jnp.zeros((1, 37, 2, H), jnp.bfloat16)
        assert plan.prepare(AttentionCall(), q, q, q, False, blocks=(16, 16)).cfg.num_warps == own
        assert plan.prepare(AttentionCall(), q, q, q, False).cfg.num_warps == _measured_row(H, 2)[2]


@pytest.mark.slow  # the tile rule itself stays in the default group (test_gpu_tiles_follow_the_measured_table)
def test_kernels_launch_with_the_measured_tiles():
    # through the public API, lowered for CUDA: each kernel's Triton grid (forward / dq: T / Tb query tiles,
    # dk/dv: S / Sb key tiles, on grid_z) and num_warps, for a head dim that pads (80 -> 128) and one at 256
    def kernels(x, T, S):
        def loss(q):
            k = jnp.zeros((1, S, 2, x.shape[-1]), x.dtype)
            out = jaxattn.dot_product_attention(q, k, k, is_causal=True, implementation="pallas_gpu")
            return jnp.sum(out.astype(jnp.float32))

        text = _lowered(jax.grad(loss), jax.ShapeDtypeStruct((1, T, 2, x.shape[-1]), x.dtype))
        launches = re.findall(
            r'grid_z = (\d+) : i32, ir = "[^"]*", name = "(\w+)", num_stages = \d+ : i32, num_warps = (\d+)', text
        )
        return {name: (int(z), int(w)) for z, name, w in launches}

    T, S = 1024, 512
    with jax.enable_x64(False):  # the Pallas kernels index in int32
        for H, dtype in ((80, jnp.bfloat16), (256, jnp.bfloat16), (192, jnp.float32)):
            Tb, Sb, warps = _measured_row(H, np.dtype(dtype).itemsize)
            got = kernels(jnp.zeros((H,), dtype), T, S)
            assert got == {
                "jaxattn_flash_forward": (T // Tb, warps),
                "jaxattn_flash_dq": (T // Tb, warps),
                "jaxattn_flash_dkv": (S // Sb, warps),
            }, (H, dtype)


# ---------------------------------------------------------------------------------------------------------
# slow: vmap


@pytest.mark.slow
def test_vmap_over_a_batch_axis():
    q, k, v = _arrays(11, (3, 5, 6, 3), (3, 7, 2, 3), (3, 7, 2, 2))

    def attend(q, k, v):
        call = AttentionCall(precision="highest", block_size=(4, 4), is_causal=True)
        return pallas_gpu.attention(call, q, k, v, True)

    expected = jaxattn.dot_product_attention(q, k, v, implementation="dense", precision="highest", is_causal=True)
    got = jax.jit(jax.vmap(attend))(q, k, v)
    assert normwise(got, expected) <= OUT_TOL
    grads = jax.jit(jax.vmap(jax.grad(lambda *a: jnp.sum(attend(*a)), argnums=(0, 1, 2))))(q, k, v)
    grads_e = jax.grad(
        lambda *a: jnp.sum(
            jaxattn.dot_product_attention(*a, implementation="dense", precision="highest", is_causal=True)
        ),
        argnums=(0, 1, 2),
    )(q, k, v)
    for g, e in zip(grads, grads_e):
        assert normwise(g, e) <= GRAD_TOL
