"""The public entry: dot_product_attention and flex_attention, and the one registry of implementations that
every attention function resolves its `implementation=` through. It sits above the engines and the kernels
(docs/design.md, "Layering rules"): _core < _engines < _kernels < _api < _schemes < _layers.

    "dense"       one [...,N,T,S] array (every option)
    "blockwise"   O(T + S) tiles (no mask, bias, return_weights or dropout: they span [T,S])
    "pallas_gpu"  the Pallas flash-attention kernel for GPUs (jaxattn._kernels.pallas_gpu)
    "pallas_tpu"  TPU splash attention (jaxattn._kernels.splash_tpu); with score_mod, mask_mod, a BlockMask,
                  a T5 / ALiBi / window bias or Shaw / DeBERTa tables our Pallas TPU kernel
                  (jaxattn._kernels.flex_tpu, forward; XLA's backward)
    "cudnn"       cuDNN through jax.nn.dot_product_attention (jaxattn._kernels.cudnn)
    None          per platform, at lowering time (jax.lax.platform_dependent): on CPU (and ROCm, and any
                  other platform) the XLA engines, blockwise when nothing needs the grid and one head's
                  logits T x S hold at least AUTO_BLOCKWISE_ELEMENTS, dense otherwise (use_blockwise); on
                  CUDA by GPU generation (CUDA_KERNELS_BY_GENERATION: cuDNN first on Hopper, for the calls
                  it computes as we define them), the Pallas GPU kernel (its split-key kernel for a decode
                  step), and on TPU splash
                  attention (our flex kernel for score_mod / mask_mod / BlockMask) when the kernel can
                  express the call (its `unsupported` says None) and does not decline it (its optional
                  `declined`: on TPU a window bias, whose padded tiles take more memory than the dense
                  engine), else the same XLA engines there.

A call's options travel as one AttentionCall (jaxattn._core.call), built and checked once at the public
entry; each kernel declares what it expresses through `unsupported(call, query, key, value, interpret)`
and computes through `attention(call, query, key, value, interpret)`.

A call no kernel can express never builds the platform switch, so its program is exactly the XLA engine's;
nor does any call traced on a CPU host unless inside cross_platform_lowering() (exporting for an accelerator
from a CPU machine), which keeps CPU tracing as cheap as before; on a GPU or TPU host it holds that host's
kernel (and the XLA engines for every other platform).
interpret=True runs an explicit pallas_gpu / pallas_tpu in Pallas' interpreter on any platform (CPU tests).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Optional

import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _kernels, _mesh
from ._core import aliases, checks
from ._core.call import FIELDS, POSITION_TERMS, AttentionCall
from ._core.eager import compiled_when_eager
from ._dispatch.key_masks import key_mask_as_segments as key_mask_as_segments
from ._dispatch.platforms import (
    TPU_GENERATIONS as TPU_GENERATIONS,
    cross_platform_lowering as cross_platform_lowering,
    cuda_capability,
    switch_platforms,
    tpu_mesh as tpu_mesh,
)
from ._engines import blockwise
from ._engines.dense import attention_core
from ._engines.tiles import check_block_mask_tiles

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import ArrayLike, Bool, Float, Int

    from ._core.shapes import AttentionOutput

# implementation=None picks blockwise when nothing needs the full [T,S] grid and one head's logits T x S
# hold at least this many elements. Measured (benchmarks/auto.py, results/auto.json, docs/performance.md)
# over T = S in 128..8192, causal or not, with and without Shaw tables, MHA and GQA, forward and
# forward+backward: the row-grouped tiles win from 128 x 128 up (by 2-14x from 1024 on). Per head, not
# per call: batch dims do not change the choice, so a vmapped call (which hides its batch axis) chooses as
# the batched one does.
AUTO_BLOCKWISE_ELEMENTS = 128 * 128


@dataclasses.dataclass(frozen=True)
class Implementation:
    """One entry of the registry: what `implementation=name` runs.

    kernel: the module under jaxattn._kernels with unsupported / attention (None: an XLA engine);
    platform: where implementation=None may take the kernel (None: only when named); on CUDA, in the order
      of CUDA_KERNELS_BY_GENERATION;
    interpretable: Pallas' interpreter runs it (interpret=True);
    key_mask_as_segments: a key-only boolean mask reaches it as segment ids (key_mask_as_segments)."""

    name: str
    kernel: Optional[str] = None
    platform: Optional[str] = None
    interpretable: bool = False
    key_mask_as_segments: bool = False


REGISTRY = {
    impl.name: impl
    for impl in (
        Implementation("dense"),
        Implementation("blockwise"),
        Implementation("pallas_gpu", "pallas_gpu", "cuda", interpretable=True, key_mask_as_segments=True),
        Implementation("pallas_tpu", "pallas_tpu", "tpu", interpretable=True),
        Implementation("cudnn", "cudnn", "cuda"),
    )
}
IMPLEMENTATIONS = (None, *REGISTRY)
KERNELS = tuple(name for name, impl in REGISTRY.items() if impl.kernel is not None)
INTERPRETED = tuple(name for name, impl in REGISTRY.items() if impl.interpretable)


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


def kernel(implementation):
    """The kernel module of `implementation`, imported the first time a call may use it (`import jaxattn`
    imports no Pallas; the _kernels package itself is only a docstring)."""
    return importlib.import_module(f"{_kernels.__name__}.{REGISTRY[implementation].kernel}")


def kernel_refusal(implementation, call: AttentionCall, query, key, value, interpret=False) -> str | None:
    """The option that kernel `implementation` cannot express in this call (None: it can); interpret=True
    asks about Pallas' interpreter, which lifts a chip's limits (tile shapes, dtypes) but not the kernel's.

    The options that span the [T,S] grid (mask, bias, return_weights, dropout) are refused here for every
    kernel; the rest is the kernel module's `unsupported`."""
    if call.needs_grid:
        return call.grid_options[0]
    return kernel(implementation).unsupported(call, query, key, value, interpret)


