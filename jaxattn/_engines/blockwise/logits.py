"""One [Tb,Sb] tile's logits and mask, shared by the forward and the backward:

    x = softcap(scale * (q k^T + q . Tk[index] + q . A^K)) + position_bias(q_pos, k_pos), then score_mod

and which of its pairs may attend (the position rule, lengths, segment ids, mask_mod on partial tiles).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..._core import mods
from ..._core.masks import WITH_MOD, allowed_pairs
from .buckets import gather_buckets
from .layout import as_tile, einsum, heads_view, slice_block
from .pairs import pair_spec


def _element_grid(cfg, fn, consts, qp, kp, B, K, score=None):
    """score_mod / mask_mod over one tile, [B,K,G,Tb,Sb] (score in that layout, or None for mask_mod)."""
    if score is not None:
        score = score.reshape(B, cfg.N, *score.shape[-2:])
    b, n = jnp.arange(B, dtype=jnp.int32), jnp.arange(cfg.N, dtype=jnp.int32)
    return heads_view(mods.on_grid(fn, consts, b, n, qp, kp, score=score), K)


def allowed_in_tile(cfg, qp, kp, j, lengths, arrays, kind, B, K):
    """bool tile broadcastable to [B,K,G,Tb,Sb], or None when every key is allowed (key block j).
    arrays: this query tile's Side; mask_mod is evaluated on WITH_MOD tiles only."""
    k_seg = None if arrays.k_seg is None else slice_block(arrays.k_seg, j * cfg.Sb, cfg.Sb, -1)
    allowed = allowed_pairs(
        cfg.rule, qp, kp, j * cfg.Sb + jnp.arange(cfg.Sb), lengths, None if k_seg is None else arrays.q_seg, k_seg
    )
    allowed = None if allowed is None else as_tile(allowed)
    if cfg.terms.mask_fn is not None and kind == WITH_MOD:
        by_mod = _element_grid(cfg, cfg.terms.mask_fn, arrays.mask_consts, qp, kp, B, K)
        allowed = by_mod if allowed is None else allowed & by_mod
    return allowed


def hook_bias(cfg, consts, qp, kp, K):
    return heads_view(cfg.bias_fn(qp, kp, *consts), K)


def capped_logits(cfg, q_blk, k_blk, per_bucket, index, scale, acc_dtype, pair_k=None):
    """softcap(scale * (q . k + q . table[index] + q . A^K)): the query-key part of a tile's logits."""
    x = einsum("bkgth,bksh->bkgts", q_blk, k_blk, cfg, acc_dtype)
    if per_bucket is not None:
        x = x + gather_buckets(per_bucket, index)
    if pair_k is not None:
        x = x + einsum(pair_spec("bkgth,tskgh->bkgts", pair_k), q_blk, pair_k, cfg, acc_dtype)
    if scale is not None:  # None: the query was scaled before the engine
        x = x * scale
    return mods.softcap(x, cfg.terms.softcap)


def tile_logits(cfg, q_blk, k_blk, per_bucket, bias, index, scale, acc_dtype, score=None, pair_k=None):
    """A tile's logits: the capped query-key logits plus the position bias, then score (score_mod)."""
    x = capped_logits(cfg, q_blk, k_blk, per_bucket, index, scale, acc_dtype, pair_k)
    x = x if bias is None else x + bias
    return x if score is None else score(x)


def tile_score(cfg, qp, kp, B, K, arrays):
    """x -> score_mod(x) on one tile (consts overridable, for the backward's vjp), or None."""
    if cfg.terms.score_fn is None:
        return None
    return lambda x, consts=arrays.score_consts: _element_grid(cfg, cfg.terms.score_fn, consts, qp, kp, B, K, x)


def corner_offset(cfg, qp, kp):
    """key_pos - query_pos at the tile's corner (t = s = 0) when positions are contiguous, else None."""
    return kp[0] - qp[0] if cfg.contiguous else None
