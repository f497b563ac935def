"""The connector's worker side: the KV tensors of one rank, and the copies and store calls
of each step's plans, run by :class:`kvstride.engine.OffloadEngine` on its lanes for every
store.

Loads are asynchronous: vLLM parks a request with a hit until this side reports its load in
``finished_recving``, so every group's state (Mamba included) is in place before the
request's first forward; a failed load, or one past ``load_timeout_s``, is reported in
``failed_recving`` too and vLLM recomputes the request. Saves copy their blocks out of the KV cache within the step that
computed them (vLLM guarantees a hand-off block or a block leaving a sliding window only
until the end of that step): straight into the arena's slots, or into staging whose store
puts run later on the engine's save lane, so no step waits for another request's saves and a
finished request's blocks are free at once.

On CUDA a save's reads of the KV cache run on a side stream beside the next steps' kernels
(into the arena, launched by the engine's launch lane). A block vLLM writes again was either
allocated anew, and each step's metadata names the blocks its scheduling allocated, which the
step's stream is fenced against before its forward (``handle_preemptions``), or it is a Mamba
hand-off state rewritten in place, whose reads the step's stream waits for at once. Where vLLM
writes newly allocated blocks before ``handle_preemptions`` (a KV cache with Mamba layers or of
mixed precision: :func:`fenced_groups`), the step's stream waits at once for every read.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, List, Optional, Tuple

from kvstride.engine import OffloadEngine
from kvstride.host_memory import pinned_bytes
from kvstride.layout import KVLayout
from kvstride.stores.placement import rank_entries
from kvstride.vllm.config import ConnectorConfig
from kvstride.vllm.metadata import JOB_REPORTS, KVStrideMetadata, KVStrideWorkerMetadata
from kvstride.vllm.stats import Outcomes
from kvstride.vllm.store_registry import engine_transfer

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

__all__ = ["WorkerSide"]

log = logging.getLogger("kvstride.vllm")

#: Seconds between a disabled store's tries to take the staging buffer again (each from a step
#: of this worker: a store the master refused, or one whose master was down at registration).
STORE_RETRY_S = 30.0


def fenced_groups(groups, kv_cache_config) -> frozenset:
    """The groups whose saves' reads the step's stream need not wait for at once: those whose
    blocks vLLM writes again only once it allocated them anew, after ``handle_preemptions``
    fenced them. None where vLLM writes new blocks before that hook: it zeroes them in a KV
    cache with Mamba layers or of mixed precision, and copies Mamba states into them (vLLM
    0.34's model runner does both in ``update_requests``, before ``pre_forward``). Never a
    scratch ring, whose block is rewritten in place while its request runs."""
    if getattr(kv_cache_config, "needs_kv_cache_zeroing", False) or any(spec.kind == "mamba" for spec in groups):
        return frozenset()
    return frozenset(g for g, spec in enumerate(groups) if spec.kind != "circular_buffer")


class WorkerSide(Outcomes):
    """A worker process's half of :class:`kvstride.vllm.KVStrideConnector`."""

    def __init__(self, config: ConnectorConfig, store, vllm_config, kv_cache_config) -> None:
        super().__init__()
        self.planner = config.planner
        self.tp_rank = config.tp_rank  # which of each plan's per-rank lists is this worker's
        self._rank = config.worker_rank  # this worker's TP rank, in its store-state reports
        self.store = store  # the Mooncake client, or the arena's slots (kvstride.arena.ArenaSlots)
        self._extra = config.extra
        self._save_wait_s = config.save_wait_s
        self._staging_wait_s = config.staging_wait_s
        self._put_linger_s = config.put_linger_s
        self._load_timeout_s = config.load_timeout_s
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.engine: Optional[OffloadEngine] = None  # once the KV caches are registered
        self._job_reports: Dict[int, List[int]] = {}
        self._corrupt: list = []  # what loads found corrupted, for the scheduler's placement
        self._saved_meta: Optional[KVStrideMetadata] = None  # the last metadata whose saves ran
        self._fenced_groups = fenced_groups(config.groups, kv_cache_config)
        self._tails_staged: set = set()  # finished requests whose tail saves left their blocks
        self._finished_seen: set = set()  # finished req ids vLLM named, not yet reported
        self._recv_done: set = set()  # loads completed, not yet reported to vLLM
        self._load_failed: set = set()  # loads failed, not yet reported to vLLM
        # The embedded store's disk tier: loads waiting for their records (req id -> its gets
        # and the reads' deadline), loads failed at that deadline whose reads still run, and
        # for the scheduler: write-through reports, records found bad, and per such load
        # [reads timed out here, late reads ended here] (its slots stay reserved until then).
        self._reading: Dict[str, Tuple[list, float]] = {}
        self._reads_late: set = set()
        self._disk_reports: Dict[int, List[int]] = {}
        self._disk_corrupt: List[int] = []
        self._disk_late: Dict[str, List[int]] = {}
        self._disk_paces = [0, 0.0, 0, 0.0]  # the disk lane's (DiskLane.take_paces), since reported
        self._layout: Optional[KVLayout] = None  # once the KV caches are registered
        self._store_disabled = False  # the store refused this worker: every request recomputes
        self._store_retry_at = 0.0
        self._store_reports: Dict[int, bool] = {}  # a change of the store's state, for the scheduler

    def shutdown(self) -> None:
        """Stop the lanes, waiting for what runs (the staging pool's registration ends with
        the pool: ``StagingPool.register``)."""
        self._shut_engine()

    def register_kv_caches(self, kv_caches) -> None:
        cfg = self._kv_cache_config
        layout = KVLayout(kv_caches, [list(g.layer_names) for g in cfg.kv_cache_groups], num_blocks=int(cfg.num_blocks))
        if hasattr(self.store, "bind_geometry"):  # a shared store: values of another memory layout are misses
            self.store.bind_geometry(layout.fingerprint())
        self._layout = layout
        self._start_engine()

    def _start_engine(self) -> None:
        """The engine over the registered KV caches; a store that refuses it (its master down,
        the staging buffer refused) is disabled: the scheduler learns it from this worker's
        next report and claims no hit until a later try (``STORE_RETRY_S``) brings it back."""
        step_tokens = int(self._vllm_config.scheduler_config.max_num_batched_tokens)
        pinned_before = pinned_bytes()
        try:
            transfer = engine_transfer(self.store, self._layout, self._extra, step_tokens, self.planner)
        except RuntimeError as err:  # the store is unusable: no engine, every request recomputes
            self._store_retry_at = time.monotonic() + STORE_RETRY_S
            if not self._store_disabled:
                log.error("kvstride: the store is disabled on this worker, every request recomputes until it is "
                          "back (tried again every %g s): %s", STORE_RETRY_S, err)
                self._store_disabled = True
                self._store_reports[self._rank] = True
                self.count("store_disabled")
            return
        self.engine = OffloadEngine(
            self.planner, transfer, self.store, name="kvstride-worker", save_wait_s=self._save_wait_s,
            staging_wait_s=self._staging_wait_s,
            put_linger_s=self._put_linger_s, load_timeout_s=self._load_timeout_s,
        )
        # The arena's slots or the staging pool, page-locked on CUDA (exactly their size).
        self.count("pinned_bytes", pinned_bytes() - pinned_before)
        if self._store_disabled:
            log.warning("kvstride: the store is back on this worker")
            self._store_disabled = False
            self._store_reports[self._rank] = False

    def _retry_store(self) -> None:
        """Take the staging buffer again once the store answers its health check (a pool is
        allocated and touched only then, never on every try)."""
        health = getattr(self.store, "health", None)
        if health is not None and health() != 0:
            self._store_retry_at = time.monotonic() + STORE_RETRY_S
            return
        self._start_engine()

    def start_load_kv(self, meta: Optional[KVStrideMetadata]) -> None:
        """Hand this step's loads to the load lane and return: vLLM keeps their requests
        waiting until ``get_finished`` reports them."""
        try:
            if not isinstance(meta, KVStrideMetadata):
                return
            self._start_loads(meta)
        except Exception as err:  # never into vLLM's step: every load of the step is recomputed
            self._log_once("start-load", "kvstride: this step's loads failed, they are recomputed: %r", err)
            self.count("load_job_errors")
            if isinstance(meta, KVStrideMetadata):
                self._load_failed.update(meta.failed_loads)
                self._load_failed.update(meta.loads)

    def _start_loads(self, meta: KVStrideMetadata) -> None:
        if meta.failed_loads:
            self._load_failed.update(meta.failed_loads)
            self.count("loads_failed", len(meta.failed_loads))
        if not meta.loads:
            return
        if self.engine is None:
            self._log_once("no-kv-caches", "kvstride: no KV caches registered (or shut down); loads are recomputed")
            self._load_failed.update(meta.loads)
            return
        gets = {rid: rank_entries(by_rank, self.tp_rank) for rid, by_rank in meta.loads.items()}
        disk = getattr(self.store, "disk", None)
        for rid, reads in meta.disk_reads.items():  # their records first, on the disk lane
            entries = gets.pop(rid, None)
            if entries is None:
                continue
            if disk is None:
                self._load_failed.add(rid)
                continue
            timeout = min(self._load_timeout_s, meta.disk_read_deadlines.get(rid, self._load_timeout_s))
            self._reading[rid] = (entries, time.monotonic() + timeout)
            disk.read(rid, reads)
        if gets:
            self.engine.submit_planned(gets=gets)

    def wait_for_save(self, meta: Optional[KVStrideMetadata]) -> None:
        """Copy this step's blocks to save out of the KV cache (into arena slots, or staged
        before ``submit_planned`` returns); store puts run on the save lane."""
        if isinstance(meta, KVStrideMetadata):
            self._run_saves(meta)

    def _run_saves(self, meta: KVStrideMetadata) -> None:
        """This step's saves, once per metadata: from ``wait_for_save``, or from
        ``get_transfer_results`` in a step without a forward, where vLLM does not call
        ``wait_for_save`` (the step after the last request finished, or one whose requests all
        wait for loads), and which may still carry finished tails and save jobs."""
        if meta is self._saved_meta:
            return
        self._saved_meta = meta
        try:
            self._write_through(meta)
            if meta.saves:
                if self.engine is None:
                    self._job_reports.update((job_id, JOB_REPORTS["failed"]) for job_id in meta.saves)
                    raise RuntimeError("no KV caches registered")
                self.engine.submit_planned(puts={job: rank_entries(puts, self.tp_rank) for job, puts in meta.saves.items()},
                                           fenced_groups=self._fenced_groups, tails=meta.save_tails)
            elif self.engine is not None:  # a step without saves: the save lane lingers for nothing
                self.engine.flush_puts()
        except Exception as err:
            self._log_once("save-step", "kvstride: this step's saves were skipped: %r", err)
            self.count("save_job_errors")
        finally:  # a finished request's blocks are released whether or not its tail was stored
            self._tails_staged.update(meta.finished_tails)

    def _write_through(self, meta: KVStrideMetadata) -> None:
        """The step's disk write-through jobs (slots the scheduler holds), to the disk lane; jobs
        the scheduler gave up are dropped if their writes have not begun."""
        disk = getattr(self.store, "disk", None)
        if meta.disk_cancelled and disk is not None:
            disk.cancel(meta.disk_cancelled)
        if not meta.disk_writes:
            return
        for job_id, entries in meta.disk_writes.items():
            if disk is None:
                self._disk_reports[job_id] = [0, 1]
            else:
                disk.write(job_id, entries)

    def _take_disk(self) -> None:
        """What the disk lane finished: write-through reports; loads whose records are in
        their slots go to the engine's load lane, those with a bad record fail."""
        disk = getattr(self.store, "disk", None)
        if disk is None:
            return
        written, read, counted = disk.take()
        self._disk_paces = [a + b for a, b in zip(self._disk_paces, disk.take_paces())]
        for name, n in counted.items():
            self.count(name, n)
        for job_id, ok in written.items():
            self._disk_reports[job_id] = [1, 0] if ok else [0, 1]
        gets = {}
        for rid, (ok, bad) in read.items():
            reading = self._reading.pop(rid, None)
            self._disk_corrupt.extend(bad)
            if rid in self._reads_late:  # failed at its deadline: now its slots may go
                self._reads_late.discard(rid)
                self._late_report(rid, ended=1)
            if reading is None:
                continue
            if ok and self.engine is not None:
                gets[rid] = reading[0]
            else:
                self.count("disk_loads_failed")
                self._load_failed.add(rid)
        now = time.monotonic()
        for rid in [rid for rid, (_, deadline) in self._reading.items() if now > deadline]:
            del self._reading[rid]  # a disk that does not answer: the request recomputes
            self._reads_late.add(rid)
            self._late_report(rid, timed_out=1)
            self.count("disk_reads_timed_out")
            self._log_once("disk-read-deadline", "kvstride: a disk-tier read took longer than its request's "
                           "compute would (or load_timeout_s=%s s); it recomputes", self._load_timeout_s)
            self._load_failed.add(rid)
        if gets:
            self.engine.submit_planned(gets=gets)

    def _late_report(self, rid: str, timed_out: int = 0, ended: int = 0) -> None:
        counts = self._disk_late.setdefault(rid, [0, 0])
        counts[0] += timed_out
        counts[1] += ended

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """Before the step's forward and loads: its stream waits (on the device) for the saves
        still reading a block the step's scheduling allocated anew (the blocks of a preempted or
        finished request included) or a load of the step writes. The offsets of a preempted
        request live on the scheduler."""
        try:
            if isinstance(kv_connector_metadata, KVStrideMetadata) and self.engine is not None:
                self.engine.fence(kv_connector_metadata.allocated)
        except Exception as err:  # never into vLLM's step
            self._log_once("fence", "kvstride: a step's fence against pending saves failed: %r", err)
            self.count("worker_errors")

    def get_transfer_results(self, meta: Optional[KVStrideMetadata], finished_req_ids) -> KVConnectorTransferResults:
        """Loads done (failed ones also in ``failed_recving``: vLLM recomputes the request,
        on every model), and finished requests whose tail saves no longer need their blocks.
        Completions taken from the engine wait in ``_recv_done`` / ``_load_failed`` until they
        are handed to vLLM, so none is lost to an error on the way."""
        results = KVConnectorTransferResults()
        try:
            if isinstance(meta, KVStrideMetadata):
                self._run_saves(meta)
            self._finished_seen.update(finished_req_ids or ())
            if self._store_disabled and self.engine is None and time.monotonic() >= self._store_retry_at:
                self._retry_store()
            self._take_disk()
            if self.engine is not None:
                got = self.engine.get_finished()
                self._recv_done.update(got.loads_done)
                self._load_failed.update(got.loads_failed)
                self._job_reports.update((job_id, JOB_REPORTS[outcome]) for job_id, outcome in got.jobs_done.items())
            self._corrupt.extend(self.store.take_corrupt())
        except Exception as err:
            self._log_once("get-finished", "kvstride get_finished failed: %r", err)
            self.count("worker_errors")
        failed, self._load_failed = self._load_failed, set()
        done, self._recv_done = self._recv_done | failed, set()
        results.finished_recving.update(done)
        results.failed_recving.update(failed)
        ready = self._tails_staged & self._finished_seen
        self._tails_staged -= ready
        results.finished_sending.update(ready)
        # Finished requests with nothing staged are never reported: forget them.
        self._finished_seen &= self._tails_staged
        return results

    def build_connector_worker_meta(self) -> Optional[KVStrideWorkerMetadata]:
        if not (self._job_reports or self._corrupt or self._disk_reports or self._disk_corrupt or self._disk_late
                or self._store_reports or any(self._disk_paces)):
            return None
        reports, self._job_reports = self._job_reports, {}
        corrupt, self._corrupt = self._corrupt, []
        disk, self._disk_reports = self._disk_reports, {}
        disk_corrupt, self._disk_corrupt = self._disk_corrupt, []
        disk_late, self._disk_late = self._disk_late, {}
        store_states, self._store_reports = self._store_reports, {}
        paces, self._disk_paces = self._disk_paces, [0, 0.0, 0, 0.0]
        return KVStrideWorkerMetadata(reports, corrupt, disk, disk_corrupt, disk_late, store_states, paces)
