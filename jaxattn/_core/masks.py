"""Which (query, key) pairs may attend: the one position/length rule, for the dense grid and for tiles.

    allowed_pairs(rule, query_pos, key_pos, key_index, lengths) -> bool [...,T,S]

is the single place that decides whether a query at absolute position i may see a key at position j
(causal: j - i <= 0) that is key number key_index of its example (padding: key_index >= lengths). The
dense engine evaluates it on the whole [T,S] grid (`allowed_keys`, which also folds in a user mask), the
blockwise and ring engines on one [Tb,Sb] tile at a time, and `key_block_range` says, from the same rule,
which key tiles of a query tile can hold an allowed pair at all (the others are skipped). A new rule is
one term in each of these two functions and then holds for every engine: a static one (a sliding window
(left, right), a chunk size) is a field of MaskRule, which every engine config carries; a per-example
array (like lengths; segment ids) is an argument, sliced to the tile by the engine as lengths are.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from . import checks
from .positions import offsets, positions


class MaskRule(NamedTuple):
    """The static (hashable) part of the position/length mask."""

    is_causal: bool = False


def check_lengths(key_value_seq_lengths, batch):
    """key_value_seq_lengths as an int array broadcastable to the batch dims (or None)."""
    if key_value_seq_lengths is None:
        return None
    lengths = jnp.asarray(key_value_seq_lengths)
    checks.check_int("key_value_seq_lengths", lengths)
    checks.check_broadcastable("key_value_seq_lengths", lengths, tuple(batch), "[...] (batch dims)")
    return lengths


def allowed_pairs(rule: MaskRule, query_pos, key_pos, key_index, lengths=None):
    """bool [...,T,S] (broadcastable), or None when every pair is allowed.

    query_pos [...,T], key_pos [...,S]: absolute positions; key_index [S]: each key's index among its
    example's keys (a tile's keys count from the tile's start); lengths [...]: valid keys per example.
    """
    allowed = None
    if rule.is_causal:
        allowed = offsets(query_pos, key_pos) <= 0
    if lengths is not None:
        valid = (key_index < lengths[..., None])[..., None, :]
        allowed = valid if allowed is None else allowed & valid
    return allowed


def key_block_range(rule: MaskRule, query_pos, key_pos, lengths, block: int, n_blocks: int):
    """[lo, hi): the key blocks (of `block` keys; key_pos [...,n_blocks * block]) that may hold a key some
    query at query_pos may see under `rule` and lengths [B|1] (counted from key 0). Static (0, n_blocks)
    when the rule and lengths allow every pair."""
    if not rule.is_causal and lengths is None:
        return 0, n_blocks
    needed = jnp.ones((n_blocks,), bool)
    if rule.is_causal:
        k_min = key_pos.reshape(*key_pos.shape[:-1], n_blocks, block).min(axis=-1)
        k_min = k_min.reshape(-1, n_blocks).min(axis=0)
        needed &= k_min <= query_pos.max()
    if lengths is not None:
        needed &= jnp.arange(n_blocks) * block < lengths.max()
    any_needed = needed.any()
    lo = jnp.where(any_needed, jnp.argmax(needed), 0)
    hi = jnp.where(any_needed, n_blocks - jnp.argmax(needed[::-1]), 0)
    return lo, hi


def allowed_keys(logits_shape, *, mask=None, is_causal=False, key_value_seq_lengths=None,
                 query_positions=None, key_positions=None):
    """The dense engine's bool 'may attend' array (broadcastable to logits_shape [...,N,T,S]), or None."""
    *batch, N, T, S = logits_shape
    allowed = None
    if mask is not None:
        allowed = jnp.asarray(mask)
        checks.check_bool("mask", allowed)
        checks.check_broadcastable("mask", allowed, logits_shape, "[...,N,T,S]")
    lengths = check_lengths(key_value_seq_lengths, batch)
    rule = MaskRule(is_causal=bool(is_causal))
    if rule.is_causal or lengths is not None:
        q_pos, k_pos = positions(T, S, query_positions, key_positions)
        pairs = allowed_pairs(rule, q_pos, k_pos, jnp.arange(S), lengths)[..., None, :, :]  # head axis
        allowed = pairs if allowed is None else allowed & pairs
    if allowed is not None and allowed.ndim > len(logits_shape):
        checks.fail("query_positions/key_positions", f"batch dims that fit [...,T]/[...,S] of {logits_shape}",
                    f"a mask of shape {checks.shape_str(allowed.shape)}")
    return allowed
