"""Parameter bytes of the quantized releases, kept quantized against the bf16 load, from shapes alone: gpt-oss-20b
and -120b (MXFP4 experts packed), Qwen3-8B-FP8, Qwen3-32B-FP8, Qwen3-30B-A3B-FP8 and DeepSeek-V3 (block-FP8 kernels
kept).

    python examples/quantized_memory.py [--model-axis 8]

No download and no weights: the released configs' shapes (below), the model's params by jax.eval_shape of its
init, each leaf at the bytes from_pretrained gives it (packed MXFP4 kernel_blocks / kernel_scales: uint8; kept
kernel_fp8: 1 byte a value and kernel_scale_inv float32, one per [128, 128] block; every other floating leaf bf16,
as the files and the dequantized load), and per device on a mesh whose "model" axis has --model-axis devices, each
leaf divided as the family's partition rules lay it out (experts split by expert, dense FP8 scales whole).
"""

import argparse
import fnmatch
import math

import jax
import jax.numpy as jnp

from jaxattn.models import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    partition_rules,
)

FAMILIES = {
    "gpt_oss": (GptOssConfig, GptOssForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM),
}
MXFP4 = {"quant_method": "mxfp4"}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
GPT_OSS = dict(
    model_type="gpt_oss",
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_experts_per_tok=4,
    sliding_window=128,
    tie_word_embeddings=False,
)
QWEN3 = dict(model_type="qwen3", vocab_size=151936, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
# name: (the released config.json values that set the parameter shapes, its quantization, how it is kept);
# huggingface.co/openai/gpt-oss-20b, -120b; huggingface.co/Qwen/Qwen3-8B-FP8, -32B-FP8, -30B-A3B-FP8;
# huggingface.co/deepseek-ai/DeepSeek-V3 (its multi-token-prediction layer, which from_pretrained skips, not counted)
MODELS = {
    "gpt-oss-20b": ({**GPT_OSS, "num_hidden_layers": 24, "num_local_experts": 32}, MXFP4, "MXFP4 experts packed"),
    "gpt-oss-120b": ({**GPT_OSS, "num_hidden_layers": 36, "num_local_experts": 128}, MXFP4, "MXFP4 experts packed"),
    "Qwen3-8B-FP8": (
        {**QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32},
        FP8,
        "FP8 kernels kept",
    ),
    "Qwen3-32B-FP8": (
        {**QWEN3, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64, "num_attention_heads": 64},
        FP8,
        "FP8 kernels kept",
    ),
    "Qwen3-30B-A3B-FP8": (
        {
            **QWEN3,
            "model_type": "qwen3_moe",
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "num_experts": 128,
            "num_experts_per_tok": 8,
        },
        FP8,
        "FP8 kernels kept",
    ),
    "DeepSeek-V3": (
        {
            "model_type": "deepseek_v3",
            "vocab_size": 129280,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_hidden_layers": 61,
            "first_k_dense_replace": 3,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "q_lora_rank": 1536,
            "kv_lora_rank": 512,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "n_group": 8,
            "topk_group": 4,
            "tie_word_embeddings": False,
        },
        FP8,
        "FP8 kernels kept",
    ),
}


def leaves(config: dict) -> dict[str, jax.ShapeDtypeStruct]:
    """{"a/b/c": shape and dtype} of the model's params for `config`, abstractly."""
    config_class, model_class = FAMILIES[config["model_type"]]
    parsed = config_class.from_dict(config)
    shapes = jax.eval_shape(lambda: model_class(parsed).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    return {"/".join(k.key for k in path): leaf for path, leaf in flat}


def nbytes(path: str, leaf, parts: int = 1) -> int:
    """Packed and float8 values 1 byte, FP8 scales float32 (as stored), every other leaf bf16 (init: float32)."""
    packed = leaf.dtype in (jnp.uint8, jnp.float8_e4m3fn)
    itemsize = 1 if packed else 4 if path.endswith("kernel_scale_inv") else 2
    return math.prod(leaf.shape) * itemsize // parts


def per_device(family: str, path: str, leaf, model_axis: int) -> int:
    """The leaf's bytes on one device of a (data=1, model=model_axis) mesh, as the family's rules split it."""
    spec = next(s for pattern, s in partition_rules(family) if fnmatch.fnmatchcase(path, pattern))
    parts = math.prod(
        model_axis for entry in spec if entry == "model" or (isinstance(entry, tuple) and "model" in entry)
    )
    return nbytes(path, leaf, parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-axis", type=int, default=8)
    args = parser.parse_args()
    print(f"| model | load | params (GB, one device) | per device, model axis {args.model_axis} (GB) |")
    print("|---|---|---:|---:|")
    for name, (config, quantization, kept) in MODELS.items():
        loads = (("bf16 (dequantize=True)", {}), (f"{kept} (default)", {"quantization_config": quantization}))
        for load, extra in loads:
            params = leaves({**config, **extra})
            total = sum(nbytes(p, x) for p, x in params.items())
            device = sum(per_device(config["model_type"], p, x, args.model_axis) for p, x in params.items())
            print(f"| {name} | {load} | {total / 1e9:.1f} | {device / 1e9:.1f} |")


if __name__ == "__main__":
    main()
