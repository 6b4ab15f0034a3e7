"""The choice of implementation, above both engines: dot_product_attention picks dense or blockwise.

    implementation="dense"      one [...,N,T,S] array (every option)
    implementation="blockwise"  O(T + S) tiles (no mask, bias, return_weights or dropout: they span [T,S])
    implementation=None         blockwise when nothing needs the grid and the float32 logits would take at
                                least AUTO_BLOCKWISE_BYTES, dense otherwise (use_blockwise)
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .._core import checks
from .blockwise import blockwise_attention, grid_options_in_use
from .dense import attention_core

# implementation=None picks blockwise when nothing needs the full [T,S] grid and the float32 logits
# [...,N,T,S] would take at least this much: from there on the tiles beat dense attention's softmax
# over one large array (measured from 4 MiB up, forward and backward; below it the two are close).
AUTO_BLOCKWISE_BYTES = 16 * 2**20


def use_blockwise(implementation, query, key, **options) -> bool:
    """The implementation rule of dot_product_attention / shaw_relative_attention / the position schemes.

    "dense" and "blockwise" are taken as given (blockwise_attention raises for options it cannot do).
    None (automatic): blockwise when no option needs the full grid (mask, bias, return_weights, dropout)
    and the float32 logits [...,N,T,S] would take at least AUTO_BLOCKWISE_BYTES; dense otherwise.
    """
    if implementation not in (None, "dense", "blockwise"):
        checks.fail("implementation", 'None (automatic), "dense" or "blockwise"', repr(implementation))
    if implementation is not None:
        return implementation == "blockwise"
    grid = {k: options.get(k) for k in ("bias", "mask", "return_weights", "dropout_rng")}
    if grid_options_in_use(dropout_rate=options.get("dropout_rate", 0.0), **grid):
        return False
    query, key = jnp.asarray(query), jnp.asarray(key)
    if query.ndim < 3 or key.ndim < 3:
        return False  # let the dense path raise its usual error
    try:
        batch = np.broadcast_shapes(query.shape[:-3], key.shape[:-3])
    except ValueError:
        return False
    logits = int(np.prod(batch, dtype=np.int64)) * query.shape[-2] * query.shape[-3] * key.shape[-3]
    return 4 * logits >= AUTO_BLOCKWISE_BYTES


def dot_product_attention(query, key, value, *, bias=None, mask=None, is_causal=False,
                          key_value_seq_lengths=None, query_positions=None, key_positions=None,
                          scale=None, dropout_rate=0.0, dropout_rng=None, return_weights=False,
                          precision=None, implementation=None, block_size=None):
    """Scaled dot-product attention, multi-head / multi-query / grouped-query.

    Args:
      query: [...,T,N,H]; key: [...,S,K,H]; value: [...,S,K,Hv], one float dtype; N % K == 0.
      bias: additive float, broadcastable to [...,N,T,S], added to the scaled logits (-inf = blocked).
      mask: bool, True = may attend, broadcastable to [...,N,T,S].
      is_causal: bottom-right aligned: query t (at t + S - T) sees keys s <= t + S - T.
      key_value_seq_lengths: int [...]; keys s >= length are padding.
      query_positions / key_positions: int [...,T] / [...,S] absolute positions replacing the
        bottom-right defaults (used by the causal mask).
      scale: defaults to H ** -0.5.
      dropout_rate, dropout_rng: dropout on the weights (a key is required when rate > 0).
      return_weights: also return the weights [...,N,T,S] (after dropout).
      precision: passed to every einsum (use "highest" for float32 comparisons).
      implementation: "dense" (one [...,N,T,S] array), "blockwise" (O(T+S) memory tiles; no mask, bias,
        return_weights or dropout) or None: blockwise when none of those is used and the float32 logits
        would take >= 16 MiB (jaxattn._engines.dispatch.use_blockwise).
      block_size: blockwise tile, int or (query_block, key_block); default: see blockwise_attention.

    Returns [...,T,N,Hv] (or (out, weights)). A query with no allowed key (or T = 0 / S = 0) gets zeros.
    """
    options = dict(bias=bias, mask=mask, is_causal=is_causal, key_value_seq_lengths=key_value_seq_lengths,
                   query_positions=query_positions, key_positions=key_positions, scale=scale,
                   dropout_rate=dropout_rate, dropout_rng=dropout_rng, return_weights=return_weights,
                   precision=precision)
    if use_blockwise(implementation, query, key, **options):
        return blockwise_attention(query, key, value, block_size=block_size, **options)
    return attention_core(query, key, value, **options)
