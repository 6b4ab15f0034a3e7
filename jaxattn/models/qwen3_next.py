"""Qwen3-Next in Flax linen: HF's Qwen3NextForCausalLM (model_type "qwen3_next").

    x = embed_tokens[ids]
    each layer i:  h = RMSNorm(x)
        linear layer (layer_types[i] = "linear_attention"):   x = x + DeltaNet(h)
        full layer   (layer_types[i] = "full_attention"):     x = x + GatedAttention(h)
        x = x + mlp(RMSNorm(x))       the MoE, or a SwiGLU of width G on mlp_only_layers / off decoder_sparse_step
    logits = RMSNorm(x) @ lm_head (or embed_tokens.T when tied)

    RMSNorm(x)        = x / sqrt(mean(x^2) + eps) * (1 + w), rounded back after the scale (w from 0; _norms'
                        "gemma" kind): every norm of the model, the attention's per-head q/k norms included
    GatedAttention(h) = o((attend(RoPE_p(q_norm(q)), RoPE_p(k_norm(k)), v) * sigmoid(gate))
                        [q | gate] = h @ q_proj, per head (q_proj's rows: head n's H query rows, then its H gate
                        rows); GQA, scale H ** -0.5; RoPE_p rotates the first p = H * partial_rotary_factor
                        features of each head (rotate-half layout on those)
    DeltaNet(h)       = out_proj(gated_rms_norm(delta_rule(l2(q), l2(k), v, g, beta), z))
                        [q | k | v | z] = h @ in_proj_qkvz and [b | a] = h @ in_proj_ba, both per key head j
                        (its Q query and Q key features, then its M/J value heads' D features for v and z; its
                        M/J b's, then its M/J a's); q, k, v through the causal depthwise conv (kernel W, silu);
                        beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); l2(x) = x / sqrt(sum(x^2) +
                        1e-6); value head m reads key head m // (M / J); scale Q ** -0.5
    MoE(h)            = sum_x p_x expert_x(h) + sigmoid(h . shared_expert_gate) shared_expert(h)
                        p = softmax(router(h)) (float32 or wider), zero off the top k, renormalised with
                        norm_topk_prob; experts SwiGLU of width F, the shared expert of width S

Padding: the linear layers zero the padded tokens' inputs (HF's apply_mask_to_padding_states), so a padded
token writes nothing to the state (its key is 0) though the state still decays through it, as HF's.

Decoding (the calling convention of _decoder): the full layers keep the usual key/value cache of L slots; a
linear layer keeps two fixed-size states in the "cache" collection, whatever the length: the conv's last
W - 1 inputs [B,W-1,C] and the delta rule's state [B,M,Q,D] (float32 or wider). A decode call's tokens
continue from them (the conv reads its state as the inputs before the call's first token).

HF's params are kept fused where HF fuses them per head (q_proj [E,N,2H]; in_proj_qkvz [E,J,P], in_proj_ba
[E,J,2M/J]) and split in the forward pass, so that the weight table is a reshape per tensor.

Refused by name: hidden_act other than "silu", attention_bias, rope types other than "default", layer_types
other than "linear_attention" / "full_attention" per layer, num_experts < 1, linear heads that do not group.
The multi-token-prediction tensors (mtp.*) of the released checkpoints are not read: such a checkpoint is
refused listing them as unexpected.

Axis letters: those of _decoder (V E N K H) and moe (X experts, F their width); G the dense layers' width,
S the shared expert's; the linear layers' J key heads of Q features, M value heads of D features, P = 2Q +
2(M/J)D per key head, C = 2JQ + MD conv channels, W the conv kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from .._api import dot_product_attention
from .._core.dtypes import accumulation_dtype
from .._forms import delta_rule
from .._schemes.rope import apply_rope
from . import _blocks, _decoder, _masks, _norms, _pretrained, _rope_config, moe, weights
from .weights import Reshape, Steps, Transpose

LAYER_KINDS = ("linear_attention", "full_attention")
L2_EPSILON = 1e-6  # HF's l2norm (the FLA kernels' constant), not the config's rms_norm_eps


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig(moe.MoEConfig):
    """HF's Qwen3NextConfig fields this port reads (defaults: HF's); linear_layers, moe_layers, rotary_dim
    are derived."""

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int | None = 2
    head_dim: int | None = 256
    rms_norm_eps: float = 1e-6
    num_local_experts: int = 512
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_layers: tuple = ()  # per layer: True = gated delta rule, False = gated softmax attention
    moe_layers: tuple = ()  # the layers whose MLP is the mixture of experts
    rotary_dim: int = 64  # head_dim * partial_rotary_factor

    rms_norm = "gemma"  # (_norms.RMSNorm) Qwen3NextRMSNorm: (1 + w), rounded after the scale

    def outside_the_model(self, name: str) -> bool:
        """The multi-token-prediction module released checkpoints store as mtp.*: transformers ignores it too."""
        return name.startswith("mtp.")

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> Qwen3NextConfig:
        """From a HF config.json dict; refuses by name what is not implemented (see the module)."""
        refuse = functools.partial(_pretrained.refuse, source)
        if config.get("hidden_act", "silu") != "silu":
            refuse("hidden_act", "'silu'", config["hidden_act"])
        if config.get("attention_bias"):
            refuse("attention_bias", "false", config["attention_bias"])
        n = config.get("num_hidden_layers", cls.num_hidden_layers)
        experts = config.get("num_local_experts", config.get("num_experts", cls.num_local_experts))
        if isinstance(experts, bool) or not isinstance(experts, int) or experts < 1:
            refuse("num_experts", "an int >= 1 (a dense Qwen3-Next is not implemented)", experts)
        J = config.get("linear_num_key_heads", cls.linear_num_key_heads)
        if config.get("linear_num_value_heads", cls.linear_num_value_heads) % J:
            refuse(
                "linear_num_value_heads", f"a multiple of linear_num_key_heads={J}", config["linear_num_value_heads"]
            )
        rope = _rope_config.rope_parameters(config)
        if rope.get("rope_type", "default") != "default":
            refuse("rope_parameters['rope_type']", "'default'", rope["rope_type"])
        factor = rope.pop("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
        parsed = cls.parse(
            {**config, "num_local_experts": experts},
            source,
            rope=rope,
            linear_layers=_linear_layers(config, n, refuse),
            moe_layers=_moe_layers(config, n, refuse),
        )
        rotary_dim = int(parsed.dims()["H"] * factor)
        if rotary_dim < 2 or rotary_dim % 2:
            refuse("rope_parameters['partial_rotary_factor']", "a factor giving an even rotary dim >= 2", factor)
        frequencies = _rope_config.rope_frequencies(config, rotary_dim, source, rope=rope)
        return dataclasses.replace(parsed, rotary_dim=rotary_dim, rope_frequencies=tuple(frequencies))

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict); the rope settings (partial_rotary_factor among them) come
        from hf_config, as every family's (to_pretrained checks that they give rotary_dim and the frequencies)."""
        return super().to_dict() | {
            "model_type": "qwen3_next",
            "architectures": ["Qwen3NextForCausalLM"],
            "hidden_act": "silu",
            "attention_bias": False,
            "num_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i in range(self.num_hidden_layers) if i not in self.moe_layers],
            "layer_types": [LAYER_KINDS[not linear] for linear in self.linear_layers],
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
        }

    def dims(self) -> dict[str, int]:
        J, M = self.linear_num_key_heads, self.linear_num_value_heads
        Q, D = self.linear_key_head_dim, self.linear_value_head_dim
        return {
            **super().dims(),
            "F": self.moe_intermediate_size,
            "G": self.intermediate_size,
            "S": self.shared_expert_intermediate_size,
            "J": J,
            "M": M,
            "Q": Q,
            "D": D,
            "U": M // J,
            "P": 2 * Q + 2 * (M // J) * D,
            "C": 2 * J * Q + M * D,
            "W": self.linear_conv_kernel_dim,
        }

    def normalize_top_k(self) -> bool:
        return self.norm_topk_prob


def _linear_layers(config: Mapping[str, Any], n: int, refuse) -> tuple:
    """HF's layer_types, else a full attention layer every full_attention_interval-th layer (HF's default 4)."""
    types = config.get("layer_types")
    if types is None:
        interval = config.get("full_attention_interval", 4)
        return tuple((i + 1) % interval != 0 for i in range(n))
    if len(types) != n or not set(types) <= set(LAYER_KINDS):
        refuse("layer_types", f"{n} entries (num_hidden_layers) among {list(LAYER_KINDS)}", types)
    return tuple(kind == "linear_attention" for kind in types)


def _moe_layers(config: Mapping[str, Any], n: int, refuse) -> tuple:
    """HF's rule: layer i is an MoE layer unless in mlp_only_layers, and only when (i + 1) % decoder_sparse_step
    == 0."""
    dense = config.get("mlp_only_layers") or []
    if not all(isinstance(i, int) and 0 <= i < n for i in dense):
        refuse("mlp_only_layers", f"layer indices in [0, {n})", dense)
    step = config.get("decoder_sparse_step", 1)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        refuse("decoder_sparse_step", "an int >= 1", step)
    return tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)


