"""flax's NNX attention tests, re-created against jaxattn.nnx.MultiHeadAttention.

Upstream: google/flax tests/nnx/nn/attention_test.py (commit 18f8f31): TestMultiHeadAttention (test_basic,
test_multihead_sow_attention_weights, test_autoregressive_decode_with_x64, test_keep_rngs,
test_causal_mask_equivalence), TestLinenConsistency.test_nnx_attention_equivalence (use_bias x dtype x
decode x normalize_qk), TestKVFeatures, TestGQADotProductAttention and TestDotProductAttentionValidation.
Written anew; the oracle is flax's own nnx.MultiHeadAttention with its parameters copied into ours
(nnx.update with nnx.state(flax_layer, nnx.Param): the trees are the same, docs/design.md, "The parameter
tree"), and for dropout the same rng stream (flax and we draw the same bernoulli keep-mask from the same key).

Deliberate differences (docs/coming_from.md): broadcast_dropout defaults to False here (True in flax); a call
is_causal is bottom-right aligned here, top-left in flax for T != S (query_positions=arange(T) gives flax's).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxattn.nnx
from helpers import arrays, normwise

B, T, E, N = 2, 5, 12, 3  # qkv_features 18 (H 6), out_features 7, in_kv_features 11


def _pair(**kw):
    """(flax's layer, ours) with flax's params copied into ours."""
    theirs = nnx.MultiHeadAttention(rngs=nnx.Rngs(0), **kw)
    ours = jaxattn.nnx.MultiHeadAttention(rngs=nnx.Rngs(0), **kw)
    nnx.update(ours, nnx.state(theirs, nnx.Param))
    return theirs, ours


def _close(a, b, tol):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert normwise(a, b) <= tol, normwise(a, b)


def test_basic():
    theirs, ours = _pair(num_heads=2, in_features=3, qkv_features=6, out_features=6)
    x = arrays(0, (1, 7, 3))[0].astype(jnp.float32)
    y = ours(x, decode=False)
    assert y.shape == (1, 7, 6)
    _close(y, theirs(x, decode=False), 1e-6)


@pytest.mark.parametrize(
    "use_bias, normalize_qk, dtype, decode, num_kv_heads",
    [
        (True, False, jnp.float32, False, None),
        (False, True, jnp.float32, True, 1),
        pytest.param(True, True, jnp.bfloat16, False, 1, marks=pytest.mark.slow),
        pytest.param(True, True, jnp.float16, True, None, marks=pytest.mark.slow),
        pytest.param(False, False, jnp.bfloat16, True, None, marks=pytest.mark.slow),
    ],
)
def test_flax_equivalence(use_bias, normalize_qk, dtype, decode, num_kv_heads):
    """test_nnx_attention_equivalence: flax's constructor options, the same numbers (decode: token by
    token through both caches); num_kv_heads=1: multi-query, flax's GQA path."""
    kw = dict(
        num_heads=N,
        in_features=E,
        qkv_features=18,
        out_features=7,
        use_bias=use_bias,
        dtype=dtype,
        normalize_qk=normalize_qk,
        decode=decode,
        precision=jax.lax.Precision.HIGHEST,
        num_kv_heads=num_kv_heads,
    )
    theirs, ours = _pair(**kw)
    assert jax.tree.structure(nnx.state(ours, nnx.Param)) == jax.tree.structure(nnx.state(theirs, nnx.Param))
    x = arrays(1, (B, T, E))[0].astype(jnp.float32)
    # half precision: bit for bit (flax's nnx layer attends through jax.nn.dot_product_attention, whose
    # float32 logits and softmax from half q, k are our core; the casts are flax's): bar 0
    tol = 1e-6 if dtype == jnp.float32 else 0.0
    if not decode:
        _close(ours(x), theirs(x), tol)
        return
    for layer in (theirs, ours):
        layer.init_cache(x.shape, dtype=dtype)
    for t in range(T):
        _close(ours(x[:, t : t + 1]), theirs(x[:, t : t + 1]), tol)


