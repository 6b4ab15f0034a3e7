"""DeBERTa's disentangled attention: the bucket helpers against transformers' own functions (to the integer),
the scheme against a float64 loop of its formula and the torchref twin's autograd, and bad input.

Axis sizes are distinct primes: B=2 T=5 S=7 H=11 Hv=13, N=6 query heads on K=3 key/value heads. The module-level
comparisons against transformers' DisentangledSelfAttention are the crosscheck cases hf_deberta_* (run here in
float64, the float32 rows in the slow group).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import torchref.positions as twin
from helpers import assert_float64, attention_loop, check_forward_and_grads, normwise
from jaxattn import deberta_log_bucket_position, deberta_relative_position, disentangled_attention

transformers = pytest.importorskip("transformers")
from transformers.models.deberta_v2 import modeling_deberta_v2 as hf  # noqa: E402

import crosscheck.cases.positions as cases  # noqa: E402

B, T, S, N, K, H, Hv = 2, 5, 7, 6, 3, 11, 13
TOL = 1e-12

# (position_buckets, max_relative_positions): DeBERTa-v3's (256, 512), v2-xlarge's, small and odd ones
BUCKETS = [(256, 512), (64, 128), (6, 9), (2, 5)] + [
    pytest.param(*p, marks=pytest.mark.slow) for p in [(256, 1024), (512, 513), (32, 512), (7, 11), (4, 7), (3, 5)]
]
# every offset within 3000, then far ones up to the int32 limit
OFFSETS = np.concatenate(
    [np.arange(-3000, 3001), [sign * 10**e for e in range(4, 10) for sign in (-1, 1)], [2**31 - 1, -(2**31 - 1)]]
)


def _hf_buckets(d, position_buckets, max_relative_positions):
    return hf.make_log_bucket_position(torch.from_numpy(d), position_buckets, max_relative_positions).long().numpy()


@pytest.mark.parametrize("position_buckets, max_relative_positions", BUCKETS)
def test_log_buckets_equal_transformers(position_buckets, max_relative_positions):
    ours = deberta_log_bucket_position(
        OFFSETS, position_buckets=position_buckets, max_relative_positions=max_relative_positions
    )
    assert ours.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(ours), _hf_buckets(OFFSETS, position_buckets, max_relative_positions))


def _bucket_loop(d, position_buckets, max_relative_positions):
    """One offset at a time, the formula with float32 steps and the log rounded once to float32."""
    mid = position_buckets // 2
    if abs(d) <= mid:
        return d
    f32 = np.float32
    log = f32(math.log(f32(abs(d)) / f32(mid)))
    log_range = f32(math.log(f32((max_relative_positions - 1) / mid)))
    return int(math.copysign(mid + int(np.ceil(log / log_range * f32(mid - 1))), d))


@pytest.mark.parametrize("position_buckets, max_relative_positions", [(256, 512), (256, 130), (9, 13)])
def test_log_buckets_equal_a_loop(position_buckets, max_relative_positions):
    """Also where max_relative_positions hugs position_buckets // 2 (256, 130): thousands of steps, where
    torch's float32 log (not always correctly rounded) may move a boundary by one at large offsets."""
    d = np.arange(-700, 701)
    expected = [_bucket_loop(int(x), position_buckets, max_relative_positions) for x in d]
    ours = deberta_log_bucket_position(
        d, position_buckets=position_buckets, max_relative_positions=max_relative_positions
    )
    np.testing.assert_array_equal(np.asarray(ours), expected)


@pytest.mark.parametrize("length", [1, 13, 600])
@pytest.mark.parametrize("position_buckets, max_relative_positions", [(-1, -1), (256, 512), (6, 9)])
def test_relative_position_equals_transformers(length, position_buckets, max_relative_positions):
    """transformers' build_relative_position is i - j: ours is j - i, the library's sign (odd buckets)."""
    x = torch.zeros(1, length, 1)
    expected = hf.build_relative_position(x, x, position_buckets, max_relative_positions)[0].numpy()
    ours = deberta_relative_position(
        length, length, position_buckets=position_buckets, max_relative_positions=max_relative_positions
    )
    np.testing.assert_array_equal(np.asarray(ours), -expected)


