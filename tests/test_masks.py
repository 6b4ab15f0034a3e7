"""crosscheck mask conversion: each torch mask convention against torch's own attention on the same inputs.

torch.nn.MultiheadAttention: bool True = NOT allowed, float additive, key_padding_mask True = ignore.
F.scaled_dot_product_attention: bool True = takes part, is_causal top-left aligned. jaxattn: True = may attend,
is_causal bottom-right. Grids are literal and small (T=3, S=4, N=3, B=2) so a flipped axis is visible.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _einsum_mha import einsum_mha

import crosscheck as cc
import jaxattn
from helpers import assert_float64, normwise, randomize

E, N, T, S, B = 15, 3, 3, 4, 2
TOL = 1e-12
X, O = True, False  # torch MHA bool masks: X = blocked

BOOL_GRID = np.array([[X, O, O, X], [O, X, O, O], [O, O, X, O]])
FLOAT_GRID = np.array([[0.0, -np.inf, 1.5, -0.5], [-2.0, 0.0, -np.inf, 0.25], [0.5, -np.inf, -np.inf, 0.0]])
PADDING = np.array([[O, O, O, X], [X, O, O, O]])  # batch 0 ignores key 3, batch 1 ignores key 0
PADDING_FLOAT = np.array([[0.0, 0.5, 0.0, -np.inf], [-np.inf, 0.0, -1.0, 0.0]])


def mha(add_bias_kv=False, add_zero_attn=False):
    return randomize(
        torch.nn.MultiheadAttention(
            E, N, batch_first=True, add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, dtype=torch.float64
        ),
        seed=0,
    )


def qkv(seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, T, E)), rng.normal(size=(B, S, E)), rng.normal(size=(B, S, E))


def check_against_torch_mha(m, attn_mask=None, key_padding_mask=None, **convert):
    """torch's MHA with its masks == jaxattn and the einsum form with the converted (mask, bias)."""
    q, k, v = qkv()
    torch_args = {
        name: None if x is None else torch.tensor(x)
        for name, x in (("attn_mask", attn_mask), ("key_padding_mask", key_padding_mask))
    }
    out, weights = m(*map(torch.tensor, (q, k, v)), need_weights=True, average_attn_weights=False, **torch_args)
    mask, bias = cc.masks_from_torch(**torch_args, **convert)
    if bias is not None:
        assert bias.dtype == jnp.float64
    params, options = cc.params_from_torch(m), cc.call_options_from_torch(m)
    results = [
        jaxattn.multi_head_attention(params, q, k, v, mask=mask, bias=bias, return_weights=True, **options),
        einsum_mha(
            jax.tree.map(np.asarray, params),
            q,
            k,
            v,
            mask=None if mask is None else np.asarray(mask),
            bias=None if bias is None else np.asarray(bias),
            xp=np,
            **options,
        ),
    ]
    for jax_out, jax_weights in results:
        assert_float64(jax_out, jax_weights, out, weights)
        assert normwise(jax_out, out.detach().numpy()) <= TOL
        assert normwise(jax_weights, weights.detach().numpy()) <= TOL
    return mask, bias


# ------------------------------------------------------------------------------- torch.nn.MultiheadAttention


def test_bool_attn_mask_2d():
    mask, bias = check_against_torch_mha(mha(), attn_mask=BOOL_GRID)
    assert bias is None
    np.testing.assert_array_equal(mask, [[0, 1, 1, 0], [1, 0, 1, 1], [1, 1, 0, 1]])


def test_bool_attn_mask_3d_is_batch_major():
    """torch's [B*N, T, S] rows are b*N + n: each (batch, head) gets its own literal grid here."""
    grids = np.stack([np.roll(BOOL_GRID, i, axis=1) for i in range(B * N)])  # row i blocks shifted columns
    mask, _ = check_against_torch_mha(mha(), attn_mask=grids, num_heads=N)
    assert mask.shape == (B, N, T, S)
    for b in range(B):
        for n in range(N):
            np.testing.assert_array_equal(mask[b, n], ~np.roll(BOOL_GRID, b * N + n, axis=1))


def test_float_attn_mask_is_bias():
    mask, bias = check_against_torch_mha(mha(), attn_mask=FLOAT_GRID)
    assert mask is None
    np.testing.assert_array_equal(bias, FLOAT_GRID)


@pytest.mark.parametrize("padding", [PADDING, PADDING_FLOAT], ids=["bool", "float"])
def test_key_padding_mask(padding):
    mask, bias = check_against_torch_mha(mha(), key_padding_mask=padding)
    converted = mask if padding.dtype == bool else bias
    assert converted.shape == (B, 1, 1, S)
    expected = ~padding if padding.dtype == bool else padding
    np.testing.assert_array_equal(converted[:, 0, 0], expected)


MIXED_TYPES = "ignore:Support for mismatched key_padding_mask and attn_mask is deprecated"  # torch still runs it


@pytest.mark.filterwarnings(MIXED_TYPES)
@pytest.mark.parametrize("attn_mask", [BOOL_GRID, FLOAT_GRID], ids=["bool", "float"])
@pytest.mark.parametrize("padding", [PADDING, PADDING_FLOAT], ids=["bool", "float"])
def test_attn_mask_and_key_padding_together(attn_mask, padding):
    mask, bias = check_against_torch_mha(mha(), attn_mask=attn_mask, key_padding_mask=padding)
    if attn_mask.dtype == padding.dtype == bool:
        assert bias is None and mask.shape == (B, 1, T, S)
        np.testing.assert_array_equal(mask[1, 0], [[0, 1, 1, 0], [0, 0, 1, 1], [0, 1, 0, 1]])


