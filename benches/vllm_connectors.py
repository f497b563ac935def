"""kvstride against vLLM's own KV connectors, in a real vLLM 0.32 CPU engine.

    .venv-vllm/bin/python benches/vllm_connectors.py [--models gemma3,qwen3_next] \
        [--prompts 48] [--reps 3] [--trials 5] [--configs all] [--retention dense|TOKENS] [--json out.json]

Run it from the repo root with the vLLM venv's python. Each (model, configuration) runs in its
own subprocess, booted once and kept: one in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``uni``),
``PYTHONHASHSEED=0``, the engine settings, models and prompts of ``tests/vllm_harness.py``
(tiny random-weight models), with ``--retention`` as vLLM's ``prefix_cache_retention_interval``
(the tests' dense checkpoints by default; ``0`` is vLLM's default, under which kvstride's
admission stores a window group's blocks only for the tails of prompt ends and junctions).
Configurations:

- ``none``              no connector (the floor: what vLLM costs by itself);
- ``kvstride-embedded`` ``{"store": "embedded"}`` (host arena in the worker);
- ``kvstride-disk``     the same with a disk tier below it (``--disk-path``, ``--disk-bytes``): with a
  small ``store_bytes`` in ``--kvstride-extra`` the memory is full and every value is written
  through to disk; ``benches/slow_disk.sh`` runs it on a throttled disk ("generate s vs
  kvstride-embedded": what serving costs with the tier);
- ``kvstride-mooncake`` ``{"store": "mooncake"}`` on the Mooncake store started here;
- ``mooncake-store``    vLLM's MooncakeStoreConnector on the same store (the peer as a pure client,
  Mooncake's "standalone-store" mode);
- ``mooncake-store-own-segment`` the peer in its default mode (``embedded``): the engine is a
  Mooncake client that contributes a global segment of its own, on a master of its own (below);
- ``offloading``, ``simple-cpu``, ``example``: vLLM's OffloadingConnector,
  SimpleCPUOffloadConnector and ExampleConnector, each tried; one that does not boot is
  reported with its error. On the vLLM 0.32 CPU build the first two fail in
  ``register_kv_caches`` (they need CUDA/XPU streams); ExampleConnector (a debug connector:
  safetensors files, no HMA) boots for gemma3 but keys whole prompts, so a request that shares
  only a prefix never hits, and fails for qwen3_next (Mamba needs HMA).

The Mooncake store is ``python -m kvstride.cli store serve --bytes ... --config-out F``
(master + the segment holder on 127.0.0.1), started and stopped here; the engines of
``kvstride-mooncake`` and ``mooncake-store`` are pure clients of it (segment 0,
"standalone-store") reading ``MOONCAKE_CONFIG_PATH=F``.

The peer's default mode. vLLM 0.32's MooncakeStoreConnector reads the JSON file named by
``MOONCAKE_CONFIG_PATH`` (``vllm/distributed/mooncake_store.py``, ``MooncakeStoreConfig.from_file``)
and has each worker call ``MooncakeDistributedStore.setup(VLLM_HOST_IP, metadata_server,
global_segment_size, local_buffer_size, protocol, device_name, master_server_address)``. Keys the
file leaves out take vLLM's defaults: ``mode`` "embedded" (each rank contributes
``global_segment_size`` in-process; "standalone-store" requires a segment of 0),
``global_segment_size`` 4 GiB, ``local_buffer_size`` 4 GiB, ``protocol`` "rdma", no
``preferred_segment``. A master must still run. ``mooncake-store-own-segment`` gets a file with
only what has no usable default here: the master's address, ``protocol`` "tcp" (no RDMA on this
host), ``device_name`` "" and ``metadata_server`` "P2PHANDSHAKE" (the same as the pure-client
file); mode and sizes are vLLM's defaults, so each engine mounts a 4 GiB segment and a 4 GiB
local buffer (the pure-client file gives 16 MiB). Its master is a bare ``mooncake_master``
(``kvstride.stores.start_master``, the flags ``store serve`` gives its master, 127.0.0.1) without
a segment holder: ``kvstride store serve`` cannot start a master alone (``--bytes`` must be > 0),
and the holder must not share this master. Mooncake places a put without ``preferred_segment``
on any mounted segment with room (measured on 0.3.13.post1: a client with a 256 MiB segment
beside a 512 MiB holder put 16 of 40 objects in its own segment, 24 in the holder's), so on the
store-serve master the peer's default mode would put a share of its objects in the holder, and the
pure clients' puts would land in the idle own-segment engine's segment. On its own master, the
engine's segment is the only one: every object it stores lives in its own process, as with one
engine in default mode. Its "store processes' CPU" is that master's alone; the segment's work is
in the engine process's threads.

The reps are interleaved: rep r of every configuration runs before rep r + 1 of any, the order
rotated each round, one engine at a time (the others idle), so that this machine's drift (tens
of percent over minutes) falls on every configuration alike.

Measured per configuration:

- write-through: wall time of one ``generate`` of N fresh, distinct 480-token prompts
  (``--max-tokens`` each, the same prompts for every configuration in a round), until every
  save is done (kvstride-mooncake's save lane idle, the scheduler without requests or pending
  push work); the median of ``--reps``. "added": each round's time minus ``none``'s in the
  same round (the write-through cost over the engine alone), its median, and that over each
  peer's median: "added vs peer: pure client" (``mooncake-store``) and "added vs peer: own
  segment" (``mooncake-store-own-segment``), in brackets the median of the per-round ratios
  (``--json``: ``added_vs``); "vs peer" is the write-through time over the pure client's;
- TTFT on a hit: store a fresh prompt, drain + ``reset_prefix_cache()`` + random KV
  (``harness.drain_and_forget``), then time one request sharing 384 of its 480 tokens with
  max_tokens=1; median over ``--trials``. For ``none`` this is a miss (full prefill). It
  includes the engine steps vLLM runs while an asynchronous load is in flight;
- scheduler-side cost: time in the scheduler-side connector's methods (lookups,
  ``update_state_after_alloc``, ``build_connector_meta``, ``update_connector_output``,
  ``request_finished*``), per engine step and per write-through rep (steps include the ones
  run until every save is reported);
- external hit tokens (what ``update_state_after_alloc`` was given) and bytes moved: kvstride's
  worker counters ``bytes_stored`` / ``bytes_loaded``; the peer's ``KVConnectorStats``
  (``save_put_total_bytes`` / ``load_get_total_bytes``); otherwise n/a;
- CPU, per write-through rep (``--json``; the second table: their medians): the engine
  process's threads' seconds (``cpu_s``; in the table, all but vLLM's compute threads),
  the store processes' (``store_cpu_s``), and kvstride-mooncake's put calls and the seconds in
  them (``put_calls``).

``--kvstride-extra JSON`` adds connector settings to both kvstride configurations (e.g.
``put_linger_s``, ``staging_bytes``) to compare them with the defaults.

The machine must be quiet for figures worth keeping: every configuration shares its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # vllm_harness

CONFIGS = ("none", "kvstride-embedded", "kvstride-disk", "kvstride-mooncake", "mooncake-store",
           "mooncake-store-own-segment", "offloading", "simple-cpu", "example")
PEER = "mooncake-store"  # the peer as a pure client of store serve's store ("vs peer")
PEER_OWN_SEGMENT = "mooncake-store-own-segment"  # the peer in its default mode
#: The peers whose added cost each configuration's is divided by, and their labels in the table.
PEERS = {PEER: "pure client", PEER_OWN_SEGMENT: "own segment"}
PROMPT_TOKENS, SHARED_TOKENS = 480, 384  # as in vllm_harness (P1 / P2)
OFFLOAD_BYTES = 256 << 20  # CPU capacity given to vLLM's CPU offloading connectors


# ---- the child: one engine, one configuration ------------------------------------------------


def transfer_config(name: str, scratch: str, kvstride_extra: dict, disk: dict):
    """The ``KVTransferConfig`` of configuration ``name`` (None: no connector); ``kvstride_extra``
    goes into every kvstride configuration's extra config, ``disk`` (``disk_path``,
    ``disk_bytes``) into kvstride-disk's."""
    import vllm_harness as harness
    from vllm.config import KVTransferConfig

    def vllm_connector(connector, extra):
        # Same role and load-failure policy as the kvstride connector gets.
        return KVTransferConfig(kv_connector=connector, kv_role="kv_both", kv_load_failure_policy="recompute",
                                kv_connector_extra_config=extra)

    if name == "none":
        return None
    if name == "kvstride-embedded":
        return harness.connector_config({"store": "embedded", **kvstride_extra})
    if name == "kvstride-disk":  # a disk tier below the memory (``--disk-path``, ``--disk-bytes``)
        return harness.connector_config({"store": "embedded", **disk, **kvstride_extra})
    if name == "kvstride-mooncake":
        return harness.connector_config({"store": "mooncake", **kvstride_extra})  # MOONCAKE_CONFIG_PATH
    if name in (PEER, PEER_OWN_SEGMENT):  # the mode and the segment: from MOONCAKE_CONFIG_PATH
        return vllm_connector("MooncakeStoreConnector", {})
    if name == "offloading":
        return vllm_connector("OffloadingConnector", {"cpu_bytes_to_use": OFFLOAD_BYTES})
    if name == "simple-cpu":
        return vllm_connector("SimpleCPUOffloadConnector", {"cpu_bytes_to_use": OFFLOAD_BYTES})
    if name == "example":
        return vllm_connector("ExampleConnector", {"shared_storage_path": os.path.join(scratch, "example-kv")})
    raise ValueError(f"unknown configuration {name!r}; one of {', '.join(CONFIGS)}")


