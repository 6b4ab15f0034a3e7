"""T5 (Raffel et al. 2020) in Flax linen, on jaxattn.linen.MultiHeadAttention: HF's T5ForConditionalGeneration.

    encoder block:  x = x + SelfAttention(RMSNorm(x); bias = table_enc[bucket(j - i)], bidirectional)
                    x = x + FF(RMSNorm(x))
    decoder block:  x = x + SelfAttention(RMSNorm(x); causal, bias = table_dec[bucket(j - i)], one-sided)
                    x = x + CrossAttention(RMSNorm(x), encoder output; no position bias)
                    x = x + FF(RMSNorm(x))
    logits = RMSNorm(x) [* d_model^-0.5 when scale_decoder_outputs] @ shared.T

Attention logits are not scaled (scale = 1): T5 folds 1/sqrt(d) into its initialisation. Each stack has ONE
relative table (HF stores it in block 0) shared by all its layers (jaxattn.t5_position_bias). FF is
relu (T5) or gated (T5 v1.1 / flan: act(x Wi_0) * (x Wi_1)). RMSNorm: x * rsqrt(mean(x^2) + eps) * w.

    model.apply({"params": p}, input_ids, attention_mask, decoder_input_ids=...) -> logits [B,Td,V]
    jaxattn.models.generate(model, p, input_ids, ...) -> [B, 1 + new]: decoder_start_token_id, then greedy
        tokens (as transformers' generate returns for encoder-decoder models)

    V vocab  E d_model  N heads  H d_kv  F d_ff  R buckets
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .. import t5_position_bias
from ..linen import MultiHeadAttention
from . import _activation_layout, _decoder, _masks, _norms, _pretrained, _save, weights
from .weights import Reshape, Steps, Transpose

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Bool, Float, Int

_ACTIVATIONS = {
    "relu": nn.relu,
    "gelu_new": functools.partial(nn.gelu, approximate=True),
    "gelu": functools.partial(nn.gelu, approximate=False),
    "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
}


@dataclasses.dataclass(frozen=True)
class T5Config:
    vocab_size: int = 32128
    d_model: int = 512
    d_kv: int = 64
    d_ff: int = 2048
    num_layers: int = 6
    num_decoder_layers: int | None = None
    num_heads: int = 8
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    dense_act_fn: str = "relu"
    is_gated_act: bool = False
    scale_decoder_outputs: bool = True
    decoder_start_token_id: int = 0
    # every attention call's implementation= (jaxattn.dot_product_attention; None: per platform); not in config.json
    implementation: str | None = dataclasses.field(default=None, compare=False)
    hf_config: Any = dataclasses.field(default=None, compare=False, repr=False)  # the config.json dict read

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> T5Config:
        """From a HF config.json dict (transformers >= 5 fields; feed_forward_proj read as transformers does)."""
        refuse = functools.partial(_pretrained.refuse, source)
        config = dict(config)
        proj = config.get("feed_forward_proj", "relu").split("-")
        if len(proj) > 2 or len(proj) == 2 and proj[0] != "gated":
            refuse("feed_forward_proj", "'ACT' or 'gated-ACT'", config["feed_forward_proj"])
        config.setdefault("is_gated_act", proj[0] == "gated")
        config.setdefault("dense_act_fn", "gelu_new" if config.get("feed_forward_proj") == "gated-gelu" else proj[-1])
        config.setdefault("scale_decoder_outputs", config.get("tie_word_embeddings", True) is not False)
        if config["dense_act_fn"] not in _ACTIVATIONS:
            refuse("dense_act_fn", f"one of {sorted(_ACTIVATIONS)}", config["dense_act_fn"])
        if config.get("decoder_start_token_id") is None:
            config["decoder_start_token_id"] = config.get("pad_token_id", 0)
        if config.get("is_decoder", False):
            refuse("is_decoder", "false (the encoder-decoder T5ForConditionalGeneration)", config["is_decoder"])
        fields = {f.name for f in dataclasses.fields(cls) if f.compare}
        return cls(**{k: v for k, v in config.items() if k in fields})

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict). feed_forward_proj as HF names it ("gated-gelu" for the
        gated gelu_new); dense_act_fn and is_gated_act are written too, and both readers take them over it."""
        act = "gelu" if self.is_gated_act and self.dense_act_fn == "gelu_new" else self.dense_act_fn
        return {
            "model_type": "t5",
            "architectures": ["T5ForConditionalGeneration"],
            "feed_forward_proj": f"gated-{act}" if self.is_gated_act else act,
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare},
        }

    @property
    def decoder_layers(self) -> int:
        return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers

    def dims(self) -> dict[str, int]:
        return {
            "V": self.vocab_size,
            "E": self.d_model,
            "N": self.num_heads,
            "H": self.d_kv,
            "F": self.d_ff,
            "R": self.relative_attention_num_buckets,
        }


