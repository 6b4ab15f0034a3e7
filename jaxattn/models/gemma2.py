"""Gemma 2 in Flax linen, on jaxattn.linen.MultiHeadAttention (GQA, RoPE, window, softcap): HF's Gemma2ForCausalLM.

    x = embed_tokens[ids] * sqrt(E)                          (the scale rounded to the embedding dtype, as HF)
    each layer:  x = x + post_attention_norm(o(attend(q, k, v)))     attend: causal, GQA, RoPE,
                                                                     scale query_pre_attn_scalar ** -0.5,
                                                                     c * tanh(logit / c) (attn softcap),
                                                                     sliding layers: window=(W - 1, 0)
                 x = x + post_feedforward_norm(down(gelu_tanh(gate(h)) * up(h))),  h = pre_feedforward_norm(x)
    logits = c * tanh((norm(x) @ embed_tokens.T) / c)        (final_logit_softcapping c; tied by default)

Norms are Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), all in float32 or wider, then cast
back (HF: "(x * w).to(float16)", unlike Llama). Which layers slide: config.layer_types (HF fills it when
absent: even layers "sliding_attention", odd ones "full_attention"). head_dim is its own setting (not
hidden_size / num_heads). Weights: the shared causal-LM rows (Llama's names) plus the two feed-forward norms.

The stack, the causal-LM wrapper, the head, the decode cache and loading are the shared base's
(jaxattn/models/_decoder.py, with the calling convention and the axis letters; blocks and norms: _blocks.py,
_norms.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from . import _blocks, _decoder, _pretrained, weights


@dataclasses.dataclass(frozen=True)
class Gemma2Config(_decoder.DecoderConfig):
    query_pre_attn_scalar: float = 256
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    tie_word_embeddings: bool = True

    rms_norm: ClassVar[str] = "gemma"

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> Gemma2Config:
        """From a HF config.json dict; refuses by name what is not implemented."""
        _decoder.check_gemma(config, source)
        L = config["num_hidden_layers"]
        types = config.get("layer_types") or [_decoder.LAYER_TYPES[i % 2] for i in range(L)]  # HF's: even slide
        windows = _decoder.layer_windows(
            types, config.get("sliding_window"), L, source, why="the config has sliding layers"
        )
        nullable = ("attn_logit_softcapping", "final_logit_softcapping")  # null: no softcap
        return cls.parse(config, source, nullable=nullable, windows=windows)

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict)."""
        own = ("attention_bias", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
        return (
            super().to_dict()
            | {k: getattr(self, k) for k in own}
            | {
                "model_type": "gemma2",
                "architectures": ["Gemma2ForCausalLM"],
                "hidden_activation": "gelu_pytorch_tanh",
                "layer_types": self.layer_types(),
                **self.sliding_window(),
            }
        )


class Gemma2Block(_blocks.SandwichBlock):
    """Gemma's sandwich-norm block (gelu-tanh MLP) with Gemma 2's attention scale and softcap."""

    def attention_options(self) -> dict:
        c = self.config
        return dict(scale=c.query_pre_attn_scalar**-0.5, logit_softcap=c.attn_logit_softcapping)


class Gemma2ForCausalLM(_decoder.ScaledCausalLM):
    """HF Gemma2ForCausalLM: input_ids [B,T] -> logits [B,T,V] (sqrt(E)-scaled embeddings, softcapped logits)."""

    Block = Gemma2Block


def weight_table(config: Gemma2Config) -> list[weights.Row]:
    """HF's names -> our params: the shared causal-LM rows, the MLP and its sandwich norms."""
    rows = [*_decoder.causal_lm_rows(config), *_decoder.sandwich_norm_rows(), *_decoder.mlp_rows(config)]
    return weights.expand(rows, config.num_hidden_layers)


_pretrained.register_family("gemma2")(_decoder.loader(Gemma2Config, Gemma2ForCausalLM, weight_table))
