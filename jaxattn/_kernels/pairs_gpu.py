"""Per-pair relative tables (relative_attention's A^K / A^V, seed 000's form) in the Pallas GPU kernel.

    logits[t,s] = scale * q_t . (k_s + A^K[t,s])        out_t = sum_s p[t,s] (v_s + A^V[t,s])

The tables are inputs of O(T x S) ([T,S,N,F] per head, or [T,S,1,F] shared over heads); every program reads
the [Tb,Sb,F] slice of the tile it is at, PAIR_CHUNK features at a time, and nothing forms [B,N,T,S] logits
or a [B,T,S,F] product:

    forward, grid (b, n, query tile i): for each key tile j the schedule lists
        x = softcap(scale * (q k^T + sum_f q[t,f] A^K[t,s,f]))         (inside the scale, as the XLA engines)
        out[:, c] += p @ v[:, c] + sum_s p[t,s] A^V[t,s,c]             (each feature chunk c its own partial of
                                                                       the online softmax: same m, same rescale)
    dq, grid (b, n, i):   dp = dO v^T + sum_f dO[t,f] A^V[t,s,f],  ds = scale p (dp - delta) (softcap's factor)
        dq[:, c] += ds @ k[:, c] + sum_s ds[t,s] A^K[t,s,c]
        dA^K[t,s,c] += ds[t,s] q[t,c]          dA^V[t,s,c] += p[t,s] dO[t,c]
    dk/dv, grid (b, key head, key tile j): flash_gpu's, with the tables' terms in the logits and in dp

Why chunks: a float32 [Tb,Sb,F] block at 64 x 64 x 128 is 2 MiB, far past one thread block's registers; at
the pair tiles (PAIR_BLOCKS, 16 x 16) a [Tb,Sb,PAIR_CHUNK] block is 4096 floats (32 registers a thread at 4
warps). Sums over f add chunk by chunk; the results indexed by f (the output, dq) are carried as one [Tb,w]
array per chunk (Triton cannot concatenate along a dimension), written chunk by chunk at the end.

Which kernel writes the table gradients: the dq kernel. It holds q and dO of its own query rows, which both
gradients are products with, and visits each (query tile, key tile) of its (b, n) once. With one batch entry a
per-head table's pair is that one program's: it stores its slices in the table's dtype into zeros XLA fills
(the tiles no schedule visits keep them; Pairs.key_owned / value_owned). Otherwise the batch entries (B
programs per pair) and, for a shared table, all N heads add into the same entries: atomic adds
(jax.ref.addupdate) into a float32 [Tp,Sp,N|1,Fp] array that starts at zero. Either array is an input aliased
to the output. The alternative, one program per (table head, query tile) looping over the batch and the
heads, would own its block, at the price of a grid of its own (a third recompute of the tiles) or B x N times
fewer dq programs. As with the kernel's other atomic adds, the order of those sums, and their last bits, vary
from run to run on a GPU.

What it combines with: everything the flash kernel takes that only masks or scales the logits (causal,
positions, lengths, segment ids, window, chunks, mask_mod, softcap, sinks, return_lse, grouped-query heads);
score_mod, a BlockMask, position_bias, Shaw's and DeBERTa's tables beside per-pair tables are refused by
name (unsupported), so implementation=None keeps the XLA engines for them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import jax.ref  # jax.ref.addupdate: a submodule, imported by name
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from .._core import checks, mods
from .._core.call import AttentionCall
from .._core.dtypes import accumulation_dtype
from .._core.softmax import (
    add_sinks,
    combine_partials,
    empty_partial,
    finalize_partial,
    logits_grad,
    probabilities,
)
from . import flash_gpu
from .flash import backward, plan, sizes
from .flash.config import Side
from .flash.refs import Refs
from .flash.tile_math import allowed_in_tile, capped_logits, dot, load, load_all, program_schedule, schedule, visit

# Tiles (queries x keys) on a GPU with per-pair tables, and the features of a table read at once: a float32
# [16,16,16] block is 4096 floats, 32 registers a thread at 4 warps (flash_gpu's 128 x 64 tiles would give
# 131072 per chunk). Triton's dot needs 16 or more on every side. Compiled for the H100 (ptxas -v on the
# programs' PTX, T = S = 1024, H = 64, bf16): no spills at 16 x 16 (255 / 245 / 167 registers: forward, dq,
# dk/dv); 16 x 32 spilled 1.9 KiB in the forward at 4 warps, 0.5 KiB at 8, and compiled 2 to 4 times slower.
# The interpreter takes the flash kernel's 16 x 16 tiles and 4-wide chunks (so the tests' head dims, padded
# to 8, take two chunks).
PAIR_BLOCKS = (16, 16)
PAIR_CHUNK = 16
# Triton's software pipelining holds each stage of a tile loop's loads in shared memory; a tile's table slices
# are many loads (one [Tb,Sb,16] block per chunk and table): float32 at head dim 128 asked 311424 bytes of
# shared memory over an H100's 232448 at flash_gpu's 2 stages (found compiling for the H100, "relative pairs
# f32 H128"); one stage fits.
PAIR_STAGES = 1
INTERPRET_CHUNK = 4

# Options refused beside per-pair tables: each adds a term the pair kernels do not compute (score_mod,
# position_bias, the other tables) or picks the tiles (a BlockMask's would be the pair tiles).
NOT_BESIDE_PAIRS = ("score_mod", "block_mask", "position_bias", "key_table", "value_table", "row_tables")


class Pairs(NamedTuple):
    """Static: which tables a call has, whether each is shared over heads, and the features read at once."""

    key: bool
    value: bool
    key_shared: bool
    value_shared: bool
    chunk: int
    # a table gradient that only one program writes per pair (one batch entry, one head per table head): stored
    # in the table's dtype into zeros; else added atomically into float32 zeros
    key_owned: bool = False
    value_owned: bool = False


def in_use(call: AttentionCall) -> bool:
    return call.rel_key is not None or call.rel_value is not None


def unsupported(call: AttentionCall, query, key, value, interpret=False) -> Optional[str]:
    """None when run() computes this call (which has rel_key or rel_value); else the first option it cannot
    express: NOT_BESIDE_PAIRS, the flash kernel's own refusals, and on a GPU tables wider than 32-bit floats."""
    for name in NOT_BESIDE_PAIRS:
        if getattr(call, name) is not None:
            return f"{name} (beside per-pair tables rel_key / rel_value)"
    problem = flash_gpu.unsupported(call.replace(rel_key=None, rel_value=None), query, key, value, interpret)
    if problem is not None or interpret:
        return problem
    for name in ("rel_key", "rel_value"):
        table = getattr(call, name)
        if table is not None and np.dtype(getattr(table, "dtype", np.float32)).itemsize > 4:
            return name
    return None


