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

Stacked rows (`stacked`): several HF tensors, one per index j of an axis ("{j}" in the name: one tensor per
expert, "model.layers.{i}.mlp.experts.{j}.gate_proj.weight"), each transformed as a plain row's tensor,
then stacked along a new leading axis of the one leaf (our [X,E,F] expert kernels).

`unfill` reads the same rows in reverse (jaxattn.models.to_pretrained). No transform has a hand-written
inverse: every transform only moves entries, so running it on the HF tensor's flat positions
(arange(size).reshape(shape)) says, for each leaf entry, which HF entry it came from; unfill writes each leaf
back there (GPT-2's q, k and v kernels side by side into c_attn, gpt-oss's interleaved gate/up columns, a
stacked leaf's slices into their "{j}" tensors). Every HF entry must be written exactly once. A leaf no row
reads, a row's leaf that is missing and a leaf of the wrong shape are ValueErrors naming the leaf. A family
therefore writes checkpoints with no second map: its table (with the configuration's `when` rows) is the
whole description.

Transforms (numpy, on the tensor's HF layout):
    copy        as stored
    transpose   torch nn.Linear [out,in] -> Flax Dense [in,out]
    reshape     to the target's shape (row-major: the HF head-major layout N*H -> [N,H])
    T_reshape   transpose, then reshape (nn.Linear [N*H,E] -> [E,N,H]; [E,N*H] -> [N,H,E])
    ("part", k, n, axis): the k-th of n equal slices along `axis`, then reshape (GPT-2's fused c_attn)
    ("every", k, n, axis): entries k, k + n, k + 2n, ... along `axis` (gpt-oss's interleaved gate/up columns)
    ("swapaxes", a, b): axes a and b swapped (a stacked [X,out,in] kernel -> [X,in,out])
    [step, step, ...]: the steps in turn (Mixtral's fused gate_up_proj: [("part", 0, 2, 1), ("swapaxes", 1, 2)])
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
    stack: str | None = None  # a stacked row: the letter of the axis its "{j}" runs over (see `stacked`)


def row(name: str, shape: tuple[str, ...], path: str, our_shape: tuple[str, ...], transform: Any = "copy",
        *, optional: bool = False) -> Row:
    """The common case: one HF tensor fills one params leaf."""
    return Row(name, shape, ((path, our_shape, transform),), optional)


def stacked(name: str, shape: tuple[str, ...], path: str, our_shape: tuple[str, ...], transform: Any = "copy",
            *, over: str) -> Row:
    """One HF tensor per j < dims[over] ("{j}" in `name`, each of `shape`) fills one params leaf: each one
    transformed to our_shape[1:], stacked along a new leading axis `over` (our_shape[0])."""
    if "{j}" not in name or our_shape[:1] != (over,):
        raise ValueError(f"stacked: expected a name with '{{j}}' and our_shape starting with {over!r}, got "
                         f"{name!r} and {our_shape}")
    return Row(name, shape, ((path, our_shape, transform),), stack=over)


def names(r: Row, dims: Mapping[str, int] | None = None) -> list[str]:
    """The HF tensors row `r` stands for: its name, or a stacked row's one per j (needs `dims`)."""
    if r.stack is None:
        return [r.name]
    return [r.name.replace("{j}", str(j)) for j in range(dims[r.stack])]


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
    layers = [dataclasses.replace(r, name=r.name.replace("{i}", str(i)),
                                  targets=tuple((p.replace("{i}", str(i)), s, t) for p, s, t in r.targets))
              for i in range(num_layers) for r in per_layer]
    return rows[:first] + layers + [r for r in rows[first:] if "{i}" not in r.name]


def size(letters: tuple[str, ...], dims: Mapping[str, int]) -> tuple[int, ...]:
    """[E, 3*E] with dims {"E": 32} -> (32, 96)."""
    return tuple(math.prod(int(a) if a.isdigit() else dims[a] for a in axis.split("*")) for axis in letters)


def _shape(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


def _step(step, x: np.ndarray) -> np.ndarray:
    kind = step[0] if isinstance(step, tuple) else step
    if kind == "part":
        _, k, n, axis = step
        return np.split(x, n, axis=axis)[k]
    if kind == "every":
        _, k, n, axis = step
        return np.take(x, np.arange(k, x.shape[axis], n), axis=axis)
    if kind == "swapaxes":
        return np.swapaxes(x, step[1], step[2])
    if kind in ("transpose", "T_reshape"):
        return x.T
    if kind not in ("copy", "reshape"):
        raise ValueError(f"table transform: expected copy/transpose/reshape/T_reshape/('part', k, n, axis)/"
                         f"('every', k, n, axis)/('swapaxes', a, b) or a list of them, got {step!r}")
    return x


def _apply(transform, x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    steps = transform if isinstance(transform, list) else [transform]
    for step in steps:
        x = _step(step, x)
    last = steps[-1][0] if isinstance(steps[-1], tuple) else steps[-1]
    if last in ("copy", "transpose", "swapaxes") and x.shape != shape:  # these never reshape
        raise ValueError(f"table: {transform} gives shape {_shape(x.shape)}, the target needs {_shape(shape)}")
    return np.ascontiguousarray(x.reshape(shape))


def check_names(tensors: Mapping[str, Any], rows, files: Mapping[str, str], *, ignored=(), dims=None) -> None:
    """ValueError listing every missing and every unexpected name (with the files they are in); `dims`
    when the rows include stacked ones."""
    known = {n for r in rows for n in names(r, dims)}
    missing = [n for r in rows if not r.optional for n in names(r, dims) if n not in tensors]
    unexpected = [n for n in tensors if n not in known and n not in ignored]
    if missing or unexpected:
        where = sorted({files[n] for n in tensors}) or ["(no tensors)"]
        raise ValueError(f"{', '.join(where)}: expected exactly the {len(known)} tensors of the weight table, "
                         f"got {len(missing)} missing {missing} and {len(unexpected)} unexpected "
                         f"{[f'{n} (in {files[n]})' for n in unexpected]}")


def _checked(tensors, files, name: str, letters: tuple[str, ...], dims):
    """tensors[name] as given (an array, or a sharded checkpoint's lazy tensor, not read here), its shape
    checked against `letters` (the error names the file, the key, both shapes)."""
    x = tensors[name]
    want = size(letters, dims)
    got = np.shape(x)  # None: a sharded checkpoint's missing file, which its leaf() reports by parameter
    if got is not None and tuple(got) != want:
        raise ValueError(f"{files[name]}: {name!r}: expected shape {_shape(want)} [{','.join(letters)}], "
                         f"got shape {_shape(got)}")
    return x


def fill(tensors: Mapping[str, np.ndarray], rows, dims: Mapping[str, int], files: Mapping[str, str], *,
         dtype: Any | None = None, ignored=()) -> dict:
    """The params tree the rows describe. tensors: {HF name: numpy array}; files: {HF name: file name}.

    dtype: cast every floating tensor to it (explicitly requested); None keeps the checkpoint's dtype.
    Every leaf is a new array (no view of `tensors`).
    `ignored` names (known buffers, checked by the caller) may be present and are skipped.
    A `tensors` mapping with a `leaf(path, names, xs, transform, shape, dtype, stacked)` method (a sharded
    checkpoint, jaxattn.models._lazy_checkpoint) builds each leaf itself (from the parts of the tensors it
    needs; xs: the row's tensors, one per "{j}" of a stacked row, whose leaf `shape` then leads with their
    count); the names and every shape are checked here first all the same.
    """
    check_names(tensors, rows, files, ignored=ignored, dims=dims)
    leaf = getattr(tensors, "leaf", None) or _dense_leaf
    params: dict = {}
    for r in rows:
        if r.name not in tensors and r.stack is None:
            continue  # optional, absent
        row_names = names(r, dims)
        xs = [_checked(tensors, files, name, r.shape, dims) for name in row_names]
        for path, our_letters, transform in r.targets:
            node = params
            *parents, name = path.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[name] = leaf(path, row_names, xs, transform, size(our_letters, dims), dtype, r.stack is not None)
    return params


def _dense_leaf(path: str, row_names, xs, transform, shape: tuple[int, ...], dtype, stacked: bool) -> np.ndarray:
    """The leaf as a numpy array: the transform of the whole tensor (of each, stacked), cast to dtype if
    floating; never a view of the caller's tensor."""
    xs = [np.asarray(x) for x in xs]
    if not stacked:
        y = _apply(transform, xs[0], shape)
        if np.shares_memory(y, xs[0]):  # never a view: the caller's tensor (a torch tensor's .numpy(),
            y = y.copy()                # a memory map) may change under the params later
    else:
        y = np.stack([_apply(transform, x, shape[1:]) for x in xs])
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
            dtypes = {x.dtype for _, x in found}
            if len(dtypes) > 1:
                raise ValueError(f"params: the leaves {paths} make one tensor {r.name!r}: expected one dtype, "
                                 f"got {sorted(map(str, dtypes))}")
            shape = size(r.shape, dims)
            if r.stack is None:
                tensors[r.name] = _unapply(r.name, found, shape)
            else:  # slice j of every leaf makes the tensor named with j
                for j, name in enumerate(names(r, dims)):
                    tensors[name] = _unapply(name, [(t, x[j]) for t, x in found], shape)
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


def _unapply(name: str, parts, shape: tuple[int, ...]) -> np.ndarray:
    """The HF tensor `name` of `shape` from its leaves [(transform, leaf)]: each transform run forward on the
    tensor's flat positions says where each leaf entry goes; every position must be written exactly once."""
    positions = np.arange(math.prod(shape)).reshape(shape)
    flat = np.empty(math.prod(shape), dtype=parts[0][1].dtype)
    written = np.zeros(math.prod(shape), dtype=np.int64)
    for transform, x in parts:
        where = _apply(transform, positions, x.shape).ravel()
        flat[where] = x.ravel()
        np.add.at(written, where, 1)
    if not (written == 1).all():
        raise ValueError(f"table: {name!r}: its rows' transforms {[t for t, _ in parts]} write "
                         f"{int((written == 0).sum())} of its {written.size} entries never and "
                         f"{int((written > 1).sum())} more than once: the rows cannot be read back")
    return flat.reshape(shape)
