"""The benchmark cases: each builds its candidates (compiled, warmed up) and states its targets.

Shapes follow the issue's target table; `quick=True` shrinks every shape so the whole run is a smoke test.
Every case's `reference` is the candidate its ratios are taken against.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from .harness import jax_candidate, torch_candidate

MiB = 2**20
GiB = 2**30


@dataclasses.dataclass
class Target:
    text: str
    check: Callable[[dict], tuple]  # {name: Candidate} -> (met: bool, measured: str)


@dataclasses.dataclass
class Case:
    name: str
    title: str
    candidates: list
    reference: str
    targets: list = dataclasses.field(default_factory=list)
    params: dict = dataclasses.field(default_factory=dict)
    rounds: int | None = None  # overrides the run's default (the long-context case is slow)
    sweep: dict | None = None  # for the plot: {"x": ..., "series": ...}


def _t(c, name):
    return c[name].median_s


def ratio_target(text, name, others, limit):
    """median(name) / min(median(others)) <= limit."""

    def check(c):
        ratio = _t(c, name) / min(_t(c, o) for o in others)
        return ratio <= limit, f"{ratio:.2f}x"

    return Target(text, check)


def speedup_target(text, slow, fast, at_least):
    """min(median(slow...)) / median(fast) >= at_least; slow is a name or a list of names."""

    def check(c):
        speedup = min(_t(c, s) for s in ([slow] if isinstance(slow, str) else slow)) / _t(c, fast)
        return speedup >= at_least, f"{speedup:.1f}x faster"

    return Target(text, check)


def memory_target(text, name, limit_fn, describe):
    def check(c):
        temp = c[name].temp_bytes
        limit = limit_fn(c)
        return temp <= limit, f"{temp / MiB:.1f} MiB (limit {limit / MiB:.1f} MiB, {describe(c)})"

    return Target(text, check)


def compile_target(text, name, limit_s):
    def check(c):
        return c[name].compile_s <= limit_s, f"{c[name].compile_s:.2f} s"

    return Target(text, check)


def _rng_arrays(shapes, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=s).astype(dtype) for s in shapes]


# ---------------------------------------------------------------------------------------------------


def ceiling_candidate(quick):
    """A float32 matmul timed in every case's rounds: the practical ceiling under that case's load."""
    import jax.numpy as jnp

    n = 512 if quick else 1024
    a, b = _rng_arrays([(n, n), (n, n)])
    return jax_candidate(f"(ceiling: jax matmul {n}^3)", jnp.matmul, jnp.asarray(a), jnp.asarray(b), flops=2.0 * n**3)


def matmul_case(quick):
    import jax.numpy as jnp
    import torch

    n = 1024 if quick else 2048
    a, b = _rng_arrays([(n, n), (n, n)])
    ta, tb = torch.from_numpy(a), torch.from_numpy(b)
    flops = 2.0 * n**3
    cands = [
        jax_candidate("jax matmul", jnp.matmul, jnp.asarray(a), jnp.asarray(b), flops=flops),
        torch_candidate("torch matmul", lambda: ta @ tb, flops=flops),
    ]
    return Case("matmul", f"Practical ceiling: float32 matmul {n}x{n}x{n}", cands, "torch matmul", params={"n": n})


def _mha_setup(quick):
    import jax
    import jax.numpy as jnp
    import torch
    from flax import linen

    import jaxattn

    B, T, E, N = (2, 128, 256, 4) if quick else (8, 512, 512, 8)
    (x,) = _rng_arrays([(B, T, E)])
    params = jaxattn.init_multi_head_attention(jax.random.key(0), E, N)
    flax_layer = linen.MultiHeadDotProductAttention(num_heads=N, qkv_features=E)
    flax_params = flax_layer.init(jax.random.key(1), x, x)
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(E, N, batch_first=True)
    flops = 4 * 2.0 * B * T * E * E + 4.0 * B * T * T * E
    return dict(
        B=B,
        T=T,
        E=E,
        N=N,
        x=x,
        xj=jnp.asarray(x),
        params=params,
        flax_layer=flax_layer,
        flax_params=flax_params,
        module=module,
        xt=torch.from_numpy(x),
        flops=flops,
    )


def _jax_nn_mha(params, x):
    import jax

    from jaxattn import project_out, project_qkv

    q, k, v = project_qkv(params, x)
    return project_out(params, jax.nn.dot_product_attention(q, k, v))


def mha_forward_case(quick):
    import torch

    import jaxattn

    s = _mha_setup(quick)
    module, xt = s["module"].eval(), s["xt"]

    def torch_fast_path():
        with torch.no_grad():
            return module(xt, xt, xt, need_weights=False)[0]

    flax_layer, flops = s["flax_layer"], s["flops"]
    cands = [
        torch_candidate(
            "torch MHA (fast path)",
            torch_fast_path,
            flops=flops,
            memory_spec={"kind": "mha", **{k: s[k] for k in "BTEN"}},
        ),
        torch_candidate("torch MHA (fast path, 1 thread)", torch_fast_path, flops=flops, threads=1),
        jax_candidate("flax MHA", lambda p, x: flax_layer.apply(p, x, x), s["flax_params"], s["xj"], flops=flops),
        jax_candidate("jax.nn + projections", _jax_nn_mha, s["params"], s["xj"], flops=flops),
        jax_candidate(
            "jaxattn",
            jaxattn.multi_head_attention,
            s["params"],
            s["xj"],
            flops=flops,
            note="implementation=None (automatic)",
        ),
        jax_candidate(
            "jaxattn dense",
            lambda p, x: jaxattn.multi_head_attention(p, x, implementation="dense"),
            s["params"],
            s["xj"],
            flops=flops,
        ),
        jax_candidate(
            "jaxattn blockwise",
            lambda p, x: jaxattn.multi_head_attention(p, x, implementation="blockwise"),
            s["params"],
            s["xj"],
            flops=flops,
        ),
    ]
    targets = [
        ratio_target("jaxattn <= 1.0x flax", "jaxattn", ["flax MHA"], 1.0),
        ratio_target(
            "jaxattn <= 1.1x torch (faster thread setting)",
            "jaxattn",
            ["torch MHA (fast path)", "torch MHA (fast path, 1 thread)"],
            1.1,
        ),
        compile_target("jit compile of multi_head_attention < 5 s", "jaxattn", 5.0),
    ]
    return Case(
        "mha_forward",
        "MHA forward B={B} T={T} E={E} N={N} float32".format(**s),
        cands,
        "torch MHA (fast path)",
        targets,
        {k: s[k] for k in "BTEN"},
    )


def mha_backward_case(quick):
    import jax

    import jaxattn

    s = _mha_setup(quick)
    module, flax_layer = s["module"].train(), s["flax_layer"]
    xt = s["xt"].clone().requires_grad_(True)
    flops = 3 * s["flops"]

    def torch_autograd():
        module.zero_grad(set_to_none=True)
        xt.grad = None
        module(xt, xt, xt, need_weights=False)[0].sum().backward()
        return xt.grad

    def grads(f):
        return jax.grad(lambda p, x: f(p, x).sum(), argnums=(0, 1))

    cands = [
        torch_candidate("torch autograd", torch_autograd, flops=flops),
        torch_candidate("torch autograd (1 thread)", torch_autograd, flops=flops, threads=1),
        jax_candidate("flax", grads(lambda p, x: flax_layer.apply(p, x, x)), s["flax_params"], s["xj"], flops=flops),
        jax_candidate("jax.nn + projections", grads(_jax_nn_mha), s["params"], s["xj"], flops=flops),
        jax_candidate(
            "jaxattn",
            grads(jaxattn.multi_head_attention),
            s["params"],
            s["xj"],
            flops=flops,
            note="implementation=None (automatic)",
        ),
        jax_candidate(
            "jaxattn dense",
            grads(lambda p, x: jaxattn.multi_head_attention(p, x, implementation="dense")),
            s["params"],
            s["xj"],
            flops=flops,
        ),
        jax_candidate(
            "jaxattn blockwise",
            grads(lambda p, x: jaxattn.multi_head_attention(p, x, implementation="blockwise")),
            s["params"],
            s["xj"],
            flops=flops,
        ),
    ]
    targets = [
        ratio_target(
            "jaxattn <= 1.1x the faster of torch/flax",
            "jaxattn",
            ["torch autograd", "torch autograd (1 thread)", "flax"],
            1.1,
        )
    ]
    return Case(
        "mha_forward_backward",
        "MHA forward+backward B={B} T={T} E={E} N={N} float32".format(**s),
        cands,
        "torch autograd",
        targets,
        {k: s[k] for k in "BTEN"},
    )


# ---------------------------------------------------------------------------------------------------


def seed000_naive(X, W_Q, W_K, W_V, a_K, a_V):
    """The seed-000 answer's torch code ported line by line to jnp (broadcasts to [B,S,S,N,H])."""
    import jax
    import jax.numpy as jnp

    D = X.shape[-1]
    XW_Q = jnp.einsum("bshd,hde->bshe", X, W_Q)
    XW_K = jnp.einsum("bshd,hde->bshe", X, W_K)
    e = (XW_Q[:, :, None] * (XW_K[:, None] + a_K)).sum(axis=-1) / jnp.sqrt(D)
    alpha = jax.nn.softmax(e, axis=2)
    XW_V = jnp.einsum("bshd,hde->bshe", X, W_V)
    return jnp.einsum("bijh,bijhd->bihd", alpha, XW_V[:, None] + a_V)


