"""The 2D relative position bias (Swin, BEiT): jaxattn.window_attention against torchref.windows and against
transformers' own attention modules with loaded weights.

* ``pos_window_*``: window_attention against its plain torch twin (torchref.windows), grouped-query heads,
  non-square windows, BEiT's cls token, Swin's shifted windows as segment ids, dense and blockwise.
* ``hf_swin_*``: transformers' SwinAttention (projections, ``relative_position_bias_table``, o_proj) on windows
  of a feature map [B * nW, T, E], unshifted, shifted (the mask of SwinLayer.get_attn_mask, -100 added where
  regions differ; ours masks them, a difference of exp(-100) ~ 4e-44 of a weight), and on a non-square window
  (HF's SwinRelativePositionBias takes (Wh, Ww); SwinAttention builds it square, so the case swaps it in).
  ``hf_swin_window_layer``: window_self_attention (the whole W-MSA / SW-MSA on a feature map) against
  SwinLayer's own shift, partition, attention and reverse.
* ``hf_beit_attention``: BeitAttention with BeitRelativePositionBias (the cls token's three extra rows).

One explicit mapping table per module (jaxattn.models.weights rows); torch's gradients map back through it. All
run transformers' "sdpa" path: its eager path softmaxes in float32 by design, which would stop the float64 rows
at float32's precision.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from crosscheck.catalogue import (
    FLOAT32_JIT,
    Const,
    Setup,
    hf_module_setup,
    linear_heads,
    normal,
    randomize,
    register_case,
    rng_for,
)

if TYPE_CHECKING:
    from jaxattn.models.weights import Row

_HF = ("transformers",)  # hf_* cases build HF modules: registered only when transformers is installed

# --- against the twin ----------------------------------------------------------------------------------------

_B, _N, _K, _H, _HV = 2, 6, 2, 7, 5  # grouped-query heads


def _twin(name: str, window, *, cls_token=False, nW=3, segments=None, **options) -> Setup:
    import jaxattn
    import torchref.windows as W

    rng = rng_for(name)
    T = window[0] * window[1] + cls_token
    inputs = {
        "q": normal(rng, (_B, nW, T, _N, _H)),
        "k": normal(rng, (_B, nW, T, _K, _H)),
        "v": normal(rng, (_B, nW, T, _K, _HV)),
    }
    params = {"table": normal(rng, (jaxattn.window_table_rows(window, cls_token=cls_token), _N))}
    if segments is not None:
        inputs["ids"] = Const(segments)

    def regions(ids):  # Swin's shifted windows: query and key share each window's region ids
        return {} if ids is None else {"query_segment_ids": ids, "key_segment_ids": ids}

    def jax_fn(p, q, k, v, ids=None):
        return jaxattn.window_attention(q, k, v, p["table"], window, cls_token=cls_token, **regions(ids), **options)

    def torch_fn(p, q, k, v, ids=None):
        return W.window_attention(q, k, v, p["table"], window, cls_token=cls_token, **regions(ids))

    return Setup(jax_fn, torch_fn, inputs, params=params)


@register_case("pos_window_2x3")
def pos_window_2x3() -> Setup:
    """window_attention, a 2x3 window (T=6), table [15,N], GQA 6/2 heads, vs torchref.windows."""
    return _twin("pos_window_2x3", (2, 3))


@register_case("pos_window_3x2_cls_blockwise")
def pos_window_3x2_cls_blockwise() -> Setup:
    """window_attention with BEiT's cls token (T=7, table [18,N]) through the blockwise engine, tiles 3x4."""
    return _twin("pos_window_3x2_cls_blockwise", (3, 2), cls_token=True, implementation="blockwise", block_size=(3, 4))


@register_case("pos_window_shifted")
def pos_window_shifted() -> Setup:
    """window_attention on shifted 3x2 windows of a 6x4 map (shift (2, 1)): the regions as segment ids."""
    import torchref.windows as W

    ids = W.shifted_window_segments((6, 4), (3, 2), (2, 1)).numpy().astype(np.int32)
    return _twin("pos_window_shifted", (3, 2), nW=4, segments=ids)


# --- against transformers ------------------------------------------------------------------------------------