@pytest.mark.slow  # the linen twin runs the shared casting code in the default group
def test_mixed_precision_with_float32_weights():
    """dtype=bfloat16 with param_dtype=float32 (float32 weights, bfloat16 compute), multi-query, QK norm:
    flax's nnx layer runs its attention through jax.nn.dot_product_attention (float32 logits and softmax
    from bfloat16 q, k: our core too), so every cast is shown bit for bit: bar 0 for the output and the
    gradients w.r.t. the float32 params and the float32 input (the linen twin: tests/peers/test_flax_linen.py)."""
    kw = dict(num_heads=N, in_features=E, qkv_features=18, out_features=7, num_kv_heads=1, normalize_qk=True)
    theirs, ours = _pair(**kw, dtype=jnp.bfloat16, param_dtype=jnp.float32, decode=False)
    x = arrays(9, (B, T, E))[0].astype(jnp.float32)
    cot = arrays(10, (B, T, 7))[0].astype(jnp.float32)

    def forward_and_grads(layer):  # (out, d params, d x), one jitted program over the layer's state
        graph, params = nnx.split(layer)

        def loss(params, x):
            out = nnx.merge(graph, params)(x)
            return jnp.sum(out.astype(jnp.float32) * cot), out

        (d_params, d_x), out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(params, x)
        return [out, d_x, *jax.tree.leaves(nnx.to_pure_dict(d_params))]

    got, expected = forward_and_grads(ours), forward_and_grads(theirs)
    assert got[0].dtype == jnp.bfloat16
    assert {p.dtype for p in jax.tree.leaves(nnx.state(ours, nnx.Param))} == {jnp.dtype(jnp.float32)}
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and np.array_equal(np.asarray(g), np.asarray(e))


def test_sow_attention_weights():
    """test_multihead_sow_attention_weights: weights [B,N,T,T] sown as "attention_weights" only by the calls
    that ask, equal to flax's."""
    theirs, ours = _pair(num_heads=N, in_features=E, decode=False)
    x = arrays(2, (B, T, E))[0].astype(jnp.float32)
    _, sown = nnx.capture(lambda m: m(x, sow_weights=True), nnx.Intermediate)(ours)
    _, flax_sown = nnx.capture(lambda m: m(x, sow_weights=True), nnx.Intermediate)(theirs)
    (w,), (w_flax,) = sown["attention_weights"], flax_sown["attention_weights"]
    assert w.shape == (B, N, T, T)
    _close(w, w_flax, 1e-6)
    _, sown = nnx.capture(lambda m: m(x), nnx.Intermediate)(ours)
    assert not sown


@pytest.mark.slow  # the linen twin runs in the default group
def test_autoregressive_decode_with_x64():
    layer = jaxattn.nnx.MultiHeadAttention(in_features=4, num_heads=2, qkv_features=4, decode=True, rngs=nnx.Rngs(0))
    x = jnp.ones((1, 4, 4))  # float64 (tests/conftest.py enables x64)
    layer.init_cache(x.shape, dtype=x.dtype)
    assert layer.cached_key.shape == (1, 4, 2, 2) and layer.cached_value.shape == (1, 4, 2, 2)
    y1, y2 = layer(x[:, :1]), layer(x[:, 1:2])
    assert y1.shape == y2.shape == (1, 1, 4) and y1.dtype == jnp.float64


@pytest.mark.parametrize("keep_rngs", [True, False])
def test_keep_rngs(keep_rngs):
    layer = jaxattn.nnx.MultiHeadAttention(
        in_features=4,
        num_heads=2,
        qkv_features=4,
        decode=True,
        rngs=nnx.Rngs(42),
        dropout_rate=0.5,
        keep_rngs=keep_rngs,
    )
    assert (layer.rngs is not None) == keep_rngs
    if keep_rngs:
        _, _, rest = nnx.split(layer, nnx.Param, ...)
        assert isinstance(rest["rngs"]["count"], nnx.RngCount) and isinstance(rest["rngs"]["key"], nnx.RngKey)
    else:
        nnx.split(layer, nnx.Param)


@pytest.mark.parametrize("broadcast_dropout", [True, False])
def test_dropout_matches_flax(broadcast_dropout):
    """dropout_rate / deterministic / broadcast_dropout: from the same rng stream flax and we draw the same
    keep-mask ([T,S] shared by batch entries and heads with broadcast_dropout)."""
    theirs, ours = _pair(
        num_heads=N,
        in_features=E,
        dropout_rate=0.5,
        broadcast_dropout=broadcast_dropout,
        deterministic=False,
        decode=False,
    )
    x = arrays(3, (B, T, E))[0].astype(jnp.float32)
    _close(ours(x), theirs(x), 1e-6)
    _close(ours(x, deterministic=True), theirs(x, deterministic=True), 1e-6)


