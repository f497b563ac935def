"""``kvstride simulate``: a multi-turn, shared-prefix chat workload through a simulated hybrid
KV cache (real torch tensors per group, a block allocator) and the offload engine.

Each turn's prefill writes deterministic content into the request's blocks (a function of the
group and of the token prefix, so any two requests sharing a prefix write identical bytes)
and offloads it; later turns look up, load hits into fresh blocks pre-filled with garbage, and
check every loaded byte against what a recompute would have written.

A Mamba group in align mode computes from its running-state block (the last of its table), not
from the loaded one: as vLLM's ``preprocess_mamba`` does, a request's first computing step
copies the hit-state block into it, and every chunk carries that state (and any error in it)
on into the hand-offs it stores. So the running state and the hand-offs are checked too, and a
load that lands after the copy (``load_timing="sync"``) is caught.

The workload, the simulated KV cache and the byte checks live together: the checks read the
cache exactly as the workload wrote it.
"""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from kvstride import _core, faults
from kvstride.engine import LoadRequest, OffloadEngine, SaveRequest
from kvstride.layout import KVLayout
from kvstride.mixes import Mix, format_groups
from kvstride.sizes import parse_size
from kvstride.stores import EmbeddedStore, MooncakeStore, start_master
from kvstride.transfer import StagingPool, Transfer

GARBAGE = 0xA5


@dataclass
class SimConfig:
    mix: Mix
    conversations: int = 8
    batch: int = 4  # requests per engine step
    turns: int = 4
    system_tokens: int = 2048
    user_tokens: int = 300
    reply_tokens: int = 200
    token_bytes: int = 64  # KV bytes per token per attention group
    state_bytes: int = 16384  # bytes of one Mamba state
    store: str = "embedded"
    store_bytes: int = 1 << 30
    # The embedded store's disk tier: a folder and its records' bytes (None / 0: none).
    disk_path: Optional[str] = None
    disk_bytes: int = 0
    algo: str = "sha256_cbor"
    seed: int = 0
    dcp: int = 1
    fault_every: int = 0  # inject a store fault before every N-th batch of requests
    chunk_tokens: int = 1024  # prefill chunk (rounded up to the alignment, at least S)
    # "async": a hit's load completes before its first computing step (what the connector
    # does); "sync": it runs in that step, after vLLM's preprocess_mamba copy (the old bug).
    load_timing: str = "async"
    progress: bool = True


@dataclass
class Conversation:
    req_id: str
    tokens: List[int]
    hashes: List[bytes] = field(default_factory=list)


class BlockAllocator:
    """Free lists of block ids per group; id 0 is vLLM's NULL block, never handed out."""

    def __init__(self, num_blocks: List[int]) -> None:
        self.free = [list(range(n - 1, 0, -1)) for n in num_blocks]

    def allocate(self, group: int, count: int) -> List[int]:
        if count > len(self.free[group]):
            raise RuntimeError(f"group {group}: out of simulated KV blocks (need {count})")
        return [self.free[group].pop() for _ in range(count)]

    def release(self, group: int, ids: List[int]) -> None:
        self.free[group].extend(i for i in ids if i)


