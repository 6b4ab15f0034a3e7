"""`python -m crosscheck`: run the catalogue (or a weights file) in JAX and torch and print one row per run.

The default run is the quick proof: the catalogue's `default_run` sample of cases, each once on its quick row
(every seed, float32 and float64, jit, vmap and plain rows, one whole model; about a minute). `--case '*'` runs
every case once; `--all` runs every row of every case (CI does).
`python -m crosscheck certify ...` is crosscheck.certify's command (crosscheck/_cli/certify_cli.py).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import math
import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from crosscheck._cli.jax_setup import configure_jax
from crosscheck._comparison.compare import TOLERANCES, TRANSFORMS, Report
from crosscheck.catalogue import DTYPES, UNAVAILABLE, Case, Row, all_cases, run_case, select_cases

# XLA compiles (not arithmetic) are the cost of a run, and they use one core each: cases run side by side.
DEFAULT_JOBS = max(1, min(4, os.cpu_count() or 1))


def default_cache_dir() -> Path:
    """JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/crosscheck/xla (~/.cache/crosscheck/xla)."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return Path(os.environ["JAX_COMPILATION_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "crosscheck" / "xla"


def _positive(text: str) -> int:
    """argparse type: an integer >= 1 (0 workers or 0 heads mean nothing; argparse says so, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


# The options of "checking a real checkpoint": each means something only with --weights.
_WEIGHTS_ONLY = ("num_heads", "num_kv_heads", "head_dim", "value_head_dim", "add_zero_attn")
# Options that select or report a catalogue run: --list ignores them, --weights replaces --case.
_RUN_ONLY = ("case", "all", "dtype", "transform", "json", "weights", "jobs", "model", "plot", "train", *_WEIGHTS_ONLY)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m crosscheck",
        description="Check that jaxattn reproduces PyTorch attention: outputs and gradients, float32 and "
        "float64, plain / jit / vmap. By default a sample of the cases runs once each (the quick proof); "
        "--case '*' runs every case once; --all runs every row of every case. "
        "Exits 1 if any row fails, 2 on a usage error. `python -m crosscheck certify --help`: certify any "
        "JAX port of a PyTorch model (crosscheck.certify).",
    )
    p.add_argument(
        "--case",
        action="append",
        metavar="NAME",
        help="case name or glob (repeatable); default: the quick proof's sample (with --all: every case)",
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="every row of each case (its dtypes x transforms); default: each case's quick rows, every case once",
    )
    p.add_argument(
        "--dtype",
        action="append",
        choices=DTYPES,
        help="only rows in this dtype (repeatable); a case with no quick row left runs its first one",
    )
    p.add_argument(
        "--transform", action="append", choices=TRANSFORMS, help="only rows under this transform (repeatable), likewise"
    )
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write the results as JSON to PATH, or to stdout (instead of the table) without PATH",
    )
    p.add_argument("--list", action="store_true", help="list the cases and exit")
    p.add_argument(
        "--cache-dir", metavar="DIR", help=f"JAX's persistent compilation cache (default: {default_cache_dir()})"
    )
    p.add_argument("--no-cache", action="store_true", help="compile everything afresh, cache nothing")
    p.add_argument(
        "--jobs",
        type=_positive,
        metavar="N",
        help=f"worker processes, one case at a time each (default {DEFAULT_JOBS}: the CPUs, at most 4)",
    )
    p.add_argument(
        "--model",
        metavar="DIR",
        help="a save_pretrained directory: transformers vs jaxattn.models, "
        "layer by layer (exit 1 names the first divergent layer)",
    )
    p.add_argument("--plot", metavar="FILE.png", help="with --model: draw error against depth (needs matplotlib)")
    t = p.add_argument_group("training parity (these options need --model DIR --train STEPS; optax)")
    t.add_argument(
        "--train",
        type=_positive,
        metavar="STEPS",
        help="train DIR for STEPS steps in torch and in JAX "
        "(optax) on seeded random batches and compare every step (exit 1 names the first divergent step)",
    )
    t.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), help="with --train (default adamw)")
    t.add_argument("--lr", type=float, metavar="LR", help="with --train: peak learning rate (default 1e-3)")
    w = p.add_argument_group("checking a real checkpoint (these options need --weights)")
    w.add_argument(
        "--weights",
        metavar="FILE",
        help="a state_dict (.safetensors/.pt/.pth/.bin) of "
        "torch.nn.MultiheadAttention or a torchref module, run against jaxattn on random inputs",
    )
    w.add_argument(
        "--num-heads", type=_positive, metavar="N", help="query heads (required: a state_dict does not record them)"
    )
    w.add_argument("--num-kv-heads", type=_positive, metavar="K", help="key/value heads (torchref modules; default N)")
    w.add_argument("--head-dim", type=_positive, metavar="H", help="query/key head dim (default: rows / heads)")
    w.add_argument("--value-head-dim", type=_positive, metavar="HV", help="value head dim (default: H)")
    w.add_argument(
        "--add-zero-attn",
        action="store_true",
        help="the torch.nn.MultiheadAttention was built with add_zero_attn=True (not in its state_dict)",
    )
    return p


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every option either takes effect or is refused (exit 2): nothing is silently ignored."""

    def given(dests):
        return [_flag(d) for d in dests if getattr(args, d) not in (None, False)]

    if args.list and given(_RUN_ONLY):
        parser.error(f"--list lists the cases and runs nothing: drop {', '.join(given(_RUN_ONLY))}")
    if args.no_cache and args.cache_dir is not None:
        parser.error("--no-cache and --cache-dir contradict each other: give one")
    if args.weights is None and given(_WEIGHTS_ONLY):
        parser.error(f"{', '.join(given(_WEIGHTS_ONLY))} describe a checkpoint: they need --weights FILE")
    if args.weights is not None:
        if args.num_heads is None:
            parser.error("--weights needs --num-heads: a state_dict does not record the number of heads")
        if args.num_kv_heads is not None and args.num_heads % args.num_kv_heads:
            parser.error(f"--num-kv-heads {args.num_kv_heads} must divide --num-heads {args.num_heads}")
        if args.case or args.all:
            parser.error(
                f"--weights runs every row of that file's module, not catalogue cases: drop "
                f"{', '.join(given(('case', 'all')))}"
            )
        if args.jobs is not None:
            parser.error("--weights runs one case in this process: drop --jobs")
    if args.plot is not None and args.model is None:
        parser.error("--plot draws the report of --model DIR: it needs --model")
    catalogue_only = ("case", "all", "transform", "weights", "jobs", *_WEIGHTS_ONLY)
    if args.model is not None and given(catalogue_only):
        parser.error(f"--model compares one checkpoint layer by layer: drop {', '.join(given(catalogue_only))}")
    if args.train is None and given(("optimizer", "lr")):
        parser.error(f"{', '.join(given(('optimizer', 'lr')))} configure a training run: they need --train STEPS")
    if args.train is not None and args.model is None:
        parser.error("--train trains a checkpoint: it needs --model DIR")
    if args.cache_dir is None and not args.no_cache:
        args.cache_dir = str(default_cache_dir())
    if args.jobs is None:
        args.jobs = DEFAULT_JOBS


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["certify"]:  # a subcommand with its own options (crosscheck._cli.certify_cli)
        from crosscheck._cli.certify_cli import main as certify_main

        return certify_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    cache_dir = None if args.no_cache else args.cache_dir
    configure_jax(cache_dir)
    if args.list:
        return _list()
    if args.train is not None:
        from crosscheck._cli.train_report_cli import main as train_main

        return train_main(
            args.model,
            steps=args.train,
            optimizer=args.optimizer or "adamw",
            lr=1e-3 if args.lr is None else args.lr,
            dtypes=args.dtype,
            plot_path=args.plot,
            json_path=args.json,
        )
    if args.model is not None:
        from crosscheck._cli.layer_report_cli import main as model_main

        return model_main(args.model, dtypes=args.dtype, plot_path=args.plot, json_path=args.json)
    try:
        cases = [_weights_case(args)] if args.weights else select_cases(args.case)
        everything = cases
        if not (args.weights or args.case or args.all):  # the quick proof: its sample of the catalogue
            cases = [c for c in cases if c.default_run]
    except (KeyError, ValueError, OSError) as error:
        print(f"python -m crosscheck: error: {error.args[0] if error.args else error}", file=sys.stderr)
        return 2
    dtypes = tuple(dict.fromkeys(args.dtype or DTYPES))
    transforms = tuple(dict.fromkeys(args.transform or TRANSFORMS))
    every = args.all or args.weights is not None  # a checkpoint is one case: all of its rows
    work = [(c, c.rows(dtypes, transforms, every=every)) for c in cases]
    _print_notes(cases)
    started = time.perf_counter()
    reports = _run(work, jobs=1 if args.weights else args.jobs, cache_dir=cache_dir)
    seconds = time.perf_counter() - started
    failed = [r for r in reports if not r.passed]
    left = sum(len(c.rows(dtypes, transforms)) for c in everything) - len(reports)
    if args.json is not None:
        text = json.dumps(_json(reports, seconds, every=every, left=left), indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    if args.json != "-":
        _print_table(reports, seconds)
        if left:  # a quick run: say what it was and what --all adds
            sample = "" if len(cases) == len(everything) else f" ({len(cases)} of {len(everything)} cases)"
            cost = "" if args.case else f" ({FULL_RUN})"
            print(f"quick run, each case once{sample}: {seconds:.0f}s; --all runs {left} more rows{cost}")
        _print_unavailable()
    return 1 if failed or not reports else 0


# What `--all` costs for the whole catalogue against the quick run, as measured in CPU time side by side
# (docs/performance.md, "The main job"); printed after a default run, so that the reader knows before starting
# one. A ratio, not seconds: it holds on a faster or busier machine too.
FULL_RUN = "a full run takes about 40x the CPU time of this one cold, 20x warm: docs/performance.md"


def _print_notes(cases: list[Case]) -> None:
    """Each distinct note of the selected cases (e.g. what their reference is), once per run, on stderr."""
    for note in dict.fromkeys(c.note for c in cases if c.note):
        print(f"note: {note}", file=sys.stderr, flush=True)


def _print_unavailable() -> None:
    if UNAVAILABLE:
        needs = sorted({m for missing in UNAVAILABLE.values() for m in missing})
        print(
            f"not run ({len(UNAVAILABLE)} cases need {', '.join(needs)}): {', '.join(UNAVAILABLE)}; "
            f'pip install -e ".[models]" to include them'
        )


def _list() -> int:
    from rich.console import Console
    from rich.table import Table

    table = Table("case", "run once", "default", "description", box=None, pad_edge=False)
    for case in all_cases().values():
        table.add_row(
            case.name,
            ", ".join(f"{d} {t}" for d, t in case.rows(every=False)),
            "yes" if case.default_run else "",
            case.description,
        )
    Console(width=_width()).print(table)
    _print_unavailable()
    return 0


def _weights_case(args: argparse.Namespace) -> Case:
    from crosscheck.cases.weights import weights_setup

    path = Path(args.weights)
    setup, what = weights_setup(
        path,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        value_head_dim=args.value_head_dim,
        add_zero_attn=args.add_zero_attn,
    )
    return Case(f"weights:{path.name}", lambda: setup, what)


# --- running ------------------------------------------------------------------------------------------------


def _run_one_case(case: Case | str, rows) -> list[Report]:
    shared: dict = {}  # the rows of one case share torch's runs on identical numbers (plain and jit)
    return [run_case(case, dtype=d, transform=t, reference_cache=shared) for d, t in rows]


def _run(work: list[tuple[Case, list[Row]]], *, jobs: int, cache_dir: str | None) -> list[Report]:
    with _progress(sum(len(rows) for _, rows in work)) as advance:
        if jobs <= 1 or len(work) <= 1:
            results = []
            for case, rows in work:
                results += _run_one_case(case, rows)
                advance(len(rows), case.name)
            return results
        # Workers take the next case as they finish one, so neither idles while the other still holds a
        # fixed slice of heavy cases. Compiled programs still travel between them through the persistent
        # compilation cache on disk (eager ops included), when it is on.
        # spawn, not fork: a forked JAX/XLA runtime is not safe. Cases travel by name and are rebuilt there.
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(
            min(jobs, len(work)), mp_context=ctx, initializer=configure_jax, initargs=(cache_dir,)
        ) as pool:
            futures = {pool.submit(_run_one_case, c.name, rows): (c, rows) for c, rows in work}
            for done in concurrent.futures.as_completed(futures):
                case, rows = futures[done]
                advance(len(rows), case.name)
            return [r for f in futures for r in f.result()]


@contextlib.contextmanager
def _progress(total: int):
    """A transient progress bar on stderr when it is a terminal; otherwise one plain line per finished case
    (CI logs, pipes), on stderr so that `--json` on stdout stays pure JSON."""
    if not sys.stderr.isatty():
        started, done = time.perf_counter(), [0]

        def line(rows: int, name: str) -> None:
            done[0] += rows
            print(
                f"[{done[0]}/{total} rows, {time.perf_counter() - started:.0f}s] {name}: {rows} rows done",
                file=sys.stderr,
                flush=True,
            )

        yield line
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("crosscheck", total=total)
        yield lambda rows, name: progress.update(task, advance=rows, description=name)


# --- reporting ----------------------------------------------------------------------------------------------


def _width() -> int | None:
    return None if sys.stdout.isatty() else 132


def _fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.2e}"


