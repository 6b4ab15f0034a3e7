"""DeBERTa-v2 / DeBERTa-v3 encoder (He et al. 2021) in Flax linen, on jaxattn.linen.DisentangledAttention.

    embeddings:  x = LayerNorm(word[ids] (+ position[pos]) (+ token_type[types])) * attention_mask
    relative:    rel = LayerNorm(rel_embeddings)   [2 span, E], one table for every layer (norm_rel_ebd)
    each layer:  a = LayerNorm(x + DisentangledAttention(x, rel, mask))   (HF: attention.self + .output)
                 x = LayerNorm(a + Dense_E(gelu_erf(Dense_F(a))))          (HF: intermediate + output)
    masked LM:   logits = LayerNorm(gelu(Dense_E(x))) @ word.T + bias      (HF: lm_predictions.lm_head, or
                                                                            cls.predictions with legacy)
    classifier:  logits = Dense_C(gelu(Dense_E(x[:, 0])))                  (HF: pooler (ContextPooler) + classifier)

It matches Hugging Face's DebertaV2Model, DebertaV2ForMaskedLM and DebertaV2ForSequenceClassification. The
masked LM has either of HF's heads, the same maths under other names: legacy=false's lm_predictions, or
legacy=true's cls.predictions (transformers' default), whose decoder is tied to the word embeddings and its
bias to cls.predictions.bias. The attention is the library's disentangled attention (c2p / p2c over
log-bucketed relative positions, jaxattn.disentangled_attention); its relative embeddings are the encoder's
rel_embeddings after their LayerNorm, projected in each layer by pos_key / pos_query, or by key / query with
share_att_key (DeBERTa-v3). Padding: attention_mask [B...,T] (1 = token) masks the keys and zeroes the padded
embeddings, as HF does; HF also masks padded queries (their rows have no allowed key and give the uniform
average there), whose outputs mean nothing in either framework.

Config options this port does not implement are refused by name (DebertaV2Config.from_dict): the
ConvLayer of DeBERTa-v2-xlarge (conv_kernel_size), relative_attention false (DeBERTa-v1-style absolute
attention), an embedding_size or attention_head_size other than hidden_size / heads, activations other than
the exact GELU, norm_rel_ebd other than "none" / "layer_norm"; and on loading a masked LM, the legacy head with
an untied decoder (tie_word_embeddings false).

    V vocab  P positions  Y token types  E hidden (= N * H)  N heads  H head dim  F intermediate
    R relative embeddings (2 span)  C labels
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Mapping, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .._layers.disentangled import check_pos_att_type
from ..linen import DisentangledAttention
from . import _activation_layout, _decoder, _masks, _norms, _pretrained, _save, weights
from ._decoder import tied_logits
from .weights import Reshape, Steps, Transpose

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Bool, Float, Int

_NORM_REL_EBD = ("none", "layer_norm")


@dataclasses.dataclass(frozen=True)
class DebertaV2Config:
    """The fields of HF's DebertaV2Config that the encoder reads (defaults: HF's DebertaV2Config, except
    relative_attention, which this port requires)."""

    vocab_size: int = 128100
    hidden_size: int = 1536
    num_hidden_layers: int = 24
    num_attention_heads: int = 24
    intermediate_size: int = 6144
    max_position_embeddings: int = 512
    type_vocab_size: int = 0
    pad_token_id: Optional[int] = 0
    layer_norm_eps: float = 1e-7
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    relative_attention: bool = True
    max_relative_positions: int = -1  # < 1: max_position_embeddings (HF's rule; see relative_positions)
    position_buckets: int = -1  # <= 0: no log buckets
    pos_att_type: tuple = ()
    share_att_key: bool = False
    norm_rel_ebd: str = "none"
    position_biased_input: bool = True
    pooler_dropout: float = 0.0
    cls_dropout: Optional[float] = None  # None: hidden_dropout_prob (HF's DebertaV2ForSequenceClassification)
    num_labels: int = 2
    legacy: bool = True  # the MLM head's names: True cls.predictions (transformers' default), False lm_predictions
    # every attention call's implementation= (jaxattn.disentangled_attention; None: dense); not in config.json
    implementation: str | None = dataclasses.field(default=None, compare=False)
    hf_config: Any = dataclasses.field(default=None, compare=False, repr=False)  # the config.json dict read

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> "DebertaV2Config":
        """From a HF config.json dict; refuses by name what this encoder does not implement."""
        refuse = functools.partial(_pretrained.refuse, source)
        for key in ("hidden_act", "pooler_hidden_act"):
            if config.get(key, "gelu") != "gelu":
                refuse(key, "'gelu' (exact erf GELU)", config[key])
        if not config.get("relative_attention", False):
            refuse(
                "relative_attention",
                "true (disentangled attention; absolute-only DeBERTa is not ported)",
                config.get("relative_attention", False),
            )
        if config.get("conv_kernel_size", 0) > 0:
            refuse(
                "conv_kernel_size",
                "0 (DeBERTa-v2's ConvLayer after the first layer is not ported)",
                config["conv_kernel_size"],
            )
        width, heads = config.get("hidden_size"), config.get("num_attention_heads")
        for key, want in (("embedding_size", width), ("pooler_hidden_size", width)):
            if config.get(key, want) != want:
                refuse(key, f"hidden_size={want} (no embed_proj / a pooler of the hidden width)", config[key])
        if "attention_head_size" in config and config["attention_head_size"] * heads != width:
            refuse(
                "attention_head_size",
                f"hidden_size / num_attention_heads = {width // heads}",
                config["attention_head_size"],
            )
        if config.get("z_steps", 0) > 1:
            refuse("z_steps", "0 or 1 (no repeated last layer)", config["z_steps"])
        norm = [t.strip() for t in str(config.get("norm_rel_ebd", "none")).lower().split("|")]
        if len(norm) != 1 or norm[0] not in _NORM_REL_EBD:
            refuse("norm_rel_ebd", f"one of {list(_NORM_REL_EBD)}", config["norm_rel_ebd"])
        try:
            terms = check_pos_att_type(config.get("pos_att_type") or ())
        except ValueError:
            refuse("pos_att_type", "a subset of ['c2p', 'p2c'] (or 'c2p|p2c')", config["pos_att_type"])
        labels = config.get("id2label")
        num_labels = len(labels) if isinstance(labels, Mapping) else config.get("num_labels", 2)
        fields = {f.name for f in dataclasses.fields(cls) if f.compare}
        parsed = cls(
            **{
                **{k: config[k] for k in fields & set(config) if k not in ("pos_att_type", "num_labels")},
                "pos_att_type": terms,
                "norm_rel_ebd": norm[0],
                "num_labels": num_labels,
            }
        )
        if parsed.hidden_size % parsed.num_attention_heads:
            refuse("hidden_size", f"a multiple of num_attention_heads={parsed.num_attention_heads}", parsed.hidden_size)
        if parsed.position_buckets > 0 and parsed.relative_positions() - 1 <= parsed.position_buckets // 2:
            refuse(
                "max_relative_positions",
                f"> position_buckets // 2 + 1 = {parsed.position_buckets // 2 + 1} (resolved: max_position_embeddings "
                "when < 1)",
                parsed.max_relative_positions,
            )
        return parsed

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict; the fields are HF's names). id2label (HF's num_labels is its
        length, 2 without one) is written only where hf_config's does not already give num_labels."""
        out = {
            "model_type": "deberta-v2",
            "architectures": ["DebertaV2Model"],
            "hidden_act": "gelu",
            "pooler_hidden_act": "gelu",
            "pooler_hidden_size": self.hidden_size,
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare},
            "pos_att_type": list(self.pos_att_type),
        }
        del out["num_labels"]
        if self.cls_dropout is None:  # HF's config has no such key unless given
            del out["cls_dropout"]
        labels = (self.hf_config or {}).get("id2label")
        if len(labels) != self.num_labels if isinstance(labels, Mapping) else self.num_labels != 2:
            out["id2label"] = {str(i): f"LABEL_{i}" for i in range(self.num_labels)}
            out["label2id"] = {f"LABEL_{i}": i for i in range(self.num_labels)}
        return out

    def relative_positions(self) -> int:
        """max_relative_positions as HF resolves it: max_position_embeddings when < 1."""
        return self.max_relative_positions if self.max_relative_positions >= 1 else self.max_position_embeddings

    def span(self) -> int:
        """Half the rows of the relative embeddings: position_buckets, or the resolved max_relative_positions."""
        return self.position_buckets if self.position_buckets > 0 else self.relative_positions()

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
            "R": 2 * self.span(),
            "C": self.num_labels,
        }


