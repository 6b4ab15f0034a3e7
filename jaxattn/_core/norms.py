"""The RMS statistic every RMS norm shares (the decoders' RMSNorm, DeepSeek's, Qwen3-Next's gated norm).

    rms_normalize(x) = x / sqrt(mean(x^2) + eps)      over the last axis

Computed in the accumulation dtype (float32 for half inputs, float64 kept) and returned so: where each
family rounds back to x's dtype (before or after its learned scale) decides bf16 results bit for bit, so that
choice stays with the caller.
"""

from __future__ import annotations

import jax

from .dtypes import accumulation_dtype


def rms_normalize(x, epsilon: float):
    """x * rsqrt(mean(x^2) + eps) over the last axis, in float32 or wider (returned so)."""
    wide = x.astype(accumulation_dtype(x.dtype))
    return wide * jax.lax.rsqrt((wide * wide).mean(-1, keepdims=True) + epsilon)
