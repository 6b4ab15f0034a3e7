"""The blockwise engine's named values: its static configuration (Config, with the programmable
Terms) and what one query tile reads (QueryTile, KeySide, Shared, Side, RowGrads) and adds into
(Grads). The ring engine builds the same values to drive fwd_tile / bwd_tile on its chunks.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

from ..._core.masks import MaskRule


class Terms(NamedTuple):
    """The static programmable terms (jaxattn._core.mods); their arrays travel in Side."""

    softcap: Optional[float] = None
    score_fn: Optional[Callable] = None  # ElementFunction.fn: score_mod(score, b, n, t, s, *consts)
    mask_fn: Optional[Callable] = None  # ElementFunction.fn: mask_mod(b, n, t, s, *consts)
    segments: bool = False
    block_kinds: bool = False


class Side(NamedTuple):
    """Arrays of the programmable terms in the engine layout: segment ids [B|1,Tp] / [B|1,Sp], sinks
    [B,K,G], the score_mod / mask_mod consts, BlockMask tile kinds [Tn,Sn] int8 (reduced over batch rows
    and heads, which share a tile). The tile functions get one query tile's view (vjp.py)."""

    q_seg: Any = None
    k_seg: Any = None
    sinks: Any = None
    score_consts: tuple = ()
    mask_consts: tuple = ()
    kinds: Any = None


class Config(NamedTuple):
    """Static (hashable) description of one engine run: tiles, heads and which terms are on."""

    Tb: int
    Sb: int
    N: int
    rule: MaskRule  # the position rule (causal, window, chunks): _core.masks decides every pair from it
    max_distance: Optional[int]  # Shaw tables' clip distance (None: no tables)
    contiguous: bool  # default positions: key_pos - query_pos = offset0 + s - t within every tile
    precision: Any
    bias_fn: Optional[Callable]  # closure-converted position_bias(q_pos, k_pos, *consts)
    terms: Terms = Terms()


class KeySide(NamedTuple):
    """Every key a query tile runs against, in the engine layout: k [B,K,Sp,H], v [B,K,Sp,Hv], their
    absolute positions pos [Sp] or [B,Sp], and lengths [B|1] (valid keys from key 0; None: every key)."""

    k: Any
    v: Any
    pos: Any
    lengths: Any = None


class Shared(NamedTuple):
    """What every tile reads besides its keys: Shaw tables key_table / value_table ([R,(N,)F] or None),
    the position hook's arrays hook_consts, scale (None: the queries were scaled before the engine), and
    per-pair tables pair_key / pair_value ([T,S,N|1,F] unpadded, or None; tile (i, j) reads its slice)."""

    key_table: Any = None
    value_table: Any = None
    hook_consts: tuple = ()
    scale: Any = None
    pair_key: Any = None
    pair_value: Any = None


class QueryTile(NamedTuple):
    """One query tile: q [B,K,G,Tb,H], its absolute positions pos [Tb] or [B,Tb], its view of the
    Side (its rows of the segment ids and of the BlockMask's tile kinds), and row0, the index of its
    first query row (where it reads per-pair tables)."""

    q: Any
    pos: Any
    arrays: Side = Side()
    row0: Any = 0


class RowGrads(NamedTuple):
    """What the backward of one query tile reads per row: d_out [B,K,G,Tb,Hv], the forward's lse
    [B,K,G,Tb], delta = rowsum(d_out * out) - d_lse [B,K,G,Tb] (d_lse: the cotangent of lse, zero when only
    the output is used), and the forward's bucket sums of p over every key value_buckets [B,K,G,Tb,R]
    (fwd_tile's with_buckets; None: formed again tile by tile)."""

    d_out: Any
    lse: Any
    delta: Any
    value_buckets: Any = None


class Grads(NamedTuple):
    """Gradient accumulators (compute dtype) that bwd_tile adds into: dk / dv shaped as the KeySide's k / v,
    the tables', the hook arrays', and score_mod's consts' (() without a score_mod)."""

    dk: Any
    dv: Any
    key_table: Any = None
    value_table: Any = None
    hook_consts: tuple = ()
    score_consts: tuple = ()
    pair_key: Any = None
    pair_value: Any = None
