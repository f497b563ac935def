"""Capacity policies for an offload store: which values to admit and which to evict.

A store of fixed capacity is worth the hits it serves. For hybrid models most of what a dense
store keeps can never serve a hit (a Mamba state at a boundary no later prompt stops at, a
sliding-window block outside every window a hit needs, attention blocks past the last state
they could be used with). The orders and indexes here hold no bytes themselves (the embedded
arena or Mooncake does), so any of them can sit in front of a real store:

- :class:`PrefixOrder`: the embedded store's eviction order (the arena's ``SlotIndex`` runs
  it, and the replay's ``kvstride`` policy through :class:`PrefixIndex`): GreedyDual-Size with
  frequency, so prefixes loaded again outlive one-off prompts, and prompts whose hit saves
  more prefill per byte (:func:`prefill_per_byte`) outlive the others; at one level the least
  recently used request first, its deepest block first, so what stays of a request is a
  prefix that can still serve a hit at some shorter boundary (SEMANTICS §8).
- :class:`TieredIndex`: two :class:`PrefixIndex` tiers, host memory over a local disk, the
  disk written through or spilled to (the replay's ``kvstride`` policy with ``disk_bytes``).
- :class:`LRUIndex`: every value on its own, least recently used evicted first (what ``dense``
  and ``vllm-reachable`` replay with).
- :class:`BoundaryIndex`: the unit is a *boundary set*: the keys one hit length ``X`` needs in
  every group (attention blocks up to ``X``, the window tail before ``X``, the state at ``X``).
  A key lives while some resident boundary needs it (reference counts), so the sets stay
  coherent: evicting a boundary frees its state and exactly the attention and window blocks
  no other resident boundary can use. Boundaries are evicted by lowest priority, a
  GreedyDual-Size-Frequency form: ``clock + min(hits, 4) x (1 + value_weight x w / mean(w))``
  where ``w`` = prefill tokens a hit at the boundary saves per byte the set added; the clock
  rises to each evicted priority, so recency, reuse and work saved per byte are weighed
  together (``value_weight`` 0 is LRU with frequency over boundary sets). The replay's
  ``kvstride-boundary-sets`` policy runs it; the connector does not.

All indexes keep counts of the bytes resident by group kind and the bytes written.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

Put = Tuple[str, int, str]  # (key, bytes, group kind)


class PrefixOrder:
    """Keys ranked ``(level, stamp, -depth)``, the lowest evicted first: GreedyDual-Size with
    frequency over requests' prefixes. A key's ``level`` is the clock when it was last written
    or read plus ``min(1 + reads, MAX_FREQUENCY) x worth``, the clock rising to each evicted
    key's level: a prefix loaded again and again outlives one-off prompts written after it, and
    ages out once the clock passes it. ``worth`` (:meth:`worth`) weighs the prefill work a hit
    on the request saves per byte its boundary set holds (:func:`prefill_per_byte`): a long
    prompt's set outlives a short one's written at the same time. At one level the least
    recently used request goes first (``stamp``), its deepest block first (``depth``): a
    caller that gives each key the stamp and worth of the newest request that wrote or read it
    and the tokens its block ends at keeps every request's resident keys a prefix of it (a
    load reads a prefix, so a shallower block is never read less often than a deeper one, and
    a read raises a key's worth to the reader's). Without depths, keys of one stamp leave in
    the order they were ranked."""

    MAX_FREQUENCY = 4
    #: How much a request's prefill saved per byte counts against recency (0: not at all).
    VALUE_WEIGHT = 3.0

    def __init__(self, value_weight: float = VALUE_WEIGHT) -> None:
        if not value_weight >= 0:  # also NaN
            raise ValueError(f"value_weight={value_weight!r}: use a number >= 0 (0: recency and reads alone)")
        # key -> its live heap entry (level, stamp, -depth, serial); stale entries left in the
        # heap (re-ranked or forgotten keys) are skipped when popped.
        self._live: Dict[str, Tuple[float, int, int, int]] = {}
        self._reads: Dict[str, int] = {}
        self._worth: Dict[str, float] = {}  # keys of worth other than 1
        self._heap: List[Tuple[float, int, int, int, str]] = []
        self._stamps = itertools.count(1)
        self._serial = itertools.count()
        self.clock = 0.0
        self.value_weight = float(value_weight)
        self._values = 0.0  # the sum and count of the values worth() was given
        self._valued = 0

    @property
    def heap_entries(self) -> int:
        return len(self._heap)

    def stamp(self) -> int:
        """A stamp newer than every one given so far."""
        return next(self._stamps)

    def stamps_after(self, stamp: int) -> None:
        """New stamps are newer than ``stamp`` (keys ranked from a saved order)."""
        self._stamps = itertools.count(int(stamp) + 1)

    def worth(self, value: float) -> float:
        """The worth of a request whose hit saves ``value`` prefill tokens per byte
        (:func:`prefill_per_byte`): ``1 + value_weight x value / mean value``, the mean over
        every value given so far. Take it once per request, and rank all its keys with it."""
        if value <= 0 or not self.value_weight:
            return 1.0
        self._values += value
        self._valued += 1
        return 1.0 + self.value_weight * value * self._valued / self._values

    def rank(self, key: str, stamp: int, depth: int = 0, worth: float = 1.0) -> None:
        if worth != 1.0:
            self._worth[key] = worth
        else:
            self._worth.pop(key, None)
        level = self.clock + min(1 + self._reads.get(key, 0), self.MAX_FREQUENCY) * worth
        entry = (level, stamp, -depth, next(self._serial))
        self._live[key] = entry
        heapq.heappush(self._heap, entry + (key,))
        if len(self._heap) > 2 * len(self._live) + 1024:  # mostly stale (touched keys): rebuild
            self._heap = [live + (k,) for k, live in self._live.items()]
            heapq.heapify(self._heap)

    def touch(self, keys: Iterable[str], stamp: int, worth: float = 1.0) -> None:
        """Ranked keys read at ``stamp`` by a request of ``worth`` (never older or worth less
        than they were), each keeping its depth."""
        live, reads, worths = self._live, self._reads, self._worth
        for key in keys:
            entry = live.get(key)
            if entry is not None:
                reads[key] = reads.get(key, 0) + 1
                self.rank(key, max(stamp, entry[1]), -entry[2], max(worth, worths.get(key, 1.0)))

    def standing(self, key: str) -> Tuple[int, int, float]:
        """A ranked key's ``(stamp, depth, worth)``: what another order ranks it with."""
        entry = self._live[key]
        return entry[1], -entry[2], self._worth.get(key, 1.0)

    def forget(self, key: str) -> None:
        del self._live[key]
        self._reads.pop(key, None)
        self._worth.pop(key, None)

    def ordered(self, keys: Iterable[str]) -> List[str]:
        """``keys`` (all ranked), first to be evicted first."""
        return sorted(keys, key=self._live.__getitem__)

    def pop(self, skip=None) -> Optional[str]:
        """Take the lowest ranked key (passing over those ``skip(key)`` is true for, which keep
        their rank) and raise the clock to its level; None when none is left."""
        popped = self.pop_standing(skip)
        return None if popped is None else popped[0]

    def pop_standing(self, skip=None) -> Optional[Tuple[str, int, int, float]]:
        """:meth:`pop`, with the key's :meth:`standing`: ``(key, stamp, depth, worth)``."""
        heap, live, passed = self._heap, self._live, []
        try:
            while heap:
                item = heapq.heappop(heap)
                key = item[4]
                if live.get(key) != item[:4]:
                    continue  # stale: the key was re-ranked or is gone
                if skip is not None and skip(key):
                    passed.append(item)
                    continue
                self.clock = max(self.clock, item[0])
                popped = (key, *self.standing(key))
                self.forget(key)
                return popped
            return None
        finally:
            for item in passed:
                heapq.heappush(heap, item)

    def clear(self) -> None:
        self._live.clear()
        self._reads.clear()
        self._worth.clear()
        self._heap.clear()


