"""implementation="pallas_gpu": our Pallas kernels for GPUs (Triton lowering). The flash kernel (flash_gpu,
forward and FlashAttention-2 backward) for every call it expresses; a few query rows against a long key axis
(decode_gpu.use_decode: a decode step against a cache) take the split-key kernel (decode_gpu) forward, with
the flash kernels' gradient.

The surface: `unsupported(query, key, value, **options)` (the first option the kernels cannot express, or
None) and `attention(query, key, value, *, interpret=False, **options)`. `interpret=True` runs the same
kernels with Pallas' interpreter on any platform (the CPU tests).
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp

from .._core import checks
from .._engines.blockwise import blockwise_attention
from . import decode_gpu, flash_gpu


def unsupported(query, key, value, *, interpret=False, **options) -> Optional[str]:
    """None when attention() computes this call; else the name of the first option it cannot express (the
    flash kernel's refusals: flash_gpu.unsupported; the split-key kernel takes only calls the flash kernel
    also takes)."""
    return flash_gpu.unsupported(query, key, value, interpret=interpret, **options)


def attention(query, key, value, *, interpret=False, **options):
    """blockwise_attention's call (its keywords and semantics) computed by the Pallas GPU kernel.

    query [...,T,N,H], key [...,S,K,H], value [...,S,K,Hv] -> [...,T,N,Hv] in query's dtype, or
    (out, lse [...,N,T]) with return_lse=True. interpret=True runs Pallas' interpreter (any platform).
    Options the kernel cannot express (unsupported) raise ValueError naming the option.

    A few query rows against a long key axis (decode_gpu.use_decode: a decode step against a cache) take
    the split-key kernel (decode_gpu.decode_attention) forward; their gradient, if asked for, is the flash kernel's.
    """
    return _attention(query, key, value, interpret, options, split_keys=True)


def flash_attention(query, key, value, *, interpret=False, **options):
    """attention() by the flash kernels whatever the shapes (never the split-key kernel): for comparisons
    (benchmarks/accelerator.py's decode rows)."""
    return _attention(query, key, value, interpret, options, split_keys=False)


def _attention(query, key, value, interpret, options, split_keys: bool):
    problem = unsupported(query, key, value, interpret=interpret, **options)
    if problem is not None:
        checks.fail(
            "implementation",
            f'the XLA engines ("dense", "blockwise" or None) with {problem}: the Pallas GPU kernel cannot express it',
            '"pallas_gpu"',
        )
    o = dict(options)
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    batch, T, S, N, K, H, Hv = checks.check_qkv(query, key, value)
    if T == 0 or S == 0:  # no tile to run: the XLA engine's zeros (and its lse of the sinks alone)
        return blockwise_attention(query, key, value, **{k: v for k, v in o.items() if k not in ("block_size",)})
    if split_keys and decode_gpu.use_decode(query, key, value, interpret=interpret, **o):
        return decode_gpu.decode_with_flash_gradient(query, key, value, interpret, o)
    return flash_gpu.run(query, key, value, interpret, o)