class DebertaV2Embeddings(nn.Module):
    config: DebertaV2Config
    dtype: Any = None
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, input_ids, token_type_ids, position_ids, mask, *, deterministic: bool):
        c = self.config
        embed = functools.partial(nn.Embed, features=c.hidden_size, dtype=self.dtype, param_dtype=self.param_dtype)
        x = embed(c.vocab_size, name="word_embeddings")(input_ids)
        if c.pad_token_id is not None:  # torch's Embedding(padding_idx): that row never receives a gradient
            x = jnp.where((input_ids == c.pad_token_id)[..., None], jax.lax.stop_gradient(x), x)
        if c.position_biased_input:  # HF's summation order: positions, then token types
            x = x + embed(c.max_position_embeddings, name="position_embeddings")(position_ids)
        if c.type_vocab_size > 0:
            x = x + embed(c.type_vocab_size, name="token_type_embeddings")(token_type_ids)
        x = _norms.layer_norm(c.layer_norm_eps, self.dtype, self.param_dtype, "LayerNorm")(x)
        if mask is not None:  # HF zeroes the padded tokens' embeddings
            x = x * (jnp.asarray(mask) != 0)[..., None].astype(x.dtype)
        return nn.Dropout(c.hidden_dropout_prob)(x, deterministic=deterministic)


