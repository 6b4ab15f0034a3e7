"""Programmable attention terms (docs/design.md, "Keywords"), each named once and shared by every engine.

    x = scale * (q . k + relative key terms)
    x = logit_softcap * tanh(x / logit_softcap)                      logit_softcap (Gemma 2)
    x = x + bias + position bias
    x = score_mod(x, b, n, t, s)                                     flex_attention
    allowed = mask & causal & lengths & segments & window & chunks & mask_mod(b, n, t, s)
    p = softmax over the allowed keys and one sink logit sinks[n] with no value     sinks (gpt-oss)

b is the index into the flattened leading batch dims, n the query head, t and s ABSOLUTE query and key
positions (the same ones the causal mask reads). The position rules (segments, window, chunks) live with
the causal rule in masks.py; this module checks the keywords and owns the element functions: score_mod and
mask_mod are traced once on scalars (`element_function`), every array they close over becomes an explicit
input (so gradients reach a learned table through any engine, custom VJPs included), and `on_grid`
evaluates them elementwise over a [B,N,T,S] grid or one [B,N,Tb,Sb] tile, as torch's flex_attention does.
"""

from __future__ import annotations

import numbers
from typing import Callable, NamedTuple, Optional

import jax
import jax.core  # jax.core.Tracer, eval_jaxpr: a submodule, imported by name so that type checkers see it
import jax.numpy as jnp
import numpy as np

from . import checks
from .placement import split_as_dim

# ---------------------------------------------------------------------------------------------------
# Keyword checks (trace time; shapes are static).


def check_window(window) -> Optional[tuple]:
    """window=(left, right): key s allowed iff t - left <= s <= t + right; None on a side = unbounded."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        checks.fail("window", "a pair (left, right) of ints >= 0 or None", repr(window))
    for side in window:
        if side is not None and (isinstance(side, bool) or not isinstance(side, numbers.Integral) or side < 0):
            checks.fail("window", "a pair (left, right) of ints >= 0 or None (no negative sizes)", repr(window))
    left, right = (None if side is None else int(side) for side in window)
    return None if left is None and right is None else (left, right)


def check_chunk_size(chunk_size) -> Optional[int]:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, numbers.Integral) or chunk_size <= 0:
        checks.fail("chunk_size", "a Python int > 0", repr(chunk_size))
    return int(chunk_size)


def check_softcap(logit_softcap) -> Optional[float]:
    if logit_softcap is None:
        return None
    if isinstance(logit_softcap, bool) or not isinstance(logit_softcap, numbers.Real) or not logit_softcap > 0:
        checks.fail("logit_softcap", "a Python float > 0", repr(logit_softcap))
    return float(logit_softcap)


def check_segment_ids(query_segment_ids, key_segment_ids, batch, T: int, S: int):
    """(query [...,T], key [...,S]) int32 arrays broadcastable to the batch dims, or (None, None)."""
    if query_segment_ids is None and key_segment_ids is None:
        return None, None
    given = (("query_segment_ids", query_segment_ids, T, "[...,T]"), ("key_segment_ids", key_segment_ids, S, "[...,S]"))
    for (name, x, _, layout), (other, *_) in zip(given, given[::-1]):
        if x is None:
            checks.fail(name, f"an int array {layout} given together with {other}", None)
    out = []
    for name, x, length, layout in given:
        x = jnp.asarray(x)
        checks.check_int(name, x)
        checks.check_min_rank(name, x, 1, layout)
        checks.check_broadcastable(name, x, (*batch, length), f"{layout} with the batch dims of query/key/value")
        out.append(x.astype(jnp.int32))
    return tuple(out)


def check_sinks(sinks, batch, N: int, acc_dtype):
    """sinks [N] or [...,N] (float, fits the compute dtype) broadcastable to [*batch, N], or None."""
    if sinks is None:
        return None
    sinks = jnp.asarray(sinks)
    checks.check_float("sinks", sinks)
    checks.check_min_rank("sinks", sinks, 1, "[N] or [...,N]")
    checks.check_broadcastable("sinks", sinks, (*batch, N), f"[N] or [...,N] with N={N} query heads")
    checks.check_fits("sinks", sinks, acc_dtype)
    return sinks


def softcap(x, cap: Optional[float]):
    """cap * tanh(x / cap) (identity when cap is None). Its derivative is 1 - (softcap(x) / cap) ** 2."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def softcap_grad(capped, cap: Optional[float]):
    """d softcap / d x, from the capped value (engines that recompute it in a backward pass)."""
    return None if cap is None else 1 - jnp.square(capped / cap)


