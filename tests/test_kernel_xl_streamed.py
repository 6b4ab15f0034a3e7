"""Shaw's key table on the TPU flex kernel with its lanes streamed (tables_tpu.TableLanes.streamed, issue 51 item
1): Transformer-XL over its whole span, whose T + S offsets would not fit VMEM as lanes beside their products, reads
each tile's window of lanes from HBM (LaneStream) and adds the window's gradient into the lanes' gradient in HBM
(LaneAdder), forward, dq and dk/dv.

Interpret mode (Pallas' interpreter on this CPU, jax_enable_x64 off as the TPU kernels need), float32, with
tables_tpu.RESIDENT_BAND lowered below the calls' bands so that small calls take the streamed route: outputs <= 1e-6
against the float64 loop of the formula (test_positions.xl_loop), gradients of q, k, v, P, u and the v bias <= 1e-5
against the dense engine in float64, normwise. Every axis its own size, T != S both ways, causal and not, per-head
and shared tables.

Lowered for a TPU at T = S = 4096 bf16 with max_left = S - 1 (cross_platform_lowering): the forward and the
training step hold the flex kernels (1 and 3 Mosaic calls: forward, dq, dk/dv) and no while loop; before the
streamed route the TPU kernel refused the band and implementation=None took the XLA engines' tile loops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_positions import N as XL_HEADS, xl_loop

import jaxattn
from helpers import assert_float64, normwise, value_and_vjp
from jaxattn._kernels import tables_tpu

OUT_TOL, GRAD_TOL = 1e-6, 1e-5


@pytest.fixture
def streamed_seen(monkeypatch):
    """The LaneStream / LaneAdder objects the kernels built: the streamed route was taken (reads and adds)."""
    seen = []
    for name in ("LaneStream", "LaneAdder"):
        cls = getattr(tables_tpu, name)
        init = cls.__init__
        monkeypatch.setattr(
            cls, "__init__", lambda self, *a, init=init, name=name: (seen.append(name), init(self, *a))[1]
        )
    return seen


# name: (B, T, S, K, H, Hv, per-head table, is_causal); N = test_positions.N (xl_loop's heads)
CASES = {
    "causal T<S per head": (2, 19, 37, 3, 5, 7, True, True),
    "T>S shared": (1, 41, 29, 2, 3, 5, False, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_lanes_over_the_whole_span(name, streamed_seen, monkeypatch):
    B, T, S, K, H, Hv, per_head, is_causal = CASES[name]
    N, max_left = XL_HEADS, S - 1
    R = max_left + 4  # max_right 3: rows past the causal diagonal too
    rng = np.random.default_rng(11)
    q, k, v, w = (
        rng.normal(size=s).astype(np.float32) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv), (B, T, N, Hv))
    )
    P = rng.normal(size=(R, N, H) if per_head else (R, H)).astype(np.float32)
    u, vb = rng.normal(size=(N, H)).astype(np.float32), rng.normal(size=(N, H)).astype(np.float32)

    def f(q, k, v, P, u, vb, **kw):
        return jaxattn.transformer_xl_attention(
            q, k, v, P, max_left=max_left, pos_bias_u=u, pos_bias_v=vb, is_causal=is_causal, **kw
        )

    args = (q, k, v, P, u, vb)
    monkeypatch.setattr(tables_tpu, "RESIDENT_BAND", 16)  # below the call's T + S - 1 offsets: streamed
    with jax.enable_x64(False):  # the TPU kernels index in int32
        out, grads = value_and_vjp(lambda *a: f(*a, implementation="pallas_tpu", interpret=True), args, w)
    assert {"LaneStream", "LaneAdder"} <= set(streamed_seen), streamed_seen
    keys = np.asarray(P, np.float64) if per_head else np.broadcast_to(np.asarray(P, np.float64)[:, None], (R, N, H))
    want = xl_loop(q, k, v, keys, u, vb, max_left, is_causal)
    assert normwise(out, want) <= OUT_TOL, normwise(out, want)
    dense_out, dense_grads = value_and_vjp(
        lambda *a: f(*a, implementation="dense"), [np.asarray(x, np.float64) for x in args], w
    )
    assert_float64(dense_out, *dense_grads)
    for got, ref, what in zip(grads, dense_grads, ("q", "k", "v", "P", "u", "v bias"), strict=True):
        assert got.dtype == jnp.float32, what
        assert normwise(got, ref) <= GRAD_TOL, (what, normwise(got, ref))


def test_whole_span_lowers_to_the_tpu_kernels():
    T, N, H = 4096, 4, 64
    q = jax.ShapeDtypeStruct((1, T, N, H), jnp.bfloat16)
    P = jax.ShapeDtypeStruct((T, N, H), jnp.float32)

    def attend(q, k, v, P):
        return jaxattn.transformer_xl_attention(q, k, v, P, max_left=T - 1, is_causal=True)

    def train(q, k, v, P):
        return jax.grad(lambda *a: jnp.sum(attend(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3))(q, k, v, P)

    with jax.enable_x64(False), jaxattn.cross_platform_lowering():
        for fn, calls in ((attend, 1), (train, 3)):
            text = jax.jit(fn).trace(q, q, q, P).lower(lowering_platforms=("tpu",)).as_text()
            assert text.count("tpu_custom_call") == calls and "stablehlo.while" not in text, fn.__name__
