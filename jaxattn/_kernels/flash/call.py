"""The one way a kernel here assembles its pallas_call: operands by name ({name: (array or ShapeDtypeStruct,
BlockSpec)}), bound back into the kernel body's typed refs (refs.bind), on a GPU's grid or a TPU's (scalars
prefetched into SMEM, VMEM scratch)."""

from __future__ import annotations

from typing import Callable, Optional

from jax.experimental import pallas as pl

from .refs import bind
from .tile_math import pick


def named_call(
    kernel: Callable,
    kinds: tuple,
    *,
    grid: tuple,
    inputs: dict,
    outputs: dict,
    name: str,
    interpret: bool,
    compiler_params,
    scalars: Optional[dict] = None,
    scratch: Optional[dict] = None,
    aliases: Optional[dict] = None,
):
    """pallas_call of kernel(bind(names, refs, *kinds)) over `grid`; inputs / outputs: {name: (array or
    ShapeDtypeStruct, BlockSpec)}, None inputs left out; aliases: {input name: output name}, the output starting
    as that input's values (the input only seeds it: the kernel reads the output, so the input has no name).

    scalars (a TPU grid): {name: flat int32 array}, prefetched into SMEM ahead of the inputs (index maps receive
    their refs last); scratch: {name: pltpu.VMEM / SemaphoreType}, after the outputs. None: a GPU's grid."""
    inputs = {key: value for key, value in inputs.items() if value is not None}
    scratch, aliases = scratch or {}, aliases or {}
    lead = {} if scalars is None else scalars
    names = (*lead, *(None if key in aliases else key for key in inputs), *outputs, *scratch)
    # pallas_call counts the scalar-prefetch operands among the inputs
    alias_index = {len(lead) + tuple(inputs).index(i): tuple(outputs).index(o) for i, o in aliases.items()}
    in_specs = [spec for _, spec in inputs.values()]
    out_specs = [spec for _, spec in outputs.values()]
    if scalars is None:
        grid_args = dict(grid=grid, in_specs=in_specs, out_specs=out_specs)
    else:
        from jax.experimental.pallas import tpu as pltpu  # a TPU grid spec; GPU calls never import Mosaic's API

        grid_args = dict(
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=len(scalars),
                grid=grid,
                in_specs=in_specs,
                out_specs=out_specs,
                scratch_shapes=list(scratch.values()),
            )
        )
    return pl.pallas_call(
        lambda *refs: kernel(bind(names, refs, *kinds)),
        out_shape=[shape for shape, _ in outputs.values()],
        input_output_aliases=alias_index,
        interpret=interpret,
        compiler_params=compiler_params,
        name=name,
        **grid_args,
    )(*lead.values(), *[x for x, _ in inputs.values()])


def index_inputs(side, batched: tuple, queries: tuple, keys: tuple, rows: bool = False, lengths: bool = True) -> dict:
    """The operands that say which pairs may attend, by name, each with its BlockSpec on the kernel's grid:
    positions and segment ids (and lengths unless `lengths=False`: a TPU prefetches them into SMEM), the ones
    the call has. queries / keys: (block length, index(*grid ids) -> the block's index) along the query / key
    axis; each array's batch row is the grid's first id b, or its one row 0 (config.Config.batched: (q_pos,
    k_pos, segments, lengths, schedule)). rows: the TPU layout, [B|1,1,L] read in blocks [1,L] (its blocks are
    two-dimensional; refs_tpu.Row reads them as [L]); else [B|1,L] in blocks [L]."""
    by_q, by_k, by_seg, by_len, _ = batched
    out = {}
    for name, x, on_batch, axis in (
        ("q_pos", side.q_pos, by_q, queries),
        ("k_pos", side.k_pos, by_k, keys),
        ("lengths", side.lengths if lengths else None, by_len, None),
        ("q_seg", side.q_seg, by_seg, queries),
        ("k_seg", side.k_seg, by_seg, keys),
    ):
        if x is None:
            continue
        if axis is None:  # lengths: one per batch entry
            out[name] = (x, pl.BlockSpec((None,), lambda *ids, on=on_batch: (pick(on, ids[0]),)))
        elif rows:
            length, index = axis
            block = lambda *ids, on=on_batch, at=index: (pick(on, ids[0]), 0, at(*ids))  # noqa: E731
            out[name] = (x[:, None, :], pl.BlockSpec((None, 1, length), block))
        else:
            length, index = axis
            block = lambda *ids, on=on_batch, at=index: (pick(on, ids[0]), at(*ids))  # noqa: E731
            out[name] = (x, pl.BlockSpec((None, length), block))
    return out
