"""torchref against a literal loop over (batch, head, t, s) in numpy float64 (tests/helpers.py), and against torch's
own attention.

Every axis has its own prime size (T=5, S=7, N=6 with K in {6, 3, 2, 1}, H=11, Hv=13, E*=17/19/23/29) so that
a swapped axis fails loudly.
"""

from __future__ import annotations

import ast
import pathlib
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchref
from helpers import attention_loop, shaw_index_loop

F64 = torch.float64
B, T, S, N, H, HV = 2, 5, 7, 6, 11, 13
TOL = {"rtol": 1e-12, "atol": 1e-12}


# ---------------------------------------------------------------------------------------------------------
# helpers


def randn(*shape, seed, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def qkv(batch=(B,), T_=T, S_=S, N_=N, K_=N, H_=H, Hv_=HV, seed=0, requires_grad=False):
    q = randn(*batch, T_, N_, H_, seed=seed)
    k = randn(*batch, S_, K_, H_, seed=seed + 1)
    v = randn(*batch, S_, K_, Hv_, seed=seed + 2)
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v))


def assert_close(actual, expected, **tol):
    np.testing.assert_allclose(np.asarray(actual.detach()), expected, **(tol or TOL))


def random_mask(*shape, seed):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) > 0.3


# ---------------------------------------------------------------------------------------------------------
# dot_product_attention against the loop

DOT_CASES = {
    "multi_head": dict(),
    "grouped_query_k3": dict(K_=3),
    "grouped_query_k2": dict(K_=2),
    "multi_query": dict(K_=1),
    "no_batch_dims": dict(batch=()),
    "two_batch_dims": dict(batch=(2, 3), K_=3),
    "mask_and_bias": dict(K_=3, mask=(B, N, T, S), bias=(B, N, T, S)),
    "broadcast_mask_and_bias": dict(mask=(T, S), bias=(1, N, 1, S)),
    "causal_square": dict(T_=7, is_causal=True),
    "causal_fewer_queries": dict(T_=5, is_causal=True, K_=2),
    "causal_more_queries": dict(T_=11, is_causal=True),
    "causal_with_mask": dict(T_=3, is_causal=True, mask=(B, 1, 3, S), bias=(N, 3, S)),
    "lengths": dict(lengths=[3, 7]),
    "lengths_and_causal_two_batch_dims": dict(batch=(2, 3), lengths=[[1, 4, 7], [0, 2, 5]], is_causal=True),
    "scale": dict(scale=0.37, K_=3),
    "query_positions": dict(T_=3, is_causal=True, query_positions=[2, 4, 6]),
    "batched_positions": dict(
        T_=3,
        is_causal=True,
        query_positions=[[0, 5, 6], [3, 3, 1]],
        key_positions=[[0, 1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1, 0]],
    ),
}


def build_case(case, seed=0):
    case = dict(case)
    shape_keys = ("batch", "T_", "S_", "N_", "K_", "H_", "Hv_")
    q, k, v = qkv(**{name: case.pop(name) for name in shape_keys if name in case}, seed=seed)
    T_, S_ = q.shape[-3], k.shape[-3]
    kwargs = {}
    if "mask" in case:
        kwargs["mask"] = random_mask(*case.pop("mask"), seed=seed + 10)
    if "bias" in case:
        kwargs["bias"] = randn(*case.pop("bias"), seed=seed + 11)
    if "lengths" in case:
        kwargs["key_value_seq_lengths"] = torch.tensor(case.pop("lengths"))
    for name in ("query_positions", "key_positions"):
        if name in case:
            kwargs[name] = torch.tensor(case.pop(name))
    kwargs.update(case)
    assert (T_, S_) == (q.shape[-3], k.shape[-3])
    return (q, k, v), kwargs


@pytest.mark.parametrize("case", DOT_CASES.values(), ids=DOT_CASES.keys())
def test_dot_product_attention_matches_loop(case):
    (q, k, v), kwargs = build_case(case)
    out, weights = torchref.dot_product_attention(q, k, v, return_weights=True, **kwargs)
    expected_out, expected_weights = attention_loop(q, k, v, **kwargs)
    assert out.dtype == F64 and out.shape == expected_out.shape
    assert_close(out, expected_out)
    assert_close(weights, expected_weights)
    assert_close(torchref.dot_product_attention(q, k, v, **kwargs), expected_out)


