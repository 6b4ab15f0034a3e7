"""The attention engines: dense (one [...,N,T,S] array), pairwise (per-pair tables), blockwise (O(T+S)
tiles), ring (blockwise tiles sharded over a mesh), and `dispatch`, which picks dense or blockwise.

Engines build on _core only; `dispatch` sits above dense and blockwise and imports both.
"""
