"""crosscheck's comparison engine on hand-made functions whose errors are known in advance."""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from crosscheck import TOLERANCES, Report, Tolerance, assert_equivalent, compare, error_metrics
from crosscheck.catalogue import Const

REPO = Path(__file__).resolve().parents[1]
RNG = np.random.default_rng(7)
X = RNG.standard_normal((2, 5, 3))  # B, T, E: distinct sizes


def test_tolerance_table_is_the_design_bar():
    assert TOLERANCES["float64"] == Tolerance(forward=1e-12, grad=1e-12)
    assert TOLERANCES["float32"] == Tolerance(forward=1e-6, grad=1e-5)


def test_error_metrics_of_a_known_perturbation():
    expected = np.full(100, 2.0)
    actual = expected.copy()
    actual[17] += 1e-3
    max_abs, max_rel, normwise = error_metrics(actual, expected)
    assert max_abs == pytest.approx(1e-3, rel=1e-9)
    assert max_rel == pytest.approx(0.5e-3, rel=1e-9)
    assert normwise == pytest.approx(1e-3 / 20.0, rel=1e-9)  # ||(1e-3, 0...)|| / ||2 * ones(100)||


def test_error_metrics_zero_reference_and_floor():
    assert error_metrics(np.zeros(4), np.zeros(4)) == (0.0, 0.0, 0.0)
    _, max_rel, normwise = error_metrics(np.array([0.0, 3e-3, 4e-3]), np.zeros(3))
    assert max_rel == 0.0 and normwise == pytest.approx(5e-3)  # absolute when the reference is all zeros
    assert error_metrics(np.array([1e-16]), np.array([2e-16]), norm_floor=1.0)[2] == pytest.approx(1e-16)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_error_metrics_non_finite_is_nan(bad):
    a = np.ones(3)
    a[1] = bad
    assert all(math.isnan(v) for v in error_metrics(a, np.ones(3)))
    assert all(math.isnan(v) for v in error_metrics(np.ones(3), a))


def _scaled(c):
    return lambda x: x * c


def jax_tanh(x):  # inputs arrive as keywords: jnp.tanh(x=...) would not take them
    return jnp.tanh(x)


def torch_tanh(x):
    return torch.tanh(x)


@pytest.mark.parametrize("transform", ["plain", "jit", "vmap"])
def test_exact_match_passes(transform):
    report = compare(jax_tanh, torch_tanh, {"x": X}, dtype="float64", transform=transform)
    assert report.passed, report
    assert {m.name for m in report.metrics} == {"output", "x"}
    leading = (3,) if transform == "vmap" else ()
    assert report.metrics[0].shape == leading + X.shape


def test_perturbation_is_measured_and_fails_float64():
    report = compare(_scaled(1 + 1e-6), _scaled(1.0), {"x": X}, dtype="float64")
    assert not report.passed
    (out,) = [m for m in report.metrics if m.kind == "output"]
    (grad,) = [m for m in report.metrics if m.kind == "grad"]
    assert out.normwise == pytest.approx(1e-6, rel=1e-6) and not out.passed
    assert grad.normwise == pytest.approx(1e-6, rel=1e-6) and not grad.passed  # d(c x)/dx = c


def test_float32_forward_and_gradient_thresholds_differ():
    # 3e-6 is over the float32 forward bar (1e-6) and under the gradient bar (1e-5)
    report = compare(_scaled(np.float32(1 + 3e-6)), _scaled(1.0), {"x": X}, dtype="float32", transform="jit")
    by_kind = {m.kind: m for m in report.metrics}
    assert not by_kind["output"].passed and by_kind["grad"].passed
    assert by_kind["output"].normwise == pytest.approx(3e-6, rel=0.1)
    assert not report.passed


def test_nan_fails_on_either_side():
    def jax_nan(x):
        return x.at[0, 0, 0].set(jnp.nan)

    def torch_nan(x):
        y = x * 1
        y[0, 0, 0] = float("nan")
        return y

    for jax_fn, torch_fn in ((jax_nan, _scaled(1.0)), (_scaled(1.0), torch_nan)):
        report = compare(jax_fn, torch_fn, {"x": X}, dtype="float64", grad=False)
        assert not report.passed
        assert "non-finite" in report.metrics[0].note
        assert math.isinf(report.worst("output"))


def test_all_zero_output_is_not_a_pass():
    report = compare(lambda x: x * 0, lambda x: x * 0, {"x": X}, dtype="float64")
    assert not report.passed
    assert "vacuous" in report.metrics[0].note


@pytest.mark.parametrize("transform", ["plain", "jit", "vmap"])
def test_wrong_output_dtype_fails(transform):
    report = compare(lambda x: x.astype(jnp.float64), _scaled(1.0), {"x": X}, dtype="float32", transform=transform)
    assert not report.passed
    assert "JAX dtype float64 != requested float32" in report.metrics[0].note
    assert {m.name for m in report.metrics} == {"output", "x"}  # gradients still measured