def test_causal_alignment_is_bottom_right_literal_grid():
    q, k, v = qkv(batch=(), T_=3, S_=5, N_=1, K_=1)
    _, weights = torchref.dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    expected = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    np.testing.assert_array_equal((weights[0] > 0).numpy(), np.array(expected, dtype=bool))
    q, k, v = qkv(batch=(), T_=5, S_=3, N_=1, K_=1)
    _, weights = torchref.dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    expected = [[0, 0, 0], [0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 1, 1]]
    np.testing.assert_array_equal((weights[0] > 0).numpy(), np.array(expected, dtype=bool))


def test_zero_logits_under_causal_mask_give_running_mean():
    # seed004: the causal bag of words.
    v = randn(B, 8, 1, HV, seed=3)
    q = torch.zeros(B, 8, 1, H, dtype=F64)
    out = torchref.dot_product_attention(q, torch.zeros_like(q), v, is_causal=True)
    running_mean = torch.cumsum(v, dim=1) / torch.arange(1, 9, dtype=F64)[:, None, None]
    assert_close(out, running_mean.numpy())


@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
@pytest.mark.parametrize("how", ["causal_more_queries", "all_false_mask", "zero_length", "minus_inf_bias"])
def test_rows_without_keys_are_zero_with_finite_gradients(how):
    T_ = 9 if how == "causal_more_queries" else T
    q, k, v = qkv(T_=T_, K_=3, requires_grad=True)
    empty = torch.zeros(B, N, T_, dtype=torch.bool)
    kwargs = {}
    if how == "causal_more_queries":
        kwargs["is_causal"] = True
        empty[:, :, : T_ - S] = True
    elif how == "all_false_mask":
        kwargs["mask"] = torch.ones(B, N, T_, S, dtype=torch.bool)
        kwargs["mask"][1, 2, 3] = False
        empty[1, 2, 3] = True
    elif how == "zero_length":
        kwargs["key_value_seq_lengths"] = torch.tensor([0, 4])
        empty[0] = True
    else:
        kwargs["bias"] = torch.zeros(B, N, T_, S, dtype=F64)
        kwargs["bias"][0, :, 1] = float("-inf")
        kwargs["bias"][0, :, 2, :3] = float("-inf")
        empty[0, :, 1] = True
        kwargs["bias"].requires_grad_(True)
    with torch.autograd.detect_anomaly():  # fails on a NaN anywhere in the backward pass, even one masked later
        out, weights = torchref.dot_product_attention(q, k, v, return_weights=True, **kwargs)
        (out.square().sum() + weights.sum()).backward()
    assert torch.all(weights[empty] == 0)
    assert torch.all(out.transpose(-3, -2)[empty] == 0)
    assert not torch.isnan(out).any() and not torch.isnan(weights).any()
    for x in (q, k, v):
        assert torch.isfinite(x.grad).all()
    assert torch.all(q.grad.transpose(-3, -2)[empty] == 0)
    if "bias" in kwargs:
        assert torch.isfinite(kwargs["bias"].grad).all()


def test_gradients_match_finite_differences():
    q, k, v = qkv(batch=(2,), T_=4, S_=3, N_=2, K_=1, H_=3, Hv_=5, requires_grad=True)
    bias = randn(2, 4, 3, seed=7).requires_grad_(True)
    mask = random_mask(2, 2, 4, 3, seed=8)

    def f(q, k, v, bias):
        return torchref.dot_product_attention(q, k, v, bias=bias, mask=mask, is_causal=True)

    assert torch.autograd.gradcheck(f, (q, k, v, bias))


# ---------------------------------------------------------------------------------------------------------
# relative attention and Shaw tables against the loop

REL_CASES = {
    "per_head": dict(rel_k=(T, S, N, H), rel_v=(T, S, N, HV)),
    "shared": dict(rel_k=(T, S, 1, H), rel_v=(T, S, 1, HV)),
    "key_only_grouped": dict(rel_k=(T, S, N, H), K_=3),
    "value_only_multi_query": dict(rel_v=(T, S, 1, HV), K_=1),
    "batched_tables": dict(rel_k=(B, 1, T, S, N, H), rel_v=(3, T, S, 1, HV), batch=(B, 3)),
    "causal_mask_bias_scale": dict(
        rel_k=(T, S, 1, H), rel_v=(T, S, N, HV), K_=2, is_causal=True, mask=(B, 1, T, S), bias=(N, T, S), scale=0.29
    ),
}


