"""Swin Transformer (Liu et al. 2021) in Flax linen, on jaxattn.linen.WindowAttention.

    patches:   x = LayerNorm(Conv_{P x P, stride P}(pixel_values))          [B, Y*X, E0] on a Y x X grid
    stage s:   its blocks, then (but the last) PatchMerging: x -> Dense_{2E}(LayerNorm(concat 2x2)) on a
               grid halved (rounded up)
    block:     a = x + WindowAttention(LayerNorm(x))     (W-MSA on even blocks, SW-MSA shifted by w // 2 on odd)
               x = a + Dense_E(gelu_erf(Dense_F(LayerNorm(a))))
    top:       LayerNorm, the mean over the grid (HF's AdaptiveAvgPool1d), a classifier Dense_L

It matches Hugging Face's SwinModel / SwinForImageClassification (transformers 5) at inference, where drop
path and dropout are off (in training, deterministic=False: hidden dropout and HF's drop path of the attention
branch, rates linear over the blocks; attention dropout is refused). HF's details kept exactly:
  * the patch embedding's and PatchMerging's LayerNorms use torch's default eps 1e-5, not layer_norm_eps;
  * a feature map that does not tile into windows is padded with zeros AFTER layernorm_before, and the padded
    tokens take part in attention as keys (they are not masked), the shifted-window regions computed on the
    padded map; the output is cropped back. PatchMerging pads an odd map with zeros before its 2x2 concat,
    whose order is HF's: [0::2, 0::2], [1::2, 0::2], [0::2, 1::2], [1::2, 1::2] (rows, cols);
  * the window clamps as SwinLayer.set_shift_and_window_size does: where min(height, width) <= window_size,
    no shift and the window is min(height, width). transformers 5 builds every bias table for window_size, so
    a map smaller than the window fails inside HF; here that is a ValueError naming both sizes.
  * HF adds -100 to the logits of keys in another region of a shifted window; we mask them (exp(-100) ~
    4e-44 of a weight, see jaxattn/_schemes/window.py).
HF pads pixel_values that its patch size does not divide; here that is a ValueError naming both sizes.

Weights come from a state_dict (or from_pretrained) through ONE table (`weight_table`, the jaxattn.models.weights
format). A block's tensors have two sets of names: the files' (attention.self.query, attention.output.dense,
intermediate.dense, output.dense: the released checkpoints', and what transformers 5's save_pretrained still
writes) and transformers 5's modules' (attention.q_proj ..., mlp.fc1: its state_dict in memory), which
transformers maps between as it loads and saves. Both are read; to_pretrained writes the files' names.

    C channels  Pa Pb patch height, width  s stage  E{s} width  N{s} heads  H{s} head dim  F{s} MLP width
    R window table rows (2w - 1)^2  L labels
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .. import window_partition, window_relative_index
from .._core import checks
from ..linen import WindowAttention
from . import _activation_layout, _norms, _pretrained, _save, weights
from .weights import Reshape, Steps, Transpose

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import ArrayLike, Float

TORCH_LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default: HF's patch-embedding and PatchMerging norms take no eps


def _pair(value) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (value[0], value[1])


def _int_pair(config: Mapping[str, Any], key: str, refuse) -> tuple[int, int] | int:
    """An int or [height, width] of positive ints from config.json (kept as written, a list as a tuple)."""
    value = config[key]
    items = value if isinstance(value, (list, tuple)) else [value]
    ok = len(items) == 2 if isinstance(value, (list, tuple)) else True
    if not ok or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in items):
        refuse(key, "a positive int or a pair [height, width] of them", value)
    return tuple(value) if isinstance(value, (list, tuple)) else value


@dataclasses.dataclass(frozen=True)
class SwinConfig:
    """The fields of HF's SwinConfig that the model reads (defaults: swin-tiny-patch4-window7-224)."""

    image_size: int | tuple[int, int] = 224  # HF's init grid; the model takes any size its patch divides
    patch_size: int | tuple[int, int] = 4
    num_channels: int = 3
    embed_dim: int = 96
    depths: tuple[int, ...] = (2, 2, 6, 2)
    num_heads: tuple[int, ...] = (3, 6, 12, 24)
    window_size: int = 7
    mlp_ratio: float = 4.0
    layer_norm_eps: float = 1e-5
    num_labels: int = 2  # the classifier's outputs (config.json: len(id2label))
    hidden_dropout_prob: float = 0.0
    attention_probs_dropout_prob: float = 0.0
    drop_path_rate: float = 0.1  # stochastic depth of the attention branch in training (HF's); none at inference
    # a learned [1,P,E0] position embedding added to the patch embeddings (P: image_size's patches); images of
    # that size only (HF's interpolate_pos_encoding is not ported)
    use_absolute_embeddings: bool = False
    # every attention call's implementation= (jaxattn.window_attention; None: per platform); not in config.json
    implementation: str | None = dataclasses.field(default=None, compare=False)
    hf_config: Any = dataclasses.field(default=None, compare=False, repr=False)  # the config.json dict read

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> "SwinConfig":
        """From a HF config.json dict; refuses by name what this port does not implement."""
        refuse = functools.partial(_pretrained.refuse, source)
        if config.get("hidden_act", "gelu") != "gelu":
            refuse("hidden_act", "'gelu' (exact erf GELU)", config["hidden_act"])
        if not isinstance(config.get("use_absolute_embeddings", False), bool):
            refuse("use_absolute_embeddings", "true or false", config["use_absolute_embeddings"])
        if config.get("qkv_bias", True) is not True:
            refuse("qkv_bias", "true (q/k/v biases, as every released Swin)", config["qkv_bias"])
        ratio = config.get("mlp_ratio", cls.mlp_ratio)
        if (
            isinstance(ratio, bool)
            or not isinstance(ratio, (int, float))
            or int(ratio * config.get("embed_dim", cls.embed_dim)) < 1
        ):
            refuse("mlp_ratio", "a positive number (the MLP is int(mlp_ratio * E) wide)", ratio)
        fields = {f.name: config[f.name] for f in dataclasses.fields(cls) if f.compare and f.name in config}
        for key in ("image_size", "patch_size"):
            if key in config:
                fields[key] = _int_pair(config, key, refuse)
        for key in ("depths", "num_heads"):
            value = config.get(key, getattr(cls, key))
            if not (
                isinstance(value, (list, tuple))
                and value
                and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value)
            ):
                refuse(key, "a non-empty list of positive ints (one per stage)", value)
            fields[key] = tuple(value)
        if len(fields["depths"]) != len(fields["num_heads"]):
            refuse("num_heads", f"one entry per stage ({len(fields['depths'])}, as depths)", list(fields["num_heads"]))
        if isinstance(config.get("id2label"), Mapping):
            fields["num_labels"] = len(config["id2label"])
        parsed = cls(**fields)
        for s, N in enumerate(parsed.num_heads):
            if parsed.width(s) % N:
                refuse("num_heads", f"stage {s}'s heads dividing its width {parsed.width(s)}", list(parsed.num_heads))
        return parsed

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict; HF's names, the derived hidden_size and num_layers too)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}
        labels = fields.pop("num_labels")
        for key in ("image_size", "patch_size", "depths", "num_heads"):
            fields[key] = fields[key] if isinstance(fields[key], int) else list(fields[key])
        id2label = dict((self.hf_config or {}).get("id2label") or {})
        if len(id2label) != labels:  # HF's default names, as transformers writes them for num_labels
            id2label = {str(k): f"LABEL_{k}" for k in range(labels)}
            label2id = {v: k for k, v in ((int(k), v) for k, v in id2label.items())}
        else:
            label2id = dict((self.hf_config or {}).get("label2id") or {v: int(k) for k, v in id2label.items()})
        return {
            "model_type": "swin",
            "architectures": ["SwinForImageClassification"],  # a SwinModel's writer says ["SwinModel"]
            "hidden_act": "gelu",
            "qkv_bias": True,
            "num_layers": len(self.depths),
            "hidden_size": self.width(len(self.depths) - 1),
            "id2label": id2label,
            "label2id": label2id,
            **fields,
        }

    def width(self, stage: int) -> int:
        """E of stage s: embed_dim * 2^s (each PatchMerging doubles it)."""
        return self.embed_dim * 2**stage

    def mlp_width(self, stage: int) -> int:
        return int(self.mlp_ratio * self.width(stage))  # HF's int(config.mlp_ratio * dim)

    def patch_grid(self) -> tuple[int, int]:
        """(Y, X): the patches of an image_size image (HF's grid_size; the absolute embeddings' P = Y * X)."""
        return tuple(i // p for i, p in zip(_pair(self.image_size), _pair(self.patch_size)))  # type: ignore[return-value]

    def dims(self) -> dict[str, int]:
        """The axis letters of the weight table."""
        Pa, Pb = _pair(self.patch_size)
        dims = {"C": self.num_channels, "Pa": Pa, "Pb": Pb, "R": (2 * self.window_size - 1) ** 2}
        dims["L"] = self.num_labels
        dims["P"] = math.prod(self.patch_grid())
        for s, N in enumerate(self.num_heads):
            E = self.width(s)
            dims.update({f"E{s}": E, f"N{s}": N, f"H{s}": E // N, f"F{s}": self.mlp_width(s)})
        return dims


# --- the layers -----------------------------------------------------------------------------------------------


def stage_window(grid: tuple[int, int], window_size: int, shift: int) -> tuple[int, int]:
    """(window, shift) of a block on a height x width grid: SwinLayer.set_shift_and_window_size's clamp."""
    if min(grid) <= window_size:
        if min(grid) < window_size:
            checks.fail(
                "pixel_values",
                f"every stage's feature map at least window_size={window_size} on each side (transformers 5 "
                f"builds the bias table for window_size and fails too)",
                f"a {grid[0]}x{grid[1]} map",
            )
        return min(grid), 0
    return window_size, shift


def patch_embedding(pixel_values, kernel, bias, *, precision=None):
    """nn.Conv2d(C, E, kernel P, stride P) as a matmul over the patches: [B,C,Y*Pa,X*Pb] -> [B,Y,X,E];
    kernel in torch's layout [E,C,Pa,Pb]."""
    E, C, Pa, Pb = kernel.shape
    B, _, height, width = pixel_values.shape
    patches = pixel_values.reshape(B, C, height // Pa, Pa, width // Pb, Pb)
    return jnp.einsum("bcyixj,ecij->byxe", patches, kernel, precision=precision) + bias


def merge_patches(x):
    """SwinPatchMerging's 2x2 concat: [B,Y,X,E] (odd sides padded with zeros) -> [B,ceil(Y/2),ceil(X/2),4E],
    channels in HF's order: rows 0::2 / 1::2 inside columns 0::2 / 1::2."""
    height, width = x.shape[1:3]
    x = jnp.pad(x, ((0, 0), (0, height % 2), (0, width % 2), (0, 0)))
    return jnp.concatenate([x[:, row::2, col::2] for col in range(2) for row in range(2)], axis=-1)


class SwinLayer(nn.Module):
    """One block on a [B,Y*X,E] stream over a `grid` (Y, X); returns (block output, HF's attention output in
    its windowed layout [B,nW,w*w,E], the MLP's output)."""

    config: SwinConfig
    stage: int
    shift: int
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    drop_path: float = 0.0  # this block's stochastic depth rate

    @nn.compact
    def __call__(self, x, grid: tuple[int, int], *, deterministic: bool):
        c = self.config
        dense = functools.partial(nn.Dense, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision)
        norm = functools.partial(_norms.layer_norm, c.layer_norm_eps, self.dtype, self.param_dtype)
        dropout = nn.Dropout(c.hidden_dropout_prob, deterministic=deterministic)
        window, shift = stage_window(grid, c.window_size, self.shift)
        (height, width), B, E = grid, x.shape[0], x.shape[-1]
        h = norm("layernorm_before")(x).reshape(B, height, width, E)
        # HF pads the normed map with zeros to whole windows; padded tokens are keys like any other
        h = jnp.pad(h, ((0, 0), (0, -height % window), (0, -width % window), (0, 0)))
        attention = WindowAttention(
            num_heads=c.num_heads[self.stage],
            window_size=window,
            shift=shift,
            param_dtype=self.param_dtype,
            precision=self.precision,
            implementation=c.implementation,
            name="attention",
        )
        out = attention(h)  # [B, height + pad, width + pad, E]
        windows = window_partition(jnp.roll(out, (-shift, -shift), axis=(1, 2)), window)  # HF's layout, for reports
        # SwinDropPath: the whole attention branch of a sample dropped (the mask broadcast over tokens and
        # channels), the kept ones scaled by 1 / (1 - rate); HF drops no MLP branch
        drop_path = nn.Dropout(self.drop_path, broadcast_dims=(1, 2), deterministic=deterministic)
        a = x + drop_path(dropout(out[:, :height, :width].reshape(x.shape)))
        m = nn.gelu(dense(c.mlp_width(self.stage), name="fc1")(norm("layernorm_after")(a)), approximate=False)
        m = dense(E, name="fc2")(m)
        return a + dropout(m), windows, m


class SwinModel(nn.Module):
    """HF SwinModel. Call with pixel_values [B,C,height,width] (HF's layout; height and width multiples of
    the patch). Returns a dict: last_hidden_state [B,T,E] (after the final LayerNorm; T the last stage's
    tokens, row-major), pooler_output [B,E] (with add_pooling_layer), hidden_states (the embeddings, then
    each stage's output after its PatchMerging, as HF's) and grids (each hidden state's (height, width)).
    Sows in "intermediates" the rows crosscheck.layer_report aligns: "embeddings", "stage{s}.block{b}.
    attention" / ".mlp" / ".residual", "stage{s}.downsample", "final_norm".
    """

    config: SwinConfig
    add_pooling_layer: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    sharding: Any = None  # a _activation_layout.ModelSharding: the activations' layout on a mesh (None: one device)

    @nn.compact
    def __call__(self, pixel_values: Float[ArrayLike, "B C Yp Xp"], *, deterministic: bool = True) -> dict[str, Any]:
        c = self.config
        if not deterministic and c.attention_probs_dropout_prob > 0:
            checks.fail(
                "deterministic",
                "True, or a config with attention_probs_dropout_prob 0 (WindowAttention has no attention dropout)",
                f"False with attention_probs_dropout_prob={c.attention_probs_dropout_prob}",
            )
        pixel_values = jnp.asarray(pixel_values)
        x, grid = self._embed(pixel_values, deterministic)
        blocks = sum(c.depths)  # HF's rates: linear in the block's index over the whole model
        rates = [c.drop_path_rate * k / max(blocks - 1, 1) for k in range(blocks)]
        self.sow("intermediates", "embeddings", x)
        hidden_states, grids = [x], [grid]
        for s, depth in enumerate(c.depths):
            for b in range(depth):
                x = _activation_layout.constrain(self.sharding, x, "BTE")  # on a mesh: batch over "data"
                layer = SwinLayer(
                    c, s, 0 if b % 2 == 0 else c.window_size // 2, self.dtype, self.param_dtype, self.precision,
                    drop_path=rates[sum(c.depths[:s]) + b], name=f"stage_{s}_block_{b}",
                )  # fmt: skip
                x, attention, mlp = layer(x, grid, deterministic=deterministic)
                self.sow("intermediates", f"stage{s}.block{b}.attention", attention)
                self.sow("intermediates", f"stage{s}.block{b}.mlp", mlp)
                self.sow("intermediates", f"stage{s}.block{b}.residual", x)
            if s < len(c.depths) - 1:
                x, grid = self._merge(x, grid, s)
                self.sow("intermediates", f"stage{s}.downsample", x)
            hidden_states.append(x)
            grids.append(grid)
        x = _norms.layer_norm(c.layer_norm_eps, self.dtype, self.param_dtype, "layernorm")(x)
        self.sow("intermediates", "final_norm", x)
        outputs = {"last_hidden_state": x, "hidden_states": tuple(hidden_states), "grids": tuple(grids)}
        if self.add_pooling_layer:
            outputs["pooler_output"] = x.mean(axis=-2)  # AdaptiveAvgPool1d(1) over the tokens
        return outputs

    def _embed(self, pixel_values, deterministic: bool):
        """SwinEmbeddings: the patch projection and its norm (eps 1e-5); ([B,Y*X,E0], (Y, X))."""
        c = self.config
        Pa, Pb = _pair(c.patch_size)
        checks.check_rank("pixel_values", pixel_values, 4, "[B,C,height,width]")
        B, C, height, width = pixel_values.shape
        if C != c.num_channels:
            checks.fail(
                "pixel_values", f"{c.num_channels} channels (num_channels) in [B,C,height,width]", f"{C} channels"
            )
        if height % Pa or width % Pb:
            checks.fail(
                "pixel_values", f"a height and width that are multiples of patch_size {Pa}x{Pb}", f"{height}x{width}"
            )
        checks.check_float("pixel_values", pixel_values)
        E = c.width(0)
        kernel = self.param("patch_kernel", nn.initializers.lecun_normal(), (E, C, Pa, Pb), self.param_dtype)
        bias = self.param("patch_bias", nn.initializers.zeros, (E,), self.param_dtype)
        dtype = self.dtype or jnp.promote_types(pixel_values.dtype, kernel.dtype)  # flax's rule: inputs and params
        if self.dtype is None and dtype != kernel.dtype:  # the attention layers take one dtype: refused here, named
            checks.fail("pixel_values", f"a dtype the params' {kernel.dtype} holds (or the model's dtype=)", dtype)
        x = patch_embedding(
            pixel_values.astype(dtype), kernel.astype(dtype), bias.astype(dtype), precision=self.precision
        )
        x = _norms.layer_norm(TORCH_LAYER_NORM_EPS, self.dtype, self.param_dtype, "embeddings_norm")(x)
        grid = (height // Pa, width // Pb)
        x = x.reshape(B, grid[0] * grid[1], E)
        if c.use_absolute_embeddings:
            if grid != c.patch_grid():
                Y, X = c.patch_grid()
                checks.fail(
                    "pixel_values",
                    f"{Y * Pa}x{X * Pb} pixels (config image_size: the absolute position embeddings cover {Y}x{X} "
                    "patches; interpolating them is not implemented)",
                    f"{height}x{width}",
                )
            position = self.param(
                "position_embeddings", nn.initializers.zeros, (1, grid[0] * grid[1], E), self.param_dtype
            )
            x = x + position.astype(x.dtype)  # HF's SwinEmbeddings: after the norm, before dropout
        x = nn.Dropout(c.hidden_dropout_prob)(x, deterministic=deterministic)
        return x, grid

    def _merge(self, x, grid, s: int):
        """SwinPatchMerging of stage s: ([B,Y'*X',2E], (Y', X')), Y' = ceil(Y / 2)."""
        B, _, E = x.shape
        merged = merge_patches(x.reshape(B, *grid, E))
        merged = _norms.layer_norm(TORCH_LAYER_NORM_EPS, self.dtype, self.param_dtype, f"merge_{s}_norm")(merged)
        reduction = nn.Dense(
            2 * E, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
            name=f"merge_{s}_reduction",
        )  # fmt: skip
        grid = merged.shape[1:3]
        return reduction(merged).reshape(B, grid[0] * grid[1], 2 * E), grid


class SwinForImageClassification(nn.Module):
    """HF SwinForImageClassification: SwinModel's pooler_output through a Dense_L. Call with pixel_values
    [B,C,height,width]; returns the logits [B,L]."""

    config: SwinConfig
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    sharding: Any = None

    @nn.compact
    def __call__(self, pixel_values: Float[ArrayLike, "B C Yp Xp"], *, deterministic: bool = True):
        swin = SwinModel(self.config, True, self.dtype, self.param_dtype, self.precision, self.sharding, name="swin")
        pooled = swin(pixel_values, deterministic=deterministic)["pooler_output"]
        classifier = nn.Dense(
            self.config.num_labels, dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision,
            name="classifier",
        )  # fmt: skip
        return classifier(pooled)


# --- weights: one row per tensor (see jaxattn.models.weights) ---------------------------------------------------

# a block's tensors whose module names in transformers 5 differ from their names in checkpoint files
_RENAMED = {
    "attention.q_proj": "attention.self.query",
    "attention.k_proj": "attention.self.key",
    "attention.v_proj": "attention.self.value",
    "attention.o_proj": "attention.output.dense",
    "attention.relative_position_bias.relative_position_bias_table": "attention.self.relative_position_bias_table",
    "mlp.fc1": "intermediate.dense",
    "mlp.fc2": "output.dense",
}


def _block_rows(s: int, module_names: bool) -> list[weights.Row]:
    """Stage s's block rows ("{i}" the block), in HF's state_dict order."""
    R = weights.row
    E, N, H, F = f"E{s}", f"N{s}", f"H{s}", f"F{s}"
    block = f"encoder.layers.{s}.blocks.{{i}}."
    ours = f"stage_{s}_block_{{i}}/"

    def name(module: str, leaf: str) -> str:
        return block + (module if module_names else _RENAMED[module]) + leaf

    rows = [
        R(block + "layernorm_before.weight", (E,), ours + "layernorm_before/scale", (E,)),
        R(block + "layernorm_before.bias", (E,), ours + "layernorm_before/bias", (E,)),
    ]
    for module, leaf in (("attention.q_proj", "query"), ("attention.k_proj", "key"), ("attention.v_proj", "value")):
        kernel, bias = ours + f"attention/{leaf}/kernel", ours + f"attention/{leaf}/bias"
        rows.append(R(name(module, ".weight"), (f"{N}*{H}", E), kernel, (E, N, H), Steps(Transpose(), Reshape())))
        rows.append(R(name(module, ".bias"), (f"{N}*{H}",), bias, (N, H), Reshape()))
    table = "attention.relative_position_bias.relative_position_bias_table"
    return rows + [
        R(name("attention.o_proj", ".weight"), (E, f"{N}*{H}"), ours + "attention/out/kernel", (N, H, E),
          Steps(Transpose(), Reshape())),
        R(name("attention.o_proj", ".bias"), (E,), ours + "attention/out/bias", (E,)),
        R(name(table, ""), ("R", N), ours + "attention/window/table", ("R", N)),
        R(block + "layernorm_after.weight", (E,), ours + "layernorm_after/scale", (E,)),
        R(block + "layernorm_after.bias", (E,), ours + "layernorm_after/bias", (E,)),
        R(name("mlp.fc1", ".weight"), (F, E), ours + "fc1/kernel", (E, F), Transpose()),
        R(name("mlp.fc1", ".bias"), (F,), ours + "fc1/bias", (F,)),
        R(name("mlp.fc2", ".weight"), (E, F), ours + "fc2/kernel", (F, E), Transpose()),
        R(name("mlp.fc2", ".bias"), (E,), ours + "fc2/bias", (E,)),
    ]  # fmt: skip


def weight_table(config: SwinConfig, *, classifier: bool = False, module_names: bool = False) -> list[weights.Row]:
    """HF's names -> our params: SwinModel's (no prefix) or, with `classifier`, SwinForImageClassification's
    ("swin." and the classifier); the files' names, or with module_names transformers 5's modules' (_RENAMED)."""
    R = weights.row
    stages = len(config.depths)
    conv = ("E0", "C", "Pa", "Pb")  # nn.Conv2d's [out, in, kh, kw], kept as is (patch_embedding reads it so)
    rows = [
        R("embeddings.patch_embeddings.projection.weight", conv, "patch_kernel", conv),
        R("embeddings.patch_embeddings.projection.bias", ("E0",), "patch_bias", ("E0",)),
        R("embeddings.norm.weight", ("E0",), "embeddings_norm/scale", ("E0",)),
        R("embeddings.norm.bias", ("E0",), "embeddings_norm/bias", ("E0",)),
    ]  # fmt: skip
    if config.use_absolute_embeddings:
        rows.append(R("embeddings.position_embeddings", ("1", "P", "E0"), "position_embeddings", ("1", "P", "E0")))
    for s, depth in enumerate(config.depths):
        rows += weights.expand(_block_rows(s, module_names), depth)
        if s < stages - 1:
            E4 = f"4*E{s}"
            rows += [
                R(f"encoder.layers.{s}.downsample.reduction.weight", (f"2*E{s}", E4), f"merge_{s}_reduction/kernel",
                  (E4, f"2*E{s}"), Transpose()),
                R(f"encoder.layers.{s}.downsample.norm.weight", (E4,), f"merge_{s}_norm/scale", (E4,)),
                R(f"encoder.layers.{s}.downsample.norm.bias", (E4,), f"merge_{s}_norm/bias", (E4,)),
            ]  # fmt: skip
    last = f"E{stages - 1}"
    rows += [
        R("layernorm.weight", (last,), "layernorm/scale", (last,)),
        R("layernorm.bias", (last,), "layernorm/bias", (last,)),
    ]
    if not classifier:
        return rows
    return [
        *weights.prefixed([dataclasses.replace(r, targets=_under("swin", r.targets)) for r in rows], "swin."),
        R("classifier.weight", ("L", last), "classifier/kernel", (last, "L"), Transpose()),
        R("classifier.bias", ("L",), "classifier/bias", ("L",)),
    ]


def _under(scope: str, targets) -> tuple:
    return tuple(t._replace(path=f"{scope}/{t.path}") for t in targets)


def state_dict_names(config: SwinConfig, *, classifier: bool = False) -> list[str]:
    """Every parameter name of transformers 5's state_dict, in table order (buffers excluded)."""
    return [r.name for r in weight_table(config, classifier=classifier, module_names=True)]


def _module_names(tensors) -> bool:
    """Does a checkpoint name its blocks' tensors as transformers 5's modules do (else as files do)?"""
    return any(".attention.q_proj." in name for name in tensors)


# the relative_position_index buffers older checkpoints hold: checked to be window_relative_index, skipped
_INDEX_BUFFERS = ("attention.self.relative_position_index", "attention.relative_position_bias.relative_position_index")


def _fill(tensors, files, config: SwinConfig, *, classifier: bool, dtype) -> dict:
    index = np.asarray(window_relative_index(config.window_size)).reshape(-1)
    ignored = [name for name in tensors if name.endswith(_INDEX_BUFFERS)]
    for name in ignored:
        if np.asarray(tensors[name]).reshape(-1).tolist() != index.tolist():
            raise ValueError(
                f"{files[name]}: {name!r}: expected the relative_position_index of a {config.window_size}x"
                f"{config.window_size} window (jaxattn.window_relative_index), got other values"
            )
    rows = weight_table(config, classifier=classifier, module_names=_module_names(tensors))
    return weights.fill(tensors, rows, config.dims(), files, dtype=dtype, ignored=tuple(ignored))


def params_from_state_dict(
    state_dict: Mapping[str, Any], config: SwinConfig, *, classifier: bool = False, dtype: Optional[Any] = None
) -> dict:
    """HF SwinModel (or, with classifier, SwinForImageClassification) state_dict -> params, by the table; the
    files' names or transformers 5's modules' (a torch state_dict, or its gradients: every transform moves
    entries only)."""
    tensors = {name: np.asarray(value) for name, value in state_dict.items()}
    return _fill(tensors, {n: "state_dict" for n in tensors}, config, classifier=classifier, dtype=dtype)


def init_params(config: SwinConfig, rng=None, *, classifier: bool = False, **model_options) -> dict:
    """Fresh random params (for tests / training from scratch), shapes as the table's."""
    rng = jax.random.key(0) if rng is None else rng
    Pa, Pb = _pair(config.patch_size)
    grid = 2 ** (len(config.depths) - 1) * config.window_size  # every stage at least one window
    Y, X = config.patch_grid() if config.use_absolute_embeddings else (grid, grid)  # the embeddings' own size
    pixels = jnp.zeros((1, config.num_channels, Y * Pa, X * Pb), jnp.float32)
    model = (SwinForImageClassification if classifier else SwinModel)(config, **model_options)
    return model.init(rng, pixels)["params"]


# --- from_pretrained / to_pretrained --------------------------------------------------------------------------


@_pretrained.register_family("swin")
@_pretrained.loads(SwinConfig, SwinForImageClassification)
def load_pretrained(config: dict, tensors, files, *, dtype, precision, source):
    """(SwinForImageClassification, params) from a checkpoint with a classifier ("swin." names and
    classifier.*), else (SwinModel, params); the files' names or transformers 5's modules'."""
    swin_config = SwinConfig.from_dict(config, source)
    classifier = "classifier.weight" in tensors
    params = _fill(tensors, files, swin_config, classifier=classifier, dtype=dtype)
    model_class = SwinForImageClassification if classifier else SwinModel
    return model_class(swin_config, precision=precision), params


@_save.register_writer(SwinModel)
def checkpoint(model: SwinModel):
    """What to_pretrained writes for a SwinModel: the files' names (save_pretrained's), without prefix."""
    config = {**_save.config_json(model.config), "architectures": ["SwinModel"]}
    return config, weight_table(model.config), model.config.dims()


@_save.register_writer(SwinForImageClassification)
def classifier_checkpoint(model: SwinForImageClassification):
    """What to_pretrained writes for a SwinForImageClassification: "swin." names and the classifier."""
    return _save.config_json(model.config), weight_table(model.config, classifier=True), model.config.dims()
