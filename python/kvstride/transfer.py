"""Batched copies between the paged KV cache and a bounded host staging pool.

A plan names blocks as ``(group, block_id)``.  ``Transfer.stage`` reserves room for them in the
:class:`StagingPool` (one host allocation, pinned on CUDA, allocated once and reused).  On CPU it
lays each entry out whole: the group's pieces of one block back to back, so one block's stored
payload is one ``(address, size)`` part -- what Mooncake's ``batch_*_multi_buffers`` calls and
the embedded store take -- and Mooncake moves one slice per value (each further part cost 30-50
us of client CPU over TCP, half a one-part 8 KiB value's put; ``benches/mooncake_parts.py``).  On CUDA it
lays them out piece-major (for piece ``j`` of the group, the ``n`` blocks' bytes are one
contiguous ``(n, size_j)`` array), which its torch copies need; a payload is then a part per
piece.  On CPU a batch's copy rows come from one table of every group's pieces (a few array
operations a batch, whatever its groups: a step saves a block of each of several groups) and the
copies are one call into the Rust core; on CUDA they are batched per piece and group.  Never one
Python call per block.

The pool has a share for loads that saves cannot take (``StagingPool(load_bytes=...)``), so
saves in flight never starve a load; ``staging_bytes_for`` sizes a pool for one step.

On CPU the copies are raw region copies in the Rust core, synchronous (the fence is complete
on return).  On CUDA they run on a side stream ordered after the caller's stream (or an event
of it, ``after=``): device -> host is a device-side gather into a temporary then one
``copy_(non_blocking=True)`` into pinned memory; host -> device is the reverse.  The returned
:class:`Fence` holds a CUDA event; the caller's stream must wait for a gather's fence before it
overwrites the blocks (``Fence.wait_stream``, no host sync).

With ``Transfer.header_room`` set (the engine sets it on CPU for a store that takes it,
``KVStore.takes_header_room``), each entry is staged after that many free bytes, room for the
store's value header (``StagedBatch.value_parts``): the store then moves header and payload as
one part. (Not on CUDA: its copies are torch ops over contiguous piece arrays.)

Scatter takes a per-entry mask (the store's statuses): entries that were not read correctly
are never copied into a KV block.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from .copies import PieceTable
from .layout import KVLayout
from .stores.base import HEADER_BYTES, _with_header_room

__all__ = ["StagingPool", "StagedBatch", "Transfer", "Fence", "staging_bytes_for", "LOAD_SHARE", "ALIGNMENT"]

#: Every staged piece array starts at a multiple of this many bytes.
ALIGNMENT = 64


def _row_bytes(pieces, room: int) -> list:
    """Per piece, the staged bytes of one entry: the piece, and the header room before the first."""
    return [p.size + (room if j == 0 else 0) for j, p in enumerate(pieces)]


def _run_bytes(pieces, room: int, n: int, whole_entries: bool) -> int:
    """Pool bytes of ``n`` entries of a group: whole entries each at the pool's alignment, or
    each piece's ``(n, size)`` array at it (piece-major)."""
    rows = _row_bytes(pieces, room)
    if whole_entries:
        return n * _round(sum(rows))
    return sum(_round(n * row) for row in rows)


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
        self.tensor = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=bool(pin))
        self.tensor.zero_()  # touched once here: the first loads and saves take no page faults
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


def header_room_for(store, layout: KVLayout) -> int:
    """Bytes staged before each block's first piece for ``store``: room for the value header
    where the store writes it next to the payload (``KVStore.takes_header_room``) and the
    copies run on CPU (the CUDA copies keep contiguous piece arrays); else 0."""
    return HEADER_BYTES if not layout.on_cuda and getattr(store, "takes_header_room", False) else 0


def staging_bytes_for(layout: KVLayout, tokens_per_step: int, planner, header_room: int = 0) -> int:
    """A default staging pool size for ``layout``: what one step computing ``tokens_per_step``
    tokens (vLLM's ``max_num_batched_tokens``) can save on this rank, plus the loads' share.

    A request's saves in a step span at most ``T + S - 1`` tokens: from its saved offset (a
    multiple of ``S``, less than ``S`` tokens behind what it had computed) to the end of the
    step, a partial-tail boundary included. So each group the planner keys
    (``planner.hashes_per_block[g] > 0``; scratch rings are never staged) puts at most
    ``cdiv(T + S - 1, B_g)`` blocks, or hand-off states, of which this rank puts its share under
    TP striding (``planner.replication``), each entry (CPU) or each group's piece array (CUDA) at the
    pool's alignment. The pool gives saves at least that and loads ``LOAD_SHARE`` of it, at least one
    block of every group. A step whose saves exceed it (many requests crossing a block boundary
    at once) still saves: its batches stream through the pool. ``header_room``: what the
    engine will stage before each block (``header_room_for``)."""
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
        # Sized for either layout (whole entries on CPU, piece-major on CUDA).
        save += max(_run_bytes(group.pieces, header_room, blocks, whole) for whole in (True, False))
        largest = max(largest, _run_bytes(group.pieces, header_room, 1, False))
    save = max(save, largest)
    capacity = _round(max(int(save / (1 - LOAD_SHARE)), int(largest / LOAD_SHARE)))
    while capacity - _load_share(capacity) < save or _load_share(capacity) < largest:
        capacity += ALIGNMENT
    return capacity


