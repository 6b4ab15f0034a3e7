"""Shaw's and DeBERTa's position tables in the TPU kernels (flex_tpu's forward, flex_tpu_vjp's dq and dk/dv).

The GPU kernel gathers q . A^K per query row at each pair's column and scatter-adds p by column; neither lowers
in Mosaic. Instead each table is laid out along the offsets of its band (TableLanes: lane e holds the row of
offset lo - M + e, M = Tb + Sb - 1 lanes of edge rows on each side, so a tile outside the band reads edge rows
from a clamped start), [N|1,E,H] per table, and a tile's terms are a window of those lanes moved into the tile's
diagonals by a strided roll (refs_tpu.diagonals) or back onto the offsets (undiagonals). With the default
positions only: a tile's offsets j - i are then contiguous.

    forward   key terms    qx = q . key lanes^T once per program ([Tb,E] VMEM scratch), a window of it rolled
                           into the diagonals (Shaw's key table, DeBERTa's c2p); DeBERTa's p2c: per key tile
                           kx = k . a window of the reversed query lanes, rolled per key row and transposed
              value term   p rolled back onto its offsets times a window of the value lanes, added to p v
    backward  with ds = d loss / d (q k^T + the key terms) and p of a tile:
              dp           += do . value lanes^T, a window rolled into the diagonals
              dq           += d qx . key lanes            d qx: ds rolled back onto the offsets
              d key lanes  += d qx^T . q                  d value lanes += p lanes^T . do   (p rolled back)
              dk           += d kx . query lanes          d kx: ds^T rolled back onto the reversed offsets
              d query lanes += d kx^T . k
              The dq program of query tile i holds qx and do . value lanes^T for its rows, sums d qx and p lanes
              over its key tiles and adds their products once after them into the (b, n) block of each
              table's gradient (the dq grid walks i in order: "arbitrary"); d query lanes per key tile. The
              dk/dv program rebuilds each query tile's terms from windows of the lanes ([Tb,W] products).

Streamed lanes (TableLanes.streamed): a key table alone whose band is wider than RESIDENT_BAND (Transformer-XL
over its whole span: T + S offsets) would not fit VMEM as [E,F] lanes beside their [Tb,E] products. Its lanes
then stay in HBM and each tile reads only its window: a [W,F] copy of the lanes (LaneStream), qx = q . window^T
per tile, and in the dq kernel d qx's two products per tile, dq's share summed in a [Tb,F] scratch and the
window's gradient added into the (b, n) block of the lanes' gradient in HBM (copy in, add, copy out: LaneAdder;
the dq grid's query tiles of one (b, n) run in order, so no two programs add into one block at once). VMEM
then holds a few [W,F] tiles whatever the span: O(T) memory in HBM, no [T,S] buffer.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .._core.call import AttentionCall
from .flash import plan, tile_math
from .flash.refs import DkvHooks, DqHooks, ForwardHooks, Refs
from .refs_tpu import LANES, diagonals, lane_window, undiagonals, window

# The dq kernel's VMEM with position tables (backward_refusal): within a TPU's 16 MiB of scoped VMEM (v5e's
# default), less the query tile's own blocks.
MAX_TABLES_VMEM = 15 * 2**20
# The widest band of offsets (hi - lo + 1) whose lanes a key table alone keeps in VMEM; wider bands stream
# their lanes a tile's window at a time (TableLanes.streamed).
RESIDENT_BAND = 2048


class LaneRefs(NamedTuple):
    """The tables' refs in the TPU kernels (TableLanes' layout): each table's lanes [E,F] (key_rows,
    query_rows, value_rows) and their gradients' blocks; the dq program's [Tb,E] float32 scratch: qx =
    q . key lanes^T, dox = do . value lanes^T, and the sums over its key tiles d_qx and p_lanes."""

    key_rows: Any = None
    query_rows: Any = None
    value_rows: Any = None
    d_key_rows: Any = None
    d_query_rows: Any = None
    d_value_rows: Any = None
    qx: Any = None
    dox: Any = None
    d_qx: Any = None
    p_lanes: Any = None
    # streamed lanes: a window's [W,F] VMEM tile, its gradient's, dq's share [Tb,F] float32, the copies' semaphore
    lane_tile: Any = None
    grad_tile: Any = None
    dq_rows: Any = None
    lane_sem: Any = None


class TableLanes(NamedTuple):
    """Static: the offsets lo..hi whose table rows differ (the band; clipping j - i to it is exact), laid out
    one offset per lane with a margin of M = Tb + Sb - 1 lanes (the offsets one tile spans) on each side:
    lane e holds offset lo - M + e (a reversed layout: hi + M - e), L = hi - lo + 1 + 2 M lanes, E padded
    (the window a tile loads from any start up to L - M stays inside). A tile's offsets lie in one window
    of M lanes; a tile wholly outside the band starts at the margin (clamped), whose lanes all hold the edge
    row: its terms are then exact too, with no branch."""

    lo: int
    hi: int
    Tb: int
    Sb: int
    key_rows: bool  # q . A^K per query row (Shaw's key table, DeBERTa's c2p): LaneRefs.key_rows, .qx
    query_rows: bool  # k . Q^r per key row (DeBERTa's p2c), reversed lanes: r.query_rows
    value_rows: bool  # sum_s p A^V (Shaw's value table): r.value_rows
    streamed: bool = False  # the key lanes in HBM, a tile's window copied in (module docstring)

    @property
    def M(self) -> int:
        return self.Tb + self.Sb - 1

    @property
    def L(self) -> int:
        return self.hi - self.lo + 1 + 2 * self.M

    @property
    def E(self) -> int:
        return -(-self.L // LANES) * LANES + window(self.Tb, self.Sb)

    def offsets(self, reverse=False):
        """int32 [L]: the offset of each lane, clipped to the band (the row beyond it is the edge's)."""
        e = np.arange(self.L)
        d = self.hi + self.M - e if reverse else self.lo - self.M + e
        return jnp.asarray(np.clip(d, self.lo, self.hi), jnp.int32)

    def windows(self, i, j, T: int, S: int):
        """((lanes, offset), (reversed lanes, offset)): tile (i, j)'s window in each layout (refs_tpu.lane_window,
        traced), from the first lane of its offsets d = j Sb + c - i Tb - r - (S - T), which run from dmin
        (r = Tb - 1, c = 0) to dmin + M - 1."""
        dmin = j * self.Sb - i * self.Tb - (self.Tb - 1) - (S - T)
        clamp = lambda x: jnp.clip(x, 0, self.L - self.M)  # noqa: E731  outside the band: the margins
        W = window(self.Tb, self.Sb)
        starts = clamp(dmin - (self.lo - self.M)), clamp(self.hi + self.M - (dmin + self.M - 1))
        return tuple(lane_window(start, W) for start in starts)


def table_lanes(rows, table, width: int, E: int):
    """[Nt,E,width] float: table [R,(N,)F] at int32 rows [L] (one per lane), heads first (Nt = N, or 1 for a
    shared table), zeros past L lanes and F features."""
    picked = jnp.take(table, rows, axis=0)
    picked = picked[:, None] if picked.ndim == 2 else picked
    picked = jnp.swapaxes(picked, 0, 1)
    return jnp.pad(picked, ((0, 0), (0, E - picked.shape[1]), (0, width - picked.shape[2])))


def table_layout(call: AttentionCall, Tb: int, Sb: int, T: int, S: int) -> TableLanes:
    """The TableLanes of a call with Shaw's tables or RowTables (static: from the call's band and tables)."""
    if call.row_tables is not None:
        rt = call.row_tables
        return TableLanes(rt.lo, rt.hi, Tb, Sb, rt.key_rows is not None, rt.query_rows is not None, False)
    band = plan.tables_band(call, T, S)
    key_alone = call.key_table is not None and call.value_table is None
    streamed = key_alone and band.hi - band.lo + 1 > RESIDENT_BAND
    return TableLanes(
        band.lo, band.hi, Tb, Sb, call.key_table is not None, False, call.value_table is not None, streamed
    )


class LaneStream:
    """One head's key lanes left in HBM ([Nt,E,F]), read as the resident block is: [at, :] (or [0, at, :], the
    dk/dv kernel's reading of its [1,E,F] block; at: lane_window's W lanes) copies those lanes of the head into
    a [W,F] VMEM tile and waits for the copy (not hidden, and not timed: no TPU has been lent)."""

    def __init__(self, ref, tile, sem, head):
        self.ref, self.tile, self.sem = ref, tile, sem
        self.head = head if ref.shape[0] > 1 else 0  # a shared table: one set of lanes

    def __getitem__(self, index):
        lanes = index[-2]
        copy = pltpu.make_async_copy(self.ref.at[self.head, lanes], self.tile, self.sem)
        copy.start()
        copy.wait()
        return self.tile[...]


class LaneAdder:
    """The (b, n) block of the lanes' gradient in HBM ([B,N,E,F] float32): add(at, x) adds x [W,F] into lanes at
    (copy in, add, copy out, each waited for)."""

    def __init__(self, ref, tile, sem, b, n):
        self.ref, self.tile, self.sem, self.b, self.n = ref, tile, sem, b, n

    def add(self, at, x):
        block = self.ref.at[self.b, self.n, at]
        copy_in = pltpu.make_async_copy(block, self.tile, self.sem)
        copy_in.start()
        copy_in.wait()
        self.tile[...] = self.tile[...] + x
        copy_out = pltpu.make_async_copy(self.tile, block, self.sem)
        copy_out.start()
        copy_out.wait()


def streamed_refs(t: LaneRefs, lanes: TableLanes, head, b=None) -> LaneRefs:
    """t with the key lanes read through a LaneStream of query head `head` where they are streamed, and (the dq
    kernel, batch entry b) their gradient's (b, head) block added into through a LaneAdder."""
    if not lanes.streamed:
        return t
    t = t._replace(key_rows=LaneStream(t.key_rows, t.lane_tile, t.lane_sem, head))
    if t.d_key_rows is not None:
        t = t._replace(d_key_rows=LaneAdder(t.d_key_rows, t.grad_tile, t.lane_sem, b, head))
    return t


def streamed_scratch(lanes: TableLanes, F: int, grads: bool) -> dict:
    """The VMEM a kernel with streamed lanes holds for them: a window's [W,F] tile and the copies' semaphore;
    with grads (the dq kernel) also its gradient's tile and dq's share [Tb,F]."""
    W = window(lanes.Tb, lanes.Sb)
    scratch = {"lane_tile": pltpu.VMEM((W, F), jnp.float32), "lane_sem": pltpu.SemaphoreType.DMA(())}
    if grads:
        scratch.update(grad_tile=pltpu.VMEM((W, F), jnp.float32), dq_rows=pltpu.VMEM((lanes.Tb, F), jnp.float32))
    return scratch


def call_lanes(call: AttentionCall, tables: dict, Tb: int, Sb: int, T: int, S: int, Hp: int, Hvp: int, dtype):
    """(TableLanes, {name: [Nt,E,Hp|Hvp]}) of a call's Shaw tables or RowTables (tables: their arrays by
    name, as attention passes them to the kernel), in the compute dtype `dtype`."""
    lanes = table_layout(call, Tb, Sb, T, S)
    if call.row_tables is not None:  # DeBERTa's: the row of an offset from the scheme's map
        row = lambda d: jnp.take(tables["row_of_offset"], d - lanes.lo)  # noqa: E731
    else:  # Shaw's: offset d reads row d + max_distance
        row = lambda d: d + call.max_distance  # noqa: E731
    out = {}
    for name, source, width, reverse in (
        ("key_rows", tables.get("key_table", tables.get("key_rows")), Hp, False),
        ("query_rows", tables.get("query_rows"), Hp, True),
        ("value_rows", tables.get("value_table"), Hvp, False),
    ):
        if source is not None:
            out[name] = table_lanes(row(lanes.offsets(reverse)), source.astype(dtype), width, lanes.E)
    return lanes, out


def key_terms(cfg, windows, qx=None, k=None, query_rows=None):
    """A tile's key terms [Tb,Sb] inside q k^T (None without): qx, the tile's window of q . key lanes^T
    [Tb,W], rolled into its diagonals; and with query_rows (the [W,H] window of the reversed query lanes)
    DeBERTa's p2c, per key row k . query_rows^T rolled (offsets rise with the lanes along a key row) and
    transposed. windows: TableLanes.windows of the tile."""
    (_, offset), (_, reverse_offset) = windows
    term = None if qx is None else diagonals(qx, offset, cfg.Sb)
    if query_rows is not None:
        kx = tile_math.dot(k.astype(jnp.float32), query_rows, cfg, (1, 1))
        by_key = diagonals(kx, reverse_offset, cfg.Tb).T
        term = by_key if term is None else term + by_key
    return term


def fill(cfg, ref, x, rows):
    """ref = x . rows^T, [Tb,E] float32: every offset lane's term for the tile's rows x, once per program (the
    key tiles read windows of it)."""
    ref[...] = tile_math.dot(x.astype(jnp.float32), rows[...], cfg, (1, 1))


def window_products(cfg, t: LaneRefs, lanes: TableLanes, at, q):
    """qx's window [Tb,W] of a tile: a slice of the program's qx (resident lanes), or q . the window's lanes^T
    (streamed: copied in by the LaneStream)."""
    if lanes.streamed:
        return tile_math.dot(q.astype(jnp.float32), t.key_rows[at, :], cfg, (1, 1))
    return t.qx[:, at]


def forward_hooks(cfg, r: Refs, t: LaneRefs, lanes: TableLanes, i, T: int, S: int) -> ForwardHooks:
    """The forward's hooks for the tables of query tile i: table_logits_of_key_tile(j, k), the key terms of
    tile (i, j) [Tb,Sb], and table_values_of_key_tile(j, p), the value term sum_s p[t, s] A^V[c(t, s)]
    [Tb,Hvp]; fills t.qx (the module docstring)."""
    W = window(cfg.Tb, cfg.Sb)
    if lanes.key_rows and not lanes.streamed:
        fill(cfg, t.qx, r.q[...], t.key_rows)

    def logits(j, k):
        windows = lanes.windows(i, j, T, S)
        (at, _), (reverse_at, _) = windows
        qx = window_products(cfg, t, lanes, at, r.q[...]) if lanes.key_rows else None
        query_rows = t.query_rows[reverse_at, :] if lanes.query_rows else None
        return key_terms(cfg, windows, qx, k, query_rows)

    def values(j, p):
        (at, offset), _ = lanes.windows(i, j, T, S)
        return tile_math.dot(undiagonals(p, offset, W), t.value_rows[at, :], cfg)

    return ForwardHooks(
        table_logits_of_key_tile=logits if lanes.key_rows or lanes.query_rows else None,
        table_values_of_key_tile=values if lanes.value_rows else None,
    )


def dq_hooks(cfg, r: Refs, t: LaneRefs, lanes: TableLanes, i, T: int, S: int) -> DqHooks:
    """The dq kernel's hooks (backward.dq_kernel) for the tables of query tile i: table_terms_of_key_tile,
    add_table_grads and finish_dq (the module docstring)."""
    if lanes.streamed:
        return streamed_dq_hooks(cfg, r, t, lanes, i, T, S)
    W = window(cfg.Tb, cfg.Sb)
    f32 = jnp.float32
    q, do = r.q[...].astype(f32), r.do[...].astype(f32)
    grads = [
        d
        for d, used in (
            (t.d_key_rows, lanes.key_rows),
            (t.d_query_rows, lanes.query_rows),
            (t.d_value_rows, lanes.value_rows),
        )
        if used
    ]

    @pl.when(i == 0)
    def _():
        for d in grads:
            d[...] = jnp.zeros(d.shape, f32)

    for product, sums, rows, x, used in (
        (t.qx, t.d_qx, t.key_rows, q, lanes.key_rows),
        (t.dox, t.p_lanes, t.value_rows, do, lanes.value_rows),
    ):
        if used:
            fill(cfg, product, x, rows)
            sums[...] = jnp.zeros(sums.shape, f32)

    def terms(j, k):
        windows = lanes.windows(i, j, T, S)
        (at, offset), (reverse_at, _) = windows
        qx = t.qx[:, at] if lanes.key_rows else None
        query_rows = t.query_rows[reverse_at, :] if lanes.query_rows else None
        dp = diagonals(t.dox[:, at], offset, cfg.Sb) if lanes.value_rows else None
        return key_terms(cfg, windows, qx, k, query_rows), dp

    def add(j, k, p, ds):
        (at, offset), (reverse_at, reverse_offset) = lanes.windows(i, j, T, S)
        ds = ds.astype(f32)
        if lanes.key_rows:
            t.d_qx[:, at] = t.d_qx[:, at] + undiagonals(ds, offset, W)
        if lanes.value_rows:
            t.p_lanes[:, at] = t.p_lanes[:, at] + undiagonals(p.astype(f32), offset, W)
        if lanes.query_rows:
            d_kx = undiagonals(ds.T, reverse_offset, W)
            d_rows = tile_math.dot(d_kx, k.astype(f32), cfg, (0, 0))
            t.d_query_rows[reverse_at, :] = t.d_query_rows[reverse_at, :] + d_rows

    def finish(dq):
        if lanes.key_rows:
            d_qx = t.d_qx[...]
            dq = dq + tile_math.dot(d_qx, t.key_rows[...], cfg).astype(dq.dtype)
            t.d_key_rows[...] = t.d_key_rows[...] + tile_math.dot(d_qx, q, cfg, (0, 0))
        if lanes.value_rows:
            t.d_value_rows[...] = t.d_value_rows[...] + tile_math.dot(t.p_lanes[...], do, cfg, (0, 0))
        return dq

    return DqHooks(table_terms_of_key_tile=terms, add_table_grads=add, finish_dq=finish)


def streamed_dq_hooks(cfg, r: Refs, t: LaneRefs, lanes: TableLanes, i, T: int, S: int) -> DqHooks:
    """dq_hooks with the key lanes streamed (a key table alone; module docstring): per key tile j its window's
    qx, then d qx = ds rolled back onto the offsets, dq's share d qx . window summed in t.dq_rows, and the
    window's gradient d qx^T . q added into the lanes' gradient in HBM (t.d_key_rows: a LaneAdder)."""
    W = window(cfg.Tb, cfg.Sb)
    f32 = jnp.float32
    q = r.q[...].astype(f32)
    t.dq_rows[...] = jnp.zeros(t.dq_rows.shape, f32)

    def terms(j, k):
        windows = lanes.windows(i, j, T, S)
        (at, _), _ = windows
        return key_terms(cfg, windows, window_products(cfg, t, lanes, at, q)), None

    def add(j, k, p, ds):
        (at, offset), _ = lanes.windows(i, j, T, S)
        d_qx = undiagonals(ds.astype(f32), offset, W)
        t.dq_rows[...] = t.dq_rows[...] + tile_math.dot(d_qx, t.key_rows[at, :], cfg)
        t.d_key_rows.add(at, tile_math.dot(d_qx, q, cfg, (0, 0)))

    def finish(dq):
        return dq + t.dq_rows[...].astype(dq.dtype)

    return DqHooks(table_terms_of_key_tile=terms, add_table_grads=add, finish_dq=finish)


def dkv_hooks(cfg, r: Refs, t: LaneRefs, lanes: TableLanes, j, T: int, S: int) -> DkvHooks:
    """The dk/dv kernel's hooks (backward.dkv_kernel) for the tables of key tile j, whose program holds one
    query head's lanes ([1,E,F] blocks): table_terms_of_query_tile, query tile i's terms from windows of the
    lanes, and dk_of_query_tile, the per-key-row term's share of dk (the module docstring)."""
    W = window(cfg.Tb, cfg.Sb)
    f32 = jnp.float32
    k = r.k[...]

    def terms(g, i, q, do):
        windows = lanes.windows(i, j, T, S)
        (at, offset), (reverse_at, _) = windows
        qx = tile_math.dot(q.astype(f32), t.key_rows[0, at, :], cfg, (1, 1)) if lanes.key_rows else None
        query_rows = t.query_rows[0, reverse_at, :] if lanes.query_rows else None
        dp = None
        if lanes.value_rows:
            dp = diagonals(tile_math.dot(do.astype(f32), t.value_rows[0, at, :], cfg, (1, 1)), offset, cfg.Sb)
        return key_terms(cfg, windows, qx, k, query_rows), dp

    def key_grads(g, i, ds):
        _, (reverse_at, reverse_offset) = lanes.windows(i, j, T, S)
        d_kx = undiagonals(ds.astype(f32).T, reverse_offset, W)
        return tile_math.dot(d_kx, t.query_rows[0, reverse_at, :], cfg)

    return DkvHooks(table_terms_of_query_tile=terms, dk_of_query_tile=key_grads if lanes.query_rows else None)


def dq_vmem(lanes: TableLanes, S: int, H: int, Hv: int, dtype, multiple: int, key_buffers: int = 2) -> int:
    """Bytes of VMEM the dq kernel's blocks with Shaw's or DeBERTa's tables take: k and v whole (key_buffers
    copies of each; 0: one key tile of each, streamed from HBM), each table's lanes [E,F] float32 and their
    gradient (each double-buffered by the pipeline), and two [Tb,E] float32 scratch blocks per table. Compiled
    for v5e (16 MiB of scoped VMEM): DeBERTa-v3's tables at T = S = 8192, head dim 64, double-buffered keys took
    17.41 MiB, this estimate 17.38 MiB."""
    padded = lambda x: -(-x // multiple) * multiple  # noqa: E731
    rows = padded(S) if key_buffers else lanes.Sb
    keys = max(key_buffers, 1) * rows * (padded(H) + padded(Hv)) * np.dtype(dtype).itemsize
    widths = [padded(F) for F, wanted in ((H, lanes.key_rows), (H, lanes.query_rows), (Hv, lanes.value_rows)) if wanted]
    if lanes.streamed:  # a window's lanes and its gradient, and dq's share [Tb,F]
        return keys + sum((2 * window(lanes.Tb, lanes.Sb) + lanes.Tb) * F * 4 for F in widths)
    tables = sum(4 * lanes.E * F * 4 for F in widths)
    scratch = 2 * lanes.Tb * lanes.E * 4 * (int(lanes.key_rows) + int(lanes.value_rows))
    return keys + tables + scratch


def key_buffers(lanes: TableLanes, S: int, H: int, Hv: int, dtype, multiple: int) -> int:
    """How many copies of one head's keys and values the dq kernel with tables holds: the pipeline's two where
    dq_vmem fits MAX_TABLES_VMEM with them (the next head's keys are copied while this head's last query tiles
    run), else one where one fits (pl.Buffered(1): the kernel waits for each head's keys, once per (b, n)), else
    0: the keys stay in HBM and each key tile is copied in when the kernel reaches it
    (refs_tpu.Streamed; it waits for every tile). Neither wait is timed: no TPU has been lent."""
    for buffers in (2, 1):
        if dq_vmem(lanes, S, H, Hv, dtype, multiple, buffers) <= MAX_TABLES_VMEM:
            return buffers
    return 0


def backward_refusal(lanes: TableLanes, S: int, H: int, Hv: int, dtype, multiple: int) -> Optional[str]:
    """None when the dq kernel's blocks with Shaw's or DeBERTa's tables fit MAX_TABLES_VMEM, the keys streamed
    a tile at a time if need be (key_buffers); else why not: the tables' lanes alone overrun it (a band of
    offsets near flex_tpu.MAX_BAND at head dim 256). DeBERTa-v3's training at T = S = 16k (head dim 64, bf16)
    takes the kernels with streamed keys (one copy of them: 17.4 MiB estimated, over the bound)."""
    total = dq_vmem(lanes, S, H, Hv, dtype, multiple, key_buffers=0)
    if total <= MAX_TABLES_VMEM:
        return None
    return (
        f"position tables (the dq kernel's tables and their gradients: {total / 2**20:.1f} MiB of VMEM > "
        f"{MAX_TABLES_VMEM >> 20} MiB)"
    )
