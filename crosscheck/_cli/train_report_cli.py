"""`python -m crosscheck --model DIR --train STEPS [--optimizer adamw] [--lr 1e-3] [--dtype D] [--plot PNG]
[--json PATH]`: a training run of the checkpoint in torch and in JAX, step by step.

The setup is fixed, so that a run means the same thing everywhere: 4 seeded random batches of 4 x 16 token
ids, right-padded rows of different lengths (padding masked out of the loss), cycled; the optimizer the spec
names (adamw: weight decay 0.01 on matrices, none on biases and norms; adam; sgd: momentum 0.9);
transformers' get_cosine_schedule_with_warmup (warmup over the first 10% of steps) and clip_grad_norm_(1.0).
Each dtype trains a fresh copy of the torch model from DIR against the params read from DIR. Prints
crosscheck.train_report's table per dtype, optionally draws loss and parameter difference against step and
writes JSON ("first_divergent": step and parameter, or null), and exits 1 naming the first divergent step.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

BATCHES, BATCH, LENGTH = 4, 4, 16
FLOOR = 1e-17  # a difference of exactly 0 on a log axis


def random_batches(vocab_size: int, *, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """BATCHES seeded batches {"input_ids", "attention_mask"} [BATCH, LENGTH], right-padded with token 0."""
    from crosscheck._hf.checkpoints import padded_batch

    batches = []
    for k in range(BATCHES):
        ids, mask = padded_batch("right", seed=seed + k, batch=BATCH, length=LENGTH, vocab=vocab_size)
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches


def image_batches(config: dict, *, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """BATCHES seeded batches {"pixel_values" [BATCH,C,height,width] (N(0, 1) at the config's image_size),
    "labels" [BATCH]} for an image classifier."""
    from crosscheck._hf.checkpoints import pixel_values

    labels = len(config.get("id2label") or {}) or config.get("num_labels", 2)
    rng = np.random.default_rng(seed)
    return [
        {"pixel_values": pixel_values(config, seed=seed + k, batch=BATCH), "labels": rng.integers(0, labels, BATCH)}
        for k in range(BATCHES)
    ]


def plot(reports, path: str) -> None:
    """Two panels against step, log scale: both losses; the parameter difference (and its bar)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("python -m crosscheck: error: --plot needs matplotlib (pip install matplotlib)") from None
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.0, 6.0), sharex=True)
    for report in reports:
        steps = [s.step for s in report.steps]
        top.plot(steps, [s.loss_torch for s in report.steps], label=f"torch {report.dtype}")
        top.plot(steps, [s.loss_jax for s in report.steps], linestyle="--", label=f"jax {report.dtype}")
        (line,) = bottom.plot(
            steps, [max(s.parameter_difference, FLOOR) for s in report.steps], label=f"{report.dtype}: all parameters"
        )
        bottom.plot(
            steps,
            [max(max(s.parameters.values()), FLOOR) for s in report.steps],
            color=line.get_color(),
            linestyle=":",
            label=f"{report.dtype}: worst parameter",
        )
        bottom.axhline(
            report.tolerance.parameter,
            color=line.get_color(),
            linestyle="--",
            linewidth=0.8,
            label=f"{report.dtype}: bar {report.tolerance.parameter:.0e}",
        )
    top.set_yscale("log")
    top.set_ylabel("loss (causal LM, real tokens)")
    top.set_title(f"{reports[0].model}: torch.optim vs optax, {len(reports[0].steps)} steps")
    top.legend(fontsize=7)
    bottom.set_yscale("log")
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel("||jax - torch|| / ||torch||")
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _block_fp8(directory: Path) -> bool:
    """Whether DIR's config.json says block FP8 (False where it cannot be read: from_pretrained names why)."""
    try:
        q = json.loads((directory / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(q, dict) and q.get("quant_method") == "fp8"


def main(
    directory: str,
    *,
    steps: int,
    optimizer: str,
    lr: float,
    dtypes: Sequence[str] | None,
    plot_path: str | None,
    json_path: str | None,
) -> int:
    from crosscheck._cli.layer_report_cli import finish
    from crosscheck._hf import checkpoints as hf
    from crosscheck._training.train_report import CLASSIFIERS, FAMILIES, IMAGE_CLASSIFIERS, train_report
    from jaxattn.models import from_pretrained

    directory = Path(directory)
    try:
        # training takes plain params: a quantized checkpoint decoded as it is read; block FP8 to float32, as
        # transformers decodes it (its default, bfloat16, would round the weights transformers trains)
        fp8 = _block_fp8(directory)
        model, params = from_pretrained(
            directory, precision="highest", dequantize=True, dtype="float32" if fp8 else None
        )
        config = json.loads((directory / "config.json").read_text())
        architecture = str((config.get("architectures") or [""])[0])
        classifier = config.get("model_type") in CLASSIFIERS and architecture.endswith("ForSequenceClassification")
        if config.get("model_type") not in FAMILIES + IMAGE_CLASSIFIERS and not classifier:
            raise ValueError(
                f"{directory}: --train trains causal LMs ({', '.join(FAMILIES)}), the sequence classifiers of "
                f"{', '.join(CLASSIFIERS)} and image classifiers ({', '.join(IMAGE_CLASSIFIERS)}), got model_type "
                f"{config.get('model_type')!r} ({architecture or 'no architectures'})"
            )
        image = config["model_type"] in IMAGE_CLASSIFIERS
        if image and "SwinForImageClassification" not in (config.get("architectures") or ()):
            raise ValueError(f"{directory}: --train trains an image classifier's logits: expected one, got a SwinModel")
    except (OSError, ValueError) as error:
        print(f"python -m crosscheck: error: {error}", file=sys.stderr)
        return 2
    batches = image_batches(config) if image else random_batches(config["vocab_size"])
    if classifier:  # a toy task: each row's label is its first token modulo the number of labels
        batches = [{**b, "labels": b["input_ids"][:, 0] % model.config.num_labels} for b in batches]
    reports = []
    for dtype in dtypes or ("float64", "float32"):
        try:
            torch_model = hf.torch_model(directory)  # a fresh copy per run: training changes it
            reports.append(
                train_report(
                    torch_model,
                    model,
                    params,
                    batches,
                    steps=steps,
                    optimizer=optimizer,
                    lr=lr,
                    scheduler="cosine",
                    max_grad_norm=1.0,
                    dtype=dtype,
                )
            )
        except (ValueError, ImportError) as error:  # ImportError: an FP8 reference without accelerate
            print(f"python -m crosscheck: error: {error}", file=sys.stderr)
            return 2
    if image:
        shape = "x".join(map(str, batches[0]["pixel_values"].shape))
        data = f"{BATCHES} random batches of pixel_values {shape} and labels"
    else:
        real = sum(int(b["attention_mask"].sum()) for b in batches)
        data = f"{BATCHES} random batches of {BATCH}x{LENGTH} ({real} real tokens)"
    header = (
        f"{directory}: {config['model_type']}, {steps} steps of {optimizer} (lr {lr}, cosine with warmup, "
        f"clip 1.0) on {data}, cycled"
    )
    return finish(
        reports,
        header=header,
        json_path=json_path,
        plot_path=plot_path,
        draw=plot,
        divergence=_divergence,
        data={
            "model": str(directory),
            "passed": all(r.passed for r in reports),
            "first_divergent": next((r.first_divergent for r in reports if not r.passed), None),
            "reports": [r.to_dict() for r in reports],
        },
    )


def _divergence(report) -> str:
    first = report.first_divergent
    where = f", {first['parameter']} ({first['layer']})" if first["parameter"] else ""
    return f"first divergent step ({report.dtype}): step {first['step']}, {first['quantity']}{where}"
