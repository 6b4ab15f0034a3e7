"""TEMPORARY placeholder for the Pallas GPU kernel: JAX's shipped flash attention for the simple case.

The real kernel (our own, every blockwise option) replaces this file; until then `attention` wraps
jax.experimental.pallas.ops.gpu.attention.mha for: K == N (no grouped heads), H == Hv, T == S with the
default positions, causal or not, segment ids when the same array is given for queries and keys (mha reads one),
lengths a multiple of mha's 128-row block (or shorter than one block), nothing else. `unsupported` names
the first option outside that.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 128
# Options this placeholder reads; every other blockwise option must be unset.
HANDLED = ("is_causal", "scale", "precision", "query_segment_ids", "key_segment_ids")


def unsupported(query, key, value, **options):
    """None when mha computes this call exactly, else the name of the first option it cannot express."""
    if jax.config.jax_enable_x64:
        return "jax_enable_x64 (mha's loop bounds mix int32 and int64)"
    for name, value_ in options.items():
        if name not in HANDLED and value_ is not None and value_ is not False:
            return name
    *_, T, N, H = np.shape(query)
    *_, S, K, _ = np.shape(key)
    if K != N:
        return "key (grouped-query heads)"
    if np.shape(value)[-1] != H:
        return "value (head dim Hv != H)"
    if T != S:
        return "query (T != S)"
    if T % min(BLOCK, T) or T == 0:
        return "query (length not a multiple of 128)"
    if options.get("query_segment_ids") is not options.get("key_segment_ids"):
        return "key_segment_ids (mha reads one array for queries and keys)"
    return None


def attention(query, key, value, *, interpret=False, is_causal=False, scale=None, precision=None,
              query_segment_ids=None, key_segment_ids=None):
    from jax.experimental.pallas.ops.gpu import attention as shipped

    del precision, key_segment_ids  # mha computes at its own precision; it reads one [B,T] segment array
    *batch, T, _, H = query.shape
    flat = lambda x: x.reshape(-1, *x.shape[len(batch):])  # noqa: E731
    segments = None if query_segment_ids is None else jnp.broadcast_to(query_segment_ids, (*batch, T)).reshape(-1, T)
    blocks = shipped.BlockSizes(block_q=min(BLOCK, T), block_k=min(BLOCK, T), block_q_dkv=min(32, T),
                                block_kv_dkv=min(32, T), block_q_dq=min(32, T), block_kv_dq=min(32, T))
    out = shipped.mha(flat(query), flat(key), flat(value), segments, sm_scale=H ** -0.5 if scale is None else scale,
                      causal=is_causal, block_sizes=blocks, interpret=interpret)
    return out.reshape(*batch, *out.shape[1:])