class DebertaV2Layer(nn.Module):
    """One post-LayerNorm block on disentangled attention; returns (block output, attention output)."""

    config: DebertaV2Config
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None

    @nn.compact
    def __call__(self, x, rel_embeddings, mask, *, deterministic: bool):
        c = self.config
        dense = functools.partial(nn.Dense, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision)
        norm = functools.partial(_norms.layer_norm, c.layer_norm_eps, self.dtype, self.param_dtype)
        dropout = nn.Dropout(c.hidden_dropout_prob, deterministic=deterministic)
        attention = DisentangledAttention(
            num_heads=c.num_attention_heads,
            max_relative_positions=c.relative_positions(),
            position_buckets=c.position_buckets,
            pos_att_type=c.pos_att_type,
            share_att_key=c.share_att_key,
            dropout_rate=c.attention_probs_dropout_prob,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=self.precision,
            implementation=c.implementation,
            name="attention",
        )
        rel = dropout(rel_embeddings)  # HF's pos_dropout, in every layer
        y = attention(x, rel_embeddings=rel, mask=mask, deterministic=deterministic)
        a = norm("attention_norm")(x + dropout(y))
        h = nn.gelu(dense(c.intermediate_size, name="intermediate")(a), approximate=False)
        out = norm("output_norm")(a + dropout(dense(c.hidden_size, name="output")(h)))
        return out, a


