"""Flash attention for GPU: a Pallas kernel (Triton lowering), forward and FlashAttention-2 backward.

    forward, grid (b, n, query tile i): tile_body.forward_kernel
    dq, grid (b, n, i): p = exp(x - lse) recomputed, ds = p (dO V^T - delta), dq_i = sum_j scale ds k_j
    dk/dv, grid (b, key head kh, key tile j): over the G query heads of kh and the query tiles that see j,
        dv_j += p^T dO, dk_j += scale ds^T q                        (delta = rowsum(dO * out) - d lse)

The semantics are blockwise_attention's (its docstring), and every rule is _core's: which pairs may attend
(masks.allowed_pairs, on the tile's positions), which key tiles a query tile visits and whether they need
a mask (masks.key_block_kinds, computed per (batch, head, query tile) before the kernel, sorted into a
schedule: WITH_MOD tiles, then MASKED, then CLEAN, then skipped ones), the online-softmax merge and sinks
(softmax.combine_partials, add_sinks, finalize_partial), softcap (mods.softcap / softcap_grad), and
score_mod / mask_mod (mods.element_function traced once; mods.on_tile calls them on the tile's iota grids;
the arrays they close over are explicit kernel inputs, and the float ones get gradients: partial sums per
(b, n, query tile) from the dq kernel, added up outside), a position bias read from a small table at an
index of the pair (offset_bias.KERNEL_BIASES: T5 and ALiBi at j - i, Swin's and BEiT's windows at the 2D
offset): its rows [B|1,N,D] computed outside, gathered per tile at the bias's index of the tile's positions
(tile_body.offset_index), their gradient scattered back by index from the dq kernel with atomic adds
(docs/kernels.md, "Position biases in the kernel"), and Shaw tables (offset_tables): q . key_table per query
row computed outside and gathered per tile at clip(j - i), the forward's sums of p by table row for the value
table, and in the backward the value term's dP gathered the same way and the key term's gradient added by
column from the dq kernel (docs/kernels.md, "Shaw tables in the kernel"), and DeBERTa's tables (row_tables:
the same key term at a column read from the scheme's map of offsets to table rows, and a per-key-row term
k . Qr computed outside, gathered per tile, its gradient added by column from the dk/dv kernel; docs/kernels.md,
"DeBERTa's disentangled tables in the kernel"). Per-pair tables (relative_attention's rel_key / rel_value)
run in pair_tables' kernels on this module's grids, layout, schedules and input specs (row_inputs,
key_tile_inputs); this one refuses them.

Layout: q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv] as the caller's (batch dims flattened, nothing padded or
copied): a BlockSpec picks one head's [Tb,Hp] tile, whole tiles and head dims padded to powers of two
(Triton's loads need them), and query head n reads key/value head n // G (G = N // K) through its index map,
so grouped-query attention never copies keys or values. A tile that runs past T, S, H or Hv reads zeros
there and writes nothing (tile_body.read / write, masked loads and stores: Config.extents); the kernels'
own arrays (positions, segment ids, schedules, lse, delta) span whole tiles. Keys past S are masked as past
the length; query rows past T are computed on zeros and never stored.

The surface: `unsupported(call, query, key, value, interpret)` (the first option of the AttentionCall the
kernel cannot express, or None) and `run(call, query, key, value, interpret)` (a call it expresses).
Package-internal, for the kernels that share this one's checks, layout and schedules (decode_gpu,
flex_tpu): prepare / finish, and the helpers decode_gpu builds its own grid from (checked, padded_rows,
kernel_layout, key_tile_kinds, sorted_kinds, tile_sizes, named_call). `interpret=True` runs the same kernels
with Pallas' interpreter on any platform (the CPU tests).
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, NamedTuple, Optional

import jax
import jax.core  # jax.core.Tracer: a submodule, imported by name so that type checkers see it
import jax.numpy as jnp
import jax.ref  # jax.ref.addupdate (the scatter-add of the position bias's gradient): a submodule, as jax.core
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._core import block_mask as block_masks, checks, mods
from .._core.call import AttentionCall
from .._core.dtypes import accumulation_dtype
from .._core.masks import (
    CLEAN,
    MASKED,
    WITH_MOD,
    MaskRule,
    check_lengths,
    key_block_kinds,
    masks_anything,
    tile_runs,
)
from .._core.offset_bias import KERNEL_BIASES
from .._core.positions import positions
from .._core.softmax import has_keys, public_lse
from .._engines import blockwise
from .._engines.tiles import check_block_mask_tiles
from . import offset_tables
from .flash.refs import DkvHooks, DqHooks, Refs, bind
from .tile_body import (
    Config,
    Extents,
    Side,
    Tables,
    add_by_column,
    add_by_key_column,
    allowed_in_tile,
    apply_score_mod,
    capped_logits,
    dot,
    fill_rows,
    forward_kernel,
    key_row_term_in,
    key_term_in,
    load,
    load_all,
    offset_bias_tile,
    offset_index,
    pick,
    pick_rows,
    program_schedule,
    read,
    schedule,
    table_column,
    table_logits,
    tile_keys,
    tile_rows,
    value_term_in,
    visit,
    write,
)

# Tiles and warps on a GPU: (Tb queries, Sb keys, num_warps) by the inputs' bytes per element and the largest
# padded head dim of a row (head dims up to 64, 128, 256); one choice for the forward, dq and dk/dv kernels, which
# share the key-tile schedules computed for one tile pair. Chosen from `ptxas -v` on the three kernels compiled for
# an H100 (sm_90a) and an A100 (sm_80) (.ci/ptxas_report.py; docs/kernels.md, "Tiles per head dim"; no GPU here to
# time them): tiles that spill no registers on either and fit both's shared memory, 128-row query tiles where that
# holds (wgmma's shape on the H100; 128 x 64 spilled in the A100's forward at head dims 65-128). One exception:
# the float32 dk/dv kernel at 129-256 spills at every tile size tried (ptxas drops it to 32 registers and a stack
# frame); 16 x 16 spills least. 8 warps throughout: 4 spilled at 128 x 64, head dim 64. Powers of two of at least
# 16, as Triton's dot needs.
GPU_TILES = {
    2: {64: (128, 64, 8), 128: (128, 32, 8), 256: (32, 64, 8)},
    4: {64: (32, 32, 8), 128: (16, 64, 8), 256: (16, 16, 8)},
}
# Calls with Shaw's or DeBERTa's per-row tables (Tables) load [Tb,Dp] blocks of them per tile: at most 64 query
# rows there above head dim 64. 128 x 64 asked 247808 bytes of shared memory at head dim 128 bf16 forward+backward
# on the H100 (232448 available; the compile grid's "shaw causal"); 64 x 64 compiled, and so did 128 x 64 at head
# dim 64 (Shaw and DeBERTa, H100 and A100).
TABLES_MAX_QUERY_TILE = 64
# The interpreter takes any size: 16 x 16 keeps interpret-mode tests quick.
INTERPRET_BLOCK = 16
MIN_GPU_BLOCK = 16
MAX_HEAD_DIM = 256

# The options these kernels express; anything else in use (the full-grid options; per-pair tables: pair_tables'
# kernels) is the XLA engines'. A position_bias only as one of offset_bias.KERNEL_BIASES (position_bias_refusal);
# Shaw tables (key_table, value_table, max_distance) within offset_tables.MAX_COLUMNS rows of reach (tables_refusal).
HANDLED = (
    "is_causal",
    "key_value_seq_lengths",
    "query_positions",
    "key_positions",
    "query_segment_ids",
    "key_segment_ids",
    "window",
    "chunk_size",
    "mask_mod",
    "block_mask",
    "scale",
    "logit_softcap",
    "sinks",
    "score_mod",
    "position_bias",
    "key_table",
    "value_table",
    "max_distance",
    "row_tables",
    "return_lse",
    "precision",
    "block_size",
)


# ---------------------------------------------------------------------------------------------------
# What the kernel can express.


def is_power_of_two(n) -> bool:
    return isinstance(n, numbers.Integral) and n > 0 and (n & (n - 1)) == 0


def _block_pair(block_size):
    if block_size is None:
        return None
    return (block_size, block_size) if isinstance(block_size, numbers.Integral) else tuple(block_size)


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


def tables_band(call: AttentionCall, T: int, S: int) -> Optional[offset_tables.Band]:
    """The band of Shaw table rows the call reads (offset_tables.band), or None without tables."""
    if not call.has_tables or call.max_distance is None:  # no max_distance: prepare's check names it
        return None
    return offset_tables.band(call.max_distance, T, S, default_positions(call))


def row_tables_refusal(call: AttentionCall) -> Optional[str]:
    """None when the kernels take the call's row_tables (none, or R rows within offset_tables.MAX_COLUMNS,
    without Shaw tables beside them); else what refuses it."""
    tables = call.row_tables
    if tables is None:
        return None
    if call.has_tables:
        return "key_table / value_table (beside row_tables)"
    if offset_tables.padded_columns(tables.rows) > offset_tables.MAX_COLUMNS:
        return (
            f"position_keys / position_queries ({tables.rows} table rows > {offset_tables.MAX_COLUMNS}: the XLA "
            "engines)"
        )
    return None


def unsupported(call: AttentionCall, query, key, value, interpret=False) -> Optional[str]:
    """None when run() computes this call; else the name of the first option it cannot express.

    Cheap (shapes and Python values only). Shaw tables reaching more than offset_tables.MAX_COLUMNS rows
    (max_distance), DeBERTa's row_tables of more rows than that (row_tables_refusal), a position_bias that is
    not one of offset_bias.KERNEL_BIASES (T5's, ALiBi's and window_attention's are; position_bias_refusal),
    per-pair tables (rel_key, rel_value: pair_tables' kernels, through pallas_gpu) and the full-grid options
    (bias, mask, dropout_rate, return_weights) are the XLA engines'. On a GPU (interpret=False) tiles must be
    powers of two >= 16 (block_size, a BlockMask's tiles), head dims at most 256, inputs at most 32-bit floats,
    scale a Python number, and score_mod / mask_mod must close over no array (Triton cannot index one by head or
    position).
    """
    T, S = (np.shape(x)[-3] if np.ndim(x) >= 3 else 0 for x in (query, key))
    problem = call.first_unhandled(HANDLED) or position_bias_refusal(call, T, S) or row_tables_refusal(call)
    if problem is not None:
        return problem
    band = tables_band(call, *(np.shape(x)[-3] if np.ndim(x) >= 3 else 1 for x in (query, key)))
    if band is not None and offset_tables.columns_refusal(band) is not None:
        return offset_tables.columns_refusal(band)
    scale = call.scale
    if (
        scale is not None
        and not isinstance(scale, numbers.Real)
        and (isinstance(scale, jax.core.Tracer) or np.ndim(scale) != 0)
    ):
        return "scale"
    if interpret:
        return None
    if np.dtype(getattr(query, "dtype", np.float32)).itemsize > 4:
        return "dtype"
    if max(np.shape(query)[-1:] + np.shape(value)[-1:], default=0) > MAX_HEAD_DIM:
        return "head_dim"
    pair = _block_pair(call.block_size)
    if pair is not None and not all(is_power_of_two(b) and b >= MIN_GPU_BLOCK for b in pair):
        return "block_size"
    block_mask = call.block_mask
    if block_mask is not None:
        tiles_ok = all(is_power_of_two(b) and b >= MIN_GPU_BLOCK for b in getattr(block_mask, "block_size", ()))
        if not tiles_ok or getattr(block_mask, "mask_consts", ()):  # mask_consts: as a mask_mod's, below
            return "block_mask"
    for name in ("score_mod", "mask_mod"):
        fn = getattr(call, name)
        if fn is not None and callable(fn):
            score_dtype = accumulation_dtype(getattr(query, "dtype", jnp.float32)) if name == "score_mod" else None
            traced = mods.element_function(name, fn, score_dtype)
            if traced.consts:
                return name
    return None


# ---------------------------------------------------------------------------------------------------
# The backward kernels: one [Tb,Sb] tile.


def _row_grads(cfg, x, lse, allowed, do, v, delta, dp_table=None):
    """(p, ds) of one tile: p recomputed from the saved lse, ds = d loss / d x = p (dp - delta) with
    dp = dO v^T (+ dp_table: Shaw's value term, dP picked at each pair's column). lse and delta: [Tb], or
    [Tb,1] (the TPU layout's columns)."""
    lse, delta = lse.reshape(-1, 1), delta.reshape(-1, 1)
    p = jnp.exp(x - jnp.where(has_keys(lse), lse, 0))  # a row with no allowed key: p masked to 0
    if allowed is not None:
        p = jnp.where(allowed, p, 0)
    dp = dot(do, v, cfg, (1, 1))
    if dp_table is not None:
        dp = dp + dp_table
    return p, p * (dp - delta)


def _table_terms(cfg, r: Refs, qp, kp, rows, keys, head=None):
    """(column, key terms, value term's dp) of one tile for Shaw / DeBERTa tables (each None where the call
    has none): rows / keys / head: where the tile's query rows sit in the row_bias / d_row_sums blocks
    (tile_body.tile_rows) and its key rows in the key_row_bias block (tile_body.tile_keys)."""
    if cfg.tables is None:
        return None, None, None
    column = table_column(cfg, r, qp, kp)
    key_term = table_logits(cfg, r, column, rows, keys, head)
    dp_table = pick_rows(r.d_row_sums, rows, column, head) if cfg.tables.value_term else None
    return column, key_term, dp_table


def _logit_grads(cfg, b, n, qp, kp, capped, bias, score_consts, ds_for, with_consts):
    """Run the tile backward from the capped logits: returns (p, d loss / d (scale q k^T), d float consts,
    d loss / d bias).

    bias: the tile's position bias (or None), added to the capped logits before score_mod. ds_for(x) ->
    (p, ds) at the final logits x; the score_mod's vjp and softcap's derivative take ds back to the product
    q k^T (times scale: the scale applies to ds here, once)."""
    d_consts = None
    if bias is not None:
        capped_and_biased = capped + bias
    else:
        capped_and_biased = capped
    if cfg.score_fn is None:
        p, ds = ds_for(capped_and_biased)
    else:
        floats = tuple(c for c, g in zip(score_consts, cfg.score_grads) if g)

        def score(x, floats):
            it = iter(floats)
            consts = tuple(next(it) if g else c for c, g in zip(score_consts, cfg.score_grads))
            return apply_score_mod(cfg, b, n, qp, kp, x, consts)

        if with_consts:
            x, score_vjp = jax.vjp(score, capped_and_biased, floats)
        else:  # the dk/dv kernel: the consts' gradients come from the dq kernel
            x, vjp_x = jax.vjp(lambda x: score(x, floats), capped_and_biased)
            score_vjp = lambda ds: (vjp_x(ds)[0], None)  # noqa: E731
        p, ds = ds_for(x)
        ds, d_consts = score_vjp(ds)
    d_bias = ds  # the bias enters the logits as it is
    if cfg.softcap is not None:
        ds = ds * mods.softcap_grad(capped, cfg.softcap)
    return p, ds * cfg.scale, d_consts, d_bias


def _scatter_by_offset(ref, index, d_bias):
    """ref[index] += d_bias ([Tb,Sb] into the rows [D] of one head): d rows[r] is the sum of d loss / d bias
    over the pairs that read row r (an offset for T5 / ALiBi, a 2D offset in a window for Swin / BEiT). The
    Triton lowering turns the scatter-add into atomic float adds (programs of every query tile add into the
    same rows, pairs of one tile into the same row), so the order of each sum,
    and its last bits, vary from run to run on a GPU; the interpreter adds in a fixed order.

    A tile whose pairs all read one row (T5 past the saturation, 2 max_distance: most tiles of a long
    sequence) adds its sum there once: one atomic where the scatter would send Tb x Sb to one address."""
    d_bias = d_bias.astype(ref.dtype)
    first = jnp.min(index)
    one_row = first == jnp.max(index)

    @pl.when(one_row)
    def _():
        jax.ref.addupdate(ref, first, jnp.sum(d_bias))

    @pl.when(jnp.logical_not(one_row))
    def _():
        jax.ref.addupdate(ref, index, d_bias)


def dq_kernel(cfg: Config, r: Refs, hooks: DqHooks = DqHooks()):
    """dq of one (b, n, query tile); also the TPU backward's (tpu_backward, through its views of the refs and
    its hooks)."""
    b, n = pl.program_id(0), pl.program_id(1)
    row0 = 0 if cfg.extents is None else pl.program_id(2) * cfg.Tb  # the query tile's first row
    q, do = read(cfg, r.q, "q", row0), read(cfg, r.do, "do", row0)
    qp, q_seg, lengths = r.q_pos[...], load(r.q_seg), load(r.lengths)
    lse, delta = r.lse[...], r.delta[...]
    score_consts, mask_consts = load_all(r.score_consts), load_all(r.mask_consts)
    acc_dtype = accumulation_dtype(q.dtype)
    key_grad = key_term_in(cfg)
    if key_grad:
        fill_rows(r.d_row_bias)

    def key_tile(kind, j, carry):
        dq, d_consts = carry
        s0 = pl.multiple_of(j * cfg.Sb, cfg.Sb)  # aligned: a TPU's dynamic slices need it
        keys = pl.ds(s0, cfg.Sb)
        k, v = (read(cfg, ref, name, s0, (keys, slice(None))) for name, ref in (("k", r.k), ("v", r.v)))
        kp = r.k_pos[keys]
        k_seg = None if q_seg is None else r.k_seg[keys]
        allowed = allowed_in_tile(cfg, kind, b, n, qp, kp, s0, lengths, q_seg, k_seg, mask_consts)
        index = bias = None
        if cfg.offset_bias is not None and hooks.bias_of_key_tile is not None:  # tpu_backward's: no gather
            bias = hooks.bias_of_key_tile(j)
        elif cfg.offset_bias is not None:
            index = offset_index(cfg, qp, kp)
            bias = offset_bias_tile(r.offset_bias, index)
        column, key_term, dp_table = _table_terms(cfg, r, qp, kp, tile_rows(cfg), tile_keys(cfg, s0))
        if hooks.table_terms_of_key_tile is not None:  # the kernel's own (tpu_backward)
            key_term, dp_table = hooks.table_terms_of_key_tile(j, k)
        p, ds, d_c, d_bias = _logit_grads(
            cfg,
            b,
            n,
            qp,
            kp,
            capped_logits(cfg, q, k, key_term),
            bias,
            score_consts,
            lambda x: _row_grads(cfg, x, lse, allowed, do, v, delta, dp_table),
            True,
        )
        dq = dq + dot(ds.astype(k.dtype), k, cfg)
        if d_c is not None:
            d_consts = tuple(a + g.astype(a.dtype) for a, g in zip(d_consts, d_c))
        if index is not None:
            _scatter_by_offset(r.d_offset_bias, index, d_bias)
        elif bias is not None:  # the kernel's own adds of the tile's gradient into its rows (tpu_backward)
            hooks.add_bias_grad(j, d_bias)
        if key_grad:  # d QA[t, c] = the sum of d loss / d (q k^T + QA) over the pairs of row t in column c
            add_by_column(r.d_row_bias, column, ds)
        if hooks.add_table_grads is not None:  # the kernel's own sums of the tables' gradients (tpu_backward)
            hooks.add_table_grads(j, k, p, ds)
        return dq, d_consts

    floats = tuple(c for c, g in zip(score_consts, cfg.score_grads) if g)
    init = (jnp.zeros(q.shape, acc_dtype), tuple(jnp.zeros(c.shape, acc_dtype) for c in floats))
    dq, d_consts = visit(cfg, program_schedule(r), key_tile, init)
    if hooks.finish_dq is not None:  # dq's share of the tables' terms, summed over the tiles (tpu_backward)
        dq = hooks.finish_dq(dq)
    write(cfg, r.dq, "dq", dq, row0)
    for ref, d in zip(r.d_score, d_consts):
        ref[...] = d


def dkv_kernel(cfg: Config, r: Refs, hooks: DkvHooks = DkvHooks()):
    """dk, dv of one (b, key head, key tile) (r.order / r.counts: the schedule over query tiles, a row per query
    head of the group when cfg.head_kinds); also the TPU backward's (tpu_backward, with its hooks)."""
    b, kh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    G = cfg.N // cfg.K
    s0 = j * cfg.Sb
    k, v = read(cfg, r.k, "k", s0), read(cfg, r.v, "v", s0)
    kp, k_seg, lengths = r.k_pos[...], load(r.k_seg), load(r.lengths)
    score_consts, mask_consts = load_all(r.score_consts), load_all(r.mask_consts)
    acc_dtype = accumulation_dtype(k.dtype)

    def query_tile(g, kind, i, carry):
        dk, dv = carry
        n = kh * G + g
        t0 = pl.multiple_of(i * cfg.Tb, cfg.Tb)  # aligned: a TPU's dynamic slices need it
        rows = pl.ds(t0, cfg.Tb)
        q, do = (read(cfg, ref, name, t0, (rows, g, slice(None))) for name, ref in (("q", r.q), ("do", r.do)))
        lse, delta, qp = r.lse[g, rows], r.delta[g, rows], r.q_pos[rows]
        q_seg = None if k_seg is None else r.q_seg[rows]
        allowed = allowed_in_tile(cfg, kind, b, n, qp, kp, s0, lengths, q_seg, k_seg, mask_consts)
        bias = None
        if cfg.offset_bias is not None and hooks.bias_of_query_tile is not None:  # tpu_backward's
            bias = hooks.bias_of_query_tile(g, i)
        elif cfg.offset_bias is not None:  # the rows of the G heads of key head kh: this head's is row g
            bias = offset_bias_tile(r.offset_bias, offset_index(cfg, qp, kp), g)
        column, key_term, dp_table = _table_terms(cfg, r, qp, kp, tile_rows(cfg, i * cfg.Tb), tile_keys(cfg), g)
        if hooks.table_terms_of_query_tile is not None:  # the kernel's own (tpu_backward)
            key_term, dp_table = hooks.table_terms_of_query_tile(g, i, q, do)
        p, ds, _, _ = _logit_grads(
            cfg,
            b,
            n,
            qp,
            kp,
            capped_logits(cfg, q, k, key_term),
            bias,
            score_consts,
            lambda x: _row_grads(cfg, x, lse, allowed, do, v, delta, dp_table),
            False,
        )
        dv = dv + dot(p.astype(do.dtype), do, cfg, (0, 0))
        dk = dk + dot(ds.astype(q.dtype), q, cfg, (0, 0))
        if hooks.dk_of_query_tile is not None:  # the kernel's own per-key-row term's share (tpu_backward: p2c)
            dk = dk + hooks.dk_of_query_tile(g, i, ds).astype(dk.dtype)
        if key_row_term_in(cfg):  # d KB[s, c] = the sum of d loss / d (q k^T + KB) over the queries of key s in c
            add_by_key_column(r.d_key_row_bias, column, ds, g)
        return dk, dv

    def query_head(g, carry):  # one query head sharing key/value head kh
        h = g if cfg.head_kinds else 0
        order = None if r.order is None else lambda idx: r.order[h, idx]  # absent: runs (schedule)
        steps = schedule(lambda k: r.counts[h, k], order)
        return visit(cfg, steps, functools.partial(query_tile, g), carry)

    carry = (jnp.zeros(k.shape, acc_dtype), jnp.zeros(v.shape, acc_dtype))
    if hooks.query_head is not None:  # one query head per program, the grid's (tpu_backward: its dk, dv views sum)
        carry = query_head(hooks.query_head, carry)
    else:  # A loop in the kernel, not unrolled in Python: unrolled, Triton compiled G copies of the tile loops
        # (compile time grew with G: 38 s at G = 8, over 600 s for MQA with 32 heads).
        carry = query_head(0, carry) if G == 1 else lax.fori_loop(0, G, query_head, carry)
    write(cfg, r.dk, "dk", carry[0], s0)
    write(cfg, r.dv, "dv", carry[1], s0)


# ---------------------------------------------------------------------------------------------------
# pallas_call plumbing: named inputs, each with its BlockSpec.


def named_call(cfg, kernel, grid, inputs, outputs, name, aliases=None, num_stages=2):
    """pallas_call of kernel(cfg, refs by name); inputs / outputs: {name: (array or ShapeDtypeStruct, spec)},
    None values left out; aliases: {input name: output name}, the output starting as that input's values;
    num_stages: Triton's software pipelining of the tile loops' loads (each stage a copy in shared memory)."""
    inputs = {k: v for k, v in inputs.items() if v is not None}
    aliases = aliases or {}
    # an aliased input only seeds its output's values: the kernel reads the output (no name, bind skips it)
    names = tuple(None if name in aliases else name for name in inputs) + tuple(outputs)
    aliases = {tuple(inputs).index(i): tuple(outputs).index(o) for i, o in aliases.items()}

    def body(*refs):
        kernel(cfg, bind(names, refs, Refs))

    return pl.pallas_call(
        body,
        grid=grid,
        in_specs=[spec for _, spec in inputs.values()],
        out_specs=[spec for _, spec in outputs.values()],
        out_shape=[shape for shape, _ in outputs.values()],
        input_output_aliases=aliases,
        interpret=cfg.interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=num_stages),
        name=name,
    )(*[x for x, _ in inputs.values()])


def _whole(x):
    """Every program reads all of x (a score_mod / mask_mod const)."""
    return x, pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def row_inputs(cfg, side, Hp, Hvp):
    """Inputs shared by the forward and dq kernels (grid b, n, i): positions, lengths, segments, consts,
    the forward schedule; q / k / v specs."""
    G = cfg.N // cfg.K
    bq, bk, bs, bl, bsched = cfg.batched
    Sp = cfg.Sn * cfg.Sb
    inputs = {
        "q_pos": (side.q_pos, pl.BlockSpec((None, cfg.Tb), lambda b, n, i: (pick(bq, b), i))),
        "k_pos": (side.k_pos, pl.BlockSpec((None, Sp), lambda b, n, i: (pick(bk, b), 0))),
        "lengths": None
        if side.lengths is None
        else (side.lengths, pl.BlockSpec((None,), lambda b, n, i: (pick(bl, b),))),
        "q_seg": None
        if side.q_seg is None
        else (side.q_seg, pl.BlockSpec((None, cfg.Tb), lambda b, n, i: (pick(bs, b), i))),
        "k_seg": None
        if side.k_seg is None
        else (side.k_seg, pl.BlockSpec((None, Sp), lambda b, n, i: (pick(bs, b), 0))),
        "order": None
        if side.order is None  # a compact schedule: runs in counts
        else (
            side.order,
            pl.BlockSpec((None, None, None, cfg.Sn), lambda b, n, i: (pick(bsched, b), pick(cfg.head_kinds, n), i, 0)),
        ),
        "counts": (
            side.counts,
            pl.BlockSpec((None, None, None, 4), lambda b, n, i: (pick(bsched, b), pick(cfg.head_kinds, n), i, 0)),
        ),
    }
    inputs.update(consts_inputs(side))
    if side.offset_bias is not None:  # the rows of head n: [D]
        batched, D = cfg.offset_bias[1], side.offset_bias.shape[-1]
        spec = pl.BlockSpec((None, None, D), lambda b, n, i: (pick(batched, b), n, 0))
        inputs["offset_bias"] = (side.offset_bias, spec)
    if side.row_bias is not None:  # Shaw's key term: the block of this tile's query rows, [Tb,Dp]
        inputs["row_bias"] = (side.row_bias, _row_block(cfg, side.row_bias))
    if side.column_map is not None:
        inputs["column_map"] = _whole(side.column_map)
    if side.key_row_bias is not None:  # the per-key-row term: every key row of head n, [Sp,Dp]
        x = side.key_row_bias
        inputs["key_row_bias"] = (x, pl.BlockSpec((None, None, Sp, x.shape[-1]), lambda b, n, i: (b, n, 0, 0)))
    specs = dict(
        q=pl.BlockSpec((None, cfg.Tb, None, Hp), lambda b, n, i: (b, i, n, 0)),
        k=pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0)),
        v=pl.BlockSpec((None, Sp, None, Hvp), lambda b, n, i: (b, 0, n // G, 0)),
    )
    return inputs, specs


def key_tile_inputs(cfg, side, q, k, v, d_out, lse, delta):
    """The dk/dv kernel's inputs on grid (b, key head h, key tile j) besides the terms' own: every query row of
    the G query heads of h (q, d_out, lse, delta, positions, segments), the key tile (k, v, positions,
    segments), lengths, the transposed schedule and the score_mod / mask_mod consts."""
    G = q.shape[2] // v.shape[2]
    Tp, Hp, Hvp = block_dims(cfg, q, v)
    bq, bk, bs, bl, bsched = cfg.batched
    heads = G if cfg.head_kinds else 1
    inputs = {
        "q": (q, pl.BlockSpec((None, Tp, G, Hp), lambda b, h, j: (b, 0, h, 0))),
        "do": (d_out, pl.BlockSpec((None, Tp, G, Hvp), lambda b, h, j: (b, 0, h, 0))),
        "lse": (lse, pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0))),
        "delta": (delta, pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0))),
        "k": (k, pl.BlockSpec((None, cfg.Sb, None, Hp), lambda b, h, j: (b, j, h, 0))),
        "v": (v, pl.BlockSpec((None, cfg.Sb, None, Hvp), lambda b, h, j: (b, j, h, 0))),
        "q_pos": (side.q_pos, pl.BlockSpec((None, Tp), lambda b, h, j: (pick(bq, b), 0))),
        "k_pos": (side.k_pos, pl.BlockSpec((None, cfg.Sb), lambda b, h, j: (pick(bk, b), j))),
        "lengths": None
        if side.lengths is None
        else (side.lengths, pl.BlockSpec((None,), lambda b, h, j: (pick(bl, b),))),
        "q_seg": None
        if side.q_seg is None
        else (side.q_seg, pl.BlockSpec((None, Tp), lambda b, h, j: (pick(bs, b), 0))),
        "k_seg": None
        if side.k_seg is None
        else (side.k_seg, pl.BlockSpec((None, cfg.Sb), lambda b, h, j: (pick(bs, b), j))),
        "order": None  # the transposed schedule, over query tiles
        if side.t_order is None
        else (
            side.t_order,
            pl.BlockSpec((None, heads, None, cfg.Tn), lambda b, h, j: (pick(bsched, b), pick(cfg.head_kinds, h), j, 0)),
        ),
        "counts": (
            side.t_counts,
            pl.BlockSpec((None, heads, None, 4), lambda b, h, j: (pick(bsched, b), pick(cfg.head_kinds, h), j, 0)),
        ),
    }
    inputs.update(consts_inputs(side))
    return inputs


