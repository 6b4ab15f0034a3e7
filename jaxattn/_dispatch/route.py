"""attend(): the route a call takes to the implementation that computes it.

A named implementation is its registry entry: an XLA engine runs as it is; a fused kernel runs (on each device's
shard over a mesh) or raises ValueError naming the option it cannot express. implementation=None builds a
per-platform switch at lowering time (jax.lax.platform_dependent): on CUDA and TPU the first entry tried there
(registry.tried_on) that expresses the call, does not decline it and (over a mesh) splits it; on CPU, ROCm and
any other platform, and where no kernel takes the call, the XLA engines (blockwise or dense, use_blockwise).

A call no kernel can express never builds the switch, so its program is exactly the XLA engine's; nor does any
call traced on a CPU host unless inside cross_platform_lowering() (exporting for an accelerator from a CPU
machine), which keeps CPU tracing as cheap as before; on a GPU or TPU host it holds that host's kernel (and the
XLA engines for every other platform).
"""

from __future__ import annotations

from typing import Callable, Optional

from jax import lax

from .. import _mesh
from .._core import checks
from .._core.call import AttentionCall
from . import platforms, registry
from .registry import Implementation


def attend(
    call: AttentionCall,
    query,
    key,
    value,
    *,
    xla: Optional[Callable] = None,
    implementation=None,
    interpret=False,
    checked: bool = False,
):
    """The result of `implementation` for `call`, the one place `implementation` and `interpret` are checked
    (registry.check_implementation), unless the caller did (checked=True: a position scheme that reads
    implementation before it routes). xla(): the caller's XLA engines for the same call (a position scheme's
    terms), in place of the registry's dense and blockwise entries; None (default): those entries."""
    if not checked:
        registry.check_implementation(implementation, interpret)
    named = None if implementation is None else registry.REGISTRY[implementation]

    def engines():
        if xla is not None:
            return xla()
        return registry.xla_engine(implementation, call, query, key).attention(call, query, key, value, False)

    # on a mesh a kernel runs on each device's shard (jaxattn._mesh): an Explicit mesh says how the inputs split
    # (split); Auto axes name only the mesh (auto), the split being the partitioner's
    reads_mesh = named is None or named.reads_mesh
    split = _mesh.split_of(call, query, key, value) if reads_mesh else None
    auto = _mesh.auto_mesh_of(query, key, value) if split is None and reads_mesh else None
    declared = None if auto is None else _mesh.layout_split(query, key, auto)  # the caller's own layout
    if declared is not None:
        split, auto = declared, None
    if named is not None and not named.fused:
        return engines()
    if named is not None:
        kernel_call = named.receives(call, query, key)
        refused = named.unsupported(kernel_call, query, key, value, interpret)
        on_mesh = refused is None and (split is not None or auto is not None)
        if on_mesh:
            refused = _mesh_refusal(kernel_call, query, key, split, interpret)
        if refused is not None:
            checks.fail(
                refused,
                f"not in use with implementation={implementation!r}, which cannot express it"
                + (" on a mesh" if on_mesh else "")
                + " (implementation=None falls back to the XLA engines)",
                "in use",
            )
        return _on_shards(named, kernel_call, query, key, value, split, auto, interpret)
    branches = {}
    for platform in platforms.switch_platforms():
        for entry in registry.tried_on(platform):
            kernel_call = entry.receives(call, query, key)
            if _takes(entry, kernel_call, query, key, value, split, auto):
                branches[platform] = lambda e=entry, c=kernel_call: _on_shards(e, c, query, key, value, split, auto)
                break
    if not branches:
        return engines()
    return lax.platform_dependent(cpu=engines, default=engines, **branches)


def _takes(entry: Implementation, call: AttentionCall, query, key, value, split, auto) -> bool:
    """Whether implementation=None takes `entry` for `call` (as it receives it): it expresses the call, does not
    decline it, and splits it over the mesh where there is one."""
    return (
        entry.unsupported(call, query, key, value, False) is None
        and entry.declined(call, query, key, value) is None
        and (split is None and auto is None or _mesh_refusal(call, query, key, split) is None)
    )


def _mesh_refusal(call: AttentionCall, query, key, split, interpret=False) -> Optional[str]:
    """The option a kernel call on a mesh cannot split (jaxattn._mesh): by the Explicit split where there is one,
    else on Auto axes."""
    if split is not None:
        return _mesh.mesh_refusal(call, query, key, split, interpret)
    return _mesh.auto_refusal(call, query, key, interpret)


def _on_shards(entry: Implementation, call: AttentionCall, query, key, value, split, auto, interpret=False):
    """The entry's attention(call, query, key, value, interpret) on each device's shard: by `split` over an
    Explicit mesh, by the partitioner's split over the Auto mesh `auto` (jaxattn._mesh), else on the whole
    arrays (one device)."""
    attend = lambda c, q, k, v: entry.attention(c, q, k, v, interpret)  # noqa: E731
    if split is not None:
        return _mesh.on_mesh(attend, call, query, key, value, split)
    if auto is not None:
        return _mesh.on_auto_mesh(attend, call, query, key, value)
    return entry.attention(call, query, key, value, interpret)
