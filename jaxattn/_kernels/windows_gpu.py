"""Shaw's key table over any span in the Pallas GPU kernel (flash_gpu): each tile's key term from the window of
table rows between its own queries and keys, no band of columns per query row (Transformer-XL's full span).

    logits[t,s] = scale * q_t . (k_s + A^K[clip(j - i, -m, m) + m])      (no value table on this route)

tables_gpu's band route computes QA = q . A^K[band]^T per query row outside the kernel, [B,N,Tp,Dp], and refuses
bands wider than tables_gpu.MAX_COLUMNS (Transformer-XL at its whole span, max_left = S - 1, reaches 2S - 1
rows). A tile never reads more than the Tb + Sb - 1 offsets between its own rows and columns: with the default
positions (query t at t + S - T, key s at s) tile (i, j)'s pair (t, s) has the offset

    d = j Sb + s - i Tb - t - (S - T) = d0(i, j) + c,   d0 = j Sb - i Tb - (Tb - 1) - (S - T),   c = s - t + Tb - 1

so c runs over a window of W = Tb + Sb - 1 columns (Wp, the next power of two: Triton's tensors). Per tile:

    Pw  = A^K[clip(d0 + c, -m, m) + m], c < Wp      [Wp,F]  a gathered load from the table (in HBM, L2)
    QP  = q_tile Pw^T                               [Tb,Wp] one more matmul
    key term[t, s] = QP[t, s - t + Tb - 1]          [Tb,Sb] the skew

Pallas' Triton lowering has no gather between registers, so the skew goes through memory: QP is stored into
the program's own scratch block ([Tb,Wp] float32 of an extra output, [B,N,Tn,Tb,Wp] for the forward and dq
kernels, [B,K,Sn,Tb,Wp] for dk/dv: linear in T), and read back at [t, s - t + Tb - 1]. Backward, in the dq
program of query tile i over its key tiles j, with ds = d loss / d (q k^T + key term):

    dQP[t, c] = ds[t, c + t - (Tb - 1)]  (0 outside the tile)   through the scratch the same way
    dq       += dQP Pw                                           (DqHooks.add_table_grads' share of dq)
    d A^K[clip(d0 + c) + m] += (dQP^T q)[c]                      atomic adds into [Nt,R,F] float32

(dQP read from the scratch and its products taken a chunk of window columns at a time, WINDOW_CHUNK; a tile
wholly past the clip distance, every offset in one row, adds sum_t (sum_s ds) q_t there once); the dk/dv
program rebuilds the key term of each query tile i the same way (its own scratch); the table term holds no k.
The tiles on a GPU keep the window's [Wp,F] float32 rows within shared memory (flash.sizes.window_tiles).
Compiled for the H100 and A100 (.ci/compile_targets.py, "xl whole span", "xl H128 T!=S"); never run on a GPU.

Ordering, which interpret mode cannot check (its programs run one after another, and it skips the barriers):
  * A program's scratch block is its own (the grid ids pick it), so only the threads of one CTA touch it. A
    store of the [Tb,Wp] block is spread over all its threads, and the read at [t, s - t + Tb - 1] reads other
    threads' elements: a barrier (plgpu.debug_barrier, CUDA's bar.sync, which orders the block's global-memory
    accesses before it against those after it for every thread of the block) sits between each store and its
    read, and another after each read, before the next store into the block (the next tile's, or dQP's store
    of ds after the key term's read) may overwrite what a slower thread still reads. Every program runs the
    same loop counts (the schedule is per program), so all its threads reach every barrier.
  * The kernels with a scratch run without Triton's software pipelining (num_stages=1, flash_gpu): the
    pipeliner may issue a later iteration's loads ahead of this iteration's stores and barriers, and it does
    not see that the scratch read depends on the store before it.
  * The table's gradient: atomic float adds from every program (and within one add, the window's columns
    that clip to one row) into one float32 array seeded with zeros (an aliased input): nothing reads it inside
    the kernel, so only the sum matters; its order (the last bits) varies from run to run on a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import jax.ref  # jax.ref.addupdate: a submodule, imported by name
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .flash.refs import DkvHooks, DqHooks, ForwardHooks, Refs
from .flash.sizes import next_power_of_two
from .flash.tile_math import dot, read

# The dq kernel's [C,Fp] float32 products for the table's gradient, in elements (_chunk): measured by compiling
# for the H100 (.ci/compile_targets.py): XL at head dim 128 (Fp = 256) asked 253952 bytes of shared memory
# (232448 available) with the whole window's [Wp,Fp] at once, Wp = 64 or 128; with flash.sizes.window_tiles'
# tiles, 4096 (C = 32 at head dim 64, 16 at 128) left the dq kernel without spills where 8192 spilled 20 bytes.
WINDOW_CHUNK = 4096


class Window(NamedTuple):
    """Static: a call's key table on the windowed route (Config.window). Tiles Tb x Sb, clip distance m, the
    default positions' shift S - T, and whether the table has a row per head (else one shared, Nt = 1)."""

    Tb: int
    Sb: int
    max_distance: int
    shift: int
    per_head: bool

    @property
    def W(self) -> int:
        return self.Tb + self.Sb - 1

    @property
    def Wp(self) -> int:
        return next_power_of_two(self.W)

    def first_offset(self, i, j):
        """d0: the offset of window column 0 of tile (i, j) (query row Tb - 1, key column 0)."""
        return j * self.Sb - i * self.Tb - (self.Tb - 1) - self.shift


