"""Issue 28 §4: the new attention forms, measured (figures in docs/latent_and_linear.md).

    python -m benchmarks.latent_and_linear [--rounds 5] [--out benchmarks/results/latent_and_linear.json]

MLA decode step: one new token over S cached tokens (S = 4k, 8k, 16k, 32k), the absorbed form reading the
compressed cache (C + R numbers per token) against the expanded form from the same cache (it up-projects the
whole cache every step) and against plain decode attention over an expanded K/V cache [S,N,H] + [S,N,Hv].
Cache bytes from the shapes, time per token (interleaved rounds, medians), XLA temp bytes.
Delta rule at T = 4096: chunked (C = 64) against recurrent, and against causal softmax attention
(jaxattn.dot_product_attention) of the same T and heads: time and XLA temp, forward and forward + backward.
float32, batch 1, DeepSeek-V3-like ratios at a CPU-sized width (N=16, C=512, R=64, Hn=128, Hv=128).
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp

import jaxattn
from benchmarks.harness import jax_candidate, load_average, time_rounds

MLA = {"E": 1024, "N": 16, "C": 512, "R": 64, "Hn": 128, "Hv": 128}
DELTA = {"T": 4096, "K": 4, "N": 8, "H": 128, "Hv": 128, "C": 64}


def _zeros(shape):
    return jnp.zeros(shape, jnp.float32) + 0.01


def mla_cases(S):
    m = MLA
    params = jaxattn.init_latent_attention(
        jax.random.PRNGKey(0),
        m["E"],
        m["N"],
        latent_dim=m["C"],
        rope_dim=m["R"],
        nope_head_dim=m["Hn"],
        value_head_dim=m["Hv"],
    )
    x = _zeros((1, 1, m["E"]))
    cache = (_zeros((1, S, m["C"])), _zeros((1, S, m["R"])), jnp.array([S - 1], jnp.int32))
    H = m["Hn"] + m["R"]
    k_cache, v_cache = _zeros((1, S, m["N"], H)), _zeros((1, S, m["N"], m["Hv"]))
    q = _zeros((1, 1, m["N"], H))

    def step(form):
        return lambda p, x, c: jaxattn.latent_attention(p, x, cache=c, form=form)[0]

    def expanded_cache(q, k, v):  # the attention read alone over an expanded cache, no projections
        return jaxattn.dot_product_attention(q, k, v, is_causal=True)

    cands = [
        jax_candidate(f"mla_absorbed_S{S}", step("absorbed"), params, x, cache),
        jax_candidate(f"mla_expanded_from_latent_S{S}", step("expanded"), params, x, cache),
        jax_candidate(f"attention_over_expanded_cache_S{S}", expanded_cache, q, k_cache, v_cache),
    ]
    cache_bytes = {"compressed": S * (m["C"] + m["R"]) * 4, "expanded": S * m["N"] * (H + m["Hv"]) * 4}
    return cands, cache_bytes


def delta_cases():
    d = DELTA
    T, K, N, H, Hv = d["T"], d["K"], d["N"], d["H"], d["Hv"]
    q, k = _zeros((1, T, K, H)), _zeros((1, T, K, H))
    v, g, beta = _zeros((1, T, N, Hv)), -_zeros((1, T, N)), _zeros((1, T, N))
    sq, sk, sv = _zeros((1, T, N, H)), _zeros((1, T, N, H)), _zeros((1, T, N, Hv))

    def delta(impl):
        return lambda q, k, v, g, beta: jaxattn.gated_delta_rule(
            q, k, v, g, beta, chunk_size=d["C"], implementation=impl
        )

    def softmax(q, k, v):
        return jaxattn.dot_product_attention(q, k, v, is_causal=True)

    def grad(f, n):
        return jax.grad(lambda *a: jnp.sum(f(*a)), argnums=tuple(range(n)))

    return [
        jax_candidate("delta_chunked_fwd", delta("chunked"), q, k, v, g, beta),
        jax_candidate("delta_recurrent_fwd", delta("recurrent"), q, k, v, g, beta),
        jax_candidate("softmax_causal_fwd", softmax, sq, sk, sv),
        jax_candidate("delta_chunked_fwd_bwd", grad(delta("chunked"), 5), q, k, v, g, beta),
        jax_candidate("delta_recurrent_fwd_bwd", grad(delta("recurrent"), 5), q, k, v, g, beta),
        jax_candidate("softmax_causal_fwd_bwd", grad(softmax, 3), sq, sk, sv),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--part", choices=["mla", "delta", "both"], default="both")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "latent_and_linear.json"))
    args = parser.parse_args(argv)
    result = {}
    if os.path.exists(args.out):  # one part at a time keeps the other's figures
        with open(args.out) as f:
            result = json.load(f)
    result.update({"mla": MLA, "delta": DELTA, "device": str(jax.devices()[0])})
    if args.part in ("mla", "both"):
        result["mla_decode"] = {"load_before": load_average()}
        _mla(args, result["mla_decode"])
        result["mla_decode"]["load_after"] = load_average()
        _write(args.out, result)
    if args.part in ("delta", "both"):
        result["delta_rule"] = {"load_before": load_average()}
        cands = delta_cases()
        time_rounds(cands, args.rounds)
        result["delta_rule"].update({c.name: c.summary() for c in cands})
        print({c.name: (round(c.median_s * 1e3, 1), c.temp_bytes) for c in cands}, flush=True)
        result["delta_rule"]["load_after"] = load_average()
        _write(args.out, result)


def _write(path, result):
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def _mla(args, result):
    for S in args.lengths:
        cands, cache_bytes = mla_cases(S)
        time_rounds(cands, args.rounds)
        result[S] = {"cache_bytes": cache_bytes, **{c.name: c.summary() for c in cands}}
        print(S, cache_bytes, {c.name: (round(c.median_s * 1e3, 3), c.temp_bytes) for c in cands}, flush=True)


if __name__ == "__main__":
    main()
