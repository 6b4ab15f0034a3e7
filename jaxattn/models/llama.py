"""Llama, Mistral and Qwen2 in Flax linen, on jaxattn.linen.MultiHeadAttention (GQA, RoPE): HF's *ForCausalLM.

    x = embed_tokens[ids]
    each layer:  x = x + o(attend(RoPE(q(RMSNorm(x))), RoPE(k(RMSNorm(x))), v(RMSNorm(x))))   causal, GQA
                 x = x + down(silu(gate(RMSNorm(x))) * up(RMSNorm(x)))                      SwiGLU
    logits = RMSNorm(x) @ lm_head (or embed_tokens.T when tied)

RoPE is the layer's own `rope` option: queries and keys are rotated after projection and before attention,
at `rope_positions` (HF's position_ids), and keys are cached already rotated, so decoding needs no
bookkeeping. The inverse frequencies follow HF's rope types "default", "linear" and "llama3"
(`jaxattn.models.rope_frequencies`); other rope types are refused by name. Qwen2 = Llama with q/k/v biases
(no o bias). Mistral = Llama with a sliding window on every layer when config.sliding_window is set (null:
none); Qwen2 slides the layers layer_types marks "sliding_attention" when use_sliding_window is set. The
window is HF's `kv_idx > q_idx - sliding_window` on cache slots, i.e. window=(sliding_window - 1, 0) with
is_causal (docs/positions.md); decoding applies it as a mask over the cache's slots (_masks.sliding_mask).

The stack, the causal-LM wrapper, the head, the decode cache and loading are the shared base's
(jaxattn/models/_decoder.py, with the calling convention and the axis letters; blocks and norms: _blocks.py,
_norms.py).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from . import _blocks, _decoder, _pretrained, weights


@dataclasses.dataclass(frozen=True)
class LlamaConfig(_decoder.DecoderConfig):
    qkv_bias: bool = False  # Qwen2: a bias on q, k and v only

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> LlamaConfig:
        """From a HF config.json dict (transformers >= 5: rope_parameters); refuses what is not implemented."""
        refuse = functools.partial(_pretrained.refuse, source)
        if config.get("hidden_act", "silu") != "silu":
            refuse("hidden_act", "'silu'", config["hidden_act"])
        if config.get("pretraining_tp", 1) != 1:
            refuse("pretraining_tp", "1", config["pretraining_tp"])
        layer_types = config.get("layer_types") or ["full_attention"]
        if config.get("model_type") != "qwen2" and set(layer_types) != {"full_attention"}:  # Mistral: HF ignores them
            refuse("layer_types", "only 'full_attention'", sorted(set(layer_types)))
        return cls.parse(
            config, source, qkv_bias=config.get("model_type") == "qwen2", windows=sliding_windows(config, source)
        )

    def model_type(self) -> str:
        """hf_config's model_type, else the one the fields imply: q/k/v biases qwen2, windows mistral, llama."""
        if self.hf_config and "model_type" in self.hf_config:
            return self.hf_config["model_type"]
        return "qwen2" if self.qkv_bias else "mistral" if self.windows else "llama"

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict): each model_type's own (Llama's biases, Mistral's
        sliding_window, Qwen2's use_sliding_window and layer_types)."""
        model_type = self.model_type()
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"model.config.hf_config['model_type']: expected one of {list(ARCHITECTURES)}, got {model_type!r}"
            )
        keys = {"model_type": model_type, "architectures": [ARCHITECTURES[model_type]], "hidden_act": "silu"}
        if model_type == "llama":
            keys |= {"attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias}
        elif model_type == "mistral":
            keys |= {"sliding_window": None, **self.sliding_window()}
        else:
            keys |= self.use_sliding_window_keys()
        return super().to_dict() | keys

    def attention_biases(self) -> tuple[str, ...]:
        if self.qkv_bias and not self.attention_bias:
            return ("query", "key", "value")
        return super().attention_biases()


ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def qwen2_slides(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") == "qwen2" and bool(config.get("use_sliding_window", False))


def sliding_windows(config: Mapping[str, Any], source) -> tuple:
    """HF's sliding_window W per layer (None: full attention), or () when no layer slides.

    Mistral: W on every layer (HF's MistralModel picks its mask by sliding_window alone); null = none.
    Qwen2: _decoder.use_sliding_window_layers. Llama: none."""
    if config.get("model_type") == "qwen2":
        return _decoder.use_sliding_window_layers(config, source)
    if config.get("model_type") == "mistral":
        return _decoder.every_layer_window(config, source)
    return ()


class LlamaForCausalLM(_decoder.CausalLM):
    """HF LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM: input_ids [B,T] -> logits [B,T,V]."""

    Block = _blocks.PreNormBlock  # Llama's own block, SwiGLU MLP


def weight_table(config: LlamaConfig) -> list[weights.Row]:
    """HF's names -> our params: the shared causal-LM rows and the gate/up/down MLP."""
    return weights.expand([*_decoder.causal_lm_rows(config), *_decoder.mlp_rows(config)], config.num_hidden_layers)


for _model_type in ("llama", "qwen2", "mistral"):
    _pretrained.register_family(_model_type)(_decoder.loader(LlamaConfig, LlamaForCausalLM, weight_table))
