"""Per-pair relative tables (relative_attention's A^K / A^V, seed 000's form) in the TPU kernels: flex_tpu's
forward, flex_tpu_vjp's dq and dk/dv.

    logits[t,s] = scale * q_t . (k_s + A^K[t,s])        out_t = sum_s p[t,s] (v_s + A^V[t,s])

The tables are inputs of O(T x S) ([T,S,N,F] per head, [T,S,1,F] shared), read as [T,Nt,F,S] (layout: keys
last) and left in HBM (memory space ANY): no block of them fits VMEM beside one head's keys (a query tile's rows
of every key at T = S = 4096, head dim 128, bf16, is 128 MiB). Keys last because a TPU's HBM tiles the last two
dims of an array together: a DMA cannot take one head out of the caller's [..., N, F] tiles, but it can take
head n of [T,Nt,F,S] (n is not a tiled dim). A TPU's default layout of a table with F < 128 is that order
already (S on the lanes, no padding), so the transpose costs nothing; with F >= 128 (row-major by default) it
is a copy. Each hook copies the [R,F,Sb] slice of the tile it is at, R query rows at a time (ROWS), into VMEM
and waits for it (a synchronous DMA, not overlapped with the arithmetic; nothing is timed on a TPU). A tile's
terms are products of each query row with its [F,Sb] slice (dots batched over the R rows; no gather, no
[B,N,T,S] logits, no [B,T,S,F] product):

    forward   key term  sum_f q[t,f] A^K[t,f,s]         value term  sum_s p[t,s] A^V[t,f,s]
    dq        dp        += sum_f do[t,f] A^V[t,f,s]     dq          += sum_s ds[t,s] A^K[t,f,s]
              d A^K[t,f,s] += q[t,f] ds[t,s]            d A^V[t,f,s] += do[t,f] p[t,s]
    dk/dv     the key term and dp of each query tile, as the dq kernel's

Which kernel writes the table gradients: the dq kernel, which holds q and do of its rows. With one batch entry a
per-head table's slice is one program's: it stores it in the table's dtype (into zeros XLA fills, an input
aliased to the output: the tiles no schedule visits keep them). Otherwise batch entries, and for a shared table
the heads, add into the same slices of a float32 array: read, added to and written back, the dq grid in order
("arbitrary" on every axis: one core of a megacore chip), since a TPU has no atomic adds.

What it combines with: what the kernel body applies per tile (causal, lengths, segment ids, window, chunks,
mask_mod, softcap, sinks, return_lse, grouped-query heads, positions of the call's own); score_mod, a BlockMask,
a position bias and Shaw's or DeBERTa's tables beside per-pair tables are refused by name
(pairs_gpu.NOT_BESIDE_PAIRS, as on a GPU).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from .flash.refs import DkvHooks, DqHooks, ForwardHooks, Refs
from .refs_tpu import IN_HBM

# Query rows of a table's tile copied at once: a [16,F,128] float32 slice is 512 KiB of VMEM at F = 64; 16 rows
# are one bf16 sublane tile. The interpreter's 16-row tiles take two chunks of 8, so that the tests cross a
# chunk's edge.
ROWS = 16
INTERPRET_ROWS = 8
TABLES = ("rel_key", "rel_value")


class PairTables(NamedTuple):
    """Static: the tile (Tb, Sb), the rows copied at once, the dots' precision, and for each table whether it has
    one head per query head (True), one shared head (False) or is absent (None), and whether each program owns
    the slices of its gradient it writes (one batch entry, one head per query head: stored, not added)."""

    Tb: int
    Sb: int
    rows: int
    precision: object
    key_heads: object  # True / False / None
    value_heads: object
    key_owned: bool = False
    value_owned: bool = False

    def heads(self, name):
        return self.key_heads if name == "rel_key" else self.value_heads

    def owned(self, name):
        return self.key_owned if name == "rel_key" else self.value_owned


def of_call(tables: dict, B: int, N: int, Tb: int, Sb: int, precision, interpret: bool) -> PairTables:
    """The PairTables of checked tables {name: [T,S,N|1,F]} (absent names: no table) with B batch entries."""
    heads = [None if name not in tables else tables[name].shape[2] == N for name in TABLES]
    rows = min(INTERPRET_ROWS if interpret else ROWS, Tb)
    return PairTables(Tb, Sb, rows, precision, *heads, *(h is True and B == 1 for h in heads))


def layout(table, Tp: int, Sp: int):
    """[T,S,Nt,F] -> [Tp,Nt,F,Sp]: keys last. A TPU's default layout of a [T,S,N,F] table with F < 128 already
    holds it in that order (S on the lanes, unpadded), so XLA makes this transpose a bitcast; T and S are padded
    (a copy) only when they are not whole tiles (padded rows are discarded, padded keys masked)."""
    T, S = table.shape[:2]
    laid = jnp.transpose(table, (0, 2, 3, 1))
    if (T, S) != (Tp, Sp):
        laid = jnp.pad(laid, ((0, Tp - T), (0, 0), (0, 0), (0, Sp - S)))
    return laid


def inputs(laid: dict) -> dict:
    """The kernels' inputs of the laid-out tables: {name: (array, BlockSpec in HBM)}."""
    return {name: (x, IN_HBM) for name, x in laid.items()}


