"""The attention forms of 2025-26 models against transformers' own torch code and against torchref.

    delta_rule_hf_chunked     jaxattn.gated_delta_rule (chunked)   vs transformers' torch_chunk_gated_delta_rule
    delta_rule_hf_recurrent   jaxattn.gated_delta_rule (recurrent) vs transformers' torch_recurrent_gated_delta_rule
    delta_rule_torchref       jaxattn.gated_delta_rule vs torchref's token-by-token loop
    mla_hf_absorbed / mla_hf_expanded / mla_hf_direct_half
                              jaxattn.latent_attention vs transformers' DeepseekV3Attention (tiny random config)
    mla_torchref              jaxattn.latent_attention (absorbed) vs torchref's expanded MLA

The delta-rule inputs are the family's raw ones: g = -softplus(a), beta = sigmoid(b), and q, k l2-normalised
(transformers' use_qk_l2norm_in_kernel formula on both sides), so gradients reach g and beta through a and b.
Every dimension is distinct (B=2, T=13 over chunks of 4, K=2 key heads, N=6 value heads, H=5, Hv=7).

float64: transformers' delta-rule functions cast every input to float32 ("to(torch.float32)"); the float64
rows run them with that cast made a float64 one (their module's `torch.float32` read as float64 for the call:
every other operation is transformers' code), and DeepseekV3Attention under crosscheck's float64_reference
(its RMS norms and softmax in float64). float32 rows hold the one-call bar (1e-6 / 1e-5): with l2-normalised
keys, as the family runs it, transformers' float32 lies ~1e-7 from ours at these sizes (unnormalised keys with
beta |k|^2 > 2 make the recurrence grow without bound, in every implementation).
"""

from __future__ import annotations

import contextlib
import types
from unittest import mock

import numpy as np

from crosscheck.catalogue import Setup, normal, randomize, register_case, rng_for, to_numpy_tree, torch_params

B, T, K, N, H, Hv, CHUNK = 2, 13, 2, 6, 5, 7, 4

# --- gated delta rule ---------------------------------------------------------------------------------------------


def _delta_inputs(name):
    rng = rng_for(name)
    return {
        "query": normal(rng, (B, T, K, H)),
        "key": normal(rng, (B, T, K, H)),
        "value": normal(rng, (B, T, N, Hv)),
        "a": normal(rng, (B, T, N)),
        "b": normal(rng, (B, T, N)),
        "initial_state": normal(rng, (B, N, H, Hv), 0.5),
    }


def _jax_delta(implementation):
    import jax
    import jax.numpy as jnp

    import jaxattn

    def l2norm(x):  # transformers' l2norm (FLA's): x / sqrt(sum x^2 + 1e-6)
        return x * jax.lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)

    def jax_fn(query, key, value, a, b, initial_state):
        out, state = jaxattn.gated_delta_rule(
            l2norm(query),
            l2norm(key),
            value,
            -jax.nn.softplus(a),
            jax.nn.sigmoid(b),
            initial_state=initial_state,
            chunk_size=CHUNK,
            return_state=True,
            implementation=implementation,
        )
        return {"out": out, "state": state}

    return jax_fn


@contextlib.contextmanager
def _float32_cast_is(hf_module, dtype):
    """transformers' delta-rule functions cast their inputs with `x.to(torch.float32)`; for a float64 run their
    module's `torch` reads float32 as float64 (everything else is torch itself)."""
    import torch

    if dtype != torch.float64:
        yield
        return
    proxy = types.SimpleNamespace(**{n: getattr(torch, n) for n in dir(torch) if not n.startswith("__")})
    proxy.float32 = torch.float64
    with mock.patch.object(hf_module, "torch", proxy):
        yield


def _hf_delta(function_name):
    import torch.nn.functional as F
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    function = getattr(hf, function_name)
    chunked = {"chunk_size": CHUNK} if "chunk" in function_name else {}

    def torch_fn(query, key, value, a, b, initial_state):
        with _float32_cast_is(hf, query.dtype):
            out, state = function(
                query,
                key,
                value,
                -F.softplus(a),
                b.sigmoid(),
                initial_state=initial_state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                **chunked,
            )
        return {"out": out, "state": state}

    return torch_fn


