"""Placing params and inputs on a device mesh, by the project's axis letters.

Data- and head-parallel attention needs no special code: put the inputs and params on the mesh with
`NamedSharding`s whose specs follow the axis letters (batch `B` over one mesh axis, heads `N`/`K` over
another) and call the ordinary functions under `jax.jit`. Every head's attention is independent, so XLA
runs each device's heads on its own batch rows; the one collective is the sum over heads in the output
projection ("...tnh,nho->...to" contracts N), an all-reduce of [...,T,Eo] over the head axis.

    letter   mesh axis          letter        mesh axis
    B        batch_axis         N, K          head_axis
    T, S     sequence_axis      anything else replicated (H, E, R, ...)
"""

from __future__ import annotations

import jax
from jax.sharding import NamedSharding, PartitionSpec

from .._core import checks
from .._core.checks import check_mesh

# The flax-layout params (docs/design.md, "The parameter tree") by entry: layout letters of each array.
# Nothing is guessed from names or ranks beyond this table (Shaw tables come shared [R,H] or per head [R,N,H]).
_PARAM_LAYOUTS = {
    ("query", "kernel"): "ENH",
    ("query", "bias"): "NH",
    ("key", "kernel"): "EKH",
    ("key", "bias"): "KH",
    ("value", "kernel"): "EKH",
    ("value", "bias"): "KH",
    ("out", "kernel"): "NHE",
    ("out", "bias"): "E",
    ("bias_kv", "key"): "KH",
    ("bias_kv", "value"): "KH",
    ("relative", "key"): ("RH", "RNH"),
    ("relative", "value"): ("RH", "RNH"),
}


def partition_spec(layout: str, *, batch_axis=None, sequence_axis=None, head_axis=None) -> PartitionSpec:
    """The PartitionSpec of an array whose dims read `layout` (one axis letter a dim, e.g. "BTNH")."""
    axis_of = {"B": batch_axis, "T": sequence_axis, "S": sequence_axis, "N": head_axis, "K": head_axis}
    return PartitionSpec(*(axis_of.get(letter) for letter in layout))


def _check_divides(name, x, layout, spec, mesh):
    for dim, (letter, axis) in enumerate(zip(layout, spec)):
        if axis is not None and x.shape[dim] % mesh.shape[axis]:
            checks.fail(
                name,
                f"dim {dim} ({letter}) divisible by mesh axis {axis!r} of size {mesh.shape[axis]}",
                f"shape {checks.shape_str(x.shape)}",
            )


def shard_inputs(inputs, mesh, layout: str, *, batch_axis=None, sequence_axis=None, head_axis=None):
    """Place an array (or a pytree of arrays sharing one layout) on `mesh`.

    layout: one axis letter per dim, e.g. "BTE" for [B,T,E] model inputs, "BTNH" for head-split queries,
    "BSKH" for keys, "B" for key_value_seq_lengths. B goes over batch_axis, T/S over sequence_axis and
    N/K over head_axis; other dims are replicated. Every sharded dim must divide by its mesh axis.
    """
    check_mesh(mesh, batch_axis=batch_axis, sequence_axis=sequence_axis, head_axis=head_axis)
    spec = partition_spec(layout, batch_axis=batch_axis, sequence_axis=sequence_axis, head_axis=head_axis)

    def place(path, x):
        name = "inputs" + jax.tree_util.keystr(path)
        if x.ndim != len(layout):
            checks.fail(name, f"rank {len(layout)} (layout {layout!r})", f"shape {checks.shape_str(x.shape)}")
        _check_divides(name, x, layout, spec, mesh)
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, inputs)


def shard_params(params, mesh, *, head_axis=None):
    """Place a multi-head params tree (flax layout) on `mesh` with heads over `head_axis`.

    Query/out kernels and biases and per-head Shaw tables are split by query head N; key/value entries by
    key/value head K when K divides by the axis size, replicated otherwise (multi-query: every device
    projects the shared key/value heads). Everything else is replicated on every device.
    """
    check_mesh(mesh, head_axis=head_axis)
    size = mesh.shape[head_axis] if head_axis is not None else 1

    def place(path, x):
        keys = tuple(getattr(p, "key", getattr(p, "name", p)) for p in path)
        name = "params" + jax.tree_util.keystr(path)
        layout = _PARAM_LAYOUTS.get(keys)
        if layout is None:
            checks.fail(name, f"an entry among {sorted('/'.join(k) for k in _PARAM_LAYOUTS)}", "an unknown entry")
        if isinstance(layout, tuple):
            layout = next((l for l in layout if len(l) == x.ndim), layout[-1])
        if x.ndim != len(layout):
            checks.fail(name, f"rank {len(layout)} ({layout})", f"shape {checks.shape_str(x.shape)}")
        if "K" in layout and x.shape[layout.index("K")] % size:
            layout = layout.replace("K", "-")  # too few key/value heads to split: replicate them
        spec = partition_spec(layout, head_axis=head_axis)
        _check_divides(name, x, layout, spec, mesh)
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, params)
