"""Flax linen attention layers: thin shells over jaxattn.multi_head_attention / relative_multi_head_attention.

    import jaxattn.linen
    layer = jaxattn.linen.MultiHeadAttention(num_heads=8)
    variables = layer.init(rng, x)                    # {"params": docs/design.md, "The parameter tree"}
    y = layer.apply(variables, x, is_causal=True)

Parameters are exactly docs/design.md, "The parameter tree" ({query,key,value,out}/{kernel,bias}, relative/...),
so params from crosscheck.params_from_torch, from init_multi_head_attention or from
flax.linen.MultiHeadDotProductAttention drop straight in, and ours run in flax's layer.

Dropout the Flax way: `deterministic` (attribute or call argument, exactly one of them set) and the
"dropout" rng stream (or an explicit `dropout_rng`).

Decoding with a key/value cache (the "cache" collection, as flax does it):

    cache = layer.init(rng, jnp.zeros((B, L, E)), decode=True)["cache"]      # L = the cache's length
    y, mut = layer.apply({"params": p, "cache": cache}, prompt, decode=True,
                         key_value_seq_lengths=prompt_lengths, mutable=["cache"])  # prefill, T tokens
    y, mut = layer.apply({"params": p, "cache": mut["cache"]}, token, decode=True, mutable=["cache"])

cached_key [B...,L,K,H], cached_value [B...,L,K,Hv], cache_index int32 [B...] (per example). Each decode
call appends its T tokens after each example's filled slots; key_value_seq_lengths [B...] says how many
of them are real (default T); queries sit at absolute positions index + t, so the causal mask and relative
tables see the positions a full causal pass gives them. Writing past L is a ValueError outside jit; inside
jit (values unknown at trace time) the output of every example whose real tokens do not fit (cache_index +
key_value_seq_lengths > L) is NaN, for that step and every later one (its cache_index keeps counting past
L); the other examples of the batch are unaffected.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import flax.linen as nn
import jax.numpy as jnp

from ._core import checks
from ._layers import cache as kv_cache, common, disentangled, options, window as window_layer
from ._layers.common import Initializer, RoPE  # noqa: F401  (RoPE: part of this module's API)

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Bool, Float, Int

    from ._core.shapes import LayerOutput


class _Group(nn.Module):
    """One entry of the parameter tree (e.g. "query": {"kernel", "bias"}): declares and returns its leaves."""

    specs: tuple  # ((leaf, shape, init), ...)
    param_dtype: Any = jnp.float32

    @nn.compact
    def __call__(self):
        return {leaf: self.param(leaf, init, shape, self.param_dtype) for leaf, shape, init in self.specs}


def _declare(specs: dict, param_dtype) -> dict:
    """The parameter tree of `specs` ({group: {leaf: (shape, init)}}), one _Group submodule per group, declared
    in the calling layer's compact method."""
    return {
        group: _Group(tuple((leaf, shape, init) for leaf, (shape, init) in leaves.items()), param_dtype, name=group)()
        for group, leaves in specs.items()
    }


def _dropout(layer: MultiHeadAttention | DisentangledAttention, deterministic, dropout_rng):
    """(rate, key) of a layer's weight dropout: options.attention_dropout with flax linen's merge_param rule
    (the attribute or the call's `deterministic`, not both) and the "dropout" rng stream."""
    return options.attention_dropout(
        layer.dropout_rate,
        layer.deterministic,
        deterministic,
        dropout_rng,
        lambda: layer.make_rng("dropout"),
        exclusive=True,
    )


