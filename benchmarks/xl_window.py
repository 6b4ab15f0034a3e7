"""Transformer-XL over its whole span on the CPU blockwise engine: this tree against another checkout of the
library (issue 51 item 1: each tile reads only its window of table rows, not q . table[r] for every row).

    git worktree add /tmp/old <a commit before the windowed tiles>
    python -m benchmarks.xl_window --old /tmp/old [--new .] [--length 2048] [--rounds 7] [--masks causal,full]
                                   [--out benchmarks/results/xl_window.json]

The case: transformer_xl_attention(implementation="blockwise") forward+backward (gradients into q, k, v, P, u
and v), T = S = --length, max_left = T - 1 (the table spans every distance: T rows causal, 2T - 1 not), B = 1,
N = K = 8, H = 64, float32. Each tree runs in a process of its own (its jaxattn first on sys.path), which
compiles the case (XLA's temp bytes reported) and then times one call whenever the parent asks: the parent
asks the two in turn, the order alternating every round (interleaved, as benchmarks.harness.time_rounds),
and prints each one's median and old / new (--out: the figures as JSON, with the command and the load).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import numpy as np

from .harness import load_average

N, H = 8, 64
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(tree, L, causal):
    """Compile the case with tree's jaxattn, print {temp_bytes, compile_s, jaxattn}, then time one call per
    "run" line read from stdin (printing the seconds) until stdin ends."""
    sys.path.insert(0, tree)
    import jax
    import jax.numpy as jnp

    import jaxattn

    R = L if causal else 2 * L - 1

    def xl(q, k, v, P, u, w):
        return jaxattn.transformer_xl_attention(
            q, k, v, P, max_left=L - 1, pos_bias_u=u, pos_bias_v=w, is_causal=causal, implementation="blockwise"
        )

    rng = np.random.default_rng(0)
    shapes = [(1, L, N, H)] * 3 + [(R, N, H), (N, H), (N, H)]
    args = [jnp.asarray(rng.normal(size=s).astype(np.float32) * (0.1 if i >= 3 else 1.0)) for i, s in enumerate(shapes)]
    start = time.perf_counter()
    compiled = jax.jit(jax.grad(lambda *a: jnp.sum(xl(*a)), tuple(range(6)))).lower(*args).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(*args))  # the warm-up call
    temp = compiled.memory_analysis().temp_size_in_bytes
    print(json.dumps({"temp_bytes": temp, "compile_s": compile_s, "jaxattn": jaxattn.__file__}), flush=True)
    for _ in sys.stdin:
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        print(time.perf_counter() - start, flush=True)


def compare(old, new, L, causal, rounds):
    """The two trees' figures for one case, timed interleaved: a dict."""
    trees = {"old": old, "new": new}
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "benchmarks.xl_window", "--child", tree, "--length", str(L)]
            + (["--masks", "causal"] if causal else ["--masks", "full"]),
            cwd=HERE,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for name, tree in trees.items()
    }
    result = {"T": L, "S": L, "max_left": L - 1, "causal": causal, "B": 1, "N": N, "K": N, "H": H, "rounds": rounds}
    for name, proc in procs.items():
        result[name] = {**json.loads(proc.stdout.readline()), "times_s": []}
    order = list(procs)
    for r in range(rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            procs[name].stdin.write("run\n")
            procs[name].stdin.flush()
            result[name]["times_s"].append(float(procs[name].stdout.readline()))
    for name, proc in procs.items():
        proc.stdin.close()
        proc.wait()
        result[name]["median_s"] = float(np.median(result[name]["times_s"]))
    result["old_over_new"] = result["old"]["median_s"] / result["new"]["median_s"]
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", help="the other checkout's root (git worktree add /tmp/old <commit>)")
    parser.add_argument("--new", default=HERE, help="the checkout measured against it (default: this one)")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--masks", default="causal,full", help="causal, full (not causal) or both")
    parser.add_argument("--out", help="write the figures here as JSON")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args.child, args.length, args.masks == "causal")
    if not args.old:
        parser.error("--old: a checkout of the library to compare with")
    run = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.xl_window " + " ".join(argv if argv is not None else sys.argv[1:]),
        "load_average_start": load_average(),
        "points": [],
    }
    for mask in args.masks.split(","):
        r = compare(os.path.abspath(args.old), os.path.abspath(args.new), args.length, mask == "causal", args.rounds)
        run["points"].append(r)
        old, new = r["old"], r["new"]
        print(
            f"XL {mask:6s} T = S = {args.length}, max_left = {args.length - 1}, fwd+bwd: "
            f"old {old['median_s'] * 1e3:.0f} ms ({old['temp_bytes'] / 2**20:.0f} MiB temp), "
            f"new {new['median_s'] * 1e3:.0f} ms ({new['temp_bytes'] / 2**20:.0f} MiB temp), "
            f"old / new {r['old_over_new']:.2f}",
            flush=True,
        )
    run["load_average_end"] = load_average()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(run, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
