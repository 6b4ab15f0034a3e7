"""The one way a kernel here assembles its pallas_call: operands by name ({name: (array or ShapeDtypeStruct,
BlockSpec)}), bound back into the kernel body's typed refs (refs.bind), on a GPU's grid or a TPU's (scalars
prefetched into SMEM, VMEM scratch)."""

from __future__ import annotations

from typing import Callable, Optional

from jax.experimental import pallas as pl

from .refs import bind


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
