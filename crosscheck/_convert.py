"""torch attention weights <-> jaxattn params, through ONE explicit mapping table.

Every torch tensor a supported module owns has a row in ``_TABLE``: its state_dict name, where it lands in
the jaxattn params tree, its shape on each side (written in the axis letters of DESIGN.md) and the layout
transform. Both directions read the same rows, so a weight cannot be mapped one way and unmapped another.

The transform is one of two, because ``nn.Linear`` computes ``x @ W.T + b`` with ``W: [out, in]`` and the
projected features are head-major (feature ``n * H + h``):

* ``transpose``: ``kernel = W.T.reshape(jax_shape)``  (``[N*H, Eq] -> [Eq, N, H]``, ``[Eo, N*Hv] -> [N, Hv, Eo]``)
* plain reshape: ``bias [N*H] -> [N, H]``, ``bias_k [1, 1, K*H] -> [K, H]``, relative tables unchanged.

torch's packed ``in_proj_weight [3E, E]`` (rows ``[q; k; v]``) and ``in_proj_bias [3E]`` have one row per
block (``block`` of ``blocks``); the blocks are split on the way in and concatenated on the way out.

A state_dict's layout is identified by its EXACT key set against the key sets the table generates (one per
layout variant: bias or not, torch's packed or separate projections, add_bias_kv, relative tables); nothing
is inferred from name suffixes or ranks. Shapes are then checked against dims taken from the module's
attributes, or from a few named "anchor" tensors plus the head counts the caller passes.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np


@dataclass(frozen=True)
class _Rule:
    """One torch tensor (or one row block of a packed one) <-> one jaxattn params leaf."""

    torch_name: str
    path: tuple[str, ...]
    torch_shape: tuple[str, ...]  # axis expressions of this rule's block, e.g. ("N*H", "Eq")
    jax_shape: tuple[str, ...]
    transpose: bool  # nn.Linear weight [out, in] -> kernel [in, ...]
    needs: frozenset[str] = frozenset()  # layout flags under which the tensor exists
    block: int = 0
    blocks: int = 1


def _rule(torch_name, path, torch_shape, jax_shape, *, transpose=False, needs=(), block=0, blocks=1):
    return _Rule(torch_name, tuple(path.split("/")), tuple(torch_shape), tuple(jax_shape), transpose,
                 frozenset(needs), block, blocks)


# Axis "N?" is optional: a Shaw table is [R, N, H] per head or [R, H] shared over heads.
# Rows are in each module's own state_dict order (own parameters first, then submodules).
_TABLE = {
    "torch": (  # torch.nn.MultiheadAttention; there Eq = Eo = N*H, K = N, Hv = H
        _rule("in_proj_weight", "query/kernel", ("N*H", "Eq"), ("Eq", "N", "H"), transpose=True,
              needs={"packed"}, block=0, blocks=3),
        _rule("in_proj_weight", "key/kernel", ("K*H", "Ek"), ("Ek", "K", "H"), transpose=True,
              needs={"packed"}, block=1, blocks=3),
        _rule("in_proj_weight", "value/kernel", ("K*Hv", "Ev"), ("Ev", "K", "Hv"), transpose=True,
              needs={"packed"}, block=2, blocks=3),
        _rule("q_proj_weight", "query/kernel", ("N*H", "Eq"), ("Eq", "N", "H"), transpose=True,
              needs={"separate"}),
        _rule("k_proj_weight", "key/kernel", ("K*H", "Ek"), ("Ek", "K", "H"), transpose=True,
              needs={"separate"}),
        _rule("v_proj_weight", "value/kernel", ("K*Hv", "Ev"), ("Ev", "K", "Hv"), transpose=True,
              needs={"separate"}),
        _rule("in_proj_bias", "query/bias", ("N*H",), ("N", "H"), needs={"bias"}, block=0, blocks=3),
        _rule("in_proj_bias", "key/bias", ("K*H",), ("K", "H"), needs={"bias"}, block=1, blocks=3),
        _rule("in_proj_bias", "value/bias", ("K*Hv",), ("K", "Hv"), needs={"bias"}, block=2, blocks=3),
        _rule("bias_k", "bias_kv/key", ("1", "1", "K*H"), ("K", "H"), needs={"bias_kv"}),
        _rule("bias_v", "bias_kv/value", ("1", "1", "K*Hv"), ("K", "Hv"), needs={"bias_kv"}),
        _rule("out_proj.weight", "out/kernel", ("Eo", "N*Hv"), ("N", "Hv", "Eo"), transpose=True),
        _rule("out_proj.bias", "out/bias", ("Eo",), ("Eo",), needs={"bias"}),
    ),
    "torchref": (  # torchref.MultiHeadAttention / RelativeMultiHeadAttention
        _rule("rel_key", "relative/key", ("R", "N?", "H"), ("R", "N?", "H"), needs={"rel_key"}),
        _rule("rel_value", "relative/value", ("R", "N?", "Hv"), ("R", "N?", "Hv"), needs={"rel_value"}),
        _rule("q_proj.weight", "query/kernel", ("N*H", "Eq"), ("Eq", "N", "H"), transpose=True),
        _rule("q_proj.bias", "query/bias", ("N*H",), ("N", "H"), needs={"bias"}),
        _rule("k_proj.weight", "key/kernel", ("K*H", "Ek"), ("Ek", "K", "H"), transpose=True),
        _rule("k_proj.bias", "key/bias", ("K*H",), ("K", "H"), needs={"bias"}),
        _rule("v_proj.weight", "value/kernel", ("K*Hv", "Ev"), ("Ev", "K", "Hv"), transpose=True),
        _rule("v_proj.bias", "value/bias", ("K*Hv",), ("K", "Hv"), needs={"bias"}),
        _rule("out_proj.weight", "out/kernel", ("Eo", "N*Hv"), ("N", "Hv", "Eo"), transpose=True),
        _rule("out_proj.bias", "out/bias", ("Eo",), ("Eo",), needs={"bias"}),
    ),
}

# Every layout a format can take: one choice from each group (an empty string means "flag off").
_FLAG_GROUPS = {
    "torch": (("packed", "separate"), ("bias", ""), ("bias_kv", "")),
    "torchref": (("bias", ""), ("rel_key", ""), ("rel_value", "")),
}
_DESCRIPTION = {"torch": "torch.nn.MultiheadAttention", "torchref": "torchref.MultiHeadAttention"}
_FORMATS = tuple(_TABLE)


def _variants(fmt: str) -> list[frozenset[str]]:
    return [frozenset(f for f in combo if f) for combo in itertools.product(*_FLAG_GROUPS[fmt])]


def _active(fmt: str, flags: frozenset[str]) -> list[_Rule]:
    return [r for r in _TABLE[fmt] if r.needs <= flags]


def _describe(fmt: str, flags: frozenset[str]) -> str:
    return f"{_DESCRIPTION[fmt]}({', '.join(sorted(flags)) or 'no bias'})"


# ----------------------------------------------------------------------------------------- layout identity


def _identify(fmts, names: set[str], key_of, what: str) -> tuple[str, frozenset[str]]:
    """The (format, flags) whose key set is exactly ``names``; else a ValueError listing the nearest ones."""
    candidates = []
    for fmt in fmts:
        for flags in _variants(fmt):
            expected = {key_of(r) for r in _active(fmt, flags)}
            if expected == names:
                return fmt, flags
            missing, unexpected = sorted(expected - names), sorted(names - expected)
            candidates.append((len(missing) + len(unexpected), fmt, flags, missing, unexpected))
    best = min(c[0] for c in candidates)
    lines = [f"  {_describe(fmt, flags)}: missing {missing}, unexpected {unexpected}"
             for score, fmt, flags, missing, unexpected in candidates if score == best]
    raise ValueError(f"{what} keys match no supported layout exactly; closest:\n" + "\n".join(lines))


def _path_str(path: tuple[str, ...]) -> str:
    return "/".join(path)


# ------------------------------------------------------------------------------------------------- shapes


def _axis(expr: str, dims: Mapping[str, int]) -> int:
    return math.prod(int(f) if f.isdigit() else dims[f] for f in expr.split("*"))


def _allowed_shapes(spec: tuple[str, ...], dims: Mapping[str, int]) -> list[tuple[int, ...]]:
    with_heads = tuple(_axis(a.rstrip("?"), dims) for a in spec)
    without = tuple(_axis(a, dims) for a in spec if not a.endswith("?"))
    return [with_heads] if with_heads == without else [with_heads, without]


def _check_shape(name: str, shape, allowed: list[tuple[int, ...]]) -> None:
    if tuple(shape) not in allowed:
        want = " or ".join(str(s) for s in allowed)
        raise ValueError(f"{name}: expected shape {want}, got {tuple(shape)}")


def _torch_shape(rules: list[_Rule], dims) -> list[tuple[int, ...]]:
    """Allowed shapes of one torch tensor; a packed one stacks its blocks' rows."""
    if len(rules) == 1:
        return _allowed_shapes(rules[0].torch_shape, dims)
    blocks = [_allowed_shapes(r.torch_shape, dims)[0] for r in rules]
    return [(sum(b[0] for b in blocks), *blocks[0][1:])]


