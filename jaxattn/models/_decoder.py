"""The base every family module reads, so that a family is its config parsing, its block and its weight table.

    configs     DecoderConfig (the fields of HF's Llama-shaped configs), checked_window, layer_windows and the
                families' window rules (every_layer_window, use_sliding_window_layers), check_gemma
    the stack   Configured (a module's config and dtypes), layer_stack (blocks in turn, each one's outputs
                sown), layer_masks / layer_window (each layer's mask and window keyword), lm_head / tied_logits
    CausalLM    HF's *ForCausalLM: embed_tokens -> layers_{i} -> norm -> lm_head; a family names its Block;
                ScaledCausalLM: Gemma's (sqrt(E)-scaled embeddings, softcapped logits), softcap
    decoding    empty_cache
    weights     causal_lm_rows, qk_norm_rows, sandwich_norm_rows and mlp_rows (HF's names, spelled out),
                tied_copy, loader (both ways: it registers the to_pretrained writer too)

Beside it: _blocks (self_attention, gated_mlp, PreNormBlock, SandwichBlock), _norms (RMSNorm, layer_norm),
_masks (key_mask, positions / positions_and_slots, sliding_mask), _rope_config (HF's rope settings ->
rope_frequencies, rope_attention_factor).

Calling convention of every decoder-only model here (GPT-2, Llama, Mistral, Qwen2, Gemma 2, Qwen 3, Gemma 3,
Mixtral, gpt-oss, Qwen3-MoE):

    logits = model.apply({"params": p}, input_ids[B,T], attention_mask=None, position_ids=None)
        attention_mask [B,T] (1 = token, 0 = padding; keys only, as HF's); position_ids default arange(T),
        as HF's forward (not generate) takes them.
    logits, vars = model.apply({"params": p, "cache": c}, ids[B,T], attention_mask=m[B,L], position_ids=pos,
                               decode=True, mutable=["cache"])
        appends the T tokens to the cache (L slots, see jaxattn.linen); attention_mask then covers all L
        slots (1 = a real token is or will be there; required by models with sliding windows, which apply
        the window to the slots as a mask); position_ids default: the slots they land in.

Padding is masked as keys only; a padded query position's output is not meaningful (HF's is not either).
Every model sows its layers' outputs in "intermediates" (see layer_stack), which crosscheck.layer_report
aligns with the torch model's.

    V vocab  E hidden  N heads  K key/value heads  H head dim  F intermediate
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from . import _activation_layout, _pretrained, _save, weights
from ._masks import key_mask, positions_and_slots, sliding_mask
from ._norms import RMSNorm
from ._rope_config import rope_attention_factor, rope_frequencies
from .weights import Reshape, Steps, Transpose

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Bool, Float, Int

# --- configs ----------------------------------------------------------------------------------------------------

LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """The fields HF's Llama-shaped configs share (names as in config.json; defaults: Llama's). A family
    subclasses it with its own fields and a from_dict that refuses what it does not implement."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # a bias on q, k, v and o
    mlp_bias: bool = False
    rope_frequencies: tuple = ()  # the inverse frequencies [H/2] (rope_frequencies of the config)
    rope_attention_factor: float = 1.0  # HF's attention_scaling: cos and sin scaled by it (yarn)
    # block-FP8 weights kept as the checkpoint stores them (its weight_block_size; _blocks.kept_fp8), None: plain
    # kernels (Qwen 3, Qwen3-MoE and DeepSeek V3 set it)
    fp8_block: tuple[int, int] | None = None
    windows: tuple = ()  # per layer: HF's sliding_window W (the query and W - 1 before) or None
    # every attention call's implementation= (jaxattn.dot_product_attention; None: per platform); not in config.json
    implementation: str | None = dataclasses.field(default=None, compare=False)
    hf_config: Any = dataclasses.field(default=None, compare=False, repr=False)  # the config.json dict read

    rms_norm: ClassVar[str] = "llama"  # which of HF's RMS norms the family's layers use (see RMSNorm)

    @classmethod
    def parse(
        cls,
        config: Mapping[str, Any],
        source,
        *,
        nullable=(),
        rope: Mapping | None = None,
        rope_name: str = "rope_parameters",
        **derived,
    ):
        """cls from the config.json keys named as its fields (null: the field's default, unless the key is
        in `nullable`), the fields the family derives, and the rope frequencies of the config's rope settings
        (or of `rope`, called `rope_name` in refusals: see rope_frequencies). A head_dim that is neither given
        nor hidden_size / num_attention_heads is refused."""
        fields = (
            {f.name for f in dataclasses.fields(cls)}
            - set(derived)
            - {"rope_frequencies", "rope_attention_factor", "hf_config", "implementation"}
        )
        parsed = cls(**{k: v for k, v in config.items() if k in fields and (v is not None or k in nullable)}, **derived)
        if parsed.hidden_size % parsed.num_attention_heads and parsed.head_dim is None:
            _pretrained.refuse(
                source,
                "head_dim",
                f"given, or hidden_size divisible by num_attention_heads={parsed.num_attention_heads}",
                None,
            )
        frequencies = rope_frequencies(config, parsed.dims()["H"], source, rope=rope, name=rope_name)
        return dataclasses.replace(
            parsed, rope_frequencies=tuple(frequencies), rope_attention_factor=rope_attention_factor(config, rope)
        )

    def to_dict(self) -> dict:
        """config.json's keys for the fields every Llama-shaped config shares; a family adds model_type,
        architectures, its activation, windows and own fields. rope_frequencies are not written: HF derives
        them from the rope settings, which come from hf_config (else HF's defaults), and to_pretrained checks
        that they give these frequencies."""
        shared = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "rms_norm_eps",
            "tie_word_embeddings",
        )
        return {k: getattr(self, k) for k in shared} | ({} if self.head_dim is None else {"head_dim": self.head_dim})

    def layer_types(self) -> list[str]:
        """HF's layer_types of the windows: "sliding_attention" where a layer has one, else "full_attention"."""
        return [LAYER_TYPES[self.window(i) is None] for i in range(self.num_hidden_layers)]

    def sliding_window(self) -> dict:
        """{"sliding_window": W} of the sliding layers, or {} when none slides."""
        return next(({"sliding_window": w} for w in self.windows if w is not None), {})

    def use_sliding_window_keys(self) -> dict:
        """Qwen's window keys (use_sliding_window_layers read back): use_sliding_window, layer_types, W."""
        return {"use_sliding_window": bool(self.windows), "layer_types": self.layer_types(), **self.sliding_window()}

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    def rope(self, layer: int | None) -> tuple[tuple, float]:
        """(inverse frequencies, attention factor) of the rotary embedding of `layer` (the same for every
        layer unless a family's layers differ, as Gemma 3's local and global ones)."""
        return self.rope_frequencies, self.rope_attention_factor

    def attention_biases(self) -> tuple[str, ...]:
        """The attention projections that carry a bias (the layer's use_bias): all four with attention_bias."""
        return ("query", "key", "value", "out") if self.attention_bias else ()

    def outside_the_model(self, name: str) -> bool:
        """True for a checkpoint tensor that belongs to no part of this model, skipped on load by name (HF's
        _keys_to_ignore_on_load_unexpected: e.g. multi-token-prediction layers, which transformers' causal LM
        never runs either). Every other tensor the table does not know is still an error."""
        return False

    def fp8_sizes(self, d: Mapping[str, int]) -> dict[str, int]:
        """The sides of the FP8 weights [out, in] of dims `d`, by their letters without "*" (N*H as NH): a
        family with other projections (DeepSeek V3's MLA) names its own."""
        return {"E": d["E"], "F": d["F"], "NH": d["N"] * d["H"], "KH": d["K"] * d["H"]}

    def fp8_grid(self, d: Mapping[str, int]) -> dict[str, int]:
        """With kept FP8 kernels, the scale grids of the checkpoint of dims `d`: each [out, in] weight's block
        rows and columns ("{out}_r", "{in}_c" over fp8_sizes: ceil over weight_block_size; kept_fp8_rows'
        letters); else {}."""
        if self.fp8_block is None:
            return {}
        br, bc = self.fp8_block
        sizes = self.fp8_sizes(d)
        return {f"{a}_r": -(-n // br) for a, n in sizes.items()} | {f"{a}_c": -(-n // bc) for a, n in sizes.items()}

    def fp8_quantization_config(self) -> dict:
        """{"quantization_config": ...} for kept FP8 kernels (hf_config's, else the released files' keys), or {}."""
        if self.fp8_block is None:
            return {}
        read = (self.hf_config or {}).get("quantization_config")
        written = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
        return {"quantization_config": read or {**written, "weight_block_size": list(self.fp8_block)}}

    def dims(self) -> dict[str, int]:
        N = self.num_attention_heads
        return {
            "V": self.vocab_size,
            "E": self.hidden_size,
            "N": N,
            "K": self.num_key_value_heads or N,
            "H": self.head_dim or self.hidden_size // N,
            "F": self.intermediate_size,
        }


def fp8_block(config: Mapping[str, Any]) -> tuple[int, int] | None:
    """A block-FP8 checkpoint's weight_block_size (quantized.scheme has checked it), for DecoderConfig.fp8_block
    of a family that keeps its FP8 kernels; None for any other checkpoint."""
    q = config.get("quantization_config") or {}
    return tuple(q["weight_block_size"]) if q.get("quant_method") == "fp8" else None


def checked_window(window, source, expected: str) -> int:
    """HF's sliding_window W, refused by name unless an int >= 1."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        _pretrained.refuse(source, "sliding_window", expected, window)
    return window


def layer_windows(types, window, num_layers: int, source, *, why: str) -> tuple:
    """HF's layer_types -> per layer: the sliding window W ("sliding_attention") or None ("full_attention").
    Refuses other kinds, a count other than num_layers, and a W that is not an int >= 1 when a layer slides."""
    if len(types) != num_layers or not set(types) <= set(LAYER_TYPES):
        _pretrained.refuse(source, "layer_types", f"{num_layers} entries among {list(LAYER_TYPES)}", types)
    if "sliding_attention" in types:
        checked_window(window, source, f"an int >= 1 ({why})")
    return tuple(window if kind == "sliding_attention" else None for kind in types)


def check_gemma(config: Mapping[str, Any], source) -> None:
    """Gemma 2 / 3: refuses a hidden_activation other than the gelu-tanh SandwichBlock's MLP has, and
    use_bidirectional_attention (their embedding variants; the blocks here are causal)."""
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        _pretrained.refuse(source, "hidden_activation", "'gelu_pytorch_tanh'", config["hidden_activation"])
    if config.get("use_bidirectional_attention"):
        _pretrained.refuse(
            source, "use_bidirectional_attention", "false or null (causal)", config["use_bidirectional_attention"]
        )


def every_layer_window(config: Mapping[str, Any], source) -> tuple:
    """Mistral / Mixtral: HF's sliding_window W on every layer (their models pick the mask by sliding_window
    alone); null: none, ()."""
    if config.get("sliding_window") is None:
        return ()
    window = checked_window(config["sliding_window"], source, "an int >= 1 or null")
    return (window,) * config["num_hidden_layers"]


def use_sliding_window_layers(config: Mapping[str, Any], source) -> tuple:
    """Qwen 2 / Qwen 3: HF's sliding_window W on the layers layer_types marks "sliding_attention" (HF's
    default: from max_window_layers on), and only with use_sliding_window (HF's config drops the window
    otherwise, so sliding layer_types without it are refused); () when no layer slides."""
    n, slides = config["num_hidden_layers"], bool(config.get("use_sliding_window", False))
    types = config.get("layer_types") or [
        "sliding_attention" if slides and i >= config.get("max_window_layers", 28) else "full_attention"
        for i in range(n)
    ]
    if not slides:
        if set(types) != {"full_attention"}:
            _pretrained.refuse(
                source, "layer_types", "only 'full_attention' (use_sliding_window is false)", sorted(set(types))
            )
        return ()
    return layer_windows(types, config.get("sliding_window"), n, source, why="use_sliding_window is true")


# --- the stack --------------------------------------------------------------------------------------------------


class Configured(nn.Module):
    """What every model and block of the families takes: its config and flax's dtype options."""

    config: Any
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    sharding: Any = None  # a _activation_layout.ModelSharding: the activations' layout on a mesh (None: one device)


