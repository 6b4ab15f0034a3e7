"""Transformer-XL relative attention (Dai et al. 2019) and its sinusoid tables; clipped tables: clipped.py.

One index convention for every table here (and for Shaw's): row r of a table of R = max_left + max_right + 1
rows holds the relative position j - i = r - max_left (key minus query), distances beyond the table are
clipped to its first/last row:

    index[t,s] = clip(key_pos[s] - query_pos[t], -max_left, max_right) + max_left

Shaw is max_left == max_right; HF's "relative_key" (Wav2Vec2-BERT, Conformer) is
left_max_position_embeddings / right_max_position_embeddings. Transformer-XL's R_{i-j} (the paper indexes by
i - j) fills row r with the sinusoid of i - j = max_left - r, see `relative_sinusoids`; its causal table
(the paper's klen rows R_{klen-1} .. R_0) is max_left = klen - 1, max_right = 0, and the bidirectional one
(HF Wav2Vec2-BERT/Conformer "relative": rows i - j = L-1 .. -(L-1)) is max_left = max_right = L - 1.

    Transformer-XL logits[n,t,s] = scale * ((q_t + u) . k_s  +  (q_t + v) . P[index[t,s]])

with P = W_R R the projected position keys. The "shift" is a gather of the per-row scores [...,N,T,R] by
`index`, exact for any T, S and positions: the pad-and-reshape trick of the paper is only right for
T == S with P spanning exactly the needed 2S-1 (or S causal) rows, and leaves stale entries elsewhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from .._api import attend, scheme_call, use_blockwise
from .._core import checks
from .._core.checks import static_int
from .._core.dtypes import accumulation_dtype
from .._core.eager import compiled_when_eager
from .._core.row_tables import per_row_logits
from .._engines import blockwise
from .._engines.dense import attention_core
from .clipped import gather_buckets, head_index, symmetric_table

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Float

    from .._core.shapes import AttentionOutput


def relative_sinusoids(
    dim: int, *, max_left: int, max_right: int, base: float = 10000.0, layout: str = "concat", dtype=jnp.float32
) -> Float[Array, "R dim"]:
    """Transformer-XL's R: [R, dim], row r = the sinusoid of i - j = max_left - r (see module docstring).

    frequencies w_k = base ** (-2k / dim); layout "concat": [sin(d w), cos(d w)] (the paper's code);
    "interleaved": sin at even features, cos at odd ones (ESPnet / HF Wav2Vec2-BERT, Conformer).
    Computed in float64 and cast to `dtype`.
    """
    dim = static_int("dim", dim, 2)
    if dim % 2:
        checks.fail("dim", "an even number (sin and cos halves)", dim)
    max_left = static_int("max_left", max_left, 0)
    max_right = static_int("max_right", max_right, 0)
    if layout not in ("concat", "interleaved"):
        checks.fail("layout", "'concat' or 'interleaved'", repr(layout))
    distance = max_left - np.arange(max_left + max_right + 1, dtype=np.float64)
    angles = distance[:, None] / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if layout == "concat":
        table = np.concatenate([np.sin(angles), np.cos(angles)], axis=-1)
    else:
        table = np.stack([np.sin(angles), np.cos(angles)], axis=-1).reshape(len(distance), dim)
    return jnp.asarray(table, dtype)


def _check_head_bias(name, b, N, H, query):
    b = jnp.asarray(b)
    checks.check_shape(name, b, (N, H), "[N,H]")
    # u and v are added to the query itself, so they must fit its dtype: the cast below only widens.
    checks.check_fits(name, b, query.dtype)
    return b.astype(query.dtype)


@compiled_when_eager
def transformer_xl_attention(
    query: Float[ArrayLike, "*#B T N H"],
    key: Float[ArrayLike, "*#B S K H"],
    value: Float[ArrayLike, "*#B S K Hv"],
    position_keys: Float[ArrayLike, "R N H"] | Float[ArrayLike, "R H"],
    *,
    max_left: int,
    pos_bias_u: Float[ArrayLike, "N H"] | None = None,
    pos_bias_v: Float[ArrayLike, "N H"] | None = None,
    **options,
) -> AttentionOutput:
    """Transformer-XL relative attention: scale * ((q + u) . k + (q + v) . P[index]) (module docstring).

    position_keys P: [R,N,H] (or [R,H] shared), the projected R_{i-j} (W_R applied, e.g. to
    `relative_sinusoids(...)`), row r <-> j - i = r - max_left, so max_right = R - 1 - max_left.
    pos_bias_u / pos_bias_v: [N,H] (the paper's u, v; HF's pos_bias_u / pos_bias_v); None = zeros.
    Keywords as dot_product_attention (causal use: is_causal=True; rows with j > i are then never read);
    implementation / interpret / block_size: as shaw_relative_attention (None: blockwise on CPU at long
    sequences, through shaw_form).
    """
    implementation, interpret = options.pop("implementation", None), options.pop("interpret", False)
    call = scheme_call("transformer_xl_attention", options)
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    dims = checks.check_qkv(query, key, value)
    N, H = dims.N, dims.H
    max_left = static_int("max_left", max_left, 0)
    position_keys = jnp.asarray(position_keys)
    R = position_keys.shape[0] if position_keys.ndim else 0
    if R <= max_left:
        checks.fail(
            "position_keys",
            f"more than max_left={max_left} rows ([R,N,H], row r <-> j - i = r - max_left)",
            f"shape {checks.shape_str(position_keys.shape)}",
        )
    precision, acc_dtype = call.precision, accumulation_dtype(query.dtype)
    P = checks.check_clipped_table("position_keys", position_keys, R, N, H, acc_dtype, "[R,H] or [R,N,H]")
    q_u = query if pos_bias_u is None else query + _check_head_bias("pos_bias_u", pos_bias_u, N, H, query)
    q_v = query if pos_bias_v is None else query + _check_head_bias("pos_bias_v", pos_bias_v, N, H, query)
    engine = implementation if implementation in ("dense", "blockwise") else None
    shaw_call, q_aug, k_aug = shaw_form(call, q_u, q_v, key, P, max_left, R - 1 - max_left)

    def xla():
        if use_blockwise(engine, shaw_call, q_aug, k_aug):
            return blockwise.tiled(shaw_call, q_aug, k_aug, value)
        index = head_index(dims.T, dims.S, max_left, R - 1 - max_left, call)
        rel_logits = lambda _: gather_buckets(per_row_logits(q_v, P, precision, acc_dtype), index)  # noqa: E731
        return attention_core(call.replace(block_size=None), q_u, key, value, relative_logits=rel_logits, dims=dims)

    return attend(shaw_call, q_aug, k_aug, value, xla=xla, implementation=implementation, interpret=interpret)


def shaw_form(call, q_u, q_v, key, P, max_left: int, max_right: int):
    """Transformer-XL as Shaw attention with a doubled head dim: (call, q_aug [...,T,N,2H], k_aug [...,S,K,2H]).

        q_aug = [q + u, q + v],  k_aug = [k, 0],  table = [0, P]  (symmetric_table of it, Shaw's clip)
        q_aug . k_aug + q_aug . table[index] = (q + u) . k + (q + v) . P[index]

    and scale stays H ** -0.5 of the real head dim, so the tiled engine's (and a kernel's) Shaw machinery
    computes XL's logits, softcap included (it caps scale * (q.k + q.table[index]), the dense engine's
    order), and autodiff takes the gradients back through the concatenations to q, k, u, v and P.

    Why not an engine change: XL's second query (q + v) only meets the table, so the doubled head dim costs
    the zero half of each tile's q.k product (forward and backward; measured in docs/performance.md) and
    nothing else, while a separate table query would be one more array through every tile function, the
    row groups, the custom VJP and each kernel that takes Shaw tables. (Folding it instead into q + u and a
    position bias (v - u) . P[index] would keep the head dim, but the bias lands after the softcap.)
    """
    H = q_u.shape[-1]
    q_aug = jnp.concatenate([q_u, q_v], axis=-1)
    k_aug = jnp.concatenate([key, jnp.zeros_like(key)], axis=-1)
    table = jnp.concatenate([jnp.zeros_like(P), P], axis=-1)
    scale = H**-0.5 if call.scale is None else call.scale
    shaw_call = call.replace(
        key_table=symmetric_table(table, max_left, max_right), max_distance=max(max_left, max_right), scale=scale
    )
    return shaw_call, q_aug, k_aug
