"""Shaw's clipped relative tables in the Pallas GPU kernel (flash_gpu): the parts outside the kernel.

    logits[t,s] = scale * q_t . (k_s + A^K[c])        out_t = sum_s p[t,s] (v_s + A^V[c])
    c = clip(j - i, -m, m) + m   (j - i = key_pos[s] - query_pos[t], m = max_distance)

The kernel never gathers a [Tb,Sb,H] tile of the tables. Only the offsets j - i in a band [lo, hi] reach
the tables' rows (band: all of [-m, m] for given positions, else the core's default positions' range
clipped to it), D = hi - lo + 1 rows, padded to Dp columns (padded_columns):

  key term    QA = q . A^K[band]^T, [B,N,Tp,Dp] per query row (row_bias, here, one matmul); each tile adds
              QA[t, clip(j - i, lo, hi) - lo] to q k^T (tile_math.pick_rows: a gather from the block of its
              query rows). Its gradient, d QA (the logits' gradient summed by column: the dq kernel's
              tile_math.add_by_column), goes back to q and A^K through XLA's autodiff of row_bias.
  value term  the forward kernel sums each row's probabilities by column, P [B,N,Tp,Dp] (rescaled with the
              online softmax as the output is, divided by l at the end), and value_term adds P @ A^V[band]
              here. P's cotangent dP = dz A^V^T comes back into the kernels' backward: d p[t,s] += dP[t, c],
              and delta (= sum_s p dp) gains sum_c P dP.

Memory: four [B,N,Tp,Dp] float32 arrays (QA, P and their gradients), O(T * min(2m+1, T+S-1)), against
the blockwise engine's per-tile buckets. The kernel takes tables up to MAX_COLUMNS columns (Dp) this way;
a wider band (m above about 500 with long sequences: Transformer-XL's whole span) of a key table alone with
the default positions takes the windowed route (windows_gpu: each tile's window of rows, any span), and the
rest stays with the XLA engines.

DeBERTa's tables (row_tables.RowTables) take the same arrays with the tables' R rows as columns (Dp =
padded_columns(R)), a pair's column read from the scheme's int32 map of the band's offsets (column_map), and
one more term per KEY row: KB = k . Qr^T, [B,N,Sp,Dp] (key_row_bias, here), picked per tile at [s, column],
its gradient summed by column per key row in the dk/dv kernel (which owns the key tile).

Why atomics (not per-block partial tables): every array above is per query row, so each program of the
forward and dq kernels owns its [Tb,Dp] block alone; the adds that meet are the keys of one row falling
in one column, which Triton's scatter-add lowers to atomic adds within the block (no other program
touches it). A tile wholly past the clip distance (every pair in one column) adds row sums instead.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax.numpy as jnp

from .._core.dtypes import accumulation_dtype
from .._core.row_tables import per_key_logits, per_row_logits
from .flash.tile_math import ROW_CHUNK

# The widest band of table rows (Dp) the kernel takes: QA, P and their gradients are [B,N,Tp,Dp] float32,
# and the forward rescales a [Tb,Dp] block in 64-column steps whenever a row's running max moves.
MAX_COLUMNS = 1024


class Band(NamedTuple):
    """The table rows a call reaches: offsets lo..hi (table rows lo + m .. hi + m), D of them, Dp padded."""

    lo: int
    hi: int
    max_distance: int

    @property
    def D(self) -> int:
        return self.hi - self.lo + 1

    @property
    def Dp(self) -> int:
        return padded_columns(self.D)


def padded_columns(D: int) -> int:
    """The columns of the per-row arrays for D rows: a power of two >= 16 up to ROW_CHUNK (a Triton tensor, the
    forward's rescale reads the block whole), else a multiple of ROW_CHUNK (it reads ROW_CHUNK columns at a
    time; a power of two would nearly double 2m + 1 = 129 rows)."""
    if D <= ROW_CHUNK:
        return max(16, 1 << (D - 1).bit_length())
    return -(-D // ROW_CHUNK) * ROW_CHUNK


def band(max_distance: int, T: int, S: int, default_positions: bool) -> Band:
    """The offsets whose table rows a call reads: [-m, m], narrowed by the default positions' range of j - i,
    [-(S - 1), T - 1] (query t at t + S - T, key s at s). Clipping j - i to the band is then exact."""
    m = int(max_distance)
    if default_positions:
        return Band(max(-m, -(S - 1)), min(m, T - 1), m)
    return Band(-m, m, m)


def columns_refusal(b: Band) -> Optional[str]:
    """None when the band fits the kernel (MAX_COLUMNS); else what refuses it, naming max_distance."""
    if b.Dp > MAX_COLUMNS:
        return f"max_distance ({b.D} table rows within reach > {MAX_COLUMNS}: the XLA engines)"
    return None


def band_rows(table, b: Band):
    """table [R,(N,)F] -> its rows of the band, [D,(N,)F]."""
    return table[b.lo + b.max_distance : b.hi + b.max_distance + 1]


def row_bias(query, key_rows, batch: tuple, Tp: int, D: int, Dp: int, precision):
    """QA [B,N,Tp,Dp] in the compute dtype: q_t . key_rows[c] for every query row t and table row c
    (zero padding past T and D). query [...,T,N,H], key_rows [D,(N,)H] (a band's rows, or DeBERTa's whole
    position-key table)."""
    acc_dtype = accumulation_dtype(query.dtype)
    qa = per_row_logits(query, key_rows.astype(acc_dtype), precision, acc_dtype)
    T, N = query.shape[-3], query.shape[-2]
    qa = jnp.broadcast_to(qa, (*batch, N, T, D)).reshape(-1, N, T, D)
    return jnp.pad(qa, [(0, 0), (0, 0), (0, Tp - T), (0, Dp - D)])


def key_row_bias(key, query_rows, N: int, batch: tuple, Sp: int, Dp: int, precision):
    """KB [B,N,Sp,Dp] in the compute dtype: k_s . query_rows[c] for every key row s, query head n (reading
    key head n // (N // K)) and table row c (zero padding past S and the rows). key [...,S,K,H], query_rows
    [R,(N,)H] (DeBERTa's position-query table, row_tables.RowTables)."""
    acc_dtype = accumulation_dtype(key.dtype)
    S, R = key.shape[-3], query_rows.shape[0]
    kb = per_key_logits(key, query_rows.astype(acc_dtype), N, precision, acc_dtype)
    kb = jnp.broadcast_to(kb, (*batch, N, S, R)).reshape(-1, N, S, R)
    return jnp.pad(kb, [(0, 0), (0, 0), (0, Sp - S), (0, Dp - R)])


def column_map(row_of_offset):
    """A RowTables' int32 rows of the offsets lo..hi, padded to a power of two (edge values; the kernel's
    clip never reads past hi - lo): the kernels' r["column_map"]."""
    rows = jnp.asarray(row_of_offset, jnp.int32)
    M = rows.shape[0]
    return jnp.pad(rows, (0, (1 << (M - 1).bit_length()) - M), mode="edge")


def value_term(row_sums, value_rows, T: int, b: Band, precision):
    """P @ A^V: row_sums [B,N,Tp,Dp] (the kernel's sums of p by column, divided by l) and value_rows
    [D,(N,)Hv] -> [B,T,N,Hv] in the compute dtype."""
    sums = row_sums[:, :, :T, : b.D]
    spec = "bntd,dnf->btnf" if value_rows.ndim == 3 else "bntd,df->btnf"
    return jnp.einsum(spec, sums, value_rows.astype(sums.dtype), precision=precision)
