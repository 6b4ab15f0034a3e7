"""Which (query, key) pairs may attend: the one position/length rule, for the dense grid and for tiles.

    allowed_pairs(rule, query_pos, key_pos, key_index, lengths, query_segments, key_segments) -> bool [...,T,S]

is the single place that decides whether a query at absolute position i may see a key at position j
(causal: j - i <= 0; window (left, right): -left <= j - i <= right; chunks of C: i // C == j // C) that is
key number key_index of its example (padding: key_index >= lengths) with the same segment id. The dense
engine evaluates it on the whole [T,S] grid (`allowed_keys`, which also folds in a user mask), the
blockwise and ring engines on one [Tb,Sb] tile at a time, and `key_block_schedule` says, from the same
rule (and a BlockMask), which key tiles of a query tile can hold an allowed pair at all (the others are
skipped) and which hold only allowed pairs (they run without a mask).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax.numpy as jnp

from . import checks
from .block_mask import EMPTY, PARTIAL
from .positions import offsets, positions


class MaskRule(NamedTuple):
    """The static (hashable) part of the position/length mask.

    is_causal: key s allowed iff s <= t.  window (left, right), either None: t - left <= s <= t + right.
    chunk_size C: t // C == s // C.  (t, s: absolute positions.)  Segment ids and lengths are arrays."""

    is_causal: bool = False
    window: Optional[tuple] = None
    chunk_size: Optional[int] = None


def check_lengths(key_value_seq_lengths, batch):
    """key_value_seq_lengths as an int array broadcastable to the batch dims (or None)."""
    if key_value_seq_lengths is None:
        return None
    lengths = jnp.asarray(key_value_seq_lengths)
    checks.check_int("key_value_seq_lengths", lengths)
    checks.check_broadcastable("key_value_seq_lengths", lengths, tuple(batch), "[...] (batch dims)")
    return lengths


def _both(a, b):
    return b if a is None else a & b


