"""The embedded store's index, on vLLM's scheduler: which key lives in which arena slot,
every allocation and eviction, pins of loads in flight, and keys visible only once every rank
wrote them (:mod:`kvstride.arena` says how the two sides fit). No bytes live here."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

from kvstride.capacity import PrefixOrder
from kvstride.stores.placement import EVERY_RANK

__all__ = ["SlotIndex", "ArenaPlacement", "slots_for", "ALIGN"]

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
    """The scheduler's view of the arena: key -> slot, and the order keys are evicted in.

    ``ready`` keys are readable on every rank; ``writing`` keys have a slot whose save has not
    been confirmed by every rank; ``pins`` count the loads in flight per slot.

    Eviction takes the ready key first in :class:`kvstride.capacity.PrefixOrder` (the order
    the replay's ``kvstride`` policy runs too): keys read by loads outlive those only written,
    and long prompts' keys (more prefill saved per slot) those of short ones (GreedyDual-Size
    with frequency); at one level the least recently used prefix first, and within it the
    deepest block first. A caller that gives each key the stamp and worth of the request
    that wrote or read it and the tokens its block ends at (``ranks``) keeps every request's
    resident keys a prefix of it, so what stays can still serve a hit at some shorter boundary
    (SEMANTICS §8: a block past the last boundary every group can serve is worth nothing).
    Without ``ranks`` each call is one stamp and keys keep their call order: least recently
    used first."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = int(num_slots)
        self._free: List[int] = list(range(self.num_slots - 1, -1, -1))
        self._ready: Dict[str, int] = {}
        self._writing: Dict[str, int] = {}
        self._pending_ranks: Dict[str, Tuple[int, int, float]] = {}  # writing key -> (stamp, depth, worth)
        self._pins: Dict[int, int] = {}  # slot -> loads in flight reading it
        self._key_of: Dict[int, str] = {}  # slot -> the key it holds or is being written for
        self._doomed: set = set()  # dropped slots still pinned: freed when the last load ends
        self.order = PrefixOrder()  # the ready keys' eviction order
        self.evictions = 0
        self.version = 0  # moves whenever the ready keys change: a lookup's answer stands until then

    def __len__(self) -> int:
        return len(self._ready)

    def stamp(self) -> int:
        """A stamp newer than every one given so far."""
        return self.order.stamp()

    def worth(self, value: float) -> float:
        """A request's worth in the order (:meth:`kvstride.capacity.PrefixOrder.worth`)."""
        return self.order.worth(value)

    # The KVStore surface OffloadEngine.lookup uses: present = readable on every rank.
    def exists(self, keys: Sequence[str]) -> List[bool]:
        return [k in self._ready for k in keys]

    def slot(self, key: str) -> Optional[int]:
        """The slot of a ready key, or None."""
        return self._ready.get(key)

    def keys(self) -> List[str]:
        """The ready keys, first to be evicted first."""
        return self.order.ordered(self._ready)

    def ready_slots(self) -> List[int]:
        return list(self._ready.values())

    def touch(self, keys: Sequence[str], stamp: Optional[int] = None, worth: float = 1.0) -> None:
        """Mark ready keys used now (``stamp``, else a new one) by a request of ``worth``,
        each keeping its depth."""
        self.order.touch(keys, self.stamp() if stamp is None else stamp, worth)

    def known(self, keys: Sequence[str]) -> List[bool]:
        """Readable, or being written (a save need not write it again)."""
        return [k in self._ready or k in self._writing for k in keys]

    def pin(self, keys: Sequence[str], stamp: Optional[int] = None, worth: float = 1.0) -> Optional[List[int]]:
        """The slots of ``keys`` (all ready), pinned until ``unpin``; None if one is not ready."""
        ready = self._ready
        if not all(k in ready for k in keys):
            return None
        return self.pin_ready(keys, stamp, worth)

    def pin_ready(self, keys: Sequence[str], stamp: Optional[int] = None, worth: float = 1.0) -> List[Optional[int]]:
        """The slot of each key, pinned until ``unpin`` and used now (:meth:`touch`); None (and
        nothing pinned) for a key that is not ready."""
        ready, pins, out = self._ready, self._pins, []
        for key in keys:
            slot = ready.get(key)
            if slot is not None:
                pins[slot] = pins.get(slot, 0) + 1
            out.append(slot)
        self.touch(keys, stamp, worth)
        return out

    def unpin(self, slots: Sequence[int]) -> None:
        pins = self._pins
        for s in slots:
            left = pins[s] - 1
            if left > 0:
                pins[s] = left
            else:
                del pins[s]
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
            self.version += 1
            self.order.forget(key)
            del self._key_of[s]
            if s in self._pins:
                self._doomed.add(s)
            else:
                self._free.append(s)

    def reserve(self, keys: Sequence[str], ranks: Optional[Dict[str, Tuple[int, int, float]]] = None) -> List[Optional[int]]:
        """A slot for each key (None when every slot is pinned or being written), evicting
        ready keys in eviction order as needed. The keys become ``writing``; ``ranks`` gives a
        key's ``(stamp, depth, worth)`` once it is confirmed."""
        out: List[Optional[int]] = []
        for key in keys:
            slot = self._free.pop() if self._free else self._evict_one()
            if slot is not None:
                self._writing[key] = slot
                self._key_of[slot] = key
                if ranks is not None and key in ranks:
                    self._pending_ranks[key] = ranks[key]
            out.append(slot)
        return out

    def _evict_one(self) -> Optional[int]:
        ready, pins = self._ready, self._pins
        key = self.order.pop(skip=lambda k: ready[k] in pins)
        if key is None:
            return None
        slot = ready.pop(key)
        del self._key_of[slot]
        self.evictions += 1
        self.version += 1
        return slot

    def confirm(self, keys: Sequence[str]) -> None:
        """Every rank wrote these keys: they become readable, ranked as ``reserve`` was told
        (else used now, in call order)."""
        stamp = None
        for key in keys:
            slot = self._writing.pop(key, None)
            if slot is None:
                continue
            self._ready[key] = slot
            self.version += 1
            rank = self._pending_ranks.pop(key, None)
            if rank is None:
                stamp = self.stamp() if stamp is None else stamp
                rank = (stamp, 0)
            self.order.rank(key, *rank)

    def abandon(self, keys: Sequence[str]) -> None:
        """A rank failed to write these keys: their slots are free again."""
        for key in keys:
            self._pending_ranks.pop(key, None)
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
        self.version += 1
        self._ready.clear()
        self.order.clear()
        self._key_of.clear()
        return True