def _row_slices(rules: list[_Rule], dims) -> list[slice]:
    sizes = [_axis(r.torch_shape[0], dims) for r in rules]
    starts = np.cumsum([0, *sizes])
    return [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def _by_tensor(rules: list[_Rule]) -> "OrderedDict[str, list[_Rule]]":
    grouped: OrderedDict[str, list[_Rule]] = OrderedDict()
    for r in rules:
        grouped.setdefault(r.torch_name, []).append(r)
    return grouped


# ------------------------------------------------------------------------------------------------- arrays


def _is_torch_tensor(x) -> bool:
    torch = _torch_if_loaded()
    return torch is not None and isinstance(x, torch.Tensor)


def _torch_if_loaded():
    import sys

    return sys.modules.get("torch")


def to_numpy(x) -> np.ndarray:
    """A host array with x's exact dtype (torch bf16 -> ml_dtypes.bfloat16, never a cast)."""
    if _is_torch_tensor(x):
        torch = _torch_if_loaded()
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            return x.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return x.numpy()
    return np.asarray(x)


def to_jax(x: np.ndarray, name: str):
    """jnp array of the same dtype; refuses the float64 -> float32 cast JAX does silently without x64."""
    if x.dtype.itemsize == 8 * (2 if x.dtype.kind == "c" else 1) and not jax.config.jax_enable_x64:
        raise ValueError(
            f"{name}: dtype {x.dtype} needs 64-bit JAX, which is off (JAX would silently truncate it to "
            "32 bits); enable it first with "
            "jax.config.update('jax_enable_x64', True), or cast the torch module/tensors to float32 yourself"
        )
    return jnp.asarray(x)


def _to_torch(x: np.ndarray):
    import torch

    x = np.array(x)  # a writable copy: torch must not alias a (read-only) JAX buffer
    if x.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


# ------------------------------------------------------------------------------------------- dims (sizes)


def _shape_of(arrays: Mapping[str, Any], name: str, ndim: int) -> tuple[int, ...]:
    shape = tuple(arrays[name].shape)
    if len(shape) != ndim:
        raise ValueError(f"{name}: expected a rank-{ndim} tensor, got shape {shape}")
    return shape


def _divide(total: int, parts: int, what: str) -> int:
    if parts <= 0 or total % parts:
        raise ValueError(f"{what}: {total} is not divisible by {parts}")
    return total // parts


def _dims_from_module(fmt: str, module) -> dict[str, int]:
    if fmt == "torch":
        N, H = module.num_heads, module.head_dim
        dims = dict(N=N, K=N, H=H, Hv=H, Eq=module.embed_dim, Eo=module.embed_dim, Ek=module.kdim,
                    Ev=module.vdim)
    else:
        dims = dict(N=module.num_heads, K=module.num_kv_heads, H=module.head_dim, Hv=module.value_head_dim,
                    Eq=module.q_proj.in_features, Ek=module.k_proj.in_features,
                    Ev=module.v_proj.in_features, Eo=module.out_proj.out_features)
        if hasattr(module, "max_distance"):
            dims["R"] = 2 * module.max_distance + 1
    return dims


def _dims_from_state_dict(fmt, flags, sd, num_heads, num_kv_heads, head_dim, value_head_dim):
    """Sizes from named anchor tensors plus the head counts, which a bare state_dict cannot tell."""
    if num_heads is None:
        raise ValueError(
            f"a bare state_dict ({_describe(fmt, flags)}) does not record its head counts: pass num_heads= "
            "(and num_kv_heads=, head_dim=, value_head_dim= where they differ from the defaults), "
            "or pass the module itself"
        )
    N = num_heads
    if fmt == "torch":
        E = _shape_of(sd, "out_proj.weight", 2)[0]
        H = _divide(E, N, f"embed_dim (out_proj.weight rows) / num_heads={N}")
        given = dict(num_kv_heads=(num_kv_heads, N), head_dim=(head_dim, H), value_head_dim=(value_head_dim, H))
        for arg, (value, implied) in given.items():
            if value is not None and value != implied:
                raise ValueError(f"{arg}={value} is impossible for torch.nn.MultiheadAttention with "
                                 f"embed_dim={E}, num_heads={N} (it must be {implied})")
        separate = "separate" in flags
        Ek = _shape_of(sd, "k_proj_weight", 2)[1] if separate else E
        Ev = _shape_of(sd, "v_proj_weight", 2)[1] if separate else E
        return dict(N=N, K=N, H=H, Hv=H, Eq=E, Ek=Ek, Ev=Ev, Eo=E)
    K = N if num_kv_heads is None else num_kv_heads
    q_rows, Eq = _shape_of(sd, "q_proj.weight", 2)
    v_rows, Ev = _shape_of(sd, "v_proj.weight", 2)
    H = _divide(q_rows, N, f"q_proj.weight rows / num_heads={N}") if head_dim is None else head_dim
    Hv = _divide(v_rows, K, f"v_proj.weight rows / num_kv_heads={K}") if value_head_dim is None else value_head_dim
    dims = dict(N=N, K=K, H=H, Hv=Hv, Eq=Eq, Ek=_shape_of(sd, "k_proj.weight", 2)[1], Ev=Ev,
                Eo=_shape_of(sd, "out_proj.weight", 2)[0])
    table = "rel_key" if "rel_key" in flags else "rel_value" if "rel_value" in flags else None
    if table is not None:
        dims["R"] = tuple(sd[table].shape)[0] if len(sd[table].shape) else 0
    return dims


def _check_dims(fmt: str, dims: Mapping[str, int]) -> None:
    if "R" in dims and dims["R"] % 2 != 1:
        raise ValueError(f"relative tables: expected an odd number of rows R = 2*max_distance+1, got {dims['R']}")
    if dims["N"] % dims["K"]:
        raise ValueError(f"num_heads={dims['N']} is not a multiple of num_kv_heads={dims['K']}")
    if fmt == "torch":
        E = dims["Eq"]
        need = dict(K=dims["N"], Hv=dims["H"], Eo=E)
        for name, value in need.items():
            if dims[name] != value:
                raise ValueError(
                    f"torch.nn.MultiheadAttention cannot hold these params: it needs {name} == {value} "
                    f"(dims from the kernels: {dict(sorted(dims.items()))})")
        if dims["N"] * dims["H"] != E:
            raise ValueError(f"torch.nn.MultiheadAttention needs num_heads * head_dim == embed_dim, got "
                             f"{dims['N']} * {dims['H']} != {E}")


def _dims_from_params(leaves: Mapping[tuple[str, ...], Any]) -> dict[str, int]:
    def kernel(name):
        shape = tuple(leaves[(name, "kernel")].shape)
        if len(shape) != 3:
            raise ValueError(f"params['{name}']['kernel']: expected rank 3, got shape {shape}")
        return shape

    Eq, N, H = kernel("query")
    Ek, K, _ = kernel("key")
    Ev, _, Hv = kernel("value")
    _, _, Eo = kernel("out")
    dims = dict(N=N, K=K, H=H, Hv=Hv, Eq=Eq, Ek=Ek, Ev=Ev, Eo=Eo)
    for table in ("key", "value"):
        if ("relative", table) in leaves:
            shape = tuple(leaves[("relative", table)].shape)
            dims.setdefault("R", shape[0] if shape else 0)
    return dims


# --------------------------------------------------------------------------------------------- public API


def _module_format(module) -> str | None:
    torch = _torch_if_loaded()
    if torch is not None and isinstance(module, torch.nn.MultiheadAttention):
        return "torch"
    if torch is not None and isinstance(module, torch.nn.Module):
        import torchref

        if isinstance(module, torchref.MultiHeadAttention):
            return "torchref"
        raise ValueError(f"params_from_torch: unsupported module {type(module).__name__}; expected "
                         "torch.nn.MultiheadAttention, torchref.MultiHeadAttention or RelativeMultiHeadAttention")
    return None


def params_from_torch(module_or_state_dict, *, num_heads: int | None = None, num_kv_heads: int | None = None,
                      head_dim: int | None = None, value_head_dim: int | None = None,
                      format: str | None = None) -> dict:
    """jaxattn params (nested dicts of jnp arrays) for a torch attention module or its state_dict.

    ``module_or_state_dict``: a ``torch.nn.MultiheadAttention`` (any constructor options: bias, add_bias_kv,
    add_zero_attn, kdim/vdim, batch_first), a ``torchref.MultiHeadAttention`` /
    ``RelativeMultiHeadAttention``, or a mapping ``name -> tensor / numpy array`` holding exactly one of their
    state_dicts (e.g. from :func:`crosscheck.load_state_dict`). A mapping's layout is identified by its exact
    key set; ``format`` ("torch" or "torchref") restricts the search. A bare mapping does not record head
    counts, so ``num_heads`` is then required, and ``num_kv_heads`` (default ``num_heads``), ``head_dim``
    (default: rows / heads) and ``value_head_dim`` where they are not the defaults. For a module they are read
    from its attributes and must not be passed.

    Result: ``{"query": {"kernel" [Eq,N,H], "bias" [N,H]}, "key": ..., "value": ..., "out": {"kernel"
    [N,Hv,Eo], "bias" [Eo]}}`` plus, where the module has them, ``"bias_kv": {"key" [K,H], "value" [K,Hv]}``
    (torch's add_bias_kv) and ``"relative": {"key" [R,(N,)H], "value" [R,(N,)Hv]}`` (Shaw tables). Options
    that are not weights (torch's ``add_zero_attn``) come from :func:`call_options_from_torch`; inputs of a
    ``batch_first=False`` torch module are ``[T, B, E]`` and need ``swapaxes(0, 1)`` for jaxattn.

    Arrays are jnp arrays with the torch dtype unchanged (float32, float64, bfloat16...). A 64-bit tensor
    while ``jax_enable_x64`` is off raises ValueError (JAX would silently halve it). Missing and unexpected
    keys are listed by name, and a wrong shape names the key and both shapes.
    """
    fmt = _module_format(module_or_state_dict)
    if fmt is not None:
        passed = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      value_head_dim=value_head_dim, format=format)
        extra = sorted(k for k, v in passed.items() if v is not None)
        if extra:
            raise ValueError(f"params_from_torch: {extra} are read from the module; pass them only with a state_dict")
        state = module_or_state_dict.state_dict()
    elif isinstance(module_or_state_dict, Mapping):
        state = module_or_state_dict
    else:
        raise ValueError("params_from_torch: expected a torch attention module or a state_dict mapping, got "
                         f"{type(module_or_state_dict).__name__}")
    if format is not None and format not in _FORMATS:
        raise ValueError(f"format: expected one of {list(_FORMATS)}, got {format!r}")
    searched = [fmt or format] if (fmt or format) else list(_FORMATS)
    fmt, flags = _identify(searched, set(state), lambda r: r.torch_name, "state_dict")
    if module_or_state_dict is state:
        dims = _dims_from_state_dict(fmt, flags, state, num_heads, num_kv_heads, head_dim, value_head_dim)
    else:
        dims = _dims_from_module(fmt, module_or_state_dict)
    _check_dims(fmt, dims)
    return _nest(_leaves_from_torch(_active(fmt, flags), state, dims))


