"""Shaw's key table on the GPU kernel's windowed route (windows_gpu, issue 51 item 1): Transformer-XL over its
whole span (max_left = S - 1, 2S - 1 table rows), which the band route (tables_gpu.MAX_COLUMNS) refuses, and a
clipped Shaw table forced onto the route by lowering the band route's limit (and its table's gradient taken in
16-column chunks of the window, windows_gpu.WINDOW_CHUNK; the XL cases take the window whole).

Interpret mode (Pallas' interpreter on this CPU), float32: outputs <= 1e-6 against the float64 loop of the
formula (test_positions.xl_loop for Transformer-XL, helpers.attention_loop with A^K at shaw_index_loop's rows
for Shaw), gradients of q, k, v, the table (and XL's u, v biases) <= 1e-5 against the dense engine in float64,
normwise. Every axis its own size, T != S both ways, lengths that are whole tiles and ragged ones, tiles
Tb != Sb both ways (windows of 23 and 31 columns, padded to 32), causal and not, per-head and shared tables;
under vmap, jit and vjp, and bf16 inputs within test_kernel_shaw's envelope.
The interpreter runs a program's steps in order and skips the barriers: what it checks is the arithmetic of
the window, the skew and its inverse, and the atomic adds' sums (the module docstring of windows_gpu says
what ordering the GPU relies on).

Lowered for CUDA at T = S = 4096 bf16 with max_left = S - 1: implementation=None takes the kernels (Triton
calls, forward and forward+backward, no [T,S] value, no XLA tile loop); before the windowed route it took the
XLA engines.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kernel_shaw import BF16_TOLERANCES
from test_positions import N as XL_HEADS, xl_loop

import jaxattn
from helpers import assert_float64, attention_loop, normwise, shaw_index_loop, value_and_vjp
from jaxattn._core.call import AttentionCall
from jaxattn._kernels import flash_gpu, tables_gpu, windows_gpu
from jaxattn._kernels.flash import plan
from jaxattn._kernels.flash.sizes import WINDOW_TABLE_ELEMENTS, next_power_of_two, window_tiles

OUT_TOL, GRAD_TOL = 1e-6, 1e-5


@pytest.fixture
def hooks_seen(monkeypatch):
    """The windowed route's hook builders each kernel called (forward, dq, dk/dv): the route was taken."""
    seen = []
    for name in ("forward_hooks", "dq_hooks", "dkv_hooks"):
        build = getattr(windows_gpu, name)
        monkeypatch.setattr(windows_gpu, name, lambda *a, build=build, name=name: (seen.append(name), build(*a))[1])
    return seen


# name: (B, T, S, K, H, Hv, block_size, per-head table, is_causal); N = test_positions.N (xl_loop's heads)
XL_CASES = {
    # T < S, ragged (19 and 37 in 16-wide tiles), grouped-query heads, causal
    "causal T<S ragged": (2, 19, 37, 3, 5, 7, None, True, True),
    # T > S, tiles 8 x 16 (a window of 23 columns), shared table, not causal
    "T>S 8x16 shared": (1, 41, 29, 2, 3, 5, (8, 16), False, False),
    # whole tiles both ways (32 = 2 x 16, 48 = 3 x 16), tiles 16 x 16, causal, per head
    "whole tiles": (1, 32, 48, 6, 4, 3, None, True, True),
    # tiles 16 x 8 (23 columns) with T = S, ragged, not causal
    "T=S 16x8": (2, 23, 23, 3, 3, 2, (16, 8), True, False),
}


