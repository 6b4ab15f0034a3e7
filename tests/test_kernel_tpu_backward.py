"""The TPU flex kernel's backward (jaxattn._kernels.flex_tpu_vjp): the flash dq and dk/dv kernels run by Mosaic,
for flex calls and T5's / ALiBi's position bias.

Interpreted (Pallas' interpreter, float32 with jax_enable_x64 off, as the TPU kernels need): outputs <= 1e-6 and
gradients <= 1e-5 normwise against the float64 loop reference (helpers.attention_reference), over GQA, T != S,
lengths and head dims that are no whole tiles, causal / window / lengths / segment ids / BlockMask / mask_mod /
score_mod, sinks and return_lse (whose cotangent enters delta); T5 and ALiBi with gradients into the table and
slopes are tests/test_kernel_relative.py's TPU cases, which take these kernels. Lowered for a TPU: a training
program holds the forward, dq and dk/dv kernels and no XLA tile loop; a window's bias and position tables keep
the XLA backward.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from helpers import allowed_loop, arrays, attention_reference, normwise
from jaxattn._core.call import AttentionCall
from jaxattn._core.offset_bias import TableBias, of_rows
from jaxattn._kernels import flex_tpu_vjp, tables_tpu
from jaxattn._schemes.window import WindowIndex

OUT_TOL, GRAD_TOL = 1e-6, 1e-5


def _penalty(score, b, n, t, s):
    return score - 0.1 * (n + 1) * jnp.abs(t - s).astype(score.dtype)


def _band(b, n, t, s):
    return (t - s) % 5 != 3


def _near(b, n, t, s):
    return t + 3 >= s


# (batch, T, S, N, K, H, Hv), options
CASES = {
    "causal window lengths score_mod GQA": (
        ((2,), 21, 34, 4, 2, 3, 5),
        dict(is_causal=True, window=(19, None), key_value_seq_lengths=np.array([30, 17]), score_mod=_penalty),
    ),
    "segments mask_mod sinks return_lse MQA": (
        ((3,), 19, 19, 3, 1, 7, 2),
        dict(
            query_segment_ids=np.array([[0] * 8 + [1] * 11] * 3),
            key_segment_ids=np.array([[0] * 8 + [1] * 11] * 3),
            mask_mod=_band,
            sinks=np.linspace(-1.0, 1.0, 3).astype(np.float32),
            return_lse=True,
        ),
    ),
    "block_mask softcap, no batch dims": (
        ((), 33, 29, 2, 2, 4, 6),
        dict(
            block_mask=jaxattn.create_block_mask(_near, None, None, 33, 29, block_size=16),
            logit_softcap=2.0,
        ),
    ),
}


def _reference_options(options):
    """attention_reference's keywords for a case: the mask rule goes to allowed_loop, the rest as given."""
    rule_names = ("is_causal", "window", "key_value_seq_lengths", "query_segment_ids", "key_segment_ids")
    rule = {k: v for k, v in options.items() if k in rule_names}
    if "mask_mod" in options:
        rule["mask_mod"] = options["mask_mod"]
    if "block_mask" in options:  # the BlockMask's own mask_mod
        rule["mask_mod"] = _near
    rest = {k: options[k] for k in ("score_mod", "sinks", "return_lse", "logit_softcap") if k in options}
    return rule, rest


@pytest.mark.parametrize(
    "name", [n if i == 0 else pytest.param(n, marks=pytest.mark.slow) for i, n in enumerate(CASES)]
)
def test_gradients_equal_the_float64_reference(name):
    (batch, T, S, N, K, H, Hv), options = CASES[name]
    q, k, v = (np.asarray(x, np.float32) for x in arrays(3, (*batch, T, N, H), (*batch, S, K, H), (*batch, S, K, Hv)))
    rule, rest = _reference_options(options)
    allowed = allowed_loop(batch, N, T, S, **rule)
    w = arrays(9, (*batch, T, N, Hv))[0]
    sinks = options.get("sinks")

    def loss_of(f):
        def loss(q, k, v, sinks):
            out = f(q, k, v, sinks)
            out, lse = out if options.get("return_lse") else (out, None)
            total = jnp.sum(out * w.astype(out.dtype))
            if lse is not None:  # lse's cotangent enters the kernels' delta
                total = total + 0.3 * jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0))
            return total

        argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
        return jax.value_and_grad(loss, argnums=argnums)

    def kernel(q, k, v, sinks):
        call = dict(options, sinks=sinks) if sinks is not None else options
        return jaxattn.flex_attention(q, k, v, implementation="pallas_tpu", interpret=True, precision="highest", **call)

    def reference(q, k, v, sinks):  # attention_reference takes one batch axis
        extra = dict(rest, sinks=sinks) if sinks is not None else rest
        if batch:
            return attention_reference(q, k, v, allowed, **extra)
        out = attention_reference(q[None], k[None], v[None], allowed[None], **extra)
        return jax.tree.map(lambda x: x[0], out)

    with jax.enable_x64(False):
        value, grads = jax.jit(loss_of(kernel))(q, k, v, sinks)
    wide = tuple(None if x is None else np.asarray(x, np.float64) for x in (q, k, v, sinks))
    want, want_grads = jax.jit(loss_of(reference))(*wide)
    assert abs(float(value) - float(want)) <= OUT_TOL * max(1.0, abs(float(want)))
    for got, ref in zip(grads, want_grads, strict=True):
        assert bool(jnp.all(jnp.isfinite(got)))
        assert normwise(got, ref) <= GRAD_TOL, normwise(got, ref)