@register_case("delta_rule_hf_chunked", requires=("transformers",))
def _delta_rule_hf_chunked() -> Setup:
    """gated_delta_rule (chunked, C=4, T=13, N=6 on K=2) vs transformers' torch_chunk_gated_delta_rule"""
    return Setup(
        _jax_delta("chunked"), _hf_delta("torch_chunk_gated_delta_rule"), _delta_inputs("delta_rule_hf_chunked")
    )


@register_case("delta_rule_hf_recurrent", requires=("transformers",))
def _delta_rule_hf_recurrent() -> Setup:
    """gated_delta_rule (recurrent) vs transformers' torch_recurrent_gated_delta_rule"""
    return Setup(
        _jax_delta("recurrent"), _hf_delta("torch_recurrent_gated_delta_rule"), _delta_inputs("delta_rule_hf_recurrent")
    )


@register_case("delta_rule_torchref")
def _delta_rule_torchref() -> Setup:
    """gated_delta_rule (chunked) vs torchref.gated_delta_rule's token-by-token loop"""
    import torch
    import torch.nn.functional as F

    import torchref

    def l2norm(x):
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    def torch_fn(query, key, value, a, b, initial_state):
        out, state = torchref.gated_delta_rule(
            l2norm(query),
            l2norm(key),
            value,
            -F.softplus(a),
            b.sigmoid(),
            initial_state=initial_state,
            return_state=True,
        )
        return {"out": out, "state": state}

    return Setup(_jax_delta("chunked"), torch_fn, _delta_inputs("delta_rule_torchref"))


# --- multi-head latent attention -----------------------------------------------------------------------------------

MLA = {
    "hidden_size": 23,
    "num_attention_heads": 3,
    "num_key_value_heads": 3,
    "q_lora_rank": 13,
    "kv_lora_rank": 11,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 5,
    "v_head_dim": 7,
}
MLA_T = 9


def latent_params_from_deepseek(state_dict, config) -> dict:
    """DeepseekV3Attention's state_dict ({name: array}) -> jaxattn.latent_attention's tree (the layout table:
    torch Linear weights are [out, in]; kv_a_proj_with_mqa's outputs are [latent C | rope R], kv_b_proj's per
    head [nope Hn | value Hv], q_b_proj's per head [nope Hn | rope R], o_proj's inputs per head [Hv])."""
    sd = {k: np.asarray(v) for k, v in state_dict.items()}
    N, C, R = config.num_attention_heads, config.kv_lora_rank, config.qk_rope_head_dim
    Hn, Hv = config.qk_nope_head_dim, config.v_head_dim
    kv_a = sd["kv_a_proj_with_mqa.weight"].T  # [E, C+R]
    kv_b = sd["kv_b_proj.weight"].T.reshape(C, N, Hn + Hv)
    params = {
        "latent": {"kernel": kv_a[:, :C]},
        "key_rope": {"kernel": kv_a[:, C:]},
        "latent_norm": {"scale": sd["kv_a_layernorm.weight"]},
        "key_up": {"kernel": kv_b[..., :Hn]},
        "value_up": {"kernel": kv_b[..., Hn:]},
        "out": {"kernel": sd["o_proj.weight"].T.reshape(N, Hv, -1)},
    }
    if "kv_a_proj_with_mqa.bias" in sd:
        params["latent"]["bias"] = sd["kv_a_proj_with_mqa.bias"][:C]
        params["key_rope"]["bias"] = sd["kv_a_proj_with_mqa.bias"][C:]
    if "o_proj.bias" in sd:
        params["out"]["bias"] = sd["o_proj.bias"]
    if "q_proj.weight" in sd:
        params["query"] = {"kernel": sd["q_proj.weight"].T.reshape(-1, N, Hn + R)}
    else:
        params["query_down"] = {"kernel": sd["q_a_proj.weight"].T}
        if "q_a_proj.bias" in sd:
            params["query_down"]["bias"] = sd["q_a_proj.bias"]
        params["query_norm"] = {"scale": sd["q_a_layernorm.weight"]}
        params["query_up"] = {"kernel": sd["q_b_proj.weight"].T.reshape(-1, N, Hn + R)}
    return params


