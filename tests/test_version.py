"""`jaxattn.__version__` is pyproject.toml's version (one place to change it), also in a source checkout."""

import re
from pathlib import Path

import jaxattn
from jaxattn import _version

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def pyproject_version() -> str:
    return re.search(r'^version = "([^"]+)"', PYPROJECT.read_text(), flags=re.MULTILINE).group(1)


def test_version_is_pyprojects():
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", jaxattn.__version__)
    assert jaxattn.__version__ == pyproject_version()


def test_an_uninstalled_checkout_reads_pyproject():
    assert _version._from_checkout() == pyproject_version()
