"""The kernels on a mesh: each device runs the kernel on its own shard of the batch and the heads.

XLA cannot partition a Pallas kernel: Mosaic refuses ("Mosaic kernels cannot be automatically partitioned"), and
a Triton call has no sharding rule, so XLA gathers q, k and v around it and runs the whole call on every
device. Attention is independent per batch entry and per head, so a call splits exactly along those dims:
every device runs the kernel, unchanged, on its batch rows and its query heads (and the key/value heads they
read), and the output leaves split the same way. Nothing is gathered, and each device holds its share of the
output and of the kernel's temporaries (docs/design.md, "Kernels on a mesh").

How a call splits (a Split: the query's batch and head entries) comes from one of two places:

    Explicit axes   (jax.set_mesh over AxisType.Explicit) the inputs' types carry their PartitionSpecs: the call
                    runs in jax.shard_map (on_mesh), the kernels' own custom VJPs inside
    Auto axes       (a multi-device NamedSharding under jax.jit) the types name only the mesh: the call is a
                    custom_partitioning call whose rule reads the query's sharding from XLA's partitioner and
                    runs the same shard function (on_auto_mesh); its backward a second one, the VJP of the
                    shard's forward

What a shard receives (Plan, SideInput):

    query [...,T,N,H]   batch dims and N as the query is split; T and H must not be split
    key / value         batch dims as the query's; K with N where it divides the head split, else each device
                        takes the key/value heads its query heads read
    side inputs         lengths, positions and segment ids with the batch; sinks with the batch and heads;
                        Shaw tables with the heads (or whole); a T5 / ALiBi / window bias as its rows [N,D] with
                        the heads; a BlockMask's tiles with the batch and heads (Explicit axes)
    score_mod/mask_mod  called with the global batch and head indices (b, n): a shard's indices plus its offset
    out [...,T,N,Hv], lse [...,N,T]: split as the query

A query or key split along its sequence (T / S) is refused by name: the sequence-parallel call is
`ring_attention`, and a kernel would otherwise need every device to hold the whole sequence.

A caller that lays its activations out itself (the models on from_pretrained(mesh=)'s Auto mesh: batch over
"data", heads over "model", constrained between blocks) says so with activation_layout(mesh, batch_axis,
head_axis): inside it, a kernel call on that Auto mesh runs in jax.shard_map by that layout (a Split, as the
Explicit path), not in a custom_partitioning call. Nothing then depends on a Python partitioner, which a TPU
program compiled from a CPU host does not run.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from ._core import block_mask as block_masks, checks, mods, offset_bias, row_tables
from ._core.call import INDEX_ARRAYS, AttentionCall
from ._core.placement import axis_names, explicit_entries


@dataclasses.dataclass(frozen=True)
class Split:
    """How one call splits over a mesh: the batch dims' entries (the query's) and the heads'."""

    batch: tuple  # one spec entry per query batch dim
    heads: object  # the spec entry of the query's N
    head_shards: int  # the number of devices the heads are split over
    mesh: object  # the mesh: the inputs' types' (Explicit), the partitioner's (Auto)

    def spec(self, batch_dims, *rest) -> PartitionSpec:
        """The PartitionSpec of an array whose leading `batch_dims` (a tuple of sizes) align with the query's
        batch dims from the right (size 1: broadcast, replicated), followed by `rest` entries."""
        batch = self.batch[len(self.batch) - len(batch_dims) :] if batch_dims else ()
        return PartitionSpec(*(e if size != 1 else None for e, size in zip(batch, batch_dims)), *rest)


