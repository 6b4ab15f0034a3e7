"""DeepSeek V3 in Flax linen: HF's DeepseekV3ForCausalLM (model_type "deepseek_v3"; Kimi K2 has its shape).

    x = embed_tokens[ids]
    each layer i:  x = x + mla(RMSNorm(x))                  multi-head latent attention (jaxattn.latent_attention)
                   x = x + mlp(RMSNorm(x))                  i < first_k_dense_replace: SwiGLU of width G, else MoE
    logits = RMSNorm(x) @ lm_head (or embed_tokens.T when tied)

    mla: q from x directly (q_lora_rank null) or through rms(x Wq_down) Wq_up; the latent c = rms(x W_latent)
         [C] and one rope key k_rope = rope(x W_key_rope) [R] per token; keys [k_nope | k_rope] and values
         from c through W_UK [C,N,Hn] and W_UV [C,N,Hv]; scale Hq ** -0.5 * mscale ** 2 (Hq = Hn + R;
         mscale = yarn_mscale(factor, mscale_all_dim) for a scaled rope with mscale_all_dim, else 1, as HF's
         yarn_apply_mscale); the rope parts rotated at rope_frequencies (of head dim R) and times yarn's
         attention factor (HF's cos and sin times attention_scaling).
    MoE(h) = shared_experts(h) + sum_x w_x expert_x(h)
         s = sigmoid(router(h)) [X] (in float32 or wider, as HF's);  choice = s + e_score_correction_bias
         groups: the X experts in n_group groups of X / n_group, each scored by the sum of its two largest
         choices; the topk_group best groups are eligible; the k = num_experts_per_tok largest choices among
         their experts are picked; w_x = s_x on them (the bias only selects), divided by their sum + 1e-20
         with norm_topk_prob, times routed_scaling_factor; zero elsewhere.
    shared_experts: a SwiGLU of width S = n_shared_experts * moe_intermediate_size; experts: SwiGLU of width F.

Decoding keeps MLA's compressed cache, per layer cached_latent [B,L,C] and cached_rope [B,L,R] (C + R
numbers per token and layer, against 2 N Hq / Hv of an expanded key/value cache), and attends from it in the
absorbed form (W_UK folded into the queries, W_UV after attention); a forward without the cache runs the
expanded form, as HF's (the two are equal numbers: tests/test_latent_attention.py).

The router's e_score_correction_bias (a buffer in HF, trained outside the loss by DeepSeek's balancing rule) is
the leaf mlp/score_correction_bias: its gradient is exactly zero (it only selects); a trainer that decays
weights should freeze it, as torch, where it is no parameter, does.

Params: self_attn holds latent.py's tree, except two fused leaves, as the checkpoint stores them:
latent_and_key_rope [E,C+R] (kv_a_proj_with_mqa: latent columns, then rope) and key_value_up [C,N,Hn+Hv]
(kv_b_proj: per head, nope then value), split at call time. Experts: moe's stacked [X,...] leaves, from
save_pretrained's per-expert tensors or the in-memory fused gate_up_proj.

Block FP8 (the released DeepSeek V3 / R1 files, quantization_config "fp8") stays as stored by default (fp8_block
set): every projection, MLA's five, the dense layers', the shared experts' and the experts', is a kernel_fp8 [out, in]
float8_e4m3fn with its kernel_scale_inv [ceil(out / br), ceil(in / bc)] (_decoder.kept_fp8_rows; the experts'
stacked [X,...]) in place of its kernel, decoded as each layer is applied (_blocks.kept_fp8 with kernel_layouts;
moe.StackedDense). The two fused leaves are decoded whole, then split as above.

Refused by name: hidden_act other than "silu", n_group not dividing n_routed_experts into groups of >= 2,
topk_group outside [1, n_group], num_experts_per_tok above the eligible experts, first_k_dense_replace
negative, a key/value head count other than the head count, rope types other than _rope_config's, mscale_all_dim
with a rope_type whose factor is unset.

Axis letters: _decoder's (V E N) and moe's (X); the MLA letters of jaxattn/_layers/latent.py: C latent,
R rope (HF's head_dim), Hn, Hv, Cq; Hq = Hn + R, Hkv = Hn + Hv, CR = C + R; F an expert's width, G the dense
layers', S the shared experts'.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .._layers.latent import latent_attention
from .._schemes import rope_scaling
from . import _blocks, _decoder, _pretrained, _rope_config, moe, weights
from .llama4 import SwiGLU
from .weights import Reshape, Steps, Transpose


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(moe.MoEConfig):
    """HF's DeepseekV3Config fields this port reads (defaults: HF's). num_local_experts is HF's
    n_routed_experts; head_dim is qk_rope_head_dim (HF sets it so: the rotary embedding's dim)."""

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    num_key_value_heads: int | None = 128
    rms_norm_eps: float = 1e-6
    num_local_experts: int = 256
    num_experts_per_tok: int = 8
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    softmax_scale: float = 0.0  # derived: Hq ** -0.5 * mscale ** 2 (HF's self.scaling)

    def outside_the_model(self, name: str) -> bool:
        """The multi-token-prediction layers a DeepSeek V3 checkpoint stores after the last layer
        (model.layers.{num_hidden_layers}.*, num_nextn_predict_layers of them): transformers ignores them too."""
        parts = name.split(".")
        return parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= self.num_hidden_layers

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> DeepseekV3Config:
        """From a HF config.json dict; refuses by name what is not implemented (see the module)."""
        refuse = functools.partial(_pretrained.refuse, source)
        moe.refuse_silu_and_jitter(config, refuse)
        X = config.get("n_routed_experts", cls.num_local_experts)
        N = config.get("num_attention_heads", cls.num_attention_heads)
        if config.get("num_key_value_heads") not in (None, N):
            refuse(
                "num_key_value_heads",
                f"null or {N} (num_attention_heads: MLA has no key/value groups)",
                config["num_key_value_heads"],
            )
        groups = config.get("n_group") or 1
        if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1 or X % groups or X // groups < 2:
            refuse(
                "n_group",
                f"an int dividing n_routed_experts={X} into groups of >= 2 experts (HF scores a group by its two best)",
                config.get("n_group"),
            )
        eligible = config.get("topk_group") or 1
        if isinstance(eligible, bool) or not isinstance(eligible, int) or not 1 <= eligible <= groups:
            refuse("topk_group", f"an int in [1, {groups}] (n_group)", config.get("topk_group"))
        k = config.get("num_experts_per_tok") or cls.num_experts_per_tok
        if isinstance(k, int) and k > eligible * (X // groups):
            refuse("num_experts_per_tok", f"at most {eligible * (X // groups)} (the experts of topk_group groups)", k)
        dense = config.get("first_k_dense_replace") or 0
        if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
            refuse("first_k_dense_replace", "an int >= 0", dense)
        R = config.get("qk_rope_head_dim", cls.qk_rope_head_dim)
        Hq = config.get("qk_nope_head_dim", cls.qk_nope_head_dim) + R
        parsed = cls.parse(
            config,
            source,
            nullable=("q_lora_rank",),
            num_local_experts=X,
            n_group=groups,
            topk_group=eligible,
            first_k_dense_replace=dense,
            head_dim=R,
            num_key_value_heads=N,
            softmax_scale=Hq**-0.5 * _mscale(config, refuse) ** 2,
            fp8_block=_decoder.fp8_block(config),
        )
        return parsed

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict)."""
        return super().to_dict() | {
            "model_type": "deepseek_v3",
            "architectures": ["DeepseekV3ForCausalLM"],
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_routed_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "routed_scaling_factor": self.routed_scaling_factor,
            "kv_lora_rank": self.kv_lora_rank,
            "q_lora_rank": self.q_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "v_head_dim": self.v_head_dim,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "first_k_dense_replace": self.first_k_dense_replace,
            "norm_topk_prob": self.norm_topk_prob,
            "rope_interleave": self.rope_interleave,
            "max_position_embeddings": self.max_position_embeddings,
            **self.fp8_quantization_config(),
        }

    def moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def dims(self) -> dict[str, int]:
        """The letters of the module (and with kept FP8 kernels their scale grids: fp8_grid)."""
        C, R, Hn, Hv = self.kv_lora_rank, self.qk_rope_head_dim, self.qk_nope_head_dim, self.v_head_dim
        F = self.moe_intermediate_size
        dims = {
            **super().dims(),
            "F": F,
            "G": self.intermediate_size,
            "S": self.n_shared_experts * F,
            "C": C,
            "R": R,
            "Hn": Hn,
            "Hv": Hv,
            "Hq": Hn + R,
            "Hkv": Hn + Hv,
            "CR": C + R,
            **({} if self.q_lora_rank is None else {"Cq": self.q_lora_rank}),
        }
        return dims | self.fp8_grid(dims)

    def fp8_sizes(self, d: Mapping[str, int]) -> dict[str, int]:
        """The sides of every FP8 weight [out, in]: MLA's (q_proj or q_a_proj / q_b_proj, kv_a_proj_with_mqa,
        kv_b_proj, o_proj), the dense layers', the shared experts' and the experts' SwiGLU."""
        sides = ("E", "F", "G", "S", "C", "CR", *(() if self.q_lora_rank is None else ("Cq",)))
        heads = {"NHq": d["N"] * d["Hq"], "NHkv": d["N"] * d["Hkv"], "NHv": d["N"] * d["Hv"]}
        return {a: d[a] for a in sides} | heads


