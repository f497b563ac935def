"""The embedded store's index, on vLLM's scheduler: which key lives in which arena slot,
every allocation and eviction, pins of loads in flight, and keys visible only once every rank
wrote them (:mod:`kvstride.arena` says how the two sides fit). No bytes live here."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvstride.arena.read_admission import DiskReadAdmission
from kvstride.capacity import PrefixOrder
from kvstride.stores.placement import EVERY_RANK

__all__ = ["SlotIndex", "ArenaPlacement", "slots_for", "overdue", "ALIGN"]

#: Slot size granularity (bytes): every slot starts on a cache line.
ALIGN = 64

#: Scheduler steps after which a write-through job not every rank reported is given up (its
#: records freed, its slots released, the workers told not to write it if they have not begun).
ABANDON_DISK_AFTER_STEPS = 256


def overdue(jobs: Dict[int, Any], step: int, limit: int) -> List[int]:
    """The ids of ``jobs`` (each with the ``step`` it was handed out at) that ``limit`` steps
    have passed without every rank's report, at scheduler step ``step``: the one give-up clock of
    the scheduler's save jobs and disk jobs, each with its own limit."""
    oldest = step - limit
    return [job_id for job_id, job in jobs.items() if job.step < oldest]

#: Write-through admission: records in flight (queued on the workers or being written, each
#: holding its arena slot) at most what the disk completes in this many steps, measured: a
#: disk slower than the saves gets the values it can write, the shallowest blocks of each save
#: first (a prefix's first blocks are what every longer hit needs), and the rest stay in memory
#: only (``disk_writes_skipped``), so that no queue grows and no slot waits on the disk for long.
DISK_BACKLOG_STEPS = 32
#: Records in flight at least, and until the disk completed its first write.
DISK_IN_FLIGHT_MIN = 16
DISK_IN_FLIGHT_START = 256
#: The disk's rate is its completions over the steps it was busy, both decayed by this much a
#: busy step (a window of about ten): a write that takes several steps measures its pace, not 0.
DISK_RATE_DECAY = 0.1


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
        slots = [self._ready.get(key) for key in keys]
        self._pin([slot for slot in slots if slot is not None])
        self.touch(keys, stamp, worth)
        return slots

    def _pin(self, slots: Sequence[int]) -> None:
        pins = self._pins
        for slot in slots:
            pins[slot] = pins.get(slot, 0) + 1

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
            self._dropped(key)
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
        self._dropped(key)
        return slot

    def confirm(self, keys: Sequence[str]) -> None:
        """Every rank wrote these keys: they become readable, ranked as ``reserve`` was told
        (else used now, in call order)."""
        stamp = None
        readied = []
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
            readied.append(key)
        self._readied(readied)

    # What a subclass keeps of the readable keys (the disk tier's persisted index): keys that
    # became readable, and a key that stopped being so.
    def _readied(self, keys: Sequence[str]) -> None:
        pass

    def _dropped(self, key: str) -> None:
        pass

    def hold(self, keys: Sequence[str]) -> Optional[List[int]]:
        """Pin the slots of ready ``keys`` (None, nothing pinned, if one is not ready) without
        using them (their rank stays): a copy out of them is in flight."""
        ready = self._ready
        if not all(k in ready for k in keys):
            return None
        slots = [ready[k] for k in keys]
        self._pin(slots)
        return slots

    def ready_key(self, key: str) -> bool:
        return key in self._ready

    def pending_rank(self, key: str) -> Optional[Tuple[int, int, float]]:
        """The ``(stamp, depth, worth)`` a key being written will be ranked with (``reserve``)."""
        return self._pending_ranks.get(key)

    def writing(self, key: str) -> bool:
        return key in self._writing

    def abandon(self, keys: Sequence[str]) -> None:
        """A rank failed to write these keys: their slots are free again."""
        self.release(self.quarantine(keys))

    def quarantine(self, keys: Sequence[str]) -> List[int]:
        """A save given up while a rank may still copy into these keys' slots: the keys are
        neither readable nor being written (a later save of one takes another slot), and their
        slots stay out of use until ``release``; returns those slots."""
        held = []
        for key in keys:
            self._pending_ranks.pop(key, None)
            slot = self._writing.pop(key, None)
            if slot is not None:
                del self._key_of[slot]
                held.append(slot)
        return held

    def release(self, slots: Sequence[int]) -> None:
        """Slots ``quarantine`` held: no copy writes them any more, they are free again."""
        self._free.extend(slots)

    def clear(self) -> bool:
        """Forget every ready key (``reset_prefix_cache(reset_connector=True)``); refused
        (False) while a load or a save is in flight."""
        if self._pins or self._writing:
            return False
        self._free.extend(self._ready.values())
        self.version += 1
        for key in self._ready:
            self._dropped(key)
        self._ready.clear()
        self.order.clear()
        self._key_of.clear()
        return True