@pytest.mark.parametrize("query_length, key_length", [(5, 11), (300, 1)])
def test_relative_position_top_left_for_transformers_cross(query_length, key_length):
    """T != S: transformers puts query t at t (top-left); query_positions=arange(T) says so here."""
    q, k = torch.zeros(1, query_length, 1), torch.zeros(1, key_length, 1)
    expected = hf.build_relative_position(q, k, 6, 20)[0].numpy()
    ours = deberta_relative_position(
        query_length,
        key_length,
        position_buckets=6,
        max_relative_positions=20,
        query_positions=np.arange(query_length),
    )
    np.testing.assert_array_equal(np.asarray(ours), -expected)
    default = deberta_relative_position(query_length, key_length, position_buckets=6, max_relative_positions=20)
    bottom_right = -hf.build_relative_position(q, k, -1, -1)[0].numpy() - (key_length - query_length)
    np.testing.assert_array_equal(
        np.asarray(default),
        np.asarray(deberta_log_bucket_position(bottom_right, position_buckets=6, max_relative_positions=20)),
    )


# --- the scheme against a float64 loop --------------------------------------------------------------------


def disentangled_loop(q, k, v, kr, qr, *, position_buckets, max_relative_positions, is_causal=False, mask=None):
    """scale * (q.k + q.Kr[row] + k.Qr[row]) one logit at a time, as a bias on attention_loop's scaled q.k."""
    span = position_buckets if position_buckets > 0 else max_relative_positions
    terms = (kr is not None) + (qr is not None)
    scale = (H * (1 + terms)) ** -0.5
    bias = np.zeros((B, N, T, S))
    for b in range(B):
        for n in range(N):
            for t in range(T):
                for s in range(S):
                    d = s - (t + S - T)
                    if position_buckets > 0:
                        d = _bucket_loop(d, position_buckets, max_relative_positions)
                    row = min(max(span - d, 0), 2 * span - 1)
                    if kr is not None:
                        bias[b, n, t, s] += q[b, t, n] @ (kr[row, n] if kr.ndim == 3 else kr[row])
                    if qr is not None:
                        bias[b, n, t, s] += k[b, s, n // (N // K)] @ (qr[row, n] if qr.ndim == 3 else qr[row])
    return attention_loop(q, k, v, bias=scale * bias, scale=scale, is_causal=is_causal, mask=mask)[0]


def _tables(seed, rows, shared=(False, False)):
    rng = np.random.default_rng(seed)
    return [rng.normal(size=(rows, H) if one else (rows, N, H)) for one in shared]


@pytest.mark.parametrize(
    "terms, position_buckets, max_relative_positions, shared",
    [
        (("c2p", "p2c"), 4, 6, (False, True)),
        (("c2p",), -1, 3, (False, False)),
        (("p2c",), 8, 30, (False, False)),
    ],
)
def test_equals_loop_and_twin(terms, position_buckets, max_relative_positions, shared):
    rng = np.random.default_rng(1)
    q, k, v = rng.normal(size=(B, T, N, H)), rng.normal(size=(B, S, K, H)), rng.normal(size=(B, S, K, Hv))
    span = position_buckets if position_buckets > 0 else max_relative_positions
    kr, qr = _tables(2, 2 * span, shared)
    kr, qr = (kr if "c2p" in terms else None), (qr if "p2c" in terms else None)
    opts = dict(position_buckets=position_buckets, max_relative_positions=max_relative_positions)
    mask = rng.random((B, 1, T, S)) > 0.3
    out = disentangled_attention(q, k, v, kr, qr, mask=mask, **opts)
    assert normwise(out, disentangled_loop(q, k, v, kr, qr, mask=mask, **opts)) <= TOL

    # jit and grad against the twin's autograd, every input and table
    args = [q, k, v, *(t for t in (kr, qr) if t is not None)]

    def place(tables):
        it = iter(tables)
        return [next(it) if term in terms else None for term in ("c2p", "p2c")]

    def ours(q, k, v, *tables):
        return disentangled_attention(q, k, v, *place(tables), **opts)

    cot = rng.normal(size=(B, T, N, Hv))
    out = jax.jit(ours)(*args)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a) * cot), argnums=tuple(range(len(args)))))(*args)
    targs = [torch.tensor(a, requires_grad=True) for a in args]
    t_out = twin.disentangled_attention(*targs[:3], *place(targs[3:]), **opts)
    t_grads = torch.autograd.grad((t_out * torch.tensor(cot)).sum(), targs)
    assert_float64(out, grads)
    assert normwise(out, t_out.detach().numpy()) <= TOL
    for g, tg in zip(grads, t_grads, strict=True):
        assert normwise(g, tg.numpy()) <= TOL


