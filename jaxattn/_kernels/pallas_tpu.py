"""implementation="pallas_tpu": JAX's splash attention (splash_tpu) for every call it expresses, our own Pallas
TPU kernel (flex_tpu) for score_mod, mask_mod, a BlockMask, a position bias (T5's and ALiBi's of j - i, Swin's
and BEiT's windows), Shaw's / DeBERTa's position tables and relative_attention's per-pair tables, which splash
cannot express."""

from __future__ import annotations

from typing import Optional

from .._core.call import AttentionCall
from . import flex_tpu, splash_tpu


def _kernel(call: AttentionCall):
    return flex_tpu if flex_tpu.wanted(call) else splash_tpu


def unsupported(call: AttentionCall, query, key, value, interpret=False) -> Optional[str]:
    return _kernel(call).unsupported(call, query, key, value, interpret)


def declined(call: AttentionCall, query, key, value) -> Optional[str]:
    return flex_tpu.declined(call, query, key, value) if flex_tpu.wanted(call) else None


def attention(call: AttentionCall, query, key, value, interpret=False):
    return _kernel(call).attention(call, query, key, value, interpret)
