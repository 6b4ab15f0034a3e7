"""Will it fit: the full-depth Llama-3-8B training step, compiled for 8 H100s and a TPU v5e-16 from a CPU host.

Llama-3-8B's shapes (32 layers, hidden 4096, 32 / 8 heads of 128, MLP 14336, vocab 128256), laid out as
`from_pretrained(mesh=)` lays them out (partition_rules("llama"): FSDP over "data", heads and MLP columns over
"model"; activations by ModelSharding), bf16 params, AdamW (optax) state in float32, a batch of B sequences of
T tokens. One step: loss, gradients, the AdamW update, params and state donated. XLA's compiled memory analysis
gives the bytes each device holds (arguments: params + AdamW state + the batch; temp: activations and
gradients), and the compiled program its collectives. Nothing is allocated or run.

Run with the compile environment of .ci/run (jax[cuda12,tpu]):

    .venv-compile/bin/python -m benchmarks.fit_llama [--json benchmarks/results/fit_llama.json]

The attention is implementation=None: the kernels on each device's shard on the GPUs; on the TPU slice the XLA
blockwise engine (a TPU compiled from a CPU host runs no Python partitioner, which the kernels on Auto axes need:
docs/sharding.md, "Kernels on a mesh").
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import os
import re
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host; the targets are compile-only topologies

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxattn  # noqa: E402
from jaxattn.models import LlamaConfig, LlamaForCausalLM, ModelSharding, partition_rules  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "fit_llama.json"
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
KERNEL_CALLS = r'custom_call_target="(__gpu\$xla\.gpu\.triton|tpu_custom_call)"'
GIB = 2**30


def llama3_8b(layers: int = 32) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_frequencies=tuple((5e5 ** (-np.arange(0, 128, 2) / 128)).tolist()),
    )


def targets():
    """name: (mesh shape, devices, implementation, HBM per device in GiB)."""
    h100 = (ROOT / ".ci" / "targets" / "h100.pbtxt").read_text()
    return {
        "8 x H100 80GB": (
            (2, 4),
            lambda: topologies.get_topology_desc("h100", "cuda", target_config=h100, topology="1x1x8").devices,
            None,
            80,
        ),
        "TPU v5e-16": (
            (4, 4),
            lambda: topologies.get_topology_desc("v5e:4x4", platform="tpu").devices,
            None,  # the kernels: each device's shard by the model's layout (jaxattn._mesh.activation_layout)
            16,
        ),
    }


def train_step_row(name, mesh_shape, devices, implementation, hbm_gib, B, T, layers) -> dict:
    mesh = Mesh(np.array(devices()).reshape(mesh_shape), ("data", "model"))
    config = dataclasses.replace(llama3_8b(layers), implementation=implementation)
    model = LlamaForCausalLM(config=config, dtype=jnp.bfloat16, sharding=ModelSharding.of(mesh, "llama"))
    rules = partition_rules("llama")
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])

    def spec_of(path):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        return next(s for pattern, s in rules if fnmatch.fnmatchcase(name, pattern))

    params = jax.tree_util.tree_map_with_path(
        lambda path, leaf: jax.ShapeDtypeStruct(leaf.shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec_of(path))),
        shapes,
    )
    optimizer = optax.adamw(1e-4, mu_dtype=jnp.float32)
    # AdamW's moments (mu, nu) placed as their params, whose paths they end with; the step count replicated
    by_path = {
        tuple(str(getattr(k, "key", k)) for k in path): leaf.sharding
        for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    replicated = NamedSharding(mesh, P())

    def placed(path, leaf):
        names = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        sharding = next((by_path[names[i:]] for i in range(len(names)) if names[i:] in by_path), replicated)
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    state = jax.tree_util.tree_map_with_path(placed, jax.eval_shape(optimizer.init, params))
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=NamedSharding(mesh, P("data")))

    def loss(params, ids):
        logits = model.apply({"params": params}, ids).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    def step(params, state, ids):
        value, grads = jax.value_and_grad(loss)(params, ids)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    start = time.perf_counter()
    with jaxattn.cross_platform_lowering():
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, ids).compile()
    memory, text = compiled.memory_analysis(), compiled.as_text()
    lines = [line for line in text.splitlines() if " = " in line]
    argument = memory.argument_size_in_bytes / GIB
    temp = memory.temp_size_in_bytes / GIB
    return dict(
        target=name,
        mesh=f"data {mesh_shape[0]} x model {mesh_shape[1]}",
        implementation=str(implementation),
        B=B,
        T=T,
        layers=layers,
        argument_gib=round(argument, 2),
        temp_gib=round(temp, 2),
        total_gib=round(argument + temp, 2),
        hbm_gib=hbm_gib,
        fits=argument + temp <= hbm_gib,
        kernels=len(re.findall(KERNEL_CALLS, text)),
        collectives={op: sum(f" {op}(" in line or f" {op}-start(" in line for line in lines) for op in COLLECTIVES},
        compile_s=round(time.perf_counter() - start, 1),
    )


def markdown(rows) -> str:
    lines = [
        "| target | mesh | batch B x T | args / device (GiB) | temp / device (GiB) | total vs HBM | collectives |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        coll = ", ".join(f"{k} {v}" for k, v in r["collectives"].items() if v)
        fits = "fits" if r["fits"] else "does not fit"
        lines.append(
            f"| {r['target']} ({r['implementation']}) | {r['mesh']} | {r['B']} x {r['T']} | {r['argument_gib']} | "
            f"{r['temp_gib']} | {r['total_gib']} of {r['hbm_gib']}: {fits} | {coll} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=str(RESULTS))
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--batches", default="8x2048,8x8192", help="comma-separated BxT")
    parser.add_argument("--targets", default="", help="substrings of the target names to run (default: all)")
    args = parser.parse_args(argv)
    rows = []
    for name, (mesh_shape, devices, implementation, hbm) in targets().items():
        if args.targets and not any(t in name for t in args.targets.split(",")):
            continue
        for batch in args.batches.split(","):
            B, T = (int(x) for x in batch.split("x"))
            row = train_step_row(name, mesh_shape, devices, implementation, hbm, B, T, args.layers)
            print(json.dumps(row), flush=True)
            rows.append(row)
            # written after every row: a TPU step at full depth compiles for minutes
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(dict(jax=jax.__version__, rows=rows), indent=1) + "\n")
    print(markdown(rows))


if __name__ == "__main__":
    main()