def _leaves_from_torch(rules: list[_Rule], state: Mapping[str, Any], dims) -> dict[tuple[str, ...], Any]:
    """The table read forwards: split packed rows, W.T for nn.Linear weights, reshape to heads."""
    leaves = {}
    for name, tensor_rules in _by_tensor(rules).items():
        tensor = to_numpy(state[name])
        _check_shape(name, tensor.shape, _torch_shape(tensor_rules, dims))
        for rule, rows in zip(tensor_rules, _row_slices(tensor_rules, dims)):
            block = tensor[rows] if rule.blocks > 1 else tensor
            block = block.T if rule.transpose else block
            shape = _allowed_shapes(rule.jax_shape, dims)[0 if block.ndim == len(rule.jax_shape) else -1]
            leaves[rule.path] = to_jax(np.ascontiguousarray(block.reshape(shape)), name)
    return leaves


_PATH_ORDER = ["query", "key", "value", "out", "bias_kv", "relative", "kernel", "bias"]


def _nest(leaves: Mapping[tuple[str, ...], Any]) -> dict:
    tree: dict = {}
    order = {name: i for i, name in enumerate(_PATH_ORDER)}
    for path in sorted(leaves, key=lambda p: [order.get(part, len(order)) for part in p]):
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = leaves[path]
    return tree


