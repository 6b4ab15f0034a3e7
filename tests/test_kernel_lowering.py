"""implementation=None carries the fused kernel into programs lowered for CUDA and TPU, and nothing new into
programs lowered for the CPU (issue 26 §2, "Lowering"). Lowered only: nothing is compiled or run, so the
4096-long programs cost well under a second each.

Each program must hold the kernel's custom call (Triton's for CUDA, Mosaic's tpu_custom_call for TPU), no
[T,S] logits buffer (no tensor type with both T and S) and no XLA tile loop (the blockwise engine's
stablehlo.while); lowered for the CPU, the same calls hold no custom call at all (today's XLA engines).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

import jaxattn
from jaxattn.models.llama import LlamaConfig, LlamaForCausalLM

KERNEL_CALL = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}
T = 4096


def lowered(fn, *args, platform):
    # x64 off, as JAX's default (the test suite turns it on): the Pallas kernels index in int32
    with jax.enable_x64(False), jaxattn.cross_platform_lowering():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def assert_fused(text, platform, T, S):
    assert KERNEL_CALL[platform] in text, f"no {KERNEL_CALL[platform]} custom call"
    # logits [...,T,S] in any float type (a decode cache [B,L,K,H] has other dims after S)
    assert not re.search(rf"[<x]{T}x{S}x(f32|bf16|f16)>", text), "a [T,S] logits buffer"
    assert "stablehlo.while" not in text, "an XLA tile loop"


def assert_xla_only(text):
    assert "custom_call" not in text


def attention_fwd(q):
    return jaxattn.dot_product_attention(q, q, q, is_causal=True)


def attention_fwd_bwd(q):
    return jax.grad(lambda q: attention_fwd(q).astype(jnp.float32).sum())(q)


@functools.cache
def sliding_block_mask(window=256):
    """Built once, outside the program, as torch users do: create_block_mask evaluates mask_mod tile by
    tile in a loop of its own, which is mask construction, not attention."""
    return jaxattn.create_block_mask(lambda b, n, t, s: (s <= t) & (t - s < window), None, None, T, T, block_size=128)


def sliding_flex(q):
    return jaxattn.flex_attention(
        q, q, q, score_mod=lambda x, b, n, t, s: x - 0.01 * (t - s), block_mask=sliding_block_mask()
    )


ATTENTION = {"forward": attention_fwd, "forward+backward": attention_fwd_bwd}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("program", list(ATTENTION))
def test_causal_attention_lowers_to_the_kernel(platform, program):
    q = jax.ShapeDtypeStruct((1, T, 8, 128), jnp.bfloat16)
    assert_fused(lowered(ATTENTION[program], q, platform=platform), platform, T, T)


@pytest.mark.parametrize("program", list(ATTENTION))
def test_causal_attention_lowered_for_cpu_is_the_xla_engine(program):
    q = jax.ShapeDtypeStruct((1, T, 8, 128), jnp.bfloat16)
    text = lowered(ATTENTION[program], q, platform="cpu")
    assert_xla_only(text)
    assert "stablehlo.while" in text  # the blockwise engine, as before


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_flex_score_mod_and_sliding_block_mask_lower_to_the_kernel(platform):
    # cuda: the Pallas GPU kernel's score_mod and BlockMask; tpu: our Pallas TPU kernel (splash has no score_mod)
    sliding_block_mask()  # built eagerly here, so the program only closes over its tile lists
    q = jax.ShapeDtypeStruct((1, T, 8, 128), jnp.bfloat16)
    assert_fused(lowered(sliding_flex, q, platform=platform), platform, T, T)


def test_flex_lowered_for_cpu_is_the_xla_engine():
    q = jax.ShapeDtypeStruct((1, T, 8, 128), jnp.bfloat16)
    assert_xla_only(lowered(sliding_flex, q, platform="cpu"))


def tiny_llama():
    """A one-layer Llama with grouped-query heads (N = 4, K = 2), bf16, its params as shapes only."""
    config = LlamaConfig(
        vocab_size=211,
        hidden_size=256,
        intermediate_size=320,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        rope_frequencies=tuple((1e4 ** (-jnp.arange(0, 64, 2) / 64)).tolist()),
    )
    model = LlamaForCausalLM(config=config, dtype=jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((1, 384), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 384), jnp.int32))["params"])
    return model, params, ids


def llama_forward(model):
    return lambda params, ids: model.apply({"params": params}, ids)


def llama_train_step(model):
    def loss(params, ids):
        logits = model.apply({"params": params}, ids).astype(jnp.float32)
        return -jnp.mean(jax.nn.log_softmax(logits[:, :-1])[..., 0])

    return lambda params, ids: jax.grad(loss)(params, ids)


def llama_decode_step(model):
    def step(params, cache, token):
        return model.apply({"params": params, "cache": cache}, token, decode=True, mutable=["cache"])

    return step


def cache_shapes(model, params, length):
    """The decode cache's shapes for `length` slots (nothing computed)."""
    ids = jnp.zeros((1, length), jnp.int32)
    return jax.eval_shape(lambda p: model.apply({"params": p}, ids, decode=True, mutable=["cache"])[1]["cache"], params)