class ArenaPlacement:
    """The embedded store's placement (:mod:`kvstride.stores.placement`): the scheduler's
    :class:`SlotIndex` gives each new key a slot and pins the slots of each load, and every
    rank copies the same slots (the arena keys as one rank: its keys never leave this index)."""

    def __init__(self, num_slots: int) -> None:
        self.index = SlotIndex(num_slots)
        self._load_pins: Dict[str, List[int]] = {}  # req id -> slots pinned for its load

    def exists(self, keys: Sequence[str]) -> List[bool]:
        return self.index.exists(keys)

    def known(self, keys: Sequence[str]) -> List[bool]:
        return self.index.known(keys)

    knows_contents = True
    ranks_evictions = True

    @property
    def version(self) -> int:
        """Moves whenever a key becomes readable or stops being so."""
        return self.index.version

    def stamp(self) -> int:
        return self.index.stamp()

    def worth(self, value: float) -> float:
        return self.index.worth(value)

    def place_saves(self, per_rank, ranks=None):
        (entries,) = per_rank
        slots = self.index.reserve([key for key, _, _ in entries], ranks)
        placed = [(slot, group, block) for (_, group, block), slot in zip(entries, slots) if slot is not None]
        keys = [key for (key, _, _), slot in zip(entries, slots) if slot is not None]
        refused = [key for (key, _, _), slot in zip(entries, slots) if slot is None]
        return {EVERY_RANK: placed}, keys, refused

    def saves_done(self, keys: Sequence[str], ok: bool) -> None:
        """Written on every rank: readable; else the slots are free again."""
        if ok:
            self.index.confirm(keys)
        else:
            self.index.abandon(keys)

    def place_load(self, req_id: str, per_rank, stamp: Optional[int] = None, worth: float = 1.0):
        (gets,) = per_rank
        slots = self.index.pin([key for key, _, _ in gets], stamp, worth)
        if slots is None:  # evicted or dropped since the lookup
            return None
        self._load_pins[req_id] = slots
        return {EVERY_RANK: [(slot, group, block) for slot, (_, group, block) in zip(slots, gets)]}

    def load_done(self, req_id: str) -> None:
        self.index.unpin(self._load_pins.pop(req_id, ()))

    def forget_corrupt(self, slots: Sequence[int]) -> None:
        self.index.drop_slots(slots)

    def reset(self) -> bool:
        return self.index.clear()
