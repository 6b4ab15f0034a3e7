"""Weight files -> ``{name: numpy array}``, without ever running code from the file.

``.safetensors`` is parsed here (8-byte little-endian header length, a JSON header, raw little-endian bytes),
so it needs neither torch nor safetensors' numpy backend, which cannot represent bfloat16; every offset is
validated against the file size before a byte is interpreted. Pickle-based files (``.pt``, ``.pth``,
``.bin``) go only through ``torch.load(weights_only=True)``, whose restricted unpickler refuses anything but
tensors and plain containers.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

SAFETENSORS_SUFFIXES = (".safetensors",)
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
SUPPORTED_SUFFIXES = SAFETENSORS_SUFFIXES + TORCH_SUFFIXES

_SAFETENSORS_DTYPES = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16), "F32": np.dtype(np.float32), "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_MAX_HEADER = 100_000_000  # the safetensors format's own limit


def load_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """``{name: numpy array}`` from a ``.safetensors``, ``.pt``, ``.pth`` or ``.bin`` file, dtypes unchanged.

    ``.safetensors`` needs no torch (bfloat16 comes back as ``ml_dtypes.bfloat16``, as JAX uses it).
    ``.pt``/``.pth``/``.bin`` need torch and are read only with ``torch.load(path, weights_only=True,
    map_location="cpu")``: a pickle that would run code is refused. The file must hold a flat mapping of
    names to tensors; a wrapper such as ``{"state_dict": ...}`` is not unwrapped by guessing (the error
    lists its top-level keys; pick the entry and save it again). A damaged file raises ValueError naming
    the path; an unknown suffix raises ValueError listing the supported ones. Feed the result to
    :func:`crosscheck.params_from_torch` (with the head counts).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix in SAFETENSORS_SUFFIXES:
        return _load_safetensors(path)
    if suffix in TORCH_SUFFIXES:
        return _load_torch(path)
    raise ValueError(f"{path}: unsupported file suffix {path.suffix!r}; supported: {list(SUPPORTED_SUFFIXES)}")


def _damaged(path: Path, why: str) -> ValueError:
    return ValueError(f"{path}: not a valid safetensors file ({why})")


def _read_header(path: Path, raw: memoryview) -> dict:
    if len(raw) < 8:
        raise _damaged(path, f"{len(raw)} bytes, shorter than the 8-byte header length")
    n = int.from_bytes(raw[:8], "little")
    if n > min(_MAX_HEADER, len(raw) - 8):
        raise _damaged(path, f"header length {n} exceeds the {len(raw) - 8} bytes after it")

    def no_duplicates(pairs):
        keys = [k for k, _ in pairs]
        if len(set(keys)) != len(keys):
            raise _damaged(path, "duplicate names in the header")
        return dict(pairs)

    try:
        header = json.loads(bytes(raw[8:8 + n]).decode("utf-8"), object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _damaged(path, f"header is not UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _damaged(path, f"header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    return header


def _entry(path: Path, name: str, info) -> tuple[np.dtype, tuple[int, ...], int, int]:
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise _damaged(path, f"entry {name!r} is not {{dtype, shape, data_offsets}}: {info!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in _SAFETENSORS_DTYPES:
        raise _damaged(path, f"entry {name!r} has unsupported dtype {dtype!r}")
    ints = lambda v: isinstance(v, list) and all(type(i) is int and i >= 0 for i in v)  # noqa: E731
    if not ints(shape) or not ints(offsets) or len(offsets) != 2:
        raise _damaged(path, f"entry {name!r} has a bad shape {shape!r} or data_offsets {offsets!r}")
    return _SAFETENSORS_DTYPES[dtype], tuple(shape), offsets[0], offsets[1]


def _load_safetensors(path: Path) -> dict[str, np.ndarray]:
    try:
        size = path.stat().st_size
        raw = bytearray(size)  # writable, so the arrays are too; one copy of the file in memory
        with open(path, "rb") as f:
            if f.readinto(raw) != size:
                raise _damaged(path, "file changed while reading")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc})") from exc
    view = memoryview(raw)
    header = _read_header(path, view)
    n = int.from_bytes(view[:8], "little")
    data = view[8 + n:]
    entries = sorted(((*_entry(path, name, info), name) for name, info in header.items()),
                     key=lambda e: (e[2], e[3]))
    end = 0
    arrays = {}
    for dtype, shape, begin, stop, name in entries:
        # the format stores tensors back to back: no gap, no overlap, nothing past the end of the file
        if begin != end or stop > len(data):
            why = "is truncated" if stop > len(data) else f"offsets [{begin}, {stop}] leave a gap or overlap"
            raise _damaged(path, f"entry {name!r} {why} (data section is {len(data)} bytes)")
        if stop - begin != math.prod(shape) * dtype.itemsize:
            raise _damaged(path, f"entry {name!r}: {stop - begin} bytes for shape {shape} of {dtype}")
        arrays[name] = _little_endian(data[begin:stop], dtype).reshape(shape)
        end = stop
    if end != len(data):
        raise _damaged(path, f"{len(data) - end} trailing bytes after the last tensor")
    return {name: arrays[name] for name in header}  # the file's own order


def _little_endian(buffer, dtype: np.dtype) -> np.ndarray:
    if dtype.itemsize == 1 or sys.byteorder == "little":
        return np.frombuffer(buffer, dtype=dtype)
    if dtype.kind == "c":  # swap each float of the pair, not the whole 8 bytes
        return np.frombuffer(buffer, dtype=dtype.newbyteorder("<")).astype(dtype)
    as_uint = np.frombuffer(buffer, dtype=f"<u{dtype.itemsize}")  # ml_dtypes have no byte-order variants
    return as_uint.astype(f"=u{dtype.itemsize}").view(dtype)


def _load_torch(path: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise ImportError(f"{path}: reading {path.suffix} files needs torch (pip install 'jaxattn[torch]'); "
                          ".safetensors files load without it") from None
    from crosscheck._convert import to_numpy

    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    try:
        obj = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # a refused pickle, a truncated zip, garbage: the message says which
        raise ValueError(f"{path}: torch.load(weights_only=True) cannot load it: {type(exc).__name__}: {exc}") from exc
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a state_dict (a dict of name -> tensor), got {type(obj).__name__}")
    not_tensors = [k for k, v in obj.items() if not (isinstance(k, str) and isinstance(v, torch.Tensor))]
    if not_tensors:
        raise ValueError(
            f"{path}: expected a flat state_dict of name -> tensor, but entries {not_tensors!r} are not tensors "
            f"(top-level keys: {list(obj)!r}). A wrapper such as {{'state_dict': ...}} or {{'model': ...}} is "
            "not guessed: load it with torch.load(..., weights_only=True)[key] and pass that dict on")
    return {name: to_numpy(tensor) for name, tensor in obj.items()}
