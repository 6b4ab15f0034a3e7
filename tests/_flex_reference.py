"""Independent references for segments, windows, chunks, softcap, sinks, score_mod and mask_mod.

Nothing here calls jaxattn. `allowed_loop` decides every (b, n, t, s) pair with plain Python loops over
the rules of DESIGN.md part 2; `attention_reference` is the obvious full-grid formula in jax.numpy (so
jax.grad gives reference gradients), sinks as an extra softmax column with no value; `attention_loop`
is the same formula as numpy loops (float64), which the tests use to check the jnp formula itself.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


def default_positions(T, S, query_pos=None, key_pos=None):
    query_pos = np.arange(T) + (S - T) if query_pos is None else np.asarray(query_pos)
    key_pos = np.arange(S) if key_pos is None else np.asarray(key_pos)
    return query_pos, key_pos


def allowed_loop(B, N, T, S, *, is_causal=False, lengths=None, query_pos=None, key_pos=None,
                 query_segments=None, key_segments=None, window=None, chunk_size=None, mask_mod=None):
    """bool [B,N,T,S]; positions [T]/[S] or [B,T]/[B,S]; segments [B,T]/[B,S]; mask_mod(b, n, t, s) on ints."""
    qp, kp = default_positions(T, S, query_pos, key_pos)
    qp, kp = np.broadcast_to(qp, (B, T)), np.broadcast_to(kp, (B, S))
    ok = np.ones((B, N, T, S), bool)
    for b in range(B):
        for n in range(N):
            for t in range(T):
                for s in range(S):
                    i, j = int(qp[b, t]), int(kp[b, s])
                    allowed = True
                    if is_causal and j > i:
                        allowed = False
                    if lengths is not None and s >= lengths[b]:
                        allowed = False
                    if query_segments is not None and query_segments[b, t] != key_segments[b, s]:
                        allowed = False
                    if window is not None:
                        left, right = window
                        if left is not None and j < i - left:
                            allowed = False
                        if right is not None and j > i + right:
                            allowed = False
                    if chunk_size is not None and i // chunk_size != j // chunk_size:
                        allowed = False
                    if mask_mod is not None and not bool(mask_mod(b, n, i, j)):
                        allowed = False
                    ok[b, n, t, s] = allowed
    return ok


def index_grids(B, N, T, S, query_pos=None, key_pos=None):
    """b, n, t, s as broadcastable int arrays [B,1,1,1], [1,N,1,1], [B|1,1,T,1], [B|1,1,1,S] (absolute t, s)."""
    qp, kp = default_positions(T, S, query_pos, key_pos)
    qp, kp = np.asarray(qp), np.asarray(kp)
    b = np.arange(B)[:, None, None, None]
    n = np.arange(N)[None, :, None, None]
    t = (qp[:, None, :, None] if qp.ndim == 2 else qp[None, None, :, None])
    s = (kp[:, None, None, :] if kp.ndim == 2 else kp[None, None, None, :])
    return tuple(jnp.asarray(x, jnp.int32) for x in (b, n, t, s))


def attention_reference(q, k, v, allowed, *, scale=None, softcap=None, bias=None, sinks=None, score_mod=None,
                        rel_logits=None, query_pos=None, key_pos=None):
    """q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv]; allowed bool [B,N,T,S]; bias [B,N,T,S]; sinks [N] or [B,N];
    rel_logits [B,N,T,S] (unscaled, added to q.k); score_mod(score, b, n, t, s) on broadcast index grids.
    Order: scale * (q.k + rel) -> softcap -> + bias -> score_mod -> mask -> softmax with the sink column."""
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    scale = H ** -0.5 if scale is None else scale
    x = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest")
    if rel_logits is not None:
        x = x + rel_logits
    x = x * scale
    if softcap is not None:
        x = softcap * jnp.tanh(x / softcap)
    if bias is not None:
        x = x + bias
    if score_mod is not None:
        x = score_mod(x, *index_grids(B, N, T, S, query_pos, key_pos))
    allowed = jnp.asarray(allowed)
    x = jnp.where(allowed, x, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(jnp.asarray(sinks).reshape(-1 if jnp.ndim(sinks) == 2 else 1, N)[:, :, None, None],
                                (B, N, T, 1))
        x = jnp.concatenate([x, sink], axis=-1)
    row_max = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)
    e = jnp.exp(x - row_max)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = (e / jnp.where(total == 0, 1, total))[..., :S]
    return jnp.einsum("bnts,bsnh->btnh", p, v, precision="highest")


def attention_loop(q, k, v, allowed, *, scale=None, softcap=None, sinks=None):
    """The same formula, numpy float64 loops (forward only)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
    G = N // K
    scale = H ** -0.5 if scale is None else scale
    sinks = None if sinks is None else np.broadcast_to(np.asarray(sinks, np.float64), (B, N))
    out = np.zeros((B, T, N, Hv))
    for b in range(B):
        for n in range(N):
            for t in range(T):
                logits, weights = [], []
                for s in range(S):
                    if not allowed[b, n, t, s]:
                        continue
                    x = scale * float(q[b, t, n] @ k[b, s, n // G])
                    if softcap is not None:
                        x = softcap * math.tanh(x / softcap)
                    logits.append(x)
                    weights.append(v[b, s, n // G])
                if not logits:
                    continue
                every = logits + ([sinks[b, n]] if sinks is not None else [])
                m = max(every)
                denom = sum(math.exp(x - m) for x in every)
                for x, val in zip(logits, weights):
                    out[b, t, n] += math.exp(x - m) / denom * val
    return out
