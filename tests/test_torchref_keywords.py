"""torchref's programmable-attention keywords against code nobody here wrote.

* torch's own ``flex_attention`` (eager, forward only: torch 2.13 has no CPU backward for it) on every case of
  ``crosscheck._comparison.flex_reference.FLEX_CASES``, through the explicit row-index -> absolute-position conversion;
* Hugging Face attention (Gemma 2, Mistral, gpt-oss, Llama 4 text, Qwen2) from tiny random configs;
* gradients: ``torch.autograd.gradcheck`` (finite differences); softcap and sinks also against the numpy loop
  reference (tests/helpers.py).

float64 throughout (torch's eager flex runs float64 on CPU). Axes have their own sizes: B=2, N=6, K=3 or 6,
H=7, Hv=11, T=13 or 5 (after a cache), S=13.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import torchref
import torchref.positions as P
from crosscheck._comparison.flex_reference import (
    FLEX_CASES,
    absolute_mod_from_torch,
    flex_reference,
    torch_mod_from_absolute,
)
from helpers import attention_loop

F64 = torch.float64
B, N, H, HV = 2, 6, 7, 11
TOL = {"rtol": 1e-12, "atol": 1e-12}

# torch warns on every eager flex call that it is slow without torch.compile: expected here.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def randn(*shape, seed, dtype=F64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def qkv(T, S, K=N, batch=(B,), seed=0, requires_grad=False):
    q, k, v = (
        randn(*batch, T, N, H, seed=seed),
        randn(*batch, S, K, H, seed=seed + 1),
        randn(*batch, S, K, HV, seed=seed + 2),
    )
    return tuple(x.requires_grad_(requires_grad) for x in (q, k, v))


def assert_close(actual, expected, **tol):
    np.testing.assert_allclose(np.asarray(actual.detach()), np.asarray(expected.detach()), **(tol or TOL))


# ---------------------------------------------------------------------------------------------------------
# torch flex_attention (eager) against the first-class keywords and torchref.flex_attention


FLEX_PARAMS = [(name, 3) for name in sorted(FLEX_CASES)] + [("causal", N), ("documents_sliding_softcap_cache", N)]
# The default group: the cases that combine options (each alone, and the other cached twins, run in the slow group).
DEFAULT_FLEX = {
    ("documents_sliding_softcap", 3),
    ("documents_sliding_softcap_cache", N),
    ("chunked_alibi_cache", 3),
    ("softcap_t5_window", 3),
    ("window_both_sides_cache", 3),
    ("prefix_lm", 3),
    ("causal", N),
}


@pytest.mark.parametrize(
    "name, K",
    [p if p in DEFAULT_FLEX else pytest.param(*p, marks=pytest.mark.slow) for p in FLEX_PARAMS],
    ids=[f"{name}-K{K}" for name, K in FLEX_PARAMS],
)
def test_flex_case_torch_flex_equals_keywords_and_torchref_flex(name, K):
    case = FLEX_CASES[name]
    q, k, v = qkv(case.T, case.S, K=K, seed=len(name))
    arrays = case.arrays(np.random.default_rng(len(name)), (B,), N)
    score_mod, mask_mod = case.mods(torch, arrays)
    expected = flex_reference(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    assert expected.dtype == F64 and expected.shape == (B, case.T, N, HV)
    got, weights = torchref.dot_product_attention(q, k, v, return_weights=True, **case.keywords(torch, arrays))
    assert_close(got, expected)
    assert_close(torchref.flex_attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod), expected)
    # the case must not be trivial: it changes the result, and a mask_mod masks some keys but not all
    assert (got - torchref.dot_product_attention(q, k, v)).abs().max() > 1e-3
    if mask_mod is not None:
        assert (weights == 0).any() and (weights > 0).any()


@pytest.mark.parametrize("T", [13, 5])
def test_sinks_match_torch_flex_log_sum_exp(T):
    q, k, v = qkv(T, 13, K=3)
    sinks = randn(N, seed=7) * 2
    window = lambda b, n, t, s: (t >= s) & (t - s <= 3)
    expected = flex_reference(q, k, v, mask_mod=window, sinks=sinks)
    got = torchref.dot_product_attention(q, k, v, is_causal=True, window=(3, 0), sinks=sinks)
    assert_close(got, expected)
    # without the sink the rows differ (the sink takes weight)
    assert not torch.allclose(got, torchref.dot_product_attention(q, k, v, is_causal=True, window=(3, 0)))


def test_row_without_keys_is_zero_in_torch_flex_and_torchref_even_with_a_sink():
    q, k, v = qkv(9, 5)  # T > S: bottom-right causal leaves the first 4 rows without a key
    sinks = randn(N, seed=3)
    expected = flex_reference(q, k, v, mask_mod=lambda b, n, t, s: t >= s, sinks=sinks)
    out, weights = torchref.dot_product_attention(q, k, v, is_causal=True, sinks=sinks, return_weights=True)
    assert_close(out, expected)
    assert (out[:, :4] == 0).all() and (weights[..., :4, :] == 0).all() and (out[:, 4:] != 0).all()


def test_position_conversion_literal_grids():
    T, S = 3, 5
    qi, ki = torch.arange(T)[:, None], torch.arange(S)[None, :]
    causal_abs = lambda b, n, t, s: t >= s
    grid = torch_mod_from_absolute(causal_abs, query_length=T, key_length=S)(0, 0, qi, ki)
    np.testing.assert_array_equal(grid.numpy(), [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    # torch's own top-left causal (q_idx >= kv_idx), seen on absolute positions, is shifted by S - T
    top_left = absolute_mod_from_torch(lambda b, h, q, kv: q >= kv, query_length=T, key_length=S)
    t = qi + (S - T)
    np.testing.assert_array_equal(top_left(0, 0, t, ki).numpy(), [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]])
    # explicit positions, per batch row: [B, T] and [B, S]
    qpos, kpos = torch.tensor([[0, 2, 4], [9, 9, 9]]), torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]])
    converted = torch_mod_from_absolute(
        causal_abs, query_length=T, key_length=S, query_positions=qpos, key_positions=kpos
    )
    np.testing.assert_array_equal(converted(0, 0, qi, ki).numpy(), [[1, 0, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    assert converted(1, 0, qi, ki).all()


def test_flex_reference_with_explicit_positions_matches_keywords():
    q, k, v = qkv(5, 13, K=3)
    qpos = torch.tensor([[3, 4, 8, 9, 12], [0, 1, 2, 6, 7]])
    kpos = torch.arange(13).expand(B, 13)
    expected = flex_reference(
        q, k, v, mask_mod=lambda b, n, t, s: (t >= s) & (t // 4 == s // 4), query_positions=qpos, key_positions=kpos
    )
    got = torchref.dot_product_attention(
        q, k, v, is_causal=True, chunk_size=4, query_positions=qpos, key_positions=kpos
    )
    assert_close(got, expected)


# ---------------------------------------------------------------------------------------------------------
# literal grids for the rules (absolute positions)


def allowed_grid(T, S, **keywords):
    q, k, v = qkv(T, S, batch=())
    _, weights = torchref.dot_product_attention(q, k, v, return_weights=True, **keywords)
    return (weights[0] > 0).int().numpy()


def test_window_chunk_segments_literal_grids():
    np.testing.assert_array_equal(
        allowed_grid(4, 6, window=(1, 0)),
        [[0, 1, 1, 0, 0, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]],
    )
    np.testing.assert_array_equal(allowed_grid(3, 3, window=(None, 1)), [[1, 1, 0], [1, 1, 1], [1, 1, 1]])
    # T > S: query positions -2..2; chunks are floor(position / 2): -2,-1 | 0,1 | 2
    np.testing.assert_array_equal(
        allowed_grid(5, 3, chunk_size=2), [[0, 0, 0], [0, 0, 0], [1, 1, 0], [1, 1, 0], [0, 0, 1]]
    )
    ids = torch.tensor([0, 0, 1, 1, 1])
    np.testing.assert_array_equal(
        allowed_grid(5, 5, query_segment_ids=ids, is_causal=True),
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]],
    )


# ---------------------------------------------------------------------------------------------------------
# softcap and sinks against the numpy loop reference, and finite-difference gradients


def test_softcap_and_sinks_match_loop():
    q, k, v = qkv(5, 7, K=3)
    sinks = randn(N, seed=9)
    keywords = dict(is_causal=True, window=(2, 0), logit_softcap=0.7, sinks=sinks)
    got = torchref.dot_product_attention(q, k, v, **keywords)
    np.testing.assert_allclose(got.numpy(), attention_loop(q, k, v, **keywords)[0], **TOL)


def test_gradients_softcap_sinks_window_segments_finite_differences():
    q, k, v = qkv(3, 5, K=3, batch=(2,), requires_grad=True)
    q, k, v = (x[..., :3].detach().requires_grad_() for x in (q, k, v))  # H = Hv = 3: small Jacobians
    sinks = randn(2, N, seed=5).requires_grad_()  # per batch row and head
    ids = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 2]])

    def f(q, k, v, sinks):
        return torchref.dot_product_attention(
            q, k, v, logit_softcap=0.9, sinks=sinks, window=(2, 1), query_segment_ids=ids[:, 2:], key_segment_ids=ids
        )

    assert torch.autograd.gradcheck(f, (q, k, v, sinks), fast_mode=True)


def test_sink_gradient_is_zero_on_rows_without_keys():
    q, k, v = qkv(4, 2, requires_grad=True)  # rows 0, 1 see no key
    sinks = randn(N, seed=2).requires_grad_()
    out = torchref.dot_product_attention(q, k, v, is_causal=True, sinks=sinks)
    (out[:, :2].sum() * 1.0).backward()
    assert torch.equal(sinks.grad, torch.zeros(N, dtype=F64)) and torch.isfinite(q.grad).all()


def test_gradients_reach_arrays_the_score_mod_closes_over():
    q, k, v = (x[..., :3].detach() for x in qkv(5, 7, K=3))
    slopes = torch.rand(N, dtype=F64, generator=torch.Generator().manual_seed(1)).requires_grad_()
    table = randn(7, N, seed=4).requires_grad_()

    def f(slopes, table):
        def score_mod(score, b, n, t, s):
            bucket = (s - t).clamp(-3, 3) + 3
            return score + slopes[n] * (s - t) + table[bucket, n]

        return torchref.flex_attention(q, k, v, score_mod=score_mod, is_causal=True, logit_softcap=1.3)

    assert torch.autograd.gradcheck(f, (slopes, table), fast_mode=True)


# ---------------------------------------------------------------------------------------------------------
# the position-scheme twins and the modules take the same keywords


def test_alibi_twin_caps_before_the_position_bias():
    q, k, v = qkv(5, 13, K=3)
    slopes = P.alibi_slopes(N)
    got = P.alibi_attention(q, k, v, slopes, is_causal=True, logit_softcap=1.1, chunk_size=4)
    expected = flex_reference(
        q,
        k,
        v,
        score_mod=lambda sc, b, n, t, s: 1.1 * torch.tanh(sc / 1.1) + slopes[n] * (s - t),
        mask_mod=lambda b, n, t, s: (t >= s) & (t // 4 == s // 4),
    )
    assert_close(got, expected)


def test_transformer_xl_softcap_caps_both_logit_terms():
    q, k, v = qkv(4, 6)
    R, max_left = 9, 6
    table, u, w = randn(R, H, seed=1), randn(N, H, seed=2), randn(N, H, seed=3)
    got = P.transformer_xl_attention(
        q, k, v, table, max_left=max_left, pos_bias_u=u, pos_bias_v=w, logit_softcap=0.8, is_causal=True
    )
    index = P.clipped_relative_index(4, 6, max_left=max_left, max_right=R - 1 - max_left)
    content = torch.einsum("btnh,bsnh->bnts", q + u, k)
    position = torch.einsum("btnh,tsh->bnts", q + w, table[index])
    logits = 0.8 * torch.tanh(H**-0.5 * (content + position) / 0.8)
    logits = logits.masked_fill(~torch.ones(4, 6, dtype=torch.bool).tril(2), float("-inf"))
    expected = torch.einsum("bnts,bsnh->btnh", logits.softmax(-1), v)
    assert_close(got, expected)


def test_modules_pass_the_keywords_through():
    torch.manual_seed(0)
    module = torchref.MultiHeadAttention(17, N, H, num_kv_heads=3, value_head_dim=HV, dtype=F64)
    rel_module = torchref.RelativeMultiHeadAttention(17, N, H, max_distance=3, num_kv_heads=3, dtype=F64)
    x = randn(B, 13, 17, seed=1)
    ids = torch.tensor([[0] * 6 + [1] * 7, [0] * 2 + [1] * 11])
    keywords = {
        "is_causal": True,
        "window": (4, 0),
        "chunk_size": 8,
        "logit_softcap": 1.5,
        "sinks": randn(N, seed=2),
        "query_segment_ids": ids,
        "key_segment_ids": ids,
    }
    q, k, v = module._project(x, None, None)
    expected = module.out_proj(torchref.dot_product_attention(q, k, v, **keywords).flatten(-2))
    assert_close(module(x, **keywords), expected)
    q, k, v = rel_module._project(x, None, None)
    expected = torchref.shaw_relative_attention(
        q, k, v, rel_module.rel_key, rel_module.rel_value, max_distance=3, **keywords
    )
    assert_close(rel_module(x, **keywords), rel_module.out_proj(expected.flatten(-2)))


# ---------------------------------------------------------------------------------------------------------
# bad input

q_, k_, v_ = qkv(5, 7, K=3)
BAD = {
    "window_negative": (lambda: torchref.dot_product_attention(q_, k_, v_, window=(-1, 0)), "window"),
    "window_not_pair": (lambda: torchref.dot_product_attention(q_, k_, v_, window=3), "window"),
    "chunk_zero": (lambda: torchref.dot_product_attention(q_, k_, v_, chunk_size=0), "chunk_size"),
    "softcap_zero": (lambda: torchref.dot_product_attention(q_, k_, v_, logit_softcap=0.0), "logit_softcap"),
    "sinks_wrong_heads": (lambda: torchref.dot_product_attention(q_, k_, v_, sinks=torch.zeros(3, dtype=F64)), "sinks"),
    "sinks_int": (lambda: torchref.dot_product_attention(q_, k_, v_, sinks=torch.zeros(N, dtype=torch.long)), "sinks"),
    "segments_float": (
        lambda: torchref.dot_product_attention(
            q_, k_, v_, query_segment_ids=torch.zeros(B, 5), key_segment_ids=torch.zeros(B, 7)
        ),
        "query_segment_ids",
    ),
    "segments_wrong_length": (
        lambda: torchref.dot_product_attention(
            q_,
            k_,
            v_,
            query_segment_ids=torch.zeros(B, 5, dtype=torch.long),
            key_segment_ids=torch.zeros(B, 5, dtype=torch.long),
        ),
        "key_segment_ids",
    ),
    "segments_one_side_T_ne_S": (
        lambda: torchref.dot_product_attention(q_, k_, v_, query_segment_ids=torch.zeros(B, 5, dtype=torch.long)),
        "key_segment_ids",
    ),
    "mask_mod_not_bool": (lambda: torchref.flex_attention(q_, k_, v_, mask_mod=lambda b, n, t, s: t - s), "mask_mod"),
    "score_mod_changes_shape": (
        lambda: torchref.flex_attention(q_, k_, v_, score_mod=lambda sc, b, n, t, s: sc.sum(-1)),
        "score_mod",
    ),
    "score_mod_changes_dtype": (
        lambda: torchref.flex_attention(q_, k_, v_, score_mod=lambda sc, b, n, t, s: sc.float()),
        "score_mod",
    ),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_raises_value_error_naming_the_argument(name):
    call, argument = BAD[name]
    with pytest.raises(ValueError, match=argument):
        call()


def test_flex_keeps_torchref_independent_of_jax():
    import ast
    import pathlib

    for path in pathlib.Path(torchref.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] in ("jax", "jaxattn", "flax", "crosscheck") for n in names), path
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torchref.flex_attention(q_, k_, v_, mask_mod=lambda b, n, t, s: t >= s)


# ---------------------------------------------------------------------------------------------------------
# Hugging Face attention (tiny random configs, offline): prefill, then more tokens on the cache

EXPECTED_LAYERS = {  # the layer types each tiny config must produce, so every mapping row is exercised
    "gemma2": {"sliding_attention", "full_attention"},
    "mistral": {"sliding_attention"},
    "gpt_oss": {"sliding_attention", "full_attention"},
    "llama4": {"chunked_attention", "full_attention"},
    "qwen2": {"full_attention"},
    "qwen2_sliding": {"sliding_attention", "full_attention"},
}
FAMILY_KEYWORDS = ("window", "chunk_size", "logit_softcap", "sinks")


@pytest.fixture(scope="module")
def hf_calls():
    pytest.importorskip("transformers")
    from crosscheck._hf.attention import FAMILIES, record_attention

    return {family: record_attention(family) for family in FAMILIES}


@pytest.mark.parametrize("family", sorted(EXPECTED_LAYERS))
def test_hf_attention_equals_torchref_with_mapped_keywords(hf_calls, family):
    calls = hf_calls[family]
    assert {c.layer_type for c in calls} == EXPECTED_LAYERS[family]
    assert any(c.query.shape[1] < c.key.shape[1] for c in calls)  # a call on the cache (T < S)
    for call in calls:
        assert call.output.dtype == F64
        got = torchref.dot_product_attention(call.query, call.key, call.value, **call.keywords)
        assert_close(got, call.output)
        for name in FAMILY_KEYWORDS:  # each mapped keyword changes the result: the mapping is what matches
            if name in call.keywords:
                without = {k: v for k, v in call.keywords.items() if k != name}
                other = torchref.dot_product_attention(call.query, call.key, call.value, **without)
                assert (other - call.output).abs().max() > 1e-3, (family, call.layer_idx, name)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_hf_gradients_equal_torchref_softcap_and_sinks(hf_calls, family):
    call = next(c for c in hf_calls[family] if c.query.shape[1] < c.key.shape[1] and "window" in c.keywords)
    inputs = [x.clone().requires_grad_() for x in (call.query, call.key, call.value)]
    cotangent = randn(*call.output.shape, seed=1)
    sinks_param = getattr(call.rerun.module, "sinks", None)
    hf_grads = torch.autograd.grad(
        (call.rerun(*inputs) * cotangent).sum(), inputs + ([sinks_param] if sinks_param is not None else [])
    )
    keywords = dict(call.keywords)
    ours = list(inputs)
    if sinks_param is not None:
        keywords["sinks"] = sinks_param.detach().clone().requires_grad_()
        ours.append(keywords["sinks"])
    our_grads = torch.autograd.grad((torchref.dot_product_attention(*inputs, **keywords) * cotangent).sum(), ours)
    for ours_g, hf_g in zip(our_grads, hf_grads):
        assert_close(ours_g, hf_g)


def test_hf_float32_within_float32_tolerance():
    from crosscheck._hf.attention import record_attention

    for call in record_attention("gemma2", dtype=torch.float32):
        got = torchref.dot_product_attention(call.query, call.key, call.value, **call.keywords)
        assert got.dtype == torch.float32
        assert_close(got, call.output, rtol=1e-5, atol=1e-6)
