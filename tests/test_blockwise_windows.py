"""Row groups under jax.grad (blockwise_attention's lax.map over batch entries x key/value heads): no tile's
Shaw term is computed outside the tile loops, so nothing spans (query tiles x key tiles) of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

import jaxattn
from helpers import grad_of_sum

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
    that was every tile's bucket index, [T/Tb, S/Sb, Tb, Sb] int32 (64 MiB); now the key loop is a while
    loop (schedule.visit). XLA temp: 95 -> 26 MiB."""

    def fn(q, k, v, table):
        return jaxattn.shaw_relative_attention(q, k, v, table, max_distance=16, implementation="blockwise")

    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(1, L, HEADS, DIM)] * 3 + [(33, DIM)]]
    shapes = array_shapes(grad_of_sum(fn, tuple(range(4))), *args)
    too_large = sorted({s for s in shapes if np.prod(s, dtype=np.int64) > L * HEADS * DIM})
    assert not too_large, too_large
