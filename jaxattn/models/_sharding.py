"""Models on a device mesh: each family's partition rules, the sharded loader, and the activations' layout.

    model, params = from_pretrained(path, mesh=mesh)            # mesh axes "data" and/or "model"
    model, params = from_pretrained(path, mesh=mesh, rules=[("*/self_attn/key/kernel", P("data"))])

Rules: one table per family, (pattern, PartitionSpec) rows over the params path ("layers_0/self_attn/
query/kernel"; fnmatch patterns, "*" crosses "/"), the first match wins, the last row "*" replicates.
`rules=` rows go in front of the family's. Parameters are sharded over "data" (FSDP: XLA gathers a
weight over "data" where it is used) and attention heads / MLP columns over "model" (tensor parallel:
column-parallel q/k/v and gate/up, row-parallel out and down, whose partial sums XLA all-reduces over
"model"). A default row that names an axis the mesh lacks leaves that dim unsplit (a mesh with "data"
only is pure FSDP); a `rules=` row must name existing axes. Every spec is checked against its leaf: its
axes exist, none twice, and each splits its dim evenly, else ValueError naming the parameter, the spec
and the shape. Mixture-of-experts weights stacked [X, ...] per layer split X over "model" by default
(MOE_RULES); a separate expert axis is one `rules=` row away: ("*/experts/*/kernel", P("expert", ...)).

Loading: every leaf is made by jax.make_array_from_callback; each process builds only the shards of its
own devices, and for each distinct shard reads only the bytes of that region of the HF tensor
(jaxattn.io.read_region). The table's transforms (transpose, head reshapes, GPT-2's c_attn parts) map a
box of the leaf to a box of the tensor: a reshape [N*H] -> [N,H] is read exactly when only the leading
letter of the merged axis (N) is split; any other cut of a merged axis reads the whole merged axis and
slices after. Stacked rows (one HF tensor per expert, jaxattn.models.moe) read only the tensors of the
experts in the shard's X range, each for its box. The newer steps map too: ("swapaxes", a, b) permutes
the box, ("part", ...) shifts it, and ("every", k, n, axis) (gpt-oss's interleaved gate/up columns) reads
the span from the first to the last entry it needs and strides after: that span holds the other n - 1
interleaved columns too, so for such rows the bytes read are bounded per tensor (never outside the part of
the tensor the shard spans, never a tensor the process holds no shard of), not by the shard's own bytes.
A shard held by several local devices is read once.

Activations: the model carries a ModelSharding (its `sharding` field): the residual stream [B,T,E] is
constrained to batch over "data" between blocks (T over a sequence axis, if one is named), so XLA keeps
the batch split and gathers FSDP weights rather than reducing activations; heads follow the weights.
The decode cache [B,L,K,H] is laid out batch over "data", key/value heads over "model".

Sequence parallel: a mesh axis "seq" splits the residual stream's T too, and the decoders' causal
self-attention (the forward, and generate's prefill) runs on jaxattn.ring_attention over it
(SequenceParallelAttention): right-padded prompts, no window or softcap; T5 and BERT refuse the axis.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .. import apply_rope, io, project_out, project_qkv, ring_attention
from .._core import checks
from .._layers import cache as kv_cache
from .._layers import common
from ..linen import MultiHeadAttention

# --- the rules, per family ----------------------------------------------------------------------------------

# Llama-shaped decoders (llama, qwen2, mistral, gemma2, qwen3, gemma3_text). Kernels: q/k/v [E,N|K,H], out [N,H,E], gate/up
# [E,F], down [F,E], lm_head [E,V]; embeddings [V,E] split by vocabulary over "model" (XLA looks tokens
# up in each device's rows and all-reduces), so a head tied to them is column-parallel too.
DECODER_RULES = (
    ("embed_tokens/embedding", P("model", "data")),
    ("*/self_attn/query/kernel", P("data", "model", None)),
    ("*/self_attn/key/kernel", P("data", "model", None)),
    ("*/self_attn/value/kernel", P("data", "model", None)),
    ("*/self_attn/out/kernel", P("model", None, "data")),
    ("*/self_attn/query/bias", P("model", None)),
    ("*/self_attn/key/bias", P("model", None)),
    ("*/self_attn/value/bias", P("model", None)),
    ("*/gate_proj/kernel", P("data", "model")),
    ("*/up_proj/kernel", P("data", "model")),
    ("*/down_proj/kernel", P("model", "data")),
    ("*/gate_proj/bias", P("model")),
    ("*/up_proj/bias", P("model")),
    ("lm_head/kernel", P("data", "model")),
    ("*", P()),
)

# GPT-2: attention as above; c_fc [E,F] column-, c_proj [F,E] row-parallel. Its vocabulary (50257) and
# positions split by nothing: wte/wpe [V|P,E] are FSDP over E only.
GPT2_RULES = (
    ("wte/embedding", P(None, "data")),
    ("wpe/embedding", P(None, "data")),
    ("*/attn/query/kernel", P("data", "model", None)),
    ("*/attn/key/kernel", P("data", "model", None)),
    ("*/attn/value/kernel", P("data", "model", None)),
    ("*/attn/out/kernel", P("model", None, "data")),
    ("*/attn/query/bias", P("model", None)),
    ("*/attn/key/bias", P("model", None)),
    ("*/attn/value/bias", P("model", None)),
    ("*/c_fc/kernel", P("data", "model")),
    ("*/c_fc/bias", P("model")),
    ("*/c_proj/kernel", P("model", "data")),
    ("lm_head/kernel", P("data", "model")),
    ("*", P()),
)

# T5: both stacks' self- and cross-attention, the FF (wi, or gated wi_0/wi_1, then wo), the shared
# embeddings by vocabulary, each stack's relative table [R,N] by heads.
T5_RULES = (
    ("shared/embedding", P("model", "data")),
    ("*/relative_attention_bias", P(None, "model")),
    ("*_attention/query/kernel", P("data", "model", None)),
    ("*_attention/key/kernel", P("data", "model", None)),
    ("*_attention/value/kernel", P("data", "model", None)),
    ("*_attention/out/kernel", P("model", None, "data")),
    ("*/ff/wi*/kernel", P("data", "model")),
    ("*/ff/wo/kernel", P("model", "data")),
    ("lm_head/kernel", P("data", "model")),
    ("*", P()),
)

# BERT: the encoder's attention, intermediate [E,F] column- and output [F,E] row-parallel; embeddings
# FSDP over E (BERT's vocabulary, 30522, splits by 2 only).
BERT_RULES = (
    ("embeddings/*/embedding", P(None, "data")),
    ("*/attention/query/kernel", P("data", "model", None)),
    ("*/attention/key/kernel", P("data", "model", None)),
    ("*/attention/value/kernel", P("data", "model", None)),
    ("*/attention/out/kernel", P("model", None, "data")),
    ("*/attention/query/bias", P("model", None)),
    ("*/attention/key/bias", P("model", None)),
    ("*/attention/value/bias", P("model", None)),
    ("*/intermediate/kernel", P("data", "model")),
    ("*/intermediate/bias", P("model")),
    ("*/output/kernel", P("model", "data")),
    ("pooler/kernel", P("data", None)),
    ("*", P()),
)

# Mixture-of-experts decoders (mixtral, qwen3_moe, gpt_oss; jaxattn.models.moe): the Llama rows for attention,
# embeddings and head, after the experts' rows (which must come first: "*/gate_proj/kernel" would match the
# 3-D expert kernels). Expert kernels gate/up [X,E,F] and down [X,F,E] are split by expert over "model"
# (expert parallel: each device runs its experts on every token, the dense dispatch's weighted sum over X
# is the all-reduce over "model"), FSDP over E; the expert biases [X,F]/[X,E] by expert; the router [E,X]
# FSDP over E, X whole (every device needs every expert's logit for the top k); gpt-oss's sinks [N] by head.
# X must divide by the "model" axis' size (8 for Mixtral, 32 or 128 for gpt-oss, 128 for Qwen3-MoE).
MOE_RULES = (
    ("*/mlp/experts/gate_proj/kernel", P("model", "data", None)),
    ("*/mlp/experts/up_proj/kernel", P("model", "data", None)),
    ("*/mlp/experts/down_proj/kernel", P("model", None, "data")),
    ("*/mlp/experts/*/bias", P("model", None)),
    ("*/mlp/router/kernel", P("data", None)),
    ("*/self_attn/sinks", P("model")),
    *DECODER_RULES,
)

# qwen3 and gemma3_text are Llama-shaped: their q_norm/k_norm weights [H] fall to "*" (replicated).
FAMILY_RULES = {"llama": DECODER_RULES, "qwen2": DECODER_RULES, "mistral": DECODER_RULES,
                "gemma2": DECODER_RULES, "qwen3": DECODER_RULES, "gemma3_text": DECODER_RULES,
                "mixtral": MOE_RULES, "qwen3_moe": MOE_RULES, "gpt_oss": MOE_RULES, "llama4_text": MOE_RULES,
                "gpt2": GPT2_RULES, "t5": T5_RULES, "bert": BERT_RULES}


def partition_rules(model_type: str) -> tuple:
    """The family's default rules: ((pattern over the params path, PartitionSpec), ...), first match wins."""
    if model_type not in FAMILY_RULES:
        checks.fail("model_type", f"one of {sorted(FAMILY_RULES)}", repr(model_type))
    return FAMILY_RULES[model_type]


