"""The contract, once, over every implementation: one option grid of dot_product_attention / flex_attention run
on implementation="dense", "blockwise", None, "pallas_gpu" and "pallas_tpu" (the kernels in Pallas'
interpreter), every case against the one float64 reference of tests/helpers.py (allowed_loop's pairs,
attention_reference's formula and its jax.grad): outputs, lse where asked, and the gradients of q, k, v and of
every float array the call takes (sinks, the slopes a score_mod closes over).

Each implementation runs where it can: the XLA engines and the Pallas GPU kernel in float64 (normwise <= 1e-12),
the TPU path (splash attention; our flex TPU kernel for what splash cannot express) in float32 with
jax_enable_x64 off, which it needs, at the float32 bar (outputs and lse <= 1e-6, gradients <= 1e-5) against the
float64 reference of the same float32 numbers (the inputs are drawn in float32, so every implementation sees the
same values and one reference serves them all). Both kernels express every case of the grid (below), so every
(case, implementation) pair runs and compares.

Interpret-mode kernels compile slowly (a forward and backward of the Pallas GPU kernel: 7 s on 2 busy cores),
and the default group has a budget, so it runs the kernels and None on the case that holds the most options at
once ("everything"; None also on "block_mask", where it picks the blockwise engine), the XLA engines on six
cases that hold every option between them (ENGINE_DEFAULT_CASES), and bf16 on dense; the slow group runs every
other (case, implementation) pair, so a kernel that starts refusing a case fails there. Engine-specific checks
(tile skipping, memory, schedules, lowering, vmap) stay in the engines' own files.

Sizes: every axis its own size (B 2, T 7, S 11, N 6, K 3, H 5, Hv 13; N = 2 K: grouped-query heads; a case that
changes sizes keeps them distinct), T != S so that bottom-right causal differs from top-left, tiles (3, 4) that
divide neither T nor S.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxattn
from helpers import allowed_loop, assert_float64, attention_reference, normwise

SIZES = dict(B=2, T=7, S=11, N=6, K=3, H=5, Hv=13)
F64_TOL = 1e-12
F32_TOL = (1e-6, 1e-5)  # the float32 bar (docs/design.md, "Tolerances"): outputs (and lse), gradients
# Half inputs against the float64 reference of the same half numbers, normwise. Float32 logits and softmax
# inside, the output and each gradient rounded once to the half dtype (that rounding alone: 1.7e-3 / 1.9e-3 in
# bf16, 2.1e-4 / 2.2e-4 in f16), plus, on some paths, the rounding of the probabilities before the value matmul.
# Measured on HALF_CASE (2026-11-27; output / worst gradient): bf16 dense and None 2.3e-3 / 2.6e-3, blockwise
# 1.7e-3 / 1.9e-3, pallas_gpu 1.8e-3 / 4.1e-3, pallas_tpu 1.9e-3 / 3.8e-3; f16 dense 2.8e-4 / 3.2e-4, blockwise
# 2.1e-4 / 2.2e-4, pallas_gpu 2.3e-4 / 4.2e-4, pallas_tpu 2.6e-4 / 5.0e-4. The envelope is about twice the worst.
HALF_TOL = {"bfloat16": (5e-3, 8e-3), "float16": (6e-4, 1e-3)}
HALF_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def alibi(slopes):
    """A score_mod closing over a float array (its gradient is compared too)."""
    return lambda score, b, n, t, s: score - slopes[n] * jnp.abs(t - s).astype(score.dtype)


def band(b, n, t, s):
    """A mask_mod that depends on the head and the absolute positions."""
    return (t - s + n) % 4 != 3


DOCS = np.array([[0] * 5 + [1] * 6, [2] * 3 + [3] * 8], np.int32)  # [B,S]: a document id per absolute position


def documents(b, n, t, s):
    """A mask_mod that depends on the batch entry (packed documents) and is causal."""
    docs = jnp.asarray(DOCS)
    return (docs[b, t] == docs[b, s]) & (s <= t)


SEGMENTS_Q = np.array([[0, 0, 1, 1, 1, 2, 2], [5, 5, 5, 5, 7, 7, 7]], np.int32)  # [B,T], sorted (packed docs)
SEGMENTS_K = np.array([[0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2], [5, 5, 5, 5, 5, 5, 5, 7, 7, 7, 7]], np.int32)
QUERY_POSITIONS = np.array([[9, 2, 4, 7, 3, 10, 5], [0, 1, 2, 3, 4, 5, 6]], np.int32)  # shuffled, batched
KEY_POSITIONS = np.array([np.arange(11), np.arange(11) * 2 - 3], np.int32)

# name: (size overrides, keywords for jaxattn and allowed_loop alike, jaxattn's other keywords, float extras)
#   extras: "sinks" [N] or "example_sinks" [B,N] (the sinks= array), "slopes" [N] (an ALiBi score_mod closing
#   over them); other keywords: "block_mask": the case's mask_mod as a BlockMask with (3, 4) tiles;
#   "return_lse": (out, lse) compared.
CASES = {
    "causal": ({}, dict(is_causal=True), {}, ()),
    "causal_rows_without_keys": (  # T > S: the first T - S rows see no key; example 0 has no key at all
        dict(T=11, S=7),
        dict(is_causal=True, key_value_seq_lengths=np.array([0, 6], np.int32)),
        {},
        ("sinks",),
    ),
    "lengths": ({}, dict(key_value_seq_lengths=np.array([9, 4], np.int32)), {}, ()),
    "positions": (  # absolute positions rule the causal mask, the window and the chunks
        {},
        dict(is_causal=True, query_positions=QUERY_POSITIONS, key_positions=KEY_POSITIONS, window=(3, 2), chunk_size=6),
        {},
        (),
    ),
    "segments_causal": ({}, dict(query_segment_ids=SEGMENTS_Q, key_segment_ids=SEGMENTS_K, is_causal=True), {}, ()),
    "segments_lengths": (
        {},
        dict(query_segment_ids=SEGMENTS_Q, key_segment_ids=SEGMENTS_K, key_value_seq_lengths=np.array([10, 8])),
        {},
        (),
    ),
    "window": ({}, dict(window=(2, 1)), {}, ()),
    "window_left_open": ({}, dict(window=(None, 2)), {}, ()),
    "chunk_causal": ({}, dict(chunk_size=4, is_causal=True), {}, ()),
    "softcap": ({}, dict(is_causal=True), dict(logit_softcap=1.5), ()),
    "sinks": ({}, dict(window=(3, 0)), {}, ("sinks",)),
    "example_sinks_segments_softcap": (  # sinks [B,N] and segment ids that differ per example
        {},
        dict(query_segment_ids=SEGMENTS_Q, key_segment_ids=SEGMENTS_K, window=(5, 0)),
        dict(logit_softcap=0.7),
        ("example_sinks",),
    ),
    "multi_query": (dict(K=1), dict(is_causal=True, window=(4, 2)), {}, ()),
    "multi_head": (dict(K=6), dict(chunk_size=5), {}, ()),
    "return_lse": ({}, dict(is_causal=True), dict(return_lse=True), ("sinks",)),
    "score_mod": ({}, dict(is_causal=True), {}, ("slopes",)),
    "mask_mod": ({}, dict(mask_mod=band), {}, ()),
    "block_mask": ({}, dict(mask_mod=documents), dict(block_mask=True), ()),
    # every option at once (each rule masks pairs the others allow), rows without keys included (the first
    # T - S rows of each example, and every row of example 0): the kernels' default-group case
    "everything": (
        dict(B=3, T=13, S=11, K=2, Hv=7),
        dict(
            is_causal=True,
            key_value_seq_lengths=np.array([0, 9, 11], np.int32),
            query_segment_ids=np.array([[0] * 13, [2] * 8 + [3] * 5, [4] * 3 + [5] * 10], np.int32),
            key_segment_ids=np.array([[0] * 11, [2] * 7 + [3] * 4, [4] * 2 + [5] * 9], np.int32),
            window=(3, 1),
            chunk_size=10,
            mask_mod=band,
        ),
        dict(logit_softcap=2.0, scale=0.3, return_lse=True),
        ("sinks", "slopes"),
    ),
}
# The default group runs these cases on the XLA engines (between them every option of the grid but per-example
# sinks and K = 1; each other case repeats one of their options alone or varies one, in the slow group) and
# KERNEL_DEFAULT_CASE on None and the kernels.
ENGINE_DEFAULT_CASES = ("causal_rows_without_keys", "positions", "block_mask", "everything")
DEFAULT_CASES = {"dense": ENGINE_DEFAULT_CASES, "blockwise": ENGINE_DEFAULT_CASES, None: ("block_mask", "everything")}
KERNEL_DEFAULT_CASE = "everything"
HALF_CASE = ({}, dict(is_causal=True, window=(4, 0)), {}, ())  # bf16 and f16 inputs

IMPLEMENTATIONS = ["dense", "blockwise", None, "pallas_gpu", "pallas_tpu"]
KERNELS = ("pallas_gpu", "pallas_tpu")

# Neither kernel refuses an option of the grid in Pallas' interpreter: pallas_gpu
# (jaxattn/_kernels/pallas_gpu.py) takes every one (its chip limits, tile shapes, dtypes, score_mod / mask_mod
# closing over arrays, do not apply in the interpreter); pallas_tpu gives what splash attention
# (jaxattn/_kernels/splash_tpu.py) cannot express (explicit positions with T > 1, return_lse, segment ids with
# key_value_seq_lengths, score_mod / mask_mod / BlockMask) to our flex TPU kernel (jaxattn/_kernels/flex_tpu.py),
# which expresses every option the Pallas GPU kernel does. Refusals by name: test_kernels.py, test_dispatch.


# ---------------------------------------------------------------------------------------------------------
# running one case


def _sizes(overrides):
    sizes = dict(SIZES, **overrides)
    return tuple(sizes[a] for a in ("B", "T", "S", "N", "K", "H", "Hv"))


@functools.cache
def _inputs(name, dtype):
    """(q, k, v, extras {name: array}, w, w_lse) of a case: normal numbers drawn in float32 (exact in float64),
    rounded to a half dtype for the half cases; every array float64 unless rounded."""
    overrides, _, _, extra_names = HALF_CASE if name == "half" else CASES[name]
    B, T, S, N, K, H, Hv = _sizes(overrides)
    rng = np.random.default_rng(sum(map(ord, name)))

    def draw(*shape):
        x = rng.normal(size=shape).astype(np.float32)
        return jax.device_put((x.astype(HALF_DTYPES[dtype]) if dtype in HALF_DTYPES else x).astype(np.float64))

    q, k, v = draw(B, T, N, H), draw(B, S, K, H), draw(B, S, K, Hv)
    slopes = rng.uniform(0.1, 0.9, N).astype(np.float32).astype(np.float64)
    extras = {"sinks": lambda: draw(N), "example_sinks": lambda: draw(B, N), "slopes": lambda: jax.device_put(slopes)}
    extras = {e: extras[e]() for e in extra_names}
    return q, k, v, extras, draw(B, T, N, Hv), draw(B, N, T)


@functools.cache
def _block_mask(name):
    overrides, rules, _, _ = CASES[name]
    B, T, S, N, *_ = _sizes(overrides)
    return jaxattn.create_block_mask(rules["mask_mod"], B, N, T, S, block_size=(3, 4))


def _attend(name, implementation):
    """f(q, k, v, extras) -> out, or (out, lse): the case's call of the public API on `implementation`."""
    overrides, rules, other, _ = HALF_CASE if name == "half" else CASES[name]
    keywords = dict(rules, **other, implementation=implementation)
    if implementation in KERNELS:
        keywords["interpret"] = True
    if keywords.pop("block_mask", False):
        keywords["block_mask"] = _block_mask(name)
    elif implementation == "blockwise":
        keywords["block_size"] = (3, 4)

    def f(q, k, v, extras):
        extra = dict(keywords, sinks=extras.get("sinks", extras.get("example_sinks")))
        if "slopes" in extras:
            extra["score_mod"] = alibi(extras["slopes"])
        if {"score_mod", "mask_mod", "block_mask", "return_lse"} & set(extra):  # torch's flex_attention surface
            return jaxattn.flex_attention(q, k, v, **extra)
        return jaxattn.dot_product_attention(q, k, v, **extra)

    return f


