"""Multi-head latent attention (MLA; DeepSeek V2/V3, Kimi K2) on a flax-style parameter tree.

Letters here, beyond the table of the package docstring: C latent rank of keys/values (kv_lora_rank), R rope
features (qk_rope_head_dim), Hn the query/key features without position (qk_nope_head_dim; the q/k head dim is
H = Hn + R), Cq the query's latent rank (q_lora_rank). From x [...,T,E]:

    q            = x Wq [E,N,Hn+R]  or  rms(x Wq_down [E,Cq]) Wq_up [Cq,N,Hn+R]      -> q_nope [Hn] | q_rope [R]
    latent c     = rms(x W_latent [E,C])                                             [...,T,C]  (cached)
    k_rope       = rope(x W_key_rope [E,R]), one for all heads                       [...,T,R]  (cached)
    q_rope       = rope(q_rope)
    k_nope[s,n]  = c_s W_UK[:,n,:] [C,N,Hn];   v[s,n] = c_s W_UV[:,n,:] [C,N,Hv]
    z[t,n]       = attention(q[t,n] = [q_nope | q_rope],  k[s,n] = [k_nope | k_rope],  v)     scale H ** -0.5
    y            = z Wo [N,Hv,Eo]

Two forms of the same numbers:
  "expanded"  (transformers'): up-project K and V per head, then dot_product_attention over [S,N,H].
  "absorbed"  W_UK folded into the queries (q_nope W_UK^T: [T,N,C]) and W_UV applied after attention: a
              multi-query attention (one key head) over the compressed [c | k_rope] [S,1,C+R] with values c
              [S,1,C], so a decode step reads only C + R numbers per cached token and never builds [S,N,H].
Both run through jaxattn.dot_product_attention, so every keyword (is_causal, key_value_seq_lengths, window,
implementation, ...) applies. RoPE is jaxattn.apply_rope on the rope part only (DeepSeek: layout
"interleaved"; transformers' rope_interleave=True gives the same q.k). DeepSeek V3's yarn mscale enters
through `scale` (H ** -0.5 * mscale ** 2) and its frequencies through `rope_frequencies`.

Parameter tree (bias entries optional, as the checkpoint has them):

    {"query": {"kernel": [E,N,Hn+R]}}                                               (direct queries), or
    {"query_down": {"kernel": [E,Cq]}, "query_norm": {"scale": [Cq]}, "query_up": {"kernel": [Cq,N,Hn+R]}}
    "latent": {"kernel": [E,C]},  "latent_norm": {"scale": [C]},  "key_rope": {"kernel": [E,R]},
    "key_up": {"kernel": [C,N,Hn]},  "value_up": {"kernel": [C,N,Hv]},  "out": {"kernel": [N,Hv,Eo]}

Decode cache: (latent [...,L,C], rope [...,L,R], index int32 [...]), the rotated k_rope and the normalised
latent as transformers caches them; written like the key/value cache (jaxattn/_layers/cache.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp

from .._api import dot_product_attention
from .._core import checks
from .._core.eager import compiled_when_eager
from .._core.norms import rms_normalize
from .._schemes.rope import apply_rope
from . import cache as kv_cache

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Float, Int

    from .._core.shapes import LatentCache, Weights

FORMS = ("absorbed", "expanded")


class LatentQKV(NamedTuple):
    """What the projections give: q_nope [...,T,N,Hn], q_rope [...,T,N,R] (rotated), latent [...,T,C]
    (normalised), k_rope [...,T,R] (rotated)."""

    q_nope: jax.Array
    q_rope: jax.Array
    latent: jax.Array
    k_rope: jax.Array


def _kernel(params, name, rank, layout):
    if name not in params or "kernel" not in params[name]:
        checks.fail(f"params['{name}']", f"an entry with a 'kernel' {layout}", f"keys {sorted(params)}")
    kernel = jnp.asarray(params[name]["kernel"])
    checks.check_rank(f"params['{name}']['kernel']", kernel, rank, layout)
    return kernel


def latent_dims(params):
    """Validate the tree's shapes against each other; return (N, Hn, R, C, Hv)."""
    key_up = _kernel(params, "key_up", 3, "[C,N,Hn]")
    C, N, Hn = key_up.shape
    value_up = _kernel(params, "value_up", 3, "[C,N,Hv]")
    Hv = value_up.shape[2]
    checks.check_shape(
        "params['value_up']['kernel']",
        value_up,
        (C, N, Hv),
        f"[C,N,Hv] with C={C}, N={N} as in params['key_up']['kernel']",
    )
    latent = _kernel(params, "latent", 2, "[E,C]")
    checks.check_dim("params['latent']['kernel']", latent, 1, C, f"[E,C] with C={C} as in params['key_up']")
    E = latent.shape[0]
    key_rope = _kernel(params, "key_rope", 2, "[E,R]")
    checks.check_dim("params['key_rope']['kernel']", key_rope, 0, E, f"[E,R] with E={E} as in params['latent']")
    R = key_rope.shape[1]
    query_name = "query" if "query" in params else "query_up"
    query = _kernel(params, query_name, 3, "[E,N,Hn+R]" if query_name == "query" else "[Cq,N,Hn+R]")
    if query.shape[1:] != (N, Hn + R):
        checks.fail(
            f"params['{query_name}']['kernel']",
            f"shape [..,{N},{Hn + R}] (N={N}, Hn+R={Hn}+{R} from params['key_up'] and params['key_rope'])",
            f"shape {checks.shape_str(query.shape)}",
        )
    if query_name == "query_up":
        down = _kernel(params, "query_down", 2, "[E,Cq]")
        checks.check_shape("params['query_down']['kernel']", down, (E, query.shape[0]), "[E,Cq]")
        checks.check_shape(
            "params['query_norm']['scale']", jnp.asarray(params["query_norm"]["scale"]), (query.shape[0],), "[Cq]"
        )
    checks.check_shape("params['latent_norm']['scale']", jnp.asarray(params["latent_norm"]["scale"]), (C,), "[C]")
    out = _kernel(params, "out", 3, "[N,Hv,Eo]")
    checks.check_shape("params['out']['kernel']", out, (N, Hv, out.shape[2]), "[N,Hv,Eo]")
    return N, Hn, R, C, Hv


