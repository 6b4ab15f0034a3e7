"""The first GPU (issue 36 §3): one command, run before anything else on a machine with a GPU, that checks the
kernels there and times them, in under 8 minutes, and writes one JSON and a log.

    PYTHONPATH=. python3 -m benchmarks.device_check --out "$OUT"      # on the GPU machine (no install needed)
    python -m benchmarks.device_check --smoke --out /tmp/x            # anywhere: the same code, tiny shapes,
                                                                      # the kernels in Pallas' interpreter

(a) Correctness: each implementation (implementation="pallas_gpu", its split-key decode kernel, "cudnn")
    against the dense engine on a small option grid, forward and gradients (q, k, v, sinks), in float32 at
    precision="highest" (the float32 bar, docs/design.md, "Tolerances": normwise <= 1e-6 forward, <= 1e-5
    gradients, against the dense engine in float32 at "highest") and in bfloat16 (bar: the kernel's error
    against that float32 reference at most twice the dense engine's own bfloat16 error, plus 1e-3).
(b) Timings (benchmarks/accelerator.py's cases): causal and sliding-window bf16 at S = 1k, 4k, 16k, forward,
    forward+backward and decode, jaxattn (implementation=None) against jax.nn.dot_product_attention (xla,
    cudnn), torch SDPA flash and torch's compiled flex_attention; TFLOP/s (forward 4*B*N*H*(allowed pairs),
    forward+backward 3.5x that) and the ratio to the best. Cases are run until the time budget is spent;
    the rest are listed as not run.
(c) The relative schemes in the kernels (issue 34 §3; benchmarks/relative.py's six: T5, ALiBi, Transformer-XL,
    clipped tables, DeBERTa-v3, per-pair tables; N = 8, H = 64): each against the dense engine in float32 at
    "highest" (forward, and gradients into q, k, v and every table; the float32 bar) on the "pallas_gpu"
    kernels, then timed in bf16 at S = 1k and 4k, forward and forward+backward: implementation=None against
    jaxattn's plain kernel on the same shape (causal; DeBERTa's encoder not) — what the relative term costs —
    and, for T5 and ALiBi, torch's compiled flex_attention with the same bias as a score_mod (gradients into
    q, k, v only). Run until its own time budget is spent (--relative-budget-s).

Writes OUT/device_check.json and OUT/device_check.log (OUT: --out, else $OUT, else benchmarks/results). Exit
status 1 when a correctness row fails (every row still runs and is recorded).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from helpers import normwise  # noqa: E402  the suite's one normwise error

F32_BAR = {"forward": 1e-6, "gradients": 1e-5}  # docs/design.md, "Tolerances": float32 at "highest"


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


@dataclasses.dataclass(frozen=True)
class Check:
    """One correctness call: sizes, the options (array options are made from `arrays`), the implementations."""

    name: str
    T: int
    S: int
    N: int = 4
    K: int = 2
    H: int = 64
    B: int = 2
    options: tuple = ()
    arrays: tuple = ()  # "lengths", "segments", "sinks"
    flex: str | None = None  # "mods" (score_mod + mask_mod), "block_mask"
    return_lse: bool = False
    implementations: tuple = ("pallas_gpu",)


def checks(smoke: bool) -> list[Check]:
    """The option grid; smoke: the same options at sizes Pallas' interpreter runs in seconds."""
    T, S, long = (19, 37, 600) if smoke else (300, 517, 8000)  # none of them whole tiles or chunks
    causal = (("is_causal", True),)
    grid = [
        Check("causal", T, T, options=causal, implementations=("pallas_gpu", "cudnn")),
        Check("causal T!=S GQA", T, S, N=6, K=2, options=causal),
        Check("full MHA H128", T, S, N=3, K=3, H=128, implementations=("pallas_gpu", "cudnn")),
        Check("H256", T, T, N=2, K=1, H=256, options=causal),
        Check("H80", T, S, N=2, K=2, H=80, options=causal),
        Check("lengths segments", T, S, options=causal, arrays=("lengths", "segments")),
        Check(
            "window softcap sinks",
            T,
            S,
            options=causal + (("window", (31, 0)), ("logit_softcap", 30.0)),
            arrays=("sinks",),
        ),
        Check("chunk", T, S, options=causal + (("chunk_size", 64),)),
        Check("return_lse", T, S, options=causal, return_lse=True),
        Check("flex score_mod mask_mod", T, S, flex="mods"),
        Check("flex block_mask", 2 * T if smoke else 512, 2 * T if smoke else 512, flex="block_mask"),
        Check("decode (split-key)", 1, long, N=8, K=2, options=causal, arrays=("lengths",)),
    ]
    if smoke:  # each code path once (Pallas' interpreter takes about a minute a row on 2 busy cores)
        grid = [c for c in grid if c.name in SMOKE_CHECKS]
    return grid


