"""DeBERTa's disentangled attention (He et al. 2021; DeBERTa-v2/v3, transformers' DisentangledSelfAttention).

Relative positions are the library's j - i (key minus query, _core.positions), log-bucketed as DeBERTa does
(transformers' make_log_bucket_position, with bucket_size = position_buckets, max_position =
max_relative_positions): with mid = position_buckets // 2,

    bucket(d) = d                                                             |d| <= mid
              = sign(d) * (mid + ceil(log(|d| / mid) / log((max_relative_positions - 1) / mid) * (mid - 1)))

position_buckets <= 0 means no buckets (bucket(d) = d). The quotient is float32 whatever the dtype, as
transformers computes it, so bucket ids match the trained models (as T5's, t5.py); the buckets come from
integer thresholds found once in numpy (_step_thresholds), never from a float log at run time.

A position table has 2 * span rows (span = position_buckets if > 0 else max_relative_positions), row r
holding relative bucket r - span; DeBERTa clips the row to the table. Both terms read, for the pair (t, s),
the row of delta(i, j) = bucket(i - j) = -bucket(j - i):

    row[t,s]   = clip(span - bucket(j - i), 0, 2 span - 1)
    c2p[n,t,s] = q_t . Kr[row[t,s]]                                         content -> position
    p2c[n,t,s] = k_s . Qr[row[t,s]]                                         position -> content
    logits     = scale * (q_t . k_s + c2p + p2c),   scale = 1 / sqrt(H * (1 + number of position terms))

The paper writes the p2c row as delta(j, i); transformers' DisentangledSelfAttention (as Microsoft's code,
which trained the checkpoints) gathers the key-major scores k_j . Qr at -r_pos[j, i] + span with
r_pos[j, i] = bucket(j - i), i.e. the row above, and that is what is computed here. Both terms are per-row
scores gathered by index, as Transformer-XL's (xl.py): q . Kr is [...,N,T,2 span], k . Qr is [...,N,S,2 span];
no [T,S,H] table is ever gathered. The blockwise engine reads the same per-row scores one tile at a time
through a score_mod (_blockwise), so nothing spans [T,S] there either.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from .._api import attend, scheme_call, use_blockwise
from .._core import checks
from .._core.checks import static_int
from .._core.dtypes import accumulation_dtype
from .._core.eager import compiled_when_eager
from .._core.positions import offsets, positions
from .._core.row_tables import RowTables, per_key_logits, per_row_logits
from .._dispatch import registry
from .._engines import blockwise
from .._engines.dense import attention_core
from .clipped import gather_buckets

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Float, Int

    from .._core.shapes import AttentionOutput

TABLE_LAYOUT = "[R,H] or [R,N,H], R = 2 * span, span = position_buckets if > 0 else max_relative_positions"


def _check_buckets(position_buckets, max_relative_positions) -> tuple[int, int]:
    """(position_buckets, max_relative_positions) as ints; buckets need room for their log range."""
    position_buckets = static_int("position_buckets", position_buckets)
    max_relative_positions = static_int("max_relative_positions", max_relative_positions, 1)
    if position_buckets > 0:
        mid = position_buckets // 2
        if mid < 1:
            checks.fail("position_buckets", ">= 2 (or <= 0: no buckets)", position_buckets)
        if max_relative_positions - 1 <= mid:
            checks.fail(
                "max_relative_positions",
                f"> position_buckets // 2 + 1 = {mid + 1} (the log buckets span mid .. max_relative_positions - 1)",
                max_relative_positions,
            )
    return position_buckets, max_relative_positions


@functools.lru_cache(maxsize=None)
def _step_thresholds(position_buckets: int, max_relative_positions: int, max_step: int | None) -> np.ndarray:
    """thresholds[k - 1] = the smallest distance |d| whose log step (the ceil term of bucket(d)) is >= k.

    The steps are evaluated in numpy as transformers does in float32, with each log correctly rounded to
    float32 (a float64 log rounded once): float32 logs of XLA and of torch differ in the last bit here and
    there, which moves a bucket boundary by one wherever the quotient lands on an integer (log(x) / log(x)
    at d = max_relative_positions - 1, for one). The steps grow with |d|, so a bisection over int32 finds every
    boundary; `max_step` None: every step an int32 distance reaches, else the first max_step.
    """
    mid = position_buckets // 2
    log_range = np.float32(np.log(np.float64(np.float32((max_relative_positions - 1) / mid))))

    def steps(distance):
        ratio = distance.astype(np.float32) / np.float32(mid)
        log = np.log(ratio.astype(np.float64)).astype(np.float32)
        return np.ceil(log / log_range * np.float32(mid - 1))

    top = np.iinfo(np.int32).max
    if max_step is None:
        max_step = int(steps(np.array(top)))
    k = np.arange(1, max_step + 1, dtype=np.float32)
    lo = np.full(k.shape, mid, np.int64)  # steps(mid) = 0 < k
    hi = np.full(k.shape, top + 1, np.int64)  # top + 1: the step is never reached by an int32
    while (hi - lo > 1).any():
        middle = (lo + hi) // 2
        reached = steps(middle) >= k
        hi, lo = np.where(reached, middle, hi), np.where(reached, lo, middle)
    return hi[hi <= top].astype(np.int32)


def _log_buckets(d, position_buckets: int, max_relative_positions: int, max_step: int | None, xp=jnp):
    """bucket(d) (module docstring), int32; steps beyond max_step (when not None) count as max_step.
    xp: jnp, or numpy for static offsets (the kernel's row map, a constant of the program)."""
    mid = position_buckets // 2
    thresholds = xp.asarray(_step_thresholds(position_buckets, max_relative_positions, max_step))
    steps = xp.searchsorted(thresholds, xp.abs(d), side="right").astype(xp.int32)
    return xp.where(xp.abs(d) <= mid, d, xp.sign(d) * (mid + steps)).astype(xp.int32)


def deberta_log_bucket_position(
    relative_position: Int[ArrayLike, "..."], *, position_buckets: int, max_relative_positions: int
) -> Int[Array, "..."]:
    """int32 log buckets of `relative_position` (any int32 array), the module docstring's bucket(d).

    transformers' make_log_bucket_position(relative_position, bucket_size=position_buckets,
    max_position=max_relative_positions), to the integer wherever torch's float32 log is correctly rounded
    (_step_thresholds); position_buckets >= 2 here.
    """
    d = jnp.asarray(relative_position)
    checks.check_int("relative_position", d)
    position_buckets, max_relative_positions = _check_buckets(position_buckets, max_relative_positions)
    if position_buckets <= 0:
        checks.fail("position_buckets", ">= 2 (without buckets the position is its own bucket)", position_buckets)
    return _log_buckets(d.astype(jnp.int32), position_buckets, max_relative_positions, None)


def deberta_relative_position(
    query_length: int,
    key_length: int,
    *,
    position_buckets: int = -1,
    max_relative_positions: int = -1,
    query_positions: Int[ArrayLike, "*#B T"] | None = None,
    key_positions: Int[ArrayLike, "*#B S"] | None = None,
) -> Int[Array, "*#B T S"]:
    """int32 [T,S] (or [...,T,S] for batched positions): bucket(j - i) at the core's positions.

    position_buckets <= 0 or max_relative_positions <= 0: no buckets (j - i itself), as transformers'
    build_relative_position. That function returns DeBERTa's i - j with the query at t (top-left): for T == S
    it is -deberta_relative_position(T, T, ...); for T != S pass query_positions=jnp.arange(T).
    """
    query_length = static_int("query_length", query_length, 0)
    key_length = static_int("key_length", key_length, 0)
    position_buckets = static_int("position_buckets", position_buckets)
    max_relative_positions = static_int("max_relative_positions", max_relative_positions)
    q_pos, k_pos = positions(query_length, key_length, query_positions, key_positions)
    relative = offsets(q_pos, k_pos).astype(jnp.int32)
    if position_buckets <= 0 or max_relative_positions <= 0:
        return relative
    position_buckets, max_relative_positions = _check_buckets(position_buckets, max_relative_positions)
    return _log_buckets(relative, position_buckets, max_relative_positions, None)


def _table_rows(position_buckets: int, max_relative_positions: int) -> tuple[int, int]:
    """(span, max_step): the tables' 2 * span rows, and the log steps that still reach a row below the clip
    (every larger step lands on the first or last row)."""
    if position_buckets > 0:
        return position_buckets, position_buckets
    return max_relative_positions, 0


def _rows_of(relative, position_buckets, max_relative_positions, span, max_step, xp=jnp):
    """int32: delta(i, j) = clip(span - bucket(j - i), 0, 2 span - 1), the row both terms read, of the
    offsets `relative` (j - i); xp as _log_buckets'."""
    relative = xp.asarray(relative, xp.int32)
    if position_buckets > 0:
        relative = _log_buckets(relative, position_buckets, max_relative_positions, max_step, xp)
    return xp.clip(span - relative, 0, 2 * span - 1).astype(xp.int32)


def _position_rows(T, S, call, position_buckets, max_relative_positions, span, max_step):
    """int32 [...,1,T,S]: delta(i, j), the row both terms read for the pair (t, s)."""
    q_pos, k_pos = positions(T, S, call.query_positions, call.key_positions)
    relative = offsets(q_pos, k_pos)
    return _rows_of(relative, position_buckets, max_relative_positions, span, max_step)[..., None, :, :]


def _saturation(position_buckets: int, max_relative_positions: int, span: int) -> int | None:
    """M such that every offset d with |d| >= M reads the table's first row (d > 0) or last row (d < 0), so
    clipping j - i to [-M, M] keeps every row; None where no int32 distance gets there.

    Without buckets the row is clip(span - d): 0 from d = span, 2 span - 1 from d = -(span - 1). With them,
    |bucket(d)| = mid + step(d) reaches span (row 0, or 2 span clipped to 2 span - 1) from step span - mid on,
    whose first distance is _step_thresholds' entry span - mid - 1."""
    if position_buckets <= 0:
        return span
    thresholds = _step_thresholds(position_buckets, max_relative_positions, position_buckets)
    step = span - position_buckets // 2
    return int(thresholds[step - 1]) if step <= len(thresholds) else None


def _kernel_tables(call, dims, tables, position_buckets, max_relative_positions, span, max_step):
    """The RowTables a kernel reads both terms from (row_tables: the rows of the offsets in a static band,
    the tables as given), or None where no static band holds the call's offsets (positions given and no
    saturation). The band: the default positions' offsets [-(S - 1), T - 1] (query t at t + S - T),
    narrowed to the saturation [-M, M]; all of [-M, M] for positions of the call's own."""
    M = _saturation(position_buckets, max_relative_positions, span)
    if call.query_positions is None and call.key_positions is None:
        lo, hi = -(dims.S - 1), dims.T - 1
        if M is not None:
            lo, hi = max(lo, -M), min(hi, M)
    elif M is None:
        return None
    else:
        lo, hi = -M, M
    hi = max(hi, lo)  # T or S = 0: one offset (no tile reads it)
    # static offsets, so numpy: the map is a constant of the program (no search in it)
    rows = _rows_of(np.arange(lo, hi + 1), position_buckets, max_relative_positions, span, max_step, np)
    return RowTables(tables.get("position_keys"), tables.get("position_queries"), rows, lo, hi, 2 * span)


def _blockwise(call, query, key, value, tables, dims, position_buckets, max_relative_positions, span, max_step):
    """The blockwise engine with both terms as its per-tile position hook: the per-row scores scale * q . Kr
    [B,N,T,R] and scale * k . Qr [B,N,S,R] (O((T + S) R), never [T,S]) read at each tile's pairs, a gather along
    the tile's rows and then its table rows (take_along_axis: no index on the batch or head axes, so it holds
    under an Explicit mesh split, where a score_mod's per-element index of a split b does not); their gradients
    flow back through the hook's arrays. Tile positions are the default ones (row t sits at t + S - T), given
    with a batch axis so that the hook's bias is one per batch entry."""
    for name in ("query_positions", "key_positions", "logit_softcap"):
        if getattr(call, name) is not None:
            checks.fail(
                name,
                "None with implementation='blockwise' (the per-row scores are indexed by row; the dense engine "
                "takes it)",
                "it in use",
            )
    precision, acc_dtype, scale = call.precision, accumulation_dtype(query.dtype), call.scale
    B = int(np.prod(dims.batch, dtype=np.int64))

    def flat(scores):  # [...,N,L,R] -> [B,N,L,R] over the call's flattened batch
        return jnp.broadcast_to(scores, (*dims.batch, *scores.shape[-3:])).reshape(B, *scores.shape[-3:])

    per_query = per_key = None
    if "position_keys" in tables:
        per_query = flat(per_row_logits(query, tables["position_keys"], precision, acc_dtype) * scale)
    if "position_queries" in tables:
        per_key = flat(per_key_logits(key, tables["position_queries"], dims.N, precision, acc_dtype) * scale)
    offset = dims.S - dims.T

    def position_bias(q_pos, k_pos):  # q_pos [B,Tb], k_pos [B,Sb] -> [B,N,Tb,Sb] ([Tb], [Sb] -> [N,Tb,Sb]: no batch)
        if q_pos.ndim == 1:
            return position_bias(q_pos[None], k_pos[None])[0]
        row = _rows_of(k_pos[:, None, :] - q_pos[:, :, None], position_buckets, max_relative_positions, span, max_step)
        t_row, s_row = jnp.clip(q_pos - offset, 0, dims.T - 1), jnp.clip(k_pos, 0, dims.S - 1)  # padding: clipped
        bias = 0.0
        if per_query is not None:  # per_query[b, n, t, row[t, s]]
            by_row = jnp.take_along_axis(per_query, t_row[:, None, :, None], axis=2)
            bias = bias + jnp.take_along_axis(by_row, row[:, None], axis=-1)
        if per_key is not None:  # per_key[b, n, s, row[t, s]]
            by_key = jnp.take_along_axis(per_key, s_row[:, None, :, None], axis=2)
            bias = bias + jnp.swapaxes(jnp.take_along_axis(by_key, jnp.swapaxes(row, -1, -2)[:, None], axis=-1), -1, -2)
        return bias

    q_pos = jnp.broadcast_to(jnp.arange(dims.T, dtype=jnp.int32) + offset, (B, dims.T)).reshape(*dims.batch, dims.T)
    k_pos = jnp.broadcast_to(jnp.arange(dims.S, dtype=jnp.int32), (B, dims.S)).reshape(*dims.batch, dims.S)
    hooked = call.replace(position_bias=position_bias, query_positions=q_pos, key_positions=k_pos)
    return blockwise.tiled(hooked, query, key, value)


def _auto_blockwise(call, query, key, R: int) -> bool:
    """implementation=None: blockwise where it takes every option in use (it refuses these three by name), T x S
    reaches use_blockwise's threshold, and S > R. The blockwise form holds per-row scores [N,T,R] and [N,S,R]
    where the dense one holds [N,T,S], so below S = R it saves nothing: DeBERTa-v3 (R = 512) at T = S = 512 in
    float32 forward+backward, blockwise 854 ms / 152 MiB against dense 735 ms / 82 MiB; at 2048, 7.5 s / 280 MiB
    against 12.6 s / 1040 MiB (benchmarks/results/relative.json, docs/positions.md "DeBERTa")."""
    if any(getattr(call, name) is not None for name in ("query_positions", "key_positions", "logit_softcap")):
        return False
    return np.shape(key)[-3] > R and use_blockwise(None, call, query, key)


@compiled_when_eager
def disentangled_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    position_keys: Float[ArrayLike, "R N H"] | Float[ArrayLike, "R H"] | None = None,
    position_queries: Float[ArrayLike, "R N H"] | Float[ArrayLike, "R H"] | None = None,
    *,
    max_relative_positions: int,
    position_buckets: int = -1,
    scale=None,
    **options,
) -> AttentionOutput:
    """DeBERTa's disentangled attention: scale * (q . k + c2p + p2c) (module docstring).

    position_keys Kr (content -> position, "c2p") and position_queries Qr (position -> content, "p2c"):
    [R,N,H] (or [R,H] shared over heads), R = 2 * span, the relative embeddings (after DeBERTa's LayerNorm)
    projected per head: transformers' pos_key_proj / pos_query_proj, or key_proj / query_proj with
    share_att_key, biases included. None leaves that term out (pos_att_type without it).
    position_buckets / max_relative_positions: the config's (position_buckets <= 0: no buckets;
    max_relative_positions as resolved by transformers, max_position_embeddings when the config has < 1).
    scale: None = 1 / sqrt(H * (1 + number of position terms given)). Keywords as dot_product_attention
    (an encoder: is_causal=False, padding as mask or key_value_seq_lengths); transformers' T != S puts the
    query at t (top-left): query_positions=jnp.arange(T). implementation: "dense" (the dense engine),
    "blockwise" (O(T + S) memory: both terms as a score_mod over per-row scores; no mask, bias, dropout,
    return_weights, query/key_positions or logit_softcap there), "pallas_gpu" (the Pallas GPU kernel: q . Kr
    per query row and k . Qr per key row computed outside it, picked per tile at the pair's row through an
    int32 map of the offsets (row_tables); ValueError naming an option it cannot express: mask, bias,
    dropout, return_weights, tables over 1024 rows), "pallas_tpu" (our Pallas TPU kernel's forward, both
    terms read from the tables laid out along the offsets, and its backward kernels (at T = S = 16384 with v3's
    256 buckets the dq kernel streams the key tiles from HBM, one copy of the keys overrunning its VMEM);
    refuses positions of the call's own and logit_softcap by name), or None: on CUDA / TPU that kernel where it
    expresses the call, else (and on every other platform) blockwise where it takes the call, T x S reaches
    dot_product_attention's threshold and S exceeds the table's rows, else dense. interpret: with
    "pallas_gpu" / "pallas_tpu", Pallas' interpreter (any platform).
    """
    implementation, interpret = options.pop("implementation", None), options.pop("interpret", False)
    registry.check_implementation(implementation, interpret)  # once: attend is told (checked=True)
    if implementation not in (None, "dense", "blockwise", "pallas_gpu", "pallas_tpu") and (
        position_keys is not None or position_queries is not None
    ):  # of the kernels, our Pallas GPU and TPU ones take the two table terms
        checks.fail(
            "position_keys / queries",
            f"not in use with implementation={implementation!r} (the XLA engines and our Pallas kernels "
            "compute them; use implementation=None, 'dense', 'blockwise', 'pallas_gpu' or 'pallas_tpu')",
            "in use",
        )
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    dims = checks.check_qkv(query, key, value)
    position_buckets, max_relative_positions = _check_buckets(position_buckets, max_relative_positions)
    span, max_step = _table_rows(position_buckets, max_relative_positions)
    terms = (position_keys is not None) + (position_queries is not None)
    if scale is None:
        scale = (dims.H * (1 + terms)) ** -0.5
    call = scheme_call("disentangled_attention", dict(options, scale=scale))
    acc_dtype = accumulation_dtype(query.dtype)
    tables = {}
    for name, table in (("position_keys", position_keys), ("position_queries", position_queries)):
        if table is not None:
            tables[name] = checks.check_clipped_table(name, table, 2 * span, dims.N, dims.H, acc_dtype, TABLE_LAYOUT)
    engine = implementation if implementation in ("dense", "blockwise") else None

    def xla():
        return _xla_engines(
            engine, call, query, key, value, tables, dims, position_buckets, max_relative_positions, span, max_step
        )

    if engine is not None:
        return xla()
    kernel_call = call
    if tables:
        row_tables = _kernel_tables(call, dims, tables, position_buckets, max_relative_positions, span, max_step)
        if row_tables is None:  # positions of the call's own and no saturation: no static band of rows
            if implementation is not None:
                checks.fail(
                    "query_positions / key_positions",
                    f"None with implementation={implementation!r} when the buckets never saturate (no static "
                    "band of table rows); the XLA engines take them",
                    "given",
                )
            return xla()
        kernel_call = call.replace(row_tables=row_tables)
    return attend(
        kernel_call, query, key, value, xla=xla, implementation=implementation, interpret=interpret, checked=True
    )


