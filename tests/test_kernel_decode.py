"""The split-key (flash-decoding) Pallas GPU kernel (decode_gpu.decode_attention) equals the dense engine, run by
Pallas' interpreter on CPU; a decode step lowered for CUDA takes it (issue 26 §3).

float32 at highest precision: outputs and lse <= 1e-6 normwise. Every axis has its own prime size; the key
axis is not a multiple of the chunk (key_chunk) nor of the key tile (the kernel masks its loads past S); query rows
with no allowed key give zeros. The kernel is forward only: a gradient through pallas_gpu.attention runs the
flash kernels (checked in the slow group, and by lowering in the default group). Interpret mode compiles
slowly, so the default group has one case with most options at once; the one-option grid, bf16 and the
routed gradient are in the slow group.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from helpers import normwise
from jaxattn import _api as dispatch
from jaxattn._core.call import AttentionCall
from jaxattn._kernels import decode_gpu

OUT_TOL, GRAD_TOL = 1e-6, 1e-5
# bf16 inputs (float32 logits, softmax and partials inside), normwise error against the float32 dense result
# of the same bf16-rounded inputs, measured on this file's default case: output 1.6e-3 (the dense engine in
# bf16 itself: 1.9e-3); lse 2.7e-8. The envelope is twice the kernel's output figure.
BF16_OUT_TOL = 3.2e-3
DECODE = "jaxattn_decode_split_key"


@pytest.fixture(autouse=True)
def x64_off():
    # Pallas kernels index in int32 (JAX's default; the suite turns x64 on)
    with jax.enable_x64(False):
        yield


def _arrays(seed, *shapes, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.normal(size=shape).astype(dtype)) for shape in shapes]


# (batch, T, S, N, K, H, Hv), the key tile, key_chunk, options. S = 37 is no multiple of the tile (4) or the chunk.
CASES = {
    # a decode step's keywords (positions, cache length, causal) with a window, softcap, sinks and GQA
    # (G = 3 query heads per key/value head); query position -1 sees no key (zeros, lse = the sink alone)
    "cache_window_softcap_sinks": (
        ((2,), 3, 37, 6, 2, 5, 7),
        4,
        8,
        dict(
            is_causal=True,
            query_positions=np.array([[-1, 2, 4], [30, 31, 35]], np.int32),
            key_value_seq_lengths=np.array([5, 33], np.int32),
            window=(20, 0),
            logit_softcap=3.0,
            sinks=np.linspace(-1.0, 1.0, 6, dtype=np.float32),
            return_lse=True,
        ),
    ),
    "one_row_plain": (((3,), 1, 41, 5, 5, 3, 2), 4, 12, {}),
    # S = 40 in whole key tiles of 4 but not whole chunks of 16: the last chunk's tiles past S are never read
    # (the kernel reads the cache unpadded, and its tiles past S are unmasked there: the schedule skips them)
    "whole_tiles_not_whole_chunks": (((2,), 3, 40, 4, 2, 8, 8), 4, 16, {}),
    "lengths_only": (
        ((2,), 2, 43, 6, 3, 5, 3),
        8,
        16,
        dict(key_value_seq_lengths=np.array([0, 29], np.int32), return_lse=True),
    ),
    "chunk_size": (((), 1, 37, 4, 2, 3, 5), 4, 8, dict(chunk_size=11, is_causal=True)),
    # a rolling cache: batched key positions, some slots unseen (2**30: beyond every query)
    "rolling_key_positions": (
        ((2,), 1, 31, 6, 2, 5, 5),
        4,
        8,
        dict(
            is_causal=True,
            query_positions=np.array([[40], [12]], np.int32),
            key_positions=np.where(
                np.arange(62).reshape(2, 31) % 7 == 3, 2**30, np.arange(62).reshape(2, 31) % 41
            ).astype(np.int32),
        ),
    ),
    # a padding mask over the cache as segment ids (what dot_product_attention makes of a key mask)
    "segments": (
        ((2,), 2, 29, 6, 3, 3, 5),
        4,
        8,
        dict(
            query_segment_ids=np.zeros((2, 2), np.int32),
            key_segment_ids=(np.arange(58).reshape(2, 29) % 5 == 1).astype(np.int32),
            is_causal=True,
        ),
    ),
}


def _run(impl, case, dtype=np.float32, rounded_to=None):
    (batch, T, S, N, K, H, Hv), tile, chunk, options = CASES[case]
    q, k, v = _arrays(1, (*batch, T, N, H), (*batch, S, K, H), (*batch, S, K, Hv))
    q, k, v = (x.astype(rounded_to or dtype).astype(dtype) for x in (q, k, v))

    @jax.jit
    def f(q, k, v):
        if impl == "kernel":
            call = AttentionCall(precision="highest", block_size=tile, **options)
            result = decode_gpu.decode_attention(call, q, k, v, True, key_chunk=chunk)
        else:
            result = jaxattn.flex_attention(q, k, v, implementation="dense", precision="highest", **options)
        return result if options.get("return_lse") else (result, None)

    return f(q, k, v)


def _compare(got, expected, tol):
    (out, lse), (out_e, lse_e) = got, expected
    assert normwise(out, out_e) <= tol, normwise(out, out_e)
    if lse_e is not None:
        assert bool(jnp.all(jnp.isfinite(lse) == jnp.isfinite(lse_e)))
        finite = jnp.isfinite(lse_e)
        assert normwise(jnp.where(finite, lse, 0), jnp.where(finite, lse_e, 0)) <= tol


def test_decode_kernel_equals_dense():
    got = _run("kernel", "cache_window_softcap_sinks")
    _compare(got, _run("dense", "cache_window_softcap_sinks"), OUT_TOL)
    out, lse = got
    sinks = CASES["cache_window_softcap_sinks"][3]["sinks"]
    assert bool(jnp.all(out[0, 0] == 0))  # query position -1: no key at or before it
    assert normwise(lse[0, :, 0], sinks) == 0


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c != "cache_window_softcap_sinks"])
def test_each_case(case):
    _compare(_run("kernel", case), _run("dense", case), OUT_TOL)
    if case == "lengths_only":  # an empty cache: zeros, lse -inf
        out, lse = _run("kernel", case)
        assert bool(jnp.all(out[0] == 0)) and bool(jnp.all(lse[0] == -jnp.inf))


@pytest.mark.slow
def test_bf16_envelope():
    case = "cache_window_softcap_sinks"
    got = jax.tree.map(lambda x: x.astype(jnp.float32), _run("kernel", case, dtype=jnp.bfloat16))
    _compare(got, _run("dense", case, rounded_to=jnp.bfloat16), BF16_OUT_TOL)


# ---------------------------------------------------------------------------------------------------------
# the choice and the refusals (shapes only)


def test_when_attention_takes_the_decode_kernel():
    step = [jnp.zeros(s, jnp.bfloat16) for s in ((1, 1, 8, 128), (1, 4096, 2, 128), (1, 4096, 2, 128))]
    assert decode_gpu.use_decode(AttentionCall(is_causal=True, key_value_seq_lengths=np.array([9])), *step)
    short = [x[:, :256] if i else x for i, x in enumerate(step)]
    assert not decode_gpu.use_decode(AttentionCall(), *short)  # one chunk: nothing to split
    prefill = [jnp.zeros((1, 512, 8, 128), jnp.bfloat16), *step[1:]]
    assert not decode_gpu.use_decode(AttentionCall(), *prefill)  # 512 x 4 rows per key/value head
    wide = [jnp.zeros((64, 1, 8, 128), jnp.bfloat16), *(jnp.zeros((64, 4096, 2, 128), jnp.bfloat16),) * 2]
    assert not decode_gpu.use_decode(AttentionCall(), *wide)  # 512 flash programs already fill the SMs
    assert not decode_gpu.use_decode(AttentionCall(mask_mod=lambda b, n, t, s: t >= s), *step)  # the flash kernel's
    with pytest.raises(ValueError, match="implementation.*mask_mod"):
        decode_gpu.decode_attention(AttentionCall(mask_mod=lambda b, n, t, s: t >= s), *step)
    with pytest.raises(ValueError, match="implementation.*bias"):
        decode_gpu.decode_attention(AttentionCall(bias=jnp.zeros((1, 4096))), *step)
    with pytest.raises(ValueError, match="^key_chunk"):
        decode_gpu.decode_attention(AttentionCall(), *step, key_chunk=100)


def test_a_key_only_mask_becomes_segment_ids():
    q, k = jnp.zeros((2, 3, 4, 5)), jnp.zeros((2, 7, 2, 5))
    mask = np.arange(14).reshape(2, 1, 1, 7) % 3 != 0
    out = dispatch.key_mask_as_segments(AttentionCall(mask=mask, is_causal=True), q, k)
    assert out.mask is None and out.is_causal
    assert np.array_equal(out.key_segment_ids, np.where(mask[:, 0, 0], 0, 1))
    assert np.array_equal(out.query_segment_ids, np.zeros(3))
    for other in (np.ones((2, 1, 3, 7), bool), mask.astype(np.float32), np.ones((5, 2, 1, 1, 7), bool)):
        assert dispatch.key_mask_as_segments(AttentionCall(mask=other), q, k).mask is other  # not a key mask here
    given = AttentionCall(mask=mask, query_segment_ids=np.zeros(3), key_segment_ids=np.zeros(7))
    assert dispatch.key_mask_as_segments(given, q, k) is given


# ---------------------------------------------------------------------------------------------------------
# a decode step lowered for CUDA (no GPU needed)


def _kernels_in(text):
    return re.findall(r'name = "(jaxattn_\w+)"', text)


STEP_SHAPES = (
    jax.ShapeDtypeStruct((1, 1, 8, 128), jnp.bfloat16),
    jax.ShapeDtypeStruct((1, 4096, 2, 128), jnp.bfloat16),
)


def _step(q, k, v):
    """A decode step: T = 1 against 4096 cached keys, bf16, GQA, the cache's keywords and a padding mask (as a
    model's decode step passes them)."""
    return jaxattn.dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        query_positions=jnp.full((1, 1), 3000),
        key_value_seq_lengths=jnp.asarray([3001]),
        mask=jnp.arange(4096)[None, None, None, :] % 9 != 0,
    )


