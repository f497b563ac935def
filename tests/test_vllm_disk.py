"""The embedded store's disk tier in a real vLLM engine (in-process, the CPU build): a memory
tier too small to keep the prompts between turns, a disk tier under it. P2 (80 % shared with
P1) and the exact repeat of P1 hit from disk after filler prompts pushed them out of memory, and
match a plain run in tokens and logprobs; a new engine on the same folder hits from disk again,
bit-identical; records changed on disk are misses, never wrong bytes.

Needs the vLLM environment (``make test-vllm``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import glob
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm import LLM  # noqa: E402

import kvstride.vllm as kv_vllm  # noqa: E402
import vllm_harness as harness  # noqa: E402
from kvstride.arena.disk import DiskRecords  # noqa: E402
from vllm_fixtures import model_dirs, plain_outputs  # noqa: E402,F401  (fixtures)

#: Arena slots of one block: room for one prompt's hit (and its saves), not for three prompts.
MEMORY_SLOTS = {"gemma3": 40, "qwen3_next": 40}


def _connectors(llm):
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    return llm.llm_engine.engine_core.engine_core.scheduler.connector.side, get_kv_transfer_group().side


def _config(folder, name: str) -> dict:
    block = _block_bytes(name)
    return {"store": "embedded", "store_bytes": MEMORY_SLOTS[name] * block, "disk_path": str(folder),
            "disk_bytes": "256MiB"}


def _block_bytes(name: str) -> int:
    """The arena's slot (a multiple of the disk's 4 KiB blocks) of ``name``'s largest group."""
    return {"gemma3": 8192, "qwen3_next": 40960}[name]


def _fillers(count: int):
    """Prompts sharing nothing with the scenario's: their saves push it out of memory."""
    return [[(13 * i + 7 * k + 1) % 499 + 1 for i in range(harness.PROMPT_TOKENS)] for k in range(count)]


class Hits:
    def __init__(self, sched) -> None:
        self.sched, self.before = sched, sched.matched_tokens

    def take(self) -> int:
        hit, self.before = self.sched.matched_tokens - self.before, self.sched.matched_tokens
        return hit


def _turn(llm, prompt, seed: int, fillers: int = 3):
    """Push what is in memory out with fillers, force vLLM's own miss, then run ``prompt``."""
    for filler in _fillers(fillers):
        harness.generate(llm, filler, max_tokens=1)
    harness.drain_and_forget(llm, seed)
    return harness.generate(llm, prompt)


@pytest.mark.parametrize("name", ["gemma3", "qwen3_next"])
def test_hits_from_disk_and_again_after_a_restart(model_dirs, plain_outputs, tmp_path, name):
    p1, p2 = harness.prompts()
    want = plain_outputs(name)
    config = _config(tmp_path, name)
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector=config))
    try:
        sched, worker = _connectors(llm)
        hits = Hits(sched)
        got = {"p1": harness.generate(llm, p1)}
        assert hits.take() == 0
        got["p2"] = _turn(llm, p2, 1)
        p2_hit = hits.take()
        got["repeat"] = _turn(llm, p1, 2)
        repeat_hit = hits.take()
        counters = {**sched.counters, **worker.counters}
        assert sched.placement.index.evictions > 0, "the memory tier never filled: nothing came from disk"
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    assert p2_hit >= harness.PEER_HITS[name] and repeat_hit >= harness.PEER_HITS[name], (p2_hit, repeat_hit, counters)
    assert counters.get("loads_from_disk", 0) >= 2 and not counters.get("loads_failed"), counters
    assert counters.get("disk_bytes_written", 0) > 0 and counters.get("disk_bytes_read", 0) > 0, counters
    assert harness.mismatches(got, want) == []

    # A new engine on the same folder: vLLM's own cache is empty, the disk still holds P1 and P2.
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector=config))
    try:
        sched, worker = _connectors(llm)
        assert sched.placement.disk.restored > 0
        hits = Hits(sched)
        again = {"p2": harness.generate(llm, p2)}
        restarted_hit = hits.take()
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    assert restarted_hit >= harness.PEER_HITS[name], restarted_hit
    assert harness.mismatches(again, {"p2": want["p2"]}) == []


def test_records_changed_on_disk_are_misses_and_the_output_stays_right(model_dirs, plain_outputs, tmp_path):
    """Random bytes over every record between two engines: the second engine's lookups still
    claim the hit (its index says so), its reads reject every record (counted), the request
    recomputes, and its output is the plain run's. The control: the same without the damage
    hits (the test above)."""
    name = "gemma3"
    p1, p2 = harness.prompts()
    config = _config(tmp_path, name)
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector=config))
    try:
        harness.generate(llm, p1)
        harness.drain_and_forget(llm, 1)
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    rng = np.random.default_rng(0)
    for path in glob.glob(os.path.join(tmp_path, "*.records")):
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.write(rng.integers(0, 256, size, np.uint8).tobytes())
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector=config))
    try:
        sched, worker = _connectors(llm)
        got = {"p2": harness.generate(llm, p2)}
        for _ in range(4):  # the rejected records' report reaches the scheduler
            llm.llm_engine.step()
        counters = {**sched.counters, **worker.counters}
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    assert counters.get("disk_records_rejected", 0) > 0 and counters.get("disk_loads_failed", 0) > 0, counters
    assert harness.mismatches(got, {"p2": plain_outputs(name)["p2"]}) == []


