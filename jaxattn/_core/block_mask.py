"""BlockMask: which [Tb,Sb] tiles of a mask_mod are empty (skipped), full (mask_mod not evaluated) or partial.

The layout is torch's FlexAttention BlockMask, per (batch, head, query tile):

    kv_num_blocks      int32 [B,N,Tn]      how many partial key tiles
    kv_indices         int32 [B,N,Tn,Sn]   their indices first (ascending), then the rest
    full_kv_num_blocks int32 [B,N,Tn]      how many full key tiles
    full_kv_indices    int32 [B,N,Tn,Sn]

with B = 1 / N = 1 when the mask was built for any batch / head (batch=None, num_heads=None, or 1: a size-1
batch or head axis broadcasts to any, as torch's does), Tn = ceil(T / Tb), Sn = ceil(S / Sb). Every other
tile is empty. Like torch's, a BlockMask carries the mask_mod it was built from (`mask_mod`; None for one
built from raw tile lists), which flex_attention applies inside its partial tiles. A BlockMask is a pytree:
the four arrays and the arrays mask_mod closes over are its leaves; sizes, tile shape and the traced mask
function are static, so it passes through jit (as an argument: other documents' ids do not recompile) and
vmap.

What a call with a BlockMask means (`resolve`, the one rule both engines read):

    block_mask alone                the mask is block_mask.mask_mod, skipped on full tiles (torch's call)
    mask_mod + block_mask           their AND; full tiles skip mask_mod only when it is the BlockMask's own
    a BlockMask without a mask_mod  its tiles: full allowed, partial masked by mask_mod (or all allowed)

`tile_kinds` turns it into one int8 [B,N,Tn,Sn] array (EMPTY / PARTIAL / FULL) that the engines read: the
blockwise engine visits a key tile when any (batch, head) row of the query tile needs it and skips
mask_mod on it when every row calls it full (the engine's tiles hold every batch row and head at once);
the dense engine allows full tiles outright and applies mask_mod to partial ones, so both engines give the
same numbers for any BlockMask, even one that disagrees with its mask_mod.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from . import checks, mods

EMPTY, PARTIAL, FULL = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Tile classification of a mask_mod and the mask_mod itself (see the module docstring); build it with
    create_block_mask, or from raw tile lists with BlockMask.from_kv_blocks."""

    kv_num_blocks: jax.Array
    kv_indices: jax.Array
    full_kv_num_blocks: jax.Array
    full_kv_indices: jax.Array
    block_size: tuple = dataclasses.field(metadata=dict(static=True))  # (Tb, Sb)
    batch: Optional[int] = dataclasses.field(metadata=dict(static=True))  # None: any batch
    num_heads: Optional[int] = dataclasses.field(metadata=dict(static=True))  # None: any head
    query_length: int = dataclasses.field(metadata=dict(static=True))
    key_length: int = dataclasses.field(metadata=dict(static=True))
    # mask_mod, traced (static) with the arrays it closes over (leaves); None: no mask_mod (raw tile lists)
    mask_program: Optional[mods.ElementProgram] = dataclasses.field(default=None, metadata=dict(static=True))
    mask_consts: tuple = ()

    @property
    def num_blocks(self) -> tuple:
        """(Tn, Sn): query and key tiles."""
        return tuple(-(-L // b) for L, b in zip((self.query_length, self.key_length), self.block_size))

    @property
    def mask_mod(self) -> Optional[Callable]:
        """mask_mod(b, n, t, s) -> bool the mask was built from (torch's BlockMask.mask_mod), or None."""
        if self.mask_program is None:
            return None
        program, consts = self.mask_program, self.mask_consts
        return lambda b, n, t, s: program(b, n, t, s, *consts)

    # torch's names for the same facts (torch.nn.attention.flex_attention.BlockMask)
    @property
    def BLOCK_SIZE(self) -> tuple:  # noqa: N802 (torch's spelling)
        return tuple(self.block_size)

    @property
    def seq_lengths(self) -> tuple:
        return (self.query_length, self.key_length)

    @property
    def shape(self) -> tuple:
        """(B, N, T, S) as built (1 for a batch / head axis built as None), torch's BlockMask.shape."""
        return (self.kv_indices.shape[0], self.kv_indices.shape[1], self.query_length, self.key_length)

    def to_dense(self):
        """int32 [B,N,Tn,Sn]: 1 where a tile is visited (partial or full), 0 where skipped (torch's to_dense)."""
        return (tile_kinds(self) != EMPTY).astype(jnp.int32)

    def sparsity(self) -> float:
        """torch's sparsity(): 100 * (1 - visited tiles x Tb x Sb / (B N T S)), with B, N as built (so
        tiles running past T or S count whole, as in torch). Needs concrete arrays."""
        visited = int(jnp.sum(self.kv_num_blocks)) + int(jnp.sum(self.full_kv_num_blocks))
        B, N, T, S = self.shape
        return 100.0 * (1.0 - visited * self.block_size[0] * self.block_size[1] / (B * N * T * S))

    @classmethod
    def from_kv_blocks(
        cls,
        kv_num_blocks,
        kv_indices,
        full_kv_num_blocks=None,
        full_kv_indices=None,
        *,
        block_size,
        query_length: int,
        key_length: int,
        mask_mod: Optional[Callable] = None,
    ):
        """A BlockMask from torch's tile lists ([B,N,Tn] counts, [B,N,Tn,Sn] indices; B or N of 1 apply to
        any batch / head). Without full lists every listed tile is partial; without mask_mod partial
        tiles are not masked (torch's noop_mask)."""
        if isinstance(block_size, int) and not isinstance(block_size, bool):
            block_size = (block_size, block_size)
        if full_kv_num_blocks is None:
            full_kv_num_blocks = jnp.zeros_like(jnp.asarray(kv_num_blocks))
            full_kv_indices = jnp.zeros_like(jnp.asarray(kv_indices))
        arrays = tuple(jnp.asarray(x) for x in (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices))
        checks.check_rank("kv_indices", arrays[1], 4, "[B,N,Tn,Sn]")
        B, N = arrays[1].shape[:2]
        fn = mods.element_function("mask_mod", mask_mod)
        block_mask = cls(
            *arrays,
            block_size=tuple(block_size),
            batch=None if B == 1 else B,
            num_heads=None if N == 1 else N,
            query_length=query_length,
            key_length=key_length,
            mask_program=None if fn is None else fn.fn,
            mask_consts=() if fn is None else fn.consts,
        )
        return check_layout(block_mask)


def from_kinds(kinds, *, block_size, batch, num_heads, query_length, key_length, mask_fn=None) -> BlockMask:
    """A BlockMask from int8 kinds [B,N,Tn,Sn] (EMPTY / PARTIAL / FULL); mask_fn: its mask_mod, traced."""

    def listing(selected):
        order = jnp.argsort(jnp.logical_not(selected), axis=-1, stable=True).astype(jnp.int32)
        return jnp.sum(selected, axis=-1, dtype=jnp.int32), order

    kv_num, kv_idx = listing(kinds == PARTIAL)
    full_num, full_idx = listing(kinds == FULL)
    return BlockMask(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        block_size=tuple(block_size),
        batch=batch,
        num_heads=num_heads,
        query_length=query_length,
        key_length=key_length,
        mask_program=None if mask_fn is None else mask_fn.fn,
        mask_consts=() if mask_fn is None else mask_fn.consts,
    )


def tile_kinds(block_mask: BlockMask):
    """int8 [B,N,Tn,Sn]: EMPTY, PARTIAL or FULL per tile (the inverse of from_kinds)."""
    Sn = block_mask.kv_indices.shape[-1]

    def members(num, idx):  # [B,N,Tn] counts and [B,N,Tn,Sn] lists -> bool [B,N,Tn,Sn]
        listed = jnp.arange(Sn) < num[..., None]
        return jnp.any((idx[..., :, None] == jnp.arange(Sn)) & listed[..., :, None], axis=-2)

    partial = members(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = members(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return jnp.where(full, FULL, jnp.where(partial, PARTIAL, EMPTY)).astype(jnp.int8)


def check_layout(block_mask: BlockMask) -> BlockMask:
    """The four tile arrays fit the BlockMask's own sizes and tiles: else a ValueError naming the field."""
    Tn, Sn = block_mask.num_blocks
    B = 1 if block_mask.batch is None else block_mask.batch
    N = 1 if block_mask.num_heads is None else block_mask.num_heads
    for name in ("kv_num_blocks", "full_kv_num_blocks", "kv_indices", "full_kv_indices"):
        x = getattr(block_mask, name)
        expected = (B, N, Tn) + ((Sn,) if name.endswith("indices") else ())
        checks.check_shape(f"block_mask.{name}", x, expected, "[B,N,Tn] / [B,N,Tn,Sn]")
        checks.check_int(f"block_mask.{name}", x)
    return block_mask


def check_block_mask(block_mask, batch_size: int, N: int, T: int, S: int):
    """A BlockMask built for these sizes (flattened batch, query heads, T, S): else a ValueError.

    A batch or head axis built as None or as 1 serves any batch / any number of heads, as torch broadcasts
    a size-1 batch or head dimension of its BlockMask (the tiles of entry 0 apply to every entry; the
    engines and kernels read a size-1 axis of the tile arrays as broadcast). Any other size must equal the
    call's."""
    if not isinstance(block_mask, BlockMask):
        checks.fail("block_mask", "a BlockMask (create_block_mask)", type(block_mask).__name__)
    built = (block_mask.batch, block_mask.num_heads, block_mask.query_length, block_mask.key_length)
    fits = built[0] in (None, 1, batch_size) and built[1] in (None, 1, N) and built[2:] == (T, S)
    if not fits:
        shown = ",".join("any" if d is None else str(d) for d in built)
        hint = ""
        if built[2] == N and built[2] != T:  # the query's head axis has the mask's query length
            hint = (
                " (query looks like torch's [B,N,T,H] layout: jaxattn takes [...,T,N,H], "
                "e.g. jnp.swapaxes(query, -3, -2))"
            )
        checks.fail(
            "block_mask",
            f"one built for [batch,heads,T,S] = [{batch_size},{N},{T},{S}] (batch and heads may be 1 or None)",
            f"one built for [{shown}]{hint}",
        )
    return check_layout(block_mask)


def resolve(mask_mod, block_mask):
    """(mask_mod, block_mask) as the engines apply them: the one reading of a call with a BlockMask.

    - block_mask with its own mask_mod and no mask_mod given: that mask_mod, on the partial tiles;
    - the same mask_mod given again (the same program and consts): unchanged, full tiles skip it;
    - another mask_mod as well: their AND, on every visited tile (full tiles become partial, since the
      BlockMask's full tiles say nothing about the other function);
    - a BlockMask without a mask_mod: unchanged (mask_mod, if any, on its partial tiles).
    """
    if block_mask is None or block_mask.mask_program is None:
        return mask_mod, block_mask
    own = mods.ElementFunction(block_mask.mask_program, tuple(block_mask.mask_consts), "block_mask.mask_mod")
    if mask_mod is None:
        return block_mask.mask_mod, block_mask
    if mods.same_function(mods.element_function("mask_mod", mask_mod), own):
        return mask_mod, block_mask
    kinds = tile_kinds(block_mask)
    demoted = from_kinds(
        jnp.where(kinds == FULL, PARTIAL, kinds),
        block_size=block_mask.block_size,
        batch=block_mask.batch,
        num_heads=block_mask.num_heads,
        query_length=block_mask.query_length,
        key_length=block_mask.key_length,
    )
    return mods.and_masks(block_mask.mask_mod, mask_mod), demoted


def dense_allowed(block_mask: BlockMask, mask_grid):
    """The dense engine's reading of a BlockMask: bool [B,N,T,S] (B, N may be 1) with full tiles allowed,
    partial tiles as mask_grid [B|1,N|1,T,S] (the mask_mod, or None for all) and empty tiles blocked."""
    kinds = tile_kinds(block_mask)
    Tb, Sb = block_mask.block_size
    T, S = block_mask.query_length, block_mask.key_length
    kinds = jnp.repeat(jnp.repeat(kinds, Tb, axis=-2), Sb, axis=-1)[..., :T, :S]
    partial = kinds == PARTIAL
    if mask_grid is not None:
        partial = partial & mask_grid
    return (kinds == FULL) | partial
