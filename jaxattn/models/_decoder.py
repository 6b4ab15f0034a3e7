"""The base every family module reads: what the models share, in one place.

    norms       RMSNorm (HF's three roundings), layer_norm
    masks       key_mask, positions / positions_and_slots, sliding_mask
    the stack   Configured (a module's config and dtypes), layer_stack (blocks in turn, each one's outputs
                sown), lm_head / tied_logits
    decoding    empty_cache

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
Every model sows its layers' outputs in "intermediates" (see layer_stack), which crosscheck.layer_report
aligns with the torch model's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

# --- norms ------------------------------------------------------------------------------------------------------

RMS_NORMS = ("llama", "gemma", "t5")


def rms_normalize(x, epsilon: float):
    """x * rsqrt(mean(x^2) + eps) over the last axis, computed in float32 or wider (returned so)."""
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return wide * jax.lax.rsqrt(jnp.mean(wide * wide, -1, keepdims=True) + epsilon)


class RMSNorm(nn.Module):
    """HF's RMS norms: the statistics in float32 or wider, then a learned scale; they differ in where they
    round back, which decides bf16 results bit for bit, so `kind` names the one to reproduce:

        "llama"  LlamaRMSNorm (Qwen2, Mistral):  weight * normed.astype(x.dtype)
        "gemma"  Gemma2RMSNorm:                   (normed * (1 + weight)).astype(x.dtype), weight from 0
        "t5"     T5LayerNorm:                     weight * normed, normed cast to a half weight's dtype first
    """

    epsilon: float
    param_dtype: Any = jnp.float32
    kind: str = "llama"

    @nn.compact
    def __call__(self, x):
        if self.kind not in RMS_NORMS:
            raise ValueError(f"kind: expected one of {list(RMS_NORMS)}, got {self.kind!r}")
        init = nn.initializers.zeros if self.kind == "gemma" else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.param_dtype)
        normed = rms_normalize(x, self.epsilon)
        if self.kind == "gemma":
            return (normed * (1.0 + weight.astype(normed.dtype))).astype(x.dtype)
        if self.kind == "t5":
            return weight * (normed.astype(weight.dtype) if weight.dtype in (jnp.bfloat16, jnp.float16) else normed)
        return weight * normed.astype(x.dtype)


def layer_norm(epsilon: float, dtype, param_dtype, name: str) -> nn.LayerNorm:
    """torch's LayerNorm: the variance as mean((x - mean)^2); flax's fast E[x^2] - E[x]^2 loses digits."""
    return nn.LayerNorm(epsilon=epsilon, use_fast_variance=False, dtype=dtype, param_dtype=param_dtype, name=name)


# --- masks and positions ----------------------------------------------------------------------------------------

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


# --- the stack --------------------------------------------------------------------------------------------------

class Configured(nn.Module):
    """What every model and block of the families takes: its config and flax's dtype options."""

    config: Any
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None


def layer_stack(module: nn.Module, layer: Callable, num_layers: int, final_norm: nn.Module, x):
    """x through the blocks and the final norm, inside `module`'s compact call; layer(i, x) -> (x, {row: output})
    runs block i. Sows in "intermediates" the rows crosscheck.layer_report aligns: "embeddings" (x as it
    comes in), each block's "layer{i}.{row}" and "layer{i}.residual" (the stream after it), "final_norm"."""
    module.sow("intermediates", "embeddings", x)
    for i in range(num_layers):
        x, rows = layer(i, x)
        for name, value in rows.items():
            module.sow("intermediates", f"layer{i}.{name}", value)
        module.sow("intermediates", f"layer{i}.residual", x)
    x = final_norm(x)
    module.sow("intermediates", "final_norm", x)
    return x


def tied_logits(x, embedding, dtype, precision):
    """x @ embedding.T: a head tied to the embeddings (nn.Embed.attend, with the model's precision)."""
    compute = dtype if dtype is not None else jnp.result_type(x, embedding)
    return jnp.einsum("...e,ve->...v", x.astype(compute), jnp.asarray(embedding, compute), precision=precision)


def lm_head(module: Configured, x, embed: nn.Embed, tie: bool):
    """The LM head in `module`'s compact call: tied to `embed`, else its own bias-free Dense "lm_head"."""
    if tie:
        return tied_logits(x, embed.embedding, module.dtype, module.precision)
    return nn.Dense(embed.num_embeddings, use_bias=False, dtype=module.dtype, param_dtype=module.param_dtype,
                    precision=module.precision, name="lm_head")(x)


# --- decoding ---------------------------------------------------------------------------------------------------

def empty_cache(model: nn.Module, params, *args, method=None, **kwargs):
    """The "cache" collection that model.apply({"params": params}, *args, decode=True, method=method,
    **kwargs) fills, all zeros: its shapes for those arguments (jax.eval_shape, nothing is computed), its
    dtype the one the model computes in with these params (a cache never casts silently)."""
    def cache(params):
        return model.apply({"params": params}, *args, decode=True, method=method, mutable=["cache"],
                           **kwargs)[1]["cache"]

    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(cache, params))