def test_a_wrong_byte_from_disk_would_be_caught(model_dirs, plain_outputs, tmp_path, monkeypatch):
    """The negative control of the test above: records read back with one byte changed past
    their check (so the load takes them) make the output differ from the plain run. The hits
    above are the disk's bytes, and the comparison sees them."""
    name = "gemma3"
    original = DiskRecords.read

    def read(self, record, slot, key, group):
        ok = original(self, record, slot, key, group)
        if ok:
            view = self.arena.buffer.numpy()[slot * self.arena.slot_bytes:][: int(self.arena.block_bytes[group])]
            view[:] = view[::-1].copy()
            self.arena.digests[slot] = self.arena._digest(np.array([slot]), np.array([group]))[0]
        return ok

    monkeypatch.setattr(DiskRecords, "read", read)
    p1, p2 = harness.prompts()
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector=_config(tmp_path, name)))
    try:
        sched, _ = _connectors(llm)
        harness.generate(llm, p1)
        got = {"p2": _turn(llm, p2, 1)}
        loads_from_disk = sched.counters.get("loads_from_disk", 0)
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    assert loads_from_disk > 0
    assert harness.mismatches(got, {"p2": plain_outputs(name)["p2"]}) != []


@pytest.mark.parametrize("load_timeout_s", [1, 600])
def test_a_disk_that_does_not_answer_costs_a_load_its_deadline(model_dirs, plain_outputs, tmp_path, monkeypatch,
                                                               load_timeout_s):
    """Reads that do not return (a hung drive): P2's load from disk fails at its deadline and P2
    recomputes, bit-identical to the plain run, while the read still runs; the slots it writes
    stay reserved until it ends, then everything is released (``reset_prefix_cache``). The
    deadline is ``load_timeout_s``, or sooner what the read admission allowed the reads (4 times
    computing P2's tokens, at least 2 s): a drive stalled behind its writes held requests 10 s
    under ``vllm serve``."""
    name = "gemma3"
    original = DiskRecords.read
    answer, reads = threading.Event(), {"started": 0, "ended": 0}

    def read(self, record, slot, key, group):
        reads["started"] += 1
        answer.wait(300)  # the drive answers when the test lets it
        ok = original(self, record, slot, key, group)
        reads["ended"] += 1
        return ok

    monkeypatch.setattr(DiskRecords, "read", read)
    p1, p2 = harness.prompts()
    config = {**_config(tmp_path, name), "load_timeout_s": load_timeout_s}
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector=config))
    try:
        sched, worker = _connectors(llm)
        harness.generate(llm, p1)
        got = {"p2": _turn(llm, p2, 1)}
        while_hung = dict(reads), dict(sched.placement._late_reads), bool(sched.placement._disk_loads)
        answer.set()
        for filler in _fillers(20):  # steps, in which the late reads report their end
            if not sched.placement._late_reads:
                break
            harness.generate(llm, filler, max_tokens=1)
        left = dict(sched.placement._late_reads), dict(sched.placement._disk_loads)
        reset = llm.reset_prefix_cache()
        counters = {**sched.counters, **worker.counters}
    finally:
        answer.set()
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    (hung_reads, late, reserved) = while_hung
    assert hung_reads["started"] > 0 and hung_reads["ended"] == 0, hung_reads  # P2 did not wait for it
    assert counters.get("disk_reads_timed_out", 0) >= 1 and counters.get("loads_from_disk", 0) >= 1, counters
    assert late and reserved, "the late read's slots were released while it could still write them"
    assert left == ({}, {}) and reset, left
    assert harness.mismatches(got, {"p2": plain_outputs(name)["p2"]}) == []


WRITER = textwrap.dedent(
    """
    import json, sys, time
    from vllm import LLM
    import vllm_harness as harness

    name, path, config, prompts = json.loads(sys.argv[1])
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], path, connector=config))
    placement = llm.llm_engine.engine_core.engine_core.scheduler.connector.side.placement
    p1, p2 = harness.prompts()
    for prompt in (p1, p2):
        harness.generate(llm, prompt)
        deadline = time.monotonic() + 120
        while placement._disk_jobs or placement._disk_queue:  # written through, reported
            assert time.monotonic() < deadline, "the write-through of P1 and P2 never ended"
            harness.generate(llm, [1] * 8, max_tokens=1)  # a step, shorter than a block: no save
    print("stored", json.dumps(placement.take_counts()), flush=True)
    while True:  # heavy writes until killed
        for k, prompt in enumerate(prompts):
            harness.generate(llm, prompt, max_tokens=1)
            print("filler", k, flush=True)
    """
)


