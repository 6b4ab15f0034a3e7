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
import jax.numpy as jnp

from ..linen import RoPE
from . import _activation_layout, quantized
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
    N, K, H, E = d["N"], d["K"], d["H"], d["E"]
    attention_layer = kept_fp8(
        block,
        _activation_layout.attention_class(block.sharding),
        {("query",): ((E, N, H), 1), ("key",): ((E, K, H), 1), ("value",): ((E, K, H), 1), ("out",): ((N, H, E), 2)},
    )
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
    E = d["E"]

    def dense(inputs: int, features: int, name: str):
        layer = kept_fp8(block, nn.Dense, {(): ((inputs, features), 1)})
        options = dict(dtype=block.dtype, param_dtype=block.param_dtype, precision=block.precision)
        return layer(features, use_bias=c.mlp_bias, name=name, **options)

    h = activation(dense(E, F, "gate_proj")(x)) * dense(E, F, "up_proj")(x)
    return dense(F, E, "down_proj")(h)


def kept_fp8(block: Configured, layer_class, layouts: dict):
    """layer_class as `block` builds it: as it is, or, when the config keeps block-FP8 weights (fp8_block: the
    checkpoint's weight_block_size), storing each kernel as the checkpoint does (kernel_fp8 [out, in] float8_e4m3fn
    and kernel_scale_inv [ceil(out / br), ceil(in / bc)] float32) and decoding it as the layer is applied
    (quantized.fp8_kernels: to the block's dtype, else bfloat16, as a dequantized load's params are).
    layouts: {the kernel's path in the layer's params: (its shape, its leading input axes)}."""
    fp8 = block.config.fp8_block
    if fp8 is None:
        return layer_class
    decode = functools.partial(quantized.fp8_kernels, block=fp8, layouts=layouts, dtype=block.dtype or jnp.bfloat16)
    placeholders = functools.partial(quantized.fp8_placeholders, block=fp8, layouts=layouts)
    return nn.map_variables(layer_class, "params", decode, placeholders, init=block.is_initializing())


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
