"""`layer_report`: a whole model in PyTorch (transformers) against its jaxattn.models port, layer by layer.

Both run the same inputs; every aligned layer output is compared: the embeddings; each block's attention
output, router logits (mixtures of experts), MLP output and residual stream; the final norm; the logits. Rows
are in forward order, so
`first_divergent` is where a port first goes wrong (a wrong weight, a wrong formula), not merely that it is
wrong somewhere.

The comparison is crosscheck.certify's (layer_report is its client): only ONE model's activations are ever
held. The JAX side runs first and keeps its sown intermediates ("intermediates" collection, see
jaxattn/models/_decoder.py); the torch side is compared inside forward hooks, each activation reduced to
three numbers the moment it exists and then dropped.

float64: HF's RMS norms take their statistics in float32 even for float64 inputs; the float64 reference
lifts exactly that (crosscheck._hf.checkpoints.float64_reference), everything else is HF's code.

Padding: rows are compared on real tokens only (attention_mask == 1). A padded query's output has no
meaning (no key is allowed to it, or only padding is) and the frameworks differ there by design.

Pass/fail per row: float32 max abs <= 1e-5 (Hugging Face's bar for its Flax ports) on rows whose values
are O(1), scaled by the row's largest |value| when that exceeds 1 (float32 rounding grows with the
magnitude: a residual stream of size 50 carries ~5e-6 of it in either framework); float64 normwise <= 1e-12.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from crosscheck._certificates.certify import Bar, Verdict, certify
from crosscheck._hf.checkpoints import float64_reference

# dtype -> (metric, bar); "max_abs" is measured against bar * max(1, the row's largest |reference value|)
LAYER_TOLERANCES: Mapping[str, tuple[str, float]] = {"float32": ("max_abs", 1e-5), "float64": ("normwise", 1e-12)}


@dataclasses.dataclass(frozen=True)
class LayerRow:
    name: str  # "embeddings", "layer3.attention", "layer3.mlp", "layer3.residual", "final_norm", "logits"
    depth: int  # position in forward order (the plot's x axis)
    max_abs: float
    normwise: float
    scale: float  # the reference row's largest |value|
    metric: str  # which of the two the bar applies to
    tolerance: float

    @property
    def bar(self) -> float:
        return self.tolerance * max(1.0, self.scale) if self.metric == "max_abs" else self.tolerance

    @property
    def passed(self) -> bool:
        value = getattr(self, self.metric)
        return not math.isnan(value) and value <= self.bar

    @property
    def ratio(self) -> float:
        return getattr(self, self.metric) / self.bar


@dataclasses.dataclass(frozen=True)
class LayerReport(Verdict):
    model: str
    dtype: str
    rows: tuple[LayerRow, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "dtype": self.dtype,
            "passed": self.passed,
            "first_divergent": self.first_divergent,
            "rows": [{**dataclasses.asdict(r), "bar": r.bar, "passed": r.passed} for r in self.rows],
        }

    def __str__(self) -> str:
        metric, bar = LAYER_TOLERANCES[self.dtype]
        what = f"max abs <= {bar:.0e} * max(1, max |ref|)" if metric == "max_abs" else f"normwise <= {bar:.0e}"
        lines = [
            f"{self.model} [{self.dtype}]: {what} per layer, real tokens only",
            f"  {'layer':32} {'max |ref|':>10} {'max abs':>10} {'normwise':>10} {'bar':>9}  result",
        ]
        lines += [
            f"  {r.name:32} {r.scale:10.2e} {r.max_abs:10.2e} {r.normwise:10.2e} {r.bar:9.1e}  "
            f"{'ok' if r.passed else 'FAIL'}"
            for r in self.rows
        ]
        lines.append(f"  first divergent: {self.first_divergent}" if not self.passed else "  every layer passes")
        return "\n".join(lines)


# --- per family: which torch modules produce the aligned outputs --------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Family:
    embeddings: Callable[[Any], Any]  # torch model -> module whose output is the embeddings row
    layers: Callable[[Any], Any]  # torch model -> the blocks
    attention: str  # block attribute: attention sub-layer
    mlp: str | None  # block attribute: MLP sub-layer (None: fused with a norm)
    final_norm: Callable[[Any], Any] | None
    jax_layer: str  # our params' name of block i ("h_{i}")
    router: str | None = None  # block attribute path of an MoE router ("mlp.gate")

    def watch(self, torch_model) -> list[tuple[Any, str]]:
        """(module, row name) in forward order."""
        watched = [(self.embeddings(torch_model), "embeddings")]
        for i, block in enumerate(self.layers(torch_model)):
            watched.append((getattr(block, self.attention), f"layer{i}.attention"))
            if self.router is not None:
                watched.append((functools.reduce(getattr, self.router.split("."), block), f"layer{i}.router"))
            if self.mlp is not None:
                watched.append((getattr(block, self.mlp), f"layer{i}.mlp"))
            watched.append((block, f"layer{i}.residual"))
        if self.final_norm is not None:
            watched.append((self.final_norm(torch_model), "final_norm"))
        return watched


class _Llama4(_Family):
    """Llama 4: the block's MLP is "feed_forward"; only its MoE layers have a router, whose forward returns
    (scores, logits): the row is the logits (second)."""

    def watch(self, torch_model) -> list[tuple[Any, str]]:
        watched = []
        for module, name in super().watch(torch_model):
            watched.append((module, name))
            if name.endswith(".attention"):
                block = self.layers(torch_model)[int(name.removeprefix("layer").split(".")[0])]
                if block.is_moe_layer:
                    watched.append((_Second(block.feed_forward.router), name.replace(".attention", ".router")))
        return watched


class _Second:
    """The second element of the tuple a torch module returns: certify's path "<module path>[1]"."""

    def __init__(self, module):
        self.module = module


