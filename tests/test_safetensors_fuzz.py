"""Fuzzing jaxattn.io.load_safetensors (what crosscheck.load_state_dict runs on .safetensors files).

Every file, valid or not, must be either read correctly or refused with ValueError naming the path: no
other exception, no hang (hypothesis deadline), and no allocation beyond the file's own size (the reader
keeps one copy of the file; tracemalloc's peak during a read must stay within that plus the parsed
header's objects, so a header claiming a huge shape or offset cannot make it allocate).

Files come from two sources:
- valid files written by the `safetensors` library itself (`safetensors.numpy.save`), then mutated:
  bytes flipped, truncated, extended, the 8-byte header length rewritten, or one header field replaced;
- headers generated here, for the dtypes safetensors.numpy cannot hold (BF16, F8_*) and for arbitrary
  JSON, offsets and shapes.
"Read correctly" is checked against an independent reading of the same bytes (the test's own JSON parse
and byte slicing), against the library (`safetensors.numpy.load`) wherever it can represent the dtypes,
and, for unmutated files, against the arrays that were written.
"""

import json
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from safetensors.numpy import load as st_load, save as st_save

from helpers import (
    SAFETENSORS_DTYPES as DTYPES,  # the spec's names, not the reader's or the writer's
    SAFETENSORS_LIBRARY_DTYPES as LIBRARY_DTYPES,
)
from jaxattn.io import load_safetensors

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FUZZ_TARGET = 2000
SLACK = 64 * 1024  # interpreter noise around a call (frames, small objects)
SETTINGS = {
    "deadline": 2000,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
}


# --- the oracle --------------------------------------------------------------------------------------------


