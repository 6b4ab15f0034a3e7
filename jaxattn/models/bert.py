"""BERT encoder (Devlin et al. 2019) in Flax linen, on jaxattn.linen.MultiHeadAttention.

    embeddings:  x = LayerNorm(word[ids] + token_type[types] + position[pos])
    each layer:  a = LayerNorm(x + MultiHeadAttention(x, mask))          (HF: attention.self + .output)
                 x = LayerNorm(a + Dense_E(gelu_erf(Dense_F(a))))         (HF: intermediate + output)
    pooler:      tanh(Dense_E(x[:, 0]))

It matches Hugging Face's BertModel ("gelu" is the exact erf GELU, LayerNorm uses the config's eps and the
two-pass variance as torch does). Weights come from a PyTorch state_dict of numpy arrays (e.g.
crosscheck.load_state_dict("model.safetensors")) through `params_from_state_dict`, which follows ONE
explicit table: every name, its shape on both sides in the letters below, and its layout transform.

    V vocab  P positions  Y token types  E hidden (= N * H)  N heads  H head dim  F intermediate
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .._core import checks
from ..linen import MultiHeadAttention
from . import _decoder, _pretrained, _table


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

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "BertConfig":
        """From a HF config.json dict; refuses what this encoder does not implement."""
        if config.get("hidden_act", "gelu") != "gelu":
            checks.fail("config['hidden_act']", "'gelu' (exact erf GELU)", repr(config["hidden_act"]))
        if config.get("position_embedding_type", "absolute") != "absolute":
            checks.fail("config['position_embedding_type']", "'absolute'", repr(config["position_embedding_type"]))
        config = cls(**{f.name: config[f.name] for f in dataclasses.fields(cls) if f.name in config})
        if config.hidden_size % config.num_attention_heads:
            checks.fail("config", "hidden_size divisible by num_attention_heads",
                         f"{config.hidden_size} and {config.num_attention_heads}")
        return config

    def dims(self) -> dict[str, int]:
        """The axis letters of the weight table."""
        N = self.num_attention_heads
        return {"V": self.vocab_size, "P": self.max_position_embeddings, "Y": self.type_vocab_size,
                "E": self.hidden_size, "N": N, "H": self.hidden_size // N, "F": self.intermediate_size}


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
        x = _decoder.layer_norm(c.layer_norm_eps, self.dtype, self.param_dtype, "LayerNorm")(x)
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
        norm = functools.partial(_decoder.layer_norm, c.layer_norm_eps, self.dtype, self.param_dtype)
        dropout = nn.Dropout(c.hidden_dropout_prob, deterministic=deterministic)
        attention = MultiHeadAttention(num_heads=c.num_attention_heads, dropout_rate=c.attention_probs_dropout_prob,
                                       dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
                                       name="attention")
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

    @nn.compact
    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, position_ids=None, *,
                 deterministic: bool = True):
        input_ids = jnp.asarray(input_ids)
        T = input_ids.shape[-1]
        token_type_ids = jnp.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        position_ids = jnp.broadcast_to(jnp.arange(T), input_ids.shape) if position_ids is None else position_ids
        mask = _decoder.key_mask(attention_mask)  # [B...,1,1,S]: keys only
        x = BertEmbeddings(self.config, self.dtype, self.param_dtype, name="embeddings")(
            input_ids, token_type_ids, position_ids, deterministic=deterministic)
        hidden_states, attention_outputs, attentions = [x], [], []
        for i in range(self.config.num_hidden_layers):
            x, a, weights = BertLayer(self.config, self.dtype, self.param_dtype, self.precision,
                                      name=f"layer_{i}")(x, mask, deterministic=deterministic)
            hidden_states.append(x)
            attention_outputs.append(a)
            attentions.append(weights)
        outputs = {"last_hidden_state": x, "hidden_states": tuple(hidden_states),
                   "attention_outputs": tuple(attention_outputs), "attentions": tuple(attentions)}
        if self.add_pooling_layer:
            pooler = nn.Dense(self.config.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype,
                              precision=self.precision, name="pooler")
            outputs["pooler_output"] = jnp.tanh(pooler(x[..., 0, :]))
        return outputs


def mean_pooling(last_hidden_state, attention_mask, *, normalize: bool = True):
    """Sentence embeddings as sentence-transformers makes them: mean over real tokens, then L2-normalised."""
    weights = jnp.asarray(attention_mask)[..., None].astype(last_hidden_state.dtype)
    pooled = (last_hidden_state * weights).sum(-2) / jnp.maximum(weights.sum(-2), 1e-9)
    if normalize:
        pooled = pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)
    return pooled


# --- weights: one row per tensor ------------------------------------------------------------------------------
# (HF state_dict name, HF shape, our params path, our shape, transform); "{i}" is the layer index.
# Transforms: copy; transpose (nn.Linear [out,in] -> Dense [in,out]); heads_in ([N*H,E] -> [E,N,H]);
# heads ([N*H] -> [N,H]); heads_out ([E,N*H] -> [N,H,E]).

_EMBEDDING_ROWS = (
    ("embeddings.word_embeddings.weight", ("V", "E"), "embeddings/word_embeddings/embedding", ("V", "E"), "copy"),
    ("embeddings.position_embeddings.weight", ("P", "E"), "embeddings/position_embeddings/embedding", ("P", "E"),
     "copy"),
    ("embeddings.token_type_embeddings.weight", ("Y", "E"), "embeddings/token_type_embeddings/embedding",
     ("Y", "E"), "copy"),
    ("embeddings.LayerNorm.weight", ("E",), "embeddings/LayerNorm/scale", ("E",), "copy"),
    ("embeddings.LayerNorm.bias", ("E",), "embeddings/LayerNorm/bias", ("E",), "copy"),
)
_LAYER_ROWS = (
    ("encoder.layer.{i}.attention.self.query.weight", ("N*H", "E"), "layer_{i}/attention/query/kernel",
     ("E", "N", "H"), "heads_in"),
    ("encoder.layer.{i}.attention.self.query.bias", ("N*H",), "layer_{i}/attention/query/bias", ("N", "H"), "heads"),
    ("encoder.layer.{i}.attention.self.key.weight", ("N*H", "E"), "layer_{i}/attention/key/kernel",
     ("E", "N", "H"), "heads_in"),
    ("encoder.layer.{i}.attention.self.key.bias", ("N*H",), "layer_{i}/attention/key/bias", ("N", "H"), "heads"),
    ("encoder.layer.{i}.attention.self.value.weight", ("N*H", "E"), "layer_{i}/attention/value/kernel",
     ("E", "N", "H"), "heads_in"),
    ("encoder.layer.{i}.attention.self.value.bias", ("N*H",), "layer_{i}/attention/value/bias", ("N", "H"), "heads"),
    ("encoder.layer.{i}.attention.output.dense.weight", ("E", "N*H"), "layer_{i}/attention/out/kernel",
     ("N", "H", "E"), "heads_out"),
    ("encoder.layer.{i}.attention.output.dense.bias", ("E",), "layer_{i}/attention/out/bias", ("E",), "copy"),
    ("encoder.layer.{i}.attention.output.LayerNorm.weight", ("E",), "layer_{i}/attention_norm/scale", ("E",), "copy"),
    ("encoder.layer.{i}.attention.output.LayerNorm.bias", ("E",), "layer_{i}/attention_norm/bias", ("E",), "copy"),
    ("encoder.layer.{i}.intermediate.dense.weight", ("F", "E"), "layer_{i}/intermediate/kernel", ("E", "F"),
     "transpose"),
    ("encoder.layer.{i}.intermediate.dense.bias", ("F",), "layer_{i}/intermediate/bias", ("F",), "copy"),
    ("encoder.layer.{i}.output.dense.weight", ("E", "F"), "layer_{i}/output/kernel", ("F", "E"), "transpose"),
    ("encoder.layer.{i}.output.dense.bias", ("E",), "layer_{i}/output/bias", ("E",), "copy"),
    ("encoder.layer.{i}.output.LayerNorm.weight", ("E",), "layer_{i}/output_norm/scale", ("E",), "copy"),
    ("encoder.layer.{i}.output.LayerNorm.bias", ("E",), "layer_{i}/output_norm/bias", ("E",), "copy"),
)
_POOLER_ROWS = (
    ("pooler.dense.weight", ("E", "E"), "pooler/kernel", ("E", "E"), "transpose"),
    ("pooler.dense.bias", ("E",), "pooler/bias", ("E",), "copy"),
)
# Buffers, not parameters: torch saves them in some checkpoints. Checked against their known value, dropped.
_BUFFERS = {"embeddings.position_ids": lambda c: np.arange(c.max_position_embeddings)[None]}


def _transform(name: str, x: np.ndarray, jax_shape: tuple[int, ...]) -> np.ndarray:
    if name in ("transpose", "heads_in", "heads_out"):
        x = x.T
    return np.ascontiguousarray(x.reshape(jax_shape))


def _rows(config: BertConfig, add_pooling_layer: bool):
    rows = list(_EMBEDDING_ROWS)
    for i in range(config.num_hidden_layers):
        rows += [(t.format(i=i), ts, p.format(i=i), js, f) for t, ts, p, js, f in _LAYER_ROWS]
    return rows + (list(_POOLER_ROWS) if add_pooling_layer else [])


def state_dict_names(config: BertConfig, *, add_pooling_layer: bool = True) -> list[str]:
    """Every parameter name params_from_state_dict expects, in table order (buffers excluded)."""
    return [row[0] for row in _rows(config, add_pooling_layer)]


def _size(letters: tuple[str, ...], dims: dict[str, int]) -> tuple[int, ...]:
    return tuple(math.prod(dims[a] for a in axis.split("*")) for axis in letters)


def params_from_state_dict(state_dict: Mapping[str, Any], config: BertConfig, *, add_pooling_layer: bool = True,
                           prefix: str = "", dtype: Optional[Any] = None) -> dict:
    """HF BertModel state_dict ({name: array}) -> BertModel params, by the table above.

    The key set must be exactly the table's names (each after `prefix`, e.g. "bert." for BertFor* heads),
    plus optional known buffers; a missing, unexpected or wrongly shaped tensor raises ValueError naming it.
    dtype: cast every float tensor (e.g. np.float64); default keeps the file's dtype.
    Also maps gradients taken in torch, since every transform is a permutation.
    """
    dims = config.dims()
    rows = _rows(config, add_pooling_layer)
    given = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    expected = {row[0] for row in rows}
    unexpected = sorted(set(given) - expected - set(_BUFFERS)) + sorted(k for k in state_dict if not k.startswith(prefix))
    missing = sorted(expected - set(given))
    if missing or unexpected:
        checks.fail("state_dict", f"exactly the {len(expected)} BERT tensors of the table (prefix {prefix!r})",
                     f"missing {missing[:6]}{'...' if len(missing) > 6 else ''}, unexpected {unexpected}")
    for name, value in _BUFFERS.items():
        if name in given and not np.array_equal(np.asarray(given[name]), value(config)):
            checks.fail(f"state_dict[{prefix + name!r}]", "the default buffer arange(P)", "other values")
    params: dict = {}
    for torch_name, torch_letters, path, jax_letters, transform in rows:
        x = np.asarray(given[torch_name])
        want = _size(torch_letters, dims)
        if x.shape != want:
            checks.fail(f"state_dict[{prefix + torch_name!r}]", f"shape {checks.shape_str(want)} "
                         f"[{','.join(torch_letters)}]", f"shape {checks.shape_str(x.shape)}")
        x = _transform(transform, x, _size(jax_letters, dims))
        if dtype is not None and np.issubdtype(x.dtype, np.floating):
            x = x.astype(dtype)
        node = params
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = x
    return params


def init_params(config: BertConfig, rng=None, **model_options) -> dict:
    """Fresh random params (for tests / training from scratch), shapes as the table's."""
    rng = jax.random.key(0) if rng is None else rng
    ids = jnp.zeros((1, 2), jnp.int32)
    return BertModel(config, **model_options).init(rng, ids)["params"]


