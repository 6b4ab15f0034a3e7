"""Every relative-position scheme on the blockwise engine (issue 34): T5, ALiBi, clipped tables, Transformer-XL
and per-pair tables (relative_attention), forward and backward, against float64 loops of each formula and the
dense engine's float64 gradients; implementation=None takes blockwise at long sequences; what blockwise cannot
combine is refused by name when asked for, and falls back to dense under None.

Prime sizes: B=2 T=37 S=41 N=6 K=3 (grouped-query) H=5 Hv=7; tiles (8, 16), so neither length is a tile
multiple, and clip distances / T5's max_distance on both sides of a tile.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_positions import bucket_loop, xl_loop

import jaxattn
from helpers import assert_float64, attention_loop, grad_of_sum, normwise, temp_bytes

B, T, S, N, K, H, Hv = 2, 37, 41, 6, 3, 5, 7
TILE = (8, 16)
FORWARD_TOL, GRAD_TOL = 1e-6, 1e-5  # float32 against float64 (docs/design.md, "Tolerances")


def qkv(seed, T=T, S=S):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(B, T, N, H)), rng.normal(size=(B, S, K, H)), rng.normal(size=(B, S, K, Hv))


def offsets_loop(T, S):
    """j - i at the default bottom-right positions, one pair at a time."""
    out = np.zeros((T, S), np.int64)
    for t in range(T):
        for s in range(S):
            out[t, s] = s - (t + S - T)
    return out


def clipped_rows(T, S, max_left, max_right):
    return np.clip(offsets_loop(T, S), -max_left, max_right) + max_left


# --- each scheme: (function of (q, k, v, *tables, implementation, **options), tables, float64 loop) ----------

_rng = np.random.default_rng(1)


def _t5(bidirectional, max_distance, is_causal):
    table = _rng.normal(size=(16, N))

    def fn(q, k, v, table, **kw):
        return jaxattn.t5_attention(
            q, k, v, table, bidirectional=bidirectional, max_distance=max_distance, is_causal=is_causal, **kw
        )

    def loop(q, k, v, table):
        rel = offsets_loop(T, S)
        buckets = np.vectorize(lambda n: bucket_loop(int(n), bidirectional, 16, max_distance))(rel)
        bias = np.moveaxis(table[buckets], -1, 0)  # [N,T,S]
        return attention_loop(q, k, v, bias=bias, scale=1.0, is_causal=is_causal)[0]

    return fn, (table,), loop


def _alibi(is_causal):
    slopes = np.asarray(jaxattn.alibi_slopes(N, dtype=jnp.float64))

    def fn(q, k, v, slopes, **kw):
        return jaxattn.alibi_attention(q, k, v, slopes, bidirectional=not is_causal, is_causal=is_causal, **kw)

    def loop(q, k, v, slopes):
        rel = offsets_loop(T, S)
        distance = rel if is_causal else -np.abs(rel)
        return attention_loop(q, k, v, bias=slopes[:, None, None] * distance, is_causal=is_causal)[0]

    return fn, (slopes,), loop


def _clipped(max_left, max_right, key_heads, value_heads):
    R = max_left + max_right + 1
    kt = _rng.normal(size=(R, N, H) if key_heads else (R, H))
    vt = _rng.normal(size=(R, N, Hv) if value_heads else (R, Hv))

    def fn(q, k, v, kt, vt, **kw):
        return jaxattn.clipped_relative_attention(q, k, v, kt, vt, max_left=max_left, max_right=max_right, **kw)

    def loop(q, k, v, kt, vt):
        rows = clipped_rows(T, S, max_left, max_right)
        a_k, a_v = (x[rows] if x.ndim == 3 else x[rows][:, :, None] for x in (kt, vt))
        return attention_loop(q, k, v, rel_key=a_k, rel_value=a_v)[0]

    return fn, (kt, vt), loop


def _xl(max_left, R, per_head, is_causal):
    P = _rng.normal(size=(R, N, H) if per_head else (R, H))
    u, w = _rng.normal(size=(N, H)), _rng.normal(size=(N, H))

    def fn(q, k, v, P, u, w, **kw):
        return jaxattn.transformer_xl_attention(
            q, k, v, P, max_left=max_left, pos_bias_u=u, pos_bias_v=w, is_causal=is_causal, **kw
        )

    def loop(q, k, v, P, u, w):
        keys = P if per_head else np.broadcast_to(P[:, None], (R, N, H))
        return xl_loop(q, k, v, keys, u, w, max_left, is_causal)

    return fn, (P, u, w), loop


def _pairs(key_heads, value_heads, is_causal):
    a_k = _rng.normal(size=(T, S, N if key_heads else 1, H))
    a_v = _rng.normal(size=(T, S, N if value_heads else 1, Hv))

    def fn(q, k, v, a_k, a_v, **kw):
        return jaxattn.relative_attention(q, k, v, a_k, a_v, is_causal=is_causal, **kw)

    def loop(q, k, v, a_k, a_v):
        return attention_loop(q, k, v, rel_key=a_k, rel_value=a_v, is_causal=is_causal)[0]

    return fn, (a_k, a_v), loop


SCHEMES = {
    "t5-bidirectional-short": _t5(True, 9, False),  # max_distance 9 < a tile
    "t5-causal-long": _t5(False, 60, True),  # 60 > a tile
    "alibi-causal": _alibi(True),
    "clipped-long-left": _clipped(20, 3, key_heads=True, value_heads=False),
    "xl-causal": _xl(S - 1, S, per_head=True, is_causal=True),
    "pairs-causal": _pairs(key_heads=True, value_heads=False, is_causal=True),
}
SLOW_SCHEMES = {
    "alibi-symmetric": _alibi(False),
    "clipped-right-only": _clipped(0, 2, key_heads=False, value_heads=True),
    "clipped-short": _clipped(3, 5, key_heads=True, value_heads=True),
    "xl-shared-bidirectional": _xl(S - 1, 2 * S - 1, per_head=False, is_causal=False),
    "xl-short": _xl(3, 6, per_head=True, is_causal=False),
    "pairs-shared": _pairs(key_heads=False, value_heads=True, is_causal=False),
}


def _check_scheme(name, schemes):
    fn, tables, loop = schemes[name]
    q, k, v = qkv(2)
    args64 = (q, k, v, *tables)
    args32 = tuple(np.asarray(a, np.float32) for a in args64)
    argnums = tuple(range(len(args64)))
    w = np.random.default_rng(3).normal(size=(B, T, N, Hv))

    def with_grads(implementation, **kw):
        f = lambda *a: fn(*a, implementation=implementation, **kw)  # noqa: E731
        return jax.jit(lambda *a: (f(*a), jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums)(*a)))

    out32, grads32 = with_grads("blockwise", block_size=TILE)(*args32)
    assert out32.dtype == jnp.float32
    error = normwise(out32, loop(*args64))
    assert error <= FORWARD_TOL, f"forward against the float64 loop: {error:.3g}"
    _, grads64 = with_grads("dense")(*args64)
    assert_float64(grads64)
    for i, got, want in zip(argnums, grads32, grads64, strict=True):
        error = normwise(got, want)
        assert error <= GRAD_TOL, f"gradient of argument {i} against the float64 dense engine: {error:.3g}"


def _slow_but(*fast):
    """Every scheme, those not in `fast` in the slow group (the default group stays a few seconds)."""
    everything = {**SCHEMES, **SLOW_SCHEMES}
    return [name if name in fast else pytest.param(name, marks=pytest.mark.slow) for name in everything]


@pytest.mark.parametrize("name", _slow_but("pairs-causal"))
def test_blockwise_float32_against_float64_loop_and_dense_gradients(name):
    _check_scheme(name, {**SCHEMES, **SLOW_SCHEMES})


# --- every other option beside a relative term ---------------------------------------------------------------

OPTIONS = {
    "lengths-segments-window": dict(
        key_value_seq_lengths=np.array([29, 41]),
        query_segment_ids=np.repeat(np.arange(2), [20, 17]),
        key_segment_ids=np.repeat(np.arange(2), [22, 19]),
        window=(13, 4),
    ),
    "softcap-sinks-lse": dict(logit_softcap=2.5, sinks=np.linspace(-1.0, 1.0, N), return_lse=True),
}


def _options_check(name, option):
    fn, tables, _ = {**SCHEMES, **SLOW_SCHEMES}[name]
    q, k, v = qkv(4)
    kw = OPTIONS[option]

    def run(implementation, block_size=None):
        f = lambda q, k, v, *t: jax.tree.leaves(  # noqa: E731
            fn(q, k, v, *t, implementation=implementation, block_size=block_size, **kw)
        )[0]
        out = f(q, k, v, *tables)
        grads = jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), tuple(range(3 + len(tables))))(q, k, v, *tables)
        return out, grads

    (out, grads), (want, want_grads) = run("blockwise", TILE), run("dense")
    assert normwise(out, want) <= 1e-12
    for got, expected in zip(grads, want_grads, strict=True):
        assert normwise(got, expected) <= 1e-12


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    ["t5-causal-long", "alibi-causal", "clipped-long-left", "xl-causal", "xl-short", "pairs-causal", "pairs-shared"],
)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_beside_a_relative_term(name, option):
    _options_check(name, option)


# --- jit, vmap ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["t5-bidirectional-short", "clipped-long-left", "pairs-causal"])
def test_vmap_equals_one_call_per_slice(name):
    fn, tables, _ = SCHEMES[name]
    q, k, v = qkv(5)
    stacked = np.stack([q, q[:, ::-1]])
    f = jax.jit(lambda q: fn(q, k, v, *tables, implementation="blockwise", block_size=TILE))
    batched = jax.vmap(f)(stacked)
    for i in range(2):
        assert normwise(batched[i], f(stacked[i])) <= 1e-14


# --- which engine implementation=None takes, and refusals ----------------------------------------------------


def _loops(fn, *args):
    """The number of loops in fn's jaxpr (the blockwise engine's tile loops: while, or scan where the bounds are
    static; the dense engine has none)."""
    text = str(jax.make_jaxpr(fn)(*args))
    return text.count("while[") + text.count("scan[")


def _call_at(name, Tq, Sk, **kw):
    """name's function on zero inputs of T = Tq, S = Sk (its tables resized: per-pair ones are [T,S,...])."""
    fn, tables, _ = {**SCHEMES, **SLOW_SCHEMES}[name]
    q, k, v = np.zeros((1, Tq, N, H)), np.zeros((1, Sk, K, H)), np.zeros((1, Sk, K, Hv))
    if name.startswith("pairs"):
        tables = tuple(np.zeros((Tq, Sk, *t.shape[2:])) for t in tables)
    if name.startswith("xl"):  # the causal table spans S rows
        tables = (np.zeros((Sk, *tables[0].shape[1:])), *tables[1:])
        fn = lambda q, k, v, P, u, w, **o: jaxattn.transformer_xl_attention(  # noqa: E731
            q, k, v, P, max_left=Sk - 1, pos_bias_u=u, pos_bias_v=w, is_causal=True, **o
        )
    return lambda: fn(q, k, v, *tables, **kw)


