"""What the checkpoint identity costs at engine start: ``kvstride.identity.checkpoint_digest``
of a 100 GB checkpoint, from the page cache and from the drive.

    python benches/checkpoint_digest.py [--gb 100] [--moe] [--dir DIR] [--reps 5]

The checkpoint is Llama-3-70B's tensor table (80 layers of 9 tensors, embeddings, norm, head:
723 tensors in 30 safetensors files, bf16) scaled to ``--gb``; with ``--moe``, a
Qwen3-30B-A3B-like one (48 layers of 128 experts of 3 matrices and 7 more tensors: 18,771
tensors, the case where the digest samples one window a tensor). Its files are sparse: only the
headers and the windows the digest samples hold data on the drive, so the bench needs a few
MiB of disk, not 100 GB, and its reads are exactly the ones a full checkpoint costs. "Cold"
drops each file's pages from the page cache first (``posix_fadvise(DONTNEED)``), so every
sampled window is read from the drive. Against it: the same reads at the same offsets with
``os.pread`` alone, on as many threads, in the same run.
"""

import argparse
import json
import os
import statistics
import struct
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from kvstride.identity import MAX_SAMPLED_WINDOWS, WINDOW_BYTES, WINDOWS, _windows, checkpoint_digest  # noqa: E402

HIDDEN, INTER, HEADS_KV, HEAD_DIM, VOCAB, LAYERS = 8192, 28672, 8, 128, 128256, 80


def moe_table():
    hidden, expert_inter, experts, layers = 2048, 768, 128, 48
    table = [("model.embed_tokens.weight", (151936, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}"
        table += [(f"{p}.{n}", s) for n, s in (
            ("input_layernorm.weight", (hidden,)), ("post_attention_layernorm.weight", (hidden,)),
            ("self_attn.q_proj.weight", (4096, hidden)), ("self_attn.k_proj.weight", (512, hidden)),
            ("self_attn.v_proj.weight", (512, hidden)), ("self_attn.o_proj.weight", (hidden, 4096)),
            ("mlp.gate.weight", (experts, hidden)))]
        for e in range(experts):
            table += [(f"{p}.mlp.experts.{e}.{n}", s) for n, s in (
                ("gate_proj.weight", (expert_inter, hidden)), ("up_proj.weight", (expert_inter, hidden)),
                ("down_proj.weight", (hidden, expert_inter)))]
    return table + [("model.norm.weight", (hidden,)), ("lm_head.weight", (151936, hidden))]


def tensor_table(moe=False):
    if moe:
        return moe_table()
    kv = HEADS_KV * HEAD_DIM
    per_layer = {
        "input_layernorm.weight": (HIDDEN,), "post_attention_layernorm.weight": (HIDDEN,),
        "self_attn.q_proj.weight": (HIDDEN, HIDDEN), "self_attn.k_proj.weight": (kv, HIDDEN),
        "self_attn.v_proj.weight": (kv, HIDDEN), "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
        "mlp.gate_proj.weight": (INTER, HIDDEN), "mlp.up_proj.weight": (INTER, HIDDEN),
        "mlp.down_proj.weight": (HIDDEN, INTER),
    }
    table = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    table += [(f"model.layers.{i}.{name}", shape) for i in range(LAYERS) for name, shape in per_layer.items()]
    return table + [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def write_checkpoint(root: Path, gb: float, moe: bool = False, files: int = 30) -> int:
    """The sparse checkpoint; returns its apparent size in bytes."""
    table = tensor_table(moe)
    windows = max(1, min(WINDOWS, MAX_SAMPLED_WINDOWS // len(table)))  # as checkpoint_digest samples
    natural = sum(2 * _count(shape) for _, shape in table)
    scale = gb * 1e9 / natural
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN}))
    per_file = -(-len(table) // files)
    total = 0
    for f in range(files):
        chunk = table[f * per_file:(f + 1) * per_file]
        header, offset, spans = {"__metadata__": {"format": "pt"}}, 0, []
        for name, shape in chunk:
            nbytes = max(2, int(2 * _count(shape) * scale) // 2 * 2)
            header[name] = {"dtype": "BF16", "shape": [nbytes // 2], "data_offsets": [offset, offset + nbytes]}
            spans.append((offset, nbytes))
            offset += nbytes
        text = json.dumps(header).encode()
        start = 8 + len(text)
        with open(root / f"model-{f + 1:05d}-of-{files:05d}.safetensors", "wb") as out:
            out.write(struct.pack("<Q", len(text)) + text)
            for begin, nbytes in spans:  # data only where the digest reads: the rest stays a hole
                for window, length in _windows(nbytes, windows):
                    out.seek(start + begin + window)
                    out.write(os.urandom(length))
            out.truncate(start + offset)
        total += start + offset
    return total


def _count(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def drop_cache(root: Path) -> None:
    for path in root.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_reads(root: Path, windows: int) -> None:
    """The digest's reads without the digest: the same windows, ``os.pread`` alone, the same threads."""
    def one(path):
        with open(path, "rb") as f:
            fd = f.fileno()
            (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
            header = json.loads(os.pread(fd, n, 8))
            for k, v in header.items():
                if k == "__metadata__":
                    continue
                begin, end = v["data_offsets"]
                for window, length in _windows(end - begin, windows):
                    os.pread(fd, length, 8 + n + begin + window)

    files = sorted(root.glob("*.safetensors"))
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, files))


def timed(fn, reps, before=None):
    times = []
    for _ in range(reps):
        if before:
            before()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), min(times), max(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=100.0, help="apparent checkpoint size")
    ap.add_argument("--moe", action="store_true", help="an MoE tensor table (18,771 tensors)")
    ap.add_argument("--dir", default=None, help="where to write it (default: a temporary folder)")
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        root = Path(tmp)
        apparent = write_checkpoint(root, a.gb, a.moe)
        result = checkpoint_digest(root)
        windows = max(1, min(WINDOWS, MAX_SAMPLED_WINDOWS // result.tensors))
        on_disk = sum(p.stat().st_blocks * 512 for p in root.iterdir())
        print(f"checkpoint: {apparent / 1e9:.1f} GB apparent ({on_disk / 2**20:.1f} MiB on the drive), "
              f"{result.files} files, {result.tensors} tensors; digest reads {result.bytes_read / 2**20:.1f} MiB "
              f"({windows} windows of {WINDOW_BYTES} B a tensor)")
        print("| what | median s | min | max |\n|---|---|---|---|")
        rows = [
            ("digest, page cache", timed(lambda: checkpoint_digest(root), a.reps)),
            ("raw preads of the same windows, page cache", timed(lambda: raw_reads(root, windows), a.reps)),
            ("digest, cold (pages dropped)", timed(lambda: checkpoint_digest(root), a.reps, lambda: drop_cache(root))),
            ("raw preads of the same windows, cold", timed(lambda: raw_reads(root, windows), a.reps, lambda: drop_cache(root))),
        ]
        for name, (med, lo, hi) in rows:
            print(f"| {name} | {med:.3f} | {lo:.3f} | {hi:.3f} |")
        print(f"the same digest on every rep: {checkpoint_digest(root).digest == result.digest}")


if __name__ == "__main__":
    main()
