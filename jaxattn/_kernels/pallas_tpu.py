"""implementation="pallas_tpu": JAX's splash attention (splash_tpu) for every call it expresses, our own Pallas
TPU kernel (flex_tpu) for score_mod, mask_mod and a BlockMask, which splash cannot express."""

from __future__ import annotations

from typing import Optional

from . import flex_tpu, splash_tpu


def _kernel(options):
    return flex_tpu if flex_tpu.wanted(options) else splash_tpu


def unsupported(query, key, value, *, interpret=False, **options) -> Optional[str]:
    return _kernel(options).unsupported(query, key, value, interpret=interpret, **options)


def attention(query, key, value, *, interpret=False, **options):
    return _kernel(options).attention(query, key, value, interpret=interpret, **options)
