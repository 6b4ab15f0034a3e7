"""Argument checking: every user error is a ValueError raised here, at trace time.

Messages always read "<argument>: expected <what>, got <what>" so a user can find the bad call without
reading an XLA error. Shapes are static under jit, so none of this costs anything at run time.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple, NoReturn, Sequence

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh


def fail(name: str, expected, actual) -> NoReturn:
    raise ValueError(f"{name}: expected {expected}, got {actual}")


def shape_str(shape: Sequence) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def check_min_rank(name: str, x, rank: int, layout: str) -> None:
    if x.ndim < rank:
        fail(name, f"rank >= {rank} ({layout})", f"shape {shape_str(x.shape)}")


def check_rank(name: str, x, rank: int, layout: str) -> None:
    if x.ndim != rank:
        fail(name, f"rank {rank} ({layout})", f"shape {shape_str(x.shape)}")


def check_dim(name: str, x, axis: int, expected: int, layout: str) -> None:
    if x.shape[axis] != expected:
        want = list(x.shape)
        want[axis] = expected
        fail(name, f"shape {shape_str(want)} ({layout})", f"shape {shape_str(x.shape)}")


def check_shape(name: str, x, expected: Sequence[int], layout: str) -> None:
    if tuple(x.shape) != tuple(expected):
        fail(name, f"shape {shape_str(expected)} ({layout})", f"shape {shape_str(x.shape)}")


def broadcast_batch(names: Sequence[str], shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The common batch shape of several arrays' leading dims, or a ValueError naming them."""
    try:
        return tuple(np.broadcast_shapes(*[tuple(s) for s in shapes]))
    except ValueError:
        listed = ", ".join(f"{n} {shape_str(s)}" for n, s in zip(names, shapes))
        fail("/".join(names), "batch dims that broadcast together", listed)


def check_broadcastable(name: str, x, target: Sequence[int], layout: str) -> None:
    """x must broadcast to target without adding dims to it (it may have fewer dims)."""
    ok = x.ndim <= len(target)
    if ok:
        try:
            ok = tuple(np.broadcast_shapes(tuple(x.shape), tuple(target))) == tuple(target)
        except ValueError:
            ok = False
    if not ok:
        fail(name, f"a shape broadcastable to {shape_str(target)} ({layout})", f"shape {shape_str(x.shape)}")


def check_bool(name: str, x) -> None:
    if x.dtype != jnp.bool_:
        fail(name, "dtype bool (True = may attend)", f"dtype {x.dtype}")


