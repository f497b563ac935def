"""End to end through a real vLLM 0.32 CPU engine, built so that wrong KV fails the test
(``tests/vllm_harness.py``): random-weight models whose output depends on every KV-cache group,
vLLM settings under which its own output is hit-invariant, and before each hit a forced miss
(drain, ``reset_prefix_cache()``, every KV tensor overwritten with random values). Tokens and
logprobs are compared with a run without a connector; a deliberately wrong load must fail.

This file is the fast tier (scheduler and worker in one process, ``uni``); the process layout
``vllm serve`` uses is ``test_vllm_serve.py``. Skipped where vLLM is not installed (it needs
its own environment, see the Makefile).
"""

from __future__ import annotations

import ctypes
import os
import time

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm import LLM  # noqa: E402

import kvstride.vllm as kv_vllm  # noqa: E402
import vllm_harness as harness  # noqa: E402
from kvstride.arena import HostArena  # noqa: E402
from kvstride.stores import MooncakeStore, Status  # noqa: E402
from mooncake_fixture import fresh_master, mooncake_master  # noqa: E402,F401  (fixtures)

MODELS = list(harness.MODELS)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: m.build(root / name) for name, m in harness.MODELS.items()}


@pytest.fixture(scope="module")
def plain_outputs(model_dirs):
    """Each model's scenario without a connector (computed once per module)."""
    cache = {}

    def get(name):
        if name not in cache:
            llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name]))
            try:
                cache[name] = harness.scenario(llm)
            finally:
                harness.close(llm)
        return cache[name]

    return get


def _connectors(llm):
    """(scheduler-side, worker-side) connector of an in-process engine."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    return llm.llm_engine.engine_core.engine_core.scheduler.connector, get_kv_transfer_group()


def _store_config(kind: str, master, name: str) -> dict:
    if kind == "embedded":
        return {"store": "embedded", "store_name": name}
    return {"store": "mooncake", "mooncake_master": master.address, "mooncake_local_hostname": "127.0.0.1", "store_name": name}


def _run_with_connector(model_dirs, name, store, **observe):
    """The scenario with the connector; returns (outputs, external hit tokens per phase,
    worker counters)."""
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector=store))
    try:
        sched, worker = _connectors(llm)
        hits = {}
        before = [0]

        def hit_of(phase):
            hits[phase] = sched.matched_tokens - before[0]
            before[0] = sched.matched_tokens

        out = harness.scenario(llm, after=hit_of)
        return out, hits, dict(worker.counters)
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()


@pytest.fixture(params=["embedded", "mooncake"])
def store_kind(request):
    return request.param


@pytest.fixture
def store_for(store_kind, request):
    master = request.getfixturevalue("mooncake_master") if store_kind == "mooncake" else None
    return lambda name: _store_config(store_kind, master, f"{name}-{store_kind}-{os.getpid()}")


@pytest.mark.parametrize("name", MODELS)
def test_bit_identical_with_hits(model_dirs, plain_outputs, store_for, name):
    """P2 (80 % shared) and the repeat of P1 hit the store after a forced miss, at least as
    far as vLLM's MooncakeStoreConnector does, and match a plain run in tokens and logprobs."""
    got, hits, counters = _run_with_connector(model_dirs, name, store_for(name))
    assert hits["p1"] == 0, hits
    assert hits["p2"] >= harness.PEER_HITS[name], (hits, counters)
    assert hits["repeat"] >= harness.PEER_HITS[name], (hits, counters)
    assert counters.get("get_ok", 0) > 0 and not counters.get("loads_failed"), counters
    assert harness.mismatches(got, plain_outputs(name)) == []


def _perturb_group_on_load(monkeypatch, group: int) -> list:
    """Every block of ``group`` that an arena load writes gets its bytes reversed afterwards."""
    original = HostArena.load
    perturbed = []

    def load(self, slots, groups, block_ids):
        ok = original(self, slots, groups, block_ids)
        ids = torch.tensor([b for g, b in zip(groups, block_ids) if g == group], dtype=torch.int64)
        if len(ids):
            for piece in range(len(self.layout.groups[group].pieces)):
                kv, _ = self._piece_views(group, piece)
                kv.index_copy_(0, ids, kv.index_select(0, ids).flip(-1))
            perturbed.extend(ids.tolist())
        return ok

    monkeypatch.setattr(HostArena, "load", load)
    return perturbed


