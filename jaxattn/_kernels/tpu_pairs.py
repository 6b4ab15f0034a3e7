"""Per-pair relative tables (relative_attention's A^K / A^V, seed 000's form) in the TPU kernels: flex_tpu's
forward, tpu_backward's dq and dk/dv.

    logits[t,s] = scale * q_t . (k_s + A^K[t,s])        out_t = sum_s p[t,s] (v_s + A^V[t,s])

The tables are inputs of O(T x S) ([T,S,N,F] per head, [T,S,1,F] shared), laid out [Nt,Tp,Sp,Fp] (layout: heads
first, padded to the kernels' grid and lanes) and left in HBM (memory space ANY): no block of them fits VMEM
beside one head's keys (a query tile's rows of every key at T = S = 4096, head dim 128, bf16, is 128 MiB). Each
hook copies the [R,Sb,Fp] slice of the tile it is at, R query rows at a time (ROWS), into VMEM and waits for it
(a synchronous DMA: the copy is not overlapped with the previous chunk's arithmetic; nothing is timed on a TPU).
A tile's terms are elementwise products and sums over one axis of that slice (no gather, no [B,N,T,S] logits,
no [B,T,S,F] product):

    forward   key term  sum_f q[t,f] A^K[t,s,f]         value term  sum_s p[t,s] A^V[t,s,f]
    dq        dp        += sum_f do[t,f] A^V[t,s,f]     dq          += sum_s ds[t,s] A^K[t,s,f]
              d A^K[t,s,f] += ds[t,s] q[t,f]            d A^V[t,s,f] += p[t,s] do[t,f]
    dk/dv     the key term and dp of each query tile, as the dq kernel's

Which kernel writes the table gradients: the dq kernel, which holds q and do of its rows. Its programs read,
add to and write back the [R,Sb,Fp] slices of a float32 [Nt,Tp,Sp,Fp] array in HBM (zeros XLA fills, an input
aliased to the output; the tiles no schedule visits keep them). Batch entries, and for a shared table the heads,
add into the same slices, so the dq grid runs in order ("arbitrary" on every axis: one core of a megacore chip)
and each read-add-write completes before the next program's; no atomics, which a TPU lacks.

What it combines with: what the kernel body applies per tile (causal, lengths, segment ids, window, chunks,
mask_mod, softcap, sinks, return_lse, grouped-query heads, positions of the call's own); score_mod, a BlockMask,
a position bias and Shaw's or DeBERTa's tables beside per-pair tables are refused by name
(pair_tables.NOT_BESIDE_PAIRS, as on a GPU).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# Query rows of a table's tile copied at once: a [16,128,128] float32 slice is 1 MiB of VMEM, and so is each
# elementwise product over it; 16 rows are one bf16 sublane tile. The interpreter's 16-row tiles take two
# chunks of 8, so that the tests cross a chunk's edge.
ROWS = 16
INTERPRET_ROWS = 8
TABLES = ("rel_key", "rel_value")


class PairTables(NamedTuple):
    """Static: the tile (Tb, Sb), the rows copied at once, and for each table whether it has one head per query
    head (True), one shared head (False) or is absent (None)."""

    Tb: int
    Sb: int
    rows: int
    key_heads: object  # True / False / None
    value_heads: object

    def heads(self, name):
        return self.key_heads if name == "rel_key" else self.value_heads

    def present(self):
        return tuple(name for name in TABLES if self.heads(name) is not None)


def of_call(tables: dict, N: int, Tb: int, Sb: int, interpret: bool) -> PairTables:
    """The PairTables of checked tables {name: [T,S,N|1,F]} (absent names: no table)."""
    heads = [None if name not in tables else tables[name].shape[2] == N for name in TABLES]
    rows = min(INTERPRET_ROWS if interpret else ROWS, Tb)
    return PairTables(Tb, Sb, rows, *heads)


def layout(table, Tp: int, Sp: int, Fp: int):
    """[T,S,Nt,F] -> [Nt,Tp,Sp,Fp], zero-padded (padded rows are discarded, padded keys masked, padded features
    meet q's and do's zero features)."""
    T, S, _, F = table.shape
    laid = jnp.transpose(table, (2, 0, 1, 3))
    return jnp.pad(laid, ((0, 0), (0, Tp - T), (0, Sp - S), (0, Fp - F)))


def inputs(laid: dict) -> dict:
    """The kernels' inputs of the laid-out tables: {name: (array, BlockSpec in HBM)}."""
    return {name: (x, pl.BlockSpec(memory_space=pl.ANY)) for name, x in laid.items()}


