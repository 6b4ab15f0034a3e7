"""jaxattn.linen and jaxattn.nnx against their one list of options (jaxattn/_layers/options.py), and against each other.

The drift tests: linen's fields, nnx's constructor arguments and both __call__s' keywords are exactly the lists'
(names and defaults; linen's fields in the list's order, as flax makes them positional), so an option added to
one front end only fails here. Then the options nnx gained from the list (position_bias, inputs_kv) give linen's
numbers with the same weights, forward and gradients, and the one dropout rule.

Axes: B=3, T=5, S=7, N=2, H=11, Hv=13, Eq=17, Ek=Ev=19, Eo=23; R (T5 buckets) = 29.
"""

import dataclasses
import inspect
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxattn
import jaxattn._layers.common
import jaxattn.linen as jl
import jaxattn.nnx as jx
from helpers import arrays, check_forward_and_grads, normwise
from jaxattn._layers import options

B, T, S, N, H, Hv, Eq, Ekv, Eo, R = 3, 5, 7, 2, 11, 13, 17, 19, 23, 29
CHEAP_INIT = nn.initializers.normal(0.3)  # eager truncated-normal compiles are slow; any init will do here


# --- drift: each front end is its list --------------------------------------------------------------------------


def _linen_fields(layer_class) -> dict:
    """{field: default} of a linen layer in declaration order (flax's parent / name left out)."""
    fields = [f for f in dataclasses.fields(layer_class) if f.name not in ("parent", "name")]
    return {f.name: (inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default) for f in fields}


def _parameters(function, kind) -> dict:
    """{name: default} of a function's parameters of one kind (inspect.Parameter.KEYWORD_ONLY, ...)."""
    return {p.name: p.default for p in inspect.signature(function).parameters.values() if p.kind == kind}


