"""The Llama-shaped blocks the families build on (each family sets their hooks):

    self_attention  the causal GQA self-attention "self_attn" (RoPE of the config's layer, biases, window)
    gated_mlp       HF's gate/up/down MLP
    PreNormBlock    Llama's block: norm -> attention -> residual, norm -> MLP -> residual
    SandwichBlock   Gemma's: norms before and after attention and MLP

Their params are what _decoder's causal_lm_rows, qk_norm_rows, sandwich_norm_rows and mlp_rows describe.
Axis letters: _decoder's (V E N K H F).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn

from ..linen import RoPE
from . import _activation_layout
from ._decoder import Configured
from ._norms import RMSNorm


def self_attention(block: PreNormBlock, x, mask, positions, decode: bool, window, **options):
    """The causal self-attention "self_attn" of a Llama-shaped block (in its compact call): GQA, RoPE at the
    frequencies of config.rope(block.layer), the config's biases, the layer's `window` keyword; options: the
    family's extras (scale, logit_softcap, qk_norm, use_sinks, chunk_size; rope: the family's own RoPE, or None
    on a layer without one). Its params are what causal_lm_rows describes.

    A rotary attention factor a (yarn) scales HF's cos and sin, so queries and keys by a each: the logits'
    scale (H ** -0.5 or the family's) by a ** 2 here, the same product in another rounding order."""
    c, d = block.config, block.config.dims()
    frequencies, factor = c.rope(block.layer)
    if factor != 1.0:
        options["scale"] = options.get("scale", d["H"] ** -0.5) * factor**2
    rope = options.pop("rope", RoPE(frequencies=frequencies))  # a family's own RoPE (layout), or None: no RoPE
    attention_layer = _activation_layout.attention_class(block.sharding)
    attention = attention_layer(
        num_heads=d["N"],
        num_kv_heads=d["K"],
        head_dim=d["H"],
        use_bias=c.attention_biases(),
        rope=rope,
        window=window,
        dtype=block.dtype,
        param_dtype=block.param_dtype,
        precision=block.precision,
        implementation=c.implementation,
        name="self_attn",
        **options,
    )
    return attention(x, mask=mask, is_causal=True, rope_positions=None if rope is None else positions, decode=decode)


def gated_mlp(block: Configured, x, activation: Callable, features: int | None = None):
    """HF's gate/up/down MLP, down(act(gate(x)) * up(x)), in `block`'s compact call (mlp_rows: its params);
    features: its intermediate width (default: the config's F)."""
    c, d = block.config, block.config.dims()
    F = d["F"] if features is None else features
    dense = functools.partial(
        nn.Dense, use_bias=c.mlp_bias, dtype=block.dtype, param_dtype=block.param_dtype, precision=block.precision
    )
    h = activation(dense(F, name="gate_proj")(x)) * dense(F, name="up_proj")(x)
    return dense(d["E"], name="down_proj")(h)


class PreNormBlock(Configured):
    """Llama's block, layer `layer` of the stack: returns (residual stream, {"attention": its output, the
    MLP's own rows (a router's logits), "mlp": its output}).

        x = x + self_attn(input_layernorm(x));  x = x + mlp(post_attention_layernorm(x))

    A family's block sets the hooks: attention_options (self_attention's extras) and feed_forward (the MLP:
    -> (output, its own rows))."""

    layer: int = 0

    def attention_options(self) -> dict:
        return {}

    def norm(self) -> Callable[..., RMSNorm]:
        """The factory of the block's RMS norms (the config's epsilon and rounding kind)."""
        return functools.partial(RMSNorm, self.config.rms_norm_eps, self.param_dtype, self.config.rms_norm)

    def feed_forward(self, x):
        return gated_mlp(self, x, nn.silu), {}

    @nn.compact
    def __call__(self, x, mask, positions, decode: bool, window=None):
        norm = self.norm()
        a = self_attention(
            self, norm(name="input_layernorm")(x), mask, positions, decode, window, **self.attention_options()
        )
        x = x + a
        m, rows = self.feed_forward(norm(name="post_attention_layernorm")(x))
        return x + m, {"attention": a, **rows, "mlp": m}


class SandwichBlock(PreNormBlock):
    """Gemma's block: norms before and after attention and MLP, the outputs rows taken before their post-norms
    (as HF's self_attn and mlp modules return them); gelu-tanh gated MLP by default.

        x = x + post_attention_layernorm(self_attn(input_layernorm(x)))
        x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))
    """

    def feed_forward(self, x):
        return gated_mlp(self, x, functools.partial(nn.gelu, approximate=True)), {}

    @nn.compact
    def __call__(self, x, mask, positions, decode: bool, window=None):
        norm = self.norm()
        a = self_attention(
            self, norm(name="input_layernorm")(x), mask, positions, decode, window, **self.attention_options()
        )
        x = x + norm(name="post_attention_layernorm")(a)
        m, rows = self.feed_forward(norm(name="pre_feedforward_layernorm")(x))
        return x + norm(name="post_feedforward_layernorm")(m), {"attention": a, **rows, "mlp": m}