def _attention_table(prefix: str, table_name: str, key_bias: bool) -> list[Row]:
    """q/k/v/o_proj of SwinAttention / BeitAttention and the bias table, [R, N] as is."""
    from jaxattn.models.weights import Reshape, row

    rows = []
    for hf, ours in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value")):
        rows.append(row(f"{prefix}{hf}.weight", ("N*H", "E"), f"{ours}/kernel", ("E", "N", "H"), linear_heads()))
        if hf != "k_proj" or key_bias:
            rows.append(row(f"{prefix}{hf}.bias", ("N*H",), f"{ours}/bias", ("N", "H"), Reshape()))
    return rows + [
        row(f"{prefix}o_proj.weight", ("E", "N*H"), "out/kernel", ("N", "H", "E"), linear_heads()),
        row(f"{prefix}o_proj.bias", ("E",), "out/bias", ("E",)),
        row(table_name, ("R", "N"), "window/table", ("R", "N")),
    ]


def _jax_window_layer(p, x, window, nW, *, cls_token=False, ids=None):
    """x [B * nW, T, E] -> project, window_attention (one bias for every window), out: [B * nW, T, E]."""
    import jaxattn

    windows = x.reshape(-1, nW, *x.shape[-2:])  # [B, nW, T, E]: the segment ids [nW, T] broadcast over B
    q, k, v = jaxattn.project_qkv(p, windows, precision="highest")
    segments = {} if ids is None else {"query_segment_ids": ids, "key_segment_ids": ids}
    z = jaxattn.window_attention(
        q, k, v, p["window"]["table"], window, cls_token=cls_token, precision="highest", **segments
    )
    return jaxattn.project_out(p, z, precision="highest").reshape(x.shape)


