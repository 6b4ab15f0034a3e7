"""jaxattn: multi-head and relative-position attention as pure JAX functions.

Axis letters (one table, used in every einsum string, shape doc, local name and test):

    ...  any number of leading batch dims (B in examples)
    T    query length                 S    key/value length
    N    query heads                  K    key/value heads, N % K == 0 (query head n uses n // (N // K))
    H    head dim of queries/keys     Hv   head dim of values
    E    model width (Eq, Ek, Ev, Eo where they differ)
    R    relative-position buckets (2 * max_distance + 1 for clipped tables)

Head-split tensors are [...,T,N,H]; attention logits/weights are [...,N,T,S]. The signatures carry these shapes
as jaxtyping annotations in the same letters (`query: Float[ArrayLike, "*#B T N H"]`, *#B being `...`),
annotations only: strings, jaxtyping imported for type checkers alone (no run-time dependency), never checked
at run time here (tests/test_shapes.py resolves and checks them with beartype).
Masks are bool with True = may attend; biases are added to the scaled logits; is_causal is bottom-right
aligned (query t sits at t + S - T); a query with no allowed key returns zeros. Every function is pure
and works under jax.jit, jax.vmap and jax.grad; bad input raises ValueError at trace time.
"""

# The public surface, in import order (by home module); docs/design.md, "Public functions", groups it by job.
from ._api import (
    dot_product_attention as dot_product_attention,
    flex_attention as flex_attention,
)
from ._core.block_mask import BlockMask as BlockMask
from ._core.mods import and_masks as and_masks, noop_mask as noop_mask, or_masks as or_masks
from ._dispatch.platforms import cross_platform_lowering as cross_platform_lowering
from ._dispatch.ring import ring_attention as ring_attention
from ._engines.blockwise import blockwise_attention as blockwise_attention
from ._engines.flex import create_block_mask as create_block_mask
from ._forms.delta_rule import (
    causal_conv1d as causal_conv1d,
    gated_delta_rule as gated_delta_rule,
    gated_delta_rule_step as gated_delta_rule_step,
    gated_rms_norm as gated_rms_norm,
)
from ._layers.disentangled import (
    disentangled_multi_head_attention as disentangled_multi_head_attention,
    init_disentangled_multi_head_attention as init_disentangled_multi_head_attention,
)
from ._layers.latent import (
    init_latent_attention as init_latent_attention,
    init_latent_cache as init_latent_cache,
    latent_attention as latent_attention,
    latent_core as latent_core,
    latent_projections as latent_projections,
)
from ._layers.multihead import (
    init_multi_head_attention as init_multi_head_attention,
    init_relative_multi_head_attention as init_relative_multi_head_attention,
    multi_head_attention as multi_head_attention,
    project_out as project_out,
    project_qkv as project_qkv,
    relative_multi_head_attention as relative_multi_head_attention,
)
from ._layers.sharding import (
    partition_spec as partition_spec,
    shard_inputs as shard_inputs,
    shard_params as shard_params,
)
from ._layers.window import (
    init_window_attention as init_window_attention,
    window_self_attention as window_self_attention,
)
from ._schemes.alibi import (
    alibi_attention as alibi_attention,
    alibi_bias as alibi_bias,
    alibi_position_bias as alibi_position_bias,
    alibi_slopes as alibi_slopes,
)
from ._schemes.clipped import (
    clipped_relative_attention as clipped_relative_attention,
    clipped_relative_index as clipped_relative_index,
)
from ._schemes.disentangled import (
    deberta_log_bucket_position as deberta_log_bucket_position,
    deberta_relative_position as deberta_relative_position,
    disentangled_attention as disentangled_attention,
)
from ._schemes.position_bias import position_bias_attention as position_bias_attention
from ._schemes.rope import (
    apply_rope as apply_rope,
    rope_attention as rope_attention,
    rope_permutation as rope_permutation,
)
from ._schemes.shaw import (
    relative_attention as relative_attention,
    relative_position_index as relative_position_index,
    shaw_relative_attention as shaw_relative_attention,
)
from ._schemes.t5 import (
    t5_attention as t5_attention,
    t5_position_bias as t5_position_bias,
    t5_relative_bias as t5_relative_bias,
    t5_relative_position_bucket as t5_relative_position_bucket,
)
from ._schemes.window import (
    shifted_window_mask as shifted_window_mask,
    shifted_window_segments as shifted_window_segments,
    window_attention as window_attention,
    window_merge as window_merge,
    window_partition as window_partition,
    window_position_bias as window_position_bias,
    window_relative_bias as window_relative_bias,
    window_relative_index as window_relative_index,
    window_table_rows as window_table_rows,
)
from ._schemes.xl import relative_sinusoids as relative_sinusoids, transformer_xl_attention as transformer_xl_attention
from ._version import __version__ as __version__

__all__ = [
    "dot_product_attention",
    "cross_platform_lowering",
    "flex_attention",
    "create_block_mask",
    "BlockMask",
    "and_masks",
    "or_masks",
    "noop_mask",
    "relative_attention",
    "relative_position_index",
    "shaw_relative_attention",
    "init_multi_head_attention",
    "multi_head_attention",
    "init_relative_multi_head_attention",
    "relative_multi_head_attention",
    "project_qkv",
    "project_out",
    "t5_relative_position_bucket",
    "t5_relative_bias",
    "t5_position_bias",
    "t5_attention",
    "alibi_slopes",
    "alibi_bias",
    "alibi_position_bias",
    "alibi_attention",
    "apply_rope",
    "rope_permutation",
    "rope_attention",
    "clipped_relative_index",
    "clipped_relative_attention",
    "relative_sinusoids",
    "transformer_xl_attention",
    "window_relative_index",
    "window_table_rows",
    "window_position_bias",
    "window_relative_bias",
    "window_attention",
    "shifted_window_segments",
    "shifted_window_mask",
    "window_partition",
    "window_merge",
    "init_window_attention",
    "window_self_attention",
    "deberta_log_bucket_position",
    "deberta_relative_position",
    "disentangled_attention",
    "disentangled_multi_head_attention",
    "init_disentangled_multi_head_attention",
    "position_bias_attention",
    "blockwise_attention",
    "ring_attention",
    "shard_params",
    "shard_inputs",
    "partition_spec",
    "gated_delta_rule",
    "gated_delta_rule_step",
    "causal_conv1d",
    "gated_rms_norm",
    "latent_attention",
    "latent_core",
    "latent_projections",
    "init_latent_attention",
    "init_latent_cache",
]
