"""Flash attention for GPU: a Pallas kernel (Triton lowering), forward and FlashAttention-2 backward.

    forward, grid (b, n, query tile i):        for each key tile j the schedule lists for (b, n, i)
        x = score_mod(softcap(scale * q_i k_j^T))        [Tb,Sb], float32 (or wider)
        (out, m, l) = combine_partials((out, m, l), partial of x over the allowed pairs, v_j)
      out_i = out / l (sinks folded in), lse_i = m + log l
    dq, grid (b, n, i): p = exp(x - lse) recomputed, ds = p (dO V^T - delta), dq_i = sum_j scale ds k_j
    dk/dv, grid (b, key head kh, key tile j): over the G query heads of kh and the query tiles that see j,
        dv_j += p^T dO, dk_j += scale ds^T q                        (delta = rowsum(dO * out) - d lse)

The semantics are blockwise_attention's (its docstring), and every rule is _core's: which pairs may attend
(masks.allowed_pairs, on the tile's positions), which key tiles a query tile visits and whether they need
a mask (masks.key_block_kinds, computed per (batch, head, query tile) before the kernel, sorted into a
schedule: WITH_MOD tiles, then MASKED, then CLEAN, then skipped ones), the online-softmax merge and sinks
(softmax.combine_partials, add_sinks, finalize_partial), softcap (mods.softcap / softcap_grad), and
score_mod / mask_mod (mods.element_function traced once; mods.on_tile calls them on the tile's iota grids;
the arrays they close over are explicit kernel inputs, and the float ones get gradients: partial sums per
(b, n, query tile) from the dq kernel, added up outside).

Layout: q [B,Tp,N,Hp], k [B,Sp,K,Hp], v [B,Sp,K,Hvp] (batch dims flattened, T, S padded to whole tiles,
head dims to powers of two): a BlockSpec picks one head's [Tb,Hp] tile, and query head n reads key/value
head n // G (G = N // K) through its index map, so grouped-query attention never copies keys or values.
Padding keys are masked as past the length; padding queries are computed and sliced off.

The surface: `unsupported(query, key, value, **options)` (the first option the kernel cannot express, or
None) and `attention(query, key, value, *, interpret=False, **options)`. `interpret=True` runs the same
kernels with Pallas' interpreter on any platform (the CPU tests).
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, NamedTuple, Optional

import jax
import jax.core  # jax.core.Tracer: a submodule, imported by name so that type checkers see it
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from .._core import block_mask as block_masks
from .._core import checks, mods
from .._core.dtypes import accumulation_dtype
from .._core.masks import (
    CLEAN,
    MASKED,
    WITH_MOD,
    MaskRule,
    allowed_pairs,
    check_lengths,
    key_block_kinds,
    masks_anything,
)
from .._core.positions import positions
from .._core.softmax import (
    add_sinks,
    combine_partials,
    empty_partial,
    finalize_partial,
    has_keys,
    merge_partials,
    public_lse,
)
from .._engines.blockwise import blockwise_attention, grid_options_in_use
from .._engines.tiles import check_block_mask_tiles

# Tiles on a GPU (queries x keys): 128 x 64 up to head dim 64, 64 x 64 above (a float32 [Tb,Sb] tile plus
# q, k, v tiles must fit the registers / shared memory of one thread block); Triton's dot needs powers of
# two of at least 16. The interpreter takes any size: 16 x 16 keeps interpret-mode tests quick.
GPU_BLOCKS = {64: (128, 64), 256: (64, 64)}  # largest padded head dim -> (Tb, Sb)
# Float32 inputs with padded head dims above 128: 64 x 64 tiles overrun an H100's 227 KiB of shared memory
# per block in the backward kernels (262400 bytes asked at head dim 192, padded to 256: found compiling for
# the H100, .ci/compile_targets.py); half-size tiles fit.
WIDE_FLOAT32_BLOCKS = (32, 32)
INTERPRET_BLOCK = 16
MIN_GPU_BLOCK = 16
MAX_HEAD_DIM = 256

# Keywords whose terms need the full [T,S] grid or relative-position tables: the XLA engines take them.
_TABLE_OPTIONS = ("key_table", "value_table", "position_bias")
_OPTIONS = {
    "is_causal",
    "key_value_seq_lengths",
    "query_positions",
    "key_positions",
    "scale",
    "precision",
    "block_size",
    "query_segment_ids",
    "key_segment_ids",
    "window",
    "chunk_size",
    "logit_softcap",
    "sinks",
    "score_mod",
    "mask_mod",
    "block_mask",
    "return_lse",
    "max_distance",
    "bias",
    "mask",
    "dropout_rate",
    "dropout_rng",
    "return_weights",
    *_TABLE_OPTIONS,
}


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


# ---------------------------------------------------------------------------------------------------
# What the kernel can express.


def _is_power_of_two(n) -> bool:
    return isinstance(n, numbers.Integral) and n > 0 and (n & (n - 1)) == 0


def _block_pair(block_size):
    if block_size is None:
        return None
    return (block_size, block_size) if isinstance(block_size, numbers.Integral) else tuple(block_size)


def unsupported(query, key, value, *, interpret=False, **options) -> Optional[str]:
    """None when attention() computes this call; else the name of the first option it cannot express.

    Cheap (shapes and Python values only). Relative-position tables and biases (key_table, value_table,
    position_bias) and the full-grid options (bias, mask, dropout_rate, return_weights) are the XLA
    engines'. On a GPU (interpret=False) tiles must be powers of two >= 16 (block_size, a BlockMask's
    tiles), head dims at most 256, inputs at most 32-bit floats, scale a Python number, and score_mod /
    mask_mod must close over no array (Triton cannot index one by head or position).
    """
    for name in options:
        if name not in _OPTIONS:
            return name
    for name in _TABLE_OPTIONS:
        if options.get(name) is not None:
            return name
    in_use = grid_options_in_use(
        **{k: options[k] for k in ("bias", "mask", "dropout_rate", "dropout_rng", "return_weights") if k in options}
    )
    if in_use:
        return in_use[0]
    scale = options.get("scale")
    if (
        scale is not None
        and not isinstance(scale, numbers.Real)
        and (isinstance(scale, jax.core.Tracer) or np.ndim(scale) != 0)
    ):
        return "scale"
    if interpret:
        return None
    if np.dtype(getattr(query, "dtype", np.float32)).itemsize > 4:
        return "dtype"
    if max(np.shape(query)[-1:] + np.shape(value)[-1:], default=0) > MAX_HEAD_DIM:
        return "head_dim"
    pair = _block_pair(options.get("block_size"))
    if pair is not None and not all(_is_power_of_two(b) and b >= MIN_GPU_BLOCK for b in pair):
        return "block_size"
    block_mask = options.get("block_mask")
    if block_mask is not None:
        tiles_ok = all(_is_power_of_two(b) and b >= MIN_GPU_BLOCK for b in getattr(block_mask, "block_size", ()))
        if not tiles_ok or getattr(block_mask, "mask_consts", ()):  # mask_consts: as a mask_mod's, below
            return "block_mask"
    for name in ("score_mod", "mask_mod"):
        fn = options.get(name)
        if fn is not None and callable(fn):
            score_dtype = accumulation_dtype(getattr(query, "dtype", jnp.float32)) if name == "score_mod" else None
            traced = mods.element_function(name, fn, score_dtype)
            if traced.consts:
                return name
    return None


# ---------------------------------------------------------------------------------------------------
# Inside the kernels: one [Tb,Sb] tile.


def _dot(a, b, cfg, contract=(1, 0)):
    """a @ b over a's axis contract[0] and b's axis contract[1], accumulated in float32 (or wider)."""
    acc_dtype = accumulation_dtype(a.dtype)
    return lax.dot_general(
        a, b, (((contract[0],), (contract[1],)), ((), ())), precision=cfg.precision, preferred_element_type=acc_dtype
    )


def _capped_logits(cfg, q, k):
    """softcap(scale * q k^T): [Tb,Sb]."""
    return mods.softcap(_dot(q, k, cfg, (1, 1)) * cfg.scale, cfg.softcap)


def _score(cfg, b, n, qp, kp, capped, score_consts):
    return capped if cfg.score_fn is None else mods.on_tile(cfg.score_fn, score_consts, b, n, qp, kp, capped)


def _allowed(cfg, kind, b, n, qp, kp, s0, lengths, q_seg, k_seg, mask_consts):
    """bool [Tb,Sb] (or None: every pair allowed) of a tile of kind WITH_MOD / MASKED / CLEAN."""
    if kind == CLEAN:
        return None
    key_index = s0 + lax.broadcasted_iota(jnp.int32, (cfg.Sb,), 0)
    allowed = allowed_pairs(cfg.rule, qp, kp, key_index, lengths, q_seg, k_seg)
    if kind == WITH_MOD:
        by_mod = mods.on_tile(cfg.mask_fn, mask_consts, b, n, qp, kp)
        allowed = by_mod if allowed is None else allowed & by_mod
    return None if allowed is None else jnp.broadcast_to(allowed, (qp.shape[0], cfg.Sb))


def _visit(cfg, counts, order, body, state):
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


def _load(r, name):
    """The whole block of an optional input (None when the call has none)."""
    ref = r.get(name)
    return None if ref is None else ref[...]


def _consts(r, prefix, count):
    return tuple(r[f"{prefix}{c}"][...] for c in range(count))


def _key_tiles(cfg: Config, r, b, n, q, qp, q_seg, lengths, key_start=0):
    """The partial (out, m, l) of rows q [Tb,H] over the key tiles r's schedule lists (r["counts"],
    r["order"]; tile j holds keys key_start + j * Sb + 0..Sb-1 of the example, r["k"][j * Sb:...] of the
    block)."""
    score_consts, mask_consts = _consts(r, "score", len(cfg.score_grads)), _consts(r, "mask", cfg.n_mask_consts)

    def key_tile(kind, j, state):
        keys = pl.ds(pl.multiple_of(j * cfg.Sb, cfg.Sb), cfg.Sb)  # aligned: a TPU's dynamic slices need it
        k, v, kp = r["k"][keys, :], r["v"][keys, :], r["k_pos"][keys]
        k_seg = None if q_seg is None else r["k_seg"][keys]
        x = _score(cfg, b, n, qp, kp, _capped_logits(cfg, q, k), score_consts)
        allowed = _allowed(cfg, kind, b, n, qp, kp, key_start + j * cfg.Sb, lengths, q_seg, k_seg, mask_consts)
        if allowed is not None:
            x = jnp.where(allowed, x, -jnp.inf)
        m = jnp.max(x, axis=-1)
        p = jnp.exp(x - jnp.where(jnp.isfinite(m), m, 0)[:, None])  # masked: exp(-inf) = 0
        out = _dot(p.astype(v.dtype), v, cfg)
        return combine_partials(state, ((out,), m, jnp.sum(p, axis=-1)))

    state = empty_partial(((cfg.Tb, r["v"].shape[-1]),), (cfg.Tb,), accumulation_dtype(q.dtype))
    return _visit(cfg, lambda kind: r["counts"][kind], lambda idx: r["order"][idx], key_tile, state)


def forward_kernel(cfg: Config, r):
    """The flash forward of one (b, n, query tile): r maps input / output names to refs (_forward's; the
    TPU kernel's adapters read the same names)."""
    b, n = pl.program_id(0), pl.program_id(1)
    state = _key_tiles(cfg, r, b, n, r["q"][...], r["q_pos"][...], _load(r, "q_seg"), _load(r, "lengths"))
    state = add_sinks(state, _load(r, "sinks"))
    (out,), lse = finalize_partial(state)
    r["out"][...] = out.astype(r["out"].dtype)
    r["lse"][...] = lse


def _row_grads(cfg, x, lse, allowed, do, v, delta):
    """(p, ds) of one tile: p recomputed from the saved lse, ds = d loss / d x = p (dO v^T - delta)."""
    p = jnp.exp(x - jnp.where(has_keys(lse), lse, 0)[:, None])  # a row with no allowed key: p masked to 0
    if allowed is not None:
        p = jnp.where(allowed, p, 0)
    return p, p * (_dot(do, v, cfg, (1, 1)) - delta[:, None])


def _logit_grads(cfg, b, n, qp, kp, capped, score_consts, ds_for, with_consts):
    """Run the tile backward from the capped logits: returns (p, d loss / d (scale q k^T), d float consts).

    ds_for(x) -> (p, ds) at the final logits x; the score_mod's vjp and softcap's derivative take ds back
    to the product q k^T (times scale: the scale applies to ds here, once)."""
    d_consts = None
    if cfg.score_fn is None:
        p, ds = ds_for(capped)
    else:
        floats = tuple(c for c, g in zip(score_consts, cfg.score_grads) if g)

        def score(x, floats):
            it = iter(floats)
            consts = tuple(next(it) if g else c for c, g in zip(score_consts, cfg.score_grads))
            return _score(cfg, b, n, qp, kp, x, consts)

        if with_consts:
            x, score_vjp = jax.vjp(score, capped, floats)
        else:  # the dk/dv kernel: the consts' gradients come from the dq kernel
            x, vjp_x = jax.vjp(lambda x: score(x, floats), capped)
            score_vjp = lambda ds: (vjp_x(ds)[0], None)  # noqa: E731
        p, ds = ds_for(x)
        ds, d_consts = score_vjp(ds)
    if cfg.softcap is not None:
        ds = ds * mods.softcap_grad(capped, cfg.softcap)
    return p, ds * cfg.scale, d_consts


def _dq_kernel(cfg: Config, r):
    b, n = pl.program_id(0), pl.program_id(1)
    q, qp, q_seg, lengths = r["q"][...], r["q_pos"][...], _load(r, "q_seg"), _load(r, "lengths")
    do, lse, delta = r["do"][...], r["lse"][...], r["delta"][...]
    score_consts, mask_consts = _consts(r, "score", len(cfg.score_grads)), _consts(r, "mask", cfg.n_mask_consts)
    acc_dtype = accumulation_dtype(q.dtype)

    def key_tile(kind, j, carry):
        dq, d_consts = carry
        s0 = j * cfg.Sb
        keys = pl.ds(s0, cfg.Sb)
        k, v, kp = r["k"][keys, :], r["v"][keys, :], r["k_pos"][keys]
        k_seg = None if q_seg is None else r["k_seg"][keys]
        allowed = _allowed(cfg, kind, b, n, qp, kp, s0, lengths, q_seg, k_seg, mask_consts)
        _, ds, d_c = _logit_grads(
            cfg,
            b,
            n,
            qp,
            kp,
            _capped_logits(cfg, q, k),
            score_consts,
            lambda x: _row_grads(cfg, x, lse, allowed, do, v, delta),
            True,
        )
        dq = dq + _dot(ds.astype(k.dtype), k, cfg)
        if d_c is not None:
            d_consts = tuple(a + g.astype(a.dtype) for a, g in zip(d_consts, d_c))
        return dq, d_consts

    floats = tuple(c for c, g in zip(score_consts, cfg.score_grads) if g)
    init = (jnp.zeros(q.shape, acc_dtype), tuple(jnp.zeros(c.shape, acc_dtype) for c in floats))
    dq, d_consts = _visit(cfg, lambda kind: r["counts"][kind], lambda idx: r["order"][idx], key_tile, init)
    r["dq"][...] = dq.astype(r["dq"].dtype)
    for c, d in enumerate(d_consts):
        r[f"d_score{c}"][...] = d


def _dkv_kernel(cfg: Config, r):
    b, kh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    G = cfg.N // cfg.K
    k, v, kp, k_seg = r["k"][...], r["v"][...], r["k_pos"][...], _load(r, "k_seg")
    lengths = _load(r, "lengths")
    score_consts, mask_consts = _consts(r, "score", len(cfg.score_grads)), _consts(r, "mask", cfg.n_mask_consts)
    acc_dtype = accumulation_dtype(k.dtype)
    s0 = j * cfg.Sb

    def query_tile(g, kind, i, carry):
        dk, dv = carry
        n = kh * G + g
        rows = pl.ds(i * cfg.Tb, cfg.Tb)
        q, do = r["q"][rows, g, :], r["do"][rows, g, :]
        lse, delta, qp = r["lse"][g, rows], r["delta"][g, rows], r["q_pos"][rows]
        q_seg = None if k_seg is None else r["q_seg"][rows]
        allowed = _allowed(cfg, kind, b, n, qp, kp, s0, lengths, q_seg, k_seg, mask_consts)
        p, ds, _ = _logit_grads(
            cfg,
            b,
            n,
            qp,
            kp,
            _capped_logits(cfg, q, k),
            score_consts,
            lambda x: _row_grads(cfg, x, lse, allowed, do, v, delta),
            False,
        )
        dv = dv + _dot(p.astype(do.dtype), do, cfg, (0, 0))
        dk = dk + _dot(ds.astype(q.dtype), q, cfg, (0, 0))
        return dk, dv

    carry = (jnp.zeros(k.shape, acc_dtype), jnp.zeros(v.shape, acc_dtype))
    for g in range(G):  # the query heads sharing key/value head kh
        h = g if cfg.head_kinds else 0
        carry = _visit(
            cfg,
            lambda kind, h=h: r["t_counts"][h, kind],
            lambda idx, h=h: r["t_order"][h, idx],
            functools.partial(query_tile, g),
            carry,
        )
    r["dk"][...] = carry[0].astype(r["dk"].dtype)
    r["dv"][...] = carry[1].astype(r["dv"].dtype)


# ---------------------------------------------------------------------------------------------------
# pallas_call plumbing: named inputs, each with its BlockSpec.


def _call(cfg, kernel, grid, inputs, outputs, name):
    """pallas_call of kernel(cfg, refs by name); inputs / outputs: {name: (array or ShapeDtypeStruct, spec)},
    None values left out."""
    inputs = {k: v for k, v in inputs.items() if v is not None}
    names = tuple(inputs) + tuple(outputs)

    def body(*refs):
        kernel(cfg, dict(zip(names, refs)))

    return pl.pallas_call(
        body,
        grid=grid,
        in_specs=[spec for _, spec in inputs.values()],
        out_specs=[spec for _, spec in outputs.values()],
        out_shape=[shape for shape, _ in outputs.values()],
        interpret=cfg.interpret,
        compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=2),
        name=name,
    )(*[x for x, _ in inputs.values()])


