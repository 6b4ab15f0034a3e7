"""fwd_tile: one query tile against every key of a KeySide, an online softmax over its key tiles (the
merge of partials is jaxattn._core.softmax's).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..._core.dtypes import accumulation_dtype
from ..._core.masks import CLEAN
from ..._core.softmax import add_sinks, combine_partials, empty_partial, finalize_partial
from .buckets import apply_table, bucket_sums, table_products, tile_index, window_sums, windowed
from .layout import einsum, slice_block
from .logits import allowed_in_tile, corner_offset, hook_bias, tile_logits, tile_score
from .pairs import pair_spec, pair_tile
from .schedule import key_schedule, visit
from .values import KeySide, QueryTile, Shared


def _block_partial(x, allowed, v_blk, cfg, acc_dtype, pair_v=None, value_rows=None, bucket_sums_of=None):
    """One tile's partial (out, m, l): out = p v (+ p . A^V, + the value table's term on the tile's window
    rows); out also carries bucket_sums_of(p) (the value table's buckets, applied once the loop ends)."""
    if allowed is not None:
        x = jnp.where(allowed, x, -jnp.inf)
    m = jnp.max(x, axis=-1)
    p = jnp.exp(x - jnp.where(jnp.isfinite(m), m, 0)[..., None])  # masked: exp(-inf) = 0
    out = einsum("bkgts,bksv->bkgtv", p.astype(v_blk.dtype), v_blk, cfg, acc_dtype)
    if pair_v is not None:
        out = out + einsum(pair_spec("bkgts,tskgv->bkgtv", pair_v), p, pair_v, cfg, acc_dtype)
    if value_rows is not None:
        out = out + apply_table(window_sums(p), value_rows, p.shape[1], cfg, acc_dtype)
    out = (out,) if bucket_sums_of is None else (out, bucket_sums_of(p))
    return out, m, jnp.sum(p, axis=-1)


def fwd_tile(cfg, tile: QueryTile, keys: KeySide, shared: Shared, with_buckets=False):
    """One query tile against every key of keys: (out [B,K,G,Tb,Hv], lse [B,K,G,Tb]), both in the compute
    dtype (a caller merging partials, like the ring, rounds only once at the end).
    with_buckets (value table, not windowed): also return the probabilities' bucket sums [B,K,G,Tb,R], which
    are exactly what the value table's gradient needs (RowGrads.value_buckets).
    Shaw tables: q . table[r] for every bucket once per query tile, gathered onto each key tile; or, windowed
    (buckets.py), each key tile's own window of rows."""
    q_blk, qp, arrays, row0 = tile
    B, K, G, Tb, _ = q_blk.shape
    Sp, Hv = keys.k.shape[2], keys.v.shape[-1]
    Sb, acc_dtype = cfg.Sb, accumulation_dtype(q_blk.dtype)
    R = 2 * cfg.max_distance + 1 if cfg.max_distance is not None else 0
    key_table, value_table, window = shared.key_table, shared.value_table, windowed(cfg)
    assert not (with_buckets and window), "a windowed value table keeps no bucket sums"
    per_bucket = None if key_table is None or window else table_products(q_blk, key_table, K, cfg, acc_dtype)
    value_buckets = value_table is not None and not window

    def key_block(kind, j, state):
        k_blk, v_blk = slice_block(keys.k, j * Sb, Sb, 2), slice_block(keys.v, j * Sb, Sb, 2)
        kp = slice_block(keys.pos, j * Sb, Sb, -1)
        offset0 = corner_offset(cfg, qp, kp)
        index, _, (key_rows, value_rows) = tile_index(cfg, qp, kp, offset0, (key_table, value_table))
        per_tile = per_bucket if key_rows is None else table_products(q_blk, key_rows, K, cfg, acc_dtype)
        bias = None if cfg.bias_fn is None else hook_bias(cfg, shared.hook_consts, qp, kp, K)
        pair_k, pair_v = (pair_tile(a, row0, j * Sb, Tb, Sb, K) for a in (shared.pair_key, shared.pair_value))
        score = tile_score(cfg, qp, kp, B, K, arrays)
        x = tile_logits(cfg, q_blk, k_blk, per_tile, bias, index, shared.scale, acc_dtype, score, pair_k)
        allowed = None if kind == CLEAN else allowed_in_tile(cfg, qp, kp, j, keys.lengths, arrays, kind, B, K)
        sums_of = (lambda p: bucket_sums(p, index, R, offset0)) if value_buckets else None
        partial = _block_partial(x, allowed, v_blk, cfg, acc_dtype, pair_v, value_rows, sums_of)
        return combine_partials(state, partial)

    shapes = ((B, K, G, Tb, Hv),) + (((B, K, G, Tb, R),) if value_buckets else ())
    schedule = key_schedule(cfg, qp, keys.pos, keys.lengths, arrays, Sp // Sb)
    state = visit(schedule, key_block, empty_partial(shapes, (B, K, G, Tb), acc_dtype, q_blk))
    state = add_sinks(state, None if arrays.sinks is None else arrays.sinks[..., None])
    outs, lse = finalize_partial(state)
    out = outs[0] + apply_table(outs[1], value_table, K, cfg, acc_dtype) if value_buckets else outs[0]
    return (out, lse, outs[1]) if with_buckets else (out, lse)
