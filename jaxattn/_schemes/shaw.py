"""Shaw et al. (2018) relative positions: per-pair tables (relative_attention) and clipped tables.

Index convention (j - i, bottom-right aligned, clipped):
    index[t,s] = clip(key_pos[s] - query_pos[t], -max_distance, max_distance) + max_distance
so row 0 is "max_distance or more keys to the left", row R-1 "max_distance or more to the right".

Shaw attention equals relative_attention with A = table[index], but never gathers that [T,S,H] tensor
(see clipped.py for the dense path; the blockwise engine computes the table terms one tile at a time).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp

from .._api import attend, scheme_call, use_blockwise
from .._core import checks
from .._core.dtypes import accumulation_dtype
from .._core.eager import compiled_when_eager
from .._engines import blockwise
from .._engines.dense import attention_core
from .._engines.pairwise import pair_logits, pair_values
from .clipped import clipped_relative_index, head_index, table_terms

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Float, Int

    from .._core.shapes import AttentionOutput

TABLE_LAYOUT = "[R,H] or [R,N,H], R = 2*max_distance+1"


def relative_position_index(
    query_length: int,
    key_length: int,
    max_distance: int,
    *,
    query_positions: Int[ArrayLike, "*#B T"] | None = None,
    key_positions: Int[ArrayLike, "*#B S"] | None = None,
) -> Int[Array, "*#B T S"]:
    """int32 [T,S] (or [...,T,S] for batched positions): clip(j - i, -k, k) + k, bottom-right aligned."""
    max_distance = checks.check_max_distance(max_distance)
    return clipped_relative_index(
        query_length,
        key_length,
        max_left=max_distance,
        max_right=max_distance,
        query_positions=query_positions,
        key_positions=key_positions,
    )


@compiled_when_eager
def shaw_relative_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    key_table: Float[ArrayLike, "R H"] | Float[ArrayLike, "R N H"] | None = None,
    value_table: Float[ArrayLike, "R Hv"] | Float[ArrayLike, "R N Hv"] | None = None,
    *,
    max_distance,
    **options,
) -> AttentionOutput:
    """Attention with Shaw et al. clipped relative-position tables.

    key_table: [R,H] shared over heads or [R,N,H] per head; value_table: [R,Hv] or [R,N,Hv];
    R = 2 * max_distance + 1, rows indexed by relative_position_index (same absolute positions as the
    causal mask, so `query_positions` / `key_positions` move both). Keywords as dot_product_attention.
    Equal to relative_attention(query, key, value, key_table[index], value_table[index]) with extra
    memory O(... * N * T * (S + R)) rather than a [T,S,H] gather.
    implementation / interpret / block_size: as dot_product_attention; blockwise computes the table terms per
    tile; a kernel takes the call only where it expresses the tables (else None keeps the XLA engines).
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    max_distance = checks.check_max_distance(max_distance)
    implementation, interpret = options.pop("implementation", None), options.pop("interpret", False)
    tables = dict(key_table=key_table, value_table=value_table)
    if key_table is not None or value_table is not None:
        tables["max_distance"] = max_distance
    call = scheme_call("shaw_relative_attention", options, **tables)
    engine = implementation if implementation in ("dense", "blockwise") else None

    def xla():
        if use_blockwise(engine, call, query, key):
            return blockwise.tiled(call.replace(max_distance=max_distance), query, key, value)
        dims = checks.check_qkv(query, key, value)
        index = head_index(dims.T, dims.S, max_distance, max_distance, call)
        rel_logits, rel_values = table_terms(
            query, dims, key_table, value_table, index, 2 * max_distance + 1, call.precision, TABLE_LAYOUT
        )
        dense_call = call.replace(key_table=None, value_table=None, max_distance=None)
        return attention_core(
            dense_call, query, key, value, relative_logits=rel_logits, relative_values=rel_values, dims=dims
        )

    return attend(call, query, key, value, xla=xla, implementation=implementation, interpret=interpret)


@compiled_when_eager
def relative_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    rel_key: Float[ArrayLike, "T S #N H"] | None = None,
    rel_value: Float[ArrayLike, "T S #N Hv"] | None = None,
    **options,
) -> AttentionOutput:
    """Attention with per-pair relative terms (Shaw et al.; the seed-000 formula).

        logits[n,t,s] = scale * q[t,n] . (k[s] + A^K[t,s,n]);   out[t,n] = sum_s p[n,t,s] (v[s] + A^V[t,s,n])

    rel_key A^K: [T,S,N,H] ([T,S,1,H] shares it over heads); rel_value A^V: [T,S,N,Hv] (or [T,S,1,Hv]).
    Keywords as dot_product_attention. The relative einsums batch over (t, n) and contract h (or s),
    so no tensor ever holds both the batch dims and [T,S,...,H] (the seed answer's [B,S,S,H,D]).
    Per-head tables use the fused pairwise contractions (no [T,N,S,H] copy of the table, see pairwise.py).
    implementation / interpret / block_size: as dot_product_attention; "blockwise" reads each tile's
    [Tb,Sb,(N),H] slice of the tables (no [...,N,T,S] logits), and None takes it on CPU by
    dot_product_attention's rule; "pallas_gpu" (and None on CUDA) reads those slices inside the Pallas GPU
    kernels, forward and backward (docs/kernels.md, "Per-pair tables in the kernel"); the TPU kernels refuse
    rel_key / rel_value by name.
    """
    implementation, interpret = options.pop("implementation", None), options.pop("interpret", False)
    call = scheme_call("relative_attention", options, rel_key=rel_key, rel_value=rel_value)
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    engine = implementation if implementation in ("dense", "blockwise") else None

    def xla():
        if use_blockwise(engine, call, query, key):
            return blockwise.tiled(call, query, key, value)
        dense_call = call.replace(rel_key=None, rel_value=None, block_size=None)
        return _dense_pairs(dense_call, query, key, value, rel_key, rel_value)

    return attend(call, query, key, value, xla=xla, implementation=implementation, interpret=interpret)


def _dense_pairs(call, query, key, value, rel_key, rel_value):
    """relative_attention on the dense engine: the per-pair terms as its relative_logits / relative_values."""
    dims = checks.check_qkv(query, key, value)
    precision = call.precision
    acc_dtype = accumulation_dtype(query.dtype)
    rel_logits = rel_values = None
    a_k, a_v = checks.check_pair_tables(rel_key, rel_value, dims.T, dims.S, dims.N, dims.H, dims.Hv, acc_dtype)
    if a_k is not None:
        if a_k.shape[2] == dims.N:
            rel_logits = lambda q: jnp.moveaxis(pair_logits(q, a_k, precision), -1, -3)  # noqa: E731
        else:
            rel_logits = lambda q: jnp.einsum(
                "...tnh,tsh->...nts",
                q,
                a_k[:, :, 0],  # noqa: E731
                precision=precision,
                preferred_element_type=acc_dtype,
            )
    if a_v is not None:
        if a_v.shape[2] == dims.N:
            rel_values = lambda p: pair_values(jnp.moveaxis(p, -3, -1), a_v, precision)  # noqa: E731
        else:
            rel_values = lambda p: jnp.einsum(
                "...nts,tsh->...tnh",
                p,
                a_v[:, :, 0].astype(acc_dtype),  # noqa: E731
                precision=precision,
            )
    return attention_core(call, query, key, value, relative_logits=rel_logits, relative_values=rel_values, dims=dims)
