"""BERT encoder (Devlin et al. 2019) in Flax linen, on jaxattn.linen.MultiHeadAttention.

    embeddings:  x = LayerNorm(word[ids] + token_type[types] + position[pos])
    each layer:  a = LayerNorm(x + MultiHeadAttention(x, mask))          (HF: attention.self + .output)
                 x = LayerNorm(a + Dense_E(gelu_erf(Dense_F(a))))         (HF: intermediate + output)
    pooler:      tanh(Dense_E(x[:, 0]))

It matches Hugging Face's BertModel ("gelu" is the exact erf GELU, LayerNorm uses the config's eps and the
two-pass variance as torch does). Weights come from a PyTorch state_dict of numpy arrays (e.g.
crosscheck.load_state_dict("model.safetensors")) through `params_from_state_dict`, which follows ONE
explicit table (`weight_table`, the jaxattn.models.weights format of every family): every name, its shape
on both sides in the letters below, and its layout transform.

    V vocab  P positions  Y token types  E hidden (= N * H)  N heads  H head dim  F intermediate
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..linen import MultiHeadAttention
from . import _activation_layout, _masks, _norms, _pretrained, _save, weights
from .weights import Reshape, Steps, Transpose

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import ArrayLike, Bool, Int


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """The fields of HF's BertConfig that the encoder reads (defaults: bert-base)."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    pad_token_id: Optional[int] = 0
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    # every attention call's implementation= (jaxattn.dot_product_attention; None: per platform); not in config.json
    implementation: str | None = dataclasses.field(default=None, compare=False)
    hf_config: Any = dataclasses.field(default=None, compare=False, repr=False)  # the config.json dict read

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> "BertConfig":
        """From a HF config.json dict; refuses by name what this encoder does not implement."""
        refuse = functools.partial(_pretrained.refuse, source)
        if config.get("hidden_act", "gelu") != "gelu":
            refuse("hidden_act", "'gelu' (exact erf GELU)", config["hidden_act"])
        if config.get("position_embedding_type", "absolute") != "absolute":
            refuse("position_embedding_type", "'absolute'", config["position_embedding_type"])
        parsed = cls(**{f.name: config[f.name] for f in dataclasses.fields(cls) if f.compare and f.name in config})
        if parsed.hidden_size % parsed.num_attention_heads:
            refuse("hidden_size", f"a multiple of num_attention_heads={parsed.num_attention_heads}", parsed.hidden_size)
        return parsed

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict; the fields are HF's names)."""
        return {
            "model_type": "bert",
            "architectures": ["BertModel"],
            "hidden_act": "gelu",
            "is_decoder": False,
            "add_cross_attention": False,
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare},
        }

    def dims(self) -> dict[str, int]:
        """The axis letters of the weight table."""
        N = self.num_attention_heads
        return {
            "V": self.vocab_size,
            "P": self.max_position_embeddings,
            "Y": self.type_vocab_size,
            "E": self.hidden_size,
            "N": N,
            "H": self.hidden_size // N,
            "F": self.intermediate_size,
        }


class BertEmbeddings(nn.Module):
    config: BertConfig
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids, token_type_ids, position_ids, *, deterministic: bool):
        c = self.config
        embed = functools.partial(nn.Embed, features=c.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype)
        x = embed(c.vocab_size, name="word_embeddings")(input_ids)
        if c.pad_token_id is not None:  # torch's Embedding(padding_idx): that row never receives a gradient
            x = jnp.where((input_ids == c.pad_token_id)[..., None], jax.lax.stop_gradient(x), x)
        x = x + embed(c.type_vocab_size, name="token_type_embeddings")(token_type_ids)  # HF's summation order
        x = x + embed(c.max_position_embeddings, name="position_embeddings")(position_ids)
        x = _norms.layer_norm(c.layer_norm_eps, self.dtype, self.param_dtype, "LayerNorm")(x)
        return nn.Dropout(c.hidden_dropout_prob)(x, deterministic=deterministic)