@pytest.mark.parametrize("case", REL_CASES.values(), ids=REL_CASES.keys())
def test_relative_attention_matches_loop(case):
    case = dict(case)
    rel_k = randn(*case.pop("rel_k"), seed=20) if "rel_k" in case else None
    rel_v = randn(*case.pop("rel_v"), seed=21) if "rel_v" in case else None
    (q, k, v), kwargs = build_case(case)
    out, weights = torchref.relative_attention(q, k, v, rel_k, rel_v, return_weights=True, **kwargs)
    expected_out, expected_weights = attention_loop(q, k, v, rel_key=rel_k, rel_value=rel_v, **kwargs)
    assert_close(out, expected_out)
    assert_close(weights, expected_weights)


def test_relative_attention_without_tables_is_dot_product_attention():
    q, k, v = qkv(K_=3)
    expected = torchref.dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(torchref.relative_attention(q, k, v, is_causal=True), expected, rtol=0, atol=0)


def test_seed000_per_head_weights_and_pair_tables():
    # seed000, corrected: X [B,S,N,D], W [N,D,D], A [S,S,N,D] -> z [B,S,N,D], scale 1/sqrt(D).
    X = randn(B, S, 3, H, seed=30)
    W_Q, W_K, W_V = (randn(3, H, H, seed=31 + i) for i in range(3))
    a_K, a_V = randn(S, S, 3, H, seed=34), randn(S, S, 3, H, seed=35)
    q, k, v = (torch.einsum("bsnd,nde->bsne", X, W) for W in (W_Q, W_K, W_V))
    e = (q.unsqueeze(2) * (k.unsqueeze(1) + a_K)).sum(-1) / H**0.5  # [B, S, S, N]
    alpha = torch.softmax(e, dim=2)
    z = torch.einsum("bijn,bijnd->bind", alpha, v.unsqueeze(1) + a_V)
    torch.testing.assert_close(torchref.relative_attention(q, k, v, a_K, a_V), z, rtol=1e-12, atol=1e-12)


def test_relative_position_index_literal_grids():
    expected = [[0, 1, 2, 3, 4], [0, 0, 1, 2, 3], [0, 0, 0, 1, 2]]
    index = torchref.relative_position_index(3, 5, 2)
    assert index.dtype == torch.int64
    np.testing.assert_array_equal(index.numpy(), expected)
    expected = [
        [2, 2, 2],  # query 0 sits at -2: every key is at distance >= +2, clipped to +1
        [2, 2, 2],
        [1, 2, 2],
        [0, 1, 2],
        [0, 0, 1],
    ]
    np.testing.assert_array_equal(torchref.relative_position_index(5, 3, 1).numpy(), expected)
    np.testing.assert_array_equal(torchref.relative_position_index(4, 4, 0).numpy(), np.zeros((4, 4)))


def test_relative_position_index_with_positions():
    qpos, kpos = [[0, 3, 9], [1, 1, 2]], [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0]]
    index = torchref.relative_position_index(
        3, 5, 2, query_positions=torch.tensor(qpos), key_positions=torch.tensor(kpos)
    )
    assert index.shape == (2, 3, 5)
    for b in range(2):
        np.testing.assert_array_equal(index[b].numpy(), shaw_index_loop(3, 5, 2, qpos[b], kpos[b]))
    index = torchref.relative_position_index(3, 5, 3, query_positions=torch.tensor([7, 0, 2]))
    np.testing.assert_array_equal(index.numpy(), shaw_index_loop(3, 5, 3, np.array([7, 0, 2])))


@pytest.mark.parametrize("T_,S_,max_distance", [(5, 7, 2), (7, 5, 3), (6, 6, 0), (1, 13, 4)])
def test_relative_position_index_matches_loop(T_, S_, max_distance):
    np.testing.assert_array_equal(
        torchref.relative_position_index(T_, S_, max_distance).numpy(), shaw_index_loop(T_, S_, max_distance)
    )


