"""torch's own attention against jaxattn: nn.MultiheadAttention across its options, and F.scaled_dot_product_attention.

Sizes (distinct so that a swapped axis cannot pass): batch B=2, query length T=5, key length S=7, heads N=3,
head dim H=11 (model width E = N*H = 33), key/value features Ek=17, Ev=19, value head dim Hv=13; grouped-query
N=6 on K=2. Cases share these sizes on purpose: JAX compiles each eager ("plain") operation once per shape,
and compiling, not arithmetic, is what a run spends its time on.
"""

from __future__ import annotations

import numpy as np

from crosscheck.catalogue import (
    FLOAT32_JIT,
    FLOAT32_VMAP,
    Const,
    Setup,
    blocked,
    normal,
    randomize,
    register_case,
    rng_for,
    to_numpy_tree,
    torch_params,
)

B, T, S, N, H, Hv, Ek, Ev = 2, 5, 7, 3, 11, 13, 17, 19
E = N * H


# --- torch.nn.MultiheadAttention ----------------------------------------------------------------------------


def mha_setup(module, rng, *, self_attention=False, attn_mask=None, key_padding_mask=None, weights=None) -> Setup:
    """A torch.nn.MultiheadAttention vs jaxattn.multi_head_attention(params_from_torch(module), ...).

    attn_mask: None, "bool" [T,S], "bool3d" [B*N,T,S] or "float" [T,S] (additive, with -inf entries);
    key_padding_mask: None, "bool" or "float" [B,S]; weights: None (need_weights=False), "mean" or "per_head".
    """
    import torch

    import jaxattn
    from crosscheck import call_options_from_torch, masks_from_torch, params_from_torch

    E, kdim, vdim, N, batch_first = module.embed_dim, module.kdim, module.vdim, module.num_heads, module.batch_first
    options = call_options_from_torch(module)
    Sk = T if self_attention else S

    def layout(features, length):  # torch's [T,B,E] unless batch_first
        return (B, length, features) if batch_first else (length, B, features)

    inputs = {"query": normal(rng, layout(E, T))}
    if not self_attention:
        inputs |= {"key": normal(rng, layout(kdim, S)), "value": normal(rng, layout(vdim, S))}
    torch_masks = {}
    if attn_mask == "bool":
        torch_masks["attn_mask"] = blocked(rng, (T, Sk))
    elif attn_mask == "bool3d":
        torch_masks["attn_mask"] = blocked(rng, (B * N, T, Sk))
    elif attn_mask == "float":
        torch_masks["attn_mask"] = np.where(blocked(rng, (T, Sk)), -np.inf, normal(rng, (T, Sk)))
    if key_padding_mask == "bool":
        torch_masks["key_padding_mask"] = blocked(rng, (B, Sk))
    elif key_padding_mask == "float":
        torch_masks["key_padding_mask"] = np.where(blocked(rng, (B, Sk)), -np.inf, normal(rng, (B, Sk)))
    jax_masks = dict(zip(("mask", "bias"), masks_from_torch(**torch_masks, num_heads=N)))
    inputs |= {k: Const(np.asarray(v)) for k, v in (torch_masks | jax_masks).items() if v is not None}

    call = {"need_weights": weights is not None, "average_attn_weights": weights == "mean"}

    def torch_fn(params, query, key=None, value=None, attn_mask=None, key_padding_mask=None, **_):
        key = query if key is None else key
        value = query if value is None else value
        out, w = torch.func.functional_call(
            module, params, (query, key, value), dict(attn_mask=attn_mask, key_padding_mask=key_padding_mask, **call)
        )
        return {"out": out} if weights is None else {"out": out, "weights": w}

    def jax_fn(params, query, key=None, value=None, mask=None, bias=None, **_):
        if not batch_first:  # jaxattn is [..., T, E]: torch's [T, B, E] -> [B, T, E]
            query, key, value = (None if x is None else x.swapaxes(0, 1) for x in (query, key, value))
        result = jaxattn.multi_head_attention(
            params, query, key, value, mask=mask, bias=bias, return_weights=weights is not None, **options
        )
        out, w = result if weights is not None else (result, None)
        out = out if batch_first else out.swapaxes(0, 1)
        if weights is None:
            return {"out": out}
        return {"out": out, "weights": w.mean(axis=-3) if weights == "mean" else w}

    return Setup(
        jax_fn,
        torch_fn,
        inputs,
        params=to_numpy_tree(params_from_torch(module)),
        torch_params=torch_params(module),
        grads_from_torch=lambda g: params_from_torch(g, num_heads=N),
    )


_MHA_CASES = {
    # name: (what it checks, options). Together: every constructor option and every mask kind.
    "mha_self": (
        "self-attention, biases, batch_first=False ([T,B,E]), no mask, mean weights",
        dict(self_attention=True, batch_first=False, weights="mean"),
    ),
    "mha_no_bias": ("bias=False, cross-attention, no weights (torch's SDPA path)", dict(bias=False)),
    "mha_kdim_vdim_bool_mask": (
        "kdim/vdim (separate q/k/v_proj_weight), bool attn_mask [T,S], per-head weights",
        dict(kdim=Ek, vdim=Ev, attn_mask="bool", weights="per_head"),
    ),
    "mha_bias_kv_float_mask": (
        "add_bias_kv, float attn_mask (additive, -inf entries), mean weights",
        dict(add_bias_kv=True, attn_mask="float", weights="mean"),
    ),
    "mha_zero_attn_key_padding": (
        "add_zero_attn, bool key_padding_mask [B,S], per-head weights",
        dict(add_zero_attn=True, key_padding_mask="bool", weights="per_head"),
    ),
    "mha_both_float_masks": (
        "float attn_mask + float key_padding_mask, no weights",
        dict(attn_mask="float", key_padding_mask="float"),
    ),
    "mha_everything": (
        "add_bias_kv + add_zero_attn + kdim/vdim, bool attn_mask [B*N,T,S] + key_padding_mask, [T,B,E], mean weights",
        dict(
            add_bias_kv=True,
            add_zero_attn=True,
            kdim=Ek,
            vdim=Ev,
            batch_first=False,
            attn_mask="bool3d",
            key_padding_mask="bool",
            weights="mean",
        ),
    ),
}


