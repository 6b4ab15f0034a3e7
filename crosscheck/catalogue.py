"""The catalogue of named comparisons that `python -m crosscheck` runs.

A case is a builder: a function that returns a `Setup` (the JAX function, the torch function, seeded inputs
and parameters). Builders make every number from a fixed seed: no network, no files. Register one with

    @register_case("my_case")
    def _my_case() -> Setup:
        '''One line shown by --list.'''
        ...

in a module of the package `crosscheck.cases` (one module per kind: `crosscheck/cases/<kind>.py`): the
catalogue imports every module there (the core ones first, in `_BUILTIN_MODULES` order, then the others by
name). Each case runs in every dtype of `DTYPES` under every transform of `TRANSFORMS` unless it says
otherwise. A case registered from anywhere else (a test, a user's script) joins the catalogue the same way.

Rows: a case's rows are its dtypes x its transforms; `python -m crosscheck --all` runs them all. A case run
once runs its `quick` rows: one row chosen per kind of case (FLOAT32_JIT, ... below; mostly jit, one compiled
program); a case that names none runs its float64 jit row (its first row if it has no such row).

The default run (`python -m crosscheck`, no --case), the quick proof, runs once each the cases registered with
`default_run=True`: a sample chosen to show in about a minute every seed, float32 and float64, jit, vmap and
plain rows, each reference (torch's modules, torchref, HF's attention) and one whole model. `--case '*'` runs
every case once; `--all` every row of every case.

This module is crosscheck's public surface for case authors: the registry (CASES, register_case, all_cases,
select_cases, run_case), what a builder returns (Setup, ModelSetup for whole models; Const marks an input
that is neither differentiated nor vmapped), and the seeded helpers the built-in cases share (rng_for, normal,
randomize, torch_params, functional, blocked, to_numpy_tree).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib
import importlib.util
import time
import traceback
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from crosscheck._comparison.compare import MODEL_TOLERANCES, TRANSFORMS, Const as Const, Report, compare

__all__ = [
    "CASES",
    "DTYPES",
    "FLOAT32_JIT",
    "FLOAT32_MODEL_TOLERANCE",
    "FLOAT32_VMAP",
    "FLOAT64_PLAIN",
    "UNAVAILABLE",
    "Case",
    "Const",
    "ModelSetup",
    "Row",
    "Setup",
    "all_cases",
    "blocked",
    "functional",
    "normal",
    "randomize",
    "register_case",
    "rng_for",
    "run_case",
    "select_cases",
    "to_numpy_tree",
    "torch_params",
]

DTYPES = ("float32", "float64")
Row = tuple[str, str]  # (dtype, transform)

# Modules whose import registers the core cases, in --list order; the other crosscheck.cases modules follow.
_BUILTIN_MODULES = ("crosscheck.cases.seeds", "crosscheck.cases.torch_nn", "crosscheck.cases.relative")


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything `compare` needs for one case (see crosscheck._comparison.compare for the calling convention)."""

    jax_fn: Callable[..., Any]
    torch_fn: Callable[..., Any]
    inputs: Mapping[str, Any]
    params: Mapping[str, Any] | None = None
    torch_params: Mapping[str, Any] | None = None
    grads_from_torch: Callable[[dict[str, Any]], Any] | None = None

    def compare(self, *, dtype: str, transform: str = "plain", name: str = "", **kwargs: Any) -> Report:
        return compare(
            self.jax_fn,
            self.torch_fn,
            self.inputs,
            dtype=dtype,
            transform=transform,
            params=self.params,
            torch_params=self.torch_params,
            grads_from_torch=self.grads_from_torch,
            name=name,
            **kwargs,
        )


# float32 bar for a whole model (crosscheck._comparison.compare.MODEL_TOLERANCES says why)
FLOAT32_MODEL_TOLERANCE = MODEL_TOLERANCES["float32"]


@dataclasses.dataclass(frozen=True)
class ModelSetup(Setup):
    """A Setup whose float32 rows use the whole-model bar (FLOAT32_MODEL_TOLERANCE); float64 keeps 1e-12."""

    def compare(self, *, dtype: str, **kwargs: Any) -> Report:
        if dtype == "float32":
            kwargs.setdefault("tolerance", FLOAT32_MODEL_TOLERANCE)
        return super().compare(dtype=dtype, **kwargs)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], Setup]
    description: str = ""
    dtypes: tuple[str, ...] = DTYPES
    transforms: tuple[str, ...] = TRANSFORMS
    note: str = ""  # said once per run by the CLI when the case is selected (e.g. what its reference is)
    quick: tuple[Row, ...] = ()  # the rows of a run that takes the case once; () means _default_quick's
    default_run: bool = False  # one of the cases `python -m crosscheck` runs with no --case

    def setup(self) -> Setup:
        return _built(self)

    def rows(
        self, dtypes: Iterable[str] = DTYPES, transforms: Iterable[str] = TRANSFORMS, *, every: bool = True
    ) -> list[Row]:
        """This case's rows within `dtypes` x `transforms`, in catalogue order: every one, or (every=False)
        its quick rows; when the selection leaves none of those, its first row that remains, so that a
        selected case always runs."""
        selected = [(d, t) for d in self.dtypes if d in dtypes for t in self.transforms if t in transforms]
        if every:
            return selected
        return [row for row in selected if row in (self.quick or _default_quick(self))] or selected[:1]


def _default_quick(case: Case) -> tuple[Row, ...]:
    rows = case.rows()
    return (("float64", "jit"),) if ("float64", "jit") in rows else tuple(rows[:1])


@functools.cache
def _built(case: Case) -> Setup:
    # built once per process: every dtype/transform row of a case shares the same numbers
    return case.build()


