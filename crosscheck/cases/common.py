"""Small helpers shared by the built-in cases: seeded numbers, torch modules with seeded weights, the
whole-model bar."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from crosscheck._catalogue import Setup
from crosscheck._compare import MODEL_TOLERANCES, Report

# float32 bar for a whole model (crosscheck._compare.MODEL_TOLERANCES says why)
FLOAT32_MODEL_TOLERANCE = MODEL_TOLERANCES["float32"]


@dataclasses.dataclass(frozen=True)
class ModelSetup(Setup):
    """A Setup whose float32 rows use the whole-model bar (FLOAT32_MODEL_TOLERANCE); float64 keeps 1e-12."""

    def compare(self, *, dtype: str, **kwargs: Any) -> Report:
        if dtype == "float32":
            kwargs.setdefault("tolerance", FLOAT32_MODEL_TOLERANCE)
        return super().compare(dtype=dtype, **kwargs)


def rng_for(name: str) -> np.random.Generator:
    """A generator seeded by the case name: every case has its own, fixed numbers."""
    return np.random.default_rng(zlib.crc32(name.encode()))


def normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return rng.standard_normal(shape) * scale


def randomize(module, rng: np.random.Generator):
    """Overwrite every parameter from `rng` (weights ~ N(0, 1/fan_in), the rest ~ N(0, 0.5^2)), in float64.

    torch's own initialisers would tie the numbers to torch's global RNG; these depend on the seed only.
    """
    import torch

    module.to(torch.float64)
    with torch.no_grad():
        for _, p in module.named_parameters():
            scale = p.shape[-1] ** -0.5 if p.ndim == 2 else 0.5
            p.copy_(torch.from_numpy(normal(rng, tuple(p.shape), scale)))
    return module


def torch_params(module) -> dict[str, np.ndarray]:
    """The module's parameters by state_dict name, as numpy (the tensors torch differentiates)."""
    return {name: p.detach().numpy().copy() for name, p in module.named_parameters()}


def to_numpy_tree(tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {k: to_numpy_tree(v) for k, v in tree.items()}
    return np.asarray(tree)


def functional(module, *args_names: str, **call_kwargs: Any):
    """torch_fn(params, **inputs) running `module` with `params` swapped in (torch.func.functional_call)."""
    import torch

    def torch_fn(params, **inputs):
        args = tuple(inputs[n] for n in args_names)
        return torch.func.functional_call(module, params, args, call_kwargs)

    return torch_fn


def blocked(rng: np.random.Generator, shape: tuple[int, ...], p: float = 0.3) -> np.ndarray:
    """Random bool "blocked" mask (True with probability p) that leaves every row some key: key 0 is open.

    A fully blocked row is NaN in torch and zeros in jaxattn by design, so it is no place for a comparison.
    """
    mask = rng.random(shape) < p
    mask[..., 0] = False
    return mask



# The rows of a case run once (`quick=` of register_case; `--all` runs every row), mostly under
# jit (one compiled program). The default run (`default_run=`) takes a sample of the cases: every seed, one
# case of each reference (nn.MultiheadAttention, SDPA, torchref's relative forms, torch's flex, an HF
# position module, a whole HF model), so that it shows float32 and float64, plain, jit and vmap in a minute.
# float64 where the reference is torchref or a seed's own code (the sharpest bar), float32 where it is torch's
# or HF's own modules, as users run them; vmap and plain on families whose rows cost least so
# (docs/performance.md, "The main job").
FLOAT32_JIT = (("float32", "jit"),)
FLOAT32_VMAP = (("float32", "vmap"),)
FLOAT64_PLAIN = (("float64", "plain"),)
