"""The kernels on a mesh: each device runs the kernel on its own shard of the batch and the heads.

XLA cannot partition a Pallas kernel: Mosaic refuses ("Mosaic kernels cannot be automatically partitioned"), and
a Triton call has no sharding rule, so XLA gathers q, k and v around it and runs the whole call on every
device. Attention is independent per batch entry and per head, so a call splits exactly along those dims:
every device runs the kernel, unchanged, on its batch rows and its query heads (and the key/value heads they
read), inside `jax.shard_map` over the axes that split them, and the output leaves split the same way. Nothing
is gathered, and each device holds its share of the output and of the kernel's temporaries.

How a call is split is read from the inputs' types: under an Explicit mesh (`jax.set_mesh` over
`AxisType.Explicit` axes) every array carries its PartitionSpec. Auto axes carry none at trace time; there the
kernel is not split here (docs/design.md, "Kernels on a mesh").

    query [...,T,N,H]   batch dims and N as the query is split; T and H must not be split
    key / value         batch dims as the query's; K with N where it divides the head split, else each device
                        takes the key/value heads its query heads read (below)
    side inputs         lengths, positions and segment ids with the batch; sinks with the batch and heads
    score_mod/mask_mod  called with the global batch and head indices (b, n): a shard's indices plus its offset
    out [...,T,N,Hv], lse [...,N,T]: split as the query

A query or key split along its sequence (T / S) is refused by name: the sequence-parallel call is
`ring_attention`, and a kernel would otherwise need every device to hold the whole sequence.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec

from ._core import checks
from ._core.call import INDEX_ARRAYS, AttentionCall
from ._core.placement import explicit_spec

# The options a split call carries to each shard (the rest are refused on a mesh: MESH_REFUSED).
SPLIT_ARRAYS = (*INDEX_ARRAYS, "sinks")
# Options whose arrays no rule here splits yet: implementation=None keeps the XLA engines for them on an
# Explicit mesh, a named kernel refuses them by name.
MESH_REFUSED = ("block_mask", "key_table", "value_table", "position_bias", "rel_key", "rel_value", "row_tables")


def _entries(x) -> Optional[tuple]:
    """x's spec, one entry a dim (None: replicated), or None when x's type carries no sharding."""
    spec = explicit_spec(x)
    if spec is None:
        return None
    return tuple(spec) + (None,) * (np.ndim(x) - len(spec))


def _axes(entry) -> tuple:
    """The mesh axes of one spec entry: None, a name or a tuple of names."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class Split:
    """How one call splits over an Explicit mesh: the batch dims' entries (the query's) and the heads'."""

    batch: tuple  # one spec entry per query batch dim
    heads: object  # the spec entry of the query's N
    head_shards: int  # the number of devices the heads are split over
    mesh: object  # the abstract mesh of the inputs' types

    def spec(self, batch_dims, *rest) -> PartitionSpec:
        """The PartitionSpec of an array whose leading `batch_dims` (a tuple of sizes) align with the query's
        batch dims from the right (size 1: broadcast, replicated), followed by `rest` entries."""
        batch = self.batch[len(self.batch) - len(batch_dims) :] if batch_dims else ()
        return PartitionSpec(*(e if size != 1 else None for e, size in zip(batch, batch_dims)), *rest)


def split_of(call: AttentionCall, query, key, value) -> Optional[Split]:
    """The Split of a call whose inputs carry Explicit shardings (None: no mesh in their types, or nothing
    split); ValueError naming the input whose sequence or head dim is split."""
    specs = {name: _entries(x) for name, x in (("query", query), ("key", key), ("value", value))}
    if all(spec is None for spec in specs.values()):
        return None
    for name, spec in specs.items():
        if spec is None:
            continue
        seq = spec[-3]
        if seq is not None:
            checks.fail(
                name,
                f"its sequence dim ({'T' if name == 'query' else 'S'}) not split over a mesh: a kernel needs every "
                f"query's keys on one device; split the sequence with jaxattn.ring_attention(..., "
                f"sequence_axis={seq!r})",
                f"split over {seq!r} ({PartitionSpec(*spec)})",
            )
        if spec[-1] is not None:
            checks.fail(name, "its head dim not split over a mesh", f"split over {spec[-1]!r} ({PartitionSpec(*spec)})")
    q_spec = specs["query"] or (None,) * np.ndim(query)
    batch, heads = q_spec[:-3], q_spec[-2]
    if not any(batch) and heads is None and not any(any(s[:-3]) or s[-2] for s in specs.values() if s is not None):
        return None
    mesh = jax.typeof(query).sharding.mesh if specs["query"] is not None else None
    if mesh is None:
        mesh = next(jax.typeof(x).sharding.mesh for x, s in zip((key, value), (specs["key"], specs["value"])) if s)
    shards = math.prod(mesh.shape[a] for a in _axes(heads))
    return Split(tuple(batch), heads, shards, mesh)


