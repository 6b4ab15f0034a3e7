"""Our Pallas TPU kernel for what splash attention cannot express: score_mod, mask_mod and a BlockMask
(flex_attention), T5's / ALiBi's position bias (an OffsetBias), Shaw's tables (shaw / clipped / Transformer-XL
attention) and DeBERTa's (RowTables), with every other option of the Pallas GPU kernel beside them. The backward
is flex_tpu_vjp's kernels (the GPU kernel's dq and dk/dv) for flex calls, T5's / ALiBi's bias and Shaw's and
DeBERTa's tables (flex_tpu_vjp.backward_refusal, tables_tpu.backward_refusal); otherwise (a window's bias, a score_mod's
arrays, blocks over VMEM) the XLA blockwise engine's.

The kernel body is the Pallas GPU kernel's forward (forward.forward_kernel: one (b, n, query tile), a
loop over the key tiles its schedule lists, score_mod / mask_mod / softcap / the mask rule per tile, sinks,
the online-softmax merge of _core), run on a TPU layout by Mosaic:

    q [B,N,Tp,Hp]   block [Tb,Hp] per (b, n, i)          out [B,N,Tp,Hvp]   block [Tb,Hvp]
    k [B,K,Sp,Hp]   block [Sp,Hp]: one key/value head's whole key axis (head n // G: GQA without copies),
    v [B,K,Sp,Hvp]  sliced per tile inside the kernel
    positions and segment ids as rows [B|1,1,L] (blocks [1,Tb] / [1,Sp]), lse [B,N,1,Tp]
    schedule (order, counts), lengths and sinks: scalar-prefetched into SMEM (scalars read per tile)
    a position bias of j - i (an OffsetBias: T5, ALiBi): its rows [B|1,N,1,E] (block [1,E] per (b, n)), the
    bias of every offset the padded grid holds, E ~ Tp + Sp (offset_rows_of_grid); no gather per tile
    a window's bias (a TableBias: Swin, BEiT): the [B|1,N,Tp,Sp] bias of every pair (pair_bias_of_grid),
    block [Tb,Sp] per (b, n, i), sliced per key tile as k and v are

A tile's position bias. Mosaic lowers no gather from a ref at an integer array index, so the GPU kernel's
rows[clip(j - i) - lo] is not an option. With the core's default positions the offsets of tile (i, j) are the
contiguous range of its Tb + Sb - 1 diagonals, and its bias is a Toeplitz matrix of that slice of the rows:
one lane-aligned load of the slice, broadcast over the tile's rows, and a strided roll (row r rotated by one
more than row r - 1) that puts each row's diagonals in place (toeplitz_tile). Calls with positions of their
own (T5 with query_positions) have no contiguous offsets per tile and are refused.

Swin's and BEiT's window bias (a TableBias: the [R,N] table read at the 2D offset of the pair, WindowIndex)
has no such structure, but a window is short (Swin 7 x 7 = 49 tokens, 12 x 12 = 144; BEiT 14 x 14 + 1 = 197)
and, at the default positions its index needs, its bias is one [N,T,S] matrix for every window and batch
entry. So it is gathered once outside the kernel, at the scheme's own index of every padded (query, key)
pair (pair_bias_of_grid), and each tile reads its [Tb,Sb] slice. Bounded: N x Tp x Sp float32 within
MAX_PAIR_BIAS_BYTES (this path is for windows, not long sequences; longer calls fall back to XLA).

Per-pair tables (relative_attention's rel_key / rel_value, docs/kernels.md, "Per-pair tables on a TPU"): left
in HBM, each tile's slice copied in by pairs_tpu' hooks.

Position tables (docs/kernels.md, "Position tables on a TPU"): Shaw's and DeBERTa's tables laid out along the
offsets of their band, a tile's terms a window of the lanes moved by strided rolls, forward and backward
(tables_tpu). The default positions only, as for the bias.

Tiles 128 x 128 (the TPU lane width; a BlockMask's own tiles when they are multiples of 128), head dims
padded to a multiple of 128, T and S padded inside. The whole key axis of one head sits in VMEM (with its
double buffer) up to flex_tpu_vjp.MAX_ROWS_BYTES (16k keys at head dim 128 in bf16); past it the keys stay in
HBM and each key tile is copied in when the kernel reaches it (refs_tpu.Streamed). Up to MAX_KEY_ROWS keys (the
[1,S] rows of key positions in VMEM); longer calls fall back to the XLA engine.

Refused with jax_enable_x64 on (in the interpreter too), and on a TPU (interpret=False) also: score_mod /
mask_mod / BlockMask mask_mod closing over an array (as on the GPU: indexing one by head or position inside the
kernel is not lowered), inputs wider than 32 bits, float16 (splash_tpu.tpu_dtype_refusal). interpret=True runs
Pallas' interpreter (any platform; closed-over arrays work).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._core import checks, mods, row_tables
from .._core.call import INDEX_ARRAYS, AttentionCall
from .._core.dtypes import accumulation_dtype
from .._core.offset_bias import OffsetBias, TableBias, of_rows
from .._engines import blockwise
from . import flash_gpu, flex_tpu_vjp, pairs_gpu, pairs_tpu, splash_tpu, tables_tpu
from .flash import backward, call as flash_call, plan, tile_math
from .flash.forward import forward_kernel
from .flash.refs import ForwardHooks, Refs, merged
from .refs_tpu import IN_HBM, LANES, Streamed, TpuRefs, rows_of, scalars_at, toeplitz_tile, window

INTERPRET_BLOCK = 16
# Keys past which a call stays on the XLA engines: the kernel holds [1,S] rows of the key positions (and segment
# ids) whole, padded to 8 sublanes and double-buffered (4 MiB apiece at 64k). One head's keys and values themselves
# are held whole up to flex_tpu_vjp.MAX_ROWS_BYTES and read a tile at a time from HBM past it.
MAX_KEY_ROWS = 2**16
MAX_BIAS_ROWS = 2**20  # one head's position-bias rows in VMEM (float32, about T + S of them): 4 MiB
# A window's bias of every pair, N x Tp x Sp float32 (pair_bias_of_grid): 16 MiB holds every Swin and BEiT
# window (Swin-L's 48 heads at 12 x 12: 48 x 256 x 256 x 4 = 12 MiB; 7 x 7: 3 MiB; BEiT-L's 16 heads at 197
# tokens: 4 MiB) while keeping the table path off long sequences. A TableBias has T = S (its length), so the
# kernel's block [Tb,Sp] is at most 128 x 2048 x 4 = 1 MiB of VMEM (doubled by the pipeline).
MAX_PAIR_BIAS_BYTES = 16 * 2**20
# The options only this kernel takes on TPU (splash takes every other call it can express).
FLEX_OPTIONS = (
    "score_mod",
    "mask_mod",
    "block_mask",
    "position_bias",
    "key_table",
    "value_table",
    "row_tables",
    "rel_key",
    "rel_value",
)
# The widest band of offsets whose table rows differ (hi - lo + 1) the kernel lays out per head: with the
# margins, E lanes of up to 2048 + 4 tiles, so the [Tb,E] float32 q . key rows (1.5 MiB at Tb = 128) and each
# table's [E,H] block fit VMEM beside the keys: DeBERTa's log buckets reach far more offsets than rows. Shaw's
# key table alone past tables_tpu.RESIDENT_BAND offsets (Transformer-XL over its whole span) streams its lanes a
# tile's window at a time (tables_tpu.TableLanes.streamed); Shaw's with a value table reach at most
# tables_gpu.MAX_COLUMNS rows (the Pallas GPU kernel's band refusal, which this kernel shares).
MAX_BAND = 2048


def wanted(call: AttentionCall) -> bool:
    """The call uses what splash cannot express and this kernel exists for."""
    return any(getattr(call, name) is not None for name in FLEX_OPTIONS)


def _tiles_ok(pair) -> bool:
    return all(isinstance(b, numbers.Integral) and b > 0 and b % LANES == 0 for b in pair)


def unsupported(call: AttentionCall, query, key, value, interpret=False) -> Optional[str]:
    """None when attention() computes this call; else the first option it cannot express: the Pallas GPU
    kernel's own refusals (without its GPU chip limits), and on a TPU the limits in the module docstring."""
    if pairs_gpu.in_use(call):
        return pairs_refusal(call, query, key, value, interpret)
    problem = flash_gpu.unsupported(call, query, key, value, interpret=True)
    if problem is not None:
        return problem
    # A position bias of j - i (an OffsetBias: T5, ALiBi) is built per tile from contiguous offsets, a
    # window's (a TableBias: Swin, BEiT) read from its bias of every pair (module docstring); the GPU kernel
    # gathers from rows at an index of the pair, which Mosaic does not lower from a ref. Refused in the
    # interpreter too, so that what runs interpreted is what a TPU runs.
    if call.position_bias is not None and not isinstance(call.position_bias, (OffsetBias, TableBias)):
        return "position_bias"
    problem = pair_bias_refusal(call, query, key)  # a window's positions and lengths: flash_gpu's refusal above
    if problem is not None:
        return problem
    if call.position_bias is not None and not plan.default_positions(call):
        name = "query_positions" if call.query_positions is not None else "key_positions"
        return f"{name} (with a position bias: the TPU kernel builds a tile's bias from its contiguous offsets)"
    if call.position_bias is not None and np.shape(query)[-3] + np.shape(key)[-3] > MAX_BIAS_ROWS:
        return f"position_bias (T + S over {MAX_BIAS_ROWS}: one head's bias rows must fit VMEM)"
    problem = tables_refusal(call)
    if problem is not None:
        return problem
    # In the interpreter too: the kernel's index arithmetic mixes int32 and int64 there (a TypeError inside
    # the kernel otherwise), as splash's does.
    if jax.config.read("jax_enable_x64"):
        return "jax_enable_x64 (the Pallas TPU kernels index in int32)"
    if interpret:
        return None
    if np.dtype(getattr(query, "dtype", np.float32)).itemsize > 4:
        return "dtype"
    if splash_tpu.tpu_dtype_refusal(query) is not None:
        return splash_tpu.tpu_dtype_refusal(query)
    block_mask = call.block_mask
    if block_mask is not None and (
        not _tiles_ok(getattr(block_mask, "block_size", ())) or getattr(block_mask, "mask_consts", ())
    ):
        return "block_mask"
    for name in ("score_mod", "mask_mod"):
        fn = getattr(call, name)
        if fn is not None:
            score_dtype = accumulation_dtype(getattr(query, "dtype", jnp.float32)) if name == "score_mod" else None
            if mods.element_function(name, fn, score_dtype).consts:
                return name
    S = np.shape(key)[-3]
    if S > MAX_KEY_ROWS:
        return f"key (S={S} > {MAX_KEY_ROWS}: the kernel's rows of key positions in VMEM)"
    return None


