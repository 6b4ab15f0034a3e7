"""Shaw tables on the CPU blockwise engine's windowed tiles (issue 51 item 1): with the default positions a
tile of Tb queries and Sb keys reads only the W = Tb + Sb - 1 offsets between them, so it takes its key term
(and a value table's) from those W table rows, never q . table[r] for all R = 2m + 1 rows
(jaxattn/_engines/blockwise/buckets.py). Transformer-XL over its whole span (max_left = S - 1) is the case
that needs it: R = 2S - 1 rows in Shaw form.

Correctness in float64, every gradient: Transformer-XL against its formula over the full grid
(helpers.attention_reference with (q + u) as the query and (q + v) . P[clip(j - i)] as relative logits), and
Shaw key and value tables against the dense engine and helpers.attention_loop. Sizes: B 2, N 6, K 3, H 5,
Hv 7; T, S in {13, 19, 23, 29}; tiles 4 x 3 (W = 6 < R), so padding past T and S, tiles wholly past the clip
distance and tiles across it.

Memory at T = S = 4096, max_left = 4095 (R = 8191 Shaw rows), forward+backward: no array of the traced
program holds more elements than the largest O(T) one (the [2T - 1, 2H] table, the [T, N, 2H] queries); the
per-bucket path held [Tb, R] products and bucket sums (Tb = 512 times the table's rows), and XLA's compiled
temp bytes (slow group) stay under 20 [T, N, 2H] float32 arrays.

Row groups under jax.grad (any Shaw table, not causal): no tile's term computed outside the tile loops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import ClosedJaxpr, Jaxpr
from test_relative_blockwise import clipped_rows

import jaxattn
from helpers import (
    allowed_loop,
    arrays,
    attention_loop,
    attention_reference,
    check_forward_and_grads,
    grad_of_sum,
    normwise,
    shaw_index_loop,
    temp_bytes,
)

B, N, K, H, Hv = 2, 6, 3, 5, 7
TILE = (4, 3)  # W = 6 offsets per tile
L, HEADS, DIM = 4096, 2, 64  # the memory checks: T = S = L, N = K = HEADS, H = DIM, float32

# --- row groups under jax.grad: nothing per (query tile, key tile) outside the tile loops ---------------------


def array_shapes(fn, *args):
    """The shape of every value fn's traced program computes (every sub-program: loops, custom VJPs, calls)."""
    shapes = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            shapes.extend(tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape"))
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                        walk(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return shapes


def test_grouped_gradient_computes_no_tile_term_outside_the_loops():
    """Forward+backward of clipped Shaw tables on row groups (N = K = 2), not causal, T = S = 4096, traced only:
    no array past the queries' [T, N, H]. Under jax.grad of the groups' lax.map, JAX moves what a scan body
    computes from the map's loop invariants alone out of the map; with the key tiles a static-length scan,
    that was every tile's bucket index, [T/Tb, S/Sb, Tb, Sb] int32 (64 MiB; on windowed tiles, a shared
    table's window rows); now the key loop is a while loop (schedule.visit). XLA temp: 95 -> 26 MiB."""

    def fn(q, k, v, table):
        return jaxattn.shaw_relative_attention(q, k, v, table, max_distance=16, implementation="blockwise")

    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(1, L, HEADS, DIM)] * 3 + [(33, DIM)]]
    shapes = array_shapes(grad_of_sum(fn, tuple(range(4))), *args)
    too_large = sorted({s for s in shapes if np.prod(s, dtype=np.int64) > L * HEADS * DIM})
    assert not too_large, too_large


# --- Transformer-XL and Shaw tables on windowed tiles, float64 ------------------------------------------------

# name: (T, S, max_left, max_right, per-head P, is_causal)
XL_CASES = {
    "whole span causal T<S": (19, 23, 22, 0, True, True),  # the paper's klen rows: R = S
    "whole span both ways T>S shared": (29, 13, 12, 12, False, False),  # R = 2S - 1, queries before key 0
    "clipped T<S": (13, 23, 7, 2, True, False),  # tiles past the clip on the left, across it, past it right
}


def xl_reference(T, S, max_left, max_right, is_causal):
    """Transformer-XL in float64 over the full grid: scale * ((q + u) . k + (q + w) . P[index]) (xl.py's module
    docstring), index = clip(j - i, -max_left, max_right) + max_left at the default positions."""
    rows = clipped_rows(T, S, max_left, max_right)  # [T,S]
    allowed = allowed_loop(B, N, T, S, is_causal=is_causal)

    def reference(q, k, v, P, u, w):
        keys = P if P.ndim == 3 else jnp.broadcast_to(P[:, None], (P.shape[0], N, H))
        rel = jnp.einsum("btnh,tsnh->bnts", q + w, keys[rows], precision="highest")
        return attention_reference(q + u, k, v, allowed, rel_logits=rel)

    return reference