def _axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _only_axes_of(spec: P, mesh: Mesh) -> P:
    """A default spec with the axes `mesh` lacks dropped (their dims unsplit)."""
    kept = [tuple(a for a in _axes(e) if a in mesh.axis_names) for e in spec]
    return P(*(None if not k else k[0] if len(k) == 1 else k for k in kept))


@dataclasses.dataclass(frozen=True)
class Rules:
    """The rows a load uses: the user's first (checked strictly), then the family's (axes the mesh lacks
    dropped)."""

    mesh: Mesh
    user: tuple
    family: tuple

    @classmethod
    def of(cls, model_type: str, mesh: Mesh, rules=None) -> Rules:
        checks.check_mesh(mesh)
        user = tuple((rules.items() if isinstance(rules, Mapping) else rules) or ())
        for k, r in enumerate(user):
            if not (isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str) and isinstance(r[1], P)):
                checks.fail(f"rules[{k}]", "a (pattern str, PartitionSpec) pair", repr(r))
            for axis in (a for e in r[1] for a in _axes(e)):
                if axis not in mesh.axis_names:
                    checks.fail(f"rules[{k}] ({r[0]!r}: {r[1]})", f"axes of the mesh {list(mesh.axis_names)}",
                                f"axis {axis!r}")
        family = tuple((pattern, _only_axes_of(spec, mesh)) for pattern, spec in partition_rules(model_type))
        return cls(mesh, user, family)

    def spec(self, path: str, shape: tuple[int, ...]) -> P:
        """The first matching row's spec for the leaf at `path`, checked against its shape."""
        spec = next(s for pattern, s in (*self.user, *self.family) if fnmatch.fnmatchcase(path, pattern))
        check_spec(path, spec, shape, self.mesh)
        return spec


