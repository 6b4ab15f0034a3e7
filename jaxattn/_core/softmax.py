"""The masked softmax, dropout on the weights, and the online-softmax merge of partial results.

Every engine normalises through here: the dense engine with masked_softmax over one [...,S] row, the
blockwise and ring engines with partials (out, running max, running sum) merged by combine_partials.
Both give zeros (and finite gradients) for a query with no allowed key.

No -inf is ever materialised on valid input (JAX's jax_debug_infs checks every intermediate in eager mode,
and jax.nn passes it): a partial with no key yet carries the finite running max no_key(dtype), the engines'
lse of an empty row is that value too, and public_lse turns it into -inf (torch's lse of an empty row) only
where a row is empty.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from . import checks
from .placement import full_beside, zeros_beside


def _shifted_exps(logits, allowed, sinks):
    """(exps, total, row_max), the last two [...,1]: exp(logit - row_max) on allowed keys (0 elsewhere) and
    their sum plus the sinks' terms. Disallowed logits are replaced *before* exp (never -inf arithmetic),
    and the row max is taken over allowed entries (and sinks) only, so fully masked rows stay finite."""
    allowed = jnp.ones(logits.shape, bool) if allowed is None else jnp.broadcast_to(allowed, logits.shape)
    # The lowest finite value stands in for "no key" (no -inf literal: under eager jax_debug_infs every
    # intermediate is checked, and jax.nn passes that check on valid input).
    lowest = jnp.finfo(logits.dtype).min
    some = jnp.any(allowed, axis=-1, keepdims=True)
    row_max = jnp.max(jnp.where(allowed, logits, lowest), axis=-1, keepdims=True, initial=lowest)
    if sinks is not None:
        row_max, some = jnp.maximum(row_max, sinks), some | True
    row_max = lax.stop_gradient(jnp.where(some & jnp.isfinite(row_max), row_max, 0))
    exps = jnp.where(allowed, jnp.exp(jnp.where(allowed, logits, row_max) - row_max), 0)
    total = jnp.sum(exps, axis=-1, keepdims=True)
    if sinks is not None:
        total = total + jnp.exp(sinks - row_max)
    return exps, total, row_max


def masked_softmax(logits, allowed, sinks=None):
    """Softmax over the last axis restricted to `allowed`; rows with no allowed key give zeros.

    sinks (broadcastable to logits[..., :1]): one more logit per row in the denominator with no value
    (gpt-oss's attention sinks); a row with no allowed key still gives zeros. Forward and gradient stay
    finite for fully masked rows (_shifted_exps). Always masked, even with allowed None: a score_mod may
    block a whole row with -inf (torch's idiom), which must give zeros too, never softmax's NaN.
    """
    exps, total, _ = _shifted_exps(logits, allowed, sinks)
    return exps / jnp.where(total == 0, 1, total)


def masked_logsumexp(logits, allowed, sinks=None):
    """[...]: log of the softmax's normaliser, sum over allowed keys of exp(logits) plus exp(sinks) (torch's
    flex_attention return_lse). -inf for a row with no allowed key and no sink, with zero gradients there
    (the log is never taken of an empty sum)."""
    _, total, row_max = _shifted_exps(logits, allowed, sinks)
    total, row_max = total[..., 0], row_max[..., 0]
    empty = total == 0  # log(0) = -inf computed only where a row is empty (no -inf literal), without gradient
    return jnp.where(
        empty,
        lax.stop_gradient(jnp.log(jnp.where(empty, 0, 1).astype(total.dtype))),
        row_max + jnp.log(jnp.where(empty, 1, total)),
    )


def dropout(weights, rate: float, rng, broadcast: bool = False):
    """Inverted dropout on the attention weights (the weights returned are the ones used).

    broadcast: one keep-mask [T,S] shared by every batch entry and head (flax's broadcast_dropout)."""
    if not 0.0 <= rate <= 1.0:
        checks.fail("dropout_rate", "a float in [0, 1]", rate)
    if rate == 0.0:
        return weights
    if rng is None:
        checks.fail("dropout_rng", "a jax.random key when dropout_rate > 0", None)
    if rate == 1.0:
        return jnp.zeros_like(weights)
    shape = (1,) * (weights.ndim - 2) + weights.shape[-2:] if broadcast else weights.shape
    keep = jax.random.bernoulli(rng, 1.0 - rate, shape)
    return jnp.where(keep, weights / (1.0 - rate), 0)


def no_key(dtype):
    """The running max of a row with no allowed key (yet): finite, and so low that exp(no_key - m) is 0
    against any real logit m (half the lowest float, so no_key - m cannot overflow)."""
    return jnp.asarray(jnp.finfo(dtype).min / 2, dtype)


def has_keys(lse):
    """bool [...]: the rows of an engine lse (finalize_partial) that had at least one key."""
    return lse > no_key(lse.dtype)


def probabilities(x, lse, allowed=None):
    """The softmax weights p = exp(x - lse) of logits x recomputed from their rows' saved log-sum-exp (the
    backward of every engine and kernel); lse broadcasts against x (the caller adds the key axis). 0 where a
    pair is not allowed; a row with no key (has_keys) is read against 0, so that nothing overflows before the
    mask."""
    p = jnp.exp(x - jnp.where(has_keys(lse), lse, 0))
    return p if allowed is None else jnp.where(allowed, p, 0)


def logits_grad(p, dp, delta):
    """d loss / d x = p (dp - delta), the softmax's backward: dp = d loss / d p (dO v^T, plus a value term's),
    delta = sum_s p dp = rowsum(dO * out) - d lse per row (broadcast against p)."""
    return p * (dp - delta)


def public_lse(lse):
    """An engine lse with -inf for the rows with no key (log 0; computed only where a row is empty)."""
    empty = ~has_keys(lse)
    return jnp.where(empty, lax.stop_gradient(jnp.log(jnp.where(empty, 0, 1).astype(lse.dtype))), lse)


def combine_partials(a, b):
    """Merge two partial softmax results computed over disjoint sets of keys.

    A partial is a triple (out, m, l) for rows [...]:
      out: pytree of arrays [...,F]  sum_s exp(x_s - m) * value_s   (unnormalised, relative to m)
      m:   [...]                     max_s x_s over the partial's allowed keys (no_key or -inf if none)
      l:   [...]                     sum_s exp(x_s - m)               (0 if it has none)
    The merge is exact and associative; rows empty in both stay (0, no_key or -inf, 0) with no NaN.
    """
    out_a, m_a, l_a = a
    out_b, m_b, l_b = b
    m = jnp.maximum(m_a, m_b)
    m_safe = jnp.where(jnp.isfinite(m), m, 0)
    c_a, c_b = jnp.exp(m_a - m_safe), jnp.exp(m_b - m_safe)
    out = jax.tree.map(lambda x, y: x * c_a[..., None] + y * c_b[..., None], out_a, out_b)
    return out, m, l_a * c_a + l_b * c_b


def merge_partials(partial, axis: int):
    """combine_partials of the partials stacked along `axis` (>= 0: the same axis of out [...,F], m and l):
    one partial with that axis reduced (split-key attention: one partial per key chunk)."""
    out, m, l = partial
    top = jnp.max(m, axis=axis, keepdims=True)
    c = jnp.exp(m - jnp.where(jnp.isfinite(top), top, 0))  # rows empty in every chunk: m = no_key, c = 1, l = 0
    out = jax.tree.map(lambda x: jnp.sum(x * c[..., None], axis=axis), out)
    return out, jnp.squeeze(top, axis), jnp.sum(l * c, axis=axis)


def empty_partial(out_shapes, rows_shape, dtype, like=None):
    """The identity of combine_partials: zeros, m = no_key, l = 0. out_shapes is a sequence of shapes; every
    array is placed as `like` (the queries whose rows it holds: placement.full_beside; None, in a kernel's
    tile: unplaced)."""
    out = tuple(zeros_beside(like, shape, dtype) for shape in out_shapes)
    return out, full_beside(like, rows_shape, no_key(dtype), dtype), zeros_beside(like, rows_shape, dtype)


def add_sinks(partial, sinks):
    """Fold one sink logit per row (a softmax term with no value) into a partial: the sink is the partial
    of one key with logit `sinks` [...] and value 0, i.e. (0, sinks, 1). None: the partial unchanged."""
    if sinks is None:
        return partial
    out, m, _ = partial
    sinks = jnp.broadcast_to(sinks, m.shape).astype(m.dtype)
    return combine_partials(partial, (jax.tree.map(jnp.zeros_like, out), sinks, jnp.ones_like(m)))


def finalize_partial(partial):
    """(out, m, l) -> (out / l, log-sum-exp); rows with no allowed key give zeros and lse = no_key (finite:
    the engines' residual; public_lse makes it -inf)."""
    out, m, l = partial
    denom = jnp.where(l == 0, 1, l)
    out = jax.tree.map(lambda x: x / denom[..., None], out)
    return out, jnp.where(l == 0, no_key(m.dtype), m + jnp.log(denom))
