"""Shared plumbing of the relative-position schemes (T5, ALiBi, RoPE, Transformer-XL).

Every scheme reads the core's absolute positions (query t at t + S - T, key s at s, unless
`query_positions` / `key_positions` say otherwise), so position terms always agree with `is_causal`.

A *position bias* is a function `bias_fn(query_pos [...,T], key_pos [...,S]) -> [...,N,T,S]` (T5, ALiBi):
it depends on positions only, never on the whole [T,S] grid, so a blockwise engine can evaluate it one
[Tb,Sb] tile at a time and never materialise [N,T,S].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import jax.numpy as jnp

from .._api import attend, scheme_call, use_blockwise
from .._core import checks
from .._core.eager import compiled_when_eager
from .._core.positions import positions
from .._dispatch import registry
from .._engines import blockwise
from .._engines.dense import attention_core

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import ArrayLike, Float

    from .._core.shapes import AttentionOutput

PositionBias = Callable[..., jnp.ndarray]  # (query_pos [...,T], key_pos [...,S]) -> [...,N,T,S]


def heads_first(per_pair):
    """[...,T,S,N] -> [...,N,T,S]."""
    return jnp.moveaxis(per_pair, -1, -3)


def _combined_bias(bias_fn: PositionBias, T: int, S: int, call):
    q_pos, k_pos = positions(T, S, call.query_positions, call.key_positions)
    position_bias = bias_fn(q_pos, k_pos)
    user_bias = call.bias
    if user_bias is None:
        return position_bias
    user_bias = jnp.asarray(user_bias)
    checks.check_float("bias", user_bias)
    return position_bias + user_bias


@compiled_when_eager
def position_bias_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    bias_fn: PositionBias,
    *,
    implementation=None,
    interpret=False,
    block_size=None,
    **options,
) -> AttentionOutput:
    """dot_product_attention with `bias_fn(query_pos, key_pos) -> [...,N,T,S]` added to the scaled logits.

    The positions are the core's (bottom-right by default; `query_positions` / `key_positions` override
    them for the bias and the causal mask alike). implementation="dense" builds the [...,N,T,S] bias (and
    accepts every dot_product_attention keyword, a user `bias` is added on top); "blockwise" hands
    bias_fn to the blockwise engine, which evaluates it one [Tb,Sb] tile at a time (O(T + S) memory; every
    keyword but the [T,S]-grid ones: mask, bias, return_weights, dropout, which it refuses by name).
    None (default): the XLA engines by dot_product_attention's rule (blockwise when no grid option is in
    use and T x S >= AUTO_BLOCKWISE_ELEMENTS, else dense), and a kernel on GPU / TPU only where it takes
    the bias function (position_bias), as dot_product_attention's implementation=; interpret likewise.
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    registry.check_implementation(implementation, interpret)  # once: attend is told (checked=True)
    call = scheme_call("position_bias_attention", options, block_size=block_size, position_bias=bias_fn)
    if implementation == "dense" and block_size is not None:
        checks.fail("block_size", "None with implementation='dense'", repr(block_size))
    engine = implementation if implementation in ("dense", "blockwise") else None

    def xla():
        # use_blockwise's rule, as dot_product_attention: blockwise (the hook one tile at a time) unless an
        # option needs the [T,S] grid or the call is small; an explicit "blockwise" refuses a grid option
        # by name (tiled), None falls back to the dense engine for it.
        if use_blockwise(engine, call, query, key):
            return blockwise.tiled(call, query, key, value)
        dims = checks.check_qkv(query, key, value)
        bias = _combined_bias(bias_fn, dims.T, dims.S, call)  # the [...,N,T,S] bias, a user `bias` on top
        dense_call = call.replace(position_bias=None, bias=bias, block_size=None)
        return attention_core(dense_call, query, key, value, dims=dims)

    if engine is not None:
        return xla()
    return attend(call, query, key, value, xla=xla, implementation=implementation, interpret=interpret, checked=True)
