"""The kernels on a mesh (jaxattn._mesh, docs/sharding.md "Kernels on a mesh"): on a mesh of 8 host CPU devices
(2 x 4), Explicit axes (jax.set_mesh, shard_map from the inputs' types) and Auto axes (arrays placed with a
NamedSharding under plain jit: custom_partitioning), each kernel, in Pallas' interpreter, runs on every device's
shard of the batch and heads and equals one device (float64 normwise 1e-12, float32 1e-6, the output and the
gradients of q, k, v and of every table: sinks, ALiBi's slopes, T5's table, Shaw's tables), with no all-gather in
the compiled program; the XLA engines and two relative schemes trace and run
under Explicit axes too (their loop carries placed like the queries), and a sequence-split input is refused by
name, pointing at ring_attention. The checks run in subprocesses (tests/_mesh_kernel_checks.py): 8 devices must
be forced before JAX starts."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "_mesh_kernel_checks.py")
TOL = {"float64": 1e-12, "float32": 1e-6}


# JAX's persistent cache variables (tests/conftest.py) are left out for the interpreted TPU ring: its largest
# programs (about 4 MB of CPU code each) compile and run, but XLA's CPU loader overflows a worker thread's stack
# reading them back from the cache (a segfault in xla::cpu::ObjectLoader::LookupSymbols under 8000 frames of LLVM
# ORC lookups, with `ulimit -s 262144` too; jax 0.10.2, 2026-11-29: CI's warm slow group, and
# `python tests/_mesh_kernel_checks.py ring_pallas_tpu` run twice with JAX_COMPILATION_CACHE_DIR set). Cold, the
# check takes about 2 minutes on 2 cores.
UNCACHED = {"ring_pallas_tpu"}


def run_checks(*names, x64=True):
    dropped = {"XLA_FLAGS"}
    if UNCACHED.intersection(names):
        dropped |= {"JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"}
        dropped |= {"JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"}
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["MESH_CHECKS_X64"] = "1" if x64 else "0"
    run = subprocess.run([sys.executable, SCRIPT, *names], capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for name in names:
        assert "error" not in results[name], results[name]["error"]
    return results


@pytest.fixture(scope="module")
def default_results():
    return run_checks("pallas_gpu", "pallas_gpu_auto", "engines", "sequence", "ring_pallas_gpu")


def assert_equal_to_one_device(cases, tol):
    assert cases, "no case ran"
    for name, case in cases.items():
        if name == "seconds":
            continue
        assert case["value"] <= tol and case["grads"] <= tol, (name, case)
        if not name.startswith("vmapped"):  # a vmapped call runs unsplit (no batching rule for the partitioning)
            assert case["all_gathers"] == 0, (name, case)  # each device computed its own shard


@pytest.mark.parametrize("axes", ["pallas_gpu", "pallas_gpu_auto"])  # Explicit, Auto
def test_pallas_gpu_on_shards(default_results, axes):
    cases = default_results[axes]
    assert_equal_to_one_device(cases, TOL["float64"])
    # the gradients stay split as the inputs were (without the split, Auto axes gave 18 all-gathers and
    # replicated gradients: P())
    assert cases["K4-batch+heads"]["dq_spec"] == "P('data', None, 'model')"
    if axes == "pallas_gpu_auto":  # jax.vmap over an Auto-axes call (a batching rule: runs unsplit, vmapped)
        assert "vmapped-batch+heads" in cases
        # inside a caller's activation_layout (the models' attention layers) a shard_map by it, no partitioner
        assert cases["layout-batch+heads"]["custom_partitioning"] is False, cases["layout-batch+heads"]
    assert {"K2-heads", "K3-heads", "score_mod-batch+heads", "t5-batch+heads", "shaw-shared-batch+heads"} <= set(cases)
    assert {"pairs-per-head-batch+heads", "pairs-shared-batch+heads", "deberta-batch+heads"} <= set(cases)
    if axes == "pallas_gpu":  # Explicit axes: FSDP-batch, and BlockMasks (whole, and split with batch and heads)
        assert cases["K4-fsdp"]["dq_spec"] == "P(('data', 'model'),)"
        assert {"block_mask-any-batch+heads", "block_mask-per-batch-and-head-batch+heads"} <= set(cases)


@pytest.mark.slow  # every layout; test_pallas_gpu_on_shards runs two of them and every GQA case
@pytest.mark.parametrize("axes", ["pallas_gpu_all", "pallas_gpu_auto_all"])
def test_pallas_gpu_on_every_layout(axes):
    cases = run_checks(axes)[axes]
    assert_equal_to_one_device(cases, TOL["float64"])
    assert cases["K4-fsdp"]["dq_spec"] == "P(('data', 'model'),)" and cases["K4-batch"]["dq_spec"] == "P('data',)"


def test_ring_on_kernel_steps(default_results):
    """ring_attention with every step on pallas_gpu (interpreted): the zigzag causal ring over 8 devices with GQA
    and key lengths, and data x sequence x heads with Shaw's tables equal one device's dense attention in
    float64, gradients of q, k, v and the tables included."""
    cases = default_results["ring_pallas_gpu"]
    assert_equal_to_one_device(cases, TOL["float64"])
    assert cases["data x seq x heads, Shaw tables"]["dq_spec"] == "P('data', 'seq', 'heads', None)"
    assert len(cases) == 3  # two rings and the seconds


@pytest.mark.slow  # test_ring_on_kernel_steps runs the zigzag and the three-axis rings
def test_more_rings_on_kernel_steps():
    """The data x sequence rings: T != S causal (contiguous chunks of unequal length), not causal with lengths;
    the zigzag ring with Shaw's key table alone (its steps' backward at the ring's residuals, the table's gradient
    from the kernels' d row_bias)."""
    cases = run_checks("ring_more_pallas_gpu")["ring_more_pallas_gpu"]
    assert_equal_to_one_device(cases, TOL["float64"])
    assert len(cases) == 4


