"""The connector's scheduler side: lookups, the block tables and hand-offs vLLM's scheduler
holds, and the step's saves and loads, planned by the core and placed in the store by its
placement (:mod:`kvstride.stores.placement`: the embedded store's slot index, or Mooncake's
keys per rank), so that the workers only copy and call the store with what they are sent.

Saves read vLLM's block tables as they are in the step (``kv_connector_block_state``), where
a block that left a sliding window is already the null block: a save that lags behind never
reads a freed block. Mamba ``align`` state is stored only from vLLM's boundary-state
hand-offs (``kv_connector_block_state.boundary_state_offloads`` each step, and
``register_finished_partial_tail`` at a request's end, whose blocks vLLM keeps until
``finished_sending``), never read positionally from a block table vLLM mutates in place.

It is the one place where vLLM's scheduler calls meet the core's plans; the lookups
(:mod:`kvstride.vllm.lookups`), request bindings and metadata are in modules of their own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

from kvstride.arena.index import overdue
from kvstride.capacity import Ghost, prefill_per_byte
from kvstride.engine import LoadRequest, OffloadEngine, SaveRequest
from kvstride.vllm.bindings import RequestBindings
from kvstride.vllm.config import ConnectorConfig
from kvstride.vllm.lookups import Lookups
from kvstride.vllm.metadata import KVStrideMetadata, KVStrideWorkerMetadata
from kvstride.vllm.stats import Outcomes

__all__ = ["SchedulerSide", "ABANDON_AFTER_STEPS"]

log = logging.getLogger("kvstride.vllm")

#: Scheduler steps after which a save job not every rank reported is abandoned (planned
#: again). An arena job is reported in the step that ran its copy, a Mooncake job once its
#: puts finished on the save lane; this bounds jobs whose report was lost or very late.
ABANDON_AFTER_STEPS = 64

#: Prefix boundaries remembered for junctions (SEMANTICS §8), least recently seen forgotten
#: first: about 20 MiB of 32-byte hashes in Python objects.
JUNCTION_MEMORY = 1 << 17


def allocated_blocks(scheduler_output) -> List[int]:
    """The block ids a step's scheduling handed to requests, of every group: a new or resumed
    request's whole table (prefix hits included), a running request's new blocks."""
    tables = [new.block_ids for new in scheduler_output.scheduled_new_reqs]
    tables += [ids for ids in scheduler_output.scheduled_cached_reqs.new_block_ids if ids]
    return sorted({block for per_group in tables for table in per_group for block in table})


def load_blocks(loads: Dict[str, Dict[int, list]]) -> List[int]:
    """The block ids ``KVStrideMetadata.loads`` write, of every rank."""
    return sorted({block for per_rank in loads.values() for entries in per_rank.values() for _, _, block in entries})


def _nothing_known(keys) -> List[bool]:
    """Plans keep every key; what need not be written is decided once for every rank's keys
    (``SchedulerSide._without_known``)."""
    return [False] * len(keys)


@dataclass
class _SaveJob:
    """A step's saves, out on the workers; ``keys`` are what the placement placed."""

    keys: List[str]
    owners: Dict[str, List[str]]
    saves: List[SaveRequest]
    states: list
    ends: List[int]
    failed: set  # req ids whose save is already known to be incomplete
    step: int  # the scheduler step that planned it
    starts: List[int]  # where each save's plan started (its request's planned offset)
    ok: int = 0  # ranks that wrote every key
    bad: int = 0  # ranks that failed
    deferred: int = 0  # ranks that left some keys to a later step


