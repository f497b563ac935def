"""The embedded store's data path on the GPU, as the vLLM connector's workers drive it
(``OffloadEngine.submit_planned`` into ``ArenaSlots``, verified reads on), against a raw pinned
``copy_`` of the same bytes measured in the same run.

    python benches/gpu_engine.py [--geometry all] [--requests 4] [--tokens 4096] [--reps 3]
                                 [--staged embedded|mooncake|none] [--staged-only]

Geometries: ``llama8b`` (32 layers, 8 KV heads x 128, bf16, 16-token blocks: a block is 64
pieces of 32 KiB), ``hybrid`` (full attention + sliding window + Mamba state lists + a scratch
ring, 64-token blocks), ``mla`` (one tensor per layer, 576 wide), ``fp8`` (``llama8b`` in
float8), ``gemma3-tp8`` and ``gpt-oss-tp8`` (one rank of those models at TP 8: full attention and
sliding window, pieces of 8 KiB and 2 KiB). Per geometry: raw D2H and H2D, the engine's save and load each alone and both at once
(a save of other blocks while a load runs), each as GB/s and as a ratio of raw (medians of
``--reps``), and how long ``submit_planned`` held its caller for the save, and its stream for
the save's reads of the groups the connector does not fence (Mamba's); then, not gated, a
save and a load whose slots are scattered (the copy kernels move them rather than the copy
engine), the copies and the host's digests each alone, and the engine's save, load and both at
once again with the digests taken and checked on the device (``DeviceCopier.digests_on_device``),
beside the XXH3 kernel alone. Every loaded byte is compared on the device with what was saved. Pinned memory: the arena's slots for what is saved.

Then the staged path, as the engine drives Mooncake (``Transfer`` into a ``StagingPool``, the
store's ``put`` / ``get`` of the staged values, digests by the store): ``--staged embedded``
(default) puts into the embedded store seen only through its buffer protocol, ``mooncake`` into a
Mooncake master and client started on this host (needs a Mooncake package). Its rows: the
engine's save and load as ratios of raw, and the store's own calls alone (their time inside the
same ops, from the engine's timers).

Then what offload costs the model (``--model-cost``, on by default): the time of one iteration of
a compute-bound workload on the same GPU (``MATMULS`` bf16 matmuls of ``MATMUL_SIZE``, then causal
attention through ``scaled_dot_product_attention`` over ``ATTENTION_TOKENS`` tokens) alone, and
while the engine saves and loads the first geometry's blocks back to back on its lanes (a thread
submits a save and a load, waits for both, and again), as the ratio of the medians of the
iterations' device times (goal: at most 1.03, the model slowed by at most 3 %).

Exits non-zero on a wrong byte and, on CUDA, when save or load is below 0.9 of raw, both at once
below 0.85, or the caller was held more than 2 ms; the staged path when its save or load is
below 0.8 of raw. Without CUDA it runs the same path on CPU
tensors (a smoke run: no goals checked).
"""

import argparse
import statistics
import sys
import threading
import time

import numpy as np
import torch

import kvstride
import kvstride.arena.device
from kvstride.arena.device_xxh3 import launch_xxh3_rows
from kvstride.arena import ArenaSlots
from kvstride.engine import OffloadEngine
from kvstride.layout import KVLayout
from kvstride.stores import EmbeddedStore
from kvstride.transfer import StagingPool, Transfer

GOAL_ONE_WAY, GOAL_BOTH, GOAL_HOLD_S, GOAL_STAGED = 0.9, 0.85, 0.002, 0.8
GOAL_MODEL_SLOWDOWN = 1.03
#: Real hybrids at TP 8, one rank's KV (16-token blocks, bf16): (layers, every how many layers one
#: is full attention, KV heads a rank, head dim, window). Gemma-3-27B: 8 KiB pieces; gpt-oss-120b:
#: 2 KiB pieces.
SMALL_PIECES = {"gemma3-tp8": (62, 6, 2, 128, 1024), "gpt-oss-tp8": (36, 2, 1, 64, 128)}
GEOMETRIES = ["llama8b", "hybrid", "mla", "fp8", *SMALL_PIECES]
MATMULS, MATMUL_SIZE, ATTENTION_TOKENS = 8, 8192, 8192


