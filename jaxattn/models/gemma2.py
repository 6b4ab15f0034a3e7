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
hidden_size / num_heads). Weights: Llama's table plus the two feed-forward norms.

Calling convention (and the decode cache): jaxattn/models/_decoder.py. Axis letters: jaxattn/models/llama.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from ..linen import MultiHeadAttention, RoPE
from . import _decoder, _pretrained, _table, llama

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class Gemma2Config(llama.LlamaConfig):
    query_pre_attn_scalar: float = 256
    attn_logit_softcapping: float | None = 50.0
    final_logit_softcapping: float | None = 30.0
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> Gemma2Config:
        """From a HF config.json dict; refuses by name what is not implemented."""
        refuse = functools.partial(_pretrained.refuse, source)
        if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
            refuse("hidden_activation", "'gelu_pytorch_tanh'", config["hidden_activation"])
        if config.get("use_bidirectional_attention"):
            refuse("use_bidirectional_attention", "false or null (causal)", config["use_bidirectional_attention"])
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_frequencies", "qkv_bias", "windows"}
        nullable = ("attn_logit_softcapping", "final_logit_softcapping")  # null = no softcap
        kept = {k: v for k, v in config.items() if k in fields and (v is not None or k in nullable)}
        gemma = cls(**kept, windows=_windows(config, source))
        H = gemma.dims()["H"]
        return dataclasses.replace(gemma, rope_frequencies=tuple(llama.rope_frequencies(config, H, source)))


def _windows(config: Mapping[str, Any], source) -> tuple:
    """Per layer: sliding_window for "sliding_attention" layers, None for "full_attention" (HF's default
    layer_types: sliding on even layers)."""
    L = config["num_hidden_layers"]
    types = config.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(L)]
    if len(types) != L or not set(types) <= set(LAYER_TYPES):
        _pretrained.refuse(source, "layer_types", f"{L} entries among {list(LAYER_TYPES)}", types)
    window = config.get("sliding_window")
    if "sliding_attention" in types and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        _pretrained.refuse(source, "sliding_window", "an int >= 1 (the config has sliding layers)", window)
    return tuple(window if t == "sliding_attention" else None for t in types)


def softcap(x, cap: float | None):
    """HF's tanh softcapping: cap * tanh(x / cap); None: x unchanged."""
    return x if cap is None else jnp.tanh(x / cap) * cap


class Gemma2Block(_decoder.Configured):
    """One sandwich-norm block; returns (residual stream, {"attention", "mlp": their outputs}), both taken
    before their post-norms (as HF's self_attn and mlp modules return them)."""

    @nn.compact
    def __call__(self, x, mask, positions, decode: bool, window: int | None = None):
        c, d = self.config, self.config.dims()
        norm = functools.partial(_decoder.RMSNorm, c.rms_norm_eps, self.param_dtype, "gemma")
        attention = MultiHeadAttention(num_heads=d["N"], num_kv_heads=d["K"], head_dim=d["H"],
                                       use_bias=c.attention_bias, rope=RoPE(frequencies=c.rope_frequencies),
                                       window=llama.layer_window(window, decode), scale=c.query_pre_attn_scalar ** -0.5,
                                       logit_softcap=c.attn_logit_softcapping, dtype=self.dtype,
                                       param_dtype=self.param_dtype, precision=self.precision, name="self_attn")
        a = attention(norm(name="input_layernorm")(x), mask=mask, is_causal=True, rope_positions=positions,
                      decode=decode)
        x = x + norm(name="post_attention_layernorm")(a)
        dense = functools.partial(nn.Dense, use_bias=c.mlp_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                                  precision=self.precision)
        h = norm(name="pre_feedforward_layernorm")(x)
        h = nn.gelu(dense(d["F"], name="gate_proj")(h), approximate=True) * dense(d["F"], name="up_proj")(h)
        m = dense(d["E"], name="down_proj")(h)
        return x + norm(name="post_feedforward_layernorm")(m), {"attention": a, "mlp": m}


class Gemma2ForCausalLM(_decoder.Configured):
    """HF Gemma2ForCausalLM: input_ids [B,T] -> logits [B,T,V]. Sows "intermediates"."""

    def max_positions(self) -> int | None:
        return None  # rotary positions have no table to run off

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, decode: bool = False):
        c, d = self.config, self.config.dims()
        input_ids = jnp.asarray(input_ids)
        positions, slots = _decoder.positions_and_slots(self, input_ids.shape, position_ids, decode)
        embed = nn.Embed(d["V"], d["E"], dtype=self.dtype, param_dtype=self.param_dtype, name="embed_tokens")
        x = embed(input_ids)
        x = x * jnp.asarray(math.sqrt(d["E"]), x.dtype)  # HF: the scale in the embedding's dtype
        x = llama.decoder_stack(self, Gemma2Block, "gemma", x, attention_mask, slots, positions, decode)
        return softcap(_decoder.lm_head(self, x, embed, c.tie_word_embeddings), c.final_logit_softcapping)


def weight_table(config: Gemma2Config) -> list[_table.Row]:
    """Llama's rows (same names and layouts) plus the feed-forward sandwich norms."""
    extra = [_table.row(f"model.layers.{{i}}.{name}.weight", ("E",), f"layers_{{i}}/{name}/weight", ("E",))
             for name in ("pre_feedforward_layernorm", "post_feedforward_layernorm")]
    return llama.weight_table(config) + _table.expand(extra, config.num_hidden_layers)


_pretrained.register_family("gemma2")(llama.loader(Gemma2Config, Gemma2ForCausalLM, weight_table))