def test_an_engine_killed_during_heavy_writes_leaves_no_wrong_byte(model_dirs, tmp_path):
    """An engine process SIGKILLed while it writes filler prompts through to disk; a new engine
    on the same folder hits what completed (P1 and P2, bit-identical with a plain run) and loads
    no wrong byte of what was in flight (the fillers it ran, again bit-identical)."""
    name = "gemma3"
    folder = tmp_path / "disk"
    folder.mkdir()
    config = _config(folder, name)
    fillers = _fillers(12)
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p))
    log_path = tmp_path / "writer.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(script), json.dumps([name, model_dirs[name], config, fillers])],
                                env=env, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        lines, writer_counts = 0, None
        while lines < len(fillers) + 5:  # killed in the middle of its second round of fillers
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                break
            line = proc.stdout.readline()
            if not line:  # it exited
                break
            if line.startswith("stored"):
                writer_counts = json.loads(line.split(" ", 1)[1])
            lines += line.startswith("filler")
        assert lines >= len(fillers) + 5, log_path.read_text()[-3000:]
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)

    p1, p2 = harness.prompts()
    checked = fillers[:6] + [p2, p1]
    plain = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name]))
    try:
        want = [harness.generate(plain, prompt, max_tokens=2) for prompt in checked]
    finally:
        harness.close(plain)
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector=config))
    try:
        sched, _ = _connectors(llm)
        assert sched.placement.disk.restored > 0
        hits = Hits(sched)
        got, got_hits = [], []
        for seed, prompt in enumerate(checked, 1):
            harness.drain_and_forget(llm, seed)
            got.append(harness.generate(llm, prompt, max_tokens=2))
            got_hits.append(hits.take())
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    assert not writer_counts.get("disk_writes_skipped"), writer_counts  # P1 and P2 written whole
    assert got_hits[-2] >= harness.PEER_HITS[name] and got_hits[-1] >= harness.PEER_HITS[name], got_hits
    assert harness.mismatches(dict(enumerate(got)), dict(enumerate(want))) == []


def test_an_mla_engines_latents_survive_the_disk_and_a_restart_bit_for_bit(tmp_path):
    """MLA (DeepSeek-V2's shape: one latent KV cache a layer). vLLM's CPU platform runs it
    without prefix caching, so nothing is claimed here; its saves go on, through the disk tier.
    A new engine on the same folder restores every record the first one wrote, and each reads
    back into its arena, checked, exactly the bytes the first engine's arena held for its key;
    both engines' outputs are a plain run's."""
    model = harness.Model("deepseek_v2", harness.deepseek_v2, 16)
    path = harness.deepseek_v2(tmp_path / "deepseek_v2")
    folder = tmp_path / "disk"
    folder.mkdir(mode=0o700)
    config = {"store": "embedded", "store_bytes": "32MiB", "disk_path": str(folder), "disk_bytes": "128MiB"}
    p1, p2 = harness.prompts()
    plain = LLM(**harness.engine_kwargs(model, path))
    try:
        want = {"p1": harness.generate(plain, p1), "p2": harness.generate(plain, p2)}
    finally:
        harness.close(plain)

    llm = LLM(**harness.engine_kwargs(model, path, connector=config))
    try:
        sched, worker = _connectors(llm)
        got = {"p1": harness.generate(llm, p1), "p2": harness.generate(llm, p2)}
        harness.drain_and_forget(llm, 1)
        deadline = time.monotonic() + 60
        while sched.placement._disk_in_flight and time.monotonic() < deadline:  # the write-through ends
            llm.llm_engine.step()
            time.sleep(0.01)
        keys = [key for key, _ in sched.placement.disk.rows()]
        arena = worker.store.arena
        slots = arena.buffer.numpy().reshape(-1, arena.slot_bytes)
        written = {}
        for key in keys:
            slot = sched.placement.index.slot(key)
            written[key] = (int(arena.slot_group[slot]), slots[slot, : int(arena.block_bytes[arena.slot_group[slot]])].copy())
        counters = {**sched.counters, **worker.counters}
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    assert sched.matched_tokens == 0 and len(written) >= harness.PROMPT_TOKENS // model.block_size - 1, counters
    assert harness.mismatches(got, want) == []

    llm = LLM(**harness.engine_kwargs(model, path, connector=config))
    try:
        sched, worker = _connectors(llm)
        assert sched.placement.disk.restored == len(written)
        arena, records = worker.store.arena, worker.store.disk.records
        slots = arena.buffer.numpy().reshape(-1, arena.slot_bytes)
        for key, record in sched.placement.disk.rows():  # into slot 0 of the new engine's empty arena
            group, value = written[key]
            assert records.read(record, 0, key, group), key
            assert np.array_equal(slots[0, : len(value)], value), key
        again = {"p2": harness.generate(llm, p2)}
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    assert harness.mismatches(again, {"p2": want["p2"]}) == []
