"""DeBERTa's disentangled attention on the flax-layout parameter tree: the layer a DeBERTa is built from.

    params = {"query", "key", "value", "out"}      as multi_head_attention's (docs/design.md, "The parameter tree")
             "pos_key":   {"kernel": [Er,N,H], "bias": [N,H]}    c2p without share_att_key (HF's pos_key_proj)
             "pos_query": {"kernel": [Er,N,H], "bias": [N,H]}    p2c without share_att_key (HF's pos_query_proj)

    Kr = rel_embeddings [R,Er] through pos_key (through key with share_att_key), Qr through pos_query (query);
    out = project_out(disentangled_attention(q, k, v, Kr, Qr, ...))

HF's DisentangledSelfAttention ends at the heads' concatenation; its DebertaV2SelfOutput.dense is "out" here
(the residual LayerNorm after it is the model's). rel_embeddings is what HF passes each layer: the encoder's
rel_embeddings.weight [2 span, E], after its LayerNorm where the config's norm_rel_ebd says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from .._core import checks
from .._core.eager import compiled_when_eager
from .._schemes.disentangled import disentangled_attention
from .common import bias_groups, flat_kernel_init
from .multihead import head_dims, init_multi_head_attention, project_qkv, project_result

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Float

    from .._core.shapes import LayerOutput

POSITION_TERMS = ("c2p", "p2c")
_OWN_ENTRY = {"c2p": "pos_key", "p2c": "pos_query"}  # the entry projecting each term's table
_SHARED_ENTRY = {"c2p": "key", "p2c": "query"}  # ... with share_att_key


def check_pos_att_type(pos_att_type) -> tuple[str, ...]:
    """HF's pos_att_type as a tuple of distinct terms among ("c2p", "p2c") (a "c2p|p2c" string too)."""
    if isinstance(pos_att_type, str):
        pos_att_type = tuple(t.strip() for t in pos_att_type.lower().split("|") if t.strip())
    terms = tuple(pos_att_type) if isinstance(pos_att_type, (tuple, list)) else None
    if terms is None or any(t not in POSITION_TERMS for t in terms) or len(set(terms)) != len(terms):
        checks.fail("pos_att_type", f"distinct terms among {POSITION_TERMS} (or 'c2p|p2c')", repr(pos_att_type))
    return terms


def position_entries(pos_att_type, share_att_key: bool) -> dict[str, str]:
    """{term: the params entry projecting its table} for the given terms."""
    if not isinstance(share_att_key, bool):
        checks.fail("share_att_key", "True or False", repr(share_att_key))
    return {t: (_SHARED_ENTRY if share_att_key else _OWN_ENTRY)[t] for t in check_pos_att_type(pos_att_type)}


def _check_entries(params, entries: dict[str, str]) -> None:
    """The tree holds exactly the position entries the terms need: none missing, none left unread."""
    own = {_OWN_ENTRY[t] for t, e in entries.items() if e == _OWN_ENTRY[t]}
    present = set(params) & set(_OWN_ENTRY.values())
    if present != own:
        checks.fail(
            "params",
            f"position entries {sorted(own)} (pos_att_type and share_att_key decide them)",
            f"{sorted(present)}",
        )


def disentangled_position_tables(
    params,
    rel_embeddings: Float[ArrayLike, "R Er"],
    *,
    pos_att_type=POSITION_TERMS,
    share_att_key=False,
    precision=None,
) -> tuple[Float[Array, "R N H"] | None, Float[Array, "R N H"] | None]:
    """(position_keys Kr, position_queries Qr), each [R,N,H] or None when its term is not in pos_att_type."""
    entries = position_entries(pos_att_type, share_att_key)
    N, K, H, _ = head_dims(params, allow=tuple(_OWN_ENTRY.values()))
    _check_entries(params, entries)
    rel = jnp.asarray(rel_embeddings)
    checks.check_rank("rel_embeddings", rel, 2, "[R,Er]: one embedding per relative position bucket")
    if share_att_key and "c2p" in entries and K != N:
        checks.fail("share_att_key", f"False with K={K} key heads != N={N} (Kr would have K heads)", True)
    tables = {}
    for term, name in entries.items():
        entry = params[name]
        kernel = jnp.asarray(entry["kernel"])
        layout = "[Er,N,H]" if name.startswith("pos_") else ("[Eq,N,H]" if name == "query" else "[Ek,K,H]")
        checks.check_rank(f"params['{name}']['kernel']", kernel, 3, layout)
        checks.check_shape(f"params['{name}']['kernel']", kernel, (rel.shape[-1], N, H), layout + " and rel [R,Er]")
        checks.check_same_dtype(("rel_embeddings", f"params['{name}']['kernel']"), (rel, kernel))
        table = jnp.einsum("re,enh->rnh", rel, kernel, precision=precision)
        if "bias" in entry:
            bias = jnp.asarray(entry["bias"])
            checks.check_shape(f"params['{name}']['bias']", bias, (N, H), "[N,H]")
            table = table + bias
        tables[term] = table
    return tables.get("c2p"), tables.get("p2c")


