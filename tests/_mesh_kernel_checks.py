"""The kernels (interpret mode) and the XLA engines on 8 host CPU devices, on a ("data", "model") = 2 x 4 mesh of
Explicit or Auto axes, against one device: test_mesh_kernels.py runs `python tests/_mesh_kernel_checks.py
[check ...]` and reads the JSON it prints ({check: {case: result}}). XLA_FLAGS must force the 8 devices before JAX
starts, hence the separate process.

Each case runs an attention call's output and the gradients of q, k, v (of sum(sin(out))) under jax.jit on inputs
placed by a PartitionSpec, and the same function on unplaced inputs (one device): the case reports the normwise
distances, the compiled program's all-gathers, and dq's spec.
"""

from __future__ import annotations

import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

# float64 by default; pallas_tpu's check runs in a process of its own with x64 off (splash refuses it).
jax.config.update("jax_enable_x64", os.environ.get("MESH_CHECKS_X64", "1") == "1")

import jaxattn  # noqa: E402
from helpers import assert_float64, normwise, print_check_results  # noqa: E402  (tests/helpers.py: this script's folder is on sys.path)
from jaxattn._mesh import activation_layout  # noqa: E402

# The layouts of the issue: batch, heads, both, and batch over both axes (FSDP-style).
LAYOUTS = {
    "batch": P("data", None, None, None),
    "heads": P(None, None, "model", None),
    "batch+heads": P("data", None, "model", None),
    "fsdp": P(("data", "model"), None, None, None),
}
HEADS = P("model")  # a per-head vector [N] split with the heads
# Every axis its own size: B = 8 (fsdp splits it 8 ways), T = 24, S = 20, N = 12, H = 8, Hv = 5.
B, T, S, N, H, Hv = 8, 24, 20, 12, 8, 5


def explicit_mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def auto_mesh():
    """Auto axes: arrays placed with a NamedSharding under plain jax.jit (the partitioner's split)."""
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def inputs(K, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    k = jax.random.normal(keys[1], (B, S, K, H), dtype)
    v = jax.random.normal(keys[2], (B, S, K, Hv), dtype)
    if dtype == jnp.float64:
        assert_float64(q, k, v)
    return q, k, v, keys[3:]


def all_gathers(compiled) -> int:
    return sum(" all-gather(" in line or " all-gather-start(" in line for line in compiled.as_text().splitlines())


def trimmed(spec) -> tuple:
    """A spec's entries without its trailing Nones (an Auto program's outputs leave them off)."""
    entries = tuple(spec)
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return entries


def compare(attend, args, layout, mesh, kv_layout=None, extra_layouts=()):
    """attend(q, k, v, *extra)'s output and the gradients of every argument (of sum(sin(out))) under jit on args
    placed by `layout` (key and value by kv_layout if given; the extra arguments, tables, slopes or sinks, by
    extra_layouts, else replicated), against one device's: normwise distances (the output's, not
    a summed loss's, which cancels), the compiled program's all-gathers, dq's spec."""

    def loss(*args):
        out = attend(*args)
        return jnp.sum(jnp.sin(out)), out

    fn = jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True)
    (_, ref_out), ref_grads = jax.jit(fn)(*args)
    kv_layout = layout if kv_layout is None else kv_layout
    # tables, slopes, sinks: split with the heads where the case says (extra_layouts), else replicated
    layouts = (layout, kv_layout, kv_layout, *extra_layouts) + (P(),) * (len(args) - 3 - len(extra_layouts))
    explicit = all(t == AxisType.Explicit for t in mesh.axis_types)
    with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():  # Auto: no mesh in context, as a user's jit
        placed = tuple(jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(args, layouts))
        compiled = jax.jit(fn).lower(*placed).compile()
        (_, out), grads = compiled(*placed)
        spec = str(P(*trimmed(grads[0].sharding.spec)))
    return {
        "value": normwise(out, ref_out),
        "grads": max(normwise(g, r) for g, r in zip(grads, ref_grads)),
        "all_gathers": all_gathers(compiled),
        "dq_spec": spec,
    }