def kernel_declines(implementation, call: AttentionCall, query, key, value) -> str | None:
    """Why implementation=None does not take kernel `implementation` for a call it expresses (None: it does):
    the kernel module's `declined`, where the evidence (compiled memory, timings) favours the XLA engines."""
    declined = getattr(kernel(implementation), "declined", None)
    return None if declined is None else declined(call, query, key, value)


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


def _for_kernel(name, call: AttentionCall, query, key) -> AttentionCall:
    """The call as kernel `name` receives it: a key-only mask as segment ids where the kernel takes them,
    and no block_size (the blockwise engine's tile; a kernel picks its own)."""
    if REGISTRY[name].key_mask_as_segments:
        call = key_mask_as_segments(call, query, key)
    return call.replace(block_size=None) if call.block_size is not None else call


def attend(call: AttentionCall, query, key, value, *, xla, implementation=None, interpret=False):
    """The result of `implementation` for `call`; xla(): the XLA engines' (dense or blockwise) for the same
    call. An explicit kernel that cannot express an option raises ValueError naming the option and the
    implementation; None takes a kernel only where one can (module docstring)."""
    check_implementation(implementation, interpret)
    # on a mesh a kernel runs on each device's shard (jaxattn._mesh): an Explicit mesh says how the inputs split
    # (split); Auto axes name only the mesh (auto), the split being the partitioner's
    split = _mesh.split_of(call, query, key, value) if implementation != "dense" else None
    auto = _mesh.auto_mesh_of(query, key, value) if split is None and implementation != "dense" else None
    if implementation in KERNELS:
        kernel_call = _for_kernel(implementation, call, query, key)
        refused = kernel_refusal(implementation, kernel_call, query, key, value, interpret)
        on_mesh = refused is None and (split is not None or auto is not None)
        if on_mesh:
            refused = _mesh_refusal(kernel_call, query, key, split, interpret)
        if refused is not None:
            checks.fail(
                refused,
                f"not in use with implementation={implementation!r}, which cannot express it"
                + (" on a mesh" if on_mesh else "")
                + " (implementation=None falls back to the XLA engines)",
                "in use",
            )
        return _on_shards(kernel(implementation).attention, kernel_call, query, key, value, split, auto, interpret)
    platforms = switch_platforms()
    if implementation is not None or not platforms:
        return xla()
    branches = {}
    for platform in platforms:
        for name in _platform_kernels(platform):
            kernel_call = _for_kernel(name, call, query, key)
            if (
                kernel_refusal(name, kernel_call, query, key, value) is None
                and kernel_declines(name, kernel_call, query, key, value) is None
                and (split is None and auto is None or _mesh_refusal(kernel_call, query, key, split) is None)
            ):
                run = kernel(name).attention
                branches[platform] = lambda run=run, c=kernel_call: _on_shards(run, c, query, key, value, split, auto)
                break
    if not branches:
        return xla()
    return lax.platform_dependent(cpu=xla, default=xla, **branches)


def _mesh_refusal(call: AttentionCall, query, key, split, interpret=False) -> str | None:
    """The option a kernel call on a mesh cannot split (jaxattn._mesh): by the Explicit split where there is one,
    else on Auto axes."""
    if split is not None:
        return _mesh.mesh_refusal(call, query, key, split, interpret)
    return _mesh.auto_refusal(call, query, key, interpret)


