"""torch attention weights <-> jaxattn params, through ONE explicit mapping table.

Every torch tensor a supported module owns has a row in the table of its layout (``_rows``), written in
jaxattn.models.weights' format, the one of every model family: its state_dict name, where it lands in the
jaxattn params tree, its shape on each side (docs/design.md, "Axis letters") and the layout transform.
Both directions read the same rows (the way back is weights.unapply: each transform run on the tensor's
flat positions), so a weight cannot be mapped one way and unmapped another.

``nn.Linear`` computes ``x @ W.T + b`` with ``W: [out, in]`` and the projected features are head-major
(feature ``n * H + h``), so its weights take ``Steps(Transpose(), Reshape())`` (``[N*H, Eq] -> [Eq, N, H]``,
``[Eo, N*Hv] -> [N, Hv, Eo]``) and biases ``Reshape()`` (``[N*H] -> [N, H]``, ``bias_k [1, 1, K*H] -> [K, H]``);
relative tables are copied. torch's packed ``in_proj_weight [3E, E]`` (rows ``[q; k; v]``) and
``in_proj_bias [3E]`` fill three leaves each, one ``Part(k, 3, 0)`` per block. Axis ``"N?"`` (this module's
own letter, resolved here before a transform runs) may be absent: a Shaw table is [R, N, H] per head or
[R, H] shared over heads.

A state_dict's layout is identified by its EXACT key set against the key sets the table generates (one per
layout variant: bias or not, torch's packed or separate projections, add_bias_kv, relative tables); nothing
is inferred from name suffixes or ranks. Shapes are then checked against dims taken from the module's
attributes, or from a few named "anchor" tensors plus the head counts the caller passes.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Mapping

import jax
import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    from jaxattn.models.weights import Row


def _rows(fmt: str, flags: frozenset[str]) -> list[Row]:
    """The table of one layout (the rows its flags keep), in the module's own state_dict order (own
    parameters first, then submodules)."""
    # imported here: jaxattn.models brings flax and every model family, which `import crosscheck` need not
    from jaxattn.models.weights import Part, Reshape, Row, Steps, Target, Transpose, row, when

    _HEADS = Steps(Transpose(), Reshape())  # nn.Linear [N*H, E] -> kernel [E, N, H]; [E, N*H] -> [N, H, E]
    bias = "bias" in flags
    if fmt == "torch":  # torch.nn.MultiheadAttention; there Eq = Eo = N*H, K = N, Hv = H
        return [
            *when(
                "packed" in flags,
                Row(
                    "in_proj_weight",
                    ("3*N*H", "Eq"),
                    (
                        Target("query/kernel", ("Eq", "N", "H"), Steps(Part(0, 3, 0), _HEADS)),
                        Target("key/kernel", ("Ek", "K", "H"), Steps(Part(1, 3, 0), _HEADS)),
                        Target("value/kernel", ("Ev", "K", "Hv"), Steps(Part(2, 3, 0), _HEADS)),
                    ),
                ),
            ),
            *when(
                "separate" in flags,
                row("q_proj_weight", ("N*H", "Eq"), "query/kernel", ("Eq", "N", "H"), _HEADS),
                row("k_proj_weight", ("K*H", "Ek"), "key/kernel", ("Ek", "K", "H"), _HEADS),
                row("v_proj_weight", ("K*Hv", "Ev"), "value/kernel", ("Ev", "K", "Hv"), _HEADS),
            ),
            *when(
                bias,
                Row(
                    "in_proj_bias",
                    ("3*N*H",),
                    (
                        Target("query/bias", ("N", "H"), Part(0, 3, 0)),
                        Target("key/bias", ("K", "H"), Part(1, 3, 0)),
                        Target("value/bias", ("K", "Hv"), Part(2, 3, 0)),
                    ),
                ),
            ),
            *when(
                "bias_kv" in flags,
                row("bias_k", ("1", "1", "K*H"), "bias_kv/key", ("K", "H"), Reshape()),
                row("bias_v", ("1", "1", "K*Hv"), "bias_kv/value", ("K", "Hv"), Reshape()),
            ),
            row("out_proj.weight", ("Eo", "N*Hv"), "out/kernel", ("N", "Hv", "Eo"), _HEADS),
            *when(bias, row("out_proj.bias", ("Eo",), "out/bias", ("Eo",))),
        ]
    return [  # torchref.MultiHeadAttention / RelativeMultiHeadAttention
        *when("rel_key" in flags, row("rel_key", ("R", "N?", "H"), "relative/key", ("R", "N?", "H"))),
        *when("rel_value" in flags, row("rel_value", ("R", "N?", "Hv"), "relative/value", ("R", "N?", "Hv"))),
        row("q_proj.weight", ("N*H", "Eq"), "query/kernel", ("Eq", "N", "H"), _HEADS),
        *when(bias, row("q_proj.bias", ("N*H",), "query/bias", ("N", "H"), Reshape())),
        row("k_proj.weight", ("K*H", "Ek"), "key/kernel", ("Ek", "K", "H"), _HEADS),
        *when(bias, row("k_proj.bias", ("K*H",), "key/bias", ("K", "H"), Reshape())),
        row("v_proj.weight", ("K*Hv", "Ev"), "value/kernel", ("Ev", "K", "Hv"), _HEADS),
        *when(bias, row("v_proj.bias", ("K*Hv",), "value/bias", ("K", "Hv"), Reshape())),
        row("out_proj.weight", ("Eo", "N*Hv"), "out/kernel", ("N", "Hv", "Eo"), _HEADS),
        *when(bias, row("out_proj.bias", ("Eo",), "out/bias", ("Eo",))),
    ]


# Every layout a format can take: one choice from each group (an empty string means "flag off").
_FLAG_GROUPS = {
    "torch": (("packed", "separate"), ("bias", ""), ("bias_kv", "")),
    "torchref": (("bias", ""), ("rel_key", ""), ("rel_value", "")),
}
_DESCRIPTION = {"torch": "torch.nn.MultiheadAttention", "torchref": "torchref.MultiHeadAttention"}
_FORMATS = tuple(_FLAG_GROUPS)


def _variants(fmt: str) -> list[frozenset[str]]:
    return [frozenset(f for f in combo if f) for combo in itertools.product(*_FLAG_GROUPS[fmt])]


def _describe(fmt: str, flags: frozenset[str]) -> str:
    return f"{_DESCRIPTION[fmt]}({', '.join(sorted(flags)) or 'no bias'})"


def _tensor_names(rows: list[Row]) -> set[str]:
    return {r.name for r in rows}


def _leaf_paths(rows: list[Row]) -> set[str]:
    return {t.path for r in rows for t in r.targets}


# ----------------------------------------------------------------------------------------- layout identity


def _identify(fmts, names: set[str], keys_of, what: str) -> tuple[str, frozenset[str]]:
    """The (format, flags) whose key set (keys_of(rows)) is exactly ``names``; else a ValueError listing the
    nearest ones."""
    candidates = []
    for fmt in fmts:
        for flags in _variants(fmt):
            expected = keys_of(_rows(fmt, flags))
            if expected == names:
                return fmt, flags
            missing, unexpected = sorted(expected - names), sorted(names - expected)
            candidates.append((len(missing) + len(unexpected), fmt, flags, missing, unexpected))
    best = min(c[0] for c in candidates)
    lines = [
        f"  {_describe(fmt, flags)}: missing {missing}, unexpected {unexpected}"
        for score, fmt, flags, missing, unexpected in candidates
        if score == best
    ]
    raise ValueError(f"{what} keys match no supported layout exactly; closest:\n" + "\n".join(lines))


# ------------------------------------------------------------------------------------------------- shapes


def _allowed_shapes(spec: tuple[str, ...], dims: Mapping[str, int]) -> list[tuple[int, ...]]:
    """The sizes of `spec`'s letters (weights.size), with and without its "?" axes."""
    from jaxattn.models.weights import size

    with_heads = size([a.rstrip("?") for a in spec], dims)
    without = size([a for a in spec if not a.endswith("?")], dims)
    return [with_heads] if with_heads == without else [with_heads, without]