def pair_blocks(T: int, S: int, interpret: bool) -> tuple:
    """(Tb, Sb): PAIR_BLOCKS on a GPU (INTERPRET_BLOCK interpreted), shrunk to the next power of two of T / S
    (never below MIN_GPU_BLOCK on a GPU)."""
    wanted = (sizes.INTERPRET_BLOCK,) * 2 if interpret else PAIR_BLOCKS
    floor = 1 if interpret else sizes.MIN_GPU_BLOCK
    return tuple(min(b, max(floor, sizes.next_power_of_two(L))) for b, L in zip(wanted, (T, S)))


def run(call: AttentionCall, query, key, value, interpret):
    """pallas_gpu.attention for a call with per-pair tables (unsupported() accepts it; T, S > 0)."""
    T, S = query.shape[-3], key.shape[-3]
    p = plan.prepare(
        call.replace(rel_key=None, rel_value=None), query, key, value, interpret, blocks=pair_blocks(T, S, interpret)
    )
    N, H, Hv = query.shape[-2], query.shape[-1], value.shape[-1]
    Tp, Sp = p.cfg.Tn * p.cfg.Tb, p.cfg.Sn * p.cfg.Sb
    acc_dtype = accumulation_dtype(query.dtype)

    def padded(a, Fp):  # zeros: dropped rows, masked keys
        return None if a is None else jnp.pad(a, [(0, Tp - T), (0, Sp - S), (0, 0), (0, Fp - a.shape[3])])

    a_k, a_v = checks.check_pair_tables(call.rel_key, call.rel_value, T, S, N, H, Hv, acc_dtype)
    a_k, a_v = padded(a_k, p.q.shape[-1]), padded(a_v, p.v.shape[-1])
    chunk = INTERPRET_CHUNK if interpret else PAIR_CHUNK
    B = p.q.shape[0]
    owned = [a is not None and B == 1 and a.shape[2] == N for a in (a_k, a_v)]
    pairs = Pairs(a_k is not None, a_v is not None, _shared(a_k), _shared(a_v), chunk, *owned)
    out, lse = _attend(p.cfg, pairs, p.q, p.k, p.v, p.side, a_k, a_v)
    return plan.finish(p, out, lse, call.return_lse)


