"""vLLM KV connector over kvstride's core: a facade that builds the side vLLM asks for
(:class:`~kvstride.vllm.scheduler.SchedulerSide` in the scheduler's process,
:class:`~kvstride.vllm.worker.WorkerSide` in each worker's) and hands it vLLM's calls.

Use it with::

    KVTransferConfig(kv_connector="KVStrideConnector", kv_connector_module_path="kvstride.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"store": "embedded"})

``kv_connector_extra_config`` (docs/OPERATING.md lists every key):

- ``store``: ``"embedded"`` (default) keeps the bytes in the workers' host memory, in one
  arena of fixed-size slots per rank (``store_bytes``, default 1 GiB), with the index in the
  scheduler (``kvstride.arena``): it works in every process layout vLLM uses (``uni``,
  ``mp``, ``vllm serve``, TP), within one engine. ``"mooncake"`` is a Mooncake store shared by
  engines and restarts, configured like vLLM's MooncakeStoreConnector (``MOONCAKE_CONFIG_PATH``;
  ``mooncake_*`` keys override it; ``kvstride store serve`` runs a long-lived one);
- ``disk_path`` and ``disk_bytes``: the embedded store's disk tier (``kvstride.arena.disk``), every
  value written through to a record file per rank, read back when memory evicted it, and kept
  for the next engine on the folder;
- ``staging_bytes`` (Mooncake staging, default: what eight full steps can save), ``model_id`` (the key namespace's
  model part, default the model path), ``cache_prefix``, ``secret_file`` (the deployment key);
- ``load_timeout_s`` (default 10): past it a load is reported failed and its request recomputes
  (a load from the disk tier: its reads of the records, then its copy, each at most this);
  ``lookup_timeout_s`` (default 1): how long a lookup waits for a shared store before it misses;
  ``staging_wait_s`` (default 4): how long a step waits in all for Mooncake staging room;
- ``admission``: ``"kvstride"`` (default) stores a window group's blocks only for the tails of
  boundaries a later lookup can hit at, under vLLM's ``prefix_cache_retention_interval``
  (SEMANTICS §8); ``"dense"`` stores them all;
- ``trust_client_mm_uuids``: on a store that outlives the engine, key multimodal items by vLLM's
  identifiers (a client's uuid included) rather than their content (``kvstride.vllm.bindings``);
- ``allow_failing_loads``: accept ``kv_load_failure_policy="fail"`` (refused otherwise: every
  load kvstride cannot complete would end its request with an error).

The connector never derives a key or a boundary: vLLM's request block hashes and per-group
block ids go to the core's planner (through :class:`kvstride.engine.OffloadEngine`).

Nothing raises into vLLM's step: errors become misses, recomputed loads or skipped saves,
each counted (``KVConnectorStats``, Prometheus ``vllm:kvstride_*``) and logged once.
Configuration that cannot work raises ``ValueError`` at construction.
"""

from __future__ import annotations

import functools
import time
from typing import Optional, Tuple, Union

from kvstride.connector_checks import check_extra_on_this_host
from kvstride.vllm.config import resolve_config
from kvstride.vllm.metadata import KVStrideMetadata, KVStrideWorkerMetadata
from kvstride.vllm.scheduler import SchedulerSide
from kvstride.vllm.stats import KVStridePromMetrics, KVStrideStats
from kvstride.vllm.store_registry import open_side_store, release_shared_store
from kvstride.vllm.worker import WorkerSide

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

__all__ = ["KVStrideConnector"]

SCHEDULER_HOOKS, WORKER_HOOKS = "scheduler_hooks", "worker_hooks"


def _timed(hooks: str):
    """Add the hook's time to the side's ``hooks`` seconds: what the connector costs vLLM's
    scheduler or worker thread, reported as ``scheduler_seconds`` / ``worker_step_seconds``."""

    def wrap(method):
        @functools.wraps(method)
        def timed(self, *args, **kwargs):
            started = time.perf_counter()
            try:
                return method(self, *args, **kwargs)
            finally:
                self.side.add_seconds(hooks, time.perf_counter() - started)

        return timed

    return wrap


