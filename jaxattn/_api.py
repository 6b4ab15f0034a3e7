"""The public entry: dot_product_attention and flex_attention. Each builds one AttentionCall (jaxattn._core.call),
checked once, and hands it to the dispatch (jaxattn._dispatch.route.attend), which checks `implementation=` once
and resolves it through the registry (jaxattn._dispatch.registry: every implementation and what
implementation=None takes on each platform). It sits above the engines and the kernels (docs/design.md,
"Layering rules"): _core < _engines < _kernels < _dispatch, _api < _schemes < _layers.

The registry's, the dispatch's and the platforms' names stay importable from here (the position schemes import
attend, check_implementation and use_blockwise from this module).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from ._core import aliases, checks
from ._core.call import FIELDS, POSITION_TERMS, AttentionCall
from ._core.eager import compiled_when_eager
from ._dispatch.key_masks import key_mask_as_segments as key_mask_as_segments
from ._dispatch.platforms import (
    TPU_GENERATIONS as TPU_GENERATIONS,
    cross_platform_lowering as cross_platform_lowering,
    cuda_capability as cuda_capability,
    tpu_mesh as tpu_mesh,
)
from ._dispatch.registry import (
    AUTO_BLOCKWISE_ELEMENTS as AUTO_BLOCKWISE_ELEMENTS,
    CUDA_KERNELS_BY_GENERATION as CUDA_KERNELS_BY_GENERATION,
    IMPLEMENTATIONS as IMPLEMENTATIONS,
    INTERPRETED as INTERPRETED,
    KERNELS as KERNELS,
    REGISTRY as REGISTRY,
    Implementation as Implementation,
    check_implementation as check_implementation,
    cuda_kernels as cuda_kernels,
    kernel as kernel,
    use_blockwise as use_blockwise,
)
from ._dispatch.route import attend as attend
from ._engines.tiles import check_block_mask_tiles

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import ArrayLike, Bool, Float, Int

    from ._core.shapes import AttentionOutput


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
        CUDA "cudnn" first on Hopper and later GPUs (for the calls it computes as defined here), then
        "pallas_gpu"; on TPU "pallas_tpu"; each where the kernel expresses the call (and pallas_tpu does not
        decline it), else that same XLA choice (docs/performance.md, "GPU and TPU"; docs/kernels.md,
        "implementation=None on each GPU generation"). "dense": one [...,N,T,S] array (every option);
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
    outs = attend(call, query, key, value, implementation=implementation, interpret=interpret)
    return aliases.residual(outs, jnp.result_type(value)) if return_residual else outs


def scheme_call(function: str, options: dict, **terms) -> AttentionCall:
    """The AttentionCall of a position scheme's call: its keywords (dot_product_attention's, taken as
    **options) and its own position terms; TypeError naming `function` for a keyword it does not take."""
    unknown = sorted(set(options) - set(SCHEME_KEYWORDS))
    if unknown:
        raise TypeError(f"{function}() got unexpected keyword arguments {unknown}")
    return AttentionCall(**options, **terms)


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
    return attend(call, query, key, value, implementation=implementation, interpret=interpret)