def gradient_dtype(pairs: PairTables, name: str, table_dtype):
    """A table's gradient: stored in the table's dtype where each program owns its slices, else summed in
    float32."""
    return table_dtype if pairs.owned(name) else jnp.float32


def scratch(pairs: PairTables, laid: dict, Hp: int, Hvp: int, grads: bool) -> dict:
    """VMEM the hooks use: each table's [R,F,Sb] slice (and with grads its gradient's), the rows x of the
    products [Tb,H|Hv] and weights w [Tb,Sb], the results, and one DMA semaphore."""
    f32, Tb, Sb, R = jnp.float32, pairs.Tb, pairs.Sb, pairs.rows
    out = {}
    for name, x in laid.items():
        out[name + "_buf"] = pltpu.VMEM((R, x.shape[2], Sb), x.dtype)
        if grads:
            out["d_" + name + "_buf"] = pltpu.VMEM((R, x.shape[2], Sb), gradient_dtype(pairs, name, x.dtype))
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
# Inside the kernels: one tile's terms, R rows of the table's slice at a time. Per query row each term is a
# product of a row with the row's [F,Sb] slice: batched dots over the R rows (an MXU product of one row each).


def _copy(src, dst, sem):
    copy = pltpu.make_async_copy(src, dst, sem)
    copy.start()
    copy.wait()


def _batched(a, b, contract, precision):
    """a [R,...] . b [R,...] over axes contract = (a's, b's), batched over the rows R."""
    dims = (((contract[0],), (contract[1],)), ((0,), (0,)))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


class PairRefs(NamedTuple):
    """The hooks' VMEM (scratch()): each table's [R,F,Sb] slice buffer (and its gradient's), the rows x of the
    products, the weights w, the results, and the DMA semaphore."""

    rel_key_buf: Any = None
    rel_value_buf: Any = None
    d_rel_key_buf: Any = None
    d_rel_value_buf: Any = None
    pair_q: Any = None
    pair_do: Any = None
    pair_w: Any = None
    pair_term: Any = None
    pair_dq: Any = None
    pair_out: Any = None
    pair_sem: Any = None


class _TableRefs(NamedTuple):
    table: Any
    buf: Any
    x: Any
    grad: Any
    grad_buf: Any


