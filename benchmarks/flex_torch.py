"""torch.compile(flex_attention) forward on this CPU: the figures jaxattn's flex path is measured against.

Cases (B=1, N=8, H=64, float32, T = S): causal, sliding window (left 512, causal), packed documents of 512
tokens (not causal), at S = 2048 and 8192; torch SDPA causal as a yardstick. The block mask is built once
with torch's create_block_mask (not timed); compile time is recorded separately; the candidates of one S are
timed interleaved (harness.time_rounds), median reported.

    python -m benchmarks.flex_torch [--sizes 2048 8192] [--rounds 5] [--json benchmarks/results/flex_torch.json]
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

from benchmarks.harness import load_average, time_rounds, torch_candidate

B, N, H, LEFT, DOC = 1, 8, 64, 512, 512


def _mask_mods(S):
    import torch

    docs = torch.arange(S) // DOC  # T == S: row indices are absolute positions here

    def causal(b, h, q, kv):
        return q >= kv

    def sliding(b, h, q, kv):
        return (q >= kv) & (q - kv <= LEFT)

    def documents(b, h, q, kv):
        return docs[q] == docs[kv]

    return {"causal": causal, "sliding_512": sliding, "documents_512": documents}


def flex_candidates(S, seed=0):
    """One compiled-flex candidate per mask, plus SDPA causal; each compiled and warmed up here."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    generator = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, N, S, H, generator=generator) for _ in range(3))
    # dynamic=False: a second size would otherwise recompile with dynamic shapes, and inductor's CPU flex
    # template then fails to compile its C++ (torch 2.13: "cur_qSplitSize8 was not declared")
    compiled = torch.compile(flex_attention, dynamic=False)
    candidates = []
    for name, mask_mod in _mask_mods(S).items():
        block_mask = create_block_mask(mask_mod, None, None, S, S, device="cpu")
        start = time.perf_counter()
        with torch.no_grad():
            compiled(q, k, v, block_mask=block_mask)
        compile_s = time.perf_counter() - start

        def run(block_mask=block_mask):
            with torch.no_grad():
                return compiled(q, k, v, block_mask=block_mask)

        cand = torch_candidate(f"flex_{name}", run, note=f"block sparsity {block_mask.sparsity():.1f}%")
        cand.compile_s = compile_s
        candidates.append(cand)
    candidates.append(
        torch_candidate(
            "sdpa_causal", lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        )
    )
    return candidates


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="benchmarks/results/flex_torch.json")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    import torch

    results = {
        "device": "cpu",
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "B": B,
        "N": N,
        "H": H,
        "dtype": "float32",
        "sizes": {},
    }
    for S in args.sizes:
        candidates = flex_candidates(S)
        time_rounds(candidates, args.rounds)
        results["sizes"][str(S)] = {c.name: c.summary() for c in candidates}
        for c in candidates:
            compile_s = f"compile {c.compile_s:5.1f} s" if c.compile_s else ""
            print(f"S={S:5d} {c.name:18s} median {c.median_s * 1e3:9.1f} ms  {compile_s:16s} {c.note}", flush=True)
    results["load_average"] = load_average()
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
