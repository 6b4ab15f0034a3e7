"""The multi-device checks of test_sharding.py, run in a subprocess with 8 host CPU devices.

`python tests/_sharding_checks.py [check ...]` prints one JSON object {check: result}. XLA_FLAGS must
force the 8 devices before JAX starts, which is why this is a separate process: the main pytest session
keeps its single device. float64 is switched on deliberately (the f32 cases pass explicit float32).
"""

from __future__ import annotations

import os
import sys

# LLVM optimisation off: these programs are compiled once and run once on tiny shapes, so this halves the
# checks' time; XLA's buffer assignment (the memory figures) happens before it and is unchanged.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jaxattn  # noqa: E402
from helpers import normwise, print_check_results  # noqa: E402  (tests/helpers.py: this script's folder is first on sys.path)

COLLECTIVES = ("collective-permute", "all-gather", "all-to-all", "all-reduce", "reduce-scatter")


def collectives(compiled):
    """Collective ops in the compiled HLO: {kind: number of instructions}."""
    lines = [line for line in compiled.as_text().splitlines() if " = " in line]
    return {op: sum(f" {op}(" in line or f" {op}-start(" in line for line in lines) for op in COLLECTIVES}


def mesh_of(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def alibi(slopes):
    """A position_bias hook closing over a differentiable array: -slope[n] * |key_pos - query_pos|."""
    return lambda qp, kp: -slopes[:, None, None] * jnp.abs(kp[None, None, :] - qp[None, :, None])


# ---------------------------------------------------------------------------------------------------
# Ring attention against single-device dense attention, forward and gradients.

# name: mesh shape, axis names, sizes and options; every axis has its own size. block_size makes key/value
# shares travel in several pieces (1x8: 3 per chunk; 2x4: 4 per share, the last one ending in padding).
CASES = {
    "1x8": dict(
        mesh=(1, 8),
        axes=("data", "seq"),
        batch=(2,),
        T=48,
        S=48,
        N=6,
        K=2,
        H=3,
        Hv=5,
        causal=True,
        lengths=True,
        tables="key-per-head+value-shared",
        bias=False,
        block_size=(3, 1),
    ),
    "2x4": dict(
        mesh=(2, 4),
        axes=("data", "seq"),
        batch=(2, 3),
        T=36,
        S=44,
        N=3,
        K=1,
        H=5,
        Hv=2,
        causal=False,
        lengths=True,
        tables=None,
        bias=True,
        block_size=(2, 3),
    ),
    "4x2": dict(
        mesh=(4, 2),
        axes=("data", "seq"),
        batch=(4,),
        T=24,
        S=40,
        N=4,
        K=2,
        H=3,
        Hv=5,
        causal=True,
        lengths=False,
        tables="key-shared+value-per-head",
        bias=True,
    ),
    "8x1": dict(
        mesh=(8, 1),
        axes=("data", "seq"),
        batch=(8,),
        T=20,
        S=28,
        N=2,
        K=2,
        H=3,
        Hv=5,
        causal=True,
        lengths=True,
        tables="key-per-head+value-shared",
        bias=False,
    ),
    "2x2x2": dict(
        mesh=(2, 2, 2),
        axes=("data", "seq", "heads"),
        batch=(2,),
        T=32,
        S=32,
        N=6,
        K=2,
        H=3,
        Hv=5,
        causal=True,
        lengths=True,
        tables="key-per-head+value-per-head",
        bias=True,
    ),
}
MAX_DISTANCE = 3


def case_inputs(case, dtype, seed=0):
    rng = np.random.default_rng(seed)
    B, T, S, N, K, H, Hv = (case[k] for k in ("batch", "T", "S", "N", "K", "H", "Hv"))

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape).astype(dtype))

    R = 2 * MAX_DISTANCE + 1
    args = {"q": normal(*B, T, N, H), "k": normal(*B, S, K, H), "v": normal(*B, S, K, Hv)}
    tables = case["tables"] or ""
    if "key" in tables:
        args["key_table"] = normal(R, N, H) if "key-per-head" in tables else normal(R, H)
    if "value" in tables:
        args["value_table"] = normal(R, N, Hv) if "value-per-head" in tables else normal(R, Hv)
    if case["bias"]:
        args["slopes"] = jnp.asarray(rng.uniform(0.1, 1.0, size=N).astype(dtype))
    lengths = None
    if case["lengths"]:  # one row with no key at all, one full, the rest anywhere
        lengths = jnp.asarray(rng.integers(0, S + 1, size=B)).at[(0,) * len(B)].set(0)
        lengths = lengths.at[(-1,) * len(B)].set(S)
    w = normal(*B, T, N, Hv)  # the output cotangent
    return args, lengths, w


