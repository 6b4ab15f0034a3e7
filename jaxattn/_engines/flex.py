"""create_block_mask: classify the [Tb,Sb] tiles of a mask_mod as empty, full or partial (a BlockMask).

The mask_mod is evaluated once per (batch, head, query, key) at ABSOLUTE positions (query t at t + S - T
unless query_positions / key_positions say otherwise), a few tiles at a time, so building the mask costs
O(B N T S) work but only O(B N Tb Sb) memory per step. The default tile is the blockwise engine's default
for these sizes, and flex_attention runs on the BlockMask's tiles.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from .._core import block_mask as block_masks, checks, mods
from .._core.positions import positions
from .tiles import block_sizes

GRID_ELEMENTS = 2**24  # mask_mod values evaluated per step (bools): never a [T,S] grid at long lengths


def _size(name, value, allow_none):
    if value is None and allow_none:
        return None
    return checks.static_int(name, value, 1)


# torch's keyword spellings of create_block_mask's arguments (torch.nn.attention.flex_attention): the
# same meaning, so a call written for torch means the same here.
TORCH_NAMES = {
    "B": "batch",
    "H": "num_heads",
    "Q_LEN": "query_length",
    "KV_LEN": "key_length",
    "BLOCK_SIZE": "block_size",
}
# torch's arguments with no meaning in JAX: refused by name rather than dropped. (device= is accepted:
# torch users write it on every call, and a jax.Device has a meaning here; see _jax_device.)
TORCH_ONLY = {
    "_compile": "create_block_mask is traced and compiled by XLA anyway; leave _compile out",
    "separate_full_blocks": "full tiles are always listed apart (they skip mask_mod)",
    "compute_dq_write_order": "a Triton backward detail with no JAX counterpart",
    "dq_kv_order": "a Triton backward detail with no JAX counterpart",
}


def _torch_spellings(sizes: dict, torch_kwargs: dict) -> dict:
    """Fold torch's spellings (B=, H=, Q_LEN=, KV_LEN=, BLOCK_SIZE=) into ours; refuse torch-only ones."""
    for name, value in torch_kwargs.items():
        if name in TORCH_ONLY:
            checks.fail(name, f"no {name} ({TORCH_ONLY[name]})", repr(value))
        if name not in TORCH_NAMES:
            raise TypeError(f"create_block_mask() got an unexpected keyword argument {name!r}")
        ours = TORCH_NAMES[name]
        if sizes[ours] is not None:
            checks.fail(name, f"either {name}= (torch's name) or {ours}=, not both", repr(value))
        sizes[ours] = value
    return sizes


def _jax_device(device):  # -> a jax.Device or None (jax.Device is a value to pyright, not a type)
    """create_block_mask's device=, read: a jax.Device is returned (the BlockMask's arrays go there, as a
    JAX user who names a device means). torch's device names ("cuda", "cpu", "cuda:0", an int index, a
    torch.device) name torch devices, not JAX ones: accepted so that torch code runs unchanged, and they
    mean nothing here (None: the tile lists are small arrays JAX moves to wherever the flex_attention call
    runs). Anything else: a ValueError naming device."""
    if isinstance(device, jax.Device):
        return device
    torch_device = type(device).__module__ == "torch" and type(device).__name__ == "device"  # without importing it
    if device is None or isinstance(device, str) or torch_device or (type(device) is int and device >= 0):
        return None
    checks.fail(
        "device", "None, a jax.Device, or a torch device (a name, index or torch.device: no effect)", repr(device)
    )