class _Qwen3Next(_Family):
    """Qwen3-Next: a block's token mixer is "linear_attn" (gated delta rule) or "self_attn" (gated softmax
    attention), per layer_types; only its MoE layers have a router ("mlp.gate", logits first)."""

    def watch(self, torch_model) -> list[tuple[Any, str]]:
        watched = [(self.embeddings(torch_model), "embeddings")]
        for i, block in enumerate(self.layers(torch_model)):
            mixer = block.linear_attn if hasattr(block, "linear_attn") else block.self_attn
            watched.append((mixer, f"layer{i}.attention"))
            if hasattr(block.mlp, "gate") and hasattr(block.mlp, "experts"):
                watched.append((block.mlp.gate, f"layer{i}.router"))
            watched += [(block.mlp, f"layer{i}.mlp"), (block, f"layer{i}.residual")]
        return [*watched, (self.final_norm(torch_model), "final_norm")]


class _T5(_Family):
    """T5: the encoder's rows ("encoder.*"), then the decoder's (with each block's cross-attention)."""

    def watch(self, torch_model) -> list[tuple[Any, str]]:
        watched = []
        for stack in ("encoder", "decoder"):
            watched.append((getattr(torch_model, stack).embed_tokens, f"{stack}.embeddings"))
            for i, block in enumerate(getattr(torch_model, stack).block):
                watched.append((block.layer[0].SelfAttention, f"{stack}.layer{i}.attention"))
                if stack == "decoder":
                    watched.append((block.layer[1].EncDecAttention, f"{stack}.layer{i}.cross_attention"))
                watched.append((block.layer[-1].DenseReluDense, f"{stack}.layer{i}.mlp"))
                watched.append((block, f"{stack}.layer{i}.residual"))
            watched.append((getattr(torch_model, stack).final_layer_norm, f"{stack}.final_norm"))
        return watched


class _DeepseekV3(_Family):
    """DeepSeek V3: a router row (mlp.gate's first output, the logits) on its MoE layers only."""

    def watch(self, torch_model) -> list[tuple[Any, str]]:
        watched = []
        for module, name in super().watch(torch_model):
            if name.endswith(".mlp"):
                gate = getattr(module, "gate", None)
                if gate is not None:
                    watched.append((gate, name.replace(".mlp", ".router")))
            watched.append((module, name))
        return watched


class _DebertaV2(_Family):
    """DeBERTa-v2: the encoder's rows; inside a head (masked LM, classifier) HF's encoder is `deberta` and ours
    sows under "deberta", so the rows are "deberta.*" there."""

    def watch(self, torch_model) -> list[tuple[Any, str]]:
        encoder = getattr(torch_model, "deberta", None)
        if encoder is None:
            return super().watch(torch_model)
        return [(module, f"deberta.{name}") for module, name in super().watch(encoder)]


