"""The payload hash of verified reads: XXH3-64 over a batch of store values, kvstride's core
(GIL released, values spread over rayon's threads) vs the `xxhash` package per value (what a
pure-Python store would do; GIL held, one core). Same digests, checked. One more row: the keyed
payload tag of a deployment secret's MAC (AEGIS-128X2-MAC) over the same values, one call.

    python benches/payload_hash.py [--values 128] [--value-kib 512] [--reps 9]
"""

import argparse
import os

import numpy as np
import xxhash

from _dataplane import median_seconds
from kvstride import _core


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--values", type=int, default=128)
    ap.add_argument("--value-kib", type=int, default=512)
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    values = [[rng.integers(0, 256, args.value_kib << 9, dtype=np.uint8) for _ in range(2)] for _ in range(args.values)]
    total = args.values * (args.value_kib << 10)

    def package():
        out = []
        for parts in values:
            h = xxhash.xxh3_64()
            for p in parts:
                h.update(p)
            out.append(h.intdigest())
        return out

    assert package() == _core.xxh3_64_batch(values)
    tag_secret = _core.StoreSecret(bytes(range(32)))  # a deployment secret's payload tag
    rows = [
        ("xxhash package, per value (baseline)", median_seconds(package, args.reps)),
        ("kvstride xxh3_64_parts, per value", median_seconds(lambda: [_core.xxh3_64_parts(v) for v in values], args.reps)),
        ("kvstride xxh3_64_batch, one call", median_seconds(lambda: _core.xxh3_64_batch(values), args.reps)),
        ("kvstride StoreSecret.payload_tags (AEGIS-128X2-MAC), one call",
         median_seconds(lambda: tag_secret.payload_tags(values), args.reps)),
    ]
    base = rows[0][1]
    print(f"{args.values} values x {args.value_kib} KiB in 2 parts ({total / 2**20:.0f} MiB), "
          f"{os.cpu_count()} CPUs, median of {args.reps}\n")
    print("| hash | median ms | GB/s | vs baseline |")
    print("|---|---:|---:|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds * 1e3:.2f} | {total / seconds / 1e9:.1f} | {base / seconds:.2f}x |")


if __name__ == "__main__":
    main()