def split_of(call: AttentionCall, query, key, value) -> Optional[Split]:
    """The Split of a call whose inputs carry Explicit shardings (None: no mesh in their types, or nothing
    split); ValueError naming the input whose sequence or head dim is split."""
    specs = {name: explicit_entries(x) for name, x in (("query", query), ("key", key), ("value", value))}
    if all(spec is None for spec in specs.values()):
        return None
    for name, spec in specs.items():
        if spec is not None:
            _refuse_sequence_split(name, spec)
    q_spec = specs["query"] or (None,) * np.ndim(query)
    batch, heads = q_spec[:-3], q_spec[-2]
    if not any(batch) and heads is None and not any(any(s[:-3]) or s[-2] for s in specs.values() if s is not None):
        return None
    mesh = jax.typeof(query).sharding.mesh if specs["query"] is not None else None
    if mesh is None:
        mesh = next(jax.typeof(x).sharding.mesh for x, s in zip((key, value), (specs["key"], specs["value"])) if s)
    shards = math.prod(mesh.shape[a] for a in axis_names(heads))
    return Split(tuple(batch), heads, shards, mesh)


# The layout a caller constrains its attention inputs to on an Auto mesh (activation_layout): (mesh, batch axis,
# head axis), or None.
_LAYOUT: contextvars.ContextVar = contextvars.ContextVar("jaxattn_activation_layout", default=None)


@contextlib.contextmanager
def activation_layout(mesh, batch_axis: Optional[str], head_axis: Optional[str]):
    """Inside: kernel calls on inputs of the Auto mesh `mesh` split as this layout says, the query's first batch
    dim over batch_axis and its heads over head_axis (where the axis is the mesh's and divides the dim; the key's
    heads too), by jax.shard_map (layout_split) rather than a custom_partitioning call (module docstring)."""
    token = _LAYOUT.set((mesh, batch_axis, head_axis))
    try:
        yield
    finally:
        _LAYOUT.reset(token)


def layout_split(query, key, mesh) -> Optional[Split]:
    """The Split of activation_layout's layout for a call on the Auto mesh `mesh` (None: no layout in context, or
    one of another mesh, or nothing it splits)."""
    layout = _LAYOUT.get()
    if layout is None or getattr(layout[0], "abstract_mesh", layout[0]) != getattr(mesh, "abstract_mesh", mesh):
        return None  # (a traced input's type names the abstract mesh)
    mesh, batch_axis, head_axis = layout
    fits = lambda axis, *dims: axis in mesh.axis_names and all(d % mesh.shape[axis] == 0 for d in dims)  # noqa: E731
    shape, batch_dims = np.shape(query), np.ndim(query) - 3
    batch = [None] * batch_dims
    if batch_dims and batch_axis is not None and fits(batch_axis, shape[0]):
        batch[0] = batch_axis
    heads = head_axis if head_axis is not None and fits(head_axis, shape[-2], np.shape(key)[-2]) else None
    if not any(batch) and heads is None:
        return None
    return Split(tuple(batch), heads, mesh.shape[heads] if heads else 1, mesh)


def _refuse_sequence_split(name: str, spec: tuple):
    """ValueError naming `name` (query / key / value) when its spec splits the sequence or the head dim."""
    seq = spec[-3]
    if seq is not None:
        checks.fail(
            name,
            f"its sequence dim ({'T' if name == 'query' else 'S'}) not split over a mesh: a kernel needs every "
            f"query's keys on one device; split the sequence with jaxattn.ring_attention(..., sequence_axis={seq!r})",
            f"split over {seq!r} ({PartitionSpec(*spec)})",
        )
    if spec[-1] is not None:
        checks.fail(name, "its head dim not split over a mesh", f"split over {spec[-1]!r} ({PartitionSpec(*spec)})")


def mesh_refusal(call: AttentionCall, query, key, split: Split, interpret=False) -> Optional[str]:
    """The first option in use that no rule here splits over a mesh (None: the call splits).

    A score_mod / mask_mod that reads the batch index b (the batch split) or the head index n (the heads split)
    sees a shard's indices plus its offset, an array it then closes over: Pallas' interpreter takes that, a
    compiled kernel (Triton, Mosaic) does not index an array from a mod, so there it is refused."""
    refused = _unsplit(call, query, key)
    if refused is not None:
        return refused
    if interpret:
        return _block_mask_refusal(call, query, split)
    batch_split, heads_split = any(split.batch), split.heads is not None
    for name in ("score_mod", "mask_mod"):
        mod = getattr(call, name)
        if mod is not None:
            reads_b, reads_n = _reads_indices(mod, name == "score_mod", query)
            if (reads_b and batch_split) or (reads_n and heads_split):
                return name
    return _block_mask_refusal(call, query, split)


