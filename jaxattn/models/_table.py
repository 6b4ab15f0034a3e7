"""Weight-name tables: HF checkpoint tensors -> a Flax params tree, one explicit row per tensor.

The one table format of every family (BERT included), and its one filler. A row names one HF tensor
literally ("{i}" = layer index: "model.layers.{i}.self_attn.q_proj.weight", never assembled from pieces, so
every name can be grepped), its shape in axis letters, and the params leaves it fills: each target is (our
path, our shape in letters, transform). Letters are the family's dims (e.g. E, N, H, F, V); "3*E"
multiplies, digits are literals. A row is the single description of its tensor, and every transform is a
permutation, reshape or split, so the table reads in reverse too (params -> checkpoint). `fill` checks the
checkpoint against the table before any array is touched: missing and unexpected names are listed by name,
every shape is checked, and each error names the file that holds the tensor, the tensor's key and both
shapes.

Building a table: `when` keeps the rows a configuration has (biases, an untied head), `expand` repeats the
"{i}" rows per layer in HF's state_dict order, `prefixed` puts the names inside a task head's prefix.

`unfill` reads the same rows in reverse (jaxattn.models.to_pretrained): each HF tensor is made from the
params leaves its row names, by each transform's inverse; the "part" targets of one row are put back side by
side along their axis (GPT-2's q, k and v kernels -> c_attn). A leaf no row reads, a row's leaf that is
missing and a leaf of the wrong shape are ValueErrors naming the leaf. A family therefore writes
checkpoints with no second map: its table (with the configuration's `when` rows) is the whole description.

Transforms (numpy, on the tensor's HF layout):
    copy        as stored
    transpose   torch nn.Linear [out,in] -> Flax Dense [in,out]
    reshape     to the target's shape (row-major: the HF head-major layout N*H -> [N,H])
    T_reshape   transpose, then reshape (nn.Linear [N*H,E] -> [E,N,H]; [E,N*H] -> [N,H,E])
    ("part", k, n, axis): the k-th of n equal slices along `axis`, then reshape (GPT-2's fused c_attn)

Their inverses (unfill, on the leaf): copy; transpose; reshape to the HF shape; reshape to the HF shape
reversed, then transpose; reshape to the slice's shape, the n slices concatenated along `axis` in k order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Row:
    name: str                 # HF tensor name; "{i}" is the layer index
    shape: tuple[str, ...]    # its shape in the family's axis letters
    targets: tuple            # ((our path "a/b/c", our shape letters, transform), ...)
    optional: bool = False    # may be absent (e.g. lm_head.weight when the embeddings are tied)


def row(name: str, shape: tuple[str, ...], path: str, our_shape: tuple[str, ...], transform: Any = "copy",
        *, optional: bool = False) -> Row:
    """The common case: one HF tensor fills one params leaf."""
    return Row(name, shape, ((path, our_shape, transform),), optional)


def when(condition: bool, *rows: Row) -> tuple[Row, ...]:
    """`rows` if `condition`, else none: the tensors a checkpoint holds only in some configurations (biases,
    an untied head), kept in the table beside the rows they go with."""
    return rows if condition else ()


def prefixed(rows, prefix: str) -> list[Row]:
    """The rows with every HF name after `prefix` (e.g. "bert." or "transformer.": the same model saved
    inside a task head); our paths unchanged."""
    return [dataclasses.replace(r, name=prefix + r.name) for r in rows]


def expand(rows, num_layers: int) -> list[Row]:
    """The rows with "{i}" once per layer, layer by layer (all of layer 0's, then layer 1's...: HF's
    state_dict order), where the first of them stands; the other rows once, in place."""
    rows = list(rows)
    first = next((k for k, r in enumerate(rows) if "{i}" in r.name), len(rows))
    per_layer = [r for r in rows if "{i}" in r.name]
    layers = [Row(r.name.format(i=i), r.shape, tuple((p.format(i=i), s, t) for p, s, t in r.targets), r.optional)
              for i in range(num_layers) for r in per_layer]
    return rows[:first] + layers + [r for r in rows[first:] if "{i}" not in r.name]


def size(letters: tuple[str, ...], dims: Mapping[str, int]) -> tuple[int, ...]:
    """[E, 3*E] with dims {"E": 32} -> (32, 96)."""
    return tuple(math.prod(int(a) if a.isdigit() else dims[a] for a in axis.split("*")) for axis in letters)


def _shape(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _apply(transform, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if isinstance(transform, tuple) and transform[0] == "part":
        _, k, n, axis = transform
        x = np.split(x, n, axis=axis)[k]
    elif transform in ("transpose", "T_reshape"):
        x = x.T
    elif transform not in ("copy", "reshape"):
        raise ValueError(f"table transform: expected copy/transpose/reshape/T_reshape/('part', k, n, axis), "
                         f"got {transform!r}")
    if transform == "copy" and x.shape != shape or transform == "transpose" and x.shape != shape:
        raise ValueError(f"table: {transform} gives shape {_shape(x.shape)}, the target needs {_shape(shape)}")
    return np.ascontiguousarray(x.reshape(shape))


def check_names(tensors: Mapping[str, Any], rows, files: Mapping[str, str], *, ignored=()) -> None:
    """ValueError listing every missing and every unexpected name (with the files they are in)."""
    known = {r.name for r in rows}
    missing = [r.name for r in rows if not r.optional and r.name not in tensors]
    unexpected = [n for n in tensors if n not in known and n not in ignored]
    if missing or unexpected:
        where = sorted({files[n] for n in tensors}) or ["(no tensors)"]
        raise ValueError(f"{', '.join(where)}: expected exactly the {len(known)} tensors of the weight table, "
                         f"got {len(missing)} missing {missing} and {len(unexpected)} unexpected "
                         f"{[f'{n} (in {files[n]})' for n in unexpected]}")


def fill(tensors: Mapping[str, np.ndarray], rows, dims: Mapping[str, int], files: Mapping[str, str], *,
         dtype: Any | None = None, ignored=()) -> dict:
    """The params tree the rows describe. tensors: {HF name: numpy array}; files: {HF name: file name}.

    dtype: cast every floating tensor to it (explicitly requested); None keeps the checkpoint's dtype.
    `ignored` names (known buffers, checked by the caller) may be present and are skipped.
    A `tensors` mapping with a `leaf(path, name, tensor, transform, shape, dtype)` method (a sharded
    checkpoint, jaxattn.models._sharding) builds each leaf itself (from the parts of the tensor it needs);
    the names and every shape are checked here first all the same.
    """
    check_names(tensors, rows, files, ignored=ignored)
    leaf = getattr(tensors, "leaf", None) or _dense_leaf
    params: dict = {}
    for r in rows:
        if r.name not in tensors:
            continue  # optional, absent
        x = tensors[r.name]
        want = size(r.shape, dims)
        got = np.shape(x)  # None: a sharded checkpoint's missing file, which its leaf() reports by parameter
        if got is not None and tuple(got) != want:
            raise ValueError(f"{files[r.name]}: {r.name!r}: expected shape {_shape(want)} "
                             f"[{','.join(r.shape)}], got shape {_shape(got)}")
        for path, our_letters, transform in r.targets:
            node = params
            *parents, name = path.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[name] = leaf(path, r.name, x, transform, size(our_letters, dims), dtype)
    return params


def _dense_leaf(path: str, name: str, x, transform, shape: tuple[int, ...], dtype) -> np.ndarray:
    """The leaf as a numpy array: the transform of the whole tensor, cast to dtype if floating."""
    y = _apply(transform, np.asarray(x), shape)
    if dtype is not None and jnp.issubdtype(y.dtype, jnp.floating):  # bfloat16 included
        y = y.astype(dtype)
    return y


def unfill(params: Mapping, rows, dims: Mapping[str, int], *, dtype: Any | None = None) -> dict[str, np.ndarray]:
    """fill's inverse: {HF name: numpy array in HF's layout}, in table order, from the params the rows describe.

    Every leaf of `params` must be read by a row and every row's leaves must be there with the shapes the
    rows give (an optional row may be absent as a whole): otherwise ValueError naming each leaf (missing,
    unread, or its expected and actual shapes). The leaves of one row must share a dtype (they become one
    tensor; nothing is cast silently). dtype: cast every floating tensor to it (explicitly requested);
    None keeps the params' dtypes.
    """
    leaves = _flatten(params)
    problems, tensors, read = [], {}, set()
    for r in rows:
        paths = [path for path, _, _ in r.targets]
        if r.optional and not any(p in leaves for p in paths):
            continue
        read.update(p for p in paths if p in leaves)
        found = []
        for path, our_letters, transform in r.targets:
            want = size(our_letters, dims)
            if path not in leaves:
                problems.append(f"{path!r} missing (for {r.name!r})")
            elif leaves[path].shape != want:
                problems.append(f"{path!r}: expected shape {_shape(want)} [{','.join(our_letters)}] "
                                f"(for {r.name!r}), got shape {_shape(leaves[path].shape)}")
            else:
                found.append((transform, leaves[path]))
        if len(found) == len(paths):
            tensors[r.name] = _unapply(r, found, size(r.shape, dims))
    problems += [f"{p!r} is read by no row of the weight table" for p in leaves if p not in read]
    if problems:
        raise ValueError(f"params: expected exactly the leaves of the weight table ({len(read)} read), got "
                         f"{len(problems)} problem(s): " + "; ".join(problems))
    if dtype is not None:
        tensors = {name: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
                   for name, x in tensors.items()}
    return tensors


def _flatten(params: Mapping, prefix: str = "") -> dict[str, np.ndarray]:
    """{"a/b/c": leaf as a numpy array} of a nested mapping (a dict or flax's FrozenDict)."""
    if not isinstance(params, Mapping):
        raise ValueError(f"params: expected a nested mapping of arrays (the params tree), got "
                         f"{type(params).__name__}" + (f" at {prefix!r}" if prefix else ""))
    flat = {}
    for key, value in params.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        flat.update(_flatten(value, path) if isinstance(value, Mapping) else {path: np.asarray(value)})
    return flat


def _unapply(r: Row, parts, shape: tuple[int, ...]) -> np.ndarray:
    """The HF tensor of row `r` from its leaves [(transform, leaf)], each transform inverted."""
    kinds = [t[0] if isinstance(t, tuple) else t for t, _ in parts]
    if kinds == ["part"] * len(parts):
        order = sorted((t[1], t[2], t[3], x) for t, x in parts)
        n, axis = order[0][1], order[0][2]
        if [k for k, *_ in order] != list(range(n)) or {(m, a) for _, m, a, _ in order} != {(n, axis)}:
            raise ValueError(f"table: {r.name!r}: expected parts 0..n-1 of one split, got "
                             f"{[t for t, _ in parts]}")
        dtypes = {x.dtype for *_, x in order}
        if len(dtypes) > 1:
            raise ValueError(f"params: the leaves {[p for p, _, _ in r.targets]} make one tensor {r.name!r}: "
                             f"expected one dtype, got {sorted(map(str, dtypes))}")
        piece = shape[:axis] + (shape[axis] // n,) + shape[axis + 1:]
        x = np.concatenate([x.reshape(piece) for *_, x in order], axis=axis)
    elif len(parts) == 1:
        transform, x = parts[0]
        if transform in ("transpose", "T_reshape"):
            x = x.reshape(shape[::-1] if transform == "T_reshape" else x.shape).T
        elif transform == "reshape":
            x = x.reshape(shape)
        elif transform != "copy":
            raise ValueError(f"table transform: expected copy/transpose/reshape/T_reshape/('part', k, n, axis), "
                             f"got {transform!r}")
    else:
        raise ValueError(f"table: {r.name!r}: several targets must all be parts of one split to be read back, "
                         f"got {kinds}")
    if x.shape != shape:
        raise ValueError(f"table: {r.name!r}: the inverse of {kinds} gives shape {_shape(x.shape)}, "
                         f"the tensor is {_shape(shape)}")
    return np.ascontiguousarray(x)
