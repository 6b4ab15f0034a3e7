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
once runs its `quick` rows: one row chosen per kind of case (crosscheck.cases.common; mostly jit, one compiled
program); a case that names none runs its float64 jit row (its first row if it has no such row).

The default run (`python -m crosscheck`, no --case), the quick proof, runs once each the cases registered with
`default_run=True`: a sample chosen to show in about a minute every seed, float32 and float64, jit, vmap and
plain rows, each reference (torch's modules, torchref, HF's attention) and one whole model. `--case '*'` runs
every case once; `--all` every row of every case.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import importlib
import importlib.util
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from crosscheck._compare import TRANSFORMS, Report, compare

__all__ = ["CASES", "DTYPES", "Case", "Row", "Setup", "catalogue", "register_case", "run_case", "select_cases"]

DTYPES = ("float32", "float64")
Row = tuple[str, str]  # (dtype, transform)

# Modules whose import registers the core cases, in --list order; the other crosscheck.cases modules follow.
_BUILTIN_MODULES = ("crosscheck.cases.seeds", "crosscheck.cases.torch_nn", "crosscheck.cases.relative")


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything `compare` needs for one case (see crosscheck._compare for the calling convention)."""

    jax_fn: Callable[..., Any]
    torch_fn: Callable[..., Any]
    inputs: Mapping[str, Any]
    params: Mapping[str, Any] | None = None
    torch_params: Mapping[str, Any] | None = None
    grads_from_torch: Callable[[dict[str, Any]], Any] | None = None

    def compare(self, *, dtype: str, transform: str = "plain", name: str = "", **kwargs: Any) -> Report:
        return compare(self.jax_fn, self.torch_fn, self.inputs, dtype=dtype, transform=transform,
                       params=self.params, torch_params=self.torch_params,
                       grads_from_torch=self.grads_from_torch, name=name, **kwargs)


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

    def rows(self, dtypes: Iterable[str] = DTYPES, transforms: Iterable[str] = TRANSFORMS, *,
             every: bool = True) -> list[Row]:
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


def register_case(name: str, *, description: str | None = None, dtypes: Iterable[str] = DTYPES,
                  transforms: Iterable[str] = TRANSFORMS, quick: Iterable[Row] = (), note: str = "",
                  requires: Iterable[str] = (), default_run: bool = False,
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
        case = Case(name, build, doc, tuple(dtypes), tuple(transforms), note, tuple(map(tuple, quick)),
                    default_run)
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


def catalogue() -> dict[str, Case]:
    """Every registered case: importing each crosscheck.cases module registers its cases (once)."""
    for module in _case_modules():
        importlib.import_module(module)
    return CASES


def select_cases(patterns: Iterable[str] | None = None) -> list[Case]:
    """Cases whose name matches any glob in `patterns` (all when None/empty), in catalogue order."""
    cases = catalogue()
    patterns = list(patterns or [])
    if not patterns:
        return list(cases.values())
    unmatched = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in cases)]
    if unmatched:
        raise KeyError(f"no case matches {unmatched}; known cases: {', '.join(cases)}")
    return [c for n, c in cases.items() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def run_case(case: Case | str, *, dtype: str, transform: str, **kwargs: Any) -> Report:
    """One table row. An exception (a broken case, a missing dependency) becomes a failing report."""
    case = catalogue()[case] if isinstance(case, str) else case
    started = time.perf_counter()
    try:
        return case.setup().compare(dtype=dtype, transform=transform, name=case.name, **kwargs)
    except Exception as error:  # noqa: BLE001 - every failure must land in the table, not abort the run
        where = traceback.extract_tb(error.__traceback__)[-1]
        problem = f"{type(error).__name__}: {error} (at {where.filename}:{where.lineno})"
        return Report(case.name, dtype, transform, (), (problem,), time.perf_counter() - started)