# --- from_pretrained ------------------------------------------------------------------------------------------

_TABLE_TRANSFORMS = {"copy": "copy", "transpose": "transpose", "heads_in": "T_reshape", "heads": "reshape",
                     "heads_out": "T_reshape"}


def weight_table(config: BertConfig, *, add_pooling_layer: bool = True, prefix: str = "") -> list[_table.Row]:
    """The table above as _table rows (HF name -> our path, transform, shape) for from_pretrained."""
    return [_table.row(prefix + name, letters, path, our_letters, _TABLE_TRANSFORMS[transform])
            for name, letters, path, our_letters, transform in _rows(config, add_pooling_layer)]


@_pretrained.register_family("bert")
def load_pretrained(config: dict, tensors, files, *, dtype, precision, source):
    """(BertModel, params) from a BertModel checkpoint (names with or without the "bert." prefix)."""
    for key in ("is_decoder", "add_cross_attention"):
        if config.get(key, False):
            _pretrained.refuse(source, key, "false (an encoder; decoder cross-attention is not implemented)",
                               config[key])
    try:
        bert_config = BertConfig.from_dict(config)
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None
    prefix = "bert." if any(name.startswith("bert.") for name in tensors) else ""
    pooler = prefix + "pooler.dense.weight" in tensors
    rows = weight_table(bert_config, add_pooling_layer=pooler, prefix=prefix)
    buffer = prefix + "embeddings.position_ids"
    if buffer in tensors and not np.array_equal(tensors[buffer], _BUFFERS["embeddings.position_ids"](bert_config)):
        raise ValueError(f"{files[buffer]}: {buffer!r}: expected the default buffer arange(P), got other values")
    params = _table.fill(tensors, rows, bert_config.dims(), files, dtype=dtype, ignored=(buffer,))
    return BertModel(bert_config, add_pooling_layer=pooler, precision=precision), params