MAXD = 2
R = 2 * MAXD + 1
SHAW_CASES = {
    "shared_tables": dict(key_table=(R, H), value_table=(R, HV)),
    "per_head_tables_grouped": dict(key_table=(R, N, H), value_table=(R, N, HV), K_=3),
    "key_table_only_causal_more_queries": dict(key_table=(R, N, H), T_=9, is_causal=True),
    "value_table_only_with_lengths": dict(value_table=(R, HV), lengths=[2, 6]),
    "batched_positions": dict(
        key_table=(R, H),
        value_table=(R, N, HV),
        T_=3,
        is_causal=True,
        query_positions=[[4, 5, 6], [0, 2, 9]],
        key_positions=[0, 1, 2, 3, 4, 5, 6],
    ),
}


@pytest.mark.parametrize("case", SHAW_CASES.values(), ids=SHAW_CASES.keys())
def test_shaw_tables_match_gathered_relative_attention_and_loop(case):
    case = dict(case)
    tables = {
        name: randn(*case.pop(name), seed=40 + i) if name in case else None
        for i, name in enumerate(("key_table", "value_table"))
    }
    (q, k, v), kwargs = build_case(case)
    T_, S_ = q.shape[-3], k.shape[-3]
    out, weights = torchref.shaw_relative_attention(q, k, v, **tables, max_distance=MAXD, return_weights=True, **kwargs)

    # The gather, by hand: one index grid per batch entry, each from the loop formula.
    qpos = kwargs.get("query_positions", torch.arange(T_) + S_ - T_).numpy()
    kpos = kwargs.get("key_positions", torch.arange(S_)).numpy()
    qpos, kpos = np.broadcast_to(qpos, (B, T_)), np.broadcast_to(kpos, (B, S_))
    index = np.stack([shaw_index_loop(T_, S_, MAXD, qpos[b], kpos[b]) for b in range(B)])  # [B, T, S]

    def gather(table):
        if table is None:
            return None
        table = table.numpy()
        return table[index][..., None, :] if table.ndim == 2 else table[index]  # [B, T, S, (1|N), D]

    rel_k, rel_v = gather(tables["key_table"]), gather(tables["value_table"])
    expected_out, expected_weights = attention_loop(q, k, v, rel_key=rel_k, rel_value=rel_v, **kwargs)
    assert_close(out, expected_out)
    assert_close(weights, expected_weights)
    as_tensor = lambda a: None if a is None else torch.from_numpy(np.ascontiguousarray(a))
    relative = torchref.relative_attention(q, k, v, as_tensor(rel_k), as_tensor(rel_v), **kwargs)
    assert_close(out, relative.detach().numpy())


def test_relative_gradients_match_finite_differences():
    q, k, v = qkv(batch=(2,), T_=3, S_=4, N_=2, K_=1, H_=3, Hv_=2, requires_grad=True)
    key_table = randn(3, 2, 3, seed=50).requires_grad_(True)
    value_table = randn(3, 2, seed=51).requires_grad_(True)

    def f(q, k, v, key_table, value_table):
        return torchref.shaw_relative_attention(q, k, v, key_table, value_table, max_distance=1, is_causal=True)

    assert torch.autograd.gradcheck(f, (q, k, v, key_table, value_table))


# ---------------------------------------------------------------------------------------------------------
# half precision and dropout


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_output_close_to_float32(dtype):
    q, k, v = (x.to(dtype) for x in qkv(K_=3))
    table = randn(R, N, H, seed=60).to(dtype)
    out, weights = torchref.shaw_relative_attention(
        q, k, v, table, max_distance=MAXD, is_causal=True, return_weights=True
    )
    assert out.dtype == dtype and weights.dtype == dtype
    reference = torchref.shaw_relative_attention(
        *(x.float() for x in (q, k, v)), table.float(), max_distance=MAXD, is_causal=True
    )
    torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)