class DebertaV2Model(nn.Module):
    """HF DebertaV2Model. Call with input_ids [B...,T] (int), attention_mask [B...,T] (1 = token).

    Returns a dict: last_hidden_state [B...,T,E], hidden_states (embeddings, then each layer's output). Sows
    "embeddings", "layer{i}.attention" (after its LayerNorm) and "layer{i}.residual" in "intermediates".
    """

    config: DebertaV2Config
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
        c = self.config
        input_ids = jnp.asarray(input_ids)
        T = input_ids.shape[-1]
        token_type_ids = jnp.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        position_ids = jnp.broadcast_to(jnp.arange(T), input_ids.shape) if position_ids is None else position_ids
        mask = _masks.key_mask(attention_mask)  # [B...,1,1,S]: keys only (a padded query's row means nothing)
        x = DebertaV2Embeddings(c, self.dtype, self.param_dtype, name="embed")(
            input_ids, token_type_ids, position_ids, attention_mask, deterministic=deterministic
        )
        self.sow("intermediates", "embeddings", x)
        rel = self.param(
            "rel_embeddings", nn.initializers.normal(0.02), (2 * c.span(), c.hidden_size), self.param_dtype
        )
        if c.norm_rel_ebd == "layer_norm":
            rel = _norms.layer_norm(c.layer_norm_eps, self.dtype, self.param_dtype, "rel_embeddings_norm")(rel)
        hidden_states = [x]
        for i in range(c.num_hidden_layers):
            x = _activation_layout.constrain(self.sharding, x, "BTE")  # on a mesh: batch over "data" between layers
            x, a = DebertaV2Layer(c, self.dtype, self.param_dtype, self.precision, name=f"layer_{i}")(
                x, rel, mask, deterministic=deterministic
            )
            self.sow("intermediates", f"layer{i}.attention", a)
            self.sow("intermediates", f"layer{i}.residual", x)
            hidden_states.append(x)
        return {"last_hidden_state": x, "hidden_states": tuple(hidden_states)}


class _WithEncoder(nn.Module):
    """A head over DebertaV2Model ("deberta", HF's base_model_prefix)."""

    config: DebertaV2Config
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    sharding: Any = None

    def encoder(self) -> DebertaV2Model:
        return DebertaV2Model(self.config, self.dtype, self.param_dtype, self.precision, self.sharding, name="deberta")

    def dense(self, features: int, name: str) -> nn.Dense:
        return nn.Dense(features, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision, name=name)


class DebertaV2ForMaskedLM(_WithEncoder):
    """HF DebertaV2ForMaskedLM: input_ids [B...,T] (and DebertaV2Model's keywords) -> logits [B...,T,V] =
    LayerNorm(gelu(dense(x))) @ word_embeddings.T + bias. Both of HF's heads compute this (config.legacy only
    names the weights): legacy's cls.predictions.decoder is the word embeddings and cls.predictions.bias, tied."""

    @nn.compact
    def __call__(
        self,
        input_ids: Int[ArrayLike, "*B T"],
        attention_mask: Int[ArrayLike, "*B T"] | Bool[ArrayLike, "*B T"] | None = None,
        token_type_ids: Int[ArrayLike, "*B T"] | None = None,
        position_ids: Int[ArrayLike, "*B T"] | None = None,
        *,
        deterministic: bool = True,
    ) -> Float[Array, "*B T V"]:
        c = self.config
        base = self.encoder()
        x = base(input_ids, attention_mask, token_type_ids, position_ids, deterministic=deterministic)
        x = nn.gelu(self.dense(c.hidden_size, "lm_dense")(x["last_hidden_state"]), approximate=False)
        x = _norms.layer_norm(c.layer_norm_eps, self.dtype, self.param_dtype, "lm_norm")(x)
        embedding = base.variables["params"]["embed"]["word_embeddings"]["embedding"]
        bias = self.param("lm_bias", nn.initializers.zeros, (c.vocab_size,), self.param_dtype)
        logits = tied_logits(x, embedding, self.dtype, self.precision)
        return logits + bias.astype(logits.dtype)


class DebertaV2ForSequenceClassification(_WithEncoder):
    """HF DebertaV2ForSequenceClassification: input_ids [B...,T] -> logits [B...,C] from the first token
    (ContextPooler: dropout, dense, gelu; then dropout and the classifier)."""

    @nn.compact
    def __call__(
        self,
        input_ids: Int[ArrayLike, "*B T"],
        attention_mask: Int[ArrayLike, "*B T"] | Bool[ArrayLike, "*B T"] | None = None,
        token_type_ids: Int[ArrayLike, "*B T"] | None = None,
        position_ids: Int[ArrayLike, "*B T"] | None = None,
        *,
        deterministic: bool = True,
    ) -> Float[Array, "*B C"]:
        c = self.config
        x = self.encoder()(input_ids, attention_mask, token_type_ids, position_ids, deterministic=deterministic)
        first = nn.Dropout(c.pooler_dropout)(x["last_hidden_state"][..., 0, :], deterministic=deterministic)
        pooled = nn.gelu(self.dense(c.hidden_size, "pooler")(first), approximate=False)
        rate = c.hidden_dropout_prob if c.cls_dropout is None else c.cls_dropout
        pooled = nn.Dropout(rate)(pooled, deterministic=deterministic)
        return self.dense(c.num_labels, "classifier")(pooled)


