"""Parameter bytes of Qwen3-8B-FP8, Qwen3-32B-FP8 and Qwen3-30B-A3B-FP8, block-FP8 kernels kept against the bf16
load, from shapes alone.

    python examples/qwen3_fp8_memory.py [--model-axis 8]

No download and no weights: the released configs' shapes (below), the model's params by jax.eval_shape of its
init, each leaf at the bytes from_pretrained gives it (the kept kernel_fp8: 1 byte a value, kernel_scale_inv:
float32, one per [128, 128] block; every other floating leaf bf16, as the files and the dequantized load), and
per device on a mesh whose "model" axis has --model-axis devices, each leaf divided as the family's partition
rules lay it out (the dense kernels' scales whole on every device, the experts' split by expert).
"""

import argparse
import fnmatch
import math

import jax
import jax.numpy as jnp

from jaxattn.models import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM, partition_rules

# the released config.json values that set the parameter shapes (huggingface.co/Qwen/Qwen3-8B-FP8, -32B-FP8,
# -30B-A3B-FP8)
SHAPES = {
    "Qwen3-8B-FP8": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32),
    "Qwen3-32B-FP8": dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64),
    "Qwen3-30B-A3B-FP8": dict(
        model_type="qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        num_experts=128,
        num_experts_per_tok=8,
    ),
}
COMMON = dict(model_type="qwen3", vocab_size=151936, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
FAMILIES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM)}
FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def leaves(config: dict) -> dict[str, jax.ShapeDtypeStruct]:
    """{"a/b/c": shape and dtype} of the model's params for `config`, abstractly."""
    config_class, model_class = FAMILIES[config["model_type"]]
    parsed = config_class.from_dict(config)
    shapes = jax.eval_shape(lambda: model_class(parsed).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"])
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    return {"/".join(k.key for k in path): leaf for path, leaf in flat}


def nbytes(path: str, leaf, parts: int = 1) -> int:
    """float8 values 1 byte, their scales float32 (as stored), every other leaf bf16 (init makes them float32)."""
    itemsize = 1 if leaf.dtype == jnp.float8_e4m3fn else 4 if path.endswith("kernel_scale_inv") else 2
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
    for name, shape in SHAPES.items():
        for load, extra in (
            ("bf16 (dequantize=True)", {}),
            ("FP8 kernels kept (default)", {"quantization_config": FP8}),
        ):
            params = leaves({**COMMON, **shape, **extra})
            total = sum(nbytes(p, x) for p, x in params.items())
            family = shape.get("model_type", COMMON["model_type"])
            device = sum(per_device(family, p, x, args.model_axis) for p, x in params.items())
            print(f"| {name} | {load} | {total / 1e9:.1f} | {device / 1e9:.1f} |")


if __name__ == "__main__":
    main()