def scratch(pairs: PairTables, laid: dict, Hp: int, Hvp: int, grads: bool) -> dict:
    """VMEM the hooks use: each table's [R,Sb,Fp] slice (and with grads its gradient's, float32), the rows x of
    the products [Tb,F] and weights w [Tb,Sb], the results, and one DMA semaphore."""
    f32, Tb, Sb, R = jnp.float32, pairs.Tb, pairs.Sb, pairs.rows
    out = {}
    for name, x in laid.items():
        out[name + "_buf"] = pltpu.VMEM((R, Sb, x.shape[-1]), x.dtype)
        if grads:
            out["d_" + name + "_buf"] = pltpu.VMEM((R, Sb, x.shape[-1]), f32)
    out.update(
        pair_q=pltpu.VMEM((Tb, Hp), f32),
        pair_do=pltpu.VMEM((Tb, Hvp), f32),
        pair_w=pltpu.VMEM((Tb, Sb), f32),
        pair_term=pltpu.VMEM((Tb, Sb), f32),
        pair_dq=pltpu.VMEM((Tb, Hp), f32),
        pair_out=pltpu.VMEM((Tb, Hvp), f32),
        pair_sem=pltpu.SemaphoreType.DMA(()),
    )
    return out


# ---------------------------------------------------------------------------------------------------
# Inside the kernels: one tile's terms, R rows of the table's slice at a time.


def _copy(src, dst, sem):
    copy = pltpu.make_async_copy(src, dst, sem)
    copy.start()
    copy.wait()


