"""`certify`: any PyTorch model against any JAX port of it, output by output and layer by layer.

    cert = certify(torch_fn, jax_fn, {"input_ids": ids}, dtype="float32", layers={"model.layers.0.mlp": "l0.mlp"})
    cert.passed; cert.first_divergent; cert.rows; cert.to_json(); cert.plot("drift.png"); print(cert.table())

Both callables get the same inputs as keyword arguments (torch tensors / JAX arrays; floating inputs cast to
`dtype`). Each returns an array, a tuple / list / dict of arrays (nested: "hidden_states[2]"), or an object
with `.logits` (transformers' outputs: only the logits are taken). Both must give the same names and shapes.

Rows, each measured against torch (the reference), in this order:
- "layer": `layers` pairs (torch module path -> JAX intermediate name), in the order torch's forward hooks
  fire. A module returning a tuple gives its first array, or element i with the path "<path>[i]". JAX's
  intermediates come from a jax_fn returning `(outputs, {name: array})`, that dict possibly nested (Flax
  `capture_intermediates` / `sow` / nnx `Intermediate` state: names joined with "/", a one-element tuple
  taken as its element, "intermediates" unwrapped).
- "output": every output.
- "kl", "top1", "top5": for the logits output (`logits=` names it; default "logits" when there is one):
  per-token KL(torch's softmax || JAX's), its largest value against a bar; the share of tokens whose top-1
  token agrees, and the mean share of the top-5 sets that agree, each against a bar.
- "grad": with `grads=True`, gradients of a scalar loss with respect to the floating inputs; when every input
  is an integer (token ids) and no `params=` map is given, with respect to the first `layers` pair's output
  ("grad/<torch path>": torch's from its forward hook, JAX's by perturbing that intermediate in jax_fn's
  jaxpr, crosscheck/_certificates/activation_grad.py); with no `layers` either, with respect to the first
  floating activation, found on each side: torch's first module output (forward hooks, in firing order) that
  is floating and depends on a parameter (the embeddings), JAX's value that equals it, made from the token
  ids in jax_fn's jaxpr (activation_grad.first_floating_program); `activation` (and `notes`) names both.
- "param_grad": with `grads=True` and `params=`, the loss's gradient with respect to each mapped torch
  parameter (the row's name) against the JAX leaf it maps to (jax_fn then takes `jax_params` first).

A certificate counts its rows per kind (`counts`); a kind it was asked for (`requested`) with no row fails
it. A failing row where a side gave another dtype than the certificate's says so in its status; `notes`
names every such row and floating `jax_params` leaves of another dtype (bfloat16 weights).

Bars: outputs and layers take crosscheck's whole-model tolerances, normwise (MODEL_TOLERANCES[dtype].forward:
float64 1e-12, float32 1e-5), or the `bar` given, or with `calibrate=` (float32) bars from torch's own
float64 run, row by row (calibrated_bar); gradients MODEL_TOLERANCES[dtype].grad; logits LOGIT_BARS[dtype].
A row non-finite on one side is its own status ("non-finite in JAX only"), never folded into a number; it
fails.

Memory: JAX runs first and keeps its intermediates; each torch layer is compared inside its forward hook
and dropped, so only one model's activations are held.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from crosscheck._certificates.activation_grad import first_floating_program, perturbed_program
from crosscheck._certificates.golden import load_golden
from crosscheck._certificates.param_grads import ParamPair, param_pairs
from crosscheck._certificates.reference import (
    FIRST_FLOATING,
    activation_pair,
    cast_inputs,
    checked_dtype,
    cotangents,
    flat_intermediates,
    layer_pairs,
    loss_value,
    named_outputs,
    nearest,
    need_torch,
    run_torch,
    versions,
)
from crosscheck._comparison.compare import MODEL_TOLERANCES, error_metrics

__all__ = ["LOGIT_BARS", "Bar", "Certificate", "LogitBars", "Row", "certify", "versions"]


@dataclasses.dataclass(frozen=True)
class Bar:
    """The bar of an output / layer row: `metric` ("normwise" or "max_abs") <= value, times max(1, max |ref|)
    when `scaled` (float32 rounding grows with the magnitude of what is rounded)."""

    metric: str
    value: float
    scaled: bool = False

    def at(self, scale: float) -> float:
        return self.value * max(1.0, scale) if self.scaled else self.value


@dataclasses.dataclass(frozen=True)
class LogitBars:
    """Largest per-token KL divergence allowed, smallest top-1 / top-5 agreement allowed."""

    kl: float
    top1: float
    top5: float


# float64: KL ~ (logit error)^2 / 2; clean runs land near 4e-29 (521 tokens), the bar leaves room for 1e-12
# logit errors. float32: set from clean runs (benchmarks/certify_margins.py, docs/certify.md): the largest
# per-token KL over tiny random GPT-2, Qwen2, Qwen3 and Llama checkpoints on 521 real tokens was 4.9e-11;
# the bar sits 100x above it and 400x below the mildest planted fault (norm epsilon 1e-5 for 1e-6: 2.0e-6).
# Agreement: no clean run flipped a top-1 token or a top-5 set; float32 allows a top-5 near tie to swap.
LOGIT_BARS: Mapping[str, LogitBars] = MappingProxyType(
    {
        "float64": LogitBars(kl=1e-24, top1=1.0, top5=1.0),
        "float32": LogitBars(kl=5e-9, top1=1.0, top5=0.99),
    }
)


@dataclasses.dataclass(frozen=True)
class Row:
    """One compared quantity. `value` is what meets `bar`: an error (<=) or, for top1/top5, an agreement (>=)."""

    name: str  # torch module path (layers), output name, "logits.kl", "grad/x", torch parameter name
    kind: str  # "layer" | "output" | "kl" | "top1" | "top5" | "grad" | "param_grad"
    shape: tuple[int, ...]
    max_abs: float
    normwise: float
    scale: float  # the reference's largest |value|
    metric: str  # "normwise" | "max_abs" | "kl" | "agreement"
    value: float
    bar: float
    status: str  # "ok", "FAIL", "non-finite in JAX only", "torch module never ran", ...
    jax_name: str = ""
    jax_dtype: str = ""  # the dtype JAX gave it (a port computing in float32 under a float64 certificate)

    @property
    def passed(self) -> bool:
        return self.status == "ok"

    @property
    def ratio(self) -> float:
        """How far along its bar the row is (1 = at the bar); for agreement, the disagreement against its own."""
        if self.metric == "agreement":
            return (1.0 - self.value) / max(1.0 - self.bar, 1e-12)
        return self.value / self.bar if self.bar > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            **{k: _json_float(v) for k, v in dataclasses.asdict(self).items()},
            "shape": list(self.shape),
            "passed": self.passed,
        }


class Verdict:
    """A report's verdict from its rows (each with .name and .passed), in forward order: a Certificate's and
    layer_report's LayerReport."""

    rows: Sequence[Any]

    @property
    def passed(self) -> bool:
        return bool(self.rows) and all(r.passed for r in self.rows)

    @property
    def first_divergent(self) -> str | None:
        """The first row (forward order: layers, outputs, logits, gradients) over its bar; None if none."""
        return next((r.name for r in self.rows if not r.passed), None)


