"""HF's rope settings read into inverse frequencies: a config.json's rope_parameters (transformers >= 5) or
rope_scaling + rope_theta (v4), their defaults and refusals; the rules themselves (default, linear, llama3,
yarn) are jaxattn/_schemes/rope_scaling.py's.

    rope_parameters        the settings dict of a config
    rope_frequencies       -> float64 inverse frequencies [H/2] (public: jaxattn.models.rope_frequencies)
    rope_attention_factor  -> HF's attention_scaling of cos and sin (yarn's; 1.0 otherwise)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._schemes import rope_scaling
from . import _pretrained

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(config: Mapping[str, Any]) -> dict:
    """HF's rope settings: rope_parameters (transformers >= 5), else rope_scaling + rope_theta (v4)."""
    if config.get("rope_parameters"):
        return dict(config["rope_parameters"])
    scaling = dict(config.get("rope_scaling") or {})
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    return {"rope_theta": config.get("rope_theta", 10000.0), **scaling}


def rope_frequencies(
    config: Mapping[str, Any],
    head_dim: int,
    source="config",
    *,
    rope: Mapping | None = None,
    name: str = "rope_parameters",
) -> np.ndarray:
    """float64 inverse frequencies [head_dim/2] for HF's rope types "default", "linear", "llama3" and "yarn".

    Reads the settings (HF's defaults, refusals) and applies the rule of jaxattn/_schemes/rope_scaling.py
    (default, linear, llama3, yarn; yarn's attention factor: rope_attention_factor).
    rope: the settings to read (default: the config's, rope_parameters(config)); name: what refusals call them
    (Gemma 3: "rope_parameters['sliding_attention']").
    """
    rope = rope_parameters(config) if rope is None else rope
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        _pretrained.refuse(source, f"{name}['rope_type']", f"one of {list(ROPE_TYPES)}", kind)
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        _pretrained.refuse(source, f"{name}['partial_rotary_factor']", "1.0", rope["partial_rotary_factor"])
    if kind != "yarn" and rope.get("attention_factor") not in (None, 1.0):
        _pretrained.refuse(
            source, f"{name}['attention_factor']", "1.0 (or unset) unless rope_type is 'yarn'", rope["attention_factor"]
        )
    base = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    inverse = rope_scaling.default_frequencies(head_dim, base)
    if kind == "linear":
        return rope_scaling.linear_frequencies(inverse, float(rope["factor"]))
    if kind == "yarn":
        ramp = rope_scaling.yarn_ramp(
            head_dim,
            base,
            _pretraining_length(rope, config),
            rope.get("beta_fast") or 32,
            rope.get("beta_slow") or 1,
            rope.get("truncate", True),
        )
        return rope_scaling.yarn_frequencies(inverse, _yarn_factor(rope, config), ramp)
    if kind == "llama3":
        factor, low, high = (float(rope[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        return rope_scaling.llama3_frequencies(
            inverse, factor, low, high, float(rope["original_max_position_embeddings"])
        )
    return inverse


def _pretraining_length(rope: Mapping[str, Any], config: Mapping[str, Any]) -> int:
    """yarn's original_max_position_embeddings: the config's own field first, then rope_parameters', then
    max_position_embeddings (HF's standardize_rope_params)."""
    return (
        config.get("original_max_position_embeddings")
        or rope.get("original_max_position_embeddings")
        or config["max_position_embeddings"]
    )


def _yarn_factor(rope: Mapping[str, Any], config: Mapping[str, Any]) -> float:
    """yarn's factor; null: max_position_embeddings / original_max_position_embeddings (HF's rule)."""
    if rope.get("factor") is None:
        return config["max_position_embeddings"] / _pretraining_length(rope, config)
    return float(rope["factor"])


def rope_attention_factor(config: Mapping[str, Any], rope: Mapping | None = None) -> float:
    """HF's attention_scaling of the rotary cos and sin: yarn's attention_factor (given, or 0.1 ln(factor) + 1,
    or its mscale / mscale_all_dim ratio), 1.0 for every other rope type. rope: as rope_frequencies'."""
    rope = rope_parameters(config) if rope is None else rope
    if rope.get("rope_type", "default") != "yarn":
        return 1.0
    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    return rope_scaling.yarn_attention_factor(
        _yarn_factor(rope, config), rope.get("mscale"), rope.get("mscale_all_dim")
    )