def _on_shards(run, call: AttentionCall, query, key, value, split, auto, interpret=False):
    """A kernel's attention(call, query, key, value, interpret) on each device's shard: by `split` over an
    Explicit mesh, by the partitioner's split over the Auto mesh `auto` (jaxattn._mesh), else on the whole
    arrays (one device)."""
    attend = lambda c, q, k, v: run(c, q, k, v, interpret)  # noqa: E731
    if split is not None:
        return _mesh.on_mesh(attend, call, query, key, value, split)
    if auto is not None:
        return _mesh.on_auto_mesh(attend, call, query, key, value)
    return run(call, query, key, value, interpret)


def _platform_kernels(platform) -> tuple[str, ...]:
    """The kernels implementation=None tries on `platform`, in order."""
    kernels = tuple(name for name in KERNELS if REGISTRY[name].platform == platform)
    return tuple(name for name in cuda_kernels(cuda_capability()) if name in kernels) if platform == "cuda" else kernels


def use_blockwise(implementation, call: AttentionCall, query, key) -> bool:
    """The XLA engines' rule (dot_product_attention, shaw_relative_attention, the position schemes).

    "dense" and "blockwise" are taken as given (the tiled engine raises for options it cannot do).
    None (automatic) and the kernels' names (their XLA fallback): blockwise when no option needs the full
    grid (call.needs_grid) and one head's logits T x S hold at least AUTO_BLOCKWISE_ELEMENTS; dense otherwise.
    """
    check_implementation(implementation)
    if implementation in ("dense", "blockwise"):
        return implementation == "blockwise"
    if call.needs_grid:
        return False
    if call.block_mask is not None:
        return True  # a BlockMask is there to skip tiles
    if np.ndim(query) < 3 or np.ndim(key) < 3:
        return False  # let the dense path raise its usual error
    return np.shape(query)[-3] * np.shape(key)[-3] >= AUTO_BLOCKWISE_ELEMENTS


def xla_engines(engine, call: AttentionCall, query, key, value):
    """The XLA engines' result for a call with no scheme terms: blockwise or dense, by use_blockwise."""
    if use_blockwise(engine, call, query, key):
        return blockwise.tiled(call, query, key, value)
    return attention_core(call, query, key, value)