def independent_reading(raw: bytes) -> dict[str, tuple[np.dtype, tuple, bytes]]:
    """{name: (dtype, shape, bytes)} as the spec describes a valid file; only called after a successful read."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n :]
    return {
        name: (np.dtype(DTYPES[e["dtype"]]), tuple(e["shape"]), data[e["data_offsets"][0] : e["data_offsets"][1]])
        for name, e in header.items()
    }


def library_reading(raw: bytes) -> dict[str, np.ndarray] | None:
    try:
        return st_load(raw)
    except Exception:  # noqa: BLE001 - the library refusing (or not representing a dtype) is allowed
        return None


def read_and_check(path, raw: bytes, expected: dict[str, np.ndarray] | None = None) -> str:
    """Write `raw`, read it, check the answer; returns "read" or "refused"."""
    path.write_bytes(raw)
    tracemalloc.start()  # only around the read: tracing hypothesis itself would cost most of the time
    try:
        got = load_safetensors(path)
    except ValueError as error:
        assert str(path) in str(error)
        outcome, why = "refused", str(error)
    else:
        outcome = "read"
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    n = int.from_bytes(raw[:8], "little") if len(raw) >= 8 else 0
    header_objects = 16 * min(n, len(raw))  # a parsed JSON header costs a small multiple of its text
    assert peak <= len(raw) + header_objects + SLACK, (peak, len(raw), n)
    library = library_reading(raw)
    if outcome == "refused":
        assert expected is None, "a valid file written by safetensors was refused"
        # The library reads no file this reader refuses, with one deliberate exception: it ignores unknown
        # keys in an entry ({"dtype", "shape", "data_offsets", "extra": 0}); this reader refuses such an
        # entry rather than silently drop what it does not understand.
        assert library is None or "is not {dtype, shape, data_offsets}" in why, (
            f"safetensors reads a file this reader refuses ({why}): {sorted(library)}"
        )
        return outcome
    mine = independent_reading(raw)
    assert list(got) == list(mine)  # the file's own order
    for name, (dtype, shape, data) in mine.items():
        array = got[name]
        assert array.dtype == dtype and array.shape == shape, (name, array.dtype, array.shape)
        assert array.tobytes() == data, name  # little-endian machine: bytes as stored
    if library is not None:
        assert sorted(library) == sorted(got)
        for name, array in library.items():
            assert array.dtype == got[name].dtype and array.tobytes() == got[name].tobytes(), name
    if expected is not None:
        assert sorted(expected) == sorted(got)
        for name, array in expected.items():
            assert array.dtype == got[name].dtype and array.shape == got[name].shape
            assert array.tobytes() == got[name].tobytes(), name
    return outcome


# --- strategies ----------------------------------------------------------------------------------------------

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=6)
shapes = st.lists(st.integers(0, 5), max_size=3)


@st.composite
def arrays(draw, dtypes=LIBRARY_DTYPES):
    out = {}
    for name in draw(st.lists(names, min_size=1, max_size=3, unique=True)):
        dtype = np.dtype(DTYPES[draw(st.sampled_from(dtypes))])
        shape = tuple(draw(shapes))
        size = int(np.prod(shape)) * dtype.itemsize
        raw = np.frombuffer(draw(st.binary(min_size=size, max_size=size)), np.uint8)
        out[name] = (raw != 0) if dtype == np.bool_ else raw.view(dtype).reshape(shape).copy()
    return out


# a field's replacement: right and wrong types, negative, huge, fractional
odd_values = st.one_of(
    st.integers(-3, 40),
    st.integers(2**31, 2**66),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=4),
    st.sampled_from(list(DTYPES) + ["F128", "f32", ""]),
    st.none(),
    st.booleans(),
    st.lists(st.integers(-2, 2**64), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def with_header(header, data: bytes, length_delta: int = 0) -> bytes:
    text = json.dumps(header).encode()
    return (len(text) + length_delta).to_bytes(8, "little", signed=False) + text + data


@st.composite
def mutated_file(draw):
    """A file written by safetensors, then (most of the time) damaged in one way."""
    expected = draw(arrays())
    metadata = draw(st.none() | st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2))
    raw = st_save(expected, metadata=metadata)
    n = int.from_bytes(raw[:8], "little")
    kind = draw(st.sampled_from(["none", "bytes", "truncate", "extend", "length", "field", "field"]))
    if kind == "none":
        return raw, expected
    if kind == "bytes":
        raw = bytearray(raw)
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        return bytes(raw), None
    if kind == "truncate":
        return raw[: draw(st.integers(0, len(raw) - 1))], None
    if kind == "extend":
        return raw + draw(st.binary(min_size=1, max_size=16)), None
    if kind == "length":
        new = draw(st.integers(0, 2**64 - 1) | st.integers(max(0, n - 9), n + 9).filter(lambda m: m != n))
        return new.to_bytes(8, "little") + raw[8:], None
    header = json.loads(raw[8 : 8 + n])
    name = draw(st.sampled_from(sorted(header)))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra", "drop", "entry"]))
    if field == "drop":
        if isinstance(header[name], dict) and header[name]:
            header[name].pop(draw(st.sampled_from(sorted(header[name]))))
    elif field == "entry":
        header[name] = draw(odd_values)
    elif isinstance(header[name], dict):
        header[name][field] = draw(odd_values)
    return with_header(header, raw[8 + n :]), None


@st.composite
def generated_file(draw):
    """A header written here: any dtype of the format (and bogus ones), consistent or random offsets."""
    header, data, offset = {}, b"", 0
    for name in draw(st.lists(names, max_size=3, unique=True)):
        dtype = draw(st.sampled_from(list(DTYPES)) | st.text(max_size=4))
        shape = draw(shapes | st.lists(st.integers(0, 2**40), max_size=3))
        itemsize = np.dtype(DTYPES[dtype]).itemsize if dtype in DTYPES else 4
        size = int(np.prod(shape, dtype=object)) * itemsize
        size = size if size <= 64 else draw(st.integers(0, 64))  # a huge claimed shape, a small file
        offsets = draw(st.just([offset, offset + size]) | st.lists(st.integers(0, 2**64), min_size=0, max_size=3))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
        data += draw(st.binary(min_size=size, max_size=size))
        offset += size
    if draw(st.booleans()):
        header["__metadata__"] = draw(st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2))
    tail = draw(st.sampled_from([b"", b"\0", b"\0" * 7]))
    json_header = st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=4),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=3),
        max_leaves=8,
    )
    if draw(st.integers(0, 9)) == 0:  # an arbitrary JSON document as the header
        return with_header(draw(json_header), data)
    return with_header(header, data + tail, draw(st.sampled_from([0, 0, 0, -1, 1])))


# --- the test ------------------------------------------------------------------------------------------------


@pytest.mark.slow  # 2,200 files
def test_fuzz_safetensors_reader_2000_plus_files(tmp_path):
    path = tmp_path / "fuzz.safetensors"
    outcomes = {"read": 0, "refused": 0}

    @settings(max_examples=1300, **SETTINGS)
    @given(mutated_file())
    def mutated(file):
        raw, expected = file
        outcomes[read_and_check(path, raw, expected)] += 1

    @settings(max_examples=900, **SETTINGS)
    @given(generated_file())
    def generated(raw):
        outcomes[read_and_check(path, raw)] += 1

    mutated()
    generated()
    total = sum(outcomes.values())
    print(f"\nsafetensors fuzz: {total} files, {outcomes['read']} read correctly, {outcomes['refused']} refused")
    assert total >= FUZZ_TARGET, outcomes
    assert outcomes["read"] >= 300 and outcomes["refused"] >= 300, outcomes  # both halves really exercised
