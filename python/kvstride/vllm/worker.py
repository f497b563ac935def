"""The connector's worker side: the KV tensors of one rank, and the copies and store calls
of each step's plans.

Loads are asynchronous: vLLM parks a request with a hit until this side reports its load in
``finished_recving``, so every group's state (Mamba included) is in place before the
request's first forward; a failed load is reported in ``failed_recving`` too and vLLM
recomputes the request. Saves copy their blocks out of the KV cache within the step that
computed them (vLLM guarantees a hand-off block or a block leaving a sliding window only
until the end of that step); the store puts run later on the engine's save lane, so no step
waits for another request's saves and a finished request's blocks are free at once.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, List, Optional, Tuple

import numpy as np

from kvstride.arena.slots import HostArena
from kvstride.engine import OffloadEngine, header_room_for
from kvstride.layout import KVLayout
from kvstride.mooncake_config import parse_size
from kvstride.transfer import StagingPool, Transfer, staging_bytes_for
from kvstride.vllm.config import ConnectorConfig
from kvstride.vllm.metadata import JOB_REPORTS, ArenaCopy, KVStrideMetadata, KVStrideWorkerMetadata
from kvstride.vllm.stats import Outcomes

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

__all__ = ["WorkerSide"]

log = logging.getLogger("kvstride.vllm")


class WorkerSide(Outcomes):
    """A worker process's half of :class:`kvstride.vllm.KVStrideConnector`."""

    def __init__(self, config: ConnectorConfig, store, vllm_config, kv_cache_config) -> None:
        super().__init__()
        self.planner = config.planner
        self.tp_rank = config.tp_rank  # which of each plan's per-rank lists is this worker's
        self.store = store
        self.arena_mode = config.arena_mode
        self.num_slots = config.num_slots
        self._extra = config.extra
        self._vllm_config = vllm_config
        self._kv_cache_config = kv_cache_config
        self.engine: Optional[OffloadEngine] = None  # once the KV caches are registered
        self.arena: Optional[HostArena] = None
        self._arena_loader: Optional[ThreadPoolExecutor] = None
        self._arena_inflight: Dict[str, Tuple[Future, ArenaCopy]] = {}
        self._job_reports: Dict[int, List[int]] = {}
        self._corrupt_slots: List[int] = []
        self._saved_meta: Optional[KVStrideMetadata] = None  # the last metadata whose saves ran
        self._tails_staged: set = set()  # finished requests whose tail saves left their blocks
        self._finished_seen: set = set()  # finished req ids vLLM named, not yet reported
        self._recv_done: set = set()  # loads completed, not yet reported to vLLM
        self._load_failed: set = set()  # loads failed, not yet reported to vLLM

    def shutdown(self) -> None:
        """Stop the loader and the lanes, waiting for what runs."""
        loader, self._arena_loader = self._arena_loader, None
        if loader is not None:
            loader.shutdown(wait=True)
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as err:
                log.warning("kvstride engine shutdown failed: %r", err)

    def register_kv_caches(self, kv_caches) -> None:
        cfg = self._kv_cache_config
        layout = KVLayout(kv_caches, [list(g.layer_names) for g in cfg.kv_cache_groups], num_blocks=int(cfg.num_blocks))
        if self.arena_mode:
            self.arena = HostArena(layout, self.num_slots)
            self._arena_loader = ThreadPoolExecutor(1, thread_name_prefix="kvstride-arena-load")
            return
        if "staging_bytes" in self._extra:
            staging_bytes = parse_size(self._extra["staging_bytes"], "staging_bytes")
        else:  # what one full step can save (vLLM's token budget), plus the loads' share
            step_tokens = int(self._vllm_config.scheduler_config.max_num_batched_tokens)
            staging_bytes = staging_bytes_for(layout, step_tokens, self.planner, header_room_for(self.store, layout))
        pool = StagingPool(staging_bytes)
        try:
            pool.register(self.store.register_buffer)
        except Exception as err:
            raise RuntimeError(f"kvstride: the store refused the staging buffer: {err!r}") from err
        self.engine = OffloadEngine(self.planner, Transfer(layout, pool), self.store, name="kvstride-worker")

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
                self._load_failed.update(meta.store_loads)
                self._load_failed.update(rid for rid in meta.arena_loads if rid not in self._arena_inflight)

    def _start_loads(self, meta: KVStrideMetadata) -> None:
        if meta.failed_loads:
            self._load_failed.update(meta.failed_loads)
            self.count("loads_failed", len(meta.failed_loads))
        for rid, copy in meta.arena_loads.items():
            self._start_arena_load(rid, copy)
        if not meta.store_loads:
            return
        if self.engine is None:
            self._log_once("no-kv-caches", "kvstride: no KV caches registered (or shut down); loads are recomputed")
            self._load_failed.update(meta.store_loads)
            return
        self.engine.submit_planned(gets={rid: gets.get(self.tp_rank, []) for rid, gets in meta.store_loads.items()})

    def wait_for_save(self, meta: Optional[KVStrideMetadata]) -> None:
        """Copy this step's blocks to save out of the KV cache (into arena slots, or staged
        before ``submit_planned`` returns); store puts run on the save lane."""
        if isinstance(meta, KVStrideMetadata):
            self._run_saves(meta)

    def _run_saves(self, meta: KVStrideMetadata) -> None:
        """This step's saves, once per metadata: from ``wait_for_save``, or from
        ``get_transfer_results`` in a step without a forward, where vLLM does not call
        ``wait_for_save`` (the step after the last request finished, or one whose requests all
        wait for loads), and which may still carry finished tails and arena jobs."""
        if meta is self._saved_meta:
            return
        self._saved_meta = meta
        try:
            for job_id, copy in meta.arena_saves.items():
                self._arena_save(job_id, copy)
            if meta.store_saves:
                if self.engine is None:
                    self._job_reports.update((job_id, JOB_REPORTS["failed"]) for job_id in meta.store_saves)
                    raise RuntimeError("no KV caches registered")
                self.engine.submit_planned(puts={job: puts.get(self.tp_rank, []) for job, puts in meta.store_saves.items()})
        except Exception as err:
            self._log_once("save-step", "kvstride: this step's saves were skipped: %r", err)
            self.count("save_job_errors")
        finally:  # a finished request's blocks are released whether or not its tail was stored
            self._tails_staged.update(meta.finished_tails)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """Nothing to wait for: a save never reads a block after its step, and the offsets
        of a preempted request live on the scheduler."""

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
            if self.engine is not None:
                got = self.engine.get_finished()
                self._recv_done.update(got.loads_done)
                self._load_failed.update(got.loads_failed)
                self._job_reports.update((job_id, JOB_REPORTS[outcome]) for job_id, outcome in got.jobs_done.items())
            for rid, ok in self._arena_loads_done():
                self._recv_done.add(rid)
                if not ok:
                    self._load_failed.add(rid)
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

    def _arena_save(self, job_id: int, copy: ArenaCopy) -> None:
        """Copy the blocks into their slots now, within the step (the blocks may be reused
        after it); the scheduler makes the keys readable once every rank reported."""
        start = time.perf_counter()
        try:
            self.arena.save(copy.slots, copy.groups, copy.block_ids)
            self._job_reports[job_id] = JOB_REPORTS["ok"]
            self.count("put_ok", len(copy.slots))
            self.count("bytes_stored", int(self.arena.block_bytes[np.asarray(copy.groups)].sum()))
        except Exception as err:
            self._log_once("arena-save", "kvstride: arena save job %d failed: %r", job_id, err)
            self._job_reports[job_id] = JOB_REPORTS["failed"]
            self.count("put_error", len(copy.slots))
        self._add_seconds("put", time.perf_counter() - start)

    def _start_arena_load(self, rid: str, copy: ArenaCopy) -> None:
        if copy.failed or self.arena is None or self._arena_loader is None:
            self._load_failed.add(rid)
            self.count("loads_failed")
            return
        ready = self._vllm_stream_event()
        self._arena_inflight[rid] = (self._arena_loader.submit(self._arena_load, copy, ready), copy)

    def _vllm_stream_event(self):
        """On CUDA, an event recorded on vLLM's stream now (the step thread's current stream):
        the loader's copies wait for it, so they land after whatever vLLM still has queued on
        the destination blocks (their previous owner's work). None on the CPU."""
        device = self.arena.layout.device
        if device is None or device.type != "cuda":
            return None
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def _arena_load(self, copy: ArenaCopy, ready=None) -> Tuple[np.ndarray, float]:
        """On the loader thread: the copy alone. Its outcome travels back in the future's
        result and is counted on the step thread (``_arena_loads_done``), so nothing here
        touches state the step thread reads or swaps."""
        if ready is not None:
            import torch

            torch.cuda.current_stream(self.arena.layout.device).wait_event(ready)
        start = time.perf_counter()
        ok = self.arena.load(copy.slots, copy.groups, copy.block_ids)
        return ok, time.perf_counter() - start

    def _arena_loads_done(self):
        """(req id, loaded completely) of every arena load that finished since the last call."""
        for rid, (future, copy) in list(self._arena_inflight.items()):
            if not future.done():
                continue
            del self._arena_inflight[rid]
            try:
                ok, seconds = future.result()
            except Exception as err:
                self._log_once("arena-load", "kvstride: arena load of %s failed, it is recomputed: %r", rid, err)
                self.count("load_job_errors")
                yield rid, False
                continue
            self._add_seconds("get", seconds)
            slots, groups = np.asarray(copy.slots), np.asarray(copy.groups)
            self._corrupt_slots.extend(slots[~ok].tolist())
            loaded = int(ok.sum())
            self.count("get_ok", loaded)
            self.count("get_corrupt", len(ok) - loaded)
            self.count("bytes_loaded", int(self.arena.block_bytes[groups[ok]].sum()))
            self.count("loads_ok" if ok.all() else "loads_failed")
            yield rid, bool(ok.all())

    def build_connector_worker_meta(self) -> Optional[KVStrideWorkerMetadata]:
        if not self._job_reports and not self._corrupt_slots:
            return None
        reports, self._job_reports = self._job_reports, {}
        corrupt, self._corrupt_slots = self._corrupt_slots, []
        return KVStrideWorkerMetadata(reports, corrupt)
