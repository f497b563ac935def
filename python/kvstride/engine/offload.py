"""The engine that orchestrates one rank's offloading (see the package's docstring); its roles are
mixed in from their modules."""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import logging
import queue
import threading
import time
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from kvstride._core import KeyPlanner
from kvstride.engine.direct import DirectSaves
from kvstride.engine.jobs import (
    _STOP,
    Finished,
    LoadRequest,
    SaveRequest,
    _DirectFinish,
    _Launch,
    _LoadJob,
    _RequestState,
    _SaveJob,
)
from kvstride.engine.loads import Loads
from kvstride.engine.lookups import Lookups
from kvstride.engine.planning import SavePlanning
from kvstride.engine.settings import (
    DEFAULT_LOAD_TIMEOUT_S,
    DEFAULT_LOOKUP_TIMEOUT_S,
    DEFAULT_PUT_LINGER_S,
    DEFAULT_SAVE_WAIT_S,
    DEFAULT_STAGING_WAIT_S,
    TIMINGS_KEPT,
    check_load_timeout,
    check_lookup_timeout,
    check_put_linger,
    check_save_wait,
    check_staging_wait,
)
from kvstride.engine.staged import StagedSaves
from kvstride.layout import KVLayout
from kvstride.stores import KVStore, Status
from kvstride.transfer import StagingPool, Transfer

log = logging.getLogger("kvstride.engine")


class OffloadEngine(Lookups, SavePlanning, DirectSaves, StagedSaves, Loads):
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
        tails: Optional[Dict[int, Iterable[str]]] = None,
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
        are copied first.

        ``tails``: per save job, the keys only a partial tail names, counted in ``tails_dropped``
        when a deferral leaves them to a later step (which cannot save them)."""
        puts, gets, tails = dict(puts or {}), dict(gets or {}), dict(tails or {})
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
            job = _SaveJob(step, [], [], [], job_id=job_id, fenced_groups=fenced, tail_keys=set(tails.get(job_id, ())))
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

    def _wait_for_urgent_reads(self, job: _SaveJob, entries: List[Tuple[str, int, int]]) -> None:
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

    def get_finished(self) -> Finished:
        with self._lock:
            self._expire_loads()
            done, self._finished = self._finished, Finished()
        return done

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

    def _refuse(self, job: _SaveJob, rest: List[Tuple[str, int, int]]) -> None:
        """Shut down while staging: nothing more of ``job`` may reach the store, so its
        requests, and the owners of ``rest`` (a planned job's), fail."""
        with self._lock:
            self.counters["refused_after_shutdown"] += len(job.saves)
            job.failed.update(save.req_id for save in job.saves)
            self._fail_owners(job, rest)

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

    def _finish_saves(self, job: _SaveJob) -> None:
        with self._lock:
            for save, state, start, end in zip(job.saves, job.states, job.starts, job.ends):
                self._finished.saves_done.add(save.req_id)
                if save.req_id in job.failed:
                    self._finished.saves_failed.add(save.req_id)
                    self.counters["saves_failed"] += 1
                    state.save_ended(start, end, ok=False)
                elif save.req_id in job.deferred:  # planned already went back at deferral
                    self._finished.saves_deferred.add(save.req_id)
                else:
                    state.save_ended(start, end, ok=True)
                    self.counters["saves_ok"] += 1
            if job.job_id is not None:
                self._finished.jobs_done[job.job_id] = "failed" if job.failed else "deferred" if job.deferred else "ok"