KINDS = ("layer", "output", "kl", "top1", "top5", "grad", "param_grad")


@dataclasses.dataclass(frozen=True)
class Certificate(Verdict):
    dtype: str
    rows: tuple[Row, ...]
    inputs: Mapping[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype)
    versions: Mapping[str, str | None]
    golden: str | None = None
    requested: tuple[str, ...] = ()  # the row kinds asked for ("layer" with layers=, "grad" with grads=True, ...)
    dtype_notes: tuple[str, ...] = ()  # arrays of another dtype than the certificate's (jax_params leaves, ...)
    calibration: str | None = None  # how the bars were calibrated (certify(calibrate=True)); None: the fixed ones
    activation: str | None = None  # where a token-input gradient certificate found its activation (see certify)

    @property
    def counts(self) -> dict[str, int]:
        """{kind: how many rows of it were compared}, for every kind requested or present."""
        kinds = [k for k in KINDS if k in self.requested or any(r.kind == k for r in self.rows)]
        return {k: sum(r.kind == k for r in self.rows) for k in kinds}

    @property
    def missing(self) -> tuple[str, ...]:
        """Kinds requested with no row compared: a check that compared nothing, which never reads as a pass."""
        return tuple(k for k in self.requested if not any(r.kind == k for r in self.rows))

    @property
    def passed(self) -> bool:
        return super().passed and not self.missing

    @property
    def first_divergent(self) -> str | None:
        found = super().first_divergent
        if found is None and self.missing:
            return f"(no {self.missing[0]} rows)"
        return found

    @property
    def notes(self) -> tuple[str, ...]:
        """What the summary says besides the rows: missing kinds, and every dtype that is not the certificate's
        (rows JAX gave in another dtype, the port's parameters)."""
        notes = [f"no {k} rows were compared, though {k} rows were requested: this fails" for k in self.missing]
        other = [r for r in self.rows if r.jax_dtype and r.jax_dtype != self.dtype]
        if other:
            kinds = sorted({r.jax_dtype for r in other})
            notes.append(
                f"dtype: JAX gave {len(other)} of {len(self.rows)} rows in {'/'.join(kinds)} under a {self.dtype} "
                f"certificate (first: {other[0].name!r}, {other[0].jax_dtype}): the port computes in another "
                "dtype than the one certified"
            )
        return (*notes, *self.dtype_notes, *([self.activation] if self.activation else []))

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "first_divergent": self.first_divergent,
            "counts": self.counts,
            "requested": list(self.requested),
            "notes": list(self.notes),
            "calibration": self.calibration,
            "activation": self.activation,
            "dtype": self.dtype,
            "versions": dict(self.versions),
            "golden": self.golden,
            "inputs": {k: {"shape": list(s), "dtype": d} for k, (s, d) in self.inputs.items()},
            "tolerances": {
                "outputs": {k: dataclasses.asdict(v) for k, v in MODEL_TOLERANCES.items()},
                "logits": {k: dataclasses.asdict(v) for k, v in LOGIT_BARS.items()},
            },
            "rows": [r.to_dict() for r in self.rows],
        }

    def table(self) -> str:
        lines = [
            f"certificate [{self.dtype}]: {'PASS' if self.passed else 'FAIL'}"
            + (f" (golden file {self.golden})" if self.golden else ""),
            f"  {'row':36} {'JAX':24} {'kind':10} {'max abs':>10} {'normwise':>10} {'value':>10} {'bar':>9}  status",
        ]
        lines += [
            f"  {r.name:36} {r.jax_name:24} {r.kind:10} {r.max_abs:10.2e} {r.normwise:10.2e} {r.value:10.3e} "
            f"{r.bar:9.1e}  {r.status}"
            for r in self.rows
        ]
        lines.append(f"  first divergent: {self.first_divergent}" if not self.passed else "  every row passes")
        lines.append("  rows compared: " + ", ".join(f"{k} {n}" for k, n in self.counts.items()))
        lines += [f"  note: {note}" for note in self.notes]
        lines += [f"  bars calibrated: {self.calibration}"] if self.calibration else []
        return "\n".join(lines)

    __str__ = table

    def __rich__(self):
        from rich.table import Table

        table = Table(title=f"certificate [{self.dtype}]: {'PASS' if self.passed else 'FAIL'}")
        for column in ("row", "JAX", "kind", "max abs", "normwise", "value", "bar", "status"):
            table.add_column(column, justify="left" if column in ("row", "JAX", "kind", "status") else "right")
        for r in self.rows:
            table.add_row(
                r.name,
                r.jax_name,
                r.kind,
                f"{r.max_abs:.2e}",
                f"{r.normwise:.2e}",
                f"{r.value:.3e}",
                f"{r.bar:.1e}",
                r.status if r.passed else f"[bold red]{r.status}[/]",
            )
        return table

    def plot(self, path: str) -> None:
        """Each row's error divided by its bar against forward order (log scale; 1 = the bar)."""
        plot_series([(self.dtype, self.rows)], path, title="torch vs JAX, per row")


