"""Timing and memory machinery shared by every benchmark case.

Timing: every candidate of a case is compiled and warmed up first (compile time recorded separately),
then the candidates are run round by round in one process, one call each per round, with the order
rotated every round, so slow drifts of machine load hit all candidates alike. Reported: the median.

Memory:
  JAX   XLA's own account of the compiled program: `compiled.memory_analysis()`; `temp` is the scratch
        memory the program needs beyond its arguments and outputs (`temp_size_in_bytes`).
  torch the peak resident-set growth during one call, in a fresh subprocess (torch_memory.py): the
        kernel's high-water mark VmHWM is reset through /proc/self/clear_refs ("5"), the call runs,
        and peak = VmHWM - VmRSS before the call. torch's CPU allocator does not cache, and glibc
        serves the large tensors with mmap, so this is the peak of live tensors (outputs included).
        tracemalloc cannot see torch's allocations, which is why this route is used.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable, Optional

import numpy as np


@dataclasses.dataclass
class Candidate:
    name: str
    run: Callable[[], Any]  # one call, blocking until the result is ready
    flops: Optional[float] = None  # nominal floating-point operations of one call
    compile_s: Optional[float] = None
    temp_bytes: Optional[int] = None  # XLA temp (JAX candidates)
    output_bytes: Optional[int] = None
    torch_memory: Optional[dict] = None  # spec for torch_memory.py (torch candidates)
    peak_bytes: Optional[int] = None  # measured torch peak RSS growth
    times: list = dataclasses.field(default_factory=list)
    cpu_times: list = dataclasses.field(default_factory=list)  # process CPU seconds of the same calls
    note: str = ""
    timed: bool = True  # False: compiled for its memory analysis only

    @property
    def median_s(self):
        return float(np.median(self.times)) if self.times else None

    @property
    def median_cpu_s(self):
        return float(np.median(self.cpu_times)) if self.cpu_times else None

    def summary(self):
        return {
            "median_s": self.median_s,
            "times_s": self.times,
            "median_cpu_s": self.median_cpu_s,
            "cpu_times_s": self.cpu_times,
            "flops": self.flops,
            "gflops_per_s": self.flops / self.median_s / 1e9 if self.flops and self.times else None,
            "compile_s": self.compile_s,
            "temp_bytes": self.temp_bytes,
            "output_bytes": self.output_bytes,
            "peak_bytes": self.peak_bytes,
            "note": self.note,
        }


def jax_candidate(name, fn, *args, flops=None, note="", run=True):
    """jit + lower + compile (timed), XLA memory analysis, one warm-up call."""
    import jax

    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    cand = Candidate(
        name,
        lambda: jax.block_until_ready(compiled(*args)),
        flops=flops,
        compile_s=compile_s,
        temp_bytes=int(memory.temp_size_in_bytes),
        output_bytes=int(memory.output_size_in_bytes),
        note=note,
    )
    if run:
        cand.run()
    cand.timed = run
    return cand


def torch_candidate(name, fn, *, flops=None, memory_spec=None, note="", threads=None):
    """A torch callable; warmed up once. memory_spec: a spec for torch_memory.py (or None).

    threads: torch.set_num_threads before every call (None: torch's default, one per core). On a loaded
    machine OpenMP's barriers make the default much slower than one thread for small ops, so cases
    time both and compare against the faster.
    """
    import torch

    default = torch.get_num_threads()

    def run():
        torch.set_num_threads(threads or default)
        return fn()

    run()
    return Candidate(name, run, flops=flops, torch_memory=memory_spec if not threads else None, note=note)


def time_rounds(candidates, rounds):
    """Interleave: each round calls every candidate once, in an order rotated by the round number.

    Records wall time and this process's CPU time (all threads) of every call. On a machine loaded by
    other jobs wall time swings with their load; CPU time much less (it still counts spin-waiting
    threads and cache contention), so with one pinned core (`taskset -c 0`, one thread) it is the
    steadier figure for comparing candidates."""
    candidates = [c for c in candidates if c.timed]
    for r in range(rounds):
        order = candidates[r % len(candidates) :] + candidates[: r % len(candidates)]
        for cand in order:
            start, cpu = time.perf_counter(), time.process_time()
            cand.run()
            cand.times.append(time.perf_counter() - start)
            cand.cpu_times.append(time.process_time() - cpu)


def measure_torch_memory(specs):
    """Run torch_memory.py once in a fresh process for all specs; returns a list of peak bytes."""
    if not specs:
        return []
    worker = os.path.join(os.path.dirname(__file__), "torch_memory.py")
    # A fixed mmap threshold turns off glibc's adaptive one, so every tensor over 64 KiB is mmapped and
    # unmapped on free: RSS then follows live tensors instead of a heap that keeps freed memory.
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(
        [sys.executable, worker], input=json.dumps(specs), capture_output=True, text=True, timeout=600, env=env
    )
    if proc.returncode != 0:
        raise RuntimeError(f"torch memory worker failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load_average():
    try:
        return os.getloadavg()
    except OSError:
        return None