def _mscale(config: Mapping[str, Any], refuse) -> float:
    """HF's yarn_apply_mscale: with a rope_type other than "default" and mscale_all_dim set, the softmax scale
    takes yarn_mscale(factor, mscale_all_dim) ** 2; else 1."""
    rope = _rope_config.rope_parameters(config)
    m = rope.get("mscale_all_dim") or 0
    if rope.get("rope_type", "default") == "default" or not m:
        return 1.0
    if rope.get("factor") is None:
        refuse(
            "rope_parameters['factor']", "a number when mscale_all_dim is set (HF's yarn_apply_mscale reads it)", None
        )
    return rope_scaling.yarn_mscale(float(rope["factor"]), float(m))


# --- routing ------------------------------------------------------------------------------------------------------


def group_limited_weights(
    logits, correction_bias, *, top_k: int, n_group: int, topk_group: int, normalize: bool, scaling: float
):
    """Router logits [...,X] -> the experts' weights [...,X] (zero off each token's k picks): DeepSeek V3's
    sigmoid scores, picked by score + correction_bias among the experts of the topk_group best groups (a group's
    score: the sum of its two best), weighted by the plain scores (see the module). Float32 or wider."""
    wide = jnp.promote_types(logits.dtype, jnp.float32)
    scores = jax.nn.sigmoid(logits.astype(wide))
    choice = scores + correction_bias.astype(wide)
    X = choice.shape[-1]
    grouped = choice.reshape(*choice.shape[:-1], n_group, X // n_group)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [...,n_group]
    _, best_groups = jax.lax.top_k(group_scores, topk_group)
    eligible = jnp.sum(jax.nn.one_hot(best_groups, n_group, dtype=bool), axis=-2)  # [...,n_group]
    eligible = jnp.repeat(eligible, X // n_group, axis=-1)  # [...,X]
    _, picked = jax.lax.top_k(jnp.where(eligible, choice, -jnp.inf), top_k)
    weights = jnp.take_along_axis(scores, picked, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    weights = weights * scaling
    return jnp.einsum("...k,...kx->...x", weights, jax.nn.one_hot(picked, X, dtype=weights.dtype))


class DeepseekMoE(_decoder.Configured):
    """DeepseekV3MoE: x [...,E] -> (shared_experts(x) + sum_x w_x expert_x(x) [...,E], router logits [...,X])."""

    @nn.compact
    def __call__(self, x):
        c, d = self.config, self.config.dims()
        wide = jnp.promote_types(x.dtype, jnp.float32)  # HF: the router's input and weight in float32
        logits = nn.Dense(
            d["X"], use_bias=False, dtype=wide, param_dtype=self.param_dtype, precision=self.precision, name="router"
        )(x)
        bias = self.param("score_correction_bias", nn.initializers.zeros, (d["X"],), self.param_dtype)
        weights = group_limited_weights(
            logits,
            bias,
            top_k=c.num_experts_per_tok,
            n_group=c.n_group,
            topk_group=c.topk_group,
            normalize=c.norm_topk_prob,
            scaling=c.routed_scaling_factor,
        )
        out = moe.Experts(c, self.dtype, self.param_dtype, self.precision, self.sharding, name="experts")(x)
        routed = jnp.einsum("...xe,...x->...e", out, weights.astype(out.dtype), precision=self.precision)
        shared = SwiGLU(
            c, self.dtype, self.param_dtype, self.precision, self.sharding, features=d["S"], name="shared_experts"
        )(x)
        return routed + shared, logits


# --- attention ---------------------------------------------------------------------------------------------------


class _Leaves(nn.Module):
    """A named group of params (kernel, bias, scale), no computation: {name: leaf}."""

    shapes: tuple  # ((name, shape, initializer), ...)
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self) -> dict:
        return {name: self.param(name, init, shape, self.param_dtype) for name, shape, init in self.shapes}


class LatentSelfAttention(_decoder.Configured):
    """DeepseekV3Attention: x [B,T,E] -> [B,T,E] through jaxattn.latent_attention; with decode, the "cache"
    collection holds cached_latent [B,L,C], cached_rope [B,L,R] and cache_index [B] (jaxattn.linen's cache
    convention: made by the first call, L the length of that call's input)."""

    def _tree(self) -> dict:
        """latent_attention's params tree from this layer's leaves (the two fused ones split)."""
        c, d = self.config, self.config.dims()
        kernel = nn.initializers.lecun_normal()
        zeros, ones = nn.initializers.zeros, nn.initializers.ones

        def group(name, shape, *, bias=False, fan_in=(0,)):
            init = nn.initializers.lecun_normal(in_axis=fan_in, out_axis=-1) if len(shape) == 3 else kernel
            leaves = (("kernel", shape, init), *((("bias", shape[-1:], zeros),) if bias else ()))
            return _Leaves(leaves, self.param_dtype, name=name)()

        def scale(name, n):
            return {"scale": _Leaves((("scale", (n,), ones),), self.param_dtype, name=name)()["scale"]}

        b = c.attention_bias
        if c.q_lora_rank is None:
            tree = {"query": group("query", (d["E"], d["N"], d["Hq"]))}
        else:
            tree = {
                "query_down": group("query_down", (d["E"], d["Cq"]), bias=b),
                "query_norm": scale("query_norm", d["Cq"]),
                "query_up": group("query_up", (d["Cq"], d["N"], d["Hq"])),
            }
        fused = group("latent_and_key_rope", (d["E"], d["CR"]), bias=b)
        kv_up = group("key_value_up", (d["C"], d["N"], d["Hkv"]))["kernel"]
        C, Hn = d["C"], d["Hn"]
        tree["latent"] = {k: v[..., :C] for k, v in fused.items()}
        tree["key_rope"] = {k: v[..., C:] for k, v in fused.items()}
        tree["latent_norm"] = scale("latent_norm", C)
        tree["key_up"], tree["value_up"] = {"kernel": kv_up[..., :Hn]}, {"kernel": kv_up[..., Hn:]}
        tree["out"] = group("out", (d["N"], d["Hv"], d["E"]), bias=b, fan_in=(0, 1))
        return tree

    @nn.compact
    def __call__(self, x, mask, positions, decode: bool):
        c = self.config
        tree = self._tree()
        dtype = self.dtype if self.dtype is not None else jnp.result_type(x, *jax.tree.leaves(tree))
        tree, x = jax.tree.map(lambda a: jnp.asarray(a, dtype), (tree, x))
        options = dict(
            positions=positions,
            scale=c.softmax_scale,
            rope_frequencies=np.asarray(c.rope_frequencies),
            rope_layout="interleaved" if c.rope_interleave else "half",
            rope_attention_factor=c.rope_attention_factor,
            precision=self.precision,
            mask=mask,
            implementation=c.implementation,
        )
        if not decode:
            return latent_attention(tree, x, form="expanded", is_causal=True, **options)
        B, L = x.shape[:2]
        existed = self.has_variable("cache", "cached_latent")
        names = ("cached_latent", "cached_rope", "cache_index")
        fresh = ((B, L, c.kv_lora_rank), dtype), ((B, L, c.qk_rope_head_dim), dtype), ((B,), jnp.int32)
        variables = [self.variable("cache", n, jnp.zeros, shape, t) for n, (shape, t) in zip(names, fresh)]
        if not existed:  # making the cache (its shapes): the output is not used
            return latent_attention(tree, x, form="expanded", is_causal=True, **options)
        y, cache = latent_attention(tree, x, form="absorbed", cache=tuple(v.value for v in variables), **options)
        for variable, new in zip(variables, cache):
            variable.value = new
        return y


def kernel_layouts(config: DeepseekV3Config) -> dict:
    """LatentSelfAttention's kernels as _blocks.kept_fp8 reads them: {path: (our shape, its leading input axes)},
    each the checkpoint's [out, in] transposed and reshaped (kv_b_proj [N*Hkv, C] decoded whole in its blocks,
    then [C, N, Hkv]: a block may straddle two heads)."""
    d = config.dims()
    E, N, C, CR, Hq, Hkv, Hv = (d[a] for a in ("E", "N", "C", "CR", "Hq", "Hkv", "Hv"))
    query = (
        {("query",): ((E, N, Hq), 1)}
        if config.q_lora_rank is None
        else {("query_down",): ((E, d["Cq"]), 1), ("query_up",): ((d["Cq"], N, Hq), 1)}
    )
    return {
        **query,
        ("latent_and_key_rope",): ((E, CR), 1),
        ("key_value_up",): ((C, N, Hkv), 1),
        ("out",): ((N, Hv, E), 2),
    }


# --- the block and the model ----------------------------------------------------------------------------------------


class DeepseekV3Block(_blocks.PreNormBlock):
    """Llama's pre-norm block with MLA and (from first_k_dense_replace on) DeepSeek's MoE; rows as
    PreNormBlock's ("router" on MoE layers)."""

    def feed_forward(self, x):
        c = self.config
        options = dict(
            dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision, sharding=self.sharding, name="mlp"
        )
        if c.moe_layer(self.layer):
            y, logits = DeepseekMoE(c, **options)(x)
            return y, {"router": logits}
        return SwiGLU(c, features=c.dims()["G"], **options)(x), {}

    @nn.compact
    def __call__(self, x, mask, positions, decode: bool, window=None):
        norm = self.norm()
        attention = _blocks.kept_fp8(self, LatentSelfAttention, kernel_layouts(self.config))
        a = attention(self.config, self.dtype, self.param_dtype, self.precision, self.sharding, name="self_attn")(
            norm(name="input_layernorm")(x), mask, positions, decode
        )
        x = x + a
        m, rows = self.feed_forward(norm(name="post_attention_layernorm")(x))
        return x + m, {"attention": a, **rows, "mlp": m}


class DeepseekV3ForCausalLM(_decoder.CausalLM):
    """HF DeepseekV3ForCausalLM: input_ids [B,T] -> logits [B,T,V] (the calling convention of _decoder)."""

    Block = DeepseekV3Block


def cache_numbers_per_token(config: DeepseekV3Config) -> int:
    """The decode cache's numbers per token and layer: C + R (an expanded key/value cache: N (Hq + Hv))."""
    return config.kv_lora_rank + config.qk_rope_head_dim


# --- weights ------------------------------------------------------------------------------------------------------

HEADS = Steps(Transpose(), Reshape())  # nn.Linear [N*H,E] -> [E,N,H] (and [E,N*H] -> [N,H,E])


def _attention_rows(config: DeepseekV3Config) -> list[weights.Row]:
    R, hf, ours, b = weights.row, "model.layers.{i}.self_attn.", "layers_{i}/self_attn/", config.attention_bias
    if config.q_lora_rank is None:
        query = [R(hf + "q_proj.weight", ("N*Hq", "E"), ours + "query/kernel", ("E", "N", "Hq"), HEADS)]
    else:
        query = [
            R(hf + "q_a_proj.weight", ("Cq", "E"), ours + "query_down/kernel", ("E", "Cq"), Transpose()),
            *weights.when(b, R(hf + "q_a_proj.bias", ("Cq",), ours + "query_down/bias", ("Cq",))),
            R(hf + "q_a_layernorm.weight", ("Cq",), ours + "query_norm/scale", ("Cq",)),
            R(hf + "q_b_proj.weight", ("N*Hq", "Cq"), ours + "query_up/kernel", ("Cq", "N", "Hq"), HEADS),
        ]
    return [
        *query,
        R(hf + "kv_a_proj_with_mqa.weight", ("CR", "E"), ours + "latent_and_key_rope/kernel", ("E", "CR"), Transpose()),
        *weights.when(b, R(hf + "kv_a_proj_with_mqa.bias", ("CR",), ours + "latent_and_key_rope/bias", ("CR",))),
        R(hf + "kv_a_layernorm.weight", ("C",), ours + "latent_norm/scale", ("C",)),
        R(hf + "kv_b_proj.weight", ("N*Hkv", "C"), ours + "key_value_up/kernel", ("C", "N", "Hkv"), HEADS),
        R(hf + "o_proj.weight", ("E", "N*Hv"), ours + "out/kernel", ("N", "Hv", "E"), HEADS),
        *weights.when(b, R(hf + "o_proj.bias", ("E",), ours + "out/bias", ("E",))),
    ]


def _swiglu_rows(hf: str, ours: str, width: str) -> list[weights.Row]:
    R = weights.row
    return [
        R(hf + "gate_proj.weight", (width, "E"), ours + "gate_proj/kernel", ("E", width), Transpose()),
        R(hf + "up_proj.weight", (width, "E"), ours + "up_proj/kernel", ("E", width), Transpose()),
        R(hf + "down_proj.weight", ("E", width), ours + "down_proj/kernel", (width, "E"), Transpose()),
    ]


def _moe_rows(fused: bool) -> list[weights.Row]:
    """An MoE layer's router (weight, correction bias), experts (per expert or fused) and shared experts."""
    experts = (
        moe.fused_expert_rows()
        if fused
        else moe.expert_rows(
            router="model.layers.{i}.mlp.gate.weight",
            gate="model.layers.{i}.mlp.experts.{j}.gate_proj.weight",
            up="model.layers.{i}.mlp.experts.{j}.up_proj.weight",
            down="model.layers.{i}.mlp.experts.{j}.down_proj.weight",
        )
    )
    return [
        *experts,
        weights.row(
            "model.layers.{i}.mlp.gate.e_score_correction_bias", ("X",), "layers_{i}/mlp/score_correction_bias", ("X",)
        ),
        *_swiglu_rows("model.layers.{i}.mlp.shared_experts.", "layers_{i}/mlp/shared_experts/", "S"),
    ]


def weight_table(config: DeepseekV3Config, *, fused: bool = False) -> list[weights.Row]:
    """HF's names -> our params, layer by layer: norms, MLA, then the dense SwiGLU (layers before
    first_k_dense_replace) or the MoE."""
    R = weights.row
    norms = [
        R("model.layers.{i}.input_layernorm.weight", ("E",), "layers_{i}/input_layernorm/weight", ("E",)),
        R(
            "model.layers.{i}.post_attention_layernorm.weight",
            ("E",),
            "layers_{i}/post_attention_layernorm/weight",
            ("E",),
        ),
    ]
    shared = [*norms, *_attention_rows(config)]
    dense = _swiglu_rows("model.layers.{i}.mlp.", "layers_{i}/mlp/", "G")
    layers = []
    for i in range(config.num_hidden_layers):
        rows = [*shared, *(_moe_rows(fused) if config.moe_layer(i) else dense)]
        rows = _decoder.kept_fp8_rows(rows) if config.fp8_block is not None else rows
        layers += weights.expand(rows, i + 1)[i * len(rows) :]  # layer i's rows ("{i}" = i)
    return [
        R("model.embed_tokens.weight", ("V", "E"), "embed_tokens/embedding", ("V", "E")),
        *layers,
        R("model.norm.weight", ("E",), "norm/weight", ("E",)),
        *weights.when(
            not config.tie_word_embeddings, R("lm_head.weight", ("V", "E"), "lm_head/kernel", ("E", "V"), Transpose())
        ),
    ]


_pretrained.register_family("deepseek_v3")(moe.loader(DeepseekV3Config, DeepseekV3ForCausalLM, weight_table))

__all__ = ["DeepseekV3Config", "DeepseekV3ForCausalLM", "cache_numbers_per_token", "group_limited_weights"]