def test_dropout_is_seeded_and_returned_weights_are_the_ones_used():
    q, k, v = qkv(K_=3)
    _, clean = torchref.dot_product_attention(q, k, v, return_weights=True)
    run = lambda seed: torchref.dot_product_attention(  # noqa: E731
        q, k, v, dropout_rate=0.4, generator=torch.Generator().manual_seed(seed), return_weights=True
    )
    out, weights = run(0)
    out_again, _ = run(0)
    out_other, _ = run(1)
    torch.testing.assert_close(out, out_again, rtol=0, atol=0)
    assert not torch.equal(out, out_other)
    kept = weights != 0
    assert 0 < kept.double().mean() < 1
    torch.testing.assert_close(weights[kept], clean[kept] / 0.6)
    expected = torch.einsum("bnts,bsnh->btnh", weights, v.repeat_interleave(2, dim=-2))
    torch.testing.assert_close(out, expected)


# ---------------------------------------------------------------------------------------------------------
# against torch's own attention


@pytest.mark.parametrize("K_", [N, 3])
def test_matches_torch_sdpa_with_bool_mask(K_):
    q, k, v = qkv(K_=K_)
    mask = random_mask(B, 1, T, S, seed=70)
    mask[..., 0] = True  # SDPA returns NaN for empty rows; the contract returns zeros, so keep rows non-empty
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=0.31, enable_gqa=K_ != N
    ).transpose(1, 2)
    out = torchref.dot_product_attention(q, k, v, mask=mask, scale=0.31)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_matches_torch_sdpa_causal_square():
    q, k, v = qkv(T_=S)
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
    ).transpose(1, 2)
    out = torchref.dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("kdim_vdim", [None, (19, 23)])
def test_multi_head_attention_matches_torch_mha(bias, kdim_vdim):
    E, heads = 18, 3  # torch's MHA needs E divisible by heads
    kdim, vdim = kdim_vdim or (E, E)
    torch_mha = torch.nn.MultiheadAttention(E, heads, bias=bias, batch_first=True, kdim=kdim, vdim=vdim, dtype=F64)
    ours = torchref.MultiHeadAttention(E, heads, key_features=kdim, value_features=vdim, bias=bias, dtype=F64)
    with torch.no_grad():
        if kdim_vdim is None:
            w_q, w_k, w_v = torch_mha.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = torch_mha.q_proj_weight, torch_mha.k_proj_weight, torch_mha.v_proj_weight
        for proj, w in ((ours.q_proj, w_q), (ours.k_proj, w_k), (ours.v_proj, w_v)):
            proj.weight.copy_(w)
        ours.out_proj.weight.copy_(torch_mha.out_proj.weight)
        if bias:
            for proj, b in zip((ours.q_proj, ours.k_proj, ours.v_proj), torch_mha.in_proj_bias.chunk(3)):
                proj.bias.copy_(b)
            ours.out_proj.bias.copy_(torch_mha.out_proj.bias)
    x = randn(B, T, E, seed=80)
    key, value = randn(B, S, kdim, seed=81), randn(B, S, vdim, seed=82)
    blocked = ~random_mask(T, S, seed=83)
    blocked[:, 0] = False
    expected, expected_weights = torch_mha(x, key, value, attn_mask=blocked, average_attn_weights=False)
    out, weights = ours(x, key, value, mask=~blocked, return_weights=True)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------
# modules against the loop

EQ, EK, EV, EO = 17, 19, 23, 29


def linear(x, layer):
    y = x @ layer.weight.detach().numpy().T
    return y if layer.bias is None else y + layer.bias.detach().numpy()


def test_multi_head_attention_module_matches_loop():
    mha = torchref.MultiHeadAttention(
        EQ, N, H, key_features=EK, value_features=EV, out_features=EO, num_kv_heads=2, value_head_dim=HV, dtype=F64
    )
    assert (mha.num_heads, mha.num_kv_heads, mha.head_dim, mha.value_head_dim) == (N, 2, H, HV)
    shapes = {name: tuple(p.shape) for name, p in mha.state_dict().items()}
    assert shapes == {
        "q_proj.weight": (N * H, EQ),
        "q_proj.bias": (N * H,),
        "k_proj.weight": (2 * H, EK),
        "k_proj.bias": (2 * H,),
        "v_proj.weight": (2 * HV, EV),
        "v_proj.bias": (2 * HV,),
        "out_proj.weight": (EO, N * HV),
        "out_proj.bias": (EO,),
    }
    x, key, value = randn(2, 3, T, EQ, seed=90), randn(2, 3, S, EK, seed=91), randn(2, 3, S, EV, seed=92)
    mask = random_mask(3, 1, T, S, seed=93)
    out, weights = mha(x, key, value, mask=mask, is_causal=True, return_weights=True)
    q = linear(x.numpy(), mha.q_proj).reshape(2, 3, T, N, H)  # head-major features: n * H + h
    k = linear(key.numpy(), mha.k_proj).reshape(2, 3, S, 2, H)
    v = linear(value.numpy(), mha.v_proj).reshape(2, 3, S, 2, HV)
    heads, expected_weights = attention_loop(q, k, v, mask=mask, is_causal=True)
    expected = linear(heads.reshape(2, 3, T, N * HV), mha.out_proj)
    assert out.shape == (2, 3, T, EO)
    assert_close(out, expected)
    assert_close(weights, expected_weights)