@pytest.mark.parametrize("name", list(XL_CASES))
def test_transformer_xl_on_windowed_tiles_equals_the_formula(name):
    T, S, max_left, max_right, per_head, is_causal = XL_CASES[name]
    R = max_left + max_right + 1
    args = arrays(5, (B, T, N, H), (B, S, K, H), (B, S, K, Hv), (R, N, H) if per_head else (R, H), (N, H), (N, H))

    def ours(q, k, v, P, u, w):
        return jaxattn.transformer_xl_attention(
            q, k, v, P, max_left=max_left, pos_bias_u=u, pos_bias_v=w, is_causal=is_causal,
            implementation="blockwise", block_size=TILE,
        )  # fmt: skip

    # the route: no per-bucket array (Shaw form's R = 2 max(max_left, max_right) + 1 > W = 6)
    assert not bucket_shaped(ours, args, TILE[0], 2 * max(max_left, max_right) + 1)
    check_forward_and_grads(ours, xl_reference(T, S, max_left, max_right, is_causal), args, tuple(range(6)))


def bucket_shaped(fn, args, Tb, R):
    """The shapes of fn's forward+backward arrays that are a tile's per-bucket products or sums ([..., Tb, R],
    or the R - 2 interior buckets) or that span R after more than one other axis."""
    grads = grad_of_sum(fn, tuple(range(len(args))))
    shapes = array_shapes(grads, *args)
    return sorted({s for s in shapes if s[-2:] in ((Tb, R), (Tb, R - 2)) or (R in s[2:] and len(s) > 3)})


# name: (T, S, max_distance, is_causal, key lengths)
SHAW_CASES = {
    "causal": (19, 23, 5, True, None),
    "lengths T>S": (29, 13, 5, False, np.array([13, 8])),  # a masked key tile, a wholly padded one
}


@pytest.mark.parametrize("name", list(SHAW_CASES))
def test_shaw_key_and_value_tables_on_windowed_tiles(name):
    """Per-head key table, shared value table: out += (window sums of p) @ value rows on each tile, and the
    tables' gradients added onto the window's rows (clipped columns share a row)."""
    T, S, m, is_causal, lengths = SHAW_CASES[name]
    R = 2 * m + 1
    args = arrays(6, (B, T, N, H), (B, S, K, H), (B, S, K, Hv), (R, N, H), (R, Hv))
    options = dict(max_distance=m, is_causal=is_causal, key_value_seq_lengths=lengths)

    def attend(implementation, **kw):
        return lambda q, k, v, tk, tv: jaxattn.shaw_relative_attention(
            q, k, v, tk, tv, implementation=implementation, **options, **kw
        )

    ours = attend("blockwise", block_size=TILE)
    assert not bucket_shaped(ours, args, TILE[0], R)
    index = shaw_index_loop(T, S, m)
    rel_key, rel_value = (
        np.asarray(args[3])[index],
        np.broadcast_to(np.asarray(args[4])[index][:, :, None], (T, S, N, Hv)),
    )
    want, _ = attention_loop(
        *args[:3], rel_key=rel_key, rel_value=rel_value, is_causal=is_causal, key_value_seq_lengths=lengths
    )
    assert normwise(jax.jit(ours)(*args), want) <= 1e-12
    check_forward_and_grads(ours, attend("dense"), args, tuple(range(5)))


# --- memory at T = S = 4096, Transformer-XL over its whole span -------------------------------------------------


def _xl_long(is_causal):
    def fn(q, k, v, P, u, w):
        return jaxattn.transformer_xl_attention(
            q, k, v, P, max_left=L - 1, pos_bias_u=u, pos_bias_v=w, is_causal=is_causal, implementation="blockwise"
        )

    R = L if is_causal else 2 * L - 1  # P's rows: the paper's klen causal, every j - i both ways
    shapes = [(1, L, HEADS, DIM)] * 3 + [(R, DIM), (HEADS, DIM), (HEADS, DIM)]
    return fn, shapes


@pytest.mark.parametrize("is_causal", [True, False])
def test_transformer_xl_whole_span_holds_no_array_past_its_inputs(is_causal):
    """Forward+backward, traced only: every array holds at most as many elements as the largest O(T) one, the
    [T, N, 2H] queries of Shaw form or its [2T - 1, 2H] table, so nothing spans [Tb, R] (4.2M elements per
    [512, 8191] tile row on the per-bucket path, against the table's 1.0M)."""
    fn, shapes = _xl_long(is_causal)
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes]
    largest = max(L * HEADS * 2 * DIM, (2 * L - 1) * 2 * DIM)
    shapes = array_shapes(grad_of_sum(fn, tuple(range(6))), *args)
    too_large = sorted({s for s in shapes if np.prod(s, dtype=np.int64) > largest})
    assert not too_large, too_large


@pytest.mark.slow  # compiles two 4096 programs (~10 s); the traced check above covers the same arrays
@pytest.mark.parametrize("is_causal", [True, False])
def test_transformer_xl_whole_span_temp_memory(is_causal):
    """XLA's temp bytes, forward+backward, under 20 [T, N, 2H] float32 arrays (80 MiB): the engine's O(T) arrays
    (the queries and keys in Shaw form and their gradients, the table and its gradient, their layouts) and a few
    tiles. Measured (x64 on, as the suite runs) 64 MiB causal, 61 MiB not; the per-bucket path took 140 / 160 MiB."""
    fn, shapes = _xl_long(is_causal)
    unit = L * HEADS * 2 * DIM * 4
    assert temp_bytes(grad_of_sum(fn, tuple(range(6))), *shapes) <= 20 * unit