def prefill_per_byte(planner, num_prompt_tokens: int, value_bytes: Sequence[int]) -> float:
    """The prefill tokens a hit at a prompt's end saves per byte of the values it loads (its
    boundary set: ``KeyPlanner.hit_set_blocks`` values of ``value_bytes[g]`` bytes per group);
    0 for a prompt too short to hit."""
    # The prompt's deepest hit boundary (without vLLM's periodic checkpoints, which lie below).
    end = max(planner.hit_boundaries(num_prompt_tokens, retention_interval=0) or [0])
    if not end:
        return 0.0
    size = sum(blocks * nbytes for blocks, nbytes in zip(planner.hit_set_blocks(end), value_bytes))
    return end / size if size else 0.0


class _Counters:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.used = 0
        self.bytes_written = 0
        self.values_written = 0
        self.evictions = 0
        self.rejected = 0  # values (or boundary sets) that could not fit at all
        self.resident_by_kind: Dict[str, int] = collections.defaultdict(int)

    def resident(self) -> Dict[str, int]:
        return {k: v for k, v in sorted(self.resident_by_kind.items())}


class LRUIndex(_Counters):
    """Key -> (bytes, kind), least recently used first; puts of present keys are skipped."""

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._entries: "collections.OrderedDict[str, Tuple[int, str]]" = collections.OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def exists(self, keys: Sequence[str]) -> List[bool]:
        entries = self._entries
        return [k in entries for k in keys]

    def touch(self, keys: Iterable[str]) -> None:
        entries = self._entries
        for key in keys:
            if key in entries:
                entries.move_to_end(key)

    def put(self, key: str, nbytes: int, kind: str) -> bool:
        """Admit one value (evicting LRU values to make room); False if it cannot fit."""
        entries = self._entries
        if key in entries:
            return False
        if nbytes > self.capacity_bytes:
            self.rejected += 1
            return False
        while self.used + nbytes > self.capacity_bytes:
            _old, (size, old_kind) = entries.popitem(last=False)
            self.used -= size
            self.resident_by_kind[old_kind] -= size
            self.evictions += 1
        entries[key] = (nbytes, kind)
        self.used += nbytes
        self.resident_by_kind[kind] += nbytes
        self.bytes_written += nbytes
        self.values_written += 1
        return True

    def put_many(self, puts: Iterable[Put]) -> int:
        """``put`` of each (key, bytes, kind) in order; the bytes written."""
        entries, by_kind, cap = self._entries, self.resident_by_kind, self.capacity_bytes
        used = self.used
        written = values = evictions = 0
        for key, nbytes, kind in puts:
            if key in entries:
                continue
            if nbytes > cap:
                self.rejected += 1
                continue
            while used + nbytes > cap:
                _old, (size, old_kind) = entries.popitem(last=False)
                used -= size
                by_kind[old_kind] -= size
                evictions += 1
            entries[key] = (nbytes, kind)
            used += nbytes
            by_kind[kind] += nbytes
            written += nbytes
            values += 1
        self.used = used
        self.bytes_written += written
        self.values_written += values
        self.evictions += evictions
        return written


