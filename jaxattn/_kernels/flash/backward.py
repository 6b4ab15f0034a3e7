"""The flash backward's bodies (FlashAttention-2), run by the Pallas GPU kernel (flash_gpu) and, on the TPU
layout, by the flex kernel's backward (flex_tpu_vjp):

    dq, grid (b, n, query tile i): p = exp(x - lse) recomputed, ds = p (dO V^T - delta), dq_i = sum_j scale ds k_j
    dk/dv, grid (b, key head kh, key tile j): over the G query heads of kh and the query tiles that see j,
        dv_j += p^T dO, dk_j += scale ds^T q                        (delta = rowsum(dO * out) - d lse)

The tile's terms are the forward's (tile_math); a kernel with its own construction of them passes hooks
(refs.DqHooks, refs.DkvHooks)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import jax.ref  # jax.ref.addupdate: a submodule, imported by name
from jax import lax
from jax.experimental import pallas as pl

from ..._core import mods
from ..._core.dtypes import accumulation_dtype
from ..._core.softmax import logits_grad, probabilities
from .config import Config, key_row_term_in, key_term_in
from .refs import DkvHooks, DqHooks, Refs
from .tile_math import (
    add_by_column,
    add_by_key_column,
    allowed_in_tile,
    apply_score_mod,
    capped_logits,
    dot,
    fill_rows,
    load,
    load_all,
    offset_bias_tile,
    offset_index,
    pick_rows,
    program_schedule,
    read,
    schedule,
    table_column,
    table_logits,
    tile_keys,
    tile_rows,
    visit,
    write,
)


def _row_grads(cfg, x, lse, allowed, do, v, delta, dp_table=None):
    """(p, ds) of one tile: p recomputed from the saved lse, ds = d loss / d x = p (dp - delta) with
    dp = dO v^T (+ dp_table: Shaw's value term, dP picked at each pair's column). lse and delta: [Tb], or
    [Tb,1] (the TPU layout's columns)."""
    p = probabilities(x, lse.reshape(-1, 1), allowed)
    dp = dot(do, v, cfg, (1, 1))
    if dp_table is not None:
        dp = dp + dp_table
    return p, logits_grad(p, dp, delta.reshape(-1, 1))


def _table_terms(cfg, r: Refs, qp, kp, rows, keys, head=None):
    """(column, key terms, value term's dp) of one tile for Shaw / DeBERTa tables (each None where the call
    has none): rows / keys / head: where the tile's query rows sit in the row_bias / d_row_sums blocks
    (tile_math.tile_rows) and its key rows in the key_row_bias block (tile_math.tile_keys)."""
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
    return p, mods.product_grad(ds, capped, cfg.softcap, cfg.scale), d_consts, d_bias


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
    """dq of one (b, n, query tile); also the TPU backward's (flex_tpu_vjp, through its views of the refs and
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
        if cfg.offset_bias is not None and hooks.bias_of_key_tile is not None:  # flex_tpu_vjp's: no gather
            bias = hooks.bias_of_key_tile(j)
        elif cfg.offset_bias is not None:
            index = offset_index(cfg, qp, kp)
            bias = offset_bias_tile(r.offset_bias, index)
        column, key_term, dp_table = _table_terms(cfg, r, qp, kp, tile_rows(cfg), tile_keys(cfg, s0))
        if hooks.table_terms_of_key_tile is not None:  # the kernel's own (flex_tpu_vjp)
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
        elif bias is not None:  # the kernel's own adds of the tile's gradient into its rows (flex_tpu_vjp)
            hooks.add_bias_grad(j, d_bias)
        if key_grad:  # d QA[t, c] = the sum of d loss / d (q k^T + QA) over the pairs of row t in column c
            add_by_column(r.d_row_bias, column, ds)
        if hooks.add_table_grads is not None:  # the kernel's own sums of the tables' gradients (flex_tpu_vjp,
            share = hooks.add_table_grads(j, k, p, ds)  # windows_gpu: which returns the tile's share of dq too)
            if share is not None:
                dq = dq + share.astype(dq.dtype)
        return dq, d_consts

    floats = tuple(c for c, g in zip(score_consts, cfg.score_grads) if g)
    init = (jnp.zeros(q.shape, acc_dtype), tuple(jnp.zeros(c.shape, acc_dtype) for c in floats))
    dq, d_consts = visit(cfg, program_schedule(r), key_tile, init)
    if hooks.finish_dq is not None:  # dq's share of the tables' terms, summed over the tiles (flex_tpu_vjp)
        dq = hooks.finish_dq(dq)
    write(cfg, r.dq, "dq", dq, row0)
    for ref, d in zip(r.d_score, d_consts):
        ref[...] = d


def dkv_kernel(cfg: Config, r: Refs, hooks: DkvHooks = DkvHooks()):
    """dk, dv of one (b, key head, key tile) (r.order / r.counts: the schedule over query tiles, a row per query
    head of the group when cfg.head_kinds); also the TPU backward's (flex_tpu_vjp, with its hooks)."""
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
        if cfg.offset_bias is not None and hooks.bias_of_query_tile is not None:  # flex_tpu_vjp's
            bias = hooks.bias_of_query_tile(g, i)
        elif cfg.offset_bias is not None:  # the rows of the G heads of key head kh: this head's is row g
            bias = offset_bias_tile(r.offset_bias, offset_index(cfg, qp, kp), g)
        column, key_term, dp_table = _table_terms(cfg, r, qp, kp, tile_rows(cfg, i * cfg.Tb), tile_keys(cfg), g)
        if hooks.table_terms_of_query_tile is not None:  # the kernel's own (flex_tpu_vjp)
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
        if hooks.dk_of_query_tile is not None:  # the kernel's own per-key-row term's share (flex_tpu_vjp: p2c)
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
    if hooks.query_head is not None:  # one query head per program, the grid's (flex_tpu_vjp: its dk, dv views sum)
        carry = query_head(hooks.query_head, carry)
    else:  # A loop in the kernel, not unrolled in Python: unrolled, Triton compiled G copies of the tile loops
        # (compile time grew with G: 38 s at G = 8, over 600 s for MQA with 32 heads).
        carry = query_head(0, carry) if G == 1 else lax.fori_loop(0, G, query_head, carry)
    write(cfg, r.dk, "dk", carry[0], s0)
    write(cfg, r.dv, "dv", carry[1], s0)


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
