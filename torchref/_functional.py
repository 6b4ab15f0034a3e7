"""Attention as plain torch code: matmul, einsum, masked_fill, softmax.

This is the oracle: every step is the textbook formula, spelled out, with no tricks. Shapes use the axis
letters of the package docstring; logits and weights are ``[..., N, T, S]``.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

# A masked logit is -inf so it gets exactly zero weight. A row with no allowed key is instead filled with this
# finite value before the softmax (then its weights are zeroed), so neither the forward nor the backward pass
# ever sees inf - inf.
_MASKED = float("-inf")
_EMPTY_ROW_FILL = 0.0


def check(ok: bool, name: str, expected: str, actual: object) -> None:
    """The one user-error check: raise ValueError naming the argument, what was expected and what came.
    (Package-internal surface: _modules uses it too.)"""
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {actual}")


def is_count(x) -> bool:
    """A non-negative Python or numpy integer (not a bool)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= 0


_check, _is_count = check, is_count  # this module's own shorthand


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return tuple(torch.broadcast_shapes(tuple(shape), tuple(target))) == tuple(target)
    except RuntimeError:
        return False


def _broadcasts_together(*shapes) -> bool:
    try:
        torch.broadcast_shapes(*[tuple(s) for s in shapes])
        return True
    except RuntimeError:
        return False


def _shape(x: Tensor) -> tuple[int, ...]:
    return tuple(x.shape)


# ---------------------------------------------------------------------------------------------------------
# relative position indices


def _positions(positions, length: int, default: Tensor, name: str) -> Tensor:
    """Absolute positions as an int64 tensor broadcast to ``[..., length]``."""
    if positions is None:
        return default
    positions = torch.as_tensor(positions, device=default.device)
    _check(
        not positions.is_floating_point() and not positions.is_complex() and positions.dtype != torch.bool,
        name, "an integer tensor", positions.dtype,
    )
    _check(
        positions.ndim == 0 or positions.shape[-1] in (1, length),
        name, f"shape broadcastable to [..., {length}]", _shape(positions),
    )
    last = positions.shape[:-1] if positions.ndim else ()
    return torch.broadcast_to(positions.long(), (*last, length))


def _default_positions(query_length: int, key_length: int, device=None) -> tuple[Tensor, Tensor]:
    """Bottom-right alignment: query t sits at t + (S - T), key s at s."""
    query_pos = torch.arange(query_length, device=device) + (key_length - query_length)
    key_pos = torch.arange(key_length, device=device)
    return query_pos, key_pos


def relative_position_index(
    query_length: int,
    key_length: int,
    max_distance: int,
    *,
    query_positions=None,
    key_positions=None,
) -> Tensor:
    """Clipped relative distance ``key_pos - query_pos`` as a bucket index in ``[0, 2 * max_distance]``.

    ``index[t, s] = clip(key_pos[s] - query_pos[t], -max_distance, max_distance) + max_distance``, with
    ``query_pos[t] = t + (S - T)`` and ``key_pos[s] = s`` unless positions are given (``[..., T]`` and
    ``[..., S]``, in which case the result is ``[..., T, S]``). Returns int64.
    """
    for name, value in (("query_length", query_length), ("key_length", key_length)):
        _check(_is_count(value), name, "a non-negative int", value)
    _check(_is_count(max_distance), "max_distance", "a non-negative int", max_distance)
    query_length, key_length, max_distance = int(query_length), int(key_length), int(max_distance)
    device = None
    for given in (query_positions, key_positions):
        if isinstance(given, Tensor):
            device = given.device
    default_q, default_k = _default_positions(query_length, key_length, device)
    query_pos = _positions(query_positions, query_length, default_q, "query_positions")
    key_pos = _positions(key_positions, key_length, default_k, "key_positions")
    _check(
        _broadcasts_together(query_pos.shape[:-1], key_pos.shape[:-1]),
        "key_positions", f"batch dims broadcastable with query_positions {_shape(query_pos)}", _shape(key_pos),
    )
    distance = key_pos.unsqueeze(-2) - query_pos.unsqueeze(-1)  # [..., T, S]
    return distance.clamp(-max_distance, max_distance) + max_distance


# ---------------------------------------------------------------------------------------------------------
# input checks


