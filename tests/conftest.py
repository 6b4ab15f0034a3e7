"""Test-wide settings.

float64 is switched on deliberately, once, before any array is made: without it JAX silently computes
"float64" references in float32, the classic false pass. float32 tests pass explicit float32 arrays.

XLA's LLVM optimisation is off for the test session (set before JAX's CPU backend starts, i.e. before the
first array): the tests compile many small programs and run each a few times, so compiling dominates and
this cuts the suite's CPU time by about 40% (tests/test_nnx.py + tests/test_cache.py: 140 s -> 87 s CPU).
Numerics stay IEEE (same ops, no fast-math either way); buffer assignment, which the memory tests read, runs
before LLVM and is unchanged. Subprocesses started by tests inherit it unless they set XLA_FLAGS themselves.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

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
    `--cache-clear` or `-p no:cacheprovider` runs cold."""
    cache = getattr(config, "cache", None)
    if cache is None:
        return
    jax.config.update("jax_compilation_cache_dir", str(cache.mkdir("xla")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
