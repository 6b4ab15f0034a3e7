"""The attention forms of 2025-26 models, written plainly: the gated delta rule token by token, the expanded
multi-head latent attention, the causal depthwise conv and the gated RMS norm. Same layouts as jaxattn's
(docs/design.md, "Latent and linear attention", jaxattn/_layers/latent.py's parameter tree, as torch tensors)."""

from __future__ import annotations

import torch
from torch import Tensor

from torchref._functional import check, dot_product_attention
from torchref.positions import apply_rope


def gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale=None,
    initial_state: Tensor | None = None,
    return_state: bool = False,
):
    """query/key [..., T, K, H], value [..., T, N, Hv], g/beta [..., T, N], initial_state [..., N, H, Hv].
    For each value head n (reading query/key head n // (N // K)) and token t:
        S <- exp(g_t) S;   S <- S + k_t (beta_t (v_t - S^T k_t))^T;   o_t = S^T (scale q_t)."""
    T, K, H = query.shape[-3:]
    N, Hv = value.shape[-2:]
    check(key.shape[-3:] == query.shape[-3:], "key", f"[..., {T}, {K}, {H}]", tuple(key.shape))
    check(N % K == 0, "value", f"a head count divisible by K={K}", N)
    check(tuple(g.shape[-2:]) == (T, N), "g", f"[..., {T}, {N}]", tuple(g.shape))
    check(tuple(beta.shape[-2:]) == (T, N), "beta", f"[..., {T}, {N}]", tuple(beta.shape))
    scale = H**-0.5 if scale is None else scale
    heads = torch.arange(N) // (N // K)
    q, k = query[..., heads, :] * scale, key[..., heads, :]  # [..., T, N, H]
    batch = torch.broadcast_shapes(q.shape[:-3], value.shape[:-3], g.shape[:-2], beta.shape[:-2])
    state = value.new_zeros(*batch, N, H, Hv) if initial_state is None else initial_state.expand(*batch, N, H, Hv)
    outputs = []
    for t in range(T):
        state = g[..., t, :].exp()[..., None, None] * state
        predicted = (state * k[..., t, :, :, None]).sum(-2)  # S^T k: [..., N, Hv]
        delta = beta[..., t, :, None] * (value[..., t, :, :] - predicted)
        state = state + k[..., t, :, :, None] * delta[..., None, :]
        outputs.append((state * q[..., t, :, :, None]).sum(-2))
    out = torch.stack(outputs, dim=-3)
    return (out, state) if return_state else out


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    state: Tensor | None = None,
    activation: str | None = "silu",
) -> Tensor:
    """x [..., T, E], weight [E, W], state [..., W-1, E] (the inputs before x): y[t] = act(bias + sum_w
    weight[:, w] x[t - (W - 1) + w]) as torch's grouped conv1d."""
    E, W = weight.shape
    before = x.new_zeros(*x.shape[:-2], W - 1, E) if state is None else state
    full = torch.cat([before, x], dim=-2)  # [..., W-1+T, E]
    flat = full.reshape(-1, *full.shape[-2:]).transpose(1, 2)  # [B, E, W-1+T]
    y = torch.nn.functional.conv1d(flat, weight[:, None, :], bias, groups=E).transpose(1, 2)
    y = y.reshape(*x.shape)
    return torch.nn.functional.silu(y) if activation == "silu" else y


def gated_rms_norm(x: Tensor, gate: Tensor, weight: Tensor, *, eps: float = 1e-6) -> Tensor:
    """weight * x / sqrt(mean(x^2) + eps) * silu(gate) over the last axis."""
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * torch.nn.functional.silu(gate)


def _rms(x: Tensor, scale: Tensor, eps: float) -> Tensor:
    return scale * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _linear(entry: dict, x: Tensor, spec: str) -> Tensor:
    y = torch.einsum(spec, x, entry["kernel"])
    return y + entry["bias"] if "bias" in entry else y


def latent_attention(
    params: dict,
    x: Tensor,
    *,
    positions=None,
    scale=None,
    rope_base: float = 10000.0,
    rope_layout: str = "interleaved",
    norm_eps: float = 1e-6,
    **options,
) -> Tensor:
    """Multi-head latent attention, the expanded form: x [..., T, E] -> [..., T, Eo] on jaxattn's tree
    (query or query_down/query_norm/query_up, latent, latent_norm, key_rope, key_up, value_up, out).
    Keys k[s, n] = [c_s W_UK[:, n] | rope(k_rope_s)], values c_s W_UV[:, n]; options as dot_product_attention."""
    Hn = params["key_up"]["kernel"].shape[-1]
    if "query" in params:
        q = _linear(params["query"], x, "...te,enh->...tnh")
    else:
        low = _rms(_linear(params["query_down"], x, "...te,ec->...tc"), params["query_norm"]["scale"], norm_eps)
        q = _linear(params["query_up"], low, "...tc,cnh->...tnh")
    c = _rms(_linear(params["latent"], x, "...te,ec->...tc"), params["latent_norm"]["scale"], norm_eps)
    k_rope = _linear(params["key_rope"], x, "...te,er->...tr")
    rope = dict(base=rope_base, layout=rope_layout)
    q = torch.cat([q[..., :Hn], apply_rope(q[..., Hn:], positions, **rope)], dim=-1)
    k_rope = apply_rope(k_rope[..., None, :], positions, **rope)  # [..., T, 1, R]
    k_nope = torch.einsum("...sc,cnh->...snh", c, params["key_up"]["kernel"])
    v = torch.einsum("...sc,cnv->...snv", c, params["value_up"]["kernel"])
    k = torch.cat([k_nope, k_rope.expand(*k_nope.shape[:-1], k_rope.shape[-1])], dim=-1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    z = dot_product_attention(q, k, v, scale=scale, **options)
    return _linear(params["out"], z, "...tnv,nve->...te")
