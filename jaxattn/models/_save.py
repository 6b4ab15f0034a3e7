"""`to_pretrained(model, params, path)`: the way back, a directory transformers' from_pretrained loads.

It writes config.json and model.safetensors, or shards model-0000k-of-0000n.safetensors with
model.safetensors.index.json, as save_pretrained does. The tensors are the family's weight table read in
reverse (weights.unfill: the same rows from_pretrained fills from, no second map), written by
jaxattn.io.safetensors_writer (no torch) and swapped in without ever losing the old set (_checkpoint_swap).
config.json holds the values the model was built from: the config.json dict it was read from
(`config.hf_config`, which from_pretrained and from_state_dict attach), overridden by what the family's
config maps to HF's keys (`config.to_dict()`), and checked: parsed back by the family's from_dict it must
give the model's config, field for field, or nothing is written.

A family provides: a config dataclass with an `hf_config` field (compare=False), `from_dict(dict, source)`
and `to_dict()` (its fields under HF's keys, model_type and architectures included), and a writer
registered with `register_writer(ModelClass)`: writer(model) -> (config_json(model.config), the weight
table's rows for this model, their dims). The Llama-shaped families get the writer from _decoder.loader,
which registers both ways.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from .. import _atomic_files as atomic_files, io
from . import weights
from ._checkpoint_swap import CONFIG, INDEX, SINGLE, swap_in

# model class -> writer(model) -> (config.json dict, rows, dims); filled by the families.
_WRITERS: dict[type, Callable] = {}

_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}  # huggingface_hub's parse_size_to_int
DEFAULT_SHARD_SIZE = "50GB"  # save_pretrained's default


def register_writer(model_class: type):
    def add(writer):
        _WRITERS[model_class] = writer
        return writer

    return add


def config_json(config) -> dict:
    """config.json's dict for a family config: its hf_config (None: {}) overridden by config.to_dict(), without
    transformers 4's "torch_dtype" (to_pretrained writes "dtype"). ValueError naming every field that the
    config's from_dict does not read back equal (a config the HF keys cannot express, e.g. rope frequencies
    set by hand without the rope settings in hf_config)."""
    written = {k: v for k, v in copy.deepcopy(dict(config.hf_config or {})).items() if k != "torch_dtype"}
    written.update(config.to_dict())
    if not isinstance(written.get("model_type"), str):
        raise ValueError(
            f"model.config: expected a model_type from to_dict() or hf_config (transformers picks the "
            f"model by it), got {written.get('model_type')!r}"
        )
    back = type(config).from_dict(written, "config.json")
    differ = [
        f"{f.name}: {getattr(config, f.name)!r} would be read back as {getattr(back, f.name)!r}"
        for f in dataclasses.fields(config)
        if f.compare and getattr(config, f.name) != getattr(back, f.name)
    ]
    if differ:
        raise ValueError(
            f"model.config: expected a config that config.json can hold, got fields its HF keys "
            f"do not reproduce: {'; '.join(differ)} (keys no field maps, e.g. rope_parameters, come "
            f"from config.hf_config)"
        )
    return written


def shard_size(max_shard_size) -> int:
    """Bytes from an int >= 1 or a string as save_pretrained takes it ("5GB", "500MB", "1.5KB"; 10^3 units);
    None: save_pretrained's default, 50GB."""
    value = DEFAULT_SHARD_SIZE if max_shard_size is None else max_shard_size
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str) and value.strip()[-2:].upper() in _SIZE_UNITS:
        number, unit = value.strip()[:-2], value.strip()[-2:].upper()
        try:
            size = int(float(number) * _SIZE_UNITS[unit])
        except ValueError:  # not a number
            size = 0
        if size >= 1:
            return size
    raise ValueError(
        f"max_shard_size: expected an int >= 1 (bytes) or a size such as '5GB' (units "
        f"{list(_SIZE_UNITS)}), got {max_shard_size!r}"
    )


def shards(tensors: Mapping[str, np.ndarray], limit: int) -> list[list[str]]:
    """Names per file, in order, as huggingface_hub splits a state_dict: a tensor larger than `limit` gets a
    file of its own; otherwise a file is closed when the next tensor would take it over `limit`. A tensor
    is never split across files."""
    files, current, used = [], [], 0
    for name, x in tensors.items():
        if x.nbytes > limit:
            files.append([name])
            continue
        if used + x.nbytes > limit:
            files.append(current)
            current, used = [], 0
        current.append(name)
        used += x.nbytes
    return files + [current] if current or not files else files