def ring_fn(case, lengths, mesh, precision=None):
    seq, batch = case["axes"][1], case["axes"][0]
    head = case["axes"][2] if len(case["axes"]) > 2 else None

    def f(args):
        bias = alibi(args["slopes"]) if "slopes" in args else None
        return jaxattn.ring_attention(
            args["q"],
            args["k"],
            args["v"],
            mesh=mesh,
            sequence_axis=seq,
            batch_axis=batch,
            head_axis=head,
            is_causal=case["causal"],
            key_value_seq_lengths=lengths,
            key_table=args.get("key_table"),
            value_table=args.get("value_table"),
            max_distance=MAX_DISTANCE if case["tables"] else None,
            position_bias=bias,
            load_balance=case.get("load_balance", True),
            block_size=case.get("block_size"),
            precision=precision,
        )

    return f


def dense_fn(case, lengths, precision=None):
    T, S = case["T"], case["S"]

    def f(args):
        bias = None
        if "slopes" in args:  # the same hook, evaluated on the whole grid of global positions
            bias = alibi(args["slopes"])(jnp.arange(T) + S - T, jnp.arange(S))
        return jaxattn.shaw_relative_attention(
            args["q"],
            args["k"],
            args["v"],
            args.get("key_table"),
            args.get("value_table"),
            max_distance=MAX_DISTANCE,
            is_causal=case["causal"],
            key_value_seq_lengths=lengths,
            bias=bias,
            implementation="dense",
            precision=precision,
        )

    return f


def forward_and_grads(f, w):
    def run(args):
        out, vjp = jax.vjp(f, args)
        return out, vjp(w)[0]

    return jax.jit(run)


def place(case, mesh, args):
    """Inputs placed on the mesh as a user would (shard_inputs); tables and slopes replicated."""
    seq, batch = case["axes"][1], case["axes"][0]
    head = case["axes"][2] if len(case["axes"]) > 2 else None
    placed = dict(args)
    letters = "B" + "." * (len(case["batch"]) - 1)
    for name, layout in (("q", letters + "TNH"), ("k", letters + "SKH"), ("v", letters + "SKH")):
        placed[name] = jaxattn.shard_inputs(
            args[name], mesh, layout, batch_axis=batch, sequence_axis=seq, head_axis=head
        )
    return placed


def check_case(name, dtype):
    case = dict(CASES[name])
    if dtype == np.float32:  # the float32 bar on the ring itself; the position terms are covered in float64
        case.update(tables=None, bias=False)
        case["load_balance"] = name != "4x2"  # one causal ring with contiguous shares
    mesh = mesh_of(case["mesh"], case["axes"])
    args, lengths, w = case_inputs(case, dtype)
    precision = "highest" if dtype == np.float32 else None
    ring = forward_and_grads(ring_fn(case, lengths, mesh, precision), w)
    compiled = ring.lower(place(case, mesh, args)).compile()
    out, grads = compiled(place(case, mesh, args))
    ref_out, ref_grads = forward_and_grads(dense_fn(case, lengths, precision), w)(args)
    result = {
        "forward": normwise(out, ref_out),
        "grads": {k: normwise(grads[k], ref_grads[k]) for k in sorted(ref_grads)},
        "finite": bool(all(np.isfinite(np.asarray(g)).all() for g in grads.values())),
        "out_spec": str(out.sharding.spec),
        "dtype": str(out.dtype),
        "collectives": collectives(compiled),
    }
    return result