class _Tile:
    """The tables' refs of one program, read at tile (t0, s0) of head `head` of each table."""

    def __init__(self, pairs: PairTables, r: Refs, t: PairRefs, head):
        self.pairs, self.t, self.head = pairs, t, head
        # per table: (its ref, its slice's VMEM buffer, the rows x it multiplies, its gradient, that one's buffer)
        self.of = {
            "rel_key": _TableRefs(r.rel_key, t.rel_key_buf, t.pair_q, r.d_rel_key, t.d_rel_key_buf),
            "rel_value": _TableRefs(r.rel_value, t.rel_value_buf, t.pair_do, r.d_rel_value, t.d_rel_value_buf),
        }

    def _slice(self, ref, name, t0, s0, c):
        R = self.pairs.rows
        head = self.head if self.pairs.heads(name) else 0
        return ref.at[pl.ds(t0 + c * R, R), head, :, pl.ds(s0, self.pairs.Sb)]

    def _read(self, name, t0, s0, c):
        """Chunk c of the tile's slice of table `name`: [R,F,Sb] float32."""
        buf = self.of[name].buf
        _copy(self._slice(self.of[name].table, name, t0, s0, c), buf, self.t.pair_sem)
        return buf[...].astype(jnp.float32)

    def _width(self, name):
        return self.of[name].buf.shape[1]

    def _chunks(self, body):
        R = self.pairs.rows

        def step(c, carry):
            body(c, pl.ds(pl.multiple_of(c * R, R), R))
            return carry

        lax.fori_loop(0, self.pairs.Tb // R, step, 0)

    def row_term(self, name, t0, s0, x):
        """sum_f x[t,f] A[t0 + t, s0 + s, f]: [Tb,Sb] float32 (x: [Tb,H|Hv], q for A^K and do for A^V, kept in
        pair_q / pair_do, where dq_and_grads reads them; features past the table's F are the padding's zeros)."""
        x_ref, out, F = self.of[name].x, self.t.pair_term, self._width(name)
        x_ref[...] = x.astype(jnp.float32)

        def body(c, rows):
            x_rows = x_ref[rows, :F][:, None, :]  # [R,1,F]
            out[rows, :] = _batched(x_rows, self._read(name, t0, s0, c), (2, 1), self.pairs.precision)[:, 0, :]

        self._chunks(body)
        return out[...]

    def pair_sum(self, name, t0, s0, w, out):
        """out[t, f] += sum_s w[t,s] A[t0 + t, s0 + s, f] (out: a [Tb,H|Hv] float32 ref; f < the table's F)."""
        w_ref, F = self.t.pair_w, self._width(name)
        w_ref[...] = w.astype(jnp.float32)

        def body(c, rows):
            sums = _batched(w_ref[rows, :][:, None, :], self._read(name, t0, s0, c), (2, 2), self.pairs.precision)
            out[rows, :F] = out[rows, :F] + sums[:, 0, :]

        self._chunks(body)

    def dq_and_grads(self, t0, s0, p, ds):
        """The dq kernel's sums of tile (t0, s0): pair_dq += sum_s ds A^K; d A^K += ds q, d A^V += p do (the
        gradients' slices stored where the program owns them, else read, added to and written back; pair_q /
        pair_do hold q and do)."""
        t, f32, pairs = self.t, jnp.float32, self.pairs
        for name, w in (("rel_key", ds), ("rel_value", p)):
            if pairs.heads(name) is None:
                continue
            w_ref, x_ref = t.pair_w, self.of[name].x
            w_ref[...] = w.astype(f32)
            grad, buf, F = self.of[name].grad, self.of[name].grad_buf, self._width(name)

            def body(c, rows, name=name, w_ref=w_ref, x_ref=x_ref, grad=grad, buf=buf, F=F):
                w_rows = w_ref[rows, :][:, None, :]  # [R,1,Sb]
                if name == "rel_key":  # dq's share: one pass over A^K with its gradient
                    sums = _batched(w_rows, self._read(name, t0, s0, c), (2, 2), pairs.precision)
                    t.pair_dq[rows, :F] = t.pair_dq[rows, :F] + sums[:, 0, :]
                outer = _batched(x_ref[rows, :F][:, None, :], w_rows, (1, 1), pairs.precision)  # [R,F,Sb]
                at = self._slice(grad, name, t0, s0, c)
                if pairs.owned(name):
                    buf[...] = outer.astype(buf.dtype)
                else:
                    _copy(at, buf, t.pair_sem)
                    buf[...] = buf[...] + outer
                _copy(buf, at, t.pair_sem)

            self._chunks(body)


def forward_hooks(pairs: PairTables, r: Refs, t: PairRefs, n, i) -> ForwardHooks:
    """The forward's hooks for query tile i of head n: the key term of tile (i, j) and its value term."""
    tile = _Tile(pairs, r, t, n)
    t0, f32 = i * pairs.Tb, jnp.float32
    logits = None
    if pairs.key_heads is not None:
        q = r.q[...]
        logits = lambda j, k: tile.row_term("rel_key", t0, j * pairs.Sb, q)  # noqa: E731

    def values(j, p):
        out = t.pair_out
        out[...] = jnp.zeros(out.shape, f32)
        tile.pair_sum("rel_value", t0, j * pairs.Sb, p, out)
        return out[...]

    return ForwardHooks(
        table_logits_of_key_tile=logits, table_values_of_key_tile=values if pairs.value_heads is not None else None
    )


def _terms(pairs: PairTables, tile: _Tile, t0, s0, q, do):
    key_term = None if pairs.key_heads is None else tile.row_term("rel_key", t0, s0, q)
    dp = None if pairs.value_heads is None else tile.row_term("rel_value", t0, s0, do)
    return key_term, dp


def dq_hooks(pairs: PairTables, r: Refs, t: PairRefs, n, i) -> DqHooks:
    """backward.dq_kernel's hooks for query tile i of head n: the tile's terms, the tables' gradients, dq's share."""
    tile = _Tile(pairs, r, t, n)
    t0, f32 = i * pairs.Tb, jnp.float32
    q, do = r.q[...], r.do[...]
    t.pair_dq[...] = jnp.zeros(t.pair_dq.shape, f32)

    def add(j, k, p, ds):
        t.pair_q[...], t.pair_do[...] = q.astype(f32), do.astype(f32)
        tile.dq_and_grads(t0, j * pairs.Sb, p, ds)

    return DqHooks(
        table_terms_of_key_tile=lambda j, k: _terms(pairs, tile, t0, j * pairs.Sb, q, do),
        add_table_grads=add,
        finish_dq=lambda dq: dq + t.pair_dq[...].astype(dq.dtype),
    )


def dkv_hooks(pairs: PairTables, r: Refs, t: PairRefs, n_of, j) -> DkvHooks:
    """backward.dkv_kernel's hook for key tile j: query tile i's terms for query head n_of(g)."""

    def terms(g, i, q, do):
        return _terms(pairs, _Tile(pairs, r, t, n_of(g)), i * pairs.Tb, j * pairs.Sb, q, do)

    return DkvHooks(table_terms_of_query_tile=terms)