class BertLayer(nn.Module):
    """One post-LayerNorm transformer block; returns (block output, attention output, attention weights)."""

    config: BertConfig
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None

    @nn.compact
    def __call__(self, x, mask, *, deterministic: bool):
        c = self.config
        dense = functools.partial(nn.Dense, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision)
        norm = functools.partial(_norms.layer_norm, c.layer_norm_eps, self.dtype, self.param_dtype)
        dropout = nn.Dropout(c.hidden_dropout_prob, deterministic=deterministic)
        attention = MultiHeadAttention(
            num_heads=c.num_attention_heads,
            dropout_rate=c.attention_probs_dropout_prob,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=self.precision,
            implementation=c.implementation,
            name="attention",
        )
        y, weights = attention(x, mask=mask, deterministic=deterministic, return_weights=True)
        a = norm("attention_norm")(x + dropout(y))
        h = nn.gelu(dense(c.intermediate_size, name="intermediate")(a), approximate=False)
        out = norm("output_norm")(a + dropout(dense(c.hidden_size, name="output")(h)))
        return out, a, weights


class BertModel(nn.Module):
    """HF BertModel's encoder. Call with input_ids [B...,T] (int), attention_mask [B...,T] (1 = token).

    Returns a dict: last_hidden_state [B...,T,E], pooler_output [B...,E] (with add_pooling_layer),
    hidden_states (embeddings, then each layer's output), attention_outputs (each layer's attention block
    after its LayerNorm) and attentions (each layer's weights [B...,N,T,T]).
    """

    config: BertConfig
    add_pooling_layer: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    sharding: Any = None  # a _activation_layout.ModelSharding: the activations' layout on a mesh (None: one device)

    @nn.compact
    def __call__(
        self,
        input_ids: Int[ArrayLike, "*B T"],
        attention_mask: Int[ArrayLike, "*B T"] | Bool[ArrayLike, "*B T"] | None = None,
        token_type_ids: Int[ArrayLike, "*B T"] | None = None,
        position_ids: Int[ArrayLike, "*B T"] | None = None,
        *,
        deterministic: bool = True,
    ) -> dict[str, Any]:
        input_ids = jnp.asarray(input_ids)
        T = input_ids.shape[-1]
        token_type_ids = jnp.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        position_ids = jnp.broadcast_to(jnp.arange(T), input_ids.shape) if position_ids is None else position_ids
        mask = _masks.key_mask(attention_mask)  # [B...,1,1,S]: keys only
        x = BertEmbeddings(self.config, self.dtype, self.param_dtype, name="embeddings")(
            input_ids, token_type_ids, position_ids, deterministic=deterministic
        )
        hidden_states, attention_outputs, attentions = [x], [], []
        for i in range(self.config.num_hidden_layers):
            x = _activation_layout.constrain(self.sharding, x, "BTE")  # on a mesh: batch over "data" between layers
            x, a, weights = BertLayer(self.config, self.dtype, self.param_dtype, self.precision, name=f"layer_{i}")(
                x, mask, deterministic=deterministic
            )
            hidden_states.append(x)
            attention_outputs.append(a)
            attentions.append(weights)
        outputs = {
            "last_hidden_state": x,
            "hidden_states": tuple(hidden_states),
            "attention_outputs": tuple(attention_outputs),
            "attentions": tuple(attentions),
        }
        if self.add_pooling_layer:
            pooler = nn.Dense(
                self.config.hidden_size,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                precision=self.precision,
                name="pooler",
            )
            outputs["pooler_output"] = jnp.tanh(pooler(x[..., 0, :]))
        return outputs


def mean_pooling(last_hidden_state, attention_mask, *, normalize: bool = True):
    """Sentence embeddings as sentence-transformers makes them: mean over real tokens, then L2-normalised."""
    weights = jnp.asarray(attention_mask)[..., None].astype(last_hidden_state.dtype)
    pooled = (last_hidden_state * weights).sum(-2) / jnp.maximum(weights.sum(-2), 1e-9)
    if normalize:
        pooled = pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return pooled


