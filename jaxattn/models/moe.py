"""Mixture-of-experts MLPs (Mixtral, Qwen3-MoE, gpt-oss): a router picks k of X experts per token; each layer's expert
weights are ONE stacked array per projection, the experts' axis X leading, so that they can be sharded over
an expert axis of a mesh.

    params of a layer's "mlp" (axis letters: X experts, E hidden, F an expert's intermediate size):
        router/kernel [E,X]  (router/bias [X], gpt-oss)
        experts/gate_proj/kernel [X,E,F]   experts/up_proj/kernel [X,E,F]   experts/down_proj/kernel [X,F,E]
        (gpt-oss: experts/{gate_proj,up_proj}/bias [X,F], experts/down_proj/bias [X,E])
        (kept quantized, each kernel instead: gpt-oss's MXFP4 kernel_blocks / kernel_scales, Qwen3-MoE's block
        FP8 kernel_fp8 [X,out,in] / kernel_scale_inv; StackedDense decodes them before its einsum)

    logits r = x @ router (+ b)                                               [...,X], the "router" row
    routing weights w [...,X], zero off each token's top k:
        "softmax_topk" (Mixtral, Qwen3-MoE): p = softmax(r), the k largest p, divided by their sum when
                       normalize (Mixtral: always; Qwen3-MoE: norm_topk_prob)
        "topk_softmax" (gpt-oss): the k largest r, softmaxed among themselves
        "topk_sigmoid" (Llama 4): the k largest r, each through a sigmoid (Llama 4 weights the experts' inputs
                       by them, not their outputs: jaxattn.models.llama4)
    y = sum_x w[..., x] * down_x(act(gate_x(x), up_x(x)))

Dispatch is dense: every expert runs on every token and w weights them (zeros off the top k), one einsum over
the stacked arrays. It is exact (a zero weight adds exactly nothing) and simple, at X / k times the FLOPs of
running only the chosen experts and a [...,X,F] intermediate: right for the tiny checkpoints the ports are
proven on and as the reference for a gather/sort dispatch, not for serving a large MoE.

The pieces: MoEConfig (the experts' config fields; a family sets its routing, biases and activation there),
SparseMoE (router + Experts, each projection a StackedDense), MoEBlock (Llama's block with a SparseMoE),
expert_rows / fused_expert_rows (the weight-table rows of per-expert or fused checkpoints) and loader,
router_logits and load_balancing_loss.

Routing is computed in float32 or wider (HF's Mixtral router takes its softmax in float32; crosscheck's
float64 reference lifts that). load_balancing_loss is HF's auxiliary loss (aux_loss with
output_router_logits) from the routers' logits, which every MoE model here sows as "layer{i}.router".
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype

from . import _blocks, _decoder, _pretrained, quantized, weights
from .weights import Part, Steps, SwapAxes, Target, Transpose

ROUTINGS = ("softmax_topk", "topk_softmax", "topk_sigmoid")


@dataclasses.dataclass(frozen=True)
class MoEConfig(_decoder.DecoderConfig):
    """A DecoderConfig with experts (HF's names): X = num_local_experts, k = num_experts_per_tok, F = an
    expert's intermediate_size; a family sets its routing, its biases and its experts' activation."""

    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    # None: the experts' kernels as float params; "mxfp4": kept packed as the released gpt-oss files hold them
    # (StackedDense: kernel_blocks [X,out,in/32,16], kernel_scales [X,out,in/32], decoded inside the matmul)
    experts_format: str | None = None

    routing: ClassVar[str] = "softmax_topk"  # see ROUTINGS
    router_bias: ClassVar[bool] = False
    expert_bias: ClassVar[bool] = False

    @classmethod
    def parse(cls, config: Mapping[str, Any], source, **kwargs):
        """DecoderConfig.parse, and num_experts_per_tok refused unless an int in [1, num_local_experts]."""
        parsed = super().parse(config, source, **kwargs)
        k, X = parsed.num_experts_per_tok, parsed.num_local_experts
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= X:
            _pretrained.refuse(source, "num_experts_per_tok", f"an int in [1, {X}] (num_local_experts)", k)
        return parsed

    def dims(self) -> dict[str, int]:
        return {**super().dims(), "X": self.num_local_experts}

    def normalize_top_k(self) -> bool:
        """softmax_topk: whether the top k probabilities are divided by their sum (Mixtral: always)."""
        return True

    def expert_activation(self, gate, up):
        """act(gate, up) of every expert: SwiGLU, silu(gate) * up."""
        return nn.silu(gate) * up


def refuse_silu_and_jitter(config: Mapping[str, Any], refuse: Callable) -> None:
    """The refusals Mixtral and Llama 4 share: SwiGLU experts (hidden_act "silu") and no router jitter."""
    if config.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", "'silu'", config["hidden_act"])
    if config.get("router_jitter_noise", 0.0):
        refuse(
            "router_jitter_noise",
            "0.0 (training-time noise on the router's input is not implemented)",
            config["router_jitter_noise"],
        )


def routing_weights(logits, top_k: int, routing: str, *, normalize: bool = True):
    """[...,X] router logits -> [...,X] weights, zero except each token's top_k experts (see the module)."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing: expected one of {list(ROUTINGS)}, got {routing!r}")
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    if routing == "softmax_topk":
        top, index = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
        top = top / jnp.sum(top, axis=-1, keepdims=True) if normalize else top
    else:
        top, index = jax.lax.top_k(logits, top_k)
        top = jax.nn.softmax(top, axis=-1) if routing == "topk_softmax" else jax.nn.sigmoid(top)
    return jnp.einsum("...k,...kx->...x", top, jax.nn.one_hot(index, logits.shape[-1], dtype=top.dtype))


def clamped_swiglu(gate, up, *, alpha: float, limit: float):
    """gpt-oss's expert activation: gate clamped above at limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate)."""
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * (gate * jax.nn.sigmoid(gate * alpha))


class StackedDense(_decoder.Configured):
    """The config's X Dense layers in one kernel [X,in,out] (bias [X,out] with the config's expert_bias):
    x [...,in] (every expert on the same input) or [...,X,in] (each expert its own) -> [...,X,out]."""

    features: int = 0

    @nn.compact
    def __call__(self, x, *, per_expert: bool = False):
        shape = (self.config.dims()["X"], x.shape[-1], self.features)
        bias = (
            self.param("bias", nn.initializers.zeros, (shape[0], shape[2]), self.param_dtype)
            if self.config.expert_bias
            else None
        )
        if self.config.experts_format == "mxfp4":  # packed [X,out,in/32,16] and its scales, decoded here
            X, i, o = shape
            zeros = nn.initializers.zeros
            blocks = self.param("kernel_blocks", zeros, (X, o, i // quantized.MX_GROUP, 16), jnp.uint8)
            scales = self.param("kernel_scales", zeros, (X, o, i // quantized.MX_GROUP), jnp.uint8)
            dtype = self.dtype or jnp.result_type(x, *([] if bias is None else [bias]))
            kernel = jnp.swapaxes(quantized.mxfp4_matrix(blocks, scales, dtype), -1, -2)  # [X,in,out]
        elif self.config.fp8_block is not None:  # block FP8 [X,out,in] and its scales, decoded here
            X, i, o = shape
            (br, bc), zeros = self.config.fp8_block, nn.initializers.zeros
            weight = self.param("kernel_fp8", zeros, (X, o, i), quantized.FP8)
            scales = self.param("kernel_scale_inv", nn.initializers.ones, (X, -(-o // br), -(-i // bc)), jnp.float32)
            dtype = self.dtype or jnp.bfloat16  # as _blocks.kept_fp8: what a dequantized load's kernels are
            kernel = jnp.swapaxes(quantized.fp8_matrix(weight, scales, self.config.fp8_block, dtype), -1, -2)
        else:
            kernel = self.param("kernel", nn.initializers.lecun_normal(batch_axis=(0,)), shape, self.param_dtype)
        x, kernel, bias = promote_dtype(x, kernel, bias, dtype=self.dtype)
        y = jnp.einsum("...xi,xio->...xo" if per_expert else "...i,xio->...xo", x, kernel, precision=self.precision)
        return y if bias is None else y + bias


class Experts(_decoder.Configured):
    """Every expert on every token: down_x(act(gate_x(x), up_x(x))) -> [...,X,E] (dense dispatch)."""

    @nn.compact
    def __call__(self, x):
        def dense(features, name):
            return StackedDense(
                self.config, self.dtype, self.param_dtype, self.precision, self.sharding, features=features, name=name
            )

        F = self.config.dims()["F"]
        h = self.config.expert_activation(dense(F, "gate_proj")(x), dense(F, "up_proj")(x))
        return dense(x.shape[-1], "down_proj")(h, per_expert=True)


class SparseMoE(_decoder.Configured):
    """The "mlp" of an MoE block: x [...,E] -> (y [...,E], router logits [...,X]); params in the module's
    layout (router, experts)."""

    @nn.compact
    def __call__(self, x):
        c = self.config
        logits = nn.Dense(
            c.dims()["X"],
            use_bias=c.router_bias,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            precision=self.precision,
            name="router",
        )(x)
        weights = routing_weights(logits, c.num_experts_per_tok, c.routing, normalize=c.normalize_top_k())
        out = Experts(c, self.dtype, self.param_dtype, self.precision, self.sharding, name="experts")(x)  # [...,X,E]
        y = jnp.einsum("...xe,...x->...e", out, weights.astype(out.dtype), precision=self.precision)
        return y.astype(out.dtype), logits


class MoEBlock(_blocks.PreNormBlock):
    """Llama's block with a SparseMoE for its MLP ("mlp"); its rows add the router's logits ("router")."""

    def feed_forward(self, x):
        y, logits = SparseMoE(self.config, self.dtype, self.param_dtype, self.precision, self.sharding, name="mlp")(x)
        return y, {"router": logits}


def expert_rows(*, router: str, gate: str, up: str, down: str) -> list[weights.Row]:
    """The rows of an MoE layer's router ([X,E] -> router/kernel [E,X]) and of its experts as
    save_pretrained writes them, one tensor per expert ("{j}"): gate and up [F,E], down [E,F] (torch Linear
    weights), each stacked into one [X,...] leaf. The arguments are the family's literal HF names."""
    R, S, ours = weights.row, functools.partial(weights.stacked, over="X"), "layers_{i}/mlp/experts/"
    return [
        R(router, ("X", "E"), "layers_{i}/mlp/router/kernel", ("E", "X"), Transpose()),
        S(gate, ("F", "E"), ours + "gate_proj/kernel", ("X", "E", "F"), Transpose()),
        S(up, ("F", "E"), ours + "up_proj/kernel", ("X", "E", "F"), Transpose()),
        S(down, ("E", "F"), ours + "down_proj/kernel", ("X", "F", "E"), Transpose()),
    ]


def fused_expert_rows() -> list[weights.Row]:
    """The same params from transformers 5's fused modules (Mixtral's and Qwen3-MoE's state_dict in memory):
    mlp.gate.weight [X,E], mlp.experts.gate_up_proj [X,2F,E] (gate rows first), mlp.experts.down_proj [X,E,F]."""
    R, ours = weights.row, "layers_{i}/mlp/experts/"
    return [
        R("model.layers.{i}.mlp.gate.weight", ("X", "E"), "layers_{i}/mlp/router/kernel", ("E", "X"), Transpose()),
        weights.Row(
            "model.layers.{i}.mlp.experts.gate_up_proj",
            ("X", "2*F", "E"),
            (
                Target(ours + "gate_proj/kernel", ("X", "E", "F"), Steps(Part(0, 2, 1), SwapAxes(1, 2))),
                Target(ours + "up_proj/kernel", ("X", "E", "F"), Steps(Part(1, 2, 1), SwapAxes(1, 2))),
            ),
        ),
        R(
            "model.layers.{i}.mlp.experts.down_proj",
            ("X", "E", "F"),
            ours + "down_proj/kernel",
            ("X", "F", "E"),
            SwapAxes(1, 2),
        ),
    ]


def loader(config_class, model_class, table: Callable) -> _pretrained.Family:
    """_decoder.loader for a family whose experts come per expert (save_pretrained) or fused (a state_dict
    in memory): table(config, fused=...) is called with what the tensors hold. to_pretrained's writer is
    registered here, once, with the per-expert rows (HF's own save layout), so a model built in Python is
    writable before any load, and a fused load does not change what is written."""
    per_expert = _decoder.loader(config_class, model_class, functools.partial(table, fused=False))
    fused = _decoder.reader(config_class, model_class, functools.partial(table, fused=True))

    def load(config: dict, tensors, files, **options):
        is_fused = any(name.endswith(".mlp.experts.gate_up_proj") for name in tensors)
        return (fused if is_fused else per_expert.load)(config, tensors, files, **options)

    return _pretrained.Family(config_class, model_class, load)


def router_logits(intermediates: dict) -> list:
    """The routers' logits [B,T,X] of every MoE layer, in layer order, from a model's sown "intermediates"
    (model.apply(..., mutable=["intermediates"])[1]["intermediates"])."""
    rows = {name: value[0] for name, value in intermediates.items() if name.endswith(".router")}
    return [rows[name] for name in sorted(rows, key=lambda n: int(n.removeprefix("layer").split(".")[0]))]


def load_balancing_loss(logits: Sequence, num_experts: int, top_k: int, attention_mask=None):
    """HF's auxiliary load-balancing loss (Switch Transformer eq. 4-6, as transformers' Mixtral and gpt-oss
    compute it) from every layer's router logits [B,T,X]: X * sum_x f_x * P_x, where f_x is the share of
    top-k choices that go to expert x and P_x its mean softmax probability, both over every layer's real
    tokens (attention_mask [B,T], 1 = token; None: all)."""
    X = num_experts
    dtype = jnp.promote_types(jnp.result_type(*logits), jnp.float32)
    chosen, probability, rows = jnp.zeros(X, dtype), jnp.zeros(X, dtype), 0.0
    for layer in logits:
        p = jax.nn.softmax(jnp.asarray(layer, dtype), axis=-1)
        real = jnp.ones(p.shape[:-1], dtype) if attention_mask is None else jnp.asarray(attention_mask, dtype)
        _, index = jax.lax.top_k(p, top_k)
        chosen = chosen + jnp.einsum("...kx,...->x", jax.nn.one_hot(index, X, dtype=dtype), real)
        probability = probability + jnp.einsum("...x,...->x", p, real)
        rows = rows + jnp.sum(real)
    return X * jnp.sum((chosen / rows) * (probability / rows))