def seed000_jaxattn(X, W_Q, W_K, W_V, a_K, a_V):
    import jax.numpy as jnp

    import jaxattn

    q, k, v = (jnp.einsum("bsnd,nde->bsne", X, W) for W in (W_Q, W_K, W_V))
    return jaxattn.relative_attention(q, k, v, a_K, a_V)


def seed000_case(quick):
    import jax.numpy as jnp
    import torch

    from .torch_memory import seed000 as seed000_torch

    B, S, N, H = (2, 64, 4, 32) if quick else (4, 256, 8, 64)
    arrays = _rng_arrays([(B, S, N, H), (N, H, H), (N, H, H), (N, H, H), (S, S, N, H), (S, S, N, H)])
    jargs = [jnp.asarray(a) for a in arrays]
    targs = [torch.from_numpy(a) for a in arrays]
    flops = 3 * 2.0 * B * S * N * H * H + 8.0 * B * N * S * S * H

    def torch_seed():
        with torch.no_grad():
            return seed000_torch(*targs)

    cands = [
        torch_candidate(
            "torch seed-000 answer",
            torch_seed,
            flops=flops,
            memory_spec={"kind": "seed000", "B": B, "S": S, "N": N, "H": H},
        ),
        torch_candidate("torch seed-000 answer (1 thread)", torch_seed, flops=flops, threads=1),
        jax_candidate("naive JAX port", seed000_naive, *jargs, flops=flops),
        jax_candidate("jaxattn.relative_attention", seed000_jaxattn, *jargs, flops=flops),
    ]
    targets = [
        speedup_target(
            "jaxattn >= 10x faster than the torch answer",
            ["torch seed-000 answer", "torch seed-000 answer (1 thread)"],
            "jaxattn.relative_attention",
            10.0,
        ),
        memory_target(
            "XLA temp <= 1/4 of the naive JAX port",
            "jaxattn.relative_attention",
            lambda c: c["naive JAX port"].temp_bytes / 4,
            lambda c: f"naive port {c['naive JAX port'].temp_bytes / MiB:.0f} MiB",
        ),
    ]
    return Case(
        "seed000",
        f"seed-000 relative attention B={B} S={S} N={N} H={H} float32 (incl. projections)",
        cands,
        "torch seed-000 answer",
        targets,
        dict(B=B, S=S, N=N, H=H),
    )


