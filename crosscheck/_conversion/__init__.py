"""torch weights, masks and weight files -> jaxattn (the one mapping table)."""
