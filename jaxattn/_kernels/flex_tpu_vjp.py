"""The TPU flex kernel's backward: the flash core's dq and dk/dv bodies (flash.backward.dq_kernel / dkv_kernel,
FlashAttention-2's backward, which the Pallas GPU kernel runs too) run by Mosaic on the TPU layout, as the
forward runs flash.forward's.

    dq,    grid (b, n, query tile i):             q, do [Tb,H], lse, delta [Tb,1]; k, v [Sp,H] of head n // G
    dk/dv, grid (b, key head h, key tile j, g):   q, do [Tp,H], lse, delta [Tp,1] of query head h G + g;
                                                  k, v [Sb,H]; dk, dv summed over g in order ("arbitrary")
    layout: q, do [B,N,Tp,Hp], k, v [B,K,Sp,Hp] (prepare's padded arrays, transposed as the forward's),
    lse and delta [B,N,Tp,1]: columns, so that a tile broadcasts them along its keys without a relayout;
    positions and segment ids as rows [B|1,1,L] (refs_tpu.Row), the schedules flattened in SMEM
    (refs_tpu.Scalars; the dk/dv kernel's over query tiles, plan.schedules' transposed one).

For the calls backward_refusal lets through: score_mod and mask_mod closing over no array, a BlockMask,
causal, window, chunks, lengths, segment ids, softcap, sinks, GQA, a position bias of j - i (T5's, ALiBi's:
an OffsetBias, its rows' gradient summed per offset without a scatter, gradients()), and Shaw's and DeBERTa's
tables (tables_tpu: their lanes' gradients summed per (b, n) in the dq kernel, no scatter). A window's bias
(Swin, BEiT) or a score_mod's arrays keep the XLA blockwise engine's backward, and so do a query axis whose
one head's rows do not fit VMEM in one dk/dv program and tables whose dq blocks do not (tables_tpu.
backward_refusal). interpret=True runs Pallas' interpreter (the CPU tests).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._core.call import AttentionCall
from .._core.offset_bias import OffsetBias
from . import pairs_tpu, tables_tpu
from .flash import backward, call as flash_call, plan, tile_math
from .flash.refs import DkvHooks, DqHooks, Refs, merged
from .refs_tpu import IN_HBM, Streamed, TpuRefs, lane_window, rows_of, scalars_at, toeplitz_tile, undiagonals, window

# One head's rows a kernel holds whole in VMEM (double-buffered by the pipeline): the forward's and the dq
# kernel's keys and values, the dk/dv kernel's queries and their cotangent; T or S up to 16k at head dim 128 in
# bf16. Past it they stay in HBM and each tile is copied in when the kernel reaches it (streamed). Beside per-pair
# tables (pairs_tpu), whose slices, products and gradients take about 4 MiB of VMEM more, half of it.
MAX_ROWS_BYTES = 8 * 2**20
MAX_ROWS_BYTES_BESIDE_PAIRS = MAX_ROWS_BYTES // 2
# The dk/dv kernel holds [1,T] rows of lse, delta and the query positions (and segment ids) whole, each padded to
# 8 sublanes and double-buffered: 4 MiB apiece at 32k.
MAX_QUERY_ROWS = 2**15


def backward_refusal(call: AttentionCall, query, has_consts: bool) -> Optional[str]:
    """None when the kernels here compute the gradient of a call the TPU flex kernel computes forward; else
    what keeps the XLA engine's backward (module docstring)."""
    if call.position_bias is not None and not isinstance(call.position_bias, OffsetBias):
        return "position_bias (a window's bias)"
    if has_consts:
        return "score_mod / mask_mod closing over arrays"
    T = np.shape(query)[-3]
    if T > MAX_QUERY_ROWS:
        return f"query (T={T} > {MAX_QUERY_ROWS}: the dk/dv kernel's rows of lse, delta and positions in VMEM)"
    return None


def streamed(L: int, H: int, Hv: int, dtype, beside_pairs: bool = False) -> bool:
    """Whether one head's rows (keys and values, or queries and their cotangent: L of them, padded head dims H,
    Hv) overrun MAX_ROWS_BYTES (MAX_ROWS_BYTES_BESIDE_PAIRS beside per-pair tables), so that a kernel reads them
    a tile at a time from HBM (refs_tpu.Streamed) instead of holding them whole in VMEM."""
    limit = MAX_ROWS_BYTES_BESIDE_PAIRS if beside_pairs else MAX_ROWS_BYTES
    return L * (H + Hv) * np.dtype(dtype).itemsize > limit