def pairs_refusal(call: AttentionCall, query, key, value, interpret=False) -> Optional[str]:
    """unsupported() for a call with per-pair tables (rel_key / rel_value, pairs_tpu): the options refused beside
    them (pairs_gpu.NOT_BESIDE_PAIRS, as on a GPU), the kernel's refusals of the rest of the call, and on a TPU
    tables wider than 32-bit floats."""
    for name in pairs_gpu.NOT_BESIDE_PAIRS:
        if getattr(call, name) is not None:
            return f"{name} (beside per-pair tables rel_key / rel_value)"
    problem = unsupported(call.replace(rel_key=None, rel_value=None), query, key, value, interpret)
    if problem is not None or interpret:
        return problem
    for name in pairs_tpu.TABLES:
        table = getattr(call, name)
        if table is not None and np.dtype(getattr(table, "dtype", np.float32)).itemsize > 4:
            return name
    return None


def declined(call: AttentionCall, query, key, value) -> Optional[str]:
    """Why implementation=None keeps a call this kernel expresses on the XLA engines (None: it takes it).

    A window bias (Swin, BEiT): the kernel pads a window's few tokens to one 128-row tile and the head dim to
    128 lanes, so compiled for v5e at 64 x 16 windows of 7x7 (H = 32, bf16) its forward holds 4-9x the dense
    engine's temp memory (docs/kernels.md, "Swin's and BEiT's windows"); nothing is timed on a TPU. Named,
    "pallas_tpu" runs it."""
    if isinstance(call.position_bias, TableBias):
        return "position_bias (a window's bias: the kernel's 128-row tiles and lanes take 4-9x the dense memory)"
    return None


