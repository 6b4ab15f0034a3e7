"""Test-wide settings.

float64 is switched on deliberately, once, before any array is made: without it JAX silently computes
"float64" references in float32, the classic false pass. float32 tests pass explicit float32 arrays.

Two XLA CPU compiler settings for the test session (set before JAX's CPU backend starts, i.e. before the
first array): the tests compile thousands of small programs (every eager op of a new shape is one) and run
each a few times, so compiling dominates.
- LLVM optimisation off: about 40% less CPU (tests/test_nnx.py + tests/test_cache.py: 140 s -> 87 s CPU).
- XLA CPU's classic elemental emitters for fusions instead of the newer MLIR fusion emitters: another ~35%
  (tests/test_layer_qk_norm.py + tests/test_cache.py: 34 -> 21 CPU-s, 2026-11-25). Same HLO, same ops.
- One LLVM module per program (parallel codegen split count 1): XLA splits a program's code into parts it
  compiles on several threads, which only contend with the other xdist worker on 2 cores; about 17% less CPU
  (tests/test_keywords.py + test_blockwise.py + test_linen.py: 82 -> 68 CPU-s, 2026-11-26). Same code.
Numerics stay IEEE (same ops, no fast-math either way); buffer assignment, which the memory tests read, runs
before code generation and is unchanged. `python -m crosscheck --all` (CI) runs with XLA's defaults, so the
default code generation is proven against torch there. Subprocesses started by tests inherit the flags
unless they set XLA_FLAGS themselves.
"""

import os
import pathlib
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
    " --xla_cpu_parallel_codegen_split_count=1"
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_enable_x64", True)

# tests/helpers.py asserts on behalf of the tests (assert_float64, check_forward_and_grads): let pytest show the
# values in those assertions too.
pytest.register_assert_rewrite("helpers")


def pytest_configure(config):
    """Every compiled program goes to one JAX persistent cache in pytest's cache dir (.pytest_cache/d/xla):
    the two xdist workers share what both compile (the same small eager programs recur across files),
    and a second run reads instead of compiling (about 2.5x faster warm; docs/performance.md, "The test
    suite"). The key hashes program, flags and versions, so a hit is the identical program.
    `--cache-clear` or `-p no:cacheprovider` runs cold.

    JAXATTN_TEST_XLA_CACHE=DIR puts the cache in DIR instead, kept across runs and checkouts (CI's slow group:
    .ci/run, which empties it past 4 GiB). JAX's own bound (jax_compilation_cache_max_size) is not set: with it,
    every write lists and stats the whole directory under a file lock to pick what to evict, O(entries) per
    compiled program. With 15684 files there, one hypothesis test of the slow group took 1180 s with the bound
    and 35 s without (2026-11-27, tests/test_kernel_schedule.py, the random rules)."""
    persistent = os.environ.get("JAXATTN_TEST_XLA_CACHE")
    cache = getattr(config, "cache", None)
    if persistent:
        jax.config.update("jax_compilation_cache_dir", persistent)
    elif cache is not None:
        jax.config.update("jax_compilation_cache_dir", str(cache.mkdir("xla")))
    else:
        return
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # The interpreters tests start (the docs' examples, the 8-device and 2-process runs) read and write the same
    # cache through JAX's environment variables: in CI's slow group their programs are hits from the last run
    # (the docs' examples alone compiled for about 230 s of it).
    os.environ["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"


SLOW_CASES = pathlib.Path(__file__).with_name("slow_cases.txt")


def slow_cases() -> set:
    """The node ids tests/slow_cases.txt lists (its # comments and blank lines aside)."""
    lines = (line.split("#", 1)[0].strip() for line in SLOW_CASES.read_text().splitlines())
    return {line for line in lines if line}


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection, which must see the marks
def pytest_collection_modifyitems(config, items):
    """Mark tests/slow_cases.txt's cases `slow`. A run of the whole suite (no paths given: testpaths) fails on
    a listed id that no test has, so a rename cannot silently return a case to the default group."""
    listed = slow_cases()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.slow)
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        stale = sorted(listed - {item.nodeid for item in items})
        if stale:
            raise pytest.UsageError(f"tests/slow_cases.txt names tests that do not exist: {stale}")


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """An xdist worker ends here without the interpreter's teardown. Its results reached the controller in
    pytest_sessionfinish ("workerfinished"); what is left is garbage collection for pytest's unraisable-exception
    check (which a finished worker can no longer report) and freeing thousands of compiled programs, torch and
    the modules: 10 s of the default group's 2-core wall time (2026-11-26: the last test at 617.4 s, the
    controller's session finish at 627.7 s), checking nothing. The controller process exits normally."""
    if hasattr(config, "workerinput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
