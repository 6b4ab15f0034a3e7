"""Cases of benchmarks.cases on one pinned core, ranked by process CPU time, optionally beside the engine
without row groups (the schedule before issue 13):

    python -m benchmarks.pinned --cases mha_forward_backward,causal [--rounds 5] [--ungrouped] [--out FILE]

The process is pinned to one core and torch runs one thread, so a call's CPU time is what it needs on a
core whatever else loads the machine (wall time on a loaded machine swings with the other jobs). Every
candidate of the chosen cases is compiled first, then all are timed interleaved (harness.time_rounds).
--ungrouped adds each jaxattn candidate compiled again with row groups off ("... ungrouped"): the engine
then runs every row in one tile with the all-rows tile budget, as it does for sharded inputs.
Prints each case's CPU-time medians and ratios to its reference; writes the medians to --out (JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from . import cases as cases_mod
from .harness import load_average, time_rounds


def build(names, ungrouped):
    """{case name: Case}; with ungrouped, the jaxattn candidates also compiled without row groups."""
    from jaxattn._engines.blockwise import groups  # where row_grouped looks on_a_device_mesh up

    built = {name: cases_mod.ALL_CASES[name](False) for name in names}
    if ungrouped:
        on_mesh = groups.on_a_device_mesh
        groups.on_a_device_mesh = lambda *xs: True  # the engine's own fallback: one all-rows tile
        try:
            for name in names:
                extra = [
                    c for c in cases_mod.ALL_CASES[name](False).candidates if c.name.startswith("jaxattn") and c.timed
                ]
                for c in extra:
                    c.name += " ungrouped"
                built[name].candidates.extend(extra)
        finally:
            groups.on_a_device_mesh = on_mesh
    return built


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", required=True, help=f"comma-separated subset of {','.join(cases_mod.ALL_CASES)}")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ungrouped", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import torch

    torch.set_num_threads(1)
    names = args.cases.split(",")
    built = build(names, args.ungrouped)
    everything = [c for case in built.values() for c in case.candidates]
    load = load_average()
    time_rounds(everything, args.rounds)
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.pinned " + " ".join(argv if argv is not None else sys.argv[1:]),
        "ranked_by": "median_cpu_s",
        "load_average_start": load,
        "load_average_end": load_average(),
        "cases": {},
    }
    for name, case in built.items():
        ref = next(c for c in case.candidates if c.name == case.reference).median_cpu_s
        print(f"\n{case.title} (CPU time, one core; reference {case.reference})")
        rows = {}
        for c in case.candidates:
            if not c.timed:
                continue
            rows[c.name] = {"median_cpu_s": c.median_cpu_s, "median_s": c.median_s, "cpu_times_s": c.cpu_times}
            print(f"  {c.name:45s} {c.median_cpu_s * 1e3:9.1f} ms  {c.median_cpu_s / ref:6.2f}x")
        result["cases"][name] = {"title": case.title, "reference": case.reference, "candidates": rows}
    print(f"\nload average {result['load_average_start']} -> {result['load_average_end']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
