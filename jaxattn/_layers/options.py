"""The options of the attention layers, listed once: jaxattn.linen and jaxattn.nnx are built from these lists.

ATTRIBUTES: MultiHeadAttention's constructor options (linen's dataclass fields, in their order; nnx's
`__init__` keywords). RELATIVE: what RelativeMultiHeadAttention adds (the Shaw tables). CALL: the keywords of
both layers' `__call__`. tests/test_layer_options.py checks both front ends against these lists (names,
defaults, linen's field order), so an option added to one front end only fails there.

Each option has a role, which says who reads it:
  size       the layer's sizes (resolved once into Dims);
  init       shapes the parameters or submodules at construction (nnx does not keep it);
  layer      read by the layer when it is called (nnx keeps it as an attribute);
  attention  handed to the attention as is (common.attend) when it is set (nnx keeps it).
An option with `only` set exists in that front end alone; its doc says why. `doc` is a line for this list's
reader: the users' documentation stays in the layers' docstrings, written out so that the API pages and
editors (which read the source) show it; the test checks that every option is named there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional

import jax.numpy as jnp

from .._core import checks
from . import common


@dataclasses.dataclass(frozen=True)
class Option:
    name: str
    default: Any
    role: str  # "size", "init", "layer" or "attention" (the module docstring)
    doc: str
    required: bool = False  # no usable default: a layer without it is refused by name
    only: Optional[str] = None  # "linen" or "nnx": that front end alone has it


ATTRIBUTES: tuple[Option, ...] = (
    Option("num_heads", None, "size", "N, the query heads", required=True),
    Option("head_dim", None, "size", "H (default Eq // N)"),
    Option("qkv_features", None, "size", "flax's spelling of num_heads * head_dim (give one of the two)"),
    Option("num_kv_heads", None, "size", "K (default N): grouped-query attention"),
    Option("value_head_dim", None, "size", "Hv (default H)"),
    Option("out_features", None, "size", "Eo (default Eq)"),
    Option(
        "use_bias", True, "init", 'biases on all four projections, none (False), or the named ones (("query", ...))'
    ),
    Option("add_bias_kv", False, "init", "torch.nn.MultiheadAttention's learned key/value row (not with decode)"),
    Option("add_zero_attn", False, "attention", "torch's zero key/value row (not with decode)"),
    Option("dropout_rate", 0.0, "layer", "dropout on the attention weights"),
    Option("deterministic", None, "layer", "no dropout (with the call's, flax's rule: attention_dropout)"),
    Option("scale", None, "attention", "the logits' scale (default H ** -0.5)"),
    Option("dtype", None, "layer", "computation dtype (default: promote inputs and params)"),
    Option("param_dtype", jnp.float32, "layer", "the parameters' dtype"),
    Option("precision", None, "attention", "for every einsum"),
    Option(
        "kernel_init",
        common.default_kernel_init,
        "init",
        "flax initialiser of the kernels (lecun_normal), called on their [fan_in, fan_out] view as flax's "
        "DenseGeneral does",
    ),
    Option("out_kernel_init", None, "init", "the out kernel's initialiser (default kernel_init)"),
    Option("bias_init", common.default_bias_init, "init", "the biases' initialiser (zeros)"),
    Option("bias_kv_init", common.default_table_init, "init", "add_bias_kv's initialiser (normal(0.02))"),
    Option("decode", False, "layer", "use the key/value cache (the call's `decode` overrides it)"),
    Option(
        "rope",
        None,
        "attention",
        "RoPE(base, rotary_dim, layout, frequencies): queries and keys rotated after projection (and qk "
        "norm), before attention and caching, at the call's rope_positions (default: the attention's positions)",
    ),
    Option(
        "window",
        None,
        "attention",
        "(left, right) sliding window on absolute positions (Mistral / Gemma 2: (W - 1, 0) with is_causal); "
        "with a left bound, decoding keeps a rolling cache of the window",
    ),
    Option("chunk_size", None, "attention", "Llama 4's chunked attention"),
    Option("logit_softcap", None, "attention", "Gemma 2's attention softcap"),
    Option("use_sinks", False, "init", 'learned per-head sinks params["sinks"] [N] (gpt-oss)'),
    Option("sinks_init", common.default_bias_init, "init", "the sinks' initialiser (zeros)"),
    Option(
        "qk_norm",
        None,
        "layer",
        'a module factory called with name="q_norm" / "k_norm": norms of each projected query / key head '
        "(Qwen 3, Gemma 3), before RoPE and caching; their params sit beside query / key / value / out. "
        "linen only: an nnx module is built from its sizes and rngs, so nnx would need a different contract",
        only="linen",
    ),
    Option(
        "normalize_qk",
        False,
        "init",
        'flax\'s LayerNorm without bias on each projected query / key head, params "query_ln" / "key_ln" '
        "(not with qk_norm)",
    ),
    Option(
        "broadcast_dropout",
        False,
        "attention",
        "flax's: one dropout keep-mask [T,S] for every batch entry and head (default False, as torch; flax: "
        "True, docs/coming_from.md)",
    ),
    Option("out_bias_init", None, "init", "the out bias' initialiser (default bias_init), flax's"),
    Option(
        "force_fp32_for_softmax",
        None,
        "layer",
        "flax linen's: True returns (and sows) the weights in float32 for a half-precision dtype, within one "
        "rounding of the exact softmax as flax's (float64 stays float64); None: in the computation dtype; False "
        "(flax's half-precision softmax) is refused: the softmax always runs in float32 here "
        "(docs/design.md, 'Half precision'). linen only: flax.nnx.MultiHeadAttention has no such option",
        only="linen",
    ),
    Option("implementation", None, "attention", "as jaxattn.dot_product_attention (None: per platform)"),
    Option("interpret", False, "attention", "as jaxattn.dot_product_attention"),
    # nnx builds its parameters in __init__, so it needs the input sizes that linen reads off its first inputs.
    Option("query_features", None, "size", "Eq (flax: in_features). nnx only: linen reads the inputs", only="nnx"),
    Option("key_features", None, "size", "Ek (default Eq). nnx only: linen reads the inputs", only="nnx"),
    Option("value_features", None, "size", "Ev (default Ek). nnx only: linen reads the inputs", only="nnx"),
    Option("in_features", None, "size", "flax nnx's spelling of query_features", only="nnx"),
    Option("in_kv_features", None, "size", "flax nnx's spelling of key_features = value_features", only="nnx"),
    Option("rngs", None, "init", 'nnx.Rngs: "params" keys, and the "dropout" stream forked', required=True, only="nnx"),
    Option("keep_rngs", True, "init", "flax nnx's: False stores no dropout stream (pass rngs= at call)", only="nnx"),
)

RELATIVE: tuple[Option, ...] = (
    Option("max_distance", None, "init", "R = 2 * max_distance + 1 table rows", required=True),
    Option("share_heads", False, "init", "[R,H] tables rather than [R,N,H]"),
    Option("use_key_table", True, "init", 'params["relative"]["key"]'),
    Option("use_value_table", True, "init", 'params["relative"]["value"]'),
    Option("table_init", common.default_table_init, "init", "the tables' initialiser (normal(0.02))"),
)

CALL: tuple[Option, ...] = (
    Option("mask", None, "attention", "as jaxattn.multi_head_attention (with a cache: over its L slots)"),
    Option("bias", None, "attention", "as jaxattn.multi_head_attention"),
    Option("is_causal", False, "attention", "as jaxattn.multi_head_attention"),
    Option("key_value_seq_lengths", None, "attention", "[...]; decoding: the real tokens among the new ones"),
    Option("query_positions", None, "attention", "[...,T] (None when decoding)"),
    Option("key_positions", None, "attention", "[...,S] (None when decoding)"),
    Option("deterministic", None, "layer", "no dropout (attention_dropout: flax's rule with the attribute)"),
    Option("dropout_rng", None, "layer", 'the dropout key (default: the "dropout" stream)'),
    Option("return_weights", False, "layer", "return (out, weights [...,N,T,S])"),
    Option("decode", None, "layer", "use the cache (default: the attribute)"),
    Option("rope_positions", None, "attention", "[...,T]: with `rope`, the rotary positions (self-attention)"),
    Option("query_segment_ids", None, "attention", "[...,T] (not with a cache)"),
    Option("key_segment_ids", None, "attention", "[...,S] (not with a cache)"),
    Option("sow_weights", False, "layer", 'flax\'s: sow the weights [...,N,T,S] as "attention_weights"'),
    Option("inputs_kv", None, "layer", "flax's deprecated spelling of key = value (not with key or value)"),
    Option(
        "position_bias",
        None,
        "attention",
        "a hook of the positions added to the logits (t5_position_bias, alibi_position_bias), evaluated tile "
        "by tile by the blockwise engine and the GPU kernel (jaxattn.position_bias_attention); not with tables",
    ),
    Option("rngs", None, "layer", 'nnx.Rngs (or a stream): the "dropout" key. nnx only (linen: make_rng)', only="nnx"),
)


def of(options: tuple[Option, ...], front_end: str) -> tuple[Option, ...]:
    """The options one front end ("linen" or "nnx") has."""
    return tuple(o for o in options if o.only in (None, front_end))


def values(layer, options: tuple[Option, ...], front_end: str) -> dict:
    """{name: value} of a layer's attributes among `options` (read by name)."""
    return {o.name: getattr(layer, o.name) for o in of(options, front_end)}