@pytest.mark.filterwarnings(MIXED_TYPES)
def test_masks_with_bias_kv_and_zero_attn_cover_real_keys_only():
    """torch pads its masks for the extra key columns; jaxattn pads (mask, bias) the same way."""
    check_against_torch_mha(
        mha(add_bias_kv=True, add_zero_attn=True), attn_mask=BOOL_GRID, key_padding_mask=PADDING_FLOAT
    )


def test_is_causal_hint_uses_the_attn_mask():
    """MHA's is_causal only promises attn_mask is top-left causal; with need_weights=False torch swaps it."""
    causal = np.triu(np.ones((T, S), bool), 1)  # torch MHA convention: True above the diagonal = blocked
    m = mha()
    q, k, v = map(torch.tensor, qkv())
    fast = m(q, k, v, attn_mask=torch.tensor(causal), is_causal=True, need_weights=False)[0]
    mask, bias = cc.masks_from_torch(causal, is_causal=True)
    out = jaxattn.multi_head_attention(cc.params_from_torch(m), *map(np.asarray, (q, k, v)), mask=mask)
    assert_float64(out, fast)
    assert normwise(out, fast.detach().numpy()) <= TOL
    np.testing.assert_array_equal(mask, [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]])
    with pytest.raises(ValueError, match="not that mask"):
        cc.masks_from_torch(BOOL_GRID, is_causal=True)
    with pytest.raises(ValueError, match="refuses it without attn_mask"):
        cc.masks_from_torch(is_causal=True)


# ---------------------------------------------------------------------------- F.scaled_dot_product_attention


def sdpa_case(T, S, seed=1):
    """q [B,N,T,H] etc. for torch; jaxattn takes the same numbers as [B,T,N,H]."""
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, N, T, 5)), rng.normal(size=(B, N, S, 5)), rng.normal(size=(B, N, S, 7))


def check_against_sdpa(T, S, attn_mask=None, is_causal=False):
    q, k, v = sdpa_case(T, S)
    expected = F.scaled_dot_product_attention(
        *map(torch.tensor, (q, k, v)),
        is_causal=is_causal,
        attn_mask=None if attn_mask is None else torch.tensor(attn_mask),
    )
    mask, bias = cc.sdpa_masks_from_torch(attn_mask, is_causal=is_causal, query_length=T, key_length=S)
    heads_last = lambda x: np.swapaxes(x, -3, -2)  # noqa: E731  [B,N,T,H] <-> [B,T,N,H]
    out = jaxattn.dot_product_attention(*map(heads_last, (q, k, v)), mask=mask, bias=bias)
    assert_float64(out, expected)
    assert normwise(heads_last(np.asarray(out)), expected.numpy()) <= TOL
    return mask, bias


def test_sdpa_bool_mask_means_take_part():
    take_part = ~BOOL_GRID  # SDPA's convention is the opposite of MHA's
    mask, bias = check_against_sdpa(T, S, attn_mask=take_part)
    assert bias is None
    np.testing.assert_array_equal(mask, take_part)


def test_sdpa_float_mask_and_per_head_shape():
    grids = np.stack([FLOAT_GRID, FLOAT_GRID[::-1], np.zeros((T, S))])  # [N, T, S]: SDPA's layout is ours
    mask, bias = check_against_sdpa(T, S, attn_mask=grids)
    assert mask is None and bias.shape == (N, T, S)


def test_sdpa_is_causal_is_top_left_when_T_below_S():
    mask, _ = check_against_sdpa(3, 5, is_causal=True)
    np.testing.assert_array_equal(mask, [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    # the pitfall, shown: jaxattn's own is_causal is bottom-right, a different mask when T != S
    q, k, v = (np.swapaxes(x, -3, -2) for x in sdpa_case(3, 5))
    with_mask = jaxattn.dot_product_attention(q, k, v, mask=mask)
    assert normwise(jaxattn.dot_product_attention(q, k, v, is_causal=True), with_mask) > 1e-3


def test_sdpa_is_causal_when_T_equals_S_matches_jaxattn_causal():
    mask, _ = check_against_sdpa(4, 4, is_causal=True)
    np.testing.assert_array_equal(mask, np.tril(np.ones((4, 4), bool)))
    q, k, v = (np.swapaxes(x, -3, -2) for x in sdpa_case(4, 4))
    causal = jaxattn.dot_product_attention(q, k, v, is_causal=True)
    masked = jaxattn.dot_product_attention(q, k, v, mask=mask)
    assert_float64(causal, masked)
    assert normwise(causal, masked) <= TOL


# -------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: cc.masks_from_torch(np.zeros((6, T, S), bool)), "pass num_heads"),
        (lambda: cc.masks_from_torch(np.zeros((7, T, S), bool), num_heads=N), "divisible by num_heads=3"),
        (lambda: cc.masks_from_torch(np.zeros((T,), bool)), r"\[T, S\] or \[B\*N, T, S\]"),
        (lambda: cc.masks_from_torch(np.zeros((T, S), np.int64)), "bool or floating"),
        (lambda: cc.masks_from_torch(BOOL_GRID, PADDING[:, :3]), "key length S = 4, got 3"),
        (lambda: cc.masks_from_torch(BOOL_GRID, query_length=4), "query length T = 4, got 3"),
        (lambda: cc.masks_from_torch(np.zeros((6, T, S), bool), np.zeros((3, S), bool), num_heads=N), "batch B = 2"),
        (lambda: cc.sdpa_masks_from_torch(is_causal=True), "query_length= and key_length="),
        (lambda: cc.sdpa_masks_from_torch(~BOOL_GRID, is_causal=True), "one or the other"),
    ],
)
def test_bad_masks(call, message):
    with pytest.raises(ValueError, match=message):
        call()