def _shared(table) -> bool:
    return table is not None and table.shape[2] == 1


# ---------------------------------------------------------------------------------------------------
# Inside the kernels: the tables' terms of one [Tb,Sb] tile.


def _width(F: int, chunk: int) -> int:
    return min(chunk, F)


def _chunks(F: int, chunk: int) -> tuple:
    """The feature slices of a padded dim F read at once (F and chunk powers of two)."""
    width = _width(F, chunk)
    return tuple(pl.ds(c, width) for c in range(0, F, width))


def _slice(ref, rows, keys, cols, head, dtype):
    """A table block's [Tb,Sb,w] slice (rows, keys, cols; `head`: the query head within a [G]-head block, None
    for a block of one head or a shared table), in the compute dtype."""
    index = (rows, keys, cols) if head is None else (rows, keys, head, cols)
    return ref[index].astype(dtype)


def _row_term(row_chunk, ref, rows, keys, head, chunks, dtype):
    """sum_f x[t,f] A[t,s,f], [Tb,Sb], a chunk of features at a time; row_chunk(cols) -> x[:, cols]."""
    total = None
    for cols in chunks:
        x = row_chunk(cols).astype(dtype)
        term = jnp.sum(x[:, None, :] * _slice(ref, rows, keys, cols, head, dtype), axis=2)
        total = term if total is None else total + term
    return total


def _pair_sum(weights, ref, rows, keys, head, cols, dtype):
    """sum_s w[t,s] A[t,s,cols]: [Tb,w]."""
    return jnp.sum(weights[:, :, None] * _slice(ref, rows, keys, cols, head, dtype), axis=1)


def _forward_kernel(pairs: Pairs, cfg, r: Refs):
    b, n = pl.program_id(0), pl.program_id(1)
    q, qp, q_seg, lengths = r.q[...], r.q_pos[...], load(r.q_seg), load(r.lengths)
    mask_consts = load_all(r.mask_consts)
    acc_dtype = accumulation_dtype(q.dtype)
    q_chunks, v_chunks = _chunks(r.q.shape[-1], pairs.chunk), _chunks(r.v.shape[-1], pairs.chunk)
    every = slice(None)

    def key_tile(kind, j, state):
        s0 = j * cfg.Sb
        keys = pl.ds(s0, cfg.Sb)
        k, kp = r.k[keys, :], r.k_pos[keys]
        k_seg = None if q_seg is None else r.k_seg[keys]
        term = None
        if pairs.key:
            term = _row_term(lambda c: r.q[:, c], r.rel_key, every, keys, None, q_chunks, acc_dtype)
        x = capped_logits(cfg, q, k, term)
        allowed = allowed_in_tile(cfg, kind, b, n, qp, kp, s0, lengths, q_seg, k_seg, mask_consts)
        if allowed is not None:
            x = jnp.where(allowed, x, -jnp.inf)
        m = jnp.max(x, axis=-1)
        p = jnp.exp(x - jnp.where(jnp.isfinite(m), m, 0)[:, None])  # masked: exp(-inf) = 0
        outs = []
        for cols in v_chunks:
            v = r.v[keys, cols]
            out = dot(p.astype(v.dtype), v, cfg)
            if pairs.value:  # the value term is linear in p: one more sum in the same partial
                out = out + _pair_sum(p, r.rel_value, every, keys, None, cols, acc_dtype)
            outs.append(out)
        return combine_partials(state, (tuple(outs), m, jnp.sum(p, axis=-1)))

    width = _width(r.v.shape[-1], pairs.chunk)
    state = empty_partial(tuple((cfg.Tb, width) for _ in v_chunks), (cfg.Tb,), acc_dtype)
    state = visit(cfg, program_schedule(r), key_tile, state)
    state = add_sinks(state, load(r.sinks))
    outs, lse = finalize_partial(state)
    for cols, out in zip(v_chunks, outs):
        r.out[:, cols] = out.astype(r.out.dtype)
    r.lse[...] = lse