def plot_series(
    series: Sequence[tuple[str, Sequence[Any]]], path: str, *, title: str, ylabel: str = "error / bar"
) -> None:
    """One line per (label, rows); a row has .name and .ratio. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from None
    names = [r.name for r in series[0][1]]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(names)), 4.0))
    for label, rows in series:
        ratio = [min(max(r.ratio, 1e-8), 1e8) if not math.isnan(r.ratio) else 1e8 for r in rows]
        ax.plot(range(len(ratio)), ratio, marker="o", label=label)
    ax.axhline(1.0, color="red", linestyle="--", label="bar")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _json_float(value: Any) -> Any:
    # JSON has no nan/inf; strings keep them visible instead of silently turning them into null.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value


# --- structure --------------------------------------------------------------------------------------------


# --- the torch side (the reference) ------------------------------------------------------------------------


# --- the JAX side ------------------------------------------------------------------------------------------


def run_jax(jax_fn, inputs: Mapping[str, np.ndarray], jax_params=None):
    """jax_fn's raw result at matmul precision "highest" (outputs, or (outputs, intermediates))."""
    import jax
    import jax.numpy as jnp

    with jax.default_matmul_precision("highest"):
        return call_jax(jax_fn, jax_params, {k: jnp.asarray(v) for k, v in inputs.items()})


def call_jax(jax_fn, jax_params, inputs: Mapping[str, Any]):
    """jax_fn(**inputs), or jax_fn(jax_params, **inputs) when the port's parameters are given."""
    return jax_fn(**inputs) if jax_params is None else jax_fn(jax_params, **inputs)


def split_jax(raw, want_layers: bool, torch_names=None):
    """({output: numpy}, {intermediate: numpy}): a result `(outputs, {name: array})` is split when layers are
    asked for, or when its outputs alone (not the pair) have torch's output names."""
    out, inter = raw, {}
    if isinstance(raw, tuple) and len(raw) == 2 and isinstance(raw[1], Mapping):
        whole = set(named_outputs(raw))
        if want_layers or (
            torch_names is not None and whole != set(torch_names) and set(named_outputs(raw[0])) == set(torch_names)
        ):
            out, inter = raw
    return (
        {k: np.asarray(v) for k, v in named_outputs(out).items()},
        {k: np.asarray(v) for k, v in flat_intermediates(inter).items()},
    )


def _split(out, want_layers: bool):
    if want_layers and isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Mapping):
        return out[0], out[1]
    return out, {}