# Model, and the group whose loaded blocks are made wrong: a sliding window, a GDN state,
# a short-conv state, full attention, a sliding window next to MoE and sinks.
NEGATIVE = [("gemma3", 1), ("qwen3_next", 0), ("lfm2", 0), ("llama", 0), ("gpt_oss", 0)]


@pytest.mark.parametrize("name,group", NEGATIVE)
def test_negative_control_wrong_load_is_caught(model_dirs, plain_outputs, monkeypatch, name, group):
    """The comparison above can fail: one group's loaded blocks made wrong change the output."""
    perturbed = _perturb_group_on_load(monkeypatch, group)
    store = {"store": "embedded", "store_name": f"neg-{name}-{os.getpid()}"}
    got, hits, _ = _run_with_connector(model_dirs, name, store)
    assert perturbed and hits["p2"] > 0
    assert harness.mismatches(got, plain_outputs(name)), "a wrong load went unnoticed"


# ---- failures: recomputed, never raised into vLLM -------------------------------------------


class _FailingLoads:
    """Make loads fail in one way once armed; the store itself stays real. Embedded: the
    arena's slots (a flipped byte that the digest catches, or an exception in the copy);
    Mooncake: the store's answers (unavailable, a value evicted after the lookup, payload bytes
    that no longer match their header's digest, an exception)."""

    def __init__(self, monkeypatch, store: str, how: str) -> None:
        self.armed = False
        self.calls = 0
        if store == "embedded":
            original = HostArena.load

            def load(arena, slots, groups, block_ids, **kwargs):
                if self.armed:
                    self.calls += 1
                    if how == "raise":
                        raise RuntimeError("arena exploded")
                    arena.buffer[int(slots[-1]) * arena.slot_bytes] ^= 0xFF
                return original(arena, slots, groups, block_ids, **kwargs)

            monkeypatch.setattr(HostArena, "load", load)
            return
        original = MooncakeStore.get

        def get(store, keys, buffers, **kwargs):
            if not self.armed:
                return original(store, keys, buffers, **kwargs)
            self.calls += 1
            keys = list(keys)
            if how == "raise":
                raise RuntimeError("store exploded")
            if how == "unavailable":
                return [Status.UNAVAILABLE] * len(keys)
            if how == "evicted":
                store.remove(keys[-1:])
            statuses = original(store, keys, buffers, **kwargs)
            if how == "corrupt":  # payload bytes changed under an intact header: only the digest sees it
                addr, _ = buffers[-1][0]
                ctypes.c_uint8.from_address(addr).value ^= 0xFF
            return statuses

        monkeypatch.setattr(MooncakeStore, "get", get)


FAULTS = [("embedded", "corrupt"), ("embedded", "raise")] + [
    ("mooncake", how) for how in ("unavailable", "evicted", "corrupt", "raise")
]


@pytest.mark.parametrize("name", ["gemma3", "qwen3_next"])
@pytest.mark.parametrize("store,how", FAULTS)
def test_failed_load_on_multi_group_model_is_recomputed(model_dirs, plain_outputs, monkeypatch, request, name, store, how):
    """vLLM 0.32 stops on block-level load errors for models with several KV-cache groups; a
    failed asynchronous load goes out as ``failed_recving``: vLLM recomputes, same output,
    the failure counted once."""
    faults = _FailingLoads(monkeypatch, store, how)
    master = request.getfixturevalue("mooncake_master") if store == "mooncake" else None
    llm = LLM(**harness.engine_kwargs(
        harness.MODELS[name], model_dirs[name], connector=_store_config(store, master, f"fail-{name}-{how}-{os.getpid()}"),
    ))
    try:
        sched, worker = _connectors(llm)
        p1, p2 = harness.prompts()
        got = {"p1": harness.generate(llm, p1)}
        harness.drain_and_forget(llm, 1)
        faults.armed = True
        got["p2"] = harness.generate(llm, p2)
        faults.armed = False
        harness.drain_and_forget(llm, 2)
        got["repeat"] = harness.generate(llm, p1)  # the store is still good for the rest
        counters = dict(worker.counters)
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    assert faults.calls > 0 and sched.matched_tokens > 0
    assert counters.get("loads_failed", 0) + counters.get("load_job_errors", 0) == 1, counters
    if how == "corrupt":
        assert counters.get("get_corrupt", 0) >= 1, counters
    assert harness.mismatches(got, plain_outputs(name)) == []