def _dense(params, name, x, spec, precision):
    entry = params[name]
    y = jnp.einsum(spec, x, jnp.asarray(entry["kernel"]), precision=precision)
    return y + entry["bias"] if "bias" in entry else y


def rms_norm(x, scale, eps):
    """DeepSeek's RMSNorm: scale * (x / sqrt(mean(x^2) + eps)), the statistics in float32 or wider and the
    normalised x rounded to x's dtype before the scale (transformers' DeepseekV3RMSNorm)."""
    return jnp.asarray(scale) * rms_normalize(x, eps).astype(x.dtype)


def latent_projections(
    params,
    x,
    positions=None,
    *,
    rope_base: float = 10000.0,
    rope_layout: str = "interleaved",
    rope_frequencies=None,
    rope_attention_factor: float = 1.0,
    norm_eps: float = 1e-6,
    precision=None,
) -> LatentQKV:
    """x [...,T,E] -> LatentQKV(q_nope, q_rope, latent, k_rope), the rope parts rotated at `positions`
    (int [...,T], default arange(T)). norm_eps: the latent norms' epsilon (transformers: 1e-6).
    rope_attention_factor: yarn's factor a on the rotated parts (transformers scales cos and sin by it, so the
    rope part of every logit by a ** 2 and the nope part not at all)."""
    x = jnp.asarray(x)
    Hn = latent_dims(params)[1]
    checks.check_min_rank("x", x, 2, "[...,T,E]")
    E = jnp.shape(params["latent"]["kernel"])[0]
    checks.check_dim("x", x, -1, E, f"[...,T,E] with E={E} as in params['latent']['kernel']")
    if "query" in params:
        q = _dense(params, "query", x, "...te,enh->...tnh", precision)
    else:
        q_low = rms_norm(
            _dense(params, "query_down", x, "...te,ec->...tc", precision), params["query_norm"]["scale"], norm_eps
        )
        q = _dense(params, "query_up", q_low, "...tc,cnh->...tnh", precision)
    latent = rms_norm(
        _dense(params, "latent", x, "...te,ec->...tc", precision), params["latent_norm"]["scale"], norm_eps
    )
    k_rope = _dense(params, "key_rope", x, "...te,er->...tr", precision)
    rope = dict(base=rope_base, layout=rope_layout, frequencies=rope_frequencies)
    q_rope = apply_rope(q[..., Hn:], positions, **rope)
    k_rope = apply_rope(k_rope[..., None, :], positions, **rope)[..., 0, :]  # one rope key, shared by the heads
    if rope_attention_factor != 1.0:
        q_rope, k_rope = (r * jnp.asarray(rope_attention_factor, r.dtype) for r in (q_rope, k_rope))
    return LatentQKV(q[..., :Hn], q_rope, latent, k_rope)


