"""Weight tables: checkpoint tensors <-> a Flax params tree, one explicit row per tensor.

The one table format of the repository: every jaxattn.models family (from_pretrained, to_pretrained, the
sharded reader) and crosscheck's conversions (torch attention modules, the HF position cases) write their
weights as rows of it.

A row (`Row`, usually made by `row`) names one checkpoint tensor literally ("{i}" = layer index:
"model.layers.{i}.self_attn.q_proj.weight", never assembled from pieces, so every name can be grepped), its
shape in axis letters, and the params leaves it fills: each `Target` is (our path "a/b/c", our shape in
letters, transform). Letters are the family's dims (e.g. E, N, H, F, V, given by a `dims` mapping); "3*E"
multiplies, digits are literals. A row is the single description of its tensor.

Transforms (numpy, on the tensor's checkpoint layout) are small frozen types, each a `Transform`:

    Copy()                  as stored (the default)
    Transpose()             torch nn.Linear [out,in] -> Flax Dense [in,out]
    Reshape()               to the target's shape (row-major: the head-major layout N*H -> [N,H])
    Part(k, n, axis)        the k-th of n equal slices along `axis` (GPT-2's fused c_attn), then reshape
    Every(k, n, axis, w=1)  blocks k, k + n, k + 2n, ... of `w` entries along `axis` (gpt-oss's interleaved
                            gate/up columns: w = 1; GPT-NeoX's per-head q/k/v rows: w = H), then reshape
    SwapAxes(a, b)          axes a and b swapped (a stacked [X,out,in] kernel -> [X,in,out])
    Steps(s, t, ...)        the steps in turn: Steps(Transpose(), Reshape()) is nn.Linear [N*H,E] -> [E,N,H];
                            Mixtral's fused gate_up_proj half is Steps(Part(0, 2, 1), SwapAxes(1, 2))

Each one knows its result (`apply`, `shape`), makes a leaf (`leaf`: apply, then reshape to the target where
the last step allows it; Copy, Transpose and SwapAxes must give the target's shape as they are), and maps a
box of its result back to the entries of the tensor it needs (`source`, `arrange`): `region` reads a shard's
box of a leaf from only that part of the tensor (the sharded reader, jaxattn.models.from_pretrained(mesh=)).

No transform has a hand-written inverse: every transform only moves entries, so running it on the tensor's
flat positions (`positions`) says, for each leaf entry, which tensor entry it came from; `unapply` writes
each leaf back there (GPT-2's q, k and v kernels side by side into c_attn, gpt-oss's interleaved columns, a
stacked leaf's slices into their "{j}" tensors), and checks that every entry is written exactly once.

Building a table: `when` keeps the rows a configuration has (biases, an untied head), `expand` repeats the
"{i}" rows per layer in HF's state_dict order, `prefixed` puts the names inside a task head's prefix.
Stacked rows (`stacked`): one tensor per index j of an axis ("{j}" in the name: one tensor per expert,
"model.layers.{i}.mlp.experts.{j}.gate_proj.weight"), each transformed as a plain row's tensor, then stacked
along a new leading axis of the one leaf (our [X,E,F] expert kernels).

Using a table: `fill` checks a checkpoint against it before any array is touched (missing and unexpected
names listed by name, every shape checked, each error naming the file that holds the tensor, its key and
both shapes) and builds the params tree; `unfill` reads the same rows in reverse (jaxattn.models.
to_pretrained): a leaf no row reads, a row's leaf that is missing and a leaf of the wrong shape are
ValueErrors naming the leaf.
"""

from __future__ import annotations

import abc
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, NamedTuple

import jax.numpy as jnp
import numpy as np

__all__ = [
    "Transform",
    "Copy",
    "Transpose",
    "Reshape",
    "Part",
    "Every",
    "SwapAxes",
    "Steps",
    "Target",
    "Row",
    "row",
    "stacked",
    "names",
    "when",
    "prefixed",
    "expand",
    "size",
    "check_names",
    "fill",
    "unfill",
    "unapply",
]

Shape = tuple[int, ...]
Cut = tuple[int, int, int]  # the entries start, start + stride, ... < stop of one axis
Box = Sequence[tuple[int, int]]  # [start, stop) per axis


def _shape(shape) -> str:
    return "[" + ",".join(str(d) for d in shape) + "]"


# --- transforms ----------------------------------------------------------------------------------------------


