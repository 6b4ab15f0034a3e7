"""Blockwise (memory-efficient) attention: an online softmax over key blocks, O(T + S) memory.

    for each query block i                                        (lax.scan)
        for each key block j that may hold an allowed key         (fori_loop over [lo_i, hi_i))
            x_ij = scale * (q_i k_j^T + q_i . Tk[index_ij] + q_i . A^K_ij) + position_bias(q_pos_i, k_pos_j)
            acc  = combine_partials(acc, block_partial(x_ij, allowed_ij, v_j (+ A^V_ij)))
        out_i = acc.out / acc.l  (+ (bucket sums of p) @ Tv / acc.l for a Shaw value table)

A^K_ij / A^V_ij: the [Tb,Sb,(N),F] tiles of per-pair tables (relative_attention, seed 000's form), read
one tile at a time from the caller's [T,S,(N),F] arrays (an O(T x S) input): the engine adds no
[B,N,T,S] logits and no [B,T,S,F] product to them.

No array ever spans [T,S]: the largest temporary is one [rows,G,Tb,Sb] tile; blockwise_attention runs
groups of rows (batch entries x key/value heads) one after another (lax.map), each small enough that its
tiles stay in cache (not for sharded inputs: see on_a_device_mesh). Causal and key-padding blocks
that hold no allowed key are never visited. A custom VJP (FlashAttention-2's backward) recomputes each
tile's probabilities from the saved log-sum-exp, so the backward pass is O(T + S) as well. The engine
returns that log-sum-exp too (return_lse), with its gradient: d lse / d x = p, one term in delta.
Tile sizes and row groups: jaxattn._engines.tiles.

Layout inside the engine: batch dims flattened to B, heads viewed as [K,G] (query head n = k*G + g), and
q [B,K,G,T,H], k [B,K,S,H], v [B,K,S,Hv] so every tile product is one batched matmul whose rows are the G
query heads sharing a key/value head (grouped-query attention never copies keys or values).

The surface other modules drive (the ring engine, the dispatch, the schemes), all without underscores:
  blockwise_attention: the public entry point (keywords); tiled(call, ...): the same for an AttentionCall
    (what the dispatch in jaxattn._api, the schemes and the kernels' empty-input path call);
  EngineConfig, fwd_tile, bwd_tile, zero_grads: one query tile against a run of keys, forward/backward,
    their arguments named: QueryTile (the tile), KeySide (every key it runs against), Shared (tables,
    hook arrays, scale), RowGrads (the backward's per-row inputs), Grads (the accumulators);
  convert_hook, check_tables, slice_block: the pieces of the entry point;
  position_bias hook: any logit term that is a function of positions only (T5, ALiBi), one tile at a time.
The online-softmax merge (combine_partials, ...) and the mask rule (allowed_pairs, key_block_range) are
_core's (softmax.py, masks.py), shared with the dense engine.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..._core import block_mask as block_masks, checks, mods
from ..._core.call import AttentionCall
from ..._core.dtypes import accumulation_dtype
from ..._core.eager import compiled_when_eager
from ..._core.masks import CLEAN, WITH_MOD, MaskRule, allowed_pairs, check_lengths, key_block_schedule
from ..._core.placement import einsum_sharding, placed_as, zeros_beside
from ..._core.positions import clipped_index, positions
from ..._core.softmax import add_sinks, combine_partials, empty_partial, finalize_partial, has_keys, no_key, public_lse
from .. import tiles

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import ArrayLike, Float, Int

    from ..._core.shapes import Attended, Lse

# ---------------------------------------------------------------------------------------------------
# Static configuration and per-tile pieces.


class Terms(NamedTuple):
    """The static programmable terms (jaxattn._core.mods); their arrays travel in TermArrays."""

    softcap: Optional[float] = None
    score_fn: Optional[Callable] = None  # ElementFunction.fn: score_mod(score, b, n, t, s, *consts)
    mask_fn: Optional[Callable] = None  # ElementFunction.fn: mask_mod(b, n, t, s, *consts)
    segments: bool = False
    block_kinds: bool = False


class TermArrays(NamedTuple):
    """Arrays of the programmable terms in the engine layout: segment ids [B|1,Tp] / [B|1,Sp], sinks
    [B,K,G], the score_mod / mask_mod consts, BlockMask tile kinds [Tn,Sn] int8 (reduced over batch rows
    and heads, which share a tile). The tile functions get one query tile's view (_tile_arrays)."""

    q_seg: Any = None
    k_seg: Any = None
    sinks: Any = None
    score_consts: tuple = ()
    mask_consts: tuple = ()
    kinds: Any = None


class EngineConfig(NamedTuple):
    """Static (hashable) description of one engine run: tiles, heads and which terms are on."""

    Tb: int
    Sb: int
    N: int
    mask: MaskRule  # the position rule (causal, window, chunks): _core.masks decides every pair from it
    max_distance: Optional[int]  # Shaw tables' clip distance (None: no tables)
    contiguous: bool  # default positions: key_pos - query_pos = offset0 + s - t within every tile
    precision: Any
    bias_fn: Optional[Callable]  # closure-converted position_bias(q_pos, k_pos, *consts)
    terms: Terms = Terms()


class KeySide(NamedTuple):
    """Every key a query tile runs against, in the engine layout: k [B,K,Sp,H], v [B,K,Sp,Hv], their
    absolute positions pos [Sp] or [B,Sp], and lengths [B|1] (valid keys from key 0; None: every key)."""

    k: Any
    v: Any
    pos: Any
    lengths: Any = None


class Shared(NamedTuple):
    """What every tile reads besides its keys: Shaw tables key_table / value_table ([R,(N,)F] or None),
    the position hook's arrays hook_consts, scale (None: the queries were scaled before the engine), and
    per-pair tables pair_key / pair_value ([T,S,N|1,F] unpadded, or None; tile (i, j) reads its slice)."""

    key_table: Any = None
    value_table: Any = None
    hook_consts: tuple = ()
    scale: Any = None
    pair_key: Any = None
    pair_value: Any = None


class QueryTile(NamedTuple):
    """One query tile: q [B,K,G,Tb,H], its absolute positions pos [Tb] or [B,Tb], its view of the
    TermArrays (its rows of the segment ids and of the BlockMask's tile kinds), and row0, the index of its
    first query row (where it reads per-pair tables)."""

    q: Any
    pos: Any
    arrays: TermArrays = TermArrays()
    row0: Any = 0


class RowGrads(NamedTuple):
    """What the backward of one query tile reads per row: d_out [B,K,G,Tb,Hv], the forward's lse
    [B,K,G,Tb], delta = rowsum(d_out * out) - d_lse [B,K,G,Tb] (d_lse: the cotangent of lse, zero when only
    the output is used), and the forward's bucket sums of p over every key value_buckets [B,K,G,Tb,R]
    (fwd_tile's with_buckets; None: formed again tile by tile)."""

    d_out: Any
    lse: Any
    delta: Any
    value_buckets: Any = None


class Grads(NamedTuple):
    """Gradient accumulators (compute dtype) that bwd_tile adds into: dk / dv shaped as the KeySide's k / v,
    the tables', the hook arrays', and score_mod's consts' (() without a score_mod)."""

    dk: Any
    dv: Any
    key_table: Any = None
    value_table: Any = None
    hook_consts: tuple = ()
    score_consts: tuple = ()
    pair_key: Any = None
    pair_value: Any = None


def _einsum(spec, a, b, cfg, acc_dtype):
    out_sharding = einsum_sharding(spec, a, b)  # None off an Explicit mesh
    return jnp.einsum(spec, a, b, precision=cfg.precision, preferred_element_type=acc_dtype, out_sharding=out_sharding)


