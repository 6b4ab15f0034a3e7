"""The flash forward's body, shared by the Pallas GPU kernels (flash_gpu, decode_gpu) and the TPU flex kernel
(flex_tpu): one program's loop over the key tiles its schedule lists, and the pieces of one [Tb,Sb] tile (which
pair_tables' kernels for per-pair tables use too: capped_logits, allowed_in_tile, visit).

    forward, grid (b, n, query tile i):        for each key tile j the schedule lists for (b, n, i)
        x = score_mod(softcap(scale * (q_i k_j^T + QA[t, c(j - i)])) + bias)  [Tb,Sb], float32 (or wider)
            bias: a position bias's rows gathered at index(i, j) (T5, ALiBi: j - i; Swin, BEiT: the 2D offset in a
            window), when the call has one (or the kernel's own hooks.bias_of_key_tile(j): flex_tpu builds
            T5's and ALiBi's from a slice of the rows without a gather)
            QA: Shaw's key term, q . key_table[row] per query row and table row ([Tp,Dp] per head,
                computed outside the kernel: offset_tables), picked per pair at c(j - i), when it has one
        (out, m, l) = combine_partials((out, m, l), partial of x over the allowed pairs, v_j)
        P[t, c(j - i)] += p  (Shaw's value term: per-row sums of p by table row, rescaled as out is)
      out_i = out / l (sinks folded in), lse_i = m + log l, P_i = P / l (offset_tables adds P @ value_table)
    flex_tpu builds the table terms of a tile itself, without a gather or a scatter: its
    hooks.table_logits_of_key_tile(j, k) in place of QA's pick (plus the per-key-row term), and
    hooks.table_values_of_key_tile(j, p) added to the tile's p v.

Every rule is _core's: which pairs may attend (masks.allowed_pairs, on the tile's positions), the schedule's
order of key tiles (WITH_MOD tiles, then MASKED, then CLEAN, then skipped ones: a list of tiles sorted by kind,
or for calls whose kinds come in runs of tiles, the runs' bounds: schedule()), the online-softmax merge and
sinks (softmax.combine_partials, add_sinks, finalize_partial), softcap (mods.softcap), and score_mod /
mask_mod (mods.on_tile calls them on the tile's iota grids). A kernel body reads typed refs (flash.refs.Refs:
r.q, r.k_pos, r.order, ...; None where the call has no such input) and takes a kernel's own constructions of a
tile's terms as typed hooks (flash.refs.ForwardHooks).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import jax.ref  # jax.ref.addupdate: a submodule, imported by name
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._core import mods
from .._core.dtypes import accumulation_dtype
from .._core.masks import CLEAN, MASKED, WITH_MOD, MaskRule, allowed_pairs
from .._core.offset_bias import OffsetIndex
from .._core.softmax import add_sinks, combine_partials, empty_partial, finalize_partial
from .flash.refs import ForwardHooks, Refs


class Config(NamedTuple):
    """Static (hashable) description of one kernel run."""

    Tb: int
    Sb: int
    Tn: int
    Sn: int
    N: int
    K: int
    rule: MaskRule
    scale: float
    softcap: Optional[float]
    score_fn: Any  # mods.ElementProgram or None
    mask_fn: Any
    score_grads: tuple  # per score_mod const: True when it is a float array (it gets a gradient)
    n_mask_consts: int
    batched: tuple  # (q_pos, k_pos, segments, lengths, schedule): which carry a batch axis B (else 1)
    head_kinds: bool  # the schedule has a head axis (a per-head BlockMask)
    precision: Any
    interpret: bool
    num_warps: int
    # a position bias in the kernel (offset_bias.KERNEL_BIASES: T5, ALiBi, Swin / BEiT windows): (index, batched),
    # its rows r.offset_bias [B|1,N,D] read at index(q_pos, k_pos) (a static function: OffsetIndex,
    # WindowIndex; batched: one set of rows per batch entry); None: no position bias
    offset_bias: Any = None
    tables: Any = None  # Shaw tables: a Tables, or None
    # the forward writes lse (r.lse [Tb]): the backward's residual, or the caller's return_lse. False: a
    # forward-only call of the GPU flash kernel without return_lse, which then has no lse output at all
    write_lse: bool = True
    # q, k, v and out (do, dq, dk, dv) as the caller's arrays, not padded to whole tiles: their Extents (the
    # GPU flash kernels); None: padded by prepare (the TPU flex kernel, the per-pair tables' kernels)
    extents: Any = None


class Extents(NamedTuple):
    """The GPU flash kernels read q, k, v and write out (and the backward's do, dq, dk, dv) where the caller's
    arrays are, unpadded: T query rows, S key rows, head dims H and Hv; the kernels' blocks span whole tiles and
    head dims Hp, Hvp (powers of two, as Triton's loads need). A tile that runs past an array reads zeros there,
    as the padding copies held, and writes nothing (read, write): Pallas' Triton lowering does not bound a
    block by its array, the kernel's mask does."""

    T: int
    S: int
    H: int
    Hv: int
    Hp: int
    Hvp: int

    def of(self, name: str) -> tuple:
        """(rows, columns) of the array behind the ref `name`."""
        rows = self.T if name in ("q", "do", "out", "dq") else self.S
        columns = self.H if name in ("q", "dq", "k", "dk") else self.Hv
        return rows, columns


class Tables(NamedTuple):
    """A call's Shaw tables in the kernels (offset_tables): offsets lo..hi reach the tables' rows, column c =
    clip(j - i, lo, hi) - lo of Dp per query row. key_term: r.row_bias [B,N,Tp,Dp] holds q_t . key_table
    at column c; value_term: r.row_sums receives the sums of p by column.

    DeBERTa's tables (row_tables.RowTables) read the same arrays at another column: mapped, c =
    r.column_map[clip(j - i, lo, hi) - lo] (the scheme's rows of the band's offsets, an int32 gather; the
    bucket formula stays in the scheme), and key_row_term adds a per-KEY-row term, r.key_row_bias
    [B,N,Sp,Dp] = k_s . query_table at column c (its gradient summed by column per key row in the dk/dv
    kernel)."""

    lo: int
    hi: int
    Dp: int
    key_term: bool
    value_term: bool
    mapped: bool = False
    key_row_term: bool = False


def key_term_in(cfg) -> bool:
    return cfg.tables is not None and cfg.tables.key_term


def value_term_in(cfg) -> bool:
    return cfg.tables is not None and cfg.tables.value_term


def key_row_term_in(cfg) -> bool:
    return cfg.tables is not None and cfg.tables.key_row_term


class Side(NamedTuple):
    """The kernels' inputs besides q, k, v: positions [B|1,Tp] / [B|1,Sp], lengths [B], segment ids
    [B|1,Tp] / [B|1,Sp], sinks [B,N], score_mod / mask_mod consts, and the key-tile schedules (forward /
    dq: order [Bs,Ns,Tn,Sn] and counts [Bs,Ns,Tn,4]; dk/dv: over query tiles, [Bs,Ns,Sn,Tn] and [Bs,Ns,Sn,4]);
    a compact schedule has no order (None) and its counts hold runs instead (schedule(), masks.tile_runs)."""

    q_pos: Any = None
    k_pos: Any = None
    lengths: Any = None
    q_seg: Any = None
    k_seg: Any = None
    sinks: Any = None
    score_consts: tuple = ()
    mask_consts: tuple = ()
    order: Any = None
    counts: Any = None
    t_order: Any = None
    t_counts: Any = None
    offset_bias: Any = None  # [B|1,N,D] in the compute dtype (Config.offset_bias), or None
    row_bias: Any = None  # Shaw's key term QA [B,N,Tp,Dp] in the compute dtype (Config.tables), or None
    column_map: Any = None  # int32 [M]: the column of each offset lo..hi (Tables.mapped), or None
    key_row_bias: Any = None  # the per-key-row term KB [B,N,Sp,Dp] in the compute dtype (Tables.key_row_term)


# ---------------------------------------------------------------------------------------------------
# Inside the kernels: one [Tb,Sb] tile.


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
# table (Dp up to offset_tables.MAX_COLUMNS) never holds more registers than a logits tile.
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
    of a compact one (flash_gpu.schedules says which a call gets)."""
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
    if cfg.extents is not None:  # (padded arrays: ref may be a view of a TPU block, tpu_backward's)
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


def key_tiles(cfg: Config, r: Refs, hooks: ForwardHooks, b, n, q, qp, q_seg, lengths, key_start=0):
    """The partial (out, m, l) of rows q [Tb,H] over the key tiles r's schedule lists (program_schedule); tile j
    holds keys key_start + j * Sb + 0..Sb-1 of the example, r.k[j * Sb:...] of the block."""
    score_consts, mask_consts = load_all(r.score_consts), load_all(r.mask_consts)

    def key_tile(kind, j, state):
        keys = pl.ds(pl.multiple_of(j * cfg.Sb, cfg.Sb), cfg.Sb)  # aligned: a TPU's dynamic slices need it
        s0 = key_start + j * cfg.Sb
        k, v = (read(cfg, ref, name, s0, (keys, slice(None))) for name, ref in (("k", r.k), ("v", r.v)))
        kp = r.k_pos[keys]
        k_seg = None if q_seg is None else r.k_seg[keys]
        column = None if cfg.tables is None else table_column(cfg, r, qp, kp)
        key_term = (
            None if cfg.tables is None else table_logits(cfg, r, column, tile_rows(cfg), tile_keys(cfg, j * cfg.Sb))
        )
        if hooks.table_logits_of_key_tile is not None:  # the kernel's own construction (flex_tpu)
            key_term = hooks.table_logits_of_key_tile(j, k)
        x = capped_logits(cfg, q, k, key_term)
        if cfg.offset_bias is not None:  # the position bias: after softcap, before score_mod
            build = hooks.bias_of_key_tile  # the kernel's own construction (flex_tpu: no gather)
            x = x + (offset_bias_tile(r.offset_bias, offset_index(cfg, qp, kp)) if build is None else build(j))
        x = apply_score_mod(cfg, b, n, qp, kp, x, score_consts)
        allowed = allowed_in_tile(cfg, kind, b, n, qp, kp, key_start + j * cfg.Sb, lengths, q_seg, k_seg, mask_consts)
        if allowed is not None:
            x = jnp.where(allowed, x, -jnp.inf)
        m = jnp.max(x, axis=-1)
        p = jnp.exp(x - jnp.where(jnp.isfinite(m), m, 0)[:, None])  # masked: exp(-inf) = 0
        out = dot(p.astype(v.dtype), v, cfg)
        if hooks.table_values_of_key_tile is not None:  # the kernel's own value term (flex_tpu)
            out = out + hooks.table_values_of_key_tile(j, p)
        merged = combine_partials(state, ((out,), m, jnp.sum(p, axis=-1)))
        if value_term_in(cfg):  # the value term's sums, rescaled as combine_partials rescales out
            old = rescale(state[1], merged[1])

            @pl.when(jnp.min(old) < 1)  # the running max moved (early tiles): skip the pass over [Tb,Dp] otherwise
            def _():
                scale_rows(r.row_sums, old)

            add_by_column(r.row_sums, column, p * rescale(m, merged[1])[:, None])
        return merged

    state = empty_partial(((cfg.Tb, r.v.shape[-1]),), (cfg.Tb,), accumulation_dtype(q.dtype))
    return visit(cfg, program_schedule(r), key_tile, state)


def forward_kernel(cfg: Config, r: Refs, hooks: ForwardHooks = ForwardHooks()):
    """The flash forward of one (b, n, query tile) (flash_gpu's forward; flex_tpu's, with its hooks)."""
    b, n = pl.program_id(0), pl.program_id(1)
    value_term = value_term_in(cfg)
    if value_term:
        fill_rows(r.row_sums)
    row0 = 0 if cfg.extents is None else pl.program_id(2) * cfg.Tb  # the query tile's first row
    q = read(cfg, r.q, "q", row0)
    state = key_tiles(cfg, r, hooks, b, n, q, r.q_pos[...], load(r.q_seg), load(r.lengths))
    m_keys = state[1]
    state = add_sinks(state, load(r.sinks))
    if value_term:  # P / l, as finalize_partial divides out (relative to the max after the sinks)
        _, m, l = state
        scale_rows(r.row_sums, rescale(m_keys, m) / jnp.where(l == 0, 1, l))
    (out,), lse = finalize_partial(state)
    write(cfg, r.out, "out", out, row0)
    if cfg.write_lse:
        r.lse[...] = lse


def pick(batched, b):
    """b when the array is batched (one row per batch entry), else its single row 0."""
    return b if batched else 0