def _whole(x):
    """Every program reads all of x (a score_mod / mask_mod const)."""
    return x, pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim)


def pick(batched, b):
    """b when the array is batched (one row per batch entry), else its single row 0."""
    return b if batched else 0


def _row_inputs(cfg, side, Hp, Hvp):
    """Inputs shared by the forward and dq kernels (grid b, n, i): positions, lengths, segments, consts,
    the forward schedule; q / k / v specs."""
    G = cfg.N // cfg.K
    bq, bk, bs, bl, bsched = cfg.batched
    Sp = cfg.Sn * cfg.Sb
    inputs = {
        "q_pos": (side.q_pos, pl.BlockSpec((None, cfg.Tb), lambda b, n, i: (pick(bq, b), i))),
        "k_pos": (side.k_pos, pl.BlockSpec((None, Sp), lambda b, n, i: (pick(bk, b), 0))),
        "lengths": None
        if side.lengths is None
        else (side.lengths, pl.BlockSpec((None,), lambda b, n, i: (pick(bl, b),))),
        "q_seg": None
        if side.q_seg is None
        else (side.q_seg, pl.BlockSpec((None, cfg.Tb), lambda b, n, i: (pick(bs, b), i))),
        "k_seg": None
        if side.k_seg is None
        else (side.k_seg, pl.BlockSpec((None, Sp), lambda b, n, i: (pick(bs, b), 0))),
        "order": (
            side.order,
            pl.BlockSpec((None, None, None, cfg.Sn), lambda b, n, i: (pick(bsched, b), pick(cfg.head_kinds, n), i, 0)),
        ),
        "counts": (
            side.counts,
            pl.BlockSpec((None, None, None, 4), lambda b, n, i: (pick(bsched, b), pick(cfg.head_kinds, n), i, 0)),
        ),
    }
    inputs.update({f"score{c}": _whole(x) for c, x in enumerate(side.score_consts)})
    inputs.update({f"mask{c}": _whole(x) for c, x in enumerate(side.mask_consts)})
    specs = dict(
        q=pl.BlockSpec((None, cfg.Tb, None, Hp), lambda b, n, i: (b, i, n, 0)),
        k=pl.BlockSpec((None, Sp, None, Hp), lambda b, n, i: (b, 0, n // G, 0)),
        v=pl.BlockSpec((None, Sp, None, Hvp), lambda b, n, i: (b, 0, n // G, 0)),
    )
    return inputs, specs


def _forward(cfg, q, k, v, side):
    """(out [B,Tp,N,Hvp] in q's dtype, lse [B,N,Tp] in the compute dtype)."""
    B, Tp, N, Hp = q.shape
    Hvp = v.shape[-1]
    inputs, specs = _row_inputs(cfg, side, Hp, Hvp)
    inputs.update(q=(q, specs["q"]), k=(k, specs["k"]), v=(v, specs["v"]))
    if side.sinks is not None:
        inputs["sinks"] = (side.sinks, pl.BlockSpec((None, None), lambda b, n, i: (b, n)))
    acc_dtype = accumulation_dtype(q.dtype)
    outputs = {
        "out": (
            jax.ShapeDtypeStruct((B, Tp, N, Hvp), q.dtype),
            pl.BlockSpec((None, cfg.Tb, None, Hvp), lambda b, n, i: (b, i, n, 0)),
        ),
        "lse": (
            jax.ShapeDtypeStruct((B, N, Tp), acc_dtype),
            pl.BlockSpec((None, None, cfg.Tb), lambda b, n, i: (b, n, i)),
        ),
    }
    return tuple(_call(cfg, forward_kernel, (B, N, cfg.Tn), inputs, outputs, "jaxattn_flash_forward"))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(cfg, q, k, v, side):
    return _forward(cfg, q, k, v, side)


def _flash_fwd(cfg, q, k, v, side):
    out, lse = _forward(cfg, q, k, v, side)
    return (out, lse), (q, k, v, side, out, lse)


def _flash_bwd(cfg, res, cotangents):
    q, k, v, side, out, lse = res
    d_out, d_lse = cotangents
    B, Tp, N, Hp = q.shape
    K, Hvp = v.shape[2], v.shape[3]
    G = N // K
    acc_dtype = accumulation_dtype(q.dtype)
    d_out = d_out.astype(q.dtype)
    # d loss / d x = p (dp - sum_s p dp) + p d_lse, and sum_s p dp = d_out . out: one delta per row
    delta = jnp.einsum("btnv,btnv->bnt", d_out.astype(acc_dtype), out.astype(acc_dtype)) - d_lse.astype(acc_dtype)

    inputs, specs = _row_inputs(cfg, side, Hp, Hvp)
    inputs.update(
        q=(q, specs["q"]),
        k=(k, specs["k"]),
        v=(v, specs["v"]),
        do=(d_out, pl.BlockSpec((None, cfg.Tb, None, Hvp), lambda b, n, i: (b, i, n, 0))),
        lse=(lse, pl.BlockSpec((None, None, cfg.Tb), lambda b, n, i: (b, n, i))),
        delta=(delta, pl.BlockSpec((None, None, cfg.Tb), lambda b, n, i: (b, n, i))),
    )
    floats = [c for c, g in zip(side.score_consts, cfg.score_grads) if g]
    outputs = {
        "dq": (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            pl.BlockSpec((None, cfg.Tb, None, Hp), lambda b, n, i: (b, i, n, 0)),
        )
    }
    for c, x in enumerate(floats):  # partial sums per (b, n, query tile), added up below
        outputs[f"d_score{c}"] = (
            jax.ShapeDtypeStruct((B, N, cfg.Tn, *x.shape), acc_dtype),
            pl.BlockSpec((None, None, None, *x.shape), lambda b, n, i, nd=x.ndim: (b, n, i) + (0,) * nd),
        )
    dq, *d_floats = _call(cfg, _dq_kernel, (B, N, cfg.Tn), inputs, outputs, "jaxattn_flash_dq")

    bq, bk, bs, bl, bsched = cfg.batched
    heads = G if cfg.head_kinds else 1
    kv_inputs = {
        "q": (q, pl.BlockSpec((None, Tp, G, Hp), lambda b, h, j: (b, 0, h, 0))),
        "do": (d_out, pl.BlockSpec((None, Tp, G, Hvp), lambda b, h, j: (b, 0, h, 0))),
        "lse": (lse, pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0))),
        "delta": (delta, pl.BlockSpec((None, G, Tp), lambda b, h, j: (b, h, 0))),
        "k": (k, pl.BlockSpec((None, cfg.Sb, None, Hp), lambda b, h, j: (b, j, h, 0))),
        "v": (v, pl.BlockSpec((None, cfg.Sb, None, Hvp), lambda b, h, j: (b, j, h, 0))),
        "q_pos": (side.q_pos, pl.BlockSpec((None, Tp), lambda b, h, j: (pick(bq, b), 0))),
        "k_pos": (side.k_pos, pl.BlockSpec((None, cfg.Sb), lambda b, h, j: (pick(bk, b), j))),
        "lengths": None
        if side.lengths is None
        else (side.lengths, pl.BlockSpec((None,), lambda b, h, j: (pick(bl, b),))),
        "q_seg": None
        if side.q_seg is None
        else (side.q_seg, pl.BlockSpec((None, Tp), lambda b, h, j: (pick(bs, b), 0))),
        "k_seg": None
        if side.k_seg is None
        else (side.k_seg, pl.BlockSpec((None, cfg.Sb), lambda b, h, j: (pick(bs, b), j))),
        "t_order": (
            side.t_order,
            pl.BlockSpec((None, heads, None, cfg.Tn), lambda b, h, j: (pick(bsched, b), pick(cfg.head_kinds, h), j, 0)),
        ),
        "t_counts": (
            side.t_counts,
            pl.BlockSpec((None, heads, None, 4), lambda b, h, j: (pick(bsched, b), pick(cfg.head_kinds, h), j, 0)),
        ),
    }
    kv_inputs.update({f"score{c}": _whole(x) for c, x in enumerate(side.score_consts)})
    kv_inputs.update({f"mask{c}": _whole(x) for c, x in enumerate(side.mask_consts)})
    kv_outputs = {
        "dk": (
            jax.ShapeDtypeStruct(k.shape, k.dtype),
            pl.BlockSpec((None, cfg.Sb, None, Hp), lambda b, h, j: (b, j, h, 0)),
        ),
        "dv": (
            jax.ShapeDtypeStruct(v.shape, v.dtype),
            pl.BlockSpec((None, cfg.Sb, None, Hvp), lambda b, h, j: (b, j, h, 0)),
        ),
    }
    dk, dv = _call(cfg, _dkv_kernel, (B, K, cfg.Sn), kv_inputs, kv_outputs, "jaxattn_flash_dkv")

    d_sinks = None
    if side.sinks is not None:  # d out_t / d sink = -p_sink[t] out_t, so d sink = -sum_t p_sink[t] delta_t
        d_sinks = -jnp.sum(jnp.exp(side.sinks[..., None] - lse) * delta, axis=-1).astype(side.sinks.dtype)
    it = iter(d_floats)
    d_score = tuple(
        jnp.sum(next(it), axis=(0, 1, 2)).astype(c.dtype) if g else None
        for c, g in zip(side.score_consts, cfg.score_grads)
    )
    d_side = Side(
        None, None, None, None, None, d_sinks, d_score, tuple(None for _ in side.mask_consts), None, None, None, None
    )
    return dq, dk, dv, d_side


_flash.defvjp(_flash_fwd, _flash_bwd)


# ---------------------------------------------------------------------------------------------------
# The entry point: checks, layout, schedules.


def _next_power_of_two(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def tile_sizes(block_size, T: int, S: int, Hp: int, interpret: bool, itemsize: int = 2) -> tuple:
    """(Tb, Sb): block_size as given, else GPU_BLOCKS by head dim (WIDE_FLOAT32_BLOCKS for 4-byte inputs
    wider than 128, INTERPRET_BLOCK when interpreted), shrunk to the next power of two of T / S (never below
    MIN_GPU_BLOCK on a GPU)."""
    pair = _block_pair(block_size)
    if pair is not None:
        for b in pair:
            if isinstance(b, bool) or not isinstance(b, numbers.Integral) or b <= 0:
                checks.fail("block_size", "an int > 0 or a pair of them", repr(block_size))
        return int(pair[0]), int(pair[1])
    if interpret:
        wanted = (INTERPRET_BLOCK, INTERPRET_BLOCK)
    elif itemsize > 2 and Hp > 128:
        wanted = WIDE_FLOAT32_BLOCKS
    else:
        wanted = next(blocks for dim, blocks in sorted(GPU_BLOCKS.items()) if Hp <= dim or dim == MAX_HEAD_DIM)
    floor = 1 if interpret else MIN_GPU_BLOCK
    return tuple(min(b, max(floor, _next_power_of_two(L))) for b, L in zip(wanted, (T, S)))


def _padded_head(H: int, interpret: bool) -> int:
    return _next_power_of_two(H) if interpret else max(MIN_GPU_BLOCK, _next_power_of_two(H))


def _rows(x, batch, length, padded):
    """[...,L] (broadcastable to the batch dims) -> [B|1, L padded] (edge-padded: padding repeats the last)."""
    if x.ndim > 1:
        x = jnp.broadcast_to(x, (*batch, length)).reshape(-1, length)
    else:
        x = x[None]
    return jnp.pad(x, [(0, 0), (0, padded - length)], mode="edge")


def _kernel_layout(x, batch, length, padded, F):
    """[...,L,K,H] -> [B, L padded, K, F padded] (zeros)."""
    x = jnp.broadcast_to(x, (*batch, *x.shape[-3:])).reshape(-1, *x.shape[-3:])
    return jnp.pad(x, [(0, 0), (0, padded - length), (0, 0), (0, F - x.shape[-1])])


def _tile_kinds(cfg, Bs, q_pos, k_pos, lengths, q_seg, k_seg, tile_kinds):
    """The key-tile kinds of every (batch, head, query tile), int32 [Bs,Ns,Tn,Sn] (Bs = B when a batched
    array decides them, Ns = N with a per-head BlockMask; [1,1,Tn,Sn] when nothing masks)."""
    rule, Tn, Sn, Tb, Sb = cfg.rule, cfg.Tn, cfg.Sn, cfg.Tb, cfg.Sb
    mask_mod = cfg.mask_fn is not None
    if not masks_anything(rule, lengths, q_seg, tile_kinds, mask_mod):
        return jnp.full((1, 1, Tn, Sn), CLEAN, jnp.int32)

    def rows(x, *shape):
        return None if x is None else jnp.broadcast_to(x, (Bs, *x.shape[1:])).reshape(Bs, *shape)

    qp, qs = rows(q_pos, Tn, Tb), rows(q_seg, Tn, Tb)
    kp, ks, ln = rows(k_pos, Sn * Sb), rows(k_seg, Sn * Sb), rows(lengths)

    def one(qp, kp, ln, qs, ks, tk=None):  # one (batch, head, query tile)
        return key_block_kinds(
            rule,
            qp,
            kp,
            None if ln is None else ln[None],
            Sb,
            Sn,
            query_segments=None if qs is None else qs[None],
            key_segments=None if ks is None else ks[None],
            block_kinds=tk,
            mask_mod=mask_mod,
        )

    tiles = (0, None, None, 0, None)
    if tile_kinds is None:
        return jax.vmap(jax.vmap(one, in_axes=tiles))(qp, kp, ln, qs, ks)[:, None]
    per_head = jax.vmap(jax.vmap(one, in_axes=tiles + (0,)), in_axes=(None,) * 5 + (0,))
    return jax.vmap(per_head)(qp, kp, ln, qs, ks, rows(tile_kinds, *tile_kinds.shape[1:]))


def _sorted_kinds(kinds):
    """(order, counts) over the last axis: the tiles' indices sorted by kind (WITH_MOD, MASKED, CLEAN, then
    skipped ones), and how many of each kind ([...,4]; the last, SKIPPED, is never read)."""
    order = jnp.argsort(kinds, axis=-1, stable=True).astype(jnp.int32)
    counts = jnp.stack(
        [jnp.sum(kinds == kind, axis=-1, dtype=jnp.int32) for kind in (WITH_MOD, MASKED, CLEAN)]
        + [jnp.zeros(kinds.shape[:-1], jnp.int32)],
        axis=-1,
    )
    return order, counts


def _schedules(cfg, Bs, q_pos, k_pos, lengths, q_seg, k_seg, tile_kinds):
    """_tile_kinds sorted into (order, counts) for the forward / dq kernels and, transposed, for the dk/dv
    kernel: (order, counts, t_order, t_counts)."""
    kinds = _tile_kinds(cfg, Bs, q_pos, k_pos, lengths, q_seg, k_seg, tile_kinds)
    return _sorted_kinds(kinds) + _sorted_kinds(jnp.swapaxes(kinds, -1, -2))


class _Call(NamedTuple):
    """One call's checked inputs, before the kernels' layout: shapes and the options as arrays / statics."""

    batch: tuple
    T: int
    S: int
    N: int
    K: int
    H: int
    Hv: int
    query_positions: Any
    key_positions: Any
    lengths: Any  # int32 [B] (capped at S) or None
    q_seg: Any
    k_seg: Any
    sinks: Any  # [B,N] in the compute dtype, or None
    rule: MaskRule
    scale: float
    softcap: Optional[float]
    precision: Any


def _checked_call(query, key, value, o) -> _Call:
    """The shapes and options every kernel here reads, checked (ValueError naming the option)."""
    batch, T, S, N, K, H, Hv = checks.check_qkv(query, key, value)
    B = int(np.prod(batch, dtype=np.int64))
    q_pos, k_pos = positions(T, S, o.get("query_positions"), o.get("key_positions"))
    checks.check_broadcastable("query_positions", q_pos, (*batch, T), "[...,T]")
    checks.check_broadcastable("key_positions", k_pos, (*batch, S), "[...,S]")
    lengths = check_lengths(o.get("key_value_seq_lengths"), batch)
    if lengths is not None:
        lengths = jnp.minimum(jnp.broadcast_to(lengths, batch).reshape(-1), S).astype(jnp.int32)
    q_seg, k_seg = mods.check_segment_ids(o.get("query_segment_ids"), o.get("key_segment_ids"), batch, T, S)
    acc_dtype = accumulation_dtype(query.dtype)
    sinks = mods.check_sinks(o.get("sinks"), batch, N, acc_dtype)
    if sinks is not None:
        sinks = jnp.broadcast_to(sinks, (*batch, N)).reshape(B, N).astype(acc_dtype)
    rule = MaskRule(
        is_causal=bool(o.get("is_causal", False)),
        window=mods.check_window(o.get("window")),
        chunk_size=mods.check_chunk_size(o.get("chunk_size")),
    )
    precision = o.get("precision")
    if precision == "highest":
        precision = lax.Precision.HIGHEST
    scale = H**-0.5 if o.get("scale") is None else float(o["scale"])
    return _Call(
        tuple(batch),
        T,
        S,
        N,
        K,
        H,
        Hv,
        q_pos,
        k_pos,
        lengths,
        q_seg,
        k_seg,
        sinks,
        rule,
        scale,
        mods.check_softcap(o.get("logit_softcap")),
        precision,
    )


def _padded_rows(call: _Call, Tp: int, Sp: int):
    """(q_pos [B|1,Tp], k_pos [B|1,Sp], lengths [B|1] or None, q_seg [B|1,Tp], k_seg [B|1,Sp]): positions and
    segment ids edge-padded, and lengths that mask the padding keys past S."""
    batch, T, S = call.batch, call.T, call.S
    q_pos, k_pos = _rows(call.query_positions, batch, T, Tp), _rows(call.key_positions, batch, S, Sp)
    lengths = call.lengths
    if lengths is None and Sp != S:
        lengths = jnp.full((1,), S, jnp.int32)  # the padding keys past S
    q_seg, k_seg = call.q_seg, call.k_seg
    if q_seg is not None:
        q_seg, k_seg = _rows(q_seg, batch, T, Tp), _rows(k_seg, batch, S, Sp)
        if q_seg.shape[0] != k_seg.shape[0]:
            B = max(q_seg.shape[0], k_seg.shape[0])
            q_seg, k_seg = (jnp.broadcast_to(x, (B, x.shape[1])) for x in (q_seg, k_seg))
    return q_pos, k_pos, lengths, q_seg, k_seg


def attention(query, key, value, *, interpret=False, **options):
    """blockwise_attention's call (its keywords and semantics) computed by the Pallas GPU kernel.

    query [...,T,N,H], key [...,S,K,H], value [...,S,K,Hv] -> [...,T,N,Hv] in query's dtype, or
    (out, lse [...,N,T]) with return_lse=True. interpret=True runs Pallas' interpreter (any platform).
    Options the kernel cannot express (unsupported) raise ValueError naming the option.

    A few query rows against a long key axis (use_decode: a decode step against a cache) take the
    split-key kernel (decode_attention) forward; their gradient, if asked for, is the flash kernel's.
    """
    return _attention(query, key, value, interpret, options, split_keys=True)


def flash_attention(query, key, value, *, interpret=False, **options):
    """attention() by the flash kernels whatever the shapes (never the split-key kernel): for comparisons
    (benchmarks/accelerator.py's decode rows)."""
    return _attention(query, key, value, interpret, options, split_keys=False)


def _attention(query, key, value, interpret, options, split_keys: bool):
    problem = unsupported(query, key, value, interpret=interpret, **options)
    if problem is not None:
        checks.fail(
            "implementation",
            f'the XLA engines ("dense", "blockwise" or None) with {problem}: the Pallas GPU kernel cannot express it',
            '"pallas_gpu"',
        )
    o = dict(options)
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    batch, T, S, N, K, H, Hv = checks.check_qkv(query, key, value)
    if T == 0 or S == 0:  # no tile to run: the XLA engine's zeros (and its lse of the sinks alone)
        return blockwise_attention(query, key, value, **{k: v for k, v in o.items() if k not in ("block_size",)})
    if split_keys and use_decode(query, key, value, interpret=interpret, **o):
        return _decode_with_flash_gradient(query, key, value, interpret, o)
    return _flash_attention(query, key, value, interpret, o)


class Prepared(NamedTuple):
    """The flash kernels' inputs for one call (prepare): q [B,Tp,N,Hp], k [B,Sp,K,Hp], v [B,Sp,K,Hvp]."""

    cfg: Config
    q: Any
    k: Any
    v: Any
    side: Side
    batch: tuple
    T: int
    N: int
    Hv: int


def _flash_attention(query, key, value, interpret, o):
    """attention() by the flash kernels (forward and backward)."""
    p = prepare(query, key, value, o, interpret)
    out, lse = _flash(p.cfg, p.q, p.k, p.v, p.side)
    return finish(p, out, lse, o.get("return_lse", False))


def finish(p: Prepared, out, lse, return_lse: bool):
    """The kernel's out [B,Tp,N,Hvp] and lse [B,N,Tp] -> the public result ([...,T,N,Hv], lse [...,N,T])."""
    batch, T, N, Hv = p.batch, p.T, p.N, p.Hv
    out = out[:, :T, :, :Hv].reshape(*batch, T, N, Hv)
    if return_lse:
        return out, public_lse(lse[..., :T].reshape(*batch, N, T))  # -inf for a row with no key
    return out


def prepare(query, key, value, o, interpret, blocks=None, head_multiple=None) -> Prepared:
    """Checks, tiles, layout and key-tile schedules of one call for the flash kernels (forward_kernel's
    inputs). blocks: (Tb, Sb) instead of tile_sizes' (a BlockMask's tiles still win); head_multiple: pad
    head dims to a multiple of it (a TPU's lane width) rather than to a power of two."""
    call = _checked_call(query, key, value, o)
    batch, T, S, N, K, H, Hv = call[:7]
    B = int(np.prod(batch, dtype=np.int64))
    acc_dtype = accumulation_dtype(query.dtype)
    mask_mod, block_mask, block_size = o.get("mask_mod"), o.get("block_mask"), o.get("block_size")
    if block_mask is not None:  # its tiles are the kernel's tiles; its own mask_mod applies (resolve)
        block_masks.check_block_mask(block_mask, B, N, T, S)
        block_size = check_block_mask_tiles(block_mask, block_size)
        mask_mod, block_mask = block_masks.resolve(mask_mod, block_mask)
    if head_multiple is None:
        Hp, Hvp = _padded_head(H, interpret), _padded_head(Hv, interpret)
    else:
        Hp, Hvp = (-(-x // head_multiple) * head_multiple for x in (H, Hv))
    if blocks is not None and block_mask is None:
        Tb, Sb = blocks
    else:
        Tb, Sb = tile_sizes(block_size, T, S, max(Hp, Hvp), interpret, np.dtype(query.dtype).itemsize)
    Tn, Sn = -(-T // Tb), -(-S // Sb)
    Tp, Sp = Tn * Tb, Sn * Sb
    q_pos, k_pos, lengths, q_seg, k_seg = _padded_rows(call, Tp, Sp)
    score_fn = mods.element_function("score_mod", o.get("score_mod"), acc_dtype)
    mask_fn = mods.element_function("mask_mod", mask_mod)
    tile_kinds = None if block_mask is None else block_masks.tile_kinds(block_mask).astype(jnp.int32)
    score_consts = () if score_fn is None else tuple(jnp.asarray(c) for c in score_fn.consts)
    mask_consts = () if mask_fn is None else tuple(jnp.asarray(c) for c in mask_fn.consts)

    Bs = max([1] + [x.shape[0] for x in (q_pos, k_pos, lengths, q_seg, tile_kinds) if x is not None])
    cfg = Config(
        Tb=Tb,
        Sb=Sb,
        Tn=Tn,
        Sn=Sn,
        N=N,
        K=K,
        rule=call.rule,
        scale=call.scale,
        softcap=call.softcap,
        score_fn=None if score_fn is None else score_fn.fn,
        mask_fn=None if mask_fn is None else mask_fn.fn,
        score_grads=mods.differentiable(score_consts),
        n_mask_consts=len(mask_consts),
        batched=(),
        head_kinds=tile_kinds is not None and tile_kinds.shape[1] > 1,
        precision=call.precision,
        interpret=bool(interpret),
        num_warps=4 if max(Hp, Hvp) <= 64 else 8,
    )
    order, counts, t_order, t_counts = _schedules(cfg, Bs, q_pos, k_pos, lengths, q_seg, k_seg, tile_kinds)
    cfg = cfg._replace(batched=tuple(x is not None and x.shape[0] > 1 for x in (q_pos, k_pos, q_seg, lengths, order)))
    side = Side(
        q_pos, k_pos, lengths, q_seg, k_seg, call.sinks, score_consts, mask_consts, order, counts, t_order, t_counts
    )

    q = _kernel_layout(query, batch, T, Tp, Hp)
    k, v = _kernel_layout(key, batch, S, Sp, Hp), _kernel_layout(value, batch, S, Sp, Hvp)
    return Prepared(cfg, q, k, v, side, batch, T, N, Hv)


# ---------------------------------------------------------------------------------------------------
# Split-key (flash-decoding) forward: a few query rows against a long key axis.
#
# The flash grid is (b, n, query tile): with T within one query tile (a decode step) that is B * N
# programs, each streaming the whole key axis, e.g. 32 programs for B = 1, N = 32 on a GPU with 108-132
# SMs. Here the key axis is split into chunks: grid (b, key/value head, chunk), each program computes the
# partial (out, m, l) of the G * T query rows of its key/value head (the G query heads of a group read
# each K/V tile once) over its chunk's scheduled tiles; merge_partials combines the chunks in XLA.
# When attention() takes it (use_decode) is a design choice from that occupancy argument, not measured
# (no GPU here): the flash grid has fewer than DECODE_PROGRAMS programs (two per SM of a 132-SM H100), the
# rows of a key/value head fit one tile, and the key axis holds at least two minimum chunks.
DECODE_PROGRAMS = 264
DECODE_MAX_ROWS = 64  # G * T query rows of one key/value head in one program (a [rows, Sb] logits tile)
DECODE_MIN_CHUNK = 256  # keys per program at least (a power of two): fewer would spend more on the merge
# Options the decode kernel does not take (the flash kernel does: attention() routes such calls there).
_NOT_DECODE = ("score_mod", "mask_mod", "block_mask")
# Array-valued options (the custom VJP's differentiable / integer inputs).
_ARRAY_OPTIONS = (
    "query_positions",
    "key_positions",
    "key_value_seq_lengths",
    "query_segment_ids",
    "key_segment_ids",
    "sinks",
)


def decode_unsupported(query, key, value, *, interpret=False, **options) -> Optional[str]:
    """None when decode_attention computes this call; else the first option it cannot express: the flash
    kernel's refusals (unsupported), score_mod / mask_mod / block_mask, and on a GPU more than
    DECODE_MAX_ROWS query rows per key/value head (G * T)."""
    problem = unsupported(query, key, value, interpret=interpret, **options)
    if problem is not None:
        return problem
    for name in _NOT_DECODE:
        if options.get(name) is not None:
            return name
    T, N, K = np.shape(query)[-3], np.shape(query)[-2], np.shape(key)[-2]
    if not interpret and K and T * (N // K) > DECODE_MAX_ROWS:
        return f"query ({T} rows x {N // K} heads per key/value head > {DECODE_MAX_ROWS})"
    return None


def use_decode(query, key, value, *, interpret=False, **options) -> bool:
    """attention()'s choice of the split-key kernel: decode_attention expresses the call, the G * T rows
    of a key/value head fit one tile, the flash grid (B * N * query tiles) has fewer than DECODE_PROGRAMS
    programs and S >= 2 * DECODE_MIN_CHUNK (the occupancy argument above; not measured)."""
    if decode_unsupported(query, key, value, interpret=interpret, **options) is not None:
        return False
    *batch, T, N, H = np.shape(query)
    S, K = np.shape(key)[-3], np.shape(key)[-2]
    Tb, _ = tile_sizes(options.get("block_size"), T, S, _padded_head(max(H, np.shape(value)[-1]), interpret), interpret)
    flash_programs = int(np.prod(batch, dtype=np.int64)) * N * -(-T // Tb)
    return T * (N // K) <= DECODE_MAX_ROWS and flash_programs < DECODE_PROGRAMS and S >= 2 * DECODE_MIN_CHUNK


def decode_tiles(block_size, key_chunk, B: int, K: int, S: int, Hp: int, interpret: bool) -> tuple:
    """(Sb, Sc): the key tile (block_size's key part, else the flash kernel's) and the keys per program:
    key_chunk, else a power of two >= DECODE_MIN_CHUNK giving about DECODE_PROGRAMS programs (B * K * chunks)."""
    _, Sb = tile_sizes(block_size, 1, S, Hp, interpret)
    if key_chunk is None:
        wanted = -(-DECODE_PROGRAMS // max(B * K, 1))
        return Sb, max(Sb, DECODE_MIN_CHUNK, _next_power_of_two(-(-S // wanted)))
    if (
        isinstance(key_chunk, bool)
        or not isinstance(key_chunk, numbers.Integral)
        or key_chunk <= 0
        or (key_chunk % Sb)
        or (not interpret and not _is_power_of_two(key_chunk))
    ):
        checks.fail(
            "key_chunk",
            f"a multiple of the key tile {Sb} ({'' if interpret else 'a power of two, '}> 0)",
            repr(key_chunk),
        )
    return Sb, int(key_chunk)


def _decode_kernel(cfg: Config, r):
    b, c = pl.program_id(0), pl.program_id(2)
    (out,), m, l = _key_tiles(
        cfg,
        r,
        b,
        None,
        r["q"][...],
        r["q_pos"][...],
        _load(r, "q_seg"),
        _load(r, "lengths"),
        key_start=c * cfg.Sn * cfg.Sb,
    )
    r["out"][...], r["m"][...], r["l"][...] = out, m, l


def _decode_partials(cfg, q, k, v, q_pos, k_pos, lengths, q_seg, k_seg, order, counts):
    """Per (b, key/value head, chunk): out [B,K,C,Rp,Hvp] (unnormalised), m and l [B,K,C,Rp]."""
    B, K, Rp, Hp = q.shape
    Sc, C, Hvp = cfg.Sn * cfg.Sb, k.shape[1] // (cfg.Sn * cfg.Sb), v.shape[-1]
    bq, bk, bs, bl, bsched = cfg.batched
    inputs = {
        "q": (q, pl.BlockSpec((None, None, Rp, Hp), lambda b, h, c: (b, h, 0, 0))),
        "k": (k, pl.BlockSpec((None, Sc, None, Hp), lambda b, h, c: (b, c, h, 0))),
        "v": (v, pl.BlockSpec((None, Sc, None, Hvp), lambda b, h, c: (b, c, h, 0))),
        "q_pos": (q_pos, pl.BlockSpec((None, Rp), lambda b, h, c: (pick(bq, b), 0))),
        "k_pos": (k_pos, pl.BlockSpec((None, Sc), lambda b, h, c: (pick(bk, b), c))),
        "lengths": None if lengths is None else (lengths, pl.BlockSpec((None,), lambda b, h, c: (pick(bl, b),))),
        "q_seg": None if q_seg is None else (q_seg, pl.BlockSpec((None, Rp), lambda b, h, c: (pick(bs, b), 0))),
        "k_seg": None if k_seg is None else (k_seg, pl.BlockSpec((None, Sc), lambda b, h, c: (pick(bs, b), c))),
        "order": (order, pl.BlockSpec((None, None, cfg.Sn), lambda b, h, c: (pick(bsched, b), c, 0))),
        "counts": (counts, pl.BlockSpec((None, None, 4), lambda b, h, c: (pick(bsched, b), c, 0))),
    }
    acc_dtype = accumulation_dtype(q.dtype)
    rows = pl.BlockSpec((None, None, None, Rp), lambda b, h, c: (b, h, c, 0))
    outputs = {
        "out": (
            jax.ShapeDtypeStruct((B, K, C, Rp, Hvp), acc_dtype),
            pl.BlockSpec((None, None, None, Rp, Hvp), lambda b, h, c: (b, h, c, 0, 0)),
        ),
        "m": (jax.ShapeDtypeStruct((B, K, C, Rp), acc_dtype), rows),
        "l": (jax.ShapeDtypeStruct((B, K, C, Rp), acc_dtype), rows),
    }
    return tuple(_call(cfg, _decode_kernel, (B, K, C), inputs, outputs, "jaxattn_decode_split_key"))


def decode_attention(query, key, value, *, interpret=False, key_chunk=None, **options):
    """attention()'s call by the split-key (flash-decoding) kernel: forward only (no custom VJP of its own;
    attention() differentiates through the flash kernel). Meant for a few query rows against a long key
    axis; any T works. key_chunk: keys per program (default: decode_tiles). What it cannot express
    (decode_unsupported) raises ValueError naming the option."""
    problem = decode_unsupported(query, key, value, interpret=interpret, **options)
    if problem is not None:
        checks.fail(
            "implementation",
            f"the flash kernel or the XLA engines with {problem}: the split-key decode kernel cannot express it",
            '"pallas_gpu" decode_attention',
        )
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    call = _checked_call(query, key, value, options)
    batch, T, S, N, K, H, Hv = call[:7]
    if T == 0 or S == 0:
        return blockwise_attention(query, key, value, **{k: v for k, v in options.items() if k != "block_size"})
    B, G = int(np.prod(batch, dtype=np.int64)), N // K
    Hp, Hvp = _padded_head(H, interpret), _padded_head(Hv, interpret)
    Sb, Sc = decode_tiles(options.get("block_size"), key_chunk, B, K, S, max(Hp, Hvp), interpret)
    C, tiles = -(-S // Sc), Sc // Sb
    R = G * T  # the rows of one key/value head: query head kh * G + g, query t -> row g * T + t
    Rp = _next_power_of_two(R) if interpret else max(MIN_GPU_BLOCK, _next_power_of_two(R))  # padded as on a GPU
    q_pos, k_pos, lengths, q_seg, k_seg = _padded_rows(call, T, C * Sc)

    Bs = max([1] + [x.shape[0] for x in (q_pos, k_pos, lengths, q_seg) if x is not None])
    cfg = Config(
        Tb=T,
        Sb=Sb,
        Tn=1,
        Sn=C * tiles,
        N=N,
        K=K,
        rule=call.rule,
        scale=call.scale,
        softcap=call.softcap,
        score_fn=None,
        mask_fn=None,
        score_grads=(),
        n_mask_consts=0,
        batched=(),
        head_kinds=False,
        precision=call.precision,
        interpret=bool(interpret),
        num_warps=4 if max(Hp, Hvp) <= 64 else 8,
    )
    kinds = _tile_kinds(cfg, Bs, q_pos, k_pos, lengths, q_seg, k_seg, None)[:, 0, 0]  # all T rows: one tile
    order, counts = _sorted_kinds(kinds.reshape(kinds.shape[0], C, tiles))  # per chunk, chunk-local indices

    def group_rows(x):  # [B|1,T] -> [B|1,Rp]: each row's value for the G heads, edge-padded
        return None if x is None else jnp.pad(jnp.tile(x, (1, G)), [(0, 0), (0, Rp - R)], mode="edge")

    cfg = cfg._replace(
        Tb=Rp, Sn=tiles, batched=tuple(x is not None and x.shape[0] > 1 for x in (q_pos, k_pos, q_seg, lengths, order))
    )
    q = _kernel_layout(query, batch, T, T, Hp).reshape(B, T, K, G, Hp)
    q = jnp.pad(q.transpose(0, 2, 3, 1, 4).reshape(B, K, R, Hp), [(0, 0), (0, 0), (0, Rp - R), (0, 0)])
    k, v = _kernel_layout(key, batch, S, C * Sc, Hp), _kernel_layout(value, batch, S, C * Sc, Hvp)
    out, m, l = _decode_partials(
        cfg, q, k, v, group_rows(q_pos), k_pos, lengths, group_rows(q_seg), k_seg, order, counts
    )
    (out,), m, l = merge_partials(((out[:, :, :, :R],), m[..., :R], l[..., :R]), axis=2)  # [B,K,R,Hvp], [B,K,R]
    heads = lambda x: x.reshape(B, N, T, *x.shape[3:])  # noqa: E731  [B,K,G*T,...] -> [B,N,T,...]
    partial = add_sinks(((heads(out),), heads(m), heads(l)), None if call.sinks is None else call.sinks[..., None])
    (out,), lse = finalize_partial(partial)
    out = jnp.swapaxes(out, 1, 2)[..., :Hv].astype(query.dtype).reshape(*batch, T, N, Hv)
    if options.get("return_lse", False):
        return out, public_lse(lse.reshape(*batch, N, T))
    return out


def _decode_with_flash_gradient(query, key, value, interpret, o):
    """decode_attention forward; a gradient runs the flash kernels (forward again, then backward)."""
    arrays = {k: jnp.asarray(o[k]) for k in _ARRAY_OPTIONS if o.get(k) is not None}
    static = tuple(sorted((k, v) for k, v in o.items() if k not in arrays))
    return _decode_forward(static, bool(interpret), query, key, value, arrays)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _decode_forward(static, interpret, query, key, value, arrays):
    return decode_attention(query, key, value, interpret=interpret, **dict(static), **arrays)


def _decode_forward_fwd(static, interpret, query, key, value, arrays):
    return _decode_forward(static, interpret, query, key, value, arrays), (query, key, value, arrays)


def _decode_forward_bwd(static, interpret, residuals, cotangent):
    def flash(query, key, value, arrays):
        return _flash_attention(query, key, value, interpret, {**dict(static), **arrays})

    return jax.vjp(flash, *residuals)[1](cotangent)


_decode_forward.defvjp(_decode_forward_fwd, _decode_forward_bwd)
