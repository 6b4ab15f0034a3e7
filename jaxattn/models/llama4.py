"""Llama 4's text model in Flax linen: HF's Llama4ForCausalLM (model_type "llama4_text").

    x = embed_tokens[ids]
    each layer i:  h = RMSNorm(x)
        RoPE layer (no_rope_layers[i] = 1):  q, k = RoPE(l2(q(h))), RoPE(l2(k(h)))   chunked: key slot s is visible
                                                                                     to query slot t iff s <= t
                                                                                     and s // C == t // C
        NoPE layer (no_rope_layers[i] = 0):  q = q(h) * tau(t), k = k(h)             global causal, no RoPE
        x = x + o(attend(q, k, v(h)))                                                GQA, scale H ** -0.5
        x = x + mlp(RMSNorm(x))
    logits = RMSNorm(x) @ lm_head (or embed_tokens.T when tied)

    l2(q)   = q / sqrt(mean(q^2) + eps) per head, no weight (use_qk_norm; RoPE layers only)
    tau(t)  = 1 + attn_scale * log(1 + floor((t + 1) / floor_scale))   (attn_temperature_tuning; NoPE layers only;
              t the query's cache slot, HF's arange + past_seen_tokens, padding counted)
    C       = attention_chunk_size; chunks start at each row's first real token (HF counts the left padding off)
    mlp     = MoE on moe_layers (HF's default: every interleave_moe_layer_step-th layer), else SwiGLU of width
              G = intermediate_size_mlp
    MoE(h)  = shared_expert(h) + sum_x expert_x(s_x * h),   s = topk_sigmoid(router(h))   (zero off the top k)

The router's scores scale each expert's INPUT (Llama 4's choice; with SwiGLU experts this is not the same as
weighting their outputs) and every expert runs on every token (dense dispatch, as jaxattn.models.moe: an
expert whose score is 0 gets a zero input and returns exactly 0, having no biases). The experts' weights are
stacked [X,...] leaves in moe's layout, filled from HF's fused experts.gate_up_proj [X,E,2F] (gate columns
first) and experts.down_proj [X,F,E]; the shared expert is a SwiGLU of width F.

RoPE: Llama 4 rotates the pairs (2k, 2k+1) (its complex-number form, torch.view_as_complex), the
"interleaved" layout of jaxattn's RoPE: no permutation of the q/k weights is needed. HF normalises q and k
after RoPE; the layer's qk_norm hook applies before it: a weightless RMS norm over the head commutes with a
rotation (the rotation keeps the sum of squares), so the two orders are the same function. The NoPE layers'
temperature is a per-query-position factor on the projected queries: the same hook carries it (identity on
the keys). Rope types as _rope_config.rope_frequencies (the released models use "llama3").

Chunked layers without an attention_mask run the attention layer's own chunk_size keyword; with padding or
the decode cache, the chunks are a mask over the cache's slots (chunked_mask), counted from each row's first
real token as HF's create_chunked_causal_mask does, so a left-padded row chunks as its unpadded self.

Refused by name: hidden_act other than "silu", router_jitter_noise, layer_types other than those the RoPE
layers imply, no_rope_layers or moe_layers that do not name the layers, a non-positive chunk size or floor_scale.

Axis letters: those of _decoder (V E N K H F) and moe (X experts); G the dense layers' intermediate width.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax.numpy as jnp

from .._core.norms import rms_normalize
from ..linen import RoPE
from . import _activation_layout, _blocks, _decoder, _masks, _norms, _pretrained, _rope_config, moe, weights
from .weights import Part, Target, Transpose

if TYPE_CHECKING:  # the shapes in the signatures: annotations only, jaxtyping is no run-time dependency
    from jaxtyping import Array, ArrayLike, Bool, Float, Int


# HF's Llama4TextConfig.default_theta: a config without rope settings means 5e5 there (Llama's 1e4 elsewhere)
DEFAULT_ROPE_THETA = 5e5


@dataclasses.dataclass(frozen=True)
class Llama4TextConfig(moe.MoEConfig):
    """HF's Llama4TextConfig fields this port reads (defaults: HF's); rope_layers and moe_layers are derived."""

    vocab_size: int = 202048
    hidden_size: int = 5120
    intermediate_size: int = 8192
    intermediate_size_mlp: int = 16384
    num_hidden_layers: int = 48
    num_attention_heads: int = 40
    num_key_value_heads: int | None = 8
    head_dim: int | None = 128
    rms_norm_eps: float = 1e-5
    num_local_experts: int = 16
    num_experts_per_tok: int = 1
    use_qk_norm: bool = True
    attention_chunk_size: int | None = 8192
    attn_temperature_tuning: bool = True
    floor_scale: int = 8192
    attn_scale: float = 0.1
    rope_layers: tuple = ()  # per layer: True = RoPE (chunked when attention_chunk_size), False = NoPE, global
    moe_layers: tuple = ()  # the layers whose MLP is the mixture of experts

    routing = "topk_sigmoid"  # (moe.ROUTINGS) the k largest logits, each through a sigmoid

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], source="config") -> Llama4TextConfig:
        """From a HF config.json dict; refuses by name what is not implemented (see the module)."""
        refuse = functools.partial(_pretrained.refuse, source)
        moe.refuse_silu_and_jitter(config, refuse)
        n = config.get("num_hidden_layers", cls.num_hidden_layers)
        rope_layers = _rope_layers(config, n, refuse)
        chunk = config.get("attention_chunk_size", cls.attention_chunk_size)
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            refuse("attention_chunk_size", "an int >= 1 or null", chunk)
        types = ["chunked_attention" if rope and chunk is not None else "full_attention" for rope in rope_layers]
        if config.get("layer_types") is not None and list(config["layer_types"]) != types:
            refuse(
                "layer_types",
                f"{types} (chunked exactly on the RoPE layers, as HF derives them)",
                config["layer_types"],
            )
        floor = config.get("floor_scale", cls.floor_scale)
        if isinstance(floor, bool) or not isinstance(floor, (int, float)) or floor <= 0:
            refuse("floor_scale", "a number > 0", floor)
        return cls.parse(
            config,
            source,
            rope=_rope_config.rope_parameters({"rope_theta": DEFAULT_ROPE_THETA, **config}),
            nullable=("attention_chunk_size",),
            rope_layers=rope_layers,
            moe_layers=_moe_layers(config, n, refuse),
        )

    def to_dict(self) -> dict:
        """config.json's keys (inverse of from_dict)."""
        return super().to_dict() | {
            "model_type": "llama4_text",
            "architectures": ["Llama4ForCausalLM"],
            "hidden_act": "silu",
            "attention_bias": self.attention_bias,
            "intermediate_size_mlp": self.intermediate_size_mlp,
            "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "router_jitter_noise": 0.0,
            "moe_layers": list(self.moe_layers),
            "no_rope_layers": [int(r) for r in self.rope_layers],
            "use_qk_norm": self.use_qk_norm,
            "attention_chunk_size": self.attention_chunk_size,
            "layer_types": self.layer_types(),
            "attn_temperature_tuning": self.attn_temperature_tuning,
            "floor_scale": self.floor_scale,
            "attn_scale": self.attn_scale,
        }

    def layer_types(self) -> list[str]:
        return ["chunked_attention" if self.chunked(i) else "full_attention" for i in range(self.num_hidden_layers)]

    def chunked(self, layer: int) -> bool:
        return self.rope_layers[layer] and self.attention_chunk_size is not None

    def rope(self, layer: int | None) -> tuple[tuple, float]:
        """A NoPE layer has no rotary embedding, so no attention factor (HF applies it to cos and sin only)."""
        frequencies, factor = super().rope(layer)
        return frequencies, factor if layer is None or self.rope_layers[layer] else 1.0

    def dims(self) -> dict[str, int]:
        return {**super().dims(), "G": self.intermediate_size_mlp}


