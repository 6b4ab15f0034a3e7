"""Key/value cache for autoregressive decoding: L slots per example, written at per-example positions.

    cached_key [...,L,K,H]    cached_value [...,L,K,Hv]    cache_index int32 [...]  (slots filled so far)

A call with T new tokens writes them to slots index .. index+T-1 and attends with absolute positions:
query t sits at index + t and key slot s at s, so the causal mask (s <= index + t) and Shaw tables read the
same positions a full causal pass would give them. The index then advances by `lengths`, the number of real
tokens among the T (default T), so a right-padded prefill of prompts of different lengths is followed by
steps that write each example's next token right after its own prompt, overwriting its padding.
"""

from __future__ import annotations

import jax
import jax.core  # jax.core.Tracer, eval_jaxpr: a submodule, imported by name so that type checkers see it
import jax.numpy as jnp

from .._core import checks


def init(batch_shape, max_length: int, num_kv_heads: int, head_dim: int, value_head_dim: int, dtype):
    """(cached_key, cached_value, cache_index) of zeros: an empty cache of max_length slots."""
    batch_shape = tuple(batch_shape)
    return (
        jnp.zeros((*batch_shape, max_length, num_kv_heads, head_dim), dtype),
        jnp.zeros((*batch_shape, max_length, num_kv_heads, value_head_dim), dtype),
        jnp.zeros(batch_shape, jnp.int32),
    )


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def _check_step(cached_key, cached_value, index, key, value, lengths, rolling=False):
    *batch, L, K, H = cached_key.shape
    name_shape = checks.shape_str
    if tuple(key.shape[:-3]) != tuple(batch) or tuple(key.shape[-2:]) != (K, H):
        checks.fail(
            "key (decode)",
            f"shape [{','.join(map(str, batch))}{',' if batch else ''}T,{K},{H}] "
            f"to fit the cache {name_shape(cached_key.shape)} [...,L,K,H]",
            f"shape {name_shape(key.shape)}",
        )
    if tuple(value.shape[:-1]) != tuple(key.shape[:-1]) or value.shape[-1] != cached_value.shape[-1]:
        checks.fail(
            "value (decode)",
            f"shape {name_shape((*key.shape[:-1], cached_value.shape[-1]))} to fit "
            f"the cache {name_shape(cached_value.shape)} [...,L,K,Hv]",
            f"shape {name_shape(value.shape)}",
        )
    T = key.shape[-3]
    if T > L and not rolling:  # a rolling cache takes any number of tokens (it keeps the newest)
        checks.fail("decode", f"at most L={L} new tokens per call (the cache's length)", f"T={T}")
    checks.check_int("key_value_seq_lengths (decode)", lengths)
    checks.check_broadcastable("key_value_seq_lengths (decode)", lengths, tuple(batch), "[...] (batch dims)")
    # Values are only known outside jit; inside jit the slots past L do not exist, so an overflowing write
    # is lost and the layer poisons that example's output with NaN (poison_overflow).
    if _is_concrete(lengths) and (jnp.any(lengths < 0) or jnp.any(lengths > T)):
        checks.fail("key_value_seq_lengths (decode)", f"counts of new tokens in [0, T={T}]", lengths)
    if not rolling and _is_concrete(index) and jnp.any(index + T > L):
        checks.fail("decode", f"room in the cache: index + T <= L={L}", f"index {index.tolist()} with T={T} new tokens")


def write(cached_key, cached_value, index, key, value, lengths=None):
    """Write T new tokens' key [...,T,K,H] / value [...,T,K,Hv] after each example's filled slots.

    lengths: int [...], how many of the T tokens are real per example (default T).
    Returns (cached_key, cached_value, cache_index) updated, and the attention keywords for the T queries
    over all L slots: causal by absolute positions, slots past each example's last real token masked.
    """
    T, L = key.shape[-3], cached_key.shape[-3]
    lengths = jnp.full(index.shape, T, jnp.int32) if lengths is None else jnp.asarray(lengths)
    _check_step(cached_key, cached_value, index, key, value, lengths)
    offset = jnp.arange(L, dtype=jnp.int32) - index[..., None]  # [...,L]: slot s holds new token s - index
    fresh = ((offset >= 0) & (offset < T))[..., None, None]
    take = jnp.clip(offset, 0, T - 1)[..., None, None]
    new_key = jnp.where(fresh, jnp.take_along_axis(key.astype(cached_key.dtype), take, axis=-3), cached_key)
    new_value = jnp.where(fresh, jnp.take_along_axis(value.astype(cached_value.dtype), take, axis=-3), cached_value)
    attend = {
        "is_causal": True,
        "query_positions": index[..., None] + jnp.arange(T, dtype=jnp.int32),
        "key_positions": jnp.arange(L, dtype=jnp.int32),
        "key_value_seq_lengths": index + lengths.astype(jnp.int32),
    }
    return new_key, new_value, index + lengths.astype(jnp.int32), attend


