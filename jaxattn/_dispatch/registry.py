"""The registry: every implementation `implementation=` names is an Implementation entry of one shape, the XLA
engines and the fused kernels alike, and the dispatch (route.attend) drives them through that shape alone.

    "dense"       one [...,N,T,S] array (every option)
    "blockwise"   O(T + S) tiles (no mask, bias, return_weights or dropout: they span [T,S])
    "pallas_gpu"  our Pallas kernels for GPUs (jaxattn._kernels.pallas_gpu: flash forward and backward, a
                  split-key kernel for a decode step, per-pair tables)
    "pallas_tpu"  TPU splash attention (jaxattn._kernels.splash_tpu); with score_mod, mask_mod, a BlockMask, a
                  T5 / ALiBi / window bias, Shaw / DeBERTa tables or per-pair tables our Pallas TPU kernel
                  (jaxattn._kernels.flex_tpu forward, jaxattn._kernels.flex_tpu_vjp's Pallas backward; a
                  window's bias, a score_mod's arrays and what does not fit VMEM keep the XLA blockwise backward)
    "cudnn"       cuDNN through jax.nn.dot_product_attention (jaxattn._kernels.cudnn)

implementation=None tries, per platform, the fused kernels whose `platform` it is (on CUDA in the order of
CUDA_KERNELS_BY_GENERATION) and takes the first that expresses the call (`unsupported` says None) and does not
decline it (`declined` says None); else the XLA engines, blockwise or dense by use_blockwise.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from types import ModuleType
from typing import Any, Callable, Optional

import numpy as np

from .. import _kernels
from .._core import checks
from .._core.call import AttentionCall
from .._engines import blockwise
from .._engines.dense import attention_core
from . import platforms
from .key_masks import key_mask_as_segments

# implementation=None picks blockwise when nothing needs the full [T,S] grid and one head's logits T x S
# hold at least this many elements. Measured (benchmarks/auto.py, results/auto.json, docs/performance.md)
# over T = S in 128..8192, causal or not, with and without Shaw tables, MHA and GQA, forward and
# forward+backward: the row-grouped tiles win from 128 x 128 up (by 2-14x from 1024 on). Per head, not
# per call: batch dims do not change the choice, so a vmapped call (which hides its batch axis) chooses as
# the batched one does.
AUTO_BLOCKWISE_ELEMENTS = 128 * 128


def never(*_) -> None:
    """An entry's `unsupported` / `declined` that never refuses or declines a call."""
    return None


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One entry of the registry: what `implementation=name` runs, and what it refuses.

    attention(call, query, key, value, interpret) -> out: how it computes a call (the call it receives);
    unsupported(call, query, key, value, interpret) -> the option it cannot express (None: it computes the
      call exactly); asked of a fused kernel only, whose refusal is a ValueError naming the option (the XLA
      engines take every call and raise their own errors);
    declined(call, query, key, value) -> why implementation=None keeps the XLA engines for a call it expresses,
      where the evidence (compiled memory, timings) favours them (None: it takes the call; default: never);
    fused: a fused kernel, which runs on each device's shard over a mesh (jaxattn._mesh) and picks its own
      tiles (no block_size); else an XLA engine, which XLA partitions;
    platform: where implementation=None tries it, on CUDA in the order of CUDA_KERNELS_BY_GENERATION (None:
      never tried; the XLA engines are None's fallback everywhere, by use_blockwise);
    interpretable: Pallas' interpreter runs it (interpret=True);
    key_mask_as_segments: a key-only boolean mask reaches it as segment ids (key_masks);
    reads_mesh: how the inputs split over a mesh is read before it runs (jaxattn._mesh), so that a query or key
      split along its sequence is refused by name, pointing at ring_attention; dense alone does not read it;
    gradients_at(call, query, key, value, out, lse, d_out, interpret) -> flash_gpu.ResidualGrads or None: its
      backward at residuals given by the caller, the out and lse of a softmax that may span more keys than `key`
      (a ring_attention step's share of the whole softmax's gradient): the cotangents of q, k, v and of the
      position terms it takes (an OffsetBias's rows over the call's offsets, flash_gpu.bias_rows_at; Shaw's key
      table); None (the field, or the result): it has none for the call, and the ring takes the step's gradient
      through its forward.
    """

    name: str
    attention: Callable[..., Any]
    unsupported: Callable[..., Optional[str]] = never
    declined: Callable[..., Optional[str]] = never
    fused: bool = False
    platform: Optional[str] = None
    interpretable: bool = False
    key_mask_as_segments: bool = False
    reads_mesh: bool = True
    gradients_at: Optional[Callable[..., Any]] = None

    def receives(self, call: AttentionCall, query, key) -> AttentionCall:
        """The call as this implementation receives it: a key-only mask as segment ids where it takes them, and
        for a fused kernel no block_size (the blockwise engine's tile; a kernel picks its own)."""
        if self.key_mask_as_segments:
            call = key_mask_as_segments(call, query, key)
        return call.replace(block_size=None) if self.fused and call.block_size is not None else call


def kernel(module: str) -> ModuleType:
    """The kernel module `module` under jaxattn._kernels, imported the first time a call may use it (`import
    jaxattn` imports no Pallas; the _kernels package itself is only a docstring)."""
    return importlib.import_module(f"{_kernels.__name__}.{module}")


def _kernel_attention(module: str, call: AttentionCall, query, key, value, interpret=False):
    return kernel(module).attention(call, query, key, value, interpret)


def _kernel_unsupported(module: str, call: AttentionCall, query, key, value, interpret=False) -> Optional[str]:
    """The options that span the [T,S] grid (mask, bias, return_weights, dropout) are refused here for every
    kernel; the rest is the kernel module's `unsupported`. interpret=True asks about Pallas' interpreter, which
    lifts a chip's limits (tile shapes, dtypes) but not the kernel's."""
    if call.needs_grid:
        return call.grid_options[0]
    return kernel(module).unsupported(call, query, key, value, interpret)


def _kernel_declined(module: str, call: AttentionCall, query, key, value) -> Optional[str]:
    return kernel(module).declined(call, query, key, value)


def _kernel_gradients_at(module: str, call: AttentionCall, query, key, value, out, lse, d_out, interpret=False):
    if call.needs_grid:
        return None
    return kernel(module).gradients_at(call, query, key, value, out, lse, d_out, interpret)


def fused_kernel(name: str, platform: str, *, declines=False, residuals=False, **flags) -> Implementation:
    """The entry of kernel module `name` (its unsupported / attention, its declined where `declines`, its
    gradients_at where `residuals`)."""
    declined = functools.partial(_kernel_declined, name) if declines else never
    return Implementation(
        name,
        attention=functools.partial(_kernel_attention, name),
        unsupported=functools.partial(_kernel_unsupported, name),
        declined=declined,
        fused=True,
        platform=platform,
        gradients_at=functools.partial(_kernel_gradients_at, name) if residuals else None,
        **flags,
    )


def _dense(call: AttentionCall, query, key, value, interpret=False):
    return attention_core(call, query, key, value)


def _blockwise(call: AttentionCall, query, key, value, interpret=False):
    return blockwise.tiled(call, query, key, value)


REGISTRY = {
    entry.name: entry
    for entry in (
        Implementation("dense", _dense, reads_mesh=False),
        Implementation("blockwise", _blockwise),
        fused_kernel("pallas_gpu", "cuda", interpretable=True, key_mask_as_segments=True, residuals=True),
        # on TPU a window bias, whose padded tiles take more memory than the dense engine (flex_tpu.declined)
        fused_kernel("pallas_tpu", "tpu", declines=True, interpretable=True, key_mask_as_segments=True, residuals=True),
        fused_kernel("cudnn", "cuda"),
    )
}
IMPLEMENTATIONS = (None, *REGISTRY)
KERNELS = tuple(name for name, entry in REGISTRY.items() if entry.fused)
INTERPRETED = tuple(name for name, entry in REGISTRY.items() if entry.interpretable)


def check_implementation(implementation, interpret=False):
    """ValueError naming `implementation` / `interpret` for a value outside IMPLEMENTATIONS."""
    if implementation not in IMPLEMENTATIONS:
        checks.fail(
            "implementation",
            "None (per platform), " + ", ".join(repr(i) for i in IMPLEMENTATIONS[1:]),
            repr(implementation),
        )
    if not isinstance(interpret, bool):
        checks.fail("interpret", "True or False", repr(interpret))
    if interpret and implementation not in INTERPRETED:
        checks.fail(
            "interpret",
            f"False unless implementation is {' or '.join(map(repr, INTERPRETED))} "
            "(only Pallas kernels have an interpreter)",
            f"True with implementation={implementation!r}",
        )


def use_blockwise(implementation, call: AttentionCall, query, key) -> bool:
    """The XLA engines' rule (dot_product_attention, shaw_relative_attention, the position schemes), for an
    `implementation` already checked (check_implementation).

    "dense" and "blockwise" are taken as given (the tiled engine raises for options it cannot do).
    None (automatic) and the kernels' names (their XLA fallback): blockwise when no option needs the full
    grid (call.needs_grid) and one head's logits T x S hold at least AUTO_BLOCKWISE_ELEMENTS; dense otherwise.
    """
    if implementation in ("dense", "blockwise"):
        return implementation == "blockwise"
    if call.needs_grid:
        return False
    if call.block_mask is not None:
        return True  # a BlockMask is there to skip tiles
    if np.ndim(query) < 3 or np.ndim(key) < 3:
        return False  # let the dense path raise its usual error
    return np.shape(query)[-3] * np.shape(key)[-3] >= AUTO_BLOCKWISE_ELEMENTS


def xla_engine(implementation, call: AttentionCall, query, key) -> Implementation:
    """The XLA engine's entry for `implementation` (dense or blockwise as named; else by use_blockwise)."""
    return REGISTRY["blockwise" if use_blockwise(implementation, call, query, key) else "dense"]


# implementation=None on CUDA: the kernels to try, in order, by GPU generation (the lowest compute capability
# each row covers, highest first); the first that expresses the call is taken. The evidence, with its
# sources (docs/kernels.md, "implementation=None on each GPU generation"): on Hopper, cuDNN's fused attention
# runs at 575-617 TFLOP/s forward at head dim 128 in bf16 against 350-370 for FlashAttention-2-class kernels
# such as ours (FlashAttention-3 paper, arXiv 2407.08608, figures 5-6), so cuDNN goes first for the calls it
# computes exactly as we define them (bf16 / fp16, H == Hv, causal or window only with T == S: cudnn.py);
# on Ampere and Ada, FlashAttention-2-class kernels are at least as fast as cuDNN's (FlashAttention-2 paper,
# arXiv 2307.08691), and ours expresses every call cuDNN does, so it is ours alone. No GPU measurement of ours
# exists yet: benchmarks/device_check.py measures both on the first GPU at hand, and this table follows it.
CUDA_KERNELS_BY_GENERATION = (
    ((9, 0), ("cudnn", "pallas_gpu")),  # Hopper (H100, H200) and later
    ((0, 0), ("pallas_gpu",)),  # Ampere (A100), Ada, and a target whose generation is not known
)


def cuda_kernels(capability: Optional[tuple[int, int]]) -> tuple[str, ...]:
    """The CUDA kernels implementation=None tries, in order, for a GPU of `capability` (None: unknown)."""
    capability = (0, 0) if capability is None else capability
    return next(kernels for lowest, kernels in CUDA_KERNELS_BY_GENERATION if capability >= lowest)


def tried_on(platform: str) -> tuple[Implementation, ...]:
    """The entries implementation=None tries on `platform`, in order (on CUDA by the GPU's generation,
    platforms.cuda_capability)."""
    entries = tuple(entry for entry in REGISTRY.values() if entry.platform == platform)
    if platform != "cuda":
        return entries
    names = {entry.name for entry in entries}
    return tuple(REGISTRY[name] for name in cuda_kernels(platforms.cuda_capability()) if name in names)
