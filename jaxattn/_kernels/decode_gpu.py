"""Split-key (flash-decoding) forward for GPU, a Pallas kernel (Triton lowering): a few query rows against a
long key axis.

The flash grid is (b, n, query tile): with T within one query tile (a decode step) that is B * N
programs, each streaming the whole key axis, e.g. 32 programs for B = 1, N = 32 on a GPU with 108-132
SMs. Here the key axis is split into chunks: grid (b, key/value head, chunk), each program computes the
partial (out, m, l) of the G * T query rows of its key/value head (the G query heads of a group read
each K/V tile once) over its chunk's scheduled tiles (forward.key_tiles); merge_partials combines the
chunks in XLA. The checks, layout and tile schedules are the flash kernel's (flash_gpu); a gradient runs the
flash kernels (decode_with_flash_gradient).

When pallas_gpu.attention takes it (use_decode) is a design choice from that occupancy argument, not
measured (no GPU here): the flash grid has fewer than DECODE_PROGRAMS programs (two per SM of a 132-SM
H100), the rows of a key/value head fit one tile, and the key axis holds at least two minimum chunks.
"""

from __future__ import annotations

import functools
import numbers
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from .._core import checks
from .._core.call import AttentionCall
from .._core.dtypes import accumulation_dtype
from .._core.softmax import add_sinks, finalize_partial, merge_partials, public_lse
from .._engines import blockwise
from .flash import call as flash_call
from .flash.config import Config, Extents, Side
from .flash.forward import key_tiles
from .flash.plan import checked, kernel_layout, key_tile_kinds, padded_rows, sorted_kinds
from .flash.refs import ForwardHooks, Refs
from .flash.sizes import MIN_GPU_BLOCK, is_power_of_two, next_power_of_two, padded_head, tile_sizes
from .flash.tile_math import load, pick
from .flash_gpu import named_call, run, unsupported

# The occupancy choice of use_decode (module docstring).
DECODE_PROGRAMS = 264
DECODE_MAX_ROWS = 64  # G * T query rows of one key/value head in one program (a [rows, Sb] logits tile)
DECODE_MIN_CHUNK = 256  # keys per program at least (a power of two): fewer would spend more on the merge
# Options the decode kernel does not take (the flash kernel does: pallas_gpu.attention routes them there).
_NOT_DECODE = ("score_mod", "mask_mod", "block_mask", "position_bias", "key_table", "value_table", "row_tables")


