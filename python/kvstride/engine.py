"""The request-level offload engine: lookups, saves, partial tails and loads, executed through
the data plane on a background worker.

It knows nothing about vLLM's classes. A driver (the vLLM connector, or ``kvstride simulate``)
calls, per engine step:

- ``lookup(requests)`` on the scheduler side: one existence call for the whole batch of new
  requests, then each request's longest joint hit from the core;
- ``submit(saves, loads)``: queue the step's work; the worker plans it with the core (which
  keys, which blocks), executes loads first, then saves, and
- ``get_finished()``: which loads and saves completed, and the block ids whose load failed
  (the driver recomputes them).

Nothing raises into the driver's step at run time: store failures, divergent boundaries and
bugs inside a job become outcomes, counted and logged once. A request's saved offset advances
only after every put of its save succeeded; a load whose bytes might be wrong is never
scattered into a KV block.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from kvstride._core import KeyPlanner
from kvstride.stores import KVStore, Status
from kvstride.transfer import StagingPool, Transfer

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


class _RequestState:
    """A request's saved offset. A job captures the object at submit time, so a save that
    completes after ``finish_request`` updates a detached object (never a later request that
    reuses the id, and never a leaked entry)."""

    __slots__ = ("offset",)

    def __init__(self) -> None:
        self.offset = 0


@dataclass
class _Job:
    step: int
    saves: List[SaveRequest]
    loads: List[LoadRequest]
    states: List[_RequestState] = field(default_factory=list)  # one per save


_STOP = object()

#: Durations kept per operation for percentiles.
TIMINGS_KEPT = 10_000


class OffloadEngine:
    """Drives one rank's offloading through ``planner`` (the core), ``transfer`` (torch copies
    between the KV tensors and a staging pool) and ``store``."""

    def __init__(
        self,
        planner: KeyPlanner,
        transfer: Transfer,
        store: KVStore,
        *,
        name: str = "kvstride-engine",
    ) -> None:
        self.planner = planner
        self.transfer = transfer
        self.pool: StagingPool = transfer.pool
        self.store = store
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
        self._queue: "queue.Queue" = queue.Queue()
        self._step = 0
        self._closed = False
        self._worker = threading.Thread(target=self._run, name=name, daemon=True)
        self._worker.start()

    # ---- bookkeeping ---------------------------------------------------------------------

    def _log_once(self, what: str, message: str, *args) -> None:
        with self._lock:
            if what in self._logged:
                return
            self._logged.add(what)
        log.warning(message, *args)

    def _count(self, name: str, n: int = 1) -> None:
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
        """Forget a finished or preempted request (its next save starts from 0). Save jobs of
        it still queued run, but no longer move any offset."""
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

    def lookup(self, requests: Sequence[Tuple[str, Sequence[bytes], int]]) -> Dict[str, int]:
        """Longest joint hit per request, from one existence call for the whole batch. After
        ``shutdown`` every request misses and the store is not called."""
        with self._lock:
            if self._closed:
                self._count("lookups_refused", len(requests))
                return {req_id: 0 for req_id, _, _ in requests}
            self._lookups_in_flight += 1
        try:
            return self._lookup(requests)
        finally:
            with self._lock:
                self._lookups_in_flight -= 1
                self._idle.notify_all()

    def _lookup(self, requests) -> Dict[str, int]:
        start = time.perf_counter()
        per_request = []
        unique: Dict[str, int] = {}
        for req_id, hashes, num_tokens in requests:
            try:
                keys = self.planner.lookup_keys(hashes, num_tokens)
            except Exception as err:  # a malformed request misses; the others go on
                self._log_once("lookup-request", "lookup of request %s refused: %r", req_id, err)
                self._count("lookup_errors")
                keys = None
            per_request.append((req_id, hashes, num_tokens, keys))
            for key in keys or ():
                unique.setdefault(key, len(unique))
        present = [False] * len(unique)
        if unique:
            try:
                present = [bool(p) for p in self.store.exists(list(unique))]
                if len(present) != len(unique):
                    raise RuntimeError(f"exists answered {len(present)} of {len(unique)} keys")
            except Exception as err:  # the store's own failures are statuses; this is a bug
                self._log_once("lookup", "lookup failed, treating every request as a miss: %r", err)
                self._count("lookup_errors")
                present = [False] * len(unique)
        hits = {}
        for req_id, hashes, num_tokens, keys in per_request:
            if keys is None:
                hits[req_id] = 0
                continue
            bitmap = [present[unique[k]] for k in keys]
            hits[req_id] = self.planner.longest_hit_bitmap(hashes, num_tokens, bitmap)
        with self._lock:
            self.counters["lookups"] += len(per_request)
            self.counters["lookup_hit_tokens"] += sum(hits.values())
            self.counters["lookup_tokens"] += sum(n for _, _, n, _ in per_request)
        self._count("lookup_keys", len(unique))
        self._time("lookup", time.perf_counter() - start)
        return hits

    # ---- worker side ---------------------------------------------------------------------

    def submit(self, saves: Sequence[SaveRequest] = (), loads: Sequence[LoadRequest] = ()) -> int:
        """Queue one step's loads and saves; returns the step number. After ``shutdown`` the
        work is refused: loads are reported failed, saves not done."""
        saves, loads = list(saves), list(loads)
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
            states = [self._requests.setdefault(save.req_id, _RequestState()) for save in saves]
            self._queue.put(_Job(step, saves, loads, states))
        return step

    def get_finished(self) -> Finished:
        with self._lock:
            done, self._finished = self._finished, Finished()
        return done

    def wait_idle(self, timeout: Optional[float] = None) -> bool:
        """Block until every submitted job ran; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    def shutdown(self, timeout: Optional[float] = 60.0) -> bool:
        """Run every queued job, then stop the worker. The store stays open (its owner closes
        it) and is never called again by this engine. True when the worker drained in time."""
        with self._lock:
            if self._closed:
                already = True
            else:
                already = False
                self._closed = True
                self._queue.put(_STOP)
            deadline = None if timeout is None else time.monotonic() + timeout
            while self._lookups_in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                self._idle.wait(left)
        if not already:
            self._worker.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self._worker.is_alive() and not self._lookups_in_flight

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is _STOP:
                    return
                self._execute(job)
            except Exception as err:  # the job's own error reporting failed: keep the worker
                self._log_once("worker-bug", "job of step %d could not be reported: %r", job.step, err)
                self._count("worker_errors")
            finally:
                self._queue.task_done()

    def _execute(self, job: _Job) -> None:
        try:
            if job.loads:
                self._load(job.loads)
        except Exception as err:  # never into the driver: fail the loads, keep going
            self._log_once("load-bug", "load job of step %d failed: %r", job.step, err)
            self._count("load_job_errors")
            with self._lock:
                for load in job.loads:
                    self._finished.loads_done.add(load.req_id)
                    self._finished.loads_failed[load.req_id] = self._all_blocks(load)
        try:
            if job.saves:
                self._save(job.saves, job.states)
        except Exception as err:
            self._log_once("save-bug", "save job of step %d failed: %r", job.step, err)
            self._count("save_job_errors")
            with self._lock:
                for save in job.saves:
                    self._finished.saves_done.add(save.req_id)
                    self._finished.saves_failed.add(save.req_id)

    @staticmethod
    def _all_blocks(load: LoadRequest) -> set:
        try:
            return {(g, int(b)) for g, table in enumerate(load.block_ids) for b in table if b}
        except Exception:  # a malformed table: report what can be read
            return set()

    def _in_layout(self, group: int, block_id: int) -> bool:
        groups = self.transfer.layout.groups
        return 0 <= group < len(groups) and 0 < block_id < groups[group].num_blocks

    # Stage, copy and store / load entries in pool-sized batches.
    def _batches(self, entries: List[Tuple[str, int, int]]):
        """Split ``(key, group, block_id)`` entries into runs that fit the staging pool."""
        start = 0
        while start < len(entries):
            end = len(entries)
            while True:
                batch = self.transfer.stage([(g, b) for _, g, b in entries[start:end]])
                if batch is not None:
                    break
                if end - start == 1:
                    raise RuntimeError(
                        f"one block does not fit the {self.pool.capacity}-byte staging pool"
                    )
                end = start + (end - start) // 2
            yield entries[start:end], batch
            start = end

    def _save(self, saves: List[SaveRequest], states: Optional[List[_RequestState]] = None) -> None:
        start_time = time.perf_counter()
        planner = self.planner
        if states is None:
            with self._lock:
                states = [self._requests.setdefault(s.req_id, _RequestState()) for s in saves]
        owners: Dict[str, List[str]] = {}  # key -> req ids waiting for it
        entries: List[Tuple[str, int, int]] = []
        ends: Dict[int, int] = {}  # index into saves -> end
        failed: set = set()
        for index, (save, state) in enumerate(zip(saves, states)):
            with self._lock:
                offset = state.offset
            plan = planner.plan_save(save.block_hashes, save.block_ids, save.num_tokens, saved_offset=offset)
            ends[index] = plan.end
            puts = list(plan.puts)
            if save.handoffs:
                tail = planner.plan_tail(save.block_hashes, save.block_ids, save.handoffs, saved_offset=offset)
                self._count(f"tail_{tail.outcome}")
                if tail.outcome == "divergent_boundaries":
                    self._log_once(
                        "divergent",
                        "partial-tail hand-offs of request %s disagree on the boundary; its tail "
                        "is not stored (the normal save goes on)",
                        save.req_id,
                    )
                puts.extend(tail.puts)
            for key, group, block_id in puts:
                if not self._in_layout(group, block_id):  # a table naming blocks we do not have
                    self._count("save_bad_block")
                    self._log_once("save-bad-block", "request %s: block %d of group %d is not in the KV cache", save.req_id, block_id, group)
                    failed.add(save.req_id)
                    continue
                if key not in owners:
                    owners[key] = []
                    entries.append((key, group, block_id))
                if save.req_id not in owners[key]:
                    owners[key].append(save.req_id)
        if entries:
            present = [bool(p) for p in self.store.exists([key for key, _, _ in entries])]
            if len(present) != len(entries):  # a short answer: put everything (puts are idempotent)
                present = [False] * len(entries)
            self._count("put_skipped_present", sum(present))
            entries = [e for e, p in zip(entries, present) if not p]
        for batch_entries, batch in self._batches(entries):
            try:
                self.transfer.gather(batch).wait()
                keys = [key for key, _, _ in batch_entries]
                put_start = time.perf_counter()
                statuses = self._statuses(self.store.put(keys, batch.all_parts()), len(keys))
                self._time("put", time.perf_counter() - put_start)
            finally:
                batch.release()
            for (key, group, _), status in zip(batch_entries, statuses):
                if status is Status.OK:
                    self._count("put_ok")
                    self._count("bytes_stored", self.transfer.layout.block_bytes(group))
                else:
                    self._count(f"put_{status.value}")
                    self._log_once(f"put-{status.value}", "store put failed (%s); first key %s", status.value, key)
                    failed.update(owners[key])
        with self._lock:
            for index, (save, state) in enumerate(zip(saves, states)):
                self._finished.saves_done.add(save.req_id)
                if save.req_id in failed:
                    self._finished.saves_failed.add(save.req_id)
                    self.counters["saves_failed"] += 1
                else:
                    state.offset = max(state.offset, ends[index])
                    self.counters["saves_ok"] += 1
        self._time("save_job", time.perf_counter() - start_time)

    def _load(self, loads: List[LoadRequest]) -> None:
        start_time = time.perf_counter()
        entries: List[Tuple[str, int, int]] = []
        owner: List[str] = []
        failed: Dict[str, set] = {}
        for load in loads:
            plan = self.planner.plan_load(
                load.block_hashes, load.block_ids, load.hit_tokens, local_tokens=load.local_tokens
            )
            if plan.missing:  # recomputed as a whole: nothing of it is fetched
                self._count("load_missing_destination", len(plan.missing))
                failed[load.req_id] = self._all_blocks(load)
                continue
            for entry in plan.gets:
                _, group, block_id = entry
                if not self._in_layout(group, block_id):
                    self._count("load_bad_block")
                    self._log_once("load-bad-block", "request %s: destination block %d of group %d is not in the KV cache", load.req_id, block_id, group)
                    failed.setdefault(load.req_id, set()).add((group, block_id))
                    continue
                entries.append(entry)
                owner.append(load.req_id)
        position = 0
        for batch_entries, batch in self._batches(entries):
            try:
                keys = [key for key, _, _ in batch_entries]
                get_start = time.perf_counter()
                statuses = self._statuses(self.store.get(keys, batch.all_parts()), len(keys))
                self._time("get", time.perf_counter() - get_start)
                ok = [status is Status.OK for status in statuses]
                self.transfer.scatter(batch, ok=ok).wait()
            finally:
                batch.release()
            for i, ((key, group, block_id), status) in enumerate(zip(batch_entries, statuses)):
                req_id = owner[position + i]
                if status is Status.OK:
                    self._count("get_ok")
                    self._count("bytes_loaded", self.transfer.layout.block_bytes(group))
                else:
                    self._count(f"get_{status.value}")
                    self._log_once(f"get-{status.value}", "store get failed (%s); first key %s", status.value, key)
                    failed.setdefault(req_id, set()).add((group, block_id))
            position += len(batch_entries)
        with self._lock:
            for load in loads:
                self._finished.loads_done.add(load.req_id)
                if load.req_id in failed:
                    self._finished.loads_failed[load.req_id] = failed[load.req_id]
                    self._count("loads_failed")
                else:
                    self._count("loads_ok")
        self._time("load_job", time.perf_counter() - start_time)