def to_pretrained(
    model, params, path: str | os.PathLike, *, dtype: Any | None = None, max_shard_size: int | str | None = None
) -> Path:
    """Write (model, params) as a save_pretrained directory that transformers loads with no missing or
    unexpected keys; returns the directory.

    model: a jaxattn.models model (from from_pretrained, from_state_dict, or built in Python with its
    family's config). params: its params tree (numpy or JAX arrays), e.g. after training in JAX; it must
    be exactly the tree the family's weight table reads (ValueError naming each missing, unread or
    misshapen leaf with both shapes). dtype: cast every floating tensor to it (e.g. "bfloat16"); None
    keeps the params' dtypes (bf16 stays bf16). config.json's "dtype" is the first floating tensor's, as
    save_pretrained writes it. max_shard_size: bytes per file (an int, or "5GB" as save_pretrained takes
    it; None: its default 50GB); one file when everything fits, else shards and the index
    ({"metadata": {"total_parameters", "total_size"}, "weight_map": {name: file}}).

    A tied head is written once, as the embeddings (transformers ties it on load). An existing directory
    is written into as save_pretrained does: the files written are replaced, and weight files of an earlier
    save that would shadow the new ones (model.safetensors, the index, other model-*-of-* shards) are
    removed; nothing else is touched. No checkpoint is lost on the way (_checkpoint_swap): the new files
    are written whole under hidden names first and swapped in so that a reader finds the complete old set
    or the complete new one; a save that fails (a full disk, an interrupt, a bad leaf) leaves the directory
    as it was, and one that is killed leaves only hidden files, which the next save removes.
    """
    writer = _WRITERS.get(type(model))
    if writer is None:
        raise ValueError(
            f"model: expected a jaxattn.models model of one of "
            f"{sorted(c.__name__ for c in _WRITERS)}, got {type(model).__name__}"
        )
    try:
        floating_dtype = dtype is None or jnp.issubdtype(jnp.dtype(dtype), jnp.floating)
    except TypeError:  # not a dtype at all
        floating_dtype = False
    if not floating_dtype:
        raise ValueError(f"dtype: expected a floating dtype (e.g. 'bfloat16') or None, got {dtype!r}")
    limit = shard_size(max_shard_size)
    config, rows, dims = writer(model)
    tensors = weights.unfill(params, rows, dims, dtype=None if dtype is None else jnp.dtype(dtype))
    floating = [x.dtype for x in tensors.values() if jnp.issubdtype(x.dtype, jnp.floating)]
    if floating:
        config["dtype"] = str(floating[0])
    directory = Path(path)
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"path: expected a directory (or a new one), got the file {directory}")
    groups = shards(tensors, limit)
    names = (
        [SINGLE]
        if len(groups) == 1
        else [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors" for k in range(len(groups))]
    )
    files = {CONFIG: _text_writer(json.dumps(config, indent=2, sort_keys=True) + "\n")}
    for name, group in zip(names, groups):  # every tensor checked here, before a file is written
        files[name] = io.safetensors_writer({k: tensors[k] for k in group})
    if len(groups) > 1:
        index = {
            "metadata": {
                "total_parameters": sum(x.size for x in tensors.values()),
                "total_size": sum(x.nbytes for x in tensors.values()),
            },
            "weight_map": {k: name for name, group in zip(names, groups) for k in group},
        }
        files[INDEX] = _text_writer(json.dumps(index, indent=2, sort_keys=True) + "\n")
    made = _make_directories(directory)
    try:
        swap_in(directory, files)
    except BaseException:
        for new in made:  # a directory this save made goes with it (empty again: swap_in removed its files)
            with contextlib.suppress(OSError):
                new.rmdir()
        raise
    return directory


def _text_writer(text: str) -> Callable[[int], None]:
    data = text.encode()
    return lambda fd: atomic_files.write_all(fd, data)


def _make_directories(directory: Path) -> list[Path]:
    """mkdir -p; the directories it made, innermost first."""
    made = [p for p in (directory, *directory.parents) if not p.exists()]
    directory.mkdir(parents=True, exist_ok=True)
    return made
