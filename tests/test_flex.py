"""flex_attention (score_mod / mask_mod / BlockMask) and create_block_mask, against independent references.

score_mod / mask_mod see absolute positions (query t at t + S - T unless positions are given) and the
flattened batch index b. The reference (tests/helpers.py) evaluates mask_mod with Python loops on
Python ints and score_mod on broadcast index grids over the full [B,N,T,S] grid; gradients of the arrays a
score_mod closes over are compared with jax.grad of that reference in float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from helpers import allowed_loop, arrays, assert_float64, attention_reference, check_forward_and_grads, normwise

B, T, S, N, K, H, Hv = 2, 7, 11, 6, 3, 5, 3
TOL = 1e-12
IMPLEMENTATIONS = ["dense", "blockwise"]


def qkv(seed=0, t=T, s=S, batch=(B,)):
    return arrays(seed, (*batch, t, N, H), (*batch, s, K, H), (*batch, s, K, Hv))


# score_mods: elementwise in (score, b, n, t, s); written so that they also broadcast (the reference's way).
def alibi(slopes):
    return lambda score, b, n, t, s: score + slopes[n] * (s - t)


def t5_table(table):  # table [9, N]: bucket = clip(s - t, -4, 4) + 4
    return lambda score, b, n, t, s: score + table[jnp.clip(s - t, -4, 4) + 4, n]


def per_batch(offsets):
    return lambda score, b, n, t, s: score * offsets[b]


def tanh_cap(score, b, n, t, s):
    return 2.0 * jnp.tanh(score / 2.0)


# mask_mods on absolute positions
def causal(b, n, t, s):
    return t >= s


def sliding(b, n, t, s):
    return (t >= s) & (t - s <= 3)


DOCS = np.array([[0] * 4 + [1] * 5 + [2] * 2, [3] * 7 + [4] * 4])  # [B, S]: document id per absolute position


def document(b, n, t, s):
    docs = jnp.asarray(DOCS)
    return docs[b, t] == docs[b, s]


PREFIX = np.array([3, 6])


def prefix_lm(b, n, t, s):
    return (s <= t) | (s < jnp.asarray(PREFIX)[b])


def chunked(b, n, t, s):
    return (t // 4 == s // 4) & (s <= t)


def head_dependent(b, n, t, s):
    return (s <= t + n - 2) | (s == 0)


MASK_MODS = {
    "causal": causal,
    "sliding": sliding,
    "document": document,
    "prefix_lm": prefix_lm,
    "chunked": chunked,
    "head_dependent": head_dependent,
}
# The other mask_mods' attention (a batch-dependent and a head-dependent one, with and without a BlockMask, on
# every implementation) is tests/test_contract.py's; these two repeat the mechanism on other patterns.
GRADIENT_CASES = ("prefix_lm", "chunked")


@pytest.mark.slow
@pytest.mark.parametrize("name", GRADIENT_CASES)
def test_mask_mods(name):
    """Blockwise with a BlockMask: forward and gradients; dense and blockwise without one: forward."""
    mask_mod = MASK_MODS[name]
    q, k, v = qkv(1)
    allowed = allowed_loop(B, N, T, S, mask_mod=mask_mod)
    block_mask = jaxattn.create_block_mask(mask_mod, B, N, T, S, block_size=(3, 4))

    def ours(q, k, v):
        return jaxattn.flex_attention(q, k, v, mask_mod=mask_mod, block_mask=block_mask)

    def reference(q, k, v):
        return attention_reference(q, k, v, allowed)

    check_forward_and_grads(ours, reference, (q, k, v), (0, 1, 2))
    expected = reference(q, k, v)
    for kw in (dict(implementation="dense"), dict(implementation="blockwise", block_size=(2, 5))):
        got = jax.jit(lambda q, k, v, kw=kw: jaxattn.flex_attention(q, k, v, mask_mod=mask_mod, **kw))(q, k, v)
        assert_float64(got)
        assert normwise(got, expected) <= TOL


SCORE_MODS = {
    "alibi": (alibi, (N,)),
    "t5_table": (t5_table, (9, N)),
    "per_batch": (per_batch, (B,)),
}


@pytest.mark.parametrize(
    "name,implementation",
    [
        ("t5_table", "dense"),
        ("t5_table", "blockwise"),
        ("per_batch", "dense"),
    ],
)
def test_score_mods_and_the_gradient_of_what_they_close_over(name, implementation):
    make, shape = SCORE_MODS[name]
    q, k, v = qkv(2)
    (param,) = arrays(3, shape)
    block_mask = jaxattn.create_block_mask(causal, None, None, T, S, block_size=(4, 3))
    allowed = allowed_loop(B, N, T, S, is_causal=True)

    def ours(q, k, v, param):
        return jaxattn.flex_attention(
            q,
            k,
            v,
            score_mod=make(param),
            mask_mod=causal,
            block_mask=block_mask if implementation == "blockwise" else None,
            implementation=implementation,
        )

    def reference(q, k, v, param):
        return attention_reference(q, k, v, allowed, score_mod=make(param))

    check_forward_and_grads(ours, reference, (q, k, v, param), (0, 1, 2, 3))


def test_score_mod_capping_equals_logit_softcap():
    q, k, v = qkv(6)
    for implementation in ("blockwise",):
        a = jaxattn.flex_attention(q, k, v, score_mod=tanh_cap, is_causal=True, implementation=implementation)
        b = jaxattn.dot_product_attention(q, k, v, logit_softcap=2.0, is_causal=True, implementation=implementation)
        assert_float64(a, b)
        assert normwise(a, b) <= TOL


def test_batch_dims_are_flattened_for_b():
    """Two leading batch dims [2,3]: b = 3 * i + j."""
    q, k, v = qkv(8, batch=(2, 3))
    scales = jnp.arange(1.0, 7.0)
    got = jaxattn.flex_attention(q, k, v, score_mod=per_batch(scales))
    assert_float64(got)
    for i in range(2):
        for j in range(3):
            expected = jaxattn.dot_product_attention(q[i, j], k[i, j], v[i, j], scale=H**-0.5 * (3 * i + j + 1))
            assert normwise(got[i, j], expected) <= TOL


def test_full_tiles_skip_mask_mod():
    """A tile marked full by a BlockMask without a mask_mod of its own (raw tile lists) is not masked: with
    a mask_mod that allows nothing, exactly the pairs of full tiles take part (torch's contract for full
    blocks). A BlockMask that carries its mask_mod would AND the two instead (tests/test_block_mask.py)."""
    q, k, v = qkv(9)
    built = jaxattn.create_block_mask(causal, None, None, T, S, block_size=(3, 4))
    bm = jaxattn.BlockMask.from_kv_blocks(
        built.kv_num_blocks,
        built.kv_indices,
        built.full_kv_num_blocks,
        built.full_kv_indices,
        block_size=(3, 4),
        query_length=T,
        key_length=S,
    )
    assert bm.mask_mod is None
    full_pairs = np.zeros((T, S), bool)
    nums, idx = np.asarray(bm.full_kv_num_blocks)[0, 0], np.asarray(bm.full_kv_indices)[0, 0]
    for i in range(nums.shape[0]):
        for j in idx[i, : nums[i]]:
            full_pairs[3 * i : 3 * i + 3, 4 * j : 4 * j + 4] = True
    assert full_pairs.any() and not full_pairs.all()
    expected = attention_reference(q, k, v, np.broadcast_to(full_pairs, (B, N, T, S)))
    for implementation in IMPLEMENTATIONS:
        got = jaxattn.flex_attention(
            q, k, v, mask_mod=lambda b, n, t, s: t < -1, block_mask=bm, implementation=implementation
        )
        assert_float64(got, expected)
        assert normwise(got, expected) <= TOL


@pytest.mark.parametrize("name", sorted(MASK_MODS))
def test_create_block_mask_against_brute_force(name):
    mask_mod = MASK_MODS[name]
    Tb, Sb = 2, 3
    bm = jaxattn.create_block_mask(mask_mod, B, N, T, S, block_size=(Tb, Sb))
    allowed = allowed_loop(B, N, T, S, mask_mod=mask_mod)
    nq, nk = -(-T // Tb), -(-S // Sb)
    assert bm.kv_num_blocks.shape == (B, N, nq) and bm.kv_indices.shape == (B, N, nq, nk)
    assert bm.full_kv_num_blocks.shape == (B, N, nq) and bm.full_kv_indices.shape == (B, N, nq, nk)
    assert bm.kv_num_blocks.dtype == jnp.int32
    for b in range(B):
        for n in range(N):
            for i in range(nq):
                tile = [allowed[b, n, i * Tb : (i + 1) * Tb, j * Sb : (j + 1) * Sb] for j in range(nk)]
                full = [j for j in range(nk) if tile[j].all()]
                partial = [j for j in range(nk) if tile[j].any() and not tile[j].all()]
                assert int(bm.full_kv_num_blocks[b, n, i]) == len(full)
                assert sorted(np.asarray(bm.full_kv_indices[b, n, i, : len(full)]).tolist()) == full
                assert int(bm.kv_num_blocks[b, n, i]) == len(partial)
                assert sorted(np.asarray(bm.kv_indices[b, n, i, : len(partial)]).tolist()) == partial


def test_block_mask_is_a_pytree_under_jit_and_vmap():
    q, k, v = qkv(10)
    bm = jaxattn.create_block_mask(sliding, B, None, T, S, block_size=(3, 4))
    leaves = jax.tree.leaves(bm)
    assert leaves and all(isinstance(x, jax.Array) for x in leaves)
    f = lambda q, k, v, bm: jaxattn.flex_attention(q, k, v, mask_mod=sliding, block_mask=bm)
    plain = f(q, k, v, bm)
    assert_float64(plain)
    assert normwise(jax.jit(f)(q, k, v, bm), plain) <= TOL
    single = jaxattn.create_block_mask(sliding, None, None, T, S, block_size=(3, 4))
    mapped = jax.vmap(f, in_axes=(0, 0, 0, None))(q, k, v, single)
    assert normwise(mapped, plain) <= TOL


def test_block_mask_skips_empty_tiles():
    """A document layout: the blockwise path visits only the tiles of each document (counted per query tile)."""
    bm = jaxattn.create_block_mask(document, B, None, T, S, block_size=(3, 4))
    allowed = allowed_loop(B, 1, T, S, mask_mod=document)
    visited = np.asarray(bm.kv_num_blocks + bm.full_kv_num_blocks)
    assert visited.sum() < B * 3 * 3  # fewer than every (query tile, key tile) pair
    for b in range(B):
        for i in range(3):
            assert visited[b, 0, i] == sum(allowed[b, 0, 3 * i : 3 * i + 3, 4 * j : 4 * j + 4].any() for j in range(3))


BAD = [
    (dict(mask_mod=lambda b, n, t, s: t - s), "mask_mod.*bool"),
    (dict(score_mod=lambda score, b, n, t, s: jnp.stack([score, score])), r"score_mod.*shape"),
    (dict(score_mod=lambda score, b, n, t, s: score.astype(jnp.float32)), "score_mod.*dtype"),
    (dict(mask_mod=causal, block_mask="sizes"), r"block_mask.*\[2,6,9,11\]"),
    (dict(block_mask="tiles"), "block_mask"),
    (dict(mask_mod=causal, block_mask="heads"), "block_mask"),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kwargs,match", BAD)
def test_bad_input(kwargs, match, implementation):
    q, k, v = qkv(11)
    kwargs = dict(kwargs)
    if kwargs.get("block_mask") == "sizes":
        kwargs["block_mask"] = jaxattn.create_block_mask(causal, B, N, 9, S)
    elif kwargs.get("block_mask") == "tiles":
        kwargs["block_mask"] = jaxattn.create_block_mask(causal, B, N, T, S, block_size=(3, 4))
        kwargs["block_size"] = (2, 2)
        kwargs["mask_mod"] = causal
    elif kwargs.get("block_mask") == "heads":
        kwargs["block_mask"] = jaxattn.create_block_mask(causal, B, 4, T, S)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(
            lambda q, k, v: jaxattn.flex_attention(q, k, v, implementation=implementation, **kwargs), q, k, v
        )


def test_create_block_mask_bad_input():
    with pytest.raises(ValueError, match="mask_mod.*bool"):
        jaxattn.create_block_mask(lambda b, n, t, s: t * 1.0, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="query_length"):
        jaxattn.create_block_mask(causal, 1, 1, 0, 4)
    with pytest.raises(ValueError, match="block_size"):
        jaxattn.create_block_mask(causal, 1, 1, 4, 4, block_size=(0, 2))


@pytest.mark.slow  # big shapes; XLA's memory analysis stays in the default run through tests/test_memory.py
def test_memory_is_linear_in_length():
    """Forward + backward of flex_attention with a closed-over score_mod table and a causal BlockMask:
    XLA's compiled temp memory grows like S (4x length: <= 4.2x memory), never like S^2."""
    F32 = jnp.float32

    def grad_temp(L):
        bm = jaxattn.create_block_mask(causal, None, None, L, L, block_size=(256, 256))
        shape = jax.ShapeDtypeStruct((1, L, 4, 32), F32)
        table = jax.ShapeDtypeStruct((9, 4), F32)

        def loss(q, k, v, table):
            out = jaxattn.flex_attention(
                q, k, v, score_mod=t5_table(table), mask_mod=causal, block_mask=bm, implementation="blockwise"
            )
            return jnp.sum(out)

        g = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        return g.lower(shape, shape, shape, table).compile().memory_analysis().temp_size_in_bytes

    small, large = grad_temp(1024), grad_temp(4096)
    assert large <= 4.2 * small, (small, large)
    assert large < 64 * 2**20
