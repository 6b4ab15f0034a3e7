"""`python -m crosscheck --weights FILE`: a real checkpoint, run in torch and in jaxattn on random inputs.

The state_dict's layout is identified by params_from_torch (exact key sets): torch.nn.MultiheadAttention, or
a torchref MultiHeadAttention / RelativeMultiHeadAttention. The matching torch module is rebuilt around the
file's tensors (load_state_dict(strict=True)) and compared like the built-in cases.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from crosscheck.catalogue import Setup, rng_for


def weights_setup(
    path: Path,
    *,
    num_heads: int,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    value_head_dim: int | None = None,
    add_zero_attn: bool = False,
) -> tuple[Setup, str]:
    """(Setup, description) for the state_dict in `path`; ValueError if no supported module matches it."""
    import torch

    from crosscheck import load_state_dict, params_from_torch

    state = load_state_dict(path)
    heads = {
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "value_head_dim": value_head_dim,
    }
    errors = {}
    for fmt in ("torch", "torchref"):
        try:
            params = params_from_torch(state, format=fmt, **heads)
            break
        except ValueError as error:
            errors[fmt] = str(error)
    else:
        raise ValueError(
            f"{path}: not a state_dict of a supported module: "
            + "; ".join(f"as {fmt}: {e}" for fmt, e in errors.items())
        )
    rng = rng_for(f"weights:{path.name}")
    tensors = {k: torch.from_numpy(np.array(v, dtype=np.float64)) for k, v in state.items()}
    if fmt == "torch":
        module, setup = _torch_module(params, tensors, add_zero_attn, rng)
    else:
        if add_zero_attn:
            raise ValueError("--add-zero-attn applies to torch.nn.MultiheadAttention only, not torchref modules")
        module, setup = _torchref_module(params, tensors, rng)
    sizes = ", ".join(f"{k}={v}" for k, v in _dims(params).items())
    return setup, f"{type(module).__name__} from {path.name} ({sizes})"


def _dims(params) -> dict[str, int]:
    Eq, N, H = params["query"]["kernel"].shape
    Ek, K, _ = params["key"]["kernel"].shape
    Ev, _, Hv = params["value"]["kernel"].shape
    Eo = params["out"]["kernel"].shape[-1]
    return {"Eq": Eq, "Ek": Ek, "Ev": Ev, "Eo": Eo, "N": N, "K": K, "H": H, "Hv": Hv}


def _torch_module(params, tensors, add_zero_attn, rng):
    import torch

    from crosscheck.cases.torch_nn import mha_setup

    d = _dims(params)
    module = torch.nn.MultiheadAttention(
        d["Eq"],
        d["N"],
        bias="bias" in params["query"],
        add_bias_kv="bias_kv" in params,
        add_zero_attn=add_zero_attn,
        kdim=d["Ek"],
        vdim=d["Ev"],
        batch_first=True,
        dtype=torch.float64,
    )
    module.load_state_dict(tensors, strict=True)
    return module, mha_setup(module, rng, weights="per_head")


def _torchref_module(params, tensors, rng):
    import torch

    import torchref
    from crosscheck.cases.relative import module_setup

    d = _dims(params)
    common = dict(
        query_features=d["Eq"],
        num_heads=d["N"],
        head_dim=d["H"],
        key_features=d["Ek"],
        value_features=d["Ev"],
        out_features=d["Eo"],
        num_kv_heads=d["K"],
        value_head_dim=d["Hv"],
        bias="bias" in params["query"],
        dtype=torch.float64,
    )
    if "relative" in params:
        tables = params["relative"]
        some = next(iter(tables.values()))
        module = torchref.RelativeMultiHeadAttention(
            **common,
            max_distance=(some.shape[0] - 1) // 2,
            share_heads=some.ndim == 2,
            use_key_table="key" in tables,
            use_value_table="value" in tables,
        )
    else:
        module = torchref.MultiHeadAttention(**common)
    module.load_state_dict(tensors, strict=True)
    return module, module_setup(module, rng, weights=True)
