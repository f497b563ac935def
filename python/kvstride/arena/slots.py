"""The embedded store's bytes, on each vLLM worker: one preallocated arena of fixed-size slots
per rank (:mod:`kvstride.arena` says how the two sides fit). Each slot keeps the XXH3 digest
of the value written into it; a load checks it before scattering, and a mismatch fails the
load (vLLM recomputes).

One copy each way: a save copies block pieces from the KV cache straight into the slot, a
load from the slot straight into the destination blocks (raw region copies in the Rust core,
GIL released, spread over cores for large batches). Device tensors go through
:mod:`kvstride.arena.device` chunk by chunk: copy kernels that read and write the pinned
slots, the copy engine for a load's runs of slots, a save through device staging whose
gathers the caller fences before it writes their blocks again (``KVLayout.fence``).
"""

from __future__ import annotations

import mmap
import threading
from typing import Callable, List, Optional

import numpy as np
import torch

from kvstride import _core
from kvstride.arena.device import DeviceCopier, recorded
from kvstride.arena.disk import DISK_ALIGN, DiskLane, DiskRecords, DiskSpec
from kvstride.arena.index import ALIGN
from kvstride.copies import PieceTable
from kvstride.host_memory import host_buffer
from kvstride.layout import KVLayout
from kvstride.stores.base import Status

__all__ = ["HostArena", "ArenaSlots", "VALUE_GROUP"]

#: ``HostArena.slot_group`` of a slot holding a value written through ``save_regions``.
VALUE_GROUP = -2