def kernel_cases(implementation, dtype, layouts=tuple(LAYOUTS), mesh=None):
    """The kernel (interpret mode) on each layout: GQA whose key/value heads split with the query heads (K = 4),
    a shard reading one key/value head (K = 2: 6 query heads per key head, 3 a shard) and one per query head
    (K = 3: 4 per key head, 3 a shard), with key lengths, sinks and causal; and a flex score_mod that reads the
    batch and head indices (b, n) it is called with."""
    mesh, results = mesh or explicit_mesh(), {}
    explicit = all(t == AxisType.Explicit for t in mesh.axis_types)
    for K in (4, 2, 3):
        q, k, v, (kl, ks, kt) = inputs(K, dtype, seed=K)
        lengths = jax.random.randint(kl, (B,), 0, S + 1)
        sinks = jax.random.normal(ks, (N,), dtype)

        def attend(q, k, v, sinks, lengths=lengths):
            out = jaxattn.dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                key_value_seq_lengths=lengths,
                sinks=sinks,
                implementation=implementation,
                interpret=True,
            )
            return out

        if K != 4:  # K does not split 4 ways: keys and values replicated, query heads split
            results[f"K{K}-heads"] = compare(attend, (q, k, v, sinks), LAYOUTS["heads"], mesh, P(), (HEADS,))
            continue
        for layout in layouts:
            sinks_layout = HEADS if "heads" in layout else P()  # sinks [N] split with the heads
            results[f"K{K}-{layout}"] = compare(attend, (q, k, v, sinks), LAYOUTS[layout], mesh, None, (sinks_layout,))
    q, k, v, (kt, _, _) = inputs(4, dtype, seed=7)
    table = jax.random.normal(kt, (B, N), dtype)

    def score_mod(score, b, n, t, s):
        return score + 0.1 * table[b, n] * (t - s)

    def flex(q, k, v):
        out = jaxattn.flex_attention(q, k, v, score_mod, implementation=implementation, interpret=True)
        return out

    results.update(position_cases(implementation, dtype, mesh))
    if explicit:  # a BlockMask splits on Explicit axes (on Auto axes it keeps the XLA engines)
        results.update(block_mask_cases(implementation, dtype, mesh))
    if explicit:  # on Auto axes a mod that closes over an array keeps the XLA engines (jaxattn._mesh.auto_refusal)
        results["score_mod-batch+heads"] = compare(flex, (q, k, v), LAYOUTS["batch+heads"], mesh)
    else:

        def distance(q, k, v):  # a mod of (t, s) and n alone, closing over nothing
            out = jaxattn.flex_attention(
                q,
                k,
                v,
                lambda x, b, n, t, s: x - 0.05 * (n + 1) * jnp.abs(t - s),
                implementation=implementation,
                interpret=True,
            )
            return out

        results["score_mod-batch+heads"] = compare(distance, (q, k, v), LAYOUTS["batch+heads"], mesh)
    return results


def position_cases(implementation, dtype, mesh):
    """The position terms a kernel takes on a mesh, on batch x heads, gradients into their tables: ALiBi's slopes
    and T5's table (a position bias's rows split with the heads), Shaw's tables and relative_attention's per-pair
    tables per head (split) and shared (whole on every shard), DeBERTa's c2p and p2c tables (split with the heads,
    the map of offsets to rows whole)."""
    q, k, v, (ka, kb, kc) = inputs(4, dtype, seed=5)
    R = 2 * 3 + 1
    slopes = jax.random.uniform(ka, (N,), dtype, 0.05, 0.5)
    t5_table = jax.random.normal(kb, (32, N), dtype)
    tables = jax.random.split(kc, 4)
    per_head = jax.random.normal(tables[0], (R, N, H), dtype), jax.random.normal(tables[1], (R, N, Hv), dtype)
    shared = jax.random.normal(tables[2], (R, H), dtype), jax.random.normal(tables[3], (R, Hv), dtype)
    kw = dict(implementation=implementation, interpret=True)

    def alibi(q, k, v, slopes):
        return jaxattn.alibi_attention(q, k, v, slopes, is_causal=True, **kw)

    def t5(q, k, v, table):
        return jaxattn.t5_attention(q, k, v, table, max_distance=16, is_causal=True, **kw)

    def shaw(q, k, v, key_table, value_table):
        return jaxattn.shaw_relative_attention(q, k, v, key_table, value_table, max_distance=3, is_causal=True, **kw)

    def pairs(q, k, v, rel_key, rel_value):
        return jaxattn.relative_attention(q, k, v, rel_key, rel_value, is_causal=True, **kw)

    def deberta(q, k, v, position_keys, position_queries):  # DeBERTa-v3's log buckets: 2 * 4 table rows
        return jaxattn.disentangled_attention(
            q, k, v, position_keys, position_queries, max_relative_positions=16, position_buckets=4, **kw
        )

    deberta_tables = tuple(jax.random.normal(key, (8, N, H), dtype) for key in jax.random.split(jax.random.key(13), 2))
    pair_keys = jax.random.split(jax.random.key(11), 4)
    pair_per_head = tuple(jax.random.normal(key, (T, S, N, F), dtype) for key, F in zip(pair_keys[:2], (H, Hv)))
    pair_shared = tuple(jax.random.normal(key, (T, S, 1, F), dtype) for key, F in zip(pair_keys[2:], (H, Hv)))
    layout, table_heads = LAYOUTS["batch+heads"], P(None, "model", None)
    pair_heads = P(None, None, "model", None)
    return {  # per-head arrays placed split with the heads, as shard_params places a layer's
        "alibi-batch+heads": compare(alibi, (q, k, v, slopes), layout, mesh, None, (HEADS,)),
        "t5-batch+heads": compare(t5, (q, k, v, t5_table), layout, mesh, None, (P(None, "model"),)),
        "shaw-per-head-batch+heads": compare(shaw, (q, k, v, *per_head), layout, mesh, None, (table_heads,) * 2),
        "shaw-shared-batch+heads": compare(shaw, (q, k, v, *shared), layout, mesh),
        "pairs-per-head-batch+heads": compare(pairs, (q, k, v, *pair_per_head), layout, mesh, None, (pair_heads,) * 2),
        "pairs-shared-batch+heads": compare(pairs, (q, k, v, *pair_shared), layout, mesh),
        "deberta-batch+heads": compare(deberta, (q, k, v, *deberta_tables), layout, mesh, None, (table_heads,) * 2),
    }


