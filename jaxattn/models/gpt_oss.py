"""gpt-oss in Flax linen: attention with learned sinks on alternating sliding/global layers, and a sparse
mixture of experts with biases and a clamped SwiGLU (HF's GptOssForCausalLM).

    x = embed_tokens[ids]
    each layer:  x = x + o(attend(RoPE(q(h)), RoPE(k(h)), v(h))),  h = RMSNorm(x)   causal, GQA, q/k/v/o biases,
                                                                  a learned sink logit per head (sinks [N]),
                                                                  sliding layers: window=(W - 1, 0)
                 x = x + moe(RMSNorm(x))     router logits r = h @ router + b, the top num_experts_per_tok r,
                                             softmaxed among themselves; each expert:
                                             down((up + 1) * g * sigmoid(alpha * g)) + b_down,
                                             g = min(gate, limit), up clipped to [-limit, limit] (both + b)
    logits = RMSNorm(x) @ lm_head

Attention is the layer's `use_sinks` option (params self_attn/sinks [N], HF's self_attn.sinks) and its
window. Which layers slide: layer_types (HF's default: even layers sliding, odd ones global). RoPE: HF's
default for gpt-oss is yarn (factor 32 over 4096 positions, beta 32/1, untruncated), used when the config
has no rope_parameters; yarn's attention factor scales cos and sin (here: the logits' scale, by its square).
Norms: GptOssRMSNorm's rounding, (weight * normed).astype(x.dtype).

Experts (jaxattn.models.moe.SparseMoE, dense dispatch): the checkpoint stores them fused, experts.gate_up_proj
[X,E,2F] with gate and up INTERLEAVED along the last axis (gate = [..., ::2], up = [..., 1::2]) and its bias
[X,2F], experts.down_proj [X,F,E] and its bias [X,E]; the table splits the interleaved columns with the
Every(k, 2, axis) transform into experts/gate_proj and experts/up_proj ([X,E,F], [X,F]). Each layer
sows its router's logits ("layer{i}.router"; moe.load_balancing_loss: HF's aux_loss).

The released checkpoints' MXFP4 experts (experts.gate_up_proj_blocks / _scales, down_proj_blocks / _scales)
stay packed by default (experts_format "mxfp4": mxfp4_expert_rows fill each projection's kernel_blocks and
kernel_scales, gate and up split from the interleaved rows by Every(k, 2, 1); moe.StackedDense decodes
them in the matmul), or are decoded as from_pretrained reads them (dequantize=True or a dtype:
jaxattn.models.quantized) into the table's gate_up_proj and down_proj.

Refused by name: hidden_act other than "silu" (HF's gpt-oss ignores it: its experts always use the clamped
SwiGLU).

The stack, the causal-LM wrapper, the head, the decode cache and loading are the shared base's
(jaxattn/models/_decoder.py, with the calling convention and the axis letters; blocks and norms: _blocks.py,
_norms.py; X = experts).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any, ClassVar

from . import _decoder, _pretrained, moe, quantized, weights
from .weights import Every, Target, Transpose

# what the released gpt-oss files keep unquantized (their quantization_config's modules_to_not_convert)
NOT_MXFP4 = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]

# HF's GptOssConfig rope_parameters when the config has none (rope_theta: its default_theta)
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
    "rope_theta": 150000.0,
}


@dataclasses.dataclass(frozen=True)
class GptOssConfig(moe.MoEConfig):
    rms_norm_eps: float = 1e-5
    head_dim: int | None = 64
    attention_bias: bool = True
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    rms_norm: ClassVar[str] = "gpt_oss"
    routing: ClassVar[str] = "topk_softmax"
    router_bias: ClassVar[bool] = True
    expert_bias: ClassVar[bool] = True

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> GptOssConfig:
        """From a HF config.json dict; refuses by name what is not implemented."""
        refuse = functools.partial(_pretrained.refuse, source)
        if config.get("hidden_act", "silu") != "silu":
            refuse("hidden_act", "'silu' (transformers' gpt-oss experts ignore it)", config["hidden_act"])
        L = config["num_hidden_layers"]
        types = config.get("layer_types") or [_decoder.LAYER_TYPES[i % 2] for i in range(L)]  # HF's: even slide
        windows = _decoder.layer_windows(
            types, config.get("sliding_window"), L, source, why="the config has sliding layers"
        )
        rope = config.get("rope_parameters") or {**DEFAULT_ROPE, "rope_theta": config.get("rope_theta", 150000.0)}
        packed = (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"
        if packed:
            for key in ("hidden_size", "intermediate_size"):
                if config.get(key, 0) % quantized.MX_GROUP:
                    refuse(key, f"a multiple of {quantized.MX_GROUP} (MXFP4 experts: one scale per 32)", config[key])
        return cls.parse(config, source, windows=windows, rope=rope, experts_format="mxfp4" if packed else None)

    def dims(self) -> dict[str, int]:
        """moe's, and with MXFP4 experts the scale groups of E and F (Eg = E / 32, Fg = F / 32)."""
        dims = super().dims()
        if self.experts_format == "mxfp4":
            dims |= {"Eg": dims["E"] // quantized.MX_GROUP, "Fg": dims["F"] // quantized.MX_GROUP}
        return dims

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict; swiglu_alpha is HF's constant, not a config key; the
        rope settings come from hf_config, else HF's default yarn, checked on the way back)."""
        return super().to_dict() | {
            "model_type": "gpt_oss",
            "architectures": ["GptOssForCausalLM"],
            "attention_bias": self.attention_bias,
            "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "swiglu_limit": self.swiglu_limit,
            "layer_types": self.layer_types(),
            **self.sliding_window(),
            **self.quantization_config(),
        }

    def quantization_config(self) -> dict:
        """{"quantization_config": ...} for MXFP4 experts (hf_config's, else transformers' for gpt-oss), or {}."""
        if self.experts_format != "mxfp4":
            return {}
        read = (self.hf_config or {}).get("quantization_config")
        return {"quantization_config": read or {"quant_method": "mxfp4", "modules_to_not_convert": NOT_MXFP4}}

    def expert_activation(self, gate, up):
        return moe.clamped_swiglu(gate, up, alpha=self.swiglu_alpha, limit=self.swiglu_limit)


class GptOssBlock(moe.MoEBlock):
    """The MoE block (biased router: top k then softmax; biased experts: clamped SwiGLU) with attention sinks."""

    def attention_options(self) -> dict:
        return dict(use_sinks=True)


class GptOssForCausalLM(_decoder.CausalLM):
    """HF GptOssForCausalLM: input_ids [B,T] -> logits [B,T,V]."""

    Block = GptOssBlock


def weight_table(config: GptOssConfig) -> list[weights.Row]:
    """HF's names -> our params: the shared causal-LM rows, the sinks, the router and the fused experts
    (gate/up columns interleaved: split by Every(k, 2, axis))."""
    R = weights.row
    experts = "model.layers.{i}.mlp.experts."
    ours = "layers_{i}/mlp/experts/"
    kernels = mxfp4_expert_rows() if config.experts_format == "mxfp4" else plain_expert_rows()
    return weights.expand(
        [
            *_decoder.causal_lm_rows(config),
            R("model.layers.{i}.self_attn.sinks", ("N",), "layers_{i}/self_attn/sinks", ("N",)),
            R(
                "model.layers.{i}.mlp.router.weight",
                ("X", "E"),
                "layers_{i}/mlp/router/kernel",
                ("E", "X"),
                Transpose(),
            ),
            R("model.layers.{i}.mlp.router.bias", ("X",), "layers_{i}/mlp/router/bias", ("X",)),
            *kernels[0],
            weights.Row(
                experts + "gate_up_proj_bias",
                ("X", "2*F"),
                (
                    Target(ours + "gate_proj/bias", ("X", "F"), Every(0, 2, 1)),
                    Target(ours + "up_proj/bias", ("X", "F"), Every(1, 2, 1)),
                ),
            ),
            *kernels[1],
            R(experts + "down_proj_bias", ("X", "E"), ours + "down_proj/bias", ("X", "E")),
        ],
        config.num_hidden_layers,
    )


def plain_expert_rows() -> tuple[list[weights.Row], list[weights.Row]]:
    """(gate_up rows, down rows) of the experts' kernels as float tensors: gate_up_proj [X,E,2F] (gate and up
    columns interleaved), down_proj [X,F,E]."""
    experts, ours = "model.layers.{i}.mlp.experts.", "layers_{i}/mlp/experts/"
    return [
        weights.Row(
            experts + "gate_up_proj",
            ("X", "E", "2*F"),
            (
                Target(ours + "gate_proj/kernel", ("X", "E", "F"), Every(0, 2, 2)),
                Target(ours + "up_proj/kernel", ("X", "E", "F"), Every(1, 2, 2)),
            ),
        )
    ], [weights.row(experts + "down_proj", ("X", "F", "E"), ours + "down_proj/kernel", ("X", "F", "E"))]


def mxfp4_expert_rows() -> tuple[list[weights.Row], list[weights.Row]]:
    """(gate_up rows, down rows) of the experts' kernels kept packed, as the released files store them (rows
    = outputs, 32 inputs per scale): gate_up_proj_blocks [X,2F,Eg,16] and _scales [X,2F,Eg] (gate and up
    rows interleaved: every other row), down_proj_blocks [X,E,Fg,16] and _scales [X,E,Fg]; each
    projection's kernel_blocks and kernel_scales (moe.StackedDense decodes them in the matmul)."""
    experts, ours = "model.layers.{i}.mlp.experts.", "layers_{i}/mlp/experts/"
    gate_up, down = [], []
    for part, tail in (("blocks", ("16",)), ("scales", ())):
        gate_up.append(
            weights.Row(
                experts + f"gate_up_proj_{part}",
                ("X", "2*F", "Eg", *tail),
                (
                    Target(ours + f"gate_proj/kernel_{part}", ("X", "F", "Eg", *tail), Every(0, 2, 1)),
                    Target(ours + f"up_proj/kernel_{part}", ("X", "F", "Eg", *tail), Every(1, 2, 1)),
                ),
            )
        )
        down.append(
            weights.row(
                experts + f"down_proj_{part}",
                ("X", "E", "Fg", *tail),
                ours + f"down_proj/kernel_{part}",
                ("X", "E", "Fg", *tail),
            )
        )
    return gate_up, down


_pretrained.register_family("gpt_oss")(_decoder.loader(GptOssConfig, GptOssForCausalLM, weight_table))