@pytest.mark.parametrize("transform", ["plain", "jit", "vmap"])
def test_shape_mismatch_is_a_problem_not_a_crash(transform):
    report = compare(lambda x: x[0], _scaled(1.0), {"x": X}, dtype="float64", transform=transform)
    assert not report.passed
    assert any("shape" in p for p in report.problems)


def test_an_error_of_the_jax_function_is_raised_not_swallowed():
    def broken(x):
        raise ValueError("broken on purpose")

    for transform in ("plain", "jit"):
        with pytest.raises(ValueError, match="broken on purpose"):
            compare(broken, torch_tanh, {"x": X}, dtype="float64", transform=transform)


def test_reference_cache_runs_torch_once_for_identical_numbers():
    calls = []

    def counted(x):
        calls.append(x.shape)
        return torch.tanh(x)

    shared = {}
    cached = [
        compare(jax_tanh, counted, {"x": X}, dtype="float64", transform=t, reference_cache=shared)
        for t in ("plain", "jit", "vmap")
    ]
    assert len(calls) == 1 + 3  # plain and jit feed torch the same numbers; vmap runs its 3 slices
    fresh = [compare(jax_tanh, torch_tanh, {"x": X}, dtype="float64", transform=t) for t in ("plain", "jit", "vmap")]
    for a, b in zip(cached, fresh):
        assert a.passed and a.metrics == b.metrics


def test_const_inputs_are_neither_differentiated_nor_batched():
    def jax_fn(x, mask):
        return jnp.where(mask, x, 0.0)

    def torch_fn(x, mask):
        return torch.where(mask, x, torch.zeros((), dtype=x.dtype))

    mask = Const(RNG.random(X.shape) < 0.5)
    report = compare(jax_fn, torch_fn, {"x": X, "mask": mask}, dtype="float64", transform="vmap")
    assert report.passed, report
    assert [m.name for m in report.metrics if m.kind == "grad"] == ["x"]


def test_params_gradients_mapped_from_torch_layout():
    w = RNG.standard_normal((3, 4))  # jax kernel [in, out]; torch weight [out, in]
    report = compare(
        lambda p, x: jnp.tanh(x @ p["kernel"]),
        lambda p, x: torch.tanh(x @ p["weight"].T),
        {"x": X},
        dtype="float64",
        transform="vmap",
        params={"kernel": w},
        torch_params={"weight": w.T},
        grads_from_torch=lambda g: {"kernel": g["weight"].T},
    )
    assert report.passed, report
    assert {m.name for m in report.metrics} == {"output", "x", "params/kernel"}


def test_wrong_param_gradient_mapping_fails():
    w = RNG.standard_normal((3, 3))
    report = compare(
        lambda p, x: x @ p["kernel"],
        lambda p, x: x @ p["weight"].T,
        {"x": X},
        dtype="float64",
        params={"kernel": w},
        torch_params={"weight": w.T},
        grads_from_torch=lambda g: {"kernel": g["weight"]},
    )
    assert not report.passed  # the forward agrees, the untransposed gradient does not
    assert [m.name for m in report.metrics if not m.passed] == ["params/kernel"]


def test_assert_equivalent_raises_with_the_report():
    assert_equivalent(jax_tanh, torch_tanh, {"x": X}, dtype="float64")
    with pytest.raises(AssertionError, match="FAIL.*float64"):
        assert_equivalent(_scaled(1.001), _scaled(1.0), {"x": X}, dtype="float64")


def test_report_json_round_trip():
    report = compare(jax_tanh, torch_tanh, {"x": X}, dtype="float64", name="tanh")
    data = json.loads(json.dumps(report.to_dict()))
    assert data["case"] == "tanh" and data["passed"] is True and data["dtype"] == "float64"
    nan_report = Report("nan", "float64", "plain", (), ("boom",))
    assert json.loads(json.dumps(nan_report.to_dict()))["worst_output"] == "nan"


def test_bad_arguments():
    with pytest.raises(ValueError, match="transform"):
        compare(jax_tanh, torch_tanh, {"x": X}, dtype="float64", transform="pmap")
    with pytest.raises(ValueError, match="dtype"):
        compare(jax_tanh, torch_tanh, {"x": X}, dtype="int32")


def test_float64_refused_without_x64():
    """With x64 off (jax.enable_x64(False): this thread, this block), float64 is refused and float32 runs."""
    j, t = (lambda x: jnp.sin(x)), (lambda x: torch.sin(x))
    with jax.enable_x64(False):
        with pytest.raises(RuntimeError, match="compare: float64 requested but JAX's x64 mode is off"):
            compare(j, t, {"x": np.ones(3)}, dtype="float64")
        assert compare(j, t, {"x": np.ones(3)}, dtype="float32").passed
    assert jax.config.jax_enable_x64  # and the rest of the session is unaffected
