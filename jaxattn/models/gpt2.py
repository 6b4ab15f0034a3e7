"""GPT-2 (Radford et al. 2019) in Flax linen, on jaxattn.linen.MultiHeadAttention: HF's GPT2LMHeadModel.

    x = wte[ids] + wpe[positions]
    each block:  x = x + Attention(LayerNorm_1(x))     causal, keys masked by attention_mask
                 x = x + Dense_E(gelu(Dense_F(LayerNorm_2(x))))
    logits = LayerNorm_f(x) @ wte.T                     (tied; an untied lm_head has its own table row)

Calling convention (and the decode cache): jaxattn/models/_decoder.py. HF's Conv1D stores [in,out]
(already Flax's Dense layout); its fused c_attn [E,3*E] splits into our query/key/value kernels [E,N,H].

    V vocab  P positions  E hidden (= N * H)  N heads  H head dim  F inner (n_inner, default 4E)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax.numpy as jnp

from . import _activation_layout, _decoder, _masks, _norms, _pretrained, _save, weights
from .weights import Part, Reshape, Target, Transpose

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Bool, Float, Int

_ACTIVATIONS = {  # HF's ACT2FN names -> the exact formula
    "gelu_new": functools.partial(nn.gelu, approximate=True),
    "gelu_pytorch_tanh": functools.partial(nn.gelu, approximate=True),
    "gelu": functools.partial(nn.gelu, approximate=False),
    "relu": nn.relu,
}


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_inner: int | None = None
    activation_function: str = "gelu_new"
    layer_norm_epsilon: float = 1e-5
    scale_attn_weights: bool = True
    scale_attn_by_inverse_layer_idx: bool = False
    tie_word_embeddings: bool = True
    # every attention call's implementation= (jaxattn.dot_product_attention; None: per platform); not in config.json
    implementation: str | None = dataclasses.field(default=None, compare=False)
    hf_config: Any = dataclasses.field(default=None, compare=False, repr=False)  # the config.json dict read

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> GPT2Config:
        """From a HF config.json dict; a setting this port does not implement is refused by name."""
        refuse = functools.partial(_pretrained.refuse, source)
        if config.get("activation_function", "gelu_new") not in _ACTIVATIONS:
            refuse("activation_function", f"one of {sorted(_ACTIVATIONS)}", config["activation_function"])
        for key in ("add_cross_attention", "reorder_and_upcast_attn"):
            if config.get(key, False):
                refuse(key, "false", config[key])
        fields = {f.name for f in dataclasses.fields(cls) if f.compare}
        parsed = cls(**{k: v for k, v in config.items() if k in fields})
        if parsed.n_embd % parsed.n_head:
            refuse("n_embd", f"a multiple of n_head={parsed.n_head}", parsed.n_embd)
        return parsed

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict; the fields are HF's names)."""
        return {
            "model_type": "gpt2",
            "architectures": ["GPT2LMHeadModel"],
            "add_cross_attention": False,
            "reorder_and_upcast_attn": False,
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare},
        }

    def dims(self) -> dict[str, int]:
        return {
            "V": self.vocab_size,
            "P": self.n_positions,
            "E": self.n_embd,
            "N": self.n_head,
            "H": self.n_embd // self.n_head,
            "F": self.n_inner or 4 * self.n_embd,
        }


class GPT2Block(_decoder.Configured):
    """One pre-LayerNorm block; returns (residual stream, {"attention": its output, "mlp": its output})."""

    layer: int = 0  # its index: scale_attn_by_inverse_layer_idx divides the logits by layer + 1

    @nn.compact
    def __call__(self, x, mask, decode: bool):
        c, d = self.config, self.config.dims()
        scale = (d["H"] ** -0.5 if c.scale_attn_weights else 1.0) / (
            self.layer + 1 if c.scale_attn_by_inverse_layer_idx else 1
        )
        norm = functools.partial(_norms.layer_norm, c.layer_norm_epsilon, self.dtype, self.param_dtype)
        dense = functools.partial(nn.Dense, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision)
        attention_layer = _activation_layout.attention_class(self.sharding)
        attention = attention_layer(
            num_heads=c.n_head,
            scale=scale,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=self.precision,
            implementation=c.implementation,
            name="attn",
        )
        a = attention(norm("ln_1")(x), mask=mask, is_causal=True, decode=decode)
        x = x + a
        h = _ACTIVATIONS[c.activation_function](dense(d["F"], name="c_fc")(norm("ln_2")(x)))
        m = dense(d["E"], name="c_proj")(h)
        return x + m, {"attention": a, "mlp": m}