def _spec(shape, index, buffers=2):
    """A BlockSpec whose index map ignores the scalar-prefetch refs; buffers=1: one copy in VMEM, not the
    pipeline's two (tables_tpu.key_buffers)."""
    mode = pl.Buffered(1) if buffers == 1 else None
    return pl.BlockSpec(shape, lambda *ids: index(*ids[:3]), pipeline_mode=mode)


class _Backward(NamedTuple):
    """One backward call as both kernels read it: the prepared call, q, k, v and do transposed to the kernels'
    [B,heads,L,F], the Pallas options, and the position terms it carries (gradients' arguments)."""

    p: plan.Prepared
    q: Any
    k: Any
    v: Any
    do: Any
    interpret: bool
    rows_of_grid: Any
    tables: Any
    S: Any
    pairs: Any

    @property
    def G(self) -> int:  # query heads per key head
        return self.q.shape[1] // self.k.shape[1]


def _scalar_inputs(side, order, counts):
    """The SMEM scalars of one kernel (its schedule, the key lengths) flattened, and their shapes by name, which
    refs_tpu.scalars_at indexes them with."""
    arrays = {"counts": counts}
    if order is not None:
        arrays["order"] = order
    if side.lengths is not None:
        arrays["lengths"] = side.lengths
    return {name: x.reshape(-1) for name, x in arrays.items()}, {name: x.shape for name, x in arrays.items()}


def _bias_start(cfg, Tp: int, i, j):
    """Tile (i, j)'s first entry in rows_of_grid: its smallest offset j Sb - i Tb - (Tb - 1), moved by Tp - 1."""
    return j * cfg.Sb - i * cfg.Tb + (Tp - cfg.Tb)


def _call(c: _Backward, kernel, name, grid, scalars, inputs, outputs, compiler_params, scratch=None, aliases=None):
    """One of the two kernels' pallas_call, its operands by name (flash.call.named_call) bound to every ref tuple
    the bodies and this module's hooks read."""
    return flash_call.named_call(
        kernel,
        (Refs, TpuRefs, tables_tpu.LaneRefs, pairs_tpu.PairRefs),
        grid=grid,
        inputs=inputs,
        outputs=outputs,
        name=name,
        interpret=c.interpret,
        compiler_params=compiler_params,
        scalars=scalars,
        scratch=scratch,
        aliases=aliases,
    )


def _key_buffers(c: _Backward) -> int:
    """Copies of one head's k and v the dq kernel holds in VMEM: two, one where the tables' blocks leave room for
    only one, or none: each key tile copied in from HBM when the kernel reaches it (refs_tpu.Streamed), as the
    forward does past MAX_ROWS_BYTES."""
    Sp, Hp, Hvp = c.k.shape[2], c.q.shape[-1], c.v.shape[-1]
    if c.tables is None:
        return 0 if streamed(Sp, Hp, Hvp, c.k.dtype, c.pairs is not None) else 2
    return tables_tpu.key_buffers(c.tables[0], Sp, Hp, Hvp, c.q.dtype, 1)