def build(name: str, blocks: int, device):
    """(kv tensors, layer names per group, group specs) for ``blocks`` blocks of every group."""
    if name in ("llama8b", "fp8"):
        dtype = torch.float8_e4m3fn if name == "fp8" else torch.bfloat16
        kv = {f"l{i}": torch.empty(2, blocks, 16, 8, 128, dtype=dtype, device=device) for i in range(32)}
        return kv, [list(kv)], [kvstride.GroupSpec("full_attention", 16)]
    if name == "mla":
        kv = {f"l{i}": torch.empty(blocks, 64, 576, dtype=torch.bfloat16, device=device) for i in range(32)}
        return kv, [list(kv)], [kvstride.GroupSpec("mla", 64)]
    if name == "hybrid":
        kv = {}
        kv.update({f"fa{i}": torch.empty(2, blocks, 64, 8, 128, dtype=torch.bfloat16, device=device) for i in range(8)})
        kv.update({f"swa{i}": torch.empty(blocks, 2, 64, 8, 128, dtype=torch.bfloat16, device=device) for i in range(8)})
        kv.update({f"m{i}": [torch.empty(blocks, 4, 2048, dtype=torch.bfloat16, device=device),
                             torch.empty(blocks, 16, 64, 128, dtype=torch.bfloat16, device=device)] for i in range(8)})
        kv["ring"] = torch.empty(blocks, 2, 4, 8, 128, dtype=torch.bfloat16, device=device)
        names = [[f"fa{i}" for i in range(8)], [f"swa{i}" for i in range(8)], [f"m{i}" for i in range(8)], ["ring"]]
        specs = [kvstride.GroupSpec("full_attention", 64), kvstride.GroupSpec("sliding_window", 64, window=1024),
                 kvstride.GroupSpec("mamba", 64, mamba_mode="align"), kvstride.GroupSpec("circular_buffer", 4)]
        return kv, names, specs
    if name in SMALL_PIECES:  # one TP rank's share of a real model: pieces of a few KiB
        layers, windowed, heads, dim, window = SMALL_PIECES[name]
        kv = {f"l{i}": torch.empty(2, blocks, 16, heads, dim, dtype=torch.bfloat16, device=device) for i in range(layers)}
        local = [f"l{i}" for i in range(layers) if i % windowed]
        names = [[f"l{i}" for i in range(layers) if not i % windowed], local]
        return kv, names, [kvstride.GroupSpec("full_attention", 16), kvstride.GroupSpec("sliding_window", 16, window=window)]
    raise SystemExit(f"--geometry {name!r}: use {', '.join(GEOMETRIES)} or all")


