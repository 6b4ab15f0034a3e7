"""The families of issue 20 beyond the bars every family meets (tests/test_models_decoders.py holds them to
those): their config variants against transformers, the config options they refuse by name, the rope
settings they read (yarn, Gemma 3's per-layer-type rotary embeddings and transformers 4's keys for them),
the mixtures of experts' router outputs and auxiliary loss, and the weight table's stacked rows.

Each variant writes a tiny random checkpoint (crosscheck._hf.checkpoints) with the option set, and compares every
layer and the logits with transformers in float32 and float64 on a left-padded batch.
"""

import json
import os
import shutil

import jax
import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crosscheck import layer_report
from crosscheck._hf import checkpoints as hf
from helpers import assert_float64
from jaxattn.models import from_pretrained, moe, rope_frequencies, supported_model_types


def _inputs():
    ids, mask = hf.padded_batch("left")
    return {"input_ids": ids, "attention_mask": mask}


def _assert_matches(directory):
    torch_model = hf.torch_model(directory)
    model, params = from_pretrained(directory)
    for dtype in ("float32", "float64"):
        report = layer_report(torch_model, (model, params), _inputs(), dtype=dtype)
        assert report.passed and report.rows[-1].normwise <= (1e-12 if dtype == "float64" else 1e-5), str(report)
    return model, params, torch_model


def test_new_families_are_supported():
    assert {
        "qwen3",
        "gemma3_text",
        "mixtral",
        "gpt_oss",
        "qwen3_moe",
        "llama4_text",
        "deepseek_v3",
        "qwen3_next",
    } <= set(supported_model_types())


@pytest.mark.slow  # two reports per variant, on top of the bars' runs of the default configs
@pytest.mark.parametrize(
    "model_type, overrides",
    [
        # all four projections biased, tied head, no sliding layer
        ("qwen3", {"attention_bias": True, "tie_word_embeddings": True, "use_sliding_window": False}),
        # tied (HF's default), no final softcap (HF's default), the global layer first, yarn on the global layers
        (
            "gemma3_text",
            {
                "tie_word_embeddings": True,
                "final_logit_softcapping": None,
                "layer_types": ["full_attention", "sliding_attention"],
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 30.0},
                    "full_attention": {
                        "rope_type": "yarn",
                        "factor": 8.0,
                        "rope_theta": 500.0,
                        "original_max_position_embeddings": 16,
                    },
                },
            },
        ),
        ("mixtral", {"sliding_window": None, "num_experts_per_tok": 3}),  # no window (Mixtral's releases), top 3
        # no attention biases, the global layer first, a plain rope (no yarn factor), top 1 (softmax of one: 1)
        (
            "gpt_oss",
            {
                "attention_bias": False,
                "layer_types": ["full_attention", "sliding_attention"],
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0},
                "num_experts_per_tok": 1,
            },
        ),
        # renormalised top k, no window, tied head, q/k/v/o biases
        (
            "qwen3_moe",
            {"norm_topk_prob": True, "use_sliding_window": False, "tie_word_embeddings": True, "attention_bias": True},
        ),
    ],
)
def test_config_variants_match_transformers(tmp_path, model_type, overrides):
    model, params, torch_model = _assert_matches(hf.write_checkpoint(model_type, tmp_path / "variant", **overrides))
    assert ("lm_head" in params) != torch_model.config.tie_word_embeddings
    biased = {g for g, leaves in params["layers_0"]["self_attn"].items() if "bias" in leaves}
    if model_type == "qwen3":
        assert biased == {"query", "key", "value", "out"}
    elif model_type == "gemma3_text":
        assert model.config.rope(1)[1] == 1.0 and model.config.rope(0)[1] > 1.0  # yarn's factor on the global layer
    elif model_type == "gpt_oss":
        assert not biased and model.config.windows == (None, 5) and model.config.rope(0)[1] == 1.0
    elif model_type == "qwen3_moe":
        assert model.config.normalize_top_k() and not model.config.windows and len(biased) == 4