def _check_shape(name: str, shape, allowed: list[tuple[int, ...]]) -> None:
    if tuple(shape) not in allowed:
        want = " or ".join(str(s) for s in allowed)
        raise ValueError(f"{name}: expected shape {want}, got {tuple(shape)}")


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
    return jax.device_put(x)  # as jnp.asarray, without the identity program it compiles per shape outside jit


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
        dims = dict(N=N, K=N, H=H, Hv=H, Eq=module.embed_dim, Eo=module.embed_dim, Ek=module.kdim, Ev=module.vdim)
    else:
        dims = dict(
            N=module.num_heads,
            K=module.num_kv_heads,
            H=module.head_dim,
            Hv=module.value_head_dim,
            Eq=module.q_proj.in_features,
            Ek=module.k_proj.in_features,
            Ev=module.v_proj.in_features,
            Eo=module.out_proj.out_features,
        )
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
                raise ValueError(
                    f"{arg}={value} is impossible for torch.nn.MultiheadAttention with "
                    f"embed_dim={E}, num_heads={N} (it must be {implied})"
                )
        separate = "separate" in flags
        Ek = _shape_of(sd, "k_proj_weight", 2)[1] if separate else E
        Ev = _shape_of(sd, "v_proj_weight", 2)[1] if separate else E
        return dict(N=N, K=N, H=H, Hv=H, Eq=E, Ek=Ek, Ev=Ev, Eo=E)
    K = N if num_kv_heads is None else num_kv_heads
    q_rows, Eq = _shape_of(sd, "q_proj.weight", 2)
    v_rows, Ev = _shape_of(sd, "v_proj.weight", 2)
    H = _divide(q_rows, N, f"q_proj.weight rows / num_heads={N}") if head_dim is None else head_dim
    Hv = _divide(v_rows, K, f"v_proj.weight rows / num_kv_heads={K}") if value_head_dim is None else value_head_dim
    dims = dict(
        N=N,
        K=K,
        H=H,
        Hv=Hv,
        Eq=Eq,
        Ek=_shape_of(sd, "k_proj.weight", 2)[1],
        Ev=Ev,
        Eo=_shape_of(sd, "out_proj.weight", 2)[0],
    )
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
                    f"(dims from the kernels: {dict(sorted(dims.items()))})"
                )
        if dims["N"] * dims["H"] != E:
            raise ValueError(
                f"torch.nn.MultiheadAttention needs num_heads * head_dim == embed_dim, got "
                f"{dims['N']} * {dims['H']} != {E}"
            )


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
        raise ValueError(
            f"params_from_torch: unsupported module {type(module).__name__}; expected "
            "torch.nn.MultiheadAttention, torchref.MultiHeadAttention or RelativeMultiHeadAttention"
        )
    return None


