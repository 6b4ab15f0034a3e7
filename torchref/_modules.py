"""Batch-first multi-head attention modules: ``nn.Linear`` projections around the functions."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torchref._functional import check, dot_product_attention, is_count, shaw_relative_attention


class MultiHeadAttention(nn.Module):
    """Multi-head (grouped-query when ``num_kv_heads < num_heads``) attention, batch first.

    ``q_proj: [Eq] -> [N * H]``, ``k_proj: [Ek] -> [K * H]``, ``v_proj: [Ev] -> [K * Hv]``,
    ``out_proj: [N * Hv] -> [Eo]``; projected features are head-major (feature ``n * H + h``).
    ``forward(query [..., T, Eq], key [..., S, Ek] = query, value [..., S, Ev] = key) -> [..., T, Eo]``.
    """

    def __init__(
        self,
        query_features: int,
        num_heads: int,
        head_dim: int | None = None,
        *,
        key_features: int | None = None,
        value_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        value_head_dim: int | None = None,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__()
        check(isinstance(num_heads, int) and num_heads > 0, "num_heads", "a positive int", num_heads)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check(
            isinstance(num_kv_heads, int) and num_kv_heads > 0 and num_heads % num_kv_heads == 0,
            "num_kv_heads",
            f"a positive int dividing num_heads={num_heads}",
            num_kv_heads,
        )
        head_dim = query_features // num_heads if head_dim is None else head_dim
        check(head_dim > 0, "head_dim", f"a positive int (query_features={query_features} // num_heads)", head_dim)
        value_head_dim = head_dim if value_head_dim is None else value_head_dim
        check(value_head_dim > 0, "value_head_dim", "a positive int", value_head_dim)
        key_features = query_features if key_features is None else key_features
        value_features = key_features if value_features is None else value_features
        out_features = query_features if out_features is None else out_features

        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.value_head_dim = value_head_dim
        N, K, H, Hv = num_heads, num_kv_heads, head_dim, value_head_dim
        factory = {"bias": bias, "device": device, "dtype": dtype}
        self.q_proj = nn.Linear(query_features, N * H, **factory)
        self.k_proj = nn.Linear(key_features, K * H, **factory)
        self.v_proj = nn.Linear(value_features, K * Hv, **factory)
        self.out_proj = nn.Linear(N * Hv, out_features, **factory)

    def _project(self, query: Tensor, key: Tensor | None, value: Tensor | None):
        key = query if key is None else key
        value = key if value is None else value
        q = self.q_proj(query).unflatten(-1, (self.num_heads, self.head_dim))  # [..., T, N, H]
        k = self.k_proj(key).unflatten(-1, (self.num_kv_heads, self.head_dim))  # [..., S, K, H]
        v = self.v_proj(value).unflatten(-1, (self.num_kv_heads, self.value_head_dim))  # [..., S, K, Hv]
        return q, k, v

    def _output(self, result, return_weights: bool):
        out, weights = result if return_weights else (result, None)
        out = self.out_proj(out.flatten(-2))  # [..., T, N * Hv] -> [..., T, Eo]
        return (out, weights) if return_weights else out

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        is_causal: bool = False,
        key_value_seq_lengths=None,
        query_positions=None,
        key_positions=None,
        scale: float | None = None,
        return_weights: bool = False,
        query_segment_ids: Tensor | None = None,
        key_segment_ids: Tensor | None = None,
        window: tuple[int | None, int | None] | None = None,
        chunk_size: int | None = None,
        logit_softcap: float | None = None,
        sinks: Tensor | None = None,
    ):
        """Every keyword is the function's (see :func:`torchref.dot_product_attention`), passed on unchanged."""
        q, k, v = self._project(query, key, value)
        result = self._attend(
            q,
            k,
            v,
            mask=mask,
            bias=bias,
            is_causal=is_causal,
            key_value_seq_lengths=key_value_seq_lengths,
            query_positions=query_positions,
            key_positions=key_positions,
            scale=scale,
            return_weights=return_weights,
            query_segment_ids=query_segment_ids,
            key_segment_ids=key_segment_ids,
            window=window,
            chunk_size=chunk_size,
            logit_softcap=logit_softcap,
            sinks=sinks,
        )
        return self._output(result, return_weights)

    def _attend(self, q, k, v, **options):
        """The attention between the projections; subclasses add their position terms here."""
        return dot_product_attention(q, k, v, **options)


class RelativeMultiHeadAttention(MultiHeadAttention):
    """:class:`MultiHeadAttention` with Shaw et al. (2018) clipped relative-position tables.

    ``rel_key`` is ``[R, N, H]`` (``[R, H]`` with ``share_heads``), ``rel_value`` ``[R, N, Hv]`` (``[R, Hv]``),
    ``R = 2 * max_distance + 1``; either is absent when its ``use_*_table`` is False.
    """

    def __init__(
        self,
        query_features: int,
        num_heads: int,
        head_dim: int | None = None,
        *,
        max_distance: int,
        share_heads: bool = False,
        use_key_table: bool = True,
        use_value_table: bool = True,
        key_features: int | None = None,
        value_features: int | None = None,
        out_features: int | None = None,
        num_kv_heads: int | None = None,
        value_head_dim: int | None = None,
        bias: bool = True,
        device=None,
        dtype=None,
    ):
        super().__init__(
            query_features,
            num_heads,
            head_dim,
            key_features=key_features,
            value_features=value_features,
            out_features=out_features,
            num_kv_heads=num_kv_heads,
            value_head_dim=value_head_dim,
            bias=bias,
            device=device,
            dtype=dtype,
        )
        check(is_count(max_distance), "max_distance", "a non-negative int", max_distance)
        self.max_distance = int(max_distance)
        self.share_heads = share_heads
        R = 2 * max_distance + 1
        heads = () if share_heads else (num_heads,)
        factory = {"device": device, "dtype": dtype}
        self.rel_key = nn.Parameter(torch.empty(R, *heads, self.head_dim, **factory)) if use_key_table else None
        self.rel_value = (
            nn.Parameter(torch.empty(R, *heads, self.value_head_dim, **factory)) if use_value_table else None
        )
        self.reset_relative_parameters()

    def reset_relative_parameters(self) -> None:
        for table in (self.rel_key, self.rel_value):
            if table is not None:
                nn.init.normal_(table, std=0.02)

    def _attend(self, q, k, v, **options):
        return shaw_relative_attention(q, k, v, self.rel_key, self.rel_value, max_distance=self.max_distance, **options)
