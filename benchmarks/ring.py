"""Ring attention scaling row: per-device memory and steps vs number of devices (1, 2, 4, 8).

    python -m benchmarks.ring [--seq 32768] [--out benchmarks/results/ring.json]

Runs on 8 host CPU devices (forced below, before JAX starts) and only *compiles*: the figures are XLA's
per-device buffer assignment (`compiled.memory_analysis()`), the collectives in the compiled HLO, and
the schedule's step and tile counts. Timings need real devices: 8 fake CPU devices share this machine's
cores, so their wall time says nothing about scaling, and no GPU was available when this was written.
On a GPU/TPU host, pass --time to add median step times of forward+backward.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import jaxattn  # noqa: E402
from jaxattn._engines import (
    ring as ring_engine,  # noqa: E402
    tiles,  # noqa: E402
)

MiB = 2**20


def chunk_pairs(D, causal):
    """Per device over the D ring steps: (chunk pairs computed, chunk pairs skipped: the
    blockwise engine finds no allowed key tile for them).
    A pair is one [S/(C D), S/(C D)] block of the logits; C = 2 chunks a device for the causal zigzag,
    whose diagonal step needs 3 of its 4 pairs and every other step 2 of 4, on every device alike."""
    if not causal:
        return D, 0
    if D == 1:
        return 1, 0
    return 3 + 2 * (D - 1), 4 * D - (3 + 2 * (D - 1))


def collectives(compiled):
    lines = [line for line in compiled.as_text().splitlines() if " = " in line]
    return {
        op: sum(f" {op}(" in line or f" {op}-start(" in line for line in lines)
        for op in ("collective-permute", "all-gather", "all-to-all", "all-reduce")
    }


def row(S, D, *, B, N, H, causal, backward, timed):
    mesh = Mesh(np.array(jax.devices()[:D]), ("seq",))
    x = jax.ShapeDtypeStruct(
        (B, S, N, H), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec(None, "seq", None, None))
    )

    def attend(q, k, v):
        return jaxattn.ring_attention(q, k, v, mesh=mesh, sequence_axis="seq", is_causal=causal)

    def run(q, k, v):
        if not backward:
            return attend(q, k, v)
        out, vjp = jax.vjp(attend, q, k, v)
        return vjp(out)

    start = time.perf_counter()
    compiled = jax.jit(run).lower(x, x, x).compile()
    memory = compiled.memory_analysis()
    pairs = chunk_pairs(D, causal)
    share = B * (S // D) * N * H * 4
    C = 2 if causal and D > 1 else 1
    tile = tiles.ring_tile_sizes(None, S // (C * D), S // (C * D), B * N, S // D * H)  # the default (Tb, Sb)
    key_tiles = -(-(S // (C * D)) // tile[1])
    pieces = C * ring_engine.pieces_per_chunk(key_tiles, C) if D > 1 else 1
    result = {
        "devices": D,
        "phase": "forward+backward" if backward else "forward",
        "temp_MiB_per_device": memory.temp_size_in_bytes / MiB,
        "arguments_MiB_per_device": memory.argument_size_in_bytes / MiB,
        "ring_steps": D,
        "kv_hops": D - 1,
        "dkv_hops": D if backward else 0,
        "bytes_per_step": 2 * share,
        "pieces_per_step": pieces,
        "chunk_pairs_per_device": pairs[0],
        "chunk_pairs_skipped_per_device": pairs[1],
        "tile": list(tile),
        # share of the S x S logits grid each device computes (diagonal pairs are half needed)
        "logit_fraction_per_device": (0.5 if causal else 1.0) / D,
        "compile_s": time.perf_counter() - start,
        "collectives": collectives(compiled),
    }
    if timed:
        rng = np.random.default_rng(0)
        args = [jax.device_put(jnp.asarray(rng.normal(size=x.shape), jnp.float32), x.sharding) for _ in range(3)]
        jax.block_until_ready(compiled(*args))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times.append(time.perf_counter() - t0)
        result["median_s"] = float(np.median(times))
    return result


def single_device(S, *, B, N, H, causal, backward):
    x = jax.ShapeDtypeStruct((B, S, N, H), jnp.float32)

    def attend(q, k, v):
        return jaxattn.dot_product_attention(q, k, v, is_causal=causal, implementation="blockwise")

    def run(q, k, v):
        if not backward:
            return attend(q, k, v)
        out, vjp = jax.vjp(attend, q, k, v)
        return vjp(out)

    return jax.jit(run).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes / MiB


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=8 * 4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--non-causal", action="store_true")
    parser.add_argument("--time", action="store_true", help="also time forward+backward (real devices only)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "ring.json"))
    args = parser.parse_args()
    shape = dict(B=args.batch, N=args.heads, H=args.head_dim)
    causal = not args.non_causal

    rows, reference = [], {}
    for backward in (False, True):
        phase = "forward+backward" if backward else "forward"
        reference[phase] = single_device(args.seq, causal=causal, backward=backward, **shape)
        for D in (1, 2, 4, 8):
            r = row(args.seq, D, causal=causal, backward=backward, timed=args.time, **shape)
            r["x_single_device_blockwise"] = r["temp_MiB_per_device"] / reference[phase]
            rows.append(r)

    print(
        f"ring attention, float32 [B={args.batch}, S={args.seq}, N={args.heads}, H={args.head_dim}], "
        f"{'causal (zigzag)' if causal else 'non-causal'}; single-device blockwise temp: "
        + ", ".join(f"{p} {m:.1f} MiB" for p, m in reference.items())
    )
    header = (
        f"{'phase':17} {'D':>2} {'temp MiB/dev':>12} {'x 1-dev':>7} {'steps':>5} {'kv hops':>7} "
        f"{'MiB/step':>8} {'pieces':>6} {'pairs run/skip':>14} {'logits/dev':>10} {'permutes':>8} "
        f"{'gathers':>7} {'tile':>9}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['phase']:17} {r['devices']:>2} {r['temp_MiB_per_device']:>12.1f} "
            f"{r['x_single_device_blockwise']:>7.3f} {r['ring_steps']:>5} {r['kv_hops']:>7} "
            f"{r['bytes_per_step'] / MiB:>8.1f} {r['pieces_per_step']:>6} "
            f"{r['chunk_pairs_per_device']:>7}/{r['chunk_pairs_skipped_per_device']:<6} "
            f"{r['logit_fraction_per_device']:>10.4f} {r['collectives']['collective-permute']:>8} "
            f"{r['collectives']['all-gather']:>7} {'x'.join(map(str, r['tile'])):>9}"
            + (f"  {r['median_s'] * 1e3:.1f} ms" if "median_s" in r else "")
        )

    report = {
        "command": "python -m benchmarks.ring",
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": [str(d) for d in jax.devices()],
        "shape": {"S": args.seq, **shape},
        "causal": causal,
        "timed": args.time,
        "timing_note": None
        if args.time
        else "no timings: 8 fake CPU devices share the host's cores (no GPU was available)",
        "single_device_blockwise_temp_MiB": reference,
        "rows": rows,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