def pair_bias_refusal(call: AttentionCall, query, key) -> Optional[str]:
    """None when the call has no table bias (TableBias) or its bias of every pair of the padded grid fits
    MAX_PAIR_BIAS_BYTES; else why not. Measured on a TPU's grid (tiles of 128, or the BlockMask's), in the
    interpreter too."""
    if not isinstance(call.position_bias, TableBias):
        return None
    Tb, Sb = (LANES, LANES) if call.block_mask is None else tuple(call.block_mask.block_size)
    N, T, S = np.shape(query)[-2], np.shape(query)[-3], np.shape(key)[-3]
    Tp, Sp = -(-T // Tb) * Tb, -(-S // Sb) * Sb
    if N * Tp * Sp * 4 <= MAX_PAIR_BIAS_BYTES:
        return None
    return (
        f"position_bias (a table bias of {N} heads x {Tp} x {Sp} padded pairs, float32, over "
        f"{MAX_PAIR_BIAS_BYTES >> 20} MiB: the TPU kernel reads it per pair, for windows, not long sequences)"
    )


def tables_refusal(call: AttentionCall) -> Optional[str]:
    """None when the kernel lays out the call's Shaw tables or RowTables (none, or those of the default
    positions within MAX_BAND offsets; DeBERTa's without logit_softcap); else what refuses them, by name."""
    if not call.has_tables and call.row_tables is None:
        return None
    if not plan.default_positions(call):  # a tile's offsets are contiguous only for the default positions
        name = "query_positions" if call.query_positions is not None else "key_positions"
        return f"{name} (with position tables: the TPU kernel reads a tile's rows at its contiguous offsets)"
    tables = call.row_tables
    if tables is None:
        return None
    if call.logit_softcap is not None:  # the gradient's engine adds DeBERTa's terms as a score_mod, after it
        return "logit_softcap (beside DeBERTa's position tables)"
    if tables.hi - tables.lo + 1 > MAX_BAND:
        return f"position_keys / position_queries ({tables.hi - tables.lo + 1} offsets of distinct rows > {MAX_BAND})"
    return None


def offset_rows_of_grid(p: plan.Prepared, S: int):
    """[B|1,N,1,E]: the bias of offset d = s - t - (S - T) for every padded query t in 0..Tp-1 and key s in
    0..Sp-1 (the core's default positions), from d = -(Tp - 1) - (S - T) up, clipped to the OffsetBias's rows
    lo..hi (exact: the bias is constant beyond them; the padding's offsets only reach discarded rows and
    masked keys), zero-padded to lanes that toeplitz_tile may load. Tile (i, j) starts at entry
    j * Sb - i * Tb + Tp - Tb (its smallest offset, key j * Sb against query i * Tb + Tb - 1)."""
    cfg = p.cfg
    index, _ = cfg.offset_bias
    lo, hi = index.lo, index.hi
    Tp, Sp = cfg.Tn * cfg.Tb, cfg.Sn * cfg.Sb
    first = -(Tp - 1) - (S - p.T)
    index = jnp.clip(first + jnp.arange(Tp + Sp - 1, dtype=jnp.int32), lo, hi) - lo
    rows = jnp.take(p.side.offset_bias, index, axis=-1)
    E = -(-(Tp + Sp - 1) // LANES) * LANES + window(cfg.Tb, cfg.Sb)
    return jnp.pad(rows, ((0, 0), (0, 0), (0, E - rows.shape[-1])))[:, :, None, :]


def pair_bias_of_grid(p: plan.Prepared):
    """[B|1,N,Tp,Sp]: a table bias (TableBias: Swin's / BEiT's windows) of every padded (query, key) pair,
    the kernel's rows [B|1,N,D] gathered at the scheme's own index of the pair's positions (the core's
    default positions, one row of them: unsupported refuses others). The padding's positions are edge-padded,
    so its entries are rows the index promises in bounds (kernel_table), and they only reach masked keys and
    discarded query rows."""
    index, _ = p.cfg.offset_bias
    pairs = index(p.side.q_pos[0], p.side.k_pos[0])  # int32 [Tp,Sp]
    return jnp.take(p.side.offset_bias, pairs, axis=-1)


def _forward(p: plan.Prepared, S: int, interpret: bool, pair_bias=None, tables=None, pairs=None):
    """flash.forward.forward_kernel on the TPU layout: (out [B,Tp,N,Hvp], lse [B,N,Tp]) as the GPU kernel's
    (S: the call's key length, for a position bias's offsets; pair_bias: a table bias's [B|1,N,Tp,Sp],
    pair_bias_of_grid, read instead of the offsets' rows; tables: (TableLanes, {name: [Nt,E,F]}) of Shaw's or
    DeBERTa's tables, tables_tpu.call_lanes, or None; pairs: per-pair tables, (PairTables, {name: [Tp,Nt,F,Sp]})
    of laid_pairs, or None)."""
    cfg, side = p.cfg, p.side
    q = jnp.swapaxes(p.q, 1, 2)  # [B,N,Tp,Hp]
    k, v = jnp.swapaxes(p.k, 1, 2), jnp.swapaxes(p.v, 1, 2)
    B, N, Tp, Hp = q.shape
    Sp, Hvp = k.shape[2], v.shape[-1]
    G = cfg.N // cfg.K
    pick = tile_math.pick

    scalars = {"counts": side.counts}  # the schedule: runs, or counts with order (tile_math.schedule)
    if side.order is not None:
        scalars["order"] = side.order
    if side.lengths is not None:
        scalars["lengths"] = side.lengths
    if side.sinks is not None:
        scalars["sinks"] = side.sinks
    scalar_shapes = {name: x.shape for name, x in scalars.items()}
    scalars = {name: x.reshape(-1) for name, x in scalars.items()}  # flat in SMEM (refs_tpu.Scalars)

    def spec(shape, index):  # index(b, n, i) -> block indices; the scalar refs are not read by index maps
        return pl.BlockSpec(shape, lambda b, n, i, *_: index(b, n, i))

    # one head's keys and values whole in VMEM, or past the bound left in HBM and read a tile at a time
    stream = flex_tpu_vjp.streamed(Sp, Hp, Hvp, k.dtype, pairs is not None)
    inputs = {
        "q": (q, spec((None, None, cfg.Tb, Hp), lambda b, n, i: (b, n, i, 0))),
        # lax.div: n >= 0, and Mosaic lowers floor division through sign, which asks the TPU generation
        "k": (k, IN_HBM if stream else spec((None, None, Sp, Hp), lambda b, n, i: (b, lax.div(n, G), 0, 0))),
        "v": (v, IN_HBM if stream else spec((None, None, Sp, Hvp), lambda b, n, i: (b, lax.div(n, G), 0, 0))),
        # positions and segment ids as rows: the query tile's, every key's (lengths: scalars, above)
        **flash_call.index_inputs(
            side, cfg.batched, (cfg.Tb, lambda b, n, i, *_: i), (Sp, lambda b, n, i, *_: 0), rows=True, lengths=False
        ),
    }
    for prefix, consts in (("score", side.score_consts), ("mask", side.mask_consts)):
        for c, x in enumerate(consts):
            inputs[f"{prefix}_consts{c}"] = (x, spec(x.shape, lambda b, n, i, nd=x.ndim: (0,) * nd))
    if pair_bias is not None:  # block [Tb,Sp] per (b, n, i): the query tile's rows of every key
        batched = cfg.offset_bias[1]
        inputs["pair_bias"] = (pair_bias, spec((None, None, cfg.Tb, Sp), lambda b, n, i: (pick(batched, b), n, i, 0)))
    elif cfg.offset_bias is not None:
        rows_of_grid, batched = offset_rows_of_grid(p, S), cfg.offset_bias[1]
        E = rows_of_grid.shape[-1]
        inputs["offset_bias"] = (rows_of_grid, spec((None, None, 1, E), lambda b, n, i: (pick(batched, b), n, 0, 0)))
    scratch = {}
    if stream:
        scratch.update(
            k_tile=pltpu.VMEM((cfg.Sb, Hp), k.dtype),
            v_tile=pltpu.VMEM((cfg.Sb, Hvp), v.dtype),
            key_sem=pltpu.SemaphoreType.DMA(()),
        )
    if tables is not None:
        lanes, arrays = tables
        for name, x in arrays.items():  # one head's lanes (or the shared table's), [E,F]; streamed: left in HBM
            heads = x.shape[0] > 1
            block = spec((None, *x.shape[1:]), lambda b, n, i, heads=heads: (pick(heads, n), 0, 0))
            inputs[name] = (x, IN_HBM if lanes.streamed else block)
        if lanes.streamed:
            scratch.update(tables_tpu.streamed_scratch(lanes, arrays["key_rows"].shape[-1], grads=False))
        elif lanes.key_rows:
            scratch["qx"] = pltpu.VMEM((cfg.Tb, lanes.E), jnp.float32)
    if pairs is not None:  # in HBM, a tile's slices copied in by the hooks (pairs_tpu)
        inputs.update(pairs_tpu.inputs(pairs[1]))
        scratch.update(pairs_tpu.scratch(pairs[0], pairs[1], Hp, Hvp, grads=False))
    acc_dtype = accumulation_dtype(q.dtype)
    outputs = {
        "out": (
            jax.ShapeDtypeStruct((B, N, Tp, Hvp), q.dtype),
            spec((None, None, cfg.Tb, Hvp), lambda b, n, i: (b, n, i, 0)),
        ),
        "lse": (
            jax.ShapeDtypeStruct((B, N, 1, Tp), acc_dtype),
            spec((None, None, 1, cfg.Tb), lambda b, n, i: (b, n, 0, i)),
        ),
    }

    lanes = None if tables is None else tables[0]
    kernel = functools.partial(
        _forward_program, cfg, scalar_shapes, stream, p.T, S, lanes, None if pairs is None else pairs[0]
    )
    out, lse = flash_call.named_call(
        kernel,
        (Refs, TpuRefs, tables_tpu.LaneRefs, pairs_tpu.PairRefs),
        grid=(B, N, cfg.Tn),
        inputs=inputs,
        outputs=outputs,
        name="jaxattn_flex_tpu_forward",
        interpret=interpret,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        scalars=scalars,
        scratch=scratch,
    )
    return jnp.swapaxes(out, 1, 2), lse[:, :, 0]


def _forward_program(cfg, scalar_shapes: dict, stream: bool, T: int, S: int, lanes, pairs, refs):
    """One program (b, n, query tile i) of _forward: the TPU views of its refs (scalars in SMEM, rows,
    streamed keys) and its hooks (a bias's Toeplitz tiles or a window bias's slices, the tables' lanes,
    per-pair tables' slices) around the flash core's forward body."""
    r, own, lane_refs, pair_refs = refs
    _, _, _, bl, bsched = cfg.batched
    pick, G, Tp = tile_math.pick, cfg.N // cfg.K, cfg.Tn * cfg.Tb
    b, n, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lead = (pick(bsched, b), pick(cfg.head_kinds, n), i)
    r = r._replace(
        order=scalars_at(r.order, scalar_shapes.get("order"), lead),
        counts=scalars_at(r.counts, scalar_shapes["counts"], lead),
        lengths=scalars_at(r.lengths, scalar_shapes.get("lengths"), (pick(bl, b),)),
        sinks=scalars_at(r.sinks, scalar_shapes.get("sinks"), (b, n)),
        **rows_of(r, ("q_pos", "k_pos", "q_seg", "k_seg", "lse")),
    )
    if stream:
        h = lax.div(n, G)
        k, v = Streamed(r.k, own.k_tile, own.key_sem, b, h), Streamed(r.v, own.v_tile, own.key_sem, b, h)
        r = r._replace(k=k, v=v)
    hooks = ForwardHooks()
    if r.offset_bias is not None:  # tile (i, j)'s bias starts at entry j * Sb - i * Tb + Tp - Tb (rows_of_grid)
        rows_of_grid = r.offset_bias
        start = lambda j: j * cfg.Sb - i * cfg.Tb + (Tp - cfg.Tb)  # noqa: E731
        hooks = ForwardHooks(bias_of_key_tile=lambda j: toeplitz_tile(rows_of_grid, start(j), cfg.Tb, cfg.Sb))
    if own.pair_bias is not None:  # key tile j's columns, an aligned dynamic slice as k and v are read
        pair_bias = own.pair_bias
        columns = lambda j: pl.ds(pl.multiple_of(j * cfg.Sb, cfg.Sb), cfg.Sb)  # noqa: E731
        hooks = ForwardHooks(bias_of_key_tile=lambda j: pair_bias[:, columns(j)])
    if lanes is not None:
        lane_refs = tables_tpu.streamed_refs(lane_refs, lanes, n)
        hooks = merged(hooks, tables_tpu.forward_hooks(cfg, r, lane_refs, lanes, i, T, S))
    if pairs is not None:
        hooks = merged(hooks, pairs_tpu.forward_hooks(pairs, r, pair_refs, n, i))
    forward_kernel(cfg, r, hooks)


def attention(call: AttentionCall, query, key, value, interpret=False):
    """The AttentionCall's attention computed forward by the Pallas TPU kernel (module docstring); its
    gradient (q, k, v, sinks, a position bias's table or slopes, Shaw's or DeBERTa's tables) by flex_tpu_vjp's
    kernels where flex_tpu_vjp.backward_refusal and tables_tpu.backward_refusal let them, else (a window's
    bias, a score_mod's closed-over arrays, blocks over VMEM) the blockwise engine's. ValueError naming the
    option it cannot express (unsupported)."""
    problem = unsupported(call, query, key, value, interpret)
    if problem is not None:
        checks.fail(
            "implementation",
            f'the XLA engines ("dense", "blockwise" or None) with {problem}: the Pallas '
            "TPU flex kernel cannot express it",
            '"pallas_tpu"',
        )
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    call = call.replace(block_size=None)  # the kernel's tiles are its own
    if query.shape[-3] == 0 or key.shape[-3] == 0:
        return blockwise.tiled(call, query, key, value)
    flex, args = of_call(call, query, key, value, interpret)

    @jax.custom_vjp
    def run(args: KernelArgs):
        return flex.forward(args)[0]

    def run_fwd(args: KernelArgs):
        result, lse = flex.forward(args)
        return result, (args, result, lse)

    def run_bwd(residuals, cotangent):
        args, result, lse = residuals
        grads = flex.kernel_grads(args, result, lse, cotangent) if flex.kernel_backward else None
        return (flex.engine_grads(args, cotangent) if grads is None else grads,)

    run.defvjp(run_fwd, run_bwd)
    return run(args)


def gradients_at(call: AttentionCall, query, key, value, out, lse, d_out, interpret=False):
    """flash_gpu.ResidualGrads by flex_tpu_vjp's kernels at residuals given by the caller, out [...,T,N,Hv] and
    lse [...,N,T] of a softmax over more keys than `key` (flash_gpu.gradients_at: a ring_attention step's share of
    the whole softmax's gradient, and with an OffsetBias the cotangent of its rows flash_gpu.bias_rows_at(call,
    T, S)); None where flash_gpu.residual_refusal names an option, the call has Shaw's tables (the TPU kernel takes
    them at the default positions only, which a ring step's are not), this kernel refuses the call or its
    backward is not the kernels' (then the caller takes the gradient through the forward)."""
    if flash_gpu.residual_refusal(call) is not None or call.has_tables:
        return None
    if unsupported(call, query, key, value, interpret) or min(np.shape(query)[-3], np.shape(key)[-3]) == 0:
        return None
    flex, args = of_call(call.replace(return_lse=False, block_size=None), query, key, value, interpret)
    if not flex.kernel_backward:
        return None
    inner = flex.from_rows(flex.inner(args.sinks, args.consts, args.indices), args.bias_rows)
    p = flex.prepare(inner, args.query, args.key, args.value)
    grads = flex.kernel_grads(args, jnp.asarray(out), plan.kernel_lse(p, lse), jnp.asarray(d_out))
    if grads is None:
        return None
    # of_call's bias rows are rows(*offset_range(T, S, True)): bias_rows_at's (the kernel takes default positions)
    bias_rows = grads.bias_rows if call.position_bias is not None else None
    return flash_gpu.ResidualGrads(grads.query, grads.key, grads.value, bias_rows)


class KernelArgs(NamedTuple):
    """The kernel's differentiable inputs (attention's custom VJP): q, k, v, sinks, the score_mod's closed-over
    arrays, the engine's (closure conversion's consts: its backward's route to a bias's table or slopes), a
    position bias's rows, Shaw's / DeBERTa's tables and per-pair tables by name, and the call's index arrays
    and BlockMask (zero cotangents: a custom VJP that closed over them would capture the tracers of an
    enclosing trace)."""

    query: Any
    key: Any
    value: Any
    sinks: Any
    consts: tuple
    engine_consts: tuple
    bias_rows: Any
    table_arrays: dict
    pair_arrays: dict
    indices: dict


def of_call(call: AttentionCall, query, key, value, interpret: bool) -> tuple:
    """(Flex, KernelArgs) of a call: what stays static and what is differentiated.

    Differentiable inputs are explicit (custom_vjp): q, k, v, sinks, the score_mod's closed-over arrays (traced
    out of it), a position bias's rows, Shaw's / DeBERTa's / per-pair tables; the rest (positions, lengths,
    segment ids, mask_mod, BlockMask) are index inputs with zero cotangents."""
    score = mods.element_function("score_mod", call.score_mod, accumulation_dtype(query.dtype))
    consts = () if score is None else tuple(jnp.asarray(c) for c in score.consts)
    T, S = query.shape[-3], key.shape[-3]
    table_bias = isinstance(call.position_bias, TableBias)
    offsets = None if call.position_bias is None or table_bias else call.position_bias.offset_range(T, S, True)
    # What the kernel reads of a position bias: its rows, differentiable (flex_tpu_vjp's cotangent for them
    # reaches the table or slopes through rows(); under the XLA backward they get zeros, the engine's formula
    # the gradient); a window's table, which only the engine differentiates
    bias_rows = None if offsets is None else call.position_bias.rows(*offsets)
    if table_bias:
        bias_rows = lax.stop_gradient(jnp.asarray(call.position_bias.table))
    blocks = (INTERPRET_BLOCK, INTERPRET_BLOCK) if interpret else (LANES, LANES)
    # What the kernel reads of Shaw's tables or DeBERTa's, by name: differentiable inputs, as the bias rows
    # (flex_tpu_vjp's cotangent for their lanes reaches the tables through them; under the XLA backward they get
    # zeros, the engine's formula the gradient, through the closure conversion below)
    table_arrays = position_tables(call, query, key, value)
    pair_arrays = pair_inputs(call, query, key, value)  # per-pair tables: differentiable inputs too (pairs_tpu)
    # The call's index arrays and BlockMask are inputs too (with zero cotangents): a custom VJP that closed
    # over them would capture the tracers of an enclosing trace (jit of grad of an eager-compiled call).
    indices = {name: getattr(call, name) for name in (*INDEX_ARRAYS, "block_mask") if getattr(call, name) is not None}
    lanes = INTERPRET_BLOCK if interpret else LANES
    refusal = flex_tpu_vjp.backward_refusal(call, query, bool(consts))
    if refusal is None and table_arrays:
        layout = tables_tpu.table_layout(call, *blocks, T, S)
        refusal = tables_tpu.backward_refusal(layout, S, query.shape[-1], value.shape[-1], query.dtype, lanes)
    rows_per_example = offsets is not None and bias_rows.ndim > 2
    flex = Flex(call, score, offsets, table_bias, rows_per_example, T, S, blocks, interpret, refusal is None, None)
    engine, engine_consts = flex.engine, ()
    # A position bias closes over its table or slopes, the call over Shaw's or DeBERTa's tables: closure
    # conversion of the engine's attention turns them into explicit inputs, differentiated by the engine's
    # backward with the scheme's own formula (its memory as the engine's: a gather from the rows, T + S of
    # them for ALiBi, took a TPU far more).
    if call.position_bias is not None or table_arrays or pair_arrays:
        engine, engine_consts = jax.closure_convert(engine, query, key, value, call.sinks, consts, indices)
    flex = dataclasses.replace(flex, converted=engine)
    args = KernelArgs(
        query, key, value, call.sinks, consts, tuple(engine_consts), bias_rows, table_arrays, pair_arrays, indices
    )
    return flex, args


@dataclasses.dataclass(frozen=True)
class Flex:
    """One call's static side in the flex kernel's custom VJP: the call, its score_mod traced out of its
    arrays, a position bias's offsets (or a window's table bias), the tiles, and which backward runs
    (kernel_backward: flex_tpu_vjp's kernels; else `converted`, the XLA engine's attention closure-converted
    to take the bias's and tables' arrays as inputs)."""

    call: AttentionCall
    score: Any  # mods.ElementProgram of score_mod, or None
    offsets: Any  # the position bias's offset range, or None
    table_bias: bool  # a window's TableBias (read from the input table)
    rows_per_example: bool  # the bias rows differ by batch entry (ALiBi's per-example slopes)
    T: int
    S: int
    blocks: tuple
    interpret: bool
    kernel_backward: bool
    converted: Any  # (query, key, value, sinks, consts, indices, *engine_consts) -> the engine's result

    def inner(self, sinks, consts, indices) -> AttentionCall:
        """The call, its array parts replaced by the custom VJP's inputs."""
        inner = self.call.replace(sinks=sinks, **indices)
        if self.score is None:
            return inner
        score = self.score
        return inner.replace(score_mod=lambda x, b, n, t, s: score.fn(x, b, n, t, s, *consts))

    def from_rows(self, inner: AttentionCall, rows) -> AttentionCall:
        """The position bias read from its rows, as the kernels read it."""
        return inner if self.offsets is None else inner.replace(position_bias=of_rows(rows, *self.offsets))

    def engine(self, query, key, value, sinks, consts, indices):
        """The XLA blockwise engine on the call."""
        call, T, S = self.call, self.T, self.S
        if self.rows_per_example:  # a bias per batch entry (ALiBi's per-example slopes): the engine takes one
            # from positions with a batch axis (the default positions, written out)
            batch = query.shape[:-3]
            indices = dict(
                indices,
                query_positions=jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) + (S - T), (*batch, T)),
                key_positions=jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (*batch, S)),
            )
        inner = self.inner(sinks, consts, indices)
        if call.row_tables is not None:  # DeBERTa's terms: no XLA engine takes RowTables; as a score_mod
            scale = query.shape[-1] ** -0.5 if call.scale is None else call.scale
            acc_dtype = accumulation_dtype(query.dtype)
            score_mod = row_tables.as_score_mod(
                call.row_tables, query, key, scale, call.precision, acc_dtype, inner.score_mod
            )
            inner = inner.replace(row_tables=None, score_mod=score_mod)
        return blockwise.tiled(inner, query, key, value)

    def prepare(self, inner: AttentionCall, query, key, value) -> plan.Prepared:
        # the tables reach the kernels as table_arrays' lanes (tables_tpu.call_lanes), not as prepare's per-row arrays
        inner = inner.replace(key_table=None, value_table=None, max_distance=None, row_tables=None)
        inner = inner.replace(rel_key=None, rel_value=None)  # per-pair tables: laid_pairs' arrays
        head_multiple = None if self.interpret else LANES
        return plan.prepare(inner, query, key, value, self.interpret, blocks=self.blocks, head_multiple=head_multiple)

    def lanes(self, p: plan.Prepared, table_arrays):
        """The tables' lanes (tables_tpu.call_lanes), as the forward lays them out."""
        acc_dtype = accumulation_dtype(p.q.dtype)
        Hp, Hvp = p.q.shape[-1], p.v.shape[-1]
        return tables_tpu.call_lanes(self.call, table_arrays, p.cfg.Tb, p.cfg.Sb, self.T, self.S, Hp, Hvp, acc_dtype)

    def forward(self, a: KernelArgs):
        """(the call's result, the kernel's lse [B,N,Tp])"""
        inner = self.from_rows(self.inner(a.sinks, a.consts, a.indices), a.bias_rows)
        if self.table_bias:  # the same bias, from the input table
            inner = inner.replace(position_bias=dataclasses.replace(self.call.position_bias, table=a.bias_rows))
        p = self.prepare(inner, a.query, a.key, a.value)
        tables = self.lanes(p, a.table_arrays) if a.table_arrays else None
        pairs = laid_pairs(a.pair_arrays, p, self.interpret) if a.pair_arrays else None
        pair_bias = pair_bias_of_grid(p) if self.table_bias else None
        out, lse = _forward(p, self.S, self.interpret, pair_bias, tables, pairs)
        return plan.finish(p, out, lse, inner.return_lse), lse

    def kernel_grads(self, args: KernelArgs, result, lse, cotangent) -> Optional[KernelArgs]:
        """The cotangents of args by flex_tpu_vjp's kernels (None: the call has a term they lack)."""
        call, T, S, interpret = self.call, self.T, self.S, self.interpret
        query, key, value = args.query, args.key, args.value
        inner = self.inner(args.sinks, args.consts, args.indices)
        p = self.prepare(self.from_rows(inner, args.bias_rows), query, key, value)
        if p.side.score_consts or p.side.mask_consts:
            return None
        batch, N, Hv = query.shape[:-3], query.shape[-2], value.shape[-1]
        B, Tp, Hvp = p.q.shape[0], p.cfg.Tn * p.cfg.Tb, p.v.shape[-1]
        out, d_out = (result[0], cotangent[0]) if call.return_lse else (result, cotangent)
        d_lse = cotangent[1].reshape(B, N, T) if call.return_lse else None
        rows = lambda x: x.reshape(B, T, N, Hv)  # noqa: E731
        delta = backward.row_delta(rows(out), rows(d_out), d_lse, Tp, accumulation_dtype(query.dtype))
        d_out = plan.kernel_layout(d_out, batch, T, Tp, Hvp)
        rows_of_grid = None if self.offsets is None else offset_rows_of_grid(p, S)
        tables = self.lanes(p, args.table_arrays) if args.table_arrays else None
        pairs = laid_pairs(args.pair_arrays, p, interpret) if args.pair_arrays else None
        dq, dk, dv, d_rows, d_lanes, d_laid = flex_tpu_vjp.gradients(
            p, lse, delta, d_out, interpret, rows_of_grid, tables, S, pairs
        )
        d_sinks = None if p.side.sinks is None else backward.sinks_grad(p.side.sinks, lse, delta)
        if d_rows is not None and rows_of_grid.shape[0] == 1:  # one set of rows for every batch entry
            d_rows = jnp.sum(d_rows, axis=0, keepdims=True)
        d_tables = self.table_grads(p, args.table_arrays, tables, d_lanes)
        d_pairs = pair_grads(p, args.pair_arrays, pairs, d_laid, interpret)

        def layout(query, key, value, sinks, bias_rows):  # prepare's arrays: pulled back, the padding drops
            laid = self.prepare(self.from_rows(inner.replace(sinks=sinks), bias_rows), query, key, value)
            grid_rows = None if self.offsets is None else offset_rows_of_grid(laid, S)
            return laid.q, laid.k, laid.v, laid.side.sinks, grid_rows

        dq, dk, dv, d_sinks, d_bias_rows = jax.vjp(layout, query, key, value, args.sinks, args.bias_rows)[1](
            (dq, dk, dv, d_sinks, d_rows)
        )
        # no score_mod consts (backward_refusal); the position bias's through bias_rows, the engine's consts none
        return zeros_like_tree(args)._replace(
            query=dq,
            key=dk,
            value=dv,
            sinks=d_sinks,
            bias_rows=d_bias_rows,
            table_arrays=d_tables,
            pair_arrays=d_pairs,
        )

    def table_grads(self, p: plan.Prepared, table_arrays, tables, d_lanes):
        """d table_arrays from the kernels' d lanes [B,N,E,F], one per (b, n): summed over the batch (a shared
        table's [1,E,F] over the heads too), then pulled back through the layout to the tables."""
        if tables is None:
            return zeros_like_tree(table_arrays)

        def summed(d, laid):
            d = jnp.sum(d, axis=0, keepdims=laid.shape[0] == 1)
            return jnp.sum(d, axis=1) if laid.shape[0] == 1 else d

        d_lanes = {name: summed(d, tables[1][name]).astype(tables[1][name].dtype) for name, d in d_lanes.items()}
        return jax.vjp(lambda t: self.lanes(p, t)[1], table_arrays)[1](d_lanes)[0]

    def engine_grads(self, args: KernelArgs, cotangent) -> KernelArgs:
        """The cotangents of args by the XLA blockwise engine's backward (it recomputes its own forward); the
        bias's and tables' through engine_consts."""
        _, engine_vjp = jax.vjp(
            lambda query, key, value, sinks, consts, engine_consts: self.converted(
                query, key, value, sinks, consts, args.indices, *engine_consts
            ),
            args.query,
            args.key,
            args.value,
            args.sinks,
            args.consts,
            args.engine_consts,
        )
        dq, dk, dv, d_sinks, d_consts, d_engine_consts = engine_vjp(cotangent)
        return zeros_like_tree(args)._replace(
            query=dq, key=dk, value=dv, sinks=d_sinks, consts=d_consts, engine_consts=d_engine_consts
        )