class SchedulerSide(Outcomes):
    """The scheduler process's half of :class:`kvstride.vllm.KVStrideConnector`."""

    def __init__(self, config: ConnectorConfig, placement) -> None:
        super().__init__()
        self.planner = config.planner
        self.rank_planners = config.rank_planners  # each TP rank's keys (one for the arena)
        self.world_size = config.world_size
        self.placement = placement  # kvstride.stores.placement: where keys go in the store
        self._disk_tier = getattr(placement, "disk", None) is not None  # the embedded store's
        # Lookups and plans need only the planner and the placement: no KV tensors here.
        self.engine = OffloadEngine(self.planner, None, placement, name="kvstride-sched",
                                    lookup_timeout_s=config.lookup_timeout_s)
        self._jobs: Dict[int, _SaveJob] = {}  # save jobs the workers have not all reported
        # Save jobs given up before every rank reported: job id -> [ranks reported, the slots
        # the placement holds until the rest report (their copies may still write them)].
        self._given_up: Dict[int, list] = {}
        self._load_hits: Dict[str, int] = {}  # req id -> hit tokens of its load in flight
        self._next_job = 0
        self._step = 0  # scheduler steps (build_connector_meta calls)
        self._requests: Dict[str, Any] = {}  # req id -> vLLM's Request, while it runs
        self._waiting: Dict[str, Any] = {}  # requests not allocated yet, in arrival order
        # Each request's planners: its keys bound to its adapter's and multimodal items' content
        self.bindings = RequestBindings(config, self.count)
        # The Mamba state block ("align" mode): a prefill chunk ends on one, or vLLM hands off
        # no state there (0: no such group).
        self._state_block = max((g.block_size for g in config.groups if g.kind == "mamba" and g.mamba_mode == "align"),
                                default=0)
        self.lookups = Lookups(self.engine, self.planner, placement, config.lookup_batch,
                               planner_of=self._lookup_planner, count=self.count)
        # TP ranks whose worker disabled its store (KVStrideWorkerMetadata.store_disabled):
        # while any is, no hit is claimed and nothing is saved (every load and save would fail)
        self._disabled_ranks: set = set()
        self._local: Dict[str, int] = {}
        self._pending_loads: Dict[str, LoadRequest] = {}
        self._loading: set = set()  # req ids whose asynchronous load is in flight
        self._failed_allocs: set = set()  # claimed hits whose load could not even be recorded
        self._recompute: set = set()  # req ids whose load failed: no hit is claimed for them again
        self._finished_tails: Dict[str, tuple] = {}  # req id -> (hashes, tables, hand-offs, boundaries)
        self.matched_tokens = 0  # external tokens reported to vLLM
        # SEMANTICS §8: window tails only where a later lookup can hit, under vLLM's retention
        # (None, dense checkpoints: every boundary); junctions from the prefixes seen before.
        self._admitting = config.admission == "kvstride" and config.retention_interval is not None
        self._retention_interval = config.retention_interval
        self._seen_prefixes = Ghost(JUNCTION_MEMORY)
        self._admitted: Dict[str, Optional[List[int]]] = {}  # req id -> its hit-capable boundaries
        self._stamps: Dict[str, int] = {}  # req id -> its recency in the placement's eviction order
        self._worths: Dict[str, float] = {}  # req id -> its worth there (prefill saved per slot)
        self._slot_values = [1] * len(self.planner.hashes_per_block)  # a value fills one slot
        self._claims_hits = config.prefix_caching
        if not self._claims_hits:
            self._log_once("no-prefix-caching", "kvstride: vLLM runs this engine without prefix caching (its platform "
                           "turns it off for some models, e.g. MLA on vLLM's CPU backend, whose prefill cannot attend "
                           "to a prefix it did not compute): no request is loaded from the store, every one computes "
                           "its prompt; saves go on")

    def shutdown(self) -> None:
        self._shut_engine()

    def _lookup_planner(self, request):
        """The planner a request's lookup keys come from (rank 0's; None: never looked up)."""
        planners = self.bindings.of(request)
        return None if planners is None else planners[0]

    def reset_cache(self) -> Optional[bool]:
        """``reset_prefix_cache(reset_connector=True)``: the embedded store forgets every block
        (False while a load or a save is in flight; vLLM's caller may try again); a Mooncake
        store is shared with other engines and one of them does not clear it (False)."""
        return self.placement.reset()

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        try:
            rid = request.request_id
            if self.engine is None or rid in self._recompute or not self._claims_hits:
                return 0, False
            if self._disabled_ranks:  # a load would fail on those ranks: a miss, not a failure
                self.count("lookups_store_disabled")
                return 0, False
            hit = self.lookups.hit(request, self._waiting, self._recompute.__contains__, num_computed_tokens)
            ext = max(0, int(hit) - int(num_computed_tokens))
            if ext:
                self._local[rid] = int(num_computed_tokens)
                self.matched_tokens += ext
            # Asynchronous: vLLM parks the request until the load is reported, so every
            # group's state (Mamba included) is in place before its first forward.
            return ext, ext > 0
        except Exception as err:  # never into vLLM's step: a miss, counted
            self.count("lookup_errors")
            self._log_once("lookup", "kvstride lookup failed, treating as a miss: %r", err)
            return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        try:
            rid = request.request_id
            self._waiting.pop(rid, None)
            self.lookups.allocated(rid)
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
            meta = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(meta, KVStrideWorkerMetadata) and meta.store_disabled:
                self._store_states(meta.store_disabled)
            if isinstance(meta, KVStrideWorkerMetadata) and meta.disk_late:  # before the loads they failed
                self.placement.disk_reads_late(meta.disk_late)
            if isinstance(meta, KVStrideWorkerMetadata) and any(meta.disk_paces):
                self.placement.read_admission.timed(*meta.disk_paces)
            self._loads_reported(connector_output.finished_recving, connector_output.failed_recving)
            # vLLM asks again after a failed load; a store that failed once is not trusted for
            # the same request (the retry could fail the same way, forever).
            self._recompute.update(connector_output.failed_recving or ())
            if isinstance(meta, KVStrideWorkerMetadata):
                self.placement.forget_corrupt(meta.corrupt)
                self._saves_reported(meta.saves)
                if meta.disk or meta.disk_corrupt:  # only the embedded store's disk tier reports these
                    self.placement.disk_written(meta.disk)
                    self.placement.forget_disk_corrupt(meta.disk_corrupt)
        except Exception as err:  # never into vLLM's scheduler; stale jobs are abandoned later
            self._log_once("connector-output", "kvstride update_connector_output failed: %r", err)
            self.count("scheduler_errors")

    def _store_states(self, disabled: Dict[int, bool]) -> None:
        """Workers' stores disabled or back (each rank reports a change once)."""
        for rank, off in disabled.items():
            if off and rank not in self._disabled_ranks:
                log.warning("kvstride: the store of TP rank %s is disabled: no hit is claimed and nothing is saved "
                            "until it is back", rank)
            elif not off and rank in self._disabled_ranks:
                log.warning("kvstride: the store of TP rank %s is back", rank)
            (self._disabled_ranks.add if off else self._disabled_ranks.discard)(int(rank))

    def on_new_request(self, request) -> None:
        self._requests[request.request_id] = request
        self._waiting[request.request_id] = request
        try:  # its content is read now: vLLM may drop its multimodal data once scheduled
            self.bindings.of(request)
        except Exception as err:  # never into vLLM: bound when first looked up, else not offloaded
            self._log_once("bind", "kvstride: a request's adapter or multimodal content could not be read: %r", err)

    def build_connector_meta(self, scheduler_output) -> KVStrideMetadata:
        """The step's plans: every load and save of both stores is planned here, from the
        hashes and block tables vLLM's scheduler holds; the workers only copy and call the
        store with what the metadata names (O(blocks that move), never a hash or a table)."""
        self._step += 1
        self.lookups.step = self._step
        if self._disk_tier:  # the prompt pace the disk's reads are weighed against
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            self.placement.read_admission.prompt_step(sum(scheduled.values()), len(scheduled))
        self._abandon_stale_jobs()
        meta = KVStrideMetadata(failed_loads=sorted(self._failed_allocs))
        try:
            meta.allocated = allocated_blocks(scheduler_output)
        except Exception as err:  # the workers then wait for every pending save before the forward
            self._log_once("allocated", "kvstride: this step's allocated blocks are unknown: %r", err)
            meta.allocated = None
        loads = list(self._pending_loads.values())
        self._pending_loads.clear()
        self._failed_allocs.clear()
        for load in loads:  # before the saves: the arena pins the loads' slots before any eviction
            self._plan_load(load, meta)
        if meta.allocated is not None and meta.loads:
            # A request waiting for its load holds blocks no scheduled request names: the load writes them.
            meta.allocated = sorted(set(meta.allocated).union(load_blocks(meta.loads)))
        try:
            saves = self._build_saves(scheduler_output, meta)
            if saves and not self._disabled_ranks:
                self._plan_saves(saves, meta)
        except Exception as err:  # saves are best effort; loads must go out
            log.warning("kvstride: this step's saves were skipped: %r", err)
            meta.saves = {}
            # Finished requests held for their tail are released all the same.
            meta.finished_tails = sorted(set(meta.finished_tails) | set(self._finished_tails))
            self._finished_tails.clear()
        for rid in meta.finished_tails:  # their tails are planned: their ranks and offsets go
            self._stamps.pop(rid, None)
            self._worths.pop(rid, None)
            self.bindings.forget(rid)
            self.engine.finish_request(rid)
        if self._disk_tier:
            meta.disk_writes = self.placement.take_disk_writes()
            meta.disk_cancelled = self.placement.take_disk_cancelled()
            for name, n in self.placement.take_counts().items():
                self.count(name, n)
            self.placement.flush()
        return meta

    # ---- loads --------------------------------------------------------------------------------

    def _plan_load(self, load: LoadRequest, meta: KVStrideMetadata) -> None:
        """The load's gets, per rank, as the placement places them (the arena pins its slots
        until the load is reported). A load that cannot be planned is reported failed by the
        workers, and vLLM recomputes it."""
        rid = load.req_id
        try:
            planners = self.bindings.of_id(rid)
            if planners is None:
                raise RuntimeError("a load of a request whose keys are bound to nothing")
            plans = [
                planner.plan_load(load.block_hashes, load.block_ids, load.hit_tokens, local_tokens=load.local_tokens)
                for planner in planners
            ]
            missing = next((plan for plan in plans if plan.missing), None)
            if missing is not None:
                self.engine.count("load_missing_destination")
                self._fail_load(rid, meta)
                return
            stamp, worth = None, 1.0
            if self.placement.ranks_evictions:  # a load makes its prefix the request's: its saves extend it
                stamp = self._stamps[rid] = self.placement.stamp()
                worth = self._worth(rid)
            placed = self.placement.place_load(rid, [list(plan.gets) for plan in plans], stamp, worth)
            if placed is None:  # gone from the store since the lookup
                self.engine.count("load_not_ready")
                self._fail_load(rid, meta)
                return
            self._load_hits[rid] = load.hit_tokens
            meta.loads[rid] = placed
            if self._disk_tier:
                reads = self.placement.disk_reads(rid)
                if reads:
                    meta.disk_reads[rid] = reads
                    deadline = self.placement.read_admission.read_deadline(load.hit_tokens - load.local_tokens)
                    if deadline is not None:
                        meta.disk_read_deadlines[rid] = deadline
                    self.engine.count("loads_from_disk")
        except Exception as err:
            log.warning("kvstride: load of %s could not be planned, it is recomputed: %r", rid, err)
            self._fail_load(rid, meta)

    def _fail_load(self, rid: str, meta: KVStrideMetadata) -> None:
        self._load_hits.pop(rid, None)
        meta.failed_loads.append(rid)

    def _loads_reported(self, done, failed) -> None:
        """Loads the workers finished: the placement releases them (the arena's pins), and a
        loaded prefix is in the store, so the request's saves start after it."""
        failed = set(failed or ())
        for rid in done or ():
            self._loading.discard(rid)
            self.placement.load_done(rid, ok=rid not in failed)
            hit = self._load_hits.pop(rid, None)
            if hit is None or rid in failed or rid not in self._requests:
                continue
            (state,) = self.engine.request_states([rid])
            state.loaded(self.planner, hit)

    # ---- saves --------------------------------------------------------------------------------

    def _plan_saves(self, saves: List[SaveRequest], meta: KVStrideMetadata) -> None:
        """Plan the step's saves with every rank's planner from the requests' offsets, minus
        what the store has or is being written (one call for every rank's keys), and place
        them (the arena gives each new key a slot)."""
        states = self.engine.request_states([save.req_id for save in saves])
        start = [state.planned for state in states]
        per_rank = [[] for _ in self.rank_planners]
        owners: Dict[str, List[str]] = {}
        failed: set = set()
        tails: set = set()  # keys only a partial tail names: a worker that defers them counts them lost
        ends = [0] * len(saves)
        # Each key's depth, for a placement that evicts (the arena): deepest blocks first.
        depths: Optional[Dict[str, int]] = {} if self.placement.ranks_evictions else None
        # The saves of requests bound alike are planned together, by their planners.
        by_binding: Dict[int, Tuple[list, List[int]]] = {}
        for i, save in enumerate(saves):
            planners = self.bindings.of_id(save.req_id)
            by_binding.setdefault(id(planners), (planners, []))[1].append(i)
        for planners, at in by_binding.values():
            group, group_states = [saves[i] for i in at], [states[i] for i in at]
            for rank, planner in enumerate(planners):
                for i in at:  # every rank plans from the same offsets
                    states[i].planned = start[i]
                entries, rank_owners, group_ends, rank_failed = self.engine.plan_saves(
                    group, group_states, _nothing_known, planner, depths, tails
                )
                per_rank[rank].extend(entries)
                failed |= rank_failed
                for key, rids in rank_owners.items():
                    owners.setdefault(key, rids)
            for i, end in zip(at, group_ends):
                ends[i] = end
        per_rank = self._without_known(per_rank, owners)
        # Eviction order: a key goes with the newest request that wrote it (and the worthiest),
        # the deepest blocks of a request first.
        ranks = None
        if depths is not None:
            ranks = {
                key: (max(self._stamp(rid) for rid in owners[key]), depth, max(self._worth(rid) for rid in owners[key]))
                for key, depth in depths.items()
                if key in owners
            }
        placed, keys, refused = self.placement.place_saves(per_rank, ranks)
        if refused:
            self.engine.count("put_full", len(refused))
            failed.update(rid for key in refused for rid in owners[key])
        job = _SaveJob(keys, owners, saves, states, ends, failed, self._step, start)
        for save, state, planned, end in zip(saves, states, start, ends):
            # A failed save plans its missing blocks again next step.
            state.planned = planned if save.req_id in failed else max(planned, end)
        if not keys:
            self._finish_job(job)
            return
        job_id = self._next_job = self._next_job + 1
        self._jobs[job_id] = job
        meta.saves[job_id] = placed
        if tails and not self.placement.knows_contents:  # (the arena's saves are never deferred)
            meta.save_tails[job_id] = sorted(tails & set(keys))

    def _without_known(self, per_rank: List[list], owners: Dict[str, List[str]]) -> List[list]:
        """Every rank's entries minus the keys a save need not write. The arena's index knows
        them. A shared store is not asked (a round trip every step): a key is skipped when its
        request's lookup found it, or when a save job of this engine wrote it after that
        lookup. Any other key is put: a put of a key another engine (or a job still out)
        writes meanwhile keeps the first value (Mooncake's puts are first-writer-wins)."""
        if self.placement.knows_contents:
            keys = list(dict.fromkeys(key for entries in per_rank for key, _, _ in entries))
            known = {key for key, p in zip(keys, self.placement.known(keys)) if p} if keys else set()
        else:
            # A lookup asks every rank's keys (SEMANTICS §6), so each rank's are found or not.
            is_known = self.lookups.is_known
            known = {key for entries in per_rank for key, _, _ in entries if is_known(key, owners[key], self._requests)}
        if not known:
            return per_rank
        self.engine.count("put_skipped_present", sum(key in known for entries in per_rank for key, _, _ in entries))
        return [[entry for entry in entries if entry[0] not in known] for entries in per_rank]

    def _abandon_stale_jobs(self) -> None:
        """Save jobs not every rank reported within ``ABANDON_AFTER_STEPS`` steps (a worker's
        launches far behind, or a report lost to its error): their saves count as failed
        (planned again from the confirmed offset), and their arena slots are held until every
        rank reported the job, since a late copy may still write them; a rank that never
        reports keeps them out of use (``save_jobs_abandoned`` less ``save_jobs_reported_late``)
        rather than let a load read another key's bytes out of them."""
        for job_id in overdue(self._jobs, self._step, ABANDON_AFTER_STEPS):
            job = self._jobs.pop(job_id)
            self._given_up[job_id] = [job.ok + job.bad + job.deferred, self.placement.saves_abandoned(job.keys)]
            self.engine.count("save_jobs_abandoned")
            job.failed.update(rid for key in job.keys for rid in job.owners[key])
            self._finish_job(job)

    def _saves_reported(self, reports: Dict[int, List[int]]) -> None:
        """Per save job, how many ranks wrote it and how many failed: once every rank
        reported, the arena's keys become readable (or are dropped) and the offsets move."""
        for job_id, (ok, bad, deferred) in reports.items():
            job = self._jobs.get(job_id)
            if job is None:
                self._given_up_reported(job_id, ok + bad + deferred)
                continue
            job.ok += ok
            job.bad += bad
            job.deferred += deferred
            if job.ok + job.bad + job.deferred < self.world_size:
                continue
            del self._jobs[job_id]
            if job.bad:
                job.failed.update(rid for key in job.keys for rid in job.owners[key])
            self.placement.saves_done(job.keys, ok=not job.bad)
            if not job.bad and not job.deferred:
                self.lookups.remember_written(job.keys)
            self._finish_job(job)

    def _check_state_alignment(self, rid: str, scheduled: int, end: int, request) -> None:
        """vLLM's "align" mode ends every prefill chunk of a block or more on a Mamba state
        block (else the prompt's end), since a state exists only where a chunk ends. A chunk
        that ends elsewhere means vLLM's scheduler aligns to another block size than its KV
        cache's: it hands off no state, so no prompt of this hybrid is stored whole (logged
        once per engine)."""
        block = self._state_block
        if not block or scheduled < block or end % block == 0 or end % self.planner.hash_block_size == 0:
            return
        if end >= request.num_prompt_tokens:
            return
        self._log_once(
            "state-alignment",
            "kvstride: vLLM ended a prefill chunk of request %s at token %d, inside a %d-token Mamba state block "
            "and before its prompt's end: vLLM keeps no Mamba state there for any connector to store, so this "
            "hybrid's prompts will not hit. vLLM's scheduler aligns chunks to another block size than its KV "
            "cache's (vLLM's CPU backend raises the block size in its workers only): start vLLM with "
            "--block-size %d (logged once)", rid, end, block, block)

    def _given_up_reported(self, job_id: int, ranks: int) -> None:
        given_up = self._given_up.get(job_id)
        if given_up is None:
            return
        given_up[0] += ranks
        if given_up[0] >= self.world_size:
            del self._given_up[job_id]
            self.placement.abandoned_saves_ended(given_up[1])
            self.engine.count("save_jobs_reported_late")

    def _finish_job(self, job: "_SaveJob") -> None:
        for save, state, start, end in zip(job.saves, job.states, job.starts, job.ends):
            # A rank that left some to later counted it there: planned again, as a failure is.
            ok = not job.deferred and save.req_id not in job.failed
            state.save_ended(start, end, ok)
            if save.req_id in job.failed:
                self.engine.count("saves_failed")
            elif ok:
                self.engine.count("saves_ok")

    def _build_saves(self, so, meta: KVStrideMetadata) -> List[SaveRequest]:
        """The step's save requests: what each scheduled request computed, vLLM's boundary
        hand-offs, and the tails of requests that finished."""
        saves: List[SaveRequest] = []
        for rid in so.preempted_req_ids or ():  # resumed, its saves start over (stored keys are skipped)
            self.engine.finish_request(rid)
        computed: Dict[str, int] = {new.req_id: int(new.num_computed_tokens) for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        computed.update((rid, int(n)) for rid, n in zip(cached.req_ids, cached.num_computed_tokens))
        # vLLM's block tables as they are now: a sliding-window or chunked-local block that left
        # the window is the null block (0) there, freed and maybe another request's, so no plan
        # reads it, however far a failed save left the saved offset behind.
        block_state = getattr(so, "kv_connector_block_state", None)
        if block_state is None:
            self._log_once("no-block-state", "kvstride: vLLM offers no kv_connector_block_state; nothing is saved")
            return saves
        handoffs = self._boundary_handoffs(so)
        for rid, n in so.num_scheduled_tokens.items():
            request = self._requests.get(rid)
            tables = block_state.get_block_ids(rid)
            if request is None or rid not in computed or tables is None or not request.block_hashes:
                continue
            if self.bindings.of(request) is None:  # its keys cannot cover its content
                continue
            hashes = request.block_hashes  # planned in this call: the core reads only what the plan needs
            admitted = self._boundaries(request)
            by_boundary = handoffs.pop(rid, [])
            first = by_boundary[0] if by_boundary else ()
            end = computed[rid] + int(n)
            self._check_state_alignment(rid, int(n), end, request)
            saves.append(SaveRequest(rid, hashes, tables, end, handoffs=first, boundaries=admitted))
            # vLLM may hand off several boundaries in one step; the planner takes one per save.
            for entries in by_boundary[1:]:
                saves.append(SaveRequest(rid, hashes, tables, end, handoffs=entries, boundaries=admitted))
        # Hand-offs of requests not scheduled this step: their own saves, on vLLM's block tables.
        for rid, by_boundary in handoffs.items():
            request = self._requests.get(rid)
            tables = block_state.get_block_ids(rid)
            if request is None or tables is None or not request.block_hashes or self.bindings.of(request) is None:
                continue
            hashes = request.block_hashes  # planned in this call: the core reads only what the plan needs
            admitted = self._boundaries(request)
            for entries in by_boundary:
                saves.append(SaveRequest(rid, hashes, tables, int(entries[0][2]), handoffs=entries, boundaries=admitted))
        for rid, (st_hashes, tables, tail, admitted) in self._finished_tails.items():
            for group in self._split_by_boundary(tail):
                saves.append(SaveRequest(rid, st_hashes, tables, int(group[0][2]), handoffs=group, boundaries=admitted))
            meta.finished_tails.append(rid)
        self._finished_tails.clear()
        return saves

    def _stamp(self, rid: str) -> int:
        """The request's recency stamp, taken at its first save or load."""
        stamp = self._stamps.get(rid)
        if stamp is None:
            stamp = self.placement.stamp()
            if rid in self._requests:  # a finished request's tail saves keep none
                self._stamps[rid] = stamp
        return stamp

    def _worth(self, rid: str) -> float:
        """The request's worth in the eviction order, taken at its first save or load: the
        prefill a hit at its prompt's end saves per slot its boundary set fills."""
        worth = self._worths.get(rid)
        if worth is None:
            request = self._requests.get(rid)
            if request is None:  # a finished request's tail saves keep none
                return 1.0
            value = prefill_per_byte(self.planner, int(request.num_prompt_tokens), self._slot_values)
            worth = self._worths[rid] = self.placement.worth(value)
        return worth

    def _boundaries(self, request) -> Optional[List[int]]:
        """The request's hit-capable boundaries (SEMANTICS §8), found at its first save: its
        prompt's ends, vLLM's periodic checkpoints, and the deepest prefix boundary an earlier
        request passed through (a junction); None keeps every window tail."""
        rid = request.request_id
        if rid in self._admitted:
            return self._admitted[rid]
        admitted = None
        if self._admitting:
            n = int(request.num_prompt_tokens)
            marks = self.planner.boundary_hashes(request.block_hashes, n)
            seen = [self._seen_prefixes.seen(mark) for mark in marks]
            admitted = self.planner.hit_boundaries(n, retention_interval=self._retention_interval, seen=seen)
            self._seen_prefixes.remember(marks)
        self._admitted[rid] = admitted
        return admitted

    @staticmethod
    def _split_by_boundary(entries) -> List[List[Tuple[int, int, int]]]:
        """vLLM's ``(group, block_id, boundary)`` hand-offs, one list per boundary (in order):
        each is one tail for the core to plan (SEMANTICS §5, rule 3)."""
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
            if rid not in self._requests or not partial_tail_offloads or not hashes or self.bindings.of(request) is None:
                return False
            tables = [list(ids) for ids in block_ids]
            self._finished_tails[rid] = (hashes, tables, list(partial_tail_offloads), self._admitted.get(rid))
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
        self._waiting.pop(rid, None)
        self._recompute.discard(rid)
        self._admitted.pop(rid, None)
        # A tail to save takes the request's rank and saved offset (it plans from there, not
        # the whole prefix again): both are dropped once the tail is planned.
        if rid not in self._finished_tails:
            self._stamps.pop(rid, None)
            self._worths.pop(rid, None)
            self.bindings.forget(rid)
            self.engine.finish_request(rid)
        self.lookups.forget(rid)
        if self._pending_loads.pop(rid, None) is not None:  # never sent: nothing writes them
            self._loading.discard(rid)
        return rid in self._loading, None
