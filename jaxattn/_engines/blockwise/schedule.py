"""Which key tiles a query tile visits (jaxattn._core.masks.key_block_schedule, from the engine's
configuration) and the loop over them: one fori_loop per kind of tile, each with its own static body
(clean tiles run without a mask).
"""

from __future__ import annotations

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
    """body(kind, j, state) over the scheduled key tiles j, one loop per kind (each a static body)."""
    start = 0
    for kind, count in enumerate(schedule.counts):
        if isinstance(count, int) and count == 0:
            continue
        stop = start + count
        state = lax.fori_loop(start, stop, lambda i, st, kind=kind: body(kind, schedule.order[i], st), state)
        start = stop
    return state
