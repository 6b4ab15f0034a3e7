"""The layout rules, checked on the source: no import cycle, no module using another module's private names.

Every module of jaxattn/, torchref/ and crosscheck/ is parsed with `ast` (imports inside functions
included) into one import graph between their modules. Asserted:
  * the graph has no cycle;
  * no module imports or reads another module's underscore name (`from .x import _y`, `x._y` on a module
    bound by an import); importing a package-private *module* (`from .._core import checks`) is fine;
  * inside jaxattn the private packages only import downwards (docs/design.md, "Layering rules"): _core <- _engines
    <- _kernels (and _mesh: a kernel call split over a mesh) <- _dispatch (the registry of implementations, the
    route to one) and _api (the public entry) <- _schemes
    <- _layers <- the public modules
    (linen, nnx, io, models, __init__), so no engine reaches up into a kernel or the dispatch, and no kernel
    into the dispatch; _forms (the delta rule) builds on _core alone;
  * crosscheck and torchref reach jaxattn only through its public modules; jaxattn never imports torch.
The checker itself is tested on small synthetic packages, so each rule is shown to be able to fail.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxattn", "torchref", "crosscheck")
# Every private package or module of jaxattn has its layer here (test_every_private_part_has_a_layer); the
# public modules are above them all.
LAYERS = {
    "_core": 0,
    "_engines": 1,
    "_forms": 1,
    "_kernels": 2,
    "_mesh": 2,
    "_dispatch": 3,
    "_api": 3,
    "_schemes": 4,
    "_layers": 5,
}
PUBLIC = 6
UNLAYERED = ("_version", "_atomic_files")  # leaf modules that import nothing of jaxattn's


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_sources() -> dict[str, tuple[str, bool]]:
    """{module name: (source, is_package)} for every module of PACKAGES."""
    sources = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            sources[_module_name(path)] = (path.read_text(), path.name == "__init__.py")
    return sources


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of a (possibly relative) `from ... import` source."""
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def analyse(sources: dict[str, tuple[str, bool]]):
    """(edges {module: {imported module}}, violations [str]) for `sources` (see package_sources)."""
    known = set(sources)
    edges: dict[str, set[str]] = {m: set() for m in sources}
    violations: list[str] = []
    for module, (source, is_package) in sources.items():
        bound: dict[str, str] = {}  # local name -> module it is bound to
        tree = ast.parse(source)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in known or alias.name.split(".")[0] in PACKAGES:
                        edges[module].add(alias.name) if alias.name in known else None
                        local = alias.asname or alias.name.split(".")[0]
                        bound[local] = alias.name if alias.asname else alias.name.split(".")[0]
                    _check_private_path(module, alias.name, known, violations)
            elif isinstance(node, ast.ImportFrom):
                source_module = _resolve(module, is_package, node.level, node.module)
                for alias in node.names:
                    full = f"{source_module}.{alias.name}"
                    if full in known:  # a submodule
                        edges[module].add(full)
                        bound[alias.asname or alias.name] = full
                        _check_private_path(module, full, known, violations)
                        continue
                    if source_module in known:
                        edges[module].add(source_module)
                        _check_private_path(module, source_module, known, violations)
                        if _is_private(alias.name) and source_module != module:
                            violations.append(f"{module}: from {source_module} import {alias.name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _is_private(node.attr):
                owner = _dotted(node.value, bound)
                if owner in known and f"{owner}.{node.attr}" not in known and owner != module:
                    violations.append(f"{module}: {owner}.{node.attr}")
    return edges, violations


def _dotted(node, bound) -> str | None:
    """The module an expression like `a.b.c` names, through the import bindings (None if not a module)."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _dotted(node.value, bound)
        return None if owner is None else f"{owner}.{node.attr}"
    return None


def _check_private_path(module: str, imported: str, known, violations) -> None:
    """Outside jaxattn, jaxattn is used through public modules only (no underscore in the path)."""
    if module.split(".")[0] != "jaxattn" and imported.split(".")[0] == "jaxattn":
        if any(_is_private(part) for part in imported.split(".")):
            violations.append(f"{module}: imports jaxattn's private module {imported}")


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n) :] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(edges):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.get(parts[1], PUBLIC) if len(parts) > 1 else PUBLIC


def layer_violations(edges) -> list[str]:
    return [
        f"{m} ({_layer(m)}) imports {n} ({_layer(n)})"
        for m, targets in edges.items()
        for n in targets
        if m.startswith("jaxattn") and n.startswith("jaxattn") and _layer(n) > _layer(m)
    ]


# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def graph():
    sources = package_sources()
    expected = {"jaxattn._engines.blockwise", "jaxattn._api", "jaxattn._kernels.pallas_gpu", "torchref._functional"}
    assert expected <= set(sources)
    return sources, *analyse(sources)


def test_no_import_cycle(graph):
    sources, edges, _ = graph
    assert sum(len(t) for t in edges.values()) > 50  # the graph was really built
    assert find_cycle(edges) is None, find_cycle(edges)


def test_no_module_uses_another_modules_private_names(graph):
    _, _, violations = graph
    assert violations == []


def test_private_packages_import_downwards_only(graph):
    _, edges, _ = graph
    assert layer_violations(edges) == []


def test_every_private_part_has_a_layer(graph):
    """A new private package (or a renamed one) must be placed in LAYERS, or the layering says nothing of it."""
    sources, edges, _ = graph
    private = {m.split(".")[1] for m in sources if m.startswith("jaxattn.") and _is_private(m.split(".")[1])}
    assert private - set(LAYERS) - set(UNLAYERED) == set()
    for name in UNLAYERED:
        assert not {n for n in edges[f"jaxattn.{name}"] if n.startswith("jaxattn")}, name


def test_the_dispatch_sits_above_the_kernels(graph):
    """The registry reaches the kernels (an edge the graph sees), and no kernel or engine reaches back into the
    dispatch or the public entry."""
    _, edges, _ = graph
    assert "jaxattn._kernels" in edges["jaxattn._dispatch.registry"]
    for module, targets in edges.items():
        if module.startswith(("jaxattn._kernels", "jaxattn._engines")):
            assert not {t for t in targets if t.startswith(("jaxattn._api", "jaxattn._dispatch"))}, module


def test_jaxattn_never_imports_torch(graph):
    sources, _, _ = graph
    for module, (source, _) in sources.items():
        if module.startswith("jaxattn"):
            names = [a.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import) for a in n.names]
            names += [n.module or "" for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)]
            assert not any(x == "torch" or x.startswith("torch.") for x in names), module


def test_checker_catches_each_kind_of_violation():
    """The rules above can fail: a synthetic package with one of each mistake."""
    sources = {
        "jaxattn": ("", True),
        "jaxattn._core": ("", True),
        "jaxattn._core.a": ("from . import b\n", False),
        "jaxattn._core.b": ("def f():\n    from .a import _hidden\n", False),  # cycle, inside a function
        "jaxattn._engines": ("", True),
        "jaxattn._engines.e": ("from .._core import a\nx = a._hidden\n", False),  # attribute use
        "jaxattn._core.c": ("from .._engines import e\n", False),  # upward import
        "jaxattn._kernels": ("", True),
        "jaxattn._kernels.k": ("from .. import _api\n", False),  # a kernel reaching up into the dispatch
        "jaxattn._api": ("from ._kernels import k\n", False),
        "crosscheck": ("import jaxattn._core.a\n", True),  # private module from outside
    }
    edges, violations = analyse(sources)
    assert find_cycle(edges) in (
        ["jaxattn._core.a", "jaxattn._core.b", "jaxattn._core.a"],
        ["jaxattn._core.b", "jaxattn._core.a", "jaxattn._core.b"],
    )
    assert "jaxattn._core.b: from jaxattn._core.a import _hidden" in violations
    assert "jaxattn._engines.e: jaxattn._core.a._hidden" in violations
    assert "crosscheck: imports jaxattn's private module jaxattn._core.a" in violations
    assert sorted(layer_violations(edges)) == [
        "jaxattn._core.c (0) imports jaxattn._engines.e (1)",
        "jaxattn._kernels.k (2) imports jaxattn._api (3)",
    ]
    assert find_cycle({m: t for m, t in edges.items() if m.startswith(("jaxattn._api", "jaxattn._kernels"))})
    clean = {
        "jaxattn": ("", True),
        "jaxattn.x": ("from . import y\nprint(y.public, y.__name__)\n", False),
        "jaxattn.y": ("public = 1\n", False),
    }
    edges, violations = analyse(clean)
    assert find_cycle(edges) is None and violations == [] and edges["jaxattn.x"] == {"jaxattn.y"}