@pytest.mark.parametrize(
    "name",
    [
        "t5-causal-long",
        pytest.param("alibi-causal", marks=pytest.mark.slow),
        "clipped-long-left",
        "xl-causal",
        "pairs-causal",
    ],
)
def test_none_takes_blockwise_from_the_threshold_and_dense_below_or_for_a_mask(name):
    assert 127 * 131 >= jaxattn._api.AUTO_BLOCKWISE_ELEMENTS > 113 * 127
    assert _loops(_call_at(name, 127, 131)) > 0
    assert _loops(_call_at(name, 113, 127)) == 0
    mask = np.ones((127, 131), bool)
    assert _loops(_call_at(name, 127, 131, mask=mask)) == 0  # a [T,S] mask: the dense engine takes it
    with pytest.raises(ValueError, match="^implementation: .*mask"):
        _call_at(name, 7, 11, mask=np.ones((7, 11), bool), implementation="blockwise")()


# --- memory: XLA's compiled analysis at T = S = 4096, nothing run ---------------------------------------------

MiB = 2**20


def _long_shapes(name, L, Hd=64, heads=8, kv_heads=2):
    """Argument shapes of name's function at T = S = L (B = 1)."""
    q, k, v = (1, L, heads, Hd), (1, L, kv_heads, Hd), (1, L, kv_heads, Hd)
    tables = {
        "t5": [(32, heads)],
        "alibi": [(heads,)],
        "xl": [(L, heads, Hd), (heads, Hd), (heads, Hd)],
        "pairs": [(L, L, 1, Hd)],
    }[name]
    return [q, k, v, *tables]


