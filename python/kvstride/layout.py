"""KV tensors -> the fixed list of byte pieces that make one block of each group.

vLLM hands a connector one tensor (or, for Mamba layers, a list of state tensors) per layer,
and the KV-cache config tells which layers form each group.  Whatever the backend's shape
-- FlashAttention ``(2, num_blocks, block, heads, dim)``, blocks-first
``(num_blocks, 2, block, heads, dim)`` / CPU ``(num_blocks, heads, block, 2*dim)``, MLA
``(num_blocks, block, dim)``, Mamba conv / SSM state ``(num_blocks, ...)`` or the raw int8
page views ``(num_blocks, 1, 1, state_bytes)`` -- block ``b`` of one tensor is a fixed set of
byte ranges ``offset_j + b * stride_j`` of ``size_j`` bytes inside the tensor's storage.
This module finds those ranges from shapes and strides only (never from backend names), so
it also covers vLLM's hybrid allocator, where one allocation is viewed by a layer of every
group (attention re-strided block-major, Mamba states as strided views of the same pages).

A group's block is the concatenation of the pieces of its layers, in layer order; adjacent
pieces that stay adjacent for every block (layer-contiguous or cross-layer layouts) are
merged, so one block costs as few copies as the memory layout allows.

Layouts that are not a fixed set of byte ranges per block (negative or zero strides,
overlapping elements, a block dimension that cannot be found, too many pieces) are refused
at registration with a ``ValueError`` naming the tensor, its shape and strides.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from . import _core

__all__ = ["Piece", "GroupLayout", "KVLayout", "PendingReads", "ComingReads", "MAX_PIECES_PER_TENSOR"]

#: More pieces than this for one tensor's block means a layout we would copy inefficiently
#: (e.g. token-major with the block dimension innermost); refuse it.
MAX_PIECES_PER_TENSOR = 64

TensorLike = Union[torch.Tensor, Sequence[torch.Tensor]]


@dataclass(frozen=True)
class Piece:
    """``size`` bytes at ``storage base + offset + block_id * stride`` belong to block ``block_id``."""

    storage: int  # index into KVLayout.storages
    offset: int  # bytes from the storage's first byte to this piece of block 0
    size: int  # bytes per block
    stride: int  # bytes between the pieces of consecutive blocks
    layer: str  # first layer the piece came from (merged pieces keep the first name)


@dataclass(frozen=True)
class GroupLayout:
    group: int
    num_blocks: int
    pieces: tuple  # tuple[Piece, ...], in value order
    block_bytes: int  # sum of piece sizes: the payload of one stored value
    layers: tuple  # layer names, in registration order

    @property
    def piece_sizes(self) -> tuple:
        return tuple(p.size for p in self.pieces)


def _describe(name: str, t: torch.Tensor) -> str:
    return (
        f"tensor {name!r}: shape {tuple(t.shape)}, strides {tuple(t.stride())} (elements), "
        f"dtype {t.dtype}, storage offset {t.storage_offset()}"
    )


def _block_dim(name: str, t: torch.Tensor, num_blocks: Optional[int]) -> int:
    shape = tuple(t.shape)
    if t.dim() == 0:
        raise ValueError(f"unsupported KV layout, {_describe(name, t)}: a scalar has no block dimension")
    fa_like = t.dim() >= 3 and shape[0] == 2
    if num_blocks is None:
        return 1 if (fa_like and t.dim() == 5) else 0
    d0 = shape[0] == num_blocks
    d1 = t.dim() >= 2 and shape[1] == num_blocks and shape[0] == 2
    if d0 and d1:  # num_blocks == 2: follow vLLM's FlashAttention convention for 5-D tensors
        return 1 if t.dim() == 5 else 0
    if d0:
        return 0
    if d1:
        return 1
    raise ValueError(
        f"unsupported KV layout, {_describe(name, t)}: no block dimension of size {num_blocks} "
        f"(expected (num_blocks, ...) or (2, num_blocks, ...))"
    )


def _tensor_geometry(t: torch.Tensor, bdim: int) -> str:
    """A tensor's per-block geometry, independent of how many blocks it holds: dtype, block
    dimension, the other dimensions' sizes, and those dimensions from outermost to innermost
    in memory (size-1 dimensions have no order: they move no byte)."""
    others = [i for i in range(t.dim()) if i != bdim]
    order = sorted((i for i in others if t.shape[i] > 1), key=lambda i: (-t.stride(i), -i))
    return f"{t.dtype}|block dim {bdim}|shape {[int(t.shape[i]) for i in others]}|memory order {order}"


def _tensor_pieces(name: str, t: torch.Tensor, bdim: int):
    """(byte offset from tensor start, size, block stride) per piece, or ValueError."""
    es = t.element_size()
    shape, strides = tuple(t.shape), tuple(t.stride())
    if any(s < 0 for s in strides):
        raise ValueError(f"unsupported KV layout, {_describe(name, t)}: negative stride")
    # Non-overlap: sorted by stride, each dimension must step past everything below it.
    dims = sorted(((strides[i] * es, shape[i]) for i in range(t.dim()) if shape[i] > 1))
    extent = es
    for st, sz in dims:
        if st < extent:
            raise ValueError(
                f"unsupported KV layout, {_describe(name, t)}: elements overlap "
                "(zero, broadcast or interleaved strides); blocks must be disjoint byte ranges"
            )
        extent = st * (sz - 1) + extent
    block_stride = strides[bdim] * es
    if shape[bdim] > 1 and block_stride == 0:
        raise ValueError(f"unsupported KV layout, {_describe(name, t)}: block stride 0")
    inner = sorted((strides[i] * es, shape[i]) for i in range(t.dim()) if i != bdim and shape[i] > 1)
    run = es
    k = 0
    while k < len(inner) and inner[k][0] == run:
        run *= inner[k][1]
        k += 1
    outer = inner[k:]
    count = 1
    for _, sz in outer:
        count *= sz
    if count > MAX_PIECES_PER_TENSOR:
        raise ValueError(
            f"unsupported KV layout, {_describe(name, t)}: one block is {count} separate byte "
            f"ranges of {run} B (more than {MAX_PIECES_PER_TENSOR}); blocks must be a few "
            "contiguous ranges (block dimension outermost or next to a K/V dimension)"
        )
    offs = sorted(
        sum(i * st for i, (st, _) in zip(idx, outer))
        for idx in itertools.product(*(range(sz) for _, sz in outer))
    )
    if shape[bdim] > 1 and block_stride < run:
        raise ValueError(f"unsupported KV layout, {_describe(name, t)}: blocks overlap")
    return [(o, run, block_stride) for o in offs]


class PendingReads:
    """Reads of KV blocks queued on side streams (saves' gathers) that the caller's stream was not
    made to wait for, each with the event it completes at, and reads another thread is about to
    launch (``expect``): ``fence(block_ids, stream)`` orders the stream after those that read
    any of ``block_ids``, before it writes them again. A read is dropped once its event
    completed or a stream waited for it. Empty on CPU, where every read is done when its call
    returns."""

    def __init__(self) -> None:
        # Saves add on the step's thread and on the engine's launch lane; fences wait on it.
        self._changed = threading.Condition()
        self._reads: List[Tuple[np.ndarray, object]] = []
        self._coming: List["ComingReads"] = []

    def __len__(self) -> int:
        with self._changed:  # both lists at one moment: a launch moves a read from one to the other
            return len(self._reads) + len(self._coming)

    def add(self, block_ids, event) -> None:
        """A read of ``block_ids`` that completes with ``event`` (None: already done); the reads
        already done are dropped, so that a caller that never fences keeps no more than runs."""
        if event is not None and len(block_ids):
            with self._changed:
                self._reads = [read for read in self._reads if not read[1].query()]
                self._reads.append((np.asarray(block_ids, dtype=np.int64), event))

    def expect(self, block_ids) -> "ComingReads":
        """Reads of ``block_ids`` that another thread will launch (and ``add``) once
        ``ComingReads.start`` allowed it, then end with ``ComingReads.done``."""
        coming = ComingReads(self, np.asarray(block_ids, dtype=np.int64))
        with self._changed:
            self._coming.append(coming)
        return coming

    def fence(self, block_ids, stream) -> int:
        """Make ``stream`` wait (on the device, never the host) for every pending read of one of
        ``block_ids`` (None: of any block); returns how many it waits for. Expected reads of
        those blocks not started yet are cancelled (they will never read them); those being
        launched are waited for on the host, the time their launches take."""
        wanted = None if block_ids is None else np.asarray(block_ids, dtype=np.int64)

        def touches(blocks: np.ndarray) -> bool:
            return wanted is None or bool(np.isin(blocks, wanted).any())

        waited = 0
        with self._changed:
            for coming in [c for c in self._coming if touches(c.block_ids)]:
                if coming.state == "expected":
                    coming.state = "cancelled"
                    self._coming.remove(coming)
                else:
                    self._changed.wait_for(lambda: coming not in self._coming)
            pending = []
            for blocks, event in self._reads:
                if event.query():
                    continue
                if touches(blocks):
                    stream.wait_event(event)
                    waited += 1
                else:
                    pending.append((blocks, event))
            self._reads = pending
        return waited


class ComingReads:
    """Reads that one thread expects another to launch (``PendingReads.expect``)."""

    def __init__(self, reads: PendingReads, block_ids: np.ndarray) -> None:
        self._reads = reads
        self.block_ids = block_ids
        self.state = "expected"  # then "launching" or "cancelled" (by a fence)

    def start(self) -> bool:
        """Whether the reads may be launched now (False: a fence cancelled them, since the
        blocks are being written again)."""
        with self._reads._changed:
            if self.state == "cancelled":
                return False
            self.state = "launching"
            return True

    def done(self) -> None:
        """The reads are launched (and added) or will not be: fences stop waiting for them."""
        with self._reads._changed:
            if self in self._reads._coming:
                self._reads._coming.remove(self)
            self._reads._changed.notify_all()


class KVLayout:
    """Byte pieces of every group's blocks.

    ``kv_caches``: layer name -> tensor, or a list/tuple of tensors (Mamba conv + SSM state),
    as vLLM's ``register_kv_caches`` gives them.  ``groups``: for each KV-cache group, its layer
    names (``kv_cache_config.kv_cache_groups[g].layer_names``).  ``num_blocks``: one int for all
    groups, one per group, or None to infer (dimension 1 for 5-D ``(2, N, ...)`` tensors,
    dimension 0 otherwise).
    """

    def __init__(
        self,
        kv_caches: Mapping[str, TensorLike],
        groups: Sequence[Sequence[str]],
        num_blocks: Union[None, int, Sequence[Optional[int]]] = None,
    ) -> None:
        if isinstance(num_blocks, int) or num_blocks is None:
            nbs = [num_blocks] * len(groups)
        else:
            nbs = list(num_blocks)
            if len(nbs) != len(groups):
                raise ValueError(f"num_blocks has {len(nbs)} entries for {len(groups)} groups")
        self._storages: list = []  # (device, storage data_ptr) -> index
        self._storage_index: dict = {}
        self._storage_tensors: list = []  # byte tensors over each whole storage (keep alive)
        self.device: Optional[torch.device] = None
        out = []
        for g, names in enumerate(groups):
            if not names:
                raise ValueError(f"KV-cache group {g} has no layers")
            pieces = []
            nb_group = nbs[g]
            for name in names:
                if name not in kv_caches:
                    raise ValueError(f"group {g} names layer {name!r}, which is not among the KV caches")
                value = kv_caches[name]
                tensors = [value] if isinstance(value, torch.Tensor) else list(value)
                for j, t in enumerate(tensors):
                    tname = name if len(tensors) == 1 else f"{name}[{j}]"
                    if not isinstance(t, torch.Tensor):
                        raise ValueError(f"KV cache {tname!r} is a {type(t).__name__}, not a torch.Tensor")
                    if self.device is None:
                        self.device = t.device
                    elif t.device != self.device:
                        raise ValueError(
                            f"unsupported KV layout, {_describe(tname, t)}: on {t.device}, "
                            f"other KV caches are on {self.device}"
                        )
                    bdim = _block_dim(tname, t, nb_group)
                    nb = t.shape[bdim]
                    if nb_group is None:
                        nb_group = nb
                    elif nb != nb_group:
                        raise ValueError(
                            f"unsupported KV layout, {_describe(tname, t)}: {nb} blocks, "
                            f"other layers of group {g} have {nb_group}"
                        )
                    sidx, base = self._storage_of(t)
                    start = t.data_ptr() - base
                    for off, size, stride in _tensor_pieces(tname, t, bdim):
                        pieces.append(Piece(sidx, start + off, size, stride, tname))
            # Storage bounds.
            for p in pieces:
                last = p.offset + (nb_group - 1) * p.stride + p.size
                if p.offset < 0 or last > self._storage_tensors[p.storage].numel():
                    raise ValueError(f"layer {p.layer!r}: block pieces fall outside the tensor's storage")
            seen = set()
            for p in pieces:
                if (p.storage, p.offset) in seen:
                    raise ValueError(f"group {g}: layer {p.layer!r} aliases another layer of the same group")
                seen.add((p.storage, p.offset))
            merged: list = []
            for p in pieces:
                q = merged[-1] if merged else None
                if q is not None and q.storage == p.storage and q.stride == p.stride and q.offset + q.size == p.offset and (
                    nb_group <= 1 or q.size + p.size <= p.stride
                ):
                    merged[-1] = Piece(q.storage, q.offset, q.size + p.size, q.stride, q.layer)
                else:
                    merged.append(p)
            out.append(
                GroupLayout(
                    group=g,
                    num_blocks=int(nb_group),
                    pieces=tuple(merged),
                    block_bytes=sum(p.size for p in merged),
                    layers=tuple(names),
                )
            )
        self.groups: tuple = tuple(out)
        self._fp = self._fingerprint(kv_caches, groups)
        self.pending_reads = PendingReads()  # the device data paths' reads of these blocks

    def _storage_of(self, t: torch.Tensor):
        st = t.untyped_storage()
        key = (str(t.device), st.data_ptr())
        if key not in self._storage_index:
            self._storage_index[key] = len(self._storage_tensors)
            whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))
            self._storage_tensors.append(whole)
        return self._storage_index[key], st.data_ptr()

    # ---- accessors -------------------------------------------------------------------

    @property
    def storages(self) -> list:
        """Flat uint8 tensors, one per distinct storage the pieces refer to."""
        return list(self._storage_tensors)

    def block_bytes(self, group: int) -> int:
        return self.groups[group].block_bytes

    def piece_addresses(self, group: int):
        """Per piece of ``group``, as uint64 arrays: its address in block 0, its block stride
        and its size (what the raw region copies of ``kvstride.arena`` / ``transfer`` need)."""
        pieces = self.groups[group].pieces
        base = [self.storages[p.storage].data_ptr() + p.offset for p in pieces]
        return tuple(np.array(x, dtype=np.uint64) for x in (base, [p.stride for p in pieces], [p.size for p in pieces]))

    def fingerprint(self) -> bytes:
        """8 bytes identifying the per-block geometry (not addresses): what a stored value's
        header carries, so that values written under another layout are never read."""
        return self._fp

    def _fingerprint(self, kv_caches, groups) -> bytes:
        """The core's ``layout_fingerprint`` (the one notion every store key and header uses)
        of the per-block geometry: groups, block bytes, piece sizes, and per tensor its dtype,
        block dimension, shape without the block count and the memory order of its other
        dimensions (what tells an HND cache from an NHD one of the same shape and bytes)."""
        description = {
            "kvstride-layout": 2,
            "groups": [
                {
                    "group": g.group,
                    "block_bytes": g.block_bytes,
                    "pieces": [p.size for p in g.pieces],
                    "tensors": [
                        _tensor_geometry(t, _block_dim(name, t, g.num_blocks))
                        for name in g.layers
                        for t in ([kv_caches[name]] if isinstance(kv_caches[name], torch.Tensor) else kv_caches[name])
                    ],
                }
                for g in self.groups
            ],
        }
        return bytes.fromhex(_core.layout_fingerprint(description))

    @property
    def on_cuda(self) -> bool:
        """The KV tensors live on a CUDA device: copies to host go through streams and pinned memory."""
        return self.device is not None and self.device.type == "cuda"

    def current_stream_event(self):
        """(CUDA) An event recorded on the calling thread's current stream, None on CPU: copies
        another thread runs later wait for it to follow the work queued here."""
        if not self.on_cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def fence(self, block_ids) -> int:
        """Order the calling thread's current stream after every save still reading one of
        ``block_ids`` (``pending_reads``; None: any block), so that the work queued next may
        write them: no host sync, nothing to do on CPU. Returns how many reads it waits for."""
        if not len(self.pending_reads):
            return 0
        return self.pending_reads.fence(block_ids, torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        """Wait on the host until every copy queued on the KV cache's device has run (a fence's
        last resort); nothing on CPU."""
        if self.on_cuda:
            torch.cuda.synchronize(self.device)

    def describe(self) -> str:
        lines = []
        for g in self.groups:
            lines.append(f"group {g.group}: {g.num_blocks} blocks x {g.block_bytes} B in {len(g.pieces)} piece(s)")
            for p in g.pieces:
                lines.append(f"  {p.layer}: storage {p.storage} +{p.offset} size {p.size} stride {p.stride}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"KVLayout({', '.join(f'g{g.group}:{g.block_bytes}Bx{len(g.pieces)}' for g in self.groups)})"
