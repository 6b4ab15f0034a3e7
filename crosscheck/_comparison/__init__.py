"""one computation in JAX and torch on the same numbers, measured (compare, tolerances)."""
