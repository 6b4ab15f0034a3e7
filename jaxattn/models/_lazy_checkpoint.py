"""The checkpoint read lazily: each process reads only the byte regions of its own shards.

Every leaf is made by jax.make_array_from_callback; each process builds only the shards of its own
devices, and for each distinct shard reads only the bytes of that region of the HF tensor
(jaxattn.io.read_region). The table's transforms (transpose, head reshapes, GPT-2's c_attn parts) map a
box of the leaf to a box of the tensor: a reshape [N*H] -> [N,H] is read exactly when only the leading
letter of the merged axis (N) is split; any other cut of a merged axis reads the whole merged axis and
slices after. Stacked rows (one HF tensor per expert, jaxattn.models.moe) read only the tensors of the
experts in the shard's X range, each for its box. The newer steps map too: ("swapaxes", a, b) permutes
the box, ("part", ...) shifts it, and ("every", k, n, axis) (gpt-oss's interleaved gate/up columns) reads
the span from the first to the last entry it needs and strides after: that span holds the other n - 1
interleaved columns too, so for such rows the bytes read are bounded per tensor (never outside the part of
the tensor the shard spans, never a tensor the process holds no shard of), not by the shard's own bytes.
A shard held by several local devices is read once. Each leaf's spec comes from _partition_rules.Rules.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from .. import io
from .._core import checks
from ._partition_rules import Rules

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
    """{HF name: LazyTensor} for _table.fill, whose `leaf` builds each params leaf as a sharded jax.Array."""

    def __init__(self, tensors: Mapping[str, LazyTensor], rules: Rules):
        self.tensors, self.rules = dict(tensors), rules

    def __getitem__(self, name):
        return self.tensors[name]

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self):
        return len(self.tensors)

    def leaf(self, path: str, names, xs, transform, shape, dtype, stacked: bool = False) -> jax.Array:
        """The params leaf at `path` as a sharded jax.Array: xs are the row's tensors (one per expert of a
        stacked row, whose leaf leads with their axis X; a shard over X reads only its experts' tensors)."""
        spec = self.rules.spec(path, shape)
        for name, x in zip(names, xs):
            if x.entry is None:
                raise ValueError(f"{path} (spec {spec}, shape {checks.shape_str(shape)}): expected tensor "
                                 f"{name!r} from {x.file.name}, got no such file in {x.file.parent}")
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

def stacked_region(xs, transform, shape, box) -> np.ndarray:
    """leaf[box] for a stacked row's leaf [X, ...] = stack(transform(x) for x in xs): only the tensors of the
    experts in box[0] are read, each for its box of the rest."""
    (a, b), rest = box[0], box[1:]
    return np.stack([region(xs[j], transform, shape[1:], rest) for j in range(a, b)])


def _kind(step) -> str:
    return step[0] if isinstance(step, tuple) else step


def region(x: LazyTensor, transform, shape, box) -> np.ndarray:
    """leaf[box] for the leaf = transform(x) of `shape` (the _table transforms), reading only what it needs.

    A transform is steps (_table: "transpose"/"T_reshape", ("swapaxes", a, b), ("part", k, n, axis),
    ("every", k, n, axis), or a list of them) giving y, then a reshape of y to `shape` that splits each of
    y's axes into consecutive leaf axes (a group). A box whose cut of a group is on its first axis only is
    one range of y's axis; a group cut elsewhere is read whole (then sliced), and so is a reshape that is no
    split. The range of y is then carried back through the steps to a box of x: permutations move it,
    "part" shifts it, and "every" (entries k, k + n, ...) maps it to the span from its first to its last
    entry, read whole and strided after (it holds the other n - 1 interleaved slices too: gpt-oss's gate
    columns read their up columns, which the same shard's up_proj reads as well). So every read is one box
    of x, never more than the span the shard's entries cover.
    """
    steps = transform if isinstance(transform, list) else [transform]
    shapes = [tuple(x.shape)]  # the shape before each step, and after the last
    for step in steps:
        kind, y = _kind(step), list(shapes[-1])
        if kind in ("transpose", "T_reshape"):
            y = y[::-1]
        elif kind == "swapaxes":
            y[step[1]], y[step[2]] = y[step[2]], y[step[1]]
        elif kind == "part":
            y[step[3]] //= step[2]
        elif kind == "every":
            y[step[3]] = len(range(step[1], y[step[3]], step[2]))
        elif kind not in ("copy", "reshape"):
            raise ValueError(f"region: unknown table transform step {step!r}")
        shapes.append(tuple(y))
    y_shape = shapes[-1]
    groups = _groups(y_shape, shape)
    if groups is None:
        wide, y_box = [(0, d) for d in shape], [(0, d) for d in y_shape]
    else:
        wide = [(0, shape[a]) if any(box[b] != (0, shape[b]) for b in g[1:]) else box[a] for g in groups for a in g]
        inner = [math.prod(shape[a] for a in g[1:]) for g in groups]
        y_box = [(wide[g[0]][0] * m, wide[g[0]][1] * m) for g, m in zip(groups, inner)]
    # back through the steps: per axis of each step's input, (start, stop, stride) of the entries needed
    cut = [(a, b, 1) for a, b in y_box]
    for step, after in zip(steps[::-1], shapes[:0:-1]):
        kind = _kind(step)
        if kind in ("transpose", "T_reshape"):
            cut = cut[::-1]
        elif kind == "swapaxes":
            cut[step[1]], cut[step[2]] = cut[step[2]], cut[step[1]]
        elif kind == "part":
            k, axis = step[1], step[3]
            a, b, st = cut[axis]
            cut[axis] = (a + k * after[axis], b + k * after[axis], st)
        elif kind == "every":
            k, n, axis = step[1:]
            a, b, st = cut[axis]
            cut[axis] = (k + n * a, k + n * (b - 1) + 1, st * n) if b > a else (0, 0, 1)
    block = x.read([(a, b) for a, b, _ in cut])
    block = block[tuple(slice(None, None, st) for _, _, st in cut)]
    for step in steps:  # the permutations forward ("part" and "every" are in the box and strides already)
        kind = _kind(step)
        if kind in ("transpose", "T_reshape"):
            block = block.T
        elif kind == "swapaxes":
            block = np.swapaxes(block, step[1], step[2])
    block = block.reshape([b - a for a, b in wide])
    return np.ascontiguousarray(block[tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(box, wide))])


def _groups(y_shape, shape) -> list[list[int]] | None:
    """The consecutive leaf axes each of y's axes splits into (size-1 leaf axes at the end join the last
    group), or None if reshaping y_shape to shape is not such a split."""
    groups, i = [], 0
    for d in y_shape:
        group, size = [], 1
        while i < len(shape) and (not group or size < d):
            group.append(i)
            size *= shape[i]
            i += 1
        if size != d or not group:
            return None
        groups.append(group)
    while groups and i < len(shape) and shape[i] == 1:
        groups[-1].append(i)
        i += 1
    return groups if i == len(shape) else None