def keep(layer, given: Mapping[str, Any], options: tuple[Option, ...], roles=("layer", "attention")) -> None:
    """Store on an nnx layer, from its __init__'s arguments `given` (its locals, named as these lists: the
    drift test), the options of `roles`: by default those it reads after construction."""
    for o in of(options, "nnx"):
        if o.role in roles:
            setattr(layer, o.name, given[o.name])


def relative_tables(layer) -> Optional[dict]:
    """The Shaw tables a layer declares: RELATIVE's attributes of a RelativeMultiHeadAttention (its class
    sets relative_attention), None for a plain layer. The one way relative tables enter either front end."""
    if not layer.relative_attention:
        return None
    return {o.name: getattr(layer, o.name) for o in RELATIVE}


def parameter_specs(dims: common.Dims, attributes: Mapping[str, Any], relative: Optional[dict]) -> dict:
    """common.param_specs from a layer's ATTRIBUTES values (by name), for both front ends."""
    return common.param_specs(
        dims,
        use_bias=attributes["use_bias"],
        add_bias_kv=attributes["add_bias_kv"],
        kernel_init=attributes["kernel_init"],
        out_kernel_init=attributes["out_kernel_init"],
        bias_init=attributes["bias_init"],
        bias_kv_init=attributes["bias_kv_init"],
        relative=relative,
        out_bias_init=attributes["out_bias_init"],
        sinks_init=attributes["sinks_init"] if attributes["use_sinks"] else None,
    )