def _rope_layers(config: Mapping[str, Any], n: int, refuse) -> tuple:
    """HF's no_rope_layers (1 = RoPE; at least one entry per layer), else a NoPE layer every
    no_rope_layer_interval-th layer."""
    listed = config.get("no_rope_layers")
    if not listed:
        interval = config.get("no_rope_layer_interval", 4)
        return tuple((i + 1) % interval != 0 for i in range(n))
    if len(listed) < n or not set(listed) <= {0, 1}:
        refuse("no_rope_layers", f"at least {n} entries (num_hidden_layers), each 0 or 1", listed)
    return tuple(bool(r) for r in listed[:n])


def _moe_layers(config: Mapping[str, Any], n: int, refuse) -> tuple:
    """HF's moe_layers, else every interleave_moe_layer_step-th layer (step - 1, 2 step - 1, ...)."""
    if config.get("moe_layers") is None:
        step = config.get("interleave_moe_layer_step", 1)
        return tuple(range(step - 1, n, step))
    layers = config["moe_layers"]
    if not all(isinstance(i, int) and 0 <= i < n for i in layers) or len(set(layers)) != len(layers):
        refuse("moe_layers", f"distinct layer indices in [0, {n})", layers)
    return tuple(sorted(layers))


# --- masks and the attention's per-head hooks -------------------------------------------------------------------


