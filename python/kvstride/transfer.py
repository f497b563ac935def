"""Batched copies between the paged KV cache and a bounded host staging pool.

A plan names blocks as ``(group, block_id)``.  ``Transfer.stage`` reserves room for them in the
:class:`StagingPool` (one host allocation, pinned on CUDA, allocated once and reused) and lays
each entry out whole: the group's pieces of one block back to back, so one block's stored
payload is one ``(address, size)`` part -- what Mooncake's ``batch_*_multi_buffers`` calls and
the embedded store take -- and Mooncake moves one slice per value (each further part cost 30-50
us of client CPU over TCP, half a one-part 8 KiB value's put; ``benches/mooncake_parts.py``).
A batch's copies are one table of every group's pieces (a few array operations a batch,
whatever its groups: a step saves a block of each of several groups), never one Python call
per block.

The pool has a share for loads that saves cannot take (``StagingPool(load_bytes=...)``), so
saves in flight never starve a load; ``staging_bytes_for`` sizes a pool for one step.

On CPU the copies are raw region copies in the Rust core, synchronous (the fence is complete on
return). On CUDA they are the copy kernels of :mod:`kvstride.arena.device`, on side streams
(gathers, their drains, scatters) ordered after the caller's stream (or an event of it,
``after=``), in chunks of at most ``CHUNK_BYTES``: a gather copies the blocks into device
staging laid out as the pool is (every core helping, in a ring of rows the gathers share:
``StagingRing``), then the copy engine drains it into the pinned pool; a scatter copies the pool's
range into device staging (the copy engine), then a kernel scatters it into the blocks. The
returned :class:`CopyEvents` holds CUDA events: the caller's stream must wait for a gather's reads
before it overwrites the blocks (``CopyEvents.wait_stream``, or per block ``KVLayout.fence``; no
host sync), and the host for all of it before the store reads the pool (``CopyEvents.wait``).

With ``Transfer.header_room`` set (the engine sets it for a store that takes it,
``KVStore.takes_header_room``), each entry is staged after that many free bytes, room for the
store's value header (``StagedBatch.value_parts``): the store then moves header and payload as
one part.

Scatter takes a per-entry mask (the store's statuses): entries that were not read correctly
are never copied into a KV block.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from .arena import device_xxh3
from .arena.device import (
    CHUNK_BYTES,
    SAVE_STAGING_CHUNKS,
    BlockKernels,
    DevicePipeline,
    copy_engine,
    chunk_sizes,
    digests_to_host,
    drain_chunk,
    on_side_stream,
    recorded,
    to_host,
    used_on,
)
from .copies import PieceTable
from .host_memory import host_buffer
from .layout import KVLayout
from .stores.base import HEADER_BYTES, _with_header_room

__all__ = ["StagingPool", "StagedBatch", "Transfer", "CopyEvents", "staging_bytes_for", "LOAD_SHARE", "ALIGNMENT"]

#: Every staged piece array starts at a multiple of this many bytes.
ALIGNMENT = 64
#: Device staging rows of a gather's chunks (multiples of the 512 bytes the kernels' widest
#: access assumes of a chunk's start).
STAGING_ROW = 512


def _entry_bytes(payload: int, room: int) -> int:
    """Pool bytes of one staged entry: the header room, then the payload, at the pool's alignment."""
    return _round(room + payload)


def _round(n: int, a: int = ALIGNMENT) -> int:
    return (n + a - 1) // a * a


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: The share of a staging pool that only loads may use, unless its ``load_bytes`` is given.
LOAD_SHARE = 0.25


def _load_share(capacity: int) -> int:
    return int(capacity * LOAD_SHARE) // ALIGNMENT * ALIGNMENT


