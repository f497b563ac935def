"""The disk tier's read admission, on vLLM's scheduler: whether a lookup may claim keys that
only the disk holds, weighing their reads against what vLLM would take to compute their tokens.
A disk far slower than the model then serves the hits it can, and the rest are computed instead
of waited for (``disk_hits_declined``). No bytes and no keys live here: the placement tells it
which reads begin and end, the workers how long their reads took, the scheduler each step."""

from __future__ import annotations

import collections
import statistics
import time
from typing import Callable, Optional

__all__ = ["ComputePace", "DiskReadAdmission", "DISK_READ_PACE_STALE_S", "DISK_READ_SLOWER", "DISK_READ_CLAIMED_S",
           "DISK_READ_DEADLINE_MIN_S"]

#: A lookup claims keys on disk only while reading them, behind the reads in flight at the
#: disk's measured read pace, takes at most this many times what vLLM would take to compute
#: their tokens: a read a little slower than the compute still spares it for other requests;
#: one far slower only makes the request wait.
DISK_READ_SLOWER = 4.0
#: Reads expected to end within this long are claimed whatever vLLM's pace: a step or two of
#: waiting that spares the compute (a small model on a fast CPU computes faster than any disk).
DISK_READ_CLAIMED_S = 0.05
#: A load's reads from disk that take longer than ``DISK_READ_SLOWER`` times computing its
#: tokens, and longer than this, are given up: the request recomputes (a read stalled behind a
#: busy drive's writes would otherwise hold it until ``load_timeout_s``).
DISK_READ_DEADLINE_MIN_S = 2.0
#: The read pace is the median of the workers' last ``DISK_PACES_KEPT`` reports of their read
#: lanes (one read that stalled, as a loop device or a busy drive does now and then, does not set
#: it). Before the first read, and after this many seconds without one (a disk slow for a while
#: is not written off), one load at a time measures it: unless the write-through's pace on the
#: same disk (measured all along, and seldom faster than its reads) says that load would not be
#: claimed either, so that no request waits on a slow disk only to measure it.
DISK_READ_PACE_STALE_S = 5.0
DISK_PACES_KEPT = 16


class ComputePace:
    """How fast vLLM computes prompt tokens, measured between the scheduler's steps: the tokens
    of steps that computed a prompt chunk over the time until the next step, decayed by
    ``DECAY`` a step. A gap far longer than the steps so far (the engine was idle) says nothing."""

    DECAY = 0.1
    IDLE_GAP = 4.0  # times the mean step: longer is idle time, not compute

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._last: Optional[float] = None
        self._last_tokens = 0  # prompt-chunk steps only: 0 for a decode-only step
        self._tokens = 0.0
        self._seconds = 0.0
        self._steps = 0.0

    def step(self, scheduled_tokens: int, scheduled_requests: int) -> None:
        """A scheduler step begins with these scheduled (more tokens than requests: a prompt chunk)."""
        now = self.clock()
        if self._last is not None and self._last_tokens:
            took = now - self._last
            mean = self._seconds / self._steps if self._steps else None
            if mean is None or took <= max(1.0, self.IDLE_GAP * mean):
                keep = 1.0 - self.DECAY
                self._tokens = self._tokens * keep + self._last_tokens
                self._seconds = self._seconds * keep + took
                self._steps = self._steps * keep + 1.0
        self._last = now
        self._last_tokens = scheduled_tokens if scheduled_tokens > scheduled_requests else 0

    def seconds(self, tokens: int) -> Optional[float]:
        """What computing ``tokens`` takes at the measured pace (None before any prompt step)."""
        if self._tokens <= 0:
            return None
        return tokens * self._seconds / self._tokens


class DiskReadAdmission:
    """The paces the workers report, the reads in flight, and vLLM's prompt pace: one
    decision, ``claims``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.compute_pace = ComputePace(clock)
        self._in_flight = 0  # records loads are reading from disk
        self._changed_at = clock()  # when that last changed
        # Seconds a record, of the workers' reads and of their writes.
        self._read_paces: "collections.deque[float]" = collections.deque(maxlen=DISK_PACES_KEPT)
        self._write_paces: "collections.deque[float]" = collections.deque(maxlen=DISK_PACES_KEPT)

    def claims(self, records: int, tokens: int) -> bool:
        """Whether a load may read ``records`` more from disk instead of computing ``tokens``."""
        return self.admits(records, self.compute_pace.seconds(tokens))

    def admits(self, records: int, compute_seconds: Optional[float]) -> bool:
        """Whether ``records`` read behind the reads in flight, at the disk's read pace, end
        within ``DISK_READ_SLOWER`` times ``compute_seconds`` (None: not known yet, admitted)
        or within ``DISK_READ_CLAIMED_S``. With no fresh read pace, one load at a time measures
        it, unless at the write-through's pace it would not end in that time either."""
        if compute_seconds is None:
            return self._in_flight == 0 or bool(self._read_paces and not self._stale())
        bound = max(DISK_READ_SLOWER * compute_seconds, DISK_READ_CLAIMED_S)
        if self._read_paces and not self._stale():
            return (self._in_flight + records) * statistics.median(self._read_paces) <= bound
        if self._in_flight:
            return False
        return not self._write_paces or records * statistics.median(self._write_paces) <= bound

    def _stale(self) -> bool:
        return self._in_flight == 0 and self.clock() - self._changed_at >= DISK_READ_PACE_STALE_S

    def read_deadline(self, tokens: int) -> Optional[float]:
        """How long a load's reads from disk may take, sparing the compute of ``tokens``,
        before its request recomputes instead (None: vLLM's pace not known yet)."""
        seconds = self.compute_pace.seconds(tokens)
        return None if seconds is None else max(DISK_READ_SLOWER * seconds, DISK_READ_DEADLINE_MIN_S)

    def prompt_step(self, scheduled_tokens: int, scheduled_requests: int) -> None:
        """A scheduler step begins (:meth:`ComputePace.step`)."""
        self.compute_pace.step(scheduled_tokens, scheduled_requests)

    def timed(self, read: int, read_seconds: float, written: int = 0, write_seconds: float = 0.0) -> None:
        """The workers read ``read`` records in ``read_seconds`` of their read lanes and wrote
        ``written`` in ``write_seconds`` of their write lanes (summed over ranks, each its own
        shard): the disk's paces, without the steps a job waits to be reported. A report of
        jobs that all failed counts as one record."""
        if read_seconds > 0:
            self._read_paces.append(read_seconds / max(1, read))
        if write_seconds > 0:
            self._write_paces.append(write_seconds / max(1, written))

    def reads_change(self, records: int) -> None:
        """Reads of ``records`` begin (> 0) or end (< 0)."""
        if records > 0 and self._stale():  # a new measure: what was measured before is gone
            self._read_paces.clear()
        self._in_flight += records
        self._changed_at = self.clock()
