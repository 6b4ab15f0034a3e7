"""Sequence-parallel (ring) attention: queries stay put, key/value chunks travel round a ring of devices.

With the sequence split over the D devices of one mesh axis, device d holds its queries and one share
of the keys/values. Each step it attends its queries to the key/value share it holds (the blockwise
engine, called one query tile at a time), merges that partial result into its running one
(combine_partials: the online softmax), and passes the share on to device d + 1 (lax.ppermute). After D
steps every query has seen every key. The share travels in P pieces (PIECES_PER_SHARE, whole key
tiles each): a piece is passed on as soon as every query tile has used it, and the piece arriving is
written over it in place, so a device holds its share plus about one piece in flight, not two shares:

    acc = empty partial
    for step in 0 .. D-1:
        for each piece p of the share held (keys [p Pk, (p+1) Pk)):
            for each query tile i:                               key tiles with no allowed key skipped
                acc[i] = combine_partials(acc[i], engine(q[i], k[p], v[p], global positions))
            k[p], v[p] = ppermute((k[p], v[p]), d -> d + 1)      (in flight while piece p+1 computes)
    out = finalize_partial(acc)

Backward (custom VJP, FlashAttention-2 style): the same ring again; dq accumulates where its queries
are, dk/dv accumulators travel with their key/value piece and arrive home after D hops. Each tile's
gradients are the blockwise engine's backward tile (blockwise.bwd_tile) given the *global* log-sum-exp
and rowsum(d_out * out), which is computed once, so the output itself is not held during the ring.

Causal balance: with contiguous shares, device d's queries see d + 1 of the D shares, so the last
device does D times the work of the first and the ring waits for it. Causal rings therefore use the
"zigzag" layout: the sequence is cut into 2D chunks and device d holds chunks d and 2D-1-d (an early
and a late one). Every step except the first then needs exactly half of the (query chunk, key chunk)
pairs: (both query chunks x the earlier key chunk) when the key share comes from a device before d, (the
later query chunk x both key chunks) when from after d; the engine skips the other half tile by tile
(its key range per query tile is empty). Every device does the same work. Inputs and outputs stay in
natural order; the zigzag reorder happens inside the ring program, one ppermute of each half of the local
share each way (no global reordered copies).

Memory (per device, units of one local share [S/D, N, H]): the local queries in the engine layout (1),
the key/value share held (2) plus about a piece in flight, the accumulator (written into the output
buffer), plus a few tiles, whose default size shrinks with the share (tiles.ring_tile_sizes). Backward adds the
cotangent in the engine layout (1), dq (1) and the travelling dk/dv accumulators (2).

Every position-dependent term (causal mask, Shaw buckets, the position_bias hook) reads global
positions computed from each chunk's offset in the sequence, never sliced from a global array.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from .._core import checks
from .._core.dtypes import accumulation_dtype
from .._core.masks import MaskRule, check_lengths
from .._core.softmax import combine_partials, empty_partial, finalize_partial, has_keys, public_lse
from . import blockwise, tiles
from .blockwise import KeySide, QueryTile, RowGrads, Shared, slice_block

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import ArrayLike, Float, Int

    from .._core.shapes import Attended


# A device's key/value share travels in this many pieces, each passed on once used: the share in flight
# beside the one held is then 1/PIECES_PER_SHARE of it (whole shares would double the keys/values a
# device holds). More pieces: smaller messages and one more pass over the accumulator each.
PIECES_PER_SHARE = 8


class _Ring(NamedTuple):
    """Static description of one ring_attention call (hashable: the custom VJP's nondiff argument)."""

    mesh: Any
    seq: Optional[str]  # mesh axes (None: not split over)
    batch: Optional[str]
    head: Optional[str]
    D: int  # ring size: devices along seq
    C: int  # chunks per device: 2 (zigzag) or 1 (contiguous)
    nb: int  # number of batch dims
    T: int
    S: int
    Cq: int  # chunk lengths, and padded to whole tiles
    Ck: int
    Cqp: int
    Ckp: int
    N: int  # query heads, global and on one device
    Nl: int
    m: int  # pieces per chunk: the unit that travels (Pk keys, whole key tiles)
    Pk: int
    lengths: bool  # key lengths in use (given, or to mask padded keys)
    engine: Any  # blockwise.Config for one (query chunk, key chunk) pair; bias_fn for all N heads
    # each step on a kernel: step(q, k, v, q_pos, k_pos, lengths, key_table, value_table) -> (out [...,T,N,Hv],
    # lse [...,N,T]), one attention call of the device's queries against one key chunk (jaxattn._dispatch.ring);
    # None: the blockwise engine's tiles
    step: Any = None


# ---------------------------------------------------------------------------------------------------
# Specs and per-device layout.


def _spec(ring, letters):
    """PartitionSpec of a [*batch, L, heads, F] array (letters "TNH" / "SKH"), lengths ("B"), or tables."""
    batch = (ring.batch,) + (None,) * (ring.nb - 1) if ring.nb else ()
    if letters == "B":
        return PartitionSpec(*batch)
    return PartitionSpec(*batch, ring.seq, ring.head, None)


def _table_spec(ring, table):
    if table is None or table.ndim == 2:
        return PartitionSpec()
    return PartitionSpec(None, ring.head, None)


def _lse_spec(ring):
    if ring.step is not None:  # [*b, C*Cq, N]
        return PartitionSpec(*_spec(ring, "B"), ring.seq, ring.head)
    return PartitionSpec(ring.batch, ring.head, None, ring.seq)


def _ring_index(ring):
    return lax.axis_index(ring.seq) if ring.seq is not None else jnp.int32(0)


def _chunk_ids(ring, d):
    """Global chunk index in each slot of device d. Zigzag: chunks d and 2D-1-d, in the order the
    reorder delivers them (slot h holds the chunk that arrived as half h of a natural share, i.e. the
    even-numbered chunk in slot 0); contiguous: (d,)."""
    if ring.C == 1:
        return (d,)
    late = 2 * ring.D - 1 - d
    even = d % 2 == 0
    return jnp.where(even, d, late), jnp.where(even, late, d)


def _query_positions(ring, d):
    """Global positions [C*Cqp] of the query chunks device d holds, slot after slot (padding repeats the
    last position): query t at t + (S - T), bottom-right aligned. Keys: _piece_keys."""
    local = jnp.minimum(jnp.arange(ring.Cqp, dtype=jnp.int32), ring.Cq - 1)
    return jnp.concatenate([(c * ring.Cq + local + ring.S - ring.T).astype(jnp.int32) for c in _chunk_ids(ring, d)])


def _engine_cfg(ring):
    """The pair config on this device: a position_bias hook gives all N heads; keep this device's."""
    cfg = ring.engine
    if cfg.bias_fn is None or ring.head is None:
        return cfg
    full_fn, Nl, head = cfg.bias_fn, ring.Nl, ring.head

    def local_heads(qp, kp, *consts):
        return lax.dynamic_slice_in_dim(full_fn(qp, kp, *consts), lax.axis_index(head) * Nl, Nl, axis=-3)

    return cfg._replace(bias_fn=local_heads)


def _shift(ring, x):
    """Pass x (a pytree) one device along the ring: d -> d + 1."""
    if ring.D == 1:
        return x
    perm = [(i, (i + 1) % ring.D) for i in range(ring.D)]
    return lax.ppermute(x, ring.seq, perm)


def _psum(x, axes):
    axes = tuple(a for a in axes if a is not None)
    return jax.tree.map(lambda g: lax.psum(g, axes), x) if axes else x


# ---------------------------------------------------------------------------------------------------
# The zigzag reorder, inside the ring program: device e's natural share is chunks 2e and 2e+1 (its two
# halves); chunk c goes to device c (c < D) or 2D-1-c (c >= D). One ppermute per half, each way.


def _zigzag_perms(D):
    """For each half h of a device's natural share (chunk c = 2e + h on device e), where it goes."""

    def dest(c):
        return c if c < D else 2 * D - 1 - c

    return [[(e, dest(2 * e + h)) for e in range(D)] for h in (0, 1)]


def _arrive(ring, x):
    """Local natural share [*b, C*L, X, F] -> the chunks this device holds, one [*b, L, X, F] per slot."""
    if ring.C == 1:
        return (x,)
    halves = jnp.split(x, 2, axis=ring.nb)
    return tuple(lax.ppermute(h, ring.seq, perm) for h, perm in zip(halves, _zigzag_perms(ring.D)))


def _depart(ring, chunks):
    """The inverse of _arrive: one [*b, L, X, F] per slot -> the local natural share."""
    if ring.C == 1:
        return chunks[0]
    back = [[(b, a) for a, b in perm] for perm in _zigzag_perms(ring.D)]
    return jnp.concatenate([lax.ppermute(c, ring.seq, p) for c, p in zip(chunks, back)], axis=ring.nb)


def _to_engine(x, L, Lp, K=None):
    """One chunk [*b, L, X, F] -> [B, X, Lp, F] (padded to whole tiles); with K, query heads X = N are
    viewed as [K, G]: [B, K, G, Lp, F]."""
    x = x.reshape(-1, L, *x.shape[-2:])
    x = jnp.moveaxis(jnp.pad(x, [(0, 0), (0, Lp - L), (0, 0), (0, 0)]), 1, 2)
    return x if K is None else x.reshape(x.shape[0], K, x.shape[1] // K, *x.shape[2:])


def _from_engine(x, L, batch_shape):
    """[B, K, (G,) Lp, F] -> one chunk [*b, L, X, F]."""
    B, Lp, F = x.shape[0], x.shape[-2], x.shape[-1]
    x = jnp.moveaxis(x.reshape(B, -1, Lp, F)[:, :, :L], 1, 2)
    return x.reshape(*batch_shape, L, x.shape[-2], F)


def _queries(ring, x, K):
    """Local natural queries (or outputs, cotangents) -> [B, K, G, C*Cqp, F]: the slots' chunks side by
    side along the sequence (each padded to whole query tiles, so no tile straddles two chunks)."""
    return jnp.concatenate([_to_engine(c, ring.Cq, ring.Cqp, K) for c in _arrive(ring, x)], axis=3)


def _keys(ring, x):
    """Local natural keys (or values) -> [B, K, C*Ckp, F]: the slots' chunks side by side (each padded to
    whole key tiles; its padding and key lengths are its own)."""
    return jnp.concatenate([_to_engine(c, ring.Ck, ring.Ckp) for c in _arrive(ring, x)], axis=2)


def _unqueries(ring, x, batch_shape):
    """[B, K, G, C*Cqp, F] -> local natural [*b, C*Cq, N, F]."""
    chunks = jnp.split(x, ring.C, axis=-2)
    return _depart(ring, [_from_engine(c, ring.Cq, batch_shape) for c in chunks])


def _unkeys(ring, xs, batch_shape):
    return _depart(ring, [_from_engine(x, ring.Ck, batch_shape) for x in xs])


# ---------------------------------------------------------------------------------------------------
# The ring: forward and backward bodies (per device, inside shard_map).


def _piece_keys(ring, src, p, lengths):
    """Global positions [Pk] of piece p of the share that device src owns, and its valid keys counted
    from the piece's start ([B|1], or None). Padding (past the chunk's Ck keys) repeats the last
    position and lies beyond every length."""
    c, start = divmod(p, ring.m)
    start *= ring.Pk
    chunk = _chunk_ids(ring, src)[c]
    local = jnp.minimum(start + jnp.arange(ring.Pk, dtype=jnp.int32), ring.Ck - 1)
    k_pos = (chunk * ring.Ck + local).astype(jnp.int32)
    if not ring.lengths:
        return k_pos, None
    total = jnp.full((1,), ring.S, jnp.int32) if lengths is None else lengths.reshape(-1).astype(jnp.int32)
    return k_pos, jnp.clip(total - chunk * ring.Ck - start, 0, max(0, min(ring.Pk, ring.Ck - start)))


def _ring_loop(ring, d, visit, carry, held, home=()):
    """Visit the D key/value shares in ring order, one piece at a time: carry, held = visit(carry, held,
    p, src) for piece p (keys [p*Pk, (p+1)*Pk) of `held`, a dict of [B,K,C*Ckp,F] arrays) of the share
    device src owns. Each piece is passed on as soon as every query tile has used it and the piece that
    arrives is written over it in place, so one piece, not a whole share, is in flight beside the share
    held. After the last visit only the entries named in `home` (the travelling dk/dv) move: their last
    hop brings them to the device owning their keys."""

    def sweep(carry, held, src, moving):
        for p in range(ring.C * ring.m):
            carry, held = visit(carry, held, p, src)
            if moving and ring.D > 1:
                # the barrier orders this piece's ppermute after the compute that reads it (else XLA may
                # issue every ppermute at the start of the step and hold two whole shares)
                carry, held = lax.optimization_barrier((carry, held))
                held = {
                    name: (_put(x, _shift(ring, _piece(ring, x, p)), p * ring.Pk) if name in moving else x)
                    for name, x in held.items()
                }
        return carry, held

    def step(state, s):
        carry, held = state
        return sweep(carry, held, (d - s) % ring.D, tuple(held)), None

    (carry, held), _ = lax.scan(step, (carry, held), jnp.arange(ring.D - 1, dtype=jnp.int32))
    return sweep(carry, held, (d + 1) % ring.D, home)


def _piece(ring, x, p):
    return x[:, :, p * ring.Pk : (p + 1) * ring.Pk]


def _put(x, piece, start):
    return lax.dynamic_update_slice_in_dim(x, piece, start, axis=2)


def _over_query_tiles(visit_tile, carry, n):
    """carry = visit_tile(carry, i) for each of the n query tiles of this device. The ring runs the
    engine one query tile at a time: its result is then one tile (no stacked copy of a whole chunk),
    and every array it reads is a whole held buffer or a tile-sized slice."""
    return lax.fori_loop(0, n, lambda i, c: visit_tile(c, i), carry)


def _fwd_body(ring, q, k, v, key_table, value_table, consts, scale, lengths):
    if ring.step is not None:
        return _step_fwd_body(ring, q, k, v, key_table, value_table, consts, lengths)
    cfg = _engine_cfg(ring)
    batch_shape = q.shape[: ring.nb]
    acc_dtype = accumulation_dtype(q.dtype)
    K, Tb = k.shape[-2], cfg.Tb
    q = _queries(ring, q, K)  # [B,K,G,C*Cqp,H]
    held = {"k": _keys(ring, k), "v": _keys(ring, v)}  # [B,K,C*Ckp,F]: the slots side by side
    d = _ring_index(ring)
    q_pos = _query_positions(ring, d)
    rows = q.shape[:-1]
    shared = Shared(key_table, value_table, consts, scale)

    def visit(partial, held, p, src):
        k_pos, length = _piece_keys(ring, src, p, lengths)
        # the piece as its own (piece-sized) array: a slice of the held share handed to the tile loop
        piece = KeySide(*(_piece(ring, held[name], p) for name in ("k", "v")), k_pos, length)

        def tile(partial, i):
            q_tile = QueryTile(slice_block(q, i * Tb, Tb, 3), slice_block(q_pos, i * Tb, Tb, 0))
            # the engine skips key tiles with no allowed key (all of them: out 0, lse no_key)
            out, lse = blockwise.fwd_tile(cfg, q_tile, piece, shared)
            # a normalised partial (out, lse) is the unnormalised one (out, m=lse, l=1)
            part = tuple(slice_block(x, i * Tb, Tb, 3) for x in partial)
            part = combine_partials(part, (out, lse, has_keys(lse).astype(acc_dtype)))
            return tuple(lax.dynamic_update_slice_in_dim(x, y, i * Tb, 3) for x, y in zip(partial, part))

        return _over_query_tiles(tile, partial, q.shape[3] // Tb), held

    (out0,), m0, l0 = empty_partial((rows + v.shape[-1:],), rows, acc_dtype, q)
    (out, m, l), _ = _ring_loop(ring, d, visit, (out0, m0, l0), held)
    (out,), lse = finalize_partial(((out,), m, l))
    return _unqueries(ring, out.astype(q.dtype), batch_shape), lse  # lse [B,K,G,C*Cqp], slot order


def _bwd_body(ring, q, k, v, key_table, value_table, consts, scale, lengths, out, lse, d_out):
    if ring.step is not None:
        return _step_bwd_body(ring, q, k, v, key_table, value_table, consts, lengths, out, lse, d_out)
    cfg = _engine_cfg(ring)
    batch_shape = q.shape[: ring.nb]
    acc_dtype = accumulation_dtype(q.dtype)
    dtypes = (q.dtype, k.dtype, v.dtype)
    K, Tb = k.shape[-2], cfg.Tb
    # delta = rowsum(d_out * out) once, in the natural layout: the output itself is not held in the ring
    delta = jnp.sum(d_out.astype(acc_dtype) * out.astype(acc_dtype), axis=-1, keepdims=True)
    delta = _queries(ring, delta, K)[..., 0]  # [B,K,G,C*Cqp]
    q, d_out = _queries(ring, q, K), _queries(ring, d_out, K)
    held = {"k": _keys(ring, k), "v": _keys(ring, v)}
    shared = Shared(key_table, value_table, consts, scale)
    zeros = blockwise.zero_grads(acc_dtype, KeySide(held["k"], held["v"], None), shared)
    # dk/dv accumulators travel with their key/value piece (in `held`); the tables' and hook's stay here
    held["dk"], held["dv"], d_tables = zeros.dk, zeros.dv, zeros._replace(dk=None, dv=None)
    d = _ring_index(ring)
    q_pos = _query_positions(ring, d)

    def visit(carry, held, p, src):
        k_pos, length = _piece_keys(ring, src, p, lengths)
        piece = KeySide(*(_piece(ring, held[name], p) for name in ("k", "v")), k_pos, length)

        def tile(state, i):
            dq, grads = state
            q_tile = QueryTile(slice_block(q, i * Tb, Tb, 3), slice_block(q_pos, i * Tb, Tb, 0))
            rows = RowGrads(*(slice_block(x, i * Tb, Tb, 3) for x in (d_out, lse, delta)))
            dq_blk, grads = blockwise.bwd_tile(cfg, q_tile, rows, piece, shared, grads)
            dq = lax.dynamic_update_slice_in_dim(dq, slice_block(dq, i * Tb, Tb, 3) + dq_blk, i * Tb, 3)
            return dq, grads

        dq, d_tables = carry
        dk, dv = (_piece(ring, held[name], p) for name in ("dk", "dv"))
        dq, grads = _over_query_tiles(tile, (dq, d_tables._replace(dk=dk, dv=dv)), q.shape[3] // Tb)
        start = p * ring.Pk
        return (
            (dq, grads._replace(dk=None, dv=None)),
            {**held, "dk": _put(held["dk"], grads.dk, start), "dv": _put(held["dv"], grads.dv, start)},
        )

    (dq, d_tables), held = _ring_loop(ring, d, visit, (jnp.zeros_like(q, acc_dtype), d_tables), held, home=("dk", "dv"))
    dq = _unqueries(ring, dq.astype(dtypes[0]), batch_shape)
    dk = _unkeys(ring, [g.astype(dtypes[1]) for g in jnp.split(held["dk"], ring.C, axis=2)], batch_shape)
    dv = _unkeys(ring, [g.astype(dtypes[2]) for g in jnp.split(held["dv"], ring.C, axis=2)], batch_shape)
    d_consts = tuple(_psum(g, _every(ring)).astype(c.dtype) for g, c in zip(d_tables.hook_consts, consts))
    tables = _table_grads(ring, (d_tables.key_table, d_tables.value_table), (key_table, value_table))
    return dq, dk, dv, *tables, d_consts


def _every(ring):
    return (ring.batch, ring.seq, ring.head)


def _table_grads(ring, grads, tables):
    """The tables' gradients summed over every device that holds them (a per-head table is split with the
    heads: summed over the batch and the ring)."""

    def shared(grad, table):
        if grad is None:
            return None
        axes = _every(ring) if table.ndim == 2 else (ring.batch, ring.seq)
        return _psum(grad, axes).astype(table.dtype)

    return tuple(shared(g, t) for g, t in zip(grads, tables))


# ---------------------------------------------------------------------------------------------------
# The ring on a kernel (ring.step): each step is one attention call per key chunk held, this device's queries
# against the chunk at their global positions, (out, lse) merged by the online softmax. The shares travel
# whole (the kernel reads a chunk at once): a device holds its share and the one arriving, 2 S / D keys.
# Backward: the same ring; step.gradients gives each step's pairs' share of the whole softmax's gradient from
# the ring's output and lse (the kernel's backward at those residuals, jaxattn._dispatch.ring).


def _in_slots(ring, x):
    """Local natural queries (or outputs, cotangents) [*b, C*Cq, N, F] -> the chunks this device holds side by
    side in slot order (zigzag: the reorder's ppermutes), unpadded."""
    return jnp.concatenate(_arrive(ring, x), axis=ring.nb) if ring.C > 1 else x


def _out_of_slots(ring, x):
    return _depart(ring, jnp.split(x, ring.C, axis=ring.nb))


def _slot_positions(ring, d):
    """Global positions [C*Cq] of device d's query slots (query t at t + S - T)."""
    local = jnp.arange(ring.Cq, dtype=jnp.int32)
    return jnp.concatenate([(c * ring.Cq + local + ring.S - ring.T).astype(jnp.int32) for c in _chunk_ids(ring, d)])


def _chunk_keys(ring, src, c, lengths):
    """Global positions [Ck] of slot c's key chunk of device src's share, and its valid keys [*b] (or None)."""
    chunk = _chunk_ids(ring, src)[c]
    k_pos = (chunk * ring.Ck + jnp.arange(ring.Ck, dtype=jnp.int32)).astype(jnp.int32)
    return k_pos, None if lengths is None else jnp.clip(lengths - chunk * ring.Ck, 0, ring.Ck).astype(jnp.int32)


def _step_loop(ring, d, visit, carry, held):
    """carry, held = visit(carry, held, src) for the D shares in ring order, `held` (a pytree of the share's
    chunks) passed d -> d + 1 between steps; returns (carry, held) after the last visit (no pass after it)."""

    def step(state, s):
        carry, held = visit(*state, (d - s) % ring.D)
        return (carry, _shift(ring, held)), None

    (carry, held), _ = lax.scan(step, (carry, held), jnp.arange(ring.D - 1, dtype=jnp.int32))
    return visit(carry, held, (d + 1) % ring.D)


def _step_lse(lse):
    """A step's lse [...,N,T] -> [...,T,N], the rows' layout here."""
    return jnp.swapaxes(lse, -1, -2)


def _query_slots(ring, x, axis):
    """x split into its C query slots along `axis` (ring.step.per_pair: one kernel call per pair of chunks), or
    whole."""
    return jnp.split(x, ring.C, axis=axis) if ring.step.per_pair else [x]


def _attend_chunk(ring, qs, q_pos, k, v, k_pos, length, tables, consts):
    """(out [*b,C*Cq,N,Hv], lse [*b,N,C*Cq]) of the device's queries against one key chunk: one step call, or one
    per query slot (ring.step.per_pair)."""
    parts = [
        ring.step(q, k, v, qp, k_pos, length, *tables, consts)
        for q, qp in zip(_query_slots(ring, qs, ring.nb), _query_slots(ring, q_pos, 0))
    ]
    return jnp.concatenate([o for o, _ in parts], axis=ring.nb), jnp.concatenate([x for _, x in parts], axis=-1)


def _chunk_gradients(ring, qs, q_pos, k, v, k_pos, length, tables, consts, out, lse, d_out):
    """ring.step.gradients of the device's queries against one key chunk (per query slot where per_pair):
    (dq [*b,C*Cq,N,H], dk, dv, d tables, d consts), dk / dv / the tables' and consts' summed over the slots."""
    rows = lambda x: _query_slots(ring, x, ring.nb)  # noqa: E731
    parts = [
        ring.step.gradients(q, k, v, qp, k_pos, length, *tables, consts, o, x, do)
        for q, qp, o, x, do in zip(
            rows(qs), _query_slots(ring, q_pos, 0), rows(out), _query_slots(ring, lse, -1), rows(d_out)
        )
    ]
    total = lambda xs: functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), xs)  # noqa: E731
    dq = jnp.concatenate([p[0] for p in parts], axis=ring.nb)
    return (dq, *(total([p[i] for p in parts]) for i in range(1, 5)))


def _step_fwd_body(ring, q, k, v, key_table, value_table, consts, lengths):
    acc_dtype = accumulation_dtype(q.dtype)
    d = _ring_index(ring)
    qs, q_pos = _in_slots(ring, q), _slot_positions(ring, d)
    rows = qs.shape[:-1]  # [*b, C*Cq, N]
    tables = (key_table, value_table)

    def visit(partial, held, src):
        for c in range(ring.C):
            k_pos, length = _chunk_keys(ring, src, c, lengths)
            out, lse = _attend_chunk(ring, qs, q_pos, held[0][c], held[1][c], k_pos, length, tables, consts)
            lse = _step_lse(lse).astype(acc_dtype)  # -inf for a row with no key in the chunk: l = 0
            partial = combine_partials(partial, ((out.astype(acc_dtype),), lse, has_keys(lse).astype(acc_dtype)))
        return partial, held

    partial = empty_partial((rows + v.shape[-1:],), rows, acc_dtype, qs)
    partial, _ = _step_loop(ring, d, visit, partial, (_arrive(ring, k), _arrive(ring, v)))
    (out,), lse = finalize_partial(partial)
    return _out_of_slots(ring, out.astype(q.dtype)), lse  # lse [*b, C*Cq, N], slot order


def _step_bwd_body(ring, q, k, v, key_table, value_table, consts, lengths, out, lse, d_out):
    acc_dtype = accumulation_dtype(q.dtype)
    d = _ring_index(ring)
    qs, q_pos = _in_slots(ring, q), _slot_positions(ring, d)
    out, d_out = _in_slots(ring, out), _in_slots(ring, d_out)
    lse = _step_lse(public_lse(lse))  # [*b, N, C*Cq], -inf for a row with no key: the step's residual
    tables = (key_table, value_table)
    zeros = lambda xs: jax.tree.map(lambda x: jnp.zeros(x.shape, acc_dtype), xs)  # noqa: E731
    ks, vs = _arrive(ring, k), _arrive(ring, v)
    held = {"k": ks, "v": vs, "dk": zeros(ks), "dv": zeros(vs)}  # dk / dv travel with their chunk
    carry = (jnp.zeros(qs.shape, acc_dtype), zeros(tables), zeros(consts))

    def visit(carry, held, src):
        dq, d_tables, d_consts = carry
        dk, dv = list(held["dk"]), list(held["dv"])
        for c in range(ring.C):
            k_pos, length = _chunk_keys(ring, src, c, lengths)
            chunk = (qs, q_pos, held["k"][c], held["v"][c], k_pos, length, tables, consts)
            dq_c, dk_c, dv_c, d_tables_c, d_consts_c = _chunk_gradients(ring, *chunk, out, lse, d_out)
            dq = dq + dq_c.astype(acc_dtype)
            dk[c], dv[c] = dk[c] + dk_c.astype(acc_dtype), dv[c] + dv_c.astype(acc_dtype)
            d_tables = jax.tree.map(lambda a, b: a + b.astype(acc_dtype), d_tables, d_tables_c)
            d_consts = jax.tree.map(lambda a, b: a + b.astype(acc_dtype), d_consts, d_consts_c)
        return (dq, d_tables, d_consts), {**held, "dk": tuple(dk), "dv": tuple(dv)}

    (dq, d_tables, d_consts), held = _step_loop(ring, d, visit, carry, held)
    dk, dv = _shift(ring, (held["dk"], held["dv"]))  # the last hop brings them to the device owning their keys
    dq = _out_of_slots(ring, dq.astype(q.dtype))
    dk, dv = (_depart(ring, [g.astype(x.dtype) for g in grads]) for grads, x in ((dk, k), (dv, v)))
    d_consts = tuple(_psum(g, _every(ring)).astype(c.dtype) for g, c in zip(d_consts, consts))
    return dq, dk, dv, *_table_grads(ring, d_tables, tables), d_consts


# ---------------------------------------------------------------------------------------------------
# The custom VJP around the two shard_maps (inputs and outputs: global arrays sharded on the mesh).


def _in_specs(ring, key_table, value_table, consts):
    x = _spec(ring, "TNH")
    return (
        x,
        x,
        x,
        _table_spec(ring, key_table),
        _table_spec(ring, value_table),
        tuple(PartitionSpec() for _ in consts),
        PartitionSpec(),
        _spec(ring, "B"),
    )


def _shard_map(ring, body, in_specs, out_specs):
    return jax.shard_map(
        functools.partial(body, ring), mesh=ring.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_core(ring, q, k, v, key_table, value_table, consts, scale, lengths):
    return _ring_fwd(ring, q, k, v, key_table, value_table, consts, scale, lengths)[0]


def _ring_fwd(ring, q, k, v, key_table, value_table, consts, scale, lengths):
    specs = _in_specs(ring, key_table, value_table, consts)
    fwd = _shard_map(ring, _fwd_body, specs, (_spec(ring, "TNH"), _lse_spec(ring)))
    out, lse = fwd(q, k, v, key_table, value_table, consts, scale, lengths)
    return out, (q, k, v, key_table, value_table, consts, scale, lengths, out, lse)


def _ring_bwd(ring, residuals, d_out):
    q, k, v, key_table, value_table, consts, scale, lengths, out, lse = residuals
    specs = _in_specs(ring, key_table, value_table, consts)
    x = _spec(ring, "TNH")
    grad_specs = specs[:6]
    bwd = _shard_map(ring, _bwd_body, specs + (x, _lse_spec(ring), x), grad_specs)
    grads = bwd(q, k, v, key_table, value_table, consts, scale, lengths, out, lse, d_out)
    return (*grads, None, None)


_ring_core.defvjp(_ring_fwd, _ring_bwd)


# ---------------------------------------------------------------------------------------------------
# Public entry point.


def _engine_config(**fields):
    """The blockwise engine's per-pair config, by field name (each chunk's positions are contiguous:
    consecutive integers from the chunk's global offset, padding masked as blockwise_attention does)."""
    fields.setdefault("terms", blockwise.Terms())  # segments, softcap, sinks, score/mask functions: not here
    missing = set(blockwise.Config._fields) - set(fields)
    if missing:  # the engine grew an option this module does not know how to set
        raise NotImplementedError(f"ring attention: blockwise engine config fields {sorted(missing)} not set")
    return blockwise.Config(**{name: fields[name] for name in blockwise.Config._fields})


def pieces_per_chunk(key_tiles, C, target=PIECES_PER_SHARE):
    """How many pieces each of the C chunks travels in: the most, up to target / C, that divide its
    key tiles evenly (a piece is whole key tiles)."""
    return max(m for m in range(1, max(1, target // C) + 1) if key_tiles % m == 0)


def _axis_size(mesh, axis):
    return 1 if axis is None else mesh.shape[axis]


def _check_divides(name, size, parts, what):
    if size % parts:
        checks.fail(name, f"{what} divisible by {parts}", size)


def ring_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    *,
    mesh,
    sequence_axis=None,
    batch_axis=None,
    head_axis=None,
    is_causal=False,
    key_value_seq_lengths: Int[ArrayLike, "*#B"] | None = None,
    key_table: Float[ArrayLike, "R H"] | Float[ArrayLike, "R N H"] | None = None,
    value_table: Float[ArrayLike, "R Hv"] | Float[ArrayLike, "R N Hv"] | None = None,
    max_distance=None,
    position_bias=None,
    scale=None,
    load_balance=True,
    block_size=None,
    precision=None,
    step=None,
    step_consts=(),
) -> Attended:
    """The ring behind jaxattn.ring_attention (jaxattn._dispatch.ring: the arguments, documented there), every
    step on the blockwise engine's tiles, or on a kernel: step, one attention call per key chunk held (or per
    pair of chunks: step.per_pair; a _Ring field, built from implementation= by the dispatch), step_consts the
    arrays it closes over (replicated, differentiated: a position bias's table or slopes)."""
    checks.check_mesh(mesh, sequence_axis=sequence_axis, batch_axis=batch_axis, head_axis=head_axis)
    if step is not None and position_bias is not None:
        checks.fail("position_bias", "None on a kernel's ring (a Python hook runs in the blockwise engine)", "a hook")
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    dims = checks.check_qkv(query, key, value)
    batch, T, S, N, K, H, Hv = dims
    C, Db, Dh = _check_split(mesh, dims, sequence_axis, batch_axis, head_axis, is_causal and load_balance)
    lengths = check_lengths(key_value_seq_lengths, batch)
    acc_dtype = accumulation_dtype(query.dtype)
    key_table, value_table, _ = blockwise.check_tables(key_table, value_table, max_distance, N, H, Hv, acc_dtype)
    if T == 0 or S == 0:  # no query, or no key: zeros, as dot_product_attention gives
        return jnp.zeros((*batch, T, N, Hv), value.dtype)
    if key_table is None and value_table is None:
        max_distance = None
    if lengths is not None:
        lengths = jnp.broadcast_to(lengths, batch).astype(jnp.int32)

    D = _axis_size(mesh, sequence_axis)
    Cq, Ck = T // (C * D), S // (C * D)
    B, Nl = int(np.prod(batch, dtype=np.int64)) // Db, N // Dh
    # a kernel's tiles are its own: a step ring's chunks stay unpadded (one piece each)
    Tb, Sb = (Cq, Ck) if step is not None else tiles.ring_tile_sizes(block_size, Cq, Ck, B * Nl, C * Cq * H)
    Cqp, Ckp = -(-Cq // Tb) * Tb, -(-Ck // Sb) * Sb

    bias_fn, consts = None, tuple(step_consts)  # a kernel step's arrays (its position bias's), differentiated
    if position_bias is not None:
        dummy_q, dummy_k = jnp.arange(Tb, dtype=jnp.int32), jnp.arange(Sb, dtype=jnp.int32)
        bias_fn, consts = blockwise.convert_hook(position_bias, dummy_q, dummy_k, 1, N, Tb, Sb, acc_dtype)

    engine = _engine_config(
        Tb=Tb,
        Sb=Sb,
        N=Nl,
        rule=MaskRule(is_causal=bool(is_causal)),
        max_distance=max_distance,
        contiguous=True,
        precision=precision,
        bias_fn=bias_fn,
    )
    m = pieces_per_chunk(Ckp // Sb, C) if D > 1 and step is None else 1
    ring = _Ring(
        mesh,
        sequence_axis,
        batch_axis,
        head_axis,
        D,
        C,
        len(batch),
        T,
        S,
        Cq,
        Ck,
        Cqp,
        Ckp,
        N,
        Nl,
        m,
        Ckp // m,
        lengths is not None or Ckp != Ck,
        engine,
        step,
    )
    scale = jnp.asarray(H**-0.5 if scale is None else scale, acc_dtype)

    query, key, value = (jnp.broadcast_to(x, (*batch, *x.shape[-3:])) for x in (query, key, value))
    return _ring_core(ring, query, key, value, key_table, value_table, consts, scale, lengths)


def _check_split(mesh, dims, sequence_axis, batch_axis, head_axis, balance):
    """Check the split over the mesh; return (C chunks per device: 2 zigzag / 1, batch and head axis sizes)."""
    D, Db, Dh = (_axis_size(mesh, a) for a in (sequence_axis, batch_axis, head_axis))
    if batch_axis is not None and not dims.batch:
        checks.fail("batch_axis", "None for inputs without batch dims", repr(batch_axis))
    if dims.batch:
        _check_divides("query/key/value", dims.batch[0], Db, f"first batch dim (batch_axis {batch_axis!r})")
    _check_divides("key", dims.K, Dh, f"heads K (head_axis {head_axis!r})")
    C = 2 if balance and D > 1 else 1
    for name, L, letter in (("query", dims.T, "T"), ("key", dims.S, "S")):
        _check_divides(
            name,
            L,
            C * D,
            f"length {letter} (sequence_axis {sequence_axis!r}" + (", zigzag causal layout" if C == 2 else "") + ")",
        )
    return C, Db, Dh
