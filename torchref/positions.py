"""Plain torch twins of jaxattn's relative-position schemes: T5, DeBERTa, ALiBi, RoPE, clipped keys, Transformer-XL.

Written as the papers state them, sharing no code with jaxattn: every position term is materialised as a
full [..., N, T, S] bias or [T, S, ...] table and handed to torchref's attention. Index convention (as
jaxattn's): relative position = j - i = key_pos - query_pos, query t at t + (S - T), key s at s, unless
``query_positions`` / ``key_positions`` are given. Shapes use the axis letters of torchref's docstring.

    import torchref.positions as P
    out = P.t5_attention(q, k, v, table, bidirectional=False, max_distance=128, is_causal=True)
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from torchref._functional import dot_product_attention, relative_attention

__all__ = [
    "t5_relative_position_bucket",
    "t5_relative_bias",
    "t5_attention",
    "deberta_log_bucket_position",
    "deberta_relative_position",
    "disentangled_attention",
    "alibi_slopes",
    "alibi_bias",
    "alibi_attention",
    "apply_rope",
    "rope_permutation",
    "rope_attention",
    "clipped_relative_index",
    "clipped_relative_attention",
    "relative_sinusoids",
    "transformer_xl_attention",
]


def _check(ok: bool, name: str, expected: str, actual: object) -> None:
    if not ok:
        raise ValueError(f"{name}: expected {expected}, got {actual}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positions(T: int, S: int, query_positions=None, key_positions=None) -> tuple[Tensor, Tensor]:
    query_pos = torch.arange(T) + (S - T) if query_positions is None else torch.as_tensor(query_positions)
    key_pos = torch.arange(S) if key_positions is None else torch.as_tensor(key_positions)
    for name, pos in (("query_positions", query_pos), ("key_positions", key_pos)):
        _check(not pos.is_floating_point() and pos.dtype != torch.bool, name, "an integer tensor", pos.dtype)
    return query_pos.long(), key_pos.long()


def _relative(T: int, S: int, query_positions=None, key_positions=None) -> Tensor:
    """j - i as [..., T, S]."""
    query_pos, key_pos = _positions(T, S, query_positions, key_positions)
    return key_pos[..., None, :] - query_pos[..., :, None]


def _qkv_lengths(query: Tensor, key: Tensor) -> tuple[int, int]:
    return query.shape[-3], key.shape[-3]


# --- T5 -------------------------------------------------------------------------------------------------


def t5_relative_position_bucket(
    relative_position: Tensor, *, bidirectional: bool = True, num_buckets: int = 32, max_distance: int = 128
) -> Tensor:
    """Mesh TensorFlow's bucket of j - i, log in float32 (as the trained models). int64."""
    _check(_is_int(num_buckets) and num_buckets >= 2, "num_buckets", "an int >= 2", num_buckets)
    _check(not relative_position.is_floating_point(), "relative_position", "an integer tensor", relative_position.dtype)
    if bidirectional:
        half = num_buckets // 2
        offset = torch.where(relative_position > 0, half, 0)
        distance = relative_position.abs()
    else:
        half = num_buckets
        offset = torch.zeros_like(relative_position)
        distance = (-relative_position).clamp(min=0)
    max_exact = half // 2
    _check(max_exact >= 1, "num_buckets", ">= 4 when bidirectional", num_buckets)
    _check(_is_int(max_distance) and max_distance > max_exact, "max_distance", f"an int > {max_exact}", max_distance)
    log_ratio = torch.log(distance.clamp(min=max_exact).float() / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (half - max_exact)).long()).clamp(max=half - 1)
    return offset + torch.where(distance < max_exact, distance, large)


def t5_relative_bias(
    table: Tensor,
    query_length: int,
    key_length: int,
    *,
    bidirectional: bool = True,
    max_distance: int = 128,
    query_positions=None,
    key_positions=None,
) -> Tensor:
    """table [R, N] -> bias [..., N, T, S] = table[bucket(j - i), n]."""
    _check(table.ndim == 2, "table", "shape [R, N]", tuple(table.shape))
    buckets = t5_relative_position_bucket(
        _relative(query_length, key_length, query_positions, key_positions),
        bidirectional=bidirectional,
        num_buckets=table.shape[0],
        max_distance=max_distance,
    )
    return table[buckets].movedim(-1, -3)


def t5_attention(query, key, value, table, *, bidirectional=True, max_distance=128, scale=1.0, bias=None, **options):
    T, S = _qkv_lengths(query, key)
    position_bias = t5_relative_bias(
        table,
        T,
        S,
        bidirectional=bidirectional,
        max_distance=max_distance,
        query_positions=options.get("query_positions"),
        key_positions=options.get("key_positions"),
    )
    bias = position_bias if bias is None else position_bias + bias
    return dot_product_attention(query, key, value, bias=bias, scale=scale, **options)


