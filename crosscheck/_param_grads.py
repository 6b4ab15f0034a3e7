"""Parameter gradients in a certificate: which JAX leaf each torch parameter's gradient is compared with.

    certify(torch_model, jax_fn, inputs, grads=True, jax_params=tree, params={
        "model.embed_tokens.weight": "embed/embedding",                      # a path in the JAX tree ("/")
        "lm_head.weight": ("lm_head/kernel", lambda g: g.T),                 # with torch -> JAX layout
        "model.norm.weight": lambda grads: grads["norm"]["scale"],           # or a callable pulling it
    })
    certify(..., params=parameter_map(torch_model, tree))   # a jaxattn.models family: through its weight table

A pair compares d loss / d (torch parameter), transformed to JAX's layout when a transform is given, with the
JAX leaf's d loss / d leaf. Both are the same numbers when the leaf is the parameter up to a permutation or a
reshape (every weight table's transform), because a gradient moves with its entries.

`parameter_map` reads a family's table through crosscheck._param_layout.ParamLayout (the public route,
jaxattn.models.from_state_dict, on numbered entries): each torch parameter is gathered back into torch's layout
from every leaf it fills (GPT-2's c_attn from three kernels), so no per-pair transform is needed. A tied
weight is one torch parameter and one leaf, and its gradient sums both uses on either side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from crosscheck._param_layout import ParamLayout

# (torch parameter name, pull(JAX grads tree) -> array, transform(torch grad) -> JAX layout or None, JAX label)
ParamPair = tuple[str, Callable[[Any], Any], Callable[[np.ndarray], np.ndarray] | None, str]


def leaf_at(tree: Any, path: str) -> Any:
    """tree["a"]["b"][0] for "a/b/0" (mappings by key, sequences by index); KeyError naming the path."""
    node = tree
    for i, key in enumerate(path.split("/")):
        try:
            node = node[int(key)] if isinstance(node, (list, tuple)) else node[key]
        except (KeyError, IndexError, ValueError, TypeError):
            where = "/".join(path.split("/")[:i]) or "the root"
            have = sorted(map(str, node)) if isinstance(node, Mapping) else type(node).__name__
            raise KeyError(f"{path!r}: no {key!r} under {where} (there: {have})") from None
    return node


def param_pairs(params: Mapping[str, Any] | None) -> list[ParamPair]:
    """certify's `params=` map -> [(torch name, pull, transform, label)], in the map's order."""
    pairs: list[ParamPair] = []
    for name, target in (params or {}).items():
        target, transform = target if isinstance(target, tuple) else (target, None)
        if not isinstance(name, str) or not (isinstance(target, str) or callable(target)):
            raise ValueError(
                f"params: expected {{torch parameter name: JAX path, callable or (either, transform)}}, "
                f"got {name!r}: {target!r}"
            )
        if isinstance(target, str):
            pairs.append((name, _path_pull(target), transform, target))
        else:
            pairs.append((name, target, transform, str(getattr(target, "label", getattr(target, "__name__", "")))))
    return pairs


def _path_pull(path: str) -> Callable[[Any], Any]:
    def pull(tree):
        try:
            return leaf_at(tree, path)
        except KeyError as error:
            raise ValueError(f"params: JAX path {error.args[0]}") from None

    return pull


@dataclasses.dataclass(frozen=True)
class FromLayout:
    """Pulls one torch parameter, in torch's layout, out of a tree shaped like a family's params."""

    layout: ParamLayout
    name: str

    def __call__(self, tree) -> np.ndarray:
        return self.layout.to_torch(tree, (self.name,))[self.name]

    @property
    def label(self) -> str:
        return "+".join(leaf.path for leaf in self.layout.leaves if leaf.name == self.name)


def parameter_map(torch_model, params) -> dict[str, FromLayout]:
    """certify's `params=` for a jaxattn.models family: every torch parameter (named_parameters() order) ->
    its gradient gathered from the JAX gradient tree through the family's weight table.

    torch_model: the transformers model of the checkpoint; params: the tree jaxattn.models loads from it
    (its structure and shapes are checked). The JAX column of each row names the leaves it comes from."""
    layout = ParamLayout.of(torch_model, params)
    return {name: FromLayout(layout, name) for name in layout.names}
