"""The request-level offload engine: lookups, saves, partial tails and loads, executed through
the data plane on background lanes (loads, saves, and a third that launches device copies).

It knows nothing about vLLM's classes. A driver (the vLLM connector, or ``kvstride simulate``)
calls, per engine step:

- ``lookup(requests)`` on the scheduler side: one existence call for the whole batch of new
  requests, then each request's longest joint hit from the core;
- ``submit(saves, loads)``: one step's work. Saves are planned with the core (which keys,
  which blocks) and copied out of the KV cache before it returns: straight into the embedded
  arena's slots (the whole save), or through the staging pool batch by batch, each batch handed
  to the save lane as soon as it is copied (which puts every batch queued, and those arriving
  within ``put_linger_s``, in one store call); loads run on the load lane, never behind a save;
- or, where planning and execution live in different processes (the vLLM connector: its
  scheduler plans with ``plan_saves`` and the core, its workers execute), ``submit_planned(puts,
  gets)``: the same copies and store calls for ``(key, group, block_id)`` entries planned
  elsewhere, each save job's outcome reported back instead of moving an offset here. With
  ``fenced_groups`` (groups whose blocks the driver writes again only after ``fence(block_ids)``)
  and a store whose copies run on device streams, those groups' copies are launched by the
  launch lane after an event of the caller's stream, so the caller's thread only records the
  event; a fence on blocks whose copies are not launched yet cancels them (they fail);
- ``get_finished()``: which loads and saves completed, and the block ids whose load failed
  (the driver recomputes them); a load not done within ``load_timeout_s`` of its submit is
  reported failed there, and nothing it gets later reaches a KV block.

Nothing raises into the driver's step at run time: store failures, divergent boundaries and
bugs inside a job become outcomes, counted and logged once. A request's saved offset advances
only after every put of its save succeeded; a load whose bytes might be wrong is never
scattered into a KV block.

Staging (any store but the embedded arena): a step's saves stream through the pool's save
share. While the share is full the step waits for staged batches (its own or earlier steps')
to be put, as long as the store keeps up: the save lane's running put began less than
``save_wait_s`` ago. A store that keeps up costs the step a short wait; deferring instead
would lose what a later step cannot plan again, window-group blocks that left vLLM's window and
partial-tail hand-offs, and with them a hit boundary the other groups reach. A stalled store
(one put longer than ``save_wait_s``) does not stall vLLM's step: the rest of the step is
deferred, not failed: counted (``saves_deferred``), its requests' planned offsets go back, and
their next step plans those blocks again. Puts a later step may not plan again are staged
first; a tail deferred all the same is lost (``tails_dropped``). Loads stage in the pool's load
share, which saves never take.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from kvstride._core import KeyPlanner
from kvstride.layout import ComingReads, KVLayout
from kvstride.stores import KVStore, Status
from kvstride.transfer import Fence, StagedBatch, StagingPool, Transfer

__all__ = ["SaveRequest", "LoadRequest", "Finished", "OffloadEngine"]

log = logging.getLogger("kvstride.engine")


@dataclass
class SaveRequest:
    """Tokens computed so far for a request, its block tables and this step's hand-offs."""

    req_id: str
    block_hashes: Sequence[bytes]
    block_ids: Sequence[Sequence[int]]
    num_tokens: int
    handoffs: Sequence[Tuple[int, int, int]] = ()  # (group, block_id, boundary)
    # The boundaries whose window tails are kept (SEMANTICS §8, ``KeyPlanner.hit_boundaries``);
    # None keeps every window tail (dense).
    boundaries: Optional[Sequence[int]] = None


@dataclass
class LoadRequest:
    """Load a hit of ``hit_tokens`` into the destination block tables ``block_ids``."""

    req_id: str
    block_hashes: Sequence[bytes]
    block_ids: Sequence[Sequence[int]]
    hit_tokens: int
    local_tokens: int = 0


@dataclass
class Finished:
    """What completed since the last ``get_finished``."""

    loads_done: set = field(default_factory=set)  # req ids whose load completed (ok or not)
    loads_failed: Dict[str, set] = field(default_factory=dict)  # req id -> failed (group, block_id)
    saves_done: set = field(default_factory=set)  # req ids whose save job finished: blocks free
    saves_failed: set = field(default_factory=set)  # req ids with a put that did not succeed
    saves_deferred: set = field(default_factory=set)  # req ids with puts left to a later step
    jobs_done: Dict[int, str] = field(default_factory=dict)  # planned save job id -> "ok", "failed" or "deferred"


class _RequestState:
    """A request's saved offsets: ``offset`` is confirmed (every put below it succeeded),
    ``planned`` is where the next save plan starts (puts in flight included). A job captures
    the object at submit time, so a save or a load that completes after ``finish_request``
    updates a detached object (never a later request that reuses the id, and never a leaked
    entry)."""

    __slots__ = ("offset", "planned", "ahead")

    def __init__(self) -> None:
        self.offset = 0
        self.planned = 0
        self.ahead: List[Tuple[int, int]] = []  # saved ranges above ``offset``, past a gap

    def confirm(self, start: int, end: int) -> None:
        """A save of ``[start, end)`` succeeded: ``offset`` moves across contiguous successes
        only, so a deferred or failed range below a later success stays below it and is planned
        again (from ``offset``); the later success counts once the gap is filled."""
        if start > self.offset:
            self.ahead.append((start, end))
            return
        self.offset = max(self.offset, end)
        self.ahead.sort()
        while self.ahead and self.ahead[0][0] <= self.offset:
            self.offset = max(self.offset, self.ahead.pop(0)[1])


@dataclass
class _LoadJob:
    step: int
    loads: List[LoadRequest]
    states: List[Optional[_RequestState]]  # one per load, captured at submit (None: planned elsewhere)
    after: object = None  # CUDA: an event on the caller's stream that the scatters follow
    planned: Optional[Dict[str, List[Tuple[str, int, int]]]] = None  # req id -> its gets, planned elsewhere
    deadline: float = float("inf")  # time.monotonic() past which its loads are reported failed
    abandoned: bool = False  # reported failed at its deadline: nothing of it may reach a KV block
    scattering: bool = False  # copying into KV blocks now: not abandoned until that ends


@dataclass
class _SaveJob:
    """A step's saves. Their blocks are copied out of the KV cache before ``submit`` returns,
    batch by batch; the save lane puts each batch (``_PutBatch``)."""

    step: int
    saves: List[SaveRequest]
    states: List[_RequestState]  # one per save
    ends: List[int]  # the save end of each save
    starts: List[int] = field(default_factory=list)  # where each save's plan started (its planned offset)
    owners: Dict[str, List[str]] = field(default_factory=dict)  # key -> req ids waiting for it
    failed: set = field(default_factory=set)  # req ids with a put that failed or was refused
    deferred: set = field(default_factory=set)  # req ids with puts left to a later step
    tail_keys: set = field(default_factory=set)  # keys only partial tails name
    in_flight: int = 0  # batches handed to the save lane and not put yet
    staging: bool = True  # submit is still copying batches
    job_id: Optional[int] = None  # a save job planned elsewhere (its owners are this id)
    # Groups whose blocks the caller fences itself (``OffloadEngine.fence``) before writing them
    # again; the caller's stream waits at once for the reads of every other group's blocks.
    fenced_groups: frozenset = frozenset()


@dataclass
class _PutBatch:
    """One staged batch of a save job, for the save lane to put and release."""

    job: _SaveJob
    entries: List[Tuple[str, int, int]]  # (key, group, block_id)
    batch: StagedBatch
    fence: Fence  # of its gather


@dataclass
class _Launch:
    """A save job's device copies of blocks the caller fences itself, for the launch lane to
    launch after ``after`` (an event of the caller's stream), unless a fence cancelled them
    (``coming``: the reads the layout's pending reads expect)."""

    job: _SaveJob
    entries: List[Tuple[str, int, int]]
    after: object
    coming: ComingReads


