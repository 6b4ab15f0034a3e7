"""Weight files -> ``{name: numpy array}``, without ever running code from the file.

``.safetensors`` goes through ``jaxattn.io.load_safetensors`` (its own parser, no torch). Pickle-based files
(``.pt``, ``.pth``, ``.bin``) go only through ``torch.load(weights_only=True)``, whose restricted unpickler
refuses anything but tensors and plain containers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np

from jaxattn.io import load_safetensors

SAFETENSORS_SUFFIXES = (".safetensors",)
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
SUPPORTED_SUFFIXES = SAFETENSORS_SUFFIXES + TORCH_SUFFIXES


def load_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """``{name: numpy array}`` from a ``.safetensors``, ``.pt``, ``.pth`` or ``.bin`` file, dtypes unchanged.

    ``.safetensors`` needs no torch (bfloat16 comes back as ``ml_dtypes.bfloat16``, as JAX uses it).
    ``.pt``/``.pth``/``.bin`` need torch and are read only with ``torch.load(path, weights_only=True,
    map_location="cpu")``: a pickle that would run code is refused. The file must hold a flat mapping of
    names to tensors; a wrapper such as ``{"state_dict": ...}`` is not unwrapped by guessing (the error
    lists its top-level keys; pick the entry and save it again). A missing file raises FileNotFoundError;
    a damaged or refused one raises ValueError naming the path; an unknown suffix raises ValueError listing the
    supported ones. Feed the result to
    :func:`crosscheck.params_from_torch` (with the head counts).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in SAFETENSORS_SUFFIXES:
        return load_safetensors(path)
    if suffix in TORCH_SUFFIXES:
        return _load_torch(path)
    raise ValueError(f"{path}: unsupported file suffix {path.suffix!r}; supported: {list(SUPPORTED_SUFFIXES)}")


def _load_torch(path: Path) -> dict[str, np.ndarray]:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if not path.is_file():
        raise ValueError(f"{path}: not a regular file")
    try:
        import torch
    except ImportError:
        raise ImportError(
            f"{path}: reading {path.suffix} files needs torch (pip install 'jaxattn[torch]'); "
            ".safetensors files load without it"
        ) from None
    from crosscheck._conversion.weights import to_numpy

    try:
        obj = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # a refused pickle, a truncated zip, garbage: the message says which
        raise ValueError(_load_error(path, exc)) from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a state_dict (a dict of name -> tensor), got {type(obj).__name__}")
    not_tensors = [k for k, v in obj.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
    if not_tensors:
        raise ValueError(
            f"{path}: expected a flat state_dict of name -> tensor, but entries {not_tensors!r} are not tensors "
            f"(top-level keys: {list(obj)!r}). A wrapper such as {{'state_dict': ...}} or {{'model': ...}} is "
            "not guessed: load it with torch.load(..., weights_only=True)[key] and pass that dict on"
        )
    return {name: to_numpy(tensor) for name, tensor in obj.items()}


def _load_error(path: Path, exc: Exception) -> str:
    """Why torch.load(weights_only=True) failed, in our words.

    A pickle that names a callable outside torch's allowlist is refused *because* loading it could run
    code. torch's own message then advises re-running with weights_only=False (or allowlisting the
    global): exactly what must not be done with an untrusted file, so that text is not passed on. The
    offending global's name is kept: it tells the owner of the file what to remove.
    """
    text = str(exc)
    if "Weights only load failed" not in text:
        return f"{path}: torch.load(weights_only=True) cannot load it: {type(exc).__name__}: {text}"
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    culprit = f" (it names {found.group(1)}, which is not a tensor or a plain container)" if found else ""
    return (
        f"{path}: refused: loading this pickle could run code from the file{culprit}. Only tensors and "
        "plain containers are read; save the weights as .safetensors, or as a dict of tensors "
        "(torch.save(module.state_dict(), ...)), and load that"
    )
