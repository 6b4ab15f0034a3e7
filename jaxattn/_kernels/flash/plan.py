"""One call's plan for the flash kernels, on any platform: its checks (checked), what the flash core can express
of its position terms (position_bias_refusal, tables_band, row_tables_refusal), tiles, layout and key-tile
schedules (prepare -> Prepared), and the way back to the public result (finish)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..._core import block_mask as block_masks, checks, mods
from ..._core.call import AttentionCall
from ..._core.dtypes import accumulation_dtype
from ..._core.masks import (
    CLEAN,
    MASKED,
    WITH_MOD,
    MaskRule,
    check_lengths,
    key_block_kinds,
    masks_anything,
    tile_runs,
)
from ..._core.offset_bias import KERNEL_BIASES
from ..._core.positions import positions
from ..._core.softmax import public_lse
from ..._engines import blockwise
from ..._engines.tiles import check_block_mask_tiles
from .. import tables_gpu, windows_gpu
from .config import Config, Extents, Side, Tables
from .sizes import gpu_tiles, mask_sub_tiles, padded_head, sub_tile_kinds, tile_sizes, window_tiles


def default_positions(call: AttentionCall) -> bool:
    return call.query_positions is None and call.key_positions is None


def position_bias_refusal(call: AttentionCall, T: int, S: int) -> Optional[str]:
    """None when the kernels compute the call's position_bias of T queries and S keys (none, or one of
    offset_bias.KERNEL_BIASES whose index the call keeps in a static range: in_kernel); else what refuses it."""
    bias = call.position_bias
    if bias is None:
        return None
    if not isinstance(bias, KERNEL_BIASES):  # a function of the whole (i, j) pair: only the XLA engines call it
        return "position_bias"
    if bias.in_kernel(T, S, default_positions(call)):
        return None
    if not default_positions(call):
        name = "query_positions" if call.query_positions is not None else "key_positions"
        return (
            f"{name} (with a position bias whose index has no static bound for them: ALiBi's j - i, "
            "a window's token places)"
        )
    return f"position_bias (its table's index holds for other lengths than T = {T}, S = {S})"


def tables_band(call: AttentionCall, T: int, S: int) -> Optional[tables_gpu.Band]:
    """The band of Shaw table rows the call reads (tables_gpu.band), or None without tables."""
    if not call.has_tables or call.max_distance is None:  # no max_distance: prepare's check names it
        return None
    return tables_gpu.band(call.max_distance, T, S, default_positions(call))


def windowed_tables(call: AttentionCall, T: int, S: int) -> bool:
    """Whether the kernels take the call's Shaw table on the windowed route (windows_gpu: each tile's key term
    from the window of rows between its queries and keys, any span): a key table alone, with the default
    positions (a tile's offsets are then contiguous), whose band of rows the per-row route refuses
    (tables_gpu.columns_refusal: Transformer-XL at its whole span). Positions of their own keep the band route
    (all 2m + 1 rows) or its refusal."""
    band = tables_band(call, T, S)
    return (
        band is not None
        and call.key_table is not None
        and call.value_table is None
        and default_positions(call)
        and tables_gpu.columns_refusal(band) is not None
    )


def row_tables_refusal(call: AttentionCall) -> Optional[str]:
    """None when the kernels take the call's row_tables (none, or R rows within tables_gpu.MAX_COLUMNS,
    without Shaw tables beside them); else what refuses it."""
    tables = call.row_tables
    if tables is None:
        return None
    if call.has_tables:
        return "key_table / value_table (beside row_tables)"
    if tables_gpu.padded_columns(tables.rows) > tables_gpu.MAX_COLUMNS:
        return (
            f"position_keys / position_queries ({tables.rows} table rows > {tables_gpu.MAX_COLUMNS}: the XLA engines)"
        )
    return None


def _rows(x, batch, length, padded):
    """[...,L] (broadcastable to the batch dims) -> [B|1, L padded] (edge-padded: padding repeats the last)."""
    if x.ndim > 1:
        x = jnp.broadcast_to(x, (*batch, length)).reshape(-1, length)
    else:
        x = x[None]
    return jnp.pad(x, [(0, 0), (0, padded - length)], mode="edge")


def kernel_layout(x, batch, length, padded, F):
    """[...,L,K,H] -> [B, L padded, K, F padded] (zeros; no pad at all when nothing is padded)."""
    x = jnp.broadcast_to(x, (*batch, *x.shape[-3:])).reshape(-1, *x.shape[-3:])
    if padded == length and F == x.shape[-1]:
        return x
    return jnp.pad(x, [(0, 0), (0, padded - length), (0, 0), (0, F - x.shape[-1])])


def key_tile_kinds(cfg, Bs, q_pos, k_pos, lengths, q_seg, k_seg, tile_kinds):
    """The key-tile kinds of every (batch, head, query tile), int32 [Bs,Ns,Tn,Sn] (Bs = B when a batched
    array decides them, Ns = N with a per-head BlockMask; [1,1,Tn,Sn] when nothing masks)."""
    rule, Tn, Sn, Tb, Sb = cfg.rule, cfg.Tn, cfg.Sn, cfg.Tb, cfg.Sb
    mask_mod = cfg.mask_fn is not None
    if not masks_anything(rule, lengths, q_seg, tile_kinds, mask_mod):
        return jnp.full((1, 1, Tn, Sn), CLEAN, jnp.int32)

    def rows(x, *shape):
        return None if x is None else jnp.broadcast_to(x, (Bs, *x.shape[1:])).reshape(Bs, *shape)

    qp, qs = rows(q_pos, Tn, Tb), rows(q_seg, Tn, Tb)
    kp, ks, ln = rows(k_pos, Sn * Sb), rows(k_seg, Sn * Sb), rows(lengths)

    def one(qp, kp, ln, qs, ks, tk=None):  # one (batch, head, query tile)
        return key_block_kinds(
            rule,
            qp,
            kp,
            None if ln is None else ln[None],
            Sb,
            Sn,
            query_segments=None if qs is None else qs[None],
            key_segments=None if ks is None else ks[None],
            block_kinds=tk,
            mask_mod=mask_mod,
        )

    tiles = (0, None, None, 0, None)
    if tile_kinds is None:
        return jax.vmap(jax.vmap(one, in_axes=tiles))(qp, kp, ln, qs, ks)[:, None]
    per_head = jax.vmap(jax.vmap(one, in_axes=tiles + (0,)), in_axes=(None,) * 5 + (0,))
    return jax.vmap(per_head)(qp, kp, ln, qs, ks, rows(tile_kinds, *tile_kinds.shape[1:]))


def sorted_kinds(kinds):
    """(order, counts) over the last axis: the tiles' indices sorted by kind (WITH_MOD, MASKED, CLEAN, then
    skipped ones), and how many of each kind ([...,4]; the last, SKIPPED, is never read)."""
    order = jnp.argsort(kinds, axis=-1, stable=True).astype(jnp.int32)
    counts = jnp.stack(
        [jnp.sum(kinds == kind, axis=-1, dtype=jnp.int32) for kind in (WITH_MOD, MASKED, CLEAN)]
        + [jnp.zeros(kinds.shape[:-1], jnp.int32)],
        axis=-1,
    )
    return order, counts


def schedules(cfg, Bs, q_pos, k_pos, lengths, q_seg, k_seg, tile_kinds, positions_given):
    """The forward / dq kernels' schedule and, transposed, the dk/dv kernel's: (order, counts, t_order,
    t_counts), tile_math.schedule's arrays (positions_given: the call passed positions of its own).

    Compact (order and t_order None, counts [Bs,1,Tn,4] and t_counts [Bs,1,Sn,4] the runs of masks.tile_runs)
    when the kinds of every program come in runs of tiles: the core's default positions (they never decrease,
    padding included), no segment ids, BlockMask or mask_mod; O(T / Tb + S / Sb) integers where the general
    form, key_tile_kinds argsorted, holds (and sorts) one per (query tile, key tile) pair: 2 GiB of int32 at
    T = S = 512k in 128 x 64 tiles, for both directions and the sort's temporaries."""
    if not positions_given and q_seg is None and tile_kinds is None and cfg.mask_fn is None:

        def runs(by_query):
            def one(qp, kp, length):
                return tile_runs(cfg.rule, qp, kp, length, cfg.Tb, cfg.Sb, by_query)

            lengths_ = None if lengths is None else jnp.broadcast_to(lengths, (Bs,))
            every = jax.vmap(one, in_axes=(None, None, None if lengths_ is None else 0), axis_size=Bs)
            return every(q_pos[0], k_pos[0], lengths_)[:, None]

        return None, runs(False), None, runs(True)
    kinds = key_tile_kinds(cfg, Bs, q_pos, k_pos, lengths, q_seg, k_seg, tile_kinds)
    return sorted_kinds(kinds) + sorted_kinds(jnp.swapaxes(kinds, -1, -2))


