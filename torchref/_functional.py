"""Attention as plain torch code: matmul, einsum, masked_fill, softmax.

This is the oracle: every step is the textbook formula, spelled out, with no tricks. Shapes use the axis
letters of the package docstring; logits and weights are ``[..., N, T, S]``.
"""

from __future__ import annotations

import math
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
        name,
        "an integer tensor",
        positions.dtype,
    )
    _check(
        positions.ndim == 0 or positions.shape[-1] in (1, length),
        name,
        f"shape broadcastable to [..., {length}]",
        _shape(positions),
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
        "key_positions",
        f"batch dims broadcastable with query_positions {_shape(query_pos)}",
        _shape(key_pos),
    )
    distance = key_pos.unsqueeze(-2) - query_pos.unsqueeze(-1)  # [..., T, S]
    return distance.clamp(-max_distance, max_distance) + max_distance


# ---------------------------------------------------------------------------------------------------------
# input checks


def _check_qkv(query: Tensor, key: Tensor, value: Tensor) -> tuple[int, ...]:
    """Validate ``query [..., T, N, H]``, ``key [..., S, K, H]``, ``value [..., S, K, Hv]``; return the batch."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        _check(isinstance(x, Tensor), name, "a torch.Tensor", type(x).__name__)
        _check(
            x.ndim >= 3,
            name,
            f"rank >= 3 ([..., {'T' if name == 'query' else 'S'}, heads, head_dim])",
            f"shape {_shape(x)}",
        )
        _check(x.is_floating_point(), name, "a floating-point tensor", x.dtype)
    *_, T, N, H = query.shape
    *_, S, K, _ = key.shape
    _check(
        key.shape[-1] == H, "key", f"head dim H={H} (query's last dim), shape [..., S, K, {H}]", f"shape {_shape(key)}"
    )
    _check(
        value.shape[-3:-1] == key.shape[-3:-1],
        "value",
        f"shape [..., {S}, {K}, Hv] matching key's S and K",
        f"shape {_shape(value)}",
    )
    _check(
        K > 0 and N % K == 0,
        "key",
        f"a head count K dividing the query head count N={N}",
        f"K={K} (shape {_shape(key)})",
    )
    batches = (query.shape[:-3], key.shape[:-3], value.shape[:-3])
    _check(
        _broadcasts_together(*batches),
        "key",
        f"batch dims broadcastable with query {tuple(query.shape[:-3])} and value {tuple(value.shape[:-3])}",
        tuple(key.shape[:-3]),
    )
    return tuple(torch.broadcast_shapes(*batches))


def _check_rel(rel: Tensor | None, name: str, batch: tuple[int, ...], T: int, S: int, N: int, dim: int) -> None:
    if rel is None:
        return
    expected = f"shape [..., {T}, {S}, {N} or 1, {dim}] ([T, S, N or 1, head_dim])"
    _check(isinstance(rel, Tensor), name, "a torch.Tensor", type(rel).__name__)
    _check(rel.ndim >= 4, name, expected, f"shape {_shape(rel)}")
    _check(
        tuple(rel.shape[-4:-2]) == (T, S) and rel.shape[-2] in (N, 1) and rel.shape[-1] == dim,
        name,
        expected,
        f"shape {_shape(rel)}",
    )
    _check(
        _broadcasts_to(rel.shape[:-4], batch),
        name,
        f"leading dims broadcastable to the batch {batch}",
        f"shape {_shape(rel)}",
    )


def _check_extra(
    batch, N, T, S, *, mask, bias, key_value_seq_lengths, query_positions, key_positions, dropout_rate
) -> None:
    target = (*batch, N, T, S)
    if mask is not None:
        _check(
            isinstance(mask, Tensor) and mask.dtype == torch.bool,
            "mask",
            "a bool tensor (True = may attend)",
            getattr(mask, "dtype", type(mask).__name__),
        )
        _check(
            _broadcasts_to(mask.shape, target),
            "mask",
            f"shape broadcastable to [..., N, T, S] = {target}",
            _shape(mask),
        )
    if bias is not None:
        _check(
            isinstance(bias, Tensor) and bias.is_floating_point(),
            "bias",
            "a floating-point tensor",
            getattr(bias, "dtype", type(bias).__name__),
        )
        _check(
            _broadcasts_to(bias.shape, target),
            "bias",
            f"shape broadcastable to [..., N, T, S] = {target}",
            _shape(bias),
        )
    if key_value_seq_lengths is not None:
        lengths = torch.as_tensor(key_value_seq_lengths)
        _check(
            not lengths.is_floating_point() and lengths.dtype != torch.bool,
            "key_value_seq_lengths",
            "an integer tensor",
            lengths.dtype,
        )
        _check(
            _broadcasts_to(lengths.shape, batch),
            "key_value_seq_lengths",
            f"shape broadcastable to the batch dims {batch}",
            _shape(lengths),
        )
    for name, pos, length in (("query_positions", query_positions, T), ("key_positions", key_positions, S)):
        if pos is not None:
            pos = torch.as_tensor(pos)
            _check(not pos.is_floating_point() and pos.dtype != torch.bool, name, "an integer tensor", pos.dtype)
            _check(
                _broadcasts_to(pos.shape, (*batch, length)),
                name,
                f"shape broadcastable to [..., {length}] = {(*batch, length)}",
                _shape(pos),
            )
    _check(0.0 <= dropout_rate < 1.0, "dropout_rate", "a float in [0, 1)", dropout_rate)


def _check_int_ids(ids, name: str, target: tuple[int, ...]) -> None:
    _check(isinstance(ids, Tensor), name, "a torch.Tensor", type(ids).__name__)
    _check(
        not ids.is_floating_point() and not ids.is_complex() and ids.dtype != torch.bool,
        name,
        "an integer tensor",
        ids.dtype,
    )
    _check(_broadcasts_to(ids.shape, target), name, f"shape broadcastable to {target}", _shape(ids))


def _segments(query_segment_ids, key_segment_ids, T: int, S: int):
    """Either id array alone serves both sides (packed self-attention), which needs T == S."""
    if query_segment_ids is None and key_segment_ids is None:
        return None, None
    if key_segment_ids is None:
        _check(
            T == S,
            "key_segment_ids",
            f"an int tensor [..., S={S}] (query_segment_ids alone serves both sides only when T == S; T={T})",
            None,
        )
        return query_segment_ids, query_segment_ids
    if query_segment_ids is None:
        _check(
            T == S,
            "query_segment_ids",
            f"an int tensor [..., T={T}] (key_segment_ids alone serves both sides only when T == S; S={S})",
            None,
        )
        return key_segment_ids, key_segment_ids
    return query_segment_ids, key_segment_ids


def _check_modern(
    batch, N, T, S, *, query_segment_ids, key_segment_ids, window, chunk_size, logit_softcap, sinks
) -> None:
    """The issue-11 keywords: segments, window, chunk_size, logit_softcap, sinks."""
    if query_segment_ids is not None:
        _check_int_ids(query_segment_ids, "query_segment_ids", (*batch, T))
    if key_segment_ids is not None:
        _check_int_ids(key_segment_ids, "key_segment_ids", (*batch, S))
    if window is not None:
        _check(isinstance(window, (tuple, list)) and len(window) == 2, "window", "a pair (left, right)", window)
        _check(
            all(side is None or _is_count(side) for side in window),
            "window",
            "(left, right) each a non-negative int or None",
            window,
        )
    if chunk_size is not None:
        _check(_is_count(chunk_size) and chunk_size > 0, "chunk_size", "a positive int", chunk_size)
    if logit_softcap is not None:
        _check(
            isinstance(logit_softcap, numbers.Real)
            and not isinstance(logit_softcap, bool)
            and 0 < logit_softcap < float("inf"),
            "logit_softcap",
            "a positive finite float",
            logit_softcap,
        )
    if sinks is not None:
        _check(
            isinstance(sinks, Tensor) and sinks.is_floating_point(),
            "sinks",
            "a floating-point tensor",
            getattr(sinks, "dtype", type(sinks).__name__),
        )
        _check(
            sinks.ndim >= 1 and sinks.shape[-1] == N and _broadcasts_to(sinks.shape, (*batch, N)),
            "sinks",
            f"shape [N] or [..., N] broadcastable to {(*batch, N)}",
            _shape(sinks),
        )


# ---------------------------------------------------------------------------------------------------------
# the math


def _absolute_positions(T: int, S: int, query_positions, key_positions, device) -> tuple[Tensor, Tensor]:
    """``[..., T]`` and ``[..., S]``: query t at t + (S - T) and key s at s, unless positions are given."""
    default_q, default_k = _default_positions(T, S, device)
    return (
        _positions(query_positions, T, default_q, "query_positions"),
        _positions(key_positions, S, default_k, "key_positions"),
    )


def _floor_div(x: Tensor, d: int) -> Tensor:
    return torch.div(x, d, rounding_mode="floor")


def _position_rules(query_pos: Tensor, key_pos: Tensor, *, is_causal, window, chunk_size) -> list[Tensor]:
    """The rules on absolute positions, each bool ``[..., T, S]``: causal, window, chunk."""
    t = query_pos.unsqueeze(-1)  # [..., T, 1]
    s = key_pos.unsqueeze(-2)  # [..., 1, S]
    rules = []
    if is_causal:
        rules.append(s <= t)
    if window is not None:
        left, right = window
        if left is not None:
            rules.append(s >= t - left)
        if right is not None:
            rules.append(s <= t + right)
    if chunk_size is not None:
        rules.append(_floor_div(t, chunk_size) == _floor_div(s, chunk_size))
    return rules


def _allowed(
    logits: Tensor,
    query_pos: Tensor,
    key_pos: Tensor,
    *,
    mask,
    bias,
    is_causal,
    key_value_seq_lengths,
    query_segment_ids,
    key_segment_ids,
    window,
    chunk_size,
    mod_mask,
) -> Tensor | None:
    """Bool ``[..., N, T, S]``: where a query may attend a key (None: everywhere)."""
    S = logits.shape[-1]
    device = logits.device
    terms = []  # each broadcastable to [..., N, T, S]
    if mask is not None:
        terms.append(mask.to(device))
    if bias is not None:
        terms.append(bias.to(device) != float("-inf"))
    terms += [
        rule.unsqueeze(-3)
        for rule in _position_rules(  # [..., 1, T, S]
            query_pos, key_pos, is_causal=is_causal, window=window, chunk_size=chunk_size
        )
    ]
    if key_value_seq_lengths is not None:
        lengths = torch.as_tensor(key_value_seq_lengths, device=device)
        valid = torch.arange(S, device=device) < lengths.unsqueeze(-1)  # [..., S]
        terms.append(valid[..., None, None, :])  # [..., 1, 1, S]
    if query_segment_ids is not None:
        q_ids = query_segment_ids.to(device)[..., None, :, None]  # [..., 1, T, 1]
        k_ids = key_segment_ids.to(device)[..., None, None, :]  # [..., 1, 1, S]
        terms.append(q_ids == k_ids)
    if mod_mask is not None:
        terms.append(mod_mask)
    if not terms:
        return None
    allowed = terms[0]
    for term in terms[1:]:
        allowed = allowed & term
    return torch.broadcast_to(allowed, logits.shape)


# ---------------------------------------------------------------------------------------------------------
# score_mod / mask_mod: user functions of (b, n, t, s) on broadcast index tensors


def _mod_indices(batch: tuple[int, ...], N: int, query_pos: Tensor, key_pos: Tensor):
    """``b [Bf,1,1,1], n [1,N,1,1], t [Bf,1,T,1], s [Bf,1,1,S]``; b indexes the flattened batch dims."""
    Bf = math.prod(batch)
    T, S = query_pos.shape[-1], key_pos.shape[-1]
    device = query_pos.device
    b = torch.arange(Bf, device=device).view(Bf, 1, 1, 1)
    n = torch.arange(N, device=device).view(1, N, 1, 1)
    t = torch.broadcast_to(query_pos, (*batch, T)).reshape(Bf, 1, T, 1)
    s = torch.broadcast_to(key_pos, (*batch, S)).reshape(Bf, 1, 1, S)
    return b, n, t, s


def _apply_score_mod(score_mod, logits: Tensor, indices) -> Tensor:
    flat = logits.reshape(-1, *logits.shape[-3:])  # [Bf, N, T, S]
    result = score_mod(flat, *indices)
    _check(
        isinstance(result, Tensor) and tuple(result.shape) == tuple(flat.shape) and result.dtype == flat.dtype,
        "score_mod",
        f"to return a {flat.dtype} tensor of shape {tuple(flat.shape)} ([B, N, T, S])",
        f"{getattr(result, 'dtype', type(result).__name__)} of shape {tuple(getattr(result, 'shape', ()))}",
    )
    return result.reshape(logits.shape)


def _apply_mask_mod(mask_mod, shape: tuple[int, ...], indices) -> Tensor:
    flat_shape = (math.prod(shape[:-3]), *shape[-3:])  # [Bf, N, T, S]
    allowed = mask_mod(*indices)
    _check(
        isinstance(allowed, Tensor) and allowed.dtype == torch.bool,
        "mask_mod",
        "to return a bool tensor",
        getattr(allowed, "dtype", type(allowed).__name__),
    )
    _check(
        _broadcasts_to(allowed.shape, flat_shape),
        "mask_mod",
        f"to return a shape broadcastable to {flat_shape} ([B, N, T, S])",
        _shape(allowed),
    )
    return torch.broadcast_to(allowed, flat_shape).reshape(shape)


def _expand_heads(x: Tensor, N: int) -> Tensor:
    """``[..., S, K, D] -> [..., S, N, D]``: query head n uses key/value head n // (N // K)."""
    K = x.shape[-2]
    return x.repeat_interleave(N // K, dim=-2)


def _expand_rel(rel: Tensor, N: int) -> Tensor:
    """``[..., T, S, 1 or N, D] -> [..., T, S, N, D]`` (a shared relative term serves every head)."""
    return rel.expand(*rel.shape[:-2], N, rel.shape[-1])


def _softmax_with_empty_rows(logits: Tensor, allowed: Tensor | None, sinks: Tensor | None = None) -> Tensor:
    """Softmax over the allowed keys; rows with no allowed key are zeros.

    ``sinks [..., N]``: one more logit per head in the denominator, with no value (its weight is dropped). A row
    with no allowed key stays zeros with a sink too (the limit of a sink-only row: every key weight is 0).
    """
    if allowed is None:
        allowed = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
    row_has_key = allowed.any(dim=-1, keepdim=True)
    logits = logits.masked_fill(~allowed, _MASKED)
    logits = logits.masked_fill(~row_has_key, _EMPTY_ROW_FILL)
    if sinks is None:
        weights = torch.softmax(logits, dim=-1)
    else:
        sink = sinks[..., None, None].expand(*logits.shape[:-1], 1)  # [..., N, T, 1]
        weights = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
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
    query,
    key,
    value,
    rel_key,
    rel_value,
    *,
    bias,
    mask,
    is_causal,
    key_value_seq_lengths,
    query_positions,
    key_positions,
    scale,
    dropout_rate,
    generator,
    return_weights,
    query_segment_ids=None,
    key_segment_ids=None,
    window=None,
    chunk_size=None,
    logit_softcap=None,
    sinks=None,
    score_mod=None,
    mask_mod=None,
):
    batch = _check_qkv(query, key, value)
    *_, T, N, H = query.shape
    S, Hv = key.shape[-3], value.shape[-1]
    _check_rel(rel_key, "rel_key", batch, T, S, N, H)
    _check_rel(rel_value, "rel_value", batch, T, S, N, Hv)
    _check_extra(
        batch,
        N,
        T,
        S,
        mask=mask,
        bias=bias,
        key_value_seq_lengths=key_value_seq_lengths,
        query_positions=query_positions,
        key_positions=key_positions,
        dropout_rate=dropout_rate,
    )
    query_segment_ids, key_segment_ids = _segments(query_segment_ids, key_segment_ids, T, S)
    _check_modern(
        batch,
        N,
        T,
        S,
        query_segment_ids=query_segment_ids,
        key_segment_ids=key_segment_ids,
        window=window,
        chunk_size=chunk_size,
        logit_softcap=logit_softcap,
        sinks=sinks,
    )
    if scale is None:
        scale = H**-0.5

    dtype = _compute_dtype(query, key, value, rel_key, rel_value, bias, sinks)
    q = query.to(dtype)
    k = _expand_heads(key.to(dtype), N)  # [..., S, N, H]
    v = _expand_heads(value.to(dtype), N)  # [..., S, N, Hv]

    logits = q.transpose(-3, -2) @ k.transpose(-3, -2).transpose(-2, -1)  # [..., N, T, S]
    if rel_key is not None:
        logits = logits + torch.einsum("...tnh,...tsnh->...nts", q, _expand_rel(rel_key.to(dtype), N))
    logits = (logits * scale).expand(*batch, N, T, S)
    if logit_softcap is not None:  # on the query-key logits only: biases and score_mod come after
        logits = logit_softcap * torch.tanh(logits / logit_softcap)

    query_pos, key_pos = _absolute_positions(T, S, query_positions, key_positions, logits.device)
    mod_mask = None
    if score_mod is not None or mask_mod is not None:
        indices = _mod_indices(batch, N, query_pos, key_pos)
        if score_mod is not None:
            logits = _apply_score_mod(score_mod, logits, indices)
            mod_mask = logits != float("-inf")  # a score_mod may mask by returning -inf, as a bias may
        if mask_mod is not None:
            allowed_by_mod = _apply_mask_mod(mask_mod, tuple(logits.shape), indices)
            mod_mask = allowed_by_mod if mod_mask is None else mod_mask & allowed_by_mod
    if bias is not None:
        logits = logits + bias.to(dtype)

    allowed = _allowed(
        logits,
        query_pos,
        key_pos,
        mask=mask,
        bias=bias,
        is_causal=is_causal,
        key_value_seq_lengths=key_value_seq_lengths,
        query_segment_ids=query_segment_ids,
        key_segment_ids=key_segment_ids,
        window=window,
        chunk_size=chunk_size,
        mod_mask=mod_mask,
    )
    weights = _softmax_with_empty_rows(logits, allowed, None if sinks is None else sinks.to(dtype))
    weights = _dropout(weights, dropout_rate, generator)

    out = (weights @ v.transpose(-3, -2)).transpose(-3, -2)  # [..., T, N, Hv]
    if rel_value is not None:
        out = out + torch.einsum("...nts,...tsnh->...tnh", weights, _expand_rel(rel_value.to(dtype), N))

    out_dtype = query.dtype
    out = out.to(out_dtype)
    if return_weights:
        return out, weights.to(out_dtype)
    return out


