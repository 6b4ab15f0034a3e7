"""A BlockMask carries its mask_mod, and flex_attention's torch-facing names mean what they mean in torch.

The issue this file pins down: `flex_attention(q, k, v, block_mask=bm)` is how every torch user writes a
masked flex call (torch's flex_attention has no mask_mod argument; the BlockMask carries it). Before,
jaxattn ran the BlockMask's partial tiles unmasked, 0.73-0.98 normwise off at T=40, S=72, tiles 16.

References: the plain-loop allowed-pairs grid and the full-grid float64 formula of tests/helpers.py, torch's
own eager flex_attention (return_lse, BlockMask fields), never jaxattn itself.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from helpers import allowed_loop, arrays, assert_float64, attention_reference, normwise

B, T, S, N, K, H, Hv = 2, 40, 72, 6, 3, 5, 7  # T=40, S=72, tiles 16: the shapes
TILES = 16
TOL = 1e-12
IMPLEMENTATIONS = ("dense", "blockwise")
DOCS = np.repeat(np.arange(8), 9)  # [S]: a document id per absolute key position, 9 keys each


def causal(b, n, t, s):
    return t >= s


def sliding(b, n, t, s):
    return (t >= s) & (t - s < 11)


def document(b, n, t, s):
    docs = jnp.asarray(DOCS)
    return (docs[t] == docs[s]) & (t >= s)


def chunked(b, n, t, s):
    return (t // 20 == s // 20) & (t >= s)


PATTERNS = {"causal": causal, "sliding": sliding, "document": document, "chunked": chunked}


def f64_error(got, expected):
    """normwise error of two float64 results (the guard fails if either is not)."""
    assert_float64(got, expected)
    return normwise(got, expected)


def qkv(seed):
    return arrays(seed, (B, T, N, H), (B, S, K, H), (B, S, K, Hv))


@functools.cache
def _allowed(mask_mod):
    """The loop reference's mask of a pattern (34560 pairs, one at a time: computed once per pattern)."""
    return allowed_loop(B, N, T, S, mask_mod=mask_mod)


def reference(mask_mod, q, k, v, **kw):
    return attention_reference(q, k, v, _allowed(mask_mod), **kw)


# the document pattern's loop reference (a Python call per element) is the slowest: slow group (CI runs it)
_SLOW_DOCUMENT = pytest.mark.slow


def _params(names):
    return [pytest.param(n, marks=_SLOW_DOCUMENT if n == "document" else ()) for n in sorted(names)]


def _causal_by_default(names):
    """The default run takes the causal pattern; the others repeat the mechanism (slow group)."""
    return [pytest.param(n, marks=pytest.mark.slow if n != "causal" else ()) for n in sorted(names)]


@pytest.mark.parametrize("name", _causal_by_default(PATTERNS))
def test_block_mask_alone_applies_its_mask_mod(name):
    """block_mask alone == mask_mod alone == both, on both engines, plain and under jit with the BlockMask
    as an argument; and the call that used to run partial tiles unmasked no longer equals the unmasked
    answer (it did before: that was the bug)."""
    mask_mod = PATTERNS[name]
    q, k, v = qkv(1)
    bm = jaxattn.create_block_mask(mask_mod, None, None, T, S, block_size=TILES)
    assert bm.mask_mod is not None
    expected = reference(mask_mod, q, k, v)
    # the old reading of this call: the same tiles with nothing inside partial ones (a raw BlockMask now)
    raw = jaxattn.BlockMask.from_kv_blocks(
        bm.kv_num_blocks,
        bm.kv_indices,
        bm.full_kv_num_blocks,
        bm.full_kv_indices,
        block_size=TILES,
        query_length=T,
        key_length=S,
    )
    unmasked_partials = jaxattn.flex_attention(q, k, v, block_mask=raw)
    assert f64_error(unmasked_partials, expected) > 0.1
    jitted = jax.jit(
        lambda q, k, v, bm, impl: jaxattn.flex_attention(q, k, v, block_mask=bm, implementation=impl), static_argnums=4
    )
    for impl in IMPLEMENTATIONS:
        calls = {
            "block_mask": jaxattn.flex_attention(q, k, v, block_mask=bm, implementation=impl),
            "mask_mod": jaxattn.flex_attention(q, k, v, mask_mod=mask_mod, implementation=impl),
            "both": jaxattn.flex_attention(q, k, v, mask_mod=mask_mod, block_mask=bm, implementation=impl),
            "jit(block_mask)": jitted(q, k, v, bm, impl),
        }
        for call, got in calls.items():
            assert f64_error(got, expected) <= TOL, (impl, call)


