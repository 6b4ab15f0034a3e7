"""Clipped relative tables on the dense engine: Shaw's (symmetric), asymmetric ones, Transformer-XL's.

A table of R = max_left + max_right + 1 rows holds one vector per clipped relative position; row
index[t,s] = clip(j - i, -max_left, max_right) + max_left (_core.positions.clipped_index). The terms are
never gathered into a [T,S,H] tensor: the key term is q . table computed once per row ([...,N,T,R]) and
then gathered to [...,N,T,S]; the value term sums the weights falling into each row ([...,N,T,R]) and
then multiplies the table.

The blockwise engine (and any kernel) takes Shaw's symmetric tables only: an asymmetric table runs there as
`symmetric_table` of it, the same attention (see its docstring), with no change to the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from .._api import attend, scheme_call, use_blockwise
from .._core import checks
from .._core.checks import static_int
from .._core.dtypes import accumulation_dtype
from .._core.eager import compiled_when_eager
from .._core.positions import clipped_index, positions
from .._core.row_tables import per_row_logits
from .._engines import blockwise
from .._engines.dense import attention_core

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Float, Int

    from .._core.shapes import AttentionOutput


def clipped_relative_index(
    query_length: int,
    key_length: int,
    *,
    max_left: int,
    max_right: int,
    query_positions: Int[ArrayLike, "*#B T"] | None = None,
    key_positions: Int[ArrayLike, "*#B S"] | None = None,
) -> Int[Array, "*#B T S"]:
    """int32 [T,S] (or [...,T,S]): clip(j - i, -max_left, max_right) + max_left, core positions."""
    max_left = static_int("max_left", max_left, 0)
    max_right = static_int("max_right", max_right, 0)
    q_pos, k_pos = positions(query_length, key_length, query_positions, key_positions)
    return clipped_index(q_pos, k_pos, max_left, max_right)


def head_index(T, S, max_left, max_right, call):
    """The clipped index at the call's positions (its query/key_positions) as [...,1,T,S]."""
    q_pos, k_pos = positions(T, S, call.query_positions, call.key_positions)
    return clipped_index(q_pos, k_pos, max_left, max_right)[..., None, :, :]


def gather_buckets(per_bucket, index):
    """per_bucket [...,N,T,R], index [...,1,T,S] -> [...,N,T,S]: per_bucket[..., t, index[t,s]]."""
    if index.ndim == 3:  # positions shared over the batch: gather [T,S] rows of a [T,R,...,N] view
        T = per_bucket.shape[-2]
        rows = jnp.moveaxis(per_bucket, (-2, -1), (0, 1))
        picked = rows[jnp.arange(T)[:, None], index[0]]
        return jnp.moveaxis(picked, (0, 1), (-2, -1))
    shape = jnp.broadcast_shapes(per_bucket.shape[:-1] + (1,), index.shape)
    per_bucket = jnp.broadcast_to(per_bucket, shape[:-1] + per_bucket.shape[-1:])
    return jnp.take_along_axis(per_bucket, jnp.broadcast_to(index, shape), axis=-1)


def sum_into_buckets(weights, index, R):
    """weights [...,N,T,S], index [...,1,T,S] -> [...,N,T,R]: sum of weights[t,s] over s with index r."""
    *lead, T, S = weights.shape
    if index.ndim == 3:  # positions shared over the batch: one [T,S] scatter into a [T,R,...,N] view
        # (transposes, not reshapes: batch and head axes stay separate, so their shardings survive)
        cols = jnp.moveaxis(weights, (-2, -1), (0, 1))
        sums = jnp.zeros((T, R, *cols.shape[2:]), weights.dtype).at[jnp.arange(T)[:, None], index[0]].add(cols)
        return jnp.moveaxis(sums, (0, 1), (-2, -1))
    index = jnp.broadcast_to(index, weights.shape)
    rows = weights.reshape(-1, S)
    row_ids = jnp.arange(rows.shape[0])[:, None]
    sums = jnp.zeros((rows.shape[0], R), weights.dtype).at[row_ids, index.reshape(rows.shape)].add(rows)
    return sums.reshape(*lead, T, R)


