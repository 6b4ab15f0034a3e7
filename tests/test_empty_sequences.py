"""Empty sequences (T = 0 or S = 0) on every path: what the dense path gives, with finite gradients.

T = 0: an empty [...,0,N,Hv] output. S = 0: no query has an allowed key, so every output is zero (the
library's rule for fully masked rows). Gradients are zero (nothing depends on the inputs) and finite.
Axes: B=2, N=3, K=1 (grouped), H=5, Hv=7; the non-empty length is 11.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn

B, N, K, H, Hv, E, LENGTH = 2, 3, 1, 5, 7, 13, 11
MESH = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("seq",))
SHAW_TABLE = np.random.default_rng(2).standard_normal((3, N, H))
T5_TABLE = np.random.default_rng(3).standard_normal((8, N))

PATHS = {
    "dense": lambda q, k, v: jaxattn.dot_product_attention(q, k, v, is_causal=True, implementation="dense"),
    "blockwise": lambda q, k, v: jaxattn.dot_product_attention(q, k, v, is_causal=True, implementation="blockwise"),
    "blockwise_lengths": lambda q, k, v: jaxattn.blockwise_attention(q, k, v, key_value_seq_lengths=jnp.array([0, 0])),
    "shaw_dense": lambda q, k, v: jaxattn.shaw_relative_attention(
        q, k, v, SHAW_TABLE, max_distance=1, implementation="dense"
    ),
    "shaw_blockwise": lambda q, k, v: jaxattn.shaw_relative_attention(
        q, k, v, SHAW_TABLE, max_distance=1, implementation="blockwise"
    ),
    "t5_dense": lambda q, k, v: jaxattn.t5_attention(q, k, v, T5_TABLE, max_distance=16),
    "t5_blockwise": lambda q, k, v: jaxattn.t5_attention(
        q, k, v, T5_TABLE, max_distance=16, implementation="blockwise"
    ),
    "ring": lambda q, k, v: jaxattn.ring_attention(q, k, v, mesh=MESH, sequence_axis="seq", is_causal=True),
}


def _qkv(T, S):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((B, T, N, H)), rng.standard_normal((B, S, K, H)), rng.standard_normal((B, S, K, Hv)))


@pytest.mark.parametrize("T, S", [(0, LENGTH), (LENGTH, 0)])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_empty_sequence_gives_zeros_and_finite_gradients(path, T, S):
    f = PATHS[path]
    q, k, v = _qkv(T, S)
    out = f(q, k, v)
    assert out.shape == (B, T, N, Hv) and out.dtype == np.float64
    np.testing.assert_array_equal(out, np.zeros((B, T, N, Hv)))
    grads = jax.grad(lambda *x: jnp.sum(f(*x) ** 2), argnums=(0, 1, 2))(q, k, v)
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and np.isfinite(g).all()


@pytest.mark.parametrize("implementation", [pytest.param("dense", marks=pytest.mark.slow), "blockwise"])
@pytest.mark.parametrize("T, S", [(0, LENGTH), (LENGTH, 0)])
def test_multi_head_attention_with_empty_sequence(implementation, T, S):
    params = jaxattn.init_multi_head_attention(
        jax.random.key(0), E, N, H, num_kv_heads=K, value_head_dim=Hv, dtype=jnp.float64
    )
    rng = np.random.default_rng(1)
    x_q, x_kv = rng.standard_normal((B, T, E)), rng.standard_normal((B, S, E))
    out = jaxattn.multi_head_attention(params, x_q, x_kv, implementation=implementation)
    # zero attention output -> the output projection's bias alone (zeros at init), [B,T,E]
    np.testing.assert_array_equal(out, np.broadcast_to(params["out"]["bias"], (B, T, E)))
    grad = jax.grad(lambda p: jnp.sum(jaxattn.multi_head_attention(p, x_q, x_kv, implementation=implementation)))(
        params
    )
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grad))
