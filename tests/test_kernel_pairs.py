"""Per-pair relative tables inside the Pallas GPU kernel (issue 34): relative_attention (seed 000's form, A^K /
A^V of [T,S,N|1,F]) with implementation="pallas_gpu" (jaxattn/_kernels/pairs_gpu.py).

Interpret mode (Pallas' interpreter on this CPU, jax_enable_x64 off for the kernel's call), float32: outputs
<= 1e-6 against the float64 loop of the formula (helpers.attention_loop with rel_key / rel_value), gradients of
q, k, v and both tables <= 1e-5 against the dense engine in float64 (whose forward agrees with the loop to
1e-12), normwise. Every axis its own size, T != S, lengths that are not multiples of the interpreter's 16-wide
tiles, head dims padded to 8 (two of the interpreter's 4-wide feature chunks), grouped-query heads, per-head and
shared tables, key table only, value table only, causal and not, key lengths, positions of their own, window /
softcap / sinks, mask_mod / segment ids / chunks beside the tables; one batch entry (the per-head table's
gradient stored by the program that owns each pair, the causally skipped tiles as zeros) and several (added
atomically); bf16 within the contract's envelope. The default group runs one case forward and backward; the
others are slow.

Lowered for CUDA (nothing compiled): implementation=None takes the kernel (its three Triton calls, no
[B,N,T,S] value, no XLA tile loop).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from helpers import assert_float64, attention_loop, normwise, value_and_vjp
from jaxattn._core.call import AttentionCall
from jaxattn._kernels import decode_gpu, flash_gpu, flex_tpu, pairs_gpu, pallas_gpu, pallas_tpu

OUT_TOL, GRAD_TOL = 1e-6, 1e-5

# name: (batch, T, S, N, K, H, Hv, key table heads, value table heads, options)
# heads: "per head" ([T,S,N,F]), "shared" ([T,S,1,F]) or None (no table)
CASES = {
    # one batch entry, so each pair of the per-head key table is one program's (stored, the skipped tiles as
    # zeros: 37 x 41 causal skips the far key tiles); the shared value table adds over the heads atomically
    "one example causal GQA": ((), 37, 41, 6, 3, 5, 7, "per head", "shared", dict(is_causal=True)),
    "both causal GQA": ((2,), 19, 23, 6, 3, 5, 7, "per head", "shared", dict(is_causal=True)),
    "key only shared T > S": ((2,), 29, 17, 4, 2, 5, 3, "shared", None, dict()),
    "value only lengths": (
        (3,),
        13,
        31,
        6,
        2,
        3,
        5,
        None,
        "per head",
        dict(is_causal=True, key_value_seq_lengths=np.array([31, 9, 20])),
    ),
    "both shared positions": ((2,), 17, 11, 4, 4, 7, 5, "shared", "shared", dict(positions=True, is_causal=True)),
    # a mask_mod (the WITH_MOD tiles) and segment ids beside the tables, chunks of attention
    "both mask_mod segments": (
        (2,),
        21,
        26,
        4,
        2,
        3,
        5,
        "per head",
        "shared",
        dict(
            mask_mod=lambda b, n, t, s: (t + 2 * s + n) % 5 != 0,
            segments=True,
            chunk_size=11,
        ),
    ),
    # the kernel's other options beside the tables: window, softcap (caps scale * (q.k + q.A^K)), sinks
    "both with the other options": (
        (2,),
        19,
        23,
        6,
        3,
        5,
        3,
        "per head",
        "per head",
        dict(window=(9, 3), logit_softcap=2.5, sinks=np.array([0.5, -1.0, 0.25, 2.0, -0.5, 1.0], np.float32)),
    ),
}
DEFAULT_CASE = "one example causal GQA"


def _setup(name):
    batch, T, S, N, K, H, Hv, key_heads, value_heads, options = CASES[name]
    rng = np.random.default_rng(13)
    q, k, v, w = (
        rng.normal(size=shape).astype(np.float32)
        for shape in ((*batch, T, N, H), (*batch, S, K, H), (*batch, S, K, Hv), (*batch, T, N, Hv))
    )

    def table(heads, F):
        return None if heads is None else rng.normal(size=(T, S, N if heads == "per head" else 1, F)).astype(np.float32)

    tables = (table(key_heads, H), table(value_heads, Hv))
    options = dict(options)
    if options.pop("segments", False):  # three segments per example, cut at their own places
        options["query_segment_ids"] = np.cumsum(rng.random(size=(*batch, T)) < 0.15, axis=-1).astype(np.int32)
        options["key_segment_ids"] = np.cumsum(rng.random(size=(*batch, S)) < 0.15, axis=-1).astype(np.int32)
    if options.pop("positions", False):  # gaps and repeats, far from the defaults
        options["query_positions"] = np.sort(rng.integers(100, 130, size=T)).astype(np.int32)
        options["key_positions"] = np.sort(rng.integers(95, 140, size=S)).astype(np.int32)
    return (q, k, v), tables, options, w


def _relative(rel_key, rel_value, **options):
    """f(q, k, v, *the tables in use) through relative_attention."""
    used = [rel_key is not None, rel_value is not None]

    def f(q, k, v, *tables, **kw):
        it = iter(tables)
        a_k, a_v = (next(it) if u else None for u in used)
        return jaxattn.relative_attention(q, k, v, a_k, a_v, **options, **kw)

    return f, tuple(t for t in (rel_key, rel_value) if t is not None)


def _check(name, implementation="pallas_gpu"):
    (q, k, v), (a_k, a_v), options, w = _setup(name)
    T, N, S = q.shape[-3], q.shape[-2], k.shape[-3]
    f, tables = _relative(a_k, a_v, **options)
    args = (q, k, v, *tables)

    with jax.enable_x64(False):
        out, grads = value_and_vjp(lambda *a: f(*a, implementation=implementation, interpret=True), args, w)
    assert out.dtype == jnp.float32

    def full(table):  # [T,S,N,F] as the loop reads it, float64
        return None if table is None else np.broadcast_to(np.asarray(table, np.float64), (T, S, N, table.shape[-1]))

    rule_names = ("is_causal", "key_value_seq_lengths", "window", "chunk_size", "mask_mod")
    rules = {n: options[n] for n in rule_names + ("query_segment_ids", "key_segment_ids") if n in options}
    rules.update({n: options[n] for n in ("query_positions", "key_positions") if n in options})
    extra = {n: options[n] for n in ("logit_softcap", "sinks") if n in options}
    want, _ = attention_loop(q, k, v, rel_key=full(a_k), rel_value=full(a_v), **rules, **extra)
    assert normwise(out, want) <= OUT_TOL, normwise(out, want)

    # gradients: the dense engine in float64 (its forward checked against the loop first)
    wide = tuple(np.asarray(x, np.float64) for x in args)
    dense_out, dense_grads = value_and_vjp(lambda *a: f(*a, implementation="dense"), wide, w)
    assert_float64(dense_out, *dense_grads)
    assert normwise(dense_out, want) <= 1e-12
    names = ("q", "k", "v") + tuple(n for n, t in (("rel_key", a_k), ("rel_value", a_v)) if t is not None)
    for got, ref, what in zip(grads, dense_grads, names, strict=True):
        assert got.dtype == jnp.float32, what
        assert normwise(got, ref) <= GRAD_TOL, (what, normwise(got, ref))


@pytest.mark.parametrize("name", [n if n == DEFAULT_CASE else pytest.param(n, marks=pytest.mark.slow) for n in CASES])
def test_kernel_matches_the_float64_loop(name):
    _check(name)


# The TPU kernel (pairs_tpu: the tables' slices copied in per tile, R = 8 rows at a time interpreted, two chunks
# of each 16-row tile). The default group runs both ways a table's gradient is written: one batch entry (the
# per-head A^K's slices stored by the one program that owns them, the causally skipped tiles' zeros kept) and
# two (both gradients added into the same slices from several programs, the dq grid in order).
TPU_DEFAULT_CASES = ("one example causal GQA", "both causal GQA")


@pytest.mark.parametrize(
    "name", [n if n in TPU_DEFAULT_CASES else pytest.param(n, marks=pytest.mark.slow) for n in CASES]
)
def test_tpu_kernel_matches_the_float64_loop(name):
    _check(name, "pallas_tpu")


# bf16 inputs and tables against the float64 dense engine on the same rounded numbers: the contract suite's bf16
# envelope, as tests/test_kernel_shaw.py holds Shaw's tables to. Measured on the two cases below: outputs <= 1.8e-3
# (the dense engine in bf16: 2.1e-3), gradients of q, k, v and both tables <= 3.9e-3 (dense 3.6e-3); the TPU
# kernel the same (outputs 1.8e-3, gradients 3.9e-3).
BF16_TOLERANCES = (5e-3, 8e-3)


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["pallas_gpu", "pallas_tpu"])
@pytest.mark.parametrize("name", ["both causal GQA", "one example causal GQA"])
def test_kernel_in_bf16_within_the_envelope(name, implementation):
    (q, k, v), (a_k, a_v), options, w = _setup(name)
    f, tables = _relative(a_k, a_v, **options)
    args = tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v, *tables))
    with jax.enable_x64(False):
        out, grads = value_and_vjp(lambda *a: f(*a, implementation=implementation, interpret=True), args, w)
    assert out.dtype == jnp.bfloat16
    wide = tuple(np.asarray(x, np.float64) for x in args)
    want, want_grads = value_and_vjp(lambda *a: f(*a, implementation="dense"), wide, w)
    assert normwise(out, want) <= BF16_TOLERANCES[0], normwise(out, want)
    for got, ref in zip(grads, want_grads, strict=True):
        assert got.dtype == jnp.bfloat16
        assert normwise(got, ref) <= BF16_TOLERANCES[1], normwise(got, ref)


def test_what_the_kernels_refuse():
    q = k = v = jnp.zeros((2, 7, 3, 4), jnp.float32)
    pair = jnp.zeros((7, 7, 1, 4), jnp.float32)

    def refusal(kernel, interpret=False, **options):
        return kernel.unsupported(AttentionCall(**options), q, k, v, interpret)

    for tables in (dict(rel_key=pair), dict(rel_value=pair), dict(rel_key=pair, rel_value=pair)):
        assert refusal(pallas_gpu, **tables) is None
        assert refusal(pallas_gpu, **tables, is_causal=True, window=(3, 0), logit_softcap=5.0) is None
        # the flash kernel alone and the split-key decode kernel keep refusing them by name
        assert refusal(flash_gpu, **tables) in tables
        assert decode_gpu.decode_unsupported(AttentionCall(**tables), q, k, v, True) in tables
        with jax.enable_x64(False):  # the TPU kernels: pairs_tpu, in the flex kernel (splash refuses them)
            assert refusal(pallas_tpu, True, **tables, is_causal=True, window=(3, 0)) is None
            assert flex_tpu.wanted(AttentionCall(**tables))
            assert pallas_tpu.declined(AttentionCall(**tables), q, k, v) is None  # implementation=None takes it
    # options the pair kernels do not compute beside the tables: named (None falls back to the XLA engines)
    beside = dict(
        score_mod=lambda s, b, n, t, u: s,
        key_table=jnp.zeros((3, 4)),
        position_bias=lambda qp, kp: jnp.zeros((3, 7, 7)),
    )
    for name, option in beside.items():
        extra = dict(max_distance=1) if name == "key_table" else {}
        assert refusal(pallas_gpu, rel_key=pair, **{name: option}, **extra).startswith(name)
        with jax.enable_x64(False):
            assert refusal(pallas_tpu, True, rel_key=pair, **{name: option}, **extra).startswith(name)
    # on a GPU or a TPU (not interpreted) a float64 table is refused by name
    assert refusal(pallas_gpu, rel_value=pair.astype(jnp.float64)) == "rel_value"
    with jax.enable_x64(False):
        assert refusal(pallas_tpu, rel_value=np.zeros((7, 7, 1, 4), np.float64)) == "rel_value"
    with pytest.raises(ValueError, match="score_mod"):
        jaxattn.relative_attention(
            q, k, v, pair, score_mod=lambda s, b, n, t, u: s, implementation="pallas_gpu", interpret=True
        )
    with pytest.raises(ValueError, match="rel_key"):  # a table's shape, named, as the XLA engines do
        jaxattn.relative_attention(q, k, v, jnp.zeros((7, 6, 1, 4)), implementation="pallas_gpu", interpret=True)


def test_pair_tiles():
    """The pair tiles: PAIR_BLOCKS on a GPU (a [Tb,Sb,PAIR_CHUNK] float32 block of 4096 floats), shrunk to short
    sequences but never below 16; the interpreter's 16 x 16."""
    assert pairs_gpu.pair_blocks(4096, 4096, False) == pairs_gpu.PAIR_BLOCKS == (16, 16)
    assert pairs_gpu.pair_blocks(5, 20, False) == (16, 16)
    assert pairs_gpu.pair_blocks(5, 3, True) == (8, 4)
    assert np.prod(pairs_gpu.PAIR_BLOCKS) * pairs_gpu.PAIR_CHUNK == 4096