# --- weights: one row per tensor (see jaxattn.models.weights) ---------------------------------------------------


def weight_table(config: BertConfig, *, add_pooling_layer: bool = True, prefix: str = "") -> list[weights.Row]:
    """HF BertModel's names (after `prefix`, e.g. "bert." inside BertFor* heads) -> our params."""
    R = weights.row
    rows = weights.expand(
        [
            R("embeddings.word_embeddings.weight", ("V", "E"), "embeddings/word_embeddings/embedding", ("V", "E")),
            R(
                "embeddings.position_embeddings.weight",
                ("P", "E"),
                "embeddings/position_embeddings/embedding",
                ("P", "E"),
            ),
            R(
                "embeddings.token_type_embeddings.weight",
                ("Y", "E"),
                "embeddings/token_type_embeddings/embedding",
                ("Y", "E"),
            ),
            R("embeddings.LayerNorm.weight", ("E",), "embeddings/LayerNorm/scale", ("E",)),
            R("embeddings.LayerNorm.bias", ("E",), "embeddings/LayerNorm/bias", ("E",)),
            R(
                "encoder.layer.{i}.attention.self.query.weight",
                ("N*H", "E"),
                "layer_{i}/attention/query/kernel",
                ("E", "N", "H"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "encoder.layer.{i}.attention.self.query.bias",
                ("N*H",),
                "layer_{i}/attention/query/bias",
                ("N", "H"),
                Reshape(),
            ),
            R(
                "encoder.layer.{i}.attention.self.key.weight",
                ("N*H", "E"),
                "layer_{i}/attention/key/kernel",
                ("E", "N", "H"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "encoder.layer.{i}.attention.self.key.bias",
                ("N*H",),
                "layer_{i}/attention/key/bias",
                ("N", "H"),
                Reshape(),
            ),
            R(
                "encoder.layer.{i}.attention.self.value.weight",
                ("N*H", "E"),
                "layer_{i}/attention/value/kernel",
                ("E", "N", "H"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "encoder.layer.{i}.attention.self.value.bias",
                ("N*H",),
                "layer_{i}/attention/value/bias",
                ("N", "H"),
                Reshape(),
            ),
            R(
                "encoder.layer.{i}.attention.output.dense.weight",
                ("E", "N*H"),
                "layer_{i}/attention/out/kernel",
                ("N", "H", "E"),
                Steps(Transpose(), Reshape()),
            ),
            R("encoder.layer.{i}.attention.output.dense.bias", ("E",), "layer_{i}/attention/out/bias", ("E",)),
            R("encoder.layer.{i}.attention.output.LayerNorm.weight", ("E",), "layer_{i}/attention_norm/scale", ("E",)),
            R("encoder.layer.{i}.attention.output.LayerNorm.bias", ("E",), "layer_{i}/attention_norm/bias", ("E",)),
            R(
                "encoder.layer.{i}.intermediate.dense.weight",
                ("F", "E"),
                "layer_{i}/intermediate/kernel",
                ("E", "F"),
                Transpose(),
            ),
            R("encoder.layer.{i}.intermediate.dense.bias", ("F",), "layer_{i}/intermediate/bias", ("F",)),
            R("encoder.layer.{i}.output.dense.weight", ("E", "F"), "layer_{i}/output/kernel", ("F", "E"), Transpose()),
            R("encoder.layer.{i}.output.dense.bias", ("E",), "layer_{i}/output/bias", ("E",)),
            R("encoder.layer.{i}.output.LayerNorm.weight", ("E",), "layer_{i}/output_norm/scale", ("E",)),
            R("encoder.layer.{i}.output.LayerNorm.bias", ("E",), "layer_{i}/output_norm/bias", ("E",)),
            *weights.when(
                add_pooling_layer,
                R("pooler.dense.weight", ("E", "E"), "pooler/kernel", ("E", "E"), Transpose()),
                R("pooler.dense.bias", ("E",), "pooler/bias", ("E",)),
            ),
        ],
        config.num_hidden_layers,
    )
    return weights.prefixed(rows, prefix)


def state_dict_names(config: BertConfig, *, add_pooling_layer: bool = True) -> list[str]:
    """Every parameter name params_from_state_dict expects, in table order (buffers excluded)."""
    return [r.name for r in weight_table(config, add_pooling_layer=add_pooling_layer)]


def params_from_state_dict(
    state_dict: Mapping[str, Any],
    config: BertConfig,
    *,
    add_pooling_layer: bool = True,
    prefix: str = "",
    dtype: Optional[Any] = None,
) -> dict:
    """HF BertModel state_dict ({name: array}) -> BertModel params, by the table above.

    The key set must be exactly the table's names (each after `prefix`, e.g. "bert." for BertFor* heads),
    plus optional known buffers; a missing, unexpected or wrongly shaped tensor raises ValueError naming it.
    dtype: cast every float tensor (e.g. np.float64); default keeps the file's dtype.
    Also maps gradients taken in torch, since every transform is a permutation.
    """
    tensors = {name: np.asarray(value) for name, value in state_dict.items()}
    return _fill(
        tensors,
        {name: "state_dict" for name in tensors},
        config,
        add_pooling_layer=add_pooling_layer,
        prefix=prefix,
        dtype=dtype,
    )


def _fill(tensors, files, config: BertConfig, *, add_pooling_layer: bool, prefix: str, dtype) -> dict:
    """The params the table describes; torch's position_ids buffer, which some checkpoints hold, is checked
    to be the default arange(P) and skipped."""
    buffer = prefix + "embeddings.position_ids"
    if buffer in tensors and not np.array_equal(tensors[buffer], np.arange(config.max_position_embeddings)[None]):
        raise ValueError(f"{files[buffer]}: {buffer!r}: expected the default buffer arange(P), got other values")
    rows = weight_table(config, add_pooling_layer=add_pooling_layer, prefix=prefix)
    return weights.fill(tensors, rows, config.dims(), files, dtype=dtype, ignored=(buffer,))


def init_params(config: BertConfig, rng=None, **model_options) -> dict:
    """Fresh random params (for tests / training from scratch), shapes as the table's."""
    rng = jax.random.key(0) if rng is None else rng
    ids = jnp.zeros((1, 2), jnp.int32)
    return BertModel(config, **model_options).init(rng, ids)["params"]


# --- from_pretrained ------------------------------------------------------------------------------------------


@_pretrained.register_family("bert")
@_pretrained.loads(BertConfig, BertModel)
def load_pretrained(config: dict, tensors, files, *, dtype, precision, source):
    """(BertModel, params) from a BertModel checkpoint (names with or without the "bert." prefix)."""
    for key in ("is_decoder", "add_cross_attention"):
        if config.get(key, False):
            _pretrained.refuse(
                source, key, "false (an encoder; decoder cross-attention is not implemented)", config[key]
            )
    bert_config = BertConfig.from_dict(config, source)
    prefix = "bert." if any(name.startswith("bert.") for name in tensors) else ""
    pooler = prefix + "pooler.dense.weight" in tensors
    params = _fill(tensors, files, bert_config, add_pooling_layer=pooler, prefix=prefix, dtype=dtype)
    return BertModel(bert_config, add_pooling_layer=pooler, precision=precision), params


@_save.register_writer(BertModel)
def checkpoint(model: BertModel):
    """What to_pretrained writes: HF BertModel's names (no prefix), the pooler when the model has one (HF's
    AutoModel builds one unless given add_pooling_layer=False)."""
    rows = weight_table(model.config, add_pooling_layer=model.add_pooling_layer)
    return _save.config_json(model.config), rows, model.config.dims()
