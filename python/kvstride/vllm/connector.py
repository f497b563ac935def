"""vLLM KV connector over kvstride's core.

Use it with::

    KVTransferConfig(kv_connector="KVStrideConnector", kv_connector_module_path="kvstride.vllm",
                     kv_role="kv_both", kv_load_failure_policy="recompute",
                     kv_connector_extra_config={"store": "embedded"})

``kv_connector_extra_config`` (README.md lists every key):

- ``store``: ``"embedded"`` (default) keeps the bytes in the workers' host memory, in one
  arena of fixed-size slots per rank (``store_bytes``, default 1 GiB), with the index in the
  scheduler (``kvstride.arena``): it works in every process layout vLLM uses (``uni``,
  ``mp``, ``vllm serve``, TP), within one engine. ``"mooncake"`` is a Mooncake store shared by
  engines and restarts, configured like vLLM's MooncakeStoreConnector (``MOONCAKE_CONFIG_PATH``;
  ``mooncake_*`` keys override it; ``kvstride store serve`` runs a long-lived one);
- ``staging_bytes`` (Mooncake staging, default: what one full step can save), ``model_id`` (the key namespace's
  model part, default the model path), ``cache_prefix``.

The connector never derives a key or a boundary: vLLM's request block hashes and per-group
block ids go to the core's planner (through :class:`kvstride.engine.OffloadEngine`).

Loads are asynchronous: ``get_num_new_matched_tokens`` returns ``(n, True)``, vLLM parks the
request until the worker reports the load in ``finished_recving``, so every group's state
(Mamba included) is in place before the request's first forward. A synchronous load would
land after vLLM's ``preprocess_mamba`` has already copied the hit-state block into the
running state (``gpu_model_runner.py``: ``preprocess_mamba`` runs before the step's
``start_load_kv``), which is how Mamba / conv state used to load wrong. A failed load is
reported in ``failed_recving`` (vLLM 0.32 takes that for every model; block-level errors stop
it on multi-group models) and vLLM recomputes the request; no hit is claimed again for it.

Saves copy their blocks out of the KV cache within the step that computed them (vLLM
guarantees a hand-off block or a block leaving a sliding window only until the end of that
step: ``single_type_kv_cache_manager.py``, ``pop_blocks_for_free``); the store puts run later
on the engine's save lane, so no step waits for another request's saves and a finished
request's blocks are free at once. A step in which vLLM runs no forward calls no
``wait_for_save``; its saves (finished tails, arena jobs) run in ``get_finished`` instead.
Save plans read vLLM's block tables as they are in the step (``kv_connector_block_state``),
where a block that left a sliding window is already the null block: a save that lags behind
never reads a freed block. Mamba ``align`` state is stored only from vLLM's
boundary-state hand-offs (``kv_connector_block_state.boundary_state_offloads`` each step, and
``register_finished_partial_tail`` at a request's end, whose blocks vLLM keeps until
``finished_sending``), never read positionally from a block table vLLM mutates in place.

Nothing raises into vLLM's step: errors become misses, recomputed loads or skipped saves,
each counted (``KVConnectorStats``, Prometheus ``vllm:kvstride_*``) and logged once.
Configuration that cannot work raises ``ValueError`` at construction.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import kvstride
from kvstride.arena import HostArena, SlotIndex, slots_for
from kvstride.engine import LoadRequest, OffloadEngine, SaveRequest
from kvstride.layout import KVLayout
from kvstride.mooncake_config import parse_size
from kvstride.secret import load_secret
from kvstride.stores import KVStore
from kvstride.transfer import StagingPool, Transfer, staging_bytes_for
from kvstride.vllm_checks import check_reproducible_hashes
from kvstride.vllm_stats import KVStridePromMetrics, KVStrideStats, stats_delta

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

__all__ = ["KVStrideConnector", "KVStrideMetadata", "KVStrideWorkerMetadata", "group_specs", "shared_store"]

log = logging.getLogger("kvstride.vllm")

# ---- stores shared by the connectors of one process ------------------------------------

_STORES: Dict[Tuple[str, bytes], KVStore] = {}
_STORE_USERS: Dict[Tuple[str, bytes], int] = {}  # connectors holding each store
_STORES_LOCK = threading.Lock()


def shared_store(name: str, fingerprint: bytes, factory) -> KVStore:
    """The process-wide store for ``(name, fingerprint)``, made by ``factory()`` once; each
    call holds a reference until :func:`release_shared_store`."""
    with _STORES_LOCK:
        key = (name, fingerprint)
        store = _STORES.get(key)
        if store is None:
            store = _STORES[key] = factory()
            _STORE_USERS[key] = 0
        _STORE_USERS[key] += 1
        return store


def release_shared_store(store: KVStore) -> None:
    """Drop one reference to a shared store; the last one closes it (its client, segment
    and buffer registrations go with it)."""
    with _STORES_LOCK:
        key = next((k for k, s in _STORES.items() if s is store), None)
        if key is None:
            return
        _STORE_USERS[key] -= 1
        if _STORE_USERS[key] > 0:
            return
        del _STORES[key], _STORE_USERS[key]
    try:
        store.close()
    except Exception as err:
        log.warning("kvstride: closing the store failed: %r", err)


def drop_shared_stores() -> None:
    """Close and forget every shared store (tests)."""
    with _STORES_LOCK:
        stores = list(_STORES.values())
        _STORES.clear()
        _STORE_USERS.clear()
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
        heads = _total_kv_heads(spec, vllm_config)
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


def _total_kv_heads(spec, vllm_config) -> Optional[int]:
    """The model's KV heads of a group (SEMANTICS §3 replicates keys over ``tp_size //
    heads``). vLLM's spec holds one rank's share, ``max(1, total // tp)``: with fewer heads
    than ranks that is 1 on every rank, so the total comes from the model config."""
    per_rank = getattr(spec, "num_kv_heads", None)
    if per_rank is None:
        return None
    tp = max(1, int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1))
    try:
        total = int(vllm_config.model_config.get_total_num_kv_heads())
    except Exception:
        total = None
    if total is not None and max(1, total // tp) == int(per_rank):
        return total
    return int(per_rank) * tp  # a group whose heads differ from the model's: its own share


def _refuse_unsupported_parallelism(parallel_config) -> None:
    """Pipeline and context parallelism shard the KV cache in ways the keys do not name yet:
    refused rather than stored under keys another shard would read."""
    for setting in ("pipeline_parallel_size", "prefill_context_parallel_size", "decode_context_parallel_size"):
        value = int(getattr(parallel_config, setting, 1) or 1)
        if value > 1:
            raise ValueError(
                f"kvstride does not support {setting}={value} yet (its KV shards would be keyed as "
                f"one); run with {setting}=1, or without the KVStrideConnector"
            )


def _tp_rank(parallel_config, tp_size: int) -> int:
    """This worker's tensor-parallel rank."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # no model-parallel group (a worker built outside vLLM's launcher)
        return int(getattr(parallel_config, "rank", 0) or 0) % tp_size


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
class ArenaCopy:
    """Blocks to copy between the KV cache and arena slots: parallel lists, one entry per
    block. A load that the scheduler could not plan has ``failed`` set (the worker reports
    it, so vLLM recomputes the request)."""

    slots: List[int] = field(default_factory=list)
    groups: List[int] = field(default_factory=list)
    block_ids: List[int] = field(default_factory=list)
    failed: bool = False