def jax_grads(
    jax_fn,
    inputs: Mapping[str, np.ndarray],
    reference: Mapping[str, np.ndarray],
    *,
    loss,
    logits,
    split: bool,
    jax_params=None,
    activation: str | None = None,
    like: np.ndarray | None = None,
    bar: Bar | None = None,
) -> tuple[dict[str, np.ndarray], Any, np.ndarray | None, str]:
    """({input: d loss / d input} for the floating inputs, d loss / d jax_params (a tree; None without them),
    d loss / d the intermediate named `activation` (None without one), what that intermediate is).

    activation=FIRST_FLOATING: the first value the program makes from its integer inputs that equals `like`
    (torch's first floating activation) within `bar` (activation_grad.first_floating_program); when none
    does, its gradient is None and the description says why."""
    import jax
    import jax.numpy as jnp

    floats = {k: jnp.asarray(v) for k, v in inputs.items() if np.issubdtype(v.dtype, np.floating)}
    others = {k: jnp.asarray(v) for k, v in inputs.items() if k not in floats}

    def outputs_and_activation(p, arrays):
        out, inter = _split(call_jax(jax_fn, p, arrays), split)
        named = activation not in (None, FIRST_FLOATING)
        return named_outputs(out), [flat_intermediates(inter)[activation]] if named else []

    described = "" if activation in (None, FIRST_FLOATING) else activation
    if activation is None:
        zero = None

        def outputs(delta, p, arrays):
            return outputs_and_activation(p, arrays)[0]
    elif activation == FIRST_FLOATING:
        if like is None or bar is None:
            raise TypeError("jax_grads: activation=FIRST_FLOATING needs torch's activation (like=) and bar=")
        limit = bar.at(float(np.abs(like).max(initial=0.0)))

        def distance(value):
            max_abs, _, normwise = error_metrics(value, like)
            return max_abs if bar.metric == "max_abs" else normwise

        try:
            with jax.default_matmul_precision("highest"):
                outputs, aval, described = first_floating_program(
                    lambda p, arrays: outputs_and_activation(p, arrays)[0],
                    jax_params,
                    {**floats, **others},
                    like,
                    distance,
                    limit,
                )
        except ValueError as error:
            return {}, None, None, f"no JAX value to compare it with: {error}"
        zero = jnp.zeros(aval.shape, aval.dtype)
    else:
        try:
            outputs, aval = perturbed_program(outputs_and_activation, (jax_params, {**floats, **others}), 0)
        except ValueError as error:
            raise ValueError(f"grads: the JAX intermediate {activation!r} cannot be differentiated: {error}") from None
        zero = jnp.zeros(aval.shape, aval.dtype)

    def scalar(delta, f, p, o, cots):
        return loss_value(jnp, outputs(delta, p, {**f, **o}), {**f, **o}, reference, loss, logits, cots)

    if not floats and jax_params is None and activation is None:
        return {}, None, None, described
    # one compile of the whole backward pass (op by op, every loss operation and each piece of a jitted
    # jax_fn's transpose compiles on its own); the cotangents are arguments, not constants baked into it
    labelled = loss is None and logits is not None and logits in reference and "labels" in inputs
    cots = {} if loss is not None or labelled else {k: jnp.asarray(v) for k, v in cotangents(reference).items()}
    with jax.default_matmul_precision("highest"):
        at, got, params = jax.jit(jax.grad(scalar, argnums=(0, 1, 2)))(zero, floats, jax_params, others, cots)
    return {k: np.asarray(v) for k, v in got.items()}, params, None if at is None else np.asarray(at), described


# --- measuring ---------------------------------------------------------------------------------------------


def measure(
    name: str, kind: str, ours: np.ndarray, theirs: np.ndarray, bar: Bar, jax_name: str = "", dtype: str = ""
) -> Row:
    """One row: JAX's `ours` against torch's `theirs` (same shape: checked by the caller). `dtype`: the
    certificate's; a failing row where either side has another floating dtype says so in its status."""
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    jax_dtype = ours.dtype.name if _floating(ours.dtype) else ""
    bad_jax, bad_torch = not np.isfinite(ours).all(), not np.isfinite(theirs).all()
    scale = float(np.abs(np.where(np.isfinite(theirs), theirs, 0)).max(initial=0.0))
    max_abs, _, normwise = error_metrics(ours, theirs)
    value = max_abs if bar.metric == "max_abs" else normwise
    limit = bar.at(scale)
    if bad_jax or bad_torch:
        status = (
            "non-finite on both sides"
            if bad_jax and bad_torch
            else "non-finite in JAX only"
            if bad_jax
            else "non-finite in torch only"
        )
    else:
        status = "ok" if value <= limit else "FAIL"
    if status != "ok" and dtype:
        sides = [(side, a.dtype.name) for side, a in (("JAX", ours), ("torch", theirs)) if _floating(a.dtype)]
        other = [f"{side} gives {name_}" for side, name_ in sides if name_ != dtype]
        if other:
            status += f" ({', '.join(other)} under a {dtype} certificate)"
    return Row(
        name, kind, tuple(theirs.shape), max_abs, normwise, scale, bar.metric, value, limit, status, jax_name, jax_dtype
    )


def _floating(dtype: np.dtype) -> bool:
    """numpy's floating dtypes and ml_dtypes' (bfloat16 is not a subtype of np.floating)."""
    import jax.numpy as jnp

    return bool(jnp.issubdtype(dtype, jnp.floating))


