"""jaxattn's relative-position forms and multi-head layers against torchref, the plain-torch oracle.

Both sides share the layout, so tables are params with the same tree on both sides. Sizes: B=2, T=5, S=7,
N=3, H=11, Hv=13, max_distance=4 (R=9, clipping the offsets -6..4 of T=5 queries on S=7 keys); grouped-query
cases use N=6 on K=2. The sizes match crosscheck.cases.torch_nn's, so eager runs reuse each other's compiles.
"""

from __future__ import annotations

from crosscheck.catalogue import (
    Const,
    Setup,
    blocked,
    normal,
    randomize,
    register_case,
    rng_for,
    to_numpy_tree,
    torch_params,
)

B, T, S, N, H, Hv, MAX_DISTANCE = 2, 5, 7, 3, 11, 13, 4
R = 2 * MAX_DISTANCE + 1


def _qkv(rng, *, N=N, K=N):
    return {"query": normal(rng, (B, T, N, H)), "key": normal(rng, (B, S, K, H)), "value": normal(rng, (B, S, K, Hv))}


def _relative_setup(name: str, *, heads: int, causal: bool = False, weights: bool = False) -> Setup:
    """relative_attention with per-pair tables A^K [T,S,heads,H], A^V [T,S,heads,Hv]."""
    import jaxattn
    import torchref

    rng = rng_for(name)
    params = {"rel_key": normal(rng, (T, S, heads, H)), "rel_value": normal(rng, (T, S, heads, Hv))}
    inputs = _qkv(rng) | {"mask": Const(~blocked(rng, (B, 1, T, S)))}

    def call(module, p, query, key, value, mask):
        return module.relative_attention(
            query, key, value, p["rel_key"], p["rel_value"], mask=mask, is_causal=causal, return_weights=weights
        )

    return Setup(lambda p, **x: call(jaxattn, p, **x), lambda p, **x: call(torchref, p, **x), inputs, params=params)


def _relative_blockwise_setup(name: str, *, heads: int) -> Setup:
    """relative_attention through the blockwise engine (tiles 2x3, so T and S are not tile multiples), causal
    T<S, per-pair tables A^K [T,S,heads,H], A^V [T,S,heads,Hv]."""
    import jaxattn
    import torchref

    rng = rng_for(name)
    params = {"rel_key": normal(rng, (T, S, heads, H)), "rel_value": normal(rng, (T, S, heads, Hv))}

    def call(module, p, query, key, value, **engine):
        return module.relative_attention(query, key, value, p["rel_key"], p["rel_value"], is_causal=True, **engine)

    return Setup(
        lambda p, **x: call(jaxattn, p, **x, implementation="blockwise", block_size=(2, 3)),
        lambda p, **x: call(torchref, p, **x),
        _qkv(rng),
        params=params,
    )


def _shaw_setup(
    name: str, *, per_head: bool, causal: bool = False, weights: bool = False, N: int = N, K: int = N
) -> Setup:
    """shaw_relative_attention with clipped tables [R,(N,)H] / [R,(N,)Hv]."""
    import jaxattn
    import torchref

    rng = rng_for(name)
    heads = (N,) if per_head else ()
    params = {"key_table": normal(rng, (R, *heads, H)), "value_table": normal(rng, (R, *heads, Hv))}

    def call(module, p, query, key, value):
        return module.shaw_relative_attention(
            query,
            key,
            value,
            p["key_table"],
            p["value_table"],
            max_distance=MAX_DISTANCE,
            is_causal=causal,
            return_weights=weights,
        )

    return Setup(
        lambda p, **x: call(jaxattn, p, **x), lambda p, **x: call(torchref, p, **x), _qkv(rng, N=N, K=K), params=params
    )


