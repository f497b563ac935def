"""Write a multi-turn chat trace in Mooncake's format (``benches/traces/README.md``).

    python scripts/conversation_trace.py --out conv.jsonl [--sessions 1500] [--seed 0]

Mooncake's synthetic trace has few turns whose prompt extends an earlier prompt and its output;
its production conversation trace (``benches/traces/``) is one workload. This one is made of
chat sessions, with the mix set by the options: each starts
from one of a few shared system prompts, and each turn's input is the previous turn's input, its
output and a new user message, so a next turn shares every full 512-token block of the previous
prompt (the partial last block is completed by new tokens: a new id). Sessions arrive as a
Poisson process and think between turns; lengths are drawn from the options' ranges (uniform,
turns per session geometric). Requests are written in timestamp order (ms).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict, List

import numpy as np

BLOCK = 512


def conversation_trace(*, sessions: int = 1500, system_prompts: int = 16, system_tokens=(1024, 8192),
                       user_tokens=(64, 1024), output_tokens=(32, 1024), mean_turns: float = 4.0,
                       max_input: int = 131072, session_rate: float = 2.0, think_s=(5.0, 120.0),
                       seed: int = 0) -> List[Dict]:
    rng = np.random.default_rng(seed)
    next_id = 0

    def fresh(count: int) -> List[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + count))
        next_id += count
        return ids

    # A system prompt's whole blocks are shared by every session that starts from it.
    systems = []
    for _ in range(system_prompts):
        tokens = int(rng.integers(*system_tokens, endpoint=True))
        systems.append((tokens, fresh(tokens // BLOCK)))
    requests = []
    start = 0.0
    for _ in range(sessions):
        start += float(rng.exponential(1.0 / session_rate))
        system, system_ids = systems[int(rng.integers(system_prompts))]
        # The context so far (tokens), the tokens whose whole blocks keep their ids, and the ids.
        context, kept, ids, at = system, system, list(system_ids), start
        for _turn in range(int(rng.geometric(1.0 / mean_turns))):
            n = context + int(rng.integers(*user_tokens, endpoint=True))
            if n > max_input:
                break
            # The previous prompt's partial last block is completed by new tokens: a new id.
            ids = ids[: kept // BLOCK] + fresh(-(-n // BLOCK) - kept // BLOCK)
            output = int(rng.integers(*output_tokens, endpoint=True))
            requests.append({"timestamp": int(at * 1000), "input_length": n, "output_length": output, "hash_ids": ids})
            context, kept = n + output, n
            at += float(rng.uniform(*think_s))
    requests.sort(key=lambda r: r["timestamp"])
    return requests


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the trace file (JSON lines)")
    ap.add_argument("--sessions", type=int, default=1500)
    ap.add_argument("--system-prompts", type=int, default=16)
    ap.add_argument("--mean-turns", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    requests = conversation_trace(sessions=args.sessions, system_prompts=args.system_prompts,
                                  mean_turns=args.mean_turns, seed=args.seed)
    with open(args.out, "w") as out:
        for request in requests:
            out.write(json.dumps(request) + "\n")
    print(f"{len(requests)} requests, {sum(r['input_length'] for r in requests)} prompt tokens -> {args.out}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
