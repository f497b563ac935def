"""The arena's device data path: blocks of KV tensors on a device (CUDA) to and from the arena's
pinned host slots, at the host link's speed.

A save gathers the blocks' pieces on the device into a staging buffer laid out as the slots are
(each block's pieces back to back, in slot order), then copies it to the pinned slots in as few
copies as the slots allow: one per run of consecutive slots. A load is the reverse: the slots'
runs to device staging, then each piece scattered into its destination blocks. The gathers and
the copies run on a side stream that first waits for the work the caller queued on its own
stream; the caller's stream then waits (on the device, never the host) only for the gathers, so
later kernels cannot overwrite a block before it was read, and the host-link copy overlaps them.
Staging is bounded (``STAGE_BYTES`` a chunk): a save larger than that goes chunk by chunk, each
chunk's gather after the previous chunk's copy on the same stream.

The same code runs on CPU tensors (no streams: every copy is done when it returns), which is how
the CPU test tier checks it; the arena uses it for device tensors only (the Rust region copies
are faster on CPU).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["DeviceCopier", "STAGE_BYTES", "slot_runs"]

#: Device staging of one chunk at most: what a save or a load moves between two host-link copies.
STAGE_BYTES = 256 << 20


def slot_runs(slots: np.ndarray) -> List[Tuple[int, int, int]]:
    """``(position, first slot, count)`` of each run of consecutive slots in ``slots`` (in
    order): one host-link copy each."""
    if not len(slots):
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(slots)]])
    return [(int(a), int(slots[a]), int(b - a)) for a, b in zip(starts, ends)]


class DeviceCopier:
    """Copies blocks of ``layout`` between the device and the host buffer ``host`` (uint8, one
    ``slot_bytes`` slot after another; pinned for CUDA). ``kv_view(group, piece)`` gives a
    piece's KV view ``(num_blocks, size)`` and ``piece_start(group, piece)`` its offset in a
    slot."""

    def __init__(self, layout, host: torch.Tensor, slot_bytes: int, kv_view: Callable, piece_start: Callable,
                 stage_bytes: int = STAGE_BYTES) -> None:
        self.layout = layout
        self.host = host
        self.slot_bytes = int(slot_bytes)
        self.device = layout.device or torch.device("cpu")
        self._kv_view = kv_view
        self._piece_start = piece_start
        self._pieces = [len(g.pieces) for g in layout.groups]
        self.chunk_slots = max(1, int(stage_bytes) // self.slot_bytes)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    # ---- saves -------------------------------------------------------------------------

    def save(self, slots: np.ndarray, groups: np.ndarray, block_ids: np.ndarray, after=None):
        """Copy each block into its slot; returns an event (CUDA) that completes when every
        byte is in the host slots, or None when they are (CPU). ``after``: an event the
        gathers follow (default: the work queued on the calling thread's current stream)."""
        order = np.argsort(slots, kind="stable")
        slots, groups, block_ids = slots[order], groups[order], block_ids[order]
        caller = self._caller_stream()
        with self._on_side(caller, after):
            for lo in range(0, len(slots), self.chunk_slots):
                hi = min(lo + self.chunk_slots, len(slots))
                # Zeros: a slot's bytes past its block (a smaller group's) are copied too.
                staging = torch.zeros((hi - lo, self.slot_bytes), dtype=torch.uint8, device=self.device)
                self._gather(staging, groups[lo:hi], block_ids[lo:hi])
                if caller is not None:  # later kernels on the caller's stream wait for the reads alone
                    gathered = torch.cuda.Event()
                    gathered.record(self._stream)
                    caller.wait_event(gathered)
                for position, first, count in slot_runs(slots[lo:hi]):
                    host = self.host[first * self.slot_bytes:(first + count) * self.slot_bytes].view(count, self.slot_bytes)
                    host.copy_(staging[position:position + count], non_blocking=self._stream is not None)
            return self._done()

    def _gather(self, staging: torch.Tensor, groups: np.ndarray, block_ids: np.ndarray) -> None:
        for g, rows, ids in self._by_group(groups, block_ids):
            for j in range(self._pieces[g]):
                kv = self._kv_view(g, j)
                self._staging_piece(staging, g, j, kv.shape[1]).index_copy_(0, rows, kv.index_select(0, ids))

    # ---- loads -------------------------------------------------------------------------

    def load(self, slots: np.ndarray, groups: np.ndarray, block_ids: np.ndarray, after=None):
        """Copy each slot into its destination block; returns an event (CUDA) that completes
        when every block is written, or None when they are (CPU). ``after``: an event the
        writes follow (default: the work queued on the calling thread's current stream)."""
        order = np.argsort(slots, kind="stable")
        slots, groups, block_ids = slots[order], groups[order], block_ids[order]
        with self._on_side(self._caller_stream(), after):
            for lo in range(0, len(slots), self.chunk_slots):
                hi = min(lo + self.chunk_slots, len(slots))
                staging = torch.empty((hi - lo, self.slot_bytes), dtype=torch.uint8, device=self.device)
                for position, first, count in slot_runs(slots[lo:hi]):
                    host = self.host[first * self.slot_bytes:(first + count) * self.slot_bytes].view(count, self.slot_bytes)
                    staging[position:position + count].copy_(host, non_blocking=self._stream is not None)
                for g, rows, ids in self._by_group(groups[lo:hi], block_ids[lo:hi]):
                    for j in range(self._pieces[g]):
                        kv = self._kv_view(g, j)
                        kv.index_copy_(0, ids, self._staging_piece(staging, g, j, kv.shape[1]).index_select(0, rows))
            return self._done()

    # ---- helpers -----------------------------------------------------------------------

    def _by_group(self, groups: np.ndarray, block_ids: np.ndarray):
        """(group, staging rows, block ids) per group, the index tensors on the device."""
        out = []
        for g in np.unique(groups):
            (rows,) = np.nonzero(groups == g)
            out.append((
                int(g),
                torch.from_numpy(rows.astype(np.int64)).to(self.device, non_blocking=True),
                torch.from_numpy(block_ids[rows].astype(np.int64)).to(self.device, non_blocking=True),
            ))
        return out

    def _staging_piece(self, staging: torch.Tensor, group: int, piece: int, size: int) -> torch.Tensor:
        """The ``(rows, size)`` view of one piece in every staged slot."""
        return staging.as_strided((staging.shape[0], size), (self.slot_bytes, 1), self._piece_start(group, piece))

    def _caller_stream(self):
        return torch.cuda.current_stream(self.device) if self._stream is not None else None

    def _on_side(self, caller, after):
        """The side stream, ordered after ``after`` (or the caller's stream); a no-op on CPU."""
        if self._stream is None:
            return _NoStream()
        if after is not None:
            self._stream.wait_event(after)
        else:
            self._stream.wait_stream(caller)
        return torch.cuda.stream(self._stream)

    def _done(self) -> Optional["torch.cuda.Event"]:
        if self._stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self._stream)
        return event


class _NoStream:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
