"""jaxattn.latent_attention (multi-head latent attention): the absorbed form equals the expanded form and
torchref's plain expanded formula in float64 (outputs and gradients), decoding from the compressed cache equals
the full causal pass, the cache holds C + R numbers per token (its shapes, and XLA's compiled memory analysis
against the expanded cache's N x (H + Hv)), keywords apply, bad weights are named.

Sizes: B=2, T=11, E=23, N=3 heads, Cq=13, C=17 latent, R=4 rope, Hn=5 (H = 9), Hv=7."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxattn
from crosscheck.catalogue import run_case
from helpers import arrays, assert_float64, normwise

B, T, E, N, Cq, C, R, Hn, Hv = 2, 11, 23, 3, 13, 17, 4, 5, 7


def make_params(seed=0, **kw):
    """Random float64 params in latent_attention's tree (shapes from init_latent_attention, traced, not run)."""
    shapes = jax.eval_shape(
        lambda: jaxattn.init_latent_attention(
            jax.random.PRNGKey(seed),
            E,
            N,
            latent_dim=C,
            rope_dim=R,
            nope_head_dim=Hn,
            value_head_dim=Hv,
            query_latent_dim=Cq,
            use_bias=True,
            dtype=jnp.float64,
            **kw,
        )
    )
    leaves, tree = jax.tree.flatten(shapes)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(tree, [jnp.asarray(rng.normal(size=x.shape) * x.shape[0] ** -0.5) for x in leaves])


def test_absorbed_equals_expanded_with_gradients():
    params, (x,) = make_params(), arrays(2, (B, T, E))

    def run(form):
        f = lambda p, x: jnp.sum(jaxattn.latent_attention(p, x, form=form, is_causal=True) ** 2)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x)

    (loss_a, (gp_a, gx_a)), (loss_e, (gp_e, gx_e)) = run("absorbed"), run("expanded")
    assert_float64(loss_a, gp_a, gx_a)
    assert normwise(loss_a, loss_e) <= 1e-12 and normwise(gx_a, gx_e) <= 1e-12
    for path, got in jax.tree_util.tree_leaves_with_path(gp_a):
        assert normwise(got, _at(gp_e, path)) <= 1e-12, jax.tree_util.keystr(path)


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


@pytest.mark.slow
def test_against_torchref_float64():
    report = run_case("mla_torchref", dtype="float64", transform="jit")
    assert report.passed, str(report)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_decode_from_the_compressed_cache(form):
    params, (x,) = make_params(3), arrays(4, (B, T, E))
    full = jaxattn.latent_attention(params, x, is_causal=True)
    cache = jaxattn.init_latent_cache((B,), 16, C, R, jnp.float64)
    assert [c.shape for c in cache[:2]] == [(B, 16, C), (B, 16, R)]  # C + R numbers per cached token
    step = jax.jit(lambda p, x, c: jaxattn.latent_attention(p, x, cache=c, form=form))
    y, cache = step(params, x[:, :7], cache)
    ys = [y]
    for t in range(7, T):
        y, cache = step(params, x[:, t : t + 1], cache)
        ys.append(y)
    assert normwise(jnp.concatenate(ys, axis=1), full) <= 1e-12
    assert cache[2].tolist() == [T, T]


def test_keywords_apply_to_both_forms():
    params, (x,) = make_params(5), arrays(6, (B, T, E))
    kw = {"is_causal": True, "window": (3, 0), "key_value_seq_lengths": jnp.array([T, 6])}

    @jax.jit  # one compiled program for the three calls
    def three(params, x):
        return (
            jaxattn.latent_attention(params, x, **kw),
            jaxattn.latent_attention(params, x, form="expanded", **kw),
            jaxattn.latent_attention(params, x, is_causal=True),
        )

    absorbed, expanded, plain = three(params, x)
    assert_float64(absorbed, expanded)
    assert normwise(absorbed, expanded) <= 1e-12
    assert normwise(absorbed, plain) > 1e-3  # the keywords did something


@pytest.mark.slow
def test_decode_cache_and_step_memory():
    """One decode token over L = 4096 cached tokens, float32. The compressed cache is (C + R) / (N (H + Hv))
    of the expanded one by its shapes, and XLA agrees on the step's argument bytes; the absorbed step never
    builds the expanded keys (its scratch is below one expanded key cache), while the expanded form from the
    same compressed cache must (its scratch is above)."""
    L, big = 4096, dict(E=64, N=8, C=32, R=16, Hn=32, Hv=32)
    params = jaxattn.init_latent_attention(
        jax.random.PRNGKey(0),
        big["E"],
        big["N"],
        latent_dim=big["C"],
        rope_dim=big["R"],
        nope_head_dim=big["Hn"],
        value_head_dim=big["Hv"],
    )
    shapes = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
    cache = jaxattn.init_latent_cache((1,), L, big["C"], big["R"])
    per_token = sum(int(np.prod(c.shape[2:])) for c in cache[:2])
    expanded_per_token = big["N"] * (big["Hn"] + big["R"] + big["Hv"])  # keys [N,H] + values [N,Hv]
    assert per_token == big["C"] + big["R"]

    def step(form):
        fn = lambda p, x, c: jaxattn.latent_attention(p, x, cache=c, form=form)
        return (
            jax.jit(fn)
            .lower(
                shapes,
                jax.ShapeDtypeStruct((1, 1, big["E"]), jnp.float32),
                jax.tree.map(lambda c: jax.ShapeDtypeStruct(c.shape, c.dtype), cache),
            )
            .compile()
        )

    absorbed, expanded = step("absorbed").memory_analysis(), step("expanded").memory_analysis()
    param_bytes = sum(p.size * 4 for p in jax.tree.leaves(params))
    assert absorbed.argument_size_in_bytes - param_bytes <= L * per_token * 4 + 4096
    expanded_cache_bytes = L * expanded_per_token * 4
    assert absorbed.temp_size_in_bytes < L * big["N"] * (big["Hn"] + big["R"]) * 4 <= expanded.temp_size_in_bytes
    assert expanded_cache_bytes >= 10 * L * per_token * 4  # (C + R) = 48 vs 2 N H-ish = 640 numbers per token


@pytest.mark.parametrize(
    "bad, match",
    [
        ("value_up", r"params\['value_up'\]\['kernel'\]: expected shape \[17,3,7\].*got shape \[16,3,7\]"),
        ("latent", r"params\['latent'\]\['kernel'\]: expected shape \[23,17\].*got shape \[23,16\]"),
        ("query_up", r"params\['query_up'\]\['kernel'\]: expected shape \[\.\.,3,9\].*got shape \[13,3,8\]"),
    ],
)
def test_bad_weights(bad, match):
    params, (x,) = make_params(), arrays(7, (B, T, E))
    kernel = params[bad]["kernel"]
    params[bad]["kernel"] = kernel[:-1] if bad == "value_up" else kernel[..., :-1]
    with pytest.raises(ValueError, match=match):
        jaxattn.latent_attention(params, x)
