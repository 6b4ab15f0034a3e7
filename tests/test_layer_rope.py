"""The layers' `rope` option and per-projection `use_bias`, against torch (autograd) and on the cache.

Reference: torch float64, written out: projections as einsums, torchref.apply_rope on the projected
queries and keys, GQA by repeating key/value heads, causal softmax attention, output projection. Sizes:
B=3, T=7, E=13, N=6 heads over K=2 key/value heads (N must hold K groups), H=10 (RoPE needs an even head
dim), Hv=10. float64 runs need x64 (tests/conftest.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxattn.linen as jl
import jaxattn.nnx as jn
from torchref.positions import apply_rope as torch_rope

B, T, E, N, K, H = 3, 7, 13, 6, 2, 10
BASE = 500.0


def _layer(**kw):
    return jl.MultiHeadAttention(num_heads=N, num_kv_heads=K, head_dim=H, rope=jl.RoPE(base=BASE), **kw)


def _params(layer, x):
    params = layer.init(jax.random.key(1), x)["params"]
    rng = np.random.default_rng(3)  # non-zero biases: a misplaced bias must show
    return jax.tree.map(lambda p: rng.standard_normal(p.shape) * 0.5, params)


def _torch_reference(params, x, positions):
    """Causal GQA attention with RoPE at `positions` [B,T], in torch float64 (differentiable in params)."""
    p = {
        g: {k: torch.tensor(np.asarray(v), requires_grad=True) for k, v in leaves.items()}
        for g, leaves in params.items()
    }
    x = torch.tensor(np.asarray(x))
    q = torch.einsum("bte,enh->btnh", x, p["query"]["kernel"]) + p["query"].get("bias", 0)
    k = torch.einsum("bte,ekh->btkh", x, p["key"]["kernel"]) + p["key"].get("bias", 0)
    v = torch.einsum("bte,ekh->btkh", x, p["value"]["kernel"]) + p["value"].get("bias", 0)
    pos = torch.as_tensor(np.asarray(positions))
    q, k = torch_rope(q, pos, base=BASE), torch_rope(k, pos, base=BASE)
    k, v = k.repeat_interleave(N // K, dim=2), v.repeat_interleave(N // K, dim=2)
    logits = torch.einsum("btnh,bsnh->bnts", q, k) * H**-0.5
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    weights = torch.softmax(logits.masked_fill(~causal, -torch.inf), -1)
    z = torch.einsum("bnts,bsnh->btnh", weights, v)
    y = torch.einsum("btnh,nho->bto", z, p["out"]["kernel"]) + p["out"].get("bias", 0)
    return y, p


@pytest.mark.parametrize(
    "use_bias",
    [
        pytest.param(True, marks=pytest.mark.slow),
        ("query", "key", "value"),
        pytest.param(False, marks=pytest.mark.slow),
    ],
)  # partial biases: both kinds
def test_rope_layer_equals_torch_forward_and_gradients(use_bias):
    layer = _layer(use_bias=use_bias)
    x = np.random.default_rng(0).standard_normal((B, T, E))
    params = _params(layer, x)
    want_groups = {"query", "key", "value", "out"} if use_bias is True else set(use_bias or ())
    assert {g for g, leaves in params.items() if "bias" in leaves} == want_groups
    # HF-style positions of a left-padded batch: 0 on padding, then 0, 1, 2, ... on the real tokens
    positions = np.maximum(np.arange(T)[None] - np.array([[0], [3], [1]]), 0)
    cot = np.random.default_rng(5).standard_normal((B, T, E))

    def loss(p):
        return jnp.sum(layer.apply({"params": p}, x, is_causal=True, rope_positions=positions) * cot)

    ours = layer.apply({"params": params}, x, is_causal=True, rope_positions=positions)
    grads = jax.grad(loss)(params)
    theirs, tparams = _torch_reference(params, x, positions)
    (theirs * torch.tensor(cot)).sum().backward()
    assert ours.dtype == jnp.float64
    np.testing.assert_allclose(ours, theirs.detach().numpy(), rtol=0, atol=1e-12)
    for group, leaves in tparams.items():
        for leaf, tensor in leaves.items():
            np.testing.assert_allclose(
                grads[group][leaf], tensor.grad.numpy(), rtol=0, atol=1e-11, err_msg=f"{group}/{leaf}"
            )
    # default rope positions = the attention's own (arange for self-attention)
    plain = layer.apply({"params": params}, x, is_causal=True)
    np.testing.assert_allclose(
        plain, _torch_reference(params, x, np.tile(np.arange(T), (B, 1)))[0].detach(), rtol=0, atol=1e-12
    )


def test_rope_decode_rotates_keys_before_caching():
    """Prefill 3 tokens then one per call: equal to the full causal pass at the same rope positions."""
    layer = _layer()
    x = np.random.default_rng(0).standard_normal((B, T, E))
    params = _params(layer, x)
    positions = np.maximum(np.arange(T)[None] - np.array([[0], [3], [1]]), 0)
    full = layer.apply({"params": params}, x, is_causal=True, rope_positions=positions)
    cache = layer.init(jax.random.key(0), np.zeros((B, T, E)), decode=True)["cache"]
    step = jax.jit(
        lambda c, xs, pos: layer.apply(
            {"params": params, "cache": c}, xs, decode=True, rope_positions=pos, mutable=["cache"]
        )
    )
    out, state = step(cache, x[:, :3], positions[:, :3])
    outs = [out]
    for t in range(3, T):
        out, state = step(state["cache"], x[:, t : t + 1], positions[:, t : t + 1])
        outs.append(out)
    np.testing.assert_allclose(np.concatenate(outs, 1), full, rtol=0, atol=1e-12)


def test_nnx_layer_has_the_same_options():
    from flax import nnx

    layer = jn.MultiHeadAttention(
        E, N, H, num_kv_heads=K, use_bias=("query", "key", "value"), rope=jn.RoPE(base=BASE), rngs=nnx.Rngs(0)
    )
    assert "bias" not in layer.params()["out"] and "bias" in layer.params()["query"]
    x = np.random.default_rng(0).standard_normal((B, T, E))
    linen = _layer(use_bias=("query", "key", "value"))
    got = layer(x, is_causal=True)
    want = linen.apply({"params": layer.params()}, x, is_causal=True)
    np.testing.assert_allclose(got, want, rtol=0, atol=0)


def test_scaled_frequencies_replace_the_base():
    """RoPE(frequencies=theta / 2) equals rotating at half the positions (HF's "linear" scaling, factor 2)."""
    x = np.random.default_rng(0).standard_normal((B, T, E))
    theta = 1.0 / BASE ** (np.arange(0, H, 2) / H)
    scaled = jl.MultiHeadAttention(num_heads=N, num_kv_heads=K, head_dim=H, rope=jl.RoPE(frequencies=tuple(theta / 2)))
    params = _params(scaled, x)
    even = 2 * np.tile(np.arange(T), (B, 1))
    got = scaled.apply({"params": params}, x, is_causal=True, rope_positions=even)
    want = _layer().apply({"params": params}, x, is_causal=True, rope_positions=even // 2)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    "make, call, match",
    [
        (lambda: jl.MultiHeadAttention(num_heads=N, use_bias=("query", "bogus")), {}, "use_bias: expected"),
        (lambda: jl.MultiHeadAttention(num_heads=N, rope={"base": 1e4}), {}, "rope: expected None or a RoPE"),
        (
            lambda: jl.MultiHeadAttention(num_heads=N),
            {"rope_positions": np.zeros((B, T), int)},
            "rope_positions: expected None unless",
        ),
        (
            lambda: jl.RelativeMultiHeadAttention(num_heads=N, max_distance=2, rope=jl.RoPE()),
            {},
            "rope: expected None with relative tables",
        ),
        (
            lambda: jl.MultiHeadAttention(num_heads=N, rope=jl.RoPE(frequencies=(1.0, 0.5))),
            {},
            r"frequencies: expected shape \[1\]",
        ),
    ],
)
def test_bad_rope_options_raise(make, call, match):
    x = np.zeros((B, T, 12))
    with pytest.raises(ValueError, match=match):
        make().init(jax.random.key(0), x, **call)