# --- DeBERTa's disentangled attention ------------------------------------------------------------------


def deberta_log_bucket_position(relative_position: Tensor, *, position_buckets: int, max_relative_positions: int):
    """DeBERTa's log bucket of d (any int tensor), int64: d where |d| <= mid = position_buckets // 2, else
    sign(d) * (mid + ceil(log(|d| / mid) / log((max_relative_positions - 1) / mid) * (mid - 1))), in float32."""
    _check(_is_int(position_buckets) and position_buckets >= 2, "position_buckets", "an int >= 2", position_buckets)
    mid = position_buckets // 2
    _check(
        _is_int(max_relative_positions) and max_relative_positions - 1 > mid,
        "max_relative_positions",
        f"an int > {mid + 1}",
        max_relative_positions,
    )
    _check(not relative_position.is_floating_point(), "relative_position", "an integer tensor", relative_position.dtype)
    distance = relative_position.abs().clamp(min=mid).float()  # the clamp keeps log(0) out of the unused branch
    log_range = torch.log(torch.tensor((max_relative_positions - 1) / mid, dtype=torch.float32))
    steps = torch.ceil(torch.log(distance / mid) / log_range * (mid - 1))
    far = relative_position.sign() * (mid + steps.long())
    return torch.where(relative_position.abs() <= mid, relative_position, far).long()


def deberta_relative_position(
    query_length: int,
    key_length: int,
    *,
    position_buckets: int = -1,
    max_relative_positions: int = -1,
    query_positions=None,
    key_positions=None,
) -> Tensor:
    """bucket(j - i), int64 [..., T, S]; no buckets (j - i) when either setting is <= 0."""
    relative = _relative(query_length, key_length, query_positions, key_positions)
    if position_buckets <= 0 or max_relative_positions <= 0:
        return relative
    return deberta_log_bucket_position(
        relative, position_buckets=position_buckets, max_relative_positions=max_relative_positions
    )