def _dq_kernel(pairs: Pairs, cfg, r: Refs):
    b, n = pl.program_id(0), pl.program_id(1)
    q, qp, q_seg, lengths = r.q[...], r.q_pos[...], load(r.q_seg), load(r.lengths)
    do, lse, delta = r.do[...], r.lse[...], r.delta[...]
    mask_consts = load_all(r.mask_consts)
    acc_dtype = accumulation_dtype(q.dtype)
    q_chunks, v_chunks = _chunks(r.q.shape[-1], pairs.chunk), _chunks(r.v.shape[-1], pairs.chunk)
    every = slice(None)

    def key_tile(kind, j, dq):
        s0 = j * cfg.Sb
        keys = pl.ds(s0, cfg.Sb)
        k, v, kp = r.k[keys, :], r.v[keys, :], r.k_pos[keys]
        k_seg = None if q_seg is None else r.k_seg[keys]
        term = None
        if pairs.key:
            term = _row_term(lambda c: r.q[:, c], r.rel_key, every, keys, None, q_chunks, acc_dtype)
        capped = capped_logits(cfg, q, k, term)
        allowed = allowed_in_tile(cfg, kind, b, n, qp, kp, s0, lengths, q_seg, k_seg, mask_consts)
        p = probabilities(capped, lse[:, None], allowed)
        dp = dot(do, v, cfg, (1, 1))
        if pairs.value:  # out += p . A^V: dp += dO . A^V, and d A^V = p dO
            dp = dp + _row_term(lambda c: r.do[:, c], r.rel_value, every, keys, None, v_chunks, acc_dtype)
            for cols in v_chunks:
                d_pair = p[:, :, None] * r.do[:, cols].astype(acc_dtype)[:, None, :]
                _write(r.d_rel_value, (every, keys, cols), d_pair, pairs.value_owned)
        ds = mods.product_grad(logits_grad(p, dp, delta[:, None]), capped, cfg.softcap, cfg.scale)
        new = []
        for chunk, cols in zip(dq, q_chunks):
            chunk = chunk + dot(ds.astype(k.dtype), r.k[keys, cols], cfg)
            if pairs.key:  # logits += scale q . A^K: dq += ds . A^K, and d A^K = ds q
                chunk = chunk + _pair_sum(ds, r.rel_key, every, keys, None, cols, acc_dtype)
                d_pair = ds[:, :, None] * r.q[:, cols].astype(acc_dtype)[:, None, :]
                _write(r.d_rel_key, (every, keys, cols), d_pair, pairs.key_owned)
            new.append(chunk)
        return tuple(new)

    init = tuple(jnp.zeros((cfg.Tb, _width(r.q.shape[-1], pairs.chunk)), acc_dtype) for _ in q_chunks)
    dq = visit(cfg, program_schedule(r), key_tile, init)
    for cols, chunk in zip(q_chunks, dq):
        r.dq[:, cols] = chunk.astype(r.dq.dtype)


def _write(ref, index, values, owned: bool):
    """A table gradient's [Tb,Sb,w] slice: stored when this program owns it, else added atomically."""
    if owned:
        ref[index] = values.astype(ref.dtype)
    else:
        jax.ref.addupdate(ref, index, values)


