"""The public entry points: blockwise_attention (keywords) and tiled (an AttentionCall: what the dispatch,
the schemes and the kernels' empty-input path call); the grid options are refused by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from ..._core import checks
from ..._core.call import GRID_KEYWORDS, AttentionCall
from ..._core.dtypes import accumulation_dtype
from ..._core.eager import compiled_when_eager
from .. import tiles
from .groups import grouped_engine, row_grouped, tile_sizes, whole_rows
from .inputs import (
    check_tables,
    check_terms,
    engine_operands,
    from_engine,
    nothing_to_tile,
    position_hook,
    positions_and_lengths,
    with_block_mask,
)
from .values import Config, KeySide, Shared

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import ArrayLike, Float, Int

    from ..._core.shapes import Attended, Lse


@compiled_when_eager
def blockwise_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    *,
    is_causal=False,
    key_value_seq_lengths: Int[ArrayLike, "*#B"] | None = None,
    query_positions: Int[ArrayLike, "*#B T"] | None = None,
    key_positions: Int[ArrayLike, "*#B S"] | None = None,
    scale=None,
    position_bias=None,
    key_table: Float[ArrayLike, "R H"] | Float[ArrayLike, "R N H"] | None = None,
    value_table: Float[ArrayLike, "R Hv"] | Float[ArrayLike, "R N Hv"] | None = None,
    max_distance=None,
    block_size=None,
    precision=None,
    query_segment_ids: Int[ArrayLike, "*#B T"] | None = None,
    key_segment_ids: Int[ArrayLike, "*#B S"] | None = None,
    window=None,
    chunk_size=None,
    logit_softcap=None,
    sinks: Float[ArrayLike, "*#B N"] | None = None,
    score_mod=None,
    mask_mod=None,
    block_mask=None,
    return_lse=False,
    **grid_options,
) -> Attended | tuple[Attended, Lse]:
    """Attention computed one [Tb,Sb] tile at a time; O(T + S) memory forward and backward.

    query [...,T,N,H], key [...,S,K,H], value [...,S,K,Hv] and is_causal, key_value_seq_lengths,
    query_positions, key_positions, scale, precision, query_segment_ids, key_segment_ids, window, chunk_size,
    logit_softcap, sinks: as dot_product_attention, with equal results (fully masked rows give zeros, finite
    gradients); score_mod, mask_mod, block_mask: as flex_attention. Half precision accumulates in float32.
    Key tiles that causality, lengths, window, chunks, segment ids or the BlockMask exclude are never visited;
    tiles every rule allows run without a mask, the BlockMask's full tiles without mask_mod.

    key_table / value_table / max_distance: Shaw et al. clipped tables, as shaw_relative_attention
      ([R,H] or [R,N,H], R = 2*max_distance+1); each tile gathers q . table[r] per bucket, or, with the
      default positions and R above a tile's Tb + Sb - 1 offsets, q . table[row] of those offsets' rows only.
    position_bias(query_pos, key_pos) -> bias: the per-tile position hook, a pure function of the tile's
      absolute positions (int32 [Tb] and [Sb], or [B,Tb] / [B,Sb] for batched positions flattened to B; the
      causal mask's; padding past T or S repeats the last one and is masked), never of T, S or a tile's
      index; bias broadcastable to [(B,)N,Tb,Sb], added to the *scaled* logits. Arrays it closes over (a T5
      table, ALiBi slopes) get gradients through the custom VJP.
    block_size: int or (query_block, key_block); default (jaxattn._engines.tiles, the whole policy): 512 keys
      and 512 / G queries, causal or not, capped by a window's span; rows (batch
      entries x key/value heads) run in groups whose float32 tile fits tiles.ROW_TILE_BYTES, all rows at once
      for inputs on a multi-device mesh (on_a_device_mesh) or with score_mod / mask_mod. A block_mask's
      block_size is the tile.
    return_lse: also return lse [...,N,T], the log of each row's softmax normaliser (allowed keys and the
      sink) in the compute dtype, -inf for a row with no allowed key; gradients flow through it.

    Arbitrary masks and biases (and return_weights, dropout) need the full [T,S] grid: passing them
    raises ValueError (implementation=None falls back to the dense path instead).
    """
    _refuse_grid_options(grid_options)
    call = AttentionCall(
        is_causal=is_causal,
        key_value_seq_lengths=key_value_seq_lengths,
        query_positions=query_positions,
        key_positions=key_positions,
        query_segment_ids=query_segment_ids,
        key_segment_ids=key_segment_ids,
        window=window,
        chunk_size=chunk_size,
        mask_mod=mask_mod,
        block_mask=block_mask,
        scale=scale,
        logit_softcap=logit_softcap,
        sinks=sinks,
        score_mod=score_mod,
        key_table=key_table,
        value_table=value_table,
        max_distance=max_distance,
        position_bias=position_bias,
        return_lse=return_lse,
        precision=precision,
        block_size=block_size,
    )
    return tiled(call, query, key, value)


def tiled(call: AttentionCall, query, key, value):
    """blockwise_attention of `call` (an AttentionCall without the grid options: mask, bias, weights,
    dropout; the dispatch never sends one here, blockwise_attention refuses them by name)."""
    if call.needs_grid:
        _refuse_grid_options({name: getattr(call, name) for name in GRID_KEYWORDS})
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    batch, T, S, N, K, H, Hv = checks.check_qkv(query, key, value)
    acc_dtype, B = accumulation_dtype(query.dtype), int(np.prod(batch, dtype=np.int64))
    block_size, mask_mod, block_mask = call.block_size, call.mask_mod, call.block_mask
    if block_mask is not None:  # the BlockMask's own mask_mod applies (block_masks.resolve)
        block_size, mask_mod, block_mask = with_block_mask(block_mask, block_size, mask_mod, B, N, T, S)
    grouped = row_grouped(query, key, value, call.score_mod, mask_mod)
    pair_key, pair_value = checks.check_pair_tables(call.rel_key, call.rel_value, T, S, N, H, Hv, acc_dtype)
    pair_width = sum(a.shape[2] * a.shape[3] for a in (pair_key, pair_value) if a is not None)
    Tb, Sb = tile_sizes(block_size, T, S, B, N, K, tiles.span(call.window, call.is_causal), grouped)
    if block_size is None and pair_width:
        Tb, Sb = tiles.pair_tile_sizes(T, S, Tb, Sb, pair_width)
    Tp, Sp = -(-T // Tb) * Tb, -(-S // Sb) * Sb
    q_pos, k_pos, lengths = positions_and_lengths(
        batch, T, S, Tp, Sp, call.query_positions, call.key_positions, call.key_value_seq_lengths
    )
    max_distance = call.max_distance
    key_table, value_table, _ = check_tables(call.key_table, call.value_table, max_distance, N, H, Hv, acc_dtype)
    if T == 0 or S == 0:  # nothing to tile: no query, or no key (every query then gets zeros, as dense)
        return nothing_to_tile(batch, T, N, Hv, value.dtype, call.sinks, acc_dtype, call.return_lse)
    bias_fn, consts = position_hook(call.position_bias, q_pos, k_pos, B, N, Tb, Sb, acc_dtype)
    terms, arrays = check_terms(call, mask_mod, block_mask, batch, T, S, N, K, Tp, Sp, acc_dtype)
    cfg = Config(
        Tb,
        Sb,
        N,
        call.rule,
        None if key_table is None and value_table is None else max_distance,
        call.query_positions is None and call.key_positions is None,
        call.precision,
        bias_fn,
        terms,
    )
    scale = H**-0.5 if call.scale is None else call.scale
    q, k, v = engine_operands(query, key, value, scale, acc_dtype, batch, Tp, Sp)
    whole = whole_rows(grouped, bias_fn is not None or pair_width > 0, q_pos, k_pos)
    groups = tiles.row_groups(B, K, N // K, Tb, Sb, whole)
    shared = Shared(key_table, value_table, consts, None, pair_key, pair_value)
    out, lse = grouped_engine(cfg, q, KeySide(k, v, k_pos, lengths), shared, q_pos, arrays, groups)
    return from_engine(out, lse, batch, T, query.dtype, call.return_lse)


def _refuse_grid_options(grid_options):
    """TypeError for keywords dot_product_attention does not take either; ValueError for those it takes that
    need the full [T,S] grid."""
    unknown = sorted(set(grid_options) - set(GRID_KEYWORDS))
    if unknown:
        raise TypeError(f"blockwise_attention() got unexpected keyword arguments {unknown}")
    in_use = AttentionCall(**grid_options).grid_options
    if in_use:
        checks.fail(
            "implementation",
            f'"dense" or None with {"/".join(in_use)}: blockwise attention does not '
            "take arbitrary masks or biases (nor return_weights or dropout), as they span the full [T,S] "
            "grid",
            '"blockwise"',
        )
