"""The entry's checks of its inputs and the layout changes around the engine: positions and key lengths,
Shaw tables, the position hook (closure-converted), the programmable terms and a BlockMask; operands into
the engine layout and the output back out of it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..._core import block_mask as block_masks, checks, mods
from ..._core.call import AttentionCall
from ..._core.masks import check_lengths
from ..._core.positions import positions
from ..._core.softmax import no_key, public_lse
from .. import tiles
from .values import Side, Terms


def flat_positions(pos, batch, length, padded):
    """[L] stays [L]; batched [...,L] -> [B,L]; then edge-padded to the padded length."""
    if pos.ndim > 1:
        pos = jnp.broadcast_to(pos, (*batch, length)).reshape(-1, length)
    return jnp.pad(pos, [(0, 0)] * (pos.ndim - 1) + [(0, padded - length)], mode="edge")


TABLE_LAYOUT = "[R,(N,)H] with R = 2*max_distance+1"


def check_tables(key_table, value_table, max_distance, N, H, Hv, acc_dtype):
    """Validate optional Shaw tables against max_distance: (key_table, value_table, R or None)."""
    if (key_table is not None or value_table is not None) and max_distance is None:
        checks.fail("max_distance", "a Python int >= 0 with key_table/value_table", None)
    R = None if max_distance is None else 2 * checks.check_max_distance(max_distance) + 1
    if key_table is not None:
        key_table = checks.check_clipped_table("key_table", key_table, R, N, H, acc_dtype, TABLE_LAYOUT)
    if value_table is not None:
        value_table = checks.check_clipped_table("value_table", value_table, R, N, Hv, acc_dtype, TABLE_LAYOUT)
    return key_table, value_table, R


def with_block_mask(block_mask, block_size, mask_mod, B, N, T, S):
    """A BlockMask's checks: (its tile as block_size, the mask_mod that applies, the resolved BlockMask)."""
    block_masks.check_block_mask(block_mask, B, N, T, S)
    block_size = tiles.check_block_mask_tiles(block_mask, block_size)
    mask_mod, block_mask = block_masks.resolve(mask_mod, block_mask)
    return block_size, mask_mod, block_mask


def position_hook(position_bias, q_pos, k_pos, B, N, Tb, Sb, acc_dtype):
    """convert_hook's (bias_fn, consts), or (None, ()) without a position_bias."""
    return (None, ()) if position_bias is None else convert_hook(position_bias, q_pos, k_pos, B, N, Tb, Sb, acc_dtype)


