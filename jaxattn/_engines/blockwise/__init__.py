"""Blockwise (memory-efficient) attention: an online softmax over key blocks, O(T + S) memory.

    for each query block i                                        (lax.scan)
        for each key block j that may hold an allowed key         (while loops over the scheduled tiles)
            x_ij = scale * (q_i k_j^T + q_i . Tk[index_ij] + q_i . A^K_ij) + position_bias(q_pos_i, k_pos_j)
            acc  = combine_partials(acc, block_partial(x_ij, allowed_ij, v_j (+ A^V_ij)))
        out_i = acc.out / acc.l  (+ (bucket sums of p) @ Tv / acc.l for a Shaw value table; windowed
                                   tiles add theirs inside acc.out, buckets.py)

A^K_ij / A^V_ij: the [Tb,Sb,(N),F] tiles of per-pair tables (relative_attention, seed 000's form), read
one tile at a time from the caller's [T,S,(N),F] arrays (an O(T x S) input): the engine adds no
[B,N,T,S] logits and no [B,T,S,F] product to them.

No array ever spans [T,S]: the largest temporary is one [rows,G,Tb,Sb] tile; blockwise_attention runs
groups of rows (batch entries x key/value heads) one after another (lax.map), each small enough that its
tiles stay in cache (not for sharded inputs: see on_a_device_mesh). Causal and key-padding blocks
that hold no allowed key are never visited. A custom VJP (FlashAttention-2's backward) recomputes each
tile's probabilities from the saved log-sum-exp, so the backward pass is O(T + S) as well. The engine
returns that log-sum-exp too (return_lse), with its gradient: d lse / d x = p, one term in delta.
Tile sizes and row groups: jaxattn._engines.tiles.

Layout inside the engine: batch dims flattened to B, heads viewed as [K,G] (query head n = k*G + g), and
q [B,K,G,T,H], k [B,K,S,H], v [B,K,S,Hv] so every tile product is one batched matmul whose rows are the G
query heads sharing a key/value head (grouped-query attention never copies keys or values).

The modules, one job each (each imports only those above it):
  values     the named values: Config and Terms (static), Side, QueryTile, KeySide, Shared,
             RowGrads, Grads (what a tile reads and adds into)
  layout     the engine layout's small operations: tile products, head views, dynamic slices
  buckets    Shaw relative buckets: a tile's bucket index, gathers and bucket sums, table products, and the
             windowed tiles' rows (a tile's own Tb + Sb - 1 offsets, default positions)
  pairs      per-pair tables [T,S,N|1,F]: one tile's slice, and its gradient added back
  logits     one tile's logits (tables, hook, softcap, score_mod) and its mask
  schedule   which key tiles a query tile visits, and the loop over them
  forward    fwd_tile: one query tile's online softmax
  backward   bwd_tile, zero_grads: one query tile's gradients (FlashAttention-2's backward)
  vjp        the engine over every query tile, with its custom VJP
  groups     row groups: whether rows are grouped, and the engine run one group at a time
  inputs     the entry's checks of its inputs and the layout changes to and from the engine
  entry      blockwise_attention and tiled

The surface other modules drive (the ring engine, the dispatch, the schemes, the kernels):
  blockwise_attention: the public entry point (keywords); tiled(call, ...): the same for an AttentionCall
    (what the dispatch in jaxattn._dispatch, the schemes and the kernels' empty-input path call);
  Config, fwd_tile, bwd_tile, zero_grads: one query tile against a run of keys, forward/backward,
    their arguments named: QueryTile (the tile), KeySide (every key it runs against), Shared (tables,
    hook arrays, scale), RowGrads (the backward's per-row inputs), Grads (the accumulators);
  convert_hook, check_tables, slice_block: the pieces of the entry point;
  position_bias hook: any logit term that is a function of positions only (T5, ALiBi), one tile at a time.
The online-softmax merge (combine_partials, ...) and the mask rule (allowed_pairs, key_block_schedule) are
_core's (softmax.py, masks.py), shared with the dense engine.
"""

from .backward import bwd_tile, zero_grads
from .buckets import contiguous_bucket_sums
from .entry import blockwise_attention, tiled
from .forward import fwd_tile
from .groups import on_a_device_mesh
from .inputs import TABLE_LAYOUT, check_tables, convert_hook
from .layout import slice_block
from .pairs import add_pair_tile, pair_tile
from .values import Config, Grads, KeySide, QueryTile, RowGrads, Shared, Side, Terms
from .vjp import Residuals

__all__ = [
    "TABLE_LAYOUT",
    "Config",
    "Grads",
    "KeySide",
    "QueryTile",
    "Residuals",
    "RowGrads",
    "Shared",
    "Side",
    "Terms",
    "add_pair_tile",
    "blockwise_attention",
    "bwd_tile",
    "check_tables",
    "contiguous_bucket_sums",
    "convert_hook",
    "fwd_tile",
    "on_a_device_mesh",
    "pair_tile",
    "slice_block",
    "tiled",
    "zero_grads",
]