class PrefixIndex(_Counters):
    """Key -> (bytes, kind) in :class:`PrefixOrder`, the embedded store's eviction order, over
    values of any size (the replay's ``kvstride`` policy; the arena's ``SlotIndex`` runs the
    same order over its slots). Puts of present keys are skipped and keep their rank, as the
    connector's saves skip the keys the arena holds."""

    def __init__(self, capacity_bytes: int, value_weight: float = PrefixOrder.VALUE_WEIGHT) -> None:
        super().__init__(capacity_bytes)
        self.order = PrefixOrder(value_weight)
        self._entries: Dict[str, Tuple[int, str]] = {}
        # Called as on_evict(key, bytes, kind, stamp, depth, worth) for each evicted value (a
        # tier below that takes what this one evicts: TieredIndex's spill).
        self.on_evict: Optional[Callable[[str, int, str, int, int, float], None]] = None

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def value(self, key: str) -> Tuple[int, str]:
        """A resident key's (bytes, kind)."""
        return self._entries[key]

    def stamp(self) -> int:
        return self.order.stamp()

    def exists(self, keys: Sequence[str]) -> List[bool]:
        entries = self._entries
        return [k in entries for k in keys]

    def touch(self, keys: Iterable[str], stamp: int, worth: float = 1.0) -> None:
        self.order.touch(keys, stamp, worth)

    def put_many(self, puts: Iterable[Tuple[str, int, str, int, int]], worth: float = 1.0) -> int:
        """Admit each (key, bytes, kind, stamp, depth) of one request of ``worth`` in order,
        evicting in the order's turn to make room; the bytes written."""
        entries, by_kind, order = self._entries, self.resident_by_kind, self.order
        written = 0
        for key, nbytes, kind, stamp, depth in puts:
            if key in entries:
                continue
            if nbytes > self.capacity_bytes:
                self.rejected += 1
                continue
            while self.used + nbytes > self.capacity_bytes:
                old, *standing = order.pop_standing()
                size, old_kind = entries.pop(old)
                self.used -= size
                by_kind[old_kind] -= size
                self.evictions += 1
                if self.on_evict is not None:
                    self.on_evict(old, size, old_kind, *standing)
            entries[key] = (nbytes, kind)
            order.rank(key, stamp, depth, worth)
            self.used += nbytes
            by_kind[kind] += nbytes
            written += nbytes
            self.values_written += 1
        self.bytes_written += written
        return written


