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

Usage: python benches/scheduler_step.py [--steps 512] [--repeat 5] [--json]
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
import time
from types import SimpleNamespace

import kvstride
from kvstride.arena import ArenaPlacement
from kvstride.stores.placement import StorePlacement
from kvstride.vllm.config import ConnectorConfig
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
        self.request = SimpleNamespace(request_id=self.rid, block_hashes=[], num_tokens=context)
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
            scheduled_cached_reqs=SimpleNamespace(req_ids=[self.rid], num_computed_tokens=[computed]),
            num_scheduled_tokens={self.rid: scheduled},
            kv_connector_block_state=self.state,
            preempted_req_ids=set(),
            finished_req_ids=set(),
        )

    def step(self) -> None:
        self.num_tokens += 1
        self._grow()


def config(store_kind: str) -> ConnectorConfig:
    groups = [
        kvstride.GroupSpec("full_attention", BLOCK, num_kv_heads=4),
        kvstride.GroupSpec("sliding_window", BLOCK, window=WINDOW, num_kv_heads=4),
    ]
    S, H = kvstride.resolve_block_sizes(groups)
    planner = kvstride.KeyPlanner(groups, hash_block_size=H, scheduler_block_size=S,
                                  namespace=kvstride.Namespace("bench", fingerprint="00" * 8))
    store = StoreChoice(store_kind, 1, num_slots=1 << 16 if store_kind == "embedded" else 0)
    return ConnectorConfig({"store": store_kind}, groups, "00" * 8, planner, [planner], 0, None, store, world_size=1)


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
            report = KVStrideWorkerMetadata(saves={job: list(JOB_REPORTS["ok"]) for job in jobs})
            side.update_connector_output(SimpleNamespace(finished_recving=(), failed_recving=(),
                                                         kv_connector_worker_meta=report))
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
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
    finally:
        store.close()
        master.stop()
    for kind in ("embedded", "mooncake"):
        base = next(r["us_per_step"] for r in rows if r["store"] == kind and r["context"] == CONTEXTS[0])
        for r in rows:
            if r["store"] == kind:
                r["ratio_vs_1k"] = r["us_per_step"] / base
    if args.json:
        print(json.dumps({"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                          "steps": args.steps, "repeat": args.repeat, "rows": rows}, indent=1))
        return 0
    print(f"# {platform.machine()}, {os.cpu_count()} CPUs, {args.steps} steps x {args.repeat} runs (median of means)")
    print("| store | context | µs per step | × the 1k step |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['store']} | {r['context'] // 1024}k | {r['us_per_step']:.1f} | {r['ratio_vs_1k']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