# --smoke's rows: the flash kernel (both dtypes, cudnn's skip), array options with sinks' gradient, a
# BlockMask with score_mod, the split-key decode kernel.
SMOKE_CHECKS = ("causal", "window softcap sinks", "flex block_mask", "decode (split-key)")
SMOKE_BF16 = ("causal",)


def distance_penalty(score, b, n, t, s):
    return score - 0.05 * (n + 1) * jnp.abs(t - s).astype(score.dtype)


def sliding(b, n, t, s):
    return (s <= t) & (t - s < 48)


def make_inputs(check: Check, seed=0):
    keys = jax.random.split(jax.random.key(seed), 8)
    B, T, S, N, K, H = check.B, check.T, check.S, check.N, check.K, check.H
    floats = {
        "q": jax.random.normal(keys[0], (B, T, N, H), jnp.float32),
        "k": jax.random.normal(keys[1], (B, S, K, H), jnp.float32),
        "v": jax.random.normal(keys[2], (B, S, K, H), jnp.float32),
    }
    ints = {}
    if "sinks" in check.arrays:
        floats["sinks"] = jax.random.normal(keys[3], (N,), jnp.float32)
    if "lengths" in check.arrays:
        ints["key_value_seq_lengths"] = jnp.array([S, max(S // 3, 1)], jnp.int32)[:B]
    if "segments" in check.arrays:
        ints["query_segment_ids"] = jnp.sort(jax.random.randint(keys[4], (B, T), 0, 3), axis=-1)
        ints["key_segment_ids"] = jnp.sort(jax.random.randint(keys[5], (B, S), 0, 3), axis=-1)
    return floats, ints, keys[6]


def attention_fn(check: Check, implementation, precision, interpret):
    mods = {}
    if check.flex == "mods":
        mods = dict(score_mod=distance_penalty, mask_mod=sliding)
    elif check.flex == "block_mask":
        mask = jaxattn.create_block_mask(sliding, None, None, check.T, check.S, block_size=16 if interpret else 128)
        mods = dict(score_mod=distance_penalty, block_mask=mask)
    extra = dict(interpret=True) if interpret and implementation == "pallas_gpu" else {}

    def call(floats, ints):
        q, k, v = floats["q"], floats["k"], floats["v"]
        options = dict(check.options, **ints, precision=precision, implementation=implementation, **extra)
        if "sinks" in floats:
            options["sinks"] = floats["sinks"]
        if check.flex or check.return_lse:
            return jaxattn.flex_attention(q, k, v, **mods, return_lse=check.return_lse, **options)
        return jaxattn.dot_product_attention(q, k, v, **options)

    return call


def forward_and_grads(call, floats, ints, cotangent_key):
    """Outputs, and the gradients of <outputs, fixed random cotangents> for the float inputs (float32)."""
    outs = jax.jit(call)(floats, ints)
    leaves = jax.tree.leaves(outs)
    cts = [jax.random.normal(jax.random.fold_in(cotangent_key, i), x.shape, jnp.float32) for i, x in enumerate(leaves)]

    def loss(floats):
        return sum(jnp.sum(x.astype(jnp.float32) * c) for x, c in zip(jax.tree.leaves(call(floats, ints)), cts))

    grads = jax.jit(jax.grad(loss))(floats)
    return [np.asarray(x, np.float32) for x in leaves], {k: np.asarray(g, np.float32) for k, g in grads.items()}


def errors(actual, expected):
    outs = max(normwise(a, e) for a, e in zip(actual[0], expected[0]))
    grads = {name: normwise(actual[1][name], expected[1][name]) for name in expected[1]}
    return outs, grads


def judge(row: dict, dtype: str, ours, reference, dense_in_dtype) -> None:
    """row += the errors of `ours` against the float32 `reference`, the bars and ok: F32_BAR in float32; else twice
    the dense engine's own error in that dtype (dense_in_dtype(): its results) plus 1e-3."""
    out_err, grad_err = errors(ours, reference)
    row.update(forward=out_err, gradients=grad_err)
    if dtype == "float32":
        out_bar, grad_bar = F32_BAR["forward"], F32_BAR["gradients"]
    else:  # the dense engine's own error in this dtype sets the scale
        dense_out, dense_grad = errors(dense_in_dtype(), reference)
        out_bar, grad_bar = 2 * dense_out + 1e-3, 2 * max(dense_grad.values()) + 1e-3
        row.update(dense_forward=dense_out, dense_gradients=dense_grad)
    row.update(forward_bar=out_bar, gradients_bar=grad_bar)
    row["ok"] = bool(out_err <= out_bar and all(e <= grad_bar for e in grad_err.values()))


def describe(row: dict) -> str:
    """A correctness row's log text: its error, its skip, or its errors against the bars."""
    if "error" in row:
        return "ERROR " + row["error"].splitlines()[0][:150]
    if row.get("skipped"):
        return row["skipped"].splitlines()[0][:150]
    what = f"fwd {row['forward']:.2e} (bar {row['forward_bar']:.1e})  grads {max(row['gradients'].values()):.2e} "
    return what + f"(bar {row['gradients_bar']:.1e})  {'ok' if row['ok'] else 'FAIL'}"


def run_check(check: Check, implementation: str, interpret: bool, dtypes) -> list[dict]:
    """The dtypes of one check: rows with the errors, the bars and pass / fail."""
    rows = []
    floats, ints, ct_key = make_inputs(check)
    reference = forward_and_grads(attention_fn(check, "dense", "highest", False), floats, ints, ct_key)
    for dtype in dtypes:
        row = dict(check=check.name, implementation=implementation, dtype=dtype, T=check.T, S=check.S, N=check.N)
        row.update(K=check.K, H=check.H, interpret=interpret)
        start = time.perf_counter()
        try:
            cast = {k: (v.astype(dtype) if k != "sinks" else v) for k, v in floats.items()}
            precision = "highest" if dtype == "float32" else None
            ours = forward_and_grads(attention_fn(check, implementation, precision, interpret), cast, ints, ct_key)
            judge(
                row,
                dtype,
                ours,
                reference,
                lambda cast=cast: forward_and_grads(attention_fn(check, "dense", None, False), cast, ints, ct_key),
            )
        except Exception as error:  # noqa: BLE001 - recorded; the run goes on
            if isinstance(error, ValueError) and "which cannot express it" in str(error):
                row.update(ok=None, skipped=f"refused: {error}"[:500])  # by design: the kernel's unsupported
                rows.append(row)
                continue
            row.update(ok=False, error=f"{type(error).__name__}: {error}"[:1500], trace=traceback.format_exc()[-1500:])
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(row)
    return rows


def correctness(smoke: bool, log) -> list[dict]:
    interpret = not on_gpu()
    rows = []
    for check in checks(smoke):
        for implementation in check.implementations:
            if implementation == "cudnn" and not on_gpu():
                rows.append(dict(check=check.name, implementation="cudnn", ok=None, skipped="no GPU here"))
                log(f"  {check.name:26} cudnn      skipped (no GPU here)")
                continue
            dtypes = ("float32", "bfloat16") if not smoke or check.name in SMOKE_BF16 else ("float32",)
            if implementation == "cudnn":  # half precision only (jaxattn._kernels.cudnn)
                dtypes = ("bfloat16",)
            for row in run_check(check, implementation, interpret, dtypes):
                rows.append(row)
                log(f"  {check.name:26} {implementation:10} {row['dtype']:9} {describe(row)}  {row['seconds']} s")
    return rows


def allowed_pairs(mask, T, S, window):
    offset = S - T
    t = np.arange(T)[:, None] + offset
    s = np.arange(S)[None, :]
    ok = s <= t
    if mask == "sliding":
        ok &= t - s < window
    return int(ok.sum())


def timings(smoke: bool, deadline: float, log) -> dict:
    """benchmarks.accelerator's cases, smallest first, until the deadline; TFLOP/s and ratio to the best."""
    from benchmarks import accelerator

    sizes, rounds, window = ([256], 2, 64) if smoke else ([1024, 4096, 16384], 5, accelerator.WINDOW)
    modes = ("forward", "forward+backward", "decode")
    cases, not_run = [], []
    for S in sizes:
        for mask in ("causal", "sliding"):
            for mode in modes:
                if time.monotonic() > deadline:
                    not_run.append(dict(mask=mask, mode=mode, S=S))
                    continue
                try:
                    case = accelerator.run_case(mask, mode, S, rounds, window)
                except Exception as error:  # noqa: BLE001
                    cases.append(dict(mask=mask, mode=mode, S=S, error=f"{type(error).__name__}: {error}"[:800]))
                    log(f"  {mask:8} {mode:17} S={S:6}  ERROR {error}")
                    continue
                T = case["T"]
                flops = 4 * accelerator.B * accelerator.N * accelerator.H * allowed_pairs(mask, T, S, window)
                flops *= 3.5 if mode == "forward+backward" else 1.0
                best = min(row["median_s"] for row in case["candidates"].values())
                for name, row in case["candidates"].items():
                    row["tflops"] = flops / row["median_s"] / 1e12
                    row["ratio_to_best"] = row["median_s"] / best
                    log(
                        f"  {mask:8} {mode:17} S={S:6} {name:28} {row['median_s'] * 1e3:9.3f} ms "
                        f"{row['tflops']:8.2f} TFLOP/s  x{row['ratio_to_best']:.2f} of best"
                    )
                for name, why in case["skipped"].items():
                    log(f"  {mask:8} {mode:17} S={S:6} {name:28} skipped: {why[:100]}")
                cases.append(case)
    return dict(sizes=sizes, rounds=rounds, window=window, cases=cases, not_run=not_run)


# ---------------------------------------------------------------------------------------------------
# (c) the relative schemes

TORCH_BIASES = ("t5", "alibi")  # the biases torch's flex_attention takes as a score_mod


def relative_correctness(name: str, L: int, interpret: bool, dtypes) -> list[dict]:
    """One scheme's rows: "pallas_gpu" (interpreted off a GPU) against the dense engine in float32 at "highest",
    forward and the gradients of <out, a fixed random cotangent> for q, k, v and every table."""
    from benchmarks import relative as schemes

    args = schemes.inputs(name, L)
    names = ("q", "k", "v") + tuple(f"table{i}" for i in range(len(args) - 3))
    cotangent = jax.random.normal(jax.random.key(1), args[0].shape[:-1] + (schemes.H,), jnp.float32)

    def run(implementation, precision, dtype):
        extra = dict(interpret=True) if interpret and implementation == "pallas_gpu" else {}
        f = schemes.scheme_function(name, implementation, precision=precision, **extra)[0]
        cast = [a.astype(dtype) for a in args]
        out = jax.jit(f)(*cast)
        grads = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) * cotangent), range(len(cast))))(*cast)
        return ([np.asarray(out, np.float32)], {n: np.asarray(g, np.float32) for n, g in zip(names, grads)})

    reference = run("dense", "highest", jnp.float32)
    rows = []
    for dtype in dtypes:
        row = dict(check=f"relative {name}", implementation="pallas_gpu", dtype=dtype, T=L, S=L, interpret=interpret)
        start = time.perf_counter()
        try:
            ours = run("pallas_gpu", "highest" if dtype == "float32" else None, dtype)
            judge(row, dtype, ours, reference, lambda dtype=dtype: run("dense", None, dtype))
        except Exception as error:  # noqa: BLE001 - recorded; the run goes on
            row.update(ok=False, error=f"{type(error).__name__}: {error}"[:1500], trace=traceback.format_exc()[-1500:])
        row["seconds"] = round(time.perf_counter() - start, 2)
        rows.append(row)
    return rows