@dataclass
class _DirectFinish:
    """A save job's copies into a store that copies blocks itself, still running on the
    device: the save lane calls ``finish`` (waits for them, keeps digests) and counts them."""

    job: _SaveJob
    entries: List[Tuple[str, int, int]]
    finish: object  # () -> statuses
    started: float  # time.perf_counter() of the copies' start


_STOP = object()

#: Durations kept per operation for percentiles.
TIMINGS_KEPT = 10_000

#: How long a lookup waits for the store's existence answer before its requests miss (vLLM's
#: scheduler waits for it): a store that hangs costs one lookup this, then every lookup misses
#: at once until the store has answered.
DEFAULT_LOOKUP_TIMEOUT_S = 1.0

#: How long a load may take from its submit until it is reported failed (its request recomputes):
#: a store that hangs costs each request at most this. A 2 GiB load over 1 GB/s TCP takes 2 s.
DEFAULT_LOAD_TIMEOUT_S = 10.0

#: How long a save lane's put may run before the store counts as stalled: a step that finds the
#: staging pool full waits for room while the running put is younger, and defers after.
DEFAULT_SAVE_WAIT_S = 2.0

#: How long one step may wait in all for staging room while the store keeps up (a slow but
#: alive store): past it the step's remaining saves are deferred, as with a stalled store.
DEFAULT_STAGING_WAIT_S = 4.0

#: At most this many keys in one store call of the save lane (``OffloadEngine._next_items``).
PUT_KEYS_PER_CALL = 1024

#: How long the save lane waits for more puts before a store call (``OffloadEngine._next_items``).
#: Mooncake's client (PyPI's build) waits for a put by busy-polling on the calling thread, which
#: then takes a core from vLLM for the whole call: at 0.2 s Gemma-3's bench engine made 44 calls
#: a rep (16 steps each) where 0.05 s made 115-149, and its save lane spent 0.21-0.25 s of CPU
#: a rep, not 0.30-0.42 (BENCHMARKS). A step without saves and ``wait_idle`` end the linger.
DEFAULT_PUT_LINGER_S = 0.2

#: The save lane lingers only while this share of the pool's save share is free.
LINGER_ROOM_SHARE = 0.25

#: ... and for at most this many steps: far fewer than the scheduler waits for a save job's report
#: (``kvstride.vllm.scheduler.ABANDON_AFTER_STEPS``, 64) on an engine whose steps are short.
LINGER_MAX_STEPS = 16

#: How often a waiter for staging room checks whether the running put has stalled.
_ROOM_CHECK_S = 0.05


def _check_seconds(name: str, value, meaning: str, positive: bool = False) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    low_ok = seconds > 0 if positive else seconds >= 0
    if isinstance(value, bool) or not low_ok or seconds == float("inf"):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number of seconds {bound} ({meaning}), got {value!r}")
    return seconds


def check_save_wait(value) -> float:
    """``save_wait_s`` as seconds, or ``ValueError`` naming it."""
    return _check_seconds("save_wait_s", value, "how long a store put may run before a step full of saves defers "
                          "instead of waiting")


def check_staging_wait(value) -> float:
    """``staging_wait_s`` as seconds, or ``ValueError`` naming it."""
    return _check_seconds("staging_wait_s", value, "how long one step may wait in all for staging room before "
                          "its remaining saves are deferred")


def check_load_timeout(value) -> float:
    """``load_timeout_s`` as seconds > 0, or ``ValueError`` naming it."""
    return _check_seconds("load_timeout_s", value, "how long a load may take before its request recomputes",
                          positive=True)


def check_lookup_timeout(value) -> float:
    """``lookup_timeout_s`` as seconds > 0, or ``ValueError`` naming it."""
    return _check_seconds("lookup_timeout_s", value, "how long a lookup waits for the store before its requests "
                          "miss", positive=True)


def check_put_linger(value) -> float:
    """``put_linger_s`` as seconds, or ``ValueError`` naming it."""
    return _check_seconds("put_linger_s", value, "how long the save lane waits for more puts to make one store "
                          "call of them; 0: it puts what is queued at once")


