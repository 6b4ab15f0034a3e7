"""Run one computation in JAX and in PyTorch on the same numbers and measure how far apart they land.

`compare` feeds identical inputs (numpy arrays cast to the requested dtype) to a JAX function and a torch
function, pulls one fixed random cotangent back through both (loss = sum(out * cot), so the gradients are
vector-Jacobian products: torch via autograd, JAX via `jax.vjp`), and measures every output and every gradient
against the one tolerance table below. torch is the reference side of every error figure.

Inputs are a dict `name -> numpy array`, handed to both functions as keyword arguments:

- a floating array is differentiated, and under `vmap` stacked along a new leading axis;
- an integer/bool array is not differentiated, but is stacked under `vmap` like the floats;
- `Const(array)` is neither: the same value for every slice, never differentiated (masks, fixed keys...).

With `params` (a nested dict of numpy arrays, jaxattn's layout) the functions are called as
`jax_fn(params, **inputs)` and `torch_fn(torch_params, **inputs)`; `torch_params` (torch's own layout, default:
the same tree) are the tensors torch differentiates, and `grads_from_torch` maps torch's parameter gradients
back onto the layout of `params` (a weight conversion is a permutation, so gradients convert like weights).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, MutableMapping
from types import MappingProxyType
from typing import Any

import numpy as np

__all__ = [
    "MODEL_TOLERANCES",
    "TOLERANCES",
    "TRANSFORMS",
    "Const",
    "Metric",
    "Report",
    "Tolerance",
    "assert_equivalent",
    "compare",
    "error_metrics",
]

TRANSFORMS = ("plain", "jit", "vmap")


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """Largest normwise relative error ||jax - torch|| / ||torch|| allowed for outputs and for gradients."""

    forward: float
    grad: float


# The bar of the project (docs/design.md, "Tolerances"). float32 assumes JAX runs matmuls at precision="highest", which
# compare() arranges; without it TPUs/GPUs would round matmul inputs to bf16/tf32 and miss 1e-6 by far.
TOLERANCES: Mapping[str, Tolerance] = MappingProxyType(
    {
        "float64": Tolerance(forward=1e-12, grad=1e-12),
        "float32": Tolerance(forward=1e-6, grad=1e-5),
    }
)


# A whole model's bar (many layers, hundreds of tokens; crosscheck.certify's default, the model cases' float32
# rows): docs/design.md, "Tolerances": float32 1e-6 / 1e-5 is the bar of ONE attention call, and across layers
# torch's own float32 result lies ~1e-6 (normwise) from the float64 truth, as does ours. float64 keeps the one-call
# bar.
MODEL_TOLERANCES: Mapping[str, Tolerance] = MappingProxyType(
    {
        "float64": TOLERANCES["float64"],
        "float32": Tolerance(forward=1e-5, grad=1e-4),
    }
)


@dataclasses.dataclass(frozen=True)
class Const:
    """An input that is the same for every vmap slice and is never differentiated (a mask, a fixed key)."""

    value: Any


@dataclasses.dataclass(frozen=True)
class Metric:
    """How far one output or one gradient of JAX lies from torch's."""

    name: str
    kind: str  # "output" or "grad"
    shape: tuple[int, ...]
    max_abs: float
    max_rel: float
    normwise: float
    tolerance: float
    passed: bool
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class Report:
    """Every metric of one comparison, plus the problems that fail it outright (shapes, dtypes, errors)."""

    name: str
    dtype: str
    transform: str
    metrics: tuple[Metric, ...]
    problems: tuple[str, ...] = ()
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return bool(self.metrics) and not self.problems and all(m.passed for m in self.metrics)

    def worst(self, kind: str) -> float:
        """Largest normwise error among the outputs ("output") or the gradients ("grad"); nan if none."""
        values = [m.normwise for m in self.metrics if m.kind == kind]
        if not values:
            return math.nan
        return math.inf if any(math.isnan(v) for v in values) else max(values)

    @property
    def max_abs(self) -> float:
        values = [m.max_abs for m in self.metrics]
        return max(values) if values else math.nan

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.name,
            "dtype": self.dtype,
            "transform": self.transform,
            "passed": self.passed,
            "worst_output": _json_float(self.worst("output")),
            "worst_grad": _json_float(self.worst("grad")),
            "max_abs": _json_float(self.max_abs),
            "seconds": round(self.seconds, 4),
            "problems": list(self.problems),
            "metrics": [{k: _json_float(v) for k, v in m.to_dict().items()} for m in self.metrics],
        }

    def __str__(self) -> str:
        status = "PASS" if self.passed else "FAIL"
        lines = [f"{status} {self.name} [{self.dtype}, {self.transform}]"]
        lines += [f"  problem: {p}" for p in self.problems]
        for m in self.metrics:
            mark = "ok  " if m.passed else "FAIL"
            lines.append(
                f"  {mark} {m.kind:6} {m.name:28} normwise={m.normwise:.3e} (tol {m.tolerance:.0e}) "
                f"max_abs={m.max_abs:.3e} max_rel={m.max_rel:.3e} shape={m.shape}" + (f"  {m.note}" if m.note else "")
            )
        return "\n".join(lines)


