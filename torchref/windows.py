"""Plain torch twin of jaxattn's 2D relative position bias (Swin, Liu et al. 2021; BEiT, Bao et al. 2022).

Written as the papers' code states it, sharing no code with jaxattn: the index from a meshgrid of patch
coordinates (query minus key, shifted to >= 0, row-major in (2 Wh - 1) x (2 Ww - 1)), the [N, T, T] bias
gathered whole, and the shifted windows' regions by labelling slices of the map. Shapes use the axis letters
of torchref's docstring; a window is the T axis (patches row-major), the windows are leading batch dims.

    import torchref.windows as W
    out = W.window_attention(q, k, v, table, (7, 7), query_segment_ids=ids, key_segment_ids=ids)
"""

from __future__ import annotations

import torch
from torch import Tensor

from torchref._functional import dot_product_attention

__all__ = [
    "window_relative_index",
    "window_relative_bias",
    "window_attention",
    "shifted_window_segments",
    "window_partition",
]


def _check(ok: bool, name: str, expected: str, actual: object) -> None:
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {actual}")


def _pair(name: str, value) -> tuple[int, int]:
    pair = tuple(value) if isinstance(value, (tuple, list)) else (value, value)
    _check(len(pair) == 2 and all(isinstance(v, int) and v >= 0 for v in pair), name, "an int or (h, w)", value)
    return pair


def window_relative_index(window_size, *, cls_token: bool = False) -> Tensor:
    """int64 [T, T]: row (dh + Wh - 1) * (2 Ww - 1) + (dw + Ww - 1) for the query-minus-key offset (dh, dw);
    with cls_token, token 0 is the cls token and takes rows R - 3 (cls -> patch), R - 2 (patch -> cls), R - 1."""
    Wh, Ww = _pair("window_size", window_size)
    coords = torch.stack(torch.meshgrid(torch.arange(Wh), torch.arange(Ww), indexing="ij")).flatten(1)  # [2, A]
    relative = coords[:, :, None] - coords[:, None, :]  # [2, A, A]: query minus key
    index = (relative[0] + Wh - 1) * (2 * Ww - 1) + (relative[1] + Ww - 1)
    if not cls_token:
        return index
    R = (2 * Wh - 1) * (2 * Ww - 1) + 3
    full = torch.zeros(Wh * Ww + 1, Wh * Ww + 1, dtype=torch.int64)
    full[1:, 1:] = index
    full[0, :] = R - 3
    full[:, 0] = R - 2
    full[0, 0] = R - 1
    return full


def window_relative_bias(table: Tensor, window_size, *, cls_token: bool = False) -> Tensor:
    """table [R, N] -> bias [N, T, T] = table[index[i, j], n]."""
    Wh, Ww = _pair("window_size", window_size)
    R = (2 * Wh - 1) * (2 * Ww - 1) + (3 if cls_token else 0)
    _check(table.ndim == 2 and table.shape[0] == R, "table", f"shape [{R}, N]", tuple(table.shape))
    return table[window_relative_index((Wh, Ww), cls_token=cls_token)].permute(2, 0, 1)


def window_attention(query, key, value, table, window_size, *, cls_token: bool = False, bias=None, **options):
    """dot_product_attention of the windows [..., T, N, H] with the window's bias [N, T, T] added."""
    position_bias = window_relative_bias(table, window_size, cls_token=cls_token)
    _check(query.shape[-3] == position_bias.shape[-1], "query", f"T = {position_bias.shape[-1]}", tuple(query.shape))
    bias = position_bias if bias is None else position_bias + bias
    return dot_product_attention(query, key, value, bias=bias, **options)


def shifted_window_segments(grid_size, window_size, shift) -> Tensor:
    """int64 [nW, T]: the original Swin labelling of a map rolled by -shift, slices (0, -window),
    (-window, -shift), (-shift, None) per axis, label 3 * h + w, read window by window."""
    height, width = _pair("grid_size", grid_size)
    Wh, Ww = _pair("window_size", window_size)
    sh, sw = _pair("shift", shift)
    label = torch.zeros(height, width, dtype=torch.int64)
    h_slices = (slice(0, height - Wh), slice(height - Wh, height - sh), slice(height - sh, height))
    w_slices = (slice(0, width - Ww), slice(width - Ww, width - sw), slice(width - sw, width))
    for a, hs in enumerate(h_slices):
        for b, ws in enumerate(w_slices):
            label[hs, ws] = 3 * a + b
    return window_partition(label[None, :, :, None], (Wh, Ww))[0, :, :, 0]


def window_partition(x: Tensor, window_size) -> Tensor:
    """[B, height, width, E] -> [B, nW, Wh * Ww, E], windows row-major over the map, patches row-major."""
    Wh, Ww = _pair("window_size", window_size)
    B, height, width, E = x.shape
    _check(height % Wh == 0 and width % Ww == 0, "x", f"height, width multiples of {Wh}x{Ww}", (height, width))
    x = x.view(B, height // Wh, Wh, width // Ww, Ww, E).transpose(2, 3)
    return x.reshape(B, -1, Wh * Ww, E)
