"""CI: the installed (non-editable) wheel holds every module of the checkout and each of them imports.

Run from a directory outside the checkout, with the wheel installed in the active environment:

    python /path/to/checkout/.ci/check_wheel.py /path/to/checkout /path/to/jaxattn-*.whl

1. The wheel's file list equals the checkout's tracked package files (`git ls-files`), so a subpackage
   missing from the build (or a stale file from an old build/ directory) fails here, by name.
2. Every module found in the installed packages imports, and from site-packages, not from the checkout.
"""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGES = ("jaxattn", "torchref", "crosscheck")


def tracked_files(checkout: Path) -> set[str]:
    listed = subprocess.run(
        ["git", "-C", str(checkout), "ls-files", *PACKAGES], check=True, capture_output=True, text=True
    ).stdout.split()
    return {f for f in listed if f.endswith((".py", "py.typed"))}


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if n.split("/", 1)[0] in PACKAGES}


def all_modules() -> list[str]:
    names = []
    for top in PACKAGES:
        package = importlib.import_module(top)
        names.append(top)
        names += [
            m.name for m in pkgutil.walk_packages(package.__path__, f"{top}.") if not m.name.endswith(".__main__")
        ]
    return names


def main(checkout: Path, wheel: Path) -> int:
    expected, shipped = tracked_files(checkout), wheel_files(wheel)
    if expected != shipped:
        print(
            f"wheel {wheel.name} differs from the checkout:\n  missing: {sorted(expected - shipped)}\n"
            f"  extra: {sorted(shipped - expected)}",
            file=sys.stderr,
        )
        return 1
    checkout = checkout.resolve()
    modules = all_modules()
    for name in modules:
        module = importlib.import_module(name)
        where = Path(module.__file__).resolve()
        if where.is_relative_to(checkout):
            print(f"{name} was imported from the checkout ({where}), not from the installed wheel", file=sys.stderr)
            return 1
    public = [m for m in modules if not any(part.startswith("_") for part in m.split("."))]
    print(
        f"wheel OK: {len(shipped)} files; {len(modules)} modules import from site-packages; public: {', '.join(public)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
