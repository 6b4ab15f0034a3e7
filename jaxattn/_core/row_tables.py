"""RowTables: per-row table terms read at a row of the pair's offset (DeBERTa's disentangled attention).

    logits[n,t,s] += q_t . key_rows[row] + k_s . query_rows[row],   row = row_of_offset[clip(j - i, lo, hi) - lo]

with j - i = key_pos[s] - query_pos[t]. key_rows / query_rows are [R,(N,)H] (either may be None); row_of_offset
is int32 [hi - lo + 1], every entry in [0, R). The scheme that builds one (jaxattn._schemes.disentangled) keeps
its own formula for the rows (DeBERTa's log buckets, clipped to the table) and promises that clipping j - i
to [lo, hi] is exact for every position the call produces: beyond the band the row is constant (the
buckets' saturation) or no pair reaches (the default positions' range). A kernel then reads the rows by an
integer gather (no bucket formula inside it), computes q . key_rows^T per query row and k . query_rows^T per
key row outside its tiles, and picks both at each pair's row (the Pallas GPU kernel: flash_gpu, offset_tables).

The XLA engines never receive a call with one: the scheme computes the same terms its own way there.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: holds arrays; hashed by identity like a closure
class RowTables:
    """The two per-row table terms of a call (module docstring)."""

    key_rows: Any  # [R,(N,)H] or None: q_t . key_rows[row] (DeBERTa's Kr, content -> position)
    query_rows: Any  # [R,(N,)H] or None: k_s . query_rows[row] (DeBERTa's Qr, position -> content)
    row_of_offset: Any  # int32 [hi - lo + 1]: the row of each offset lo..hi
    lo: int
    hi: int
    rows: int  # R, the tables' rows

    @property
    def has_key_rows(self) -> bool:
        return self.key_rows is not None

    @property
    def has_query_rows(self) -> bool:
        return self.query_rows is not None
