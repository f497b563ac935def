"""vLLM KV connector: a thin driver of :class:`kvstride.engine.OffloadEngine`.

Use it with::

    KVTransferConfig(kv_connector="KVStrideConnector", kv_connector_module_path="kvstride.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"store": "embedded", "store_name": "default"})

``kv_connector_extra_config``:

- ``store``: ``"embedded"`` (default: an in-process store, shared by every connector of this
  process that names the same ``store_name`` and has the same layout fingerprint) or
  ``"mooncake"`` with ``mooncake_master`` = ``"host:port"``;
- ``store_bytes`` (embedded capacity, default 1 GiB), ``staging_bytes`` (default 64 MiB),
  ``model_id`` (the key namespace's model part, default the model path), ``cache_prefix``.

The connector never derives a key or a boundary: the scheduler side hands vLLM's request
block hashes to ``OffloadEngine.lookup`` and records the allocated per-group block ids; the
worker side hands the same hashes and block ids to ``OffloadEngine.submit`` and reports what
``get_finished`` returns (failed loads as block ids vLLM recomputes). The planner comes from
vLLM's ``kv_cache_config`` groups through :class:`kvstride.GroupSpec` and
:func:`kvstride.resolve_block_sizes`.

Loads are synchronous (``get_num_new_matched_tokens`` returns ``(n, False)``; ``start_load_kv``
waits for the load job). Saves run on the engine's worker while the request runs; a request
that saved anything keeps its blocks (``request_finished`` returns True) until the worker
drained its save jobs, so a freed block is never read by a save.

Nothing raises into vLLM's step: errors become misses, failed block ids or skipped saves.
Configuration that cannot work raises at construction.

Limits: the embedded store is per process, so the scheduler and the worker must share one
(``distributed_executor_backend="uni"``); use Mooncake otherwise. vLLM's block hashes start
from a seed that is random per process unless ``PYTHONHASHSEED`` is set: two processes share
hits only when it is. Loads are synchronous.

Mamba ``align`` boundary states: vLLM hands them over as ``(group, block_id, boundary)``
tuples (``scheduler_output.kv_connector_block_state.boundary_state_offloads`` each step, and
``register_finished_partial_tail`` at a request's end); they go to the engine unchanged as
``SaveRequest.handoffs``, one save per boundary. Hand-offs of requests finished or preempted in
that step are dropped. A step whose saves carry hand-offs waits for them in ``wait_for_save``
(vLLM does not keep those blocks for the request). vLLM 0.32 cannot take block-level load
failures for models with several KV-cache groups (it raises in ``_handle_invalid_blocks``), so
a failed load on such a model stops the engine.
"""

from __future__ import annotations

import logging
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import kvstride
from kvstride.engine import LoadRequest, OffloadEngine, SaveRequest
from kvstride.layout import KVLayout
from kvstride.stores import EmbeddedStore, KVStore
from kvstride.transfer import StagingPool, Transfer
from kvstride.vllm_stats import KVStridePromMetrics, KVStrideStats, stats_delta

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

__all__ = ["KVStrideConnector", "KVStrideMetadata", "group_specs", "shared_store"]

log = logging.getLogger("kvstride.vllm")

#: Seconds a synchronous load (or a drain of saves at request end) may take before its
#: blocks are reported failed / released.
WAIT_TIMEOUT_S = 60.0

# ---- stores shared by the connectors of one process ------------------------------------

_STORES: Dict[Tuple[str, bytes], KVStore] = {}
_STORES_LOCK = threading.Lock()


def shared_store(name: str, fingerprint: bytes, factory) -> KVStore:
    """The process-wide store for ``(name, fingerprint)``, made by ``factory()`` once."""
    with _STORES_LOCK:
        store = _STORES.get((name, fingerprint))
        if store is None:
            store = _STORES[(name, fingerprint)] = factory()
        return store


def drop_shared_stores() -> None:
    """Close and forget every shared store (tests)."""
    with _STORES_LOCK:
        stores = list(_STORES.values())
        _STORES.clear()
    for store in stores:
        try:
            store.close()
        except Exception:
            pass


# ---- geometry from vLLM's kv_cache_config ----------------------------------------------


