"""Eager calls compiled whole: a public function called on concrete arrays runs as one jitted program.

Called outside jax.jit, JAX runs a function op by op and compiles every op of a new shape on its own: one
dot_product_attention of the dense engine is some thirty small programs, its gradient as many again. The
functions decorated here (the attention functions, the layers' functional forms) instead trace themselves
into one jit per signature: eager use (a notebook, a test, jax.grad or jax.vmap without jit around them)
compiles one program and reuses it, with the same results (the same operations, traced the same way).

The rule, per argument:
  - a pytree whose leaves are all arrays (jax.Array, numpy arrays, BlockMask, a params dict) is traced;
  - anything else hashable (None, Python and numpy scalars, strings, tuples of them, dtypes, precision) is
    a static argument, keyed by type and value: a new value is a new program;
  - a callable (score_mod, mask_mod, position_bias), or a value neither traced nor hashable, leaves the
    call unwrapped: a callable's closure may change between calls (a global it reads), which a program
    cached by the callable's identity would not see.
Inside jax.jit (or make_jaxpr, eval_shape) the function is called directly, so a user's jitted program is
exactly what it was; under jax.grad and jax.vmap without jit the wrapper applies (one program for the
forward, one for the backward, instead of every op twice). Bad input raises the same ValueError, at
trace time. cross_platform_lowering's setting is part of the key (it changes what is traced).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, TypeVar

import jax
import numpy as np

F = TypeVar("F", bound=Callable[..., Any])

# JAX's tracer of jit / make_jaxpr / eval_shape (the class name: jax exposes no public predicate for
# "inside a staging trace"); any other tracer (grad's, vmap's) is itself being evaluated eagerly.
_STAGING_TRACER = "DynamicJaxprTracer"

# Extra parts of the cache key: zero-argument callables read at call time (registered by modules whose
# context changes what a function traces, e.g. dispatch's cross_platform_lowering).
_CONTEXT: list[Callable[[], Any]] = []


def register_context(read: Callable[[], Any]) -> None:
    """Make read() (hashable) part of every wrapped call's key."""
    _CONTEXT.append(read)


def _is_array(x) -> bool:
    """Arrays are traced; numpy scalars (np.float32(3.0)) are not: they stand for Python numbers, which the
    checks accept where they take a Python int or float (chunk_size, logit_softcap)."""
    return isinstance(x, (jax.Array, np.ndarray))


def _split(value):
    """'dynamic' (traced), 'static' (part of the program's key), or None when the call must stay unwrapped."""
    leaves = jax.tree.leaves(value)
    if leaves and all(_is_array(leaf) for leaf in leaves):
        if any(type(leaf).__name__ == _STAGING_TRACER for leaf in leaves):
            return None
        return "dynamic"
    if callable(value) or any(callable(leaf) for leaf in leaves):
        return None
    try:
        hash(value)
    except TypeError:
        return None
    return "static"


def _key(value):
    """value with its type (recursively in tuples): 1, 1.0 and True are equal in Python but not to a check
    that refuses a float block size, so they must not share a program."""
    if isinstance(value, tuple):
        return (tuple, tuple(_key(v) for v in value))
    return (type(value), value)


@functools.lru_cache(maxsize=None)
def _program(fn, static_names: tuple, dynamic_names: tuple, key: tuple):
    """One jit per (function, static keywords, which keywords are traced); key: the static values' _key and
    the context, in the lru key only."""
    del dynamic_names, key

    def call(dynamic: dict):
        return fn(**dict(static_names), **dynamic)

    return jax.jit(call)


# Calls whose function needs a concrete value of an argument given as an array (a check on a 0-d array's
# value, say): they run unwrapped from the first failure on, per (function, statics, traced names).
_CONCRETE: set = set()
_NEEDS_CONCRETE = (
    jax.errors.ConcretizationTypeError,  # TracerBoolConversionError among them
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
    jax.errors.NonConcreteBooleanIndexError,
)


def compiled_when_eager(fn: F | None = None, *, concrete: tuple[str, ...] = ()) -> F:
    """fn, run as one jitted program per signature when called eagerly (the module docstring's rule).

    concrete: arguments whose values fn checks when they are known (a decode cache's index against its
    length: ValueError outside jit, NaN inside): a call that gives one of them (not None) runs unwrapped,
    so an eager call keeps its check."""
    if fn is None:
        return functools.partial(compiled_when_eager, concrete=concrete)  # type: ignore[return-value]
    signature = inspect.signature(fn)
    kinds = {p.kind: p.name for p in signature.parameters.values()}
    if inspect.Parameter.VAR_POSITIONAL in kinds:  # *args cannot be passed by name to the jitted call
        return fn
    var_keyword = kinds.get(inspect.Parameter.VAR_KEYWORD)  # **options: its entries are keywords like the others

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)  # let fn raise its own error
        arguments = dict(bound.arguments)
        if var_keyword is not None:
            arguments.update(arguments.pop(var_keyword, {}))
        if any(arguments.get(name) is not None for name in concrete):
            return fn(*args, **kwargs)
        static, dynamic = [], {}
        for name, value in arguments.items():
            kind = _split(value)
            if kind is None:
                return fn(*args, **kwargs)
            if kind == "dynamic":
                dynamic[name] = value
            else:
                static.append((name, value))
        if not dynamic:
            return fn(*args, **kwargs)
        names = tuple(sorted(dynamic))
        key = (tuple(_key(v) for _, v in static), tuple(read() for read in _CONTEXT))
        if (fn, key, names) in _CONCRETE:
            return fn(*args, **kwargs)
        try:
            return _program(fn, tuple(static), names, key)(dynamic)
        except _NEEDS_CONCRETE:
            _CONCRETE.add((fn, key, names))
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