HEADS = {
    "model": DebertaV2Model,
    "masked_lm": DebertaV2ForMaskedLM,
    "classification": DebertaV2ForSequenceClassification,
}
_ARCHITECTURES = {
    DebertaV2Model: "DebertaV2Model",
    DebertaV2ForMaskedLM: "DebertaV2ForMaskedLM",
    DebertaV2ForSequenceClassification: "DebertaV2ForSequenceClassification",
}


# --- weights: one row per tensor (see jaxattn.models.weights) ---------------------------------------------------


def _linear(name: str, path: str, out_letters: tuple[str, ...], in_letter: str = "E") -> list[weights.Row]:
    """A torch Linear [prod(out), in] as a Dense kernel [in, *out] and bias [*out] (reshaped when out is N, H)."""
    R = weights.row
    flat = "*".join(out_letters)
    split = len(out_letters) > 1
    return [
        R(
            f"{name}.weight",
            (flat, in_letter),
            f"{path}/kernel",
            (in_letter, *out_letters),
            Steps(Transpose(), Reshape()) if split else Transpose(),
        ),
        R(f"{name}.bias", (flat,), f"{path}/bias", out_letters, Reshape() if split else weights.Copy()),
    ]


def _layer_norm(name: str, path: str, letter: str = "E") -> list[weights.Row]:
    R = weights.row
    return [
        R(f"{name}.weight", (letter,), f"{path}/scale", (letter,)),
        R(f"{name}.bias", (letter,), f"{path}/bias", (letter,)),
    ]


def weight_table(config: DebertaV2Config, head: str = "model") -> list[weights.Row]:
    """HF's names -> our params for DebertaV2Model (head "model": no prefix) or a head ("masked_lm",
    "classification": the encoder under "deberta." / "deberta/")."""
    if head not in HEADS:
        raise ValueError(f"head: expected one of {list(HEADS)}, got {head!r}")
    R = weights.row
    c = config
    p = "" if head == "model" else "deberta/"
    layer = "encoder.layer.{i}"
    own = {"c2p": ("pos_key_proj", "pos_key"), "p2c": ("pos_query_proj", "pos_query")}
    position_rows = [
        row
        for term in c.pos_att_type
        if not c.share_att_key
        for row in _linear(
            f"{layer}.attention.self.{own[term][0]}", f"{p}layer_{{i}}/attention/{own[term][1]}", ("N", "H")
        )
    ]
    rows = [
        R("embeddings.word_embeddings.weight", ("V", "E"), f"{p}embed/word_embeddings/embedding", ("V", "E")),
        *weights.when(
            c.position_biased_input,
            R(
                "embeddings.position_embeddings.weight",
                ("P", "E"),
                f"{p}embed/position_embeddings/embedding",
                ("P", "E"),
            ),
        ),
        *weights.when(
            c.type_vocab_size > 0,
            R(
                "embeddings.token_type_embeddings.weight",
                ("Y", "E"),
                f"{p}embed/token_type_embeddings/embedding",
                ("Y", "E"),
            ),
        ),
        *_layer_norm("embeddings.LayerNorm", f"{p}embed/LayerNorm"),
        *_linear(f"{layer}.attention.self.query_proj", f"{p}layer_{{i}}/attention/query", ("N", "H")),
        *_linear(f"{layer}.attention.self.key_proj", f"{p}layer_{{i}}/attention/key", ("N", "H")),
        *_linear(f"{layer}.attention.self.value_proj", f"{p}layer_{{i}}/attention/value", ("N", "H")),
        *position_rows,
        R(
            f"{layer}.attention.output.dense.weight",
            ("E", "N*H"),
            f"{p}layer_{{i}}/attention/out/kernel",
            ("N", "H", "E"),
            Steps(Transpose(), Reshape()),
        ),
        R(f"{layer}.attention.output.dense.bias", ("E",), f"{p}layer_{{i}}/attention/out/bias", ("E",)),
        *_layer_norm(f"{layer}.attention.output.LayerNorm", f"{p}layer_{{i}}/attention_norm"),
        *_linear(f"{layer}.intermediate.dense", f"{p}layer_{{i}}/intermediate", ("F",)),
        *_linear(f"{layer}.output.dense", f"{p}layer_{{i}}/output", ("E",), "F"),
        *_layer_norm(f"{layer}.output.LayerNorm", f"{p}layer_{{i}}/output_norm"),
        R("encoder.rel_embeddings.weight", ("R", "E"), f"{p}rel_embeddings", ("R", "E")),
        *weights.when(c.norm_rel_ebd == "layer_norm", *_layer_norm("encoder.LayerNorm", f"{p}rel_embeddings_norm")),
    ]
    rows = weights.expand(rows, c.num_hidden_layers)
    if head == "model":
        return rows
    rows = weights.prefixed(rows, "deberta.")
    if head == "masked_lm" and c.legacy:  # its tied decoder is stored, if at all, as copies (see _tied_copies)
        return [
            *rows,
            *_linear("cls.predictions.transform.dense", "lm_dense", ("E",)),
            *_layer_norm("cls.predictions.transform.LayerNorm", "lm_norm"),
            R("cls.predictions.bias", ("V",), "lm_bias", ("V",)),
        ]
    if head == "masked_lm":
        return [
            *rows,
            *_linear("lm_predictions.lm_head.dense", "lm_dense", ("E",)),
            *_layer_norm("lm_predictions.lm_head.LayerNorm", "lm_norm"),
            R("lm_predictions.lm_head.bias", ("V",), "lm_bias", ("V",)),
        ]
    return [*rows, *_linear("pooler.dense", "pooler", ("E",)), *_linear("classifier", "classifier", ("C",))]