def _check_qkv(query: Tensor, key: Tensor, value: Tensor) -> tuple[int, ...]:
    """Validate ``query [..., T, N, H]``, ``key [..., S, K, H]``, ``value [..., S, K, Hv]``; return the batch."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check(isinstance(x, Tensor), name, "a torch.Tensor", type(x).__name__)
        _check(x.ndim >= 3, name, f"rank >= 3 ([..., {'T' if name == 'query' else 'S'}, heads, head_dim])",
               f"shape {_shape(x)}")
        _check(x.is_floating_point(), name, "a floating-point tensor", x.dtype)
    *_, T, N, H = query.shape
    *_, S, K, _ = key.shape
    _check(key.shape[-1] == H, "key", f"head dim H={H} (query's last dim), shape [..., S, K, {H}]",
           f"shape {_shape(key)}")
    _check(value.shape[-3:-1] == key.shape[-3:-1], "value", f"shape [..., {S}, {K}, Hv] matching key's S and K",
           f"shape {_shape(value)}")
    _check(K > 0 and N % K == 0, "key", f"a head count K dividing the query head count N={N}",
           f"K={K} (shape {_shape(key)})")
    batches = (query.shape[:-3], key.shape[:-3], value.shape[:-3])
    _check(_broadcasts_together(*batches), "key",
           f"batch dims broadcastable with query {tuple(query.shape[:-3])} and value {tuple(value.shape[:-3])}",
           tuple(key.shape[:-3]))
    return tuple(torch.broadcast_shapes(*batches))


def _check_rel(rel: Tensor | None, name: str, batch: tuple[int, ...], T: int, S: int, N: int, dim: int) -> None:
    if rel is None:
        return
    expected = f"shape [..., {T}, {S}, {N} or 1, {dim}] ([T, S, N or 1, head_dim])"
    _check(isinstance(rel, Tensor), name, "a torch.Tensor", type(rel).__name__)
    _check(rel.ndim >= 4, name, expected, f"shape {_shape(rel)}")
    _check(tuple(rel.shape[-4:-2]) == (T, S) and rel.shape[-2] in (N, 1) and rel.shape[-1] == dim,
           name, expected, f"shape {_shape(rel)}")
    _check(_broadcasts_to(rel.shape[:-4], batch), name, f"leading dims broadcastable to the batch {batch}",
           f"shape {_shape(rel)}")


def _check_extra(
    batch, N, T, S, *, mask, bias, key_value_seq_lengths, query_positions, key_positions, dropout_rate
) -> None:
    target = (*batch, N, T, S)
    if mask is not None:
        _check(isinstance(mask, Tensor) and mask.dtype == torch.bool, "mask", "a bool tensor (True = may attend)",
               getattr(mask, "dtype", type(mask).__name__))
        _check(_broadcasts_to(mask.shape, target), "mask", f"shape broadcastable to [..., N, T, S] = {target}",
               _shape(mask))
    if bias is not None:
        _check(isinstance(bias, Tensor) and bias.is_floating_point(), "bias", "a floating-point tensor",
               getattr(bias, "dtype", type(bias).__name__))
        _check(_broadcasts_to(bias.shape, target), "bias", f"shape broadcastable to [..., N, T, S] = {target}",
               _shape(bias))
    if key_value_seq_lengths is not None:
        lengths = torch.as_tensor(key_value_seq_lengths)
        _check(not lengths.is_floating_point() and lengths.dtype != torch.bool, "key_value_seq_lengths",
               "an integer tensor", lengths.dtype)
        _check(_broadcasts_to(lengths.shape, batch), "key_value_seq_lengths",
               f"shape broadcastable to the batch dims {batch}", _shape(lengths))
    for name, pos, length in (("query_positions", query_positions, T), ("key_positions", key_positions, S)):
        if pos is not None:
            pos = torch.as_tensor(pos)
            _check(not pos.is_floating_point() and pos.dtype != torch.bool, name, "an integer tensor", pos.dtype)
            _check(_broadcasts_to(pos.shape, (*batch, length)), name,
                   f"shape broadcastable to [..., {length}] = {(*batch, length)}", _shape(pos))
    _check(0.0 <= dropout_rate < 1.0, "dropout_rate", "a float in [0, 1)", dropout_rate)


# ---------------------------------------------------------------------------------------------------------
# the math


def _allowed(
    logits: Tensor, *, mask, bias, is_causal, key_value_seq_lengths, query_positions, key_positions
) -> Tensor | None:
    """Bool ``[..., N, T, S]``: where a query may attend a key (None: everywhere)."""
    *batch, N, T, S = logits.shape
    allowed = None

    def both(a, b):
        return b if a is None else a & b

    if mask is not None:
        allowed = both(allowed, mask.to(logits.device))
    if bias is not None:
        allowed = both(allowed, bias.to(logits.device) != float("-inf"))
    if is_causal:
        default_q, default_k = _default_positions(T, S, logits.device)
        query_pos = _positions(query_positions, T, default_q, "query_positions")
        key_pos = _positions(key_positions, S, default_k, "key_positions")
        causal = key_pos.unsqueeze(-2) <= query_pos.unsqueeze(-1)  # [..., T, S]
        allowed = both(allowed, causal.unsqueeze(-3))  # [..., 1, T, S]
    if key_value_seq_lengths is not None:
        lengths = torch.as_tensor(key_value_seq_lengths, device=logits.device)
        valid = torch.arange(S, device=logits.device) < lengths.unsqueeze(-1)  # [..., S]
        allowed = both(allowed, valid[..., None, None, :])  # [..., 1, 1, S]
    if allowed is None:
        return None
    return torch.broadcast_to(allowed, logits.shape)


def _expand_heads(x: Tensor, N: int) -> Tensor:
    """``[..., S, K, D] -> [..., S, N, D]``: query head n uses key/value head n // (N // K)."""
    K = x.shape[-2]
    return x.repeat_interleave(N // K, dim=-2)


def _expand_rel(rel: Tensor, N: int) -> Tensor:
    """``[..., T, S, 1 or N, D] -> [..., T, S, N, D]`` (a shared relative term serves every head)."""
    return rel.expand(*rel.shape[:-2], N, rel.shape[-1])


def _softmax_with_empty_rows(logits: Tensor, allowed: Tensor | None) -> Tensor:
    if allowed is None:
        return torch.softmax(logits, dim=-1)
    row_has_key = allowed.any(dim=-1, keepdim=True)
    logits = logits.masked_fill(~allowed, _MASKED)
    logits = logits.masked_fill(~row_has_key, _EMPTY_ROW_FILL)
    weights = torch.softmax(logits, dim=-1)
    return torch.where(row_has_key, weights, torch.zeros_like(weights))


def _dropout(weights: Tensor, rate: float, generator) -> Tensor:
    if rate == 0.0:
        return weights
    keep = torch.rand(weights.shape, generator=generator, dtype=weights.dtype, device=weights.device) >= rate
    return weights * keep / (1.0 - rate)


def _compute_dtype(*tensors: Tensor | None) -> torch.dtype:
    """Float64 stays float64; float32 and half precision compute in float32."""
    dtype = torch.float32
    for x in tensors:
        if x is not None and x.is_floating_point():
            dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def _attention(
    query, key, value, rel_key, rel_value, *, bias, mask, is_causal, key_value_seq_lengths,
    query_positions, key_positions, scale, dropout_rate, generator, return_weights,
):
    batch = _check_qkv(query, key, value)
    *_, T, N, H = query.shape
    S, Hv = key.shape[-3], value.shape[-1]
    _check_rel(rel_key, "rel_key", batch, T, S, N, H)
    _check_rel(rel_value, "rel_value", batch, T, S, N, Hv)
    _check_extra(batch, N, T, S, mask=mask, bias=bias, key_value_seq_lengths=key_value_seq_lengths,
                 query_positions=query_positions, key_positions=key_positions, dropout_rate=dropout_rate)
    if scale is None:
        scale = H ** -0.5

    dtype = _compute_dtype(query, key, value, rel_key, rel_value, bias)
    q = query.to(dtype)
    k = _expand_heads(key.to(dtype), N)  # [..., S, N, H]
    v = _expand_heads(value.to(dtype), N)  # [..., S, N, Hv]

    logits = q.transpose(-3, -2) @ k.transpose(-3, -2).transpose(-2, -1)  # [..., N, T, S]
    if rel_key is not None:
        logits = logits + torch.einsum("...tnh,...tsnh->...nts", q, _expand_rel(rel_key.to(dtype), N))
    logits = logits * scale
    if bias is not None:
        logits = logits + bias.to(dtype)

    allowed = _allowed(logits, mask=mask, bias=bias, is_causal=is_causal,
                       key_value_seq_lengths=key_value_seq_lengths,
                       query_positions=query_positions, key_positions=key_positions)
    weights = _softmax_with_empty_rows(logits, allowed)
    weights = _dropout(weights, dropout_rate, generator)

    out = (weights @ v.transpose(-3, -2)).transpose(-3, -2)  # [..., T, N, Hv]
    if rel_value is not None:
        out = out + torch.einsum("...nts,...tsnh->...tnh", weights, _expand_rel(rel_value.to(dtype), N))

    out_dtype = query.dtype
    out = out.to(out_dtype)
    if return_weights:
        return out, weights.to(out_dtype)
    return out


def dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    bias: Tensor | None = None,
    mask: Tensor | None = None,
    is_causal: bool = False,
    key_value_seq_lengths=None,
    query_positions=None,
    key_positions=None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    generator: torch.Generator | None = None,
    return_weights: bool = False,
):
    """Scaled dot-product attention, ``[..., T, N, H], [..., S, K, H], [..., S, K, Hv] -> [..., T, N, Hv]``.

    ``logits[n, t, s] = scale * q[t, n] . k[s, n // (N // K)] + bias[n, t, s]`` over the allowed keys
    (``mask`` True, causal, within ``key_value_seq_lengths``, bias not -inf), softmax over ``s``,
    ``out[t, n] = sum_s p[n, t, s] * v[s, n // (N // K)]``. A row with no allowed key gives zeros.
    With ``return_weights`` returns ``(out, weights [..., N, T, S])`` (after dropout).
    """
    return _attention(
        query, key, value, None, None, bias=bias, mask=mask, is_causal=is_causal,
        key_value_seq_lengths=key_value_seq_lengths, query_positions=query_positions,
        key_positions=key_positions, scale=scale, dropout_rate=dropout_rate, generator=generator,
        return_weights=return_weights,
    )


