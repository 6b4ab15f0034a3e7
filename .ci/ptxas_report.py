"""Registers, spills and shared memory of the GPU flash kernels, compiled for an H100 / A100 (issue 36 §4).

XLA compiles each program for a GPU target config as .ci/compile_targets.py does (no GPU needed); with
`xla_dump_to` it writes each kernel's PTX (one *.ptx per kernel) and its launch (grid, threads, dynamic shared
memory) in *.thunk_sequence.txt. The pip ptxas (nvidia-cuda-nvcc, in the compile environment) then reads each
`jaxattn_flash_*` kernel's PTX with -v: registers per thread, stack frame, spill stores / loads. Needs the compile
environment (.ci/run's .venv-compile):

    .venv-compile/bin/python .ci/ptxas_report.py [--targets h100,a100] [--heads 64,80,128,256]
        [--dtypes bfloat16,float32] [--check] [--json PATH]

Per (target, head dim, dtype): a causal forward+backward program through the public API
(implementation="pallas_gpu", [1, 1024, 2, H], T = S), which holds all three kernels (forward, dq, dk/dv).
Tiles are read back from the launch grids (forward / dq grid [B,N,T/Tb], dk/dv grid [B,K,S/Sb]), num_warps from
the threads. --check: exit status 1 when a kernel spills beyond KNOWN_SPILLS or its shared memory passes the
target's limit. --tiles Tb,Sb,W: every program with those tiles and num_warps instead of the kernel's own choice
(a probe of alternatives; the kernel's table is sizes.GPU_TILES).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import compile_targets as ct  # noqa: E402  (.ci/, this script's directory)
import jax  # noqa: E402
import numpy as np  # noqa: E402

import jaxattn  # noqa: E402
from jaxattn._kernels.flash import sizes

RESULTS = ct.ROOT / "benchmarks" / "results" / "ptxas.json"
ARCH = {"h100": "sm_90a", "a100": "sm_80"}  # XLA's PTX targets sm_90a on an H100 (wgmma needs the "a")
SHARED_LIMIT = {"h100": 232448, "a100": 166912}  # bytes per block, opt-in (.ci/targets/README.md)
KERNELS = ("jaxattn_flash_forward", "jaxattn_flash_dq", "jaxattn_flash_dkv")
T = 1024
N = 2


def ptxas() -> str:
    """The ptxas of the nvidia-cuda-nvcc wheel jax[cuda12] installs (or one on PATH)."""
    try:
        import nvidia.cuda_nvcc

        found = Path(nvidia.cuda_nvcc.__path__[0]) / "bin" / "ptxas"
        if found.exists():
            return str(found)
    except ImportError:
        pass
    return "ptxas"


def ptxas_info(ptx: Path, arch: str) -> dict:
    """registers, stack frame and spill bytes of the one entry in ptx, from `ptxas -v`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        done = subprocess.run(
            [ptxas(), "-v", "--gpu-name", arch, str(ptx), "-o", cubin.name], capture_output=True, text=True
        )
    text = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"ptxas failed on {ptx.name}: {text[-500:]}")
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    registers = re.search(r"Used (\d+) registers", text)
    if frame is None or registers is None:
        raise RuntimeError(f"ptxas -v printed no usage for {ptx.name}: {text[-500:]}")
    return dict(
        registers=int(registers.group(1)),
        stack_bytes=int(frame.group(1)),
        spill_stores=int(frame.group(2)),
        spill_loads=int(frame.group(3)),
    )


def launches(dump: Path) -> dict:
    """{kernel: (grid, threads, dynamic shared memory bytes)} from XLA's thunk sequence."""
    found = {}
    for path in dump.glob("*.thunk_sequence.txt"):
        for line in path.read_text().splitlines():
            hit = re.search(
                r"(jaxattn_flash_\w+) grid: \[([\d, ]+)\] threads: \[(\d+)[\d, ]*\]\s+shared_memory: (\d+)", line
            )
            if hit:
                grid = tuple(int(g) for g in hit.group(2).split(","))
                found[hit.group(1)] = (grid, int(hit.group(3)), int(hit.group(4)))
    return found