# ---------------------------------------------------------------------------------------------------


def shaw_gather_port(q, k, v, key_table, value_table, index):
    """The obvious port: gather A = table[index] ([T,S,H]), then the seed-000 einsums."""
    import jax
    import jax.numpy as jnp

    a_k, a_v = key_table[index], value_table[index]
    logits = jnp.einsum("btnh,bsnh->bnts", q, k) + jnp.einsum("btnh,tsh->bnts", q, a_k)
    p = jax.nn.softmax(logits * q.shape[-1] ** -0.5, axis=-1)
    return jnp.einsum("bnts,bsnh->btnh", p, v) + jnp.einsum("bnts,tsh->btnh", p, a_v)


def shaw_case(quick):
    import jax
    import jax.numpy as jnp

    import jaxattn

    B, T, N, H, md = (1, 512, 4, 32, 16) if quick else (1, 2048, 8, 64, 16)
    R = 2 * md + 1
    q, k, v = (jnp.asarray(a) for a in _rng_arrays([(B, T, N, H)] * 3))
    tk, tv = (jnp.asarray(a) * 0.1 for a in _rng_arrays([(R, H), (R, H)], seed=1))
    index = jaxattn.relative_position_index(T, T, md)
    flops = 4.0 * B * N * T * T * H

    def shaw(implementation):
        return lambda q, k, v, tk, tv: jaxattn.shaw_relative_attention(
            q, k, v, tk, tv, max_distance=md, implementation=implementation
        )

    cands = [
        jax_candidate("jax.nn.dot_product_attention (no tables)", jax.nn.dot_product_attention, q, k, v, flops=flops),
        jax_candidate("gather-then-einsum port", shaw_gather_port, q, k, v, tk, tv, index, flops=flops),
        jax_candidate("jaxattn", shaw(None), q, k, v, tk, tv, flops=flops, note="implementation=None (automatic)"),
        jax_candidate("jaxattn dense", shaw("dense"), q, k, v, tk, tv, flops=flops),
        jax_candidate("jaxattn blockwise", shaw("blockwise"), q, k, v, tk, tv, flops=flops),
    ]
    plain = "jax.nn.dot_product_attention (no tables)"
    targets = [
        memory_target(
            "temp memory <= 2x plain",
            "jaxattn",
            lambda c: 2 * c[plain].temp_bytes,
            lambda c: f"plain {c[plain].temp_bytes / MiB:.0f} MiB",
        ),
        ratio_target("time <= 1.5x plain", "jaxattn", [plain], 1.5),
    ]
    return Case(
        "shaw",
        f"Shaw tables k={md} (R={R}, shared over heads) B={B} T=S={T} N={N} H={H} float32 forward",
        cands,
        plain,
        targets,
        dict(B=B, T=T, N=N, H=H, max_distance=md),
    )