def logit_rows(name: str, ours: np.ndarray, theirs: np.ndarray, bars: LogitBars) -> list[Row]:
    """Per-token KL(torch || JAX) (largest), top-1 agreement (share of tokens), top-5 overlap (mean share)."""
    a = np.asarray(theirs, np.float64).reshape(-1, theirs.shape[-1])
    b = np.asarray(ours, np.float64).reshape(-1, ours.shape[-1])
    shape = tuple(theirs.shape[:-1])
    if not (np.isfinite(a).all() and np.isfinite(b).all()) or not a.size:
        status = "non-finite logits" if a.size else "no tokens"
        return [
            Row(f"{name}.{k}", k, shape, math.nan, math.nan, math.nan, m, math.nan, bar, status)
            for k, m, bar in (("kl", "kl", bars.kl), ("top1", "agreement", bars.top1), ("top5", "agreement", bars.top5))
        ]
    kl = float(np.max(kl_divergence(a, b)))
    top1 = float(np.mean(a.argmax(-1) == b.argmax(-1)))
    k = min(5, a.shape[-1])
    top_a, top_b = np.argpartition(-a, k - 1, axis=-1)[:, :k], np.argpartition(-b, k - 1, axis=-1)[:, :k]
    top5 = float(np.mean([len(set(x) & set(y)) / k for x, y in zip(top_a, top_b, strict=True)]))
    nan = math.nan
    return [
        Row(f"{name}.kl", "kl", shape, nan, nan, nan, "kl", kl, bars.kl, "ok" if kl <= bars.kl else "FAIL"),
        Row(
            f"{name}.top1",
            "top1",
            shape,
            nan,
            nan,
            nan,
            "agreement",
            top1,
            bars.top1,
            "ok" if top1 >= bars.top1 else "FAIL",
        ),
        Row(
            f"{name}.top5",
            "top5",
            shape,
            nan,
            nan,
            nan,
            "agreement",
            top5,
            bars.top5,
            "ok" if top5 >= bars.top5 else "FAIL",
        ),
    ]


def kl_divergence(theirs: np.ndarray, ours: np.ndarray) -> np.ndarray:
    """Per row KL(softmax(theirs) || softmax(ours)) = sum p (d - 1 + e^-d), d = log p - log q: the same sum as
    sum p d (sum p e^-d = sum q = 1), but of non-negative terms ~ d^2 / 2, so a float64 KL near 1e-30 is
    resolved instead of drowning in the 1e-16 rounding of sum p d."""
    log_p, log_q = _log_softmax(theirs), _log_softmax(ours)
    d = log_p - log_q
    small = np.abs(d) < 1e-3
    series = d * d / 2 - d**3 / 6 + d**4 / 24  # d + expm1(-d) cancels for small d; its Taylor series does not
    terms = np.where(small, series, d + np.expm1(-np.where(small, 0.0, d)))
    return np.sum(np.exp(log_p) * terms, axis=-1)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def check_structure(ours: Mapping[str, np.ndarray], theirs: Mapping[str, np.ndarray], what: str) -> None:
    if set(ours) != set(theirs):
        raise ValueError(f"{what}: JAX gives {sorted(ours)}, torch gives {sorted(theirs)}")
    for k in theirs:
        if ours[k].shape != theirs[k].shape:
            raise ValueError(f"{what} {k!r}: torch shape {tuple(theirs[k].shape)} vs JAX shape {tuple(ours[k].shape)}")


# --- certify -----------------------------------------------------------------------------------------------


