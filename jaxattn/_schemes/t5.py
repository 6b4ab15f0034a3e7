"""T5 relative position buckets (Raffel et al. 2020; Mesh TensorFlow's `_relative_position_bucket`).

Index convention: the relative position is j - i = key_pos - query_pos (HF's memory_position -
context_position), the library's one sign convention. Buckets:

    bidirectional: half the buckets for j - i <= 0, half (offset by num_buckets // 2) for j - i > 0
    causal:        only j - i <= 0 is told apart; every j - i > 0 lands in bucket 0 (masked anyway)
    within a half: distances d < max_exact = B // 2 get their own bucket (B = buckets in the half),
                   larger ones share log-spaced buckets up to max_distance; beyond it, the last bucket

The log is computed in float32 whatever the table dtype, exactly as Mesh TF and HF do, so bucket ids match
the trained models bit for bit (a float64 log moves a few boundaries).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax.numpy as jnp

from .._core import checks
from .._core.checks import static_int
from .._core.eager import compiled_when_eager
from .._core.offset_bias import OffsetBias
from .._core.positions import positions
from .position_bias import heads_first, position_bias_attention

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Float, Int

    from .._core.shapes import AttentionOutput


def _check_buckets(num_buckets, max_distance, bidirectional: bool) -> tuple[int, int, int]:
    num_buckets = static_int("num_buckets", num_buckets, 2)
    max_distance = static_int("max_distance", max_distance, 1)
    half = num_buckets // 2 if bidirectional else num_buckets
    max_exact = half // 2
    if max_exact < 1:
        checks.fail("num_buckets", ">= 4 when bidirectional (each half needs >= 2 buckets)", num_buckets)
    if max_distance <= max_exact:
        checks.fail(
            "max_distance",
            f"> {max_exact} (the exact-bucket range num_buckets"
            f"{' // 2' if bidirectional else ''} // 2; the log buckets need room)",
            max_distance,
        )
    return half, max_exact, max_distance


def t5_relative_position_bucket(
    relative_position, *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
):
    """int32 bucket ids in [0, num_buckets) of `relative_position` = j - i (int array, any shape)."""
    relative_position = jnp.asarray(relative_position)
    checks.check_int("relative_position", relative_position)
    half, max_exact, max_distance = _check_buckets(num_buckets, max_distance, bidirectional)
    n = relative_position.astype(jnp.int32)
    if bidirectional:
        ids = jnp.where(n > 0, half, 0)
        distance = jnp.abs(n)
    else:
        ids = jnp.zeros_like(n)
        distance = jnp.maximum(-n, 0)
    # float32 on purpose (see module docstring); the clamp only keeps log(0) out of the unused branch.
    ratio = jnp.maximum(distance, max_exact).astype(jnp.float32) / jnp.float32(max_exact)
    scaled = jnp.log(ratio) / jnp.float32(math.log(max_distance / max_exact)) * jnp.float32(half - max_exact)
    large = jnp.minimum(max_exact + scaled.astype(jnp.int32), half - 1)
    return (ids + jnp.where(distance < max_exact, distance, large)).astype(jnp.int32)


def _check_table(table):
    table = jnp.asarray(table)
    checks.check_rank("table", table, 2, "[R,N]: one learned scalar per bucket and head")
    checks.check_float("table", table)
    return table


def t5_position_bias(table, *, bidirectional: bool = True, max_distance: int = 128):
    """The T5 bias as a position function: (query_pos [...,T], key_pos [...,S]) -> [...,N,T,S].

    table: [R,N] (HF's `relative_attention_bias.weight`), R = num_buckets. The function is an OffsetBias (a
    function of j - i alone), which the Pallas GPU kernel computes inside its tiles, and the TPU flex kernel's
    forward with the core's default positions.
    """
    table = _check_table(table)
    _, _, max_distance = _check_buckets(table.shape[0], max_distance, bidirectional)

    def of_offset(relative_position):  # [...,T,S] -> [...,N,T,S]
        buckets = t5_relative_position_bucket(
            relative_position, bidirectional=bidirectional, num_buckets=table.shape[0], max_distance=max_distance
        )
        return heads_first(table[buckets])

    # Every distance from 2 * max_distance on is in the last bucket of its half, float32 log and all: there
    # log(d / max_exact) / log(max_distance / max_exact) >= 1 + log 2 / log(2**31) > 1.03, far from the
    # truncation at 1 (tests/test_kernel_relative.py checks it over every offset up to 4 * max_distance).
    return OffsetBias(of_offset, saturation=2 * max_distance)


def t5_relative_bias(
    table: Float[ArrayLike, "R N"],
    query_length: int,
    key_length: int,
    *,
    bidirectional: bool = True,
    max_distance: int = 128,
    query_positions: Int[ArrayLike, "*#B T"] | None = None,
    key_positions: Int[ArrayLike, "*#B S"] | None = None,
) -> Float[Array, "*#B N T S"]:
    """T5's additive bias [N,T,S] (or [...,N,T,S] for batched positions): table[bucket(j - i)].

    Positions are the core's: query t at t + S - T (HF's past_seen_tokens = S - T when decoding with a
    cache), key s at s; `query_positions` / `key_positions` override them. Not scaled: T5 adds it to
    unscaled logits and uses scale=1.
    """
    bias_fn = t5_position_bias(table, bidirectional=bidirectional, max_distance=max_distance)
    return bias_fn(*positions(query_length, key_length, query_positions, key_positions))


@compiled_when_eager
def t5_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    table: Float[ArrayLike, "R N"],
    *,
    bidirectional: bool = True,
    max_distance: int = 128,
    scale=1.0,
    **options,
) -> AttentionOutput:
    """Attention with the T5 bias added to the logits; `scale` defaults to 1 as in T5.

    Keywords as dot_product_attention, plus implementation=None (on CPU blockwise from T x S = 128 x 128,
    as dot_product_attention) | "dense" | "blockwise" | a kernel (and block_size, interpret): the blockwise
    path evaluates the bias one tile at a time and never holds [N,T,S] (position_bias_attention).
    """
    bias_fn = t5_position_bias(table, bidirectional=bidirectional, max_distance=max_distance)
    return position_bias_attention(query, key, value, bias_fn, scale=scale, **options)