@pytest.mark.parametrize("name", list(XL_CASES))
def test_transformer_xl_over_its_whole_span(name, hooks_seen):
    B, T, S, K, H, Hv, block, per_head, is_causal = XL_CASES[name]
    N, max_left = XL_HEADS, S - 1
    R = max_left + 4  # max_right 3: rows past the causal diagonal too
    rng = np.random.default_rng(7)
    q, k, v, w = (
        rng.normal(size=s).astype(np.float32) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv), (B, T, N, Hv))
    )
    P = rng.normal(size=(R, N, H) if per_head else (R, H)).astype(np.float32)
    u, vb = rng.normal(size=(N, H)).astype(np.float32), rng.normal(size=(N, H)).astype(np.float32)

    def f(q, k, v, P, u, vb, **kw):
        return jaxattn.transformer_xl_attention(
            q, k, v, P, max_left=max_left, pos_bias_u=u, pos_bias_v=vb, is_causal=is_causal, **kw
        )

    # the band route's limit below this call's band (T + S - 1 rows): the call is the windowed route's
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tables_gpu, "MAX_COLUMNS", 16)
        args = (q, k, v, P, u, vb)
        out, grads = value_and_vjp(
            lambda *a: f(*a, implementation="pallas_gpu", interpret=True, block_size=block), args, w
        )
    assert sorted(set(hooks_seen)) == ["dkv_hooks", "dq_hooks", "forward_hooks"], hooks_seen
    keys = np.asarray(P, np.float64) if per_head else np.broadcast_to(np.asarray(P, np.float64)[:, None], (R, N, H))
    want = xl_loop(q, k, v, keys, u, vb, max_left, is_causal)
    assert normwise(out, want) <= OUT_TOL, normwise(out, want)
    dense_out, dense_grads = value_and_vjp(
        lambda *a: f(*a, implementation="dense"), [np.asarray(x, np.float64) for x in args], w
    )
    assert_float64(dense_out, *dense_grads)
    for got, ref, what in zip(grads, dense_grads, ("q", "k", "v", "P", "u", "v bias"), strict=True):
        assert got.dtype == jnp.float32, what
        assert normwise(got, ref) <= GRAD_TOL, (what, normwise(got, ref))


# name: (B, T, S, N, K, H, Hv, max_distance, block_size, per-head table, is_causal)
SHAW_CASES = {
    # max_distance 5 < a tile: far tiles wholly past the clip (one table row: the one-row adds), near ones mixed
    "clipped causal": (2, 29, 43, 4, 2, 5, 3, 5, None, True, True),
    # max_distance 11, tiles 8 x 16, shared table, T > S, not causal
    "clipped 8x16 shared": (1, 37, 23, 4, 1, 3, 5, 11, (8, 16), False, False),
}


@pytest.mark.parametrize("name", list(SHAW_CASES))
def test_clipped_shaw_table_on_the_windowed_route(name, hooks_seen):
    B, T, S, N, K, H, Hv, m, block, per_head, is_causal = SHAW_CASES[name]
    rng = np.random.default_rng(3)
    q, k, v, w = (
        rng.normal(size=s).astype(np.float32) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv), (B, T, N, Hv))
    )
    table = rng.normal(size=(2 * m + 1, N, H) if per_head else (2 * m + 1, H)).astype(np.float32)

    def f(q, k, v, table, **kw):
        return jaxattn.shaw_relative_attention(q, k, v, table, max_distance=m, is_causal=is_causal, **kw)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tables_gpu, "MAX_COLUMNS", 8)  # below the band's 2m + 1 rows: the windowed route
        patch.setattr(windows_gpu, "WINDOW_CHUNK", 1)  # the dq kernel's table gradient in 16-column chunks
        assert plan.windowed_tables(AttentionCall(key_table=table, max_distance=m), T, S)
        args = (q, k, v, table)
        out, grads = value_and_vjp(
            lambda *a: f(*a, implementation="pallas_gpu", interpret=True, block_size=block), args, w
        )
    assert sorted(set(hooks_seen)) == ["dkv_hooks", "dq_hooks", "forward_hooks"], hooks_seen
    index = shaw_index_loop(T, S, m)
    rel_key = np.asarray(table, np.float64)[index]
    if not per_head:
        rel_key = np.broadcast_to(rel_key[..., None, :], (T, S, N, H))
    want, _ = attention_loop(q, k, v, rel_key=rel_key, is_causal=is_causal)
    assert normwise(out, want) <= OUT_TOL, normwise(out, want)
    _, dense_grads = value_and_vjp(
        lambda *a: f(*a, implementation="dense"), [np.asarray(x, np.float64) for x in args], w
    )
    for got, ref, what in zip(grads, dense_grads, ("q", "k", "v", "key_table"), strict=True):
        assert normwise(got, ref) <= GRAD_TOL, (what, normwise(got, ref))