class MultiHeadAttention(nn.Module):
    """Multi-head / grouped-query attention (see the module docstring for decoding).

    The attributes are jaxattn._layers.options.ATTRIBUTES, the list jaxattn.nnx shares
    (tests/test_layer_options.py holds these fields to it).

    Attributes:
      num_heads: N.  head_dim: H (default Eq // N).  num_kv_heads: K (default N).  value_head_dim: Hv (default H).
      out_features: Eo (default Eq).  use_bias: biases on all four projections (True), none (False), or
        the named ones (e.g. ("query", "key", "value"), Qwen2's).
      add_bias_kv / add_zero_attn: torch.nn.MultiheadAttention's extras (not with decode).
      dropout_rate, deterministic: dropout on the attention weights.  scale: default H ** -0.5.
      dtype: computation dtype (default: promote inputs and params).  param_dtype: parameters' dtype.
      precision: for every einsum.  kernel_init / out_kernel_init / bias_init / bias_kv_init: flax
        initialisers; kernels are initialised on their [fan_in, fan_out] view, as flax's DenseGeneral does.
      decode: use the "cache" collection (the call argument overrides it).
      rope: RoPE(base, rotary_dim, layout, frequencies): rotate queries and keys after projection, before
        attention (and before caching), at the call's `rope_positions` (default: the attention's positions).
      qkv_features: flax.linen.MultiHeadDotProductAttention's spelling of num_heads * head_dim (a
        ValueError with head_dim also set); out_features, use_bias, dropout_rate, deterministic, dtype,
        param_dtype, precision, kernel_init, out_kernel_init, bias_init and decode are named as in flax.
      window: (left, right) sliding window on absolute positions (Mistral / Gemma 2: (W - 1, 0) with
        is_causal); with a left bound, decoding keeps a rolling cache of the window (O(window) memory).
      chunk_size: Llama 4's chunked attention.  logit_softcap: Gemma 2's attention softcap.
      use_sinks: learned per-head sinks `params["sinks"]`, shape [N] (gpt-oss), initialised by sinks_init (zeros).
      qk_norm: a module factory (e.g. functools.partial(RMSNorm, eps)) called with name="q_norm" and
        name="k_norm": the norms of each projected query head [...,T,N,H] and key head [...,S,K,H], applied
        before RoPE and before caching (Qwen 3, Gemma 3); their params sit beside query/key/value/out.
      normalize_qk: flax's QK normalisation: LayerNorm without bias over each head's H features of the
        projected queries and keys, params "query_ln" / "key_ln" {"scale": [H]} as in flax (not with qk_norm).
      broadcast_dropout: flax's: one dropout keep-mask [T,S] for every batch entry and head. Default False
        (independent per head, as torch); flax defaults to True (docs/coming_from.md).
      out_bias_init: the out projection's bias initialiser (default bias_init), as flax's.
      force_fp32_for_softmax: flax's. Half-precision logits and softmax are always computed in float32 here
        (docs/design.md, "Half precision"). True also returns (and sows) the attention weights in float32
        for a half-precision dtype, as flax does (float64 stays float64): our float32 softmax, rounded once
        to the computation dtype on its way out of the attention and widened back, so within one rounding
        of the exact softmax, as flax's float32 weights from its bfloat16 logits are. None (unset): the
        weights in the computation dtype. False (flax's bfloat16 softmax) is refused by name.

    Call: flax's sow_weights=True also stores the weights [...,N,T,S] in "intermediates" as
    "attention_weights" (flax's name); inputs_kv= (flax's deprecated spelling of key = value) is accepted.
      implementation / interpret: as jaxattn.dot_product_attention (None: per platform at lowering time).
    """

    # The fields of options.ATTRIBUTES' linen entries, in its order (flax needs them written out here).
    num_heads: int
    head_dim: Optional[int] = None
    qkv_features: Optional[int] = None  # flax's spelling: num_heads * head_dim (give one of the two)
    num_kv_heads: Optional[int] = None
    value_head_dim: Optional[int] = None
    out_features: Optional[int] = None
    use_bias: Union[bool, tuple] = True
    add_bias_kv: bool = False
    add_zero_attn: bool = False
    dropout_rate: float = 0.0
    deterministic: Optional[bool] = None
    scale: Optional[float] = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Initializer = common.default_kernel_init
    out_kernel_init: Optional[Initializer] = None
    bias_init: Initializer = common.default_bias_init
    bias_kv_init: Initializer = common.default_table_init
    decode: bool = False
    rope: Optional[RoPE] = None
    window: Optional[tuple] = None
    chunk_size: Optional[int] = None
    logit_softcap: Optional[float] = None
    use_sinks: bool = False
    sinks_init: Initializer = common.default_bias_init
    qk_norm: Optional[Callable[..., nn.Module]] = None
    normalize_qk: bool = False
    broadcast_dropout: bool = False
    out_bias_init: Optional[Initializer] = None
    force_fp32_for_softmax: Optional[bool] = None  # flax's attribute (default False there); False is refused
    implementation: Optional[str] = None
    interpret: bool = False

    relative_attention = False  # a class constant, not a field: RelativeMultiHeadAttention's tables (options)

    def _params(self, dims):
        attributes = options.values(self, options.ATTRIBUTES, "linen")
        specs = options.parameter_specs(dims, attributes, options.relative_tables(self))
        sinks = specs.pop("sinks", None)
        params = _declare(specs, self.param_dtype)
        if sinks is not None:
            params["sinks"] = self.param("sinks", sinks[1], sinks[0], self.param_dtype)
        return params

    def _qk_norm(self):
        """(q, k) -> (q_norm(q), k_norm(k)) with the submodules qk_norm builds, or None."""
        if self.normalize_qk:
            if self.qk_norm is not None:
                checks.fail("normalize_qk", "False with qk_norm (give one of the two)", True)
            norm = functools.partial(nn.LayerNorm, use_bias=False, dtype=self.dtype, param_dtype=self.param_dtype)
            q_norm, k_norm = norm(name="query_ln"), norm(name="key_ln")  # flax's names
            return lambda q, k: (q_norm(q), k_norm(k))
        if self.qk_norm is None:
            return None
        q_norm, k_norm = self.qk_norm(name="q_norm"), self.qk_norm(name="k_norm")
        return lambda q, k: (q_norm(q), k_norm(k))

    def _cache(self, dims, key, batch, dtype):
        """The "cache" variables, and whether they existed before this call (False while initialising)."""
        existed = self.has_variable("cache", "cached_key")
        length = common.cache_length(self.window, key.shape[-2])  # a window keeps a rolling cache of its size
        fresh = kv_cache.init(batch, length, dims.K, dims.H, dims.Hv, dtype)
        names = ("cached_key", "cached_value", "cache_index")
        variables = [self.variable("cache", n, lambda v=v: v) for n, v in zip(names, fresh)]
        return variables, existed

    @nn.compact
    def __call__(
        self,
        query: Float[ArrayLike, "*#B T Eq"],
        key: Float[ArrayLike, "*#B S Ek"] | None = None,
        value: Float[ArrayLike, "*#B S Ev"] | None = None,
        *,
        mask: Bool[ArrayLike, "..."] | None = None,
        bias: Float[ArrayLike, "..."] | None = None,
        is_causal=False,
        key_value_seq_lengths: Int[ArrayLike, "*#B"] | None = None,
        query_positions: Int[ArrayLike, "*#B T"] | None = None,
        key_positions: Int[ArrayLike, "*#B S"] | None = None,
        deterministic: Optional[bool] = None,
        dropout_rng=None,
        return_weights: bool = False,
        decode: Optional[bool] = None,
        rope_positions: Int[ArrayLike, "*#B T"] | None = None,
        query_segment_ids: Int[ArrayLike, "*#B T"] | None = None,
        key_segment_ids: Int[ArrayLike, "*#B S"] | None = None,
        sow_weights: bool = False,
        inputs_kv: Float[ArrayLike, "*#B S Ek"] | None = None,
        position_bias=None,
    ) -> LayerOutput:
        """query [...,T,Eq], key [...,S,Ek] (default query), value [...,S,Ev] (default key) -> [...,T,Eo].

        Keywords (options.CALL) as jaxattn.multi_head_attention; returns (out, weights [...,N,T,S]) with return_weights.
        position_bias: a hook of the positions added to the logits (t5_position_bias, alibi_position_bias),
        which the blockwise engine and the GPU kernel evaluate tile by tile (jaxattn.position_bias_attention).
        rope_positions [...,T]: with `rope`, the rotary positions of the queries and keys (self-attention).
        sow_weights / inputs_kv: flax's (see the class docstring).
        """
        given = dict(locals())  # the keywords above by name: options.attention_keywords forwards CALL's from it
        if not (self.force_fp32_for_softmax is None or self.force_fp32_for_softmax is True):
            checks.fail(
                "force_fp32_for_softmax",
                "True or None (half-precision logits and softmax always run in float32 here)",
                repr(self.force_fp32_for_softmax),
            )
        key, value = common.flax_inputs_kv(inputs_kv, key, value)
        query, key, value = common.inputs(query, key, value)
        head_dim = common.flax_sizes(self.num_heads, head_dim=self.head_dim, qkv_features=self.qkv_features)["head_dim"]
        dims = common.resolve_dims(
            query.shape[-1],
            self.num_heads,
            head_dim,
            key_features=key.shape[-1],
            value_features=value.shape[-1],
            out_features=self.out_features,
            num_kv_heads=self.num_kv_heads,
            value_head_dim=self.value_head_dim,
        )
        params = self._params(dims)
        dtype = common.layer_dtype(self.dtype, params, query, key, value)
        params, query, key, value = common.cast((params, query, key, value), dtype)
        rate, rng = _dropout(self, deterministic, dropout_rng)
        cache = None
        if self.decode if decode is None else decode:
            batch = jnp.broadcast_shapes(jnp.shape(query)[:-2], jnp.shape(key)[:-2])
            variables, existed = self._cache(dims, key, batch, dtype)
            cache = tuple(v.value for v in variables) if existed else None
        result, new_cache = common.attend(
            params,
            query,
            key,
            value,
            relative=self.relative_attention,
            cache=cache,
            qk_norm=self._qk_norm(),
            **options.attention_keywords(
                self, given, dropout_rate=rate, dropout_rng=rng, return_weights=return_weights or sow_weights
            ),
        )
        if new_cache is not None:
            for variable, new in zip(variables, new_cache):
                variable.value = new
        if self.force_fp32_for_softmax and (return_weights or sow_weights):
            result = common.widen_weights(result, jnp.float32)
        if sow_weights:
            result, weights = common.weights_to_sow(result, return_weights)
            self.sow("intermediates", "attention_weights", weights)
        return result


