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

`parameter_map` reads a family's table through crosscheck._conversion.param_layout.ParamLayout (the public route,
jaxattn.models.from_state_dict, on numbered entries): each torch parameter is gathered back into torch's layout
from every leaf it fills (GPT-2's c_attn from three kernels), so no per-pair transform is needed. A tied
weight is one torch parameter and one leaf, and its gradient sums both uses on either side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from crosscheck._conversion.param_layout import ParamLayout

# (torch parameter name, pull(JAX grads tree) -> array, transform(torch grad) -> JAX layout or None, JAX label)
ParamPair = tuple[str, Callable[[Any], Any], Callable[[np.ndarray], np.ndarray] | None, str]


def leaf_at(tree: Any, path: str) -> Any:
    """tree["a"]["b"][0] for "a/b/0": mappings by key (a digit string also finds an integer key, as in nnx's
    State of an nnx.List or a list of blocks), sequences by index, other objects by attribute (an nnx Module);
    KeyError naming the path and the children really there."""
    node = tree
    for i, key in enumerate(path.split("/")):
        found, node = _child(node, key)
        if not found:
            where = "/".join(path.split("/")[:i]) or "the root"
            raise KeyError(f"{path!r}: no {key!r} under {where} (there: {_children(node)})") from None
    return node


def _child(node: Any, key: str) -> tuple[bool, Any]:
    """(True, node's child named `key`) or (False, node)."""
    if isinstance(node, Mapping):
        for candidate in (key, int(key)) if key.lstrip("-").isdigit() else (key,):
            if candidate in node:
                return True, node[candidate]
        return False, node
    if isinstance(node, Sequence) and not isinstance(node, str):
        if key.lstrip("-").isdigit() and -len(node) <= int(key) < len(node):
            return True, node[int(key)]
        return False, node
    if not key.startswith("_") and hasattr(node, key) and not hasattr(node, "shape"):
        return True, getattr(node, key)
    return False, node


def _children(node: Any) -> str:
    """What is under a node, as its keys are spelt there: ['attn', 'mlp'], [0, 1] (integer keys), indices
    0..n-1 of a sequence, or the node's type when it has no children."""
    if isinstance(node, Mapping):
        return repr(sorted(node, key=lambda k: (not isinstance(k, int), str(k)))) if node else "nothing"
    if isinstance(node, Sequence) and not isinstance(node, str):
        return f"indices 0..{len(node) - 1} of a {type(node).__name__}" if node else f"an empty {type(node).__name__}"
    return f"a leaf of type {type(node).__name__}"


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