DISK_POLICIES = ("write-through", "spill")


class TieredIndex:
    """Host memory over a local disk, each a :class:`PrefixIndex` of its own capacity: a key is
    present when either tier holds it, and a load of a key only the disk holds reads it back
    into memory (where it is resident again, evicting as memory does). The disk admits by
    ``policy`` (:data:`DISK_POLICIES`):

    - ``write-through``: every value memory stores is written to disk at once, so the disk holds
      what memory does as far as its capacity lets it, and what was saved outlives a restart
      that empties memory.
    - ``spill``: a value goes to disk only when memory evicts it and the disk does not hold it:
      fewer disk writes, but a restart that empties memory loses what only memory held.

    Both tiers rank a key with the stamp, depth and worth its requests give it, each on its own
    clock; stamps and worths come from the memory tier's order (:attr:`order`), as without a
    disk. A save writes into memory what memory lacks, as memory alone would (the engine has
    the value at hand, where the disk's copy would have to be read). ``bytes_written`` counts
    the saves (read-backs from disk are not saves); the disk's writes are
    ``disk.bytes_written``, its reads ``disk_bytes_read``."""

    def __init__(self, memory_bytes: int, disk_bytes: int, policy: str = "write-through",
                 value_weight: float = PrefixOrder.VALUE_WEIGHT) -> None:
        if policy not in DISK_POLICIES:
            raise ValueError(f"disk policy {policy!r}: use one of {', '.join(DISK_POLICIES)}")
        self.policy = policy
        self.memory = PrefixIndex(memory_bytes, value_weight)
        self.disk = PrefixIndex(disk_bytes, value_weight)
        self.order = self.memory.order
        self.bytes_written = 0
        self.values_written = 0
        self.disk_bytes_read = 0
        self.loads_from_disk = 0  # loads that read at least one value from disk
        if policy == "spill":
            self.memory.on_evict = self._spill

    @property
    def used(self) -> int:
        return self.memory.used

    @property
    def evictions(self) -> int:
        return self.memory.evictions

    def resident(self) -> Dict[str, int]:
        return self.memory.resident()

    def stamp(self) -> int:
        return self.memory.stamp()

    def exists(self, keys: Sequence[str]) -> List[bool]:
        memory, disk = self.memory, self.disk
        return [k in memory or k in disk for k in keys]

    def touch(self, keys: Iterable[str], stamp: int, worth: float = 1.0) -> None:
        """A load read ``keys``: from memory where it holds them, else from disk, each read
        back into memory with the disk's standing of it and counted as read there."""
        memory, disk = self.memory, self.disk
        keys = list(keys)
        # Memory's keys are raised first, so that the read-backs evict other keys before them.
        memory.touch(keys, stamp, worth)
        disk.touch(keys, stamp, worth)
        # Taken before any is put: a spill the read-backs cause must not evict one still to read.
        reads = [(key, *disk.value(key), *disk.order.standing(key)) for key in keys
                 if key not in memory and key in disk]
        for key, nbytes, kind, key_stamp, depth, key_worth in reads:
            memory.put_many([(key, nbytes, kind, key_stamp, depth)], key_worth)
            memory.touch([key], stamp, worth)
            self.disk_bytes_read += nbytes
        if reads:
            self.loads_from_disk += 1

    def put_many(self, puts: Iterable[Tuple[str, int, str, int, int]], worth: float = 1.0) -> int:
        """Save each (key, bytes, kind, stamp, depth) of one request of ``worth`` into memory,
        and with ``write-through`` each value memory stores onto disk too (unless the disk holds
        it); the bytes saved into memory."""
        memory, disk = self.memory, self.disk
        values = memory.values_written
        if self.policy == "spill":
            written = memory.put_many(puts, worth)
        else:  # each value as memory stores it: what memory skips was written through before
            written = 0
            for put in puts:
                stored = memory.values_written
                written += memory.put_many([put], worth)
                if memory.values_written > stored:
                    disk.put_many([put], worth)
        self.bytes_written += written
        self.values_written += memory.values_written - values
        return written

    def _spill(self, key: str, nbytes: int, kind: str, stamp: int, depth: int, worth: float) -> None:
        self.disk.put_many([(key, nbytes, kind, stamp, depth)], worth)