# The default group: the CUDA forward and the TPU training step; the slow group the other two.
@pytest.mark.parametrize(
    "platform, program",
    [
        ("cuda", "forward"),
        ("tpu", "training step"),
        pytest.param("cuda", "training step", marks=pytest.mark.slow),
        pytest.param("tpu", "forward", marks=pytest.mark.slow),
    ],
)
def test_llama_lowers_to_the_kernel(platform, program):
    model, params, ids = tiny_llama()
    fn = llama_forward(model) if program == "forward" else llama_train_step(model)
    text = lowered(fn, params, ids, platform=platform)
    assert_fused(text, platform, 384, 384)


def generate_step(model):
    """jaxattn.models.generate's step (models/_generate.py: _decode_call): one token with the attention
    mask over every cache slot (its padding mask) and its position."""

    def step(params, cache, token, attention_mask, position_ids):
        logits, variables = model.apply(
            {"params": params, "cache": cache},
            token,
            attention_mask=attention_mask,
            position_ids=position_ids,
            decode=True,
            mutable=["cache"],
        )
        return jnp.argmax(logits[:, -1], axis=-1), variables["cache"]

    return step


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_llama_decode_step_lowers_to_the_kernel(platform):
    # T = 1 against a 4096-slot cache. cuda: generate's step (the cache's positions and length, and the
    # padding mask, which reaches the kernel as key segment ids) takes the split-key decode kernel. tpu:
    # splash takes the one row's keys as segment ids (without the padding mask: splash is not given a mask)
    model, params, _ = tiny_llama()
    token = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    cache = cache_shapes(model, params, T)
    if platform == "cuda":
        slots = jax.ShapeDtypeStruct((1, T), jnp.int32)
        text = lowered(generate_step(model), params, cache, token, slots, token, platform=platform)
        assert re.findall(r'name = "(jaxattn_\w+)"', text) == ["jaxattn_decode_split_key"]  # one layer
    else:
        text = lowered(llama_decode_step(model), params, cache, token, platform=platform)
    assert_fused(text, platform, 1, T)


@pytest.mark.parametrize("program", ["forward", pytest.param("training step", marks=pytest.mark.slow)])
def test_llama_lowered_for_cpu_is_the_xla_engine(program):
    model, params, ids = tiny_llama()
    fn = llama_forward(model) if program == "forward" else llama_train_step(model)
    assert_xla_only(lowered(fn, params, ids, platform="cpu"))


def tiny_t5():
    """A one-layer T5 (encoder 448 tokens, decoder 320; model width 192, 4 heads of 64), bf16, its params as
    shapes only: the relative bias reaches the attention as t5_position_bias, a hook the GPU kernel computes
    in its tiles. Every size differs, so a [T,S] buffer cannot be mistaken for another."""
    from jaxattn.models.t5 import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=211, d_model=192, d_kv=64, d_ff=288, num_layers=1, num_heads=4)
    model = T5ForConditionalGeneration(config=config, dtype=jnp.bfloat16)
    ids, dec = jnp.zeros((1, 448), jnp.int32), jnp.zeros((1, 320), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), ids, decoder_input_ids=dec)["params"])
    shapes = (jax.ShapeDtypeStruct((1, 448), jnp.int32), jax.ShapeDtypeStruct((1, 320), jnp.int32))
    return model, params, shapes


@pytest.mark.parametrize("program", ["forward", pytest.param("training step", marks=pytest.mark.slow)])
def test_t5_lowers_to_the_kernel_with_its_relative_bias(program):
    model, params, (ids, dec) = tiny_t5()

    def forward(params, ids, dec):
        return model.apply({"params": params}, ids, decoder_input_ids=dec).astype(jnp.float32)

    def train_step(params, ids, dec):
        return jax.grad(lambda p: -jnp.mean(jax.nn.log_softmax(forward(p, ids, dec))[..., 0]))(params)

    text = lowered(forward if program == "forward" else train_step, params, ids, dec, platform="cuda")
    for T_, S_ in ((448, 448), (320, 320), (320, 448)):  # encoder, decoder, cross-attention
        assert_fused(text, "cuda", T_, S_)


@pytest.mark.parametrize("scheme", ["t5", pytest.param("alibi", marks=pytest.mark.slow)])
def test_relative_bias_lowers_to_the_tpu_kernel(scheme):
    """T5's and ALiBi's bias built in the tiles of our Pallas TPU kernel (issue 34), implementation=None on a
    TPU: its Mosaic call, no [T,S] bias or logits, no XLA tile loop (whether Mosaic compiles the tile's
    strided roll: .ci/compile_targets.py, "t5 causal" / "alibi causal" on v5e and v6e)."""
    N = 8
    q = jax.ShapeDtypeStruct((1, T, N, 128), jnp.bfloat16)
    params = jax.ShapeDtypeStruct((32, N) if scheme == "t5" else (N,), jnp.float32)

    def forward(q, params):
        if scheme == "t5":
            return jaxattn.t5_attention(q, q, q, params, bidirectional=False, is_causal=True)
        return jaxattn.alibi_attention(q, q, q, params, is_causal=True)

    text = lowered(forward, q, params, platform="tpu")
    assert 'name = "jaxattn_flex_tpu_forward"' in text
    assert_fused(text, "tpu", T, T)


