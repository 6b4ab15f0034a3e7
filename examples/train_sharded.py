"""Train a ported model on a device mesh: the checkpoint loaded sharded, then AdamW steps under jit.

    python examples/train_sharded.py DIR [--mesh 2x4] [--steps 3]
    python examples/train_sharded.py --demo llama --host-devices 8    # a tiny random Llama on 8 CPU devices

from_pretrained(DIR, mesh=mesh) puts every parameter on the mesh by the family's rules (FSDP over "data",
heads and MLP columns over "model"); the step is the ordinary one, jit-compiled: next-token cross-entropy
on real tokens (padding masked), jax.value_and_grad, an optax AdamW update. XLA gathers each FSDP weight
over "data" where it is used and reduce-scatters its gradient back; the parameters and the optimizer
state stay sharded as the rules say. DIR: a decoder (gpt2, llama, qwen2, mistral, gemma2) or T5 (its
decoder predicts decoder_input_ids shifted by one).
"""

import argparse
import os
import sys
import tempfile


def causal_lm_loss(model, params, batch):
    """Mean next-token cross-entropy over real tokens: logits at t predict targets at t + 1.

    batch: input_ids [B,T] and attention_mask [B,T] (1 = token); T5 also decoder_input_ids [B,Td], whose
    tokens are the targets (every one real). Computed in float32 or wider."""
    import jax
    import jax.numpy as jnp

    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "decoder_input_ids") if k in batch}
    logits = model.apply({"params": params}, **inputs)
    targets = batch.get("decoder_input_ids", batch["input_ids"])
    real = jnp.ones_like(targets) if "decoder_input_ids" in batch else batch["attention_mask"]
    logits = logits[:, :-1].astype(jnp.promote_types(logits.dtype, jnp.float32))
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[:, 1:, None], axis=-1)[..., 0]
    weight = (real[:, 1:] * real[:, :-1]).astype(nll.dtype)  # a real target after a real token
    return jnp.sum(nll * weight) / jnp.sum(weight)


def train_step(model, optimizer):
    """jit(step): (params, opt_state, batch) -> (params, opt_state, loss), one optax update; params and
    optimizer state come out laid out as they went in (the rules' shardings)."""
    import jax
    import optax

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: causal_lm_loss(model, p, batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", nargs="?", help="a transformers save_pretrained directory")
    parser.add_argument(
        "--demo",
        choices=["gpt2", "llama", "qwen2", "mistral", "gemma2", "t5"],
        help="write a tiny random checkpoint of this family (needs torch + transformers)",
    )
    parser.add_argument("--mesh", default=None, help="data x model, e.g. 2x4 (default: all devices over data)")
    parser.add_argument("--host-devices", type=int, default=None, help="CPU only: pretend to have N devices")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    if args.host_devices:  # before JAX starts
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.host_devices}"
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh

    from jaxattn.models import from_pretrained

    directory = args.directory
    if args.demo:
        from crosscheck._hf import checkpoints as _hf_models

        directory = _hf_models.write_checkpoint(args.demo, tempfile.mkdtemp(), vocab_size=128, **DEMO[args.demo])
    if directory is None:
        parser.error("give DIR or --demo FAMILY")
    devices = np.array(jax.devices())
    shape = tuple(int(n) for n in args.mesh.split("x")) if args.mesh else (len(devices), 1)
    mesh = Mesh(devices[: int(np.prod(shape))].reshape(shape), ("data", "model"))
    model, params = from_pretrained(directory, mesh=mesh, dequantize=True)  # trainable (MXFP4 experts decoded)
    optimizer = optax.adamw(1e-3)
    opt_state = jax.jit(optimizer.init)(params)
    step = train_step(model, optimizer)
    rng = np.random.default_rng(0)
    B, T = 2 * shape[0], 16
    ids = rng.integers(1, model.config.vocab_size, (B, T))
    mask = np.ones((B, T), np.int32)
    mask[0, :5] = 0  # a left-padded row
    batch = {"input_ids": ids, "attention_mask": mask}
    if getattr(model, "is_encoder_decoder", False):
        batch["decoder_input_ids"] = rng.integers(1, model.config.vocab_size, (B, 8))
    batch = {k: model.sharding.place(v, "BT") for k, v in batch.items()}  # batch over "data"
    for i in range(args.steps):
        params, opt_state, loss = step(params, opt_state, batch)
        print(f"step {i}: loss {float(loss):.4f}")
    for path, leaf in jax.tree_util.tree_leaves_with_path(params)[:4]:
        print(f"{jax.tree_util.keystr(path)}: {leaf.shape} {leaf.sharding.spec}")


# tiny configs whose heads and widths split over 8 devices (vocab 128; see crosscheck._hf.checkpoints.TINY)
DEMO = {
    "gpt2": dict(n_embd=64, n_head=8),
    "t5": dict(d_model=64, d_kv=8, num_heads=8, d_ff=96),
    **{
        f: dict(hidden_size=64, intermediate_size=96, num_attention_heads=16, num_key_value_heads=8)
        for f in ("llama", "qwen2", "mistral")
    },
    **{
        f: dict(hidden_size=64, intermediate_size=96, num_attention_heads=16, num_key_value_heads=8, head_dim=8)
        for f in ("gemma2", "gemma3_text", "qwen3")
    },
    # mixtures of experts: 8 experts (X splits over "model" by default)
    "mixtral": dict(
        hidden_size=64, intermediate_size=96, num_attention_heads=16, num_key_value_heads=8, num_local_experts=8
    ),
    "gpt_oss": dict(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=8,
        num_local_experts=8,
    ),
    "qwen3_moe": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=8,
        num_experts=8,
    ),
    "llama4_text": dict(
        hidden_size=64,
        intermediate_size=32,
        intermediate_size_mlp=96,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=8,
        num_local_experts=8,
    ),
    # MLA: 8 heads, q latent 32, kv latent 16, rope 4, nope 8, value 8; 8 experts in 2 groups
    "deepseek_v3": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=4,
        qk_nope_head_dim=8,
        v_head_dim=8,
        n_routed_experts=8,
        n_group=2,
        topk_group=1,
        num_experts_per_tok=2,
        n_shared_experts=1,
    ),
    "qwen3_next": dict(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=8,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        num_experts=8,
    ),
}

if __name__ == "__main__":
    sys.exit(main())