def check_spec(path: str, spec: P, shape, mesh: Mesh) -> None:
    """ValueError naming the parameter, the spec and the shape unless `spec` lays `shape` out on `mesh`:
    rank, axes that exist (each once) and dims divisible by their axes' sizes."""
    where = f"{path} (spec {spec}, shape {checks.shape_str(shape)})"
    if len(spec) > len(shape):
        checks.fail(where, f"at most {len(shape)} entries (one per dim)", f"{len(spec)}")
    used = [a for e in spec for a in _axes(e)]
    for axis in used:
        if axis not in mesh.axis_names:
            checks.fail(where, f"axes of the mesh {list(mesh.axis_names)}", f"axis {axis!r}")
    if len(set(used)) != len(used):
        checks.fail(where, "each mesh axis at most once", f"axes {used}")
    for dim, (d, e) in enumerate(zip(shape, spec)):
        parts = math.prod(mesh.shape[a] for a in _axes(e))
        if d % parts:
            checks.fail(where, f"dim {dim} ({d}) divisible by {parts} (mesh axes {list(_axes(e))})",
                        f"{d} % {parts} = {d % parts}")


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


# --- activations ---------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ModelSharding:
    """How a model's activations lie on `mesh`: batch over batch_axis, heads over head_axis, and (with
    sequence_axis) the sequence too. Axes the mesh lacks, or that do not divide a dim, leave it unsplit."""

    mesh: Mesh
    batch_axis: str | None = "data"
    head_axis: str | None = "model"
    sequence_axis: str | None = None

    @classmethod
    def of(cls, mesh: Mesh, model_type: str) -> ModelSharding:
        """from_pretrained's: batch over "data", heads over "model", and a mesh axis "seq" is the sequence
        axis (sequence parallel, the decoders' attention on the ring)."""
        if "seq" in mesh.axis_names and model_type in ("t5", "bert"):
            checks.fail("mesh", f"no axis 'seq' for {model_type} (sequence parallelism runs the decoders' causal "
                                f"self-attention on the ring)", f"axes {list(mesh.axis_names)}")
        return cls(mesh, sequence_axis="seq" if "seq" in mesh.axis_names else None)

    def spec(self, layout: str, shape) -> P:
        """The spec of an array whose dims read `layout` (B batch, T/L sequence, N/K heads, others whole)."""
        axis_of = {"B": self.batch_axis, "T": self.sequence_axis, "N": self.head_axis, "K": self.head_axis}
        axes = [axis_of.get(letter) for letter in layout]
        return P(*(a if a in self.mesh.axis_names and d % self.mesh.shape[a] == 0 else None
                   for a, d in zip(axes, shape)))

    def place(self, x, layout: str):
        """A host array (the same in every process) as a global array laid out by `layout`."""
        x = np.asarray(x)
        sharding = NamedSharding(self.mesh, self.spec(layout, x.shape))
        return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def constrain(sharding: ModelSharding | None, x, layout: str):
    """x laid out by `layout` on the model's mesh, inside jit (no-op for a model without a mesh, or for x
    of another rank, e.g. BERT's extra batch dims)."""
    if sharding is None or jnp.ndim(x) != len(layout):
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(sharding.mesh, sharding.spec(layout, x.shape)))