class T5FeedForward(_decoder.Configured):
    @nn.compact
    def __call__(self, x):
        c, act = self.config, _ACTIVATIONS[self.config.dense_act_fn]
        dense = functools.partial(
            nn.Dense, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision
        )
        if c.is_gated_act:
            h = act(dense(c.d_ff, name="wi_0")(x)) * dense(c.d_ff, name="wi_1")(x)
        else:
            h = act(dense(c.d_ff, name="wi")(x))
        return dense(c.d_model, name="wo")(h)


class T5Block(_decoder.Configured):
    """One block; returns (residual stream, {row name: sub-layer output})."""

    is_decoder: bool = False

    @nn.compact
    def __call__(self, x, self_mask, self_bias, encoder=None, encoder_mask=None, decode: bool = False):
        c = self.config
        norm = functools.partial(_norms.RMSNorm, c.layer_norm_epsilon, self.param_dtype, "t5")
        attention = functools.partial(
            MultiHeadAttention,
            num_heads=c.num_heads,
            head_dim=c.d_kv,
            use_bias=False,
            scale=1.0,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=self.precision,
            implementation=c.implementation,
        )
        a = attention(name="self_attention")(
            norm(name="self_attention_norm")(x),
            mask=self_mask,
            position_bias=self_bias,
            is_causal=self.is_decoder,
            decode=decode,
        )
        x = x + a
        rows = {"attention": a}
        if self.is_decoder:
            h = attention(name="cross_attention")(norm(name="cross_attention_norm")(x), encoder, mask=encoder_mask)
            x = x + h
            rows["cross_attention"] = h
        m = T5FeedForward(c, self.dtype, self.param_dtype, self.precision, name="ff")(norm(name="ff_norm")(x))
        rows["mlp"] = m
        return x + m, rows


class T5Stack(_decoder.Configured):
    """The encoder or the decoder: blocks sharing one relative table, then the final RMSNorm."""

    is_decoder: bool = False

    @nn.compact
    def __call__(self, x, attention_mask=None, encoder=None, encoder_mask=None, *, decode: bool = False):
        c = self.config
        table = self.param(
            "relative_attention_bias",
            nn.initializers.normal(c.d_model**-0.5),
            (c.relative_attention_num_buckets, c.num_heads),
            self.param_dtype,
        )
        # The bias as a hook of the positions (never an [N,T,S] array here): the attention evaluates it at its
        # own positions (bottom-right; when decoding, the cache's: queries at their slots, keys at theirs),
        # one tile at a time on the blockwise engine and inside the GPU kernel.
        bias = t5_position_bias(
            table.astype(x.dtype), bidirectional=not self.is_decoder, max_distance=c.relative_attention_max_distance
        )
        mask = _masks.key_mask(attention_mask)

        def layer(i, x):
            block = T5Block(
                c, self.dtype, self.param_dtype, self.precision, is_decoder=self.is_decoder, name=f"block_{i}"
            )
            return block(x, mask, bias, encoder, encoder_mask, decode)

        norm = _norms.RMSNorm(c.layer_norm_epsilon, self.param_dtype, "t5", name="final_layer_norm")
        return _decoder.layer_stack(self, layer, c.decoder_layers if self.is_decoder else c.num_layers, norm, x)


