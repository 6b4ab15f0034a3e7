"""The optax twin of a torch training setup: optimizer (with its param groups), LR scheduler, clipping.

    tx = optax_from_torch(optimizer, torch_model, params, scheduler=scheduler, max_grad_norm=1.0)

One explicit table, checked against torch's own source (torch/optim/sgd.py, adam.py, adamw.py,
torch/nn/utils/clip_grad.py, transformers/optimization.py) and optax's (alias.py, transform.py, schedules):

| torch                                        | optax                                                         |
|----------------------------------------------|---------------------------------------------------------------|
| SGD(lr, momentum, nesterov, weight_decay)     | add_decayed_weights(wd) (L2, into the gradient, as torch) then |
|                                              | sgd(lr, momentum or None, nesterov): both buffers start at g   |
| Adam(lr, betas, eps, weight_decay)            | add_decayed_weights(wd) (L2) then adam(lr, b1, b2, eps)        |
| AdamW / Adam(decoupled_weight_decay=True)     | adamw(lr, b1, b2, eps, weight_decay=wd): p - lr * wd * p       |
| each param group                             | its own transform; multi_transform over labels of our leaves  |
| a parameter in no group                      | set_to_zero() (torch never updates it)                        |
| clip_grad_norm_(parameters, max_norm)         | clip_grad_norm_torch(max_norm) (below: not clip_by_global_norm) |
| get_cosine_schedule_with_warmup (LambdaLR)    | warmup_cosine_decay_schedule(0, lr, W, N,                      |
|                                              |   end_value=lr * min_lr_rate)                                 |
| get_linear_schedule_with_warmup (LambdaLR)    | join_schedules(linear 0 -> lr over W, linear lr -> 0 over N - W) |
| no scheduler                                 | the group's lr, constant                                      |

Adam's update is the same formula on both sides: m_hat / (sqrt(v_hat) + eps) with eps OUTSIDE the root
(optax's eps_root stays 0) and bias corrections 1 - beta^t from t = 1. Torch steps its scheduler after
optimizer.step(), so step t (0-based) uses lr(t): optax's schedule count starts at 0 on the first update.

Refused by name (ValueError saying why), because torch and optax disagree or optax has no twin:
`maximize` (optax minimises: negate the loss), SGD `dampening` != 0 (optax.trace has none; torch also skips
it on the first step), `amsgrad` (torch keeps the max of the RAW second moment and divides by the current
bias correction; optax.scale_by_amsgrad keeps the max of the bias-corrected one), Adafactor (torch's and
optax's differ in definition: torch factors the last two dims of torch's layout, optax the two largest
dims above min_dim_size_to_factor of ours, and the weight tables change layouts ([N*H,E] -> [E,N,H]), so
even one definition would factor differently on the two sides; also eps1 clamps the estimate in torch but
is added to g^2 in optax, and the relative step min(lr, 1/sqrt(t)) * RMS(p) has no optax twin), any other
optimizer class, LR schedulers other than the two above, a cosine with num_cycles != 0.5, and a run past
num_training_steps (HF's cosine rises again there, optax's stays at end_value). Options that change how
torch computes but not the update (`foreach`, `fused`, `capturable`, `differentiable`) are accepted and
listed as such; keys torch itself does not know (user labels in a group) are ignored by torch and here.
"""

from __future__ import annotations

import functools
from typing import Any

# options of torch optimizers that choose kernels, not the update's math
NEUTRAL = ("foreach", "fused", "capturable", "differentiable")
# torch's clip_grad_norm_ divides by (total_norm + 1e-6)
TORCH_CLIP_EPSILON = 1e-6
SPECS = ("sgd", "adam", "adamw")