def test_multi_head_attention_module_defaults_to_self_attention():
    mha = torchref.MultiHeadAttention(EQ, 3, bias=False, dtype=F64)
    assert (mha.head_dim, mha.value_head_dim, mha.num_kv_heads) == (5, 5, 3)
    assert mha.q_proj.bias is None and mha.out_proj.weight.shape == (EQ, 15)
    x = randn(B, T, EQ, seed=94)
    torch.testing.assert_close(mha(x), mha(x, x, x), rtol=0, atol=0)
    torch.testing.assert_close(mha(x, x), mha(x, x, x), rtol=0, atol=0)


@pytest.mark.parametrize("share_heads", [False, True])
@pytest.mark.parametrize("use_tables", [(True, True), (True, False), (False, True)])
def test_relative_multi_head_attention_module_matches_loop(share_heads, use_tables):
    mha = torchref.RelativeMultiHeadAttention(
        EQ,
        N,
        H,
        max_distance=MAXD,
        share_heads=share_heads,
        use_key_table=use_tables[0],
        use_value_table=use_tables[1],
        num_kv_heads=3,
        value_head_dim=HV,
        out_features=EO,
        dtype=F64,
    )
    heads = () if share_heads else (N,)
    for name, used, dim in (("rel_key", use_tables[0], H), ("rel_value", use_tables[1], HV)):
        table = getattr(mha, name)
        assert (name in mha.state_dict()) == used
        if used:
            assert isinstance(table, torch.nn.Parameter) and table.shape == (R, *heads, dim)
            assert 0 < table.std() < 0.1
    x = randn(B, T, EQ, seed=95)
    out = mha(x, is_causal=True)
    q = linear(x.numpy(), mha.q_proj).reshape(B, T, N, H)
    k = linear(x.numpy(), mha.k_proj).reshape(B, T, 3, H)
    v = linear(x.numpy(), mha.v_proj).reshape(B, T, 3, HV)
    index = shaw_index_loop(T, T, MAXD)

    def gather(table):
        if table is None:
            return None
        table = table.detach().numpy()
        return table[index][..., None, :] if share_heads else table[index]

    attended, _ = attention_loop(q, k, v, rel_key=gather(mha.rel_key), rel_value=gather(mha.rel_value), is_causal=True)
    assert_close(out, linear(attended.reshape(B, T, N * HV), mha.out_proj))
    out.sum().backward()
    for table in (mha.rel_key, mha.rel_value):
        if table is not None:
            assert table.grad is not None and torch.isfinite(table.grad).all() and table.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------------------
# bad input: ValueError naming the argument, the expected and the actual shape


def _good():
    return qkv(K_=3)


def _call(fn=torchref.dot_product_attention, *, q=None, k=None, v=None, args=(), **kwargs):
    good_q, good_k, good_v = _good()
    q = good_q if q is None else q
    k = good_k if k is None else k
    v = good_v if v is None else v
    return lambda: fn(q, k, v, *args, **kwargs)


def _shaw(**kwargs):
    return _call(torchref.shaw_relative_attention, **kwargs)