def engine_operands(query, key, value, scale, acc_dtype, batch, Tp, Sp):
    """q * scale [B,K,G,Tp,H], k [B,K,Sp,H], v [B,K,Sp,Hv] in the accumulation dtype. Half precision: widen
    q, k, v once here (O(T + S) memory) rather than in every tile product, where XLA's CPU dots convert both
    operands again for each tile pair (bf16 S=2048 causal forward: 176 -> 113 ms). Probabilities then meet
    the values in float32 too, one rounding fewer. Scaling [T,H] queries once beats scaling every [Tb,Sb]
    tile (forward and backward)."""
    (T, N, H), (S, K) = query.shape[-3:], key.shape[-3:-1]
    scale = jnp.asarray(scale, acc_dtype)
    if query.dtype != acc_dtype:
        query, key, value = query.astype(acc_dtype), key.astype(acc_dtype), value.astype(acc_dtype)
    q = _engine_layout(query * scale, batch, T, Tp).reshape(int(np.prod(batch, dtype=np.int64)), K, N // K, Tp, H)
    return q, _engine_layout(key, batch, S, Sp), _engine_layout(value, batch, S, Sp)


def from_engine(out, lse, batch, T, dtype, return_lse):
    """out [B,K,G,Tp,Hv] -> [...,T,N,Hv] in the inputs' dtype; lse [B,K,G,Tp] -> [...,N,T] if asked for."""
    B, K, G, Tp, Hv = out.shape
    out = jnp.moveaxis(out.reshape(B, K * G, Tp, Hv), 1, 2)[:, :T].reshape(*batch, T, K * G, Hv).astype(dtype)
    return (out, public_lse(lse.reshape(*batch, K * G, Tp)[..., :T])) if return_lse else out


def nothing_to_tile(batch, T, N, Hv, dtype, sinks, acc_dtype, return_lse):
    """T == 0 or S == 0: zeros [...,T,N,Hv] (and lse: _empty_lse)."""
    out = jnp.zeros((*batch, T, N, Hv), dtype)
    return (out, _empty_lse(batch, N, T, sinks, acc_dtype)) if return_lse else out


def _empty_lse(batch, N, T, sinks, acc_dtype):
    """lse [...,N,T] when there is no key: the sink alone, or -inf."""
    if sinks is None:
        return public_lse(jnp.full((*batch, N, T), no_key(acc_dtype), acc_dtype))
    return jnp.broadcast_to(jnp.asarray(sinks, acc_dtype)[..., None], (*batch, N, T))


def check_terms(call: AttentionCall, mask_mod, block_mask, batch, T, S, N, K, Tp, Sp, acc_dtype):
    """Check the programmable options against the shapes: (Terms, Side) in the engine layout
    (mask_mod, block_mask: the call's, resolved by with_block_mask)."""
    B = int(np.prod(batch, dtype=np.int64))
    q_seg, k_seg = mods.check_segment_ids(call.query_segment_ids, call.key_segment_ids, batch, T, S)
    if q_seg is not None:  # [B|1, L padded]: padding repeats the last id (padded keys are masked by length)
        q_seg, k_seg = (flat_positions(x, batch, L, Lp) for x, L, Lp in ((q_seg, T, Tp), (k_seg, S, Sp)))
        q_seg, k_seg = (x if x.ndim == 2 else x[None] for x in (q_seg, k_seg))
    sinks = mods.check_sinks(call.sinks, batch, N, acc_dtype)
    if sinks is not None:
        sinks = jnp.broadcast_to(sinks, (*batch, N)).reshape(B, K, N // K)
    score_fn = mods.element_function("score_mod", call.score_mod, acc_dtype)
    mask_fn = mods.element_function("mask_mod", mask_mod)
    kinds = None
    if block_mask is not None:  # one kind per tile for every batch row and head (they share the tile)
        each = block_masks.tile_kinds(block_mask)
        kinds = jnp.where(
            jnp.all(each == block_masks.FULL, axis=(0, 1)),
            block_masks.FULL,
            jnp.where(jnp.any(each != block_masks.EMPTY, axis=(0, 1)), block_masks.PARTIAL, block_masks.EMPTY),
        ).astype(jnp.int8)
    terms = Terms(
        softcap=call.logit_softcap,
        score_fn=None if score_fn is None else score_fn.fn,
        mask_fn=None if mask_fn is None else mask_fn.fn,
        segments=q_seg is not None,
        block_kinds=kinds is not None,
    )
    arrays = Side(
        q_seg=q_seg,
        k_seg=k_seg,
        sinks=sinks,
        score_consts=() if score_fn is None else score_fn.consts,
        mask_consts=() if mask_fn is None else mask_fn.consts,
        kinds=kinds,
    )
    return terms, arrays


def positions_and_lengths(batch, T, S, Tp, Sp, query_positions, key_positions, key_value_seq_lengths):
    """Engine positions ([L] or [B,L], padded to Tp / Sp) and key lengths [B|1] (or None: all valid)."""
    q_pos, k_pos = positions(T, S, query_positions, key_positions)
    checks.check_broadcastable("query_positions", q_pos, (*batch, T), "[...,T]")
    checks.check_broadcastable("key_positions", k_pos, (*batch, S), "[...,S]")
    q_pos, k_pos = flat_positions(q_pos, batch, T, Tp), flat_positions(k_pos, batch, S, Sp)
    lengths = check_lengths(key_value_seq_lengths, batch)
    if lengths is not None:
        lengths = jnp.minimum(jnp.broadcast_to(lengths, batch).reshape(-1), S).astype(jnp.int32)
    elif Sp != S:
        lengths = jnp.full((1,), S, jnp.int32)  # the padding keys past S
    return q_pos, k_pos, lengths


def _engine_layout(x, batch, length, padded):
    """[...,L,K,F] -> [B,K,L_padded,F] (batch dims broadcast and flattened, L zero-padded)."""
    B = int(np.prod(batch, dtype=np.int64))
    x = jnp.broadcast_to(x, (*batch, *x.shape[-3:])).reshape(B, *x.shape[-3:])
    x = jnp.pad(x, [(0, 0), (0, padded - length), (0, 0), (0, 0)])
    return jnp.moveaxis(x, 1, -2)


def convert_hook(position_bias, q_pos, k_pos, B, N, Tb, Sb, acc_dtype):
    """Closure-convert the hook (its arrays become differentiable engine inputs); check its shape."""
    qp, kp = q_pos[..., :Tb], k_pos[..., :Sb]
    lead = (B,) if max(q_pos.ndim, k_pos.ndim) > 1 else ()
    target = (*lead, N, Tb, Sb)
    shape = jax.eval_shape(position_bias, qp, kp).shape
    try:
        fits = len(shape) <= len(target) and np.broadcast_shapes(shape, target) == target
    except ValueError:
        fits = False
    if not fits:
        checks.fail(
            "position_bias(query_pos, key_pos)",
            f"a shape broadcastable to {checks.shape_str(target)} ([(B,)N,Tb,Sb] for one tile)",
            f"shape {checks.shape_str(shape)}",
        )

    def tile_bias(qp, kp):
        return jnp.broadcast_to(jnp.asarray(position_bias(qp, kp)).astype(acc_dtype), target)

    bias_fn, consts = jax.closure_convert(tile_bias, qp, kp)
    return bias_fn, tuple(consts)
