"""RowTables: per-row table terms read at a row of the pair's offset (DeBERTa's disentangled attention).

    logits[n,t,s] += q_t . key_rows[row] + k_s . query_rows[row],   row = row_of_offset[clip(j - i, lo, hi) - lo]

with j - i = key_pos[s] - query_pos[t]. key_rows / query_rows are [R,(N,)H] (either may be None); row_of_offset
is int32 [hi - lo + 1], every entry in [0, R). The scheme that builds one (jaxattn._schemes.disentangled) keeps
its own formula for the rows (DeBERTa's log buckets, clipped to the table) and promises that clipping j - i
to [lo, hi] is exact for every position the call produces: beyond the band the row is constant (the
buckets' saturation) or no pair reaches (the default positions' range). A kernel then reads the rows by an
integer gather (no bucket formula inside it), computes q . key_rows^T per query row and k . query_rows^T per
key row outside its tiles, and picks both at each pair's row (the Pallas GPU kernel: flash_gpu, tables_gpu).

The XLA engines never receive a call with one: the scheme computes the same terms there from the same two
products, per_row_logits and per_key_logits (below: their one home, for the schemes and the kernels alike).
A kernel whose gradient is an XLA engine's (flex_tpu) hands that engine both terms as a score_mod
(as_score_mod).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: holds arrays; hashed by identity like a closure
class RowTables:
    """The two per-row table terms of a call (module docstring)."""

    key_rows: Any  # [R,(N,)H] or None: q_t . key_rows[row] (DeBERTa's Kr, content -> position)
    query_rows: Any  # [R,(N,)H] or None: k_s . query_rows[row] (DeBERTa's Qr, position -> content)
    row_of_offset: Any  # int32 [hi - lo + 1]: the row of each offset lo..hi
    lo: int
    hi: int
    rows: int  # R, the tables' rows

    @property
    def has_key_rows(self) -> bool:
        return self.key_rows is not None

    @property
    def has_query_rows(self) -> bool:
        return self.query_rows is not None


def per_row_logits(q, table, precision, acc_dtype):
    """q [...,T,N,H] . table [R,(N,)H] -> [...,N,T,R]: every query row against every table row (Shaw's and
    Transformer-XL's key term, DeBERTa's c2p)."""
    spec = "...tnh,rnh->...ntr" if table.ndim == 3 else "...tnh,rh->...ntr"
    return jnp.einsum(spec, q, table, precision=precision, preferred_element_type=acc_dtype)


def per_key_logits(key, table, N, precision, acc_dtype):
    """k [...,S,K,H] . table [R,(N,)H] -> [...,N,S,R]: every key row against every table row, query head n
    reading key head n // (N // K) (DeBERTa's p2c)."""
    *_, S, K, H = key.shape
    G = N // K
    if table.ndim == 2:
        per_head = jnp.einsum("...skh,rh->...ksr", key, table, precision=precision, preferred_element_type=acc_dtype)
        per_head = jnp.broadcast_to(per_head[..., :, None, :, :], (*per_head.shape[:-3], K, G, S, table.shape[0]))
    else:
        grouped = table.reshape(table.shape[0], K, G, H)
        per_head = jnp.einsum(
            "...skh,rkgh->...kgsr", key, grouped, precision=precision, preferred_element_type=acc_dtype
        )
    return per_head.reshape(*per_head.shape[:-4], N, S, table.shape[0])


def as_score_mod(tables: RowTables, query, key, scale, precision, acc_dtype, user_mod=None):
    """score_mod(score, b, n, t, s) adding scale * (q_t . key_rows[row] + k_s . query_rows[row]) at the
    default positions (query row t at position t + S - T, key row s at s; b: the flattened batch entry),
    then user_mod: both terms for an XLA engine (blockwise.tiled) from per-row scores [B,N,T,R] / [B,N,S,R],
    never [T,S]. Rows past T / S (padded tiles) read clipped rows, their pairs discarded by the engine."""
    *batch, T, N, _ = query.shape
    S = key.shape[-3]
    B = int(np.prod(batch, dtype=np.int64))

    def flat(scores):  # [...,N,L,R] -> [B,N,L,R]
        return jnp.broadcast_to(scores, (*batch, *scores.shape[-3:])).reshape(B, *scores.shape[-3:])

    per_query = per_key = None
    if tables.key_rows is not None:
        per_query = flat(per_row_logits(query, tables.key_rows, precision, acc_dtype) * scale)
    if tables.query_rows is not None:
        per_key = flat(per_key_logits(key, tables.query_rows, N, precision, acc_dtype) * scale)
    row_of_offset = jnp.asarray(tables.row_of_offset, jnp.int32)

    def score_mod(score, b, n, t, s):
        row = row_of_offset[jnp.clip(s - t, tables.lo, tables.hi) - tables.lo]
        if per_query is not None:
            score = score + per_query[b, n, jnp.clip(t - (S - T), 0, T - 1), row]
        if per_key is not None:
            score = score + per_key[b, n, jnp.clip(s, 0, S - 1), row]
        return score if user_mod is None else user_mod(score, b, n, t, s)

    return score_mod