def _keywords(function) -> dict:
    """{name: default} of every parameter that can be passed by keyword, self, query, key and value left out."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = inspect.signature(function).parameters.values()
    return {p.name: p.default for p in params if p.kind in kinds and p.name not in ("self", "query", "key", "value")}


def _expected(option_list, front_end) -> dict:
    """{name: default} a front end must have. A required option has no default, except where Python forces one
    (linen's fields after defaulted ones, nnx's positional sizes after query_features): None, refused by name
    (test_required_options_are_refused_by_name)."""
    return {o.name: ("required" if o.required else o.default) for o in options.of(option_list, front_end)}


def _declared(defaults: dict, option_list) -> dict:
    required = {o.name for o in option_list if o.required}
    return {
        name: ("required" if name in required and default in (None, inspect.Parameter.empty) else default)
        for name, default in defaults.items()
    }


def _same(got: dict, want: dict, where: str):
    extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
    assert not extra and not missing, f"{where}: not in the list {extra}, missing {missing} (_layers/options.py)"
    differ = {n: (got[n], want[n]) for n in want if got[n] is not want[n] and got[n] != want[n]}
    assert not differ, f"{where}: defaults differ from the list's, (got, list): {differ}"


def test_linen_fields_are_the_attribute_list_in_its_order():
    fields = _linen_fields(jl.MultiHeadAttention)
    _same(_declared(fields, options.ATTRIBUTES), _expected(options.ATTRIBUTES, "linen"), "linen MultiHeadAttention")
    assert list(fields) == [o.name for o in options.of(options.ATTRIBUTES, "linen")]  # flax's positional order
    relative = _linen_fields(jl.RelativeMultiHeadAttention)
    assert list(relative) == list(fields) + [o.name for o in options.RELATIVE]
    _same(
        _declared({n: relative[n] for n in list(relative)[len(fields) :]}, options.RELATIVE),
        _expected(options.RELATIVE, "linen"),
        "linen RelativeMultiHeadAttention",
    )


def test_nnx_constructor_is_the_attribute_list():
    _same(
        _declared(_keywords(jx.MultiHeadAttention.__init__), options.ATTRIBUTES),
        _expected(options.ATTRIBUTES, "nnx"),
        "nnx MultiHeadAttention.__init__",
    )
    relative = _keywords(jx.RelativeMultiHeadAttention.__init__)
    shared = {n: relative.pop(n) for n in ("query_features", "num_heads", "head_dim", "rngs")}
    _same(_declared(relative, options.RELATIVE), _expected(options.RELATIVE, "nnx"), "nnx RelativeMultiHeadAttention")
    assert shared == {n: d for n, d in _keywords(jx.MultiHeadAttention.__init__).items() if n in shared}
    assert _parameters(jx.RelativeMultiHeadAttention.__init__, inspect.Parameter.VAR_KEYWORD)  # the rest: **


@pytest.mark.parametrize("front_end, layer_class", [("linen", jl.MultiHeadAttention), ("nnx", jx.MultiHeadAttention)])
def test_call_keywords_are_the_call_list(front_end, layer_class):
    call = layer_class.__call__
    positional = _parameters(call, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    assert positional == {"self": inspect.Parameter.empty, "query": inspect.Parameter.empty, "key": None, "value": None}
    assert not _parameters(call, inspect.Parameter.VAR_KEYWORD)  # every keyword is named, none swallowed
    _same(_keywords(call), _expected(options.CALL, front_end), f"{front_end} MultiHeadAttention.__call__")


def test_the_lists_are_well_formed():
    """Names are unique per list; what reaches the attention is the same option in both front ends (a front
    end-only option may only be the layer's own business); every role is one the module docstring defines."""
    for option_list in (options.ATTRIBUTES, options.RELATIVE, options.CALL):
        names = [o.name for o in option_list]
        assert len(names) == len(set(names))
        assert all(o.role in ("size", "init", "layer", "attention") for o in option_list)
        assert all(o.only in (None, "linen", "nnx") for o in option_list)
    forwarded = [o for o in options.ATTRIBUTES + options.CALL if o.role == "attention"]
    assert forwarded and all(o.only is None for o in forwarded)
    assert not set(o.name for o in forwarded) & set(o.name for o in options.RELATIVE)


def test_every_option_is_documented():
    """Each option of a front end is named in its docstrings (nnx's refer to linen's for the shared ones) or
    is a keyword of jaxattn.dot_product_attention, which the call's docstring refers to."""
    attention = set(inspect.signature(jaxattn.dot_product_attention).parameters)
    linen_docs = jl.MultiHeadAttention.__doc__ + jl.MultiHeadAttention.__call__.__doc__
    for front_end, layer_class in (("linen", jl.MultiHeadAttention), ("nnx", jx.MultiHeadAttention)):
        docs = linen_docs + layer_class.__doc__ + layer_class.__call__.__doc__
        for o in options.of(options.ATTRIBUTES + options.CALL, front_end):
            assert re.search(rf"\b{o.name}\b", docs) or o.name in attention, (front_end, o.name)
    for layer_class in (jl.RelativeMultiHeadAttention, jx.RelativeMultiHeadAttention):
        assert all(re.search(rf"\b{o.name}\b", layer_class.__doc__) for o in options.RELATIVE)


def test_required_options_are_refused_by_name():
    x = np.zeros((B, T, Eq))
    with pytest.raises(TypeError, match="num_heads"):
        jl.MultiHeadAttention()
    with pytest.raises(ValueError, match="num_heads"):
        jx.MultiHeadAttention(Eq, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="rngs"):
        jx.MultiHeadAttention(Eq, N)
    with pytest.raises(ValueError, match="max_distance"):
        jl.RelativeMultiHeadAttention(num_heads=N, head_dim=H).init(jax.random.key(0), x)
    with pytest.raises(TypeError, match="max_distance"):
        jx.RelativeMultiHeadAttention(Eq, N, rngs=nnx.Rngs(0))


# --- the same numbers: nnx's position_bias and inputs_kv as linen's -------------------------------------------


def _pair(relative=False, kv_features=Ekv, **attributes):
    """A linen and an nnx layer of the same options (float64), and a parameter tree both take."""
    kw = dict(
        head_dim=H,
        value_head_dim=Hv,
        out_features=Eo,
        param_dtype=jnp.float64,
        kernel_init=CHEAP_INIT,
        bias_init=CHEAP_INIT,
        **attributes,
    )
    if relative:
        linen, twin = jl.RelativeMultiHeadAttention, jx.RelativeMultiHeadAttention
        kw["max_distance"] = 2
    else:
        linen, twin = jl.MultiHeadAttention, jx.MultiHeadAttention
    q, kv = arrays(0, (B, T, Eq), (B, S, kv_features))
    params = linen(num_heads=N, **kw).init(jax.random.key(0), q, inputs_kv=kv)["params"]
    nnx_layer = twin(Eq, N, in_kv_features=kv_features, rngs=nnx.Rngs(1), **kw)
    return linen(num_heads=N, **kw), nnx_layer, params


def _nnx_apply(layer):
    """(params tree, *inputs) -> the nnx layer's call with that tree loaded: a pure function to jit and grad."""
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)

    def apply(tree, *args, **kw):
        loaded = jax.tree.map(lambda x: x, params)  # a copy to load `tree` into (replace_by_pure_dict: in place)
        nnx.replace_by_pure_dict(loaded, tree)
        return nnx.merge(graphdef, loaded, rest)(*args, **kw)

    return apply