# the masked LM's names by config.legacy
_MLM_PREFIX = {False: "lm_predictions.", True: "cls.predictions."}


def _head_of(tensors) -> str:
    """The head a checkpoint holds, by its names: lm_predictions or cls.predictions (masked LM), classifier, or
    none."""
    if any(name.startswith(tuple(_MLM_PREFIX.values())) for name in tensors):
        return "masked_lm"
    if "classifier.weight" in tensors:
        return "classification"
    return "model"


def _check_tied(config: Mapping[str, Any], head: str, legacy: bool, source) -> None:
    """The legacy head's decoder is ours only when transformers ties it (to the word embeddings, its bias to
    cls.predictions.bias): with tie_word_embeddings false it is a Linear of its own, not ported."""
    if head == "masked_lm" and legacy and not config.get("tie_word_embeddings", True):
        _pretrained.refuse(
            source,
            "tie_word_embeddings",
            "true (the legacy head's decoder tied to the word embeddings; an untied one is not ported)",
            config["tie_word_embeddings"],
        )


def _tied_copies(tensors, files, config: DebertaV2Config, head: str, source) -> list[str]:
    """The legacy head's decoder weight and bias where a checkpoint stores them (torch's state_dict and .bin
    files hold every tied name; save_pretrained's safetensors drop them): checked to be copies, then skipped."""
    if head != "masked_lm" or not config.legacy:
        return []
    decoder = {
        "cls.predictions.decoder.weight": "deberta.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias",
    }
    return [
        name
        for copy, original in decoder.items()
        for name in _decoder.tied_copy(tensors, files, source, tied=True, embedding=original, head=copy)
    ]


