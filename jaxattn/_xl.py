"""Asymmetrically clipped relative keys and Transformer-XL relative attention (Dai et al. 2019).

One index convention for every table here (and for Shaw's): row r of a table of R = max_left + max_right + 1
rows holds the relative position j - i = r - max_left (key minus query), distances beyond the table are
clipped to its first/last row:

    index[t,s] = clip(key_pos[s] - query_pos[t], -max_left, max_right) + max_left

Shaw is max_left == max_right; HF's "relative_key" (Wav2Vec2-BERT, Conformer) is
left_max_position_embeddings / right_max_position_embeddings. Transformer-XL's R_{i-j} (the paper indexes by
i - j) fills row r with the sinusoid of i - j = max_left - r, see `relative_sinusoids`; its causal table
(the paper's klen rows R_{klen-1} .. R_0) is max_left = klen - 1, max_right = 0, and the bidirectional one
(HF Wav2Vec2-BERT/Conformer "relative": rows i - j = L-1 .. -(L-1)) is max_left = max_right = L - 1.

    Transformer-XL logits[n,t,s] = scale * ((q_t + u) . k_s  +  (q_t + v) . P[index[t,s]])

with P = W_R R the projected position keys. The "shift" is a gather of the per-row scores [...,N,T,R] by
`index`, exact for any T, S and positions: the pad-and-reshape trick of the paper is only right for
T == S with P spanning exactly the needed 2S-1 (or S causal) rows, and leaves stale entries elsewhere.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from . import _checks
from ._attention import attention_core, check_qkv, compute_dtype
from ._masking import positions
from ._positions import offsets, static_int
from ._relative import _gather_buckets, _sum_into_buckets


def clipped_relative_index(query_length: int, key_length: int, *, max_left: int, max_right: int,
                           query_positions=None, key_positions=None):
    """int32 [T,S] (or [...,T,S]): clip(j - i, -max_left, max_right) + max_left, core positions."""
    max_left = static_int("max_left", max_left, 0)
    max_right = static_int("max_right", max_right, 0)
    q_pos, k_pos = positions(query_length, key_length, query_positions, key_positions)
    return (jnp.clip(offsets(q_pos, k_pos), -max_left, max_right) + max_left).astype(jnp.int32)


def _check_table(name, table, R, N, head_dim, query, layout):
    table = jnp.asarray(table)
    if table.ndim not in (2, 3):
        _checks.fail(name, f"rank 2 or 3 ({layout})", f"shape {_checks.shape_str(table.shape)}")
    expected = (R, head_dim) if table.ndim == 2 else (R, N, head_dim)
    if tuple(table.shape) != expected:
        _checks.fail(name, f"shape {_checks.shape_str(expected)} ({layout})",
                     f"shape {_checks.shape_str(table.shape)}")
    _checks.check_fits(name, table, compute_dtype(query.dtype))
    return table


def _per_row_logits(q, table, precision, acc):
    """q [...,T,N,H] . table [R,(N,)H] -> [...,N,T,R]."""
    spec = "...tnh,rnh->...ntr" if table.ndim == 3 else "...tnh,rh->...ntr"
    return jnp.einsum(spec, q, table, precision=precision, preferred_element_type=acc)


def _index(T, S, max_left, max_right, options):
    q_pos, k_pos = positions(T, S, options.get("query_positions"), options.get("key_positions"))
    return (jnp.clip(offsets(q_pos, k_pos), -max_left, max_right) + max_left)[..., None, :, :]


def clipped_relative_attention(query, key, value, key_table=None, value_table=None, *, max_left: int,
                               max_right: int, **options):
    """Shaw-style relative attention with an asymmetric clip (HF "relative_key" of Wav2Vec2-BERT).

    key_table: [R,H] (shared over heads) or [R,N,H]; value_table: [R,Hv] or [R,N,Hv]; R = max_left +
    max_right + 1, row r <-> j - i = r - max_left. logits = scale * q . (k + key_table[index]),
    out = sum p (v + value_table[index]). Keywords as dot_product_attention. max_left == max_right ==
    max_distance is shaw_relative_attention.
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    _, T, S, N, _, H, Hv = check_qkv(query, key, value)
    max_left = static_int("max_left", max_left, 0)
    max_right = static_int("max_right", max_right, 0)
    R = max_left + max_right + 1
    precision, acc = options.get("precision"), compute_dtype(query.dtype)
    index = _index(T, S, max_left, max_right, options)
    layout = "[R,H] or [R,N,H], R = max_left + max_right + 1"

    rel_logits = rel_values = None
    if key_table is not None:
        t_k = _check_table("key_table", key_table, R, N, H, query, layout)
        rel_logits = lambda q: _gather_buckets(_per_row_logits(q, t_k, precision, acc), index)
    if value_table is not None:
        t_v = _check_table("value_table", value_table, R, N, Hv, query, layout.replace("H", "Hv"))
        spec = "...ntr,rnh->...tnh" if t_v.ndim == 3 else "...ntr,rh->...tnh"
        rel_values = lambda p: jnp.einsum(spec, _sum_into_buckets(p, index, R), t_v.astype(acc),
                                          precision=precision)
    return attention_core(query, key, value, relative_logits=rel_logits, relative_values=rel_values, **options)


