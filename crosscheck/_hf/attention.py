"""Hugging Face attention of today's models, recorded as torch-side references with our keywords.

A tiny random model of each family runs eager attention twice: a prefill of ``T0`` tokens, then ``T1`` more
tokens on the cache (so ``T < S`` and positions are absolute). Every call of the family's
``eager_attention_forward`` is recorded: the query/key/value it was given (after projections, RoPE, QK norm,
temperature tuning and the cache), HF's output, and the keywords that make ``dot_product_attention`` compute
the same thing (``keywords_for_layer``: the one mapping table from HF options to ours, documented in
docs/positions.md, "Windows, chunks, softcap, sinks"). A crosscheck case then needs only its JAX side::

    for call in record_attention("gemma2", dtype=torch.float64):
        expected = call.output                     # [B, T, N, H], HF eager
        got = jaxattn.dot_product_attention(call.query, call.key, call.value, **call.keywords)

Layouts are converted to ours (``[B, T, N, H]``, ``[B, S, K, H]``). HF's eager paths softmax in float32 by
design (Gemma 2, Mistral, Qwen2); for float64 runs that one cast is lifted (``_softmax_keeps_float64``), as
the float64 comparison needs. Sliding and chunked layers keep a trimmed cache (``DynamicSlidingWindowLayer``),
so the recorded keys are the last ``S`` tokens: ``key_positions`` says where they sit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from unittest import mock

import numpy as np

from crosscheck.catalogue import randomize

FAMILIES = ("gemma2", "mistral", "gpt_oss", "llama4", "qwen2", "qwen2_sliding")

_WINDOW, _CHUNK, _SOFTCAP = 4, 4, 0.6  # small enough that every rule bites at these lengths


def tiny_config(family: str):
    """A 2-layer config with N=6 query heads, K=2 or 3 key/value heads, H=8, eager attention."""
    import transformers as tf

    common = {
        "vocab_size": 61,
        "hidden_size": 24,
        "intermediate_size": 20,
        "num_hidden_layers": 2,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "attn_implementation": "eager",
    }
    if family == "gemma2":  # alternating sliding/full layers by default; query_pre_attn_scalar != head_dim
        return tf.Gemma2Config(
            **common,
            sliding_window=_WINDOW,
            attn_logit_softcapping=_SOFTCAP,
            final_logit_softcapping=None,
            query_pre_attn_scalar=13,
        )
    if family == "mistral":  # every layer slides
        return tf.MistralConfig(**common, sliding_window=_WINDOW)
    if family == "gpt_oss":  # alternating sliding/full, per-head sinks
        return tf.GptOssConfig(
            **{**common, "num_key_value_heads": 2},
            sliding_window=_WINDOW,
            num_local_experts=2,
            num_experts_per_tok=1,
            experts_implementation="eager",
        )
    if family == "llama4":  # chunked layers are those with RoPE; no_rope_layers [1, 0]: chunked, then full
        return tf.Llama4TextConfig(
            **common,
            attention_chunk_size=_CHUNK,
            no_rope_layers=[1, 0],
            intermediate_size_mlp=20,
            num_local_experts=2,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
        )
    if family == "qwen2":  # full attention, biased q/k/v projections
        return tf.Qwen2Config(**common)
    if family == "qwen2_sliding":  # layers >= max_window_layers slide
        return tf.Qwen2Config(**common, use_sliding_window=True, sliding_window=_WINDOW, max_window_layers=1)
    raise ValueError(f"family: expected one of {FAMILIES}, got {family!r}")


def _layer_type(config, layer_idx: int) -> str:
    types = getattr(config, "layer_types", None)
    if types is not None:
        return types[layer_idx]
    # Mistral has no layer_types: sliding_window (when set) applies to every layer
    return "full_attention" if getattr(config, "sliding_window", None) is None else "sliding_attention"


def keywords_for_layer(module) -> dict:
    """HF attention module -> keywords of ``dot_product_attention`` (the mapping table; positions apart).

    * every decoder here is causal: ``is_causal=True`` (HF's ``causal_mask_function``: ``kv_idx <= q_idx``);
    * ``scale = module.scaling`` (Gemma 2: ``query_pre_attn_scalar ** -0.5``, others ``head_dim ** -0.5``);
    * sliding layer: HF allows ``kv_idx > q_idx - sliding_window`` (``sliding_window_overlay``), i.e. the
      window counts the query itself: ``window=(sliding_window - 1, 0)``;
    * chunked layer (Llama 4): ``(kv_idx // attention_chunk_size) == (q_idx // attention_chunk_size)`` on
      absolute positions (no padding): ``chunk_size=attention_chunk_size``;
    * Gemma 2 ``attn_logit_softcapping``: ``c * tanh(x / c)`` on the scaled logits before the mask:
      ``logit_softcap=attn_logit_softcapping``;
    * gpt-oss ``module.sinks [N]``: a logit concatenated to each row before the softmax and dropped after:
      ``sinks=module.sinks``.
    """
    config = module.config
    keywords = {"is_causal": True, "scale": float(module.scaling)}
    layer_type = _layer_type(config, module.layer_idx)
    if layer_type == "sliding_attention":
        keywords["window"] = (config.sliding_window - 1, 0)
    elif layer_type == "chunked_attention":
        keywords["chunk_size"] = config.attention_chunk_size
    elif layer_type != "full_attention":
        raise ValueError(f"layer_types: expected sliding/chunked/full attention, got {layer_type!r}")
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        keywords["logit_softcap"] = float(softcap)
    if getattr(module, "sinks", None) is not None:
        keywords["sinks"] = module.sinks.detach()
    return keywords


@dataclasses.dataclass
class AttentionCall:
    """One recorded eager attention call, in our layouts. ``keywords`` include the absolute positions."""

    family: str
    layer_idx: int
    layer_type: str
    query: object  # [B, T, N, H]
    key: object  # [B, S, K, H]
    value: object  # [B, S, K, Hv]
    output: object  # [B, T, N, Hv], HF's eager result
    keywords: dict
    rerun: object = None  # (query, key, value) in our layouts -> HF's eager output; differentiable (gradients
    #                       reach the layer's parameters too, e.g. gpt-oss sinks: ``rerun.module.sinks``)


@contextlib.contextmanager
def _softmax_keeps_float64():
    """HF eager softmaxes with ``dtype=torch.float32`` by design; a float64 run keeps float64 there."""
    import torch

    original = torch.nn.functional.softmax

    def softmax(input, dim=None, _stacklevel=3, dtype=None):
        if input.dtype == torch.float64 and dtype == torch.float32:
            dtype = torch.float64
        return original(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    with mock.patch.object(torch.nn.functional, "softmax", softmax):
        yield


def _modeling_module(family: str):
    name = "qwen2" if family == "qwen2_sliding" else family
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def build_model(family: str, *, dtype=None, seed: int = 0):
    """The tiny causal LM in ``dtype``, weights seeded here: matrices N(0, 1/fan_in) (q/k doubled), vectors
    (norms, biases, gpt-oss sinks) N(0, 0.5^2), sinks doubled."""
    import torch
    import transformers as tf

    config = tiny_config(family)
    torch.manual_seed(seed)
    model = tf.Llama4ForCausalLM(config) if family == "llama4" else tf.AutoModelForCausalLM.from_config(config)
    randomize(model, np.random.default_rng(seed))
    with torch.no_grad():  # logits and sinks large enough that softcap, window and sinks all matter
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight", "sinks")):
                p.mul_(2.0)
    return model.to(dtype or torch.float64).eval()


def record_attention(
    family: str, *, dtype=None, batch: int = 2, prefill: int = 9, extend: int = 4, seed: int = 0
) -> list[AttentionCall]:
    """Run the tiny model on ``prefill`` tokens, then ``extend`` more with the cache; record every layer."""
    import torch

    dtype = dtype or torch.float64
    model = build_model(family, dtype=dtype, seed=seed)
    module = _modeling_module(family)
    original = module.eager_attention_forward
    calls: list[AttentionCall] = []
    past = {"length": 0}

    def precision():
        return _softmax_keeps_float64() if dtype == torch.float64 else contextlib.nullcontext()

    def hf_rerun(attention, attention_mask, kwargs):
        def rerun(query, key, value):
            mask = attention_mask  # an additive float mask follows the run's dtype (Llama 4 adds it as is)
            if mask is not None and mask.is_floating_point():
                mask = mask.to(query.dtype)
            with precision():
                out, _ = original(
                    attention, query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mask, **kwargs
                )
            return out

        rerun.module = attention
        return rerun

    def recording(attention, query, key, value, attention_mask, **kwargs):
        out, weights = original(attention, query, key, value, attention_mask, **kwargs)
        T, S = query.shape[-2], key.shape[-2]
        end = past["length"] + T  # absolute position after the last query
        keywords = keywords_for_layer(attention)
        keywords["query_positions"] = torch.arange(end - T, end)
        keywords["key_positions"] = torch.arange(end - S, end)  # trimmed caches keep the last S tokens
        calls.append(
            AttentionCall(
                family,
                attention.layer_idx,
                _layer_type(attention.config, attention.layer_idx),
                query.transpose(1, 2).detach(),
                key.transpose(1, 2).detach(),
                value.transpose(1, 2).detach(),
                out.detach(),
                keywords,
                hf_rerun(attention, attention_mask, kwargs),
            )
        )
        return out, weights

    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, model.config.vocab_size, (batch, prefill + extend)))
    with precision(), mock.patch.object(module, "eager_attention_forward", recording), torch.no_grad():
        cache = model(ids[:, :prefill], use_cache=True).past_key_values
        past["length"] = prefill
        model(ids[:, prefill:], past_key_values=cache, use_cache=True)
    return calls