def _swin(name: str, *, window, grid, shift=0) -> Setup:
    import torch
    from transformers import SwinConfig
    from transformers.models.swin.modeling_swin import SwinAttention, SwinLayer, SwinRelativePositionBias

    import jaxattn

    B, E, N = 2, 10, 2
    config = SwinConfig(embed_dim=E, num_heads=[N], window_size=max(window), qkv_bias=True)
    config._attn_implementation = "sdpa"
    module = SwinAttention(config, E, N, window_size=max(window))
    if window[0] != window[1]:  # HF's bias module takes (Wh, Ww); SwinAttention only builds it square
        module.relative_position_bias = SwinRelativePositionBias(N, window)
    rng = rng_for(name)
    module = randomize(module, rng).eval()
    T = window[0] * window[1]
    nW = (grid[0] // window[0]) * (grid[1] // window[1])
    inputs = {"x": normal(rng, (B * nW, T, E))}
    layer = None
    if shift:
        layer = SwinLayer(config, E, grid, N, shift_size=shift)
        ids = jaxattn.shifted_window_segments(grid, window, shift)
        inputs["ids"] = Const(np.asarray(ids))

    def jax_fn(p, x, ids=None):
        return _jax_window_layer(p, x, window, nW, ids=ids)

    def torch_fn(p, x, ids=None):
        mask = None if layer is None else layer.get_attn_mask(*grid, dtype=x.dtype, device=torch.device("cpu"))
        return torch.func.functional_call(module, p, (x,), {"attention_mask": mask})[0]

    R = jaxattn.window_table_rows(window)
    table = _attention_table("", "relative_position_bias.relative_position_bias_table", key_bias=True)
    return hf_module_setup(
        module, table, dict(E=E, N=N, H=E // N, R=R), jax_fn, torch_fn, inputs, fixed=("k_proj.bias",)
    )


@register_case("hf_swin_attention", requires=_HF, quick=FLOAT32_JIT, default_run=True)
def hf_swin_attention() -> Setup:
    """HF SwinAttention, 3x3 windows of a 6x9 map (nW=6), qkv biases, relative_position_bias_table [25,N]."""
    return _swin("hf_swin_attention", window=(3, 3), grid=(6, 9))


@register_case("hf_swin_attention_shifted", requires=_HF, quick=FLOAT32_JIT)
def hf_swin_attention_shifted() -> Setup:
    """HF SwinAttention with SwinLayer.get_attn_mask (shift 1 of 3x3 windows, 6x9 map) vs segment ids."""
    return _swin("hf_swin_attention_shifted", window=(3, 3), grid=(6, 9), shift=1)


@register_case("hf_swin_attention_2x3", requires=_HF, quick=FLOAT32_JIT)
def hf_swin_attention_2x3() -> Setup:
    """HF SwinAttention with a non-square SwinRelativePositionBias((2, 3)) (table [15,N]), windows of a 4x6 map."""
    return _swin("hf_swin_attention_2x3", window=(2, 3), grid=(4, 6))


@register_case("hf_swin_window_layer", requires=_HF, quick=FLOAT32_JIT)
def hf_swin_window_layer() -> Setup:
    """window_self_attention on a 6x9 map (3x3 windows, shift 1) vs SwinLayer's cyclic_shift, window_partition,
    SwinAttention with get_attn_mask, window_reverse and the shift back."""
    import torch
    from transformers import SwinConfig
    from transformers.models.swin.modeling_swin import SwinLayer, window_partition, window_reverse

    import jaxattn

    B, E, N, ws, shift, grid = 2, 10, 2, 3, 1, (6, 9)
    config = SwinConfig(embed_dim=E, num_heads=[N], window_size=ws)
    config._attn_implementation = "sdpa"
    layer = SwinLayer(config, E, grid, N, shift_size=shift)
    rng = rng_for("hf_swin_window_layer")
    module = randomize(layer.attention, rng).eval()

    def jax_fn(p, x):
        return jaxattn.window_self_attention(p, x, ws, shift=shift, precision="highest")

    def torch_fn(p, x):
        windows = window_partition(layer.cyclic_shift(x), ws).view(-1, ws * ws, E)
        mask = layer.get_attn_mask(*grid, dtype=x.dtype, device=torch.device("cpu"))
        out = torch.func.functional_call(module, p, (windows,), {"attention_mask": mask})[0]
        return layer.cyclic_shift(window_reverse(out.view(-1, ws, ws, E), ws, *grid), reverse=True)

    R = jaxattn.window_table_rows(ws)
    table = _attention_table("", "relative_position_bias.relative_position_bias_table", key_bias=True)
    inputs = {"x": normal(rng, (B, *grid, E))}
    return hf_module_setup(
        module, table, dict(E=E, N=N, H=E // N, R=R), jax_fn, torch_fn, inputs, fixed=("k_proj.bias",)
    )


@register_case("hf_beit_attention", requires=_HF, quick=FLOAT32_JIT)
def hf_beit_attention() -> Setup:
    """HF BeitAttention + BeitRelativePositionBias: a 3x3 patch grid plus the cls token (T=10, table [28,N])."""
    import torch
    from transformers import BeitConfig
    from transformers.models.beit.modeling_beit import BeitAttention, BeitRelativePositionBias

    # A square grid: BeitRelativePositionBias.forward views the table as [2Ww-1, 2Wh-1] and resizes it
    # (bilinear) to [2Wh-1, 2Ww-1], the identity only when Wh == Ww; a non-square grid gets a resampled table.
    B, E, N, window = 2, 12, 4, (3, 3)
    config = BeitConfig(hidden_size=E, num_attention_heads=N, image_size=6, patch_size=2)
    config._attn_implementation = "sdpa"

    class Block(torch.nn.Module):  # the two modules BeitLayer calls, without its norms and MLP
        def __init__(self):
            super().__init__()
            self.attention = BeitAttention(config)
            self.relative_position_bias = BeitRelativePositionBias(config)

        def forward(self, x):
            bias = self.relative_position_bias(window, dim_size=x.shape[1])
            return self.attention(x, attention_mask=bias)[0]

    rng = rng_for("hf_beit_attention")
    module = randomize(Block(), rng).eval()
    T = window[0] * window[1] + 1

    def jax_fn(p, x):
        return _jax_window_layer(p, x, window, 1, cls_token=True)

    def torch_fn(p, x):
        return torch.func.functional_call(module, p, (x,))

    import jaxattn

    R = jaxattn.window_table_rows(window, cls_token=True)
    table = _attention_table("attention.", "relative_position_bias.relative_position_bias_table", key_bias=False)
    return hf_module_setup(
        module, table, dict(E=E, N=N, H=E // N, R=R), jax_fn, torch_fn, {"x": normal(rng, (B, T, E))}
    )


def cases() -> list[str]:
    """The names this module registers (in catalogue order)."""
    from crosscheck.catalogue import CASES

    return [name for name, case in CASES.items() if case.build.__module__ == __name__]
