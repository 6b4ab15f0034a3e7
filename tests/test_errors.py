"""Bad input: every wrong call raises ValueError naming the argument and both shapes/dtypes, at trace time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn

B, T, S, N, K, H, Hv, E = 2, 5, 7, 6, 3, 11, 13, 17
f64 = np.float64
q = np.zeros((B, T, N, H))
k = np.zeros((B, S, K, H))
v = np.zeros((B, S, K, Hv))
params = jax.tree.map(
    np.asarray, jaxattn.init_multi_head_attention(jax.random.key(0), E, N, H, num_kv_heads=K, dtype=jnp.float64)
)
x = np.zeros((B, T, E))


def without(tree, *path):
    tree = jax.tree.map(lambda a: a, tree)
    node = tree
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    return tree


def replaced(tree, path, value):
    tree = jax.tree.map(lambda a: a, tree)
    node = tree
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return tree


dpa = jaxattn.dot_product_attention
CASES = {
    # name: (call, words the message must contain)
    "query rank": (lambda: dpa(q[0, 0], k, v), ["query", "[6,11]", "[...,T,N,H]"]),
    "key rank": (lambda: dpa(q, k[0, 0], v), ["key", "[3,11]", "[...,S,K,H]"]),
    "key head dim": (lambda: dpa(q, np.zeros((B, S, K, 4)), v), ["key", "H=11", "[2,7,3,4]"]),
    "value length": (lambda: dpa(q, k, np.zeros((B, 4, K, Hv))), ["value", "[...,7,3,Hv]", "[2,4,3,13]"]),
    "N % K": (lambda: dpa(q, np.zeros((B, S, 4, H)), np.zeros((B, S, 4, Hv))), ["key", "N=6", "K=4"]),
    "batch mismatch": (lambda: dpa(q, np.zeros((3, S, K, H)), np.zeros((3, S, K, Hv))), ["query", "[2]", "[3]"]),
    "dtype mismatch": (lambda: dpa(q.astype(np.float32), k, v), ["query", "float32", "float64"]),
    "integer inputs": (lambda: dpa(*(np.zeros(a.shape, np.int32) for a in (q, k, v))), ["query", "int32"]),
    "mask not bool": (lambda: dpa(q, k, v, mask=np.ones((T, S))), ["mask", "bool", "float64"]),
    "mask shape": (lambda: dpa(q, k, v, mask=np.ones((T, 3), bool)), ["mask", "[2,6,5,7]", "[5,3]"]),
    "mask extra dims": (lambda: dpa(q, k, v, mask=np.ones((1, 1, 1, T, S), bool)), ["mask", "[1,1,1,5,7]"]),
    "bias shape": (lambda: dpa(q, k, v, bias=np.zeros((N + 1, T, S))), ["bias", "[2,6,5,7]", "[7,5,7]"]),
    "bias int": (lambda: dpa(q, k, v, bias=np.zeros((T, S), np.int32)), ["bias", "floating", "int32"]),
    "bias narrower": (
        lambda: dpa(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), bias=np.zeros((T, S))),
        ["bias", "float32", "float64"],
    ),
    "lengths shape": (
        lambda: dpa(q, k, v, key_value_seq_lengths=np.array([1, 2, 3])),
        ["key_value_seq_lengths", "[3]"],
    ),
    "lengths float": (
        lambda: dpa(q, k, v, key_value_seq_lengths=np.array([1.0, 2.0])),
        ["key_value_seq_lengths", "integer"],
    ),
    "positions length": (
        lambda: dpa(q, k, v, is_causal=True, query_positions=np.arange(4)),
        ["query_positions", "[4]"],
    ),
    "positions float": (
        lambda: dpa(q, k, v, is_causal=True, key_positions=np.arange(S) * 1.0),
        ["key_positions", "integer"],
    ),
    "dropout no rng": (lambda: dpa(q, k, v, dropout_rate=0.5), ["dropout_rng"]),
    "dropout rate": (lambda: dpa(q, k, v, dropout_rate=1.5, dropout_rng=jax.random.key(0)), ["dropout_rate", "1.5"]),
    "rel_key shape": (
        lambda: jaxattn.relative_attention(q, k, v, np.zeros((T, S, 2, H))),
        ["rel_key", "[5,7,6 or 1,11]", "[5,7,2,11]"],
    ),
    "rel_value rank": (
        lambda: jaxattn.relative_attention(q, k, v, None, np.zeros((T, S, Hv))),
        ["rel_value", "[5,7,13]"],
    ),
    "shaw table rows": (
        lambda: jaxattn.shaw_relative_attention(q, k, v, np.zeros((4, H)), max_distance=2),
        ["key_table", "[5,11]", "[4,11]"],
    ),
    "shaw table heads": (
        lambda: jaxattn.shaw_relative_attention(q, k, v, None, np.zeros((5, K, Hv)), max_distance=2),
        ["value_table", "[5,6,13]", "[5,3,13]"],
    ),
    "max_distance < 0": (
        lambda: jaxattn.shaw_relative_attention(q, k, v, np.zeros((1, H)), max_distance=-1),
        ["max_distance", "-1"],
    ),
    "max_distance float": (lambda: jaxattn.relative_position_index(3, 3, 2.0), ["max_distance", "2.0"]),
    "params missing kernel": (
        lambda: jaxattn.multi_head_attention(without(params, "key", "kernel"), x),
        ["params['key']", "kernel"],
    ),
    "params missing entry": (lambda: jaxattn.multi_head_attention(without(params, "out"), x), ["params['out']"]),
    "params unexpected key": (lambda: jaxattn.multi_head_attention({**params, "extra": {}}, x), ["params", "extra"]),
    "params kernel heads": (
        lambda: jaxattn.multi_head_attention(replaced(params, ("out", "kernel"), np.zeros((N - 1, H, E))), x),
        ["params['out']['kernel']", "[6,11,17]", "[5,11,17]"],
    ),
    "params bias shape": (
        lambda: jaxattn.multi_head_attention(replaced(params, ("key", "bias"), np.zeros((N, H))), x),
        ["params['key']['bias']", "[3,11]", "[6,11]"],
    ),
    "input features": (
        lambda: jaxattn.multi_head_attention(params, np.zeros((B, T, E + 2))),
        ["query", "17", "[2,5,19]"],
    ),
    "relative params missing": (lambda: jaxattn.relative_multi_head_attention(params, x), ["params", "relative"]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_raises_value_error(name):
    call, words = CASES[name]
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, f"{name}: {word!r} not in {message!r}"


def test_errors_raise_at_trace_time_under_jit():
    with pytest.raises(ValueError, match="mask"):
        jax.jit(lambda q, k, v: dpa(q, k, v, mask=jnp.ones((T, 3), bool)))(q, k, v)
