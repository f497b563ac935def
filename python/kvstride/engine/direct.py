"""Saves into a store that copies blocks itself (the embedded arena): copies launched on the caller's
thread where the caller's stream must wait for their reads, the others on the launch lane after an
event of the caller's stream.

A part of :class:`kvstride.engine.OffloadEngine`, which it is mixed into: the state it
reads and the helpers it calls are the engine's (``kvstride/engine/offload.py``)."""

from __future__ import annotations

import time
from typing import List, Tuple

from kvstride.engine.jobs import _DirectFinish, _Launch, _SaveJob
from kvstride.stores import Status


class DirectSaves:
    """Saves into a store that copies blocks itself (the embedded arena)."""

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
                self._wait_for_urgent_reads(job, entries)
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
