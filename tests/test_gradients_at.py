"""The kernels' backward at a caller's residuals (Implementation.gradients_at, what each ring_attention step runs):
the keys split in chunks, each chunk's call given the out and lse of the whole softmax (and d_out) returns its
share of the whole gradient, so the chunks' dq summed, their dk / dv side by side and their position terms'
gradients summed equal jax.grad of the float64 reference over every key (tests/helpers.py). Two position terms ride
along, as in the ring's steps:
- a position bias of j - i: each chunk reads the table at its true offsets (the default offset plus the chunk's
  place), as the ring's pairs of chunks do, and its rows' cotangent (ResidualGrads.bias_rows) is pulled back
  through that reading;
- Shaw's key table alone, each chunk at its keys' global positions (the table's cotangent, and q . A^K's share of
  dq, from the kernels' d row_bias).
Interpreted: pallas_gpu in float64, pallas_tpu (the flex kernel's backward; the bias only: its tables take the
default positions) in float32 (the TPU kernels index in int32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import allowed_loop, arrays, attention_reference, normwise, shaw_index_loop
from jaxattn._core.call import AttentionCall
from jaxattn._core.offset_bias import OffsetBias
from jaxattn._dispatch import registry

B, T, N, K, H = 2, 24, 6, 3, 16
CHUNKS = (16, 24)  # S = 40 keys in two chunks of unequal length
S = sum(CHUNKS)
LO = -(S - 1)  # the bias table holds one bias per offset j - i of the whole call: LO .. T - 1
MAX_DISTANCE = 5  # Shaw's: 11 rows, so that offsets clip inside one chunk and across both


def chunk_bias(table, start, size):
    """The chunk's OffsetBias at its own default positions: the table [N, T + S - 1] at the true offset, the
    chunk's default offset s - t - (size - T) plus start + size - S (its keys' place among all S)."""
    delta = start + size - S

    def of_offset(d):  # [...,T,s] -> [...,N,T,s]
        return jnp.moveaxis(jnp.take(table, jnp.clip(d + delta - LO, 0, table.shape[-1] - 1), axis=1), 0, -3)

    return OffsetBias(of_offset)


def reference(q, k, v, term, lengths, scheme):
    """jax.numpy over every key, independent of jaxattn: the bias or Shaw's key term built pair by pair."""
    allowed = allowed_loop(B, N, T, S, key_value_seq_lengths=lengths)
    if scheme == "bias":
        t, s = np.arange(T)[:, None], np.arange(S)[None, :]
        bias = jnp.broadcast_to(term[:, (s - (t + S - T)) - LO], (B, N, T, S))  # bottom-right aligned offsets
        return attention_reference(q, k, v, allowed, bias=bias, return_lse=True)
    rows = term[shaw_index_loop(T, S, MAX_DISTANCE)]  # [T,S,H]: the key table at each pair's clipped offset
    rel = jnp.einsum("btnh,tsh->bnts", q, rows, precision="highest")
    return attention_reference(q, k, v, allowed, rel_logits=rel, return_lse=True)


def chunk_call(scheme, term, start, size, lengths):
    """(the chunk's call, its term's pullback to the whole term: d chunk term -> d term)."""
    chunk_lengths = jnp.asarray(np.clip(lengths - start, 0, size))
    if scheme == "bias":
        bias = chunk_bias(term, start, size)
        bounds = bias.offset_range(T, size, True)  # bias_rows_at's offsets: the call's default positions
        pullback = jax.vjp(lambda tb: chunk_bias(tb, start, size).rows(*bounds), term)[1]
        call = AttentionCall(key_value_seq_lengths=chunk_lengths, position_bias=bias)
        return call, lambda grads: pullback(grads.bias_rows)[0]
    call = AttentionCall(
        key_value_seq_lengths=chunk_lengths,
        query_positions=jnp.arange(T, dtype=jnp.int32) + (S - T),  # the whole call's default positions
        key_positions=jnp.arange(start, start + size, dtype=jnp.int32),
        key_table=term,
        max_distance=MAX_DISTANCE,
    )
    return call, lambda grads: grads.key_table


@pytest.mark.parametrize(
    "implementation, scheme, dtype, tol",
    [
        ("pallas_gpu", "bias", np.float64, 1e-12),
        ("pallas_gpu", "key_table", np.float64, 1e-12),
        ("pallas_tpu", "bias", np.float32, 2e-5),
    ],
)
def test_chunks_backward_at_the_whole_softmax_equals_the_whole_gradient(implementation, scheme, dtype, tol):
    with jax.enable_x64(dtype == np.float64):
        term_shape = (N, T + S - 1) if scheme == "bias" else (2 * MAX_DISTANCE + 1, H)
        shapes = (B, T, N, H), (B, S, K, H), (B, S, K, H), term_shape, (B, T, N, H)
        q, k, v, term, d_out = arrays(3, *shapes, dtype=dtype)
        lengths = np.array([S, 29], np.int32)  # the second example's last keys are padding, in the second chunk
        assert q.dtype == dtype  # float64 where asked: no silent float32

        (out, lse), pullback = jax.vjp(lambda *a: reference(*a, lengths, scheme), q, k, v, term)
        expected = pullback((d_out, jnp.zeros_like(lse)))

        gradients_at = registry.REGISTRY[implementation].gradients_at
        dq, dks, dvs, d_term = jnp.zeros_like(q), [], [], jnp.zeros_like(term)
        for start, size in zip(np.cumsum((0,) + CHUNKS[:-1]), CHUNKS):
            call, term_grad = chunk_call(scheme, term, int(start), size, lengths)
            kc, vc = k[:, start : start + size], v[:, start : start + size]
            got = gradients_at(call, q, kc, vc, out, lse, d_out, True)
            assert got is not None, implementation
            dq, d_term = dq + got.query, d_term + term_grad(got)
            dks.append(got.key)
            dvs.append(got.value)
        got = (dq, jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1), d_term)
        for name, g, e in zip(("dq", "dk", "dv", f"d {scheme}"), got, expected):
            assert g.dtype == e.dtype and g.shape == e.shape, (name, g.dtype, g.shape)
            assert normwise(g, e) < tol, (name, normwise(g, e))


def test_a_value_table_keeps_the_forward():
    """A value table's gradient needs the step's own P summed by offset, which only its forward computes: no
    backward at residuals (the ring then takes the step's gradient through its forward), on both kernels."""
    call = AttentionCall(key_table=jnp.zeros((3, 8)), value_table=jnp.zeros((3, 8)), max_distance=1)
    q, kv = jnp.zeros((1, 8, 2, 8)), jnp.zeros((1, 8, 2, 8))
    lse = jnp.zeros((1, 2, 8))
    for name in ("pallas_gpu", "pallas_tpu"):
        assert registry.REGISTRY[name].gradients_at(call, q, kv, kv, q, lse, q, True) is None, name