class Checked(NamedTuple):
    """One call's checked inputs, before the kernels' layout: shapes and the options as arrays / statics."""

    batch: tuple
    T: int
    S: int
    N: int
    K: int
    H: int
    Hv: int
    query_positions: Any
    key_positions: Any
    lengths: Any  # int32 [B] (capped at S) or None
    q_seg: Any
    k_seg: Any
    sinks: Any  # [B,N] in the compute dtype, or None
    rule: MaskRule
    scale: float
    softcap: Optional[float]
    precision: Any


def checked(call: AttentionCall, query, key, value) -> Checked:
    """The shapes and options every kernel here reads, checked against the shapes (ValueError naming the
    option)."""
    batch, T, S, N, K, H, Hv = checks.check_qkv(query, key, value)
    B = int(np.prod(batch, dtype=np.int64))
    q_pos, k_pos = positions(T, S, call.query_positions, call.key_positions)
    checks.check_broadcastable("query_positions", q_pos, (*batch, T), "[...,T]")
    checks.check_broadcastable("key_positions", k_pos, (*batch, S), "[...,S]")
    lengths = check_lengths(call.key_value_seq_lengths, batch)
    if lengths is not None:
        lengths = jnp.minimum(jnp.broadcast_to(lengths, batch).reshape(-1), S).astype(jnp.int32)
    q_seg, k_seg = mods.check_segment_ids(call.query_segment_ids, call.key_segment_ids, batch, T, S)
    acc_dtype = accumulation_dtype(query.dtype)
    sinks = mods.check_sinks(call.sinks, batch, N, acc_dtype)
    if sinks is not None:
        sinks = jnp.broadcast_to(sinks, (*batch, N)).reshape(B, N).astype(acc_dtype)
    precision = call.precision
    if precision == "highest":
        precision = lax.Precision.HIGHEST
    scale = H**-0.5 if call.scale is None else float(call.scale)
    return Checked(
        batch=tuple(batch),
        T=T,
        S=S,
        N=N,
        K=K,
        H=H,
        Hv=Hv,
        query_positions=q_pos,
        key_positions=k_pos,
        lengths=lengths,
        q_seg=q_seg,
        k_seg=k_seg,
        sinks=sinks,
        rule=call.rule,
        scale=scale,
        softcap=call.logit_softcap,
        precision=precision,
    )


