"""Scaled dot-product attention and the seed-000 relative form, around one shared core.

    logits[...,n,t,s] = scale * (q[t,n] . k[s,kv(n)] + relative_logits[...,n,t,s]) + bias
    p = masked_softmax(logits, allowed)            (float32 or wider)
    out[...,t,n]      = sum_s p[...,n,t,s] v[s,kv(n)] + relative_values(p)[...,t,n]

Grouped-query heads: query head n uses key/value head kv(n) = n // G with G = N // K, so the query's head
axis is viewed as [K,G] (head n = k*G + g) and the einsums never copy keys or values G times.
"""

from __future__ import annotations

from typing import Callable, Optional

import jax.numpy as jnp

from . import _checks
from ._masking import allowed_keys, dropout, masked_softmax
from ._pairwise import pair_logits, pair_values


def compute_dtype(dtype):
    """Half-precision inputs get float32 logits and softmax; float32/float64 keep their own."""
    return jnp.promote_types(dtype, jnp.float32)


def check_qkv(query, key, value):
    """Validate [...,T,N,H], [...,S,K,H], [...,S,K,Hv]; return (batch, T, S, N, K, H, Hv)."""
    _checks.check_min_rank("query", query, 3, "[...,T,N,H]")
    _checks.check_min_rank("key", key, 3, "[...,S,K,H]")
    _checks.check_min_rank("value", value, 3, "[...,S,K,Hv]")
    *q_batch, T, N, H = query.shape
    *k_batch, S, K, Hk = key.shape
    *v_batch, Sv, Kv, Hv = value.shape
    if Hk != H:
        _checks.fail("key", f"head dim H={H} as in query [...,T,N,H]={_checks.shape_str(query.shape)}",
                     f"shape {_checks.shape_str(key.shape)}")
    if (Sv, Kv) != (S, K):
        _checks.fail("value", f"shape [...,{S},{K},Hv] (S and K as in key {_checks.shape_str(key.shape)})",
                     f"shape {_checks.shape_str(value.shape)}")
    if N % K != 0:
        _checks.fail("key", f"a number of heads K dividing the query's N={N}", f"K={K} in shape "
                     f"{_checks.shape_str(key.shape)}")
    _checks.check_same_dtype(("query", "key", "value"), (query, key, value))
    _checks.check_float("query", query)
    batch = _checks.broadcast_batch(("query", "key", "value"), (q_batch, k_batch, v_batch))
    return batch, T, S, N, K, H, Hv


def attention_core(query, key, value, *, relative_logits: Optional[Callable] = None,
                   relative_values: Optional[Callable] = None, bias=None, mask=None, is_causal=False,
                   key_value_seq_lengths=None, query_positions=None, key_positions=None, scale=None,
                   dropout_rate=0.0, dropout_rng=None, return_weights=False, precision=None):
    """The one attention routine; `relative_*` add the position terms (see module docstring).

    relative_logits(query) -> [...,N,T,S] (unscaled); relative_values(weights) -> [...,T,N,Hv].
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    batch, T, S, N, K, H, Hv = check_qkv(query, key, value)
    G = N // K
    acc = compute_dtype(query.dtype)
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
        bias = jnp.asarray(bias)
        _checks.check_fits("bias", bias, acc)
        _checks.check_broadcastable("bias", bias, logits_shape, "[...,N,T,S]")
        logits = logits + bias
        # -inf in an additive mask (torch's float masks) means "blocked": same rule as mask=False.
        finite = logits > -jnp.inf
        allowed = finite if allowed is None else allowed & finite

    weights = masked_softmax(logits, allowed)
    weights = dropout(weights, dropout_rate, dropout_rng)

    p = weights.astype(value.dtype).reshape(*weights.shape[:-3], K, G, T, S)
    out = jnp.einsum("...kgts,...skh->...tkgh", p, value, precision=precision, preferred_element_type=acc)
    out = out.reshape(*out.shape[:-3], N, Hv)
    if relative_values is not None:
        out = out + relative_values(weights)
    out = out.astype(value.dtype)
    return (out, weights.astype(query.dtype)) if return_weights else out


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
        would take >= 16 MiB (jaxattn._blockwise.use_blockwise).
      block_size: blockwise tile, int or (query_block, key_block); default: see jaxattn._blockwise.

    Returns [...,T,N,Hv] (or (out, weights)). A query with no allowed key gets zeros.
    """
    from . import _blockwise  # imported here because _blockwise builds on this module

    if _blockwise.use_blockwise(implementation, query, key, bias=bias, mask=mask, dropout_rate=dropout_rate,
                                return_weights=return_weights):
        return _blockwise.blockwise_attention(
            query, key, value, bias=bias, mask=mask, is_causal=is_causal,
            key_value_seq_lengths=key_value_seq_lengths, query_positions=query_positions,
            key_positions=key_positions, scale=scale, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
            return_weights=return_weights, precision=precision, block_size=block_size)
    return attention_core(query, key, value, bias=bias, mask=mask, is_causal=is_causal,
                          key_value_seq_lengths=key_value_seq_lengths, query_positions=query_positions,
                          key_positions=key_positions, scale=scale, dropout_rate=dropout_rate,
                          dropout_rng=dropout_rng, return_weights=return_weights, precision=precision)