def consts_inputs(side) -> dict:
    """The score_mod / mask_mod consts, whole to every program (Refs.score_consts, Refs.mask_consts)."""
    inputs = {f"score_consts{c}": _whole(x) for c, x in enumerate(side.score_consts)}
    inputs.update({f"mask_consts{c}": _whole(x) for c, x in enumerate(side.mask_consts)})
    return inputs


def key_tile_outputs(cfg, k, v):
    """The dk/dv kernel's outputs dk, dv on grid (b, key head h, key tile j): the key tile's rows of k's and v's
    shapes and dtypes."""
    _, Hp, Hvp = block_dims(cfg, k, v)
    return {
        "dk": (
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            pl.BlockSpec((None, cfg.Sb, None, Hp), lambda b, h, j: (b, j, h, 0)),
        ),
        "dv": (
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            pl.BlockSpec((None, cfg.Sb, None, Hvp), lambda b, h, j: (b, j, h, 0)),
        ),
    }


def block_dims(cfg, q, v) -> tuple:
    """(Tp, Hp, Hvp): the query rows and head dims the kernels' blocks span, whole tiles and padded head dims,
    over q [B,T|Tp,N,H|Hp] and v [B,S|Sp,K,Hv|Hvp] (unpadded: cfg.extents)."""
    Tp = cfg.Tn * cfg.Tb
    if cfg.extents is not None:
        return Tp, cfg.extents.Hp, cfg.extents.Hvp
    return Tp, q.shape[-1], v.shape[-1]