def chunked_mask(attention_mask, slots, chunk: int):
    """The attention layers' mask of a chunked layer on the cache's slots [B,1,T,L]: key slot s is visible to
    the query in slot t iff s <= t, (s - p) // C == (t - p) // C with p the row's left padding (HF's
    chunked_overlay), and s holds a token."""
    if attention_mask is None:
        raise ValueError(
            "attention_mask: expected [B,L] covering the cache's L slots when decoding a model "
            "with chunked layers, got None"
        )
    attention_mask = jnp.asarray(attention_mask)
    left = jnp.sum(jnp.cumsum(attention_mask, -1) == 0, -1)[:, None, None]  # leading padding slots
    key_slots = jnp.arange(attention_mask.shape[-1], dtype=jnp.int32)
    query_slots = slots[..., None]
    same_chunk = (key_slots - left) // chunk == (query_slots - left) // chunk
    return ((key_slots <= query_slots) & same_chunk)[:, None] & _masks.key_mask(attention_mask)


def temperature(slots, floor_scale: float, attn_scale: float, dtype):
    """tau(t) = 1 + attn_scale * log1p(floor((t + 1) / floor_scale)) [B,T] at the queries' slots, computed
    in float32 or wider (HF: in float32)."""
    wide = jnp.promote_types(dtype, jnp.float32)
    return jnp.log1p(jnp.floor((slots.astype(wide) + 1.0) / floor_scale)) * attn_scale + 1.0


class L2Norm(nn.Module):
    """Llama4TextL2Norm: x / sqrt(mean(x^2) + eps) over each head's features, no weight, back in x's dtype."""

    epsilon: float

    @nn.compact
    def __call__(self, x):
        return rms_normalize(x, self.epsilon).astype(x.dtype)


class QueryTemperature(nn.Module):
    """The queries [B,T,N,H] times their slot's tau [B,T], rounded back to their dtype (as HF's)."""

    scales: Any

    @nn.compact
    def __call__(self, q):
        return (q * self.scales[..., None, None]).astype(q.dtype)