def block_mask_cases(implementation, dtype, mesh):
    """A BlockMask of a causal sliding window (8 key positions): built for any batch and head (its arrays whole on
    every shard) and built per batch entry and head ([B,N,...], split with the batch and heads)."""
    q, k, v, _ = inputs(4, dtype, seed=9)

    def window(b, n, t, s):
        return (s <= t) & (t - s < 8)

    kw = dict(implementation=implementation, interpret=True, block_size=(8, 8))
    results = {}
    for name, (batch, heads) in (("any", (None, None)), ("per-batch-and-head", (B, N))):
        mask = jaxattn.create_block_mask(window, batch, heads, T, S, block_size=(8, 8))

        def attend(q, k, v, mask=mask):
            return jaxattn.flex_attention(q, k, v, block_mask=mask, **kw)

        results[f"block_mask-{name}-batch+heads"] = compare(attend, (q, k, v), LAYOUTS["batch+heads"], mesh)
    return results


def check_pallas_gpu():
    return kernel_cases("pallas_gpu", jnp.float64, layouts=("batch+heads", "fsdp"))


def check_pallas_gpu_all():
    return kernel_cases("pallas_gpu", jnp.float64)


def check_pallas_gpu_f32():
    return kernel_cases("pallas_gpu", jnp.float32, layouts=("batch+heads",))


def check_pallas_gpu_auto():
    results = kernel_cases("pallas_gpu", jnp.float64, layouts=("batch+heads",), mesh=auto_mesh())
    q, k, v, _ = inputs(4, jnp.float64, seed=13)

    def vmapped(q, k, v):  # jax.vmap over the batch: the partitioned call runs unsplit, vmapped (jaxattn._mesh)
        one = lambda q, k, v: jaxattn.dot_product_attention(  # noqa: E731
            q, k, v, is_causal=True, implementation="pallas_gpu", interpret=True
        )
        return jax.vmap(one)(q, k, v)

    results["vmapped-batch+heads"] = compare(vmapped, (q, k, v), LAYOUTS["batch+heads"], auto_mesh())

    # a caller's own layout (jaxattn._mesh.activation_layout, what the models' attention layers declare): the
    # kernel runs in a shard_map by it, no custom_partitioning call in the lowered program
    mesh = auto_mesh()

    def laid_out(q, k, v):
        with activation_layout(mesh, "data", "model"):
            return jaxattn.dot_product_attention(q, k, v, is_causal=True, implementation="pallas_gpu", interpret=True)

    case = compare(laid_out, (q, k, v), LAYOUTS["batch+heads"], mesh)
    placed = [jax.device_put(x, NamedSharding(mesh, LAYOUTS["batch+heads"])) for x in (q, k, v)]
    lowered = jax.jit(laid_out).lower(*placed).as_text()
    case["custom_partitioning"] = "CustomSPMDPartitioning" in lowered
    results["layout-batch+heads"] = case
    return results


