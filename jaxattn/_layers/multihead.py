"""Multi-head attention on a flax-layout parameter tree.

    q[...,t,n,h]  = x_q[...,t,e] Wq[e,n,h] + bq[n,h]        ("...te,enh->...tnh")
    k, v likewise with K heads (Wk [Ek,K,H], Wv [Ev,K,Hv])
    y[...,t,o]    = z[...,t,n,h] Wo[n,h,o] + bo[o]           ("...tnh,nho->...to")

The tree is exactly flax.linen.MultiHeadDotProductAttention's, so the same params drive these functions,
the Flax modules and flax's own layer. Head counts and dims are read from the kernels' shapes.
Extras for converted torch modules: "bias_kv" ({"key": [K,H], "value": [K,Hv]}, torch's add_bias_kv) and
the keyword add_zero_attn; both append key columns that every query may attend (torch's order).
"sinks" [N]: learned per-head attention sinks (gpt-oss), used as the `sinks` keyword.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from .._api import dot_product_attention
from .._core import checks
from .._core.eager import compiled_when_eager
from .._core.masks import allowed_keys
from .._schemes.position_bias import position_bias_attention
from .._schemes.shaw import shaw_relative_attention

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Float

    from .._core.shapes import LayerOutput

_PROJECTIONS = {  # name: (kernel layout, bias layout)
    "query": ("[Eq,N,H]", "[N,H]"),
    "key": ("[Ek,K,H]", "[K,H]"),
    "value": ("[Ev,K,Hv]", "[K,Hv]"),
    "out": ("[N,Hv,Eo]", "[Eo]"),
}
_EXTRAS = ("bias_kv", "relative", "sinks")


def _entry(params, name):
    if not isinstance(params, dict) and not hasattr(params, "keys"):
        checks.fail("params", "a dict with 'query', 'key', 'value', 'out'", type(params).__name__)
    if name not in params or "kernel" not in params[name]:
        checks.fail(
            f"params['{name}']",
            "an entry with a 'kernel'",
            f"keys {sorted(params)}" if name not in params else f"keys {sorted(params[name])}",
        )
    return params[name]


def head_dims(params, *, allow=_EXTRAS):
    """Validate the tree's shapes against each other; return (N, K, H, Hv)."""
    unknown = sorted(set(params) - set(_PROJECTIONS) - set(allow))
    if unknown:
        checks.fail("params", f"keys among {sorted(_PROJECTIONS) + list(allow)}", f"unexpected keys {unknown}")
    wq, wk, wv, wo = (jnp.asarray(_entry(params, n)["kernel"]) for n in ("query", "key", "value", "out"))
    checks.check_rank("params['query']['kernel']", wq, 3, "[Eq,N,H]")
    _, N, H = wq.shape
    checks.check_rank("params['key']['kernel']", wk, 3, "[Ek,K,H]")
    K = wk.shape[1]
    checks.check_dim("params['key']['kernel']", wk, 2, H, "[Ek,K,H]")
    if N % K != 0:
        checks.fail(
            "params['key']['kernel']",
            f"K dividing N={N} (from params['query']['kernel'])",
            f"K={K} in shape {checks.shape_str(wk.shape)}",
        )
    checks.check_rank("params['value']['kernel']", wv, 3, "[Ev,K,Hv]")
    checks.check_dim("params['value']['kernel']", wv, 1, K, "[Ev,K,Hv]")
    Hv = wv.shape[2]
    checks.check_rank("params['out']['kernel']", wo, 3, "[N,Hv,Eo]")
    checks.check_shape("params['out']['kernel']", wo, (N, Hv, wo.shape[2]), "[N,Hv,Eo]")
    expected_bias = {"query": (N, H), "key": (K, H), "value": (K, Hv), "out": (wo.shape[2],)}
    for name, shape in expected_bias.items():
        if "bias" in params[name]:
            checks.check_shape(
                f"params['{name}']['bias']", jnp.asarray(params[name]["bias"]), shape, _PROJECTIONS[name][1]
            )
    if "sinks" in params:
        checks.check_shape("params['sinks']", jnp.asarray(params["sinks"]), (N,), "[N]: one sink logit per head")
    if "bias_kv" in params:
        bkv = params["bias_kv"]
        checks.check_shape("params['bias_kv']['key']", jnp.asarray(bkv["key"]), (K, H), "[K,H]")
        checks.check_shape("params['bias_kv']['value']", jnp.asarray(bkv["value"]), (K, Hv), "[K,Hv]")
    return N, K, H, Hv