# ---------------------------------------------------------------------------------------------------


def long_context_case(quick):
    import jax
    import jax.numpy as jnp

    import jaxattn

    B, T, N, H = (1, 2048, 8, 64) if quick else (1, 16384, 8, 64)
    shape = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    q, k, v = (jnp.asarray(a) for a in _rng_arrays([(B, T, N, H)] * 3))
    flops = 3.5 * 4.0 * B * N * T * T * H / 2  # causal half; backward ~2.5x forward (recomputed logits)

    def train_step(implementation):
        def loss(q, k, v):
            return jaxattn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation).sum()

        return jax.grad(loss, argnums=(0, 1, 2))

    dense = jax_candidate(
        "jaxattn dense (compiled, not run)",
        train_step("dense"),
        shape,
        shape,
        shape,
        run=False,
        note="XLA memory analysis only: too large to run",
    )
    cands = [jax_candidate("jaxattn", train_step(None), q, k, v, flops=flops, note="implementation=None"), dense]
    targets = [
        Target(
            "runs (forward+backward)",
            lambda c: (c["jaxattn"].median_s is not None, f"{c['jaxattn'].median_s:.1f} s per step"),
        ),
        memory_target(
            "XLA temp memory < 1 GiB",
            "jaxattn",
            lambda c: GiB,
            lambda c: f"dense would need {c['jaxattn dense (compiled, not run)'].temp_bytes / GiB:.1f} GiB",
        ),
    ]
    return Case(
        "long_context",
        f"Long context causal forward+backward B={B} T=S={T} N={N} H={H} float32",
        cands,
        "jaxattn",
        targets,
        dict(B=B, T=T, N=N, H=H),
        rounds=2,
    )


