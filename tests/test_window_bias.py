"""The 2D relative position bias of windowed vision encoders (Swin, BEiT): the index, the shifted-window regions,
window_attention, against plain loops of the formulas and against transformers' own modules.

References: the index and the regions as plain Python loops (the regions as the original Swin code writes them,
slices of a label map, not HF's arithmetic); the attention as tests/helpers.attention_loop with the loop's bias,
and, for gradients, a dense jnp formula built from the loop's index (no jaxattn). Sizes: B=2 maps, nW windows,
windows 2x3, 3x2 (non-square, so a swapped axis fails) and 3x3, N=5 query heads over K=1 (multi-query), H=7,
Hv=11.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import arrays, assert_float64, attention_loop, check_forward_and_grads, normwise
from jaxattn import (
    shifted_window_mask,
    shifted_window_segments,
    window_attention,
    window_merge,
    window_partition,
    window_relative_bias,
    window_relative_index,
    window_table_rows,
)

B, N, K, H, Hv = 2, 5, 1, 7, 11
WINDOWS = [(2, 3), (3, 2), (3, 3), (1, 4)]

# --- loop references ----------------------------------------------------------------------------------------


def index_loop(Wh, Ww, cls_token=False):
    """table row of (query i, key j): the query-minus-key offset (dh, dw) shifted to >= 0, row-major in
    (2 Wh - 1) x (2 Ww - 1); BEiT's cls token (position 0) takes the three last rows."""
    A = Wh * Ww
    R = (2 * Wh - 1) * (2 * Ww - 1)
    index = np.zeros((A, A), np.int64)
    for i, j in itertools.product(range(A), repeat=2):
        dh, dw = i // Ww - j // Ww, i % Ww - j % Ww
        index[i, j] = (dh + Wh - 1) * (2 * Ww - 1) + (dw + Ww - 1)
    if not cls_token:
        return index
    full = np.zeros((A + 1, A + 1), np.int64)
    full[1:, 1:] = index
    full[0, :], full[:, 0], full[0, 0] = R, R + 1, R + 2
    return full


def regions_loop(height, width, Wh, Ww, sh, sw):
    """The original Swin code: label the map by slices (0, -window), (-window, -shift), (-shift, None) per axis,
    then read each window's labels row-major, windows row-major."""
    label = np.zeros((height, width), np.int64)
    count = 0
    h_slices = (slice(0, -Wh), slice(-Wh, -sh if sh else None), slice(-sh if sh else height, None))
    w_slices = (slice(0, -Ww), slice(-Ww, -sw if sw else None), slice(-sw if sw else width, None))
    for hs in h_slices:
        for ws in w_slices:
            label[hs, ws] = count
            count += 1
    return np.array([label[a : a + Wh, b : b + Ww].ravel() for a in range(0, height, Wh) for b in range(0, width, Ww)])


def dense_reference(q, k, v, table, index, mask=None):
    """softmax(q k^T / sqrt(H) + table[index] (+ -inf off the mask)) v, in jnp from the loop's index."""
    G = q.shape[-2] // k.shape[-2]
    k, v = jnp.repeat(k, G, axis=-2), jnp.repeat(v, G, axis=-2)
    logits = jnp.einsum("...tnh,...snh->...nts", q, k) / q.shape[-1] ** 0.5
    logits = logits + jnp.moveaxis(table[index], -1, 0)
    if mask is not None:
        logits = jnp.where(mask[..., None, :, :], logits, -jnp.inf)
    return jnp.einsum("...nts,...snh->...tnh", jax.nn.softmax(logits, axis=-1), v)


# --- the index ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "window",
    [(2, 3), (3, 2), pytest.param((1, 1), marks=pytest.mark.slow), pytest.param((7, 7), marks=pytest.mark.slow)],
)
def test_index_matches_loop(window):
    for cls_token in (False, True):
        got = window_relative_index(window, cls_token=cls_token)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), index_loop(*window, cls_token))
        assert int(got.max()) == window_table_rows(window, cls_token=cls_token) - 1  # every row is used


def test_index_literal_grid():
    # window 1x2: query minus key dw = -1, 0, 1 -> rows 0, 1, 2 (query 0 vs key 1: dw = -1, row 0)
    np.testing.assert_array_equal(np.asarray(window_relative_index((1, 2))), [[1, 0], [2, 1]])
    assert window_table_rows(3) == 25 and window_table_rows((2, 3), cls_token=True) == 3 * 5 + 3


@pytest.mark.parametrize(
    "window", [(2, 3), (7, 7), *(pytest.param(w, marks=pytest.mark.slow) for w in [(3, 2), (4, 4), (5, 1)])]
)
def test_index_equals_transformers(window):
    pytest.importorskip("transformers")
    from transformers.models.beit.modeling_beit import BeitRelativePositionBias
    from transformers.models.swin.modeling_swin import SwinRelativePositionBias

    A = window[0] * window[1]
    hf = SwinRelativePositionBias(3, window).relative_position_index.view(A, A).numpy()
    np.testing.assert_array_equal(np.asarray(window_relative_index(window)), hf)
    beit = BeitRelativePositionBias.generate_relative_position_index(window).numpy()
    np.testing.assert_array_equal(np.asarray(window_relative_index(window, cls_token=True)), beit)


