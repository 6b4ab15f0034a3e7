"""Positions, masks and the masked softmax: the numerical choices, each named once.

Absolute positions: query t sits at t + (S - T) and key s at s unless the caller passes positions.
This bottom-right alignment makes T < S the decoding-with-a-cache case, and every position-dependent
term (causal mask, relative indices) reads the same two position vectors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import _checks


def positions(query_length: int, key_length: int, query_positions=None, key_positions=None):
    """(query_pos [...,T], key_pos [...,S]) as int32, defaulting to bottom-right alignment."""
    if query_positions is None:
        query_positions = jnp.arange(query_length, dtype=jnp.int32) + (key_length - query_length)
    else:
        query_positions = jnp.asarray(query_positions)
        _checks.check_int("query_positions", query_positions)
        _checks.check_min_rank("query_positions", query_positions, 1, "[...,T]")
        _checks.check_dim("query_positions", query_positions, -1, query_length, "[...,T]")
    if key_positions is None:
        key_positions = jnp.arange(key_length, dtype=jnp.int32)
    else:
        key_positions = jnp.asarray(key_positions)
        _checks.check_int("key_positions", key_positions)
        _checks.check_min_rank("key_positions", key_positions, 1, "[...,S]")
        _checks.check_dim("key_positions", key_positions, -1, key_length, "[...,S]")
    return query_positions.astype(jnp.int32), key_positions.astype(jnp.int32)


def relative_offsets(query_pos, key_pos):
    """key_pos - query_pos as [...,1,T,S] (j - i): the head axis is left for broadcasting."""
    offsets = key_pos[..., None, :] - query_pos[..., :, None]
    return offsets[..., None, :, :]


def allowed_keys(logits_shape, *, mask=None, is_causal=False, key_value_seq_lengths=None,
                 query_positions=None, key_positions=None):
    """The bool 'may attend' array (broadcastable to logits_shape [...,N,T,S]), or None for all."""
    *batch, N, T, S = logits_shape
    allowed = None

    def both(a, b):
        return b if a is None else a & b

    if mask is not None:
        mask = jnp.asarray(mask)
        _checks.check_bool("mask", mask)
        _checks.check_broadcastable("mask", mask, logits_shape, "[...,N,T,S]")
        allowed = mask
    if is_causal:
        q_pos, k_pos = positions(T, S, query_positions, key_positions)
        allowed = both(allowed, relative_offsets(q_pos, k_pos) <= 0)
    if key_value_seq_lengths is not None:
        lengths = jnp.asarray(key_value_seq_lengths)
        _checks.check_int("key_value_seq_lengths", lengths)
        _checks.check_broadcastable("key_value_seq_lengths", lengths, batch, "[...] (batch dims)")
        valid = jnp.arange(S) < lengths[..., None]
        allowed = both(allowed, valid[..., None, None, :])
    if allowed is not None and allowed.ndim > len(logits_shape):
        _checks.fail("query_positions/key_positions", f"batch dims that fit [...,T]/[...,S] of {logits_shape}",
                     f"a mask of shape {_checks.shape_str(allowed.shape)}")
    return allowed


def masked_softmax(logits, allowed):
    """Softmax over the last axis restricted to `allowed`; rows with no allowed key give zeros.

    Disallowed logits are replaced *before* exp (never -inf arithmetic), and the row max is taken over
    allowed entries only, so the forward pass and its gradient stay finite for fully masked rows.
    """
    if allowed is None:
        return jax.nn.softmax(logits, axis=-1)
    allowed = jnp.broadcast_to(allowed, logits.shape)
    row_max = jnp.max(jnp.where(allowed, logits, -jnp.inf), axis=-1, keepdims=True)
    row_max = lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0))
    exps = jnp.where(allowed, jnp.exp(jnp.where(allowed, logits, row_max) - row_max), 0)
    total = jnp.sum(exps, axis=-1, keepdims=True)
    return exps / jnp.where(total == 0, 1, total)


def dropout(weights, rate: float, rng):
    """Inverted dropout on the attention weights (the weights returned are the ones used)."""
    if not 0.0 <= rate <= 1.0:
        _checks.fail("dropout_rate", "a float in [0, 1]", rate)
    if rate == 0.0:
        return weights
    if rng is None:
        _checks.fail("dropout_rng", "a jax.random key when dropout_rate > 0", None)
    if rate == 1.0:
        return jnp.zeros_like(weights)
    keep = jax.random.bernoulli(rng, 1.0 - rate, weights.shape)
    return jnp.where(keep, weights / (1.0 - rate), 0)
