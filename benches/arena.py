"""The embedded store's data path end to end: KV blocks -> arena slots (save) and back (load),
with the digest of every value computed at save and checked at load, against one raw torch
copy of the same bytes in the same run.

    python benches/arena.py [--blocks 256] [--layers 4] [--piece-kib 64] [--repeat 7] [--threads 1]

The workload: one request of 256 blocks x 4 full-attention layers, 64 KiB per
layer and block (64 MiB), laid out the way vLLM's CPU backend lays out a layer
(``[num_blocks, heads, block, 2*head_dim]``), on the arena the vLLM connector uses.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from _dataplane import median_seconds
from kvstride.arena import HostArena
from kvstride.layout import KVLayout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--piece-kib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the baseline's)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    num_blocks = args.blocks * 2 + 1  # sources and destinations apart; 0 is vLLM's null block
    elems = args.piece_kib * 1024 // 2  # bf16
    heads, block = 2, 32
    dim2 = elems // (heads * block)
    kv = {f"layer{i}": torch.randn(num_blocks, heads, block, dim2).to(torch.bfloat16) for i in range(args.layers)}
    layout = KVLayout(kv, [list(kv)], num_blocks=num_blocks)
    arena = HostArena(layout, args.blocks)
    total = args.blocks * layout.block_bytes(0)

    slots = np.arange(args.blocks)
    groups = np.zeros(args.blocks, dtype=np.int64)
    src = np.arange(1, args.blocks + 1)
    dst = src + args.blocks

    save = median_seconds(lambda: arena.save(slots, groups, src), args.repeat)
    load = median_seconds(lambda: arena.load(slots, groups, dst), args.repeat)
    for t in kv.values():
        assert torch.equal(t[1 : args.blocks + 1], t[args.blocks + 1 :]), "a load wrote wrong bytes"

    raw_src = torch.empty(total, dtype=torch.uint8).random_()
    raw_dst = torch.empty(total, dtype=torch.uint8)
    raw = median_seconds(lambda: raw_dst.copy_(raw_src), args.repeat)

    gb = total / 1e9
    print(f"{args.blocks} blocks x {args.layers} layers x {args.piece_kib} KiB = {total >> 20} MiB, "
          f"verified reads on, torch threads {args.threads}, median of {args.repeat}")
    print()
    print("| path | median ms | GB/s | vs raw copy |")
    print("|---|---:|---:|---:|")
    for name, seconds in (("save: KV -> arena slots", save), ("load: arena slots -> KV", load), ("raw torch copy_", raw)):
        print(f"| {name} | {seconds * 1e3:.2f} | {gb / seconds:.2f} | {raw / seconds:.2f} |")


if __name__ == "__main__":
    main()