# ---------------------------------------------------------------------------------------------------
# Rolling cache: a layer with a sliding window (left, right) only ever needs the last `left` keys.

# The position of a key no query may see (an empty slot, a padding token): beyond every query, so the
# causal rule excludes it on either engine, with no mask array (the blockwise path stays open).
UNSEEN = 2**30


def rolling_size(window, max_length: int) -> int:
    """Slots of a rolling cache for window (left, right): min(left, max_length), at least 1."""
    return max(1, min(window[0], max_length))


def rolling_write(cached_key, cached_value, index, key, value, lengths=None):
    """Attend T new tokens over a rolling cache of W slots, then keep the newest W real keys.

    Slot s holds the key of the absolute position p with p % W == s among the last W positions
    index - W .. index - 1 (per example). Returns (keys [...,W+T,K,H], values [...,W+T,K,Hv], attention
    keywords, new cache): the W slots followed by the T new tokens, at absolute key positions (UNSEEN for
    empty slots and padding tokens), queries at index + t, causal.
    """
    T, W = key.shape[-3], cached_key.shape[-3]
    lengths = jnp.full(index.shape, T, jnp.int32) if lengths is None else jnp.asarray(lengths)
    _check_step(cached_key, cached_value, index, key, value, lengths, rolling=True)
    lengths = lengths.astype(jnp.int32)
    slots, t = jnp.arange(W, dtype=jnp.int32), jnp.arange(T, dtype=jnp.int32)
    slot_pos = index[..., None] - W + jnp.mod(slots - index[..., None], W)  # [...,W]
    slot_pos = jnp.where(slot_pos >= 0, slot_pos, UNSEEN)
    new_pos = jnp.where(t < lengths[..., None], index[..., None] + t, UNSEEN)  # [...,T]
    keys = jnp.concatenate([cached_key, key.astype(cached_key.dtype)], axis=-3)
    values = jnp.concatenate([cached_value, value.astype(cached_value.dtype)], axis=-3)
    attend = {
        "is_causal": True,
        "query_positions": index[..., None] + t,
        "key_positions": jnp.concatenate([slot_pos, new_pos], axis=-1),
    }
    # slot s now holds the newest real position p <= index + lengths - 1 with p % W == s
    last = index + lengths - 1
    newest = last[..., None] - jnp.mod(last[..., None] - slots, W)  # [...,W]
    fresh = (newest >= index[..., None])[..., None, None]
    take = jnp.clip(newest - index[..., None], 0, T - 1)[..., None, None]
    new_key = jnp.where(fresh, jnp.take_along_axis(keys[..., W:, :, :], take, axis=-3), cached_key)
    new_value = jnp.where(fresh, jnp.take_along_axis(values[..., W:, :, :], take, axis=-3), cached_value)
    return keys, values, attend, (new_key, new_value, index + lengths)


def poison_overflow(result, overflowed):
    """NaN in every output (and weight) of the examples whose cache overflowed (bool [...]), so a step past
    the cache never returns plausible numbers; the other examples are untouched. Outside jit the cache
    raises first; inside jit the index keeps counting past L, so every later step of that example is NaN too."""

    def poison(x, core_dims):
        flag = overflowed.reshape(overflowed.shape + (1,) * core_dims)
        return jnp.where(flag, jnp.asarray(jnp.nan, x.dtype), x)

    if isinstance(result, tuple):
        out, weights = result
        return poison(out, 2), poison(weights, 3)
    return poison(result, 2)
