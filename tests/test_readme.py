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


def test_readme_fits_a_screen_with_three_examples_and_two_quick_start_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert len(BLOCKS) == 3  # a function under jit/vmap, a Flax layer, from_pretrained; the rest is in docs/
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
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=README.parent)
    assert done.returncode == 0, done.stderr[-3000:]


def test_every_docs_page_is_in_the_site_and_in_the_readmes_map():
    # mkdocs --strict fails on a nav entry without its page, not on a page left out of the nav: check that here
    nav = (README.parent / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    readme = README.read_text()
    for page in DOCS:
        assert f": {page.name}" in nav, f"{page.name} is not in mkdocs.yml's nav"
        assert f"(docs/{page.name})" in readme or page.name == "index.md", f"README does not link {page.name}"


@pytest.mark.slow
@pytest.mark.parametrize("doc", [d for d in DOCS if python_blocks(d)], ids=lambda d: d.name)
def test_docs_examples_run_in_order(tmp_path, doc):
    # Each page's blocks in order, in a fresh interpreter, as a user pastes them. The sharding page asks
    # for 8 devices, which a CPU provides when told before JAX starts (the page says how).
    script = tmp_path / f"{doc.stem}_examples.py"
    script.write_text("\n".join(python_blocks(doc)))
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=README.parent,
        env=env,
        check=False,
    )
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
