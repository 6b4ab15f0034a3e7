"""What the decoder-only families share: masks and positions, with and without the decode cache.

Calling convention of every decoder-only model here (GPT-2, Llama, Mistral, Qwen2, Gemma 2):

    logits = model.apply({"params": p}, input_ids[B,T], attention_mask=None, position_ids=None)
        attention_mask [B,T] (1 = token, 0 = padding; keys only, as HF's); position_ids default arange(T),
        as HF's forward (not generate) takes them.
    logits, vars = model.apply({"params": p, "cache": c}, ids[B,T], attention_mask=m[B,L], position_ids=pos,
                               decode=True, mutable=["cache"])
        appends the T tokens to the cache (L slots, see jaxattn.linen); attention_mask then covers all L
        slots (1 = a real token is or will be there; required by models with sliding windows, which apply
        the window to the slots as a mask); position_ids default: the slots they land in.

Padding is masked as keys only; a padded query position's output is not meaningful (HF's is not either).
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp


def key_mask(attention_mask):
    """[B,S] (1 = token) -> the attention layers' mask [B,1,1,S] (True = may attend), or None."""
    if attention_mask is None:
        return None
    return jnp.asarray(attention_mask).astype(bool)[:, None, None, :]


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
    s holds a token. Without the cache the layer's own `window` keyword does this (see the model).

    Decoding uses the full cache and this mask, not the layer's O(window) rolling cache: HF's window counts
    padding slots (left or right) as positions, which a rolling cache that skips padding cannot reproduce.
    """
    if not decode:
        return key_mask(attention_mask)
    if attention_mask is None:
        raise ValueError("attention_mask: expected [B,L] covering the cache's L slots when decoding a model "
                         "with sliding windows, got None")
    key_slots = jnp.arange(jnp.shape(attention_mask)[-1], dtype=jnp.int32)
    band = (key_slots <= slots[..., None]) & (key_slots > slots[..., None] - window)  # [B,T,L]
    return band[:, None] & key_mask(attention_mask)


def final_logits(module: nn.Module, x, embed: nn.Embed, vocab_size: int, tie: bool, *, dtype, param_dtype,
                 precision):
    """The LM head: x @ embedding.T when the embeddings are tied, else its own bias-free Dense."""
    if tie:  # embed.attend, with the model's precision
        compute = dtype if dtype is not None else jnp.result_type(x, embed.embedding)
        return jnp.einsum("...e,ve->...v", x.astype(compute), jnp.asarray(embed.embedding, compute),
                          precision=precision)
    return nn.Dense(vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype, precision=precision,
                    name="lm_head")(x)
