"""One process of tests/test_multiprocess.py: 2 processes x 4 host CPU devices, one global mesh of 8.

    python tests/_multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT

Each process forces 4 CPU devices, joins JAX's multi-process runtime (`jax.distributed.initialize`, CPU
collectives over gloo, coordinator on localhost:PORT) and runs the same program as every other process
(multi-controller SPMD): ring attention over all 8 devices, so the ring crosses the process boundary,
and data/head-sharded multi_head_attention, forward and gradients. Every sharded result is gathered to
every process (`multihost_utils.process_allgather`) and compared with this process's own single-device
run (float64, dense attention). Prints one JSON line {check: result}.
"""

from __future__ import annotations

import os
import sys

# LLVM optimisation off: tiny programs compiled once and run once (as tests/_sharding_checks.py).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
    " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
)
os.environ["JAX_PLATFORMS"] = "cpu"

import functools  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from helpers import join_processes, normwise  # noqa: E402  (tests/helpers.py: this script's folder is first on sys.path)

LOCAL_DEVICES = 4
MAX_DISTANCE = 3

# The ring runs over all 8 devices, so it crosses from process 0's devices to process 1's and back.
# Every axis has its own size; grouped-query heads (N=6, K=2), key lengths, a per-head key table and a
# shared value table; block_size makes each share travel in several pieces.
RING_CASES = {
    "ring-1x8": dict(
        mesh=(1, 8),
        axes=("data", "seq"),
        B=2,
        T=48,
        S=48,
        N=6,
        K=2,
        H=3,
        Hv=5,
        tables=("per-head", "shared"),
        block_size=(3, 2),
    ),
}


def gather(tree):
    """Global (sharded, possibly not addressable here) arrays -> numpy copies of the whole arrays."""
    return jax.tree.map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)), tree)


def global_array(x, mesh, spec):
    """The same host array in every process -> one global array laid out by spec (each process
    supplies the shards of its own devices)."""
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda index: x[index])


def mesh_of(shape, names):
    return Mesh(np.array(jax.devices()).reshape(shape), names)


def ring_inputs(case, rng):
    B, T, S, N, K, H, Hv = (case[k] for k in ("B", "T", "S", "N", "K", "H", "Hv"))
    R = 2 * MAX_DISTANCE + 1
    key_kind, value_kind = case["tables"]
    args = {
        "q": rng.normal(size=(B, T, N, H)),
        "k": rng.normal(size=(B, S, K, H)),
        "v": rng.normal(size=(B, S, K, Hv)),
        "key_table": rng.normal(size=(R, N, H) if key_kind == "per-head" else (R, H)),
        "value_table": rng.normal(size=(R, N, Hv) if value_kind == "per-head" else (R, Hv)),
    }
    lengths = np.array([S // 3, S])  # one row with padding keys, one full
    w = rng.normal(size=(B, T, N, Hv))  # the output cotangent
    return args, lengths, w


def check_ring(case):
    import jaxattn

    rng = np.random.default_rng(0)  # the same inputs in every process
    args, lengths, w = ring_inputs(case, rng)
    mesh = mesh_of(case["mesh"], case["axes"])
    axes = dict(zip(case["axes"], case["axes"]))
    seq, batch, head = axes.get("seq"), axes.get("data"), axes.get("heads")

    def ring(a):
        return jaxattn.ring_attention(
            a["q"],
            a["k"],
            a["v"],
            mesh=mesh,
            sequence_axis=seq,
            batch_axis=batch,
            head_axis=head,
            is_causal=True,
            key_value_seq_lengths=lengths,
            key_table=a["key_table"],
            value_table=a["value_table"],
            max_distance=MAX_DISTANCE,
            block_size=case["block_size"],
        )

    def dense(a):
        return jaxattn.shaw_relative_attention(
            a["q"],
            a["k"],
            a["v"],
            a["key_table"],
            a["value_table"],
            max_distance=MAX_DISTANCE,
            is_causal=True,
            key_value_seq_lengths=lengths,
            implementation="dense",
        )

    @functools.partial(jax.jit, static_argnums=0)
    def forward_and_grads(f, a, w):  # w is an argument: a jit may not close over a global array
        out, vjp = jax.vjp(f, a)
        return out, vjp(w)[0]

    specs = {
        "q": PartitionSpec(batch, seq, head, None),
        "k": PartitionSpec(batch, seq, head, None),
        "v": PartitionSpec(batch, seq, head, None),
    }
    placed = {name: global_array(x, mesh, specs.get(name, PartitionSpec())) for name, x in args.items()}
    w_placed = global_array(w, mesh, specs["q"])
    out, grads = gather(forward_and_grads(ring, placed, w_placed))
    ref_out, ref_grads = forward_and_grads(dense, {k: jnp.asarray(x) for k, x in args.items()}, jnp.asarray(w))
    return {
        "forward": normwise(out, ref_out),
        "grads": {k: normwise(grads[k], ref_grads[k]) for k in ref_grads},
        "dtype": str(out.dtype),
        "shape": list(out.shape),
    }


def check_data_head_parallel():
    """multi_head_attention with the batch over one mesh axis (across the processes) and heads over the
    other (within a process), loss and every gradient against this process's single-device run."""
    import jaxattn

    mesh = mesh_of((2, 4), ("data", "model"))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 24, 12))
    params = jaxattn.init_multi_head_attention(jax.random.key(0), 12, 8, 3, num_kv_heads=4, dtype=jnp.float64)
    params = jax.tree.map(np.asarray, params)
    results = {}
    for impl in ("dense", "blockwise"):

        def loss(p, x):
            return jnp.sum(
                jnp.sin(jaxattn.multi_head_attention(p, x, is_causal=True, implementation=impl, block_size=8))
            )

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        # the placement helpers build the global arrays (device_put of the same host value everywhere)
        p_sharded = jaxattn.shard_params(params, mesh, head_axis="model")
        x_sharded = jaxattn.shard_inputs(x, mesh, "BTE", batch_axis="data")
        value, grads = gather(fn(p_sharded, x_sharded))
        ref_value, ref_grads = fn(jax.tree.map(jnp.asarray, params), jnp.asarray(x))
        flat, ref_flat = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
        # the key bias's gradient is zero in exact arithmetic (a per-query logit shift, which softmax ignores):
        # both runs hold rounding residue there, so gradients are measured against a floor of 1 (unit scale)
        results[impl] = {
            "loss": abs(float(value) - float(ref_value)) / abs(float(ref_value)),
            "grads": max(normwise(g, r, floor=1.0) for g, r in zip(flat, ref_flat)),
            "n_grads": len(flat),
        }
    return results


def main(process_id, num_processes, port):
    jax.config.update("jax_enable_x64", True)
    results = join_processes(process_id, num_processes, port, LOCAL_DEVICES)
    checks = {
        **{name: (lambda case=case: check_ring(case)) for name, case in RING_CASES.items()},
        "data-head-parallel": check_data_head_parallel,
    }
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            results[name] = check()
        except Exception as error:  # reported per check, so one failure does not hide the others
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(results), flush=True)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:4]))
