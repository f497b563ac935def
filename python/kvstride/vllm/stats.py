"""vLLM stats for the kvstride connector: what :class:`kvstride.engine.OffloadEngine` counted,
shipped the way vLLM 0.32 ships connector stats, logged in its periodic "KV Transfer metrics"
line and exported to Prometheus.

How vLLM moves them:

- every step, each worker's connector and the scheduler's connector return
  ``get_kv_connector_stats()``: :func:`stats_delta` of their own engine (None when nothing
  changed: the worker's output then stays empty);
- the workers' stats are pickled to the engine core, summed across workers
  (``KVOutputAggregator``), then summed with the scheduler's (``Scheduler.update_from_output``);
- the sum's ``data`` travels in ``SchedulerStats.kv_connector_stats`` (msgpack) to the front
  end, where ``KVConnectorLogging`` rebuilds it with ``build_kv_connector_stats(data)``, sums
  the steps of a log interval and logs their ``reduce()``, and :class:`KVStridePromMetrics`
  adds each step's ``data`` to its counters.

So ``data`` is flat, ``{name: int | float}``, and holds only the names whose delta is not 0.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, Mapping, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["KVStrideStats", "KVStridePromMetrics", "stats_delta", "Outcomes"]

log = logging.getLogger("kvstride.vllm")

#: Stats name -> the engine counter it is the delta of.
COUNTED = {
    "lookups": "lookups",
    "lookup_hit_tokens": "lookup_hit_tokens",
    "lookup_tokens": "lookup_tokens",
    "bytes_loaded": "bytes_loaded",
    "bytes_stored": "bytes_stored",
    "puts_skipped_present": "put_skipped_present",
    "saves_deferred": "saves_deferred",
}
#: The same for what moves only with the embedded store's disk tier, or when something is off:
#: in the log line only when it moved.
SHOWN_WHEN_MOVED = {
    "loads_from_disk": "loads_from_disk",
    "disk_bytes_written": "disk_bytes_written",
    "disk_bytes_read": "disk_bytes_read",
    "lookups_store_disabled": "lookups_store_disabled",
    "requests_unbound": "requests_unbound",
    "pinned_bytes": "pinned_bytes",
    "disk_writes_skipped": "disk_writes_skipped",
    "disk_hits_declined": "disk_hits_declined",
    "save_jobs_reported_late": "save_jobs_reported_late",
}
#: Stats name -> the engine operation whose total seconds it is the delta of (store calls).
TIMED = {"load_seconds": "get", "save_seconds": "put"}
#: The same for the connector's hooks on vLLM's scheduler thread and in its workers' steps
#: (every rank's): what kvstride costs the step; in the log line only when it moved.
HOOK_SECONDS = {"scheduler_seconds": "scheduler_hooks", "worker_step_seconds": "worker_hooks"}
#: Failures are "failed:<engine counter>": every store outcome of a get or put but these...
SUCCESSES = frozenset({"get_ok", "put_ok", "put_skipped_present"})
#: ...and these engine counters.
FAILURE_COUNTERS = frozenset(
    {"loads_failed", "loads_timed_out", "lookup_timeouts", "saves_failed", "load_job_errors", "save_job_errors",
     "lookup_errors", "mac_rejected", "disk_write_errors", "disk_read_errors", "disk_records_rejected", "disk_short_writes",
     "disk_loads_failed", "disk_reads_timed_out", "saves_cancelled_by_fence", "store_disabled", "fence_errors",
     "disk_write_jobs_given_up", "save_jobs_abandoned"}
)
FAILED = "failed:"


def _is_failure(counter: str) -> bool:
    if counter in FAILURE_COUNTERS:
        return True
    return counter.startswith(("get_", "put_")) and counter not in SUCCESSES


@dataclass
class KVStrideStats(KVConnectorStats):
    """Deltas of an engine's counters over a step or a log interval: ``data`` maps names of
    :data:`COUNTED`, :data:`TIMED`, :data:`HOOK_SECONDS` and ``"failed:<engine counter>"`` to numbers (plain str
    keys and numbers: pickled from the workers, msgpack-encoded to the front end)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVStrideStats:
        assert isinstance(other, KVStrideStats)
        # A new object: the dict vLLM wraps in build_kv_connector_stats is the one it also
        # passes to Prometheus, so it is never summed into.
        summed = dict(self.data)
        for name, value in other.data.items():
            summed[name] = summed.get(name, 0) + value
        return KVStrideStats(data=summed)

    def reduce(self) -> Dict[str, int | float]:
        """Every counted name (0 included, for a stable log line), the disk tier's when it
        moved bytes, the hit rate, seconds rounded to ms, then the failures that occurred."""
        summary: Dict[str, int | float] = {name: self.data.get(name, 0) for name in COUNTED}
        summary.update((name, self.data[name]) for name in SHOWN_WHEN_MOVED if self.data.get(name))
        if summary["lookup_tokens"]:
            summary["lookup_hit_rate"] = round(summary["lookup_hit_tokens"] / summary["lookup_tokens"], 3)
        summary.update((name, round(self.data.get(name, 0.0), 3)) for name in TIMED)
        summary.update((name, round(self.data[name], 3)) for name in HOOK_SECONDS if self.data.get(name))
        summary.update(sorted((name, n) for name, n in self.data.items() if name.startswith(FAILED)))
        return summary

    def is_empty(self) -> bool:
        return not any(self.data.values())


