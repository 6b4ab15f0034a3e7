"""The Pallas GPU kernel (jaxattn._kernels.pallas_gpu) equals the dense engine, run by Pallas' interpreter on CPU.

float32 at highest precision: outputs and lse <= 1e-6, gradients (q, k, v, sinks, a score_mod's closed-over
array) <= 1e-5, normwise. Every axis has its own prime size; T, S and the head dims are not multiples of the
tiles (the kernel pads them inside), T > S gives causal rows with no allowed key (zeros, finite gradients).
Interpret mode compiles slowly, so options are grouped into a few cases; the one-option-at-a-time grid,
vmap and the bf16 envelope are in the slow group. The CUDA lowering tests check that the kernel lowers to
Triton custom calls with no XLA tile loop, on this CPU machine.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn._kernels import pallas_gpu
from helpers import allowed_loop, attention_reference, normwise

OUT_TOL, GRAD_TOL = 1e-6, 1e-5
# bf16 inputs (float32 logits and softmax inside), normwise error against the float32 dense result of the
# same bf16-rounded inputs, measured over this file's four cases: kernel output <= 2.0e-3, gradients <= 4.0e-3
# (the dense engine run in bf16 itself: 2.4e-3 and 3.3e-3; lse 3e-8). The envelope is twice the kernel's.
BF16_OUT_TOL, BF16_GRAD_TOL = 4e-3, 8e-3


def _arrays(seed, *shapes, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=shape).astype(dtype)) for shape in shapes]


def _alibi(slope):
    return lambda score, b, n, t, s: score - slope[n] * jnp.abs(t - s).astype(score.dtype)


def _band(b, n, t, s):
    return (t - s) % 5 != 3


def _case(name):
    """(shapes (batch, T, S, N, K, H, Hv), block, options, differentiable extras {name: array}) of one case."""
    rng = np.random.default_rng(7)
    if name == "causal_gqa_lengths_segments_sinks_score_mask":  # the default-group case: T > S, no key for some
        batch, T, S, N, K, H, Hv = (2,), 13, 11, 6, 2, 5, 7
        q_seg = jnp.asarray(np.sort(rng.integers(0, 2, (2, T)), axis=-1), jnp.int32)
        k_seg = jnp.asarray(np.sort(rng.integers(0, 2, (2, S)), axis=-1), jnp.int32)
        return (
            (batch, T, S, N, K, H, Hv),
            (8, 4),
            dict(
                is_causal=True,
                key_value_seq_lengths=jnp.asarray([9, 6], jnp.int32),
                query_segment_ids=q_seg,
                key_segment_ids=k_seg,
                logit_softcap=4.0,
                mask_mod=_band,
                return_lse=True,
            ),
            {
                "sinks": jnp.asarray(rng.normal(size=N), jnp.float32),
                "slope": jnp.asarray(rng.uniform(0.1, 1.0, N), jnp.float32),
            },
        )
    if name == "causal_gqa_lengths_lse":  # T > S: the first queries see no key
        batch, T, S, N, K, H, Hv = (2,), 13, 11, 6, 3, 5, 7
        return (
            (batch, T, S, N, K, H, Hv),
            (8, 4),
            dict(is_causal=True, key_value_seq_lengths=jnp.asarray([9, 4], jnp.int32), return_lse=True),
            {},
        )
    if name == "window_chunk_segments_softcap_sinks":
        batch, T, S, N, K, H, Hv = (), 11, 17, 6, 2, 3, 5
        q_seg = jnp.asarray(np.sort(rng.integers(0, 3, T)), jnp.int32)
        k_seg = jnp.asarray(np.sort(rng.integers(0, 3, S)), jnp.int32)
        return (
            (batch, T, S, N, K, H, Hv),
            (4, 8),
            dict(
                window=(5, 2),
                chunk_size=7,
                query_segment_ids=q_seg,
                key_segment_ids=k_seg,
                logit_softcap=2.0,
                query_positions=jnp.asarray(rng.permutation(T) + 3, jnp.int32),
                return_lse=True,
            ),
            {"sinks": jnp.asarray(rng.normal(size=N), jnp.float32)},
        )
    if name == "score_mod_mask_mod_block_mask":
        batch, T, S, N, K, H, Hv = (3,), 19, 23, 6, 2, 5, 3
        kinds = rng.integers(0, 3, (1, N, 3, 3))
        kinds[0, :, 1, 0] = 0  # an empty tile for every head
        block_mask = jaxattn.BlockMask.from_kv_blocks(
            *_tile_lists(kinds), block_size=(8, 8), query_length=T, key_length=S, mask_mod=_band
        )
        return (
            (batch, T, S, N, K, H, Hv),
            None,
            dict(block_mask=block_mask, is_causal=True, return_lse=True),
            {"slope": jnp.asarray(rng.uniform(0.1, 1.0, N), jnp.float32)},
        )
    raise KeyError(name)


def _tile_lists(kinds):
    """torch's tile lists (partial then full) from kinds [B,N,Tn,Sn] (0 empty, 1 partial, 2 full)."""

    def listing(selected):
        order = np.argsort(~selected, axis=-1, kind="stable")
        return jnp.asarray(selected.sum(-1), jnp.int32), jnp.asarray(order, jnp.int32)

    return (*listing(kinds == 1), *listing(kinds == 2))