class StagingPool:
    """A bounded, reusable host buffer with a first-fit range allocator, in two shares so that
    saves in flight never starve a load: loads allocate from the last ``load_bytes`` only,
    saves from the rest (``lane`` of :meth:`alloc`).

    ``load_bytes``: the loads' share (default: ``LOAD_SHARE`` of the capacity; 0: one region
    that both lanes share). ``pin``: page-lock the buffer (default: when CUDA is available).
    ``register(fn)`` calls ``fn(ptr, nbytes)`` once, e.g. ``store.register_buffer`` for Mooncake.
    """

    def __init__(self, capacity_bytes: int, *, load_bytes: Optional[int] = None, pin: Optional[bool] = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"staging capacity must be positive, got {capacity_bytes}")
        if pin is None:
            pin = torch.cuda.is_available()
        self.capacity = _round(int(capacity_bytes))
        self.load_bytes = _load_share(self.capacity) if load_bytes is None else _round(int(load_bytes))
        if not 0 <= self.load_bytes < self.capacity:
            raise ValueError(
                f"load_bytes={load_bytes} must be >= 0 and leave room for saves in a {self.capacity}-byte pool"
            )
        boundary = self.capacity - self.load_bytes
        self._windows = {
            None: (0, self.capacity),
            "save": (0, boundary),
            "load": (boundary, self.capacity) if self.load_bytes else (0, self.capacity),
        }
        # Exactly its size, touched once (the first copies take no page faults), pinned for the
        # device's copies (kvstride.host_memory: not PyTorch's power-of-two pinned allocator).
        self.tensor = host_buffer(self.capacity, pin=bool(pin), what="the staging pool")
        self.pinned = bool(pin)
        self.ptr = self.tensor.data_ptr()
        self._free = [(0, self.capacity)]  # sorted, coalesced (offset, size)
        self._lock = threading.Lock()

    def register(self, register_fn) -> None:
        """``register_fn(ptr, nbytes)`` (a store's ``register_buffer``); that store's
        ``unregister_buffer`` runs when this pool goes, before its memory is freed, so no
        registration outlives it (a later pool at the same address registers anew)."""
        register_fn(self.ptr, self.capacity)
        unregister = getattr(getattr(register_fn, "__self__", None), "unregister_buffer", None)
        if unregister is not None:
            weakref.finalize(self, unregister, self.ptr)

    def share(self, lane: Optional[str] = None) -> int:
        """Bytes ``lane`` ("save", "load", None: any) may hold at once."""
        lo, hi = self._windows[lane]
        return hi - lo

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(s for _, s in self._free)

    def free_in(self, lane: Optional[str] = None) -> int:
        """Free bytes in ``lane``'s share (not necessarily in one range)."""
        lo, hi = self._windows[lane]
        with self._lock:
            return sum(max(0, min(off + size, hi) - max(off, lo)) for off, size in self._free)

    def alloc(self, nbytes: int, lane: Optional[str] = None) -> Optional[int]:
        """Offset of ``nbytes`` reserved bytes in ``lane``'s share ("save", "load"; None: anywhere),
        or None if no free range there is large enough."""
        n = _round(max(int(nbytes), 1))
        lo, hi = self._windows[lane]
        with self._lock:
            for i, (off, size) in enumerate(self._free):
                start = max(off, lo)
                if min(off + size, hi) - start < n:
                    continue
                rest = [(o, s) for o, s in ((off, start - off), (start + n, off + size - start - n)) if s]
                self._free[i : i + 1] = rest
                return start
        return None

    def release(self, offset: int, nbytes: int) -> None:
        n = _round(max(int(nbytes), 1))
        with self._lock:
            free = self._free
            free.append((offset, n))
            free.sort()
            merged = [free[0]]
            for off, size in free[1:]:
                po, ps = merged[-1]
                if po + ps == off:
                    merged[-1] = (po, ps + size)
                else:
                    merged.append((off, size))
            self._free = merged


def header_room_for(store) -> int:
    """Bytes staged before each block's first piece for ``store``: room for the value header
    where the store writes it next to the payload (``KVStore.takes_header_room``), else 0."""
    return HEADER_BYTES if getattr(store, "takes_header_room", False) else 0