def _flatten(tree, prefix=()) -> dict[tuple[str, ...], Any]:
    if not isinstance(tree, Mapping):
        return {prefix: tree}
    leaves = {}
    for name, sub in tree.items():
        leaves.update(_flatten(sub, (*prefix, str(name))))
    return leaves


def params_to_torch(params: Mapping, *, format: str) -> "OrderedDict[str, Any]":
    """The torch state_dict (an OrderedDict of CPU tensors, in the module's own key order) for jaxattn params.

    ``format="torch"``: for ``torch.nn.MultiheadAttention`` (packed ``in_proj_weight`` when the key and value
    kernels have as many input features as the query kernel, separate ``q/k/v_proj_weight`` otherwise, as torch
    decides from kdim/vdim); needs ``K == N``, ``Hv == H``, ``Eo == N * H``, all biases or none, and takes
    ``params["bias_kv"]``. ``format="torchref"``: for ``torchref.MultiHeadAttention`` /
    ``RelativeMultiHeadAttention`` (any head layout, ``params["relative"]`` tables). The result loads with
    ``module.load_state_dict(sd, strict=True)``; dtypes are kept, and ``params_from_torch`` of it gives back
    ``params`` exactly. Missing/unexpected entries and wrong shapes raise ValueError naming them.
    """
    if format not in _FORMATS:
        raise ValueError(f"format: expected one of {list(_FORMATS)}, got {format!r}")
    leaves = {path: to_numpy(x) for path, x in _flatten(params).items()}
    _, flags = _identify([format], {_path_str(p) for p in leaves}, lambda r: _path_str(r.path), "params")
    dims = _dims_from_params(leaves)
    _check_dims(format, dims)
    if format == "torch":  # packed and separate share one params key set; torch picks by kdim/vdim
        packed = dims["Ek"] == dims["Eq"] == dims["Ev"]
        flags = flags - {"packed", "separate"} | {"packed" if packed else "separate"}
    return _torch_from_leaves(_active(format, flags), leaves, dims)