# --- the token mixers ---------------------------------------------------------------------------------------------


class Projection(nn.Module):
    """x [...,E] @ kernel [E,*out] -> [...,*out] (a Dense onto a head-split layout, no bias)."""

    out: tuple
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=0, out_axis=tuple(range(1, len(self.out) + 1))
        )
        kernel = self.param("kernel", init, (x.shape[-1], *self.out), self.param_dtype)
        x, kernel = promote_dtype(x, kernel, dtype=self.dtype)
        letters = "abcd"[: len(self.out)]
        return jnp.einsum(f"...e,e{letters}->...{letters}", x, kernel, precision=self.precision)


class OutProjection(nn.Module):
    """z [...,N,H] @ kernel [N,H,E] -> [...,E] (no bias)."""

    features: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None

    @nn.compact
    def __call__(self, z):
        init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=(0, 1), out_axis=2)
        kernel = self.param("kernel", init, (*z.shape[-2:], self.features), self.param_dtype)
        z, kernel = promote_dtype(z, kernel, dtype=self.dtype)
        return jnp.einsum("...nh,nhe->...e", z, kernel, precision=self.precision)


class GatedAttention(_decoder.Configured):
    """Qwen3NextAttention (see the module): h [B,T,E] -> [B,T,E]; decoding appends to an L-slot key/value
    cache ("cached_key" [B,L,K,H], "cached_value") at the call's slots."""

    @nn.compact
    def __call__(self, h, key_mask, positions, slots, decode: bool):
        c, d = self.config, self.config.dims()
        N, K, H = d["N"], d["K"], d["H"]
        project = functools.partial(
            Projection, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision
        )
        norm = functools.partial(_norms.RMSNorm, c.rms_norm_eps, self.param_dtype, c.rms_norm)
        q, gate = jnp.split(project((N, 2 * H), name="q_proj")(h), 2, axis=-1)  # head n: H query, H gate
        q = norm(name="q_norm")(q)
        k = norm(name="k_norm")(project((K, H), name="k_proj")(h))
        v = project((K, H), name="v_proj")(h)
        rope = functools.partial(
            apply_rope, positions=positions, rotary_dim=c.rotary_dim, layout="half", frequencies=c.rope_frequencies
        )
        q, k = rope(q), rope(k)
        query_positions = key_positions = None
        if decode:
            k, v = self._cached(k, v, slots)
            query_positions, key_positions = slots, jnp.arange(k.shape[-3], dtype=jnp.int32)
        z = dot_product_attention(
            q,
            k,
            v,
            mask=key_mask,
            is_causal=True,
            query_positions=query_positions,
            key_positions=key_positions,
            precision=self.precision,
            implementation=c.implementation,
        )
        z = z * jax.nn.sigmoid(gate)
        return OutProjection(d["E"], self.dtype, self.param_dtype, self.precision, name="o_proj")(z)

    def _cached(self, k, v, slots):
        """The cache with the call's keys/values [B,T,K,H] written at their slots (B rows, one start each):
        (keys, values) [B,L,K,H] to attend to. Initialising, the cache is the call's length."""
        cached_k = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cached_v = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        write = jax.vmap(lambda cache, new, start: jax.lax.dynamic_update_slice_in_dim(cache, new, start, 0))
        keys = write(cached_k.value, k.astype(cached_k.value.dtype), slots[:, 0])
        values = write(cached_v.value, v.astype(cached_v.value.dtype), slots[:, 0])
        if not self.is_initializing():
            cached_k.value, cached_v.value = keys, values
        return keys, values