class Transform(abc.ABC):
    """A move of a tensor's entries into a params leaf: a step (or `Steps`), then a reshape to the leaf's
    shape where `reshapes` allows it."""

    reshapes: ClassVar[bool] = True  # may the leaf's shape differ from apply's result (a final reshape)?

    @abc.abstractmethod
    def apply(self, x: np.ndarray) -> np.ndarray:
        """The step on the whole tensor (before the final reshape)."""

    @abc.abstractmethod
    def shape(self, shape: Shape) -> Shape:
        """apply's result shape for a tensor of `shape`."""

    def source(self, cut: list[Cut], shape: Shape) -> list[Cut] | None:
        """The entries of a tensor of `shape` whose apply gives the entries `cut` of the result, as a cut of
        the tensor (None: no such cut; the region is then read whole). Identity unless overridden."""
        return cut

    def arrange(self, block: np.ndarray) -> np.ndarray:
        """What is left of apply once source's entries are read: the axis permutation (slices are in the
        cut already). Identity unless overridden."""
        return block

    def leaf(self, x: np.ndarray, shape: Shape) -> np.ndarray:
        """The params leaf of `shape` from the tensor x: apply, then reshape (contiguous; may be a view of x)."""
        y = self.apply(x)
        if not self.reshapes and y.shape != tuple(shape):  # these never reshape
            raise ValueError(f"table: {self} gives shape {_shape(y.shape)}, the target needs {_shape(shape)}")
        return np.ascontiguousarray(y.reshape(shape))

    def positions(self, tensor_shape: Shape, shape: Shape) -> np.ndarray:
        """For each entry of the leaf of `shape`, the flat position of the tensor entry it comes from (the
        transform read backwards, with no inverse written by hand)."""
        return self.leaf(np.arange(math.prod(tensor_shape)).reshape(tensor_shape), shape)

    def region(self, read: Callable[[Box], np.ndarray], tensor_shape: Shape, shape: Shape, box: Box) -> np.ndarray:
        """leaf[box] for the leaf of `shape` made from a tensor of `tensor_shape`, reading only what it needs:
        read(tensor box) -> that box of the tensor (jaxattn.io.read_region on a file).

        apply gives y; the reshape of y to `shape` splits each of y's axes into consecutive leaf axes (a
        group). A box whose cut of a group is on its first axis only is one range of y's axis; a group cut
        elsewhere is read whole (then sliced), and so is a reshape that is no split. The range of y is then
        carried back through the steps (`source`: permutations move it, Part shifts it, Every maps it to the
        span from its first to its last entry, read whole and strided after: it holds the other n - 1
        interleaved slices too, so gpt-oss's gate columns read their up columns). So every read is one box of
        the tensor, never more than the span the shard's entries cover (Every with w > 1: the whole tensor).
        """
        y_shape = self.shape(tuple(tensor_shape))
        groups = _groups(y_shape, shape)
        if groups is None:
            wide, y_box = [(0, d) for d in shape], [(0, d) for d in y_shape]
        else:
            wide = [(0, shape[a]) if any(box[b] != (0, shape[b]) for b in g[1:]) else box[a] for g in groups for a in g]
            inner = [math.prod(shape[a] for a in g[1:]) for g in groups]
            y_box = [(wide[g[0]][0] * m, wide[g[0]][1] * m) for g, m in zip(groups, inner)]
        cut = self.source([(a, b, 1) for a, b in y_box], tuple(tensor_shape))
        if cut is None:
            whole = self.leaf(read([(0, d) for d in tensor_shape]), shape)
            return np.ascontiguousarray(whole[tuple(slice(a, b) for a, b in box)])
        block = read([(a, b) for a, b, _ in cut])
        block = self.arrange(block[tuple(slice(None, None, st) for _, _, st in cut)])
        block = block.reshape([b - a for a, b in wide])
        return np.ascontiguousarray(block[tuple(slice(a - w, b - w) for (a, b), (w, _) in zip(box, wide))])


@dataclasses.dataclass(frozen=True)
class Copy(Transform):
    """As stored: the leaf has the tensor's shape."""

    reshapes: ClassVar[bool] = False

    def apply(self, x):
        return x

    def shape(self, shape):
        return tuple(shape)