class HostArena:
    """``num_slots`` fixed-size slots in one preallocated host buffer (pinned when the KV cache
    is on CUDA), touched once at construction so the hot path takes no page faults.

    ``save`` / ``load`` take parallel arrays (slot, group, block id), one entry per block of
    the attached ``layout``; ``save_regions`` / ``load_regions`` take values as raw byte parts
    (the store protocol). Without a layout (``slot_bytes`` then sizes the slots) only the
    region forms work until :meth:`attach` gives it one."""

    def __init__(
        self,
        layout: Optional[KVLayout],
        num_slots: int,
        *,
        copier: Optional[str] = None,
        slot_bytes: Optional[int] = None,
        stored_groups=None,
        align: int = ALIGN,
        pin: Optional[bool] = None,
    ) -> None:
        if layout is None and slot_bytes is None:
            raise ValueError("HostArena needs a layout or slot_bytes")
        # The groups whose blocks are saved here (None: all): a scratch ring's need no room.
        self.stored_groups = None if stored_groups is None else tuple(int(g) for g in stored_groups)
        size = slot_bytes if slot_bytes is not None else self._largest_block(layout)
        # ``align``: where each slot starts (a disk tier's direct I/O needs its block size).
        self.slot_bytes = -(-int(size) // align) * align
        if self.slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be positive, got {slot_bytes}")
        self.num_slots = int(num_slots)
        if pin is None:
            pin = layout is not None and layout.on_cuda
        nbytes = self.num_slots * self.slot_bytes
        # Page-aligned, exactly its size (pinned for the device's copies on CUDA); an alignment
        # past a page takes the slack.
        slack = 0 if mmap.PAGESIZE % align == 0 else align - 1
        raw = host_buffer(nbytes + slack, pin=pin, what="the embedded store's arena")
        start = (-raw.data_ptr()) % align
        self.buffer = raw[start : start + nbytes]
        self.pinned = bool(pin)
        self.ptr = self.buffer.data_ptr()
        self.digests = np.zeros(self.num_slots, dtype=np.uint64)
        self.lengths = np.zeros(self.num_slots, dtype=np.uint64)  # bytes of the value in each slot
        self.slot_group = np.full(self.num_slots, -1, dtype=np.int64)  # -1: never written
        self.layout: Optional[KVLayout] = None
        self.copier = "regions"
        self._device: Optional[DeviceCopier] = None  # the "device" copier's
        self._pieces: Optional[PieceTable] = None
        self.block_bytes = np.zeros(0, dtype=np.uint64)
        if layout is not None:
            self.attach(layout, copier=copier)

    def attach(self, layout: KVLayout, *, copier: Optional[str] = None) -> None:
        """Copy blocks of ``layout`` from now on (its stored groups' blocks must fit a slot)."""
        largest = self._largest_block(layout)
        if largest > self.slot_bytes:
            raise ValueError(
                f"slot_bytes={self.slot_bytes} is smaller than a block of this KV cache ({largest} bytes); "
                f"give at least {largest}"
            )
        device = layout.device or torch.device("cpu")
        copier = copier or ("regions" if device.type == "cpu" else "device")
        if copier not in ("regions", "device"):
            raise ValueError(f"copier must be 'regions' or 'device', got {copier!r}")
        self.layout, self.copier = layout, copier
        self._pieces = PieceTable(layout)  # a block's pieces fill its slot in order
        self.block_bytes = np.array([g.block_bytes for g in layout.groups], dtype=np.uint64)  # per group
        self._device = None
        if copier == "device":
            self._device = DeviceCopier(layout, self.buffer, self.slot_bytes, self._pieces)

    def _largest_block(self, layout: KVLayout) -> int:
        groups = range(len(layout.groups)) if self.stored_groups is None else self.stored_groups
        return max((layout.groups[g].block_bytes for g in groups), default=1)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def _check(self, slots: np.ndarray, groups: np.ndarray, block_ids: np.ndarray) -> None:
        if self.layout is None:
            raise ValueError("this arena has no KV layout attached: use the region forms or attach() one")
        if not (len(slots) == len(groups) == len(block_ids)):
            raise ValueError("slots, groups and block ids must have the same length")
        if len(slots) and (slots.min() < 0 or slots.max() >= self.num_slots):
            raise ValueError(f"slot out of range 0..{self.num_slots - 1}")
        for g in np.unique(groups):
            if not 0 <= g < len(self.layout.groups):
                raise ValueError(f"group {g} out of range (layout has {len(self.layout.groups)} groups)")
            if self.stored_groups is not None and g not in self.stored_groups:
                raise ValueError(f"group {g} is not stored in this arena (its slots fit groups {self.stored_groups})")
            ids = block_ids[groups == g]
            if ids.min() < 0 or ids.max() >= self.layout.groups[g].num_blocks:
                raise ValueError(f"block id out of range for group {g}")

    def _rows(self, slots, groups, block_ids):
        """The entries as rows for the Rust copy, entry by entry: (KV addresses, slot
        addresses, lengths) of every piece and where each entry's pieces start
        (``row_start``)."""
        return self._pieces.rows(groups, block_ids, self._slot_addresses(slots))

    def _slot_addresses(self, slots: np.ndarray) -> np.ndarray:
        return np.uint64(self.ptr) + slots.astype(np.uint64) * np.uint64(self.slot_bytes)

    def _digest(self, slots: np.ndarray, groups: np.ndarray) -> np.ndarray:
        addrs = np.ascontiguousarray(self._slot_addresses(slots))
        lengths = np.ascontiguousarray(self.block_bytes[groups])
        return _core._xxh3_64_regions(addrs, lengths)

    # ---- saves and loads ----------------------------------------------------------------

    def save(self, slots, groups, block_ids, *, digest: bool = True) -> None:
        """Copy each block into its slot and keep the value's digest (``digest=False``: copy
        only; such slots load only with ``verify=False``)."""
        finish = self.save_begin(slots, groups, block_ids, digest=digest)
        if finish is not None:
            finish()

    def save_begin(self, slots, groups, block_ids, *, digest: bool = True, after=None,
                   urgent: bool = False) -> Optional[Callable[[], None]]:
        """``save`` whose device copies may still be running when it returns: None when it is
        done (the Rust region copies), else ``finish()``, which waits for them and then keeps
        the digests (until then the slots hold no value: call it off the caller's thread). The
        caller fences the blocks (``KVLayout.fence``) before its device work writes them again.
        ``after`` (CUDA): an event the copies follow (default: the work queued on the calling
        thread's current stream); ``urgent``: never queued behind other saves' copies (the
        caller's stream will wait for this one's reads at once)."""
        slots, groups, block_ids = (np.asarray(a, dtype=np.int64) for a in (slots, groups, block_ids))
        self._check(slots, groups, block_ids)
        if self.copier == "regions":
            kv, slot, length, row_start = self._rows(slots, groups, block_ids)
            if digest:
                self._keep(slots, groups, _core._save_rows(kv, slot, length, row_start))
            else:
                _core._copy_regions(kv, slot, length)
                self._keep(slots, groups, 0)
            return None
        chunks, found = self._device.save(slots, groups, block_ids, after=after, digests=digest, urgent=urgent)

        def finish() -> None:
            digests = np.zeros(len(slots), dtype=np.uint64)
            for part, copied in chunks:  # each chunk's digests while the next one copies
                if copied is not None:
                    copied.synchronize()
                if digest and found is None:
                    digests[part] = self._digest(slots[part], groups[part])
            if found is not None:  # taken on the device
                digests = found.numpy().view(np.uint64)
            self._keep(slots, groups, digests)

        return finish

    def _keep(self, slots: np.ndarray, groups: np.ndarray, digests) -> None:
        self.digests[slots] = digests
        self.lengths[slots] = self.block_bytes[groups]
        self.slot_group[slots] = groups

    def load(self, slots, groups, block_ids, *, verify: bool = True, after=None) -> np.ndarray:
        """Copy each slot into its destination block when the slot holds a value of that group
        whose digest still matches (``verify=False``: without the digest check); returns which
        entries were loaded. ``after`` (CUDA): an event the writes follow (default: the work
        queued on the calling thread's current stream)."""
        slots, groups, block_ids = (np.asarray(a, dtype=np.int64) for a in (slots, groups, block_ids))
        self._check(slots, groups, block_ids)
        # Only a slot holding a value of the block's group can be loaded into it.
        (candidates,) = np.nonzero(self.slot_group[slots] == groups)
        ok = np.zeros(len(slots), dtype=bool)
        if not len(candidates):
            return ok
        s, g, b = slots[candidates], groups[candidates], block_ids[candidates]
        if self.copier == "regions":
            kv, slot, length, row_start = self._rows(s, g, b)
            if verify:
                ok[candidates] = _core._load_rows(slot, kv, length, row_start, self.digests[s])
            else:
                _core._copy_regions(slot, kv, length)
                ok[candidates] = True
            return ok
        def check(part: np.ndarray) -> np.ndarray:  # a chunk's digests while the previous one copies
            if not verify:
                return np.ones(len(part), dtype=bool)
            return self._digest(s[part], g[part]) == self.digests[s[part]]

        good, written = self._device.load(s, g, b, check, after=after, expected=self.digests[s] if verify else None)
        if written is not None:  # the caller is told the blocks are written: they must be
            written.synchronize()
        ok[candidates] = good
        return ok

    # ---- values as raw byte parts (the store protocol) ----------------------------------

    def _region_rows(self, slots: np.ndarray, values):
        """Rows for values given as ``[(address, nbytes), ...]`` parts: each value's parts
        back to back from the start of its slot."""
        addr, length, offset, row_start, totals = [], [], [], [0], []
        for parts in values:
            pos = 0
            for a, n in parts:
                addr.append(a)
                length.append(n)
                offset.append(pos)
                pos += n
            row_start.append(len(addr))
            totals.append(pos)
        addr, length, offset, row_start, totals = (
            np.array(x, dtype=np.uint64) for x in (addr, length, offset, row_start, totals)
        )
        slot_addr = np.repeat(self._slot_addresses(slots), np.diff(row_start).astype(np.int64)) + offset
        return addr, slot_addr, length, row_start, totals

    def save_regions(self, slots, values, *, digest: bool = True) -> None:
        """Copy each value (its parts in order) into its slot; each must fit a slot."""
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots) != len(values):
            raise ValueError("slots and values must have the same length")
        addr, slot_addr, length, row_start, totals = self._region_rows(slots, values)
        if len(totals) and int(totals.max()) > self.slot_bytes:
            raise ValueError(f"a value of {int(totals.max())} bytes does not fit a {self.slot_bytes}-byte slot")
        if digest:
            self.digests[slots] = _core._save_rows(addr, slot_addr, length, row_start)
        else:
            _core._copy_regions(addr, slot_addr, length)
            self.digests[slots] = 0
        self.lengths[slots] = totals
        self.slot_group[slots] = VALUE_GROUP

    def load_regions(self, slots, values, *, verify: bool = True) -> np.ndarray:
        """Copy each slot into the parts of its value when the slot holds a protocol value of
        exactly that length whose digest still matches; returns which were copied."""
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots) != len(values):
            raise ValueError("slots and values must have the same length")
        addr, slot_addr, length, row_start, totals = self._region_rows(slots, values)
        fits = (self.slot_group[slots] == VALUE_GROUP) & (self.lengths[slots] == totals)
        ok = np.zeros(len(slots), dtype=bool)
        (rows,) = np.nonzero(fits)
        if not len(rows):
            return ok
        if len(rows) < len(slots):  # only the rows that fit take part
            keep = [np.arange(row_start[r], row_start[r + 1], dtype=np.int64) for r in rows]
            pieces = np.concatenate(keep) if keep else np.zeros(0, dtype=np.int64)
            counts = np.diff(row_start)[rows]
            row_start = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint64)
            addr, slot_addr, length = addr[pieces], slot_addr[pieces], length[pieces]
        if verify:
            ok[rows] = _core._load_rows(slot_addr, addr, length, row_start, self.digests[slots[rows]])
        else:
            _core._copy_regions(slot_addr, addr, length)
            ok[rows] = True
        return ok