@dataclass
class _DiskJob:
    """Keys being copied from arena slots (held) to disk records (being written)."""

    keys: List[str]
    slots: List[int]
    step: int
    ok: int = 0
    bad: int = 0


class ArenaPlacement:
    """The embedded store's placement (:mod:`kvstride.stores.placement`): the scheduler's
    :class:`SlotIndex` gives each new key a slot and pins the slots of each load, and every
    rank copies the same slots (the arena keys as one rank: its keys never leave this index).

    With a disk tier (``disk``, a :class:`kvstride.arena.disk_index.DiskIndex`) every value
    that becomes readable in memory is written through to a disk record (its slot held until
    every rank wrote it), a lookup sees both tiers, and a load of a key only on disk reads its
    record into a newly reserved slot first (``disk_reads``): the key is then in memory again.
    Whether a lookup claims such keys is ``read_admission``'s (:mod:`kvstride.arena.read_admission`)."""

    def __init__(self, num_slots: int, disk=None, world_size: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.index = SlotIndex(num_slots)
        self.disk = disk
        self.world_size = int(world_size)
        self._load_pins: Dict[str, List[int]] = {}  # req id -> slots pinned for its load
        # req id -> (keys read from disk into reserved slots, their records pinned, the reads)
        self._disk_loads: Dict[str, Tuple[List[str], List[int], list]] = {}
        # req id -> ranks whose reads of its records passed the load's deadline and still run:
        # its reserved slots and pinned records wait for them (``disk_reads_late``).
        self._late_reads: Dict[str, int] = {}
        self._failed_while_late: set = set()  # such loads vLLM was told failed
        self._disk_queue: List[Tuple[int, int, str]] = []  # (slot, record, key) to write, slot held
        self._disk_jobs: Dict[int, _DiskJob] = {}
        self._next_disk_job = 0
        self._step = 0
        self._disk_in_flight = 0  # records queued or being written (their slots held)
        self._disk_done = 0  # records completed since the last step
        self._disk_done_decayed = 0.0  # completions in busy steps, decayed (DISK_RATE_DECAY)
        self._disk_busy_decayed = 0.0  # busy steps, decayed alike
        self._disk_busy = False  # records were in flight at the last step's start
        self._disk_cancelled: List[int] = []  # jobs given up, for the workers to drop
        # Whether a lookup may claim keys only the disk holds (None without a disk tier).
        self.read_admission = None if disk is None else DiskReadAdmission(clock)
        self.counts: Dict[str, int] = {}  # what the scheduler counts (take_counts)

    def exists(self, keys: Sequence[str]) -> List[bool]:
        present = self.index.exists(keys)
        if self.disk is None:
            return present
        return [p or self.disk.ready_key(k) for p, k in zip(present, keys)]

    def known(self, keys: Sequence[str]) -> List[bool]:
        known = self.index.known(keys)
        if self.disk is None:
            return known
        return [p or self.disk.ready_key(k) for p, k in zip(known, keys)]

    knows_contents = True
    ranks_evictions = True

    @property
    def version(self) -> int:
        """Moves whenever a key becomes readable or stops being so (in either tier)."""
        return self.index.version + (0 if self.disk is None else self.disk.version)

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
        """Written on every rank: readable (and written through to disk); else the slots are
        free again."""
        if not ok:
            self.index.abandon(keys)
            return
        ranks = {key: self.index.pending_rank(key) for key in keys}
        self.index.confirm(keys)
        if self.disk is not None:
            self._write_through([key for key in keys if self.index.ready_key(key)], ranks)

    def saves_abandoned(self, keys: Sequence[str]) -> List[int]:
        """A save job given up before every rank reported it: its keys are not readable, and
        its slots stay out of use (a rank may still copy into them) until
        ``abandoned_saves_ended`` is given what this returns."""
        return self.index.quarantine(keys)

    def abandoned_saves_ended(self, held: Sequence[int]) -> None:
        """Every rank reported the given-up job: its copies ended, its slots are free again."""
        self.index.release(held)

    def disk_budget(self) -> int:
        """Records the write-through may have in flight now (``DISK_BACKLOG_STEPS``)."""
        if self._disk_done_decayed <= 0:
            return DISK_IN_FLIGHT_START
        rate = self._disk_done_decayed / self._disk_busy_decayed  # records the disk completes a step
        return max(DISK_IN_FLIGHT_MIN, int(rate * DISK_BACKLOG_STEPS))

    def take_counts(self) -> Dict[str, int]:
        counts, self.counts = self.counts, {}
        return counts

    def _write_through(self, keys: List[str], ranks: Dict[str, Optional[tuple]]) -> None:
        disk = self.disk
        keys = [key for key in keys if not disk.ready_key(key) and not disk.writing(key)]
        room = max(0, self.disk_budget() - self._disk_in_flight)
        if len(keys) > room:  # the disk's pace: the shallowest blocks first, the rest in memory only
            keys = sorted(keys, key=lambda key: (ranks.get(key) or (0, 0, 1.0))[1])
            self.counts["disk_writes_skipped"] = self.counts.get("disk_writes_skipped", 0) + len(keys) - room
            keys = keys[:room]
        if not keys:
            return
        # The disk's own recency (its order outlives the arena's), the arena's depth and worth.
        stamp = disk.stamp()
        records = disk.reserve(keys, {key: (stamp, *(ranks.get(key) or (0, 0, 1.0))[1:]) for key in keys})
        for key, record in zip(keys, records):
            if record is None:  # every record pinned or being written: this one stays in memory only
                continue
            (slot,) = self.index.hold([key])
            self._disk_queue.append((slot, record, key))
            self._disk_in_flight += 1

    def take_disk_writes(self) -> Dict[int, List[Tuple[int, int, str]]]:
        """This step's write-through jobs: job id -> (slot, record, key) for every rank; and
        jobs not every rank reported within ``ABANDON_DISK_AFTER_STEPS`` are given up."""
        self._step += 1
        if self._disk_busy:  # a step the disk had work all along: its pace
            keep = 1.0 - DISK_RATE_DECAY
            self._disk_done_decayed = self._disk_done_decayed * keep + self._disk_done
            self._disk_busy_decayed = self._disk_busy_decayed * keep + 1.0
        self._disk_done = 0
        self._disk_busy = self._disk_in_flight > 0
        for job_id in overdue(self._disk_jobs, self._step, ABANDON_DISK_AFTER_STEPS):
            self._end_disk_job(self._disk_jobs.pop(job_id), ok=False)
            self._disk_cancelled.append(job_id)
            self.counts["disk_write_jobs_given_up"] = self.counts.get("disk_write_jobs_given_up", 0) + 1
        if not self._disk_queue:
            return {}
        entries, self._disk_queue = self._disk_queue, []
        job_id = self._next_disk_job = self._next_disk_job + 1
        self._disk_jobs[job_id] = _DiskJob([key for _, _, key in entries], [slot for slot, _, _ in entries], self._step)
        return {job_id: entries}

    def disk_written(self, reports: Dict[int, List[int]]) -> None:
        """Per write-through job, ranks that wrote it and ranks that failed: once every rank
        reported, its keys are readable on disk (or their records free again)."""
        for job_id, (ok, bad) in reports.items():
            job = self._disk_jobs.get(job_id)
            if job is None:
                continue
            job.ok += ok
            job.bad += bad
            if job.ok + job.bad >= self.world_size:
                del self._disk_jobs[job_id]
                self._end_disk_job(job, ok=not job.bad)

    def take_disk_cancelled(self) -> List[int]:
        """Write-through jobs given up since the last call: a worker that has not begun one
        drops it (its records are free again, its slots another key's)."""
        cancelled, self._disk_cancelled = self._disk_cancelled, []
        return cancelled

    def _end_disk_job(self, job: _DiskJob, ok: bool) -> None:
        if ok:
            self.disk.confirm(job.keys)
            self._disk_done += len(job.keys)
        else:
            self.disk.abandon(job.keys)
        self._disk_in_flight -= len(job.keys)
        self.index.unpin(job.slots)

    def place_load(self, req_id: str, per_rank, stamp: Optional[int] = None, worth: float = 1.0):
        (gets,) = per_rank
        keys = [key for key, _, _ in gets]
        in_memory = self.index.exists(keys)
        if all(in_memory):
            slots = self.index.pin(keys, stamp, worth)
            if slots is None:  # evicted or dropped since the lookup
                return None
            self._load_pins[req_id] = slots
            return {EVERY_RANK: [(slot, group, block) for slot, (_, group, block) in zip(slots, gets)]}
        if self.disk is None:
            return None
        return self._place_disk_load(req_id, gets, in_memory, stamp, worth)

    def _place_disk_load(self, req_id: str, gets, in_memory: List[bool], stamp, worth: float):
        """A load some of whose keys are on disk only: the others' slots pinned, the disk
        keys' records pinned and a slot reserved for each (their reads go first); None, with
        nothing held, when a key is gone or its slot cannot be had."""
        index, disk = self.index, self.disk
        cached = [key for (key, _, _), here in zip(gets, in_memory) if here]
        from_disk = [(key, group, depth) for depth, ((key, group, _), here) in enumerate(zip(gets, in_memory)) if not here]
        disk_keys = [key for key, _, _ in from_disk]
        if len(set(disk_keys)) < len(disk_keys) or any(index.writing(key) for key in disk_keys):
            return None  # read by another load (or saved) right now
        slots = index.pin(cached, stamp, worth)
        if slots is None:
            return None
        records = disk.hold(disk_keys)
        if records is None:
            index.unpin(slots)
            return None
        stamp = index.stamp() if stamp is None else stamp
        reserved = index.reserve(disk_keys, {key: (stamp, depth, worth) for key, _, depth in from_disk})
        if any(slot is None for slot in reserved):
            index.abandon([key for key, slot in zip(disk_keys, reserved) if slot is not None])
            index.unpin(slots)
            disk.unpin(records)
            return None
        disk.touch(disk_keys, disk.stamp(), worth)
        slot_of = dict(zip(cached, slots))
        slot_of.update(zip(disk_keys, reserved))
        reads = [(record, slot, key, group) for (key, group, _), record, slot in zip(from_disk, records, reserved)]
        self._load_pins[req_id] = slots
        self._disk_loads[req_id] = (disk_keys, records, reads)
        self.read_admission.reads_change(len(disk_keys))
        return {EVERY_RANK: [(slot_of[key], group, block) for key, group, block in gets]}

    def disk_reads(self, req_id: str) -> list:
        """The ``(record, slot, key, group)`` reads the load of ``req_id`` starts with."""
        held = self._disk_loads.get(req_id)
        return [] if held is None else held[2]

    def load_done(self, req_id: str, ok: bool = True) -> None:
        """The workers reported the load: its pins go; keys it read from disk are readable in
        memory when it succeeded (their slots free again when not, once no rank's read of
        them still runs)."""
        self.index.unpin(self._load_pins.pop(req_id, ()))
        if self._late_reads.get(req_id):
            self._failed_while_late.add(req_id)
            return
        self._end_disk_load(req_id, ok)

    def disk_reads_late(self, reports: Dict[str, List[int]]) -> None:
        """Per load, [ranks whose reads passed its deadline, ranks whose late reads ended]: a
        late read still writes the load's reserved slots, so they are not given to other keys
        before it ends."""
        for req_id, (timed_out, ended) in reports.items():
            left = self._late_reads.get(req_id, 0) + timed_out - ended
            if left > 0:
                self._late_reads[req_id] = left
                continue
            self._late_reads.pop(req_id, None)
            if req_id in self._failed_while_late:
                self._failed_while_late.discard(req_id)
                self._end_disk_load(req_id, ok=False)

    def _end_disk_load(self, req_id: str, ok: bool) -> None:
        held = self._disk_loads.pop(req_id, None)
        if held is not None:
            keys, records, _ = held
            self.read_admission.reads_change(-len(keys))
            (self.index.confirm if ok else self.index.abandon)(keys)
            self.disk.unpin(records)

    def forget_corrupt(self, slots: Sequence[int]) -> None:
        self.index.drop_slots(slots)

    def forget_disk_corrupt(self, records: Sequence[int]) -> None:
        """Records a worker found torn, stale or foreign: forgotten (rewritten by later saves)."""
        if self.disk is not None and records:
            self.disk.drop_slots(records)

    def flush(self) -> None:
        """The step's changes to the disk tier's persisted index."""
        if self.disk is not None:
            self.disk.flush()

    def reset(self) -> bool:
        if self.disk is not None and (self._disk_jobs or self._disk_queue or self._disk_loads):
            return False
        if not self.index.clear():
            return False
        return self.disk is None or self.disk.clear()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
