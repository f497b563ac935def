"""Data-plane bench: scattered KV blocks <-> staging vs one raw copy of the same bytes.

    python benches/transfer.py [--blocks 64] [--block-kib 512] [--reps 15]

Layout: 2 layers, FlashAttention (2, N, block, heads, dim) bf16, i.e. 4 pieces per block
(K and V of each layer); random block ids.  Baseline: ``dst.copy_(src)`` of one contiguous
tensor holding the same number of bytes, measured in the same run.  Ratio = baseline time /
kvstride time (goal >= 0.9 on CPU).
"""

import argparse
import platform
import statistics

import torch

from _dataplane import load, median_seconds

layout_mod, transfer_mod = load("layout"), load("transfer")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--block-kib", type=int, default=512, help="bytes of one group block (all layers)")
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    heads, dim, layers = 8, 128, 2
    tokens = a.block_kib * 1024 // (layers * 2 * heads * dim * 2)
    kv = {f"l{i}": torch.randn(2, a.num_blocks, tokens, heads, dim).to(torch.bfloat16) for i in range(layers)}
    L = layout_mod.KVLayout(kv, [list(kv)])
    bb = L.groups[0].block_bytes
    g = torch.Generator().manual_seed(0)
    ids = torch.randperm(a.num_blocks, generator=g)[: a.blocks].tolist()
    pool = transfer_mod.StagingPool(a.blocks * bb + (1 << 20))
    pool.tensor.fill_(1)
    tr = transfer_mod.Transfer(L, pool)
    batch = tr.stage([(0, b) for b in ids])
    nbytes = a.blocks * bb
    raw_src = torch.ones(nbytes, dtype=torch.uint8)
    raw_dst = torch.ones(nbytes, dtype=torch.uint8)
    rows = []
    for name, fn, raw in (
        ("gather KV->staging", lambda: tr.gather(batch).wait(), lambda: raw_dst.copy_(raw_src)),
        ("scatter staging->KV", lambda: tr.scatter(batch).wait(), lambda: raw_src.copy_(raw_dst)),
    ):
        # interleave to share noise
        tk, tb = [], []
        for _ in range(3):
            tk.append(median_seconds(fn, a.reps))
            tb.append(median_seconds(raw, a.reps))
        k, b = statistics.median(tk), statistics.median(tb)
        rows.append((name, k, b))
    print(f"machine: {platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"{a.blocks} blocks x {bb / 2**20:.2f} MiB ({len(L.groups[0].pieces)} pieces/block) = {nbytes / 2**20:.0f} MiB per op, median of {a.reps} x 3")
    print()
    print("| op | kvstride median | GB/s | raw copy_ median | GB/s | ratio |")
    print("|---|---|---|---|---|---|")
    for name, k, b in rows:
        print(f"| {name} | {k * 1e3:.2f} ms | {nbytes / k / 1e9:.2f} | {b * 1e3:.2f} ms | {nbytes / b / 1e9:.2f} | {b / k:.3f} |")
    batch.release()


if __name__ == "__main__":
    main()