def torch_relative(name: str, L: int, args, backward: bool, device="cuda", compiled=True):
    """torch's compiled flex_attention with the scheme's bias as a score_mod (T5's bucket table, ALiBi's slopes)
    and the causal mask as a BlockMask, on [1,N,L,H] bf16 tensors on `device`: a call of (q, k, v)'s forward
    (and backward into q, k, v), synchronised, that returns the output [1,L,N,H] (tests/test_device_check.py
    checks it against jaxattn's on the CPU, eager)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def tensor(x, dtype=torch.bfloat16, grad=False):
        return torch.tensor(np.asarray(x, np.float32), device=device, dtype=dtype, requires_grad=grad)

    q, k, v = (tensor(np.swapaxes(np.asarray(a, np.float32), 1, 2), grad=backward) for a in args[:3])
    distance = torch.arange(-(L - 1), L, device=device)  # s - t, indexed by s - t + L - 1
    if name == "t5":  # the causal buckets of s - t (32 buckets, max_distance 128, t5_attention's scale 1)
        rows = jaxattn.t5_relative_position_bucket(np.arange(-(L - 1), L), bidirectional=False)
        bucket, table = tensor(rows, torch.int64), tensor(args[3], torch.float32)

        def score_mod(score, b, h, t, s):
            return score + table[bucket[s - t + L - 1], h]

        scale = 1.0
    else:  # ALiBi, causal: slope * (s - t)
        slopes = tensor(args[3], torch.float32)

        def score_mod(score, b, h, t, s):
            return score + slopes[h] * distance[s - t + L - 1]

        scale = None
    block_mask = create_block_mask(lambda b, h, t, s: t >= s, None, None, L, L, device=device)
    flex = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    def call():
        out = flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)
        if backward:
            torch.autograd.grad(out.float().sum(), (q, k, v))
        if device == "cuda":
            torch.cuda.synchronize()
        return out.transpose(1, 2)

    return call


def relative(smoke: bool, timed: bool, budget_s: float, log) -> dict:
    """(c): each scheme's correctness rows, then its timings for budget_s seconds (module docstring)."""
    from benchmarks import accelerator, harness, relative as schemes

    interpret = not on_gpu()
    L = 24 if smoke else 300  # no whole tiles
    dtypes = ("float32",) if smoke else ("float32", "bfloat16")
    rows = []
    for name in schemes.SCHEMES:
        for row in relative_correctness(name, L, interpret, dtypes):
            rows.append(row)
            log(f"  {row['check']:26} pallas_gpu {row['dtype']:9} {describe(row)}  {row['seconds']} s")
    result = dict(correctness=rows, cases=[], not_run=[])
    if not timed:
        return result
    deadline = time.monotonic() + budget_s
    sizes, rounds = ([128], 2) if smoke else ([1024, 4096], 5)
    torch_here = accelerator.torch_cuda()
    for S in sizes:
        for mode in ("forward", "forward+backward"):
            for name in schemes.SCHEMES:
                if time.monotonic() > deadline:
                    result["not_run"].append(dict(scheme=name, mode=mode, S=S))
                    continue
                case = dict(scheme=name, mode=mode, S=S, candidates={}, skipped={})
                args = [a.astype(jnp.bfloat16) for a in schemes.inputs(name, S)]
                causal = name != "deberta"  # DeBERTa-v3 is an encoder
                ours = schemes.scheme_function(name, None)[0]

                def plain(q, k, v, causal=causal):
                    return jaxattn.dot_product_attention(q, k, v, is_causal=causal)

                fns = {f"jaxattn {name}": (ours, args), "jaxattn plain": (plain, args[:3])}
                candidates = []
                for label, (fn, fn_args) in fns.items():
                    if mode == "forward+backward":
                        fn = jax.grad(lambda *a, fn=fn: jnp.sum(fn(*a).astype(jnp.float32)), range(len(fn_args)))
                    try:
                        candidates.append(harness.jax_candidate(label, fn, *fn_args))
                    except Exception as error:  # noqa: BLE001 - out of memory, say: recorded
                        case["skipped"][label] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                if torch_here and name in TORCH_BIASES:
                    try:
                        call = torch_relative(name, S, args, mode == "forward+backward")
                        start = time.perf_counter()
                        call()  # compiles flex, warms up
                        compile_s = time.perf_counter() - start
                        candidates.append(harness.Candidate("torch flex compiled", call, compile_s=compile_s))
                    except Exception as error:  # noqa: BLE001
                        case["skipped"]["torch flex compiled"] = f"{type(error).__name__}: {str(error)[:200]}"
                harness.time_rounds(candidates, rounds)
                base = next((c.median_s for c in candidates if c.name == "jaxattn plain"), None)
                for c in candidates:
                    case["candidates"][c.name] = {**c.summary(), "ratio_to_plain": c.median_s / base if base else None}
                    log(
                        f"  {name:8} {mode:17} S={S:6} {c.name:22} {c.median_s * 1e3:9.3f} ms"
                        + (f"  x{c.median_s / base:.2f} of plain" if base else "")
                    )
                for label, why in case["skipped"].items():
                    log(f"  {name:8} {mode:17} S={S:6} {label:22} skipped: {why[:100]}")
                result["cases"].append(case)
    return result


