"""Relative-position schemes: jaxattn against torchref.positions, and against the HF models that use them.

Two kinds of case:

* ``pos_*``: each scheme's jaxattn function against its plain torch twin (torchref.positions), grouped-query
  heads, bottom-right causal T < S where the scheme is causal.
* ``hf_*``: a tiny random HF ``transformers`` attention module (built offline from a config, weights seeded
  here) against the same computation written with jaxattn. Each model has ONE explicit mapping table
  (``_*_table``, rows of jaxattn.models.weights: HF parameter name -> jaxattn params path, and the layout
  transform); the key set must match exactly and every shape its letters. The same table maps torch's
  gradients, since a weight conversion is a permutation.

Where an HF module rounds to float32 on purpose, the float64 run says how it was kept in float64:

* Llama / GPT-NeoX build cos/sin from float32 ``inv_freq``: the float64 run feeds them HF's own formula
  (``inv_freq = 1 / base ** (arange(0, d, 2) / d)``, ``cat(freqs, freqs)``) evaluated in float64; float32 runs
  use HF's rotary module untouched. Attention runs through HF's "sdpa" path (its eager path softmaxes in
  float32 by design).
* BLOOM softmaxes with ``dtype=torch.float32``: the float64 run patches that one cast (``_Float64Softmax``).
* MPT casts its logits with ``.float()`` before the softmax: no float64 comparison is possible (float32 only).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING
from unittest import mock

import numpy as np

from crosscheck.catalogue import (
    FLOAT32_JIT,
    Const,
    Setup,
    hf_module_setup,
    linear_heads,
    normal,
    randomize,
    register_case,
    rng_for,
)

if TYPE_CHECKING:
    from jaxattn.models.weights import Row

_HF = ("transformers",)  # hf_* cases build HF modules: registered only when transformers is installed

# --- mapping tables ------------------------------------------------------------------------------------
# In jaxattn.models.weights' format (the one of every model family): HF name, its shape in letters, our path,
# our shape, the transform (numpy; weights and gradients alike). nn.Linear weight is [out, in], head-major out.
# Imported in each function: jaxattn.models brings flax and every model family, which registering cases need not.


def _t5_table() -> list[Row]:
    from jaxattn.models.weights import row

    heads = linear_heads()
    return [
        row("q.weight", ("N*H", "E"), "query/kernel", ("E", "N", "H"), heads),
        row("k.weight", ("N*H", "E"), "key/kernel", ("E", "N", "H"), heads),
        row("v.weight", ("N*H", "E"), "value/kernel", ("E", "N", "H"), heads),
        row("o.weight", ("E", "N*H"), "out/kernel", ("N", "H", "E"), heads),
        row("relative_attention_bias.weight", ("R", "N"), "t5/table", ("R", "N")),
    ]  # [R,N] as is


def _linear_rows(hf: str, ours: str, N: str) -> list[Row]:
    """An nn.Linear projection to N heads (the letter: "N" or "K") and its bias."""
    from jaxattn.models.weights import Reshape, row

    return [
        row(f"{hf}.weight", (f"{N}*H", "E"), f"{ours}/kernel", ("E", N, "H"), linear_heads()),
        row(f"{hf}.bias", (f"{N}*H",), f"{ours}/bias", (N, "H"), Reshape()),
    ]


def _llama_table() -> list[Row]:
    from jaxattn.models.weights import row

    heads = linear_heads()
    return [
        *_linear_rows("q_proj", "query", "N"),
        *_linear_rows("k_proj", "key", "K"),
        *_linear_rows("v_proj", "value", "K"),
        row("o_proj.weight", ("E", "N*H"), "out/kernel", ("N", "H", "E"), heads),
        row("o_proj.bias", ("E",), "out/bias", ("E",)),
    ]


def _fused_per_head_table(H: int, fused: str, dense: str) -> list[Row]:
    """GPT-NeoX / BLOOM: fused rows [N, 3, H] (per head: q, k, v), biases everywhere: block j of every 3
    blocks of H rows."""
    from jaxattn.models.weights import Every, Row, Steps, Target, row

    heads = linear_heads()
    names = ("query", "key", "value")
    return [
        Row(
            f"{fused}.weight",
            ("N*3*H", "E"),
            tuple(
                Target(f"{name}/kernel", ("E", "N", "H"), Steps(Every(j, 3, 0, w=H), heads))
                for j, name in enumerate(names)
            ),
        ),
        Row(
            f"{fused}.bias",
            ("N*3*H",),
            tuple(Target(f"{name}/bias", ("N", "H"), Every(j, 3, 0, w=H)) for j, name in enumerate(names)),
        ),
        row(f"{dense}.weight", ("E", "N*H"), "out/kernel", ("N", "H", "E"), heads),
        row(f"{dense}.bias", ("E",), "out/bias", ("E",)),
    ]


def _mpt_table() -> list[Row]:
    """MPT: Wqkv rows [3, N, H] (q block, k block, v block), no biases."""
    from jaxattn.models.weights import Part, Row, Steps, Target, row

    heads = linear_heads()
    return [
        Row(
            "Wqkv.weight",
            ("3*N*H", "E"),
            tuple(
                Target(f"{name}/kernel", ("E", "N", "H"), Steps(Part(j, 3, 0), heads))
                for j, name in enumerate(("query", "key", "value"))
            ),
        ),
        row("out_proj.weight", ("E", "N*H"), "out/kernel", ("N", "H", "E"), heads),
    ]


def _w2v2bert_table(kind: str) -> list[Row]:
    from jaxattn.models.weights import row

    heads = linear_heads()
    table = [
        *_linear_rows("linear_q", "query", "N"),
        *_linear_rows("linear_k", "key", "N"),
        *_linear_rows("linear_v", "value", "N"),
        row("linear_out.weight", ("E", "N*H"), "out/kernel", ("N", "H", "E"), heads),
        row("linear_out.bias", ("E",), "out/bias", ("E",)),
    ]
    if kind == "relative_key":  # [L+R+1, H], shared over heads
        return table + [row("distance_embedding.weight", ("R", "H"), "relative/key", ("R", "H"))]
    return table + [
        row("linear_pos.weight", ("N*H", "E"), "position/kernel", ("E", "N", "H"), heads),
        row("pos_bias_u", ("N", "H"), "pos_bias_u", ("N", "H")),
        row("pos_bias_v", ("N", "H"), "pos_bias_v", ("N", "H")),
    ]


def _call(module, params, *args, **kwargs):
    import torch

    return torch.func.functional_call(module, params, args, kwargs)


def _additive_causal(T: int, S: int, dtype):
    """HF's float mask [1,1,T,S]: 0 where query t (at t + S - T) may see key s, finfo.min elsewhere."""
    import torch

    allowed = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T)
    blocked = torch.full((T, S), torch.finfo(dtype).min, dtype=dtype)
    return torch.where(allowed, torch.zeros((), dtype=dtype), blocked)[None, None]