def fresh_tokens(seed: int, n: int) -> list:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


class SchedulerProbe:
    """Wraps the scheduler-side connector's methods (on the instance): time spent in them,
    engine steps (``build_connector_meta`` calls) and external tokens granted."""

    METHODS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
               "update_connector_output", "request_finished", "request_finished_all_groups",
               "register_finished_partial_tail")

    def __init__(self, connector):
        self.seconds = 0.0
        self.steps = 0
        self.ext_tokens = 0
        self._depth = 0  # only the outermost call counts (request_finished -> _all_groups)
        if connector is not None:
            for name in self.METHODS:
                if hasattr(connector, name):
                    setattr(connector, name, self._wrap(name, getattr(connector, name)))

    def _wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
                self._depth -= 1
            if name == "build_connector_meta":
                self.steps += 1
            elif name == "update_state_after_alloc":
                self.ext_tokens += int(args[2] if len(args) > 2 else kwargs.get("num_external_tokens", 0))
            return out

        return wrapped

    def snapshot(self):
        return self.seconds, self.steps, self.ext_tokens


class ByteProbe:
    """(bytes stored, bytes loaded) so far on the worker side, or None where the connector
    does not say. kvstride: its counters; others: their ``KVConnectorStats`` (collected by
    wrapping ``get_kv_connector_stats``, which vLLM calls every step and which resets)."""

    def __init__(self, worker):
        from collections import Counter

        self.worker = worker
        self.kvstride = type(worker).__name__ == "KVStrideConnector"
        self.totals = Counter()
        self.seen = False
        self._orig = None
        if worker is not None and not self.kvstride and hasattr(worker, "get_kv_connector_stats"):
            self._orig = worker.get_kv_connector_stats

            def wrapped():
                stats = self._orig()
                self._take(stats)
                return stats

            worker.get_kv_connector_stats = wrapped

    def _take(self, stats) -> None:
        if stats is None:
            return
        try:
            reduced = stats.reduce()
        except Exception:
            return
        for key, value in reduced.items():
            if "bytes" in key and isinstance(value, (int, float)):
                self.totals[key] += value
                self.seen = True

    def snapshot(self):
        if self.worker is None:
            return None
        if self.kvstride:
            c = self.worker.counters
            return int(c.get("bytes_stored", 0)), int(c.get("bytes_loaded", 0))
        if self._orig is not None:
            self._take(self._orig())  # what vLLM has not collected yet
        if not self.seen:
            return None
        # MooncakeStoreConnectorStats: save_put_total_bytes / load_get_total_bytes.
        stored = sum(v for k, v in self.totals.items() if any(w in k for w in ("save", "store", "put")))
        loaded = sum(v for k, v in self.totals.items() if any(w in k for w in ("load", "get", "recv")))
        return int(stored), int(loaded)


