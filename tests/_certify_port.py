"""A hand-written JAX port of tests/test_certify.py's torch module (no torch here: the golden-file test runs it
in a process where torch cannot be imported). Weights: the torch module's state_dict as numpy arrays."""

import jax
import jax.numpy as jnp

EPS = 1e-5  # torch.nn.LayerNorm's default, which the torch module uses


def port(weights, *, eps=EPS):
    """jax_fn(x [B,T,E]) -> ({"logits": [B,T,V]}, {name: intermediate}); the names are the port's own."""
    w = {k: jnp.asarray(v) for k, v in weights.items()}

    def layer_norm(h):
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        return (h - mean) / jnp.sqrt(var + eps) * w["norm.weight"] + w["norm.bias"]

    def jax_fn(x):
        proj = jnp.einsum("btd,fd->btf", x, w["proj.weight"]) + w["proj.bias"]
        act = jax.nn.gelu(proj, approximate=False)
        norm = layer_norm(act)
        logits = jnp.einsum("btf,vf->btv", norm, w["head.weight"])
        return {"logits": logits}, {"dense": proj, "gelu": act, "ln": norm, "lm_head": logits}

    return jax_fn


LAYERS = {"proj": "dense", "act": "gelu", "norm": "ln", "head": "lm_head"}
