"""Port a Hugging Face checkpoint directory to JAX and prove it, layer by layer and token by token.

    python examples/port_model.py DIR [--new-tokens 24] [--prompt "Once upon a time"]
    python examples/port_model.py --demo gpt2          # a tiny random GPT-2 written to a temp directory

DIR is what transformers' save_pretrained writes (config.json + model.safetensors, or shards): bert, gpt2,
t5, llama, mistral, qwen2, gemma2, qwen3, gemma3_text, mixtral, gpt_oss, qwen3_moe, llama4_text, deepseek_v3,
qwen3_next and deberta-v2 (jaxattn.models.supported_model_types()). The JAX side loads it
with jaxattn.models.from_pretrained (no torch);
the PyTorch side with transformers (eager attention). Printed: crosscheck.layer_report in float32 and float64 (every
aligned layer: max abs, normwise, pass/fail, the first divergent layer), then, for generative models, a
greedy continuation from both frameworks side by side.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

import crosscheck
from jaxattn.models import from_pretrained, generate, supported_model_types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
jax.config.update("jax_enable_x64", True)  # the float64 report needs it; float32 runs pass float32 arrays

PROMPTS = ("The quick brown fox", "Once upon a time, in a small village,", "Hi!")


ENCODERS = ("bert", "deberta-v2")  # no continuation to compare


def _torch_model(directory: Path, config: dict):
    import transformers

    auto = {"bert": transformers.AutoModel, "t5": transformers.AutoModelForSeq2SeqLM}
    if config["model_type"] == "deberta-v2":  # the head config.json names (masked LM, classifier or none)
        auto["deberta-v2"] = getattr(transformers, config["architectures"][0])
    cls = auto.get(config["model_type"], transformers.AutoModelForCausalLM)
    return cls.from_pretrained(str(directory), attn_implementation="eager", local_files_only=True).eval()


def _batch(directory: Path, config: dict, prompts):
    """Token ids of the prompts with the directory's tokenizer (left-padded for decoders), or random ids."""
    side = "right" if config["model_type"] in (*ENCODERS, "t5") else "left"
    pad = config.get("pad_token_id") or 0
    if (directory / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        tokenizer.no_truncation()
        tokenizer.enable_padding(pad_id=pad, direction=side)
        encoded = tokenizer.encode_batch(list(prompts))
        return (
            np.array([e.ids for e in encoded]),
            np.array([e.attention_mask for e in encoded]),
            lambda ids: tokenizer.decode(list(map(int, ids))),
        )
    rng = np.random.default_rng(0)
    lengths = [9, 5, 7][: len(prompts)]
    T = max(lengths)
    ids = rng.integers(1, config["vocab_size"], (len(lengths), T))
    mask = np.array([[int(t >= T - n) if side == "left" else int(t < n) for t in range(T)] for n in lengths])
    return np.where(mask == 1, ids, pad), mask, lambda ids: " ".join(map(str, ids))


def main(directory, *, new_tokens: int = 24, prompts=PROMPTS) -> dict:
    import torch

    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    model, params = from_pretrained(directory, precision="highest")
    torch_model = _torch_model(directory, config)
    ids, mask, decode = _batch(directory, config, prompts)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if config["model_type"] == "t5":
        inputs["decoder_input_ids"] = np.zeros((len(ids), 1), np.int64)  # the decoder's start token
    reports = [crosscheck.layer_report(torch_model, (model, params), inputs, dtype=d) for d in ("float32", "float64")]
    for report in reports:
        print(report, end="\n\n")
    result = {"reports": reports, "ours": None, "theirs": None}
    if config["model_type"] in ENCODERS:
        print("(an encoder: no continuation to compare)")
        return result
    torch_model.float()
    torch_model.generation_config.eos_token_id = None  # both sides produce exactly new_tokens
    torch_model.generation_config.pad_token_id = config.get("pad_token_id") or 0
    ours = generate(
        model,
        jax.tree.map(lambda x: np.asarray(x, np.float32), params),
        ids,
        max_new_tokens=new_tokens,
        attention_mask=mask,
    )
    with torch.no_grad():
        theirs = torch_model.generate(
            torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=new_tokens, do_sample=False
        ).numpy()
    print(f"greedy continuation, {new_tokens} new tokens (float32), jaxattn | PyTorch:")
    for row, (a, b) in enumerate(zip(ours[:, -new_tokens:], theirs[:, -new_tokens:])):
        same = "same" if np.array_equal(a, b) else "DIFFERENT"
        print(f"  [{row}] {same}\n      jaxattn: {decode(a)}\n      PyTorch: {decode(b)}")
    result.update(ours=ours, theirs=theirs)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("directory", nargs="?", help="a save_pretrained directory")
    parser.add_argument(
        "--demo",
        choices=[t for t in supported_model_types() if t != "bert"],  # (BERT: a DIR of its own)
        help="write a tiny random checkpoint and port it",
    )
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    if bool(args.directory) == bool(args.demo):
        parser.error("give a DIR or --demo MODEL_TYPE")
    if args.demo:
        with tempfile.TemporaryDirectory() as tmp:
            crosscheck.write_random_checkpoint(args.demo, tmp)
            outcome = main(tmp, new_tokens=args.new_tokens)
    else:
        outcome = main(args.directory, new_tokens=args.new_tokens)
    sys.exit(0 if all(r.passed for r in outcome["reports"]) else 1)