@pytest.mark.parametrize("use_padding", [True, False])
@pytest.mark.parametrize("is_cross_attention", [True, False])
def test_causal_mask_equivalence(use_padding, is_cross_attention):
    """is_causal combined with a padding mask equals the precombined mask (flax's test), through
    jaxattn.dot_product_attention with two batch dims; flax's causal mask is top-left (tril of [T,S]):
    query_positions=arange(T) is that reading for the cross-attention case."""
    q_len, kv_len = 2, (4 if is_cross_attention else 2)
    q, k, v = arrays(4, (1, 1, q_len, 2, 4), (1, 1, kv_len, 2, 4), (1, 1, kv_len, 2, 4))
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((q_len, kv_len), bool)), (1, 1, 2, q_len, kv_len))
    padding = jnp.ones((1, 1, 1, q_len, kv_len), bool).at[..., -2:].set(False) if use_padding else None
    combined = causal if padding is None else causal & padding
    want = nnx.dot_product_attention(q, k, v, mask=combined, deterministic=True)
    got = jaxattn.dot_product_attention(q, k, v, mask=padding, is_causal=True, query_positions=jnp.arange(q_len))
    alive = np.asarray(combined.any(-1))[..., None].transpose(0, 1, 3, 2, 4)  # [1,1,T,N,1]: rows with a key
    _close(got * alive, want * alive, 1e-6)  # flax attends through jax.nn here: float32 softmax
    assert not bool(jnp.any(got * ~alive))  # a row with no key: zeros here (flax: the mean of the values)


def test_varying_num_features():
    """TestKVFeatures: in_kv_features differs from in_features."""
    theirs, ours = _pair(num_heads=2, in_features=3, qkv_features=6, out_features=6, in_kv_features=4, decode=False)
    x, y = (a.astype(jnp.float32) for a in arrays(5, (1, 3), (1, 4)))
    _close(ours(x, y), theirs(x, y), 1e-6)


@pytest.mark.slow  # GQA against flax runs in the default group through test_flax_equivalence
def test_gqa_multihead_attention():
    """TestGQADotProductAttention.test_gqa_multihead_attention at small sizes: kernel shapes, output equal to
    flax's, the decode cache [B,L,K,H] and its index."""
    in_feat, n_heads, n_kv, qkv = 10, 6, 2, 24
    theirs, ours = _pair(num_heads=n_heads, in_features=in_feat, qkv_features=qkv, num_kv_heads=n_kv)
    H = qkv // n_heads
    assert ours.query.kernel.shape == (in_feat, n_heads, H) and ours.key.kernel.shape == (in_feat, n_kv, H)
    x = arrays(6, (1, 7, in_feat))[0].astype(jnp.float32)
    _close(ours(x, decode=False), theirs(x, decode=False), 1e-6)
    ours.init_cache((1, 7, in_feat))
    assert ours.cached_key.shape == (1, 7, n_kv, H)
    assert ours(jnp.ones((1, 1, in_feat), jnp.float32), decode=True).shape == (1, 1, in_feat)
    assert int(ours.cache_index[...][0]) == 1  # one index per example here (flax: one scalar)


def test_gqa_parity_with_jax_and_invalid_heads():
    q, k, v = (a.astype(jnp.float32) for a in arrays(7, (2, 8, 4, 16), (2, 8, 2, 16), (2, 8, 2, 16)))
    _close(jaxattn.dot_product_attention(q, k, v), jax.nn.dot_product_attention(q, k, v), 1e-6)
    with pytest.raises(ValueError, match="key"):
        jaxattn.dot_product_attention(jnp.ones((1, 4, 5, 8)), jnp.ones((1, 4, 2, 8)), jnp.ones((1, 4, 2, 8)))


@pytest.mark.parametrize(
    "q_shape, k_shape, v_shape, name",
    [
        ((2, 16, 4, 8), (3, 16, 4, 8), (3, 16, 4, 8), "key"),  # batch dims do not broadcast
        ((2, 16, 4, 8), (2, 16, 4, 8), (2, 15, 4, 8), "value"),  # key / value lengths differ
        ((2, 16, 4, 8), (2, 16, 4, 7), (2, 16, 4, 8), "key"),  # query / key depths differ
    ],
)
def test_invalid_shapes(q_shape, k_shape, v_shape, name):
    """TestDotProductAttentionValidation: a ValueError naming the argument (ours also broadcasts batch dims
    of different rank, which flax refuses: (16, 4, 8) keys with (2, 16, 4, 8) queries are valid here)."""
    with pytest.raises(ValueError, match=name):
        jaxattn.dot_product_attention(
            jnp.ones(q_shape), jnp.ones(k_shape), jnp.ones(v_shape), dropout_rate=0.1, dropout_rng=jax.random.key(0)
        )
