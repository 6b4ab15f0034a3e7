"""Weight files without torch: ``load_safetensors(path) -> {name: numpy array}`` and ``save_safetensors``.

The safetensors format is parsed here (8-byte little-endian header length, a JSON header, raw
little-endian bytes), so it needs neither torch nor safetensors' numpy backend, which cannot represent
bfloat16 (it comes back as ``ml_dtypes.bfloat16``, as JAX uses it). Every offset is validated against
the file size before a byte is interpreted; a damaged file raises ValueError naming the path, a missing
one FileNotFoundError. Nothing in a weight file is ever executed. ``save_safetensors(tensors, path)`` writes
the same format (what ``jaxattn.models.to_pretrained`` writes), bf16 and float8 included.

A sharded load reads parts: ``safetensors_entries(path)`` parses the header alone ({name: TensorEntry}:
dtype, shape, byte offset), and ``read_region(path, entry, box)`` copies one box of a tensor out of
memory maps of the rows it spans (numpy slicing; 4 MiB mapped at a time), counting the box's bytes in
``bytes_read`` (per file and tensor).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import mmap
import os
import sys
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from . import _atomic_files as atomic_files

_SAFETENSORS_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "C64": np.dtype(np.complex64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}
_MAX_HEADER = 100_000_000  # the safetensors format's own limit


def load_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """``{name: numpy array}`` in the file's order, dtypes unchanged (bf16 as ``ml_dtypes.bfloat16``)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        # writable, so the arrays are too; one copy of the file in memory; np.empty, not bytearray: no
        # zero-filling of memory the read overwrites (3x faster for a 100 MB file)
        raw = memoryview(np.empty(size, np.uint8))
        with open(path, "rb") as f:
            if f.readinto(raw) != size:
                raise _damaged(path, "file changed while reading")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc})") from exc
    view = memoryview(raw)
    header = _read_header(path, view)
    n = int.from_bytes(view[:8], "little")
    data = view[8 + n :]
    entries = sorted(((*_entry(path, name, info), name) for name, info in header.items()), key=lambda e: (e[2], e[3]))
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
        header = json.loads(bytes(raw[8 : 8 + n]).decode("utf-8"), object_pairs_hook=no_duplicates)
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
    if not isinstance(dtype, str) or dtype not in _SAFETENSORS_DTYPES:  # a JSON list is not even hashable
        raise _damaged(path, f"entry {name!r} has unsupported dtype {dtype!r}")
    ints = lambda v: isinstance(v, list) and all(type(i) is int and i >= 0 for i in v)  # noqa: E731
    if not ints(shape) or not ints(offsets) or len(offsets) != 2:
        raise _damaged(path, f"entry {name!r} has a bad shape {shape!r} or data_offsets {offsets!r}")
    return _SAFETENSORS_DTYPES[dtype], tuple(shape), offsets[0], offsets[1]


def _little_endian(buffer, dtype: np.dtype) -> np.ndarray:
    if dtype.itemsize == 1 or sys.byteorder == "little":
        return np.frombuffer(buffer, dtype=dtype)
    if dtype.kind == "c":  # swap each float of the pair, not the whole 8 bytes
        return np.frombuffer(buffer, dtype=dtype.newbyteorder("<")).astype(dtype)
    as_uint = np.frombuffer(buffer, dtype=f"<u{dtype.itemsize}")  # ml_dtypes have no byte-order variants
    return as_uint.astype(f"=u{dtype.itemsize}").view(dtype)


# --- reading parts of a file: a sharded load reads only the bytes of its own shards --------------------------


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file, from its header: where its bytes lie, nothing read yet."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte, from the start of the file
    nbytes: int


# Bytes read by read_region, per (file, tensor name): what a sharded load read (tests count it).
bytes_read: collections.Counter = collections.Counter()