def _heads_view(x, K):
    """[...,N,Tb,Sb] -> [...,K,G,Tb,Sb]."""
    return x.reshape(*x.shape[:-3], K, x.shape[-3] // K, *x.shape[-2:])


def _rows(x):
    """A per-(batch?, t, s) array [Tb,Sb] / [B,Tb,Sb] -> broadcastable to tiles [B,K,G,Tb,Sb]."""
    return x if x.ndim == 2 else x[:, None, None]


def _bucket_index(cfg, qp, kp):
    return clipped_index(qp, kp, cfg.max_distance, cfg.max_distance)


def _gather(per_bucket, index):
    """per_bucket [B,K,G,Tb,R], index [Tb,Sb] or [B,Tb,Sb] -> [B,K,G,Tb,Sb]."""
    index = jnp.broadcast_to(_rows(index), per_bucket.shape[:-1] + index.shape[-1:])
    return jnp.take_along_axis(per_bucket, index, axis=-1, mode="promise_in_bounds")


def _bucket_sum(x, index, R, offset0=None):
    """The transpose of _gather: [B,K,G,Tb,Sb] -> [B,K,G,Tb,R], sums of x[t,s] over s with index r.

    With offset0 (contiguous positions: key_pos - query_pos = offset0 + s - t in this tile) no scatter
    is needed: an interior bucket r holds exactly one key, s = t + r - max_distance - offset0 (a gather
    of [Tb,R] entries), and the two clipped buckets are masked row sums. On CPU, XLA's scatter-add
    costs about as much as the whole tile's attention; this costs a small fraction of it.
    """
    if offset0 is None:
        zeros = zeros_beside(x, x.shape[:-1] + (R,), x.dtype)
        return jax.linear_transpose(lambda pb: _gather(pb, index), zeros)(x)[0]
    return contiguous_bucket_sums(x, R, offset0)


def contiguous_bucket_sums(x, R, offset0):
    """[...,T,S] -> [...,T,R]: Shaw bucket sums when key_pos - query_pos = offset0 + s - t (the default
    positions have offset0 = S - T). Gathers and masked sums only: no scatter (see _bucket_sum)."""
    if R == 1:
        return jnp.sum(x, axis=-1, keepdims=True)
    d = (R - 1) // 2
    Tb, Sb = x.shape[-2:]
    t = jnp.arange(Tb)[:, None]
    offsets = offset0 + jnp.arange(Sb)[None, :] - t
    left = jnp.sum(jnp.where(offsets <= -d, x, 0), axis=-1, keepdims=True)
    right = jnp.sum(jnp.where(offsets >= d, x, 0), axis=-1, keepdims=True)
    cols = t + jnp.arange(1 - d, d)[None, :] - offset0  # [Tb, R-2]: the key of each interior bucket
    inside = (cols >= 0) & (cols < Sb)
    cols = jnp.broadcast_to(jnp.clip(cols, 0, Sb - 1), x.shape[:-1] + (R - 2,))
    interior = jnp.where(inside, jnp.take_along_axis(x, cols, axis=-1, mode="promise_in_bounds"), 0)
    return jnp.concatenate([left, interior, right], axis=-1)


def _element_grid(cfg, fn, consts, qp, kp, B, K, score=None):
    """score_mod / mask_mod over one tile, [B,K,G,Tb,Sb] (score in that layout, or None for mask_mod)."""
    if score is not None:
        score = score.reshape(B, cfg.N, *score.shape[-2:])
    b, n = jnp.arange(B, dtype=jnp.int32), jnp.arange(cfg.N, dtype=jnp.int32)
    return _heads_view(mods.on_grid(fn, consts, b, n, qp, kp, score=score), K)


def _allowed(cfg, qp, kp, j, lengths, arrays, kind, B, K):
    """bool tile broadcastable to [B,K,G,Tb,Sb], or None when every key is allowed (key block j).
    arrays: this query tile's TermArrays; mask_mod is evaluated on WITH_MOD tiles only."""
    k_seg = None if arrays.k_seg is None else slice_block(arrays.k_seg, j * cfg.Sb, cfg.Sb, -1)
    allowed = allowed_pairs(
        cfg.mask, qp, kp, j * cfg.Sb + jnp.arange(cfg.Sb), lengths, None if k_seg is None else arrays.q_seg, k_seg
    )
    allowed = None if allowed is None else _rows(allowed)
    if cfg.terms.mask_fn is not None and kind == WITH_MOD:
        by_mod = _element_grid(cfg, cfg.terms.mask_fn, arrays.mask_consts, qp, kp, B, K)
        allowed = by_mod if allowed is None else allowed & by_mod
    return allowed


def _tile_bias(cfg, consts, qp, kp, K):
    return _heads_view(cfg.bias_fn(qp, kp, *consts), K)


def _capped_logits(cfg, q_blk, k_blk, per_bucket, index, scale, acc_dtype, pair_k=None):
    """softcap(scale * (q . k + q . table[index] + q . A^K)): the query-key part of a tile's logits."""
    x = _einsum("bkgth,bksh->bkgts", q_blk, k_blk, cfg, acc_dtype)
    if per_bucket is not None:
        x = x + _gather(per_bucket, index)
    if pair_k is not None:
        x = x + _einsum(_pair_spec("bkgth,tskgh->bkgts", pair_k), q_blk, pair_k, cfg, acc_dtype)
    if scale is not None:  # None: the query was scaled before the engine
        x = x * scale
    return mods.softcap(x, cfg.terms.softcap)


def _tile_logits(cfg, q_blk, k_blk, per_bucket, bias, index, scale, acc_dtype, score=None, pair_k=None):
    """A tile's logits: the capped query-key logits plus the position bias, then score (score_mod)."""
    x = _capped_logits(cfg, q_blk, k_blk, per_bucket, index, scale, acc_dtype, pair_k)
    x = x if bias is None else x + bias
    return x if score is None else score(x)


def _score(cfg, qp, kp, B, K, arrays):
    """x -> score_mod(x) on one tile (consts overridable, for the backward's vjp), or None."""
    if cfg.terms.score_fn is None:
        return None
    return lambda x, consts=arrays.score_consts: _element_grid(cfg, cfg.terms.score_fn, consts, qp, kp, B, K, x)


def _schedule(cfg, qp, k_pos, lengths, arrays, n_blocks):
    return key_block_schedule(
        cfg.mask,
        qp,
        k_pos,
        lengths,
        cfg.Sb,
        n_blocks,
        query_segments=arrays.q_seg if cfg.terms.segments else None,
        key_segments=arrays.k_seg,
        block_kinds=arrays.kinds if cfg.terms.block_kinds else None,
        mask_mod=cfg.terms.mask_fn is not None,
    )


def _visit(schedule, body, state):
    """body(kind, j, state) over the scheduled key tiles j, one loop per kind (each a static body)."""
    start = 0
    for kind, count in enumerate(schedule.counts):
        if isinstance(count, int) and count == 0:
            continue
        stop = start + count
        state = lax.fori_loop(start, stop, lambda i, st, kind=kind: body(kind, schedule.order[i], st), state)
        start = stop
    return state


def _offset0(cfg, qp, kp):
    """key_pos - query_pos at the tile's corner (t = s = 0) when positions are contiguous, else None."""
    return kp[0] - qp[0] if cfg.contiguous else None


def _block_partial(x, allowed, v_blk, index, offset0, R, value_table, cfg, acc_dtype, pair_v=None):
    """One tile's partial (out, m, l); out also carries the bucket sums of p for a value table."""
    if allowed is not None:
        x = jnp.where(allowed, x, -jnp.inf)
    m = jnp.max(x, axis=-1)
    p = jnp.exp(x - jnp.where(jnp.isfinite(m), m, 0)[..., None])  # masked: exp(-inf) = 0
    out = _einsum("bkgts,bksv->bkgtv", p.astype(v_blk.dtype), v_blk, cfg, acc_dtype)
    if pair_v is not None:
        out = out + _einsum(_pair_spec("bkgts,tskgv->bkgtv", pair_v), p, pair_v, cfg, acc_dtype)
    out = (out,)
    if value_table is not None:
        out = out + (_bucket_sum(p, index, R, offset0),)
    return out, m, jnp.sum(p, axis=-1)


def _per_bucket(q_blk, table, K, cfg, acc_dtype):
    """q . table[r] for every bucket: [B,K,G,Tb,R] (table [R,H] or [R,N,H])."""
    if table.ndim == 2:
        return _einsum("bkgth,rh->bkgtr", q_blk, table.astype(acc_dtype), cfg, acc_dtype)
    table = table.reshape(table.shape[0], K, -1, table.shape[-1]).astype(acc_dtype)
    return _einsum("bkgth,rkgh->bkgtr", q_blk, table, cfg, acc_dtype)


def _apply_table(buckets, table, K, cfg, acc_dtype):
    """[B,K,G,Tb,R] @ table [R,(N,)F] -> [B,K,G,Tb,F]."""
    if table.ndim == 2:
        return _einsum("bkgtr,rf->bkgtf", buckets, table.astype(acc_dtype), cfg, acc_dtype)
    table = table.reshape(table.shape[0], K, -1, table.shape[-1]).astype(acc_dtype)
    return _einsum("bkgtr,rkgf->bkgtf", buckets, table, cfg, acc_dtype)


def _table_grad(buckets, x_blk, table, K, cfg, acc_dtype):
    """d table from bucket sums [B,K,G,Tb,R] and per-row vectors x [B,K,G,Tb,F]: [R,(N,)F]."""
    if table.ndim == 2:
        return _einsum("bkgtr,bkgtf->rf", buckets, x_blk, cfg, acc_dtype)
    grad = _einsum("bkgtr,bkgtf->rkgf", buckets, x_blk, cfg, acc_dtype)
    return grad.reshape(table.shape)


def slice_block(x, start, size, axis):
    """x[start:start+size] along axis (start traced)."""
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _pair_rows(table, t0, s0, Tb, Sb):
    """The rows and columns of tile (t0, s0) in a per-pair table [T,S,...], clipped to T - 1 / S - 1: the
    padding past T or S reads the last real row or column (its queries are dropped, its keys masked, so
    its entries never count and their gradients are zero)."""
    T, S = table.shape[:2]
    return jnp.minimum(t0 + jnp.arange(Tb), T - 1)[:, None], jnp.minimum(s0 + jnp.arange(Sb), S - 1)[None, :]


def _tile_start(t0, s0):
    """A per-pair tile's corner as dynamic_slice's start (one integer type: t0 comes from a scan, s0 from a
    loop, whose integer widths may differ under x64)."""
    return tuple(jnp.asarray(i, jnp.int32) for i in (t0, s0, 0, 0))


def _divides(table, Tb, Sb):
    """Every tile of the per-pair table lies inside it (no padding): a plain slice reads it."""
    return table.shape[0] % Tb == 0 and table.shape[1] % Sb == 0


def pair_tile(table, t0, s0, Tb, Sb, K):
    """Tile (t0, s0) of a per-pair table [T,S,N|1,F] in the compute dtype: [Tb,Sb,K,G,F] per head (query
    head n = k*G + g, the engine layout), [Tb,Sb,F] shared over heads; None stays None."""
    if table is None:
        return None
    if _divides(table, Tb, Sb):
        tile = lax.dynamic_slice(table, _tile_start(t0, s0), (Tb, Sb, *table.shape[2:]))
    else:
        tile = table.at[_pair_rows(table, t0, s0, Tb, Sb)].get(mode="promise_in_bounds")
    heads, F = table.shape[2:]
    tile = tile[:, :, 0] if heads == 1 else tile.reshape(Tb, Sb, K, heads // K, F)
    return tile.astype(accumulation_dtype(table.dtype))


def _pair_spec(spec, tile):
    """An einsum spec written for a per-head tile (tskgf) as it reads for `tile` (tsf when shared)."""
    return spec if tile.ndim == 5 else spec.replace("tskg", "ts")


def _pair_grad(x, y, tile, cfg, acc_dtype):
    """The gradient of a per-pair tile (pair_tile's layout) from per-pair cotangents x [B,K,G,Tb,Sb] and
    per-row vectors y [B,K,G,Tb,F]: sum over the batch (and the heads, for a shared table) of x y."""
    return _einsum(_pair_spec("bkgts,bkgtf->tskgf", tile), x, y, cfg, acc_dtype)


def add_pair_tile(acc, grad, t0, s0):
    """acc [T,S,N|1,F] + grad (pair_tile's layout, tile (t0, s0)) at that tile; the padding's entries of
    grad (clipped onto the last row / column by _pair_rows) are zeros, so adding them changes nothing."""
    Tb, Sb = grad.shape[:2]
    grad = grad.reshape(Tb, Sb, *acc.shape[2:])
    if _divides(acc, Tb, Sb):
        start = _tile_start(t0, s0)
        return lax.dynamic_update_slice(acc, lax.dynamic_slice(acc, start, grad.shape) + grad, start)
    return acc.at[_pair_rows(acc, t0, s0, Tb, Sb)].add(grad, mode="promise_in_bounds")


# ---------------------------------------------------------------------------------------------------
# The engine: forward and custom backward on the engine layout.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _engine(cfg, q, keys, shared, q_pos, arrays):
    """(out [B,K,G,Tp,Hv] in q's dtype, lse [B,K,G,Tp] in the compute dtype) over every query tile."""
    return _engine_fwd(cfg, q, keys, shared, q_pos, arrays)[0]


def fwd_tile(cfg, tile: QueryTile, keys: KeySide, shared: Shared, with_buckets=False):
    """One query tile against every key of keys: (out [B,K,G,Tb,Hv], lse [B,K,G,Tb]), both in the compute
    dtype (a caller merging partials, like the ring, rounds only once at the end).
    with_buckets (value table only): also return the probabilities' bucket sums [B,K,G,Tb,R], which are
    exactly what the value table's gradient needs (RowGrads.value_buckets)."""
    q_blk, qp, arrays, row0 = tile
    B, K, G, Tb, _ = q_blk.shape
    Sp, Hv = keys.k.shape[2], keys.v.shape[-1]
    Sb, acc_dtype = cfg.Sb, accumulation_dtype(q_blk.dtype)
    R = 2 * cfg.max_distance + 1 if cfg.max_distance is not None else 0
    value_table = shared.value_table
    per_bucket = None if shared.key_table is None else _per_bucket(q_blk, shared.key_table, K, cfg, acc_dtype)

    def key_block(kind, j, state):
        k_blk, v_blk = slice_block(keys.k, j * Sb, Sb, 2), slice_block(keys.v, j * Sb, Sb, 2)
        kp = slice_block(keys.pos, j * Sb, Sb, -1)
        index = None if R == 0 else _bucket_index(cfg, qp, kp)
        bias = None if cfg.bias_fn is None else _tile_bias(cfg, shared.hook_consts, qp, kp, K)
        pair_k, pair_v = (pair_tile(a, row0, j * Sb, Tb, Sb, K) for a in (shared.pair_key, shared.pair_value))
        score = _score(cfg, qp, kp, B, K, arrays)
        x = _tile_logits(cfg, q_blk, k_blk, per_bucket, bias, index, shared.scale, acc_dtype, score, pair_k)
        allowed = None if kind == CLEAN else _allowed(cfg, qp, kp, j, keys.lengths, arrays, kind, B, K)
        offset0 = _offset0(cfg, qp, kp)
        partial = _block_partial(x, allowed, v_blk, index, offset0, R, value_table, cfg, acc_dtype, pair_v)
        return combine_partials(state, partial)

    shapes = ((B, K, G, Tb, Hv),) + (((B, K, G, Tb, R),) if value_table is not None else ())
    schedule = _schedule(cfg, qp, keys.pos, keys.lengths, arrays, Sp // Sb)
    state = _visit(schedule, key_block, empty_partial(shapes, (B, K, G, Tb), acc_dtype, q_blk))
    state = add_sinks(state, None if arrays.sinks is None else arrays.sinks[..., None])
    outs, lse = finalize_partial(state)
    out = outs[0] if value_table is None else outs[0] + _apply_table(outs[1], value_table, K, cfg, acc_dtype)
    return (out, lse, outs[1]) if with_buckets else (out, lse)


def bwd_tile(cfg, tile: QueryTile, rows: RowGrads, keys: KeySide, shared: Shared, grads: Grads):
    """Backward of one query tile against every key of keys: (dq tile, grads). grads: accumulators the
    tile adds into, so a caller keeps one of each however many tiles it runs. Without Shaw tables, a position
    hook, per-pair tables or score_mod (whose terms are written for [Tb,Sb] tiles) the tiles run keys-major
    (_bwd_keys_major)."""
    pairs = shared.pair_key is not None or shared.pair_value is not None
    if not pairs and shared.key_table is None and shared.value_table is None and cfg.bias_fn is None:
        if cfg.terms.score_fn is None:
            return _bwd_keys_major(cfg, tile, rows, keys, shared, grads)
    q_blk, qp, arrays, row0 = tile
    do_blk, delta = rows.d_out, rows.delta
    B, K, _, Tb = q_blk.shape[:4]
    Sp, Sb, acc_dtype = keys.k.shape[2], cfg.Sb, accumulation_dtype(q_blk.dtype)
    R = 2 * cfg.max_distance + 1 if cfg.max_distance is not None else 0
    key_table, value_table, scale = shared.key_table, shared.value_table, shared.scale
    lse_blk = jnp.where(has_keys(rows.lse), rows.lse, 0)  # empty rows: every p is masked to 0 anyway
    per_bucket = None if key_table is None else _per_bucket(q_blk, key_table, K, cfg, acc_dtype)
    do_table = None if value_table is None else _per_bucket(do_blk, value_table, K, cfg, acc_dtype)

    def key_block(kind, j, inner):
        dq, dk, dv, ds_buckets, p_buckets, d_consts, d_score, d_pair_k, d_pair_v = inner
        s0 = j * Sb
        k_blk, v_blk = slice_block(keys.k, s0, Sb, 2), slice_block(keys.v, s0, Sb, 2)
        kp = slice_block(keys.pos, s0, Sb, -1)
        index = None if R == 0 else _bucket_index(cfg, qp, kp)
        bias, bias_vjp = None, None
        if cfg.bias_fn is not None:
            bias, bias_vjp = jax.vjp(lambda c: _tile_bias(cfg, c, qp, kp, K), shared.hook_consts)
        pair_k, pair_v = (pair_tile(a, row0, s0, Tb, Sb, K) for a in (shared.pair_key, shared.pair_value))
        capped = _capped_logits(cfg, q_blk, k_blk, per_bucket, index, scale, acc_dtype, pair_k)
        x = capped if bias is None else capped + bias
        score_vjp = None
        if cfg.terms.score_fn is not None:
            x, score_vjp = jax.vjp(_score(cfg, qp, kp, B, K, arrays), x, arrays.score_consts)
        p = jnp.exp(x - lse_blk[..., None])
        allowed = None if kind == CLEAN else _allowed(cfg, qp, kp, j, keys.lengths, arrays, kind, B, K)
        if allowed is not None:
            p = jnp.where(allowed, p, 0)
        dv_blk = _einsum("bkgts,bkgtv->bksv", p.astype(do_blk.dtype), do_blk, cfg, acc_dtype)
        dp = _einsum("bkgtv,bksv->bkgts", do_blk, v_blk, cfg, acc_dtype)
        if pair_v is not None:  # out += p . A^V: dp += d_out . A^V, d A^V = p d_out (summed over the batch)
            dp = dp + _einsum(_pair_spec("bkgtv,tskgv->bkgts", pair_v), do_blk, pair_v, cfg, acc_dtype)
            d_pair_v = add_pair_tile(d_pair_v, _pair_grad(p, do_blk, pair_v, cfg, acc_dtype), row0, s0)
        if value_table is not None:
            dp = dp + _gather(do_table, index)
            if rows.value_buckets is None:  # else p_buckets already holds the forward's sums
                p_buckets = p_buckets + _bucket_sum(p, index, R, _offset0(cfg, qp, kp))
        ds = p * (dp - delta[..., None])  # d loss / d x (the final logits)
        if score_vjp is not None:  # d loss / d (logits before score_mod), and d score_mod's arrays
            ds, d_s = score_vjp(ds)
            d_score = tuple(a if a is None else a + g for a, g in zip(d_score, d_s))
        if bias_vjp is not None:
            d_bias = jnp.sum(ds, axis=tuple(range(ds.ndim - bias.ndim))).reshape(bias.shape).astype(bias.dtype)
            (d_c,) = bias_vjp(placed_as(d_bias, bias))
            d_consts = jax.tree.map(jnp.add, d_consts, d_c)
        if cfg.terms.softcap is not None:
            ds = ds * mods.softcap_grad(capped, cfg.terms.softcap)
        if scale is not None:
            ds = ds * scale
        dq = dq + _einsum("bkgts,bksh->bkgth", ds.astype(q_blk.dtype), k_blk, cfg, acc_dtype)
        dk_blk = _einsum("bkgts,bkgth->bksh", ds.astype(q_blk.dtype), q_blk, cfg, acc_dtype)
        if key_table is not None:
            ds_buckets = ds_buckets + _bucket_sum(ds, index, R, _offset0(cfg, qp, kp))
        if pair_k is not None:  # x += q . A^K: dq += ds . A^K, d A^K = ds q (summed over the batch)
            dq = dq + _einsum(_pair_spec("bkgts,tskgh->bkgth", pair_k), ds, pair_k, cfg, acc_dtype)
            d_pair_k = add_pair_tile(d_pair_k, _pair_grad(ds, q_blk, pair_k, cfg, acc_dtype), row0, s0)
        dk = lax.dynamic_update_slice_in_dim(dk, slice_block(dk, s0, Sb, 2) + dk_blk, s0, axis=2)
        dv = lax.dynamic_update_slice_in_dim(dv, slice_block(dv, s0, Sb, 2) + dv_blk, s0, axis=2)
        return dq, dk, dv, ds_buckets, p_buckets, d_consts, d_score, d_pair_k, d_pair_v

    buckets = zeros_beside(q_blk, q_blk.shape[:-1] + (R,), acc_dtype)
    p_buckets = buckets if rows.value_buckets is None else rows.value_buckets.astype(acc_dtype)
    init = (
        jnp.zeros_like(q_blk, acc_dtype),
        grads.dk,
        grads.dv,
        buckets,
        p_buckets,
        grads.hook_consts,
        grads.score_consts,
        grads.pair_key,
        grads.pair_value,
    )
    schedule = _schedule(cfg, qp, keys.pos, keys.lengths, arrays, Sp // Sb)
    dq, dk, dv, ds_buckets, p_buckets, d_consts, d_score, d_pair_k, d_pair_v = _visit(schedule, key_block, init)
    d_key_table, d_value_table = grads.key_table, grads.value_table
    if key_table is not None:
        dq = dq + _apply_table(ds_buckets, key_table, K, cfg, acc_dtype)
        d_key_table = d_key_table + _table_grad(ds_buckets, q_blk.astype(acc_dtype), key_table, K, cfg, acc_dtype)
    if value_table is not None:
        d_value_table = d_value_table + _table_grad(p_buckets, do_blk.astype(acc_dtype), value_table, K, cfg, acc_dtype)
    return dq, Grads(dk, dv, d_key_table, d_value_table, d_consts, d_score, d_pair_k, d_pair_v)


def _keys_major(allowed):
    """A tile mask broadcastable to [B,K,G,Tb,Sb] -> broadcastable to [B,K,Sb,G,Tb]."""
    return allowed.T[:, None, :] if allowed.ndim == 2 else jnp.moveaxis(allowed, -1, 2)


def _bwd_keys_major(cfg, tile: QueryTile, rows: RowGrads, keys: KeySide, shared: Shared, grads: Grads):
    """bwd_tile's products on keys-major tiles [B,K,Sb,G,Tb] (x^T = k q^T, p^T, ds^T):

        dv += p^T do    dp^T = v do^T    dk += ds^T q    dq^T += k^T ds^T

    each reads its operands in the layout XLA:CPU's dot takes as they are (rows, then the contracted axis),
    where the [Tb,Sb] orientation copies a transposed p and ds for dv and dk, two [Tb,Sb] arrays per tile:
    a 512 x 512 tile's backward takes 1.28 ms against 1.80 ms (2 cores, float32, H = 64)."""
    q_blk, qp, arrays = tile.q, tile.pos, tile.arrays
    B, K = q_blk.shape[:2]
    Sb, acc_dtype, scale, cap = cfg.Sb, accumulation_dtype(q_blk.dtype), shared.scale, cfg.terms.softcap
    lse = jnp.where(has_keys(rows.lse), rows.lse, 0)[:, :, None]  # [B,K,1,G,Tb]; empty rows: p masked to 0
    delta = rows.delta[:, :, None]
    q_t = jnp.moveaxis(q_blk, -1, 2)  # [B,K,H,G,Tb], once per query tile
    do_t = jnp.moveaxis(rows.d_out, -1, 2)  # [B,K,Hv,G,Tb]

    def key_block(kind, j, inner):
        dq_t, dk, dv = inner
        s0 = j * Sb
        k_blk, v_blk = slice_block(keys.k, s0, Sb, 2), slice_block(keys.v, s0, Sb, 2)
        x_t = _einsum("bksh,bkhgt->bksgt", k_blk, q_t, cfg, acc_dtype)
        capped = mods.softcap(x_t if scale is None else x_t * scale, cap)
        p_t = jnp.exp(capped - lse)
        kp = slice_block(keys.pos, s0, Sb, -1)
        allowed = None if kind == CLEAN else _allowed(cfg, qp, kp, j, keys.lengths, arrays, kind, B, K)
        if allowed is not None:
            p_t = jnp.where(_keys_major(allowed), p_t, 0)
        dv_blk = _einsum("bksgt,bkgtv->bksv", p_t.astype(rows.d_out.dtype), rows.d_out, cfg, acc_dtype)
        ds_t = p_t * (_einsum("bksv,bkvgt->bksgt", v_blk, do_t, cfg, acc_dtype) - delta)  # d loss / d logits
        if cap is not None:
            ds_t = ds_t * mods.softcap_grad(capped, cap)
        if scale is not None:
            ds_t = ds_t * scale
        ds_t = ds_t.astype(q_blk.dtype)
        dq_t = dq_t + _einsum("bksh,bksgt->bkhgt", k_blk, ds_t, cfg, acc_dtype)
        dk_blk = _einsum("bksgt,bkgth->bksh", ds_t, q_blk, cfg, acc_dtype)
        dk = lax.dynamic_update_slice_in_dim(dk, slice_block(dk, s0, Sb, 2) + dk_blk, s0, axis=2)
        dv = lax.dynamic_update_slice_in_dim(dv, slice_block(dv, s0, Sb, 2) + dv_blk, s0, axis=2)
        return dq_t, dk, dv

    schedule = _schedule(cfg, qp, keys.pos, keys.lengths, arrays, keys.k.shape[2] // Sb)
    dq_t, dk, dv = _visit(schedule, key_block, (jnp.zeros_like(q_t, acc_dtype), grads.dk, grads.dv))
    return jnp.moveaxis(dq_t, 2, -1), grads._replace(dk=dk, dv=dv)


def zero_grads(acc_dtype, keys: KeySide, shared: Shared, score_consts=()) -> Grads:
    """Zero accumulators (compute dtype acc_dtype) for keys' k / v, the shared tables and hook arrays and a
    score_mod's consts (None entries stay None): what bwd_tile adds into."""

    def zeros(x):
        return jax.tree.map(lambda a: jnp.zeros_like(a, acc_dtype), x)

    return Grads(
        zeros(keys.k),
        zeros(keys.v),
        zeros(shared.key_table),
        zeros(shared.value_table),
        zeros(shared.hook_consts),
        zeros(score_consts),
        zeros(shared.pair_key),
        zeros(shared.pair_value),
    )


def _tile_arrays(arrays, i, Tb):
    """Query tile i's view of the TermArrays: its rows of the query segment ids and of the tile kinds."""
    q_seg = None if arrays.q_seg is None else slice_block(arrays.q_seg, i * Tb, Tb, -1)
    return arrays._replace(q_seg=q_seg, kinds=None if arrays.kinds is None else arrays.kinds[i])


def _keeps_value_buckets(value_table, Hv):
    """The backward reuses the forward's bucket sums of p (value table [R,(N,)Hv]) when they take no more
    memory than the output they come with (R <= Hv); otherwise it forms them again, tile by tile."""
    return value_table is not None and value_table.shape[0] <= Hv


class Residuals(NamedTuple):
    """What the engine's backward reads: its inputs, the output, lse and (kept) value-table bucket sums."""

    q: Any
    keys: KeySide
    shared: Shared
    q_pos: Any
    arrays: TermArrays
    out: Any
    lse: Any
    buckets: Any


def _engine_fwd(cfg, q, keys, shared, q_pos, arrays):
    B, K, G, Tp, H = q.shape
    Tb, Hv = cfg.Tb, keys.v.shape[-1]
    keep = _keeps_value_buckets(shared.value_table, Hv)

    def query_block(_, i):
        q_blk, qp_blk = slice_block(q, i * Tb, Tb, 3), slice_block(q_pos, i * Tb, Tb, -1)
        tile = QueryTile(q_blk, qp_blk, _tile_arrays(arrays, i, Tb), i * Tb)
        out, lse, *buckets = fwd_tile(cfg, tile, keys, shared, with_buckets=keep)
        return None, (out.astype(q.dtype), lse, *buckets)

    _, (out, lse, *buckets) = lax.scan(query_block, None, jnp.arange(Tp // Tb))
    out = jnp.moveaxis(out, 0, 3).reshape(B, K, G, Tp, Hv)
    lse = jnp.moveaxis(lse, 0, 3).reshape(B, K, G, Tp)
    buckets = jnp.moveaxis(buckets[0], 0, 3).reshape(B, K, G, Tp, -1) if keep else None
    return (out, lse), Residuals(q, keys, shared, q_pos, arrays, out, lse, buckets)


def _engine_bwd(cfg, res: Residuals, cotangents):
    d_out, d_lse = cotangents
    q, arrays, Tb = res.q, res.arrays, cfg.Tb
    acc_dtype = accumulation_dtype(q.dtype)
    # score_mod's float arrays get gradients; its integer ones (ids, indices) none
    score_consts = tuple(
        c if d else None for c, d in zip(arrays.score_consts, mods.differentiable(arrays.score_consts))
    )

    def query_block(carry, i):
        grads, d_sinks = carry
        tile = QueryTile(
            slice_block(q, i * Tb, Tb, 3), slice_block(res.q_pos, i * Tb, Tb, -1), _tile_arrays(arrays, i, Tb), i * Tb
        )
        do_blk, o_blk = slice_block(d_out, i * Tb, Tb, 3), slice_block(res.out, i * Tb, Tb, 3)
        lse_blk = slice_block(res.lse, i * Tb, Tb, 3)
        # d loss / d x = p * (dp - sum_s p dp) + p * d_lse, and sum_s p dp = d_out . out: one delta
        d_lse_blk = slice_block(d_lse, i * Tb, Tb, 3).astype(acc_dtype)
        delta = jnp.sum(do_blk.astype(acc_dtype) * o_blk.astype(acc_dtype), axis=-1) - d_lse_blk
        buckets = None if res.buckets is None else slice_block(res.buckets, i * Tb, Tb, 3)
        dq, grads = bwd_tile(cfg, tile, RowGrads(do_blk, lse_blk, delta, buckets), res.keys, res.shared, grads)
        if d_sinks is not None:  # d out_t / d sink = -p_sink[t] out_t, so d sink = -sum_t p_sink[t] delta_t
            d_sinks = d_sinks - jnp.sum(jnp.exp(arrays.sinks[..., None] - lse_blk) * delta, axis=-1)
        return (grads, d_sinks), dq

    grads = zero_grads(acc_dtype, res.keys, res.shared, score_consts)
    d_sinks = None if arrays.sinks is None else jnp.zeros_like(arrays.sinks, acc_dtype)
    (grads, d_sinks), dq = lax.scan(query_block, (grads, d_sinks), jnp.arange(q.shape[3] // Tb))
    dq = jnp.moveaxis(dq, 0, 3).reshape(q.shape)

    def cast(grad, like):
        return None if like is None or grad is None else grad.astype(like.dtype)

    keys, shared = res.keys, res.shared
    d_keys = KeySide(cast(grads.dk, keys.k), cast(grads.dv, keys.v), None, None)
    d_shared = Shared(
        cast(grads.key_table, shared.key_table),
        cast(grads.value_table, shared.value_table),
        jax.tree.map(cast, grads.hook_consts, shared.hook_consts),
        None,
        cast(grads.pair_key, shared.pair_key),
        cast(grads.pair_value, shared.pair_value),
    )
    d_arrays = TermArrays(
        sinks=cast(d_sinks, arrays.sinks),
        score_consts=tuple(map(cast, grads.score_consts, score_consts)) if score_consts else (),
        mask_consts=tuple(None for _ in arrays.mask_consts),
    )
    return dq.astype(q.dtype), d_keys, d_shared, None, d_arrays


_engine.defvjp(_engine_fwd, _engine_bwd)


# ---------------------------------------------------------------------------------------------------
# Row groups: blockwise_attention runs _engine over a few rows (batch entries x key/value heads) at a time.


def on_a_device_mesh(*xs):
    """True when an input is laid out over a multi-device mesh (jit of sharded arguments, or a sharded
    array). Its batch or head axes may then be split over devices in ways the trace cannot see (automatic
    axes carry no spec), and a loop over row groups would make XLA all-gather such an axis."""
    for x in xs:
        mesh = getattr(jax.typeof(x).sharding, "mesh", None)
        if mesh is not None and not mesh.empty and mesh.size > 1:
            return True
    return False


def _grouped_engine(cfg, q, keys, shared, q_pos, arrays, groups):
    """_engine over one row group at a time (lax.map): (out [B,K,G,Tp,Hv], lse [B,K,G,Tp]); groups = (Bc, Kc)
    batch entries and key/value heads per group. A group takes every Cb-th batch entry and every Ck-th
    head (b = i * Cb + cb): the loop runs over the minor factors, so contiguous blocks of B or K stay
    together. Arrays with a batch or head axis are split along it (per-head tables [R,N,F] by key/value
    head); shared ones are closed over, their gradients summed over the groups by autodiff."""
    B, K, G = q.shape[:3]
    Bc, Kc = groups
    Cb, Ck = B // Bc, K // Kc
    if Cb * Ck == 1:
        return _engine(cfg, q, keys, shared, q_pos, arrays)

    def split(x):  # [B,K,...] -> [Cb*Ck, Bc, Kc, ...]
        x = jnp.moveaxis(x.reshape(Bc, Cb, Kc, Ck, *x.shape[2:]), (1, 3), (0, 1))
        return x.reshape(Cb * Ck, Bc, Kc, *x.shape[4:])

    def unsplit(x):  # the inverse: [Cb*Ck, Bc, Kc, ...] -> [B,K,...]
        x = jnp.moveaxis(x.reshape(Cb, Ck, Bc, Kc, *x.shape[3:]), (0, 1), (1, 3))
        return x.reshape(B, K, *x.shape[4:])

    def per_batch(x, batched):  # [B,...] -> [Cb*Ck, Bc, ...]; a shared one stays closed over (None)
        if x is None or not batched:
            return None
        x = jnp.moveaxis(x.reshape(Bc, Cb, *x.shape[1:]), 1, 0)[:, None]
        return jnp.broadcast_to(x, (Cb, Ck, *x.shape[2:])).reshape(Cb * Ck, Bc, *x.shape[3:])

    def per_head(table):  # [R,N,F] -> [Cb*Ck, R, Kc*G, F]; None or a shared [R,F] stays closed over (None)
        if table is None or table.ndim == 2:
            return None
        R, _, F = table.shape
        table = jnp.moveaxis(table.reshape(R, Kc, Ck, G, F), 2, 0).reshape(Ck, R, Kc * G, F)
        return jnp.broadcast_to(table[None], (Cb, Ck, R, Kc * G, F)).reshape(Cb * Ck, R, Kc * G, F)

    def either(part, whole):
        return whole if part is None else part

    group_cfg = cfg._replace(N=Kc * G)

    def group(xs):
        qg, kg, vg, ktg, vtg, qpg, kpg, lg, qsg, ksg, sg = xs
        group_arrays = arrays._replace(q_seg=either(qsg, arrays.q_seg), k_seg=either(ksg, arrays.k_seg), sinks=sg)
        group_keys = KeySide(kg, vg, either(kpg, keys.pos), either(lg, keys.lengths))
        group_shared = shared._replace(
            key_table=either(ktg, shared.key_table), value_table=either(vtg, shared.value_table)
        )
        return _engine(group_cfg, qg, group_keys, group_shared, either(qpg, q_pos), group_arrays)

    def rows_of(x):  # lengths [B|1], segment ids [B|1,L]: per batch entry when the first axis is B > 1
        return per_batch(x, x is not None and B > 1 and x.shape[0] == B)

    xs = (
        split(q),
        split(keys.k),
        split(keys.v),
        per_head(shared.key_table),
        per_head(shared.value_table),
        per_batch(q_pos, q_pos.ndim > 1),
        per_batch(keys.pos, keys.pos.ndim > 1),
        rows_of(keys.lengths),
        rows_of(arrays.q_seg),
        rows_of(arrays.k_seg),
        None if arrays.sinks is None else split(arrays.sinks),
    )
    out, lse = lax.map(group, xs)  # [Cb*Ck, Bc, Kc, G, Tp, (Hv)]
    return unsplit(out), unsplit(lse)


# ---------------------------------------------------------------------------------------------------
# Public entry point: argument checks and the layout changes around the engine.


def _flat_positions(pos, batch, length, padded):
    """[L] stays [L]; batched [...,L] -> [B,L]; then edge-padded to the padded length."""
    if pos.ndim > 1:
        pos = jnp.broadcast_to(pos, (*batch, length)).reshape(-1, length)
    return jnp.pad(pos, [(0, 0)] * (pos.ndim - 1) + [(0, padded - length)], mode="edge")


TABLE_LAYOUT = "[R,(N,)H] with R = 2*max_distance+1"


def check_tables(key_table, value_table, max_distance, N, H, Hv, acc_dtype):
    """Validate optional Shaw tables against max_distance: (key_table, value_table, R or None)."""
    if (key_table is not None or value_table is not None) and max_distance is None:
        checks.fail("max_distance", "a Python int >= 0 with key_table/value_table", None)
    R = None if max_distance is None else 2 * checks.check_max_distance(max_distance) + 1
    if key_table is not None:
        key_table = checks.check_clipped_table("key_table", key_table, R, N, H, acc_dtype, TABLE_LAYOUT)
    if value_table is not None:
        value_table = checks.check_clipped_table("value_table", value_table, R, N, Hv, acc_dtype, TABLE_LAYOUT)
    return key_table, value_table, R


@compiled_when_eager
def blockwise_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    *,
    is_causal=False,
    key_value_seq_lengths: Int[ArrayLike, "*#B"] | None = None,
    query_positions: Int[ArrayLike, "*#B T"] | None = None,
    key_positions: Int[ArrayLike, "*#B S"] | None = None,
    scale=None,
    position_bias=None,
    key_table: Float[ArrayLike, "R H"] | Float[ArrayLike, "R N H"] | None = None,
    value_table: Float[ArrayLike, "R Hv"] | Float[ArrayLike, "R N Hv"] | None = None,
    max_distance=None,
    block_size=None,
    precision=None,
    query_segment_ids: Int[ArrayLike, "*#B T"] | None = None,
    key_segment_ids: Int[ArrayLike, "*#B S"] | None = None,
    window=None,
    chunk_size=None,
    logit_softcap=None,
    sinks: Float[ArrayLike, "*#B N"] | None = None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    return_lse=False,
    **grid_options,
) -> Attended | tuple[Attended, Lse]:
    """Attention computed one [Tb,Sb] tile at a time; O(T + S) memory forward and backward.

    query [...,T,N,H], key [...,S,K,H], value [...,S,K,Hv] and is_causal, key_value_seq_lengths,
    query_positions, key_positions, scale, precision, query_segment_ids, key_segment_ids, window, chunk_size,
    logit_softcap, sinks: as dot_product_attention, with equal results (fully masked rows give zeros, finite
    gradients); score_mod, mask_mod, block_mask: as flex_attention. Half precision accumulates in float32.
    Key tiles that causality, lengths, window, chunks, segment ids or the BlockMask exclude are never visited;
    tiles every rule allows run without a mask, the BlockMask's full tiles without mask_mod.

    key_table / value_table / max_distance: Shaw et al. clipped tables, as shaw_relative_attention
      ([R,H] or [R,N,H], R = 2*max_distance+1); each tile gathers q . table[r] per bucket.
    position_bias(query_pos, key_pos) -> bias: the per-tile position hook, a pure function of the tile's
      absolute positions (int32 [Tb] and [Sb], or [B,Tb] / [B,Sb] for batched positions flattened to B; the
      causal mask's; padding past T or S repeats the last one and is masked), never of T, S or a tile's
      index; bias broadcastable to [(B,)N,Tb,Sb], added to the *scaled* logits. Arrays it closes over (a T5
      table, ALiBi slopes) get gradients through the custom VJP.
    block_size: int or (query_block, key_block); default (jaxattn._engines.tiles, the whole policy): 512 keys
      and 512 / G queries, causal or not, capped by a window's span; rows (batch
      entries x key/value heads) run in groups whose float32 tile fits tiles.ROW_TILE_BYTES, all rows at once
      for inputs on a multi-device mesh (on_a_device_mesh) or with score_mod / mask_mod. A block_mask's
      block_size is the tile.
    return_lse: also return lse [...,N,T], the log of each row's softmax normaliser (allowed keys and the
      sink) in the compute dtype, -inf for a row with no allowed key; gradients flow through it.

    Arbitrary masks and biases (and return_weights, dropout) need the full [T,S] grid: passing them
    raises ValueError (implementation=None falls back to the dense path instead).
    """
    _refuse_grid_options(grid_options)
    call = AttentionCall(
        is_causal=is_causal,
        key_value_seq_lengths=key_value_seq_lengths,
        query_positions=query_positions,
        key_positions=key_positions,
        query_segment_ids=query_segment_ids,
        key_segment_ids=key_segment_ids,
        window=window,
        chunk_size=chunk_size,
        mask_mod=mask_mod,
        block_mask=block_mask,
        scale=scale,
        logit_softcap=logit_softcap,
        sinks=sinks,
        score_mod=score_mod,
        key_table=key_table,
        value_table=value_table,
        max_distance=max_distance,
        position_bias=position_bias,
        return_lse=return_lse,
        precision=precision,
        block_size=block_size,
    )
    return tiled(call, query, key, value)


def tiled(call: AttentionCall, query, key, value):
    """blockwise_attention of `call` (an AttentionCall without the grid options: mask, bias, weights,
    dropout; the dispatch never sends one here, blockwise_attention refuses them by name)."""
    if call.needs_grid:
        _refuse_grid_options({name: getattr(call, name) for name in _GRID_OPTIONS})
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    batch, T, S, N, K, H, Hv = checks.check_qkv(query, key, value)
    acc_dtype, B = accumulation_dtype(query.dtype), int(np.prod(batch, dtype=np.int64))
    block_size, mask_mod, block_mask = call.block_size, call.mask_mod, call.block_mask
    if block_mask is not None:  # the BlockMask's own mask_mod applies (block_masks.resolve)
        block_size, mask_mod, block_mask = _with_block_mask(block_mask, block_size, mask_mod, B, N, T, S)
    grouped = _row_grouped(query, key, value, call.score_mod, mask_mod)
    pair_key, pair_value = checks.check_pair_tables(call.rel_key, call.rel_value, T, S, N, H, Hv, acc_dtype)
    pair_width = sum(a.shape[2] * a.shape[3] for a in (pair_key, pair_value) if a is not None)
    Tb, Sb = _tile_sizes(block_size, T, S, B, N, K, tiles.span(call.window, call.is_causal), grouped)
    if block_size is None and pair_width:
        Tb, Sb = tiles.pair_tile_sizes(T, S, Tb, Sb, pair_width)
    Tp, Sp = -(-T // Tb) * Tb, -(-S // Sb) * Sb
    q_pos, k_pos, lengths = _positions_and_lengths(
        batch, T, S, Tp, Sp, call.query_positions, call.key_positions, call.key_value_seq_lengths
    )
    max_distance = call.max_distance
    key_table, value_table, _ = check_tables(call.key_table, call.value_table, max_distance, N, H, Hv, acc_dtype)
    if T == 0 or S == 0:  # nothing to tile: no query, or no key (every query then gets zeros, as dense)
        return _nothing_to_tile(batch, T, N, Hv, value.dtype, call.sinks, acc_dtype, call.return_lse)
    bias_fn, consts = _hook(call.position_bias, q_pos, k_pos, B, N, Tb, Sb, acc_dtype)
    terms, arrays = _terms(call, mask_mod, block_mask, batch, T, S, N, K, Tp, Sp, acc_dtype)
    cfg = EngineConfig(
        Tb,
        Sb,
        N,
        call.rule,
        None if key_table is None and value_table is None else max_distance,
        call.query_positions is None and call.key_positions is None,
        call.precision,
        bias_fn,
        terms,
    )
    scale = H**-0.5 if call.scale is None else call.scale
    q, k, v = _engine_operands(query, key, value, scale, acc_dtype, batch, Tp, Sp)
    whole = _whole_rows(grouped, bias_fn is not None or pair_width > 0, q_pos, k_pos)
    groups = tiles.row_groups(B, K, N // K, Tb, Sb, whole)
    shared = Shared(key_table, value_table, consts, None, pair_key, pair_value)
    out, lse = _grouped_engine(cfg, q, KeySide(k, v, k_pos, lengths), shared, q_pos, arrays, groups)
    return _from_engine(out, lse, batch, T, query.dtype, call.return_lse)


_GRID_OPTIONS = ("bias", "mask", "dropout_rate", "dropout_rng", "return_weights")


def _refuse_grid_options(grid_options):
    """TypeError for keywords dot_product_attention does not take either; ValueError for those it takes that
    need the full [T,S] grid."""
    unknown = sorted(set(grid_options) - set(_GRID_OPTIONS))
    if unknown:
        raise TypeError(f"blockwise_attention() got unexpected keyword arguments {unknown}")
    in_use = AttentionCall(**grid_options).grid_options
    if in_use:
        checks.fail(
            "implementation",
            f'"dense" or None with {"/".join(in_use)}: blockwise attention does not '
            "take arbitrary masks or biases (nor return_weights or dropout), as they span the full [T,S] "
            "grid",
            '"blockwise"',
        )


def _with_block_mask(block_mask, block_size, mask_mod, B, N, T, S):
    """A BlockMask's checks: (its tile as block_size, the mask_mod that applies, the resolved BlockMask)."""
    block_masks.check_block_mask(block_mask, B, N, T, S)
    block_size = tiles.check_block_mask_tiles(block_mask, block_size)
    mask_mod, block_mask = block_masks.resolve(mask_mod, block_mask)
    return block_size, mask_mod, block_mask


def _hook(position_bias, q_pos, k_pos, B, N, Tb, Sb, acc_dtype):
    """convert_hook's (bias_fn, consts), or (None, ()) without a position_bias."""
    return (None, ()) if position_bias is None else convert_hook(position_bias, q_pos, k_pos, B, N, Tb, Sb, acc_dtype)


def _row_grouped(query, key, value, score_mod, mask_mod):
    """Row groups unless the inputs are sharded (a row loop would all-gather a sharded batch or head axis)
    or score_mod / mask_mod need the global batch and head indices of every row."""
    return score_mod is None and mask_mod is None and not on_a_device_mesh(query, key, value)


def _tile_sizes(block_size, T, S, B, N, K, span, grouped):
    """(Tb, Sb): the row-group tiles, or one tile over all B * N rows (tiles.py's two defaults)."""
    if grouped:
        return tiles.row_tile_sizes(block_size, T, S, N // K, span)
    return tiles.block_sizes(block_size, T, S, B * N, span=span)


def _whole_rows(grouped, hooked, q_pos, k_pos):
    """tiles.row_groups' `whole`: one group of all rows when not grouped or when a hook's bias spans every
    batch entry (batched positions); every head in each group when a hook's bias or a per-pair table
    (hooked) spans every head (a group of heads would need a copy of the table's heads)."""
    if not grouped or (hooked and max(q_pos.ndim, k_pos.ndim) > 1):
        return "all"
    return "heads" if hooked else None


def _engine_operands(query, key, value, scale, acc_dtype, batch, Tp, Sp):
    """q * scale [B,K,G,Tp,H], k [B,K,Sp,H], v [B,K,Sp,Hv] in the accumulation dtype. Half precision: widen
    q, k, v once here (O(T + S) memory) rather than in every tile product, where XLA's CPU dots convert both
    operands again for each tile pair (bf16 S=2048 causal forward: 176 -> 113 ms). Probabilities then meet
    the values in float32 too, one rounding fewer. Scaling [T,H] queries once beats scaling every [Tb,Sb]
    tile (forward and backward)."""
    (T, N, H), (S, K) = query.shape[-3:], key.shape[-3:-1]
    scale = jnp.asarray(scale, acc_dtype)
    if query.dtype != acc_dtype:
        query, key, value = query.astype(acc_dtype), key.astype(acc_dtype), value.astype(acc_dtype)
    q = _engine_layout(query * scale, batch, T, Tp).reshape(int(np.prod(batch, dtype=np.int64)), K, N // K, Tp, H)
    return q, _engine_layout(key, batch, S, Sp), _engine_layout(value, batch, S, Sp)


def _from_engine(out, lse, batch, T, dtype, return_lse):
    """out [B,K,G,Tp,Hv] -> [...,T,N,Hv] in the inputs' dtype; lse [B,K,G,Tp] -> [...,N,T] if asked for."""
    B, K, G, Tp, Hv = out.shape
    out = jnp.moveaxis(out.reshape(B, K * G, Tp, Hv), 1, 2)[:, :T].reshape(*batch, T, K * G, Hv).astype(dtype)
    return (out, public_lse(lse.reshape(*batch, K * G, Tp)[..., :T])) if return_lse else out


def _nothing_to_tile(batch, T, N, Hv, dtype, sinks, acc_dtype, return_lse):
    """T == 0 or S == 0: zeros [...,T,N,Hv] (and lse: _empty_lse)."""
    out = jnp.zeros((*batch, T, N, Hv), dtype)
    return (out, _empty_lse(batch, N, T, sinks, acc_dtype)) if return_lse else out


def _empty_lse(batch, N, T, sinks, acc_dtype):
    """lse [...,N,T] when there is no key: the sink alone, or -inf."""
    if sinks is None:
        return public_lse(jnp.full((*batch, N, T), no_key(acc_dtype), acc_dtype))
    return jnp.broadcast_to(jnp.asarray(sinks, acc_dtype)[..., None], (*batch, N, T))


def _terms(call: AttentionCall, mask_mod, block_mask, batch, T, S, N, K, Tp, Sp, acc_dtype):
    """Check the programmable options against the shapes: (Terms, TermArrays) in the engine layout
    (mask_mod, block_mask: the call's, resolved by _with_block_mask)."""
    B = int(np.prod(batch, dtype=np.int64))
    q_seg, k_seg = mods.check_segment_ids(call.query_segment_ids, call.key_segment_ids, batch, T, S)
    if q_seg is not None:  # [B|1, L padded]: padding repeats the last id (padded keys are masked by length)
        q_seg, k_seg = (_flat_positions(x, batch, L, Lp) for x, L, Lp in ((q_seg, T, Tp), (k_seg, S, Sp)))
        q_seg, k_seg = (x if x.ndim == 2 else x[None] for x in (q_seg, k_seg))
    sinks = mods.check_sinks(call.sinks, batch, N, acc_dtype)
    if sinks is not None:
        sinks = jnp.broadcast_to(sinks, (*batch, N)).reshape(B, K, N // K)
    score_fn = mods.element_function("score_mod", call.score_mod, acc_dtype)
    mask_fn = mods.element_function("mask_mod", mask_mod)
    kinds = None
    if block_mask is not None:  # one kind per tile for every batch row and head (they share the tile)
        each = block_masks.tile_kinds(block_mask)
        kinds = jnp.where(
            jnp.all(each == block_masks.FULL, axis=(0, 1)),
            block_masks.FULL,
            jnp.where(jnp.any(each != block_masks.EMPTY, axis=(0, 1)), block_masks.PARTIAL, block_masks.EMPTY),
        ).astype(jnp.int8)
    terms = Terms(
        softcap=call.logit_softcap,
        score_fn=None if score_fn is None else score_fn.fn,
        mask_fn=None if mask_fn is None else mask_fn.fn,
        segments=q_seg is not None,
        block_kinds=kinds is not None,
    )
    arrays = TermArrays(
        q_seg=q_seg,
        k_seg=k_seg,
        sinks=sinks,
        score_consts=() if score_fn is None else score_fn.consts,
        mask_consts=() if mask_fn is None else mask_fn.consts,
        kinds=kinds,
    )
    return terms, arrays


def _positions_and_lengths(batch, T, S, Tp, Sp, query_positions, key_positions, key_value_seq_lengths):
    """Engine positions ([L] or [B,L], padded to Tp / Sp) and key lengths [B|1] (or None: all valid)."""
    q_pos, k_pos = positions(T, S, query_positions, key_positions)
    checks.check_broadcastable("query_positions", q_pos, (*batch, T), "[...,T]")
    checks.check_broadcastable("key_positions", k_pos, (*batch, S), "[...,S]")
    q_pos, k_pos = _flat_positions(q_pos, batch, T, Tp), _flat_positions(k_pos, batch, S, Sp)
    lengths = check_lengths(key_value_seq_lengths, batch)
    if lengths is not None:
        lengths = jnp.minimum(jnp.broadcast_to(lengths, batch).reshape(-1), S).astype(jnp.int32)
    elif Sp != S:
        lengths = jnp.full((1,), S, jnp.int32)  # the padding keys past S
    return q_pos, k_pos, lengths


def _engine_layout(x, batch, length, padded):
    """[...,L,K,F] -> [B,K,L_padded,F] (batch dims broadcast and flattened, L zero-padded)."""
    B = int(np.prod(batch, dtype=np.int64))
    x = jnp.broadcast_to(x, (*batch, *x.shape[-3:])).reshape(B, *x.shape[-3:])
    x = jnp.pad(x, [(0, 0), (0, padded - length), (0, 0), (0, 0)])
    return jnp.moveaxis(x, 1, -2)


def convert_hook(position_bias, q_pos, k_pos, B, N, Tb, Sb, acc_dtype):
    """Closure-convert the hook (its arrays become differentiable engine inputs); check its shape."""
    qp, kp = q_pos[..., :Tb], k_pos[..., :Sb]
    lead = (B,) if max(q_pos.ndim, k_pos.ndim) > 1 else ()
    target = (*lead, N, Tb, Sb)
    shape = jax.eval_shape(position_bias, qp, kp).shape
    try:
        fits = len(shape) <= len(target) and np.broadcast_shapes(shape, target) == target
    except ValueError:
        fits = False
    if not fits:
        checks.fail(
            "position_bias(query_pos, key_pos)",
            f"a shape broadcastable to {checks.shape_str(target)} ([(B,)N,Tb,Sb] for one tile)",
            f"shape {checks.shape_str(shape)}",
        )

    def tile_bias(qp, kp):
        return jnp.broadcast_to(jnp.asarray(position_bias(qp, kp)).astype(acc_dtype), target)

    bias_fn, consts = jax.closure_convert(tile_bias, qp, kp)
    return bias_fn, tuple(consts)
