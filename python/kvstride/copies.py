"""Rows for the core's block copies (``_core._save_rows`` / ``_load_rows``), one builder for
the arena's slots and the staging pool alike.

A copy moves every piece of a set of blocks: piece ``p`` of entry ``i`` lies at
``src_base[p] + src_index[i] * src_stride[p]`` on one side and ``dst_base[p] + dst_index[i] *
dst_stride[p]`` on the other (a KV tensor: base of block 0, block id, block stride; a slot:
the piece's offset in slot 0, slot id, slot size; staging: the piece in the first entry's
row, the entry's position, the row's bytes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

import numpy as np

__all__ = ["CopyRun", "copy_rows"]


@dataclass
class CopyRun:
    """Entries of one group: per piece bases, strides and sizes (uint64 arrays), per entry
    the indices on each side, and each entry's index in the caller's order."""

    src_base: np.ndarray
    src_stride: np.ndarray
    src_index: np.ndarray
    dst_base: np.ndarray
    dst_stride: np.ndarray
    dst_index: np.ndarray
    size: np.ndarray
    order: np.ndarray


def _addresses(base: np.ndarray, index: np.ndarray, stride: np.ndarray) -> np.ndarray:
    return (base[None, :] + index.astype(np.uint64)[:, None] * stride[None, :]).ravel()


def copy_rows(runs: Iterable[CopyRun]) -> Optional[Tuple[np.ndarray, ...]]:
    """(source addresses, destination addresses, lengths, row_start, order) of ``runs``, one
    row per entry (its pieces from ``row_start[i]``), runs in turn; None without an entry."""
    src, dst, length, counts, order = [], [], [], [], []
    for run in runs:
        if not len(run.order):
            continue
        src.append(_addresses(run.src_base, run.src_index, run.src_stride))
        dst.append(_addresses(run.dst_base, run.dst_index, run.dst_stride))
        length.append(np.broadcast_to(run.size, (len(run.order), len(run.size))).ravel())
        counts.append(np.full(len(run.order), len(run.size), dtype=np.uint64))
        order.append(np.asarray(run.order, dtype=np.int64))
    if not src:
        return None
    src, dst, length = (np.ascontiguousarray(np.concatenate(x), dtype=np.uint64) for x in (src, dst, length))
    row_start = np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.uint64)
    return src, dst, length, row_start, np.concatenate(order)
