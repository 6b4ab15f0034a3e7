"""Tile sweep of causal blockwise attention on one pinned core (the figures behind the causal default tile):

    python -m benchmarks.tiles --length 2048 --tiles 256x256,128x128,256x128 [--backward] [--rounds 5]

B=1 N=8 H=64 float32, is_causal=True, implementation="blockwise" with each block_size (query_block x
key_block); candidates compiled, then timed interleaved (harness.time_rounds); prints process CPU-time
medians (the process is pinned to one core, so they hold up on a loaded machine).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from .harness import jax_candidate, time_rounds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--tiles", default="256x256,128x128,256x128")
    parser.add_argument("--backward", action="store_true", help="forward+backward (gradients of q, k, v)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import jax
    import jax.numpy as jnp

    import jaxattn

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, args.length, 8, 64)).astype(np.float32)) for _ in range(3))
    cands = []
    for tile in args.tiles.split(","):
        block = tuple(int(b) for b in tile.split("x"))

        def f(q, k, v, block=block):
            return jaxattn.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise", block_size=block)

        if args.backward:
            f = jax.grad(lambda q, k, v, f=f: f(q, k, v).sum(), argnums=(0, 1, 2))
        cands.append(jax_candidate(tile, f, q, k, v))
    time_rounds(cands, args.rounds)
    for c in cands:
        print(f"{'fwd+bwd' if args.backward else 'fwd'} S={args.length} tile {c.name}: {c.median_cpu_s * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