LONG = {
    "t5": lambda q, k, v, t, **o: jaxattn.t5_attention(q, k, v, t, bidirectional=False, is_causal=True, **o),
    "alibi": lambda q, k, v, s, **o: jaxattn.alibi_attention(q, k, v, s, is_causal=True, **o),
    "xl": lambda q, k, v, P, u, w, **o: jaxattn.transformer_xl_attention(
        q, k, v, P, max_left=P.shape[0] - 1, pos_bias_u=u, pos_bias_v=w, is_causal=True, **o
    ),
    "pairs": lambda q, k, v, a, **o: jaxattn.relative_attention(q, k, v, a, is_causal=True, **o),
}


# The largest share of [N,T,S] the default path may hold at T = S = 4096. Transformer-XL's position keys span
# every distance (R = S rows; 2S - 1 once made symmetric): its per-head table in Shaw form, [2S - 1, N, 2H], is
# itself 1/8 of the logits at 4096, held with a copy laid out by key/value head (each tile reads only its window
# of W = Tb + Sb - 1 rows: 0.19 of the logits forward, 0.40 forward+backward; 0.26 / 0.53 when every tile formed
# q . P[r] for all 2S - 1 rows); the others hold tiles and O(T + S) vectors only.
SHARE = {"t5": 1 / 16, "alibi": 1 / 16, "xl": 1 / 4, "pairs": 1 / 16}