def certify(
    torch_fn,
    jax_fn,
    inputs: Mapping[str, Any] | None,
    *,
    dtype: str = "float32",
    layers=None,
    logits: str | None = None,
    grads: bool = False,
    golden=None,
    loss=None,
    bar: Bar | None = None,
    select: Callable[[str, np.ndarray], np.ndarray] | None = None,
    torch_module=None,
    checkpoint_hash: str | None = None,
    params: Mapping[str, Any] | None = None,
    jax_params=None,
    calibrate: bool | Callable[..., Any] = False,
) -> Certificate:
    """Certify `jax_fn` against `torch_fn` on `inputs` ({name: numpy array}); see the module docstring.

    torch_fn: a torch.nn.Module (cast to `dtype` and put in eval mode, in place) or any callable; None with
    `golden=` (a file from crosscheck.record: torch is then never imported).
    layers: {torch module path: JAX intermediate name}, {path: (name, transform)} with
    `transform(torch_array) -> JAX's layout`, or a sequence of (path, name[, transform]) where a repeated path
    means the module's next call. With golden= and no `layers`: the pairs the file was recorded for.
    torch_module: the module the paths are resolved in when torch_fn is a plain callable (cast too).
    logits: the output holding logits (default "logits" when present; False: none).
    loss(outputs, inputs) -> scalar, for grads=True: called with torch tensors and with JAX arrays (write it
    with operations both have).
    bar: the bar of output and layer rows (default: normwise MODEL_TOLERANCES[dtype].forward).
    select(jax_name, array) -> the entries to compare (e.g. real tokens), applied to both sides of output,
    layer and logit rows.
    checkpoint_hash: with golden=, refuse a file recorded from another checkpoint (or pass the torch module
    as torch_fn).
    jax_params: the port's parameters; jax_fn is then called `jax_fn(jax_params, **inputs)` (e.g.
    `lambda p, input_ids: model.apply({"params": p}, input_ids)`), so that they can be differentiated.
    params: with grads=True, {torch parameter name: JAX path "a/b/kernel", pull(grads tree) -> array, or
    (either, transform(torch grad) -> JAX's layout)}: one row per pair, named by the torch parameter, comparing
    d loss / d parameter (crosscheck/_certificates/param_grads.py; parameter_map(torch_model, tree) for our families).
    calibrate: with dtype="float32", each output and layer row's bar is set from a second reference run:
    torch in float64 on the same (float32) inputs and weights, CALIBRATION_FACTOR times torch's own float32
    error at that row, and never under CALIBRATION_FLOOR (see calibrated_bar). A bar that scales with the
    model: deep models get the room their rounding needs, and a fault under the fixed 1e-5 bar (a norm
    epsilon at unit scale) still shows. Needs a live torch_fn (not golden=). calibrate=torch_fn64, a callable
    like torch_fn: the float64 reference run is torch_fn64(**inputs) instead (a second reference, e.g. a
    transformers model under crosscheck's float64_reference, whose float32-only steps then run in float64).
    """
    dtype = checked_dtype(dtype)
    weights = param_pairs(params)
    if weights and not grads:
        raise ValueError("params: parameter gradients are compared with grads=True only")
    if weights and jax_params is None:
        raise ValueError(
            "params: needs jax_params=, the JAX tree the gradients are taken with respect to "
            "(jax_fn is then called jax_fn(jax_params, **inputs))"
        )
    if calibrate and (dtype != "float32" or golden is not None or bar is not None or select is not None):
        raise ValueError(
            "calibrate: sets the float32 bars of a live torch run from the same run in float64; expected "
            f'dtype="float32" and no golden=, bar= or select=, got dtype={dtype!r}, golden={golden!r}, '
            f"bar={bar!r}, select={select!r}"
        )
    bar = bar or Bar("normwise", MODEL_TOLERANCES[dtype].forward)
    pairs = layer_pairs(layers)
    select = select or (lambda name, array: array)
    reference = None
    if golden is not None:
        reference = load_golden(
            golden,
            inputs,
            dtype=dtype,
            torch_fn=torch_fn,
            checkpoint_hash=checkpoint_hash,
            grads=grads,
            params=[name for name, *_ in weights],
        )
        inputs = reference.inputs
        if layers is None:  # the pairs the file was recorded for (their transforms, if any, are not stored)
            pairs = [(path, name, None) for path, name in reference.meta.get("pairs", [])]
    elif torch_fn is None:
        raise ValueError("torch_fn: None needs golden=PATH (a file written by crosscheck.record)")
    else:
        need_torch("certify(torch_fn, ...)")
    if inputs is None:
        raise ValueError("inputs: expected {name: array}, got None")
    inputs = cast_inputs(inputs, dtype)
    # float64 arrays of torch's own run on the same numbers, when calibrating: {row label: array}
    exact = (
        reference_in_float64(
            torch_fn if calibrate is True else calibrate,
            inputs,
            pairs,
            torch_module if torch_module is not None else torch_fn,
        )
        if calibrate
        else {}
    )
    first = activation_pair(inputs, pairs, [name for name, *_ in weights]) if grads else None
    if first == FIRST_FLOATING and reference is not None and not reference.activations:
        raise ValueError(
            f"golden: {reference.path} holds no first floating activation, whose gradient grads=True compares when "
            "every input is an integer and no layers= or params= is given (record(..., grads=True) without layers=)"
        )
    if first not in (None, FIRST_FLOATING) and reference is not None and first[0] not in reference.activation_grads:
        raise ValueError(
            f"golden: {reference.path} holds no gradient for the output of {first[0]!r}, which grads=True compares "
            "when every input is an integer (record(..., grads=True, layers=...) with the same first layer)"
        )
    raw = run_jax(jax_fn, inputs, jax_params)
    ours, inter = split_jax(raw, bool(pairs))
    missing = [name for _, name, _ in pairs if name not in inter]
    if missing:
        raise nearest(missing[0], list(inter), "JAX intermediate")

    layer_rows: list[Row] = []
    seen: dict[str, int] = {}

    def on_layer(index: int, path: str, name: str, array: np.ndarray | None) -> None:
        seen[path] = seen.get(path, 0) + 1
        label = path if seen[path] == 1 else f"{path} (call {seen[path]})"
        if array is None:
            nan = math.nan
            layer_rows.append(
                Row(label, "layer", (), nan, nan, nan, bar.metric, nan, nan, "torch module never ran", name)
            )
            return
        mine = inter[name]
        if mine.shape != array.shape:
            raise ValueError(
                f"layers {path!r} -> {name!r}: torch shape {array.shape} vs JAX shape {mine.shape} "
                "(give a transform: {path: (name, transform)})"
            )
        row_bar = calibrated_bar(array, exact[label]) if calibrate else bar
        layer_rows.append(measure(label, "layer", select(name, mine), select(name, array), row_bar, name, dtype))

    if reference is None:
        theirs, their_grads, their_params, their_activation, their_values = run_torch(
            torch_fn,
            inputs,
            dtype=dtype,
            pairs=pairs,
            torch_module=torch_module,
            on_layer=on_layer,
            grads=grads,
            loss=loss,
            logits=_logits_name(logits, split_jax(raw, True)[0]),
            params=[name for name, *_ in weights],
            activation=None if first in (None, FIRST_FLOATING) else 0,
            first_floating=first == FIRST_FLOATING,
        )
    else:
        theirs, their_grads, their_params = reference.outputs, reference.grads, reference.param_grads
        their_activation, their_values = reference.activation_grads, reference.activations
        calls: dict[str, int] = {}
        for index, (path, name, transform) in enumerate(pairs):
            calls[path] = calls.get(path, 0) + 1
            array = reference.layer(path if calls[path] == 1 else f"{path} (call {calls[path]})")
            on_layer(index, path, name, array if transform is None else np.asarray(transform(array)))
        layer_rows.sort(key=lambda r: reference.order(r.name))  # forward order, as recorded
    ours = split_jax(raw, bool(pairs), theirs)[0]
    check_structure(ours, theirs, "outputs")
    rows = layer_rows + [
        measure(k, "output", ours[k], theirs[k], calibrated_bar(theirs[k], exact[k]), k, dtype)
        if calibrate
        else measure(k, "output", select(k, ours[k]), select(k, theirs[k]), bar, k, dtype)
        for k in theirs
    ]
    name = _logits_name(logits, theirs)
    if name is not None:
        rows += logit_rows(name, select(name, ours[name]), select(name, theirs[name]), LOGIT_BARS[dtype])
    activation_note = None
    if grads:
        split = bool(pairs) or len(ours) != len(named_outputs(raw))
        torch_path, like = next(iter(their_values.items())) if first == FIRST_FLOATING else (None, None)
        mine, tree, at, described = jax_grads(
            jax_fn,
            inputs,
            theirs,
            loss=loss,
            logits=name,
            split=split,
            jax_params=jax_params,
            activation=first if first in (None, FIRST_FLOATING) else first[1],
            like=like,
            bar=bar,
        )
        check_structure(mine, their_grads, "gradients")
        grad_bar = Bar("normwise", MODEL_TOLERANCES[dtype].grad)
        rows += [measure(f"grad/{k}", "grad", mine[k], their_grads[k], grad_bar, k, dtype) for k in their_grads]
        if first == FIRST_FLOATING:
            rows.append(_first_floating_row(torch_path, at, described, their_activation[torch_path], grad_bar, dtype))
            activation_note = _first_floating_note(torch_path, at, described)
        elif first is not None:
            path, jax_name, _ = first
            if at.shape != their_activation[path].shape:
                raise ValueError(
                    f"layers {path!r} -> {jax_name!r}: torch gradient shape {their_activation[path].shape} vs JAX "
                    f"shape {at.shape}"
                )
            rows.append(measure(f"grad/{path}", "grad", at, their_activation[path], grad_bar, jax_name, dtype))
        rows += [param_row(pair, tree, their_params[pair[0]], grad_bar, dtype) for pair in weights]
    shapes = {k: (tuple(v.shape), str(v.dtype)) for k, v in inputs.items()}
    info = versions() if reference is None else {**versions(), "recorded_with": json.dumps(reference.versions)}
    requested = (
        *(["layer"] if pairs else []),
        "output",
        *(["kl", "top1", "top5"] if name is not None else []),
        *(["grad"] if grads and not weights else []),
        *(["param_grad"] if weights else []),
    )
    weight_dtypes = _parameter_dtypes(jax_params, dtype)
    failing = next((k for k, r in enumerate(rows) if not r.passed), None)
    if weight_dtypes and failing is not None:  # named where the reader looks first, not only in the summary
        rows[failing] = dataclasses.replace(rows[failing], status=f"{rows[failing].status} ({weight_dtypes[0]})")
    calibration = (
        f"output and layer bars: {CALIBRATION_FACTOR:g} x torch's own float32 error against its float64 run "
        f"at that row, at least {CALIBRATION_FLOOR:g}"
        if calibrate
        else None
    )
    return Certificate(
        dtype,
        tuple(rows),
        shapes,
        info,
        None if golden is None else str(golden),
        requested,
        weight_dtypes,
        calibration,
        activation_note,
    )


