"""Shaw et al.'s clipped relative tables on one tile: the bucket index r of each (query, key) pair, the
products q . table[r] for every bucket, their gather onto the tile, and its transpose, the sums of a tile
over the keys of each bucket (what the value table's output and both tables' gradients read).

With contiguous positions a tile reads only its window (windowed): pair (t, s) has the offset
key_pos - query_pos = offset0 + s - t, so the tile's Tb x Sb pairs read the W = Tb + Sb - 1 offsets
offset0 - (Tb - 1) + c, c < W, whatever R = 2m + 1 is (Transformer-XL's whole span: R = 2S - 1). Per tile:

    rows       = table[clip(offset0 - (Tb - 1) + c, -m, m) + m]      [W,(N,)F]    window_rows
    term[t, s] = (q rows^T)[t, s - t + Tb - 1]                        the skew     window_skew, gather_buckets
    sums[t, c] = x[t, c + t - (Tb - 1)]   (0 past the tile's keys)    its transpose, window_sums

and the value term p . A^V is window_sums(p) @ rows, d q = window_sums(ds) @ rows, d rows = sums^T q (added
onto the table's rows: clipped columns share a row, and add).
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
    offsets = offset0 + jnp.arange(Sb)[None, :] - jnp.arange(Tb)[:, None]
    left = jnp.sum(jnp.where(offsets <= -d, x, 0), axis=-1, keepdims=True)
    right = jnp.sum(jnp.where(offsets >= d, x, 0), axis=-1, keepdims=True)
    interior = _diagonals(x, 1 - d - offset0, R - 2)  # bucket r's key: offset r - d, s = t + r - d - offset0
    return jnp.concatenate([left, interior, right], axis=-1)


def _diagonals(x, first, count):
    """[...,Tb,Sb] -> [...,Tb,count]: y[t, c] = x[t, t + first + c], 0 where that key is outside the tile
    (column c holds the pair of s - t = first + c: at most one key per row, a gather)."""
    Tb, Sb = x.shape[-2:]
    cols = jnp.arange(Tb)[:, None] + first + jnp.arange(count)[None, :]
    inside = (cols >= 0) & (cols < Sb)
    cols = jnp.broadcast_to(jnp.clip(cols, 0, Sb - 1), x.shape[:-1] + (count,))
    return jnp.where(inside, jnp.take_along_axis(x, cols, axis=-1, mode="promise_in_bounds"), 0)


def windowed(cfg):
    """Whether a tile reads its window of table rows rather than q . table[r] for all R = 2m + 1 buckets:
    positions contiguous (cfg.contiguous) and the window, W = Tb + Sb - 1 offsets, narrower than R."""
    return cfg.contiguous and cfg.max_distance is not None and cfg.Tb + cfg.Sb - 1 < 2 * cfg.max_distance + 1


def tile_index(cfg, qp, kp, offset0, tables):
    """A tile's view of the tables: (index [Tb,Sb], each pair's column in the per-row products; windowed, the
    window's row index [W] and each table's rows [W,(N,)F] (window_rows), else None and Nones)."""
    if windowed(cfg):
        return window_skew(cfg), *window_rows(cfg, offset0, tables)
    return None if cfg.max_distance is None else bucket_index(cfg, qp, kp), None, (None,) * len(tables)


def window_rows(cfg, offset0, tables):
    """A contiguous tile's window (offset0: key_pos - query_pos at t = s = 0): (index [W], the table row of
    column c's offset offset0 - (Tb - 1) + c, clipped; each table's rows [W,(N,)F], None for None)."""
    m = cfg.max_distance
    index = jnp.clip(offset0 - (cfg.Tb - 1) + jnp.arange(cfg.Tb + cfg.Sb - 1), -m, m) + m
    return index, tuple(None if t is None else t[index] for t in tables)


def window_skew(cfg):
    """[Tb,Sb]: pair (t, s)'s column in its tile's window, s - t + Tb - 1 (gather_buckets' index)."""
    return jnp.arange(cfg.Sb)[None, :] - jnp.arange(cfg.Tb)[:, None] + cfg.Tb - 1


def window_sums(x):
    """The transpose of the skew: [...,Tb,Sb] -> [...,Tb,W], y[t, c] = x[t, c + t - (Tb - 1)] (0 past the keys)."""
    Tb, Sb = x.shape[-2:]
    return _diagonals(x, 1 - Tb, Tb + Sb - 1)


def add_rows(grad, index, rows):
    """grad[index[c]] += rows[c] for every window column c (clipped columns share a row: their rows add)."""
    return grad.at[index].add(rows.astype(grad.dtype), mode="promise_in_bounds")


def table_products(q_blk, table, K, cfg, acc_dtype):
    """q . table[r] for every row: [B,K,G,Tb,R] (table [R,H] or [R,N,H], or a tile's window rows)."""
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