@dataclasses.dataclass(frozen=True)
class Reshape(Transform):
    """To the leaf's shape, row-major (a head-major N*H axis -> [N,H])."""

    def apply(self, x):
        return x

    def shape(self, shape):
        return tuple(shape)


@dataclasses.dataclass(frozen=True)
class Transpose(Transform):
    """All axes reversed: torch nn.Linear's weight [out,in] -> a Dense kernel [in,out]."""

    reshapes: ClassVar[bool] = False

    def apply(self, x):
        return x.T

    def shape(self, shape):
        return tuple(shape)[::-1]

    def source(self, cut, shape):
        return cut[::-1]

    def arrange(self, block):
        return block.T


@dataclasses.dataclass(frozen=True)
class SwapAxes(Transform):
    """Axes a and b swapped (a stacked [X,out,in] kernel -> [X,in,out])."""

    a: int
    b: int
    reshapes: ClassVar[bool] = False

    def apply(self, x):
        return np.swapaxes(x, self.a, self.b)

    def _swap(self, items: Sequence) -> list:
        items = list(items)
        items[self.a], items[self.b] = items[self.b], items[self.a]
        return items

    def shape(self, shape):
        return tuple(self._swap(shape))

    def source(self, cut, shape):
        return self._swap(cut)

    def arrange(self, block):
        return np.swapaxes(block, self.a, self.b)


