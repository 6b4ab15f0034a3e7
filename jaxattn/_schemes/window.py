"""The 2D relative position bias of windowed vision encoders (Swin, Liu et al. 2021; BEiT, Bao et al. 2022).

A window of Wh x Ww patches is T = Wh * Ww tokens in row-major order: token p sits at (p // Ww, p % Ww). Each
head learns one scalar per 2D offset, a table [R,N] of R = (2 Wh - 1)(2 Ww - 1) rows, and

    logits[n,i,j] = scale * q_i . k_j + table[index[i,j], n]

Index convention: with the library's offsets (dh, dw) = key minus query (j - i, per axis),

    index[i,j] = (Wh - 1 - dh) * (2 Ww - 1) + (Ww - 1 - dw)

which is transformers' `relative_position_index` to the integer: HF (and the papers' code) store the rows by
query minus key, so a trained table loads as is. BEiT puts a cls token in front (T = Wh * Ww + 1, position 0)
and gives it three more rows: R - 3 for cls -> patch, R - 2 for patch -> cls, R - 1 for cls -> cls.

Swin's shifted windows roll the feature map by -(sh, sw) before cutting it into windows; a window that wraps
round the edge holds patches from up to four regions that were not neighbours, and attention stays inside
a region. The regions are segment ids (`shifted_window_segments`): query i may see key j iff their ids are
equal, SwinLayer.get_attn_mask's pattern (HF adds -100 where they differ; we mask, the difference is
exp(-100) ~ 4e-44 of a weight).

Letters beyond docs/design.md, "Axis letters", in this module's shapes: W the windows of a map (nW), Y and X
its height and width in patches.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax.numpy as jnp

from .._core import checks
from .._core.checks import static_int
from .._core.eager import compiled_when_eager
from .._core.offset_bias import TableBias
from .._core.positions import offsets, positions
from .position_bias import position_bias_attention

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Bool, Float, Int

    from .._core.shapes import AttentionOutput


def as_pair(name: str, value, minimum: int) -> tuple[int, int]:
    """An int or a pair (height, width) of Python ints >= minimum, as (height, width); else a ValueError naming it."""
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            checks.fail(name, "an int or a pair (height, width)", repr(value))
        return static_int(f"{name}[0]", value[0], minimum), static_int(f"{name}[1]", value[1], minimum)
    value = static_int(name, value, minimum)
    return value, value


def window_table_rows(window_size: int | tuple[int, int], *, cls_token: bool = False) -> int:
    """R, the rows of the bias table of a window: (2 Wh - 1)(2 Ww - 1), plus 3 with BEiT's cls token."""
    Wh, Ww = as_pair("window_size", window_size, 1)
    return (2 * Wh - 1) * (2 * Ww - 1) + (3 if cls_token else 0)