def _dq_operands(c: _Backward, lse, delta, buffers: int):
    """The dq kernel's (scalars, their shapes, inputs, outputs, scratch) on grid (b, n, query tile i): one
    query tile of q, do, lse and delta, the whole keys of head n // G (or HBM refs and a tile's scratch), the
    rows of offsets and their gradient, [B,N,1,E], summed over the query tiles of (b, n)."""
    cfg, side, q, k, v, do = c.p.cfg, c.p.side, c.q, c.k, c.v, c.do
    B, N, _, Hp = q.shape
    Sp, Hvp, G = k.shape[2], v.shape[-1], c.G
    pick = tile_math.pick
    columns = lse[..., None], delta[..., None]  # [B,N,Tp,1]: a tile's rows at a time
    scalars, shapes = _scalar_inputs(side, side.order, side.counts)  # the forward's schedule
    inputs = {
        "q": (q, _spec((None, None, cfg.Tb, Hp), lambda b, n, i: (b, n, i, 0))),
        "do": (do, _spec((None, None, cfg.Tb, Hvp), lambda b, n, i: (b, n, i, 0))),
        "lse": (columns[0], _spec((None, None, cfg.Tb, 1), lambda b, n, i: (b, n, i, 0))),
        "delta": (columns[1], _spec((None, None, cfg.Tb, 1), lambda b, n, i: (b, n, i, 0))),
        # lax.div: n >= 0, and Mosaic lowers floor division through sign, which asks the TPU generation
        "k": (k, _spec((None, None, Sp, Hp), lambda b, n, i: (b, lax.div(n, G), 0, 0), buffers)),
        "v": (v, _spec((None, None, Sp, Hvp), lambda b, n, i: (b, lax.div(n, G), 0, 0), buffers)),
        # positions and segment ids as rows: the query tile's, every key's (lengths: scalars)
        **flash_call.index_inputs(
            side, cfg.batched, (cfg.Tb, lambda b, n, i, *_: i), (Sp, lambda b, n, i, *_: 0), rows=True, lengths=False
        ),
    }
    scratch = {}
    if buffers == 0:  # the keys in HBM, read a tile at a time
        inputs["k"], inputs["v"] = (k, IN_HBM), (v, IN_HBM)
        scratch.update(
            k_tile=pltpu.VMEM((cfg.Sb, Hp), k.dtype),
            v_tile=pltpu.VMEM((cfg.Sb, Hvp), v.dtype),
            key_sem=pltpu.SemaphoreType.DMA(()),
        )
    dq_spec = _spec((None, None, cfg.Tb, Hp), lambda b, n, i: (b, n, i, 0))
    outputs = {"dq": (jax.ShapeDtypeStruct(q.shape, q.dtype), dq_spec)}
    if c.rows_of_grid is not None:
        batched, E = cfg.offset_bias[1], c.rows_of_grid.shape[-1]
        rows_spec = _spec((None, None, 1, E), lambda b, n, i: (pick(batched, b), n, 0, 0))
        inputs["offset_bias"] = (c.rows_of_grid, rows_spec)
        grad_rows = jax.ShapeDtypeStruct((B, N, 1, E), jnp.float32)
        outputs["d_offset_bias"] = (grad_rows, _spec((None, None, 1, E), lambda b, n, i: (b, n, 0, 0)))
    return scalars, shapes, inputs, outputs, scratch


def _dq_table_operands(c: _Backward, inputs, outputs, scratch):
    """Adds the tables' and the per-pair tables' operands to the dq kernel's (in place); returns its aliases.

    Each table's lanes for head n (or the shared table's), their gradients per (b, n) (tables_tpu); per-pair
    tables in HBM, their gradients zeros in HBM aliased to the outputs, stored or added into in order
    (pairs_tpu)."""
    cfg, B, N = c.p.cfg, c.q.shape[0], c.q.shape[1]
    Hp, Hvp = c.q.shape[-1], c.v.shape[-1]
    pick = tile_math.pick
    aliases = {}
    if c.tables is not None and c.tables[0].streamed:  # in HBM: a window copied in, its gradient added into
        lanes, arrays = c.tables
        x = arrays["key_rows"]
        inputs["key_rows"] = (x, IN_HBM)
        inputs["d_key_rows_zeros"] = (jnp.zeros((B, N, *x.shape[1:]), jnp.float32), IN_HBM)
        outputs["d_key_rows"] = (jax.ShapeDtypeStruct((B, N, *x.shape[1:]), jnp.float32), IN_HBM)
        aliases["d_key_rows_zeros"] = "d_key_rows"
        scratch.update(tables_tpu.streamed_scratch(lanes, x.shape[-1], grads=True))
    elif c.tables is not None:
        lanes, arrays = c.tables
        for name, x in arrays.items():
            heads = x.shape[0] > 1
            inputs[name] = (x, _spec((None, *x.shape[1:]), lambda b, n, i, heads=heads: (pick(heads, n), 0, 0)))
            grad = jax.ShapeDtypeStruct((B, N, *x.shape[1:]), jnp.float32)
            outputs["d_" + name] = (grad, _spec((None, None, *x.shape[1:]), lambda b, n, i: (b, n, 0, 0)))
        for names, table in ((("qx", "d_qx"), "key_rows"), (("dox", "p_lanes"), "value_rows")):
            for name in names if getattr(lanes, table) else ():  # [Tb,E] float32 each (tables_tpu)
                scratch[name] = pltpu.VMEM((cfg.Tb, lanes.E), jnp.float32)
    if c.pairs is not None:
        pair_tables, arrays = c.pairs
        inputs.update(pairs_tpu.inputs(arrays))
        for name, x in arrays.items():
            dtype = pairs_tpu.gradient_dtype(pair_tables, name, x.dtype)
            inputs["d_" + name + "_zeros"] = (jnp.zeros(x.shape, dtype), IN_HBM)
            outputs["d_" + name] = (jax.ShapeDtypeStruct(x.shape, dtype), IN_HBM)
            aliases["d_" + name + "_zeros"] = "d_" + name
        scratch.update(pairs_tpu.scratch(pair_tables, arrays, Hp, Hvp, grads=True))
    return aliases


