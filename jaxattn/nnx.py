"""Flax NNX attention layers: thin shells over jaxattn.multi_head_attention / relative_multi_head_attention.

    import jaxattn.nnx
    layer = jaxattn.nnx.MultiHeadAttention(64, num_heads=8, rngs=nnx.Rngs(0))
    y = layer(x, is_causal=True)

nnx.state(layer, nnx.Param) is exactly the tree of docs/design.md, "The parameter tree", so nnx.update(layer, params)
loads params from crosscheck.params_from_torch, init_multi_head_attention or flax's own attention layers.

Dropout the Flax way: `deterministic` (call argument, else attribute; layer.eval() / layer.train() set it)
and the "dropout" rng stream forked from the constructor's `rngs` (or `rngs` / `dropout_rng` at call time).

Decoding with a key/value cache (nnx.Cache state, as flax does it):

    layer.init_cache((B, L, E))                                   # L slots per example
    y = layer(prompt, decode=True, key_value_seq_lengths=lengths)    # prefill: T tokens, `lengths` real
    y = layer(token, decode=True)                                    # then one (or more) per step

Each decode call appends its tokens after each example's filled slots (cache_index is int32 [B...]) and
attends at absolute positions, so the causal mask and relative tables match a full causal pass.
Writing past L is a ValueError outside jit; inside jit the output of every example whose real tokens do not
fit (cache_index + key_value_seq_lengths > L) is NaN, for that step and every later one; the other examples
of the batch are unaffected.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

import jax.numpy as jnp
from flax import nnx

from ._core import checks
from ._layers import cache as kv_cache, common, disentangled, options, window as window_layer
from ._layers.common import Initializer, RoPE  # noqa: F401  (RoPE: part of this module's API)

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Bool, Float, Int

    from ._core.shapes import LayerOutput


class _Group(nnx.Module):
    """One entry of the parameter tree (e.g. "query" with "kernel" and "bias")."""

    def __init__(self, leaves: dict, param_dtype, rngs: nnx.Rngs):
        for leaf, (shape, init) in leaves.items():
            setattr(self, leaf, nnx.Param(init(rngs.params(), shape, param_dtype)))
        self.leaves = tuple(leaves)

    def tree(self) -> dict:
        return {leaf: getattr(self, leaf)[...] for leaf in self.leaves}


class _Grouped(nnx.Module):
    """A layer whose parameters are groups of leaves ({group: {leaf: (shape, init)}} specs), as the functional
    API's parameter tree."""

    def _declare(self, specs: dict, param_dtype, rngs: nnx.Rngs):
        for group, leaves in specs.items():
            setattr(self, group, _Group(leaves, param_dtype, rngs))
        self.groups = tuple(specs)

    def params(self) -> dict:
        """The parameter tree as plain nested dicts of arrays (what the functional API takes)."""
        return {group: getattr(self, group).tree() for group in self.groups}


def _dropout(layer: MultiHeadAttention | DisentangledAttention, deterministic, rngs, dropout_rng):
    """(rate, key) of a layer's weight dropout: options.attention_dropout with flax nnx's rule (the call's
    `deterministic` wins over the attribute) and a key from the call's rngs, else the layer's forked stream."""

    def stream():
        return (rngs.dropout if isinstance(rngs, nnx.Rngs) else (rngs if rngs is not None else layer.rngs))()

    return options.attention_dropout(
        layer.dropout_rate, layer.deterministic, deterministic, dropout_rng, stream, exclusive=False
    )