@dataclasses.dataclass(frozen=True)
class Part(Transform):
    """The k-th of n equal slices along `axis` (GPT-2's fused c_attn columns q | k | v), then reshape."""

    k: int
    n: int
    axis: int

    def __post_init__(self):
        if not 0 <= self.k < self.n:
            raise ValueError(f"Part: expected 0 <= k < n, got k={self.k}, n={self.n}")

    def apply(self, x):
        return np.split(x, self.n, axis=self.axis)[self.k]

    def shape(self, shape):
        return tuple(d // self.n if a == self.axis else d for a, d in enumerate(shape))

    def source(self, cut, shape):
        start, stop, stride = cut[self.axis]
        offset = self.k * (shape[self.axis] // self.n)
        return [(start + offset, stop + offset, stride) if a == self.axis else c for a, c in enumerate(cut)]


@dataclasses.dataclass(frozen=True)
class Every(Transform):
    """Blocks k, k + n, k + 2n, ... of `w` consecutive entries along `axis`, then reshape: gpt-oss's interleaved
    gate/up columns (w = 1), GPT-NeoX's fused rows [N,3,H] (q, k, v per head: Every(j, 3, 0, w=H))."""

    k: int
    n: int
    axis: int
    w: int = 1

    def __post_init__(self):
        if not 0 <= self.k < self.n or self.w < 1:
            raise ValueError(f"Every: expected 0 <= k < n and w >= 1, got k={self.k}, n={self.n}, w={self.w}")

    def _index(self, length: int) -> np.ndarray:
        blocks = np.arange(self.k, length // self.w, self.n)
        return (blocks[:, None] * self.w + np.arange(self.w)).ravel()

    def apply(self, x):
        return np.take(x, self._index(x.shape[self.axis]), axis=self.axis)

    def shape(self, shape):
        return tuple(self._index(d).size if a == self.axis else d for a, d in enumerate(shape))

    def source(self, cut, shape):
        if self.w != 1:
            return None  # not one strided range of the tensor
        start, stop, stride = cut[self.axis]
        k, n = self.k, self.n
        span = (k + n * start, k + n * (stop - 1) + 1, stride * n) if stop > start else (0, 0, 1)
        return [span if a == self.axis else c for a, c in enumerate(cut)]


@dataclasses.dataclass(frozen=True, init=False)
class Steps(Transform):
    """The steps in turn (a Steps among them joins in its own), then the reshape the last step allows. Copy and
    Reshape do nothing as a step: only the leaf's final reshape happens."""

    steps: tuple[Transform, ...]

    def __init__(self, *steps: Transform):
        if not steps or not all(isinstance(s, Transform) for s in steps):
            raise ValueError(f"Steps: expected one or more transforms, got {steps!r}")
        object.__setattr__(self, "steps", tuple(t for s in steps for t in (s.steps if isinstance(s, Steps) else (s,))))

    @property
    def reshapes(self) -> bool:  # type: ignore[override]
        return self.steps[-1].reshapes

    def __repr__(self):
        return f"Steps({', '.join(map(repr, self.steps))})"

    def apply(self, x):
        for step in self.steps:
            x = step.apply(x)
        return x

    def _shapes(self, shape: Shape) -> list[Shape]:
        """The shape before each step, and after the last."""
        shapes = [tuple(shape)]
        for step in self.steps:
            shapes.append(step.shape(shapes[-1]))
        return shapes

    def shape(self, shape):
        return self._shapes(shape)[-1]

    def source(self, cut, shape):
        for step, before in zip(self.steps[::-1], self._shapes(shape)[-2::-1]):
            cut = step.source(cut, before)
            if cut is None:
                return None
        return cut

    def arrange(self, block):
        for step in self.steps:
            block = step.arrange(block)
        return block


def _groups(y_shape: Shape, shape: Shape) -> list[list[int]] | None:
    """The consecutive leaf axes each of y's axes splits into (size-1 leaf axes at the end join the last
    group), or None if reshaping y_shape to shape is not such a split."""
    groups, i = [], 0
    for d in y_shape:
        group, n = [], 1
        while i < len(shape) and (not group or n < d):
            group.append(i)
            n *= shape[i]
            i += 1
        if n != d or not group:
            return None
        groups.append(group)
    while groups and i < len(shape) and shape[i] == 1:
        groups[-1].append(i)
        i += 1
    return groups if i == len(shape) else None


# --- rows and tables -----------------------------------------------------------------------------------------


class Target(NamedTuple):
    """A params leaf a row fills: its path "a/b/c" ("{i}": the layer), its shape in letters, the transform."""

    path: str
    shape: tuple[str, ...]
    transform: Transform


@dataclasses.dataclass(frozen=True)
class Row:
    """One checkpoint tensor and the leaves it fills."""

    name: str  # the tensor's name; "{i}" is the layer index ("{j}": a stacked row's index)
    shape: tuple[str, ...]  # its shape in the family's axis letters
    targets: tuple[Target, ...]  # the leaves it fills
    optional: bool = False  # may be absent (e.g. lm_head.weight when the embeddings are tied)
    stack: str | None = None  # a stacked row: the letter of the axis its "{j}" runs over (see `stacked`)

    def __post_init__(self):
        targets = tuple(Target(*t) for t in self.targets)
        for t in targets:
            if not isinstance(t.transform, Transform):
                raise ValueError(
                    f"{self.name}: {t.path}: expected a jaxattn.models.weights transform (Copy(), "
                    f"Transpose(), Reshape(), Part(k, n, axis), Every(k, n, axis), SwapAxes(a, b), "
                    f"Steps(...)), got {t.transform!r}"
                )
        object.__setattr__(self, "targets", targets)


def row(
    name: str,
    shape: tuple[str, ...],
    path: str,
    our_shape: tuple[str, ...],
    transform: Transform = Copy(),
    *,
    optional: bool = False,
) -> Row:
    """The common case: one tensor fills one params leaf."""
    return Row(name, shape, (Target(path, our_shape, transform),), optional)


def stacked(
    name: str,
    shape: tuple[str, ...],
    path: str,
    our_shape: tuple[str, ...],
    transform: Transform = Copy(),
    *,
    over: str,
) -> Row:
    """One tensor per j < dims[over] ("{j}" in `name`, each of `shape`) fills one params leaf: each one
    transformed to our_shape[1:], stacked along a new leading axis `over` (our_shape[0])."""
    if "{j}" not in name or our_shape[:1] != (over,):
        raise ValueError(
            f"stacked: expected a name with '{{j}}' and our_shape starting with {over!r}, got {name!r} and {our_shape}"
        )
    return Row(name, shape, (Target(path, our_shape, transform),), stack=over)


def names(r: Row, dims: Mapping[str, int] | None = None) -> list[str]:
    """The tensors row `r` stands for: its name, or a stacked row's one per j (needs `dims`)."""
    if r.stack is None:
        return [r.name]
    if dims is None:
        raise ValueError(f"{r.name}: a stacked row needs dims (its {r.stack!r} count)")
    return [r.name.replace("{j}", str(j)) for j in range(dims[r.stack])]


def when(condition: bool, *rows: Row) -> tuple[Row, ...]:
    """`rows` if `condition`, else none: the tensors a checkpoint holds only in some configurations (biases,
    an untied head), kept in the table beside the rows they go with."""
    return rows if condition else ()


def prefixed(rows: Iterable[Row], prefix: str) -> list[Row]:
    """The rows with every name after `prefix` (e.g. "bert." or "transformer.": the same model saved
    inside a task head); our paths unchanged."""
    return [dataclasses.replace(r, name=prefix + r.name) for r in rows]


def expand(rows: Iterable[Row], num_layers: int) -> list[Row]:
    """The rows with "{i}" once per layer, layer by layer (all of layer 0's, then layer 1's...: HF's
    state_dict order), where the first of them stands; the other rows once, in place."""
    rows = list(rows)
    first = next((k for k, r in enumerate(rows) if "{i}" in r.name), len(rows))
    per_layer = [r for r in rows if "{i}" in r.name]
    layers = [
        dataclasses.replace(
            r,
            name=r.name.replace("{i}", str(i)),
            targets=tuple(t._replace(path=t.path.replace("{i}", str(i))) for t in r.targets),
        )
        for i in range(num_layers)
        for r in per_layer
    ]
    return rows[:first] + layers + [r for r in rows[first:] if "{i}" not in r.name]


def size(letters: Sequence[str], dims: Mapping[str, int]) -> Shape:
    """[E, 3*E] with dims {"E": 32} -> (32, 96)."""
    return tuple(math.prod(int(a) if a.isdigit() else dims[a] for a in axis.split("*")) for axis in letters)


# --- a checkpoint -> params ----------------------------------------------------------------------------------


def check_names(
    tensors: Mapping[str, Any],
    rows: Sequence[Row],
    files: Mapping[str, str],
    *,
    ignored=(),
    dims: Mapping[str, int] | None = None,
) -> None:
    """ValueError listing every missing and every unexpected name (with the files they are in); `dims`
    when the rows include stacked ones."""
    known = {n for r in rows for n in names(r, dims)}
    missing = [n for r in rows if not r.optional for n in names(r, dims) if n not in tensors]
    unexpected = [n for n in tensors if n not in known and n not in ignored]
    if missing or unexpected:
        where = sorted({files[n] for n in tensors}) or ["(no tensors)"]
        raise ValueError(
            f"{', '.join(where)}: expected exactly the {len(known)} tensors of the weight table, "
            f"got {len(missing)} missing {missing} and {len(unexpected)} unexpected "
            f"{[f'{n} (in {files[n]})' for n in unexpected]}"
        )


def _checked(tensors, files, name: str, letters: tuple[str, ...], dims):
    """tensors[name] as given (an array, or a sharded checkpoint's lazy tensor, not read here), its shape
    checked against `letters` (the error names the file, the key, both shapes)."""
    x = tensors[name]
    want = size(letters, dims)
    got = np.shape(x)  # None: a sharded checkpoint's missing file, which its leaf() reports by parameter
    if got is not None and tuple(got) != want:
        raise ValueError(
            f"{files[name]}: {name!r}: expected shape {_shape(want)} [{','.join(letters)}], got shape {_shape(got)}"
        )
    return x


def fill(
    tensors: Mapping[str, Any],
    rows: Sequence[Row],
    dims: Mapping[str, int],
    files: Mapping[str, str],
    *,
    dtype: Any | None = None,
    ignored=(),
) -> dict:
    """The params tree the rows describe. tensors: {name: numpy array}; files: {name: file name}.

    dtype: cast every floating tensor to it (explicitly requested); None keeps the checkpoint's dtype.
    Every leaf is a new array (no view of `tensors`).
    `ignored` names (known buffers, checked by the caller) may be present and are skipped.
    A `tensors` mapping with a `leaf(path, names, xs, transform, shape, dtype, stacked)` method (a sharded
    checkpoint, from_pretrained(mesh=)) builds each leaf itself (from the parts of the tensors it needs:
    Transform.region; xs: the row's tensors, one per "{j}" of a stacked row, whose leaf `shape` then leads
    with their count); the names and every shape are checked here first all the same.
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


def _dense_leaf(path: str, row_names, xs, transform: Transform, shape: Shape, dtype, stacked: bool) -> np.ndarray:
    """The leaf as a numpy array: the transform of the whole tensor (of each, stacked), cast to dtype if
    floating; never a view of the caller's tensor."""
    xs = [np.asarray(x) for x in xs]
    if not stacked:
        y = transform.leaf(xs[0], shape)
        if np.shares_memory(y, xs[0]):  # never a view: the caller's tensor (a torch tensor's .numpy(),
            y = y.copy()  # a memory map) may change under the params later
    else:
        y = np.stack([transform.leaf(x, shape[1:]) for x in xs])
    if dtype is not None and jnp.issubdtype(y.dtype, jnp.floating):  # bfloat16 included
        y = y.astype(dtype)
    return y


# --- params -> a checkpoint ----------------------------------------------------------------------------------


def unfill(
    params: Mapping, rows: Sequence[Row], dims: Mapping[str, int], *, dtype: Any | None = None
) -> dict[str, np.ndarray]:
    """fill's inverse: {name: numpy array in the checkpoint's layout}, in table order, from the params the rows
    describe.

    Every leaf of `params` must be read by a row and every row's leaves must be there with the shapes the
    rows give (an optional row may be absent as a whole): otherwise ValueError naming each leaf (missing,
    unread, or its expected and actual shapes). The leaves of one row must share a dtype (they become one
    tensor; nothing is cast silently). dtype: cast every floating tensor to it (explicitly requested);
    None keeps the params' dtypes.
    """
    leaves = _flatten(params)
    problems, tensors, read = [], {}, set()
    for r in rows:
        paths = [t.path for t in r.targets]
        if r.optional and not any(p in leaves for p in paths):
            continue
        read.update(p for p in paths if p in leaves)
        found = []
        for path, our_letters, transform in r.targets:
            want = size(our_letters, dims)
            if path not in leaves:
                problems.append(f"{path!r} missing (for {r.name!r})")
            elif leaves[path].shape != want:
                problems.append(
                    f"{path!r}: expected shape {_shape(want)} [{','.join(our_letters)}] "
                    f"(for {r.name!r}), got shape {_shape(leaves[path].shape)}"
                )
            else:
                found.append((transform, leaves[path]))
        if len(found) == len(paths):
            dtypes = {x.dtype for _, x in found}
            if len(dtypes) > 1:
                raise ValueError(
                    f"params: the leaves {paths} make one tensor {r.name!r}: expected one dtype, "
                    f"got {sorted(map(str, dtypes))}"
                )
            shape = size(r.shape, dims)
            if r.stack is None:
                tensors[r.name] = unapply(r.name, found, shape)
            else:  # slice j of every leaf makes the tensor named with j
                for j, name in enumerate(names(r, dims)):
                    tensors[name] = unapply(name, [(t, x[j]) for t, x in found], shape)
    problems += [f"{p!r} is read by no row of the weight table" for p in leaves if p not in read]
    if problems:
        raise ValueError(
            f"params: expected exactly the leaves of the weight table ({len(read)} read), got "
            f"{len(problems)} problem(s): " + "; ".join(problems)
        )
    if dtype is not None:
        tensors = {name: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x for name, x in tensors.items()}
    return tensors


def _flatten(params: Mapping, prefix: str = "") -> dict[str, np.ndarray]:
    """{"a/b/c": leaf as a numpy array} of a nested mapping (a dict or flax's FrozenDict)."""
    if not isinstance(params, Mapping):
        raise ValueError(
            f"params: expected a nested mapping of arrays (the params tree), got "
            f"{type(params).__name__}" + (f" at {prefix!r}" if prefix else "")
        )
    flat = {}
    for key, value in params.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        flat.update(_flatten(value, path) if isinstance(value, Mapping) else {path: np.asarray(value)})
    return flat


def unapply(name: str, parts: Sequence[tuple[Transform, np.ndarray]], shape: Shape) -> np.ndarray:
    """The tensor `name` of `shape` from its leaves [(transform, leaf)]: each transform's `positions` say where
    each leaf entry goes; every position must be written exactly once (ValueError otherwise)."""
    flat = np.empty(math.prod(shape), dtype=parts[0][1].dtype)
    written = np.zeros(math.prod(shape), dtype=np.int64)
    for transform, x in parts:
        where = transform.positions(shape, x.shape).ravel()
        flat[where] = x.ravel()
        np.add.at(written, where, 1)
    if not (written == 1).all():
        raise ValueError(
            f"table: {name!r}: its rows' transforms {[t for t, _ in parts]} write "
            f"{int((written == 0).sum())} of its {written.size} entries never and "
            f"{int((written > 1).sum())} more than once: the rows cannot be read back"
        )
    return flat.reshape(shape)
