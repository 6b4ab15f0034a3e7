"""Independent float64 references: the attention formula as plain loops over numpy arrays.

Nothing here calls jaxattn or torchref; it is the formula of DESIGN.md written the slowest obvious way.
"""

import numpy as np


def attention_loop(q, k, v, *, rel_key=None, rel_value=None, mask=None, bias=None, is_causal=False,
                   lengths=None, query_pos=None, key_pos=None, scale=None):
    """q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv]; rel_* [T,S,N,*]; mask/bias [B,N,T,S]; lengths [B]."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, T, N, H = q.shape
    S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
    G = N // K
    scale = H ** -0.5 if scale is None else scale
    if query_pos is None:
        query_pos = np.arange(T) + (S - T)
    if key_pos is None:
        key_pos = np.arange(S)
    out = np.zeros((B, T, N, Hv))
    weights = np.zeros((B, N, T, S))
    for b in range(B):
        for n in range(N):
            kv = n // G
            for t in range(T):
                logits = np.empty(S)
                ok = np.ones(S, bool)
                for s in range(S):
                    key_vec = k[b, s, kv] + (0 if rel_key is None else rel_key[t, s, n])
                    logits[s] = scale * float(q[b, t, n] @ key_vec)
                    if bias is not None:
                        logits[s] += bias[b, n, t, s]
                    if mask is not None and not mask[b, n, t, s]:
                        ok[s] = False
                    if is_causal and key_pos[s] > query_pos[t]:
                        ok[s] = False
                    if lengths is not None and s >= lengths[b]:
                        ok[s] = False
                    if logits[s] == -np.inf:
                        ok[s] = False
                if not ok.any():
                    continue
                e = np.where(ok, np.exp(np.where(ok, logits, 0) - logits[ok].max()), 0.0)
                p = e / e.sum()
                weights[b, n, t] = p
                for s in range(S):
                    val = v[b, s, kv] + (0 if rel_value is None else rel_value[t, s, n])
                    out[b, t, n] += p[s] * val
    return out, weights


def shaw_index_loop(T, S, max_distance, query_pos=None, key_pos=None):
    query_pos = np.arange(T) + (S - T) if query_pos is None else query_pos
    key_pos = np.arange(S) if key_pos is None else key_pos
    idx = np.zeros((T, S), np.int64)
    for t in range(T):
        for s in range(S):
            idx[t, s] = min(max(key_pos[s] - query_pos[t], -max_distance), max_distance) + max_distance
    return idx


def normwise(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def normwise_f64(actual, expected):
    """normwise, insisting both sides really are float64 (guards against a silent float32 fallback)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype == np.float64, (actual.dtype, expected.dtype)
    return normwise(actual, expected)