def _per_pair_table(name, table, T, S, N, head_dim, layout, query):
    table = jnp.asarray(table)
    _checks.check_rank(name, table, 4, layout)
    if table.shape[2] not in (1, N) or tuple(table.shape[:2]) != (T, S) or table.shape[3] != head_dim:
        _checks.fail(name, f"shape [{T},{S},{N} or 1,{head_dim}] ({layout})",
                     f"shape {_checks.shape_str(table.shape)}")
    _checks.check_fits(name, table, compute_dtype(query.dtype))
    return table


def relative_attention(query, key, value, rel_key=None, rel_value=None, **options):
    """Attention with per-pair relative terms (Shaw et al.; the seed-000 formula).

        logits[n,t,s] = scale * q[t,n] . (k[s] + A^K[t,s,n]);   out[t,n] = sum_s p[n,t,s] (v[s] + A^V[t,s,n])

    rel_key A^K: [T,S,N,H] ([T,S,1,H] shares it over heads); rel_value A^V: [T,S,N,Hv] (or [T,S,1,Hv]).
    Keywords as dot_product_attention. The relative einsums batch over (t, n) and contract h (or s),
    so no tensor ever holds both the batch dims and [T,S,...,H] (the seed answer's [B,S,S,H,D]).
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    _, T, S, N, _, H, Hv = check_qkv(query, key, value)
    precision = options.get("precision")
    acc = compute_dtype(query.dtype)
    rel_logits = rel_values = None
    if rel_key is not None:
        a_k = _per_pair_table("rel_key", rel_key, T, S, N, H, "A^K [T,S,N,H]", query)
        key_spec = "...tnh,tsnh->...nts" if a_k.shape[2] == N else "...tnh,tsh->...nts"
        a_k = a_k if a_k.shape[2] == N else a_k[:, :, 0]
        rel_logits = lambda q: jnp.einsum(key_spec, q, a_k, precision=precision, preferred_element_type=acc)
        if a_k.ndim == 4:  # per head: fused, no [T,N,S,H] copy of the table (see _pairwise)
            rel_logits = lambda q: jnp.moveaxis(pair_logits(q, a_k, precision), -1, -3)
    if rel_value is not None:
        a_v = _per_pair_table("rel_value", rel_value, T, S, N, Hv, "A^V [T,S,N,Hv]", query)
        value_spec = "...nts,tsnh->...tnh" if a_v.shape[2] == N else "...nts,tsh->...tnh"
        a_v = a_v if a_v.shape[2] == N else a_v[:, :, 0]
        rel_values = lambda p: jnp.einsum(value_spec, p, a_v.astype(acc), precision=precision)
        if a_v.ndim == 4:
            rel_values = lambda p: pair_values(jnp.moveaxis(p, -3, -1), a_v, precision)
    return attention_core(query, key, value, relative_logits=rel_logits, relative_values=rel_values, **options)
