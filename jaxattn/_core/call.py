"""AttentionCall: one call's options as one frozen value (docs/design.md, "How a call's options travel").

The public functions keep their keywords (dot_product_attention, flex_attention, the position schemes,
blockwise_attention); each builds one AttentionCall at its entry, checks what can be checked without the
arrays' shapes there, and hands that value down: the dispatch (jaxattn._dispatch) asks each kernel whether it
can express the call and the engines and kernels read its fields. Nothing below the entry packs or unpacks
keyword dicts, so `is_causal` is followed from the entry to a kernel by reading `call.is_causal`.

The fields, by what they do (the names are dot_product_attention's):

    which pairs may attend   is_causal, key_value_seq_lengths, query_positions, key_positions,
                             query_segment_ids, key_segment_ids, window, chunk_size, mask_mod, block_mask
    the logits               scale, logit_softcap, sinks, score_mod
    position terms           key_table, value_table, max_distance (Shaw tables), position_bias (a hook
                             of the absolute positions; T5's and ALiBi's are OffsetBias values, functions
                             of j - i alone, Swin's / BEiT's TableBias values, a table read at the 2D offset
                             in a window: the Pallas GPU kernel computes both in its tiles), rel_key,
                             rel_value (per-pair tables [T,S,N|1,F], relative_attention's A^K / A^V),
                             row_tables (row_tables.RowTables: per-row terms read at a row of j - i,
                             DeBERTa's c2p / p2c as disentangled_attention hands them to a kernel)
    the full [T,S] grid      mask, bias, dropout_rate, dropout_rng, broadcast_dropout, return_weights
    outputs and numerics     return_lse, precision
    the XLA engines' own     block_size (the blockwise tile; a kernel picks its own)

Shape-dependent checks (a mask that must broadcast to [...,N,T,S], segment ids of length T) stay with the
engines and kernels that see the arrays; everything else is checked here, once.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import numpy as np

from . import checks, mods
from .masks import MaskRule

# The options that span the whole [T,S] grid: only the dense engine computes them (AttentionCall.grid_options,
# in this order, is what every other engine and kernel refuses by name).
GRID_OPTIONS = ("mask", "bias", "return_weights", "dropout_rate")
# The keywords of those options: dropout_rng too, which needs the grid only beside a dropout_rate (the layers
# pass their key either way), so a key alone is no grid option. blockwise_attention takes exactly these
# keywords of dot_product_attention's beyond its own, to refuse them by name.
GRID_KEYWORDS = (*GRID_OPTIONS, "dropout_rng")
# The integer arrays that say which pairs may attend (a custom VJP takes them as inputs: closing over them
# would capture a tracer of an enclosing trace).
INDEX_ARRAYS = ("key_value_seq_lengths", "query_positions", "key_positions", "query_segment_ids", "key_segment_ids")
# The fields that hold arrays (a BlockMask: a pytree of them): an AttentionCall's pytree leaves, so that a call
# passes through jax.custom_vjp, jax.vjp or jax.jit as one value (the rest, Python values, functions and
# position-term objects, rides in its treedef).
ARRAY_FIELDS = (
    *INDEX_ARRAYS,
    "block_mask",
    "sinks",
    "key_table",
    "value_table",
    "rel_key",
    "rel_value",
    "mask",
    "bias",
    "dropout_rng",
)
# The position terms of the relative schemes.
POSITION_TERMS = ("key_table", "value_table", "position_bias", "rel_key", "rel_value", "row_tables")


def _is_set(value) -> bool:
    """An option in use: not None, False or a Python zero (dropout_rate=0.0 is the default)."""
    if value is None or value is False:
        return False
    return not (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: arrays inside; compared by identity
class AttentionCall:
    """The options of one attention call (module docstring); build it with the public keywords."""

    # which (query, key) pairs may attend
    is_causal: bool = False
    key_value_seq_lengths: Any = None
    query_positions: Any = None
    key_positions: Any = None
    query_segment_ids: Any = None
    key_segment_ids: Any = None
    window: Optional[tuple] = None
    chunk_size: Optional[int] = None
    mask_mod: Optional[Callable] = None
    block_mask: Any = None
    # the logits
    scale: Any = None
    logit_softcap: Optional[float] = None
    sinks: Any = None
    score_mod: Optional[Callable] = None
    # position terms
    key_table: Any = None
    value_table: Any = None
    max_distance: Optional[int] = None
    position_bias: Optional[Callable] = None
    rel_key: Any = None
    rel_value: Any = None
    row_tables: Any = None  # a row_tables.RowTables (DeBERTa's terms for a kernel), or None
    # the full [T,S] grid
    mask: Any = None
    bias: Any = None
    dropout_rate: Any = 0.0
    dropout_rng: Any = None
    broadcast_dropout: bool = False
    return_weights: bool = False
    # outputs and numerics
    return_lse: bool = False
    precision: Any = None
    # the XLA engines' own
    block_size: Any = None

    def __post_init__(self):
        for name in ("is_causal", "return_weights", "return_lse", "broadcast_dropout"):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)) and not (isinstance(value, int) and value in (0, 1)):
                checks.fail(name, "True or False (a Python bool: it decides the program)", repr(value))
            object.__setattr__(self, name, bool(value))
        if not _is_set(self.dropout_rate):
            object.__setattr__(self, "broadcast_dropout", False)  # no dropout: no keep-mask to share
        object.__setattr__(self, "window", mods.check_window(self.window))
        object.__setattr__(self, "chunk_size", mods.check_chunk_size(self.chunk_size))
        object.__setattr__(self, "logit_softcap", mods.check_softcap(self.logit_softcap))

    def replace(self, **changes) -> AttentionCall:
        """A copy with `changes` (checked again)."""
        return dataclasses.replace(self, **changes)

    @property
    def rule(self) -> MaskRule:
        """The static part of the position mask (causal, window, chunk)."""
        return MaskRule(is_causal=self.is_causal, window=self.window, chunk_size=self.chunk_size)

    @property
    def grid_options(self) -> tuple:
        """The options in use that span the full [T,S] grid (mask, bias, return_weights, dropout), by
        name: the one place that decides whether a call needs the dense engine."""
        return tuple(name for name in GRID_OPTIONS if _is_set(getattr(self, name)))

    @property
    def needs_grid(self) -> bool:
        return bool(self.grid_options)

    @property
    def has_tables(self) -> bool:
        """Shaw key or value tables in use."""
        return self.key_table is not None or self.value_table is not None

    def in_use(self) -> tuple:
        """The names of every option set (not None / False / 0), in field order: what a kernel that
        handles only some options checks against its list. A dropout key without a dropout rate does
        nothing (the layers pass theirs whether or not dropout is on), so it does not count."""
        idle = () if _is_set(self.dropout_rate) else ("dropout_rng",)
        return tuple(f.name for f in dataclasses.fields(self) if f.name not in idle and _is_set(getattr(self, f.name)))

    def first_unhandled(self, handled) -> Optional[str]:
        """The first option in use that is not in `handled` (None: all are)."""
        return next((name for name in self.in_use() if name not in handled), None)

    def without_grid(self) -> AttentionCall:
        """The call with the grid options at their defaults (what the tiled engines and kernels see)."""
        return self.replace(mask=None, bias=None, dropout_rate=0.0, dropout_rng=None, return_weights=False)


FIELDS = tuple(f.name for f in dataclasses.fields(AttentionCall))


STATIC_FIELDS = tuple(name for name in FIELDS if name not in ARRAY_FIELDS)


class _Static:
    """A call's non-array fields in its treedef, compared field by field by identity: they may hold arrays (a
    position bias's table, DeBERTa's RowTables), which == cannot compare, and functions."""

    __slots__ = ("values",)

    def __init__(self, values: tuple):
        self.values = values

    def __eq__(self, other):
        return isinstance(other, _Static) and all(a is b for a, b in zip(self.values, other.values))

    def __hash__(self):
        return hash(tuple(map(id, self.values)))


def _flatten(call: AttentionCall):
    arrays = tuple(getattr(call, name) for name in ARRAY_FIELDS)
    return arrays, _Static(tuple(getattr(call, name) for name in STATIC_FIELDS))


def _unflatten(static: _Static, arrays) -> AttentionCall:
    # fields set as they are, not through __init__: the statics were checked when the call was built, and the
    # leaves may be placeholders while JAX rebuilds a tree
    call = object.__new__(AttentionCall)
    for name, value in (*zip(STATIC_FIELDS, static.values), *zip(ARRAY_FIELDS, arrays)):
        object.__setattr__(call, name, value)
    return call


jax.tree_util.register_pytree_node(AttentionCall, _flatten, _unflatten)
