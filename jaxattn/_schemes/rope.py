"""Rotary position embeddings (Su et al. 2021).

Feature pairs (a, b) of each head are rotated by angle pos * theta_k, theta_k = base ** (-2k / rotary_dim),
k = 0 .. rotary_dim/2 - 1:   a' = a cos - b sin,   b' = b cos + a sin.   Features >= rotary_dim pass through.
Which features form pair k is the layout (the two conventions in use):

    "half":        (k, k + rotary_dim/2)   GPT-NeoX, HF Llama/Mistral/Qwen/Gemma (`rotate_half`)
    "interleaved": (2k, 2k + 1)            GPT-J, Meta's original Llama (complex multiplication)

A checkpoint trained in one layout runs in the other after permuting the q/k projection outputs of every
head by `rope_permutation` (HF's Llama conversion script does exactly this). Angles are computed in float32
or wider (float64 inputs keep float64), never in the input's half precision: bf16 positions lose
integers above 256. The inverse frequencies of HF's context extensions (linear, llama3, yarn) are
rope_scaling.py's; they enter here as `frequencies`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from .._api import attend, scheme_call
from .._core import checks
from .._core.checks import static_int
from .._core.dtypes import accumulation_dtype
from .._core.eager import compiled_when_eager
from .._core.positions import positions as absolute_positions
from .._engines import blockwise
from .._engines.dense import attention_core
from .rope_scaling import default_frequencies

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Float, Int

    from .._core.shapes import AttentionOutput

LAYOUTS = ("half", "interleaved")


def _check_layout(name, layout):
    if layout not in LAYOUTS:
        checks.fail(name, f"one of {LAYOUTS}", repr(layout))
    return layout


def _rotary_dim(rotary_dim, H: int) -> int:
    rotary_dim = H if rotary_dim is None else static_int("rotary_dim", rotary_dim, 2)
    if rotary_dim % 2:
        checks.fail("rotary_dim", "an even number (features rotate in pairs)", rotary_dim)
    if rotary_dim > H:
        checks.fail("rotary_dim", f"<= the head dim H={H}", rotary_dim)
    return rotary_dim


def _check_base(base):
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
        checks.fail("base", "a float > 1", repr(base))
    return float(base)


def inverse_frequencies(rotary_dim: int, base: float, dtype):
    """theta_k = base ** (-2k / rotary_dim), computed in float64 and then cast."""
    return jnp.asarray(default_frequencies(rotary_dim, base), dtype)


def _frequencies(frequencies, rotary_dim: int, base: float, dtype):
    if frequencies is None:
        return inverse_frequencies(rotary_dim, base, dtype)
    frequencies = jnp.asarray(frequencies)
    checks.check_float("frequencies", frequencies)
    checks.check_shape("frequencies", frequencies, (rotary_dim // 2,), "[rotary_dim/2]")
    return frequencies.astype(dtype)


def _split_pairs(x, rotary_dim: int, layout: str):
    if layout == "half":
        return x[..., : rotary_dim // 2], x[..., rotary_dim // 2 : rotary_dim]
    return x[..., 0:rotary_dim:2], x[..., 1:rotary_dim:2]


def _join_pairs(a, b, layout: str):
    if layout == "half":
        return jnp.concatenate([a, b], axis=-1)
    return jnp.stack([a, b], axis=-1).reshape(*a.shape[:-1], 2 * a.shape[-1])


def apply_rope(
    x: Float[ArrayLike, "*#B T N H"],
    positions: Int[ArrayLike, "*#B T"] | None = None,
    *,
    offset=0,
    base: float = 10000.0,
    rotary_dim: int | None = None,
    layout: str = "half",
    frequencies: Float[ArrayLike, " _half_rotary_dim"] | None = None,
) -> Float[Array, "*#B T N H"]:
    """Rotate the first `rotary_dim` features of every head of x [...,T,N,H] by its position.

    positions: int [...,T] (broadcast against x's batch dims); default arange(T) + offset (offset: an int
    or int scalar array, e.g. the number of cached tokens when decoding). rotary_dim: even, <= H, default H
    (GPT-NeoX/GPT-J rotate only part of each head). frequencies: the inverse frequencies theta_k
    [rotary_dim/2] to use instead of base ** (-2k / rotary_dim), for scaled variants (HF's "linear":
    theta / factor; "llama3", "yarn": their own per-k formulas). Returns x's shape and dtype.
    """
    x = jnp.asarray(x)
    checks.check_min_rank("x", x, 3, "[...,T,N,H]")
    checks.check_float("x", x)
    *_, T, N, H = x.shape
    rotary_dim = _rotary_dim(rotary_dim, H)
    layout = _check_layout("layout", layout)
    base = _check_base(base)
    if positions is None:
        offset = jnp.asarray(offset)
        checks.check_int("offset", offset)
        checks.check_rank("offset", offset, 0, "a scalar")
        positions = jnp.arange(T, dtype=jnp.int32) + offset.astype(jnp.int32)
    else:
        positions = jnp.asarray(positions)
        checks.check_int("positions", positions)
        checks.check_min_rank("positions", positions, 1, "[...,T]")
        checks.check_dim("positions", positions, -1, T, "[...,T]")
    acc_dtype = accumulation_dtype(x.dtype)
    angles = positions.astype(acc_dtype)[..., :, None, None] * _frequencies(frequencies, rotary_dim, base, acc_dtype)
    cos, sin = jnp.cos(angles), jnp.sin(angles)  # [...,T,1,rotary_dim/2]
    a, b = _split_pairs(x.astype(acc_dtype), rotary_dim, layout)
    rotated = _join_pairs(a * cos - b * sin, b * cos + a * sin, layout)
    rest = jnp.broadcast_to(x[..., rotary_dim:], rotated.shape[:-1] + (H - rotary_dim,)).astype(acc_dtype)
    return jnp.concatenate([rotated, rest], axis=-1).astype(x.dtype)


def rope_permutation(
    head_dim: int, *, rotary_dim: int | None = None, source: str = "interleaved", target: str = "half"
):
    """int [H] permutation p with apply_rope(x[..., p], layout=target) == apply_rope(x, layout=source)[..., p].

    Permute a q/k projection's output features per head with it (flax kernel [E,N,H]: kernel[..., p],
    bias [N,H]: bias[..., p]) to move a checkpoint between layouts; q . k is unchanged because q and k
    move together. interleaved -> half is HF's `permute` in convert_llama_weights_to_hf.py.
    """
    head_dim = static_int("head_dim", head_dim, 1)
    rotary_dim = _rotary_dim(rotary_dim, head_dim)
    _check_layout("source", source)
    _check_layout("target", target)
    half = rotary_dim // 2
    # feature f of `layout` holds component c of pair k:
    pair_of = {"half": lambda k, c: k + c * half, "interleaved": lambda k, c: 2 * k + c}
    perm = np.arange(head_dim)
    for k in range(half):
        for c in (0, 1):
            perm[pair_of[target](k, c)] = pair_of[source](k, c)
    return perm


@compiled_when_eager
def rope_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    *,
    base: float = 10000.0,
    rotary_dim: int | None = None,
    layout: str = "half",
    **options,
) -> AttentionOutput:
    """RoPE on query and key at the core's positions, then dot_product_attention.

    Positions: query t at t + S - T, key s at s (or `query_positions` / `key_positions`), the same ones
    the causal mask uses; so decoding T new tokens against S cached keys needs no offset bookkeeping.
    Keys here are the *unrotated* projections (rotate-then-cache users call apply_rope themselves).
    implementation / interpret: None (default: the dense engine on CPU, as ever; a kernel on GPU / TPU
    where it expresses the call), "dense", "blockwise" or a kernel, as dot_product_attention's.
    """
    implementation, interpret = options.pop("implementation", None), options.pop("interpret", False)
    call = scheme_call("rope_attention", options)
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    dims = checks.check_qkv(query, key, value)
    q_pos, k_pos = absolute_positions(dims.T, dims.S, call.query_positions, call.key_positions)
    rope = dict(base=base, rotary_dim=rotary_dim, layout=layout)
    q, k = apply_rope(query, q_pos, **rope), apply_rope(key, k_pos, **rope)
    if implementation == "blockwise":
        return blockwise.tiled(call, q, k, value)

    def xla():
        return attention_core(call, q, k, value, dims=dims)

    return attend(call, q, k, value, xla=xla, implementation=implementation, interpret=interpret)
