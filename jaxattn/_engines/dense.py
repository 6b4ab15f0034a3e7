"""The dense engine: one [...,N,T,S] logits array, the masked softmax, and optional relative terms.

    logits[...,n,t,s] = scale * (q[t,n] . k[s,kv(n)] + relative_logits[...,n,t,s]) + bias
    p = masked_softmax(logits, allowed)            (float32 or wider)
    out[...,t,n]      = sum_s p[...,n,t,s] v[s,kv(n)] + relative_values(p)[...,t,n]

Grouped-query heads: query head n uses key/value head kv(n) = n // G with G = N // K, so the query's head
axis is viewed as [K,G] (head n = k*G + g) and the einsums never copy keys or values G times.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax.numpy as jnp

from .._core import checks
from .._core.dtypes import accumulation_dtype
from .._core.masks import allowed_keys
from .._core.softmax import dropout, masked_softmax


def _add_bias(logits, allowed, bias, logits_shape, acc):
    bias = jnp.asarray(bias)
    checks.check_fits("bias", bias, acc)
    checks.check_broadcastable("bias", bias, logits_shape, "[...,N,T,S]")
    logits = logits + bias
    # -inf in an additive mask (torch's float masks) means "blocked": same rule as mask=False.
    finite = logits > -jnp.inf
    return logits, (finite if allowed is None else allowed & finite)


def attention_core(query, key, value, *, relative_logits: Optional[Callable] = None,
                   relative_values: Optional[Callable] = None, bias=None, mask=None, is_causal=False,
                   key_value_seq_lengths=None, query_positions=None, key_positions=None, scale=None,
                   dropout_rate=0.0, dropout_rng=None, return_weights=False, precision=None, dims=None):
    """The dense attention routine; `relative_*` add the position terms (see module docstring).

    relative_logits(query) -> [...,N,T,S] (unscaled); relative_values(weights) -> [...,T,N,Hv].
    dims: checks.check_qkv's result when the caller has already checked query/key/value.
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    batch, T, S, N, K, H, Hv = checks.check_qkv(query, key, value) if dims is None else dims
    G = N // K
    acc = accumulation_dtype(query.dtype)
    scale = H ** -0.5 if scale is None else scale
    logits_shape = (*batch, N, T, S)

    q = query.reshape(*query.shape[:-2], K, G, H)
    logits = jnp.einsum("...tkgh,...skh->...kgts", q, key, precision=precision, preferred_element_type=acc)
    logits = logits.reshape(*logits.shape[:-4], N, T, S)
    if relative_logits is not None:
        logits = logits + relative_logits(query)
    logits = logits * jnp.asarray(scale, acc)

    allowed = allowed_keys(logits_shape, mask=mask, is_causal=is_causal,
                           key_value_seq_lengths=key_value_seq_lengths,
                           query_positions=query_positions, key_positions=key_positions)
    if bias is not None:
        logits, allowed = _add_bias(logits, allowed, bias, logits_shape, acc)

    weights = masked_softmax(logits, allowed)
    weights = dropout(weights, dropout_rate, dropout_rng)

    p = weights.astype(value.dtype).reshape(*weights.shape[:-3], K, G, T, S)
    out = jnp.einsum("...kgts,...skh->...tkgh", p, value, precision=precision, preferred_element_type=acc)
    out = out.reshape(*out.shape[:-3], N, Hv)
    if relative_values is not None:
        out = out + relative_values(weights)
    out = out.astype(value.dtype)
    return (out, weights.astype(query.dtype)) if return_weights else out