def clip_grad_norm_torch(max_norm: float):
    """torch.nn.utils.clip_grad_norm_ as an optax transform: g * min(max_norm / (||g|| + 1e-6), 1).

    Not optax.clip_by_global_norm, which has no 1e-6 (g * max_norm / ||g|| when ||g|| > max_norm): a
    relative difference of 1e-6 / ||g|| on every clipped step, far above float64's bar.
    """
    import jax
    import jax.numpy as jnp
    import optax

    def update(updates, state, params=None):
        del params
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(updates)))
        coef = jnp.minimum(max_norm / (norm + TORCH_CLIP_EPSILON), 1.0)
        return jax.tree.map(lambda g: g * coef.astype(g.dtype), updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def optax_from_torch(
    optimizer, torch_model, params, *, scheduler=None, max_grad_norm: float | None = None, steps: int | None = None
):
    """The optax GradientTransformation that follows `optimizer` (and `scheduler`, and clipping) exactly.

    optimizer: a fresh torch.optim SGD / Adam / AdamW on `torch_model`'s parameters, any param groups.
    torch_model: the transformers model of a jaxattn.models family; params: our params tree for it (the
    groups become labels of its leaves through the family's weight table). scheduler: None or HF's
    get_cosine/linear_schedule_with_warmup on `optimizer`. max_grad_norm: torch's clip_grad_norm_ over all
    parameters before each step. steps: the run's length, checked against the scheduler's range.
    """
    from crosscheck._conversion.param_layout import ParamLayout

    layout = ParamLayout.of(torch_model, params)
    return twin(optimizer, torch_model, layout, scheduler=scheduler, max_grad_norm=max_grad_norm, steps=steps)[0]


def twin(optimizer, torch_model, layout, *, scheduler=None, max_grad_norm=None, steps=None) -> tuple[Any, list[str]]:
    """(optax transform, one line per mapping decision) for `optimizer` over `layout`'s parameters (the
    ParamLayout of torch_model against our params)."""
    import jax

    try:
        import optax
    except ImportError:
        raise ImportError('crosscheck\'s training parity needs optax: pip install "jaxattn[train]"') from None

    kind = _kind(optimizer)
    if optimizer.state:
        raise ValueError(
            f"optimizer: expected a fresh {type(optimizer).__name__} (no state yet: the optax twin "
            f"starts from zero moments), got state for {len(optimizer.state)} parameters"
        )
    _check_scheduler(scheduler, optimizer, steps)
    group_of = {id(p): k for k, g in enumerate(optimizer.param_groups) for p in g["params"]}
    named = _named_parameters(optimizer, torch_model)
    labels = {
        name: f"group{group_of[id(p)]}" if id(p) in group_of and p.requires_grad else "frozen"
        for name, p in named.items()
    }
    transforms, lines = {}, []
    for k, group in enumerate(optimizer.param_groups):
        lr = _learning_rate(scheduler, k, group, steps)
        transforms[f"group{k}"], line = _group_twin(kind, group, lr, optimizer.defaults)
        members = [n for n in layout.names if labels[n] == f"group{k}"]
        lines.append(f"group {k} ({len(members)} parameters): {line}")
    frozen = [n for n in layout.names if labels[n] == "frozen"]
    if frozen:
        transforms["frozen"] = optax.set_to_zero()
        lines.append(f"requires_grad=False or in no group (torch never updates them; set_to_zero): {', '.join(frozen)}")
    neutral = sorted({key for g in optimizer.param_groups for key in NEUTRAL if key in g and g[key]})
    if neutral:
        lines.append(f"accepted, kernels only (not the update's math): {', '.join(neutral)}")
    if len(transforms) == 1:
        tx = next(iter(transforms.values()))
    else:
        tx = optax.multi_transform(transforms, layout.labels(labels.__getitem__))
    if max_grad_norm is not None:
        if not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm: expected a number > 0, got {max_grad_norm!r}")
        tx = optax.chain(clip_grad_norm_torch(float(max_grad_norm)), tx)
        no_grad = layout.labels(lambda name: not named[name].requires_grad)
        if any(jax.tree.leaves(no_grad)):  # torch has no gradient for them: none in its norm either
            tx = optax.chain(optax.masked(optax.set_to_zero(), no_grad), tx)
        lines.insert(
            0,
            f"clip_grad_norm_(all parameters, {max_grad_norm}) -> clip_grad_norm_torch({max_grad_norm}) "
            f"(min(max_norm / (norm + 1e-6), 1), torch's formula)",
        )
    return tx, lines


def _named_parameters(optimizer, torch_model) -> dict:
    """{torch name: parameter} of torch_model; every tensor the optimizer holds must be among them."""
    params = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    named = dict(torch_model.named_parameters())
    known = {id(p) for p in named.values()}
    strangers = [tuple(p.shape) for i, p in params.items() if i not in known]
    if strangers:
        raise ValueError(
            f"optimizer: expected parameters of torch_model only, got {len(strangers)} others (shapes {strangers[:4]})"
        )
    return named


def _kind(optimizer) -> str:
    import torch

    kinds = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}
    kind = kinds.get(type(optimizer))
    if kind is not None:
        return kind
    name = type(optimizer).__name__
    if name == "Adafactor":
        raise ValueError(
            "optimizer: Adafactor has no optax twin: torch factors the second moment over the last "
            "two dims of torch's layout, optax over the two largest dims (>= min_dim_size_to_factor) "
            "of ours, and the weight tables change layouts; eps1 clamps the estimate in torch but is "
            "added to g^2 in optax; torch's step min(lr, 1/sqrt(t)) * RMS(param) has no optax twin"
        )
    raise ValueError(f"optimizer: expected torch.optim.SGD, Adam or AdamW (the mapped ones), got {name}")


