"""A position bias that depends on the relative offset j - i alone (T5's buckets, ALiBi): the structured form of
the `position_bias` hook that a kernel can recognise and compute inside its tiles.

    bias[..., n, t, s] = of_offset(key_pos[s] - query_pos[t])[..., n]

Called as a hook, `OffsetBias(of_offset)(query_pos, key_pos)` is the [...,N,T,S] bias every engine adds (the
dense engine builds it, the blockwise engine one tile at a time). A kernel instead asks for `rows(lo, hi)`,
the bias of each offset in a range, [...,N,D] with D = hi - lo + 1, computed once outside the kernel from the
scheme's table or slopes (O(N (T + S)) memory): inside a tile the bias is a gather from those rows at
clip(j - i, lo, hi) - lo, and the gradient of the rows (a scatter-add of the logits' gradient by offset) goes
back to the table or slopes through XLA's autodiff of `rows`.

`saturation` (None, or M >= 0): the scheme's promise that of_offset(d) == of_offset(clip(d, -M, M)) for
every d (T5: every distance from 2 * max_distance on lands in the last bucket). offset_range uses it to bound
the rows a call needs whatever its positions; without it, only the core's default positions have a static
range of offsets.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from .positions import offsets


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
