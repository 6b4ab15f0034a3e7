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
    q_min, q_max = query_pos.min(), query_pos.max()
    needed, full = jnp.ones((n_blocks,), bool), jnp.ones((n_blocks,), bool)
    left, right = rule.window or (None, None)
    if rule.is_causal:
        needed, full = needed & (k_min <= q_max), full & (k_max <= q_min)
    if left is not None:
        needed, full = needed & (k_max >= q_min - left), full & (k_min >= q_max - left)
    if right is not None:
        needed, full = needed & (k_min <= q_max + right), full & (k_max <= q_min + right)
    if rule.chunk_size is not None:
        C = rule.chunk_size
        needed &= (k_min // C <= q_max // C) & (k_max // C >= q_min // C)
        full &= (q_min // C == q_max // C) & (k_min // C == q_min // C) & (k_max // C == q_min // C)
    if lengths is not None:
        start = jnp.arange(n_blocks) * block
        needed, full = needed & (start < lengths.max()), full & (start + block <= lengths.min())
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