def stats_delta(
    counters: Mapping[str, int], seconds: Mapping[str, float], last: Dict[str, int | float]
) -> Optional[KVStrideStats]:
    """What the engine's cumulative ``counters`` and ``seconds`` gained since the totals in
    ``last`` (updated to the current ones); None when nothing did."""
    # Snapshots in one C call each: the engine's lanes keep counting on other threads.
    counters, seconds = dict(counters), dict(seconds)
    totals: Dict[str, int | float] = {name: counters.get(counter, 0) for name, counter in {**COUNTED, **SHOWN_WHEN_MOVED}.items()}
    totals.update((name, seconds.get(operation, 0.0)) for name, operation in {**TIMED, **HOOK_SECONDS}.items())
    totals.update((FAILED + counter, n) for counter, n in counters.items() if _is_failure(counter))
    data: Dict[str, int | float] = {}
    for name, total in totals.items():
        previous = last.get(name, 0)
        # Below the last total, the engine was replaced and its counters restarted at 0 (a
        # negative delta would also make Prometheus' Counter.inc raise in vLLM's output loop).
        delta = total - previous if total >= previous else total
        if delta:
            data[name] = delta
        last[name] = total
    return KVStrideStats(data=data) if data else None


#: Prometheus counters: stats name -> (series, documentation). vLLM's "vllm:" prefix, because
#: its stat logger unregisters only "vllm:" collectors before registering them again (a
#: second engine in one process would otherwise fail on duplicated series).
SERIES = {
    "lookups": ("vllm:kvstride_lookups", "Requests looked up in the kvstride store."),
    "lookup_hit_tokens": ("vllm:kvstride_lookup_hit_tokens", "Prompt tokens the kvstride store had."),
    "lookup_tokens": ("vllm:kvstride_lookup_tokens", "Prompt tokens looked up in the kvstride store."),
    "bytes_loaded": ("vllm:kvstride_bytes_loaded", "Bytes loaded from the kvstride store into the KV cache."),
    "bytes_stored": ("vllm:kvstride_bytes_stored", "Bytes saved from the KV cache to the kvstride store."),
    "load_seconds": ("vllm:kvstride_load_seconds", "Seconds spent in kvstride store gets."),
    "save_seconds": ("vllm:kvstride_save_seconds", "Seconds spent in kvstride store puts."),
    "scheduler_seconds": (
        "vllm:kvstride_scheduler_seconds",
        "Seconds the scheduler's thread spent in the kvstride connector (lookups, metadata, finished requests).",
    ),
    "worker_step_seconds": (
        "vllm:kvstride_worker_step_seconds",
        "Seconds the workers' steps spent in the kvstride connector (load starts, save waits, results), "
        "summed over ranks.",
    ),
    "puts_skipped_present": (
        "vllm:kvstride_puts_skipped_present",
        "Blocks not put because the kvstride store already had them.",
    ),
    "saves_deferred": (
        "vllm:kvstride_saves_deferred",
        "Request saves left to the request's next step because the store stalled with the staging pool full.",
    ),
    "lookups_store_disabled": (
        "vllm:kvstride_lookups_store_disabled",
        "Requests not looked up (a miss) because a worker's store was disabled.",
    ),
    "requests_unbound": (
        "vllm:kvstride_requests_unbound",
        "Requests neither loaded nor stored: their LoRA adapter or multimodal content could not be read.",
    ),
    "pinned_bytes": (
        "vllm:kvstride_pinned_bytes",
        "Host memory page-locked for the device's copies (the arena's slots or the staging pool), every rank.",
    ),
    "disk_writes_skipped": (
        "vllm:kvstride_disk_writes_skipped",
        "Values left in memory only because the disk tier could not keep up with the saves.",
    ),
    "save_jobs_reported_late": (
        "vllm:kvstride_save_jobs_reported_late",
        "Save jobs given up (failures outcome save_jobs_abandoned) that every rank reported later: "
        "the arena slots they held are free again.",
    ),
    "loads_from_disk": ("vllm:kvstride_loads_from_disk", "Loads that read some blocks from the disk tier."),
    "disk_hits_declined": (
        "vllm:kvstride_disk_hits_declined",
        "Lookups that claimed only what memory held: reading the rest from the disk tier was expected to take "
        "over 4 times as long as computing it, and over 50 ms.",
    ),
    "disk_bytes_written": ("vllm:kvstride_disk_bytes_written", "Bytes written to the disk tier's records."),
    "disk_bytes_read": ("vllm:kvstride_disk_bytes_read", "Bytes read from the disk tier's records."),
}
FAILURES_SERIES = (
    "vllm:kvstride_failures",
    "kvstride failures by outcome: get_*/put_* per block, loads_failed/saves_failed per "
    "request, *_job_errors per job, lookup_errors per lookup batch.",
)


