"""End-to-end engine check and bench on a CUDA machine: a hybrid KV cache on the GPU (full
attention + sliding window + Mamba state + a scratch ring), requests saved through the
OffloadEngine into the embedded store, then looked up and loaded into fresh blocks; every
loaded byte is compared on the GPU with what was saved.

    python benches/gpu_engine.py [--requests 16] [--tokens 8192]

Needs torch with CUDA, numpy, xxhash and the built kvstride extension (python/kvstride/_core).
Prints a markdown table; exits non-zero if a loaded byte differs.
"""

import argparse
import sys
import time

import torch

import kvstride
from kvstride.engine import LoadRequest, OffloadEngine, SaveRequest
from kvstride.layout import KVLayout
from kvstride.stores import EmbeddedStore


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=8192)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    groups = [
        kvstride.GroupSpec("full_attention", 256),
        kvstride.GroupSpec("sliding_window", 256, window=1024),
        kvstride.GroupSpec("mamba", 1024),
        kvstride.GroupSpec("circular_buffer", 4),
    ]
    S, H = kvstride.resolve_block_sizes(groups, prefix_match_unit=256)
    planner = kvstride.KeyPlanner(groups, hash_block_size=H, scheduler_block_size=S, namespace="gpu-engine")
    per_request = [-(-args.tokens // (g.block_size)) + 1 for g in groups]
    num_blocks = [args.requests * 2 * n + 2 for n in per_request]
    heads, dim, layers = 8, 128, 2
    kv, names = {}, []
    for g, spec in enumerate(groups):
        layer_names = [f"g{g}l{i}" for i in range(layers)]
        for name in layer_names:
            if spec.kind == "mamba":
                kv[name] = [
                    torch.randn(num_blocks[g], 4, 2048, dtype=torch.bfloat16, device=device),
                    torch.randn(num_blocks[g], 16, 64, 128, dtype=torch.bfloat16, device=device),
                ]
            else:
                kv[name] = torch.randn(2, num_blocks[g], spec.block_size, heads, dim, dtype=torch.bfloat16, device=device)
        names.append(layer_names)
    layout = KVLayout(kv, names)
    # Slots are as large as the largest block: room for every stored block of every request (the
    # scratch ring's blocks are never stored).
    largest = max(g.block_bytes for g in layout.groups)
    stored = sum(n for n, keyed in zip(per_request, planner.hashes_per_block) if keyed)
    store = EmbeddedStore(2 * args.requests * stored * largest)
    engine = OffloadEngine(planner, layout, store)  # blocks go straight between the GPU and pinned slots
    hasher = kvstride.BlockHasher(seed="0")
    gen = torch.Generator().manual_seed(0)
    requests = []
    next_free = [1] * len(groups)

    def take(g, count):
        ids = list(range(next_free[g], next_free[g] + count))
        next_free[g] += count
        return ids

    for r in range(args.requests):
        tokens = torch.randint(1, 150000, (args.tokens,), generator=gen).numpy()
        hashes = hasher.hash_blocks(tokens, H)
        tables = [take(g, -(-args.tokens // spec.block_size)) for g, spec in enumerate(groups)]
        boundary = args.tokens // planner.alignment * planner.alignment
        handoffs = [(2, tables[2][-1], boundary)]
        requests.append((f"r{r}", hashes, tables, handoffs))
    torch.cuda.synchronize() if device.type == "cuda" else None
    start = time.perf_counter()
    engine.submit(saves=[SaveRequest(rid, h, t, args.tokens, ho) for rid, h, t, ho in requests])
    engine.wait_idle()
    save_s = time.perf_counter() - start
    stored = engine.counters["bytes_stored"]
    hits = engine.lookup([(rid, h, args.tokens + 1) for rid, h, _, _ in requests])
    loads, destinations = [], {}
    for rid, h, tables, _ in requests:
        fresh = [take(g, len(t)) for g, t in enumerate(tables)]
        destinations[rid] = fresh
        loads.append(LoadRequest(rid, h, fresh, hits[rid]))
    start = time.perf_counter()
    engine.submit(loads=loads)
    engine.wait_idle()
    load_s = time.perf_counter() - start
    loaded = engine.counters["bytes_loaded"]
    finished = engine.get_finished()
    wrong = 0
    for (rid, h, tables, _), load in zip(requests, loads):
        plan = planner.plan_load(h, load.block_ids, load.hit_tokens)
        source_of = {}
        for g, table in enumerate(tables):
            for b, block in enumerate(table):
                source_of[(g, load.block_ids[g][b])] = block
        for _key, g, dest in plan.gets:
            src = source_of[(g, dest)]
            if groups[g].kind == "mamba":
                src = requests[int(rid[1:])][3][0][1]  # the hand-off block holds the state
            for name in names[g]:
                value = kv[name]
                for t in value if isinstance(value, list) else [value]:
                    if t.dim() == 5:
                        wrong += int((t[:, src] != t[:, dest]).sum())
                    else:
                        wrong += int((t[src] != t[dest]).sum())
    engine.shutdown()
    ok = wrong == 0 and not finished.loads_failed and all(hits[rid] == args.tokens // planner.alignment * planner.alignment for rid, *_ in requests)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {name}, torch {torch.__version__}; {args.requests} requests x {args.tokens} tokens; "
          f"S={S} H={H}; hits {sorted(set(hits.values()))}\n")
    print("| phase | bytes | seconds | GB/s |")
    print("|---|---|---|---|")
    print(f"| save (D2H into arena slots, digests kept) | {stored} | {save_s:.3f} | {stored / save_s / 1e9:.2f} |")
    print(f"| load (digests checked, slots H2D) | {loaded} | {load_s:.3f} | {loaded / load_s / 1e9:.2f} |")
    print(f"\nverified: {ok} (wrong elements: {wrong}, failed loads: {len(finished.loads_failed)})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