def _block_mask_refusal(call: AttentionCall, query, split: Optional[Split]) -> Optional[str]:
    """A BlockMask whose own mask_mod reads b or n, on a split of the batch or heads (its partial tiles would see
    the shard's indices; a BlockMask's mask_mod is not rewrapped), or on Auto axes (split None: a pytree the
    partitioning rule does not lay out yet)."""
    block_mask = call.block_mask
    if block_mask is None:
        return None
    if split is None:
        return "block_mask"
    if block_mask.mask_mod is not None:
        reads_b, reads_n = _reads_indices(block_mask.mask_mod, False, query)
        if (reads_b and any(split.batch)) or (reads_n and split.heads is not None):
            return "block_mask"
    return None


def _unsplit(call: AttentionCall, query, key) -> Optional[str]:
    """The first option in use that no rule splits (None: every one does): a position bias whose rows have batch
    dims, or a BlockMask under several batch dims (side_inputs). implementation=None keeps the XLA engines for
    it on a mesh, a named kernel refuses it by name."""
    if side_inputs(call, np.shape(query)[-3], np.shape(key)[-3], np.ndim(query) - 3) is None:
        return "block_mask" if call.block_mask is not None else "position_bias"
    return None


def _reads_indices(mod: Callable, with_score: bool, query) -> tuple[bool, bool]:
    """Whether mod's result depends on its batch index b and head index n (traced once on scalars: a jaxpr
    variable that no equation and no output reads is not read)."""
    index = jax.ShapeDtypeStruct((), jnp.int32)
    args = ((jax.ShapeDtypeStruct((), jnp.result_type(query)),) if with_score else ()) + (index,) * 4
    jaxpr = jax.make_jaxpr(mod)(*args).jaxpr
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    lead = 1 if with_score else 0
    return id(jaxpr.invars[lead]) in used, id(jaxpr.invars[lead + 1]) in used