class _Swin(_Family):
    """Swin: per stage, each block's attention (HF's windowed layout [B*nW, w*w, E], which ours is reshaped
    from), MLP and output, then the stage's PatchMerging; the final LayerNorm. SwinForImageClassification's
    rows carry our "swin." scope (its SwinModel's sown intermediates)."""

    def watch(self, torch_model) -> list[tuple[Any, str]]:
        classifier = hasattr(torch_model, "swin")
        swin, scope = (torch_model.swin, "swin.") if classifier else (torch_model, "")
        watched = [(swin.embeddings, f"{scope}embeddings")]
        for s, stage in enumerate(swin.encoder.layers):
            for b, block in enumerate(stage.blocks):
                name = f"{scope}stage{s}.block{b}"
                watched += [
                    (block.attention, f"{name}.attention"),
                    (block.mlp, f"{name}.mlp"),
                    (block, f"{name}.residual"),
                ]
            if stage.downsample is not None:
                watched.append((stage.downsample, f"{scope}stage{s}.downsample"))
        return [*watched, (swin.layernorm, f"{scope}final_norm")]


FAMILIES: dict[str, _Family] = {
    "gpt2": _Family(
        lambda m: m.transformer.drop, lambda m: m.transformer.h, "attn", "mlp", lambda m: m.transformer.ln_f, "h_{i}"
    ),
    "llama": _Family(
        lambda m: m.model.embed_tokens,
        lambda m: m.model.layers,
        "self_attn",
        "mlp",
        lambda m: m.model.norm,
        "layers_{i}",
    ),
    "bert": _Family(lambda m: m.embeddings, lambda m: m.encoder.layer, "attention", None, None, "layer_{i}"),
    "t5": _T5(None, None, "", None, None, "{stack}/block_{i}"),
}
for _model_type in ("qwen2", "mistral", "gemma2", "qwen3", "gemma3_text"):
    FAMILIES[_model_type] = FAMILIES["llama"]
FAMILIES["mixtral"] = FAMILIES["qwen3_moe"] = dataclasses.replace(FAMILIES["llama"], router="mlp.gate")
FAMILIES["gpt_oss"] = dataclasses.replace(FAMILIES["llama"], router="mlp.router")
FAMILIES["deepseek_v3"] = _DeepseekV3(
    lambda m: m.model.embed_tokens, lambda m: m.model.layers, "self_attn", "mlp", lambda m: m.model.norm, "layers_{i}"
)
FAMILIES["llama4_text"] = _Llama4(
    lambda m: m.model.embed_tokens,
    lambda m: m.model.layers,
    "self_attn",
    "feed_forward",
    lambda m: m.model.norm,
    "layers_{i}",
)
FAMILIES["deberta-v2"] = _DebertaV2(
    lambda m: m.embeddings, lambda m: m.encoder.layer, "attention", None, None, "layer_{i}"
)
FAMILIES["swin"] = _Swin(None, None, "", None, None, "")
FAMILIES["qwen3_next"] = _Qwen3Next(
    lambda m: m.model.embed_tokens, lambda m: m.model.layers, "", "mlp", lambda m: m.model.norm, "layers_{i}"
)


def family(torch_model) -> _Family:
    model_type = torch_model.config.model_type
    if model_type not in FAMILIES:
        raise ValueError(f"torch_model: expected a model_type among {sorted(FAMILIES)}, got {model_type!r}")
    return FAMILIES[model_type]


@functools.cache
def _jitted_apply(model, mutable: bool):
    import jax

    if mutable:
        return jax.jit(lambda params, inputs: model.apply({"params": params}, **inputs, mutable=["intermediates"]))
    return jax.jit(lambda params, inputs: model.apply({"params": params}, **inputs))


def _flat(tree, prefix="") -> dict[str, Any]:
    """Sown intermediates {"decoder": {"layer0.mlp": (x,)}} -> {"decoder.layer0.mlp": x}."""
    if isinstance(tree, tuple):
        return {prefix: tree[0]}
    return {k: v for name, sub in tree.items() for k, v in _flat(sub, f"{prefix}.{name}" if prefix else name).items()}


def _jax_rows(model, params, inputs) -> dict[str, np.ndarray]:
    """Our side's aligned outputs, by row name (BERT returns them; the others sow them)."""
    from jaxattn.models import BertModel

    if isinstance(model, BertModel):
        out = _jitted_apply(model, False)(params, inputs)
        rows = {"embeddings": out["hidden_states"][0]}
        for i, a in enumerate(out["attention_outputs"]):
            rows[f"layer{i}.attention"] = a
            rows[f"layer{i}.residual"] = out["hidden_states"][i + 1]
        return {k: np.asarray(v) for k, v in rows.items()}
    logits, state = _jitted_apply(model, True)(params, inputs)
    rows = {name: np.asarray(value) for name, value in _flat(state["intermediates"]).items()}
    if isinstance(logits, Mapping):  # a model without a head (DebertaV2Model, SwinModel): its sown rows only
        return rows
    return {**rows, "logits": np.asarray(logits)}