def staging_bytes_for(layout: KVLayout, tokens_per_step: int, planner, header_room: int = 0) -> int:
    """A default staging pool size for ``layout``: what one step computing ``tokens_per_step``
    tokens (vLLM's ``max_num_batched_tokens``) can save on this rank, plus the loads' share.

    A request's saves in a step span at most ``T + S - 1`` tokens: from its saved offset (a
    multiple of ``S``, less than ``S`` tokens behind what it had computed) to the end of the
    step, a partial-tail boundary included. So each group the planner keys
    (``planner.hashes_per_block[g] > 0``; scratch rings are never staged) puts at most
    ``cdiv(T + S - 1, B_g)`` blocks, or hand-off states, of which this rank puts its share under
    TP striding (``planner.replication``), each entry at the pool's alignment. The pool gives
    saves at least that and loads ``LOAD_SHARE`` of it, at least one block of every group. A
    step whose saves exceed it (many requests crossing a block boundary at once) still saves:
    its batches stream through the pool. ``header_room``: what the engine will stage before
    each block (``header_room_for``)."""
    tokens = int(tokens_per_step)
    if tokens <= 0:
        raise ValueError(f"tokens_per_step must be positive, got {tokens_per_step}")
    reach = tokens + planner.scheduler_block_size - 1
    save, largest = 0, ALIGNMENT
    for g, group in enumerate(layout.groups):
        per_block = planner.hashes_per_block[g]
        if not per_block:
            continue
        blocks = _cdiv(_cdiv(reach, per_block * planner.hash_block_size), planner.replication(g))
        entry = _entry_bytes(group.block_bytes, header_room)
        save += blocks * entry
        largest = max(largest, entry)
    save = max(save, largest)
    capacity = _round(max(int(save / (1 - LOAD_SHARE)), int(largest / LOAD_SHARE)))
    while capacity - _load_share(capacity) < save or _load_share(capacity) < largest:
        capacity += ALIGNMENT
    return capacity