def window_table(key_table, Fp: int, dtype):
    """The kernels' table, [Nt,R,Fp] in `dtype` (the compute dtype): key_table [R,(N,)F] heads first (Nt = N,
    or 1 for a shared table), zeros past F (the padded head dim of q's blocks)."""
    table = key_table[:, None] if key_table.ndim == 2 else key_table
    table = jnp.swapaxes(table, 0, 1).astype(dtype)
    return jnp.pad(table, [(0, 0), (0, 0), (0, Fp - table.shape[-1])])


def scratch_shape(w: Window, *lead) -> jax.ShapeDtypeStruct:
    """A kernel's scratch output: one [Tb,Wp] float32 block per program of a grid lead (its three ids)."""
    return jax.ShapeDtypeStruct((*lead, w.Tb, w.Wp), jnp.float32)


def scratch_spec(w: Window) -> pl.BlockSpec:
    return pl.BlockSpec((None, None, None, w.Tb, w.Wp), lambda a, b, c: (a, b, c, 0, 0))


def _barrier(cfg):
    """The CTA's barrier between a scratch block's store and its reads (module docstring); the interpreter runs
    a program's steps in order and has no lowering for it."""
    if not cfg.interpret:
        plgpu.debug_barrier()


def _rows(w: Window, i, j, c0: int = 0, C=None):
    """int32 [C]: the table row of window columns c0..c0+C-1 of tile (i, j) (all Wp without C),
    clip(d0 + c, -m, m) + m."""
    m, C = w.max_distance, w.Wp if C is None else C
    c = c0 + lax.broadcasted_iota(jnp.int32, (C,), 0)
    return jnp.clip(w.first_offset(i, j) + c, -m, m) + m


def _window_rows(ref, head, rows):
    """Pw [C,Fp]: the table rows `rows` [C] of one head (a gathered load; rows repeat where they clip)."""
    Fp = ref.shape[-1]
    index = jnp.broadcast_to(rows[:, None], (rows.shape[0], Fp))
    return ref[head, index, lax.broadcasted_iota(jnp.int32, index.shape, 1)]


def _skewed(cfg, scratch, qp):
    """key term [Tb,Sb] = qp[t, s - t + Tb - 1], qp [Tb,Wp] float32, through the program's scratch block."""
    Tb, Sb = cfg.Tb, cfg.Sb
    scratch[...] = qp
    _barrier(cfg)
    t = lax.broadcasted_iota(jnp.int32, (Tb, Sb), 0)
    s = lax.broadcasted_iota(jnp.int32, (Tb, Sb), 1)
    term = scratch[t, s - t + (Tb - 1)]
    _barrier(cfg)
    return term


