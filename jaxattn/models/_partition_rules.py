"""Partition rules: which PartitionSpec each parameter of a family gets on a device mesh.

    model, params = from_pretrained(path, mesh=mesh)            # mesh axes "data" and/or "model"
    model, params = from_pretrained(path, mesh=mesh, rules=[("*/self_attn/key/kernel", P("data"))])

One table per family, (pattern, PartitionSpec) rows over the params path ("layers_0/self_attn/
query/kernel"; fnmatch patterns, "*" crosses "/"), the first match wins, the last row "*" replicates.
`rules=` rows go in front of the family's. Parameters are sharded over "data" (FSDP: XLA gathers a
weight over "data" where it is used) and attention heads / MLP columns over "model" (tensor parallel:
column-parallel q/k/v and gate/up, row-parallel out and down, whose partial sums XLA all-reduces over
"model"). A default row that names an axis the mesh lacks leaves that dim unsplit (a mesh with "data"
only is pure FSDP); a `rules=` row must name existing axes. Every spec is checked against its leaf: its
axes exist, none twice, and each splits its dim evenly, else ValueError naming the parameter, the spec
and the shape. Mixture-of-experts weights stacked [X, ...] per layer split X over "model" by default
(MOE_RULES); a separate expert axis is one `rules=` row away: ("*/experts/*/kernel", P("expert", ...)).

The loader that reads each shard's bytes is _lazy_checkpoint.py; the activations' layout on the mesh and
sequence parallelism are _activation_layout.py.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from collections.abc import Mapping

from jax.sharding import Mesh, PartitionSpec as P

from .._core import checks

# --- the rules, per family ----------------------------------------------------------------------------------

# Llama-shaped decoders (llama, qwen2, mistral, gemma2, qwen3, gemma3_text). Kernels: q/k/v [E,N|K,H],
# out [N,H,E], gate/up [E,F], down [F,E], lm_head [E,V]; embeddings [V,E] split by vocabulary over "model"
# (XLA looks tokens up in each device's rows and all-reduces), so a head tied to them is column-parallel too.
DECODER_RULES = (
    ("embed_tokens/embedding", P("model", "data")),
    ("*/self_attn/query/kernel", P("data", "model", None)),
    ("*/self_attn/key/kernel", P("data", "model", None)),
    ("*/self_attn/value/kernel", P("data", "model", None)),
    ("*/self_attn/out/kernel", P("model", None, "data")),
    ("*/self_attn/query/bias", P("model", None)),
    ("*/self_attn/key/bias", P("model", None)),
    ("*/self_attn/value/bias", P("model", None)),
    ("*/gate_proj/kernel", P("data", "model")),
    ("*/up_proj/kernel", P("data", "model")),
    ("*/down_proj/kernel", P("model", "data")),
    ("*/gate_proj/bias", P("model")),
    ("*/up_proj/bias", P("model")),
    ("lm_head/kernel", P("data", "model")),
    # kept block-FP8 kernels (Qwen 3's FP8 releases): the checkpoint's [out, in], split as the kernel's
    # transpose; their scales (a [ceil(out / 128), ceil(in / 128)] grid) whole on every device, as "*" says
    ("*/self_attn/query/kernel_fp8", P("model", "data")),
    ("*/self_attn/key/kernel_fp8", P("model", "data")),
    ("*/self_attn/value/kernel_fp8", P("model", "data")),
    ("*/self_attn/out/kernel_fp8", P("data", "model")),
    ("*/gate_proj/kernel_fp8", P("model", "data")),
    ("*/up_proj/kernel_fp8", P("model", "data")),
    ("*/down_proj/kernel_fp8", P("data", "model")),
    ("*", P()),
)

# GPT-2: attention as above; c_fc [E,F] column-, c_proj [F,E] row-parallel. Its vocabulary (50257) and
# positions split by nothing: wte/wpe [V|P,E] are FSDP over E only.
GPT2_RULES = (
    ("wte/embedding", P(None, "data")),
    ("wpe/embedding", P(None, "data")),
    ("*/attn/query/kernel", P("data", "model", None)),
    ("*/attn/key/kernel", P("data", "model", None)),
    ("*/attn/value/kernel", P("data", "model", None)),
    ("*/attn/out/kernel", P("model", None, "data")),
    ("*/attn/query/bias", P("model", None)),
    ("*/attn/key/bias", P("model", None)),
    ("*/attn/value/bias", P("model", None)),
    ("*/c_fc/kernel", P("data", "model")),
    ("*/c_fc/bias", P("model")),
    ("*/c_proj/kernel", P("model", "data")),
    ("lm_head/kernel", P("data", "model")),
    ("*", P()),
)

# T5: both stacks' self- and cross-attention, the FF (wi, or gated wi_0/wi_1, then wo), the shared
# embeddings by vocabulary, each stack's relative table [R,N] by heads.
T5_RULES = (
    ("shared/embedding", P("model", "data")),
    ("*/relative_attention_bias", P(None, "model")),
    ("*_attention/query/kernel", P("data", "model", None)),
    ("*_attention/key/kernel", P("data", "model", None)),
    ("*_attention/value/kernel", P("data", "model", None)),
    ("*_attention/out/kernel", P("model", None, "data")),
    ("*/ff/wi*/kernel", P("data", "model")),
    ("*/ff/wo/kernel", P("model", "data")),
    ("lm_head/kernel", P("data", "model")),
    ("*", P()),
)

# BERT: the encoder's attention, intermediate [E,F] column- and output [F,E] row-parallel; embeddings
# FSDP over E (BERT's vocabulary, 30522, splits by 2 only).
BERT_RULES = (
    ("embeddings/*/embedding", P(None, "data")),
    ("*/attention/query/kernel", P("data", "model", None)),
    ("*/attention/key/kernel", P("data", "model", None)),
    ("*/attention/value/kernel", P("data", "model", None)),
    ("*/attention/out/kernel", P("model", None, "data")),
    ("*/attention/query/bias", P("model", None)),
    ("*/attention/key/bias", P("model", None)),
    ("*/attention/value/bias", P("model", None)),
    ("*/intermediate/kernel", P("data", "model")),
    ("*/intermediate/bias", P("model")),
    ("*/output/kernel", P("model", "data")),
    ("pooler/kernel", P("data", None)),
    ("*", P()),
)

# DeBERTa-v2/v3 (jaxattn.models.deberta_v2): BERT's layout for the encoder (under "deberta/" in the heads);
# pos_key / pos_query [E,N,H] by head as key / query; the relative embeddings [R,E] and the heads' dense
# layers FSDP over E; the MLM bias [V] and the classifier replicated.
DEBERTA_V2_RULES = (
    ("*embed/*/embedding", P(None, "data")),
    ("*/attention/pos_key/kernel", P("data", "model", None)),
    ("*/attention/pos_query/kernel", P("data", "model", None)),
    ("*/attention/pos_key/bias", P("model", None)),
    ("*/attention/pos_query/bias", P("model", None)),
    ("*rel_embeddings", P(None, "data")),
    ("lm_dense/kernel", P("data", None)),
    *BERT_RULES[1:],
)
# Mixture-of-experts decoders (mixtral, qwen3_moe, gpt_oss; jaxattn.models.moe): the Llama rows for attention,
# embeddings and head, after the experts' rows (which must come first: "*/gate_proj/kernel" would match the
# 3-D expert kernels). Expert kernels gate/up [X,E,F] and down [X,F,E] are split by expert over "model"
# (expert parallel: each device runs its experts on every token, the dense dispatch's weighted sum over X
# is the all-reduce over "model"), FSDP over E; the expert biases [X,F]/[X,E] by expert; the router [E,X]
# FSDP over E, X whole (every device needs every expert's logit for the top k); gpt-oss's sinks [N] by head.
# X must divide by the "model" axis' size (8 for Mixtral, 32 or 128 for gpt-oss, 128 for Qwen3-MoE).
MOE_RULES = (
    ("*/mlp/experts/gate_proj/kernel", P("model", "data", None)),
    ("*/mlp/experts/up_proj/kernel", P("model", "data", None)),
    ("*/mlp/experts/down_proj/kernel", P("model", None, "data")),
    ("*/mlp/experts/*/bias", P("model", None)),
    ("*/mlp/experts/*/kernel_blocks", P("model", None, None, None)),  # gpt-oss's packed MXFP4: by expert
    ("*/mlp/experts/*/kernel_scales", P("model", None, None)),
    ("*/mlp/experts/*/kernel_fp8", P("model", None, None)),  # Qwen3-MoE's kept block FP8 [X,out,in]: by expert
    ("*/mlp/experts/*/kernel_scale_inv", P("model", None, None)),
    ("*/mlp/router/kernel", P("data", None)),
    ("*/self_attn/sinks", P("model")),
    *DECODER_RULES,
)

# DeepSeek V3 (jaxattn.models.deepseek_v3): MLA's per-head kernels by head over "model" (query or query_up
# [E|Cq,N,Hq], key_value_up [C,N,Hn+Hv] column-parallel, out [N,Hv,E] row-parallel: MOE_RULES' Llama rows), its
# down projections to the latents (query_down [E,Cq], latent_and_key_rope [E,C+R]) FSDP only (every head reads
# the whole latent), the norms and the router's score-correction bias [X] replicated; experts, router and the
# shared experts' and dense layers' SwiGLU as MOE_RULES. Kept block FP8: each kernel_fp8 [out, in] as its kernel's
# transpose (the heads' rows of q_b_proj / kv_b_proj over "model"), the scales whole (MOE_RULES' rows for o_proj,
# q_proj, the SwiGLUs and the experts).
DEEPSEEK_RULES = (
    ("*/self_attn/query_up/kernel", P(None, "model", None)),
    ("*/self_attn/key_value_up/kernel", P("data", "model", None)),
    ("*/self_attn/query_down/kernel", P("data", None)),
    ("*/self_attn/latent_and_key_rope/kernel", P("data", None)),
    ("*/self_attn/query_up/kernel_fp8", P("model", None)),
    ("*/self_attn/key_value_up/kernel_fp8", P("model", "data")),
    ("*/self_attn/query_down/kernel_fp8", P(None, "data")),
    ("*/self_attn/latent_and_key_rope/kernel_fp8", P(None, "data")),
    *MOE_RULES,
)

# Qwen3-Next: its gated attention's q_proj [E,N,2H] (query and gate per head), k/v [E,K,H] and o_proj [N,H,E] by
# heads as Llama's; the linear layers' fused projections [E,J,...] by key head, out_proj [M,D,E], A_log [M] and
# dt_bias [M] by value head and the conv [C,W] by channel (where XLA's propagation puts them in the train step:
# replicated, they would come out of it laid out otherwise); norms replicated; the shared expert's gate [E,1]
# FSDP; experts as MOE_RULES.
QWEN3_NEXT_RULES = (
    ("*/self_attn/q_proj/kernel", P("data", "model", None)),
    ("*/self_attn/k_proj/kernel", P("data", "model", None)),
    ("*/self_attn/v_proj/kernel", P("data", "model", None)),
    ("*/self_attn/o_proj/kernel", P("model", None, "data")),
    ("*/linear_attn/in_proj_qkvz/kernel", P("data", "model", None)),
    ("*/linear_attn/in_proj_ba/kernel", P("data", "model", None)),
    ("*/linear_attn/out_proj/kernel", P("model", None, "data")),
    ("*/linear_attn/A_log", P("model")),
    ("*/linear_attn/dt_bias", P("model")),
    ("*/linear_attn/conv_weight", P("model", None)),
    ("*/mlp/shared_expert_gate/kernel", P("data", None)),
    *MOE_RULES,
)

# Swin (jaxattn.models.swin): data parallel (the batch over "data", ModelSharding's) with the MLPs tensor parallel,
# fc1 [E,F] column- and fc2 [F,E] row-parallel over "model" (F = 4E in every released Swin). The attention stays
# replicated: the stages' head counts (3, 6, 12, 24 in swin-tiny) split evenly over no one "model" size, and a
# window's attention is small next to its MLP. Weights are not FSDP'd: the largest Swin has 197M parameters.
SWIN_RULES = (
    ("*/fc1/kernel", P(None, "model")),
    ("*/fc1/bias", P("model")),
    ("*/fc2/kernel", P("model", None)),
    ("*", P()),
)

# qwen3 and gemma3_text are Llama-shaped: their q_norm/k_norm weights [H] fall to "*" (replicated).
FAMILY_RULES = {
    "llama": DECODER_RULES,
    "qwen2": DECODER_RULES,
    "mistral": DECODER_RULES,
    "gemma2": DECODER_RULES,
    "qwen3": DECODER_RULES,
    "gemma3_text": DECODER_RULES,
    "mixtral": MOE_RULES,
    "qwen3_moe": MOE_RULES,
    "gpt_oss": MOE_RULES,
    "llama4_text": MOE_RULES,
    "deepseek_v3": DEEPSEEK_RULES,
    "qwen3_next": QWEN3_NEXT_RULES,
    "gpt2": GPT2_RULES,
    "t5": T5_RULES,
    "bert": BERT_RULES,
    "deberta-v2": DEBERTA_V2_RULES,
    "swin": SWIN_RULES,
}


def partition_rules(model_type: str) -> tuple:
    """The family's default rules: ((pattern over the params path, PartitionSpec), ...), first match wins."""
    if model_type not in FAMILY_RULES:
        checks.fail("model_type", f"one of {sorted(FAMILY_RULES)}", repr(model_type))
    return FAMILY_RULES[model_type]