# the decode cache's leaves (jaxattn.linen's cache and the models' position count), by name
CACHE_LAYOUTS = {"cached_key": "BLKH", "cached_value": "BLKH", "cache_index": "B", "next_position": "B"}


def constrain_cache(sharding: ModelSharding | None, cache):
    """The "cache" collection laid out batch over data, key/value heads over model (no-op without a mesh)."""
    if sharding is None:
        return cache

    def one(path, x):
        name = getattr(path[-1], "key", path[-1])
        if name not in CACHE_LAYOUTS:
            checks.fail(f"cache{jax.tree_util.keystr(path)}", f"a cache entry among {sorted(CACHE_LAYOUTS)}",
                        "an unknown entry")
        return constrain(sharding, x, CACHE_LAYOUTS[name])

    return jax.tree_util.tree_map_with_path(one, cache)


def place(model, x, layout: str):
    """A host array (the same in every process) on the model's mesh laid out by `layout`; x itself for a
    model without a mesh."""
    return x if model.sharding is None else model.sharding.place(x, layout)


def decode_outputs(model, token, cache):
    """A decode step's outputs, inside jit: on a mesh, the new token [B] replicated (every process reads
    it) and the cache laid out as constrain_cache does; unchanged without a mesh."""
    if model.sharding is None:
        return token, cache
    token = jax.lax.with_sharding_constraint(token, NamedSharding(model.sharding.mesh, P()))
    return token, constrain_cache(model.sharding, cache)


# --- sequence parallel: the ring engine for the causal self-attention of a whole sequence ------------------------

