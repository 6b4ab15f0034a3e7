"""Sharded attention: ring (sequence-parallel), data- and head-parallel, on 8 host CPU devices.

The multi-device checks run once, in a subprocess (tests/_sharding_checks.py) that forces 8 devices
before JAX starts; this session keeps its single device. Each test below reads that run's results:
sharded == single-device dense attention (float64 normwise 1e-12, float32 1e-6, forward and every
gradient) over meshes 1x8, 2x4, 4x2, 8x1 (and 2x2x2 with heads split), the compiled programs' collectives
(ppermutes for the ring, never an all-gather), and per-device XLA temp memory at S = 8 x 4096.
The placement helpers' cheap checks (a 1-device mesh) run in this session.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxattn

jax.config.update("jax_enable_x64", True)

TOL = {"float64": 1e-12, "float32": 1e-6}
SCRIPT = os.path.join(os.path.dirname(__file__), "_sharding_checks.py")
F64_MESHES = ["1x8", "2x4", "4x2", "8x1", "2x2x2"]
F32_MESHES = ["1x8", "2x4", "4x2", "8x1"]


@pytest.fixture(scope="module")
def results():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def get(results, name):
    result = results[name]
    assert "error" not in result, result["error"]
    return result


@pytest.mark.slow  # reads the 8-device subprocess run (_sharding_checks.py)
@pytest.mark.parametrize("dtype,mesh", [("float64", m) for m in F64_MESHES] + [("float32", m) for m in F32_MESHES])
def test_ring_equals_single_device(results, dtype, mesh):
    result = get(results, f"ring-{ {'float64': 'f64', 'float32': 'f32'}[dtype] }-{mesh}")
    assert result["dtype"] == dtype
    assert result["forward"] <= TOL[dtype]
    assert result["finite"]
    for name, error in result["grads"].items():
        assert error <= TOL[dtype], (name, error)
    assert "'seq'" in result["out_spec"]  # the output stays sharded over the sequence


@pytest.mark.slow  # reads the 8-device subprocess run (_sharding_checks.py)
@pytest.mark.parametrize("mesh", F64_MESHES)
def test_ring_collectives(results, mesh):
    """The ring is collective permutes; keys/values are never all-gathered (nor all-to-all'd). The only
    all-reduces are the gradient sums of the Shaw tables / position-bias arrays shared by devices."""
    ops = get(results, f"ring-f64-{mesh}")["collectives"]
    ring_size = {"1x8": 8, "2x4": 4, "4x2": 2, "8x1": 1, "2x2x2": 2}[mesh]
    assert (ops["collective-permute"] > 0) == (ring_size > 1)
    assert ops["all-gather"] == 0 and ops["all-to-all"] == 0 and ops["reduce-scatter"] == 0
    assert ops["all-reduce"] <= 2


@pytest.mark.slow  # reads the 8-device subprocess run (_sharding_checks.py)
def test_data_and_head_parallel_jit(results):
    """The ordinary layers under jit with NamedSharding (batch over 'data', heads over 'model'): equal to
    one device, and no all-gather: the all-reduce of the output projection's sum over heads is the only
    collective in the forward pass (its transpose and the weight gradients' batch sums come with grad)."""
    for name, result in get(results, "data-head-parallel").items():
        if name == "seconds":
            continue
        assert result["loss"] <= 1e-12 and result["grads"] <= 1e-12, (name, result)
        assert result["collectives"]["all-gather"] == 0, name
        assert result["collectives"]["all-to-all"] == 0, name
        assert result["query_kernel_spec"] == "P(None, 'model', None)"
        if "default-tiles" in name:  # one device would loop over row groups; sharded, nothing is gathered
            assert result["one_device_row_groups"] > 1, (name, result)


@pytest.mark.slow  # reads the 8-device subprocess run (_sharding_checks.py)
def test_per_device_memory(results):
    """S = 8 x 4096, float32 [1,S,8,64], causal, compiled only. Measured: the ring's per-device temp is
    0.167x (forward) and 0.175x (forward+backward) of one device holding all of S. What stays above 1/8:
    the arrived queries (zigzag) and the held key/value share are copies a single device reads from its
    arguments, and backward the travelling dk/dv (docs/sharding.md). Key/value shares travel in pieces,
    so less than one extra piece is in flight. Against one device holding only S/8 the ring needs 1.25x /
    1.40x: since issue 13 that device runs row groups (tiles of one head, ~1 MiB: 25.8 / 40.3 MiB, was
    43.1 / 76.2), while the ring's tiles still span every row of its share (its figures are unchanged).
    Bounds with a little margin, so a regression of the ring shows."""
    memory = get(results, "memory")
    for phase, bound, share_bound in (("forward", 0.175, 1.32), ("forward+backward", 0.19, 1.47)):
        row = memory[phase]
        ring, full, share = row["ring 8 devices, S"], row["blockwise 1 device, S"], row["blockwise 1 device, S/8"]
        assert ring <= bound * full, (phase, row)
        assert ring <= share_bound * share, (phase, row)


@pytest.mark.slow  # reads the 8-device subprocess run (_sharding_checks.py)
def test_errors_name_the_argument(results):
    for name, message in get(results, "errors")["messages"].items():
        assert message.startswith(f"{name}: expected"), (name, message)


# ---------------------------------------------------------------------------------------------------
# Single-device checks (this session: one CPU device, a 1-device mesh).


def one_device_mesh():
    return Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "seq"))


def test_shard_params_layouts():
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1), ("model",))
    params = jaxattn.init_relative_multi_head_attention(
        jax.random.key(0), 6, 4, 3, num_kv_heads=2, max_distance=2, share_heads=True
    )
    placed = jaxattn.shard_params(params, mesh, head_axis="model")
    specs = jax.tree.map(lambda x: tuple(x.sharding.spec), placed)
    assert specs["query"]["kernel"] == (None, "model", None) and specs["query"]["bias"] == ("model", None)
    assert specs["key"]["kernel"] == (None, "model", None) and specs["out"]["kernel"] == ("model", None, None)
    assert specs["out"]["bias"] == (None,) and specs["relative"]["key"] == (None, None)
    with pytest.raises(ValueError, match=r"params\['extra'\]"):
        jaxattn.shard_params({**params, "extra": {"w": jnp.zeros(2)}}, mesh, head_axis="model")
    with pytest.raises(ValueError, match="head_axis: expected one of the mesh's axes"):
        jaxattn.shard_params(params, mesh, head_axis="heads")


def test_shard_inputs_checks_rank():
    mesh = one_device_mesh()
    placed = jaxattn.shard_inputs({"x": jnp.zeros((2, 5, 4))}, mesh, "BTE", batch_axis="data")
    assert tuple(placed["x"].sharding.spec) == ("data", None, None)
    with pytest.raises(ValueError, match=r"inputs\['x'\]: expected rank 4"):
        jaxattn.shard_inputs({"x": jnp.zeros((2, 5, 4))}, mesh, "BTNH")
    with pytest.raises(ValueError, match="mesh: expected a jax.sharding.Mesh"):
        jaxattn.shard_inputs(jnp.zeros((2, 5, 4)), "mesh", "BTE")
