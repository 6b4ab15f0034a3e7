"""Fine-tune DeBERTa-v3 for sequence classification in JAX (optax), step for step against PyTorch.

    python examples/deberta_finetune.py DIR [--steps 12] [--labels 3] [--dtype float64]
    python examples/deberta_finetune.py          # a tiny random DeBERTa-v3-shaped checkpoint in a temp directory

DIR: what transformers' save_pretrained writes for a deberta-v2 model (DeBERTa-v2 / v3: DebertaV2Model,
ForMaskedLM or ForSequenceClassification). transformers builds DebertaV2ForSequenceClassification from it
(a head it lacks starts from transformers' seeded init) and saves that; jaxattn.models.from_pretrained reads
the saved directory (no torch), so both sides start from the same weights. Both then take the same AdamW steps
(warmup + cosine, gradients clipped at 1.0) on the same padded batches of a toy task (the label is the first
token's id modulo the number of labels), dropout off; crosscheck.train_report compares them step by step:
both losses, every gradient and every parameter after each update (float64: 1e-10 normwise, 1e-12 on the loss;
float32: torch float32's own drift from float64).
"""

import argparse
import os
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

import crosscheck
from jaxattn.models import DebertaV2ForSequenceClassification, from_pretrained

os.environ.setdefault("HF_HUB_OFFLINE", "1")
jax.config.update("jax_enable_x64", True)  # the float64 run needs it; float32 runs pass float32 arrays


def batches(vocab_size: int, num_labels: int, *, count: int = 4, size: int = 5, length: int = 13, seed: int = 0):
    """`count` right-padded batches [size, length]: lengths length, length - 4, ..., token ids from 1, and the
    toy label of each row (its first token modulo num_labels)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        ids = rng.integers(1, vocab_size, (size, length))
        mask = np.ones_like(ids)
        for b in range(size):
            mask[b, length - (0, 4, 2, 7, 1)[b % 5] :] = 0
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": ids[:, 0] % num_labels})
    return out


def tiny_checkpoint(directory: Path) -> Path:
    """A tiny random DeBERTa-v3-shaped masked LM (crosscheck's seeded test checkpoint)."""
    from crosscheck._hf import checkpoints as hf

    return hf.write_checkpoint("deberta-v2", directory)


def main(directory, *, steps: int = 12, num_labels: int = 3, dtype: str = "float64", lr: float = 1e-3):
    """(the train report, the JAX model) after `steps` steps; prints the report."""
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()  # the new head's "newly initialized" notice
    torch.manual_seed(0)
    torch_model = transformers.DebertaV2ForSequenceClassification.from_pretrained(
        str(directory), num_labels=num_labels, attn_implementation="eager", local_files_only=True
    )
    with tempfile.TemporaryDirectory(prefix="deberta-classifier-") as start:
        torch_model.save_pretrained(start)  # the starting point both sides read
        model, params = from_pretrained(start, dtype=dtype)
    assert isinstance(model, DebertaV2ForSequenceClassification)
    data = batches(model.config.vocab_size, num_labels)
    report = crosscheck.train_report(
        torch_model,
        model,
        params,
        data,
        steps=steps,
        optimizer="adamw",
        lr=lr,
        scheduler="cosine",
        max_grad_norm=1.0,
        dtype=dtype,
    )
    print(report)
    return report, model


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", help="a deberta-v2 save_pretrained directory (default: a tiny one)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--labels", type=int, default=3)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="deberta-") as scratch:
        source = args.directory or tiny_checkpoint(Path(scratch) / "tiny")
        outcome, _ = main(source, steps=args.steps, num_labels=args.labels, dtype=args.dtype)
    sys.exit(0 if outcome.passed else 1)