def group_specs(kv_cache_config, vllm_config) -> List[kvstride.GroupSpec]:
    """One :class:`kvstride.GroupSpec` per vLLM KV-cache group, in group order."""
    from vllm.v1 import kv_cache_interface as kci

    mamba_mode = getattr(vllm_config.cache_config, "mamba_cache_mode", "none") or "none"
    out = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        bs = int(spec.block_size)
        heads = getattr(spec, "num_kv_heads", None)
        if isinstance(spec, kci.CircularBufferSpec):
            out.append(kvstride.GroupSpec("circular_buffer", bs))
        elif isinstance(spec, kci.SlidingWindowSpec):  # incl. SlidingWindowMLASpec
            out.append(kvstride.GroupSpec("sliding_window", bs, window=int(spec.sliding_window), num_kv_heads=heads))
        elif isinstance(spec, kci.ChunkedLocalAttentionSpec):
            out.append(kvstride.GroupSpec("chunked_local", bs, window=int(spec.attention_chunk_size), num_kv_heads=heads))
        elif isinstance(spec, kci.MLAAttentionSpec):
            out.append(kvstride.GroupSpec("mla", bs))
        elif isinstance(spec, kci.FullAttentionSpec):
            out.append(kvstride.GroupSpec("full_attention", bs, num_kv_heads=heads))
        elif isinstance(spec, kci.MambaSpec):
            out.append(kvstride.GroupSpec("mamba", bs, mamba_mode=mamba_mode))
        else:
            raise ValueError(
                f"KV-cache group {g} has a {type(spec).__name__}, which kvstride cannot offload; "
                "supported: full attention, MLA, sliding window, chunked local, Mamba, circular buffer"
            )
    return out


def _fingerprint(vllm_config, kv_cache_config, groups) -> str:
    """16 hex chars describing everything a stored block's bytes depend on."""
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    desc = {
        "model": str(getattr(model, "model", "")),
        "dtype": str(getattr(model, "dtype", "")),
        "kv_dtype": str(getattr(cache, "cache_dtype", "")),
        "hash": str(getattr(cache, "prefix_caching_hash_algo", "")),
        "groups": [
            [type(g.kv_cache_spec).__name__, repr(spec_g), int(getattr(g.kv_cache_spec, "page_size_bytes", 0)), list(g.layer_names)]
            for g, spec_g in zip(kv_cache_config.kv_cache_groups, groups)
        ],
        "layout": str(getattr(kv_cache_config, "kv_cache_layout", "")),
    }
    return kvstride.layout_fingerprint(desc)


# ---- metadata ----------------------------------------------------------------------------


@dataclass
class KVStrideMetadata(KVConnectorMetadata):
    loads: List[LoadRequest] = field(default_factory=list)
    saves: List[SaveRequest] = field(default_factory=list)
    preempted: List[str] = field(default_factory=list)
    finished_tails: List[str] = field(default_factory=list)  # finished req ids saved this step


@dataclass
class _SchedReq:
    request: Any
    block_ids: List[List[int]] = field(default_factory=list)


