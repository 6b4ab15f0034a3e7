"""Test helpers, one home for each: the normwise error, the float64 guard, the independent attention references,
the safetensors spec's dtype table, and the two-process runs (start the processes, join them in each).

Every test file imports these from here, and so do the scripts that tests run as subprocesses
(`python tests/_sharding_checks.py`, `python tests/_multiprocess_worker.py ...`: a script's own folder is first
on sys.path, so `from helpers import ...` finds this file there too).

Nothing here calls jaxattn, torchref or crosscheck. The references are the formula of docs/design.md, "Keywords",
written the slowest obvious way: `allowed_loop` decides every (batch, head, t, s) pair by its rules with Python loops,
`attention_loop` computes one scalar logit at a time in float64 (numpy), and `attention_reference` is the same formula
over the full grid in jax.numpy, so that jax.grad gives reference gradients (tests/test_helpers.py holds it to
`attention_loop`). Their keywords are the contract's own (`key_value_seq_lengths`, `query_positions`, `window`,
`logit_softcap`, `sinks`...), so a test hands the reference the keywords it gives jaxattn.
"""

import json
import math
import os
import socket
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

# ---------------------------------------------------------------------------------------------------------
# the safetensors format's dtype names -> numpy, written down from its spec (not taken from jaxattn.io), and
# the ones the safetensors library's numpy backend can hold

# Families whose transformers float32 run is itself further than 1e-5 from its float64 run on the tiny
# checkpoints (Qwen3-Next: 1.3e-5 to 1.6e-5; its delta rule is ill-conditioned at tiny key head dims): their
# float32 outputs are held to twice that measured distance from the float64 truth, not to 1e-5 from torch's
# float32 (tests/test_models_decoders.py, tests/test_to_pretrained.py).
FLOAT32_ENVELOPE = ("qwen3_next",)

SAFETENSORS_DTYPES = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "U32": np.uint32,
    "I32": np.int32,
    "U64": np.uint64,
    "I64": np.int64,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
    "C64": np.complex64,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
}
SAFETENSORS_LIBRARY_DTYPES = ("BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64", "F16", "F32", "F64")

# ---------------------------------------------------------------------------------------------------------
# comparing


def _numpy(x):
    """numpy view of a jax / numpy array, a torch tensor (detached) or a Python number, dtype unchanged."""
    if hasattr(x, "detach"):  # torch
        return x.detach().cpu().numpy()
    return np.asarray(x)


def normwise(actual, expected, *, floor=0.0):
    """The normwise relative error ||actual - expected|| / max(||expected||, floor), 2-norms over every entry,
    computed in float64 (whatever the inputs' dtypes).

    Strictly relative by default (floor 0): a reference of small norm is not excused, and a reference that is exactly
    zero is matched only exactly (0.0, else inf). This is the strictest of the definitions the suite once had (no floor,
    which gave nan on zero references; 1e-300; 1.0, which turned every reference of norm below 1 into an absolute
    comparison), and the one docs/design.md, "Tolerances" states. `floor` is for the one case where relative error means
    nothing: a quantity that is zero in exact arithmetic (the gradient of a per-row logit shift, which softmax ignores;
    a single key) that both sides compute as rounding residue. A caller that passes it says why, and passes the
    problem's scale.

    Shapes must be equal (no broadcasting: [T,S] never passes against [B,T,S]); a NaN or inf on either side gives
    nan, which fails every `<=`.
    """
    a, e = (_numpy(x).astype(np.float64) for x in (actual, expected))
    assert a.shape == e.shape, f"normwise: shapes differ, actual {a.shape} vs expected {e.shape}"
    if not (np.isfinite(a).all() and np.isfinite(e).all()):
        return math.nan
    diff = float(np.linalg.norm((a - e).ravel()))
    scale = max(float(np.linalg.norm(e.ravel())), floor)
    if scale == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / scale


def assert_float64(*arrays):
    """The x64 guard: raises AssertionError unless JAX is in 64-bit mode and every array given (jax, numpy or
    torch; pytrees of them) is float64 as it stands.

    Without `jax_enable_x64` (tests/conftest.py turns it on) JAX silently turns float64 inputs into float32, and
    a "float64" test then compares float32 numbers: the classic false pass. Nothing is cast before the check,
    so a float32 result fails it; give it what the code under test returned. tests/test_helpers.py shows it
    failing with x64 off.
    """
    assert jax.config.jax_enable_x64, (
        "jax_enable_x64 is off: JAX computes float64 inputs in float32 (tests/conftest.py turns it on)"
    )
    leaves = jax.tree.leaves(arrays)
    assert leaves, "assert_float64: no array to check"
    dtypes = [str(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype).removeprefix("torch.") for x in leaves]
    assert all(d == "float64" for d in dtypes), f"expected float64 results, got {dtypes}"