def _first_floating_row(torch_path: str, ours, described: str, theirs: np.ndarray, bar: Bar, dtype: str) -> Row:
    """The gradient row at the first floating activation: JAX's found value's gradient against torch's, or,
    when JAX makes no value equal to torch's activation, a failing row that says so."""
    if ours is None:
        nan = math.nan
        status = f"FAIL: {described}"
        return Row(f"grad/{torch_path}", "grad", tuple(theirs.shape), nan, nan, nan, bar.metric, nan, bar.value, status)
    if ours.shape != theirs.shape:  # found by torch's activation's shape, so equal unless torch's grad differs
        raise ValueError(f"grad/{torch_path}: torch gradient shape {theirs.shape} vs JAX shape {ours.shape}")
    return measure(f"grad/{torch_path}", "grad", ours, theirs, bar, described, dtype)


def _first_floating_note(torch_path: str, at: np.ndarray | None, described: str) -> str:
    """What a certificate of token inputs with neither layers= nor params= compared its gradient at."""
    jax_side = (
        f"JAX's {described} ({at.dtype.name}{list(at.shape)}: the primitive, then its jaxpr site, equation indices "
        "down through jit'd sub-programs and the output's position), the value its program makes from the "
        "integer inputs that equals it (the last of the first such run)"
        if at is not None
        else f"none on JAX's side ({described})"
    )
    return (
        "grads: every input is an integer and neither layers= nor params= is given, so the gradient compared is "
        f"the loss's with respect to the first floating activation: torch's {torch_path!r} output (the first "
        f"module output, in forward order, that is floating and depends on a parameter) against {jax_side}"
    )