def row_delta(out, d_out, d_lse, Tp: int, acc_dtype):
    """delta [B,N,Tp] in acc_dtype, one per query row: d loss / d x = p (dp - sum_s p dp) + p d lse, and
    sum_s p dp = d_out . out, so delta = d_out . out - d lse. out, d_out [B,T|Tp,N,F] (padding rows and columns
    zero in d_out), d_lse [B,N,T|Tp] or None; rows past T are zero."""
    delta = jnp.einsum("btnv,btnv->bnt", d_out.astype(acc_dtype), out.astype(acc_dtype))
    if d_lse is not None:
        delta = delta - d_lse.astype(acc_dtype)
    return jnp.pad(delta, [(0, 0), (0, 0), (0, Tp - delta.shape[-1])])


def sinks_grad(sinks, lse, delta):
    """d loss / d sinks [B,N] from the saved lse and delta [B,N,Tp]: d out_t / d sink = -p_sink[t] out_t, so
    d sink = -sum_t p_sink[t] delta_t."""
    return -jnp.sum(jnp.exp(sinks[..., None] - lse) * delta, axis=-1).astype(sinks.dtype)


def _row_block(cfg, x):
    """The BlockSpec of a per-query-row array [B,N,Tp,Dp] (Shaw's row_bias, row_sums) on grid (b, n, i)."""
    return pl.BlockSpec((None, None, cfg.Tb, x.shape[-1]), lambda b, n, i: (b, n, i, 0))