class SimulatedCache:
    """One KV tensor per group: ``(blocks, block_size, token_bytes)`` for attention kinds,
    ``(blocks, state_bytes)`` for Mamba state."""

    def __init__(self, groups, num_blocks: List[int], cfg: SimConfig, hash_block_size: int) -> None:
        self.groups = groups
        self.cfg = cfg
        self.h = hash_block_size
        self.tensors = []
        for g, spec in enumerate(groups):
            if spec.kind == "mamba":
                shape = (num_blocks[g], cfg.state_bytes)
            else:
                shape = (num_blocks[g], spec.block_size * cfg.dcp, cfg.token_bytes)
            self.tensors.append(torch.full(shape, GARBAGE, dtype=torch.uint8))
        names = [f"group{g}" for g in range(len(groups))]
        self.layout = KVLayout(dict(zip(names, self.tensors)), [[n] for n in names])

    def block_tokens(self, g: int) -> int:
        spec = self.groups[g]
        return spec.block_size if spec.kind == "mamba" else spec.block_size * self.cfg.dcp

    @staticmethod
    def _seed(g: int, block_hash: Optional[bytes]) -> int:
        base = int.from_bytes(block_hash[:3], "big") if block_hash else 0xFFFFFF
        return (base ^ (g * 0x9E37)) & 0xFFFFFF

    def expected_rows(self, g: int, hashes: List[bytes], lo: int, hi: int) -> torch.Tensor:
        """What a prefill writes for token positions [lo, hi) of group g: (hi - lo, bytes)."""
        positions = torch.arange(lo, hi, dtype=torch.int64)
        chunk = positions // self.h
        seeds = torch.tensor(
            [self._seed(g, hashes[j] if j < len(hashes) else None) for j in range(lo // self.h, (hi - 1) // self.h + 1)],
            dtype=torch.int64,
        )
        seed = seeds[chunk - lo // self.h]
        lanes = torch.arange(self.cfg.token_bytes, dtype=torch.int64)
        mixed = (seed[:, None] + (positions % self.h)[:, None] * 7919 + lanes[None, :] * 104729) * 2654435761
        return ((mixed >> 16) & 0xFF).to(torch.uint8)

    def expected_state(self, g: int, block_hash: bytes) -> torch.Tensor:
        lanes = torch.arange(self.cfg.state_bytes, dtype=torch.int64)
        mixed = (self._seed(g, block_hash) + lanes * 104729 + 77) * 2654435761
        return ((mixed >> 16) & 0xFF).to(torch.uint8)

    def state_at(self, g: int, hashes: List[bytes], tokens: int) -> torch.Tensor:
        """The Mamba state after ``tokens`` (a hash boundary); 0 tokens: the initial state."""
        if tokens == 0:
            return torch.zeros(self.cfg.state_bytes, dtype=torch.uint8)
        return self.expected_state(g, hashes[tokens // self.h - 1])

    def write_tokens(self, g: int, table: List[int], hashes: List[bytes], lo: int, hi: int) -> None:
        if hi <= lo:
            return
        b = self.block_tokens(g)
        positions = torch.arange(lo, hi)
        blocks = torch.tensor(table, dtype=torch.int64)[positions // b]
        self.tensors[g][blocks, positions % b] = self.expected_rows(g, hashes, lo, hi)

    def wrong_bytes_tokens(self, g: int, block_id: int, block_index: int, hashes, hit: int) -> int:
        b = self.block_tokens(g)
        lo, hi = block_index * b, min((block_index + 1) * b, hit)
        got = self.tensors[g][block_id, : hi - lo]
        return int((got != self.expected_rows(g, hashes, lo, hi)).sum())


def _percentile(values: List[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


class Simulation:
    def __init__(self, cfg: SimConfig) -> None:
        if cfg.load_timing not in ("async", "sync"):
            raise ValueError(f"load_timing {cfg.load_timing!r}: use async or sync")
        self.cfg = cfg
        groups = list(cfg.mix.groups)
        self.groups = groups
        self.s, self.h = _core.resolve_block_sizes(groups, prefix_match_unit=cfg.mix.prefix_match_unit, dcp=cfg.dcp)
        self.hasher = _core.BlockHasher(cfg.algo, seed=str(cfg.seed))
        self.rng = random.Random(cfg.seed)
        self.max_tokens = cfg.system_tokens + cfg.turns * (cfg.user_tokens + cfg.reply_tokens) + self.s
        num_blocks = []
        for g in groups:
            size = g.block_size if g.kind == "mamba" else g.block_size * cfg.dcp
            # Every conversation's table plus one copy-on-write block per conversation.
            num_blocks.append(cfg.conversations * (-(-self.max_tokens // size) + 2) + 2)
        self.cache = SimulatedCache(groups, num_blocks, cfg, self.h)
        self.allocator = BlockAllocator(num_blocks)
        fingerprint = _core.layout_fingerprint(
            {"groups": format_groups(groups), "S": self.s, "H": self.h, "algo": cfg.algo, "seed": cfg.seed, "dcp": cfg.dcp}
        )
        self.planner = _core.KeyPlanner(
            groups,
            hash_block_size=self.h,
            scheduler_block_size=self.s,
            namespace=_core.Namespace("kvstride-simulate", fingerprint=fingerprint),
            dcp=cfg.dcp,
        )
        self.master = self.store = None
        try:
            self.store = self._open_store()
            if isinstance(self.store, MooncakeStore):  # staging its buffers are registered from
                pool = StagingPool(max(64 << 20, 4 * max(self.cache.layout.block_bytes(g) for g in range(len(groups)))))
                pool.register(self.store.register_buffer)
                transfer = Transfer(self.cache.layout, pool)
            else:  # the embedded arena copies blocks itself
                transfer = self.cache.layout
            self.engine = OffloadEngine(self.planner, transfer, self.store)
        except BaseException:  # nothing closes a Simulation that failed to construct
            if self.store is not None:
                self.store.close()
            if self.master is not None:
                self.master.stop()
            raise
        self.align_mamba = {
            g
            for g, spec in enumerate(groups)
            if spec.kind == "mamba" and spec.mamba_mode == "align" and self.planner.hashes_per_block[g]
        }
        a = self.planner.alignment
        self.chunk = max(self.s, -(-max(1, cfg.chunk_tokens) // a) * a)
        self.history: List[dict] = []
        self.wrong_bytes = 0
        self.verified_bytes = 0
        self.faults: Dict[str, int] = {}
        self.rounds = 0
        self.convs: List[Conversation] = []

    def _open_store(self):
        cfg = self.cfg
        fp = self.cache.layout.fingerprint()
        if cfg.store == "embedded":
            return EmbeddedStore(cfg.store_bytes, fingerprint=fp, disk_path=cfg.disk_path, disk_bytes=cfg.disk_bytes)
        if cfg.disk_path is not None:
            raise ValueError("--disk-path: the disk tier is the embedded store's; use --store embedded")
        if cfg.store == "mooncake":
            self.master = start_master()
            return MooncakeStore(self.master, segment_bytes=cfg.store_bytes, local_hostname=self.master.host, fingerprint=fp)
        if cfg.store.startswith("mooncake://"):
            return MooncakeStore(cfg.store[len("mooncake://"):], segment_bytes=cfg.store_bytes, fingerprint=fp)
        raise ValueError(f"--store {cfg.store!r}: use embedded, mooncake or mooncake://HOST:PORT")

    def close(self) -> None:
        self.engine.shutdown()
        self.store.close()
        if self.master is not None:
            self.master.stop()

    # ---- workload ------------------------------------------------------------------------

    def _tokens(self, count: int) -> List[int]:
        return [self.rng.randrange(1, 150_000) for _ in range(count)]

    def _hash_more(self, conv: Conversation) -> None:
        """Extend the conversation's hash chain over its new full hash blocks."""
        done = len(conv.hashes) * self.h
        full = len(conv.tokens) // self.h * self.h
        if full > done:
            parent = conv.hashes[-1] if conv.hashes else None
            conv.hashes.extend(self.hasher.hash_blocks(conv.tokens[done:full], self.h, parent=parent))

    def _known_keys(self, convs: List[Conversation]) -> List[str]:
        """Every key the lookups of ``convs`` consult: what the store can hold for them."""
        keys: Dict[str, None] = {}
        for conv in convs:
            if conv.hashes:
                keys.update(dict.fromkeys(self.planner.lookup_keys(conv.hashes, len(conv.tokens))))
        return list(keys)

    FAULT_KINDS = ("corrupt", "restart", "evict")

    def _inject_fault(self, batch: List[Conversation]) -> str:
        """One store fault before a batch of requests, in turn: corrupt values the batch will
        read, restart the store, evict half of what it holds."""
        kind = self.FAULT_KINDS[(self.rounds // self.cfg.fault_every - 1) % len(self.FAULT_KINDS)]
        store = self.store
        if kind == "restart" and not faults.can_restart(store, self.master):
            kind = "evict"  # a master we did not start: evict instead
        if kind == "corrupt":
            victims = faults.corrupt_values(store, self.rng, 8, keys=self._known_keys(batch))
            self.faults["corrupted_values"] = self.faults.get("corrupted_values", 0) + victims
        elif kind == "restart":
            faults.restart(store, self.master)
            self.faults["store_restarts"] = self.faults.get("store_restarts", 0) + 1
        else:
            keys = None if isinstance(store, EmbeddedStore) else self._known_keys(self.convs)
            removed = faults.evict(store, self.rng, 0.5, keys=keys)
            self.faults["evicted_values"] = self.faults.get("evicted_values", 0) + removed
        self.faults[f"fault_{kind}"] = self.faults.get(f"fault_{kind}", 0) + 1
        return kind

    def run(self) -> dict:
        cfg = self.cfg
        system = self._tokens(cfg.system_tokens)
        convs = [Conversation(f"conv{i}", system + self._tokens(cfg.user_tokens)) for i in range(cfg.conversations)]
        self.convs = convs
        progress = None
        if cfg.progress:
            try:
                from tqdm import tqdm

                progress = tqdm(total=cfg.turns * cfg.conversations, desc="simulate", unit="req", file=sys.stderr)
            except ImportError:
                progress = None
        started = time.perf_counter()
        for turn in range(cfg.turns):
            for first in range(0, len(convs), cfg.batch):
                self._round(turn, convs[first : first + cfg.batch])
            if progress is not None:
                progress.update(len(convs))
            for conv in convs:
                conv.tokens += self._tokens(cfg.reply_tokens) + self._tokens(cfg.user_tokens)
        if progress is not None:
            progress.close()
        return self.summary(time.perf_counter() - started)

    def _round(self, turn: int, convs: List[Conversation]) -> None:
        cfg, planner, cache = self.cfg, self.planner, self.cache
        for conv in convs:
            self._hash_more(conv)
        if cfg.fault_every and self.rounds and self.rounds % cfg.fault_every == 0:
            self.engine.wait_idle()
            self._inject_fault(convs)
        self.rounds += 1
        round_start = time.perf_counter()
        before = dict(self.engine.counters)
        hits = self.engine.lookup([(c.req_id, c.hashes, len(c.tokens)) for c in convs])
        tables: Dict[str, List[List[int]]] = {}
        for conv in convs:
            n = len(conv.tokens)
            tables[conv.req_id] = [
                self.allocator.allocate(g, -(-n // cache.block_tokens(g))) for g in range(len(self.groups))
            ]
            for g, table in enumerate(tables[conv.req_id]):
                cache.tensors[g][table] = GARBAGE
        loads = [
            LoadRequest(c.req_id, c.hashes, tables[c.req_id], hits[c.req_id]) for c in convs if hits[c.req_id] > 0
        ]
        sync = cfg.load_timing == "sync"
        if sync:  # the load runs in the first computing step, after preprocess_mamba
            for conv in convs:
                self._preprocess_mamba(tables[conv.req_id], hits[conv.req_id])
        if loads:
            self.engine.submit(loads=loads)
            self.engine.wait_idle()
        finished = self.engine.get_finished()
        verified_hits = {}
        for conv in convs:
            hit = hits[conv.req_id]
            if hit and conv.req_id in finished.loads_failed:
                hit = 0  # recompute: a failed load costs only recomputation
            if not sync or not hit:  # a recompute starts over from the initial state
                self._preprocess_mamba(tables[conv.req_id], hit)
            if hit:
                self._verify(conv, tables[conv.req_id], hit)
            verified_hits[conv.req_id] = hit
        # Chunked prefill of [hit, n): one engine step per chunk, all requests of the batch
        # advancing together, each step saving up to its chunk end and handing off the Mamba
        # state at the last aligned boundary it reached (a fresh copy-on-write block).
        a = planner.alignment
        progress = {c.req_id: verified_hits[c.req_id] for c in convs}  # tokens computed
        handed = {c.req_id: verified_hits[c.req_id] for c in convs}  # last Mamba state stored
        saves_failed: set = set()
        while True:
            step = [c for c in convs if progress[c.req_id] < len(c.tokens)]
            if not step:
                break
            saves, cows = [], []
            for conv in step:
                n, table = len(conv.tokens), tables[conv.req_id]
                lo = progress[conv.req_id]
                hi = min(n, lo + self.chunk)
                progress[conv.req_id] = hi
                boundary = min(hi, len(conv.hashes) * self.h) // a * a
                handoffs = []
                for g, spec in enumerate(self.groups):
                    if spec.kind == "mamba":
                        state = self._compute_state(g, conv.hashes, table[g], lo, boundary)
                        if boundary > handed[conv.req_id] and planner.hashes_per_block[g]:
                            (cow,) = self.allocator.allocate(g, 1)
                            cache.tensors[g][cow] = state
                            if g in self.align_mamba:
                                self._check_state(g, cow, conv.hashes, boundary)
                            handoffs.append((g, cow, boundary))
                            cows.append((g, cow))
                    else:
                        cache.write_tokens(g, table[g], conv.hashes, lo, hi)
                if handoffs:
                    handed[conv.req_id] = boundary
                saves.append(SaveRequest(conv.req_id, list(conv.hashes), table, hi, handoffs))
            self.engine.submit(saves=saves)
            self.engine.wait_idle()
            saves_failed |= self.engine.get_finished().saves_failed
            for g, cow in cows:
                self.allocator.release(g, [cow])
        for conv in convs:
            for g, table in enumerate(tables[conv.req_id]):
                self.allocator.release(g, table)
            # Each turn is a new request to the engine; what it stored stays in the store.
            self.engine.finish_request(conv.req_id)
        after = self.engine.counters
        elapsed = time.perf_counter() - round_start
        prompt = sum(len(c.tokens) for c in convs)
        self.history.append(
            {
                "turn": turn,
                "prompt_tokens": prompt,
                "hit_tokens": sum(verified_hits.values()),
                "hit_rate": sum(verified_hits.values()) / prompt if prompt else 0.0,
                "bytes_moved": (after["bytes_loaded"] - before.get("bytes_loaded", 0))
                + (after["bytes_stored"] - before.get("bytes_stored", 0)),
                "seconds": elapsed,
                "saves_failed": len(saves_failed),
            }
        )

    def _preprocess_mamba(self, table: List[List[int]], hit: int) -> None:
        """vLLM's preprocess_mamba at a request's first computing step (align mode): the
        running-state block starts as a copy of the hit-state block, whatever that holds now;
        without a hit the kernel starts from the initial state."""
        for g in self.align_mamba:
            running = self.cache.tensors[g][table[g][-1]]
            if hit:
                running[:] = self.cache.tensors[g][table[g][(hit - 1) // self.cache.block_tokens(g)]]
            else:
                running.zero_()

    def _compute_state(self, g: int, hashes: List[bytes], table: List[int], lo: int, hi: int) -> torch.Tensor:
        """The Mamba state at ``hi`` a chunk from ``lo`` computes. In align mode: the running-state
        block, advanced from lo to hi; an error it started with stays in it."""
        expected = self.cache.state_at(g, hashes, hi)
        if g not in self.align_mamba:
            return expected
        running = self.cache.tensors[g][table[-1]]
        running[:] = expected ^ running ^ self.cache.state_at(g, hashes, lo)
        return running

    def _check_state(self, g: int, block_id: int, hashes: List[bytes], tokens: int) -> None:
        expected = self.cache.state_at(g, hashes, tokens)
        self.wrong_bytes += int((self.cache.tensors[g][block_id] != expected).sum())
        self.verified_bytes += expected.numel()

    def _verify(self, conv: Conversation, table: List[List[int]], hit: int) -> None:
        plan = self.planner.plan_load(conv.hashes, table, hit)
        for key, g, block_id in plan.gets:
            if self.groups[g].kind == "mamba":
                self._check_state(g, block_id, conv.hashes, hit)
            else:
                index = table[g].index(block_id)
                self.wrong_bytes += self.cache.wrong_bytes_tokens(g, block_id, index, conv.hashes, hit)
                b = self.cache.block_tokens(g)
                self.verified_bytes += (min((index + 1) * b, hit) - index * b) * self.cfg.token_bytes
        # What the first chunk computes from: right only if the hit state was there in time.
        for g in self.align_mamba:
            self._check_state(g, table[g][-1], conv.hashes, hit)

    # ---- report --------------------------------------------------------------------------

    def summary(self, seconds: float) -> dict:
        c = self.engine.counters
        t = self.engine.timings
        prompt = sum(r["prompt_tokens"] for r in self.history)
        hit = sum(r["hit_tokens"] for r in self.history)
        put_seconds = self.engine.seconds["put"]
        get_seconds = self.engine.seconds["get"]
        outcomes = {k: v for k, v in sorted(c.items()) if k.startswith(("tail_", "put_", "get_", "loads_", "load_", "save_", "saves_", "lookup_errors", "refused", "worker_errors"))}
        outcomes.update(self.faults)
        return {
            "mix": self.cfg.mix.name,
            "groups": format_groups(self.groups),
            "S": self.s,
            "H": self.h,
            "partial_hits": self.planner.partial_hits,
            "store": self.cfg.store,
            "conversations": self.cfg.conversations,
            "turns": self.cfg.turns,
            "chunk_tokens": self.chunk,
            "load_timing": self.cfg.load_timing,
            "verified": self.wrong_bytes == 0,
            "wrong_bytes": self.wrong_bytes,
            "verified_bytes": self.verified_bytes,
            "hit_rate": hit / prompt if prompt else 0.0,
            "tokens_saved": hit,
            "prompt_tokens": prompt,
            "bytes_stored": c["bytes_stored"],
            "bytes_loaded": c["bytes_loaded"],
            "put_gbps": c["bytes_stored"] / put_seconds / 1e9 if put_seconds else 0.0,
            "get_gbps": c["bytes_loaded"] / get_seconds / 1e9 if get_seconds else 0.0,
            "latency_ms": {
                op: {"p50": _percentile(t.get(op, []), 0.5) * 1e3, "p99": _percentile(t.get(op, []), 0.99) * 1e3}
                for op in ("lookup", "put", "get")
            },
            "outcomes": outcomes,
            "disk": self.store.disk_counters() if isinstance(self.store, EmbeddedStore) else {},
            "faults": dict(self.faults),
            "seconds": seconds,
            "history": self.history,
        }


def print_table(result: dict, out=None) -> None:
    out = out if out is not None else sys.stdout  # looked up per call: stdout may be redirected
    rows = [
        ("mix", f"{result['mix']}  ({result['groups']})"),
        ("S / H", f"{result['S']} / {result['H']}  partial hits {'on' if result['partial_hits'] else 'off'}"),
        ("store", result["store"]),
        ("requests", f"{result['conversations']} conversations x {result['turns']} turns, prefill chunks of {result['chunk_tokens']} tokens, {result['load_timing']} loads"),
        ("hit rate", f"{result['hit_rate']:.1%}  ({result['tokens_saved']} of {result['prompt_tokens']} prompt tokens)"),
        ("verified", f"{result['verified']}  ({result['verified_bytes']} bytes of loads and Mamba states checked, {result['wrong_bytes']} wrong)"),
        ("stored", f"{result['bytes_stored'] / 1e6:.1f} MB at {result['put_gbps']:.2f} GB/s"),
        ("loaded", f"{result['bytes_loaded'] / 1e6:.1f} MB at {result['get_gbps']:.2f} GB/s"),
    ]
    disk = result.get("disk") or {}
    if disk:
        rows.append(("disk tier", f"{disk.get('disk_bytes_written', 0) / 1e6:.1f} MB written, "
                                  f"{disk.get('disk_bytes_read', 0) / 1e6:.1f} MB read, "
                                  f"{disk.get('disk_records_rejected', 0)} records rejected"))
    for op, lat in result["latency_ms"].items():
        rows.append((f"{op} p50 / p99", f"{lat['p50']:.2f} / {lat['p99']:.2f} ms"))
    for name, count in result["outcomes"].items():
        rows.append((f"  {name}", str(count)))
    rows.append(("wall time", f"{result['seconds']:.1f} s"))
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}", file=out)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    turns = [r["turn"] for r in result["history"]]
    fig, left = plt.subplots(figsize=(7, 4))
    left.plot(turns, [r["hit_rate"] * 100 for r in result["history"]], "o-", color="tab:blue")
    left.set_xlabel("turn")
    left.set_ylabel("hit rate (%)", color="tab:blue")
    right = left.twinx()
    right.plot(
        turns,
        [r["bytes_moved"] / r["seconds"] / 1e9 if r["seconds"] else 0 for r in result["history"]],
        "s--",
        color="tab:orange",
    )
    right.set_ylabel("bytes moved per second (GB/s)", color="tab:orange")
    left.set_title(f"kvstride simulate: {result['mix']} on {result['store']}")
    fig.tight_layout()
    fig.savefig(path)


def run_simulation(cfg: SimConfig) -> dict:
    sim = Simulation(cfg)
    try:
        return sim.run()
    finally:
        sim.close()


# ---- trace replay (``kvstride simulate --trace``) -------------------------------------------

DEFAULT_TRACE_CAPACITIES = ("256G", "1T", "4T", "16T")


def run_trace(path: str, *, model: Optional[str] = None, capacities=DEFAULT_TRACE_CAPACITIES,
              policies=None, progress: bool = False, limit: Optional[int] = None, disk_bytes=0,
              **kwargs) -> List[dict]:
    """Replay a Mooncake-format trace (``kvstride.trace``) for each policy x capacity: one
    result dict each (policy, model, capacity_bytes, requests, prompt_tokens, hit_tokens,
    token_hit_rate, bytes_written, bytes_written_per_request, resident_bytes_by_kind ...).
    With ``disk_bytes`` (kvstride only), each capacity is followed by that memory over a disk,
    one result per disk policy (``disk_policies``, default both; disk_policy,
    disk_bytes_written_per_request, disk_bytes_read_per_request ...)."""
    from kvstride import trace as tr

    requests = tr.read_trace(path, limit=limit)
    geometry = tr.load_model(model or tr.DEFAULT_MODEL)
    caps = [c if isinstance(c, int) else parse_size(c) for c in capacities]
    disk = disk_bytes if isinstance(disk_bytes, int) else parse_size(disk_bytes)
    return tr.replay(requests, geometry, caps, list(policies or tr.POLICIES), progress=progress, disk_bytes=disk,
                     **kwargs)


def print_trace_table(results: List[dict], out=None) -> None:
    out = out if out is not None else sys.stdout
    if not results:
        return
    first = results[0]
    print(f"model {first['model']}  ({first['groups']}, S={first['S']} H={first['H']})  "
          f"{first['requests']} requests, {first['prompt_tokens']} prompt tokens", file=out)
    memory_alone = [r for r in results if not r["disk_bytes"]]
    dense = {r["capacity_bytes"]: r for r in memory_alone if r["policy"] == "dense"}
    header = f"{'policy':<15} {'capacity':>8} {'hit rate':>9} {'vs dense':>9} {'GiB written/req':>15} {'vs dense':>9}  resident by kind (GiB)"
    print(header, file=out)
    for r in memory_alone:
        d = dense.get(r["capacity_bytes"])
        hit_ratio = f"{r['token_hit_rate'] / d['token_hit_rate']:.2f}x" if d and d["token_hit_rate"] else "-"
        wr_ratio = f"{r['bytes_written'] / d['bytes_written']:.2f}x" if d and d["bytes_written"] else "-"
        resident = ", ".join(f"{k} {v / 2**30:.0f}" for k, v in r["resident_bytes_by_kind"].items())
        print(f"{r['policy']:<15} {r['capacity']:>8} {r['token_hit_rate']:>9.1%} {hit_ratio:>9} "
              f"{r['bytes_written_per_request'] / 2**30:>15.3f} {wr_ratio:>9}  {resident}", file=out)
    if len(memory_alone) < len(results):
        _print_disk_table(results, out)
    bad = sum(r["unservable_hits"] for r in results)
    print(f"hits every group could not serve: {bad}", file=out)


def _print_disk_table(results: List[dict], out) -> None:
    """Per policy and memory capacity: the hit rate of memory alone, and per disk policy that
    of memory over the disk with the disk's GiB written and read per request."""
    tiered = [r for r in results if r["disk_bytes"]]
    disk_policies = list(dict.fromkeys(r["disk_policy"] for r in tiered))
    by_tier = {(r["policy"], r["capacity_bytes"], r["disk_policy"]): r for r in tiered}
    print(f"\nwith a {tiered[0]['disk']} disk below memory (disk GiB written / read per request):", file=out)
    print(f"{'policy':<15} {'memory':>8} {'alone':>7}"
          + "".join(f"  | {p:>13} {'written':>8} {'read':>7}" for p in disk_policies), file=out)
    for r in results:
        if r["disk_bytes"]:
            continue
        row = f"{r['policy']:<15} {r['capacity']:>8} {r['token_hit_rate']:>7.1%}"
        for p in disk_policies:
            d = by_tier[(r["policy"], r["capacity_bytes"], p)]
            row += (f"  | {d['token_hit_rate']:>13.1%} {d['disk_bytes_written_per_request'] / 2**30:>8.3f} "
                    f"{d['disk_bytes_read_per_request'] / 2**30:>7.3f}")
        print(row, file=out)


def _capacity_label(gib: float) -> str:
    """256 GiB, 1 TiB, 16 TiB: an axis tick in the units a capacity is given in."""
    if gib >= 1024:
        return f"{gib / 1024:g} TiB"
    return f"{gib:g} GiB"


def plot_trace(results: List[dict], path: str) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(r: dict) -> str:
        return f"{r['policy']} + {r['disk']} disk, {r['disk_policy']}" if r["disk_bytes"] else r["policy"]

    fig, ax = plt.subplots(figsize=(7, 4))
    for line in dict.fromkeys(label(r) for r in results):
        rows = sorted((r["capacity_bytes"], r["token_hit_rate"]) for r in results if label(r) == line)
        ax.plot([c / (1 << 30) for c, _ in rows], [h * 100 for _, h in rows], "o-", label=line)
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda gib, _: _capacity_label(gib)))
    ax.set_xlabel("store capacity")
    ax.set_ylabel("token hit rate (%)")
    ax.set_title(f"kvstride simulate --trace: {results[0]['model']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