@functools.cache
def _reference_of(name):
    """(f(q, k, v, extras) of the float64 reference, allowed [B,N,T,S]) of a case."""
    overrides, rules, other, _ = HALF_CASE if name == "half" else CASES[name]
    B, T, S, N, *_ = _sizes(overrides)
    allowed = allowed_loop(B, N, T, S, **rules)

    def f(q, k, v, extras):
        return attention_reference(
            q,
            k,
            v,
            allowed,
            logit_softcap=other.get("logit_softcap"),
            sinks=extras.get("sinks", extras.get("example_sinks")),
            scale=other.get("scale"),
            score_mod=alibi(extras["slopes"]) if "slopes" in extras else None,
            query_positions=rules.get("query_positions"),
            key_positions=rules.get("key_positions"),
            return_lse=other.get("return_lse", False),
        )

    return f, allowed


def _outputs_and_grads(f, q, k, v, extras, w, w_lse):
    """jit of (out, lse or None, gradients of sum(out * w) + sum(lse * w_lse) over q, k, v and extras); rows with
    no allowed key have lse = -inf and take no cotangent."""

    @jax.jit
    def run(q, k, v, extras, w, w_lse):
        result, vjp = jax.vjp(f, q, k, v, extras)
        out, lse = result if isinstance(result, tuple) else (result, None)
        d_lse = None if lse is None else jnp.where(jnp.isfinite(lse), w_lse, 0).astype(lse.dtype)
        grads = vjp((w.astype(out.dtype), d_lse) if lse is not None else w.astype(out.dtype))
        return out, lse, grads

    return run(q, k, v, extras, w, w_lse)


