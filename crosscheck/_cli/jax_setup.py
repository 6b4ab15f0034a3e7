"""How crosscheck's runs set JAX up: x64 on, and JAX's persistent compilation cache (the catalogue's CLI, its
worker processes and the certify command all start here)."""

from __future__ import annotations

from pathlib import Path


def configure_jax(cache_dir: str | None = None) -> None:
    """x64 on (float32 rows still pass explicit float32 arrays), and JAX's persistent compilation cache.

    A run spends its time compiling (each eager operation of a "plain" row is its own small XLA program),
    and the same programs come back in every run and in every worker: cached, a second run is ~5x faster.
    The cache is JAX's own, keyed by the program, the compile options and the jax/jaxlib versions, so a
    cached executable is the executable a fresh compile would produce.
    """
    import jax

    jax.config.update("jax_enable_x64", True)
    if cache_dir:
        try:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # an unwritable cache only costs time
        else:
            jax.config.update("jax_compilation_cache_dir", str(cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
            jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
