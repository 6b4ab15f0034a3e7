"""Hugging Face models: small random checkpoints, attention references, layer_report."""
