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
    venv = "python3 -m venv .venv && . .venv/bin/activate && pip install -c constraints.txt"  # the tested versions
    assert commands == [
        f'{venv} -e ".[models]" && python -m crosscheck',
        f'{venv} -e ".[test]" && python -m pytest -q',
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
    from crosscheck._cli.certify_cli import _parser as certify_parser
    from crosscheck._cli.main import _parser

    pages = [README, *DOCS]
    commands = [m for p in pages for m in re.findall(r"python -m crosscheck([^`\n#]*)", p.read_text())]
    assert len(commands) >= 5
    for tail in commands:
        args = [a.strip("'") for a in re.findall(r"'[^']*'|\S+", tail)]
        certify_parser().parse_args(args[1:]) if args[:1] == ["certify"] else _parser().parse_args(args)


# The contract lives in the repository, in docs/design.md; code cites a section of it as `docs/design.md,
# "<heading>"` and pages link it as `design.md#<anchor>`. The former home outside the repository is named here
# in two pieces so that this file does not cite it itself.
FORMER_CONTRACT = "DESIGN" + ".md"
CITING = ("jaxattn", "torchref", "crosscheck", "tests", "docs", "examples", "benchmarks")


def cited_headings(text: str) -> list[str]:
    """The headings cited as `docs/design.md, "<heading>"`, also where the citation wraps across lines (of a
    docstring or of `#` comments)."""
    flat = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text)
    return re.findall(r'docs/design\.md, "([^"]+)"', flat)


def anchor(heading: str) -> str:
    """The anchor mkdocs gives a heading (python-markdown's toc slugify): punctuation dropped, lower case,
    runs of spaces and hyphens as one hyphen."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def test_the_contract_is_cited_inside_the_repository():
    root = README.parent
    design = (root / "docs" / "design.md").read_text()
    headings = {line.lstrip("#").strip() for line in design.splitlines() if re.match(r"#{2,3} ", line)}
    assert {"Axis letters", "Semantics", "Tolerances", "Layering rules", "How to add a kernel"} <= headings
    files = [README] + [
        p for d in CITING for p in sorted((root / d).rglob("*")) if p.suffix in (".py", ".md") and p.is_file()
    ]
    citations = []
    for path in files:
        text = path.read_text()
        assert FORMER_CONTRACT not in text, f"{path.relative_to(root)} cites {FORMER_CONTRACT}: cite docs/design.md"
        if path.name != pathlib.Path(__file__).name:  # this file's own examples are not citations
            citations += [(path.name, h) for h in cited_headings(text) if h != "<heading>"]
        if path.parent.name == "docs":
            citations += [(path.name, a) for a in re.findall(r"\(design\.md#([\w-]+)\)", text)]
    assert len(citations) >= 30  # the citations were found, so the check below checked something
    anchors = {anchor(h) for h in headings}
    unknown = [(name, c) for name, c in citations if c not in headings and c not in anchors]
    assert unknown == [], f"citations of docs/design.md naming no heading of it: {unknown}"


def test_citation_reader_on_wrapped_citations():
    assert cited_headings('x (docs/design.md, "Rows with no\n    allowed key") y') == ["Rows with no allowed key"]
    assert cited_headings('# as in docs/design.md,\n# "Axis letters".') == ["Axis letters"]
    assert anchor("How a call's options travel") == "how-a-calls-options-travel"
    assert anchor("The main job: `python -m crosscheck`") == "the-main-job-python-m-crosscheck"