class KVStrideConnector(KVConnectorBase_V1, SupportsHMA):
    """A vLLM KV connector over :class:`OffloadEngine` (see the module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("KVStrideConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._extra = extra
        groups = group_specs(kv_cache_config, vllm_config)
        self.groups = groups
        S, H = kvstride.resolve_block_sizes(groups)
        vllm_h = getattr(kv_cache_config, "hash_block_size", None)
        if vllm_h is not None and int(vllm_h) != H:
            raise ValueError(
                f"vLLM hashes blocks of {vllm_h} tokens but kvstride resolves H={H} for groups "
                f"{[(g.kind, g.block_size) for g in groups]}; the request block hashes would not line up"
            )
        fp = _fingerprint(vllm_config, kv_cache_config, groups)
        self.fingerprint = fp
        pc = vllm_config.parallel_config
        namespace = kvstride.Namespace(
            str(extra.get("model_id") or vllm_config.model_config.model),
            cache_prefix=extra.get("cache_prefix"),
            fingerprint=fp,
            tp_rank=int(getattr(pc, "rank", 0) or 0) % max(1, int(getattr(pc, "tensor_parallel_size", 1) or 1)),
        )
        self.planner = kvstride.KeyPlanner(groups, hash_block_size=H, scheduler_block_size=S, namespace=namespace)
        self.store = self._make_store(extra, bytes.fromhex(fp))
        self.engine: Optional[OffloadEngine] = None
        # scheduler side
        self._sreqs: Dict[str, _SchedReq] = {}
        self._local: Dict[str, int] = {}
        self._pending_loads: Dict[str, LoadRequest] = {}
        self._loading: set = set()  # req ids whose asynchronous load is in flight
        self._recompute: set = set()  # req ids whose load failed: no hit is claimed for them again
        self._finished_tails: Dict[str, tuple] = {}  # req id -> (hashes, tables, hand-offs)
        # worker side
        self._tails_staged: set = set()  # finished requests whose tail saves left their blocks
        self._finished_seen: set = set()  # finished req ids vLLM named, not yet reported
        self._load_failed: set = set()  # loads that never reached the engine
        self._stats_last: dict = {}  # the engine counters last reported to vLLM
        self.matched_tokens = 0  # external tokens reported to vLLM (scheduler side)
        if role == KVConnectorRole.SCHEDULER:
            # Lookups need only the planner and the store: no KV tensors on this side.
            self.engine = OffloadEngine(
                self.planner, types.SimpleNamespace(pool=None, layout=None), self.store, name="kvstride-sched"
            )

    # ---- shared ----------------------------------------------------------------------------

    @staticmethod
    def _make_store(extra: dict, fingerprint: bytes) -> KVStore:
        kind = str(extra.get("store", "embedded"))
        name = str(extra.get("store_name", "default"))
        if kind == "embedded":
            capacity = int(extra.get("store_bytes", 1 << 30))
            return shared_store(name, fingerprint, lambda: EmbeddedStore(capacity, fingerprint=fingerprint))
        if kind == "mooncake":
            from kvstride.stores import MooncakeStore

            master = extra.get("mooncake_master")
            if not master:
                raise ValueError("store 'mooncake' needs kv_connector_extra_config['mooncake_master'] = 'host:port'")
            return shared_store(
                f"mooncake:{master}:{name}", fingerprint, lambda: MooncakeStore(str(master), fingerprint=fingerprint)
            )
        raise ValueError(f"unknown kvstride store {kind!r}; use 'embedded' or 'mooncake'")

    # ---- stats (both roles: lookups count on the scheduler, transfers on the workers) ---------

    def get_kv_connector_stats(self) -> Optional[KVStrideStats]:
        if self.engine is None:
            return None
        return stats_delta(self.engine.counters, self.engine.seconds, self._stats_last)

    @classmethod
    def build_kv_connector_stats(cls, data=None) -> KVStrideStats:
        return KVStrideStats(data=data) if data is not None else KVStrideStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVStridePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as err:
                log.warning("kvstride engine shutdown failed: %r", err)

    # ---- scheduler side ------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        try:
            rid = request.request_id
            # At least the last prompt token must be computed by vLLM.
            limit = int(request.num_tokens) - 1
            if self.engine is None or limit <= num_computed_tokens or rid in self._recompute:
                return 0, False
            hit = self.engine.lookup([(rid, list(request.block_hashes), limit)])[rid]
            ext = max(0, int(hit) - int(num_computed_tokens))
            if ext:
                self._local[rid] = int(num_computed_tokens)
                self.matched_tokens += ext
            # Asynchronous: vLLM parks the request until the load is reported, so every
            # group's state (Mamba included) is in place before its first forward.
            return ext, ext > 0
        except Exception as err:  # never into vLLM's step: a miss
            log.warning("kvstride lookup failed, treating as a miss: %r", err)
            return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        try:
            rid = request.request_id
            local = self._local.pop(rid, 0)
            if num_external_tokens <= 0:
                return
            block_ids = [list(ids) for ids in blocks.get_block_ids()]
            self._pending_loads[rid] = LoadRequest(
                rid, list(request.block_hashes), block_ids, hit_tokens=local + int(num_external_tokens), local_tokens=local
            )
            self._loading.add(rid)
        except Exception as err:
            log.warning("kvstride update_state_after_alloc failed: %r", err)

    def update_connector_output(self, connector_output) -> None:
        for rid in connector_output.finished_recving or ():
            self._loading.discard(rid)
        # vLLM asks again after a failed load; a store that failed once is not trusted for the
        # same request (the retry could fail the same way, forever).
        self._recompute.update(connector_output.failed_recving or ())

    def on_new_request(self, request) -> None:
        self._sreqs[request.request_id] = _SchedReq(request)

    def build_connector_meta(self, scheduler_output) -> KVStrideMetadata:
        meta = KVStrideMetadata(loads=list(self._pending_loads.values()))
        self._pending_loads.clear()
        try:
            self._build_saves(scheduler_output, meta)
        except Exception as err:  # saves are best effort; loads must go out
            log.warning("kvstride: this step's saves were skipped: %r", err)
            meta.saves = []
            # Finished requests held for their tail are released all the same.
            meta.finished_tails = sorted(set(meta.finished_tails) | set(self._finished_tails))
            self._finished_tails.clear()
        return meta

    def _build_saves(self, so, meta: KVStrideMetadata) -> None:
        for rid in so.preempted_req_ids or ():
            st = self._sreqs.get(rid)
            if st is not None:  # its blocks are gone; a resumed request starts a new table
                st.block_ids = []
            meta.preempted.append(rid)
        computed: Dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            st = self._sreqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = [list(ids) for ids in new.block_ids]
            computed[new.req_id] = int(new.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            st = self._sreqs.get(rid)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in resumed:
                st.block_ids = [list(ids) for ids in (new_ids or ())]
            elif new_ids:
                if not st.block_ids:
                    st.block_ids = [[] for _ in new_ids]
                for g, ids in enumerate(new_ids):
                    st.block_ids[g].extend(ids)
            computed[rid] = int(cached.num_computed_tokens[i])
        handoffs = self._boundary_handoffs(so)
        for rid, n in so.num_scheduled_tokens.items():
            st = self._sreqs.get(rid)
            if st is None or rid not in computed or not st.block_ids:
                continue
            hashes = list(st.request.block_hashes)
            if not hashes:
                continue
            tables = [list(ids) for ids in st.block_ids]
            by_boundary = handoffs.pop(rid, [])
            first = by_boundary[0] if by_boundary else ()
            meta.saves.append(SaveRequest(rid, hashes, tables, computed[rid] + int(n), handoffs=first))
            # vLLM may hand off several boundaries in one step; the planner takes one per save.
            for entries in by_boundary[1:]:
                meta.saves.append(SaveRequest(rid, hashes, tables, computed[rid] + int(n), handoffs=entries))
        # Hand-offs of requests not scheduled this step: their own saves, on vLLM's block tables.
        block_state = getattr(so, "kv_connector_block_state", None)
        for rid, by_boundary in handoffs.items():
            st = self._sreqs.get(rid)
            tables = block_state.get_block_ids(rid) if block_state is not None else None
            if st is None or tables is None or not st.request.block_hashes:
                continue
            hashes = list(st.request.block_hashes)
            tables = [list(ids) for ids in tables]
            for entries in by_boundary:
                meta.saves.append(SaveRequest(rid, hashes, tables, int(entries[0][2]), handoffs=entries))
        for rid, entries in self._finished_tails.items():
            st_hashes, tables = entries[0], entries[1]
            for group in self._split_by_boundary(entries[2]):
                meta.saves.append(SaveRequest(rid, st_hashes, tables, int(group[0][2]), handoffs=group))
            meta.finished_tails.append(rid)
        self._finished_tails.clear()

    @staticmethod
    def _split_by_boundary(entries) -> List[List[Tuple[int, int, int]]]:
        """vLLM's ``(group, block_id, boundary)`` hand-offs, one list per boundary (in order)."""
        out: Dict[int, List[Tuple[int, int, int]]] = {}
        for g, b, boundary in entries:
            out.setdefault(int(boundary), []).append((int(g), int(b), int(boundary)))
        return [out[k] for k in sorted(out)]

    def _boundary_handoffs(self, so) -> Dict[str, List[List[Tuple[int, int, int]]]]:
        """This step's Mamba ``align`` boundary-state hand-offs (vLLM's
        ``kv_connector_block_state.boundary_state_offloads``), per request and boundary. Those of
        requests finished or preempted in this step are dropped: their blocks may be reused."""
        block_state = getattr(so, "kv_connector_block_state", None)
        offloads = getattr(block_state, "boundary_state_offloads", None) or {}
        gone = set(so.preempted_req_ids or ()) | set(getattr(so, "finished_req_ids", ()) or ())
        out = {}
        for rid, entries in offloads.items():
            if rid in gone or rid not in self._sreqs or not entries:
                continue
            out[rid] = self._split_by_boundary(entries)
        return out

    def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads) -> bool:
        """A finished request's boundary states (vLLM keeps its blocks while this returns True,
        until the worker's ``get_finished`` names the request)."""
        try:
            rid = request.request_id
            st = self._sreqs.get(rid)
            hashes = list(request.block_hashes)
            if st is None or not partial_tail_offloads or not hashes:
                return False
            self._finished_tails[rid] = (hashes, [list(ids) for ids in block_ids], list(partial_tail_offloads))
            return True
        except Exception as err:
            log.warning("kvstride register_finished_partial_tail failed: %r", err)
            return False

    def request_finished_all_groups(self, request, block_ids) -> Tuple[bool, Optional[dict]]:
        """Saves copy their blocks out within the step that computed them, so a finished
        request's blocks are free at once, but while its load is in flight: vLLM frees them
        when the worker reports the load (``finished_recving``)."""
        rid = request.request_id
        self._local.pop(rid, None)
        self._sreqs.pop(rid, None)
        self._recompute.discard(rid)
        if self._pending_loads.pop(rid, None) is not None:  # never sent: nothing writes them
            self._loading.discard(rid)
        return rid in self._loading, None

    def request_finished(self, request, block_ids) -> Tuple[bool, Optional[dict]]:
        return self.request_finished_all_groups(request, (block_ids,))

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches) -> None:
        cfg = self._kv_cache_config
        layout = KVLayout(kv_caches, [list(g.layer_names) for g in cfg.kv_cache_groups], num_blocks=int(cfg.num_blocks))
        pool = StagingPool(int(self._extra.get("staging_bytes", 64 << 20)))
        try:
            pool.register(self.store.register_buffer)
        except Exception as err:
            raise RuntimeError(f"kvstride: the store refused the staging buffer: {err!r}") from err
        self.engine = OffloadEngine(self.planner, Transfer(layout, pool), self.store, name="kvstride-worker")

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Hand this step's loads to the load lane and return: vLLM keeps their requests
        waiting until ``get_finished`` reports them."""
        try:
            meta = self._get_connector_metadata()
        except Exception:
            return
        if not isinstance(meta, KVStrideMetadata) or not meta.loads:
            return
        if self.engine is None:
            log.warning("kvstride: no KV caches registered; %d loads are recomputed", len(meta.loads))
            self._load_failed.update(load.req_id for load in meta.loads)
            return
        self.engine.submit(loads=meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs) -> None:
        return  # whole blocks are saved after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        """Copy this step's blocks to save out of the KV cache (the engine plans and stages
        them before ``submit`` returns); their store puts run on the save lane."""
        try:
            meta = self._get_connector_metadata()
            if not isinstance(meta, KVStrideMetadata) or not meta.saves:
                return
            if self.engine is None:
                raise RuntimeError("no KV caches registered")
            self.engine.submit(saves=meta.saves)
            self._tails_staged.update(meta.finished_tails)
        except Exception as err:
            log.warning("kvstride: this step's saves were skipped: %r", err)
            self._tails_staged.update(getattr(meta, "finished_tails", ()))

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """Nothing to wait for: a save never reads a block after its step."""
        for rid in getattr(kv_connector_metadata, "preempted", ()):
            if self.engine is not None:
                self.engine.finish_request(rid)

    def get_transfer_results(self, finished_req_ids) -> KVConnectorTransferResults:
        """Loads done (failed ones also in ``failed_recving``: vLLM recomputes the request,
        on every model), and finished requests whose tail saves no longer need their blocks."""
        results = KVConnectorTransferResults()
        try:
            self._finished_seen.update(finished_req_ids or ())
            failed, self._load_failed = self._load_failed, set()
            if self.engine is not None:
                got = self.engine.get_finished()
                results.finished_recving.update(got.loads_done)
                failed.update(got.loads_failed)
            results.finished_recving.update(failed)
            results.failed_recving.update(failed)
            ready = self._tails_staged & self._finished_seen
            self._tails_staged -= ready
            self._finished_seen -= ready
            results.finished_sending.update(ready)
            for rid in finished_req_ids or ():
                if self.engine is not None:
                    self.engine.finish_request(rid)
            # Finished requests with nothing staged are never reported: forget them.
            self._finished_seen &= self._tails_staged
        except Exception as err:
            log.warning("kvstride get_finished failed: %r", err)
        return results

    def get_finished(self, finished_req_ids):
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set:
        return set()  # failures go out as failed_recving, which vLLM takes for every model