def _dkv_kernel(pairs: Pairs, cfg, r: Refs):
    b, kh, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    G = cfg.N // cfg.K
    k, v, kp, k_seg, lengths = r.k[...], r.v[...], r.k_pos[...], load(r.k_seg), load(r.lengths)
    mask_consts = load_all(r.mask_consts)
    acc_dtype = accumulation_dtype(k.dtype)
    q_chunks, v_chunks = _chunks(r.q.shape[-1], pairs.chunk), _chunks(r.do.shape[-1], pairs.chunk)
    s0, every = j * cfg.Sb, slice(None)

    def query_tile(g, kind, i, carry):
        dk, dv = carry
        n = kh * G + g
        rows = pl.ds(i * cfg.Tb, cfg.Tb)
        q, do = r.q[rows, g, :], r.do[rows, g, :]
        lse, delta, qp = r.lse[g, rows], r.delta[g, rows], r.q_pos[rows]
        q_seg = None if k_seg is None else r.q_seg[rows]
        term = None
        if pairs.key:
            head = None if pairs.key_shared else g
            term = _row_term(lambda c: r.q[rows, g, c], r.rel_key, rows, every, head, q_chunks, acc_dtype)
        capped = capped_logits(cfg, q, k, term)
        allowed = allowed_in_tile(cfg, kind, b, n, qp, kp, s0, lengths, q_seg, k_seg, mask_consts)
        p = probabilities(capped, lse[:, None], allowed)
        dp = dot(do, v, cfg, (1, 1))
        if pairs.value:
            head = None if pairs.value_shared else g
            dp = dp + _row_term(lambda c: r.do[rows, g, c], r.rel_value, rows, every, head, v_chunks, acc_dtype)
        ds = mods.product_grad(logits_grad(p, dp, delta[:, None]), capped, cfg.softcap, cfg.scale)
        dv = dv + dot(p.astype(do.dtype), do, cfg, (0, 0))
        dk = dk + dot(ds.astype(q.dtype), q, cfg, (0, 0))
        return dk, dv

    def query_head(g, carry):  # one query head sharing key/value head kh
        h = g if cfg.head_kinds else 0
        order = None if r.order is None else (lambda idx: r.order[h, idx])  # absent: runs
        steps = schedule(lambda kind: r.counts[h, kind], order)
        return visit(cfg, steps, functools.partial(query_tile, g), carry)

    carry = (jnp.zeros(k.shape, acc_dtype), jnp.zeros(v.shape, acc_dtype))
    carry = query_head(0, carry) if G == 1 else lax.fori_loop(0, G, query_head, carry)  # a loop: flash_gpu's why
    r.dk[...] = carry[0].astype(r.dk.dtype)
    r.dv[...] = carry[1].astype(r.dv.dtype)


# ---------------------------------------------------------------------------------------------------
# pallas_call plumbing.


def _row_table_spec(cfg, table):
    """A table's block for grid (b, n, query tile i): the tile's rows, every key, head n (or the shared one):
    [Tb,Sp,Fp]."""
    shared = _shared(table)
    return pl.BlockSpec((cfg.Tb, table.shape[1], None, table.shape[3]), lambda b, n, i: (i, 0, 0 if shared else n, 0))


def _key_table_spec(cfg, table, G):
    """A table's block for grid (b, key head h, key tile j): every query row, the tile's keys, the G query heads
    of h ([Tp,Sb,G,Fp]) or the shared one ([Tp,Sb,Fp])."""
    Tp, F = table.shape[0], table.shape[3]
    if _shared(table):
        return pl.BlockSpec((Tp, cfg.Sb, None, F), lambda b, h, j: (0, j, 0, 0))
    return pl.BlockSpec((Tp, cfg.Sb, G, F), lambda b, h, j: (0, j, h, 0))


def _forward(cfg, pairs, q, k, v, side, a_k, a_v):
    """(out [B,Tp,N,Hvp] in q's dtype, lse [B,N,Tp] in the compute dtype)."""
    B, Tp, N, Hp = q.shape
    Hvp = v.shape[-1]
    inputs, specs = flash_gpu.row_inputs(cfg, side, Hp, Hvp)
    inputs.update(q=(q, specs["q"]), k=(k, specs["k"]), v=(v, specs["v"]))
    if side.sinks is not None:
        inputs["sinks"] = (side.sinks, pl.BlockSpec((None, None), lambda b, n, i: (b, n)))
    for name, table in (("rel_key", a_k), ("rel_value", a_v)):
        if table is not None:
            inputs[name] = (table, _row_table_spec(cfg, table))
    outputs = {
        "out": (
            jax.ShapeDtypeStruct((B, Tp, N, Hvp), q.dtype),
            pl.BlockSpec((None, cfg.Tb, None, Hvp), lambda b, n, i: (b, i, n, 0)),
        ),
        "lse": (
            jax.ShapeDtypeStruct((B, N, Tp), accumulation_dtype(q.dtype)),
            pl.BlockSpec((None, None, cfg.Tb), lambda b, n, i: (b, n, i)),
        ),
    }
    kernel = functools.partial(_forward_kernel, pairs)
    out, lse = flash_gpu.named_call(
        cfg, kernel, (B, N, cfg.Tn), inputs, outputs, "jaxattn_pairs_forward", num_stages=PAIR_STAGES
    )
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _attend(cfg, pairs, q, k, v, side, a_k, a_v):
    return _forward(cfg, pairs, q, k, v, side, a_k, a_v)


