#!/usr/bin/env python3
"""The connector's scheduler-side work per decode step against the length of the context.

No model: the scheduler side of ``kvstride.vllm`` (``SchedulerSide``, as vLLM builds it) is
driven with the objects vLLM hands it each step — a request with its block hashes, a
scheduler output naming one decoded token, the per-group block tables of
``kv_connector_block_state`` — for one request whose context is 1k, 32k or 128k tokens.
A step's work is ``build_connector_meta``, the pickling of the metadata it returns (what vLLM
sends its workers in every multi-process layout) and the workers' save reports coming back
(``update_connector_output``). The request's prefix is saved before
timing starts, so every timed step saves only what the step completed.

Geometry (a Gemma-3-like hybrid): full attention and sliding window (1024 tokens), 16-token
blocks, one TP rank. Stores: the embedded store (the scheduler plans every save into arena
slots) and Mooncake (a real ``mooncake_master`` on loopback; the scheduler sends the save
requests its workers plan).

A second table: the step while vLLM's waiting queue is blocked at its head (KV memory full,
exactly when offload matters): ``QUEUE`` waiting prompts of ``QUEUE_TOKENS`` tokens, vLLM
asking the head's hit every step (``get_num_new_matched_tokens``, then the head cannot be
allocated), while one running request prefills a chunk and saves it every step (so the
store's content changes every step). Reported per step: the connector's time, the store's
existence calls and the keys they ask, at TP=1 and TP=4 (Mooncake keys each rank's heads).

A third table: the embedded store with and without a disk tier below it, written through at
the rate the saves come (a running request prefills and saves a ``CHUNK`` every step, and every
rank reports the step's disk writes done the next step): the scheduler's index of the records
(its SQLite rows committed off the step) against the same run without the tier, per step, at
the median and the 99th percentile (goal: p99 within ``DISK_GOAL_MS``).

Usage: python benches/scheduler_step.py [--steps 512] [--repeat 5] [--disk-steps 2000] [--json]
Run with the vLLM venv (``.venv-vllm/bin/python``): the metadata classes are vLLM's.
Each figure is the median over ``--repeat`` runs (interleaved across the context lengths) of
the mean time per step of ``--steps`` steps (a block completes every 16 steps, so a mean covers both kinds of step).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import platform
import statistics
import sys
import tempfile
import time
from types import SimpleNamespace

import kvstride
from kvstride.arena import ArenaPlacement
from kvstride.arena.disk_index import DiskIndex
from kvstride.stores.placement import StorePlacement
from kvstride.vllm.config import ConnectorConfig
from kvstride.vllm.lookups import LOOKUP_BATCH_TOKENS
from kvstride.vllm.metadata import JOB_REPORTS, KVStrideWorkerMetadata
from kvstride.vllm.scheduler import SchedulerSide
from kvstride.vllm.store_registry import StoreChoice

BLOCK = 16
WINDOW = 1024
CONTEXTS = (1024, 32 * 1024, 128 * 1024)


def block_hash(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest()


class BlockState:
    """``kv_connector_block_state``: vLLM's block tables as they are in the step (window
    blocks that left the window are the null block 0)."""

    def __init__(self) -> None:
        self.tables = {}
        self.boundary_state_offloads = {}

    def get_block_ids(self, rid):
        return self.tables.get(rid)


class Workload:
    """One request decoding from ``context`` tokens on."""

    def __init__(self, context: int) -> None:
        self.rid = "r0"
        self.num_tokens = context
        self.request = SimpleNamespace(request_id=self.rid, block_hashes=[], num_tokens=context, num_prompt_tokens=context)
        self.state = BlockState()
        self.full, self.window = [], []
        self._grow()

    def _grow(self) -> None:
        """Hashes and block ids for every complete block, the window group's old blocks null."""
        blocks = self.num_tokens // BLOCK
        hashes = self.request.block_hashes
        while len(hashes) < blocks:
            hashes.append(block_hash(len(hashes)))
        owned = -(-self.num_tokens // BLOCK)
        while len(self.full) < owned:
            self.full.append(1 + 2 * len(self.full))
            self.window.append(2 + 2 * len(self.window))
        first_live = max(0, (self.num_tokens - WINDOW) // BLOCK - 1)
        for b in range(max(0, first_live - 2), first_live):
            self.window[b] = 0
        self.state.tables[self.rid] = (self.full, self.window)
        self.request.num_tokens = self.num_tokens

    def output(self, computed: int, scheduled: int):
        return SimpleNamespace(
            scheduled_new_reqs=[],
            scheduled_cached_reqs=SimpleNamespace(req_ids=[self.rid], num_computed_tokens=[computed], new_block_ids=[None]),
            num_scheduled_tokens={self.rid: scheduled},
            kv_connector_block_state=self.state,
            preempted_req_ids=set(),
            finished_req_ids=set(),
        )

    def step(self) -> None:
        self.num_tokens += 1
        self._grow()


def config(store_kind: str, tp: int = 1) -> ConnectorConfig:
    groups = [
        kvstride.GroupSpec("full_attention", BLOCK, num_kv_heads=4),
        kvstride.GroupSpec("sliding_window", BLOCK, window=WINDOW, num_kv_heads=4),
    ]
    S, H = kvstride.resolve_block_sizes(groups)
    keyed = tp if store_kind == "mooncake" else 1  # the arena keys as one rank

    def planner(rank: int) -> kvstride.KeyPlanner:
        namespace = kvstride.Namespace("bench", fingerprint="00" * 8, tp_rank=rank)
        return kvstride.KeyPlanner(groups, hash_block_size=H, scheduler_block_size=S, namespace=namespace,
                                   tp_size=keyed, tp_rank=rank)

    planners = [planner(rank) for rank in range(keyed)]
    store = StoreChoice(store_kind, keyed, num_slots=1 << 16 if store_kind == "embedded" else 0)
    return ConnectorConfig({"store": store_kind}, groups, "00" * 8, planners[0], planners, 0, None, store, world_size=tp)


def report_all_ranks(side: SchedulerSide, jobs, disk_jobs=()) -> None:
    """Every rank wrote its part of ``jobs`` and of the disk's ``disk_jobs`` (each rank reports
    on its own)."""
    for _ in range(side.world_size):
        report = KVStrideWorkerMetadata(saves={job: list(JOB_REPORTS["ok"]) for job in jobs},
                                        disk={job: [1, 0] for job in disk_jobs})
        side.update_connector_output(SimpleNamespace(finished_recving=(), failed_recving=(), kv_connector_worker_meta=report))


def run_steps(side: SchedulerSide, work: Workload, steps: int) -> float:
    """Mean seconds of connector work per step over ``steps`` decode steps (vLLM's own part,
    growing the request, is not timed)."""
    spent = 0.0
    for _ in range(steps):
        computed = work.num_tokens
        work.step()
        output = work.output(computed, 1)
        start = time.perf_counter()
        meta = side.build_connector_meta(output)
        pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
        jobs = list(meta.saves)
        if jobs:  # every rank wrote its part
            report_all_ranks(side, jobs)
        spent += time.perf_counter() - start
    return spent / steps


def measure(store_kind: str, store, context: int, steps: int) -> float:
    cfg = config(store_kind)
    side = SchedulerSide(cfg, ArenaPlacement(cfg.store.num_slots) if store is None else StorePlacement(store))
    try:
        work = Workload(context)
        side.on_new_request(work.request)
        # The prefill: the whole context saved (and, on the arena, confirmed) before timing.
        run_steps(side, work, 1)
        return run_steps(side, work, steps)
    finally:
        side.shutdown()

QUEUE = 300  # waiting prompts behind a head that cannot be allocated
QUEUE_TOKENS = 8192
CHUNK = 512  # the running request's prefill chunk: it saves every step
QUEUE_STEPS = 64
QUEUE_GOAL_MS = 5.0


class CountingExists:
    """The placement's ``exists``, counted: calls and keys asked."""

    def __init__(self, placement) -> None:
        self.inner = placement.exists
        self.calls = 0
        self.keys = 0
        placement.exists = self

    def __call__(self, keys):
        self.calls += 1
        self.keys += len(keys)
        return self.inner(keys)


def queue_step_costs(store_kind: str, store, tp: int, steps: int) -> dict:
    """Per step, with the waiting queue blocked at its head: the connector's seconds (the head's
    lookup, the step's plans and pickled metadata, the ranks' reports), store calls and keys."""
    cfg = config(store_kind, tp)
    placement = ArenaPlacement(cfg.store.num_slots) if store is None else StorePlacement(store)
    side = SchedulerSide(cfg, placement)
    counter = CountingExists(placement)
    try:
        waiting = []
        for r in range(QUEUE):
            hashes = [block_hash((r + 1) << 32 | i) for i in range(QUEUE_TOKENS // BLOCK)]
            waiting.append(SimpleNamespace(request_id=f"w{r}", block_hashes=hashes, num_tokens=QUEUE_TOKENS,
                                           num_prompt_tokens=QUEUE_TOKENS))
            side.on_new_request(waiting[-1])
        running = Workload(0)
        running.request.num_prompt_tokens = 1 << 20
        side.on_new_request(running.request)
        side.update_state_after_alloc(running.request, SimpleNamespace(get_block_ids=lambda: ([], [])), 0)
        spent, calls, keys = [], [], []
        for _ in range(steps):
            computed = running.num_tokens
            running.num_tokens += CHUNK
            running._grow()
            output = running.output(computed, CHUNK)
            before = (counter.calls, counter.keys)
            start = time.perf_counter()
            side.get_num_new_matched_tokens(waiting[0], 0)  # vLLM asks the head; it does not fit
            meta = side.build_connector_meta(output)
            pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
            if meta.saves:
                report_all_ranks(side, list(meta.saves))
            spent.append(time.perf_counter() - start)
            calls.append(counter.calls - before[0])
            keys.append(counter.keys - before[1])
        # The bound: the head's keys and LOOKUP_BATCH_TOKENS of other waiting requests' (a shared store).
        head_keys = len(cfg.planner.lookup_keys(waiting[0].block_hashes, QUEUE_TOKENS))
        return {"ms_per_step": statistics.median(spent) * 1e3, "max_ms": max(spent) * 1e3,
                "store_calls_per_step": max(calls), "max_keys_per_step": max(keys),
                "key_bound": head_keys * (1 + LOOKUP_BATCH_TOKENS // QUEUE_TOKENS)}
    finally:
        side.shutdown()


DISK_STEPS = 2000
DISK_GOAL_MS = 1.0


def disk_step_costs(with_disk: bool, steps: int) -> list:
    """Per step, seconds of the connector's work while a running request prefills and saves a
    ``CHUNK`` each step, on the embedded store with (``with_disk``) or without a disk tier
    whose every rank reports the last step's writes done."""
    cfg = config("embedded")
    with tempfile.TemporaryDirectory(prefix="kvstride-bench-disk-") as folder:
        index = DiskIndex(1 << 17, folder, {"record_bytes": 4096, "ranks": 1, "fingerprint": cfg.fingerprint,
                                            "model": "bench"}) if with_disk else None
        side = SchedulerSide(cfg, ArenaPlacement(cfg.store.num_slots, index, 1))
        try:
            running = Workload(0)
            running.request.num_prompt_tokens = 1 << 30
            side.on_new_request(running.request)
            side.update_state_after_alloc(running.request, SimpleNamespace(get_block_ids=lambda: ([], [])), 0)
            spent, written = [], []
            for _ in range(steps):
                computed = running.num_tokens
                running.num_tokens += CHUNK
                running._grow()
                output = running.output(computed, CHUNK)
                start = time.perf_counter()
                meta = side.build_connector_meta(output)
                pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
                report_all_ranks(side, list(meta.saves), written)
                spent.append(time.perf_counter() - start)
                written = list(meta.disk_writes)
            return spent
        finally:
            side.shutdown()
            if index is not None:
                index.close()


def percentile(values, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def disk_rows(steps: int, repeat: int) -> list:
    """Median over ``repeat`` interleaved runs of each run's per-step p50 and p99, without and
    with the tier."""
    runs = {False: [], True: []}
    for _ in range(repeat):
        for with_disk in (False, True):
            spent = disk_step_costs(with_disk, steps)
            runs[with_disk].append((percentile(spent, 0.5), percentile(spent, 0.99)))
    return [{"disk": with_disk, "p50_ms": statistics.median(r[0] for r in runs[with_disk]) * 1e3,
             "p99_ms": statistics.median(r[1] for r in runs[with_disk]) * 1e3} for with_disk in (False, True)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--queue-steps", type=int, default=QUEUE_STEPS)
    ap.add_argument("--disk-steps", type=int, default=DISK_STEPS)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from kvstride.stores import MooncakeStore, start_master

    master = start_master()
    store = MooncakeStore(master, local_hostname="127.0.0.1", segment_bytes=16 << 20)
    rows = []
    try:
        for kind, st in (("embedded", None), ("mooncake", store)):
            measure(kind, st, CONTEXTS[0], args.steps)  # warm-up (the store client's first calls)
            # Interleaved (1k, 32k, 128k, 1k, ...): the machine's drift falls on every length alike.
            runs = {context: [] for context in CONTEXTS}
            for _ in range(args.repeat):
                for context in CONTEXTS:
                    runs[context].append(measure(kind, st, context, args.steps))
            for context in CONTEXTS:
                rows.append({"store": kind, "context": context, "us_per_step": statistics.median(runs[context]) * 1e6,
                             "runs_us": [round(r * 1e6, 1) for r in runs[context]]})
        queue = [dict(store=kind, tp=tp, **queue_step_costs(kind, st, tp, args.queue_steps))
                 for kind, st in (("embedded", None), ("mooncake", store)) for tp in (1, 4)]
    finally:
        store.close()
        master.stop()
    for kind in ("embedded", "mooncake"):
        base = next(r["us_per_step"] for r in rows if r["store"] == kind and r["context"] == CONTEXTS[0])
        for r in rows:
            if r["store"] == kind:
                r["ratio_vs_1k"] = r["us_per_step"] / base
    disk = disk_rows(args.disk_steps, args.repeat)
    disk_added_p99_ms = disk[1]["p99_ms"] - disk[0]["p99_ms"]
    met = all(q["ms_per_step"] <= QUEUE_GOAL_MS and q["store_calls_per_step"] <= 1
              and q["max_keys_per_step"] <= q["key_bound"] for q in queue) and disk_added_p99_ms <= DISK_GOAL_MS
    if args.json:
        print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "steps": args.steps, "repeat": args.repeat, "rows": rows, "queue": queue, "disk": disk,
                          "disk_added_p99_ms": disk_added_p99_ms,
                          "queue_goal_met": met}, indent=1))
        return 0 if met else 1
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, {args.steps} steps x {args.repeat} runs (median of means)")
    print("| store | context | µs per step | × the 1k step |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['store']} | {r['context'] // 1024}k | {r['us_per_step']:.1f} | {r['ratio_vs_1k']:.2f} |")
    print(f"\n# {QUEUE} waiting {QUEUE_TOKENS // 1024}k-token prompts blocked at the head, {args.queue_steps} steps "
          f"(goal: <= {QUEUE_GOAL_MS:g} ms and <= 1 store call of bounded keys per step)")
    print("| store | TP | ms per step (median) | max ms | store calls per step (max) | keys per step (max) | key bound |")
    print("|---|---|---|---|---|---|---|")
    for q in queue:
        print(f"| {q['store']} | {q['tp']} | {q['ms_per_step']:.2f} | {q['max_ms']:.2f} | "
              f"{q['store_calls_per_step']} | {q['max_keys_per_step']} | {q['key_bound']} |")
    print(f"\n# the embedded store, a {CHUNK}-token chunk saved every step, {args.disk_steps} steps, with and without a "
          f"disk tier written through (goal: p99 within {DISK_GOAL_MS:g} ms of the run without)")
    print("| disk tier | ms per step, p50 | ms per step, p99 |")
    print("|---|---|---|")
    for d in disk:
        print(f"| {'yes' if d['disk'] else 'no'} | {d['p50_ms']:.3f} | {d['p99_ms']:.3f} |")
    print(f"p99 added by the disk tier: {disk_added_p99_ms:.3f} ms")
    print("goals met" if met else "goals NOT met")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