def test_nnx_position_bias_and_inputs_kv_are_linens():
    """Cross-attention through flax's inputs_kv with a T5 bias hook, causal: nnx gives linen's numbers with the
    same weights, forward and the gradients of the params, the inputs and the T5 table; both equal the
    functional layer with the hook's bias materialised as an [N,T,S] array (a different route: the dense bias)."""
    linen, twin, params = _pair()
    q, kv = arrays(1, (B, T, Eq), (B, S, Ekv))
    (table,) = arrays(2, (R, N))
    hook = lambda table: jaxattn.t5_position_bias(table, bidirectional=True, max_distance=31)  # noqa: E731
    call = dict(is_causal=True)

    leaves, treedef = jax.tree.flatten(params)  # check_forward_and_grads differentiates array arguments

    def ours(*args):
        *tree, q, kv, table = args
        return _nnx_apply(twin)(treedef.unflatten(tree), q, inputs_kv=kv, position_bias=hook(table), **call)

    def theirs(*args):
        *tree, q, kv, table = args
        return linen.apply({"params": treedef.unflatten(tree)}, q, inputs_kv=kv, position_bias=hook(table), **call)

    args = (*leaves, q, kv, table)
    check_forward_and_grads(ours, theirs, args, tuple(range(len(args))), tol=1e-14)
    query_positions, key_positions = jnp.arange(T) + S - T, jnp.arange(S)  # the default positions (cross)
    dense = jaxattn.multi_head_attention(
        params, q, kv, kv, bias=hook(table)(query_positions, key_positions), is_causal=True
    )
    assert normwise(ours(*args), dense) <= 1e-13


def test_nnx_position_bias_decoding_is_linens():
    """A prefill of T - 1 tokens and one decode step with an ALiBi hook: nnx's cache and outputs are linen's."""
    linen, twin, params = _pair(kv_features=Eq)
    (x,) = arrays(3, (B, T, Eq))
    hook = jaxattn.alibi_position_bias(jaxattn.alibi_slopes(N, dtype=jnp.float64))
    cache = linen.init(jax.random.key(0), jnp.zeros((B, T, Eq)), decode=True)["cache"]
    nnx.update(twin, params)
    twin.init_cache((B, T, Eq), jnp.float64)
    for tokens in (x[:, : T - 1], x[:, T - 1 :]):
        want, mutated = linen.apply(
            {"params": params, "cache": cache}, tokens, decode=True, position_bias=hook, mutable=["cache"]
        )
        cache = mutated["cache"]
        got = twin(tokens, decode=True, position_bias=hook)
        assert normwise(got, want) == 0.0
    assert normwise(twin.cached_key[...], cache["cached_key"]) == 0.0
    np.testing.assert_array_equal(twin.cache_index[...], cache["cache_index"])
    full = jaxattn.multi_head_attention(params, x, is_causal=True, position_bias=hook)  # the hook at its positions
    assert normwise(got, full[:, T - 1 :]) <= 1e-13


