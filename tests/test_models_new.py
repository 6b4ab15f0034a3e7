"""The families of issue 20 beyond the bars every family meets (tests/test_models_decoders.py holds them to
those): their config variants against transformers, the config options they refuse by name, the rope
settings they read (yarn, Gemma 3's per-layer-type rotary embeddings and transformers 4's keys for them).

Each variant writes a tiny random checkpoint (crosscheck._hf_models) with the option set, and compares every
layer and the logits with transformers in float32 and float64 on a left-padded batch.
"""

import json
import os
import shutil

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crosscheck import _hf_models as hf
from crosscheck import layer_report
from jaxattn.models import from_pretrained, rope_frequencies, supported_model_types


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
    assert {"qwen3", "gemma3_text"} <= set(supported_model_types())


@pytest.mark.parametrize("model_type, overrides", [
    # all four projections biased, tied head, no sliding layer
    ("qwen3", {"attention_bias": True, "tie_word_embeddings": True, "use_sliding_window": False}),
    # tied (HF's default), no final softcap (HF's default), the global layer first, yarn on the global layers
    ("gemma3_text", {"tie_word_embeddings": True, "final_logit_softcapping": None,
                     "layer_types": ["full_attention", "sliding_attention"],
                     "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 30.0},
                                         "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 500.0,
                                                            "original_max_position_embeddings": 16}}})])
def test_config_variants_match_transformers(tmp_path, model_type, overrides):
    model, params, torch_model = _assert_matches(hf.write_checkpoint(model_type, tmp_path / "variant", **overrides))
    assert ("lm_head" in params) != torch_model.config.tie_word_embeddings
    if model_type == "qwen3":
        assert {g for g, leaves in params["layers_0"]["self_attn"].items() if "bias" in leaves} == {
            "query", "key", "value", "out"}
    else:
        assert model.config.rope(1)[1] == 1.0 and model.config.rope(0)[1] > 1.0  # yarn's factor on the global layer


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


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096, "rope_theta": 150000.0},  # gpt-oss's
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5, "original_max_position_embeddings": 32,
     "rope_theta": 500.0},
    {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.25, "original_max_position_embeddings": 128,
     "rope_theta": 10000.0}])
def test_yarn_frequencies_and_attention_factor_equal_transformers(rope):
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from jaxattn.models._decoder import rope_attention_factor

    config = transformers.LlamaConfig(hidden_size=96, num_attention_heads=3, max_position_embeddings=256,
                                      rope_parameters=dict(rope))
    theirs, factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    ours = rope_frequencies(config.to_dict(), 32)
    np.testing.assert_allclose(ours, theirs.double().numpy(), rtol=1e-6, atol=0)
    assert rope_attention_factor(config.to_dict()) == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("model_type, changes, named", [
    ("qwen3", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3", {"use_sliding_window": False, "layer_types": ["sliding_attention", "full_attention"]}, "layer_types"),
    ("qwen3", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
     r"rope_parameters\['rope_type'\]"),
    ("gemma3_text", {"hidden_activation": "gelu"}, "hidden_activation"),
    ("gemma3_text", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("gemma3_text", {"layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
    ("gemma3_text", {"rope_parameters": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}, "rope_parameters"),
    ("gemma3_text", {"rope_parameters": {"sliding_attention": {"rope_type": "longrope", "rope_theta": 1e4}}},
     r"rope_parameters\['sliding_attention'\]\['rope_type'\]"),
    ("gemma3_text", {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                                            "partial_rotary_factor": 0.5}}},
     r"rope_parameters\['full_attention'\]\['partial_rotary_factor'\]")])
def test_config_options_not_implemented_are_refused(tmp_path, model_type, changes, named):
    source = hf.write_checkpoint(model_type, tmp_path / "ok")
    config = json.loads((source / "config.json").read_text())
    bad = tmp_path / "bad"
    shutil.copytree(source, bad)
    (bad / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ValueError, match=rf"{bad}/config.json: {named}: expected"):
        from_pretrained(bad)