def position_specs(dims, position_features: int, entries: dict[str, str], *, use_bias, kernel_init, bias_init) -> dict:
    """The pos_key / pos_query entries among `entries` in common.param_specs' format {entry: {leaf: (shape,
    init)}}: kernels [Er,N,H] initialised over Er, biases [N,H] where the query projection has one."""
    biased = "query" in bias_groups(use_bias)
    specs = {}
    for term, name in entries.items():
        if name == _OWN_ENTRY[term]:
            specs[name] = {"kernel": ((position_features, dims.N, dims.H), flat_kernel_init(kernel_init, 1))}
            if biased:
                specs[name]["bias"] = ((dims.N, dims.H), bias_init)
    return specs


@compiled_when_eager
def disentangled_multi_head_attention(
    params,
    query: Float[ArrayLike, "*#B T Eq"],
    key: Float[ArrayLike, "*#B S Ek"] | None = None,
    value: Float[ArrayLike, "*#B S Ev"] | None = None,
    *,
    rel_embeddings: Float[ArrayLike, "R Er"],
    max_relative_positions: int,
    position_buckets: int = -1,
    pos_att_type=POSITION_TERMS,
    share_att_key: bool = False,
    precision=None,
    **options,
) -> LayerOutput:
    """Project, disentangled_attention, project out (module docstring). query [...,T,Eq]; key [...,S,Ek]
    defaults to query (HF's query_states is `query`, its hidden_states `key`), value to key. Keywords as
    disentangled_attention (mask, key_value_seq_lengths, scale, return_weights, ...). Returns [...,T,Eo]."""
    keys, queries = disentangled_position_tables(
        params, rel_embeddings, pos_att_type=pos_att_type, share_att_key=share_att_key, precision=precision
    )
    q, k, v = project_qkv(params, query, key, value, precision=precision)
    result = disentangled_attention(
        q,
        k,
        v,
        keys,
        queries,
        max_relative_positions=max_relative_positions,
        position_buckets=position_buckets,
        precision=precision,
        **options,
    )
    return project_result(params, result, precision=precision)


def init_disentangled_multi_head_attention(
    rng,
    query_features: int,
    num_heads: int,
    head_dim: int | None = None,
    *,
    pos_att_type=POSITION_TERMS,
    share_att_key: bool = False,
    position_features: int | None = None,
    **kwargs,
):
    """init_multi_head_attention plus the pos_key / pos_query entries the terms need (none with share_att_key):
    kernels [Er,N,H] (Er = position_features, default query_features) lecun-normal over Er, zero biases."""
    entries = position_entries(pos_att_type, share_att_key)
    rng_mha, rng_pos = jax.random.split(rng)
    params = init_multi_head_attention(rng_mha, query_features, num_heads, head_dim, **kwargs)
    N, _, H, _ = head_dims(params, allow=())
    Er = query_features if position_features is None else position_features
    dtype = params["query"]["kernel"].dtype
    init = jax.nn.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
    for rng_n, name in zip(jax.random.split(rng_pos, 2), _OWN_ENTRY.values()):
        if name in entries.values():
            params[name] = {"kernel": init(rng_n, (Er, N, H), dtype)}
            if "bias" in params["query"]:
                params[name]["bias"] = jnp.zeros((N, H), dtype)
    return params