def _dq_offset_bias_hooks(c: _Backward, r: Refs, i) -> DqHooks:
    """Query tile i's bias of key tile j as a window of its head's row rolled into the tile's diagonals
    (refs_tpu.toeplitz_tile), as in the forward; its gradient the inverse roll summed over the tile's rows
    (undiagonals), added into the program's row of offsets, which starts at zeros on the first query tile."""
    cfg, Tp = c.p.cfg, c.q.shape[2]
    W = window(cfg.Tb, cfg.Sb)
    rows_of_bias, d_rows = r.offset_bias, r.d_offset_bias

    @pl.when(i == 0)
    def _():
        d_rows[...] = jnp.zeros(d_rows.shape, d_rows.dtype)

    def add(j, d_bias):  # d rows[start + (Tb - 1 - t) + s] += d_bias[t, s]
        start = _bias_start(cfg, Tp, i, j)
        at, offset = lane_window(start, W)
        sums = jnp.sum(undiagonals(d_bias.astype(jnp.float32), offset, W), axis=0)
        d_rows[0, at] = d_rows[0, at] + sums

    return DqHooks(
        bias_of_key_tile=lambda j: toeplitz_tile(rows_of_bias, _bias_start(cfg, Tp, i, j), cfg.Tb, cfg.Sb),
        add_bias_grad=add,
    )


def _dq_kernel(c: _Backward, shapes, buffers: int):
    """The dq program of (b, n, query tile i): its refs read as flash.backward.dq_kernel reads them (the
    schedule's and lengths' scalars at (b, n, i), positions as rows, streamed keys), and the hooks of the
    position terms it carries."""
    cfg, G = c.p.cfg, c.G
    bl, bsched = cfg.batched[3], cfg.batched[4]
    pick = tile_math.pick

    def dq(refs):
        r, own, lane_refs, pair_refs = refs
        b, n, i = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        lead = (pick(bsched, b), pick(cfg.head_kinds, n), i)
        r = r._replace(
            order=scalars_at(r.order, shapes.get("order"), lead),
            counts=scalars_at(r.counts, shapes["counts"], lead),
            lengths=scalars_at(r.lengths, shapes.get("lengths"), (pick(bl, b),)),
            **rows_of(r, ("q_pos", "k_pos", "q_seg", "k_seg")),
        )
        if buffers == 0:
            h = lax.div(n, G)
            k, v = Streamed(r.k, own.k_tile, own.key_sem, b, h), Streamed(r.v, own.v_tile, own.key_sem, b, h)
            r = r._replace(k=k, v=v)
        hooks = DqHooks()
        if r.offset_bias is not None:
            hooks = _dq_offset_bias_hooks(c, r, i)
        if c.tables is not None:
            lane_refs = tables_tpu.streamed_refs(lane_refs, c.tables[0], n, b)
            hooks = merged(hooks, tables_tpu.dq_hooks(cfg, r, lane_refs, c.tables[0], i, c.p.T, c.S))
        if c.pairs is not None:
            hooks = merged(hooks, pairs_tpu.dq_hooks(c.pairs[0], r, pair_refs, n, i))
        backward.dq_kernel(cfg, r, hooks)

    return dq