def params_from_torch(
    module_or_state_dict,
    *,
    num_heads: int | None = None,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    value_head_dim: int | None = None,
    format: str | None = None,
) -> dict:
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
        passed = dict(
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            value_head_dim=value_head_dim,
            format=format,
        )
        extra = sorted(k for k, v in passed.items() if v is not None)
        if extra:
            raise ValueError(f"params_from_torch: {extra} are read from the module; pass them only with a state_dict")
        state = module_or_state_dict.state_dict()
    elif isinstance(module_or_state_dict, Mapping):
        state = module_or_state_dict
    else:
        raise ValueError(
            "params_from_torch: expected a torch attention module or a state_dict mapping, got "
            f"{type(module_or_state_dict).__name__}"
        )
    if format is not None and format not in _FORMATS:
        raise ValueError(f"format: expected one of {list(_FORMATS)}, got {format!r}")
    searched = [fmt or format] if (fmt or format) else list(_FORMATS)
    fmt, flags = _identify(searched, set(state), _tensor_names, "state_dict")
    if module_or_state_dict is state:
        dims = _dims_from_state_dict(fmt, flags, state, num_heads, num_kv_heads, head_dim, value_head_dim)
    else:
        dims = _dims_from_module(fmt, module_or_state_dict)
    _check_dims(fmt, dims)
    return _nest(_leaves_from_torch(_rows(fmt, flags), state, dims))


def _leaves_from_torch(rows: list[Row], state: Mapping[str, Any], dims) -> dict[tuple[str, ...], Any]:
    """The table read forwards: each tensor's shape checked, then each of its leaves made by its transform."""
    leaves = {}
    for r in rows:
        tensor = to_numpy(state[r.name])
        _check_shape(r.name, tensor.shape, _allowed_shapes(r.shape, dims))
        for t in r.targets:
            shape = _allowed_shapes(t.shape, dims)[0 if tensor.ndim == len(r.shape) else -1]
            leaves[tuple(t.path.split("/"))] = to_jax(t.transform.leaf(tensor, shape), r.name)
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
    _, flags = _identify([format], {"/".join(p) for p in leaves}, _leaf_paths, "params")
    dims = _dims_from_params(leaves)
    _check_dims(format, dims)
    if format == "torch":  # packed and separate share one params key set; torch picks by kdim/vdim
        packed = dims["Ek"] == dims["Eq"] == dims["Ev"]
        flags = flags - {"packed", "separate"} | {"packed" if packed else "separate"}
    return _torch_from_leaves(_rows(format, flags), leaves, dims)


def _torch_from_leaves(rows: list[Row], leaves, dims) -> "OrderedDict[str, Any]":
    """The table read backwards: each tensor from its leaves (weights.unapply: packed blocks side by side)."""
    from jaxattn.models import weights

    state: OrderedDict[str, Any] = OrderedDict()
    for r in rows:
        parts = []
        for t in r.targets:
            leaf = leaves[tuple(t.path.split("/"))]
            _check_shape(f"params['{t.path}']", leaf.shape, _allowed_shapes(t.shape, dims))
            parts.append((t.transform, leaf))
        if len({leaf.dtype for _, leaf in parts}) > 1:
            raise ValueError(
                f"{r.name} packs {[t.path for t in r.targets]}, which must share one "
                f"dtype, got {[str(leaf.dtype) for _, leaf in parts]}"
            )
        shape = _allowed_shapes(r.shape, dims)[0 if parts[0][1].ndim == len(r.targets[0].shape) else -1]
        state[r.name] = _to_torch(weights.unapply(r.name, parts, shape))
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