class CopyEvents:
    """When a gather or a scatter is done: CPU, on return; CUDA, recorded events of the whole
    copy (``wait``) and, for a gather, of its reads of the KV blocks (``wait_stream``: what a
    fence waits for)."""

    def __init__(self, event=None, read=None) -> None:
        self._event = event
        self._read = read if read is not None else event

    def wait(self) -> None:
        """Block the calling thread until the copies are finished."""
        if self._event is not None:
            self._event.synchronize()

    def wait_stream(self, stream=None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait for the copies' reads of the
        KV blocks (a gather) or for the copies (a scatter), without blocking the host."""
        if self._read is not None:
            (stream or torch.cuda.current_stream()).wait_event(self._read)


@dataclass
class StagedBatch:
    """Blocks reserved in the staging pool; ``parts(i)`` is block i's payload as
    [(address, size)], ready for ``store.put`` / ``store.get``.  Release it (or use it as a
    context manager) once the copies are fenced and the store call has returned."""

    pool: StagingPool
    blocks: list  # [(group, block_id)]
    offset: int
    nbytes: int
    _parts: list = field(default_factory=list)
    _released: bool = False
    digests: Optional[np.ndarray] = None  # per entry, set by gather(digests=True)
    verified: Optional[np.ndarray] = None  # per entry, set by scatter(expected=...)
    header_room: int = 0  # bytes free in front of each entry's first part

    def parts(self, i: int) -> list:
        return self._parts[i]

    def all_parts(self) -> list:
        return list(self._parts)

    def value_parts(self) -> list:
        """Each entry's parts with the header room joined to the first: a whole stored value,
        for ``store.put / get(..., header_room=True)``."""
        room = self.header_room
        if not room:
            raise ValueError("this batch was staged without header room (Transfer.header_room)")
        return [_with_header_room(parts, room) for parts in self._parts]

    def payload_view(self, i: int) -> list:
        """Block i's payload parts as uint8 tensor views of the pool (tests, debugging)."""
        base = self.pool.ptr
        return [self.pool.tensor[a - base : a - base + s] for a, s in self._parts[i]]

    def release(self) -> bool:
        """Give the room back; True the first time (releasing twice is harmless)."""
        if self._released:
            return False
        self._released = True
        self.pool.release(self.offset, self.nbytes)
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


class Transfer:
    """Gathers / scatters staged blocks between ``layout``'s KV tensors and ``pool``.

    ``kernels``: copy with the device copy kernels (default on CUDA; True on CPU runs them under
    Triton's interpreter, for tests), else the Rust region copier. ``chunk_bytes``: the most a
    copy stages on the device at once."""

    def __init__(self, layout: KVLayout, pool: StagingPool, *, stream=None, kernels: Optional[bool] = None,
                 chunk_bytes: int = CHUNK_BYTES) -> None:
        self.layout = layout
        self.mac_secret = None  # a StoreSecret: CPU digests are keyed payload tags (the store's MAC)
        self.pool = pool
        self.device = layout.device or torch.device("cpu")
        self.cuda = layout.on_cuda
        self.header_room = 0  # free bytes staged before each entry (make_header_room_for)
        # Gathers run on ``stream`` (the pipeline's gather stream), scatters on a stream of their own.
        self.pipeline = DevicePipeline(self.device, gather=stream)
        self._pieces = PieceTable(layout)
        self._payload_bytes = np.array([g.block_bytes for g in layout.groups], dtype=np.int64)
        self.chunk_bytes = int(chunk_bytes)
        self.kernels: Optional[BlockKernels] = None
        if self.cuda and kernels is False:
            raise ValueError("a CUDA KV cache is copied by the device kernels: leave kernels unset (True or None)")
        if self.cuda if kernels is None else kernels:
            self.kernels = BlockKernels(layout, self._pieces, self.device, [pool.ptr, ALIGNMENT, HEADER_BYTES])
        # With the kernels, take a gather's digests and check a scatter's on the device (XXH3 of
        # values the kernel takes; payloads start 16-byte aligned in the pool).
        self.digests_on_device = False
        self._hashable = all(device_xxh3.eligible(g.block_bytes) for g in layout.groups)

    @property
    def stream(self):
        """(CUDA) The stream the gathers run on."""
        return self.pipeline.gather

    def digests_ride_copies(self, mac_secret=None) -> bool:
        """Whether ``gather(digests=True)`` and ``scatter(expected=...)`` take and check each value's
        digest as they copy: the Rust copier always (XXH3, or with ``mac_secret`` the keyed payload
        tag), the device kernels with ``digests_on_device`` for XXH3 of values the kernel takes."""
        if self.kernels is None:
            return True
        return self.digests_on_device and mac_secret is None and self.header_room % 16 == 0 and self._hashable

    def make_header_room_for(self, store) -> None:
        """Stage room for ``store``'s value header before each entry from now on
        (``header_room_for``); the engine calls it once, before its first stage."""
        self.header_room = header_room_for(store)

    # ---- staging -----------------------------------------------------------------------

    def staged_bytes(self, blocks: Sequence[tuple]) -> int:
        """Pool bytes ``stage(blocks)`` needs."""
        return sum(_entry_bytes(int(self._payload_bytes[g]), self.header_room) for g, _ in blocks)

    def staged_bytes_bound(self, group: int) -> Tuple[int, int]:
        """``(per_entry, per_run)``: ``staged_bytes`` of ``n`` entries of ``group`` in one batch
        is at most ``n * per_entry + per_run`` (each entry is aligned on its own)."""
        return _entry_bytes(int(self._payload_bytes[group]), self.header_room), 0

    def stage(self, blocks: Sequence[tuple], lane: Optional[str] = None) -> Optional[StagedBatch]:
        """Reserve room for ``blocks`` ([(group, block_id)]) in ``lane``'s share of the pool
        (see :meth:`StagingPool.alloc`), or None if it is too full (split the batch, or wait
        for an earlier one to be released). Each entry whole at the pool's alignment: the
        header room, then the group's pieces back to back; one payload part per entry."""
        blocks = [(int(g), int(b)) for g, b in blocks]
        groups = self.layout.groups
        for g, b in blocks:
            if not 0 <= g < len(groups):
                raise ValueError(f"group {g} out of range (layout has {len(groups)} groups)")
            if not 0 <= b < groups[g].num_blocks:
                raise ValueError(f"block id {b} out of range for group {g} ({groups[g].num_blocks} blocks)")
        room, payload = self.header_room, self._payload_bytes
        starts, nbytes = [], 0
        for g, _ in blocks:
            starts.append(nbytes)
            nbytes += _entry_bytes(int(payload[g]), room)
        off = self.pool.alloc(nbytes, lane)
        if off is None:
            return None
        batch = StagedBatch(self.pool, blocks, off, nbytes, header_room=room)
        first = self.pool.ptr + off + room
        batch._parts = [[(first + start, int(payload[g]))] for (g, _), start in zip(blocks, starts)]
        return batch

    # ---- copies ------------------------------------------------------------------------

    def current_stream_event(self):
        """(CUDA) An event recorded on the calling thread's current stream, None on CPU: copies
        run later on another thread are ordered after it with ``after=``."""
        return recorded(torch.cuda.current_stream(self.device)) if self.cuda else None

    def _entries(self, batch: StagedBatch, ok: Optional[Sequence[bool]] = None):
        """The batch's entries (those with ``ok[i]``) as arrays: index, group, block id and
        payload address; None without an entry."""
        order = np.arange(len(batch.blocks)) if ok is None else np.flatnonzero(np.asarray(ok, dtype=bool))
        if not len(order):
            return None
        blocks = np.asarray(batch.blocks, dtype=np.int64)[order]
        payloads = np.array([batch._parts[i][0][0] for i in order], dtype=np.uint64)
        return order, blocks[:, 0], blocks[:, 1], payloads

    def _cpu_copy(self, batch: StagedBatch, to_pool: bool, ok=None, digests: bool = False, expected=None) -> CopyEvents:
        """Both directions on CPU: raw region copies in the Rust core, GIL released. Not
        torch's ops: called from the engine's lanes, a torch op opens an OpenMP team that
        fights vLLM's bound OpenMP threads (a 144 KiB scatter took 60-80 ms).

        ``digests`` (gather): also keep each entry's XXH3-64, hashed while it is in cache.
        ``expected`` (scatter): write an entry only if its staged bytes have that digest.
        With ``self.mac_secret`` (a ``StoreSecret``, set by the engine from a store keyed with a
        deployment secret) the digest is the keyed payload tag of the value's MAC instead."""
        from kvstride import _core

        entries = self._entries(batch, ok)
        if digests:
            batch.digests = np.zeros(len(batch.blocks), dtype=np.uint64)
        if expected is not None:
            batch.verified = np.zeros(len(batch.blocks), dtype=bool)
        if entries is None:
            return CopyEvents()
        order, groups, block_ids, payloads = entries
        kv, pool, length, row_start = self._pieces.rows(groups, block_ids, payloads)
        if digests:
            batch.digests[order] = _core._save_rows(kv, pool, length, row_start, self.mac_secret)
        elif expected is not None:
            want = np.asarray(expected, dtype=np.uint64)[order]
            batch.verified[order] = _core._load_rows(pool, kv, length, row_start, want, self.mac_secret)
        else:
            _core._copy_regions(*((kv, pool) if to_pool else (pool, kv)), length)
        return CopyEvents()

    def _chunks(self, batch: StagedBatch, payloads: np.ndarray, growing: bool) -> List[Tuple[int, int, int, int]]:
        """The batch cut into chunks of whole entries of at most ``chunk_bytes`` each (an entry
        larger than that alone): ``(first entry, end entry, pool offset, bytes)`` per chunk, the
        smaller chunks first (``growing``) or last (``chunk_sizes``)."""
        starts = payloads - np.uint64(self.pool.ptr + batch.header_room)  # pool offsets of the entries
        ends = np.append(starts[1:], np.uint64(batch.offset + batch.nbytes))
        per_entry = int((ends - starts).max())
        counts = chunk_sizes(len(payloads), max(1, self.chunk_bytes // per_entry), growing)
        bounds = np.cumsum([0, *counts])
        return [(int(a), int(b), int(starts[a]), int(ends[b - 1] - starts[a])) for a, b in zip(bounds[:-1], bounds[1:])]

    def _kernel_gather(self, batch: StagedBatch, digests: bool, urgent: bool) -> CopyEvents:
        """KV blocks -> device staging laid out as the pool (every core helping) -> the pool, chunk
        by chunk: the gathers on the gather stream, each waiting only for the drain of the last
        chunk that used its rows of the staging ring (``StagingRing``), the drains on a stream
        of their own; the read event it returns follows the last chunk's gather, never a drain,
        and each chunk's gather joins the layout's ``pending_reads``.
        ``digests``: each value's XXH3 from the staging, beside the drain, into ``batch.digests``
        (filled once the copy is done). ``urgent``: on the urgent streams."""
        _, groups, block_ids, payloads = self._entries(batch)
        kernels, read = self.kernels, None
        pipeline = self.pipeline
        (gathers, hashes), drains = pipeline.save_streams(urgent), pipeline.drain
        with pipeline.save_lock, on_side_stream(gathers):
            chunks = self._chunks(batch, payloads, growing=False)
            largest = max(nbytes for *_, nbytes in chunks)  # an entry larger than a chunk: two of it
            ring = pipeline.ring(-(-max(self.chunk_bytes, largest) // STAGING_ROW) * SAVE_STAGING_CHUNKS, STAGING_ROW)
            taken = [ring.take(-(-nbytes // STAGING_ROW)) for *_, nbytes in chunks]
            staged = np.zeros(len(payloads), dtype=np.uint64)
            for (first, end, offset, _), chunk in zip(chunks, taken):
                staged[first:end] = np.uint64(chunk.address) + (payloads[first:end] - np.uint64(self.pool.ptr + offset))
            table = kernels.table(groups, block_ids, staged, self._payload_bytes[groups])
            found = torch.empty(len(payloads), dtype=torch.int64, device=self.device) if digests else None
            for (first, end, offset, nbytes), chunk in zip(chunks, taken):
                chunk.wait(gathers)  # its rows' last reader first
                kernels.blocks(table, groups, first, end - first, True, kernels.device_programs)
                read = recorded(gathers)
                self.layout.pending_reads.add(block_ids[first:end], read)

                def drain(chunk=chunk, offset=offset, nbytes=nbytes) -> None:
                    # The chunk's pool range is one run: the copy engine, at the link's speed, no SM taken.
                    start = chunk.start * STAGING_ROW
                    copy_engine(self.pool.tensor[offset:offset + nbytes], ring.memory[start:start + nbytes])

                def digest(first=first, end=end) -> None:
                    device_xxh3.launch_xxh3_rows(kernels.origin, table, first, end - first, 2, 3, found)

                drain_chunk(chunk, read, drains, hashes, drain, digest if digests else None)
            if digests:
                batch.digests = digests_to_host(found, drains, hashes).numpy().view(np.uint64)
            for tensor, stream in ((table, drains), (table, hashes), (found, hashes)):
                used_on(tensor, stream)
            return CopyEvents(recorded(drains), read)

    def _kernel_scatter(self, batch: StagedBatch, ok, after, expected) -> CopyEvents:
        """The pool -> device staging (the copy engine, one copy a chunk) -> the blocks of the
        entries with ``ok``, chunk by chunk on the scatter stream; with ``expected``, only those
        whose staged bytes have that XXH3 (checked on the device; ``batch.verified`` says which,
        filled once the copy is done)."""
        _, all_groups, all_block_ids, payloads = self._entries(batch)
        kept = np.arange(len(batch.blocks)) if ok is None else np.flatnonzero(np.asarray(ok, dtype=bool))
        if expected is not None:
            batch.verified = np.zeros(len(batch.blocks), dtype=bool)
        if not len(kept):
            return CopyEvents()
        groups, block_ids = all_groups[kept], all_block_ids[kept]
        kernels = self.kernels
        with on_side_stream(self.pipeline.scatter, after):
            chunks = self._chunks(batch, payloads, growing=True)
            staging = torch.empty(max(nbytes for *_, nbytes in chunks), dtype=torch.uint8, device=self.device)
            chunk_of = np.repeat(np.arange(len(chunks)), [end - first for first, end, _, _ in chunks])[kept]
            offsets = np.array([offset for _, _, offset, _ in chunks], dtype=np.uint64)[chunk_of]
            staged = staging.data_ptr() + (payloads[kept] - np.uint64(self.pool.ptr) - offsets)
            checks = () if expected is None else (self._payload_bytes[groups], np.asarray(expected, dtype=np.uint64)[kept])
            table = kernels.table(groups, block_ids, staged, *checks)
            flags = None if expected is None else torch.empty(len(kept), dtype=torch.int64, device=self.device)
            bounds = np.searchsorted(chunk_of, np.arange(len(chunks) + 1))
            for k, (_, _, offset, nbytes) in enumerate(chunks):
                first, count = int(bounds[k]), int(bounds[k + 1] - bounds[k])
                if not count:
                    continue
                staging[:nbytes].copy_(self.pool.tensor[offset:offset + nbytes], non_blocking=True)
                if flags is not None:
                    device_xxh3.launch_xxh3_rows(kernels.origin, table, first, count, 2, 3, flags, expected=table[4])
                kernels.blocks(table, groups, first, count, False, kernels.device_programs, flags=flags)
            if flags is not None:
                verified = torch.zeros(len(batch.blocks), dtype=torch.bool, device=self.device)
                verified[torch.from_numpy(kept).to(self.device, non_blocking=True)] = flags != 0
                batch.verified = to_host(verified).numpy()
            return CopyEvents(recorded(self.pipeline.scatter))

    def gather(self, batch: StagedBatch, *, digests: bool = False, urgent: bool = False) -> CopyEvents:
        """KV blocks -> staging. ``digests`` (where ``digests_ride_copies``): also set
        ``batch.digests``, each entry's XXH3-64 (the store's payload hash), computed while the
        bytes are in cache or in device staging (then filled once the copy is done).
        CUDA: the blocks are read on the side stream; the caller's stream must wait for those
        reads (``CopyEvents.wait_stream``), or fence the blocks (``KVLayout.fence``), before it
        writes them again. ``urgent``: on streams of its own, never behind other gathers'
        copies (for blocks the caller's stream waits for at once)."""
        if self.kernels is None:
            return self._cpu_copy(batch, to_pool=True, digests=digests)
        if digests and not self.digests_ride_copies():
            raise ValueError("digests during a device gather need digests_on_device and values the XXH3 kernel takes")
        if not batch.blocks:
            batch.digests = np.zeros(0, dtype=np.uint64) if digests else None
            return CopyEvents()
        return self._kernel_gather(batch, digests, urgent)

    def scatter(self, batch: StagedBatch, ok: Optional[Sequence[bool]] = None, *, expected=None, after=None) -> CopyEvents:
        """Staging -> KV blocks, only for entries with ``ok[i]`` true (default: all).
        ``expected`` (where ``digests_ride_copies``): the XXH3-64 each entry's staged bytes must
        have; an entry whose bytes differ is not written, and ``batch.verified`` tells which were
        (once the copy is done).
        ``after`` (CUDA): an event from :meth:`current_stream_event` on the stream whose pending
        work the writes must follow (default: the calling thread's current stream)."""
        if self.kernels is None:
            return self._cpu_copy(batch, to_pool=False, ok=ok, expected=expected)
        if expected is not None and not self.digests_ride_copies():
            raise ValueError("digest-checked device scatters need digests_on_device and values the XXH3 kernel takes")
        if not batch.blocks:
            batch.verified = np.zeros(0, dtype=bool) if expected is not None else None
            return CopyEvents()
        return self._kernel_scatter(batch, ok, after, expected)