@pytest.mark.slow  # 5 s: a legacy spelling of one family's config (CI runs it)
def test_gemma3_reads_transformers_4_rope_keys(tmp_path):
    """rope_theta + rope_scaling (global layers) and rope_local_base_freq (local layers), as Google's Gemma 3
    configs spell them, give the rotary embeddings transformers 5 builds from them."""
    directory = hf.write_checkpoint("gemma3_text", tmp_path / "legacy")
    config = json.loads((directory / "config.json").read_text())
    del config["rope_parameters"]
    config.update(rope_theta=2000.0, rope_local_base_freq=70.0, rope_scaling={"rope_type": "linear", "factor": 3.0})
    (directory / "config.json").write_text(json.dumps(config))
    model, _, torch_model = _assert_matches(directory)
    rotary = torch_model.model.rotary_emb
    for layer, kind in enumerate(("sliding_attention", "full_attention")):
        theirs = getattr(rotary, f"{kind}_inv_freq").double().numpy()
        np.testing.assert_allclose(model.config.rope(layer)[0], theirs, rtol=1e-6, atol=0)


def test_gemma3_layer_types_default_to_the_sliding_window_pattern():
    import transformers

    from jaxattn.models.gemma3 import Gemma3Config

    theirs = transformers.Gemma3TextConfig(num_hidden_layers=7, sliding_window=9, sliding_window_pattern=3)
    config = {k: v for k, v in theirs.to_dict().items() if k != "layer_types"}
    ours = Gemma3Config.from_dict({**config, "sliding_window_pattern": 3})
    assert ours.windows == tuple(9 if t == "sliding_attention" else None for t in theirs.layer_types)
    assert ours.windows == (9, 9, None, 9, 9, None, 9)


