"""Relative-position schemes on top of the engines: Shaw and clipped tables, T5, ALiBi, RoPE, Transformer-XL,
and the position-bias hook that lets a scheme run on the blockwise engine one tile at a time."""
