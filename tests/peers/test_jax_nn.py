"""jax's own dot-product-attention tests, re-created against jaxattn.dot_product_attention.

Upstream: jax-ml/jax tests/nn_test.py (commit cec06d1), NNFunctionsTest.testDotProductAttention (GQA x dtype x
vmap, with the lse residual), testDotProductAttentionMask (bias / causal / padding / custom mask / sliding
window and their pairs, gradients with respect to q, k, v and bias), testDotProductAttentionBiasGradient,
testDotProductAttentionFloat64MaskDebugInfs (regression jax#37422) and
testDotProductAttention_localWindowSizeWithoutMask. The cases are written anew here with jax.nn's keywords
(query_seq_lengths, key_value_seq_lengths, local_window_size, return_residual, implementation="xla", bias and
mask positional) and jax.nn.dot_product_attention(implementation="xla") as the oracle. Shapes are small and
every axis has its own size (B 2 or 3, T = S 11 where jax.nn and we must agree, N 6, H 5).

jax.nn computes its softmax in float32 whatever the input dtype, so against it float64 inputs agree to
float32 accuracy only; the float64 bar (1e-12) is checked against tests/helpers.py's reference instead.

Deliberate differences (docs/coming_from.md), each checked both ways below:
- is_causal and local_window_size use absolute positions, bottom-right aligned (query t at t + S - T); jax.nn
  reads row indices (top-left). Equal when T == S; query_positions=jnp.arange(T) gives jax.nn's reading.
- A query row with no allowed key gives zeros here; jax.nn gives the mean of the values (its large negative
  fill makes the softmax uniform). Its residual is -inf here, a large negative finite number in jax.nn.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from helpers import allowed_loop, arrays, assert_float64, attention_reference, normwise

B, T, S, N, H = 2, 11, 11, 6, 5


def _qkv(dtype, K=N, batch=B, T=T, S=S, seed=0):
    q, k, v = arrays(seed, (batch, T, N, H), (batch, S, K, H), (batch, S, K, H))
    return q.astype(dtype), k.astype(dtype), v.astype(dtype)


def _close(ours, theirs, tol):
    """Normwise relative error of each pair (float64 arithmetic) <= tol."""
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
        assert normwise(a, b) <= tol, normwise(a, b)


TOL = {jnp.bfloat16: 2e-2, jnp.float16: 4e-3, jnp.float32: 1e-5}


# testDotProductAttention: grouped-query heads (G = N // K query heads per key/value head), half and single
# precision, under vmap, with the lse residual and its (stopped) gradient.
# Upstream's product (3 dtypes x 3 groups x vmap) thinned to cover each value once or twice (time budget).
@pytest.mark.parametrize(
    "dtype, G, use_vmap",
    [
        (jnp.bfloat16, 3, True),
        (jnp.float32, 1, False),
        pytest.param(jnp.bfloat16, 1, False, marks=pytest.mark.slow),
        pytest.param(jnp.float16, 2, False, marks=pytest.mark.slow),
        pytest.param(jnp.float32, 6, True, marks=pytest.mark.slow),
    ],
    ids=str,
)
def test_dot_product_attention_gqa_residual(dtype, G, use_vmap):
    q, k, v = _qkv(dtype, K=N // G)
    grad, lse_grad = (x.astype(dtype) for x in arrays(1, (B, T, N, H), (B, T, N)))
    theirs = partial(jax.nn.dot_product_attention, implementation="xla", return_residual=True)
    ours = partial(jaxattn.dot_product_attention, implementation="xla", return_residual=True)
    if use_vmap:
        ours = jax.vmap(ours)

    def run(fn):
        out, f_vjp = jax.vjp(fn, q, k, v)
        return out, f_vjp((grad, lse_grad)), f_vjp((jnp.zeros_like(grad), lse_grad))

    # jax.nn's float16 asks XLA:CPU for an F16_F16_F32 dot, which only its eager fallback survives: run eagerly
    (out_t, res_t), grads_t, _ = run(theirs) if dtype == jnp.float16 else jax.jit(run, static_argnums=0)(theirs)
    (out_o, res_o), grads_o, lse_only = jax.jit(run, static_argnums=0)(ours)
    _close((out_o, res_o), (out_t, res_t), TOL[dtype])
    assert res_o.shape == (B, T, N) and res_o.dtype == dtype  # jax.nn's layout BTN, in the input dtype
    _close(grads_o, grads_t, 5 * TOL[dtype])
    for dx in lse_only:  # the residual carries no gradient, in jax.nn and here
        assert not bool(jnp.any(dx))


# three pairs in the default group (each mode but "custom" is in one), the rest in the slow group
MASK_MODES = [("causal", "padding"), ("bias", "causal"), ("causal", "sliding_window")] + [
    pytest.param(mode, marks=pytest.mark.slow)
    for mode in (("custom", "padding"), "bias", "causal", "padding", "custom", "sliding_window")
]


def _mask_case(mode, dtype):
    """testDotProductAttentionMask's inputs: (args (q, k, v, bias, mask), keywords)."""
    mode = (mode,) if isinstance(mode, str) else mode
    q, k, v = _qkv(dtype)
    bias = mask = None
    kwargs = dict(is_causal="causal" in mode)
    if "padding" in mode:
        kwargs.update(
            query_seq_lengths=jnp.array([T // 2, T // 4], jnp.int32),
            key_value_seq_lengths=jnp.array([S // 4, S // 2], jnp.int32),
        )
    if "custom" in mode:
        mask = jnp.tril(jnp.ones((T, S), bool))[None, None]
    if "bias" in mode:
        bias = arrays(4, (1, N, T, S))[0].astype(dtype)
    if "sliding_window" in mode:
        kwargs.update(local_window_size=(3, 2) if kwargs["is_causal"] else (3, 0))
    return (q, k, v, bias, mask), kwargs


@pytest.mark.parametrize("mode", MASK_MODES, ids=str)
def test_dot_product_attention_mask(mode):
    """Forward and the gradients with respect to q, k, v and bias against jax.nn, bias and mask passed
    positionally as jax.nn users do, on our automatic choice and our explicit dense engine."""
    args, kwargs = _mask_case(mode, jnp.float32)
    grad = arrays(3, (B, T, N, H))[0].astype(jnp.float32)
    argnums = (0, 1, 2) + ((3,) if args[3] is not None else ())

    def vjp(fn):
        def run(*a):
            out, f_vjp = jax.vjp(lambda *a: fn(*a, *args[len(argnums) :], **kwargs), *a)
            return out, f_vjp(grad)

        return jax.jit(run)(*args[: len(argnums)])

    expected = vjp(partial(jax.nn.dot_product_attention, implementation="xla"))
    for impl in (None, "dense"):
        _close(vjp(partial(jaxattn.dot_product_attention, implementation=impl)), expected, 2e-5)


@pytest.mark.parametrize(
    "mode", [("causal", "padding"), pytest.param(("causal", "sliding_window"), marks=pytest.mark.slow)], ids=str
)
def test_dot_product_attention_mask_float64(mode):
    """The same cases in float64 against the float64 reference (jax.nn's softmax is float32 only)."""
    (q, k, v, bias, mask), kwargs = _mask_case(mode, jnp.float64)
    lengths = kwargs.get("query_seq_lengths")
    allowed = allowed_loop(
        B,
        N,
        T,
        S,
        is_causal=kwargs["is_causal"],
        window=kwargs.get("local_window_size"),
        key_value_seq_lengths=kwargs.get("key_value_seq_lengths"),
    )
    if lengths is not None:
        allowed &= (np.arange(T)[None, :] < np.asarray(lengths)[:, None])[:, None, :, None]
    got = jax.jit(lambda q, k, v: jaxattn.dot_product_attention(q, k, v, bias, mask, **kwargs))(q, k, v)
    want = attention_reference(q, k, v, allowed)
    assert_float64(got, want)
    assert normwise(got, want) <= 1e-12


def test_float64_mask_debug_infs():
    """Regression jax#37422: float64, an unbatched TNH call, a key mask, under jax_debug_infs (eager)."""
    T_, S_, K_, N_, H_ = 5, 7, 3, 6, 11
    mask = jnp.arange(S_) <= S_ // 2
    with jax.debug_infs(True), jax.debug_nans(True):
        out = jaxattn.dot_product_attention(
            jnp.zeros((T_, N_, H_)), jnp.zeros((S_, K_, H_)), jnp.zeros((S_, K_, H_)), mask=mask
        )
        out.block_until_ready()
    assert_float64(out)


# Our main paths under JAX's own debugging flags (jax.nn passes them on valid input, and so must we): dense
# and blockwise, masks with empty rows, padding, sinks; eager forward and jitted gradients.
# (Eager calls: there jax_debug_infs checks every intermediate; under jit only the outputs.)
DEBUG_CASES = {
    "dense": dict(
        mask=jnp.ones((T, S), bool).at[2].set(False),
        sinks=jnp.ones(N),
        key_value_seq_lengths=jnp.array([0, 4]),
        implementation="dense",
    ),
    "blockwise": dict(
        is_causal=True,
        query_seq_lengths=jnp.array([3, 11], jnp.int32),
        local_window_size=(2, 0),
        key_value_seq_lengths=jnp.array([0, 5]),
        sinks=jnp.ones(N),
        query_positions=jnp.arange(T) - 4,
        implementation="blockwise",
        block_size=4,
    ),
}


@pytest.mark.parametrize("case", list(DEBUG_CASES))
def test_debug_nans_and_infs_stay_quiet(case):
    """Rows with no key (mask, padding, causal before the first key), sinks, both engines: eager forward and
    gradient under jax_debug_nans and jax_debug_infs."""
    kwargs = DEBUG_CASES[case]
    q, k, v = _qkv(jnp.float64, K=3)
    f = partial(jaxattn.dot_product_attention, **kwargs)
    with jax.debug_infs(True), jax.debug_nans(True):
        out = f(q, k, v)
        grads = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2))(q, k, v)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in (out, *grads))


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("use_vmap", [False, True])
def test_bias_gradient(batch_size, use_vmap):
    """testDotProductAttentionBiasGradient: self-attention x = q = k = v, a per-example bias and an all-True
    key mask; the bias gradient against jax.nn's."""
    x, bias = arrays(0, (batch_size, S, N, H), (batch_size, N, S, S))
    x, bias = x.astype(jnp.float32), bias.astype(jnp.float32)
    mask = jnp.ones((1, 1, S), bool)

    def attention(fn, x, bias, mask):
        return fn(query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False, implementation="xla")

    def bwd(fn):
        f = partial(attention, fn)
        f = jax.vmap(f, in_axes=(0, 0, None)) if use_vmap else f
        out, f_vjp = jax.vjp(f, x, bias, mask)
        return out, f_vjp(x)[:2]

    _close(
        jax.jit(lambda: bwd(jaxattn.dot_product_attention))(),
        jax.jit(lambda: bwd(jax.nn.dot_product_attention))(),
        2e-5,
    )


def test_local_window_size_without_mask():
    """testDotProductAttention_localWindowSizeWithoutMask: the window applies with no mask at all; an int is
    the symmetric window; local_window_size is our window=(left, right)."""

    @jax.jit
    def run(q, k, v):
        return (
            jaxattn.dot_product_attention(q, k, v, mask=None, local_window_size=(8, 8)),
            jaxattn.dot_product_attention(q, k, v, mask=None, local_window_size=(1, 1)),
            jax.nn.dot_product_attention(q, k, v, local_window_size=(1, 1)),
            jaxattn.dot_product_attention(q, k, v, local_window_size=1),
            jaxattn.dot_product_attention(q, k, v, window=(1, 1)),
        )

    large, small, theirs, symmetric, ours = run(*_qkv(jnp.float32))
    assert not bool(jnp.allclose(large, small))
    _close(small, theirs, 1e-5)
    _close(symmetric, small, 0.0)
    _close(ours, small, 0.0)


# ---------------------------------------------------------------------------------------------------------
# The deliberate differences, both readings.


@pytest.mark.parametrize("T_", [4, 13])
def test_causal_and_window_alignment_for_t_not_s(T_):
    """jax.nn aligns is_causal and local_window_size top-left (row indices); we align bottom-right (absolute
    positions, query t at t + S - T). query_positions=arange(T) gives jax.nn's reading exactly; jax.nn with
    an explicit bottom-right mask gives ours on every row that has a key."""
    q, k, v = _qkv(jnp.float32, T=T_)
    bottom_right = jnp.tril(jnp.ones((T_, S), bool), k=S - T_)

    @jax.jit
    def run(q, k, v):
        top_left = [
            (
                jaxattn.dot_product_attention(q, k, v, query_positions=jnp.arange(T_), **kw),
                jax.nn.dot_product_attention(q, k, v, **kw),
            )
            for kw in (dict(is_causal=True), dict(local_window_size=(2, 1)))
        ]
        return (
            top_left,
            jaxattn.dot_product_attention(q, k, v, is_causal=True),
            jax.nn.dot_product_attention(q, k, v, mask=bottom_right),
        )

    top_left, ours, theirs = run(q, k, v)
    for a, b in top_left:
        _close(a, b, 1e-5)
    has_key = np.asarray(bottom_right.any(-1))
    _close(ours[:, has_key], theirs[:, has_key], 1e-5)
    assert not bool(jnp.any(ours[:, ~has_key]))  # T > S: the first T - S queries see no key: zeros


def test_row_with_no_allowed_key():
    """A query row with no allowed key: zeros here (and lse -inf); jax.nn: the mean of the values (and a
    large negative finite lse). Other rows agree."""
    q, k, v = _qkv(jnp.float32)
    mask = jnp.ones((T, S), bool).at[3].set(False)
    (ours, res_o), (theirs, res_t) = jax.jit(
        lambda q, k, v: [
            f(q, k, v, mask=mask, return_residual=True)
            for f in (jaxattn.dot_product_attention, jax.nn.dot_product_attention)
        ]
    )(q, k, v)
    rows = np.arange(T) != 3
    _close((ours[:, rows], res_o[:, rows]), (theirs[:, rows], res_t[:, rows]), 1e-5)
    assert not bool(jnp.any(ours[:, 3])) and bool(jnp.all(res_o[:, 3] == -jnp.inf))
    _close(theirs[:, 3], jnp.mean(v, axis=1), 1e-5)
    assert bool(jnp.all(jnp.isfinite(res_t[:, 3])))


def test_keywords_refused_by_name():
    q, k, v = _qkv(jnp.float32)
    bad = [
        dict(local_window_size=2, window=(2, 2)),
        dict(local_window_size=(-1, 2)),
        dict(local_window_size="2"),
        dict(query_seq_lengths=jnp.array([1.0, 2.0])),
        dict(return_residual="yes"),
        dict(implementation="triton"),
    ]
    for kw in bad:
        with pytest.raises(ValueError, match=next(iter(kw)) if "window" not in kw else "local_window_size"):
            jaxattn.dot_product_attention(q, k, v, **kw)
