"""jaxattn.gated_delta_rule (chunked and recurrent), its one-token step and the family helpers, in float64
against the token-by-token recurrence of tests/helpers.py (outputs, final state, gradients through q, k, v, g,
beta and the initial state); memory from XLA's compiled analysis; bad input.

Sizes: B=2, T=13 (not a multiple of the chunk C=4), K=2 key heads, N=6 value heads, H=5, Hv=7."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxattn
import torchref
from helpers import arrays, assert_float64, delta_rule_reference, grad_of_sum, normwise, temp_bytes

B, T, K, N, H, Hv, C = 2, 13, 2, 6, 5, 7, 4


def inputs(seed=0, *, batch=(B,), T=T):
    q, k, v, a, b, s0 = arrays(
        seed,
        (*batch, T, K, H),
        (*batch, T, K, H),
        (*batch, T, N, Hv),
        (*batch, T, N),
        (*batch, T, N),
        (*batch, N, H, Hv),
    )
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)  # unit keys, as the family l2-normalises them
    return q, k, v, -jax.nn.softplus(a), jax.nn.sigmoid(b), 0.5 * s0


def both(implementation, **kw):
    return lambda q, k, v, g, beta, s0: jaxattn.gated_delta_rule(
        q, k, v, g, beta, initial_state=s0, return_state=True, implementation=implementation, **kw
    )


@pytest.mark.parametrize("implementation", ["chunked", pytest.param("recurrent", marks=pytest.mark.slow)])
def test_equals_the_recurrence_with_gradients(implementation):
    args = inputs()
    w_out, w_state = arrays(7, (B, T, N, Hv), (B, N, H, Hv))

    def loss_and_grads(f):  # one compiled program: (out, state) and the gradients of a weighted sum of both
        def weighted(*a):
            out, state = f(*a)
            return jnp.sum(out * w_out) + jnp.sum(state * w_state), (out, state)

        return jax.jit(jax.value_and_grad(weighted, argnums=range(6), has_aux=True))(*args)

    (_, (out, state)), grads = loss_and_grads(both(implementation, chunk_size=C))
    (_, (ref_out, ref_state)), ref_grads = loss_and_grads(delta_rule_reference)
    assert_float64(out, state, grads)
    assert normwise(out, ref_out) <= 1e-12 and normwise(state, ref_state) <= 1e-12
    for name, got, want in zip(["q", "k", "v", "g", "beta", "initial_state"], grads, ref_grads, strict=True):
        assert normwise(got, want) <= 1e-12, name


@pytest.mark.slow
def test_chunk_size_and_batch_layouts_change_nothing():
    q, k, v, g, beta, s0 = inputs(1)
    want = jaxattn.gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=64)  # one padded chunk
    for C_ in (1, 3, 13):
        assert normwise(jaxattn.gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=C_), want) <= 1e-13
    # vmap over the batch axis, and a leading batch dim that broadcasts (q, k shared by both examples)
    vmapped = jax.vmap(lambda *a: jaxattn.gated_delta_rule(*a[:5], initial_state=a[5], chunk_size=C))(
        q, k, v, g, beta, s0
    )
    assert normwise(vmapped, want) <= 1e-13
    shared = jaxattn.gated_delta_rule(q[:1], k[:1], v, g, beta, initial_state=s0, chunk_size=C)
    assert (
        normwise(
            shared,
            jaxattn.gated_delta_rule(
                jnp.broadcast_to(q[:1], q.shape),
                jnp.broadcast_to(k[:1], k.shape),
                v,
                g,
                beta,
                initial_state=s0,
                chunk_size=C,
            ),
        )
        <= 1e-13
    )


@pytest.mark.slow
def test_decode_steps_continue_a_prefill():
    q, k, v, g, beta, s0 = inputs(2)
    full, full_state = jaxattn.gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=C, return_state=True)
    prefix = 9
    out, state = jaxattn.gated_delta_rule(
        *(x[:, :prefix] for x in (q, k, v, g, beta)), initial_state=s0, chunk_size=C, return_state=True
    )
    step = jax.jit(jaxattn.gated_delta_rule_step)
    outs = [out]
    for t in range(prefix, T):
        o, state = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        outs.append(o[:, None])
    assert normwise(jnp.concatenate(outs, axis=1), full) <= 1e-13 and normwise(state, full_state) <= 1e-13


@pytest.mark.slow
def test_torchref_twin_and_bfloat16():
    q, k, v, g, beta, s0 = inputs(3)
    to = lambda x: torch.from_numpy(np.array(x))
    want = torchref.gated_delta_rule(*map(to, (q, k, v, g, beta)), initial_state=to(s0))
    assert normwise(jaxattn.gated_delta_rule(q, k, v, g, beta, initial_state=s0), want) <= 1e-12
    half = jaxattn.gated_delta_rule(*(x.astype(jnp.bfloat16) for x in (q, k, v)), g, beta, initial_state=s0)
    assert half.dtype == jnp.bfloat16 and normwise(half, want) <= 3e-2


@pytest.mark.slow
def test_memory_is_linear_in_length():
    """Forward and backward at T and 4T: O(T x C) grows 4x; a [T,T] matrix (T=4096: 64 MiB per head) would
    be 16x."""

    def temp(T):
        shapes = [(1, T, 2, 64), (1, T, 2, 64), (1, T, 4, 64), (1, T, 4), (1, T, 4)]
        return temp_bytes(grad_of_sum(jaxattn.gated_delta_rule, (0, 1, 2, 3, 4)), *shapes)

    small, large = temp(1024), temp(4096)
    assert large <= 4.5 * small, (small, large)
    assert large < 4 * 4096 * 4096 * 4 / 2, large  # under half the [N,T,T] float32 logits of softmax attention


@pytest.mark.slow
def test_conv1d_and_gated_norm():
    x, w, bias, gate = arrays(4, (B, T, 11), (11, 4), (11,), (B, T, 11))
    to = lambda a: torch.from_numpy(np.array(a))
    full = jaxattn.causal_conv1d(x, w, bias)
    assert normwise(full, torchref.causal_conv1d(to(x), to(w), to(bias))) <= 1e-13
    # prefill then one token at a time from the conv state
    y, state = jaxattn.causal_conv1d(x[:, :6], w, bias, return_state=True)
    ys = [y]
    for t in range(6, T):
        y, state = jaxattn.causal_conv1d(x[:, t : t + 1], w, bias, state=state, return_state=True)
        ys.append(y)
    assert normwise(jnp.concatenate(ys, axis=1), full) <= 1e-13
    assert normwise(jaxattn.gated_rms_norm(x, gate, bias), torchref.gated_rms_norm(to(x), to(gate), to(bias))) <= 1e-13


@pytest.mark.parametrize(
    "change, match",
    [
        ({"g": (B, T, N + 1)}, r"g: expected shape \[\.\.\.,13,6\].*got shape \[2,13,7\]"),
        ({"beta": (B, T - 1, N)}, r"beta: expected shape \[\.\.\.,13,6\].*got shape \[2,12,6\]"),
        ({"value": (B, T, 5, Hv)}, r"value: expected .*K=2.*got N=5"),
        ({"initial_state": (B, N, Hv, H)}, r"initial_state: expected shape \[\.\.\.,6,5,7\].*got shape \[2,6,7,5\]"),
    ],
)
def test_bad_shapes(change, match):
    shapes = {
        "query": (B, T, K, H),
        "key": (B, T, K, H),
        "value": (B, T, N, Hv),
        "g": (B, T, N),
        "beta": (B, T, N),
        "initial_state": (B, N, H, Hv),
    } | change
    a = dict(zip(shapes, arrays(5, *shapes.values())))
    with pytest.raises(ValueError, match=match):
        jaxattn.gated_delta_rule(**a)


def test_bad_chunk_size():
    a = arrays(6, (B, T, K, H), (B, T, K, H), (B, T, N, Hv), (B, T, N), (B, T, N))
    for bad in (0, -4):
        with pytest.raises(ValueError, match="chunk_size: expected an int >= 1"):
            jaxattn.gated_delta_rule(*a, chunk_size=bad)