def relative_sinusoids(dim: int, *, max_left: int, max_right: int, base: float = 10000.0,
                       layout: str = "concat", dtype=jnp.float32):
    """Transformer-XL's R: [R, dim], row r = the sinusoid of i - j = max_left - r (see module docstring).

    frequencies w_k = base ** (-2k / dim); layout "concat": [sin(d w), cos(d w)] (the paper's code);
    "interleaved": sin at even features, cos at odd ones (ESPnet / HF Wav2Vec2-BERT, Conformer).
    Computed in float64 and cast to `dtype`.
    """
    dim = static_int("dim", dim, 2)
    if dim % 2:
        _checks.fail("dim", "an even number (sin and cos halves)", dim)
    max_left = static_int("max_left", max_left, 0)
    max_right = static_int("max_right", max_right, 0)
    if layout not in ("concat", "interleaved"):
        _checks.fail("layout", "'concat' or 'interleaved'", repr(layout))
    distance = max_left - np.arange(max_left + max_right + 1, dtype=np.float64)
    angles = distance[:, None] / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if layout == "concat":
        table = np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)
    else:
        table = np.stack([np.sin(angles), np.cos(angles)], axis=-1).reshape(len(distance), dim)
    return jnp.asarray(table, dtype)


def _check_head_bias(name, b, N, H, query):
    b = jnp.asarray(b)
    _checks.check_shape(name, b, (N, H), "[N,H]")
    # u and v are added to the query itself, so they must fit its dtype: the cast below only widens.
    _checks.check_fits(name, b, query.dtype)
    return b.astype(query.dtype)


def transformer_xl_attention(query, key, value, position_keys, *, max_left: int, pos_bias_u=None,
                             pos_bias_v=None, **options):
    """Transformer-XL relative attention: scale * ((q + u) . k + (q + v) . P[index]) (module docstring).

    position_keys P: [R,N,H] (or [R,H] shared), the projected R_{i-j} (W_R applied, e.g. to
    `relative_sinusoids(...)`), row r <-> j - i = r - max_left, so max_right = R - 1 - max_left.
    pos_bias_u / pos_bias_v: [N,H] (the paper's u, v; HF's pos_bias_u / pos_bias_v); None = zeros.
    Keywords as dot_product_attention (causal use: is_causal=True; rows with j > i are then never read).
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    _, T, S, N, _, H, _ = check_qkv(query, key, value)
    max_left = static_int("max_left", max_left, 0)
    position_keys = jnp.asarray(position_keys)
    R = position_keys.shape[0] if position_keys.ndim else 0
    if R <= max_left:
        _checks.fail("position_keys", f"more than max_left={max_left} rows ([R,N,H], row r <-> j - i = "
                     "r - max_left)", f"shape {_checks.shape_str(position_keys.shape)}")
    P = _check_table("position_keys", position_keys, R, N, H, query, "[R,H] or [R,N,H]")
    precision, acc = options.get("precision"), compute_dtype(query.dtype)
    index = _index(T, S, max_left, R - 1 - max_left, options)

    q_u = query if pos_bias_u is None else query + _check_head_bias("pos_bias_u", pos_bias_u, N, H, query)
    q_v = query if pos_bias_v is None else query + _check_head_bias("pos_bias_v", pos_bias_v, N, H, query)
    rel_logits = lambda _: _gather_buckets(_per_row_logits(q_v, P, precision, acc), index)
    return attention_core(q_u, key, value, relative_logits=rel_logits, **options)
