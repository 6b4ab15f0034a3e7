"""jaxattn.io.save_safetensors: files that jaxattn's reader, the safetensors library and torch's loader read
back bit for bit, laid out as the format says; bad input refused by name before a byte is written."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from helpers import (
    SAFETENSORS_DTYPES as DTYPES,  # the spec's names, not the reader's or the writer's
    SAFETENSORS_LIBRARY_DTYPES as LIBRARY_DTYPES,
)
from jaxattn.io import load_safetensors, save_safetensors

SHAPES = [(3, 5), (), (0, 4), (7,), (2, 1, 3)]


def _tensors():
    """One tensor per dtype and shape (the shapes cycle), random bits: every byte pattern a value may hold."""
    rng = np.random.default_rng(0)
    tensors = {}
    for k, (name, dtype) in enumerate(DTYPES.items()):
        shape = SHAPES[k % len(SHAPES)]
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        raw = rng.integers(0, 256, size, dtype=np.uint8)
        tensors[f"t.{name.lower()}"] = (
            raw.view(np.uint8 if dtype == np.bool_ else dtype).reshape(shape)
            if dtype != np.bool_
            else (raw % 2).astype(bool).reshape(shape)
        )
    return tensors


def _same(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


def test_every_dtype_reads_back_bit_for_bit_through_three_readers(tmp_path):
    tensors = _tensors()
    path = save_safetensors(tensors, tmp_path / "all.safetensors")
    assert path == tmp_path / "all.safetensors"
    ours = load_safetensors(path)
    assert list(ours) == list(tensors)  # the header keeps the given order
    for name, x in tensors.items():
        _same(ours[name], x)
    from safetensors.numpy import load_file  # its numpy backend has no BF16/F8: a file of the dtypes it has

    only_library = {k: v for k, v in tensors.items() if k.split(".")[1].upper() in LIBRARY_DTYPES}
    save_safetensors(only_library, tmp_path / "library.safetensors")
    for name, x in load_file(tmp_path / "library.safetensors").items():
        _same(x, only_library[name])
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file as torch_load_file

    torch_dtypes = {"BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
    for name, t in torch_load_file(path).items():
        kind = name.split(".")[1].upper()
        assert t.shape == tensors[name].shape
        if kind in torch_dtypes:
            assert t.dtype == torch_dtypes[kind]
        same_bits = t.reshape(-1).view(torch.uint8).numpy()  # torch views a 0-d tensor as bytes only when flat
        assert np.array_equal(same_bits.reshape(-1), np.ascontiguousarray(tensors[name]).view(np.uint8).reshape(-1))


def test_layout_header_alignment_and_metadata(tmp_path):
    tensors = {
        "b16": np.ones((3,), ml_dtypes.bfloat16),
        "f64": np.arange(5.0),
        "u8": np.arange(3, dtype=np.uint8),
        "f32": np.arange(4, dtype=np.float32),
    }
    raw = save_safetensors(tensors, tmp_path / "x.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert n % 8 == 0 and raw[8 + n - 1 : 8 + n] in (b"}", b" ")
    header = json.loads(raw[8 : 8 + n])
    assert list(header) == ["__metadata__", "b16", "f64", "u8", "f32"] and header["__metadata__"] == {"format": "pt"}
    assert {k: e["dtype"] for k, e in header.items() if k != "__metadata__"} == {
        "b16": "BF16",
        "f64": "F64",
        "u8": "U8",
        "f32": "F32",
    }
    spans = sorted(tuple(e["data_offsets"]) for k, e in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] == len(raw) - 8 - n
    for name, e in header.items():  # widest first: each tensor starts at a multiple of its item size
        if name != "__metadata__":
            assert e["data_offsets"][0] % tensors[name].dtype.itemsize == 0
    raw = save_safetensors(tensors, tmp_path / "m.safetensors", metadata={"format": "pt", "note": "x"}).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert json.loads(raw[8 : 8 + n])["__metadata__"] == {"format": "pt", "note": "x"}


def test_jax_arrays_views_and_other_byte_orders_keep_their_values(tmp_path):
    values = np.arange(12, dtype=np.float64).reshape(3, 4)
    tensors = {
        "jax": jnp.asarray(values, jnp.bfloat16),
        "transposed": values.T,
        "big_endian": values.astype(">f8"),
        "strided": values[:, ::2],
    }
    back = load_safetensors(save_safetensors(tensors, tmp_path / "x.safetensors"))
    _same(back["jax"], values.astype(ml_dtypes.bfloat16))
    _same(back["transposed"], np.ascontiguousarray(values.T))
    _same(back["big_endian"], values)
    _same(back["strided"], np.ascontiguousarray(values[:, ::2]))


@pytest.mark.parametrize(
    "tensors, pattern",
    [
        ({"x": np.array([object()])}, r"tensors\['x'\]: expected one of the safetensors dtypes .* got object"),
        ({"x": np.array(["abc"])}, r"tensors\['x'\]: expected one of the safetensors dtypes .* got <U3"),
        ({"x": np.zeros(2, np.complex128)}, r"tensors\['x'\]: .* got complex128"),
        ({"": np.zeros(2)}, r"tensors: expected names that are non-empty strings .* got ''"),
        ({"__metadata__": np.zeros(2)}, r"got '__metadata__'"),
        ({3: np.zeros(2)}, r"tensors: expected names .* got 3"),
    ],
)
def test_bad_tensors_are_refused_by_name_and_nothing_is_written(tmp_path, tensors, pattern):
    with pytest.raises(ValueError, match=pattern):
        save_safetensors(tensors, tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(ValueError, match=r"metadata: expected \{str: str\}, got \{'format': 1\}"):
        save_safetensors({"x": np.zeros(2)}, tmp_path / "x.safetensors", metadata={"format": 1})
