"""The activations' layout on a device mesh, and sequence parallelism on a "seq" axis.

Activations: the model carries a ModelSharding (its `sharding` field): the residual stream [B,T,E] is
constrained to batch over "data" between blocks (T over a sequence axis, if one is named), so XLA keeps
the batch split and gathers FSDP weights rather than reducing activations; heads follow the weights.
The decode cache [B,L,K,H] is laid out batch over "data", key/value heads over "model".

Sequence parallel: a mesh axis "seq" splits the residual stream's T too, and the decoders' causal
self-attention (the forward, and generate's prefill) runs on jaxattn.ring_attention over it
(SequenceParallelAttention): right-padded prompts, no window or softcap; T5, BERT, DeBERTa and Swin refuse
the axis.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import apply_rope, project_out, project_qkv, ring_attention
from .._core import checks
from .._layers import cache as kv_cache, common
from .._mesh import activation_layout
from ..linen import MultiHeadAttention

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
        if "seq" in mesh.axis_names and model_type in ("t5", "bert", "deberta-v2", "swin"):
            checks.fail(
                "mesh",
                f"no axis 'seq' for {model_type} (sequence parallelism runs the decoders' causal "
                f"self-attention on the ring)",
                f"axes {list(mesh.axis_names)}",
            )
        return cls(mesh, sequence_axis="seq" if "seq" in mesh.axis_names else None)

    def spec(self, layout: str, shape) -> P:
        """The spec of an array whose dims read `layout` (B batch, T/L sequence, N/K heads, others whole)."""
        axis_of = {"B": self.batch_axis, "T": self.sequence_axis, "N": self.head_axis, "K": self.head_axis}
        axes = [axis_of.get(letter) for letter in layout]
        return P(
            *(a if a in self.mesh.axis_names and d % self.mesh.shape[a] == 0 else None for a, d in zip(axes, shape))
        )

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


# the decode cache's leaves (jaxattn.linen's cache and the models' position count), by name; MLA's compressed
# cache batch over data only; Qwen3-Next's linear layers: the conv's last inputs [B,W-1,C] batch over data, the
# delta rule's state [B,M,Q,D] by value head
CACHE_LAYOUTS = {
    "cached_key": "BLKH",
    "cached_value": "BLKH",
    "cache_index": "B",
    "next_position": "B",
    "cached_latent": "BLC",
    "cached_rope": "BLR",
    "conv_state": "BLE",
    "recurrent_state": "BNHH",
}


def constrain_cache(sharding: ModelSharding | None, cache):
    """The "cache" collection laid out batch over data, key/value heads over model (no-op without a mesh)."""
    if sharding is None:
        return cache

    def one(path, x):
        name = getattr(path[-1], "key", path[-1])
        if name not in CACHE_LAYOUTS:
            checks.fail(
                f"cache{jax.tree_util.keystr(path)}", f"a cache entry among {sorted(CACHE_LAYOUTS)}", "an unknown entry"
            )
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
    def __call__(
        self, query, key=None, value=None, *, mask=None, is_causal=False, rope_positions=None, decode=None, **options
    ):
        if self.is_initializing() or decode and (query.shape[-2] == 1 or not self.has_variable("cache", "cached_key")):
            return super().__call__(
                query,
                key,
                value,
                mask=mask,
                is_causal=is_causal,
                rope_positions=rope_positions,
                decode=decode,
                **options,
            )
        unsupported = {
            "key": key,
            "value": value,
            "window": self.window,
            "chunk_size": self.chunk_size,
            "logit_softcap": self.logit_softcap,
            "use_sinks": self.use_sinks or None,
            **options,
        }
        for name, given in unsupported.items():
            if given is not None:
                checks.fail(
                    name,
                    "None with sequence parallelism (the ring runs causal self-attention, keys masked by count)",
                    repr(given) if isinstance(given, (tuple, float, int)) else "one",
                )
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
        fits = lambda axis, *dims: (
            axis
            if axis in s.mesh.axis_names
            and all(  # noqa: E731
                d % s.mesh.shape[axis] == 0 for d in dims
            )
            else None
        )
        return ring_attention(
            q,
            k,
            v,
            mesh=s.mesh,
            sequence_axis=s.sequence_axis,
            is_causal=True,
            batch_axis=fits(s.batch_axis, q.shape[0]),
            head_axis=fits(s.head_axis, q.shape[-2], k.shape[-2]),
            key_value_seq_lengths=lengths,
            scale=self.scale,
            precision=self.precision,
        )


def _key_counts(mask, S: int):
    """The models' key mask [B,1,1,S] (True = a token) -> (tokens per row [B], whether each row is right
    padding, all its tokens first), or (None, None) without a mask."""
    if mask is None:
        return None, None
    if mask.ndim != 4 or mask.shape[1:3] != (1, 1):
        checks.fail(
            "mask",
            "a key mask [B,1,1,S] (attention_mask) with sequence parallelism",
            f"shape {checks.shape_str(mask.shape)}",
        )
    tokens = mask[:, 0, 0, :]
    lengths = jnp.sum(tokens, -1).astype(jnp.int32)
    return lengths, jnp.all(tokens == (jnp.arange(S) < lengths[:, None]), -1)


class LaidOutAttention(MultiHeadAttention):
    """jaxattn.linen.MultiHeadAttention (the same params and cache) on a model's mesh: its attention inputs lie
    as the model constrains them (batch over the batch axis, heads over the head axis), so a kernel call runs on
    each device's shard by that layout (jax.shard_map, jaxattn._mesh.activation_layout) rather than in a
    custom_partitioning call whose split XLA's partitioner decides: the same program on a GPU, and one that
    compiles for a TPU from a CPU host too (which runs no Python partitioner)."""

    sharding: Any = None  # a ModelSharding

    @nn.compact
    def __call__(self, *args, **kwargs):
        s = self.sharding
        with activation_layout(s.mesh, s.batch_axis, s.head_axis):
            return super().__call__(*args, **kwargs)


def attention_class(sharding: ModelSharding | None):
    """The attention layer a block of a model with this sharding builds: SequenceParallelAttention (with the
    sharding bound) when it has a sequence axis, LaidOutAttention on a mesh without one, else
    MultiHeadAttention."""
    if sharding is None:
        return MultiHeadAttention
    if sharding.sequence_axis is None:
        return functools.partial(LaidOutAttention, sharding=sharding)
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
        checks.fail(
            "attention_mask",
            "right padding (each row's tokens first) with sequence parallelism (the ring masks keys by count)",
            f"rows {np.flatnonzero(~right.all(-1)).tolist()} padded otherwise",
        )