CASES: dict[str, Case] = {}
# Cases left out because an optional package is missing: name -> the packages it needs. Reported by the
# CLI, so a smaller install runs what it can and says what it did not run (never a failing row).
UNAVAILABLE: dict[str, tuple[str, ...]] = {}


def register_case(
    name: str,
    *,
    description: str | None = None,
    dtypes: Iterable[str] = DTYPES,
    transforms: Iterable[str] = TRANSFORMS,
    quick: Iterable[Row] = (),
    note: str = "",
    requires: Iterable[str] = (),
    default_run: bool = False,
) -> Callable[[Callable[[], Setup]], Callable[[], Setup]]:
    """Decorator adding a builder to the catalogue; the description defaults to its docstring's first line.

    `quick`: the (dtype, transform) rows run when the case runs once (default: the float64 jit row).
    `default_run`: the case is in `python -m crosscheck`'s default run (the quick proof). `note`: a line
    the CLI prints once per run when the case is selected. `requires`: importable names the case needs
    beyond torch (e.g. "transformers"); when one is missing the case is listed in UNAVAILABLE instead of
    the catalogue.
    """

    def add(build: Callable[[], Setup]) -> Callable[[], Setup]:
        missing = tuple(m for m in requires if importlib.util.find_spec(m) is None)
        if missing:
            UNAVAILABLE[name] = missing
            return build
        if name in CASES:
            raise ValueError(f"register_case: a case named {name!r} is already registered")
        doc = description if description is not None else (build.__doc__ or "").strip().split("\n")[0]
        case = Case(name, build, doc, tuple(dtypes), tuple(transforms), note, tuple(map(tuple, quick)), default_run)
        outside = [row for row in case.quick if row not in case.rows()]
        if outside:
            raise ValueError(f"register_case: quick rows {outside} of {name!r} are not among its rows {case.rows()}")
        CASES[name] = case
        return build

    return add


def _case_modules() -> list[str]:
    package = Path(__file__).parent / "cases"
    found = sorted(f"crosscheck.cases.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__")
    return [*_BUILTIN_MODULES, *(m for m in found if m not in _BUILTIN_MODULES)]


def all_cases() -> dict[str, Case]:
    """Every registered case: importing each crosscheck.cases module registers its cases (once)."""
    for module in _case_modules():
        importlib.import_module(module)
    return CASES


def select_cases(patterns: Iterable[str] | None = None) -> list[Case]:
    """Cases whose name matches any glob in `patterns` (all when None/empty), in catalogue order."""
    cases = all_cases()
    patterns = list(patterns or [])
    if not patterns:
        return list(cases.values())
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in cases)]
    if unmatched:
        raise KeyError(f"no case matches {unmatched}; known cases: {', '.join(cases)}")
    return [c for n, c in cases.items() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def run_case(case: Case | str, *, dtype: str, transform: str, **kwargs: Any) -> Report:
    """One table row. An exception (a broken case, a missing dependency) becomes a failing report."""
    case = all_cases()[case] if isinstance(case, str) else case
    started = time.perf_counter()
    try:
        return case.setup().compare(dtype=dtype, transform=transform, name=case.name, **kwargs)
    except Exception as error:  # noqa: BLE001 - every failure must land in the table, not abort the run
        where = traceback.extract_tb(error.__traceback__)[-1]
        problem = f"{type(error).__name__}: {error} (at {where.filename}:{where.lineno})"
        return Report(case.name, dtype, transform, (), (problem,), time.perf_counter() - started)


# --- what the built-in cases share: seeded numbers and torch modules, the rows a case runs once ----------


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


# HF attention modules as cases (crosscheck.cases.positions, .windows): their weights by weight-table rows.
def linear_heads():
    """nn.Linear [N*H, E] -> kernel [E, N, H]; [E, N*H] -> [N, H, E]."""
    from jaxattn.models.weights import Reshape, Steps, Transpose

    return Steps(Transpose(), Reshape())


def fill_from_hf(rows: list, dims: dict, state: dict) -> dict:
    """HF flat {name: array} -> jaxattn tree (exactly the rows' names, every shape checked against dims)."""
    from jaxattn.models import weights

    return weights.fill({k: np.asarray(v) for k, v in state.items()}, rows, dims, {k: "HF module" for k in state})


def hf_module_setup(module, table: list, dims: dict, jax_fn, torch_fn, inputs, fixed=()) -> Setup:
    """Setup with jax params from the table (its letters' sizes: dims). `fixed` names are held constant (not
    differentiated) on both sides: key biases without RoPE, whose gradient is identically zero (q . b_k is
    constant along each softmax row), so both frameworks return roundoff noise that no relative error can
    compare."""
    state = torch_params(module)
    consts = {name: state.pop(name) for name in fixed}
    jax_consts = fill_from_hf([r for r in table if r.name in fixed], dims, consts)
    table = [r for r in table if r.name not in fixed]

    def jax_with_consts(p, **kw):
        dtype = next(iter(kw.values())).dtype
        merged = {k: dict(v) if isinstance(v, dict) else v for k, v in p.items()}
        for entry, leaves in jax_consts.items():
            merged.setdefault(entry, {}).update({k: np.asarray(a, dtype) for k, a in leaves.items()})
        return jax_fn(merged, **kw)

    def torch_with_consts(p, **kw):
        import torch

        dtype = next(iter(kw.values())).dtype
        return torch_fn({**p, **{n: torch.from_numpy(a).to(dtype) for n, a in consts.items()}}, **kw)

    return Setup(
        jax_with_consts,
        torch_with_consts,
        inputs,
        params=fill_from_hf(table, dims, state),
        torch_params=state,
        grads_from_torch=lambda grads: fill_from_hf(table, dims, grads),
    )


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