class RelativeMultiHeadAttention(MultiHeadAttention):
    """MultiHeadAttention with Shaw et al. clipped relative-position tables in params["relative"] (not with
    add_bias_kv / add_zero_attn).

    Extra attributes (options.RELATIVE): max_distance (R = 2 * max_distance + 1 rows), share_heads ([R,H]
    tables rather than [R,N,H]), use_key_table / use_value_table, table_init (default normal(0.02)).
    """

    # options.RELATIVE's fields; max_distance is required (None is refused by name: fields after defaults
    # need a default).
    max_distance: Optional[int] = None
    share_heads: bool = False
    use_key_table: bool = True
    use_value_table: bool = True
    table_init: Initializer = common.default_table_init

    relative_attention = True


class WindowAttention(nn.Module):
    """Swin's (shifted) window self-attention on a feature map [..., height, width, E] -> [..., height, width, E].

    A thin shell over window_self_attention: params {query,key,value,out}/{kernel,bias} as docs/design.md,
    "The parameter tree", plus window/table [(2 Wh - 1)(2 Ww - 1), N] (transformers' SwinAttention
    relative_position_bias_table as is). shift > 0 is SW-MSA (the map rolled by -shift, regions kept apart).
    """

    num_heads: int
    window_size: Union[int, tuple[int, int]]
    shift: Union[int, tuple[int, int]] = 0
    head_dim: Optional[int] = None
    use_bias: bool = True
    kernel_init: Initializer = common.default_kernel_init
    bias_init: Initializer = common.default_bias_init
    table_init: Initializer = common.default_table_init
    param_dtype: Any = jnp.float32
    precision: Any = None
    implementation: Optional[str] = None

    @nn.compact
    def __call__(self, x: Float[ArrayLike, "*#B Y X E"]) -> Float[Array, "*#B Y X E"]:
        x = jnp.asarray(x)
        checks.check_min_rank("x", x, 3, "[...,height,width,E]: a feature map")
        features = x.shape[-1]
        if self.has_variable("params", "query"):  # built: the channels are the kernel's, not the input's
            features = self.variables["params"]["query"]["kernel"].shape[0]
        specs = window_layer.window_param_specs(
            features,
            self.num_heads,
            self.window_size,
            head_dim=self.head_dim,
            use_bias=self.use_bias,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
            table_init=self.table_init,
        )
        params = _declare(specs, self.param_dtype)
        return window_layer.window_self_attention(
            params, x, self.window_size, shift=self.shift, precision=self.precision, implementation=self.implementation
        )