def _modern(query_segment_ids, key_segment_ids, window, chunk_size, logit_softcap, sinks) -> dict:
    """The programmable-attention keywords, passed on unchanged by every public function."""
    return {
        "query_segment_ids": query_segment_ids,
        "key_segment_ids": key_segment_ids,
        "window": window,
        "chunk_size": chunk_size,
        "logit_softcap": logit_softcap,
        "sinks": sinks,
    }


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
    query_segment_ids: Tensor | None = None,
    key_segment_ids: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    chunk_size: int | None = None,
    logit_softcap: float | None = None,
    sinks: Tensor | None = None,
):
    """Scaled dot-product attention, ``[..., T, N, H], [..., S, K, H], [..., S, K, Hv] -> [..., T, N, Hv]``.

    ``logits[n, t, s] = cap(scale * q[t, n] . k[s, n // (N // K)]) + bias[n, t, s]`` over the allowed keys,
    softmax over ``s`` (plus the sink), ``out[t, n] = sum_s p[n, t, s] * v[s, n // (N // K)]``. A row with no
    allowed key gives zeros. With ``return_weights`` returns ``(out, weights [..., N, T, S])`` (after dropout;
    with ``sinks`` a row sums to less than 1).

    A key is allowed where every given rule allows it (``tq`` / ``sk``: the absolute positions, query t at
    ``t + (S - T)`` or ``query_positions[t]``, key s at ``s`` or ``key_positions[s]``):

    - ``mask`` True; ``bias`` not -inf; ``is_causal``: ``sk <= tq``; ``key_value_seq_lengths``: ``s < length``;
    - ``query_segment_ids [..., T]`` / ``key_segment_ids [..., S]`` (int): equal ids (either alone serves both
      sides when T == S);
    - ``window=(left, right)``: ``tq - left <= sk <= tq + right``, None = unbounded on that side;
    - ``chunk_size=C``: ``floor(tq / C) == floor(sk / C)``.

    ``logit_softcap=c``: ``cap(x) = c * tanh(x / c)`` on the scaled query-key logits (relative key terms
    included), before ``bias`` and position biases. ``sinks [N]`` or ``[..., N]``: a per-head logit added to
    the softmax denominator with no value; a row with no allowed key still gives zeros (and zero gradient).
    """
    return _attention(
        query,
        key,
        value,
        None,
        None,
        bias=bias,
        mask=mask,
        is_causal=is_causal,
        key_value_seq_lengths=key_value_seq_lengths,
        query_positions=query_positions,
        key_positions=key_positions,
        scale=scale,
        dropout_rate=dropout_rate,
        generator=generator,
        return_weights=return_weights,
        **_modern(query_segment_ids, key_segment_ids, window, chunk_size, logit_softcap, sinks),
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
    query_segment_ids: Tensor | None = None,
    key_segment_ids: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    chunk_size: int | None = None,
    logit_softcap: float | None = None,
    sinks: Tensor | None = None,
):
    """Attention with per-pair relative terms (the seed-000 form).

    ``rel_key`` A^K is ``[T, S, N, H]`` (or ``[T, S, 1, H]``, shared over heads), ``rel_value`` A^V is
    ``[T, S, N, Hv]`` (or ``[T, S, 1, Hv]``); either may carry leading dims broadcastable to the batch.
    ``logits[n, t, s] = scale * q[t, n] . (k[s, kv(n)] + A^K[t, s, n]) + bias[n, t, s]``,
    ``out[t, n] = sum_s p[n, t, s] * (v[s, kv(n)] + A^V[t, s, n])``; everything else as
    :func:`dot_product_attention`.
    """
    return _attention(
        query,
        key,
        value,
        rel_key,
        rel_value,
        bias=bias,
        mask=mask,
        is_causal=is_causal,
        key_value_seq_lengths=key_value_seq_lengths,
        query_positions=query_positions,
        key_positions=key_positions,
        scale=scale,
        dropout_rate=dropout_rate,
        generator=generator,
        return_weights=return_weights,
        **_modern(query_segment_ids, key_segment_ids, window, chunk_size, logit_softcap, sinks),
    )


