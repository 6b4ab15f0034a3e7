"""`python -m crosscheck --model DIR [--plot FILE.png] [--json FILE]`: a checkpoint, layer by layer.

Loads DIR in transformers (torch, eager attention) and in jaxattn.models (no torch), runs both on one
batch (the directory's tokenizer.json on fixed sentences when there is one, else seeded random token ids;
prompts of different lengths, padded), prints crosscheck.layer_report's table per dtype, optionally draws
error against depth and writes JSON, and exits 1 naming the first divergent layer.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Hi!",
    "A man is eating food.",
    "Two dogs are playing in the snow near the old wooden fence.",
)


def model_inputs(directory: Path, config: dict) -> dict[str, np.ndarray]:
    """{"input_ids", "attention_mask"} [B,T]: real sentences when DIR has a tokenizer, else random ids.

    Padding is on the right for encoders (BERT, T5) and on the left for decoders, as each is used. T5 also
    gets decoder_input_ids: its decoder_start_token_id, then 6 seeded random tokens. An image model (Swin):
    {"pixel_values"} [3,C,height,width] at its config's image_size.
    """
    from crosscheck._hf.checkpoints import IMAGE_FAMILIES, pixel_values

    if config.get("model_type") in IMAGE_FAMILIES:  # no tokens: seeded N(0, 1) pixels at the config's size
        return {"pixel_values": pixel_values(config)}
    inputs = _encoder_inputs(directory, config)
    if config.get("model_type") == "t5":
        B = len(inputs["input_ids"])
        start = config.get("decoder_start_token_id")
        start = config.get("pad_token_id") or 0 if start is None else start
        decoder = np.random.default_rng(1).integers(0, config["vocab_size"], (B, 7))
        decoder[:, 0] = start
        inputs["decoder_input_ids"] = decoder
    return inputs


def _encoder_inputs(directory: Path, config: dict) -> dict[str, np.ndarray]:
    from crosscheck._hf.checkpoints import padded_batch

    side = "right" if config.get("model_type") in ("bert", "t5", "deberta-v2") else "left"
    pad = config.get("pad_token_id") or 0
    tokenizer_file = directory / "tokenizer.json"
    if tokenizer_file.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            Tokenizer = None
        if Tokenizer is not None:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
            tokenizer.no_truncation()
            tokenizer.enable_padding(pad_id=pad, direction=side)
            encoded = tokenizer.encode_batch(list(SENTENCES))
            return {
                "input_ids": np.array([e.ids for e in encoded], np.int64),
                "attention_mask": np.array([e.attention_mask for e in encoded], np.int64),
            }
    ids, mask = padded_batch(side, vocab=config["vocab_size"])
    return {"input_ids": np.where(mask == 1, ids, pad), "attention_mask": mask}


def plot(reports, path: str) -> None:
    """Error against depth, one line per dtype; each row's error is divided by its bar, so 1 = tolerance."""
    from crosscheck._certificates.certify import plot_series

    try:
        plot_series(
            [
                (
                    f"{r.dtype}: " + ("max abs / (1e-5 max(1,|ref|))" if r.dtype == "float32" else "normwise / 1e-12"),
                    r.rows,
                )
                for r in reports
            ],
            path,
            title=f"{reports[0].model}: jaxattn.models vs transformers, per layer",
            ylabel="error / tolerance",
        )
    except ImportError:
        raise SystemExit(
            'python -m crosscheck: error: --plot needs matplotlib (pip install -e ".[bench]" or pip install matplotlib)'
        ) from None


def finish(reports, *, header: str, data: dict, json_path: str | None, plot_path: str | None, draw, divergence) -> int:
    """What a report command ends with: --json PATH writes `data` (--json alone, PATH "-", prints it instead
    of the tables), else `header` and each report; `draw(reports, plot_path)` with --plot; one stderr line
    `divergence(report)` per failed report; the exit status (1 if any failed)."""
    if json_path is not None:
        text = json.dumps(data, indent=1)
        print(text) if json_path == "-" else Path(json_path).write_text(text + "\n")
    if json_path != "-":
        print(header)
        for report in reports:
            print(report)
    if plot_path:
        draw(reports, plot_path)
    failed = [r for r in reports if not r.passed]
    for report in failed:
        print(divergence(report), file=sys.stderr)
    return 1 if failed else 0


def ported(directory: Path, config: dict, model, params, dtype: str):
    """(model, params) to compare in `dtype` with transformers' model of the directory. A block-FP8 checkpoint:
    transformers decodes it in float32 (the product of FP8 value and scale rounded once, then cast); so in
    float32 our kept FP8 kernels, decoded as each layer is applied, in float32 too (the model at dtype float32:
    its default decodes to bfloat16), and in float64 the params decoded to float32 as they are read (a float64
    decode is exact, and would differ from transformers' by its rounding). Any other checkpoint as loaded."""
    if (config.get("quantization_config") or {}).get("quant_method") != "fp8":
        return model, params
    if dtype == "float32":
        import jax.numpy as jnp

        return model.clone(dtype=jnp.float32), params
    from jaxattn.models import from_pretrained

    return from_pretrained(directory, dtype="float32", precision="highest")


def main(directory: str | None, *, dtypes: Sequence[str] | None, plot_path: str | None, json_path: str | None) -> int:
    from crosscheck._hf.layer_report import LAYER_TOLERANCES, layer_report
    from jaxattn.models import from_pretrained

    if directory is None:
        print("python -m crosscheck: error: --plot needs --model DIR", file=sys.stderr)
        return 2
    directory = Path(directory)
    try:
        model, params = from_pretrained(directory, precision="highest")
        config = json.loads((directory / "config.json").read_text())
        from crosscheck._hf.checkpoints import fp8_reference, torch_model

        torch = torch_model(directory)
        reference = fp8_reference(directory)
    except (OSError, ValueError, ImportError) as error:
        print(f"python -m crosscheck: error: {error}", file=sys.stderr)
        return 2
    inputs = model_inputs(directory, config)
    reports = [
        layer_report(torch, ported(directory, config, model, params, dtype), inputs, dtype=dtype)
        for dtype in (dtypes or tuple(LAYER_TOLERANCES))
    ]
    if "pixel_values" in inputs:
        batch = f"pixel_values {'x'.join(map(str, inputs['pixel_values'].shape))}"
    else:
        batch = (
            f"batch {'x'.join(map(str, inputs['input_ids'].shape))}, {int(inputs['attention_mask'].sum())} real tokens"
        )
    return finish(
        reports,
        header=f"{directory}: {config['model_type']}, {batch}" + (f"; against {reference}" if reference else ""),
        data={
            "model": str(directory),
            "passed": all(r.passed for r in reports),
            "reports": [r.to_dict() for r in reports],
        },
        json_path=json_path,
        plot_path=plot_path,
        draw=plot,
        divergence=lambda r: f"first divergent layer ({r.dtype}): {r.first_divergent}",
    )
