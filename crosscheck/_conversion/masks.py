"""torch attention masks -> jaxattn's ``(mask, bias)``.

jaxattn: ``mask`` is bool, True = may attend; ``bias`` is float, added to the scaled logits (``-inf`` counts as
masked); both broadcast to ``[..., N, T, S]``. torch has three other conventions, all converted here:

====================================  ==========================  ===========================================
torch argument                        torch meaning               jaxattn
====================================  ==========================  ===========================================
MHA ``attn_mask`` bool [T,S]/[B*N,T,S]  True = NOT allowed         ``mask = ~attn_mask`` ([B*N,...] -> [B,N,T,S])
MHA ``attn_mask`` float                additive                    ``bias = attn_mask``
MHA ``key_padding_mask`` bool [B,S]    True = ignore this key      ``mask = ~kpm[:, None, None, :]``
MHA ``key_padding_mask`` float [B,S]   additive                    ``bias = kpm[:, None, None, :]``
SDPA ``attn_mask`` bool                True = TAKES PART           ``mask = attn_mask``  (the opposite of MHA!)
SDPA ``attn_mask`` float               additive                    ``bias = attn_mask``
SDPA ``is_causal=True``                top-left: ``tril(ones(T,S))``  explicit ``mask`` (see below)
====================================  ==========================  ===========================================

Causal alignment pitfall: torch's ``is_causal`` is TOP-LEFT aligned (query ``t`` sees keys ``s <= t``) while
jaxattn's is BOTTOM-RIGHT (query ``t`` sees ``s <= t + S - T``). They agree only when ``T == S``. So torch's
``is_causal`` is always converted to an explicit top-left mask, never to jaxattn's ``is_causal``.

A query row that the masks block entirely is NaN in torch and zeros in jaxattn (docs/design.md, "Rows with no allowed
key"); compare such rows knowingly. With torch's ``add_bias_kv`` / ``add_zero_attn`` the converted masks still cover
only the S real keys: jaxattn appends the always-attendable extra columns itself, as torch does.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from crosscheck._conversion.weights import to_jax, to_numpy


def _kind(name: str, x: np.ndarray) -> str:
    if x.dtype == np.bool_:
        return "bool"
    if jnp.issubdtype(x.dtype, jnp.floating):  # numpy's own issubdtype misses ml_dtypes.bfloat16
        return "float"
    raise ValueError(f"{name}: expected a bool or floating tensor (as torch requires), got dtype {x.dtype}")


def _check_length(name: str, actual: int, expected: int | None, what: str) -> None:
    if expected is not None and actual != expected:
        raise ValueError(f"{name}: expected {what} = {expected}, got {actual}")


def _top_left_causal(query_length, key_length) -> np.ndarray:
    """torch's is_causal mask, True = may attend: tril(ones(T, S))."""
    return np.tril(np.ones((query_length, key_length), dtype=bool))


def _split(parts: list[tuple[str, np.ndarray]], bool_means_allowed: bool):
    """Bool parts combine into one mask (AND), float parts into one bias (sum); either may be None."""
    mask = bias = None
    for name, x in parts:
        if _kind(name, x) == "bool":
            allowed = x if bool_means_allowed else ~x
            mask = allowed if mask is None else mask & allowed
        else:
            bias = x if bias is None else bias + x
    return (None if mask is None else to_jax(mask, "mask"), None if bias is None else to_jax(bias, "bias"))


def masks_from_torch(
    attn_mask=None,
    key_padding_mask=None,
    *,
    num_heads: int | None = None,
    is_causal: bool = False,
    query_length: int | None = None,
    key_length: int | None = None,
):
    """``(mask, bias)`` for jaxattn from ``torch.nn.MultiheadAttention``'s mask arguments (either may be None).

    ``attn_mask``: ``[T, S]`` or ``[B*N, T, S]`` (row ``b*N + n``; needs ``num_heads``, result ``[B, N, T, S]``);
    bool True = NOT allowed (-> ``mask = ~attn_mask``), float = additive (-> ``bias``, ``-inf`` allowed).
    ``key_padding_mask``: ``[B, S]`` (or ``[S]`` for unbatched inputs); bool True = ignore the key, float =
    additive; becomes ``[B, 1, 1, S]``. Masks of the same kind are merged (bool: AND, float: sum), so the
    result has at most one mask and one bias. Both layouts are the same whether or not the module is
    ``batch_first``. ``query_length`` / ``key_length``, when given, are checked against the masks.

    ``is_causal`` is MHA's *hint* that ``attn_mask`` is the causal mask: torch then may skip ``attn_mask`` and
    use SDPA's top-left causal mask instead, so the two must agree. The conversion uses ``attn_mask`` and
    raises ValueError if it is not top-left causal (torch's result would depend on the kernel it picks) or
    absent (torch refuses that too). Top-left is not jaxattn's bottom-right ``is_causal`` when ``T != S``:
    see the module docstring.

    Float masks keep their dtype (a float64 mask needs ``jax_enable_x64``). Returns jnp arrays.
    """
    a = None if attn_mask is None else _mha_attn_mask(to_numpy(attn_mask), num_heads)
    kpm = None if key_padding_mask is None else to_numpy(key_padding_mask)
    if a is not None:
        _check_length("attn_mask", a.shape[-2], query_length, "query length T")
        _check_length("attn_mask", a.shape[-1], key_length, "key length S")
        key_length = a.shape[-1]
        if is_causal:
            _check_causal_hint(a)
    elif is_causal:
        raise ValueError(
            "is_causal: torch.nn.MultiheadAttention takes is_causal only as a hint that attn_mask is "
            "the causal mask, and refuses it without attn_mask; pass the attn_mask (or use "
            "sdpa_masks_from_torch for F.scaled_dot_product_attention's is_causal)"
        )
    if kpm is not None:
        if kpm.ndim not in (1, 2):
            raise ValueError(f"key_padding_mask: expected shape [B, S] (or [S]), got {kpm.shape}")
        _check_length("key_padding_mask", kpm.shape[-1], key_length, "key length S")
        if a is not None and a.ndim == 4 and kpm.ndim == 2 and kpm.shape[0] != a.shape[0]:
            raise ValueError(
                f"key_padding_mask: expected batch B = {a.shape[0]} (from attn_mask "
                f"[B*N, T, S] with N={num_heads}), got shape {kpm.shape}"
            )
        kpm = kpm.reshape(*kpm.shape[:-1], 1, 1, kpm.shape[-1])  # [B, 1, 1, S]
    parts = [(name, x) for name, x in (("attn_mask", a), ("key_padding_mask", kpm)) if x is not None]
    return _split(parts, bool_means_allowed=False)


