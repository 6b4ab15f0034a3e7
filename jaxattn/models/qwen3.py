"""Qwen 3 in Flax linen, on jaxattn.linen.MultiHeadAttention (GQA, RoPE, q/k norms): HF's Qwen3ForCausalLM.

    x = embed_tokens[ids]
    each layer:  q = RoPE(q_norm(q(h))), k = RoPE(k_norm(k(h))), h = RMSNorm(x)     q_norm, k_norm: RMS norms
                 x = x + o(attend(q, k, v(h)))                                       over each head's H features
                 x = x + down(silu(gate(RMSNorm(x))) * up(RMSNorm(x)))
    logits = RMSNorm(x) @ lm_head (or embed_tokens.T when tied)

Llama's block (_blocks.PreNormBlock) with the layer's qk_norm option: HF's Qwen3RMSNorm (Llama's rounding)
on every query and key head after projection, before RoPE, so the cache holds normed, rotated keys.
head_dim is its own setting (HF's default 128). attention_bias puts a bias on all four projections (none by
default; no q/k/v-only biases as Qwen 2 has). Which layers slide: layer_types, with use_sliding_window
(_decoder.use_sliding_window_layers, as Qwen 2). Rope types as _rope_config.rope_frequencies; others refused.
The FP8 releases' projections (block FP8, quantization_config "fp8") stay as stored by default: fp8_block set,
_decoder.kept_fp8_rows' kernel_fp8 / kernel_scale_inv params, decoded as each layer is applied (_blocks.kept_fp8).

The stack, the causal-LM wrapper, the head, the decode cache and loading are the shared base's
(jaxattn/models/_decoder.py, with the calling convention and the axis letters; blocks and norms: _blocks.py,
_norms.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from . import _blocks, _decoder, _pretrained, weights


@dataclasses.dataclass(frozen=True)
class Qwen3Config(_decoder.DecoderConfig):
    head_dim: int | None = 128

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> Qwen3Config:
        """From a HF config.json dict; refuses by name what is not implemented."""
        if config.get("hidden_act", "silu") != "silu":
            _pretrained.refuse(source, "hidden_act", "'silu'", config["hidden_act"])
        windows = _decoder.use_sliding_window_layers(config, source)
        return cls.parse(config, source, windows=windows, fp8_block=_decoder.fp8_block(config))

    def dims(self) -> dict[str, int]:
        """The decoder's, and with kept FP8 kernels their scale grids (fp8_grid)."""
        dims = super().dims()
        return dims | self.fp8_grid(dims)

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict)."""
        return super().to_dict() | {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            **self.use_sliding_window_keys(),
            **self.fp8_quantization_config(),
        }


class Qwen3Block(_blocks.PreNormBlock):
    """Llama's block with per-head RMS norms on queries and keys."""

    def attention_options(self) -> dict:
        return dict(qk_norm=self.norm())


class Qwen3ForCausalLM(_decoder.CausalLM):
    """HF Qwen3ForCausalLM: input_ids [B,T] -> logits [B,T,V]."""

    Block = Qwen3Block


def weight_table(config: Qwen3Config) -> list[weights.Row]:
    """HF's names -> our params: the shared causal-LM rows, the q/k norms and the gate/up/down MLP."""
    rows = [*_decoder.causal_lm_rows(config), *_decoder.qk_norm_rows(), *_decoder.mlp_rows(config)]
    rows = _decoder.kept_fp8_rows(rows) if config.fp8_block is not None else rows
    return weights.expand(rows, config.num_hidden_layers)


_pretrained.register_family("qwen3")(_decoder.loader(Qwen3Config, Qwen3ForCausalLM, weight_table))