def _stat_cpu(stat: str) -> tuple:
    """(name, utime + stime seconds) from a /proc .../stat line."""
    name = stat[stat.index("(") + 1:stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2:].split()
    return name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu() -> dict:
    """This process's CPU seconds so far by thread id: (name, seconds)."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            out[int(task.name)] = _stat_cpu((task / "stat").read_text())
        except (OSError, ValueError):
            continue
    return out


def cpu_by_thread(after: dict, before: dict) -> dict:
    """Every thread's CPU seconds between two :func:`thread_cpu` snapshots, busiest first, as
    ``name/tid`` (vLLM's main thread, which also runs the scheduler and one of the OpenMP
    threads, as ``main``; the other OpenMP threads and the connectors' lanes are ``python``)."""
    main = os.getpid()
    spent = {
        "main" if tid == main else f"{name}/{tid}": round(cpu - before.get(tid, (name, 0.0))[1], 3)
        for tid, (name, cpu) in after.items()
    }
    return dict(sorted(((k, v) for k, v in spent.items() if v > 0), key=lambda kv: -kv[1]))


def process_cpu(pids) -> float:
    """CPU seconds so far of processes ``pids`` (every thread), 0 for those gone."""
    total = 0.0
    for pid in pids:
        try:
            total += _stat_cpu(Path(f"/proc/{pid}/stat").read_text())[1]
        except (OSError, ValueError):
            pass
    return total


def thread_report(limit: int = 8) -> list:
    """This process's busiest threads: name, CPU seconds, the cores it may run on (vLLM's CPU
    worker binds its OpenMP thread; helper threads started after that inherit the binding)."""
    rows = []
    for tid, (name, cpu) in thread_cpu().items():
        try:
            cores = sorted(os.sched_getaffinity(tid))
        except OSError:  # the thread ended
            continue
        rows.append({"thread": name, "cpu_s": round(cpu, 2), "cores": cores})
    return sorted(rows, key=lambda r: -r["cpu_s"])[:limit]


def delta(after, before):
    if after is None or before is None:
        return None
    return [a - b for a, b in zip(after, before)]


class ChildEngine:
    """One configuration's engine, booted and warmed up once; the parent asks it for one
    write-through rep or one TTFT trial at a time, interleaved with the other configurations'."""

    def __init__(self, spec: dict):
        import vllm_harness as harness
        from vllm import LLM

        self.harness, self.spec = harness, spec
        model = harness.MODELS[spec["model"]]
        kwargs = harness.engine_kwargs(model, spec["path"], prefix_cache_retention_interval=spec["retention"])
        ktc = transfer_config(spec["config"], spec["scratch"], spec["kvstride_extra"], spec["disk"])
        if ktc is not None:
            kwargs["kv_transfer_config"] = ktc
        start = time.perf_counter()
        self.llm = LLM(**kwargs)
        self.boot_s = time.perf_counter() - start
        core = self.llm.llm_engine.engine_core.engine_core
        self.sched = core.scheduler
        self.worker = None
        if self.sched.connector is not None:
            from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

            self.worker = get_kv_transfer_group()
        self.probe, self.bytes_probe = SchedulerProbe(self.sched.connector), ByteProbe(self.worker)
        self._count_puts()
        self._warm_up()

    def generate(self, prompts, max_tokens):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
        self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)

    def wait_saved(self, timeout=120.0):
        """Every save of what ran so far is in its store."""
        deadline = time.monotonic() + timeout
        if self.bytes_probe.kvstride and not self.worker.side.engine.wait_idle(timeout):  # Mooncake's save lane
            raise TimeoutError("kvstride save lane never went idle")
        # Finished requests held for their saves, the peer's store jobs (has_pending_push_work):
        # their completions reach the scheduler on a step.
        while self.sched.has_requests():
            if time.monotonic() > deadline:
                raise TimeoutError("the scheduler still has requests / pending saves")
            self.llm.llm_engine.step()
            time.sleep(0.001)

    def reset_local(self):
        while not self.llm.reset_prefix_cache():
            self.llm.llm_engine.step()
            time.sleep(0.001)

    def _warm_up(self):
        """A few saves and one hit cycle, not measured."""
        mt = self.spec["max_tokens"]
        self.generate([fresh_tokens(900_000 + i, PROMPT_TOKENS) for i in range(min(4, self.spec["prompts"]))], mt)
        self.wait_saved()
        warm = fresh_tokens(910_000, PROMPT_TOKENS)
        self.generate([warm], 1)
        self.wait_saved()
        self.harness.drain_and_forget(self.llm, 999)
        self.generate([warm[:SHARED_TOKENS] + fresh_tokens(920_000, PROMPT_TOKENS - SHARED_TOKENS)], 1)
        self.wait_saved()

    def write_rep(self, r: int) -> dict:
        """Write-through: N fresh prompts (the same for every configuration in rep ``r``) in one
        generate call, until all is saved."""
        self.reset_local()
        prompts = [fresh_tokens(1_000_000 + 10_000 * r + i, PROMPT_TOKENS) for i in range(self.spec["prompts"])]
        s0, b0, c0, p0 = self.probe.snapshot(), self.bytes_probe.snapshot(), thread_cpu(), self.put_calls()
        t0 = time.perf_counter()
        self.generate(prompts, self.spec["max_tokens"])
        t1 = time.perf_counter()
        self.wait_saved()
        t2 = time.perf_counter()
        s1, b1 = self.probe.snapshot(), self.bytes_probe.snapshot()
        return {"generate_s": t1 - t0, "write_through_s": t2 - t0,
                "sched_s": s1[0] - s0[0], "steps": s1[1] - s0[1], "ext_tokens": s1[2] - s0[2],
                "bytes": delta(b1, b0), "cpu_s": cpu_by_thread(thread_cpu(), c0),
                "put_calls": delta(self.put_calls(), p0)}

    def put_calls(self):
        """kvstride's (put calls, seconds in them) so far on its save lane; None for others and
        for the embedded store (whose saves are copies into its arena, not put calls)."""
        if not self.bytes_probe.kvstride or self._puts is None:
            return None
        return [self._puts, self.worker.side.engine.seconds["put"]]

    def _count_puts(self) -> None:
        """Counts the save lane's store put calls (``_puts``), on kvstride's Mooncake store."""
        self._puts = None
        store = self.worker.side.engine.store if self.bytes_probe.kvstride else None
        if store is None or type(store).__name__ != "MooncakeStore":
            return
        self._puts, put = 0, store.put

        def counted(*args, **kwargs):
            self._puts += 1
            return put(*args, **kwargs)

        store.put = counted

    def hit_trial(self, t: int) -> dict:
        """TTFT on a hit: store P1, forced miss, time P2 (shares 384 tokens)."""
        p1 = fresh_tokens(2_000_000 + t, PROMPT_TOKENS)
        self.generate([p1], self.spec["max_tokens"])
        self.wait_saved()
        self.harness.drain_and_forget(self.llm, 100 + t)
        p2 = p1[:SHARED_TOKENS] + fresh_tokens(3_000_000 + t, PROMPT_TOKENS - SHARED_TOKENS)
        s0, b0 = self.probe.snapshot(), self.bytes_probe.snapshot()
        t0 = time.perf_counter()
        self.generate([p2], 1)
        ttft = time.perf_counter() - t0
        self.wait_saved()
        s1, b1 = self.probe.snapshot(), self.bytes_probe.snapshot()
        return {"ttft_s": ttft, "ext_tokens": s1[2] - s0[2], "steps": s1[1] - s0[1],
                "sched_s": s1[0] - s0[0], "bytes": delta(b1, b0)}

    def finish(self) -> dict:
        out = {"threads": thread_report()}
        if self.bytes_probe.kvstride:
            out["worker_counters"] = {k: int(v) for k, v in self.worker.counters.items()}
        self.harness.close(self.llm)
        return out


