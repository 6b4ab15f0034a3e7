"""crosscheck cases of programmable attention (issue 11), each against code nobody here wrote or against torchref.

* ``flex_<pattern>``: ``jaxattn.flex_attention`` called as torch users call theirs (the score_mod, and the
  mask_mod only inside ``create_block_mask``'s BlockMask: ``flex_attention(q, k, v, score_mod, block_mask)``)
  against torch's eager ``flex_attention`` making the same call (crosscheck._comparison.flex_reference's
  flex_reference converts row indices explicitly). Forward only: torch has no CPU backward for flex. The
  ``mask_mod=`` keyword is proven by the ``_keywords`` and ``_blockwise`` cases (and tests/test_block_mask.py:
  block_mask alone == mask_mod).
* ``flex_<pattern>_keywords``: the same pattern through dot_product_attention's first-class keywords (segments,
  window, chunk_size, logit_softcap, masks, biases), forward and gradients against torchref.flex_attention
  running the mods.
* ``flex_<pattern>_blockwise``: flex_attention on the blockwise engine (small tiles, mask_mod per tile, the
  custom VJP), forward and gradients against torchref.flex_attention.
* ``hf_modern_<family>``: every eager attention call of a tiny random Gemma 2 / Mistral / gpt-oss / Llama 4 /
  Qwen2 model (a prefill, then tokens on the cache), recorded with crosscheck._hf.attention, against
  dot_product_attention with the mapped keywords; gradients through HF's own eager function.

Patterns with ``_cache`` have T < S: a cache precedes the queries, positions are bottom-right.
"""

from __future__ import annotations

import numpy as np

from crosscheck._comparison.flex_reference import FLEX_CASES, flex_reference
from crosscheck.catalogue import FLOAT32_JIT, FLOAT64_PLAIN, Setup, register_case

_HF = ("transformers",)
B, N, K, H, Hv = 2, 6, 3, 8, 5
REFERENCE_NOTE = (
    "flex_<pattern> cases: the reference is torch's eager flex_attention (exact, unfused; slower "
    "than torch.compile'd flex, whose advice to compile it is silenced)"
)


class _ForwardSetup(Setup):
    """A Setup compared on outputs only (torch's flex_attention has no CPU backward pass)."""

    def compare(self, **kwargs):
        return super().compare(grad=False, **kwargs)


def _inputs(case, seed):
    rng = np.random.default_rng(seed)
    arrays = case.arrays(rng, (B,), N)
    inputs = {
        "query": rng.standard_normal((B, case.T, N, H)),
        "key": rng.standard_normal((B, case.S, K, H)),
        "value": rng.standard_normal((B, case.S, K, Hv)),
    }
    return inputs, arrays


def _cast(xp, arrays, like):
    """The case's arrays for one side: floats in the run's dtype (a score_mod keeps the score's dtype)."""
    out = {}
    for name, a in arrays.items():
        if xp.__name__ == "torch":
            t = xp.from_numpy(np.asarray(a))
            out[name] = t.to(like.dtype) if t.is_floating_point() else t
        else:
            out[name] = xp.asarray(a, like.dtype) if np.issubdtype(np.asarray(a).dtype, np.floating) else xp.asarray(a)
    return out


def _jax_flex(case, arrays, **options):
    def jax_fn(query, key, value):
        import jax.numpy as jnp

        import jaxattn

        score_mod, mask_mod = case.mods(jnp, _cast(jnp, arrays, query))
        return jaxattn.flex_attention(query, key, value, score_mod=score_mod, mask_mod=mask_mod, **options)

    return jax_fn


def _torchref_flex(case, arrays):
    def torch_fn(query, key, value):
        import torch

        import torchref

        score_mod, mask_mod = case.mods(torch, _cast(torch, arrays, query))
        return torchref.flex_attention(query, key, value, score_mod=score_mod, mask_mod=mask_mod)

    return torch_fn


def _torch_style_flex(case, arrays):
    """The call as a torch user writes it: the mask only inside a BlockMask (torch's flex_attention has no
    mask_mod argument), flex_attention(q, k, v, score_mod, block_mask=create_block_mask(mask_mod, B, N, T, S))."""

    def jax_fn(query, key, value):
        import jax.numpy as jnp

        import jaxattn

        score_mod, mask_mod = case.mods(jnp, _cast(jnp, arrays, query))
        block_mask = (
            None
            if mask_mod is None
            else jaxattn.create_block_mask(mask_mod, B=query.shape[0], H=N, Q_LEN=query.shape[-3], KV_LEN=key.shape[-3])
        )
        return jaxattn.flex_attention(query, key, value, score_mod, block_mask)

    return jax_fn


