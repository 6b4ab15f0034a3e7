"""The two contractions of per-head per-pair tables A [T,S,N,H] (the seed-000 form), without a copy of A.

    pair_logits(q [...,T,N,H], A) -> [...,T,S,N]:   sum_h q[...,t,n,h] A[t,s,n,h]
    pair_values(x [...,T,S,N], A) -> [...,T,N,H]:   sum_s x[...,t,s,n] A[t,s,n,h]

As einsums these are dots batched over (t, n), which XLA's CPU dot runs only after copying A into a
[T,N,S,H] layout: one full copy of each table per call (2 x 128 MiB at B=4 S=256 N=8 H=64, half the
naive port's temp memory, and most of the time). The primal forms here read A in place (see _dot_h and
_sum_s for the layouts, chosen by measurement: docs/performance.md). Under differentiation the einsum
forms are used instead (custom VJP): their backward shares one copy of A with the forward, while
autodiff of the fused forms materialises [...,T,S,N,H] products (measured 1.5 GiB and 5x slower).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

MAX_BLOCK_DIAGONAL_HEADS = 8


def _acc_dtype(*arrays):
    return jnp.promote_types(jnp.result_type(*arrays), jnp.float32)


def _flat_batch(x, core_dims):
    """[...,*core] -> ([Bf,*core], batch shape)."""
    batch = x.shape[: x.ndim - core_dims]
    return x.reshape(-1, *x.shape[x.ndim - core_dims :]), batch


def _dot_h(y, table, precision):
    """sum_h y[...,t,n,h] A[t,s,n,h] as one matmul per t against a block-diagonal [N*H, Bf*N] view of y.

    A[t] is [S, N*H] in place, so the dot needs no copy of A; the block-diagonal rhs does N times the
    necessary flops, which is still ~2x faster on CPU than the fused multiply-reduce over the minor h
    (measured 44 vs 98 ms at B=4 S=256 N=8 H=64; the einsum with its table copy: 115 ms). Beyond
    MAX_BLOCK_DIAGONAL_HEADS heads the waste outgrows the gain and the fused form is used.
    """
    acc_dtype = _acc_dtype(y, table)
    T, S, N, H = table.shape
    if N > MAX_BLOCK_DIAGONAL_HEADS:
        return jnp.sum(y.astype(acc_dtype)[..., :, None, :, :] * table.astype(acc_dtype), axis=-1)
    flat, batch = _flat_batch(y, 3)
    diagonal = jnp.einsum("btnh,nm->tnhbm", flat, jnp.eye(N, dtype=y.dtype)).reshape(T, N * H, -1)
    out = jnp.einsum(
        "tsk,tkj->tsj", table.reshape(T, S, N * H), diagonal, precision=precision, preferred_element_type=acc_dtype
    )
    return jnp.moveaxis(out.reshape(T, S, -1, N), 2, 0).reshape(*batch, T, S, N)


def _sum_s(x, table, precision):
    """sum_s x[...,t,s,n] A[t,s,n,h], fused, with x moved to [T,S,Bf,N] so the reduction runs over a
    major axis and the loop vectorises over h (measured 33 vs 63 ms with the batch-major x)."""
    acc_dtype = _acc_dtype(x, table)
    flat, batch = _flat_batch(x, 3)
    x_t = jnp.transpose(flat, (1, 2, 0, 3)).astype(acc_dtype)  # [T,S,Bf,N]
    out = jnp.sum(x_t[..., None] * table.astype(acc_dtype)[:, :, None], axis=1)  # [T,Bf,N,H]
    return jnp.moveaxis(out, 0, 1).reshape(*batch, *out.shape[:1], *out.shape[2:])


def _dot_h_einsum(y, table, precision):
    return jnp.einsum("...tnh,tsnh->...tsn", y, table, precision=precision, preferred_element_type=_acc_dtype(y, table))


def _sum_s_einsum(x, table, precision):
    return jnp.einsum("...tsn,tsnh->...tnh", x, table, precision=precision, preferred_element_type=_acc_dtype(x, table))


def _outer(x, y, precision):
    """sum over the batch dims of x[...,t,s,n] y[...,t,n,h] -> [T,S,N,H]."""
    return jnp.einsum("...tsn,...tnh->tsnh", x, y, precision=precision, preferred_element_type=_acc_dtype(x, y))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def pair_logits(y, table, precision=None):
    return _dot_h(y, table, precision)


def _pair_logits_fwd(y, table, precision):
    return _dot_h_einsum(y, table, precision), (y, table)


def _pair_logits_bwd(precision, res, g):
    y, table = res
    return (_sum_s_einsum(g, table, precision).astype(y.dtype), _outer(g, y, precision).astype(table.dtype))


pair_logits.defvjp(_pair_logits_fwd, _pair_logits_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def pair_values(x, table, precision=None):
    return _sum_s(x, table, precision)


def _pair_values_fwd(x, table, precision):
    return _sum_s_einsum(x, table, precision), (x, table)


def _pair_values_bwd(precision, res, g):
    x, table = res
    return (_dot_h_einsum(g, table, precision).astype(x.dtype), _outer(x, g, precision).astype(table.dtype))


pair_values.defvjp(_pair_values_fwd, _pair_values_bwd)