def _bool_causal(T: int, S: int):
    import torch

    return (torch.arange(S)[None, :] <= torch.arange(T)[:, None] + (S - T))[None, None]


# --- jaxattn sides --------------------------------------------------------------------------------------


def _project(p, x_q, x_kv=None):
    from jaxattn import project_qkv

    return project_qkv(p, x_q, x_kv, precision="highest")


def _out(p, z):
    from jaxattn import project_out

    return project_out(p, z, precision="highest")


# --- T5 ------------------------------------------------------------------------------------------------


def _t5(name: str, *, decoder: bool, T: int, S: int) -> Setup:
    from transformers import T5Config
    from transformers.cache_utils import DynamicCache
    from transformers.models.t5.modeling_t5 import T5Attention

    import jaxattn

    B, E, N, H, R, max_distance = 2, 14, 3, 5, 10, 11
    config = T5Config(
        d_model=E,
        d_kv=H,
        num_heads=N,
        relative_attention_num_buckets=R,
        relative_attention_max_distance=max_distance,
        dropout_rate=0.0,
        is_decoder=decoder,
    )
    config._attn_implementation = "eager"
    rng = rng_for(name)
    module = randomize(T5Attention(config, has_relative_attention_bias=True, layer_idx=0, is_causal=decoder), rng)
    module.eval()

    def jax_fn(p, x):
        q, k, v = _project(p, x[..., S - T :, :], x)
        z = jaxattn.t5_attention(
            q,
            k,
            v,
            p["t5"]["table"],
            bidirectional=not decoder,
            max_distance=max_distance,
            is_causal=decoder,
            precision="highest",
        )
        return _out(p, z)

    def torch_fn(p, x):
        if not decoder:
            return _call(module, p, x)[0]
        cache, past = DynamicCache(), S - T
        if past:  # prefill the cache with the first S - T tokens, then attend from the last T
            _call(module, p, x[:, :past], mask=_additive_causal(past, past, x.dtype), past_key_values=cache)
        return _call(module, p, x[:, past:], mask=_additive_causal(T, S, x.dtype), past_key_values=cache)[0]

    return hf_module_setup(
        module, _t5_table(), dict(E=E, N=N, H=H, R=R), jax_fn, torch_fn, {"x": normal(rng, (B, S, E))}
    )


@register_case("hf_t5_encoder", requires=_HF, quick=FLOAT32_JIT)
def hf_t5_encoder() -> Setup:
    """HF T5Attention (encoder: bidirectional buckets, no mask), 10 buckets, max_distance 11, T=S=13."""
    return _t5("hf_t5_encoder", decoder=False, T=13, S=13)


@register_case("hf_t5_decoder", requires=_HF, quick=FLOAT32_JIT)
def hf_t5_decoder() -> Setup:
    """HF T5Attention (decoder: causal buckets), decoding T=5 new tokens against a DynamicCache, S=13."""
    return _t5("hf_t5_decoder", decoder=True, T=5, S=13)


# --- RoPE: Llama, GPT-NeoX ------------------------------------------------------------------------------


def _hf_cos_sin(rotary, config, position_ids, dtype, rotary_dim: int, base: float):
    """HF's rotary cos/sin: its own module in float32, its formula evaluated in float64 for float64."""
    import torch

    if dtype != torch.float64:
        return rotary(torch.zeros((), dtype=dtype), position_ids)
    inv_freq = 1.0 / base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    freqs = position_ids[..., None].double() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@register_case("hf_llama", requires=_HF, quick=FLOAT32_JIT, default_run=True)
