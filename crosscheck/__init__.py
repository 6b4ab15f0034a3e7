"""crosscheck: torch attention weights and masks -> jaxattn, and proof that both frameworks agree.

Weights (one explicit mapping table, exact key sets, every shape checked, dtypes kept)::

    params = params_from_torch(module)                       # torch.nn.MultiheadAttention / torchref modules
    params = params_from_torch(load_state_dict("w.safetensors"), num_heads=8)   # a bare state_dict
    options = call_options_from_torch(module)                # e.g. {"add_zero_attn": True}
    out = jaxattn.multi_head_attention(params, q, k, v, mask=mask, bias=bias, **options)
    module.load_state_dict(params_to_torch(params, format="torch"), strict=True)   # and back

Masks (torch's conventions differ from jaxattn's True = may attend; torch's is_causal is top-left aligned)::

    mask, bias = masks_from_torch(attn_mask, key_padding_mask, num_heads=N)   # nn.MultiheadAttention's
    mask, bias = sdpa_masks_from_torch(attn_mask, is_causal=..., query_length=T, key_length=S)   # SDPA's

Proof (one tolerance table keyed by dtype; forward outputs and gradients, plain / jit / vmap)::

    report = compare(jax_fn, torch_fn, {"x": x}, dtype="float64", transform="jit")   # Report: per-output metrics
    assert_equivalent(jax_fn, torch_fn, {"x": x}, dtype="float32")                  # AssertionError if not
    python -m crosscheck [--case GLOB] [--all] [--dtype float32|float64] [--transform plain|jit|vmap] [--json [PATH]]
                                                             # default: every case once; --all: every row

The catalogue those runs draw from (crosscheck.catalogue: CASES, register_case, Setup, Const, run_case and the
seeded helpers a case author needs)::

    from crosscheck.catalogue import Const, Setup, register_case, rng_for, run_case
    @register_case("my_case")
    def _my_case() -> Setup: ...                             # seeded inputs; Const(x): not differentiated
    report = run_case("my_case", dtype="float64", transform="jit")

Whole models (transformers checkpoints against jaxattn.models, layer by layer)::

    report = layer_report(torch_model, (model, params), {"input_ids": ids, "attention_mask": m}, dtype="float64")
    report.first_divergent                                   # None, or e.g. "layer3.mlp"
    python -m crosscheck --model DIR [--plot FILE.png] [--json FILE]
    write_random_checkpoint("gpt2", "dir")                   # tiny, seeded, every parameter random

Any PyTorch model against any JAX port (outputs, layers by forward hooks, logits KL / top-k, gradients)::

    cert = certify(torch_model, jax_fn, {"input_ids": ids}, dtype="float32", layers={"model.norm": "norm"})
    cert.passed; cert.first_divergent; cert.to_json(); cert.plot("drift.png"); print(cert.table())
    record(torch_model, {"input_ids": ids}, "golden.safetensors", layers=...)   # torch's side, once
    certify(None, jax_fn, None, golden="golden.safetensors", layers=...)       # then without torch
    python -m crosscheck certify --torch MODULE:FACTORY --jax MODULE:FACTORY [--record PATH | --golden PATH]

Training runs (torch.optim + a torch loop against optax + one jit step, step by step; needs optax)::

    report = train_report(torch_model, model, params, batches, steps=100, optimizer=torch_optimizer,
                          scheduler=scheduler, max_grad_norm=1.0, dtype="float64")
    report.first_divergent                                   # None, or {"step": 7, "parameter": "...", ...}
    tx = optax_from_torch(torch_optimizer, torch_model, params, scheduler=scheduler, max_grad_norm=1.0)
    python -m crosscheck --model DIR --train STEPS [--optimizer adamw] [--lr 1e-3] [--plot FILE.png] [--json FILE]

Files: ``load_state_dict(path)`` reads ``.safetensors`` without torch and ``.pt``/``.pth``/``.bin`` only via
``torch.load(weights_only=True)``. Axis letters (B, T, S, N, K, H, Hv, E, R): docs/design.md, "Axis letters".

torch is imported lazily, only where a torch object or a pickle file is involved: keep it that way in every
module imported here, so that the safetensors -> jaxattn route works on a machine without torch.
"""

from crosscheck import catalogue as catalogue  # the cases: CASES, register_case, Setup, Const, run_case...
from crosscheck._certificates.certify import (
    LOGIT_BARS as LOGIT_BARS,
    Bar as Bar,
    Certificate as Certificate,
    LogitBars as LogitBars,
    certify as certify,
)
from crosscheck._certificates.golden import record as record
from crosscheck._certificates.param_grads import parameter_map as parameter_map
from crosscheck._certificates.propose import LayerProposal as LayerProposal, propose_layers as propose_layers
from crosscheck._certificates.reference import checkpoint_hash as checkpoint_hash
from crosscheck._comparison.compare import (
    MODEL_TOLERANCES as MODEL_TOLERANCES,
    TOLERANCES as TOLERANCES,
    Metric as Metric,
    Report as Report,
    Tolerance as Tolerance,
    assert_equivalent as assert_equivalent,
    compare as compare,
    error_metrics as error_metrics,
)
from crosscheck._conversion.files import SUPPORTED_SUFFIXES as SUPPORTED_SUFFIXES, load_state_dict as load_state_dict
from crosscheck._conversion.masks import (
    masks_from_torch as masks_from_torch,
    sdpa_masks_from_torch as sdpa_masks_from_torch,
)
from crosscheck._conversion.weights import (
    call_options_from_torch as call_options_from_torch,
    params_from_torch as params_from_torch,
    params_to_torch as params_to_torch,
)
from crosscheck._hf.checkpoints import write_checkpoint as write_random_checkpoint
from crosscheck._hf.layer_report import LayerReport as LayerReport, layer_report as layer_report
from crosscheck._training.optim import (
    clip_grad_norm_torch as clip_grad_norm_torch,
    optax_from_torch as optax_from_torch,
)
from crosscheck._training.train_report import (
    TRAIN_TOLERANCES as TRAIN_TOLERANCES,
    TrainReport as TrainReport,
    TrainStep as TrainStep,
    train_report as train_report,
)

__all__ = [
    "LOGIT_BARS",
    "Bar",
    "Certificate",
    "LogitBars",
    "certify",
    "checkpoint_hash",
    "record",
    "LayerProposal",
    "parameter_map",
    "propose_layers",
    "MODEL_TOLERANCES",
    "TOLERANCES",
    "Metric",
    "Report",
    "Tolerance",
    "assert_equivalent",
    "catalogue",
    "compare",
    "error_metrics",
    "LayerReport",
    "layer_report",
    "write_random_checkpoint",
    "SUPPORTED_SUFFIXES",
    "call_options_from_torch",
    "load_state_dict",
    "masks_from_torch",
    "params_from_torch",
    "params_to_torch",
    "sdpa_masks_from_torch",
    "TRAIN_TOLERANCES",
    "TrainReport",
    "TrainStep",
    "clip_grad_norm_torch",
    "optax_from_torch",
    "train_report",
]
