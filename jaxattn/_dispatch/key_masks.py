"""A key-only boolean mask rewritten as segment ids, for the kernels that take segment ids but no mask
(registry.Implementation.key_mask_as_segments)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .._core.call import AttentionCall


def key_mask_as_segments(call: AttentionCall, query, key) -> AttentionCall:
    """The call with a boolean `mask` that varies only over keys ([...,1,1,S] or [S]: a decoder's padding mask
    over its cache, as jaxattn.models' decode step passes it) rewritten as segment ids: query ids 0, key ids
    0 where the mask allows and 1 where it does not, the same rule (a row with no allowed key: zeros). Any
    other mask, or one beside segment ids, leaves the call unchanged (the kernel refuses it)."""
    mask = call.mask
    if mask is None or call.query_segment_ids is not None or call.key_segment_ids is not None:
        return call
    shape, S, batch = np.shape(mask), np.shape(key)[-3], tuple(np.shape(query)[:-3])
    if (
        jnp.result_type(mask) != jnp.bool_
        or not shape
        or shape[-1] != S
        or any(d != 1 for d in shape[-3:-1])
        or len(shape[:-3]) > len(batch)
    ):
        return call
    try:
        if np.broadcast_shapes(shape[:-3], batch) != batch:
            return call
    except ValueError:
        return call
    keys = jnp.where(jnp.reshape(mask, (*shape[:-3], S)), 0, 1).astype(jnp.int32)
    return call.replace(mask=None, query_segment_ids=jnp.zeros((np.shape(query)[-3],), jnp.int32), key_segment_ids=keys)
