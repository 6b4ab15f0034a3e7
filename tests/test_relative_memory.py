"""The relative forms never build the seed answer's [B,T,S,N,H] tensor, nor Shaw's [T,S,H] gather.

Read from XLA's compiled memory analysis (deterministic; nothing is run, shapes are abstract).
"""

import jax
import jax.numpy as jnp
import pytest

import jaxattn
from helpers import grad_of_sum, temp_bytes

ITEM = 4  # bytes of a float32


def naive_seed000(q, k, v, a_k, a_v):
    """The seed answer ported literally: it materialises [B,T,S,N,H] (our bound's yardstick)."""
    e = jnp.sum(q[:, :, None] * (k[:, None] + a_k), axis=-1) * q.shape[-1] ** -0.5
    alpha = jax.nn.softmax(e, axis=2)
    return jnp.einsum("btsn,btsnh->btnh", alpha, v[:, None] + a_v)


def test_relative_attention_never_builds_the_batch_pair_tensor():
    S, N, H = 256, 8, 64
    per_example = S * S * N * H * ITEM  # one example's [T,S,N,H] slice of the seed's [B,T,S,N,H]: 128 MiB

    def temps(fn, B):
        return temp_bytes(fn, *([(B, S, N, H)] * 3 + [(S, S, N, H)] * 2))

    # The tables are [T,S,N,H] already; what must not happen is memory growing by a pair tensor per example.
    for fn in (jaxattn.relative_attention, grad_of_sum(jaxattn.relative_attention, (0, 1, 2, 3, 4))):
        growth = (temps(fn, 8) - temps(fn, 1)) / 7
        assert growth <= per_example / 8, (growth, per_example)
    naive_growth = (temps(naive_seed000, 8) - temps(naive_seed000, 1)) / 7
    assert naive_growth >= per_example  # the yardstick really does build it


@pytest.mark.parametrize("per_head", [pytest.param(False, marks=pytest.mark.slow), True])
def test_shaw_far_below_a_gather(per_head):
    B, S, N, H, max_distance = 1, 2048, 8, 64, 16
    R = 2 * max_distance + 1
    table = (R, N, H) if per_head else (R, H)
    shaw = lambda q, k, v, tk, tv: jaxattn.shaw_relative_attention(q, k, v, tk, tv, max_distance=max_distance)
    shapes = [(B, S, N, H)] * 3 + [table] * 2
    gather = S * S * H * ITEM  # one [T,S,H] gather: 1 GiB
    logits = B * N * S * S * ITEM  # one [N,T,S] float32 array: 128 MiB
    ours = temp_bytes(shaw, *shapes)
    plain = temp_bytes(jaxattn.dot_product_attention, *shapes[:3])
    assert ours < gather, (ours, gather)
    assert ours <= B * S * S * N * H * ITEM / 8
    # Beyond plain attention, only a few [N,T,S]-sized arrays (gathered key term, bucket sums' input).
    assert ours - plain <= 3 * logits, (ours, plain, logits)
    ours_grad = temp_bytes(grad_of_sum(shaw, (0, 1, 2, 3, 4)), *shapes)
    assert ours_grad < gather, (ours_grad, gather)