def safetensors_entries(path: str | os.PathLike) -> dict[str, TensorEntry]:
    """{name: TensorEntry} in the file's order, reading the header only. Every entry is checked as
    load_safetensors checks it (back to back, no gap, its bytes matching its shape, nothing past the end)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            raw = head + (f.read(n) if len(head) == 8 and n <= min(_MAX_HEADER, size - 8) else b"")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such file") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot read ({exc})") from exc
    if len(raw) == 8 and size > 8:  # the header length was refused above: say why, as load_safetensors does
        raise _damaged(path, f"header length {n} exceeds the {size - 8} bytes after it")
    header = _read_header(path, memoryview(raw))
    data = size - len(raw)
    entries, end = {}, 0
    by_offset = sorted(((*_entry(path, name, info), name) for name, info in header.items()), key=lambda e: e[2:4])
    for dtype, shape, begin, stop, name in by_offset:
        if begin != end or stop > data or stop - begin != math.prod(shape) * dtype.itemsize:
            raise _damaged(
                path,
                f"entry {name!r}: offsets [{begin}, {stop}] for shape {list(shape)} of {dtype} "
                f"(the previous entry ends at {end}, the data section is {data} bytes)",
            )
        entries[name], end = TensorEntry(name, dtype, shape, len(raw) + begin, stop - begin), stop
    if end != data:
        raise _damaged(path, f"{data - end} trailing bytes after the last tensor")
    return {name: entries[name] for name in header}


_MAP_BYTES = 1 << 22  # at most this much of a tensor is mapped at once: its touched pages count as resident


@contextlib.contextmanager
def _mapped(f, start: int, length: int):
    """A read-only memoryview of bytes [start, start + length) of the open file f, memory-mapped with its
    pages read in at once (MAP_POPULATE where the OS has it: one call instead of a fault per page)."""
    aligned = start - start % mmap.ALLOCATIONGRANULARITY
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    with mmap.mmap(f.fileno(), start - aligned + length, flags=flags, prot=mmap.PROT_READ, offset=aligned) as m:
        view = memoryview(m)[start - aligned :]
        try:
            yield view
        finally:
            view.release()


def read_region(path: str | os.PathLike, entry: TensorEntry, box) -> np.ndarray:
    """The part box = ((start, stop) per axis) of the tensor `entry` of the file at `path`, reading only its
    bytes: the tensor's bytes memory-mapped a slab of leading-axis indices at a time (4 MiB; the rows the
    box spans), and the box sliced out of each slab and copied by numpy. Counted in `bytes_read` (the
    box's bytes; the OS reads whole pages, those of the rows the box spans)."""
    box = tuple((int(a), int(b)) for a, b in box)
    if len(box) != len(entry.shape) or not all(0 <= a <= b <= d for (a, b), d in zip(box, entry.shape)):
        raise ValueError(
            f"{path}: {entry.name!r}: expected a box of (start, stop) within shape {list(entry.shape)}, got {list(box)}"
        )
    lengths = [b - a for a, b in box]
    shape, cut = (entry.shape, box) if entry.shape else ((1,), ((0, 1),))  # a scalar as one entry
    # moved as unsigned ints of the item's size (whatever the dtype: ml_dtypes, complex), byte order as in
    # the file; interpreted after the copy
    unit = np.dtype(f"u{entry.dtype.itemsize}")
    part = np.empty([b - a for a, b in cut], unit)
    if part.size:
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: no such file") from None
        with f:
            if os.fstat(f.fileno()).st_size < entry.offset + entry.nbytes:  # a page past the end: SIGBUS
                raise _damaged(Path(path), f"entry {entry.name!r}: file changed while reading")
            row = math.prod(shape[1:]) * entry.dtype.itemsize  # bytes per index of the leading axis
            step = max(1, _MAP_BYTES // row)
            inner = tuple(slice(a, b) for a, b in cut[1:])
            first, last = cut[0]
            for a in range(first, last, step):
                b = min(last, a + step)
                with _mapped(f, entry.offset + a * row, (b - a) * row) as raw:
                    slab = np.frombuffer(raw, unit).reshape(b - a, *shape[1:])
                    part[a - first : b - first] = slab[(slice(None), *inner)]
                    del slab  # before the map closes
    bytes_read[(str(path), entry.name)] += part.nbytes
    return _little_endian(part.data, entry.dtype).reshape(lengths)


_DTYPE_NAMES = {dtype: name for name, dtype in _SAFETENSORS_DTYPES.items()}
_METADATA = {"format": "pt"}  # transformers refuses a safetensors file whose metadata names no known format


def save_safetensors(tensors, path: str | os.PathLike, *, metadata: dict[str, str] | None = None) -> Path:
    """Write ``{name: array}`` (numpy, or anything ``np.asarray`` takes: JAX arrays) as a safetensors file.

    The header lists the tensors in the given order (each ``{dtype, shape, data_offsets}``) after
    ``"__metadata__"`` (default ``{"format": "pt"}``, which transformers requires), padded with spaces to a
    multiple of 8 bytes as the safetensors library pads it. The data section holds the tensors back to back,
    C order, little-endian, the widest dtypes first, so every tensor starts at a multiple of its item size.
    A dtype the format has no name for (object, float128...), or a name that is not a non-empty string,
    raises ValueError naming the tensor; nothing is cast. Returns the path.

    The file is written whole under a hidden temporary name beside `path` (jaxattn._atomic_files), fsynced
    and renamed over `path` in one step: a reader finds the old file or the new one, never a part, and a
    failed write (a full disk, an interrupt) leaves `path` as it was and no temporary file behind.
    """
    path = Path(path)
    write = safetensors_writer(tensors, metadata=metadata)  # every check before a file is created
    atomic_files.replace(atomic_files.write_temp(path, write), path)
    atomic_files.fsync_directory(path.parent)
    return path


def safetensors_writer(tensors, *, metadata: dict[str, str] | None = None) -> Callable[[int], None]:
    """write(fd): the bytes of save_safetensors' file for `tensors`, written to an open descriptor. Every
    name, dtype and the metadata are checked here, before anything is written (ValueError as
    save_safetensors)."""
    metadata = dict(_METADATA if metadata is None else metadata)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"metadata: expected {{str: str}}, got {metadata!r}")
    arrays = {}
    for name, value in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError(
                f"tensors: expected names that are non-empty strings other than '__metadata__', got {name!r}"
            )
        array = np.asarray(value)
        if array.dtype.byteorder == (">" if sys.byteorder == "little" else "<"):  # same values, native order
            array = array.astype(array.dtype.newbyteorder("="))
        if array.dtype not in _DTYPE_NAMES:
            raise ValueError(
                f"tensors[{name!r}]: expected one of the safetensors dtypes "
                f"{sorted(str(d) for d in _DTYPE_NAMES)}, got {array.dtype}"
            )
        arrays[name] = array
    order = sorted(arrays, key=lambda name: -arrays[name].dtype.itemsize)  # stable: ties keep the given order
    header, offset = {}, 0
    for name in order:
        header[name] = {
            "dtype": _DTYPE_NAMES[arrays[name].dtype],
            "shape": list(arrays[name].shape),
            "data_offsets": [offset, offset + arrays[name].nbytes],
        }
        offset += arrays[name].nbytes
    text = json.dumps(
        {"__metadata__": metadata, **{name: header[name] for name in arrays}}, separators=(",", ":")
    ).encode("utf-8")
    text += b" " * (-len(text) % 8)

    def write(fd: int) -> None:
        atomic_files.write_all(fd, len(text).to_bytes(8, "little") + text)
        for name in order:
            atomic_files.write_all(fd, _little_endian_bytes(arrays[name]))

    return write


def _little_endian_bytes(array: np.ndarray) -> memoryview:
    array = np.ascontiguousarray(array).reshape(-1)
    if array.dtype.itemsize > 1 and sys.byteorder != "little":
        if array.dtype.kind == "c":  # each float of the pair
            array = array.astype(array.dtype.newbyteorder("<"))
        else:
            array = array.view(f"=u{array.dtype.itemsize}").astype(f"<u{array.dtype.itemsize}")
    return memoryview(array.view(np.uint8))
