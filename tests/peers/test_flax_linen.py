"""flax's linen attention tests, re-created against jaxattn.linen.MultiHeadAttention.

Upstream: google/flax tests/linen/linen_attention_test.py (commit 18f8f31): test_multihead_self_attention,
test_dtype_infer, test_multihead_encoder_decoder_attention, test_mha_out_initializers,
test_multihead_self_attention_w_dropout / _explicit_dropout / _w_dropout_disabled, test_causal_mask_1d,
test_decoding, test_autoregressive_receptive_field_1d, test_multihead_kv_args,
test_multihead_sow_attention_weights, test_autoregressive_decode_with_x64. Written anew; the oracle is
flax.linen.MultiHeadDotProductAttention run on the same variables (our parameter tree is flax's: docs/design.md,
"The parameter tree"), with the same "dropout" rng (flax and we draw the same bernoulli keep-mask from it).

Deliberate differences (docs/coming_from.md): broadcast_dropout defaults to False here (True in flax);
complex inputs are refused (ValueError naming the dtype) where flax computes in complex64; causal masking is
the is_causal keyword (flax users build nn.make_causal_mask, which means the same for self-attention).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn.linen
from helpers import arrays, normwise

N, QKV = 4, 12  # H 3


def _pair(**kw):
    return nn.MultiHeadDotProductAttention(**kw), jaxattn.linen.MultiHeadAttention(**kw)


def _close(a, b, tol):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert normwise(a, b) <= tol, normwise(a, b)


ONES = dict(kernel_init=nn.initializers.ones, bias_init=nn.initializers.zeros)


@pytest.mark.parametrize("shape", [(3, 6, 5), (3, 2, 7, 5)])  # self-attention; two batch dims (encoder-decoder)
def test_multihead_self_attention(shape):
    theirs, ours = _pair(num_heads=N, qkv_features=QKV, deterministic=False, **ONES)
    x = arrays(0, shape)[0].astype(jnp.float32)
    variables = theirs.init(jax.random.key(0), x)
    y, ours_vars = ours.init_with_output(jax.random.key(0), x)
    assert y.shape == x.shape and y.dtype == jnp.float32
    assert jax.tree.map(jnp.shape, ours_vars) == jax.tree.map(jnp.shape, variables)
    _close(ours.apply(variables, x), theirs.apply(variables, x), 1e-6)


def test_dtype_infer_and_complex_refused():
    """dtype=None infers the computation dtype from inputs and params (bfloat16 inputs, float32 params:
    float32, as flax); complex inputs (flax's test_dtype_infer) are refused by name here."""
    theirs, ours = _pair(num_heads=N, qkv_features=QKV, deterministic=False, **ONES)
    x = jnp.ones((3, 6, 5), jnp.bfloat16)
    variables = theirs.init(jax.random.key(0), x)
    assert ours.apply(variables, x).dtype == theirs.apply(variables, x).dtype
    with pytest.raises(ValueError, match="dtype"):
        ours.init(jax.random.key(0), jnp.ones((3, 6, 5), jnp.complex64))


MIXED = dict(num_heads=N, qkv_features=QKV, dtype=jnp.bfloat16, param_dtype=jnp.float32, deterministic=True)


def _forward_and_grads(layer, variables, x, cot):
    """layer.apply(variables, x) and the gradients of sum(out * cot) in float32 w.r.t. the params and x."""
    f = lambda variables, x: layer.apply(variables, x)  # noqa: E731
    grads = jax.grad(lambda v, x: jnp.sum(f(v, x).astype(jnp.float32) * cot), argnums=(0, 1))
    return jax.jit(lambda v, x: (f(v, x), grads(v, x)))(variables, x)


@pytest.mark.parametrize("normalize_qk", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_mixed_precision_with_float32_weights(normalize_qk):
    """dtype=bfloat16 with param_dtype=float32 (float32 weights, bfloat16 compute) on float32 inputs.

    Our casts are flax's, bit for bit: the inputs, kernels and biases go to bfloat16 before each projection
    (DenseGeneral's promote_dtype), query_ln / key_ln are flax's LayerNorm, the out projection casts the
    attention output. Shown against flax's layer with flax's attention core swapped for
    jax.nn.dot_product_attention, whose core is ours (float32 logits and softmax from bfloat16 q, k, as
    docs/design.md, "Half precision", requires, and as flax's nnx layer runs by default): bar 0, output and
    gradients (w.r.t. the float32 params and the input). Against flax's own default core, which rounds
    the logits and the softmax to bfloat16, the outputs differ by that rounding only: bar 1e-2 (about three
    bfloat16 roundings, 2**-9 each; measured 4.2e-3 and 5.0e-3)."""
    kw = dict(MIXED, normalize_qk=normalize_qk)
    theirs = nn.MultiHeadDotProductAttention(**kw)
    f32_core = nn.MultiHeadDotProductAttention(attention_fn=jax.nn.dot_product_attention, **kw)
    ours = jaxattn.linen.MultiHeadAttention(**kw)
    x = arrays(8, (3, 7, 5))[0].astype(jnp.float32)
    cot = arrays(9, (3, 7, 5))[0].astype(jnp.float32)
    variables = theirs.init(jax.random.key(0), x)
    assert {leaf.dtype for leaf in jax.tree.leaves(variables)} == {jnp.dtype(jnp.float32)}
    assert jax.tree.map(jnp.shape, ours.init(jax.random.key(0), x)) == jax.tree.map(jnp.shape, variables)
    got, expected = (_forward_and_grads(layer, variables, x, cot) for layer in (ours, f32_core))
    assert got[0].dtype == jnp.bfloat16
    for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        assert g.dtype == e.dtype and np.array_equal(np.asarray(g), np.asarray(e))
    _close(got[0], theirs.apply(variables, x), 1e-2)


def test_force_fp32_for_softmax():
    """flax's force_fp32_for_softmax=True (its float32 softmax after bfloat16 logits) is what we always do:
    accepted, the same outputs as flax's with it to the rounding of flax's bfloat16 logits (bar 1e-2, as
    above; measured 4.3e-3); False (flax's bfloat16 softmax) is refused by name."""
    theirs, ours = _pair(**MIXED, force_fp32_for_softmax=True)
    x = arrays(10, (3, 7, 5))[0].astype(jnp.float32)
    variables = theirs.init(jax.random.key(0), x)
    _close(ours.apply(variables, x), theirs.apply(variables, x), 1e-2)
    with pytest.raises(ValueError, match="force_fp32_for_softmax"):
        ours.clone(force_fp32_for_softmax=False).apply(variables, x)


def test_mha_out_initializers():
    _, ours = _pair(
        num_heads=N,
        qkv_features=QKV,
        kernel_init=nn.initializers.ones,
        out_kernel_init=nn.initializers.zeros,
        bias_init=nn.initializers.zeros,
        out_bias_init=nn.initializers.ones,
        deterministic=False,
    )
    params = ours.init(jax.random.key(0), jnp.ones((3, 2, 7, 5)))["params"]
    for group in ("query", "key", "value"):
        np.testing.assert_array_equal(params[group]["kernel"], 1.0)
        np.testing.assert_array_equal(params[group]["bias"], 0.0)
    np.testing.assert_array_equal(params["out"]["kernel"], 0.0)
    np.testing.assert_array_equal(params["out"]["bias"], 1.0)


@pytest.mark.parametrize("broadcast_dropout", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_dropout_matches_flax(broadcast_dropout):
    """test_multihead_self_attention_w_dropout / _explicit_dropout: the "dropout" stream or an explicit
    dropout_rng; flax and we draw the same keep-mask from the same key."""
    theirs, ours = _pair(
        num_heads=N, qkv_features=QKV, dropout_rate=0.3, deterministic=False, broadcast_dropout=broadcast_dropout
    )
    x = arrays(1, (3, 7, 5))[0].astype(jnp.float32)
    variables = theirs.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    rngs = {"dropout": jax.random.key(2)}
    _close(ours.apply(variables, x, rngs=rngs), theirs.apply(variables, x, rngs=rngs), 1e-6)
    key = jax.random.key(3)
    _close(ours.apply(variables, x, dropout_rng=key), theirs.apply(variables, x, dropout_rng=key), 1e-6)
    assert normwise(ours.apply(variables, x, dropout_rng=key), ours.apply(variables, x, rngs=rngs)) > 1e-3


def test_dropout_disabled():
    """test_multihead_self_attention_w_dropout_disabled: rate 0, or deterministic=True (attribute or call),
    gives the same output whatever the dropout rng."""
    x = arrays(2, (3, 7, 5))[0].astype(jnp.float32)
    rngs1, rngs2 = ({"params": jax.random.key(0), "dropout": jax.random.key(i)} for i in (1, 2))
    layer = jaxattn.linen.MultiHeadAttention(num_heads=N, qkv_features=QKV, dropout_rate=0.0, deterministic=True)
    variables = layer.init(rngs1, x)
    outs = [
        layer.apply(variables, x, rngs=rngs1),
        layer.apply(variables, x, rngs=rngs2),
        layer.clone(deterministic=None).apply(variables, x, deterministic=True, rngs=rngs1),
        layer.clone(dropout_rate=0.5, deterministic=None).apply(variables, x, deterministic=True, rngs=rngs2),
    ]
    for y in outs[1:]:
        np.testing.assert_array_equal(y, outs[0])


def test_causal_mask_and_decoding():
    """test_causal_mask_1d / test_decoding: our is_causal equals flax's nn.make_causal_mask in a full pass, and
    decoding token by token (decode=True, the "cache" collection) equals that pass and flax's own decoding."""
    theirs, ours = _pair(num_heads=3, qkv_features=12, precision=jax.lax.Precision.HIGHEST, deterministic=False)
    x = arrays(3, (2, 5, 12))[0].astype(jnp.float32)
    variables = theirs.init(jax.random.key(0), x)
    full = theirs.apply(variables, x, mask=nn.make_causal_mask(jnp.ones((2, 5))))
    _close(ours.apply(variables, x, is_causal=True), full, 1e-6)
    cache_t = theirs.clone(decode=True).init(jax.random.key(0), x)["cache"]
    cache_o = ours.clone(decode=True).init(jax.random.key(0), x)["cache"]
    step_t, step_o = (
        jax.jit(lambda v, x, m=m: m.clone(decode=True).apply(v, x, mutable=["cache"])) for m in (theirs, ours)
    )
    for t in range(5):
        y_t, mut_t = step_t({**variables, "cache": cache_t}, x[:, t : t + 1])
        y_o, mut_o = step_o({**variables, "cache": cache_o}, x[:, t : t + 1])
        cache_t, cache_o = mut_t["cache"], mut_o["cache"]
        _close(y_o, y_t, 1e-6)
        _close(y_o, full[:, t : t + 1], 1e-5)


def test_autoregressive_receptive_field_1d():
    """Output t depends on inputs 0..t only (gradients), with is_causal."""
    layer = jaxattn.linen.MultiHeadAttention(num_heads=1, kernel_init=jax.nn.initializers.ones, deterministic=False)
    x = arrays(4, (1, 7, 1))[0]
    variables = layer.init(jax.random.key(0), x)
    jac = jax.jit(jax.jacobian(lambda x: layer.apply(variables, x, is_causal=True)[0, :, 0]))(x)[:, 0, :, 0]  # [t,s]
    deps = np.abs(np.asarray(jac)) > 1e-9
    np.testing.assert_array_equal(deps, np.tril(np.ones((7, 7), bool)))


def test_multihead_kv_args():
    """Separate inputs_k / inputs_v, and flax's inputs_kv spelling, equal flax's."""
    theirs, ours = _pair(num_heads=N, qkv_features=QKV, deterministic=False)
    q, kv, v = (a.astype(jnp.float32) for a in arrays(5, (3, 5), (9, 5), (9, 5)))
    variables = theirs.init(jax.random.key(0), q, kv, v)
    _close(ours.apply(variables, q, kv, v), theirs.apply(variables, q, kv, v), 1e-6)
    _close(ours.apply(variables, q, inputs_kv=kv), theirs.apply(variables, q, kv, kv), 1e-6)
    with pytest.raises(ValueError, match="inputs_kv"):
        ours.apply(variables, q, kv, inputs_kv=kv)


def test_sow_attention_weights():
    theirs, ours = _pair(num_heads=N, qkv_features=QKV, deterministic=True)
    x = arrays(6, (3, 6, 5))[0].astype(jnp.float32)
    variables = theirs.init(jax.random.key(0), x)
    _, sown = ours.apply(variables, x, sow_weights=True, mutable=["intermediates"])
    _, flax_sown = theirs.apply(variables, x, sow_weights=True, mutable=["intermediates"])
    (w,), (w_flax,) = sown["intermediates"]["attention_weights"], flax_sown["intermediates"]["attention_weights"]
    assert w.shape == (3, N, 6, 6)
    _close(w, w_flax, 1e-6)
    _, sown = ours.apply(variables, x, mutable=["intermediates"])
    assert not sown


@pytest.mark.parametrize("normalize_qk, use_bias", [(True, False), (False, True)])
def test_normalize_qk_and_use_bias(normalize_qk, use_bias):
    """normalize_qk (params query_ln / key_ln) and use_bias: the same tree and numbers as flax's."""
    theirs, ours = _pair(num_heads=N, qkv_features=QKV, normalize_qk=normalize_qk, use_bias=use_bias)
    x = arrays(7, (2, 6, 5))[0].astype(jnp.float32)
    variables = theirs.init(jax.random.key(0), x)
    assert jax.tree.map(jnp.shape, ours.init(jax.random.key(0), x)) == jax.tree.map(jnp.shape, variables)
    _close(ours.apply(variables, x), theirs.apply(variables, x), 1e-6)


def test_autoregressive_decode_with_x64():
    layer = jaxattn.linen.MultiHeadAttention(num_heads=2, qkv_features=4, decode=True)
    x = jnp.ones((1, 4, 4))  # float64 (x64 is on in the test session)
    variables = layer.init(jax.random.key(0), x)
    assert variables["cache"]["cached_key"].shape == (1, 4, 2, 2)
    y1, mut = layer.apply(variables, x[:, :1], mutable=["cache"])
    y2, _ = layer.apply({**variables, **mut}, x[:, 1:2], mutable=["cache"])
    assert y1.shape == y2.shape == (1, 1, 4) and y2.dtype == jnp.float64
