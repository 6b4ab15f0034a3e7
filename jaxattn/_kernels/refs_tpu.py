"""What the TPU kernels (flex_tpu, its backward flex_tpu_vjp) share: views of refs that let the shared kernel
bodies (flash.forward, flash.backward) read them as the GPU layout's (a [1,L] row read as [L]: Row;
a schedule flattened into SMEM read at a program's indices: Scalars), lane-aligned windows (lane_window), and the
lane rolls that move a tile's entries onto its diagonals and back (a position term of j - i without a gather or
a scatter: toeplitz_tile, diagonals, undiagonals)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128
SUBLANES = 8  # the rows of a 32-bit vreg
# An input or output left in HBM (memory space ANY): the kernel copies what it needs itself (Streamed, pairs_tpu).
IN_HBM = pl.BlockSpec(memory_space=pl.ANY)


class TpuRefs(NamedTuple):
    """A TPU kernel's own refs beside the shared bodies' (flash.refs.Refs): VMEM tiles and DMA semaphores for rows
    left in HBM (Streamed), float32 sums of dk and dv over a group's query heads, a window bias's block."""

    k_tile: Any = None
    v_tile: Any = None
    key_sem: Any = None
    q_tile: Any = None
    do_tile: Any = None
    query_sem: Any = None
    dk_sum: Any = None
    dv_sum: Any = None
    pair_bias: Any = None  # flex_tpu: a window bias's [Tb,Sp] rows of every key (pair_bias_of_grid)


def scalars_at(ref, shape, base, axes=None):
    """Scalars(ref, shape, base, axes), or None for an absent ref."""
    return None if ref is None else Scalars(ref, shape, base, axes)


def rows_of(r, names) -> dict:
    """{name: Row(ref)} of the refs `names` of r (a NamedTuple) that are present: for r._replace."""
    return {name: Row(getattr(r, name)) for name in names if getattr(r, name) is not None}


class Row:
    """A [1,L] block read and written as [L] (TPU blocks are two-dimensional; the kernel reads rows)."""

    def __init__(self, ref):
        self.ref, self.dtype, self.shape = ref, ref.dtype, ref.shape[1:]

    def __getitem__(self, index):
        return self.ref[0, :] if index is Ellipsis else self.ref[0, index]

    def __setitem__(self, index, value):
        self.ref[0, :] = value


class Scalars:
    """An array of `shape`, in SMEM flattened (row-major), read at a program's `base` (a leading index, the rest
    0): [...] the scalar there, [j] (or [h, j]) the entries `axes` further (default: the axis after base's).

    Flattened because SMEM pads each last-axis row of a 2D or wider array to 128 words: a schedule [B,1,1,1]
    of 1024 windows (Swin's shifted regions as segment ids) took 512 KiB of the 1 MiB, order and counts all
    of it; flat, 4 KiB each."""

    def __init__(self, ref, shape, base, axes=None):
        strides = [int(np.prod(shape[a + 1 :], dtype=np.int64)) for a in range(len(shape))]
        self.ref = ref
        self.start = sum(index * stride for index, stride in zip(base, strides))
        if axes is None:
            axes = (len(base),) if len(base) < len(shape) else ()
        self.steps = tuple(strides[a] for a in axes)

    def __getitem__(self, index):
        if index is Ellipsis:
            return self.ref[self.start]
        index = index if isinstance(index, tuple) else (index,)
        return self.ref[self.start + sum(i * step for i, step in zip(index, self.steps))]


class Streamed:
    """One head's rows of an array left in HBM ([B,heads,L,F]: keys, values, queries or their cotangent), read as
    a kernel reads its whole VMEM block: [rows, columns] (or [rows, g, columns], the dk/dv kernel's reading of
    query head g, the head fixed here) copies those rows of head (b, h) into a VMEM tile and waits for the copy
    (rows past flex_tpu_vjp.MAX_ROWS_BYTES; the wait is not hidden, and not timed: no TPU has been lent)."""

    def __init__(self, ref, tile, sem, b, h, one_head_of_many=False):
        self.ref, self.tile, self.sem, self.b, self.h = ref, tile, sem, b, h
        self.dtype = tile.dtype
        L, F = ref.shape[2], ref.shape[3]
        self.shape = (L, 1, F) if one_head_of_many else (L, F)

    def __getitem__(self, index):
        rows, columns = index[0], index[-1]
        copy = pltpu.make_async_copy(self.ref.at[self.b, self.h, rows], self.tile, self.sem)
        copy.start()
        copy.wait()
        return self.tile[:, columns]


def window(Tb: int, Sb: int) -> int:
    """Lanes toeplitz_tile loads: the tile's Tb + Sb - 1 diagonals from any start within a lane tile."""
    return -(-(Tb + Sb - 1) // LANES) * LANES + LANES


def lane_window(start, W: int):
    """(pl.ds of W lanes from the lane tile that holds start, start's offset in it): an aligned dynamic slice,
    as Mosaic needs (start >= 0, traced)."""
    aligned = pl.multiple_of(lax.div(start, LANES) * LANES, LANES)  # start >= 0: lax.div floors
    return pl.ds(aligned, W), start - aligned


def toeplitz_tile(row, start, Tb: int, Sb: int):
    """[Tb,Sb]: tile[r, c] = row[start + (Tb - 1 - r) + c], the bias of a tile whose offsets j - i grow by one
    per key and fall by one per query (row: the [1,E] block of a head's offset rows; start >= 0, traced).

    Without a gather: the window row[0, a : a + W] from the lane tile a that holds start (an aligned dynamic
    slice, as Mosaic needs), broadcast to Tb rows, and rolled along the lanes by W - (Tb - 1) - (start - a)
    plus r in row r (pltpu.roll's stride): rolled[r, c] = window[(c + (Tb - 1 - r) + start - a) mod W], never
    wrapping for c < Sb (window())."""
    W = window(Tb, Sb)
    at, offset = lane_window(start, W)
    lanes = jnp.broadcast_to(row[0, at][None, :], (Tb, W))
    return diagonals(lanes, offset, Sb)


def diagonals(lanes, offset, C: int):
    """[R,C]: tile[r, c] = lanes[r, offset + (R - 1 - r) + c] of lanes [R,W] (offset in 0..W - R - C + 1,
    traced): each row rolled along the lanes by W - (R - 1) - offset plus r, rolled[r, c] = lanes[r, (c +
    (R - 1 - r) + offset) mod W]. Two rolls (rotations along one axis add up): the traced W - offset, the same
    for every row, and the static W - (R - 1) plus r (pltpu.roll's stride). Mosaic compiles a strided roll by
    a static amount only: libtpu 0.0.48.1 and later (jax 0.11's) refuse a traced one ("strided dynamic
    rotation along the two last dimensions is unsupported"), which 0.0.42.1 (jax 0.10's) took."""
    R, W = lanes.shape
    uniform = pltpu.roll(lanes, lax.rem(W - offset, W), 1)  # offset in 0..W: a shift in 0..W - 1
    return pltpu.roll(uniform, (W - (R - 1)) % W, 1, stride=1, stride_axis=0)[:, :C]


def undiagonals(tile, offset, W: int):
    """[R,W]: diagonals' inverse, out[r, offset + (R - 1 - r) + c] = tile[r, c] (zeros elsewhere): row r
    rolled right by offset + R - 1 - r, one lane less per row. A stride of -1 has no static roll either
    (pltpu.roll takes no negative stride, and Mosaic refuses W - 1: a shift past a vreg's 128 lanes within its
    8 rows), so, data movement only (exact): the traced offset, the same for every row; then, with rows
    r = 8 g + s (a vreg's 8 sublanes; 1 row per group where R is no multiple of 8), each group's static
    R - 8 - 8 g and the rest, 7 - s, bit by bit (a static roll by 2^b taken by the rows whose 7 - s has bit b):
    five rolls and three selects over the tile (R - 1 - r bit by bit would be 1 + log2 R rolls and log2 R)."""
    R, C = tile.shape
    out = jnp.concatenate([tile, jnp.zeros((R, W - C), tile.dtype)], axis=1)
    out = pltpu.roll(out, offset, 1)  # offset in 0..W - R - C + 1
    h = SUBLANES if R % SUBLANES == 0 else 1  # rows r = g + s, g a multiple of h, s < h
    out = jnp.concatenate([pltpu.roll(out[g : g + h], R - h - g, 1) for g in range(0, R, h)], axis=0)
    rest = (h - 1) - lax.broadcasted_iota(jnp.int32, (R, W), 0) % h  # row r's rotation still to do
    for b in range((h - 1).bit_length()):
        out = jnp.where((rest & (1 << b)) != 0, pltpu.roll(out, 1 << b, 1), out)
    return out