def l2_normalize(x, epsilon: float = L2_EPSILON):
    """HF's l2norm over the last axis: x / sqrt(sum(x^2) + eps), in float32 or wider (returned so)."""
    wide = x.astype(accumulation_dtype(x.dtype))
    return wide * jax.lax.rsqrt(jnp.sum(wide * wide, axis=-1, keepdims=True) + epsilon)


class GatedDeltaNet(_decoder.Configured):
    """Qwen3NextGatedDeltaNet (see the module): h [B,T,E] -> [B,T,E]; decoding carries "conv_state"
    [B,W-1,C] and "recurrent_state" [B,M,Q,D] in the "cache" collection."""

    @nn.compact
    def __call__(self, h, token_mask, decode: bool):
        c, d = self.config, self.config.dims()
        J, M, Q, D, G = d["J"], d["M"], d["Q"], d["D"], d["M"] // d["J"]
        if token_mask is not None:  # padded tokens in: zeros (HF's apply_mask_to_padding_states)
            h = (h * token_mask[..., None]).astype(h.dtype)
        project = functools.partial(
            Projection, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision
        )
        q, k, v, z = jnp.split(project((J, d["P"]), name="in_proj_qkvz")(h), (Q, 2 * Q, 2 * Q + G * D), axis=-1)
        b, a = jnp.split(project((J, 2 * G), name="in_proj_ba")(h), 2, axis=-1)
        *batch, T, _ = h.shape
        mixed = jnp.concatenate(
            [q.reshape(*batch, T, J * Q), k.reshape(*batch, T, J * Q), v.reshape(*batch, T, M * D)], axis=-1
        )  # [B,T,C]: the conv's channel order
        conv = self.param(
            "conv_weight", nn.initializers.lecun_normal(in_axis=1, out_axis=0), (d["C"], d["W"]), self.param_dtype
        )
        conv_state = (
            self.variable("cache", "conv_state", jnp.zeros, (*batch, d["W"] - 1, d["C"]), mixed.dtype)
            if decode
            else None
        )
        mixed, new_conv_state = delta_rule.causal_conv1d(
            mixed,
            jnp.asarray(conv, mixed.dtype),
            state=None if conv_state is None else conv_state.value,
            activation="silu",
            return_state=True,
        )
        q, k, v = jnp.split(mixed, (J * Q, 2 * J * Q), axis=-1)
        q, k, v = q.reshape(*batch, T, J, Q), k.reshape(*batch, T, J, Q), v.reshape(*batch, T, M, D)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (M,), self.param_dtype)
        a_log = self.param("A_log", nn.initializers.zeros, (M,), self.param_dtype)
        wide = accumulation_dtype(a.dtype)
        beta = jax.nn.sigmoid(b.reshape(*batch, T, M))
        g = -jnp.exp(a_log.astype(wide)) * jax.nn.softplus(a.reshape(*batch, T, M).astype(wide) + dt_bias)
        state = self.variable("cache", "recurrent_state", jnp.zeros, (*batch, M, Q, D), wide) if decode else None
        out, new_state = delta_rule.gated_delta_rule(
            l2_normalize(q),
            l2_normalize(k),
            v.astype(wide),
            g,
            beta,
            return_state=True,
            initial_state=None if state is None else state.value,
            implementation="recurrent" if decode and T == 1 else None,
        )  # HF's: recurrent for one token
        if decode and not self.is_initializing():
            conv_state.value, state.value = new_conv_state, new_state.astype(wide)  # type: ignore[union-attr]
        weight = self.param("norm_weight", nn.initializers.ones, (D,), self.param_dtype)
        out = delta_rule.gated_rms_norm(out.astype(v.dtype), z.reshape(*batch, T, M, D), weight, eps=c.rms_norm_eps)
        return OutProjection(d["E"], self.dtype, self.param_dtype, self.precision, name="out_proj")(out)


