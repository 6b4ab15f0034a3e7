"""Views of TPU kernel refs that let the shared kernel bodies (tile_body, flash_gpu's dq and dk/dv kernels) read
them as the GPU layout's: a [1,L] row read as [L] (Row), and a schedule flattened into SMEM read at a program's
indices (Scalars). Used by the TPU flex kernel (flex_tpu) and its backward (tpu_backward)."""

from __future__ import annotations

import numpy as np


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