@compiled_when_eager
def dot_product_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    bias: Float[ArrayLike, "..."] | None = None,
    mask: Bool[ArrayLike, "..."] | None = None,
    *,
    is_causal=False,
    key_value_seq_lengths: Int[ArrayLike, "*#B"] | None = None,
    query_positions: Int[ArrayLike, "*#B T"] | None = None,
    key_positions: Int[ArrayLike, "*#B S"] | None = None,
    scale=None,
    dropout_rate=0.0,
    dropout_rng=None,
    return_weights=False,
    precision=None,
    implementation=None,
    block_size=None,
    query_segment_ids: Int[ArrayLike, "*#B T"] | None = None,
    key_segment_ids: Int[ArrayLike, "*#B S"] | None = None,
    window=None,
    chunk_size=None,
    logit_softcap=None,
    sinks: Float[ArrayLike, "*#B N"] | None = None,
    interpret=False,
    query_seq_lengths: Int[ArrayLike, "*#B"] | None = None,
    local_window_size=None,
    return_residual=False,
    broadcast_dropout=False,
) -> AttentionOutput:
    """Scaled dot-product attention, multi-head / multi-query / grouped-query.

    Args:
      query: [...,T,N,H]; key: [...,S,K,H]; value: [...,S,K,Hv], one float dtype; N % K == 0.
      bias: additive float, broadcastable to [...,N,T,S], added to the scaled logits (-inf = blocked).
      mask: bool, True = may attend, broadcastable to [...,N,T,S].
      is_causal: bottom-right aligned: query t (at t + S - T) sees keys s <= t + S - T.
      key_value_seq_lengths: int [...]; keys s >= length are padding.
      query_positions / key_positions: int [...,T] / [...,S] absolute positions replacing the
        bottom-right defaults (used by the causal mask, window and chunks).
      scale: defaults to H ** -0.5.
      dropout_rate, dropout_rng: dropout on the weights (a key is required when rate > 0).
      return_weights: also return the weights [...,N,T,S] (after dropout).
      precision: passed to every einsum (use "highest" for float32 comparisons).
      implementation: None (default) chooses per platform when the program is lowered: on CPU "blockwise"
        when no mask, bias, return_weights or dropout is used and T x S >= 128 x 128, else "dense"; on
        CUDA "pallas_gpu" and on TPU "pallas_tpu" where the kernel expresses the call, else that same XLA
        choice (docs/performance.md, "GPU and TPU"). "dense": one [...,N,T,S] array (every option);
        "blockwise": O(T+S) memory tiles (no mask, bias, return_weights or dropout); "pallas_gpu" /
        "pallas_tpu" / "cudnn": that fused kernel, ValueError naming the option it cannot express.
      interpret: with "pallas_gpu" / "pallas_tpu", run the kernel in Pallas' interpreter (any platform,
        CPU included; for tests).
      block_size: blockwise tile, int or (query_block, key_block); default: see blockwise_attention.
      query_segment_ids / key_segment_ids: int [...,T] / [...,S]: a query sees only keys with its id
        (packed documents).
      window: (left, right), ints >= 0 or None (unbounded): key s allowed iff t - left <= s <= t + right
        (absolute positions; Mistral's sliding window W is (W - 1, 0) with is_causal).
      chunk_size: C > 0: key s allowed iff t // C == s // C (Llama 4's chunked attention).
      logit_softcap: c > 0: c * tanh(x / c) on the scaled query-key logits (relative key terms included),
        before bias and position biases (Gemma 2).
      sinks: float [N] or [...,N]: one logit per query head in the softmax denominator with no value
        (gpt-oss); it receives gradients; a row with no allowed key still gives zeros.

    jax.nn.dot_product_attention's spellings mean what they mean there (jaxattn._core.aliases,
    docs/coming_from.md): bias and mask may be passed positionally; query_seq_lengths: int [...], queries
    t >= length see no key (zeros); local_window_size: int or (left, right), our window; return_residual: also
    return jax.nn's residual, the lse [...,T,N] in the value dtype, without gradient (return_lse of
    flex_attention is the differentiable [...,N,T] one); implementation="xla": the XLA engines.
    broadcast_dropout (flax's): one dropout keep-mask [T,S] shared by every batch entry and head.

    The blockwise path skips the key tiles that causality, lengths, window, chunks or segment ids exclude.
    Returns [...,T,N,Hv] (or (out, weights)). A query with no allowed key (or T = 0 / S = 0) gets zeros.
    """
    window = aliases.window_from_local(local_window_size, window)
    query_segment_ids, key_segment_ids = aliases.query_length_segments(
        query_seq_lengths, query_segment_ids, key_segment_ids, np.shape(query), np.shape(key)
    )
    if not isinstance(return_residual, bool):
        checks.fail("return_residual", "True or False", repr(return_residual))
    call = AttentionCall(
        is_causal=is_causal,
        key_value_seq_lengths=key_value_seq_lengths,
        query_positions=query_positions,
        key_positions=key_positions,
        query_segment_ids=query_segment_ids,
        key_segment_ids=key_segment_ids,
        window=window,
        chunk_size=chunk_size,
        scale=scale,
        logit_softcap=logit_softcap,
        sinks=sinks,
        mask=mask,
        bias=bias,
        dropout_rate=dropout_rate,
        dropout_rng=dropout_rng,
        broadcast_dropout=bool(broadcast_dropout and dropout_rate != 0),  # no dropout: nothing to share
        return_weights=return_weights,
        return_lse=return_residual,
        precision=precision,
        block_size=block_size,
    )
    if implementation == "xla":  # jax.nn's name for its XLA path: the XLA engines' own choice, never a kernel
        implementation = "blockwise" if use_blockwise(None, call, query, key) else "dense"
    outs = run(call, query, key, value, implementation, interpret)
    return aliases.residual(outs, jnp.result_type(value)) if return_residual else outs


def scheme_call(function: str, options: dict, **terms) -> AttentionCall:
    """The AttentionCall of a position scheme's call: its keywords (dot_product_attention's, taken as
    **options) and its own position terms; TypeError naming `function` for a keyword it does not take."""
    unknown = sorted(set(options) - set(SCHEME_KEYWORDS))
    if unknown:
        raise TypeError(f"{function}() got unexpected keyword arguments {unknown}")
    return AttentionCall(**options, **terms)


def run(call: AttentionCall, query, key, value, implementation=None, interpret=False):
    """The public functions' common end: `call` by `implementation` (attend), the XLA engines' choice as
    the fallback."""
    check_implementation(implementation, interpret)
    engine = implementation if implementation in ("dense", "blockwise") else None
    return attend(
        call,
        query,
        key,
        value,
        implementation=implementation,
        interpret=interpret,
        xla=lambda: xla_engines(engine, call, query, key, value),
    )


