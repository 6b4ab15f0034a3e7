"""The kernels' backward at a caller's residuals (Implementation.gradients_at, what each ring_attention step runs):
the keys split in chunks, each chunk's call given the out and lse of the whole softmax (and d_out) returns its
share of the whole gradient, so the chunks' dq summed, their dk / dv side by side and their bias rows' gradients
pulled back to one table equal jax.grad of the float64 reference over every key (tests/helpers.py). A position bias
of j - i rides along: each chunk reads the table at its true offsets (the default offset plus the chunk's place),
as the ring's pairs of chunks do, and its rows' cotangent (d_bias_rows) is pulled back through that reading.
Interpreted: pallas_gpu in float64, pallas_tpu (the flex kernel's backward) in float32 (the TPU kernels index in
int32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import allowed_loop, arrays, attention_reference, normwise
from jaxattn._core.call import AttentionCall
from jaxattn._core.offset_bias import OffsetBias
from jaxattn._dispatch import registry

B, T, N, K, H = 2, 24, 6, 3, 16
CHUNKS = (16, 24)  # S = 40 keys in two chunks of unequal length
S = sum(CHUNKS)
LO = -(S - 1)  # the table holds one bias per offset j - i of the whole call: LO .. T - 1


def chunk_bias(table, start, size):
    """The chunk's OffsetBias at its own default positions: the table [N, T + S - 1] at the true offset, the
    chunk's default offset s - t - (size - T) plus start + size - S (its keys' place among all S)."""
    delta = start + size - S

    def of_offset(d):  # [...,T,s] -> [...,N,T,s]
        return jnp.moveaxis(jnp.take(table, jnp.clip(d + delta - LO, 0, table.shape[-1] - 1), axis=1), 0, -3)

    return OffsetBias(of_offset)


def reference(q, k, v, table, lengths):
    """jax.numpy over every key, float64-capable, independent of jaxattn: the bias built pair by pair."""
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    bias = table[:, (s - (t + S - T)) - LO]  # [N,T,S], bottom-right aligned offsets
    allowed = allowed_loop(B, N, T, S, key_value_seq_lengths=lengths)
    return attention_reference(q, k, v, allowed, bias=jnp.broadcast_to(bias, (B, N, T, S)), return_lse=True)


@pytest.mark.parametrize(
    "implementation, dtype, tol",
    [("pallas_gpu", np.float64, 1e-12), ("pallas_tpu", np.float32, 2e-5)],
)
def test_chunks_backward_at_the_whole_softmax_equals_the_whole_gradient(implementation, dtype, tol):
    x64 = dtype == np.float64
    with jax.enable_x64(x64):
        shapes = (B, T, N, H), (B, S, K, H), (B, S, K, H), (N, T + S - 1), (B, T, N, H)
        q, k, v, table, d_out = arrays(3, *shapes, dtype=dtype)
        lengths = np.array([S, 29], np.int32)  # the second example's last keys are padding, in the second chunk
        assert q.dtype == dtype  # float64 where asked: no silent float32

        (out, lse), pullback = jax.vjp(lambda *a: reference(*a, lengths), q, k, v, table)
        expected = pullback((d_out, jnp.zeros_like(lse)))

        gradients_at = registry.REGISTRY[implementation].gradients_at
        dq, dks, dvs, d_table = jnp.zeros_like(q), [], [], jnp.zeros_like(table)
        for start, size in zip(np.cumsum((0,) + CHUNKS[:-1]), CHUNKS):
            bias = chunk_bias(table, start, size)
            chunk_lengths = jnp.asarray(np.clip(lengths - start, 0, size))
            call = AttentionCall(key_value_seq_lengths=chunk_lengths, position_bias=bias)
            kc, vc = k[:, start : start + size], v[:, start : start + size]
            got = gradients_at(call, q, kc, vc, out, lse, d_out, True)
            assert got is not None, implementation
            dq_c, dk_c, dv_c, d_rows = got
            bounds = bias.offset_range(T, size, True)
            (d_table_c,) = jax.vjp(lambda tb: chunk_bias(tb, start, size).rows(*bounds), table)[1](d_rows)
            dq, d_table = dq + dq_c, d_table + d_table_c
            dks.append(dk_c)
            dvs.append(dv_c)
        got = (dq, jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1), d_table)
        for name, g, e in zip(("dq", "dk", "dv", "d table"), got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape, (name, g.dtype, g.shape)
            assert normwise(g, e) < tol, (name, normwise(g, e))