def _real_tokens(name: str, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
    """Which [B,T] positions of row `name` are real tokens (T5's decoder rows follow the decoder's mask)."""
    decoder = "decoder_input_ids" in inputs and (name.startswith("decoder.") or name == "logits")
    ids = inputs["decoder_input_ids" if decoder else "input_ids"]
    mask = inputs.get("decoder_attention_mask" if decoder else "attention_mask")
    return np.ones(ids.shape, bool) if mask is None else mask.astype(bool)


def _on_real_tokens(array: np.ndarray, real: np.ndarray) -> np.ndarray:
    """A [B,T,...] row's real tokens; of a per-sequence row [B,C] (a classifier's logits, pooled from the first
    token: DeBERTa's ContextPooler) the sequences whose first token is real (left padding: a padded query)."""
    return array[real] if array.shape[: real.ndim] == real.shape else array[real[:, 0]]


def _to_layout(shape: tuple[int, ...]) -> Callable[[np.ndarray], np.ndarray]:
    """HF's routers see tokens as [B*T, E]: ours keep [B,T,E]."""
    return lambda theirs: theirs.reshape(shape) if theirs.shape != shape and theirs.shape[-1:] == shape[-1:] else theirs


def _floating_as(x: np.ndarray, dtype: str) -> np.ndarray:
    """x cast to dtype if floating (bf16 included); packed quantized params (gpt-oss's MXFP4 kernel_blocks and
    kernel_scales, uint8) and kept FP8 kernels (kernel_fp8, float8_e4m3fn: 1 byte a value) as they are."""
    import jax.numpy as jnp

    return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > 1 else x


def layer_report(torch_model, model_and_params, inputs: Mapping[str, Any], *, dtype: str) -> LayerReport:
    """Compare every aligned layer of `torch_model` (a transformers model) and (model, params) (its port).

    inputs: {"input_ids": int [B,T], "attention_mask": [B,T] (optional)} as numpy arrays, or an image model's
    {"pixel_values": [B,C,height,width]} (every position compared; cast to dtype). dtype: "float32"
    or "float64"; both sides are cast to it (the torch model in place, our params by an explicit astype).
    A client of crosscheck.certify: the family's watched modules become its `layers` pairs, our sown
    intermediates its JAX side, real tokens its `select`, LAYER_TOLERANCES its bar.
    """
    import jax
    import torch

    if dtype not in LAYER_TOLERANCES:
        raise ValueError(f"dtype: expected one of {sorted(LAYER_TOLERANCES)}, got {dtype!r}")
    model, params = model_and_params
    spec = family(torch_model)
    metric, bar = LAYER_TOLERANCES[dtype]
    params = jax.tree.map(lambda x: _floating_as(np.asarray(x), dtype), params)
    inputs = {k: np.asarray(v) for k, v in inputs.items()}
    inputs = {k: v.astype(dtype) if np.issubdtype(v.dtype, np.floating) else v for k, v in inputs.items()}
    ours = _jax_rows(model, params, inputs)
    logits = {"logits": ours.pop("logits")} if "logits" in ours else {}
    paths = {id(module): path for path, module in torch_model.named_modules()}
    pairs = [
        (
            paths[id(module.module)] + "[1]" if isinstance(module, _Second) else paths[id(module)],
            name,
            _to_layout(ours[name].shape),
        )
        for module, name in spec.watch(torch_model)
    ]

    def torch_fn(**tensors):
        with float64_reference(torch_model, dtype):  # token ids as int64; pixel_values as they come (dtype)
            out = torch_model(**{k: t if t.is_floating_point() else t.long() for k, t in tensors.items()})
        return {"logits": out.logits} if logits else {}

    torch_model.to(getattr(torch, dtype)).eval()
    cert = certify(
        torch_fn,
        lambda **_: (logits, ours),
        inputs,
        dtype=dtype,
        layers=pairs,
        logits=False,
        bar=Bar(metric, bar, scaled=metric == "max_abs"),
        torch_module=torch_model,
        select=None
        if "input_ids" not in inputs
        else lambda name, array: _on_real_tokens(array, _real_tokens(name, inputs)),
    )
    rows = [
        LayerRow(r.jax_name, depth, r.max_abs, r.normwise, r.scale, metric, bar) for depth, r in enumerate(cert.rows)
    ]
    return LayerReport(torch_model.config.model_type, dtype, tuple(rows))
