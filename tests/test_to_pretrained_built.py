"""to_pretrained of a mixture-of-experts model built in Python: a config, params of its own, no checkpoint read.

Mixtral and Qwen3-MoE (moe.loader) register their writer when the family is defined, with the per-expert rows
that transformers' save_pretrained writes; before, the writer came with the first from_pretrained (a model built
in Python could not be written) and a load of fused experts (transformers 5's state_dict in memory) switched
it to the fused rows. Checked:
  * in a fresh interpreter (nothing loaded before), to_pretrained writes both families, per expert;
  * transformers loads the Mixtral directory with no missing, unexpected or mismatched keys, and its logits
    equal jaxattn's on the same params (float32, max abs <= 1e-5 on real tokens of a left-padded batch);
  * after from_state_dict of transformers' fused state_dict, the same model is written to the same files.
The config has no rope settings: both sides read HF Mixtral's default rope_theta (1e6, not Llama's 1e4). Sizes
are tiny and each axis its own (V 23, E 20, F 13, N 5 heads of H 6 over K 1, X 3 experts, top 2; T 11).
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from crosscheck._hf import checkpoints as hf
from jaxattn.io import load_safetensors
from jaxattn.models import from_pretrained, from_state_dict, to_pretrained

ATTENTION = {
    "vocab_size": 23,
    "hidden_size": 20,
    "num_hidden_layers": 2,
    "num_attention_heads": 5,
    "num_key_value_heads": 1,
    "head_dim": 6,
    "max_position_embeddings": 32,
}
CONFIGS = {
    "mixtral": {
        "model_type": "mixtral",
        **ATTENTION,
        "intermediate_size": 13,
        "num_local_experts": 3,
        "num_experts_per_tok": 2,
    },
    "qwen3_moe": {
        "model_type": "qwen3_moe",
        **ATTENTION,
        "intermediate_size": 13,
        "moe_intermediate_size": 13,
        "num_experts": 3,
        "num_experts_per_tok": 2,
    },
}
# each family's first expert tensor as save_pretrained names it
PER_EXPERT = {
    "mixtral": "model.layers.0.block_sparse_moe.experts.0.w1.weight",
    "qwen3_moe": "model.layers.0.mlp.experts.0.gate_proj.weight",
}

# In a fresh interpreter: builds each family's model from its config dict (argv[1]), its params the init tree
# (traced, nothing compiled) filled with seeded normal values, and writes it under argv[2]/<model_type>.
WRITE = """
import json, sys
import jax, numpy as np
from jaxattn import models
CLASSES = {"mixtral": (models.MixtralConfig, models.MixtralForCausalLM),
           "qwen3_moe": (models.Qwen3MoeConfig, models.Qwen3MoeForCausalLM)}
for model_type, config in json.loads(sys.argv[1]).items():
    config_class, model_class = CLASSES[model_type]
    model = model_class(config_class.from_dict(config))
    shapes = jax.eval_shape(model.init, jax.random.key(0), np.ones((1, 3), np.int32))["params"]
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: 0.3 * rng.standard_normal(x.shape).astype(np.float32), shapes)
    models.to_pretrained(model, params, sys.argv[2] + "/" + model_type)
"""


def _tensors(directory):
    return load_safetensors(directory / "model.safetensors")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """model_type -> the directory a fresh interpreter wrote for the model built from CONFIGS[model_type]."""
    root = tmp_path_factory.mktemp("built")
    result = subprocess.run(
        [sys.executable, "-c", WRITE, json.dumps(CONFIGS), str(root)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr
    return {model_type: root / model_type for model_type in CONFIGS}


@pytest.mark.slow  # a fresh interpreter: 3 s
@pytest.mark.parametrize("model_type", CONFIGS)
def test_a_fresh_interpreter_writes_a_built_model_per_expert(written, model_type):
    tensors = _tensors(written[model_type])
    assert PER_EXPERT[model_type] in tensors and not any("gate_up_proj" in name for name in tensors)
    assert json.loads((written[model_type] / "config.json").read_text())["model_type"] == model_type


def test_transformers_loads_a_built_mixtral_with_its_logits(written, tmp_path):
    import transformers

    transformers.utils.logging.disable_progress_bar()
    theirs, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(written["mixtral"]),
        attn_implementation="eager",
        experts_implementation="eager",
        output_loading_info=True,
        local_files_only=True,
    )
    assert info == {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": set(), "error_msgs": []}
    ids, mask = hf.padded_batch("left", vocab=23)
    with torch.no_grad():
        reference = theirs.eval()(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits
    model, params = from_pretrained(written["mixtral"])  # the model and params written, read back as they are
    ours = np.asarray(jax.jit(model.apply)({"params": params}, ids, mask))  # one compile, not one per op
    real = mask.astype(bool)
    assert np.abs(ours[real] - reference.numpy()[real]).max() <= 1e-5

    # transformers 5 holds the experts fused in memory: reading that state_dict leaves the writer per expert
    fused = {k: v.numpy() for k, v in theirs.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in fused)
    from_state_dict(theirs.config.to_dict(), fused)
    again = _tensors(to_pretrained(model, params, tmp_path / "after_fused_load"))
    first = _tensors(written["mixtral"])
    assert set(again) == set(first) and all(np.array_equal(again[k], first[k]) for k in first)