def _dq(c: _Backward, lse, delta):
    """(dq [B,N,Tp,Hp], d rows_of_grid or None, d tables by name, d per-pair tables by name): the dq kernel.

    Its grid walks the query tiles of one (b, n) in order ("arbitrary") where the rows of offsets' or the
    tables' gradients sum over them in one output block (O(T + S) per head, no atomics); every program in order
    beside per-pair tables, whose gradients' slices any program may add into."""
    buffers = _key_buffers(c)
    scalars, shapes, inputs, outputs, scratch = _dq_operands(c, lse, delta, buffers)
    aliases = _dq_table_operands(c, inputs, outputs, scratch)
    if c.rows_of_grid is None and c.tables is None:
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel"))
    else:
        params = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"))
    if c.pairs is not None:
        params = pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary", "arbitrary"))
    grid = (c.q.shape[0], c.q.shape[1], c.p.cfg.Tn)
    kernel = _dq_kernel(c, shapes, buffers)
    dq_out, *d_extra = _call(c, kernel, "jaxattn_flex_tpu_dq", grid, scalars, inputs, outputs, params, scratch, aliases)
    d_rows = d_extra[:1] if c.rows_of_grid is not None else []
    n_tables = 0 if c.tables is None else len(c.tables[1])
    d_tables = {} if c.tables is None else dict(zip(c.tables[1], d_extra[len(d_rows) :]))
    d_pairs = {} if c.pairs is None else dict(zip(c.pairs[1], d_extra[len(d_rows) + n_tables :]))
    return dq_out, d_rows[0] if d_rows else None, d_tables, d_pairs


def _dkv_spec(shape, index):
    """A BlockSpec of the dk/dv grid: index(b, h, j, g), the scalar-prefetch refs ignored."""
    return pl.BlockSpec(shape, lambda *ids: index(*ids[:4]))


def _dkv_operands(c: _Backward, lse, delta, stream_queries: bool):
    """The dk/dv kernel's (scalars, their shapes, inputs, outputs, scratch) on grid (b, key head h, key tile j,
    query head g of h): the whole rows of query head h G + g (or HBM refs and a tile's scratch), one key tile of
    k and v, and float32 sums of dk and dv over the G programs of (b, h, j)."""
    cfg, side, q, k, v, do = c.p.cfg, c.p.side, c.q, c.k, c.v, c.do
    Tp, Hp = q.shape[2:]
    Hvp, G = v.shape[-1], c.G
    pick, spec = tile_math.pick, _dkv_spec
    scalars, shapes = _scalar_inputs(side, side.t_order, side.t_counts)  # the transposed schedule
    heads = lambda b, h, j, g: (b, h * G + g, 0, 0)  # noqa: E731  the rows of query head h G + g
    inputs = {
        "q": (q, IN_HBM if stream_queries else spec((None, 1, Tp, Hp), heads)),
        "do": (do, IN_HBM if stream_queries else spec((None, 1, Tp, Hvp), heads)),
        # rows [1,Tp]: a [Tp,1] column of the whole query axis takes 128 lanes per row of VMEM (8 MiB at 16k)
        "lse": (lse[:, :, None, :], spec((None, 1, 1, Tp), heads)),
        "delta": (delta[:, :, None, :], spec((None, 1, 1, Tp), heads)),
        "k": (k, spec((None, None, cfg.Sb, Hp), lambda b, h, j, g: (b, h, j, 0))),
        "v": (v, spec((None, None, cfg.Sb, Hvp), lambda b, h, j, g: (b, h, j, 0))),
        # positions and segment ids as rows: every query row, the key tile's (lengths: scalars)
        **flash_call.index_inputs(
            side,
            cfg.batched,
            (Tp, lambda b, h, j, g, *_: 0),
            (cfg.Sb, lambda b, h, j, g, *_: j),
            rows=True,
            lengths=False,
        ),
    }
    if c.rows_of_grid is not None:  # the rows of query head h G + g
        batched, E = cfg.offset_bias[1], c.rows_of_grid.shape[-1]
        rows_spec = spec((None, 1, 1, E), lambda b, h, j, g: (pick(batched, b), h * G + g, 0, 0))
        inputs["offset_bias"] = (c.rows_of_grid, rows_spec)
    if c.tables is not None:  # the lanes of query head h G + g (or the shared table's); streamed: in HBM
        for name, x in c.tables[1].items():
            per_head = x.shape[0] > 1
            index = lambda b, h, j, g, per_head=per_head: (pick(per_head, h * G + g), 0, 0)  # noqa: E731
            inputs[name] = (x, IN_HBM if c.tables[0].streamed else spec((1, *x.shape[1:]), index))
    if c.pairs is not None:
        inputs.update(pairs_tpu.inputs(c.pairs[1]))
    key_tile = lambda b, h, j, g: (b, h, j, 0)  # noqa: E731
    outputs = {
        "dk": (jax.ShapeDtypeStruct(k.shape, k.dtype), spec((None, None, cfg.Sb, Hp), key_tile)),
        "dv": (jax.ShapeDtypeStruct(v.shape, v.dtype), spec((None, None, cfg.Sb, Hvp), key_tile)),
    }
    scratch = {}
    if G > 1:  # dk and dv summed over the G programs in float32
        scratch = {"dk_sum": pltpu.VMEM((cfg.Sb, Hp), jnp.float32), "dv_sum": pltpu.VMEM((cfg.Sb, Hvp), jnp.float32)}
    if c.pairs is not None:
        scratch.update(pairs_tpu.scratch(c.pairs[0], c.pairs[1], Hp, Hvp, grads=False))
    if c.tables is not None and c.tables[0].streamed:
        scratch.update(tables_tpu.streamed_scratch(c.tables[0], c.tables[1]["key_rows"].shape[-1], grads=False))
    if stream_queries:  # one query tile of q and do at a time, copied in from HBM
        scratch.update(
            q_tile=pltpu.VMEM((cfg.Tb, Hp), q.dtype),
            do_tile=pltpu.VMEM((cfg.Tb, Hvp), do.dtype),
            query_sem=pltpu.SemaphoreType.DMA(()),
        )
    return scalars, shapes, inputs, outputs, scratch


