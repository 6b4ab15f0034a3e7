"""`train_report`: a PyTorch training run against the same run in JAX (optax), step by step.

Per-call gradient parity does not show that N optimizer steps stay together: epsilon placement, bias
correction, which parameters decay, clipping, schedules and the loss's reduction over padding all move a
run while every single gradient matches. Both loops here take the same batches in the same order:

    torch (the reference)                                JAX (jit: gradient, then optax update)
    optimizer.zero_grad(); loss = causal_lm_loss(...)    loss, grads = value_and_grad(causal_lm_loss)(params)
    loss.backward(); clip_grad_norm_(..., max_norm)      updates, state = tx.update(grads, state, params)
    optimizer.step(); scheduler.step()                   params = optax.apply_updates(params, updates)

`tx` is `optax_from_torch` of the torch setup (crosscheck/_training/optim.py), or your own optax transform
(`jax_optimizer=`), which the report then checks. Step k (1-based) takes batch (k - 1) mod len(batches) at
the parameters after k - 1 updates; it records both losses, both gradient norms (before clipping), and per
torch parameter (named_parameters() names, compared element by element through the family's weight table:
crosscheck/_conversion/param_layout.py) the normwise difference of its gradient and of its value after the update.
Step 0 is the starting point (the two sets of weights must agree before anything runs).

Loss: causal-LM cross entropy, token t predicting token t + 1, averaged over the targets whose token AND
predicting token are real (attention_mask 1 on both; HF's labels = -100 on padding is the same for right
padding), log-softmax in float32 or wider; one formula, written once per framework (`causal_lm_loss`).
A classifier, a sequence one (CLASSIFIERS' *ForSequenceClassification, batches with "labels" [B]) or an image
one (IMAGE_CLASSIFIERS: Swin, batches of {"pixel_values", "labels"}): the mean cross entropy of its logits [B,C]
against the labels (`classification_loss`, HF's single-label loss).

Dropout is off on both sides: the torch model runs in eval() mode (its dropout modules are identities, no
other layer of these families changes with it), the JAX model is deterministic. float64: HF's float32-only
steps are lifted for the torch run (crosscheck._hf.checkpoints.float64_reference), or float64 parity could not
exist. Mixed precision (`mixed_precision="bfloat16"`): float32 master weights and optimizer on both sides,
the forward and backward in bfloat16 (torch: autocast on CPU; JAX: params cast to bfloat16 for the model,
gradients back to float32 through the cast); the two are different roundings of the same math, so its bar is
a measured envelope (TRAIN_TOLERANCES), not a proof.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from crosscheck._comparison.compare import error_metrics
from crosscheck._conversion.param_layout import ParamLayout, layer_of
from crosscheck._hf.checkpoints import buffers_as_frozen_parameters, float64_reference
from crosscheck._training.optim import SPECS, torch_optimizer, twin, warmup_cosine

FAMILIES = (
    "gpt2",
    "llama",
    "qwen2",
    "mistral",
    "gemma2",
    "qwen3",
    "gemma3_text",
    "mixtral",
    "gpt_oss",
    "qwen3_moe",
    "llama4_text",
    "deepseek_v3",
    "qwen3_next",
)  # the causal LMs of jaxattn.models
# encoders whose *ForSequenceClassification trains on batches with "labels" [B] (classification_loss)
CLASSIFIERS = ("deberta-v2",)
IMAGE_CLASSIFIERS = ("swin",)  # trained on {"pixel_values", "labels"} with classification_loss


@dataclasses.dataclass(frozen=True)
class TrainTolerance:
    """Bars of a run, normwise relative: a parameter after each step and a gradient against torch's, and
    |loss_jax - loss_torch| / |loss_torch|."""

    parameter: float
    gradient: float
    loss: float


# Measured on the tiny checkpoint of each family (write_checkpoint), 100 AdamW steps (warmup + cosine, clip 1.0,
# lr 1e-3) on 4 padded 4x16 batches (the tests' random_batches; float32 and mixed also on a second set); the
# largest value over families, steps and sets, then the bar:
#   float64  parameter 8.5e-15, gradient 3.1e-12, loss 1.0e-14                   bars 1e-10, 1e-10, 1e-12
#   float32  parameter 2.5e-6, gradient 1.6e-3, loss 4.1e-5 (the size of torch float32's own drift from torch
#            float64 on the same run: parameter 5.8e-7, loss 1.3e-5 for Llama)  bars 1e-5, 1e-2, 1e-4
#   bfloat16-mixed  parameter 2.9e-2, gradient 2.8, loss 5.9e-2 (torch autocast against torch float32 on the
#            same run: parameter 3.1e-2, loss 6.9e-2)                            bars 1e-1, none, 2e-1
TRAIN_TOLERANCES: Mapping[str, TrainTolerance] = MappingProxyType(
    {
        "float64": TrainTolerance(parameter=1e-10, gradient=1e-10, loss=1e-12),
        "float32": TrainTolerance(parameter=1e-5, gradient=1e-2, loss=1e-4),
        # gradients of two bf16 computations differ by O(1) late in a run: reported, not held to a bar
        "bfloat16-mixed": TrainTolerance(parameter=1e-1, gradient=math.inf, loss=2e-1),
    }
)


@dataclasses.dataclass(frozen=True)
class TrainStep:
    step: int  # 1-based optimizer step
    lr: float  # torch's first param group's lr at this step
    loss_torch: float
    loss_jax: float
    grad_norm_torch: float  # global 2-norm of the raw gradients (before clipping)
    grad_norm_jax: float
    gradients: Mapping[str, float]  # torch name -> normwise difference of its gradient
    parameters: Mapping[str, float]  # torch name -> normwise difference after the update
    parameter_difference: float  # all parameters together, normwise (noise leaves apart)
    noise_difference: float  # the noise leaves' elements together, normwise (nan when there are none)

    @property
    def loss_difference(self) -> float:
        return abs(self.loss_jax - self.loss_torch) / abs(self.loss_torch)


@dataclasses.dataclass(frozen=True)
class TrainReport:
    model: str
    dtype: str  # "float32", "float64" or "bfloat16-mixed"
    optimizer: tuple[str, ...]  # the mapping, one line per decision (or "jax_optimizer: given")
    layers: Mapping[str, str]  # torch name -> its layer ("layer3", "wte", ...), names in model order
    initial: Mapping[str, float]  # step 0: torch name -> normwise difference before training
    noise: tuple[str, ...]  # leaves whose gradient is rounding noise on both sides (no bar)
    steps: tuple[TrainStep, ...]
    tolerance: TrainTolerance
    seconds: Mapping[str, float]  # {"torch": s, "jax": s, "jax_compile": s}

    def _over(self, values: Mapping[str, float], bar: float) -> list[str]:
        """Names over `bar` (NaN included), the worst first."""
        bad = [n for n, v in values.items() if not v <= bar]
        return sorted(bad, key=lambda n: -values[n] if not math.isnan(values[n]) else -math.inf)

    def divergences(self) -> list[dict[str, Any]]:
        """Every (step, quantity, parameters over the bar), in the order the run meets them: step 0's
        weights, then per step the loss, the gradients, the parameters after the update."""
        t, found = self.tolerance, []
        if self._over(self.initial, t.parameter):
            found.append({"step": 0, "quantity": "parameter", "names": self._over(self.initial, t.parameter)})
        for s in self.steps:
            if not s.loss_difference <= t.loss:
                found.append({"step": s.step, "quantity": "loss", "names": []})
            for quantity, values, bar in (
                ("gradient", s.gradients, t.gradient),
                ("parameter", s.parameters, t.parameter),
            ):
                if self._over(values, bar):
                    found.append({"step": s.step, "quantity": quantity, "names": self._over(values, bar)})
        return found

    @property
    def first_divergent(self) -> dict[str, Any] | None:
        """None, or {"step", "quantity" ("loss", "gradient" or "parameter"), "parameter" (the worst torch
        name over the bar there; None for the loss), "layer", "over_bar" (every name over it)}."""
        found = self.divergences()
        if not found:
            return None
        first = found[0]
        name = first["names"][0] if first["names"] else None
        return {
            "step": first["step"],
            "quantity": first["quantity"],
            "parameter": name,
            "layer": self.layers[name] if name else None,
            "over_bar": first["names"],
        }

    @property
    def first_divergent_step(self) -> int | None:
        first = self.first_divergent
        return None if first is None else first["step"]

    @property
    def passed(self) -> bool:
        return bool(self.steps) and self.first_divergent is None

    def worst(self) -> dict[str, float]:
        """The run's largest parameter, gradient and loss differences."""
        per = [max(s.parameters.values()) for s in self.steps]
        return {
            "parameter": max(per, default=math.nan),
            "gradient": max((max(s.gradients.values()) for s in self.steps), default=math.nan),
            "loss": max((s.loss_difference for s in self.steps), default=math.nan),
            "initial": max(self.initial.values(), default=math.nan),
            "noise": max((s.noise_difference for s in self.steps), default=math.nan),
        }

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (NaN -> None)."""
        return _json_ready(
            {
                "model": self.model,
                "dtype": self.dtype,
                "passed": self.passed,
                "first_divergent": self.first_divergent,
                "optimizer": list(self.optimizer),
                "tolerance": dataclasses.asdict(self.tolerance),
                "worst": self.worst(),
                "noise": list(self.noise),
                "seconds": dict(self.seconds),
                "initial": dict(self.initial),
                "layers": dict(self.layers),
                "steps": [{**dataclasses.asdict(s), "loss_difference": s.loss_difference} for s in self.steps],
            }
        )

    def __str__(self) -> str:
        t = self.tolerance
        lines = [
            f"{self.model} [{self.dtype}]: {len(self.steps)} steps; bars: parameter <= {t.parameter:.0e}, "
            f"gradient <= {t.gradient:.0e} normwise, loss <= {t.loss:.0e} relative",
            *self.optimizer,
            f"  {'step':>5} {'lr':>9} {'loss torch':>12} {'loss jax':>12} {'loss diff':>9} "
            f"{'|g| torch':>9} {'param diff':>10} {'worst parameter':36}",
        ]
        for s in _shown(self.steps):
            name = max(s.parameters, key=lambda n: s.parameters[n])
            lines.append(
                f"  {s.step:5d} {s.lr:9.2e} {s.loss_torch:12.8f} {s.loss_jax:12.8f} "
                f"{s.loss_difference:9.1e} {s.grad_norm_torch:9.2e} {s.parameter_difference:10.2e} "
                f"{name} {s.parameters[name]:.1e}"
            )
        first = self.first_divergent
        w = self.worst()
        lines.append(f"  worst: parameter {w['parameter']:.2e}, gradient {w['gradient']:.2e}, loss {w['loss']:.2e}")
        if self.noise:
            lines.append(
                f"  compared apart, no bar (gradient at rounding level on both sides at step 1: Adam steps on "
                f"noise): {'; '.join(self.noise)}; largest difference {w['noise']:.1e}"
            )
        lines.append(
            "  every step passes"
            if first is None
            else f"  first divergent: step {first['step']}, {first['quantity']}"
            + (f" of {first['parameter']} ({first['layer']})" if first["parameter"] else "")
        )
        return "\n".join(lines)


def _json_ready(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_ready(v) for v in value]
    return value


def _shown(steps: Sequence[TrainStep]) -> list[TrainStep]:
    """The table's rows: the first five steps, every tenth, the last."""
    return [s for i, s in enumerate(steps) if i < 5 or s.step % 10 == 0 or i == len(steps) - 1]


