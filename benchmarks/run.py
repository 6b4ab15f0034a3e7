"""Run every benchmark comparison: `python -m benchmarks.run [--quick] [--cases a,b] [--rounds N]`.

Prints one table per case (medians, ratios to the case's reference, achieved GFLOP/s and the share of the
float32 matmul rate measured in the same run, compile time, XLA temp memory, torch peak memory), then
each target as met/missed. Writes <out>/results.json (or quick.json), results.md and sweep.png.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

from rich.console import Console
from rich.table import Table

from . import cases as cases_mod
from .harness import load_average, measure_torch_memory, time_rounds

MiB = 2**20


def machine():
    import flax
    import jax
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jax_backend": jax.default_backend(),
        "flax": flax.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def _fmt(x, spec, scale=1.0):
    return "" if x is None else format(x * scale, spec)


def case_rows(case, matmul_gflops):
    ref = next(c for c in case.candidates if c.name == case.reference).median_s
    rows = []
    for c in case.candidates:
        s = c.summary()
        gflops = s["gflops_per_s"]
        rows.append(
            {
                "candidate": c.name,
                "median ms": _fmt(c.median_s, ".1f", 1e3),
                f"x {case.reference}": _fmt(c.median_s / ref if c.median_s and ref else None, ".2f"),
                "GFLOP/s": _fmt(gflops, ".1f"),
                "% matmul": _fmt(gflops / matmul_gflops if gflops and matmul_gflops else None, ".0f", 100),
                "compile s": _fmt(c.compile_s, ".2f"),
                "XLA temp MiB": _fmt(c.temp_bytes, ".1f", 1 / MiB),
                "torch peak MiB": _fmt(c.peak_bytes, ".1f", 1 / MiB),
                "note": c.note,
            }
        )
    return rows


def target_rows(case):
    by_name = {c.name: c for c in case.candidates}
    rows = []
    for t in case.targets:
        try:
            met, measured = t.check(by_name)
        except Exception as err:  # a missing candidate or measurement is a missed target, not a crash
            met, measured = False, f"not measured ({type(err).__name__}: {err})"
        rows.append({"target": t.text, "measured": measured, "met": bool(met)})
    return rows


def print_case(console, case, rows, targets):
    table = Table(title=case.title, title_justify="left")
    for col in rows[0]:
        table.add_column(col, justify="left" if col in ("candidate", "note") else "right")
    for row in rows:
        table.add_row(*row.values())
    console.print(table)
    for t in targets:
        mark = "[green]met[/green]" if t["met"] else "[red]MISSED[/red]"
        console.print(f"  target: {t['target']}: {t['measured']} -> {mark}")


def markdown(results):
    lines = [
        f"Measured {results['date']} on {results['machine']['cpu']} ({results['machine']['cores']} cores), "
        f"jax {results['machine']['jax']}, flax {results['machine']['flax']}, "
        f"torch {results['machine']['torch']}; "
        f"load average {results['load_average_start']} at start, {results['load_average_end']} at end; "
        f"{results['rounds']} rounds; `{results['command']}`.",
        "",
    ]
    for case in results["cases"]:
        lines.append(f"**{case['title']}**")
        lines.append("")
        cols = [c for c in case["rows"][0] if c != "note"]
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "|".join("---" for _ in cols) + "|")
        for row in case["rows"]:
            lines.append("| " + " | ".join(row[c] for c in cols) + " |")
        lines.append("")
        for t in case["targets"]:
            lines.append(f"- target {t['target']}: {t['measured']}, **{'met' if t['met'] else 'missed'}**")
        lines.append("")
    return "\n".join(lines)


def plot(case, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_name = {c.name: c for c in case.candidates}
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    for index, (series, points) in enumerate(case.sweep.items()):
        style = dict(color=f"C{index}", label=series)  # one colour per series on both axes
        xs = [s for s, _ in points]
        ax_t.plot(xs, [by_name[n].median_s * 1e3 for _, n in points], "o-", **style)
        mem = [
            by_name[n].peak_bytes
            if by_name[n].peak_bytes is not None
            else (by_name[n].temp_bytes or 0) + (by_name[n].output_bytes or 0)
            for _, n in points
        ]
        if any(by_name[n].peak_bytes is not None or by_name[n].temp_bytes is not None for _, n in points):
            ax_m.plot(xs, [m / MiB for m in mem], "o-", **style)
    for ax, label in ((ax_t, "forward time (ms, median)"), (ax_m, "memory (MiB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T = S")
        ax.set_ylabel(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    ax_m.set_title("JAX: XLA temp + output; torch: peak RSS growth", fontsize=9)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes, 2 rounds: a < 1 minute smoke test")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per case (default 5, quick 2)")
    parser.add_argument("--cases", default=None, help=f"comma-separated subset of {','.join(cases_mod.ALL_CASES)}")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--no-plot", action="store_true")
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 5)
    names = args.cases.split(",") if args.cases else list(cases_mod.ALL_CASES)
    unknown = sorted(set(names) - set(cases_mod.ALL_CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}")
    if "matmul" not in names:
        names.insert(0, "matmul")  # every run measures its own ceiling

    console = Console(width=200)
    results = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python -m benchmarks.run " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quick": args.quick,
        "rounds": rounds,
        "load_average_start": load_average(),
        "cases": [],
    }
    console.print(f"[bold]jaxattn benchmarks[/bold] {results['date']} {results['machine']}")
    started = time.perf_counter()
    built = []
    for name in names:
        case = cases_mod.ALL_CASES[name](args.quick)
        if name != "matmul":
            case.candidates.append(cases_mod.ceiling_candidate(args.quick))
        time_rounds(case.candidates, case.rounds if case.rounds and not args.quick else rounds)
        specs = [c for c in case.candidates if c.torch_memory is not None]
        for cand, peak in zip(specs, measure_torch_memory([c.torch_memory for c in specs])):
            cand.peak_bytes = peak
        # "% matmul" is against the matmul timed in this case's own rounds (same load)
        matmul_gflops = max(
            c.summary()["gflops_per_s"] for c in case.candidates if c.name.startswith("(ceiling") or name == "matmul"
        )
        rows, targets = case_rows(case, matmul_gflops), target_rows(case)
        print_case(console, case, rows, targets)
        results["cases"].append(
            {
                "name": case.name,
                "title": case.title,
                "params": case.params,
                "reference": case.reference,
                "rows": rows,
                "targets": targets,
                "candidates": {c.name: c.summary() for c in case.candidates},
            }
        )
        built.append(case)
    results["load_average_end"] = load_average()
    results["total_s"] = time.perf_counter() - started
    missed = [t["target"] for c in results["cases"] for t in c["targets"] if not t["met"]]
    console.print(
        f"done in {results['total_s']:.0f} s; load average {results['load_average_end']}; "
        f"{len(missed)} target(s) missed{': ' + '; '.join(missed) if missed else ''}"
    )

    os.makedirs(args.out, exist_ok=True)
    stem = "quick" if args.quick else "results"
    with open(os.path.join(args.out, f"{stem}.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    with open(os.path.join(args.out, f"{stem}.md"), "w") as f:
        f.write(markdown(results) + "\n")
    sweep = next((c for c in built if c.sweep), None)
    if sweep is not None and not args.no_plot:
        plot(
            sweep,
            os.path.join(args.out, f"{'quick-' if args.quick else ''}sweep.png"),
            f"{sweep.title}\n{results['machine']['cpu']}, {results['date']}",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
