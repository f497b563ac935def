"""Where a policy's hits fall short of dense's on a trace, request by request.

    python scripts/trace_loss_split.py --trace benches/traces/mooncake_conversation_trace.jsonl.gz
        [--model qwen3-next-80b] [--policy kvstride] [--capacity 1P]

Both policies run through the replay (kvstride.trace) at one capacity, by default one that
holds everything, so every point lost is a hit with no state to land on. Each request that
hits less than under dense is put in one class, by the trace alone. Its shared prefix ends
at the deepest whole 512-token block an earlier request also had. The class says where that
end sits in the first request that had the block:
- "all but the last whole block": the request that first had the block had one more whole
  block, so the end is one block short of the end of its prompt;
- "inside an earlier prompt": anywhere else, a branch point met for the first time or
  not kept.
"""

from __future__ import annotations

import argparse
from typing import Dict, List

from kvstride.trace import TRACE_BLOCK, ReplayConfig, TraceReplay, load_model, read_trace
from kvstride.sizes import parse_size


def hits_per_request(replay: TraceReplay, trace, policy: str, capacity: int) -> List[int]:
    hits = [0] * len(trace)

    def record(position: int, hit: int) -> None:
        hits[position] = hit

    replay.run(trace, ReplayConfig(replay.model, capacity, policy, on_request=record))
    return hits


def classify(trace) -> List[str]:
    """Per request, where its shared prefix ends in the first request with that block."""
    first: Dict[int, int] = {}  # id -> the first request with it in a whole block
    classes = []
    for i, req in enumerate(trace):
        ids = req.hash_ids
        shared = 0
        while shared < len(ids) and ids[shared] in first:
            shared += 1
        if shared == 0:
            classes.append("nothing shared")
        else:
            whole = trace[first[ids[shared - 1]]].input_length // TRACE_BLOCK
            classes.append("all but the last whole block" if whole == shared + 1 else "inside an earlier prompt")
        for hid in ids[: req.input_length // TRACE_BLOCK]:
            first.setdefault(hid, i)
    return classes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--model", default="qwen3-next-80b")
    parser.add_argument("--policy", default="kvstride")
    parser.add_argument("--capacity", default="1P", help="e.g. 16T; the default holds every trace here")
    args = parser.parse_args()
    trace = read_trace(args.trace)
    replay = TraceReplay(load_model(args.model))  # the trie and hashes, built once for both runs
    capacity = parse_size(args.capacity)
    dense = hits_per_request(replay, trace, "dense", capacity)
    other = hits_per_request(replay, trace, args.policy, capacity)
    tokens = sum(req.input_length for req in trace)
    print(f"dense {100 * sum(dense) / tokens:.2f} %, {args.policy} {100 * sum(other) / tokens:.2f} % of prompt tokens")
    lost: Dict[str, List[int]] = {}
    for cls, d, o in zip(classify(trace), dense, other):
        if o < d:
            lost.setdefault(cls, []).append(d - o)
    for cls, gaps in sorted(lost.items()):
        print(f"{cls}: {len(gaps)} requests, {100 * sum(gaps) / tokens:.2f} points")


if __name__ == "__main__":
    main()