def hf_llama() -> Setup:
    """HF LlamaAttention (RoPE "half", GQA N=6 K=2, biases), decoding T=4 against a DynamicCache, S=11."""
    import torch
    from transformers import LlamaConfig
    from transformers.cache_utils import DynamicCache
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    import jaxattn

    B, T, S, E, N, K, H, base = 2, 4, 11, 18, 6, 2, 10, 500.0
    config = LlamaConfig(
        hidden_size=E,
        num_attention_heads=N,
        num_key_value_heads=K,
        head_dim=H,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": base},
    )
    config._attn_implementation = "sdpa"
    rng = rng_for("hf_llama")
    module = randomize(LlamaAttention(config, layer_idx=0), rng).eval()
    rotary = LlamaRotaryEmbedding(config)

    def jax_fn(p, x):
        q, k, v = _project(p, x[..., S - T :, :], x)
        return _out(p, jaxattn.rope_attention(q, k, v, base=base, layout="half", is_causal=True, precision="highest"))

    def torch_fn(p, x):
        cache, past = DynamicCache(), S - T
        cos_sin = _hf_cos_sin(rotary, config, torch.arange(S)[None], x.dtype, H, base)
        _call(
            module,
            p,
            x[:, :past],
            position_embeddings=tuple(c[:, :past] for c in cos_sin),
            attention_mask=None,
            past_key_values=cache,
        )  # SDPA's is_causal: T == S here
        return _call(
            module,
            p,
            x[:, past:],
            position_embeddings=tuple(c[:, past:] for c in cos_sin),
            attention_mask=_bool_causal(T, S),
            past_key_values=cache,
        )[0]

    return hf_module_setup(
        module, _llama_table(), dict(E=E, N=N, K=K, H=H), jax_fn, torch_fn, {"x": normal(rng, (B, S, E))}
    )


@register_case("hf_gpt_neox", requires=_HF, quick=FLOAT32_JIT)
def hf_gpt_neox() -> Setup:
    """HF GPTNeoXAttention (RoPE "half" on 4 of 10 dims per head: partial_rotary_factor 0.4), causal T=S=9."""
    import torch
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import GPTNeoXAttention, GPTNeoXRotaryEmbedding

    import jaxattn

    B, T, E, N, base, factor = 2, 9, 30, 3, 300.0, 0.4
    H = E // N
    rotary_dim = int(H * factor)
    config = GPTNeoXConfig(
        hidden_size=E,
        num_attention_heads=N,
        attention_bias=True,
        attention_dropout=0.0,
        rope_parameters={"rope_type": "default", "rope_theta": base, "partial_rotary_factor": factor},
    )
    config._attn_implementation = "sdpa"
    rng = rng_for("hf_gpt_neox")
    module = randomize(GPTNeoXAttention(config, layer_idx=0), rng).eval()
    rotary = GPTNeoXRotaryEmbedding(config)

    def jax_fn(p, x):
        q, k, v = _project(p, x)
        z = jaxattn.rope_attention(
            q, k, v, base=base, rotary_dim=rotary_dim, layout="half", is_causal=True, precision="highest"
        )
        return _out(p, z)

    def torch_fn(p, x):
        cos_sin = _hf_cos_sin(rotary, config, torch.arange(T)[None], x.dtype, rotary_dim, base)
        return _call(module, p, x, attention_mask=None, position_embeddings=cos_sin)[0]

    table = _fused_per_head_table(H, "query_key_value", "dense")
    return hf_module_setup(module, table, dict(E=E, N=N, H=H), jax_fn, torch_fn, {"x": normal(rng, (B, T, E))})


# --- ALiBi: BLOOM, MPT ----------------------------------------------------------------------------------


class _Float64Softmax:
    """torch.nn.functional for BLOOM's module, except that softmax(x, dtype=float32) keeps float64 x float64."""

    def __getattr__(self, name):
        import torch.nn.functional as F

        return getattr(F, name)

    @staticmethod
    def softmax(x, dim=None, dtype=None, **kwargs):
        import torch
        import torch.nn.functional as F

        return F.softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype, **kwargs)