# --- the loss, once per framework -------------------------------------------------------------------------------


def causal_lm_loss_jax(logits, input_ids, attention_mask):
    """Mean cross entropy of token t + 1 given tokens <= t over targets whose token and predictor are real."""
    import jax
    import jax.numpy as jnp

    logits = logits[:, :-1].astype(jnp.promote_types(logits.dtype, jnp.float32))
    weights = (attention_mask[:, :-1] * attention_mask[:, 1:]).astype(logits.dtype)
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, input_ids[:, 1:, None], axis=-1)[..., 0]
    return (nll * weights).sum() / weights.sum()


def causal_lm_loss_torch(logits, input_ids, attention_mask):
    """causal_lm_loss_jax in torch, line for line."""
    import torch

    logits = logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32))
    weights = (attention_mask[:, :-1] * attention_mask[:, 1:]).to(logits.dtype)
    logp = torch.log_softmax(logits, dim=-1)
    nll = -torch.gather(logp, -1, input_ids[:, 1:, None])[..., 0]
    return (nll * weights).sum() / weights.sum()


def classification_loss_jax(logits, labels):
    """Mean cross entropy of the labels [B] under logits [B,C], log-softmax in float32 or wider."""
    import jax
    import jax.numpy as jnp

    logp = jax.nn.log_softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1)[:, 0].mean()