@pytest.mark.parametrize(
    "name", [n if i == 0 else pytest.param(n, marks=pytest.mark.slow) for i, n in enumerate(CASES)]
)
def test_streamed_rows_give_the_same_gradients(name, monkeypatch):
    """Past MAX_ROWS_BYTES (forced here to every call) the forward's and the dq kernel's keys and values and the
    dk/dv kernel's queries and their cotangent stay in HBM, a tile copied in at a time (refs_tpu.Streamed): the
    same outputs and gradients."""
    monkeypatch.setattr(flex_tpu_vjp, "MAX_ROWS_BYTES", 1)
    test_gradients_equal_the_float64_reference(name)


# bf16 inputs against the float64 reference on the same rounded numbers: the bars of the kernels' other bf16
# checks (tests/test_kernel_shaw.py), outputs 5e-3 and gradients 8e-3 normwise.
BF16_TOLERANCES = (5e-3, 8e-3)


@pytest.mark.slow
def test_bf16_within_the_envelope():
    (batch, T, S, N, K, H, Hv), options = CASES["causal window lengths score_mod GQA"]
    shapes = (*batch, T, N, H), (*batch, S, K, H), (*batch, S, K, Hv)
    q, k, v = (np.asarray(x, np.float32).astype(jnp.bfloat16) for x in arrays(5, *shapes))
    rule, rest = _reference_options(options)
    allowed = allowed_loop(batch, N, T, S, **rule)
    w = arrays(9, (*batch, T, N, Hv))[0]

    def value_and_grads(f, w, *args):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(f(*a).astype(w.dtype) * w), argnums=(0, 1, 2)))(*args)

    def kernel(q, k, v):
        return jaxattn.flex_attention(q, k, v, implementation="pallas_tpu", interpret=True, **options)

    with jax.enable_x64(False):
        out = jax.jit(kernel)(q, k, v)
        _, grads = value_and_grads(kernel, np.asarray(w, np.float32), q, k, v)
    wide = tuple(np.asarray(x, np.float64) for x in (q, k, v))
    want = attention_reference(*wide, allowed, **rest)
    _, want_grads = value_and_grads(lambda *a: attention_reference(*a, allowed, **rest), w, *wide)
    assert out.dtype == jnp.bfloat16
    assert normwise(out, want) <= BF16_TOLERANCES[0], normwise(out, want)
    for got, ref in zip(grads, want_grads, strict=True):
        assert got.dtype == jnp.bfloat16
        assert normwise(got, ref) <= BF16_TOLERANCES[1], normwise(got, ref)


def _training_program(options, T=4096):
    q = jax.ShapeDtypeStruct((1, T, 8, 128), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, T, 2, 128), jnp.bfloat16)

    def loss(q, k, v):
        out = jaxattn.flex_attention(q, k, v, implementation="pallas_tpu", **options)
        return jnp.sum(out.astype(jnp.float32))

    with jax.enable_x64(False), jaxattn.cross_platform_lowering():
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).as_text()


def test_a_training_program_holds_the_three_kernels():
    text = _training_program(dict(score_mod=lambda x, b, n, t, s: x - 0.01 * jnp.abs(t - s), is_causal=True))
    kernels = re.findall(r'kernel_name = "(\w+)"', text)
    assert sorted(kernels) == ["jaxattn_flex_tpu_dkv", "jaxattn_flex_tpu_dq", "jaxattn_flex_tpu_forward"]
    assert "stablehlo.while" not in text  # no XLA tile loop
    assert not re.search(r"4096x4096", text)  # no [T,S] buffer


