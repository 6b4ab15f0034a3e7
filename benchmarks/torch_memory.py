"""Peak memory of torch calls on CPU, measured in this fresh process (see harness.py for the method).

Reads a JSON list of specs on stdin, prints a JSON list of peak byte counts (one per spec) on stdout.
A spec: {"kind": "sdpa" | "math" | "mha" | "seed000", plus shape fields}. Each spec is built, called once
to warm up, then the kernel's peak-RSS counter is reset and one call is measured.
"""

from __future__ import annotations

import json
import re
import sys

import torch


def _status_kib(field):
    with open("/proc/self/status") as f:
        return int(re.search(field + r":\s+(\d+)", f.read()).group(1))


def peak_bytes(fn):
    """Peak resident-set growth (bytes) during fn(), results kept alive until the peak is read."""
    fn()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    before = _status_kib("VmRSS")
    result = fn()
    peak = _status_kib("VmHWM")
    del result
    return (peak - before) * 1024


def build(spec):
    """A zero-argument torch callable for one spec (forward only, no_grad)."""
    torch.manual_seed(0)
    kind = spec["kind"]
    if kind in ("sdpa", "math"):
        B, T, S, N, H = (spec[k] for k in ("B", "T", "S", "N", "H"))
        q, k, v = torch.randn(B, N, T, H), torch.randn(B, N, S, H), torch.randn(B, N, S, H)
        causal = spec.get("causal", False)
        if kind == "sdpa":
            return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return lambda: math_attention(q, k, v, causal)
    if kind == "mha":
        B, T, E, N = (spec[k] for k in ("B", "T", "E", "N"))
        module = torch.nn.MultiheadAttention(E, N, batch_first=True).eval()
        x = torch.randn(B, T, E)
        return lambda: module(x, x, x, need_weights=False)[0]
    if kind == "seed000":
        B, S, N, H = (spec[k] for k in ("B", "S", "N", "H"))
        args = [torch.randn(B, S, N, H)] + [torch.randn(N, H, H) for _ in range(3)]
        args += [torch.randn(S, S, N, H) for _ in range(2)]
        return lambda: seed000(*args)
    raise ValueError(f"unknown spec kind {kind!r}")


def math_attention(q, k, v, causal):
    """The plain torch route users write: matmul, masked_fill, softmax, matmul ([B,N,T,S] logits)."""
    logits = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        T, S = logits.shape[-2:]
        logits = logits.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(S - T), float("-inf"))
    return torch.softmax(logits, dim=-1) @ v


def seed000(X, W_Q, W_K, W_V, a_K, a_V):
    """The seed-000 answer's code, verbatim apart from names (builds [B,S,S,H,D])."""
    D = X.shape[-1]
    XW_Q = torch.einsum("bshd,hde->bshe", X, W_Q)
    XW_K = torch.einsum("bshd,hde->bshe", X, W_K)
    e = (XW_Q.unsqueeze(2) * (XW_K.unsqueeze(1) + a_K)).sum(dim=-1) / torch.sqrt(torch.tensor(D, dtype=X.dtype))
    alpha = torch.nn.functional.softmax(e, dim=2)
    XW_V = torch.einsum("bshd,hde->bshe", X, W_V)
    return torch.einsum("bijh,bijhd->bihd", alpha, XW_V.unsqueeze(1) + a_V)


def main():
    specs = json.loads(sys.stdin.read())
    peaks = []
    with torch.no_grad():
        for spec in specs:
            peaks.append(peak_bytes(build(spec)))
    print(json.dumps(peaks))


if __name__ == "__main__":
    main()
