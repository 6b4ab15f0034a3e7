"""What a flash kernel body reads and writes, typed: its refs by role (Refs; an input the call does not have, or an
output the kernel does not write, is None) and the hooks through which a kernel built on the shared bodies puts its
own construction of a tile's terms in place of the default gather (ForwardHooks, DqHooks, DkvHooks; an absent hook
is None: the body's own rule). A pallas_call assembles its operands by name (call.named_call); bind() turns the
refs it receives back into these tuples, so a misspelt name fails when the kernel is traced, not as a silent None.

Hook names say the tile they build and take one signature each:

    forward   bias_of_key_tile(j) -> [Tb,Sb]             the position bias of key tile j
              table_logits_of_key_tile(j, k) -> [Tb,Sb]  the table terms inside q k^T
              table_values_of_key_tile(j, p) -> [Tb,Hv]  the value term sum_s p A^V
    dq        bias_of_key_tile(j), add_bias_grad(j, d_bias)
              table_terms_of_key_tile(j, k) -> (key terms [Tb,Sb], the value term's dp [Tb,Sb]), each or None
              add_table_grads(j, k, p, ds) -> the tile's share of dq [Tb,H], or None
              finish_dq(dq) -> dq
    dk/dv     bias_of_query_tile(g, i) -> [Tb,Sb]        query head g of the group, query tile i
              table_terms_of_query_tile(g, i, q, do) -> (key terms, dp)
              dk_of_query_tile(g, i, ds) -> [Sb,H]       a per-key-row term's share of dk
              query_head: the grid's query head (one head per program), or None: the kernel loops over G
"""

from __future__ import annotations

import re
from typing import Any, Callable, NamedTuple, Optional


class Refs(NamedTuple):
    """A flash kernel's refs (blocks of one program) by role; None where absent. Shapes are the blocks'."""

    # q k^T, p v and their cotangents
    q: Any = None
    k: Any = None
    v: Any = None
    do: Any = None
    lse: Any = None  # the forward's output; the backward's input
    delta: Any = None  # rowsum(dO * out) - d lse
    out: Any = None
    m: Any = None  # the split-key decode kernel's partial max and sum
    l: Any = None  # noqa: E741
    dq: Any = None
    dk: Any = None
    dv: Any = None
    # which pairs may attend
    q_pos: Any = None
    k_pos: Any = None
    q_seg: Any = None
    k_seg: Any = None
    lengths: Any = None
    sinks: Any = None
    order: Any = None  # the program's schedule (forward, dq: over key tiles; dk/dv: over query tiles), or None:
    counts: Any = None  # a compact schedule, runs in counts (tile_math.schedule)
    score_consts: tuple = ()  # the arrays score_mod / mask_mod close over
    mask_consts: tuple = ()
    d_score: tuple = ()  # partial gradients of score_mod's float consts
    # position terms (config.Config.offset_bias, Config.tables; pairs_gpu: per-pair tables)
    offset_bias: Any = None
    d_offset_bias: Any = None
    row_bias: Any = None
    d_row_bias: Any = None
    row_sums: Any = None
    d_row_sums: Any = None
    column_map: Any = None
    key_row_bias: Any = None
    d_key_row_bias: Any = None
    rel_key: Any = None
    rel_value: Any = None
    d_rel_key: Any = None
    d_rel_value: Any = None
    window_table: Any = None  # windows_gpu: the key table [Nt,R,Hp], its gradient, a program's [Tb,Wp] scratch
    d_window_table: Any = None
    window_scratch: Any = None


class ForwardHooks(NamedTuple):
    bias_of_key_tile: Optional[Callable] = None
    table_logits_of_key_tile: Optional[Callable] = None
    table_values_of_key_tile: Optional[Callable] = None


class DqHooks(NamedTuple):
    bias_of_key_tile: Optional[Callable] = None
    add_bias_grad: Optional[Callable] = None
    table_terms_of_key_tile: Optional[Callable] = None
    add_table_grads: Optional[Callable] = None
    finish_dq: Optional[Callable] = None


class DkvHooks(NamedTuple):
    bias_of_query_tile: Optional[Callable] = None
    table_terms_of_query_tile: Optional[Callable] = None
    dk_of_query_tile: Optional[Callable] = None
    query_head: Any = None


def merged(*hooks):
    """One hooks tuple from several of one type (a bias's, a table's): each hook set by at most one of them."""
    fields = {}
    for h in hooks:
        for name, fn in h._asdict().items():
            if fn is not None:
                if name in fields:
                    raise ValueError(f"two constructions of the kernel hook {name}")
                fields[name] = fn
    return type(hooks[0])(**fields)


_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def bind(names, refs, *kinds):
    """Refs received in the order of `names` -> one tuple per kind (NamedTuple classes, Refs first): each takes
    the names that are its fields; `name{c}` fills entry c of a tuple field `name` (score_consts0, d_score1).
    A name no kind has raises: the assembly and the body disagree. A name None is skipped."""
    by_kind = [dict() for _ in kinds]
    for name, ref in zip(names, refs):
        if name is None:  # an operand the kernel does not read (an aliased output's seed)
            continue
        for fields, kind in zip(by_kind, kinds):
            numbered = _NUMBERED.match(name)
            if name in kind._fields:
                fields[name] = ref
                break
            if numbered and numbered.group(1) in kind._fields:
                fields.setdefault(numbered.group(1), []).append((int(numbered.group(2)), ref))
                break
        else:
            raise ValueError(f"a kernel operand named {name!r} that no ref tuple ({[k.__name__ for k in kinds]}) has")
    bound = []
    for fields, kind in zip(by_kind, kinds):
        for name, value in fields.items():
            if isinstance(value, list):
                fields[name] = tuple(ref for _, ref in sorted(value, key=lambda pair: pair[0]))
        bound.append(kind(**fields))
    return bound[0] if len(bound) == 1 else tuple(bound)