def attention_keywords(layer, given: Mapping[str, Any], **computed) -> dict:
    """What a layer's __call__ hands common.attend: its attention attributes and the call's attention
    options (`given`: the call's locals) that are set, plus what the layer computed (dropout, return_weights).

    An option left at its default is left out: the attention's defaults are the layer's, and an engine that
    lacks an option (relative tables: broadcast_dropout, position_bias) sees it only when set, when attend
    refuses it by name."""
    chosen = {o.name: getattr(layer, o.name) for o in ATTRIBUTES if o.role == "attention"}
    chosen |= {o.name: given[o.name] for o in CALL if o.role == "attention"}
    defaults = {o.name: o.default for o in ATTRIBUTES + CALL if o.role == "attention"}
    return {name: value for name, value in chosen.items() if value is not defaults[name]} | computed


def attention_dropout(
    rate: float,
    attribute: Optional[bool],
    given: Optional[bool],
    dropout_rng,
    stream: Callable[[], Any],
    *,
    exclusive: bool,
):
    """(rate, key) of a layer's dropout on the attention weights, one rule for every layer.

    `deterministic` is needed only when rate > 0: the call's (`given`) or the layer's (`attribute`); the call's
    wins (flax nnx's first_from), or with `exclusive` giving both is refused (flax linen's merge_param). Then
    the call's dropout_rng, else a key from `stream` (linen's make_rng, nnx's forked or call-time rngs).
    """
    if rate == 0.0:
        return 0.0, None
    if exclusive and attribute is not None and given is not None:
        checks.fail("deterministic", "the attribute or the call argument, not both (flax linen's rule)", "both")
    deterministic = attribute if given is None else given
    if deterministic is None:
        checks.fail("deterministic", "True or False (call argument or attribute) when dropout_rate > 0", None)
    if deterministic:
        return 0.0, None
    return rate, dropout_rng if dropout_rng is not None else stream()