# --- the block ---------------------------------------------------------------------------------------------------


class SwiGLU(_decoder.Configured):
    """down(silu(gate(x)) * up(x)) of intermediate width `features` (the dense layers' G, the shared expert's S)."""

    features: int = 0

    @nn.compact
    def __call__(self, x):
        return _blocks.gated_mlp(self, x, nn.silu, features=self.features)


class Qwen3NextMoE(_decoder.Configured):
    """Qwen3NextSparseMoeBlock: x [...,E] -> (routed + sigmoid(shared_expert_gate(x)) shared_expert(x) [...,E],
    router logits [...,X])."""

    @nn.compact
    def __call__(self, x):
        c, d = self.config, self.config.dims()
        options = dict(dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision)
        logits = nn.Dense(d["X"], use_bias=False, name="router", **options)(x)
        weights = moe.routing_weights(logits, c.num_experts_per_tok, c.routing, normalize=c.normalize_top_k())
        out = moe.Experts(c, sharding=self.sharding, name="experts", **options)(x)  # [...,X,E]
        routed = jnp.einsum("...xe,...x->...e", out, weights.astype(out.dtype), precision=self.precision)
        shared = SwiGLU(c, features=d["S"], sharding=self.sharding, name="shared_expert", **options)(x)
        gate = nn.Dense(1, use_bias=False, name="shared_expert_gate", **options)(x)
        return routed.astype(out.dtype) + jax.nn.sigmoid(gate) * shared, logits


