"""The memory targets of the performance work, asserted from XLA's compiled memory analysis.

Nothing runs: every function is lowered and compiled on abstract shapes (jax.ShapeDtypeStruct), and
`temp_size_in_bytes` is XLA's own count of the scratch memory beyond arguments and outputs. The figures
are deterministic, so a regression (a [T,S] array sneaking into the blockwise path, a table copy in the
seed-000 form) fails here rather than in a benchmark nobody reads. No wall-clock time is asserted.
"""

import jax
import jax.numpy as jnp
import pytest

import jaxattn
from helpers import grad_of_sum, temp_bytes

MiB, GiB = 2**20, 2**30


def causal(implementation):
    return lambda q, k, v: jaxattn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def test_long_context_forward_backward_under_1_gib():
    shape = (1, 16384, 8, 64)  # dense logits alone: 8 GiB
    assert temp_bytes(grad_of_sum(causal(None), (0, 1, 2)), shape, shape, shape) < GiB
    assert temp_bytes(causal(None), shape, shape, shape) < 256 * MiB


def test_blockwise_memory_is_linear_in_length():
    def grad_temp(S):
        shape = (1, S, 8, 64)
        return temp_bytes(grad_of_sum(causal("blockwise"), (0, 1, 2)), shape, shape, shape)

    small, large = grad_temp(4096), grad_temp(16384)
    # 4x the length: O(S) state (q, k, v, their gradients) grows 4x, the tiles not at all; O(S^2) would be 16x.
    assert large <= 4.2 * small, (small, large)


@pytest.mark.parametrize("per_head", [pytest.param(False, marks=pytest.mark.slow), True])
def test_shaw_within_twice_plain_attention(per_head):
    B, S, N, H, max_distance = 1, 2048, 8, 64, 16
    R = 2 * max_distance + 1
    table = (R, N, H) if per_head else (R, H)
    shapes = [(B, S, N, H)] * 3 + [table] * 2
    plain = temp_bytes(jax.nn.dot_product_attention, *shapes[:3])

    def shaw(q, k, v, tk, tv):
        return jaxattn.shaw_relative_attention(q, k, v, tk, tv, max_distance=max_distance)

    assert temp_bytes(shaw, *shapes) <= 2 * plain
    assert temp_bytes(grad_of_sum(shaw, (0, 1, 2, 3, 4)), *shapes) <= 2 * temp_bytes(
        grad_of_sum(jax.nn.dot_product_attention, (0, 1, 2)), *shapes[:3]
    )


def seed000_naive(X, W_Q, W_K, W_V, a_K, a_V):
    """The seed-000 answer's torch code ported line by line to jnp."""
    XW_Q, XW_K, XW_V = (jnp.einsum("bshd,hde->bshe", X, W) for W in (W_Q, W_K, W_V))
    e = (XW_Q[:, :, None] * (XW_K[:, None] + a_K)).sum(axis=-1) / jnp.sqrt(X.shape[-1])
    alpha = jax.nn.softmax(e, axis=2)
    return jnp.einsum("bijh,bijhd->bihd", alpha, XW_V[:, None] + a_V)


def seed000_jaxattn(X, W_Q, W_K, W_V, a_K, a_V):
    q, k, v = (jnp.einsum("bsnd,nde->bsne", X, W) for W in (W_Q, W_K, W_V))
    return jaxattn.relative_attention(q, k, v, a_K, a_V)


def test_seed000_quarter_of_the_naive_port():
    B, S, N, H = 4, 256, 8, 64
    shapes = [(B, S, N, H), (N, H, H), (N, H, H), (N, H, H), (S, S, N, H), (S, S, N, H)]
    naive, ours = temp_bytes(seed000_naive, *shapes), temp_bytes(seed000_jaxattn, *shapes)
    assert ours <= naive / 4, (ours, naive)
    # and in absolute terms: no copy of a 128 MiB table, only a few [B,N,T,S]-sized arrays (8 MiB each)
    assert ours <= 48 * MiB, ours