def blockwise_vs_dense_case(quick):
    import jax.numpy as jnp

    import jaxattn

    B, T, N, H = (1, 512, 4, 64) if quick else (1, 2048, 8, 64)
    q, k, v = (jnp.asarray(a) for a in _rng_arrays([(B, T, N, H)] * 3))
    flops = 4.0 * B * N * T * T * H

    def attend(implementation):
        return lambda q, k, v: jaxattn.dot_product_attention(q, k, v, implementation=implementation)

    cands = [
        jax_candidate("dense", attend("dense"), q, k, v, flops=flops),
        jax_candidate("blockwise", attend("blockwise"), q, k, v, flops=flops),
        jax_candidate("automatic", attend(None), q, k, v, flops=flops),
    ]
    targets = [ratio_target("blockwise forward <= 1.3x dense", "blockwise", ["dense"], 1.3)]
    return Case(
        "blockwise_vs_dense",
        f"Blockwise vs dense forward B={B} T=S={T} N={N} H={H} float32",
        cands,
        "dense",
        targets,
        dict(B=B, T=T, N=N, H=H),
    )


def sweep_case(quick):
    """Time and memory against sequence length (the plot): dense, blockwise, torch SDPA, torch math."""
    import jax.numpy as jnp
    import torch

    import jaxattn

    B, N, H = 1, 8, 64
    lengths = [256, 512, 1024] if quick else [512, 1024, 2048, 4096, 8192]
    dense_max = 4096
    cands, series = [], {}
    for S in lengths:
        q, k, v = (jnp.asarray(a) for a in _rng_arrays([(B, S, N, H)] * 3))
        tq, tk, tv = (torch.from_numpy(np.asarray(a).transpose(0, 2, 1, 3).copy()) for a in (q, k, v))
        flops = 4.0 * B * N * S * S * H
        spec = {"B": B, "T": S, "S": S, "N": N, "H": H}
        entries = [
            (
                "jaxattn blockwise",
                lambda: jax_candidate(
                    f"jaxattn blockwise S={S}",
                    lambda q, k, v: jaxattn.dot_product_attention(q, k, v, implementation="blockwise"),
                    q,
                    k,
                    v,
                    flops=flops,
                ),
            )
        ]
        sdpa = _torch_sdpa(tq, tk, tv)  # bound now: a lambda here would see the last S's tensors
        entries.append(
            (
                "torch SDPA",
                lambda: torch_candidate(f"torch SDPA S={S}", sdpa, flops=flops, memory_spec={"kind": "sdpa", **spec}),
            )
        )
        entries.append(
            (
                "torch SDPA (1 thread)",
                lambda: torch_candidate(f"torch SDPA 1 thread S={S}", sdpa, flops=flops, threads=1),
            )
        )
        if S <= dense_max:
            entries.append(
                (
                    "jaxattn dense",
                    lambda: jax_candidate(
                        f"jaxattn dense S={S}",
                        lambda q, k, v: jaxattn.dot_product_attention(q, k, v, implementation="dense"),
                        q,
                        k,
                        v,
                        flops=flops,
                    ),
                )
            )
            entries.append(
                (
                    "torch math",
                    lambda: torch_candidate(
                        f"torch math S={S}", _torch_math(tq, tk, tv), flops=flops, memory_spec={"kind": "math", **spec}
                    ),
                )
            )
        for series_name, make in entries:
            cand = make()
            cands.append(cand)
            series.setdefault(series_name, []).append((S, cand.name))
    return Case(
        "sweep",
        f"Forward time and memory against sequence length, B={B} N={N} H={H} float32",
        cands,
        cands[0].name,
        params=dict(B=B, N=N, H=H, lengths=lengths),
        sweep=series,
    )


def _torch_sdpa(q, k, v):
    import torch

    def run():
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    return run


def _torch_math(q, k, v):
    import torch

    from .torch_memory import math_attention

    def run():
        with torch.no_grad():
            return math_attention(q, k, v, False)

    return run


