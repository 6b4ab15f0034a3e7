"""A second route to multi-head attention on jaxattn params: the plain einsum form of seed 001.

Used by the crosscheck conversion tests next to jaxattn itself, so a mapping bug cannot hide behind a
matching bug in jaxattn. ``xp`` is numpy or jax.numpy (the latter for gradients). Batch-first, one batch axis.
"""


def einsum_mha(params, query, key, value, *, mask=None, bias=None, add_zero_attn=False, rel_index=None, xp):
    """query [B,T,Eq], key [B,S,Ek], value [B,S,Ev] -> (out [B,T,Eo], weights [B,N,T,S'])).

    Extra key columns follow torch: bias_kv first, then the zero key; they are always attendable.
    mask (True = may attend) / bias cover the S real keys and broadcast to [B,N,T,S].
    rel_index [T,S] (Shaw bucket of each query/key pair) selects rows of params["relative"] tables.
    """

    def dense(name, x, spec):
        y = xp.einsum(spec, x, params[name]["kernel"])
        return y + params[name]["bias"] if "bias" in params[name] else y

    q = dense("query", query, "bte,enh->btnh")
    k = dense("key", key, "bse,ekh->bskh")
    v = dense("value", value, "bse,ekh->bskh")
    (B, T, N, H), S = q.shape, k.shape[1]
    extras = []
    if "bias_kv" in params:
        extras.append((params["bias_kv"]["key"], params["bias_kv"]["value"]))
    if add_zero_attn:
        extras.append((xp.zeros(k.shape[2:], k.dtype), xp.zeros(v.shape[2:], v.dtype)))
    for extra_k, extra_v in extras:
        k = xp.concatenate([k, xp.broadcast_to(extra_k, (B, 1, *extra_k.shape))], axis=1)
        v = xp.concatenate([v, xp.broadcast_to(extra_v, (B, 1, *extra_v.shape))], axis=1)
    group = N // k.shape[2]  # query head n uses key/value head n // group
    k, v = xp.repeat(k, group, axis=2), xp.repeat(v, group, axis=2)

    logits = xp.einsum("btnh,bsnh->bnts", q, k)
    rel = params.get("relative", {})
    if "key" in rel:
        table = rel["key"] if rel["key"].ndim == 3 else rel["key"][:, None, :]
        logits = logits + xp.einsum("btnh,tsnh->bnts", q, xp.broadcast_to(table[rel_index], (T, S, N, H)))
    logits = logits * H**-0.5
    pad = [(0, 0)] * 3 + [(0, len(extras))]
    if bias is not None:
        logits = logits + xp.pad(xp.broadcast_to(bias, (B, N, T, S)), pad)
    if mask is not None:
        logits = xp.where(xp.pad(xp.broadcast_to(mask, (B, N, T, S)), pad, constant_values=True), logits, -xp.inf)
    weights = xp.exp(logits - logits.max(axis=-1, keepdims=True))
    weights = weights / weights.sum(axis=-1, keepdims=True)

    z = xp.einsum("bnts,bsnh->btnh", weights, v)
    if "value" in rel:
        table = rel["value"] if rel["value"].ndim == 3 else rel["value"][:, None, :]
        Hv = table.shape[-1]
        z = z + xp.einsum("bnts,tsnh->btnh", weights, xp.broadcast_to(table[rel_index], (T, S, N, Hv)))
    out = dense("out", z, "btnh,nho->bto")
    return out, weights
