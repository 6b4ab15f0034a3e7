"""`from_pretrained(path)`: a directory written by transformers' save_pretrained -> (Flax model, params).

The directory holds config.json and either model.safetensors or shards listed by
model.safetensors.index.json ({"weight_map": {name: file}}). Files are read by jaxattn.io.load_safetensors
(no torch); each family maps names through its one explicit table (see jaxattn.models.weights and the family module).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..io import load_safetensors
from . import _activation_layout, _lazy_checkpoint, _partition_rules, quantized


@dataclasses.dataclass(frozen=True)
class Family:
    """A model_type's port as from_pretrained registers it: the config class it parses, the model class it
    builds (jaxattn.models exports both), and load(config dict, tensors, files, *, dtype, precision, source)
    -> (model, params). _decoder.loader and moe.loader make one; a family with its own loader function says
    its classes with @loads(ConfigClass, ModelClass)."""

    config_class: type
    model_class: type
    load: Callable

    def __call__(self, *args, **kwargs):
        return self.load(*args, **kwargs)


def loads(config_class: type, model_class: type) -> Callable[[Callable], Family]:
    """Decorator: a loader function as the Family of config_class and model_class."""
    return lambda load: Family(config_class, model_class, load)


# model_type -> its Family; filled by the family modules as they are imported.
_FAMILIES: dict[str, Family] = {}


def register_family(model_type: str) -> Callable[[Family], Family]:
    def add(family: Family) -> Family:
        _FAMILIES[model_type] = family
        return family

    return add


def registered_families() -> dict[str, Family]:
    """model_type -> Family, for every supported model_type (a copy)."""
    return dict(sorted(_FAMILIES.items()))


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(_FAMILIES))


def read_config(path: str | os.PathLike) -> dict:
    """config.json of a checkpoint directory, as a dict (FileNotFoundError / ValueError naming the file)."""
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory}: not a directory (from_pretrained takes a save_pretrained directory)")
    file = directory / "config.json"
    if not file.is_file():
        raise FileNotFoundError(
            f"{file}: no config.json in {directory} (from_pretrained needs the directory save_pretrained wrote)"
        )
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object, got a {type(config).__name__}")
    return config


def read_tensors(path: str | os.PathLike, read: Callable = load_safetensors) -> tuple[dict[str, Any], dict[str, str]]:
    """({name: array}, {name: file name}) from model.safetensors or the shards of its index.

    read(file) -> {name: tensor}: load_safetensors, or a reader of headers only (a sharded load)."""
    directory = Path(path)
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise ValueError(
                f"{index}: expected JSON with a 'weight_map' {{name: file}}, got an error: {error!r}"
            ) from None
        tensors, files = {}, {}
        for shard in sorted(set(weight_map.values())):
            for name, array in read(directory / shard).items():
                if weight_map.get(name) != shard:
                    raise ValueError(
                        f"{directory / shard}: tensor {name!r} is not listed for this file in "
                        f"{index.name} (listed: {weight_map.get(name)!r})"
                    )
                tensors[name], files[name] = array, shard
        listed_only = sorted(set(weight_map) - set(tensors))
        if listed_only:
            raise ValueError(f"{index}: names listed but in no shard: {listed_only}")
        return tensors, files
    single = directory / "model.safetensors"
    if not single.is_file():
        found = sorted(p.name for p in directory.iterdir())
        raise FileNotFoundError(
            f"{single}: no model.safetensors and no model.safetensors.index.json in "
            f"{directory} (found {found}); .bin/.pt checkpoints need torch: "
            f"re-save with save_pretrained(safe_serialization=True)"
        )
    tensors = read(single)
    return tensors, {name: single.name for name in tensors}


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: Any | None = None,
    precision: Any = None,
    mesh=None,
    rules=None,
    dequantize: bool = False,
):
    """(model, params) for a save_pretrained directory of a supported model_type, without torch.

    dtype: cast every floating tensor to it (e.g. "float32" for a bf16 checkpoint); None keeps the file's
    dtypes (bf16 stays bf16, and the model computes in it).
    A quantized checkpoint (jaxattn.models.quantized): gpt-oss's MXFP4 experts stay packed by default
    (params kernel_blocks / kernel_scales, decoded inside the matmul; to_pretrained writes them back as
    they were), and so do the block-FP8 projections of Qwen 3, Qwen3-MoE and DeepSeek V3 (kernel_fp8 /
    kernel_scale_inv, decoded as each layer is applied); dequantize=True or a dtype gives plain params instead,
    decoded as they are read (to dtype; None: bfloat16).
    The model is a Flax linen module: model.apply({"params": params}, input_ids, attention_mask=...) (see the
    family's module). Its config.hf_config is config.json's dict, whose keys the port does not read
    to_pretrained writes back.
    precision: the model's einsum/matmul precision (e.g. "highest" to keep float32 exact on TPU/GPU).
    mesh: a jax.sharding.Mesh (axes "data" and/or "model", and "seq" for sequence parallel): every
    parameter is a jax.Array sharded by the family's rules, each process reading only the byte ranges of
    its own devices' shards; the model keeps its activations on the mesh (see _activation_layout.py).
    rules: ((pattern, PartitionSpec), ...) or {pattern: spec}, tried before the family's
    (jaxattn.models.partition_rules(model_type)); only with a mesh.
    """
    config = read_config(path)
    _family(config, Path(path) / "config.json")
    check_config(config, Path(path) / "config.json")
    form = quantized.scheme(config, Path(path) / "config.json")
    if mesh is None:
        if rules is not None:
            raise ValueError(f"rules: expected None without a mesh (they lay parameters out on one), got {rules!r}")
        config, tensors, files = _plain(config, form, *read_tensors(path), dtype, dequantize)
        return _load(config, tensors, files, dtype, precision, Path(path) / "config.json")
    sharded_rules = _partition_rules.Rules.of(config["model_type"], mesh, rules)
    sharding = _activation_layout.ModelSharding.of(mesh, config["model_type"])
    lazy = read_tensors(path, _lazy_checkpoint.lazy_reader(path))
    config, tensors, files = _plain(config, form, *lazy, dtype, dequantize)
    checkpoint = _lazy_checkpoint.ShardedCheckpoint(tensors, sharded_rules)
    model, params = _load(config, checkpoint, files, dtype, precision, Path(path) / "config.json")
    return model.clone(sharding=sharding), params


def from_state_dict(
    config: dict, state_dict, *, dtype: Any | None = None, precision: Any = None, dequantize: bool = False
):
    """(model, params) from a config.json dict and a {name: array} state_dict already in memory.

    The same tables and checks as from_pretrained (errors name "state_dict" where they would name a file;
    dequantize as there).
    Gradients taken in torch convert the same way (every table transform is a permutation or a split).
    """
    _family(config, "config")
    form = quantized.scheme(config, "config")
    tensors = {k: np.asarray(v) for k, v in state_dict.items()}
    config, tensors, files = _plain(config, form, tensors, {k: "state_dict" for k in tensors}, dtype, dequantize)
    return _load(config, tensors, files, dtype, precision, "config")


# the quantized formats a family keeps packed in its params (else they are decoded as they are read)
_KEPT_PACKED = {("gpt_oss", "mxfp4"), ("qwen3", "fp8"), ("qwen3_moe", "fp8"), ("deepseek_v3", "fp8")}


def _plain(config: dict, form, tensors, files, dtype, dequantize: bool):
    """A quantized checkpoint (form: quantized.scheme's) as the plain one it decodes to: its tensors decoded
    when read (to dtype; None: bfloat16) and its config without quantization_config (the params are plain:
    to_pretrained writes them so); one the family keeps packed (no dtype, no dequantize) only checked; any
    other checkpoint as it is."""
    if form is None:
        return config, tensors, files
    if dtype is None and not dequantize and (config["model_type"], form.quant_method) in _KEPT_PACKED:
        quantized.check_pairs(form, tensors, files)
        return config, tensors, files
    tensors, files = quantized.plain_tensors(form, tensors, files, None if dtype is None else jnp.dtype(dtype))
    return {k: v for k, v in config.items() if k != "quantization_config"}, tensors, files


# The keys every tensor's shape follows from, in each model_type's naming: a config.json must hold them (HF's
# save_pretrained writes them all), so that a missing one is named instead of filled by a default that only
# surfaces later as a shape mismatch.
_SHAPE_KEYS = {
    "gpt2": ("vocab_size", "n_embd", "n_head", "n_layer"),
    "t5": ("vocab_size", "d_model", "num_heads", "num_layers", "d_ff", "d_kv"),
    "swin": ("num_channels", "embed_dim", "window_size"),  # depths / num_heads: lists, SwinConfig.from_dict checks
}
_NO_HEAD_DIVISION = ("t5", "swin")  # keys[1] % keys[2] is no head check for these
_DECODER_SHAPE_KEYS = ("vocab_size", "hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size")
# checked where present and not null: positive integers, positive numbers, non-negative numbers
_POSITIVE_INTS = ("num_key_value_heads", "head_dim", "n_inner", "n_positions", "max_position_embeddings")
_POSITIVE_NUMBERS = ("rope_theta",)
_NON_NEGATIVE_NUMBERS = ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon")


def check_config(config: dict, source) -> None:
    """Refuse by name, before any tensor is read, a config.json whose shape keys are missing or not positive
    integers, whose rope_theta (also inside rope_parameters) is not a positive number, whose norm epsilon is
    not a non-negative number, or whose heads do not divide the width (without a head_dim) or are not a
    multiple of the key/value heads."""
    keys = _SHAPE_KEYS.get(config["model_type"], _DECODER_SHAPE_KEYS)
    width, heads = keys[1], keys[2]
    for key in keys:
        if config.get(key) is None:
            raise ValueError(f"{source}: {key}: missing (a required key: every weight's shape depends on it)")
    for key in (*keys, *_POSITIVE_INTS):
        value = config.get(key)
        if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value > 0):
            raise ValueError(f"{source}: {key}: expected a positive integer, got {value!r}")
    numbers = [(key, config.get(key)) for key in (*_POSITIVE_NUMBERS, *_NON_NEGATIVE_NUMBERS)]
    rope = _rope_thetas(config.get("rope_parameters"))
    numbers += [(f"rope_parameters{where}['rope_theta']", value) for where, value in rope]
    for key, value in numbers:
        if value is None:
            continue
        positive = key not in _NON_NEGATIVE_NUMBERS
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not (value > 0 or (value == 0 and not positive)):
            wanted = "a positive number" if positive else "a non-negative number"
            raise ValueError(f"{source}: {key}: expected {wanted}, got {value!r}")
    if (
        config.get("head_dim") is None
        and config[width] % config[heads]
        and config["model_type"] not in _NO_HEAD_DIVISION
    ):
        raise ValueError(
            f"{source}: {heads}: expected a divisor of {width}={config[width]} (no head_dim is given), "
            f"got {config[heads]}"
        )
    kv = config.get("num_key_value_heads")
    if kv is not None and config[heads] % kv:
        raise ValueError(f"{source}: num_key_value_heads: expected a divisor of {heads}={config[heads]}, got {kv}")


def _rope_thetas(rope, where: str = ""):
    """[(where, value)] of every rope_theta in rope_parameters, one level per layer type (Gemma 3's)."""
    if not isinstance(rope, dict):
        return []
    found = [(where, rope["rope_theta"])] if "rope_theta" in rope else []
    for key, value in rope.items():
        if isinstance(value, dict):
            found += _rope_thetas(value, f"{where}[{key!r}]")
    return found


def _family(config: dict, source):
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        raise ValueError(f"{source}: model_type: expected one of {list(supported_model_types())}, got {model_type!r}")
    return _FAMILIES[model_type]


def _load(config, tensors, files, dtype, precision, source):
    dtype = None if dtype is None else jnp.dtype(dtype)
    model, params = _family(config, source)(config, tensors, files, dtype=dtype, precision=precision, source=source)
    if "hf_config" in {f.name for f in dataclasses.fields(model.config)}:
        # the dict the config was parsed from, for the keys the port does not read (to_pretrained writes them back)
        model = model.clone(config=dataclasses.replace(model.config, hf_config=copy.deepcopy(config)))
    return model, params


def refuse(source, key: str, expected, got) -> None:
    """A config option this port does not implement: ValueError naming the file and the key."""
    raise ValueError(f"{source}: {key}: expected {expected} (what jaxattn.models implements), got {got!r}")