class GPT2LMHeadModel(_decoder.Configured):
    """HF GPT2LMHeadModel: input_ids [B,T] -> logits [B,T,V]. Sows "intermediates" (see _decoder.py)."""

    def max_positions(self) -> int | None:
        return self.config.n_positions

    @nn.compact
    def __call__(
        self,
        input_ids: Int[ArrayLike, "B T"],
        attention_mask: Int[ArrayLike, "B _keys"] | Bool[ArrayLike, "B _keys"] | None = None,
        position_ids: Int[ArrayLike, "B T"] | None = None,
        *,
        decode: bool = False,
    ) -> Float[Array, "B T V"]:
        c, d = self.config, self.config.dims()
        input_ids = jnp.asarray(input_ids)
        position_ids = _masks.positions(self, input_ids.shape, position_ids, decode)
        embed = functools.partial(nn.Embed, features=d["E"], dtype=self.dtype, param_dtype=self.param_dtype)
        wte = embed(d["V"], name="wte")
        x = wte(input_ids) + embed(d["P"], name="wpe")(position_ids)
        mask = _masks.key_mask(attention_mask)

        def layer(i, x):
            block = GPT2Block(c, self.dtype, self.param_dtype, self.precision, self.sharding, layer=i, name=f"h_{i}")
            return block(x, mask, decode)

        ln_f = _norms.layer_norm(c.layer_norm_epsilon, self.dtype, self.param_dtype, "ln_f")
        x = _decoder.layer_stack(self, layer, c.n_layer, ln_f, x)
        return _decoder.lm_head(self, x, wte, c.tie_word_embeddings)


# --- weights: one row per HF tensor (names of GPT2LMHeadModel; a bare GPT2Model has no "transformer.") -------


def weight_table(config: GPT2Config, *, prefix: str = "transformer.") -> list[weights.Row]:
    """HF's names (after `prefix`) -> our params. Conv1D stores [in,out], Flax's Dense layout already."""
    R = weights.row
    rows = weights.expand(
        [
            R("wte.weight", ("V", "E"), "wte/embedding", ("V", "E")),
            R("wpe.weight", ("P", "E"), "wpe/embedding", ("P", "E")),
            R("h.{i}.ln_1.weight", ("E",), "h_{i}/ln_1/scale", ("E",)),
            R("h.{i}.ln_1.bias", ("E",), "h_{i}/ln_1/bias", ("E",)),
            weights.Row(
                "h.{i}.attn.c_attn.weight",
                ("E", "3*E"),
                (  # columns q | k | v
                    Target("h_{i}/attn/query/kernel", ("E", "N", "H"), Part(0, 3, 1)),
                    Target("h_{i}/attn/key/kernel", ("E", "N", "H"), Part(1, 3, 1)),
                    Target("h_{i}/attn/value/kernel", ("E", "N", "H"), Part(2, 3, 1)),
                ),
            ),
            weights.Row(
                "h.{i}.attn.c_attn.bias",
                ("3*E",),
                (
                    Target("h_{i}/attn/query/bias", ("N", "H"), Part(0, 3, 0)),
                    Target("h_{i}/attn/key/bias", ("N", "H"), Part(1, 3, 0)),
                    Target("h_{i}/attn/value/bias", ("N", "H"), Part(2, 3, 0)),
                ),
            ),
            R("h.{i}.attn.c_proj.weight", ("N*H", "E"), "h_{i}/attn/out/kernel", ("N", "H", "E"), Reshape()),
            R("h.{i}.attn.c_proj.bias", ("E",), "h_{i}/attn/out/bias", ("E",)),
            R("h.{i}.ln_2.weight", ("E",), "h_{i}/ln_2/scale", ("E",)),
            R("h.{i}.ln_2.bias", ("E",), "h_{i}/ln_2/bias", ("E",)),
            R("h.{i}.mlp.c_fc.weight", ("E", "F"), "h_{i}/c_fc/kernel", ("E", "F")),
            R("h.{i}.mlp.c_fc.bias", ("F",), "h_{i}/c_fc/bias", ("F",)),
            R("h.{i}.mlp.c_proj.weight", ("F", "E"), "h_{i}/c_proj/kernel", ("F", "E")),
            R("h.{i}.mlp.c_proj.bias", ("E",), "h_{i}/c_proj/bias", ("E",)),
            R("ln_f.weight", ("E",), "ln_f/scale", ("E",)),
            R("ln_f.bias", ("E",), "ln_f/bias", ("E",)),
        ],
        config.n_layer,
    )
    # save_pretrained drops a tied head's copy; one that is present must equal wte (see load_pretrained)
    head = weights.when(
        not config.tie_word_embeddings, R("lm_head.weight", ("V", "E"), "lm_head/kernel", ("E", "V"), Transpose())
    )
    return weights.prefixed(rows, prefix) + list(head)


@_pretrained.register_family("gpt2")
@_pretrained.loads(GPT2Config, GPT2LMHeadModel)
def load_pretrained(config: dict, tensors, files, *, dtype, precision, source):
    """(GPT2LMHeadModel, params) from a GPT2LMHeadModel (or bare GPT2Model) checkpoint."""
    gpt2 = GPT2Config.from_dict(config, source)
    prefix = "" if "wte.weight" in tensors else "transformer."
    ignored = [n for n in tensors if n.endswith((".attn.bias", ".attn.masked_bias"))]  # old causal-mask buffers
    ignored += _decoder.tied_copy(
        tensors, files, source, tied=gpt2.tie_word_embeddings, embedding=prefix + "wte.weight"
    )
    params = weights.fill(tensors, weight_table(gpt2, prefix=prefix), gpt2.dims(), files, dtype=dtype, ignored=ignored)
    return GPT2LMHeadModel(gpt2, precision=precision), params


@_save.register_writer(GPT2LMHeadModel)
def checkpoint(model: GPT2LMHeadModel):
    """What to_pretrained writes: GPT2LMHeadModel's names (a tied head once, as wte)."""
    return _save.config_json(model.config), weight_table(model.config), model.config.dims()
