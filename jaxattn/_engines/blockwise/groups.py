"""Row groups: blockwise_attention runs the engine over a few rows (batch entries x key/value heads) at a
time (lax.map), so each group's tiles stay in cache; whether rows are grouped, the tiles each way, and the
split of every array into groups. Tile sizes and group sizes themselves: jaxattn._engines.tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .. import tiles
from .values import KeySide
from .vjp import engine


def on_a_device_mesh(*xs):
    """True when an input is laid out over a multi-device mesh (jit of sharded arguments, or a sharded
    array). Its batch or head axes may then be split over devices in ways the trace cannot see (automatic
    axes carry no spec), and a loop over row groups would make XLA all-gather such an axis."""
    for x in xs:
        mesh = getattr(jax.typeof(x).sharding, "mesh", None)
        if mesh is not None and not mesh.empty and mesh.size > 1:
            return True
    return False


def grouped_engine(cfg, q, keys, shared, q_pos, arrays, groups):
    """engine over one row group at a time (lax.map): (out [B,K,G,Tp,Hv], lse [B,K,G,Tp]); groups = (Bc, Kc)
    batch entries and key/value heads per group. A group takes every Cb-th batch entry and every Ck-th
    head (b = i * Cb + cb): the loop runs over the minor factors, so contiguous blocks of B or K stay
    together. Arrays with a batch or head axis are split along it (per-head tables [R,N,F] by key/value
    head); shared ones are closed over, their gradients summed over the groups by autodiff."""
    B, K, G = q.shape[:3]
    Bc, Kc = groups
    Cb, Ck = B // Bc, K // Kc
    if Cb * Ck == 1:
        return engine(cfg, q, keys, shared, q_pos, arrays)

    def split(x):  # [B,K,...] -> [Cb*Ck, Bc, Kc, ...]
        x = jnp.moveaxis(x.reshape(Bc, Cb, Kc, Ck, *x.shape[2:]), (1, 3), (0, 1))
        return x.reshape(Cb * Ck, Bc, Kc, *x.shape[4:])

    def unsplit(x):  # the inverse: [Cb*Ck, Bc, Kc, ...] -> [B,K,...]
        x = jnp.moveaxis(x.reshape(Cb, Ck, Bc, Kc, *x.shape[3:]), (0, 1), (1, 3))
        return x.reshape(B, K, *x.shape[4:])

    def per_batch(x, batched):  # [B,...] -> [Cb*Ck, Bc, ...]; a shared one stays closed over (None)
        if x is None or not batched:
            return None
        x = jnp.moveaxis(x.reshape(Bc, Cb, *x.shape[1:]), 1, 0)[:, None]
        return jnp.broadcast_to(x, (Cb, Ck, *x.shape[2:])).reshape(Cb * Ck, Bc, *x.shape[3:])

    def per_head(table):  # [R,N,F] -> [Cb*Ck, R, Kc*G, F]; None or a shared [R,F] stays closed over (None)
        if table is None or table.ndim == 2:
            return None
        R, _, F = table.shape
        table = jnp.moveaxis(table.reshape(R, Kc, Ck, G, F), 2, 0).reshape(Ck, R, Kc * G, F)
        return jnp.broadcast_to(table[None], (Cb, Ck, R, Kc * G, F)).reshape(Cb * Ck, R, Kc * G, F)

    def either(part, whole):
        return whole if part is None else part

    group_cfg = cfg._replace(N=Kc * G)

    def group(xs):
        qg, kg, vg, ktg, vtg, qpg, kpg, lg, qsg, ksg, sg = xs
        group_arrays = arrays._replace(q_seg=either(qsg, arrays.q_seg), k_seg=either(ksg, arrays.k_seg), sinks=sg)
        group_keys = KeySide(kg, vg, either(kpg, keys.pos), either(lg, keys.lengths))
        group_shared = shared._replace(
            key_table=either(ktg, shared.key_table), value_table=either(vtg, shared.value_table)
        )
        return engine(group_cfg, qg, group_keys, group_shared, either(qpg, q_pos), group_arrays)

    def rows_of(x):  # lengths [B|1], segment ids [B|1,L]: per batch entry when the first axis is B > 1
        return per_batch(x, x is not None and B > 1 and x.shape[0] == B)

    xs = (
        split(q),
        split(keys.k),
        split(keys.v),
        per_head(shared.key_table),
        per_head(shared.value_table),
        per_batch(q_pos, q_pos.ndim > 1),
        per_batch(keys.pos, keys.pos.ndim > 1),
        rows_of(keys.lengths),
        rows_of(arrays.q_seg),
        rows_of(arrays.k_seg),
        None if arrays.sinks is None else split(arrays.sinks),
    )
    out, lse = lax.map(group, xs)  # [Cb*Ck, Bc, Kc, G, Tp, (Hv)]
    return unsplit(out), unsplit(lse)


def row_grouped(query, key, value, score_mod, mask_mod):
    """Row groups unless the inputs are sharded (a row loop would all-gather a sharded batch or head axis)
    or score_mod / mask_mod need the global batch and head indices of every row."""
    return score_mod is None and mask_mod is None and not on_a_device_mesh(query, key, value)


def tile_sizes(block_size, T, S, B, N, K, span, grouped):
    """(Tb, Sb): the row-group tiles, or one tile over all B * N rows (tiles.py's two defaults)."""
    if grouped:
        return tiles.row_tile_sizes(block_size, T, S, N // K, span)
    return tiles.block_sizes(block_size, T, S, B * N, span=span)


def whole_rows(grouped, hooked, q_pos, k_pos):
    """tiles.row_groups' `whole`: one group of all rows when not grouped or when a hook's bias spans every
    batch entry (batched positions); every head in each group when a hook's bias or a per-pair table
    (hooked) spans every head (a group of heads would need a copy of the table's heads)."""
    if not grouped or (hooked and max(q_pos.ndim, k_pos.ndim) > 1):
        return "all"
    return "heads" if hooked else None