def _phases(llm, between=None):
    """The scenario's three requests; ``between(phase)`` runs after each forced miss."""
    p1, p2 = harness.prompts()
    out = {}
    for seed, (phase, prompt) in enumerate((("p1", p1), ("p2", p2), ("repeat", p1))):
        if seed:
            harness.drain_and_forget(llm, seed)
            if between is not None:
                between(phase)
        out[phase] = harness.generate(llm, prompt)
    return out


def test_mooncake_master_killed_mid_run_and_restarted(model_dirs, plain_outputs, fresh_master):
    """The master dies before P2 and comes back (empty) before the repeat: the engine keeps
    serving with the plain run's output, the lost store counted, never raised."""
    name = "qwen3_next"
    llm = LLM(**harness.engine_kwargs(
        harness.MODELS[name], model_dirs[name], connector=_store_config("mooncake", fresh_master, f"kill-{os.getpid()}"),
    ))
    try:
        sched, worker = _connectors(llm)

        def master(phase):
            if phase == "p2":
                fresh_master.kill()
            else:
                fresh_master.restart()

        got = _phases(llm, master)
        sched_counters, counters = dict(sched.counters), dict(worker.counters)
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    assert harness.mismatches(got, plain_outputs(name)) == []
    assert counters.get("put_ok", 0) > 0, counters  # P1 was stored
    failures = {k: v for k, v in {**sched_counters, **counters}.items() if "unavailable" in k or "error" in k}
    assert failures, (sched_counters, counters)


def test_store_full_keeps_serving(model_dirs, plain_outputs):
    """An embedded store far smaller than one prompt: what does not fit is refused or evicted
    and counted, hits (if any) stay right, the output is the plain run's. (A full Mooncake
    segment is tests/test_mooncake.py's: Mooncake refuses segments small enough to fill here.)"""
    name = "gemma3"
    config = {"store": "embedded", "store_bytes": 8 * 8192}  # 8 slots of one Gemma-3 block
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector=config))
    try:
        sched, worker = _connectors(llm)
        got = harness.scenario(llm)
        counters = {**sched.counters, **worker.counters}
        evictions = sched.index.evictions if sched.index is not None else 0
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    assert harness.mismatches(got, plain_outputs(name)) == []
    refused = {k: v for k, v in counters.items() if k.startswith("put_") and k not in ("put_ok", "put_skipped_present")}
    assert refused or evictions, counters


def test_reset_connector_empties_the_embedded_store(model_dirs):
    """``reset_prefix_cache(reset_connector=True)`` forgets every stored block: the repeat of
    a prompt that hit before now misses."""
    name = "gemma3"
    llm = LLM(**harness.engine_kwargs(
        harness.MODELS[name], model_dirs[name], connector=_store_config("embedded", None, f"reset-{os.getpid()}"),
    ))
    try:
        sched, _ = _connectors(llm)
        p1, _ = harness.prompts()
        harness.generate(llm, p1)
        harness.drain_and_forget(llm, 1)
        assert len(sched.index) > 0
        deadline = time.monotonic() + 60
        while not llm.reset_prefix_cache(reset_connector=True):  # refused while saves are in flight
            assert time.monotonic() < deadline, "reset_connector never succeeded"
            llm.llm_engine.step()
        assert len(sched.index) == 0
        before = sched.matched_tokens
        harness.generate(llm, p1)
        assert sched.matched_tokens == before  # nothing left to hit
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()


def test_a_hit_whose_load_cannot_be_recorded_is_recomputed(model_dirs, plain_outputs, monkeypatch):
    """The hit was claimed asynchronously (vLLM parks the request), then recording its load
    fails: the request is reported failed and recomputed, never left waiting."""
    name = "gemma3"
    armed = [False]
    real = kv_vllm.LoadRequest

    def load_request(*args, **kwargs):
        if armed[0]:
            raise RuntimeError("bookkeeping exploded")
        return real(*args, **kwargs)

    monkeypatch.setattr(kv_vllm, "LoadRequest", load_request)
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector={"store": "embedded"}))
    try:
        sched, worker = _connectors(llm)
        got = harness.scenario(llm, after=lambda phase: armed.__setitem__(0, phase == "p1"))
        counters = dict(worker.counters)
    finally:
        harness.close(llm)
    assert sched.matched_tokens > 0 and counters.get("loads_failed") == 1, counters
    assert harness.mismatches(got, plain_outputs(name)) == []
