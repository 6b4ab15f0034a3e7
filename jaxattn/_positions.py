"""Shared plumbing of the relative-position schemes (T5, ALiBi, RoPE, Transformer-XL).

Every scheme reads the core's absolute positions (query t at t + S - T, key s at s, unless
`query_positions` / `key_positions` say otherwise), so position terms always agree with `is_causal`.

A *position bias* is a function `bias_fn(query_pos [...,T], key_pos [...,S]) -> [...,N,T,S]` (T5, ALiBi):
it depends on positions only, never on the whole [T,S] grid, so a blockwise engine can evaluate it one
[Tb,Sb] tile at a time and never materialise [N,T,S].
"""

from __future__ import annotations

import numbers
from typing import Callable

import jax.numpy as jnp

from . import _checks
from ._attention import attention_core, check_qkv
from ._blockwise import blockwise_attention
from ._masking import positions

PositionBias = Callable[..., jnp.ndarray]  # (query_pos [...,T], key_pos [...,S]) -> [...,N,T,S]


def static_int(name: str, value, minimum: int | None = None) -> int:
    """A Python int (not bool, not an array: these set shapes), optionally >= minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        _checks.fail(name, "a Python int", repr(value))
    if minimum is not None and value < minimum:
        _checks.fail(name, f"an int >= {minimum}", value)
    return int(value)


def offsets(query_pos, key_pos):
    """key_pos - query_pos as [...,T,S] (j - i, the library's one sign convention)."""
    return key_pos[..., None, :] - query_pos[..., :, None]


def heads_first(per_pair):
    """[...,T,S,N] -> [...,N,T,S]."""
    return jnp.moveaxis(per_pair, -1, -3)


def _combined_bias(bias_fn: PositionBias, T: int, S: int, options: dict):
    q_pos, k_pos = positions(T, S, options.get("query_positions"), options.get("key_positions"))
    position_bias = bias_fn(q_pos, k_pos)
    user_bias = options.pop("bias", None)
    if user_bias is None:
        return position_bias
    user_bias = jnp.asarray(user_bias)
    _checks.check_float("bias", user_bias)
    return position_bias + user_bias


_BLOCKWISE_OPTIONS = ("is_causal", "key_value_seq_lengths", "query_positions", "key_positions", "scale",
                      "precision")


def _unset(value) -> bool:
    """None, False or 0.0: an option left at its default (dropout_rate=0.0, return_weights=False)."""
    return value is None or (isinstance(value, (bool, int, float)) and not value)


def position_bias_attention(query, key, value, bias_fn: PositionBias, *, implementation: str = "dense",
                            block_size=None, **options):
    """dot_product_attention with `bias_fn(query_pos, key_pos) -> [...,N,T,S]` added to the scaled logits.

    The positions are the core's (bottom-right by default; `query_positions` / `key_positions` override
    them for the bias and the causal mask alike). implementation="dense" builds the [...,N,T,S] bias (and
    accepts every dot_product_attention keyword, a user `bias` is added on top); "blockwise" hands
    bias_fn to the blockwise engine, which evaluates it one [Tb,Sb] tile at a time (O(T + S) memory;
    keywords: is_causal, key_value_seq_lengths, positions, scale, precision, and block_size).
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    _, T, S, *_ = check_qkv(query, key, value)
    options = dict(options)
    if implementation == "blockwise":
        unsupported = sorted(k for k, v in options.items() if k not in _BLOCKWISE_OPTIONS and not _unset(v))
        if unsupported:
            _checks.fail("implementation", f"'dense' for {unsupported} (blockwise takes "
                         f"{list(_BLOCKWISE_OPTIONS)} and block_size)", repr(implementation))
        options = {k: v for k, v in options.items() if k in _BLOCKWISE_OPTIONS}
        return blockwise_attention(query, key, value, position_bias=bias_fn, block_size=block_size, **options)
    if implementation != "dense":
        _checks.fail("implementation", "'dense' or 'blockwise'", repr(implementation))
    if block_size is not None:
        _checks.fail("block_size", "None with implementation='dense'", repr(block_size))
    options["bias"] = _combined_bias(bias_fn, T, S, options)
    return attention_core(query, key, value, **options)