# dot_product_attention's keywords that flex_attention takes through **options (the rest are its own
# arguments, or jax.nn's spellings that only dot_product_attention takes).
SHARED_KEYWORDS = (
    "bias",
    "mask",
    "is_causal",
    "key_value_seq_lengths",
    "query_positions",
    "key_positions",
    "dropout_rate",
    "dropout_rng",
    "broadcast_dropout",
    "return_weights",
    "precision",
    "query_segment_ids",
    "key_segment_ids",
    "window",
    "chunk_size",
    "logit_softcap",
    "sinks",
)

# The keywords a position scheme takes through **options: every option but the position terms it sets.
SCHEME_KEYWORDS = tuple(name for name in FIELDS if name not in (*POSITION_TERMS, "max_distance"))

# torch's flex_attention arguments with no JAX meaning: refused by name (never silently dropped).
TORCH_ONLY = {
    "kernel_options": "Triton kernel options of torch's flex_attention; XLA compiles this kernel",
    "return_aux": "use return_lse=True (the only auxiliary output here)",
}


@compiled_when_eager
def flex_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    score_mod=None,
    block_mask=None,
    scale=None,
    enable_gqa=None,
    return_lse=False,
    *,
    mask_mod=None,
    implementation=None,
    interpret=False,
    block_size=None,
    **options,
) -> AttentionOutput:
    """Attention with a score function, a mask function and block skipping (torch's FlexAttention, in JAX).

        score_mod(score, b, n, t, s) -> score   the scaled logit (after logit_softcap and bias) of query
                                                position t, key position s, query head n and flattened
                                                batch index b; elementwise: scalars in, a scalar out
        mask_mod(b, n, t, s) -> bool            True = may attend; ANDed with every other mask keyword

    The first eight arguments are torch's, in torch's order and with torch's meaning (only the layout
    differs: query [...,T,N,H] here, [B,N,T,H] in torch):
      block_mask: a BlockMask (create_block_mask). It carries its mask_mod, which applies inside its
        partial tiles; empty tiles are skipped and full tiles run without it. With mask_mod= as well the
        mask is their AND (full tiles skip mask_mod only when it is the BlockMask's own). A BlockMask
        built from raw tile lists without a mask_mod masks nothing inside its partial tiles (torch's
        noop_mask), or applies mask_mod= there. The blockwise path runs on its tiles (implementation=None
        picks blockwise when one is given).
      scale: defaults to H ** -0.5.
      enable_gqa: None (default) or True: key/value heads K may divide the query heads N (grouped-query
        attention); False: K must equal N, as torch requires without enable_gqa=True.
      return_lse: also return lse [...,N,T] (float32 for half inputs), log of each row's softmax
        normaliser, -inf for a row with no allowed key (torch's; with sinks, they are in it too).
        Differentiable.

    t and s are ABSOLUTE positions (query t at t + S - T, or query_positions / key_positions), so a causal
    mask_mod is `t >= s` with or without a cache in front; torch's are row indices: the same when T == S,
    and query_positions=jnp.arange(T) gives torch's reading otherwise. Arrays either function closes over
    receive gradients on both paths. Every keyword of dot_product_attention applies (implementation and
    interpret included); torch's kernel_options and return_aux are refused by name.
    """
    for name in TORCH_ONLY:
        if name in options:
            checks.fail(name, f"no {name} ({TORCH_ONLY[name]})", repr(options[name]))
    if not isinstance(return_lse, bool):
        checks.fail("return_lse", "True or False", repr(return_lse))
    if enable_gqa not in (None, True, False):
        checks.fail("enable_gqa", "None, True or False", repr(enable_gqa))
    if enable_gqa is False and np.ndim(query) >= 2 and np.ndim(key) >= 2 and np.shape(query)[-2] != np.shape(key)[-2]:
        checks.fail(
            "enable_gqa",
            "True (or None) for key/value heads K that differ from the query heads N "
            f"(torch refuses K != N without enable_gqa=True); query heads {np.shape(query)[-2]}, "
            f"key heads {np.shape(key)[-2]}",
            "False",
        )
    unknown = sorted(set(options) - set(SHARED_KEYWORDS))
    if unknown:
        raise TypeError(f"flex_attention() got unexpected keyword arguments {unknown}")
    if block_mask is not None and block_size is not None:  # the BlockMask's tiles are the blockwise tiles
        check_block_mask_tiles(block_mask, block_size)
    call = AttentionCall(
        score_mod=score_mod,
        mask_mod=mask_mod,
        block_mask=block_mask,
        scale=scale,
        return_lse=return_lse,
        block_size=block_size,
        **options,
    )
    return run(call, query, key, value, implementation, interpret)