@dataclass
class KVStrideMetadata(KVConnectorMetadata):
    loads: List[LoadRequest] = field(default_factory=list)  # worker-planned (Mooncake)
    saves: List[SaveRequest] = field(default_factory=list)
    preempted: List[str] = field(default_factory=list)
    finished_tails: List[str] = field(default_factory=list)  # finished req ids saved this step
    failed_loads: List[str] = field(default_factory=list)  # claimed hits no load could be planned for
    arena_loads: Dict[str, ArenaCopy] = field(default_factory=dict)  # req id -> copy (embedded)
    arena_saves: Dict[int, ArenaCopy] = field(default_factory=dict)  # save job id -> copy


@dataclass
class KVStrideWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: per arena save job, [ranks that wrote it, ranks that failed]; and
    the slots whose value a load found corrupted (the scheduler forgets them)."""

    saves: Dict[int, List[int]] = field(default_factory=dict)
    corrupt_slots: List[int] = field(default_factory=list)

    def aggregate(self, other: "KVStrideWorkerMetadata") -> "KVStrideWorkerMetadata":
        merged = {job: list(counts) for job, counts in self.saves.items()}
        for job, (ok, bad) in other.saves.items():
            counts = merged.setdefault(job, [0, 0])
            counts[0] += ok
            counts[1] += bad
        return KVStrideWorkerMetadata(merged, self.corrupt_slots + other.corrupt_slots)


@dataclass
class _ArenaSaveJob:
    keys: List[str]
    owners: Dict[str, List[str]]
    saves: List[SaveRequest]
    states: list
    ends: List[int]
    failed: set  # req ids whose save is already known to be incomplete
    step: int  # the scheduler step that planned it
    ok: int = 0  # ranks that wrote every slot
    bad: int = 0  # ranks that failed


#: The embedded store's capacity per TP rank without ``store_bytes``.
DEFAULT_STORE_BYTES = 1 << 30

#: Scheduler steps after which an arena save job that no rank reported is abandoned. Every
#: rank reports in the step that ran the copy (vLLM returns it with that step's output), so
#: this bounds only jobs whose report was lost.
ABANDON_AFTER_STEPS = 64


def arena_slot_bytes(kv_cache_config) -> int:
    """An upper bound of one block's bytes on one rank, over every group: what the scheduler
    sizes the arena's slots by (each worker's slots are at most this large)."""
    sizes = [
        int(g.kv_cache_spec.page_size_bytes) * len(g.layer_names) for g in kv_cache_config.kv_cache_groups
    ]
    return max(sizes)


class KVStrideConnector(KVConnectorBase_V1, SupportsHMA):
    """A vLLM KV connector over :class:`OffloadEngine` (see the module docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise ValueError("KVStrideConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._extra = extra
        # The deployment key (issue 17): keyed store keys and, on Mooncake, a MAC on every value.
        # A missing, unreadable, group/other-readable or weak file is a ValueError naming it.
        secret_file = extra.get("secret_file")
        secret = load_secret(secret_file) if secret_file else None
        groups = group_specs(kv_cache_config, vllm_config)
        self.groups = groups
        vllm_h = getattr(kv_cache_config, "hash_block_size", None)
        # vLLM's hash block (its prefix_match_unit when one is set) is the unit kvstride keys by.
        S, H = kvstride.resolve_block_sizes(groups, prefix_match_unit=None if vllm_h is None else int(vllm_h))
        if vllm_h is not None and int(vllm_h) != H:
            raise ValueError(
                f"vLLM hashes blocks of {vllm_h} tokens but kvstride resolves H={H} for groups "
                f"{[(g.kind, g.block_size) for g in groups]}; the request block hashes would not line up"
            )
        fp = _fingerprint(vllm_config, kv_cache_config, groups)
        self.fingerprint = fp
        pc = vllm_config.parallel_config
        _refuse_unsupported_parallelism(pc)
        # The embedded store is the arena: the scheduler's index, the workers' slots.
        self.arena_mode = str(extra.get("store", "embedded")) == "embedded"
        # Keys per TP rank (SEMANTICS §3). The arena's keys never leave the scheduler's index
        # and every rank writes its own shard into the same slot, so it keys as one rank; a
        # Mooncake store is shared by every rank, so each keys (and stripes) its own heads, and
        # the scheduler looks up in every rank's namespace.
        tp_size = 1 if self.arena_mode else max(1, int(getattr(pc, "tensor_parallel_size", 1) or 1))
        tp_rank = _tp_rank(pc, tp_size) if role == KVConnectorRole.WORKER and tp_size > 1 else 0
        namespace = kvstride.Namespace(
            str(extra.get("model_id") or vllm_config.model_config.model),
            cache_prefix=extra.get("cache_prefix"),
            fingerprint=fp,
            tp_rank=tp_rank,
        )
        self.planner = kvstride.KeyPlanner(
            groups, hash_block_size=H, scheduler_block_size=S, namespace=namespace, tp_size=tp_size, tp_rank=tp_rank,
            secret=secret,
        )
        if self.arena_mode:
            self.store = None
            store_bytes = parse_size(extra.get("store_bytes", DEFAULT_STORE_BYTES), "store_bytes")
            self.num_slots = slots_for(store_bytes, arena_slot_bytes(kv_cache_config))
        else:
            # Engines share what they store: their block hashes must agree.
            check_reproducible_hashes(vllm_config, shared=True)
            if secret is None:
                log.warning(
                    "kvstride: store 'mooncake' without a secret_file: values are unauthenticated and keys are a "
                    "public function of the tokens, so any client of the Mooncake master can write KV this engine "
                    "loads and probe which prompts were sent; set kv_connector_extra_config['secret_file'] "
                    "(`kvstride store serve --secret-file PATH` creates one; README: Trust model)"
                )
            self.store = self._make_store(extra, bytes.fromhex(fp), secret)
        self.engine: Optional[OffloadEngine] = None
        self.world_size = max(1, int(getattr(pc, "world_size", 1) or 1))
        # scheduler side, arena
        self.index: Optional[SlotIndex] = None
        self._load_pins: Dict[str, List[int]] = {}  # req id -> slots pinned for its load
        self._arena_jobs: Dict[int, _ArenaSaveJob] = {}
        self._next_job = 0
        self._step = 0  # scheduler steps (build_connector_meta calls)
        # worker side, arena
        self.arena: Optional[HostArena] = None
        self._arena_loader: Optional[ThreadPoolExecutor] = None
        self._arena_inflight: Dict[str, Tuple[Future, ArenaCopy]] = {}
        self._arena_reports: Dict[int, List[int]] = {}
        self._corrupt_slots: List[int] = []
        # scheduler side
        self._requests: Dict[str, Any] = {}  # req id -> vLLM's Request, while it runs
        self._local: Dict[str, int] = {}
        self._pending_loads: Dict[str, LoadRequest] = {}
        self._loading: set = set()  # req ids whose asynchronous load is in flight
        self._failed_allocs: set = set()  # claimed hits whose load could not even be recorded
        self._recompute: set = set()  # req ids whose load failed: no hit is claimed for them again
        self._finished_tails: Dict[str, tuple] = {}  # req id -> (hashes, tables, hand-offs)
        # worker side
        self._saved_meta: Optional[KVStrideMetadata] = None  # the last metadata whose saves ran
        self._tails_staged: set = set()  # finished requests whose tail saves left their blocks
        self._finished_seen: set = set()  # finished req ids vLLM named, not yet reported
        self._recv_done: set = set()  # loads completed, not yet reported to vLLM
        self._load_failed: set = set()  # loads failed, not yet reported to vLLM
        # The connector's own outcomes (the engine counts its own); the step thread and the
        # arena loader's results both land here, under the lock.
        self._counters: collections.Counter = collections.Counter()
        self._seconds: collections.Counter = collections.Counter()
        self._counters_lock = threading.Lock()
        self._logged: set = set()
        self._stats_last: dict = {}  # the engine counters last reported to vLLM
        self.matched_tokens = 0  # external tokens reported to vLLM (scheduler side)
        self._mooncake_reset_logged = False
        if role == KVConnectorRole.SCHEDULER:
            # Lookups (and, for the arena, save plans) need only the planner and the index or
            # store: no KV tensors on this side.
            if self.arena_mode:
                self.index = SlotIndex(self.num_slots)
            store = self.index if self.arena_mode else self.store
            self.engine = OffloadEngine(self.planner, None, store, name="kvstride-sched")

    # ---- shared ----------------------------------------------------------------------------

    @staticmethod
    def _make_store(extra: dict, fingerprint: bytes, secret: Optional[bytes] = None) -> KVStore:
        """The Mooncake client, configured the way vLLM's MooncakeStoreConnector is
        (``MOONCAKE_CONFIG_PATH``), explicit ``mooncake_*`` keys overriding the file."""
        kind = str(extra.get("store"))
        if kind != "mooncake":
            raise ValueError(f"unknown kvstride store {kind!r}; use 'embedded' (the default) or 'mooncake'")
        from kvstride.mooncake_config import resolve_client_config
        from kvstride.stores import MooncakeStore

        config = resolve_client_config(extra)
        name = f"mooncake:{config.master_server_address}:{extra.get('store_name', 'default')}"
        if secret is not None:  # connectors with different keys never share a client; the key itself stays out
            name += ":key:" + hashlib.sha256(b"kvstride secret id\0" + secret).hexdigest()[:16]
        return shared_store(
            name, fingerprint, lambda: MooncakeStore.from_config(config, fingerprint=fingerprint, secret=secret)
        )

    # ---- stats (both roles: lookups count on the scheduler, transfers on the workers) ---------

    def count(self, name: str, n: int = 1) -> None:
        with self._counters_lock:
            self._counters[name] += n

    def _add_seconds(self, operation: str, seconds: float) -> None:
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
        if self.store is not None:  # forged values the store's MAC check refused (issue 17)
            out["mac_rejected"] += self.store.counters.get("mac_rejected", 0)
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

    @classmethod
    def build_kv_connector_stats(cls, data=None) -> KVStrideStats:
        return KVStrideStats(data=data) if data is not None else KVStrideStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVStridePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """vLLM 0.33's sleep mode frees and restores the KV caches under the connector's
        registered views and in-flight copies: not supported."""
        return False

    def shutdown(self) -> None:
        """Stop the lanes and the loader (waiting for what runs), then let go of the store:
        the last connector of the process that uses it closes it."""
        loader, self._arena_loader = self._arena_loader, None
        if loader is not None:
            loader.shutdown(wait=True)
        engine, self.engine = self.engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as err:
                log.warning("kvstride engine shutdown failed: %r", err)
        store, self.store = self.store, None
        if store is not None:
            release_shared_store(store)

    # ---- scheduler side ------------------------------------------------------------------

    def reset_cache(self) -> Optional[bool]:
        """``reset_prefix_cache(reset_connector=True)``. The embedded store forgets every block
        (False while a load or a save is in flight; vLLM's caller may try again). A Mooncake
        store is shared with other engines and one of them does not clear it: False."""
        if self.index is not None:
            return self.index.clear()
        if self.store is not None:
            if not self._mooncake_reset_logged:
                self._mooncake_reset_logged = True
                log.warning(
                    "kvstride: reset_connector cannot clear the Mooncake store, other engines share it; "
                    "to drop what it holds use another cache_prefix or restart its holder (logged once)"
                )
            return False
        return None

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        try:
            rid = request.request_id
            if self.engine is None or rid in self._recompute:
                return 0, False
            # The core keeps the last token for vLLM to compute (SEMANTICS §6).
            hit = self.engine.lookup([(rid, list(request.block_hashes), int(request.num_tokens))])[rid]
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
        except Exception as err:  # the request waits for a load: report it failed, never hang
            log.warning("kvstride update_state_after_alloc failed, the hit is recomputed: %r", err)
            self._failed_allocs.add(request.request_id)
            self._loading.add(request.request_id)

    def update_connector_output(self, connector_output) -> None:
        try:
            for rid in connector_output.finished_recving or ():
                self._loading.discard(rid)
                if self.index is not None:
                    self.index.unpin(self._load_pins.pop(rid, ()))
            # vLLM asks again after a failed load; a store that failed once is not trusted for
            # the same request (the retry could fail the same way, forever).
            self._recompute.update(connector_output.failed_recving or ())
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(meta, KVStrideWorkerMetadata) and self.index is not None:
                self.index.drop_slots(meta.corrupt_slots)
                self._arena_saves_reported(meta.saves)
        except Exception as err:  # never into vLLM's scheduler; stale jobs are abandoned later
            self._log_once("connector-output", "kvstride update_connector_output failed: %r", err)
            self.count("scheduler_errors")

    def on_new_request(self, request) -> None:
        self._requests[request.request_id] = request

    def build_connector_meta(self, scheduler_output) -> KVStrideMetadata:
        self._step += 1
        if self.index is not None:
            self._abandon_stale_jobs()
        meta = KVStrideMetadata(loads=list(self._pending_loads.values()), failed_loads=sorted(self._failed_allocs))
        self._pending_loads.clear()
        self._failed_allocs.clear()
        if self.index is not None:  # pin the loads' slots before any save can evict one
            meta.arena_loads = {load.req_id: self._plan_arena_load(load) for load in meta.loads}
            meta.loads = []
        try:
            self._build_saves(scheduler_output, meta)
            if self.index is not None:
                self._plan_arena_saves(meta)
        except Exception as err:  # saves are best effort; loads must go out
            log.warning("kvstride: this step's saves were skipped: %r", err)
            meta.saves = []
            # Finished requests held for their tail are released all the same.
            meta.finished_tails = sorted(set(meta.finished_tails) | set(self._finished_tails))
            self._finished_tails.clear()
        return meta

    # ---- the arena, scheduler side ----------------------------------------------------------

    def _plan_arena_load(self, load: LoadRequest) -> ArenaCopy:
        try:
            plan = self.planner.plan_load(
                load.block_hashes, load.block_ids, load.hit_tokens, local_tokens=load.local_tokens
            )
            slots = None if plan.missing else self.index.pin([key for key, _, _ in plan.gets])
            if slots is None:
                self.engine.count("load_missing_destination" if plan.missing else "load_not_ready")
                return ArenaCopy(failed=True)
            self._load_pins[load.req_id] = slots
            return ArenaCopy(slots, [g for _, g, _ in plan.gets], [b for _, _, b in plan.gets])
        except Exception as err:
            log.warning("kvstride: load of %s could not be planned, it is recomputed: %r", load.req_id, err)
            return ArenaCopy(failed=True)

    def _plan_arena_saves(self, meta: KVStrideMetadata) -> None:
        """The step's saves planned here (the index knows what is stored), each new key given
        a slot; workers only copy. A key without a free or evictable slot is not stored."""
        saves, meta.saves = meta.saves, []
        if not saves:
            return
        states = self.engine.request_states([save.req_id for save in saves])
        entries, owners, ends, failed = self.engine.plan_saves(saves, states, self.index.known)
        keys = [key for key, _, _ in entries]
        slots = self.index.reserve(keys)
        kept = [(e, s) for e, s in zip(entries, slots) if s is not None]
        if len(kept) < len(entries):
            self.engine.count("put_full", len(entries) - len(kept))
            failed.update(rid for (key, _, _), s in zip(entries, slots) if s is None for rid in owners[key])
        job = _ArenaSaveJob([e[0] for e, _ in kept], owners, saves, states, ends, failed, self._step)
        for save, state in zip(saves, states):
            if save.req_id in failed:
                state.planned = state.offset  # the next step plans the missing blocks again
        if not kept:
            self._finish_arena_job(job, failed)
            return
        job_id = self._next_job = self._next_job + 1
        self._arena_jobs[job_id] = job
        meta.arena_saves[job_id] = ArenaCopy([s for _, s in kept], [e[1] for e, _ in kept], [e[2] for e, _ in kept])

    def _abandon_stale_jobs(self) -> None:
        """Arena save jobs no rank reported within ``ABANDON_AFTER_STEPS`` steps (a report lost
        to a worker's error): their slots are freed and their saves count as failed."""
        oldest = self._step - ABANDON_AFTER_STEPS
        for job_id in [j for j, job in self._arena_jobs.items() if job.step < oldest]:
            job = self._arena_jobs.pop(job_id)
            self.index.abandon(job.keys)
            self.engine.count("save_jobs_abandoned")
            job.failed.update(rid for key in job.keys for rid in job.owners[key])
            self._finish_arena_job(job, job.failed)

    def _arena_saves_reported(self, reports: Dict[int, List[int]]) -> None:
        for job_id, (ok, bad) in reports.items():
            job = self._arena_jobs.get(job_id)
            if job is None:
                continue
            job.ok += ok
            job.bad += bad
            if job.ok + job.bad < self.world_size:
                continue
            del self._arena_jobs[job_id]
            if job.bad:
                self.index.abandon(job.keys)
                self.engine.count("put_error", len(job.keys))
                job.failed.update(rid for key in job.keys for rid in job.owners[key])
            else:
                self.index.confirm(job.keys)
                self.engine.count("put_ok", len(job.keys))
            self._finish_arena_job(job, job.failed)

    def _finish_arena_job(self, job: _ArenaSaveJob, failed: set) -> None:
        for save, state, end in zip(job.saves, job.states, job.ends):
            if save.req_id in failed:
                state.planned = state.offset
                self.engine.count("saves_failed")
            else:
                state.offset = max(state.offset, end)
                self.engine.count("saves_ok")

    def _build_saves(self, so, meta: KVStrideMetadata) -> None:
        meta.preempted.extend(so.preempted_req_ids or ())
        computed: Dict[str, int] = {new.req_id: int(new.num_computed_tokens) for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update((rid, int(n)) for rid, n in zip(cached.req_ids, cached.num_computed_tokens))
        # vLLM's block tables as they are now: a sliding-window or chunked-local block that left
        # the window is the null block (0) there, freed and maybe another request's, so no plan
        # reads it, however far a failed save left the saved offset behind.
        block_state = getattr(so, "kv_connector_block_state", None)
        if block_state is None:
            self._log_once("no-block-state", "kvstride: vLLM offers no kv_connector_block_state; nothing is saved")
            return
        handoffs = self._boundary_handoffs(so)
        for rid, n in so.num_scheduled_tokens.items():
            request = self._requests.get(rid)
            tables = block_state.get_block_ids(rid)
            if request is None or rid not in computed or tables is None or not request.block_hashes:
                continue
            hashes = list(request.block_hashes)
            tables = [list(ids) for ids in tables]
            by_boundary = handoffs.pop(rid, [])
            first = by_boundary[0] if by_boundary else ()
            meta.saves.append(SaveRequest(rid, hashes, tables, computed[rid] + int(n), handoffs=first))
            # vLLM may hand off several boundaries in one step; the planner takes one per save.
            for entries in by_boundary[1:]:
                meta.saves.append(SaveRequest(rid, hashes, tables, computed[rid] + int(n), handoffs=entries))
        # Hand-offs of requests not scheduled this step: their own saves, on vLLM's block tables.
        for rid, by_boundary in handoffs.items():
            request = self._requests.get(rid)
            tables = block_state.get_block_ids(rid)
            if request is None or tables is None or not request.block_hashes:
                continue
            hashes = list(request.block_hashes)
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
            if rid in gone or rid not in self._requests or not entries:
                continue
            out[rid] = self._split_by_boundary(entries)
        return out

    def register_finished_partial_tail(self, request, block_ids, partial_tail_offloads) -> bool:
        """A finished request's boundary states (vLLM keeps its blocks while this returns True,
        until the worker's ``get_finished`` names the request)."""
        try:
            rid = request.request_id
            hashes = list(request.block_hashes)
            if rid not in self._requests or not partial_tail_offloads or not hashes:
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
        self._requests.pop(rid, None)
        self._recompute.discard(rid)
        if self.index is not None:
            self.engine.finish_request(rid)
        if self._pending_loads.pop(rid, None) is not None:  # never sent: nothing writes them
            self._loading.discard(rid)
        return rid in self._loading, None

    def request_finished(self, request, block_ids) -> Tuple[bool, Optional[dict]]:
        return self.request_finished_all_groups(request, (block_ids,))

    # ---- worker side -----------------------------------------------------------------------

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
            staging_bytes = staging_bytes_for(layout, step_tokens, self.planner)
        pool = StagingPool(staging_bytes)
        try:
            pool.register(self.store.register_buffer)
        except Exception as err:
            raise RuntimeError(f"kvstride: the store refused the staging buffer: {err!r}") from err
        self.engine = OffloadEngine(self.planner, Transfer(layout, pool), self.store, name="kvstride-worker")

    def start_load_kv(self, forward_context, **kwargs) -> None:
        """Hand this step's loads to the load lane and return: vLLM keeps their requests
        waiting until ``get_finished`` reports them."""
        meta = None
        try:
            meta = self._get_connector_metadata()
            if not isinstance(meta, KVStrideMetadata):
                return
            self._start_loads(meta)
        except Exception as err:  # never into vLLM's step: every load of the step is recomputed
            self._log_once("start-load", "kvstride: this step's loads failed, they are recomputed: %r", err)
            self.count("load_job_errors")
            if isinstance(meta, KVStrideMetadata):
                self._load_failed.update(meta.failed_loads)
                self._load_failed.update(load.req_id for load in meta.loads)
                self._load_failed.update(rid for rid in meta.arena_loads if rid not in self._arena_inflight)

    def _start_loads(self, meta: KVStrideMetadata) -> None:
        if meta.failed_loads:
            self._load_failed.update(meta.failed_loads)
            self.count("loads_failed", len(meta.failed_loads))
        for rid, copy in meta.arena_loads.items():
            self._start_arena_load(rid, copy)
        if not meta.loads:
            return
        if self.engine is None:
            self._log_once("no-kv-caches", "kvstride: no KV caches registered (or shut down); loads are recomputed")
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
        except Exception:
            return
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
            if meta.saves:
                if self.engine is None:
                    raise RuntimeError("no KV caches registered")
                self.engine.submit(saves=meta.saves)
        except Exception as err:
            self._log_once("save-step", "kvstride: this step's saves were skipped: %r", err)
            self.count("save_job_errors")
        finally:  # a finished request's blocks are released whether or not its tail was stored
            self._tails_staged.update(meta.finished_tails)

    def handle_preemptions(self, kv_connector_metadata) -> None:
        """Nothing to wait for: a save never reads a block after its step."""
        try:
            for rid in getattr(kv_connector_metadata, "preempted", ()):
                if self.engine is not None:
                    self.engine.finish_request(rid)
        except Exception as err:
            self._log_once("preemptions", "kvstride handle_preemptions failed: %r", err)

    def get_transfer_results(self, finished_req_ids) -> KVConnectorTransferResults:
        """Loads done (failed ones also in ``failed_recving``: vLLM recomputes the request,
        on every model), and finished requests whose tail saves no longer need their blocks.
        Completions taken from the engine wait in ``_recv_done`` / ``_load_failed`` until they
        are handed to vLLM, so none is lost to an error on the way."""
        results = KVConnectorTransferResults()
        try:
            meta = self._get_connector_metadata() if self.has_connector_metadata() else None
            if isinstance(meta, KVStrideMetadata):
                self._run_saves(meta)
            self._finished_seen.update(finished_req_ids or ())
            if self.engine is not None:
                got = self.engine.get_finished()
                self._recv_done.update(got.loads_done)
                self._load_failed.update(got.loads_failed)
            for rid, ok in self._arena_loads_done():
                self._recv_done.add(rid)
                if not ok:
                    self._load_failed.add(rid)
            for rid in finished_req_ids or ():
                if self.engine is not None:
                    self.engine.finish_request(rid)
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

    def get_finished(self, finished_req_ids):
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    # ---- the arena, worker side -------------------------------------------------------------

    def _arena_save(self, job_id: int, copy: ArenaCopy) -> None:
        """Copy the blocks into their slots now, within the step (the blocks may be reused
        after it); the scheduler makes the keys readable once every rank reported."""
        start = time.perf_counter()
        try:
            self.arena.save(copy.slots, copy.groups, copy.block_ids)
            self._arena_reports[job_id] = [1, 0]
            self.count("put_ok", len(copy.slots))
            self.count("bytes_stored", int(self.arena.block_bytes[np.asarray(copy.groups)].sum()))
        except Exception as err:
            self._log_once("arena-save", "kvstride: arena save job %d failed: %r", job_id, err)
            self._arena_reports[job_id] = [0, 1]
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
        if not self._arena_reports and not self._corrupt_slots:
            return None
        reports, self._arena_reports = self._arena_reports, {}
        corrupt, self._corrupt_slots = self._corrupt_slots, []
        return KVStrideWorkerMetadata(reports, corrupt)

    def get_block_ids_with_load_errors(self) -> set:
        return set()  # failures go out as failed_recving, which vLLM takes for every model