def arrays(seed, *shapes, dtype=np.float64):
    """One jnp array of standard normal numbers per shape (float64 unless `dtype` says otherwise). device_put,
    not jnp.asarray: outside jit, jnp.asarray of a numpy array compiles an identity program per shape."""
    rng = np.random.default_rng(seed)
    return [jax.device_put(rng.normal(size=shape).astype(dtype)) for shape in shapes]


def value_and_vjp(f, args, w):
    """(f(*args), the cotangents of args for the output cotangent w), under one jax.jit: a kernel test's output
    and every argument's gradient in one program."""

    @jax.jit
    def run(*args):
        out, vjp = jax.vjp(f, *args)
        return out, vjp(jnp.asarray(w, out.dtype))

    return run(*args)


def check_forward_and_grads(ours, reference, args, argnums, *, tol=1e-12, grad_floor=0.0):
    """ours(*args) against reference(*args), both run under jit: the outputs, and the gradients with respect to
    args[argnums] of sum(out * w) for one fixed random cotangent w. All of them float64 (assert_float64), every
    gradient of ours finite, each normwise error <= tol; `grad_floor` is normwise's floor for the gradients
    (0: strictly relative; a caller whose gradients can vanish in exact arithmetic passes one and says why)."""
    w = arrays(99, jax.eval_shape(reference, *args).shape)[0]

    def both(f):
        return jax.jit(lambda *a: (f(*a), jax.grad(lambda *a: jnp.sum(f(*a) * w), argnums=argnums)(*a)))

    (expected, g_expected), (got, g_got) = both(reference)(*args), both(ours)(*args)
    assert_float64(expected, g_expected, got, g_got)
    error = normwise(got, expected)
    assert error <= tol, f"output: normwise error {error:.3g} > {tol:g}"
    for i, ge, gg in zip(argnums, g_expected, g_got, strict=True):
        assert bool(jnp.all(jnp.isfinite(gg))), f"gradient of argument {i} is not finite"
        error = normwise(gg, ge, floor=grad_floor)
        assert error <= tol, f"gradient of argument {i}: normwise error {error:.3g} > {tol:g}"


def randomize(module, seed):
    """A torch module with every parameter drawn from N(0, 0.5^2) (seeded), in eval mode: torch initializes
    in_proj_bias / out_proj.bias to zero, which would hide a misplaced bias. (torch is imported here, not at
    the top: the subprocess scripts import this file and need no torch.)"""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.5)
    return module.eval()


# ---------------------------------------------------------------------------------------------------------
# compiled memory (nothing runs: lowered and compiled on abstract shapes)


def temp_bytes(fn, *shapes, dtype=jnp.float32):
    """XLA's temp buffer bytes (scratch beyond arguments and outputs) of jit(fn) on arguments of these shapes."""
    args = [jax.ShapeDtypeStruct(shape, dtype) for shape in shapes]
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def grad_of_sum(fn, argnums):
    """jax.grad of sum(fn(*args)) with respect to args[argnums]: the backward pass whose memory is measured."""
    return jax.grad(lambda *a: jnp.sum(fn(*a)), argnums=argnums)


# ---------------------------------------------------------------------------------------------------------
# references


def shaw_index_loop(T, S, max_distance, query_positions=None, key_positions=None):
    """int64 [T,S]: clip(j - i, -max_distance, max_distance) + max_distance, one pair at a time."""
    qp = np.arange(T) + (S - T) if query_positions is None else _numpy(query_positions)
    kp = np.arange(S) if key_positions is None else _numpy(key_positions)
    index = np.zeros((T, S), np.int64)
    for t in range(T):
        for s in range(S):
            index[t, s] = min(max(int(kp[s]) - int(qp[t]), -max_distance), max_distance) + max_distance
    return index


def _positions(batch, T, S, query_positions, key_positions):
    """Absolute positions broadcast to batch + [T] and batch + [S] (default: bottom-right, t + S - T and s)."""
    qp = np.arange(T) + (S - T) if query_positions is None else _numpy(query_positions)
    kp = np.arange(S) if key_positions is None else _numpy(key_positions)
    return np.broadcast_to(qp, batch + (T,)), np.broadcast_to(kp, batch + (S,))


