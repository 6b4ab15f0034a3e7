"""The five seed documents (docs/design.md, "Seed cases"), each as the seed's own torch code against jaxattn.

The torch side of every case is the seed's code (the corrected answer where the seed asked a question),
kept in the seed's layout and variable names; the JAX side is the jaxattn way of writing the same thing.
"""

from __future__ import annotations

from crosscheck.catalogue import (
    Const,
    Setup,
    functional,
    normal,
    randomize,
    register_case,
    rng_for,
    to_numpy_tree,
    torch_params,
)


@register_case("seed000", default_run=True)
def seed000() -> Setup:
    """Seed 000: relative attention, X [B,S,N,H], per-head W [N,H,H], A^K/A^V [S,S,N,H] -> z [B,S,N,H]."""
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    import jaxattn

    B, S, N, H = 2, 7, 3, 11  # the seed's B, S, H (heads), D (head dim)
    rng = rng_for("seed000")
    params = {name: normal(rng, (N, H, H), H**-0.5) for name in ("W_Q", "W_K", "W_V")}
    params |= {name: normal(rng, (S, S, N, H)) for name in ("a_K", "a_V")}

    def jax_fn(p, X):
        q, k, v = (jnp.einsum("bsnh,nhe->bsne", X, p[w]) for w in ("W_Q", "W_K", "W_V"))
        # the seed divides by sqrt(d_z) with d_z = D, the per-head dim: jaxattn's default scale H ** -0.5
        return jaxattn.relative_attention(q, k, v, rel_key=p["a_K"], rel_value=p["a_V"])

    def torch_fn(p, X):  # the seed's corrected answer, verbatim but for the dtype of sqrt(d_z)
        B, S, H, D = X.shape
        d_z = D
        W_Q, W_K, W_V, a_K, a_V = p["W_Q"], p["W_K"], p["W_V"], p["a_K"], p["a_V"]
        XW_Q = torch.einsum("bshd,hde->bshe", X, W_Q)
        XW_K = torch.einsum("bshd,hde->bshe", X, W_K)
        e_ij_numerator = (XW_Q.unsqueeze(2) * (XW_K.unsqueeze(1) + a_K)).sum(dim=-1)  # [B, S, S, H]
        # the seed writes dtype=torch.float32 here, which rounds sqrt(D) to float32 in a float64 run
        e_ij = e_ij_numerator / torch.sqrt(torch.tensor(d_z, dtype=X.dtype))
        alpha = F.softmax(e_ij, dim=2)  # [B, S, S, H]
        XW_V = torch.einsum("bshd,hde->bshe", X, W_V)
        return torch.einsum("bijh,bijhd -> bihd", alpha, (XW_V.unsqueeze(1) + a_V))  # [B, S, H, D]

    return Setup(jax_fn, torch_fn, {"X": normal(rng, (B, S, N, H))}, params=params)


@register_case("seed001", default_run=True)
def seed001() -> Setup:
    """Seed 001: einsum multi-head self-attention == torch.nn.MultiheadAttention(bias=False), d=12, n_h=2."""
    import torch

    import jaxattn
    from crosscheck import params_from_torch

    n_b, p, d, n_h = 3, 5, 12, 2
    rng = rng_for("seed001")
    M = randomize(torch.nn.MultiheadAttention(d, n_h, batch_first=True, dropout=0.0, bias=False), rng)
    mha = functional(M, "X", "X", "X", need_weights=False)

    def jax_fn(params, X):
        return jaxattn.multi_head_attention(params, X)

    def torch_fn(params, X):
        Y_torch, _ = mha(params, X=X)
        return Y_torch

    return Setup(
        jax_fn,
        torch_fn,
        {"X": normal(rng, (n_b, p, d))},
        params=to_numpy_tree(params_from_torch(M)),
        torch_params=torch_params(M),
        grads_from_torch=lambda g: params_from_torch(g, num_heads=n_h),
    )


