"""Qwen3-MoE in Flax linen: Qwen 3's attention (per-head q/k RMS norms before RoPE) with a sparse mixture of
experts on every layer (HF's Qwen3MoeForCausalLM).

    x = embed_tokens[ids]
    each layer:  x = x + o(attend(RoPE(q_norm(q(h))), RoPE(k_norm(k(h))), v(h))),  h = RMSNorm(x)
                 x = x + moe(RMSNorm(x))     router logits r = h @ gate, p = softmax(r) (float32 or wider),
                                             the top num_experts_per_tok p, divided by their sum only with
                                             norm_topk_prob (HF's default: not), weighting the chosen
                                             experts' down(silu(gate(h)) * up(h)), F = moe_intermediate_size
    logits = RMSNorm(x) @ lm_head (or embed_tokens.T when tied)

The MoE is jaxattn.models.moe's (dense dispatch, stacked [X,E,F] expert weights, router logits sown as
"layer{i}.router", moe.load_balancing_loss: HF's aux_loss). The checkpoint's per-expert tensors
mlp.experts.{j}.{gate,up,down}_proj.weight (save_pretrained) or transformers 5's fused ones (a state_dict in
memory) fill them. The experts' count is num_local_experts (HF's attribute for num_experts; either key is
read). sliding_window: with use_sliding_window, on every layer (HF's Qwen3MoeModel picks one mask for all).
The FP8 releases' projections stay as stored by default (fp8_block set: _decoder.kept_fp8_rows' kernel_fp8 /
kernel_scale_inv, the experts' stacked [X,...]; decoded as each layer is applied).

Refused by name: dense layers among the experts' (mlp_only_layers other than [], decoder_sparse_step other
than 1: the released Qwen3-MoE models have neither), hidden_act other than "silu".

The stack, the causal-LM wrapper, the head, the decode cache and loading are the shared base's
(jaxattn/models/_decoder.py, with the calling convention and the axis letters; blocks and norms: _blocks.py,
_norms.py; X = experts).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from . import _decoder, _pretrained, moe, weights


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(moe.MoEConfig):
    num_local_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> Qwen3MoeConfig:
        """From a HF config.json dict; refuses by name what is not implemented."""
        refuse = functools.partial(_pretrained.refuse, source)
        if config.get("hidden_act", "silu") != "silu":
            refuse("hidden_act", "'silu'", config["hidden_act"])
        if config.get("mlp_only_layers"):
            refuse("mlp_only_layers", "[] or null (every layer a mixture of experts)", config["mlp_only_layers"])
        if config.get("decoder_sparse_step", 1) != 1:
            refuse("decoder_sparse_step", "1 (every layer a mixture of experts)", config["decoder_sparse_step"])
        window = config.get("sliding_window") if config.get("use_sliding_window") else None  # HF drops it
        windows = _decoder.every_layer_window({**config, "sliding_window": window}, source)
        experts = config.get("num_local_experts", config.get("num_experts", cls.num_local_experts))
        config = {**config, "num_local_experts": experts}
        return cls.parse(config, source, windows=windows, fp8_block=_decoder.fp8_block(config))

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict)."""
        return super().to_dict() | {
            "model_type": "qwen3_moe",
            "architectures": ["Qwen3MoeForCausalLM"],
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            "num_local_experts": self.num_local_experts,  # transformers 5's key (4's num_experts maps to it)
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "norm_topk_prob": self.norm_topk_prob,
            "mlp_only_layers": [],
            "decoder_sparse_step": 1,
            "use_sliding_window": bool(self.windows),
            "sliding_window": None,
            **self.sliding_window(),
            **self.fp8_quantization_config(),
        }

    def dims(self) -> dict[str, int]:
        """The decoder's with F an expert's intermediate size, and with kept FP8 kernels their scale grids."""
        dims = {**super().dims(), "F": self.moe_intermediate_size}
        return dims | self.fp8_grid(dims)

    def normalize_top_k(self) -> bool:
        return self.norm_topk_prob


class Qwen3MoeBlock(moe.MoEBlock):
    """The MoE block (softmax router, top k, renormalised with norm_topk_prob) with Qwen 3's q/k norms."""

    def attention_options(self) -> dict:
        return dict(qk_norm=self.norm())


class Qwen3MoeForCausalLM(_decoder.CausalLM):
    """HF Qwen3MoeForCausalLM: input_ids [B,T] -> logits [B,T,V]."""

    Block = Qwen3MoeBlock


def weight_table(config: Qwen3MoeConfig, *, fused: bool = False) -> list[weights.Row]:
    """HF's names -> our params: the shared causal-LM rows, the q/k norms, the router and the experts (per
    expert, stacked into one [X,...] leaf each, or fused)."""
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
    rows = [*_decoder.causal_lm_rows(config), *_decoder.qk_norm_rows(), *experts]
    rows = _decoder.kept_fp8_rows(rows) if config.fp8_block is not None else rows
    return weights.expand(rows, config.num_hidden_layers)


_pretrained.register_family("qwen3_moe")(moe.loader(Qwen3MoeConfig, Qwen3MoeForCausalLM, weight_table))