@functools.cache
def _expected(name, dtype):
    """The float64 reference's (out, lse, grads) of a case, once per case and input dtype."""
    f, _ = _reference_of(name)
    got = _outputs_and_grads(f, *_inputs(name, dtype))
    assert_float64(got)
    return got


def _runs_in(implementation):
    """(context, dtype) an implementation runs in: the TPU path needs 64-bit mode off, hence float32."""
    if implementation == "pallas_tpu":
        return jax.enable_x64(False), np.float32
    return contextlib.nullcontext(), None


def _check(name, implementation, dtype="float64"):
    """One case on one implementation against the reference (module docstring): outputs, lse, gradients."""
    q, k, v, extras, w, w_lse = _inputs(name, dtype)
    out_e, lse_e, grads_e = _expected(name, dtype)
    context, run_dtype = _runs_in(implementation)
    if dtype in HALF_TOL:
        run_dtype, tol = HALF_DTYPES[dtype], HALF_TOL[dtype]
    elif run_dtype is None:
        run_dtype, tol = np.float64, (F64_TOL, F64_TOL)
    else:
        tol = F32_TOL
    cast = lambda x: jnp.asarray(x, run_dtype)  # noqa: E731 (exact: the numbers are float32 / half already)
    with context:
        out, lse, grads = _outputs_and_grads(
            _attend(name, implementation),
            *map(cast, (q, k, v)),
            jax.tree.map(cast, extras),
            *map(cast, (w, w_lse)),
        )
    assert out.dtype == run_dtype, (out.dtype, run_dtype)
    if run_dtype == np.float64:
        assert_float64(out, lse, grads)
    error = normwise(out, out_e)
    assert error <= tol[0], f"output: normwise error {error:.3g} > {tol[0]:g}"
    _, allowed = _reference_of(name)
    empty = ~allowed.any(-1)  # [B,N,T]: rows with no allowed key give zeros
    assert not np.asarray(out).transpose(0, 2, 1, 3)[empty].any()
    if lse_e is not None:
        assert bool(jnp.all(jnp.isfinite(lse) == jnp.isfinite(lse_e)))
        finite = jnp.isfinite(lse_e)
        error = normwise(jnp.where(finite, lse, 0), jnp.where(finite, lse_e, 0))
        assert error <= tol[0], f"lse: normwise error {error:.3g} > {tol[0]:g}"
    names = ["query", "key", "value"] + sorted(extras)
    for label, g, e in zip(names, jax.tree.leaves(grads), jax.tree.leaves(grads_e), strict=True):
        assert g.dtype == run_dtype, (label, g.dtype)
        assert bool(jnp.all(jnp.isfinite(g))), f"gradient of {label} is not finite"
        error = normwise(g, e)
        assert error <= tol[1], f"gradient of {label}: normwise error {error:.3g} > {tol[1]:g}"