@register_case("seed002", default_run=True)
def seed002() -> Setup:
    """Seed 002: per-head W [N,E,H] vs the packed [E,N*H] matmul, triu(diagonal=1) as blocked, bmm."""
    import jax.numpy as jnp
    import torch

    import jaxattn

    B, T, E, N, d_k = 2, 5, 7, 3, 11  # the seed's B, N (length), T (features), n_heads, d_k
    rng = rng_for("seed002")
    params = {name: normal(rng, (N, E, d_k), E**-0.5) for name in ("w_Q", "w_K", "w_V")}

    def jax_fn(p, x):
        q, k, v = (jnp.einsum("bte,neh->btnh", x, p[w]) for w in ("w_Q", "w_K", "w_V"))
        return jaxattn.dot_product_attention(q, k, v, is_causal=True)

    def project(x, w):  # the seed's unrolled projection: (B*T, E) @ (E, n_heads*d_k), then split heads
        w_T = w.permute([1, 0, 2]).contiguous().view(E, -1)
        out = x.reshape(-1, E) @ w_T
        return out.view((B, T, N, d_k)).permute([0, 2, 1, 3]).contiguous()  # (B, n_heads, T, d_k)

    def attn(Q, K, V, mask):  # the seed's attn, its batched Q @ K^T written as the bmm it checked against
        QKT = torch.bmm(Q.reshape(-1, T, d_k), K.reshape(-1, T, d_k).transpose(-2, -1)).view(B, N, T, T)
        QKT = QKT * (d_k**-0.5)
        masked_QKT = QKT.masked_fill(mask, float("-inf"))
        weights = torch.softmax(masked_QKT, dim=-1)
        return weights @ V

    def torch_fn(p, x):
        Q, K, V = (project(x, p[w]) for w in ("w_Q", "w_K", "w_V"))
        out = attn(Q, K, V, mask=torch.triu(torch.ones((T, T), dtype=torch.bool), diagonal=1))
        return out.permute(0, 2, 1, 3)  # [B, T, N, H] as jaxattn

    return Setup(jax_fn, torch_fn, {"x": normal(rng, (B, T, E))}, params=params)


@register_case("seed003", default_run=True)
def seed003() -> Setup:
    """Seed 003: step-by-step SDPA (similarities, / sqrt(d_k), masked_fill -inf, softmax, @ values), [B,N,T,H]."""
    import torch
    from torch.nn.functional import softmax

    import jaxattn

    B, N, T, d_k = 2, 3, 7, 11
    rng = rng_for("seed003")
    mask_matrix = torch.tril(torch.ones(T, T)) == 0  # the seed's ScaledDotProductAttention(do_mask=True)

    def jax_fn(q, k, v):
        bnth_to_btnh = (0, 2, 1, 3)
        out = jaxattn.dot_product_attention(
            q.transpose(bnth_to_btnh), k.transpose(bnth_to_btnh), v.transpose(bnth_to_btnh), is_causal=True
        )
        return out.transpose(bnth_to_btnh)

    def torch_fn(q, k, v):
        similarities = q @ k.transpose(-2, -1)  # calculate_dot_product_similarities
        std = torch.sqrt(torch.tensor(k.shape[-1], dtype=q.dtype))  # scale(); the seed's TYPE_FLOAT
        similarities = similarities / std
        similarities = similarities.masked_fill(mask=mask_matrix, value=float("-inf"))  # mask()
        similarities = softmax(similarities, dim=-1)
        return similarities @ v  # calculate_attentions: (B,h,T,T) @ (B,h,T,d_v)

    inputs = {name: normal(rng, (B, N, T, d_k)) for name in ("q", "k", "v")}
    return Setup(jax_fn, torch_fn, inputs)


SEED004_LENGTH = 8


@register_case("seed004", default_run=True)
def seed004() -> Setup:
    """Seed 004: zero logits under a causal mask = the running mean tril(ones)/rowsum @ values (T=8)."""
    import jax.numpy as jnp
    import torch

    import jaxattn

    B, T, C = 3, SEED004_LENGTH, 2  # the seed's C = torch.randn(4, 8, 2), with a prime batch
    rng = rng_for("seed004")

    def jax_fn(values, keys):
        query = jnp.zeros((B, T, 1, 1), values.dtype)  # q = 0: every logit q.k is 0
        out, weights = jaxattn.dot_product_attention(
            query, keys[..., None, None], values[..., None, :], is_causal=True, return_weights=True
        )
        return {"out": out[..., 0, :], "weights": weights[..., 0, :, :]}

    def torch_fn(values, keys):
        tril = torch.tril(torch.ones(T, T, dtype=values.dtype))
        weights = tril / tril.sum(1, keepdim=True)
        return {"out": weights @ values, "weights": weights.expand(B, T, T)}

    inputs = {"values": normal(rng, (B, T, C)), "keys": Const(normal(rng, (B, T)))}
    return Setup(jax_fn, torch_fn, inputs)
