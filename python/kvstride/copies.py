"""Rows for the core's block copies (``_core._save_rows`` / ``_load_rows`` / ``_copy_regions``),
one builder for the arena's slots and the staging pool alike.

A copy moves every piece of a set of blocks between the KV cache and *entries*: places where a
block's pieces lie back to back, in order (an arena slot, a staged payload). Piece ``p`` of a
block ``b`` lies at ``base[p] + b * stride[p]`` in the KV cache and at ``entry + start[p]`` in
its entry. One table holds the pieces of every group, so that a batch's rows are a few array
operations whatever its groups: a step of a hybrid model saves a block of each of several
groups, and work per group was most of a small step's cost (``benches/save_step.py``)."""

from __future__ import annotations

from typing import Tuple

import numpy as np

from .layout import KVLayout

__all__ = ["PieceTable"]


class PieceTable:
    """Every group's pieces of ``layout``: per piece its address in block 0, its block stride,
    its size and its start in an entry (uint64 arrays), group ``g``'s pieces being
    ``count[g]`` rows from ``first[g]``."""

    def __init__(self, layout: KVLayout) -> None:
        groups = [layout.piece_addresses(g) for g in range(len(layout.groups))]
        counts = [len(size) for _, _, size in groups]
        self.count = np.array(counts, dtype=np.int64)
        self.first = np.cumsum([0, *counts[:-1]]).astype(np.int64)
        self.base, self.stride, self.size = (
            np.concatenate([group[k] for group in groups]).astype(np.uint64) for k in range(3)
        )
        self.start = np.concatenate([np.cumsum([0, *size[:-1]]) for _, _, size in groups]).astype(np.uint64)

    def piece_start(self, group: int, piece: int) -> int:
        """Where piece ``piece`` of ``group`` starts in an entry."""
        return int(self.start[self.first[group] + piece])

    def rows(self, groups: np.ndarray, block_ids: np.ndarray, entries: np.ndarray) -> Tuple[np.ndarray, ...]:
        """(KV addresses, entry addresses, lengths, row_start) of every piece of the blocks
        ``(groups[i], block_ids[i])`` whose entries start at ``entries[i]``: entry ``i``'s
        pieces are rows ``row_start[i]`` to ``row_start[i + 1]``, in its order."""
        counts = self.count[groups]
        ends = np.cumsum(counts)
        row_start = np.zeros(len(counts) + 1, dtype=np.uint64)
        row_start[1:] = ends
        total = int(ends[-1]) if len(ends) else 0
        piece = np.arange(total) + np.repeat(self.first[groups] - (ends - counts), counts)
        kv = self.base[piece] + np.repeat(np.asarray(block_ids, dtype=np.uint64), counts) * self.stride[piece]
        at = np.repeat(np.asarray(entries, dtype=np.uint64), counts) + self.start[piece]
        return kv, at, self.size[piece], row_start
