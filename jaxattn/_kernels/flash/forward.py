"""The flash forward's body, shared by the Pallas GPU kernels (flash_gpu, decode_gpu) and the TPU flex kernel
(flex_tpu): one program's loop over the key tiles its schedule lists, and the pieces of one [Tb,Sb] tile (which
pairs_gpu' kernels for per-pair tables use too: capped_logits, allowed_in_tile, visit).

    forward, grid (b, n, query tile i):        for each key tile j the schedule lists for (b, n, i)
        x = score_mod(softcap(scale * (q_i k_j^T + QA[t, c(j - i)])) + bias)  [Tb,Sb], float32 (or wider)
            bias: a position bias's rows gathered at index(i, j) (T5, ALiBi: j - i; Swin, BEiT: the 2D offset in a
            window), when the call has one (or the kernel's own hooks.bias_of_key_tile(j): flex_tpu builds
            T5's and ALiBi's from a slice of the rows without a gather)
            QA: Shaw's key term, q . key_table[row] per query row and table row ([Tp,Dp] per head,
                computed outside the kernel: tables_gpu), picked per pair at c(j - i), when it has one
        (out, m, l) = combine_partials((out, m, l), partial of x over the allowed pairs, v_j)
        P[t, c(j - i)] += p  (Shaw's value term: per-row sums of p by table row, rescaled as out is)
      out_i = out / l (sinks folded in), lse_i = m + log l, P_i = P / l (tables_gpu adds P @ value_table)
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

import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..._core.dtypes import accumulation_dtype
from ..._core.softmax import add_sinks, combine_partials, empty_partial, finalize_partial
from .config import Config, value_term_in
from .refs import ForwardHooks, Refs
from .tile_math import (
    add_by_column,
    allowed_in_tile,
    apply_score_mod,
    capped_logits,
    dot,
    fill_rows,
    load,
    load_all,
    offset_bias_tile,
    offset_index,
    program_schedule,
    read,
    rescale,
    scale_rows,
    table_column,
    table_logits,
    tile_keys,
    tile_rows,
    visit,
    write,
)


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
