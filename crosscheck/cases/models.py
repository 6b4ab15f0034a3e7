"""Whole models: one case per family, a tiny random-weight checkpoint against transformers (eager).

Each case writes its family's checkpoint (crosscheck._hf.checkpoints: seeded, offline) to a temporary
directory, loads it with jaxattn.models.from_pretrained and with transformers, and compares the logits on
real tokens of a left-padded batch and the gradient of every parameter (torch's state_dict gradients
converted through the same weight table as the weights). The per-layer view of the same comparison is
`python -m crosscheck --model DIR`.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import numpy as np

from crosscheck.catalogue import FLOAT32_JIT, ModelSetup, Setup, register_case


def _setup(model_type: str, **overrides) -> Setup:
    """overrides: write_checkpoint's config keywords (a variant of the family's tiny config)."""
    from crosscheck._hf import checkpoints as hf
    from jaxattn.models import from_pretrained, from_state_dict

    with tempfile.TemporaryDirectory(prefix=f"crosscheck-{model_type}-") as directory:
        hf.write_checkpoint(model_type, directory, **overrides)
        config = json.loads((Path(directory) / "config.json").read_text())
        model, params = from_pretrained(directory, precision="highest")
        torch_models = {dtype: hf.torch_model(directory, dtype) for dtype in ("float32", "float64")}
    state = {
        k: v.detach().numpy()
        for k, v in torch_models["float32"].state_dict().items()
        if k in dict(torch_models["float32"].named_parameters())
    }
    input_ids, attention_mask = hf.padded_batch("left")
    inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
    if model_type in hf.IMAGE_FAMILIES:  # Swin: seeded pixel_values, every image's logits
        inputs = hf.padded_inputs(model_type, "left")
    if model_type == "t5":  # the decoder's tokens: start token, then 6 others
        inputs["decoder_input_ids"] = np.random.default_rng(1).integers(0, hf.VOCAB, (3, 7))

    def real(logits, attention_mask=None, decoder_input_ids=None, **_):
        # padded queries have no meaning; T5's logits are the decoder's (no decoder padding); an image's are whole
        return logits if decoder_input_ids is not None or attention_mask is None else logits * attention_mask[..., None]

    def jax_fn(params, **inputs):
        return {"logits": real(model.apply({"params": params}, **inputs), **inputs)}

    def torch_fn(state, **inputs):
        import torch
        from torch.func import functional_call

        dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
        with hf.float64_reference(torch_models[dtype], dtype):
            kwargs = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v.long() for k, v in inputs.items()}
            out = functional_call(torch_models[dtype], state, args=(), kwargs=kwargs)
        return {"logits": real(out.logits, **inputs)}

    def grads_from_torch(grads):
        return from_state_dict(config, {k: np.asarray(v) for k, v in grads.items()})[1]

    return ModelSetup(
        jax_fn=jax_fn,
        torch_fn=torch_fn,
        inputs=inputs,
        params=params,
        torch_params=state,
        grads_from_torch=grads_from_torch,
    )


for _model_type, _doc in (
    ("gpt2", "GPT-2 (2 layers, tied embeddings): logits and every parameter gradient"),
    ("t5", "T5 v1.1 (2+2 layers, gated FF): logits and every parameter gradient"),
    ("llama", "Llama (2 layers, GQA 6/2, linear rope): logits and every parameter gradient"),
    ("qwen2", "Qwen2 (2 layers, GQA 6/2, q/k/v biases, tied): logits and every gradient"),
    ("mistral", "Mistral (2 layers, GQA 6/2, sliding window 5 < 11 tokens): logits and every parameter gradient"),
    (
        "gemma2",
        "Gemma 2 (sliding + global layer, GQA 4/2, head_dim 16, both softcaps): logits and every parameter gradient",
    ),
    ("qwen3", "Qwen 3 (2 layers, GQA, q/k RMS norms per head): logits and every gradient"),
    (
        "gemma3_text",
        "Gemma 3 (local + global layers with their own ropes, q/k norms, "
        "embedding scale): logits and every parameter gradient",
    ),
    (
        "mixtral",
        "Mixtral (2 layers, top-2 of 5 experts, stacked expert weights): logits and "
        "every gradient (torch's fused experts read through the table)",
    ),
    (
        "gpt_oss",
        "gpt-oss (sinks, alternating windows, biased router, clamped SwiGLU "
        "experts): logits and every parameter gradient",
    ),
    ("qwen3_moe", "Qwen3-MoE (q/k norms, top-k experts, norm_topk_prob): logits and every parameter gradient"),
    (
        "llama4_text",
        "Llama 4 (chunked RoPE layer with L2 q/k norms, NoPE layer with attention "
        "temperature, sigmoid-routed experts + shared expert): logits and every "
        "parameter gradient",
    ),
    (
        "deepseek_v3",
        "DeepSeek V3 (multi-head latent attention with yarn, dense layer, "
        "group-limited sigmoid-routed experts + shared experts): logits and "
        "every parameter gradient",
    ),
    (
        "qwen3_next",
        "Qwen3-Next (gated delta-rule layer with its conv, gated softmax layer with "
        "partial RoPE, experts + gated shared expert): logits and every parameter "
        "gradient",
    ),
    (
        "deberta-v2",
        "DeBERTa-v3-shaped masked LM (disentangled attention c2p + p2c, log buckets, shared keys, relative "
        "embeddings' LayerNorm, lm_predictions head tied to the embeddings): logits and every parameter gradient",
    ),
    (
        "swin",
        "Swin (image classifier: padded and shifted windows, PatchMerging of an odd map, clamped window): "
        "logits and every parameter gradient on pixel_values",
    ),
):
    register_case(
        f"model_{_model_type.replace('-', '_')}",
        description=f"{_doc}, left-padded batch, vs transformers",
        transforms=("jit",),
        quick=FLOAT32_JIT,
        default_run=_model_type == "gpt2",  # one whole model
        requires=("transformers",),
    )(functools.partial(_setup, _model_type))

register_case(
    "model_deberta_v2_legacy",
    description="DeBERTa-v2 masked LM with transformers' default head (legacy: cls.predictions, its decoder tied "
    "to the word embeddings and its bias): logits and every parameter gradient, left-padded batch, vs transformers",
    transforms=("jit",),
    quick=FLOAT32_JIT,
    default_run=False,
    requires=("transformers",),
)(functools.partial(_setup, "deberta-v2", legacy=True))