class OffloadEngine:
    """Drives one rank's offloading through ``planner`` (the core) and ``store``.

    ``transfer``: how blocks reach the store. A store that copies blocks itself (the embedded
    arena, ``EmbeddedStore``) takes the ``KVLayout`` alone and is bound to it: one copy per
    block each way, no staging. Any other store (Mooncake) takes a :class:`Transfer` (copies
    between the KV tensors and a staging pool its buffers are registered from; one block of
    every keyed group must fit each of the pool's shares, else ``ValueError``). None: planning
    and lookups only (a scheduler with no KV tensors)."""

    def __init__(
        self,
        planner: KeyPlanner,
        transfer: Union[Transfer, KVLayout, None],
        store: KVStore,
        *,
        name: str = "kvstride-engine",
        save_wait_s: float = DEFAULT_SAVE_WAIT_S,
        put_linger_s: float = DEFAULT_PUT_LINGER_S,
        load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
        lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,
        staging_wait_s: float = DEFAULT_STAGING_WAIT_S,
    ) -> None:
        self.save_wait_s = check_save_wait(save_wait_s)
        self.staging_wait_s = check_staging_wait(staging_wait_s)
        self.put_linger_s = check_put_linger(put_linger_s)
        self.load_timeout_s = check_load_timeout(load_timeout_s)
        self.lookup_timeout_s = check_lookup_timeout(lookup_timeout_s)
        self._asking: Optional[concurrent.futures.ThreadPoolExecutor] = None  # a store that may not answer
        self._asked: Optional[concurrent.futures.Future] = None  # its existence call, while it runs
        self._loads_out: List[_LoadJob] = []  # queued or running, for their deadline
        self.planner = planner
        self.store = store
        if isinstance(transfer, KVLayout):
            self.layout: Optional[KVLayout] = transfer
            self.transfer: Optional[Transfer] = None
        else:
            self.layout = None if transfer is None else transfer.layout
            self.transfer = transfer
        self.pool: Optional[StagingPool] = None if self.transfer is None else self.transfer.pool
        # The payload digests ride the staging copies (hashed while the bytes are in cache or in
        # device staging) when the store takes them from its caller (Mooncake) and the copies can
        # (Transfer.digests_ride_copies); else the store hashes the staged values itself.
        self._fused_digests = (
            getattr(store, "takes_digests", False) and store.verify and self.transfer is not None
            and self.transfer.digests_ride_copies(getattr(store, "mac_secret", None))
        )
        if self._fused_digests:  # with a deployment secret the digest is the MAC's payload tag
            self.transfer.mac_secret = getattr(store, "mac_secret", None)
        # The store writes each value's header into the room staged before its first piece.
        if self.transfer is not None:
            self.transfer.make_header_room_for(store)
        self._headers_staged = self.transfer is not None and self.transfer.header_room > 0
        self._num_blocks = None if self.layout is None else [g.num_blocks for g in self.layout.groups]
        self._block_bytes = None if self.layout is None else [g.block_bytes for g in self.layout.groups]
        # Blocks go straight between the KV tensors and a store that can copy them itself.
        self.direct = self.layout is not None and hasattr(store, "bind_layout")
        if self.direct:
            store.bind_layout(self.layout)
        elif self.layout is not None and self.transfer is None:
            raise ValueError(
                f"{type(store).__name__} needs staging buffers: pass Transfer(layout, StagingPool(nbytes)) "
                "instead of the layout"
            )
        if self.transfer is not None and not self.direct:
            # Per group, a bound on a batch's staged bytes: per block, and once per run.
            self._staged_bound = [self.transfer.staged_bytes_bound(g) for g in range(len(self.layout.groups))]
            self._batch_bytes = self._staging_limits()
        self.counters: collections.Counter = collections.Counter()
        # Per operation: the latest durations (bounded: the engine runs for the server's
        # lifetime) for percentiles, and the total seconds for rates.
        self.timings: Dict[str, "collections.deque[float]"] = collections.defaultdict(
            lambda: collections.deque(maxlen=TIMINGS_KEPT)
        )
        self.seconds: collections.Counter = collections.Counter()
        self._requests: Dict[str, _RequestState] = {}
        self._finished = Finished()
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)  # lookups in flight reach 0
        self._lookups_in_flight = 0
        self._logged: set = set()
        # Two lanes: a load never waits behind saves, a save never behind loads; and for a store
        # whose copies run on device streams, a lane that launches them (``_Launch``).
        self._load_queue: "queue.Queue" = queue.Queue()
        self._save_queue: "queue.Queue" = queue.Queue()
        self._launch_queue: "queue.Queue" = queue.Queue()
        self._pool_freed = threading.Condition(self._lock)  # a staged batch was released
        self._releases = 0  # staged batches released so far: a waiter sees room come back
        self._put_started: Optional[float] = None  # when the save lane's running put began
        self._room_waiters = 0  # steps waiting for staging room (the save lane stops lingering)
        self._flush_pending = False  # flush_puts() since the save lane's last call: it does not linger
        self._step = 0
        self._closed = False
        self.name = name
        # A planning-only engine (no KV tensors: a scheduler) runs no transfers, so no lanes.
        self._workers = [
            threading.Thread(target=self._run, args=(q,), name=f"{name}-{lane}", daemon=True)
            for lane, q in (("load", self._load_queue), ("save", self._save_queue))
            if self.layout is not None
        ]
        self._launcher = None
        if self.direct and hasattr(store, "copies_on_streams"):
            self._launcher = threading.Thread(target=self._run, args=(self._launch_queue,), name=f"{name}-launch",
                                              daemon=True)
        for worker in self._workers + [self._launcher] * (self._launcher is not None):
            worker.start()

    def _staging_limits(self) -> Dict[str, int]:
        """Bytes per staged batch of each lane, once one block of every group the planner
        keys is known to fit each lane's share of the pool (else none of it could ever be
        saved or loaded). A save batch takes at most half the save share, so one batch is
        copied while the one before it is put."""
        pool, layout = self.pool, self.layout
        keyed = [g for g in range(len(layout.groups)) if self.planner.hashes_per_block[g]]
        largest = max((self.transfer.staged_bytes([(g, 0)]) for g in keyed), default=0)
        for lane in ("save", "load"):
            if pool.share(lane) < largest:
                raise ValueError(
                    f"the {pool.capacity}-byte staging pool gives {lane}s {pool.share(lane)} bytes, less "
                    f"than one block ({largest} bytes): size it with "
                    "kvstride.transfer.staging_bytes_for(layout, tokens_per_step, planner)"
                )
        return {"save": max(largest, pool.share("save") // 2), "load": pool.share("load")}

    # ---- bookkeeping ---------------------------------------------------------------------

    def _log_once(self, what: str, message: str, *args) -> None:
        with self._lock:
            if what in self._logged:
                return
            self._logged.add(what)
        log.warning(message, *args)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to counter ``name`` (thread-safe; drivers count their own outcomes here)."""
        with self._lock:
            self.counters[name] += n

    def _time(self, name: str, seconds: float) -> None:
        with self._lock:
            self.timings[name].append(seconds)
            self.seconds[name] += seconds

    def saved_offset(self, req_id: str) -> int:
        with self._lock:
            state = self._requests.get(req_id)
            return state.offset if state is not None else 0

    def finish_request(self, req_id: str) -> None:
        """Forget a finished or preempted request (its next save starts from 0). Its jobs
        still queued run, but no longer move any offset."""
        with self._lock:
            self._requests.pop(req_id, None)

    @property
    def closed(self) -> bool:
        return self._closed

    @staticmethod
    def _statuses(statuses, n: int) -> list:
        """A store's per-key answer, exactly ``n`` long: anything missing or not a Status
        counts as a failure (a short answer must never read as success)."""
        out = list(statuses) if statuses is not None else []
        out = [s if isinstance(s, Status) else Status.ERROR for s in out[:n]]
        return out + [Status.ERROR] * (n - len(out))

    # ---- scheduler side ------------------------------------------------------------------

    def lookup(self, requests: Sequence[Tuple[str, Sequence[bytes], int]],
               bitmaps: Optional[Dict[str, List[bool]]] = None) -> Dict[str, int]:
        """Longest joint hit per request, from one existence call for the whole batch. After
        ``shutdown`` every request misses and the store is not called. ``bitmaps``, if given,
        gets each request's existence bitmap over ``planner.lookup_keys`` when the store
        answered (none for a request whose answer timed out or failed: its misses are not the
        store's word). A request given as ``(req_id, hashes, num_tokens, planner)`` is keyed by
        its own planner (one bound to its adapter or multimodal content)."""
        with self._lock:
            if self._closed:
                self.count("lookups_refused", len(requests))
                return {request[0]: 0 for request in requests}
            self._lookups_in_flight += 1
        try:
            return self._lookup(requests, bitmaps)
        finally:
            with self._lock:
                self._lookups_in_flight -= 1
                self._idle.notify_all()

    def _lookup(self, requests, bitmaps_out: Optional[Dict[str, List[bool]]]) -> Dict[str, int]:
        start = time.perf_counter()
        per_request = []
        unique: Dict[str, int] = {}
        for req_id, hashes, num_tokens, *own in requests:
            planner = own[0] if own else self.planner
            try:
                keys = planner.lookup_keys(hashes, num_tokens)
            except Exception as err:  # a malformed request misses; the others go on
                self._log_once("lookup-request", "lookup of request %s refused: %r", req_id, err)
                self.count("lookup_errors")
                keys = None
            per_request.append((req_id, hashes, num_tokens, keys, planner))
            for key in keys or ():
                unique.setdefault(key, len(unique))
        present = [False] * len(unique)
        answered = True
        if unique:
            try:
                answer = self._exists_in_time(list(unique))
                answered = answer is not None
                if answered:
                    present = [bool(p) for p in answer]
                    if len(present) != len(unique):
                        raise RuntimeError(f"exists answered {len(present)} of {len(unique)} keys")
            except Exception as err:  # the store's own failures are statuses; this is a bug
                self._log_once("lookup", "lookup failed, treating every request as a miss: %r", err)
                self.count("lookup_errors")
                present, answered = [False] * len(unique), False
        hits = {}
        for req_id, hashes, num_tokens, keys, planner in per_request:
            if keys is None:
                hits[req_id] = 0
                continue
            bitmap = [present[unique[k]] for k in keys]
            hits[req_id] = planner.longest_hit_bitmap(hashes, num_tokens, bitmap)
            if bitmaps_out is not None and answered:
                bitmaps_out[req_id] = bitmap
        with self._lock:
            self.counters["lookups"] += len(per_request)
            self.counters["lookup_hit_tokens"] += sum(hits.values())
            self.counters["lookup_tokens"] += sum(request[2] for request in per_request)
        self.count("lookup_keys", len(unique))
        self._time("lookup", time.perf_counter() - start)
        return hits

    def _exists_in_time(self, keys: List[str]) -> Optional[list]:
        """The store's existence answer for ``keys``, or None when it does not answer within
        ``lookup_timeout_s`` or still has not answered an earlier call (counted in
        ``lookup_timeouts``). A store whose index is here (``knows_contents``) answers at once."""
        if getattr(self.store, "knows_contents", False):
            return self.store.exists(keys)
        with self._lock:
            if self._asked is not None and not self._asked.done():
                self.count("lookup_timeouts")
                return None
            if self._asking is None:
                self._asking = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"{self.name}-lookup")
            self._asked = asked = self._asking.submit(self.store.exists, keys)
        try:
            return asked.result(timeout=self.lookup_timeout_s)
        except concurrent.futures.TimeoutError:
            self.count("lookup_timeouts")
            self._log_once("lookup-timeout", "the store did not answer a lookup within lookup_timeout_s=%gs: "
                           "requests miss until it answers", self.lookup_timeout_s)
            return None

    # ---- worker side ---------------------------------------------------------------------

    def submit(self, saves: Sequence[SaveRequest] = (), loads: Sequence[LoadRequest] = ()) -> int:
        """Queue one step's loads and saves; returns the step number.

        Saves are planned and their blocks copied out of the KV cache before this returns
        (only the store puts run later, on the save lane), so the caller may free or reuse the
        blocks right after: vLLM guarantees a hand-off block, or a block that leaves a sliding
        window, only until the end of the step that offered it. On CUDA the copies run on a
        side stream that the caller's current stream is made to wait for (no host sync).
        Saves that find the staging pool held by earlier steps are deferred (module
        docstring). Loads run on the load lane after the work queued so far on the caller's
        stream, and write only their destination blocks. After ``shutdown`` the work is
        refused: loads are reported failed, saves not done."""
        saves, loads = list(saves), list(loads)
        self._refuse_if_planning_only()
        with self._lock:  # the closed check and the enqueue are one step: no job is lost
            self._step += 1
            step = self._step
            if self._closed:
                self.counters["refused_after_shutdown"] += len(saves) + len(loads)
                for load in loads:
                    self._finished.loads_done.add(load.req_id)
                    self._finished.loads_failed[load.req_id] = self._all_blocks(load)
                for save in saves:
                    self._finished.saves_done.add(save.req_id)
                    self._finished.saves_failed.add(save.req_id)
                return step
            if loads:
                states = [self._requests.setdefault(load.req_id, _RequestState()) for load in loads]
                self._queue_load(_LoadJob(step, loads, states, self._caller_stream_event()))
            if not saves:
                return step
            states = [self._requests.setdefault(save.req_id, _RequestState()) for save in saves]
        job = _SaveJob(step, saves, states, [0] * len(saves), starts=[0] * len(saves))
        # The copy into a direct store is the whole save.
        self._run_save_job(job, self._save_direct if self.direct else self._stage_saves, [s.req_id for s in saves])
        return step

    def submit_planned(
        self,
        puts: Optional[Dict[int, List[Tuple[str, int, int]]]] = None,
        gets: Optional[Dict[str, List[Tuple[str, int, int]]]] = None,
        *,
        fenced_groups: Iterable[int] = (),
    ) -> int:
        """Execute one step's work that a planner elsewhere planned (the vLLM connector's
        scheduler, which holds the requests' offsets): ``puts`` maps a save job id to its
        ``(key, group, block_id)`` entries, copied out of the KV cache before this returns (as
        ``submit``'s saves are) and put on the save lane, each job's outcome reported in
        ``Finished.jobs_done`` (``"ok"``, ``"failed"`` if a put failed, else ``"deferred"`` if some were
        left to a later step); ``gets`` maps a
        request id to the entries of its load, run on the load lane and reported like
        ``submit``'s loads. Returns the step number.

        ``fenced_groups``: groups whose saved blocks the caller writes again only after
        ``fence`` named them (vLLM: a block allocated anew). On CUDA the caller's stream then
        does not wait for their reads, which run beside its later kernels; it waits at once
        for the reads of the other groups' blocks (a hand-off state rewritten in place), which
        are copied first."""
        puts, gets = dict(puts or {}), dict(gets or {})
        fenced = frozenset(int(g) for g in fenced_groups)
        self._refuse_if_planning_only()
        with self._lock:
            self._step += 1
            step = self._step
            if self._closed:
                self.counters["refused_after_shutdown"] += len(puts) + len(gets)
                for req_id, entries in gets.items():
                    self._finished.loads_done.add(req_id)
                    self._finished.loads_failed[req_id] = {(g, b) for _, g, b in entries}
                self._finished.jobs_done.update((job_id, "failed") for job_id in puts)
                return step
            if gets:
                loads = [LoadRequest(req_id, (), (), 0) for req_id in gets]
                self._queue_load(_LoadJob(step, loads, [None] * len(loads), self._caller_stream_event(), planned=gets))
        for job_id, entries in puts.items():
            job = _SaveJob(step, [], [], [], job_id=job_id, fenced_groups=fenced)
            self._run_save_job(job, functools.partial(self._execute_planned, entries=entries), [job_id])
        return step

    def fence(self, block_ids: Optional[Iterable[int]]) -> int:
        """Order the calling thread's current stream after every save still reading one of
        ``block_ids`` (of any group; None: any block), so that the work queued next may write
        them: on the device, no host sync; nothing on CPU, where a save's reads are done when
        it returns. Returns how many reads it waits for."""
        if self.layout is None:
            return 0
        try:
            return self.layout.fence(None if block_ids is None else np.fromiter(block_ids, dtype=np.int64))
        except Exception as err:  # fails closed: what comes next may overwrite a block a save still reads
            self.count("fence_errors")
            self._log_once("fence", "a fence on the step's blocks failed, so the step waits for every save's "
                           "reads: %r", err)
        try:
            return self.layout.fence(None)
        except Exception as err:
            self._log_once("fence-all", "a fence on every save's reads failed, so the host waits for the "
                           "device: %r", err)
            self.layout.synchronize()
            return 0

    def _fence_unfenced(self, job: _SaveJob, entries: List[Tuple[str, int, int]]) -> None:
        """The caller's stream waits now for the reads of ``entries``' blocks that the caller
        does not fence itself (``_SaveJob.fenced_groups``); failing closed, as ``fence``."""
        now = [block for _, group, block in entries if group not in job.fenced_groups]
        if now:
            self.fence(now)

    def _refuse_if_planning_only(self) -> None:
        if self.layout is None:
            raise ValueError("this engine has no KV layout (transfer=None): it plans and looks up, it moves no blocks")

    def _caller_stream_event(self):
        """(CUDA) An event on the caller's current stream that a load's writes wait for, so
        they land after the work still queued on their destination blocks; None on CPU."""
        if self.transfer is not None:
            return self.transfer.current_stream_event()
        return self.layout.current_stream_event()

    def _execute_planned(self, job: _SaveJob, entries: List[Tuple[str, int, int]]) -> None:
        kept = entries
        inside = self._entries_in_layout(entries)
        if not inside.all():  # rare: count and log the blocks we do not have
            for entry in itertools.compress(entries, ~inside):
                self._bad_save_block(f"job {job.job_id}", entry)
            kept = list(itertools.compress(entries, inside))
        if len(kept) < len(entries):
            job.failed.add(job.job_id)
        job.owners = {key: [job.job_id] for key, _, _ in kept}
        if job.fenced_groups:  # the blocks the caller's stream waits for are read first
            kept = sorted(kept, key=lambda entry: entry[1] in job.fenced_groups)
        if self.direct:
            self._put_direct(job, kept)
        else:
            self._stage_entries(job, kept)

    def _run_save_job(self, job: _SaveJob, execute, owners_on_error: List) -> None:
        """``execute(job)`` (copies out of the KV cache, puts queued), then the job finishes
        here or with its last put. An error fails ``owners_on_error``, never the driver."""
        try:
            execute(job)
        except Exception as err:  # never into the driver: fail these saves, keep going
            self._log_once("save-bug", "save job of step %d failed: %r", job.step, err)
            self.count("save_job_errors")
            with self._lock:
                job.failed.update(owners_on_error)
        with self._lock:
            job.staging = False
            finished = not job.in_flight
        if finished:
            self._finish_saves(job)

    def _queue_load(self, job: _LoadJob) -> None:
        """(Under the lock) hand ``job`` to the load lane, with its deadline."""
        job.deadline = time.monotonic() + self.load_timeout_s
        self._loads_out.append(job)
        self._load_queue.put(job)

    def get_finished(self) -> Finished:
        with self._lock:
            self._expire_loads()
            done, self._finished = self._finished, Finished()
        return done

    def _expire_loads(self) -> None:
        """(Under the lock) report the loads past their deadline failed, so their requests
        recompute and free their blocks; the lane drops whatever of them it still gets."""
        now = time.monotonic()
        for job in self._loads_out:
            if job.deadline > now or job.abandoned or job.scattering:
                continue  # a scatter in progress is a memory copy: it ends, then the job expires
            job.abandoned = True
            for load in job.loads:
                self._finished.loads_done.add(load.req_id)
                self._finished.loads_failed[load.req_id] = self._all_blocks(load)
            self.count("loads_timed_out", len(job.loads))
            self._log_once("load-timeout", "loads not done within load_timeout_s=%gs are recomputed (the store "
                           "may hang); what they get later is dropped", self.load_timeout_s)
        self._loads_out = [job for job in self._loads_out if not job.abandoned]

    def _begin_scatter(self, job: _LoadJob) -> bool:
        """Whether ``job`` may write KV blocks now (not abandoned at its deadline); it then
        cannot be abandoned until ``_end_scatter``."""
        with self._lock:
            if job.abandoned:
                return False
            job.scattering = True
            return True

    def _end_scatter(self, job: _LoadJob) -> None:
        with self._lock:
            job.scattering = False

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Block until every submitted job ran (puts at once: ``flush_puts``); False on timeout."""
        self.flush_puts()
        deadline = None if timeout is None else time.monotonic() + timeout
        for lane in (self._load_queue, self._launch_queue, self._save_queue):  # a launch queues a finish
            with lane.all_tasks_done:  # notified by the lane's task_done
                while lane.unfinished_tasks:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    lane.all_tasks_done.wait(left)
        return True

    def shutdown(self, timeout: Optional[float] = 60.0) -> bool:
        """Run every queued job, then stop the lanes. The store stays open (its owner closes
        it) and is never called again by this engine. True when every lane drained in time."""
        with self._lock:
            already = self._closed
            if not already:
                self._closed = True
                if self._launcher is not None:
                    self._launch_queue.put(_STOP)
                self._pool_freed.notify_all()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not already and self._launcher is not None:  # its launches hand their finish to the save lane
            self._launcher.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            if not already and self._workers:  # a planning-only engine has no lanes to stop
                self._load_queue.put(_STOP)
                self._save_queue.put(_STOP)
            while self._lookups_in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._idle.wait(left)
        if not already:
            for worker in self._workers:
                worker.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if self._asking is not None:  # a call the store never answered is not waited for
                self._asking.shutdown(wait=False, cancel_futures=True)
        lanes = self._workers + [self._launcher] * (self._launcher is not None)
        return not any(w.is_alive() for w in lanes) and not self._lookups_in_flight

    def _run(self, lane: "queue.Queue") -> None:
        while True:
            items = self._next_items(lane)
            try:
                if items[0] is _STOP:
                    return
                if isinstance(items[0], _LoadJob):
                    self._execute_load(items[0])
                elif isinstance(items[0], _DirectFinish):
                    self._finish_direct(items[0])
                elif isinstance(items[0], _Launch):
                    self._launch(items[0])
                else:
                    self._execute_puts(items)
            except Exception as err:  # the job's own error reporting failed: keep the lane
                step = items[0].step if isinstance(items[0], _LoadJob) else items[0].job.step
                self._log_once("worker-bug", "job of step %d could not be reported: %r", step, err)
                self.count("worker_errors")
            finally:
                for _ in items:
                    lane.task_done()

    def _next_items(self, lane: "queue.Queue") -> list:
        """The lane's next job (blocking); for a put, with the puts queued behind it, up to
        ``PUT_KEYS_PER_CALL`` keys, and those that arrive within ``put_linger_s`` and
        ``LINGER_MAX_STEPS`` steps while no step waits for staging room, room is not low
        (``_save_room_low``) and nobody flushed (``flush_puts``): one store call for all of
        them. A Mooncake call costs ~0.3 ms of a polling client thread however few values it
        moves (``benches/mooncake_parts.py``), and 2-13 ms beside a busy vLLM engine on 2 cores.
        A stop or a load behind them waits for the next call."""
        items = [lane.get()]
        if not isinstance(items[0], _PutBatch):
            return items
        keys = len(items[0].entries)
        deadline = time.monotonic() + self.put_linger_s
        with lane.mutex:  # peek: a stop, a load or a put over the limit stays queued
            while keys < PUT_KEYS_PER_CALL:
                if not lane.queue:
                    left = deadline - time.monotonic()
                    if left <= 0 or self._closed or self._room_waiters or self._flush_pending or (
                        self._save_room_low() or self._step - items[0].job.step >= LINGER_MAX_STEPS
                    ):
                        break
                    lane.not_empty.wait(left)
                    continue
                head = lane.queue[0]
                if not isinstance(head, _PutBatch) or keys + len(head.entries) > PUT_KEYS_PER_CALL:
                    break
                items.append(lane.queue.popleft())  # lane.get's bookkeeping: the task stays unfinished
                lane.not_full.notify()
                keys += len(head.entries)
            self._flush_pending = False  # a flush from now on is for the puts after this call
        return items

    def flush_puts(self) -> None:
        """No more saves are coming soon (a step without saves, a caller waiting for idle): the
        save lane puts what it holds now instead of lingering for more, and does not linger for
        the next put either."""
        with self._save_queue.mutex:
            self._flush_pending = True
            self._save_queue.not_empty.notify()

    def _save_room_low(self) -> bool:
        """Less than ``LINGER_ROOM_SHARE`` of the save share is free: a step may soon have to
        wait for room, so the save lane stops lingering (a default pool holds eight steps)."""
        return self.pool.free_in("save") < self.pool.share("save") * LINGER_ROOM_SHARE

    def _execute_load(self, job: _LoadJob) -> None:
        try:
            self._load(job)
        except Exception as err:  # never into the driver: fail the loads, keep going
            self._log_once("load-bug", "load job of step %d failed: %r", job.step, err)
            self.count("load_job_errors")
            with self._lock:
                if not self._load_over(job):
                    return
                for load in job.loads:
                    self._finished.loads_done.add(load.req_id)
                    self._finished.loads_failed[load.req_id] = self._all_blocks(load)

    def _load_over(self, job: _LoadJob) -> bool:
        """(Under the lock) ``job`` leaves the loads out; whether it is still to be reported
        (not already reported failed at its deadline)."""
        if job in self._loads_out:
            self._loads_out.remove(job)
        return not job.abandoned

    def _execute_puts(self, items: List[_PutBatch]) -> None:
        with self._lock:
            self._put_started = time.monotonic()
        try:
            self._put(items)
        except Exception as err:  # never into the driver: fail the batches' saves, keep going
            self._log_once("save-bug", "save job of step %d failed: %r", items[0].job.step, err)
            self.count("save_job_errors")
            with self._lock:
                for item in items:
                    item.job.failed.update(rid for key, _, _ in item.entries for rid in item.job.owners[key])
        finally:
            for item in items:
                self._release_batch(item.batch)
            finished = []
            with self._lock:
                self._put_started = None
                for item in items:
                    item.job.in_flight -= 1
                    if not item.job.in_flight and not item.job.staging:
                        finished.append(item.job)
            for job in finished:
                self._finish_saves(job)

    @staticmethod
    def _all_blocks(load: LoadRequest) -> set:
        try:
            return {(g, int(b)) for g, table in enumerate(load.block_ids) for b in table if b}
        except Exception:  # a malformed table: report what can be read
            return set()

    def _bad_save_block(self, owner: str, entry: Tuple[str, int, int]) -> None:
        """Count and log (once) a save whose source block is not in the KV cache."""
        _, group, block_id = entry
        self.count("save_bad_block")
        self._log_once("save-bad-block", "%s: block %d of group %d is not in the KV cache", owner, block_id, group)

    def _entries_in_layout(self, entries: List[Tuple[str, int, int]]) -> np.ndarray:
        """Per ``(key, group, block_id)`` entry, whether its block is in the KV cache: a known
        group, a block id below its count, never vLLM's null block 0. Planning without KV
        tensors, any block but 0 (the worker checks). Array operations: a large save is
        thousands of entries."""
        groups = np.fromiter((g for _, g, _ in entries), dtype=np.int64, count=len(entries))
        block_ids = np.fromiter((b for _, _, b in entries), dtype=np.int64, count=len(entries))
        if self._num_blocks is None:
            return block_ids > 0
        known = (groups >= 0) & (groups < len(self._num_blocks))
        limits = np.zeros(len(groups), dtype=np.int64)
        limits[known] = np.asarray(self._num_blocks, dtype=np.int64)[groups[known]]
        return known & (block_ids > 0) & (block_ids < limits)

    def _stage_run(self, entries: List[Tuple[str, int, int]], start: int, lane: str, room_coming):
        """Stage the longest run of ``entries`` from ``start`` that fits one batch of ``lane``,
        as (end, StagedBatch). While nothing fits, wait for a staged batch to be released as
        long as ``room_coming()`` (called under the lock) says one will be; else (start, None)."""
        end, nbytes, groups = start, 0, set()
        while end < len(entries):  # a bound on the staged bytes of entries[start:end + 1]
            group = entries[end][1]
            per_entry, per_run = self._staged_bound[group]
            more = per_entry + (0 if group in groups else per_run)
            if end > start and nbytes + more > self._batch_bytes[lane]:
                break
            nbytes += more
            groups.add(group)
            end += 1
        while True:
            with self._lock:
                releases = self._releases
            size = end - start
            while True:  # halve while the free room is smaller or split
                batch = self.transfer.stage([(g, b) for _, g, b in entries[start : start + size]], lane)
                if batch is not None:
                    return start + size, batch
                if size == 1:
                    break
                size //= 2
            with self._lock:
                while self._releases == releases:
                    if not room_coming():
                        return start, None
                    self._room_waiters += 1
                    try:
                        if lane == "save":  # a save lane lingering for more puts puts what it has now
                            with self._save_queue.mutex:
                                self._save_queue.not_empty.notify()
                        self._pool_freed.wait(_ROOM_CHECK_S)  # a release wakes it at once
                    finally:
                        self._room_waiters -= 1

    def plan_saves(self, saves: Sequence[SaveRequest], states: Sequence["_RequestState"], known, planner=None,
                   depths: Optional[Dict[str, int]] = None):
        """The core's plans for ``saves`` (normal save and partial tail) from each request's
        planned offset, minus keys ``known(keys)`` says are stored; advances the planned offsets.
        ``planner``: another rank's planner (the same groups and offsets, its own keys).
        Returns (entries [(key, group, block_id)], owners {key: [req ids]}, ends, failed req ids).
        Entries a later step may not be able to plan again come first: keys only a partial tail
        names (its hand-off blocks are valid in this step only), then window-group blocks.
        ``depths``, if given, gets each key's depth: the tokens its block ends at (a tail's
        boundary), for an eviction order that keeps prefixes."""
        entries, owners, ends, failed, _ = self._plan_saves(saves, states, known, planner, depths)
        return entries, owners, ends, failed

    @staticmethod
    def _depths(planner, save: SaveRequest, offset: int, end: int, puts, depths: Dict[str, int]) -> None:
        """Each put's block end in tokens, from the block-table rows the save covered (the
        normal save writes blocks in [offset, end) only: the cost stays that of the step)."""
        rows: Dict[int, Dict[int, int]] = {}
        for key, group, block_id in puts:
            b = planner.groups[group].block_size
            where = rows.get(group)
            if where is None:
                lo = offset // b
                table = save.block_ids[group]
                where = rows[group] = {bid: i for i, bid in enumerate(table[lo : -(-end // b)], lo)}
            row = where.get(block_id)
            depths[key] = end if row is None else (row + 1) * b

    def _plan_saves(self, saves, states, known, planner=None, depths=None):
        """``plan_saves``, plus the keys only partial tails name."""
        planner = planner or self.planner
        windowed = [spec.kind in ("sliding_window", "chunked_local") for spec in planner.groups]
        ordered: List[Tuple[int, str, int, int]] = []  # (staging order, key, group, block_id)
        owners: Dict[str, List[str]] = {}
        ends: List[int] = []
        failed: set = set()
        tail_keys: set = set()
        for save, state in zip(saves, states):
            with self._lock:
                offset = state.planned
            plan = planner.plan_save(
                save.block_hashes, save.block_ids, save.num_tokens, saved_offset=offset, boundaries=save.boundaries
            )
            ends.append(plan.end)
            puts = list(plan.puts)
            if depths is not None:
                self._depths(planner, save, offset, plan.end, puts, depths)
            if save.handoffs:
                tail = planner.plan_tail(save.block_hashes, save.block_ids, save.handoffs, saved_offset=offset)
                self.count(f"tail_{tail.outcome}")
                if tail.outcome == "divergent_boundaries":
                    self._log_once(
                        "divergent",
                        "partial-tail hand-offs of request %s disagree on the boundary; its tail "
                        "is not stored (the normal save goes on)",
                        save.req_id,
                    )
                # Keys only the tail names (hand-off states, a partial boundary block): the
                # next step cannot plan them again.
                normal = {key for key, _, _ in puts}
                tail_keys.update(key for key, _, _ in tail.puts if key not in normal)
                puts.extend(tail.puts)
                if depths is not None and tail.boundary is not None:
                    depths.update((key, int(tail.boundary)) for key, _, _ in tail.puts)
            req_id = save.req_id
            for (key, group, block_id), inside in zip(puts, self._entries_in_layout(puts)):
                if not inside:
                    self._bad_save_block(f"request {req_id}", (key, group, block_id))
                    failed.add(req_id)
                    continue
                waiting = owners.get(key)
                if waiting is None:
                    owners[key] = [req_id]
                    order = 0 if key in tail_keys else 1 if windowed[group] else 2
                    ordered.append((order, key, group, block_id))
                elif req_id not in waiting:
                    waiting.append(req_id)
        with self._lock:
            for save, state, end in zip(saves, states, ends):
                if save.req_id not in failed:
                    state.planned = max(state.planned, end)
        ordered.sort(key=lambda entry: entry[0])  # stable: group and block order within each
        entries = [(key, group, block_id) for _, key, group, block_id in ordered]
        if entries:
            present = [bool(p) for p in known([key for key, _, _ in entries])]
            if len(present) != len(entries):  # a short answer: put everything (puts are idempotent)
                present = [False] * len(entries)
            self.count("put_skipped_present", sum(present))
            entries = [e for e, p in zip(entries, present) if not p]
        return entries, owners, ends, failed, tail_keys

    def _starts(self, states) -> List[int]:
        with self._lock:
            return [state.planned for state in states]

    def request_states(self, req_ids: Sequence[str]) -> List["_RequestState"]:
        with self._lock:
            return [self._requests.setdefault(rid, _RequestState()) for rid in req_ids]

    def _stage_saves(self, job: _SaveJob) -> None:
        """Plan ``job``'s saves with the core, drop keys the store has (one existence call),
        and copy the remaining blocks into staging batch by batch, each handed to the save
        lane at once. While the pool is full, wait for staged batches to be put while the store
        keeps up (``_save_room_coming``); once it has stalled, defer the rest."""
        job.starts = self._starts(job.states)
        entries, job.owners, job.ends, job.failed, job.tail_keys = self._plan_saves(job.saves, job.states, self.store.exists)
        self._stage_entries(job, entries)

    def _stage_entries(self, job: _SaveJob, entries: List[Tuple[str, int, int]]) -> None:
        """Copy ``entries`` into staging batch by batch, each handed to the save lane at once
        (``_stage_saves``)."""
        start_time = time.perf_counter()
        deadline = time.monotonic() + self.staging_wait_s  # what the step waits for room in all

        def room_coming() -> bool:
            return self._save_room_coming() and time.monotonic() < deadline

        position = 0
        while position < len(entries):
            end, batch = self._stage_run(entries, position, "save", room_coming)
            if batch is None:
                if self._closed:
                    self._refuse(job, entries[position:])
                else:
                    self._defer(job, entries[position:])
                break
            try:
                staged = entries[position:end]
                urgent = bool(job.fenced_groups) and any(group not in job.fenced_groups for _, group, _ in staged)
                fence = self.transfer.gather(batch, digests=self._fused_digests, urgent=urgent)
                self._fence_unfenced(job, staged)
            except BaseException:
                self._release_batch(batch)
                raise
            with self._lock:  # the closed check and the enqueue are one step: no batch is lost
                refused = self._closed
                if not refused:
                    job.in_flight += 1
                    self._save_queue.put(_PutBatch(job, entries[position:end], batch, fence))
            if refused:
                self._release_batch(batch)
                self._refuse(job, entries[position:])
                break
            position = end
        self._time("save_stage", time.perf_counter() - start_time)

    def _save_room_coming(self) -> bool:
        """(Under the lock) Whether staged save batches will be released without the store
        stalling: puts are queued or running, and the running one began less than
        ``save_wait_s`` ago."""
        if self._closed or not self._save_queue.unfinished_tasks:
            return False
        started = self._put_started
        return started is None or time.monotonic() - started < self.save_wait_s

    def _refuse(self, job: _SaveJob, rest: List[Tuple[str, int, int]]) -> None:
        """Shut down while staging: nothing more of ``job`` may reach the store, so its
        requests, and the owners of ``rest`` (a planned job's), fail."""
        with self._lock:
            self.counters["refused_after_shutdown"] += len(job.saves)
            job.failed.update(save.req_id for save in job.saves)
            self._fail_owners(job, rest)

    def _defer(self, job: _SaveJob, rest: List[Tuple[str, int, int]]) -> None:
        """Leave ``rest`` to a later step: its requests plan those blocks again from their
        confirmed offset. Tail puts among them are lost (hand-off blocks are valid only in the
        step that offered them)."""
        self._log_once(
            "save-deferred",
            "kvstride: with the staging pool full, a store put ran longer than save_wait_s=%.1f s or the step "
            "waited staging_wait_s=%.1f s for room: this step's remaining saves are deferred (counted as "
            "saves_deferred); blocks a later step cannot save again (window blocks that left the window, partial "
            "tails) are lost",
            self.save_wait_s, self.staging_wait_s,
        )
        deferred = {rid for key, _, _ in rest for rid in job.owners[key]}
        tails_lost = {rid for key, _, _ in rest if key in job.tail_keys for rid in job.owners[key]}
        with self._lock:
            job.deferred |= deferred
            for save, state in zip(job.saves, job.states):
                if save.req_id in deferred:
                    state.planned = state.offset
            self.counters["saves_deferred"] += len(deferred)
            self.counters["tails_dropped"] += len(tails_lost)

    def _count_outcomes(self, op: str, entries, statuses, bytes_counter: str) -> None:
        """Count ``op``'s statuses (and the bytes of the OK ones) in one go; log each failure
        kind once."""
        block_bytes = self._block_bytes
        outcomes = collections.Counter(statuses)
        if outcomes[Status.OK] == len(statuses):
            moved = sum(block_bytes[group] for _, group, _ in entries)
        else:
            moved = 0
            for (key, group, _), status in zip(entries, statuses):
                if status is Status.OK:
                    moved += block_bytes[group]
                else:  # the first key of each kind of failure
                    self._log_once(f"{op}-{status.value}", "store %s failed (%s); first key %s", op, status.value, key)
        with self._lock:
            for status, n in outcomes.items():
                self.counters[f"{op}_{status.value}"] += n
            if moved:
                self.counters[bytes_counter] += moved

    def _count_puts(self, job: _SaveJob, entries, statuses) -> None:
        self._count_outcomes("put", entries, statuses, "bytes_stored")
        if not all(status is Status.OK for status in statuses):
            with self._lock:
                self._fail_owners(job, [entry for entry, status in zip(entries, statuses) if status is not Status.OK])

    @staticmethod
    def _fail_owners(job: _SaveJob, entries: List[Tuple[str, int, int]]) -> None:
        """(Under the lock) the requests (or planned job) owning ``entries``' keys fail."""
        job.failed.update(owner for key, _, _ in entries for owner in job.owners[key])

    def _save_direct(self, job: _SaveJob) -> None:
        """Plan ``job``'s saves and copy their blocks straight into the store."""
        job.starts = self._starts(job.states)
        entries, job.owners, job.ends, job.failed = self.plan_saves(job.saves, job.states, self.store.exists)
        self._put_direct(job, entries)

    def _put_direct(self, job: _SaveJob, entries: List[Tuple[str, int, int]]) -> None:
        """Copy ``entries`` straight into a store that copies blocks itself. Where its copies run
        on device streams and the caller fences some groups itself (``submit_planned``), the
        other groups' copies (first in ``entries``) are launched here, urgent, and the
        caller's stream waits for their reads; the fenced groups' copies go to the launch
        lane, so that the caller's thread only records an event for them."""
        apart: List[Tuple[str, int, int]] = []
        on_streams = bool(job.fenced_groups) and getattr(self.store, "copies_on_streams", False)
        if on_streams:
            split = next((i for i, (_, group, _) in enumerate(entries) if group in job.fenced_groups), len(entries))
            entries, apart = entries[:split], entries[split:]
        if entries:
            keys, groups, block_ids = zip(*entries)
            put_start = time.perf_counter()
            begin = getattr(self.store, "save_blocks_begin", None)
            if begin is None:
                started = self.store.save_blocks(keys, groups, block_ids)
            else:
                started = begin(keys, groups, block_ids, urgent=True) if on_streams else begin(keys, groups, block_ids)
            try:
                self._fence_unfenced(job, entries)
            finally:  # copies under way are waited for before the job reports, whatever happens
                self._finish_or_queue(job, entries, started, put_start)
        if apart:
            coming = self.layout.pending_reads.expect([block for _, _, block in apart])
            with self._lock:  # the closed check and the enqueue are one step: no launch is lost
                refused = self._closed
                if not refused:
                    job.in_flight += 1
                    self._launch_queue.put(_Launch(job, apart, self.store.caller_event(), coming))
            if refused:
                coming.done()
                self._refuse(job, apart)

    def _finish_or_queue(self, job: _SaveJob, entries, started, put_start: float) -> None:
        """Count a direct save's statuses, or hand its ``finish()`` (device copies still
        running) to the save lane."""
        if callable(started):
            with self._lock:
                job.in_flight += 1
            self._save_queue.put(_DirectFinish(job, list(entries), started, put_start))
            return
        statuses = self._statuses(started, len(entries))
        self._time("put", time.perf_counter() - put_start)
        self._count_puts(job, entries, statuses)

    def _launch(self, item: _Launch) -> None:
        """The launch lane: ``item``'s copies, after the caller's event, unless a fence cancelled
        them (their blocks are being written again: those saves fail, counted)."""
        entries, job, put_start = item.entries, item.job, time.perf_counter()
        started = None
        try:
            if item.coming.start():
                keys, groups, block_ids = zip(*entries)
                started = self.store.save_blocks_begin(keys, groups, block_ids, after=item.after)
            else:  # no store call was made: the job fails, nothing else counts these entries
                self.count("saves_cancelled_by_fence", len(entries))
                self._log_once("fence-cancel", "saves whose blocks were written again before their copies "
                               "were launched were cancelled (the launch lane is behind)")
                with self._lock:
                    self._fail_owners(job, entries)
        except Exception as err:  # never into the driver: fail these saves, keep going
            self._log_once("save-bug", "save job of step %d failed: %r", job.step, err)
            self.count("save_job_errors")
            started = [Status.ERROR] * len(entries)
        finally:
            item.coming.done()
        try:
            if started is not None:
                self._finish_or_queue(job, entries, started, put_start)
        finally:
            self._part_done(job)  # (a finish handed to the save lane counts itself)

    def _part_done(self, job: _SaveJob) -> None:
        """One of ``job``'s parts in flight ended: the job finishes with the last one, once its
        copies out of the KV cache are all started."""
        with self._lock:
            job.in_flight -= 1
            finished = not job.in_flight and not job.staging
        if finished:
            self._finish_saves(job)

    def _finish_direct(self, item: _DirectFinish) -> None:
        try:
            statuses = self._statuses(item.finish(), len(item.entries))
        except Exception as err:  # never into the driver: fail these saves, keep going
            self._log_once("save-bug", "save job of step %d failed: %r", item.job.step, err)
            self.count("save_job_errors")
            statuses = [Status.ERROR] * len(item.entries)
        self._time("put", time.perf_counter() - item.started)
        self._count_puts(item.job, item.entries, statuses)
        self._part_done(item.job)

    def _put(self, items: List[_PutBatch]) -> None:
        """One store call for ``items`` (``_next_items``), then each batch released and
        counted for its own job."""
        values, options = [], self._value_options()
        for item in items:
            item.fence.wait()
            values += self._store_values(item.batch)
        if self._fused_digests:
            options["digests"] = np.concatenate([item.batch.digests for item in items])
        keys = [key for item in items for key, _, _ in item.entries]
        put_start = time.perf_counter()
        statuses = self._statuses(self.store.put(keys, values, **options), len(keys))
        self._time("put", time.perf_counter() - put_start)
        position = 0
        for item in items:
            self._release_batch(item.batch)
            end = position + len(item.entries)
            self._count_puts(item.job, item.entries, statuses[position:end])
            position = end

    def _store_values(self, batch: StagedBatch) -> list:
        """The batch's values as the store takes them (``_value_options`` says how)."""
        return batch.value_parts() if self._headers_staged else batch.all_parts()

    def _value_options(self) -> dict:
        """The store call's options for ``_store_values``' values (a fresh dict)."""
        return {"header_room": True} if self._headers_staged else {}

    def _release_batch(self, batch: StagedBatch) -> None:
        """Give a staged batch's room back (once) and wake whoever waits for room."""
        if batch.release():
            with self._lock:
                self._releases += 1
                self._pool_freed.notify_all()

    def _finish_saves(self, job: _SaveJob) -> None:
        with self._lock:
            for save, state, start, end in zip(job.saves, job.states, job.starts, job.ends):
                self._finished.saves_done.add(save.req_id)
                if save.req_id in job.failed:
                    self._finished.saves_failed.add(save.req_id)
                    self.counters["saves_failed"] += 1
                    state.planned = state.offset  # the next save retries from what is stored
                elif save.req_id in job.deferred:  # planned already went back at deferral
                    self._finished.saves_deferred.add(save.req_id)
                else:
                    state.confirm(start, end)
                    self.counters["saves_ok"] += 1
            if job.job_id is not None:
                self._finished.jobs_done[job.job_id] = "failed" if job.failed else "deferred" if job.deferred else "ok"

    def _fetch(self, entries: List[Tuple[str, int, int]], job: _LoadJob):
        """Read ``entries`` into their destination blocks (only those whose status is OK are
        written; on CUDA after the event ``job.after``; nothing once ``job`` is past its
        deadline), as runs of (entries, statuses)."""
        after = job.after
        if self.direct:
            if entries:
                if not self._begin_scatter(job):
                    yield entries, [Status.UNAVAILABLE] * len(entries)
                    return
                try:
                    keys, groups, block_ids = zip(*entries)
                    get_start = time.perf_counter()
                    # Ordered after the caller's event alone: never through this lane's (legacy
                    # default) stream, which would queue the load behind a forward running there.
                    statuses = self._statuses(self.store.load_blocks(keys, groups, block_ids, after=after), len(keys))
                    self._time("get", time.perf_counter() - get_start)
                finally:
                    self._end_scatter(job)
                yield entries, statuses
            return

        def saves_hold_room() -> bool:  # only a pool without a load share is shared with saves
            return self._save_queue.unfinished_tasks > 0

        position = 0
        while position < len(entries):
            end, batch = self._stage_run(entries, position, "load", saves_hold_room)
            if batch is None:
                raise RuntimeError(f"no staging room for a load in the {self.pool.capacity}-byte pool")
            batch_entries = entries[position:end]
            try:
                keys = [key for key, _, _ in batch_entries]
                get_start = time.perf_counter()
                values, options = self._store_values(batch), self._value_options()
                if self._fused_digests:  # the store checks headers; the scatter checks bytes
                    expected = [0] * len(keys)
                    statuses = self._statuses(self.store.get(keys, values, digests_out=expected, **options), len(keys))
                    self._time("get", time.perf_counter() - get_start)
                    if self._begin_scatter(job):
                        try:
                            ok = [status is Status.OK for status in statuses]
                            self.transfer.scatter(batch, ok=ok, expected=expected, after=after).wait()
                        finally:
                            self._end_scatter(job)
                        bad = [i for i, (good, written) in enumerate(zip(ok, batch.verified)) if good and not written]
                        for i in bad:
                            statuses[i] = Status.CORRUPT
                        self.store.corrupt([keys[i] for i in bad])
                    else:  # past its deadline: its request recomputes, maybe in these blocks already
                        statuses = [Status.UNAVAILABLE] * len(keys)
                else:
                    statuses = self._statuses(self.store.get(keys, values, **options), len(keys))
                    self._time("get", time.perf_counter() - get_start)
                    if self._begin_scatter(job):
                        try:
                            self.transfer.scatter(batch, ok=[status is Status.OK for status in statuses], after=after).wait()
                        finally:
                            self._end_scatter(job)
                    else:  # past its deadline: its request recomputes, maybe in these blocks already
                        statuses = [Status.UNAVAILABLE] * len(keys)
            finally:
                self._release_batch(batch)
            yield batch_entries, statuses
            position = end

    def _load(self, job: _LoadJob) -> None:
        start_time = time.perf_counter()
        entries: List[Tuple[str, int, int]] = []
        owner: List[str] = []
        failed: Dict[str, set] = {}
        for load in job.loads:
            gets = None if job.planned is None else job.planned.get(load.req_id, [])
            if gets is None:
                plan = self.planner.plan_load(
                    load.block_hashes, load.block_ids, load.hit_tokens, local_tokens=load.local_tokens
                )
                if plan.missing:  # recomputed as a whole: nothing of it is fetched
                    self.count("load_missing_destination", len(plan.missing))
                    failed[load.req_id] = self._all_blocks(load)
                    continue
                gets = plan.gets
            for entry, inside in zip(gets, self._entries_in_layout(gets)):
                _, group, block_id = entry
                if not inside:
                    self.count("load_bad_block")
                    self._log_once("load-bad-block", "request %s: destination block %d of group %d is not in the KV cache", load.req_id, block_id, group)
                    failed.setdefault(load.req_id, set()).add((group, block_id))
                    continue
                entries.append(entry)
                owner.append(load.req_id)
        position = 0
        for batch_entries, statuses in self._fetch(entries, job):
            if job.abandoned:  # reported failed at its deadline: what it got since is not counted
                continue
            self._count_outcomes("get", batch_entries, statuses, "bytes_loaded")
            for i, ((key, group, block_id), status) in enumerate(zip(batch_entries, statuses)):
                if status is not Status.OK:
                    failed.setdefault(owner[position + i], set()).add((group, block_id))
            position += len(batch_entries)
        with self._lock:
            if not self._load_over(job):
                return
            for load, state in zip(job.loads, job.states):
                self._finished.loads_done.add(load.req_id)
                if load.req_id in failed:
                    self._finished.loads_failed[load.req_id] = failed[load.req_id]
                    self.count("loads_failed")
                else:
                    self.count("loads_ok")
                    if state is None:  # planned elsewhere: the planner's side keeps the offsets
                        continue
                    # The loaded prefix is in the store: this request's saves start after it.
                    # (The state captured at submit: a finished request's is detached.)
                    done_to = self.planner.saved_offset_after_load(load.hit_tokens)
                    state.confirm(0, done_to)
                    state.planned = max(state.planned, done_to)
        self._time("load_job", time.perf_counter() - start_time)