def relative_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    rel_key: Tensor | None = None,
    rel_value: Tensor | None = None,
    *,
    bias: Tensor | None = None,
    mask: Tensor | None = None,
    is_causal: bool = False,
    key_value_seq_lengths=None,
    query_positions=None,
    key_positions=None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    generator: torch.Generator | None = None,
    return_weights: bool = False,
):
    """Attention with per-pair relative terms (the seed-000 form).

    ``rel_key`` A^K is ``[T, S, N, H]`` (or ``[T, S, 1, H]``, shared over heads), ``rel_value`` A^V is
    ``[T, S, N, Hv]`` (or ``[T, S, 1, Hv]``); either may carry leading dims broadcastable to the batch.
    ``logits[n, t, s] = scale * q[t, n] . (k[s, kv(n)] + A^K[t, s, n]) + bias[n, t, s]``,
    ``out[t, n] = sum_s p[n, t, s] * (v[s, kv(n)] + A^V[t, s, n])``; everything else as
    :func:`dot_product_attention`.
    """
    return _attention(
        query, key, value, rel_key, rel_value, bias=bias, mask=mask, is_causal=is_causal,
        key_value_seq_lengths=key_value_seq_lengths, query_positions=query_positions,
        key_positions=key_positions, scale=scale, dropout_rate=dropout_rate, generator=generator,
        return_weights=return_weights,
    )


