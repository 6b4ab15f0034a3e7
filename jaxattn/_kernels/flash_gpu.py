"""Flash attention for GPU: a Pallas kernel (Triton lowering), forward and FlashAttention-2 backward.

    forward, grid (b, n, query tile i): flash.forward.forward_kernel
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
(flash.tile_math.offset_index), their gradient scattered back by index from the dq kernel with atomic adds
(docs/kernels.md, "Position biases in the kernel"), and Shaw tables (tables_gpu): q . key_table per query
row computed outside and gathered per tile at clip(j - i), the forward's sums of p by table row for the value
table, and in the backward the value term's dP gathered the same way and the key term's gradient added by
column from the dq kernel (docs/kernels.md, "Shaw tables in the kernel"; a key table alone whose band is too wide
for that, Transformer-XL's whole span: each tile's window of table rows, windows_gpu), and DeBERTa's tables
(row_tables: the same key term at a column read from the scheme's map of offsets to table rows, and a per-key-row
term k . Qr computed outside, gathered per tile, its gradient added by column from the dk/dv kernel;
docs/kernels.md, "DeBERTa's disentangled tables in the kernel"). Per-pair tables (relative_attention's rel_key /
rel_value) run in pairs_gpu' kernels on this module's grids, layout, schedules and input specs (row_inputs,
key_tile_inputs); this one refuses them.

Layout: q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv] as the caller's (batch dims flattened, nothing padded or
copied): a BlockSpec picks one head's [Tb,Hp] tile, whole tiles and head dims padded to powers of two
(Triton's loads need them), and query head n reads key/value head n // G (G = N // K) through its index map,
so grouped-query attention never copies keys or values. A tile that runs past T, S, H or Hv reads zeros
there and writes nothing (flash.tile_math.read / write, masked loads and stores: Config.extents); the kernels'
own arrays (positions, segment ids, schedules, lse, delta) span whole tiles. Keys past S are masked as past
the length; query rows past T are computed on zeros and never stored.

The surface: `unsupported(call, query, key, value, interpret)` (the first option of the AttentionCall the
kernel cannot express, or None) and `run(call, query, key, value, interpret)` (a call it expresses).
The bodies, checks, layout and schedules are the platform-neutral flash core's (jaxattn/_kernels/flash/); this
module is the GPU's: its BlockSpecs (row_inputs, key_tile_inputs), its pallas_call (named_call, which
pairs_gpu and decode_gpu take too) and the custom VJP. `interpret=True` runs the same kernels with Pallas'
interpreter on any platform (the CPU tests).
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, NamedTuple, Optional

import jax
import jax.core  # jax.core.Tracer: a submodule, imported by name so that type checkers see it
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._core import mods
from .._core.call import POSITION_TERMS, AttentionCall
from .._core.dtypes import accumulation_dtype
from .._core.offset_bias import OffsetBias, of_rows
from . import tables_gpu, windows_gpu
from .flash import call
from .flash.backward import dkv_kernel, dq_kernel, row_delta, sinks_grad
from .flash.config import Side, value_term_in
from .flash.forward import forward_kernel
from .flash.plan import (
    default_positions,
    finish,
    kernel_lse,
    position_bias_refusal,
    prepare,
    row_tables_refusal,
    tables_band,
    windowed_tables,
)
from .flash.refs import Refs
from .flash.sizes import MAX_HEAD_DIM, MIN_GPU_BLOCK, block_pair, is_power_of_two
from .flash.tile_math import pick

# The options these kernels express; anything else in use (the full-grid options; per-pair tables: pairs_gpu'
# kernels) is the XLA engines'. A position_bias only as one of offset_bias.KERNEL_BIASES (position_bias_refusal);
# Shaw tables (key_table, value_table, max_distance) within tables_gpu.MAX_COLUMNS rows of reach, or a key table
# alone over any span with the default positions (plan.windowed_tables).
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


def unsupported(call: AttentionCall, query, key, value, interpret=False) -> Optional[str]:
    """None when run() computes this call; else the name of the first option it cannot express.

    Cheap (shapes and Python values only). Shaw tables reaching more than tables_gpu.MAX_COLUMNS rows
    (max_distance) unless a key table alone with the default positions (plan.windowed_tables), DeBERTa's row_tables
    of more rows than that (row_tables_refusal), a position_bias that is not one of offset_bias.KERNEL_BIASES (T5's,
    ALiBi's and window_attention's are; position_bias_refusal), per-pair tables (rel_key, rel_value: pairs_gpu'
    kernels, through pallas_gpu) and the full-grid options
    (bias, mask, dropout_rate, return_weights) are the XLA engines'. On a GPU (interpret=False) tiles must be
    powers of two >= 16 (block_size, a BlockMask's tiles), head dims at most 256, inputs at most 32-bit floats,
    scale a Python number, and score_mod / mask_mod must close over no array (Triton cannot index one by head or
    position).
    """
    T, S = (np.shape(x)[-3] if np.ndim(x) >= 3 else 0 for x in (query, key))
    problem = call.first_unhandled(HANDLED) or position_bias_refusal(call, T, S) or row_tables_refusal(call)
    if problem is not None:
        return problem
    T, S = (np.shape(x)[-3] if np.ndim(x) >= 3 else 1 for x in (query, key))
    band = tables_band(call, T, S)
    if band is not None and tables_gpu.columns_refusal(band) is not None and not windowed_tables(call, T, S):
        return tables_gpu.columns_refusal(band)
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
    pair = block_pair(call.block_size)
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


def named_call(cfg, kernel, grid, inputs, outputs, name, aliases=None, num_stages=2):
    """call.named_call of kernel(cfg, refs) on a GPU's grid (Triton's num_warps from cfg); num_stages: Triton's
    software pipelining of the tile loops' loads (each stage a copy in shared memory; 1 with a windowed key
    table, whose scratch block a pipelined load could read ahead of its store: windows_gpu)."""
    if cfg.window is not None:
        num_stages = 1
    return call.named_call(
        lambda r: kernel(cfg, r),
        (Refs,),
        grid=grid,
        inputs=inputs,
        outputs=outputs,
        name=name,
        interpret=cfg.interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=num_stages),
        aliases=aliases,
    )


def _whole(x):
    """Every program reads all of x (a score_mod / mask_mod const)."""
    return x, pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def row_inputs(cfg, side, Hp, Hvp):
    """Inputs shared by the forward and dq kernels (grid b, n, i): positions, lengths, segments, consts,
    the forward schedule; q / k / v specs."""
    G = cfg.N // cfg.K
    bsched = cfg.batched[4]  # the schedule's batch rows (Config.batched)
    Sp = cfg.Sn * cfg.Sb
    # positions, lengths, segment ids: the query tile's rows, every key
    inputs = call.index_inputs(side, cfg.batched, (cfg.Tb, lambda b, n, i: i), (Sp, lambda b, n, i: 0))
    inputs |= {
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
    bsched = cfg.batched[4]  # the schedule's batch rows (Config.batched)
    heads = G if cfg.head_kinds else 1
    inputs = {
        "q": (q, pl.BlockSpec((None, Tp, G, Hp), lambda b, h, j: (b, 0, h, 0))),
        "do": (d_out, pl.BlockSpec((None, Tp, G, Hvp), lambda b, h, j: (b, 0, h, 0))),
        "lse": (lse, pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0))),
        "delta": (delta, pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0))),
        "k": (k, pl.BlockSpec((None, cfg.Sb, None, Hp), lambda b, h, j: (b, j, h, 0))),
        "v": (v, pl.BlockSpec((None, cfg.Sb, None, Hvp), lambda b, h, j: (b, j, h, 0))),
        # positions, lengths, segment ids: every query row, the key tile's
        **call.index_inputs(side, cfg.batched, (Tp, lambda b, h, j: 0), (cfg.Sb, lambda b, h, j: j)),
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
    kernel = forward_kernel
    if cfg.window is not None:  # the key table whole, and the program's scratch block (windows_gpu)
        inputs["window_table"] = _whole(side.window_table)
        outputs["window_scratch"] = (
            windows_gpu.scratch_shape(cfg.window, B, N, cfg.Tn),
            windows_gpu.scratch_spec(cfg.window),
        )
        kernel = lambda cfg, r: forward_kernel(cfg, r, windows_gpu.forward_hooks(cfg, r))  # noqa: E731
    results = named_call(cfg, kernel, (B, N, cfg.Tn), inputs, outputs, "jaxattn_flash_forward")
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
    kernel = dq_kernel
    if cfg.window is not None:  # the key table whole, its gradient (atomic adds into zeros), the scratch block
        table = side.window_table
        inputs["window_table"] = _whole(table)
        inputs["d_window_table_zeros"] = _whole(jnp.zeros(table.shape, acc_dtype))
        outputs["d_window_table"] = (jax.ShapeDtypeStruct(table.shape, acc_dtype), _whole(table)[1])
        outputs["window_scratch"] = (
            windows_gpu.scratch_shape(cfg.window, B, N, cfg.Tn),
            windows_gpu.scratch_spec(cfg.window),
        )
        aliases = {**(aliases or {}), "d_window_table_zeros": "d_window_table"}
        kernel = lambda cfg, r: dq_kernel(cfg, r, windows_gpu.dq_hooks(cfg, r))  # noqa: E731
    dq, *d_floats = named_call(cfg, kernel, (B, N, cfg.Tn), inputs, outputs, "jaxattn_flash_dq", aliases)
    if cfg.window is not None:
        d_floats.pop()  # the scratch
    d_window_table = d_floats.pop() if cfg.window is not None else None
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
    kv_kernel = dkv_kernel
    if cfg.window is not None:  # the key table whole, and the program's scratch block
        kv_inputs["window_table"] = _whole(side.window_table)
        kv_outputs["window_scratch"] = (
            windows_gpu.scratch_shape(cfg.window, B, K, cfg.Sn),
            windows_gpu.scratch_spec(cfg.window),
        )
        kv_kernel = lambda cfg, r: dkv_kernel(cfg, r, windows_gpu.dkv_hooks(cfg, r))  # noqa: E731
    dk, dv, *d_key_rows = named_call(
        cfg, kv_kernel, (B, K, cfg.Sn), kv_inputs, kv_outputs, "jaxattn_flash_dkv", kv_aliases
    )
    if cfg.window is not None:
        d_key_rows.pop()  # the scratch

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
        window_table=d_window_table,
    )
    return dq, dk, dv, d_side


_flash.defvjp(_flash_fwd, _flash_bwd)


# What a call may use to take its backward at residuals of the caller's (gradients_at): HANDLED's options that only
# decide which pairs attend and how the logits are formed; position terms, sinks and the mods (their arrays) have
# gradients or residuals of their own beyond (out, lse). Two position terms are taken too, their gradients returned
# (ResidualGrads): a position bias of j - i (an OffsetBias: T5's, ALiBi's), and Shaw's key table alone (a value
# table's gradient needs the step's own P summed by offset, which only its forward computes).
RESIDUAL_OPTIONS = tuple(
    name
    for name in HANDLED
    if name not in (*POSITION_TERMS, "max_distance", "sinks", "score_mod", "mask_mod", "block_mask")
)


class ResidualGrads(NamedTuple):
    """gradients_at's result: the cotangents of query, key, value, and of the position terms it takes: bias_rows,
    an OffsetBias's rows as bias_rows_at gives them; key_table, Shaw's key table (None where the call has none)."""

    query: Any
    key: Any
    value: Any
    bias_rows: Any = None
    key_table: Any = None


def residual_refusal(call: AttentionCall) -> Optional[str]:
    """None when a call's backward may be taken at a caller's residuals (RESIDUAL_OPTIONS, an OffsetBias as its
    position bias, Shaw's key table alone); else the first option that keeps it to its own forward."""
    if call.position_bias is not None and not isinstance(call.position_bias, OffsetBias):
        return "position_bias"
    if call.value_table is not None:
        return "value_table"
    return call.replace(position_bias=None, key_table=None, max_distance=None).first_unhandled(RESIDUAL_OPTIONS)


def bias_rows_at(call: AttentionCall, T: int, S: int):
    """(rows [...,N,D], (lo, hi)): the rows of the call's OffsetBias over its kernel offsets, whose cotangent
    gradients_at returns (the caller pulls it back to the bias's table or slopes through rows(lo, hi))."""
    bounds = call.position_bias.offset_range(T, S, default_positions(call))
    return call.position_bias.rows(*bounds), bounds


def gradients_at(call: AttentionCall, query, key, value, out, lse, d_out, interpret) -> Optional[ResidualGrads]:
    """ResidualGrads by the flash backward kernels at residuals given by the caller: out [...,T,N,Hv] and lse
    [...,N,T] (public: -inf for a row with no key) of a softmax that may span more keys than `key`, d_out the
    cotangent of that out. Each pair's p = exp(x - lse) is then its probability in the whole softmax and delta =
    d_out . out the whole row's, so the result is this call's pairs' share of the whole softmax's gradient (a
    ring_attention step's, under the global output). The position terms' arrays the kernels read beside q, k, v
    (an OffsetBias's rows, Shaw's key term q . A^K or the key table's window) get the kernels' cotangents, pulled
    back through prepare's layout of them to the bias rows, the key table and q. None where residual_refusal
    names an option (or run() refuses one): the caller then takes the gradient through the forward."""
    if residual_refusal(call) is not None or unsupported(call, query, key, value, interpret):
        return None
    call = call.replace(return_lse=False)
    bias_rows, bounds = bias_rows_at(call, query.shape[-3], key.shape[-3]) if call.position_bias else (None, None)

    def laid(query, key_table, bias_rows):  # prepare's arrays from the differentiable inputs
        with_terms = call.replace(key_table=key_table)
        if bias_rows is not None:  # the bias read from its rows (of_rows: what the kernel reads)
            with_terms = with_terms.replace(position_bias=of_rows(bias_rows, *bounds))
        return prepare(with_terms, query, key, value, interpret, unpadded=True)

    terms = lambda side: (side.offset_bias, side.row_bias, side.window_table)  # noqa: E731  float side arrays
    p = laid(query, call.key_table, bias_rows)
    B, T, N = p.q.shape[0], p.T, p.N
    rows = lambda x: jnp.asarray(x).reshape(B, T, N, -1)  # noqa: E731
    residuals = (p.q, p.k, p.v, p.side, rows(out).astype(p.q.dtype), kernel_lse(p, lse), None)
    dq, dk, dv, d_side = _flash_bwd(p.cfg, residuals, (rows(d_out), None, None))
    dq, dk, dv = dq.reshape(query.shape), dk.reshape(key.shape), dv.reshape(value.shape)
    if call.position_bias is None and call.key_table is None:
        return ResidualGrads(dq, dk, dv)
    d_terms = tuple(None if x is None else d.astype(x.dtype) for x, d in zip(terms(p.side), terms(d_side)))
    pullback = jax.vjp(lambda *a: terms(laid(*a).side), query, call.key_table, bias_rows)[1]
    dq_term, d_key_table, d_bias_rows = pullback(d_terms)  # q . A^K's share of dq, the tables' cotangents
    dq = dq if dq_term is None else (dq + dq_term.astype(dq.dtype))
    return ResidualGrads(dq, dk, dv, d_bias_rows, d_key_table)


def run(call: AttentionCall, query, key, value, interpret):
    """pallas_gpu.attention by the flash kernels (forward and backward): a call unsupported() accepts, T, S > 0."""
    p = prepare(call, query, key, value, interpret, unpadded=True)
    out, lse, row_sums = _flash(p.cfg._replace(write_lse=bool(call.return_lse)), p.q, p.k, p.v, p.side)
    if row_sums is not None:  # Shaw's value term, P @ A^V, added to the kernel's sum_s p v
        band = tables_band(call, p.T, key.shape[-3])
        rows = tables_gpu.value_term(row_sums, p.value_rows, p.T, band, p.cfg.precision)  # [B,T,N,Hv]
        out = (out.astype(rows.dtype) + rows).astype(out.dtype)
    return finish(p, out, lse, call.return_lse)
