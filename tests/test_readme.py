"""The README's and docs/'s Python examples run as written (they are the first thing a new user copies)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
DOCS = sorted((README.parent / "docs").glob("*.md"))


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.DOTALL)


BLOCKS = python_blocks(README)


def test_readme_has_examples_and_two_quick_start_commands():
    text = README.read_text()
    assert len(BLOCKS) >= 4
    quick = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = [line.strip() for line in quick.splitlines() if line.startswith("    ")]
    assert commands == [
        'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[models]" && python -m crosscheck',
        'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && python -m pytest -q',
    ]
    ci = (README.parent / ".ci" / "run").read_text()
    assert "python -m pytest -q" in ci


@pytest.mark.slow  # a fresh interpreter compiles every example
def test_readme_examples_run_in_order(tmp_path):
    # A fresh interpreter, as a user has it: JAX's defaults (no x64), nothing imported by the test suite.
    script = tmp_path / "readme_examples.py"
    script.write_text("\n".join(BLOCKS))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=README.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[[0 1 2 3 4]" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("doc", [d for d in DOCS if python_blocks(d)], ids=lambda d: d.name)
def test_docs_examples_run_in_order(tmp_path, doc):
    # Each page's blocks in order, in a fresh interpreter, as a user pastes them. The sharding page asks
    # for 8 devices, which a CPU provides when told before JAX starts (the page says how).
    script = tmp_path / f"{doc.stem}_examples.py"
    script.write_text("\n".join(python_blocks(doc)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=README.parent, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def test_docs_crosscheck_commands_parse():
    # Every `python -m crosscheck ...` written in README or docs is a command the CLI accepts.
    from crosscheck._certify_cli import _parser as certify_parser
    from crosscheck._cli import _parser

    pages = [README, *DOCS]
    commands = [m for p in pages for m in re.findall(r"python -m crosscheck([^`\n#]*)", p.read_text())]
    assert len(commands) >= 5
    for tail in commands:
        args = [a.strip("'") for a in re.findall(r"'[^']*'|\S+", tail)]
        certify_parser().parse_args(args[1:]) if args[:1] == ["certify"] else _parser().parse_args(args)