def disentangled_attention(
    query,
    key,
    value,
    position_keys=None,
    position_queries=None,
    *,
    max_relative_positions,
    position_buckets=-1,
    scale=None,
    bias=None,
    **options,
):
    """scale * (q_t . k_s + q_t . Kr[row] + k_s . Qr[row]), row[t, s] = clip(span - bucket(j - i), 0, 2 span - 1).

    Kr / Qr: [R, N or 1 omitted, H] tables of R = 2 * span rows (span = position_buckets if > 0, else
    max_relative_positions); scale defaults to 1 / sqrt(H * (1 + number of tables)). All three terms are
    query-key logits, written as ONE dot product of concatenations (as transformer_xl_attention):
    ``[q, 1] . ([k, 0] + [Kr[row], k * Qr[row]])``, relative_attention with doubled H.
    """
    T, S, N, K, H = query.shape[-3], key.shape[-3], query.shape[-2], key.shape[-2], query.shape[-1]
    span = position_buckets if position_buckets > 0 else max_relative_positions
    terms = [t for t in (position_keys, position_queries) if t is not None]
    for name, table in (("position_keys", position_keys), ("position_queries", position_queries)):
        _check(
            table is None or table.shape[0] == 2 * span,
            name,
            f"{2 * span} rows",
            None if table is None else tuple(table.shape),
        )
    scale = (H * (1 + len(terms))) ** -0.5 if scale is None else scale
    relative = deberta_relative_position(
        T,
        S,
        position_buckets=position_buckets,
        max_relative_positions=max_relative_positions,
        query_positions=options.get("query_positions"),
        key_positions=options.get("key_positions"),
    )
    row = (span - relative).clamp(0, 2 * span - 1)  # [..., T, S]
    key_per_head = key.repeat_interleave(N // K, dim=-2)  # [..., S, N, H]
    zeros = torch.zeros(*row.shape, N, H, dtype=query.dtype)
    c2p = zeros if position_keys is None else _gather(position_keys, row).expand_as(zeros)  # [..., T, S, N, H]
    p2c = zeros if position_queries is None else _gather(position_queries, row) * key_per_head.unsqueeze(-4)
    joint_query = torch.cat([query, torch.ones_like(query)], -1)  # [..., T, N, 2H]
    joint_key = torch.cat([key, torch.zeros_like(key)], -1)  # [..., S, K, 2H]
    joint_rel = torch.cat(torch.broadcast_tensors(c2p, p2c), -1)  # [..., T, S, N, 2H]
    return relative_attention(joint_query, joint_key, value, joint_rel, bias=bias, scale=scale, **options)


# --- ALiBi ----------------------------------------------------------------------------------------------


def alibi_slopes(num_heads: int, *, max_bias: float = 8.0, dtype=torch.float64) -> Tensor:
    """The paper's get_slopes (github.com/ofirpress/attention_with_linear_biases), recursive form."""
    _check(_is_int(num_heads) and num_heads >= 1, "num_heads", "an int >= 1", num_heads)

    def power_of_2(n):
        start = 2.0 ** (-max_bias / n)
        return [start ** (i + 1) for i in range(n)]

    def get_slopes(n):
        if math.log2(n).is_integer():
            return power_of_2(n)
        closest = 2 ** math.floor(math.log2(n))
        return power_of_2(closest) + get_slopes(2 * closest)[0::2][: n - closest]

    return torch.tensor(get_slopes(num_heads), dtype=dtype)


def alibi_bias(
    slopes: Tensor,
    query_length: int,
    key_length: int,
    *,
    bidirectional: bool = False,
    query_positions=None,
    key_positions=None,
) -> Tensor:
    """slope * (j - i) (causal form) or -slope * |j - i| (symmetric), [..., N, T, S]."""
    distance = _relative(query_length, key_length, query_positions, key_positions).to(slopes.dtype)
    if bidirectional:
        distance = -distance.abs()
    return slopes[:, None, None] * distance[..., None, :, :]


def alibi_attention(query, key, value, slopes, *, bidirectional=False, bias=None, **options):
    T, S = _qkv_lengths(query, key)
    position_bias = alibi_bias(
        slopes,
        T,
        S,
        bidirectional=bidirectional,
        query_positions=options.get("query_positions"),
        key_positions=options.get("key_positions"),
    )
    bias = position_bias if bias is None else position_bias + bias
    return dot_product_attention(query, key, value, bias=bias, **options)


# --- RoPE -----------------------------------------------------------------------------------------------


def _rotate_half_layout(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF/GPT-NeoX: pairs (k, k + D/2), written with rotate_half."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * torch.cat([cos, cos], -1) + torch.cat([-x2, x1], -1) * torch.cat([sin, sin], -1)


def _complex_layout(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Meta's Llama / GPT-J: pairs (2k, 2k+1) as one complex number, multiplied by e^{i angle}."""
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * torch.complex(cos, sin)).flatten(-2)


def apply_rope(
    x: Tensor, positions=None, *, offset: int = 0, base: float = 10000.0, rotary_dim=None, layout: str = "half"
) -> Tensor:
    """x [..., T, N, H] rotated on its first rotary_dim features; angles in float64 for float64 input,
    float32 otherwise."""
    T, H = x.shape[-3], x.shape[-1]
    rotary_dim = H if rotary_dim is None else rotary_dim
    _check(
        _is_int(rotary_dim) and 2 <= rotary_dim <= H and rotary_dim % 2 == 0,
        "rotary_dim",
        f"an even int in [2, {H}]",
        rotary_dim,
    )
    _check(layout in ("half", "interleaved"), "layout", "'half' or 'interleaved'", layout)
    positions = torch.arange(T) + offset if positions is None else torch.as_tensor(positions)
    _check(not positions.is_floating_point(), "positions", "an integer tensor", positions.dtype)
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = positions.to(torch.float64)[..., :, None, None] * inv_freq  # [..., T, 1, rotary_dim/2]
    cos, sin = angles.cos().to(work), angles.sin().to(work)
    rot, rest = x[..., :rotary_dim].to(work), x[..., rotary_dim:].to(work)
    rotate = _rotate_half_layout if layout == "half" else _complex_layout
    rotated = rotate(rot, cos, sin)
    rest = rest.expand(*rotated.shape[:-1], rest.shape[-1])
    return torch.cat([rotated, rest], -1).to(x.dtype)


def rope_permutation(head_dim: int, *, rotary_dim=None, source: str = "interleaved", target: str = "half") -> Tensor:
    """int64 [H] p: apply_rope(x[..., p], layout=target) == apply_rope(x, layout=source)[..., p]."""
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    _check(
        _is_int(rotary_dim) and 2 <= rotary_dim <= head_dim and rotary_dim % 2 == 0,
        "rotary_dim",
        f"an even int in [2, {head_dim}]",
        rotary_dim,
    )
    # HF convert_llama_weights_to_hf.permute: view(H/2, 2) -> transpose -> flatten, on the rotary part.
    to_half = torch.arange(rotary_dim).view(rotary_dim // 2, 2).t().reshape(-1)
    perm = {
        ("interleaved", "half"): to_half,
        ("half", "interleaved"): torch.argsort(to_half),
        ("half", "half"): torch.arange(rotary_dim),
        ("interleaved", "interleaved"): torch.arange(rotary_dim),
    }
    return torch.cat([perm[(source, target)], torch.arange(rotary_dim, head_dim)])


def rope_attention(query, key, value, *, base=10000.0, rotary_dim=None, layout="half", **options):
    T, S = _qkv_lengths(query, key)
    query_pos, key_pos = _positions(T, S, options.get("query_positions"), options.get("key_positions"))
    rope = dict(base=base, rotary_dim=rotary_dim, layout=layout)
    return dot_product_attention(
        apply_rope(query, query_pos, **rope), apply_rope(key, key_pos, **rope), value, **options
    )


# --- clipped relative keys and Transformer-XL ----------------------------------------------------------


def clipped_relative_index(
    query_length: int, key_length: int, *, max_left: int, max_right: int, query_positions=None, key_positions=None
) -> Tensor:
    """clip(j - i, -max_left, max_right) + max_left, int64 [..., T, S]."""
    _check(_is_int(max_left) and max_left >= 0, "max_left", "an int >= 0", max_left)
    _check(_is_int(max_right) and max_right >= 0, "max_right", "an int >= 0", max_right)
    relative = _relative(query_length, key_length, query_positions, key_positions)
    return relative.clamp(-max_left, max_right) + max_left


def _gather(table: Tensor | None, index: Tensor) -> Tensor | None:
    """[R, D] / [R, N, D] -> [..., T, S, 1 or N, D]."""
    if table is None:
        return None
    gathered = table[index]
    return gathered.unsqueeze(-2) if table.ndim == 2 else gathered


def clipped_relative_attention(query, key, value, key_table=None, value_table=None, *, max_left, max_right, **options):
    """relative_attention with A = table[clipped_relative_index(...)] (the [T, S, N, H] tensor, built)."""
    T, S = _qkv_lengths(query, key)
    index = clipped_relative_index(
        T,
        S,
        max_left=max_left,
        max_right=max_right,
        query_positions=options.get("query_positions"),
        key_positions=options.get("key_positions"),
    )
    R = max_left + max_right + 1
    for name, table in (("key_table", key_table), ("value_table", value_table)):
        _check(table is None or table.shape[0] == R, name, f"{R} rows", None if table is None else tuple(table.shape))
    return relative_attention(query, key, value, _gather(key_table, index), _gather(value_table, index), **options)


def relative_sinusoids(
    dim: int, *, max_left: int, max_right: int, base: float = 10000.0, layout: str = "concat", dtype=torch.float64
) -> Tensor:
    """[R, dim], row r = sinusoid of i - j = max_left - r; "concat" [sin, cos] or "interleaved" sin/cos."""
    _check(_is_int(dim) and dim >= 2 and dim % 2 == 0, "dim", "an even int >= 2", dim)
    distance = max_left - torch.arange(max_left + max_right + 1, dtype=torch.float64)
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.outer(distance, inv_freq)
    if layout == "concat":
        table = torch.cat([angles.sin(), angles.cos()], -1)
    else:
        table = torch.zeros(len(distance), dim, dtype=torch.float64)
        table[:, 0::2], table[:, 1::2] = angles.sin(), angles.cos()
    return table.to(dtype)


def transformer_xl_attention(
    query, key, value, position_keys, *, max_left, pos_bias_u=None, pos_bias_v=None, scale=None, bias=None, **options
):
    """scale * ((q + u) . k + (q + v) . P[index]), P[index] gathered as the full [..., T, S, N or 1, H] table.

    Both terms are query-key logits (``logit_softcap`` caps their sum), so they are written as ONE dot product
    of concatenations: ``[q + u, q + v] . ([k, 0] + [0, P[index]])``, i.e. relative_attention with doubled H.
    """
    T, S, H = query.shape[-3], key.shape[-3], query.shape[-1]
    R = position_keys.shape[0]
    scale = H**-0.5 if scale is None else scale
    index = clipped_relative_index(
        T,
        S,
        max_left=max_left,
        max_right=R - 1 - max_left,
        query_positions=options.get("query_positions"),
        key_positions=options.get("key_positions"),
    )
    q_u = query if pos_bias_u is None else query + pos_bias_u
    q_v = query if pos_bias_v is None else query + pos_bias_v
    P = _gather(position_keys, index)  # [..., T, S, 1 or N, H]
    joint_query = torch.cat([q_u, q_v.expand_as(q_u)], -1)  # [..., T, N, 2H]
    joint_key = torch.cat([key, torch.zeros_like(key)], -1)  # [..., S, K, 2H]
    joint_rel = torch.cat([torch.zeros_like(P), P], -1)  # [..., T, S, 1 or N, 2H]
    return relative_attention(joint_query, joint_key, value, joint_rel, bias=bias, scale=scale, **options)