class KVStrideConnector(KVConnectorBase_V1, SupportsHMA):
    """A vLLM KV connector over :class:`kvstride.engine.OffloadEngine` (see the module
    docstring). ``side`` is the scheduler's or the worker's half; each vLLM call goes to it."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("KVStrideConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        worker = role == KVConnectorRole.WORKER
        config = resolve_config(vllm_config, kv_cache_config, worker=worker)
        self.fingerprint = config.fingerprint
        store, self._shared_client = open_side_store(config, vllm_config, worker)
        self._own_store = store if self._shared_client is None else None  # the arena's side, closed here
        self.side: Union[SchedulerSide, WorkerSide]
        if worker:
            self.side = WorkerSide(config, store, vllm_config, kv_cache_config)
        else:
            self.side = SchedulerSide(config, store)

    # ---- both roles --------------------------------------------------------------------------

    @property
    def counters(self):
        return self.side.counters

    def get_kv_connector_stats(self) -> Optional[KVStrideStats]:
        return self.side.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data=None) -> KVStrideStats:
        return KVStrideStats(data=data) if data is not None else KVStrideStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVStridePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config) -> bool:
        """vLLM asks this while it builds its configuration, before any worker starts, when its
        CUDA graphs capture whole steps (vLLM's default on CUDA): the checks of
        ``kv_connector_extra_config`` that need no engine run here, so that a mistake stops the
        start before a model loads. kvstride's copies run outside any graph: no piecewise mode."""
        check_extra_on_this_host(extra_config or {})
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """vLLM 0.33's sleep mode frees and restores the KV caches under the connector's
        registered views and in-flight copies: not supported."""
        return False

    def shutdown(self) -> None:
        """Stop the side's lanes (waiting for what runs), then let go of the shared store: the
        last connector of the process that uses it closes it."""
        self.side.shutdown()
        client, self._shared_client = self._shared_client, None
        if client is not None:
            release_shared_store(client)
        own, self._own_store = self._own_store, None
        if own is not None:  # the disk tier's files and index
            own.close()

    # ---- scheduler side ------------------------------------------------------------------------

    @_timed(SCHEDULER_HOOKS)
    def reset_cache(self) -> Optional[bool]:
        return self.side.reset_cache()

    @_timed(SCHEDULER_HOOKS)
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        return self.side.get_num_new_matched_tokens(request, num_computed_tokens)

    @_timed(SCHEDULER_HOOKS)
    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        self.side.update_state_after_alloc(request, blocks, num_external_tokens)

    @_timed(SCHEDULER_HOOKS)
    def update_connector_output(self, connector_output) -> None:
        self.side.update_connector_output(connector_output)

    @_timed(SCHEDULER_HOOKS)
    def on_new_request(self, request) -> None:
        self.side.on_new_request(request)

    @_timed(SCHEDULER_HOOKS)
    def build_connector_meta(self, scheduler_output) -> KVStrideMetadata:
        return self.side.build_connector_meta(scheduler_output)

    @_timed(SCHEDULER_HOOKS)
    def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads) -> bool:
        return self.side.register_finished_partial_tail(request, block_ids, partial_tail_offloads)

    @_timed(SCHEDULER_HOOKS)
    def request_finished_all_groups(self, request, block_ids) -> Tuple[bool, Optional[dict]]:
        return self.side.request_finished_all_groups(request, block_ids)

    @_timed(SCHEDULER_HOOKS)
    def request_finished(self, request, block_ids) -> Tuple[bool, Optional[dict]]:
        return self.side.request_finished_all_groups(request, (block_ids,))

    # ---- worker side ---------------------------------------------------------------------------

    def _step_metadata(self) -> Optional[KVStrideMetadata]:
        """The metadata bound for this step, if any (never raises into vLLM's step)."""
        try:
            return self._get_connector_metadata() if self.has_connector_metadata() else None
        except Exception:
            return None

    def register_kv_caches(self, kv_caches) -> None:
        self.side.register_kv_caches(kv_caches)

    @_timed(WORKER_HOOKS)
    def start_load_kv(self, forward_context, **kwargs) -> None:
        self.side.start_load_kv(self._step_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # whole blocks are saved after the forward (wait_for_save)

    @_timed(WORKER_HOOKS)
    def wait_for_save(self) -> None:
        self.side.wait_for_save(self._step_metadata())

    @_timed(WORKER_HOOKS)
    def handle_preemptions(self, kv_connector_metadata) -> None:
        self.side.handle_preemptions(kv_connector_metadata)

    @_timed(WORKER_HOOKS)
    def get_transfer_results(self, finished_req_ids) -> KVConnectorTransferResults:
        return self.side.get_transfer_results(self._step_metadata(), finished_req_ids)

    def get_finished(self, finished_req_ids):
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    @_timed(WORKER_HOOKS)
    def build_connector_worker_meta(self) -> Optional[KVStrideWorkerMetadata]:
        return self.side.build_connector_worker_meta()

    def get_block_ids_with_load_errors(self) -> set:
        return set()  # failures go out as failed_recving, which vLLM takes for every model
