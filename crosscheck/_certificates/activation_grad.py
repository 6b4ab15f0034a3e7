"""The gradient of a scalar with respect to one of a JAX function's intermediates, for certify's `grads=True`
when every input is an integer (token ids): the embedding output is then the first floating quantity both
sides share, and d loss / d (that activation) is what a torch forward hook gives on the other side.

A JAX function does not expose its intermediates as arguments, so the intermediate is found in the
function's jaxpr (the variable it returns under that name) and the program is re-evaluated with a `delta`
added where that variable is made: d scalar / d delta at delta = 0 is d scalar / d intermediate, every later
use of the variable seeing the perturbed value. jit'd sub-programs (and remat) that make it are entered, so
a port jit'd as a whole works the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# primitives whose sub-program runs once, inline, with the equation's inputs as its inputs: the variable can
# be perturbed inside them (loops and conditionals cannot be entered this way)
_INLINE = {"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint"}
_LOOPS = {"scan", "while", "cond"}


def perturbed_program(fn: Callable[..., tuple[Any, Any]], args: Sequence[Any], index: int):
    """(run(delta, *args) -> fn's first result, the traced shape of fn(*args)[1][index]) where fn(*args) ->
    (first, [intermediates...]) and `delta` is added to intermediate `index` where it is made.

    ValueError when the intermediate is not made by the program (an input), or is made inside a loop or a
    conditional (it cannot be perturbed there)."""
    import jax

    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    first_leaves, first_tree = jax.tree_util.tree_flatten(shape[0])
    n_first = len(first_leaves)
    target = closed.jaxpr.outvars[n_first + index]
    _check_reachable(closed.jaxpr, target)

    def run(delta, *call_args):
        flat = jax.tree_util.tree_leaves(call_args)
        outs = _evaluate(closed.jaxpr, closed.consts, flat, target, delta)
        return jax.tree_util.tree_unflatten(first_tree, outs[:n_first])

    return run, jax.tree_util.tree_leaves(shape[1])[index]


def _check_reachable(jaxpr, var) -> None:
    """ValueError unless `var` is made by an equation that _evaluate can perturb: one of this program's, or
    one inside a sub-program it enters; not an input, and not inside a loop or a conditional, where adding
    delta to the stacked outputs would not reach the later iterations that use them."""
    for eqn in jaxpr.eqns:
        for position, out in enumerate(eqn.outvars):
            if out is not var:
                continue
            if eqn.primitive.name in _LOOPS:
                raise ValueError(
                    f"it is made inside a {eqn.primitive.name} (a scanned or looped layer): give layers= a first "
                    "pair outside it (the embeddings), or params= a parameter map"
                )
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            inner_jaxpr = getattr(inner, "jaxpr", inner)
            if eqn.primitive.name in _INLINE and inner_jaxpr is not None:
                if _makes(inner_jaxpr, inner_jaxpr.outvars[position]):
                    _check_reachable(inner_jaxpr, inner_jaxpr.outvars[position])
            return
    raise ValueError("it is not made by the program's own operations (an input or a constant)")


def _makes(jaxpr, var) -> bool:
    return any(out is var for eqn in jaxpr.eqns for out in eqn.outvars)


def _evaluate(jaxpr, consts, args, target, delta):
    """jax.core.eval_jaxpr, with `delta` added to `target` right after the equation that makes it."""
    from jax.extend import core

    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        position = next((k for k, out in enumerate(eqn.outvars) if out is target), None)
        if position is None:
            outs = _bind(eqn, invals)
        else:
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            inner_jaxpr = getattr(inner, "jaxpr", inner)
            enter = eqn.primitive.name in _INLINE and inner_jaxpr is not None
            if enter and _makes(inner_jaxpr, inner_jaxpr.outvars[position]):
                outs = _evaluate(
                    inner_jaxpr, getattr(inner, "consts", ()), invals, inner_jaxpr.outvars[position], delta
                )
            else:
                outs = _bind(eqn, invals)
                outs[position] = outs[position] + delta
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn, invals) -> list[Any]:
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]
