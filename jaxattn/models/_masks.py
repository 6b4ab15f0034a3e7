"""The models' attention masks and positions, from HF's arguments (attention_mask [B,S], 1 = token;
position_ids [B,T]) and the decode cache's slots:

    key_mask             attention_mask -> the attention layers' mask [B,1,1,S] (keys only)
    positions            position_ids or their default (arange, shifted by the cache when decoding)
    positions_and_slots  and the cache slots the tokens sit in
    sliding_mask         HF's sliding window over cache slots when decoding (padding slots counted)
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


def key_mask(attention_mask):
    """[...,S] (1 = token) -> the attention layers' mask [...,1,1,S] (True = may attend), or None."""
    if attention_mask is None:
        return None
    return jnp.asarray(attention_mask).astype(bool)[..., None, None, :]


def positions(module: nn.Module, shape: tuple[int, int], position_ids, decode: bool):
    """position_ids, or their default: arange(T), shifted by the tokens already in the cache when decoding."""
    return positions_and_slots(module, shape, position_ids, decode)[0]


def positions_and_slots(module: nn.Module, shape: tuple[int, int], position_ids, decode: bool):
    """(position_ids [B,T], slots [B,T]): the rotary/learned positions, and the cache slots the tokens sit in.

    Decoding keeps its own count in the "cache" collection ("next_position" [B]): the slots filled so far,
    so that a model called token by token without position_ids numbers its tokens as one full pass would.
    Slots (arange(T) without the cache) are what Hugging Face's sliding windows count, padding included.
    """
    B, T = shape
    if not decode:
        slots = jnp.broadcast_to(jnp.arange(T), (B, T))
        return (slots if position_ids is None else jnp.asarray(position_ids)), slots
    filled = module.variable("cache", "next_position", lambda: jnp.zeros((B,), jnp.int32))
    slots = filled.value[:, None] + jnp.arange(T, dtype=jnp.int32)
    if module.has_variable("cache", "next_position") and not module.is_initializing():
        filled.value = filled.value + T
    return (slots if position_ids is None else jnp.asarray(position_ids)), slots


def sliding_mask(attention_mask, slots, window: int, decode: bool):
    """The attention layers' mask for a sliding layer when decoding: key slot s is visible to the query in
    slot q iff q - window < s <= q (HF's sliding_window_overlay, on cache slots, padding slots counted) and
    s holds a token. Without the cache the layer's own `window` keyword does this (see layer_window).

    Decoding uses the full cache and this mask, not the layer's O(window) rolling cache: HF's window counts
    padding slots (left or right) as positions, which a rolling cache that skips padding cannot reproduce.
    """
    if not decode:
        return key_mask(attention_mask)
    if attention_mask is None:
        raise ValueError(
            "attention_mask: expected [B,L] covering the cache's L slots when decoding a model "
            "with sliding windows, got None"
        )
    key_slots = jnp.arange(jnp.shape(attention_mask)[-1], dtype=jnp.int32)
    band = (key_slots <= slots[..., None]) & (key_slots > slots[..., None] - window)  # [B,T,L]
    return band[:, None] & key_mask(attention_mask)