def child_main(spec_json: str, reply_fd: int) -> int:
    """Boots the engine, answers ``ready``, then runs each command read from stdin (``write R``,
    ``hit T``, ``finish``) and answers one JSON line on ``reply_fd`` per command."""
    spec = json.loads(spec_json)
    reply = os.fdopen(reply_fd, "w")

    def answer(out: dict) -> None:
        reply.write(json.dumps(out) + "\n")
        reply.flush()

    engine = None
    try:
        engine = ChildEngine(spec)
        answer({"ok": True, "boot_s": engine.boot_s})
        for line in sys.stdin:
            op, _, arg = line.strip().partition(" ")
            if op == "write":
                answer({"ok": True, **engine.write_rep(int(arg))})
            elif op == "hit":
                answer({"ok": True, **engine.hit_trial(int(arg))})
            elif op == "finish":
                answer({"ok": True, **engine.finish()})
                break
    except BaseException as err:  # reported to the parent, which shows it in the table
        import traceback

        traceback.print_exc()
        answer({"ok": False, "error": f"{type(err).__name__}: {err}"})
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown (vLLM / Mooncake threads)


# ---- the parent: store server, subprocesses, tables --------------------------------------------


def child_pids(pid: int) -> list:
    """Direct children of ``pid`` (Linux /proc), e.g. the master of ``store serve``."""
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