def _chunk(w: Window, Fp: int) -> int:
    """The window columns the dq kernel takes at once for the table's gradient: [C,Fp] float32 products within
    WINDOW_CHUNK elements (at least 16, Triton's dot; at most Wp)."""
    return max(16, min(w.Wp, WINDOW_CHUNK // Fp))


def _table_grads(cfg, r: Refs, head, i, j, q, ds):
    """The dq program's work with ds [Tb,Sb] float32 of tile (i, j): the table's gradient d A^K[rows] += dQP^T q
    (atomic adds), and dq's share dQP Pw, returned ([Tb,Fp] float32); dQP [Tb,Wp] = ds[t, c + t - (Tb - 1)]
    (0 where that is no key of the tile), read from the scratch a chunk of window columns at a time (_chunk: a
    whole [Wp,Fp] float32 product overran the H100's shared memory at Fp = 256). A tile wholly past the clip
    distance, every offset in one row, adds sum_t (sum_s ds[t,s]) q_t there once instead."""
    w, m, Tb, Sb = cfg.window, cfg.window.max_distance, cfg.Tb, cfg.Sb
    Fp = r.window_table.shape[-1]
    d0 = w.first_offset(i, j)
    one_row = (d0 >= m) | (d0 + w.W - 1 <= -m)

    @pl.when(one_row)
    def _():
        row_sum = jnp.sum(jnp.sum(ds, axis=1)[:, None] * q, axis=0)
        jax.ref.addupdate(r.d_window_table, (head, jnp.clip(d0, -m, m) + m, pl.ds(0, Fp)), row_sum)

    scratch = r.window_scratch
    scratch[:, pl.ds(0, Sb)] = ds
    _barrier(cfg)
    C = _chunk(w, Fp)
    share = jnp.zeros((Tb, Fp), jnp.float32)
    for c0 in range(0, w.Wp, C):
        t = lax.broadcasted_iota(jnp.int32, (Tb, C), 0)
        s = c0 + lax.broadcasted_iota(jnp.int32, (Tb, C), 1) + t - (Tb - 1)
        d_qp = jnp.where((s >= 0) & (s < Sb), scratch[t, jnp.clip(s, 0, Sb - 1)], 0.0)
        rows = _rows(w, i, j, c0, C)
        share = share + dot(d_qp, _window_rows(r.window_table, head, rows), cfg)

        @pl.when(jnp.logical_not(one_row))
        def _(rows=rows, d_qp=d_qp):
            d_rows = dot(d_qp, q, cfg, (0, 0))  # [C,Fp]
            index = jnp.broadcast_to(rows[:, None], d_rows.shape)
            features = lax.broadcasted_iota(jnp.int32, d_rows.shape, 1)
            jax.ref.addupdate(r.d_window_table, (head, index, features), d_rows)

    _barrier(cfg)  # every thread's reads of ds done before the next tile's store
    return share


def _head(cfg, n):
    return n if cfg.window.per_head else 0


def forward_hooks(cfg, r: Refs) -> ForwardHooks:
    """The forward's hook of query tile i = program_id(2), head n = program_id(1): the key term of tile (i, j)."""
    n, i = pl.program_id(1), pl.program_id(2)
    row0 = 0 if cfg.extents is None else i * cfg.Tb
    q = read(cfg, r.q, "q", row0).astype(jnp.float32)

    def logits(j, k):
        rows = _window_rows(r.window_table, _head(cfg, n), _rows(cfg.window, i, j))
        return _skewed(cfg, r.window_scratch, dot(q, rows, cfg, (1, 1)))

    return ForwardHooks(table_logits_of_key_tile=logits)


def dq_hooks(cfg, r: Refs) -> DqHooks:
    """The dq kernel's hooks of query tile i: the key term of tile (i, j), and from its ds the table's gradient
    (atomic adds) and dq's share dQP Pw (returned by add_table_grads)."""
    n, i = pl.program_id(1), pl.program_id(2)
    row0 = 0 if cfg.extents is None else i * cfg.Tb
    q = read(cfg, r.q, "q", row0).astype(jnp.float32)
    head = _head(cfg, n)

    def terms(j, k):
        rows = _window_rows(r.window_table, head, _rows(cfg.window, i, j))
        return _skewed(cfg, r.window_scratch, dot(q, rows, cfg, (1, 1))), None

    def add(j, k, p, ds):
        return _table_grads(cfg, r, head, i, j, q, ds.astype(jnp.float32))

    return DqHooks(table_terms_of_key_tile=terms, add_table_grads=add)


def dkv_hooks(cfg, r: Refs) -> DkvHooks:
    """The dk/dv kernel's hook of key tile j, key head kh: the key term of tile (i, j) for query head g of the
    group."""
    kh, j = pl.program_id(1), pl.program_id(2)
    G = cfg.N // cfg.K

    def terms(g, i, q, do):
        rows = _window_rows(r.window_table, _head(cfg, kh * G + g), _rows(cfg.window, i, j))
        return _skewed(cfg, r.window_scratch, dot(q.astype(jnp.float32), rows, cfg, (1, 1))), None

    return DkvHooks(table_terms_of_query_tile=terms)