def _attend_fwd(cfg, pairs, q, k, v, side, a_k, a_v):
    out, lse = _forward(cfg, pairs, q, k, v, side, a_k, a_v)
    return (out, lse), (q, k, v, side, a_k, a_v, out, lse)


def _attend_bwd(cfg, pairs, res, cotangents):
    q, k, v, side, a_k, a_v, out, lse = res
    d_out, d_lse = cotangents
    B, Tp, N, Hp = q.shape
    K, Hvp = v.shape[2], v.shape[3]
    G = N // K
    acc_dtype = accumulation_dtype(q.dtype)
    d_out = d_out.astype(q.dtype)
    delta = backward.row_delta(out, d_out, d_lse, Tp, acc_dtype)  # out holds p . A^V too

    inputs, specs = flash_gpu.row_inputs(cfg, side, Hp, Hvp)
    inputs.update(
        q=(q, specs["q"]),
        k=(k, specs["k"]),
        v=(v, specs["v"]),
        do=(d_out, pl.BlockSpec((None, cfg.Tb, None, Hvp), lambda b, n, i: (b, i, n, 0))),
        lse=(lse, pl.BlockSpec((None, None, cfg.Tb), lambda b, n, i: (b, n, i))),
        delta=(delta, pl.BlockSpec((None, None, cfg.Tb), lambda b, n, i: (b, n, i))),
    )
    outputs = {
        "dq": (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            pl.BlockSpec((None, cfg.Tb, None, Hp), lambda b, n, i: (b, i, n, 0)),
        )
    }
    aliases = {}
    for name, table, owned in (("rel_key", a_k, pairs.key_owned), ("rel_value", a_v, pairs.value_owned)):
        if table is None:
            continue
        spec = _row_table_spec(cfg, table)
        inputs[name] = (table, spec)
        # zeros (the tiles no schedule visits keep them), an input aliased to the output: stored into by the one
        # program of each pair in the table's dtype, or added into atomically in float32 (module docstring)
        dtype = table.dtype if owned else acc_dtype
        inputs[f"d_{name}_zeros"] = (jnp.zeros(table.shape, dtype), spec)
        outputs[f"d_{name}"] = (jax.ShapeDtypeStruct(table.shape, dtype), spec)
        aliases[f"d_{name}_zeros"] = f"d_{name}"
    dq_kernel = functools.partial(_dq_kernel, pairs)
    dq, *d_tables = flash_gpu.named_call(
        cfg, dq_kernel, (B, N, cfg.Tn), inputs, outputs, "jaxattn_pairs_dq", aliases, PAIR_STAGES
    )
    d_tables = iter(d_tables)
    d_a_k, d_a_v = (None if t is None else next(d_tables).astype(t.dtype) for t in (a_k, a_v))

    kv_inputs = flash_gpu.key_tile_inputs(cfg, side, q, k, v, d_out, lse, delta)
    for name, table in (("rel_key", a_k), ("rel_value", a_v)):
        if table is not None:
            kv_inputs[name] = (table, _key_table_spec(cfg, table, G))
    kv_outputs = flash_gpu.key_tile_outputs(cfg, k, v)
    dkv_kernel = functools.partial(_dkv_kernel, pairs)
    dk, dv = flash_gpu.named_call(
        cfg, dkv_kernel, (B, K, cfg.Sn), kv_inputs, kv_outputs, "jaxattn_pairs_dkv", num_stages=PAIR_STAGES
    )

    d_sinks = None if side.sinks is None else backward.sinks_grad(side.sinks, lse, delta)
    d_side = Side(*(None,) * len(side))._replace(
        sinks=d_sinks, score_consts=(), mask_consts=tuple(None for _ in side.mask_consts)
    )
    return dq, dk, dv, d_side, d_a_k, d_a_v


_attend.defvjp(_attend_fwd, _attend_bwd)