class Fence:
    """Completion of a gather or scatter.  CPU: complete on return.  CUDA: a recorded event."""

    def __init__(self, event=None) -> None:
        self._event = event

    def wait(self) -> None:
        """Block the calling thread until the copies are finished."""
        if self._event is not None:
            self._event.synchronize()

    def wait_stream(self, stream=None) -> None:
        """Make ``stream`` (default: the current CUDA stream) wait, without blocking the host."""
        if self._event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self._event)


@dataclass
class _GroupRun:
    """(Piece-major, CUDA) One group's entries of a batch."""

    group: int
    rows: list  # indices into StagedBatch.blocks
    ids: torch.Tensor  # int64 block ids (CPU)
    piece_offs: list  # pool offset of each piece's bytes in the first entry's row
    row_bytes: list  # per piece, the pool bytes from one entry's row to the next


@dataclass
class StagedBatch:
    """Blocks reserved in the staging pool; ``parts(i)`` is block i's payload as
    [(address, size)], ready for ``store.put`` / ``store.get``.  Release it (or use it as a
    context manager) once the copies are fenced and the store call has returned."""

    pool: StagingPool
    blocks: list  # [(group, block_id)]
    offset: int
    nbytes: int
    runs: list = field(default_factory=list)  # piece-major (CUDA) only: one _GroupRun per group
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


def _wide_dtype(*values: int):
    """The widest integer dtype whose size divides every value (index_copy_ is per element)."""
    for dt, w in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if all(v % w == 0 for v in values):
            return dt, w
    return torch.uint8, 1


