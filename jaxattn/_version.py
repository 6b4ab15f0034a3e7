"""`jaxattn.__version__`: the installed distribution's version (pyproject.toml's `version`, through the
package metadata that pip writes), so that there is one place to change it."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path


def _from_checkout() -> str:
    """A source checkout on sys.path that was never installed: pyproject.toml beside the package."""
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    try:
        found = re.search(r'^version = "([^"]+)"', pyproject.read_text(), flags=re.MULTILINE)
    except OSError:
        found = None
    return found.group(1) if found else "0+unknown"


try:
    __version__ = metadata.version("jaxattn")
except metadata.PackageNotFoundError:
    __version__ = _from_checkout()
