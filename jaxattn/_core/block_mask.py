"""BlockMask: which [Tb,Sb] tiles of a mask_mod are empty (skipped), full (mask_mod not evaluated) or partial.

The layout is torch's FlexAttention BlockMask, per (batch, head, query tile):

    kv_num_blocks      int32 [B,N,Tn]      how many partial key tiles
    kv_indices         int32 [B,N,Tn,Sn]   their indices first (ascending), then the rest
    full_kv_num_blocks int32 [B,N,Tn]      how many full key tiles
    full_kv_indices    int32 [B,N,Tn,Sn]

with B = 1 / N = 1 when the mask was built for any batch / head (batch=None, num_heads=None), Tn = ceil(T /
Tb), Sn = ceil(S / Sb). Every other tile is empty. A BlockMask is a pytree (the four arrays are its leaves;
sizes and tile shape are static), so it passes through jit and vmap.

`tile_kinds` turns it into one int8 [B,N,Tn,Sn] array (EMPTY / PARTIAL / FULL) that the engines read: the
blockwise engine visits a key tile when any (batch, head) row of the query tile needs it and skips
mask_mod on it when every row calls it full (the engine's tiles hold every batch row and head at once);
the dense engine allows full tiles outright and applies mask_mod to partial ones, so both engines give the
same numbers for any BlockMask, even one that disagrees with its mask_mod.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from . import checks

EMPTY, PARTIAL, FULL = 0, 1, 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class BlockMask:
    """Tile classification of a mask_mod (see the module docstring); build it with create_block_mask."""

    kv_num_blocks: jax.Array
    kv_indices: jax.Array
    full_kv_num_blocks: jax.Array
    full_kv_indices: jax.Array
    block_size: tuple = dataclasses.field(metadata=dict(static=True))  # (Tb, Sb)
    batch: Optional[int] = dataclasses.field(metadata=dict(static=True))  # None: any batch
    num_heads: Optional[int] = dataclasses.field(metadata=dict(static=True))  # None: any head
    query_length: int = dataclasses.field(metadata=dict(static=True))
    key_length: int = dataclasses.field(metadata=dict(static=True))

    @property
    def num_blocks(self) -> tuple:
        """(Tn, Sn): query and key tiles."""
        return tuple(-(-L // b) for L, b in zip((self.query_length, self.key_length), self.block_size))


def from_kinds(kinds, *, block_size, batch, num_heads, query_length, key_length) -> BlockMask:
    """A BlockMask from int8 kinds [B,N,Tn,Sn] (EMPTY / PARTIAL / FULL)."""

    def listing(selected):
        order = jnp.argsort(jnp.logical_not(selected), axis=-1, stable=True).astype(jnp.int32)
        return jnp.sum(selected, axis=-1, dtype=jnp.int32), order

    kv_num, kv_idx = listing(kinds == PARTIAL)
    full_num, full_idx = listing(kinds == FULL)
    return BlockMask(kv_num, kv_idx, full_num, full_idx, block_size=tuple(block_size), batch=batch,
                     num_heads=num_heads, query_length=query_length, key_length=key_length)


def tile_kinds(block_mask: BlockMask):
    """int8 [B,N,Tn,Sn]: EMPTY, PARTIAL or FULL per tile (the inverse of from_kinds)."""
    Sn = block_mask.kv_indices.shape[-1]

    def members(num, idx):  # [B,N,Tn] counts and [B,N,Tn,Sn] lists -> bool [B,N,Tn,Sn]
        listed = jnp.arange(Sn) < num[..., None]
        return jnp.any((idx[..., :, None] == jnp.arange(Sn)) & listed[..., :, None], axis=-2)

    partial = members(block_mask.kv_num_blocks, block_mask.kv_indices)
    full = members(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    return jnp.where(full, FULL, jnp.where(partial, PARTIAL, EMPTY)).astype(jnp.int8)


def check_block_mask(block_mask, batch_size: int, N: int, T: int, S: int):
    """A BlockMask built for these sizes (flattened batch, query heads, T, S): else a ValueError."""
    if not isinstance(block_mask, BlockMask):
        checks.fail("block_mask", "a BlockMask (create_block_mask)", type(block_mask).__name__)
    built = (block_mask.batch, block_mask.num_heads, block_mask.query_length, block_mask.key_length)
    fits = (built[0] in (None, batch_size) and built[1] in (None, N) and built[2:] == (T, S))
    if not fits:
        shown = ",".join("any" if d is None else str(d) for d in built)
        checks.fail("block_mask", f"one built for [batch,heads,T,S] = [{batch_size},{N},{T},{S}] (batch and heads "
                    "may be None)", f"one built for [{shown}]")
    Tn, Sn = block_mask.num_blocks
    for name in ("kv_num_blocks", "full_kv_num_blocks", "kv_indices", "full_kv_indices"):
        x = getattr(block_mask, name)
        expected = (1 if built[0] is None else built[0], 1 if built[1] is None else built[1], Tn)
        expected = expected + ((Sn,) if name.endswith("indices") else ())
        checks.check_shape(f"block_mask.{name}", x, expected, "[B,N,Tn] / [B,N,Tn,Sn]")
        checks.check_int(f"block_mask.{name}", x)
    return block_mask


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
