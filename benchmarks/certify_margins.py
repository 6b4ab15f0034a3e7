"""How far each planted porting fault lands above certify's bars, against the clean run's distance below them.

    python -m benchmarks.certify_margins [--dtype float32 float64] [--clean] [--unit-scale] [--json PATH]

The faults of crosscheck/_certificates/faults.py in a tiny random Llama (tied head, MiniLM's vocabulary) on 521
tokens of real text, and positions shifted by one in the real all-MiniLM-L6-v2 on its 9 real sentences. Per
fault: the first divergent row (expected: the one named in FAULTS), its normwise error planted / clean (the margin),
the largest per-token KL planted / clean, top-1 agreement. Not a speed measurement: numbers, not seconds.

--unit-scale: the same Llama faults again with the embedding table rescaled to unit variance (the tiny
checkpoint's is ~0.047: a norm epsilon's effect, ~ (its change) / (2 x the mean square), is ~21x smaller at
unit scale), in float64, in float32 against the fixed bar, and in float32 against bars calibrated from torch's own
float64 run (certify(calibrate=...)).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def llama_rows(dtype: str, *, unit: bool = False, calibrate: bool = False, only=None) -> list[dict]:
    import tempfile

    from crosscheck import certify
    from crosscheck._certificates.faults import FAULTS, jax_llama, llama_layers, real_text_ids, write_llama
    from crosscheck._hf.checkpoints import float64_reference, torch_model
    from jaxattn.models import from_pretrained

    directory = write_llama(tempfile.mkdtemp())
    if unit:
        unit_embeddings(directory)
    ids = real_text_ids()
    theirs = torch_model(directory, dtype)
    model, params = from_pretrained(directory, dtype=dtype, precision="highest")
    layers = llama_layers(model.config.num_hidden_layers)

    def torch_fn(input_ids):
        with float64_reference(theirs, dtype):
            return theirs(input_ids=input_ids)

    def torch64(input_ids):  # the second reference run calibrated bars come from
        with float64_reference(theirs, "float64"):
            return theirs(input_ids=input_ids)

    def run(m, p, offset=0):
        return certify(
            torch_fn,
            jax_llama(m, p, offset),
            {"input_ids": ids},
            dtype=dtype,
            layers=layers,
            torch_module=theirs,
            calibrate=torch64 if calibrate else False,
        )

    name = "llama" + ("@unit" if unit else "") + ("+cal" if calibrate else "")
    clean = run(model, params)
    rows = [_row(name, "clean", None, clean, clean)]
    for fault, (plant, expected) in FAULTS.items():
        if only is None or fault in only:
            rows.append(_row(name, fault, expected, run(*plant(model, params)), clean))
    return rows


def unit_embeddings(directory) -> None:
    """Rescale the checkpoint's embedding table (tied: the head too) to unit variance, in place."""
    import numpy as np

    from jaxattn.io import load_safetensors, save_safetensors

    file = directory / "model.safetensors"
    tensors = dict(load_safetensors(file))
    table = np.asarray(tensors["model.embed_tokens.weight"], np.float64)
    tensors["model.embed_tokens.weight"] = (table / table.std()).astype(np.float32)
    save_safetensors(tensors, file)


def minilm_rows(dtype: str) -> list[dict]:
    import numpy as np

    from crosscheck import certify
    from crosscheck._certificates.faults import minilm_jax, minilm_layers, real_tokens
    from crosscheck.cases.minilm import encode, torch_bert

    ids, mask = encode()
    inputs = {"input_ids": ids.astype(np.int64), "attention_mask": mask.astype(np.int64)}
    theirs = torch_bert(dtype)

    def run(offset):
        return certify(
            theirs, minilm_jax(dtype, offset), inputs, dtype=dtype, layers=minilm_layers(6), select=real_tokens(mask)
        )

    clean = run(0)
    return [
        _row("minilm", "clean", None, clean, clean),
        _row("minilm", "positions_shifted", "embeddings", run(1), clean),
    ]


