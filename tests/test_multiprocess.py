"""Ring attention and sharded layers across processes: 2 processes x 4 host CPU devices on localhost.

Both processes run tests/_multiprocess_worker.py (jax.distributed over gloo CPU collectives, one global
mesh of 8 devices): the causal ring over all 8 devices (GQA, key lengths, Shaw tables) and data/head-
sharded multi_head_attention, forward and gradients, each gathered and compared with the process's own
single-device dense run in float64. This file only starts them (bounded time) and reads their reports.
"""

import os

import pytest

from helpers import run_processes

pytestmark = pytest.mark.slow  # two processes x 4 devices: the longest single check

WORKER = os.path.join(os.path.dirname(__file__), "_multiprocess_worker.py")
PROCESSES = 2
TIMEOUT_S = 240  # generous for a loaded 2-core machine; about 30 s when it is quiet
TOL = 1e-12


@pytest.fixture(scope="module")
def reports():
    return run_processes(WORKER, PROCESSES, timeout_s=TIMEOUT_S)


def test_runtime_spans_processes(reports):
    assert [r["process_index"] for r in reports] == list(range(PROCESSES))
    for r in reports:
        assert (r["process_count"], r["devices"], r["local_devices"]) == (PROCESSES, 8, 4)


def check(report, name):
    result = report[name]
    assert "error" not in result, result["error"]
    return result


@pytest.mark.parametrize("process", range(PROCESSES))
def test_causal_ring_across_processes(reports, process):
    result = check(reports[process], "ring-1x8")
    assert result["dtype"] == "float64"
    assert result["forward"] <= TOL
    assert sorted(result["grads"]) == ["k", "key_table", "q", "v", "value_table"]
    for name, error in result["grads"].items():
        assert error <= TOL, (name, error)


@pytest.mark.parametrize("process", range(PROCESSES))
@pytest.mark.parametrize("implementation", ["dense", "blockwise"])
def test_data_head_sharded_mha_across_processes(reports, process, implementation):
    result = check(reports[process], "data-head-parallel")[implementation]
    assert result["n_grads"] == 9  # 4 kernels, 4 biases and the input
    assert result["loss"] <= TOL
    assert result["grads"] <= TOL


def test_processes_agree(reports):
    """Every process gathered the same global results."""
    strip = [{k: v for k, v in r.items() if k != "process_index"} for r in reports]
    for r in strip:
        for result in r.values():
            if isinstance(result, dict):
                result.pop("seconds", None)
    assert strip[0] == strip[1]