def _gather_table(table: Tensor | None, name: str, index: Tensor, R: int, N: int, dim: int) -> Tensor | None:
    """``[R, D]`` or ``[R, N, D]`` table -> ``[..., T, S, 1 or N, D]`` relative term."""
    if table is None:
        return None
    expected = f"shape [{R}, {dim}] (shared over heads) or [{R}, {N}, {dim}] (per head), R = 2 * max_distance + 1"
    _check(isinstance(table, Tensor), name, "a torch.Tensor", type(table).__name__)
    ok = (table.ndim == 2 and tuple(table.shape) == (R, dim)) or (
        table.ndim == 3 and tuple(table.shape) == (R, N, dim))
    _check(ok, name, expected, f"shape {_shape(table)}")
    gathered = table[index.to(table.device)]  # [..., T, S, (N,) D]
    return gathered.unsqueeze(-2) if table.ndim == 2 else gathered


def shaw_relative_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_table: Tensor | None = None,
    value_table: Tensor | None = None,
    *,
    max_distance: int,
    bias: Tensor | None = None,
    mask: Tensor | None = None,
    is_causal: bool = False,
    key_value_seq_lengths=None,
    query_positions=None,
    key_positions=None,
    scale: float | None = None,
    dropout_rate: float = 0.0,
    generator: torch.Generator | None = None,
    return_weights: bool = False,
):
    """Shaw et al. (2018) clipped relative attention.

    Tables are ``[R, H]`` (shared over heads) or ``[R, N, H]`` (per head); the value table ``[R, Hv]`` or
    ``[R, N, Hv]``; ``R = 2 * max_distance + 1``. Equal to :func:`relative_attention` with
    ``A = table[relative_position_index(T, S, max_distance, query_positions=..., key_positions=...)]``,
    which is exactly how this oracle computes it.
    """
    _check(_is_count(max_distance), "max_distance", "a non-negative int", max_distance)
    max_distance = int(max_distance)
    batch = _check_qkv(query, key, value)
    *_, T, N, H = query.shape
    S, Hv = key.shape[-3], value.shape[-1]
    _check_extra(batch, N, T, S, mask=mask, bias=bias, key_value_seq_lengths=key_value_seq_lengths,
                 query_positions=query_positions, key_positions=key_positions, dropout_rate=dropout_rate)
    R = 2 * max_distance + 1
    index = relative_position_index(T, S, max_distance, query_positions=query_positions,
                                    key_positions=key_positions)
    rel_key = _gather_table(key_table, "key_table", index, R, N, H)
    rel_value = _gather_table(value_table, "value_table", index, R, N, Hv)
    return relative_attention(
        query, key, value, rel_key, rel_value, bias=bias, mask=mask, is_causal=is_causal,
        key_value_seq_lengths=key_value_seq_lengths, query_positions=query_positions,
        key_positions=key_positions, scale=scale, dropout_rate=dropout_rate, generator=generator,
        return_weights=return_weights,
    )
