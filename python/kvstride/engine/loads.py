"""The load lane: a load job's gets planned with the core (or elsewhere), read straight into KV blocks
(the arena) or through staging, nothing written once the job is past its deadline, and the deadline
itself.

A part of :class:`kvstride.engine.OffloadEngine`, which it is mixed into: the state it
reads and the helpers it calls are the engine's (``kvstride/engine/offload.py``)."""

from __future__ import annotations

import time
from typing import Dict, List, Tuple

from kvstride.engine.jobs import LoadRequest, _LoadJob
from kvstride.stores import Status


class Loads:
    """The load lane."""

    def _queue_load(self, job: _LoadJob) -> None:
        """(Under the lock) hand ``job`` to the load lane, with its deadline."""
        job.deadline = time.monotonic() + self.load_timeout_s
        self._loads_out.append(job)
        self._load_queue.put(job)

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

    @staticmethod
    def _all_blocks(load: LoadRequest) -> set:
        try:
            return {(g, int(b)) for g, table in enumerate(load.block_ids) for b in table if b}
        except Exception:  # a malformed table: report what can be read
            return set()

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
                    # (The state captured at submit: a finished request's is detached.)
                    state.loaded(self.planner, load.hit_tokens)
        self._time("load_job", time.perf_counter() - start_time)