def _refuse(key: str, value, why: str) -> None:
    raise ValueError(f"optimizer: param group option {key}={value!r} has no optax twin: {why}")


def _scalar(x) -> float:
    return float(x.item()) if hasattr(x, "item") else float(x)


def _group_twin(kind: str, group, lr, defaults) -> tuple[Any, str]:
    """One param group -> (optax transform, "torch ... -> optax ..." line)."""
    import optax

    known = {
        "sgd": {"lr", "momentum", "dampening", "weight_decay", "nesterov", "maximize"},
        "adam": {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "decoupled_weight_decay"},
    }[kind]
    unknown = sorted(k for k in defaults if k not in known and k not in NEUTRAL)
    if unknown:
        raise ValueError(
            f"optimizer: option(s) {unknown} of {kind} are not in the mapping table (a newer torch?): "
            f"refused rather than guessed"
        )
    if group.get("maximize"):
        _refuse("maximize", True, "optax minimises; negate the loss instead")
    wd = _scalar(group["weight_decay"])
    rate = lr if isinstance(lr, float) else "schedule"
    if kind == "sgd":
        if group["dampening"] != 0:
            _refuse(
                "dampening", group["dampening"], "optax.trace has no dampening (and torch skips it on the first step)"
            )
        momentum = _scalar(group["momentum"])
        tx = optax.sgd(lr, momentum=momentum or None, nesterov=bool(group["nesterov"]))
        text = (
            f"SGD(lr={rate}, momentum={momentum}, nesterov={group['nesterov']}, weight_decay={wd}) -> "
            f"{'add_decayed_weights(%g) + ' % wd if wd else ''}sgd({rate}, momentum={momentum or None}, "
            f"nesterov={group['nesterov']})"
        )
        return (optax.chain(optax.add_decayed_weights(wd), tx) if wd else tx), text
    if group["amsgrad"]:
        _refuse(
            "amsgrad",
            True,
            "torch keeps the max of the raw second moment and divides it by the current bias "
            "correction; optax.scale_by_amsgrad keeps the max of the bias-corrected moment",
        )
    b1, b2 = (_scalar(b) for b in group["betas"])
    eps = _scalar(group["eps"])
    if group.get("decoupled_weight_decay"):
        return (
            optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=wd),
            f"AdamW(lr={rate}, betas=({b1}, {b2}), eps={eps}, weight_decay={wd}) -> "
            f"adamw({rate}, b1={b1}, b2={b2}, eps={eps}, weight_decay={wd})",
        )
    tx = optax.adam(lr, b1=b1, b2=b2, eps=eps)
    return (
        (optax.chain(optax.add_decayed_weights(wd), tx) if wd else tx),
        f"Adam(lr={rate}, betas=({b1}, {b2}), eps={eps}, weight_decay={wd}) -> "
        f"{'add_decayed_weights(%g) + ' % wd if wd else ''}adam({rate}, b1={b1}, b2={b2}, eps={eps})",
    )


# --- learning-rate schedulers ---------------------------------------------------------------------------------

_HF = "transformers.optimization"