@pytest.mark.parametrize(
    "platform, kernel_call",
    [("cuda", "__gpu$xla.gpu.triton"), pytest.param("tpu", "tpu_custom_call", marks=pytest.mark.slow)],
)
def test_ring_with_t5_lowers_to_the_kernels(platform, kernel_call):
    """A T5 bias in the ring (implementation=None, lowered for a GPU / TPU on a mesh of the one CPU device): the
    step's pair of chunks holds the kernels (its causal and whole kinds: 2 forward calls; the training step adds
    dq and dk/dv for each at the ring's residuals, the bias's rows' gradient among them: 6, no recomputed forward),
    no XLA tile loop of the blockwise ring."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import jaxattn

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "seq"))
    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((32, 4), jnp.float32)

    def loss(q, k, v, table):
        bias = jaxattn.t5_position_bias(table, bidirectional=False)
        out = jaxattn.ring_attention(
            q, k, v, mesh=mesh, sequence_axis="seq", batch_axis="data", is_causal=True, position_bias=bias
        )
        return jnp.sum(out.astype(jnp.float32))

    with jax.enable_x64(False), jaxattn.cross_platform_lowering():
        for fn, calls in ((loss, 2), (jax.grad(loss, argnums=(0, 1, 2, 3)), 6)):
            text = jax.jit(fn).trace(q, kv, kv, table).lower(lowering_platforms=(platform,)).as_text()
            assert text.count(kernel_call) == calls and "stablehlo.while" not in text, (text.count(kernel_call), calls)


@pytest.mark.parametrize("platform, kernel_call", [("cuda", "__gpu$xla.gpu.triton"), ("tpu", "tpu_custom_call")])
def test_ring_steps_lower_to_the_kernels(platform, kernel_call):
    """implementation=None, lowered for a GPU / TPU (cross_platform_lowering), on a mesh of the one CPU device: the
    ring's training step holds exactly the forward kernel and the backward's two (dq, dk/dv) at the ring's
    residuals, no recomputed forward (4 calls) and no XLA tile loop of the blockwise ring (while loops)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import jaxattn

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "seq"))
    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        out = jaxattn.ring_attention(q, k, v, mesh=mesh, sequence_axis="seq", batch_axis="data", is_causal=True)
        return jnp.sum(out.astype(jnp.float32))

    with jax.enable_x64(False), jaxattn.cross_platform_lowering():  # the TPU kernels index in int32
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=(platform,))
    text = lowered.as_text()
    assert text.count(kernel_call) == 3 and "stablehlo.while" not in text