def classification_loss_torch(logits, labels):
    """classification_loss_jax in torch, line for line."""
    import torch

    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    return -torch.gather(logp, -1, labels[:, None])[:, 0].mean()


# --- the report -------------------------------------------------------------------------------------------------


def train_report(
    torch_model,
    model,
    params,
    batches: Sequence[Mapping[str, Any]],
    *,
    steps: int,
    optimizer,
    lr: float | None = None,
    scheduler=None,
    max_grad_norm: float | None = None,
    jax_optimizer=None,
    dtype: str = "float32",
    mixed_precision: str | None = None,
) -> TrainReport:
    """Train `torch_model` (transformers, a causal LM) and (model, params) (its jaxattn.models port) for
    `steps` steps on `batches` ([{"input_ids": int [B,T], "attention_mask": [B,T] (optional)}], cycled),
    and compare the two runs step by step. A sequence classifier (CLASSIFIERS) takes "labels" int [B] too; an
    image classifier (Swin) takes [{"pixel_values": [B,C,height,width], "labels": int [B]}].

    optimizer: a fresh torch.optim SGD / Adam / AdamW on torch_model's parameters (param groups mapped
    one by one), or "sgd" / "adam" / "adamw" with `lr` (crosscheck._training.optim.torch_optimizer). scheduler:
    None, HF's get_cosine/linear_schedule_with_warmup on that optimizer, or "cosine" (warmup over the first
    10% of steps). max_grad_norm: clip_grad_norm_ over every parameter before each step. jax_optimizer: an
    optax transform to check instead of the mapped twin. dtype: "float32" or "float64", both sides cast
    to it (the torch model in place); mixed_precision="bfloat16" with dtype "float32": see the module doc.
    torch_model and optimizer are trained in place, as a torch loop would.
    """
    import jax
    import torch

    run = _Run.check(torch_model, batches, steps, dtype, mixed_precision)
    buffers_as_frozen_parameters(torch_model)  # DeepSeek V3's router bias: a leaf of ours, frozen on both sides
    optimizer, scheduler = _torch_setup(torch_model, optimizer, lr, scheduler, steps)
    layout = ParamLayout.of(torch_model, params)
    tx, lines = twin(optimizer, torch_model, layout, scheduler=scheduler, max_grad_norm=max_grad_norm, steps=steps)
    if jax_optimizer is not None:
        tx, lines = jax_optimizer, [f"jax_optimizer: given (the mapped twin would be: {'; '.join(lines)})"]
    torch_model.to(getattr(torch, dtype)).eval()
    params = jax.tree.map(lambda x: np.asarray(x).astype(dtype), params)
    named = dict(torch_model.named_parameters())
    initial = _differences(layout.to_torch(params), _values(named))
    jax_step = _jax_step(model, tx, mixed_precision, run.image)
    state, rows, clock, noise = tx.init(params), [], {"torch": 0.0, "jax": 0.0, "jax_compile": 0.0}, None
    with float64_reference(torch_model, dtype):
        for k in range(1, steps + 1):
            ids, mask, labels = run.batch(k)  # an image classifier's: (pixel_values, None, labels)
            if run.image:
                ids = ids.astype(dtype)
            started = time.perf_counter()
            lr_now = float(optimizer.param_groups[0]["lr"])
            loss_t, grads_t = _torch_step(
                torch_model, named, optimizer, scheduler, max_grad_norm, ids, mask, labels, mixed_precision, run.image
            )
            clock["torch"] += time.perf_counter() - started
            started = time.perf_counter()
            params, state, loss_j, grads_tree = jax.block_until_ready(jax_step(params, state, ids, mask, labels))
            clock["jax_compile" if k == 1 else "jax"] += time.perf_counter() - started
            if noise is None:
                noise = _Noise.find(layout, grads_t, grads_tree, dtype)
            grads_j = layout.to_torch(grads_tree)
            values_t, values_j = _values(named), layout.to_torch(params)
            trained = {n for n, p in named.items() if p.requires_grad}
            rows.append(
                TrainStep(
                    k,
                    lr_now,
                    loss_t,
                    float(loss_j),
                    _norm(grads_t),
                    _norm(grads_j),
                    _differences(grads_j, grads_t, noise.kept, trained),
                    _differences(values_j, values_t, noise.kept),
                    *noise.totals(values_j, values_t),
                )
            )
    return TrainReport(
        run.name(torch_model),
        run.key,
        tuple(lines),
        {n: layer_of(n) for n in named},
        initial,
        noise.described,
        tuple(rows),
        TRAIN_TOLERANCES[run.key],
        clock,
    )


