"""The flash forward's body, shared by the Pallas GPU kernels (flash_gpu, decode_gpu) and the TPU flex kernel
(flex_tpu): one program's loop over the key tiles its schedule lists, and the pieces of one [Tb,Sb] tile.

    forward, grid (b, n, query tile i):        for each key tile j the schedule lists for (b, n, i)
        x = score_mod(softcap(scale * q_i k_j^T) + bias)  [Tb,Sb], float32 (or wider)
            bias: an OffsetBias's rows gathered at j - i (T5, ALiBi), when the call has one (or the kernel's
            own r["offset_bias_of_tile"](j): flex_tpu slices the rows without a gather)
        (out, m, l) = combine_partials((out, m, l), partial of x over the allowed pairs, v_j)
      out_i = out / l (sinks folded in), lse_i = m + log l

Every rule is _core's: which pairs may attend (masks.allowed_pairs, on the tile's positions), the schedule's
order of key tiles (WITH_MOD tiles, then MASKED, then CLEAN, then skipped ones), the online-softmax merge and
sinks (softmax.combine_partials, add_sinks, finalize_partial), softcap (mods.softcap), and score_mod /
mask_mod (mods.on_tile calls them on the tile's iota grids). A kernel reads its refs by name (r["q"],
r["k_pos"], r["order"], ...): each kernel's pallas_call builds that dict from its own layout.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .._core import mods
from .._core.dtypes import accumulation_dtype
from .._core.masks import CLEAN, MASKED, WITH_MOD, MaskRule, allowed_pairs
from .._core.softmax import add_sinks, combine_partials, empty_partial, finalize_partial


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
    # an OffsetBias (T5, ALiBi): (lo, hi, batched), its rows r["offset_bias"] [B|1,N,D] hold the bias of
    # offsets j - i = lo..hi (batched: one set per batch entry); None: no position bias
    offset_bias: Any = None


class Side(NamedTuple):
    """The kernels' inputs besides q, k, v: positions [B|1,Tp] / [B|1,Sp], lengths [B], segment ids
    [B|1,Tp] / [B|1,Sp], sinks [B,N], score_mod / mask_mod consts, and the key-tile schedules (forward /
    dq: order [Bs,Ns,Tn,Sn] and counts [Bs,Ns,Tn,4]; dk/dv: over query tiles, [Bs,Ns,Sn,Tn] and [Bs,Ns,Sn,4])."""

    q_pos: Any
    k_pos: Any
    lengths: Any
    q_seg: Any
    k_seg: Any
    sinks: Any
    score_consts: tuple
    mask_consts: tuple
    order: Any
    counts: Any
    t_order: Any
    t_counts: Any
    offset_bias: Any = None  # [B|1,N,D] in the compute dtype (Config.offset_bias), or None


# ---------------------------------------------------------------------------------------------------
# Inside the kernels: one [Tb,Sb] tile.


def dot(a, b, cfg, contract=(1, 0)):
    """a @ b over a's axis contract[0] and b's axis contract[1], accumulated in float32 (or wider)."""
    acc_dtype = accumulation_dtype(a.dtype)
    return lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), ((), ())), precision=cfg.precision, preferred_element_type=acc_dtype
    )


def capped_logits(cfg, q, k):
    """softcap(scale * q k^T): [Tb,Sb]."""
    return mods.softcap(dot(q, k, cfg, (1, 1)) * cfg.scale, cfg.softcap)


def offset_index(cfg, qp, kp):
    """int32 [Tb,Sb]: the row of the offset-bias rows each pair reads, clip(j - i, lo, hi) - lo. The clip is
    exact (OffsetBias.offset_range: the bias is constant beyond the range) and keeps every gather in bounds,
    padding rows and columns included."""
    lo, hi, _ = cfg.offset_bias
    return jnp.clip(kp[None, :] - qp[:, None], lo, hi) - lo


def offset_bias_tile(ref, index, head=None):
    """The position bias of a tile, float [Tb,Sb]: a gather from the rows of one head (ref: the block of one
    (b, n), [D], or with `head` of a group of heads, [G,D]) at `index` (offset_index)."""
    return ref[index] if head is None else ref[head, index]


def apply_score_mod(cfg, b, n, qp, kp, capped, score_consts):
    return capped if cfg.score_fn is None else mods.on_tile(cfg.score_fn, score_consts, b, n, qp, kp, capped)


def allowed_in_tile(cfg, kind, b, n, qp, kp, s0, lengths, q_seg, k_seg, mask_consts):
    """bool [Tb,Sb] (or None: every pair allowed) of a tile of kind WITH_MOD / MASKED / CLEAN."""
    if kind == CLEAN:
        return None
    key_index = s0 + lax.broadcasted_iota(jnp.int32, (cfg.Sb,), 0)
    allowed = allowed_pairs(cfg.rule, qp, kp, key_index, lengths, q_seg, k_seg)
    if kind == WITH_MOD:
        by_mod = mods.on_tile(cfg.mask_fn, mask_consts, b, n, qp, kp)
        allowed = by_mod if allowed is None else allowed & by_mod
    return None if allowed is None else jnp.broadcast_to(allowed, (qp.shape[0], cfg.Sb))


def visit(cfg, counts, order, body, state):
    """body(kind, tile, state) over the scheduled tiles: one loop per kind, each with a static body.
    counts(kind) / order(index) read the schedule's scalars."""
    start = 0
    for kind in (WITH_MOD, MASKED, CLEAN):
        if kind == WITH_MOD and cfg.mask_fn is None:
            continue
        stop = start + counts(kind)
        state = lax.fori_loop(start, stop, lambda idx, st, kind=kind: body(kind, order(idx), st), state)
        start = stop
    return state