def layer_stack(module: nn.Module, layer: Callable, num_layers: int, final_norm: nn.Module, x):
    """x through the blocks and the final norm, inside `module`'s compact call; layer(i, x) -> (x, {row: output})
    runs block i. Sows in "intermediates" the rows crosscheck.layer_report aligns: "embeddings" (x as it
    comes in), each block's "layer{i}.{row}" and "layer{i}.residual" (the stream after it), "final_norm"."""
    module.sow("intermediates", "embeddings", x)
    x = _activation_layout.constrain(module.sharding, x, "BTE")  # on a mesh: batch over "data" between blocks
    for i in range(num_layers):
        x, rows = layer(i, x)
        x = _activation_layout.constrain(module.sharding, x, "BTE")
        for name, value in rows.items():
            module.sow("intermediates", f"layer{i}.{name}", value)
        module.sow("intermediates", f"layer{i}.residual", x)
    x = final_norm(x)
    module.sow("intermediates", "final_norm", x)
    return x


def layer_window(window: int | None, decode: bool):
    """The attention layer's `window` keyword for HF's sliding_window W: (W - 1, 0) without the cache; None
    when decoding, where the window is part of the mask (sliding_mask)."""
    return None if window is None or decode else (window - 1, 0)


def layer_masks(config: DecoderConfig, attention_mask, slots, decode: bool) -> dict:
    """{window (or None): the attention layers' mask}, one per distinct window of the model's layers."""
    windows = {config.window(i) for i in range(config.num_hidden_layers)}
    return {
        w: key_mask(attention_mask) if w is None else sliding_mask(attention_mask, slots, w, decode) for w in windows
    }