def check_pallas_gpu_auto_all():
    return kernel_cases("pallas_gpu", jnp.float64, mesh=auto_mesh())


def check_pallas_tpu():
    return kernel_cases("pallas_tpu", jnp.float32, layouts=("batch+heads", "heads"))


def check_engines():
    """dense, blockwise and None (the XLA engines on a CPU) under an Explicit mesh, causal and not (the
    blockwise engine's while and scan loops), and three relative schemes on the blockwise engine (DeBERTa's
    failed there with a ShardingTypeError until its terms were read per tile without indexing a split b)."""
    mesh, results = explicit_mesh(), {}
    q, k, v, (kt, kb, _) = inputs(4, jnp.float64, seed=11)
    key_table, value_table = jax.random.normal(kt, (7, H), jnp.float64), jax.random.normal(kb, (7, Hv), jnp.float64)
    slopes = jaxattn.alibi_slopes(N)
    for implementation in ("dense", "blockwise", None):
        for causal in (True, False):

            def attend(q, k, v, causal=causal, implementation=implementation):
                out = jaxattn.dot_product_attention(q, k, v, is_causal=causal, implementation=implementation)
                return out

            results[f"{implementation}-causal={causal}"] = compare(attend, (q, k, v), LAYOUTS["batch+heads"], mesh)

    def shaw(q, k, v):
        out = jaxattn.shaw_relative_attention(
            q, k, v, key_table, value_table, max_distance=3, is_causal=True, implementation="blockwise", block_size=8
        )
        return out

    def alibi(q, k, v):
        return jaxattn.alibi_attention(q, k, v, slopes, is_causal=True, implementation="blockwise")

    lengths = jax.random.randint(kb, (B,), 0, S + 1)
    for implementation in ("dense", "blockwise"):

        def flex(q, k, v, implementation=implementation):  # score_mod and mask_mod read (b, n) beside a split score
            out = jaxattn.flex_attention(
                q,
                k,
                v,
                lambda x, b, n, t, s: x - 0.01 * (n + 1 + b) * jnp.abs(t - s),
                mask_mod=lambda b, n, t, s: (t + b) % 5 != 1,
                key_value_seq_lengths=lengths,
                implementation=implementation,
            )
            return out

        results[f"flex-{implementation}"] = compare(flex, (q, k, v), LAYOUTS["batch+heads"], mesh)
    deberta_tables = tuple(jax.random.normal(key, (8, N, H), jnp.float64) for key in jax.random.split(kt, 2))

    def deberta(q, k, v, position_keys, position_queries):  # per-row scores read per tile, split b and n
        return jaxattn.disentangled_attention(
            q,
            k,
            v,
            position_keys,
            position_queries,
            max_relative_positions=16,
            position_buckets=4,
            implementation="blockwise",
            block_size=8,
        )

    results["shaw-blockwise"] = compare(shaw, (q, k, v), LAYOUTS["batch+heads"], mesh)
    results["alibi-blockwise"] = compare(alibi, (q, k, v), LAYOUTS["batch+heads"], mesh)
    table_heads = P(None, "model", None)
    results["deberta-blockwise"] = compare(
        deberta, (q, k, v, *deberta_tables), LAYOUTS["batch+heads"], mesh, None, (table_heads,) * 2
    )
    return results


def check_sequence_refused():
    """A sequence-split query or key: ValueError naming the input, its axis and ring_attention, for a kernel (on
    Auto axes raised by the partitioning rule at compile time, inside the error XLA reports)."""
    messages = {}
    q, k, v, _ = inputs(4, jnp.float32)
    for name, layout, mesh in (
        ("query", P(None, "model", None, None), explicit_mesh()),
        ("key", P(None, "model", None, None), explicit_mesh()),
        ("query, Auto axes", P(None, "model", None, None), auto_mesh()),
    ):
        explicit = all(t == AxisType.Explicit for t in mesh.axis_types)
        with jax.set_mesh(mesh) if explicit else contextlib.nullcontext():
            args = [q, k, v]
            index = 1 if name == "key" else 0
            args[index] = jax.device_put(args[index], NamedSharding(mesh, layout))
            try:
                jax.jit(
                    lambda q, k, v: jaxattn.dot_product_attention(q, k, v, implementation="pallas_gpu", interpret=True)
                )(*args)
                messages[name] = "no error"
            except ValueError as error:
                messages[name] = str(error)
            except Exception as error:  # Auto axes: XLA's error around the rule's ValueError
                messages[name] = f"{type(error).__name__}: {error}"
    return {"messages": messages}


