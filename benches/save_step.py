"""What one small save step costs on vLLM's thread: a block of each of several KV-cache groups
staged (with the Mooncake value header's room), gathered with its payload digests, and released.

    python benches/save_step.py [--groups 4] [--block-kib 32] [--blocks-per-group 1] [--steps 1000] [--reps 7]

Why: a hybrid model in vLLM has several groups of one or a few layers each (the tiny Gemma-3 of
``benches/vllm_connectors.py``: four groups of one layer, 32-token blocks), and with prefill
chunks of a block every step saves one block of each. A step then moves little, and what costs
is the work per step and per group around the copy (``Transfer.stage`` and the copy rows; the
copy itself is one call into the Rust core). Baseline, in the same run: one ``copy_`` of a
contiguous tensor of the step's bytes. Each group: one layer, K and V in one
``(2, N, tokens, 1, 256)`` bf16 tensor, two pieces a block. Torch on one thread, as the
engine's lanes and vLLM's CPU worker leave it for this call.
"""

import argparse
import platform
import statistics
import time

import torch

from _dataplane import load

layout_mod, transfer_mod = load("layout"), load("transfer")
HEADER_ROOM = 64  # kvstride.stores.base.HEADER_BYTES: staged before each value on CPU for Mooncake


def per_step_us(fn, steps: int) -> float:
    start = time.perf_counter()
    for k in range(steps):
        fn(k)
    return (time.perf_counter() - start) / steps * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--block-kib", type=int, default=32, help="bytes of one group's block (K and V)")
    ap.add_argument("--blocks-per-group", type=int, default=1)
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--steps", type=int, default=1000, help="steps timed per rep")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    tokens = a.block_kib * 1024 // (2 * 256 * 2)
    kv = {f"layer{g}": torch.randn(2, a.num_blocks, tokens, 1, 256).to(torch.bfloat16) for g in range(a.groups)}
    layout = layout_mod.KVLayout(kv, [[name] for name in kv])
    transfer = transfer_mod.Transfer(layout, transfer_mod.StagingPool(64 << 20))
    transfer.header_room = HEADER_ROOM
    per_step = a.groups * a.blocks_per_group

    def save_step(k: int) -> None:
        blocks = [(g, 1 + (k * per_step + g * a.blocks_per_group + j) % (a.num_blocks - 1))
                  for g in range(a.groups) for j in range(a.blocks_per_group)]
        batch = transfer.stage(blocks, "save")
        transfer.gather(batch, digests=True)
        batch.value_parts()
        batch.release()

    nbytes = per_step * layout.groups[0].block_bytes
    raw_src, raw_dst = torch.ones(nbytes, dtype=torch.uint8), torch.ones(nbytes, dtype=torch.uint8)
    save_step(0), raw_dst.copy_(raw_src)  # warm up
    ours, raw = [], []
    for _ in range(a.reps):  # interleaved, so that drift falls on both
        ours.append(per_step_us(save_step, a.steps))
        raw.append(per_step_us(lambda k: raw_dst.copy_(raw_src), a.steps))
    k, b = statistics.median(ours), statistics.median(raw)
    print(f"machine: {platform.machine()}, torch {torch.__version__} on 1 thread; {a.groups} groups x "
          f"{a.blocks_per_group} block(s) of {layout.groups[0].block_bytes // 1024} KiB a step "
          f"({len(layout.groups[0].pieces)} pieces a block); median of {a.reps} reps of {a.steps} steps")
    print()
    print("| per step | kvstride stage + gather (digests) + release | raw copy_ of the same bytes | raw / kvstride |")
    print("|---|---:|---:|---:|")
    print(f"| {nbytes // 1024} KiB | {k:.1f} µs | {b:.1f} µs | {b / k:.3f} |")


if __name__ == "__main__":
    main()
