"""RoPE's inverse frequencies theta_k [H/2] and their context-extension rules, in float64 numpy (the numbers
HF's rope types compute; a model casts them where it rotates, see rope.apply_rope's `frequencies`):

    default   theta_k = base ** (-2k / H),  k = 0 .. H/2 - 1
    linear    theta_k / factor                                   (position interpolation)
    llama3    long wavelengths (> L / low) divided by factor, short ones (< L / high) kept, a linear blend
              in L / wavelength between                          (HF's _compute_llama3_parameters)
    yarn      theta_k and theta_k / factor blended by a ramp over the dims between the beta_fast and
              beta_slow corrections; cos and sin scaled by its attention factor   (HF's _compute_yarn_parameters)

L is the pretraining context (original_max_position_embeddings). Reading a config into these arguments
(defaults, refusals) is the models' job (jaxattn.models._rope_config.rope_frequencies).
"""

from __future__ import annotations

import math

import numpy as np


def default_frequencies(rotary_dim: int, base: float) -> np.ndarray:
    """theta_k = base ** (-2k / rotary_dim), float64 [rotary_dim/2]."""
    k = np.arange(0, rotary_dim, 2, dtype=np.float64)
    return 1.0 / base ** (k / rotary_dim)


def linear_frequencies(inverse: np.ndarray, factor: float) -> np.ndarray:
    return inverse / factor


def llama3_frequencies(
    inverse: np.ndarray, factor: float, low_freq_factor: float, high_freq_factor: float, original_length: float
) -> np.ndarray:
    low, high, old = low_freq_factor, high_freq_factor, original_length
    wavelength = 2 * math.pi / inverse
    scaled = np.where(wavelength > old / low, inverse / factor, inverse)
    smooth = (old / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < old / high) & ~(wavelength > old / low)
    return np.where(medium, blended, scaled)


def yarn_ramp(
    head_dim: int, base: float, original_length: float, beta_fast: float, beta_slow: float, truncate: bool
) -> np.ndarray:
    """[H/2]: 0 on the dims yarn extrapolates (theta_k kept), 1 on those it interpolates (theta_k / factor)."""

    def correction(rotations):  # the dim at which a wavelength makes `rotations` turns over the original length
        return head_dim * math.log(original_length / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction(beta_fast), correction(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high  # HF's guard against a zero-width ramp
    return np.clip((np.arange(head_dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)


def yarn_frequencies(inverse: np.ndarray, factor: float, ramp: np.ndarray) -> np.ndarray:
    return inverse * (1 - ramp) + inverse / factor * ramp


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """yarn's magnitude rule 0.1 m ln(factor) + 1 (1 when factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """yarn_mscale(factor), or the ratio of that rule at mscale and at mscale_all_dim when both are given
    (DeepSeek's form)."""
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)
