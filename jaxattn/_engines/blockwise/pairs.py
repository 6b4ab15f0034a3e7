"""Per-pair tables [T,S,N|1,F] (relative_attention's A^K / A^V): the [Tb,Sb,...] slice a tile reads, the
einsum spec for a per-head or a shared table, and a tile's gradient added back at its place.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..._core.dtypes import accumulation_dtype
from .layout import einsum


def _pair_rows(table, t0, s0, Tb, Sb):
    """The rows and columns of tile (t0, s0) in a per-pair table [T,S,...], clipped to T - 1 / S - 1: the
    padding past T or S reads the last real row or column (its queries are dropped, its keys masked, so
    its entries never count and their gradients are zero)."""
    T, S = table.shape[:2]
    return jnp.minimum(t0 + jnp.arange(Tb), T - 1)[:, None], jnp.minimum(s0 + jnp.arange(Sb), S - 1)[None, :]


def _tile_start(t0, s0):
    """A per-pair tile's corner as dynamic_slice's start (one integer type: t0 comes from a scan, s0 from a
    loop, whose integer widths may differ under x64)."""
    return tuple(jnp.asarray(i, jnp.int32) for i in (t0, s0, 0, 0))


def _divides(table, Tb, Sb):
    """Every tile of the per-pair table lies inside it (no padding): a plain slice reads it."""
    return table.shape[0] % Tb == 0 and table.shape[1] % Sb == 0


def pair_tile(table, t0, s0, Tb, Sb, K):
    """Tile (t0, s0) of a per-pair table [T,S,N|1,F] in the compute dtype: [Tb,Sb,K,G,F] per head (query
    head n = k*G + g, the engine layout), [Tb,Sb,F] shared over heads; None stays None."""
    if table is None:
        return None
    if _divides(table, Tb, Sb):
        tile = lax.dynamic_slice(table, _tile_start(t0, s0), (Tb, Sb, *table.shape[2:]))
    else:
        tile = table.at[_pair_rows(table, t0, s0, Tb, Sb)].get(mode="promise_in_bounds")
    heads, F = table.shape[2:]
    tile = tile[:, :, 0] if heads == 1 else tile.reshape(Tb, Sb, K, heads // K, F)
    return tile.astype(accumulation_dtype(table.dtype))


def pair_spec(spec, tile):
    """An einsum spec written for a per-head tile (tskgf) as it reads for `tile` (tsf when shared)."""
    return spec if tile.ndim == 5 else spec.replace("tskg", "ts")


def pair_grad(x, y, tile, cfg, acc_dtype):
    """The gradient of a per-pair tile (pair_tile's layout) from per-pair cotangents x [B,K,G,Tb,Sb] and
    per-row vectors y [B,K,G,Tb,F]: sum over the batch (and the heads, for a shared table) of x y."""
    return einsum(pair_spec("bkgts,bkgtf->tskgf", tile), x, y, cfg, acc_dtype)


def add_pair_tile(acc, grad, t0, s0):
    """acc [T,S,N|1,F] + grad (pair_tile's layout, tile (t0, s0)) at that tile; the padding's entries of
    grad (clipped onto the last row / column by _pair_rows) are zeros, so adding them changes nothing."""
    Tb, Sb = grad.shape[:2]
    grad = grad.reshape(Tb, Sb, *acc.shape[2:])
    if _divides(acc, Tb, Sb):
        start = _tile_start(t0, s0)
        return lax.dynamic_update_slice(acc, lax.dynamic_slice(acc, start, grad.shape) + grad, start)
    return acc.at[_pair_rows(acc, t0, s0, Tb, Sb)].add(grad, mode="promise_in_bounds")