def _offset_rows(rows, batch, N, acc_dtype):
    """A kernel bias's rows [...,N,D] (any leading dims that broadcast to the batch, N or 1 heads) as the
    kernels' [B|1,N,D] in the compute dtype (B: rows that differ by batch entry, e.g. ALiBi's per-example
    slopes)."""
    rows = jnp.asarray(rows)
    D = rows.shape[-1]
    checks.check_broadcastable("position_bias", rows, (*batch, N, D), "[...,N,D]: the bias of each row of its index")
    if int(np.prod(rows.shape[:-2], dtype=np.int64)) > 1:
        rows = jnp.broadcast_to(rows, (*batch, N, D)).reshape(-1, N, D)
    else:
        rows = jnp.broadcast_to(rows.reshape(rows.shape[-2:]), (N, D))[None]
    return rows.astype(acc_dtype)


def padded_rows(call: Checked, Tp: int, Sp: int):
    """(q_pos [B|1,Tp], k_pos [B|1,Sp], lengths [B|1] or None, q_seg [B|1,Tp], k_seg [B|1,Sp]): positions and
    segment ids edge-padded, and lengths that mask the padding keys past S."""
    batch, T, S = call.batch, call.T, call.S
    q_pos, k_pos = _rows(call.query_positions, batch, T, Tp), _rows(call.key_positions, batch, S, Sp)
    lengths = call.lengths
    if lengths is None and Sp != S:
        lengths = jnp.full((1,), S, jnp.int32)  # the padding keys past S
    q_seg, k_seg = call.q_seg, call.k_seg
    if q_seg is not None:
        q_seg, k_seg = _rows(q_seg, batch, T, Tp), _rows(k_seg, batch, S, Sp)
        if q_seg.shape[0] != k_seg.shape[0]:
            B = max(q_seg.shape[0], k_seg.shape[0])
            q_seg, k_seg = (jnp.broadcast_to(x, (B, x.shape[1])) for x in (q_seg, k_seg))
    return q_pos, k_pos, lengths, q_seg, k_seg