def _forward(cfg, q, k, v, side):
    """(out [B,Tp,N,Hvp] in q's dtype, lse [B,N,Tp] in the compute dtype (None without cfg.write_lse),
    row_sums [B,N,Tp,Dp] in the compute dtype: Shaw's value term, or None); out [B,T,N,Hv] when unpadded
    (cfg.extents)."""
    B, _, N, _ = q.shape
    Tp, Hp, Hvp = block_dims(cfg, q, v)
    out_rows, out_dim = (Tp, Hvp) if cfg.extents is None else (cfg.extents.T, cfg.extents.Hv)
    inputs, specs = row_inputs(cfg, side, Hp, Hvp)
    inputs.update(q=(q, specs["q"]), k=(k, specs["k"]), v=(v, specs["v"]))
    if side.sinks is not None:
        inputs["sinks"] = (side.sinks, pl.BlockSpec((None, None), lambda b, n, i: (b, n)))
    acc_dtype = accumulation_dtype(q.dtype)
    outputs = {
        "out": (
            jax.ShapeDtypeStruct((B, out_rows, N, out_dim), q.dtype),
            pl.BlockSpec((None, cfg.Tb, None, Hvp), lambda b, n, i: (b, i, n, 0)),
        ),
    }
    if cfg.write_lse:
        lse = jax.ShapeDtypeStruct((B, N, Tp), acc_dtype)
        outputs["lse"] = (lse, pl.BlockSpec((None, None, cfg.Tb), lambda b, n, i: (b, n, i)))
    if value_term_in(cfg):
        sums = jax.ShapeDtypeStruct((B, N, Tp, cfg.tables.Dp), acc_dtype)
        outputs["row_sums"] = (sums, _row_block(cfg, sums))
    results = named_call(cfg, forward_kernel, (B, N, cfg.Tn), inputs, outputs, "jaxattn_flash_forward")
    results = dict(zip(outputs, results))
    return results["out"], results.get("lse"), results.get("row_sums")