def _dkv_kernel(c: _Backward, shapes, stream_queries: bool):
    """The dk/dv program of (b, h, j, g): its refs read as flash.backward.dkv_kernel reads them (the schedule's
    scalars of the query heads of h, one query head's blocks as the GPU layout's [Tp,G,F], lse and delta rows as
    columns, dk and dv summed over g), and the hooks of the position terms it carries."""
    cfg, G, Tp = c.p.cfg, c.G, c.q.shape[2]
    bl, bsched = cfg.batched[3], cfg.batched[4]
    pick = tile_math.pick

    def dkv(refs):
        r, own, lane_refs, pair_refs = refs
        b, h, j, g = (pl.program_id(axis) for axis in range(4))
        # the schedule rows of (b, the query heads of h, key tile j): [heads, ...] read as [g, idx]
        lead = (pick(bsched, b), h * G if cfg.head_kinds else 0, j)
        r = r._replace(
            order=scalars_at(r.order, shapes.get("order"), lead, axes=(1, 3)),
            counts=scalars_at(r.counts, shapes["counts"], lead, axes=(1, 3)),
            lengths=scalars_at(r.lengths, shapes.get("lengths"), (pick(bl, b),)),
            **rows_of(r, ("q_pos", "k_pos", "q_seg", "k_seg")),
        )
        if stream_queries:
            n = h * G + g
            r = r._replace(
                q=Streamed(r.q, own.q_tile, own.query_sem, b, n, True),
                do=Streamed(r.do, own.do_tile, own.query_sem, b, n, True),
            )
        else:
            r = r._replace(q=_OneHead(r.q), do=_OneHead(r.do))
        r = r._replace(lse=_ColumnOfRow(r.lse), delta=_ColumnOfRow(r.delta))
        if G > 1:
            r = r._replace(dk=_SumOverHeads(r.dk, own.dk_sum, g, G), dv=_SumOverHeads(r.dv, own.dv_sum, g, G))
        hooks = DkvHooks(query_head=g)
        if r.offset_bias is not None:  # the forward's toeplitz_tile of query head g's row
            rows_of_bias = r.offset_bias
            hooks = hooks._replace(
                bias_of_query_tile=lambda g, i: toeplitz_tile(
                    rows_of_bias.at[0], _bias_start(cfg, Tp, i, j), cfg.Tb, cfg.Sb
                )
            )
        if c.tables is not None:
            lane_refs = tables_tpu.streamed_refs(lane_refs, c.tables[0], h * G + g)
            hooks = merged(hooks, tables_tpu.dkv_hooks(cfg, r, lane_refs, c.tables[0], j, c.p.T, c.S))
        if c.pairs is not None:
            hooks = merged(hooks, pairs_tpu.dkv_hooks(c.pairs[0], r, pair_refs, lambda g: h * G + g, j))
        backward.dkv_kernel(cfg, r, hooks)

    return dkv