def test_both_front_ends_hand_the_attention_the_same_keywords(monkeypatch):
    """Every attention option of the lists, set to a value of its own, reaches common.attend, the same from
    linen and from nnx (attend replaced by a recorder: what is handed over, not what is computed)."""
    handed = []

    def recorder(params, query, key, value, **keywords):
        handed.append(keywords)
        return jnp.zeros((*query.shape[:-1], Eo), query.dtype), None

    monkeypatch.setattr(jaxattn._layers.common, "attend", recorder)
    attributes = dict(
        add_zero_attn=True,
        scale=0.25,
        precision="highest",
        rope=jl.RoPE(base=97.0),
        window=(3, 0),
        chunk_size=4,
        logit_softcap=5.0,
        broadcast_dropout=True,
        implementation="dense",
        interpret=True,
    )
    call = {o.name: object() for o in options.CALL if o.role == "attention"}  # handed over as they are
    call["is_causal"] = True
    set_names = {o.name for o in options.ATTRIBUTES + options.CALL if o.role == "attention"}
    assert set(attributes) | set(call) == set_names  # this test sets every attention option of the lists
    linen, twin, params = _pair(**attributes)
    q, kv = arrays(6, (B, T, Eq), (B, S, Ekv))
    handed.clear()  # _pair's init called it too
    linen.apply({"params": params}, q, kv, **call)
    twin(q, kv, **call)
    by_linen, by_nnx = ({n: k for n, k in h.items() if n != "qk_norm"} for h in handed)
    assert by_linen.keys() == by_nnx.keys() and set_names <= by_linen.keys()
    assert all(by_linen[n] is by_nnx[n] or by_linen[n] == by_nnx[n] for n in by_linen)
    assert all(by_linen[n] is call[n] for n in call)


@pytest.mark.parametrize("front_end", ["linen", "nnx"])
def test_refusals_are_the_same(front_end):
    """What common.attend refuses, both front ends refuse by name: a bias hook with relative tables, inputs_kv
    with key."""
    q, kv = arrays(4, (B, T, Eq), (B, S, Ekv))
    hook = jaxattn.alibi_position_bias(jaxattn.alibi_slopes(N, dtype=jnp.float64))
    linen, twin, params = _pair(relative=True)
    run = (lambda **kw: linen.apply({"params": params}, q, **kw)) if front_end == "linen" else twin
    args = () if front_end == "linen" else (q,)
    with pytest.raises(ValueError, match="position_bias"):
        run(*args, inputs_kv=kv, position_bias=hook)
    with pytest.raises(ValueError, match="inputs_kv"):
        run(*args, key=kv, inputs_kv=kv)


# --- one dropout rule -----------------------------------------------------------------------------------------


def test_one_dropout_rule_in_flaxs_two_spellings():
    """options.attention_dropout for both: no `deterministic` anywhere is refused when rate > 0 (and fine at rate
    0); the call's wins in nnx (flax nnx's first_from), giving both is refused in linen (flax linen's
    merge_param); an explicit dropout_rng draws the functional layer's mask in both."""
    q, kv = arrays(5, (B, T, Eq), (B, S, Ekv))
    key = jax.random.key(7)
    linen, twin, params = _pair(dropout_rate=0.3, deterministic=True)
    functional = jaxattn.multi_head_attention(params, q, kv, kv, dropout_rate=0.3, dropout_rng=key)
    plain = jaxattn.multi_head_attention(params, q, kv, kv)
    nnx.update(twin, params)
    assert normwise(twin(q, kv, deterministic=False, dropout_rng=key), functional) == 0.0  # the call wins
    assert normwise(twin(q, kv), plain) == 0.0  # the attribute
    with pytest.raises(ValueError, match="deterministic"):
        linen.apply({"params": params}, q, kv, deterministic=False, dropout_rng=key)
    assert normwise(linen.apply({"params": params}, q, kv), plain) == 0.0
    unset = jl.MultiHeadAttention(num_heads=N, head_dim=H, value_head_dim=Hv, out_features=Eo, dropout_rate=0.3)
    dropped = unset.apply({"params": params}, q, kv, deterministic=False, dropout_rng=key)
    assert normwise(dropped, functional) == 0.0
    twin.deterministic = None
    for run in (lambda: twin(q, kv), lambda: unset.apply({"params": params}, q, kv)):
        with pytest.raises(ValueError, match="deterministic"):
            run()
    assert options.attention_dropout(0.0, None, None, None, lambda: 1 / 0, exclusive=True) == (0.0, None)
