"""The attention engines: dense (one [...,N,T,S] array), pairwise (per-pair tables), blockwise (O(T+S)
tiles), ring (blockwise tiles sharded over a mesh), flex (create_block_mask) and tiles (the tile policy).

Engines build on _core only; the choice between them (and the kernels) is jaxattn._dispatch's, above them all.
"""