@register_case("hf_bloom", requires=_HF, quick=FLOAT32_JIT)
def hf_bloom() -> Setup:
    """HF BloomAttention (ALiBi, slope * key_pos, N=6 heads: not a power of two), causal T=S=11."""
    import torch
    from transformers import BloomConfig
    from transformers.models.bloom import modeling_bloom
    from transformers.models.bloom.modeling_bloom import BloomAttention, build_alibi_tensor

    import jaxattn

    B, T, E, N = 2, 11, 24, 6
    H = E // N
    config = BloomConfig(hidden_size=E, n_head=N, attention_dropout=0.0, hidden_dropout=0.0)
    rng = rng_for("hf_bloom")
    module = randomize(BloomAttention(config, layer_idx=0), rng).eval()

    def jax_fn(p, x):
        q, k, v = _project(p, x)
        slopes = jaxattn.alibi_slopes(N, dtype=x.dtype)
        return _out(p, jaxattn.alibi_attention(q, k, v, slopes, is_causal=True, precision="highest"))

    def torch_fn(p, x):
        alibi_tensor = build_alibi_tensor(torch.ones(B, T), N, x.dtype)  # [B*N, 1, T]: slope * key_pos
        keep = (
            mock.patch.object(modeling_bloom, "F", _Float64Softmax())
            if x.dtype == torch.float64
            else contextlib.nullcontext()
        )
        with keep:
            return _call(module, p, x, torch.zeros_like(x), alibi_tensor, _additive_causal(T, T, x.dtype))[0]

    table = _fused_per_head_table(H, "query_key_value", "dense")
    # the fused bias holds BLOOM's key bias (zero gradient, see _hf_setup): the whole tensor is held fixed
    return hf_module_setup(
        module,
        table,
        dict(E=E, N=N, H=H),
        jax_fn,
        torch_fn,
        {"x": normal(rng, (B, T, E))},
        fixed=("query_key_value.bias",),
    )


@register_case("hf_mpt", requires=_HF, quick=FLOAT32_JIT, dtypes=("float32",))
def hf_mpt() -> Setup:
    """HF MptAttention (ALiBi, slope * (key_pos - (S-1)), N=6 heads), causal T=S=10; float32 only (see top)."""
    from transformers import MptConfig
    from transformers.models.mpt.modeling_mpt import MptAttention, build_mpt_alibi_tensor

    import jaxattn

    B, T, E, N = 2, 10, 24, 6
    H = E // N
    config = MptConfig(d_model=E, n_heads=N, attn_config={"alibi_bias_max": 8, "attn_pdrop": 0})
    rng = rng_for("hf_mpt")
    module = randomize(MptAttention(config, layer_idx=0), rng).eval()

    def jax_fn(p, x):
        q, k, v = _project(p, x)
        slopes = jaxattn.alibi_slopes(N, max_bias=8.0, dtype=x.dtype)
        return _out(p, jaxattn.alibi_attention(q, k, v, slopes, is_causal=True, precision="highest"))

    def torch_fn(p, x):
        position_bias = build_mpt_alibi_tensor(N, T, alibi_bias_max=8).to(x.dtype)  # [N, 1, T]
        blocked = ~_bool_causal(T, T)  # MPT's mask: True = masked
        return _call(module, p, x, position_bias, attention_mask=blocked)[0]

    return hf_module_setup(module, _mpt_table(), dict(E=E, N=N, H=H), jax_fn, torch_fn, {"x": normal(rng, (B, T, E))})


# --- Wav2Vec2-BERT: clipped relative keys, Transformer-XL ----------------------------------------------


def _w2v2bert(name: str, kind: str, *, T: int, E: int, N: int, left: int = 0, right: int = 0) -> Setup:
    from transformers import Wav2Vec2BertConfig
    from transformers.models.wav2vec2_bert.modeling_wav2vec2_bert import Wav2Vec2BertSelfAttention

    import jaxattn

    B, H = 2, E // N
    config = Wav2Vec2BertConfig(
        hidden_size=E,
        num_attention_heads=N,
        position_embeddings_type=kind,
        left_max_position_embeddings=left,
        right_max_position_embeddings=right,
        attention_dropout=0.0,
    )
    config._attn_implementation = "eager"  # its eager path keeps the softmax in the input dtype
    rng = rng_for(name)
    module = randomize(Wav2Vec2BertSelfAttention(config), rng).eval()
    inputs = {"x": normal(rng, (B, T, E))}

    if kind == "relative_key":

        def jax_fn(p, x):
            q, k, v = _project(p, x)
            z = jaxattn.clipped_relative_attention(
                q, k, v, p["relative"]["key"], max_left=left, max_right=right, precision="highest"
            )
            return _out(p, z)

        def torch_fn(p, x):
            return _call(module, p, x)[0]
    else:
        # HF's Wav2Vec2BertRelPositionalEmbedding rows: i - j = T-1 .. -(T-1), interleaved sin/cos
        inputs["pos"] = np.asarray(
            jaxattn.relative_sinusoids(E, max_left=T - 1, max_right=T - 1, layout="interleaved", dtype=np.float64)
        )[None]

        def jax_fn(p, x, pos):
            import jax.numpy as jnp

            q, k, v = _project(p, x)
            keys = jnp.einsum("re,enh->rnh", pos[0], p["position"]["kernel"], precision="highest")
            z = jaxattn.transformer_xl_attention(
                q,
                k,
                v,
                keys,
                max_left=T - 1,
                pos_bias_u=p["pos_bias_u"],
                pos_bias_v=p["pos_bias_v"],
                precision="highest",
            )
            return _out(p, z)

        def torch_fn(p, x, pos):
            return _call(module, p, x, relative_position_embeddings=pos)[0]

    dims = dict(E=E, N=N, H=H, R=left + right + 1)
    return hf_module_setup(module, _w2v2bert_table(kind), dims, jax_fn, torch_fn, inputs, fixed=("linear_k.bias",))