def _mla_setup(name, *, form="absorbed", interleave=True, q_lora=True, bias=True) -> Setup:
    import torch
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    import jaxattn
    from crosscheck._hf.checkpoints import float64_reference

    rng = rng_for(name)
    config = DeepseekV3Config(
        **{**MLA, "q_lora_rank": MLA["q_lora_rank"] if q_lora else None},
        rope_interleave=interleave,
        attention_bias=bias,
        max_position_embeddings=64,
    )
    config._attn_implementation = "eager"
    module = randomize(DeepseekV3Attention(config, layer_idx=0), rng).eval()
    base = config.rope_parameters.get("rope_theta", 10000.0)
    causal = torch.full((MLA_T, MLA_T), float("-inf")).triu(1)

    def torch_fn(params, hidden):
        R = config.qk_rope_head_dim  # default RoPE, as DeepseekV3RotaryEmbedding, in the input's dtype
        inverse = 1.0 / base ** (torch.arange(0, R, 2, dtype=torch.float64) / R)
        angles = torch.arange(MLA_T, dtype=torch.float64)[:, None] * inverse
        emb = torch.cat([angles, angles], -1)[None]
        mask = causal.to(hidden.dtype)[None, None]
        with float64_reference(module, "float64" if hidden.dtype == torch.float64 else "float32"):
            out, _ = torch.func.functional_call(
                module, params, (hidden, (emb.cos().to(hidden.dtype), emb.sin().to(hidden.dtype)), mask)
            )
        return out

    def jax_fn(params, hidden):
        return jaxattn.latent_attention(
            params,
            hidden,
            form=form,
            is_causal=True,
            rope_base=base,
            rope_layout="interleaved" if interleave else "half",
        )

    return Setup(
        jax_fn,
        torch_fn,
        {"hidden": normal(rng, (B, MLA_T, MLA["hidden_size"]))},
        params=to_numpy_tree(latent_params_from_deepseek(module.state_dict(), config)),
        torch_params=torch_params(module),
        grads_from_torch=lambda g: latent_params_from_deepseek(g, config),
    )


register_case(
    "mla_hf_absorbed",
    requires=("transformers",),
    description="latent_attention absorbed vs transformers' DeepseekV3Attention (q_lora, bias, rope_interleave)",
)(lambda: _mla_setup("mla_hf_absorbed"))
register_case(
    "mla_hf_expanded", requires=("transformers",), description="latent_attention expanded vs DeepseekV3Attention"
)(lambda: _mla_setup("mla_hf_expanded", form="expanded"))
register_case(
    "mla_hf_direct_half",
    requires=("transformers",),
    description="latent_attention absorbed vs DeepseekV3Attention, direct q_proj, no bias, half rope",
)(lambda: _mla_setup("mla_hf_direct_half", interleave=False, q_lora=False, bias=False))


@register_case("mla_torchref")
def _mla_torchref() -> Setup:
    """latent_attention (absorbed) vs torchref.latent_attention (expanded), causal"""
    import jax
    import jax.numpy as jnp

    import jaxattn
    import torchref

    rng = rng_for("mla_torchref")
    params = jaxattn.init_latent_attention(
        jax.random.PRNGKey(0),
        23,
        3,
        latent_dim=11,
        rope_dim=4,
        nope_head_dim=5,
        value_head_dim=7,
        query_latent_dim=13,
        use_bias=True,
        dtype=jnp.float64,
    )
    params = jax.tree.map(lambda p: np.asarray(p) + normal(rng, p.shape, 0.3), params)
    return Setup(
        lambda p, hidden: jaxattn.latent_attention(p, hidden, is_causal=True),
        lambda p, hidden: torchref.latent_attention(p, hidden, is_causal=True),
        {"hidden": normal(rng, (B, MLA_T, 23))},
        params=params,
    )
