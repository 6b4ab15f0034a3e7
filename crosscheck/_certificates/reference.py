"""The reference side of a certificate (crosscheck.certify) and of a golden file (crosscheck.record): the
inputs cast to the run's dtype, torch's run with its forward hooks on the named layers, the scalar loss and
its cotangents, and what identifies a run (library versions, the checkpoint's hash). Both certify and record
drive it, so a golden file holds exactly what a live torch run would have given certify.
"""

from __future__ import annotations

import difflib
import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from crosscheck._comparison.compare import TOLERANCES


def versions() -> dict[str, str | None]:
    """Versions of the libraries a certificate depends on (None: not installed)."""
    import importlib.metadata

    found = {}
    for name in ("torch", "jax", "jaxlib", "transformers", "flax"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def named_outputs(out: Any, prefix: str = "") -> dict[str, Any]:
    """An output tree -> {name: array}: `.logits` objects give "logits"; dicts their keys; sequences "[i]"."""
    if not isinstance(out, Mapping) and getattr(out, "logits", None) is not None:
        return {"logits": out.logits}
    if isinstance(out, Mapping) and "logits" in out and hasattr(out, "to_tuple"):  # transformers' ModelOutput
        return {"logits": out["logits"]}
    if isinstance(out, Mapping):
        flat: dict[str, Any] = {}
        for k, v in out.items():
            if v is not None:
                flat.update(named_outputs(v, f"{prefix}.{k}" if prefix else str(k)))
        return flat
    if isinstance(out, (tuple, list)):
        flat = {}
        for i, v in enumerate(out):
            flat.update(named_outputs(v, f"{prefix}[{i}]" if prefix else f"output[{i}]"))
        return flat
    return {prefix or "output": out}


def flat_intermediates(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Flax / nnx intermediates {"intermediates": {"block": {"mlp": (x,)}}} -> {"block/mlp": x}."""
    if isinstance(tree, Mapping):
        if set(tree) == {"intermediates"} and not prefix:
            return flat_intermediates(tree["intermediates"])
        flat: dict[str, Any] = {}
        for k, v in tree.items():
            flat.update(flat_intermediates(v, f"{prefix}/{k}" if prefix else str(k)))
        return flat
    if hasattr(tree, "value") and not hasattr(tree, "shape"):  # an nnx Variable
        return flat_intermediates(tree.value, prefix)
    if isinstance(tree, (tuple, list)):
        if len(tree) == 1:
            return flat_intermediates(tree[0], prefix)
        return {k: v for i, t in enumerate(tree) for k, v in flat_intermediates(t, f"{prefix}[{i}]").items()}
    return {prefix: tree}


def nearest(name: str, candidates: Sequence[str], what: str, argument: str = "layers") -> ValueError:
    close = difflib.get_close_matches(name, list(candidates), n=5, cutoff=0.4)
    return ValueError(f"{argument}: {what} {name!r} does not exist; nearest: {close or sorted(candidates)[:10]}")


def layer_pairs(layers: Any) -> list[tuple[str, str, Callable[[np.ndarray], np.ndarray] | None]]:
    """{path: name} / {path: (name, transform)} / [(path, name[, transform]), ...] -> [(path, name, transform)]."""
    if layers is None:
        return []
    items = layers.items() if isinstance(layers, Mapping) else layers
    pairs = []
    for item in items:
        path, target = item[0], item[1] if len(item) == 2 else tuple(item[1:])
        name, transform = (target, None) if isinstance(target, str) else (target[0], target[1])
        if not isinstance(path, str) or not isinstance(name, str):
            raise ValueError(f"layers: expected {{torch module path: JAX name}} strings, got {item!r}")
        pairs.append((path, name, transform))
    return pairs


def checked_dtype(dtype: Any) -> str:
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    if name not in TOLERANCES:
        raise ValueError(f"dtype: expected one of {sorted(TOLERANCES)}, got {dtype!r}")
    if name == "float64":
        import jax

        if not jax.config.x64_enabled:
            raise RuntimeError(
                "dtype: float64 needs JAX's x64 mode (jax.config.update('jax_enable_x64', True)); "
                "without it JAX would silently compute in float32"
            )
    return name


def cast_inputs(inputs: Mapping[str, Any], dtype: str) -> dict[str, np.ndarray]:
    out = {}
    for k, v in inputs.items():
        v = np.asarray(v)
        out[k] = v.astype(dtype) if np.issubdtype(v.dtype, np.floating) else v
    return out


def state_hash(module) -> str:
    """sha256 over a torch module's state_dict: names, shapes and values, in name order. Floating tensors are
    hashed as float64 (exact from float32 / bfloat16), so a module cast to the certificate's dtype in place
    keeps the hash of the checkpoint it was loaded from. The same number as checkpoint_hash of its entries."""
    return checkpoint_hash(
        {
            name: (tensor.detach().cpu().double() if tensor.is_floating_point() else tensor.detach().cpu()).numpy()
            for name, tensor in module.state_dict().items()
        }
    )


def checkpoint_hash(source) -> str:
    """certify's checkpoint hash (the golden file's checkpoint_sha256) without torch: of {name: array}, of a
    .safetensors file, or of a save_pretrained directory (every .safetensors file in it: the model or its
    shards). Equal to the hash
    of a torch module whose state_dict has exactly these entries; save_pretrained stores a tied weight once,
    where state_dict() lists it under each name, so for a tied model hash the state_dict's arrays instead."""
    import os
    from pathlib import Path

    if isinstance(source, (str, os.PathLike)):
        from jaxattn.io import load_safetensors

        path = Path(source)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files:
            raise FileNotFoundError(f"{path}: no .safetensors file in it (checkpoint_hash reads save_pretrained's)")
        source = {name: array for file in files for name, array in load_safetensors(file).items()}
    digest = hashlib.sha256()
    for name in sorted(source):
        array = np.asarray(source[name])
        if not np.issubdtype(array.dtype, np.integer) and array.dtype != np.bool_:
            array = array.astype(np.float64)  # exact from float32, float16 and bfloat16 (ml_dtypes)
        array = np.ascontiguousarray(array)
        digest.update(f"{name}|torch.{array.dtype.name}|{tuple(int(n) for n in array.shape)}|".encode())
        digest.update(array.reshape(-1).view(np.uint8).tobytes())
    return digest.hexdigest()


def need_torch(what: str):
    try:
        import torch
    except ImportError:
        raise ImportError(
            f'{what} runs the PyTorch model and needs torch: pip install torch (or "jaxattn[torch]"), '
            "or certify against a golden file: certify(None, jax_fn, inputs, golden=PATH), "
            "PATH written by crosscheck.record on a machine with torch"
        ) from None
    return torch


def first_tensor(value) -> Any:
    """A module's output -> its first array (a tuple's first element, a mapping's first value, recursively)."""
    while isinstance(value, (tuple, list)) or (isinstance(value, Mapping) and value):
        value = value[0] if isinstance(value, (tuple, list)) else next(iter(value.values()))
    return value


def to_numpy(value) -> np.ndarray:
    return first_tensor(value).detach().cpu().numpy()


# activation_pair's answer when no pair is given: the first floating activation, found on both sides
FIRST_FLOATING = "first floating activation"


def activation_pair(inputs: Mapping[str, np.ndarray], pairs, params: Sequence[str]):
    """Where grads=True takes the loss's gradient besides the inputs and parameters: None when a floating input
    or a mapped parameter is differentiated; else (every input an integer: token ids) the first layer pair's
    output, or FIRST_FLOATING with no pair: the first floating activation each side makes from the inputs
    (the embedding output; run_torch's first_floating, activation_grad.first_floating_program)."""
    if any(np.issubdtype(np.asarray(v).dtype, np.floating) for v in inputs.values()) or params:
        return None
    return pairs[0] if pairs else FIRST_FLOATING


def output_element(path: str) -> tuple[str, int | None]:
    """ "model.layers.1.router[1]" -> ("model.layers.1.router", 1): element 1 of the tuple the module returns
    (HF's routers return (scores, logits)); a plain path -> (path, None): the module's output, or the first
    array in it."""
    if path.endswith("]") and "[" in path:
        base, _, index = path[:-1].rpartition("[")
        if index.isdigit():
            return base, int(index)
    return path, None


def run_torch(
    torch_fn,
    inputs: Mapping[str, np.ndarray],
    *,
    dtype: str,
    pairs,
    torch_module=None,
    on_layer: Callable[[int, str, str, np.ndarray | None], None],
    grads: bool = False,
    loss=None,
    logits: str | None = None,
    params: Sequence[str] = (),
    activation: int | None = None,
    first_floating: bool = False,
):
    """torch_fn(**inputs) with forward hooks on the `pairs`' module paths; `on_layer(index, path, name, array)`
    per hooked call in firing order (array None: never ran). With grads, the loss is differentiated with
    respect to the floating inputs, the module's parameters named in `params` (named_parameters() names) and
    the output of pair number `activation` (its first call; in JAX's layout when the pair has a transform),
    or with `first_floating` that of the first module, in the order forward hooks fire, whose output is
    floating and depends on a parameter (the embeddings, when the inputs are token ids).
    Returns ({output: array}, {input: grad}, {parameter: grad}, {torch path: grad} (the activation's),
    {torch path: the activation's value} (first_floating's only))."""
    torch = need_torch("certify(torch_fn, ...)")
    module = torch_module if torch_module is not None else torch_fn
    is_module = isinstance(module, torch.nn.Module)
    if is_module:
        module.to(getattr(torch, dtype)).eval()
    if pairs and not is_module:
        raise ValueError("layers: module paths need torch_fn to be a torch.nn.Module (or torch_module=)")
    if first_floating and not is_module:
        raise ValueError(
            "grads: every input is an integer, so the gradient is taken at the first floating activation, which "
            "is found by forward hooks on torch_fn's modules: torch_fn must be a torch.nn.Module (or give "
            "torch_module=), or give layers= / params="
        )
    weights = torch_parameters(module, params) if grads and params else {}
    queues: dict[int, list[tuple[int, str, str, Any]]] = {}
    targets = {}
    for index, (path, name, transform) in enumerate(pairs):
        module_path, element = output_element(path)
        try:
            target = module.get_submodule(module_path)
        except AttributeError:
            raise nearest(
                module_path, [n for n, _ in module.named_modules(remove_duplicate=False) if n], "torch module path"
            ) from None
        targets[id(target)] = target
        queues.setdefault(id(target), []).append((index, path, name, transform, element))
    ran: set[int] = set()
    held: dict[str, Any] = {}  # torch path -> the activation tensor, kept in the graph for its gradient

    def hook(queue):
        calls = iter(queue)

        def on_call(mod, args, out):
            entry = next(calls, None)
            if entry is not None:
                index, path, name, transform, element = entry
                if grads and index == activation:
                    held[path] = first_tensor(out if element is None else out[element])
                array = to_numpy(out if element is None else out[element])
                ran.add(index)
                on_layer(index, path, name, array if transform is None else np.asarray(transform(array)))

        return on_call

    values: dict[str, np.ndarray] = {}  # first_floating's activation: torch path -> its value

    def first_floating_hook(path):
        def on_call(mod, args, out):
            tensor = first_tensor(out)
            if not held and isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.requires_grad:
                held[path], values[path] = tensor, tensor.detach().cpu().numpy()

        return on_call

    tensors = {k: torch.from_numpy(np.array(v)) for k, v in inputs.items()}
    if grads:
        for t in tensors.values():
            t.requires_grad_(t.is_floating_point())
    handles = [targets[key].register_forward_hook(hook(queue)) for key, queue in queues.items()]
    if grads and first_floating:
        handles += [
            m.register_forward_hook(first_floating_hook(path or "(model)")) for path, m in module.named_modules()
        ]
    try:
        with torch.set_grad_enabled(grads):
            raw = named_outputs(torch_fn(**tensors))
    finally:
        for handle in handles:
            handle.remove()
    for index, (path, name, _) in enumerate(pairs):
        if index not in ran:
            on_layer(index, path, name, None)
    outputs = {k: v.detach().cpu().numpy() for k, v in raw.items()}
    input_grads: dict[str, np.ndarray] = {}
    param_grads: dict[str, np.ndarray] = {}
    activation_grads: dict[str, np.ndarray] = {}
    if grads:
        wrt = {k: t for k, t in tensors.items() if t.requires_grad}
        if first_floating and not held:
            raise ValueError(
                "grads: every input is an integer and no module's output is floating and depends on a parameter "
                "(requires_grad), so there is no activation to take the gradient at: give params= or layers="
            )
        if activation is not None and not (held and next(iter(held.values())).requires_grad):
            path = pairs[activation][0]
            raise ValueError(
                f"grads: the output of layers {path!r} is compared for the gradient (every input is an integer), "
                + ("but that module never ran" if not held else "but it does not depend on any parameter")
            )
        if wrt or weights or held:
            scalar = loss_value(torch, raw, tensors, outputs, loss, logits)
            wanted = [
                *((("input", k), t) for k, t in wrt.items()),
                *((("param", k), t) for k, t in weights.items()),
                *((("activation", k), t) for k, t in held.items()),
            ]
            got = torch.autograd.grad(scalar, [t for _, t in wanted], allow_unused=True)
            every = {  # a parameter the loss never reached: zeros
                key: np.zeros(tuple(t.shape), dtype) if g is None else g.detach().cpu().numpy()
                for (key, t), g in zip(wanted, got, strict=True)
            }
            input_grads = {k: every["input", k] for k in wrt}
            param_grads = {k: every["param", k] for k in weights}
            for path in held:  # a layout transform moves a gradient's entries as it moves the activation's
                transform = None if first_floating else pairs[activation][2]
                g = every["activation", path]
                activation_grads[path] = g if transform is None else np.asarray(transform(g))
    return outputs, input_grads, param_grads, activation_grads, values


def torch_parameters(module, names: Sequence[str]) -> dict[str, Any]:
    """{name: parameter} of a torch module, by named_parameters() name (ValueError with the nearest names)."""
    import torch

    if not isinstance(module, torch.nn.Module):
        raise ValueError("params: parameter gradients need torch_fn to be a torch.nn.Module (or torch_module=)")
    found = dict(module.named_parameters())
    for name in names:
        if name not in found:
            raise nearest(name, list(found), "torch parameter", "params")
    return {name: found[name] for name in names}


def loss_value(xp, outputs, inputs, reference, loss, logits, cots=None):
    """The scalar both sides differentiate: `loss(outputs, inputs)`; else the mean log-likelihood of
    inputs["labels"] under the logits; else sum(out * c) with one seeded cotangent c per output
    (`cots`: those cotangents, already made from `reference`, e.g. as arguments of a jitted function)."""
    if loss is not None:
        return loss(outputs, inputs)
    if logits is not None and logits in outputs and "labels" in inputs:
        labels = inputs["labels"]
        if hasattr(xp, "nn") and hasattr(xp.nn, "functional"):  # torch
            logp = xp.log_softmax(outputs[logits], dim=-1)
            return xp.take_along_dim(logp, labels.long()[..., None], dim=-1).mean()
        import jax

        logp = jax.nn.log_softmax(outputs[logits], axis=-1)
        return xp.take_along_axis(logp, labels[..., None].astype(xp.int32), axis=-1).mean()
    total = 0.0
    for name, cot in (cotangents(reference) if cots is None else cots).items():
        total = total + (outputs[name] * (xp.from_numpy(cot) if hasattr(xp, "from_numpy") else cot)).sum()
    return total


def cotangents(reference: Mapping[str, np.ndarray], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 2)
    return {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in reference.items()}
