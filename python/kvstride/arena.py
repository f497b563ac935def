"""The embedded store across vLLM's processes: the scheduler owns the index, the workers own the
bytes.

vLLM runs the scheduler (EngineCore) and the model runners (Workers, one per TP rank) in
separate processes. The bytes of offloaded blocks stay with the workers, each rank its own
shard, in one preallocated :class:`HostArena` of fixed-size slots. The scheduler keeps a
:class:`SlotIndex` of which key lives in which slot and decides every allocation and eviction
itself, so it answers lookups without asking a worker, and a hit it reports is always servable:

- a key becomes visible to lookups only after every rank reported its slot written;
- the slots of a load are pinned from the step that plans it until its completion comes back,
  and eviction never takes a pinned or a still-being-written slot;
- all of it happens on the scheduler's own thread (lookup, allocation and eviction are never
  interleaved with each other), and workers never evict on their own.

Both sides derive the slot count from the same configuration (``slots_for``), so slot ids mean
the same in every process. Each slot keeps the XXH3 digest of the value written into it; a
load checks it before scattering, and a mismatch fails the load (vLLM recomputes).

One copy each way: a save copies block pieces from the KV cache straight into the slot, a
load from the slot straight into the destination blocks (raw region copies in the Rust core,
GIL released, spread over cores for large batches; a torch path for device tensors).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from kvstride import _core
from kvstride.layout import KVLayout

__all__ = ["SlotIndex", "HostArena", "slots_for", "ALIGN"]

#: Slot size granularity (bytes): every slot starts on a cache line.
ALIGN = 64


def slots_for(capacity_bytes: int, slot_bytes: int) -> int:
    """How many slots of ``slot_bytes`` fit ``capacity_bytes`` (the scheduler and every worker
    compute it from the same configuration)."""
    slot = -(-int(slot_bytes) // ALIGN) * ALIGN
    if slot <= 0:
        raise ValueError(f"slot size must be positive, got {slot_bytes}")
    count = int(capacity_bytes) // slot
    if count < 1:
        raise ValueError(
            f"store_bytes={capacity_bytes} holds no block of {slot} bytes; give at least {slot} "
            "(kv_connector_extra_config['store_bytes'])"
        )
    return count


class SlotIndex:
    """The scheduler's view of the arena: key -> slot, least recently used first.

    ``ready`` keys are readable on every rank; ``writing`` keys have a slot whose save has not
    been confirmed by every rank; ``pins`` count the loads in flight per slot."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = int(num_slots)
        self._free: List[int] = list(range(self.num_slots - 1, -1, -1))
        self._ready: "collections.OrderedDict[str, int]" = collections.OrderedDict()
        self._writing: Dict[str, int] = {}
        self._pins: collections.Counter = collections.Counter()
        self._key_of: Dict[int, str] = {}  # slot -> the key it holds or is being written for
        self._doomed: set = set()  # dropped slots still pinned: freed when the last load ends
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._ready)

    # The KVStore surface OffloadEngine.lookup uses: present = readable on every rank.
    def exists(self, keys: Sequence[str]) -> List[bool]:
        return [k in self._ready for k in keys]

    def known(self, keys: Sequence[str]) -> List[bool]:
        """Readable, or being written (a save need not write it again)."""
        return [k in self._ready or k in self._writing for k in keys]

    def pin(self, keys: Sequence[str]) -> Optional[List[int]]:
        """The slots of ``keys`` (all ready), pinned until ``unpin``; None if one is not ready."""
        slots = [self._ready.get(k) for k in keys]
        if any(s is None for s in slots):
            return None
        for k, s in zip(keys, slots):
            self._ready.move_to_end(k)
            self._pins[s] += 1
        return slots

    def unpin(self, slots: Sequence[int]) -> None:
        for s in slots:
            left = self._pins[s] - 1
            if left > 0:
                self._pins[s] = left
            else:
                del self._pins[s]
                if s in self._doomed:
                    self._doomed.discard(s)
                    self._free.append(s)

    def drop_slots(self, slots: Sequence[int]) -> None:
        """Forget the ready keys held in ``slots`` (a rank found their value corrupted); a
        slot still pinned by a load is freed when that load ends."""
        for s in set(slots):
            key = self._key_of.get(s)
            if key is None or self._ready.get(key) != s:
                continue
            del self._ready[key]
            del self._key_of[s]
            if s in self._pins:
                self._doomed.add(s)
            else:
                self._free.append(s)

    def reserve(self, keys: Sequence[str]) -> List[Optional[int]]:
        """A slot for each key (None when every slot is pinned or being written), evicting the
        least recently used ready keys as needed. The keys become ``writing``."""
        out: List[Optional[int]] = []
        for key in keys:
            slot = self._free.pop() if self._free else self._evict_one()
            if slot is not None:
                self._writing[key] = slot
                self._key_of[slot] = key
            out.append(slot)
        return out

    def _evict_one(self) -> Optional[int]:
        for key, slot in self._ready.items():
            if slot not in self._pins:
                del self._ready[key]
                del self._key_of[slot]
                self.evictions += 1
                return slot
        return None

    def confirm(self, keys: Sequence[str]) -> None:
        """Every rank wrote these keys: they become readable (most recently used)."""
        for key in keys:
            slot = self._writing.pop(key, None)
            if slot is not None:
                self._ready[key] = slot

    def abandon(self, keys: Sequence[str]) -> None:
        """A rank failed to write these keys: their slots are free again."""
        for key in keys:
            slot = self._writing.pop(key, None)
            if slot is not None:
                del self._key_of[slot]
                self._free.append(slot)

    def clear(self) -> bool:
        """Forget every ready key (``reset_prefix_cache(reset_connector=True)``); refused
        (False) while a load or a save is in flight."""
        if self._pins or self._writing:
            return False
        self._free.extend(self._ready.values())
        self._ready.clear()
        self._key_of.clear()
        return True


