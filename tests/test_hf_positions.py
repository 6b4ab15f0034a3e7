"""jaxattn's position schemes against the HF `transformers` models that use them (tiny random configs, offline).

The module-level comparisons are the crosscheck catalogue's `hf_*` cases (crosscheck/cases/positions.py:
one explicit weight-mapping table per model, gradients of inputs and every weight compared). Here each runs
under jit in float64 (normwise <= 1e-12) and float32 (<= 1e-6 outputs, <= 1e-5 gradients); the pieces
(bucket ids, slopes, sinusoids, the T5 decoding bias) are compared directly and, where integers, exactly.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import crosscheck.cases.positions as cases  # noqa: E402
from jaxattn import (  # noqa: E402
    alibi_slopes,  # noqa: E402
    relative_sinusoids,  # noqa: E402
    t5_relative_bias,
    t5_relative_position_bucket,
)

HF_CASES = [
    "hf_t5_encoder",
    "hf_t5_decoder",
    "hf_llama",
    "hf_gpt_neox",
    "hf_bloom",
    "hf_mpt",
    "hf_w2v2bert_relative_key",
    "hf_w2v2bert_relative",
    "hf_gptj_rope",
]


def _dtypes(name):
    return ["float32"] if name == "hf_mpt" else ["float64", "float32"]  # MPT: .float() before its softmax


def _hf_params():
    """Every case in its strictest dtype in the default run; the float32 runs of cases that also have a float64
    one (their own programs, ~12 s of compiling) in the slow group."""
    for name in HF_CASES:
        for dtype in _dtypes(name):
            slow = dtype == "float32" and len(_dtypes(name)) > 1
            yield pytest.param(name, dtype, marks=pytest.mark.slow) if slow else (name, dtype)


@pytest.mark.parametrize("name, dtype", list(_hf_params()))
def test_hf_module_agrees_outputs_and_gradients(name, dtype):
    assert jax.config.x64_enabled  # float64 runs really are float64 (conftest), and compare() checks dtypes
    report = getattr(cases, name)().compare(dtype=dtype, transform="jit", name=name)
    assert report.passed, str(report)
    assert any(m.kind == "grad" and m.name.startswith("params/") for m in report.metrics) or name == "hf_gptj_rope"


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (10, 11), (7, 40), (64, 1000)])
def test_t5_bucket_ids_equal_hf(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    n = np.arange(-2000, 2001)
    hf = T5Attention._relative_position_bucket(
        torch.tensor(n), bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    ours = t5_relative_position_bucket(
        n, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
    )
    np.testing.assert_array_equal(np.asarray(ours), hf.numpy())


@pytest.mark.parametrize("decoder", [False, True])
def test_t5_bias_with_past_tokens_equals_hf_compute_bias(decoder):
    from transformers import T5Config
    from transformers.models.t5.modeling_t5 import T5Attention

    config = T5Config(
        d_model=8,
        d_kv=2,
        num_heads=3,
        relative_attention_num_buckets=12,
        relative_attention_max_distance=20,
        is_decoder=decoder,
    )
    module = T5Attention(config, has_relative_attention_bias=True, layer_idx=0).double()
    T, S = 5, 31
    hf = module.compute_bias(T, S, past_seen_tokens=S - T)[0].detach().numpy()  # [N,T,S]
    table = module.relative_attention_bias.weight.detach().numpy()
    ours = t5_relative_bias(table, T, S, bidirectional=not decoder, max_distance=20)
    assert ours.dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(ours), hf)


@pytest.mark.parametrize("num_heads", [1, 3, 4, 6, 8, 12, 16, 20, 48])
def test_alibi_slopes_equal_bloom_and_mpt(num_heads):
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    ours = np.asarray(alibi_slopes(num_heads, dtype=jnp.float64))
    bloom = _get_alibi_slopes(num_heads, "cpu").double().numpy()  # float32 pow in HF
    mpt = -build_mpt_alibi_tensor(num_heads, 2)[:, 0, 0].double().numpy()  # slope * (0 - 1)
    np.testing.assert_allclose(ours, bloom, rtol=1e-6)  # HF raises a float32 base to integer powers
    np.testing.assert_allclose(ours, mpt, rtol=1e-6)
    if num_heads in (1, 3, 4, 6, 8):  # every slope is 2 ** -integer: exact in float32 too
        np.testing.assert_array_equal(np.asarray(alibi_slopes(num_heads)), _get_alibi_slopes(num_heads, "cpu"))


def test_relative_sinusoids_equal_hf_wav2vec2_bert_table():
    from transformers import Wav2Vec2BertConfig
    from transformers.models.wav2vec2_bert.modeling_wav2vec2_bert import Wav2Vec2BertRelPositionalEmbedding

    E, T = 22, 9
    embed = Wav2Vec2BertRelPositionalEmbedding(Wav2Vec2BertConfig(hidden_size=E, max_source_positions=T))
    hf = embed(torch.zeros(1, T, E))[0].numpy()  # rows i - j = T-1 .. -(T-1), computed by HF in float32
    ours = relative_sinusoids(E, max_left=T - 1, max_right=T - 1, layout="interleaved", dtype=jnp.float64)
    np.testing.assert_allclose(np.asarray(ours), hf, rtol=0, atol=1e-6)


def test_llama_inverse_frequencies_equal_hf():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from jaxattn._schemes.rope import inverse_frequencies

    config = LlamaConfig(
        hidden_size=24,
        num_attention_heads=2,
        head_dim=12,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )
    hf = LlamaRotaryEmbedding(config).inv_freq.numpy()
    ours = np.asarray(inverse_frequencies(12, 500000.0, jnp.float64))
    np.testing.assert_allclose(ours, hf, rtol=1e-6)  # HF: float32 pow
