"""cuDNN's fused attention, through jax.nn.dot_product_attention(implementation="cudnn"), for the calls it
computes exactly as we define them.

Its conventions against ours: jax.nn's is_causal and local_window_size are TOP-LEFT aligned (query t at t),
ours bottom-right (t + S - T): the same only when T == S, so causal and window need T == S. A row with no
allowed key is not zeroed by cuDNN: rows that lengths leave empty (length 0, or a window past the last real
key) are set to zero here. Inputs must be float16 / bfloat16 with H == Hv, a multiple of 8 and at most 128
(cuDNN's flash kernels; Hopper's 256 is not taken: jax.nn reads the generation from the host's default
backend, so a program for an H100 traced on a CPU host would be refused at lowering).

Lowering checks the installed cuDNN, so this path lowers only with a CUDA build of jaxlib (a GPU host, or
the compile environment of .ci/compile_targets.py; JAX raises "cuDNN is not detected" elsewhere).
implementation=None takes it on Hopper and later GPUs (jaxattn._dispatch.registry.CUDA_KERNELS_BY_GENERATION; on a CPU
host only inside cross_platform_lowering(cuda_compute_capability="9.0")). Not measured yet on a GPU
(docs/kernels.md). Refused by name: float32, T != S with causal or window, explicit positions, segment ids,
chunk_size, logit_softcap, sinks, score_mod / mask_mod / block_mask, return_lse, relative tables and
position biases, head dims cuDNN does not take.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .._core import checks
from .._core.call import AttentionCall

HANDLED = ("is_causal", "scale", "precision", "key_value_seq_lengths", "window")
MAX_HEAD_DIM = 128


@functools.cache
def installed() -> bool:
    """jaxlib has cuDNN (a CUDA build): jax.nn's cuDNN path checks this while tracing and raises otherwise.
    Read from jax's own module (no public flag says it); an unreadable answer counts as absent."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo
    except ImportError:
        return False
    return getattr(fused_attention_stablehlo, "cuda_versions", None) is not None


def unsupported(call: AttentionCall, query, key, value, interpret=False):
    """None when cuDNN computes this call exactly, else the name of the first option it cannot express."""
    problem = call.first_unhandled(HANDLED)
    if problem is not None:
        return problem
    if jnp.dtype(getattr(query, "dtype", np.float32)) not in (jnp.float16, jnp.bfloat16):
        return "query (dtype: cuDNN takes float16 / bfloat16)"
    T, S = np.shape(query)[-3], np.shape(key)[-3]
    for name in ("is_causal", "window"):
        if getattr(call, name) not in (None, False) and T != S:
            return f"{name} (cuDNN aligns it top-left: T == S only)"
    H = np.shape(query)[-1]
    if np.shape(value)[-1] != H:
        return "value (head dim Hv != H)"
    if H % 8 or H > MAX_HEAD_DIM:
        return f"query (head dim {H}: cuDNN takes multiples of 8 up to {MAX_HEAD_DIM})"
    if not installed():
        return "implementation (cuDNN is not installed: it comes with a CUDA build of jaxlib)"
    return None


def _empty_rows(T, lengths, causal, window):
    """bool [B,T]: rows with no allowed key once lengths cut the keys (T == S here)."""
    t = jnp.arange(T)[None, :]
    left, right = (None, None) if window is None else window
    lo = jnp.zeros_like(t) if left is None else jnp.maximum(0, t - left)
    hi = lengths[:, None] - 1
    hi = jnp.minimum(hi, t) if causal else hi
    hi = hi if right is None else jnp.minimum(hi, t + right)
    return lo > hi


def attention(call: AttentionCall, query, key, value, interpret=False):
    """jax.nn.dot_product_attention(implementation="cudnn") over [...,T,N,H] inputs (module docstring)."""
    del interpret  # no interpreter for cuDNN; it computes at its own (float32-accumulating) precision
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    batch, T, S, N, _, _, Hv = checks.check_qkv(query, key, value)
    window, is_causal, key_value_seq_lengths = call.window, call.is_causal, call.key_value_seq_lengths
    B = int(np.prod(batch, dtype=np.int64))
    flat = lambda x: x.reshape(B, *x.shape[len(batch) :])  # noqa: E731
    lengths = None
    if key_value_seq_lengths is not None:
        lengths = jnp.asarray(key_value_seq_lengths)
        checks.check_int("key_value_seq_lengths", lengths)
        lengths = jnp.broadcast_to(lengths, batch).reshape(B).astype(jnp.int32)
    local = None if window is None else tuple(S if side is None else side for side in window)
    out = jax.nn.dot_product_attention(
        flat(query),
        flat(key),
        flat(value),
        scale=call.scale,
        is_causal=is_causal,
        key_value_seq_lengths=lengths,
        local_window_size=local,
        implementation="cudnn",
    )
    if lengths is not None:
        out = jnp.where(_empty_rows(T, lengths, is_causal, window)[:, :, None, None], 0, out)
    return out.reshape(*batch, T, N, Hv).astype(value.dtype)
