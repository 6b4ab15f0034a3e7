"""jaxattn.io against the safetensors library (its numpy API): read, read a shard's region, write, bf16,
and damaged files.

    python -m benchmarks.safetensors_io [--layers 8] [--rounds 7] [--out benchmarks/results/safetensors_io.json]

The tensors are a Llama's (hidden 512, MLP 1024, vocabulary 4096: `--layers 8` is 100 MB), float32 and
bfloat16. Candidates are interleaved round by round, medians reported (benchmarks/harness.py):

  read      the whole file: io.load_safetensors vs safetensors.numpy.load_file
  region    what a sharded load reads: for every 2-D tensor a quarter of its rows and, separately, a
            quarter of its columns (the cut that is one run per row in the file): io.read_region (a
            numpy.memmap slice) vs safe_open(..., "numpy").get_slice(name)[rows, cols]
  write     the whole file: io.save_safetensors (hidden temporary file, fsync, rename) and the same bytes
            without fsync or rename (io.safetensors_writer into an open file), vs
            safetensors.numpy.save_file (written in place, no fsync)

`damaged`: the mutated files of tests/test_safetensors_fuzz.py's kinds (bytes flipped, truncated,
extended, header length rewritten), each read by both; the exception types each raises are counted, and
every file one accepts and the other refuses is listed.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import ml_dtypes
import numpy as np

from jaxattn import io

from .harness import Candidate, load_average, time_rounds


def llama_tensors(layers: int, dtype) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    E, F, V = 512, 1024, 4096
    shapes = {"model.embed_tokens.weight": (V, E), "lm_head.weight": (V, E), "model.norm.weight": (E,)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + f"self_attn.{n}_proj.weight": (E, E) for n in "qkvo"})
        shapes.update(
            {
                p + "mlp.gate_proj.weight": (F, E),
                p + "mlp.up_proj.weight": (F, E),
                p + "mlp.down_proj.weight": (E, F),
                p + "input_layernorm.weight": (E,),
            }
        )
    return {k: rng.standard_normal(s, dtype=np.float32).astype(dtype) for k, s in shapes.items()}


def regions(entries):
    """(name, box) pairs: a quarter of the rows, then a quarter of the columns, of every 2-D tensor."""
    for name, e in entries.items():
        if len(e.shape) == 2:
            rows, cols = e.shape
            yield name, ((rows // 4, rows // 2), (0, cols))
            yield name, ((0, rows), (cols // 4, cols // 2))


def candidates(path, tensors, scratch):
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    entries = io.safetensors_entries(path)
    boxes = list(regions(entries))

    def ours_region():
        return [io.read_region(path, entries[name], box) for name, box in boxes]

    def library_region():
        with safe_open(str(path), "numpy") as f:
            return [f.get_slice(name)[tuple(slice(a, b) for a, b in box)] for name, box in boxes]

    def ours_unsynced():
        with open(os.path.join(scratch, "plain.safetensors"), "wb") as f:
            io.safetensors_writer(tensors)(f.fileno())

    got, want = ours_region(), library_region()
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(got, want))
    return [
        Candidate("read: io.load_safetensors", lambda: io.load_safetensors(path)),
        Candidate("read: safetensors.numpy.load_file", lambda: load_file(str(path))),
        Candidate("region: io.read_region (memmap)", ours_region),
        Candidate("region: safe_open get_slice", library_region),
        Candidate(
            "write: io.save_safetensors (fsync, rename)",
            lambda: io.save_safetensors(tensors, os.path.join(scratch, "ours.safetensors")),
        ),
        Candidate("write: io.safetensors_writer (no fsync)", ours_unsynced),
        Candidate(
            "write: safetensors.numpy.save_file",
            lambda: save_file(tensors, os.path.join(scratch, "library.safetensors")),
        ),
    ]


def mutations(raw: bytes, count: int, rng):
    """Damaged copies of a valid file: the kinds tests/test_safetensors_fuzz.py makes."""
    n = int.from_bytes(raw[:8], "little")
    for _ in range(count):
        kind = rng.integers(4)
        data = bytearray(raw)
        if kind == 0:  # flip bytes, mostly in the header
            for at in rng.integers(0, min(len(data), 8 + n + 64), rng.integers(1, 6)):
                data[at] ^= 1 << int(rng.integers(8))
        elif kind == 1:
            data = data[: int(rng.integers(0, len(data)))]
        elif kind == 2:
            data += bytes(rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8))
        else:
            data[:8] = int(rng.integers(0, 2 * n + 16)).to_bytes(8, "little")
        yield bytes(data)


def damaged(scratch, count=500):
    from safetensors.numpy import load_file

    tensors = {f"t{k}": np.arange(k + 3, dtype=np.float32) for k in range(6)}
    path = os.path.join(scratch, "valid.safetensors")
    io.save_safetensors(tensors, path)
    raw = open(path, "rb").read()
    outcomes = collections.Counter()
    disagree = []
    for k, data in enumerate(mutations(raw, count, np.random.default_rng(0))):
        bad = os.path.join(scratch, "bad.safetensors")
        with open(bad, "wb") as f:
            f.write(data)
        got = {}
        for who, read in (("jaxattn.io", io.load_safetensors), ("safetensors", lambda p: load_file(p))):
            try:
                read(bad)
                got[who] = "read"
            except Exception as error:  # noqa: BLE001 - the point is which kinds each raises
                got[who] = type(error).__name__
            outcomes[f"{who}: {got[who]}"] += 1
        if (got["jaxattn.io"] == "read") != (got["safetensors"] == "read"):
            disagree.append({"mutation": k, **got})
    return {"files": count, "outcomes": dict(outcomes), "disagree": disagree[:10], "disagree_count": len(disagree)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="benchmarks/results/safetensors_io.json")
    args = parser.parse_args()
    started = time.time()
    result = {
        "command": "python -m benchmarks.safetensors_io",
        "rounds": args.rounds,
        "cores": os.cpu_count(),
        "load_average": load_average(),
    }
    with tempfile.TemporaryDirectory() as scratch:
        for dtype in (np.float32, ml_dtypes.bfloat16):
            tensors = llama_tensors(args.layers, dtype)
            path = io.save_safetensors(tensors, os.path.join(scratch, "checkpoint.safetensors"))
            cands = candidates(path, tensors, scratch)
            time_rounds(cands, args.rounds)
            result[np.dtype(dtype).name] = {
                "bytes": os.path.getsize(path),
                **{c.name: {"median_s": c.median_s, "times_s": c.times} for c in cands},
            }
            for c in cands:
                print(f"{np.dtype(dtype).name:9s} {c.name:45s} {c.median_s * 1e3:9.1f} ms")
        result["damaged"] = damaged(scratch)
    print(json.dumps(result["damaged"], indent=1))
    result["seconds"] = round(time.time() - started, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
