"""The five seed documents: each is a crosscheck case that passes in float64 under plain, jit and vmap,
plus the fact each seed was written to establish."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxattn
from crosscheck.catalogue import all_cases, run_case

SEEDS = ("seed000", "seed001", "seed002", "seed003", "seed004")


# The default run checks every seed under jit; plain and vmap (each seed's own eager and batched programs,
# ~25 s of compiling) run in the slow group, and `python -m crosscheck --all` runs all three again in CI.
@pytest.mark.parametrize(
    "transform", [pytest.param("plain", marks=pytest.mark.slow), "jit", pytest.param("vmap", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("name", SEEDS)
def test_seed_case_passes_in_float64(name, transform):
    report = run_case(name, dtype="float64", transform=transform)
    assert report.passed, report
    assert report.worst("output") <= 1e-12 and report.worst("grad") <= 1e-12
    assert {m.kind for m in report.metrics} == {"output", "grad"}


def _run_jax_side(name):
    setup = all_cases()[name].setup()
    inputs = {k: getattr(v, "value", v) for k, v in setup.inputs.items()}
    inputs = {k: jnp.asarray(v) for k, v in inputs.items()}
    if setup.params is None:
        return setup.jax_fn(**inputs), inputs
    return setup.jax_fn(setup.params, **inputs), inputs


def test_seed000_output_is_b_s_n_h():
    z, inputs = _run_jax_side("seed000")
    B, S, N, H = inputs["X"].shape
    assert len({B, S, N, H}) == 4  # distinct sizes: a swapped axis cannot hide
    assert z.shape == (B, S, N, H)


def test_seed004_weights_are_the_running_mean_grid():
    out, inputs = _run_jax_side("seed004")
    T = 8
    literal = np.array([[1 / (t + 1) if s <= t else 0.0 for s in range(T)] for t in range(T)])
    assert literal[1, :2].tolist() == [0.5, 0.5] and literal[2, 2] == 1 / 3
    weights = np.asarray(out["weights"])
    assert weights.shape == (3, T, T)
    np.testing.assert_allclose(weights, np.broadcast_to(literal, weights.shape), rtol=1e-15, atol=0)
    running_mean = np.cumsum(inputs["values"], axis=1) / np.arange(1, T + 1)[:, None]
    np.testing.assert_allclose(out["out"], running_mean, rtol=1e-13, atol=1e-15)


def test_seed004_zero_query_causal_weights_directly():
    T = 8
    q = jnp.zeros((1, T, 1, 2), jnp.float64)
    k = jnp.asarray(np.random.default_rng(4).standard_normal((1, T, 1, 2)))
    _, weights = jaxattn.dot_product_attention(q, k, k, is_causal=True, return_weights=True)
    np.testing.assert_allclose(weights[0, 0], np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None], rtol=1e-15)


def test_seed002_batched_matmul_is_bmm_and_per_head_is_packed():
    # the seed's own checks, in its sizes and letters (N = length, T = features here)
    torch.manual_seed(0)
    B, n_heads, N, d_k, T = 2, 4, 5, 3, 7
    a = torch.randn((B, n_heads, N, d_k), dtype=torch.float64)
    b = torch.randn((B, n_heads, N, d_k), dtype=torch.float64)
    bmm = torch.bmm(a.view((-1, N, d_k)), b.view((-1, N, d_k)).transpose(-2, -1)).view((B, n_heads, N, N))
    assert torch.allclose(bmm, a @ b.transpose(-2, -1), rtol=1e-15, atol=0)

    x = torch.randn((B, N, T), dtype=torch.float64)
    w_Q = torch.randn((n_heads, T, d_k), dtype=torch.float64)
    packed = x.view((-1, T)) @ w_Q.permute([1, 0, 2]).contiguous().view(T, -1)
    packed = packed.view((B, N, n_heads, d_k)).permute([0, 2, 1, 3])
    per_head = torch.stack([x @ w_Q[i] for i in range(n_heads)], dim=1)
    assert torch.allclose(per_head, packed, rtol=1e-14, atol=1e-15)


def test_seed001_notebook_function_equals_torch_mha():
    # the notebook's claim, in float64: its einsum function reproduces nn.MultiheadAttention(bias=False)
    torch.manual_seed(1)
    n_b, p, d, n_h = 3, 5, 12, 2
    X = torch.randn(n_b, p, d, dtype=torch.float64)
    M = torch.nn.MultiheadAttention(d, n_h, batch_first=True, dropout=0.0, bias=False, dtype=torch.float64)
    Y_torch, _ = M(X, X, X)
    Q, K, V = M.in_proj_weight[:d], M.in_proj_weight[d : 2 * d], M.in_proj_weight[2 * d :]
    L = M.out_proj.weight
    d_h = d // n_h
    KX = torch.einsum("ij,bsj->bsi", K, X).reshape(n_b, p, n_h, d_h)
    QX = torch.einsum("ij,bsj->bsi", Q, X).reshape(n_b, p, n_h, d_h)
    VX = torch.einsum("ij,bsj->bsi", V, X).reshape(n_b, p, n_h, d_h)
    D = torch.einsum("bshi,bthi->bhst", QX, KX)
    U = torch.exp(D / torch.sqrt(torch.tensor(d_h).double()))
    Ut = U / torch.sum(U, axis=3)[:, :, :, None]
    Z = torch.einsum("bhst,bthi->bshi", Ut, VX).reshape(n_b, p, n_h * d_h)
    Y = torch.einsum("ij,bsj->bsi", L, Z)
    assert (torch.norm(Y_torch - Y) / torch.norm(Y)).item() < 1e-14