@pytest.mark.slow  # ~25 s: the loop reference per vmapped entry
def test_block_mask_under_vmap():
    q, k, v = qkv(2)
    bm = jaxattn.create_block_mask(document, None, None, T, S, block_size=TILES)
    expected = reference(document, q, k, v)
    for impl in IMPLEMENTATIONS:
        mapped = jax.vmap(lambda q, k, v: jaxattn.flex_attention(q, k, v, block_mask=bm, implementation=impl))(q, k, v)
        assert f64_error(mapped, expected) <= TOL, impl
        passed = jax.vmap(
            lambda q, k, v, bm: jaxattn.flex_attention(q, k, v, block_mask=bm, implementation=impl),
            in_axes=(0, 0, 0, None),
        )(q, k, v, bm)
        assert f64_error(passed, expected) <= TOL, impl


@pytest.mark.slow  # ~40 s: jax.grad through the loop reference
def test_gradients_through_block_mask_alone():
    """jax.grad of q, k, v and of a table a score_mod closes over, with the mask from block_mask alone;
    a float array the mask_mod closes over gets a zero (finite) gradient: masks are not differentiable."""
    q, k, v, table, weights = arrays(3, (B, T, N, H), (B, S, K, H), (B, S, K, Hv), (9, N), (S,))
    cot = arrays(4, (B, T, N, Hv))[0]

    def score_mod(table):
        return lambda score, b, n, t, s: score + table[jnp.clip(s - t, -4, 4) + 4, n]

    def loss_ours(q, k, v, table, weights):
        mask_mod = lambda b, n, t, s: (weights[s] > -1.0) & document(b, n, t, s)  # noqa: E731
        bm = jaxattn.create_block_mask(mask_mod, None, None, T, S, block_size=TILES)
        return jnp.sum(
            jaxattn.flex_attention(q, k, v, score_mod=score_mod(table), block_mask=bm, implementation="blockwise") * cot
        )

    def loss_reference(q, k, v, table):
        keep = np.asarray(weights) > -1.0
        return jnp.sum(
            reference(lambda b, n, t, s: keep[s] and document(b, n, t, s), q, k, v, score_mod=score_mod(table)) * cot
        )

    got = jax.grad(loss_ours, argnums=(0, 1, 2, 3, 4))(q, k, v, table, weights)
    expected = jax.grad(loss_reference, argnums=(0, 1, 2, 3))(q, k, v, table)
    for g, e in zip(got, expected):
        assert f64_error(g, e) <= TOL
    assert bool(jnp.all(got[4] == 0))


def test_another_mask_mod_is_anded_on_every_tile():
    """mask_mod and a BlockMask carrying a different one: their AND, also inside the BlockMask's full tiles
    (causal's full tiles hold pairs the sliding window blocks)."""
    q, k, v = qkv(5)
    bm = jaxattn.create_block_mask(causal, None, None, T, S, block_size=TILES)
    assert int(bm.full_kv_num_blocks.sum()) > 0
    window = lambda b, n, t, s: t - s < 11  # noqa: E731
    expected = reference(jaxattn.and_masks(causal, window), q, k, v)
    assert f64_error(expected, reference(causal, q, k, v)) > 0.1
    for impl in IMPLEMENTATIONS:
        got = jaxattn.flex_attention(q, k, v, mask_mod=window, block_mask=bm, implementation=impl)
        assert f64_error(got, expected) <= TOL, impl


def test_raw_tile_lists_apply_a_given_mask_mod_on_partial_tiles():
    """BlockMask.from_kv_blocks with mask_mod= carries it; without one, mask_mod= applies on its partial tiles."""
    q, k, v = qkv(6)
    built = jaxattn.create_block_mask(sliding, None, None, T, S, block_size=TILES)
    lists = (built.kv_num_blocks, built.kv_indices, built.full_kv_num_blocks, built.full_kv_indices)
    carried = jaxattn.BlockMask.from_kv_blocks(*lists, block_size=TILES, query_length=T, key_length=S, mask_mod=sliding)
    raw = jaxattn.BlockMask.from_kv_blocks(*lists, block_size=TILES, query_length=T, key_length=S)
    expected = reference(sliding, q, k, v)
    for impl in IMPLEMENTATIONS:
        assert f64_error(jaxattn.flex_attention(q, k, v, block_mask=carried, implementation=impl), expected) <= TOL
        got = jaxattn.flex_attention(q, k, v, mask_mod=sliding, block_mask=raw, implementation=impl)
        assert f64_error(got, expected) <= TOL


