"""Issue 26 §5: the CPU engine against torch SDPA on the whole machine, both at their default threads.

    python -m benchmarks.cores [--lengths 2048,8192] [--rounds 7] [--halves] [--out benchmarks/results/cores.json]

Not pinned (benchmarks.pinned pins one core): here each framework may use every core, and the table says how
many it kept busy (process CPU time / wall time of a call). Candidates, compiled first, then timed
interleaved round by round; medians:
    jaxattn          dot_product_attention, implementation=None (the blockwise engine at these lengths)
    jaxattn halves   (--halves) the same call on two halves of the heads, concatenated: two independent engine
                     loops in one program, to see whether XLA:CPU runs independent loops on two cores (it did
                     not, 2026-11-25 and -26)
    torch SDPA       torch.nn.functional.scaled_dot_product_attention, [B,N,S,H] contiguous
B=1 N=8 H=64 float32, causal and not, forward and forward+backward (the gradient of sum(out ** 2)).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import numpy as np

B, N, H = 1, 8, 64


def _jax_candidates(causal: bool, backward: bool, halves: bool):
    import jax
    import jax.numpy as jnp

    import jaxattn

    def whole(q, k, v):
        return jaxattn.dot_product_attention(q, k, v, is_causal=causal)

    def two_halves(q, k, v):
        h = N // 2
        parts = [whole(q[:, :, i : i + h], k[:, :, i : i + h], v[:, :, i : i + h]) for i in (0, h)]
        return jnp.concatenate(parts, axis=2)

    def grad_of(f):
        return jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), argnums=(0, 1, 2))

    fns = {"jaxattn": whole, **({"jaxattn halves": two_halves} if halves else {})}
    return {name: jax.jit(grad_of(f) if backward else f) for name, f in fns.items()}


def _torch_candidate(q, k, v, causal: bool, backward: bool):
    import torch

    tq, tk, tv = (torch.from_numpy(a).transpose(1, 2).contiguous().requires_grad_(backward) for a in (q, k, v))

    def call():
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        if backward:
            (out**2).sum().backward()

    return call


def measure(S: int, causal: bool, backward: bool, rounds: int, halves: bool = False) -> dict:
    """{candidate: {"ms": median wall, "cores": median CPU / wall, "ratio": ms / torch's ms}}."""
    import jax

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, S, N, H)).astype(np.float32) for _ in range(3))
    calls = {
        name: (lambda f=f: jax.block_until_ready(f(q, k, v)))
        for name, f in _jax_candidates(causal, backward, halves).items()
    }
    calls["torch SDPA"] = _torch_candidate(q, k, v, causal, backward)
    for call in calls.values():  # compile / warm up
        call()
    times: dict[str, list] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            wall, cpu = time.perf_counter(), time.process_time()
            call()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    torch_ms = 1e3 * float(np.median([w for w, _ in times["torch SDPA"]]))
    result = {}
    for name, xs in times.items():
        ms = 1e3 * float(np.median([w for w, _ in xs]))
        result[name] = {"ms": ms, "cores": float(np.median([c / w for w, c in xs])), "ratio": ms / torch_ms}
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="2048,8192")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--halves", action="store_true", help="also the heads in two independent halves")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = []
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores")
    for S in (int(s) for s in args.lengths.split(",")):
        for causal in (True, False):
            for backward in (False, True):
                result = measure(S, causal, backward, args.rounds, args.halves)
                case = f"S={S} {'causal' if causal else 'full'} {'fwd+bwd' if backward else 'fwd'}"
                for name, r in result.items():
                    print(f"{case:26s} {name:15s} {r['ms']:9.1f} ms  {r['cores']:4.2f} cores  {r['ratio']:5.2f}x torch")
                rows.append({"case": case, **{name: r for name, r in result.items()}})
    if args.out:
        meta = {"date": datetime.date.today().isoformat(), "load_average_end": os.getloadavg()[0]}
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
