"""The flash kernels' static description of one run (Config, with Extents and Tables) and their inputs besides
q, k and v (Side): what plan.prepare computes for one call and every kernel body reads."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from ..._core.masks import (
    MaskRule,
)


class Config(NamedTuple):
    """Static (hashable) description of one kernel run."""

    Tb: int
    Sb: int
    Tn: int
    Sn: int
    N: int
    K: int
    rule: MaskRule
    scale: float
    softcap: Optional[float]
    score_fn: Any  # mods.ElementProgram or None
    mask_fn: Any
    score_grads: tuple  # per score_mod const: True when it is a float array (it gets a gradient)
    n_mask_consts: int
    batched: tuple  # (q_pos, k_pos, segments, lengths, schedule): which carry a batch axis B (else 1)
    head_kinds: bool  # the schedule has a head axis (a per-head BlockMask)
    precision: Any
    interpret: bool
    num_warps: int
    # a position bias in the kernel (offset_bias.KERNEL_BIASES: T5, ALiBi, Swin / BEiT windows): (index, batched),
    # its rows r.offset_bias [B|1,N,D] read at index(q_pos, k_pos) (a static function: OffsetIndex,
    # WindowIndex; batched: one set of rows per batch entry); None: no position bias
    offset_bias: Any = None
    tables: Any = None  # Shaw tables: a Tables, or None
    # Shaw's key table on the windowed route (windows_gpu.Window: each tile's key term from the window of table
    # rows between its rows and columns, Side.window_table), or None
    window: Any = None
    # the forward writes lse (r.lse [Tb]): the backward's residual, or the caller's return_lse. False: a
    # forward-only call of the GPU flash kernel without return_lse, which then has no lse output at all
    write_lse: bool = True
    # q, k, v and out (do, dq, dk, dv) as the caller's arrays, not padded to whole tiles: their Extents (the
    # GPU flash kernels); None: padded by prepare (the TPU flex kernel, the per-pair tables' kernels)
    extents: Any = None


class Extents(NamedTuple):
    """The GPU flash kernels read q, k, v and write out (and the backward's do, dq, dk, dv) where the caller's
    arrays are, unpadded: T query rows, S key rows, head dims H and Hv; the kernels' blocks span whole tiles and
    head dims Hp, Hvp (powers of two, as Triton's loads need). A tile that runs past an array reads zeros there,
    as the padding copies held, and writes nothing (read, write): Pallas' Triton lowering does not bound a
    block by its array, the kernel's mask does."""

    T: int
    S: int
    H: int
    Hv: int
    Hp: int
    Hvp: int

    def of(self, name: str) -> tuple:
        """(rows, columns) of the array behind the ref `name`."""
        rows = self.T if name in ("q", "do", "out", "dq") else self.S
        columns = self.H if name in ("q", "dq", "k", "dk") else self.Hv
        return rows, columns


class Tables(NamedTuple):
    """A call's Shaw tables in the kernels (tables_gpu): offsets lo..hi reach the tables' rows, column c =
    clip(j - i, lo, hi) - lo of Dp per query row. key_term: r.row_bias [B,N,Tp,Dp] holds q_t . key_table
    at column c; value_term: r.row_sums receives the sums of p by column.

    DeBERTa's tables (row_tables.RowTables) read the same arrays at another column: mapped, c =
    r.column_map[clip(j - i, lo, hi) - lo] (the scheme's rows of the band's offsets, an int32 gather; the
    bucket formula stays in the scheme), and key_row_term adds a per-KEY-row term, r.key_row_bias
    [B,N,Sp,Dp] = k_s . query_table at column c (its gradient summed by column per key row in the dk/dv
    kernel)."""

    lo: int
    hi: int
    Dp: int
    key_term: bool
    value_term: bool
    mapped: bool = False
    key_row_term: bool = False


def key_term_in(cfg) -> bool:
    return cfg.tables is not None and cfg.tables.key_term


def value_term_in(cfg) -> bool:
    return cfg.tables is not None and cfg.tables.value_term


def key_row_term_in(cfg) -> bool:
    return cfg.tables is not None and cfg.tables.key_row_term


class Side(NamedTuple):
    """The kernels' inputs besides q, k, v: positions [B|1,Tp] / [B|1,Sp], lengths [B], segment ids
    [B|1,Tp] / [B|1,Sp], sinks [B,N], score_mod / mask_mod consts, and the key-tile schedules (forward /
    dq: order [Bs,Ns,Tn,Sn] and counts [Bs,Ns,Tn,4]; dk/dv: over query tiles, [Bs,Ns,Sn,Tn] and [Bs,Ns,Sn,4]);
    a compact schedule has no order (None) and its counts hold runs instead (schedule(), masks.tile_runs)."""

    q_pos: Any = None
    k_pos: Any = None
    lengths: Any = None
    q_seg: Any = None
    k_seg: Any = None
    sinks: Any = None
    score_consts: tuple = ()
    mask_consts: tuple = ()
    order: Any = None
    counts: Any = None
    t_order: Any = None
    t_counts: Any = None
    offset_bias: Any = None  # [B|1,N,D] in the compute dtype (Config.offset_bias), or None
    row_bias: Any = None  # Shaw's key term QA [B,N,Tp,Dp] in the compute dtype (Config.tables), or None
    column_map: Any = None  # int32 [M]: the column of each offset lo..hi (Tables.mapped), or None
    key_row_bias: Any = None  # the per-key-row term KB [B,N,Sp,Dp] in the compute dtype (Tables.key_row_term)
    window_table: Any = None  # Shaw's key table [Nt,R,Hp] in the compute dtype (Config.window), or None