def _dense(name, params, x, spec, precision):
    entry = params[name]
    kernel = jnp.asarray(entry["kernel"])
    layout = _PROJECTIONS[name][0]
    checks.check_min_rank(f"{name} input", x, 2, "[...,T,E]" if name != "out" else "[...,T,N,Hv]")
    features = kernel.shape[0] if name != "out" else kernel.shape[:2]
    got = x.shape[-1] if name != "out" else x.shape[-2:]
    if got != features:
        checks.fail(
            name if name != "out" else "attention output",
            f"features {features} to match params['{name}']['kernel'] {layout}={checks.shape_str(kernel.shape)}",
            f"shape {checks.shape_str(x.shape)}",
        )
    checks.check_same_dtype((name, f"params['{name}']['kernel']"), (x, kernel))
    y = jnp.einsum(spec, x, kernel, precision=precision)
    return y + entry["bias"] if "bias" in entry else y


def project_qkv(
    params,
    query: Float[ArrayLike, "*#B T Eq"],
    key: Float[ArrayLike, "*#B S Ek"] | None = None,
    value: Float[ArrayLike, "*#B S Ev"] | None = None,
    *,
    precision=None,
) -> tuple[Float[Array, "*#B T N H"], Float[Array, "*#B S K H"], Float[Array, "*#B S K Hv"]]:
    """[...,T,Eq], [...,S,Ek], [...,S,Ev] -> q [...,T,N,H], k [...,S,K,H], v [...,S,K,Hv]."""
    query = jnp.asarray(query)
    key = query if key is None else jnp.asarray(key)
    value = key if value is None else jnp.asarray(value)
    q = _dense("query", params, query, "...te,enh->...tnh", precision)
    k = _dense("key", params, key, "...se,ekh->...skh", precision)
    v = _dense("value", params, value, "...se,ekh->...skh", precision)
    return q, k, v


def project_out(params, z: Float[ArrayLike, "*#B T N Hv"], *, precision=None) -> Float[Array, "*#B T Eo"]:
    """[...,T,N,Hv] -> [...,T,Eo]."""
    return _dense("out", params, z, "...tnh,nho->...to", precision)


def project_result(params, result, *, precision=None):
    """project_out on an attention result: z [...,T,N,Hv], or (z, weights) -> (out, weights)."""
    if isinstance(result, tuple):
        z, weights = result
        return project_out(params, z, precision=precision), weights
    return project_out(params, result, precision=precision)


def _append_keys(params, q, k, v, add_zero_attn, options):
    """torch's add_bias_kv / add_zero_attn: extra key columns after the S real ones, always attendable.

    Masking that depends on S (causal, lengths, user masks and biases) is resolved on the real keys
    first, then padded with "allowed" columns, so the extra columns never shift anyone's positions.
    """
    extras = []
    if "bias_kv" in params:
        extras.append((params["bias_kv"]["key"], params["bias_kv"]["value"]))
    if add_zero_attn:
        extras.append((jnp.zeros(k.shape[-2:], k.dtype), jnp.zeros(v.shape[-2:], v.dtype)))
    if not extras:
        return k, v, options
    rules = [
        name
        for name in ("window", "chunk_size", "query_segment_ids", "key_segment_ids")
        if options.get(name) is not None
    ]
    if rules:
        checks.fail(
            "/".join(rules),
            "None with add_bias_kv / add_zero_attn (torch's extra key columns have no position)",
            "a value",
        )
    batch = jnp.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    T, N = q.shape[-3:-1]
    S = k.shape[-3]
    new_k = [jnp.broadcast_to(jnp.asarray(ek, k.dtype), (*batch, 1, *k.shape[-2:])) for ek, _ in extras]
    new_v = [jnp.broadcast_to(jnp.asarray(ev, v.dtype), (*batch, 1, *v.shape[-2:])) for _, ev in extras]
    k = jnp.concatenate([jnp.broadcast_to(k, (*batch, *k.shape[-3:])), *new_k], axis=-3)
    v = jnp.concatenate([jnp.broadcast_to(v, (*batch, *v.shape[-3:])), *new_v], axis=-3)

    options = dict(options)
    logits_shape = (*batch, N, T, S)
    allowed = allowed_keys(
        logits_shape,
        mask=options.pop("mask", None),
        is_causal=options.pop("is_causal", False),
        key_value_seq_lengths=options.pop("key_value_seq_lengths", None),
        query_positions=options.pop("query_positions", None),
        key_positions=options.pop("key_positions", None),
    )
    pad = [(0, 0)] * (len(logits_shape) - 1) + [(0, len(extras))]
    if allowed is not None:
        allowed = jnp.broadcast_to(allowed, jnp.broadcast_shapes(allowed.shape, (1,) * len(logits_shape)))
        options["mask"] = jnp.pad(allowed, pad[-allowed.ndim :], constant_values=True)
    if options.get("bias") is not None:
        bias = jnp.asarray(options["bias"])
        checks.check_broadcastable("bias", bias, logits_shape, "[...,N,T,S]")
        bias = jnp.broadcast_to(bias, jnp.broadcast_shapes(bias.shape, (1,) * len(logits_shape)))
        options["bias"] = jnp.pad(bias, pad[-bias.ndim :])
    return k, v, options


