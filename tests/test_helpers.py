"""The test helpers themselves (tests/helpers.py): normwise's definition, the float64 guard failing when x64 is
off, the references against literal grids and against each other.

A reference that is wrong the same way as the code under test hides the bug, so its rules are pinned to literal
grids here; the differentiable full-grid formula (attention_reference, which gives the flex and keyword tests
their gradients) is held to the float64 loop on every term at once.
"""

import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxattn
from helpers import (
    allowed_loop,
    arrays,
    assert_float64,
    attention_loop,
    attention_reference,
    check_forward_and_grads,
    normwise,
    shaw_index_loop,
)

B, T, S, N, K, H, Hv = 2, 7, 11, 6, 3, 5, 3  # N = 2 K: grouped-query heads
TOL = 1e-12

# ---------------------------------------------------------------------------------------------------------
# normwise


def test_normwise_is_strictly_relative():
    expected = np.array([3.0, 4.0])  # norm 5
    assert normwise(expected + [0.3, 0.4], expected) == pytest.approx(0.1, rel=1e-12)
    # a small reference is not excused: still 0.1, not the absolute 5e-4 that a floor of 1 would report
    small = expected * 1e-3
    assert normwise(small * 1.1, small) == pytest.approx(0.1, rel=1e-12)
    assert normwise(small * 1.1, small, floor=1.0) == pytest.approx(5e-4, rel=1e-12)
    assert normwise(small * 1.1, small, floor=1e-6) == pytest.approx(0.1, rel=1e-12)  # a floor below the norm: no-op
    # an exactly-zero reference is matched only exactly
    assert normwise(np.zeros(3), np.zeros(3)) == 0.0
    assert normwise(np.array([0.0, 1e-17, 0.0]), np.zeros(3)) == math.inf
    assert normwise(np.array([0.0, 1e-17, 0.0]), np.zeros(3), floor=1.0) == pytest.approx(1e-17)


def test_normwise_refuses_broadcasting_and_never_passes_a_nan():
    with pytest.raises(AssertionError, match="shapes differ"):
        normwise(np.zeros((2, 3)), np.zeros(3))
    assert math.isnan(normwise([np.nan, 1.0], [1.0, 1.0]))
    assert math.isnan(normwise([1.0, 1.0], [np.inf, 1.0]))
    assert not normwise([np.nan], [1.0]) <= TOL


def test_normwise_computes_in_float64_from_any_array():
    third = np.float64(1) / 3
    assert normwise(np.float32(third), third) == pytest.approx(abs(float(np.float32(third)) - third) / third)
    assert normwise(jnp.asarray([1.0, 2.0], jnp.bfloat16), np.array([1.0, 2.0])) == 0.0
    t = torch.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    assert normwise(t * 2, np.array([2.0, 4.0])) == 0.0


# ---------------------------------------------------------------------------------------------------------
# the float64 guard


def test_assert_float64_checks_dtypes_as_they_stand():
    assert_float64(jnp.zeros(2), np.zeros(3), torch.zeros(2, dtype=torch.float64, requires_grad=True))
    assert_float64({"a": [jnp.zeros(2)], "b": np.zeros(1)})  # pytrees: every leaf
    for bad in (
        jnp.zeros(2, jnp.float32),
        np.zeros(2, np.float32),
        torch.zeros(2),
        jnp.zeros(2, jnp.bfloat16),
        np.zeros(2, np.int64),
    ):
        with pytest.raises(AssertionError, match="expected float64"):
            assert_float64(jnp.zeros(2), bad)
    with pytest.raises(AssertionError, match="no array"):
        assert_float64()
    with pytest.raises(AssertionError, match="no array"):
        assert_float64(None, {})


def test_assert_float64_fails_when_x64_is_off():
    """The same float64 test path with x64 switched off: jaxattn computes in float32 and the guard says so."""
    q, k, v = (np.random.default_rng(0).normal(size=s) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv)))
    assert_float64(jaxattn.dot_product_attention(q, k, v, is_causal=True))  # x64 on (tests/conftest.py)
    with jax.enable_x64(False):
        out = jaxattn.dot_product_attention(q, k, v, is_causal=True)
        assert out.dtype == jnp.float32
        with pytest.raises(AssertionError, match="jax_enable_x64 is off"):
            assert_float64(out)
        with pytest.raises(AssertionError, match="jax_enable_x64 is off"):
            assert_float64(np.zeros(2))  # a float64 numpy array does not help: the flag is off
    assert_float64(jaxattn.dot_product_attention(q, k, v, is_causal=True))


GUARD_SCRIPT = """
import json
import jax, numpy as np
import jaxattn
from helpers import assert_float64, normwise
rng = np.random.default_rng(0)
q, k, v = rng.normal(size=(2, 5, 6, 3)), rng.normal(size=(2, 7, 3, 3)), rng.normal(size=(2, 7, 3, 2))
f = lambda q, k, v: jaxattn.dot_product_attention(q, k, v, is_causal=True)
out = f(q, k, v)
report = {"dtype": str(out.dtype), "vmap_vs_plain": normwise(jax.vmap(f)(q, k, v), out), "guard": None}
try:
    assert_float64(out)
except AssertionError as error:
    report["guard"] = str(error)
print(json.dumps(report))
"""