def _fill(tensors, files, config: DebertaV2Config, head: str, dtype, source="config") -> dict:
    """The params the table describes; torch's position_ids buffer, which older checkpoints hold, is checked to
    be the default arange(P) and skipped, as are the copies of the legacy head's tied decoder. With
    position_biased_input false a position table some DeBERTa-v3 checkpoints still hold is read by no layer:
    transformers skips it on load (DebertaV2PreTrainedModel's _keys_to_ignore_on_load_unexpected) and so does
    this port; its shape is checked all the same."""
    prefix = "" if head == "model" else "deberta."
    buffer, unused = prefix + "embeddings.position_ids", prefix + "embeddings.position_embeddings.weight"
    if buffer in tensors and not np.array_equal(tensors[buffer], np.arange(config.max_position_embeddings)[None]):
        raise ValueError(f"{files[buffer]}: {buffer!r}: expected the default buffer arange(P), got other values")
    ignored = (buffer, *_tied_copies(tensors, files, config, head, source))
    if head == "masked_lm":  # DeBERTa-v3's released files also hold the replaced-token-detection head of its
        # ELECTRA-style pretraining, which transformers has no module for: HF's ForMaskedLM skips it
        # (_keys_to_ignore_on_load_unexpected), and so does this port
        ignored += tuple(name for name in tensors if name.startswith("mask_predictions."))
    if not config.position_biased_input:
        if unused in tensors and tuple(np.shape(tensors[unused])) != (
            config.max_position_embeddings,
            config.hidden_size,
        ):
            raise ValueError(
                f"{files[unused]}: {unused!r}: expected shape [{config.max_position_embeddings},{config.hidden_size}] "
                f"[P,E] (unused: position_biased_input is false), got shape {list(np.shape(tensors[unused]))}"
            )
        ignored += (unused,)
    return weights.fill(tensors, weight_table(config, head), config.dims(), files, dtype=dtype, ignored=ignored)


def params_from_state_dict(
    state_dict: Mapping[str, Any], config: DebertaV2Config, *, head: str = "model", dtype: Optional[Any] = None
) -> dict:
    """A HF DebertaV2Model / ForMaskedLM / ForSequenceClassification state_dict ({name: array}) -> our params,
    by the table above (`head` as weight_table's). Every transform is a permutation: gradients map the same way."""
    tensors = {name: np.asarray(value) for name, value in state_dict.items()}
    return _fill(tensors, {name: "state_dict" for name in tensors}, config, head, dtype)


def init_params(config: DebertaV2Config, rng=None, head: str = "model", **model_options) -> dict:
    """Fresh random params (for tests / training from scratch), shapes as the table's."""
    rng = jax.random.key(0) if rng is None else rng
    return HEADS[head](config, **model_options).init(rng, jnp.zeros((1, 2), jnp.int32))["params"]


# --- from_pretrained / to_pretrained --------------------------------------------------------------------------


@_pretrained.register_family("deberta-v2")
@_pretrained.loads(DebertaV2Config, DebertaV2Model)
def load_pretrained(config: dict, tensors, files, *, dtype, precision, source):
    """(model, params) from a DebertaV2Model checkpoint, or a ForMaskedLM (lm_predictions.* with legacy false,
    cls.predictions.* with legacy true) or ForSequenceClassification (pooler.* and classifier.*) one, whose
    encoder is under "deberta."."""
    deberta_config = DebertaV2Config.from_dict(config, source)
    head = _head_of(tensors)
    legacy = deberta_config.legacy
    if head == "masked_lm" and not any(name.startswith(_MLM_PREFIX[legacy]) for name in tensors):
        # the names of the other head: HF would build the config's head and leave it random
        expected = {
            False: "true (the checkpoint holds cls.predictions, which HF reads only then)",
            True: "false (the checkpoint holds lm_predictions, which HF reads only then; DeBERTa-v3's released "
            'config.json predates the key and transformers defaults it to true: add "legacy": false)',
        }
        _pretrained.refuse(source, "legacy", expected[legacy], legacy)
    _check_tied(config, head, legacy, source)
    params = _fill(tensors, files, deberta_config, head, dtype, source)
    return HEADS[head](deberta_config, precision=precision), params


def _writer(model):
    """What to_pretrained writes: the model's HF names and its architecture."""
    head = next(name for name, cls in HEADS.items() if isinstance(model, cls))
    config = _save.config_json(model.config)  # "legacy" included: the head's names follow it
    config["architectures"] = [_ARCHITECTURES[type(model)]]
    _check_tied(config, head, model.config.legacy, "model.config")
    return config, weight_table(model.config, head), model.config.dims()


for _model_class in HEADS.values():
    _save.register_writer(_model_class)(_writer)
