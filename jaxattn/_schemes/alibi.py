"""ALiBi: attention with linear biases (Press et al. 2022).

Index convention: bias[n,t,s] = slope[n] * (j - i) with j - i = key_pos - query_pos, so

    causal (bidirectional=False): slope * (j - i) = -slope * (i - j), <= 0 on every key a causal query sees
                                  (keys to the right get positive values: use it with is_causal / a mask)
    symmetric (bidirectional=True): -slope * |j - i|

BLOOM and MPT add slope * key_pos (resp. slope * (key_pos - (S-1))) instead of slope * (j - i): the
difference, slope * query_pos, is constant along each softmax row, so the attention is the same.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from .._core import checks
from .._core.checks import static_int
from .._core.eager import compiled_when_eager
from .._core.offset_bias import OffsetBias
from .._core.positions import positions
from .position_bias import position_bias_attention

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Float, Int

    from .._core.shapes import AttentionOutput


def alibi_slopes(num_heads: int, *, max_bias: float = 8.0, dtype=jnp.float32) -> Float[Array, " N"]:
    """[N] slopes: 2 ** (-max_bias * k / N), k = 1..N, for N a power of two.

    Otherwise (the paper's recipe, also BLOOM's and MPT's): the slopes of the closest lower power of two
    c, followed by the odd-k slopes 2 ** (-max_bias * k / (2c)), k = 1, 3, 5, ..., of its double.
    Computed in float64 and cast to `dtype`.
    """
    num_heads = static_int("num_heads", num_heads, 1)
    if not isinstance(max_bias, (int, float)) or isinstance(max_bias, bool) or not max_bias > 0:
        checks.fail("max_bias", "a positive float", repr(max_bias))
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-max_bias * k / closest) for k in range(1, closest + 1)]
    extra = num_heads - closest
    slopes += [2.0 ** (-max_bias * k / (2 * closest)) for k in range(1, 2 * extra, 2)]
    return jnp.asarray(np.asarray(slopes, np.float64), dtype)


def _check_slopes(slopes):
    slopes = jnp.asarray(slopes)
    checks.check_min_rank("slopes", slopes, 1, "[...,N]")
    checks.check_float("slopes", slopes)
    return slopes


def alibi_position_bias(slopes, *, bidirectional: bool = False):
    """ALiBi as a position function: (query_pos [...,T], key_pos [...,S]) -> [...,N,T,S].

    The function is an OffsetBias (a function of j - i alone), which the Pallas GPU kernel and the TPU flex
    kernel's forward compute inside their tiles (with the core's default positions: the bias grows without
    bound, so other positions have no static range of offsets)."""
    slopes = _check_slopes(slopes)

    def of_offset(relative_position):  # [...,T,S] -> [...,N,T,S]
        distance = relative_position.astype(slopes.dtype)[..., None, :, :]
        distance = -jnp.abs(distance) if bidirectional else distance
        return slopes[..., :, None, None] * distance

    return OffsetBias(of_offset)


def alibi_bias(
    slopes: Float[ArrayLike, "*#B N"],
    query_length: int,
    key_length: int,
    *,
    bidirectional: bool = False,
    query_positions: Int[ArrayLike, "*#B T"] | None = None,
    key_positions: Int[ArrayLike, "*#B S"] | None = None,
) -> Float[Array, "*#B N T S"]:
    """ALiBi's additive bias [N,T,S] (or [...,N,T,S]) from slopes [N] (see `alibi_slopes`).

    bidirectional=False: slope * (j - i) (pair it with is_causal); True: -slope * |j - i|.
    Positions as the core's (query t at t + S - T by default).
    """
    bias_fn = alibi_position_bias(slopes, bidirectional=bidirectional)
    return bias_fn(*positions(query_length, key_length, query_positions, key_positions))


@compiled_when_eager
def alibi_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    slopes: Float[ArrayLike, "*#B N"],
    *,
    bidirectional: bool = False,
    **options,
) -> AttentionOutput:
    """Attention with the ALiBi bias added to the scaled logits.

    Keywords as dot_product_attention, plus implementation=None (on CPU blockwise from T x S = 128 x 128)
    | "dense" | "blockwise" | a kernel (and block_size, interpret), as t5_attention.
    """
    bias_fn = alibi_position_bias(slopes, bidirectional=bidirectional)
    return position_bias_attention(query, key, value, bias_fn, **options)
