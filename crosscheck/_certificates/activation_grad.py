"""The gradient of a scalar with respect to one of a JAX function's intermediates, for certify's `grads=True`
when every input is an integer (token ids): the embedding output is then the first floating quantity both
sides share, and d loss / d (that activation) is what a torch forward hook gives on the other side.

A JAX function does not expose its intermediates as arguments, so the intermediate is found in the
function's jaxpr and the program is re-evaluated with a `delta` added where that value is made: d scalar /
d delta at delta = 0 is d scalar / d intermediate, every later use of the value seeing the perturbed one.
jit'd sub-programs (and remat) are entered, so a port jit'd as a whole works the same way. The value is
found either by name (an intermediate the function returns: `perturbed_program`) or, with no name, as the
first value made from the integer inputs that equals torch's activation (`first_floating_program`).

A site is where a value is made: the indices of the equations down through the sub-programs entered, then
the position of the value among its equation's outputs. A sub-program called twice is two sites.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

# primitives whose sub-program runs once, inline, with the equation's inputs as its inputs: a value can
# be perturbed inside them (loops and conditionals cannot be entered this way)
_INLINE = {"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint"}
_LOOPS = {"scan", "while", "cond"}

Site = tuple[int, ...]


def perturbed_program(fn: Callable[..., tuple[Any, Any]], args: Sequence[Any], index: int):
    """(run(delta, *args) -> fn's first result, the traced shape of fn(*args)[1][index]) where fn(*args) ->
    (first, [intermediates...]) and `delta` is added to intermediate `index` where it is made.

    ValueError when the intermediate is not made by the program (an input), or is made inside a loop or a
    conditional (it cannot be perturbed there)."""
    import jax

    closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
    n_first = len(jax.tree_util.tree_leaves(shape[0]))
    site = _site_of(closed.jaxpr, closed.jaxpr.outvars[n_first + index])
    run = _runner(closed, site, jax.tree_util.tree_structure(shape[0]), n_first)
    return run, jax.tree_util.tree_leaves(shape[1])[index]


def first_floating_program(
    fn: Callable[..., Any], params: Any, inputs: Any, like: np.ndarray, distance: Callable[[Any], float], within: float
):
    """(run(delta, params, inputs) -> fn's result, the value's aval, a description of it) for the value of
    fn(params, inputs) that stands for torch's first floating activation `like` (the embedding output):
    among the floating values of like's shape that fn makes from its integer inputs, in program order, the
    first run of those within `within` of `like` by `distance`, and of that run the last (the value the rest
    of the program reads: a port's steps that keep the lookup's value, such as the `where` that stands for
    torch's Embedding(padding_idx), come after the lookup itself).

    Values made inside loops and conditionals are not candidates (they cannot be perturbed there). The
    search runs the program eagerly and stops at the end of that run. ValueError when no value matches,
    naming how many were seen and the nearest."""
    import jax

    closed, shape = jax.make_jaxpr(fn, return_shape=True)(params, inputs)
    n_params = len(jax.tree_util.tree_leaves(params))
    sources = {v for v in closed.jaxpr.invars[n_params:] if not jax.numpy.issubdtype(v.aval.dtype, jax.numpy.inexact)}
    wanted = {
        site: (primitive, aval)
        for site, primitive, aval in _made_from(closed.jaxpr, sources)
        if jax.numpy.issubdtype(aval.dtype, jax.numpy.floating) and tuple(aval.shape) == tuple(like.shape)
    }
    seen: list[tuple[float, Site]] = []
    match: list[Site] = []  # the current run of matching values

    class RunEnded(Exception):
        pass

    def watch(site, value):
        if site in wanted:
            seen.append((distance(np.asarray(value)), site))
            if seen[-1][0] <= within:
                match.append(site)
            elif match:
                raise RunEnded
        return value

    try:
        _evaluate(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves((params, inputs)), lambda here: True, watch)
    except RunEnded:
        pass
    if match:
        primitive, aval = wanted[match[-1]]
        n_out = len(jax.tree_util.tree_leaves(shape))
        return (
            _runner(closed, match[-1], jax.tree_util.tree_structure(shape), n_out),
            aval,
            f"{primitive}@{_site_name(match[-1])}",
        )
    if not seen:
        raise ValueError(
            f"no floating value of shape {tuple(like.shape)} is made from the integer inputs (outside loops and "
            "conditionals)"
        )
    nearest, site = min(seen, key=lambda pair: pair[0] if np.isfinite(pair[0]) else np.inf)
    raise ValueError(
        f"none of the {len(seen)} floating values of shape {tuple(like.shape)} made from the integer inputs "
        f"equals it (the nearest, {wanted[site][0]}@{_site_name(site)}, is {nearest:.2e} away, the bar {within:g})"
    )


def _site_name(site: Site) -> str:
    return ".".join(map(str, site))


def _runner(closed, site: Site, tree, n_out: int):
    """run(delta, *args): the program's first n_out results (as `tree`), `delta` added at `site`."""
    import jax

    def run(delta, *call_args):
        def edit(here, value):
            return value + delta if here == site else value

        flat = jax.tree_util.tree_leaves(call_args)
        outs = _evaluate(closed.jaxpr, closed.consts, flat, lambda here: _on_the_way(here, site), edit)
        return jax.tree_util.tree_unflatten(tree, outs[:n_out])

    return run


def _on_the_way(here: Site, site: Site) -> bool:
    """Whether the equation at `here` is a sub-program call that `site` lies inside (not the equation making it)."""
    return len(here) < len(site) - 1 and site[: len(here)] == here


def _inner(eqn):
    """The (jaxpr, consts) an inline equation runs, or None."""
    if eqn.primitive.name not in _INLINE:
        return None
    inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
    if inner is None:
        return None
    return getattr(inner, "jaxpr", inner), getattr(inner, "consts", ())


def _site_of(jaxpr, var, prefix: Site = ()) -> Site:
    """The site making `var`, through the sub-programs whose output it is; ValueError unless it can be
    perturbed there: made by one of the program's own operations, not an input, and not inside a loop or a
    conditional, where adding delta to the stacked outputs would not reach the later iterations that use them."""
    for i, eqn in enumerate(jaxpr.eqns):
        for position, out in enumerate(eqn.outvars):
            if out is not var:
                continue
            if eqn.primitive.name in _LOOPS:
                raise ValueError(
                    f"it is made inside a {eqn.primitive.name} (a scanned or looped layer): give layers= a first "
                    "pair outside it (the embeddings), or params= a parameter map"
                )
            inner = _inner(eqn)
            if inner is not None and _makes(inner[0], inner[0].outvars[position]):
                return _site_of(inner[0], inner[0].outvars[position], (*prefix, i))
            return (*prefix, i, position)
    raise ValueError("it is not made by the program's own operations (an input or a constant)")


def _makes(jaxpr, var) -> bool:
    return any(out is var for eqn in jaxpr.eqns for out in eqn.outvars)


def _made_from(jaxpr, sources: set, prefix: Site = ()) -> Iterator[tuple[Site, str, Any]]:
    """(site, primitive, aval) of every value made from `sources` (vars of jaxpr), in program order, inside
    the inline sub-programs too; a loop's or conditional's outputs count as made from them, but are no sites."""
    from jax.extend import core

    reached = set(sources)
    for i, eqn in enumerate(jaxpr.eqns):
        fed = [not isinstance(v, core.Literal) and v in reached for v in eqn.invars]
        if not any(fed):
            continue
        inner = _inner(eqn)
        if inner is not None:
            yield from _made_from(inner[0], {v for v, f in zip(inner[0].invars, fed, strict=True) if f}, (*prefix, i))
        elif eqn.primitive.name not in _LOOPS:
            for position, out in enumerate(eqn.outvars):
                yield (*prefix, i, position), eqn.primitive.name, out.aval
        reached.update(eqn.outvars)


def _evaluate(jaxpr, consts, args, enter: Callable[[Site], bool], edit: Callable[[Site, Any], Any], prefix=()):
    """jax.core.eval_jaxpr, entering the inline sub-programs where `enter(site of the equation)` says so, with
    `edit(site, value)` applied to every value made by an equation not entered."""
    from jax.extend import core

    env: dict[Any, Any] = {}

    def read(v):
        return v.val if isinstance(v, core.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts, strict=True):
        env[v] = x
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for i, eqn in enumerate(jaxpr.eqns):
        invals = [read(v) for v in eqn.invars]
        here = (*prefix, i)
        inner = _inner(eqn)
        if inner is not None and enter(here):
            outs = _evaluate(inner[0], inner[1], invals, enter, edit, here)
        else:
            outs = [edit((*here, position), x) for position, x in enumerate(_bind(eqn, invals))]
        for v, x in zip(eqn.outvars, outs, strict=True):
            env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _bind(eqn, invals) -> list[Any]:
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]