@pytest.mark.parametrize("scheme", ["shaw", pytest.param("deberta", marks=pytest.mark.slow), "transformer-xl"])
def test_position_tables_lower_to_the_tpu_kernel(scheme):
    """Shaw's tables, DeBERTa-v3's (buckets 256 / 512) and Transformer-XL's (through its Shaw form) in the tiles
    of our Pallas TPU kernel, implementation=None on a TPU, forward: its Mosaic call, no [T,S] value, no XLA
    tile loop (whether Mosaic compiles the tiles' rolls: .ci/compile_targets.py, "shaw causal" / "deberta")."""
    N, H = 8, 128
    q = jax.ShapeDtypeStruct((1, T, N, H), jnp.bfloat16)
    rows = {"shaw": 129, "deberta": 512, "transformer-xl": 300}[scheme]
    table = jax.ShapeDtypeStruct((rows, N, H), jnp.float32)

    def forward(q, table):
        if scheme == "shaw":
            return jaxattn.shaw_relative_attention(q, q, q, table, table, max_distance=64, is_causal=True)
        if scheme == "deberta":
            return jaxattn.disentangled_attention(
                q, q, q, table, table, position_buckets=256, max_relative_positions=512
            )
        bias = jnp.ones((N, H), jnp.bfloat16)  # u and v in the inputs' dtype
        return jaxattn.transformer_xl_attention(
            q, q, q, table, max_left=rows - 1, pos_bias_u=bias, pos_bias_v=bias, is_causal=True
        )

    text = lowered(forward, q, table, platform="tpu")
    assert 'name = "jaxattn_flex_tpu_forward"' in text
    assert_fused(text, "tpu", T, T)


def strided_roll_shifts(fn, *args):
    """(the Pallas kernels in fn's jaxpr, the shift of every strided pltpu.roll inside them), fn traced only."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    kernels, shifts = [], []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                kernels.append(str(eqn.params["name"]))
            if eqn.primitive.name == "roll" and eqn.params["stride"] is not None:
                shifts.append(eqn.invars[1])
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                        walk(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub)

    with jax.enable_x64(False):
        walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return kernels, shifts


@pytest.mark.parametrize("scheme", ["t5", "alibi", "shaw", "deberta"])
def test_tpu_kernels_roll_by_static_strides_only(scheme):
    """Issue 51 §7: Mosaic in libtpu 0.0.48.1 and later (jax 0.11's pin) refuses a strided roll by a traced
    amount ("strided dynamic rotation along the two last dimensions is unsupported"), which 0.0.42.1 (jax
    0.10's) compiled. The relative terms' rolls (refs_tpu.diagonals / undiagonals) hold every traced amount in
    a roll without a stride, forward and backward, on a TPU's 128 x 128 tiles. That Mosaic compiles them:
    .ci/compile_targets.py's relative cases with both libtpus (.ci/run)."""
    from jax.extend.core import Literal

    N, H, T_ = 2, 128, 512
    q = jax.ShapeDtypeStruct((1, T_, N, H), jnp.bfloat16)
    rows = {"t5": (32, N), "alibi": (N,), "shaw": (129, N, H), "deberta": (512, N, H)}[scheme]
    table = jax.ShapeDtypeStruct(rows, jnp.float32)

    def loss(q, table):
        options = dict(implementation="pallas_tpu")
        if scheme == "t5":
            out = jaxattn.t5_attention(q, q, q, table, bidirectional=False, is_causal=True, **options)
        elif scheme == "alibi":
            out = jaxattn.alibi_attention(q, q, q, table, is_causal=True, **options)
        elif scheme == "shaw":
            out = jaxattn.shaw_relative_attention(q, q, q, table, table[:, 0], max_distance=64, **options)
        else:
            buckets = dict(position_buckets=256, max_relative_positions=512)
            out = jaxattn.disentangled_attention(q, q, q, table, table, **buckets, **options)
        return out.astype(jnp.float32).sum()

    kernels, shifts = strided_roll_shifts(jax.grad(loss, argnums=(0, 1)), q, table)
    assert {"jaxattn_flex_tpu_forward", "jaxattn_flex_tpu_dq", "jaxattn_flex_tpu_dkv"} <= set(kernels), kernels
    assert shifts, "no strided roll: the tiles' terms are built some other way; revisit this check"
    traced = [str(shift) for shift in shifts if not isinstance(shift, Literal)]
    assert not traced, f"{len(traced)} of {len(shifts)} strided rolls by a traced amount: {traced[:3]}"
