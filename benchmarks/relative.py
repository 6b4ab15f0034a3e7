"""Each relative-position scheme on the blockwise engine against the dense engine (issue 34), on CPU.

    python -m benchmarks.relative [--rounds 3] [--lengths 2048,8192] [--max-dense-gib 6] [--max-backward 8192]
                                  [--directions fwd,fwd+bwd] [--out benchmarks/results/relative.json] [--append]

Schemes (B = 1, N = K = 8, H = 64, float32, causal, T = S): T5 (causal buckets, 32 buckets, max_distance 128),
ALiBi, Transformer-XL (position keys [S,N,H] with u and v), clipped tables (max_left 64, max_right 16, key and
value tables [R,N,H]), DeBERTa-v3's disentangled attention ("deberta": not causal, 256 buckets, c2p and p2c
tables [512,N,H]) and per-pair tables (relative_attention, A^K [T,S,1,H]: 1 GiB at 2048, so only lengths up
to --max-pairs, default 2048). Forward and forward+backward (gradients into q, k, v and every table). Each point
compiles both engines (XLA's memory analysis: temp bytes), then times them interleaved (medians of wall time);
a dense program whose temp memory exceeds --max-dense-gib is compiled for its memory figure but not run, and
so is every forward+backward beyond --max-backward. The file is written after every point; --append adds to it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

from .harness import jax_candidate, load_average, time_rounds

N, H = 8, 64
SCHEMES = ("t5", "alibi", "xl", "clipped", "deberta", "pairs")  # scheme_function's names


def scheme_function(name, implementation, **extra):
    """(function of (q, k, v, *tables), table shapes as functions of L); extra: more keywords of every call
    (interpret=True, precision, by benchmarks.device_check)."""
    import jaxattn

    common = dict(is_causal=True, implementation=implementation, **extra)
    if name == "t5":
        return (
            lambda q, k, v, t: jaxattn.t5_attention(q, k, v, t, bidirectional=False, **common),
            [lambda L: (32, N)],
        )
    if name == "alibi":
        return lambda q, k, v, s: jaxattn.alibi_attention(q, k, v, s, **common), [lambda L: (N,)]
    if name == "xl":
        return (
            lambda q, k, v, P, u, w: jaxattn.transformer_xl_attention(
                q, k, v, P, max_left=P.shape[0] - 1, pos_bias_u=u, pos_bias_v=w, **common
            ),
            [lambda L: (L, N, H), lambda L: (N, H), lambda L: (N, H)],
        )
    if name == "clipped":
        return (
            lambda q, k, v, kt, vt: jaxattn.clipped_relative_attention(
                q, k, v, kt, vt, max_left=64, max_right=16, **common
            ),
            [lambda L: (81, N, H), lambda L: (81, N, H)],
        )
    if name == "deberta":  # DeBERTa-v3's settings: an encoder (not causal), 256 buckets, c2p and p2c [512,N,H]
        return (
            lambda q, k, v, kr, qr: jaxattn.disentangled_attention(
                q,
                k,
                v,
                kr,
                qr,
                position_buckets=256,
                max_relative_positions=512,
                implementation=implementation,
                **extra,
            ),
            [lambda L: (512, N, H), lambda L: (512, N, H)],
        )
    if name == "pairs":
        return lambda q, k, v, a: jaxattn.relative_attention(q, k, v, a, **common), [lambda L: (L, L, 1, H)]
    raise ValueError(name)


def inputs(name, L, seed=0):
    """float32 (q, k, v, *the scheme's tables) at T = S = L: normal draws, the tables scaled by 0.1; ALiBi's
    slopes the geometric ones of 8 heads."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    shapes = [(1, L, N, H)] * 3 + [shape(L) for shape in scheme_function(name, None)[1]]
    args = [jnp.asarray(rng.normal(size=s).astype(np.float32) * (0.1 if i >= 3 else 1.0)) for i, s in enumerate(shapes)]
    if name == "alibi":
        args[3] = jnp.asarray(2.0 ** -np.arange(1, N + 1), jnp.float32)
    return args


def point(name, L, backward, rounds, max_dense_bytes, timed=True):
    import jax
    import jax.numpy as jnp

    args = inputs(name, L)
    cands = []
    for engine in ("blockwise", "dense"):
        f = scheme_function(name, engine)[0]
        if backward:
            f = jax.grad(lambda *a, f=f: jnp.sum(f(*a)), argnums=tuple(range(len(args))))
        cand = jax_candidate(engine, f, *args, run=False)  # compiled: its memory figure first
        if timed and (engine == "blockwise" or cand.temp_bytes <= max_dense_bytes):
            cand.run()  # the warm-up call
            cand.timed = True
        cands.append(cand)
    if any(c.timed for c in cands):
        time_rounds(cands, rounds)
    causal = name != "deberta"
    result = {"scheme": name, "T": L, "S": L, "B": 1, "N": N, "K": N, "H": H, "causal": causal, "rounds": rounds}
    result["direction"] = "fwd+bwd" if backward else "fwd"
    for c in cands:
        result[c.name] = {
            "median_s": c.median_s,
            "times_s": c.times,
            "compile_s": c.compile_s,
            "temp_bytes": c.temp_bytes,
            "run": c.timed,
        }
    return result


def markdown_table(result):
    lines = [
        "| scheme | T = S | pass | blockwise | dense | dense / blockwise | temp blockwise | temp dense |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        b, d = p["blockwise"], p["dense"]
        block_time = f"{b['median_s'] * 1e3:.0f} ms" if b["run"] else "not run"
        dense_time = f"{d['median_s'] * 1e3:.0f} ms" if d["run"] else "not run"
        ratio = f"{d['median_s'] / b['median_s']:.2f}" if d["run"] and b["run"] else ""
        lines.append(
            f"| {p['scheme']} | {p['T']} | {p['direction']} | {block_time} | {dense_time} | {ratio} "
            f"| {b['temp_bytes'] / 2**20:.0f} MiB | {d['temp_bytes'] / 2**20:.0f} MiB |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--schemes", default="t5,alibi,xl,clipped,pairs")
    parser.add_argument("--max-pairs", type=int, default=2048)
    parser.add_argument("--max-dense-gib", type=float, default=6.0)
    parser.add_argument("--max-backward", type=int, default=8192, help="longer forward+backward: memory only")
    parser.add_argument("--directions", default="fwd,fwd+bwd", help="fwd, fwd+bwd or both (comma-separated)")
    parser.add_argument("--append", action="store_true", help="add the points to those already in --out")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "relative.json"))
    parser.add_argument("--table", action="store_true", help="print the markdown table of --out (no timing)")
    args = parser.parse_args(argv)
    if args.table:
        with open(args.out) as f:
            print(markdown_table(json.load(f)))
        return 0
    run = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": "python -m benchmarks.relative " + " ".join(argv if argv is not None else sys.argv[1:]),
        "load_average_start": load_average(),
    }
    result = {"runs": [], "points": []}
    if args.append and os.path.exists(args.out):
        with open(args.out) as f:
            result = json.load(f)
    result["runs"].append(run)
    started = time.perf_counter()
    for L in (int(x) for x in args.lengths.split(",")):
        for name in args.schemes.split(","):
            if name == "pairs" and L > args.max_pairs:
                continue
            for backward in (False, True):
                if ("fwd+bwd" if backward else "fwd") not in args.directions.split(","):
                    continue
                timed = not backward or L <= args.max_backward
                p = point(name, L, backward, args.rounds, args.max_dense_gib * 2**30, timed)
                p["load_average"] = load_average()
                result["points"].append(p)
                save(result, args.out)
                b, d = p["blockwise"], p["dense"]
                block = f"{b['median_s'] * 1e3:9.1f} ms" if b["run"] else "  not run   "
                dense = f"{d['median_s'] * 1e3:9.1f} ms" if d["run"] else "  not run   "
                print(
                    f"{name:8s} L={L:5d} {p['direction']:7s} blockwise {block} "
                    f"{b['temp_bytes'] / 2**20:7.0f} MiB  dense {dense} {d['temp_bytes'] / 2**20:7.0f} MiB",
                    flush=True,
                )
    run["load_average_end"] = load_average()
    run["wall_s"] = time.perf_counter() - started
    save(result, args.out)
    print(markdown_table(result))
    return 0


def save(result, path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