def _xl_inputs(seed, shapes, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return tuple(rng.normal(size=shape).astype(dtype) for shape in shapes)


def test_transformer_xl_whole_span_under_vmap_and_in_bf16(hooks_seen):
    """vmap over an axis the kernel does not see (inside jit and vjp; the table's gradient summed over it), and
    bf16 inputs (the position keys float32) within the contract's bf16 envelope (test_kernel_shaw's), both
    against the dense engine in float64 on the same numbers."""
    V, T, S, N, K, H, Hv = 3, 19, 37, 4, 2, 5, 7
    q, k, v, w = _xl_inputs(1, ((V, T, N, H), (V, S, K, H), (V, S, K, Hv), (V, T, N, Hv)))
    (P,) = _xl_inputs(2, ((S, N, H),))

    def vmapped(implementation, **kw):
        def f(q, k, v, P):
            def one(q, k, v):
                return jaxattn.transformer_xl_attention(
                    q[None], k[None], v[None], P, max_left=S - 1, is_causal=True, implementation=implementation, **kw
                )[0]

            return jax.vmap(one)(q, k, v)

        return f

    args = (q, k, v, P)
    want, want_grads = value_and_vjp(vmapped("dense"), [np.asarray(x, np.float64) for x in args], w)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tables_gpu, "MAX_COLUMNS", 16)
        got, got_grads = value_and_vjp(vmapped("pallas_gpu", interpret=True), args, w)
        half = (*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), P)
        got_half, got_half_grads = value_and_vjp(vmapped("pallas_gpu", interpret=True), half, w)
    assert sorted(set(hooks_seen)) == ["dkv_hooks", "dq_hooks", "forward_hooks"], hooks_seen
    assert normwise(got, want) <= OUT_TOL
    for g, e in zip(got_grads, want_grads, strict=True):
        assert normwise(g, e) <= GRAD_TOL
    assert got_half.dtype == jnp.bfloat16
    rounded = [np.asarray(x, np.float64) for x in half]
    want, want_grads = value_and_vjp(vmapped("dense"), rounded, w)
    assert normwise(got_half, want) <= BF16_TOLERANCES[0], normwise(got_half, want)
    for g, e in zip(got_half_grads, want_grads, strict=True):
        assert normwise(g, e) <= BF16_TOLERANCES[1], normwise(g, e)


