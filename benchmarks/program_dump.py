"""The programs the Pallas kernels build, written out for a before / after diff of a refactor:

    PYTHONHASHSEED=0 python -m benchmarks.program_dump OUT_DIR      (once before the change, once after)
    diff -r BEFORE_DIR AFTER_DIR                                    (no output: the programs are unchanged)

For each case, `jax.make_jaxpr(jax.grad(loss))` of a pallas_gpu / pallas_tpu call in interpret mode (so a CPU
traces the real kernels), and, since `str(jaxpr)` names a pallas_call without its body, every nested kernel's body,
grid mapping (BlockSpecs and index maps), compiler params and input-output aliases. Cases: the flex options
(causal, GQA, segment ids with a mask_mod, sinks, softcap with a window and lengths, score_mod, BlockMask) and every
position term (T5, ALiBi, Shaw, DeBERTa, per-pair tables), on the TPU layout also with keys, queries and table keys
streamed from HBM. PYTHONHASHSEED fixed: the table and pair cases' traces depend on set order otherwise. Issue 50's
kernel refactor was held to these (27 files, byte-identical).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jax_core

import jaxattn
from jaxattn._kernels import flex_tpu_vjp, tables_tpu

B, T, S, N, K, H, Hv = 2, 37, 29, 4, 2, 8, 8  # T, S not whole tiles; GQA where K < N


def cases(implementation: str, rng) -> dict:
    """name: (function of the arrays, the arrays)."""

    def a(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    q, k, v = a(B, T, N, H), a(B, S, K, H), a(B, S, K, Hv)
    q1, k1, v1 = a(B, T, N, H), a(B, S, N, H), a(B, S, N, Hv)
    seg_q = jnp.asarray(np.cumsum(rng.random((B, T)) < 0.15, -1), jnp.int32)
    seg_k = jnp.asarray(np.cumsum(rng.random((B, S)) < 0.15, -1), jnp.int32)
    kw = dict(implementation=implementation, interpret=True)
    # on a TPU plain attention goes to splash: an identity score_mod takes the flex kernel
    same = (lambda score, b, n, t, s: score) if implementation == "pallas_tpu" else None

    def flex(**options):
        return lambda q, k, v: jaxattn.flex_attention(q, k, v, **kw, **options)

    def distance(score, b, n, t, s):
        return score - 0.1 * (n + 1) * jnp.abs(t - s).astype(score.dtype)

    block_mask = jaxattn.create_block_mask(lambda b, n, t, s: t + 3 >= s, None, None, T, S, block_size=16)
    lengths = np.array([25, 17])
    return {
        "plain_causal": (flex(is_causal=True, score_mod=same), (q1, k1, v1)),
        "gqa": (flex(is_causal=True, score_mod=same), (q, k, v)),
        "segments_maskmod": (
            flex(query_segment_ids=seg_q, key_segment_ids=seg_k, mask_mod=lambda b, n, t, s: (t - s) % 5 != 3),
            (q, k, v),
        ),
        "sinks": (flex(sinks=jnp.linspace(-1.0, 1.0, N), score_mod=distance), (q, k, v)),
        "softcap": (
            flex(logit_softcap=2.0, score_mod=same, is_causal=True, window=(19, None), key_value_seq_lengths=lengths),
            (q, k, v),
        ),
        "score_mod": (flex(score_mod=distance), (q, k, v)),
        "block_mask": (flex(block_mask=block_mask), (q, k, v)),
        "t5": (
            lambda q, k, v, t: jaxattn.t5_attention(q, k, v, t, bidirectional=False, is_causal=True, **kw),
            (q, k, v, a(32, N)),
        ),
        "alibi": (
            lambda q, k, v, s: jaxattn.alibi_attention(q, k, v, s, is_causal=True, **kw),
            (q, k, v, jnp.ones(N) * 0.5),
        ),
        "shaw": (
            lambda q, k, v, kt, vt: jaxattn.shaw_relative_attention(
                q, k, v, kt, vt, max_distance=5, is_causal=True, **kw
            ),
            (q, k, v, a(11, N, H), a(11, Hv)),
        ),
        "deberta": (
            lambda q, k, v, kr, qr: jaxattn.disentangled_attention(
                q, k, v, kr, qr, max_relative_positions=9, position_buckets=6, **kw
            ),
            (q, k, v, a(12, N, H), a(12, H)),
        ),
        "deberta_causal_lengths": (
            lambda q, k, v, kr, qr: jaxattn.disentangled_attention(
                q, k, v, kr, qr, max_relative_positions=20, is_causal=True, key_value_seq_lengths=lengths, **kw
            ),
            (q, k, v, a(40, N, H), a(40, N, H)),
        ),
        "pairs": (
            lambda q, k, v, ak, av: jaxattn.relative_attention(q, k, v, ak, av, is_causal=True, **kw),
            (q, k, v, a(T, S, N, H), a(T, S, 1, Hv)),
        ),
    }


def kernels(jaxpr, found=None) -> list:
    """Every pallas_call's body, grid mapping, compiler params and aliases, nested ones included."""
    found = [] if found is None else found
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            params = eqn.params
            found.append(
                f"=== {params['name']}\n{params['grid_mapping']!r}\n{params['compiler_params']!r}"
                f"{params['input_output_aliases']!r}\n{params['jaxpr']}"
            )
            kernels(params["jaxpr"], found)
        for param in eqn.params.values():
            for x in param if isinstance(param, (tuple, list)) else (param,):
                if isinstance(x, jax_core.ClosedJaxpr):
                    kernels(x.jaxpr, found)
                elif isinstance(x, jax_core.Jaxpr):
                    kernels(x, found)
    return found