# Each scheme's training program with gradients into its tables: T5's (its rows' gradient summed per offset in
# the dq kernel, the table's through them, no scatter), Shaw's key and value tables and DeBERTa's c2p and p2c
# (each table's lanes' gradient summed in the dq kernel, the tables' through the lanes' layout).
SCHEMES = {
    "t5": (
        ((32, 8),),
        lambda q, k, v, table: jaxattn.t5_attention(
            q, k, v, table, bidirectional=False, is_causal=True, implementation="pallas_tpu"
        ),
    ),
    "shaw": (
        ((33, 8, 128), (33, 128)),
        lambda q, k, v, kt, vt: jaxattn.shaw_relative_attention(
            q, k, v, kt, vt, max_distance=16, is_causal=True, implementation="pallas_tpu"
        ),
    ),
    "deberta": (
        ((512, 8, 128), (512, 8, 128)),
        lambda q, k, v, kr, qr: jaxattn.disentangled_attention(
            q, k, v, kr, qr, max_relative_positions=512, position_buckets=256, implementation="pallas_tpu"
        ),
    ),
}


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_a_scheme_training_program_holds_the_three_kernels(scheme):
    table_shapes, f = SCHEMES[scheme]
    q = jax.ShapeDtypeStruct((1, 4096, 8, 128), jnp.bfloat16)
    tables = [jax.ShapeDtypeStruct(shape, jnp.float32) for shape in table_shapes]

    def loss(q, k, v, *tables):
        return jnp.sum(f(q, k, v, *tables).astype(jnp.float32))

    with jax.enable_x64(False), jaxattn.cross_platform_lowering():
        program = jax.jit(jax.grad(loss, argnums=tuple(range(3 + len(tables))))).trace(q, q, q, *tables)
        text = program.lower(lowering_platforms=("tpu",)).as_text()
    kernels = re.findall(r'kernel_name = "(\w+)"', text)
    assert sorted(kernels) == ["jaxattn_flex_tpu_dkv", "jaxattn_flex_tpu_dq", "jaxattn_flex_tpu_forward"]
    assert "stablehlo.while" not in text
    assert not re.search(r"4096x4096", text)


def test_what_keeps_the_xla_backward():
    q = jnp.zeros((1, 64, 4, 8))
    bias = of_rows(jnp.zeros((4, 9)), -4, 4)  # a position bias of j - i (T5's, ALiBi's kind)
    assert flex_tpu_vjp.backward_refusal(AttentionCall(is_causal=True), q, False) is None
    assert flex_tpu_vjp.backward_refusal(AttentionCall(position_bias=bias), q, False) is None
    tables = AttentionCall(key_table=jnp.zeros((9, 4, 8)), max_distance=4)
    assert flex_tpu_vjp.backward_refusal(tables, q, False) is None
    # the dq kernel's VMEM with tables: DeBERTa-v3's at 8192, head dim 64, with two copies of the keys (estimated
    # 17.38 MiB; v5e's compile took 17.41 MiB of its 16) takes one (13.4 MiB, compiled for v5e); at 16k one
    # copy is 17.4 MiB: the keys streamed a tile at a time (0), 9.4 MiB
    deberta = tables_tpu.TableLanes(-512, 511, 128, 128, True, True, False)
    assert deberta.E == 1920
    assert round(tables_tpu.dq_vmem(deberta, 8192, 64, 64, jnp.bfloat16, 128) / 2**20, 2) == 17.38
    assert round(tables_tpu.dq_vmem(deberta, 16384, 64, 64, jnp.bfloat16, 128, 0) / 2**20, 2) == 9.44
    buffers = [tables_tpu.key_buffers(deberta, T, 64, 64, jnp.bfloat16, 128) for T in (4096, 8192, 16384)]
    assert buffers == [2, 1, 0]
    for T in (8192, 16384):
        assert tables_tpu.backward_refusal(deberta, T, 64, 64, jnp.bfloat16, 128) is None
    # the XLA backward where the tables' lanes alone overrun VMEM: Shaw's widest band (2048 offsets) with key and
    # value tables at head dim 256
    widest = tables_tpu.TableLanes(-1024, 1023, 128, 128, True, False, True)
    assert tables_tpu.backward_refusal(widest, 128, 256, 256, jnp.bfloat16, 128).startswith("position tables (")
    window = TableBias(jnp.zeros((15 * 15, 4)), WindowIndex(8, 8, False), 64)  # Swin's 8 x 8 windows
    assert flex_tpu_vjp.backward_refusal(AttentionCall(position_bias=window), q, False).startswith(
        "position_bias (a window's bias"
    )
    assert "closing over arrays" in flex_tpu_vjp.backward_refusal(AttentionCall(), q, True)
    # one head's query rows past MAX_ROWS_BYTES are streamed (16k at head dim 128 in float32); the [1,T] rows of
    # lse, delta and positions bound T at 32k
    mid = jax.ShapeDtypeStruct((1, 2**14, 32, 128), jnp.float32)
    assert flex_tpu_vjp.streamed(2**14, 128, 128, jnp.float32)
    assert flex_tpu_vjp.backward_refusal(AttentionCall(), mid, False) is None
    long = jax.ShapeDtypeStruct((1, 2**15 + 1, 8, 128), jnp.bfloat16)
    assert flex_tpu_vjp.backward_refusal(AttentionCall(), long, False).startswith("query (T=32769")