class StoreServer:
    """``kvstride store serve`` in a subprocess; ``config_path`` is its MOONCAKE_CONFIG_PATH."""

    def __init__(self, scratch: str, size: str):
        self.config_path = os.path.join(scratch, "mooncake.json")
        self.log_path = os.path.join(scratch, "store-serve.log")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstride.cli", "store", "serve", "--bytes", size, "--config-out", self.config_path],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, cwd=str(ROOT),
        )
        self.children = []
        deadline = time.monotonic() + 60
        while not os.path.exists(self.config_path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvstride store serve did not come up; log {self.log_path}:\n"
                                   + Path(self.log_path).read_text()[-2000:])
            time.sleep(0.1)
        self.children = child_pids(self.proc.pid)  # the mooncake_master it started

    @property
    def pids(self) -> list:
        """The store's processes: this server (the segment holder) and its master."""
        return [self.proc.pid, *self.children]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # it closes its holder, then its master
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.children:  # only if it could not stop its master itself
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.log.close()


class BareMaster:
    """A ``mooncake_master`` alone (no segment holder), for the peer in its default mode, whose
    engine brings its own segment; ``config_path`` is its MOONCAKE_CONFIG_PATH: the master's
    address and the transport, with the mode and sizes left to vLLM's defaults."""

    def __init__(self, scratch: str):
        from kvstride.cli import STORE_SERVE_CLIENT_TTL_S
        from kvstride.stores import start_master

        # The same master as `kvstride store serve` starts: loopback, its client TTL, warnings only.
        self.master = start_master(host="127.0.0.1", client_ttl_s=STORE_SERVE_CLIENT_TTL_S,
                                   extra_args=["--minloglevel=1"], log_dir=scratch)
        self.config_path = os.path.join(scratch, "mooncake-own-segment.json")
        # No "mode", "global_segment_size", "local_buffer_size": vLLM's defaults ("embedded",
        # 4 GiB, 4 GiB). "protocol" would default to "rdma": this host has none.
        config = {"master_server_address": self.master.address, "protocol": "tcp", "device_name": "",
                  "metadata_server": "P2PHANDSHAKE"}
        Path(self.config_path).write_text(json.dumps(config) + "\n")

    @property
    def pids(self) -> list:
        return [self.master.pid]

    def stop(self) -> None:
        self.master.stop()