def mesh_refusal(call: AttentionCall, query, split: Split, interpret=False) -> Optional[str]:
    """The first option in use that no rule here splits over a mesh (None: the call splits).

    A score_mod / mask_mod that reads the batch index b (the batch split) or the head index n (the heads split)
    sees a shard's indices plus its offset, an array it then closes over: Pallas' interpreter takes that, a
    compiled kernel (Triton, Mosaic) does not index an array from a mod, so there it is refused."""
    refused = next((name for name in MESH_REFUSED if name in call.in_use()), None)
    if refused is not None or interpret:
        return refused
    batch_split, heads_split = any(split.batch), split.heads is not None
    for name in ("score_mod", "mask_mod"):
        mod = getattr(call, name)
        if mod is not None:
            reads_b, reads_n = _reads_indices(mod, name == "score_mod", query)
            if (reads_b and batch_split) or (reads_n and heads_split):
                return name
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


def _batch_of(x, suffix: int) -> tuple:
    """The batch dims of a side input with `suffix` trailing non-batch dims."""
    return tuple(np.shape(x)[: np.ndim(x) - suffix])


def _index_offsets(split: Split, batch_shape, N):
    """Arrays whose shard holds the global indices of its batch entries and heads: a device reads its own
    offsets from them (lax.axis_index would need each axis by name; these follow any spec)."""
    flat = jnp.arange(math.prod(batch_shape), dtype=jnp.int32).reshape(batch_shape)
    heads = jnp.arange(N, dtype=jnp.int32)
    return (flat, split.spec(batch_shape)), (heads, PartitionSpec(split.heads))


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


def on_mesh(run: Callable, call: AttentionCall, query, key, value, split: Split):
    """run(call, query, key, value) on each device's shard of `split` (jax.shard_map), the result split as the
    query; `call` carries only options that split (mesh_refusal is None)."""
    batch_shape = tuple(np.shape(query)[:-3])
    N, K = np.shape(query)[-2], np.shape(key)[-2]
    heads_split = split.heads is not None
    kv_with_heads = heads_split and K % split.head_shards == 0
    kv_spec = lambda x: split.spec(_batch_of(x, 3), None, split.heads if kv_with_heads else None, None)  # noqa: E731

    side = {}  # name: (array, spec)
    for name in SPLIT_ARRAYS:
        x = getattr(call, name)
        if x is None:
            continue
        suffix = 0 if name == "key_value_seq_lengths" else 1  # lengths [...]; the rest [...,T|S] or [...,N]
        rest = (split.heads,) if name == "sinks" else (None,) * suffix
        side[name] = (x, split.spec(_batch_of(x, suffix), *rest))
    (batch_ids, batch_spec), (head_ids, head_spec) = _index_offsets(split, batch_shape, N)
    mods = {  # only a mod that reads b or n needs the global ones (a compiled kernel takes no other: mesh_refusal)
        name: mod
        for name in ("score_mod", "mask_mod")
        if (mod := getattr(call, name)) is not None and any(_reads_indices(mod, name == "score_mod", query))
    }
    names = tuple(side)

    def shard(q, k, v, batch_ids, head_ids, *arrays):
        if heads_split and not kv_with_heads:
            k, v = (_kv_heads(x, split, N, head_ids) for x in (k, v))
        local = dict(zip(names, arrays))
        for name, mod in mods.items():  # score_mod(score, b, n, t, s), mask_mod(b, n, t, s)
            local[name] = _global_mod(mod, batch_ids, head_ids, batch_shape, 1 if name == "score_mod" else 0)
        return run(call.replace(**local), q, k, v)

    out_spec = split.spec(batch_shape, None, split.heads, None)
    lse_spec = split.spec(batch_shape, split.heads, None)
    in_specs = (
        split.spec(batch_shape, None, split.heads, None),
        kv_spec(key),
        kv_spec(value),
        batch_spec,
        head_spec,
        *(spec for _, spec in side.values()),
    )
    # check_vma=False: a pallas_call's outputs say nothing of how they vary over the mesh axes (Pallas asks
    # for it under check_vma); every output here is split exactly as out_specs say.
    mapped = jax.shard_map(
        shard,
        mesh=split.mesh,
        in_specs=in_specs,
        out_specs=(out_spec, lse_spec) if call.return_lse else out_spec,
        check_vma=False,
    )
    args = (query, key, value, batch_ids, head_ids, *(x for x, _ in side.values()))
    # an Explicit mesh's shard_map takes each input placed as its spec says: the index arrays and side inputs
    # are made or passed replicated (a device keeps its slice, nothing moves); a key placed unlike the query
    # moves to the query's split here, in the open, where a user's profile shows it.
    return mapped(*(jax.sharding.reshard(x, spec) for x, spec in zip(args, in_specs)))
