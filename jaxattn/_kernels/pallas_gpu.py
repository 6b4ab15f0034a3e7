"""implementation="pallas_gpu": our Pallas kernels for GPUs (Triton lowering). The flash kernel (flash_gpu,
forward and FlashAttention-2 backward) for every call it expresses; a few query rows against a long key axis
(decode_gpu.use_decode: a decode step against a cache) take the split-key kernel (decode_gpu) forward, with
the flash kernels' gradient; relative_attention's per-pair tables (rel_key / rel_value) take pairs_gpu' kernels
on the flash kernels' grids.

The surface: `unsupported(call, query, key, value, interpret)` (the first option of the AttentionCall the
kernels cannot express, or None) and `attention(call, query, key, value, interpret)`. `interpret=True` runs the same
kernels with Pallas' interpreter on any platform (the CPU tests).
"""

from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import numpy as np

from .._core import checks
from .._core.call import AttentionCall
from .._engines import blockwise
from . import decode_gpu, flash_gpu, pairs_gpu


def unsupported(call: AttentionCall, query, key, value, interpret=False) -> Optional[str]:
    """None when attention() computes this call; else the name of the first option it cannot express (the
    flash kernel's refusals: flash_gpu.unsupported; per-pair tables: pairs_gpu.unsupported; the split-key
    kernel takes only calls the flash kernel also takes)."""
    if pairs_gpu.in_use(call):
        return pairs_gpu.unsupported(call, query, key, value, interpret)
    return flash_gpu.unsupported(call, query, key, value, interpret)


def attention(call: AttentionCall, query, key, value, interpret=False):
    """The AttentionCall's attention computed by the Pallas GPU kernels (blockwise_attention's semantics).

    query [...,T,N,H], key [...,S,K,H], value [...,S,K,Hv] -> [...,T,N,Hv] in query's dtype, or
    (out, lse [...,N,T]) with return_lse=True. interpret=True runs Pallas' interpreter (any platform).
    Options the kernel cannot express (unsupported) raise ValueError naming the option.

    A few query rows against a long key axis (decode_gpu.use_decode: a decode step against a cache) take
    the split-key kernel (decode_gpu.decode_attention) forward; their gradient, if asked for, is the flash kernel's.
    """
    return _attention(call, query, key, value, interpret, split_keys=True)


def flash_attention(call: AttentionCall, query, key, value, interpret=False):
    """attention() by the flash kernels whatever the shapes (never the split-key kernel): for comparisons
    (benchmarks/accelerator.py's decode rows)."""
    return _attention(call, query, key, value, interpret, split_keys=False)


def gradients_at(call: AttentionCall, query, key, value, out, lse, d_out, interpret=False):
    """flash_gpu.ResidualGrads at residuals (out, lse) of a softmax over more keys than the call's:
    flash_gpu.gradients_at; None where it does not take the call (per-pair tables, the options it lists) or
    T = 0 / S = 0."""
    if pairs_gpu.in_use(call) or min(np.shape(query)[-3], np.shape(key)[-3]) == 0:
        return None
    return flash_gpu.gradients_at(call, query, key, value, out, lse, d_out, interpret)


def _attention(call: AttentionCall, query, key, value, interpret, split_keys: bool):
    problem = unsupported(call, query, key, value, interpret)
    if problem is not None:
        checks.fail(
            "implementation",
            f'the XLA engines ("dense", "blockwise" or None) with {problem}: the Pallas GPU kernel cannot express it',
            '"pallas_gpu"',
        )
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    batch, T, S, N, K, H, Hv = checks.check_qkv(query, key, value)
    if T == 0 or S == 0:  # no tile to run: the XLA engine's zeros (and its lse of the sinks alone)
        return blockwise.tiled(call.replace(block_size=None), query, key, value)
    if pairs_gpu.in_use(call):  # per-pair tables: the flash kernels' grid with the tables' tiles read in
        return pairs_gpu.run(call, query, key, value, interpret)
    if split_keys and decode_gpu.use_decode(call, query, key, value, interpret):
        return decode_gpu.decode_with_flash_gradient(call, query, key, value, interpret)
    return flash_gpu.run(call, query, key, value, interpret)