def _json_float(value: Any) -> Any:
    # JSON has no nan/inf; strings keep them visible instead of silently turning them into null.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def error_metrics(actual: np.ndarray, expected: np.ndarray, *, norm_floor: float = 0.0) -> tuple[float, float, float]:
    """(max abs, max rel, normwise rel) of `actual` against the reference `expected`, computed in float64.

    max rel is taken over the entries where the reference is non-zero (max abs covers the others); normwise is
    ||actual - expected||_2 / max(||expected||_2, norm_floor), or the absolute ||actual - expected||_2 when
    that denominator is 0. Any non-finite value on either side makes all three nan: a NaN never passes.
    """
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    if a.shape != e.shape:
        raise ValueError(f"error_metrics: shapes differ, actual {a.shape} vs expected {e.shape}")
    if not (np.isfinite(a).all() and np.isfinite(e).all()):
        return math.nan, math.nan, math.nan
    diff = np.abs(a - e)
    max_abs = float(diff.max(initial=0.0))
    nonzero = e != 0
    max_rel = float((diff[nonzero] / np.abs(e[nonzero])).max(initial=0.0))
    ref_norm = float(np.linalg.norm(e.ravel()))
    diff_norm = float(np.linalg.norm(diff.ravel()))
    denominator = max(ref_norm, norm_floor)
    normwise = diff_norm / denominator if denominator > 0 else diff_norm
    return max_abs, max_rel, normwise


def compare(
    jax_fn: Callable[..., Any],
    torch_fn: Callable[..., Any],
    inputs: Mapping[str, Any],
    *,
    dtype: str,
    params: Mapping[str, Any] | None = None,
    torch_params: Mapping[str, Any] | None = None,
    grads_from_torch: Callable[[dict[str, Any]], Any] | None = None,
    grad: bool = True,
    transform: str = "plain",
    vmap_size: int = 3,
    seed: int = 0,
    tolerance: Tolerance | None = None,
    name: str = "",
    reference_cache: MutableMapping[Any, Any] | None = None,
) -> Report:
    """Run `jax_fn` and `torch_fn` on the same inputs in `dtype` and measure outputs and gradients.

    transform: "plain" (eager JAX), "jit" (forward and backward under one `jax.jit`) or "vmap" (`vmap_size`
    inputs stacked along a new leading axis through `jax.vmap`, compiled with `jax.jit`, against torch run
    slice by slice).
    Outputs may be an array, a tuple/list of arrays or a dict of arrays (same structure on both sides).
    float64 needs JAX's x64 mode on (`jax.config.update("jax_enable_x64", True)` or `jax.enable_x64()`):
    without it the request is refused rather than silently compared in float32.
    reference_cache: a dict shared by calls with the SAME torch function, inputs and parameters (the rows of
    one case): torch's results are kept there by the numbers torch is fed (dtype, slices, seed), so the
    "plain" and "jit" rows, which feed torch identical numbers, run the reference once.
    """
    started = time.perf_counter()
    dtype = _checked_dtype(dtype)
    if transform not in TRANSFORMS:
        raise ValueError(f"compare: transform must be one of {TRANSFORMS}, got {transform!r}")
    tolerance = tolerance or TOLERANCES[dtype]
    params = {} if params is None else params
    torch_params = params if torch_params is None else torch_params

    slices = _input_slices(inputs, vmap_size if transform == "vmap" else 1, seed)
    cast = [_cast_inputs(s, dtype) for s in slices]
    consts = {k: _cast(v.value, dtype) for k, v in inputs.items() if isinstance(v, Const)}

    torch_out, torch_grads = _cached_torch(
        reference_cache,
        (dtype, len(slices), grad, seed),
        lambda: _run_torch(torch_fn, cast, consts, torch_params, dtype, grad, seed),
    )
    problems: list[str] = []
    cot = _cotangents(torch_out, seed) if grad else None
    jax_out, jax_grads = _run_jax(jax_fn, cast, consts, params, dtype, transform, cot, problems)

    metrics = _output_metrics(jax_out, torch_out, dtype, tolerance.forward, problems)
    if grad and jax_grads is not None:
        torch_param_grads = torch_grads["params"]
        if grads_from_torch is not None and torch_param_grads:
            torch_param_grads = grads_from_torch(torch_param_grads)
        metrics += _grad_metrics(
            jax_grads, {**torch_grads, "params": torch_param_grads}, dtype, tolerance.grad, problems
        )
    return Report(name, dtype, transform, tuple(metrics), tuple(problems), time.perf_counter() - started)


