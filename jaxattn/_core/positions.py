"""Absolute positions and the one relative-position convention (j - i = key minus query).

Absolute positions: query t sits at t + (S - T) and key s at s unless the caller passes positions.
This bottom-right alignment makes T < S the decoding-with-a-cache case, and every position-dependent
term (causal mask, relative indices, position biases) reads the same two position vectors.
"""

from __future__ import annotations

import jax.numpy as jnp

from . import checks


def positions(query_length: int, key_length: int, query_positions=None, key_positions=None):
    """(query_pos [...,T], key_pos [...,S]) as int32, defaulting to bottom-right alignment."""
    if query_positions is None:
        query_positions = jnp.arange(query_length, dtype=jnp.int32) + (key_length - query_length)
    else:
        query_positions = jnp.asarray(query_positions)
        checks.check_int("query_positions", query_positions)
        checks.check_min_rank("query_positions", query_positions, 1, "[...,T]")
        checks.check_dim("query_positions", query_positions, -1, query_length, "[...,T]")
    if key_positions is None:
        key_positions = jnp.arange(key_length, dtype=jnp.int32)
    else:
        key_positions = jnp.asarray(key_positions)
        checks.check_int("key_positions", key_positions)
        checks.check_min_rank("key_positions", key_positions, 1, "[...,S]")
        checks.check_dim("key_positions", key_positions, -1, key_length, "[...,S]")
    return query_positions.astype(jnp.int32), key_positions.astype(jnp.int32)


def offsets(query_pos, key_pos):
    """key_pos - query_pos as [...,T,S] (j - i, the library's one sign convention)."""
    return key_pos[..., None, :] - query_pos[..., :, None]


def clipped_index(query_pos, key_pos, max_left: int, max_right: int):
    """int32 [...,T,S]: clip(j - i, -max_left, max_right) + max_left, the row of a clipped relative table
    (R = max_left + max_right + 1 rows; Shaw's tables are max_left = max_right = max_distance)."""
    return (jnp.clip(offsets(query_pos, key_pos), -max_left, max_right) + max_left).astype(jnp.int32)