@register_case("hf_w2v2bert_relative_key", requires=_HF, quick=FLOAT32_JIT)
def hf_w2v2bert_relative_key() -> Setup:
    """HF Wav2Vec2BertSelfAttention "relative_key": Shaw keys clipped asymmetrically (left 4, right 2), T=9."""
    return _w2v2bert("hf_w2v2bert_relative_key", "relative_key", T=9, E=21, N=3, left=4, right=2)


@register_case("hf_w2v2bert_relative", requires=_HF, quick=FLOAT32_JIT)
def hf_w2v2bert_relative() -> Setup:
    """HF Wav2Vec2BertSelfAttention "relative": Transformer-XL u/v terms over projected sinusoids, T=8, H=11."""
    return _w2v2bert("hf_w2v2bert_relative", "relative", T=8, E=22, N=2)


# --- DeBERTa-v2/v3: disentangled attention -------------------------------------------------------------


def _deberta_table(pos_att_type: tuple[str, ...], share_att_key: bool) -> list[Row]:
    """DisentangledSelfAttention: q/k/v projections, and pos_key_proj (c2p) / pos_query_proj (p2c) unless
    share_att_key (then key_proj / query_proj project the relative embeddings too)."""
    table = [*_linear_rows("query_proj", "query", "N"), *_linear_rows("key_proj", "key", "N")]
    table += _linear_rows("value_proj", "value", "N")
    if not share_att_key and "c2p" in pos_att_type:
        table += _linear_rows("pos_key_proj", "pos_key", "N")
    if not share_att_key and "p2c" in pos_att_type:
        table += _linear_rows("pos_query_proj", "pos_query", "N")
    return table


def _deberta_position_tables(p, rel, pos_att_type, share_att_key):
    """(position_keys, position_queries) [R,N,H]: the relative embeddings [R,E] through their projections."""
    import jax.numpy as jnp

    def project(entry):
        return jnp.einsum("re,enh->rnh", rel, entry["kernel"], precision="highest") + entry["bias"]

    keys = project(p["key" if share_att_key else "pos_key"]) if "c2p" in pos_att_type else None
    queries = project(p["query" if share_att_key else "pos_query"]) if "p2c" in pos_att_type else None
    return keys, queries


@contextlib.contextmanager
def deberta_float64_scale(dtype):
    """transformers' scaled_size_sqrt takes sqrt(H * scale_factor) in float32 (torch.float) whatever the
    dtype: a 1e-8 relative error in every logit of a float64 run. The float64 run evaluates it in float64."""
    import torch
    from transformers.models.deberta_v2 import modeling_deberta_v2

    def scaled_size_sqrt(layer, scale_factor):
        return torch.sqrt(torch.tensor(layer.size(-1), dtype=torch.float64) * scale_factor)

    if dtype != torch.float64:
        yield
        return
    with mock.patch.object(modeling_deberta_v2, "scaled_size_sqrt", scaled_size_sqrt):
        yield


def _deberta(
    name: str,
    pos_att_type: tuple[str, ...],
    *,
    share_att_key: bool,
    position_buckets: int,
    max_relative_positions: int,
    T: int,
    S: int,
    padding: str,
) -> Setup:
    """A DisentangledSelfAttention with seeded weights. padding: "keys" (the last 3 keys of batch row 1 padded:
    a [B,1,1,S] mask), "deberta" (DeBERTa's own [B,1,T,S] mask, padded queries included: transformers returns
    their uniform average and jaxattn zeros, docs/design.md "Rows with no allowed key", so both sides zero those
    rows) or "none". T != S feeds transformers query_states [B,T,E]; its positions are top-left."""
    import torch
    from transformers import DebertaV2Config
    from transformers.models.deberta_v2.modeling_deberta_v2 import DisentangledSelfAttention

    import jaxattn

    B, E, N = 2, 15, 3
    H = E // N
    config = DebertaV2Config(
        hidden_size=E,
        num_attention_heads=N,
        relative_attention=True,
        pos_att_type=list(pos_att_type),
        share_att_key=share_att_key,
        position_buckets=position_buckets,
        max_relative_positions=max_relative_positions,
        attention_probs_dropout_prob=0.0,
        hidden_dropout_prob=0.0,
    )
    rng = rng_for(name)
    module = randomize(DisentangledSelfAttention(config), rng).eval()
    span = position_buckets if position_buckets > 0 else max_relative_positions
    keep = np.ones((B, S), bool)
    if padding != "none":
        keep[1, -3:] = False
    mask = keep[:, None, :, None] & keep[:, None, None, :] if padding == "deberta" else keep[:, None, None, :]
    mask = np.broadcast_to(mask, (B, 1, T, S))
    rows = keep[:, :, None] if padding == "deberta" else np.ones((B, T, 1), bool)  # the rows compared
    inputs = {"x": normal(rng, (B, S, E)), "rel": normal(rng, (2 * span, E)), "mask": Const(mask)}
    if T != S:
        inputs["x_q"] = normal(rng, (B, T, E))

    def jax_fn(p, x, rel, mask, x_q=None):
        q, k, v = _project(p, x if x_q is None else x_q, x)
        keys, queries = _deberta_position_tables(p, rel, pos_att_type, share_att_key)
        z = jaxattn.disentangled_attention(
            q,
            k,
            v,
            keys,
            queries,
            position_buckets=position_buckets,
            max_relative_positions=max_relative_positions,
            mask=mask,
            query_positions=None if T == S else np.arange(T),
            precision="highest",
        )
        return z.reshape(*z.shape[:-2], E) * rows

    def torch_fn(p, x, rel, mask, x_q=None):
        with deberta_float64_scale(x.dtype):
            z = _call(module, p, x, mask, query_states=x_q, rel_embeddings=rel)[0]
        return z * torch.from_numpy(rows)

    # pos_key_proj's bias (and key_proj's when only c2p reads keys) adds q . b to a whole softmax row: its
    # gradient is identically zero (see _hf_setup), held fixed on both sides
    fixed = ("pos_key_proj.bias",) if "c2p" in pos_att_type and not share_att_key else ()
    if "p2c" not in pos_att_type:
        fixed += ("key_proj.bias",)
    table = _deberta_table(pos_att_type, share_att_key)
    return hf_module_setup(module, table, dict(E=E, N=N, H=H), jax_fn, torch_fn, inputs, fixed=fixed)