DEFAULT_CASE = "causal_gqa_lengths_segments_sinks_score_mask"
CASES = ["causal_gqa_lengths_lse", "window_chunk_segments_softcap_sinks", "score_mod_mask_mod_block_mask"]


def _attend(impl, block, options, extras):
    """f(q, k, v, extras) -> (out, lse or None) for the kernel ("kernel") or the dense engine ("dense")."""

    def f(q, k, v, extras):
        opts = dict(options)
        if "sinks" in extras:
            opts["sinks"] = extras["sinks"]
        if "slope" in extras:
            opts["score_mod"] = _alibi(extras["slope"])
        if impl == "kernel":
            result = pallas_gpu.attention(q, k, v, interpret=True, precision="highest", block_size=block, **opts)
        else:
            result = jaxattn.flex_attention(q, k, v, implementation="dense", precision="highest", **opts)
        return result if opts.get("return_lse") else (result, None)

    return f


def _run(impl, case, dtype=np.float32, rounded_to=None):
    """jit of (out, lse, gradients of sum(out * w) + sum(lse * w_lse) over finite lse) for one case, inputs
    in dtype (rounded_to: first rounded to that dtype, the bf16 inputs a float32 reference sees)."""
    (batch, T, S, N, K, H, Hv), block, options, extras = _case(case)
    q, k, v, w, w_lse = _arrays(
        1, (*batch, T, N, H), (*batch, S, K, H), (*batch, S, K, Hv), (*batch, T, N, Hv), (*batch, N, T)
    )
    q, k, v = (x.astype(rounded_to or dtype).astype(dtype) for x in (q, k, v))
    f = _attend(impl, block, options, extras)

    @jax.jit
    def both(q, k, v, extras):
        (out, lse), vjp = jax.vjp(f, q, k, v, extras)
        # rows with no allowed key have lse = -inf and no gradient: their cotangent is 0
        d_lse = None if lse is None else jnp.where(jnp.isfinite(lse), w_lse, 0).astype(lse.dtype)
        return out, lse, vjp((w.astype(out.dtype), d_lse))

    return both(q, k, v, extras)


def _compare(got, expected, out_tol, grad_tol):
    (out, lse, grads), (out_e, lse_e, grads_e) = got, expected
    assert normwise(out, out_e) <= out_tol, normwise(out, out_e)
    if lse_e is not None:
        assert bool(jnp.all(jnp.isfinite(lse) == jnp.isfinite(lse_e)))
        finite = jnp.isfinite(lse_e)
        assert normwise(jnp.where(finite, lse, 0), jnp.where(finite, lse_e, 0)) <= out_tol
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_e), strict=True):
        assert bool(jnp.all(jnp.isfinite(g)))
        assert normwise(g, e) <= grad_tol, normwise(g, e)


def test_kernel_equals_dense_and_the_loop_reference():
    """The default-group case (most options at once): against the dense engine (outputs, lse, gradients of
    q, k, v, sinks and the score_mod's slopes) and the tests' own formula (helpers: allowed_loop and
    attention_reference, which share no code with jaxattn)."""
    got = _run("kernel", DEFAULT_CASE)
    _compare(got, _run("dense", DEFAULT_CASE), OUT_TOL, GRAD_TOL)
    (batch, T, S, N, K, H, Hv), _, options, extras = _case(DEFAULT_CASE)
    out, lse, _ = got
    assert bool(jnp.all(out[:, :2] == 0))  # queries before the first key: zeros (lse = the sink alone)
    assert normwise(lse[..., :2], jnp.broadcast_to(extras["sinks"][:, None], (2, N, 2))) == 0
    q, k, v = _arrays(1, (*batch, T, N, H), (*batch, S, K, H), (*batch, S, K, Hv))
    rules = {
        name: options[name]
        for name in ("is_causal", "key_value_seq_lengths", "query_segment_ids", "key_segment_ids", "mask_mod")
    }
    allowed = allowed_loop(batch, N, T, S, **rules)
    expected = attention_reference(
        q,
        k,
        v,
        allowed,
        logit_softcap=options["logit_softcap"],
        sinks=extras["sinks"],
        score_mod=_alibi(extras["slope"]),
    )
    assert normwise(out, expected) <= OUT_TOL


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_dense(case):
    got = _run("kernel", case)
    _compare(got, _run("dense", case), OUT_TOL, GRAD_TOL)
    if case == "causal_gqa_lengths_lse":  # queries before the first key: zeros, lse = -inf
        out, lse, _ = got
        assert bool(jnp.all(out[:, :2] == 0)) and bool(jnp.all(lse[..., :2] == -jnp.inf))


