"""Programmable attention benchmarks (issue 11): block-sparse windows and documents, softcap, sinks, flex.

    python -m benchmarks.flex [--quick] [--rounds R] [--json FILE] [--plot FILE] [--no-torch]

Each case times its candidates interleaved round by round in one process (benchmarks/harness.py; medians,
compile time excluded) and reports the ratio to its baseline next to the issue's target. Memory rows are
XLA's compiled memory analysis (temp bytes) of forward + backward at S = 16384; nothing runs for them.
--quick divides every length by 4 (a smoke run; the targets are stated for the full sizes).
Against torch: torch.compile(flex_attention) (benchmarks/flex_torch.py builds torch's candidates) and ours,
causal / sliding window 512 / documents of 512 at S = 2048 and 8192, interleaved in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from benchmarks.harness import jax_candidate, load_average, time_rounds

F32 = jnp.float32
HERE = os.path.dirname(__file__)


def qkv(L, N=8, H=64, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return tuple(jax.random.normal(k, (1, L, N, H), F32) for k in keys)


def attend(**kw):
    return lambda q, k, v: jaxattn.dot_product_attention(q, k, v, implementation="blockwise", **kw)


def causal_mod(b, n, t, s):
    return t >= s


def cases(scale):
    """(name, target ratio, {candidate: fn}, baseline name, arrays) per case."""
    long, docs, mid = 16384 // scale, 8192 // scale, 2048 // scale
    q16 = qkv(long)
    q8 = qkv(docs)
    q2 = qkv(mid)
    doc_len = docs // 16
    segments = jnp.repeat(jnp.arange(16, dtype=jnp.int32), doc_len)[None]
    sinks = jnp.linspace(-1.0, 1.0, 8, dtype=F32)
    block_mask = jaxattn.create_block_mask(causal_mod, None, None, mid, mid)
    return [
        (
            "sliding window (512, 0) causal, T=S=%d" % long,
            0.12,
            {"full causal": attend(is_causal=True), "window": attend(is_causal=True, window=(512, 0))},
            "full causal",
            q16,
        ),
        (
            "16 packed documents of %d, S=%d" % (doc_len, docs),
            0.15,
            {
                "full": attend(),
                "segments": lambda q, k, v: jaxattn.dot_product_attention(
                    q, k, v, implementation="blockwise", query_segment_ids=segments, key_segment_ids=segments
                ),
            },
            "full",
            q8,
        ),
        (
            "logit_softcap 50, T=S=%d" % mid,
            1.3,
            {"plain": attend(), "softcap": attend(logit_softcap=50.0)},
            "plain",
            q2,
        ),
        ("sinks [N], T=S=%d" % mid, 1.05, {"plain": attend(), "sinks": attend(sinks=sinks)}, "plain", q2),
        (
            "flex causal mask_mod + create_block_mask, T=S=%d" % mid,
            1.1,
            {
                "is_causal": attend(is_causal=True),
                "flex": lambda q, k, v: jaxattn.flex_attention(q, k, v, mask_mod=causal_mod, block_mask=block_mask),
            },
            "is_causal",
            q2,
        ),
    ]


def memory_rows(scale):
    """Forward + backward XLA temp bytes at S = 16384 (// scale) for each keyword."""
    L = 16384 // scale
    shape = jax.ShapeDtypeStruct((1, L, 8, 64), F32)
    segments = jnp.repeat(jnp.arange(16, dtype=jnp.int32), L // 16)[None]
    block_mask = jaxattn.create_block_mask(causal_mod, None, None, L, L)
    variants = {
        "window (512, 0) causal": dict(is_causal=True, window=(512, 0)),
        "segments (16 docs)": dict(query_segment_ids=segments, key_segment_ids=segments),
        "chunk_size 1024 causal": dict(is_causal=True, chunk_size=1024),
        "logit_softcap": dict(logit_softcap=50.0, is_causal=True),
        "sinks": dict(sinks=jnp.zeros((8,), F32), is_causal=True),
        "flex causal + BlockMask": dict(mask_mod=causal_mod, block_mask=block_mask),
    }
    rows = {}
    for name, kw in variants.items():

        def loss(q, k, v, kw=kw):
            return jnp.sum(jaxattn.flex_attention(q, k, v, implementation="blockwise", **kw))

        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(shape, shape, shape).compile()
        rows[name] = int(compiled.memory_analysis().temp_size_in_bytes)
    return rows


def torch_rows(scale, rounds):
    """ours / torch.compile(flex_attention) per mask at S = 2048, 8192 (// scale), timed interleaved."""
    from benchmarks.flex_torch import flex_candidates

    rows = []
    for S in (2048 // scale, 8192 // scale):
        q, k, v = qkv(S)
        docs = (jnp.arange(S, dtype=jnp.int32) // 512)[None]
        ours = [
            jax_candidate("ours_causal", attend(is_causal=True), q, k, v),
            jax_candidate("ours_sliding_512", attend(is_causal=True, window=(512, 0)), q, k, v),
            jax_candidate(
                "ours_documents_512",
                lambda q, k, v: jaxattn.dot_product_attention(
                    q, k, v, implementation="blockwise", query_segment_ids=docs, key_segment_ids=docs
                ),
                q,
                k,
                v,
            ),
        ]
        theirs = flex_candidates(S)
        time_rounds(ours + theirs, rounds)
        by_name = {c.name: c for c in ours + theirs}
        for mask in ("causal", "sliding_512", "documents_512"):
            mine, torch_ = by_name[f"ours_{mask}"], by_name[f"flex_{mask}"]
            row = {
                "S": S,
                "mask": mask,
                "ours_s": mine.median_s,
                "torch_flex_s": torch_.median_s,
                "ratio": mine.median_s / torch_.median_s,
                "target": 1.0,
            }
            row["met"] = row["ratio"] <= 1.0
            rows.append(row)
            print(
                f"S={S:5d} {mask:14s} ours {1e3 * row['ours_s']:9.1f} ms  torch.compile(flex) "
                f"{1e3 * row['torch_flex_s']:9.1f} ms  ratio {row['ratio']:.2f} (target <= 1.0: "
                f"{'met' if row['met'] else 'MISSED'})",
                flush=True,
            )
        rows.append({"S": S, "mask": "sdpa_causal (torch yardstick)", "torch_s": by_name["sdpa_causal"].median_s})
    return rows


def run(scale, rounds, with_torch=True):
    results = {"machine": {"load_average": load_average(), "jax": jax.__version__, "scale": scale}, "cases": []}
    for name, target, fns, baseline, arrays in cases(scale):
        cands = [jax_candidate(label, fn, *arrays) for label, fn in fns.items()]
        time_rounds(cands, rounds)
        base = next(c for c in cands if c.name == baseline)
        row = {"case": name, "target": target, "candidates": {c.name: c.summary() for c in cands}}
        other = next(c for c in cands if c.name != baseline)
        row["ratio"] = other.median_s / base.median_s
        row["met"] = row["ratio"] <= target
        results["cases"].append(row)
        print(
            f"{name:60s} {other.name:10s} {1e3 * other.median_s:9.1f} ms  {baseline:12s} "
            f"{1e3 * base.median_s:9.1f} ms  ratio {row['ratio']:.3f} (target <= {target}: "
            f"{'met' if row['met'] else 'MISSED'})",
            flush=True,
        )
    if with_torch:
        results["vs_torch_compile_flex"] = torch_rows(scale, rounds)
    results["memory_fwd_bwd_bytes"] = memory_rows(scale)
    for name, temp in results["memory_fwd_bwd_bytes"].items():
        print(
            f"fwd+bwd temp, {name:28s} {temp / 2**20:8.1f} MiB (target < 1024 MiB: "
            f"{'met' if temp < 2**30 else 'MISSED'})",
            flush=True,
        )
    return results


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["cases"]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    y = np.arange(len(rows))
    ax.barh(y, [r["ratio"] for r in rows], color=["tab:green" if r["met"] else "tab:red" for r in rows])
    ax.scatter([r["target"] for r in rows], y, marker="|", s=400, color="black", label="target")
    ax.set_yticks(y, [r["case"] for r in rows], fontsize=7)
    ax.set_xlabel("time relative to the case's baseline (lower is better)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--no-torch", action="store_true", help="skip the torch.compile(flex_attention) rows")
    args = parser.parse_args(argv)
    scale = 4 if args.quick else 1
    results = run(scale, args.rounds or (3 if args.quick else 5), with_torch=not args.no_torch)
    suffix = "_quick" if args.quick else ""
    json_path = args.json or os.path.join(HERE, "results", f"flex{suffix}.json")
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    plot(results, args.plot or os.path.join(HERE, "results", f"flex{suffix}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