def _map_output(result, f):
    """f on an attention result: z, or (z, weights) -> (f(z), weights)."""
    if isinstance(result, tuple):
        return f(result[0]), result[1]
    return f(result)


def latent_core(
    params, q_nope, q_rope, latent, k_rope, *, form: str = "absorbed", scale=None, precision=None, **options
):
    """Attention of q_nope [...,T,N,Hn], q_rope [...,T,N,R] over latent [...,S,C], k_rope [...,S,R] with
    params' key_up [C,N,Hn] and value_up [C,N,Hv] -> z [...,T,N,Hv] (or (z, weights [...,N,T,S])).

    form "absorbed" or "expanded" (module docstring); scale defaults to (Hn + R) ** -0.5, the q/k head dim's.
    Other keywords are dot_product_attention's.
    """
    if form not in FORMS:
        checks.fail("form", f"one of {FORMS}", repr(form))
    key_up, value_up = jnp.asarray(params["key_up"]["kernel"]), jnp.asarray(params["value_up"]["kernel"])
    C, N, Hn = key_up.shape
    R = q_rope.shape[-1]
    checks.check_dim("latent", latent, -1, C, f"[...,S,C] with C={C} as in params['key_up']['kernel'] [C,N,Hn]")
    checks.check_dim("k_rope", k_rope, -1, R, f"[...,S,R] with R={R} as in q_rope")
    checks.check_dim("q_nope", q_nope, -1, Hn, f"[...,T,N,Hn] with Hn={Hn} as in params['key_up']['kernel']")
    scale = (Hn + R) ** -0.5 if scale is None else scale
    if form == "absorbed":
        q_latent = jnp.einsum("...tnh,cnh->...tnc", q_nope, key_up, precision=precision)
        query = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)  # [...,T,N,C+R]
        key = jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)[..., None, :]  # [...,S,1,C+R]
        result = dot_product_attention(
            query, key, latent[..., None, :], scale=scale, precision=precision, **options
        )  # [...,T,N,C]
        return _map_output(result, lambda z: jnp.einsum("...tnc,cnv->...tnv", z, value_up, precision=precision))
    k_nope = jnp.einsum("...sc,cnh->...snh", latent, key_up, precision=precision)
    value = jnp.einsum("...sc,cnv->...snv", latent, value_up, precision=precision)
    k_shared = jnp.broadcast_to(k_rope[..., None, :], (*k_rope.shape[:-1], N, R)).astype(k_nope.dtype)
    query = jnp.concatenate([q_nope, q_rope.astype(q_nope.dtype)], axis=-1)
    return dot_product_attention(
        query, jnp.concatenate([k_nope, k_shared], axis=-1), value, scale=scale, precision=precision, **options
    )


def init_latent_cache(batch_shape, max_length: int, latent_dim: int, rope_dim: int, dtype=jnp.float32) -> LatentCache:
    """An empty MLA decode cache: (latent [...,L,C], rope [...,L,R], index int32 [...]) of zeros."""
    batch_shape = tuple(batch_shape)
    return (
        jnp.zeros((*batch_shape, max_length, latent_dim), dtype),
        jnp.zeros((*batch_shape, max_length, rope_dim), dtype),
        jnp.zeros(batch_shape, jnp.int32),
    )