def load(r, name):
    """The whole block of an optional input (None when the call has none)."""
    ref = r.get(name)
    return None if ref is None else ref[...]


def load_consts(r, prefix, count):
    return tuple(r[f"{prefix}{c}"][...] for c in range(count))


def key_tiles(cfg: Config, r, b, n, q, qp, q_seg, lengths, key_start=0):
    """The partial (out, m, l) of rows q [Tb,H] over the key tiles r's schedule lists (r["counts"],
    r["order"]; tile j holds keys key_start + j * Sb + 0..Sb-1 of the example, r["k"][j * Sb:...] of the
    block)."""
    score_consts, mask_consts = load_consts(r, "score", len(cfg.score_grads)), load_consts(r, "mask", cfg.n_mask_consts)

    def key_tile(kind, j, state):
        keys = pl.ds(pl.multiple_of(j * cfg.Sb, cfg.Sb), cfg.Sb)  # aligned: a TPU's dynamic slices need it
        k, v, kp = r["k"][keys, :], r["v"][keys, :], r["k_pos"][keys]
        k_seg = None if q_seg is None else r["k_seg"][keys]
        x = capped_logits(cfg, q, k)
        if cfg.offset_bias is not None:  # the position bias: after softcap, before score_mod
            build = r.get("offset_bias_of_tile")  # a kernel's own construction, j -> [Tb,Sb] (flex_tpu: no gather)
            x = x + (offset_bias_tile(r["offset_bias"], offset_index(cfg, qp, kp)) if build is None else build(j))
        x = apply_score_mod(cfg, b, n, qp, kp, x, score_consts)
        allowed = allowed_in_tile(cfg, kind, b, n, qp, kp, key_start + j * cfg.Sb, lengths, q_seg, k_seg, mask_consts)
        if allowed is not None:
            x = jnp.where(allowed, x, -jnp.inf)
        m = jnp.max(x, axis=-1)
        p = jnp.exp(x - jnp.where(jnp.isfinite(m), m, 0)[:, None])  # masked: exp(-inf) = 0
        out = dot(p.astype(v.dtype), v, cfg)
        return combine_partials(state, ((out,), m, jnp.sum(p, axis=-1)))

    state = empty_partial(((cfg.Tb, r["v"].shape[-1]),), (cfg.Tb,), accumulation_dtype(q.dtype))
    return visit(cfg, lambda kind: r["counts"][kind], lambda idx: r["order"][idx], key_tile, state)


def forward_kernel(cfg: Config, r):
    """The flash forward of one (b, n, query tile): r maps input / output names to refs (flash_gpu's
    forward; flex_tpu's adapters read the same names)."""
    b, n = pl.program_id(0), pl.program_id(1)
    state = key_tiles(cfg, r, b, n, r["q"][...], r["q_pos"][...], load(r, "q_seg"), load(r, "lengths"))
    state = add_sinks(state, load(r, "sinks"))
    (out,), lse = finalize_partial(state)
    r["out"][...] = out.astype(r["out"].dtype)
    r["lse"][...] = lse


def pick(batched, b):
    """b when the array is batched (one row per batch entry), else its single row 0."""
    return b if batched else 0
