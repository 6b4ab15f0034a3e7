"""crosscheck.load_state_dict: safetensors without torch, pickles only through weights_only, damage reported."""

import json
import os
import pickle
import subprocess
import sys
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import crosscheck as cc


def tensors():
    gen = torch.Generator().manual_seed(0)
    return {
        "f32": torch.randn(3, 5, generator=gen),
        "f64": torch.randn(7, dtype=torch.float64, generator=gen),
        "bf16": torch.randn(2, 3, 5, generator=gen).to(torch.bfloat16),
        "i64": torch.arange(-6, 6, dtype=torch.int64).reshape(3, 4),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 3),
    }


NUMPY_DTYPES = {
    "f32": np.float32,
    "f64": np.float64,
    "bf16": ml_dtypes.bfloat16,
    "i64": np.int64,
    "scalar": np.float32,
    "empty": np.float32,
}


def assert_same(loaded: dict, expected: dict):
    assert sorted(loaded) == sorted(expected)  # safetensors writers may reorder; torch keeps the order
    for name, tensor in expected.items():
        array = loaded[name]
        assert isinstance(array, np.ndarray) and array.dtype == NUMPY_DTYPES[name], (name, array.dtype)
        assert array.shape == tuple(tensor.shape), name
        if tensor.dtype == torch.bfloat16:  # compare the bits: no value may have been rounded
            np.testing.assert_array_equal(array.view(np.int16), tensor.view(torch.int16).numpy())
        else:
            np.testing.assert_array_equal(array, tensor.numpy())


def test_safetensors_round_trip(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file(tensors(), str(path), metadata={"format": "pt"})
    assert_same(cc.load_state_dict(path), tensors())


def test_safetensors_loads_without_torch(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file(tensors(), str(path))
    script = textwrap.dedent(f"""
        import sys
        from crosscheck import load_state_dict
        state = load_state_dict({str(path)!r})
        assert "torch" not in sys.modules, "torch was imported"
        print({{name: str(a.dtype) for name, a in state.items()}})
    """)
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr
    assert eval(result.stdout) == {name: np.dtype(d).name for name, d in NUMPY_DTYPES.items()}


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_safetensors_to_params_matches_the_module(tmp_path, dtype):
    m = torch.nn.MultiheadAttention(15, 5, kdim=7, vdim=11, add_bias_kv=True, dtype=dtype)
    path = tmp_path / "mha.safetensors"
    save_file(m.state_dict(), str(path))
    from_file = cc.params_from_torch(cc.load_state_dict(path), num_heads=5)
    expected = cc.params_from_torch(m)
    assert jax.tree.structure(from_file) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(from_file), jax.tree.leaves(expected)):
        assert a.dtype == b.dtype == {torch.float64: np.float64, torch.bfloat16: ml_dtypes.bfloat16}[dtype]
        assert np.array_equal(a, b)


@pytest.mark.parametrize("suffix", [".pt", ".pth", ".bin"])
def test_torch_file_round_trip(tmp_path, suffix):
    path = tmp_path / f"w{suffix}"
    torch.save(tensors(), path)
    assert_same(cc.load_state_dict(path), tensors())


def test_wrapped_checkpoint_is_not_guessed(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"state_dict": tensors(), "epoch": 3}, path)
    with pytest.raises(ValueError, match=r"top-level keys: \['state_dict', 'epoch'\]"):
        cc.load_state_dict(path)


class Hostile:
    """Unpickling this would create ``marker``: the classic code-execution pickle."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.mark.parametrize("writer", ["torch.save", "pickle.dump"])
def test_hostile_pickle_is_refused_and_runs_nothing(tmp_path, writer):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pt"
    payload = {"weight": torch.zeros(2), "evil": Hostile(marker)}
    if writer == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(payload, f, protocol=2)  # the protocol torch's own unpickler expects
    assert not marker.exists()
    with pytest.raises(ValueError, match=str(path)) as refused:
        cc.load_state_dict(path)
    assert not marker.exists()
    message = str(refused.value)
    assert "refused: loading this pickle could run code" in message
    # the offending global is named (torch.save pickles open() itself; pickle.dump's torch.zeros goes first)
    assert ("io.open" if writer == "torch.save" else "torch.storage._load_from_bytes") in message
    # torch's advice to take the unsafe path is not passed on, neither in the message nor as its cause
    assert "weights_only=False" not in message and "safe_globals" not in message
    assert refused.value.__cause__ is None and refused.value.__suppress_context__
    if writer == "pickle.dump":  # the payload is real: a plain unpickler does run it
        with open(path, "rb") as f:
            pickle.load(f)["evil"].close()
        assert marker.exists()


def safetensors_bytes(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


F32_HEADER = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


DAMAGED = [
    (b"", "shorter than the 8-byte header length"),
    (b"\xff" * 8 + b"{}", "header length"),
    (safetensors_bytes(F32_HEADER, b"\0" * 8)[:-3], "truncated"),
    (safetensors_bytes(F32_HEADER, b"\0" * 12), "trailing bytes"),
    (b"\x05\0\0\0\0\0\0\0{nope", "not UTF-8 JSON"),
    (safetensors_bytes([1, 2], b""), "not an object"),
    (safetensors_bytes({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8), "8 bytes for"),
    (safetensors_bytes({"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8), "dtype"),
    (safetensors_bytes({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, b"\0" * 8), "bad shape"),
    # found by fuzzing:
    (safetensors_bytes({"a": {"dtype": [], "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8), "dtype \\[\\]"),
    (
        safetensors_bytes({**F32_HEADER, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
        "gap or overlap",
    ),
    (b'\x1c\0\0\0\0\0\0\0{"a": {}, "a": {}}          ', "duplicate"),
]


@pytest.mark.parametrize("content, why", DAMAGED, ids=[why for _, why in DAMAGED])
def test_damaged_safetensors(tmp_path, content, why):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=why) as err:
        cc.load_state_dict(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_random_garbage(tmp_path, suffix):
    path = tmp_path / f"garbage{suffix}"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match=str(path)):
        cc.load_state_dict(path)


def test_truncated_torch_file(tmp_path):
    path = tmp_path / "w.pt"
    torch.save(tensors(), path)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match=str(path)):
        cc.load_state_dict(path)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt", ".pth", ".bin"])
def test_missing_file_is_file_not_found(tmp_path, suffix):
    path = tmp_path / f"missing{suffix}"
    with pytest.raises(FileNotFoundError, match=str(path)):
        cc.load_state_dict(path)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_directory_is_not_a_weights_file(tmp_path, suffix):
    path = tmp_path / f"dir{suffix}"
    path.mkdir()
    with pytest.raises(ValueError, match=str(path)):
        cc.load_state_dict(path)


def test_unknown_suffix(tmp_path):
    with pytest.raises(ValueError, match=r"unsupported file suffix '\.npz'.*\.safetensors.*\.pt.*\.pth.*\.bin"):
        cc.load_state_dict(tmp_path / "w.npz")