BAD_INPUTS = {
    "query_rank": ("query", _call(q=randn(T, N * H, seed=0))),
    "key_rank": ("key", _call(k=randn(S, H, seed=0))),
    "key_head_dim": ("key", _call(k=randn(B, S, 3, H + 1, seed=0))),
    "heads_not_divisible": ("key", _call(k=randn(B, S, 4, H, seed=0), v=randn(B, S, 4, HV, seed=0))),
    "value_length": ("value", _call(v=randn(B, S + 1, 3, HV, seed=0))),
    "value_heads": ("value", _call(v=randn(B, S, 2, HV, seed=0))),
    "batch_mismatch": ("key", _call(k=randn(3, S, 3, H, seed=0), v=randn(3, S, 3, HV, seed=0))),
    "query_integer": ("query", _call(q=torch.ones(B, T, N, H, dtype=torch.int64))),
    "mask_not_bool": ("mask", _call(mask=torch.ones(B, N, T, S))),
    "mask_shape": ("mask", _call(mask=torch.ones(B, N, S, T, dtype=torch.bool))),
    "mask_extra_batch": ("mask", _call(mask=torch.ones(3, B, N, T, S, dtype=torch.bool))),
    "bias_shape": ("bias", _call(bias=torch.zeros(N + 1, T, S, dtype=F64))),
    "lengths_shape": ("key_value_seq_lengths", _call(key_value_seq_lengths=torch.tensor([1, 2, 3]))),
    "lengths_float": ("key_value_seq_lengths", _call(key_value_seq_lengths=torch.tensor([1.0, 2.0]))),
    "query_positions_shape": ("query_positions", _call(is_causal=True, query_positions=torch.arange(T + 1))),
    "key_positions_float": ("key_positions", _call(is_causal=True, key_positions=torch.ones(S))),
    "dropout_rate": ("dropout_rate", _call(dropout_rate=1.5)),
    "rel_key_shape": ("rel_key", _call(torchref.relative_attention, args=(randn(S, T, N, H, seed=0),))),
    "rel_key_heads": ("rel_key", _call(torchref.relative_attention, args=(randn(T, S, 3, H, seed=0),))),
    "rel_value_dim": ("rel_value", _call(torchref.relative_attention, args=(None, randn(T, S, N, H, seed=0)))),
    "key_table_buckets": ("key_table", _shaw(args=(randn(R + 1, H, seed=0),), max_distance=MAXD)),
    "key_table_heads": ("key_table", _shaw(args=(randn(R, 3, H, seed=0),), max_distance=MAXD)),
    "value_table_dim": ("value_table", _shaw(args=(None, randn(R, H, seed=0)), max_distance=MAXD)),
    "shaw_max_distance": ("max_distance", _shaw(args=(randn(R, H, seed=0),), max_distance=-1)),
    "index_max_distance": ("max_distance", lambda: torchref.relative_position_index(T, S, -2)),
    "index_positions": (
        "query_positions",
        lambda: torchref.relative_position_index(T, S, 2, query_positions=torch.arange(T + 2)),
    ),
    "module_kv_heads": ("num_kv_heads", lambda: torchref.MultiHeadAttention(EQ, N, num_kv_heads=4)),
    "module_head_dim": ("head_dim", lambda: torchref.MultiHeadAttention(3, 5)),
    "module_max_distance": ("max_distance", lambda: torchref.RelativeMultiHeadAttention(EQ, N, max_distance=-1)),
}


@pytest.mark.parametrize("name,call", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises_value_error_naming_the_argument(name, call):
    with pytest.raises(ValueError, match=rf"^{name}: expected .*, got ") as info:
        call()
    assert name in str(info.value)


def test_public_surface_and_independence():
    core = {
        "dot_product_attention",
        "relative_attention",
        "relative_position_index",
        "shaw_relative_attention",
        "MultiHeadAttention",
        "RelativeMultiHeadAttention",
    }
    assert core <= set(torchref.__all__)
    assert all(hasattr(torchref, name) for name in torchref.__all__)
    for letter in ("... B", "T", "S", "N", "K", "H", "E", "R"):  # the axis-letter table, one row each
        assert re.search(rf"^ +{re.escape(letter)} ", torchref.__doc__, re.MULTILINE), letter
    assert "Hv head dim of values" in torchref.__doc__
    # The oracle must be a second route to the numbers: it imports neither jaxattn nor jax.
    for path in pathlib.Path(torchref.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module]
                assert not any(name and name.split(".")[0] in ("jaxattn", "jax") for name in names), path