@compiled_when_eager
def multi_head_attention(
    params,
    query: Float[ArrayLike, "*#B T Eq"],
    key: Float[ArrayLike, "*#B S Ek"] | None = None,
    value: Float[ArrayLike, "*#B S Ev"] | None = None,
    *,
    add_zero_attn=False,
    precision=None,
    **options,
) -> LayerOutput:
    """Project, attend (dot_product_attention), project out.

    query [...,T,Eq]; key [...,S,Ek] defaults to query, value [...,S,Ev] to key (self-attention).
    Keywords as dot_product_attention (mask/bias [...,N,T,S] over the S real keys), plus add_zero_attn
    (torch's option: one zero key/value column appended) and position_bias (a hook of the positions, as
    jaxattn.position_bias_attention's: T5's t5_position_bias, ALiBi's alibi_position_bias).
    Returns [...,T,Eo] (or (out, weights)).
    """
    head_dims(params, allow=("bias_kv", "sinks"))
    options = with_param_sinks(params, options)
    q, k, v = project_qkv(params, query, key, value, precision=precision)
    k, v, options = _append_keys(params, q, k, v, add_zero_attn, options)
    result = attend_heads(q, k, v, precision=precision, **options)
    return project_result(params, result, precision=precision)


def attend_heads(q, k, v, *, precision=None, position_bias=None, **options):
    """The layers' attention of projected heads: dot_product_attention, or position_bias_attention with a
    position bias hook (T5's buckets, ALiBi), which the blockwise engine and the GPU kernel evaluate tile by
    tile instead of an [...,N,T,S] bias array."""
    if position_bias is None:
        return dot_product_attention(q, k, v, precision=precision, **options)
    return position_bias_attention(q, k, v, position_bias, precision=precision, **options)


def with_param_sinks(params, options):
    """options with sinks=params["sinks"] when the tree has learned sinks (gpt-oss); never both."""
    if "sinks" not in params:
        return options
    if options.get("sinks") is not None:
        checks.fail("sinks", "None when params has a 'sinks' entry (the learned sinks are used)", "an array")
    return {**options, "sinks": params["sinks"]}


def relative_tables(params):
    """(key_table, value_table, max_distance) from params['relative']."""
    if "relative" not in params:
        checks.fail("params", "a 'relative' entry with 'key' and/or 'value' tables", f"keys {sorted(params)}")
    rel = params["relative"]
    unknown = sorted(set(rel) - {"key", "value"})
    if unknown or not rel:
        checks.fail("params['relative']", "keys among ['key', 'value']", f"keys {sorted(rel)}")
    R = {jnp.shape(t)[0] for t in rel.values()}
    (rows,) = R if len(R) == 1 else (None,)
    if rows is None or rows % 2 != 1:
        checks.fail(
            "params['relative']",
            "tables with one odd number of rows R = 2*max_distance+1",
            {n: checks.shape_str(jnp.shape(t)) for n, t in rel.items()},
        )
    return rel.get("key"), rel.get("value"), (rows - 1) // 2