def tied_logits(x, embedding, dtype, precision):
    """x @ embedding.T: a head tied to the embeddings (nn.Embed.attend, with the model's precision)."""
    compute = dtype if dtype is not None else jnp.result_type(x, embedding)
    return jnp.einsum("...e,ve->...v", x.astype(compute), jnp.asarray(embedding, compute), precision=precision)


def lm_head(module: Configured, x, embed: nn.Embed, tie: bool):
    """The LM head in `module`'s compact call: tied to `embed`, else its own bias-free Dense "lm_head"."""
    if tie:
        return tied_logits(x, embed.embedding, module.dtype, module.precision)
    return nn.Dense(
        embed.num_embeddings,
        use_bias=False,
        dtype=module.dtype,
        param_dtype=module.param_dtype,
        precision=module.precision,
        name="lm_head",
    )(x)


class CausalLM(Configured):
    """HF's *ForCausalLM of the Llama shape: input_ids [B,T] -> logits [B,T,V] (the calling convention above).

        x = scale_embeddings(embed_tokens[ids]);  x = layers_i(x), i < L;  logits = cap_logits(head(norm(x)))

    A family subclasses it, naming its `Block` (PreNormBlock or SandwichBlock, with the family's hooks):
    built with layer=i, called (x, mask, positions, decode, window) -> (x, {row: output}), with its norms
    "input_layernorm" and "post_attention_layernorm", its self_attention and its MLP (causal_lm_rows and
    mlp_rows describe them). The hooks are identities unless the family's HF model
    scales its embeddings or caps its logits. Sows "intermediates" (layer_stack).
    """

    Block: ClassVar[type]

    def max_positions(self) -> int | None:
        return None  # rotary positions have no table to run off

    def scale_embeddings(self, x):
        return x

    def cap_logits(self, logits):
        return logits

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
        positions, slots = positions_and_slots(self, input_ids.shape, position_ids, decode)
        embed = nn.Embed(d["V"], d["E"], dtype=self.dtype, param_dtype=self.param_dtype, name="embed_tokens")
        masks = layer_masks(c, attention_mask, slots, decode)

        def layer(i, x):
            block = self.Block(
                c, self.dtype, self.param_dtype, self.precision, self.sharding, layer=i, name=f"layers_{i}"
            )
            return block(x, masks[c.window(i)], positions, decode, layer_window(c.window(i), decode))

        norm = RMSNorm(c.rms_norm_eps, self.param_dtype, c.rms_norm, name="norm")
        x = layer_stack(self, layer, c.num_hidden_layers, norm, self.scale_embeddings(embed(input_ids)))
        return self.cap_logits(lm_head(self, x, embed, c.tie_word_embeddings))


