"""What a Mooncake put costs per part of a value and per call: the same bytes put as 1, 2, 4 or
8 parts, and one-part values put 1, 4, 16 or 64 keys a call.

    python benches/mooncake_parts.py [--value-kib 8,64,512] [--values 2048] [--batch 16] [--reps 5]

The store is set up as ``benches/vllm_connectors.py`` sets it up, and as a cluster runs it:
``python -m kvstride.cli store serve`` (a master and the segment holder, another process, on
127.0.0.1), this process a pure client (segment 0) over TCP. Each rep puts ``--values`` values
of each size in batches of ``--batch`` keys with the raw ``batch_put_from_multi_buffers``, from
one registered buffer, each value's bytes contiguous and split into equal parts; fresh keys
every time, removed after. The part counts (and the batch sizes) of one size and rep run back to
back, in an order rotated every rep, so the machine's drift falls on each alike; the figures are
medians over reps of the wall time and of this process's CPU time per value (Mooncake's client
polls while a call runs: its CPU time is about the call's wall time), and the ratio is the wall
time over the one-part (or ``--batch``-key) median.

Why: the engine's staging on CPU used to lay a value out as one part per piece (a block's K
and V of every layer of its group), and Mooncake's TCP transport moves each part as a slice of
its own. This bench decides the layout (``kvstride.transfer``: whole entries on CPU), and the
save lane's one call for every put queued (``kvstride.engine.PUT_KEYS_PER_CALL``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from vllm_connectors import StoreServer  # the vLLM bench's store: `kvstride store serve`, stopped with its master

PART_COUNTS = (1, 2, 4, 8)
BATCH_SIZES = (1, 4, 16, 64)


def pure_client(config_path: str):
    from mooncake.store import MooncakeDistributedStore

    config = json.loads(Path(config_path).read_text())
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    client = MooncakeDistributedStore()
    rc = client.setup("127.0.0.1", config.get("metadata_server", "P2PHANDSHAKE"), 0, 64 << 20, "tcp", "",
                      config["master_server_address"])
    if rc != 0:
        raise RuntimeError(f"Mooncake setup failed with {rc}")
    return client


def put_all(client, tag: str, base: int, value_bytes: int, parts: int, values: int, batch: int):
    """Wall and CPU seconds to put ``values`` values of ``value_bytes`` as ``parts`` parts each,
    ``batch`` keys a call; removes them after."""
    part = value_bytes // parts
    keys = [f"{tag}-{i}" for i in range(values)]
    cpu = time.process_time()
    start = time.perf_counter()
    for b in range(0, values, batch):
        chunk = range(b, min(b + batch, values))
        ptrs = [[base + i * value_bytes + j * part for j in range(parts)] for i in chunk]
        codes = client.batch_put_from_multi_buffers([keys[i] for i in chunk], ptrs, [[part] * parts] * len(ptrs))
        if any(c != 0 for c in codes):
            raise RuntimeError(f"put failed: codes {sorted(set(codes))}")
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    client.batch_remove(keys, True)
    return elapsed, cpu


def rotated(xs, rep: int) -> tuple:
    return xs[rep % len(xs):] + xs[:rep % len(xs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--value-kib", default="8,64,512", help="value sizes, KiB, comma-separated")
    ap.add_argument("--values", type=int, default=2048, help="values put per size, part count and rep")
    ap.add_argument("--batch", type=int, default=16, help="keys per batch call")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--store-bytes", default="2G")
    a = ap.parse_args()
    sizes = [int(x) * 1024 for x in a.value_kib.split(",")]
    values = {size: max(a.batch, min(a.values, (256 << 20) // size)) for size in sizes}  # at most 256 MiB a set
    buf = np.random.default_rng(0).integers(0, 256, max(values[s] * s for s in sizes), dtype=np.uint8)
    # (size, parts, keys a call) -> [(wall, cpu) per value, one per rep]
    runs = [(s, p, a.batch) for s in sizes for p in PART_COUNTS] + [(s, 1, b) for s in sizes for b in BATCH_SIZES if b != a.batch]
    times = {run: [] for run in runs}
    with tempfile.TemporaryDirectory(prefix="kvstride-parts-") as scratch:
        server = StoreServer(scratch, a.store_bytes)
        try:
            client = pure_client(server.config_path)
            try:
                if client.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                    raise RuntimeError("register_buffer failed")
                for rep in range(a.reps):
                    for size in sizes:
                        for run in rotated([r for r in runs if r[0] == size], rep):
                            _, parts, batch = run
                            wall, cpu = put_all(client, f"r{rep}s{size}p{parts}b{batch}", buf.ctypes.data, size, parts,
                                                values[size], batch)
                            times[run].append((wall / values[size], cpu / values[size]))
                client.unregister_buffer(buf.ctypes.data)
            finally:
                client.close()
        finally:
            server.stop()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores; `kvstride store serve` holder over TCP on "
          f"loopback, a pure client; median of {a.reps} reps")
    print()
    print("| value | parts | keys a call | values / rep | µs per value | client CPU µs per value | MiB/s | vs one part, "
          f"{a.batch} keys |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for size in sizes:
        one = statistics.median(w for w, _ in times[size, 1, a.batch])
        for run in sorted((r for r in runs if r[0] == size), key=lambda r: (r[2] != a.batch, r[1], r[2])):
            wall = statistics.median(w for w, _ in times[run])
            cpu = statistics.median(c for _, c in times[run])
            print(f"| {size // 1024} KiB | {run[1]} | {run[2]} | {values[size]} | {wall * 1e6:.1f} | {cpu * 1e6:.1f} | "
                  f"{size / wall / 2**20:.0f} | {wall / one:.2f}× |")


if __name__ == "__main__":
    main()