class DisentangledAttention(nn.Module):
    """DeBERTa's disentangled attention layer (jaxattn.disentangled_multi_head_attention): HF's
    DisentangledSelfAttention with its output projection (DebertaV2SelfOutput.dense) as "out".

    Attributes: num_heads N, head_dim H (default Eq // N), max_relative_positions, position_buckets (<= 0: none),
    pos_att_type ("c2p", "p2c" or both), share_att_key (project the relative embeddings with key / query rather
    than params "pos_key" / "pos_query"), out_features, use_bias, scale (default 1 / sqrt(H * (1 + terms))),
    dropout_rate / deterministic (on the attention weights, HF's attention_probs_dropout_prob; HF's dropout of
    rel_embeddings is the model's), dtype, param_dtype, precision, kernel_init, bias_init, implementation (None,
    "dense" or "blockwise").
    Call: query [...,T,Eq], key / value (default query), rel_embeddings [2 span, Er] (the encoder's, after its
    LayerNorm), keywords mask, key_value_seq_lengths, query_positions, key_positions, return_weights,
    deterministic, dropout_rng (default: the "dropout" rng stream).
    """

    num_heads: int
    max_relative_positions: Optional[int] = None  # required; a default only because dataclass fields follow defaults
    head_dim: Optional[int] = None
    position_buckets: int = -1
    pos_att_type: tuple = ("c2p", "p2c")
    share_att_key: bool = False
    out_features: Optional[int] = None
    use_bias: bool = True
    dropout_rate: float = 0.0
    deterministic: Optional[bool] = None
    scale: Optional[float] = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None
    kernel_init: Initializer = common.default_kernel_init
    bias_init: Initializer = common.default_bias_init
    implementation: Optional[str] = None

    @nn.compact
    def __call__(
        self,
        query: Float[ArrayLike, "*#B T Eq"],
        key: Float[ArrayLike, "*#B S Ek"] | None = None,
        value: Float[ArrayLike, "*#B S Ev"] | None = None,
        *,
        rel_embeddings: Float[ArrayLike, "R Er"],
        mask: Bool[ArrayLike, "..."] | None = None,
        key_value_seq_lengths: Int[ArrayLike, "*#B"] | None = None,
        query_positions: Int[ArrayLike, "*#B T"] | None = None,
        key_positions: Int[ArrayLike, "*#B S"] | None = None,
        return_weights: bool = False,
        deterministic: Optional[bool] = None,
        dropout_rng=None,
    ) -> LayerOutput:
        """[...,T,Eq] -> [...,T,Eo] (or (out, weights [...,N,T,S]) with return_weights)."""
        if self.max_relative_positions is None:
            checks.fail("max_relative_positions", "an int >= 1 (HF's, resolved)", None)
        query, key, value = common.inputs(query, key, value)
        rel_embeddings = jnp.asarray(rel_embeddings)
        dims = common.resolve_dims(
            query.shape[-1],
            self.num_heads,
            self.head_dim,
            key_features=key.shape[-1],
            value_features=value.shape[-1],
            out_features=self.out_features,
        )
        specs = common.param_specs(dims, use_bias=self.use_bias, kernel_init=self.kernel_init, bias_init=self.bias_init)
        specs |= disentangled.position_specs(
            dims,
            rel_embeddings.shape[-1],
            disentangled.position_entries(self.pos_att_type, self.share_att_key),
            use_bias=self.use_bias,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
        )
        params = _declare(specs, self.param_dtype)
        dtype = common.layer_dtype(self.dtype, params, query, key, value, rel_embeddings)
        params, query, key, value, rel_embeddings = common.cast((params, query, key, value, rel_embeddings), dtype)
        rate, rng = _dropout(self, deterministic, dropout_rng)
        return disentangled.disentangled_multi_head_attention(
            params,
            query,
            key,
            value,
            rel_embeddings=rel_embeddings,
            max_relative_positions=self.max_relative_positions,
            position_buckets=self.position_buckets,
            pos_att_type=self.pos_att_type,
            share_att_key=self.share_att_key,
            precision=self.precision,
            mask=mask,
            key_value_seq_lengths=key_value_seq_lengths,
            query_positions=query_positions,
            key_positions=key_positions,
            scale=self.scale,
            dropout_rate=rate,
            dropout_rng=rng,
            return_weights=return_weights,
            implementation=self.implementation,
        )