# ---------------------------------------------------------------------------------------------------
# Where the MHA training step's time goes, and attention against torch's fused CPU kernels.


def mha_breakdown_case(quick):
    """The MHA step in pieces: the four projections alone (attention replaced by a sum, so the same
    matmuls and their gradients run) and attention alone on the projected shapes, forward and
    forward+backward, jaxattn against torch (F.linear and F.scaled_dot_product_attention)."""
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    import jaxattn
    from jaxattn import project_out, project_qkv

    s = _mha_setup(quick)
    B, T, E, N = (s[k] for k in "BTEN")
    H = E // N
    q, k, v = (jnp.asarray(a) for a in _rng_arrays([(B, T, N, H)] * 3, seed=2))
    tq, tk, tv = (torch.from_numpy(np.asarray(a).transpose(0, 2, 1, 3).copy()).requires_grad_(True) for a in (q, k, v))
    xt = s["xt"].clone().requires_grad_(True)
    w_in = torch.randn(3 * E, E) * E**-0.5
    w_out = torch.randn(E, E) * E**-0.5
    b_in, b_out = torch.zeros(3 * E), torch.zeros(E)
    weights = [w.requires_grad_(True) for w in (w_in, b_in, w_out, b_out)]
    proj_flops = 4 * 2.0 * B * T * E * E
    attn_flops = 4.0 * B * T * T * E

    def projections(p, x):  # q + k + v stands in for attention: same shapes, no attention cost
        q, k, v = project_qkv(p, x)
        return project_out(p, q + k + v)

    def torch_projections():
        qkv = F.linear(xt, weights[0], weights[1])
        return F.linear(sum(qkv.chunk(3, dim=-1)), weights[2], weights[3])

    def torch_projections_fwd():
        with torch.no_grad():
            return torch_projections()

    def torch_projections_bwd():
        xt.grad = None
        for w in weights:
            w.grad = None
        torch_projections().sum().backward()

    def torch_attention_fwd():
        with torch.no_grad():
            return F.scaled_dot_product_attention(tq, tk, tv)

    def torch_attention_bwd():
        for a in (tq, tk, tv):
            a.grad = None
        F.scaled_dot_product_attention(tq, tk, tv).sum().backward()

    def grads(f, argnums):
        return jax.grad(lambda *a: f(*a).sum(), argnums=argnums)

    def attention(implementation):
        return lambda q, k, v: jaxattn.dot_product_attention(q, k, v, implementation=implementation)

    cands = [
        jax_candidate("jaxattn projections fwd", projections, s["params"], s["xj"], flops=proj_flops),
        torch_candidate("torch projections fwd", torch_projections_fwd, flops=proj_flops),
        jax_candidate(
            "jaxattn projections fwd+bwd", grads(projections, (0, 1)), s["params"], s["xj"], flops=3 * proj_flops
        ),
        torch_candidate("torch projections fwd+bwd", torch_projections_bwd, flops=3 * proj_flops),
        jax_candidate("jaxattn attention fwd", attention(None), q, k, v, flops=attn_flops),
        jax_candidate("jaxattn dense attention fwd", attention("dense"), q, k, v, flops=attn_flops),
        torch_candidate("torch SDPA fwd", torch_attention_fwd, flops=attn_flops),
        jax_candidate("jaxattn attention fwd+bwd", grads(attention(None), (0, 1, 2)), q, k, v, flops=3.5 * attn_flops),
        jax_candidate(
            "jaxattn dense attention fwd+bwd", grads(attention("dense"), (0, 1, 2)), q, k, v, flops=3.5 * attn_flops
        ),
        torch_candidate("torch SDPA fwd+bwd", torch_attention_bwd, flops=3.5 * attn_flops),
    ]
    return Case(
        "mha_breakdown",
        "Where the MHA step's time goes, B={B} T={T} E={E} N={N} float32".format(**s),
        cands,
        "torch projections fwd",
        params={k: s[k] for k in "BTEN"},
    )