@register_case("hf_deberta_buckets", requires=_HF, quick=FLOAT32_JIT)
def hf_deberta_buckets() -> Setup:
    """HF DisentangledSelfAttention c2p+p2c, log buckets (6, max 9) clipped at |j-i| >= 12, padded keys, T=S=13."""
    return _deberta(
        "hf_deberta_buckets",
        ("c2p", "p2c"),
        share_att_key=False,
        position_buckets=6,
        max_relative_positions=9,
        T=13,
        S=13,
        padding="keys",
    )


@register_case("hf_deberta_shared_key", requires=_HF, quick=FLOAT32_JIT)
def hf_deberta_shared_key() -> Setup:
    """HF DisentangledSelfAttention c2p+p2c, share_att_key, no buckets (clipped at 5), DeBERTa's mask, T=S=11."""
    return _deberta(
        "hf_deberta_shared_key",
        ("c2p", "p2c"),
        share_att_key=True,
        position_buckets=-1,
        max_relative_positions=5,
        T=11,
        S=11,
        padding="deberta",
    )


@register_case("hf_deberta_c2p_cross", requires=_HF, quick=FLOAT32_JIT)
def hf_deberta_c2p_cross() -> Setup:
    """HF DisentangledSelfAttention c2p only, buckets (4, max 7), query_states T=5 != S=11 (top-left positions)."""
    return _deberta(
        "hf_deberta_c2p_cross",
        ("c2p",),
        share_att_key=False,
        position_buckets=4,
        max_relative_positions=7,
        T=5,
        S=11,
        padding="keys",
    )


@register_case("hf_deberta_p2c", requires=_HF, quick=FLOAT32_JIT)
def hf_deberta_p2c() -> Setup:
    """HF DisentangledSelfAttention p2c only, no buckets (max_relative_positions 16: no clip), T=S=7."""
    return _deberta(
        "hf_deberta_p2c",
        ("p2c",),
        share_att_key=False,
        position_buckets=-1,
        max_relative_positions=16,
        T=7,
        S=7,
        padding="none",
    )


@register_case("hf_deberta_c2p_shared", requires=_HF, quick=FLOAT32_JIT)
def hf_deberta_c2p_shared() -> Setup:
    """HF DisentangledSelfAttention c2p only through key_proj (share_att_key), buckets (10, max 30), T=S=9."""
    return _deberta(
        "hf_deberta_c2p_shared",
        ("c2p",),
        share_att_key=True,
        position_buckets=10,
        max_relative_positions=30,
        T=9,
        S=9,
        padding="keys",
    )


# --- each scheme against its torchref twin ---------------------------------------------------------------

_B, _T, _S, _N, _K, _H, _HV = 2, 5, 11, 6, 3, 7, 3  # grouped-query heads, bottom-right T < S


def _qkv(rng):
    return {"q": normal(rng, (_B, _T, _N, _H)), "k": normal(rng, (_B, _S, _K, _H)), "v": normal(rng, (_B, _S, _K, _HV))}


def _twin_case(name, jax_fn, torch_fn, rng, params=None):
    return Setup(jax_fn, torch_fn, _qkv(rng), params=params)


@register_case("pos_t5_causal")
def pos_t5_causal() -> Setup:
    """t5_attention (causal buckets, learned table [R,N]) vs torchref.positions, GQA, causal T=5 < S=11."""
    import jaxattn
    import torchref.positions as P

    rng = rng_for("pos_t5_causal")
    opts = dict(bidirectional=False, max_distance=7, is_causal=True)
    return _twin_case(
        "pos_t5_causal",
        lambda p, q, k, v: jaxattn.t5_attention(q, k, v, p["table"], **opts),
        lambda p, q, k, v: P.t5_attention(q, k, v, p["table"], **opts),
        rng,
        {"table": normal(rng, (8, _N))},
    )