def test_relative_bias_equals_transformers_module():
    pytest.importorskip("transformers")
    import torch
    from transformers.models.swin.modeling_swin import SwinRelativePositionBias

    module = SwinRelativePositionBias(N, (2, 3))
    table = torch.randn(window_table_rows((2, 3)), N, dtype=torch.float64)
    with torch.no_grad():
        module.relative_position_bias_table = torch.nn.Parameter(table)
        hf = module()[0].numpy()  # [N, T, T]
    np.testing.assert_array_equal(np.asarray(window_relative_bias(table.numpy(), (2, 3))), hf)


def test_torchref_twin_index_and_regions_match_loops():
    import torchref.windows as twin

    for window in [(2, 3), (3, 2)]:
        for cls_token in (False, True):
            np.testing.assert_array_equal(
                twin.window_relative_index(window, cls_token=cls_token), index_loop(*window, cls_token)
            )
    got = twin.shifted_window_segments((6, 6), (3, 2), (2, 1)).numpy()
    np.testing.assert_array_equal(got, regions_loop(6, 6, 3, 2, 2, 1))


# --- shifted windows ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "grid, window, shift",
    [
        ((6, 6), (3, 2), (2, 1)),
        ((4, 4), (2, 2), 0),
        pytest.param((4, 6), (2, 3), (1, 1), marks=pytest.mark.slow),
        pytest.param((9, 6), (3, 3), (1, 2), marks=pytest.mark.slow),
    ],
)
def test_segments_match_swin_slices(grid, window, shift):
    sh, sw = (shift, shift) if isinstance(shift, int) else shift
    got = shifted_window_segments(grid, window, shift)
    assert got.dtype == jnp.int32 and got.shape == ((grid[0] // window[0]) * (grid[1] // window[1]), np.prod(window))
    np.testing.assert_array_equal(np.asarray(got), regions_loop(*grid, *window, sh, sw))


@pytest.mark.parametrize(
    "grid, window, shift",
    [
        ((6, 9), 3, 1),
        ((10, 5), 5, 0),
        pytest.param((8, 4), 4, 2, marks=pytest.mark.slow),
        pytest.param((4, 6), 2, 1, marks=pytest.mark.slow),
    ],
)
def test_mask_equals_swin_layer_get_attn_mask(grid, window, shift):
    pytest.importorskip("transformers")
    import torch
    from transformers import SwinConfig
    from transformers.models.swin.modeling_swin import SwinLayer

    layer = SwinLayer(SwinConfig(window_size=window, embed_dim=6), 6, grid, 2, shift_size=shift)
    hf = layer.get_attn_mask(*grid, dtype=torch.float64, device="cpu")
    got = np.asarray(shifted_window_mask(grid, window, shift))
    if hf is None:  # shift 0: HF passes no mask; ours allows every pair of a window
        assert shift == 0 and got.all()
        return
    np.testing.assert_array_equal(got, hf.numpy() == 0)  # HF: 0 where allowed, -100 where not
    assert not got.all()


def test_partition_equals_transformers_and_merge_inverts_it():
    pytest.importorskip("transformers")
    import torch
    from transformers.models.swin.modeling_swin import window_partition as hf_partition

    x = np.random.default_rng(0).normal(size=(B, 6, 9, 5))
    got = window_partition(x, 3)  # [B, nW, T, E]
    np.testing.assert_array_equal(np.asarray(got).reshape(-1, 9, 5), hf_partition(torch.tensor(x), 3).view(-1, 9, 5))
    for window in [(2, 3), (3, 1), (6, 9)]:
        np.testing.assert_array_equal(np.asarray(window_merge(window_partition(x, window), window, (6, 9))), x)


# --- window_attention ---------------------------------------------------------------------------------------


def _inputs(window, nW=3, cls_token=False, seed=0):
    T = window[0] * window[1] + cls_token
    return arrays(
        seed, (B, nW, T, N, H), (B, nW, T, K, H), (B, nW, T, K, Hv), (window_table_rows(window, cls_token=cls_token), N)
    )


@pytest.mark.parametrize("window", WINDOWS)
def test_attention_matches_loop(window):
    q, k, v, table = _inputs(window)
    bias = np.asarray(table)[index_loop(*window)].transpose(2, 0, 1)  # [N, T, T]
    out = window_attention(q, k, v, table, window)
    want, _ = attention_loop(q, k, v, bias=bias)
    assert_float64(out)
    assert normwise(out, want) <= 1e-12


@pytest.mark.parametrize(
    "window, cls_token, implementation",
    [((2, 3), False, "dense"), pytest.param((3, 2), True, "blockwise", marks=pytest.mark.slow)],
)
def test_attention_gradients_into_table(window, cls_token, implementation):
    q, k, v, table = _inputs(window, cls_token=cls_token, seed=1)
    index = index_loop(*window, cls_token)
    options = dict(implementation=implementation) | ({"block_size": (2, 3)} if implementation == "blockwise" else {})
    check_forward_and_grads(
        lambda q, k, v, t: window_attention(q, k, v, t, window, cls_token=cls_token, **options),
        lambda q, k, v, t: dense_reference(q, k, v, t, index),
        (q, k, v, table),
        (0, 1, 2, 3),
    )


def test_shifted_windows_as_segments():
    grid, window, shift = (4, 6), (2, 3), (1, 2)
    q, k, v, table = _inputs(window, nW=4, seed=2)
    segments = shifted_window_segments(grid, window, shift)  # [nW, T], broadcast over B
    mask = np.asarray(shifted_window_mask(grid, window, shift))
    out = window_attention(
        q, k, v, table, window, query_segment_ids=segments, key_segment_ids=segments, implementation="blockwise"
    )
    bias = np.asarray(table)[index_loop(*window)].transpose(2, 0, 1)
    want, _ = attention_loop(q, k, v, bias=bias, mask=mask[:, None])
    assert normwise(out, want) <= 1e-12
    check_forward_and_grads(
        lambda q, k, v, t: window_attention(q, k, v, t, window, query_segment_ids=segments, key_segment_ids=segments),
        lambda q, k, v, t: dense_reference(q, k, v, t, index_loop(*window), mask=jnp.asarray(mask)),
        (q, k, v, table),
        (0, 1, 2, 3),
    )


def test_attention_float32():
    q, k, v, table = (x.astype(np.float32) for x in _inputs((3, 3), seed=3))
    out = window_attention(q, k, v, table, 3, precision="highest")
    want, _ = attention_loop(q, k, v, bias=np.asarray(table, np.float64)[index_loop(3, 3)].transpose(2, 0, 1))
    assert out.dtype == jnp.float32 and normwise(out, want) <= 1e-6


# --- bad input ----------------------------------------------------------------------------------------------


def test_bad_input_names_the_argument():
    q, k, v, table = _inputs((2, 3))
    cases = [
        (lambda: window_attention(q, k, v, table, (3, 2, 1)), "window_size"),
        (lambda: window_attention(q, k, v, table, (3, 3)), r"query: expected shape \[2,3,9,5,7\]"),
        (lambda: window_attention(q, k, v, table[:-1], (2, 3)), r"table: expected shape \[15,5\]"),
        (lambda: window_attention(q, k, v, table[:, :3], (2, 3)), r"table: expected shape \[R,5\]"),
        (lambda: window_attention(q, k, v, table, (2, 3), query_positions=np.arange(6)), "query_positions"),
        (lambda: window_attention(q, k, v, table.astype(np.int32), (2, 3)), "table: expected a floating dtype"),
        (lambda: shifted_window_segments((5, 6), (2, 3), 1), "grid_size: expected a height that is a multiple"),
        (lambda: shifted_window_segments((4, 6), (2, 3), (1, 3)), "shift: expected a width shift < the window's 3"),
        (lambda: shifted_window_segments((4, 6), (2, 3), -1), "shift: expected an int >= 0"),
        (lambda: window_partition(np.zeros((4, 7, 5)), 2), r"x: expected a height and width that are multiples"),
        (lambda: window_merge(np.zeros((3, 6, 5)), (2, 3), (4, 6)), r"windows: expected shape \[...,4,6,E\]"),
        (lambda: window_relative_index(0), "window_size: expected an int >= 1"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


# --- the crosscheck cases (transformers' SwinAttention / BeitAttention, torchref.windows) -------------------

# every case in float64 under jit: the slow group (tests/test_window_layer.py runs transformers' SwinAttention with
# the shifted mask in the default group); CI's `python -m crosscheck --all` runs every row
CASES = [
    "hf_swin_attention",
    "hf_swin_attention_shifted",
    "hf_swin_attention_2x3",
    "hf_swin_window_layer",
    "hf_beit_attention",
    "pos_window_2x3",
    "pos_window_3x2_cls_blockwise",
    "pos_window_shifted",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_crosscheck_cases_in_float64(name):
    if name.startswith("hf_"):
        pytest.importorskip("transformers")
    import crosscheck.cases.windows as cases

    assert jax.config.x64_enabled  # float64 rows really are float64 (conftest), and compare() checks dtypes
    report = getattr(cases, name)().compare(dtype="float64", transform="jit", name=name)
    assert report.passed, str(report)
    table = "params/window/table" if name.startswith("hf_") else "params/table"
    assert any(m.kind == "grad" and m.name == table for m in report.metrics), [m.name for m in report.metrics]
