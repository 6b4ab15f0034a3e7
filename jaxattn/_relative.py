"""Shaw et al. (2018) clipped relative positions: tables of R = 2 * max_distance + 1 rows.

Index convention (j - i, bottom-right aligned, clipped):
    index[t,s] = clip(key_pos[s] - query_pos[t], -max_distance, max_distance) + max_distance
so row 0 is "max_distance or more keys to the left", row R-1 "max_distance or more to the right".

Shaw attention equals relative_attention with A = table[index], but never gathers that [T,S,H] tensor:
the key term is q . table computed once per bucket ([...,N,T,R]) and then gathered to [...,N,T,S]; the
value term sums the weights falling into each bucket ([...,N,T,R]) and then multiplies the table.
"""

from __future__ import annotations

import jax.numpy as jnp

from . import _checks
from . import _blockwise
from ._attention import attention_core, check_qkv, compute_dtype
from ._masking import positions, relative_offsets


def relative_position_index(query_length: int, key_length: int, max_distance: int, *,
                            query_positions=None, key_positions=None):
    """int32 [T,S] (or [...,T,S] for batched positions): clip(j - i, -k, k) + k, bottom-right aligned."""
    max_distance = _checks.check_max_distance(max_distance)
    q_pos, k_pos = positions(query_length, key_length, query_positions, key_positions)
    offsets = k_pos[..., None, :] - q_pos[..., :, None]
    return (jnp.clip(offsets, -max_distance, max_distance) + max_distance).astype(jnp.int32)


def _check_table(name, table, R, N, head_dim, query):
    table = jnp.asarray(table)
    layout = f"[R,{'Hv' if name == 'value_table' else 'H'}] or [R,N,...] with R = 2*max_distance+1"
    if table.ndim == 2:
        expected = (R, head_dim)
    elif table.ndim == 3:
        expected = (R, N, head_dim)
    else:
        _checks.fail(name, f"rank 2 or 3 ({layout})", f"shape {_checks.shape_str(table.shape)}")
    if tuple(table.shape) != expected:
        _checks.fail(name, f"shape {_checks.shape_str(expected)} ({layout})",
                     f"shape {_checks.shape_str(table.shape)}")
    _checks.check_fits(name, table, compute_dtype(query.dtype))
    return table


def _gather_buckets(per_bucket, index):
    """per_bucket [...,N,T,R], index [...,1,T,S] -> [...,N,T,S]: per_bucket[..., t, index[t,s]]."""
    if index.ndim == 3:  # positions shared over the batch: gather [T,S] rows of a [T,R,...,N] view
        T = per_bucket.shape[-2]
        rows = jnp.moveaxis(per_bucket, (-2, -1), (0, 1))
        picked = rows[jnp.arange(T)[:, None], index[0]]
        return jnp.moveaxis(picked, (0, 1), (-2, -1))
    shape = jnp.broadcast_shapes(per_bucket.shape[:-1] + (1,), index.shape)
    per_bucket = jnp.broadcast_to(per_bucket, shape[:-1] + per_bucket.shape[-1:])
    return jnp.take_along_axis(per_bucket, jnp.broadcast_to(index, shape), axis=-1)


def _sum_into_buckets(weights, index, R):
    """weights [...,N,T,S], index [...,1,T,S] -> [...,N,T,R]: sum of weights[t,s] over s with index r."""
    *lead, T, S = weights.shape
    if index.ndim == 3:  # positions shared over the batch: one [T,S] scatter into a [T,R,...,N] view
        # (transposes, not reshapes: batch and head axes stay separate, so their shardings survive)
        cols = jnp.moveaxis(weights, (-2, -1), (0, 1))
        sums = jnp.zeros((T, R, *cols.shape[2:]), weights.dtype).at[jnp.arange(T)[:, None], index[0]].add(cols)
        return jnp.moveaxis(sums, (0, 1), (-2, -1))
    index = jnp.broadcast_to(index, weights.shape)
    rows = weights.reshape(-1, S)
    row_ids = jnp.arange(rows.shape[0])[:, None]
    sums = jnp.zeros((rows.shape[0], R), weights.dtype).at[row_ids, index.reshape(rows.shape)].add(rows)
    return sums.reshape(*lead, T, R)


def shaw_relative_attention(query, key, value, key_table=None, value_table=None, *, max_distance, **options):
    """Attention with Shaw et al. clipped relative-position tables.

    key_table: [R,H] shared over heads or [R,N,H] per head; value_table: [R,Hv] or [R,N,Hv];
    R = 2 * max_distance + 1, rows indexed by relative_position_index (same absolute positions as the
    causal mask, so `query_positions` / `key_positions` move both). Keywords as dot_product_attention.
    Equal to relative_attention(query, key, value, key_table[index], value_table[index]) with extra
    memory O(... * N * T * (S + R)) rather than a [T,S,H] gather.
    implementation / block_size: as dot_product_attention; blockwise computes the table terms per tile.
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    _, T, S, N, _, H, Hv = check_qkv(query, key, value)
    max_distance = _checks.check_max_distance(max_distance)
    implementation, block_size = options.pop("implementation", None), options.pop("block_size", None)
    if _blockwise.use_blockwise(implementation, query, key, **options):
        return _blockwise.blockwise_attention(query, key, value, key_table=key_table, value_table=value_table,
                                              max_distance=max_distance, block_size=block_size, **options)
    R = 2 * max_distance + 1
    precision = options.get("precision")
    acc = compute_dtype(query.dtype)
    q_pos, k_pos = positions(T, S, options.get("query_positions"), options.get("key_positions"))
    index = jnp.clip(relative_offsets(q_pos, k_pos), -max_distance, max_distance) + max_distance

    rel_logits = rel_values = None
    if key_table is not None:
        t_k = _check_table("key_table", key_table, R, N, H, query)
        key_spec = "...tnh,rnh->...ntr" if t_k.ndim == 3 else "...tnh,rh->...ntr"

        def rel_logits(q):
            per_bucket = jnp.einsum(key_spec, q, t_k, precision=precision, preferred_element_type=acc)
            return _gather_buckets(per_bucket, index)

    if value_table is not None:
        t_v = _check_table("value_table", value_table, R, N, Hv, query)
        value_spec = "...ntr,rnh->...tnh" if t_v.ndim == 3 else "...ntr,rh->...tnh"

        def rel_values(p):
            return jnp.einsum(value_spec, _sum_into_buckets(p, index, R), t_v.astype(acc), precision=precision)

    return attention_core(query, key, value, relative_logits=rel_logits, relative_values=rel_values, **options)