def _worst_text(worst: dict[str, Any]) -> str:
    """e.g. "worst 0.73 of tolerance (flex_softcap jit output: 7.30e-07 / tol 1e-06)"."""
    what = worst["kind"] if worst["name"] == worst["kind"] else f"{worst['kind']} {worst['name']}"
    return (
        f"worst {worst['share_of_tolerance']:.2g} of tolerance ({worst['case']} {worst['transform']} {what}: "
        f"{_fmt(worst['normwise'])} / tol {worst['tolerance']:.0e})"
    )


def _share(m) -> float:
    """A metric's error as a share of its own tolerance (1 = at the bar; a non-finite error counts as inf)."""
    return math.inf if math.isnan(m.normwise) else m.normwise / m.tolerance


def _worst_metric(rows: list[Report]) -> dict[str, Any] | None:
    """The metric nearest its own tolerance among `rows`: rows carry their own bars (a whole model's float32
    bar is 1e-5, not 1e-6), so the worst is measured in shares of each row's bar, and named."""
    found = [(r, m) for r in rows for m in r.metrics]
    if not found:
        return None
    r, m = max(found, key=lambda rm: _share(rm[1]))
    return {
        "share_of_tolerance": _share(m),
        "case": r.name,
        "transform": r.transform,
        "kind": m.kind,
        "name": m.name,
        "normwise": m.normwise,
        "tolerance": m.tolerance,
    }