# The primal runs when nothing differentiates the call: lse is written only when the caller asked for it
# (cfg.write_lse). The fwd rule runs under a gradient, and the backward needs lse, asked for or not.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, side):
    return _forward(cfg, q, k, v, side)


def _flash_fwd(cfg, q, k, v, side):
    out, lse, row_sums = _forward(cfg._replace(write_lse=True), q, k, v, side)
    return (out, lse if cfg.write_lse else None, row_sums), (q, k, v, side, out, lse, row_sums)


def _flash_bwd(cfg, res, cotangents):
    q, k, v, side, out, lse, row_sums = res
    d_out, d_lse, d_row_sums = cotangents
    B, T, N, _ = q.shape
    Tp, Hp, Hvp = block_dims(cfg, q, v)
    K = v.shape[2]
    G = N // K
    acc_dtype = accumulation_dtype(q.dtype)
    d_out = d_out.astype(q.dtype)
    # d_lse None: lse was not an output (cfg.write_lse); its cotangent [B,N,Tp] otherwise
    delta = row_delta(out, d_out, None if d_lse is None else d_lse[..., :T], Tp, acc_dtype)
    if row_sums is not None:  # Shaw's value term: out gains P A^V, so sum_s p dp gains sum_c P dP
        d_row_sums = d_row_sums.astype(acc_dtype)
        delta = delta + jnp.sum(row_sums * d_row_sums, axis=-1)

    inputs, specs = row_inputs(cfg, side, Hp, Hvp)
    inputs.update(
        q=(q, specs["q"]),
        k=(k, specs["k"]),
        v=(v, specs["v"]),
        do=(d_out, pl.BlockSpec((None, cfg.Tb, None, Hvp), lambda b, n, i: (b, i, n, 0))),
        lse=(lse, pl.BlockSpec((None, None, cfg.Tb), lambda b, n, i: (b, n, i))),
        delta=(delta, pl.BlockSpec((None, None, cfg.Tb), lambda b, n, i: (b, n, i))),
    )
    floats = [c for c, g in zip(side.score_consts, cfg.score_grads) if g]
    outputs = {
        "dq": (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            pl.BlockSpec((None, cfg.Tb, None, Hp), lambda b, n, i: (b, i, n, 0)),
        )
    }
    for c, x in enumerate(floats):  # partial sums per (b, n, query tile), added up below
        outputs[f"d_score{c}"] = (
            jax.ShapeDtypeStruct((B, N, cfg.Tn, *x.shape), acc_dtype),
            pl.BlockSpec((None, None, None, *x.shape), lambda b, n, i, nd=x.ndim: (b, n, i) + (0,) * nd),
        )
    aliases = None
    if side.offset_bias is not None:  # atomic adds into rows that start at zero (an input aliased to the output)
        batched = cfg.offset_bias[1]
        rows = side.offset_bias.shape  # in the compute dtype, as the rows: float32 for half inputs
        inputs["d_offset_bias_zeros"] = (
            jnp.zeros(rows, acc_dtype),
            pl.BlockSpec((None, None, rows[-1]), lambda b, n, i: (pick(batched, b), n, 0)),
        )
        outputs["d_offset_bias"] = (
            jax.ShapeDtypeStruct(rows, acc_dtype),
            pl.BlockSpec((None, None, rows[-1]), lambda b, n, i: (pick(batched, b), n, 0)),
        )
        aliases = {"d_offset_bias_zeros": "d_offset_bias"}
    if row_sums is not None:
        inputs["d_row_sums"] = (d_row_sums, _row_block(cfg, d_row_sums))
    if side.row_bias is not None:  # d QA: each program's own [Tb,Dp] block, zeroed by the kernel
        d_row_bias = jax.ShapeDtypeStruct(side.row_bias.shape, acc_dtype)
        outputs["d_row_bias"] = (d_row_bias, _row_block(cfg, d_row_bias))
    dq, *d_floats = named_call(cfg, dq_kernel, (B, N, cfg.Tn), inputs, outputs, "jaxattn_flash_dq", aliases)
    d_row_bias = d_floats.pop() if side.row_bias is not None else None
    d_offset_bias = d_floats.pop() if side.offset_bias is not None else None

    kv_inputs = key_tile_inputs(cfg, side, q, k, v, d_out, lse, delta)
    if side.offset_bias is not None:  # the rows of the G query heads of key head h: [G,D]
        batched, D = cfg.offset_bias[1], side.offset_bias.shape[-1]
        kv_inputs["offset_bias"] = (
            side.offset_bias,
            pl.BlockSpec((None, G, D), lambda b, h, j: (pick(batched, b), h, 0)),
        )
    for name, x in (("row_bias", side.row_bias), ("d_row_sums", d_row_sums if row_sums is not None else None)):
        if x is not None:  # the rows of the G query heads of key head h, every query row: [G,Tp,Dp]
            kv_inputs[name] = (x, pl.BlockSpec((None, G, Tp, x.shape[-1]), lambda b, h, j: (b, h, 0, 0)))
    if side.column_map is not None:
        kv_inputs["column_map"] = _whole(side.column_map)
    kv_aliases = None
    key_rows_spec = None
    if side.key_row_bias is not None:  # this key tile's rows for the G query heads of key head h: [G,Sb,Dp]
        key_rows_spec = pl.BlockSpec((None, G, cfg.Sb, side.key_row_bias.shape[-1]), lambda b, h, j: (b, h, j, 0))
        kv_inputs["key_row_bias"] = (side.key_row_bias, key_rows_spec)
        # its gradient: atomic adds into this program's own block, starting at zero (an input aliased to it)
        kv_inputs["d_key_row_bias_zeros"] = (jnp.zeros(side.key_row_bias.shape, acc_dtype), key_rows_spec)
        kv_aliases = {"d_key_row_bias_zeros": "d_key_row_bias"}
    kv_outputs = key_tile_outputs(cfg, k, v)
    if key_rows_spec is not None:
        kv_outputs["d_key_row_bias"] = (jax.ShapeDtypeStruct(side.key_row_bias.shape, acc_dtype), key_rows_spec)
    dk, dv, *d_key_rows = named_call(
        cfg, dkv_kernel, (B, K, cfg.Sn), kv_inputs, kv_outputs, "jaxattn_flash_dkv", kv_aliases
    )

    d_sinks = None if side.sinks is None else sinks_grad(side.sinks, lse, delta)
    it = iter(d_floats)
    d_score = tuple(
        jnp.sum(next(it), axis=(0, 1, 2)).astype(c.dtype) if g else None
        for c, g in zip(side.score_consts, cfg.score_grads)
    )
    d_side = Side(  # the integer inputs (positions, segment ids, schedules, the column map) get no cotangent
        sinks=d_sinks,
        score_consts=d_score,
        mask_consts=tuple(None for _ in side.mask_consts),
        offset_bias=d_offset_bias,
        row_bias=d_row_bias,
        key_row_bias=d_key_rows[0] if d_key_rows else None,
    )
    return dq, dk, dv, d_side


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------------------
# One call's checks, layout, schedules (decode_gpu and flex_tpu take them too).