class Prepared(NamedTuple):
    """The flash kernels' inputs for one call (prepare): q [B,Tp,N,Hp], k [B,Sp,K,Hp], v [B,Sp,K,Hvp]."""

    cfg: Config
    q: Any
    k: Any
    v: Any
    side: Side
    batch: tuple
    T: int
    N: int
    Hv: int
    value_rows: Any = None  # Shaw's value table, its band's rows [D,(N,)Hv] (tables_gpu), or None


def kernel_lse(p: Prepared, lse):
    """finish's inverse for lse: a public lse [...,N,T] (-inf for a row with no key) -> the kernels' [B,N,Tp] in
    the compute dtype, a row with no key at 0 (its pairs are all masked: p = 0 whatever lse is), padding rows 0."""
    B, N, T = p.q.shape[0], p.N, p.T
    lse = jnp.asarray(lse).reshape(B, N, T).astype(accumulation_dtype(p.q.dtype))
    return jnp.pad(jnp.where(jnp.isfinite(lse), lse, 0), [(0, 0), (0, 0), (0, p.cfg.Tn * p.cfg.Tb - T)])


def finish(p: Prepared, out, lse, return_lse: bool):
    """The kernel's out [B,Tp,N,Hvp] (or unpadded, [B,T,N,Hv]) and lse [B,N,Tp] -> the public result
    ([...,T,N,Hv], lse [...,N,T])."""
    batch, T, N, Hv = p.batch, p.T, p.N, p.Hv
    out = out[:, :T, :, :Hv].reshape(*batch, T, N, Hv)
    if return_lse:
        return out, public_lse(lse[..., :T].reshape(*batch, N, T))  # -inf for a row with no key
    return out


def _resolved_block_mask(call: AttentionCall, B: int, N: int, T: int, S: int):
    """(mask_mod, block_mask, block_size) of the call: a BlockMask checked against the shapes, its tiles the
    block_size the kernels take sub-tiles of (mask_sub_tiles), its own mask_mod the one that applies (resolve)."""
    mask_mod, block_mask, block_size = call.mask_mod, call.block_mask, call.block_size
    if block_mask is not None:
        block_masks.check_block_mask(block_mask, B, N, T, S)
        block_size = check_block_mask_tiles(block_mask, block_size)
        mask_mod, block_mask = block_masks.resolve(mask_mod, block_mask)
    return mask_mod, block_mask, block_size