def last_error(log_path) -> str:
    """The most telling line of a failed child's or server's log: its last error, not vLLM's
    "initialization failed" that follows the root cause."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return "(no log)"
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if (any(w in line for w in ("Error", "Exception", "error:")) and not line.startswith(("File ", "raise "))
                and "initialization failed" not in line):
            return line[-400:]
    return lines[-1][-400:] if lines else "no output"


class Child:
    """One configuration's engine subprocess (``--child``): booted once, then asked for one rep
    or trial at a time. A child that fails or times out is stopped and its error kept."""

    def __init__(self, model: str, path: str, config: str, args, scratch: str, store):
        self.config, self.timeout = config, args.timeout
        tag = f"{model}-{config}"
        self.log_path = os.path.join(scratch, f"{tag}.log")
        child_scratch = os.path.join(scratch, tag)
        os.makedirs(child_scratch, exist_ok=True)
        # Short: the peer's ipc socket path must fit sockaddr_un (107 bytes), whatever the tag.
        rpc_dir = tempfile.mkdtemp(prefix="rpc-", dir=scratch)
        spec = dict(model=model, path=path, config=config, prompts=args.prompts, retention=args.retention,
                    max_tokens=args.max_tokens, scratch=child_scratch,
                    kvstride_extra=args.kvstride_extra, disk=disk_settings(args, child_scratch))
        env = dict(os.environ)
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONHASHSEED="0",
            VLLM_HOST_IP="127.0.0.1",  # the peer's Mooncake client advertises this address
            MC_TCP_BIND_ADDRESS="127.0.0.1",
            # The peer's scheduler->worker lookup socket is ipc://$VLLM_RPC_BASE_PATH/lookup_rpc_port_0_...:
            # private, so that other vLLM runs on this machine cannot collide with it.
            VLLM_RPC_BASE_PATH=rpc_dir,
            PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), str(ROOT / "python"), env.get("PYTHONPATH", "")]),
        )
        self.store_pids = [] if store is None else store.pids
        if store is not None:
            env["MOONCAKE_CONFIG_PATH"] = store.config_path
        else:
            env.pop("MOONCAKE_CONFIG_PATH", None)
        read_fd, write_fd = os.pipe()
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", json.dumps(spec), "--reply-fd", str(write_fd)],
            env=env, cwd=str(ROOT), stdin=subprocess.PIPE, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True, pass_fds=(write_fd,), text=True,
        )
        os.close(write_fd)
        self.replies = os.fdopen(read_fd)
        self.result = {"ok": True, "write": [], "hit": []}
        self.start = time.monotonic()
        boot = self._reply()
        if boot.get("ok"):
            self.result["boot_s"] = boot["boot_s"]

    @property
    def ok(self) -> bool:
        return self.result.get("ok", False)

    def _reply(self) -> dict:
        """The child's answer to its last command (or to booting)."""
        ready, _, _ = select.select([self.replies], [], [], self.timeout)
        line = self.replies.readline() if ready else ""
        out = json.loads(line) if line else {"ok": False, "error": "no answer" + ("" if ready else " (timeout)")}
        if not out.get("ok"):
            self.fail(out.get("error"))
        return out

    def fail(self, error) -> None:
        line = last_error(self.log_path)
        self.result = {"ok": False, "error": error if line in str(error) else f"{error} | log: {line}"}
        self.stop()

    def _command(self, command: str) -> dict:
        """Sends ``command``; the child's figures, or {} once it failed (its error kept)."""
        if not self.ok:
            return {}
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except OSError as err:
            self.fail(f"the child is gone: {err!r}")
            return {}
        out = self._reply()
        return {k: v for k, v in out.items() if k != "ok"} if out.get("ok") else {}

    def ask(self, command: str, into: str) -> None:
        """Runs ``write R`` or ``hit T`` and appends its figures to ``result[into]``, with the
        CPU the store's processes (holder and master; for the own-segment peer its bare master)
        spent meanwhile."""
        store_cpu = process_cpu(self.store_pids)
        figures = self._command(command)
        if figures:
            figures["store_cpu_s"] = round(process_cpu(self.store_pids) - store_cpu, 3)
            self.result[into].append(figures)

    def finish(self) -> dict:
        self.result.update(self._command("finish"))
        self.stop()
        self.result["log"], self.result["wall_s"] = self.log_path, time.monotonic() - self.start
        return self.result

    def stop(self) -> None:
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: only what it started
            self.proc.wait()
        self.replies.close()
        self.log.close()


def run_model(model: str, path: str, configs, args, scratch: str, stores: dict) -> dict:
    """Every configuration's engine booted (one after another), then rounds: rep r of every
    configuration before rep r + 1 of any, the order rotated each round so that each
    configuration runs at each position; the same for the TTFT trials. Engines not running
    are idle (their configuration's figures are not measured while another runs). ``stores``:
    each configuration's Mooncake store (MOONCAKE_CONFIG_PATH, and whose CPU is counted)."""
    children = []
    for config in configs:
        children.append(Child(model, path, config, args, scratch, stores.get(config)))
        state = "booted" if children[-1].ok else f"FAILED: {children[-1].result['error'][:200]}"
        print(f"# {model} / {config}: {state}", flush=True)
    try:
        for what, count in (("write", args.reps), ("hit", args.trials)):
            for r in range(count):
                shift = r % len(children)
                for child in children[shift:] + children[:shift]:
                    child.ask(f"{what} {r}", what)
            print(f"# {model}: {count} {what} rounds done", flush=True)
    finally:
        results = {child.config: child.finish() for child in children}
    return results


def cpu_beside_compute(cpu_s: dict) -> float:
    """A rep's CPU seconds (``cpu_s``) outside vLLM's compute: every thread but the main one
    and those that ran at least half as long as it (vLLM's other OpenMP threads, which spin)."""
    main = cpu_s.get("main", 0.0)
    return sum(v for k, v in cpu_s.items() if k != "main" and v < main / 2)