def assert_equivalent(
    jax_fn: Callable[..., Any], torch_fn: Callable[..., Any], inputs: Mapping[str, Any], **kwargs: Any
) -> Report:
    """`compare(...)`, raising AssertionError with the full report when anything fails."""
    report = compare(jax_fn, torch_fn, inputs, **kwargs)
    if not report.passed:
        raise AssertionError(f"JAX and torch disagree:\n{report}")
    return report


# --- inputs ------------------------------------------------------------------------------------------------


def _checked_dtype(dtype: Any) -> str:
    name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
    if name not in TOLERANCES:
        raise ValueError(f"compare: dtype must be one of {sorted(TOLERANCES)}, got {dtype!r}")
    if name == "float64":
        import jax

        if not jax.config.x64_enabled:
            raise RuntimeError(
                "compare: float64 requested but JAX's x64 mode is off, so JAX would silently compute in "
                "float32; call jax.config.update('jax_enable_x64', True) first (or use jax.enable_x64())"
            )
    return name


def _input_slices(inputs: Mapping[str, Any], count: int, seed: int) -> list[dict[str, np.ndarray]]:
    """`count` sets of the non-Const inputs: the given one, then seeded perturbations of its float arrays."""
    base = {k: np.asarray(v) for k, v in inputs.items() if not isinstance(v, Const)}
    rng = np.random.default_rng(seed + 1)
    slices = [base]
    for _ in range(count - 1):
        slices.append({k: _perturbed(v, rng) for k, v in base.items()})
    return slices