def allowed_pairs(rule: MaskRule, query_pos, key_pos, key_index, lengths=None, query_segments=None, key_segments=None):
    """bool [...,T,S] (broadcastable), or None when every pair is allowed.

    query_pos [...,T], key_pos [...,S]: absolute positions; key_index [S]: each key's index among its
    example's keys (a tile's keys count from the tile's start); lengths [...]: valid keys per example;
    query_segments [...,T] / key_segments [...,S]: segment ids (a query sees only its own segment).
    """
    allowed = None
    if rule.is_causal or rule.window is not None:
        offsets_ = offsets(query_pos, key_pos)
        left, right = rule.window or (None, None)
        if rule.is_causal:
            allowed = offsets_ <= 0
        if left is not None:
            allowed = _both(allowed, offsets_ >= -left)
        if right is not None:
            allowed = _both(allowed, offsets_ <= right)
    if rule.chunk_size is not None:
        C = rule.chunk_size
        allowed = _both(allowed, (query_pos // C)[..., :, None] == (key_pos // C)[..., None, :])
    if lengths is not None:
        allowed = _both(allowed, (key_index < lengths[..., None])[..., None, :])
    if query_segments is not None:
        allowed = _both(allowed, query_segments[..., :, None] == key_segments[..., None, :])
    return allowed


# Kinds of the key tiles a query tile visits (key_block_schedule): mask_mod and the rule apply, only the
# rule applies, or nothing masks (every pair allowed).
WITH_MOD, MASKED, CLEAN = 0, 1, 2
SKIPPED = 3  # a key tile with no allowed pair (key_block_kinds)


class TileSchedule(NamedTuple):
    """A query tile's key tiles: order [n_blocks] (WITH_MOD ones first, then MASKED, then CLEAN) and the
    count of each kind; tiles past their sum hold no allowed pair and are skipped."""

    order: Any
    counts: tuple


def key_block_schedule(
    rule: MaskRule,
    query_pos,
    key_pos,
    lengths,
    block: int,
    n_blocks: int,
    *,
    query_segments=None,
    key_segments=None,
    block_kinds=None,
    mask_mod=False,
) -> TileSchedule:
    """Which key blocks (of `block` keys; key_pos [...,n_blocks * block]) a query tile (query_pos [...,Tb])
    visits under `rule`, lengths [B|1] (counted from key 0), segment ids (query [B|1,Tb], key
    [B|1,n_blocks * block]) and a BlockMask row block_kinds [n_blocks] (EMPTY / PARTIAL / FULL), and how:
    key_block_kinds's kinds, sorted. Static (every tile CLEAN, in order) when nothing masks.
    """
    if not masks_anything(rule, lengths, query_segments, block_kinds, mask_mod):
        return TileSchedule(jnp.arange(n_blocks, dtype=jnp.int32), (0, 0, n_blocks))
    kind = key_block_kinds(
        rule,
        query_pos,
        key_pos,
        lengths,
        block,
        n_blocks,
        query_segments=query_segments,
        key_segments=key_segments,
        block_kinds=block_kinds,
        mask_mod=mask_mod,
    )
    order = jnp.argsort(kind, stable=True).astype(jnp.int32)
    counts = tuple(jnp.sum(kind == k, dtype=jnp.int32) for k in (WITH_MOD, MASKED, CLEAN))
    return TileSchedule(order, counts if mask_mod else (0,) + counts[1:])  # static 0: no mask_mod loop to compile


def masks_anything(rule: MaskRule, lengths=None, query_segments=None, block_kinds=None, mask_mod=False) -> bool:
    """False when every (query, key) pair is allowed: no rule, lengths, segment ids, BlockMask or mask_mod."""
    return bool(
        rule.is_causal
        or rule.window
        or rule.chunk_size
        or lengths is not None
        or query_segments is not None
        or block_kinds is not None
        or mask_mod
    )


class Bound(NamedTuple):
    """One range test of a (query tile, key tile) pair: key <= query (below) or key >= query, where key is a
    quantity of the key tile (its least or greatest position, its first index, ...) and query one of the query
    tile. With positions that never decrease along the axis, both grow with the tile index, so the key tiles
    that pass it are a prefix (below) or a suffix of the key axis, and the query tiles a suffix or a prefix."""

    key: Any
    query: Any
    below: bool

    def holds(self):
        return self.key <= self.query if self.below else self.key >= self.query


def tile_bounds(rule: MaskRule, q_min, q_max, k_min, k_max, k_start, block: int, lengths=None):
    """(needed, full): the Bounds a key tile must pass to hold an allowed pair (needed) and to hold only allowed
    pairs (full), from allowed_pairs' rule on the tiles' ranges: least / greatest query position q_min / q_max,
    key position k_min / k_max, first key index k_start, `block` keys, lengths [...] (the greatest decides
    needed, the least full). Segment ids and a BlockMask are no ranges of positions: key_block_kinds adds them.
    """
    needed, full = [], []
    left, right = rule.window or (None, None)
    if rule.is_causal:  # k <= q
        needed.append(Bound(k_min, q_max, True))
        full.append(Bound(k_max, q_min, True))
    if left is not None:  # k >= q - left
        needed.append(Bound(k_max, q_min - left, False))
        full.append(Bound(k_min, q_max - left, False))
    if right is not None:  # k <= q + right
        needed.append(Bound(k_min, q_max + right, True))
        full.append(Bound(k_max, q_min + right, True))
    if rule.chunk_size is not None:  # k // C == q // C
        C = rule.chunk_size
        needed += [Bound(k_min // C, q_max // C, True), Bound(k_max // C, q_min // C, False)]
        # every pair in one chunk: q_max // C <= k_min // C <= k_max // C <= q_min // C, so all four are equal
        full += [Bound(k_max // C, q_min // C, True), Bound(k_min // C, q_max // C, False)]
    if lengths is not None:  # key index < length
        needed.append(Bound(k_start, lengths.max() - 1, True))
        full.append(Bound(k_start + block, lengths.min(), True))
    return needed, full


def tile_runs(rule: MaskRule, query_pos, key_pos, length, query_block: int, key_block: int, by_query=False):
    """int32 [Tn,4]: per query tile, the key tiles key_block_kinds would visit as runs, (a0, c0, c1, a1): tiles
    a0 <= j < a1 are needed, c0 <= j < c1 of them full (CLEAN), the rest MASKED; c0 = c1 = a1 when none is
    full. by_query: per key tile, the query tiles that visit it, [Sn,4] (the dk/dv kernel's view).

    query_pos [Tn * query_block] / key_pos [Sn * key_block]: positions that never decrease (the core's default
    positions, edge-padded), so that every Bound passes on a prefix or a suffix of tiles (Bound) and their
    intersection is a run: needed, one run [a0, a1); full, one run inside it (full implies needed, test by
    test), so MASKED is [a0, c0) and [c1, a1). Found by binary search on the tiles' ranges: O(Tn + Sn), never
    the [Tn,Sn] grid of kinds. length: the example's key count (a scalar), or None. No segment ids, BlockMask
    or mask_mod: those need key_block_kinds' grid."""
    q_tiles, k_tiles = query_pos.reshape(-1, query_block), key_pos.reshape(-1, key_block)
    Tn, Sn = q_tiles.shape[0], k_tiles.shape[0]
    k_start = jnp.arange(Sn, dtype=jnp.int32) * key_block
    args = (q_tiles.min(axis=1), q_tiles.max(axis=1), k_tiles.min(axis=1), k_tiles.max(axis=1), k_start, key_block)
    needed, full = tile_bounds(rule, *args, None if length is None else jnp.asarray(length))
    n, m = (Tn, Sn) if by_query else (Sn, Tn)  # n tiles searched for each of m
    # The binary search unrolled (log2(n) steps): no while loop in the program (the kernels' lowering tests).
    # jnp's unrolled scan of one step (n = 1) is still a while loop, so one tile compares instead ([m,1]).
    method = "compare_all" if n == 1 else "scan_unrolled"

    def run(bounds):
        lo, hi = jnp.zeros((m,), jnp.int32), jnp.full((m,), n, jnp.int32)
        for bound in bounds:
            key, query = jnp.broadcast_to(bound.key, (Sn,)), jnp.broadcast_to(bound.query, (Tn,))
            # a prefix of tiles ends at the count that pass; a suffix starts at the count that fail
            if by_query:  # key <= query: a suffix of query tiles; key >= query: a prefix
                end = jnp.searchsorted(query, key, side="right" if not bound.below else "left", method=method)
                prefix = not bound.below
            else:
                end = jnp.searchsorted(key, query, side="right" if bound.below else "left", method=method)
                prefix = bound.below
            if prefix:
                hi = jnp.minimum(hi, end.astype(jnp.int32))
            else:
                lo = jnp.maximum(lo, end.astype(jnp.int32))
        return lo, jnp.maximum(lo, hi)

    a0, a1 = run(needed)
    c0, c1 = run(needed + full)
    empty = c0 == c1
    return jnp.stack([a0, jnp.where(empty, a1, c0), jnp.where(empty, a1, c1), a1], axis=-1)


def key_block_kinds(
    rule: MaskRule,
    query_pos,
    key_pos,
    lengths,
    block: int,
    n_blocks: int,
    *,
    query_segments=None,
    key_segments=None,
    block_kinds=None,
    mask_mod=False,
):
    """int32 [n_blocks]: the kind of each key block for one query tile (arguments as key_block_schedule):
    WITH_MOD, MASKED or CLEAN, or SKIPPED when it holds no allowed pair.

    Every test reads ranges (min / max of positions and ids per tile): exact for contiguous positions and
    sorted segment ids, conservative for any others (a needed tile is never skipped, a tile with a blocked
    pair is never CLEAN). mask_mod: a mask function is in use (WITH_MOD on the BlockMask's partial tiles,
    on every visited tile without a BlockMask).
    """
    k_blocks = key_pos.reshape(-1, n_blocks, block)
    k_min, k_max = k_blocks.min(axis=(0, 2)), k_blocks.max(axis=(0, 2))
    starts = jnp.arange(n_blocks) * block
    needed_bounds, full_bounds = tile_bounds(
        rule, query_pos.min(), query_pos.max(), k_min, k_max, starts, block, lengths
    )
    needed, full = jnp.ones((n_blocks,), bool), jnp.ones((n_blocks,), bool)
    for bound in needed_bounds:
        needed &= bound.holds()
    for bound in full_bounds:
        full &= bound.holds()
    if query_segments is not None:
        ks = key_segments.reshape(-1, n_blocks, block)
        qs_min, qs_max = query_segments.min(axis=-1)[:, None], query_segments.max(axis=-1)[:, None]
        ks_min, ks_max = ks.min(axis=-1), ks.max(axis=-1)
        needed &= jnp.any((ks_min <= qs_max) & (ks_max >= qs_min), axis=0)
        full &= jnp.all((qs_min == qs_max) & (ks_min == ks_max) & (ks_min == qs_min), axis=0)
    with_mod = jnp.full((n_blocks,), bool(mask_mod))
    if block_kinds is not None:
        needed &= block_kinds != EMPTY
        with_mod &= block_kinds == PARTIAL  # the BlockMask's full tiles skip mask_mod
    return jnp.where(needed, jnp.where(with_mod, WITH_MOD, jnp.where(full, CLEAN, MASKED)), SKIPPED).astype(jnp.int32)


def allowed_keys(
    logits_shape,
    *,
    mask=None,
    is_causal=False,
    key_value_seq_lengths=None,
    query_positions=None,
    key_positions=None,
    window=None,
    chunk_size=None,
    query_segments=None,
    key_segments=None,
):
    """The dense engine's bool 'may attend' array (broadcastable to logits_shape [...,N,T,S]), or None."""
    *batch, N, T, S = logits_shape
    allowed = None
    if mask is not None:
        allowed = jnp.asarray(mask)
        checks.check_bool("mask", allowed)
        checks.check_broadcastable("mask", allowed, logits_shape, "[...,N,T,S]")
    lengths = check_lengths(key_value_seq_lengths, batch)
    rule = MaskRule(is_causal=bool(is_causal), window=window, chunk_size=chunk_size)
    if rule != MaskRule() or lengths is not None or query_segments is not None:
        q_pos, k_pos = positions(T, S, query_positions, key_positions)
        pairs = allowed_pairs(rule, q_pos, k_pos, jnp.arange(S), lengths, query_segments, key_segments)[
            ..., None, :, :
        ]  # head axis
        allowed = pairs if allowed is None else allowed & pairs
    if allowed is not None and allowed.ndim > len(logits_shape):
        checks.fail(
            "query_positions/key_positions",
            f"batch dims that fit [...,T]/[...,S] of {logits_shape}",
            f"a mask of shape {checks.shape_str(allowed.shape)}",
        )
    return allowed
