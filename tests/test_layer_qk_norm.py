"""The linen layer's `qk_norm` option (Qwen 3 / Gemma 3: an RMS norm on every projected query and key head,
before RoPE and before caching), against torch float64 written out, and on the decode cache.

Sizes: B=3, T=7, E=13, N=6 heads over K=2 key/value heads, H=10. The norm's scales are random (a norm
applied to the wrong axis, or after RoPE, must show).
"""

import functools

import jax
import numpy as np
import pytest
import torch

import jaxattn.linen as jl
from jaxattn.models._norms import RMSNorm
from torchref.positions import apply_rope as torch_rope

B, T, E, N, K, H = 3, 7, 13, 6, 2, 10
BASE, EPS = 500.0, 1e-6


def _layer(**kw):
    return jl.MultiHeadAttention(
        num_heads=N,
        num_kv_heads=K,
        head_dim=H,
        rope=jl.RoPE(base=BASE),
        use_bias=False,
        qk_norm=functools.partial(RMSNorm, EPS, kind="gemma"),
        **kw,
    )


def _params(layer, x):
    params = layer.init(jax.random.key(1), x)["params"]
    assert set(params) == {"query", "key", "value", "out", "q_norm", "k_norm"}
    assert params["q_norm"]["weight"].shape == params["k_norm"]["weight"].shape == (H,)
    rng = np.random.default_rng(3)
    return jax.tree.map(lambda p: rng.standard_normal(p.shape) * 0.5, params)


def _torch_reference(params, x):
    """Causal GQA attention, q/k heads RMS-normed with (1 + w) then rotated, torch float64."""
    p = {
        g: {k: torch.tensor(np.asarray(v), requires_grad=True) for k, v in leaves.items()}
        for g, leaves in params.items()
    }
    x = torch.tensor(np.asarray(x))

    def norm(h, w):
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * (1 + w)

    q = norm(torch.einsum("bte,enh->btnh", x, p["query"]["kernel"]), p["q_norm"]["weight"])
    k = norm(torch.einsum("bte,ekh->btkh", x, p["key"]["kernel"]), p["k_norm"]["weight"])
    v = torch.einsum("bte,ekh->btkh", x, p["value"]["kernel"])
    pos = torch.arange(T)
    q, k = torch_rope(q, pos, base=BASE), torch_rope(k, pos, base=BASE)
    k, v = k.repeat_interleave(N // K, dim=2), v.repeat_interleave(N // K, dim=2)
    logits = torch.einsum("btnh,bsnh->bnts", q, k) * H**-0.5
    weights = torch.softmax(logits.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -torch.inf), -1)
    return torch.einsum("btnh,nho->bto", torch.einsum("bnts,bsnh->btnh", weights, v), p["out"]["kernel"]), p


def test_qk_norm_equals_torch_forward_and_gradients():
    layer = _layer()
    x = np.random.default_rng(0).standard_normal((B, T, E))
    params = _params(layer, x)
    theirs, p = _torch_reference(params, x)
    cotangent = np.random.default_rng(1).standard_normal(theirs.shape)
    theirs.backward(torch.tensor(cotangent))

    @jax.jit  # one compile for the whole layer and its VJP (eager dispatch compiles every op on its own)
    def forward_and_grads(params, cotangent):
        y, vjp = jax.vjp(lambda p: layer.apply({"params": p}, x, is_causal=True), params)
        return y, vjp(cotangent)[0]

    y, grads = forward_and_grads(params, cotangent)
    np.testing.assert_allclose(y, theirs.detach().numpy(), rtol=0, atol=1e-12)
    for group, leaves in grads.items():
        for leaf, g in leaves.items():
            np.testing.assert_allclose(g, p[group][leaf].grad.numpy(), rtol=0, atol=1e-11, err_msg=f"{group}/{leaf}")


def test_qk_norm_decode_caches_normed_keys():
    """Token by token through the cache equals one causal pass (the cache holds normed, rotated keys)."""
    layer = _layer()
    x = np.random.default_rng(0).standard_normal((B, T, E))
    params = _params(layer, x)
    full = jax.jit(lambda p, x: layer.apply({"params": p}, x, is_causal=True))(params, x)
    cache = layer.init(jax.random.key(0), x, decode=True)["cache"]
    step = jax.jit(lambda p, c, x: layer.apply({"params": p, "cache": c}, x, decode=True, mutable=["cache"]))
    steps = []
    for t in range(T):
        y, mutated = step(params, cache, x[:, t : t + 1])
        cache = mutated["cache"]
        steps.append(y)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jl.RelativeMultiHeadAttention(num_heads=2, max_distance=3, qk_norm=functools.partial(RMSNorm, EPS)),
        lambda: jl.MultiHeadAttention(num_heads=2, add_bias_kv=True, qk_norm=functools.partial(RMSNorm, EPS)),
    ],
)
def test_qk_norm_refused_with_relative_tables_and_bias_kv(make):
    with pytest.raises(ValueError, match="qk_norm: expected None with relative tables"):
        make().init(jax.random.key(0), np.zeros((1, 3, 4)))
