"""The accelerator kernels behind implementation= (issue 26) beyond the option grid (tests/test_contract.py runs
that grid on both Pallas kernels in the interpreter, and holds them to their refusal lists): refusals outside
the interpreter, the cuDNN argument mapping, and TPU splash attention and our flex TPU kernel in Pallas'
interpreter where the grid does not reach (a decode step, vmap, the flex kernel in bf16), against the dense
engine.

Splash computes in float32 (float32 accumulation, float32 softmax), so float32 inputs meet docs/design.md,
"Tolerances"'s float32 bar against the dense engine at precision="highest": forward <= 1e-6, gradients <= 1e-5 normwise.
Pallas kernels trace with 64-bit ints off (JAX's default; the suite turns x64 on), hence x64_off.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from jaxattn._core.call import AttentionCall
from jaxattn._kernels import cudnn, flex_tpu, splash_tpu
from tests.helpers import normwise

B, T, S, N, K, H, Hv = 2, 37, 53, 6, 3, 13, 11


@pytest.fixture
def x64_off():
    with jax.enable_x64(False):
        yield


def qkv(dtype=jnp.float32, T=T, S=S, seed=0):
    rng = np.random.default_rng(seed)
    shapes = ((B, T, N, H), (B, S, K, H), (B, S, K, Hv))
    return [jnp.asarray(rng.standard_normal(shape), dtype) for shape in shapes]


# --- refusals ---------------------------------------------------------------------------------------------------


def test_unknown_implementation_is_refused_by_name():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="^implementation: .*'pallas_tpu'.*got 'flash'"):
        jaxattn.dot_product_attention(q, k, v, implementation="flash")


@pytest.mark.parametrize("implementation", [None, "dense", "blockwise", "cudnn"])
def test_interpret_only_with_a_pallas_kernel(implementation):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="^interpret: "):
        jaxattn.dot_product_attention(q, k, v, implementation=implementation, interpret=True)


SLOPES = jnp.asarray(np.linspace(0.0, 1.0, N), jnp.float32)


@pytest.mark.parametrize(
    "implementation, keywords, option",
    [
        ("pallas_tpu", dict(mask=np.ones((T, S), bool)), "mask"),
        ("pallas_tpu", dict(bias=np.zeros((T, S), np.float32)), "bias"),
        ("pallas_tpu", dict(return_weights=True), "return_weights"),
        # a score_mod closing over an array: the TPU flex kernel cannot index it by head on a TPU
        ("pallas_tpu", dict(score_mod=lambda x, b, n, t, s: x + SLOPES[n]), "score_mod"),
        ("cudnn", dict(), "query (dtype"),  # float32 inputs
        ("cudnn", dict(logit_softcap=5.0), "logit_softcap"),
    ],
)
def test_an_explicit_kernel_refuses_what_it_cannot_express(x64_off, implementation, keywords, option):
    q, k, v = qkv(jnp.bfloat16 if "dtype" not in option else jnp.float32)
    with pytest.raises(ValueError, match=rf"^{re.escape(option)}.*implementation='{implementation}'"):
        jaxattn.flex_attention(q, k, v, implementation=implementation, **keywords)


@pytest.mark.parametrize(
    "keywords",
    [dict(is_causal=True), dict(score_mod=lambda x, b, n, t, s: x - 0.1 * (t - s))],
    ids=["splash", "flex kernel"],
)
def test_float16_is_refused_on_a_tpu_and_none_takes_xla_there(x64_off, keywords):
    # Mosaic compiles no float16 vector load (v5e and v6e: .ci/compile_targets.py), so both TPU kernels refuse
    # float16 by name and implementation=None lowered for a TPU holds no kernel; the interpreter has no such limit
    q, k, v = qkv(jnp.float16)
    with pytest.raises(ValueError, match=r"^query \(dtype float16.*implementation='pallas_tpu'"):
        jaxattn.flex_attention(q, k, v, implementation="pallas_tpu", **keywords)
    with jaxattn.cross_platform_lowering():
        text = (
            jax.jit(lambda q, k, v: jaxattn.flex_attention(q, k, v, **keywords))
            .trace(q, k, v)
            .lower(lowering_platforms=("tpu",))
            .as_text()
        )
    assert "tpu_custom_call" not in text
    bf16 = jax.jit(lambda q, k, v: jaxattn.flex_attention(q, k, v, **keywords))
    with jaxattn.cross_platform_lowering():
        text = bf16.trace(*(x.astype(jnp.bfloat16) for x in (q, k, v))).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text  # the same call in bfloat16 takes the kernel


def test_shaw_tables_go_to_the_flex_kernel_not_splash(x64_off):
    """Splash has no tables: "pallas_tpu" hands them to our flex TPU kernel (tests/test_kernel_shaw.py), which
    refuses positions of the call's own by name."""
    q, k, v = qkv()
    table = np.zeros((9, H), np.float32)
    call = AttentionCall(key_table=table, max_distance=4)
    assert splash_tpu.unsupported(call, q, k, v, True) is not None
    assert flex_tpu.wanted(call) and flex_tpu.unsupported(call, q, k, v, True) is None
    with pytest.raises(ValueError, match="^key_positions.*'pallas_tpu'"):
        jaxattn.shaw_relative_attention(
            q, k, v, table, max_distance=4, key_positions=np.arange(S), implementation="pallas_tpu", interpret=True
        )


