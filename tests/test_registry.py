"""The registry of implementations (jaxattn._dispatch.registry): every implementation `implementation=` names, the
XLA engines included, is an entry of one shape that the dispatch drives (how it runs, what it refuses, what
implementation=None declines), and a call checks its `implementation=` once, whatever path it takes."""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn import _api
from jaxattn._core.call import AttentionCall
from tests.helpers import allowed_loop, attention_reference, normwise

B, T, S, N, K, H, Hv = 2, 5, 7, 3, 1, 11, 13


def qkv(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv))]


def test_every_implementation_is_an_entry_of_one_shape():
    names = ("dense", "blockwise", "pallas_gpu", "pallas_tpu", "cudnn")
    assert tuple(_api.REGISTRY) == _api.IMPLEMENTATIONS[1:] == names
    fields = {field.name for field in dataclasses.fields(_api.Implementation)}
    assert {"name", "attention", "unsupported", "declined", "platform", "interpretable"} <= fields
    for name, entry in _api.REGISTRY.items():
        assert type(entry) is _api.Implementation and entry.name == name
        assert all(callable(getattr(entry, member)) for member in ("attention", "unsupported", "declined")), name
    assert _api.KERNELS == ("pallas_gpu", "pallas_tpu", "cudnn")
    assert [entry.platform for entry in _api.REGISTRY.values()] == [None, None, "cuda", "tpu", "cuda"]


def test_the_xla_engines_run_through_their_entries():
    """The dense and blockwise entries compute a causal call (float64 reference), as the public function does."""
    q, k, v = qkv()
    call = AttentionCall(is_causal=True, block_size=(3, 2))
    expected = attention_reference(q, k, v, allowed_loop(B, N, T, S, is_causal=True))
    for name in ("dense", "blockwise"):
        out = _api.REGISTRY[name].attention(call, q, k, v, False)
        assert normwise(out, expected) <= 1e-14, name
        public = jaxattn.dot_product_attention(q, k, v, is_causal=True, block_size=(3, 2), implementation=name)
        np.testing.assert_array_equal(out, public)
        assert _api.REGISTRY[name].unsupported(call.replace(mask=np.ones((T, S), bool)), q, k, v, False) is None


def test_declined_is_a_declared_member_and_only_the_tpu_kernel_declines():
    """A window's bias (Swin): expressed by the TPU flex kernel, but implementation=None keeps the XLA engines
    there (flex_tpu.declined, the padded tiles' memory); no other entry declines it, nor a plain call."""
    q, k, v = qkv()
    window = (2, 3)
    table = np.random.default_rng(1).standard_normal((jaxattn.window_table_rows(window), N))
    plain, windowed = AttentionCall(), AttentionCall(position_bias=jaxattn.window_position_bias(table, window))
    declining = {name for name, entry in _api.REGISTRY.items() if entry.declined(windowed, q, k, v) is not None}
    assert declining == {"pallas_tpu"}
    assert all(entry.declined(plain, q, k, v) is None for entry in _api.REGISTRY.values())


def test_a_kernel_entry_refuses_the_options_that_span_the_grid():
    q, k, v = qkv()
    mask = np.ones((T, S), bool)
    for name in _api.KERNELS:
        assert _api.REGISTRY[name].unsupported(AttentionCall(mask=mask), q, k, v, False) == "mask", name


def _count_checks(monkeypatch):
    """The calls of check_implementation in the module that defines it (where the dispatch looks it up)."""
    home = sys.modules[_api.check_implementation.__module__]
    calls = []
    check = home.check_implementation

    def counted(*args, **kwargs):
        calls.append(args)
        return check(*args, **kwargs)

    monkeypatch.setattr(home, "check_implementation", counted)
    return calls


CALLS = {
    "dot_product_attention": lambda implementation, **kw: (
        lambda q, k, v: jaxattn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation, **kw)
    ),
    "flex_attention": lambda implementation, **kw: (
        lambda q, k, v: jaxattn.flex_attention(q, k, v, implementation=implementation, **kw)
    ),
    # the position schemes that read implementation= before they route (attend(checked=True))
    "alibi_attention": lambda implementation, **kw: (
        lambda q, k, v: jaxattn.alibi_attention(q, k, v, np.linspace(0.1, 1, N), implementation=implementation, **kw)
    ),
    "t5_attention": lambda implementation, **kw: (
        lambda q, k, v: jaxattn.t5_attention(q, k, v, np.ones((32, N)), implementation=implementation, **kw)
    ),
    "disentangled_attention": lambda implementation, **kw: (
        lambda q, k, v: jaxattn.disentangled_attention(
            q, k, v, position_keys=np.ones((8, N, H)), max_relative_positions=4, implementation=implementation, **kw
        )
    ),
}


@pytest.mark.parametrize("function", CALLS)
@pytest.mark.parametrize(
    "implementation, interpret",
    [(None, False), ("dense", False), ("blockwise", False), ("pallas_gpu", True)],
)
def test_a_call_checks_its_implementation_once(monkeypatch, function, implementation, interpret):
    calls = _count_checks(monkeypatch)
    q, k, v = qkv()
    keywords = dict(interpret=True) if interpret else {}
    with jax.enable_x64(False), jaxattn.cross_platform_lowering():  # None: the platform switch with every kernel
        jax.make_jaxpr(CALLS[function](implementation, **keywords))(q, k, v)
    assert calls == [(implementation, interpret)]


def test_jax_nn_s_xla_checks_once(monkeypatch):
    """implementation="xla" (jax.nn's spelling) is the XLA engines' choice, checked as that engine's name."""
    calls = _count_checks(monkeypatch)
    jax.make_jaxpr(lambda q, k, v: jaxattn.dot_product_attention(q, k, v, implementation="xla"))(*qkv())
    assert T * S < _api.AUTO_BLOCKWISE_ELEMENTS and calls == [("dense", False)]


def test_an_attention_call_is_a_pytree_of_its_arrays():
    """AttentionCall's leaves are its array fields (ARRAY_FIELDS, a BlockMask's own arrays among them), so a call
    passes through jax.vjp / custom_vjp / jit as one value: a map keeps every other option (the same objects), a
    VJP gives a call of cotangents (float0 for the integer ones), and a jitted function of a call traces its
    arrays, not its statics."""
    from jaxattn._core.call import ARRAY_FIELDS, FIELDS

    rng = np.random.default_rng(3)
    sinks, lengths = rng.standard_normal(N), np.array([4, 7])
    score_mod = lambda x, b, n, t, s: x  # noqa: E731
    call = AttentionCall(is_causal=True, sinks=sinks, key_value_seq_lengths=lengths, scale=0.25, score_mod=score_mod)
    leaves, treedef = jax.tree.flatten(call)
    assert len(leaves) == 2 and set(ARRAY_FIELDS) < set(FIELDS)
    doubled = jax.tree.map(lambda x: 2 * x, call)
    np.testing.assert_array_equal(doubled.sinks, 2 * sinks)
    assert doubled.score_mod is score_mod and doubled.scale == 0.25 and doubled.is_causal
    assert jax.tree.structure(doubled) == treedef

    def loss(call):
        return jnp.sum(call.sinks**2) * call.scale

    (d_call,) = jax.vjp(loss, call)[1](1.0)
    assert isinstance(d_call, AttentionCall)
    np.testing.assert_allclose(d_call.sinks, 2 * 0.25 * sinks)
    assert d_call.key_value_seq_lengths.dtype == jax.dtypes.float0
    np.testing.assert_allclose(jax.jit(loss)(call), loss(call))