class KVStridePromMetrics(KVConnectorPromMetrics):
    """kvstride's Prometheus counters, per vLLM engine (its ``labelnames``), and the failures
    with an ``outcome`` label too."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: Dict[type, type],
        labelnames: list,
        per_engine_labelvalues: Dict[int, list],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: Dict[Tuple[str, int], Any] = {}
        for name, (series, documentation) in SERIES.items():
            counter = self._counter_cls(name=series, documentation=documentation, labelnames=labelnames)
            for engine_idx, labelvalues in per_engine_labelvalues.items():
                self._counters[name, engine_idx] = counter.labels(*labelvalues)
        series, documentation = FAILURES_SERIES
        self._failures = self._counter_cls(
            name=series, documentation=documentation, labelnames=labelnames + ["outcome"]
        )
        # The known outcomes are exported as 0 from the start (an alert on their rate sees a
        # series, not an absent one); the store's per-block outcomes are bound on first sight.
        self._failures_by_outcome: Dict[Tuple[str, int], Any] = {}
        for outcome in sorted(FAILURE_COUNTERS):
            for engine_idx in per_engine_labelvalues:
                self._failure_counter(outcome, engine_idx)

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        """Add one step's ``data`` (summed over the workers and the scheduler) of engine
        ``engine_idx``; names that are not series (``reduce()``'s hit rate) are skipped."""
        for name, value in transfer_stats_data.items():
            if value <= 0:  # a negative Counter.inc raises in vLLM's output loop
                continue
            if name.startswith(FAILED):
                self._failure_counter(name[len(FAILED):], engine_idx).inc(value)
            elif name in SERIES:
                self._counters[name, engine_idx].inc(value)

    def _failure_counter(self, outcome: str, engine_idx: int) -> Any:
        key = (outcome, engine_idx)
        if key not in self._failures_by_outcome:
            labelvalues = self.per_engine_labelvalues[engine_idx] + [outcome]
            self._failures_by_outcome[key] = self._failures.labels(*labelvalues)
        return self._failures_by_outcome[key]


class Outcomes:
    """What one side of the connector counted and timed (its engine adds its own), logged
    once per kind of failure, and reported to vLLM as per-step deltas (under a lock: vLLM's
    stats thread and the step thread both read them)."""

    def __init__(self) -> None:
        self.engine = None  # the side's OffloadEngine, once it has one
        self.store = None  # the side's store, whose counters hold the MAC's rejections
        self._counters: collections.Counter = collections.Counter()
        self._seconds: collections.Counter = collections.Counter()
        self._counters_lock = threading.Lock()
        self._logged: set = set()
        self._stats_last: dict = {}  # the totals last reported to vLLM

    def count(self, name: str, n: int = 1) -> None:
        with self._counters_lock:
            self._counters[name] += n

    def _shut_engine(self) -> None:
        """Stop the engine's lanes, waiting for what runs, and let it go (its staging with it)."""
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as err:
                log.warning("kvstride engine shutdown failed: %r", err)

    def add_seconds(self, operation: str, seconds: float) -> None:
        with self._counters_lock:
            self._seconds[operation] += seconds

    def _log_once(self, what: str, message: str, *args) -> None:
        with self._counters_lock:
            if what in self._logged:
                return
            self._logged.add(what)
        log.warning(message, *args)

    @property
    def counters(self) -> collections.Counter:
        """What this side counted: the connector's outcomes plus its engine's."""
        with self._counters_lock:
            out = collections.Counter(self._counters)
        if self.engine is not None:
            out.update(dict(self.engine.counters))
        counted = getattr(self.store, "counters", None)
        if counted is not None:  # forged values the store's MAC check refused
            out["mac_rejected"] += counted.get("mac_rejected", 0)
        return out

    def get_kv_connector_stats(self) -> Optional[KVStrideStats]:
        try:
            with self._counters_lock:
                seconds = collections.Counter(self._seconds)
            if self.engine is not None:
                seconds.update(dict(self.engine.seconds))
            return stats_delta(self.counters, seconds, self._stats_last)
        except Exception as err:  # stats are never worth a failed step
            self._log_once("stats", "kvstride stats failed: %r", err)
            return None