def test_block_masks_of_one_function_share_a_compiled_program():
    """Two BlockMasks from the same mask factory with different document ids: one jit compilation (the
    traced mask function is static by what it computes; the ids are data), each answer right."""
    q, k, v = qkv(7)

    def documents(ids):
        ids = jnp.asarray(ids)
        return lambda b, n, t, s: ids[t] == ids[s]

    ids_a, ids_b = DOCS, np.repeat(np.arange(4), 18)
    fn = jax.jit(lambda q, k, v, bm: jaxattn.flex_attention(q, k, v, block_mask=bm, implementation="blockwise"))
    for ids in (ids_a, ids_b):
        bm = jaxattn.create_block_mask(documents(ids), None, None, T, S, block_size=TILES)
        assert f64_error(fn(q, k, v, bm), reference(lambda b, n, t, s: ids[t] == ids[s], q, k, v)) <= TOL
    assert fn._cache_size() == 1


def test_torch_spellings_of_create_block_mask():
    ours = jaxattn.create_block_mask(sliding, None, None, T, S, block_size=TILES)
    theirs = jaxattn.create_block_mask(sliding, B=None, H=None, Q_LEN=T, KV_LEN=S, BLOCK_SIZE=TILES)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        assert np.array_equal(a, b)
    assert theirs.BLOCK_SIZE == (TILES, TILES) and theirs.seq_lengths == (T, S) and theirs.shape == (1, 1, T, S)
    with pytest.raises(ValueError, match="Q_LEN.*not both"):
        jaxattn.create_block_mask(sliding, None, None, T, S, Q_LEN=T)
    with pytest.raises(TypeError, match="SEQ"):
        jaxattn.create_block_mask(sliding, None, None, T, S, SEQ=3)


def test_device_as_torch_users_write_it():
    """torch's 6th argument, device: its torch names ("cuda", "cpu", an index), by keyword or position
    (BLOCK_SIZE 7th), build the same BlockMask; a jax.Device places its arrays there; anything else, and
    torch's other arguments with no JAX meaning, are refused by name."""
    ours = jaxattn.create_block_mask(sliding, None, None, T, S, block_size=TILES)
    for device in ("cuda", "cpu", "cuda:1", 0):
        for theirs in (
            jaxattn.create_block_mask(sliding, None, None, T, S, device=device, BLOCK_SIZE=TILES),
            jaxattn.create_block_mask(sliding, None, None, T, S, device, TILES),
        ):
            assert jax.tree.structure(theirs) == jax.tree.structure(ours)
            for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
                assert np.array_equal(a, b)
    assert not any(x.committed for x in jax.tree.leaves(theirs))  # a torch name places nothing
    device = jax.devices()[-1]
    placed = jaxattn.create_block_mask(document, None, None, T, S, device=device, block_size=TILES)
    assert placed.mask_consts  # the document ids it closes over travel with it
    assert all(x.committed and x.devices() == {device} for x in jax.tree.leaves(placed))  # jax.device_put
    for bad in (1.5, [0], -1, True):
        with pytest.raises(ValueError, match="device"):
            jaxattn.create_block_mask(sliding, None, None, T, S, device=bad)
    for name, value in (("_compile", True), ("separate_full_blocks", False), ("dq_kv_order", True)):
        with pytest.raises(ValueError, match=name):
            jaxattn.create_block_mask(sliding, None, None, T, S, **{name: value})


def test_torch_only_arguments_and_enable_gqa():
    q, k, v = qkv(8)
    with pytest.raises(ValueError, match="kernel_options"):
        jaxattn.flex_attention(q, k, v, kernel_options={"BLOCK_M": 64})
    with pytest.raises(ValueError, match="return_aux"):
        jaxattn.flex_attention(q, k, v, return_aux=object())
    with pytest.raises(ValueError, match=r"enable_gqa.*query heads 6, key heads 3"):
        jaxattn.flex_attention(q, k, v, enable_gqa=False)
    expected = jaxattn.flex_attention(q, k, v)
    assert f64_error(jaxattn.flex_attention(q, k, v, enable_gqa=True), expected) == 0
    mha = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
    assert f64_error(jaxattn.flex_attention(q, *mha, enable_gqa=False), expected) <= TOL