def test_x64_keeps_implementation_none_on_the_xla_engines():
    # the suite runs with x64 on: the platform switch is never built then, whatever the host
    q, k, v = qkv()
    with jaxattn.cross_platform_lowering():
        text = (
            jax.jit(lambda q, k, v: jaxattn.dot_product_attention(q, k, v, is_causal=True))
            .trace(q, k, v)
            .lower(lowering_platforms=("tpu",))
            .as_text()
        )
    assert "tpu_custom_call" not in text


# --- cuDNN: the argument mapping, with jax.nn's XLA path standing in for cuDNN (no cuDNN on this machine) -----


@pytest.mark.parametrize(
    "keywords",
    [
        pytest.param(dict(window=(4, 2)), marks=pytest.mark.slow),
        dict(is_causal=True, window=(6, None), key_value_seq_lengths=[0, 23]),
    ],
    ids=["window", "causal-window-lengths"],
)
def test_cudnn_maps_our_keywords_onto_jax_nn(monkeypatch, keywords):
    real = jax.nn.dot_product_attention
    monkeypatch.setattr(
        jax.nn, "dot_product_attention", lambda *a, implementation, **kw: real(*a, implementation="xla", **kw)
    )
    q, k, _ = qkv(T=S)  # T == S: jax.nn's top-left alignment is ours there
    v = qkv(T=S, seed=2)[1]  # [B,S,K,H]: cuDNN (and jax.nn) need Hv == H
    ours = jaxattn.dot_product_attention(q, k, v, implementation="dense", precision="highest", **keywords)
    mapped = cudnn.attention(AttentionCall(**keywords), q, k, v)
    assert normwise(mapped, ours) <= 1e-6


# --- splash attention in the interpreter ---------------------------------------------------------------------


def check_splash(keywords, *, dtype=jnp.float32, T=T, S=S, sinks=False, tol=(1e-6, 1e-5)):
    """Forward and gradients (q, k, v and sinks) of the splash kernel against the dense engine."""
    q, k, v = qkv(dtype, T=T, S=S)
    w = qkv(jnp.float32, T=T, S=S, seed=1)[0][..., :Hv]
    args = (q, k, v) + ((jnp.asarray(np.linspace(-1.0, 1.0, N), jnp.float32),) if sinks else ())

    def run(implementation, **extra):
        def f(q, k, v, *sinks):
            out = jaxattn.dot_product_attention(
                q, k, v, implementation=implementation, sinks=sinks[0] if sinks else None, **keywords, **extra
            )
            return out, jnp.sum(out.astype(jnp.float32) * w)

        return jax.jit(lambda *a: (f(*a)[0], jax.grad(lambda *a: f(*a)[1], argnums=range(len(a)))(*a)))(*args)

    with jax.enable_x64(False):
        got, g_got = run("pallas_tpu", interpret=True)
        up = [a.astype(jnp.float32) for a in args]
        args = tuple(up)
        expected, g_expected = run("dense", precision="highest")
    errors = [normwise(got, expected)] + [normwise(a, b) for a, b in zip(g_got, g_expected, strict=True)]
    assert all(np.isfinite(errors)), errors
    assert errors[0] <= tol[0] and max(errors[1:]) <= tol[1], errors
    return got, errors


@pytest.mark.slow
def test_splash_one_query_row_against_a_cache():
    # a decode step: T = 1 at explicit positions with lengths and a window (one empty row: position 2 with
    # lengths 0), keys at their defaults
    got, _ = check_splash(
        dict(
            is_causal=True,
            query_positions=np.array([[2], [40]]),
            key_value_seq_lengths=np.array([0, 47]),
            window=(9, 0),
        ),
        T=1,
    )
    assert not np.asarray(got[0]).any()


