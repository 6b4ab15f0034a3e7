"""What the linen and nnx attention layers share: the parameter tree they declare and the one call they make.

Both layers declare exactly the tree of docs/design.md, "The parameter tree" (plus bias_kv or
relative/{key,value}), built from `param_specs`, and both compute through `attend`, which is the functional
API itself (multi_head_attention / relative_multi_head_attention) or, when decoding, the same projections
and attention around a key/value cache (cache.py).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from .._core import checks
from .._core.eager import compiled_when_eager
from .._core.positions import positions as absolute_positions
from .._schemes.rope import apply_rope
from .._schemes.shaw import shaw_relative_attention
from . import cache as kv_cache
from .multihead import (
    attend_heads,
    head_dims,
    multi_head_attention,
    project_qkv,
    project_result,
    relative_multi_head_attention,
    relative_tables,
    with_param_sinks,
)

Initializer = Callable[[Any, tuple, Any], jax.Array]  # flax's convention: init(rng, shape, dtype)

default_kernel_init = jax.nn.initializers.lecun_normal()
default_bias_init = jax.nn.initializers.zeros
default_table_init = jax.nn.initializers.normal(0.02)


@dataclasses.dataclass(frozen=True)
class RoPE:
    """Rotary embeddings inside a layer: queries and keys rotated after projection, before attention.

    base, rotary_dim, layout: as jaxattn.apply_rope. frequencies: the inverse frequencies [rotary_dim/2]
    (a tuple; scaled variants such as HF's "linear" / "llama3") instead of base ** (-2k / rotary_dim).
    """

    base: float = 10000.0
    rotary_dim: Optional[int] = None
    layout: str = "half"
    frequencies: Optional[tuple] = None

    def options(self) -> dict:
        return dict(base=self.base, rotary_dim=self.rotary_dim, layout=self.layout, frequencies=self.frequencies)


_GROUPS = ("query", "key", "value", "out")


def bias_groups(use_bias) -> tuple[str, ...]:
    """use_bias: True (all four projections), False (none), or the names of the biased ones."""
    if isinstance(use_bias, bool):
        return _GROUPS if use_bias else ()
    names = (use_bias,) if isinstance(use_bias, str) else tuple(use_bias)
    if any(n not in _GROUPS for n in names):
        checks.fail("use_bias", f"a bool or names among {_GROUPS}", repr(use_bias))
    return names


def check_rope(rope) -> Optional[RoPE]:
    if rope is not None and not isinstance(rope, RoPE):
        checks.fail("rope", "None or a RoPE(base=..., rotary_dim=..., layout=..., frequencies=...)", repr(rope))
    return rope


@dataclasses.dataclass(frozen=True)
class Dims:
    """Feature and head sizes in the letters of docs/design.md, "Axis letters"."""

    Eq: int
    Ek: int
    Ev: int
    Eo: int
    N: int
    K: int
    H: int
    Hv: int


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        checks.fail(name, "a positive int", repr(value))
    return value


def resolve_dims(
    query_features,
    num_heads,
    head_dim=None,
    *,
    key_features=None,
    value_features=None,
    out_features=None,
    num_kv_heads=None,
    value_head_dim=None,
) -> Dims:
    """Fill the defaults (as init_multi_head_attention does) and validate every size."""
    N = _positive("num_heads", num_heads)
    Eq = _positive("query_features", query_features)
    if head_dim is None and Eq % N:
        checks.fail("head_dim", f"given, or query_features={Eq} divisible by num_heads={N}", None)
    H = _positive("head_dim", Eq // N if head_dim is None else head_dim)
    K = _positive("num_kv_heads", N if num_kv_heads is None else num_kv_heads)
    if N % K:
        checks.fail("num_kv_heads", f"a divisor of num_heads={N}", K)
    Ek = _positive("key_features", Eq if key_features is None else key_features)
    Ev = _positive("value_features", Ek if value_features is None else value_features)
    return Dims(
        Eq=Eq,
        Ek=Ek,
        Ev=Ev,
        Eo=_positive("out_features", Eq if out_features is None else out_features),
        N=N,
        K=K,
        H=H,
        Hv=_positive("value_head_dim", H if value_head_dim is None else value_head_dim),
    )


def _one_of(ours: str, value, flax_name: str, flax_value):
    """One spelling of a size: ours, or flax's name for the same thing; both is an error."""
    if value is not None and flax_value is not None:
        checks.fail(
            f"{ours}/{flax_name}",
            f"one of them ({flax_name} is flax's name for {ours})",
            f"{ours}={value!r} and {flax_name}={flax_value!r}",
        )
    return flax_value if value is None else value


def flax_sizes(
    num_heads,
    *,
    query_features=None,
    head_dim=None,
    key_features=None,
    value_features=None,
    in_features=None,
    qkv_features=None,
    in_kv_features=None,
) -> dict:
    """Our size arguments from either spelling: flax's in_features = query_features, in_kv_features =
    key_features = value_features, qkv_features = num_heads * head_dim (flax's per-head dim is
    qkv_features // num_heads). Returns dict(query_features, head_dim, key_features, value_features)."""
    query_features = _one_of("query_features", query_features, "in_features", in_features)
    key_features = _one_of("key_features", key_features, "in_kv_features", in_kv_features)
    value_features = _one_of("value_features", value_features, "in_kv_features", in_kv_features)
    if qkv_features is not None:
        N, total = _positive("num_heads", num_heads), _positive("qkv_features", qkv_features)
        if total % N:
            checks.fail("qkv_features", f"a multiple of num_heads={N} (flax: num_heads * head_dim)", total)
        head_dim = _one_of("head_dim", head_dim, "qkv_features // num_heads", total // N)
    return dict(
        query_features=query_features, head_dim=head_dim, key_features=key_features, value_features=value_features
    )


def flat_kernel_init(init: Initializer, fan_in_dims: int) -> Initializer:
    """Call `init` on the 2-D [fan_in, fan_out] view and reshape, as flax's DenseGeneral does.

    So any flax initialiser (lecun_normal, xavier_uniform, ...) sees the true fan-in and fan-out of
    a [Eq,N,H] or [N,Hv,Eo] kernel rather than reading them off its last two axes.
    """

    def kernel_init(rng, shape, dtype=jnp.float32):
        flat = (math.prod(shape[:fan_in_dims]), math.prod(shape[fan_in_dims:]))
        return jnp.reshape(init(rng, flat, dtype), shape)

    return kernel_init


def param_specs(
    d: Dims,
    *,
    use_bias=True,
    add_bias_kv=False,
    kernel_init=default_kernel_init,
    out_kernel_init=None,
    bias_init=default_bias_init,
    bias_kv_init=default_table_init,
    relative: Optional[dict] = None,
    sinks_init: Optional[Initializer] = None,
    out_bias_init: Optional[Initializer] = None,
) -> dict:
    """{group: {leaf: (shape, init)}} as in docs/design.md, "The parameter tree"; "sinks": (shape [N], init) on top.

    relative: None, or dict(max_distance, share_heads, use_key_table, use_value_table, table_init).
    sinks_init: None (no sinks) or the initialiser of learned per-head sinks [N] (gpt-oss).
    out_bias_init: the out projection's bias initialiser (default bias_init), flax's out_bias_init.
    """
    kernel_in = flat_kernel_init(kernel_init, 1)
    kernel_out = flat_kernel_init(out_kernel_init or kernel_init, 2)
    groups = {
        "query": ((d.Eq, d.N, d.H), (d.N, d.H), kernel_in),
        "key": ((d.Ek, d.K, d.H), (d.K, d.H), kernel_in),
        "value": ((d.Ev, d.K, d.Hv), (d.K, d.Hv), kernel_in),
        "out": ((d.N, d.Hv, d.Eo), (d.Eo,), kernel_out),
    }
    specs = {}
    biased = bias_groups(use_bias)
    for name, (kernel_shape, bias_shape, init) in groups.items():
        specs[name] = {"kernel": (kernel_shape, init)}
        if name in biased:
            specs[name]["bias"] = (bias_shape, (out_bias_init or bias_init) if name == "out" else bias_init)
    if add_bias_kv:
        specs["bias_kv"] = {"key": ((d.K, d.H), bias_kv_init), "value": ((d.K, d.Hv), bias_kv_init)}
    if relative is not None:
        max_distance = checks.check_max_distance(relative["max_distance"])
        if not (relative["use_key_table"] or relative["use_value_table"]):
            checks.fail("use_key_table/use_value_table", "at least one table", "neither")
        R, heads = 2 * max_distance + 1, (() if relative["share_heads"] else (d.N,))
        tables = {"key": (R, *heads, d.H), "value": (R, *heads, d.Hv)}
        specs["relative"] = {
            name: (shape, relative["table_init"]) for name, shape in tables.items() if relative[f"use_{name}_table"]
        }
    if sinks_init is not None:
        specs["sinks"] = ((d.N,), sinks_init)
    return specs


def layer_dtype(dtype, params, *arrays):
    """flax's rule: the layer's `dtype` if set, else the promotion of the inputs and the params."""
    if dtype is not None:
        return jnp.dtype(dtype)
    return jnp.result_type(*arrays, *jax.tree.leaves(params))


def cast(tree, dtype):
    return jax.tree.map(lambda x: jnp.asarray(x, dtype), tree)


def flax_inputs_kv(inputs_kv, key, value):
    """flax's inputs_kv= (key = value = inputs_kv), refused together with key or value."""
    if inputs_kv is None:
        return key, value
    if key is not None or value is not None:
        checks.fail("inputs_kv", "None when key or value is given (flax's rule)", "an array")
    return inputs_kv, inputs_kv


def widen_weights(result, dtype):
    """(out, weights) with the weights in at least `dtype`'s precision (flax's force_fp32_for_softmax returns
    float32 weights for a half-precision layer); wider weights (float64) are kept as they are."""
    out, weights = result
    return out, weights.astype(jnp.promote_types(weights.dtype, dtype))


def weights_to_sow(result, return_weights: bool):
    """(what the call returns, the weights to sow) from a result computed with return_weights=True."""
    out, weights = result
    return (result if return_weights else out), weights


def inputs(query, key, value):
    """Self-attention defaults: key = query, value = key."""
    query = jnp.asarray(query)
    key = query if key is None else jnp.asarray(key)
    value = key if value is None else jnp.asarray(value)
    return query, key, value


def _rotate(q, k, rope: Optional[RoPE], query_positions, key_positions):
    """RoPE on the projected queries [...,T,N,H] and keys [...,S,K,H] at their positions."""
    if rope is None:
        return q, k
    return apply_rope(q, query_positions, **rope.options()), apply_rope(k, key_positions, **rope.options())


def _rope_positions(rope_positions, T: int, S: int, default_query, default_key):
    """Rotary positions: `rope_positions` [...,T] for queries and keys alike (self-attention: the same
    tokens, e.g. HF's position_ids), else the attention's own positions."""
    if rope_positions is None:
        return default_query, default_key
    rope_positions = jnp.asarray(rope_positions)
    checks.check_int("rope_positions", rope_positions)
    checks.check_dim("rope_positions", rope_positions, -1, T, "[...,T]")
    if S != T:
        checks.fail("rope_positions", f"self-attention (as many keys as queries, T={T})", f"S={S} keys")
    return rope_positions, rope_positions


def rolling(window) -> bool:
    """A layer whose window is bounded on the left keeps a rolling cache of that window (cache.rolling_write)."""
    return window is not None and window[0] is not None


def cache_length(window, max_length: int) -> int:
    """Slots of a layer's cache for inputs of up to max_length tokens: its window's, or max_length."""
    return kv_cache.rolling_size(window, max_length) if rolling(window) else max_length


def _project(params, query, key, value, precision, qk_norm):
    """project_qkv, then `qk_norm` (if any) on the projected queries and keys."""
    q, k, v = project_qkv(params, query, key, value, precision=precision)
    return (*qk_norm(q, k), v) if qk_norm is not None else (q, k, v)


def _decode(
    params, query, key, value, cache, *, relative, precision, options, rope=None, rope_positions=None, qk_norm=None
):
    """Project, write the new keys/values into the cache, attend over all its slots, project out.

    With `rope` (and `qk_norm`), the new keys are normalised and rotated before they are written: the cache
    holds them as attention reads them."""
    for name in ("query_positions", "key_positions"):
        if options.pop(name, None) is not None:
            checks.fail(name, "None when decoding (positions come from the cache index)", "an array")
    options.pop("is_causal", None)  # a cache is causal by construction
    for name in ("query_segment_ids", "key_segment_ids"):
        if options.get(name) is not None:
            checks.fail(name, "None when decoding (the cache keeps no segment ids)", "an array")
    head_dims(params, allow=(("relative",) if relative else ()) + ("sinks",))
    options = with_param_sinks(params, options)
    q, k, v = _project(params, query, key, value, precision, qk_norm)
    if rope is not None:
        T = q.shape[-3]
        slots = cache[2][..., None] + jnp.arange(T, dtype=jnp.int32)  # where the new tokens land
        q, k = _rotate(q, k, rope, *_rope_positions(rope_positions, T, k.shape[-3], slots, slots))
    lengths = options.pop("key_value_seq_lengths", None)
    if rolling(options.get("window")):  # an O(window) cache: attend over its slots and this call's tokens
        keys, values, attend_kw, new_cache = kv_cache.rolling_write(*cache, k, v, lengths)
    else:
        cached_key, cached_value, index, attend_kw = kv_cache.write(*cache, k, v, lengths)
        keys, values, new_cache = cached_key, cached_value, (cached_key, cached_value, index)
    if relative:
        key_table, value_table, max_distance = relative_tables(params)
        result = shaw_relative_attention(
            q,
            keys,
            values,
            key_table,
            value_table,
            max_distance=max_distance,
            precision=precision,
            **attend_kw,
            **options,
        )
    else:
        result = attend_heads(q, keys, values, precision=precision, **attend_kw, **options)
    result = project_result(params, result, precision=precision)
    if not rolling(options.get("window")):  # a rolling cache never overflows: it keeps the newest keys
        result = kv_cache.poison_overflow(result, new_cache[2] > new_cache[0].shape[-3])
    return result, new_cache


def _attend_rotary(params, query, key, value, rope, rope_positions, precision, options, qk_norm=None):
    """multi_head_attention's projections and attention, with `qk_norm` and RoPE between them."""
    head_dims(params, allow=("sinks",))
    options = with_param_sinks(params, options)
    q, k, v = _project(params, query, key, value, precision, qk_norm)
    T, S = q.shape[-3], k.shape[-3]
    default = absolute_positions(T, S, options.get("query_positions"), options.get("key_positions"))
    q, k = _rotate(q, k, rope, *_rope_positions(rope_positions, T, S, *default))
    result = attend_heads(q, k, v, precision=precision, **options)
    return project_result(params, result, precision=precision)


@compiled_when_eager(concrete=("cache",))  # the cache's index is checked when known
def attend(
    params,
    query,
    key,
    value,
    *,
    relative: bool,
    add_zero_attn=False,
    precision=None,
    cache=None,
    rope: Optional[RoPE] = None,
    rope_positions=None,
    qk_norm: Optional[Callable] = None,
    **options,
):
    """The layers' forward pass: (result, new_cache), new_cache None unless `cache` was given.

    Without a cache this IS multi_head_attention / relative_multi_head_attention (same numbers).
    cache = (cached_key, cached_value, cache_index): the call's keys/values are new tokens (see cache.py);
    key_value_seq_lengths then counts the real ones among them, mask/bias index the cache's L slots.
    rope: RoPE on queries and keys after projection, at `rope_positions` [...,T] (self-attention) or the
    attention's positions (query t + S - T, key s; decoding: the slots the new tokens land in).
    qk_norm: (q [...,T,N,H], k [...,S,K,H]) -> (q, k), applied to the projected queries and keys before RoPE
    (Qwen 3's and Gemma 3's per-head RMS norms).
    """
    rope = check_rope(rope)
    if relative and options.get("position_bias") is not None:
        checks.fail("position_bias", "None with relative tables (one relative term per layer)", "a function")
    if rope_positions is not None and rope is None:
        checks.fail("rope_positions", "None unless the layer has rope=RoPE(...)", "an array")
    if options.get("broadcast_dropout") and relative:
        checks.fail("broadcast_dropout", "False with relative tables (their engine draws dropout per head)", True)
    for name, given in (("rope", rope), ("qk_norm", qk_norm)):
        if given is not None and (relative or add_zero_attn or "bias_kv" in params):
            checks.fail(name, "None with relative tables, add_zero_attn or add_bias_kv", f"a {type(given).__name__}")
    if cache is not None:
        if add_zero_attn or "bias_kv" in params:
            checks.fail(
                "decode", "a layer without add_zero_attn / add_bias_kv (torch-only extras)", "a layer with them"
            )
        return _decode(
            params,
            query,
            key,
            value,
            cache,
            relative=relative,
            precision=precision,
            options=options,
            rope=rope,
            rope_positions=rope_positions,
            qk_norm=qk_norm,
        )
    if rope is not None or qk_norm is not None:
        return _attend_rotary(params, query, key, value, rope, rope_positions, precision, options, qk_norm), None
    if relative:
        return relative_multi_head_attention(params, query, key, value, precision=precision, **options), None
    return multi_head_attention(
        params, query, key, value, add_zero_attn=add_zero_attn, precision=precision, **options
    ), None