def next_power_of_two(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def gpu_tiles(Hp: int, itemsize: int, tables: bool = False) -> tuple:
    """(Tb, Sb, num_warps) on a GPU for a padded head dim Hp <= MAX_HEAD_DIM and the inputs' bytes per element:
    GPU_TILES' row (4-byte inputs: float32; 2-byte and narrower: the half-precision row); tables: the call has
    per-row tables (Tb at most TABLES_MAX_QUERY_TILE above head dim 64)."""
    rows = GPU_TILES[4 if itemsize > 2 else 2]
    Tb, Sb, warps = next(tiles for dim, tiles in sorted(rows.items()) if Hp <= dim or dim == MAX_HEAD_DIM)
    return (min(Tb, TABLES_MAX_QUERY_TILE) if tables and Hp > 64 else Tb), Sb, warps


def tile_sizes(block_size, T: int, S: int, Hp: int, interpret: bool, itemsize: int = 2, tables: bool = False) -> tuple:
    """(Tb, Sb): block_size as given, else gpu_tiles' by head dim and bytes per element (INTERPRET_BLOCK when
    interpreted), shrunk to the next power of two of T / S (never below
    MIN_GPU_BLOCK on a GPU)."""
    pair = _block_pair(block_size)
    if pair is not None:
        for b in pair:
            if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b <= 0:
                checks.fail("block_size", "an int > 0 or a pair of them", repr(block_size))
        return int(pair[0]), int(pair[1])
    wanted = (INTERPRET_BLOCK, INTERPRET_BLOCK) if interpret else gpu_tiles(Hp, itemsize, tables)[:2]
    floor = 1 if interpret else MIN_GPU_BLOCK
    return tuple(min(b, max(floor, next_power_of_two(L))) for b, L in zip(wanted, (T, S)))


def mask_sub_tiles(mask_tiles, wanted) -> tuple:
    """(Tb, Sb) of the kernels under a BlockMask of mask_tiles: per axis the wanted tile (tile_sizes') where it
    divides the mask's, else the mask's own. Each kernel tile then lies inside one mask tile and takes its kind
    (sub_tile_kinds), so the mask's skipping stays exact, and a coarse BlockMask (create_block_mask's default
    at T = 4096 is 512 x 512) does not force tiles whose backward overruns shared memory."""
    return tuple(w if m % w == 0 else m for m, w in zip(mask_tiles, wanted))


def sub_tile_kinds(kinds, ratios, Tn: int, Sn: int):
    """A BlockMask's kinds [B,N,Tm,Sm] -> the kernels' [B,N,Tn,Sn]: each mask tile's kind repeated over the
    ratios = (rows, columns) of kernel tiles it holds; the repeats past T / S (a last mask tile that runs past
    them) dropped."""
    rows, columns = ratios
    return jnp.repeat(jnp.repeat(kinds, rows, axis=2), columns, axis=3)[:, :, :Tn, :Sn]


def padded_head(H: int, interpret: bool) -> int:
    return next_power_of_two(H) if interpret else max(MIN_GPU_BLOCK, next_power_of_two(H))


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
    t_counts), tile_body.schedule's arrays (positions_given: the call passed positions of its own).

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
    value_rows: Any = None  # Shaw's value table, its band's rows [D,(N,)Hv] (offset_tables), or None