def pair_grads(p: plan.Prepared, pair_arrays, pairs, d_laid, interpret: bool):
    """d per-pair tables from the kernels' [Tp,Nt,F,Sp] (summed over the batch, and a shared table's heads, in
    the kernel): pulled back through the layout."""
    if pairs is None:
        return zeros_like_tree(pair_arrays)
    d_laid = {name: d.astype(pairs[1][name].dtype) for name, d in d_laid.items()}
    return jax.vjp(lambda t: laid_pairs(t, p, interpret)[1], pair_arrays)[1](d_laid)[0]


def position_tables(call: AttentionCall, query, key, value) -> dict:
    """The arrays of a call's Shaw tables (checked, in the compute dtype: key_table / value_table) or RowTables
    (key_rows / query_rows and the int32 row_of_offset), by name; {} without tables."""
    acc_dtype = accumulation_dtype(query.dtype)
    if call.has_tables:
        N, H, Hv = query.shape[-2], query.shape[-1], value.shape[-1]
        checked = blockwise.check_tables(call.key_table, call.value_table, call.max_distance, N, H, Hv, acc_dtype)
        return {name: x for name, x in zip(("key_table", "value_table"), checked[:2]) if x is not None}
    tables = call.row_tables
    if tables is None:
        return {}
    arrays = {"key_rows": tables.key_rows, "query_rows": tables.query_rows}
    arrays = {name: jnp.asarray(x, acc_dtype) for name, x in arrays.items() if x is not None}
    return dict(arrays, row_of_offset=jnp.asarray(tables.row_of_offset, jnp.int32))