def _lowered_for_cuda(fn):
    q, kv = STEP_SHAPES
    with jaxattn.cross_platform_lowering():
        return jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()


def test_a_decode_step_lowers_to_the_split_key_kernel():
    """One Triton call, the split-key kernel; no XLA loop, no [T,S] logits."""
    text = _lowered_for_cuda(_step)
    assert _kernels_in(text) == [DECODE]
    assert "stablehlo.while" not in text
    assert not re.search(r"[<x]1x4096x(f32|bf16|f16)>", text)


@pytest.mark.slow
def test_a_differentiated_decode_step_lowers_to_the_flash_kernels_too():
    """value_and_grad: the split-key kernel for the value, the flash kernels (forward, dq, dk/dv) for the
    gradient; no XLA loop. (The platform switch carries the XLA branch's residuals, the dense engine's
    [N,T,S] weights at T = 1, as zeros through the kernel branch: JAX's linearization of a switch gives every
    branch the union of the residuals, so no [T,S] check here.)"""
    text = _lowered_for_cuda(
        jax.value_and_grad(lambda *a: jnp.sum(jnp.asarray(_step(*a), jnp.float32)), argnums=(0, 1, 2))
    )
    assert sorted(_kernels_in(text)) == sorted(
        [DECODE, "jaxattn_flash_forward", "jaxattn_flash_dq", "jaxattn_flash_dkv"]
    )
    assert "stablehlo.while" not in text