def _check_scheduler(scheduler, optimizer, steps) -> None:
    if scheduler is None:
        return
    if getattr(scheduler, "optimizer", None) is not optimizer:
        raise ValueError("scheduler: expected a scheduler built on `optimizer`, got one on another optimizer")
    if scheduler.last_epoch != 0:
        raise ValueError(f"scheduler: expected a fresh scheduler (last_epoch 0), got last_epoch {scheduler.last_epoch}")


def _learning_rate(scheduler, k: int, group, steps):
    """The group's lr: a float, or an optax schedule for HF's LambdaLR schedules."""
    import optax

    if scheduler is None:
        return _scalar(group["lr"])
    name = type(scheduler).__name__
    function = scheduler.lr_lambdas[k] if name == "LambdaLR" else None
    hf = (
        function.func.__name__
        if isinstance(function, functools.partial) and getattr(function.func, "__module__", None) == _HF
        else None
    )
    if hf not in ("_get_cosine_schedule_with_warmup_lr_lambda", "_get_linear_schedule_with_warmup_lr_lambda"):
        raise ValueError(
            f"scheduler: expected transformers' get_cosine_schedule_with_warmup or "
            f"get_linear_schedule_with_warmup (a LambdaLR), got {name}"
            f"{' of ' + repr(function) if function is not None else ''}: no mapped optax twin"
        )
    base = float(scheduler.base_lrs[k])
    options = dict(function.keywords)
    warmup, total = int(options.pop("num_warmup_steps")), int(options.pop("num_training_steps"))
    if "linear" in hf:
        pieces = [optax.linear_schedule(0.0, base, warmup)] if warmup else []
        pieces.append(optax.linear_schedule(base, 0.0, total - warmup))
        return float_count(pieces[0] if len(pieces) == 1 else optax.join_schedules(pieces, [warmup]))
    cycles, floor = float(options.pop("num_cycles", 0.5)), float(options.pop("min_lr_rate", 0.0))
    if options:
        raise ValueError(f"scheduler: options {sorted(options)} of {hf} are not in the mapping table")
    if cycles != 0.5:
        raise ValueError(
            f"scheduler: num_cycles={cycles} has no optax twin (warmup_cosine_decay_schedule is "
            f"the half cosine, num_cycles=0.5)"
        )
    if steps is not None and steps > total:
        raise ValueError(
            f"steps: expected at most num_training_steps={total} with a cosine schedule (HF's "
            f"cosine rises again after it, optax's stays at its end value), got {steps}"
        )
    return float_count(optax.warmup_cosine_decay_schedule(0.0, base, warmup, total, end_value=base * floor))


def float_count(schedule):
    """`schedule` called with the step count as the widest float (float64 under jax_enable_x64).

    optax's schedules divide optax's int32 count (count / warmup_steps), and JAX divides int32 in float32
    even under x64: the learning rate would carry float32 rounding (~3e-8 relative) into a float64 run,
    and float64 parameters would drift apart by ~1e-10 from the first warmup step."""
    import jax.numpy as jnp

    return lambda count: schedule(jnp.asarray(count, jnp.result_type(float)))


# --- the CLI's convenience: a string spec ------------------------------------------------------------------


def torch_optimizer(spec: str, torch_model, *, lr: float, weight_decay: float = 0.01):
    """ "sgd" (momentum 0.9), "adam" or "adamw" on torch_model's parameters. adamw: two groups, weight decay
    on the matrices (ndim >= 2: projections and embeddings), none on biases and norm scales (the usual
    convention, HF Trainer's too)."""
    import torch

    if spec not in SPECS:
        raise ValueError(f"optimizer: expected a torch.optim optimizer or one of {list(SPECS)}, got {spec!r}")
    if not lr > 0:
        raise ValueError(f"lr: expected a number > 0, got {lr!r}")
    params = list(torch_model.parameters())
    if spec == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if spec == "adam":
        return torch.optim.Adam(params, lr=lr)
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr)


def warmup_cosine(optimizer, steps: int, warmup: int | None = None):
    """HF's get_cosine_schedule_with_warmup over `steps`, warmup the first 10% (at least 1 step)."""
    from transformers import get_cosine_schedule_with_warmup

    return get_cosine_schedule_with_warmup(optimizer, max(1, steps // 10) if warmup is None else warmup, steps)