def _gather_table(table: Tensor | None, name: str, index: Tensor, R: int, N: int, dim: int) -> Tensor | None:
    """``[R, D]`` or ``[R, N, D]`` table -> ``[..., T, S, 1 or N, D]`` relative term."""
    if table is None:
        return None
    expected = f"shape [{R}, {dim}] (shared over heads) or [{R}, {N}, {dim}] (per head), R = 2 * max_distance + 1"
    _check(isinstance(table, Tensor), name, "a torch.Tensor", type(table).__name__)
    ok = (table.ndim == 2 and tuple(table.shape) == (R, dim)) or (table.ndim == 3 and tuple(table.shape) == (R, N, dim))
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
    query_segment_ids: Tensor | None = None,
    key_segment_ids: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    chunk_size: int | None = None,
    logit_softcap: float | None = None,
    sinks: Tensor | None = None,
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
    _check_extra(
        batch,
        N,
        T,
        S,
        mask=mask,
        bias=bias,
        key_value_seq_lengths=key_value_seq_lengths,
        query_positions=query_positions,
        key_positions=key_positions,
        dropout_rate=dropout_rate,
    )
    R = 2 * max_distance + 1
    index = relative_position_index(T, S, max_distance, query_positions=query_positions, key_positions=key_positions)
    rel_key = _gather_table(key_table, "key_table", index, R, N, H)
    rel_value = _gather_table(value_table, "value_table", index, R, N, Hv)
    return relative_attention(
        query,
        key,
        value,
        rel_key,
        rel_value,
        bias=bias,
        mask=mask,
        is_causal=is_causal,
        key_value_seq_lengths=key_value_seq_lengths,
        query_positions=query_positions,
        key_positions=key_positions,
        scale=scale,
        dropout_rate=dropout_rate,
        generator=generator,
        return_weights=return_weights,
        **_modern(query_segment_ids, key_segment_ids, window, chunk_size, logit_softcap, sinks),
    )


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    score_mod=None,
    mask_mod=None,
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
    query_segment_ids: Tensor | None = None,
    key_segment_ids: Tensor | None = None,
    window: tuple[int | None, int | None] | None = None,
    chunk_size: int | None = None,
    logit_softcap: float | None = None,
    sinks: Tensor | None = None,
):
    """:func:`dot_product_attention` with a score function and a mask function of the positions.

    ``score_mod(score, b, n, t, s) -> score`` and ``mask_mod(b, n, t, s) -> bool`` are called once, on whole
    tensors: ``score [B, N, T, S]`` (the scaled logits after ``logit_softcap``, before ``bias``), ``b [B, 1, 1, 1]``
    (index into the flattened leading batch dims), ``n [1, N, 1, 1]``, ``t [B, 1, T, 1]`` and ``s [B, 1, 1, S]``
    the ABSOLUTE query and key positions (``t + (S - T)`` and ``s``, or ``query_positions`` / ``key_positions``;
    unlike torch's flex_attention, which passes row indices). ``score_mod`` must keep the shape and dtype; a
    -inf score masks the key. ``mask_mod`` returns bool broadcastable to ``[B, N, T, S]`` (True = may attend),
    combined (AND) with every other mask keyword. Tensors the functions close over receive gradients.
    """
    return _attention(
        query,
        key,
        value,
        None,
        None,
        bias=bias,
        mask=mask,
        is_causal=is_causal,
        key_value_seq_lengths=key_value_seq_lengths,
        query_positions=query_positions,
        key_positions=key_positions,
        scale=scale,
        dropout_rate=dropout_rate,
        generator=generator,
        return_weights=return_weights,
        score_mod=score_mod,
        mask_mod=mask_mod,
        **_modern(query_segment_ids, key_segment_ids, window, chunk_size, logit_softcap, sinks),
    )
