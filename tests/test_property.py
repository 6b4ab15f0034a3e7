"""Property test: jaxattn == torchref (the independent torch oracle) in float64, values and gradients.

Hypothesis draws batch dims, prime sizes, head groupings, masks, bottom-right causal with T <= S, and
Shaw tables (shared or per head), and checks the plain call and one of jit / vmap / grad-of-jit.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import jaxattn
import torchref
from helpers import assert_float64, normwise

PRIMES = [1, 2, 3, 5, 7]
TOL = 1e-12


@st.composite
def problems(draw):
    batch = tuple(draw(st.lists(st.sampled_from([2, 3]), max_size=2)))
    K = draw(st.sampled_from([1, 2, 3]))
    N = K * draw(st.sampled_from([1, 2, 3]))
    T = draw(st.sampled_from(PRIMES))
    S = draw(st.sampled_from([s for s in PRIMES + [11] if s >= T]))
    H, Hv = draw(st.sampled_from([(2, 3), (5, 3), (3, 7)]))
    relative = draw(st.sampled_from(["none", "shared", "per_head"]))
    return dict(
        batch=batch,
        N=N,
        K=K,
        T=T,
        S=S,
        H=H,
        Hv=Hv,
        relative=relative,
        max_distance=draw(st.sampled_from([0, 1, 3])),
        is_causal=draw(st.booleans()),
        with_mask=draw(st.booleans()),
        transform=draw(st.sampled_from(["jit", "vmap", "none"])),
        seed=draw(st.integers(0, 2**16)),
    )


def arrays(p):
    rng = np.random.default_rng(p["seed"])
    b, T, S, N, K, H, Hv = p["batch"], p["T"], p["S"], p["N"], p["K"], p["H"], p["Hv"]
    R = 2 * p["max_distance"] + 1
    heads = {"none": None, "shared": (), "per_head": (N,)}[p["relative"]]
    out = {
        "q": rng.normal(size=(*b, T, N, H)),
        "k": rng.normal(size=(*b, S, K, H)),
        "v": rng.normal(size=(*b, S, K, Hv)),
        "cot": rng.normal(size=(*b, T, N, Hv)),
    }
    if heads is not None:
        out["tk"], out["tv"] = rng.normal(size=(R, *heads, H)), rng.normal(size=(R, *heads, Hv))
    mask = rng.random((*b, N, T, S)) > 0.25 if p["with_mask"] else None
    return out, mask


def run_jax(p, x, mask, transform):
    names = sorted(k for k in x if k != "cot")

    def f(*args):
        a = dict(zip(names, args))
        kw = dict(mask=mask, is_causal=p["is_causal"])
        if "tk" in a:
            return jaxattn.shaw_relative_attention(
                a["q"], a["k"], a["v"], a["tk"], a["tv"], max_distance=p["max_distance"], **kw
            )
        return jaxattn.dot_product_attention(a["q"], a["k"], a["v"], **kw)

    loss = lambda *args: jnp.sum(f(*args) * x["cot"])
    args = [jnp.asarray(x[n]) for n in names]
    if transform == "jit":
        f, loss = jax.jit(f), jax.jit(loss)
    out = f(*args)
    if transform == "vmap" and p["batch"] and mask is None:
        # vmap over the first batch axis (tables are shared, so not mapped)
        axes = [0 if n in "qkv" else None for n in names]
        mapped = jax.vmap(f, in_axes=axes)(*args)
        assert normwise(mapped, out) <= TOL
    grads = jax.grad(loss, argnums=tuple(range(len(names))))(*args)
    assert_float64(out, grads)
    return out, dict(zip(names, grads))


def run_torch(p, x, mask):
    t = {n: torch.tensor(a, dtype=torch.float64, requires_grad=(n != "cot")) for n, a in x.items()}
    kw = dict(mask=None if mask is None else torch.tensor(mask), is_causal=p["is_causal"])
    if "tk" in t:
        out = torchref.shaw_relative_attention(
            t["q"], t["k"], t["v"], t["tk"], t["tv"], max_distance=p["max_distance"], **kw
        )
    else:
        out = torchref.dot_product_attention(t["q"], t["k"], t["v"], **kw)
    (out * t["cot"]).sum().backward()
    return out.detach().numpy(), {n: t[n].grad.numpy() for n in t if n != "cot"}


@pytest.mark.slow  # 12 drawn problems, each a fresh compile of values and gradients
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_jaxattn_equals_torchref_float64(p):
    x, mask = arrays(p)
    out, grads = run_jax(p, x, mask, p["transform"])
    ref, ref_grads = run_torch(p, x, mask)
    assert normwise(out, ref) <= TOL, p
    # Some gradients are exactly zero in exact arithmetic (max_distance=0 makes the key table a per-row
    # constant, which softmax ignores): both sides then hold rounding noise, so every gradient's error is
    # measured against the larger of its own norm and the query gradient's (the problem's scale).
    scale = np.linalg.norm(ref_grads["q"])
    for name, g in grads.items():
        err = normwise(g, ref_grads[name], floor=scale)
        assert err <= TOL, (name, err, p)


@pytest.mark.parametrize("K", [1, 2])
def test_grouped_query_multi_head_module_equals_torchref(K):
    """jaxattn.multi_head_attention on params from torchref's nn.Linear module, with GQA and Hv != H."""
    torch.manual_seed(0)
    Eq, N, H, Hv, Eo, T = 17, 6, 5, 7, 11, 3
    m = torchref.MultiHeadAttention(Eq, N, H, num_kv_heads=K, value_head_dim=Hv, out_features=Eo, dtype=torch.float64)
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    w = lambda name, heads, dim: sd[f"{name}.weight"].T.reshape(-1, heads, dim)
    params = {
        "query": {"kernel": w("q_proj", N, H), "bias": sd["q_proj.bias"].reshape(N, H)},
        "key": {"kernel": w("k_proj", K, H), "bias": sd["k_proj.bias"].reshape(K, H)},
        "value": {"kernel": w("v_proj", K, Hv), "bias": sd["v_proj.bias"].reshape(K, Hv)},
        "out": {"kernel": sd["out_proj.weight"].T.reshape(N, Hv, Eo), "bias": sd["out_proj.bias"]},
    }
    x = np.random.default_rng(1).normal(size=(2, T, Eq))
    ours = jaxattn.multi_head_attention(params, x, is_causal=True)
    ref = m(torch.tensor(x), is_causal=True).detach().numpy()
    assert normwise(ours, ref) <= TOL
