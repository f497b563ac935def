"""``OffloadEngine`` end to end, driven as docs/LIBRARY.md's "Driving the engine" does: save a
request's blocks (plan, copy, store), then look it up and load it into other blocks, with
verified reads on, against raw copies of the same bytes in the same run.

    python benches/engine.py [--blocks 256] [--layers 4] [--piece-kib 64] [--repeat 31]
                             [--threads 1] [--stores embedded,mooncake]

The workload: one request of 256 blocks x 4 full-attention layers, 64 KiB per
layer and block (64 MiB), in vLLM's CPU-backend layer layout. Every repetition saves a fresh
request (new tokens, so new keys) and loads it back; the loaded blocks are checked byte for
byte. Timed: ``submit`` of the save until the engine is idle (the save is stored), and the
lookup plus ``submit`` of the load until it is finished.

Baselines, same bytes, same run: one raw torch ``copy_`` of a contiguous 64 MiB tensor, timed
before and after every repetition (the median of those is the baseline); for
the Mooncake store also the raw client (``batch_put_from_multi_buffers`` /
``batch_get_into_multi_buffers`` of the blocks' pieces, no header, no hash) plus that copy,
which is what a save or load has to do at the least.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import numpy as np
import torch

import kvstride
from kvstride.engine import LoadRequest, OffloadEngine, SaveRequest
from kvstride.layout import KVLayout
from kvstride.stores import EmbeddedStore, MooncakeStore, start_master
from kvstride.transfer import StagingPool, Transfer


class Workload:
    def __init__(self, args) -> None:
        self.blocks = args.blocks
        num_blocks = 2 * args.blocks + 1  # sources and destinations apart; 0 is vLLM's null block
        heads, self.block_tokens = 2, 32
        dim2 = args.piece_kib * 1024 // 2 // (heads * self.block_tokens)  # bf16
        self.kv = {
            f"layer{i}": torch.randn(num_blocks, heads, self.block_tokens, dim2).to(torch.bfloat16)
            for i in range(args.layers)
        }
        self.layout = KVLayout(self.kv, [list(self.kv)], num_blocks=num_blocks)
        self.bytes = args.blocks * self.layout.block_bytes(0)
        groups = [kvstride.GroupSpec("full_attention", self.block_tokens)]
        s, h = kvstride.resolve_block_sizes(groups)
        self.planner = kvstride.KeyPlanner(groups, hash_block_size=h, scheduler_block_size=s, namespace="bench")
        self.hasher = kvstride.BlockHasher(seed="0")
        self.tokens = args.blocks * self.block_tokens
        self.src = [list(range(1, args.blocks + 1))]
        self.dst = [list(range(args.blocks + 1, 2 * args.blocks + 1))]
        self._fresh = itertools.count()

    def hashes(self):
        """A fresh request: new tokens, so keys the store has not seen."""
        start = next(self._fresh) * self.tokens
        return self.hasher.hash_blocks(np.arange(start + 1, start + self.tokens + 1, dtype=np.int64), self.block_tokens)

    def check_loaded(self) -> None:
        for t in self.kv.values():
            assert torch.equal(t[self.src[0][0] : self.src[0][-1] + 1], t[self.dst[0][0] :]), "a load wrote wrong bytes"


def bench_engine(work: Workload, engine: OffloadEngine, repeat: int, raw_copy):
    """Median save and load seconds, each next to the raw copy timed just before it: the
    machine's memory bandwidth drifts, so every operation has its own baseline, and the
    ratio reported is the median of these pairs."""
    times = {"save": [], "load": [], "raw": []}
    ratios = {"save": [], "load": []}
    for rep in range(repeat + 1):  # the first is a warm-up
        hashes = work.hashes()
        raw_save = raw_copy()
        start = time.perf_counter()
        engine.submit(saves=[SaveRequest(f"s{rep}", hashes, work.src, work.tokens)])
        engine.wait_idle()
        saved = time.perf_counter() - start
        done = engine.get_finished()
        assert not done.saves_failed, engine.counters
        raw_load = raw_copy()
        start = time.perf_counter()
        hit = engine.lookup([(f"l{rep}", hashes, work.tokens + 1)])[f"l{rep}"]
        engine.submit(loads=[LoadRequest(f"l{rep}", hashes, work.dst, hit)])
        engine.wait_idle()
        loaded = time.perf_counter() - start
        done = engine.get_finished()
        assert hit == work.tokens and not done.loads_failed, (hit, engine.counters)
        work.check_loaded()
        for t in work.kv.values():  # the next load must write every byte again
            t[work.dst[0][0] :].zero_()
        if rep:
            times["save"].append(saved)
            times["load"].append(loaded)
            times["raw"] += [raw_save, raw_load]
            ratios["save"].append(raw_save / saved)
            ratios["load"].append(raw_load / loaded)
    return {k: statistics.median(v) for k, v in times.items()}, {k: statistics.median(v) for k, v in ratios.items()}


def warm_segment(store: MooncakeStore, pool: StagingPool, work: Workload) -> None:
    """Write the whole segment once with throw-away values, then remove them: Mooncake faults
    its segment pages in on first use, which neither path should pay inside the timing (a store
    that has run a while has touched them all)."""
    client, size, n = store.client, work.layout.block_bytes(0), work.blocks
    keys_all = []
    for batch in range(store.segment_bytes // work.bytes):
        keys = [f"warm-{batch}-{b}" for b in range(n)]
        codes = client.batch_put_from_multi_buffers(keys, [[pool.ptr + b * size] for b in range(n)], [[size]] * n)
        keys_all += [k for k, c in zip(keys, codes) if c == 0]
    client.batch_remove(keys_all, True)


def bench_raw_mooncake(work: Workload, store: MooncakeStore, pool: StagingPool, repeat: int):
    """The raw client on the same bytes: one value per block, its pieces as parts (what the
    engine stages), copied in and out of staging with one raw copy_ each way."""
    piece = work.layout.groups[0].pieces[0].size
    parts = len(work.layout.groups[0].pieces)
    staging = pool.tensor[: work.bytes]
    ptrs = [[pool.ptr + (b * parts + p) * piece for p in range(parts)] for b in range(work.blocks)]
    sizes = [[piece] * parts for _ in range(work.blocks)]
    source = torch.empty(work.bytes, dtype=torch.uint8).random_()
    client = store.client
    fresh = itertools.count()
    puts, gets = [], []
    for rep in range(repeat + 1):
        keys = [f"raw-{next(fresh)}-{b}" for b in range(work.blocks)]
        start = time.perf_counter()
        staging.copy_(source)
        codes = client.batch_put_from_multi_buffers(keys, ptrs, sizes)
        put = time.perf_counter() - start
        assert all(c == 0 for c in codes), codes[:4]
        start = time.perf_counter()
        codes = client.batch_get_into_multi_buffers(keys, ptrs, sizes)
        source.copy_(staging)
        get = time.perf_counter() - start
        assert all(c == work.layout.block_bytes(0) for c in codes), codes[:4]
        client.batch_remove(keys, True)
        if rep:
            puts.append(put)
            gets.append(get)
    return statistics.median(puts), statistics.median(gets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--piece-kib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=31)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the baseline's)")
    parser.add_argument("--stores", default="embedded,mooncake")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Workload(args)
    gb = work.bytes / 1e9

    raw_src = torch.empty(work.bytes, dtype=torch.uint8).random_()
    raw_dst = torch.empty(work.bytes, dtype=torch.uint8)

    def raw_copy() -> float:
        start = time.perf_counter()
        raw_dst.copy_(raw_src)
        return time.perf_counter() - start

    rows = []  # (name, median seconds, ratio vs its baseline)

    def engine_rows(name: str, engine: OffloadEngine) -> dict:
        times, ratios = bench_engine(work, engine, args.repeat, raw_copy)
        engine.shutdown()
        rows.append((f"{name}: raw torch copy_", times["raw"], 1.0))
        rows.append((f"{name}: save", times["save"], ratios["save"]))
        rows.append((f"{name}: load", times["load"], ratios["load"]))
        return times

    stores = args.stores.split(",")
    if "embedded" in stores:
        store = EmbeddedStore(3 * work.bytes)  # room for 3 requests: later ones evict
        engine_rows("embedded", OffloadEngine(work.planner, work.layout, store))
        assert store.nbytes <= store.capacity
    if "mooncake" in stores:
        master = start_master()
        try:
            # Room for every request of the run (the engine's values stay).
            segment = (args.repeat + 3) * (work.bytes + (4 << 20))
            store = MooncakeStore(master, segment_bytes=segment, fingerprint=b"benchfp0")
            pool = StagingPool(work.bytes + (1 << 20))
            pool.register(store.register_buffer)
            warm_segment(store, pool, work)
            raw_put, raw_get = bench_raw_mooncake(work, store, pool, args.repeat)
            times = engine_rows("mooncake", OffloadEngine(work.planner, Transfer(work.layout, pool), store))
            rows += [
                ("raw copy_ + raw batch put", raw_put, times["raw"] / raw_put),
                ("raw batch get + raw copy_", raw_get, times["raw"] / raw_get),
                ("mooncake: save vs raw put", times["save"], raw_put / times["save"]),
                ("mooncake: load vs raw get", times["load"], raw_get / times["load"]),
            ]
            store.close()
        finally:
            master.stop()

    print(
        f"{args.blocks} blocks x {args.layers} layers x {args.piece_kib} KiB = {work.bytes >> 20} MiB per request, "
        f"verified reads on, torch threads {args.threads}, median of {args.repeat}"
    )
    print()
    print("| path | median ms | GB/s | vs baseline |")
    print("|---|---:|---:|---:|")
    for name, seconds, ratio in rows:
        print(f"| {name} | {seconds * 1e3:.2f} | {gb / seconds:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
