"""The README's Python examples run as written (they are the first thing a new user copies)."""

import pathlib
import re
import subprocess
import sys


README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


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


def test_readme_examples_run_in_order(tmp_path):
    # A fresh interpreter, as a user has it: JAX's defaults (no x64), nothing imported by the test suite.
    script = tmp_path / "readme_examples.py"
    script.write_text("\n".join(BLOCKS))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          cwd=README.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[[0 1 2 3 4]" in done.stdout
