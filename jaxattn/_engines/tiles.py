"""The tile-size policy of the blockwise and ring engines, in one place: how large a [Tb,Sb] tile is and
how many rows (batch entries x key/value heads) run side by side.

    block_sizes      an explicit block_size, checked; or the all-rows default (a [rows,Tb,Sb] tile of
                     about TILE_BUDGET_BYTES): sharded inputs, score_mod / mask_mod, create_block_mask
    row_tile_sizes   the row-group default (blockwise_attention's usual path): ROW_TILE_BYTES tiles
    row_groups       how many rows one group takes
    pair_tile_sizes  the default shrunk for per-pair tables (relative_attention), whose slices are per tile
    ring_tile_sizes  the ring's default: block_sizes for one chunk pair, shrunk with the device's share
    span             a sliding window's width, which caps every default (its edge tiles are mostly masked)

Every default is "evened out": as many blocks as the size needs, then equal blocks, so the padding
past T or S is less than one block's worth. The figures behind the constants: docs/performance.md.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from .._core import checks

# Measured on 2-core CPUs (benchmarks/, docs/performance.md). blockwise_attention runs one group of rows
# (batch entries x key/value heads) at a time, so a tile [rows, G, Tb, Sb] and the row's keys and values
# stay in the core's L2 cache across query tiles, instead of every head streaming from memory for every
# tile. Per key/value head a tile holds G * Tb query rows (the G query heads that share it) against Sb
# keys: 512 x 512, causal or not. XLA:CPU spreads one operation over its threads only when it is large
# (two independent loops run one after the other), so smaller tiles leave cores idle: causal S = 2048 /
# 8192, B1 N8 H64 float32 on an Intel Xeon with 2 cores, 512 x 512 against 128 x 128: forward 80 / 867 ms
# against 114 / 1497 ms (2026-11-26). On one pinned core, where nothing is spread and the half-masked
# diagonal tiles cost more, 512 x 512 is within 6% of 128 x 128 (forward 96 against 90 ms, forward+backward
# 229 against 228 ms at S = 2048), so one default serves both.
DEFAULT_KEY_BLOCK = 512
DEFAULT_QUERY_ROWS = 512  # G * Tb
ROW_TILE_BYTES = 2**20  # rows are grouped until one float32 tile [rows, G, Tb, Sb] would exceed this
# Without row groups (sharded inputs, score_mod / mask_mod, the ring): key blocks of 512 and query blocks
# as large as fit a ~16 MiB float32 tile [B,N,Tb,Sb] (64 <= Tb <= 512, powers of two).
TILE_BUDGET_BYTES = 16 * 2**20
# The ring keeps a few float32 tiles live at once (about two forward, four backward): its default tile
# holds at most 1/RING_TILE_SHARE of the elements of a device's queries, so memory falls with D too.
RING_TILE_SHARE = 8
SMALLEST_DEFAULT = 64
# Per-pair tables (relative_attention): each tile reads its [Tb,Sb,N,F] slice of A^K / A^V, N * F times the
# size of one row's logits tile, so the default tile shrinks until those slices (float32) fit this budget.
PAIR_TILE_BYTES = 4 * 2**20


def span(window, is_causal: bool) -> Optional[int]:
    """The most consecutive keys a query may see under a window (left, right), or None (unbounded)."""
    if window is None or window[0] is None or (window[1] is None and not is_causal):
        return None
    return window[0] + (0 if window[1] is None else window[1]) + 1


def _window_cap(width: Optional[int]) -> int:
    """The largest default block: 512, or about half a window's width (a power of two, at least 128)."""
    return 512 if width is None else max(128, min(512, 1 << max(width // 2, 1).bit_length() - 1))


def _evened(T: int, S: int, query_block: int, key_block: int) -> tuple:
    """As many blocks as each size needs, then equal ones: padding less than one block's worth."""
    return tuple(-(-L // -(-L // b)) for L, b in ((max(T, 1), query_block), (max(S, 1), key_block)))


def block_sizes(block_size, T: int, S: int, rows: int, span: Optional[int] = None) -> tuple:
    """(Tb, Sb) from the option, or the default for `rows` = B * N tiles side by side (at least 1 each,
    also for an empty sequence). span: how many consecutive keys a query may see at most (a sliding
    window's width), or None: the default tiles then shrink to about span / 2 (not below 128), so a
    window's edge tiles, which are mostly masked, stay a small part of the work."""
    T, S, rows = max(T, 1), max(S, 1), max(rows, 1)
    if block_size is None:
        cap = _window_cap(span)
        key_block = min(DEFAULT_KEY_BLOCK, cap, S)
        query_block = TILE_BUDGET_BYTES // (4 * rows * key_block)
        query_block = max(SMALLEST_DEFAULT, min(cap, 1 << max(query_block, 1).bit_length() - 1))
        block_size = _evened(T, S, query_block, key_block)
    if isinstance(block_size, (int, np.integer)) and not isinstance(block_size, bool):
        block_size = (block_size, block_size)
    ok = (
        isinstance(block_size, (tuple, list))
        and len(block_size) == 2
        and all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b > 0 for b in block_size)
    )
    if not ok:
        checks.fail("block_size", "a positive int or a pair (query_block, key_block)", repr(block_size))
    return min(int(block_size[0]), T), min(int(block_size[1]), S)


def row_tile_sizes(block_size, T: int, S: int, G: int, span: Optional[int]) -> tuple:
    """(Tb, Sb) for row groups: the given block_size, or the defaults (DEFAULT_QUERY_ROWS / G queries and
    DEFAULT_KEY_BLOCK keys, causal or not; a window's span caps both as in block_sizes)."""
    if block_size is None:
        cap = _window_cap(span)
        key_block, query_block = DEFAULT_KEY_BLOCK, max(16, DEFAULT_QUERY_ROWS // G)
        block_size = _evened(T, S, min(query_block, cap), min(key_block, cap))
    return block_sizes(block_size, T, S, 1)


def pair_tile_sizes(T: int, S: int, Tb: int, Sb: int, width: int) -> tuple:
    """The default (Tb, Sb) halved, larger side first and down to 16, while a tile's per-pair table slices
    [Tb,Sb,width] (width: the tables' heads x features, summed) hold more than PAIR_TILE_BYTES (float32)."""
    while 4 * Tb * Sb * width > PAIR_TILE_BYTES and max(Tb, Sb) > 16:
        if Tb >= Sb:
            Tb = max(16, Tb // 2)
        else:
            Sb = max(16, Sb // 2)
    return _evened(T, S, Tb, Sb)


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, max(1, min(n, at_most)) + 1) if n % d == 0)


def row_groups(B: int, K: int, G: int, Tb: int, Sb: int, whole: Optional[str]) -> tuple:
    """(Bc, Kc): batch entries and key/value heads per row group, the most whose float32 tile
    [Bc, Kc, G, Tb, Sb] fits ROW_TILE_BYTES (at least one of each). whole: None, "heads" (every group
    keeps all K heads: a position_bias hook returns every head's bias) or "all" (one group)."""
    if whole == "all":
        return B, K
    fit = max(1, ROW_TILE_BYTES // (4 * G * Tb * Sb))
    Kc = K if whole == "heads" else _largest_divisor(K, fit)
    Bc = _largest_divisor(B, fit // Kc) if Kc == K else 1
    return Bc, Kc


def ring_tile_sizes(block_size, Cq: int, Ck: int, rows: int, query_elements: int) -> tuple:
    """(Tb, Sb) within one device's chunks: as block_sizes for an explicit block_size; the default is
    block_sizes' for one chunk pair, its larger side halved while a tile [rows, Tb, Sb] would hold more
    than 1/RING_TILE_SHARE of the elements of this device's queries (rows * query_elements), down to 64:
    a fixed tile would be a constant that stops the per-device memory from falling with D."""
    Tb, Sb = block_sizes(block_size, Cq, Ck, rows)
    if block_size is not None:
        return Tb, Sb
    while RING_TILE_SHARE * Tb * Sb > query_elements and max(Tb, Sb) > SMALLEST_DEFAULT:
        if Tb >= Sb:
            Tb = max(SMALLEST_DEFAULT, Tb // 2)
        else:
            Sb = max(SMALLEST_DEFAULT, Sb // 2)
    return _evened(Cq, Ck, Tb, Sb)


def check_block_mask_tiles(block_mask, block_size) -> tuple:
    """The tile of a call with a BlockMask: the mask's own (block_size None or the same), else ValueError."""
    T, S = block_mask.query_length, block_mask.key_length
    tiles = tuple(block_mask.block_size)
    if block_size is not None and block_sizes(block_size, T, S, 1) != tiles:
        checks.fail(
            "block_mask", f"tiles of block_size={block_size!r} (or block_size=None)", f"a BlockMask of tiles {tiles}"
        )
    return tiles
