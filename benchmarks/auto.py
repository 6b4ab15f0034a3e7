"""The data behind implementation=None: dense against blockwise on a grid, and the rule's pick at each point.

    python -m benchmarks.auto [--rounds 3] [--cpu] [--max-length 8192] [--out benchmarks/results/auto.json]

Grid: T = S in 128 .. 8192 (powers of two), causal or not, with or without Shaw tables (k = 16, shared
[R,H]), multi-head (K = N = 8) or grouped-query (N = 8, K = 2); B = 1, H = 64, float32; forward at every
length, forward+backward up to --max-backward (default 2048). At each point dense and blockwise are
compiled and timed interleaved (medians of wall and process CPU time); the point records which one the
automatic rule (jaxattn's `use_blockwise`) picks and its time over the better of the two. Dense is not run
beyond --max-dense (default 4096): its [N,T,S] logits alone take 2 GiB at 8192.

--cpu pins the process to one core (and torch is not involved): process CPU time is then the figure the
ratios use, which holds up on a machine that other jobs load; without it, wall time on all cores.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import sys
import time

import numpy as np

from .harness import jax_candidate, load_average, time_rounds


def point_functions(T, N, K, H, causal, shaw, backward):
    import jax
    import jax.numpy as jnp

    import jaxattn

    max_distance = 16

    def attend(implementation):
        def f(q, k, v, tk, tv):
            if shaw:
                return jaxattn.shaw_relative_attention(
                    q, k, v, tk, tv, max_distance=max_distance, is_causal=causal, implementation=implementation
                )
            return jaxattn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)

        if not backward:
            return f
        return jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2, 3, 4) if shaw else (0, 1, 2))

    rng = np.random.default_rng(0)
    R = 2 * max_distance + 1
    args = [
        jnp.asarray(rng.normal(size=s).astype(np.float32))
        for s in ((1, T, N, H), (1, T, K, H), (1, T, K, H), (R, H), (R, H))
    ]
    return attend, args


def automatic_pick(T, N, K, H, causal, shaw):
    """What implementation=None runs at this point: "dense" or "blockwise"."""
    import jax

    from jaxattn import _api as dispatch
    from jaxattn._core.call import AttentionCall

    q = jax.ShapeDtypeStruct((1, T, N, H), np.float32)
    k = jax.ShapeDtypeStruct((1, T, K, H), np.float32)
    return "blockwise" if dispatch.use_blockwise(None, AttentionCall(is_causal=causal), q, k) else "dense"


def run_point(T, N, K, causal, shaw, backward, rounds, max_dense, H=64):
    attend, args = point_functions(T, N, K, H, causal, shaw, backward)
    cands = {"blockwise": jax_candidate("blockwise", attend("blockwise"), *args)}
    if T <= max_dense:
        cands["dense"] = jax_candidate("dense", attend("dense"), *args)
    time_rounds(list(cands.values()), rounds)
    point = {
        "T": T,
        "S": T,
        "B": 1,
        "N": N,
        "K": K,
        "H": H,
        "causal": causal,
        "shaw": shaw,
        "direction": "fwd+bwd" if backward else "fwd",
    }
    for name, c in cands.items():
        point[name] = {
            "median_s": c.median_s,
            "median_cpu_s": c.median_cpu_s,
            "times_s": c.times,
            "cpu_times_s": c.cpu_times,
            "compile_s": c.compile_s,
            "temp_bytes": c.temp_bytes,
        }
    point["pick"] = automatic_pick(T, N, K, H, causal, shaw)
    return point


def score(point, key):
    """(automatic / better of the two, better) under the median `key`; None when dense was not run."""
    if "dense" not in point:
        return None, "blockwise"
    times = {name: point[name][key] for name in ("dense", "blockwise")}
    best = min(times, key=times.get)
    return times[point["pick"]] / times[best], best


def markdown_table(result):
    """One row per (direction, T), one column per variant: dense / blockwise time (below 1: dense is
    faster), the automatic pick's letter, and its time over the better of the two."""
    key = result["ranked_by"]
    variants = sorted({(p["K"], p["causal"], p["shaw"]) for p in result["points"]}, key=lambda v: (-v[0], v[1], v[2]))
    names = [
        f"{'MHA' if K == 8 else f'GQA K={K}'}{', causal' if c else ''}{', Shaw' if s else ''}" for K, c, s in variants
    ]
    lines = ["| pass | T = S | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    rows = sorted({(p["direction"], p["T"]) for p in result["points"]}, key=lambda r: (r[0] != "fwd", r[1]))
    by = {(p["direction"], p["T"], p["K"], p["causal"], p["shaw"]): p for p in result["points"]}
    for direction, T in rows:
        cells = []
        for K, c, s in variants:
            p = by.get((direction, T, K, c, s))
            if p is None:
                cells.append("")
            elif "dense" not in p:
                cells.append(f"b {p['blockwise'][key] * 1e3:.0f} ms (dense not run)")
            else:
                ratio = p["dense"][key] / p["blockwise"][key]
                cells.append(f"{ratio:.2f} {p['pick'][0]} {p['auto_over_best']:.2f}x")
        lines.append(f"| {direction} | {T} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rescore(path):
    with open(path) as f:
        result = json.load(f)
    for point in result["points"]:
        point["pick"] = automatic_pick(point["T"], point["N"], point["K"], point["H"], point["causal"], point["shaw"])
        point["auto_over_best"], point["best"] = score(point, result["ranked_by"])
    result["worst_auto_over_best"] = max(
        p["auto_over_best"] for p in result["points"] if p["auto_over_best"] is not None
    )
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"worst automatic / best: {result['worst_auto_over_best']:.2f}x")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="one pinned core; rank by process CPU time")
    parser.add_argument("--lengths", default="128,256,512,1024,2048,4096,8192")
    parser.add_argument("--max-dense", type=int, default=4096)
    parser.add_argument("--max-backward", type=int, default=2048)
    parser.add_argument("--directions", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both (comma-separated)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "auto.json"))
    parser.add_argument("--table", action="store_true", help="print the markdown table of --out (no timing)")
    parser.add_argument(
        "--rescore", action="store_true", help="re-apply the current rule to the timings already in --out (no timing)"
    )
    args = parser.parse_args(argv)
    if args.rescore:
        return rescore(args.out)
    if args.table:
        with open(args.out) as f:
            print(markdown_table(json.load(f)))
        return 0
    if args.cpu:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    key = "median_cpu_s" if args.cpu else "median_s"
    lengths = [int(x) for x in args.lengths.split(",")]
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.auto " + " ".join(argv if argv is not None else sys.argv[1:]),
        "ranked_by": key,
        "load_average_start": load_average(),
        "points": [],
    }
    started = time.perf_counter()
    for backward, T, (N, K), causal, shaw in itertools.product(
        (False, True), lengths, ((8, 8), (8, 2)), (False, True), (False, True)
    ):
        if backward and T > args.max_backward or ("fwd+bwd" if backward else "fwd") not in args.directions.split(","):
            continue
        point = run_point(T, N, K, causal, shaw, backward, args.rounds, args.max_dense)
        ratio, best = score(point, key)
        point["auto_over_best"], point["best"] = ratio, best
        result["points"].append(point)
        times = "  ".join(f"{n} {point[n][key] * 1e3:8.2f} ms" for n in ("dense", "blockwise") if n in point)
        print(
            f"{point['direction']:7s} T={T:5d} N={N} K={K} causal={causal:d} shaw={shaw:d}  {times}  "
            f"pick {point['pick']:9s} best {best:9s} "
            f"{'' if ratio is None else f'{ratio:.2f}x'}",
            flush=True,
        )
    result["load_average_end"] = load_average()
    result["total_s"] = time.perf_counter() - started
    worst = max((p["auto_over_best"] for p in result["points"] if p["auto_over_best"] is not None), default=None)
    result["worst_auto_over_best"] = worst
    print(f"worst automatic / best: {worst:.2f}x; {result['total_s']:.0f} s; load {result['load_average_end']}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