def product_grad(ds, capped, cap: Optional[float], scale=None):
    """d loss / d (the unscaled product q k^T, plus the terms inside it) from ds = d loss / d (the capped logits):
    softcap's derivative at them, times the scale (None: the scale was applied to q before the product). The
    tile backward's chain rule, for every engine and kernel."""
    if cap is not None:
        ds = ds * softcap_grad(capped, cap)
    return ds if scale is None else ds * scale


# ---------------------------------------------------------------------------------------------------
# score_mod / mask_mod: element functions with their closed-over arrays made explicit.


class ElementProgram:
    """A score_mod / mask_mod traced once on scalars: called as program(*scalars, *consts).

    Static and hashable by what it computes (the jaxpr's text: primitives, literals, shapes and dtypes
    of its consts), not by the identity of the Python function, so two BlockMasks built from the same
    mask function (or the same factory with other closed-over arrays) share compiled programs when
    passed to jax.jit as arguments. The consts' values travel separately, as data."""

    def __init__(self, jaxpr, num_scalars: int):
        self.jaxpr, self.num_scalars = jaxpr, num_scalars
        self._key = (num_scalars, str(jaxpr))

    def __call__(self, *scalars_and_consts):
        scalars, consts = scalars_and_consts[: self.num_scalars], scalars_and_consts[self.num_scalars :]
        return jax.core.eval_jaxpr(self.jaxpr, list(consts), *scalars)[0]

    def __eq__(self, other):
        return isinstance(other, ElementProgram) and self._key == other._key

    def __hash__(self):
        return hash(self._key)


class ElementFunction(NamedTuple):
    """fn(*scalars, *consts): a score_mod or mask_mod traced once on scalars; consts are the arrays it closes
    over (float ones are differentiable inputs). Hashable static part: `fn` (and `name`); consts are data."""

    fn: ElementProgram
    consts: tuple
    name: str


def element_function(name: str, user_fn, score_dtype=None) -> Optional[ElementFunction]:
    """Trace score_mod(score, b, n, t, s) (score_dtype given) or mask_mod(b, n, t, s) on scalars.

    A score_mod must return a scalar of score_dtype, a mask_mod a bool scalar: anything else is a
    ValueError naming the function and both shapes/dtypes, raised here (trace time).
    """
    if user_fn is None:
        return None
    if not callable(user_fn):
        checks.fail(name, "a function", type(user_fn).__name__)
    index = jax.ShapeDtypeStruct((), jnp.int32)
    args = ((jax.ShapeDtypeStruct((), score_dtype),) if score_dtype is not None else ()) + (index,) * 4
    closed, out = jax.make_jaxpr(lambda *a: jnp.asarray(user_fn(*a)), return_shape=True)(*args)
    signature = f"{name}({'score, ' if score_dtype is not None else ''}b, n, t, s)"
    if out.shape != ():
        checks.fail(
            signature,
            "a scalar (shape []) per element, as its score/index arguments",
            f"shape {checks.shape_str(out.shape)}",
        )
    want = jnp.dtype(score_dtype) if score_dtype is not None else jnp.dtype(jnp.bool_)
    if out.dtype != want:
        what = "bool (True = may attend)" if score_dtype is None else f"the score's dtype {want.name}"
        checks.fail(signature, f"dtype {what}", f"dtype {out.dtype}")
    return ElementFunction(ElementProgram(closed.jaxpr, len(args)), tuple(closed.consts), name)


