"""certify / record: any PyTorch model against any JAX port (golden files, layer maps, gradients)."""