def _one_pair_at_a_time(mask_mod):
    """mask_mod for one (b, n, t, s) of Python ints per call. One written with jax.numpy (it returns a JAX
    array) is called through jax.jit, compiled once for every pair: run eagerly, each of its operations is
    dispatched on its own, ~0.3 ms a pair. One that JAX cannot trace (numpy indexed by the ints) runs as is."""
    if not isinstance(mask_mod(0, 0, 0, 0), jax.Array):
        return mask_mod
    compiled = jax.jit(mask_mod)
    try:
        compiled(0, 0, 0, 0)
    except (jax.errors.JAXTypeError, jax.errors.JAXIndexError):
        return mask_mod
    return compiled


def allowed_loop(
    batch,
    N,
    T,
    S,
    *,
    is_causal=False,
    key_value_seq_lengths=None,
    query_positions=None,
    key_positions=None,
    query_segment_ids=None,
    key_segment_ids=None,
    window=None,
    chunk_size=None,
    mask_mod=None,
):
    """bool [*batch,N,T,S]: which keys each query may attend, by docs/design.md, "Keywords", one pair at a time.

    batch: an int or a tuple of leading batch dims. Positions are [T]/[S] or batch + [T]/[S] (absolute; default
    bottom-right); segment ids batch + [T] / [S]; lengths batch-shaped; mask_mod(b, n, t, s) is called on Python
    ints with b the flattened batch index and t, s absolute positions.
    """
    batch = (batch,) if isinstance(batch, (int, np.integer)) else tuple(batch)
    qp, kp = _positions(batch, T, S, query_positions, key_positions)
    if (query_segment_ids is None) != (key_segment_ids is None):
        raise ValueError("allowed_loop: give both query_segment_ids and key_segment_ids, or neither")
    if query_segment_ids is not None:
        qs = np.broadcast_to(_numpy(query_segment_ids), batch + (T,))
        ks = np.broadcast_to(_numpy(key_segment_ids), batch + (S,))
    lengths = None if key_value_seq_lengths is None else np.broadcast_to(_numpy(key_value_seq_lengths), batch)
    left, right = (None, None) if window is None else window
    if mask_mod is not None:
        mask_mod = _one_pair_at_a_time(mask_mod)
    ok = np.ones(batch + (N, T, S), bool)
    for b, index in enumerate(np.ndindex(*batch)):
        for n in range(N):
            for t in range(T):
                for s in range(S):
                    i, j = int(qp[index + (t,)]), int(kp[index + (s,)])
                    allowed = True
                    if is_causal and j > i:
                        allowed = False
                    if lengths is not None and s >= lengths[index]:
                        allowed = False
                    if query_segment_ids is not None and qs[index + (t,)] != ks[index + (s,)]:
                        allowed = False
                    if left is not None and j < i - left:
                        allowed = False
                    if right is not None and j > i + right:
                        allowed = False
                    if chunk_size is not None and i // chunk_size != j // chunk_size:
                        allowed = False
                    if mask_mod is not None and not bool(mask_mod(b, n, i, j)):
                        allowed = False
                    ok[index + (n, t, s)] = allowed
    return ok


