"""The platform and accelerator generation a program is lowered for, as implementation=None needs them:
cross_platform_lowering() (tracing on a CPU host for CUDA or TPU), the CUDA compute capability (which picks the
CUDA kernels, registry.CUDA_KERNELS_BY_GENERATION) and the TPU generation Mosaic lowers for (tpu_mesh)."""

from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import jax

from .._core import checks
from .._core.eager import register_context

_CROSS_PLATFORM = contextvars.ContextVar("jaxattn_cross_platform", default=False)
register_context(_CROSS_PLATFORM.get)  # an eager call traced inside cross_platform_lowering() is another program
_CUDA_CAPABILITY = contextvars.ContextVar("jaxattn_cuda_capability", default=None)
register_context(_CUDA_CAPABILITY.get)


# TPU generations by name: (the device kind JAX reports for the chip, TensorCores per JAX device), as libtpu's
# topologies report them (v5p's two TensorCores are one device, megacore). Mosaic reads the generation it lowers
# for (lane and sublane counts, native bfloat16: integer `//` in a kernel goes through `sign`, whose lowering
# asks) from the device of the abstract mesh in context, else from JAX's default device, which on a CPU host is
# the CPU: "Unsupported TPU device kind: cpu" (jax 0.10, pallas/mosaic/tpu_info.get_device_kind). No Pallas
# API takes it per call, and a traced input carries no device, so cross_platform_lowering(tpu_generation=)
# names it for the lowering done inside it (tpu_mesh).
TPU_GENERATIONS = {
    "v5e": ("TPU v5 lite", 1),
    "v5p": ("TPU v5", 2),
    "v6e": ("TPU v6 lite", 1),
    "7x": ("TPU7x", 1),
}


def _tpu_device(value) -> jax.sharding.AbstractDevice:
    """The TPU that tpu_generation names: a name of TPU_GENERATIONS or a TPU device (jax.devices("tpu")[0],
    a topology's device: its own device kind and core count); ValueError naming tpu_generation."""
    if isinstance(value, str) and value in TPU_GENERATIONS:
        kind, cores = TPU_GENERATIONS[value]
        return jax.sharding.AbstractDevice(device_kind=kind, num_cores=cores, platform="tpu")
    kind = getattr(value, "device_kind", None)
    if not isinstance(value, str) and getattr(value, "platform", None) == "tpu" and isinstance(kind, str):
        return jax.sharding.AbstractDevice(device_kind=kind, num_cores=getattr(value, "num_cores", 1), platform="tpu")
    checks.fail("tpu_generation", f"one of {list(TPU_GENERATIONS)} or a TPU device", repr(value))
    raise AssertionError  # checks.fail raises


def tpu_mesh(mesh: jax.sharding.AbstractMesh, tpu_generation) -> Optional[jax.sharding.AbstractMesh]:
    """The abstract mesh to lower inside so that Mosaic lowers for `tpu_generation` (TPU_GENERATIONS): `mesh`
    (the one in context; empty outside jax.set_mesh) with that TPU as its device, or None where `mesh` is over
    that TPU already. The one rule for the TPU generation of a lowering: tpu_generation, else the mesh in
    context's device, else JAX's default device (those two Mosaic reads itself). A mesh over another TPU
    contradicts tpu_generation: ValueError naming it."""
    device = _tpu_device(tpu_generation)
    own = mesh.abstract_device
    if own is not None and own.platform == "tpu":
        if own.device_kind != device.device_kind:
            checks.fail("tpu_generation", f"the mesh in context's TPU, {own.device_kind!r}", repr(device.device_kind))
        return None
    return mesh.update(abstract_device=device)


def _capability(value) -> tuple[int, int]:
    """(major, minor) from "9.0", 9.0, (9, 0) or "sm_90"; ValueError naming cuda_compute_capability."""
    text = str(value).removeprefix("sm_")
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(x, int) for x in value):
        return value
    if text.isdigit() and len(text) >= 2:
        return int(text[:-1]), int(text[-1])
    major, dot, minor = text.partition(".")
    if dot and major.isdigit() and minor.isdigit():
        return int(major), int(minor)
    checks.fail("cuda_compute_capability", 'a compute capability such as "9.0", "sm_90" or (9, 0)', repr(value))
    raise AssertionError  # checks.fail raises


@contextlib.contextmanager
def cross_platform_lowering(cuda_compute_capability=None, tpu_generation=None):
    """Within it, implementation=None builds the per-platform switch even when JAX's default backend is
    the CPU, so a program traced here and lowered for CUDA or TPU (jax.jit(f).trace(...).lower(
    lowering_platforms=("cuda",)), jax.export) carries the kernels.

    cuda_compute_capability: the GPU generation the program is for ("9.0" / "sm_90" / (9, 0)), which picks
    the CUDA kernel by CUDA_KERNELS_BY_GENERATION; None (default) takes the row for an unknown generation,
    our Pallas kernel, which lowers without a GPU's libraries (cuDNN's lowering needs the cuDNN of a CUDA
    build of jaxlib). On a GPU host the generation is the device's own.

    tpu_generation: the TPU the program is lowered for ("v5e", "v5p", "v6e", "7x", or a TPU device such as a
    jax.experimental.topologies device), which Mosaic needs where a kernel's lowering depends on it (splash
    with chunk_size, integer division in a flex mask_mod or score_mod). None (default): the device of the
    mesh in context (jax.set_mesh over TPU devices), else JAX's default device, which on a CPU host fails
    those lowerings ("Unsupported TPU device kind: cpu"). It holds for the lowering done inside the block
    (jax.jit(f).lower(...), jax.export), not for a program traced inside and lowered after it.

    Outside it, on a CPU host the switch is left out: its CPU branch is the only one a CPU lowering keeps
    (bit-identical results, same compile time), but tracing the kernel branches costs about 0.6 s per
    trace of a causal forward+backward (measured, docs/performance.md) for nothing; on a GPU or TPU host
    the switch holds that host's kernel only.
    """
    capability = None if cuda_compute_capability is None else _capability(cuda_compute_capability)
    mesh = None if tpu_generation is None else tpu_mesh(jax.sharding.get_abstract_mesh(), tpu_generation)
    token = _CROSS_PLATFORM.set(True)
    capability_token = _CUDA_CAPABILITY.set(capability)
    try:
        with contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh):
            yield
    finally:
        _CUDA_CAPABILITY.reset(capability_token)
        _CROSS_PLATFORM.reset(token)


def cuda_capability() -> Optional[tuple[int, int]]:
    """The compute capability implementation=None picks CUDA kernels for: cross_platform_lowering()'s, else the
    default device's on a GPU host, else None (unknown)."""
    if _CROSS_PLATFORM.get():
        return _CUDA_CAPABILITY.get()
    if jax.default_backend() not in ("gpu", "cuda"):
        return None
    value = getattr(jax.devices()[0], "compute_capability", None)
    return None if value is None else _capability(value)


def switch_platforms() -> tuple[str, ...]:
    """The platforms whose kernel branch implementation=None's switch gets: every one inside
    cross_platform_lowering(), else the default backend's own (a GPU host traces no TPU kernel, a CPU host none)."""
    if _CROSS_PLATFORM.get():
        return ("cuda", "tpu")
    return {"gpu": ("cuda",), "cuda": ("cuda",), "tpu": ("tpu",)}.get(jax.default_backend(), ())