# the three-axis rings' mesh and sizes (data x sequence x heads), each case adding its terms
THREE_AXES = dict(mesh=(2, 2, 2), axes=("data", "seq", "heads"), batch=2, T=32, S=32, N=6, K=2, causal=True)

# ring_attention with every step on a kernel (implementation=, interpret mode): mesh shape and axes, sizes (every
# axis its own; T and S divide by D, or 2D for the causal zigzag), options. Shaw's tables in pallas_gpu's rings
# (the TPU kernel takes tables at the default positions only: its ring steps would fall back, so not named here).
RING_CASES = {
    "seq 8, zigzag causal, GQA, lengths": dict(
        mesh=(1, 8), axes=("data", "seq"), batch=1, T=48, S=48, N=6, K=2, causal=True, lengths=True
    ),
    "data 2 x seq 4, T != S, causal": dict(
        mesh=(2, 4), axes=("data", "seq"), batch=2, T=24, S=40, N=3, K=1, causal=True, lengths=False
    ),
    "data 2 x seq 4, not causal, lengths": dict(
        mesh=(2, 4), axes=("data", "seq"), batch=4, T=36, S=44, N=3, K=3, causal=False, lengths=True
    ),
    "seq 8, zigzag causal, ALiBi": dict(
        mesh=(1, 8), axes=("data", "seq"), batch=1, T=48, S=48, N=6, K=2, causal=True, lengths=True, bias="alibi"
    ),
    "data x seq x heads, causal, T5": dict(THREE_AXES, lengths=False, bias="t5"),
    "data 2 x seq 4, T != S, not causal, ALiBi": dict(
        mesh=(2, 4), axes=("data", "seq"), batch=2, T=24, S=40, N=3, K=1, causal=False, lengths=True, bias="alibi"
    ),
    "data x seq x heads, Shaw tables": dict(THREE_AXES, lengths=True, tables=True),
    "seq 8, zigzag causal, GQA, Shaw key table": dict(  # a key table alone: the kernels' backward at residuals
        mesh=(1, 8), axes=("data", "seq"), batch=1, T=48, S=48, N=6, K=2, causal=True, lengths=True, tables="key"
    ),
}
RING_MAX_DISTANCE = 3


# the rings the default group runs (test_mesh_kernels.test_ring_on_kernel_steps); the slow group runs the rest
DEFAULT_RINGS = ("seq 8, zigzag causal, GQA, lengths", "data x seq x heads, Shaw tables")