def _param(name, implementation):
    """pytest params: the cases outside DEFAULT_CASES go to the slow group."""
    slow = name not in DEFAULT_CASES.get(implementation, (KERNEL_DEFAULT_CASE,))
    return pytest.param(name, implementation, marks=pytest.mark.slow) if slow else (name, implementation)


# ---------------------------------------------------------------------------------------------------------
# the grid


@pytest.mark.parametrize(
    "name, implementation",
    [_param(n, i) for i in IMPLEMENTATIONS for n in CASES],
)
def test_case(name, implementation):
    _check(name, implementation)


@pytest.mark.parametrize(
    "dtype, implementation",
    [
        (d, i) if (d, i) == ("bfloat16", "dense") else pytest.param(d, i, marks=pytest.mark.slow)
        for d in HALF_TOL
        for i in IMPLEMENTATIONS
    ],
)
def test_half_precision(dtype, implementation):
    """Half inputs: float32 logits and softmax inside, half outputs and gradients within HALF_TOL of the float64
    reference on the same half numbers. (tests/test_blockwise.py holds the blockwise engine to its rounding
    alone in the default group.)"""
    _check("half", implementation, dtype)


def test_the_tpu_path_refuses_64_bit_mode():
    """Splash and our flex TPU kernel index in int32: with jax_enable_x64 on (in the interpreter too) the call
    is refused by name, never a failure inside the kernel."""
    for name in ("causal", "score_mod"):
        q, k, v, extras, *_ = _inputs(name, "float64")
        with pytest.raises(ValueError, match=r"^jax_enable_x64\b.*implementation='pallas_tpu'"):
            jax.eval_shape(_attend(name, "pallas_tpu"), q, k, v, extras)