# ---------------------------------------------------------------------------------------------------------
# what the kernel refuses


def test_unsupported_names_the_option():
    q, k, v = (jnp.zeros((2, 5, 2, 4), jnp.float32),) * 3
    assert pallas_gpu.unsupported(q, k, v, is_causal=True, window=(3, 0), sinks=jnp.zeros(2)) is None
    assert pallas_gpu.unsupported(q, k, v, bias=jnp.zeros((5, 5))) == "bias"
    assert pallas_gpu.unsupported(q, k, v, mask=jnp.ones((5, 5), bool)) == "mask"
    assert pallas_gpu.unsupported(q, k, v, dropout_rate=0.1) == "dropout_rate"
    assert pallas_gpu.unsupported(q, k, v, return_weights=True) == "return_weights"
    assert pallas_gpu.unsupported(q, k, v, key_table=jnp.zeros((3, 4)), max_distance=1) == "key_table"
    assert pallas_gpu.unsupported(q, k, v, position_bias=lambda i, j: 0.0) == "position_bias"
    slope = jnp.ones(2, jnp.float32)
    # Triton cannot index a closed-over array by head or position: on a GPU such a score_mod falls back
    assert pallas_gpu.unsupported(q, k, v, score_mod=_alibi(slope)) == "score_mod"
    assert pallas_gpu.unsupported(q, k, v, score_mod=_alibi(slope), interpret=True) is None
    assert pallas_gpu.unsupported(q, k, v, score_mod=lambda x, b, n, t, s: x * 0.5) is None
    assert pallas_gpu.unsupported(q, k, v, block_size=(24, 16)) == "block_size"
    with pytest.raises(ValueError, match="implementation.*bias"):
        pallas_gpu.attention(q, k, v, bias=jnp.zeros((5, 5)), interpret=True)
    out, lse = pallas_gpu.attention(q, k[:, :0], v[:, :0], interpret=True, return_lse=True)  # no key: no tile
    assert bool(jnp.all(out == 0)) and out.shape == (2, 5, 2, 4) and bool(jnp.all(lse == -jnp.inf))


# ---------------------------------------------------------------------------------------------------------
# lowering for CUDA (no GPU needed): one Triton custom call per kernel, no XLA tile loop


def _lowered(f, *args):
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


LOWERED = {
    "causal": lambda: dict(is_causal=True),
    # window, segment ids, and a score_mod and BlockMask mask_mod that close over no array (one that does
    # falls back: see unsupported)
    "window_segments_score_mod_block_mask": lambda: dict(
        window=(127, 0),
        query_segment_ids=jnp.zeros((1, 512), jnp.int32),
        key_segment_ids=jnp.zeros((1, 512), jnp.int32),
        score_mod=lambda x, b, n, t, s: x - 0.01 * jnp.abs(t - s).astype(x.dtype),
        block_mask=jaxattn.create_block_mask(lambda b, n, t, s: t >= s, None, None, 512, 512, block_size=(64, 64)),
    ),
}


@pytest.mark.parametrize("name", list(LOWERED))
def test_lowers_to_triton_for_cuda(name):
    options = LOWERED[name]()
    q = jax.ShapeDtypeStruct((1, 512, 4, 64), jnp.bfloat16)

    def f(q, k, v):
        return pallas_gpu.attention(q, k, v, **options)

    forward = _lowered(f, q, q, q)
    backward = _lowered(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2)), q, q, q)
    assert forward.count("__gpu$xla.gpu.triton") == 1  # the forward kernel
    assert backward.count("__gpu$xla.gpu.triton") == 3  # forward, dq, dk/dv
    for text in (forward, backward):
        assert "stablehlo.while" not in text
        assert "512x512" not in text  # no [T,S] array


