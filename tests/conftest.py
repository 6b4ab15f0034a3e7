"""Test-wide settings.

float64 is switched on deliberately, once, before any array is made: without it JAX silently computes
"float64" references in float32, the classic false pass. float32 tests pass explicit float32 arrays.
"""

import jax

jax.config.update("jax_enable_x64", True)