def table_terms(query, dims, key_table, value_table, index, R, precision, layout):
    """(relative_logits, relative_values) callbacks of the dense engine for clipped tables (either None).

    layout names the tables' shape in error messages ("H" reads "Hv" for value_table).
    """
    acc_dtype = accumulation_dtype(query.dtype)
    rel_logits = rel_values = None
    if key_table is not None:
        t_k = checks.check_clipped_table("key_table", key_table, R, dims.N, dims.H, acc_dtype, layout)

        def rel_logits(q):
            return gather_buckets(per_row_logits(q, t_k, precision, acc_dtype), index)

    if value_table is not None:
        t_v = checks.check_clipped_table(
            "value_table", value_table, R, dims.N, dims.Hv, acc_dtype, layout.replace("H", "Hv")
        )
        spec = "...ntr,rnh->...tnh" if t_v.ndim == 3 else "...ntr,rh->...tnh"

        def rel_values(p):
            return jnp.einsum(spec, sum_into_buckets(p, index, R), t_v.astype(acc_dtype), precision=precision)

    return rel_logits, rel_values


def symmetric_table(table, max_left: int, max_right: int):
    """A clipped table [R,(N,)F] (R = max_left + max_right + 1) as Shaw's symmetric one of max_distance
    D = max(max_left, max_right): [2D+1,(N,)F], row r' = table[clip(r' - D, -max_left, max_right) + max_left].

    The same attention: for every j - i, clip(clip(j - i, -D, D), -max_left, max_right) = clip(j - i,
    -max_left, max_right) as D covers both sides, so the short side repeats its edge row, exactly what the
    asymmetric clip reads there. A gather with static indices: its gradient sums the repeated rows back
    into the edge row (autodiff). The copy is 2D+1 rows, O(max(max_left, max_right)) memory."""
    D = max(max_left, max_right)
    rows = np.clip(np.arange(-D, D + 1), -max_left, max_right) + max_left
    return table if max_left == max_right else jnp.take(table, rows, axis=0)


@compiled_when_eager
def clipped_relative_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    key_table: Float[ArrayLike, "R H"] | Float[ArrayLike, "R N H"] | None = None,
    value_table: Float[ArrayLike, "R Hv"] | Float[ArrayLike, "R N Hv"] | None = None,
    *,
    max_left: int,
    max_right: int,
    **options,
) -> AttentionOutput:
    """Shaw-style relative attention with an asymmetric clip (HF "relative_key" of Wav2Vec2-BERT).

    key_table: [R,H] (shared over heads) or [R,N,H]; value_table: [R,Hv] or [R,N,Hv]; R = max_left +
    max_right + 1, row r <-> j - i = r - max_left. logits = scale * q . (k + key_table[index]),
    out = sum p (v + value_table[index]). Keywords as dot_product_attention. max_left == max_right ==
    max_distance is shaw_relative_attention. implementation / interpret / block_size: as
    shaw_relative_attention (None: blockwise on CPU at long sequences, the tables as symmetric_table).
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    implementation, interpret = options.pop("implementation", None), options.pop("interpret", False)
    max_left = static_int("max_left", max_left, 0)
    max_right = static_int("max_right", max_right, 0)
    layout = "[R,H] or [R,N,H], R = max_left + max_right + 1"
    call = scheme_call("clipped_relative_attention", options)
    engine = implementation if implementation in ("dense", "blockwise") else None
    dims = checks.check_qkv(query, key, value)
    acc_dtype, R = accumulation_dtype(query.dtype), max_left + max_right + 1
    tables = {}
    for name, table, head_dim in (("key_table", key_table, dims.H), ("value_table", value_table, dims.Hv)):
        if table is not None:
            table = checks.check_clipped_table(name, table, R, dims.N, head_dim, acc_dtype, layout)
            tables[name] = symmetric_table(table, max_left, max_right)
    shaw_call = call.replace(**tables, max_distance=max(max_left, max_right)) if tables else call

    def xla():
        if use_blockwise(engine, shaw_call, query, key):
            return blockwise.tiled(shaw_call, query, key, value)
        dense_call = call.replace(block_size=None)
        index = head_index(dims.T, dims.S, max_left, max_right, call)
        rel_logits, rel_values = table_terms(query, dims, key_table, value_table, index, R, call.precision, layout)
        return attention_core(
            dense_call, query, key, value, relative_logits=rel_logits, relative_values=rel_values, dims=dims
        )

    return attend(shaw_call, query, key, value, xla=xla, implementation=implementation, interpret=interpret)
