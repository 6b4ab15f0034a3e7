"""jaxattn.models.deberta_v2: what its config refuses, and which head a checkpoint's names select.

Its agreement with transformers (every layer, logits, gradients, float32 and float64) is checked where every
family's is: tests/test_to_pretrained.py (the masked LM with either head, the classifier and the bare encoder,
written back and reloaded in transformers), crosscheck's cases model_deberta_v2 and model_deberta_v2_legacy and
`python -m crosscheck --model DIR` (tests/test_cli_model.py), tests/test_models_sharded.py (meshes). Here: the
config options it does not implement are refused by name, before any tensor is read; the masked LM's names
follow `legacy`, and the legacy head's tied decoder, where a file stores it, is checked to be the copies.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.models import (
    DebertaV2Config,
    DebertaV2ForMaskedLM,
    DebertaV2ForSequenceClassification,
    DebertaV2Model,
    from_state_dict,
    to_pretrained,
)
from jaxattn.models.deberta_v2 import init_params, weight_table

# DeBERTa-v3-base's config.json keys, at a tiny size (E 15 = 3 heads of 5, prime-ish sizes)
V3 = {
    "model_type": "deberta-v2",
    "vocab_size": 37,
    "hidden_size": 15,
    "num_hidden_layers": 2,
    "num_attention_heads": 3,
    "intermediate_size": 23,
    "max_position_embeddings": 29,
    "type_vocab_size": 0,
    "hidden_act": "gelu",
    "relative_attention": True,
    "position_buckets": 6,
    "max_relative_positions": -1,
    "norm_rel_ebd": "layer_norm",
    "share_att_key": True,
    "pos_att_type": "p2c|c2p",
    "position_biased_input": False,
    "layer_norm_eps": 1e-7,
    "pooler_hidden_size": 15,
    "pooler_hidden_act": "gelu",
    "legacy": False,
}


def _tensors(config: dict, head: str) -> dict:
    """A state_dict of the right names and shapes for `head` (zeros), from the port's own table."""
    parsed = DebertaV2Config.from_dict(config)
    dims = parsed.dims()
    from jaxattn.models.weights import size

    return {r.name: np.zeros(size(r.shape, dims), np.float32) for r in weight_table(parsed, head)}


@pytest.mark.parametrize(
    "key, value, pattern",
    [
        ("hidden_act", "relu", r"hidden_act: expected 'gelu'"),
        ("pooler_hidden_act", "tanh", r"pooler_hidden_act: expected 'gelu'"),
        ("relative_attention", False, r"relative_attention: expected true"),
        ("conv_kernel_size", 3, r"conv_kernel_size: expected 0"),
        ("embedding_size", 16, r"embedding_size: expected hidden_size=15"),
        ("pooler_hidden_size", 16, r"pooler_hidden_size: expected hidden_size=15"),
        ("attention_head_size", 4, r"attention_head_size: expected hidden_size / num_attention_heads = 5"),
        ("norm_rel_ebd", "layer_norm|other", r"norm_rel_ebd: expected one of \['none', 'layer_norm'\]"),
        ("pos_att_type", ["c2p", "p2p"], r"pos_att_type: expected a subset of \['c2p', 'p2c'\]"),
        ("pos_att_type", ["c2p", "c2p"], r"pos_att_type: expected a subset"),
        ("z_steps", 2, r"z_steps: expected 0 or 1"),
        ("max_relative_positions", 4, r"max_relative_positions: expected > position_buckets // 2 \+ 1 = 4"),
    ],
)
def test_config_options_it_does_not_implement_are_refused_by_name(key, value, pattern):
    with pytest.raises(ValueError, match=rf"^config: {pattern}.* got {re.escape(repr(value))}$"):
        from_state_dict({**V3, key: value}, _tensors(V3, "model"))