def attention_loop(
    q,
    k,
    v,
    *,
    mask=None,
    bias=None,
    rel_key=None,
    rel_value=None,
    scale=None,
    logit_softcap=None,
    score_mod=None,
    sinks=None,
    **rules,
):
    """The attention formula in float64, one scalar logit at a time: (out [*batch,T,N,Hv], weights [*batch,N,T,S]).

    q [*batch,T,N,H], k [*batch,S,K,H], v [*batch,S,K,Hv] (batch dims broadcast; query head n uses key/value
    head n // (N // K)); mask (bool, True = may attend) and bias broadcastable to [*batch,N,T,S]; rel_key /
    rel_value (seed 000's A^K, A^V) broadcastable to [*batch,T,S,N,H] / [...,Hv]; sinks [N] or [*batch,N];
    `rules` are allowed_loop's keywords (is_causal, key_value_seq_lengths, positions, segment ids, window,
    chunk_size, mask_mod). Per allowed pair:

        x = scale * q_t . (k_s + A^K[t,s])  ->  logit_softcap * tanh(x / logit_softcap)  ->  + bias
          ->  score_mod(x, b, n, t, s) on Python numbers, b flattened, t and s absolute

    a logit of -inf drops its key; p = softmax over the kept keys, with the sink as one more logit that has no
    value; out_t = sum_s p_s (v_s + A^V[t,s]). A row with no kept key gives zeros (output and weights).
    """
    q, k, v = (_numpy(x).astype(np.float64) for x in (q, k, v))
    batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    (T, N, H), (S, K, Hv) = q.shape[-3:], v.shape[-3:]
    q, k, v = (np.broadcast_to(x, batch + x.shape[-3:]) for x in (q, k, v))
    G = N // K
    scale = H**-0.5 if scale is None else scale
    ok = allowed_loop(batch, N, T, S, **rules)
    if mask is not None:
        mask = _numpy(mask)
        assert mask.dtype == bool, f"attention_loop: mask must be bool (True = may attend), got {mask.dtype}"
        ok &= np.broadcast_to(mask, ok.shape)
    bias = None if bias is None else np.broadcast_to(_numpy(bias).astype(np.float64), ok.shape)
    rel_key = None if rel_key is None else np.broadcast_to(_numpy(rel_key).astype(np.float64), batch + (T, S, N, H))
    rel_value = (
        None if rel_value is None else np.broadcast_to(_numpy(rel_value).astype(np.float64), batch + (T, S, N, Hv))
    )
    sinks = None if sinks is None else np.broadcast_to(_numpy(sinks).astype(np.float64), batch + (N,))
    qp, kp = _positions(batch, T, S, rules.get("query_positions"), rules.get("key_positions"))
    out = np.zeros(batch + (T, N, Hv))
    weights = np.zeros(batch + (N, T, S))
    for b, index in enumerate(np.ndindex(*batch)):
        for n in range(N):
            kv = n // G
            for t in range(T):
                logits = {}
                for s in range(S):
                    if not ok[index + (n, t, s)]:
                        continue
                    key = k[index + (s, kv)]
                    if rel_key is not None:
                        key = key + rel_key[index + (t, s, n)]
                    x = scale * float(q[index + (t, n)] @ key)
                    if logit_softcap is not None:
                        x = logit_softcap * math.tanh(x / logit_softcap)
                    if bias is not None:
                        x += float(bias[index + (n, t, s)])
                    if score_mod is not None:
                        x = float(score_mod(x, b, n, int(qp[index + (t,)]), int(kp[index + (s,)])))
                    if x != -math.inf:
                        logits[s] = x
                if not logits:
                    continue
                every = list(logits.values()) + ([float(sinks[index + (n,)])] if sinks is not None else [])
                top = max(every)
                denominator = sum(math.exp(x - top) for x in every)
                for s, x in logits.items():
                    p = math.exp(x - top) / denominator
                    weights[index + (n, t, s)] = p
                    value = v[index + (s, kv)]
                    if rel_value is not None:
                        value = value + rel_value[index + (t, s, n)]
                    out[index + (t, n)] += p * value
    return out, weights


def _index_grids(B, N, T, S, query_positions=None, key_positions=None):
    """b, n, t, s as broadcastable int32 arrays [B,1,1,1], [1,N,1,1], [B|1,1,T,1], [B|1,1,1,S] (absolute t, s)."""
    qp = np.arange(T) + (S - T) if query_positions is None else _numpy(query_positions)
    kp = np.arange(S) if key_positions is None else _numpy(key_positions)
    b = np.arange(B)[:, None, None, None]
    n = np.arange(N)[None, :, None, None]
    t = qp[:, None, :, None] if qp.ndim == 2 else qp[None, None, :, None]
    s = kp[:, None, None, :] if kp.ndim == 2 else kp[None, None, None, :]
    return tuple(jnp.asarray(x, jnp.int32) for x in (b, n, t, s))


