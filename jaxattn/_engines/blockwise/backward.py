"""bwd_tile: the gradients of one query tile against every key of a KeySide (FlashAttention-2's backward:
each tile's probabilities recomputed from the forward's log-sum-exp), added into Grads accumulators;
zero_grads makes those. Without tables, a position hook or score_mod the tiles run keys-major.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..._core import mods
from ..._core.dtypes import accumulation_dtype
from ..._core.masks import CLEAN
from ..._core.placement import placed_as, zeros_beside
from ..._core.softmax import logits_grad, probabilities
from .buckets import (
    add_rows,
    apply_table,
    bucket_sums,
    gather_buckets,
    table_grad,
    table_products,
    tile_index,
    window_sums,
    windowed,
)
from .layout import einsum, slice_block
from .logits import allowed_in_tile, capped_logits, corner_offset, hook_bias, tile_score
from .pairs import add_pair_tile, pair_grad, pair_spec, pair_tile
from .schedule import key_schedule, visit
from .values import Grads, KeySide, QueryTile, RowGrads, Shared


class _TileSums(NamedTuple):
    """What bwd_tile's loop over key tiles adds into: dq [B,K,G,Tb,H] (compute dtype), the bucket sums of ds
    and of p [B,K,G,Tb,R] (the key and value tables' gradients read them once the loop ends; p's start
    from the forward's when RowGrads.value_buckets has them; None when windowed: each tile then adds its
    window's share into key_table / value_table), and Grads' dk, dv, key_table, value_table, hook_consts,
    score_consts, pair_key and pair_value."""

    dq: Any
    dk: Any
    dv: Any
    key_table: Any
    value_table: Any
    ds_buckets: Any
    p_buckets: Any
    hook_consts: tuple
    score_consts: tuple
    pair_key: Any
    pair_value: Any


def bwd_tile(cfg, tile: QueryTile, rows: RowGrads, keys: KeySide, shared: Shared, grads: Grads):
    """Backward of one query tile against every key of keys: (dq tile, grads). grads: accumulators the
    tile adds into, so a caller keeps one of each however many tiles it runs. Without Shaw tables, a position
    hook, per-pair tables or score_mod (whose terms are written for [Tb,Sb] tiles) the tiles run keys-major
    (_bwd_keys_major)."""
    pairs = shared.pair_key is not None or shared.pair_value is not None
    if not pairs and shared.key_table is None and shared.value_table is None and cfg.bias_fn is None:
        if cfg.terms.score_fn is None:
            return _bwd_keys_major(cfg, tile, rows, keys, shared, grads)
    q_blk, qp, arrays, row0 = tile
    do_blk, delta = rows.d_out, rows.delta
    B, K, _, Tb = q_blk.shape[:4]
    Sp, Sb, acc_dtype = keys.k.shape[2], cfg.Sb, accumulation_dtype(q_blk.dtype)
    R = 2 * cfg.max_distance + 1 if cfg.max_distance is not None else 0
    key_table, value_table, scale, window = shared.key_table, shared.value_table, shared.scale, windowed(cfg)
    per_bucket, do_table = (  # q . Tk[r] and d_out . Tv[r] for every bucket, unless each tile has its window
        None if table is None or window else table_products(x, table, K, cfg, acc_dtype)
        for x, table in ((q_blk, key_table), (do_blk, value_table))
    )

    def key_block(kind, j, acc: _TileSums) -> _TileSums:
        s0 = j * Sb
        k_blk, v_blk = slice_block(keys.k, s0, Sb, 2), slice_block(keys.v, s0, Sb, 2)
        kp = slice_block(keys.pos, s0, Sb, -1)
        offset0 = corner_offset(cfg, qp, kp)
        index, row_index, (key_rows, value_rows) = tile_index(cfg, qp, kp, offset0, (key_table, value_table))
        per_tile, do_tile = (  # q . Tk[index] and d_out . Tv[index] of this tile's window
            whole if own is None else table_products(x, own, K, cfg, acc_dtype)
            for whole, x, own in ((per_bucket, q_blk, key_rows), (do_table, do_blk, value_rows))
        )
        bias, bias_vjp = None, None
        if cfg.bias_fn is not None:
            bias, bias_vjp = jax.vjp(lambda c: hook_bias(cfg, c, qp, kp, K), shared.hook_consts)
        pair_k, pair_v = (pair_tile(a, row0, s0, Tb, Sb, K) for a in (shared.pair_key, shared.pair_value))
        capped = capped_logits(cfg, q_blk, k_blk, per_tile, index, scale, acc_dtype, pair_k)
        x = capped if bias is None else capped + bias
        score_vjp = None
        if cfg.terms.score_fn is not None:
            x, score_vjp = jax.vjp(tile_score(cfg, qp, kp, B, K, arrays), x, arrays.score_consts)
        allowed = None if kind == CLEAN else allowed_in_tile(cfg, qp, kp, j, keys.lengths, arrays, kind, B, K)
        p = probabilities(x, rows.lse[..., None], allowed)
        dv_blk = einsum("bkgts,bkgtv->bksv", p.astype(do_blk.dtype), do_blk, cfg, acc_dtype)
        dp = einsum("bkgtv,bksv->bkgts", do_blk, v_blk, cfg, acc_dtype)
        if pair_v is not None:  # out += p . A^V: dp += d_out . A^V, d A^V = p d_out (summed over the batch)
            dp = dp + einsum(pair_spec("bkgtv,tskgv->bkgts", pair_v), do_blk, pair_v, cfg, acc_dtype)
            d_pair_v = pair_grad(p, do_blk, pair_v, cfg, acc_dtype)
            acc = acc._replace(pair_value=add_pair_tile(acc.pair_value, d_pair_v, row0, s0))
        if value_table is not None:  # out += (bucket sums of p) @ Tv: dp += d_out . Tv[index], d Tv = sums^T d_out
            dp = dp + gather_buckets(do_tile, index)
            if window:
                d_rows = table_grad(window_sums(p), do_blk, value_rows, K, cfg, acc_dtype)
                acc = acc._replace(value_table=add_rows(acc.value_table, row_index, d_rows))
            elif rows.value_buckets is None:  # else p_buckets already holds the forward's sums
                acc = acc._replace(p_buckets=acc.p_buckets + bucket_sums(p, index, R, offset0))
        ds = logits_grad(p, dp, delta[..., None])  # d loss / d x (the final logits)
        if score_vjp is not None:  # d loss / d (logits before score_mod), and d score_mod's arrays
            ds, d_s = score_vjp(ds)
            acc = acc._replace(score_consts=tuple(a if a is None else a + g for a, g in zip(acc.score_consts, d_s)))
        if bias_vjp is not None:
            d_bias = jnp.sum(ds, axis=tuple(range(ds.ndim - bias.ndim))).reshape(bias.shape).astype(bias.dtype)
            (d_c,) = bias_vjp(placed_as(d_bias, bias))
            acc = acc._replace(hook_consts=jax.tree.map(jnp.add, acc.hook_consts, d_c))
        ds = mods.product_grad(ds, capped, cfg.terms.softcap, scale)
        dq = acc.dq + einsum("bkgts,bksh->bkgth", ds.astype(q_blk.dtype), k_blk, cfg, acc_dtype)
        dk_blk = einsum("bkgts,bkgth->bksh", ds.astype(q_blk.dtype), q_blk, cfg, acc_dtype)
        if key_table is not None and window:  # x += q . Tk[index]: dq += sums @ Tk, d Tk = sums^T q
            sums = window_sums(ds)
            dq = dq + apply_table(sums, key_rows, K, cfg, acc_dtype)
            d_rows = table_grad(sums, q_blk, key_rows, K, cfg, acc_dtype)
            acc = acc._replace(key_table=add_rows(acc.key_table, row_index, d_rows))
        elif key_table is not None:
            acc = acc._replace(ds_buckets=acc.ds_buckets + bucket_sums(ds, index, R, offset0))
        if pair_k is not None:  # x += q . A^K: dq += ds . A^K, d A^K = ds q (summed over the batch)
            dq = dq + einsum(pair_spec("bkgts,tskgh->bkgth", pair_k), ds, pair_k, cfg, acc_dtype)
            d_pair_k = pair_grad(ds, q_blk, pair_k, cfg, acc_dtype)
            acc = acc._replace(pair_key=add_pair_tile(acc.pair_key, d_pair_k, row0, s0))
        dk = lax.dynamic_update_slice_in_dim(acc.dk, slice_block(acc.dk, s0, Sb, 2) + dk_blk, s0, axis=2)
        dv = lax.dynamic_update_slice_in_dim(acc.dv, slice_block(acc.dv, s0, Sb, 2) + dv_blk, s0, axis=2)
        return acc._replace(dq=dq, dk=dk, dv=dv)

    buckets = None if window else zeros_beside(q_blk, q_blk.shape[:-1] + (R,), acc_dtype)
    init = _TileSums(
        dq=jnp.zeros_like(q_blk, acc_dtype),
        dk=grads.dk,
        dv=grads.dv,
        key_table=grads.key_table,
        value_table=grads.value_table,
        ds_buckets=buckets,
        p_buckets=buckets if rows.value_buckets is None else rows.value_buckets.astype(acc_dtype),
        hook_consts=grads.hook_consts,
        score_consts=grads.score_consts,
        pair_key=grads.pair_key,
        pair_value=grads.pair_value,
    )
    schedule = key_schedule(cfg, qp, keys.pos, keys.lengths, arrays, Sp // Sb)
    sums = visit(schedule, key_block, init)
    dq = sums.dq
    grads = grads._replace(
        dk=sums.dk,
        dv=sums.dv,
        key_table=sums.key_table,
        value_table=sums.value_table,
        hook_consts=sums.hook_consts,
        score_consts=sums.score_consts,
        pair_key=sums.pair_key,
        pair_value=sums.pair_value,
    )
    if key_table is not None and not window:
        dq = dq + apply_table(sums.ds_buckets, key_table, K, cfg, acc_dtype)
        d_key_table = table_grad(sums.ds_buckets, q_blk.astype(acc_dtype), key_table, K, cfg, acc_dtype)
        grads = grads._replace(key_table=grads.key_table + d_key_table)
    if value_table is not None and not window:
        d_value_table = table_grad(sums.p_buckets, do_blk.astype(acc_dtype), value_table, K, cfg, acc_dtype)
        grads = grads._replace(value_table=grads.value_table + d_value_table)
    return dq, grads


def _keys_major(allowed):
    """A tile mask broadcastable to [B,K,G,Tb,Sb] -> broadcastable to [B,K,Sb,G,Tb]."""
    return allowed.T[:, None, :] if allowed.ndim == 2 else jnp.moveaxis(allowed, -1, 2)


def _bwd_keys_major(cfg, tile: QueryTile, rows: RowGrads, keys: KeySide, shared: Shared, grads: Grads):
    """bwd_tile's products on keys-major tiles [B,K,Sb,G,Tb] (x^T = k q^T, p^T, ds^T):

        dv += p^T do    dp^T = v do^T    dk += ds^T q    dq^T += k^T ds^T

    each reads its operands in the layout XLA:CPU's dot takes as they are (rows, then the contracted axis),
    where the [Tb,Sb] orientation copies a transposed p and ds for dv and dk, two [Tb,Sb] arrays per tile:
    a 512 x 512 tile's backward takes 1.28 ms against 1.80 ms (2 cores, float32, H = 64)."""
    q_blk, qp, arrays = tile.q, tile.pos, tile.arrays
    B, K = q_blk.shape[:2]
    Sb, acc_dtype, scale, cap = cfg.Sb, accumulation_dtype(q_blk.dtype), shared.scale, cfg.terms.softcap
    lse = rows.lse[:, :, None]  # [B,K,1,G,Tb]
    delta = rows.delta[:, :, None]
    q_t = jnp.moveaxis(q_blk, -1, 2)  # [B,K,H,G,Tb], once per query tile
    do_t = jnp.moveaxis(rows.d_out, -1, 2)  # [B,K,Hv,G,Tb]

    def key_block(kind, j, inner):
        dq_t, dk, dv = inner
        s0 = j * Sb
        k_blk, v_blk = slice_block(keys.k, s0, Sb, 2), slice_block(keys.v, s0, Sb, 2)
        x_t = einsum("bksh,bkhgt->bksgt", k_blk, q_t, cfg, acc_dtype)
        capped = mods.softcap(x_t if scale is None else x_t * scale, cap)
        kp = slice_block(keys.pos, s0, Sb, -1)
        allowed = None if kind == CLEAN else allowed_in_tile(cfg, qp, kp, j, keys.lengths, arrays, kind, B, K)
        p_t = probabilities(capped, lse, None if allowed is None else _keys_major(allowed))
        dv_blk = einsum("bksgt,bkgtv->bksv", p_t.astype(rows.d_out.dtype), rows.d_out, cfg, acc_dtype)
        ds_t = logits_grad(p_t, einsum("bksv,bkvgt->bksgt", v_blk, do_t, cfg, acc_dtype), delta)  # d loss / d logits
        ds_t = mods.product_grad(ds_t, capped, cap, scale)
        ds_t = ds_t.astype(q_blk.dtype)
        dq_t = dq_t + einsum("bksh,bksgt->bkhgt", k_blk, ds_t, cfg, acc_dtype)
        dk_blk = einsum("bksgt,bkgth->bksh", ds_t, q_blk, cfg, acc_dtype)
        dk = lax.dynamic_update_slice_in_dim(dk, slice_block(dk, s0, Sb, 2) + dk_blk, s0, axis=2)
        dv = lax.dynamic_update_slice_in_dim(dv, slice_block(dv, s0, Sb, 2) + dv_blk, s0, axis=2)
        return dq_t, dk, dv

    schedule = key_schedule(cfg, qp, keys.pos, keys.lengths, arrays, keys.k.shape[2] // Sb)
    dq_t, dk, dv = visit(schedule, key_block, (jnp.zeros_like(q_t, acc_dtype), grads.dk, grads.dv))
    return jnp.moveaxis(dq_t, 2, -1), grads._replace(dk=dk, dv=dv)


def zero_grads(acc_dtype, keys: KeySide, shared: Shared, score_consts=()) -> Grads:
    """Zero accumulators (compute dtype acc_dtype) for keys' k / v, the shared tables and hook arrays and a
    score_mod's consts (None entries stay None): what bwd_tile adds into."""

    def zeros(x):
        return jax.tree.map(lambda a: jnp.zeros_like(a, acc_dtype), x)

    return Grads(
        zeros(keys.k),
        zeros(keys.v),
        zeros(shared.key_table),
        zeros(shared.value_table),
        zeros(shared.hook_consts),
        zeros(score_consts),
        zeros(shared.pair_key),
        zeros(shared.pair_value),
    )