@compiled_when_eager
def relative_multi_head_attention(
    params,
    query: Float[ArrayLike, "*#B T Eq"],
    key: Float[ArrayLike, "*#B S Ek"] | None = None,
    value: Float[ArrayLike, "*#B S Ev"] | None = None,
    *,
    precision=None,
    **options,
) -> LayerOutput:
    """multi_head_attention with Shaw tables from params['relative'] (see shaw_relative_attention)."""
    head_dims(params, allow=("relative", "sinks"))
    options = with_param_sinks(params, options)
    key_table, value_table, max_distance = relative_tables(params)
    q, k, v = project_qkv(params, query, key, value, precision=precision)
    result = shaw_relative_attention(
        q, k, v, key_table, value_table, max_distance=max_distance, precision=precision, **options
    )
    return project_result(params, result, precision=precision)


def _kernel_init(fan_in_axes, out_axes):
    return jax.nn.initializers.lecun_normal(in_axis=fan_in_axes, out_axis=out_axes)


def init_multi_head_attention(
    rng,
    query_features: int,
    num_heads: int,
    head_dim: int | None = None,
    *,
    key_features: int | None = None,
    value_features: int | None = None,
    out_features: int | None = None,
    num_kv_heads: int | None = None,
    value_head_dim: int | None = None,
    use_bias: bool = True,
    dtype=jnp.float32,
    kernel_init=None,
    bias_init=None,
):
    """Fresh params in the flax layout (flax's defaults: lecun_normal kernels over the fan-in, zero biases).

    head_dim defaults to query_features // num_heads, num_kv_heads to num_heads, value_head_dim to
    head_dim, key_features to query_features, value_features to key_features, out_features to
    query_features. kernel_init(key, shape, dtype) / bias_init override the initialisers.
    """
    if head_dim is None:
        if query_features % num_heads:
            checks.fail(
                "head_dim", f"given, or query_features={query_features} divisible by num_heads={num_heads}", None
            )
        head_dim = query_features // num_heads
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    if num_heads % num_kv_heads:
        checks.fail("num_kv_heads", f"a divisor of num_heads={num_heads}", num_kv_heads)
    value_head_dim = head_dim if value_head_dim is None else value_head_dim
    key_features = query_features if key_features is None else key_features
    value_features = key_features if value_features is None else value_features
    out_features = query_features if out_features is None else out_features
    shapes = {
        "query": ((query_features, num_heads, head_dim), (0, (1, 2))),
        "key": ((key_features, num_kv_heads, head_dim), (0, (1, 2))),
        "value": ((value_features, num_kv_heads, value_head_dim), (0, (1, 2))),
        "out": ((num_heads, value_head_dim, out_features), ((0, 1), 2)),
    }
    bias_init = bias_init or jax.nn.initializers.zeros
    params = {}
    for rng_n, (name, (shape, (fan_in, fan_out))) in zip(jax.random.split(rng, 4), shapes.items()):
        init = kernel_init or _kernel_init(fan_in, fan_out)
        params[name] = {"kernel": init(rng_n, shape, dtype)}
        if use_bias:
            bias_shape = shape[1:] if name != "out" else shape[2:]
            params[name]["bias"] = bias_init(rng_n, bias_shape, dtype)
    return params


def init_relative_multi_head_attention(
    rng,
    query_features: int,
    num_heads: int,
    head_dim: int | None = None,
    *,
    max_distance: int,
    share_heads: bool = False,
    key_table: bool = True,
    value_table: bool = True,
    table_init=None,
    **kwargs,
):
    """init_multi_head_attention plus params['relative'] Shaw tables ([R,N,H] or [R,H] if share_heads)."""
    rng_mha, rng_k, rng_v = jax.random.split(rng, 3)
    params = init_multi_head_attention(rng_mha, query_features, num_heads, head_dim, **kwargs)
    R = 2 * checks.check_max_distance(max_distance) + 1
    N, _, H, Hv = head_dims(params, allow=())
    table_init = table_init or jax.nn.initializers.normal(0.02)
    dtype = params["query"]["kernel"].dtype
    heads = () if share_heads else (N,)
    rel = {}
    if key_table:
        rel["key"] = table_init(rng_k, (R, *heads, H), dtype)
    if value_table:
        rel["value"] = table_init(rng_v, (R, *heads, Hv), dtype)
    params["relative"] = rel
    return params