def _axes(entry) -> tuple:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _only_axes_of(spec: P, mesh: Mesh) -> P:
    """A default spec with the axes `mesh` lacks dropped (their dims unsplit)."""
    kept = [tuple(a for a in _axes(e) if a in mesh.axis_names) for e in spec]
    return P(*(None if not k else k[0] if len(k) == 1 else k for k in kept))


@dataclasses.dataclass(frozen=True)
class Rules:
    """The rows a load uses: the user's first (checked strictly), then the family's (axes the mesh lacks
    dropped)."""

    mesh: Mesh
    user: tuple
    family: tuple

    @classmethod
    def of(cls, model_type: str, mesh: Mesh, rules=None) -> Rules:
        checks.check_mesh(mesh)
        user = tuple((rules.items() if isinstance(rules, Mapping) else rules) or ())
        for k, r in enumerate(user):
            if not (isinstance(r, tuple) and len(r) == 2 and isinstance(r[0], str) and isinstance(r[1], P)):
                checks.fail(f"rules[{k}]", "a (pattern str, PartitionSpec) pair", repr(r))
            for axis in (a for e in r[1] for a in _axes(e)):
                if axis not in mesh.axis_names:
                    checks.fail(
                        f"rules[{k}] ({r[0]!r}: {r[1]})", f"axes of the mesh {list(mesh.axis_names)}", f"axis {axis!r}"
                    )
        family = tuple((pattern, _only_axes_of(spec, mesh)) for pattern, spec in partition_rules(model_type))
        return cls(mesh, user, family)

    def spec(self, path: str, shape: tuple[int, ...]) -> P:
        """The first matching row's spec for the leaf at `path`, checked against its shape."""
        spec = next(s for pattern, s in (*self.user, *self.family) if fnmatch.fnmatchcase(path, pattern))
        check_spec(path, spec, shape, self.mesh)
        return spec


def check_spec(path: str, spec: P, shape, mesh: Mesh) -> None:
    """ValueError naming the parameter, the spec and the shape unless `spec` lays `shape` out on `mesh`:
    rank, axes that exist (each once) and dims divisible by their axes' sizes."""
    where = f"{path} (spec {spec}, shape {checks.shape_str(shape)})"
    if len(spec) > len(shape):
        checks.fail(where, f"at most {len(shape)} entries (one per dim)", f"{len(spec)}")
    used = [a for e in spec for a in _axes(e)]
    for axis in used:
        if axis not in mesh.axis_names:
            checks.fail(where, f"axes of the mesh {list(mesh.axis_names)}", f"axis {axis!r}")
    if len(set(used)) != len(used):
        checks.fail(where, "each mesh axis at most once", f"axes {used}")
    for dim, (d, e) in enumerate(zip(shape, spec)):
        parts = math.prod(mesh.shape[a] for a in _axes(e))
        if d % parts:
            checks.fail(
                where,
                f"dim {dim} ({d}) divisible by {parts} (mesh axes {list(_axes(e))})",
                f"{d} % {parts} = {d % parts}",
            )