def program(f, args) -> str:
    """The gradient program of a weighted sum of f(*args) (every argument differentiated), kernels written out."""
    jax.clear_caches()  # a cached trace would hide a change made between cases (the streamed ones below)

    def loss(*xs):
        out = f(*xs)
        return jnp.sum(out * jnp.cos(jnp.arange(out.size, dtype=out.dtype).reshape(out.shape)))

    try:
        closed = jax.make_jaxpr(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)
        return str(closed) + "\n".join(kernels(closed.jaxpr))
    except Exception as error:  # a case that no longer traces is part of the diff, not the end of the run
        return f"ERROR {type(error).__name__}: {str(error)[:500]}"


@contextlib.contextmanager
def patched(module, name, value):
    """module.name = value inside the block (the TPU kernels' VMEM bounds, to reach their streamed forms)."""
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    args = parser.parse_args(argv)
    if os.environ.get("PYTHONHASHSEED") != "0":
        print("warning: PYTHONHASHSEED is not 0; the table and pair cases may differ from run to run", file=sys.stderr)
    os.makedirs(args.out_dir, exist_ok=True)
    programs = {}
    with jax.enable_x64(False):
        tpu = cases("pallas_tpu", np.random.default_rng(0))
        programs.update({f"tpu_{name}": program(*case) for name, case in tpu.items()})
        with patched(flex_tpu_vjp, "MAX_ROWS_BYTES", 1):  # keys and queries read a tile at a time from HBM
            programs.update({f"tpu_streamed_{name}": program(*tpu[name]) for name in ("gqa", "t5", "softcap")})
        with patched(tables_tpu, "key_buffers", lambda *_: 0):  # the tables' dq kernel streams its keys
            names = ("shaw", "deberta_causal_lengths")
            programs.update({f"tpu_streamed_tables_{name}": program(*tpu[name]) for name in names})
        gpu = cases("pallas_gpu", np.random.default_rng(0))
        programs.update({f"gpu_{name}": program(*case) for name, case in gpu.items()})
    for name, text in programs.items():
        with open(os.path.join(args.out_dir, name + ".txt"), "w") as fh:
            fh.write(text)
        print(name, len(text), text[:100] if text.startswith("ERROR") else "")
    return 0


if __name__ == "__main__":
    sys.exit(main())