class ArenaSlots:
    """A worker's arena as the store :class:`kvstride.engine.OffloadEngine` copies blocks into
    and out of directly, on its lanes: the keys are the slots the scheduler's index placed
    (``ArenaPlacement``). Slots whose value a load found corrupted are kept for the
    scheduler's index (``take_corrupt``), which alone may free them."""

    takes_digests = False

    def __init__(self, num_slots: int, copier: Optional[str] = None, stored_groups=None,
                 disk: Optional[DiskSpec] = None) -> None:
        self.num_slots = int(num_slots)
        self.copier = copier  # HostArena's; None: the KV tensors' device decides
        self.stored_groups = stored_groups  # HostArena's: the groups its slots must fit (None: all)
        self.disk_spec = disk  # this rank's disk tier, opened with the layout
        self.arena: Optional[HostArena] = None  # once the engine binds the KV layout
        self.disk: Optional[DiskLane] = None
        self._corrupt: List[int] = []
        self._lock = threading.Lock()  # the load lane adds, the step thread takes

    def bind_layout(self, layout: KVLayout) -> None:
        align = ALIGN if self.disk_spec is None else DISK_ALIGN
        self.arena = HostArena(layout, self.num_slots, copier=self.copier, stored_groups=self.stored_groups, align=align)
        if self.disk_spec is not None:
            self.disk = DiskLane(DiskRecords(self.disk_spec, self.arena, layout.fingerprint()))

    def save_blocks(self, slots, groups, block_ids) -> List[Status]:
        started = self.save_blocks_begin(slots, groups, block_ids)
        return started() if callable(started) else started

    @property
    def copies_on_streams(self) -> bool:
        """Whether a save's copies run on device streams, ordered after an event of the caller's
        (``save_blocks_begin(after=...)``), so that another thread may launch them."""
        device = self.arena._device if self.arena is not None else None
        return device is not None and device.pipeline.gather is not None

    def caller_event(self):
        """(With ``copies_on_streams``) an event recorded on the calling thread's current stream,
        for copies another thread launches to follow (``save_blocks_begin(after=...)``)."""
        return recorded(torch.cuda.current_stream(self.arena._device.device))

    def save_blocks_begin(self, slots, groups, block_ids, after=None, urgent: bool = False):
        """``save_blocks``' statuses when the copy is done, else a ``finish()`` returning
        them, for the save lane to call (``HostArena.save_begin``; ``after`` and ``urgent`` as
        there)."""
        finish = self.arena.save_begin(slots, groups, block_ids, after=after, urgent=urgent)
        if finish is None:
            return [Status.OK] * len(slots)

        def finished() -> List[Status]:
            finish()
            return [Status.OK] * len(slots)

        return finished

    def load_blocks(self, slots, groups, block_ids, after=None) -> List[Status]:
        """Load each slot into its block (``HostArena.load``; ``after`` as there)."""
        ok = self.arena.load(slots, groups, block_ids, after=after)
        bad = [int(s) for s, good in zip(slots, ok) if not good]
        if bad:
            with self._lock:
                self._corrupt.extend(bad)
        return [Status.OK if good else Status.CORRUPT for good in ok]

    def take_corrupt(self) -> List[int]:
        with self._lock:
            corrupt, self._corrupt = self._corrupt, []
        return corrupt

    def close(self) -> None:
        """The disk tier finishes what it was given; the arena's memory goes with the last
        reference."""
        if self.disk is not None:
            self.disk.shutdown()
            self.disk = None