@register_case("pos_t5_bidirectional_blockwise")
def pos_t5_bidirectional_blockwise() -> Setup:
    """t5_attention bidirectional through the blockwise engine (tiles 2x4) vs torchref.positions, T=5 < S=11."""
    import jaxattn
    import torchref.positions as P

    rng = rng_for("pos_t5_bidirectional_blockwise")
    opts = dict(bidirectional=True, max_distance=6)
    return _twin_case(
        "pos_t5_bidirectional_blockwise",
        lambda p, q, k, v: jaxattn.t5_attention(
            q, k, v, p["table"], implementation="blockwise", block_size=(2, 4), **opts
        ),
        lambda p, q, k, v: P.t5_attention(q, k, v, p["table"], **opts),
        rng,
        {"table": normal(rng, (10, _N))},
    )


@register_case("pos_alibi_causal", default_run=True)
def pos_alibi_causal() -> Setup:
    """alibi_attention (slope * (j - i), 6 heads) vs torchref.positions, GQA, causal T=5 < S=11."""
    import jaxattn
    import torchref.positions as P

    rng = rng_for("pos_alibi_causal")
    slopes = np.asarray(P.alibi_slopes(_N))
    return _twin_case(
        "pos_alibi_causal",
        lambda p, q, k, v: jaxattn.alibi_attention(q, k, v, p["slopes"], is_causal=True),
        lambda p, q, k, v: P.alibi_attention(q, k, v, p["slopes"], is_causal=True),
        rng,
        {"slopes": slopes},
    )


@register_case("pos_alibi_symmetric_blockwise")
def pos_alibi_symmetric_blockwise() -> Setup:
    """alibi_attention symmetric (-slope |j - i|) through the blockwise engine vs torchref.positions."""
    import jaxattn
    import torchref.positions as P

    rng = rng_for("pos_alibi_symmetric_blockwise")
    return _twin_case(
        "pos_alibi_symmetric_blockwise",
        lambda p, q, k, v: jaxattn.alibi_attention(
            q, k, v, p["slopes"], bidirectional=True, implementation="blockwise", block_size=3
        ),
        lambda p, q, k, v: P.alibi_attention(q, k, v, p["slopes"], bidirectional=True),
        rng,
        {"slopes": np.asarray(P.alibi_slopes(_N))},
    )


def _rope_case(name, layout, rotary_dim):
    import jaxattn
    import torchref.positions as P

    opts = dict(layout=layout, rotary_dim=rotary_dim, base=50.0, is_causal=True)
    return _twin_case(
        name,
        lambda q, k, v: jaxattn.rope_attention(q, k, v, **opts),
        lambda q, k, v: P.rope_attention(q, k, v, **opts),
        rng_for(name),
    )


@register_case("pos_rope_half_partial")
def pos_rope_half_partial() -> Setup:
    """rope_attention "half" (GPT-NeoX partial rotary: rotary_dim=4 of H=7) vs torchref, GQA, causal T=5 < S=11."""
    return _rope_case("pos_rope_half_partial", "half", 4)


@register_case("pos_rope_interleaved")
def pos_rope_interleaved() -> Setup:
    """rope_attention "interleaved" (GPT-J) vs torchref's complex-multiplication twin, rotary_dim=6 of H=7."""
    return _rope_case("pos_rope_interleaved", "interleaved", 6)


@register_case("pos_clipped_relative")
def pos_clipped_relative() -> Setup:
    """clipped_relative_attention (max_left 4, max_right 1, key [R,N,H] and value [R,Hv] tables), GQA, causal."""
    import jaxattn
    import torchref.positions as P

    rng = rng_for("pos_clipped_relative")
    opts = dict(max_left=4, max_right=1, is_causal=True)
    return _twin_case(
        "pos_clipped_relative",
        lambda p, q, k, v: jaxattn.clipped_relative_attention(q, k, v, p["kt"], p["vt"], **opts),
        lambda p, q, k, v: P.clipped_relative_attention(q, k, v, p["kt"], p["vt"], **opts),
        rng,
        {"kt": normal(rng, (6, _N, _H)), "vt": normal(rng, (6, _HV))},
    )


@register_case("pos_transformer_xl_causal")
def pos_transformer_xl_causal() -> Setup:
    """transformer_xl_attention causal (the paper's S rows R_{S-1}..R_0), u/v, GQA, T=5 < S=11."""
    import jaxattn
    import torchref.positions as P

    rng = rng_for("pos_transformer_xl_causal")
    opts = dict(max_left=_S - 1, is_causal=True)
    params = {"keys": normal(rng, (_S, _N, _H)), "u": normal(rng, (_N, _H)), "w": normal(rng, (_N, _H))}
    return _twin_case(
        "pos_transformer_xl_causal",
        lambda p, q, k, v: jaxattn.transformer_xl_attention(
            q, k, v, p["keys"], pos_bias_u=p["u"], pos_bias_v=p["w"], **opts
        ),
        lambda p, q, k, v: P.transformer_xl_attention(q, k, v, p["keys"], pos_bias_u=p["u"], pos_bias_v=p["w"], **opts),
        rng,
        params,
    )