_CONSTRUCTOR = ("bias", "add_bias_kv", "add_zero_attn", "kdim", "vdim", "batch_first")


def _register_mha(name: str, description: str, options: dict) -> None:
    def build() -> Setup:
        import torch

        rng = rng_for(name)
        constructor = {k: v for k, v in options.items() if k in _CONSTRUCTOR}
        module = randomize(torch.nn.MultiheadAttention(E, N, **constructor), rng)
        return mha_setup(module, rng, **{k: v for k, v in options.items() if k not in _CONSTRUCTOR})

    register_case(
        name,
        description=f"nn.MultiheadAttention: {description}",
        quick=FLOAT32_JIT,
        default_run=name == "mha_everything",
    )(build)  # the quick proof: every option at once


for _name, (_description, _options) in _MHA_CASES.items():
    _register_mha(_name, _description, _options)


# --- torch.nn.functional.scaled_dot_product_attention -------------------------------------------------------


def _sdpa_setup(
    name: str, *, T=T, S=S, N=N, K=N, Hv=Hv, is_causal=False, jax_causal=False, attn_mask=None, scale=None
) -> Setup:
    """F.scaled_dot_product_attention on [B,N,T,H] vs jaxattn.dot_product_attention on [B,T,N,H].

    is_causal: torch's flag (top-left aligned), converted by sdpa_masks_from_torch. jax_causal: jaxattn's
    is_causal (bottom-right aligned) against torch given that explicit mask. attn_mask: None, "bool" (SDPA:
    True = takes part) or "float".
    """
    import torch.nn.functional as F

    import jaxattn
    from crosscheck import sdpa_masks_from_torch

    rng = rng_for(name)
    inputs = {"query": normal(rng, (B, N, T, H)), "key": normal(rng, (B, K, S, H)), "value": normal(rng, (B, K, S, Hv))}
    torch_mask = None
    if attn_mask == "bool":
        torch_mask = ~blocked(rng, (B, 1, T, S))
    elif attn_mask == "float":
        torch_mask = np.where(blocked(rng, (T, S)), -np.inf, normal(rng, (T, S)))
    elif jax_causal:
        torch_mask = np.tril(np.ones((T, S), dtype=bool), S - T)  # bottom-right, spelled out for torch
    if torch_mask is not None:
        inputs["attn_mask"] = Const(torch_mask)
    if not jax_causal:
        mask, bias = sdpa_masks_from_torch(torch_mask, is_causal=is_causal, query_length=T, key_length=S)
        inputs |= {k: Const(np.asarray(v)) for k, v in (("mask", mask), ("bias", bias)) if v is not None}

    def torch_fn(query, key, value, attn_mask=None, **_):
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=K != N
        )

    def jax_fn(query, key, value, mask=None, bias=None, **_):
        bnth_to_btnh = (0, 2, 1, 3)
        q, k, v = (x.transpose(bnth_to_btnh) for x in (query, key, value))
        out = jaxattn.dot_product_attention(q, k, v, mask=mask, bias=bias, is_causal=jax_causal, scale=scale)
        return out.transpose(bnth_to_btnh)

    return Setup(jax_fn, torch_fn, inputs)


_SDPA_CASES = {
    "sdpa_scale": ("no mask, Hv != H, scale=0.37 overriding H ** -0.5", dict(scale=0.37)),
    "sdpa_causal": ("is_causal with T == S (both alignments agree)", dict(T=S, is_causal=True)),
    "sdpa_causal_top_left": (
        "torch's is_causal with T < S is top-left: via sdpa_masks_from_torch",
        dict(is_causal=True),
    ),
    "sdpa_causal_bottom_right": (
        "jaxattn's is_causal with T < S == torch's explicit tril(ones, S - T)",
        dict(jax_causal=True),
    ),
    "sdpa_bool_mask": ("bool attn_mask [B,1,T,S] (True = takes part)", dict(attn_mask="bool")),
    "sdpa_float_mask": ("float attn_mask [T,S] (additive, -inf entries)", dict(attn_mask="float")),
    "sdpa_gqa": ("enable_gqa=True, N=6 query heads on K=2 key/value heads", dict(N=6, K=2)),
}


def _register_sdpa(name: str, description: str, options: dict) -> None:
    register_case(
        name,
        description=f"F.scaled_dot_product_attention: {description}",
        quick=FLOAT32_VMAP,
        default_run=name == "sdpa_gqa",
    )(lambda: _sdpa_setup(name, **options))


for _name, (_description, _options) in _SDPA_CASES.items():
    _register_sdpa(_name, _description, _options)