@pytest.mark.parametrize("name", ["t5", pytest.param("alibi", marks=pytest.mark.slow), "xl", "pairs"])
def test_default_cpu_path_far_below_the_logits_at_4096(name):
    L, heads = 4096, 8
    logits = heads * L * L * 4  # one [N,T,S] float32 array: 512 MiB
    assert temp_bytes(LONG[name], *_long_shapes(name, L)) <= logits * SHARE[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LONG))
def test_the_dense_path_holds_the_logits_at_4096(name):
    """The yardstick of the test above: implementation="dense" holds [N,T,S] (or more)."""
    L, heads = 4096, 8
    dense = temp_bytes(lambda *a: LONG[name](*a, implementation="dense"), *_long_shapes(name, L))
    assert dense >= heads * L * L * 4


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LONG))
def test_default_cpu_memory_grows_linearly(name):
    """Doubling T = S doubles the default path's temp memory, forward and backward ([N,T,S] would quadruple)."""
    argnums = tuple(range(len(_long_shapes(name, 8))))
    for fn in (LONG[name], grad_of_sum(LONG[name], argnums)):
        small, large = (temp_bytes(fn, *_long_shapes(name, L)) for L in (2048, 4096))
        assert large <= 2.3 * small, (small, large)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LONG))
def test_default_cpu_backward_far_below_the_logits_at_4096(name):
    L, heads = 4096, 8
    logits = heads * L * L * 4
    shapes = _long_shapes(name, L)
    argnums = tuple(range(len(shapes)))
    # the per-pair table's gradient is an output [T,S,1,H] (the table's own size), not a temporary
    assert temp_bytes(grad_of_sum(LONG[name], argnums), *shapes) <= logits * 2 * SHARE[name]