def _torch_from_leaves(rules: list[_Rule], leaves, dims) -> "OrderedDict[str, Any]":
    """The table read backwards: heads flattened, kernel.T for nn.Linear weights, packed blocks stacked."""
    state: OrderedDict[str, Any] = OrderedDict()
    for name, tensor_rules in _by_tensor(rules).items():
        blocks = []
        for rule in tensor_rules:
            leaf = leaves[rule.path]
            _check_shape(f"params['{_path_str(rule.path)}']", leaf.shape, _allowed_shapes(rule.jax_shape, dims))
            torch_shape = _allowed_shapes(rule.torch_shape, dims)[0 if leaf.ndim == len(rule.jax_shape) else -1]
            blocks.append(leaf.reshape(torch_shape[::-1]).T if rule.transpose else leaf.reshape(torch_shape))
        if len({b.dtype for b in blocks}) > 1:
            raise ValueError(f"{name} packs {[_path_str(r.path) for r in tensor_rules]}, which must share one "
                             f"dtype, got {[str(b.dtype) for b in blocks]}")
        state[name] = _to_torch(np.concatenate(blocks) if len(blocks) > 1 else blocks[0])
    return state


def call_options_from_torch(module) -> dict:
    """The jaxattn call keywords that reproduce a module's non-weight options.

    ``torch.nn.MultiheadAttention`` -> ``{"add_zero_attn": module.add_zero_attn}`` (pass them on:
    ``jaxattn.multi_head_attention(params, q, k, v, **options)``). torchref modules have none (their
    ``max_distance`` is implied by the tables' ``R = 2 * max_distance + 1`` rows) -> ``{}``. Not included:
    torch's dropout probability (training-time randomness that cannot match across frameworks) and
    ``batch_first``, which is an input layout (jaxattn is always ``[..., T, E]``).
    """
    fmt = _module_format(module)
    if fmt is None:
        raise ValueError(f"call_options_from_torch: expected a torch attention module, got {type(module).__name__}")
    return {"add_zero_attn": bool(module.add_zero_attn)} if fmt == "torch" else {}
