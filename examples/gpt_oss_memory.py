"""Parameter bytes of gpt-oss-20b and -120b, MXFP4 experts kept packed against the bf16 load, from shapes alone.

    python examples/gpt_oss_memory.py [--model-axis 8]

No download and no weights: the released configs' shapes (below), the model's params by jax.eval_shape of its
init, each leaf at the bytes from_pretrained gives it (floating: bf16, as the files and the dequantized load;
the packed kernel_blocks / kernel_scales: uint8), and per device on a mesh whose "model" axis has
--model-axis devices, each leaf divided as gpt-oss's partition rules lay it out (experts split by expert).
"""

import argparse
import fnmatch
import math

import jax
import jax.numpy as jnp

from jaxattn.models import GptOssConfig, GptOssForCausalLM, partition_rules

# the released config.json values that set the parameter shapes (huggingface.co/openai/gpt-oss-20b, -120b)
SHAPES = {
    "gpt-oss-20b": dict(num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": dict(num_hidden_layers=36, num_local_experts=128),
}
COMMON = dict(
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
MXFP4 = {"quant_method": "mxfp4"}


def leaves(config: dict) -> dict[str, jax.ShapeDtypeStruct]:
    """{"a/b/c": shape and dtype} of the model's params for `config`, abstractly."""
    parsed = GptOssConfig.from_dict(config)
    shapes = jax.eval_shape(
        lambda: GptOssForCausalLM(parsed).init(jax.random.key(0), jnp.zeros((1, 4), jnp.int32))["params"]
    )
    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    return {"/".join(k.key for k in path): leaf for path, leaf in flat}


def nbytes(leaf, parts: int = 1) -> int:
    itemsize = 1 if leaf.dtype == jnp.uint8 else 2  # floating leaves as bf16
    return math.prod(leaf.shape) * itemsize // parts


def per_device(path: str, leaf, model_axis: int) -> int:
    """The leaf's bytes on one device of a (data=1, model=model_axis) mesh, as the family's rules split it."""
    spec = next(s for pattern, s in partition_rules("gpt_oss") if fnmatch.fnmatchcase(path, pattern))
    parts = math.prod(
        model_axis for entry in spec if entry == "model" or (isinstance(entry, tuple) and "model" in entry)
    )
    return nbytes(leaf, parts)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-axis", type=int, default=8)
    args = parser.parse_args()
    print(f"| model | load | params (GB, one device) | per device, model axis {args.model_axis} (GB) |")
    print("|---|---|---:|---:|")
    for name, shape in SHAPES.items():
        for load, extra in (
            ("bf16 (dequantize=True)", {}),
            ("MXFP4 experts packed (default)", {"quantization_config": MXFP4}),
        ):
            params = leaves({**COMMON, **shape, **extra})
            total = sum(nbytes(x) for x in params.values())
            device = sum(per_device(p, x, args.model_axis) for p, x in params.items())
            print(f"| {name} | {load} | {total / 1e9:.1f} | {device / 1e9:.1f} |")


if __name__ == "__main__":
    main()