@pytest.mark.parametrize(
    "rope",
    [
        {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
            "rope_theta": 150000.0,
        },  # gpt-oss's
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
            "original_max_position_embeddings": 32,
            "rope_theta": 500.0,
        },
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "attention_factor": 1.25,
            "original_max_position_embeddings": 128,
            "rope_theta": 10000.0,
        },
    ],
)
def test_yarn_frequencies_and_attention_factor_equal_transformers(rope):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxattn.models._rope_config import rope_attention_factor

    config = transformers.LlamaConfig(
        hidden_size=96, num_attention_heads=3, max_position_embeddings=256, rope_parameters=dict(rope)
    )
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = rope_frequencies(config.to_dict(), 32)
    np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=1e-6, atol=0)
    assert rope_attention_factor(config.to_dict()) == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize(
    "model_type, changes, named",
    [
        ("qwen3", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen3", {"use_sliding_window": False, "layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
        (
            "qwen3",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            r"rope_parameters\['rope_type'\]",
        ),
        ("gemma3_text", {"hidden_activation": "gelu"}, "hidden_activation"),
        ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("gemma3_text", {"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
        (
            "gemma3_text",
            {"rope_parameters": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
            "rope_parameters",
        ),
        (
            "gemma3_text",
            {"rope_parameters": {"sliding_attention": {"rope_type": "longrope", "rope_theta": 1e4}}},
            r"rope_parameters\['sliding_attention'\]\['rope_type'\]",
        ),
        (
            "gemma3_text",
            {
                "rope_parameters": {
                    "full_attention": {
                        "rope_type": "linear",
                        "factor": 2.0,
                        "rope_theta": 1e4,
                        "partial_rotary_factor": 0.5,
                    }
                }
            },
            r"rope_parameters\['full_attention'\]\['partial_rotary_factor'\]",
        ),
    ],
)
def test_config_options_not_implemented_are_refused(tmp_path, model_type, changes, named):
    source = hf.write_checkpoint(model_type, tmp_path / "ok")
    config = json.loads((source / "config.json").read_text())
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    (bad / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ValueError, match=rf"{bad}/config.json: {named}: expected"):
        from_pretrained(bad)


# the default run takes mixtral in float32; the other routers and float64 run in the slow group (CI)
@pytest.mark.parametrize(
    "model_type",
    ["mixtral", pytest.param("gpt_oss", marks=pytest.mark.slow), pytest.param("qwen3_moe", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("dtype", ["float32", pytest.param("float64", marks=pytest.mark.slow)])
def test_router_logits_and_aux_loss_equal_transformers(tmp_path, model_type, dtype):
    """HF's output_router_logits=True outputs: every layer's router logits (ours sown as "layer{i}.router")
    and aux_loss (moe.load_balancing_loss over the real tokens). HF accumulates the loss in float32 whatever
    the dtype, so the loss is held to float32's 1e-6 relative in both runs."""
    directory = hf.write_checkpoint(model_type, tmp_path / model_type)
    model, params = from_pretrained(directory, dtype=dtype)
    torch_model = hf.torch_model(directory, dtype)
    ids, mask = hf.padded_batch("left")
    _, state = model.apply({"params": params}, ids, attention_mask=mask, mutable=["intermediates"])
    logits = moe.router_logits(state["intermediates"])
    with torch.no_grad(), hf.float64_reference(torch_model, dtype):
        out = torch_model(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), output_router_logits=True)
    assert len(logits) == len(out.router_logits) == 2 and logits[0].shape == (3, 11, 5)
    real = mask.astype(bool)
    for ours, theirs in zip(logits, out.router_logits):
        theirs = theirs.numpy().reshape(ours.shape)[real]
        np.testing.assert_allclose(np.asarray(ours)[real], theirs, rtol=0, atol=1e-5 if dtype == "float32" else 1e-12)
    config = model.config
    loss = moe.load_balancing_loss(logits, config.num_local_experts, config.num_experts_per_tok, mask)
    assert np.asarray(loss).dtype == np.dtype(dtype)
    np.testing.assert_allclose(loss, out.aux_loss.double().numpy(), rtol=1e-6)
    # no attention_mask: every token attends and counts (HF's loss without a mask)
    _, state = model.apply({"params": params}, ids, mutable=["intermediates"])
    with torch.no_grad(), hf.float64_reference(torch_model, dtype):
        theirs = torch_model(torch.from_numpy(ids), output_router_logits=True).aux_loss
    ours = moe.load_balancing_loss(
        moe.router_logits(state["intermediates"]), config.num_local_experts, config.num_experts_per_tok
    )
    np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=1e-6)
    assert abs(float(ours) - float(loss)) > 1e-3  # the mask mattered


def test_routing_weights_keep_the_top_k_as_each_family_does():
    """Literal logits: Mixtral renormalises the top k of the softmax, gpt-oss softmaxes the top k logits, Llama 4
    sigmoids them."""
    logits = np.log(np.array([[1.0, 4.0, 2.0, 3.0]]))
    mixtral = moe.routing_weights(logits, 2, "softmax_topk")
    np.testing.assert_allclose(mixtral, [[0, 4 / 7, 0, 3 / 7]], rtol=1e-12)
    unnormalised = moe.routing_weights(logits, 2, "softmax_topk", normalize=False)
    np.testing.assert_allclose(unnormalised, [[0, 0.4, 0, 0.3]], rtol=1e-12)
    np.testing.assert_allclose(moe.routing_weights(logits, 2, "topk_softmax"), mixtral, rtol=1e-12)
    np.testing.assert_allclose(
        moe.routing_weights(np.array([[0.0, 3.0, 1.0, 3.0]]), 3, "topk_softmax"),
        [[0, np.e**2 / (2 * np.e**2 + 1), 1 / (2 * np.e**2 + 1), np.e**2 / (2 * np.e**2 + 1)]],
        rtol=1e-12,
    )
    # Llama 4: each of the top k logits through a sigmoid, not normalised: log(4) -> 4/5, log(3) -> 3/4
    np.testing.assert_allclose(moe.routing_weights(logits, 2, "topk_sigmoid"), [[0, 0.8, 0, 0.75]], rtol=1e-12)
    with pytest.raises(ValueError, match="routing: expected one of"):
        moe.routing_weights(logits, 2, "topk")


def test_stacked_rows_name_each_expert_tensor(tmp_path):
    """Mixtral's per-expert tensors fill one [X,...] leaf each: leaf[j] is expert j's tensor (transposed);
    a missing expert tensor is listed by name, a misshapen one named with both shapes."""
    from jaxattn.io import load_safetensors
    from jaxattn.models import from_state_dict

    directory = hf.write_checkpoint("mixtral", tmp_path / "mixtral")
    config = json.loads((directory / "config.json").read_text())
    tensors = load_safetensors(directory / "model.safetensors")
    _, params = from_state_dict(config, tensors)
    for j in range(5):
        np.testing.assert_array_equal(
            params["layers_1"]["mlp"]["experts"]["down_proj"]["kernel"][j],
            tensors[f"model.layers.1.block_sparse_moe.experts.{j}.w2.weight"].T,
        )
    gone = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    with pytest.raises(ValueError, match=rf"1 missing \['{gone}'\]"):
        from_state_dict(config, {k: v for k, v in tensors.items() if k != gone})
    with pytest.raises(ValueError, match=rf"'{gone}': expected shape \[40,48\] \[F,E\], got shape \[48,40\]"):
        from_state_dict(config, {**tensors, gone: tensors[gone].T})


@pytest.mark.parametrize(
    "model_type, changes, named",
    [
        ("mixtral", {"hidden_act": "gelu"}, "hidden_act"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("mixtral", {"num_experts_per_tok": 6}, "num_experts_per_tok"),
        ("mixtral", {"sliding_window": 0}, "sliding_window"),
        (
            "mixtral",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            r"rope_parameters\['rope_type'\]",
        ),
        ("gpt_oss", {"quantization_config": {"quant_method": "gptq"}}, r"quantization_config\['quant_method'\]"),
        ("gpt_oss", {"hidden_act": "gelu"}, "hidden_act"),
        ("gpt_oss", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ("gpt_oss", {"layer_types": ["sliding_attention"]}, "layer_types"),
        (
            "gpt_oss",
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            r"rope_parameters\['rope_type'\]",
        ),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("qwen3_moe", {"hidden_act": "relu"}, "hidden_act"),
        ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ],
)
def test_moe_config_options_not_implemented_are_refused(tmp_path, model_type, changes, named):
    test_config_options_not_implemented_are_refused(tmp_path, model_type, changes, named)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_moe_loads_transformers_5_fused_experts_too(tmp_path, model_type):
    """A state_dict in memory (transformers 5's fused mlp.experts.gate_up_proj [X,2F,E] and down_proj
    [X,E,F]) gives the same params as the per-expert checkpoint save_pretrained wrote."""
    from jaxattn.io import load_safetensors
    from jaxattn.models import from_state_dict

    directory = hf.write_checkpoint(model_type, tmp_path / model_type)
    config = json.loads((directory / "config.json").read_text())
    _, saved = from_state_dict(config, load_safetensors(directory / "model.safetensors"))
    memory = {k: v.numpy() for k, v in hf.torch_model(directory).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in memory
    _, fused = from_state_dict(config, memory)
    import jax

    assert jax.tree.structure(saved) == jax.tree.structure(fused)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(fused)):
        np.testing.assert_array_equal(a, b)


# --- Llama 4 (llama4_text): its layer pattern and options --------------------------------------------------------


@pytest.mark.slow  # two reports per variant, on top of the bars' runs of the default config
@pytest.mark.parametrize(
    "overrides",
    [
        # no chunks (every layer global), the NoPE layer first, both layers MoE with top 2, biased projections
        {
            "attention_chunk_size": None,
            "no_rope_layers": [0, 1],
            "moe_layers": [0, 1],
            "num_experts_per_tok": 2,
            "attention_bias": True,
        },
        # no L2 q/k norm, no temperature, tied head, HF's default rope
        {
            "use_qk_norm": False,
            "attn_temperature_tuning": False,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
        },
    ],
)
def test_llama4_variants_match_transformers(tmp_path, overrides):
    model, params, torch_model = _assert_matches(hf.write_checkpoint("llama4_text", tmp_path / "v", **overrides))
    c = model.config
    assert c.layer_types() == torch_model.config.layer_types and list(c.moe_layers) == torch_model.config.moe_layers
    assert ("lm_head" in params) != c.tie_word_embeddings


def test_llama4_layer_pattern_follows_hf_defaults():
    """no_rope_layers and moe_layers unset: a NoPE layer every no_rope_layer_interval-th layer, an MoE every
    interleave_moe_layer_step-th, as transformers' Llama4TextConfig derives them."""
    import transformers

    from jaxattn.models.llama4 import Llama4TextConfig

    hf_config = transformers.Llama4TextConfig(
        num_hidden_layers=9, no_rope_layer_interval=3, interleave_moe_layer_step=4, attention_chunk_size=7
    )
    ours = Llama4TextConfig.from_dict(
        {k: v for k, v in hf_config.to_dict().items() if k not in ("no_rope_layers", "moe_layers", "layer_types")}
    )
    assert [int(r) for r in ours.rope_layers] == hf_config.no_rope_layers == [1, 1, 0] * 3
    assert list(ours.moe_layers) == hf_config.moe_layers == [3, 7]
    assert ours.layer_types() == hf_config.layer_types


def test_llama4_options_not_implemented_are_refused(tmp_path):
    source = hf.write_checkpoint("llama4_text", tmp_path / "ok")
    config = json.loads((source / "config.json").read_text())
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    for changes, named in [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ({"num_experts_per_tok": 6}, "num_experts_per_tok"),
        ({"layer_types": ["full_attention", "full_attention"]}, "layer_types"),
        ({"no_rope_layers": [1]}, "no_rope_layers"),
        ({"no_rope_layers": [1, 2]}, "no_rope_layers"),
        ({"moe_layers": [2]}, "moe_layers"),
        ({"attention_chunk_size": 0}, "attention_chunk_size"),
        ({"floor_scale": 0}, "floor_scale"),
    ]:
        (bad / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(ValueError, match=rf"{bad}/config.json: {named}: expected"):
            from_pretrained(bad)


# --- DeepSeek V3 (deepseek_v3): MLA options, the router's options, the compressed decode cache -------------------


@pytest.mark.slow  # two reports per variant, on top of the bars' runs of the default config
@pytest.mark.parametrize(
    "overrides",
    [
        # queries straight from x (no q latent), half-split rope, biased projections, tied head, plain rope
        {
            "q_lora_rank": None,
            "rope_interleave": False,
            "attention_bias": True,
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},
        },
        # every layer MoE, one group (no group limit), top 2 not renormalised, one shared expert, a linear rope with
        # mscale_all_dim (HF's yarn_apply_mscale scales the softmax for any rope type but "default")
        {
            "first_k_dense_replace": 0,
            "n_group": 1,
            "topk_group": 1,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "n_shared_experts": 1,
            "routed_scaling_factor": 1.7,
            "rope_parameters": {"rope_type": "linear", "factor": 3.0, "rope_theta": 10000.0, "mscale_all_dim": 0.8},
        },
    ],
)
def test_deepseek_v3_variants_match_transformers(tmp_path, overrides):
    model, params, torch_model = _assert_matches(hf.write_checkpoint("deepseek_v3", tmp_path / "v", **overrides))
    assert model.config.softmax_scale == pytest.approx(torch_model.model.layers[0].self_attn.scaling, rel=1e-15)
    assert ("lm_head" in params) != model.config.tie_word_embeddings


def test_deepseek_v3_decodes_from_the_compressed_latent_cache():
    """generate's cache holds, per layer, the latent [B,L,C] and the rope key [B,L,R] (C + R numbers per token,
    against N (Hq + Hv) for an expanded key/value cache) and nothing else (shapes only: nothing is computed).
    The tiny config's yarn makes both of HF's factors bite: the softmax scale Hq ** -0.5 * m(0.9) ** 2 and the
    rope factor m(0.7) / m(0.9), m(a) = 0.1 a ln(4) + 1 (HF's yarn_get_mscale; the layer reports check them
    against transformers)."""
    import math

    import jax
    import jax.numpy as jnp

    from jaxattn.models._decoder import empty_cache
    from jaxattn.models.deepseek_v3 import DeepseekV3Config, DeepseekV3ForCausalLM, cache_numbers_per_token

    c = DeepseekV3Config.from_dict(hf.TINY["deepseek_v3"][2])
    model = DeepseekV3ForCausalLM(c)
    ids = jnp.zeros((3, 17), jnp.int32)
    params = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), ids))["params"]
    cache = empty_cache(model, params, ids, attention_mask=jnp.ones_like(ids))
    assert sorted(cache) == ["layers_0", "layers_1", "next_position"]
    for i in range(2):
        layer = cache[f"layers_{i}"]["self_attn"]
        assert {k: v.shape for k, v in layer.items()} == {
            "cached_latent": (3, 17, 13),
            "cached_rope": (3, 17, 4),
            "cache_index": (3,),
        }
    assert cache_numbers_per_token(c) == 13 + 4 < c.num_attention_heads * (9 + 7)
    m = lambda a: 0.1 * a * math.log(4.0) + 1.0  # noqa: E731
    assert c.softmax_scale == pytest.approx(9**-0.5 * m(0.9) ** 2, rel=1e-15)
    assert c.rope_attention_factor == pytest.approx(m(0.7) / m(0.9), rel=1e-15)


def test_deepseek_v3_group_limited_routing_equals_a_loop():
    """group_limited_weights against a per-token loop (numpy, float64): groups scored by their two best
    biased scores, the best groups' experts eligible, top k by biased score, weighted by the plain sigmoid."""
    import jax

    from jaxattn.models.deepseek_v3 import group_limited_weights

    rng = np.random.default_rng(0)
    T, X, n_group, topk_group, k, scaling = 7, 15, 3, 2, 3, 2.5
    logits, bias = rng.normal(size=(T, X)), rng.normal(size=X) * 0.3
    ours = np.asarray(
        group_limited_weights(
            jax.numpy.asarray(logits),
            jax.numpy.asarray(bias),
            top_k=k,
            n_group=n_group,
            topk_group=topk_group,
            normalize=True,
            scaling=scaling,
        )
    )
    assert_float64(ours)
    expected = np.zeros((T, X))
    for t in range(T):
        s = 1 / (1 + np.exp(-logits[t]))
        choice = s + bias
        groups = sorted(range(n_group), key=lambda g: -np.sort(choice[g * 5 : (g + 1) * 5])[-2:].sum())[:topk_group]
        eligible = [x for x in range(X) if x // 5 in groups]
        picked = sorted(eligible, key=lambda x: -choice[x])[:k]
        expected[t, picked] = s[picked] / (s[picked].sum() + 1e-20) * scaling
    np.testing.assert_allclose(ours, expected, rtol=1e-14, atol=0)
    assert ((ours > 0).sum(-1) == k).all()


def test_deepseek_v3_options_not_implemented_are_refused(tmp_path):
    source = hf.write_checkpoint("deepseek_v3", tmp_path / "ok")
    config = json.loads((source / "config.json").read_text())
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    for changes, named in [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"n_group": 4}, "n_group"),
        ({"n_group": 15}, "n_group"),
        ({"topk_group": 4}, "topk_group"),
        ({"num_experts_per_tok": 11}, "num_experts_per_tok"),
        ({"num_key_value_heads": 1}, "num_key_value_heads"),
        ({"first_k_dense_replace": -1}, "first_k_dense_replace"),
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0}},
            r"rope_parameters\['rope_type'\]",
        ),
    ]:
        (bad / "config.json").write_text(json.dumps({**config, **changes}))
        with pytest.raises(ValueError, match=rf"{bad}/config.json: {named}: expected"):
            from_pretrained(bad)


