"""The shapes in the public signatures (jaxtyping, in the package's axis letters) hold at run time.

The library only annotates, and never imports jaxtyping (a test extra, not a dependency): its modules keep
their annotations as strings (`from __future__ import annotations`) and import jaxtyping and
jaxattn._core.shapes' aliases under TYPE_CHECKING alone. Here each public attention function, layer `__call__`
and model `__call__` has those strings resolved (typing.get_type_hints with the jaxtyping names and the aliases:
a name it cannot resolve raises, where jaxtyping alone would quietly read it as Any), is wrapped in jaxtyping's
`jaxtyped(typechecker=beartype)` and called on a representative input, so a wrong annotation (a swapped letter,
a missing batch dim, a return that is not what the annotation says) fails.
Every axis has its own size (B=2, T=3, S=5, N=6, K=2, H=7, Hv=11, E=13, R=9), so a letter bound to the
wrong axis shows. The calls run under jax.eval_shape: the checker runs at trace time, on the numpy inputs
the calls close over and on the traced results, and nothing is compiled.
"""

import functools
import inspect
import os
import subprocess
import sys
import typing

import jax
import jaxtyping
import numpy as np
import pytest
from beartype import beartype
from flax import nnx
from jax.sharding import Mesh

import jaxattn
import jaxattn.linen
import jaxattn.nnx
from jaxattn._core import shapes
from jaxattn.models import (
    BertConfig,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    Llama4ForCausalLM,
    Llama4TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

B, T, S, N, K, H, Hv, E = 2, 3, 5, 6, 2, 7, 11, 13
MAX_DISTANCE = 4
R = 2 * MAX_DISTANCE + 1


# What the annotation strings name beyond each module's own globals: jaxtyping's and shapes.py's aliases.
SHAPE_NAMES = {
    **{name: getattr(jaxtyping, name) for name in ("Array", "ArrayLike", "Bool", "Float", "Int")},
    **{name: value for name, value in vars(shapes).items() if name[:1].isupper()},
}


def checked(fn):
    """fn under jaxtyping's run-time check: arguments and return against its annotations, one set of sizes.
    The annotation strings are resolved first (NameError for a name that is neither in fn's module nor in
    SHAPE_NAMES), and the check runs on a wrapper that carries the resolved signature."""
    hints = typing.get_type_hints(fn, localns=SHAPE_NAMES, include_extras=True)
    signature = inspect.signature(fn)
    signature = signature.replace(
        parameters=[p.replace(annotation=hints.get(name, p.empty)) for name, p in signature.parameters.items()],
        return_annotation=hints.get("return", signature.empty),
    )

    @functools.wraps(fn)
    def resolved(*args, **kwargs):
        return fn(*args, **kwargs)

    resolved.__signature__ = signature  # inspect.signature (jaxtyping's) stops here, not at fn's strings
    resolved.__annotations__ = hints
    return jaxtyping.jaxtyped(typechecker=beartype)(resolved)


@pytest.mark.slow  # a fresh interpreter: 3 s
def test_importing_jaxattn_imports_no_jaxtyping():
    """The annotations cost nothing at run time: a fresh interpreter imports every public module of jaxattn
    without jaxtyping, beartype or torch (docs/design.md, "Packages": jaxattn depends on jax, flax and numpy), and every
    module at all where jaxtyping cannot be imported (a user's install: it is only in the test and dev extras)."""
    script = (
        "import sys, jaxattn, jaxattn.linen, jaxattn.nnx, jaxattn.models\n"
        "print(sorted(m for m in ('jaxtyping', 'beartype', 'torch') if m in sys.modules))\n"
        # and every module of the package imports where jaxtyping is not installed (as .ci/check_wheel.py does)
        "import importlib, pkgutil\n"
        "sys.modules['jaxtyping'] = None\n"
        "for m in pkgutil.walk_packages(jaxattn.__path__, 'jaxattn.'):\n"
        "    importlib.import_module(m.name)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def _arrays(*shapes, dtype=np.float32):
    rng = np.random.default_rng(0)
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


q, k, v = _arrays((B, T, N, H), (B, S, K, H), (B, S, K, Hv))
x_q, x_kv = _arrays((B, T, E), (B, S, 17))
causal = np.tril(np.ones((T, S), bool), S - T)
positions = np.arange(T)[None].repeat(B, 0)


def _mha_params(**options):
    return jaxattn.init_multi_head_attention(
        jax.random.key(0), E, N, H, key_features=17, num_kv_heads=K, value_head_dim=Hv, **options
    )


# name -> call(): each a public function called through `checked`, on the sizes above
CALLS = {
    "dot_product_attention": lambda: checked(jaxattn.dot_product_attention)(
        q,
        k,
        v,
        mask=causal,
        query_positions=positions,
        key_value_seq_lengths=np.array([S, 4]),
        sinks=np.zeros(N, np.float32),
        return_weights=True,
    ),
    "dot_product_attention residual": lambda: checked(jaxattn.dot_product_attention)(
        q, k[0], v[0], is_causal=True, return_residual=True
    ),
    "flex_attention": lambda: checked(jaxattn.flex_attention)(
        q, k, v, score_mod=lambda score, b, n, t, s: score - (t - s), return_lse=True
    ),
    "blockwise_attention": lambda: checked(jaxattn.blockwise_attention)(q, k, v, is_causal=True, return_lse=True),
    "ring_attention": lambda: checked(jaxattn.ring_attention)(
        q, k, v, mesh=Mesh(np.array(jax.devices()[:1]), ("seq",)), sequence_axis="seq"
    ),
    "relative_attention": lambda: checked(jaxattn.relative_attention)(q, k, v, *_arrays((T, S, 1, H), (T, S, N, Hv))),
    "shaw_relative_attention": lambda: checked(jaxattn.shaw_relative_attention)(
        q, k, v, *_arrays((R, H), (R, N, Hv)), max_distance=MAX_DISTANCE
    ),
    "relative_position_index": lambda: checked(jaxattn.relative_position_index)(
        T, S, MAX_DISTANCE, query_positions=positions, key_positions=np.arange(S)
    ),
    "clipped_relative_attention": lambda: checked(jaxattn.clipped_relative_attention)(
        q, k, v, *_arrays((R, N, H), (R, Hv)), max_left=5, max_right=3
    ),
    "clipped_relative_index": lambda: checked(jaxattn.clipped_relative_index)(T, S, max_left=5, max_right=3),
    "t5_attention": lambda: checked(jaxattn.t5_attention)(q, k, v, *_arrays((32, N))),
    "t5_relative_bias": lambda: checked(jaxattn.t5_relative_bias)(*_arrays((32, N)), T, S),
    "alibi_attention": lambda: checked(jaxattn.alibi_attention)(q, k, v, jaxattn.alibi_slopes(N)),
    "alibi_bias": lambda: checked(jaxattn.alibi_bias)(checked(jaxattn.alibi_slopes)(N), T, S),
    "apply_rope": lambda: checked(jaxattn.apply_rope)(q, positions, rotary_dim=H - 1),
    "rope_attention": lambda: checked(jaxattn.rope_attention)(q, k, v, rotary_dim=H - 1, is_causal=True),
    "transformer_xl_attention": lambda: checked(jaxattn.transformer_xl_attention)(
        q, k, v, *_arrays((R, N, H)), max_left=5, pos_bias_u=_arrays((N, H))[0]
    ),
    "disentangled_attention": lambda: checked(jaxattn.disentangled_attention)(
        q, k, v, *_arrays((8, N, H), (8, H)), position_buckets=4, max_relative_positions=6
    ),
    "deberta_relative_position": lambda: checked(jaxattn.deberta_relative_position)(
        T, S, position_buckets=4, max_relative_positions=6, query_positions=positions
    ),
    "deberta_log_bucket_position": lambda: checked(jaxattn.deberta_log_bucket_position)(
        np.arange(-9, 9).reshape(3, 6), position_buckets=4, max_relative_positions=6
    ),
    "disentangled_multi_head_attention": lambda: checked(jaxattn.disentangled_multi_head_attention)(
        jaxattn.init_disentangled_multi_head_attention(jax.random.key(0), E, N, H),
        x_q,
        rel_embeddings=_arrays((8, E))[0],
        position_buckets=4,
        max_relative_positions=6,
    ),
    "relative_sinusoids": lambda: checked(jaxattn.relative_sinusoids)(H + 1, max_left=5, max_right=3),
    "position_bias_attention": lambda: checked(jaxattn.position_bias_attention)(
        q, k, v, jaxattn.alibi_position_bias(jaxattn.alibi_slopes(N))
    ),
    "window_attention": lambda: checked(jaxattn.window_attention)(
        q, k[..., :T, :, :], v[..., :T, :, :], *_arrays((6, N)), (1, 2), cls_token=True
    ),
    "window_relative_bias": lambda: checked(jaxattn.window_relative_bias)(*_arrays((5, N)), (1, 3)),
    "window_relative_index": lambda: checked(jaxattn.window_relative_index)((1, 3)),
    "shifted_window_segments and mask": lambda: checked(jaxattn.shifted_window_mask)((4, 6), (2, 3), 1),
    "window_partition and window_merge": lambda: checked(jaxattn.window_merge)(
        checked(jaxattn.window_partition)(*_arrays((B, 4, 6, E)), (2, 3)), (2, 3), (4, 6)
    ),
    "window_self_attention": lambda: checked(jaxattn.window_self_attention)(
        jaxattn.init_window_attention(jax.random.key(0), E, 1, (2, 3)), *_arrays((B, 4, 6, E)), (2, 3), shift=1
    ),
    "multi_head_attention": lambda: checked(jaxattn.multi_head_attention)(
        _mha_params(), x_q, x_kv, add_zero_attn=True, return_weights=True
    ),
    "relative_multi_head_attention": lambda: checked(jaxattn.relative_multi_head_attention)(
        jaxattn.init_relative_multi_head_attention(jax.random.key(0), E, N, H, max_distance=MAX_DISTANCE), x_q
    ),
    "project_qkv and project_out": lambda: checked(jaxattn.project_out)(
        _mha_params(), checked(jaxattn.project_qkv)(_mha_params(), x_q, x_kv)[2][..., :T, :, :].repeat(3, -2)
    ),
    "gated_delta_rule": lambda: checked(jaxattn.gated_delta_rule)(
        *_arrays((B, T, K, H), (B, T, K, H), (B, T, N, Hv), (B, T, N), (B, T, N)), return_state=True
    ),
    "gated_delta_rule_step": lambda: checked(jaxattn.gated_delta_rule_step)(
        *_arrays((B, K, H), (B, K, H), (B, N, Hv), (B, N), (B, N), (B, N, H, Hv))
    ),
    "causal_conv1d": lambda: checked(jaxattn.causal_conv1d)(
        *_arrays((B, T, E), (E, 4), (E,)), state=_arrays((B, 3, E))[0], return_state=True
    ),
    "gated_rms_norm": lambda: checked(jaxattn.gated_rms_norm)(*_arrays((B, T, E), (B, T, E), (E,))),
    "latent_attention": lambda: checked(jaxattn.latent_attention)(
        _latent_params(), x_q, cache=jaxattn.init_latent_cache((B,), 8, 5, 4)
    ),
}


def _latent_params():
    return jaxattn.init_latent_attention(
        jax.random.key(0), E, N, latent_dim=5, rope_dim=4, nope_head_dim=3, value_head_dim=Hv, query_latent_dim=7
    )


@pytest.mark.parametrize("name", CALLS)
def test_public_functions_meet_their_annotations(name):
    jax.eval_shape(CALLS[name])


def test_traced_inputs_meet_the_array_like_annotations():
    # CALLS hand the checker numpy arrays (closed over, so not traced); under jit it sees jax arrays
    out = jax.eval_shape(lambda q, k, v: checked(jaxattn.dot_product_attention)(q, k, v, is_causal=True), q, k, v)
    assert out.shape == (B, T, N, Hv)


def test_the_checker_refuses_what_the_annotations_rule_out():
    # key's head dim 8 against the query's H = 7: the annotation's shared letter H catches it before the body
    with pytest.raises(jaxtyping.TypeCheckError, match="key"):
        jax.eval_shape(lambda: checked(jaxattn.dot_product_attention)(q, k[..., :1], v))
    with pytest.raises(jaxtyping.TypeCheckError, match="mask"):  # Bool, not float
        jax.eval_shape(lambda: checked(jaxattn.dot_product_attention)(q, k, v, mask=causal.astype(np.float32)))


@pytest.mark.parametrize("layers", [jaxattn.linen, jaxattn.nnx], ids=["linen", "nnx"])
def test_layers_call_meets_its_annotations(layers):
    call = checked(layers.MultiHeadAttention.__call__)
    if layers is jaxattn.linen:
        layer = layers.MultiHeadAttention(num_heads=N, head_dim=H, num_kv_heads=K, value_head_dim=Hv)
        variables = jax.eval_shape(layer.init, jax.random.key(0), x_q, x_kv)
        out, weights = jax.eval_shape(
            lambda variables: layer.apply(variables, x_q, x_kv, mask=causal, return_weights=True, method=call),
            variables,
        )
    else:
        layer = layers.MultiHeadAttention(
            E, N, head_dim=H, key_features=17, num_kv_heads=K, value_head_dim=Hv, rngs=nnx.Rngs(0)
        )
        out, weights = jax.eval_shape(lambda: call(layer, x_q, x_kv, mask=causal, return_weights=True))
    assert out.shape == (B, T, E) and weights.shape == (B, N, T, S)


TINY_DECODER = dict(
    vocab_size=19,
    hidden_size=16,
    intermediate_size=10,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
)


# one model per distinct __call__: the shared causal LM (Llama and most families), GPT-2, Llama 4, BERT, T5
@pytest.mark.parametrize("family", ["llama", "gpt2", "llama4_text", "bert", "t5"])
def test_models_call_meets_its_annotations(family):
    ids = np.arange(B * T).reshape(B, T) % 19
    mask = np.ones((B, T), np.int32)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig.from_dict({"model_type": "llama", **TINY_DECODER}))
        args = (ids, mask)
    elif family == "gpt2":
        model = GPT2LMHeadModel(
            GPT2Config.from_dict(
                {"model_type": "gpt2", "vocab_size": 19, "n_embd": 12, "n_layer": 1, "n_head": 4, "n_positions": 8}
            )
        )
        args = (ids, mask)
    elif family == "llama4_text":
        model = Llama4ForCausalLM(
            Llama4TextConfig.from_dict(
                {
                    "model_type": "llama4_text",
                    **TINY_DECODER,
                    "intermediate_size_mlp": 10,
                    "num_local_experts": 3,
                    "attention_chunk_size": 4,
                }
            )
        )
        args = (ids, mask)
    elif family == "bert":
        model = BertModel(
            BertConfig(
                vocab_size=19,
                hidden_size=12,
                num_hidden_layers=1,
                num_attention_heads=4,
                intermediate_size=10,
                max_position_embeddings=8,
            )
        )
        args = (ids, mask)
    else:
        model = T5ForConditionalGeneration(
            T5Config.from_dict(
                {
                    "model_type": "t5",
                    "vocab_size": 19,
                    "d_model": 12,
                    "d_kv": 3,
                    "d_ff": 10,
                    "num_layers": 1,
                    "num_heads": 4,
                    "relative_attention_num_buckets": 8,
                    "relative_attention_max_distance": 16,
                }
            )
        )
        args = (ids, mask, ids[:, :2])
    params = jax.eval_shape(model.init, jax.random.key(0), *args)
    out = jax.eval_shape(lambda params: model.apply(params, *args, method=checked(type(model).__call__)), params)
    if family != "bert":
        assert out.shape == (B, args[-1].shape[-1], 19)
