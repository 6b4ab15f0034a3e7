"""Llama, Mistral and Qwen2 in Flax linen, on jaxattn.linen.MultiHeadAttention (GQA, RoPE): HF's *ForCausalLM.

    x = embed_tokens[ids]
    each layer:  x = x + o(attend(RoPE(q(RMSNorm(x))), RoPE(k(RMSNorm(x))), v(RMSNorm(x))))   causal, GQA
                 x = x + down(silu(gate(RMSNorm(x))) * up(RMSNorm(x)))                      SwiGLU
    logits = RMSNorm(x) @ lm_head (or embed_tokens.T when tied)

RoPE is the layer's own `rope` option: queries and keys are rotated after projection and before attention,
at `rope_positions` (HF's position_ids), and keys are cached already rotated, so decoding needs no
bookkeeping. The inverse frequencies follow HF's rope types "default", "linear" and "llama3"
(`rope_frequencies`); other rope types are refused by name. Qwen2 = Llama with q/k/v biases (no o bias).
Mistral = Llama with a sliding window on every layer when config.sliding_window is set (null: none); Qwen2
slides the layers layer_types marks "sliding_attention" when use_sliding_window is set. The window is HF's
`kv_idx > q_idx - sliding_window` on cache slots, i.e. window=(sliding_window - 1, 0) with is_causal
(docs/positions.md); decoding applies it as a mask over the cache's slots (_decoder.sliding_mask).

Calling convention (and the decode cache): jaxattn/models/_decoder.py.

    V vocab  E hidden  N heads  K key/value heads  H head dim  F intermediate
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from ..linen import MultiHeadAttention, RoPE
from . import _decoder, _pretrained, _table

ROPE_TYPES = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False       # Llama: a bias on q, k, v and o
    qkv_bias: bool = False             # Qwen2: a bias on q, k and v only
    mlp_bias: bool = False
    rope_frequencies: tuple = ()       # the inverse frequencies [H/2] (rope_frequencies of the config)
    windows: tuple = ()                # per layer: HF's sliding_window W (the query and W - 1 before) or None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> LlamaConfig:
        """From a HF config.json dict (transformers >= 5: rope_parameters); refuses what is not implemented."""
        refuse = functools.partial(_pretrained.refuse, source)
        if config.get("hidden_act", "silu") != "silu":
            refuse("hidden_act", "'silu'", config["hidden_act"])
        if config.get("pretraining_tp", 1) != 1:
            refuse("pretraining_tp", "1", config["pretraining_tp"])
        layer_types = config.get("layer_types") or ["full_attention"]
        if qwen2_slides(config):  # HF's Qwen2 slides the layers marked so, only with use_sliding_window
            if set(layer_types) - {"full_attention", "sliding_attention"}:
                refuse("layer_types", "'full_attention' or 'sliding_attention'", sorted(set(layer_types)))
        elif set(layer_types) != {"full_attention"}:  # Mistral ignores layer_types in HF (it warns): refused
            refuse("layer_types", "only 'full_attention'" + (" (use_sliding_window is false)"
                   if config.get("model_type") == "qwen2" else ""), sorted(set(layer_types)))
        fields = {f.name for f in dataclasses.fields(cls)} - {"rope_frequencies", "qkv_bias", "windows"}
        kept = {k: v for k, v in config.items() if k in fields and v is not None}
        llama = cls(**kept, qkv_bias=config.get("model_type") == "qwen2",
                    windows=sliding_windows(config, source))
        if llama.hidden_size % llama.num_attention_heads and llama.head_dim is None:
            refuse("head_dim", f"given, or hidden_size divisible by num_attention_heads={llama.num_attention_heads}",
                   None)
        return dataclasses.replace(llama, rope_frequencies=tuple(rope_frequencies(config, llama.dims()["H"],
                                                                                  source)))

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def dims(self) -> dict[str, int]:
        N = self.num_attention_heads
        return {"V": self.vocab_size, "E": self.hidden_size, "N": N, "K": self.num_key_value_heads or N,
                "H": self.head_dim or self.hidden_size // N, "F": self.intermediate_size}


def qwen2_slides(config: Mapping[str, Any]) -> bool:
    return config.get("model_type") == "qwen2" and bool(config.get("use_sliding_window", False))


def sliding_windows(config: Mapping[str, Any], source) -> tuple:
    """HF's sliding_window W per layer (None: full attention), or () when no layer slides.

    Mistral: W on every layer (HF's MistralModel picks its mask by sliding_window alone); null = none.
    Qwen2: W on the layers layer_types marks "sliding_attention" (HF's default: from max_window_layers on),
    and only with use_sliding_window (HF's config drops the window otherwise)."""
    n = config["num_hidden_layers"]
    if config.get("model_type") == "mistral" and config.get("sliding_window") is not None:
        return (checked_window(config["sliding_window"], source, "an int >= 1 or null"),) * n
    if not qwen2_slides(config):
        return ()
    window = checked_window(config.get("sliding_window"), source, "an int >= 1 (use_sliding_window is true)")
    types = config.get("layer_types") or ["sliding_attention" if i >= config.get("max_window_layers", 28)
                                          else "full_attention" for i in range(n)]
    if len(types) != n:
        _pretrained.refuse(source, "layer_types", f"one entry per layer ({n})", len(types))
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def checked_window(window, source, expected: str) -> int:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        _pretrained.refuse(source, "sliding_window", expected, window)
    return window


def rope_parameters(config: Mapping[str, Any]) -> dict:
    """HF's rope settings: rope_parameters (transformers >= 5), else rope_scaling + rope_theta (v4)."""
    if config.get("rope_parameters"):
        return dict(config["rope_parameters"])
    scaling = dict(config.get("rope_scaling") or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {"rope_theta": config.get("rope_theta", 10000.0), **scaling}


def rope_frequencies(config: Mapping[str, Any], head_dim: int, source="config") -> np.ndarray:
    """float64 inverse frequencies [head_dim/2] for HF's rope types "default", "linear" and "llama3".

    default: theta_k = base^(-2k/H); linear: theta_k / factor; llama3: long wavelengths divided by factor,
    short ones kept, a smooth blend between (HF's _compute_llama3_parameters, in float64).
    """
    rope = rope_parameters(config)
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        _pretrained.refuse(source, "rope_parameters['rope_type']", f"one of {list(ROPE_TYPES)}", kind)
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        _pretrained.refuse(source, "rope_parameters['partial_rotary_factor']", "1.0", rope["partial_rotary_factor"])
    if rope.get("attention_factor") not in (None, 1.0):
        _pretrained.refuse(source, "rope_parameters['attention_factor']", "1.0 (or unset)", rope["attention_factor"])
    base = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    inverse = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if kind == "linear":
        return inverse / float(rope["factor"])
    if kind == "llama3":
        factor, low, high = (float(rope[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old = float(rope["original_max_position_embeddings"])
        wavelength = 2 * math.pi / inverse
        scaled = np.where(wavelength > old / low, inverse / factor, inverse)
        smooth = (old / wavelength - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelength < old / high) & ~(wavelength > old / low)
        return np.where(medium, blended, scaled)
    return inverse


def layer_window(window: int | None, decode: bool):
    """The attention layer's `window` keyword for HF's sliding_window W: (W - 1, 0) without the cache; None
    when decoding, where the window is part of the mask (_decoder.sliding_mask)."""
    return None if window is None or decode else (window - 1, 0)


def layer_masks(config, attention_mask, slots, decode: bool) -> dict:
    """{window (or None): the attention layers' mask}, one per distinct window of the model's layers."""
    windows = {config.window(i) for i in range(config.num_hidden_layers)}
    return {w: _decoder.key_mask(attention_mask) if w is None else
            _decoder.sliding_mask(attention_mask, slots, w, decode) for w in windows}


class LlamaBlock(_decoder.Configured):
    """One pre-norm block; returns (residual stream, {"attention": its output, "mlp": its output})."""

    @nn.compact
    def __call__(self, x, mask, positions, decode: bool, window: int | None = None):
        c, d = self.config, self.config.dims()
        norm = functools.partial(_decoder.RMSNorm, c.rms_norm_eps, self.param_dtype, "llama")
        bias = True if c.attention_bias else (("query", "key", "value") if c.qkv_bias else False)
        attention = MultiHeadAttention(num_heads=d["N"], num_kv_heads=d["K"], head_dim=d["H"], use_bias=bias,
                                       rope=RoPE(frequencies=c.rope_frequencies), window=layer_window(window, decode),
                                       dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
                                       name="self_attn")
        a = attention(norm(name="input_layernorm")(x), mask=mask, is_causal=True, rope_positions=positions,
                      decode=decode)
        x = x + a
        dense = functools.partial(nn.Dense, use_bias=c.mlp_bias, dtype=self.dtype, param_dtype=self.param_dtype,
                                  precision=self.precision)
        h = norm(name="post_attention_layernorm")(x)
        h = nn.silu(dense(d["F"], name="gate_proj")(h)) * dense(d["F"], name="up_proj")(h)
        m = dense(d["E"], name="down_proj")(h)
        return x + m, {"attention": a, "mlp": m}


def decoder_stack(module: nn.Module, block, norm_kind: str, x, attention_mask, slots, positions, decode: bool):
    """The layers and final norm (RMSNorm of `norm_kind`) of a Llama-shaped model, called from `module`'s
    compact __call__ (so the submodules are its own): per-window masks, then _decoder.layer_stack."""
    c = module.config
    masks = layer_masks(c, attention_mask, slots, decode)

    def layer(i, x):
        return block(c, module.dtype, module.param_dtype, module.precision, name=f"layers_{i}")(
            x, masks[c.window(i)], positions, decode, c.window(i))

    norm = _decoder.RMSNorm(c.rms_norm_eps, module.param_dtype, norm_kind, name="norm")
    return _decoder.layer_stack(module, layer, c.num_hidden_layers, norm, x)


class LlamaForCausalLM(_decoder.Configured):
    """HF LlamaForCausalLM / Qwen2ForCausalLM: input_ids [B,T] -> logits [B,T,V]. Sows "intermediates"."""

    def max_positions(self) -> int | None:
        return None  # rotary positions have no table to run off

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, position_ids=None, *, decode: bool = False):
        c, d = self.config, self.config.dims()
        input_ids = jnp.asarray(input_ids)
        positions, slots = _decoder.positions_and_slots(self, input_ids.shape, position_ids, decode)
        embed = nn.Embed(d["V"], d["E"], dtype=self.dtype, param_dtype=self.param_dtype, name="embed_tokens")
        x = decoder_stack(self, LlamaBlock, "llama", embed(input_ids), attention_mask, slots, positions, decode)
        return _decoder.lm_head(self, x, embed, c.tie_word_embeddings)


# --- weights: one row per HF tensor ---------------------------------------------------------------------------

def _rows(config: LlamaConfig) -> list[_table.Row]:
    R = _table.row
    rows = [R("model.embed_tokens.weight", ("V", "E"), "embed_tokens/embedding", ("V", "E")),
            R("model.layers.{i}.input_layernorm.weight", ("E",), "layers_{i}/input_layernorm/weight", ("E",))]
    for hf, ours, heads in (("q", "query", "N"), ("k", "key", "K"), ("v", "value", "K")):
        rows.append(R(f"model.layers.{{i}}.self_attn.{hf}_proj.weight", (f"{heads}*H", "E"),
                      f"layers_{{i}}/self_attn/{ours}/kernel", ("E", heads, "H"), "T_reshape"))
        if config.attention_bias or config.qkv_bias:
            rows.append(R(f"model.layers.{{i}}.self_attn.{hf}_proj.bias", (f"{heads}*H",),
                          f"layers_{{i}}/self_attn/{ours}/bias", (heads, "H"), "reshape"))
    rows.append(R("model.layers.{i}.self_attn.o_proj.weight", ("E", "N*H"), "layers_{i}/self_attn/out/kernel",
                  ("N", "H", "E"), "T_reshape"))
    if config.attention_bias:
        rows.append(R("model.layers.{i}.self_attn.o_proj.bias", ("E",), "layers_{i}/self_attn/out/bias", ("E",)))
    rows.append(R("model.layers.{i}.post_attention_layernorm.weight", ("E",),
                  "layers_{i}/post_attention_layernorm/weight", ("E",)))
    for name, shape in (("gate_proj", ("F", "E")), ("up_proj", ("F", "E")), ("down_proj", ("E", "F"))):
        rows.append(R(f"model.layers.{{i}}.mlp.{name}.weight", shape, f"layers_{{i}}/{name}/kernel", shape[::-1],
                      "transpose"))
        if config.mlp_bias:
            rows.append(R(f"model.layers.{{i}}.mlp.{name}.bias", shape[:1], f"layers_{{i}}/{name}/bias", shape[:1]))
    rows.append(R("model.norm.weight", ("E",), "norm/weight", ("E",)))
    if not config.tie_word_embeddings:
        rows.append(R("lm_head.weight", ("V", "E"), "lm_head/kernel", ("E", "V"), "transpose"))
    return _table.expand(rows, config.num_hidden_layers)


def weight_table(config: LlamaConfig) -> list[_table.Row]:
    return _rows(config)


def loader(config_class, model_class, table):
    """A from_pretrained loader: config dict -> config_class.from_dict, weights through table(config)."""
    def load(config: dict, tensors, files, *, dtype, precision, source):
        parsed = config_class.from_dict(config, source)
        ignored = []
        if parsed.tie_word_embeddings and "lm_head.weight" in tensors:
            ignored.append("lm_head.weight")
            if not np.array_equal(tensors["lm_head.weight"], tensors.get("model.embed_tokens.weight")):
                raise ValueError(f"{files['lm_head.weight']}: 'lm_head.weight': expected a copy of "
                                 f"model.embed_tokens.weight (tie_word_embeddings is true in {source}), "
                                 f"got other values")
        params = _table.fill(tensors, table(parsed), parsed.dims(), files, dtype=dtype, ignored=ignored)
        return model_class(parsed, precision=precision), params
    return load


for _model_type in ("llama", "qwen2", "mistral"):
    _pretrained.register_family(_model_type)(loader(LlamaConfig, LlamaForCausalLM, weight_table))