def test_ring_with_a_shaw_key_table_takes_the_kernels_backward_at_residuals():
    """Shaw's key table alone in the ring, lowered for a GPU: the training step holds the forward kernel and the
    backward's dq and dk/dv at the ring's residuals (3 calls; 4 while the step's backward recomputed its forward
    under jax.vjp). With a value table too, whose gradient needs the step's own P by offset, the forward is
    recomputed (4)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    import jaxattn

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "seq"))
    q = jax.ShapeDtypeStruct((2, 256, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 256, 2, 64), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((9, 64), jnp.float32)

    def loss(q, k, v, *tables):
        terms = dict(zip(("key_table", "value_table"), tables))
        out = jaxattn.ring_attention(
            q, k, v, mesh=mesh, sequence_axis="seq", batch_axis="data", is_causal=True, max_distance=4, **terms
        )
        return jnp.sum(out.astype(jnp.float32))

    for tables, calls in (((table,), 3), ((table, table), 4)):
        argnums = tuple(range(3 + len(tables)))
        with jax.enable_x64(False), jaxattn.cross_platform_lowering():
            lowered = (
                jax.jit(jax.grad(loss, argnums=argnums)).trace(q, kv, kv, *tables).lower(lowering_platforms=("cuda",))
            )
        text = lowered.as_text()
        assert text.count("__gpu$xla.gpu.triton") == calls and "stablehlo.while" not in text, len(tables)


@pytest.mark.slow  # one kernel call per pair of chunks (both causal kinds compiled): 50 s interpreted
def test_ring_with_a_position_bias_on_kernel_steps():
    """T5's and ALiBi's biases (OffsetBias) in the kernels' ring: zigzag causal over 8 devices, causal with the
    heads split too (T5's table split with them), not causal with T != S; gradients of the slopes / table."""
    cases = run_checks("ring_bias_pallas_gpu")["ring_bias_pallas_gpu"]
    assert_equal_to_one_device(cases, TOL["float64"])
    assert len(cases) == 4


@pytest.mark.slow  # the TPU flex kernel's ring steps, interpreted (x64 off: the TPU kernels index in int32)
def test_ring_on_tpu_kernel_steps():
    cases = run_checks("ring_pallas_tpu", x64=False)["ring_pallas_tpu"]
    assert_equal_to_one_device(cases, TOL["float32"])
    assert len(cases) == 7  # three plain rings, three with a bias, and the seconds


def test_xla_engines_under_explicit_mesh(default_results):
    assert_equal_to_one_device(default_results["engines"], TOL["float64"])
    assert {"shaw-blockwise", "alibi-blockwise", "deberta-blockwise"} <= set(default_results["engines"])


def test_sequence_split_refused_by_name(default_results):
    messages = default_results["sequence"]["messages"]
    for name in ("query", "key"):
        assert messages[name].startswith(f"{name}: "), messages[name]
        assert "ring_attention" in messages[name] and "'model'" in messages[name], messages[name]
    # Auto axes: the split is the partitioner's, so the rule raises while XLA compiles, inside XLA's error
    auto = messages["query, Auto axes"]
    assert "ValueError: query: expected its sequence dim (T) not split" in auto and "ring_attention" in auto, auto


@pytest.mark.slow  # test_pallas_gpu_on_shards runs the same cases in float64
def test_pallas_gpu_on_shards_float32():
    assert_equal_to_one_device(run_checks("pallas_gpu_f32")["pallas_gpu_f32"], TOL["float32"])


@pytest.mark.slow  # the TPU kernels interpreted on every shard (x64 off: splash refuses it)
def test_pallas_tpu_on_shards():
    assert_equal_to_one_device(run_checks("pallas_tpu", x64=False)["pallas_tpu"], TOL["float32"])


def test_one_device_program_is_unchanged():
    """A call on one device is not split: lowered for CUDA (cross_platform_lowering), its program holds the kernel
    and neither a custom_partitioning call nor a shard_map (the Auto path only starts on a multi-device mesh)."""
    import jax
    import jax.numpy as jnp

    import jaxattn

    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((2, 128, 2, 64), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(jaxattn.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32))

    with jaxattn.cross_platform_lowering():
        text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text  # the kernels
    assert "CustomSPMDPartitioning" not in text and "sdy.manual_computation" not in text
