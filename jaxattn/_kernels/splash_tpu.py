"""TPU splash attention (shipped with JAX: jax.experimental.pallas.ops.tpu.splash_attention), driven by our
keywords.

What splash is given, per batch entry (vmapped over the flattened batch), in its [N,T,H] layout:
  q * scale       splash does not scale q; scaling first keeps logit_softcap on the scaled logits (ours)
  one mask        our position rule as a splash _ComputableMask, one function of (query row, key column) that
                  splash evaluates in numpy to skip empty tiles and inside the kernel for partial ones:
                  key s < S, causal s <= t + S - T (bottom-right), window t' - left <= s <= t' + right,
                  chunk t' // C == s // C, with t' = t + S - T the query's absolute position
  segment ids     the user's, and key_value_seq_lengths folded in (keys past a length get an id no query has)
  sinks           splash's own (one logit per query head, with its gradient)
  GQA             make_splash_mha reads key/value head n // (N // K) itself; no copies

Lengths that are not a multiple of splash's block are padded inside (padded keys masked, padded rows cut).
A row with no allowed key must give zeros (docs/design.md, "Rows with no allowed key") where splash would divide 0 by 0:
such rows (and padded rows) are let through to one extra zero key column S (key 0, value 0) that only they may see, so
their output is exactly 0 and every gradient finite and zero. Splash computes in float32 (its matmuls accumulate in
float32, the softmax is float32); half inputs stay half in the matmuls, as ours do.

One query row (T = 1, a decode step against a cache): whatever masks its keys (explicit positions, lengths,
segment ids, causal, window, chunk) is one vector over the keys per batch entry, computed by the dense
engine's mask rule and handed to splash as key segment ids, so a decode step takes splash too.

Not expressible here (unsupported names them): explicit query/key positions with T > 1, score_mod,
mask_mod, block_mask, return_lse (splash's residuals are not differentiable), relative tables and position
biases, segment ids together with key_value_seq_lengths with T > 1; and any call traced with
jax_enable_x64 on (splash's index arithmetic then mixes int32 and int64 and fails to lower).
"""

from __future__ import annotations

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._core import checks, mods
from .._core.call import AttentionCall
from .._core.masks import allowed_keys

LANES = 128  # splash's tiles are multiples of the TPU lane width
MAX_BLOCK = 512
# The options splash expresses (with their defaults, every other blockwise option must be unset).
HANDLED = (
    "is_causal",
    "scale",
    "precision",
    "query_segment_ids",
    "key_segment_ids",
    "key_value_seq_lengths",
    "window",
    "chunk_size",
    "logit_softcap",
    "sinks",
    "return_lse",
)
# With one query row (a decode step) every mask keyword is one vector over the keys per batch entry, which
# segment ids carry exactly: explicit positions too, and lengths with segment ids.
ONE_ROW = ("query_positions", "key_positions")


def unsupported(call: AttentionCall, query, key, value, interpret=False):
    """None when splash computes this call exactly, else the name of the first option it cannot express.

    The same in Pallas' interpreter (interpret=True) as on a TPU (splash's own limits), except float16
    inputs, which only the chip refuses (tpu_dtype_refusal)."""
    if jax.config.read("jax_enable_x64"):
        return "jax_enable_x64 (splash's index arithmetic does not trace with 64-bit ints on)"
    if not interpret and tpu_dtype_refusal(query) is not None:
        return tpu_dtype_refusal(query)
    one_row = np.shape(query)[-3] == 1
    problem = call.first_unhandled(HANDLED + (ONE_ROW if one_row else ()))
    if problem is not None:
        return problem
    if call.return_lse:
        return "return_lse"
    if (
        not one_row
        and call.key_value_seq_lengths is not None
        and (call.query_segment_ids is not None or call.key_segment_ids is not None)
    ):
        return "key_value_seq_lengths (with segment ids)"
    if min(np.shape(query)[-3], np.shape(key)[-3]) == 0:
        return "query (an empty sequence)"
    return None