class T5ForConditionalGeneration(_decoder.Configured):
    """HF T5ForConditionalGeneration. Sows "intermediates" under "encoder" and "decoder"."""

    tie_lm_head: bool = True

    is_encoder_decoder = True  # generate() decodes from decoder_start_token_id (not a dataclass field)

    def setup(self):
        c = self.config
        self.shared = nn.Embed(c.vocab_size, c.d_model, dtype=self.dtype, param_dtype=self.param_dtype)
        stack = functools.partial(
            T5Stack, c, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision, sharding=self.sharding
        )
        self.encoder = stack(is_decoder=False)
        self.decoder = stack(is_decoder=True)
        if not self.tie_lm_head:
            self.lm_head = nn.Dense(
                c.vocab_size, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision
            )

    def encode(self, input_ids, attention_mask=None):
        """input_ids [B,T] -> the encoder's output [B,T,E]."""
        return self.encoder(self.shared(jnp.asarray(input_ids)), attention_mask)

    def decode(
        self,
        decoder_input_ids,
        encoder_output,
        attention_mask=None,
        decoder_attention_mask=None,
        decoder_position_ids=None,
        *,
        decode: bool = False,
    ):
        """Decoder tokens [B,Td] over the encoder output -> logits [B,Td,V].

        decode=True: append to the decoder's cache; decoder_attention_mask [B,L] then covers its L slots
        (required: it tells the relative bias how many slots there are).
        """
        decoder_input_ids = jnp.asarray(decoder_input_ids)
        if decoder_position_ids is not None:
            # T5 has no position ids (HF's T5 takes none): its relative bias reads the tokens' slots
            raise ValueError("decoder_position_ids: expected None (T5's bias reads the token slots), got an array")
        if decode and decoder_attention_mask is None:
            raise ValueError("decoder_attention_mask: expected [B,L] over the cache's L slots when decoding, got None")
        x = self.decoder(
            self.shared(decoder_input_ids),
            decoder_attention_mask,
            encoder_output,
            _masks.key_mask(attention_mask),
            decode=decode,
        )
        if self.config.scale_decoder_outputs:
            x = x * self.config.d_model**-0.5
        if self.tie_lm_head:
            return _decoder.tied_logits(x, self.shared.embedding, self.dtype, self.precision)
        return self.lm_head(x)

    def __call__(
        self,
        input_ids: Int[ArrayLike, "B T"],
        attention_mask: Int[ArrayLike, "B T"] | Bool[ArrayLike, "B T"] | None = None,
        decoder_input_ids: Int[ArrayLike, "B Td"] | None = None,
        decoder_attention_mask: Int[ArrayLike, "B Td"] | Bool[ArrayLike, "B Td"] | None = None,
    ) -> Float[Array, "B Td V"]:
        if decoder_input_ids is None:
            raise ValueError("decoder_input_ids: expected int [B,Td] (T5 is an encoder-decoder), got None")
        encoder_output = self.encode(input_ids, attention_mask)
        return self.decode(decoder_input_ids, encoder_output, attention_mask, decoder_attention_mask)

    def generate(self, params, input_ids, attention_mask, max_new_tokens: int, stopping=None):
        """Greedy decoding (called by jaxattn.models.generate): [B, 1 + n], n <= max_new_tokens.

        stopping: a jaxattn.models._generate.Stopping (eos/pad rule), or None (exactly max_new_tokens)."""
        B = input_ids.shape[0]
        L = max_new_tokens + 1
        place = functools.partial(_activation_layout.place, self, layout="BT")  # on a mesh: batch over "data"
        attention_mask = place(attention_mask)
        encoder_output = _encode(self, params, place(input_ids), attention_mask)
        start = np.full((B, 1), self.config.decoder_start_token_id, input_ids.dtype)
        slots = place(np.ones((B, L), np.int32))
        cache = _decoder.empty_cache(
            self, params, np.zeros((B, L), np.int32), encoder_output, attention_mask, slots, method=self.decode
        )
        token, new = start, [start]
        for _ in range(max_new_tokens):
            if stopping is not None and stopping.done:
                break
            token, cache = _decode_step(self, params, cache, place(token), encoder_output, attention_mask, slots)
            token = np.asarray(token if stopping is None else stopping(token))[:, None]
            new.append(token)
        return np.concatenate(new, -1)


@functools.partial(jax.jit, static_argnums=0)
def _encode(model, params, input_ids, attention_mask):
    return model.apply({"params": params}, input_ids, attention_mask, method=model.encode)