@register_case("pos_clipped_relative_blockwise")
def pos_clipped_relative_blockwise() -> Setup:
    """clipped_relative_attention (max_left 4 > a tile, max_right 1) through the blockwise engine (tiles 2x4,
    the table made symmetric), per-head key and shared value tables, GQA, causal T=5 < S=11."""
    import jaxattn
    import torchref.positions as P

    rng = rng_for("pos_clipped_relative_blockwise")
    opts = dict(max_left=4, max_right=1, is_causal=True)
    return _twin_case(
        "pos_clipped_relative_blockwise",
        lambda p, q, k, v: jaxattn.clipped_relative_attention(
            q, k, v, p["kt"], p["vt"], implementation="blockwise", block_size=(2, 4), **opts
        ),
        lambda p, q, k, v: P.clipped_relative_attention(q, k, v, p["kt"], p["vt"], **opts),
        rng,
        {"kt": normal(rng, (6, _N, _H)), "vt": normal(rng, (6, _HV))},
    )


@register_case("pos_transformer_xl_blockwise")
def pos_transformer_xl_blockwise() -> Setup:
    """transformer_xl_attention bidirectional (2S-1 shared position keys), u/v, through the blockwise engine
    (tiles 3x4, Shaw form with a doubled head dim), GQA, T=5 < S=11."""
    import jaxattn
    import torchref.positions as P

    rng = rng_for("pos_transformer_xl_blockwise")
    opts = dict(max_left=_S - 1)
    params = {"keys": normal(rng, (2 * _S - 1, _H)), "u": normal(rng, (_N, _H)), "w": normal(rng, (_N, _H))}
    return _twin_case(
        "pos_transformer_xl_blockwise",
        lambda p, q, k, v: jaxattn.transformer_xl_attention(
            q,
            k,
            v,
            p["keys"],
            pos_bias_u=p["u"],
            pos_bias_v=p["w"],
            implementation="blockwise",
            block_size=(3, 4),
            **opts,
        ),
        lambda p, q, k, v: P.transformer_xl_attention(q, k, v, p["keys"], pos_bias_u=p["u"], pos_bias_v=p["w"], **opts),
        rng,
        params,
    )


@register_case("pos_disentangled_gqa")
def pos_disentangled_gqa() -> Setup:
    """disentangled_attention c2p ([R,N,H]) + p2c ([R,H] shared), buckets (4, max 6), GQA, causal T=5 < S=11."""
    import jaxattn
    import torchref.positions as P

    rng = rng_for("pos_disentangled_gqa")
    opts = dict(position_buckets=4, max_relative_positions=6, is_causal=True)
    return _twin_case(
        "pos_disentangled_gqa",
        lambda p, q, k, v: jaxattn.disentangled_attention(q, k, v, p["kr"], p["qr"], **opts),
        lambda p, q, k, v: P.disentangled_attention(q, k, v, p["kr"], p["qr"], **opts),
        rng,
        {"kr": normal(rng, (8, _N, _H)), "qr": normal(rng, (8, _H))},
    )


@register_case("pos_disentangled_blockwise")
def pos_disentangled_blockwise() -> Setup:
    """disentangled_attention on the blockwise engine (tiles 2x4), buckets (6, max 8), GQA, causal T=5 < S=11."""
    import jaxattn
    import torchref.positions as P

    rng = rng_for("pos_disentangled_blockwise")
    opts = dict(position_buckets=6, max_relative_positions=8, is_causal=True)
    return _twin_case(
        "pos_disentangled_blockwise",
        lambda p, q, k, v: jaxattn.disentangled_attention(
            q, k, v, p["kr"], p["qr"], implementation="blockwise", block_size=(2, 4), **opts
        ),
        lambda p, q, k, v: P.disentangled_attention(q, k, v, p["kr"], p["qr"], **opts),
        rng,
        {"kr": normal(rng, (12, _N, _H)), "qr": normal(rng, (12, _N, _H))},
    )


@register_case("hf_gptj_rope", requires=_HF, quick=FLOAT32_JIT)
def hf_gptj_rope() -> Setup:
    """HF GPT-J's apply_rotary_pos_emb (the "interleaved" layout, rotate_every_two) on 6 of H=11 features."""
    import torch
    from transformers.models.gptj.modeling_gptj import apply_rotary_pos_emb, create_sinusoidal_positions

    import jaxattn

    B, T, N, H, rotary_dim = 2, 7, 3, 11, 6
    rng = rng_for("hf_gptj_rope")

    def jax_fn(x):
        return jaxattn.apply_rope(x, rotary_dim=rotary_dim, layout="interleaved")

    def torch_fn(x):
        if x.dtype == torch.float64:  # GPT-J's create_sinusoidal_positions, evaluated in float64
            inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
            angles = torch.arange(T, dtype=torch.float64)[:, None] * inv_freq
            sin_cos = torch.cat((angles.sin(), angles.cos()), dim=1)
        else:
            sin_cos = create_sinusoidal_positions(T, rotary_dim)
        sin, cos = sin_cos[None].to(x.dtype).chunk(2, dim=-1)  # [1, T, rotary_dim/2] each
        rotated = apply_rotary_pos_emb(x[..., :rotary_dim], sin, cos)
        return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)

    return Setup(jax_fn, torch_fn, {"x": normal(rng, (B, T, N, H))})


def cases() -> list[str]:
    """The names this module registers (in catalogue order), e.g. for a catalogue that does not import it."""
    from crosscheck.catalogue import CASES

    return [name for name, case in CASES.items() if case.build.__module__ == __name__]
