"""train_report: a torch training run against the same run in JAX (optax), step by step."""