@functools.partial(jax.jit, static_argnums=0)
def _decode_step(model, params, cache, token, encoder_output, attention_mask, slots):
    logits, variables = model.apply(
        {"params": params, "cache": cache},
        token,
        encoder_output,
        attention_mask,
        slots,
        decode=True,
        method=model.decode,
        mutable=["cache"],
    )
    token = jnp.argmax(logits[:, -1], -1).astype(token.dtype)
    return _activation_layout.decode_outputs(model, token, variables["cache"])


# --- weights --------------------------------------------------------------------------------------------------


def weight_table(config: T5Config, *, lm_head: bool) -> list[weights.Row]:
    """HF's names -> our params. Each stack keeps its one relative table in block 0; a decoder block's
    cross-attention (layer.1) comes before its FF (layer.2)."""
    R, gated = weights.row, config.is_gated_act
    encoder = weights.expand(
        [
            R(
                "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                ("R", "N"),
                "encoder/relative_attention_bias",
                ("R", "N"),
            ),
            R(
                "encoder.block.{i}.layer.0.SelfAttention.q.weight",
                ("N*H", "E"),
                "encoder/block_{i}/self_attention/query/kernel",
                ("E", "N", "H"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "encoder.block.{i}.layer.0.SelfAttention.k.weight",
                ("N*H", "E"),
                "encoder/block_{i}/self_attention/key/kernel",
                ("E", "N", "H"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "encoder.block.{i}.layer.0.SelfAttention.v.weight",
                ("N*H", "E"),
                "encoder/block_{i}/self_attention/value/kernel",
                ("E", "N", "H"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "encoder.block.{i}.layer.0.SelfAttention.o.weight",
                ("E", "N*H"),
                "encoder/block_{i}/self_attention/out/kernel",
                ("N", "H", "E"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "encoder.block.{i}.layer.0.layer_norm.weight",
                ("E",),
                "encoder/block_{i}/self_attention_norm/weight",
                ("E",),
            ),
            *weights.when(
                gated,
                R(
                    "encoder.block.{i}.layer.1.DenseReluDense.wi_0.weight",
                    ("F", "E"),
                    "encoder/block_{i}/ff/wi_0/kernel",
                    ("E", "F"),
                    Transpose(),
                ),
                R(
                    "encoder.block.{i}.layer.1.DenseReluDense.wi_1.weight",
                    ("F", "E"),
                    "encoder/block_{i}/ff/wi_1/kernel",
                    ("E", "F"),
                    Transpose(),
                ),
            ),
            *weights.when(
                not gated,
                R(
                    "encoder.block.{i}.layer.1.DenseReluDense.wi.weight",
                    ("F", "E"),
                    "encoder/block_{i}/ff/wi/kernel",
                    ("E", "F"),
                    Transpose(),
                ),
            ),
            R(
                "encoder.block.{i}.layer.1.DenseReluDense.wo.weight",
                ("E", "F"),
                "encoder/block_{i}/ff/wo/kernel",
                ("F", "E"),
                Transpose(),
            ),
            R("encoder.block.{i}.layer.1.layer_norm.weight", ("E",), "encoder/block_{i}/ff_norm/weight", ("E",)),
            R("encoder.final_layer_norm.weight", ("E",), "encoder/final_layer_norm/weight", ("E",)),
        ],
        config.num_layers,
    )
    decoder = weights.expand(
        [
            R(
                "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                ("R", "N"),
                "decoder/relative_attention_bias",
                ("R", "N"),
            ),
            R(
                "decoder.block.{i}.layer.0.SelfAttention.q.weight",
                ("N*H", "E"),
                "decoder/block_{i}/self_attention/query/kernel",
                ("E", "N", "H"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "decoder.block.{i}.layer.0.SelfAttention.k.weight",
                ("N*H", "E"),
                "decoder/block_{i}/self_attention/key/kernel",
                ("E", "N", "H"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "decoder.block.{i}.layer.0.SelfAttention.v.weight",
                ("N*H", "E"),
                "decoder/block_{i}/self_attention/value/kernel",
                ("E", "N", "H"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "decoder.block.{i}.layer.0.SelfAttention.o.weight",
                ("E", "N*H"),
                "decoder/block_{i}/self_attention/out/kernel",
                ("N", "H", "E"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "decoder.block.{i}.layer.0.layer_norm.weight",
                ("E",),
                "decoder/block_{i}/self_attention_norm/weight",
                ("E",),
            ),
            R(
                "decoder.block.{i}.layer.1.EncDecAttention.q.weight",
                ("N*H", "E"),
                "decoder/block_{i}/cross_attention/query/kernel",
                ("E", "N", "H"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "decoder.block.{i}.layer.1.EncDecAttention.k.weight",
                ("N*H", "E"),
                "decoder/block_{i}/cross_attention/key/kernel",
                ("E", "N", "H"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "decoder.block.{i}.layer.1.EncDecAttention.v.weight",
                ("N*H", "E"),
                "decoder/block_{i}/cross_attention/value/kernel",
                ("E", "N", "H"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "decoder.block.{i}.layer.1.EncDecAttention.o.weight",
                ("E", "N*H"),
                "decoder/block_{i}/cross_attention/out/kernel",
                ("N", "H", "E"),
                Steps(Transpose(), Reshape()),
            ),
            R(
                "decoder.block.{i}.layer.1.layer_norm.weight",
                ("E",),
                "decoder/block_{i}/cross_attention_norm/weight",
                ("E",),
            ),
            *weights.when(
                gated,
                R(
                    "decoder.block.{i}.layer.2.DenseReluDense.wi_0.weight",
                    ("F", "E"),
                    "decoder/block_{i}/ff/wi_0/kernel",
                    ("E", "F"),
                    Transpose(),
                ),
                R(
                    "decoder.block.{i}.layer.2.DenseReluDense.wi_1.weight",
                    ("F", "E"),
                    "decoder/block_{i}/ff/wi_1/kernel",
                    ("E", "F"),
                    Transpose(),
                ),
            ),
            *weights.when(
                not gated,
                R(
                    "decoder.block.{i}.layer.2.DenseReluDense.wi.weight",
                    ("F", "E"),
                    "decoder/block_{i}/ff/wi/kernel",
                    ("E", "F"),
                    Transpose(),
                ),
            ),
            R(
                "decoder.block.{i}.layer.2.DenseReluDense.wo.weight",
                ("E", "F"),
                "decoder/block_{i}/ff/wo/kernel",
                ("F", "E"),
                Transpose(),
            ),
            R("decoder.block.{i}.layer.2.layer_norm.weight", ("E",), "decoder/block_{i}/ff_norm/weight", ("E",)),
            R("decoder.final_layer_norm.weight", ("E",), "decoder/final_layer_norm/weight", ("E",)),
        ],
        config.decoder_layers,
    )
    return [
        R("shared.weight", ("V", "E"), "shared/embedding", ("V", "E")),
        *encoder,
        *decoder,
        *weights.when(lm_head, R("lm_head.weight", ("V", "E"), "lm_head/kernel", ("E", "V"), Transpose())),
    ]


@_pretrained.register_family("t5")
@_pretrained.loads(T5Config, T5ForConditionalGeneration)
def load_pretrained(config: dict, tensors, files, *, dtype, precision, source):
    """(T5ForConditionalGeneration, params). A stored lm_head equal to shared.weight is the tied copy."""
    t5 = T5Config.from_dict(config, source)
    ignored = []
    for copy in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"):
        if copy in tensors and "shared.weight" in tensors and np.array_equal(tensors[copy], tensors["shared.weight"]):
            ignored.append(copy)
    untied = "lm_head.weight" in tensors and "lm_head.weight" not in ignored
    params = weights.fill(tensors, weight_table(t5, lm_head=untied), t5.dims(), files, dtype=dtype, ignored=ignored)
    return T5ForConditionalGeneration(t5, precision=precision, tie_lm_head=not untied), params


@_save.register_writer(T5ForConditionalGeneration)
def checkpoint(model: T5ForConditionalGeneration):
    """What to_pretrained writes: shared once (transformers ties the encoder's and decoder's embed_tokens and,
    unless lm_head.weight is stored with other values, the head to it); an untied head as lm_head.weight."""
    rows = weight_table(model.config, lm_head=not model.tie_lm_head)
    return _save.config_json(model.config), rows, model.config.dims()
