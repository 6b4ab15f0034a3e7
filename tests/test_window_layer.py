"""Swin's window self-attention layer (window_self_attention, jaxattn.linen / jaxattn.nnx WindowAttention) against
transformers' own pieces with the same weights: SwinLayer.cyclic_shift, window_partition, SwinAttention with
SwinLayer.get_attn_mask, window_reverse and the shift back. float64, outputs and gradients (the map, a projection
kernel, the bias table); the Flax shells equal the function on the same tree; bad maps are refused by name.
Sizes: B=2 maps of 6x9 patches, 3x3 windows (nW=6), E=10 channels, N=2 heads of H=5.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxattn.linen
import jaxattn.nnx
from helpers import assert_float64, normwise
from jaxattn import init_window_attention, window_self_attention

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import SwinConfig  # noqa: E402
from transformers.models.swin.modeling_swin import SwinLayer, window_partition, window_reverse  # noqa: E402

B, HEIGHT, WIDTH, E, N, WS = 2, 6, 9, 10, 2, 3


def hf_layer(shift, seed=0):
    config = SwinConfig(embed_dim=E, num_heads=[N], window_size=WS)
    config._attn_implementation = "sdpa"  # the eager path softmaxes in float32 by design
    layer = SwinLayer(config, E, (HEIGHT, WIDTH), N, shift_size=shift).double().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.attention.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * p.shape[-1] ** -0.5)
    return layer


def hf_window_attention(layer, x):
    """SwinLayer.forward's attention part (no norms, no MLP, no residual), on x [B, height, width, E]."""
    shifted = layer.cyclic_shift(x)
    windows = window_partition(shifted, WS).view(-1, WS * WS, E)
    mask = layer.get_attn_mask(HEIGHT, WIDTH, dtype=x.dtype, device=x.device)
    out = layer.attention(windows, mask)[0]
    return layer.cyclic_shift(window_reverse(out.view(-1, WS, WS, E), WS, HEIGHT, WIDTH), reverse=True)


def params_from_hf(attention):
    """SwinAttention's state -> our tree: nn.Linear [N*H, E] -> kernel [E,N,H]; o_proj [E, N*H] -> [N,H,E]."""
    state = {k: v.detach().numpy() for k, v in attention.named_parameters()}
    tree = {
        ours: {"kernel": state[f"{hf}.weight"].T.reshape(E, N, E // N), "bias": state[f"{hf}.bias"].reshape(N, -1)}
        for hf, ours in (("q_proj", "query"), ("k_proj", "key"), ("v_proj", "value"))
    }
    tree["out"] = {"kernel": state["o_proj.weight"].T.reshape(N, E // N, E), "bias": state["o_proj.bias"]}
    tree["window"] = {"table": state["relative_position_bias.relative_position_bias_table"]}
    return jax.tree.map(jnp.asarray, tree)


@pytest.mark.parametrize("shift", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_function_equals_swin_layer_attention(shift):
    layer = hf_layer(shift)
    x = np.random.default_rng(1).normal(size=(B, HEIGHT, WIDTH, E))
    cotangent = np.random.default_rng(2).normal(size=x.shape)
    x_torch = torch.tensor(x, requires_grad=True)
    want = hf_window_attention(layer, x_torch)
    (want * torch.tensor(cotangent)).sum().backward()
    params = params_from_hf(layer.attention)

    def loss(params, x):
        return jnp.sum(window_self_attention(params, x, WS, shift=shift) * cotangent)

    got = window_self_attention(params, x, WS, shift=shift)
    g_params, g_x = jax.grad(loss, argnums=(0, 1))(params, jnp.asarray(x))
    assert_float64(got, g_x)
    assert normwise(got, want) <= 1e-12
    assert normwise(g_x, x_torch.grad) <= 1e-12
    table = layer.attention.relative_position_bias.relative_position_bias_table.grad
    assert normwise(g_params["window"]["table"], table) <= 1e-12
    q_kernel = layer.attention.q_proj.weight.grad.numpy().T.reshape(E, N, E // N)
    assert normwise(g_params["query"]["kernel"], q_kernel) <= 1e-12


@pytest.mark.slow  # the shells repeat the function's checks above; ~2.5 s
def test_linen_and_nnx_shells_equal_the_function():
    x = jnp.asarray(np.random.default_rng(3).normal(size=(B, HEIGHT, WIDTH, E)))
    params = init_window_attention(jax.random.key(0), E, N, WS)
    params = jax.tree.map(lambda a: a + 0.1, params)  # the table and biases off zero
    params = jax.tree.map(lambda a: a.astype(jnp.float64), params)
    want = window_self_attention(params, x, WS, shift=1)
    linen = jaxattn.linen.WindowAttention(num_heads=N, window_size=WS, shift=1, param_dtype=jnp.float64)
    built = linen.init(jax.random.key(1), x)["params"]
    assert jax.tree.map(jnp.shape, built) == jax.tree.map(jnp.shape, params)
    assert normwise(linen.apply({"params": params}, x), want) <= 1e-15
    layer = jaxattn.nnx.WindowAttention(E, N, WS, shift=1, param_dtype=jnp.float64, rngs=nnx.Rngs(0))
    assert jax.tree.map(jnp.shape, layer.params()) == jax.tree.map(jnp.shape, params)
    for group, leaves in params.items():
        for leaf, value in leaves.items():
            getattr(getattr(layer, group), leaf)[...] = value
    assert normwise(layer(x), want) <= 1e-15


def test_bad_maps_are_refused_by_name():
    params = init_window_attention(jax.random.key(0), E, N, WS)
    linen = jaxattn.linen.WindowAttention(num_heads=N, window_size=WS)
    variables = linen.init(jax.random.key(1), jnp.zeros((1, 6, 6, E), jnp.float32))
    layer = jaxattn.nnx.WindowAttention(E, N, WS, rngs=nnx.Rngs(0))
    for call in (
        lambda x: window_self_attention(params, x, WS),
        lambda x: linen.apply(variables, x),
        layer,
    ):
        with pytest.raises(ValueError, match=r"x: expected 10 channels .* got shape \[1,6,6,7\]"):
            call(jnp.zeros((1, 6, 6, 7), jnp.float32))
        with pytest.raises(ValueError, match="x: expected a height and width that tile into 3x3 windows, got 6x8"):
            call(jnp.zeros((1, 6, 8, E), jnp.float32))
    with pytest.raises(ValueError, match=r"window/table: expected \[9,N\] for 2x2 windows"):
        window_self_attention(params, jnp.zeros((1, 6, 6, E), jnp.float32), 2)
    with pytest.raises(ValueError, match="shift: expected a height shift < the window's 3"):
        window_self_attention(params, jnp.zeros((1, 6, 6, E), jnp.float32), WS, shift=3)