@compiled_when_eager(concrete=("cache",))  # the cache's index is checked when known
def latent_attention(
    params,
    x: Float[ArrayLike, "*#B T E"],
    *,
    form: str = "absorbed",
    cache: LatentCache | None = None,
    positions: Int[ArrayLike, "*#B T"] | None = None,
    scale=None,
    rope_base: float = 10000.0,
    rope_layout: str = "interleaved",
    rope_frequencies=None,
    rope_attention_factor: float = 1.0,
    norm_eps: float = 1e-6,
    precision=None,
    **options,
) -> Float[Array, "*#B T Eo"] | tuple[Float[Array, "*#B T Eo"], Weights | LatentCache]:
    """Multi-head latent attention of x [...,T,E] -> y [...,T,Eo] (module docstring has the formulas).

    form: "absorbed" (default) or "expanded", equal numbers. positions: int [...,T] for RoPE (default
    arange(T), or the cache's index + arange(T)). cache: (latent [...,L,C], rope [...,L,R], index [...]) from
    init_latent_cache; the T new tokens are written after `index` and attend causally over the cache, and the
    call returns (y, new cache); the cache's keywords (causal, positions, lengths) are used, further keywords
    (window, ...) join them. Without a cache: self-attention over the T tokens, keywords as
    dot_product_attention's (pass is_causal=True for a decoder). return_weights gives (y, weights) without a
    cache.
    """
    if cache is not None:
        cached_latent, cached_rope, index = (jnp.asarray(c) for c in cache)
        if positions is None:
            positions = index[..., None] + jnp.arange(jnp.shape(x)[-2], dtype=jnp.int32)
    qkv = latent_projections(
        params,
        x,
        positions,
        rope_base=rope_base,
        rope_layout=rope_layout,
        rope_frequencies=rope_frequencies,
        rope_attention_factor=rope_attention_factor,
        norm_eps=norm_eps,
        precision=precision,
    )
    latent, k_rope = qkv.latent, qkv.k_rope
    if cache is not None:
        # the key/value cache's writer with one "head": the latent as keys, the rope key as values
        new_latent, new_rope, index, attend = kv_cache.write(
            cached_latent[..., None, :], cached_rope[..., None, :], index, latent[..., None, :], k_rope[..., None, :]
        )
        latent, k_rope = new_latent[..., 0, :], new_rope[..., 0, :]
        options = {**options, **attend}
    z = latent_core(
        params, qkv.q_nope, qkv.q_rope, latent, k_rope, form=form, scale=scale, precision=precision, **options
    )
    y = _map_output(z, lambda z: _dense(params, "out", z, "...tnv,nve->...te", precision))
    if cache is None:
        return y
    # an overflowing write is lost inside jit (outside, kv_cache.write raised): that example's output is NaN
    return kv_cache.poison_overflow(y, index > cached_latent.shape[-2]), (latent, k_rope, index)


def init_latent_attention(
    rng,
    features: int,
    num_heads: int,
    *,
    latent_dim: int,
    rope_dim: int,
    nope_head_dim: int,
    value_head_dim: int,
    query_latent_dim: int | None = None,
    out_features: int | None = None,
    use_bias: bool = False,
    dtype=jnp.float32,
):
    """Fresh MLA params (module docstring's tree): lecun_normal kernels over the fan-in, unit norm scales, zero
    biases (on the down projections and out, as DeepSeek's attention_bias). query_latent_dim None: direct
    queries [E,N,Hn+R]."""
    out_features = features if out_features is None else out_features
    H = nope_head_dim + rope_dim
    kernels = {
        "latent": ((features, latent_dim), 0),
        "key_rope": ((features, rope_dim), 0),
        "key_up": ((latent_dim, num_heads, nope_head_dim), 0),
        "value_up": ((latent_dim, num_heads, value_head_dim), 0),
        "out": ((num_heads, value_head_dim, out_features), (0, 1)),
    }
    if query_latent_dim is None:
        kernels["query"] = ((features, num_heads, H), 0)
    else:
        kernels["query_down"] = ((features, query_latent_dim), 0)
        kernels["query_up"] = ((query_latent_dim, num_heads, H), 0)
    params = {}
    for key, (name, (shape, fan_in)) in zip(jax.random.split(rng, len(kernels)), sorted(kernels.items())):
        out_axes = tuple(a for a in range(len(shape)) if a not in ((fan_in,) if isinstance(fan_in, int) else fan_in))
        init = jax.nn.initializers.lecun_normal(in_axis=fan_in, out_axis=out_axes)
        params[name] = {"kernel": init(key, shape, dtype)}
        if use_bias and name in ("latent", "key_rope", "query_down", "out"):
            params[name]["bias"] = jnp.zeros(shape[-1:], dtype)
    params["latent_norm"] = {"scale": jnp.ones((latent_dim,), dtype)}
    if query_latent_dim is not None:
        params["query_norm"] = {"scale": jnp.ones((query_latent_dim,), dtype)}
    return params