def test_float32_wide_heads_take_half_size_tiles():
    # 64 x 64 float32 tiles at head dim 192 (padded to 256) overran an H100's shared memory in the backward
    # kernels (found compiling for an H100 target: .ci/compile_targets.py); bfloat16 keeps 64 x 64. The
    # Triton grid's query-tile axis (grid_z) counts the tiles.
    q = jax.ShapeDtypeStruct((1, 512, 2, 192), jnp.float32)
    half = jax.ShapeDtypeStruct(q.shape, jnp.bfloat16)

    def attention(q):  # the public API: the kernel's own signature is being reshaped
        return jaxattn.dot_product_attention(q, q, q, is_causal=True, implementation="pallas_gpu")

    def query_tiles(x):
        text = _lowered(attention, x)
        return {int(z) for z in re.findall(r"grid_z = (\d+)", text)}

    with jax.enable_x64(False):  # the Pallas kernels index in int32
        assert query_tiles(q) == {512 // 32}
        assert query_tiles(half) == {512 // 64}


# ---------------------------------------------------------------------------------------------------------
# slow: each option alone, vmap, bf16


# One option per test, T < S and T > S in turn (T = 5 with S = 7, or T = 7 with S = 5): B = 2, N = 6, K = 3.
GRID = {
    "causal_t<s": (5, 7, dict(is_causal=True)),
    "causal_t>s": (7, 5, dict(is_causal=True)),
    "full_t>s": (7, 5, {}),
    "lengths": (5, 7, dict(key_value_seq_lengths=jnp.asarray([5, 0], jnp.int32))),
    "window": (7, 5, dict(window=(3, 1))),
    "chunk": (5, 7, dict(chunk_size=4)),
    "softcap": (7, 5, dict(logit_softcap=1.5)),
    "positions": (
        5,
        7,
        dict(query_positions=jnp.asarray([[9, 2, 4, 7, 3], [0, 1, 2, 3, 4]], jnp.int32), is_causal=True),
    ),
    "segments": (
        5,
        7,
        dict(
            query_segment_ids=jnp.asarray([[0, 0, 1, 1, 2]] * 2, jnp.int32),
            key_segment_ids=jnp.asarray([[0, 1, 1, 2, 2, 2, 2]] * 2, jnp.int32),
        ),
    ),
    "mask_mod": (7, 5, dict(mask_mod=_band)),
    "score_mod": (5, 7, dict(score_mod=lambda x, b, n, t, s: x * (1.0 + 0.1 * n))),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(GRID))
def test_each_option(name):
    T, S, options = GRID[name]
    N, K, H, Hv = 6, 3, 3, 2
    q, k, v, w = _arrays(5, (2, T, N, H), (2, S, K, H), (2, S, K, Hv), (2, T, N, Hv))

    def run(impl):
        def attend(q, k, v):
            if impl == "kernel":
                return pallas_gpu.attention(q, k, v, interpret=True, precision="highest", block_size=(2, 4), **options)
            return jaxattn.flex_attention(q, k, v, implementation="dense", precision="highest", **options)

        def both(q, k, v):
            out, vjp = jax.vjp(attend, q, k, v)
            return out, None, vjp(w)

        return jax.jit(both)(q, k, v)

    _compare(run("kernel"), run("dense"), OUT_TOL, GRAD_TOL)


@pytest.mark.slow
def test_vmap_over_a_batch_axis():
    q, k, v = _arrays(11, (3, 5, 6, 3), (3, 7, 2, 3), (3, 7, 2, 2))

    def attend(q, k, v):
        return pallas_gpu.attention(q, k, v, interpret=True, precision="highest", block_size=(4, 4), is_causal=True)

    expected = jaxattn.dot_product_attention(q, k, v, implementation="dense", precision="highest", is_causal=True)
    got = jax.jit(jax.vmap(attend))(q, k, v)
    assert normwise(got, expected) <= OUT_TOL
    grads = jax.jit(jax.vmap(jax.grad(lambda *a: jnp.sum(attend(*a)), argnums=(0, 1, 2))))(q, k, v)
    grads_e = jax.grad(
        lambda *a: jnp.sum(
            jaxattn.dot_product_attention(*a, implementation="dense", precision="highest", is_causal=True)
        ),
        argnums=(0, 1, 2),
    )(q, k, v)
    for g, e in zip(grads, grads_e):
        assert normwise(g, e) <= GRAD_TOL


@pytest.mark.slow
@pytest.mark.parametrize("case", [DEFAULT_CASE, "window_chunk_segments_softcap_sinks"])  # every option between them
def test_bf16_envelope(case):
    """bf16 inputs against the float32 dense result of the same (bf16-rounded) inputs."""
    got = jax.tree.map(lambda x: x.astype(jnp.float32), _run("kernel", case, dtype=jnp.bfloat16))
    _compare(got, _run("dense", case, rounded_to=jnp.bfloat16), BF16_OUT_TOL, BF16_GRAD_TOL)
