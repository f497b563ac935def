#!/usr/bin/env python3
"""The embedded store's disk tier against raw direct I/O of the same bytes on the same file system.

Each run writes ``--records`` values of ``--record-mib`` MiB from arena slots to the tier's record
file and reads them back into other slots (``kvstride.arena.disk.DiskLane``: headers, digests
checked on read, ``IO_THREADS`` records in flight), and, as the baseline in the same run, writes
and reads the same bytes at the same offsets of another file with plain ``pwritev`` / ``preadv``
(``O_DIRECT`` when the file system takes it, as the tier does; the same number of threads). Both
sides' files are preallocated first. Each figure is the median over ``--repeat`` interleaved runs.

Then the start of an engine whose index holds 1 TiB of such records: the rows restored by
``DiskIndex`` (SQLite), timed.

Usage: python benches/disk_tier.py [--path DIR] [--records 256] [--record-mib 2] [--repeat 5] [--json]
Exits 1 when a ratio is below 0.8.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from kvstride.arena import ArenaSlots
from kvstride.arena.disk import DISK_ALIGN, IO_THREADS, DiskSpec, record_bytes
from kvstride.arena.disk_index import INDEX_FILE, DiskIndex
from kvstride.layout import KVLayout

GOAL = 0.8


def file_system(path: str) -> str:
    """The file system type and device under ``path`` (``df``)."""
    try:
        out = subprocess.run(["df", "-T", path], capture_output=True, text=True, check=True).stdout.splitlines()[-1]
        device, fs_type = out.split()[:2]
        return f"{fs_type} on {device}"
    except (OSError, subprocess.CalledProcessError, ValueError):
        return "unknown"


def drain(lane) -> tuple:
    for pool in (lane._write_lane, lane._read_lane):
        pool.submit(lambda: None).result()
    return lane.take()


def raw_io(fd: int, arena, records: int, record: int, write: bool) -> float:
    """Seconds to write (read) every slot's bytes at its record's offset, IO_THREADS at a time."""
    slots = arena.buffer.numpy()
    size = arena.slot_bytes

    def one(i: int) -> None:
        view = memoryview(slots[i * size : (i + 1) * size])
        if write:
            os.pwritev(fd, [view], i * record)
        else:
            os.preadv(fd, [view], i * record)

    with concurrent.futures.ThreadPoolExecutor(IO_THREADS) as pool:
        start = time.perf_counter()
        list(pool.map(one, range(records)))
        return time.perf_counter() - start


def index_start_seconds(folder: str, rows: int, record: int) -> float:
    """Seconds for DiskIndex to restore ``rows`` persisted records (keys like the connector's)."""
    signature = {"record_bytes": record, "ranks": 1}
    DiskIndex(rows, folder, signature).close()  # the schema and the signature
    db = sqlite3.connect(os.path.join(folder, INDEX_FILE))
    prefix = "model@fp:0011223344556677@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"
    with db:
        db.executemany("INSERT INTO records VALUES (?, ?, ?, ?, ?)",
                       ((f"{prefix}{i:064x}", i, i + 1, i % 512, 1.0) for i in range(rows)))
    db.close()
    start = time.perf_counter()
    index = DiskIndex(rows, folder, signature)
    seconds = time.perf_counter() - start
    assert index.restored == rows
    index.close()
    return seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--path", default=None, help="a folder on the file system to measure (default: a temp folder)")
    ap.add_argument("--records", type=int, default=256)
    ap.add_argument("--record-mib", type=float, default=2.0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    folder = tempfile.mkdtemp(prefix="kvstride-disk-bench-", dir=args.path)
    try:
        block = int(args.record_mib * (1 << 20)) // DISK_ALIGN * DISK_ALIGN
        kv = {"kv": torch.randint(0, 256, (args.records, block), dtype=torch.uint8)}
        payload, record = record_bytes(block)
        spec = DiskSpec(folder, args.records, payload, rank=0, ranks=1, fingerprint=bytes(8))
        slots = ArenaSlots(2 * args.records, disk=spec)
        slots.bind_layout(KVLayout(kv, [["kv"]]))
        arena, lane = slots.arena, slots.disk
        ids = np.arange(args.records)
        arena.save(ids, np.zeros(args.records, dtype=np.int64), ids)
        raw_path = os.path.join(folder, "raw.bin")
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if lane.records.direct else 0)
        raw_fd = os.open(raw_path, flags, 0o600)
        os.posix_fallocate(raw_fd, 0, args.records * record)
        runs = {name: [] for name in ("raw_write", "tier_write", "raw_read", "tier_read")}
        nbytes = args.records * block
        for rep in range(args.repeat):
            runs["raw_write"].append(raw_io(raw_fd, arena, args.records, record, write=True))
            start = time.perf_counter()
            lane.write(rep, [(i, i, f"key-{i}") for i in range(args.records)])
            written, _, _ = drain(lane)
            runs["tier_write"].append(time.perf_counter() - start)
            assert written == {rep: True}
            runs["raw_read"].append(raw_io(raw_fd, arena, args.records, record, write=False))
            start = time.perf_counter()
            lane.read("r", [(i, args.records + i, f"key-{i}", 0) for i in range(args.records)])
            _, read, _ = drain(lane)
            runs["tier_read"].append(time.perf_counter() - start)
            assert read == {"r": (True, [])}, "a record did not read back"
        os.close(raw_fd)
        slots.close()
        gbps = {name: nbytes / statistics.median(seconds) / 1e9 for name, seconds in runs.items()}
        ratios = {"write": gbps["tier_write"] / gbps["raw_write"], "read": gbps["tier_read"] / gbps["raw_read"]}
        rows = (1 << 40) // record
        start_s = index_start_seconds(tempfile.mkdtemp(dir=folder), rows, record)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "file_system": file_system(args.path or tempfile.gettempdir()),
        "direct_io": lane.records.direct, "records": args.records, "record_bytes": record, "threads": IO_THREADS,
        "gb_per_s": {k: round(v, 3) for k, v in gbps.items()}, "ratio": {k: round(v, 3) for k, v in ratios.items()},
        "index_start_s_for_1_tib": round(start_s, 3), "index_rows_for_1_tib": rows,
    }
    met = min(ratios.values()) >= GOAL
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"# {result['machine']}; {result['file_system']}; O_DIRECT {result['direct_io']}; "
              f"{args.records} records of {record / 2**20:.2f} MiB, {IO_THREADS} threads, median of {args.repeat}")
        print("| | raw GB/s | disk tier GB/s | ratio |")
        print("|---|---|---|---|")
        for op in ("write", "read"):
            print(f"| {op} | {gbps['raw_' + op]:.2f} | {gbps['tier_' + op]:.2f} | {ratios[op]:.2f} |")
        print(f"index start, 1 TiB of records ({rows:,} rows): {start_s:.2f} s")
        print("goal met" if met else f"goal NOT met (>= {GOAL} of raw)")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