class MultiHeadAttention(_Grouped):
    """Multi-head / grouped-query attention (see the module docstring for decoding).

    Sizes as jaxattn.init_multi_head_attention: query_features Eq, num_heads N, head_dim H (default Eq // N),
    key_features Ek (Eq), value_features Ev (Ek), out_features Eo (Eq), num_kv_heads K (N), value_head_dim
    Hv (H). Options as jaxattn.linen.MultiHeadAttention (rope=RoPE(...) and the call's rope_positions
    included); `rngs` supplies "params" and "dropout" keys. Both front ends take their options from one list,
    jaxattn._layers.options (ATTRIBUTES; tests/test_layer_options.py holds this signature to it).

    flax.nnx.MultiHeadAttention's keywords are accepted where they mean the same thing: in_features
    (= query_features), in_kv_features (= key_features = value_features), qkv_features (= N * H),
    out_features, num_kv_heads, decode, dtype, param_dtype, ... (giving both spellings of one size is a
    ValueError). Pass them by keyword: flax's positional order is (num_heads, in_features), ours
    (query_features, num_heads).

    Also flax's: normalize_qk (LayerNorm without bias on each projected query / key head, params
    query_ln / key_ln {"scale": [H]}), broadcast_dropout (one keep-mask [T,S] for every batch entry and head;
    default False here, True in flax: docs/coming_from.md), out_bias_init, keep_rngs (False: no dropout
    stream is stored, pass rngs= at call time), and at call time sow_weights=True (the weights [...,N,T,S]
    sown as nnx.Intermediate "attention_weights") and inputs_kv= (flax's spelling of key = value). Not here:
    linen's qk_norm (a linen module factory) and force_fp32_for_softmax (flax.nnx has none).
    """

    relative_attention = False  # RelativeMultiHeadAttention's tables (options.relative_tables)
    # Kept by options.keep from the constructor's arguments; the ones read here by name, declared for pyright.
    dropout_rate: float
    deterministic: Optional[bool]
    dtype: Any
    param_dtype: Any
    decode: bool
    window: Optional[tuple]

    def __init__(
        self,
        query_features: Optional[int] = None,
        num_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        *,
        key_features: Optional[int] = None,
        value_features: Optional[int] = None,
        in_features: Optional[int] = None,
        qkv_features: Optional[int] = None,
        in_kv_features: Optional[int] = None,
        out_features: Optional[int] = None,
        num_kv_heads: Optional[int] = None,
        value_head_dim: Optional[int] = None,
        use_bias: Union[bool, tuple] = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        dropout_rate: float = 0.0,
        deterministic: Optional[bool] = None,
        scale: Optional[float] = None,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Initializer = common.default_kernel_init,
        out_kernel_init: Optional[Initializer] = None,
        bias_init: Initializer = common.default_bias_init,
        bias_kv_init: Initializer = common.default_table_init,
        decode: bool = False,
        window: Optional[tuple] = None,
        chunk_size: Optional[int] = None,
        logit_softcap: Optional[float] = None,
        use_sinks: bool = False,
        sinks_init: Initializer = common.default_bias_init,
        rope: Optional[RoPE] = None,
        rngs: nnx.Rngs,
        implementation: Optional[str] = None,
        interpret: bool = False,
        normalize_qk: bool = False,
        broadcast_dropout: bool = False,
        out_bias_init: Optional[Initializer] = None,
        keep_rngs: bool = True,
    ):
        given = dict(locals())  # the arguments by name: options.keep / parameter_specs read ATTRIBUTES' from it
        sizes = common.flax_sizes(
            num_heads,
            query_features=query_features,
            head_dim=head_dim,
            key_features=key_features,
            value_features=value_features,
            in_features=in_features,
            qkv_features=qkv_features,
            in_kv_features=in_kv_features,
        )
        if sizes["query_features"] is None:
            checks.fail("query_features", "a positive int (or flax's spelling in_features)", None)
        self.dims = common.resolve_dims(
            sizes.pop("query_features"),
            num_heads,
            out_features=out_features,
            num_kv_heads=num_kv_heads,
            value_head_dim=value_head_dim,
            **sizes,
        )
        specs = options.parameter_specs(self.dims, given, options.relative_tables(self))
        sinks = specs.pop("sinks", None)
        self._declare(specs, param_dtype, rngs)
        self.sinks = nnx.data(None) if sinks is None else nnx.Param(sinks[1](rngs.params(), sinks[0], param_dtype))
        options.keep(self, given, options.ATTRIBUTES)  # what __call__ reads, as linen's fields
        self.rope = common.check_rope(rope)
        self.rngs = rngs.dropout.fork() if dropout_rate > 0 and keep_rngs else nnx.data(None)
        norm = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)  # flax's query_ln / key_ln
        self.query_ln = nnx.LayerNorm(self.dims.H, **norm) if normalize_qk else nnx.data(None)
        self.key_ln = nnx.LayerNorm(self.dims.H, **norm) if normalize_qk else nnx.data(None)
        self.cached_key: Optional[nnx.Cache] = nnx.data(None)
        self.cached_value: Optional[nnx.Cache] = nnx.data(None)
        self.cache_index: Optional[nnx.Cache] = nnx.data(None)

    def params(self) -> dict:
        """The parameter tree as plain nested dicts of arrays (what the functional API takes)."""
        tree = super().params()
        if self.sinks is not None:
            tree["sinks"] = self.sinks[...]
        return tree

    def init_cache(self, input_shape, dtype: Any = None) -> None:
        """An empty cache for inputs of shape (*batch, L, E): L slots per example (as flax's init_cache)."""
        if len(input_shape) < 2:
            checks.fail("input_shape", "(*batch, L, E)", tuple(input_shape))
        dtype = dtype or self.dtype or self.param_dtype
        *batch, L, _ = input_shape
        d = self.dims
        L = common.cache_length(self.window, L)  # a window keeps a rolling cache of its own size
        cached_key, cached_value, index = kv_cache.init(batch, L, d.K, d.H, d.Hv, dtype)
        self.cached_key, self.cached_value = nnx.Cache(cached_key), nnx.Cache(cached_value)
        self.cache_index = nnx.Cache(index)

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
        rngs=None,
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

        Keywords (options.CALL) as jaxattn.linen.MultiHeadAttention's call, plus rngs (the dropout stream);
        returns (out, weights [...,N,T,S]) with return_weights.
        """
        given = dict(locals())  # the keywords above by name: options.attention_keywords forwards CALL's from it
        key, value = common.flax_inputs_kv(inputs_kv, key, value)
        query, key, value = common.inputs(query, key, value)
        params = self.params()
        dtype = common.layer_dtype(self.dtype, params, query, key, value)
        params, query, key, value = common.cast((params, query, key, value), dtype)
        rate, rng = _dropout(self, deterministic, rngs, dropout_rng)
        cache = None
        if self.decode if decode is None else decode:
            if self.cached_key is None:
                checks.fail("decode", "a cache: call init_cache((*batch, L, E)) first", "no cache")
            cache = (self.cached_key[...], self.cached_value[...], self.cache_index[...])
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
            self.cached_key[...], self.cached_value[...], self.cache_index[...] = new_cache
        if sow_weights:
            result, weights = common.weights_to_sow(result, return_weights)
            self.sow(nnx.Intermediate, "attention_weights", weights)
        return result

    def _qk_norm(self):
        """flax's normalize_qk: (q, k) -> (query_ln(q), key_ln(k)), or None."""
        if self.query_ln is None:
            return None
        return lambda q, k: (self.query_ln(q), self.key_ln(k))