# --- Qwen3-Next (qwen3_next): its layer pattern and options ---------------------------------------------------------


@pytest.mark.slow  # two reports, on top of the bars' runs of the default config
def test_qwen3_next_variant_matches_transformers(tmp_path):
    """The full layer first, both layers MoE (decoder_sparse_step 1, no mlp_only_layers), top 2 not renormalised,
    half of each head rotated, tied head, value heads = key heads in the linear layer."""
    overrides = {
        "layer_types": ["full_attention", "linear_attention"],
        "mlp_only_layers": [],
        "norm_topk_prob": False,
        "tie_word_embeddings": True,
        "linear_num_value_heads": 3,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
    }
    model, params, torch_model = _assert_matches(hf.write_checkpoint("qwen3_next", tmp_path / "v", **overrides))
    c = model.config
    assert c.linear_layers == (False, True) and c.moe_layers == (0, 1) and c.rotary_dim == 8
    assert ("lm_head" in params) != c.tie_word_embeddings


def test_qwen3_next_layer_pattern_follows_hf_defaults():
    """layer_types unset: a full attention layer every full_attention_interval-th layer; the MoE on every
    decoder_sparse_step-th layer outside mlp_only_layers; partial_rotary_factor HF's 0.25 of head_dim."""
    import transformers

    from jaxattn.models.qwen3_next import Qwen3NextConfig

    hf_config = transformers.Qwen3NextConfig(
        num_hidden_layers=7,
        full_attention_interval=3,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
    )
    config = {k: v for k, v in hf_config.to_dict().items() if k != "layer_types"}
    ours = Qwen3NextConfig.from_dict({**config, "full_attention_interval": 3})
    assert [
        ("linear_attention" if linear else "full_attention") for linear in ours.linear_layers
    ] == hf_config.layer_types
    hf_moe = [i for i in range(7) if i not in hf_config.mlp_only_layers and (i + 1) % 2 == 0]  # HF's decoder layer
    assert list(ours.moe_layers) == hf_moe == [1, 5] and ours.rotary_dim == 4
    np.testing.assert_allclose(
        ours.rope_frequencies, 1.0 / hf_config.rope_parameters["rope_theta"] ** (np.arange(0, 4, 2) / 4), rtol=1e-15
    )