def _tiles(call: AttentionCall, c: Checked, dtype, block_size, block_mask, blocks, Hp: int, Hvp: int, interpret):
    """(Tb, Sb, num_warps) of the call: a kernel's own tiles (blocks), sub-tiles of a BlockMask's tiles, or
    tile_sizes' for block_size or the defaults (a BlockMask's tiles win over a kernel's own)."""
    itemsize = np.dtype(dtype).itemsize
    # warps: GPU_TILES' for the head dim (with block_size or a BlockMask's tiles too); a kernel that passes its own
    # tiles (blocks) keeps the rule it was measured with, JAX's mha's: 4 up to head dim 64, else 8
    warps = gpu_tiles(max(Hp, Hvp), itemsize)[2]
    if blocks is not None:
        warps = 4 if max(Hp, Hvp) <= 64 else 8
    tables = call.has_tables or call.row_tables is not None
    T, S = c.T, c.S
    if blocks is not None and block_mask is None:
        Tb, Sb = blocks
    elif blocks is None and block_mask is not None:  # sub-tiles of the mask's tiles, by head dim as without it
        Tb, Sb = mask_sub_tiles(block_size, tile_sizes(None, T, S, max(Hp, Hvp), interpret, itemsize, tables))
    else:  # block_size, the defaults, or a kernel's own tiles under a BlockMask (the mask's tiles win)
        Tb, Sb = tile_sizes(block_size, T, S, max(Hp, Hvp), interpret, itemsize, tables)
        if block_size is None and not interpret and windowed_tables(call, T, S):  # the window's rows fit
            Tb, Sb = window_tiles(Tb, Sb, Hp)
    return Tb, Sb, warps


class _Terms(NamedTuple):
    """A call's position terms on the kernels' layout: Side's fields of these names (offset_bias, row_bias,
    column_map, key_row_bias, window_table) and Prepared.value_rows; None where the call has none."""

    offset_bias: Any = None
    row_bias: Any = None
    value_rows: Any = None
    column_map: Any = None
    key_row_bias: Any = None
    window_table: Any = None


def _offset_bias(call: AttentionCall, c: Checked, cfg: Config, terms: _Terms, acc_dtype):
    """(cfg, terms) with a position bias of j - i: its rows [B|1,N,D] and the index into them (Config.offset_bias);
    a KERNEL_BIASES in a static range (unsupported refuses any other)."""
    if call.position_bias is None:
        return cfg, terms
    rows, index = call.position_bias.kernel_table(c.T, c.S, default_positions(call))
    offset_rows = _offset_rows(rows, c.batch, c.N, acc_dtype)
    return cfg._replace(offset_bias=(index, offset_rows.shape[0] > 1)), terms._replace(offset_bias=offset_rows)


def _shaw_tables(call: AttentionCall, c: Checked, query, Tp: int, Hp: int, cfg: Config, terms: _Terms, acc_dtype):
    """(cfg, terms) with Shaw's tables within MAX_COLUMNS rows of reach: the key table's per-row terms q . A^K
    over its band's rows, and the value table's band rows (tables_gpu); or a key table alone on the windowed
    route (windowed_tables: the table itself, [Nt,R,Hp], windows_gpu). unsupported refuses the rest."""
    if not call.has_tables:
        return cfg, terms
    key_table, value_table, _ = blockwise.check_tables(
        call.key_table, call.value_table, call.max_distance, c.N, c.H, c.Hv, acc_dtype
    )
    if windowed_tables(call, c.T, c.S):
        per_head = key_table.ndim == 3
        window = windows_gpu.Window(cfg.Tb, cfg.Sb, int(call.max_distance), c.S - c.T, per_head)
        terms = terms._replace(window_table=windows_gpu.window_table(key_table, Hp, acc_dtype))
        return cfg._replace(window=window), terms
    band = tables_band(call, c.T, c.S)
    if key_table is not None:
        key_rows = tables_gpu.band_rows(key_table, band)
        terms = terms._replace(row_bias=tables_gpu.row_bias(query, key_rows, c.batch, Tp, band.D, band.Dp, c.precision))
    if value_table is not None:
        terms = terms._replace(value_rows=tables_gpu.band_rows(value_table, band))
    tables = Tables(band.lo, band.hi, band.Dp, key_table is not None, value_table is not None)
    return cfg._replace(tables=tables), terms