# ---------------------------------------------------------------------------------------------------
# Data- and head-parallel: the ordinary functions under jit with NamedSharding (no shard_map).

# The key bias's gradient is zero in exact arithmetic (a per-query logit shift, which softmax ignores): both
# runs hold rounding residue there, so the layers' gradients are measured against a floor of 1 (unit scale).
KEY_BIAS_FLOOR = 1.0


def check_data_head_parallel():
    mesh = mesh_of((2, 4), ("data", "model"))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(4, 24, 12)))
    results = {}
    for relative in (False, True):
        if relative:
            params = jaxattn.init_relative_multi_head_attention(
                jax.random.key(0), 12, 8, 3, num_kv_heads=4, max_distance=2, dtype=jnp.float64
            )
            layer = jaxattn.relative_multi_head_attention
        else:
            params = jaxattn.init_multi_head_attention(jax.random.key(0), 12, 8, 3, num_kv_heads=4, dtype=jnp.float64)
            layer = jaxattn.multi_head_attention
        p_sharded = jaxattn.shard_params(params, mesh, head_axis="model")
        x_sharded = jaxattn.shard_inputs(x, mesh, "BTE", batch_axis="data")
        for impl in ("dense", "blockwise"):  # dense Shaw too: its bucket views keep head shardings

            def loss(p, x):
                return jnp.sum(jnp.sin(layer(p, x, is_causal=True, implementation=impl, block_size=8)))

            fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
            compiled = fn.lower(p_sharded, x_sharded).compile()
            (value, grads), (ref_value, ref_grads) = compiled(p_sharded, x_sharded), fn(params, x)
            flat, ref_flat = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
            results[f"{'relative' if relative else 'mha'}-{impl}"] = {
                "loss": abs(float(value - ref_value)) / abs(float(ref_value)),
                "grads": max(normwise(g, r, floor=KEY_BIAS_FLOOR) for g, r in zip(flat, ref_flat)),
                "collectives": collectives(compiled),
                "query_kernel_spec": str(p_sharded["query"]["kernel"].sharding.spec),
            }
    results.update(check_default_tiles_sharded(mesh))
    return results


def check_default_tiles_sharded(mesh):
    """Blockwise with its default tiles at T = 256, where one device runs several row groups (a loop over
    batch entries x key/value heads): sharded inputs must run without that loop, or XLA all-gathers the
    sharded batch and head axes it walks."""
    from jaxattn._engines import tiles

    B, T, E, N, K = 8, 256, 16, 8, 4
    x = jnp.asarray(np.random.default_rng(3).normal(size=(B, T, E)))
    params = jaxattn.init_multi_head_attention(jax.random.key(1), E, N, E // N, num_kv_heads=K, dtype=jnp.float64)
    p_sharded = jaxattn.shard_params(params, mesh, head_axis="model")
    x_sharded = jaxattn.shard_inputs(x, mesh, "BTE", batch_axis="data")
    results = {}
    for causal in (False, True):

        def loss(p, x, causal=causal):
            return jnp.sum(jnp.sin(jaxattn.multi_head_attention(p, x, is_causal=causal, implementation="blockwise")))

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        compiled = fn.lower(p_sharded, x_sharded).compile()
        (value, grads), (ref_value, ref_grads) = compiled(p_sharded, x_sharded), fn(params, x)
        G = N // K
        sizes = tiles.row_tile_sizes(None, T, T, G, None)
        Bc, Kc = tiles.row_groups(B, K, G, *sizes, None)
        results[f"mha-blockwise-default-tiles-{'causal' if causal else 'full'}"] = {
            "loss": abs(float(value - ref_value)) / abs(float(ref_value)),
            "grads": max(
                normwise(g, r, floor=KEY_BIAS_FLOOR) for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads))
            ),
            "collectives": collectives(compiled),
            "one_device_row_groups": (B // Bc) * (K // Kc),
            "query_kernel_spec": str(p_sharded["query"]["kernel"].sharding.spec),
        }
    return results


# ---------------------------------------------------------------------------------------------------
# Per-device memory: lowering and compiling only, nothing runs.


def temp_mib(fn, *args):
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return analysis.temp_size_in_bytes / 2**20