def median_time(fn, reps: int, sync) -> float:
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def raw_buffers(nbytes: int, device):
    """The same bytes in one contiguous device tensor and one (pinned on CUDA) host tensor."""
    return (torch.empty(nbytes, dtype=torch.uint8, device=device),
            torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda"))


def raw_times(src, host, reps: int, sync):
    """Medians of a raw ``copy_`` device -> host and host -> device."""
    return (median_time(lambda: host.copy_(src, non_blocking=True), reps, sync),
            median_time(lambda: src.copy_(host, non_blocking=True), reps, sync))


def wrong_bytes(kv, names, entries, offset: int) -> int:
    """Bytes of the blocks ``b + offset`` (loaded) that differ from blocks ``b`` (saved), on the device."""
    wrong = 0
    for g, b in entries:
        for layer in names[g]:
            for t in kv[layer] if isinstance(kv[layer], list) else [kv[layer]]:
                dim = 1 if t.dim() == 5 and t.shape[0] == 2 else 0
                wrong += int((t.select(dim, b).view(torch.uint8) != t.select(dim, b + offset).view(torch.uint8)).sum())
    return wrong


def setup(name: str, args, device, copies: int):
    """``name``'s KV cache with room for ``copies`` times one op's blocks (random bytes), its
    layout, a planner, and one op: every stored group's blocks of the requests (a hybrid's
    groups share the count; never the scratch ring), from block 1 on."""
    block_tokens = 16 if name in ("llama8b", "fp8", *SMALL_PIECES) else 64
    saved_blocks = args.requests * -(-args.tokens // block_tokens)
    kv, names, specs = build(name, copies * saved_blocks + 2, device)
    layout = KVLayout(kv, names)
    for storage in layout.storages:
        storage.copy_(torch.randint(0, 256, storage.shape, dtype=torch.uint8, device=device))
    S, H = kvstride.resolve_block_sizes(specs)
    planner = kvstride.KeyPlanner(specs, hash_block_size=H, scheduler_block_size=S, namespace=f"gpu-{name}")
    stored = [g for g, n in enumerate(planner.hashes_per_block) if n]
    entries = [(g, 1 + b) for g in stored for b in range(saved_blocks)]
    # The groups the vLLM connector fences on reallocation (kvstride.vllm.worker.fenced_groups,
    # which needs vLLM): none with Mamba layers, whose new blocks vLLM zeroes before any fence;
    # else all but a scratch ring, rewritten in place.
    mamba = any(spec.kind == "mamba" for spec in specs)
    fenced = [] if mamba else [g for g, spec in enumerate(specs) if spec.kind != "circular_buffer"]
    return kv, names, layout, planner, stored, entries, saved_blocks, fenced


class StreamWait:
    """How long the caller's stream was held by what a call queued on it (a save's waits for its
    reads), between two timing events on CUDA; nothing elsewhere."""

    def __init__(self, device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = []

    def around(self, call):
        if not self.cuda:
            return call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        result = call()
        end.record()
        end.synchronize()
        self.seconds.append(start.elapsed_time(end) / 1e3)
        return result

    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1e3 if self.seconds else 0.0


def run(name: str, args, device) -> bool:
    kv, names, layout, planner, stored, entries, saved_blocks, fenced = setup(name, args, device, 3)
    store = ArenaSlots(2 * len(entries), copier=None if device.type == "cuda" else "device")
    engine = OffloadEngine(planner, layout, store)
    if args.programs:
        store.arena._device.kernels.programs = args.programs
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    try:
        arena_bytes = 2 * len(entries) * max(layout.groups[g].block_bytes for g in stored)
        nbytes = sum(layout.groups[g].block_bytes for g, _ in entries)
        # Raw: the same bytes in one contiguous device tensor and one pinned host tensor.
        src, host = raw_buffers(nbytes, device)
        d2h, h2d = raw_times(src, host, args.reps, sync)
        other = torch.empty_like(src)
        other_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        streams = (torch.cuda.Stream(device), torch.cuda.Stream(device)) if device.type == "cuda" else None

        def raw_both():
            if streams is None:
                host.copy_(src), other.copy_(other_host)
                return
            with torch.cuda.stream(streams[0]):
                host.copy_(src, non_blocking=True)
            with torch.cuda.stream(streams[1]):
                other.copy_(other_host, non_blocking=True)

        both_raw = median_time(raw_both, args.reps, sync)
        saves = [(slot, g, b) for slot, (g, b) in enumerate(entries)]
        holds, job, stream_wait = [], [0], StreamWait(device)

        def save(puts):
            job[0] += 1
            start = time.perf_counter()
            stream_wait.around(lambda: engine.submit_planned(puts={job[0]: puts}, fenced_groups=fenced))
            holds.append(time.perf_counter() - start)
            engine.wait_idle()
            assert engine.get_finished().jobs_done.get(job[0]) == "ok", "a save failed"

        def load(gets, rid="r"):
            engine.submit_planned(gets={rid: gets})
            engine.wait_idle()
            done = engine.get_finished()
            assert rid in done.loads_done and not done.loads_failed, "a load failed"

        save_s = median_time(lambda: save(saves), args.reps, sync)
        hold, waited_ms = statistics.median(holds), stream_wait.median_ms()
        if args.profile:  # where the caller's hold goes, by function
            import cProfile
            import pstats

            profile = cProfile.Profile()
            profile.runcall(engine.submit_planned, puts={-1: saves})
            engine.wait_idle()
            engine.get_finished()
            pstats.Stats(profile).sort_stats("tottime").print_stats(14)
        offset = saved_blocks + 1
        gets = [(slot, g, b + offset) for slot, g, b in saves]
        load_s = median_time(lambda: load(gets), args.reps, sync)
        wrong = wrong_bytes(kv, names, entries, offset)
        second = [(len(saves) + i, g, b) for i, (_, g, b) in enumerate(saves)]  # into other slots

        def both():
            job[0] += 1
            loader = threading.Thread(target=engine.submit_planned, kwargs={"gets": {"both": gets}})
            loader.start()
            engine.submit_planned(puts={job[0]: second}, fenced_groups=fenced)
            loader.join()
            engine.wait_idle()
            done = engine.get_finished()
            assert done.jobs_done.get(job[0]) == "ok" and "both" in done.loads_done and not done.loads_failed

        both_s = median_time(both, args.reps, sync)
        # Slots scattered over the arena (no two consecutive): the kernels move them.
        scattered = [(2 * i + 1, g, b) for i, (_, g, b) in enumerate(saves)]
        scattered_save_s = median_time(lambda: save(scattered), args.reps, sync)
        def zero_destinations():  # a load that wrote nothing would be seen
            for g in stored:
                ids = torch.tensor([b + offset for group, b in entries if group == g], device=device)
                for layer in names[g]:
                    for t in kv[layer] if isinstance(kv[layer], list) else [kv[layer]]:
                        t.view(torch.uint8).index_fill_(1 if t.dim() == 5 and t.shape[0] == 2 else 0, ids, 0)

        zero_destinations()
        scattered_load_s = median_time(lambda: load([(slot, g, b + offset) for slot, g, b in scattered]), args.reps, sync)
        wrong += wrong_bytes(kv, names, entries, offset)
        # Where the engine's time goes: the copies alone (no digests) and the digests alone.
        arena = store.arena
        slots, groups, blocks = (np.array(column) for column in zip(*saves))
        kernel_save_s = median_time(lambda: arena.save(slots, groups, blocks, digest=False), args.reps, sync)
        kernel_load_s = median_time(lambda: arena.load(slots, groups, blocks + offset, verify=False), args.reps, sync)
        digest_s = median_time(lambda: arena._digest(slots, groups), args.reps, sync)
        host_copy_s = median_time(lambda: other_host.copy_(host), args.reps, sync)
        # The same ops with the digests taken and checked on the device; the slots they save load
        # with the host's check too (one digest function).
        arena._device.digests_on_device = True
        first_hold = len(holds)
        device_save_s = median_time(lambda: save(saves), args.reps, sync)
        device_hold = statistics.median(holds[first_hold:])
        arena._device.digests_on_device = False
        zero_destinations()
        load(gets)
        wrong += wrong_bytes(kv, names, entries, offset)
        arena._device.digests_on_device = True
        zero_destinations()
        device_load_s = median_time(lambda: load(gets), args.reps, sync)
        wrong += wrong_bytes(kv, names, entries, offset)
        device_both_s = median_time(both, args.reps, sync)
        arena._device.digests_on_device = False
        # The XXH3 kernel alone, over the same values in device memory.
        lengths = np.array([layout.groups[g].block_bytes for g, _ in entries], dtype=np.uint64)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.uint64)
        table = torch.from_numpy(np.stack([np.uint64(src.data_ptr()) + starts, lengths]).view(np.int64)).to(device)
        found = torch.empty(len(entries), dtype=torch.int64, device=device)
        device_digest_s = None
        if device.type == "cuda":  # (a CPU run has no kernels)
            device_digest_s = median_time(lambda: launch_xxh3_rows(src, table, 0, len(entries), 0, 1, found), args.reps, sync)
    finally:
        engine.shutdown()
    ratios = {"save": d2h / save_s, "load": h2d / load_s, "both": both_raw / both_s}
    gbs = lambda seconds, scale=1: scale * nbytes / seconds / 1e9  # noqa: E731
    print(f"\n### {name}: {len(entries)} blocks, {nbytes / 2**30:.2f} GiB a way; pinned arena {arena_bytes / 2**30:.2f} GiB\n")
    print("| path | GB/s | x raw |\n|---|---|---|")
    print(f"| raw copy_ D2H | {gbs(d2h):.1f} | 1.00 |\n| raw copy_ H2D | {gbs(h2d):.1f} | 1.00 |")
    print(f"| raw both ways at once | {gbs(both_raw, 2):.1f} | 1.00 |")
    print(f"| engine save | {gbs(save_s):.1f} | {ratios['save']:.2f} |")
    print(f"| engine load | {gbs(load_s):.1f} | {ratios['load']:.2f} |")
    print(f"| engine save and load at once | {gbs(both_s, 2):.1f} | {ratios['both']:.2f} |")
    print(f"| engine save, scattered slots | {gbs(scattered_save_s):.1f} | {d2h / scattered_save_s:.2f} |")
    print(f"| engine load, scattered slots | {gbs(scattered_load_s):.1f} | {h2d / scattered_load_s:.2f} |")
    print(f"| copies alone, save (no digests) | {gbs(kernel_save_s):.1f} | {d2h / kernel_save_s:.2f} |")
    print(f"| copies alone, load (no digests) | {gbs(kernel_load_s):.1f} | {h2d / kernel_load_s:.2f} |")
    print(f"| digests alone (XXH3 of the slots, host) | {gbs(digest_s):.1f} | |")
    print(f"| host memory copy (torch, {torch.get_num_threads()} threads) | {gbs(host_copy_s):.1f} | |")
    print(f"| engine save, digests on the device | {gbs(device_save_s):.1f} | {d2h / device_save_s:.2f} |")
    print(f"| engine load, digests on the device | {gbs(device_load_s):.1f} | {h2d / device_load_s:.2f} |")
    print(f"| engine save and load at once, digests on the device | {gbs(device_both_s, 2):.1f} | "
          f"{both_raw / device_both_s:.2f} |")
    if device_digest_s is not None:
        print(f"| digests alone (XXH3 of device memory, the GPU) | {gbs(device_digest_s):.1f} | |")
    print(f"\nsubmit_planned held its caller {hold * 1e3:.2f} ms for the save ({device_hold * 1e3:.2f} ms with the "
          f"digests on the device); the caller's stream waited {waited_ms:.2f} ms for the save's reads (the "
          f"groups the connector does not fence); wrong bytes: {wrong}")
    ok = wrong == 0
    if device.type == "cuda":
        ok = ok and ratios["save"] >= GOAL_ONE_WAY and ratios["load"] >= GOAL_ONE_WAY
        ok = ok and ratios["both"] >= GOAL_BOTH and hold <= GOAL_HOLD_S
    return ok


class ThroughBuffers:
    """A store seen through its buffer protocol alone (``put`` / ``get`` of host parts): the
    engine stages through its pool, as it does for Mooncake."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __getattr__(self, name):
        if name == "bind_layout":  # never the direct path
            raise AttributeError(name)
        return getattr(self.inner, name)


def staged_store(kind: str, values: int, op_bytes: int, value_bytes: int, reps: int):
    """(store, what to stop afterwards) for ``reps`` saves of ``values`` values (``op_bytes``,
    each at most ``value_bytes``) under new keys, and their loads: the embedded store evicts
    the oldest values, so it holds two ops (a slot a value); a Mooncake segment holds every op."""
    if kind == "embedded":
        return ThroughBuffers(EmbeddedStore(2 * values * value_bytes, slot_bytes=value_bytes)), []
    from kvstride.stores import MooncakeStore, start_master

    master = start_master()
    store = MooncakeStore(master, segment_bytes=(reps + 2) * op_bytes, local_buffer_bytes=64 << 20)
    return store, [store.close, master.stop]


def run_staged(name: str, args, device) -> bool:
    """The engine through its staging pool into ``args.staged``'s store, against raw copies."""
    kv, names, layout, planner, stored, entries, saved_blocks, fenced = setup(name, args, device, 2)
    nbytes = sum(layout.groups[g].block_bytes for g, _ in entries)
    store, stop = staged_store(args.staged, len(entries), nbytes + len(entries) * 4096,
                               max(layout.groups[g].block_bytes for g in stored), args.reps)
    pool = StagingPool(1 << 20)  # replaced below, once the header room is known
    transfer = Transfer(layout, pool)
    transfer.make_header_room_for(store)
    op_bytes = transfer.staged_bytes(entries)
    pool = StagingPool(2 * op_bytes, load_bytes=op_bytes)  # a whole save and a whole load at once
    pool.register(store.register_buffer)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    offset = saved_blocks + 1
    job = [0]

    def measure(digests_on_device: bool) -> dict:
        """The engine's save and load medians, the store's calls in them, the hold, wrong bytes."""
        transfer = Transfer(layout, pool)
        transfer.digests_on_device = digests_on_device
        engine = OffloadEngine(planner, transfer, store)
        holds, store_seconds, stream_wait = [], {"put": [], "get": []}, StreamWait(device)

        def timed_store(call: str, fn) -> None:
            before = engine.seconds[call]
            fn()
            store_seconds[call].append(engine.seconds[call] - before)

        def save() -> None:
            job[0] += 1
            start = time.perf_counter()
            puts = [(f"{name}-{job[0]}-{i}", g, b) for i, (g, b) in enumerate(entries)]
            stream_wait.around(lambda: engine.submit_planned(puts={job[0]: puts}, fenced_groups=fenced))
            holds.append(time.perf_counter() - start)
            engine.wait_idle()
            assert engine.get_finished().jobs_done.get(job[0]) == "ok", f"a save failed: {engine.counters}"

        def load() -> None:
            gets = [(f"{name}-{job[0]}-{i}", g, b + offset) for i, (g, b) in enumerate(entries)]
            engine.submit_planned(gets={"r": gets})
            engine.wait_idle()
            done = engine.get_finished()
            assert "r" in done.loads_done and not done.loads_failed, f"a load failed: {engine.counters}"

        try:
            save_s = median_time(lambda: timed_store("put", save), args.reps, sync)
            load_s = median_time(lambda: timed_store("get", load), args.reps, sync)
        finally:
            engine.shutdown()
        return {"save": save_s, "load": load_s, "put": statistics.median(store_seconds["put"]),
                "get": statistics.median(store_seconds["get"]), "hold": statistics.median(holds),
                "stream wait": stream_wait.median_ms(), "wrong": wrong_bytes(kv, names, entries, offset)}

    # Digests on the device where the store takes them from the copies (Mooncake) and there are kernels.
    modes = [False, True] if getattr(store, "takes_digests", False) and device.type == "cuda" else [False]
    try:
        d2h, h2d = raw_times(*raw_buffers(nbytes, device), args.reps, sync)
        results = {mode: measure(mode) for mode in modes}
    finally:
        for fn in stop:
            fn()
    gbs = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    print(f"\n### {name}, staged into {args.staged}: {len(entries)} blocks, {nbytes / 2**30:.2f} GiB a way; "
          f"pinned pool {pool.capacity / 2**30:.2f} GiB\n")
    print("| path | GB/s | x raw |\n|---|---|---|")
    print(f"| raw copy_ D2H | {gbs(d2h):.1f} | 1.00 |\n| raw copy_ H2D | {gbs(h2d):.1f} | 1.00 |")
    for mode, r in results.items():
        where = ", digests on the device" if mode else ""
        print(f"| engine save (copies, digests, puts){where} | {gbs(r['save']):.1f} | {d2h / r['save']:.2f} |")
        print(f"| engine load (gets, checks, copies){where} | {gbs(r['load']):.1f} | {h2d / r['load']:.2f} |")
        print(f"| the store's puts alone, in those saves | {gbs(r['put']):.1f} | {d2h / r['put']:.2f} |")
        print(f"| the store's gets alone, in those loads | {gbs(r['get']):.1f} | {h2d / r['get']:.2f} |")
    print("\n" + "; ".join(f"submit_planned held its caller {r['hold'] * 1e3:.2f} ms for the save"
                           f"{' (digests on the device)' if mode else ''}, its stream {r['stream wait']:.2f} ms"
                           for mode, r in results.items())
          + f"; wrong bytes: {sum(r['wrong'] for r in results.values())}")
    default = results[False]
    ok = all(r["wrong"] == 0 for r in results.values())
    if device.type == "cuda":
        ok = ok and min(d2h / default["save"], h2d / default["load"]) >= GOAL_STAGED
    return ok


def model_iteration(device, small: bool):
    """One iteration of a compute-bound model stand-in: matmuls, then causal attention."""
    size, tokens = (256, 256) if small else (MATMUL_SIZE, ATTENTION_TOKENS)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(size, size, dtype=dtype, device=device) for _ in range(2))
    q, k, v = (torch.randn(1, 32, tokens, 128, dtype=dtype, device=device) for _ in range(3))

    def iteration():
        for _ in range(MATMULS):
            torch.matmul(a, b)
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    return iteration


def iteration_times(iteration, count: int, device) -> list:
    """Seconds of each of ``count`` iterations: device time between events on CUDA, wall time
    elsewhere."""
    times = []
    for _ in range(count):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            iteration()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            iteration()
            times.append(time.perf_counter() - start)
    return times


def model_cost(name: str, args, device) -> bool:
    """The model's iteration alone, then while the engine saves and loads ``name``'s blocks at
    full rate; their ratio against ``GOAL_MODEL_SLOWDOWN``."""
    kv, names, layout, planner, stored, entries, saved_blocks, fenced = setup(name, args, device, 2)
    store = ArenaSlots(2 * len(entries), copier=None if device.type == "cuda" else "device")
    engine = OffloadEngine(planner, layout, store)
    iteration = model_iteration(device, small=device.type != "cuda")
    count = 10 * args.reps
    saves = [(slot, g, b) for slot, (g, b) in enumerate(entries)]
    # Loads read what the first save wrote; the saves at full rate write other slots meanwhile.
    gets = [(slot, g, b + saved_blocks + 1) for slot, g, b in saves]
    resaves = [(len(saves) + slot, g, b) for slot, g, b in saves]
    stop, rounds, moved, failure = threading.Event(), [0], [0], []

    def offload():  # what the connector's workers would queue, back to back
        try:
            while not stop.is_set():
                rounds[0] += 1
                engine.submit_planned(puts={rounds[0]: resaves}, fenced_groups=fenced)
                engine.submit_planned(gets={f"r{rounds[0]}": gets})
                engine.wait_idle()
                done = engine.get_finished()
                assert done.jobs_done.get(rounds[0]) == "ok" and not done.loads_failed, "a save or a load failed"
                moved[0] += 2 * sum(layout.groups[g].block_bytes for g, _ in entries)
        except BaseException as err:  # seen by the main thread after the join
            failure.append(err)

    try:
        engine.submit_planned(puts={0: saves}, fenced_groups=fenced)
        engine.wait_idle()
        assert engine.get_finished().jobs_done.get(0) == "ok", "a save failed"
        iteration_times(iteration, 3, device)  # warm-up
        alone = statistics.median(iteration_times(iteration, count, device))
        worker = threading.Thread(target=offload, name="offload")
        worker.start()
        start = time.perf_counter()
        try:
            beside = statistics.median(iteration_times(iteration, count, device))
        finally:
            stop.set()
            worker.join()
        if failure:
            raise failure[0]
        rate = moved[0] / (time.perf_counter() - start) / 1e9
    finally:
        engine.shutdown()
    slowdown = beside / alone
    print(f"\n### what offload costs the model ({name}'s blocks, saved and loaded back to back)\n")
    print("| model iteration | ms (median) | x alone |\n|---|---|---|")
    print(f"| alone | {alone * 1e3:.2f} | 1.00 |")
    print(f"| beside saves and loads ({rate:.1f} GB/s moved) | {beside * 1e3:.2f} | {slowdown:.3f} |")
    return device.type != "cuda" or slowdown <= GOAL_MODEL_SLOWDOWN


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--geometry", default="all", help=f"{', '.join(GEOMETRIES)} or all")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="profile the caller's hold of one save")
    ap.add_argument("--programs", type=int, default=0, help="programs of the copy kernels (default: the arena's)")
    ap.add_argument("--staged", default="embedded", choices=["embedded", "mooncake", "none"],
                    help="the store of the staged path's rows (none: skip them)")
    ap.add_argument("--staged-only", action="store_true", help="the staged path's rows alone")
    ap.add_argument("--model-cost", default="llama8b", help="the geometry whose offload runs beside the model's "
                    "iterations (none: skip it)")
    args = ap.parse_args()
    if args.requests <= 0 or args.tokens <= 0 or args.reps <= 0:
        print("gpu_engine.py: --requests, --tokens and --reps must be positive", file=sys.stderr)
        return 2
    if args.staged_only and args.staged == "none":
        print("gpu_engine.py: --staged-only needs --staged embedded or mooncake", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run: no goals checked)"
    programs = args.programs or kvstride.arena.device.COPY_PROGRAMS
    print(f"device: {label}; torch {torch.__version__}; {args.requests} requests x {args.tokens} tokens a save; "
          f"copy kernels of {programs} programs")
    names = GEOMETRIES if args.geometry == "all" else [args.geometry]
    results = {} if args.staged_only else {name: run(name, args, device) for name in names}
    if args.staged != "none":
        results.update({f"{name} staged": run_staged(name, args, device) for name in names})
    if args.model_cost != "none" and not args.staged_only:
        results["model cost"] = model_cost(args.model_cost, args, device)
    failed = [name for name, ok in results.items() if not ok]
    print(f"\ngoals (save, load >= {GOAL_ONE_WAY} of raw; both >= {GOAL_BOTH}; hold <= 2 ms; staged save, load >= "
          f"{GOAL_STAGED}; the model slowed <= {GOAL_MODEL_SLOWDOWN}x) and bytes: "
          + ("met" if not failed else f"NOT met for {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