class Unchanged(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x


def _temperature_hook(scales):
    """The qk_norm factory of a NoPE layer: q_norm scales the queries by tau, k_norm leaves the keys."""

    def make(name):
        return QueryTemperature(scales, name=name) if name == "q_norm" else Unchanged(name=name)

    return make


# --- the block ---------------------------------------------------------------------------------------------------


class SwiGLU(_decoder.Configured):
    """down(silu(gate(x)) * up(x)) of intermediate width `features` (the dense layers' G, the shared expert's F)."""

    features: int = 0

    @nn.compact
    def __call__(self, x):
        return _blocks.gated_mlp(self, x, nn.silu, features=self.features)


class RoutedExperts(_decoder.Configured):
    """Each expert x on its own input [...,X,E] -> [...,X,E]: down_x(silu(gate_x(.)) * up_x(.))."""

    @nn.compact
    def __call__(self, x):
        def dense(features, name):
            return moe.StackedDense(
                self.config, self.dtype, self.param_dtype, self.precision, self.sharding, features=features, name=name
            )

        F = self.config.dims()["F"]
        h = nn.silu(dense(F, "gate_proj")(x, per_expert=True)) * dense(F, "up_proj")(x, per_expert=True)
        return dense(x.shape[-1], "down_proj")(h, per_expert=True)


class Llama4MoE(_decoder.Configured):
    """Llama4TextMoe: x [...,E] -> (shared_expert(x) + sum_x expert_x(s_x x) [...,E], router logits [...,X])."""

    @nn.compact
    def __call__(self, x):
        c = self.config
        logits = nn.Dense(
            c.dims()["X"],
            use_bias=False,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=self.precision,
            name="router",
        )(x)
        scores = moe.routing_weights(logits, c.num_experts_per_tok, c.routing).astype(x.dtype)  # HF: back to x's
        # each expert's input [B,T,X,E], kept batch over "data" on a mesh: left to itself XLA splits E over
        # "data" as the FSDP'd expert kernels are, and all-reduces the activations over "data"
        inputs = _activation_layout.constrain(self.sharding, x[..., None, :] * scores[..., :, None], "BTXE")
        routed = RoutedExperts(c, self.dtype, self.param_dtype, self.precision, self.sharding, name="experts")(inputs)
        shared = SwiGLU(
            c, self.dtype, self.param_dtype, self.precision, self.sharding, features=c.dims()["F"], name="shared_expert"
        )(x)
        return shared + jnp.sum(routed, axis=-2), logits


class Llama4Block(_blocks.PreNormBlock):
    """Llama's pre-norm block with Llama 4's attention (RoPE + L2 q/k norm + chunks, or NoPE + temperature) and
    its MLP (the MoE on moe_layers, else a SwiGLU of width G); rows as PreNormBlock's ("router" on MoE layers)."""

    def feed_forward(self, x):
        c, d = self.config, self.config.dims()
        options = dict(
            dtype=self.dtype, param_dtype=self.param_dtype, precision=self.precision, sharding=self.sharding, name="mlp"
        )
        if self.layer in c.moe_layers:
            y, logits = Llama4MoE(c, **options)(x)
            return y, {"router": logits}
        return SwiGLU(c, features=d["G"], **options)(x), {}

    def attention_hooks(self, slots, dtype, chunk_size) -> dict:
        """self_attention's options of this layer: RoPE, chunks and L2 norms, or the NoPE temperature."""
        c = self.config
        if c.rope_layers[self.layer]:
            return dict(
                rope=RoPE(frequencies=c.rope_frequencies, layout="interleaved"),
                chunk_size=chunk_size,
                qk_norm=functools.partial(L2Norm, c.rms_norm_eps) if c.use_qk_norm else None,
            )
        if not c.attn_temperature_tuning:
            return dict(rope=None)
        return dict(rope=None, qk_norm=_temperature_hook(temperature(slots, c.floor_scale, c.attn_scale, dtype)))

    @nn.compact
    def __call__(self, x, mask, positions, decode: bool, slots=None, chunk_size=None):
        norm = self.norm()
        h = norm(name="input_layernorm")(x)
        a = _blocks.self_attention(
            self, h, mask, positions, decode, None, **self.attention_hooks(slots, h.dtype, chunk_size)
        )
        x = x + a
        m, rows = self.feed_forward(norm(name="post_attention_layernorm")(x))
        return x + m, {"attention": a, **rows, "mlp": m}


class Llama4ForCausalLM(_decoder.CausalLM):
    """HF Llama4ForCausalLM: input_ids [B,T] -> logits [B,T,V] (the calling convention of _decoder)."""

    Block = Llama4Block

    @nn.compact
    def __call__(
        self,
        input_ids: Int[ArrayLike, "B T"],
        attention_mask: Int[ArrayLike, "B _keys"] | Bool[ArrayLike, "B _keys"] | None = None,
        position_ids: Int[ArrayLike, "B T"] | None = None,
        *,
        decode: bool = False,
    ) -> Float[Array, "B T V"]:
        c, d = self.config, self.config.dims()
        input_ids = jnp.asarray(input_ids)
        positions, slots = _masks.positions_and_slots(self, input_ids.shape, position_ids, decode)
        embed = nn.Embed(d["V"], d["E"], dtype=self.dtype, param_dtype=self.param_dtype, name="embed_tokens")
        full = _masks.key_mask(attention_mask)
        # the layer's chunk_size keyword counts chunks from slot 0: right without padding or a cache
        plain = attention_mask is None and not decode
        chunked = (
            full
            if plain or c.attention_chunk_size is None
            else chunked_mask(attention_mask, slots, c.attention_chunk_size)
        )

        def layer(i, x):
            block = self.Block(
                c, self.dtype, self.param_dtype, self.precision, self.sharding, layer=i, name=f"layers_{i}"
            )
            if not c.chunked(i):
                return block(x, full, positions, decode, slots)
            return block(x, chunked, positions, decode, slots, c.attention_chunk_size if plain else None)

        norm = _norms.RMSNorm(c.rms_norm_eps, self.param_dtype, c.rms_norm, name="norm")
        x = _decoder.layer_stack(self, layer, c.num_hidden_layers, norm, embed(input_ids))
        return _decoder.lm_head(self, x, embed, c.tie_word_embeddings)


# --- weights ------------------------------------------------------------------------------------------------------


def _feed_forward_rows() -> tuple[list[weights.Row], list[weights.Row]]:
    """(a dense layer's rows, an MoE layer's rows): HF's feed_forward.* tensors -> our layers_{i}/mlp/*."""
    R, ours = weights.row, "layers_{i}/mlp/"

    def swiglu(hf: str, path: str, width: str) -> list[weights.Row]:
        return [
            R(hf + "gate_proj.weight", (width, "E"), path + "gate_proj/kernel", ("E", width), Transpose()),
            R(hf + "up_proj.weight", (width, "E"), path + "up_proj/kernel", ("E", width), Transpose()),
            R(hf + "down_proj.weight", ("E", width), path + "down_proj/kernel", (width, "E"), Transpose()),
        ]

    dense = swiglu("model.layers.{i}.feed_forward.", ours, "G")
    experts = [
        R("model.layers.{i}.feed_forward.router.weight", ("X", "E"), ours + "router/kernel", ("E", "X"), Transpose()),
        weights.Row(
            "model.layers.{i}.feed_forward.experts.gate_up_proj",
            ("X", "E", "2*F"),
            (
                Target(ours + "experts/gate_proj/kernel", ("X", "E", "F"), Part(0, 2, 2)),
                Target(ours + "experts/up_proj/kernel", ("X", "E", "F"), Part(1, 2, 2)),
            ),
        ),
        R(
            "model.layers.{i}.feed_forward.experts.down_proj",
            ("X", "F", "E"),
            ours + "experts/down_proj/kernel",
            ("X", "F", "E"),
        ),
        *swiglu("model.layers.{i}.feed_forward.shared_expert.", ours + "shared_expert/", "F"),
    ]
    return dense, experts


def weight_table(config: Llama4TextConfig) -> list[weights.Row]:
    """HF's names -> our params: the shared causal-LM rows, then each layer's dense MLP or MoE (its router,
    its fused experts split into gate and up, its shared expert), as moe_layers says."""
    dense, experts = _feed_forward_rows()
    on_moe_layers = {r.name: False for r in dense} | {r.name: True for r in experts}

    def kept(r: weights.Row) -> bool:
        template = _template(r.name)
        return template not in on_moe_layers or on_moe_layers[template] == (
            int(r.name.split(".")[2]) in config.moe_layers
        )

    rows = weights.expand([*_decoder.causal_lm_rows(config), *dense, *experts], config.num_hidden_layers)
    return [r for r in rows if kept(r)]


def _template(name: str) -> str:
    """model.layers.3.feed_forward.x -> model.layers.{i}.feed_forward.x (other names unchanged)."""
    parts = name.split(".")
    if name.startswith("model.layers.") and parts[2].isdigit():
        parts[2] = "{i}"
    return ".".join(parts)


_pretrained.register_family("llama4_text")(_decoder.loader(Llama4TextConfig, Llama4ForCausalLM, weight_table))