class Qwen3NextBlock(_decoder.Configured):
    """Pre-norm block: the layer's token mixer ("linear_attn" or "self_attn"), then its MLP; rows as
    _blocks.PreNormBlock's ("attention" the mixer's output, "router" on MoE layers, "mlp")."""

    layer: int = 0

    @nn.compact
    def __call__(self, x, key_mask, token_mask, positions, slots, decode: bool):
        c, d = self.config, self.config.dims()
        options = dict(dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision, sharding=self.sharding)
        norm = functools.partial(_norms.RMSNorm, c.rms_norm_eps, self.param_dtype, c.rms_norm)
        h = norm(name="input_layernorm")(x)
        if c.linear_layers[self.layer]:
            a = GatedDeltaNet(c, name="linear_attn", **options)(h, token_mask, decode)
        else:
            a = GatedAttention(c, name="self_attn", **options)(h, key_mask, positions, slots, decode)
        x = x + a
        h = norm(name="post_attention_layernorm")(x)
        if self.layer in c.moe_layers:
            m, logits = Qwen3NextMoE(c, name="mlp", **options)(h)
            return x + m, {"attention": a, "router": logits, "mlp": m}
        m = SwiGLU(c, features=d["G"], name="mlp", **options)(h)
        return x + m, {"attention": a, "mlp": m}


