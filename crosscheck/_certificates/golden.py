"""Golden files: torch's side of a certificate, recorded once, so that a JAX port certifies without torch.

    record(torch_model, {"input_ids": ids}, "golden.safetensors", layers={"model.layers.0.mlp": "l0.mlp"})
    certify(None, jax_fn, None, golden="golden.safetensors", layers={...})        # no torch imported

One safetensors file (written by jaxattn.io.save_safetensors): "inputs/<name>", "outputs/<name>",
"layers/<torch path>" (a module's later calls: "<path> (call 2)", ...), "grads/<input>", "param_grads/<torch
parameter name>" (record's `params`: d loss / d parameter, in torch's layout), "activation_grads/<torch path>"
(with grads and integer inputs only: d loss / d the first layer's output, see certify; with no layers, the
first floating activation's, whose value is "activations/<torch path>", for certify to find JAX's). Its metadata holds
one JSON document under "crosscheck.golden": format version, library versions, dtype, input shapes and
dtypes, the layers in forward order, the (torch path, JAX name) pairs they were recorded for (certify's
default `layers` with this file), the loss used for gradients, and the sha256 of the module's state_dict
(names, dtypes, shapes, bytes) when torch_fn is a module.

Refused (ValueError): a file of another checkpoint (`checkpoint_hash=` or a torch module given to certify
and the recorded hash differ), other input shapes or values, another dtype, gradients asked of a file
recorded without them, or parameter gradients it does not hold.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from crosscheck._certificates.reference import (
    FIRST_FLOATING,
    activation_pair,
    cast_inputs,
    checked_dtype,
    layer_pairs,
    nearest,
    run_torch,
    state_hash,
    versions,
)

FORMAT = 1
_KEY = "crosscheck.golden"


def record(
    torch_fn,
    inputs: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    layers=None,
    grads: bool = False,
    dtype: str = "float32",
    loss=None,
    logits: str | None = None,
    torch_module=None,
    params: Iterable[str] | None = None,
) -> Path:
    """Run `torch_fn(**inputs)` in `dtype` and write what certify compares against to `path` (see above).

    layers, loss, logits, torch_module: as for certify (only the torch paths of `layers` are used). A custom
    `loss` cannot be stored: certify must then be given the same one. params (with grads=True): the torch
    parameter names whose gradients are stored (certify's `params=` map works: its keys are taken). Returns
    the path.
    """
    from jaxattn.io import save_safetensors

    dtype = checked_dtype(dtype)
    inputs = cast_inputs(inputs, dtype)
    pairs = layer_pairs(layers)
    captured: dict[str, np.ndarray] = {}
    order: list[str] = []
    seen: dict[str, int] = {}

    def on_layer(index, layer_path, name, array):
        seen[layer_path] = seen.get(layer_path, 0) + 1
        label = layer_path if seen[layer_path] == 1 else f"{layer_path} (call {seen[layer_path]})"
        if array is not None:
            captured[label] = array
            order.append(label)

    names = list(params or ())
    if names and not grads:
        raise ValueError("params: parameter gradients are recorded with grads=True only")
    first = activation_pair(inputs, pairs, names) if grads else None
    outputs, input_grads, param_grads, activation_grads, activations = run_torch(
        torch_fn,
        inputs,
        dtype=dtype,
        pairs=pairs,
        torch_module=torch_module,
        on_layer=on_layer,
        grads=grads,
        loss=loss,
        logits=None if logits is False else (logits or "logits"),
        params=names,
        activation=None if first in (None, FIRST_FLOATING) else 0,
        first_floating=first == FIRST_FLOATING,
    )
    import torch

    module = torch_module if torch_module is not None else torch_fn
    meta = {
        "format": FORMAT,
        "versions": versions(),
        "dtype": dtype,
        "inputs": {k: {"shape": list(v.shape), "dtype": str(v.dtype)} for k, v in inputs.items()},
        "outputs": list(outputs),
        "layers": order,
        "pairs": [[path, name] for path, name, _ in pairs],
        "grads": sorted(input_grads) if grads else None,
        "param_grads": names if grads else None,
        "activation_grads": sorted(activation_grads) if grads else None,
        "loss": None
        if not grads
        else (
            "custom" if loss is not None else "labels" if "labels" in inputs and "logits" in outputs else "cotangent"
        ),
        "checkpoint_sha256": state_hash(module) if isinstance(module, torch.nn.Module) else None,
    }
    tensors = {
        **{f"inputs/{k}": v for k, v in inputs.items()},
        **{f"outputs/{k}": v for k, v in outputs.items()},
        **{f"layers/{k}": captured[k] for k in order},
        **{f"grads/{k}": v for k, v in input_grads.items()},
        **{f"param_grads/{k}": v for k, v in param_grads.items()},
        **{f"activation_grads/{k}": v for k, v in activation_grads.items()},
        **{f"activations/{k}": v for k, v in activations.items()},
    }
    return save_safetensors(tensors, path, metadata={"format": "np", _KEY: json.dumps(meta)})


@dataclasses.dataclass(frozen=True)
class Golden:
    path: str
    meta: Mapping[str, Any]
    inputs: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    layers: dict[str, np.ndarray]
    grads: dict[str, np.ndarray]
    param_grads: dict[str, np.ndarray]
    activation_grads: dict[str, np.ndarray]
    activations: dict[str, np.ndarray]  # the first floating activation's value (recorded with no layers)

    @property
    def versions(self) -> Mapping[str, Any]:
        return self.meta["versions"]

    def layer(self, label: str) -> np.ndarray:
        if label not in self.layers:
            raise nearest(label, list(self.layers), f"torch module path (recorded in {self.path})")
        return self.layers[label]

    def order(self, label: str) -> int:
        return self.meta["layers"].index(label)


def read_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The "__metadata__" of a safetensors file (the 8-byte header length, then the JSON header)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(size)).get("__metadata__", {})


def load_golden(
    path,
    inputs,
    *,
    dtype: str,
    torch_fn=None,
    checkpoint_hash: str | None = None,
    grads: bool = False,
    params: Iterable[str] = (),
) -> Golden:
    """Read a golden file and refuse it where it cannot certify this run (see the module docstring)."""
    from jaxattn.io import load_safetensors

    path = str(path)
    meta_text = read_metadata(path).get(_KEY)
    if meta_text is None:
        raise ValueError(f"golden: {path} is not a golden file written by crosscheck.record (no {_KEY!r} metadata)")
    meta = json.loads(meta_text)
    if meta.get("format") != FORMAT:
        raise ValueError(f"golden: {path} has format {meta.get('format')}, this crosscheck reads format {FORMAT}")
    if meta["dtype"] != dtype:
        raise ValueError(f"golden: {path} was recorded in {meta['dtype']}, certify asked for dtype={dtype!r}")
    if torch_fn is not None and checkpoint_hash is None:
        if not hasattr(torch_fn, "state_dict"):
            raise ValueError(
                "torch_fn: with golden=, expected None or the torch module the file was recorded "
                f"from (to check its checkpoint), got {type(torch_fn).__name__}"
            )
        checkpoint_hash = state_hash(torch_fn)
    recorded = meta.get("checkpoint_sha256")
    if checkpoint_hash is not None and checkpoint_hash != recorded:
        raise ValueError(
            f"golden: {path} was recorded from another checkpoint (sha256 {recorded}), not this one ({checkpoint_hash})"
        )
    tensors = load_safetensors(path)
    stored = {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith("inputs/")}
    if inputs is not None:
        given = cast_inputs(inputs, dtype)
        if set(given) != set(stored):
            raise ValueError(f"golden: {path} was recorded with inputs {sorted(stored)}, got {sorted(given)}")
        for k, v in given.items():
            if v.shape != stored[k].shape:
                raise ValueError(
                    f"golden: inputs[{k!r}] has shape {v.shape}, {path} was recorded with {stored[k].shape}"
                )
            if not np.array_equal(v, stored[k]):
                raise ValueError(f"golden: inputs[{k!r}] differs from the values {path} was recorded with")
    if grads and meta.get("grads") is None:
        raise ValueError(f"golden: grads=True, but {path} was recorded without gradients (record(..., grads=True))")

    def part(prefix):
        return {k.split("/", 1)[1]: v for k, v in tensors.items() if k.startswith(prefix + "/")}

    param_grads = part("param_grads")
    for name in params:
        if name not in param_grads:
            raise nearest(
                name,
                list(param_grads) or ["(none: record(..., grads=True, params=...))"],
                f"torch parameter (gradients recorded in {path})",
                "params",
            )
    outputs = part("outputs")
    return Golden(
        path,
        meta,
        stored,
        {k: outputs[k] for k in meta["outputs"]},
        part("layers"),
        part("grads"),
        param_grads,
        part("activation_grads"),
        part("activations"),
    )