def tpu_dtype_refusal(query) -> str | None:
    """The refusal of float16 inputs on a TPU (splash's and the flex kernel's): Mosaic compiles no float16
    vector load ("Invalid vector type for load", found compiling for v5e and v6e, .ci/compile_targets.py),
    so a float16 call must take the XLA engines (implementation=None) rather than fail at compile time."""
    if np.dtype(getattr(query, "dtype", np.float32)) == np.float16:
        return "query (dtype float16: Mosaic has no float16 vector loads on a TPU; bfloat16 or float32)"
    return None


def _round_up(n, m):
    return -(-n // m) * m


class PositionRule:
    """Our mask rule on splash's padded [Tp,Sp] grid (module docstring); `dummy`: key column S is open."""

    def __init__(self, T, S, *, causal, window, chunk, dummy):
        self.offset, self.S, self.causal, self.chunk, self.dummy = S - T, S, causal, chunk, dummy
        self.left, self.right = (None, None) if window is None else window

    @property
    def key(self) -> tuple:
        """Everything the rule decides by (a splash mask's identity)."""
        return (self.offset, self.S, self.causal, self.left, self.right, self.chunk, self.dummy)

    def allowed(self, t, s):
        """Works on numpy arrays (splash's tile classification) and inside the kernel (jnp)."""
        pos = t + self.offset
        ok = s < self.S
        if self.causal:
            ok = ok & (s <= pos)
        if self.left is not None:
            ok = ok & (s >= pos - self.left)
        if self.right is not None:
            ok = ok & (s <= pos + self.right)
        if self.chunk is not None:
            ok = ok & (pos // self.chunk == s // self.chunk)
        return (ok | (s == self.S)) if self.dummy else ok

    def rows_with_keys(self, Tp):
        """bool [Tp]: rows with an allowed key among 0..S-1 (numpy; each row's keys are one interval)."""
        pos = np.arange(Tp, dtype=np.int64) + self.offset
        lo, hi = np.zeros_like(pos), np.full_like(pos, self.S - 1)
        if self.causal:
            hi = np.minimum(hi, pos)
        if self.left is not None:
            lo = np.maximum(lo, pos - self.left)
        if self.right is not None:
            hi = np.minimum(hi, pos + self.right)
        if self.chunk is not None:
            start = np.floor_divide(pos, self.chunk) * self.chunk
            lo, hi = np.maximum(lo, start), np.minimum(hi, start + self.chunk - 1)
        return lo <= hi


@functools.cache
def _rule_mask_class():
    """splash's masks are _ComputableMask subclasses (CausalMask, LocalMask, ChunkedCausalMask); ours is their
    intersection at our absolute positions, with the padding and the zero column. One class for the process
    (splash imported on first use), equal by shape and rule: splash caches its processed mask info by the
    mask (_process_mask's lru_cache), so every call and layer with the same rule and lengths hits that cache
    (a class made per call never did: about 5 s of tracing per call at 32k, issue 36), and two rules never
    share an entry."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    class RuleMask(masks._ComputableMask):
        def __init__(self, rule: PositionRule, shape):
            self.key = (tuple(shape), rule.key)
            super().__init__(shape=shape, mask_function=rule.allowed)

        def __eq__(self, other):
            return isinstance(other, RuleMask) and other.key == self.key

        def __hash__(self):
            return hash((RuleMask, self.key))

    return RuleMask


def _splash_mask(rule: PositionRule, Tp, Sp):
    return _rule_mask_class()(rule, (Tp, Sp))


@jax.custom_vjp
def float32_cotangent(sinks):
    """The identity on float32 sinks whose cotangent is cast back to float32: splash's backward returns the
    sinks' gradient in the inputs' dtype (bf16 for bf16 inputs; jax 0.10, splash_attention_kernel.py
    `dsinks = jnp.sum(... .astype(o.dtype) ...)`), which gave bf16 gradients to float32 sinks and made
    implementation=None's forward+backward unlowerable (its XLA branch gives float32: a `case` whose branches
    disagree on the dtype; issue 36)."""
    return sinks


float32_cotangent.defvjp(lambda sinks: (sinks, None), lambda _, g: (g.astype(jnp.float32),))


def _blocks(length):
    """(block, padded length): a lane-multiple block of at most MAX_BLOCK that the padded length divides."""
    block = min(MAX_BLOCK, _round_up(length, LANES))
    return block, _round_up(length, block)


def _row_has_key(rule, q_ids, kv_ids, block):
    """bool [Tp]: some key allowed by the rule and the segment ids (XLA, one [block,Sp] tile at a time)."""
    Tp, Sp = q_ids.shape[0], kv_ids.shape[0]
    s = jnp.arange(Sp, dtype=jnp.int32)
    real = copy.copy(rule)
    real.dummy = False  # the zero column is what an empty row gets, not a key it has

    def tile(i):
        t = i * block + jnp.arange(block, dtype=jnp.int32)
        ids = lax.dynamic_slice_in_dim(q_ids, i * block, block)
        return jnp.any(real.allowed(t[:, None], s[None, :]) & (ids[:, None] == kv_ids[None, :]), axis=-1)

    if Tp == block:  # one tile (a decode step): no loop
        return tile(0)
    return lax.map(tile, jnp.arange(Tp // block)).reshape(Tp)


def _segment_ids(rule, batch, T, S, Tp, Sp, block_q, q_seg, k_seg, lengths, static_rows):
    """(q ids [B,Tp], kv ids [B,Sp]) for splash, the zero column S included, or None when no row needs them."""
    B = int(np.prod(batch, dtype=np.int64))
    if q_seg is None and lengths is None:
        if static_rows.all():
            return None
        q_ids = jnp.broadcast_to(jnp.asarray(np.where(static_rows, 0, 1), jnp.int32), (B, Tp))
        kv_ids = jnp.broadcast_to(jnp.asarray(np.arange(Sp) == S, jnp.int32), (B, Sp))
        return q_ids, kv_ids
    if q_seg is None:  # only lengths: keys past a length get id 1, the zero column id 2
        q_ids = jnp.zeros((B, Tp), jnp.int32)
        length = jnp.broadcast_to(jnp.asarray(lengths, jnp.int32), batch).reshape(B, 1)
        kv_ids = jnp.where(jnp.arange(Sp)[None] < length, 0, 1).astype(jnp.int32)
        fresh = jnp.full((B,), 2, jnp.int32)
    else:
        q_ids = jnp.pad(jnp.broadcast_to(q_seg, (*batch, T)).reshape(B, T).astype(jnp.int32), ((0, 0), (0, Tp - T)))
        kv_ids = jnp.pad(jnp.broadcast_to(k_seg, (*batch, S)).reshape(B, S).astype(jnp.int32), ((0, 0), (0, Sp - S)))
        fresh = jnp.max(kv_ids[:, :S], axis=-1) + 1  # an id no real key has (segment ids < 2**31 - 1)
    has_key = jax.vmap(functools.partial(_row_has_key, rule, block=block_q))(q_ids, kv_ids)
    q_ids = jnp.where(has_key, q_ids, fresh[:, None])
    kv_ids = kv_ids.at[:, S].set(fresh)
    return q_ids, kv_ids


def _one_row_keys(batch, S, **mask_options):
    """For T == 1: int32 [...,S] key segment ids, 0 where the single query may attend, 1 elsewhere (the
    dense engine's own mask rule, jaxattn._core.masks), or None when every key is allowed."""
    allowed = allowed_keys((*batch, 1, 1, S), **mask_options)
    if allowed is None:
        return None
    return jnp.where(jnp.broadcast_to(allowed, (*batch, 1, 1, S))[..., 0, 0, :], 0, 1).astype(jnp.int32)


def attention(call: AttentionCall, query, key, value, interpret=False):
    """Splash attention over [...,T,N,H] inputs, with our semantics (module docstring)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as splash,
        splash_attention_mask as masks,
    )

    # splash's matmuls accumulate in float32 (precision has nothing to set); return_lse is refused
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    batch, T, S, N, _, H, Hv = checks.check_qkv(query, key, value)
    B = int(np.prod(batch, dtype=np.int64))
    is_causal, window, chunk, cap = call.is_causal, call.window, call.chunk_size, call.logit_softcap
    query_positions, key_positions = call.query_positions, call.key_positions
    key_value_seq_lengths, scale = call.key_value_seq_lengths, call.scale
    q_seg, k_seg = mods.check_segment_ids(call.query_segment_ids, call.key_segment_ids, batch, T, S)
    if key_value_seq_lengths is not None:
        checks.check_int("key_value_seq_lengths", jnp.asarray(key_value_seq_lengths))
    sinks = mods.check_sinks(call.sinks, batch, N, jnp.float32)
    if T == 1 and (
        query_positions is not None
        or key_positions is not None
        or (key_value_seq_lengths is not None and q_seg is not None)
    ):
        # one query row: its allowed keys become key segment ids (queries 0), the rule's keywords spent
        k_seg = _one_row_keys(
            batch,
            S,
            is_causal=is_causal,
            key_value_seq_lengths=key_value_seq_lengths,
            query_positions=query_positions,
            key_positions=key_positions,
            window=window,
            chunk_size=chunk,
            query_segments=q_seg,
            key_segments=k_seg,
        )
        q_seg = None if k_seg is None else jnp.zeros((*batch, 1), jnp.int32)
        is_causal, window, chunk, key_value_seq_lengths = False, None, None, None

    block_q, Tp = _blocks(T)
    rule = PositionRule(T, S, causal=bool(is_causal), window=window, chunk=chunk, dummy=False)
    static_rows = rule.rows_with_keys(Tp)
    dynamic = q_seg is not None or key_value_seq_lengths is not None
    rule.dummy = dynamic or not static_rows.all()
    block_kv, Sp = _blocks(S + rule.dummy)
    ids = _segment_ids(rule, batch, T, S, Tp, Sp, block_q, q_seg, k_seg, key_value_seq_lengths, static_rows)

    blocks = splash.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv,
        block_q_dq=block_q,
        block_kv_dq=block_kv,
    )
    mask = masks.MultiHeadMask([_splash_mask(rule, Tp, Sp)] * N)
    kernel = splash.make_splash_mha(
        mask, block_sizes=blocks, attn_logits_soft_cap=cap, head_shards=1, q_seq_shards=1, interpret=interpret
    )

    scale = H**-0.5 if scale is None else scale
    q = (query.astype(jnp.float32) * scale).astype(query.dtype)

    def heads_first(x, length, padded):  # [...,L,heads,F] -> [B,heads,padded,F], zeros in the padding
        x = jnp.moveaxis(x.reshape(B, length, *x.shape[-2:]), -2, 1)
        return jnp.pad(x, ((0, 0), (0, 0), (0, padded - length), (0, 0)))

    q, k, v = heads_first(q, T, Tp), heads_first(key, S, Sp), heads_first(value, S, Sp)
    sink_rows = None if sinks is None else float32_cotangent(jnp.broadcast_to(sinks, (*batch, N)).reshape(B, N))

    def one(q, k, v, ids, sink):
        segments = None if ids is None else splash.SegmentIds(q=ids[0], kv=ids[1])
        return kernel(q, k, v, segments, sink)

    out = jax.vmap(one)(q, k, v, ids, sink_rows)  # [B,N,Tp,Hv]
    out = jnp.moveaxis(out[:, :, :T], 1, 2)
    return out.reshape(*batch, T, N, Hv).astype(value.dtype)