def _perturbed(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if not np.issubdtype(x.dtype, np.floating):
        return x
    return x + rng.standard_normal(x.shape) * (float(np.std(x)) if x.size else 0.0)


def _cast(x: Any, dtype: str) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(dtype) if np.issubdtype(x.dtype, np.floating) else x


def _cast_inputs(inputs: Mapping[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
    return {k: _cast(v, dtype) for k, v in inputs.items()}


def _is_float(x: np.ndarray) -> bool:
    return np.issubdtype(np.asarray(x).dtype, np.floating)


def _named_outputs(out: Any) -> dict[str, Any]:
    if isinstance(out, Mapping):
        return dict(out)
    if isinstance(out, (tuple, list)):
        return {f"output[{i}]": o for i, o in enumerate(out)}
    return {"output": out}


def _cotangents(outputs: Mapping[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 2)
    return {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in outputs.items()}


def _map_tree(fn: Callable[[Any], Any], tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {k: _map_tree(fn, v) for k, v in tree.items()}
    return fn(tree)


def _flatten(tree: Any, prefix: str) -> dict[str, Any]:
    if isinstance(tree, Mapping):
        flat: dict[str, Any] = {}
        for k, v in tree.items():
            flat.update(_flatten(v, f"{prefix}/{k}" if prefix else str(k)))
        return flat
    return {prefix: tree}


# --- the torch side (the reference) -------------------------------------------------------------------------


def _cached_torch(cache: MutableMapping[Any, Any] | None, key: tuple[Any, ...], run: Callable[[], Any]) -> Any:
    """`run()` once per key of `cache` (no cache: every time). Callers only read the results."""
    if cache is None:
        return run()
    if key not in cache:
        cache[key] = run()
    return cache[key]


def _run_torch(torch_fn, slices, consts, torch_params, dtype, grad, seed):
    """Forward (and backward with the cotangents of `_cotangents`) of torch, slice by slice."""
    import torch

    def tensor(x: np.ndarray, requires_grad: bool) -> torch.Tensor:
        t = torch.from_numpy(np.array(x))  # a writable copy: torch must not alias read-only buffers
        return t.requires_grad_(requires_grad and grad and t.is_floating_point())

    tparams = _map_tree(lambda p: tensor(_cast(p, dtype), True), torch_params)
    tconsts = {k: tensor(v, False) for k, v in consts.items()}
    per_slice, leaves = [], []
    for s in slices:
        targs = {k: tensor(v, True) for k, v in s.items()}
        out = _named_outputs(torch_fn(tparams, **targs, **tconsts) if torch_params else torch_fn(**targs, **tconsts))
        for k, o in out.items():
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"torch output {k!r} is a {type(o).__name__}, not a torch.Tensor")
        per_slice.append(out)
        leaves.append(targs)
    outputs = {k: np.stack([o[k].detach().numpy() for o in per_slice]) for k in per_slice[0]}
    if len(slices) == 1:
        outputs = {k: v[0] for k, v in outputs.items()}
    if not grad:
        return outputs, None

    cot = _cotangents(outputs, seed)
    cot_slices = [cot] if len(slices) == 1 else [{k: v[i] for k, v in cot.items()} for i in range(len(slices))]
    loss = sum((o * torch.from_numpy(c[k])).sum() for o, c in zip(per_slice, cot_slices) for k, o in o.items())
    flat_params = _flatten(tparams, "")
    wrt = [t for ts in leaves for t in ts.values() if t.requires_grad] + list(flat_params.values())
    got = iter(torch.autograd.grad(loss, wrt, allow_unused=True) if wrt else [])

    def take(t: torch.Tensor) -> np.ndarray:
        g = next(got)
        return np.zeros(t.shape, dtype) if g is None else g.detach().numpy()

    input_grads = [{k: take(t) for k, t in ts.items() if t.requires_grad} for ts in leaves]
    param_grads = {path: take(t) for path, t in flat_params.items()}
    grads = {k: np.stack([g[k] for g in input_grads]) for k in input_grads[0]}
    if len(slices) == 1:
        grads = {k: v[0] for k, v in grads.items()}
    grads["params"] = _unflatten(param_grads)
    return outputs, grads


def _unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


# --- the JAX side -------------------------------------------------------------------------------------------


def _run_jax(jax_fn, slices, consts, params, dtype, transform, cot, problems):
    import jax
    import jax.numpy as jnp

    batched = len(slices) > 1
    data = {k: np.stack([s[k] for s in slices]) if batched else slices[0][k] for k in slices[0]}
    diff = {k: jnp.asarray(v) for k, v in data.items() if _is_float(v)}
    aux = {k: jnp.asarray(v) for k, v in data.items() if not _is_float(v)}
    jconsts = {k: jnp.asarray(v) for k, v in consts.items()}
    jparams = _map_tree(lambda p: jnp.asarray(_cast(p, dtype)), params)

    def call(d, p, a, c):
        return _named_outputs(jax_fn(p, **d, **a, **c) if params else jax_fn(**d, **a, **c))

    forward = jax.vmap(call, in_axes=(0, None, 0, None)) if batched else call

    def forward_backward(d, p, a, c, ct):
        out, pull = jax.vjp(lambda d_, p_: forward(d_, p_, a, c), d, p)
        grad_d, grad_p = pull(ct)
        return out, {**grad_d, "params": grad_p}

    with jax.default_matmul_precision("highest"):
        if cot is None:
            fn = forward if transform == "plain" else jax.jit(forward)
            out, grads = fn(diff, jparams, aux, jconsts), None
        elif transform == "plain":
            out, grads = _eager_vjp(forward, (diff, jparams, aux, jconsts), cot, problems)
        else:
            # vmap runs compiled too: one compile instead of an eager batched op-by-op pass (same numbers)
            out, grads = _compiled_vjp(forward, forward_backward, (diff, jparams, aux, jconsts), cot, problems)
    out = {k: np.asarray(v) for k, v in out.items()}
    grads = None if grads is None else jax.tree_util.tree_map(np.asarray, grads)
    return out, grads


def _eager_vjp(forward, args, cot, problems):
    """Forward and pullback op by op (no jit anywhere): the outputs of the forward decide the cotangent."""
    import jax
    import jax.numpy as jnp

    diff, params, aux, consts = args
    out, pull = jax.vjp(lambda d, p: forward(d, p, aux, consts), diff, params)
    mismatch = _structure_problem(out, cot)
    if mismatch:
        problems.append(mismatch)
        return out, None
    # the cotangent takes each output's own dtype, so a wrong output dtype is reported, not raised
    grad_d, grad_p = pull({k: jnp.asarray(v, dtype=out[k].dtype) for k, v in cot.items()})
    return out, {**grad_d, "params": grad_p}


def _compiled_vjp(forward, forward_backward, args, cot, problems):
    """jit(forward_backward), traced once when JAX's outputs match torch's in names, shapes and dtypes (every
    passing row): the cotangent then has torch's dtypes, which are JAX's. Otherwise the pullback refuses that
    cotangent while tracing, and the outputs' abstract values are worked out first to say what differs."""
    import jax
    import jax.numpy as jnp

    fn = jax.jit(forward_backward)
    try:
        return fn(*args, {k: jnp.asarray(v) for k, v in cot.items()})
    except (TypeError, ValueError):
        pass  # a mismatch, or an error of jax_fn itself: the path below reports the one, re-raises the other
    shapes = jax.eval_shape(forward, *args)
    mismatch = _structure_problem(shapes, cot)
    if mismatch:
        problems.append(mismatch)
        return jax.jit(forward)(*args), None
    # the cotangent takes each output's own dtype, so a wrong output dtype is reported, not raised
    return fn(*args, {k: jnp.asarray(v, dtype=shapes[k].dtype) for k, v in cot.items()})


def _structure_problem(shapes: Mapping[str, Any], cot: Mapping[str, np.ndarray]) -> str:
    if set(shapes) != set(cot):
        return f"outputs differ: JAX gives {sorted(shapes)}, torch gives {sorted(cot)}"
    bad = [
        f"{k}: JAX {tuple(shapes[k].shape)} vs torch {cot[k].shape}"
        for k in shapes
        if tuple(shapes[k].shape) != cot[k].shape
    ]
    return "output shapes differ: " + "; ".join(bad) if bad else ""


# --- measuring ----------------------------------------------------------------------------------------------


def _metric(name, kind, actual, expected, dtype, tol, norm_floor=0.0) -> Metric:
    notes = []
    if actual.shape != expected.shape:
        return Metric(
            name,
            kind,
            tuple(expected.shape),
            math.nan,
            math.nan,
            math.nan,
            tol,
            False,
            f"shape: JAX {actual.shape} vs torch {expected.shape}",
        )
    for side, x in (("JAX", actual), ("torch", expected)):
        if x.dtype != np.dtype(dtype):
            notes.append(f"{side} dtype {x.dtype} != requested {dtype}")
    max_abs, max_rel, normwise = error_metrics(actual, expected, norm_floor=norm_floor)
    if math.isnan(normwise):
        notes.append("non-finite values (NaN/inf)")
    elif kind == "output" and not np.any(expected):
        notes.append("torch's output is all zeros: a vacuous comparison")  # gradients may be zero, outputs not
    passed = not notes and normwise <= tol
    if np.linalg.norm(np.asarray(expected, np.float64).ravel()) < norm_floor:
        notes.append(f"reference below its kind's RMS scale: measured against that scale ({norm_floor:.2e})")
    return Metric(name, kind, tuple(expected.shape), max_abs, max_rel, normwise, tol, passed, "; ".join(notes))


def _norm_floors(reference: Mapping[str, np.ndarray]) -> dict[str, float]:
    """Per array, the norm it would have at the RMS scale of all arrays of its kind together.

    A gradient that is zero in exact arithmetic (the key projection's bias: softmax ignores a shift shared
    by a whole row of logits) comes out as rounding noise on both sides, and noise against noise is a
    relative error near 1. Measured against the scale of the computation it is what it is: rounding.
    A real error in a small array still fails unless it is itself below tolerance x that scale.
    """
    arrays = {k: np.asarray(v, np.float64).ravel() for k, v in reference.items()}
    size = sum(a.size for a in arrays.values())
    if not size or not all(np.isfinite(a).all() for a in arrays.values()):
        return {k: 0.0 for k in arrays}
    mean_square = sum(float(a @ a) for a in arrays.values()) / size
    return {k: math.sqrt(mean_square * a.size) for k, a in arrays.items()}


def _output_metrics(jax_out, torch_out, dtype, tol, problems) -> list[Metric]:
    if set(jax_out) != set(torch_out):
        problems.append(f"outputs differ: JAX gives {sorted(jax_out)}, torch gives {sorted(torch_out)}")
        return []
    floors = _norm_floors(torch_out)
    return [_metric(k, "output", jax_out[k], torch_out[k], dtype, tol, floors[k]) for k in torch_out]


def _grad_metrics(jax_grads, torch_grads, dtype, tol, problems) -> list[Metric]:
    jflat, tflat = _flatten(jax_grads, ""), _flatten(torch_grads, "")
    if set(jflat) != set(tflat):
        problems.append(f"gradients differ in names: JAX {sorted(jflat)} vs torch {sorted(tflat)}")
        return []
    floors = _norm_floors(tflat)
    return [_metric(k, "grad", np.asarray(jflat[k]), np.asarray(tflat[k]), dtype, tol, floors[k]) for k in tflat]