def _summary(reports: list[Report], seconds: float) -> dict[str, Any]:
    by_dtype = {}
    for dtype in dict.fromkeys(r.dtype for r in reports):
        rows = [r for r in reports if r.dtype == dtype]
        worst = {
            k: max((r.worst(k) for r in rows if not math.isnan(r.worst(k))), default=math.nan)
            for k in ("output", "grad")
        }
        by_dtype[dtype] = {
            "rows": len(rows),
            "worst_output": worst["output"],
            "worst_grad": worst["grad"],
            "worst": _worst_metric(rows),
        }
    return {
        "rows": len(reports),
        "passed": sum(r.passed for r in reports),
        "failed": sum(not r.passed for r in reports),
        "seconds": round(seconds, 2),
        "by_dtype": by_dtype,
    }


def _finite(tree: Any) -> Any:
    """JSON has no nan/inf: strings keep them visible (as Report.to_dict does)."""
    if isinstance(tree, dict):
        return {k: _finite(v) for k, v in tree.items()}
    return str(tree) if isinstance(tree, float) and not math.isfinite(tree) else tree


def _json(reports: list[Report], seconds: float, *, every: bool, left: int) -> dict[str, Any]:
    import jax
    import torch

    return {
        "passed": bool(reports) and all(r.passed for r in reports),
        "selection": {"rows": "all" if every else "quick", "rows_run": len(reports), "rows_not_run": left},
        "summary": _finite(_summary(reports, seconds)),
        "tolerances": {d: {"output": t.forward, "grad": t.grad} for d, t in TOLERANCES.items()},
        "versions": {"python": platform.python_version(), "jax": jax.__version__, "torch": torch.__version__},
        "rows": [r.to_dict() for r in reports],
    }