def _dkv(c: _Backward, lse, delta):
    """(dk [B,K,Sp,Hp], dv [B,K,Sp,Hvp]): the dk/dv kernel, the G programs of (b, h, j) adding their shares of
    dk and dv in order ("arbitrary" last axis)."""
    stream_queries = streamed(c.q.shape[2], c.q.shape[-1], c.v.shape[-1], c.q.dtype, c.pairs is not None)
    scalars, shapes, inputs, outputs, scratch = _dkv_operands(c, lse, delta, stream_queries)
    by_heads = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))
    grid = (c.q.shape[0], c.k.shape[1], c.p.cfg.Sn, c.G)
    kernel = _dkv_kernel(c, shapes, stream_queries)
    dk, dv = _call(c, kernel, "jaxattn_flex_tpu_dkv", grid, scalars, inputs, outputs, by_heads, scratch)
    return dk, dv


def gradients(
    p: plan.Prepared,
    lse,
    delta,
    d_out,
    interpret: bool,
    rows_of_grid=None,
    tables=None,
    S=None,
    pairs=None,
):
    """(dq [B,Tp,N,Hp], dk [B,Sp,K,Hp], dv [B,Sp,K,Hvp], d rows_of_grid [B,N,1,E] float32 or None) of a prepared
    call (prepare's padded arrays) from the forward's lse and delta = rowsum(dO * out) - d lse, both [B,N,Tp]
    float32, and d_out [B,Tp,N,Hvp]; rows_of_grid: a position bias of j - i, the bias of every offset of the
    grid [B|1,N,1,E] (flex_tpu.offset_rows_of_grid), or None.

    A tile's bias is a window of its head's row rolled into the tile's diagonals (refs_tpu.toeplitz_tile), as in
    the forward; its gradient the inverse roll summed over the tile's rows (undiagonals), added into the dq
    program's row of offsets. The dq grid walks the query tiles of one (b, n) in order ("arbitrary"), so
    that row stays in VMEM and sums over them: d rows [B,N,1,E], O(T + S) per head, no atomics.

    pairs: per-pair tables (pairs_tpu: (PairTables, {name: [Tp,Nt,F,Sp]})) or None; their gradients, [Tp,Nt,F,Sp]
    by name (pairs_tpu.gradient_dtype), are the last result (empty without)."""
    q, k, v, do = (jnp.swapaxes(x, 1, 2) for x in (p.q, p.k, p.v, d_out.astype(p.q.dtype)))  # [B,heads,L,F]
    c = _Backward(p, q, k, v, do, interpret, rows_of_grid, tables, S, pairs)
    dq_out, d_rows, d_tables, d_pairs = _dq(c, lse, delta)
    dk, dv = _dkv(c, lse, delta)
    dq_out, dk, dv = (jnp.swapaxes(x, 1, 2) for x in (dq_out, dk, dv))
    return dq_out, dk, dv, d_rows, d_tables, d_pairs


class _OneHead:
    """The [1,Tp,F] block of one query head's q or do (the dk/dv grid's g) read as the GPU layout's [Tp,G,F] the
    dk/dv kernel indexes by head: [rows, g, columns] -> ref[0, rows, columns], any g the block's one head."""

    def __init__(self, ref):
        self.ref, self.dtype = ref, ref.dtype
        self.shape = (ref.shape[1], 1, ref.shape[2])

    def __getitem__(self, index):
        rows, _, columns = index
        return self.ref[0, rows, columns]


class _ColumnOfRow:
    """A [1,1,Tp] block of one query head's lse or delta read as the dk/dv kernel reads the G heads' columns:
    [g, rows] -> [Tb,1], the row's slice turned into a column (a [8,Tb] transpose, which Mosaic lowers)."""

    def __init__(self, ref):
        self.ref, self.dtype = ref, ref.dtype

    def __getitem__(self, index):
        _, rows = index
        row = self.ref[0, :, rows]  # [1,Tb]
        return jnp.broadcast_to(row, (8, row.shape[-1])).T[:, :1]


class _SumOverHeads:
    """dk or dv of a key tile as the sum of the G query heads' shares, the grid's last axis g (in order): the dk/dv
    kernel's write of head g's share sets (g = 0) or adds to a float32 scratch, and the last head writes the sum."""

    def __init__(self, out, total, g, G: int):
        self.out, self.total, self.g, self.G = out, total, g, G
        self.dtype, self.shape = total.dtype, total.shape

    def __setitem__(self, index, value):
        total, g = self.total, self.g

        @pl.when(g == 0)
        def _():
            total[...] = value

        @pl.when(g > 0)
        def _():
            total[...] = total[...] + value

        @pl.when(g == self.G - 1)
        def _():
            self.out[...] = total[...].astype(self.out.dtype)