class _Tile:
    """The tables' refs of one program, read at tile (t0, s0) of head `head` of each table."""

    def __init__(self, pairs: PairTables, r, head):
        self.pairs, self.r, self.head = pairs, r, head

    def _slice(self, ref, name, t0, s0, c):
        R = self.pairs.rows
        head = self.head if self.pairs.heads(name) else 0
        return ref.at[head, pl.ds(t0 + c * R, R), pl.ds(s0, self.pairs.Sb)]

    def _read(self, name, t0, s0, c):
        """Chunk c of the tile's [Tb,Sb,F] slice of table `name`: [R,Sb,F] float32."""
        buf = self.r[name + "_buf"]
        _copy(self._slice(self.r[name], name, t0, s0, c), buf, self.r["pair_sem"])
        return buf[...].astype(jnp.float32)

    def _chunks(self, body):
        R = self.pairs.rows

        def step(c, carry):
            body(c, pl.ds(pl.multiple_of(c * R, R), R))
            return carry

        lax.fori_loop(0, self.pairs.Tb // R, step, 0)

    def row_term(self, name, t0, s0, x):
        """sum_f x[t,f] A[t0 + t, s0 + s, f]: [Tb,Sb] float32 (x: [Tb,F], q for A^K and do for A^V, kept in
        pair_q / pair_do, where dq_and_grads reads them)."""
        x_ref, out = self.r["pair_q" if name == "rel_key" else "pair_do"], self.r["pair_term"]
        x_ref[...] = x.astype(jnp.float32)

        def body(c, rows):
            out[rows, :] = jnp.sum(x_ref[rows, :][:, None, :] * self._read(name, t0, s0, c), axis=-1)

        self._chunks(body)
        return out[...]

    def pair_sum(self, name, t0, s0, w, out):
        """out[t, f] += sum_s w[t,s] A[t0 + t, s0 + s, f] (out: a [Tb,F] float32 ref)."""
        w_ref = self.r["pair_w"]
        w_ref[...] = w.astype(jnp.float32)

        def body(c, rows):
            out[rows, :] = out[rows, :] + jnp.sum(w_ref[rows, :][:, :, None] * self._read(name, t0, s0, c), axis=1)

        self._chunks(body)

    def dq_and_grads(self, t0, s0, p, ds):
        """The dq kernel's sums of tile (t0, s0): pair_dq += sum_s ds A^K; d A^K += ds q, d A^V += p do (the
        gradients' slices read, added to and written back; pair_q / pair_do hold q and do)."""
        r, f32 = self.r, jnp.float32
        for name, w in (("rel_key", ds), ("rel_value", p)):
            if self.pairs.heads(name) is None:
                continue
            w_ref, x_ref = r["pair_w"], r["pair_q" if name == "rel_key" else "pair_do"]
            w_ref[...] = w.astype(f32)
            grad, buf = r["d_" + name], r["d_" + name + "_buf"]

            def body(c, rows, name=name, w_ref=w_ref, x_ref=x_ref, grad=grad, buf=buf):
                w_rows = w_ref[rows, :]
                if name == "rel_key":  # dq's share: one pass over A^K with its gradient
                    a = self._read(name, t0, s0, c)
                    r["pair_dq"][rows, :] = r["pair_dq"][rows, :] + jnp.sum(w_rows[:, :, None] * a, axis=1)
                at = self._slice(grad, name, t0, s0, c)
                _copy(at, buf, r["pair_sem"])
                buf[...] = buf[...] + w_rows[:, :, None] * x_ref[rows, :][:, None, :]
                _copy(buf, at, r["pair_sem"])

            self._chunks(body)


def forward_hooks(pairs: PairTables, r, n, i):
    """tile_body.key_tiles' hooks for query tile i of head n: the key term of tile (i, j) and its value term."""
    tile = _Tile(pairs, r, n)
    t0, f32 = i * pairs.Tb, jnp.float32
    if pairs.key_heads is not None:
        q = r["q"][...]
        r["table_logits_of_tile"] = lambda j, k: tile.row_term("rel_key", t0, j * pairs.Sb, q)

    def values(j, p):
        out = r["pair_out"]
        out[...] = jnp.zeros(out.shape, f32)
        tile.pair_sum("rel_value", t0, j * pairs.Sb, p, out)
        return out[...]

    if pairs.value_heads is not None:
        r["table_values_of_tile"] = values


def _terms(pairs: PairTables, tile: _Tile, t0, s0, q, do):
    key_term = None if pairs.key_heads is None else tile.row_term("rel_key", t0, s0, q)
    dp = None if pairs.value_heads is None else tile.row_term("rel_value", t0, s0, do)
    return key_term, dp


def dq_hooks(pairs: PairTables, r, n, i):
    """flash_gpu.dq_kernel's hooks for query tile i of head n: the tile's terms, the tables' gradients, dq's share."""
    tile = _Tile(pairs, r, n)
    t0, f32 = i * pairs.Tb, jnp.float32
    q, do = r["q"][...], r["do"][...]
    r["pair_dq"][...] = jnp.zeros(r["pair_dq"].shape, f32)

    def add(j, k, p, ds):
        r["pair_q"][...], r["pair_do"][...] = q.astype(f32), do.astype(f32)
        tile.dq_and_grads(t0, j * pairs.Sb, p, ds)

    r["table_terms_of_tile"] = lambda j, k: _terms(pairs, tile, t0, j * pairs.Sb, q, do)
    r["add_table_grads"] = add
    r["finish_table_grads"] = lambda dq: dq + r["pair_dq"][...].astype(dq.dtype)


def dkv_hooks(pairs: PairTables, r, n_of, j):
    """flash_gpu.dkv_kernel's hook for key tile j: query tile i's terms for query head n_of(g)."""

    def terms(g, i, q, do):
        return _terms(pairs, _Tile(pairs, r, n_of(g)), i * pairs.Tb, j * pairs.Sb, q, do)

    r["table_terms_of_tile"] = terms
