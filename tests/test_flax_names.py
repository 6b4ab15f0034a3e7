"""flax's keyword names for the layers' sizes: accepted where they mean the same thing, one spelling each.

The reference is flax's own layer: built with the same flax keywords, it must declare a parameter tree of
the same structure and shapes as ours. Axes: E=12 in, Ekv=7 key/value in, N=3 heads, H=4 (qkv 12), Eo=5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn, nnx

import jaxattn.linen as jl
import jaxattn.nnx as jx

E, EKV, N, H, EO = 12, 7, 3, 4, 5
FLAX_KW = dict(num_heads=N, in_features=E, qkv_features=N * H, out_features=EO, in_kv_features=EKV)


def _shapes(module):
    return jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(module, nnx.Param)))


def test_nnx_takes_flax_keywords_and_declares_flax_shapes():
    ours = jx.MultiHeadAttention(**FLAX_KW, decode=False, rngs=nnx.Rngs(0))
    theirs = nnx.MultiHeadAttention(**FLAX_KW, decode=False, rngs=nnx.Rngs(0))
    assert _shapes(ours) == _shapes(theirs)
    same = jx.MultiHeadAttention(E, N, H, key_features=EKV, value_features=EKV, out_features=EO, rngs=nnx.Rngs(0))
    assert _shapes(same) == _shapes(ours)
    x, kv = np.ones((2, 11, E)), np.ones((2, 13, EKV))
    assert ours(x, kv).shape == (2, 11, EO)


@pytest.mark.parametrize(
    "ours, flax_name",
    [
        (dict(query_features=E), dict(in_features=E)),
        (dict(head_dim=H), dict(qkv_features=N * H)),
        (dict(key_features=EKV), dict(in_kv_features=EKV)),
        (dict(value_features=EKV), dict(in_kv_features=EKV)),
    ],
)
def test_nnx_refuses_both_spellings(ours, flax_name):
    kw = {"in_features": E, **ours, **flax_name} if "query_features" not in ours else {**ours, **flax_name}
    with pytest.raises(ValueError, match=f"{next(iter(ours))}/{next(iter(flax_name))}.*one of them"):
        jx.MultiHeadAttention(num_heads=N, rngs=nnx.Rngs(0), **kw)


def test_nnx_size_errors_name_the_argument():
    with pytest.raises(ValueError, match="qkv_features: expected a multiple of num_heads=3"):
        jx.MultiHeadAttention(num_heads=N, in_features=E, qkv_features=10, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="query_features: expected a positive int"):
        jx.MultiHeadAttention(num_heads=N, rngs=nnx.Rngs(0))


def test_linen_takes_qkv_features_and_declares_flax_shapes():
    x = np.ones((2, 11, E))
    ours = jl.MultiHeadAttention(num_heads=N, qkv_features=N * H, out_features=EO).init(jax.random.key(0), x)
    theirs = nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=N * H, out_features=EO).init(
        jax.random.key(0), x
    )
    assert jax.tree.map(jnp.shape, ours) == jax.tree.map(jnp.shape, theirs)
    with pytest.raises(ValueError, match="head_dim/qkv_features // num_heads.*one of them"):
        jl.MultiHeadAttention(num_heads=N, head_dim=H, qkv_features=N * H).init(jax.random.key(0), x)