def module_setup(module, rng, *, causal: bool = False, weights: bool = False) -> Setup:
    """A torchref MultiHeadAttention / RelativeMultiHeadAttention vs jaxattn on params_from_torch(module)."""
    import torch

    import jaxattn
    import torchref
    from crosscheck import params_from_torch

    jax_attention = (
        jaxattn.relative_multi_head_attention
        if isinstance(module, torchref.RelativeMultiHeadAttention)
        else jaxattn.multi_head_attention
    )
    inputs = {
        "query": normal(rng, (B, T, module.q_proj.in_features)),
        "key": normal(rng, (B, S, module.k_proj.in_features)),
        "value": normal(rng, (B, S, module.v_proj.in_features)),
        "mask": Const(~blocked(rng, (B, 1, T, S))),
    }
    call = {"is_causal": causal, "return_weights": weights}

    def torch_fn(params, query, key, value, mask):
        return torch.func.functional_call(module, params, (query, key, value), dict(mask=mask, **call))

    def jax_fn(params, query, key, value, mask):
        return jax_attention(params, query, key, value, mask=mask, **call)

    head_counts = {
        "num_heads": module.num_heads,
        "num_kv_heads": module.num_kv_heads,
        "head_dim": module.head_dim,
        "value_head_dim": module.value_head_dim,
    }
    return Setup(
        jax_fn,
        torch_fn,
        inputs,
        params=to_numpy_tree(params_from_torch(module)),
        torch_params=torch_params(module),
        grads_from_torch=lambda g: params_from_torch(g, format="torchref", **head_counts),
    )


_CASES = {
    "relative_per_head": (
        "relative_attention, A^K/A^V [T,S,N,H], bool mask, weights",
        lambda n: _relative_setup(n, heads=N, weights=True),
    ),
    "relative_shared": (
        "relative_attention, tables shared over heads [T,S,1,H], causal T<S",
        lambda n: _relative_setup(n, heads=1, causal=True),
    ),
    "relative_per_head_blockwise": (
        "relative_attention on the blockwise engine, A^K/A^V [T,S,N,H], causal T<S, tiles 2x3",
        lambda n: _relative_blockwise_setup(n, heads=N),
    ),
    "relative_shared_blockwise": (
        "relative_attention on the blockwise engine, tables shared over heads [T,S,1,H], causal T<S",
        lambda n: _relative_blockwise_setup(n, heads=1),
    ),
    "shaw_shared": (
        "shaw_relative_attention, tables [R,H], weights",
        lambda n: _shaw_setup(n, per_head=False, weights=True),
    ),
    "shaw_per_head_causal_gqa": (
        "shaw_relative_attention, tables [R,N,H], causal T<S, N=6 on K=2 heads",
        lambda n: _shaw_setup(n, per_head=True, causal=True, N=6, K=2),
    ),
    "torchref_mha_gqa": (
        "torchref.MultiHeadAttention, N=6 on K=2 heads, Hv != H, Eq/Ek/Ev/Eo distinct, weights",
        lambda n: _module_case(
            n,
            "MultiHeadAttention",
            weights=True,
            query_features=17,
            num_heads=6,
            head_dim=H,
            num_kv_heads=2,
            value_head_dim=Hv,
            key_features=19,
            value_features=23,
            out_features=29,
        ),
    ),
    "torchref_relative_mha": (
        "torchref.RelativeMultiHeadAttention, per-head tables, Hv != H, causal T<S",
        lambda n: _module_case(
            n,
            "RelativeMultiHeadAttention",
            causal=True,
            query_features=17,
            num_heads=3,
            head_dim=11,
            value_head_dim=13,
            max_distance=MAX_DISTANCE,
        ),
    ),
    "torchref_relative_mha_shared": (
        "torchref.RelativeMultiHeadAttention, shared tables, no bias, weights",
        lambda n: _module_case(
            n,
            "RelativeMultiHeadAttention",
            weights=True,
            query_features=17,
            num_heads=3,
            head_dim=11,
            share_heads=True,
            bias=False,
            max_distance=MAX_DISTANCE,
        ),
    ),
}


def _module_case(name: str, module_type: str, *, causal: bool = False, weights: bool = False, **kwargs) -> Setup:
    import torchref

    rng = rng_for(name)
    module = randomize(getattr(torchref, module_type)(**kwargs), rng)
    return module_setup(module, rng, causal=causal, weights=weights)


def _register(name: str, description: str, build) -> None:
    quick_proof = name in ("shaw_per_head_causal_gqa", "torchref_relative_mha")  # a function and a module
    register_case(name, description=description, default_run=quick_proof)(lambda: build(name))


for _name, (_description, _build) in _CASES.items():
    _register(_name, _description, _build)
