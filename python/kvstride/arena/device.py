"""The arena's device data path: blocks of KV tensors on a device (CUDA) to and from the arena's
pinned host slots, at the host link's speed, with few launches from the caller's thread.

Every copy is a table of rows, the rows the Rust region copier takes on CPU
(:class:`kvstride.copies.PieceTable`: a block's pieces in the KV cache, back to back in its
slot). On CUDA a Triton kernel copies a whole table in one launch: the GPU reads and writes pinned
host memory directly (it is mapped into the device's address space), so a chunk is one launch
whatever its groups, pieces and slots, and such a copy runs on a few of the GPU's cores.

A save runs on a stream of its own that first waits for the work the caller queued on its
stream: per chunk, a kernel gathers the blocks' pieces into device staging laid out as the
slots are (at the device memory's speed, every core helping), then a kernel drains the staging
into the pinned slots. Staging holds one chunk, so a chunk's gather follows the drains of the
chunks before it. The caller's stream does not wait: each chunk's gather is kept in the
layout's ``pending_reads`` with its blocks, and the caller fences the blocks it is about to
write again (``KVLayout.fence``: its stream waits, on the device, for the gathers that read
them). The caller's thread only enqueues: launches cost it the same at any size (the copy
engine's commands do not), which keeps a 2 GiB save to a few milliseconds of its time.

A load runs on the load lane's thread, on a stream of its own: per chunk, when its slots form
few runs (``DMA_RUNS``), the copy engine moves each run into device staging and a kernel
scatters the staging into the destination blocks; scattered slots are read by one kernel
straight into the blocks.

Work goes in chunks of ``CHUNK_BYTES``: each chunk's event lets the host compute a save's
digests while the next chunk copies, and check a load's digests before its chunk is copied; the
first chunks of a load and the last of a save are small, so that little of either waits for
the other. Staging holds one chunk.

With ``digests_on_device`` the GPU takes those digests instead (:mod:`kvstride.arena.device_xxh3`,
the same XXH3-64): a save hashes each chunk's staging on a stream of its own while the chunk
drains, and a load copies each chunk into one of two staging buffers, then checks and scatters
it on a stream of its own while the next chunk copies, leaving an entry whose bytes changed
unwritten. No byte then crosses host memory a second time.

The same code runs on CPU tensors, each table executed by the Rust region copier (no streams:
every copy is done when it returns), which is how the CPU test tier checks it; the kernels
themselves are checked on CPU memory by Triton's interpreter, and on CUDA by the CUDA tests.

It holds the whole device pipeline, the kernels, the staging ring, the streams and the digests,
in one file, so that the ordering rules between them (which event waits for which copy) can be
read in one place.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from kvstride import _core
from kvstride.arena import device_xxh3
from kvstride.copies import PieceTable

__all__ = ["BlockKernels", "DeviceCopier", "DevicePipeline", "StagingRing", "SAVE_STAGING_CHUNKS", "CHUNK_BYTES",
           "COPY_PROGRAMS", "DMA_RUNS", "access_width", "chunk_sizes", "copy_engine", "copy_rows", "digests_to_host",
           "drain_chunk", "launch_copy_rows", "on_side_stream", "recorded", "slot_runs", "to_host", "used_on"]

#: One chunk at most: a save's (its staging holds ``SAVE_STAGING_CHUNKS``), a load's, and
#: the bytes whose digests are computed (saves) or checked (loads) while the previous or next
#: chunk copies.
CHUNK_BYTES = 128 << 20

#: Programs (thread blocks) of the copy kernel: enough to keep the host link busy, few of the
#: GPU's cores, so that the model's own kernels run beside a copy.
COPY_PROGRAMS = 32

#: Runs of consecutive slots in a chunk up to which the GPU's copy engine moves them over the
#: host link (one ``copy_`` a run, at the link's full speed, no SM); a chunk of more scattered
#: slots is moved by the rows kernel on ``COPY_PROGRAMS`` programs (about 0.9 of that speed, one
#: launch), straight from the slots (loads) or out of device staging (saves' drains). A run is
#: one slot or more, never a piece: pieces (4-64 KiB) meet only device memory.
DMA_RUNS = 8

#: Elements a program copies per step of its loop.
_TILE = 2048

_ELEMENTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def access_width(*arrays) -> Tuple[int, int]:
    """``(element bytes, elements per access)`` for copies whose every address, stride and length
    in ``arrays`` is a multiple of the element: 8-byte elements two at a time where everything
    is a multiple of 16 bytes (one 16-byte access per thread), else the widest element that
    divides everything."""
    bits = int(np.bitwise_or.reduce(np.concatenate([np.asarray(a, dtype=np.uint64).ravel() for a in arrays])))
    if bits % 16 == 0:
        return 8, 2
    return next(width for width in (8, 4, 2, 1) if bits % width == 0), 1


@functools.lru_cache(maxsize=None)
def _kernels():
    """The Triton copy kernels, compiled on first use (Triton ships with PyTorch's CUDA builds).

    Each program walks work items (one tile of one row or piece each) with a grid stride, so a
    copy of a few blocks spreads over every program as a large one does. Addresses arrive as
    integers and become offsets (in ``W``-byte elements) from ``origin``, a pointer argument
    whose alignment Triton knows: with the ``VEC`` hint each thread then moves 16 bytes per
    access. Tables are int64 ``(rows, stride)`` arrays, read from column ``first`` on."""
    import triton
    import triton.language as tl

    runtime_ints = ["origin_addr", "stride", "first", "count", "tiles", "n_pieces", "n_groups", "pieces_per_entry"]

    @triton.jit(do_not_specialize=runtime_ints[:5])
    def copy_rows_kernel(origin, origin_addr, table, stride, first, count, tiles,
                         W: tl.constexpr, VEC: tl.constexpr, TILE: tl.constexpr):
        # table rows: source addresses, destination addresses, lengths (elements).
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        for work in range(pid, count * tiles, programs):
            row = first + work // tiles
            start = (work % tiles) * TILE
            length = tl.multiple_of(tl.load(table + 2 * stride + row), VEC)
            if start < length:
                src = tl.multiple_of((tl.load(table + row) - origin_addr) // W, VEC)
                dst = tl.multiple_of((tl.load(table + stride + row) - origin_addr) // W, VEC)
                offsets = start + tl.arange(0, TILE)
                inside = offsets < length
                tl.store(origin + dst + offsets, tl.load(origin + src + offsets, mask=inside), mask=inside)

    @triton.jit(do_not_specialize=runtime_ints)
    def copy_blocks_kernel(origin, origin_addr, table, stride, first, count, tiles, pieces, n_pieces, groups,
                           n_groups, pieces_per_entry, flags, TO_SLOTS: tl.constexpr, FLAGS: tl.constexpr,
                           W: tl.constexpr, VEC: tl.constexpr, TILE: tl.constexpr):
        # table rows: group, block id, slot address. pieces rows: address in block 0, block
        # stride (bytes), size (elements), start in a slot (bytes); groups rows: first piece,
        # piece count. With FLAGS, an entry whose flag (by column) is 0 is left alone.
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        per_entry = pieces_per_entry * tiles
        for work in range(pid, count * per_entry, programs):
            entry = first + work // per_entry
            nth = (work % per_entry) // tiles
            start = (work % tiles) * TILE
            group = tl.load(table + entry)
            wanted = nth < tl.load(groups + n_groups + group)
            if FLAGS:
                wanted = wanted & (tl.load(flags + entry) != 0)
            if wanted:
                piece = tl.load(groups + group) + nth
                size = tl.multiple_of(tl.load(pieces + 2 * n_pieces + piece), VEC)
                if start < size:
                    block = tl.load(table + stride + entry)
                    kv_addr = tl.load(pieces + piece) + block * tl.load(pieces + n_pieces + piece)
                    slot_addr = tl.load(table + 2 * stride + entry) + tl.load(pieces + 3 * n_pieces + piece)
                    kv = tl.multiple_of((kv_addr - origin_addr) // W, VEC)
                    slot = tl.multiple_of((slot_addr - origin_addr) // W, VEC)
                    offsets = start + tl.arange(0, TILE)
                    inside = offsets < size
                    if TO_SLOTS:
                        tl.store(origin + slot + offsets, tl.load(origin + kv + offsets, mask=inside), mask=inside)
                    else:
                        tl.store(origin + kv + offsets, tl.load(origin + slot + offsets, mask=inside), mask=inside)

    return copy_rows_kernel, copy_blocks_kernel


def _on(device: torch.device, array: np.ndarray) -> torch.Tensor:
    """``array`` as int64 on ``device``, through pinned memory to CUDA: the copy does not wait on
    the host."""
    table = torch.from_numpy(np.ascontiguousarray(np.asarray(array).view(np.int64)))
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table


#: Chunks of device staging a copier's saves share, as a ring of rows: a chunk's gather waits
#: only for the drain of the last chunk that used its rows (of this save or an earlier one),
#: not for the host-link copies queued since, so a step whose stream waits for its saves'
#: gathers waits for device-speed copies alone while the ring has room.
SAVE_STAGING_CHUNKS = 2


class StagingRing:
    """Saves' device staging: ``rows`` rows of ``row_bytes`` handed out in order, and the chunks
    that took them, each read until its event ``_Chunk.done`` (its drain, on one drain stream,
    after its hash: a later chunk's event implies every earlier one's)."""

    def __init__(self, device: torch.device, rows: int, row_bytes: int) -> None:
        self.memory = torch.empty(rows * row_bytes, dtype=torch.uint8, device=device)
        self.rows, self.row_bytes = rows, row_bytes
        self._next = 0
        self._taken: List[_Chunk] = []  # oldest first: chunks with rows no later chunk took since

    def take(self, count: int) -> "_Chunk":
        """Rows for a chunk of ``count`` (at most ``rows``); ``after`` is the newest chunk that
        read some of them last, whose ``done`` must come first (it implies the older ones')."""
        start = self._next if self._next + count <= self.rows else 0
        chunk = _Chunk(start, start + count)
        self._next = chunk.end
        for earlier in self._taken:
            if earlier.give_up(chunk.start, chunk.end):
                chunk.after = earlier
        self._taken = [earlier for earlier in self._taken if earlier.spans] + [chunk]
        chunk.address = self.memory.data_ptr() + chunk.start * self.row_bytes
        return chunk

    def synchronize(self) -> None:
        """Wait on the host until every chunk handed out was read (before the ring is replaced)."""
        for chunk in self._taken:
            if chunk.done is not None:
                chunk.done.synchronize()


class _Chunk:
    """A save chunk's rows in the staging ring (``spans``: those no later chunk took since; its
    first row's ``address``), the chunk it waits for, and its ``done`` event."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.spans = [(start, end)]
        self.after: Optional[_Chunk] = None
        self.done = None
        self.address = 0

    def wait(self, stream) -> None:
        """``stream``'s next work follows the reads of the chunk that had these rows last."""
        if stream is not None and self.after is not None and self.after.done is not None:
            stream.wait_event(self.after.done)

    def give_up(self, start: int, end: int) -> bool:
        """Rows ``start`` to ``end`` go to a later chunk: whether this one held some of them."""
        kept = []
        for first, last in self.spans:
            kept += [span for span in ((first, min(last, start)), (max(first, end), last)) if span[0] < span[1]]
        held = kept != self.spans
        self.spans = kept
        return held


class DevicePipeline:
    """The streams of one device data path and the staging ring its saves share, the same for
    the arena (:class:`DeviceCopier`) and the staging pool (:class:`kvstride.transfer.Transfer`).
    One stream per kind of copy:

    - ``gather``: a save's reads of KV blocks into device staging, the reads a fence waits for;
    - ``urgent``: the gathers of an urgent copy, one whose reads the caller's stream waits for at
      once (a block vLLM rewrites in place): never behind other gathers, first where they compete;
    - ``drain``: device staging to host memory (the slots, the pool), apart from the gathers;
    - ``hash``, ``urgent_hash``: a save's digests of its device staging, beside its drains;
    - ``scatter``: a load's copies into KV blocks, never behind a save;
    - ``check``: a load's digest checks on the device, beside its copies.

    On CPU every stream is None: a copy is done when it returns."""

    def __init__(self, device: torch.device, gather=None) -> None:
        cuda = device.type == "cuda"

        def stream(priority: int = 0):
            return torch.cuda.Stream(device, priority=priority) if cuda else None

        self.device = device
        self.gather = (gather or stream()) if cuda else None
        self.urgent = stream(priority=-1)
        self.drain, self.hash, self.urgent_hash = stream(), stream(), stream()
        self.scatter, self.check = stream(), stream()
        # One save's launches at a time (the caller's thread and the launch lane both save): the
        # ring's next chunk must see its rows' last reader.
        self.save_lock = threading.Lock()
        self._ring: Optional[StagingRing] = None

    def save_streams(self, urgent: bool) -> Tuple[object, object]:
        """A save's (gather, hash) streams."""
        return (self.urgent, self.urgent_hash) if urgent else (self.gather, self.hash)

    def ring(self, rows: int, row_bytes: int) -> StagingRing:
        """The saves' staging ring of at least ``rows`` rows of ``row_bytes``: made on the first
        save, and again larger once the chunks in flight ended."""
        ring = self._ring
        if ring is None or ring.rows < rows or ring.row_bytes != row_bytes:
            if ring is not None:
                ring.synchronize()
            self._ring = ring = StagingRing(self.device, rows, row_bytes)
        return ring


def drain_chunk(chunk: _Chunk, gathered, drains, hashes, drain: Callable[[], None],
                digest: Optional[Callable[[], None]] = None) -> None:
    """A gathered chunk's ``drain`` to host memory on ``drains``, after its gather (event
    ``gathered``), with its ``digest`` beside it on ``hashes``; the chunk's staging rows are read
    until ``chunk.done``, after both."""
    with on_side_stream(drains, gathered):
        if digest is not None:
            with on_side_stream(hashes, gathered):
                digest()
        drain()
        if digest is not None and drains is not None:
            drains.wait_stream(hashes)
        chunk.done = recorded(drains)


def digests_to_host(found: torch.Tensor, drains, hashes) -> torch.Tensor:
    """The digests every chunk's hash wrote into ``found``, copied to the host after them; what
    ``drains`` records next follows the copy."""
    with on_side_stream(hashes, None):
        on_host = to_host(found)
    if drains is not None:
        drains.wait_stream(hashes)
    return on_host


def _programs(programs: int, work: int) -> Tuple[int]:
    return (max(1, min(int(programs), work)),)


def copy_rows(src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, kernel_on: Optional[torch.device] = None,
              programs: int = COPY_PROGRAMS) -> None:
    """Copy ``lengths[i]`` bytes from address ``src[i]`` to ``dst[i]`` for every row (uint64
    arrays; rows must not overlap). ``kernel_on`` a device: one kernel on its current stream,
    any mix of device and pinned host addresses (CUDA; on CPU, Triton's interpreter runs it);
    None: the Rust region copier, done when it returns."""
    if not len(src):
        return
    if kernel_on is None:
        _core._copy_regions(src, dst, lengths)
        return
    width, vec = access_width(src, dst, lengths)
    table = _on(kernel_on, np.stack([src, dst, lengths // np.uint64(width)]))
    launch_copy_rows(table, table, 0, len(src), width, vec, int(lengths.max()) // width, programs)


def launch_copy_rows(origin: torch.Tensor, table: torch.Tensor, first: int, count: int, width: int, vec: int,
                     longest: int, programs: int = COPY_PROGRAMS) -> None:
    """The rows kernel over columns ``first`` to ``first + count`` of ``table`` (int64, rows:
    sources, destinations, lengths in ``width``-byte elements, the longest ``longest``), its
    addresses taken relative to ``origin`` (a tensor on the kernel's device, 16-byte aligned),
    on the current stream."""
    tiles = -(-longest // _TILE)
    with device_xxh3.LAUNCHES:
        copy_rows_kernel, _ = _kernels()
        copy_rows_kernel[_programs(programs, count * tiles)](
            origin.view(_ELEMENTS[width]), origin.data_ptr(), table, table.shape[1], first, count, tiles,
            W=width, VEC=vec, TILE=_TILE)


def slot_runs(slots: np.ndarray) -> List[Tuple[int, int, int]]:
    """``(position, first slot, count)`` of each run of consecutive slots in ``slots``, in order."""
    if not len(slots):
        return []
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(slots)]])
    return [(int(a), int(slots[a]), int(b - a)) for a, b in zip(starts, ends)]


class BlockKernels:
    """The copy kernels bound to one KV layout: its pieces' table on ``device`` and the widest
    access every piece allows, together with ``aligned`` (the other addresses and strides the
    rows will use: a host buffer's address, its slot or entry size). Used by the arena's
    copier and by the staging pool's transfers."""

    def __init__(self, layout, pieces: PieceTable, device: torch.device, aligned=(), programs: int = COPY_PROGRAMS) -> None:
        self.pieces = pieces
        self.device = device
        self.programs = int(programs)
        # Copies between device staging and the KV cache stay on the device: every core may help.
        self.device_programs = self.programs
        if device.type == "cuda":
            self.device_programs = max(self.programs, 2 * torch.cuda.get_device_properties(device).multi_processor_count)
        block_bytes = [g.block_bytes for g in layout.groups]
        # Device staging rows start at multiples of 512 bytes from the caching allocator's blocks.
        self.width, self.vec = access_width(pieces.base, pieces.stride, pieces.size, pieces.start, block_bytes,
                                            [*aligned, 512])
        self._piece_table = _on(device, np.stack([pieces.base, pieces.stride, pieces.size // np.uint64(self.width),
                                                  pieces.start]))
        self.origin = self._piece_table  # an aligned device tensor: the kernels take addresses as offsets from it
        self._origin_in_elements = self._piece_table.view(_ELEMENTS[self.width])  # the copy kernel's W-byte elements
        self._group_table = _on(device, np.stack([pieces.first, pieces.count]))
        self._tiles_per_piece = -(-int(pieces.size.max(initial=1)) // self.width // _TILE)
        if device.type == "cuda":
            self.warm_up()

    def warm_up(self) -> None:
        """Launch every variant of the copy kernels once, with no work: Triton compiles a kernel
        on its first launch, under ``LAUNCHES``, so a step's first save would wait for the
        compiler (and every other launch with it) and the launch lane fall far behind."""
        table = self.table(np.zeros(1), np.zeros(1), np.zeros(1))
        launch_copy_rows(self._piece_table, table, 0, 0, self.width, self.vec, 0, 1)
        for to_entries in (True, False):
            for flags in (None, table[0]):
                self._launch_blocks(table, 0, 0, 1, to_entries, 1, flags)

    def table(self, *rows: np.ndarray) -> torch.Tensor:
        """Rows of an op's table (uint64 arrays of one length) on the device."""
        return _on(self.device, np.stack([np.asarray(r).astype(np.uint64) for r in rows]))

    def blocks(self, table: torch.Tensor, groups: np.ndarray, first: int, count: int, to_entries: bool,
               programs: int, flags: Optional[torch.Tensor] = None) -> None:
        """Copy every piece of the blocks in columns ``first`` to ``first + count`` of ``table``
        (rows: group, block id, entry address; ``groups`` the group row on the host) to
        (``to_entries``) or from their entries, where their pieces lie back to back; with
        ``flags`` (a device tensor, by column), only the entries whose flag is not 0."""
        if not count:
            return
        per_entry = int(self.pieces.count[groups[first:first + count]].max())
        self._launch_blocks(table, first, count, per_entry, to_entries, programs, flags)

    def _launch_blocks(self, table: torch.Tensor, first: int, count: int, per_entry: int, to_entries: bool,
                       programs: int, flags: Optional[torch.Tensor]) -> None:
        with device_xxh3.LAUNCHES:
            _, copy_blocks_kernel = _kernels()
            copy_blocks_kernel[_programs(programs, count * per_entry * self._tiles_per_piece)](
                self._origin_in_elements, self._piece_table.data_ptr(), table, table.shape[1], first, count,
                self._tiles_per_piece, self._piece_table, self._piece_table.shape[1], self._group_table,
                self._group_table.shape[1], per_entry,
                table if flags is None else flags, TO_SLOTS=to_entries, FLAGS=flags is not None, W=self.width,
                VEC=self.vec, TILE=_TILE)

    def rows(self, table: torch.Tensor, first: int, count: int, longest: int, programs: int) -> None:
        """The rows kernel over columns ``first`` to ``first + count`` of ``table`` (rows: sources,
        destinations, lengths in ``width``-byte elements); ``longest``: the longest, in bytes."""
        launch_copy_rows(self._piece_table, table, first, count, self.width, self.vec, longest // self.width, programs)


def copy_engine(dst: torch.Tensor, src: torch.Tensor) -> None:
    """One copy by the GPU's copy engine on the current stream (``copy_``, not waited for)."""
    dst.copy_(src, non_blocking=True)


def on_side_stream(stream, after=None):
    """``stream``, ordered after the event ``after`` (default: the work queued on the calling
    thread's current stream), as a context; a no-op without a stream (CPU)."""
    if stream is None:
        return contextlib.nullcontext()
    if after is not None:
        stream.wait_event(after)
    else:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    return torch.cuda.stream(stream)


def recorded(stream) -> Optional["torch.cuda.Event"]:
    """An event recorded on ``stream`` now (None without a stream). Blocking: a lane thread
    that waits for it sleeps rather than spins a core for a whole host-link copy."""
    if stream is None:
        return None
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event


class DeviceCopier:
    """Copies blocks between the device KV cache of ``layout`` and the host buffer ``host``
    (uint8, one ``slot_bytes`` slot after another; pinned for CUDA), a block's pieces back to
    back in its slot as ``pieces`` places them. Saves and loads run on streams of their own,
    so that one never waits behind the other."""

    def __init__(self, layout, host: torch.Tensor, slot_bytes: int, pieces: PieceTable,
                 chunk_bytes: int = CHUNK_BYTES, programs: int = COPY_PROGRAMS, kernels: Optional[bool] = None,
                 dma_runs: int = DMA_RUNS, digests_on_device: bool = False) -> None:
        self.layout = layout
        self.host = host
        self.slot_bytes = int(slot_bytes)
        self.device = layout.device or torch.device("cpu")
        self.pieces = pieces
        self.block_bytes = np.array([g.block_bytes for g in layout.groups], dtype=np.uint64)
        self.chunk_slots = max(1, int(chunk_bytes) // self.slot_bytes)
        self.dma_runs = int(dma_runs)
        cuda = self.device.type == "cuda"
        self.pipeline = DevicePipeline(self.device)
        # The copy kernels (default on CUDA; on CPU under Triton's interpreter, for tests), else
        # the Rust region copier.
        self.kernels = None
        self.width = 1
        if cuda if kernels is None else kernels:
            # Slots and staging rows start at multiples of slot_bytes from aligned buffers.
            self.kernels = BlockKernels(layout, pieces, self.device, [host.data_ptr(), slot_bytes], programs)
            self.width = self.kernels.width
        # Digests on the device (with the kernels): a save's XXH3 taken from its device staging
        # and a load's checked there, so that no byte crosses host memory twice. Groups whose
        # values the XXH3 kernel does not take keep theirs on the host.
        self.digests_on_device = bool(digests_on_device)
        self._hashable = np.array([device_xxh3.eligible(int(n)) and self.slot_bytes % 16 == 0 for n in self.block_bytes],
                                  dtype=bool)
        if cuda and self.digests_on_device and self.kernels is not None:
            device_xxh3.warm_up(self.device)  # compiled now, not under a step's first save

    def _slot_addresses(self, slots: np.ndarray) -> np.ndarray:
        return np.uint64(self.host.data_ptr()) + slots.astype(np.uint64) * np.uint64(self.slot_bytes)

    def _chunks(self, count: int, growing: bool) -> List[np.ndarray]:
        """Positions ``0..count`` cut into chunks of at most ``chunk_slots`` (``chunk_sizes``)."""
        bounds = np.cumsum([0, *chunk_sizes(count, self.chunk_slots, growing)])
        return [np.arange(a, b) for a, b in zip(bounds[:-1], bounds[1:])]

    def _staging(self, parts: List[np.ndarray], buffers: int = 1) -> Tuple[torch.Tensor, np.ndarray]:
        """Device staging for ``buffers`` of the largest of ``parts`` (on the current stream), and
        each position's row address in it: its place in its chunk, in buffer ``k % buffers`` for
        chunk ``k``."""
        largest = max(map(len, parts))
        staging = torch.empty(buffers * largest * self.slot_bytes, dtype=torch.uint8, device=self.device)
        row = np.concatenate([part - part[0] + k % buffers * largest for k, part in enumerate(parts)]).astype(np.uint64)
        return staging, np.uint64(staging.data_ptr()) + row * np.uint64(self.slot_bytes)

    def _table(self, *rows: np.ndarray) -> Optional[torch.Tensor]:
        """Rows of an op's table on the device, for the kernels (None without them)."""
        return None if self.kernels is None else self.kernels.table(*rows)

    def _copy_blocks(self, groups: np.ndarray, block_ids: np.ndarray, entries: np.ndarray, part: np.ndarray,
                     table: Optional[torch.Tensor], to_entries: bool, staged: bool) -> None:
        """Copy every piece of blocks ``(groups[i], block_ids[i])`` for ``i`` in ``part`` (a
        contiguous range) to (``to_entries``) or from ``entries[i]``, where their pieces lie
        back to back: one kernel over those columns of ``table`` (the three arrays on the
        device; ``staged``: the entries are in device staging, so every core may help), or the
        Rust region copier."""
        if not len(part):
            return
        if table is None:
            kv, at, length, _ = self.pieces.rows(groups[part], block_ids[part], entries[part])
            _core._copy_regions(*((kv, at) if to_entries else (at, kv)), length)
            return
        programs = self.kernels.device_programs if staged else self.kernels.programs
        self.kernels.blocks(table, groups, int(part[0]), len(part), to_entries, programs)

    def _link_runs(self, slots: np.ndarray) -> Optional[List[Tuple[int, int, int]]]:
        """The runs of ``slots`` when the copy engine should move them (few enough that their
        copies cost the host little), else None: the kernel moves them, however scattered."""
        runs = slot_runs(slots)
        return runs if len(runs) <= self.dma_runs else None

    def _copy_runs_in(self, staging: torch.Tensor, runs: List[Tuple[int, int, int]], row: int = 0) -> None:
        """The copy engine moves each ``(position, first slot, count)`` run of slots into
        ``staging``'s rows from ``row + position`` on."""
        size = self.slot_bytes
        for position, first, count in runs:
            start = (row + position) * size
            copy_engine(staging[start:start + count * size], self.host[first * size:(first + count) * size])

    def _copy_runs_out(self, staging: torch.Tensor, runs: List[Tuple[int, int, int]], row: int) -> None:
        """The copy engine moves ``staging``'s rows from ``row + position`` on into each
        ``(position, first slot, count)`` run of slots."""
        size = self.slot_bytes
        for position, first, count in runs:
            start = (row + position) * size
            copy_engine(self.host[first * size:(first + count) * size], staging[start:start + count * size])

    # ---- saves -------------------------------------------------------------------------

    def hashes_on_device(self, groups: np.ndarray) -> bool:
        """Whether an op on blocks of ``groups`` takes or checks its digests on the device."""
        return self.digests_on_device and self.kernels is not None and bool(self._hashable[groups].all())

    def save(self, slots: np.ndarray, groups: np.ndarray, block_ids: np.ndarray, after=None, digests: bool = False,
             urgent: bool = False) -> Tuple[List[Tuple[np.ndarray, Optional["torch.cuda.Event"]]], Optional[torch.Tensor]]:
        """Copy each block into its slot, chunk by chunk, in the order given; returns
        ``(positions, event)`` per chunk: the positions of its entries and an event (CUDA)
        that completes when their bytes are in the host slots, or None when they are (CPU);
        and, with ``digests`` where ``hashes_on_device``, each value's XXH3-64 (an int64 host
        tensor, filled once the last chunk's event completed), else None. ``after``: an event
        the gathers follow (default: the work queued on the calling thread's current stream).
        Each chunk's gather joins the layout's ``pending_reads``: fence the blocks
        (``KVLayout.fence``) before the caller's stream writes them again. ``urgent``: on
        streams of its own, so that a fence waits for this save alone, not for the copies of
        the saves queued before it."""
        hashed = digests and self.hashes_on_device(groups)
        pipeline = self.pipeline
        (gathers, hashes), drains = pipeline.save_streams(urgent), pipeline.drain
        with pipeline.save_lock, on_side_stream(gathers, after):
            parts = self._chunks(len(slots), growing=False)
            ring = pipeline.ring(SAVE_STAGING_CHUNKS * self.chunk_slots, self.slot_bytes)
            chunks = [ring.take(len(part)) for part in parts]
            staged = np.concatenate([np.uint64(chunk.address) + np.arange(len(part), dtype=np.uint64)
                                     * np.uint64(self.slot_bytes) for chunk, part in zip(chunks, parts)])
            into, lengths = self._slot_addresses(slots), self.block_bytes[groups]
            table = self._table(groups, block_ids, staged, staged, into, lengths // np.uint64(self.width), lengths)
            found = torch.empty(len(slots), dtype=torch.int64, device=self.device) if hashed else None
            try:
                for part, chunk in zip(parts, chunks):
                    chunk.wait(gathers)  # its rows' last reader first
                    self._copy_blocks(groups, block_ids, staged, part, table, True, True)
                    gathered = recorded(gathers)
                    self.layout.pending_reads.add(block_ids[part], gathered)

                    runs = self._link_runs(slots[part]) if table is not None else None

                    def drain(part=part, chunk=chunk, runs=runs) -> None:
                        if table is None:
                            copy_rows(staged[part], into[part], lengths[part])
                        elif runs is not None:  # few runs of slots: the copy engine, no SM taken
                            self._copy_runs_out(ring.memory, runs, chunk.start)
                        else:
                            self.kernels.rows(table[3:], int(part[0]), len(part), int(lengths[part].max()),
                                              self.kernels.programs)

                    def digest(part=part) -> None:
                        device_xxh3.launch_xxh3_rows(self.kernels.origin, table, int(part[0]), len(part), 2, 6, found)

                    drain_chunk(chunk, gathered, drains, hashes, drain, digest if hashed else None)
                found_on_host = None
                if hashed:
                    found_on_host = digests_to_host(found, drains, hashes)
                    chunks[-1].done = recorded(drains)  # after the digests' copy too
            except BaseException:
                # The save fails with chunks already queued: they end before it is reported
                # failed, when its slots are free to take another key's value.
                for stream in (gathers, drains, hashes):
                    if stream is not None:
                        recorded(stream).synchronize()
                raise
            for tensor, stream in ((table, drains), (table, hashes), (found, hashes)):
                used_on(tensor, stream)
        return [(part, chunk.done) for part, chunk in zip(parts, chunks)], found_on_host

    # ---- loads -------------------------------------------------------------------------

    def load(self, slots: np.ndarray, groups: np.ndarray, block_ids: np.ndarray,
             check: Optional[Callable[[np.ndarray], np.ndarray]], after=None,
             expected: Optional[np.ndarray] = None) -> Tuple[np.ndarray, Optional["torch.cuda.Event"]]:
        """Copy each slot into its destination block, chunk by chunk, the entries of a chunk
        whose ``check(positions)`` is False left out (it runs on the host while the previous
        chunk copies); with ``expected`` (each value's XXH3-64) where ``hashes_on_device``, the
        entries whose staged bytes have another digest are left out instead, checked on the
        device. Returns which entries were copied (an array filled once the event completed)
        and an event (CUDA) that completes when every block is written, or None when they are
        (CPU). ``after``: an event the writes follow (default: the work queued on the calling
        thread's current stream)."""
        if expected is not None and self.hashes_on_device(groups):
            return self._load_checked_on_device(slots, groups, block_ids, expected, after)
        order = np.argsort(slots, kind="stable")  # consecutive slots form runs for the copy engine
        slots, groups, block_ids = slots[order], groups[order], block_ids[order]
        copied = np.zeros(len(slots), dtype=bool)
        at = self._slot_addresses(slots)
        with on_side_stream(self.pipeline.scatter, after):
            parts = self._chunks(len(slots), growing=True)
            staging, staged = self._staging(parts) if self.kernels is not None else (None, None)
            table = self._table(groups, block_ids, at) if staging is None else self._table(groups, block_ids, at, groups, block_ids, staged)
            for part in parts:
                good = check(order[part])
                copied[order[part[good]]] = True
                runs = self._link_runs(slots[part]) if table is not None and good.all() else None
                if runs is not None:  # one copy a run into staging, then a scatter on the device
                    self._copy_runs_in(staging, runs)
                    self._copy_blocks(groups, block_ids, staged, part, table[3:], False, True)
                elif good.all():
                    self._copy_blocks(groups, block_ids, at, part, table, False, False)
                elif good.any():  # a table of its own for the entries that passed
                    kept = part[good]
                    self._copy_blocks(groups[kept], block_ids[kept], at[kept], np.arange(len(kept)),
                                      self._table(groups[kept], block_ids[kept], at[kept]), False, False)
            return copied, recorded(self.pipeline.scatter)

    def _load_checked_on_device(self, slots, groups, block_ids, expected, after):
        """``load`` with the digests checked on the device: per chunk, the slots into one of two
        device staging buffers (the copy engine for a few runs, else a kernel) on the load
        stream, then on a stream of their own, while the next chunk copies, their XXH3 against
        ``expected`` into a flag per entry and the scatter of the flagged entries."""
        order = np.argsort(slots, kind="stable")
        slots, groups, block_ids = slots[order], groups[order], block_ids[order]
        at, lengths = self._slot_addresses(slots), self.block_bytes[groups]
        kernels = self.kernels
        with on_side_stream(self.pipeline.scatter, after):
            parts = self._chunks(len(slots), growing=True)
            staging, staged = self._staging(parts, buffers=min(2, len(parts)))
            largest = max(map(len, parts))
            table = self._table(groups, block_ids, staged, at, staged, lengths // np.uint64(self.width), lengths,
                                np.asarray(expected, dtype=np.uint64)[order])
            flags = torch.empty(len(slots), dtype=torch.int64, device=self.device)
            scattered = []
            for k, part in enumerate(parts):
                if k >= 2 and scattered[k - 2] is not None:  # this buffer's previous chunk is done with it
                    self.pipeline.scatter.wait_event(scattered[k - 2])
                runs = self._link_runs(slots[part])
                if runs is not None:
                    self._copy_runs_in(staging, runs, k % 2 * largest)
                else:
                    kernels.rows(table[3:], int(part[0]), len(part), int(lengths[part].max()), kernels.programs)
                with on_side_stream(self.pipeline.check, recorded(self.pipeline.scatter)):
                    device_xxh3.launch_xxh3_rows(kernels.origin, table, int(part[0]), len(part), 2, 6, flags,
                                                 expected=table[7])
                    kernels.blocks(table, groups, int(part[0]), len(part), False, kernels.device_programs, flags=flags)
                    scattered.append(recorded(self.pipeline.check))
            if self.pipeline.check is not None:
                self.pipeline.scatter.wait_stream(self.pipeline.check)
            checked = to_host(flags)
            done = recorded(self.pipeline.scatter)
            for tensor in (staging, table, flags):
                used_on(tensor, self.pipeline.check)
        if done is not None:
            done.synchronize()  # the load lane's thread: the flags say which entries were written
        copied = np.zeros(len(slots), dtype=bool)
        copied[order] = checked.numpy() != 0
        return copied, done


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` queued on the current stream (pinned from a GPU, so that the copy
    does not wait on the host): read it once an event recorded after it completed."""
    on_host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.device.type == "cuda")
    return on_host.copy_(tensor, non_blocking=True)


def used_on(tensor: Optional[torch.Tensor], stream) -> None:
    """Keep the caching allocator from reusing ``tensor``'s memory before ``stream``'s queued
    work is done (it was allocated on another stream)."""
    if tensor is not None and stream is not None:
        tensor.record_stream(stream)


def chunk_sizes(count: int, largest: int, growing: bool) -> List[int]:
    """``count`` items cut into chunks of at most ``largest``: the first ones small and doubling
    (``growing``: a load's host check of its first chunk waits for nobody), or the last ones
    (else: a save's last digests trail its last copy by little)."""
    sizes, size = [], max(1, largest // 4)
    while count > sum(sizes):
        sizes.append(min(size, count - sum(sizes)))
        size = min(2 * size, largest)
    return sizes if growing else sizes[::-1]
