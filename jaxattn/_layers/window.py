"""Swin's (shifted) window self-attention on a feature map: the functional layer the Flax shells wrap.

    x [..., height, width, E] -> roll by -shift -> windows [..., nW, Wh*Ww, E] -> q, k, v -> window_attention
      (the 2D relative bias; the shifted regions as segment ids) -> out projection -> merge -> roll back

The parameter tree is docs/design.md, "The parameter tree" (query/key/value/out) plus {"window": {"table":
[R,N]}}, R = (2 Wh - 1)(2 Ww - 1). From transformers' SwinAttention: q_proj/k_proj/v_proj weight [N*H, E] ->
kernel [E,N,H], o_proj [E, N*H] -> [N,H,E], biases reshaped, relative_position_bias.relative_position_bias_table
as is. HF pads a map that does not tile into windows; here that is a ValueError (pad it yourself, as you
choose).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from .._core import checks
from .._core.eager import compiled_when_eager
from .._schemes.window import (
    as_pair,
    shifted_window_segments,
    window_attention,
    window_merge,
    window_partition,
    window_table_rows,
)
from . import common
from .multihead import project_out, project_qkv

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Float


def window_param_specs(
    features: int,
    num_heads: int,
    window_size,
    *,
    head_dim=None,
    use_bias=True,
    kernel_init=common.default_kernel_init,
    bias_init=common.default_bias_init,
    table_init=common.default_table_init,
) -> dict:
    """{group: {leaf: (shape, init)}}: the multi-head groups (features in and out) and window/table [R,N]."""
    dims = common.resolve_dims(features, num_heads, head_dim)
    specs = common.param_specs(dims, use_bias=use_bias, kernel_init=kernel_init, bias_init=bias_init)
    specs["window"] = {"table": ((window_table_rows(window_size), dims.N), table_init)}
    return specs


def init_window_attention(rng, features: int, num_heads: int, window_size, **options) -> dict:
    """Fresh params (lecun-normal kernels, zero biases, a N(0, 0.02^2) table; `options` as window_param_specs)."""
    specs = window_param_specs(features, num_heads, window_size, **options)
    leaves = [(group, leaf, spec) for group, group_specs in specs.items() for leaf, spec in group_specs.items()]
    keys = jax.random.split(rng, len(leaves))
    params: dict = {}
    for key, (group, leaf, (shape, init)) in zip(keys, leaves):
        params.setdefault(group, {})[leaf] = init(key, shape, jnp.float32)
    return params


@compiled_when_eager
def window_self_attention(
    params,
    x: Float[ArrayLike, "*#B Y X E"],
    window_size,
    *,
    shift=0,
    precision=None,
    implementation=None,
) -> Float[Array, "*#B Y X E"]:
    """Swin's W-MSA (shift 0) / SW-MSA (shift > 0) on a feature map [..., height, width, E]."""
    x = jnp.asarray(x)
    checks.check_min_rank("x", x, 3, "[...,height,width,E]: a feature map")
    E = params["query"]["kernel"].shape[0]
    if x.shape[-1] != E:
        checks.fail(
            "x", f"{E} channels (query/kernel [E,N,H]) in [...,height,width,E]", f"shape {checks.shape_str(x.shape)}"
        )
    table = params["window"]["table"]
    rows = window_table_rows(window_size)
    Wh, Ww = as_pair("window_size", window_size, 1)
    height, width = x.shape[-3:-1]
    if height % Wh or width % Ww:
        checks.fail("x", f"a height and width that tile into {Wh}x{Ww} windows", f"{height}x{width}")
    if table.shape[0] != rows:
        checks.fail("window/table", f"[{rows},N] for {Wh}x{Ww} windows", f"shape {checks.shape_str(table.shape)}")
    sh, sw = as_pair("shift", shift, 0)
    grid = (height, width)
    segments = {}
    if (sh, sw) != (0, 0):
        ids = shifted_window_segments(grid, (Wh, Ww), (sh, sw))
        segments = {"query_segment_ids": ids, "key_segment_ids": ids}
    rolled = jnp.roll(x, (-sh, -sw), axis=(-3, -2))
    windows = window_partition(rolled, (Wh, Ww))  # [..., nW, T, E]
    q, k, v = project_qkv(params, windows, precision=precision)
    z = window_attention(q, k, v, table, (Wh, Ww), precision=precision, implementation=implementation, **segments)
    out = window_merge(project_out(params, z, precision=precision), (Wh, Ww), grid)
    return jnp.roll(out, (sh, sw), axis=(-3, -2))