@contextlib.contextmanager
def forced_tiles(tiles):
    """Every call takes (Tb, Sb, num_warps) = tiles (None: the kernel's own choice)."""
    jax.clear_caches()  # jitted inner functions keyed on their static call, not on the tile table
    if tiles is None:
        yield
        return
    saved = sizes.gpu_tiles
    sizes.gpu_tiles = lambda Hp, itemsize, tables=False: tiles
    try:
        yield
    finally:
        sizes.gpu_tiles = saved


def measure(target: str, device, H: int, dtype: str, tiles=None) -> list[dict]:
    """One row per flash kernel of the causal forward+backward program at head dim H."""
    case = ct.Case(f"H{H}", T=T, N=N, H=H, dtype=dtype, options=ct.CAUSAL)
    fn, args = ct.attention_program(case, "gpu", "forward+backward", 1)
    base = dict(target=target, arch=ARCH[target], H=H, dtype=dtype)
    with tempfile.TemporaryDirectory() as dump:
        start = time.perf_counter()
        mesh = jax.set_mesh(jax.sharding.Mesh(np.array([device]), ("x",)))
        try:
            with forced_tiles(tiles), jaxattn.cross_platform_lowering(ct.CAPABILITY[target]), mesh:
                lowered = jax.jit(fn).lower(*ct.shapes(args, device))
            lowered.compile(compiler_options={"xla_dump_to": dump})
        except Exception as error:  # a tile choice that does not compile (shared memory) is a result
            return [dict(base, kernel="all", error=f"{type(error).__name__}: {error}"[:600])]
        seconds = round(time.perf_counter() - start, 1)
        found = launches(Path(dump))
        rows = []
        for kernel in KERNELS:
            ptx = [p for p in Path(dump).glob("*.ptx") if f".entry {kernel}(" in p.read_text()]
            if kernel not in found or len(ptx) != 1:
                raise RuntimeError(f"{target} H{H} {dtype}: {kernel} not found once in the dump ({len(ptx)} PTX)")
            grid, threads, shared = found[kernel]
            Tb = T // grid[2] if kernel != "jaxattn_flash_dkv" else None
            Sb = T // grid[2] if kernel == "jaxattn_flash_dkv" else None
            row = dict(base, kernel=kernel.removeprefix("jaxattn_flash_"), grid=grid, num_warps=threads // 32)
            row.update(Tb=Tb, Sb=Sb, shared_bytes=shared, compile_s=seconds, **ptxas_info(ptx[0], ARCH[target]))
            rows.append(row)
    # each launch names one tile axis; the other is the program's other kernel's (one pair per call)
    Tb = next(r["Tb"] for r in rows if r["Tb"])
    Sb = next(r["Sb"] for r in rows if r["Sb"])
    for row in rows:
        row.update(Tb=Tb, Sb=Sb)
    return rows


# The spills the kernel's tiles leave (docs/kernels.md, "Tiles per head dim"): (target, head dim, dtype, kernel) ->
# the most spill-store bytes allowed. --check fails on any other spill, on more than this, and on a known spill
# that is gone (take it off the list).
KNOWN_SPILLS = {
    ("h100", 256, "float32", "dkv"): 4428,
    ("a100", 256, "float32", "dkv"): 4448,
}


def problems(rows) -> list[str]:
    out = []
    for r in rows:
        known = KNOWN_SPILLS.get((r["target"], r["H"], r["dtype"], r["kernel"]))
        if "error" in r:
            out.append(f"{r['target']} H{r['H']} {r['dtype']}: does not compile: {r['error'][:200]}")
        elif (r["spill_stores"] or r["spill_loads"]) and (known is None or r["spill_stores"] > known):
            out.append(f"{r['target']} H{r['H']} {r['dtype']} {r['kernel']}: spills {r['spill_stores']} bytes")
        elif known is not None and not r["spill_stores"]:
            out.append(f"{r['target']} H{r['H']} {r['dtype']} {r['kernel']}: no longer spills; off KNOWN_SPILLS")
        elif r["shared_bytes"] > SHARED_LIMIT[r["target"]]:
            out.append(
                f"{r['target']} H{r['H']} {r['dtype']} {r['kernel']}: {r['shared_bytes']} bytes of shared memory"
            )
    return out


SHORT = {"bfloat16": "bf16", "float32": "f32", "float16": "fp16"}


def markdown(rows) -> str:
    lines = [
        "| target | H | dtype | kernel | Tb x Sb | warps | registers | spill stores / loads (bytes) | shared (bytes) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        dtype = SHORT.get(r["dtype"], r["dtype"])
        if "error" in r:
            lines.append(f"| {r['target']} | {r['H']} | {dtype} | all | | | | does not compile | |")
            continue
        spills = f"{r['spill_stores']} / {r['spill_loads']}"
        lines.append(
            f"| {r['target']} ({r['arch']}) | {r['H']} | {dtype} | {r['kernel']} | {r['Tb']} x {r['Sb']} | "
            f"{r['num_warps']} | {r['registers']} | {spills} | {r['shared_bytes']} |"
        )
    return "\n".join(lines)


def summary(rows) -> str:
    """docs/kernels.md's table: a line per (target, head dim, dtype), its three kernels side by side."""
    lines = [
        "| target | H | dtype | Tb x Sb, warps | registers fwd / dq / dkv | spill stores fwd / dq / dkv (bytes) "
        "| shared, largest (bytes) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    groups = {}
    for r in rows:
        groups.setdefault((r["target"], r["H"], r["dtype"]), []).append(r)
    for (target, H, dtype), kernels in groups.items():
        head = f"| {target} | {H} | {SHORT.get(dtype, dtype)} |"
        if "error" in kernels[0]:
            lines.append(f"{head} | does not compile | | |")
            continue
        k = {r["kernel"]: r for r in kernels}
        order = [k[name] for name in ("forward", "dq", "dkv")]
        regs = " / ".join(str(r["registers"]) for r in order)
        spills = " / ".join(str(r["spill_stores"]) for r in order)
        shared = max(r["shared_bytes"] for r in order)
        first = order[0]
        lines.append(f"{head} {first['Tb']} x {first['Sb']}, {first['num_warps']} | {regs} | {spills} | {shared} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", default="h100,a100")
    parser.add_argument("--heads", default="64,80,128,256")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--tiles", default="", help="Tb,Sb,num_warps for every program (a probe)")
    parser.add_argument("--check", action="store_true", help="exit 1 on a new spill or a shared-memory overrun")
    parser.add_argument("--json", default=str(RESULTS))
    parser.add_argument("--table", action="store_true", help="print --json's summary table; compile nothing")
    args = parser.parse_args(argv)
    if args.table:
        print(summary(json.loads(Path(args.json).read_text())["rows"]))
        return 0
    tiles = tuple(int(x) for x in args.tiles.split(",")) if args.tiles else None
    rows = []
    start = time.perf_counter()
    for target in args.targets.split(","):
        device = ct.topology_device(target)
        for H in (int(h) for h in args.heads.split(",")):
            for dtype in args.dtypes.split(","):
                for row in measure(target, device, H, dtype, tiles):
                    rows.append(row)
                    print(markdown([row]).splitlines()[-1], flush=True)
    wall = round(time.perf_counter() - start, 1)
    found = problems(rows)
    report = dict(jax=jax.__version__, ptxas=ptxas_version(), T=T, N=N, tiles=tiles, wall_s=wall, rows=rows)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{len(rows)} kernels in {wall} s")
    for problem in found:
        print(f"PROBLEM: {problem}")
    return 1 if args.check and found else 0


def ptxas_version() -> str:
    done = subprocess.run([ptxas(), "--version"], capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 else "unknown"


if __name__ == "__main__":
    sys.exit(main())
