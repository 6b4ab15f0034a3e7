"""Tile sizes of the flash kernels: the GPU's measured choice by head dim and bytes per element (GPU_TILES), the
interpreter's, a BlockMask's sub-tiles, and padded head dims."""

from __future__ import annotations

import numbers

import jax.numpy as jnp

from ..._core import checks

# Tiles and warps on a GPU: (Tb queries, Sb keys, num_warps) by the inputs' bytes per element and the largest
# padded head dim of a row (head dims up to 64, 128, 256); one choice for the forward, dq and dk/dv kernels, which
# share the key-tile schedules computed for one tile pair. Chosen from `ptxas -v` on the three kernels compiled for
# an H100 (sm_90a) and an A100 (sm_80) (.ci/ptxas_report.py; docs/kernels.md, "Tiles per head dim"; no GPU here to
# time them): tiles that spill no registers on either and fit both's shared memory, 128-row query tiles where that
# holds (wgmma's shape on the H100; 128 x 64 spilled in the A100's forward at head dims 65-128). One exception:
# the float32 dk/dv kernel at 129-256 spills at every tile size tried (ptxas drops it to 32 registers and a stack
# frame); 16 x 16 spills least. 8 warps throughout: 4 spilled at 128 x 64, head dim 64. Powers of two of at least
# 16, as Triton's dot needs.
GPU_TILES = {
    2: {64: (128, 64, 8), 128: (128, 32, 8), 256: (32, 64, 8)},
    4: {64: (32, 32, 8), 128: (16, 64, 8), 256: (16, 16, 8)},
}


# Calls with Shaw's or DeBERTa's per-row tables (Tables) load [Tb,Dp] blocks of them per tile: at most 64 query
# rows there above head dim 64. 128 x 64 asked 247808 bytes of shared memory at head dim 128 bf16 forward+backward
# on the H100 (232448 available; the compile grid's "shaw causal"); 64 x 64 compiled, and so did 128 x 64 at head
# dim 64 (Shaw and DeBERTa, H100 and A100).
TABLES_MAX_QUERY_TILE = 64


# Calls on the windowed route (windows_gpu) take each tile's window of Wp table rows, [Wp,Hp] float32, as a dot
# operand (shared memory) beside the [Tb,Wp] product: Wp * Hp at most WINDOW_TABLE_ELEMENTS (window_tiles).
# Transformer-XL at head dim 128 (Hp = 256 after shaw_form) in the tables' 32 x 64 tiles (Wp = 128) asked 196608
# bytes of the A100's 166912 (forward+backward). At 128 * 128 elements (head dim 64 bf16: 64 x 32, Wp = 128; head
# dim 128: 32 x 32) every program compiled but the dq and dk/dv kernels spilled (ptxas -v, H100 and A100, T = S =
# 8192, causal, bf16: dq 2052 spill-store bytes at head dim 64 on the H100, 140-264 elsewhere); at 64 * 128 (head
# dim 64: 32 x 32, Wp = 64; head dim 128: 16 x 16) none spills, bf16 or float32 at head dim 64 (float32 at head
# dim 128 is the plain kernel's known dk/dv spill, 16 x 16: 388 bytes).
WINDOW_TABLE_ELEMENTS = 64 * 128


# The interpreter takes any size: 16 x 16 keeps interpret-mode tests quick.
INTERPRET_BLOCK = 16


MIN_GPU_BLOCK = 16


MAX_HEAD_DIM = 256


def is_power_of_two(n) -> bool:
    return isinstance(n, numbers.Integral) and n > 0 and (n & (n - 1)) == 0


def block_pair(block_size):
    if block_size is None:
        return None
    return (block_size, block_size) if isinstance(block_size, numbers.Integral) else tuple(block_size)


def next_power_of_two(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def gpu_tiles(Hp: int, itemsize: int, tables: bool = False) -> tuple:
    """(Tb, Sb, num_warps) on a GPU for a padded head dim Hp <= MAX_HEAD_DIM and the inputs' bytes per element:
    GPU_TILES' row (4-byte inputs: float32; 2-byte and narrower: the half-precision row); tables: the call has
    per-row tables (Tb at most TABLES_MAX_QUERY_TILE above head dim 64)."""
    rows = GPU_TILES[4 if itemsize > 2 else 2]
    Tb, Sb, warps = next(tiles for dim, tiles in sorted(rows.items()) if Hp <= dim or dim == MAX_HEAD_DIM)
    return (min(Tb, TABLES_MAX_QUERY_TILE) if tables and Hp > 64 else Tb), Sb, warps


def tile_sizes(block_size, T: int, S: int, Hp: int, interpret: bool, itemsize: int = 2, tables: bool = False) -> tuple:
    """(Tb, Sb): block_size as given, else gpu_tiles' by head dim and bytes per element (INTERPRET_BLOCK when
    interpreted), shrunk to the next power of two of T / S (never below
    MIN_GPU_BLOCK on a GPU)."""
    pair = block_pair(block_size)
    if pair is not None:
        for b in pair:
            if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b <= 0:
                checks.fail("block_size", "an int > 0 or a pair of them", repr(block_size))
        return int(pair[0]), int(pair[1])
    wanted = (INTERPRET_BLOCK, INTERPRET_BLOCK) if interpret else gpu_tiles(Hp, itemsize, tables)[:2]
    floor = 1 if interpret else MIN_GPU_BLOCK
    return tuple(min(b, max(floor, next_power_of_two(L))) for b, L in zip(wanted, (T, S)))


def mask_sub_tiles(mask_tiles, wanted) -> tuple:
    """(Tb, Sb) of the kernels under a BlockMask of mask_tiles: per axis the wanted tile (tile_sizes') where it
    divides the mask's, else the mask's own. Each kernel tile then lies inside one mask tile and takes its kind
    (sub_tile_kinds), so the mask's skipping stays exact, and a coarse BlockMask (create_block_mask's default
    at T = 4096 is 512 x 512) does not force tiles whose backward overruns shared memory."""
    return tuple(w if m % w == 0 else m for m, w in zip(mask_tiles, wanted))


def sub_tile_kinds(kinds, ratios, Tn: int, Sn: int):
    """A BlockMask's kinds [B,N,Tm,Sm] -> the kernels' [B,N,Tn,Sn]: each mask tile's kind repeated over the
    ratios = (rows, columns) of kernel tiles it holds; the repeats past T / S (a last mask tile that runs past
    them) dropped."""
    rows, columns = ratios
    return jnp.repeat(jnp.repeat(kinds, rows, axis=2), columns, axis=3)[:, :, :Tn, :Sn]


def padded_head(H: int, interpret: bool) -> int:
    return next_power_of_two(H) if interpret else max(MIN_GPU_BLOCK, next_power_of_two(H))


def window_tiles(Tb: int, Sb: int, Hp: int) -> tuple:
    """(Tb, Sb) for the windowed route on a GPU: the larger tile halved (the keys' when equal) until the window's
    next_power_of_two(Tb + Sb - 1) rows of Hp features fit WINDOW_TABLE_ELEMENTS, never below MIN_GPU_BLOCK."""
    while next_power_of_two(Tb + Sb - 1) * Hp > WINDOW_TABLE_ELEMENTS and max(Tb, Sb) > MIN_GPU_BLOCK:
        if Sb >= Tb:
            Sb //= 2
        else:
            Tb //= 2
    return Tb, Sb
