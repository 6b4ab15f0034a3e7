"""Which key tiles a query tile visits (jaxattn._core.masks.key_block_schedule, from the engine's
configuration) and the loop over them: one while loop per kind of tile, each with its own static body
(clean tiles run without a mask).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..._core.masks import key_block_schedule


def key_schedule(cfg, qp, k_pos, lengths, arrays, n_blocks):
    """The key tiles (of n_blocks) that query positions qp visit, by kind, from cfg's rule and terms."""
    return key_block_schedule(
        cfg.rule,
        qp,
        k_pos,
        lengths,
        cfg.Sb,
        n_blocks,
        query_segments=arrays.q_seg if cfg.terms.segments else None,
        key_segments=arrays.k_seg,
        block_kinds=arrays.kinds if cfg.terms.block_kinds else None,
        mask_mod=cfg.terms.mask_fn is not None,
    )


def visit(schedule, body, state):
    """body(kind, j, state) over the scheduled key tiles j, one loop per kind (each a static body).

    While loops, also where the counts are static (fori_loop would make those scans): under jax.grad of the
    row groups' lax.map (groups.py) JAX moves whatever a scan body computes from the map's loop invariants
    alone out of the map, one copy per (query tile, key tile): each tile's Shaw bucket index [Tb,Sb], or
    anything else a tile derives from positions and shared tables alone, O(T S) memory in all. A while
    loop's body stays whole."""
    start = 0
    for kind, count in enumerate(schedule.counts):
        if isinstance(count, int) and count == 0:
            continue
        stop = start + count

        def step(carry, kind=kind):
            i, st = carry
            return i + 1, body(kind, schedule.order[i], st)

        state = lax.while_loop(lambda carry, stop=stop: carry[0] < stop, step, (jnp.int32(start), state))[1]
        start = stop
    return state