@pytest.fixture(scope="module")
def qwen3_next_checkpoint(tmp_path_factory):
    return hf.write_checkpoint("qwen3_next", tmp_path_factory.mktemp("qwen3_next"))


def test_qwen3_next_options_not_implemented_are_refused(qwen3_next_checkpoint):
    """Each option this port does not implement: ValueError naming the file and the key (the config alone is
    parsed, as from_pretrained does before any weight)."""
    from jaxattn.models.qwen3_next import Qwen3NextConfig

    source = qwen3_next_checkpoint / "config.json"
    config = json.loads(source.read_text())
    Qwen3NextConfig.from_dict(config, source)
    rope = config["rope_parameters"]
    for changes, named in [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_experts": 0}, "num_experts"),
        ({"num_experts_per_tok": 6}, "num_experts_per_tok"),
        ({"layer_types": ["linear_attention"]}, "layer_types"),
        ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types"),
        ({"linear_num_value_heads": 8}, "linear_num_value_heads"),
        ({"mlp_only_layers": [2]}, "mlp_only_layers"),
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"rope_parameters": {**rope, "rope_type": "linear", "factor": 2.0}}, r"rope_parameters\['rope_type'\]"),
        ({"rope_parameters": {**rope, "partial_rotary_factor": 0.01}}, r"rope_parameters\['partial_rotary_factor'\]"),
    ]:
        with pytest.raises(ValueError, match=rf"{source}: {named}: expected"):
            Qwen3NextConfig.from_dict({**config, **changes}, source)


