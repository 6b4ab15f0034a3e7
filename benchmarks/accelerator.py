"""jaxattn on an accelerator (issue 26 §4): implementation=None against jax.nn.dot_product_attention (XLA and
cuDNN), torch SDPA (flash) and torch flex_attention compiled, on whatever device JAX's default backend is.

Cases: bf16, B=1, N=8 (K=8), H=128, causal and sliding window (W=1024: window=(W-1, 0) with is_causal);
forward and forward+backward at T = S in --sizes; decode (T=1 against a cache of S keys, causal). One
interleaved run per (case, S) (harness.time_rounds), medians, ratios against jaxattn. Memory: XLA's temp
bytes of the compiled program (JAX), torch.cuda.max_memory_allocated growth (torch). A candidate that cannot
run here (no CUDA for torch, no cuDNN, out of memory) is recorded with its reason and skipped.

    python -m benchmarks.accelerator [--sizes 1024 2048 ... 32768] [--rounds 10] [--json PATH]
    python -m benchmarks.accelerator --smoke      # tiny sizes; runs on the CPU (GPU rows skipped)

Writes benchmarks/results/accelerator_<device>.json (the device named as JAX reports it) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import re
import time

from benchmarks.harness import Candidate, jax_candidate, load_average, time_rounds

B, N, H, WINDOW = 1, 8, 128, 1024


def _device():
    import jax

    device = jax.devices()[0]
    return device.platform, getattr(device, "device_kind", device.platform)


def _inputs(T, S, seed=0):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(seed), 3)
    lengths = (T, S, S)
    return [jax.random.normal(key, (B, length, N, H), jnp.bfloat16) for key, length in zip(keys, lengths, strict=True)]


def _with_backward(attention):
    import jax
    import jax.numpy as jnp

    return jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2))


def jax_attentions(mask, window, decode=False):
    """{name: attention(q, k, v)} of the JAX candidates for this mask. decode (T = 1): also jaxattn's XLA
    engines and, on a GPU, its flash kernel without the key split, against the split-key kernel that
    implementation=None takes there (docs/kernels.md: the choice is not yet measured)."""
    import jax

    import jaxattn
    from jaxattn._core.call import AttentionCall
    from jaxattn._kernels import pallas_gpu

    win = dict(window=(window - 1, 0)) if mask == "sliding" else {}
    local = dict(local_window_size=(window - 1, 0)) if mask == "sliding" else {}
    candidates = {
        "jaxattn": lambda q, k, v: jaxattn.dot_product_attention(q, k, v, is_causal=True, **win),
        "jax.nn xla": lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla", **local
        ),
    }
    if decode:
        candidates["jaxattn xla"] = lambda q, k, v: jaxattn.dot_product_attention(
            q, k, v, is_causal=True, implementation="xla", **win
        )
    if decode and _device()[0] == "gpu":
        flash_call = AttentionCall(is_causal=True, **win)
        candidates["jaxattn flash, no key split"] = lambda q, k, v: pallas_gpu.flash_attention(flash_call, q, k, v)
    if _device()[0] == "gpu":
        candidates["jax.nn cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn", **local
        )
    return candidates


def torch_attentions(mask, window, T, S):
    """{name: attention(q, k, v)} of the torch candidates ([B,N,T,H] tensors); {} without CUDA."""
    try:
        import torch
    except ImportError:
        return {}
    if not torch.cuda.is_available():
        return {}
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    offset = S - T  # bottom-right, as ours

    def mask_mod(b, h, q, kv):
        allowed = q + offset >= kv
        return allowed & (q + offset - kv < window) if mask == "sliding" else allowed

    block_mask = create_block_mask(mask_mod, None, None, T, S, device="cuda")
    flex = torch.compile(flex_attention, dynamic=False)
    candidates = {"torch flex compiled": lambda q, k, v: flex(q, k, v, block_mask=block_mask)}
    if mask == "causal" and T == S:  # SDPA's flash kernel has no window and aligns causal top-left

        def sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        candidates["torch sdpa flash"] = sdpa
    return candidates


def _jax_candidates(mask, mode, T, S, window):
    candidates, skipped = [], {}
    q, k, v = _inputs(T, S)
    for name, attention in jax_attentions(mask, window, decode=T == 1).items():
        fn = _with_backward(attention) if mode == "forward+backward" else attention
        try:
            candidates.append(jax_candidate(name, fn, q, k, v))
        except Exception as error:  # noqa: BLE001 - a candidate this device cannot run is reported, not fatal
            skipped[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return candidates, skipped


def _torch_candidates(mask, mode, T, S, window):
    import torch

    candidates, skipped = [], {}
    generator = torch.Generator(device="cuda").manual_seed(0)
    shapes = ((B, N, T, H), (B, N, S, H), (B, N, S, H))
    q, k, v = (
        torch.randn(s, generator=generator, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes
    )
    for name, attention in torch_attentions(mask, window, T, S).items():

        def call(attention=attention):
            out = attention(q, k, v)
            if mode == "forward+backward":
                torch.autograd.grad(out.float().sum(), (q, k, v))
            torch.cuda.synchronize()

        try:
            start = time.perf_counter()
            call()  # compiles flex, warms up
            compile_s = time.perf_counter() - start
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            call()
            peak = torch.cuda.max_memory_allocated() - before
            candidates.append(Candidate(name, call, compile_s=compile_s, peak_bytes=int(peak)))
        except Exception as error:  # noqa: BLE001
            skipped[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return candidates, skipped


def run_case(mask, mode, S, rounds, window):
    T = 1 if mode == "decode" else S
    jax_mode = "forward" if mode == "decode" else mode
    candidates, skipped = _jax_candidates(mask, jax_mode, T, S, window)
    more, also_skipped = _torch_candidates(mask, jax_mode, T, S, window) if torch_cuda() else ([], {})
    candidates, skipped = candidates + more, {**skipped, **also_skipped}
    time_rounds(candidates, rounds)
    ours = next((c.median_s for c in candidates if c.name == "jaxattn"), None)
    rows = {c.name: {**c.summary(), "ratio_to_jaxattn": c.median_s / ours if ours else None} for c in candidates}
    return {"mask": mask, "mode": mode, "T": T, "S": S, "candidates": rows, "skipped": skipped}


def torch_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def print_table(results):
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    header = ["mask", "mode", "T", "S", "candidate", "median ms", "x jaxattn", "memory MiB"]
    lines = []
    for case in results["cases"]:
        for name, row in case["candidates"].items():
            memory = row["temp_bytes"] if row["temp_bytes"] is not None else row["peak_bytes"]
            lines.append(
                [
                    case["mask"],
                    case["mode"],
                    str(case["T"]),
                    str(case["S"]),
                    name,
                    f"{row['median_s'] * 1e3:.3f}",
                    f"{row['ratio_to_jaxattn']:.2f}",
                    "-" if memory is None else f"{memory / 2**20:.1f}",
                ]
            )
        for name, why in case["skipped"].items():
            lines.append([case["mask"], case["mode"], str(case["T"]), str(case["S"]), name, "skipped", "", why[:60]])
    if Console is None:
        print("\t".join(header))
        for line in lines:
            print("\t".join(line))
        return
    table = Table(title=f"attention on {results['device']} (bf16, B={B}, N={N}, H={H})")
    for column in header:
        table.add_column(column)
    for line in lines:
        table.add_row(*line)
    Console().print(table)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--modes", nargs="+", default=["forward", "forward+backward", "decode"])
    parser.add_argument("--masks", nargs="+", default=["causal", "sliding"])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, two rounds (runs anywhere)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    sizes, rounds, window = (args.sizes, args.rounds, WINDOW) if not args.smoke else ([256], 2, 64)
    platform, kind = _device()
    cases = [run_case(mask, mode, S, rounds, window) for S in sizes for mask in args.masks for mode in args.modes]
    results = {
        "device": kind,
        "platform": platform,
        "window": window,
        "rounds": rounds,
        "smoke": args.smoke,
        "load_average": load_average(),
        "cases": cases,
    }
    print_table(results)
    path = args.json or f"benchmarks/results/accelerator_{re.sub(r'[^A-Za-z0-9]+', '_', kind).strip('_').lower()}.json"
    if not args.smoke or args.json:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