def memory_row(S, devices, *, causal=True, backward=False, B=1, N=8, H=64):
    """Per-device XLA temp (MiB) of ring attention on `devices` devices, or (devices=0) of single-device
    blockwise attention, for float32 [B,S,N,H] self-attention."""
    mesh = mesh_of((max(devices, 1),), ("seq",))
    sharding = NamedSharding(mesh, PartitionSpec(None, "seq", None, None)) if devices else None
    x = jax.ShapeDtypeStruct((B, S, N, H), jnp.float32, sharding=sharding)
    if devices:

        def attend(q, k, v):
            return jaxattn.ring_attention(q, k, v, mesh=mesh, sequence_axis="seq", is_causal=causal)
    else:

        def attend(q, k, v):
            return jaxattn.dot_product_attention(q, k, v, is_causal=causal, implementation="blockwise")

    if backward:

        def run(q, k, v):
            out, vjp = jax.vjp(attend, q, k, v)
            return vjp(out)
    else:
        run = attend
    return temp_mib(run, x, x, x)


def check_memory():
    S = 8 * 4096
    result = {}
    for backward in (False, True):
        key = "forward+backward" if backward else "forward"
        result[key] = {
            "blockwise 1 device, S": memory_row(S, 0, backward=backward),
            "blockwise 1 device, S/8": memory_row(S // 8, 0, backward=backward),
            "ring 8 devices, S": memory_row(S, 8, backward=backward),
        }
    return result


def check_errors():
    """Bad calls raise ValueError naming the argument, at trace time: {case: message or 'no error'}."""
    mesh = mesh_of((2, 4), ("data", "seq"))
    rng = np.random.default_rng(2)

    def qkv(B=(2,), T=64, S=64, N=4, K=2):
        return [jnp.asarray(rng.normal(size=s)) for s in ((*B, T, N, 3), (*B, S, K, 3), (*B, S, K, 5))]

    calls = {
        "query": lambda: jaxattn.ring_attention(*qkv(T=36, S=36), mesh=mesh, sequence_axis="seq", is_causal=True),
        "key": lambda: jaxattn.ring_attention(*qkv(N=6, K=3), mesh=mesh, sequence_axis="seq", head_axis="data"),
        "query/key/value": lambda: jaxattn.ring_attention(
            *qkv(B=(3,)), mesh=mesh, sequence_axis="seq", batch_axis="data"
        ),
        "sequence_axis": lambda: jaxattn.ring_attention(*qkv(), mesh=mesh, sequence_axis="time"),
        "batch_axis": lambda: jaxattn.ring_attention(*qkv(B=()), mesh=mesh, sequence_axis="seq", batch_axis="data"),
        "sequence_axis/batch_axis": lambda: jaxattn.ring_attention(
            *qkv(), mesh=mesh, sequence_axis="seq", batch_axis="seq"
        ),
        "max_distance": lambda: jaxattn.ring_attention(
            *qkv(), mesh=mesh, sequence_axis="seq", key_table=jnp.zeros((3, 3))
        ),
        "key_value_seq_lengths": lambda: jaxattn.ring_attention(
            *qkv(), mesh=mesh, sequence_axis="seq", key_value_seq_lengths=jnp.ones((2,))
        ),
        "inputs": lambda: jaxattn.shard_inputs(jnp.zeros((2, 6, 4, 3)), mesh, "BTNH", sequence_axis="seq"),
    }
    messages = {}
    for name, call in calls.items():
        try:
            call()
            messages[name] = "no error"
        except ValueError as error:
            messages[name] = str(error)
    return {"messages": messages}


CHECKS = {
    **{f"ring-f64-{name}": (lambda name=name: check_case(name, np.float64)) for name in CASES},
    **{f"ring-f32-{name}": (lambda name=name: check_case(name, np.float32)) for name in ("1x8", "2x4", "4x2", "8x1")},
    "data-head-parallel": check_data_head_parallel,
    "memory": check_memory,
    "errors": check_errors,
}


if __name__ == "__main__":
    print_check_results(CHECKS, sys.argv[1:])
