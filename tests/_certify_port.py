"""A small torch model and a hand-written JAX port of it, for tests/test_certify.py. torch is imported only
inside torch_toy: the golden-file test imports this module where torch cannot be imported. The factories are
those of `python -m crosscheck certify --torch tests/_certify_port.py:torch_factory --jax ...:jax_factory`."""

import jax
import jax.numpy as jnp
import numpy as np

B, T, E, F, V = 3, 13, 5, 7, 11  # every axis its own prime size

EPS = 1e-5  # torch.nn.LayerNorm's default, which the torch module uses


def forward(w, x, *, eps=EPS):
    """The port: w {torch name: array} (torch's layouts), x [B,T,E] -> ({"logits": [B,T,V]}, intermediates)."""

    def layer_norm(h):
        mean = h.mean(-1, keepdims=True)
        var = ((h - mean) ** 2).mean(-1, keepdims=True)
        return (h - mean) / jnp.sqrt(var + eps) * w["norm.weight"] + w["norm.bias"]

    proj = jnp.einsum("btd,fd->btf", x, w["proj.weight"]) + w["proj.bias"]
    act = jax.nn.gelu(proj, approximate=False)
    norm = layer_norm(act)
    logits = jnp.einsum("btf,vf->btv", norm, w["head.weight"])
    return {"logits": logits}, {"dense": proj, "gelu": act, "ln": norm, "lm_head": logits}


def port(weights, *, eps=EPS):
    """jax_fn(x [B,T,E]) -> ({"logits": [B,T,V]}, {name: intermediate}); the names are the port's own."""
    w = {k: jnp.asarray(v) for k, v in weights.items()}
    return jax.jit(lambda x: forward(w, x, eps=eps))  # one compile instead of one per eager operation


def flax_tree(weights):
    """The toy's weights as a Flax-style params tree (kernels [in, out]), what params= maps torch names into."""
    return {
        "proj": {"kernel": weights["proj.weight"].T, "bias": weights["proj.bias"]},
        "norm": {"scale": weights["norm.weight"], "bias": weights["norm.bias"]},
        "head": {"kernel": weights["head.weight"].T},
    }


def tree_port(frozen=()):
    """jax_fn(params, x) on flax_tree's layout; the torch names in `frozen` enter as constants (stop_gradient:
    a port that closes over a weight instead of taking it as a parameter), so they never get a gradient."""

    def jax_fn(params, x):
        w = {
            "proj.weight": params["proj"]["kernel"].T,
            "proj.bias": params["proj"]["bias"],
            "norm.weight": params["norm"]["scale"],
            "norm.bias": params["norm"]["bias"],
            "head.weight": params["head"]["kernel"].T,
        }
        return forward({k: jax.lax.stop_gradient(v) if k in frozen else v for k, v in w.items()}, x)

    return jax.jit(jax_fn)


# torch parameter -> its place in flax_tree: a path with a layout transform, a path, a callable on the tree
PARAMS = {
    "proj.weight": ("proj/kernel", np.transpose),
    "proj.bias": "proj/bias",
    "norm.weight": lambda grads: grads["norm"]["scale"],
    "norm.bias": "norm/bias",
    "head.weight": ("head/kernel", np.transpose),
}


LAYERS = {"proj": "dense", "act": "gelu", "norm": "ln", "head": "lm_head"}


def torch_toy(seed=0):
    """(torch module proj -> GELU -> LayerNorm -> head, its state_dict as float64 numpy arrays)."""
    import torch

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(E, F)
            self.act = torch.nn.GELU()
            self.norm = torch.nn.LayerNorm(F)
            self.head = torch.nn.Linear(F, V, bias=False)

        def forward(self, x):
            return {"logits": self.head(self.norm(self.act(self.proj(x))))}

    torch.manual_seed(seed)
    model = Toy()
    with torch.no_grad():
        model.norm.weight.add_(0.3 * torch.randn(F))  # not the identity
        model.norm.bias.add_(0.3 * torch.randn(F))
    return model, {k: v.detach().numpy().astype(np.float64) for k, v in model.state_dict().items()}


def toy_inputs(seed=1):
    return {"x": np.random.default_rng(seed).standard_normal((B, T, E))}


def torch_factory():
    return torch_toy()[0], toy_inputs(), LAYERS


def jax_factory():
    return port(torch_toy()[1]), toy_inputs()


def faulty_jax_factory():
    return port(torch_toy()[1], eps=1e-3), toy_inputs()