def _sdpa_pair(B, S, N, H, dtype, causal, quick_seed=0):
    """jax q, k, v [B,S,N,H] and torch copies [B,N,S,H] (requiring grad) of the same values."""
    import jax.numpy as jnp
    import torch

    arrays = _rng_arrays([(B, S, N, H)] * 3, seed=quick_seed)
    jx = [jnp.asarray(a, dtype) for a in arrays]
    tdtype = {jnp.float32: torch.float32, jnp.bfloat16: torch.bfloat16}[dtype]
    tx = [torch.from_numpy(a.transpose(0, 2, 1, 3).copy()).to(tdtype).requires_grad_(True) for a in arrays]
    return jx, tx


def _attention_vs_sdpa(name, title, lengths, dtype, quick):
    """jaxattn (automatic implementation) against torch SDPA (its CPU flash kernel), causal, forward and
    forward+backward, at each length; targets: <= 1.0x torch's faster thread setting."""
    import jax
    import jax.numpy as jnp
    import torch
    import torch.nn.functional as F

    import jaxattn

    B, N, H = 1, 8, 64
    cands, targets = [], []
    for S in lengths:
        (q, k, v), (tq, tk, tv) = _sdpa_pair(B, S, N, H, dtype, True)
        flops = 4.0 * B * N * S * S * H / 2  # causal: half the grid

        def attend(q, k, v):
            return jaxattn.dot_product_attention(q, k, v, is_causal=True)

        def loss(q, k, v):
            return attend(q, k, v).astype(jnp.float32).sum()

        def torch_fwd(tq=tq, tk=tk, tv=tv):
            with torch.no_grad():
                return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

        def torch_bwd(tq=tq, tk=tk, tv=tv):
            for a in (tq, tk, tv):
                a.grad = None
            F.scaled_dot_product_attention(tq, tk, tv, is_causal=True).float().sum().backward()

        for direction, jfn, tfn, f in (
            ("fwd", attend, torch_fwd, flops),
            ("fwd+bwd", jax.grad(loss, argnums=(0, 1, 2)), torch_bwd, 3.5 * flops),
        ):
            names = [
                f"jaxattn {direction} S={S}",
                f"torch SDPA {direction} S={S}",
                f"torch SDPA 1 thread {direction} S={S}",
            ]
            cands += [
                jax_candidate(names[0], jfn, q, k, v, flops=f, note="implementation=None"),
                torch_candidate(names[1], tfn, flops=f),
                torch_candidate(names[2], tfn, flops=f, threads=1),
            ]
            targets.append(
                ratio_target(
                    f"{direction} S={S}: jaxattn <= 1.0x torch SDPA (faster thread setting)", names[0], names[1:], 1.0
                )
            )
    return Case(
        name,
        title,
        cands,
        cands[1].name,
        targets,
        dict(B=B, N=N, H=H, lengths=lengths, causal=True),
        rounds=3 if max(lengths) > 4096 else None,
    )


def causal_case(quick):
    import jax.numpy as jnp

    lengths = [512, 1024] if quick else [1024, 2048, 4096, 8192]  # issue 53's rows, and the long one kept
    return _attention_vs_sdpa(
        "causal", "Causal attention vs torch SDPA (CPU flash kernel), B=1 N=8 H=64 float32", lengths, jnp.float32, quick
    )


def bf16_case(quick):
    import jax.numpy as jnp

    lengths = [512] if quick else [1024, 2048, 4096]
    return _attention_vs_sdpa(
        "bf16",
        "bfloat16 causal attention (float32 accumulation) vs torch SDPA in bfloat16, B=1 N=8 H=64",
        lengths,
        jnp.bfloat16,
        quick,
    )


ALL_CASES = {
    "matmul": matmul_case,
    "mha_forward": mha_forward_case,
    "mha_forward_backward": mha_backward_case,
    "mha_breakdown": mha_breakdown_case,
    "causal": causal_case,
    "bf16": bf16_case,
    "seed000": seed000_case,
    "shaw": shaw_case,
    "blockwise_vs_dense": blockwise_vs_dense_case,
    "long_context": long_context_case,
    "sweep": sweep_case,
}