def run(call: AttentionCall, query, key, value, interpret):
    """pallas_gpu.attention by the flash kernels (forward and backward): a call unsupported() accepts, T, S > 0."""
    p = prepare(call, query, key, value, interpret, unpadded=True)
    out, lse, row_sums = _flash(p.cfg._replace(write_lse=bool(call.return_lse)), p.q, p.k, p.v, p.side)
    if row_sums is not None:  # Shaw's value term, P @ A^V, added to the kernel's sum_s p v
        band = tables_band(call, p.T, key.shape[-3])
        rows = offset_tables.value_term(row_sums, p.value_rows, p.T, band, p.cfg.precision)  # [B,T,N,Hv]
        out = (out.astype(rows.dtype) + rows).astype(out.dtype)
    return finish(p, out, lse, call.return_lse)


def finish(p: Prepared, out, lse, return_lse: bool):
    """The kernel's out [B,Tp,N,Hvp] (or unpadded, [B,T,N,Hv]) and lse [B,N,Tp] -> the public result
    ([...,T,N,Hv], lse [...,N,T])."""
    batch, T, N, Hv = p.batch, p.T, p.N, p.Hv
    out = out[:, :T, :, :Hv].reshape(*batch, T, N, Hv)
    if return_lse:
        return out, public_lse(lse[..., :T].reshape(*batch, N, T))  # -inf for a row with no key
    return out