class SequenceParallelAttention(MultiHeadAttention):
    """jaxattn.linen.MultiHeadAttention (the same params and cache) whose causal self-attention over a whole
    sequence runs as jaxattn.ring_attention over the model's sequence axis: queries stay where their tokens
    are, key/value shares travel round the ring. So does generate's prefill (decode=True with T > 1 new
    tokens into an empty cache): the prompt's rotated keys and values are written to the cache, and the
    prompt attends to itself on the ring. Decoding a token, and making the cache (init, or an apply that
    creates it), take MultiHeadAttention's path.

    The ring masks keys by count, so the attention mask must be right padding (1s then 0s: a row that is not
    gives NaN, as a cache overflow does; so does a prefill into a cache that is not empty) and the layer may
    have no window, chunks, softcap or sinks (ValueError). Query and key/value heads split over the head axis
    when both divide by it, the batch over the batch axis when it divides; T must divide by 2 x the sequence
    axis' size (the zigzag layout).
    """

    sharding: Any = None  # a ModelSharding whose sequence_axis is one of its mesh's axes

    @nn.compact
    def __call__(self, query, key=None, value=None, *, mask=None, is_causal=False, rope_positions=None,
                 decode=None, **options):
        if self.is_initializing() or decode and (query.shape[-2] == 1 or not self.has_variable("cache", "cached_key")):
            return super().__call__(query, key, value, mask=mask, is_causal=is_causal, rope_positions=rope_positions,
                                    decode=decode, **options)
        unsupported = {"key": key, "value": value, "window": self.window, "chunk_size": self.chunk_size,
                       "logit_softcap": self.logit_softcap, "use_sinks": self.use_sinks or None, **options}
        for name, given in unsupported.items():
            if given is not None:
                checks.fail(name, "None with sequence parallelism (the ring runs causal self-attention, keys "
                                  "masked by count)", repr(given) if isinstance(given, (tuple, float, int)) else "one")
        if not (is_causal or decode):
            checks.fail("is_causal", "True with sequence parallelism (the ring runs causal self-attention)", is_causal)
        dtype = common.layer_dtype(self.dtype, self.variables["params"], query)
        params, query = common.cast((self.variables["params"], query), dtype)
        q, k, v = project_qkv(params, query, precision=self.precision)
        if (qk_norm := self._qk_norm()) is not None:  # Qwen 3, Gemma 3: before RoPE and the cache, as attend
            q, k = qk_norm(q, k)
        T = q.shape[-3]
        if self.rope is not None:
            positions = jnp.arange(T) if rope_positions is None else rope_positions
            q, k = (apply_rope(x, positions, **self.rope.options()) for x in (q, k))
        lengths, valid = _key_counts(mask if mask is None else mask[..., :T], T)  # decoding: the prompt's slots
        if decode:
            names = ("cached_key", "cached_value", "cache_index")
            index = self.get_variable("cache", "cache_index")
            for name, new in zip(names, kv_cache.write(*(self.get_variable("cache", n) for n in names), k, v)):
                self.put_variable("cache", name, new)
            valid = (index == 0) if valid is None else valid & (index == 0)
        out = project_out(params, self._ring(q, k, v, lengths), precision=self.precision)
        return out if valid is None else jnp.where(valid[:, None, None], out, jnp.nan)

    def _ring(self, q, k, v, lengths):
        s = self.sharding
        fits = lambda axis, *dims: axis if axis in s.mesh.axis_names and all(  # noqa: E731
            d % s.mesh.shape[axis] == 0 for d in dims) else None
        return ring_attention(q, k, v, mesh=s.mesh, sequence_axis=s.sequence_axis, is_causal=True,
                              batch_axis=fits(s.batch_axis, q.shape[0]),
                              head_axis=fits(s.head_axis, q.shape[-2], k.shape[-2]), key_value_seq_lengths=lengths,
                              scale=self.scale, precision=self.precision)


def _key_counts(mask, S: int):
    """The models' key mask [B,1,1,S] (True = a token) -> (tokens per row [B], whether each row is right
    padding, all its tokens first), or (None, None) without a mask."""
    if mask is None:
        return None, None
    if mask.ndim != 4 or mask.shape[1:3] != (1, 1):
        checks.fail("mask", "a key mask [B,1,1,S] (attention_mask) with sequence parallelism",
                    f"shape {checks.shape_str(mask.shape)}")
    tokens = mask[:, 0, 0, :]
    lengths = jnp.sum(tokens, -1).astype(jnp.int32)
    return lengths, jnp.all(tokens == (jnp.arange(S) < lengths[:, None]), -1)


def attention_class(sharding: ModelSharding | None):
    """The attention layer a block of a model with this sharding builds: SequenceParallelAttention (with the
    sharding bound) when it has a sequence axis, else MultiHeadAttention."""
    if sharding is None or sharding.sequence_axis is None:
        return MultiHeadAttention
    return functools.partial(SequenceParallelAttention, sharding=sharding)


def check_prompts(model, attention_mask) -> None:
    """generate's prompts on a sequence-parallel model: right padding (each row's tokens first), since the
    ring masks the prompt's keys by count; ValueError naming the rows padded otherwise."""
    sharding = model.sharding
    if sharding is None or sharding.sequence_axis is None:
        return
    mask = np.asarray(attention_mask)
    right = mask == (np.arange(mask.shape[-1]) < mask.sum(-1, keepdims=True))
    if not right.all():
        checks.fail("attention_mask", "right padding (each row's tokens first) with sequence parallelism (the "
                                      "ring masks keys by count)", f"rows {np.flatnonzero(~right.all(-1)).tolist()} "
                                                                   "padded otherwise")