def attention_reference(
    q,
    k,
    v,
    allowed,
    *,
    scale=None,
    logit_softcap=None,
    bias=None,
    sinks=None,
    score_mod=None,
    rel_logits=None,
    query_positions=None,
    key_positions=None,
    return_lse=False,
):
    """attention_loop's formula over the full grid in jax.numpy (differentiable: jax.grad gives the reference
    gradients, and of the arrays a score_mod closes over).

    q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv]; allowed bool [B,N,T,S] (from allowed_loop); bias [B,N,T,S]; sinks [N]
    or [B,N]; rel_logits [B,N,T,S] (unscaled, added to q.k: q_t . A^K[t,s]); score_mod(score, b, n, t, s) on
    broadcast index grids. Order: scale * (q.k + rel) -> softcap -> + bias -> score_mod -> mask -> softmax with
    the sink column. return_lse: also the log of each row's softmax denominator [B,N,T] (the sink's term
    included; -inf for a row with no allowed key and no sink), as (out, lse).
    """
    B, T, N, H = q.shape
    S, K = k.shape[1], k.shape[2]
    G = N // K
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    scale = H**-0.5 if scale is None else scale
    x = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest")
    if rel_logits is not None:
        x = x + rel_logits
    x = x * scale
    if logit_softcap is not None:
        x = logit_softcap * jnp.tanh(x / logit_softcap)
    if bias is not None:
        x = x + bias
    if score_mod is not None:
        x = score_mod(x, *_index_grids(B, N, T, S, query_positions, key_positions))
    x = jnp.where(jnp.asarray(allowed), x, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(
            jnp.asarray(sinks).reshape(-1 if jnp.ndim(sinks) == 2 else 1, N)[:, :, None, None], (B, N, T, 1)
        )
        x = jnp.concatenate([x, sink], axis=-1)
    row_max = jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0)
    e = jnp.exp(x - row_max)
    total = jnp.sum(e, axis=-1, keepdims=True)
    p = (e / jnp.where(total == 0, 1, total))[..., :S]
    out = jnp.einsum("bnts,bsnh->btnh", p, v, precision="highest")
    if not return_lse:
        return out
    lse = jnp.where(total == 0, -jnp.inf, row_max + jnp.log(jnp.where(total == 0, 1, total)))
    return out, lse[..., 0]


# ---------------------------------------------------------------------------------------------------------
# several processes on localhost (tests/test_multiprocess.py, tests/test_models_sharded.py)


def run_processes(script, count, *args, timeout_s, mode=()):
    """Starts `count` copies of `python SCRIPT *mode PROCESS_ID COUNT PORT *args` (PORT: a free localhost port
    for jax.distributed's coordinator; XLA_FLAGS cleared, each script sets its own), waits for each at most
    timeout_s and returns [the JSON of each one's last stdout line]. A process that fails fails the caller
    with its stderr; none is left waiting on its peer."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *mode, str(i), str(count), str(port), *map(str, args)],
            env=env,
            cwd=os.path.dirname(str(script)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(count)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout_s)
            assert proc.returncode == 0, err[-4000:]
            outputs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return outputs


def join_processes(process_id, count, port, local_devices):
    """In a script run_processes started: JAX's multi-process runtime over `local_devices` CPU devices per
    process (CPU collectives over gloo, coordinator on localhost:PORT); jax.devices() then spans them all."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{port}",
        num_processes=count,
        process_id=process_id,
        local_device_ids=list(range(local_devices)),
        initialization_timeout=60,
    )
    return {
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "devices": len(jax.devices()),
        "local_devices": len(jax.local_devices()),
    }


# ---------------------------------------------------------------------------------------------------------
# gated delta rule (docs/design.md, "Latent and linear attention"), the recurrence as written there


def delta_rule_reference(q, k, v, g, beta, initial_state=None, *, scale=None):
    """(out [B,T,N,Hv], state [B,N,H,Hv]) token by token in jax.numpy (a Python loop over T, differentiable):
    value head n reads query/key head n // (N // K); S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;
    o_t = S^T (scale q_t), scale = H ** -0.5 by default. q, k [B,T,K,H]; v [B,T,N,Hv]; g, beta [B,T,N];
    initial_state [B,N,H,Hv] (default zeros)."""
    B, T, K, H = q.shape
    N, Hv = v.shape[-2:]
    scale = H**-0.5 if scale is None else scale
    q, k = jnp.repeat(q, N // K, axis=2), jnp.repeat(k, N // K, axis=2)  # [B,T,N,H]: head n reads n // (N // K)
    S = jnp.zeros((B, N, H, Hv), v.dtype) if initial_state is None else initial_state
    outs = []
    for t in range(T):
        S = jnp.exp(g[:, t])[..., None, None] * S
        delta = beta[:, t, :, None] * (v[:, t] - jnp.einsum("bnh,bnhv->bnv", k[:, t], S))
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(jnp.einsum("bnh,bnhv->bnv", scale * q[:, t], S))
    return jnp.stack(outs, axis=1), S


def print_check_results(checks: dict, names, devices: int = 8):
    """The multi-device check scripts' main (tests/_sharding_checks.py, tests/_mesh_kernel_checks.py): run each
    named check (all without names) and print one JSON object {name: result}, each with its seconds; a check
    that raises reports its error, so one failure does not hide the others."""
    assert len(jax.devices()) == devices, jax.devices()
    results = {}
    for name in names or checks:
        start = time.perf_counter()
        try:
            results[name] = checks[name]()
        except Exception as error:  # reported per check
            results[name] = {"error": f"{type(error).__name__}: {error}"}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(results))