def ring_cases(implementation, dtype, biases=(None, "alibi", "t5"), names=None):
    """Each RING_CASES ring whose bias is in `biases` (every step on `implementation`, interpreted) against one
    device's dense shaw_relative_attention / position_bias_attention: the output and the gradients of q, k, v
    and the tables or the bias's array (of sum(sin(out)))."""
    import numpy as np
    from jax.sharding import Mesh

    results = {}
    for name, case in RING_CASES.items():
        if case.get("tables") and implementation != "pallas_gpu" or case.get("bias") not in biases:
            continue
        if names is not None and name not in names:
            continue
        mesh = Mesh(np.array(jax.devices()).reshape(case["mesh"]), case["axes"])
        batch_axis, seq = case["axes"][:2]
        head_axis = case["axes"][2] if len(case["axes"]) > 2 else None
        keys = jax.random.split(jax.random.key(len(name)), 6)
        Bc, Tc, Sc, Nc, Kc = (case[k] for k in ("batch", "T", "S", "N", "K"))
        q = jax.random.normal(keys[0], (Bc, Tc, Nc, H), dtype)
        k = jax.random.normal(keys[1], (Bc, Sc, Kc, H), dtype)
        v = jax.random.normal(keys[2], (Bc, Sc, Kc, Hv), dtype)
        R = 2 * RING_MAX_DISTANCE + 1
        tables = ()
        if case.get("tables"):  # a per-head key table, a shared value table (or none: tables="key")
            tables = (jax.random.normal(keys[3], (R, Nc, H), dtype), jax.random.normal(keys[4], (R, Hv), dtype))
            tables = tables[:1] if case["tables"] == "key" else tables
        bias_of = {  # the bias's array (ALiBi's slopes, T5's table) is differentiated like a table
            "alibi": (jax.random.uniform(keys[5], (Nc,), dtype, 0.1, 1.0), jaxattn.alibi_position_bias),
            "t5": (jax.random.normal(keys[5], (16, Nc), dtype), lambda t: jaxattn.t5_position_bias(t, max_distance=12)),
        }.get(case.get("bias"))
        if bias_of is not None:
            tables = (bias_of[0],)
        lengths = jnp.arange(Bc) * (Sc // Bc) + 3 if case["lengths"] else None  # 3 .. S: one row sees few keys
        options = dict(is_causal=case["causal"], key_value_seq_lengths=lengths)
        if case.get("tables"):
            options["max_distance"] = RING_MAX_DISTANCE

        def ring(q, k, v, *tables):
            terms = dict(zip(("key_table", "value_table"), tables))
            if bias_of is not None:
                terms = {"position_bias": bias_of[1](tables[0])}
            return jaxattn.ring_attention(
                q,
                k,
                v,
                mesh=mesh,
                sequence_axis=seq,
                batch_axis=batch_axis,
                head_axis=head_axis,
                implementation=implementation,
                interpret=True,
                **terms,
                **options,
            )

        def dense(q, k, v, *tables):
            if bias_of is not None:
                bias = bias_of[1](tables[0])
                return jaxattn.position_bias_attention(q, k, v, bias, **options, implementation="dense")
            return jaxattn.shaw_relative_attention(
                q,
                k,
                v,
                *(tuple(tables) + (None,) * (2 - len(tables))),
                **{"max_distance": RING_MAX_DISTANCE, **options},
                implementation="dense",
            )

        def loss(*args, f):
            out = f(*args)
            return jnp.sum(jnp.sin(out)), out

        def run(f):
            argnums = tuple(range(3 + len(tables)))
            return jax.jit(jax.value_and_grad(functools.partial(loss, f=f), argnums=argnums, has_aux=True))

        (_, ref_out), ref_grads = run(dense)(q, k, v, *tables)
        placed = [
            jaxattn.shard_inputs(x, mesh, letters, batch_axis=batch_axis, sequence_axis=seq, head_axis=head_axis)
            for x, letters in ((q, "BTNH"), (k, "BSKH"), (v, "BSKH"))
        ]
        compiled = run(ring).lower(*placed, *tables).compile()
        (_, out), grads = compiled(*placed, *tables)
        results[name] = {
            "value": normwise(out, ref_out),
            "grads": max(normwise(g, r) for g, r in zip(grads, ref_grads)),
            "all_gathers": all_gathers(compiled),
            "dq_spec": str(grads[0].sharding.spec),
        }
    return results


def check_ring_pallas_gpu():
    return ring_cases("pallas_gpu", jnp.float64, biases=(None,), names=DEFAULT_RINGS)


def check_ring_more_pallas_gpu():  # the rings beyond DEFAULT_RINGS without a bias: T != S, lengths, a key table
    rest = tuple(name for name, case in RING_CASES.items() if name not in DEFAULT_RINGS and not case.get("bias"))
    return ring_cases("pallas_gpu", jnp.float64, biases=(None,), names=rest)


def check_ring_bias_pallas_gpu():  # T5's and ALiBi's biases: one kernel call per pair of chunks
    return ring_cases("pallas_gpu", jnp.float64, biases=("alibi", "t5"))


def check_ring_pallas_tpu():
    return ring_cases("pallas_tpu", jnp.float32)


CHECKS = {
    "ring_pallas_gpu": check_ring_pallas_gpu,
    "ring_more_pallas_gpu": check_ring_more_pallas_gpu,
    "ring_bias_pallas_gpu": check_ring_bias_pallas_gpu,
    "ring_pallas_tpu": check_ring_pallas_tpu,
    "pallas_gpu": check_pallas_gpu,
    "pallas_gpu_f32": check_pallas_gpu_f32,
    "pallas_gpu_all": check_pallas_gpu_all,
    "pallas_gpu_auto": check_pallas_gpu_auto,
    "pallas_gpu_auto_all": check_pallas_gpu_auto_all,
    "pallas_tpu": check_pallas_tpu,
    "engines": check_engines,
    "sequence": check_sequence_refused,
}


if __name__ == "__main__":
    print_check_results(CHECKS, sys.argv[1:])
