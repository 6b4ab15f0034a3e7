"""The dense engine: one [...,N,T,S] logits array, the masked softmax, and optional relative terms.

    logits[...,n,t,s] = softcap(scale * (q[t,n] . k[s,kv(n)] + relative_logits[...,n,t,s])) + bias
    logits            = score_mod(logits, b, n, t, s)                          (flex_attention)
    p = masked_softmax(logits, allowed, sinks)     (float32 or wider)
    out[...,t,n]      = sum_s p[...,n,t,s] v[s,kv(n)] + relative_values(p)[...,t,n]

Grouped-query heads: query head n uses key/value head kv(n) = n // G with G = N // K, so the query's head
axis is viewed as [K,G] (head n = k*G + g) and the einsums never copy keys or values G times.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax.numpy as jnp
import numpy as np

from .._core import block_mask as block_masks, checks, mods
from .._core.call import AttentionCall
from .._core.dtypes import accumulation_dtype
from .._core.masks import allowed_keys
from .._core.positions import positions
from .._core.softmax import dropout, masked_logsumexp, masked_softmax


def _add_bias(logits, allowed, bias, logits_shape, acc_dtype):
    bias = jnp.asarray(bias)
    checks.check_fits("bias", bias, acc_dtype)
    checks.check_broadcastable("bias", bias, logits_shape, "[...,N,T,S]")
    logits = logits + bias
    # -inf in an additive mask (torch's float masks) means "blocked": same rule as mask=False.
    finite = jnp.isfinite(logits) | (logits > 0)  # not -inf (no -inf literal: eager jax_debug_infs)
    return logits, (finite if allowed is None else allowed & finite)


def flat_grid(batch, N, T, S, query_positions, key_positions):
    """(b [B], n [N], t [T] or [B,T], s [S] or [B,S]): the element indices that score_mod / mask_mod see,
    over the flattened batch B = prod(batch), at absolute positions."""
    B = int(np.prod(batch, dtype=np.int64))
    q_pos, k_pos = positions(T, S, query_positions, key_positions)

    def flat(pos, length):
        return pos if pos.ndim == 1 else jnp.broadcast_to(pos, (*batch, length)).reshape(B, length)

    return jnp.arange(B, dtype=jnp.int32), jnp.arange(N, dtype=jnp.int32), flat(q_pos, T), flat(k_pos, S)


def _unflatten(grid, batch):
    """[B|1, N|1, T, S] over the flattened batch -> [*batch or 1s, N|1, T, S]."""
    if not batch:
        return grid[0]
    lead = tuple(batch) if grid.shape[0] != 1 else (1,) * len(batch)
    return grid.reshape(*lead, *grid.shape[1:])


class _Programmable:
    """The programmable options of one dense call, checked against the shapes (jaxattn._core.mods)."""

    def __init__(self, call: AttentionCall, batch, N, T, S, acc_dtype):
        self.q_seg, self.k_seg = mods.check_segment_ids(call.query_segment_ids, call.key_segment_ids, batch, T, S)
        self.sinks = mods.check_sinks(call.sinks, batch, N, acc_dtype)
        mask_mod, block_mask = call.mask_mod, call.block_mask
        if block_mask is not None:  # the BlockMask's own mask_mod applies (block_masks.resolve)
            block_masks.check_block_mask(block_mask, int(np.prod(batch, dtype=np.int64)), N, T, S)
            mask_mod, block_mask = block_masks.resolve(mask_mod, block_mask)
        self.score_fn = mods.element_function("score_mod", call.score_mod, acc_dtype)
        self.mask_fn = mods.element_function("mask_mod", mask_mod)
        self.block_mask = block_mask
        with_grid = self.score_fn is not None or self.mask_fn is not None
        self.grid = flat_grid(batch, N, T, S, call.query_positions, call.key_positions) if with_grid else None
        self.batch, self.shape = batch, (*batch, N, T, S)

    def score(self, logits):
        """score_mod over the whole grid (identity without one)."""
        if self.score_fn is None:
            return logits
        B = self.grid[0].shape[0]
        flat = jnp.broadcast_to(logits, self.shape).reshape(B, *self.shape[-3:])
        return mods.on_grid(self.score_fn.fn, self.score_fn.consts, *self.grid, score=flat).reshape(self.shape)

    def allowed(self, allowed):
        """allowed & mask_mod, read through the BlockMask when there is one."""
        if self.mask_fn is None and self.block_mask is None:
            return allowed
        by_mod = None if self.mask_fn is None else mods.on_grid(self.mask_fn.fn, self.mask_fn.consts, *self.grid)
        if self.block_mask is not None:
            by_mod = block_masks.dense_allowed(self.block_mask, by_mod)
        by_mod = _unflatten(by_mod, self.batch)
        return by_mod if allowed is None else allowed & by_mod


def attention_core(
    call: AttentionCall,
    query,
    key,
    value,
    *,
    relative_logits: Optional[Callable] = None,
    relative_values: Optional[Callable] = None,
    dims=None,
):
    """The dense attention routine for `call` (every option); `relative_*` add the position terms of a
    scheme (see module docstring): the call's own Shaw tables and position hook are the tiled engine's and
    the kernels'; a scheme hands the dense engine their terms as these two functions.

    relative_logits(query) -> [...,N,T,S] (unscaled); relative_values(weights) -> [...,T,N,Hv].
    dims: checks.check_qkv's result when the caller has already checked query/key/value.
    Returns out, or (out, weights) / (out, lse) / (out, weights, lse) with return_weights / return_lse
    (lse [...,N,T]: the log of the softmax's normaliser, in the accumulation dtype).
    """
    if call.has_tables or call.position_bias is not None:
        raise TypeError("attention_core takes a scheme's terms as relative_logits / relative_values")
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    batch, T, S, N, K, H, Hv = checks.check_qkv(query, key, value) if dims is None else dims
    G = N // K
    acc_dtype = accumulation_dtype(query.dtype)
    scale = H**-0.5 if call.scale is None else call.scale
    logits_shape = (*batch, N, T, S)
    prog = _Programmable(call, batch, N, T, S, acc_dtype)

    q = query.reshape(*query.shape[:-2], K, G, H)
    logits = jnp.einsum("...tkgh,...skh->...kgts", q, key, precision=call.precision, preferred_element_type=acc_dtype)
    logits = logits.reshape(*logits.shape[:-4], N, T, S)
    if relative_logits is not None:
        logits = logits + relative_logits(query)
    logits = mods.softcap(logits * jnp.asarray(scale, acc_dtype), call.logit_softcap)

    allowed = allowed_keys(
        logits_shape,
        mask=call.mask,
        is_causal=call.is_causal,
        key_value_seq_lengths=call.key_value_seq_lengths,
        query_positions=call.query_positions,
        key_positions=call.key_positions,
        window=call.window,
        chunk_size=call.chunk_size,
        query_segments=prog.q_seg,
        key_segments=prog.k_seg,
    )
    if call.bias is not None:
        logits, allowed = _add_bias(logits, allowed, call.bias, logits_shape, acc_dtype)
    logits = prog.score(logits)
    allowed = prog.allowed(allowed)

    sinks = None if prog.sinks is None else prog.sinks[..., :, None, None]
    lse = jnp.broadcast_to(masked_logsumexp(logits, allowed, sinks), (*batch, N, T)) if call.return_lse else None
    weights = masked_softmax(logits, allowed, sinks)
    weights = dropout(weights, call.dropout_rate, call.dropout_rng, call.broadcast_dropout)

    p = weights.astype(value.dtype).reshape(*weights.shape[:-3], K, G, T, S)
    out = jnp.einsum("...kgts,...skh->...tkgh", p, value, precision=call.precision, preferred_element_type=acc_dtype)
    out = out.reshape(*out.shape[:-3], N, Hv)
    if relative_values is not None:
        out = out + relative_values(weights)
    out = (out.astype(value.dtype),) + ((weights.astype(query.dtype),) if call.return_weights else ())
    out = out + ((lse,) if call.return_lse else ())
    return out if len(out) > 1 else out[0]
