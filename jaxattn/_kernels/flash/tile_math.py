"""The pieces of one [Tb,Sb] tile that the flash bodies (forward, backward) and the per-pair kernels
(pairs_gpu) share: the logits (dot, capped_logits), which pairs may attend (allowed_in_tile), the position terms
read at a pair's index (offset_index, table_column, table_logits) and their sums by column, the schedule a
program walks (schedule, visit, Listed, Runs), and the masked reads and writes of unpadded arrays (read, write)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import jax.ref  # jax.ref.addupdate: a submodule, imported by name
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ..._core import mods
from ..._core.dtypes import accumulation_dtype
from ..._core.masks import (
    CLEAN,
    MASKED,
    WITH_MOD,
    allowed_pairs,
)
from ..._core.offset_bias import OffsetIndex
from .config import key_row_term_in, key_term_in
from .refs import Refs


def dot(a, b, cfg, contract=(1, 0)):
    """a @ b over a's axis contract[0] and b's axis contract[1], accumulated in float32 (or wider)."""
    acc_dtype = accumulation_dtype(a.dtype)
    return lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), ((), ())), precision=cfg.precision, preferred_element_type=acc_dtype
    )


def capped_logits(cfg, q, k, table_term=None):
    """softcap(scale * (q k^T + table_term)): [Tb,Sb]; table_term: Shaw's key term of the tile (or None),
    inside the scale and the softcap as the XLA engines add it."""
    x = dot(q, k, cfg, (1, 1))
    if table_term is not None:
        x = x + table_term
    return mods.softcap(x * cfg.scale, cfg.softcap)


def offset_index(cfg, qp, kp):
    """int32 [Tb,Sb]: the row of the position-bias rows each pair reads, the bias's own index of the tile's
    positions (OffsetIndex: clip(j - i, lo, hi) - lo; WindowIndex: the 2D offset), in bounds for every
    position of the call, padding rows and columns included (kernel_table's promise)."""
    index, _ = cfg.offset_bias
    return index(qp, kp)


def table_column(cfg, r: Refs, qp, kp):
    """int32 [Tb,Sb]: the column of the table arrays (row_bias, row_sums, key_row_bias) each pair reads:
    clip(j - i, lo, hi) - lo for Shaw's tables, or that offset's entry of r.column_map (Tables.mapped:
    DeBERTa's log-bucketed rows, computed by the scheme)."""
    index = OffsetIndex(cfg.tables.lo, cfg.tables.hi)(qp, kp)
    return r.column_map[index] if cfg.tables.mapped else index


def tile_rows(cfg, row0=0):
    """int32 [Tb,Sb]: row0 + t, the row of each pair in a per-query-row block ([Tb,Dp] from row0 = 0, or a
    whole [Tp,Dp] block from the query tile's first row)."""
    return row0 + lax.broadcasted_iota(jnp.int32, (cfg.Tb, cfg.Sb), 0)


def tile_keys(cfg, key0=0):
    """int32 [Tb,Sb]: key0 + s, the key row of each pair in a per-key-row block ([Sp,Dp] of the whole key
    axis from the key tile's first row, or a tile's own [Sb,Dp] from key0 = 0)."""
    return key0 + lax.broadcasted_iota(jnp.int32, (cfg.Tb, cfg.Sb), 1)


def table_logits(cfg, r: Refs, column, rows, keys, head=None):
    """The table terms of a tile inside q k^T (None: the call has none), [Tb,Sb]: QA[t, c] (row_bias at the
    tile's query rows `rows`) plus KB[s, c] (key_row_bias at its key rows `keys`), c = column; `head`: the
    query head within the blocks (the dk/dv kernel's group)."""
    term = None
    if key_term_in(cfg):
        term = pick_rows(r.row_bias, rows, column, head)
    if key_row_term_in(cfg):
        by_key = pick_rows(r.key_row_bias, keys, column, head)
        term = by_key if term is None else term + by_key
    return term


def pick_rows(ref, rows, column, head=None):
    """ref[rows, column] (or ref[head, rows, column]): [Tb,Sb] gathered from a per-row block [Tb|Tp,Dp]."""
    return ref[rows, column] if head is None else ref[head, rows, column]


def add_by_column(ref, column, values):
    """ref[t, column[t,s]] += values[t,s] into a [Tb,Dp] block: the sum over the keys of each row that read
    one column (the Shaw value term's sums of p; the key term's gradient). The Triton lowering adds with
    atomics (keys of one row meet in one column). A tile whose pairs all read one column (every tile past
    the clip distance: most of a long sequence's) adds its row sums there instead: Tb adds, not Tb x Sb."""
    first = jnp.min(column)
    one_column = first == jnp.max(column)

    @pl.when(one_column)
    def _():
        jax.ref.addupdate(ref, (pl.ds(0, values.shape[0]), first), jnp.sum(values, axis=1))

    @pl.when(jnp.logical_not(one_column))
    def _():
        jax.ref.addupdate(ref, (lax.broadcasted_iota(jnp.int32, values.shape, 0), column), values)


def add_by_key_column(ref, column, values, head=None):
    """ref[(head,) s, column[t,s]] += values[t,s] into a key tile's [Sb,Dp] block (or [G,Sb,Dp] with head):
    the sum over the queries of each key row that read one column (the gradient of the per-key-row term,
    from the dk/dv kernel, which owns its key tile). As add_by_column: atomic adds within the block, and a
    tile whose pairs all read one column adds its column sums there instead."""
    first = jnp.min(column)
    one_column = first == jnp.max(column)
    keys = pl.ds(0, values.shape[1])
    lead = () if head is None else (head,)

    @pl.when(one_column)
    def _():
        jax.ref.addupdate(ref, (*lead, keys, first), jnp.sum(values, axis=0))

    @pl.when(jnp.logical_not(one_column))
    def _():
        jax.ref.addupdate(ref, (*lead, lax.broadcasted_iota(jnp.int32, values.shape, 1), column), values)


# The columns of a per-row block [Tb,Dp] that one step of scale_rows reads: as wide as a key tile, so a wide
# table (Dp up to tables_gpu.MAX_COLUMNS) never holds more registers than a logits tile.
ROW_CHUNK = 64


def scale_rows(ref, factor):
    """ref[t, :] *= factor[t] over a [Tb,Dp] block, ROW_CHUNK columns at a time."""
    Dp = ref.shape[-1]
    width = min(ROW_CHUNK, Dp)
    for c in range(0, Dp, width):
        cols = pl.ds(c, width)
        ref[:, cols] = ref[:, cols] * factor[:, None]


def fill_rows(ref, value=0.0):
    Dp = ref.shape[-1]
    width = min(ROW_CHUNK, Dp)
    for c in range(0, Dp, width):
        ref[:, pl.ds(c, width)] = jnp.full((ref.shape[0], width), value, ref.dtype)


def rescale(m_from, m_to):
    """exp(m_from - m_to) with combine_partials' guard (m_to not finite: no key yet, the factor relative to 0)."""
    return jnp.exp(m_from - jnp.where(jnp.isfinite(m_to), m_to, 0))


def offset_bias_tile(ref, index, head=None):
    """The position bias of a tile, float [Tb,Sb]: a gather from the rows of one head (ref: the block of one
    (b, n), [D], or with `head` of a group of heads, [G,D]) at `index` (offset_index)."""
    return ref[index] if head is None else ref[head, index]


def apply_score_mod(cfg, b, n, qp, kp, capped, score_consts):
    return capped if cfg.score_fn is None else mods.on_tile(cfg.score_fn, score_consts, b, n, qp, kp, capped)


def allowed_in_tile(cfg, kind, b, n, qp, kp, s0, lengths, q_seg, k_seg, mask_consts):
    """bool [Tb,Sb] (or None: every pair allowed) of a tile of kind WITH_MOD / MASKED / CLEAN."""
    if kind == CLEAN:
        return None
    key_index = s0 + lax.broadcasted_iota(jnp.int32, (cfg.Sb,), 0)
    allowed = allowed_pairs(cfg.rule, qp, kp, key_index, lengths, q_seg, k_seg)
    if kind == WITH_MOD:
        by_mod = mods.on_tile(cfg.mask_fn, mask_consts, b, n, qp, kp)
        allowed = by_mod if allowed is None else allowed & by_mod
    return None if allowed is None else jnp.broadcast_to(allowed, (qp.shape[0], cfg.Sb))


class Listed(NamedTuple):
    """The general schedule of one program: its tiles sorted by kind, order(idx) the tile of step idx (WITH_MOD
    ones first, then MASKED, then CLEAN), and counts(kind) how many of each (sorted_kinds' rows)."""

    counts: Any  # kind -> int32 scalar
    order: Any  # step -> int32 scalar

    def count(self, kind):
        return self.counts(kind)

    def tile(self, kind, first, idx):
        return self.order(first + idx)


class Runs(NamedTuple):
    """The compact schedule of one program (masks.tile_runs' row, read once): tiles a0 <= j < a1 are visited,
    c0 <= j < c1 of them CLEAN (c0 = c1 = a1 when none is), the rest MASKED; no WITH_MOD tile. Steps go in
    the order Listed's would: the MASKED tiles ascending ([a0, c0), then [c1, a1)), then the CLEAN ones."""

    a0: Any
    c0: Any
    c1: Any
    a1: Any

    def count(self, kind):
        if kind == MASKED:
            return (self.c0 - self.a0) + (self.a1 - self.c1)
        return self.c1 - self.c0 if kind == CLEAN else 0

    def tile(self, kind, first, idx):
        if kind == CLEAN:
            return self.c0 + idx
        return self.a0 + idx + jnp.where(idx < self.c0 - self.a0, 0, self.c1 - self.c0)  # past the clean run


def schedule(row, order=None):
    """The schedule a program walks (visit): row(k) reads its row of the counts array ([...,4]): the counts
    of a Listed schedule with order(idx) its sorted tiles, or without order (None) the runs (a0, c0, c1, a1)
    of a compact one (plan.schedules says which a call gets)."""
    return Listed(row, order) if order is not None else Runs(*(row(k) for k in range(4)))


def visit(cfg, steps, body, state):
    """body(kind, tile, state) over the tiles a schedule (Listed or Runs) lists: one loop per kind, each with a
    static body."""
    first = 0
    for kind in (WITH_MOD, MASKED, CLEAN):
        if kind == WITH_MOD and cfg.mask_fn is None:
            continue
        count = steps.count(kind)
        state = lax.fori_loop(
            0, count, lambda idx, st, kind=kind, first=first: body(kind, steps.tile(kind, first, idx), st), state
        )
        first = first + count
    return state


def in_bounds(cfg, name, shape, row0):
    """bool [L,F]: which elements of a [L,F] tile of array `name` (Extents.of) whose first row is row0 lie inside
    the array; None when all do: whole tiles (row0 is a multiple of L, so a tile that starts inside ends
    inside) and a head dim that is its block's. No kernel visits a tile that starts past its array: the grids
    cover ceil(T / Tb) and ceil(S / Sb) tiles, and the decode kernel's last chunk lists no tile past S (the
    schedule skips keys past the length, which padded_rows sets to S there)."""
    rows, columns = cfg.extents.of(name)
    mask = None
    if rows % shape[0]:
        mask = row0 + lax.broadcasted_iota(jnp.int32, shape, 0) < rows
    if columns != shape[1]:
        inside = lax.broadcasted_iota(jnp.int32, shape, 1) < columns
        mask = inside if mask is None else mask & inside
    return mask


def read(cfg, ref, name, row0=0, index=None):
    """ref[index] (the whole block without index): a [L,F] tile of q, k, v or do, row0 its first row in the
    array; zeros past the array's rows and columns when the kernel reads it unpadded (cfg.extents)."""
    if cfg.extents is not None:  # (padded arrays: ref may be a view of a TPU block, flex_tpu_vjp's)
        view = ref if index is None else ref.at[index]
        mask = in_bounds(cfg, name, view.shape, row0)
        if mask is not None:
            if index is not None:  # a Python int index (the dk/dv kernel's head 0 when G = 1): the
                # interpreter's masked load takes array indices only
                view = ref.at[tuple(jnp.int32(i) if isinstance(i, int) else i for i in index)]
            return plgpu.load(view, mask=mask, other=0)
    return ref[...] if index is None else ref[index]


def write(cfg, ref, name, value, row0=0):
    """ref[...] = value, a [L,F] tile of out, dq, dk or dv whose first row is row0; nothing past the array's
    rows and columns when it is unpadded (cfg.extents)."""
    value = value.astype(ref.dtype)
    mask = None if cfg.extents is None else in_bounds(cfg, name, ref.shape, row0)
    if mask is None:
        ref[...] = value
    else:
        plgpu.store(ref, value, mask=mask)


def load(ref):
    """The whole block of an optional input (None when the call has none)."""
    return None if ref is None else ref[...]


def load_all(refs: tuple) -> tuple:
    return tuple(ref[...] for ref in refs)


def program_schedule(r: Refs):
    """The schedule of this program's refs (r.order and r.counts, or r.counts alone holding runs)."""
    order = r.order
    return schedule(lambda k: r.counts[k], None if order is None else lambda idx: order[idx])


def pick(batched, b):
    """b when the array is batched (one row per batch entry), else its single row 0."""
    return b if batched else 0