def test_guard_fails_without_the_conftest():
    """A fresh interpreter without tests/conftest.py (JAX's default: x64 off). A float64 test there would compare
    float32 numbers, and a jit/vmap-equals-plain comparison can even come out at 0 (what made the old guards,
    which cast to float64 before asserting float64, useless); assert_float64 refuses it."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = {
        **os.environ,
        "JAX_ENABLE_X64": "0",
        "PYTHONPATH": os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run([sys.executable, "-c", GUARD_SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert report["dtype"] == "float32", report
    assert report["guard"] is not None and "jax_enable_x64 is off" in report["guard"], report


def test_check_forward_and_grads_fails_on_a_small_error():
    (x,) = arrays(0, (3, 5))
    check_forward_and_grads(lambda x: jnp.sin(x) * 2, lambda x: 2 * jnp.sin(x), (x,), (0,))
    with pytest.raises(AssertionError, match="output"):
        check_forward_and_grads(lambda x: jnp.sin(x) * (1 + 1e-10), jnp.sin, (x,), (0,))
    with pytest.raises(AssertionError, match="gradient of argument 0"):  # right output, wrong gradient
        wrong = jax.custom_vjp(lambda x: jnp.sin(x))
        wrong.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x) * (1 + 1e-10),))
        check_forward_and_grads(wrong, jnp.sin, (x,), (0,))
    with pytest.raises(AssertionError, match="expected float64"):
        check_forward_and_grads(lambda x: jnp.sin(x).astype(jnp.float32), jnp.sin, (x,), (0,))


# ---------------------------------------------------------------------------------------------------------
# the references: literal grids


def test_allowed_loop_literal_grids():
    grid = lambda **kw: allowed_loop((), 1, kw.pop("T"), kw.pop("S"), **kw)[0].astype(int).tolist()  # noqa: E731
    # bottom-right causal: query t sits at t + S - T
    assert grid(T=3, S=5, is_causal=True) == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert grid(T=4, S=2, is_causal=True) == [[0, 0], [0, 0], [1, 0], [1, 1]]
    assert grid(T=4, S=6, window=(1, 0)) == [
        [0, 1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1, 1],
    ]
    assert grid(T=3, S=3, window=(None, 1)) == [[1, 1, 0], [1, 1, 1], [1, 1, 1]]
    # T > S: query positions -2..2; chunks floor(position / 2): -2,-1 | 0,1 | 2
    assert grid(T=5, S=3, chunk_size=2) == [[0, 0, 0], [0, 0, 0], [1, 1, 0], [1, 1, 0], [0, 0, 1]]
    ids = np.array([0, 0, 1, 1, 1])
    assert grid(T=5, S=5, query_segment_ids=ids, key_segment_ids=ids, is_causal=True) == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 1],
    ]
    assert grid(
        T=2, S=4, key_value_seq_lengths=3, query_positions=[0, 9], key_positions=[9, 0, 5, 1], is_causal=True
    ) == [[0, 1, 0, 0], [1, 1, 1, 0]]
    with pytest.raises(ValueError, match="both"):
        allowed_loop(1, 1, 2, 2, query_segment_ids=np.zeros((1, 2)))


def test_allowed_loop_batch_dims_and_mask_mod_arguments():
    """mask_mod gets the flattened batch index, the head and absolute positions, as Python ints."""
    seen = []

    def mask_mod(b, n, t, s):
        seen.append((b, n, t, s))
        return (b + n + t + s) % 3 != 0

    ok = allowed_loop((2, 3), 2, 2, 3, mask_mod=mask_mod, query_positions=[[[10, 11]] * 3, [[20, 21]] * 3])
    assert ok.shape == (2, 3, 2, 2, 3)
    assert all(type(x) is int for x in seen[0])
    for i in range(2):
        for j in range(3):
            for n in range(2):
                for t in range(2):
                    for s in range(3):
                        b, pos = 3 * i + j, (10, 20)[i] + t
                        assert ok[i, j, n, t, s] == ((b + n + pos + s) % 3 != 0)


def test_shaw_index_loop_literal_grid():
    assert shaw_index_loop(3, 5, 2).tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 2, 3], [0, 0, 0, 1, 2]]
    assert shaw_index_loop(2, 3, 1, query_positions=[7, 0]).tolist() == [[0, 0, 0], [1, 2, 2]]


def test_attention_loop_literals():
    rng = np.random.default_rng(1)
    v = rng.normal(size=(1, 5, 1, 2))
    zeros = np.zeros((1, 5, 1, 3))
    # seed 004: equal logits under a causal mask give the running mean of the values
    out, weights = attention_loop(zeros, zeros, v, is_causal=True)
    assert normwise(out, np.cumsum(v, axis=1) / np.arange(1, 6)[None, :, None, None]) <= 1e-15
    assert normwise(weights[0, 0], np.tril(np.ones((5, 5))) / np.arange(1, 6)[:, None]) <= 1e-15
    # a -inf bias drops its key; a row with no key gives zeros, even with a sink
    bias = np.zeros((1, 1, 5, 5))
    bias[..., 1] = -np.inf
    out, weights = attention_loop(zeros, zeros, v, bias=bias, key_value_seq_lengths=[2], sinks=[0.0])
    assert (weights[..., 1] == 0).all() and (weights[..., 0] == 0.5).all()  # key 0 and the sink, equal logits
    assert normwise(out[0, :, 0], np.broadcast_to(v[0, 0, 0] / 2, (5, 2))) <= 1e-15
    out, weights = attention_loop(zeros, zeros, v, key_value_seq_lengths=[0], sinks=[3.0])
    assert not out.any() and not weights.any()
    # one key of logit x and a sink of logit c: p = e^x / (e^x + e^c), softcap before the bias
    q, k = np.full((1, 1, 1, 4), 1.0), np.full((1, 1, 1, 4), 2.0)  # x = 8 / sqrt(4) = 4
    _, weights = attention_loop(q, k, v[:, :1], logit_softcap=2.0, bias=np.full((1, 1, 1, 1), 0.5), sinks=[1.0])
    x = 2.0 * math.tanh(4.0 / 2.0) + 0.5
    assert weights[0, 0, 0, 0] == pytest.approx(math.exp(x) / (math.exp(x) + math.exp(1.0)), rel=1e-15)


def test_attention_reference_matches_the_loop_on_every_term():
    """The differentiable full-grid formula against the loop: grouped-query heads, custom positions, window,
    chunks, segments, lengths, relative keys, softcap, bias, score_mod and sinks per example, all at once."""
    q, k, v, a_k, bias, slopes, sinks = arrays(
        1, (B, T, N, H), (B, S, K, H), (B, S, K, Hv), (T, S, N, H), (B, N, T, S), (N,), (B, N)
    )
    segments_q = np.array([[0, 0, 1, 1, 1, 2, 2], [5, 5, 5, 5, 7, 7, 7]])
    segments_k = np.array([[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7]])
    rules = dict(
        query_positions=np.array([[4, 5, 6, 7, 8, 9, 10], [9, 3, 4, 10, 5, 6, 7]]),
        key_positions=np.arange(S),
        window=(5, 1),
        chunk_size=9,
        query_segment_ids=segments_q,
        key_segment_ids=segments_k,
        key_value_seq_lengths=np.array([11, 9]),
    )
    allowed = allowed_loop(B, N, T, S, **rules)
    assert allowed.any(-1).mean() > 0.5 and not allowed.all(-1).any()  # most rows see some keys, none all

    def score_mod(score, b, n, t, s):
        return score + slopes[n] * (s - t) - 0.1 * b

    got = attention_reference(
        q,
        k,
        v,
        allowed,
        logit_softcap=1.3,
        bias=bias,
        sinks=sinks,
        score_mod=score_mod,
        rel_logits=jnp.einsum("btnh,tsnh->bnts", q, a_k, precision="highest"),
        query_positions=rules["query_positions"],
        key_positions=rules["key_positions"],
    )
    want, _ = attention_loop(
        q, k, v, rel_key=a_k, logit_softcap=1.3, bias=bias, sinks=sinks, score_mod=score_mod, **rules
    )
    assert_float64(got)
    assert normwise(got, want) <= TOL


def test_attention_reference_lse_is_the_log_of_the_denominator():
    """return_lse: log(sum over allowed keys of exp(logit) + exp(sink)), one scalar at a time in numpy; a row
    with no allowed key has only the sink's term (without sinks: -inf)."""
    q, k, v, sinks = arrays(2, (B, T, N, H), (B, S, K, H), (B, S, K, Hv), (N,))
    allowed = allowed_loop(B, N, T, S, is_causal=True, key_value_seq_lengths=np.array([0, 8]))
    qn, kn = np.asarray(q), np.asarray(k)
    for with_sinks in (False, True):
        _, lse = attention_reference(
            q, k, v, allowed, logit_softcap=1.3, sinks=sinks if with_sinks else None, return_lse=True
        )
        assert_float64(lse)
        want = np.zeros((B, N, T))
        for b, n, t in np.ndindex(B, N, T):
            terms = [
                math.exp(1.3 * math.tanh(H**-0.5 * float(qn[b, t, n] @ kn[b, s, n // (N // K)]) / 1.3))
                for s in range(S)
                if allowed[b, n, t, s]
            ] + ([math.exp(float(sinks[n]))] if with_sinks else [])
            want[b, n, t] = math.log(sum(terms)) if terms else -math.inf
        assert np.array_equal(np.isinf(np.asarray(lse)), np.isinf(want)) and np.isinf(want).any() != with_sinks
        finite = np.isfinite(want)
        assert normwise(np.asarray(lse)[finite], want[finite]) <= TOL