def prepare(
    call: AttentionCall, query, key, value, interpret, blocks=None, head_multiple=None, unpadded=False
) -> Prepared:
    """Checks, tiles, layout and key-tile schedules of one call for the flash kernels (forward_kernel's
    inputs). blocks: (Tb, Sb) instead of tile_sizes' (a BlockMask's tiles still win; without blocks the kernels
    take sub-tiles of them, mask_sub_tiles); head_multiple: pad
    head dims to a multiple of it (a TPU's lane width) rather than to a power of two; unpadded: q, k, v as
    the caller's arrays (cfg.extents: the kernels mask what runs past them; the GPU flash kernels), else
    padded with zeros to whole tiles and the padded head dims."""
    mask_mod, block_mask, block_size = call.mask_mod, call.block_mask, call.block_size
    score_mod = call.score_mod
    c = checked(call, query, key, value)
    batch, T, S, N, K, H, Hv = c.batch, c.T, c.S, c.N, c.K, c.H, c.Hv
    B = int(np.prod(batch, dtype=np.int64))
    acc_dtype = accumulation_dtype(query.dtype)
    if block_mask is not None:  # its tiles hold the kernels' (mask_sub_tiles); its own mask_mod applies (resolve)
        block_masks.check_block_mask(block_mask, B, N, T, S)
        block_size = check_block_mask_tiles(block_mask, block_size)
        mask_mod, block_mask = block_masks.resolve(mask_mod, block_mask)
    if head_multiple is None:
        Hp, Hvp = padded_head(H, interpret), padded_head(Hv, interpret)
    else:
        Hp, Hvp = (-(-x // head_multiple) * head_multiple for x in (H, Hv))
    # warps: GPU_TILES' for the head dim (with block_size or a BlockMask's tiles too); a kernel that passes its own
    # tiles (blocks) keeps the rule it was measured with, JAX's mha's: 4 up to head dim 64, else 8
    warps = gpu_tiles(max(Hp, Hvp), np.dtype(query.dtype).itemsize)[2]
    if blocks is not None:
        warps = 4 if max(Hp, Hvp) <= 64 else 8
    tables = call.has_tables or call.row_tables is not None
    itemsize = np.dtype(query.dtype).itemsize
    if blocks is not None and block_mask is None:
        Tb, Sb = blocks
    elif blocks is None and block_mask is not None:  # sub-tiles of the mask's tiles, by head dim as without it
        Tb, Sb = mask_sub_tiles(block_size, tile_sizes(None, T, S, max(Hp, Hvp), interpret, itemsize, tables))
    else:  # block_size, the defaults, or a kernel's own tiles under a BlockMask (the mask's tiles win)
        Tb, Sb = tile_sizes(block_size, T, S, max(Hp, Hvp), interpret, itemsize, tables)
    Tn, Sn = -(-T // Tb), -(-S // Sb)
    Tp, Sp = Tn * Tb, Sn * Sb
    q_pos, k_pos, lengths, q_seg, k_seg = padded_rows(c, Tp, Sp)
    score_fn = mods.element_function("score_mod", score_mod, acc_dtype)
    mask_fn = mods.element_function("mask_mod", mask_mod)
    tile_kinds = None
    if block_mask is not None:
        ratios = (block_size[0] // Tb, block_size[1] // Sb)
        tile_kinds = sub_tile_kinds(block_masks.tile_kinds(block_mask).astype(jnp.int32), ratios, Tn, Sn)
    score_consts = () if score_fn is None else tuple(jnp.asarray(c) for c in score_fn.consts)
    mask_consts = () if mask_fn is None else tuple(jnp.asarray(c) for c in mask_fn.consts)

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
    order, counts, t_order, t_counts = schedules(
        cfg, Bs, q_pos, k_pos, lengths, q_seg, k_seg, tile_kinds, not default_positions(call)
    )
    cfg = cfg._replace(batched=tuple(x is not None and x.shape[0] > 1 for x in (q_pos, k_pos, q_seg, lengths, counts)))
    offset_rows = None
    if call.position_bias is not None:  # a KERNEL_BIASES in a static range (unsupported refuses any other)
        rows, index = call.position_bias.kernel_table(T, S, default_positions(call))
        offset_rows = _offset_rows(rows, batch, N, acc_dtype)
        cfg = cfg._replace(offset_bias=(index, offset_rows.shape[0] > 1))
    row_bias = value_rows = None
    if call.has_tables:  # Shaw tables within MAX_COLUMNS rows of reach (unsupported refuses wider ones)
        key_table, value_table, _ = blockwise.check_tables(
            call.key_table, call.value_table, call.max_distance, N, H, Hv, acc_dtype
        )
        band = tables_band(call, T, S)
        if key_table is not None:
            key_rows = offset_tables.band_rows(key_table, band)
            row_bias = offset_tables.row_bias(query, key_rows, batch, Tp, band.D, band.Dp, c.precision)
        if value_table is not None:
            value_rows = offset_tables.band_rows(value_table, band)
        cfg = cfg._replace(tables=Tables(band.lo, band.hi, band.Dp, key_table is not None, value_table is not None))
    column_map = key_row_bias = None
    if call.row_tables is not None:  # DeBERTa's: columns are the tables' R rows, read through the scheme's map
        tables = call.row_tables
        Dp = offset_tables.padded_columns(tables.rows)
        if tables.key_rows is not None:
            row_bias = offset_tables.row_bias(query, tables.key_rows, batch, Tp, tables.rows, Dp, c.precision)
        if tables.query_rows is not None:
            key_row_bias = offset_tables.key_row_bias(key, tables.query_rows, N, batch, Sp, Dp, c.precision)
        column_map = offset_tables.column_map(tables.row_of_offset)
        cfg = cfg._replace(
            tables=Tables(
                tables.lo, tables.hi, Dp, tables.key_rows is not None, False, True, tables.query_rows is not None
            )
        )
    side = Side(
        q_pos=q_pos,
        k_pos=k_pos,
        lengths=lengths,
        q_seg=q_seg,
        k_seg=k_seg,
        sinks=c.sinks,
        score_consts=score_consts,
        mask_consts=mask_consts,
        order=order,
        counts=counts,
        t_order=t_order,
        t_counts=t_counts,
        offset_bias=offset_rows,
        row_bias=row_bias,
        column_map=column_map,
        key_row_bias=key_row_bias,
    )

    if unpadded:  # no copies: the kernels mask the tiles that run past T, S, H, Hv (tile_body.read, write)
        cfg = cfg._replace(extents=Extents(T, S, H, Hv, Hp, Hvp))
        q = kernel_layout(query, batch, T, T, H)
        k, v = kernel_layout(key, batch, S, S, H), kernel_layout(value, batch, S, S, Hv)
    else:
        q = kernel_layout(query, batch, T, Tp, Hp)
        k, v = kernel_layout(key, batch, S, Sp, Hp), kernel_layout(value, batch, S, Sp, Hvp)
    return Prepared(cfg, q, k, v, side, batch, T, N, Hv, value_rows)