def test_the_clipped_case_has_one_row_tiles_and_mixed_ones():
    """What the default Shaw case covers: tiles (16 x 16) whose window lies wholly past the clip distance
    (windows_gpu._table_grads' one-row adds) and tiles whose window spans several rows."""
    _, T, S, _, _, _, _, m, _, _, _ = SHAW_CASES["clipped causal"]
    w = windows_gpu.Window(16, 16, m, S - T, True)
    Tn, Sn = -(-T // 16), -(-S // 16)
    d0 = np.array([[w.first_offset(i, j) for j in range(Sn)] for i in range(Tn)])
    one_row = (d0 >= m) | (d0 + w.W - 1 <= -m)
    assert one_row.any() and (~one_row).any(), d0


def test_which_calls_take_the_windowed_route():
    """A key table alone with the default positions, whose band the per-row route refuses; a value table or
    positions of their own keep the band route's answer (its refusal, naming max_distance)."""
    q = k = v = jnp.zeros((1, 300, 2, 4), jnp.float32)
    m = 299
    wide = dict(key_table=jnp.zeros((2 * m + 1, 4)), max_distance=m)  # 599 rows within reach: within MAX_COLUMNS
    assert not plan.windowed_tables(AttentionCall(**wide), 300, 300)
    q = k = v = jnp.zeros((1, 4096, 2, 4), jnp.float32)
    m = 4095
    wide = dict(key_table=jnp.zeros((2 * m + 1, 4)), max_distance=m)
    assert plan.windowed_tables(AttentionCall(**wide), 4096, 4096)
    assert flash_gpu.unsupported(AttentionCall(**wide), q, k, v) is None
    for other in (dict(value_table=jnp.zeros((2 * m + 1, 4))), dict(query_positions=jnp.arange(4096))):
        call = AttentionCall(**wide, **other)
        assert not plan.windowed_tables(call, 4096, 4096)
        assert flash_gpu.unsupported(call, q, k, v).startswith("max_distance")


def test_window_tiles_fit_the_bound():
    """flash.sizes.window_tiles on a GPU: a window of next_power_of_two(Tb + Sb - 1) rows of Hp features within
    WINDOW_TABLE_ELEMENTS (the A100's shared memory, and no register spills measured, at Transformer-XL's head
    dims 64 and 128), the larger tile halved (the keys' when equal), never below 16."""
    assert window_tiles(64, 32, 128) == (32, 32)  # bf16, XL at head dim 64 (Hp = 128 after shaw_form)
    assert window_tiles(32, 64, 256) == (16, 16)  # bf16, XL at head dim 128
    assert window_tiles(16, 32, 128) == (16, 32)  # within the bound already
    assert window_tiles(16, 16, 512) == (16, 16)  # nothing smaller to take
    for Tb, Sb, Hp in ((128, 64, 128), (64, 64, 256), (16, 64, 256), (128, 128, 64)):
        tb, sb = window_tiles(Tb, Sb, Hp)
        assert next_power_of_two(tb + sb - 1) * Hp <= WINDOW_TABLE_ELEMENTS and min(tb, sb) >= 16


T_LONG = 4096
TRITON = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("program", ["forward+backward", pytest.param("forward", marks=pytest.mark.slow)])
def test_transformer_xl_whole_span_lowered_for_cuda_is_the_kernel(program):
    """implementation=None, bf16, T = S = 4096, max_left = S - 1 (8191 table rows): the Triton kernels, no XLA
    tile loop, no [T,S] value."""
    N, H = 8, 64
    q = jax.ShapeDtypeStruct((1, T_LONG, N, H), jnp.bfloat16)
    P = jax.ShapeDtypeStruct((T_LONG, N, H), jnp.float32)

    def forward(q, P):
        return jaxattn.transformer_xl_attention(q, q, q, P, max_left=T_LONG - 1, is_causal=True)

    fn = forward if program == "forward" else jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32)), (0, 1))
    with jax.enable_x64(False), jaxattn.cross_platform_lowering():
        text = jax.jit(fn).trace(q, P).lower(lowering_platforms=("cuda",)).as_text()
    kernels = set(re.findall(r'name = "(jaxattn_flash_\w+)"', text))
    want = {"jaxattn_flash_forward"} | ({"jaxattn_flash_dq", "jaxattn_flash_dkv"} if program != "forward" else set())
    assert TRITON in text and kernels == want, kernels
    assert "stablehlo.while" not in text, "an XLA tile loop"
    assert not re.search(rf"[<x]{T_LONG}x{T_LONG}x(f32|bf16|f16|i1|i32)>", text), "a [T,S] buffer"
    # the CTA barriers around the scratch block (windows_gpu), which the interpreter skips: in the Triton IR
    assert "barrier" in text, "no barrier between the scratch block's store and its reads"
    # and no software pipelining, which could issue a scratch read ahead of its store
    assert set(re.findall(r"num_stages = (\d+)", text)) == {"1"}
