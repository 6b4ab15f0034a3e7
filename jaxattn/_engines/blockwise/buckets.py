"""Shaw et al.'s clipped relative tables on one tile: the bucket index r of each (query, key) pair, the
products q . table[r] for every bucket, their gather onto the tile, and its transpose, the sums of a tile
over the keys of each bucket (what the value table's output and both tables' gradients read).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..._core.placement import zeros_beside
from ..._core.positions import clipped_index
from .layout import as_tile, einsum


def bucket_index(cfg, qp, kp):
    return clipped_index(qp, kp, cfg.max_distance, cfg.max_distance)


def gather_buckets(per_bucket, index):
    """per_bucket [B,K,G,Tb,R], index [Tb,Sb] or [B,Tb,Sb] -> [B,K,G,Tb,Sb]."""
    index = jnp.broadcast_to(as_tile(index), per_bucket.shape[:-1] + index.shape[-1:])
    return jnp.take_along_axis(per_bucket, index, axis=-1, mode="promise_in_bounds")


def bucket_sums(x, index, R, offset0=None):
    """The transpose of gather_buckets: [B,K,G,Tb,Sb] -> [B,K,G,Tb,R], sums of x[t,s] over s with index r.

    With offset0 (contiguous positions: key_pos - query_pos = offset0 + s - t in this tile) no scatter
    is needed: an interior bucket r holds exactly one key, s = t + r - max_distance - offset0 (a gather
    of [Tb,R] entries), and the two clipped buckets are masked row sums. On CPU, XLA's scatter-add
    costs about as much as the whole tile's attention; this costs a small fraction of it.
    """
    if offset0 is None:
        zeros = zeros_beside(x, x.shape[:-1] + (R,), x.dtype)
        return jax.linear_transpose(lambda pb: gather_buckets(pb, index), zeros)(x)[0]
    return contiguous_bucket_sums(x, R, offset0)


def contiguous_bucket_sums(x, R, offset0):
    """[...,T,S] -> [...,T,R]: Shaw bucket sums when key_pos - query_pos = offset0 + s - t (the default
    positions have offset0 = S - T). Gathers and masked sums only: no scatter (see bucket_sums)."""
    if R == 1:
        return jnp.sum(x, axis=-1, keepdims=True)
    d = (R - 1) // 2
    Tb, Sb = x.shape[-2:]
    t = jnp.arange(Tb)[:, None]
    offsets = offset0 + jnp.arange(Sb)[None, :] - t
    left = jnp.sum(jnp.where(offsets <= -d, x, 0), axis=-1, keepdims=True)
    right = jnp.sum(jnp.where(offsets >= d, x, 0), axis=-1, keepdims=True)
    cols = t + jnp.arange(1 - d, d)[None, :] - offset0  # [Tb, R-2]: the key of each interior bucket
    inside = (cols >= 0) & (cols < Sb)
    cols = jnp.broadcast_to(jnp.clip(cols, 0, Sb - 1), x.shape[:-1] + (R - 2,))
    interior = jnp.where(inside, jnp.take_along_axis(x, cols, axis=-1, mode="promise_in_bounds"), 0)
    return jnp.concatenate([left, interior, right], axis=-1)


def table_products(q_blk, table, K, cfg, acc_dtype):
    """q . table[r] for every bucket: [B,K,G,Tb,R] (table [R,H] or [R,N,H])."""
    if table.ndim == 2:
        return einsum("bkgth,rh->bkgtr", q_blk, table.astype(acc_dtype), cfg, acc_dtype)
    table = table.reshape(table.shape[0], K, -1, table.shape[-1]).astype(acc_dtype)
    return einsum("bkgth,rkgh->bkgtr", q_blk, table, cfg, acc_dtype)


def apply_table(buckets, table, K, cfg, acc_dtype):
    """[B,K,G,Tb,R] @ table [R,(N,)F] -> [B,K,G,Tb,F]."""
    if table.ndim == 2:
        return einsum("bkgtr,rf->bkgtf", buckets, table.astype(acc_dtype), cfg, acc_dtype)
    table = table.reshape(table.shape[0], K, -1, table.shape[-1]).astype(acc_dtype)
    return einsum("bkgtr,rkgf->bkgtf", buckets, table, cfg, acc_dtype)


def table_grad(buckets, x_blk, table, K, cfg, acc_dtype):
    """d table from bucket sums [B,K,G,Tb,R] and per-row vectors x [B,K,G,Tb,F]: [R,(N,)F]."""
    if table.ndim == 2:
        return einsum("bkgtr,bkgtf->rf", buckets, x_blk, cfg, acc_dtype)
    grad = einsum("bkgtr,bkgtf->rkgf", buckets, x_blk, cfg, acc_dtype)
    return grad.reshape(table.shape)
