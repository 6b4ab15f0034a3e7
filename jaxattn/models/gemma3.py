"""Gemma 3 (text) in Flax linen, on jaxattn.linen.MultiHeadAttention (GQA, RoPE, window, q/k norms):
HF's Gemma3ForCausalLM, model_type "gemma3_text".

    x = embed_tokens[ids] * sqrt(E)                          (the scale rounded to the embedding dtype, as HF)
    each layer:  q = RoPE_l(q_norm(q(h))), k = RoPE_l(k_norm(k(h))),  h = input_layernorm(x)
                 x = x + post_attention_norm(o(attend(q, k, v(h))))   attend: causal, GQA,
                                                                      scale query_pre_attn_scalar ** -0.5,
                                                                      sliding layers: window=(W - 1, 0)
                 x = x + post_feedforward_norm(down(gelu_tanh(gate(m)) * up(m))),  m = pre_feedforward_norm(x)
    logits = c * tanh((norm(x) @ embed_tokens.T) / c)        (final_logit_softcapping c if set; tied by default)

Gemma 2's sandwich block (_blocks.SandwichBlock, (1 + w) RMS norms) with two differences: per-head q/k
norms (Gemma's (1 + w) rounding) before RoPE, and two rotary embeddings: RoPE_l is the local one on the
layers layer_types marks "sliding_attention" (rope_parameters['sliding_attention']: "default" at 10 000 in
Google's configs) and the global one on the others (rope_parameters['full_attention']: "linear" scaling in
Google's 4B-27B configs). transformers 4's keys map as HF maps them: rope_theta and rope_scaling to the global
layers, rope_local_base_freq to the local ones. layer_types, when absent: every sliding_window_pattern-th
layer (default 6) global, the others sliding. Both rope settings go through _rope_config.rope_frequencies
(types "default", "linear", "llama3", "yarn"); others are refused by name. use_bidirectional_attention
(Gemma 3's embedding variant) is refused, and so is attn_logit_softcapping other than null: HF's
Gemma3TextConfig keeps it, but its Gemma3Attention never passes it to the attention (transformers 5.24), so
no value but null has a reference to match.

The stack, the causal-LM wrapper, the head, the decode cache and loading are the shared base's
(jaxattn/models/_decoder.py, with the calling convention and the axis letters; blocks and norms: _blocks.py,
_norms.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from . import _blocks, _decoder, _pretrained, _rope_config, weights

# HF's default rope_theta per layer type (Gemma3TextConfig.default_theta)
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


@dataclasses.dataclass(frozen=True)
class Gemma3Config(_decoder.DecoderConfig):
    head_dim: int | None = 256
    query_pre_attn_scalar: float = 256
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True
    sliding_rope_frequencies: tuple = ()  # the local layers' rotary embedding (rope_frequencies: the global's)
    sliding_rope_attention_factor: float = 1.0

    rms_norm: ClassVar[str] = "gemma"

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> Gemma3Config:
        """From a HF config.json dict; refuses by name what is not implemented."""
        _decoder.check_gemma(config, source)
        if config.get("attn_logit_softcapping") is not None:  # HF's Gemma3Attention never applies it
            _pretrained.refuse(
                source,
                "attn_logit_softcapping",
                "null (transformers' Gemma 3 attention does not apply it)",
                config["attn_logit_softcapping"],
            )
        L, pattern = config["num_hidden_layers"], config.get("sliding_window_pattern", 6)
        types = config.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(L)
        ]
        windows = _decoder.layer_windows(
            types, config.get("sliding_window"), L, source, why="the config has sliding layers"
        )
        ropes = layer_type_ropes(config, source)
        parsed = cls.parse(
            config,
            source,
            nullable=("final_logit_softcapping",),
            windows=windows,
            rope=ropes["full_attention"],
            rope_name="rope_parameters['full_attention']",
        )
        local = ropes["sliding_attention"]
        frequencies = _rope_config.rope_frequencies(
            config, parsed.dims()["H"], source, rope=local, name="rope_parameters['sliding_attention']"
        )
        return dataclasses.replace(
            parsed,
            sliding_rope_frequencies=tuple(frequencies),
            sliding_rope_attention_factor=_rope_config.rope_attention_factor(config, local),
        )

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict; the ropes of both layer types come from hf_config, else
        HF's defaults, and to_pretrained checks they read back as these frequencies)."""
        own = ("attention_bias", "query_pre_attn_scalar", "final_logit_softcapping")
        return (
            super().to_dict()
            | {k: getattr(self, k) for k in own}
            | {
                "model_type": "gemma3_text",
                "architectures": ["Gemma3ForCausalLM"],
                "hidden_activation": "gelu_pytorch_tanh",
                "attn_logit_softcapping": None,
                "layer_types": self.layer_types(),
                **self.sliding_window(),
            }
        )

    def rope(self, layer: int | None) -> tuple[tuple, float]:
        if layer is not None and self.window(layer) is not None:
            return self.sliding_rope_frequencies, self.sliding_rope_attention_factor
        return super().rope(layer)


def layer_type_ropes(config: Mapping[str, Any], source) -> dict[str, dict]:
    """{layer type: its rope settings}, as Gemma3TextConfig builds them: rope_parameters keyed by layer type
    (transformers >= 5), or transformers 4's rope_theta + rope_scaling (global layers) and
    rope_local_base_freq (local layers); a legacy rope_scaling applies to the global layers in both."""
    given = config.get("rope_parameters") or {}
    unknown = sorted(set(given) - set(_decoder.LAYER_TYPES))
    if unknown:
        _pretrained.refuse(
            source, "rope_parameters", f"a dict keyed by layer type, keys among {list(_decoder.LAYER_TYPES)}", unknown
        )
    legacy = {"full_attention": config.get("rope_theta"), "sliding_attention": config.get("rope_local_base_freq")}
    scaling = dict(config.get("rope_scaling") or {})
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    ropes = {}
    for kind in _decoder.LAYER_TYPES:
        rope = {"rope_type": "default", **(given.get(kind) or {}), **(scaling if kind == "full_attention" else {})}
        rope.setdefault("rope_theta", legacy[kind] if legacy[kind] is not None else DEFAULT_THETA[kind])
        ropes[kind] = rope
    return ropes


class Gemma3Block(_blocks.SandwichBlock):
    """Gemma's sandwich-norm block (gelu-tanh MLP) with Gemma 3's attention: its scale and q/k norms."""

    def attention_options(self) -> dict:
        return dict(scale=self.config.query_pre_attn_scalar**-0.5, qk_norm=self.norm())


class Gemma3ForCausalLM(_decoder.ScaledCausalLM):
    """HF Gemma3ForCausalLM: input_ids [B,T] -> logits [B,T,V] (sqrt(E)-scaled embeddings, softcapped logits)."""

    Block = Gemma3Block


def weight_table(config: Gemma3Config) -> list[weights.Row]:
    """HF's names -> our params: the shared causal-LM rows, the q/k norms, the MLP and its sandwich norms."""
    rows = [
        *_decoder.causal_lm_rows(config),
        *_decoder.qk_norm_rows(),
        *_decoder.sandwich_norm_rows(),
        *_decoder.mlp_rows(config),
    ]
    return weights.expand(rows, config.num_hidden_layers)


_pretrained.register_family("gemma3_text")(_decoder.loader(Gemma3Config, Gemma3ForCausalLM, weight_table))
