"""docs/certify.md's TinyLM (a torch language model fed token ids) and its Flax linen port, for the
certificate tests that need integer-only inputs. torch is imported only inside torch_tiny_lm."""

from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

B, T, V, E, F = 3, 29, 53, 16, 37  # E is the docs' width; the others primes


class Port(nn.Module):
    """The port; `cut_mlp_gradient` plants a fault only gradients can see: the MLP branch's value is kept but
    its gradient dropped (stop_gradient), as a port that computed a branch outside the differentiated graph.
    `padding_idx`: torch's Embedding(padding_idx) as jaxattn.models' BERT ports it, the looked-up rows of that
    token held out of the table's gradient by a `where` after the lookup."""

    approximate: bool = False
    eps: float = 1e-5
    cut_mlp_gradient: bool = False
    padding_idx: Optional[int] = None

    @nn.compact
    def __call__(self, input_ids):
        x = nn.Embed(V, E, name="embed")(input_ids)
        if self.padding_idx is not None:
            x = jnp.where((input_ids == self.padding_idx)[..., None], jax.lax.stop_gradient(x), x)
        self.sow("intermediates", "embeddings", x)
        h = nn.LayerNorm(epsilon=self.eps, name="norm")(x)
        h = nn.Dense(E, name="fc2")(nn.gelu(nn.Dense(F, name="fc1")(h), approximate=self.approximate))
        if self.cut_mlp_gradient:
            h = jax.lax.stop_gradient(h)
        self.sow("intermediates", "mlp", h)
        return {"logits": nn.Dense(V, use_bias=False, name="head")(x + h)}


LAYERS = {"embed": "embeddings", "mlp": "mlp"}

GRAD_MAP = {
    "embed.weight": "embed/embedding",
    "norm.weight": "norm/scale",
    "norm.bias": "norm/bias",
    "mlp.0.weight": ("fc1/kernel", np.transpose),
    "mlp.0.bias": "fc1/bias",
    "mlp.2.weight": ("fc2/kernel", np.transpose),
    "mlp.2.bias": "fc2/bias",
    "head.weight": ("head/kernel", np.transpose),
}


def torch_tiny_lm(seed=0, eps=1e-5, padding_idx=None):
    """(the torch model, its weights as the port's params tree, float64 numpy)."""
    import torch

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(V, E, padding_idx=padding_idx)
            self.norm = torch.nn.LayerNorm(E, eps=eps)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(E, F), torch.nn.GELU(), torch.nn.Linear(F, E))
            self.head = torch.nn.Linear(E, V, bias=False)

        def forward(self, input_ids):
            x = self.embed(input_ids)
            x = x + self.mlp(self.norm(x))
            return {"logits": self.head(x)}

    torch.manual_seed(seed)
    model = TinyLM()
    w = {k: v.detach().numpy().astype(np.float64) for k, v in model.state_dict().items()}
    params = {
        "embed": {"embedding": w["embed.weight"]},
        "norm": {"scale": w["norm.weight"], "bias": w["norm.bias"]},
        "fc1": {"kernel": w["mlp.0.weight"].T, "bias": w["mlp.0.bias"]},
        "fc2": {"kernel": w["mlp.2.weight"].T, "bias": w["mlp.2.bias"]},
        "head": {"kernel": w["head.weight"].T},
    }
    return model, params


def port(params, dtype="float32", **options):
    """jax_fn(input_ids) -> (outputs, intermediates), weights cast to `dtype` and closed over."""
    cast = jax.tree.map(lambda a: np.asarray(a, dtype), params)
    return jax.jit(lambda input_ids: Port(**options).apply({"params": cast}, input_ids, mutable=["intermediates"]))


def tree_port(**options):
    """jax_fn(params, input_ids): the port with its parameters an argument, for params= maps."""
    return jax.jit(lambda p, input_ids: Port(**options).apply({"params": p}, input_ids, mutable=["intermediates"]))


def token_ids(seed=0):
    return {"input_ids": np.random.default_rng(seed).integers(0, V, (B, T))}