def _row_tables(call: AttentionCall, c: Checked, query, key, Tp: int, Sp: int, cfg: Config, terms: _Terms):
    """(cfg, terms) with DeBERTa's tables: the columns are the tables' R rows, read through the scheme's map
    (column_map); c2p's per-row terms q . Kr and p2c's per-key-row terms k . Qr (tables_gpu)."""
    tables = call.row_tables
    if tables is None:
        return cfg, terms
    Dp = tables_gpu.padded_columns(tables.rows)
    if tables.key_rows is not None:
        terms = terms._replace(
            row_bias=tables_gpu.row_bias(query, tables.key_rows, c.batch, Tp, tables.rows, Dp, c.precision)
        )
    if tables.query_rows is not None:
        terms = terms._replace(
            key_row_bias=tables_gpu.key_row_bias(key, tables.query_rows, c.N, c.batch, Sp, Dp, c.precision)
        )
    terms = terms._replace(column_map=tables_gpu.column_map(tables.row_of_offset))
    key_rows, query_rows = tables.key_rows is not None, tables.query_rows is not None
    return cfg._replace(tables=Tables(tables.lo, tables.hi, Dp, key_rows, False, True, query_rows)), terms


def _side(padded, sinks, score_consts, mask_consts, schedule, terms: _Terms) -> Side:
    """The arrays beside q, k, v every flash kernel reads (Side): the padded positions, lengths and segment ids
    (padded_rows), sinks, the mods' consts, the schedules (schedules) and the position terms."""
    q_pos, k_pos, lengths, q_seg, k_seg = padded
    order, counts, t_order, t_counts = schedule
    return Side(
        q_pos=q_pos,
        k_pos=k_pos,
        lengths=lengths,
        q_seg=q_seg,
        k_seg=k_seg,
        sinks=sinks,
        score_consts=score_consts,
        mask_consts=mask_consts,
        order=order,
        counts=counts,
        t_order=t_order,
        t_counts=t_counts,
        offset_bias=terms.offset_bias,
        row_bias=terms.row_bias,
        column_map=terms.column_map,
        key_row_bias=terms.key_row_bias,
        window_table=terms.window_table,
    )


def _layout(c: Checked, cfg: Config, query, key, value, Tp: int, Sp: int, Hp: int, Hvp: int, unpadded: bool):
    """(cfg, q, k, v) in the kernels' layout: the caller's arrays, the kernels masking the tiles that run past T,
    S, H, Hv (cfg.extents; tile_math.read, write), or padded with zeros to whole tiles and the padded head dims."""
    batch, T, S, H, Hv = c.batch, c.T, c.S, c.H, c.Hv
    if unpadded:  # no copies
        cfg = cfg._replace(extents=Extents(T, S, H, Hv, Hp, Hvp))
        q = kernel_layout(query, batch, T, T, H)
        k, v = kernel_layout(key, batch, S, S, H), kernel_layout(value, batch, S, S, Hv)
    else:
        q = kernel_layout(query, batch, T, Tp, Hp)
        k, v = kernel_layout(key, batch, S, Sp, Hp), kernel_layout(value, batch, S, Sp, Hvp)
    return cfg, q, k, v


