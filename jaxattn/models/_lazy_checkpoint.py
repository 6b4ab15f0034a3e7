"""The checkpoint read lazily: each process reads only the byte regions of its own shards.

Every leaf is made by jax.make_array_from_callback; each process builds only the shards of its own
devices, and for each distinct shard reads only the bytes of that region of the HF tensor
(jaxattn.io.read_region). The table's transforms (jaxattn.models.weights: Transpose, head reshapes,
GPT-2's c_attn Parts) map a box of the leaf to a box of the tensor (Transform.region): a reshape [N*H] ->
[N,H] is read exactly when only the leading letter of the merged axis (N) is split; any other cut of a
merged axis reads the whole merged axis and slices after. Stacked rows (one HF tensor per expert,
jaxattn.models.moe) read only the tensors of the experts in the shard's X range, each for its box.
SwapAxes permutes the box, Part shifts it, and Every(k, n, axis) (gpt-oss's interleaved gate/up columns)
reads the span from the first to the last entry it needs and strides after: that span holds the other
n - 1 interleaved columns too, so for such rows the bytes read are bounded per tensor (never outside the
part of the tensor the shard spans, never a tensor the process holds no shard of), not by the shard's own
bytes.
A shard held by several local devices is read once. Each leaf's spec comes from _partition_rules.Rules.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from .. import io
from .._core import checks
from ._partition_rules import Rules
from .weights import Transform

# --- the checkpoint, read a region at a time ----------------------------------------------------------------


class LazyTensor:
    """A tensor of a safetensors file, known by its header entry; read whole only if converted to an array
    (value checks such as a tied head's copy), else region by region."""

    def __init__(self, file: Path, entry: io.TensorEntry | None):
        self.file, self.entry = file, entry

    @property
    def shape(self):
        return None if self.entry is None else self.entry.shape  # None: its file is missing

    @property
    def dtype(self):
        return self.entry.dtype

    def read(self, box) -> np.ndarray:
        if self.entry is None:
            raise ValueError(f"{self.file}: no such file (a shard file the index lists)")
        return io.read_region(self.file, self.entry, box)

    def __array__(self, dtype=None, copy=None):
        whole = self.read(tuple((0, d) for d in self.shape))
        return whole if dtype is None else whole.astype(dtype)


def lazy_reader(directory):
    """read(file) -> {name: LazyTensor} from its header alone, for _pretrained.read_tensors. A shard file the
    index lists but the directory lacks gives its listed names as tensors whose file is missing (reported
    by the parameter they fill, with its spec and shape)."""
    index = Path(directory) / "model.safetensors.index.json"

    def read(file: Path) -> dict[str, LazyTensor]:
        if file.is_file() or not index.is_file():
            return {name: LazyTensor(file, e) for name, e in io.safetensors_entries(file).items()}
        listed = json.loads(index.read_text())["weight_map"]
        return {name: LazyTensor(file, None) for name, f in listed.items() if f == file.name}

    return read


class ShardedCheckpoint(Mapping):
    """{HF name: LazyTensor} for weights.fill, whose `leaf` builds each params leaf as a sharded jax.Array."""

    def __init__(self, tensors: Mapping[str, LazyTensor], rules: Rules):
        self.tensors, self.rules = dict(tensors), rules

    def __getitem__(self, name):
        return self.tensors[name]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)

    def leaf(self, path: str, names, xs, transform: Transform, shape, dtype, stacked: bool = False) -> jax.Array:
        """The params leaf at `path` as a sharded jax.Array: xs are the row's tensors (one per expert of a
        stacked row, whose leaf leads with their axis X; a shard over X reads only its experts' tensors)."""
        spec = self.rules.spec(path, shape)
        for name, x in zip(names, xs):
            if x.entry is None:
                raise ValueError(
                    f"{path} (spec {spec}, shape {checks.shape_str(shape)}): expected tensor "
                    f"{name!r} from {x.file.name}, got no such file in {x.file.parent}"
                )
        x0 = xs[0]
        out = np.dtype(dtype) if dtype is not None and jnp.issubdtype(x0.dtype, jnp.floating) else x0.dtype
        read = {}  # box -> array: a shard several local devices hold is read once

        def shard(index):
            box = tuple(s.indices(d)[:2] for s, d in zip(index, shape))
            if box not in read:
                got = stacked_region(xs, transform, shape, box) if stacked else region(x0, transform, shape, box)
                read[box] = got.astype(out, copy=False)
            return read[box]

        return jax.make_array_from_callback(tuple(shape), NamedSharding(self.rules.mesh, spec), shard, dtype=out)


# --- a box of a leaf as a box of its HF tensor ---------------------------------------------------------------


def region(x: LazyTensor, transform: Transform, shape, box) -> np.ndarray:
    """leaf[box] for the leaf = transform(x) of `shape`, reading only the box of x it needs
    (Transform.region: the one interpreter of the transforms' steps)."""
    return transform.region(x.read, tuple(x.shape), tuple(shape), box)


def stacked_region(xs, transform: Transform, shape, box) -> np.ndarray:
    """leaf[box] for a stacked row's leaf [X, ...] = stack(transform(x) for x in xs): only the tensors of the
    experts in box[0] are read, each for its box of the rest."""
    (a, b), rest = box[0], box[1:]
    return np.stack([region(xs[j], transform, shape[1:], rest) for j in range(a, b)])