# A calibrated float32 bar: CALIBRATION_FACTOR times the reference's own float32 rounding error at the row
# (torch float32 against torch float64 on the same numbers), never under CALIBRATION_FLOOR. Two correct float32
# implementations each sit about that rounding error from the exact value, so about twice it from each other;
# the factor leaves 5x room on that. The floor keeps a row torch computes exactly (an embedding lookup: error 0)
# from getting a bar of 0, and sits 10x over float32's unit roundoff (6e-8).
CALIBRATION_FACTOR = 10.0
CALIBRATION_FLOOR = 6e-7


def calibrated_bar(theirs: np.ndarray, exact: np.ndarray) -> Bar:
    """The normwise bar of a float32 row whose float64 reference value is `exact` (see CALIBRATION_FACTOR)."""
    own = error_metrics(np.asarray(theirs), np.asarray(exact))[2]
    return Bar("normwise", max(CALIBRATION_FACTOR * own, CALIBRATION_FLOOR) if math.isfinite(own) else math.nan)


def reference_in_float64(torch_fn, inputs: Mapping[str, np.ndarray], pairs, torch_module) -> dict[str, np.ndarray]:
    """{row label: array} of torch's run in float64 on the same numbers: the float32 inputs widened, a module's
    weights widened in place (exactly: float32 -> float64 -> float32 gives the same bits back, which the
    float32 run that follows casts them to)."""
    exact: dict[str, np.ndarray] = {}
    seen: dict[str, int] = {}

    def on_layer(index, path, name, array):
        seen[path] = seen.get(path, 0) + 1
        if array is not None:
            exact[path if seen[path] == 1 else f"{path} (call {seen[path]})"] = array

    outputs, *_ = run_torch(
        torch_fn,
        cast_inputs(inputs, "float64"),
        dtype="float64",
        pairs=pairs,
        torch_module=torch_module,
        on_layer=on_layer,
    )
    return {**exact, **outputs}


def _parameter_dtypes(jax_params, dtype: str) -> tuple[str, ...]:
    """A note when the port's parameters (jax_params) hold floating leaves of another dtype than the
    certificate's (bfloat16 weights under a float32 certificate): a bar cannot tell that from a port fault."""
    import jax

    if jax_params is None:
        return ()
    leaves = [np.dtype(leaf.dtype) for leaf in jax.tree_util.tree_leaves(jax_params) if hasattr(leaf, "dtype")]
    other = sorted({d.name for d in leaves if _floating(d) and d.name != dtype})
    if not other:
        return ()
    count = sum(d.name in other for d in leaves)
    return (f"dtype: {count} of {len(leaves)} leaves of jax_params are {'/'.join(other)}, the certificate is {dtype}",)


def param_row(pair: ParamPair, tree, theirs: np.ndarray, bar: Bar, dtype: str = "") -> Row:
    """d loss / d (torch parameter) against the JAX leaf the pair pulls from the gradient tree."""
    name, pull, transform, label = pair
    theirs = theirs if transform is None else np.asarray(transform(theirs))
    ours = np.asarray(pull(tree))
    if ours.shape != theirs.shape:
        raise ValueError(
            f"params {name!r} -> {label!r}: torch gradient shape {theirs.shape} vs JAX shape "
            f"{ours.shape} (give a transform: {{name: (path, transform)}})"
        )
    return measure(name, "param_grad", ours, theirs, bar, label, dtype)


def _logits_name(logits, outputs: Mapping[str, Any]) -> str | None:
    if logits is False:
        return None
    if logits is None:
        return "logits" if "logits" in outputs else None
    if logits not in outputs:
        raise ValueError(f"logits: expected one of the outputs {sorted(outputs)}, got {logits!r}")
    return logits