def clean_kl_rows(dtype: str) -> list[dict]:
    """The clean runs LOGIT_BARS' float32 KL bar is set from: four families x two seeds, 521 real tokens."""
    import tempfile

    from crosscheck import certify
    from crosscheck._certificates.faults import real_text_ids
    from crosscheck._hf.checkpoints import float64_reference, torch_model, write_checkpoint
    from crosscheck.cases.minilm import model_dir
    from jaxattn.models import from_pretrained

    ids = real_text_ids()
    vocab = json.loads((model_dir() / "config.json").read_text())["vocab_size"]
    rows = []
    room = {"max_position_embeddings": 1024}
    for model_type, room in (("gpt2", {"n_positions": 1024}), ("qwen2", room), ("qwen3", room), ("llama", room)):
        for seed in (1, 2):
            directory = write_checkpoint(model_type, tempfile.mkdtemp(), vocab_size=vocab, seed=seed, **room)
            theirs = torch_model(directory, dtype)
            model, params = from_pretrained(directory, dtype=dtype, precision="highest")

            def torch_fn(input_ids, theirs=theirs):
                with float64_reference(theirs, dtype):
                    return theirs(input_ids=input_ids)

            def jax_fn(input_ids, model=model, params=params):
                return {"logits": model.apply({"params": params}, input_ids)}

            cert = certify(torch_fn, jax_fn, {"input_ids": ids}, dtype=dtype)
            rows.append(_row(f"{model_type}#{seed}", "clean", None, cert, cert))
    return rows


def _row(model: str, fault: str, expected, cert, clean) -> dict:
    ours, base = {r.name: r for r in cert.rows}, {r.name: r for r in clean.rows}
    measured = [r for r in cert.rows if r.kind in ("layer", "output")]
    where = cert.first_divergent or max(measured, key=lambda r: r.ratio).name  # clean: the row nearest its bar
    kl = ours.get("logits.kl")
    return {
        "model": model,
        "fault": fault,
        "dtype": cert.dtype,
        "passed": cert.passed,
        "first_divergent": cert.first_divergent,
        "expected": expected,
        "row": where,
        "normwise": ours[where].normwise,
        "clean_normwise": base[where].normwise,
        "bar": ours[where].bar,
        "margin": ours[where].normwise / max(base[where].normwise, 1e-300),
        "kl": kl.value if kl else None,
        "clean_kl": base["logits.kl"].value if kl else None,
        "top1": ours["logits.top1"].value if kl else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.certify_margins")
    parser.add_argument("--dtype", nargs="+", default=["float32", "float64"], choices=["float32", "float64"])
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--clean", action="store_true", help="also the 8 clean runs the float32 KL bar is set from")
    parser.add_argument(
        "--unit-scale", action="store_true", help="only the Llama faults at unit scale: float64, float32, calibrated"
    )
    parser.add_argument("--fault", nargs="+", metavar="NAME", help="with --unit-scale: only these Llama faults")
    args = parser.parse_args()
    import jax

    jax.config.update("jax_enable_x64", True)
    if args.unit_scale:
        rows = llama_rows("float64", unit=True, only=args.fault) + llama_rows("float32", unit=True, only=args.fault)
        rows += llama_rows("float32", unit=True, calibrate=True, only=args.fault)
    else:
        rows = [r for dtype in args.dtype for r in llama_rows(dtype) + minilm_rows(dtype)]
    if args.clean:
        rows += [r for dtype in args.dtype for r in clean_kl_rows(dtype)]
    print(
        f"{'model':15} {'fault':18} {'dtype':8} {'first divergent':26} {'normwise':>9} {'clean':>9} {'bar':>7} "
        f"{'margin':>9} {'KL':>9} {'clean KL':>9} {'top1':>5}"
    )
    for r in rows:
        kl = "" if r["kl"] is None else f"{r['kl']:9.2e} {r['clean_kl']:9.2e} {r['top1']:5.3f}"
        print(
            f"{r['model']:15} {r['fault']:18} {r['dtype']:8} {str(r['first_divergent']):26} {r['normwise']:9.2e} "
            f"{r['clean_normwise']:9.2e} {r['bar']:7.0e} {r['margin']:9.2e} {kl}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