def test_qwen3_next_linear_layers_decode_from_fixed_size_states(qwen3_next_checkpoint):
    """The decode cache for 16 and for 64 slots: the linear layer holds the conv's last W - 1 inputs [B,W-1,C]
    and the delta rule's state [B,M,Q,D] whatever the length (no key/value cache), the full layer L slots."""
    import jax

    from jaxattn.models import _decoder

    model, params = from_pretrained(qwen3_next_checkpoint, dtype="float64")
    d = model.config.dims()
    shapes = {}
    for L in (16, 64):
        ids = np.zeros((3, L), np.int32)
        cache = _decoder.empty_cache(model, params, ids, attention_mask=np.ones_like(ids))
        shapes[L] = {jax.tree_util.keystr(p): (x.shape, x.dtype) for p, x in jax.tree_util.tree_leaves_with_path(cache)}
    linear = {k: v for k, v in shapes[64].items() if "linear_attn" in k}
    assert linear == {
        "['layers_0']['linear_attn']['conv_state']": ((3, d["W"] - 1, d["C"]), np.float64),
        "['layers_0']['linear_attn']['recurrent_state']": ((3, d["M"], d["Q"], d["D"]), np.float64),
    }
    assert {k: v for k, v in shapes[16].items() if "linear_attn" in k} == linear
    assert shapes[64]["['layers_1']['self_attn']['cached_key']"][0] == (3, 64, d["K"], d["H"])


