"""Position biases a kernel can recognise and compute inside its tiles: each is a gather from a small table of
rows at an index computed from the pair's positions alone,

    bias[..., n, t, s] = rows[..., n, index(query_pos[t], key_pos[s])]

- OffsetBias (T5's buckets, ALiBi): a function of the relative offset j - i alone; its rows are the bias of
  each offset in a range lo..hi, index = clip(j - i, lo, hi) - lo (OffsetIndex).
- TableBias (Swin's and BEiT's 2D windows): a learned table [R,N] read at an index of the pair that the scheme
  defines (any static function of the two positions, e.g. the 2D offset inside a window).

Called as a hook, `bias(query_pos, key_pos)` is the [...,N,T,S] bias every engine adds (the dense engine
builds it, the blockwise engine one tile at a time). A kernel instead asks for `kernel_table(T, S,
default_positions)`: (rows [...,N,D], index), the rows computed once outside the kernel (O(N D) memory) and
`index` a static (hashable) function of (query_pos [Tb], key_pos [Sb]) -> int32 [Tb,Sb] in [0, D) for every
position the call produces (its edge-padded ones included); inside a tile the bias is a gather from the rows
at index(qp, kp), and the gradient of the rows (a scatter-add of the logits' gradient by index) goes back to
the table or slopes through XLA's autodiff of the rows. None: no static index bound for this call.

`saturation` (OffsetBias; None, or M >= 0): the scheme's promise that of_offset(d) == of_offset(clip(d, -M,
M)) for every d (T5: every distance from 2 * max_distance on lands in the last bucket). offset_range uses it
to bound the rows a call needs whatever its positions; without it, only the core's default positions have a
static range of offsets.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from .positions import offsets


@dataclasses.dataclass(frozen=True)  # hashable by value: a kernel's static configuration holds it
class OffsetIndex:
    """index = clip(j - i, lo, hi) - lo: the row of an offset among an OffsetBias's rows lo..hi. The clip is
    exact (OffsetBias.offset_range: the bias is constant beyond the range) and keeps every gather in bounds."""

    lo: int
    hi: int

    def __call__(self, query_pos, key_pos):
        return (jnp.clip(offsets(query_pos, key_pos), self.lo, self.hi) - self.lo).astype(jnp.int32)


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: closes over arrays; hashed by identity like a closure
class OffsetBias:
    """bias = of_offset(j - i): of_offset maps int offsets [...,T,S] to the bias [...,N,T,S] (module docstring)."""

    of_offset: Callable
    saturation: Optional[int] = None

    def __call__(self, query_pos, key_pos):
        """The position_bias hook: [...,N,T,S] from query_pos [...,T] and key_pos [...,S]."""
        return self.of_offset(offsets(query_pos, key_pos))

    def rows(self, lo: int, hi: int):
        """[...,N,D]: the bias of each offset lo, lo + 1, ..., hi (D = hi - lo + 1)."""
        return self.of_offset(jnp.arange(lo, hi + 1, dtype=jnp.int32)[None, :])[..., 0, :]

    def offset_range(self, T: int, S: int, default_positions: bool) -> Optional[tuple]:
        """(lo, hi) such that of_offset(clip(d, lo, hi)) == of_offset(d) for every offset d a call of T queries
        and S keys produces; None when there is no static bound (positions given, no saturation).

        The core's default positions (query t at t + S - T, key s at s) give d = s - t - (S - T) in
        [-(S - 1), T - 1]; a saturation M narrows that to [-M, M] and bounds any positions."""
        M = self.saturation
        if default_positions:
            lo, hi = -(S - 1), T - 1
            return (lo, hi) if M is None else (max(lo, -M), min(hi, M))
        return None if M is None else (-M, M)

    def in_kernel(self, T: int, S: int, default_positions: bool) -> bool:
        """Whether kernel_table has a static bound for such a call (cheap: no array is built)."""
        return self.offset_range(T, S, default_positions) is not None

    def kernel_table(self, T: int, S: int, default_positions: bool) -> Optional[tuple]:
        """(rows [...,N,D], OffsetIndex(lo, hi)) over offset_range's offsets; None where it has no bound."""
        bounds = self.offset_range(T, S, default_positions)
        return None if bounds is None else (self.rows(*bounds), OffsetIndex(*bounds))


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: holds an array; hashed by identity like a closure
class TableBias:
    """bias[..., n, t, s] = table[index(query_pos[t], key_pos[s]), n]: a learned table [R,N] read at a static
    index of the pair of positions (module docstring).

    index: hashable (a frozen dataclass), (query_pos [...,T], key_pos [...,S]) -> int32 [...,T,S], written with
    elementwise jnp only (a kernel evaluates it inside a tile); it promises rows in [0, R) for the positions
    0..length - 1, so a kernel takes it only with the core's default positions and T == S == length."""

    table: object  # [R,N]
    index: Callable
    length: int

    def __call__(self, query_pos, key_pos):
        """The position_bias hook: [...,N,T,S] from query_pos [...,T] and key_pos [...,S]."""
        return jnp.moveaxis(self.table[self.index(query_pos, key_pos)], -1, -3)

    def in_kernel(self, T: int, S: int, default_positions: bool) -> bool:
        """Whether index holds for such a call: the default positions of T = S = length tokens."""
        return default_positions and T == self.length and S == self.length

    def kernel_table(self, T: int, S: int, default_positions: bool) -> Optional[tuple]:
        """(rows [N,R], index) for the positions index is defined on (in_kernel); None for any other call."""
        if not self.in_kernel(T, S, default_positions):
            return None
        return jnp.swapaxes(jnp.asarray(self.table), -1, -2), self.index


# The biases a kernel computes in its tiles (each has in_kernel and kernel_table).
KERNEL_BIASES = (OffsetBias, TableBias)


def of_rows(rows, lo: int, hi: int) -> OffsetBias:
    """The OffsetBias read from its rows: rows [...,N,D] the bias of offsets lo..hi, constant beyond them
    (of_offset(d) = rows[..., clip(d, lo, hi) - lo]), for a kernel that takes the rows as an input rather than
    the scheme's table or slopes (flex_tpu's forward)."""
    rows = jnp.asarray(rows)

    def of_offset(relative_position):  # [...,T,S] -> [...,N,T,S]
        index = jnp.clip(relative_position, lo, hi) - lo
        lead = jnp.broadcast_shapes(rows.shape[:-2], index.shape[:-2])
        (N, D), (T, S) = rows.shape[-2:], index.shape[-2:]
        per_example = jnp.broadcast_to(rows, (*lead, N, D)).reshape(-1, N, D)
        indices = jnp.broadcast_to(index, (*lead, T, S)).reshape(-1, T, S)
        of_head = jax.vmap(lambda row, index: row[index], in_axes=(0, None))  # one gather per head
        return jax.vmap(of_head)(per_example, indices).reshape(*lead, N, T, S)

    return OffsetBias(of_offset, saturation=max(-lo, hi, 0))
