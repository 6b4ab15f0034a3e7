"""`ParamLayout`: which elements of which torch parameter fill each leaf of a jaxattn.models params tree.

The families' weight tables (jaxattn.models) map a torch state_dict to our params by copies, transposes,
reshapes and splits: every JAX element is exactly one torch element. `ParamLayout.of(torch_model, params)`
reads that permutation through the public route, `jaxattn.models.from_state_dict`, once: it converts a
state_dict whose entries are their own element numbers (parameter k holds offset_k + arange(numel_k)), so
each converted leaf lists, element by element, where it came from. It then checks that the leaves hold
every element exactly once (a table that summed or dropped entries would not be a permutation, and is
refused) and that the tree has the structure and shapes of the params it will be compared with.

With it, anything shaped like the params (parameters, gradients, optimizer labels) converts both ways
exactly: `to_torch(tree)` gives {torch name: array in torch's layout}, `to_jax({name: array})` the tree.
Tied weights are one torch parameter (named_parameters() lists a tied tensor once) and one JAX leaf.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class _Leaf:
    name: str  # the torch parameter it comes from
    index: np.ndarray  # int64, the leaf's shape: flat positions in that torch parameter
    path: str  # "h_0/attn/query/kernel"


@dataclasses.dataclass(frozen=True)
class ParamLayout:
    names: tuple[str, ...]  # torch parameter names, named_parameters() order
    shapes: Mapping[str, tuple[int, ...]]  # torch shapes
    leaves: tuple[_Leaf, ...]  # our leaves, in jax.tree flatten order
    treedef: Any

    @classmethod
    def of(cls, torch_model, params) -> ParamLayout:
        """The layout of `torch_model` (a transformers model of a jaxattn.models family) against `params`."""
        import jax

        from jaxattn.models import from_state_dict

        named = list(torch_model.named_parameters())
        shapes = {name: tuple(p.shape) for name, p in named}
        offsets = np.cumsum([0] + [p.numel() for _, p in named])
        probe = {
            name: np.arange(offsets[k], offsets[k + 1], dtype=np.int64).reshape(shapes[name])
            for k, name in enumerate(shapes)
        }
        _, numbered = from_state_dict(torch_model.config.to_dict(), probe)
        flat, treedef = jax.tree_util.tree_flatten_with_path(numbered)
        theirs, their_def = jax.tree_util.tree_flatten_with_path(params)
        if their_def != treedef or any(np.shape(a) != np.shape(b) for (_, a), (_, b) in zip(flat, theirs)):
            raise ValueError(
                f"params: expected the tree jaxattn.models builds for {type(torch_model).__name__} "
                f"({_describe(flat)}), got {_describe(theirs)}"
            )
        seen = np.sort(np.concatenate([np.asarray(leaf).ravel() for _, leaf in flat]))
        if not np.array_equal(seen, np.arange(offsets[-1])):
            raise ValueError(
                f"torch_model: the weight table of {torch_model.config.model_type!r} is not a "
                f"permutation of the torch parameters ({seen.size} elements for {offsets[-1]}): "
                f"parameters cannot be compared element by element"
            )
        leaves = []
        for path, leaf in flat:
            leaf = np.asarray(leaf)
            k = int(np.searchsorted(offsets, leaf.flat[0], side="right")) - 1
            if leaf.min() < offsets[k] or leaf.max() >= offsets[k + 1]:
                raise ValueError(f"torch_model: leaf {_path(path)} mixes elements of several torch parameters")
            leaves.append(_Leaf(named[k][0], leaf - offsets[k], _path(path)))
        return cls(tuple(shapes), shapes, tuple(leaves), treedef)

    def to_jax(self, tensors: Mapping[str, Any]):
        """{torch name: array in torch's layout} -> a tree shaped like the params (values copied)."""
        import jax

        flat = {name: np.asarray(tensors[name]).reshape(-1) for name in self.names}
        return jax.tree_util.tree_unflatten(self.treedef, [flat[leaf.name][leaf.index] for leaf in self.leaves])

    def to_torch(self, tree, names=None) -> dict[str, np.ndarray]:
        """A tree shaped like the params -> {torch name: numpy array in torch's layout} (only `names`, if given)."""
        import jax

        values = jax.tree_util.tree_leaves(tree)
        if len(values) != len(self.leaves):
            raise ValueError(f"tree: expected {len(self.leaves)} leaves (the params' structure), got {len(values)}")
        wanted = self.names if names is None else tuple(names)
        out: dict[str, np.ndarray] = {}
        for leaf, value in zip(self.leaves, values):
            if leaf.name not in wanted:
                continue
            value = np.asarray(value)
            target = out.setdefault(leaf.name, np.empty(int(np.prod(self.shapes[leaf.name])), value.dtype))
            target[leaf.index.reshape(-1)] = value.reshape(-1)
        return {name: out[name].reshape(self.shapes[name]) for name in wanted}

    def kept(self, excluded: set[int]) -> dict[str, np.ndarray]:
        """{torch name: bool array in torch's layout}: False on the elements of the excluded leaves (indices
        into `leaves`), True elsewhere."""
        keep = {name: np.ones(int(np.prod(self.shapes[name])), bool) for name in self.names}
        for i in excluded:
            keep[self.leaves[i].name][self.leaves[i].index.reshape(-1)] = False
        return {name: keep[name].reshape(self.shapes[name]) for name in self.names}

    def labels(self, label: Callable[[str], Any]):
        """A tree shaped like the params whose leaves are label(torch name of the leaf)."""
        import jax

        return jax.tree_util.tree_unflatten(self.treedef, [label(leaf.name) for leaf in self.leaves])


def layer_of(name: str) -> str:
    """ "model.layers.3.mlp.up_proj.weight" -> "layer3"; "transformer.wte.weight" -> "wte" (no layer index);
    "decoder.block.1.layer.0.SelfAttention.q.weight" -> "decoder.layer1"."""
    stack = name.split(".")[0] + "." if name.startswith(("encoder.", "decoder.")) else ""  # T5's two stacks
    match = re.search(r"\.(\d+)\.", name)
    if match:
        return f"{stack}layer{match.group(1)}"
    parts = [p for p in name.split(".") if p not in ("model", "transformer", "weight", "bias")]
    return parts[0] if parts else name


def _path(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _describe(flat) -> str:
    return (
        f"{len(flat)} leaves: "
        + ", ".join(f"{_path(p)} {list(np.shape(x))}" for p, x in flat[:4])
        + (", ..." if len(flat) > 4 else "")
    )
