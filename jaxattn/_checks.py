"""Argument checking: every user error is a ValueError raised here, at trace time.

Messages always read "<argument>: expected <what>, got <what>" so a user can find the bad call without
reading an XLA error. Shapes are static under jit, so none of this costs anything at run time.
"""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np


def fail(name: str, expected, actual) -> None:
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