def prepare(
    call: AttentionCall, query, key, value, interpret, blocks=None, head_multiple=None, unpadded=False
) -> Prepared:
    """Checks, tiles, layout and key-tile schedules of one call for the flash kernels (forward_kernel's
    inputs). blocks: (Tb, Sb) instead of tile_sizes' (a BlockMask's tiles still win; without blocks the kernels
    take sub-tiles of them, mask_sub_tiles); head_multiple: pad
    head dims to a multiple of it (a TPU's lane width) rather than to a power of two; unpadded: q, k, v as
    the caller's arrays (cfg.extents: the kernels mask what runs past them; the GPU flash kernels), else
    padded with zeros to whole tiles and the padded head dims."""
    c = checked(call, query, key, value)
    batch, T, S, N, K, H, Hv = c.batch, c.T, c.S, c.N, c.K, c.H, c.Hv
    B = int(np.prod(batch, dtype=np.int64))
    acc_dtype = accumulation_dtype(query.dtype)
    mask_mod, block_mask, block_size = _resolved_block_mask(call, B, N, T, S)
    if head_multiple is None:
        Hp, Hvp = padded_head(H, interpret), padded_head(Hv, interpret)
    else:
        Hp, Hvp = (-(-x // head_multiple) * head_multiple for x in (H, Hv))
    Tb, Sb, warps = _tiles(call, c, query.dtype, block_size, block_mask, blocks, Hp, Hvp, interpret)
    Tn, Sn = -(-T // Tb), -(-S // Sb)
    Tp, Sp = Tn * Tb, Sn * Sb
    padded = padded_rows(c, Tp, Sp)
    q_pos, k_pos, lengths, q_seg, k_seg = padded
    score_fn = mods.element_function("score_mod", call.score_mod, acc_dtype)
    mask_fn = mods.element_function("mask_mod", mask_mod)
    tile_kinds = None
    if block_mask is not None:
        ratios = (block_size[0] // Tb, block_size[1] // Sb)
        tile_kinds = sub_tile_kinds(block_masks.tile_kinds(block_mask).astype(jnp.int32), ratios, Tn, Sn)
    score_consts = () if score_fn is None else tuple(jnp.asarray(x) for x in score_fn.consts)
    mask_consts = () if mask_fn is None else tuple(jnp.asarray(x) for x in mask_fn.consts)

    Bs = max([1] + [x.shape[0] for x in (q_pos, k_pos, lengths, q_seg, tile_kinds) if x is not None])
    cfg = Config(
        Tb=Tb,
        Sb=Sb,
        Tn=Tn,
        Sn=Sn,
        N=N,
        K=K,
        rule=c.rule,
        scale=c.scale,
        softcap=c.softcap,
        score_fn=None if score_fn is None else score_fn.fn,
        mask_fn=None if mask_fn is None else mask_fn.fn,
        score_grads=mods.differentiable(score_consts),
        n_mask_consts=len(mask_consts),
        batched=(),
        head_kinds=tile_kinds is not None and tile_kinds.shape[1] > 1,
        precision=c.precision,
        interpret=bool(interpret),
        num_warps=warps,
    )
    schedule = schedules(cfg, Bs, q_pos, k_pos, lengths, q_seg, k_seg, tile_kinds, not default_positions(call))
    counts = schedule[1]  # (order, counts, t_order, t_counts): batched says which arrays differ by batch entry
    cfg = cfg._replace(batched=tuple(x is not None and x.shape[0] > 1 for x in (q_pos, k_pos, q_seg, lengths, counts)))
    cfg, terms = _offset_bias(call, c, cfg, _Terms(), acc_dtype)
    cfg, terms = _shaw_tables(call, c, query, Tp, Hp, cfg, terms, acc_dtype)
    cfg, terms = _row_tables(call, c, query, key, Tp, Sp, cfg, terms)
    side = _side(padded, c.sinks, score_consts, mask_consts, schedule, terms)
    cfg, q, k, v = _layout(c, cfg, query, key, value, Tp, Sp, Hp, Hvp, unpadded)
    return Prepared(cfg, q, k, v, side, batch, T, N, Hv, terms.value_rows)