# a leaf whose gradient norm is at most this many machine epsilons of the global gradient norm, on both sides
NOISE_FLOOR_EPS = 1e3


@dataclasses.dataclass(frozen=True)
class _Noise:
    """Leaves whose gradient is rounding noise on both sides at step 1 (norm <= NOISE_FLOOR_EPS * eps *
    the global gradient norm; every other leaf of these models is >= 1e-4 of it): their exact gradient is
    zero (a key bias without RoPE adds q.b to a whole row of logits, which softmax ignores). Adam divides
    that noise by sqrt(v) + eps ~ eps and steps on it, differently on each side, by up to lr per step
    (GPT-2's key biases drift ~1e-3 apart in float32, as torch float32 drifts from torch float64); their
    elements are compared apart (`noise_difference`), with no bar."""

    kept: Mapping[str, np.ndarray]  # torch name -> bool, False on noise elements
    described: tuple[str, ...]

    @classmethod
    def find(cls, layout: ParamLayout, grads_t, grads_tree, dtype: str) -> _Noise:
        import jax

        theirs = [np.linalg.norm(np.asarray(g, np.float64)) for g in jax.tree.leaves(layout.to_jax(grads_t))]
        ours = [np.linalg.norm(np.asarray(g, np.float64)) for g in jax.tree.leaves(grads_tree)]
        floor = NOISE_FLOOR_EPS * np.finfo(dtype).eps * max(_norm(grads_t), math.hypot(*ours) if ours else 0.0)
        noise = {i for i, (a, b) in enumerate(zip(theirs, ours)) if a <= floor and b <= floor}
        described = tuple(
            f"{layout.leaves[i].path} ({layout.leaves[i].index.size} elements of {layout.leaves[i].name})"
            for i in sorted(noise)
        )
        return cls(layout.kept(noise), described)

    def totals(self, ours: Mapping[str, np.ndarray], theirs: Mapping[str, np.ndarray]) -> tuple[float, float]:
        """(normwise difference of the kept elements, of the noise elements) over all parameters."""
        pick = [
            (np.asarray(ours[n])[k], np.asarray(theirs[n])[k], np.asarray(ours[n])[~k], np.asarray(theirs[n])[~k])
            for n, k in self.kept.items()
        ]
        kept = error_metrics(_flat([p[0] for p in pick]), _flat([p[1] for p in pick]))[2]
        noisy = [p for p in pick if p[2].size]
        rest = error_metrics(_flat([p[2] for p in noisy]), _flat([p[3] for p in noisy]))[2] if noisy else math.nan
        return kept, rest


