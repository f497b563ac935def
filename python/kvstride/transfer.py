"""Batched copies between the paged KV cache and a bounded host staging pool.

A plan names blocks as ``(group, block_id)``.  ``Transfer.stage`` reserves room for them in the
:class:`StagingPool` (one host allocation, pinned on CUDA, allocated once and reused) and lays
each group's entries out piece-major: for piece ``j`` of the group, the ``n`` blocks' bytes
are one contiguous ``(n, size_j)`` array.  So one block's stored payload is a list of
``(address, size)`` parts (one row of each piece array) -- exactly what
Mooncake's ``batch_*_multi_buffers`` calls and the embedded store take -- and the copies are
one ``index_select`` (gather) or ``index_copy_`` (scatter) per piece and group, whatever the
number of blocks.  Never one Python call per block.

On CUDA the copies run on a side stream: the side stream first waits for the current stream
(the KV was written there), device -> host goes through a device-side gather into a temporary
then one ``copy_(non_blocking=True)`` into pinned memory; host -> device is the reverse.  The
returned :class:`Fence` holds a CUDA event.  On CPU the same code runs synchronously and the
fence is already complete.

Scatter takes a per-entry mask (the store's statuses): entries that were not read correctly
are never copied into a KV block.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch

from .layout import KVLayout

__all__ = ["StagingPool", "StagedBatch", "Transfer", "Fence"]

_ALIGN = 64


def _round(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


class StagingPool:
    """A bounded, reusable host buffer with a first-fit range allocator.

    ``pin``: page-lock the buffer (default: when CUDA is available).  ``register(fn)`` calls
    ``fn(ptr, nbytes)`` once, e.g. ``store.register_buffer`` for Mooncake.
    """

    def __init__(self, capacity_bytes: int, *, pin: Optional[bool] = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"staging capacity must be positive, got {capacity_bytes}")
        if pin is None:
            pin = torch.cuda.is_available()
        self.capacity = _round(int(capacity_bytes))
        self.tensor = torch.empty(self.capacity, dtype=torch.uint8, pin_memory=bool(pin))
        self.pinned = bool(pin)
        self.ptr = self.tensor.data_ptr()
        self._free = [(0, self.capacity)]  # sorted, coalesced (offset, size)
        self._lock = threading.Lock()

    def register(self, register_fn) -> None:
        register_fn(self.ptr, self.capacity)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(s for _, s in self._free)

    def alloc(self, nbytes: int) -> Optional[int]:
        """Offset of ``nbytes`` reserved bytes, or None if no free range is large enough."""
        n = _round(max(int(nbytes), 1))
        with self._lock:
            for i, (off, size) in enumerate(self._free):
                if size >= n:
                    if size == n:
                        del self._free[i]
                    else:
                        self._free[i] = (off + n, size - n)
                    return off
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


class Fence:
    """Completion of a gather or scatter.  CPU: complete on return.  CUDA: a recorded event."""

    def __init__(self, event=None) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event is None or self._event.query()

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
    group: int
    rows: list  # indices into StagedBatch.blocks
    ids: torch.Tensor  # int64 block ids (CPU)
    piece_offs: list  # pool offset of each piece array (n x size_j)


@dataclass
class StagedBatch:
    """Blocks reserved in the staging pool; ``parts(i)`` is block i's payload as
    [(address, size)], ready for ``store.put`` / ``store.get``.  Release it (or use it as a
    context manager) once the copies are fenced and the store call has returned."""

    pool: StagingPool
    blocks: list  # [(group, block_id)]
    offset: int
    nbytes: int
    runs: list = field(default_factory=list)
    _parts: list = field(default_factory=list)
    _released: bool = False
    digests: Optional[np.ndarray] = None  # per entry, set by gather(digests=True)
    verified: Optional[np.ndarray] = None  # per entry, set by scatter(expected=...)

    def parts(self, i: int) -> list:
        return self._parts[i]

    def all_parts(self) -> list:
        return list(self._parts)

    def payload_view(self, i: int) -> list:
        """Block i's payload parts as uint8 tensor views of the pool (tests, debugging)."""
        base = self.pool.ptr
        return [self.pool.tensor[a - base : a - base + s] for a, s in self._parts[i]]

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.pool.release(self.offset, self.nbytes)

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
        self.pool = pool
        self.device = layout.device or torch.device("cpu")
        self.cuda = self.device.type == "cuda"
        self.stream = (stream or torch.cuda.Stream(device=self.device)) if self.cuda else None
        # Per storage, per dtype width: a flat tensor over the whole storage.
        self._wide: dict = {}
        # Per group: per piece, (view over all blocks as (num_blocks, size/w), dtype, w)
        self._views = [[self._piece_view(p, g.num_blocks) for p in g.pieces] for g in layout.groups]
        self._pieces = [layout.piece_addresses(g) for g in range(len(layout.groups))]  # for the CPU copies
        self._pool_views: dict = {}

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

    # ---- staging -----------------------------------------------------------------------

    def staged_bytes(self, blocks: Sequence[tuple]) -> int:
        """Pool bytes ``stage(blocks)`` needs."""
        counts: dict = {}
        for g, _ in blocks:
            counts[g] = counts.get(g, 0) + 1
        total = 0
        for g, n in counts.items():
            total += sum(_round(n * p.size) for p in self.layout.groups[g].pieces)
        return total

    def stage(self, blocks: Sequence[tuple]) -> Optional[StagedBatch]:
        """Reserve pool room for ``blocks`` ([(group, block_id)]), or None if the pool is too
        full (split the batch, or wait for an earlier one to be released)."""
        blocks = [(int(g), int(b)) for g, b in blocks]
        groups = self.layout.groups
        by_group: dict = {}
        for i, (g, b) in enumerate(blocks):
            if not 0 <= g < len(groups):
                raise ValueError(f"group {g} out of range (layout has {len(groups)} groups)")
            if not 0 <= b < groups[g].num_blocks:
                raise ValueError(f"block id {b} out of range for group {g} ({groups[g].num_blocks} blocks)")
            by_group.setdefault(g, []).append(i)
        nbytes = self.staged_bytes(blocks)
        off = self.pool.alloc(nbytes)
        if off is None:
            return None
        batch = StagedBatch(self.pool, blocks, off, nbytes)
        batch._parts = [None] * len(blocks)
        cur = off
        base = self.pool.ptr
        for g, rows in by_group.items():
            n = len(rows)
            ids = torch.tensor([blocks[i][1] for i in rows], dtype=torch.int64)
            piece_offs = []
            for p in groups[g].pieces:
                piece_offs.append(cur)
                cur += _round(n * p.size)
            batch.runs.append(_GroupRun(g, rows, ids, piece_offs))
            sizes = [p.size for p in groups[g].pieces]
            for k, i in enumerate(rows):
                batch._parts[i] = [(base + po + k * s, s) for po, s in zip(piece_offs, sizes)]
        return batch

    # ---- copies ------------------------------------------------------------------------

    def _begin(self):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self.stream.wait_event(ev)
        return torch.cuda.stream(self.stream)

    def _end(self, ctx) -> Fence:
        if ctx is None:
            return Fence()
        ev = torch.cuda.Event()
        ev.record(self.stream)
        return Fence(ev)

    def _cpu_rows(self, batch: StagedBatch, ok: Optional[Sequence[bool]] = None):
        """The batch's entries (those with ``ok[i]``) as rows for the Rust copies: per piece
        the KV address, the staging address and the size, entry by entry (``row_start``), and
        the entry index of each row."""
        kv, pool, length, counts, order = [], [], [], [], []
        for run in batch.runs:
            keep = np.arange(len(run.rows)) if ok is None else np.flatnonzero([ok[i] for i in run.rows])
            if not len(keep):
                continue
            ids = run.ids.numpy()[keep].astype(np.uint64)
            base, stride, size = self._pieces[run.group]
            staged = np.uint64(self.pool.ptr) + np.array(run.piece_offs, dtype=np.uint64)
            kv.append((base[None, :] + ids[:, None] * stride[None, :]).ravel())
            pool.append((staged[None, :] + keep.astype(np.uint64)[:, None] * size[None, :]).ravel())
            length.append(np.broadcast_to(size, (len(keep), len(size))).ravel())
            counts.append(np.full(len(keep), len(size), dtype=np.uint64))
            order.append(np.asarray(run.rows, dtype=np.int64)[keep])
        if not kv:
            return None
        kv, pool, length = (np.ascontiguousarray(np.concatenate(x), dtype=np.uint64) for x in (kv, pool, length))
        row_start = np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.uint64)
        return kv, pool, length, row_start, np.concatenate(order)

    def _cpu_copy(self, batch: StagedBatch, to_pool: bool, ok=None, digests: bool = False, expected=None) -> Fence:
        """Both directions on CPU: raw region copies in the Rust core, GIL released. Not
        torch's ops: called from the engine's lanes, a torch op opens an OpenMP team that
        fights vLLM's bound OpenMP threads (a 144 KiB scatter took 60-80 ms).

        ``digests`` (gather): also keep each entry's XXH3-64, hashed while it is in cache.
        ``expected`` (scatter): write an entry only if its staged bytes have that digest."""
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
            batch.digests[order] = _core._save_rows(kv, pool, length, row_start)
        elif expected is not None:
            want = np.asarray(expected, dtype=np.uint64)[order]
            batch.verified[order] = _core._load_rows(pool, kv, length, row_start, want)
        else:
            _core._copy_regions(*((kv, pool) if to_pool else (pool, kv)), length)
        return Fence()

    def gather(self, batch: StagedBatch, *, digests: bool = False) -> Fence:
        """KV blocks -> staging. ``digests`` (CPU only): also set ``batch.digests``, each
        entry's XXH3-64 (the store's payload hash), computed while the bytes are in cache."""
        if not self.cuda:
            return self._cpu_copy(batch, to_pool=True, digests=digests)
        if digests:
            raise ValueError("digests during the gather are computed on CPU KV caches only")
        ctx = self._begin()
        if ctx is not None:
            ctx.__enter__()
        try:
            for run in batch.runs:
                n = len(run.rows)
                ids = run.ids.to(self.device, non_blocking=True) if self.cuda else run.ids
                for view, po, p in zip(self._views[run.group], run.piece_offs, self.layout.groups[run.group].pieces):
                    dst = self._pool_rows(po, n, p.size, view.dtype)
                    if self.cuda:
                        dst.copy_(view.index_select(0, ids), non_blocking=True)
                    else:
                        torch.index_select(view, 0, ids, out=dst)
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        return self._end(ctx)

    def scatter(self, batch: StagedBatch, ok: Optional[Sequence[bool]] = None, *, expected=None) -> Fence:
        """Staging -> KV blocks, only for entries with ``ok[i]`` true (default: all).
        ``expected`` (CPU only): the XXH3-64 each entry's staged bytes must have; an entry
        whose bytes differ is not written, and ``batch.verified`` tells which were."""
        if not self.cuda:
            return self._cpu_copy(batch, to_pool=False, ok=ok, expected=expected)
        if expected is not None:
            raise ValueError("digest-checked scatters run on CPU KV caches only")
        ctx = self._begin()
        if ctx is not None:
            ctx.__enter__()
        try:
            for run in batch.runs:
                n = len(run.rows)
                if ok is None:
                    sel = None
                else:
                    keep = [k for k, i in enumerate(run.rows) if ok[i]]
                    if not keep:
                        continue
                    sel = None if len(keep) == n else torch.tensor(keep, dtype=torch.int64)
                ids = run.ids if sel is None else run.ids.index_select(0, sel)
                if self.cuda:
                    ids = ids.to(self.device, non_blocking=True)
                    dsel = sel.to(self.device, non_blocking=True) if sel is not None else None
                for view, po, p in zip(self._views[run.group], run.piece_offs, self.layout.groups[run.group].pieces):
                    src = self._pool_rows(po, n, p.size, view.dtype)
                    if self.cuda:
                        src = src.to(self.device, non_blocking=True)
                        if dsel is not None:
                            src = src.index_select(0, dsel)
                    elif sel is not None:
                        src = src.index_select(0, sel)
                    view.index_copy_(0, ids, src)
        finally:
            if ctx is not None:
                ctx.__exit__(None, None, None)
        return self._end(ctx)
