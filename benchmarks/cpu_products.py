"""What the CPU engine's tiles are made of, XLA against torch: the rate of the tile products alone.

    python -m benchmarks.cpu_products [--rounds 7] [--out benchmarks/results/cpu_products.json]

The blockwise engine's time is its tile products (q k^T, p v and, backward, three more) plus a few passes
over each tile; torch SDPA's CPU kernel is the same algorithm on oneDNN / MKL products. This measures the
products alone, both frameworks at their default threads, interleaved round by round (medians): products
[M,K] x [K,N] in a loop, in the shapes the engine's tiles have (H = 64 contracted for q k^T, a key block
contracted for p v), and a 512 x 512 forward tile (both products, max, exp, sums, one head) in a loop, the
engine's inner step without its bookkeeping. GFLOP/s counts 2 M K N per product.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import numpy as np

# (batch, M, K, N): q k^T of one head's 512 x 512 tile, of 8 heads' 128 x 128 tiles (the former causal
# default), p v of a 512 x 512 tile, and the larger products of a 1024-row tile
SHAPES = ((1, 512, 64, 512), (8, 128, 64, 128), (1, 512, 512, 64), (1, 1024, 64, 1024))
TILE_STEPS = 64
STACK = 4  # operand pairs the loops cycle through


def _interleaved(calls: dict, rounds: int) -> dict:
    for call in calls.values():
        call()
    times: dict = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            wall, cpu = time.perf_counter(), time.process_time()
            call()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return {
        name: {"s": float(np.median([w for w, _ in xs])), "cores": float(np.median([c / w for w, c in xs]))}
        for name, xs in times.items()
    }


def products(rounds: int) -> list:
    """Per shape, STEPS products in a loop over a stack of R operand pairs (the engine's loop over tiles;
    the operands stay in cache): XLA in one jitted fori_loop (each product's first row feeds the carry, so
    every product runs whole), torch in a Python loop writing into one output buffer."""
    import jax
    import jax.numpy as jnp
    import torch
    from jax import lax

    rows = []
    for batch, M, K, N in SHAPES:
        steps = max(8, int(1e9 / (2 * batch * M * K * N)))  # about 1 GFLOP a call
        rng = np.random.default_rng(0)
        a = rng.standard_normal((STACK, batch, M, K)).astype(np.float32)
        b = rng.standard_normal((STACK, batch, K, N)).astype(np.float32)

        @jax.jit
        def loop(a, b, steps=steps):
            def step(i, carry):
                x = jnp.einsum("bmk,bkn->bmn", a[i % STACK], b[i % STACK])
                return carry + x[:, 0]

            return lax.fori_loop(0, steps, step, jnp.zeros((a.shape[1], b.shape[-1]), jnp.float32))

        ja, jb = jax.device_put(a), jax.device_put(b)
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        out = torch.empty((batch, M, N))

        def torch_loop(steps=steps, ta=ta, tb=tb, out=out):
            for i in range(steps):
                torch.bmm(ta[i % STACK], tb[i % STACK], out=out)

        result = _interleaved({"xla": lambda: loop(ja, jb).block_until_ready(), "torch": torch_loop}, rounds)
        flop = 2.0 * steps * batch * M * K * N
        rows.append(
            {
                "shape": f"{batch} x [{M}x{K}] x [{K}x{N}]",
                **{f"{k} GFLOP/s": flop / r["s"] / 1e9 for k, r in result.items()},
                **{f"{k} cores": r["cores"] for k, r in result.items()},
            }
        )
    return rows


def forward_tile(rounds: int) -> dict:
    """TILE_STEPS forward steps of one head's 512 x 512 tile (q k^T, row max, exp, row sum, p v; no online
    rescaling, no mask), XLA in one jitted loop and torch in a Python loop."""
    import jax
    import jax.numpy as jnp
    import torch
    from jax import lax

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((512, 64)).astype(np.float32) for _ in range(3))

    @jax.jit
    def steps(q, k, v):
        def step(i, acc):
            x = jnp.einsum("th,sh->ts", q + i * 1e-9, k) * 0.125
            p = jnp.exp(x - jnp.max(x, axis=-1, keepdims=True))
            return acc + jnp.einsum("ts,sh->th", p, v) / jnp.sum(p, axis=-1, keepdims=True)

        return lax.fori_loop(0, TILE_STEPS, step, jnp.zeros((512, 64), jnp.float32))

    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))

    def torch_steps():
        acc = torch.zeros((512, 64))
        for _ in range(TILE_STEPS):
            x = torch.mm(tq, tk.T) * 0.125
            p = torch.exp(x - x.amax(dim=-1, keepdim=True))
            acc += torch.mm(p, tv) / p.sum(dim=-1, keepdim=True)
        return acc

    jq, jk, jv = (jax.device_put(x) for x in (q, k, v))
    result = _interleaved({"xla": lambda: steps(jq, jk, jv).block_until_ready(), "torch": torch_steps}, rounds)
    return {f"{name} ms per tile": 1e3 * r["s"] / TILE_STEPS for name, r in result.items()} | {
        f"{name} cores": r["cores"] for name, r in result.items()
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores")
    rows = products(args.rounds)
    for r in rows:
        print(
            f"{r['shape']:28s} xla {r['xla GFLOP/s']:6.1f} GFLOP/s ({r['xla cores']:.2f} cores)   "
            f"torch {r['torch GFLOP/s']:6.1f} GFLOP/s ({r['torch cores']:.2f} cores)"
        )
    tile = forward_tile(args.rounds)
    print(
        f"512 x 512 forward tile: xla {tile['xla ms per tile']:.3f} ms ({tile['xla cores']:.2f} cores)   "
        f"torch {tile['torch ms per tile']:.3f} ms ({tile['torch cores']:.2f} cores)"
    )
    if args.out:
        meta = {"date": datetime.date.today().isoformat(), "load_average_end": os.getloadavg()[0]}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "products": rows, "forward_tile": tile}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