class Qwen3NextForCausalLM(_decoder.CausalLM):
    """HF Qwen3NextForCausalLM: input_ids [B,T] -> logits [B,T,V] (the calling convention of _decoder)."""

    Block = Qwen3NextBlock

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, decode: bool = False):
        c, d = self.config, self.config.dims()
        input_ids = jnp.asarray(input_ids)
        positions, slots = _masks.positions_and_slots(self, input_ids.shape, position_ids, decode)
        embed = nn.Embed(d["V"], d["E"], dtype=self.dtype, param_dtype=self.param_dtype, name="embed_tokens")
        key_mask = _masks.key_mask(attention_mask)
        token_mask = None  # the call's own tokens' mask [B,T] (decoding: attention_mask covers the L slots)
        if attention_mask is not None:
            attention_mask = jnp.asarray(attention_mask)
            token_mask = jnp.take_along_axis(attention_mask, slots, axis=-1) if decode else attention_mask

        def layer(i, x):
            block = self.Block(
                c, self.dtype, self.param_dtype, self.precision, self.sharding, layer=i, name=f"layers_{i}"
            )
            return block(x, key_mask, token_mask, positions, slots, decode)

        norm = _norms.RMSNorm(c.rms_norm_eps, self.param_dtype, c.rms_norm, name="norm")
        x = _decoder.layer_stack(self, layer, c.num_hidden_layers, norm, embed(input_ids))
        return _decoder.lm_head(self, x, embed, c.tie_word_embeddings)


# --- weights ------------------------------------------------------------------------------------------------------


def _mixer_rows() -> tuple[list[weights.Row], list[weights.Row]]:
    """(a linear layer's rows, a full attention layer's rows): HF's linear_attn.* / self_attn.* tensors."""
    R, hf, ours = weights.row, "model.layers.{i}.", "layers_{i}/"
    linear = [
        R(hf + "linear_attn.dt_bias", ("M",), ours + "linear_attn/dt_bias", ("M",)),
        R(hf + "linear_attn.A_log", ("M",), ours + "linear_attn/A_log", ("M",)),
        R(hf + "linear_attn.conv1d.weight", ("C", "1", "W"), ours + "linear_attn/conv_weight", ("C", "W"), Reshape()),
        R(
            hf + "linear_attn.in_proj_qkvz.weight",
            ("J*P", "E"),
            ours + "linear_attn/in_proj_qkvz/kernel",
            ("E", "J", "P"),
            Steps(Transpose(), Reshape()),
        ),
        R(
            hf + "linear_attn.in_proj_ba.weight",
            ("2*M", "E"),
            ours + "linear_attn/in_proj_ba/kernel",
            ("E", "J", "2*U"),
            Steps(Transpose(), Reshape()),
        ),
        R(hf + "linear_attn.norm.weight", ("D",), ours + "linear_attn/norm_weight", ("D",)),
        R(
            hf + "linear_attn.out_proj.weight",
            ("E", "M*D"),
            ours + "linear_attn/out_proj/kernel",
            ("M", "D", "E"),
            Steps(Transpose(), Reshape()),
        ),
    ]
    full = [
        R(
            hf + "self_attn.q_proj.weight",
            ("N*2*H", "E"),
            ours + "self_attn/q_proj/kernel",
            ("E", "N", "2*H"),
            Steps(Transpose(), Reshape()),
        ),
        R(
            hf + "self_attn.k_proj.weight",
            ("K*H", "E"),
            ours + "self_attn/k_proj/kernel",
            ("E", "K", "H"),
            Steps(Transpose(), Reshape()),
        ),
        R(
            hf + "self_attn.v_proj.weight",
            ("K*H", "E"),
            ours + "self_attn/v_proj/kernel",
            ("E", "K", "H"),
            Steps(Transpose(), Reshape()),
        ),
        R(
            hf + "self_attn.o_proj.weight",
            ("E", "N*H"),
            ours + "self_attn/o_proj/kernel",
            ("N", "H", "E"),
            Steps(Transpose(), Reshape()),
        ),
        R(hf + "self_attn.q_norm.weight", ("H",), ours + "self_attn/q_norm/weight", ("H",)),
        R(hf + "self_attn.k_norm.weight", ("H",), ours + "self_attn/k_norm/weight", ("H",)),
    ]
    return linear, full


