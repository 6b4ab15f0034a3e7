"""`propose_layers`: a first `layers=` map for certify, from execution order, shape and value, for the user to fix.

    proposal = crosscheck.propose_layers(torch_model, jax_fn, {"input_ids": ids})   # prints it
    cert = crosscheck.certify(torch_model, jax_fn, inputs, layers=proposal.layers)

The torch side is every submodule's output (forward hooks; a module returning a tuple gives its first array),
in the order the hooks fire; the JAX side is jax_fn's intermediates (a jax_fn returning `(outputs, {name:
array})`, as for certify). Each JAX intermediate is paired with the same-shaped torch output it is closest to
(normwise): a model has many [B,T,E] outputs (norms, projections, residuals), and shape and order alone would
pair an attention output with the norm in front of it. The order is torch's: Flax nests sown values by
module scope, so a dict of intermediates is not in execution order. Where a module and its last submodule
give the same array (an attention block and its output projection, a block and its eval-mode dropout), the
outer module is proposed, unless it returns a mapping (a whole model's ModelOutput, whose last_hidden_state is
its final norm's output): then the layer is.

A pair under `within` is sure, and only sure pairs make the ready map (`proposal.layers`). A JAX intermediate
with none is still paired with the closest same-shaped output that no sure pair took, as a guess, listed apart
(`proposal.guesses`) with the reason it is unsure: a known transform that reconciles the two when one does
(JAX = c x torch, as an embedding without Gemma's sqrt(E); one side after a norm the other is before, as
BERT's pre-norm sum against its post-norm output), else its distance. A port that has no counterpart for an
intermediate, or that goes wrong at layer 3, would otherwise get a wrong or failing pair pasted in;
`proposal.layers_with_guesses` has both, for certifying a port known to be broken. One with no same-shaped
output at all is listed as unmatched. Pairs of different layouts (heads split, transposed) are never proposed:
give those a transform by hand.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from crosscheck._certificates.certify import call_jax, run_jax, split_jax
from crosscheck._certificates.reference import cast_inputs, checked_dtype, flat_intermediates, need_torch, to_numpy
from crosscheck._comparison.compare import error_metrics


@dataclasses.dataclass(frozen=True)
class ProposedPair:
    path: str  # torch module path ("<path> (call k)" for a module's k-th call)
    name: str  # JAX intermediate
    shape: tuple[int, ...]
    normwise: float
    sure: bool  # under `within`; False: a guess, the closest same-shaped output no sure pair took
    reason: str = ""  # a guess's: the transform that reconciles the two, or how far apart they are


@dataclasses.dataclass(frozen=True)
class LayerProposal:
    pairs: tuple[ProposedPair, ...]  # in torch's firing order
    unmatched: tuple[str, ...]  # JAX intermediates with no torch output of their shape where they belong
    within: float

    @property
    def layers(self) -> dict[str, str] | list[tuple[str, str]]:
        """certify's `layers=` of the sure pairs: {torch path: JAX name}, or [(path, name), ...] when a module
        is called twice."""
        return _layers([p for p in self.pairs if p.sure])

    @property
    def guesses(self) -> tuple[ProposedPair, ...]:
        """The unsure pairs, in order, each with its reason; never in `layers`."""
        return tuple(p for p in self.pairs if not p.sure)

    @property
    def layers_with_guesses(self) -> dict[str, str] | list[tuple[str, str]]:
        """`layers` with the guesses in their places: for a port known to be broken, whose layers after the
        fault can only be guessed, so that certify names the first divergent one."""
        return _layers(list(self.pairs))

    def __str__(self) -> str:
        sure = [p for p in self.pairs if p.sure]
        sequence = isinstance(_layers(list(self.pairs)), list)
        lines = ["layers = [" if sequence else "layers = {"]
        for p in sure:
            lines.append(f"    {_entry(p, sequence):60}  # {list(p.shape)} normwise {p.normwise:.1e}")
        lines += [f"    # {name!r}: no torch module output of its shape where it belongs" for name in self.unmatched]
        lines.append("]" if sequence else "}")
        if self.guesses:
            lines.append(f"# guesses, not in the map (no torch output within {self.within:g}): check, then add by hand")
            lines += [f"#   {_entry(p, sequence):60}  # {p.reason}" for p in self.guesses]
        return "\n".join(lines)


def _layers(pairs: list[ProposedPair]) -> dict[str, str] | list[tuple[str, str]]:
    plain = [(p.path.split(" (call ")[0], p.name) for p in pairs]
    if len({path for path, _ in plain}) == len(plain):
        return dict(plain)
    return plain


def _entry(p: ProposedPair, sequence: bool) -> str:
    path = p.path.split(" (call ")[0]
    return f"({path!r}, {p.name!r})," if sequence else f"{path!r}: {p.name!r},"


def propose_layers(
    torch_module,
    jax_fn,
    inputs: Mapping[str, Any],
    *,
    dtype: str = "float32",
    torch_fn=None,
    jax_params=None,
    within: float = 1e-3,
    echo: bool = True,
) -> LayerProposal:
    """Pair jax_fn's intermediates with torch_module's submodule outputs (see the module docstring).

    torch_fn: what to call with the inputs (default torch_module itself; e.g. a wrapper around a model whose
    submodules are torch_module's). jax_params: as for certify (jax_fn(jax_params, **inputs)).
    within: the largest normwise difference of a sure pair. echo: print the proposal as Python to paste."""
    torch = need_torch("propose_layers")
    dtype = checked_dtype(dtype)
    inputs = cast_inputs(inputs, dtype)
    _, inter = split_jax(run_jax(jax_fn, inputs, jax_params), True)
    if not inter:
        raise ValueError(
            "jax_fn: expected it to return (outputs, {name: array}) with at least one intermediate, "
            "got no intermediates"
        )
    theirs = torch_outputs(torch, torch_module, torch_fn or torch_module, inputs, dtype)
    proposal = align(list(inter.items()), theirs, within, jax_order(jax_fn, inputs, jax_params))
    if echo:
        print(proposal)
    return proposal


def torch_outputs(torch, module, torch_fn, inputs: Mapping[str, np.ndarray], dtype: str) -> list[tuple[str, Any, bool]]:
    """[(path, first array of its output, whether the output is a mapping)] for every submodule call, in the
    order the forward hooks fire (a mapping: a whole model's output, e.g. transformers' ModelOutput)."""
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"torch_module: expected a torch.nn.Module, got {type(module).__name__}")
    module.to(getattr(torch, dtype)).eval()
    fired: list[tuple[str, Any, bool]] = []
    calls: dict[str, int] = {}

    def hook(path):
        def on_call(mod, args, out):
            try:
                array = to_numpy(out)
            except (AttributeError, IndexError, StopIteration, TypeError):  # no tensor in it
                return
            calls[path] = calls.get(path, 0) + 1
            label = path if calls[path] == 1 else f"{path} (call {calls[path]})"
            fired.append((label, array, isinstance(out, Mapping)))

        return on_call

    handles = [m.register_forward_hook(hook(path)) for path, m in module.named_modules() if path]
    try:
        with torch.no_grad():
            torch_fn(**{k: torch.from_numpy(np.array(v)) for k, v in inputs.items()})
    finally:
        for handle in handles:
            handle.remove()
    return fired


def jax_order(jax_fn, inputs: Mapping[str, np.ndarray], jax_params) -> dict[str, tuple[int, ...]] | None:
    """{intermediate: its place in the program} from jax_fn's jaxpr: the index of the equation that makes it,
    followed into jit'd sub-programs. None when jax_fn cannot be traced abstractly."""
    import jax
    import jax.numpy as jnp

    def intermediates(params, arrays):
        raw = call_jax(jax_fn, params, arrays)
        return flat_intermediates(raw[1] if isinstance(raw, tuple) and len(raw) == 2 else {})

    try:
        closed, shape = jax.make_jaxpr(intermediates, return_shape=True)(
            jax_params, {k: jnp.asarray(v) for k, v in inputs.items()}
        )
    except Exception:  # noqa: BLE001  (a jax_fn that leaves JAX, e.g. for numpy: fall back on the values)
        return None
    paths = [path[0].key for path, _ in jax.tree_util.tree_flatten_with_path(shape)[0]]
    return {name: program_position(closed.jaxpr, var) for name, var in zip(paths, closed.jaxpr.outvars)}


def program_position(jaxpr, var) -> tuple[int, ...]:
    """(index of the equation making `var`, then its index inside that equation's sub-program, ...); (-1,)
    for an input or a constant."""
    for k, eqn in enumerate(jaxpr.eqns):
        for position, out in enumerate(eqn.outvars):
            if out is var:
                inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
                inner = getattr(inner, "jaxpr", inner)
                if inner is None or not hasattr(inner, "outvars"):
                    return (k,)
                return (k, *program_position(inner, inner.outvars[position]))
    return (-1,)


def align(
    ours: list[tuple[str, Any]],
    theirs: list[tuple[str, Any, bool]],
    within: float,
    order: Mapping[str, tuple[int, ...]] | None = None,
) -> LayerProposal:
    """Pairs JAX intermediates with torch outputs so that both stay in execution order: `order` (JAX's program
    order; None: the order of each one's closest torch output) against torch's firing order. Of those
    pairings, the one with the most digits of agreement, -log10(normwise), summed over its sure pairs (under
    `within`; an alignment, as diff aligns lines); then, between each two sure pairs, the unsure ones aligned
    the same way with the outputs between their partners (as many pairs as fit, then the closest). Ties: a
    layer before a whole model's mapping output, then the outer module."""
    error: dict[tuple[int, int], float] = {}
    for i, (_, a) in enumerate(ours):
        for j, (_, b, _) in enumerate(theirs):
            if np.shape(a) == np.shape(b):
                e = error_metrics(np.asarray(a), np.asarray(b))[2]
                if not math.isnan(e):
                    error[i, j] = e

    def closest(i: int, allowed) -> int | None:
        found = [j for j in allowed if (i, j) in error]
        return min(found, key=lambda j: (error[i, j], theirs[j][2], depth(theirs[j][0]), j)) if found else None

    def by_closest(i: int) -> tuple[int, ...]:
        j = closest(i, range(len(theirs)))
        return (len(theirs) if j is None else j, i)

    rank = sorted(range(len(ours)), key=lambda i: order[ours[i][0]] if order is not None else by_closest(i))
    sure = _best_alignment(rank, range(len(theirs)), lambda i, j: _digits(error.get((i, j)), within, theirs[j]))
    matched = dict(sure)
    anchors = [-1] + [k for k, i in enumerate(rank) if i in sure] + [len(rank)]
    for left, right in zip(anchors, anchors[1:]):  # the unsure ones, in order between their sure neighbours
        low = sure[rank[left]] + 1 if left >= 0 else 0
        high = sure[rank[right]] if right < len(rank) else len(theirs)
        matched |= _best_alignment(
            rank[left + 1 : right],
            range(low, high),
            lambda i, j: None if (i, j) not in error else 10 - math.log10(max(error[i, j], 1e-9)) - _tie(theirs[j]),
        )
    pairs = [
        ProposedPair(
            theirs[matched[i]][0],
            ours[i][0],
            tuple(np.shape(ours[i][1])),
            error[i, matched[i]],
            i in sure,
            "" if i in sure else reconcile(ours[i][1], theirs[matched[i]][1], within),
        )
        for i in rank
        if i in matched
    ]
    unmatched = [ours[i][0] for i in rank if i not in matched]
    return LayerProposal(tuple(pairs), tuple(unmatched), within)


def _digits(error: float | None, within: float, output: tuple[str, Any, bool]) -> float | None:
    """A sure pair's score: its digits of agreement (> 0), a little less for a mapping output or a deeper
    module (equal arrays: the layer, the outer module win); None for no pair."""
    if error is None or not error < within:
        return None
    return -math.log10(max(error, 1e-300)) + 1 - _tie(output)


def _tie(output: tuple[str, Any, bool]) -> float:
    """What breaks a tie between equal arrays: a little off for each level of depth, more for a mapping."""
    return 1e-3 * (depth(output[0]) + 100 * output[2])


def _best_alignment(rank: list[int], outputs: range, score) -> dict[int, int]:
    """{i: j}: the order-keeping pairing of rank's items with `outputs` of largest summed score(i, j) (None:
    no pair), by dynamic programming over prefixes."""
    n, m = len(rank), len(outputs)
    best = np.zeros((n + 1, m + 1))
    for a in range(1, n + 1):
        for b in range(1, m + 1):
            s = score(rank[a - 1], outputs[b - 1])
            best[a, b] = max(best[a - 1, b], best[a, b - 1], -math.inf if s is None else best[a - 1, b - 1] + s)
    matched: dict[int, int] = {}
    a, b = n, m
    while a and b:
        s = score(rank[a - 1], outputs[b - 1])
        if s is not None and best[a, b] == best[a - 1, b - 1] + s:
            matched[rank[a - 1]] = outputs[b - 1]
            a, b = a - 1, b - 1
        elif best[a, b] == best[a - 1, b]:
            a -= 1
        else:
            b -= 1
    return matched


def depth(path: str) -> int:
    """How deep a module path is: "model.layers.0.self_attn" 3, "model.layers.0.self_attn.o_proj" 4."""
    return path.split(" (call ")[0].count(".")


def reconcile(ours, theirs, within: float) -> str:
    """Why a same-shaped guess is unsure, in words: the first of a few known transforms that brings JAX's
    array within `within` (normwise) of torch's, else how far apart they are. Known: a scale (JAX = c x
    torch: an embedding with or without Gemma's sqrt(E)); torch's output a norm (layer or RMS, with a fitted
    per-feature scale and shift) of JAX's, or JAX's a norm of torch's (a post-norm output against a pre-norm
    sum, as BERT's)."""
    a = np.asarray(ours, np.float64)
    b = np.asarray(theirs, np.float64)
    distance = error_metrics(a, b)[2]
    bb = float(np.sum(b * b))
    if bb > 0 and np.isfinite(a).all() and np.isfinite(b).all():
        c = float(np.sum(a * b)) / bb
        if c != 0 and error_metrics(a, c * b)[2] < within:
            return f"JAX = {_factor(c)} x torch (normwise {distance:.1e} as they are): a scale one side applies"
        for kind in ("layer norm", "RMS norm"):
            as_they_are = f"(normwise {distance:.1e} as they are)"
            if a.ndim and _fits_norm(a, b, kind, within):
                return f"torch = {kind}(JAX) {as_they_are}: torch's output is after a norm JAX's is before"
            if a.ndim and _fits_norm(b, a, kind, within):
                return f"JAX = {kind}(torch) {as_they_are}: JAX's output is after a norm torch's is before"
    return f"normwise {distance:.1e}, over {within:g}: paired by shape and order only, no known transform fits"


def _factor(c: float) -> str:
    """c written as sqrt(n) or 1/sqrt(n) when it is one (an embedding scale), else as a number."""
    for power, text in ((2, "sqrt({})"), (-2, "1/sqrt({})")):
        n = c**power if c > 0 else 0
        if n >= 2 and abs(n - round(n)) < 1e-4 * n:
            return text.format(round(n))
    return f"{c:.6g}"


def _fits_norm(x: np.ndarray, y: np.ndarray, kind: str, within: float) -> bool:
    """Whether y = norm(x) x g + h over the last axis, with g and h per feature fitted by least squares."""
    rows = x.reshape(-1, x.shape[-1])
    target = y.reshape(-1, y.shape[-1])
    centred = rows - rows.mean(-1, keepdims=True) if kind == "layer norm" else rows
    normed = centred / np.sqrt(np.mean(centred**2, -1, keepdims=True) + 1e-30)
    dn = normed - normed.mean(0)
    g = np.sum(dn * (target - target.mean(0)), 0) / np.maximum(np.sum(dn * dn, 0), 1e-300)
    fitted = normed * g + (target.mean(0) - g * normed.mean(0))
    return error_metrics(fitted, target)[2] < within