def test_the_names_select_the_head_and_legacy_is_the_one_the_config_names():
    for head, cls in (
        ("model", DebertaV2Model),
        ("masked_lm", DebertaV2ForMaskedLM),
        ("classification", DebertaV2ForSequenceClassification),
    ):
        model, params = from_state_dict(V3, _tensors(V3, head))
        assert type(model) is cls and model.config.pos_att_type == ("p2c", "c2p") and model.config.span() == 6
        fresh = jax.eval_shape(lambda: init_params(model.config, head=head))  # the model's own tree = the table's
        assert {k: v.shape for k, v in _flat(fresh).items()} == {k: v.shape for k, v in _flat(params).items()}
    with pytest.raises(ValueError, match=r"^config: legacy: expected false \(the checkpoint holds lm_predictions"):
        from_state_dict({**V3, "legacy": True}, _tensors(V3, "masked_lm"))
    # DeBERTa-v3's released files: the masked LM head and the replaced-token-detection head, skipped as HF does
    released = {**_tensors(V3, "masked_lm"), "mask_predictions.classifier.weight": np.ones((1, 15), np.float32)}
    model, kept = from_state_dict(V3, released)
    assert type(model) is DebertaV2ForMaskedLM and not any("mask_predictions" in k for k in _flat(kept))
    with pytest.raises(ValueError, match=r'legacy: expected false .*add "legacy": false'):
        from_state_dict({k: v for k, v in V3.items() if k != "legacy"}, released)
    with pytest.raises(ValueError, match=r"^config: legacy: expected true \(the checkpoint holds cls.predictions"):
        from_state_dict(V3, _tensors({**V3, "legacy": True}, "masked_lm"))
    unused = {
        **_tensors(V3, "masked_lm"),
        "deberta.embeddings.position_embeddings.weight": np.ones((29, 15), np.float32),
    }
    _, kept = from_state_dict(V3, unused)  # v3 without absolute positions: skipped, as transformers does
    assert "position_embeddings" not in kept["deberta"]["embed"]
    with pytest.raises(ValueError, match=r"position_embeddings.weight': expected shape \[29,15\] \[P,E\] \(unused"):
        from_state_dict(V3, {**unused, "deberta.embeddings.position_embeddings.weight": np.ones((3, 15), np.float32)})
    with pytest.raises(ValueError, match=r"1 missing \['embeddings.position_embeddings.weight'\]"):  # read: needed
        from_state_dict({**V3, "position_biased_input": True}, _tensors(V3, "model"))
    missing = _tensors(V3, "model")
    del missing["encoder.LayerNorm.weight"]  # norm_rel_ebd "layer_norm" needs the relative embeddings' norm
    with pytest.raises(ValueError, match=r"1 missing \['encoder.LayerNorm.weight'\]"):
        from_state_dict(V3, missing)


def test_the_legacy_head_reads_cls_predictions_and_checks_the_copies_of_its_tied_decoder(tmp_path):
    """transformers' default masked LM (legacy true): the cls.predictions head, the lm_predictions head's maths
    under other names (tests/test_to_pretrained.py holds its logits to transformers'); its decoder is tied to the
    word embeddings and its bias to cls.predictions.bias, copies torch's .bin files store, checked and skipped."""
    legacy = {**V3, "legacy": True}
    tensors = _tensors(legacy, "masked_lm")
    assert {n for n in tensors if not n.startswith("deberta.")} == {
        "cls.predictions.transform.dense.weight",
        "cls.predictions.transform.dense.bias",
        "cls.predictions.transform.LayerNorm.weight",
        "cls.predictions.transform.LayerNorm.bias",
        "cls.predictions.bias",
    }
    tensors["cls.predictions.bias"] = np.arange(37, dtype=np.float32)
    model, params = from_state_dict(legacy, tensors)
    assert type(model) is DebertaV2ForMaskedLM and model.config.legacy
    np.testing.assert_array_equal(params["lm_bias"], tensors["cls.predictions.bias"])
    embeddings = tensors["deberta.embeddings.word_embeddings.weight"]
    copies = {
        "cls.predictions.decoder.weight": embeddings,
        "cls.predictions.decoder.bias": tensors["cls.predictions.bias"],
    }
    _, kept = from_state_dict(legacy, {**tensors, **copies})
    assert jax.tree.all(jax.tree.map(np.array_equal, kept, params))
    for name, copy in copies.items():
        other = {**tensors, **copies, name: copy + 1}
        with pytest.raises(ValueError, match=rf"'{re.escape(name)}': expected a copy of"):
            from_state_dict(legacy, other)
    with pytest.raises(ValueError, match=r"^config: tie_word_embeddings: expected true \(the legacy head's decoder"):
        from_state_dict({**legacy, "tie_word_embeddings": False}, tensors)
    untied = model.clone(config=dataclasses.replace(model.config, hf_config={"tie_word_embeddings": False}))
    with pytest.raises(ValueError, match=r"^model.config: tie_word_embeddings: expected true"):  # nor written so
        to_pretrained(untied, params, tmp_path / "untied")
    assert not (tmp_path / "untied").exists()


def test_config_round_trips_through_its_hf_keys():
    config = DebertaV2Config.from_dict({**V3, "id2label": {"0": "a", "1": "b", "2": "c"}})
    assert config.num_labels == 3 and config.relative_positions() == 29 and config.norm_rel_ebd == "layer_norm"
    assert DebertaV2Config.from_dict(config.to_dict()) == config
    model = DebertaV2ForSequenceClassification(config)
    params = jax.eval_shape(lambda: init_params(config, head="classification"))
    logits = jax.eval_shape(lambda p: model.apply({"params": p}, jnp.ones((2, 5, 7), jnp.int32)), params)
    assert logits.shape == (2, 5, 3)  # extra batch dims pass through


def _flat(tree, prefix=""):
    if not isinstance(tree, dict):
        return {prefix: tree}
    return {k: v for name, sub in tree.items() for k, v in _flat(sub, f"{prefix}/{name}" if prefix else name).items()}