def test_torch_layout_with_a_block_mask_is_named():
    """query in torch's [B,N,T,H] layout against a BlockMask built for T: the error says which layout."""
    q, k, v = arrays(9, (B, N, S, H), (B, K, S, H), (B, K, S, Hv))  # self-attention, torch's layout
    bm = jaxattn.create_block_mask(causal, None, None, S, S, block_size=TILES)
    for impl in IMPLEMENTATIONS:
        with pytest.raises(ValueError, match=r"torch's \[B,N,T,H\] layout"):
            jaxattn.flex_attention(q, k, v, block_mask=bm, implementation=impl)


def test_positional_arguments_in_torch_order():
    q, k, v = qkv(10)
    bm = jaxattn.create_block_mask(document, None, None, T, S, block_size=TILES)
    alibi = lambda score, b, n, t, s: score - 0.1 * (t - s)  # noqa: E731
    by_keyword = jaxattn.flex_attention(q, k, v, score_mod=alibi, block_mask=bm, scale=0.3)
    by_position = jaxattn.flex_attention(q, k, v, alibi, bm, 0.3)
    assert f64_error(by_position, by_keyword) == 0


def torch_flex(q, k, v, mask_mod, score_mod=None):
    """torch's eager flex_attention on our arrays (layout [B,T,N,H] <-> torch's [B,N,T,H]), T == S."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def t(x):
        return torch.from_numpy(np.asarray(x)).transpose(1, 2)

    L = q.shape[1]
    bm = create_block_mask(mask_mod, None, None, L, L, device="cpu", BLOCK_SIZE=TILES)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*torch.compile", category=UserWarning)
        out, lse = flex_attention(
            t(q), t(k), t(v), score_mod=score_mod, block_mask=bm, enable_gqa=True, return_lse=True
        )
    return out.transpose(1, 2).numpy(), lse.numpy(), bm


def torch_document(b, h, i, j):
    import torch

    docs = torch.from_numpy(DOCS)
    return (docs[i] == docs[j]) & (i >= j)


TORCH_MASKS = {"causal": lambda b, h, i, j: i >= j, "document": torch_document}  # the same, on torch indices


@pytest.mark.slow  # torch flex parity stays in the default group: tests/peers/test_torch_flex.py
@pytest.mark.parametrize("name", _params(TORCH_MASKS))
def test_return_lse_and_block_mask_fields_equal_torchs(name):
    """T == S (where torch's row indices and our positions agree): output, lse and the BlockMask's
    tiles equal torch's eager flex_attention in float64, on both engines; lse's gradient matches the
    float64 formula's (jax.nn.logsumexp over the allowed keys)."""
    mask_mod = PATTERNS[name]
    q, k, v = arrays(11, (B, S, N, H), (B, S, K, H), (B, S, K, Hv))
    out_t, lse_t, bm_t = torch_flex(q, k, v, TORCH_MASKS[name])
    bm = jaxattn.create_block_mask(mask_mod, None, None, S, S, block_size=TILES)
    assert np.array_equal(np.asarray(bm.to_dense()), bm_t.to_dense().numpy())
    assert bm.sparsity() == pytest.approx(bm_t.sparsity())
    allowed = allowed_loop(B, N, S, S, mask_mod=mask_mod)
    cot = arrays(12, (B, N, S))[0]

    def lse_reference(q, k):
        x = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, N // K, axis=2)) * H**-0.5
        return jax.nn.logsumexp(jnp.where(allowed, x, -jnp.inf), axis=-1)

    expected_grads = jax.grad(lambda q, k: jnp.sum(lse_reference(q, k) * cot), argnums=(0, 1))(q, k)
    for impl in IMPLEMENTATIONS:
        out, lse = jaxattn.flex_attention(q, k, v, block_mask=bm, return_lse=True, implementation=impl)
        assert lse.shape == (B, N, S) and lse.dtype == jnp.float64
        assert f64_error(out, out_t) <= TOL and f64_error(lse, lse_t) <= TOL, impl
        grads = jax.grad(
            lambda q, k: jnp.sum(
                jaxattn.flex_attention(q, k, v, block_mask=bm, return_lse=True, implementation=impl)[1] * cot
            ),
            argnums=(0, 1),
        )(q, k)
        for g, e in zip(grads, expected_grads):
            assert f64_error(g, e) <= TOL, impl


def test_lse_of_rows_with_no_key_and_with_sinks():
    """lse is -inf for a row with no allowed key (torch's convention), the sink's logit when only the
    sink remains; the output there is zeros either way."""
    q, k, v = qkv(13)
    sinks = arrays(14, (N,))[0]
    lengths = jnp.array([S, 0])
    for impl in IMPLEMENTATIONS:
        out, lse = jaxattn.flex_attention(q, k, v, key_value_seq_lengths=lengths, return_lse=True, implementation=impl)
        assert bool(jnp.all(jnp.isneginf(lse[1]))) and bool(jnp.all(jnp.isfinite(lse[0])))
        assert bool(jnp.all(out[1] == 0))
        out, lse = jaxattn.flex_attention(
            q, k, v, key_value_seq_lengths=lengths, sinks=sinks, return_lse=True, implementation=impl
        )
        assert np.array_equal(np.asarray(lse[1]), np.broadcast_to(np.asarray(sinks)[:, None], (N, T)))


KERNELS = {"pallas_gpu": dict(interpret=True), "pallas_tpu": dict(interpret=True)}  # interpret mode on CPU


@pytest.mark.parametrize(
    "sizes, kernels",
    [
        ((1, 1), False),  # the default group: the engines (the kernels read a size-1 axis as for None)
        pytest.param((1, 1), True, marks=pytest.mark.slow),  # + the kernels in interpret mode: ~10 s more
        pytest.param((1, N), True, marks=pytest.mark.slow),
        pytest.param((B, 1), True, marks=pytest.mark.slow),
    ],
)
def test_size_one_batch_and_head_broadcast(sizes, kernels):
    """torch's B=1 / H=1: a BlockMask built for one batch entry and / or one head serves a batch of B and N
    heads (torch broadcasts a size-1 batch or head dimension of its BlockMask), on every path: the engines
    in float64 and, with `kernels`, both kernels in interpret mode in float32 (the TPU kernel indexes in
    int32: x64 off); outputs and gradients of q, k, v against the float64 formula."""
    bm = jaxattn.create_block_mask(causal, *sizes, T, S, block_size=TILES)
    assert bm.shape == (*sizes, T, S)
    q, k, v = qkv(15)
    cot = arrays(16, (B, T, N, Hv))[0]
    allowed = _allowed(causal)

    def with_grads(f):
        return lambda *a: (f(*a), jax.grad(lambda *a: jnp.sum(f(*a) * cot.astype(a[0].dtype)), argnums=(0, 1, 2))(*a))

    expected = jax.jit(with_grads(lambda q, k, v: attention_reference(q, k, v, allowed)))(q, k, v)
    for impl in IMPLEMENTATIONS:
        got = jax.jit(with_grads(lambda q, k, v: jaxattn.flex_attention(q, k, v, block_mask=bm, implementation=impl)))(
            q, k, v
        )
        assert_float64(got)
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
            assert normwise(g, e) <= TOL, impl
    if not kernels:
        return
    with jax.enable_x64(False):
        args = [x.astype(jnp.float32) for x in (q, k, v)]
        bm32 = jaxattn.create_block_mask(causal, *sizes, T, S, block_size=TILES)  # int32 tile lists
        for impl, kw in KERNELS.items():
            kernel = lambda q, k, v: jaxattn.flex_attention(q, k, v, block_mask=bm32, implementation=impl, **kw)
            # jit of grad, as the engines above: the TPU kernel's custom VJP once closed over the BlockMask's
            # arrays, tracers of the eager wrapper's trace under grad, and failed to lower here
            out, grads = jax.jit(with_grads(kernel))(*args)
            assert out.dtype == jnp.float32 and normwise(out, expected[0]) <= 1e-6, impl
            for g, e in zip(grads, expected[1], strict=True):
                assert normwise(g, e) <= 1e-5, impl


def test_other_batch_and_head_sizes_are_refused_naming_both_shapes():
    """Only a size of 1 (or None) broadcasts: a BlockMask built for 3 batch entries or 4 heads is refused
    for B=2, N=6, naming block_mask and both shapes."""
    q, k, v = qkv(17)
    for sizes, shown in (((3, 1), r"\[3,1,40,72\]"), ((1, 4), r"\[1,4,40,72\]"), ((None, 2), r"\[any,2,40,72\]")):
        bm = jaxattn.create_block_mask(causal, *sizes, T, S, block_size=TILES)
        for impl in (*IMPLEMENTATIONS, "pallas_gpu"):
            with pytest.raises(ValueError, match=r"block_mask.*\[2,6,40,72\].*" + shown):
                jaxattn.flex_attention(q, k, v, block_mask=bm, implementation=impl, interpret=impl == "pallas_gpu")