def check_int(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        fail(name, "an integer dtype", f"dtype {x.dtype}")


def check_float(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        fail(name, "a floating dtype", f"dtype {x.dtype}")


def check_same_dtype(names: Sequence[str], arrays) -> None:
    dtypes = [a.dtype for a in arrays]
    if len(set(dtypes)) > 1:
        listed = ", ".join(f"{n} {d}" for n, d in zip(names, dtypes))
        fail("/".join(names), "one dtype (nothing is cast silently)", listed)


def check_max_distance(max_distance) -> int:
    """Clipped relative tables have R = 2 * max_distance + 1 rows: a static Python int >= 0."""
    if isinstance(max_distance, bool) or not isinstance(max_distance, int) or max_distance < 0:
        fail("max_distance", "a Python int >= 0", repr(max_distance))
    return max_distance


def check_fits(name: str, x, compute_dtype) -> None:
    """A float operand joining `compute_dtype` arithmetic must not be silently narrowed."""
    check_float(name, x)
    if jnp.promote_types(x.dtype, compute_dtype) != compute_dtype:
        fail(name, f"a dtype that fits {jnp.dtype(compute_dtype).name} without loss", f"dtype {x.dtype}")


def static_int(name: str, value, minimum: int | None = None) -> int:
    """A Python int (not bool, not an array: these set shapes), optionally >= minimum."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(name, "a Python int", repr(value))
    if minimum is not None and value < minimum:
        fail(name, f"an int >= {minimum}", value)
    return int(value)


class QKV(NamedTuple):
    """The sizes check_qkv reads off query [...,T,N,H], key [...,S,K,H], value [...,S,K,Hv]."""

    batch: tuple
    T: int
    S: int
    N: int
    K: int
    H: int
    Hv: int


def check_qkv(query, key, value) -> QKV:
    """Validate [...,T,N,H], [...,S,K,H], [...,S,K,Hv]; return their sizes (batch, T, S, N, K, H, Hv)."""
    check_min_rank("query", query, 3, "[...,T,N,H]")
    check_min_rank("key", key, 3, "[...,S,K,H]")
    check_min_rank("value", value, 3, "[...,S,K,Hv]")
    *q_batch, T, N, H = query.shape
    *k_batch, S, K, Hk = key.shape
    *v_batch, Sv, Kv, Hv = value.shape
    if Hk != H:
        fail("key", f"head dim H={H} as in query [...,T,N,H]={shape_str(query.shape)}", f"shape {shape_str(key.shape)}")
    if (Sv, Kv) != (S, K):
        fail(
            "value",
            f"shape [...,{S},{K},Hv] (S and K as in key {shape_str(key.shape)})",
            f"shape {shape_str(value.shape)}",
        )
    if N % K != 0:
        fail("key", f"a number of heads K dividing the query's N={N}", f"K={K} in shape {shape_str(key.shape)}")
    check_same_dtype(("query", "key", "value"), (query, key, value))
    check_float("query", query)
    batch = broadcast_batch(("query", "key", "value"), (q_batch, k_batch, v_batch))
    return QKV(batch, T, S, N, K, H, Hv)


def check_clipped_table(name: str, table, R: int, N: int, head_dim: int, acc_dtype, layout: str):
    """A clipped relative table (Shaw, asymmetric, Transformer-XL): [R,F] shared over heads or [R,N,F]."""
    table = jnp.asarray(table)
    if table.ndim not in (2, 3):
        fail(name, f"rank 2 or 3 ({layout})", f"shape {shape_str(table.shape)}")
    expected = (R, head_dim) if table.ndim == 2 else (R, N, head_dim)
    if tuple(table.shape) != expected:
        fail(name, f"shape {shape_str(expected)} ({layout})", f"shape {shape_str(table.shape)}")
    check_fits(name, table, acc_dtype)
    return table


def check_pair_table(name: str, table, T: int, S: int, N: int, head_dim: int, acc_dtype, layout: str):
    """A per-pair relative table (relative_attention's A^K / A^V): [T,S,N,F], or [T,S,1,F] shared over heads."""
    table = jnp.asarray(table)
    check_rank(name, table, 4, layout)
    if table.shape[2] not in (1, N) or tuple(table.shape[:2]) != (T, S) or table.shape[3] != head_dim:
        fail(name, f"shape [{T},{S},{N} or 1,{head_dim}] ({layout})", f"shape {shape_str(table.shape)}")
    check_fits(name, table, acc_dtype)
    return table


def check_pair_tables(rel_key, rel_value, T: int, S: int, N: int, H: int, Hv: int, acc_dtype):
    """(A^K, A^V) of relative_attention, each checked by check_pair_table (None where absent): A^K [T,S,N|1,H],
    A^V [T,S,N|1,Hv]."""
    wanted = (("rel_key", rel_key, H, "A^K [T,S,N,H]"), ("rel_value", rel_value, Hv, "A^V [T,S,N,Hv]"))
    return tuple(
        None if table is None else check_pair_table(name, table, T, S, N, F, acc_dtype, layout)
        for name, table, F, layout in wanted
    )


def check_mesh(mesh, **axes):
    """mesh is a jax.sharding.Mesh and each named axis is one of its axes, used at most once."""
    if not isinstance(mesh, Mesh):
        fail("mesh", "a jax.sharding.Mesh", type(mesh).__name__)
    used = {name: axis for name, axis in axes.items() if axis is not None}
    for name, axis in used.items():
        if axis not in mesh.axis_names:
            fail(name, f"one of the mesh's axes {tuple(mesh.axis_names)}", repr(axis))
    if len(set(used.values())) != len(used):
        fail("/".join(used), "distinct mesh axes", used)