# ---------------------------------------------------------------------------------------------------------
# slow: the routed call (a key mask through dot_product_attention) and its gradient, interpreted


@pytest.mark.slow
def test_attention_routes_a_decode_step_and_differentiates_through_the_flash_kernel():
    B, T, S, N, K, H = 2, 1, 521, 6, 3, 7  # S >= 2 * DECODE_MIN_CHUNK: the decode kernel (3 chunks of 256)
    q, k, v, w = _arrays(3, (B, T, N, H), (B, S, K, H), (B, S, K, H), (B, T, N, H))
    rng = np.random.default_rng(4)
    keywords = dict(
        is_causal=True,
        query_positions=np.array([[300], [517]], np.int32),
        key_value_seq_lengths=np.array([301, 518], np.int32),
        mask=rng.uniform(size=(B, 1, 1, S)) > 0.3,
        sinks=np.linspace(-1, 1, N, dtype=np.float32),
    )
    without_mask = AttentionCall(**{name: x for name, x in keywords.items() if name != "mask"})
    assert decode_gpu.use_decode(without_mask, q, k, v, True)

    def run(implementation, **extra):
        def f(q, k, v):
            out = jaxattn.dot_product_attention(
                q, k, v, implementation=implementation, precision="highest", **keywords, **extra
            )
            return jnp.sum(out * w), out

        return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True))(q, k, v)

    (_, out), grads = run("pallas_gpu", interpret=True)
    (_, out_e), grads_e = run("dense")
    assert normwise(out, out_e) <= OUT_TOL
    for g, e in zip(grads, grads_e, strict=True):
        assert normwise(g, e) <= GRAD_TOL


@pytest.mark.slow
def test_vmap_over_a_batch_axis():
    q, k, v = _arrays(11, (3, 1, 6, 3), (3, 29, 2, 3), (3, 29, 2, 2))
    lengths = jnp.asarray([29, 4, 17], jnp.int32)

    def attend(q, k, v, length):
        call = AttentionCall(precision="highest", block_size=4, is_causal=True, key_value_seq_lengths=length)
        return decode_gpu.decode_attention(call, q, k, v, True, key_chunk=8)

    got = jax.jit(jax.vmap(attend))(q, k, v, lengths)
    expected = jaxattn.dot_product_attention(
        q, k, v, implementation="dense", precision="highest", is_causal=True, key_value_seq_lengths=lengths
    )
    assert normwise(got, expected) <= OUT_TOL
