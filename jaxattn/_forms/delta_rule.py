"""Gated delta-rule linear attention (Gated DeltaNet; Qwen3-Next's linear-attention layers).

Per value head n, token by token, with a state S [H,Hv] (key features x value features):

    S <- exp(g_t) S                                   decay (g_t <= 0 in practice)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T           delta rule: write only what S does not yet predict
    o_t = S^T (scale q_t)                             scale = H ** -0.5 by default

Value head n reads query/key head n // (N // K) (transformers' repeat_interleave). Below, that grouping is
kept as axes [K,G] with G = N // K, so the key Gram matrices are computed once per key head, not per value head.

Chunked parallel form (training, prefill): split T into chunks of C tokens. Within a chunk, with the cumulative
log decay gamma_i = g_1 + ... + g_i and the state S0 at the chunk's start, the updates u_i = beta_i (v_i - ...)
satisfy the unit lower-triangular system (the UT / WY transform)

    (I + A) U = beta V - diag(beta exp(gamma)) K S0,      A_ij = beta_i exp(gamma_i - gamma_j) k_i . k_j  (j < i)

so U = W_v - W_k S0 with W_v = (I + A)^-1 (beta V), W_k = (I + A)^-1 (beta exp(gamma) K): two triangular solves
per chunk, independent of the state (all chunks at once). Then, per chunk in a lax.scan:

    o_i  = exp(gamma_i) S0^T q_i + sum_{j<=i} exp(gamma_i - gamma_j) (q_i . k_j) u_j
    S_C  = exp(gamma_C) S0 + sum_j exp(gamma_C - gamma_j) k_j u_j^T

Memory is O(T x C) (per-chunk [C,C] matrices), never O(T^2). T that is not a multiple of C is padded with
tokens of g = 0 and beta = 0 (and zero q, k, v), which leave the state unchanged. Half-precision inputs are
computed in float32 and the output cast back (the state keeps the wide dtype).

Also here: the causal depthwise conv1d and the gated RMS output norm of the Qwen3-Next family, with the
decode-time state of the conv.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from .._core import checks
from .._core.checks import shape_str
from .._core.dtypes import accumulation_dtype
from .._core.eager import compiled_when_eager
from .._core.norms import rms_normalize

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Float

DEFAULT_CHUNK_SIZE = 64
IMPLEMENTATIONS = (None, "chunked", "recurrent")


def _check_inputs(query, key, value, g, beta, initial_state):
    """Shapes of query [...,T,K,H], key [...,T,K,H], value [...,T,N,Hv], g/beta [...,T,N], state [...,N,H,Hv]."""
    checks.check_min_rank("query", query, 3, "[...,T,K,H]")
    checks.check_min_rank("key", key, 3, "[...,T,K,H]")
    checks.check_min_rank("value", value, 3, "[...,T,N,Hv]")
    *_, T, K, H = query.shape
    *_, _, N, Hv = value.shape
    if key.shape[-3:] != query.shape[-3:]:
        checks.fail(
            "key",
            f"shape [...,{T},{K},{H}] (as query [...,T,K,H]={shape_str(query.shape)})",
            f"shape {shape_str(key.shape)}",
        )
    if value.shape[-3] != T:
        checks.fail("value", f"shape [...,{T},N,Hv] (T={T} as in query)", f"shape {shape_str(value.shape)}")
    if N % K != 0:
        checks.fail(
            "value",
            f"a number of value heads N that the K={K} query/key heads divide",
            f"N={N} in shape {shape_str(value.shape)}",
        )
    for name, x in (("g", g), ("beta", beta)):
        checks.check_min_rank(name, x, 2, "[...,T,N]")
        if x.shape[-2:] != (T, N):
            checks.fail(
                name,
                f"shape [...,{T},{N}] ([...,T,N] as value {shape_str(value.shape)})",
                f"shape {shape_str(x.shape)}",
            )
    checks.check_same_dtype(("query", "key", "value"), (query, key, value))
    for name, x in (("query", query), ("g", g), ("beta", beta)):
        checks.check_float(name, x)
    shapes = [query.shape[:-3], key.shape[:-3], value.shape[:-3], g.shape[:-2], beta.shape[:-2]]
    names = ["query", "key", "value", "g", "beta"]
    if initial_state is not None:
        checks.check_min_rank("initial_state", initial_state, 3, "[...,N,H,Hv]")
        if initial_state.shape[-3:] != (N, H, Hv):
            checks.fail(
                "initial_state",
                f"shape [...,{N},{H},{Hv}] ([...,N,H,Hv] for value "
                f"{shape_str(value.shape)} and query {shape_str(query.shape)})",
                f"shape {shape_str(initial_state.shape)}",
            )
        checks.check_float("initial_state", initial_state)
        shapes.append(initial_state.shape[:-3])
        names.append("initial_state")
    batch = checks.broadcast_batch(names, shapes)
    return batch, T, K, N // K, H, Hv


def _scale(scale, H):
    return H**-0.5 if scale is None else scale


def _prepare(query, key, value, g, beta, initial_state, scale):
    """Broadcast to one batch shape, group value heads as [K,G], cast to the accumulation dtype."""
    batch, T, K, G, H, Hv = _check_inputs(query, key, value, g, beta, initial_state)
    acc_dtype = accumulation_dtype(query.dtype)
    q = jnp.broadcast_to(query, batch + query.shape[-3:]).astype(acc_dtype) * _scale(scale, H)
    k = jnp.broadcast_to(key, batch + key.shape[-3:]).astype(acc_dtype)
    v = jnp.broadcast_to(value, batch + value.shape[-3:]).astype(acc_dtype).reshape(*batch, T, K, G, Hv)
    g, beta = (jnp.broadcast_to(x, batch + x.shape[-2:]).astype(acc_dtype).reshape(*batch, T, K, G) for x in (g, beta))
    if initial_state is None:
        state = jnp.zeros((*batch, K, G, H, Hv), acc_dtype)
    else:
        state = jnp.broadcast_to(initial_state, batch + initial_state.shape[-3:]).astype(acc_dtype)
        state = state.reshape(*batch, K, G, H, Hv)
    return q, k, v, g, beta, state


def _step(state, q, k, v, g, beta):
    """One token: state [...,K,G,H,Hv], q/k [...,K,H], v [...,K,G,Hv], g/beta [...,K,G] -> (state, o [...,K,G,Hv])."""
    state = jnp.exp(g)[..., None, None] * state
    predicted = jnp.einsum("...kh,...kghv->...kgv", k, state)
    update = beta[..., None] * (v - predicted)
    state = state + jnp.einsum("...kh,...kgv->...kghv", k, update)
    return state, jnp.einsum("...kh,...kghv->...kgv", q, state)


def _recurrent(q, k, v, g, beta, state):
    """The recurrence as a lax.scan over T, on the grouped layout of _prepare."""
    n = q.ndim - 3  # batch rank
    to_front = lambda x: jnp.moveaxis(x, n, 0)  # the scan runs over T
    state, out = jax.lax.scan(lambda s, xs: _step(s, *xs), state, tuple(map(to_front, (q, k, v, g, beta))))
    return jnp.moveaxis(out, 0, n), state


def _unit_lower_inverse(A):
    """(I + A)^-1 for strictly lower triangular A [...,C,C], by forward substitution: row i of the inverse is
    e_i - sum_{j<i} A_ij (row j). A loop of C batched vector-matrix products, no LAPACK call (two concurrent
    LAPACK triangular solves of chunk-sized batches deadlock XLA's CPU runtime)."""
    C = A.shape[-1]

    def row(i, M):  # M = inverse - I; rows < i are final, row i still holds -A_i
        r = M[..., i, :]
        return M.at[..., i, :].set(r + jnp.einsum("...j,...jc->...c", r, M))

    return jax.lax.fori_loop(1, C, row, -A) + jnp.eye(C, dtype=A.dtype)


@jax.custom_vjp
def unit_lower_solve(A, B):
    """X = (I + A)^-1 B for strictly lower triangular A [...,C,C], B [...,C,F] (the UT transform's solve).
    Its gradient is written out (dB = (I + A)^-T dX, dA = -dB X^T below the diagonal) so that the backward
    pass keeps one [C,C] inverse per system instead of the loop's C intermediate ones: memory O(T x C)."""
    return _unit_lower_inverse(A) @ B


def _solve_forward(A, B):
    inverse = _unit_lower_inverse(A)
    X = inverse @ B
    return X, (inverse, X)


def _solve_backward(residuals, dX):
    inverse, X = residuals
    dB = jnp.swapaxes(inverse, -1, -2) @ dX
    return jnp.tril(-dB @ jnp.swapaxes(X, -1, -2), -1), dB


unit_lower_solve.defvjp(_solve_forward, _solve_backward)


def _chunked(q, k, v, g, beta, state, C):
    """The chunked parallel form on the grouped layout of _prepare (see the module docstring)."""
    *batch, T, K, G, Hv = v.shape
    pad = -T % C
    if pad:  # padding tokens: g = 0, beta = 0 keep the state; their outputs are dropped
        q, k, v, g, beta = (
            jnp.pad(x, [(0, 0)] * len(batch) + [(0, pad)] + [(0, 0)] * (x.ndim - len(batch) - 1))
            for x in (q, k, v, g, beta)
        )
    n = len(batch)
    # [...,T,...] -> [nC,...,C,...]: the chunk index leads (the scan's axis)
    chunks = lambda x: jnp.moveaxis(x.reshape(*batch, -1, C, *x.shape[n + 1 :]), n, 0)
    q, k, v, g, beta = map(chunks, (q, k, v, g, beta))
    gamma = jnp.cumsum(g, axis=n + 1)  # [nC,...,C,K,G]: cumulative log decay within each chunk
    i = jnp.arange(C)
    lower = i[:, None] >= i[None, :]  # j <= i
    # decay[..,i,j] = exp(gamma_i - gamma_j) for j <= i, else 0 (masked before exp: no overflow)
    diff = gamma[..., :, None, :, :] - gamma[..., None, :, :, :]  # [nC,...,i,j,K,G]
    decay = jnp.exp(jnp.where(lower[:, :, None, None], diff, -jnp.inf))
    kk = jnp.einsum("...ikh,...jkh->...ijk", k, k)[..., None]  # [nC,...,i,j,K,1]: shared by the G value heads
    qk = jnp.einsum("...ikh,...jkh->...ijk", q, k)[..., None]
    strictly = (i[:, None] > i[None, :])[:, :, None, None]
    A = jnp.where(strictly, beta[..., :, None, :, :] * decay * kk, 0)  # [nC,...,i,j,K,G]
    attn = decay * qk  # intra-chunk "attention", j <= i
    # (I + A) W = rhs, unit lower triangular, per (chunk, batch, K, G): move [i,j] to the end
    strict = jnp.moveaxis(A, (n + 1, n + 2), (-2, -1))
    rhs_v = jnp.moveaxis(beta[..., None] * v, n + 1, -2)  # [nC,...,K,G,C,Hv]
    rhs_k = jnp.moveaxis((beta * jnp.exp(gamma))[..., None] * k[..., None, :], n + 1, -2)  # [nC,...,K,G,C,H]
    w = unit_lower_solve(strict, jnp.concatenate([rhs_v, rhs_k], axis=-1))
    w_v, w_k = w[..., :Hv], w[..., Hv:]  # [nC,...,K,G,C,Hv], [nC,...,K,G,C,H]
    q_decayed = jnp.exp(gamma)[..., None] * q[..., None, :]  # [nC,...,C,K,G,H]
    k_to_end = jnp.exp(gamma[..., -1:, :, :] - gamma)[..., None] * k[..., None, :]  # [nC,...,C,K,G,H]
    chunk_decay = jnp.exp(gamma[..., -1, :, :])  # [nC,...,K,G]

    def scan_chunk(s0, xs):
        w_v, w_k, q_decayed, k_to_end, attn, chunk_decay = xs
        u = w_v - jnp.einsum("...kgch,...kghv->...kgcv", w_k, s0)  # the delta-rule updates
        out = jnp.einsum("...ckgh,...kghv->...ckgv", q_decayed, s0) + jnp.einsum("...ijkg,...kgjv->...ikgv", attn, u)
        s1 = chunk_decay[..., None, None] * s0 + jnp.einsum("...ckgh,...kgcv->...kghv", k_to_end, u)
        return s1, out

    state, out = jax.lax.scan(scan_chunk, state, (w_v, w_k, q_decayed, k_to_end, attn, chunk_decay))
    out = jnp.moveaxis(out, 0, n).reshape(*batch, -1, K, G, Hv)  # [...,T+pad,K,G,Hv]
    return out[..., :T, :, :, :], state


@compiled_when_eager
def gated_delta_rule(
    query: Float[ArrayLike, "*#B T K H"],
    key: Float[ArrayLike, "*#B T K H"],
    value: Float[ArrayLike, "*#B T N Hv"],
    g: Float[ArrayLike, "*#B T N"],
    beta: Float[ArrayLike, "*#B T N"],
    *,
    scale=None,
    initial_state: Float[ArrayLike, "*#B N H Hv"] | None = None,
    chunk_size=None,
    return_state=False,
    implementation=None,
) -> Float[Array, "*#B T N Hv"] | tuple[Float[Array, "*#B T N Hv"], Float[Array, "*#B N H Hv"]]:
    """Gated delta-rule linear attention (module docstring has the recurrence).

    query [...,T,K,H], key [...,T,K,H], value [...,T,N,Hv], g [...,T,N] (log decay), beta [...,T,N];
    initial_state [...,N,H,Hv] (default zeros); batch dims broadcast. chunk_size C (default 64) for the
    chunked form; implementation "chunked" (default) or "recurrent" (a scan over tokens; the same numbers).
    No normalisation of q or k inside: callers l2-normalise as their family does.
    Returns out [...,T,N,Hv], or (out, final state [...,N,H,Hv]) with return_state.
    """
    query, key, value, g, beta = map(jnp.asarray, (query, key, value, g, beta))
    initial_state = None if initial_state is None else jnp.asarray(initial_state)
    if implementation not in IMPLEMENTATIONS:
        checks.fail("implementation", f"one of {IMPLEMENTATIONS}", repr(implementation))
    C = checks.static_int("chunk_size", DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size, 1)
    q, k, v, g, beta, state = _prepare(query, key, value, g, beta, initial_state, scale)
    if implementation == "recurrent":
        out, state = _recurrent(q, k, v, g, beta, state)
    else:
        out, state = _chunked(q, k, v, g, beta, state, C)
    *batch, T, K, G, Hv = out.shape
    out = out.reshape(*batch, T, K * G, Hv).astype(value.dtype)
    if return_state:
        return out, state.reshape(*batch, K * G, *state.shape[-2:])
    return out


@compiled_when_eager
def gated_delta_rule_step(
    query: Float[ArrayLike, "*#B K H"],
    key: Float[ArrayLike, "*#B K H"],
    value: Float[ArrayLike, "*#B N Hv"],
    g: Float[ArrayLike, "*#B N"],
    beta: Float[ArrayLike, "*#B N"],
    state: Float[ArrayLike, "*#B N H Hv"],
    *,
    scale=None,
) -> tuple[Float[Array, "*#B N Hv"], Float[Array, "*#B N H Hv"]]:
    """One decode token: query/key [...,K,H], value [...,N,Hv], g/beta [...,N], state [...,N,H,Hv]
    -> (out [...,N,Hv], new state [...,N,H,Hv]): gated_delta_rule on T = 1 with initial_state=state."""
    query, key, value, g, beta, state = map(jnp.asarray, (query, key, value, g, beta, state))
    expand = lambda x, axes=-3: jnp.expand_dims(x, axes)  # add the T axis of one token
    q, k, v, g, beta, s = _prepare(
        expand(query), expand(key), expand(value), expand(g, -2), expand(beta, -2), state, scale
    )
    s, out = _step(s, q[..., 0, :, :], k[..., 0, :, :], v[..., 0, :, :, :], g[..., 0, :, :], beta[..., 0, :, :])
    *batch, K, G, Hv = out.shape
    return out.reshape(*batch, K * G, Hv).astype(value.dtype), s.reshape(*batch, K * G, *s.shape[-2:])


# --- the family's helpers ----------------------------------------------------------------------------------------

ACTIVATIONS = {None: lambda x: x, "silu": jax.nn.silu}


def causal_conv1d(
    x: Float[ArrayLike, "*#B T E"],
    weight: Float[ArrayLike, "E W"],
    bias: Float[ArrayLike, " E"] | None = None,
    *,
    state: Float[ArrayLike, "*#B _W1 E"] | None = None,
    activation="silu",
    return_state=False,
) -> Float[Array, "*#B T E"] | tuple[Float[Array, "*#B T E"], Float[Array, "*#B _W1 E"]]:
    """Causal depthwise convolution over T (Qwen3-Next's short conv on the mixed q/k/v features):

        y[t,e] = act(bias[e] + sum_w weight[e,w] x[t - (W - 1) + w, e])

    x [...,T,E], weight [E,W], bias [E] or None; state [...,W-1,E]: the W - 1 inputs before x (decode;
    default zeros, the start of a sequence). activation "silu" (the family's) or None. Returns y [...,T,E],
    or (y, new state [...,W-1,E]: the last W - 1 inputs) with return_state. Half inputs are computed in float32.
    """
    x, weight = jnp.asarray(x), jnp.asarray(weight)
    checks.check_min_rank("x", x, 2, "[...,T,E]")
    checks.check_rank("weight", weight, 2, "[E,W]")
    *batch, T, E = x.shape
    W = weight.shape[1]
    checks.check_dim("weight", weight, 0, E, f"[E,W] with E={E} as in x {shape_str(x.shape)}")
    if activation not in ACTIVATIONS:
        checks.fail("activation", f"one of {tuple(ACTIVATIONS)}", repr(activation))
    acc_dtype = accumulation_dtype(x.dtype)
    if state is None:
        state = jnp.zeros((*batch, W - 1, E), x.dtype)
    state = jnp.asarray(state)
    checks.check_min_rank("state", state, 2, "[...,W-1,E]")
    if state.shape[-2:] != (W - 1, E):
        checks.fail(
            "state",
            f"shape [...,{W - 1},{E}] ([...,W-1,E] for weight {shape_str(weight.shape)})",
            f"shape {shape_str(state.shape)}",
        )
    batch = tuple(checks.broadcast_batch(("x", "state"), (batch, state.shape[:-2])))
    window = jnp.concatenate(
        [
            jnp.broadcast_to(state, batch + state.shape[-2:]).astype(acc_dtype),
            jnp.broadcast_to(x, batch + x.shape[-2:]).astype(acc_dtype),
        ],
        axis=-2,
    )  # [...,W-1+T,E]
    y = sum(window[..., w : w + T, :] * weight[:, w].astype(acc_dtype) for w in range(W))
    if bias is not None:
        bias = jnp.asarray(bias)
        checks.check_shape("bias", bias, (E,), "[E]")
        y = y + bias.astype(acc_dtype)
    y = ACTIVATIONS[activation](y).astype(x.dtype)
    if return_state:
        return y, window[..., window.shape[-2] - (W - 1) :, :].astype(x.dtype)
    return y


def gated_rms_norm(
    x: Float[ArrayLike, "*#B F"], gate: Float[ArrayLike, "*#B F"], weight: Float[ArrayLike, " F"], *, eps: float = 1e-6
) -> Float[Array, "*#B F"]:
    """Qwen3-Next's gated output norm (Qwen3NextRMSNormGated), over the last axis F:

        weight * x / sqrt(mean(x^2) + eps) * silu(gate)

    x, gate [...,F]; weight [F]. Statistics and gate in float32 or wider; the normalised x is rounded to x's
    dtype before the weight, as transformers does. Returns x's shape and dtype.
    """
    x, gate, weight = map(jnp.asarray, (x, gate, weight))
    checks.check_min_rank("x", x, 1, "[...,F]")
    checks.check_shape("weight", weight, x.shape[-1:], "[F]")
    if gate.shape[-1:] != x.shape[-1:]:
        checks.fail("gate", f"shape [...,{x.shape[-1]}] (as x {shape_str(x.shape)})", f"shape {shape_str(gate.shape)}")
    normed = rms_normalize(x, eps).astype(x.dtype)
    return (weight * normed * jax.nn.silu(gate.astype(accumulation_dtype(x.dtype)))).astype(x.dtype)