@dataclasses.dataclass(frozen=True)  # hashable by value: the Pallas GPU kernel evaluates it inside its tiles
class WindowIndex:
    """The table row of each (query, key) pair of token positions, int32 [...,T,S] from [...,T] and [...,S]
    (the module docstring's index; elementwise jnp only, so a kernel computes it per tile)."""

    Wh: int
    Ww: int
    cls_token: bool = False

    def __call__(self, query_pos, key_pos):
        Wh, Ww = self.Wh, self.Ww
        patch_q, patch_k = (query_pos, key_pos) if not self.cls_token else (query_pos - 1, key_pos - 1)  # cls at 0
        dh = offsets(patch_q // Ww, patch_k // Ww)  # key row minus query row
        dw = offsets(patch_q % Ww, patch_k % Ww)  # key column minus query column
        index = (Wh - 1 - dh) * (2 * Ww - 1) + (Ww - 1 - dw)
        if self.cls_token:
            R = (2 * Wh - 1) * (2 * Ww - 1) + 3
            q_cls, k_cls = (query_pos == 0)[..., :, None], (key_pos == 0)[..., None, :]
            index = jnp.where(q_cls, R - 3, jnp.where(k_cls, R - 2, index))
            index = jnp.where(q_cls & k_cls, R - 1, index)
        return index.astype(jnp.int32)


def window_relative_index(window_size: int | tuple[int, int], *, cls_token: bool = False) -> Int[Array, "T T"]:
    """int32 [T,T], T = Wh * Ww (+1 with `cls_token`): the table row of each pair of a window's tokens.

    Equal to transformers' SwinRelativePositionBias.relative_position_index (viewed [T,T]) and, with
    cls_token=True, to BeitRelativePositionBias.generate_relative_position_index.
    """
    Wh, Ww = as_pair("window_size", window_size, 1)
    T = Wh * Ww + (1 if cls_token else 0)
    return WindowIndex(Wh, Ww, cls_token)(*positions(T, T))


def _check_table(table, window_size, cls_token: bool):
    table = jnp.asarray(table)
    checks.check_rank("table", table, 2, "[R,N]: one learned scalar per 2D offset and head")
    checks.check_float("table", table)
    R = window_table_rows(window_size, cls_token=cls_token)
    checks.check_dim("table", table, 0, R, f"[R,N], R = (2 Wh - 1)(2 Ww - 1){' + 3' if cls_token else ''}")
    return table


def window_position_bias(table, window_size: int | tuple[int, int], *, cls_token: bool = False):
    """The 2D relative bias as a position function: (query_pos [...,T], key_pos [...,S]) -> [...,N,T,S].

    table: [R,N] (HF's `relative_position_bias_table`); positions are token positions in the window. The
    function is a TableBias (the table read at WindowIndex), which the Pallas GPU kernel computes inside its
    tiles (docs/kernels.md, "Position biases in the kernel").
    """
    Wh, Ww = as_pair("window_size", window_size, 1)
    table = _check_table(table, (Wh, Ww), cls_token)
    return TableBias(table, WindowIndex(Wh, Ww, cls_token), Wh * Ww + (1 if cls_token else 0))


def window_relative_bias(
    table: Float[ArrayLike, "R N"], window_size: int | tuple[int, int], *, cls_token: bool = False
) -> Float[Array, "N T T"]:
    """The additive bias [N,T,T] of one window: table[index[i,j], n] (HF's SwinRelativePositionBias())."""
    Wh, Ww = as_pair("window_size", window_size, 1)
    T = Wh * Ww + (1 if cls_token else 0)
    return window_position_bias(table, (Wh, Ww), cls_token=cls_token)(*positions(T, T))


@compiled_when_eager
def window_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B T K H"],
    value: Float[ArrayLike, "*#B T K Hv"],
    table: Float[ArrayLike, "R N"],
    window_size: int | tuple[int, int],
    *,
    cls_token: bool = False,
    **options,
) -> AttentionOutput:
    """Attention inside windows of Wh x Ww patches with the 2D relative bias added to the scaled logits.

    query / key / value hold one window each along T = Wh * Ww (+1 with BEiT's `cls_token`), patches in
    row-major order, the windows along the leading batch dims ([B, nW, T, N, H] or [B * nW, T, N, H]; see
    `window_partition`). Swin's shifted windows: pass `shifted_window_segments(...)` [nW, T] as both
    `query_segment_ids` and `key_segment_ids` (they broadcast over the batch dims). Keywords as
    dot_product_attention (scale defaults to H ** -0.5, as Swin and BEiT), plus implementation and interpret
    as position_bias_attention: "dense" builds [N,T,T] for one window only (shared by every window),
    "blockwise" (block_size) one tile at a time, "pallas_gpu" folds the windows into the kernel's batch axis
    and reads the table inside each tile at WindowIndex (its gradient scattered back into the table),
    "pallas_tpu" gathers one window's [N,T,T] bias outside our TPU flex kernel and reads it per tile (forward;
    the XLA blockwise backward), and None takes the GPU kernel on CUDA and the XLA engines elsewhere, TPU
    included: the TPU kernel's 128-row tiles hold 4-9x the dense engine's memory at Swin's shapes
    (docs/kernels.md, "Swin's and BEiT's windows").
    """
    Wh, Ww = as_pair("window_size", window_size, 1)
    T = Wh * Ww + (1 if cls_token else 0)
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    dims = checks.check_qkv(query, key, value)
    layout = f"[...,T,N,H] with T = {Wh}*{Ww}{' + 1' if cls_token else ''} tokens of a window"
    checks.check_dim("query", query, -3, T, layout)
    checks.check_dim("key", key, -3, T, layout.replace("N,H", "K,H"))
    for name in ("query_positions", "key_positions"):  # a token's position is its place in the window
        if options.get(name) is not None:
            checks.fail(name, "None (window_attention reads each token's place in its window)", "an array")
    table = jnp.asarray(table)
    if table.ndim == 2 and table.shape[1] != dims.N:
        checks.fail(
            "table", f"shape [R,{dims.N}] (one column per query head)", f"shape {checks.shape_str(table.shape)}"
        )
    bias_fn = window_position_bias(table, (Wh, Ww), cls_token=cls_token)
    return position_bias_attention(query, key, value, bias_fn, **options)