@dataclass
class _GroupCopy:
    """Per group: for each piece, the address of block 0, the block stride, the size, and
    the piece's offset inside a slot."""

    base: np.ndarray
    stride: np.ndarray
    size: np.ndarray
    slot_offset: np.ndarray
    block_bytes: int


class HostArena:
    """``num_slots`` fixed-size slots in one preallocated host buffer (pinned when the KV cache
    is on CUDA), touched once at construction so the hot path takes no page faults.

    ``save`` / ``load`` take parallel arrays (slot, group, block id), one entry per block."""

    def __init__(self, layout: KVLayout, num_slots: int, *, copier: Optional[str] = None) -> None:
        self.layout = layout
        self.slot_bytes = -(-max(g.block_bytes for g in layout.groups) // ALIGN) * ALIGN
        self.num_slots = int(num_slots)
        device = layout.device or torch.device("cpu")
        self.copier = copier or ("regions" if device.type == "cpu" else "torch")
        if self.copier not in ("regions", "torch"):
            raise ValueError(f"copier must be 'regions' or 'torch', got {copier!r}")
        pin = device.type == "cuda"
        self.buffer = torch.empty(self.num_slots * self.slot_bytes, dtype=torch.uint8, pin_memory=pin)
        self.buffer.zero_()
        self.ptr = self.buffer.data_ptr()
        self.digests = np.zeros(self.num_slots, dtype=np.uint64)
        self.slot_group = np.full(self.num_slots, -1, dtype=np.int64)  # -1: never written
        self._groups = [self._group_copy(g) for g in layout.groups]
        self.block_bytes = np.array([g.block_bytes for g in layout.groups], dtype=np.uint64)  # per group
        self._views: Dict[tuple, tuple] = {}

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def _group_copy(self, group) -> _GroupCopy:
        storages = self.layout.storages
        base = np.array([storages[p.storage].data_ptr() + p.offset for p in group.pieces], dtype=np.uint64)
        size = np.array([p.size for p in group.pieces], dtype=np.uint64)
        offsets = np.concatenate([[0], np.cumsum(size)[:-1]]).astype(np.uint64)
        stride = np.array([p.stride for p in group.pieces], dtype=np.uint64)
        return _GroupCopy(base, stride, size, offsets, group.block_bytes)

    def _check(self, slots: np.ndarray, groups: np.ndarray, block_ids: np.ndarray) -> None:
        if not (len(slots) == len(groups) == len(block_ids)):
            raise ValueError("slots, groups and block ids must have the same length")
        if len(slots) and (slots.min() < 0 or slots.max() >= self.num_slots):
            raise ValueError(f"slot out of range 0..{self.num_slots - 1}")
        for g in np.unique(groups):
            if not 0 <= g < len(self._groups):
                raise ValueError(f"group {g} out of range (layout has {len(self._groups)} groups)")
            ids = block_ids[groups == g]
            if ids.min() < 0 or ids.max() >= self.layout.groups[g].num_blocks:
                raise ValueError(f"block id out of range for group {g}")

    def _rows(self, slots, groups, block_ids):
        """The entries as rows for the Rust copy: (KV addresses, slot addresses, lengths) of
        every piece, where each row's pieces start (``row_start``), each row's value region in
        its slot, and ``order``: the entry index of each row (rows go group by group)."""
        kv, arena, length, counts, order = [], [], [], [], []
        for g in np.unique(groups):
            (index,) = np.nonzero(groups == g)
            copy = self._groups[g]
            ids = block_ids[index].astype(np.uint64)
            rows = self.ptr + slots[index].astype(np.uint64) * np.uint64(self.slot_bytes)
            kv.append((copy.base[None, :] + ids[:, None] * copy.stride[None, :]).ravel())
            arena.append((rows[:, None] + copy.slot_offset[None, :]).ravel())
            length.append(np.broadcast_to(copy.size, (len(ids), len(copy.size))).ravel())
            counts.append(np.full(len(ids), len(copy.size), dtype=np.uint64))
            order.append(index)
        order = np.concatenate(order) if order else np.zeros(0, dtype=np.int64)
        row_start = np.concatenate([[0], np.cumsum(np.concatenate(counts))]) if counts else np.zeros(1)
        value_addr = self.ptr + slots[order].astype(np.uint64) * np.uint64(self.slot_bytes)
        value_len = self.block_bytes[groups[order]]
        flat = (np.concatenate(x) if x else np.zeros(0, dtype=np.uint64) for x in (kv, arena, length))
        kv, arena, length = (np.ascontiguousarray(x, dtype=np.uint64) for x in flat)
        return kv, arena, length, row_start.astype(np.uint64), value_addr, value_len, order

    def _digest(self, slots: np.ndarray, groups: np.ndarray) -> np.ndarray:
        addrs = np.ascontiguousarray(self.ptr + slots.astype(np.uint64) * np.uint64(self.slot_bytes))
        lengths = np.ascontiguousarray(self.block_bytes[groups])
        return _core._xxh3_64_regions(addrs, lengths)

    # ---- the torch path (device tensors) ------------------------------------------------

    def _piece_views(self, group: int, piece: int):
        """(KV view (num_blocks, size), slot view (num_slots, size)) of one piece, as uint8."""
        key = (group, piece)
        if key not in self._views:
            p = self.layout.groups[group].pieces[piece]
            storage = self.layout.storages[p.storage]
            kv = storage.as_strided((self.layout.groups[group].num_blocks, p.size), (p.stride, 1), p.offset)
            off = int(self._groups[group].slot_offset[piece])
            slot = self.buffer.as_strided((self.num_slots, p.size), (self.slot_bytes, 1), off)
            self._views[key] = (kv, slot)
        return self._views[key]

    def _torch_copy(self, slots, groups, block_ids, to_arena: bool) -> None:
        for g in np.unique(groups):
            sel = groups == g
            ids = torch.from_numpy(block_ids[sel].astype(np.int64))
            rows = torch.from_numpy(slots[sel].astype(np.int64))
            for j in range(len(self.layout.groups[g].pieces)):
                kv, slot = self._piece_views(int(g), j)
                if to_arena:
                    slot.index_copy_(0, rows, kv.index_select(0, ids.to(kv.device)).cpu())
                else:
                    kv.index_copy_(0, ids.to(kv.device), slot.index_select(0, rows).to(kv.device))
        if self.layout.device is not None and self.layout.device.type == "cuda":
            torch.cuda.current_stream(self.layout.device).synchronize()

    # ---- saves and loads ----------------------------------------------------------------

    def save(self, slots, groups, block_ids) -> None:
        """Copy each block into its slot and keep the value's digest."""
        slots, groups, block_ids = (np.asarray(a, dtype=np.int64) for a in (slots, groups, block_ids))
        self._check(slots, groups, block_ids)
        if self.copier == "regions":
            kv, slot, length, row_start, value_addr, value_len, order = self._rows(slots, groups, block_ids)
            digests = np.empty(len(slots), dtype=np.uint64)
            digests[order] = _core._save_rows(kv, slot, length, row_start, value_addr, value_len)
        else:
            self._torch_copy(slots, groups, block_ids, to_arena=True)
            digests = self._digest(slots, groups)
        self.digests[slots] = digests
        self.slot_group[slots] = groups

    def load(self, slots, groups, block_ids) -> np.ndarray:
        """Copy each slot into its destination block when the slot holds a value of that group
        whose digest still matches; returns which entries were loaded."""
        slots, groups, block_ids = (np.asarray(a, dtype=np.int64) for a in (slots, groups, block_ids))
        self._check(slots, groups, block_ids)
        # Only a slot holding a value of the block's group can be loaded into it.
        (candidates,) = np.nonzero(self.slot_group[slots] == groups)
        ok = np.zeros(len(slots), dtype=bool)
        if not len(candidates):
            return ok
        s, g, b = slots[candidates], groups[candidates], block_ids[candidates]
        if self.copier == "regions":
            kv, slot, length, row_start, value_addr, value_len, order = self._rows(s, g, b)
            ok[candidates[order]] = _core._load_rows(
                slot, kv, length, row_start, value_addr, value_len, self.digests[s[order]]
            )
            return ok
        good = self._digest(s, g) == self.digests[s]
        if good.any():
            self._torch_copy(s[good], g[good], b[good], to_arena=False)
        ok[candidates] = good
        return ok