def _flex_vs_torch(case):
    inputs, arrays = _inputs(case, 11)

    def torch_fn(query, key, value):
        import torch

        score_mod, mask_mod = case.mods(torch, _cast(torch, arrays, query))
        return flex_reference(query, key, value, score_mod=score_mod, mask_mod=mask_mod)

    return _ForwardSetup(_torch_style_flex(case, arrays), torch_fn, inputs)


def _keywords_vs_torchref(case):
    inputs, arrays = _inputs(case, 12)

    def jax_fn(query, key, value):
        import jax.numpy as jnp

        import jaxattn

        return jaxattn.dot_product_attention(query, key, value, **case.keywords(jnp, _cast(jnp, arrays, query)))

    return Setup(jax_fn, _torchref_flex(case, arrays), inputs)


def _blockwise_vs_torchref(case):
    inputs, arrays = _inputs(case, 13)
    jax_fn = _jax_flex(case, arrays, implementation="blockwise", block_size=(2, 3))
    return Setup(jax_fn, _torchref_flex(case, arrays), inputs)


for _name, _case in FLEX_CASES.items():
    _quick_proof = _name == "documents_sliding_softcap"  # three keywords at once, vs torch's flex and torchref
    register_case(
        f"flex_{_name}",
        quick=FLOAT32_JIT,
        note=REFERENCE_NOTE,
        default_run=_quick_proof,
        description=f"flex_attention(q, k, v, score_mod, block_mask) vs torch's eager call (forward), "
        f"{_name}, "
        f"T={_case.T} S={_case.S}",
    )(lambda c=_case: _flex_vs_torch(c))
    register_case(
        f"flex_{_name}_keywords",
        quick=FLOAT64_PLAIN,
        default_run=_quick_proof,
        description=f"dot_product_attention keywords vs torchref.flex_attention mods (and gradients), {_name}",
    )(lambda c=_case: _keywords_vs_torchref(c))
    register_case(
        f"flex_{_name}_blockwise",
        description=f"flex_attention on the blockwise engine vs torchref.flex_attention (and gradients), {_name}",
    )(lambda c=_case: _blockwise_vs_torchref(c))


# ---------------------------------------------------------------------------------------------------------
# Hugging Face attention of today's models


def _hf_family(family: str) -> Setup:
    """Every recorded attention call of the family: outputs and gradients, one entry per call."""
    import torch

    from crosscheck._hf.attention import record_attention

    calls = record_attention(family, dtype=torch.float64)
    # each module's float64 parameters (gpt-oss sinks...), restored before every run: a float32 run casts
    # the module, and the float64 run after it must not see rounded values
    originals = [{n: p.detach().clone() for n, p in call.rerun.module.named_parameters()} for call in calls]
    inputs, fixed = {}, []
    for i, call in enumerate(calls):
        for part in ("query", "key", "value"):
            inputs[f"{part}{i}"] = getattr(call, part).numpy()
        fixed.append({k: v.detach().numpy() if isinstance(v, torch.Tensor) else v for k, v in call.keywords.items()})

    def jax_keywords(kw, like):
        import jax.numpy as jnp

        out = {}
        for name, value in kw.items():
            if isinstance(value, np.ndarray):
                floating = np.issubdtype(value.dtype, np.floating)
                value = jnp.asarray(value, like.dtype) if floating else jnp.asarray(value)
            out[name] = value
        return out

    def jax_fn(**arrays):
        import jaxattn

        return {
            f"call{i}": jaxattn.dot_product_attention(
                arrays[f"query{i}"], arrays[f"key{i}"], arrays[f"value{i}"], **jax_keywords(kw, arrays[f"query{i}"])
            )
            for i, kw in enumerate(fixed)
        }

    def torch_fn(**arrays):
        outs = {}
        for i, call in enumerate(calls):
            module = call.rerun.module.to(arrays[f"query{i}"].dtype)
            with torch.no_grad():
                for name, param in module.named_parameters():
                    param.copy_(originals[i][name].to(param.dtype))
            outs[f"call{i}"] = call.rerun(arrays[f"query{i}"], arrays[f"key{i}"], arrays[f"value{i}"])
        return outs

    return Setup(jax_fn, torch_fn, inputs)


for _family in ("gemma2", "mistral", "gpt_oss", "llama4", "qwen2", "qwen2_sliding"):
    register_case(
        f"hf_modern_{_family}",
        requires=_HF,
        quick=FLOAT32_JIT,
        description=f"HF {_family} eager attention (prefill + cache steps) vs dot_product_attention "
        "with the mapped keywords, outputs and gradients",
    )(lambda f=_family: _hf_family(f))