def same_function(a: ElementFunction, b: ElementFunction) -> bool:
    """True when a and b certainly compute the same thing: the same program and the same consts (the
    same arrays, or concrete arrays of equal values). Traced consts of different origin count as different."""
    if a.fn != b.fn or len(a.consts) != len(b.consts):
        return False
    for x, y in zip(a.consts, b.consts):
        if x is y:
            continue
        if isinstance(x, jax.core.Tracer) or isinstance(y, jax.core.Tracer):
            return False
        x, y = np.asarray(x), np.asarray(y)
        if x.shape != y.shape or x.dtype != y.dtype or not np.array_equal(x, y):
            return False
    return True


def _combined(name: str, combine, start: bool, mask_mods) -> Callable:
    for i, fn in enumerate(mask_mods):
        if not callable(fn):
            checks.fail(f"{name} argument {i}", "a mask_mod(b, n, t, s) -> bool", type(fn).__name__)

    def mask_mod(b, n, t, s):
        allowed = jnp.asarray(start)
        for fn in mask_mods:
            allowed = combine(allowed, fn(b, n, t, s))
        return allowed

    return mask_mod


def noop_mask(b, n, t, s):
    """torch's noop_mask: every (query, key) pair may attend (a BlockMask of it has only full tiles)."""
    return jnp.ones_like(t, dtype=bool)


def and_masks(*mask_mods: Callable) -> Callable:
    """mask_mod(b, n, t, s) allowing a pair iff every one of mask_mods does (torch's and_masks)."""
    return _combined("and_masks", jnp.logical_and, True, mask_mods)


def or_masks(*mask_mods: Callable) -> Callable:
    """mask_mod(b, n, t, s) allowing a pair iff any one of mask_mods does (torch's or_masks)."""
    return _combined("or_masks", jnp.logical_or, False, mask_mods)


def differentiable(consts) -> tuple:
    """Which consts carry gradients (floating dtypes)."""
    return tuple(jnp.issubdtype(jnp.asarray(c).dtype, jnp.inexact) for c in consts)


def on_grid(fn: Callable, consts, b, n, t, s, score=None):
    """Evaluate fn (an ElementFunction's fn) elementwise over the grid [B,N,T,S]: b [B], n [N], t [T] or [B,T],
    s [S] or [B,S] (int32), score [B,N,T,S] (score_mod) or None (mask_mod). Nested vmaps, so fn sees scalars, as
    torch's does."""

    def call(*a):
        return fn(*a, *consts)

    has_score = score is not None
    b, n = split_as_dim(b, score, 0), split_as_dim(n, score, 1)  # as the score is split (an Explicit mesh)
    lead = (0,) if has_score else ()
    f = jax.vmap(call, in_axes=lead + (None, None, None, 0))  # S
    f = jax.vmap(f, in_axes=lead + (None, None, 0, None))  # T
    f = jax.vmap(f, in_axes=lead + (None, 0, None, None))  # N
    f = jax.vmap(f, in_axes=lead + (0, None, 0 if t.ndim == 2 else None, 0 if s.ndim == 2 else None))  # B
    return f(*((score,) if has_score else ()), b, n, t, s)


def on_tile(fn: Callable, consts, b, n, t, s, score=None):
    """fn over one (batch, head) tile [Tb,Sb] inside a kernel: b, n int32 scalars (a kernel's program ids),
    t [Tb], s [Sb] int32 absolute positions, score [Tb,Sb] (score_mod) or None (mask_mod). The same
    elementwise calls as on_grid, with no batch or head axis (a Triton tile is two-dimensional)."""

    def call(*a):
        return fn(*a, *consts)

    if score is None:
        f = jax.vmap(jax.vmap(lambda ti, si: call(b, n, ti, si), in_axes=(None, 0)), in_axes=(0, None))
        return f(t, s)
    f = jax.vmap(jax.vmap(lambda x, ti, si: call(x, b, n, ti, si), in_axes=(0, None, 0)), in_axes=(0, 0, None))
    return f(score, t, s)