def shifted_window_segments(
    grid_size: tuple[int, int], window_size: int | tuple[int, int], shift: int | tuple[int, int]
) -> Int[Array, "W T"]:
    """int32 [nW, T]: the region of each token of each window of a (height, width) feature map rolled by
    -shift, windows in `window_partition`'s order; tokens of two regions may not attend to each other.

    Per axis (SwinLayer.get_attn_mask): region 0 below size - window, 1 below size - shift, 2 beyond; the id
    is 3 * region_h + region_w. A shift of 0 gives one region per window (no mask).
    """
    height, width = as_pair("grid_size", grid_size, 1)
    Wh, Ww = as_pair("window_size", window_size, 1)
    sh, sw = as_pair("shift", shift, 0)
    for name, size, w, s in (("height", height, Wh, sh), ("width", width, Ww, sw)):
        if size % w:
            checks.fail("grid_size", f"a {name} that is a multiple of the window's {w}", f"{name} {size}")
        if s >= w:
            checks.fail("shift", f"a {name} shift < the window's {w}", f"{name} shift {s}")

    def region(size, w, s):
        at = jnp.arange(size)
        return (at >= size - w).astype(jnp.int32) + (at >= size - s).astype(jnp.int32)

    ids = 3 * region(height, Wh, sh)[:, None] + region(width, Ww, sw)[None, :]  # [height, width]
    return window_partition(ids[..., None], (Wh, Ww))[..., 0]


def shifted_window_mask(
    grid_size: tuple[int, int], window_size: int | tuple[int, int], shift: int | tuple[int, int]
) -> Bool[Array, "W T T"]:
    """bool [nW, T, T], True = may attend: the pairs of a window in the same region (shifted_window_segments).
    As segment ids it costs no [T,T] array; this is the same rule as a mask."""
    ids = shifted_window_segments(grid_size, window_size, shift)
    return ids[:, :, None] == ids[:, None, :]


def window_partition(x: Float[ArrayLike, "*#B Y X E"], window_size: int | tuple[int, int]) -> Float[Array, "*#B W T E"]:
    """[..., height, width, E] -> [..., nW, Wh * Ww, E]: the windows row-major over the map, each window's
    patches row-major (transformers' window_partition, with the windows on their own axis)."""
    x = jnp.asarray(x)
    Wh, Ww = as_pair("window_size", window_size, 1)
    checks.check_min_rank("x", x, 3, "[...,height,width,E]")
    *batch, height, width, E = x.shape
    if height % Wh or width % Ww:
        checks.fail("x", f"a height and width that are multiples of the window {Wh}x{Ww}", f"{height}x{width}")
    x = x.reshape(*batch, height // Wh, Wh, width // Ww, Ww, E)
    x = jnp.swapaxes(x, -4, -3)  # [..., rows, cols, Wh, Ww, E]
    return x.reshape(*batch, (height // Wh) * (width // Ww), Wh * Ww, E)


def window_merge(
    windows: Float[ArrayLike, "*#B W T E"], window_size: int | tuple[int, int], grid_size: tuple[int, int]
) -> Float[Array, "*#B Y X E"]:
    """The inverse of window_partition: [..., nW, Wh * Ww, E] -> [..., height, width, E]."""
    windows = jnp.asarray(windows)
    Wh, Ww = as_pair("window_size", window_size, 1)
    height, width = as_pair("grid_size", grid_size, 1)
    if height % Wh or width % Ww:
        checks.fail("grid_size", f"multiples of the window {Wh}x{Ww}", f"{height}x{width}")
    rows, cols = height // Wh, width // Ww
    checks.check_min_rank("windows", windows, 3, "[...,nW,T,E]")
    *batch, W, T, E = windows.shape
    if (W, T) != (rows * cols, Wh * Ww):
        checks.fail("windows", f"shape [...,{rows * cols},{Wh * Ww},E]", f"shape {checks.shape_str(windows.shape)}")
    x = windows.reshape(*batch, rows, cols, Wh, Ww, E)
    x = jnp.swapaxes(x, -4, -3)  # [..., rows, Wh, cols, Ww, E]
    return x.reshape(*batch, height, width, E)