def _xla_engines(
    engine, call, query, key, value, tables, dims, position_buckets, max_relative_positions, span, max_step
):
    """The XLA engines' disentangled attention: blockwise ("blockwise", or None where _auto_blockwise takes
    it), else dense with both terms gathered from the per-row scores."""
    precision, acc_dtype = call.precision, accumulation_dtype(query.dtype)
    if engine == "blockwise" or (engine is None and _auto_blockwise(call, query, key, 2 * span)):
        return _blockwise(
            call, query, key, value, tables, dims, position_buckets, max_relative_positions, span, max_step
        )
    rows = _position_rows(dims.T, dims.S, call, position_buckets, max_relative_positions, span, max_step)

    def relative_logits(q):
        total = 0.0
        if "position_keys" in tables:
            total = total + gather_buckets(per_row_logits(q, tables["position_keys"], precision, acc_dtype), rows)
        if "position_queries" in tables:
            per_key = per_key_logits(key, tables["position_queries"], dims.N, precision, acc_dtype)
            total = total + jnp.swapaxes(gather_buckets(per_key, jnp.swapaxes(rows, -1, -2)), -1, -2)
        return total

    rel_logits = relative_logits if tables else None
    return attention_core(call, query, key, value, relative_logits=rel_logits, dims=dims)
