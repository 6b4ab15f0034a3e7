"""torch's FlexAttention as a reference in jaxattn's conventions, and a table of flex cases.

Conventions differ in two ways, converted here explicitly and nowhere else:

* Positions. torch's ``score_mod(score, b, h, q_idx, kv_idx)`` / ``mask_mod(b, h, q_idx, kv_idx)`` receive ROW
  indices (``q_idx`` in ``[0, T)``, ``kv_idx`` in ``[0, S)``, top-left). jaxattn and torchref pass ABSOLUTE
  positions: query row ``i`` sits at ``t = i + (S - T)`` (bottom-right, a cache precedes the queries) or at
  ``query_positions[i]``, key row ``j`` at ``s = j`` or ``key_positions[j]``. So a causal ``mask_mod`` is
  ``t >= s`` in ours, ``q_idx + (S - T) >= kv_idx`` in torch's.
* Layout. torch's flex wants ``[B, N, T, H]`` with exactly one batch dim; ours is ``[..., T, N, H]``. ``b`` is
  the index into the flattened leading dims in both.

``flex_reference`` runs torch's eager ``flex_attention`` (forward only: torch has no CPU backward for it) on
our layout with our absolute mods. torch's flex has no sinks; they are applied from its log-sum-exp:
``out_with_sink = out * exp(lse) / (exp(lse) + exp(sink))`` (a row with no key has lse = -inf: zeros).

``FLEX_CASES``: named cases, each as absolute-position mods written against an array namespace ``xp``
(``torch`` or ``jax.numpy``: only operators, ``xp.where`` and ``xp.tanh``), plus the equivalent first-class
keywords for ``dot_product_attention`` (built by ``case.keywords(xp, batch)``), so that the JAX side of a
crosscheck case needs only its own ``xp``.
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np


def _row_to_absolute(rows, b, positions, offset):
    """Row index -> absolute position: ``rows + offset`` or ``positions[row]`` (``[T]`` or ``[B, T]``)."""
    if positions is None:
        return rows + offset
    return positions[rows] if positions.ndim == 1 else positions[b, rows]


def _is_score_mod(mod: Callable) -> bool:
    """score_mod(score, b, n, t, s) has five parameters, mask_mod(b, n, t, s) four (torch tells them apart the
    same way, so the wrappers below must have exact signatures, not ``*args``)."""
    count = len(inspect.signature(mod).parameters)
    if count not in (4, 5):
        raise ValueError(f"mod: expected score_mod(score, b, n, t, s) or mask_mod(b, n, t, s), got {count} parameters")
    return count == 5


def torch_mod_from_absolute(
    mod: Callable, *, query_length: int, key_length: int, query_positions=None, key_positions=None
) -> Callable:
    """A score_mod or mask_mod on ABSOLUTE positions -> one in torch's convention (row indices, top-left).

    ``query_positions [T] / [B, T]``, ``key_positions [S] / [B, S]``: int torch tensors (B = flattened batch).
    """
    offset = key_length - query_length

    def positions(b, q_idx, kv_idx):
        return (_row_to_absolute(q_idx, b, query_positions, offset), _row_to_absolute(kv_idx, b, key_positions, 0))

    if _is_score_mod(mod):

        def score_mod(score, b, h, q_idx, kv_idx):
            return mod(score, b, h, *positions(b, q_idx, kv_idx))

        return score_mod

    def mask_mod(b, h, q_idx, kv_idx):
        return mod(b, h, *positions(b, q_idx, kv_idx))

    return mask_mod


def absolute_mod_from_torch(mod: Callable, *, query_length: int, key_length: int) -> Callable:
    """A mod written for torch (row indices, top-left) -> one on ABSOLUTE positions (default positions only:
    query row ``i`` at ``i + (S - T)``, key row ``j`` at ``j``; custom positions have no inverse)."""
    offset = key_length - query_length
    if _is_score_mod(mod):

        def score_mod(score, b, n, t, s):
            return mod(score, b, n, t - offset, s)

        return score_mod

    def mask_mod(b, n, t, s):
        return mod(b, n, t - offset, s)

    return mask_mod


def _to_torch_layout(x, batch):
    """``[..., L, N, D] -> [B, N, L, D]`` with the leading dims flattened (broadcast to ``batch`` first)."""
    x = x.expand(*batch, *x.shape[-3:])
    return x.reshape(-1, *x.shape[-3:]).transpose(1, 2)


def flex_reference(
    query,
    key,
    value,
    *,
    score_mod=None,
    mask_mod=None,
    scale=None,
    sinks=None,
    query_positions=None,
    key_positions=None,
):
    """torch's eager ``flex_attention`` on ``[..., T, N, H], [..., S, K, H], [..., S, K, Hv]`` -> ``[..., T, N, Hv]``.

    ``score_mod(score, b, n, t, s)`` / ``mask_mod(b, n, t, s)`` on ABSOLUTE positions (jaxattn's convention),
    converted with :func:`torch_mod_from_absolute`; ``mask_mod`` goes through torch's ``create_block_mask``.
    ``sinks [N]``: see the module docstring. Grouped-query heads use torch's ``enable_gqa``.
    """
    import torch
    from torch.nn.attention.flex_attention import (
        AuxRequest,
        create_block_mask,
        flex_attention,
    )

    batch = tuple(torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3]))
    T, N = query.shape[-3], query.shape[-2]
    S, K = key.shape[-3], key.shape[-2]
    q, k, v = (_to_torch_layout(x, batch) for x in (query, key, value))
    B = q.shape[0]
    positions = {
        "query_length": T,
        "key_length": S,
        "query_positions": _flat(query_positions, batch),
        "key_positions": _flat(key_positions, batch),
    }
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(torch_mod_from_absolute(mask_mod, **positions), B, N, T, S, device="cpu")
    torch_score_mod = None if score_mod is None else torch_mod_from_absolute(score_mod, **positions)
    with warnings.catch_warnings():
        # torch advises its users to compile flex_attention; here the eager function is the reference on
        # purpose (exact, unfused), so that advice is not ours to pass on (the CLI says once what it is)
        warnings.filterwarnings(
            "ignore",
            message=r"flex_attention called without torch\.compile\(\)",
            category=UserWarning,
            module=r"torch\.nn\.attention\.flex_attention",
        )
        out, aux = flex_attention(
            q,
            k,
            v,
            score_mod=torch_score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=K != N,
            return_aux=AuxRequest(lse=True),
        )
    if sinks is not None:  # out * p(keys) with p(keys) = e^lse / (e^lse + e^sink) = sigmoid(lse - sink)
        out = out * torch.sigmoid(aux.lse - sinks.to(out.dtype)[:, None])[..., None]
    return out.transpose(1, 2).reshape(*batch, T, N, value.shape[-1])


def _flat(positions, batch):
    """``[T]`` stays; ``[..., T]`` -> ``[B, T]`` over the flattened batch (torch's ``b``)."""
    if positions is None or positions.ndim == 1:
        return positions
    return positions.expand(*batch, positions.shape[-1]).reshape(-1, positions.shape[-1])


# ---------------------------------------------------------------------------------------------------------
# the case table: absolute-position mods and the equivalent keywords


@dataclasses.dataclass(frozen=True)
class FlexCase:
    """One pattern, two spellings. ``mods(xp, arrays)`` -> ``(score_mod, mask_mod)`` on absolute positions;
    ``keywords(xp, arrays)`` -> keywords of ``dot_product_attention`` that mean the same. ``arrays`` come from
    ``case.arrays(rng, batch, N)`` (numpy, floats in float64: cast them for a float32 run, since a score_mod must
    keep the score's dtype; ``docs`` is ``[B, S]``, one batch dim); query/key lengths are ``T``, ``S``."""

    name: str
    T: int
    S: int
    mods: Callable[[Any, dict], tuple[Callable | None, Callable | None]]
    keywords: Callable[[Any, dict], dict]
    arrays: Callable[[np.random.Generator, tuple[int, ...], int], dict] = lambda rng, batch, N: {}


def _and(*masks):
    out = masks[0]
    for m in masks[1:]:
        out = out & m
    return out


def _documents(rng, batch, S, count=3):
    """int32 ``[..., S]``: sorted document ids (packed, every document non-empty)."""
    cuts = np.sort(rng.choice(np.arange(1, S), size=(*batch, count - 1)), axis=-1)
    return (np.arange(S) >= cuts[..., :, None]).sum(-2).astype(np.int32)


def _case_arrays(rng, batch, N, S=0, R=0):
    return {
        "docs": _documents(rng, batch, S),
        "slopes": 2.0 ** -rng.uniform(0.5, 4.0, N),
        "table": rng.standard_normal((R, N)),
        "sinks": rng.standard_normal(N),
    }


def _rel_bucket(xp, t, s, D):
    """Clipped relative distance ``clip(s - t, -D, D) + D`` (the T5-style table index, without log buckets)."""
    return xp.where(s - t > D, D, xp.where(s - t < -D, -D, s - t)) + D


_C, _W, _P, _D, _CAP = 4, 3, 5, 4, 2.5  # chunk, window left, prefix, table reach, softcap


def _flex_cases() -> dict[str, FlexCase]:
    def causal(xp, a):
        return None, lambda b, n, t, s: t >= s

    def sliding(xp, a):
        return None, lambda b, n, t, s: (t >= s) & (t - s <= _W)

    def window_both(xp, a):
        return None, lambda b, n, t, s: (s >= t - _W) & (s <= t + 2)

    def documents(xp, a):
        docs = xp.asarray(a["docs"])  # [B, S]: a query's document is the key's at the same absolute position
        return None, lambda b, n, t, s: docs[b, t] == docs[b, s]

    def prefix_lm(xp, a):
        return None, lambda b, n, t, s: (s <= t) | (s < _P)

    def chunked(xp, a):
        return None, lambda b, n, t, s: (t >= s) & (t // _C == s // _C)

    def softcap(xp, a):
        return (lambda score, b, n, t, s: _CAP * xp.tanh(score / _CAP)), None

    def alibi(xp, a):
        slopes = xp.asarray(a["slopes"])
        return (lambda score, b, n, t, s: score + slopes[n] * (s - t)), (lambda b, n, t, s: t >= s)

    def t5_table(xp, a):
        table = xp.asarray(a["table"])  # [R, N]
        return (lambda score, b, n, t, s: score + table[_rel_bucket(xp, t, s, _D), n]), None

    def docs_sliding_softcap(xp, a):
        docs = xp.asarray(a["docs"])
        return (softcap(xp, a)[0], lambda b, n, t, s: (docs[b, t] == docs[b, s]) & (t >= s) & (t - s <= _W))

    def chunked_alibi(xp, a):
        return alibi(xp, a)[0], chunked(xp, a)[1]

    def softcap_t5_sliding(xp, a):
        table = xp.asarray(a["table"])
        return (
            (lambda score, b, n, t, s: _CAP * xp.tanh(score / _CAP) + table[_rel_bucket(xp, t, s, _D), n]),
            lambda b, n, t, s: (s >= t - _W) & (s <= t + 1),
        )

    def kw_causal(xp, a):
        return {"is_causal": True}

    def kw_docs(xp, a, T, S):
        docs = xp.asarray(a["docs"])
        return {"query_segment_ids": docs[..., S - T :], "key_segment_ids": docs}

    def kw_prefix(xp, a, T, S):
        t = xp.asarray(np.arange(T) + S - T)[:, None]
        s = xp.asarray(np.arange(S))[None, :]
        return {"mask": (s <= t) | (s < _P)}

    def kw_alibi_bias(xp, a, T, S):
        rel = xp.asarray((np.arange(S)[None, :] - (np.arange(T) + S - T)[:, None]).astype(a["slopes"].dtype))
        return {"bias": xp.asarray(a["slopes"])[:, None, None] * rel}

    def kw_t5_bias(xp, a, T, S):
        index = np.clip(np.arange(S)[None, :] - (np.arange(T) + S - T)[:, None], -_D, _D) + _D
        return {"bias": xp.asarray(np.moveaxis(a["table"][index], -1, 0))}  # [N, T, S]

    def case(name, T, S, mods, keywords, R=0):
        return FlexCase(
            name,
            T,
            S,
            mods,
            lambda xp, a: keywords(xp, a, T, S),
            lambda rng, batch, N: _case_arrays(rng, batch, N, S, R),
        )

    plain = {
        "causal": (causal, lambda xp, a, T, S: kw_causal(xp, a)),
        "sliding": (sliding, lambda xp, a, T, S: {"is_causal": True, "window": (_W, 0)}),
        "window_both_sides": (window_both, lambda xp, a, T, S: {"window": (_W, 2)}),
        "documents": (documents, kw_docs),
        "prefix_lm": (prefix_lm, kw_prefix),
        "chunked": (chunked, lambda xp, a, T, S: {"is_causal": True, "chunk_size": _C}),
        "softcap": (softcap, lambda xp, a, T, S: {"logit_softcap": _CAP}),
        "alibi": (alibi, lambda xp, a, T, S: {"is_causal": True, **kw_alibi_bias(xp, a, T, S)}),
        "t5_table": (t5_table, kw_t5_bias),
        "documents_sliding_softcap": (
            docs_sliding_softcap,
            lambda xp, a, T, S: {**kw_docs(xp, a, T, S), "is_causal": True, "window": (_W, 0), "logit_softcap": _CAP},
        ),
        "chunked_alibi": (
            chunked_alibi,
            lambda xp, a, T, S: {"is_causal": True, "chunk_size": _C, **kw_alibi_bias(xp, a, T, S)},
        ),
        "softcap_t5_window": (
            softcap_t5_sliding,
            lambda xp, a, T, S: {"logit_softcap": _CAP, "window": (_W, 1), **kw_t5_bias(xp, a, T, S)},
        ),
    }
    cases = {}
    for name, (mods, keywords) in plain.items():
        R = 2 * _D + 1 if "t5" in name else 0
        cases[name] = case(name, 13, 13, mods, keywords, R)
        cases[name + "_cache"] = case(name + "_cache", 5, 13, mods, keywords, R)  # T < S: bottom-right
    return cases


FLEX_CASES: dict[str, FlexCase] = _flex_cases()
