"""Saves through the staging pool (Mooncake): batches gathered into staging while the store keeps up,
deferred once it stalls, put by the save lane in store calls that linger for more; the pool's room,
which loads through it share.

A part of :class:`kvstride.engine.OffloadEngine`, which it is mixed into: the state it
reads and the helpers it calls are the engine's (``kvstride/engine/offload.py``)."""

from __future__ import annotations

import queue
import time
from typing import List, Tuple

import numpy as np

from kvstride.engine.jobs import _PutBatch, _SaveJob
from kvstride.engine.settings import LINGER_MAX_STEPS, LINGER_ROOM_SHARE, PUT_KEYS_PER_CALL, _ROOM_CHECK_S
from kvstride.transfer import StagedBatch


class StagedSaves:
    """Saves through the staging pool (Mooncake)."""

    def _stage_saves(self, job: _SaveJob) -> None:
        """Plan ``job``'s saves with the core, drop keys the store has (one existence call),
        and copy the remaining blocks into staging batch by batch, each handed to the save
        lane at once. While the pool is full, wait for staged batches to be put while the store
        keeps up (``_save_room_coming``); once it has stalled, defer the rest."""
        job.starts = self._starts(job.states)
        entries, job.owners, job.ends, job.failed = self.plan_saves(job.saves, job.states, self.store.exists,
                                                                    tail_keys=job.tail_keys)
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
                copied = self.transfer.gather(batch, digests=self._fused_digests, urgent=urgent)
                self._wait_for_urgent_reads(job, staged)
            except BaseException:
                self._release_batch(batch)
                raise
            with self._lock:  # the closed check and the enqueue are one step: no batch is lost
                refused = self._closed
                if not refused:
                    job.in_flight += 1
                    self._save_queue.put(_PutBatch(job, entries[position:end], batch, copied))
            if refused:
                self._release_batch(batch)
                self._refuse(job, entries[position:])
                break
            position = end
        self._time("save_stage", time.perf_counter() - start_time)

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

    def _save_room_coming(self) -> bool:
        """(Under the lock) Whether staged save batches will be released without the store
        stalling: puts are queued or running, and the running one began less than
        ``save_wait_s`` ago."""
        if self._closed or not self._save_queue.unfinished_tasks:
            return False
        started = self._put_started
        return started is None or time.monotonic() - started < self.save_wait_s

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

    def _put(self, items: List[_PutBatch]) -> None:
        """One store call for ``items`` (``_next_items``), then each batch released and
        counted for its own job."""
        values, options = [], self._value_options()
        for item in items:
            item.copied.wait()
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