class Transfer:
    """Gathers / scatters staged blocks between ``layout``'s KV tensors and ``pool``."""

    def __init__(self, layout: KVLayout, pool: StagingPool, *, stream=None) -> None:
        self.layout = layout
        self.mac_secret = None  # a StoreSecret: CPU digests are keyed payload tags (the store's MAC)
        self.pool = pool
        self.device = layout.device or torch.device("cpu")
        self.cuda = layout.on_cuda
        self.header_room = 0  # CPU only: free bytes staged before each entry (make_header_room_for)
        self.stream = (stream or torch.cuda.Stream(device=self.device)) if self.cuda else None
        # Per storage, per dtype width: a flat tensor over the whole storage.
        self._wide: dict = {}
        # Per group: per piece, (view over all blocks as (num_blocks, size/w), dtype, w)
        self._views = [[self._piece_view(p, g.num_blocks) for p in g.pieces] for g in layout.groups]
        self._pool_views: dict = {}
        self._pieces = None if self.cuda else PieceTable(layout)  # the CPU copies' rows

    def _flat(self, storage: int, dtype, w: int) -> torch.Tensor:
        key = (storage, w)
        if key not in self._wide:
            u8 = self.layout.storages[storage]
            n = u8.numel() // w
            self._wide[key] = torch.empty(0, dtype=dtype, device=u8.device).set_(u8.untyped_storage(), 0, (n,), (1,))
        return self._wide[key]

    def _piece_view(self, p, num_blocks: int):
        base = self.layout.storages[p.storage].data_ptr()
        dtype, w = _wide_dtype(p.offset, p.size, p.stride, base)
        flat = self._flat(p.storage, dtype, w)
        return flat.as_strided((num_blocks, p.size // w), (p.stride // w, 1), p.offset // w)

    def _pool_rows(self, off: int, n: int, size: int, dtype) -> torch.Tensor:
        """(n, size) bytes of the pool at ``off`` as a ``dtype`` matrix (offsets are 64-aligned)."""
        pv = self._pool_views.get(dtype)
        if pv is None:
            t = self.pool.tensor
            w = torch.empty(0, dtype=dtype).element_size()
            pv = torch.empty(0, dtype=dtype).set_(t.untyped_storage(), 0, (t.numel() // w,), (1,))
            self._pool_views[dtype] = pv
        w = pv.element_size()
        return pv.as_strided((n, size // w), (size // w, 1), off // w)

    @property
    def whole_entries(self) -> bool:
        """CPU: each entry's pieces back to back (module docstring); CUDA: piece-major."""
        return not self.cuda

    def make_header_room_for(self, store) -> None:
        """Stage room for ``store``'s value header before each entry from now on
        (``header_room_for``); the engine calls it once, before its first stage."""
        self.header_room = header_room_for(store, self.layout)

    # ---- staging -----------------------------------------------------------------------

    def staged_bytes(self, blocks: Sequence[tuple]) -> int:
        """Pool bytes ``stage(blocks)`` needs."""
        counts: dict = {}
        for g, _ in blocks:
            counts[g] = counts.get(g, 0) + 1
        total = 0
        for g, n in counts.items():
            total += _run_bytes(self.layout.groups[g].pieces, self.header_room, n, self.whole_entries)
        return total

    def staged_bytes_bound(self, group: int) -> Tuple[int, int]:
        """``(per_entry, per_run)``: ``staged_bytes`` of ``n`` entries of ``group`` in one batch
        is at most ``n * per_entry + per_run`` (whole entries are each aligned; piece arrays
        each add at most the alignment)."""
        pieces = self.layout.groups[group].pieces
        if self.whole_entries:
            return _run_bytes(pieces, self.header_room, 1, True), 0
        return sum(_row_bytes(pieces, self.header_room)), ALIGNMENT * len(pieces)

    def stage(self, blocks: Sequence[tuple], lane: Optional[str] = None) -> Optional[StagedBatch]:
        """Reserve room for ``blocks`` ([(group, block_id)]) in ``lane``'s share of the pool
        (see :meth:`StagingPool.alloc`), or None if it is too full (split the batch, or wait
        for an earlier one to be released)."""
        blocks = [(int(g), int(b)) for g, b in blocks]
        groups = self.layout.groups
        for g, b in blocks:
            if not 0 <= g < len(groups):
                raise ValueError(f"group {g} out of range (layout has {len(groups)} groups)")
            if not 0 <= b < groups[g].num_blocks:
                raise ValueError(f"block id {b} out of range for group {g} ({groups[g].num_blocks} blocks)")
        if self.whole_entries:
            return self._stage_whole_entries(blocks, lane)
        by_group: dict = {}
        for i, (g, _) in enumerate(blocks):
            by_group.setdefault(g, []).append(i)
        nbytes = self.staged_bytes(blocks)
        off = self.pool.alloc(nbytes, lane)
        if off is None:
            return None
        room = self.header_room
        batch = StagedBatch(self.pool, blocks, off, nbytes, header_room=room)
        batch._parts = [None] * len(blocks)
        cur = off
        base = self.pool.ptr
        for g, rows in by_group.items():  # piece-major: per piece, the run's blocks as one array
            n = len(rows)
            ids = torch.tensor([blocks[i][1] for i in rows], dtype=torch.int64)
            sizes = [p.size for p in groups[g].pieces]
            row_bytes = _row_bytes(groups[g].pieces, room)
            piece_offs = []
            for size, row in zip(sizes, row_bytes):
                piece_offs.append(cur + row - size)  # after the header room
                cur += _round(n * row)
            for k, i in enumerate(rows):
                batch._parts[i] = [(base + po + k * row, s) for po, row, s in zip(piece_offs, row_bytes, sizes)]
            batch.runs.append(_GroupRun(g, rows, ids, piece_offs, row_bytes))
        return batch

    def _stage_whole_entries(self, blocks: list, lane: Optional[str]) -> Optional[StagedBatch]:
        """(CPU) Each entry whole at the pool's alignment: the header room, then the group's
        pieces back to back; one payload part per entry."""
        room, payload = self.header_room, [g.block_bytes for g in self.layout.groups]
        starts, nbytes = [], 0
        for g, _ in blocks:
            starts.append(nbytes)
            nbytes += _round(room + payload[g])
        off = self.pool.alloc(nbytes, lane)
        if off is None:
            return None
        batch = StagedBatch(self.pool, blocks, off, nbytes, header_room=room)
        first = self.pool.ptr + off + room
        batch._parts = [[(first + start, payload[g])] for (g, _), start in zip(blocks, starts)]
        return batch

    # ---- copies ------------------------------------------------------------------------

    def current_stream_event(self):
        """(CUDA) An event recorded on the calling thread's current stream, None on CPU: copies
        run later on another thread are ordered after it with ``after=``."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def _side_stream(self, after=None):
        """(CUDA) The side stream, ordered after ``after`` (an event), else after the work the
        current stream has queued (the KV was written there)."""
        self.stream.wait_event(after if after is not None else self.current_stream_event())
        return torch.cuda.stream(self.stream)

    def _fence(self) -> Fence:
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return Fence(ev)

    def _cpu_rows(self, batch: StagedBatch, ok: Optional[Sequence[bool]] = None):
        """The batch's entries (those with ``ok[i]``; whole entries) as rows for the Rust
        copies: per piece the KV address, the staging address and the size, entry by entry
        (``row_start``), and the entry index of each row; None without an entry."""
        order = np.arange(len(batch.blocks)) if ok is None else np.flatnonzero(np.asarray(ok, dtype=bool))
        if not len(order):
            return None
        blocks = np.asarray(batch.blocks, dtype=np.int64)[order]
        payloads = np.array([batch._parts[i][0][0] for i in order], dtype=np.uint64)
        return (*self._pieces.rows(blocks[:, 0], blocks[:, 1], payloads), order)

    def _cpu_copy(self, batch: StagedBatch, to_pool: bool, ok=None, digests: bool = False, expected=None) -> Fence:
        """Both directions on CPU: raw region copies in the Rust core, GIL released. Not
        torch's ops: called from the engine's lanes, a torch op opens an OpenMP team that
        fights vLLM's bound OpenMP threads (a 144 KiB scatter took 60-80 ms).

        ``digests`` (gather): also keep each entry's XXH3-64, hashed while it is in cache.
        ``expected`` (scatter): write an entry only if its staged bytes have that digest.
        With ``self.mac_secret`` (a ``StoreSecret``, set by the engine from a store keyed with a
        deployment secret) the digest is the keyed payload tag of the value's MAC instead."""
        from kvstride import _core

        rows = self._cpu_rows(batch, ok)
        if digests:
            batch.digests = np.zeros(len(batch.blocks), dtype=np.uint64)
        if expected is not None:
            batch.verified = np.zeros(len(batch.blocks), dtype=bool)
        if rows is None:
            return Fence()
        kv, pool, length, row_start, order = rows
        if digests:
            batch.digests[order] = _core._save_rows(kv, pool, length, row_start, self.mac_secret)
        elif expected is not None:
            want = np.asarray(expected, dtype=np.uint64)[order]
            batch.verified[order] = _core._load_rows(pool, kv, length, row_start, want, self.mac_secret)
        else:
            _core._copy_regions(*((kv, pool) if to_pool else (pool, kv)), length)
        return Fence()

    def gather(self, batch: StagedBatch, *, digests: bool = False) -> Fence:
        """KV blocks -> staging. ``digests`` (CPU only): also set ``batch.digests``, each
        entry's XXH3-64 (the store's payload hash), computed while the bytes are in cache.
        CUDA: the blocks are read on the side stream; the caller's stream must wait for the
        fence (``Fence.wait_stream``) before it writes them again."""
        if not self.cuda:
            return self._cpu_copy(batch, to_pool=True, digests=digests)
        if digests:
            raise ValueError("digests during the gather are computed on CPU KV caches only")
        with self._side_stream():
            for run in batch.runs:
                n = len(run.rows)
                ids = run.ids.to(self.device, non_blocking=True)
                for view, po, p in zip(self._views[run.group], run.piece_offs, self.layout.groups[run.group].pieces):
                    self._pool_rows(po, n, p.size, view.dtype).copy_(view.index_select(0, ids), non_blocking=True)
        return self._fence()

    def scatter(self, batch: StagedBatch, ok: Optional[Sequence[bool]] = None, *, expected=None, after=None) -> Fence:
        """Staging -> KV blocks, only for entries with ``ok[i]`` true (default: all).
        ``expected`` (CPU only): the XXH3-64 each entry's staged bytes must have; an entry
        whose bytes differ is not written, and ``batch.verified`` tells which were.
        ``after`` (CUDA): an event from :meth:`current_stream_event` on the stream whose pending
        work the writes must follow (default: the calling thread's current stream)."""
        if not self.cuda:
            return self._cpu_copy(batch, to_pool=False, ok=ok, expected=expected)
        if expected is not None:
            raise ValueError("digest-checked scatters run on CPU KV caches only")
        with self._side_stream(after):
            for run in batch.runs:
                n = len(run.rows)
                sel = None
                if ok is not None:
                    keep = [k for k, i in enumerate(run.rows) if ok[i]]
                    if not keep:
                        continue
                    if len(keep) < n:
                        sel = torch.tensor(keep, dtype=torch.int64)
                ids = (run.ids if sel is None else run.ids.index_select(0, sel)).to(self.device, non_blocking=True)
                dsel = None if sel is None else sel.to(self.device, non_blocking=True)
                for view, po, p in zip(self._views[run.group], run.piece_offs, self.layout.groups[run.group].pieces):
                    src = self._pool_rows(po, n, p.size, view.dtype).to(self.device, non_blocking=True)
                    if dsel is not None:
                        src = src.index_select(0, dsel)
                    view.index_copy_(0, ids, src)
        return self._fence()