@pytest.mark.parametrize("T_", [1, T], ids=["decode step", "prefill"])
def test_a_key_mask_reaches_the_tpu_kernels_as_segment_ids(x64_off, T_):
    """A decoder's padding mask over its keys ([B,1,1,S], as jaxattn.models' decode step passes it) is segment ids
    for pallas_tpu, as for pallas_gpu (registry.Implementation.key_mask_as_segments): computed, not refused, equal
    to the dense engine; a row with no allowed key gives zeros."""
    q, k, v = qkv(T=T_)
    rng = np.random.default_rng(5)
    mask = rng.uniform(size=(B, 1, 1, S)) > 0.4
    mask[0] = False  # every key of one example padding
    got = jaxattn.dot_product_attention(q, k, v, mask=mask, implementation="pallas_tpu", interpret=True)
    want = jaxattn.dot_product_attention(q, k, v, mask=mask, implementation="dense", precision="highest")
    assert normwise(got, want) <= 1e-6 and not np.asarray(got[0]).any()


def test_splash_reuses_its_processed_mask_and_never_another_rules(x64_off):
    """Splash caches its processed mask by the mask object: a second trace of the same rule hits that cache,
    and another rule of the same shape (not causal) gets its own entry and its own answer."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as info

    q, k, v = qkv(T=S)

    def traced(**keywords):  # a new function each time: traced again, as another layer or call would be
        return jax.jit(
            lambda q: jaxattn.dot_product_attention(q, k, v, implementation="pallas_tpu", interpret=True, **keywords)
        )(q)

    traced(is_causal=True)
    first = info._process_mask.cache_info()
    causal = traced(is_causal=True)
    second = info._process_mask.cache_info()
    assert second.hits > first.hits and second.misses == first.misses
    full = traced()
    assert info._process_mask.cache_info().misses > second.misses
    for got, keywords in ((causal, dict(is_causal=True)), (full, {})):
        expected = jaxattn.dot_product_attention(q, k, v, implementation="dense", precision="highest", **keywords)
        assert normwise(got, expected) <= 1e-6


def test_float32_sinks_beside_bfloat16_inputs_keep_a_float32_gradient_on_splash(x64_off):
    """Splash returns the sinks' gradient in the inputs' dtype; ours stays float32 (within the bf16 envelope of
    the float32 dense engine's), and implementation=None's forward+backward lowers for a TPU (its branches
    agree on the dtype)."""
    q, k, v = qkv(jnp.bfloat16)
    sinks = jnp.asarray(np.linspace(-1.0, 1.0, N), jnp.float32)

    def loss(sinks, q, k, v, implementation, **extra):
        out = jaxattn.dot_product_attention(
            q, k, v, is_causal=True, sinks=sinks, implementation=implementation, **extra
        )
        return jnp.sum(out.astype(jnp.float32) ** 2)

    got = jax.grad(loss)(sinks, q, k, v, "pallas_tpu", interpret=True)
    up = [x.astype(jnp.float32) for x in (q, k, v)]
    expected = jax.grad(loss)(sinks, *up, "dense", precision="highest")
    assert got.dtype == jnp.float32 and normwise(got, expected) <= 8e-3
    with jaxattn.cross_platform_lowering():
        grad = jax.jit(jax.grad(loss), static_argnums=4)
        text = grad.trace(sinks, q, k, v, None).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text


@pytest.mark.slow
def test_splash_under_vmap():
    q, k, v = qkv()
    with jax.enable_x64(False):
        f = jax.vmap(lambda q, k, v: jaxattn.dot_product_attention(q, k, v, is_causal=True, precision="highest"))
        g = jax.vmap(
            lambda q, k, v: jaxattn.dot_product_attention(
                q, k, v, is_causal=True, implementation="pallas_tpu", interpret=True
            )
        )
        assert normwise(g(q, k, v), f(q, k, v)) <= 1e-6


# --- our Pallas TPU kernel (flex_tpu: score_mod, mask_mod, BlockMask) in the interpreter -----------------------


def alibi(slope):
    return lambda x, b, n, t, s: x - slope[n] * jnp.abs(t - s).astype(x.dtype)


def band(b, n, t, s):
    return (t - s) % 5 != 3


def check_flex_tpu(keywords, *, dtype=jnp.float32, tol=1e-6, T=T, S=S):
    """flex_attention(implementation="pallas_tpu", interpret=True) with an ALiBi score_mod over slopes and
    sinks against the dense engine: outputs and finite lse (forward: the kernel's gradients are the blockwise
    engine's backward, which tests/test_contract.py compares)."""
    q, k, v = qkv(dtype, T=T, S=S)
    slope = jnp.asarray(np.linspace(0.1, 0.9, N), jnp.float32)
    sinks = jnp.asarray(np.linspace(-1.0, 1.0, N), jnp.float32)

    def run(implementation, q, k, v, **extra):
        f = lambda q, k, v: jaxattn.flex_attention(  # noqa: E731
            q, k, v, alibi(slope), implementation=implementation, sinks=sinks, return_lse=True, **keywords, **extra
        )
        return jax.jit(f)(q, k, v)

    with jax.enable_x64(False):
        out, lse = run("pallas_tpu", q, k, v, interpret=True)
        out_e, lse_e = run("dense", *(x.astype(jnp.float32) for x in (q, k, v)), precision="highest")
    finite = jnp.isfinite(lse_e)
    assert bool(jnp.all(jnp.isfinite(lse) == finite))
    assert normwise(out, out_e) <= tol and normwise(jnp.where(finite, lse, 0), jnp.where(finite, lse_e, 0)) <= tol
    return out


@pytest.mark.slow
def test_tpu_flex_kernel_bfloat16_envelope():
    # measured: normwise error of the bf16 kernel against the float32 dense engine on float32 copies of the same
    # inputs, output 1.8e-3, lse 4.7e-8 (float32 logits and softmax, bf16 p before p @ v; the dense engine in
    # bf16: 2.4e-3); the envelope is twice the output figure
    check_flex_tpu(dict(is_causal=True, mask_mod=band), dtype=jnp.bfloat16, tol=3.6e-3)


# --- the layers and the models pass implementation= to every attention call ---------------------------------


def test_a_layer_passes_implementation_on(x64_off):
    from jaxattn.linen import MultiHeadAttention

    layer = MultiHeadAttention(num_heads=3, head_dim=5, implementation="pallas_tpu", interpret=True)
    x = jnp.ones((2, 7, 11))
    params = jax.eval_shape(MultiHeadAttention(num_heads=3, head_dim=5).init, jax.random.key(0), x)
    with pytest.raises(ValueError, match="^mask.*implementation='pallas_tpu'"):
        jax.eval_shape(lambda p: layer.apply(p, x, mask=np.ones((7, 7), bool)), params)  # traced, not run


def test_a_model_config_passes_implementation_on():
    import dataclasses

    from jaxattn.models.llama import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=17,
        hidden_size=12,
        intermediate_size=10,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=6,
        rope_frequencies=(1.0, 0.1, 0.01),
    )
    ids = jnp.zeros((1, 5), jnp.int32)
    params = jax.eval_shape(LlamaForCausalLM(config=config).init, jax.random.key(0), ids)
    model = LlamaForCausalLM(config=dataclasses.replace(config, implementation="flash"))
    with pytest.raises(ValueError, match="^implementation: .*got 'flash'"):
        jax.eval_shape(lambda p: model.apply(p, ids), params)


# --- implementation=None on CUDA, by GPU generation (jaxattn._api.CUDA_KERNELS_BY_GENERATION) -----------------


def cuda_qkv(dtype):
    """T == S and H == Hv == 16: shapes cuDNN takes."""
    rng = np.random.default_rng(3)
    return [jnp.asarray(rng.standard_normal((B, S, n, 16)), dtype) for n in (N, K, K)]


def _cuda_path(monkeypatch, capability, dtype=jnp.bfloat16, **keywords):
    """(cuDNN reached, our GPU kernel traced) for implementation=None traced for `capability`: cuDNN is
    stood in for by jax.nn's XLA path (no cuDNN here), recording that it was reached."""
    reached = []
    real = jax.nn.dot_product_attention

    def stand_in(*args, implementation, **kw):
        reached.append(implementation)
        return real(*args, implementation="xla", **kw)

    monkeypatch.setattr(cudnn, "installed", lambda: True)
    monkeypatch.setattr(jax.nn, "dot_product_attention", stand_in)
    q, k, v = cuda_qkv(dtype)
    with jax.enable_x64(False), jaxattn.cross_platform_lowering(cuda_compute_capability=capability):
        text = str(jax.make_jaxpr(lambda q, k, v: jaxattn.dot_product_attention(q, k, v, **keywords))(q, k, v))
    return ("cudnn" if reached else None), "jaxattn_flash_forward" in text


@pytest.mark.parametrize("capability", ["9.0", "sm_100", (9, 0)])
def test_hopper_and_later_take_cudnn_for_what_it_computes_exactly(monkeypatch, capability):
    assert _cuda_path(monkeypatch, capability, is_causal=True) == ("cudnn", False)
    # what cuDNN cannot express goes to our kernel: float32, sinks, T != S with causal (its top-left alignment)
    assert _cuda_path(monkeypatch, capability, jnp.float32, is_causal=True) == (None, True)
    assert _cuda_path(monkeypatch, capability, is_causal=True, sinks=jnp.zeros(N, jnp.float32)) == (None, True)


@pytest.mark.parametrize("capability", ["8.0", "8.9", None])
def test_ampere_ada_and_an_unknown_generation_take_our_kernel(monkeypatch, capability):
    assert _cuda_path(monkeypatch, capability, is_causal=True) == (None, True)


def test_without_cudnn_hopper_takes_our_kernel_and_an_explicit_cudnn_says_why():
    # this machine's jaxlib has no cuDNN: None still lowers, with our kernel
    q, k, v = cuda_qkv(jnp.bfloat16)
    with jax.enable_x64(False), jaxattn.cross_platform_lowering(cuda_compute_capability="9.0"):
        text = str(jax.make_jaxpr(lambda q: jaxattn.dot_product_attention(q, k, v, is_causal=True))(q))
    assert "jaxattn_flash_forward" in text
    with jax.enable_x64(False), pytest.raises(ValueError, match="cuDNN is not installed"):
        jaxattn.dot_product_attention(q, k, v, implementation="cudnn")


@pytest.mark.parametrize("bad", ["hopper", "9", 9, (9,)])
def test_a_compute_capability_is_checked_by_name(bad):
    with pytest.raises(ValueError, match="^cuda_compute_capability: "):
        with jaxattn.cross_platform_lowering(cuda_compute_capability=bad):
            pass


def _chunked_splash_for_tpu():
    """Splash with chunk_size lowered for a TPU from this CPU host (its chunk rule's integer `//` lowers
    through `sign`, whose Mosaic rule asks for the TPU generation): the lowered text."""
    q, k, v = (jax.ShapeDtypeStruct(x.shape, jnp.bfloat16) for x in qkv())
    attend = lambda q, k, v: jaxattn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=True, chunk_size=16, implementation="pallas_tpu"
    )
    return jax.jit(attend).trace(q, k, v).lower(lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("generation", ["v5e", "v6e"])
def test_a_cpu_host_lowers_chunked_splash_for_the_tpu_generation_it_is_told(x64_off, generation):
    # issue 51 §6: without it Mosaic asks JAX's default device, this CPU
    with pytest.raises(ValueError, match="Unsupported TPU device kind: cpu"), jaxattn.cross_platform_lowering():
        _chunked_splash_for_tpu()
    with jaxattn.cross_platform_lowering(tpu_generation=generation):
        text = _chunked_splash_for_tpu()
    assert "tpu_custom_call" in text
    assert jax.sharding.get_abstract_mesh().abstract_device is None  # the block's mesh is left with it


def test_tpu_generation_names_the_device_of_the_mesh_in_context():
    def device_inside(mesh, tpu_generation):
        with jax.sharding.use_abstract_mesh(mesh), jaxattn.cross_platform_lowering(tpu_generation=tpu_generation):
            inside = jax.sharding.get_abstract_mesh()
        assert inside.axis_names == mesh.axis_names and inside.axis_sizes == mesh.axis_sizes
        return inside.abstract_device

    v6e = jax.sharding.AbstractDevice(device_kind="TPU v6 lite", num_cores=1, platform="tpu")
    no_mesh, cpus = jax.sharding.AbstractMesh((), ()), jax.sharding.AbstractMesh((3,), ("x",))
    assert device_inside(no_mesh, "v6e") == v6e
    assert device_inside(cpus.update(abstract_device=v6e), "v6e") == v6e
    v5p = jax.sharding.AbstractDevice(device_kind="TPU v5", num_cores=2, platform="tpu")
    assert device_inside(cpus, "v5p") == v5p
    # a TPU device (a topology's, jax.devices("tpu")[0]): its own kind and cores
    device = type("TpuDevice", (), dict(platform="tpu", device_kind="TPU7x", num_cores=1))()
    assert device_inside(no_mesh, device) == jax.sharding.AbstractDevice("TPU7x", 1, "tpu")
    # a mesh over another TPU contradicts it
    with pytest.raises(ValueError, match="^tpu_generation: expected the mesh in context's TPU, 'TPU v6 lite'"):
        device_inside(cpus.update(abstract_device=v6e), "v5e")


@pytest.mark.parametrize("bad", ["v4", "TPU v5 lite", "V5E", 5, jax.devices("cpu")[0]])
def test_a_tpu_generation_is_checked_by_name(bad):
    with pytest.raises(ValueError, match=r"^tpu_generation: expected one of \['v5e', 'v5p', 'v6e', '7x'\]"):
        with jaxattn.cross_platform_lowering(tpu_generation=bad):
            pass
