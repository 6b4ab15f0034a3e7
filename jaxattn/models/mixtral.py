"""Mixtral in Flax linen: Mistral's attention with a sparse mixture-of-experts MLP (HF's MixtralForCausalLM).

    x = embed_tokens[ids]
    each layer:  x = x + o(attend(RoPE(q(h)), RoPE(k(h)), v(h))),  h = RMSNorm(x)      causal, GQA, window
                 x = x + moe(RMSNorm(x))     router logits r = h @ router, p = softmax(r) (float32 or wider),
                                             the top num_experts_per_tok experts, their p renormalised,
                                             y = sum of their down(silu(gate(h)) * up(h)) weighted by them
    logits = RMSNorm(x) @ lm_head

The MoE is jaxattn.models.moe.SparseMoE (dense dispatch, cost and layout there): its params are one stacked
array per projection and layer, experts/{gate_proj,up_proj,down_proj}/kernel [X,E,F] / [X,F,E], filled
from the checkpoint's per-expert tensors block_sparse_moe.experts.{j}.w1 / w3 / w2 (what transformers 5.24's
save_pretrained writes) by stacked rows of the weight table, or from the fused tensors of transformers 5's
modules (a model's state_dict in memory: mlp.experts.gate_up_proj [X,2F,E], gate rows first, and
mlp.experts.down_proj [X,E,F]); the loader picks the table by the names present. Each layer sows its router's logits
("layer{i}.router"); moe.load_balancing_loss turns them into HF's aux_loss.

sliding_window: on every layer when set (Mistral's rule, _decoder.every_layer_window). router_jitter_noise
(training-time noise on the router's input) is refused unless 0; router_aux_loss_coef and
output_router_logits only weigh and return the auxiliary loss, which is moe.load_balancing_loss here. A config
without rope settings has HF's Mixtral default, rope_theta 1e6.

The stack, the causal-LM wrapper, the head, the decode cache and loading are the shared base's
(jaxattn/models/_decoder.py, with the calling convention and the axis letters; blocks and norms: _blocks.py,
_norms.py; X = experts).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from . import _decoder, _pretrained, _rope_config, moe, weights

# HF's MixtralConfig rope_theta when a config has none (not Llama's 10 000, _decoder's default): a config read
# or written without rope settings means the same frequencies here and in transformers.
DEFAULT_ROPE_THETA = 1e6


@dataclasses.dataclass(frozen=True)
class MixtralConfig(moe.MoEConfig):
    rms_norm_eps: float = 1e-5

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> MixtralConfig:
        """From a HF config.json dict; refuses by name what is not implemented."""
        refuse = functools.partial(_pretrained.refuse, source)
        moe.refuse_silu_and_jitter(config, refuse)
        rope = _rope_config.rope_parameters({"rope_theta": DEFAULT_ROPE_THETA, **config})
        return cls.parse(config, source, windows=_decoder.every_layer_window(config, source), rope=rope)

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict)."""
        return super().to_dict() | {
            "model_type": "mixtral",
            "architectures": ["MixtralForCausalLM"],
            "hidden_act": "silu",
            "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "router_jitter_noise": 0.0,
            "sliding_window": None,
            **self.sliding_window(),
        }


class MixtralForCausalLM(_decoder.CausalLM):
    """HF MixtralForCausalLM: input_ids [B,T] -> logits [B,T,V]."""

    Block = moe.MoEBlock  # Llama's block, a SparseMoE for its MLP: softmax, top k, renormalised; SwiGLU experts


def weight_table(config: MixtralConfig, *, fused: bool = False) -> list[weights.Row]:
    """HF's names -> our params: the shared causal-LM rows, the router and the experts: the per-expert w1
    (gate), w3 (up) and w2 (down) stacked into one [X,...] leaf each, or (fused) split from gate_up_proj."""
    experts = (
        moe.fused_expert_rows()
        if fused
        else moe.expert_rows(
            router="model.layers.{i}.block_sparse_moe.gate.weight",
            gate="model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight",
            up="model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight",
            down="model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight",
        )
    )
    return weights.expand([*_decoder.causal_lm_rows(config), *experts], config.num_hidden_layers)


_pretrained.register_family("mixtral")(moe.loader(MixtralConfig, MixtralForCausalLM, weight_table))