def _mha_attn_mask(a: np.ndarray, num_heads: int | None) -> np.ndarray:
    """[T, S] as is; torch's [B*N, T, S] (row b*N + n) as [B, N, T, S]."""
    if a.ndim == 2:
        return a
    if a.ndim != 3:
        raise ValueError(f"attn_mask: expected shape [T, S] or [B*N, T, S], got {a.shape}")
    if num_heads is None:
        raise ValueError(f"attn_mask: a 3-D mask {a.shape} is [B*N, T, S]; pass num_heads= to split it")
    if a.shape[0] % num_heads:
        raise ValueError(f"attn_mask: expected a first dim B*N divisible by num_heads={num_heads}, got shape {a.shape}")
    return a.reshape(a.shape[0] // num_heads, num_heads, *a.shape[1:])


def _check_causal_hint(a: np.ndarray) -> None:
    T, S = a.shape[-2:]
    blocked = ~_top_left_causal(T, S)
    is_causal = (a == blocked) if a.dtype == np.bool_ else ((a == -np.inf) == blocked) & ((a == 0) | blocked)
    if not np.all(is_causal):
        raise ValueError(
            "is_causal: torch.nn.MultiheadAttention treats is_causal as a promise that attn_mask is the top-left "
            "causal mask (blocked above the diagonal: torch.triu(ones(T, S), 1) as bool, -inf as float), and "
            "may then replace attn_mask by SDPA's causal mask; this attn_mask is not that mask, so torch's "
            "result is ill-defined. Drop is_causal=True."
        )


def sdpa_masks_from_torch(
    attn_mask=None, *, is_causal: bool = False, query_length: int | None = None, key_length: int | None = None
):
    """``(mask, bias)`` for jaxattn from ``torch.nn.functional.scaled_dot_product_attention``'s arguments.

    SDPA's bool ``attn_mask`` means True = TAKES PART in attention, the opposite of MultiheadAttention's; it is
    passed through as ``mask``. A float ``attn_mask`` becomes ``bias``. Its shape is already jaxattn's (any
    shape broadcastable to ``[..., N, T, S]``), so it is not reshaped.

    ``is_causal=True`` (SDPA refuses it together with ``attn_mask``) becomes the explicit TOP-LEFT mask
    ``tril(ones(T, S))`` and needs ``query_length`` and ``key_length``. Do not translate it into jaxattn's
    ``is_causal=True``: that one is bottom-right aligned and differs whenever ``T != S`` (e.g. T=2, S=4:
    torch lets query 0 see key 0 only, jaxattn lets it see keys 0..2).
    """
    if is_causal:
        if attn_mask is not None:
            raise ValueError(
                "is_causal: scaled_dot_product_attention refuses is_causal=True with an attn_mask; "
                "pass one or the other"
            )
        if query_length is None or key_length is None:
            raise ValueError("is_causal: pass query_length= and key_length= to build torch's top-left causal mask")
        return _split([("is_causal", _top_left_causal(query_length, key_length))], bool_means_allowed=True)
    if attn_mask is None:
        return None, None
    a = to_numpy(attn_mask)
    if a.ndim < 2:
        raise ValueError(f"attn_mask: expected a shape broadcastable to [..., N, T, S] (rank >= 2), got {a.shape}")
    _check_length("attn_mask", a.shape[-2], query_length if a.shape[-2] != 1 else None, "query length T")
    _check_length("attn_mask", a.shape[-1], key_length if a.shape[-1] != 1 else None, "key length S")
    return _split([("attn_mask", a)], bool_means_allowed=True)