def softcap(x, cap: float | None):
    """HF's tanh softcapping: cap * tanh(x / cap); None: x unchanged."""
    return x if cap is None else jnp.tanh(x / cap) * cap


class ScaledCausalLM(CausalLM):
    """Gemma's causal LM: the embeddings times sqrt(E), the scale rounded to their dtype first (HF's
    embed_scale.to(weight.dtype)); the logits softcapped by config.final_logit_softcapping (None: not)."""

    def scale_embeddings(self, x):
        return x * jnp.asarray(math.sqrt(self.config.dims()["E"]), x.dtype)

    def cap_logits(self, logits):
        return softcap(logits, self.config.final_logit_softcapping)


# --- decoding ---------------------------------------------------------------------------------------------------


def empty_cache(model: nn.Module, params, *args, method=None, **kwargs):
    """The "cache" collection that model.apply({"params": params}, *args, decode=True, method=method,
    **kwargs) fills, all zeros: its shapes for those arguments (jax.eval_shape, nothing is computed), its
    dtype the one the model computes in with these params (a cache never casts silently)."""

    def cache(params):
        return model.apply({"params": params}, *args, decode=True, method=method, mutable=["cache"], **kwargs)[1][
            "cache"
        ]

    shapes = jax.eval_shape(cache, params)
    zeros = functools.partial(jax.tree.map, lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    if model.sharding is None:
        return zeros()
    return jax.jit(lambda: _activation_layout.constrain_cache(model.sharding, zeros()))()  # made on the mesh, sharded


# --- weights: HF's names, one row per tensor (see jaxattn.models.weights) ----------------------------------------


def causal_lm_rows(config: DecoderConfig) -> list[weights.Row]:
    """What every Llama-shaped checkpoint holds besides its MLP: the embeddings, each layer's two norms and
    attention (torch nn.Linear [out,in] -> our heads-split kernels), the final norm and an untied head."""
    R, biases = weights.row, config.attention_biases()
    return [
        R("model.embed_tokens.weight", ("V", "E"), "embed_tokens/embedding", ("V", "E")),
        R("model.layers.{i}.input_layernorm.weight", ("E",), "layers_{i}/input_layernorm/weight", ("E",)),
        R(
            "model.layers.{i}.self_attn.q_proj.weight",
            ("N*H", "E"),
            "layers_{i}/self_attn/query/kernel",
            ("E", "N", "H"),
            Steps(Transpose(), Reshape()),
        ),
        R(
            "model.layers.{i}.self_attn.k_proj.weight",
            ("K*H", "E"),
            "layers_{i}/self_attn/key/kernel",
            ("E", "K", "H"),
            Steps(Transpose(), Reshape()),
        ),
        R(
            "model.layers.{i}.self_attn.v_proj.weight",
            ("K*H", "E"),
            "layers_{i}/self_attn/value/kernel",
            ("E", "K", "H"),
            Steps(Transpose(), Reshape()),
        ),
        R(
            "model.layers.{i}.self_attn.o_proj.weight",
            ("E", "N*H"),
            "layers_{i}/self_attn/out/kernel",
            ("N", "H", "E"),
            Steps(Transpose(), Reshape()),
        ),
        *weights.when(
            "query" in biases,
            R(
                "model.layers.{i}.self_attn.q_proj.bias",
                ("N*H",),
                "layers_{i}/self_attn/query/bias",
                ("N", "H"),
                Reshape(),
            ),
        ),
        *weights.when(
            "key" in biases,
            R(
                "model.layers.{i}.self_attn.k_proj.bias",
                ("K*H",),
                "layers_{i}/self_attn/key/bias",
                ("K", "H"),
                Reshape(),
            ),
        ),
        *weights.when(
            "value" in biases,
            R(
                "model.layers.{i}.self_attn.v_proj.bias",
                ("K*H",),
                "layers_{i}/self_attn/value/bias",
                ("K", "H"),
                Reshape(),
            ),
        ),
        *weights.when(
            "out" in biases,
            R("model.layers.{i}.self_attn.o_proj.bias", ("E",), "layers_{i}/self_attn/out/bias", ("E",)),
        ),
        R(
            "model.layers.{i}.post_attention_layernorm.weight",
            ("E",),
            "layers_{i}/post_attention_layernorm/weight",
            ("E",),
        ),
        R("model.norm.weight", ("E",), "norm/weight", ("E",)),
        *weights.when(
            not config.tie_word_embeddings, R("lm_head.weight", ("V", "E"), "lm_head/kernel", ("E", "V"), Transpose())
        ),
    ]


def qk_norm_rows() -> list[weights.Row]:
    """Each layer's per-head RMS norms of queries and keys (self_attention with qk_norm; Qwen 3, Gemma 3)."""
    R = weights.row
    return [
        R("model.layers.{i}.self_attn.q_norm.weight", ("H",), "layers_{i}/self_attn/q_norm/weight", ("H",)),
        R("model.layers.{i}.self_attn.k_norm.weight", ("H",), "layers_{i}/self_attn/k_norm/weight", ("H",)),
    ]


def sandwich_norm_rows() -> list[weights.Row]:
    """Each layer's norms around the MLP of a SandwichBlock (its attention's two: causal_lm_rows)."""
    R = weights.row
    return [
        R(
            "model.layers.{i}.pre_feedforward_layernorm.weight",
            ("E",),
            "layers_{i}/pre_feedforward_layernorm/weight",
            ("E",),
        ),
        R(
            "model.layers.{i}.post_feedforward_layernorm.weight",
            ("E",),
            "layers_{i}/post_feedforward_layernorm/weight",
            ("E",),
        ),
    ]


def mlp_rows(config: DecoderConfig) -> list[weights.Row]:
    """Each layer's gate/up/down MLP (gated_mlp's params)."""
    R = weights.row
    return [
        R("model.layers.{i}.mlp.gate_proj.weight", ("F", "E"), "layers_{i}/gate_proj/kernel", ("E", "F"), Transpose()),
        R("model.layers.{i}.mlp.up_proj.weight", ("F", "E"), "layers_{i}/up_proj/kernel", ("E", "F"), Transpose()),
        R("model.layers.{i}.mlp.down_proj.weight", ("E", "F"), "layers_{i}/down_proj/kernel", ("F", "E"), Transpose()),
        *weights.when(
            config.mlp_bias,
            R("model.layers.{i}.mlp.gate_proj.bias", ("F",), "layers_{i}/gate_proj/bias", ("F",)),
            R("model.layers.{i}.mlp.up_proj.bias", ("F",), "layers_{i}/up_proj/bias", ("F",)),
            R("model.layers.{i}.mlp.down_proj.bias", ("E",), "layers_{i}/down_proj/bias", ("E",)),
        ),
    ]


# the HF names of the weights a block-FP8 release stores in FP8 (DeepSeek V3's kv_a_proj_with_mqa too)
FP8_PROJECTIONS = ("proj.weight", "proj_with_mqa.weight")


def kept_fp8_rows(rows: list[weights.Row]) -> list[weights.Row]:
    """rows with every projection's weight (a row whose HF name ends in FP8_PROJECTIONS and fills a kernel) kept in
    block FP8: the weight [out, in] as stored into kernel_fp8, its weight_scale_inv [out_r, in_c] into
    kernel_scale_inv (DecoderConfig.fp8_grid's letters; _blocks.kept_fp8 and moe.StackedDense decode them); a
    stacked row (one tensor per expert) stacks both over its axis."""
    out = []
    for row in rows:
        (target,) = row.targets
        if not (row.name.endswith(FP8_PROJECTIONS) and target.path.endswith("/kernel")):
            out.append(row)
            continue
        o, i = row.shape
        grid = (o.replace("*", "") + "_r", i.replace("*", "") + "_c")
        kernel = target.path.removesuffix("/kernel")
        for name, shape, leaf in (
            (row.name, (o, i), "kernel_fp8"),
            (row.name + "_scale_inv", grid, "kernel_scale_inv"),
        ):
            if row.stack is None:
                out.append(weights.row(name, shape, f"{kernel}/{leaf}", shape))
            else:
                out.append(weights.stacked(name, shape, f"{kernel}/{leaf}", (row.stack, *shape), over=row.stack))
    return out


def tied_copy(
    tensors: Mapping[str, np.ndarray],
    files: Mapping[str, str],
    source,
    *,
    tied: bool,
    embedding: str,
    head: str = "lm_head.weight",
) -> list[str]:
    """[head] when the checkpoint stores the tied head's copy of the embeddings (the table then skips it),
    checked equal so that nothing is dropped silently; else []."""
    if not tied or head not in tensors:
        return []
    if not np.array_equal(tensors[head], tensors.get(embedding)):
        raise ValueError(
            f"{files[head]}: {head!r}: expected a copy of {embedding} (tie_word_embeddings is true "
            f"in {source}), got other values"
        )
    return [head]


def loader(config_class, model_class, table: Callable) -> _pretrained.Family:
    """A from_pretrained loader for a CausalLM family: config_class.from_dict, the weights through
    table(config) (a stored copy of a tied head checked and skipped). It registers the way back too: to_pretrained
    writes a model_class through the same table, its config through config_class.to_dict (see _save)."""

    @_save.register_writer(model_class)
    def checkpoint(model):
        return _save.config_json(model.config), table(model.config), model.config.dims()

    return _pretrained.Family(config_class, model_class, reader(config_class, model_class, table))


def reader(config_class, model_class, table: Callable) -> Callable:
    """loader's load function alone, registering no writer: for a table that is only read (moe.loader's
    fused experts, which transformers' save_pretrained never writes)."""

    def load(config: dict, tensors, files, *, dtype, precision, source):
        parsed = config_class.from_dict(config, source)
        ignored = tied_copy(
            tensors, files, source, tied=parsed.tie_word_embeddings, embedding="model.embed_tokens.weight"
        ) + [name for name in tensors if parsed.outside_the_model(name)]
        params = weights.fill(tensors, table(parsed), parsed.dims(), files, dtype=dtype, ignored=ignored)
        return model_class(parsed, precision=precision), params

    return load
