"""The engine over every query tile of one group of rows (lax.scan over fwd_tile / bwd_tile), with its
custom VJP: the forward saves Residuals (out, lse and, when small, the value table's bucket sums), the
backward recomputes each tile from them, so both passes take O(T + S) memory.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..._core import mods
from ..._core.dtypes import accumulation_dtype
from .backward import bwd_tile, zero_grads
from .buckets import windowed
from .forward import fwd_tile
from .layout import slice_block
from .values import KeySide, QueryTile, RowGrads, Shared, Side


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def engine(cfg, q, keys, shared, q_pos, arrays):
    """(out [B,K,G,Tp,Hv] in q's dtype, lse [B,K,G,Tp] in the compute dtype) over every query tile."""
    return _engine_fwd(cfg, q, keys, shared, q_pos, arrays)[0]


def _tile_arrays(arrays, i, Tb):
    """Query tile i's view of the Side: its rows of the query segment ids and of the tile kinds."""
    q_seg = None if arrays.q_seg is None else slice_block(arrays.q_seg, i * Tb, Tb, -1)
    return arrays._replace(q_seg=q_seg, kinds=None if arrays.kinds is None else arrays.kinds[i])


def _keeps_value_buckets(cfg, value_table, Hv):
    """The backward reuses the forward's bucket sums of p (value table [R,(N,)Hv]) when they take no more
    memory than the output they come with (R <= Hv); otherwise it forms them again, tile by tile. Windowed
    tiles (buckets.windowed) form no bucket sums."""
    return value_table is not None and value_table.shape[0] <= Hv and not windowed(cfg)


class Residuals(NamedTuple):
    """What the engine's backward reads: its inputs, the output, lse and (kept) value-table bucket sums."""

    q: Any
    keys: KeySide
    shared: Shared
    q_pos: Any
    arrays: Side
    out: Any
    lse: Any
    buckets: Any


def _engine_fwd(cfg, q, keys, shared, q_pos, arrays):
    B, K, G, Tp, H = q.shape
    Tb, Hv = cfg.Tb, keys.v.shape[-1]
    keep = _keeps_value_buckets(cfg, shared.value_table, Hv)

    def query_block(_, i):
        q_blk, qp_blk = slice_block(q, i * Tb, Tb, 3), slice_block(q_pos, i * Tb, Tb, -1)
        tile = QueryTile(q_blk, qp_blk, _tile_arrays(arrays, i, Tb), i * Tb)
        out, lse, *buckets = fwd_tile(cfg, tile, keys, shared, with_buckets=keep)
        return None, (out.astype(q.dtype), lse, *buckets)

    _, (out, lse, *buckets) = lax.scan(query_block, None, jnp.arange(Tp // Tb))
    out = jnp.moveaxis(out, 0, 3).reshape(B, K, G, Tp, Hv)
    lse = jnp.moveaxis(lse, 0, 3).reshape(B, K, G, Tp)
    buckets = jnp.moveaxis(buckets[0], 0, 3).reshape(B, K, G, Tp, -1) if keep else None
    return (out, lse), Residuals(q, keys, shared, q_pos, arrays, out, lse, buckets)


def _engine_bwd(cfg, res: Residuals, cotangents):
    d_out, d_lse = cotangents
    q, arrays, Tb = res.q, res.arrays, cfg.Tb
    acc_dtype = accumulation_dtype(q.dtype)
    # score_mod's float arrays get gradients; its integer ones (ids, indices) none
    score_consts = tuple(
        c if d else None for c, d in zip(arrays.score_consts, mods.differentiable(arrays.score_consts))
    )

    def query_block(carry, i):
        grads, d_sinks = carry
        tile = QueryTile(
            slice_block(q, i * Tb, Tb, 3), slice_block(res.q_pos, i * Tb, Tb, -1), _tile_arrays(arrays, i, Tb), i * Tb
        )
        do_blk, o_blk = slice_block(d_out, i * Tb, Tb, 3), slice_block(res.out, i * Tb, Tb, 3)
        lse_blk = slice_block(res.lse, i * Tb, Tb, 3)
        # d loss / d x = p * (dp - sum_s p dp) + p * d_lse, and sum_s p dp = d_out . out: one delta
        d_lse_blk = slice_block(d_lse, i * Tb, Tb, 3).astype(acc_dtype)
        delta = jnp.sum(do_blk.astype(acc_dtype) * o_blk.astype(acc_dtype), axis=-1) - d_lse_blk
        buckets = None if res.buckets is None else slice_block(res.buckets, i * Tb, Tb, 3)
        dq, grads = bwd_tile(cfg, tile, RowGrads(do_blk, lse_blk, delta, buckets), res.keys, res.shared, grads)
        if d_sinks is not None:  # d out_t / d sink = -p_sink[t] out_t, so d sink = -sum_t p_sink[t] delta_t
            d_sinks = d_sinks - jnp.sum(jnp.exp(arrays.sinks[..., None] - lse_blk) * delta, axis=-1)
        return (grads, d_sinks), dq

    grads = zero_grads(acc_dtype, res.keys, res.shared, score_consts)
    d_sinks = None if arrays.sinks is None else jnp.zeros_like(arrays.sinks, acc_dtype)
    (grads, d_sinks), dq = lax.scan(query_block, (grads, d_sinks), jnp.arange(q.shape[3] // Tb))
    dq = jnp.moveaxis(dq, 0, 3).reshape(q.shape)

    def cast(grad, like):
        return None if like is None or grad is None else grad.astype(like.dtype)

    keys, shared = res.keys, res.shared
    d_keys = KeySide(cast(grads.dk, keys.k), cast(grads.dv, keys.v), None, None)
    d_shared = Shared(
        cast(grads.key_table, shared.key_table),
        cast(grads.value_table, shared.value_table),
        jax.tree.map(cast, grads.hook_consts, shared.hook_consts),
        None,
        cast(grads.pair_key, shared.pair_key),
        cast(grads.pair_value, shared.pair_value),
    )
    d_arrays = Side(
        sinks=cast(d_sinks, arrays.sinks),
        score_consts=tuple(map(cast, grads.score_consts, score_consts)) if score_consts else (),
        mask_consts=tuple(None for _ in arrays.mask_consts),
    )
    return dq.astype(q.dtype), d_keys, d_shared, None, d_arrays


engine.defvjp(_engine_fwd, _engine_bwd)