# ---------------------------------------------------------------------------------------------------------
# lowered for CUDA

T_LOWERED = 1024
TRITON = "__gpu$xla.gpu.triton"


# implementation=None's kernels per platform: (the custom call that holds them, forward, backward)
LOWERED_KERNELS = {
    "cuda": (TRITON, {"jaxattn_pairs_forward"}, {"jaxattn_pairs_dq", "jaxattn_pairs_dkv"}),
    "tpu": ("tpu_custom_call", {"jaxattn_flex_tpu_forward"}, {"jaxattn_flex_tpu_dq", "jaxattn_flex_tpu_dkv"}),
}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("program", ["forward+backward", pytest.param("forward", marks=pytest.mark.slow)])
def test_lowered_is_the_kernel(program, platform):
    """implementation=None lowered for CUDA (the pair kernels' Triton calls) and for a TPU (the flex kernel's three
    Mosaic calls, the tables' slices copied in by pairs_tpu): forward, and dq and dk/dv for the gradient; no
    [B,N,T,S] value, no [B,T,S,H] product and no XLA tile loop; the tables are inputs, [T,S,N,H] per head and
    [T,S,1,Hv] shared. Compiled for the H100 and v5e in CI (.ci/compile_targets.py, "relative pairs", "None
    relative pairs")."""
    N, K, H = 4, 2, 64
    q = jax.ShapeDtypeStruct((1, T_LOWERED, N, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, T_LOWERED, K, H), jnp.bfloat16)
    a_k = jax.ShapeDtypeStruct((T_LOWERED, T_LOWERED, N, H), jnp.bfloat16)
    a_v = jax.ShapeDtypeStruct((T_LOWERED, T_LOWERED, 1, H), jnp.bfloat16)

    def forward(q, k, v, a_k, a_v):
        return jaxattn.relative_attention(q, k, v, a_k, a_v, is_causal=True)

    if program == "forward":
        fn = forward
    else:
        fn = jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)), argnums=(0, 1, 2, 3, 4))
    with jax.enable_x64(False), jaxattn.cross_platform_lowering():
        text = jax.jit(fn).trace(q, kv, kv, a_k, a_v).lower(lowering_platforms=(platform,)).as_text()
    kernels = set(re.findall(r'name = "(jaxattn_\w+)"', text))
    custom_call, forward_kernels, backward_kernels = LOWERED_KERNELS[platform]
    want = forward_kernels | (backward_kernels if program != "forward" else set())
    assert custom_call in text and kernels == want, kernels
    assert "stablehlo.while" not in text, "an XLA tile loop"
    # no [B,N,T,S] logits or probabilities (nor [N,T,S], [T,S] of one head), and no [B,T,S,H] product
    T = T_LOWERED
    assert not re.search(rf"[<x]{T}x{T}x(f32|bf16|f16|i1|i32)>", text), "a [T,S] buffer"
    assert not re.search(rf"<1x{T}x{T}x{H}x", text), "a [B,T,S,H] product"