def _global_mod(mod: Callable, batch_ids, head_ids, batch_shape, lead: int) -> Callable:
    """mod with its (b, n) read as a shard's flattened batch index and head index, called with the global ones.

    A shard's batch block starts at the multi-index of its first global id; a local flat index b unravels over
    the shard's batch shape, adds that start, and ravels over the global shape. The heads are one block."""
    local_shape = batch_ids.shape
    first = batch_ids.reshape(-1)[0] if batch_ids.size else jnp.int32(0)
    n0 = head_ids[0]

    def to_global(b):
        out, stride_g, stride_l = 0, 1, 1
        for size_g, size_l in zip(reversed(batch_shape), reversed(local_shape)):
            start = (first // stride_g) % size_g
            out = out + (start + (b // stride_l) % size_l) * stride_g
            stride_g, stride_l = stride_g * size_g, stride_l * size_l
        return out

    return lambda *args: mod(*args[:lead], to_global(args[lead]), args[lead + 1] + n0, *args[lead + 2 :])


def _kv_heads(key, split: Split, N: int, head_ids):
    """The key/value heads a shard's query heads read, when K does not split with N: one head where a shard's
    query heads share one (G % Nl == 0), else one per query head (the shard then runs multi-head)."""
    K, Nl = key.shape[-2], head_ids.shape[0]
    G = N // K
    if G % Nl == 0:
        return lax.dynamic_slice_in_dim(key, head_ids[0] // G, 1, axis=-2)
    return jnp.take(key, head_ids // G, axis=-2)


@dataclasses.dataclass(frozen=True)
class SideInput:
    """One array a split call carries to its shards beside q, k, v: the AttentionCall field it fills (or
    "row_tables.<attribute>": one array of DeBERTa's RowTables, which the shard puts back together), how it
    splits (spec), and how the shard's slice becomes the field's value (rebuild: a position bias's rows
    become an OffsetBias / TableBias of the shard's heads)."""

    field: str
    array: object
    spec: Callable  # Split -> PartitionSpec
    rebuild: Callable = lambda x: x

    @property
    def differentiable(self) -> bool:
        return not isinstance(self.array, block_masks.BlockMask) and jnp.issubdtype(
            jnp.result_type(self.array), jnp.inexact
        )


def _batch_side(field: str, x, trailing: int, heads_last: bool = False) -> SideInput:
    """A side input of batch dims [...] (aligned with the query's from the right) and `trailing` dims, the last
    one the query heads when heads_last (sinks [...,N])."""
    batch = tuple(np.shape(x)[: np.ndim(x) - trailing])
    rest = lambda split: (split.heads,) if heads_last else (None,) * trailing  # noqa: E731
    return SideInput(field, x, lambda split: split.spec(batch, *rest(split)))


def _table_side(field: str, table) -> SideInput:
    """A Shaw table: [R,F] shared by the heads (whole on every shard) or [R,N,F] (split with the heads)."""
    if np.ndim(table) == 2:
        return SideInput(field, table, lambda split: PartitionSpec())
    return SideInput(field, table, lambda split: PartitionSpec(None, split.heads, None))


def _row_table_sides(tables: row_tables.RowTables) -> list:
    """DeBERTa's RowTables as its arrays: the c2p / p2c tables [R,(N,)H] as Shaw's (split with the heads, or whole
    when shared), the map of offsets to rows whole on every shard (rows, lo and hi are static)."""
    sides = [
        _table_side(f"row_tables.{name}", table)
        for name, table in (("key_rows", tables.key_rows), ("query_rows", tables.query_rows))
        if table is not None
    ]
    row_of_offset = jnp.asarray(tables.row_of_offset, jnp.int32)
    return [*sides, SideInput("row_tables.row_of_offset", row_of_offset, lambda split: PartitionSpec())]


def _pair_side(field: str, table) -> SideInput:
    """A per-pair table (relative_attention's rel_key / rel_value, [T,S,N|1,F]): split with the heads, or whole on
    every shard when the heads share it; no batch axis (one table for every example)."""
    if np.shape(table)[2] == 1:
        return SideInput(field, table, lambda split: PartitionSpec())
    return SideInput(field, table, lambda split: PartitionSpec(None, None, split.heads, None))


def _bias_side(bias, T: int, S: int, default_positions: bool) -> Optional[SideInput]:
    """A kernel position bias (offset_bias.KERNEL_BIASES) as its rows [N,D], split with the heads, each shard's
    rebuilt into the same kind of bias over its heads; None for rows with batch dims (not split yet)."""
    rows, index = bias.kernel_table(T, S, default_positions)
    if np.ndim(rows) != 2:
        return None
    if isinstance(bias, offset_bias.OffsetBias):
        lo, hi = index.lo, index.hi
        rebuild = lambda local: offset_bias.of_rows(local, lo, hi)  # noqa: E731
    else:
        rebuild = lambda local: offset_bias.TableBias(jnp.swapaxes(local, -1, -2), index, bias.length)  # noqa: E731
    return SideInput("position_bias", rows, lambda split: PartitionSpec(split.heads, None), rebuild)


def _block_mask_side(block_mask, batch_dims: int) -> Optional[SideInput]:
    """A BlockMask (a pytree: four tile arrays [B|1,N|1,Tn(,Sn)], its mask_mod's arrays): its batch axis split as
    the query's (one batch dim) and its head axis with the heads, where they are not 1; each shard's rebuilt with
    its own sizes. None where the query has several batch dims (the BlockMask's B is their flattened product)."""
    if batch_dims > 1:
        return None
    B, N = block_mask.kv_indices.shape[:2]

    def spec(split):
        batch = split.batch[0] if split.batch and B > 1 else None
        heads = split.heads if N > 1 else None
        tiles = lambda x: PartitionSpec(batch, heads)  # noqa: E731
        return dataclasses.replace(
            jax.tree.map(tiles, block_mask), mask_consts=tuple(PartitionSpec() for _ in block_mask.mask_consts)
        )

    def rebuild(local):
        b, n = local.kv_indices.shape[:2]
        return dataclasses.replace(
            local,
            batch=None if local.batch is None else b,
            num_heads=None if local.num_heads is None else n,
        )

    return SideInput("block_mask", block_mask, spec, rebuild)


def side_inputs(call: AttentionCall, T: int, S: int, batch_dims: int = 1) -> Optional[tuple]:
    """The SideInputs of a call (None: an option in use that no rule splits: see mesh_refusal)."""
    sides = []
    for name in INDEX_ARRAYS:  # lengths [...]; positions and segment ids [...,T] / [...,S]
        if getattr(call, name) is not None:
            sides.append(_batch_side(name, getattr(call, name), 0 if name == "key_value_seq_lengths" else 1))
    if call.sinks is not None:
        sides.append(_batch_side("sinks", call.sinks, 1, heads_last=True))
    for name in ("key_table", "value_table"):
        if getattr(call, name) is not None:
            sides.append(_table_side(name, getattr(call, name)))
    for name in ("rel_key", "rel_value"):
        if getattr(call, name) is not None:
            sides.append(_pair_side(name, getattr(call, name)))
    if call.row_tables is not None:
        sides.extend(_row_table_sides(call.row_tables))
    if call.block_mask is not None:
        block_mask = _block_mask_side(call.block_mask, batch_dims)
        if block_mask is None:
            return None
        sides.append(block_mask)
    if call.position_bias is not None:
        if not isinstance(call.position_bias, offset_bias.KERNEL_BIASES):
            return None
        default = call.query_positions is None and call.key_positions is None
        if not call.position_bias.in_kernel(T, S, default):
            return None
        bias = _bias_side(call.position_bias, T, S, default)
        if bias is None:
            return None
        sides.append(bias)
    return tuple(sides)


class Plan:
    """What a kernel call carries to each shard, whatever the split: its SideInputs, the index arrays a shard
    reads its offsets from, the mods that need global (b, n)."""

    def __init__(self, call: AttentionCall, query, key, value):
        self.batch_shape = tuple(np.shape(query)[:-3])
        self.N, self.K = np.shape(query)[-2], np.shape(key)[-2]
        self.T, self.S = np.shape(query)[-3], np.shape(key)[-3]
        self.side = side_inputs(call, self.T, self.S, len(self.batch_shape))
        if self.side is None:
            raise AssertionError("mesh_refusal admits only calls whose side inputs split")
        self.batch_ids = jnp.arange(math.prod(self.batch_shape), dtype=jnp.int32).reshape(self.batch_shape)
        self.head_ids = jnp.arange(self.N, dtype=jnp.int32)
        self.mods = {  # name: (mod, reads b, reads n): a mod reading b or n needs the global ones on a split
            name: (mod, *_reads_indices(mod, name == "score_mod", query))
            for name in ("score_mod", "mask_mod")
            if (mod := getattr(call, name)) is not None
        }
        # the arrays travel as arguments (a RowTables' static rows, lo and hi stay here, for the shards)
        self.call = call.replace(**{side.field.split(".")[0]: None for side in self.side})
        self.row_tables = call.row_tables
        self.key_shape, self.value_shape = tuple(np.shape(key)), tuple(np.shape(value))

    def arguments(self, query, key, value) -> tuple:
        return (query, key, value, self.batch_ids, self.head_ids, *(side.array for side in self.side))

    def kv_with_heads(self, split: Split) -> bool:
        """Key/value heads split with the query heads (K divides the head split)."""
        return split.heads is not None and self.K % split.head_shards == 0

    def in_specs(self, split: Split) -> tuple:
        kv_heads = split.heads if self.kv_with_heads(split) else None
        return (
            split.spec(self.batch_shape, None, split.heads, None),
            split.spec(self.key_shape[:-3], None, kv_heads, None),
            split.spec(self.value_shape[:-3], None, kv_heads, None),
            split.spec(self.batch_shape),
            PartitionSpec(split.heads),
            *(side.spec(split) for side in self.side),
        )

    def out_specs(self, split: Split):
        out = split.spec(self.batch_shape, None, split.heads, None)
        return (out, split.spec(self.batch_shape, split.heads, None)) if self.call.return_lse else out

    def shard_fn(self, run: Callable, split: Split) -> Callable:
        """The function each device runs on its shard: run(call, q, k, v) with its key/value heads, its side
        arrays and mods reading global (b, n)."""
        heads_split, kv_with_heads = split.heads is not None, self.kv_with_heads(split)

        def shard(q, k, v, batch_ids, head_ids, *arrays):
            if heads_split and not kv_with_heads:
                k, v = (_kv_heads(x, split, self.N, head_ids) for x in (k, v))
            local = {side.field: side.rebuild(x) for side, x in zip(self.side, arrays)}
            tables = {name.split(".")[1]: local.pop(name) for name in list(local) if name.startswith("row_tables.")}
            if tables:  # DeBERTa's tables put back together from the shard's arrays
                local["row_tables"] = dataclasses.replace(
                    self.row_tables,
                    key_rows=tables.get("key_rows"),
                    query_rows=tables.get("query_rows"),
                    row_of_offset=tables["row_of_offset"],
                )
            # score_mod(score, b, n, t, s), mask_mod(b, n, t, s)
            for name, (mod, reads_b, reads_n) in self.mods.items():
                if (reads_b and any(split.batch)) or (reads_n and heads_split):
                    lead = 1 if name == "score_mod" else 0
                    local[name] = _global_mod(mod, batch_ids, head_ids, self.batch_shape, lead)
            return run(self.call.replace(**local), q, k, v)

        return shard


def on_mesh(run: Callable, call: AttentionCall, query, key, value, split: Split):
    """run(call, query, key, value) on each device's shard of `split` (jax.shard_map), the result split as the
    query; `call` carries only options that split (mesh_refusal is None)."""
    plan = Plan(call, query, key, value)
    in_specs = plan.in_specs(split)
    # check_vma=False: a pallas_call's outputs say nothing of how they vary over the mesh axes (Pallas asks
    # for it under check_vma); every output here is split exactly as out_specs say.
    mapped = jax.shard_map(
        plan.shard_fn(run, split), mesh=split.mesh, in_specs=in_specs, out_specs=plan.out_specs(split), check_vma=False
    )
    # an Explicit mesh's shard_map takes each input placed as its spec says: the index arrays and side inputs
    # are made or passed replicated (a device keeps its slice, nothing moves); a key placed unlike the query
    # moves to the query's split here, in the open, where a user's profile shows it. On an Auto mesh (a
    # caller's activation_layout) the same placement is a sharding constraint.
    explicit = all(t == AxisType.Explicit for t in getattr(split.mesh, "axis_types", ()))
    place = (
        jax.sharding.reshard
        if explicit
        else lambda x, spec: jax.lax.with_sharding_constraint(x, NamedSharding(split.mesh, spec))
    )
    return mapped(*(place(x, spec) for x, spec in zip(plan.arguments(query, key, value), in_specs)))


# ---------------------------------------------------------------------------------------------------
# Auto axes: the split is known only when XLA partitions the program, so the kernel call is a
# custom_partitioning call whose partition rule runs the same shard function on each device's shard.


def auto_mesh_of(query, key, value):
    """The mesh of Auto axes over more than one device that the inputs' types name (arrays placed with a
    NamedSharding, under jax.jit), or None: one device, an Explicit mesh, or inside a shard_map."""
    typeof = getattr(jax, "typeof", None)
    if typeof is None:
        return None
    for x in (query, key, value):
        mesh = getattr(getattr(typeof(x), "sharding", None), "mesh", None)
        if mesh is None or getattr(mesh, "empty", True) or mesh.size <= 1:
            continue
        if all(t == AxisType.Auto for t in mesh.axis_types):
            return mesh
    return None


def auto_refusal(call: AttentionCall, query, key, interpret=False) -> Optional[str]:
    """The first option the Auto-axes path cannot split (None: it can): what mesh_refusal refuses, and a
    score_mod / mask_mod that closes over arrays (a partitioned call is traced on its own, closing over
    nothing) or, on a compiled kernel, reads b or n (whatever the split turns out to be)."""
    refused = _unsplit(call, query, key) or _block_mask_refusal(call, query, None)
    if refused is not None:
        return refused
    for name in ("score_mod", "mask_mod"):
        mod = getattr(call, name)
        if mod is None:
            continue
        score_dtype = jnp.result_type(query) if name == "score_mod" else None
        if mods.element_function(name, mod, score_dtype).consts:
            return name
        if not interpret and any(_reads_indices(mod, name == "score_mod", query)):
            return name
    return None


def _split_of_sharding(sharding, mesh, ndim: int) -> Split:
    """The Split a query's NamedSharding (as XLA's partitioner hands it over) gives."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(tuple(sharding.spec)))
    _refuse_sequence_split("query", spec)
    heads = spec[-2]
    return Split(spec[:-3], heads, math.prod(mesh.shape[a] for a in axis_names(heads)), mesh)


def _sharding_rule(plan: Plan, backward: bool) -> str:
    """The Shardy rule of the call (factors named by the axis letters): batch dims shared where sizes agree,
    heads n (query) and k (key/value) apart, so that propagation never ties what the partition rule decides."""
    batch = [f"b{i}" for i in range(len(plan.batch_shape))]

    def lead(shape):
        dims = shape[: len(shape)]
        offset = len(plan.batch_shape) - len(dims)
        return [
            batch[offset + i] if size == plan.batch_shape[offset + i] else f"x{offset + i}_{id(shape) % 997}"
            for i, size in enumerate(dims)
        ]

    def mapping(letters):  # a scalar operand (no batch dims: batch_ids) maps no factor
        return " ".join(letters)

    # side inputs: factors of their own (the partition rule places them; nothing to tie them to the query by)
    side = [mapping([f"x{j}_{d}" for d in range(np.ndim(x.array))]) for j, x in enumerate(plan.side)]
    q = mapping(batch + ["t", "n", "h"])
    k = mapping(lead(plan.key_shape[:-3]) + ["s", "k", "h"])
    v = mapping(lead(plan.value_shape[:-3]) + ["s", "k", "hv"])
    inputs = [q, k, v, mapping(batch), "n", *side]
    out = [mapping(batch + ["t", "n", "hv"])] + ([mapping(batch + ["n", "t"])] if plan.call.return_lse else [])
    if not backward:
        return f"{', '.join(inputs)} -> {', '.join(out)}"
    grads = [q, k, v] + [side[j] for j, x in enumerate(plan.side) if x.differentiable]
    return f"{', '.join(inputs + out)} -> {', '.join(grads)}"


def on_auto_mesh(run: Callable, call: AttentionCall, query, key, value):
    """run(call, query, key, value) split over the Auto axes XLA's partitioner finds the inputs on: the forward
    and the backward are each a custom_partitioning call whose rule runs Plan.shard_fn on every device's shard
    (batch and heads), the backward as the VJP of the shard's own forward (the kernel's forward runs again
    there: its residuals cannot leave a partitioned call whose shapes are known only to the partitioner)."""
    plan = Plan(call, query, key, value)
    args = plan.arguments(query, key, value)
    n_args, ndim = len(args), np.ndim(query)
    # the arguments the backward differentiates: q, k, v and the floating side inputs (sinks, tables, bias rows)
    wrt = (0, 1, 2) + tuple(5 + j for j, side in enumerate(plan.side) if side.differentiable)
    whole = Split((None,) * len(plan.batch_shape), None, 1, None)

    def named(mesh, specs):
        return jax.tree.map(
            lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )

    # jax.jit: a kernel's program holds constants (tile schedules as numpy arrays); a jitted call keeps them
    # inside its own program, where custom_partitioning (which traces its function closing over nothing) allows them
    forward = jax.jit(plan.shard_fn(run, whole))

    def forward_partition(mesh, arg_shapes, result_shape):
        split = _split_of_sharding(arg_shapes[0].sharding, mesh, ndim)
        return mesh, plan.shard_fn(run, split), named(mesh, plan.out_specs(split)), named(mesh, plan.in_specs(split))

    def forward_infer(mesh, arg_shapes, result_shape):
        return named(mesh, plan.out_specs(_split_of_sharding(arg_shapes[0].sharding, mesh, ndim)))

    def gradients(split: Split):
        shard = plan.shard_fn(run, split)
        specs = plan.in_specs(split)
        split_axes = [a for e in (*split.batch, split.heads) for a in axis_names(e)]

        def grads(*inputs):
            args, cts = list(inputs[:n_args]), inputs[n_args:]

            def of(*diff):
                return shard(*(diff[wrt.index(i)] if i in wrt else a for i, a in enumerate(args)))

            _, vjp = jax.vjp(of, *(args[i] for i in wrt))
            out = list(vjp(tuple(cts) if plan.call.return_lse else cts[0]))
            # an argument whole on the devices of a split axis (k, v beside split heads they do not split with; a
            # table shared by the heads; sinks without batch dims) took a part of its gradient on each: the sum
            for j, i in enumerate(wrt):
                kept = {a for e in specs[i] for a in axis_names(e)}
                summed = tuple(a for a in split_axes if a not in kept)
                out[j] = lax.psum(out[j], summed) if summed else out[j]
            return tuple(out)

        return grads

    def grad_specs(split: Split):
        specs = plan.in_specs(split)
        return tuple(specs[i] for i in wrt)

    def backward_partition(mesh, arg_shapes, result_shape):
        split = _split_of_sharding(arg_shapes[0].sharding, mesh, ndim)
        out_specs = plan.out_specs(split)
        in_specs = plan.in_specs(split) + (tuple(out_specs) if plan.call.return_lse else (out_specs,))
        return mesh, gradients(split), named(mesh, grad_specs(split)), named(mesh, in_specs)

    def backward_infer(mesh, arg_shapes, result_shape):
        return named(mesh, grad_specs(_split_of_sharding(arg_shapes[0].sharding, mesh, ndim)))

    forward_call = custom_partitioning(forward)
    forward_call.def_partition(
        partition=forward_partition,
        infer_sharding_from_operands=forward_infer,
        sharding_rule=_sharding_rule(plan, False),
    )
    backward_call = custom_partitioning(jax.jit(gradients(whole)))
    backward_call.def_partition(
        partition=backward_partition,
        infer_sharding_from_operands=backward_infer,
        sharding_rule=_sharding_rule(plan, True),
    )

    forward_call = _vmapped_as(forward_call, forward)
    backward_call = _vmapped_as(backward_call, jax.jit(gradients(whole)))

    @jax.custom_vjp
    def attend(*args):
        return forward_call(*args)

    def attend_fwd(*args):
        return forward_call(*args), args

    def attend_bwd(args, ct):
        grads = backward_call(*args, *(ct if plan.call.return_lse else (ct,)))
        cotangents = [None] * n_args
        for i, g in zip(wrt, grads):
            cotangents[i] = g
        return tuple(cotangents)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(*args)


def _vmapped_as(partitioned: Callable, whole: Callable) -> Callable:
    """partitioned (a custom_partitioning call), which under jax.vmap runs `whole` (the same call unsplit) vmapped:
    custom_partitioning has no batching rule, and a vmapped call (jax.vmap of the attention, or of a jitted program
    holding it) hides the batch axis the rule would split. The kernels are vmapped as before the split."""
    wrapped = jax.custom_batching.custom_vmap(partitioned)

    @wrapped.def_vmap
    def rule(axis_size, in_batched, *args):
        out = jax.vmap(whole, in_axes=tuple(0 if b else None for b in in_batched), axis_size=axis_size)(*args)
        return out, jax.tree.map(lambda _: True, out)

    return wrapped