def test_causal_grouped_heads_equal_loop():
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(B, T, N, H)), rng.normal(size=(B, S, K, H)), rng.normal(size=(B, S, K, Hv))
    kr, qr = _tables(4, 6)
    opts = dict(position_buckets=-1, max_relative_positions=3)
    out = disentangled_attention(q, k, v, kr, qr, is_causal=True, **opts)
    assert normwise(out, disentangled_loop(q, k, v, kr, qr, is_causal=True, **opts)) <= TOL


@pytest.mark.parametrize("name", ["hf_deberta_buckets"])
def test_transformers_module_agrees_float64(name):
    """One of the hf_deberta_* cases in the default group (outputs and the gradients of inputs, every weight
    and the relative embeddings, 1e-12); every case in both dtypes in the slow test below and `crosscheck --all`."""
    report = getattr(cases, name)().compare(dtype="float64", transform="jit", name=name)
    assert report.passed, str(report)
    grads = {m.name for m in report.metrics if m.kind == "grad"}
    assert {"x", "rel"} <= grads and any(g.startswith("params/") for g in grads), grads


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(
    "name",
    ["hf_deberta_buckets", "hf_deberta_shared_key", "hf_deberta_c2p_cross", "hf_deberta_p2c", "hf_deberta_c2p_shared"],
)
def test_transformers_module_agrees(name, dtype):
    report = getattr(cases, name)().compare(dtype=dtype, transform="jit", name=name)
    assert report.passed, str(report)


# --- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(position_buckets=1, max_relative_positions=10), "position_buckets: expected >= 2"),
        (dict(position_buckets=8, max_relative_positions=5), "max_relative_positions: expected > position_buckets"),
        (dict(position_buckets=-1, max_relative_positions=0), "max_relative_positions: expected an int >= 1"),
        (dict(position_buckets=4.0, max_relative_positions=10), "position_buckets: expected a Python int"),
    ],
)
def test_bad_settings(kwargs, match):
    q, k, v = np.zeros((T, N, H)), np.zeros((S, K, H)), np.zeros((S, K, Hv))
    with pytest.raises(ValueError, match=match):
        disentangled_attention(q, k, v, np.zeros((8, N, H)), **kwargs)


def test_bad_tables_and_implementation():
    q, k, v = np.zeros((T, N, H)), np.zeros((S, K, H)), np.zeros((S, K, Hv))
    opts = dict(position_buckets=4, max_relative_positions=10)
    with pytest.raises(ValueError, match=r"position_keys: expected shape \[8,6,11\]"):
        disentangled_attention(q, k, v, np.zeros((10, N, H)), **opts)
    with pytest.raises(ValueError, match=r"position_queries: expected shape \[8,11\]"):
        disentangled_attention(q, k, v, None, np.zeros((8, H + 1)), **opts)
    with pytest.raises(ValueError, match="position_keys / queries: expected not in use with implementation='cudnn'"):
        disentangled_attention(q, k, v, np.zeros((8, N, H)), implementation="cudnn", **opts)
    with pytest.raises(ValueError, match="relative_position: expected an integer dtype"):
        deberta_log_bucket_position(np.zeros(3), position_buckets=4, max_relative_positions=10)
    with pytest.raises(ValueError, match="position_buckets: expected >= 2"):
        deberta_log_bucket_position(np.zeros(3, int), position_buckets=-1, max_relative_positions=10)
    with pytest.raises(ValueError, match="max_relative_positions: expected > position_buckets // 2 \\+ 1 = 5"):
        deberta_relative_position(T, S, position_buckets=8, max_relative_positions=5)


