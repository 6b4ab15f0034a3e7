"""pyproject.toml states ranges, constraints.txt the exact versions tested, .ci/lowest.txt the lowest bounds.

A library's extras that pin one version (torch==2.13.0) make `pip install "jaxattn[torch]"` replace a user's
own torch; the pins belong in constraints.txt, which the README's commands and .ci/run pass to pip. Each lower
bound is one the project passes with: .ci/run's lowest job installs .ci/lowest.txt and runs the default group,
so that file must pin exactly the bounds pyproject.toml states.
"""

import re
import tomllib
from pathlib import Path

import pytest

packaging = pytest.importorskip("packaging")
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def requirements() -> list[Requirement]:
    """Every requirement of pyproject.toml: the core's and every extra's (references to our own extras left out)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return [Requirement(r) for r in listed if canonicalize_name(Requirement(r).name) != "jaxattn"]


def pins(path: Path) -> dict[str, Version]:
    """name -> version of a constraints file's `name==version` lines (comments and blank lines skipped)."""
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)", line)
        assert match, f"{path.name}: expected name==version, got {line!r}"
        name = canonicalize_name(match.group(1))
        assert name not in found, f"{path.name}: {name} pinned twice"
        found[name] = Version(match.group(2))
    return found


def lower_bound(requirement: Requirement) -> Version | None:
    bounds = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
    return max(bounds) if bounds else None


def test_no_extra_pins_one_version():
    # A range keeps a user's torch (a CUDA build, 2.14) that is in it; ==/=== would replace it
    for requirement in requirements():
        operators = {s.operator for s in requirement.specifier}
        assert not operators & {"==", "==="}, (
            f"pyproject.toml: {requirement} pins one version; pin it in constraints.txt"
        )
        assert ">=" in operators, f"pyproject.toml: {requirement} states no lower bound for the lowest job to test"


def test_torch_range_keeps_the_neighbouring_releases():
    # The cases: a user's 2.13 CPU or CUDA build and 2.14 stay; the tested pin is inside the range
    (torch,) = [r for r in requirements() if r.name == "torch"]
    for kept in ["2.13.0", "2.13.0+cpu", "2.13.0+cu128", "2.14.1", "2.15.0"]:
        assert torch.specifier.contains(kept), f"{torch} would replace a user's torch {kept}"
    assert not torch.specifier.contains("2.12.1")  # below the lowest version tested (.ci/lowest.txt)


def test_every_pin_of_constraints_is_inside_the_ranges():
    tested = pins(ROOT / "constraints.txt")
    for requirement in requirements():
        name = canonicalize_name(requirement.name)
        assert name in tested, f"constraints.txt does not pin {name} ({requirement})"
        assert requirement.specifier.contains(tested[name]), (
            f"constraints.txt: {name}=={tested[name]} not in {requirement}"
        )
    # torch's pin takes the machines' local CPU wheel (2.13.0+cpu): a pin without a local label matches it
    assert tested["torch"] == Version("2.13.0") and not tested["torch"].local


def test_lowest_pins_are_exactly_the_lower_bounds():
    lowest = pins(ROOT / ".ci" / "lowest.txt")
    bounds: dict[str, Version] = {}
    for requirement in requirements():
        name, bound = canonicalize_name(requirement.name), lower_bound(requirement)
        if bound is not None:
            bounds[name] = max(bound, bounds.get(name, bound))  # jaxtyping is in two extras
    for name, bound in bounds.items():
        assert name in lowest, f".ci/lowest.txt does not pin {name} (pyproject.toml's bound: >={bound})"
        assert lowest[name] == bound, f".ci/lowest.txt pins {name}=={lowest[name]}, pyproject.toml's bound is {bound}"
    # jaxlib is not ours to require (jax pins its own), but must be jax's version for the pin to resolve
    assert set(lowest) - set(bounds) == {"jaxlib"} and lowest["jaxlib"] == lowest["jax"]


def test_readme_and_ci_install_with_the_constraints():
    readme = (ROOT / "README.md").read_text()
    installs = re.findall(r"pip install [^\n`&#]*", readme.split("## Quick start", 1)[1].split("\n## ", 1)[0])
    assert len(installs) == 2 and all("-c constraints.txt" in c for c in installs), installs
    ci = (ROOT / ".ci" / "run").read_text()
    for line in ci.splitlines():
        if re.search(r"pip install\b", line) and not line.lstrip().startswith("#"):
            assert re.search(r"-c (\S*/)?constraints\.txt|-c \S*lowest\.txt", line), (
                f".ci/run installs without pins: {line}"
            )
    assert "-c .ci/lowest.txt" in ci
