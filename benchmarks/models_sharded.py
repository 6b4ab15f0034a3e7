"""A ported model on 8 devices against one: forward tokens/s, load time, memory per device.

    python -m benchmarks.models_sharded [--dir DIR] [--batch 8] [--length 128] [--rounds 7] [--only load]
                                        [--out benchmarks/results/models_sharded.json]
    (--only load: the load part alone, into benchmarks/results/models_sharded_load.json)

Runs on 8 host CPU devices (forced below, before JAX starts). DIR: a save_pretrained directory; default: a
random Llama written with transformers (8 layers, hidden 512, MLP 1024, 8 heads of 64, vocabulary 4096,
float32: 100 MB). Candidates are interleaved round by round and medians reported (benchmarks/harness.py):

  forward   jit(model.apply) on [batch, length] tokens: params on one device, and loaded onto the meshes
            (data, model) = (8,1), (2,4), (1,8) by from_pretrained(mesh=...); tokens/s = batch x length /
            median time. Also XLA's per-device temp and the parameter bytes on device 0.
  load      from_pretrained(DIR) (whole tensors, then device_put by jit) against from_pretrained(DIR,
            mesh=...) (each shard's byte ranges): median seconds and the bytes read.

The 8 "devices" are threads of this machine's CPU cores, so the forward timings say how much the sharded
program's extra work (collectives, smaller matmuls) costs when there is no more hardware, not how it
scales on 8 real accelerators. Memory figures are exact (XLA's buffer assignment, bytes held).
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from jaxattn import io  # noqa: E402
from jaxattn.models import from_pretrained  # noqa: E402

from .harness import jax_candidate, load_average, time_rounds  # noqa: E402

MESHES = ((8, 1), (2, 4), (1, 8))
MiB = 2**20


def checkpoint(directory):
    if directory:
        return directory
    from crosscheck._hf import checkpoints as _hf_models

    return str(
        _hf_models.write_checkpoint(
            "llama",
            tempfile.mkdtemp(),
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=1024,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=8,
            head_dim=64,
        )
    )


def device0_bytes(params):
    first = jax.devices()[0]
    return sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards if s.device == first)


def forward_candidates(directory, batch, length):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 4096, (batch, length)).astype(np.int32)
    mask = np.ones_like(ids)
    model, params = from_pretrained(directory)
    params = jax.device_put(params, jax.devices()[0])
    tokens = batch * length
    candidates, rows = [], {}

    def forward(model):
        return lambda p, i, m: model.apply({"params": p}, i, attention_mask=m)

    one = jax_candidate("1 device", forward(model), params, ids, mask)
    candidates.append(one)
    rows["1 device"] = {"param_bytes_device0": device0_bytes(params), "temp_bytes": one.temp_bytes}
    for shape in MESHES:
        mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "model"))
        smodel, sparams = from_pretrained(directory, mesh=mesh)
        placed = [smodel.sharding.place(x, "BT") for x in (ids, mask)]
        name = f"8 devices {shape[0]}x{shape[1]}"
        cand = jax_candidate(name, forward(smodel), sparams, *placed)
        candidates.append(cand)
        rows[name] = {"param_bytes_device0": device0_bytes(sparams), "temp_bytes": cand.temp_bytes}
    return candidates, rows, tokens


def load_candidates(directory):
    from benchmarks.harness import Candidate

    def load(mesh):
        return lambda: jax.block_until_ready(from_pretrained(directory, mesh=mesh)[1])

    def whole():  # the unsharded path, then onto device 0 (what a one-device run holds)
        return jax.block_until_ready(jax.device_put(from_pretrained(directory)[1], jax.devices()[0]))

    candidates, read = [Candidate("from_pretrained(dir)", whole)], {}
    for shape in ((2, 4), (8, 1)):
        mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "model"))
        candidates.append(Candidate(f"from_pretrained(dir, mesh={shape[0]}x{shape[1]})", load(mesh)))
    for cand in candidates:  # warm up, and count the bytes each way reads
        io.bytes_read.clear()
        cand.run()
        read[cand.name] = sum(io.bytes_read.values())
    read[candidates[0].name] = None  # load_safetensors reads every tensor whole (not counted by read_region)
    return candidates, read


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=None, help="default benchmarks/results/models_sharded[_ONLY].json")
    parser.add_argument("--only", choices=("forward", "load"), default=None, help="measure one part only")
    args = parser.parse_args()
    out = args.out or f"benchmarks/results/models_sharded{'_' + args.only if args.only else ''}.json"
    directory = checkpoint(args.dir)
    checkpoint_bytes = sum(
        os.path.getsize(os.path.join(directory, f)) for f in os.listdir(directory) if f.endswith(".safetensors")
    )
    started = time.time()
    forward, rows, tokens, loads, read = [], {}, 0, [], {}
    if args.only != "load":
        forward, rows, tokens = forward_candidates(directory, args.batch, args.length)
        time_rounds(forward, args.rounds)
    if args.only != "forward":
        loads, read = load_candidates(directory)
        time_rounds(loads, args.rounds)
    base = forward[0].median_s if forward else None
    whole = loads[0].median_s if loads else None
    result = {
        "command": "python -m benchmarks.models_sharded",
        "jax": jax.__version__,
        "checkpoint_bytes": checkpoint_bytes,
        "batch": args.batch,
        "length": args.length,
        "rounds": args.rounds,
        "cores": os.cpu_count(),
        "load_average": load_average(),
        "forward": {
            c.name: {
                **rows[c.name],
                "median_s": c.median_s,
                "tokens_per_s": tokens / c.median_s,
                "vs_one_device": base / c.median_s,
                "compile_s": c.compile_s,
                "times_s": c.times,
            }
            for c in forward
        },
        "load": {
            c.name: {
                "median_s": c.median_s,
                "vs_unsharded": c.median_s / whole,
                "bytes_read": read[c.name],
                "times_s": c.times,
            }
            for c in loads
        },
        "seconds": round(time.time() - started, 1),
    }
    report(result)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def report(result):
    console = Console(width=200)
    console.print(
        f"checkpoint {result['checkpoint_bytes'] / MiB:.1f} MiB; forward [{result['batch']}, "
        f"{result['length']}] float32; {result['rounds']} rounds interleaved, medians; "
        f"{result['cores']} cores; load average {result['load_average']}"
    )
    table = Table(title="forward: jit(model.apply), one device vs 8 host devices", title_justify="left")
    for col in ("candidate", "median ms", "tokens/s", "x 1 device", "params MiB on device 0", "XLA temp MiB"):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    for name, r in result["forward"].items():
        table.add_row(
            name,
            f"{r['median_s'] * 1e3:.1f}",
            f"{r['tokens_per_s']:.0f}",
            f"{r['vs_one_device']:.2f}",
            f"{r['param_bytes_device0'] / MiB:.1f}",
            f"{r['temp_bytes'] / MiB:.1f}",
        )
    if result["forward"]:
        console.print(table)
    table = Table(title="load: from_pretrained, whole tensors vs each shard's byte ranges", title_justify="left")
    for col in ("candidate", "median s", "x unsharded", "MiB read"):
        table.add_column(col, justify="left" if col == "candidate" else "right")
    for name, r in result["load"].items():
        read = "every tensor" if r["bytes_read"] is None else f"{r['bytes_read'] / MiB:.1f}"
        table.add_row(name, f"{r['median_s']:.3f}", f"{r['vs_unsharded']:.2f}", read)
    console.print(table)


if __name__ == "__main__":
    main()
