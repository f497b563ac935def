"""The embedded store: a host-memory arena of fixed-size slots in this process (the same
:class:`~kvstride.arena.SlotIndex` and :class:`~kvstride.arena.HostArena` the vLLM connector
splits across its scheduler and workers)."""

from __future__ import annotations

import logging
import threading
from typing import Optional

import numpy as np

from kvstride.sizes import format_size
from kvstride.stores.base import KVStore, Status, _copy_parts

__all__ = ["EmbeddedStore"]

log = logging.getLogger("kvstride.stores")

class EmbeddedStore(KVStore):
    """In-process host memory: one preallocated arena of fixed-size slots (``kvstride.arena``)
    with an LRU index; nothing to start. Values cost one copy each way and no allocation.

    The slot size is the largest block of the KV cache once an :class:`OffloadEngine` binds
    the store to its layout (the engine then copies blocks straight between the KV tensors and
    the slots, no staging). Used through the buffer protocol alone, give ``slot_bytes``: a
    value larger than a slot is ``FULL``. The arena (``capacity_bytes // slot`` slots) is
    allocated and touched as soon as the slot size is known; it is pinned when a CUDA KV cache
    sized it (leave ``slot_bytes`` unset then).

    Verified reads keep each value's XXH3-64 next to its slot (computed while the copy is in
    cache) and check it before a byte leaves the slot; a mismatch is ``CORRUPT`` and the value
    is dropped. A slot a load is reading is never evicted or reused until that load ends.

    ``disk_path`` and ``disk_bytes``: the disk tier the vLLM connector has (``kvstride.arena.disk``),
    for blocks of a bound layout: every block stored is written through to a record, a block
    memory evicted loads from its record (read into a slot on the caller's thread, verified),
    and the records and their index outlive the store. Which slot and record each key takes,
    what the disk admits, and when a key becomes readable in either tier is the connector's
    own :class:`~kvstride.arena.index.ArenaPlacement` (``placement``), run on the caller's
    thread as the connector's scheduler runs it on vLLM's."""

    def __init__(
        self,
        capacity_bytes: int = 1 << 30,
        *,
        fingerprint: bytes = b"\0" * 8,
        verify: bool = True,
        slot_bytes: Optional[int] = None,
        disk_path: Optional[str] = None,
        disk_bytes: int = 0,
    ) -> None:
        super().__init__(fingerprint, verify)
        if (disk_path is None) != (not disk_bytes):
            raise ValueError("EmbeddedStore takes disk_path and disk_bytes together (a folder and its records' bytes)")
        from kvstride.arena.disk import check_disk_folder, existing_records_bytes  # kvstride.arena imports stores

        self._disk_path = None if disk_path is None else check_disk_folder(disk_path, int(disk_bytes),
                                                                            existing_records_bytes(disk_path))
        self._disk_bytes = int(disk_bytes)
        self.disk = None  # kvstride.arena.disk.DiskRecords, once a layout is bound
        self._disk_counts: dict = {}  # what the placement counted (disk_writes_skipped, ...)
        if capacity_bytes <= 0:
            raise ValueError(f"EmbeddedStore capacity_bytes must be positive, got {capacity_bytes}")
        if slot_bytes is not None and not 0 < slot_bytes <= capacity_bytes:
            raise ValueError(
                f"EmbeddedStore slot_bytes={slot_bytes} must be positive and at most capacity_bytes={capacity_bytes}"
            )
        self.capacity = int(capacity_bytes)
        self._slot_bytes = slot_bytes
        self.arena = None  # kvstride.arena.HostArena, once the slot size is known
        self.placement = None  # kvstride.arena.ArenaPlacement: the slots' and records' keys
        self._index = None  # its SlotIndex
        self._loads = 0  # names this store's loads for the placement
        self._lock = threading.Lock()
        self._closed = False
        if slot_bytes is not None:
            self._allocate()

    # -- the arena --

    def bind_layout(self, layout) -> None:
        """Copy blocks of ``layout`` straight between its KV tensors and the slots (what
        ``OffloadEngine`` calls). Sizes the slots to its largest block unless ``slot_bytes``
        did; ``ValueError`` when a block cannot fit a slot."""
        largest = max(g.block_bytes for g in layout.groups)
        if self._slot_bytes is not None and self._slot_bytes < largest:
            raise ValueError(
                f"EmbeddedStore slot_bytes={self._slot_bytes} is smaller than a block of this KV cache "
                f"({largest} bytes); give at least {largest} or leave it unset"
            )
        with self._lock:
            if self.arena is None:
                self._allocate(layout)
            else:
                self.arena.attach(layout)

    def _allocate(self, layout=None) -> bool:
        """(under the lock) Allocate the arena once its slot size is known."""
        from kvstride.arena import ArenaPlacement, HostArena, slots_for
        from kvstride.arena.disk import DISK_ALIGN, DiskRecords, DiskSpec, record_bytes
        from kvstride.arena.disk_index import DiskIndex

        if layout is None and self._slot_bytes is None:
            return False
        slot = self._slot_bytes or max(g.block_bytes for g in layout.groups)
        if self._disk_path is None:
            count = slots_for(self.capacity, slot)
            self.arena = HostArena(layout, count, slot_bytes=slot)
            self.placement = ArenaPlacement(count)
            self._index = self.placement.index
            return True
        if layout is None:
            raise ValueError("EmbeddedStore's disk tier stores blocks: bind a layout (an OffloadEngine does)")
        payload, record = record_bytes(slot)
        count = slots_for(self.capacity, payload)
        self.arena = HostArena(layout, count, slot_bytes=payload, align=DISK_ALIGN)
        records = self._disk_bytes // record
        if records < 1:
            raise ValueError(f"disk_bytes={format_size(self._disk_bytes)} holds no record of {format_size(record)}; "
                             f"give at least {format_size(record)}")
        spec = DiskSpec(self._disk_path, records, payload, rank=0, ranks=1, fingerprint=self.fingerprint)
        disk_index = DiskIndex(records, self._disk_path, {
            "record_bytes": record, "ranks": 1, "fingerprint": self.fingerprint.hex(),
            "geometry": bytes(layout.fingerprint()).hex()})
        try:
            self.disk = DiskRecords(spec, self.arena, layout.fingerprint())
        except BaseException:
            disk_index.close()
            raise
        self.placement = ArenaPlacement(count, disk=disk_index)
        self._index = self.placement.index
        return True

    @property
    def slot_bytes(self) -> Optional[int]:
        return None if self.arena is None else self.arena.slot_bytes

    @property
    def num_slots(self) -> int:
        return 0 if self.arena is None else self.arena.num_slots

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the store holds (the arena: at most ``capacity``)."""
        return 0 if self.arena is None else self.arena.nbytes

    @property
    def used(self) -> int:
        """Bytes of the slots holding a readable value."""
        return 0 if self.arena is None else len(self._index) * self.arena.slot_bytes

    @property
    def evictions(self) -> int:
        return 0 if self._index is None else self._index.evictions

    def __len__(self) -> int:
        return 0 if self._index is None else len(self._index)

    # -- protocol --

    def exists(self, keys):
        keys = list(keys)
        with self._lock:
            if self._closed:
                self._note("exists", Status.UNAVAILABLE, len(keys), "store closed")
                return [False] * len(keys)
            if self._index is None:
                return [False] * len(keys)
            return self.placement.exists(keys)

    def _begin_writes(self, op: str, keys: list, todo: list, out: list) -> list:
        """(under the lock) Slots for the keys at ``todo`` not stored yet: present keys are OK
        (idempotent, touched), the others reserved; FULL when every slot is busy. Returns
        [(index into keys, slot)] to write."""
        index = self._index
        ready = index.exists([keys[i] for i in todo])
        index.touch([keys[i] for i, r in zip(todo, ready) if r])
        fresh = [i for i, r in zip(todo, ready) if not r]
        writing = index.known([keys[i] for i in fresh])
        for i, w in zip(fresh, writing):
            if w:  # another put of this key is writing it now
                out[i] = Status.OK
        fresh = [i for i, w in zip(fresh, writing) if not w]
        for i, r in zip(todo, ready):
            if r:
                out[i] = Status.OK
        slots = index.reserve([keys[i] for i in fresh])
        writes = []
        for i, slot in zip(fresh, slots):
            if slot is None:
                out[i] = Status.FULL
                self._note(op, Status.FULL, 0, "every slot is being read or written")
            else:
                writes.append((i, slot))
        return writes

    def _write(self, op: str, keys: list, writes: list, out: list, copy, blocks: bool = False) -> None:
        """Run ``copy(slots, rows)`` for the reserved ``writes`` outside the lock, then make the
        keys readable, or free their slots if it failed (never raised at run time). Written
        ``blocks`` of the bound layout go on to the disk tier, when there is one."""
        if not writes:
            return
        rows, slots = [i for i, _ in writes], [s for _, s in writes]
        try:
            copy(slots, rows)
            status = Status.OK
        except Exception as e:
            self._note(op, Status.ERROR, 0, repr(e))
            status = Status.ERROR
        with self._lock:
            written = [keys[i] for i in rows]
            ok = status is Status.OK and not self._closed
            if blocks:
                self.placement.saves_done(written, ok)
            elif ok:
                self._index.confirm(written)
            else:
                self._index.abandon(written)
        for i in rows:
            out[i] = status

    def put(self, keys, buffers):
        keys = list(keys)
        prepared = self._prepare("put", keys, buffers, writable=False)
        if prepared is None:
            return [Status.INVALID] * len(keys)
        regs, _keep, out, first, uniq, totals = prepared  # _keep: the buffers stay alive for the call
        todo = [i for i in uniq if out[i] is None]
        writes: list = []
        with self._lock:
            if self._closed:
                for i in todo:
                    out[i] = Status.UNAVAILABLE
            elif todo and self.arena is None and not self._allocate():
                self._note("put", Status.INVALID, 0, "no slot size yet: pass slot_bytes= or bind_layout() first")
                for i in todo:
                    out[i] = Status.INVALID
            elif todo:
                for i in todo:
                    if totals[i] > self.arena.slot_bytes:
                        out[i] = Status.FULL
                writes = self._begin_writes("put", keys, [i for i in todo if out[i] is None], out)
        self._write(
            "put", keys, writes, out,
            lambda slots, rows: self.arena.save_regions(slots, [regs[i] for i in rows], digest=self.verify),
        )
        return self._finish("put", keys, out, first)

    def _finish(self, op: str, keys: list, out: list, first: dict, regs=None) -> list:
        """Repeated keys take their first occurrence's status (and bytes); count them all."""
        if len(first) < len(keys):
            for i, k in enumerate(keys):
                if out[i] is None:
                    out[i] = out[first[k]]
                    if regs is not None and out[i] is Status.OK:
                        _copy_parts(regs[first[k]], regs[i])
        self._note_all(op, out)
        return out

    def _pin(self, keys: list, todo: list, out: list) -> list:
        """(under the lock) Pin the slots of the keys at ``todo`` that are readable; MISSING
        (or UNAVAILABLE when closed) for the others. Returns [(index into keys, slot)]."""
        if self._closed or self._index is None:
            for i in todo:
                out[i] = Status.UNAVAILABLE if self._closed else Status.MISSING
            return []
        slots = self._index.pin_ready([keys[i] for i in todo])
        reads = []
        for i, slot in zip(todo, slots):
            if slot is None:
                out[i] = Status.MISSING
            else:
                reads.append((i, slot))
        return reads

    def _read(self, op: str, keys: list, reads: list, out: list, fits, copy) -> None:
        """Run ``copy(slots, rows)`` (which entries it copied) for the pinned ``reads`` outside
        the lock, then unpin. A value whose digest check failed is dropped (the next put
        rewrites it); one that does not ``fit`` its destination (length, group) is left for its
        readers. Never raised at run time: an exception fails every read."""
        if not reads:
            return
        rows, slots = [i for i, _ in reads], np.array([s for _, s in reads], dtype=np.int64)
        try:
            ok = copy(slots, rows).tolist()
        except Exception as e:
            self._note(op, Status.ERROR, 0, repr(e))
            with self._lock:
                self._index.unpin(slots.tolist())
            for i in rows:
                out[i] = Status.ERROR
            return
        with self._lock:
            self._index.unpin(slots.tolist())
            if not all(ok):
                self._index.drop_slots([int(s) for s, good, fit in zip(slots, ok, fits) if fit and not good])
        for i, good in zip(rows, ok):
            out[i] = Status.OK if good else Status.CORRUPT
        if not all(ok):
            first_bad = keys[rows[ok.index(False)]]
            self._note(op, Status.CORRUPT, 0, f"{first_bad!r}: payload hash, length or group mismatch")

    def get(self, keys, buffers):
        keys = list(keys)
        prepared = self._prepare("get", keys, buffers, writable=True)
        if prepared is None:
            return [Status.INVALID] * len(keys)
        regs, _keep, out, first, uniq, totals = prepared  # _keep: the buffers stay alive for the call
        with self._lock:
            reads = self._pin(keys, [i for i in uniq if out[i] is None], out)
        if reads:
            slots = np.array([s for _, s in reads], dtype=np.int64)
            fits = self.arena.lengths[slots] == np.array([totals[i] for i, _ in reads], dtype=np.uint64)
            self._read(
                "get", keys, reads, out, fits,
                lambda slots, rows: self.arena.load_regions(slots, [regs[i] for i in rows], verify=self.verify),
            )
        return self._finish("get", keys, out, first, regs)

    # -- blocks straight between the KV cache and the slots (bound to a layout) --

    def save_blocks(self, keys, groups, block_ids) -> list:
        """Store block ``block_ids[i]`` of group ``groups[i]`` of the bound layout under
        ``keys[i]``: one copy from the KV tensors into a slot. Statuses as ``put``."""
        keys = list(keys)
        out: list = [None] * len(keys)
        first, uniq = self._dedup(keys)
        with self._lock:
            if self._closed or self.arena is None or self.arena.layout is None:
                why = "store closed" if self._closed else "no layout bound"
                status = Status.UNAVAILABLE if self._closed else Status.INVALID
                self._note("put", status, 0, why)
                return self._finish("put", keys, [status] * len(keys), first)
            writes = self._begin_writes("put", keys, uniq, out)
        groups, block_ids = np.asarray(groups), np.asarray(block_ids)
        self._write(
            "put", keys, writes, out,
            lambda slots, rows: self.arena.save(slots, groups[rows], block_ids[rows], digest=self.verify),
            blocks=True,
        )
        self._write_through()
        return self._finish("put", keys, out, first)

    def _write_through(self) -> None:
        """The disk tier's jobs the placement admitted for the values just stored, written now
        (their slots held until then)."""
        if self.disk is None:
            return
        with self._lock:
            jobs = self.placement.take_disk_writes()
        written = {job_id: all([self.disk.write(*entry) for entry in entries]) for job_id, entries in jobs.items()}
        with self._lock:
            self.placement.disk_written({job_id: (1, 0) if ok else (0, 1) for job_id, ok in written.items()})
            self._end_step()

    def _end_step(self) -> None:
        """(under the lock) The placement's counts kept, its index's changes persisted."""
        for name, n in self.placement.take_counts().items():
            self._disk_counts[name] = self._disk_counts.get(name, 0) + n
        self.placement.flush()

    def _read_from_disk(self, keys: list, groups) -> None:
        """Keys only the disk tier holds: read into fresh slots (verified), readable in memory
        again; a record that fails its check is forgotten. When the placement cannot hold the
        load (a key being written, no free slot), the disk keys stay misses."""
        if self.disk is None:
            return
        with self._lock:
            wanted = {}
            for key, group in zip(keys, groups):
                wanted.setdefault(key, int(group))
            present = self.placement.exists(list(wanted))
            gets = [(key, group, 0) for (key, group), here in zip(wanted.items(), present) if here]
            if all(self._index.ready_key(key) for key, _, _ in gets):
                return
            self._loads += 1
            load = f"load-{self._loads}"
            if self.placement.place_load(load, [gets]) is None:
                return
            reads = self.placement.disk_reads(load)
        read = [self.disk.read(*entry) for entry in reads]
        with self._lock:
            self.placement.forget_disk_corrupt([entry[0] for entry, ok in zip(reads, read) if not ok])
            self.placement.load_done(load, ok=all(read))
            self._end_step()

    def disk_counters(self) -> dict:
        """The disk tier's bytes written and read, its rejected records and the writes its
        admission skipped (none without a tier)."""
        if self.disk is None:
            return {}
        with self._lock:
            return {**self.disk.counters, **self._disk_counts}

    def load_blocks(self, keys, groups, block_ids, after=None) -> list:
        """Load ``keys[i]`` into block ``block_ids[i]`` of group ``groups[i]``: one copy from
        the slot, only after its digest matched. A key asked twice is written to both blocks.
        Statuses as ``get``; a non-OK key's block is left untouched. ``after`` (CUDA): an
        event the writes follow (default: the calling thread's current stream's work)."""
        keys = list(keys)
        out: list = [None] * len(keys)
        with self._lock:
            if self.arena is not None and self.arena.layout is None and not self._closed:
                self._note("get", Status.INVALID, 0, "no layout bound")
                return self._finish("get", keys, [Status.INVALID] * len(keys), {})
        self._read_from_disk(keys, groups)
        with self._lock:
            reads = self._pin(keys, list(range(len(keys))), out)  # pins count per destination
        if reads:
            groups, block_ids = np.asarray(groups), np.asarray(block_ids)
            rows = [i for i, _ in reads]
            fits = self.arena.slot_group[[s for _, s in reads]] == groups[rows]
            self._read(
                "get", keys, reads, out, fits,
                lambda slots, rows: self.arena.load(slots, groups[rows], block_ids[rows], verify=self.verify, after=after),
            )
        return self._finish("get", keys, out, {})

    # -- housekeeping --

    def remove(self, keys) -> None:
        with self._lock:
            if self._index is not None:
                self._index.drop_slots([s for s in map(self._index.slot, keys) if s is not None])

    def keys(self) -> list:
        """A snapshot of the stored keys, least recently used first."""
        with self._lock:
            return [] if self._index is None else self._index.keys()

    def value_view(self, key: str) -> Optional[np.ndarray]:
        """The stored bytes of ``key`` in place (tests and fault injection), or None."""
        with self._lock:
            slot = None if self._index is None else self._index.slot(key)
            if slot is None:
                return None
            start = slot * self.arena.slot_bytes
            return self.arena.buffer[start : start + int(self.arena.lengths[slot])].numpy()

    def clear(self) -> None:
        """Drop every value (the store stays open), as a restarted store would be."""
        with self._lock:
            if self._index is not None:
                self._index.drop_slots(self._index.ready_slots())

    def close(self) -> None:
        with self._lock:
            already, self._closed = self._closed, True
            if self._index is not None:
                self._index.drop_slots(self._index.ready_slots())
        if not already and self.disk is not None:  # the records and their index stay for the next store
            self.disk.close()
            self.placement.close()


# ---- Mooncake master --------------------------------------------------------------------
