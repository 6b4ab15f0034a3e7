"""Upstream spellings folded into ours (docs/coming_from.md): jax.nn.dot_product_attention's keywords.

    local_window_size=w | (left, right)   -> window=(w, w) | (left, right)   (absolute positions, as window)
    query_seq_lengths [...]               -> queries t >= length see no key (zeros), as segment ids
    return_residual=True                  -> (out, lse [...,T,N]) without gradient, in the value dtype
    implementation="xla"                  -> the XLA engines (dense / blockwise), never a fused kernel

Each alias means what jax.nn means by it; where the two readings differ on purpose (positions for T != S, a
row with no allowed key) docs/coming_from.md says so. Giving both an alias and our own keyword is refused.
"""

from __future__ import annotations

import numbers

import jax.numpy as jnp
from jax import lax

from . import checks


def window_from_local(local_window_size, window):
    """jax.nn's local_window_size (int: symmetric, or (left, right)) as our window=(left, right)."""
    if local_window_size is None:
        return window
    if window is not None:
        checks.fail(
            "local_window_size",
            "either local_window_size= (jax.nn's name) or window=, not both",
            repr(local_window_size),
        )
    sides = (local_window_size,) * 2 if not isinstance(local_window_size, (tuple, list)) else local_window_size
    if len(sides) != 2 or not all(
        isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0 for x in sides
    ):
        checks.fail("local_window_size", "an int >= 0 or a pair (left, right) of ints >= 0", repr(local_window_size))
    return tuple(int(x) for x in sides)


def query_length_segments(query_seq_lengths, query_segment_ids, key_segment_ids, query_shape, key_shape):
    """Query padding (query t >= query_seq_lengths[...] sees no key) expressed as segment ids, so that every
    engine, the blockwise tile skipping included, honours it with no [T,S] mask: a padded query gets an id
    that no key has (one below the smallest key id; 0 / -1 when no segment ids are given).

    query_seq_lengths: int, broadcastable to the batch dims [...]. Returns (query_segment_ids,
    key_segment_ids) for the call; unchanged when query_seq_lengths is None.
    """
    if query_seq_lengths is None:
        return query_segment_ids, key_segment_ids
    lengths = jnp.asarray(query_seq_lengths)
    checks.check_int("query_seq_lengths", lengths)
    if len(query_shape) < 3:
        return query_segment_ids, key_segment_ids  # check_qkv names the query's rank
    *batch, T, _, _ = query_shape
    checks.check_broadcastable("query_seq_lengths", lengths, tuple(batch), "[...] (batch dims)")
    valid = jnp.arange(T) < lengths[..., None]  # [...,T]
    if query_segment_ids is None and key_segment_ids is None:
        query_segment_ids, key_segment_ids = jnp.zeros((T,), jnp.int32), jnp.zeros((key_shape[-3],), jnp.int32)
    if query_segment_ids is None or key_segment_ids is None:
        return query_segment_ids, key_segment_ids  # the segment-id check names the missing one
    query_segment_ids, key_segment_ids = jnp.asarray(query_segment_ids), jnp.asarray(key_segment_ids)
    nobody = jnp.min(key_segment_ids, axis=-1, keepdims=True) - 1  # no key has this id
    return jnp.where(valid, query_segment_ids, nobody), key_segment_ids


def residual(outputs, value_dtype):
    """jax.nn's return_residual from a call with return_lse=True: (..., lse [...,N,T]) -> (..., lse [...,T,N])
    in the value dtype, without gradient (jax.nn stops it: the residual is a by-product for kernels, not a
    differentiable output; flex_attention's return_lse is that)."""
    *head, lse = outputs
    return (*head, lax.stop_gradient(jnp.swapaxes(lse, -1, -2).astype(value_dtype)))