# --- the layer: functional, linen, nnx ---------------------------------------------------------------------


def _hf_attention(share_att_key, pos_att_type, seed=5):
    """DebertaV2Attention with seeded float64 weights, and the same weights as our parameter tree."""
    from crosscheck.catalogue import randomize

    E, N = 15, 3
    config = transformers.DebertaV2Config(
        hidden_size=E,
        num_attention_heads=N,
        relative_attention=True,
        pos_att_type=list(pos_att_type),
        share_att_key=share_att_key,
        position_buckets=4,
        max_relative_positions=7,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
    )
    module = randomize(hf.DebertaV2Attention(config), np.random.default_rng(seed)).eval()
    state = {name: p.detach().numpy() for name, p in module.named_parameters()}

    def heads(name):
        w, b = state[f"self.{name}_proj.weight"], state[f"self.{name}_proj.bias"]
        return {"kernel": w.T.reshape(E, N, E // N), "bias": b.reshape(N, E // N)}

    params = {name: heads(name) for name in ("query", "key", "value")}
    params["out"] = {"kernel": state["output.dense.weight"].T.reshape(N, E // N, E), "bias": state["output.dense.bias"]}
    for term, name in (("c2p", "pos_key"), ("p2c", "pos_query")):
        if term in pos_att_type and not share_att_key:
            params[name] = heads(name)
    return module, params


def _hf_forward(module, x, rel, mask):
    """transformers' attention up to SelfOutput's dense (its residual LayerNorm is the model's), scale in float64."""
    with cases.deberta_float64_scale(torch.float64):
        z = module.self(torch.from_numpy(x), torch.from_numpy(mask), rel_embeddings=torch.from_numpy(rel))[0]
        return module.output.dense(z).detach().numpy()


@pytest.mark.parametrize(
    "share_att_key, pos_att_type",
    [(False, ("c2p", "p2c")), pytest.param(True, ("p2c", "c2p"), marks=pytest.mark.slow)],
)
def test_layers_equal_transformers(share_att_key, pos_att_type):
    import flax.nnx as nnx

    import jaxattn.linen
    import jaxattn.nnx
    from jaxattn import disentangled_multi_head_attention, init_disentangled_multi_head_attention

    module, params = _hf_attention(share_att_key, pos_att_type)
    rng = np.random.default_rng(6)
    x, rel = rng.normal(size=(B, 13, 15)), rng.normal(size=(8, 15))
    mask = np.ones((B, 1, 1, 13), bool)
    mask[1, ..., -4:] = False
    expected = _hf_forward(module, x, rel, mask)
    opts = dict(position_buckets=4, max_relative_positions=7, pos_att_type=pos_att_type, share_att_key=share_att_key)
    out = disentangled_multi_head_attention(params, x, rel_embeddings=rel, mask=mask, **opts)
    assert normwise(out, expected) <= TOL

    linen_layer = jaxattn.linen.DisentangledAttention(num_heads=3, **opts)
    variables = linen_layer.init(jax.random.key(0), x, rel_embeddings=rel)
    assert jax.tree.structure(variables["params"]) == jax.tree.structure(params)
    assert normwise(linen_layer.apply({"params": params}, x, rel_embeddings=rel, mask=mask), expected) <= TOL

    nnx_layer = jaxattn.nnx.DisentangledAttention(15, 3, **opts, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    assert jax.tree.structure(nnx_layer.params()) == jax.tree.structure(params)
    nnx.update(nnx_layer, params)
    assert normwise(nnx_layer(x, rel_embeddings=rel, mask=mask), expected) <= TOL

    fresh = init_disentangled_multi_head_attention(
        jax.random.key(1), 15, 3, pos_att_type=pos_att_type, share_att_key=share_att_key
    )
    assert jax.tree.map(jnp.shape, fresh) == jax.tree.map(jnp.shape, params)


def test_layer_refuses_entries_that_do_not_fit_the_terms():
    from jaxattn import disentangled_multi_head_attention, init_disentangled_multi_head_attention

    params = init_disentangled_multi_head_attention(jax.random.key(0), 15, 3, dtype=jnp.float64)
    x, rel = np.zeros((2, 5, 15)), np.zeros((8, 15))
    opts = dict(rel_embeddings=rel, position_buckets=4, max_relative_positions=7)
    with pytest.raises(ValueError, match=r"params: expected position entries \['pos_key'\]"):
        disentangled_multi_head_attention(params, x, pos_att_type=("c2p",), **opts)
    with pytest.raises(ValueError, match=r"params: expected position entries \[\]"):
        disentangled_multi_head_attention(params, x, share_att_key=True, **opts)
    with pytest.raises(ValueError, match="pos_att_type: expected distinct terms"):
        disentangled_multi_head_attention(params, x, pos_att_type=("c2p", "p2p"), **opts)
    with pytest.raises(ValueError, match=r"params\['pos_key'\]\['kernel'\]: expected shape \[14,3,5\]"):
        disentangled_multi_head_attention(params, x, **{**opts, "rel_embeddings": np.zeros((8, 14))})


# --- the blockwise path ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        dict(is_causal=True),
        pytest.param(dict(key_value_seq_lengths=np.array([S, 4])), marks=pytest.mark.slow),
        pytest.param(dict(block_size=(2, 3)), marks=pytest.mark.slow),
    ],
)
def test_blockwise_equals_dense(options):
    """Outputs and the gradients of q, k, v and both tables, GQA, bucketed rows clipped at both ends."""
    rng = np.random.default_rng(11)
    q, k, v = rng.normal(size=(B, T, N, H)), rng.normal(size=(B, S, K, H)), rng.normal(size=(B, S, K, Hv))
    kr, qr = _tables(12, 8, (False, True))
    opts = dict(position_buckets=4, max_relative_positions=5, **options)

    def dense(*args):
        return disentangled_attention(*args, **{k: v for k, v in opts.items() if k != "block_size"})

    def tiled(*args):
        return disentangled_attention(*args, implementation="blockwise", **opts)

    check_forward_and_grads(tiled, dense, (q, k, v, kr, qr), (0, 1, 2, 3, 4), tol=TOL)


@pytest.mark.slow  # ~7 s of compiling at T = S = 4096
def test_blockwise_memory_is_linear():
    """No [N,T,S] array, forward or backward: doubling T = S from 2048 to 4096 adds memory linearly, a small
    fraction of the [N,T,S] float32 logits array the dense engine adds."""
    from helpers import grad_of_sum, temp_bytes

    opts = dict(position_buckets=64, max_relative_positions=256)

    def blockwise(q, k, v, kr, qr):
        return disentangled_attention(q, k, v, kr, qr, implementation="blockwise", **opts)

    def temps(fn, L):
        return temp_bytes(fn, *([(1, L, 4, 16)] * 3 + [(128, 4, 16)] * 2))

    logits_growth = 4 * (4096**2 - 2048**2) * 4  # one [N,T,S] float32 array's growth: 192 MiB
    for fn in (blockwise, grad_of_sum(blockwise, (0, 1, 2, 3, 4))):
        growth = temps(fn, 4096) - temps(fn, 2048)
        assert growth < logits_growth / 8, (growth, logits_growth)
    dense = lambda *a: disentangled_attention(*a, implementation="dense", **opts)  # noqa: E731  holds [N,T,S]
    assert temps(dense, 4096) - temps(dense, 2048) >= logits_growth


def _engine(fn):
    """Which engine fn(**kw) runs under implementation=None: its program is that of "dense" or "blockwise"."""
    program = {name: str(jax.make_jaxpr(lambda: fn(implementation=name))()) for name in (None, "dense", "blockwise")}
    assert program["dense"] != program["blockwise"]
    return next((name for name in ("dense", "blockwise") if program[None] == program[name]), "neither")


def test_none_takes_blockwise_past_the_threshold_and_the_table():
    """None: blockwise where T x S reaches the threshold and S exceeds the table's rows (and the call has no
    option only dense takes); dense otherwise. Its numbers are the dense engine's."""
    from jaxattn._api import AUTO_BLOCKWISE_ELEMENTS

    R = 2 * 61  # position_buckets = 61 (a span of 61 rows each way)
    opts = dict(position_buckets=61, max_relative_positions=97)

    def call(Tq, Sk, **kw):
        rng = np.random.default_rng(Tq * Sk)
        q, k, v = rng.normal(size=(Tq, N, H)), rng.normal(size=(Sk, K, H)), rng.normal(size=(Sk, K, Hv))
        kr, qr = rng.normal(size=(R, N, H)) * 0.3, rng.normal(size=(R, N, H)) * 0.3
        return lambda **more: disentangled_attention(q, k, v, kr, qr, **opts, **kw, **more)

    assert 127 * 131 >= AUTO_BLOCKWISE_ELEMENTS > 113 * 127 and 131 > R >= 113
    assert _engine(call(127, 131)) == "blockwise"
    assert _engine(call(113, 127)) == "dense"  # below the threshold
    assert _engine(call(167, R)) == "dense"  # past the threshold, but S = R: per-row scores as wide as the logits
    for only_dense in (dict(query_positions=np.arange(127)), dict(logit_softcap=30.0)):  # indexed by row, capped
        program = str(jax.make_jaxpr(lambda: call(127, 131, **only_dense)())())
        assert program == str(jax.make_jaxpr(lambda: call(127, 131, **only_dense)(implementation="dense"))())
    fn = call(127, 131)
    auto, dense = fn(), fn(implementation="dense")
    assert_float64(auto, dense)
    assert normwise(auto, dense) < TOL


def test_blockwise_refuses_what_it_cannot_index():
    q, k, v = np.zeros((T, N, H)), np.zeros((S, K, H)), np.zeros((S, K, Hv))
    opts = dict(position_buckets=4, max_relative_positions=10, implementation="blockwise")
    with pytest.raises(ValueError, match="query_positions: expected None with implementation='blockwise'"):
        disentangled_attention(q, k, v, np.zeros((8, N, H)), query_positions=np.arange(T), **opts)
    with pytest.raises(ValueError, match="interpret: expected False unless implementation is"):
        disentangled_attention(q, k, v, np.zeros((8, N, H)), interpret=True, **opts)
    with pytest.raises(ValueError, match="logit_softcap: expected None with implementation='blockwise'"):
        disentangled_attention(q, k, v, np.zeros((8, N, H)), logit_softcap=5.0, **opts)
    with pytest.raises(ValueError, match="mask"):
        disentangled_attention(q, k, v, np.zeros((8, N, H)), mask=np.ones((T, S), bool), **opts)


def test_layers_dropout():
    """Weight dropout as MultiHeadAttention's: deterministic gives the plain output; a drawn mask changes it,
    the same key the same way in linen and nnx (both hand it to the engine); no `deterministic`: ValueError."""
    import flax.nnx as nnx

    import jaxattn.linen
    import jaxattn.nnx

    x, rel = np.random.default_rng(7).normal(size=(B, 9, 15)), np.random.default_rng(8).normal(size=(8, 15))
    opts = dict(position_buckets=4, max_relative_positions=7)
    layer = jaxattn.linen.DisentangledAttention(num_heads=3, dropout_rate=0.3, **opts)
    variables = layer.init(jax.random.key(0), x, rel_embeddings=rel, deterministic=True)
    plain = jaxattn.linen.DisentangledAttention(num_heads=3, **opts).apply(variables, x, rel_embeddings=rel)
    assert normwise(layer.apply(variables, x, rel_embeddings=rel, deterministic=True), plain) == 0.0
    key = jax.random.key(3)
    dropped = layer.apply(variables, x, rel_embeddings=rel, deterministic=False, dropout_rng=key)
    assert bool(jnp.all(jnp.isfinite(dropped))) and normwise(dropped, plain) > 1e-3
    with pytest.raises(ValueError, match="deterministic"):
        layer.apply(variables, x, rel_embeddings=rel)

    twin_layer = jaxattn.nnx.DisentangledAttention(
        15, 3, dropout_rate=0.3, **opts, param_dtype=jnp.float64, rngs=nnx.Rngs(0)
    )
    nnx.update(twin_layer, variables["params"])
    assert normwise(twin_layer(x, rel_embeddings=rel, deterministic=False, dropout_rng=key), dropped) <= TOL
    twin_layer.eval()
    assert normwise(twin_layer(x, rel_embeddings=rel), plain) == 0.0