def _mlp_rows(fused: bool) -> tuple[list[weights.Row], list[weights.Row]]:
    """(a dense layer's rows, an MoE layer's rows): HF's mlp.* tensors -> our layers_{i}/mlp/*."""
    R, hf, ours = weights.row, "model.layers.{i}.mlp.", "layers_{i}/mlp/"

    def swiglu(prefix: str, width: str) -> list[weights.Row]:
        return [
            R(
                hf + prefix + "gate_proj.weight",
                (width, "E"),
                ours + prefix.replace(".", "/") + "gate_proj/kernel",
                ("E", width),
                Transpose(),
            ),
            R(
                hf + prefix + "up_proj.weight",
                (width, "E"),
                ours + prefix.replace(".", "/") + "up_proj/kernel",
                ("E", width),
                Transpose(),
            ),
            R(
                hf + prefix + "down_proj.weight",
                ("E", width),
                ours + prefix.replace(".", "/") + "down_proj/kernel",
                (width, "E"),
                Transpose(),
            ),
        ]

    experts = (
        moe.fused_expert_rows()
        if fused
        else moe.expert_rows(
            router=hf + "gate.weight",
            gate=hf + "experts.{j}.gate_proj.weight",
            up=hf + "experts.{j}.up_proj.weight",
            down=hf + "experts.{j}.down_proj.weight",
        )
    )
    shared = [
        *swiglu("shared_expert.", "S"),
        R(hf + "shared_expert_gate.weight", ("1", "E"), ours + "shared_expert_gate/kernel", ("E", "1"), Transpose()),
    ]
    return swiglu("", "G"), [*experts, *shared]


def weight_table(config: Qwen3NextConfig, *, fused: bool = False) -> list[weights.Row]:
    """HF's names -> our params: embeddings, each layer's norms, its token mixer (linear or full, as
    layer_types says) and its MLP (dense or MoE: per-expert or fused experts), the final norm, the head."""
    R = weights.row
    linear, full = _mixer_rows()
    dense, sparse = _mlp_rows(fused)
    norms = [
        R("model.layers.{i}.input_layernorm.weight", ("E",), "layers_{i}/input_layernorm/weight", ("E",)),
        R(
            "model.layers.{i}.post_attention_layernorm.weight",
            ("E",),
            "layers_{i}/post_attention_layernorm/weight",
            ("E",),
        ),
    ]
    kinds = (
        {r.name: "linear" for r in linear}
        | {r.name: "full" for r in full}
        | {r.name: "dense" for r in dense}
        | {r.name: "sparse" for r in sparse}
    )

    def kept(r: weights.Row) -> bool:
        """A layer's row of the kind its layer is (norms on every layer; other rows once, in place)."""
        parts = r.name.split(".")
        if not (r.name.startswith("model.layers.") and parts[2].isdigit()):
            return True
        i, kind = int(parts[2]), kinds.get(".".join([*parts[:2], "{i}", *parts[3:]]))
        mixer = "linear" if config.linear_layers[i] else "full"
        return kind is None or kind in (mixer, "sparse" if i in config.moe_layers else "dense")

    rows = [
        R("model.embed_tokens.weight", ("V", "E"), "embed_tokens/embedding", ("V", "E")),
        *norms,
        *linear,
        *full,
        *dense,
        *sparse,
        R("model.norm.weight", ("E",), "norm/weight", ("E",)),
        *weights.when(
            not config.tie_word_embeddings, R("lm_head.weight", ("V", "E"), "lm_head/kernel", ("E", "V"), Transpose())
        ),
    ]
    return [r for r in weights.expand(rows, config.num_hidden_layers) if kept(r)]


_pretrained.register_family("qwen3_next")(moe.loader(Qwen3NextConfig, Qwen3NextForCausalLM, weight_table))