@pytest.mark.slow  # three compiles of the delta rule's chunked and recurrent forms
def test_qwen3_next_decoding_in_pieces_equals_one_pass(qwen3_next_checkpoint):
    """float64, left-padded prompts of 11 tokens: a 7-token prefill, a 3-token call continuing from the conv and
    delta-rule states (HF's cached multi-token path) and one single-token step give the logits of one pass."""
    import jax
    import jax.numpy as jnp

    from helpers import normwise
    from jaxattn.models import _decoder

    model, params = from_pretrained(qwen3_next_checkpoint, dtype="float64")
    ids, mask = hf.padded_batch("left")
    whole = np.asarray(jax.jit(lambda p: model.apply({"params": p}, ids, attention_mask=mask))(params))
    cache = _decoder.empty_cache(model, params, ids, attention_mask=np.ones_like(ids))
    positions = np.where(mask == 1, np.cumsum(mask, -1) - 1, 0)

    @jax.jit
    def decode(params, cache, ids, positions):
        logits, variables = model.apply(
            {"params": params, "cache": cache},
            ids,
            attention_mask=mask,
            position_ids=positions,
            decode=True,
            mutable=["cache"],
        )
        return logits, variables["cache"]

    pieces = []
    for start, stop in ((0, 7), (7, 10), (10, 11)):
        logits, cache = decode(params, cache, jnp.asarray(ids[:, start:stop]), positions[:, start:stop])
        pieces.append(np.asarray(logits))
    real = mask == 1
    assert normwise(np.concatenate(pieces, axis=1)[real], whole[real]) <= 1e-12