def median_of(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(res: dict) -> dict:
    """The table's figures from one configuration's raw result."""
    if not res.get("ok"):
        return {"error": res.get("error")}
    # The median rep (an odd --reps picks a measured one), never the best.
    best = sorted(res["write"], key=lambda r: r["write_through_s"])[len(res["write"]) // 2]
    steps = sum(r["steps"] for r in res["write"])
    stored = [r["bytes"][0] for r in res["write"] if r["bytes"] is not None]
    loaded = [t["bytes"][1] for t in res["hit"] if t["bytes"] is not None]
    return {
        "write_through_s": best["write_through_s"],
        "generate_s": best["generate_s"],
        "sched_us_per_step": (1e6 * sum(r["sched_s"] for r in res["write"]) / steps) if steps else None,
        "sched_ms_per_rep": 1e3 * statistics.mean(r["sched_s"] for r in res["write"]),
        "hit_steps": median_of(t["steps"] for t in res["hit"]),
        "ttft_hit_ms": median_of(1e3 * t["ttft_s"] for t in res["hit"]),
        "hit_tokens": median_of(t["ext_tokens"] for t in res["hit"]),
        "write_ext_tokens": sum(r["ext_tokens"] for r in res["write"]),
        "bytes_stored_per_rep": statistics.mean(stored) if stored else None,
        "bytes_loaded_per_hit": statistics.mean(loaded) if loaded else None,
        "boot_s": res["boot_s"],
        "cpu_beside_compute_s": median_of(cpu_beside_compute(r["cpu_s"]) for r in res["write"] if "cpu_s" in r),
        "store_cpu_s": median_of(r.get("store_cpu_s") for r in res["write"]),
        "put_calls": median_of((r.get("put_calls") or [None])[0] for r in res["write"]),
    }


def added_costs(raw: dict, rows: dict) -> None:
    """Write-through cost over the engine alone, round by round (each rep against ``none``'s
    rep of the same round): each configuration's median added seconds, and that over each
    peer's of :data:`PEERS` (the pure client and the own segment; ``added_vs[peer]``: the ratio
    of medians and the median of the per-round ratios, as a check on it)."""
    base = raw.get("none", {})
    if not base.get("ok"):
        return
    floor = [rep["write_through_s"] for rep in base["write"]]
    added = {}
    for config, res in raw.items():
        if config == "none" or not res.get("ok") or len(res["write"]) != len(floor):
            continue
        added[config] = [rep["write_through_s"] - f for rep, f in zip(res["write"], floor)]
        rows[config]["added_s"] = statistics.median(added[config])
    for name in PEERS:
        peer = added.get(name)
        if not peer or statistics.median(peer) <= 0:
            continue
        for config, costs in added.items():
            per_round = [c / p for c, p in zip(costs, peer) if p > 0]
            rows[config].setdefault("added_vs", {})[name] = {
                "ratio": statistics.median(costs) / statistics.median(peer),
                "per_round": statistics.median(per_round) if per_round else None,
            }


def fmt_bytes(n) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def print_table(model: str, rows: dict, args) -> None:
    peer = rows.get(PEER, {}).get("write_through_s")
    print(f"\n### {model}: {args.prompts} prompts x {PROMPT_TOKENS} tokens, max_tokens={args.max_tokens}, "
          f"median of {args.reps} reps; TTFT median of {args.trials} (hit shares {SHARED_TOKENS} tokens); "
          f"prefix_cache_retention_interval={args.retention}\n")
    peers = [name for name in PEERS if name in rows]
    embedded = rows.get("kvstride-embedded", {}).get("generate_s")
    print("| configuration | generate s | vs kvstride-embedded | write-through s | vs peer (pure client) | added s | "
          + "".join(f"added vs peer: {PEERS[name]} (per round) | " for name in peers)
          + "sched us/step | sched ms/rep | TTFT on hit ms | hit tokens | bytes stored / rep | bytes loaded / hit |")
    print("|---|---:|---:|---:|---:|---:|" + "---:|" * len(peers) + "---:|---:|---:|---:|---:|---:|")
    for name, s in rows.items():
        if "error" in s:
            print(f"| {name} | did not run: {s['error'][:300]} |" + " |" * (11 + len(peers)))
            continue
        ratio = f"{s['write_through_s'] / peer:.2f}x" if peer else "n/a"
        added = f"{s['added_s']:.3f}" if "added_s" in s else "-"
        added_ratios = ""
        for peer_name in peers:
            vs = s.get("added_vs", {}).get(peer_name)
            text = "-" if vs is None else f"{vs['ratio']:.2f}x"
            if vs is not None and vs["per_round"] is not None:
                text += f" ({vs['per_round']:.2f}x)"
            added_ratios += f" {text} |"
        sched = fmt_or_dash(s["sched_us_per_step"], 0)
        serving = f"{s['generate_s'] / embedded:.2f}x" if embedded else "n/a"
        print(f"| {name} | {s['generate_s']:.3f} | {serving} | {s['write_through_s']:.3f} | {ratio} | {added} |"
              f"{added_ratios} {sched} | {s['sched_ms_per_rep']:.1f} | "
              f"{s['ttft_hit_ms']:.1f} | "
              f"{s['hit_tokens']:.0f} | {fmt_bytes(s['bytes_stored_per_rep'])} | {fmt_bytes(s['bytes_loaded_per_hit'])} |")
    print("\nCPU a write-through rep (medians) beside vLLM's compute threads, of the store's processes "
          f"(for {PEER_OWN_SEGMENT}: its bare master; its segment is in the engine), "
          "and kvstride-mooncake's put calls:\n")
    print("| configuration | CPU beside vLLM's compute s | store processes' CPU s | put calls |")
    print("|---|---:|---:|---:|")
    for name, s in rows.items():
        if "error" not in s:
            print(f"| {name} | {fmt_or_dash(s['cpu_beside_compute_s'], 3)} | {fmt_or_dash(s['store_cpu_s'], 3)} | "
                  f"{fmt_or_dash(s['put_calls'], 0)} |")


def fmt_or_dash(value, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def disk_settings(args, child_scratch: str) -> dict:
    """kvstride-disk's folder: ``--disk-path`` (a slow disk, say) or one in the engine's scratch."""
    folder = os.path.join(args.disk_path or child_scratch, "kvstride-disk-" + os.path.basename(child_scratch))
    os.makedirs(folder, mode=0o700, exist_ok=True)
    return {"disk_path": folder, "disk_bytes": args.disk_bytes}


def retention_interval(text: str):
    return None if text in ("dense", "none", "None") else int(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gemma3,qwen3_next", help="comma-separated, from tests/vllm_harness.py")
    ap.add_argument("--configs", default="all", help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--prompts", type=int, default=48, help="fresh prompts per write-through generate call")
    ap.add_argument("--reps", type=int, default=3, help="write-through repetitions (the median is reported)")
    ap.add_argument("--retention", type=retention_interval, default=None,
                    help="vLLM's prefix_cache_retention_interval: 'dense' (None, the tests' setting, default) "
                         "or tokens (0: vLLM's default, checkpoints at prompt ends and junctions only)")
    ap.add_argument("--trials", type=int, default=5, help="TTFT-on-hit trials (median is reported)")
    ap.add_argument("--max-tokens", type=int, default=1, help="tokens generated per write-through prompt")
    ap.add_argument("--store-bytes", default="1G", help="segment of the Mooncake store server")
    ap.add_argument("--timeout", type=float, default=900, help="seconds an engine may take to boot, or to run one rep or trial")
    ap.add_argument("--kvstride-extra", type=json.loads, default={}, metavar="JSON",
                    help="more kv_connector_extra_config for both kvstride configurations, e.g. '{\"put_linger_s\": 0.1}'")
    ap.add_argument("--disk-path", help="kvstride-disk's folder is made here (default: in the scratch folder)")
    ap.add_argument("--disk-bytes", default="256MiB", help="kvstride-disk's disk_bytes")
    ap.add_argument("--json", metavar="PATH", help="also write every raw and summarized figure here")
    ap.add_argument("--keep", action="store_true", help="keep the scratch folder (models, logs)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--reply-fd", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child_main(args.child, args.reply_fd)

    import vllm_harness as harness

    models = [m for m in args.models.split(",") if m]
    configs = list(CONFIGS) if args.configs == "all" else [c for c in args.configs.split(",") if c]
    for name in models:
        if name not in harness.MODELS:
            ap.error(f"unknown model {name!r}; one of {', '.join(harness.MODELS)}")
    for name in configs:
        if name not in CONFIGS:
            ap.error(f"unknown configuration {name!r}; one of {', '.join(CONFIGS)}")
    scratch = tempfile.mkdtemp(prefix="kvstride-vllm-bench-")
    print(f"# vLLM connectors bench: {platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.2f} at start; scratch {scratch}", flush=True)
    report = {"args": vars(args), "models": {}}
    store = bare = None
    try:
        if any(c in ("kvstride-mooncake", PEER) for c in configs):
            store = StoreServer(scratch, args.store_bytes)
            print(f"# Mooncake store: MOONCAKE_CONFIG_PATH={store.config_path}: "
                  f"{Path(store.config_path).read_text().strip()}", flush=True)
        if PEER_OWN_SEGMENT in configs:
            bare = BareMaster(scratch)
            print(f"# {PEER_OWN_SEGMENT}: a bare mooncake_master (pid {bare.master.pid}), "
                  f"MOONCAKE_CONFIG_PATH={bare.config_path}: {Path(bare.config_path).read_text().strip()} "
                  "(mode and sizes: vLLM's defaults)", flush=True)
        # Every configuration but the own-segment peer sees store serve's store, as before.
        stores = {config: bare if config == PEER_OWN_SEGMENT else store for config in configs}
        for model in models:
            path = harness.MODELS[model].build(Path(scratch) / "models" / model)
            raw = run_model(model, path, configs, args, scratch, stores)
            rows = {config: summarize(res) for config, res in raw.items()}
            added_costs(raw, rows)
            print_table(model, rows, args)
            report["models"][model] = {"summary": rows, "raw": raw}
    finally:
        if store is not None:
            store.stop()
        if bare is not None:
            bare.stop()
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1))
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end"
          + ("" if args.keep else " (scratch removed; --keep keeps the logs)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