def pair_inputs(call: AttentionCall, query, key, value) -> dict:
    """A call's per-pair tables (rel_key [T,S,N|1,H], rel_value [T,S,N|1,Hv]), checked, by name; {} without."""
    T, S, N, H, Hv = query.shape[-3], key.shape[-3], query.shape[-2], query.shape[-1], value.shape[-1]
    acc_dtype = accumulation_dtype(query.dtype)
    tables = checks.check_pair_tables(call.rel_key, call.rel_value, T, S, N, H, Hv, acc_dtype)
    return {name: table for name, table in zip(pairs_tpu.TABLES, tables) if table is not None}


def laid_pairs(arrays: dict, p: plan.Prepared, interpret: bool):
    """(PairTables, {name: [Tp,Nt,F,Sp]}): per-pair tables (pair_inputs) as the kernels read them (pairs_tpu)."""
    cfg = p.cfg
    Tp, Sp = cfg.Tn * cfg.Tb, cfg.Sn * cfg.Sb
    laid = {name: pairs_tpu.layout(x, Tp, Sp) for name, x in arrays.items()}
    return pairs_tpu.of_call(arrays, p.q.shape[0], p.N, cfg.Tb, cfg.Sb, cfg.precision, interpret), laid


def zeros_like_tree(tree):
    """Zero cotangents for every array of a tree (float0 for integer arrays)."""
    return jax.tree.map(_zero_cotangent, tree)


def _zero_cotangent(x):
    """The cotangent of an input that gets no gradient: float0 zeros for an integer array (JAX's rule)."""
    x = jnp.asarray(x)
    if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
        return np.zeros(x.shape, jax.dtypes.float0)
    return jnp.zeros_like(x)