@dataclasses.dataclass(frozen=True)
class _Run:
    # (input_ids, attention_mask, labels or None), or an image classifier's (pixel_values, None, labels)
    batches: tuple[tuple[np.ndarray, np.ndarray | None, np.ndarray | None], ...]
    dtype: str
    mixed_precision: str | None
    image: bool = False  # an image classifier: batches of (pixel_values, labels)

    @property
    def key(self) -> str:
        return "bfloat16-mixed" if self.mixed_precision else self.dtype

    def batch(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        return self.batches[(k - 1) % len(self.batches)]

    def name(self, torch_model) -> str:
        return f"{torch_model.config.model_type} ({type(torch_model).__name__})"

    @classmethod
    def check(cls, torch_model, batches, steps, dtype, mixed_precision) -> _Run:
        import jax

        model_type = getattr(getattr(torch_model, "config", None), "model_type", None)
        classifier = model_type in CLASSIFIERS and type(torch_model).__name__.endswith("ForSequenceClassification")
        if model_type not in FAMILIES + IMAGE_CLASSIFIERS and not classifier:
            raise ValueError(
                f"torch_model: expected a causal LM of model_type {list(FAMILIES)}, a sequence classifier of "
                f"{list(CLASSIFIERS)} or an image classifier of {list(IMAGE_CLASSIFIERS)}, got {model_type!r} "
                f"({type(torch_model).__name__})"
            )
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps: expected an int >= 1, got {steps!r}")
        if dtype not in ("float32", "float64"):
            raise ValueError(f"dtype: expected 'float32' or 'float64', got {dtype!r}")
        if dtype == "float64" and not jax.config.jax_enable_x64:
            raise ValueError(
                "dtype: 'float64' needs jax_enable_x64 (jax.config.update('jax_enable_x64', True)); "
                "without it JAX would compute in float32"
            )
        if mixed_precision not in (None, "bfloat16"):
            raise ValueError(f"mixed_precision: expected None or 'bfloat16', got {mixed_precision!r}")
        if mixed_precision and dtype != "float32":
            raise ValueError(f"dtype: mixed_precision keeps float32 master weights: expected 'float32', got {dtype!r}")
        if not isinstance(batches, Sequence) or not batches:
            raise ValueError(
                f"batches: expected a non-empty sequence of {{'input_ids', 'attention_mask'}}, "
                f"got {type(batches).__name__}"
            )
        image = model_type in IMAGE_CLASSIFIERS
        if image:
            checked = _checked_image_batch
        else:
            checked = functools.partial(_checked_batch, classifier=classifier)
        return cls(tuple(checked(i, b) for i, b in enumerate(batches)), dtype, mixed_precision, image)


def _checked_image_batch(i: int, batch) -> tuple[np.ndarray, None, np.ndarray]:
    if not isinstance(batch, Mapping) or set(batch) != {"pixel_values", "labels"}:
        got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
        raise ValueError(f"batches[{i}]: expected a mapping with exactly 'pixel_values' and 'labels', got {got}")
    pixels, labels = np.asarray(batch["pixel_values"]), np.asarray(batch["labels"])
    if pixels.ndim != 4 or not np.issubdtype(pixels.dtype, np.floating):
        raise ValueError(
            f"batches[{i}]['pixel_values']: expected floating [B,C,height,width], got {pixels.dtype} "
            f"{list(pixels.shape)}"
        )
    if labels.shape != pixels.shape[:1] or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(
            f"batches[{i}]['labels']: expected integer [{pixels.shape[0]}], got {labels.dtype} {list(labels.shape)}"
        )
    return pixels, None, labels.astype(np.int64)


def _checked_batch(i: int, batch, classifier: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise ValueError(f"batches[{i}]: expected a mapping with 'input_ids', got {type(batch).__name__}")
    keys = {"input_ids", "attention_mask", "labels"} if classifier else {"input_ids", "attention_mask"}
    extra = sorted(set(batch) - keys)
    if extra:
        raise ValueError(f"batches[{i}]: expected only {sorted(keys)}, got also {extra}")
    ids = np.asarray(batch["input_ids"])
    if ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.shape[1] < 2:
        raise ValueError(
            f"batches[{i}]['input_ids']: expected integer [B,T] with T >= 2, got {ids.dtype} {list(ids.shape)}"
        )
    mask = np.asarray(batch.get("attention_mask", np.ones_like(ids)))
    if mask.shape != ids.shape or not np.isin(mask, (0, 1)).all():
        raise ValueError(
            f"batches[{i}]['attention_mask']: expected 0/1 of shape {list(ids.shape)}, got "
            f"{mask.dtype} {list(mask.shape)}"
        )
    if classifier:
        labels = np.asarray(batch.get("labels"))
        if labels.shape != ids.shape[:1] or not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(
                f"batches[{i}]['labels']: expected integer [B] = [{ids.shape[0]}] (a class per sequence), got "
                f"{labels.dtype} {list(labels.shape)}"
            )
        return ids.astype(np.int64), mask.astype(np.int64), labels.astype(np.int64)
    if not (mask[:, :-1] * mask[:, 1:]).any():
        raise ValueError(
            f"batches[{i}]['attention_mask']: expected at least one real token after a real token "
            f"(a target of the loss), got none"
        )
    return ids.astype(np.int64), mask.astype(np.int64), None


def _torch_setup(torch_model, optimizer, lr, scheduler, steps):
    """The user's torch optimizer and scheduler, or the ones a string spec names."""
    import torch

    if isinstance(optimizer, str):
        if lr is None:
            raise ValueError(f"lr: expected a learning rate with optimizer={optimizer!r}, got None")
        optimizer = torch_optimizer(optimizer, torch_model, lr=lr)
    elif not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer: expected a torch.optim optimizer or one of {list(SPECS)}, got {type(optimizer).__name__}"
        )
    elif lr is not None:
        raise ValueError("lr: the torch optimizer carries its learning rates; give lr only with a string spec")
    if scheduler == "cosine":
        scheduler = warmup_cosine(optimizer, steps)
    elif isinstance(scheduler, str):
        raise ValueError(f"scheduler: expected None, 'cosine' or a transformers LambdaLR, got {scheduler!r}")
    return optimizer, scheduler


def _torch_step(torch_model, named, optimizer, scheduler, max_grad_norm, ids, mask, labels, mixed_precision, image):
    """One torch training step; (loss, {name: raw gradient}); labels: a classifier's, else None; image: ids are
    pixel_values (mask None)."""
    import contextlib

    import torch

    optimizer.zero_grad(set_to_none=True)
    torch_model.zero_grad(set_to_none=True)
    ids_t, mask_t = torch.from_numpy(ids), None if mask is None else torch.from_numpy(mask)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if mixed_precision else contextlib.nullcontext()
    with autocast:
        if image:
            logits = torch_model(pixel_values=ids_t).logits
        elif labels is None:
            logits = torch_model(input_ids=ids_t, attention_mask=mask_t, use_cache=False).logits
        else:
            logits = torch_model(input_ids=ids_t, attention_mask=mask_t).logits
    if labels is None:
        loss = causal_lm_loss_torch(logits, ids_t, mask_t)
    else:
        loss = classification_loss_torch(logits, torch.from_numpy(labels))
    loss.backward()
    missing = [n for n, p in named.items() if p.requires_grad and p.grad is None]
    if missing:
        raise ValueError(
            f"torch_model: parameters {missing} get no gradient from the loss: torch's optimizers skip "
            f"them while optax updates every leaf; freeze them (requires_grad=False)"
        )
    grads = {
        n: (p.grad.detach().numpy().copy() if p.grad is not None else np.zeros(p.shape, p.detach().numpy().dtype))
        for n, p in named.items()
    }
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(torch_model.parameters(), max_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    return float(loss.detach()), grads


def _jax_step(model, tx, mixed_precision, image=False):
    """params, state, ids, mask, labels -> (params, state, loss, raw gradients); image: ids are pixel_values.

    Two jit programs, not one: the model's loss-and-gradient (the costly compile, the same for every
    optimizer, so cached per model: a second report on the model, e.g. with another optimizer, reuses it)
    and the optax update (small). The gradients go to the host at every step anyway, for the comparison."""
    import jax
    import optax

    gradients = {}

    @jax.jit
    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def step(params, state, ids, mask, labels=None):
        kind = "image" if image else "causal_lm" if labels is None else "classify"
        if kind not in gradients:
            gradients[kind] = _loss_and_gradient(model, mixed_precision, kind)
        loss, grads = gradients[kind](params, ids, mask, labels)
        return (*update(params, state, grads), loss, grads)

    return step


@functools.cache
def _loss_and_gradient(model, mixed_precision, kind: str):
    import jax
    import jax.numpy as jnp

    def loss(params, ids, mask, labels):  # kind "image": ids are pixel_values, mask None
        if mixed_precision:  # float32 master weights, the model computes in bfloat16
            params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
        if kind == "image":
            return classification_loss_jax(model.apply({"params": params}, ids), labels)
        logits = model.apply({"params": params}, ids, attention_mask=mask)
        return causal_lm_loss_jax(logits, ids, mask) if kind == "causal_lm" else classification_loss_jax(logits, labels)

    return jax.jit(jax.value_and_grad(loss))


def _differences(
    ours: Mapping[str, np.ndarray], theirs: Mapping[str, np.ndarray], kept=None, names=None
) -> dict[str, float]:
    """torch name -> normwise difference over its kept elements (names with none kept are left out)."""
    out = {}
    for n in theirs:
        keep = np.ones(np.shape(theirs[n]), bool) if kept is None else kept[n]
        if keep.any() and (names is None or n in names):
            out[n] = error_metrics(np.asarray(ours[n])[keep], np.asarray(theirs[n])[keep])[2]
    return out


def _values(named) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in named.items()}


def _norm(tensors: Mapping[str, np.ndarray]) -> float:
    return float(math.sqrt(sum(float(np.sum(np.square(t, dtype=np.float64))) for t in tensors.values())))


def _flat(arrays: Sequence[np.ndarray]) -> np.ndarray:
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])