def decode_unsupported(call: AttentionCall, query, key, value, interpret=False) -> Optional[str]:
    """None when decode_attention computes this call; else the first option it cannot express: the flash
    kernel's refusals (unsupported), score_mod / mask_mod / block_mask / position_bias / Shaw or DeBERTa tables, and on
    a GPU more than DECODE_MAX_ROWS query rows per key/value head (G * T)."""
    problem = unsupported(call, query, key, value, interpret)
    if problem is not None:
        return problem
    for name in _NOT_DECODE:
        if getattr(call, name) is not None:
            return name
    T, N, K = np.shape(query)[-3], np.shape(query)[-2], np.shape(key)[-2]
    if not interpret and K and T * (N // K) > DECODE_MAX_ROWS:
        return f"query ({T} rows x {N // K} heads per key/value head > {DECODE_MAX_ROWS})"
    return None


def use_decode(call: AttentionCall, query, key, value, interpret=False) -> bool:
    """pallas_gpu.attention's choice of the split-key kernel: decode_attention expresses the call, the G * T rows
    of a key/value head fit one tile, the flash grid (B * N * query tiles) has fewer than DECODE_PROGRAMS
    programs and S >= 2 * DECODE_MIN_CHUNK (the occupancy argument above; not measured)."""
    if decode_unsupported(call, query, key, value, interpret) is not None:
        return False
    *batch, T, N, H = np.shape(query)
    S, K = np.shape(key)[-3], np.shape(key)[-2]
    Tb, _ = tile_sizes(call.block_size, T, S, padded_head(max(H, np.shape(value)[-1]), interpret), interpret)
    flash_programs = int(np.prod(batch, dtype=np.int64)) * N * -(-T // Tb)
    return T * (N // K) <= DECODE_MAX_ROWS and flash_programs < DECODE_PROGRAMS and S >= 2 * DECODE_MIN_CHUNK


def decode_tiles(block_size, key_chunk, B: int, K: int, S: int, Hp: int, interpret: bool) -> tuple:
    """(Sb, Sc): the key tile (block_size's key part, else the flash kernel's) and the keys per program:
    key_chunk, else a power of two >= DECODE_MIN_CHUNK giving about DECODE_PROGRAMS programs (B * K * chunks)."""
    _, Sb = tile_sizes(block_size, 1, S, Hp, interpret)
    if key_chunk is None:
        wanted = -(-DECODE_PROGRAMS // max(B * K, 1))
        return Sb, max(Sb, DECODE_MIN_CHUNK, next_power_of_two(-(-S // wanted)))
    if (
        isinstance(key_chunk, bool)
        or not isinstance(key_chunk, numbers.Integral)
        or key_chunk <= 0
        or (key_chunk % Sb)
        or (not interpret and not is_power_of_two(key_chunk))
    ):
        checks.fail(
            "key_chunk",
            f"a multiple of the key tile {Sb} ({'' if interpret else 'a power of two, '}> 0)",
            repr(key_chunk),
        )
    return Sb, int(key_chunk)


def _decode_kernel(cfg: Config, r: Refs):
    b, c = pl.program_id(0), pl.program_id(2)
    (out,), m, l = key_tiles(
        cfg,
        r,
        ForwardHooks(),
        b,
        None,
        r.q[...],
        r.q_pos[...],
        load(r.q_seg),
        load(r.lengths),
        key_start=c * cfg.Sn * cfg.Sb,
    )
    r.out[...], r.m[...], r.l[...] = out, m, l


def _decode_partials(cfg, q, k, v, q_pos, k_pos, lengths, q_seg, k_seg, order, counts):
    """Per (b, key/value head, chunk): out [B,K,C,Rp,Hvp] (unnormalised), m and l [B,K,C,Rp]."""
    B, K, Rp, Hp = q.shape
    Sc, Hvp = cfg.Sn * cfg.Sb, cfg.extents.Hvp
    C = -(-k.shape[1] // Sc)
    bsched = cfg.batched[4]  # the schedule's batch rows (Config.batched)
    inputs = {
        "q": (q, pl.BlockSpec((None, None, Rp, Hp), lambda b, h, c: (b, h, 0, 0))),
        "k": (k, pl.BlockSpec((None, Sc, None, Hp), lambda b, h, c: (b, c, h, 0))),
        "v": (v, pl.BlockSpec((None, Sc, None, Hvp), lambda b, h, c: (b, c, h, 0))),
        # positions, lengths, segment ids: every query row (of the G heads), the chunk's keys
        **flash_call.index_inputs(
            Side(q_pos=q_pos, k_pos=k_pos, lengths=lengths, q_seg=q_seg, k_seg=k_seg),
            cfg.batched,
            (Rp, lambda b, h, c: 0),
            (Sc, lambda b, h, c: c),
        ),
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
    return tuple(named_call(cfg, _decode_kernel, (B, K, C), inputs, outputs, "jaxattn_decode_split_key"))


def decode_attention(call: AttentionCall, query, key, value, interpret=False, *, key_chunk=None):
    """pallas_gpu.attention's call by the split-key (flash-decoding) kernel: forward only (no custom VJP of
    its own; decode_with_flash_gradient differentiates through the flash kernel). Meant for a few query rows
    against a long key axis; any T works. key_chunk: keys per program (default: decode_tiles). What it cannot
    express (decode_unsupported) raises ValueError naming the option."""
    problem = decode_unsupported(call, query, key, value, interpret)
    if problem is not None:
        checks.fail(
            "implementation",
            f"the flash kernel or the XLA engines with {problem}: the split-key decode kernel cannot express it",
            '"pallas_gpu" decode_attention',
        )
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    block_size, return_lse = call.block_size, call.return_lse
    c = checked(call, query, key, value)
    batch, T, S, N, K, H, Hv = c.batch, c.T, c.S, c.N, c.K, c.H, c.Hv
    if T == 0 or S == 0:
        return blockwise.tiled(call.replace(block_size=None), query, key, value)
    B, G = int(np.prod(batch, dtype=np.int64)), N // K
    Hp, Hvp = padded_head(H, interpret), padded_head(Hv, interpret)
    Sb, Sc = decode_tiles(block_size, key_chunk, B, K, S, max(Hp, Hvp), interpret)
    C, tiles = -(-S // Sc), Sc // Sb
    R = G * T  # the rows of one key/value head: query head kh * G + g, query t -> row g * T + t
    Rp = next_power_of_two(R) if interpret else max(MIN_GPU_BLOCK, next_power_of_two(R))  # padded as on a GPU
    q_pos, k_pos, lengths, q_seg, k_seg = padded_rows(c, T, C * Sc)

    Bs = max([1] + [x.shape[0] for x in (q_pos, k_pos, lengths, q_seg) if x is not None])
    cfg = Config(
        Tb=T,
        Sb=Sb,
        Tn=1,
        Sn=C * tiles,
        N=N,
        K=K,
        rule=c.rule,
        scale=c.scale,
        softcap=c.softcap,
        score_fn=None,
        mask_fn=None,
        score_grads=(),
        n_mask_consts=0,
        batched=(),
        head_kinds=False,
        precision=c.precision,
        interpret=bool(interpret),
        num_warps=4 if max(Hp, Hvp) <= 64 else 8,
    )
    kinds = key_tile_kinds(cfg, Bs, q_pos, k_pos, lengths, q_seg, k_seg, None)[:, 0, 0]  # all T rows: one tile
    order, counts = sorted_kinds(kinds.reshape(kinds.shape[0], C, tiles))  # per chunk, chunk-local indices

    def group_rows(x):  # [B|1,T] -> [B|1,Rp]: each row's value for the G heads, edge-padded
        return None if x is None else jnp.pad(jnp.tile(x, (1, G)), [(0, 0), (0, Rp - R)], mode="edge")

    cfg = cfg._replace(
        Tb=Rp, Sn=tiles, batched=tuple(x is not None and x.shape[0] > 1 for x in (q_pos, k_pos, q_seg, lengths, order))
    )
    q = kernel_layout(query, batch, T, T, Hp).reshape(B, T, K, G, Hp)
    q = jnp.pad(q.transpose(0, 2, 3, 1, 4).reshape(B, K, R, Hp), [(0, 0), (0, 0), (0, Rp - R), (0, 0)])
    # the cache as it is, not padded to whole chunks and head dims (a copy of all of it per step): the kernel's
    # loads mask what runs past S and H, Hv (tile_math.read)
    cfg = cfg._replace(extents=Extents(T, S, H, Hv, Hp, Hvp))
    k, v = kernel_layout(key, batch, S, S, H), kernel_layout(value, batch, S, S, Hv)
    out, m, l = _decode_partials(
        cfg, q, k, v, group_rows(q_pos), k_pos, lengths, group_rows(q_seg), k_seg, order, counts
    )
    (out,), m, l = merge_partials(((out[:, :, :, :R],), m[..., :R], l[..., :R]), axis=2)  # [B,K,R,Hvp], [B,K,R]
    heads = lambda x: x.reshape(B, N, T, *x.shape[3:])  # noqa: E731  [B,K,G*T,...] -> [B,N,T,...]
    partial = add_sinks(((heads(out),), heads(m), heads(l)), None if c.sinks is None else c.sinks[..., None])
    (out,), lse = finalize_partial(partial)
    out = jnp.swapaxes(out, 1, 2)[..., :Hv].astype(query.dtype).reshape(*batch, T, N, Hv)
    if return_lse:
        return out, public_lse(lse.reshape(*batch, N, T))
    return out


def decode_with_flash_gradient(call: AttentionCall, query, key, value, interpret):
    """decode_attention forward; a gradient runs the flash kernels (forward again, then backward). The call
    is an input of the custom VJP (a pytree: its arrays, lengths, positions, segment ids and sinks, are leaves;
    the integer ones get float0 cotangents)."""
    return _decode_forward(bool(interpret), query, key, value, jax.tree.map(jnp.asarray, call))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _decode_forward(interpret, query, key, value, call):
    return decode_attention(call, query, key, value, interpret)


def _decode_forward_fwd(interpret, query, key, value, call):
    return _decode_forward(interpret, query, key, value, call), (query, key, value, call)


def _decode_forward_bwd(interpret, residuals, cotangent):
    def flash(query, key, value, call):
        return run(call, query, key, value, interpret)

    return jax.vjp(flash, *residuals)[1](cotangent)


_decode_forward.defvjp(_decode_forward_fwd, _decode_forward_bwd)