def machine() -> dict:
    info = dict(
        jax=jax.__version__,
        backend=jax.default_backend(),
        devices=[f"{d.platform}:{getattr(d, 'device_kind', '')}" for d in jax.devices()],
        python=platform.python_version(),
        host=platform.node(),
    )
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_cuda"] = torch.cuda.is_available()
    except ImportError:
        info["torch"] = None
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        info["nvidia_smi"] = None
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", "--dry-run", action="store_true", help="tiny shapes, kernels interpreted")
    parser.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    # (b) until 300 s from the start, then at most the case in progress (about a minute: torch compiles
    # flex_attention per shape); (c)'s timings 120 s after its correctness rows: under 8 minutes in all, within
    # a device session's 10-minute command (not yet measured on a GPU)
    parser.add_argument("--budget-s", type=float, default=300.0, help="wall seconds before timings stop")
    parser.add_argument("--no-timings", action="store_true")
    parser.add_argument("--relative-budget-s", type=float, default=120.0, help="wall seconds for (c)'s timings")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    log_file = open(out / "device_check.log", "w")

    def log(line):
        print(line, flush=True)
        log_file.write(line + "\n")
        log_file.flush()

    results = dict(smoke=args.smoke, machine=machine())
    log(f"device_check: {json.dumps(results['machine'])}")
    log("(a) correctness against the dense engine")
    results["correctness"] = correctness(args.smoke, log)
    if not args.no_timings:
        log("(b) timings")
        results["timings"] = timings(args.smoke, start + args.budget_s, log)
    log("(c) the relative schemes in the kernels")
    results["relative"] = relative(args.smoke, not args.no_timings, args.relative_budget_s, log)
    results["wall_s"] = round(time.monotonic() - start, 1)
    failed = [r for r in results["correctness"] + results["relative"]["correctness"] if r.get("ok") is False]
    results["failed"] = [f"{r['check']} {r['implementation']} {r.get('dtype')}" for r in failed]
    (out / "device_check.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    rows = len(results["correctness"]) + len(results["relative"]["correctness"])
    log(f"correctness: {rows - len(failed)} rows ok or skipped, {len(failed)} failing")
    log(f"wall {results['wall_s']} s")
    log(f"wrote {out / 'device_check.json'} and {out / 'device_check.log'}")
    log_file.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