class Ghost:
    """A bounded, least-recently-seen-first set of boundary hashes: the prefixes requests were
    seen to pass through, resident or not."""

    def __init__(self, entries: int = 1 << 22) -> None:
        self.entries = int(entries)
        self._seen: "collections.OrderedDict[bytes, None]" = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def seen(self, bid: bytes) -> bool:
        return bid in self._seen

    def remember(self, bids: Iterable[bytes]) -> None:
        seen = self._seen
        for bid in bids:
            if bid in seen:
                seen.move_to_end(bid)
            else:
                seen[bid] = None
        while len(seen) > self.entries:
            seen.popitem(last=False)


class BoundaryIndex(_Counters):
    """Boundary sets with reference-counted keys and GreedyDual-Size-Frequency eviction.

    ``ghost_entries`` bounds the remembered boundary hashes (:meth:`seen`, :meth:`remember`):
    the prefixes this index has seen requests pass through, whose junctions are worth a state
    checkpoint even when nothing of them is resident any more."""

    def __init__(self, capacity_bytes: int, *, ghost_entries: int = 1 << 22, max_frequency: int = 4,
                 value_weight: float = 0.1) -> None:
        super().__init__(capacity_bytes)
        self._keys: Dict[str, List] = {}  # key -> [refcount, bytes, kind]
        self._bounds: Dict[bytes, List] = {}  # boundary id -> [priority, keys, value, size, hits, serial]
        self._heap: List[Tuple[float, int, bytes]] = []
        self._serial = itertools.count()
        self.clock = 0.0
        self.max_frequency = max_frequency
        self.value_weight = float(value_weight)
        self._w_sum = 0.0
        self._w_count = 0
        self.ghost = Ghost(ghost_entries)

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    @property
    def boundaries(self) -> int:
        return len(self._bounds)

    def has_boundary(self, bid: bytes) -> bool:
        return bid in self._bounds

    def exists(self, keys: Sequence[str]) -> List[bool]:
        table = self._keys
        return [k in table for k in keys]

    # ---- ghost: prefixes seen --------------------------------------------------------------

    def seen(self, bid: bytes) -> bool:
        return self.ghost.seen(bid)

    def remember(self, bids: Iterable[bytes]) -> None:
        self.ghost.remember(bids)

    # ---- boundary sets ---------------------------------------------------------------------

    def _priority(self, value: float, size: int, hits: int) -> float:
        w = value / max(1, size)
        mean = self._w_sum / self._w_count if self._w_count else w
        relative = w / mean if mean > 0 else 1.0
        return self.clock + min(hits, self.max_frequency) * (1.0 + self.value_weight * relative)

    def touch_boundary(self, bid: bytes) -> bool:
        """A hit was served at this boundary: count it and refresh its priority."""
        entry = self._bounds.get(bid)
        if entry is None:
            return False
        entry[4] += 1
        entry[0] = self._priority(entry[2], entry[3], entry[4])
        entry[5] = next(self._serial)
        heapq.heappush(self._heap, (entry[0], entry[5], bid))
        return True

    def _evict_one(self, protected: Optional[bytes] = None) -> bool:
        heap, bounds = self._heap, self._bounds
        deferred = []
        try:
            while heap:
                priority, serial, bid = heapq.heappop(heap)
                entry = bounds.get(bid)
                if entry is None or entry[5] != serial:
                    continue  # stale heap item
                if bid == protected:
                    deferred.append((priority, serial, bid))
                    continue
                del bounds[bid]
                self.clock = max(self.clock, priority)
                self._release(entry[1])
                self.evictions += 1
                return True
            return False
        finally:
            for item in deferred:
                heapq.heappush(heap, item)

    def _release(self, keys: Sequence[str]) -> None:
        table, by_kind = self._keys, self.resident_by_kind
        for key in keys:
            rec = table[key]
            rec[0] -= 1
            if rec[0] == 0:
                del table[key]
                self.used -= rec[1]
                by_kind[rec[2]] -= rec[1]

    def put_boundary(self, bid: bytes, needs: Sequence[Put], value: float) -> int:
        """Admit the boundary set ``bid``: every key a hit at it needs, with the prefill tokens
        such a hit saves. Keys already resident are shared (referenced), the rest written,
        lower-priority boundaries evicted to make room. Returns the bytes written (0 when the
        set is already resident or cannot fit even alone)."""
        if bid in self._bounds:
            self.touch_boundary(bid)
            return 0
        table = self._keys
        sizes = {k: (b, kind) for k, b, kind in needs}
        keys = list(sizes)
        # Reference what is resident first, so that making room never frees it.
        new = []
        for key in keys:
            rec = table.get(key)
            if rec is not None:
                rec[0] += 1
            else:
                new.append(key)
        added = sum(sizes[k][0] for k in new)
        while self.used + added > self.capacity_bytes:
            if not self._evict_one():
                break
        if self.used + added > self.capacity_bytes:  # cannot fit even alone: undo
            self._release([k for k in keys if k in table])
            self.rejected += 1
            return 0
        by_kind = self.resident_by_kind
        for key in new:
            nbytes, kind = sizes[key]
            table[key] = [1, nbytes, kind]
            self.used += nbytes
            by_kind[kind] += nbytes
        self.bytes_written += added
        self.values_written += len(new)
        serial = next(self._serial)
        size = max(added, min(sizes[k][0] for k in keys) if keys else 1)
        self._w_sum += value / max(1, size)
        self._w_count += 1
        priority = self._priority(value, size, 1)
        self._bounds[bid] = [priority, keys, float(value), size, 1, serial]
        heapq.heappush(self._heap, (priority, serial, bid))
        return added
