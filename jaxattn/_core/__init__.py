"""Foundations every engine, scheme and layer reads: argument checks, dtypes, positions, masks, softmax.

Imports only jax/numpy and its own modules; nothing here knows about engines or layers.
"""