# --- tensors outside the model: multi-token-prediction layers ------------------------------------------------------


@pytest.mark.parametrize(
    "family, extra",
    [("deepseek_v3", "model.layers.2.eh_proj.weight"), ("qwen3_next", "mtp.fc.weight")],
)
def test_multi_token_prediction_tensors_are_skipped_and_nothing_else(tmp_path, family, extra):
    """Released DeepSeek V3 and Qwen3-Next checkpoints store multi-token-prediction weights that transformers'
    causal LM ignores (its _keys_to_ignore_on_load_unexpected): they load, to the same params; any other unknown
    tensor is still refused by name. (The tiny checkpoints have 2 layers: layer index 2 is past the last.)"""
    from safetensors.numpy import load_file, save_file

    source = hf.write_checkpoint(family, tmp_path / "ok")
    _, want = from_pretrained(source)
    for name, refused in [(extra, False), ("model.layers.1.not_a_weight", True)]:
        bad = tmp_path / name
        shutil.copytree(source, bad)
        (file,) = bad.glob("*.safetensors")
        save_file({**load_file(file), name: np.ones((5, 3), np.float32)}, file, metadata={"format": "pt"})
        if refused:
            with pytest.raises(ValueError, match="not_a_weight"):
                from_pretrained(bad)
        else:
            _, got = from_pretrained(bad)
            assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)))


# --- a config.json without rope settings: the family's own default rope_theta, as transformers reads it -----------


@pytest.mark.parametrize(
    "family, hf_config, hf_rotary",
    [
        ("llama4_text", "Llama4TextConfig", "models.llama4.modeling_llama4.Llama4TextRotaryEmbedding"),
        ("mixtral", "MixtralConfig", "models.mixtral.modeling_mixtral.MixtralRotaryEmbedding"),
        ("qwen3", "Qwen3Config", "models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding"),
        ("gpt_oss", "GptOssConfig", "models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding"),
    ],
)
def test_a_config_without_rope_settings_means_the_familys_default_theta(family, hf_config, hf_rotary):
    """transformers gives each family its own default rope_theta (Llama 4 5e5, Mixtral 1e6, gpt-oss 1.5e5,
    Llama-likes 1e4): a config.json with no rope key must mean the same frequencies to us (our to_pretrained
    writes such configs when a model was built from a dict)."""
    import importlib

    import transformers

    config = {k: v for k, v in hf.TINY[family][2].items() if not k.startswith("rope")}
    from jaxattn.models._pretrained import registered_families

    ours = registered_families()[family].config_class.from_dict(config)
    module, name = hf_rotary.rsplit(".", 1)
    rotary = getattr(importlib.import_module(f"transformers.{module}"), name)
    theirs = rotary(getattr(transformers, hf_config)(**config)).inv_freq.double().numpy()
    np.testing.assert_allclose(np.asarray(ours.rope_frequencies, np.float64)[: theirs.size], theirs, rtol=1e-6)