def _print_table(reports: list[Report], seconds: float) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=_width())
    table = Table(title="jaxattn vs torch: normwise relative error ||jax - torch|| / ||torch||")
    for column, justify in (
        ("case", "left"),
        ("dtype", "left"),
        ("transform", "left"),
        ("outputs", "right"),
        ("gradients", "right"),
        ("max abs", "right"),
        ("time", "right"),
        ("result", "left"),
    ):
        table.add_column(column, justify=justify, no_wrap=True)
    for r in reports:
        result = "[green]pass[/]" if r.passed else "[bold red]FAIL[/]"
        table.add_row(
            r.name,
            r.dtype,
            r.transform,
            _fmt(r.worst("output")),
            _fmt(r.worst("grad")),
            _fmt(r.max_abs),
            f"{r.seconds:.1f}s",
            result,
        )
    console.print(table)
    for r in reports:
        if not r.passed:
            console.print(str(r), markup=False, highlight=False)
    s = _summary(reports, seconds)
    parts = [f"{d}: {_worst_text(v['worst'])}" for d, v in s["by_dtype"].items() if v["worst"] is not None]
    verdict = "[green]all passed[/]" if s["failed"] == 0 and s["rows"] else f"[bold red]{s['failed']} FAILED[/]"
    console.print(f"{s['rows']} rows, {s['passed']} passed, {verdict} in {seconds:.1f}s; " + "; ".join(parts))