class RelativeMultiHeadAttention(MultiHeadAttention):
    """MultiHeadAttention with Shaw et al. clipped relative-position tables in params["relative"] (not with
    add_bias_kv / add_zero_attn); the other keywords as MultiHeadAttention's.

    Extra arguments (options.RELATIVE): max_distance (R = 2 * max_distance + 1 rows), share_heads ([R,H] tables
    rather than [R,N,H]), use_key_table / use_value_table, table_init (default normal(0.02)).
    """

    relative_attention = True

    def __init__(
        self,
        query_features: Optional[int] = None,
        num_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        *,
        max_distance: int,
        share_heads: bool = False,
        use_key_table: bool = True,
        use_value_table: bool = True,
        table_init: Initializer = common.default_table_init,
        rngs: nnx.Rngs,
        **attributes,
    ):
        # Kept on the layer as linen's fields are, so that MultiHeadAttention reads the tables the one way both
        # front ends do (options.relative_tables).
        options.keep(self, locals(), options.RELATIVE, roles=("init",))
        super().__init__(query_features, num_heads, head_dim, rngs=rngs, **attributes)


class WindowAttention(_Grouped):
    """Swin's (shifted) window self-attention on a feature map [..., height, width, E] -> [..., height, width, E].

    A thin shell over window_self_attention; params() is the tree of jaxattn.linen.WindowAttention
    ({query,key,value,out}/{kernel,bias} and window/table [R,N]). shift > 0 is SW-MSA.
    """

    def __init__(
        self,
        features: int,
        num_heads: int,
        window_size,
        *,
        shift=0,
        head_dim: Optional[int] = None,
        use_bias: bool = True,
        kernel_init: Initializer = common.default_kernel_init,
        bias_init: Initializer = common.default_bias_init,
        table_init: Initializer = common.default_table_init,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        implementation: Optional[str] = None,
        rngs: nnx.Rngs,
    ):
        specs = window_layer.window_param_specs(
            features,
            num_heads,
            window_size,
            head_dim=head_dim,
            use_bias=use_bias,
            kernel_init=kernel_init,
            bias_init=bias_init,
            table_init=table_init,
        )
        self._declare(specs, param_dtype, rngs)
        self.window_size, self.shift = window_size, shift
        self.precision, self.implementation = precision, implementation

    def __call__(self, x: Float[ArrayLike, "*#B Y X E"]) -> Float[Array, "*#B Y X E"]:
        return window_layer.window_self_attention(
            self.params(),
            x,
            self.window_size,
            shift=self.shift,
            precision=self.precision,
            implementation=self.implementation,
        )


