"""The engine layout's small operations: tile products, views between N heads and [K,G], per-row
arrays broadcast to a tile, dynamic slices.

Layout: batch dims flattened to B, heads viewed as [K,G] (query head n = k*G + g), q [B,K,G,T,H],
k [B,K,S,H], v [B,K,S,Hv]: every tile product is one batched matmul whose rows are the G query heads that
share a key/value head.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..._core.placement import einsum_sharding


def einsum(spec, a, b, cfg, acc_dtype):
    """A tile product in cfg's precision, accumulated in acc_dtype (on an Explicit mesh: sharded as its operands)."""
    out_sharding = einsum_sharding(spec, a, b)  # None off an Explicit mesh
    return jnp.einsum(spec, a, b, precision=cfg.precision, preferred_element_type=acc_dtype, out_sharding=out_sharding)


def heads_view(x, K):
    """[...,N,Tb,Sb] -> [...,K,G,Tb,Sb]."""
    return x.reshape(*x.shape[:-3], K, x.shape[-3] // K, *x.shape[-2:])


def as_tile(x):
    """A per-(batch?, t, s) array [Tb,Sb] / [B,Tb,Sb] -> broadcastable to tiles [B,K,G,Tb,Sb]."""
    return x if x.ndim == 2 else x[:, None, None]


def slice_block(x, start, size, axis):
    """x[start:start+size] along axis (start traced)."""
    return lax.dynamic_slice_in_dim(x, start, size, axis=axis)
