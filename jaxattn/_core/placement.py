"""Arrays a program makes for itself, placed like the arrays they sit beside.

Under an Explicit mesh (`jax.set_mesh` over `AxisType.Explicit` axes) every array's type carries its sharding,
and a loop's carry must leave the body with the type it entered: an accumulator made by `jnp.zeros(shape)` is
replicated, while the body's update of it is sharded like the queries it came from, and jax refuses the loop
("carry input and carry output must have equal types"). So every carry the engines make starts here, with the
sharding of the array whose rows it holds. Under Auto axes, and with no mesh at all, types carry no sharding
and these are jnp.full / jnp.zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec


def explicit_spec(x) -> PartitionSpec | None:
    """x's PartitionSpec when its type carries one (an Explicit mesh in context), else None."""
    typeof = getattr(jax, "typeof", None)  # jax >= 0.6
    sharding = None if typeof is None else getattr(typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or getattr(mesh, "empty", True) or not getattr(mesh, "_any_axis_explicit", False):
        return None
    return sharding.spec


def explicit_entries(x) -> tuple | None:
    """x's spec padded to one entry a dim (None: that dim whole), or None when x's type carries no sharding."""
    spec = explicit_spec(x)
    return None if spec is None else tuple(spec) + (None,) * (jnp.ndim(x) - len(spec))


def axis_names(entry) -> tuple:
    """The mesh axes of one spec entry: None, a name, or a tuple of names."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def full_beside(like, shape, fill, dtype):
    """jnp.full(shape, fill, dtype), each dim of `shape` that equals the same dim of `like` sharded as it is
    there (the leading dims a row accumulator shares with its queries); the others replicated."""
    entries = None if like is None else explicit_entries(like)
    if entries is None:
        return jnp.full(shape, fill, dtype)
    like_shape = jnp.shape(like)
    placed = tuple(
        entries[i] if i < len(like_shape) and like_shape[i] == size else None for i, size in enumerate(shape)
    )
    return jnp.full(shape, fill, dtype, out_sharding=PartitionSpec(*placed))


def zeros_beside(like, shape, dtype):
    """full_beside(like, shape, 0, dtype)."""
    return full_beside(like, shape, 0, dtype)


def einsum_sharding(spec: str, *operands) -> PartitionSpec | None:
    """The out_sharding of jnp.einsum(spec, *operands) under an Explicit mesh (None elsewhere, or when no
    operand is placed): each output letter split as the first operand that has it is, each mesh axis used
    once. A sum over a split letter (a table's gradient summed over the batch and heads) is then an
    all-reduce into a replicated result, which jax will not guess ("Contracting dimensions are sharded")."""
    inputs, out = spec.replace(" ", "").split("->")
    entries = {}
    placed = False
    for letters, x in zip(inputs.split(","), operands):
        x_entries = explicit_entries(x)
        if x_entries is None:
            continue
        placed = True
        for letter, entry in zip(letters, x_entries):
            entries.setdefault(letter, entry)
    if not placed:
        return None
    used, result = set(), []
    for letter in out:
        axes = entries.get(letter)
        names = axis_names(axes)
        if names and not used.intersection(names):
            used.update(names)
            result.append(axes)
        else:
            result.append(None)
    return PartitionSpec(*result)


def placed_as(x, like):
    """x resharded as `like` is under an Explicit mesh (a cotangent handed to a vjp must carry the type of
    the primal output: a position bias computed replicated takes back its gradient summed over split
    batch rows and heads); x itself elsewhere."""
    spec = explicit_spec(like)
    return x if spec is None else jax.sharding.reshard(x, spec)


def split_as_dim(index, like, axis: int):
    """A 1-D `index` split as `like`'s dim `axis` is (a score_mod's batch and head indices, vmapped beside a
    score split over the batch and heads: vmap needs the mapped dims split the same way); unchanged elsewhere."""
    entries = None if like is None else explicit_entries(like)
    return index if entries is None else jax.sharding.reshard(index, PartitionSpec(entries[axis]))