def create_block_mask(
    mask_mod,
    batch: Optional[int] = None,
    num_heads: Optional[int] = None,
    query_length: Optional[int] = None,
    key_length: Optional[int] = None,
    device=None,
    block_size=None,
    *,
    query_positions=None,
    key_positions=None,
    **torch_kwargs,
) -> block_masks.BlockMask:
    """The BlockMask of mask_mod(b, n, t, s) -> bool for these sizes (layout: jaxattn._core.block_mask).

    The first seven arguments are torch's, in torch's order (mask_mod, B, H, Q_LEN, KV_LEN, device,
    BLOCK_SIZE). batch: the flattened batch size the mask varies over, or None (or 1) when it does not
    depend on b (then evaluated at b = 0; the BlockMask serves any batch, as torch broadcasts a size-1
    batch dimension); num_heads likewise for n. query_length / key_length: T and S (required). device:
    a jax.Device places the BlockMask's arrays there; torch's devices ("cuda", "cpu", a torch.device) are
    accepted and mean nothing here (_jax_device). block_size: int or (Tb, Sb), default the blockwise
    engine's tile for batch * num_heads rows. query_positions / key_positions: int [T] / [S] absolute
    positions, as the flex_attention call will use (default bottom-right: query t at t + S - T). torch's
    keyword spellings B=, H=, Q_LEN=, KV_LEN=, BLOCK_SIZE= mean the same; _compile= and torch's kernel
    options are refused by name. The BlockMask keeps mask_mod (its .mask_mod), so
    flex_attention(q, k, v, block_mask=bm) applies it, as torch's does.
    """
    sizes = _torch_spellings(
        dict(batch=batch, num_heads=num_heads, query_length=query_length, key_length=key_length, block_size=block_size),
        torch_kwargs,
    )
    place_on = _jax_device(device)
    batch, num_heads, block_size = sizes["batch"], sizes["num_heads"], sizes["block_size"]
    batch, num_heads = _size("batch", batch, True), _size("num_heads", num_heads, True)
    T = _size("query_length", sizes["query_length"], False)
    S = _size("key_length", sizes["key_length"], False)
    fn = mods.element_function("mask_mod", mask_mod)
    Bm, Nm = batch or 1, num_heads or 1
    Tb, Sb = block_sizes(block_size, T, S, Bm * Nm)
    Tn, Sn = -(-T // Tb), -(-S // Sb)
    q_pos, k_pos = positions(T, S, query_positions, key_positions)
    checks.check_rank("query_positions", q_pos, 1, "[T]: one position per query")
    checks.check_rank("key_positions", k_pos, 1, "[S]: one position per key")
    q_pos = jnp.pad(q_pos, (0, Tn * Tb - T), mode="edge")
    k_pos = jnp.pad(k_pos, (0, Sn * Sb - S), mode="edge")
    b, n = jnp.arange(Bm, dtype=jnp.int32), jnp.arange(Nm, dtype=jnp.int32)

    def tile_kind(i, j):
        qp, kp = lax.dynamic_slice_in_dim(q_pos, i * Tb, Tb), lax.dynamic_slice_in_dim(k_pos, j * Sb, Sb)
        allowed = mods.on_grid(fn.fn, fn.consts, b, n, qp, kp)  # [Bm,Nm,Tb,Sb]
        real = ((i * Tb + jnp.arange(Tb)) < T)[:, None] & ((j * Sb + jnp.arange(Sb)) < S)[None, :]
        some = jnp.any(allowed & real, axis=(-2, -1))
        every = jnp.all(allowed | ~real, axis=(-2, -1))
        return jnp.where(every, block_masks.FULL, jnp.where(some, block_masks.PARTIAL, block_masks.EMPTY))

    per_step = min(Sn, max(1, GRID_ELEMENTS // (Bm * Nm * Tb * Sb)))

    def row(i):  # [Sn,Bm,Nm]
        return lax.map(lambda j: tile_kind(i, j), jnp.arange(Sn), batch_size=per_step)

    kinds = jax.jit(lambda: lax.map(row, jnp.arange(Tn)))()  # [Tn,Sn,Bm,Nm]
    kinds = jnp.transpose(kinds, (2, 3, 0, 1)).astype(jnp.int8)
    block_mask = block_masks.from_kinds(
        kinds, block_size=(Tb, Sb), batch=batch, num_heads=num_heads, query_length=T, key_length=S, mask_fn=fn
    )
    return block_mask if place_on is None else jax.device_put(block_mask, place_on)