class DisentangledAttention(_Grouped):
    """DeBERTa's disentangled attention layer (jaxattn.disentangled_multi_head_attention): HF's
    DisentangledSelfAttention with its output projection (DebertaV2SelfOutput.dense) as "out".

    Sizes: query_features Eq, num_heads N, head_dim H (default Eq // N), key_features / value_features /
    out_features (default Eq), position_features Er (the relative embeddings' width, default Eq). Options as
    jaxattn.linen.DisentangledAttention; dropout as MultiHeadAttention's (deterministic, layer.eval() /
    layer.train(), the forked "dropout" stream or the call's rngs / dropout_rng). nnx.state(layer, nnx.Param)
    is the functional parameter tree.
    """

    def __init__(
        self,
        query_features: int,
        num_heads: int,
        head_dim: Optional[int] = None,
        *,
        max_relative_positions: int,
        position_buckets: int = -1,
        pos_att_type: tuple = ("c2p", "p2c"),
        share_att_key: bool = False,
        key_features: Optional[int] = None,
        value_features: Optional[int] = None,
        out_features: Optional[int] = None,
        position_features: Optional[int] = None,
        use_bias: bool = True,
        dropout_rate: float = 0.0,
        deterministic: Optional[bool] = None,
        scale: Optional[float] = None,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        precision: Any = None,
        kernel_init: Initializer = common.default_kernel_init,
        bias_init: Initializer = common.default_bias_init,
        implementation: Optional[str] = None,
        rngs: nnx.Rngs,
    ):
        dims = common.resolve_dims(
            query_features,
            num_heads,
            head_dim,
            key_features=key_features,
            value_features=value_features,
            out_features=out_features,
        )
        entries = disentangled.position_entries(pos_att_type, share_att_key)
        specs = common.param_specs(dims, use_bias=use_bias, kernel_init=kernel_init, bias_init=bias_init)
        Er = query_features if position_features is None else position_features
        specs |= disentangled.position_specs(
            dims, Er, entries, use_bias=use_bias, kernel_init=kernel_init, bias_init=bias_init
        )
        self._declare(specs, param_dtype, rngs)
        self.max_relative_positions, self.position_buckets = max_relative_positions, position_buckets
        self.pos_att_type, self.share_att_key = tuple(pos_att_type), share_att_key
        self.scale, self.dtype, self.param_dtype, self.precision = scale, dtype, param_dtype, precision
        self.implementation = implementation
        self.dropout_rate, self.deterministic = dropout_rate, deterministic
        self.rngs = rngs.dropout.fork() if dropout_rate > 0 else nnx.data(None)

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
        rngs: nnx.Rngs | None = None,
        dropout_rng=None,
    ) -> LayerOutput:
        """[...,T,Eq] -> [...,T,Eo] (or (out, weights [...,N,T,S]) with return_weights)."""
        query, key, value = common.inputs(query, key, value)
        rel_embeddings = jnp.asarray(rel_embeddings)
        rate, rng = _dropout(self, deterministic, rngs, dropout_rng)
        params = self.params()
        dtype = common.layer_dtype(self.dtype, params, query, key, value, rel_embeddings)
        params, query, key, value, rel_embeddings = common.cast((params, query, key, value, rel_embeddings), dtype)
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
