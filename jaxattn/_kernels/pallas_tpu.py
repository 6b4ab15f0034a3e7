"""implementation="pallas_tpu": JAX's splash attention (splash_tpu) for every call it expresses, our own Pallas
TPU kernel (flex_tpu) for score_mod, mask_mod, a BlockMask, a position bias (T5's and ALiBi's of j - i, Swin's
and BEiT's windows), Shaw's / DeBERTa's position tables and relative_attention's per-pair tables, which splash
cannot express, and for the calls splash refuses that it takes (return_lse, positions of the caller's own: a
ring_attention step)."""

from __future__ import annotations

from typing import Optional

from .._core.call import AttentionCall
from . import flex_tpu, splash_tpu


def _kernel(call: AttentionCall, query, key, value, interpret=False):
    if flex_tpu.wanted(call) or splash_tpu.unsupported(call, query, key, value, interpret) is not None:
        return flex_tpu
    return splash_tpu


def unsupported(call: AttentionCall, query, key, value, interpret=False) -> Optional[str]:
    return _kernel(call, query, key, value, interpret).unsupported(call, query, key, value, interpret)


def declined(call: AttentionCall, query, key, value) -> Optional[str]:
    return flex_tpu.declined(call, query, key, value) if _kernel(call, query, key, value) is flex_tpu else None


def gradients_at(call: AttentionCall, query, key, value, out, lse, d_out, interpret=False):
    """flash_gpu.ResidualGrads at residuals (out, lse) of a softmax over more keys than the call's, by the flex
    kernel's
    backward (flex_tpu.gradients_at; splash has none that takes them), or None."""
    return flex_tpu.gradients_at(call, query, key, value, out, lse, d_out, interpret)


def attention(call: AttentionCall, query, key, value, interpret=False):
    return _kernel(call, query, key, value, interpret).attention(call, query, key, value, interpret)
