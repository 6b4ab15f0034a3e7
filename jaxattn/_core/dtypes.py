"""The accumulation rule: which dtype logits, softmax and einsum outputs are computed in."""

from __future__ import annotations

import jax.numpy as jnp


def accumulation_dtype(dtype):
    """Half-precision inputs get float32 logits and softmax; float32/float64 keep their own."""
    return jnp.promote_types(dtype, jnp.float32)
