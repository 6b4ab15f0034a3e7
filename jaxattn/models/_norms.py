"""HF's norms as Flax modules: RMSNorm (its four roundings back to the input dtype) and torch's LayerNorm
(layer_norm). The RMS statistic itself is jaxattn/_core/norms.py's rms_normalize."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from .._core.norms import rms_normalize

RMS_NORMS = ("llama", "gemma", "t5", "gpt_oss")


class RMSNorm(nn.Module):
    """HF's RMS norms: the statistics in float32 or wider, then a learned scale; they differ in where they
    round back, which decides bf16 results bit for bit, so `kind` names the one to reproduce:

        "llama"  LlamaRMSNorm (Qwen2, Mistral):  weight * normed.astype(x.dtype)
        "gemma"  Gemma2RMSNorm:                   (normed * (1 + weight)).astype(x.dtype), weight from 0
        "t5"     T5LayerNorm:                     weight * normed, normed cast to a half weight's dtype first
        "gpt_oss" GptOssRMSNorm:                  (weight * normed).astype(x.dtype)

    HF's code takes the statistics in float32 for float64 inputs too; crosscheck's float64 reference lifts
    that (crosscheck._hf.checkpoints.float64_reference), so float64 here means float64 throughout.
    """

    epsilon: float
    param_dtype: Any = jnp.float32
    kind: str = "llama"

    @nn.compact
    def __call__(self, x):
        if self.kind not in RMS_NORMS:
            raise ValueError(f"kind: expected one of {list(RMS_NORMS)}, got {self.kind!r}")
        init = nn.initializers.zeros if self.kind == "gemma" else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.param_dtype)
        normed = rms_normalize(x, self.epsilon)
        if self.kind == "gemma":
            return (normed * (1.0 + weight.astype(normed.dtype))).astype(x.dtype)
        if self.kind == "t5":
            return weight * (normed.astype(weight.dtype) if weight.dtype in (jnp.bfloat16, jnp.float16) else normed)
        if self.kind == "gpt_oss":
            return (weight * normed).astype(x.dtype)
        return weight * normed.astype(x.dtype)


def layer_norm(epsilon: float, dtype, param_dtype, name: str) -> nn.LayerNorm:
    """torch's LayerNorm: the variance as mean((x - mean)^2); flax's fast E[x^2] - E[x]^2 loses digits."""
    return nn.LayerNorm(epsilon=epsilon, use_fast_variance=False, dtype=dtype, param_dtype=param_dtype, name=name)
