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

import collections
import ctypes
import os
import time
from typing import Optional

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
vllm = pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from vllm import LLM  # noqa: E402

import kvstride.vllm as kv_vllm  # noqa: E402
from kvstride.vllm import scheduler as vllm_scheduler  # noqa: E402
import vllm_harness as harness  # noqa: E402
from kvstride.arena import HostArena  # noqa: E402
from kvstride.stores import HEADER_BYTES, MooncakeStore, Status  # noqa: E402
from vllm_fixtures import model_dirs, plain_outputs  # noqa: E402,F401  (fixtures)
from mooncake_fixture import fresh_master, mooncake_master  # noqa: E402,F401  (fixtures)

MODELS = list(harness.MODELS)


@pytest.fixture(scope="module")
def plain_run(model_dirs):
    """``workload(llm)`` on model ``name`` without a connector, with engine settings
    ``overrides`` (computed once per module and arguments)."""
    cache = {}

    def get(name, workload, **overrides):
        key = (name, workload.__name__, tuple(sorted(overrides.items())))
        if key not in cache:
            llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], **overrides))
            try:
                cache[key] = workload(llm)
            finally:
                harness.close(llm)
        return cache[key]

    return get


def _connectors(llm):
    """(scheduler-side, worker-side) connector of an in-process engine."""
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    return llm.llm_engine.engine_core.engine_core.scheduler.connector.side, get_kv_transfer_group().side


def _scheduler_side(llm):
    """The scheduler side of the engine's connector; None without one."""
    connector = harness.scheduler_of(llm).connector
    return None if connector is None else connector.side


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

        out = harness.scenario(llm, after=hit_of)  # ends with every vLLM block back (assert_idle)
        counters = dict(worker.counters)
        if hasattr(sched.placement, "index"):  # the embedded store: no save or load job left in flight
            assert llm.reset_prefix_cache(reset_connector=True), "reset_prefix_cache(reset_connector=True) refused"
        return out, hits, counters
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


def test_an_engine_vllm_runs_without_prefix_caching_loads_nothing(tmp_path):
    """vLLM's CPU platform turns prefix caching off for MLA models (DeepSeek-V2's shape here):
    their prefill cannot attend to a prefix it did not compute, so a loaded prefix changes the
    output (P2's logprobs and the repeat's tokens did). kvstride claims no hit on such an engine,
    and the scenario matches a plain run; saves go on."""
    model = harness.Model("deepseek_v2", harness.deepseek_v2, 16)
    path = harness.deepseek_v2(tmp_path / "deepseek_v2")
    plain = LLM(**harness.engine_kwargs(model, path))
    try:
        assert not plain.llm_engine.vllm_config.cache_config.enable_prefix_caching
        want = harness.scenario(plain)
    finally:
        harness.close(plain)
    llm = LLM(**harness.engine_kwargs(model, path, connector={"store": "embedded"}))
    try:
        sched, worker = _connectors(llm)
        got = harness.scenario(llm)
        assert sched.matched_tokens == 0 and worker.counters.get("bytes_stored", 0) > 0, dict(worker.counters)
    finally:
        harness.close(llm)
    assert harness.mismatches(got, want) == []


def _perturb_group_on_load(monkeypatch, group: int) -> list:
    """Every block of ``group`` that an arena load writes gets its bytes reversed afterwards."""
    original = HostArena.load
    perturbed = []

    def load(self, slots, groups, block_ids, **kwargs):
        ok = original(self, slots, groups, block_ids, **kwargs)
        ids = torch.tensor([b for g, b in zip(groups, block_ids) if g == group], dtype=torch.int64)
        if len(ids):
            for p in self.layout.groups[group].pieces:  # each piece of every block: (blocks, bytes)
                kv = self.layout.storages[p.storage].as_strided(
                    (self.layout.groups[group].num_blocks, p.size), (p.stride, 1), p.offset)
                kv.index_copy_(0, ids, kv.index_select(0, ids).flip(-1))
            perturbed.extend(ids.tolist())
        return ok

    monkeypatch.setattr(HostArena, "load", load)
    return perturbed


# Model, and the group whose loaded blocks are made wrong: a sliding window, a GDN state,
# a short-conv state, full attention, a sliding window next to MoE and sinks, a Mamba-2 state
# and a sliding window next to Mamba-2.
NEGATIVE = [
    ("gemma3", 1), ("qwen3_next", 0), ("lfm2", 0), ("llama", 0), ("gpt_oss", 0), ("nemotron_h_swa", 0),
    ("nemotron_h_swa", 2),
]


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
                addr, nbytes = buffers[-1][0]  # the first part, maybe with the header's room in front
                ctypes.c_uint8.from_address(addr + nbytes - 1).value ^= 0xFF
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
        idle = harness.free_blocks(llm)
        p1, p2 = harness.prompts()
        got = {"p1": harness.generate(llm, p1)}
        harness.drain_and_forget(llm, 1)
        faults.armed = True
        got["p2"] = harness.generate(llm, p2)
        faults.armed = False
        harness.drain_and_forget(llm, 2)
        got["repeat"] = harness.generate(llm, p1)  # the store is still good for the rest
        harness.assert_idle(llm, idle)
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
    """The scenario's three requests; ``between(phase)`` runs after each forced miss. Ends
    with every vLLM block back (``assert_idle``)."""
    idle = harness.free_blocks(llm)
    p1, p2 = harness.prompts()
    out = {}
    for seed, (phase, prompt) in enumerate((("p1", p1), ("p2", p2), ("repeat", p1))):
        if seed:
            harness.drain_and_forget(llm, seed)
            if between is not None:
                between(phase)
        out[phase] = harness.generate(llm, prompt)
    harness.assert_idle(llm, idle)
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
        evictions = sched.placement.index.evictions if hasattr(sched.placement, "index") else 0
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
        idle = harness.free_blocks(llm)
        p1, _ = harness.prompts()
        harness.generate(llm, p1)
        harness.drain_and_forget(llm, 1)
        assert len(sched.placement.index) > 0
        deadline = time.monotonic() + 60
        while not llm.reset_prefix_cache(reset_connector=True):  # refused while saves are in flight
            assert time.monotonic() < deadline, "reset_connector never succeeded"
            llm.llm_engine.step()
        assert len(sched.placement.index) == 0
        before = sched.matched_tokens
        harness.generate(llm, p1)
        assert sched.matched_tokens == before  # nothing left to hit
        harness.assert_idle(llm, idle)
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()


def test_a_hit_whose_load_cannot_be_recorded_is_recomputed(model_dirs, plain_outputs, monkeypatch):
    """The hit was claimed asynchronously (vLLM parks the request), then recording its load
    fails: the request is reported failed and recomputed, never left waiting."""
    name = "gemma3"
    armed = [False]
    real = vllm_scheduler.LoadRequest

    def load_request(*args, **kwargs):
        if armed[0]:
            raise RuntimeError("bookkeeping exploded")
        return real(*args, **kwargs)

    monkeypatch.setattr(vllm_scheduler, "LoadRequest", load_request)
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector={"store": "embedded"}))
    try:
        sched, worker = _connectors(llm)
        got = harness.scenario(llm, after=lambda phase: armed.__setitem__(0, phase == "p1"))
        counters = dict(worker.counters)
    finally:
        harness.close(llm)
    assert sched.matched_tokens > 0 and counters.get("loads_failed") == 1, counters
    assert harness.mismatches(got, plain_outputs(name)) == []


# ---- saves read only blocks vLLM still holds (issue 15.2, review B5) -----------------------------


def test_window_blocks_after_failed_saves_are_stored_as_computed(model_dirs, monkeypatch):
    """Gemma-3 (sliding window 64, block 32): every save fails while the prompt is prefilled
    and the decode runs well past the window, then saves work again. vLLM has freed (and,
    with a pool this small, handed out again) the window blocks of the boundaries the
    connector could not save; whatever the connector stores afterwards must be the KV those
    tokens had when they were computed, byte for byte (recorded after every step from vLLM's
    live block table), never another block's bytes under this request's keys."""
    name = "gemma3"
    prompt = harness.prompts()[0]
    decode = 192  # past the window (64) several times over before saves work again
    kwargs = harness.engine_kwargs(
        harness.MODELS[name], model_dirs[name], connector=_store_config("embedded", None, f"window-{os.getpid()}"),
        max_model_len=harness.PROMPT_TOKENS + decode + 32, num_gpu_blocks_override=48,
    )
    failing = [True]
    calls = {"failed": 0, "ok": 0}
    original = HostArena.save_begin  # the worker's path into the arena

    def save(arena, *args, **kw):
        if failing[0]:
            calls["failed"] += 1
            raise RuntimeError("store down")
        calls["ok"] += 1
        return original(arena, *args, **kw)

    monkeypatch.setattr(HostArena, "save_begin", save)
    llm = LLM(**kwargs)
    try:
        sched, worker = _connectors(llm)
        layout = worker.store.arena.layout
        groups = range(len(layout.groups))
        recorder = harness.LiveBlockRecorder(llm, layout, groups)
        engine = llm.llm_engine
        from vllm.inputs import TokensPrompt

        engine.add_request("w", TokensPrompt(prompt_token_ids=prompt), harness.sampling(decode))
        scheduler = harness.scheduler_of(llm)
        (rid,) = list(scheduler.requests)
        request = scheduler.requests[rid]
        while engine.has_unfinished_requests():
            engine.step()
            recorder.record()
            # Saves work again once the decode is two windows past the prompt.
            if failing[0] and request.num_computed_tokens >= harness.PROMPT_TOKENS + 128:
                failing[0] = False
        harness.assert_idle(llm, None)
        assert calls["failed"] > 0 and calls["ok"] > 0, calls
        assert recorder.freed_seen > 0  # vLLM did free window blocks
        keys = harness.block_keys(sched.planner, request.block_hashes, len(layout.groups), request.num_computed_tokens)
        stored = [(key, sched.placement.index.slot(key)) for key in sched.placement.index.keys()]
        assert stored, "nothing was stored after the saves came back"
        # Read every stored value back through the arena (digest checked) into a free block.
        scratch = 1
        wrong, checked = [], 0
        for key, slot in stored:
            assert key in keys, f"stored key {key} is no block of the request"
            g, i = keys[key]
            ok = worker.store.arena.load([slot], [g], [scratch])
            assert ok.all(), f"slot {slot} of {key} does not verify"
            want = recorder.bytes.get((rid, g, i))
            assert want is not None, f"group {g} block {i} was stored but never seen live in vLLM"
            checked += 1
            if harness.block_bytes(layout, g, scratch) != want:
                wrong.append((g, i))
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    assert not wrong, f"{len(wrong)} of {checked} stored blocks hold other bytes than their tokens' KV: {sorted(wrong)}"


#: (prompts, prompt tokens, tokens generated): long prompts that run one or two at a time, and
#: more requests than the cache holds as they grow, which vLLM preempts; a preempted request
#: hits what it saved and waits for its load.
FENCE_WORKLOADS = {"long prompts": (3, harness.PROMPT_TOKENS, 64), "preempting": (4, 96, 288)}


@pytest.mark.parametrize("workload", FENCE_WORKLOADS)
def test_every_block_a_step_hands_to_a_request_is_fenced_before_its_forward(model_dirs, monkeypatch, workload):
    """On CUDA a save's reads run beside the next steps' kernels, until the step about to write
    one of its blocks is fenced. Each step's metadata must name every block vLLM's scheduling
    handed to a request in that step (freed by a finished or preempted request or by a sliding
    window, and given to another; the blocks of a request that waits for its load, which the
    load writes that step), as vLLM's own block tables show them before and after the step's
    scheduling; and the worker fences exactly those blocks before the forward and the loads
    (vLLM calls ``handle_preemptions`` there)."""
    name = "gemma3"
    count, prompt_tokens, generated = FENCE_WORKLOADS[workload]
    prompts = [[(7 * i + 11 * k) % 500 + 3 for i in range(prompt_tokens)] for k in range(count)]
    kwargs = harness.engine_kwargs(
        harness.MODELS[name], model_dirs[name], connector=_store_config("embedded", None, f"fence-{os.getpid()}"),
        max_model_len=prompt_tokens + generated, num_gpu_blocks_override=48,
    )
    llm = LLM(**kwargs)
    preempted = []
    try:
        scheduler = harness.scheduler_of(llm)
        manager = scheduler.kv_cache_manager
        _, worker = _connectors(llm)
        preempt = scheduler._preempt_request

        def preempting(request, *args, **kwargs):
            preempted.append(request.request_id)
            return preempt(request, *args, **kwargs)

        monkeypatch.setattr(scheduler, "_preempt_request", preempting)

        def owned():
            return {rid: {b for table in manager.get_block_ids(rid) for b in table} for rid in scheduler.requests}

        handed, metas, fenced = [], [], []
        schedule, build, fence = scheduler.schedule, scheduler.connector.build_connector_meta, worker.engine.fence

        def scheduling(*args, **kwargs):
            before = owned()
            output = schedule(*args, **kwargs)
            after = owned()
            handed.append(set().union(*(blocks - before.get(rid, set()) for rid, blocks in after.items())) - {0})
            return output

        def building(output):
            metas.append(build(output))
            return metas[-1]

        def fencing(block_ids):
            fenced.append(list(block_ids))
            return fence(fenced[-1])

        monkeypatch.setattr(scheduler, "schedule", scheduling)
        monkeypatch.setattr(scheduler.connector, "build_connector_meta", building)
        monkeypatch.setattr(worker.engine, "fence", fencing)
        llm.generate([{"prompt_token_ids": p} for p in prompts], harness.sampling(generated), use_tqdm=False)
        harness.assert_idle(llm, None)
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    assert bool(preempted) == (workload == "preempting"), f"preempted: {preempted}"
    assert any(meta.loads for meta in metas) == (workload == "preempting")
    assert len(handed) == len(metas) and metas
    for step, (blocks, meta) in enumerate(zip(handed, metas)):
        assert blocks <= set(meta.allocated), f"step {step}: blocks {sorted(blocks - set(meta.allocated))} not named"
    assert [meta.allocated for meta in metas if meta.allocated] == [f for f in fenced if f]
    reused = [b for b, n in collections.Counter(b for blocks in handed for b in blocks).items() if n > 1]
    assert reused, "the workload must hand blocks out again"


@pytest.mark.parametrize("name", ["gemma3", "lfm2"])
def test_reads_are_left_pending_only_where_vllm_writes_new_blocks_after_the_fence(model_dirs, name):
    """vLLM zeroes the blocks it allocates in a KV cache with Mamba layers (its KV-cache config
    says so), and 0.34's model runner does that before ``handle_preemptions``, where no fence
    can order a save's pending reads first. So on a Mamba hybrid no group is fenced: the
    step's stream waits for every read of a save at once. Sliding-window and full-attention
    groups are fenced."""
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name],
                                      connector=_store_config("embedded", None, f"fenced-{name}-{os.getpid()}")))
    try:
        _, worker = _connectors(llm)
        kv_cache_config = harness.scheduler_of(llm).kv_cache_config
        fenced = worker._fenced_groups
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    if name == "lfm2":
        assert kv_cache_config.needs_kv_cache_zeroing and fenced == frozenset()
    else:
        groups = len(kv_cache_config.kv_cache_groups)
        assert not kv_cache_config.needs_kv_cache_zeroing and fenced == frozenset(range(groups))


def test_no_group_is_fenced_in_a_mixed_precision_cache_and_a_ring_never_is():
    """A mixed-precision KV cache is zeroed on allocation too (vLLM's config says so); a
    circular buffer's block is rewritten in place while its request runs, as a Mamba state is."""
    from types import SimpleNamespace

    from kvstride import GroupSpec
    from kvstride.vllm.worker import fenced_groups

    groups = [GroupSpec("full_attention", 32), GroupSpec("circular_buffer", 32)]
    assert fenced_groups(groups, SimpleNamespace(needs_kv_cache_zeroing=False)) == frozenset({0})
    assert fenced_groups(groups, SimpleNamespace(needs_kv_cache_zeroing=True)) == frozenset()


# ---- the boundary rule in one place (issue 14.3, review B6) ----------------------------------

#: A prompt one token past a block boundary (481 = 15 * 32 + 1).
P481 = [(7 * i + 3) % 500 + 3 for i in range(15 * 32 + 1)]


def _forced_miss_phases(llm, phases, hits: Optional[list] = None) -> dict:
    """Each ``(phase, prompt)`` in turn, every one after the first after a forced miss;
    ``hits`` gets each request's external hit tokens (with a connector). Ends with vLLM's
    blocks back (``assert_idle``)."""
    sched = _scheduler_side(llm)
    idle = harness.free_blocks(llm)
    out = {}
    for seed, (phase, prompt) in enumerate(phases):
        if seed:
            harness.drain_and_forget(llm, seed)
        before = sched.matched_tokens if sched is not None else 0
        out[phase] = harness.generate(llm, prompt)
        if hits is not None:
            hits.append(sched.matched_tokens - before)
    harness.assert_idle(llm, idle)
    return out


def _repeat_481(llm, hits: Optional[list] = None) -> dict:
    """P481, then its exact repeat after a forced miss."""
    return _forced_miss_phases(llm, (("first", P481), ("repeat", P481)), hits)


@pytest.mark.parametrize("kind", ["embedded", "mooncake"])
def test_repeat_of_block_plus_one_prompt_hits_all_but_its_last_token(model_dirs, plain_run, request, kind):
    """A 481-token prompt (n = 1 mod the 32-token block) repeated after a forced miss hits
    exactly 480 tokens, all but the one vLLM must compute (vLLM's MooncakeStoreConnector
    does), and matches a plain run in tokens and logprobs."""
    name = "llama"
    master = request.getfixturevalue("mooncake_master") if kind == "mooncake" else None
    store = _store_config(kind, master, f"p481-{kind}-{os.getpid()}")
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector=store))
    try:
        hits = []
        got = _repeat_481(llm, hits)
        counters = dict(_connectors(llm)[1].counters)
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    assert hits == [0, 480], (hits, counters)
    assert harness.mismatches(got, plain_run(name, _repeat_481)) == []


# ---- admission under vLLM's default retention (issue 18, SEMANTICS §8) ----------------------

#: vLLM's default ``prefix_cache_retention_interval``: checkpoints at prompt ends and junctions.
DEFAULT_RETENTION = {"prefix_cache_retention_interval": 0}


def _admission_phases():
    """P1, P2 (its first 384 tokens), P3 (the same 384, another tail), the repeat of P1."""
    p1, p2 = harness.prompts()
    tail = [(13 * i + 7) % 500 + 3 for i in range(harness.PROMPT_TOKENS - harness.SHARED_TOKENS)]
    return (("p1", p1), ("p2", p2), ("p3", p1[: harness.SHARED_TOKENS] + tail), ("repeat", p1))


def _admission_workload(llm, hits: Optional[list] = None) -> dict:
    """The admission phases, each after a forced miss."""
    return _forced_miss_phases(llm, _admission_phases(), hits)


def _admission_run(model_dirs, store: dict):
    llm = LLM(**harness.engine_kwargs(harness.MODELS["gemma3"], model_dirs["gemma3"], connector=store, **DEFAULT_RETENTION))
    try:
        hits = []
        got = _admission_workload(llm, hits)
        sched, worker = _connectors(llm)
        counters = dict(worker.counters)
        # Nothing kept per request once every request finished (tails included).
        assert not sched._admitted and not sched._stamps, (sched._admitted, sched._stamps)
        if store["store"] == "embedded":
            assert llm.reset_prefix_cache(reset_connector=True), "reset_prefix_cache(reset_connector=True) refused"
        return got, hits, counters
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()


@pytest.mark.parametrize("kind", ["embedded", "mooncake"])
def test_window_blocks_are_stored_only_where_a_lookup_can_hit(model_dirs, plain_run, request, kind):
    """Gemma-3 (window 64) under vLLM's default retention: P1 keeps only the window tails of
    its ends (448, 480), so P2, sharing 384 tokens with it, misses, as vLLM's own cache would
    without a checkpoint there; P2's save finds P1's prefix seen before and keeps the tail of
    their junction, so P3 (the same 384 tokens) hits 384 and the repeat of P1 hits 448. Tokens
    and logprobs are the plain run's; the dense policy stores more for the same run."""
    master = request.getfixturevalue("mooncake_master") if kind == "mooncake" else None
    want = plain_run("gemma3", _admission_workload, **DEFAULT_RETENTION)
    store = _store_config(kind, master, f"admission-{kind}-{os.getpid()}")
    got, hits, counters = _admission_run(model_dirs, store)
    assert hits == [0, 0, harness.SHARED_TOKENS, 448], (hits, counters)
    assert harness.mismatches(got, want) == []
    assert not counters.get("loads_failed") and not counters.get("get_corrupt"), counters
    if kind == "embedded":
        dense = _store_config(kind, master, f"admission-dense-{os.getpid()}") | {"admission": "dense"}
        got_dense, hits_dense, counters_dense = _admission_run(model_dirs, dense)
        assert hits_dense == [0, harness.SHARED_TOKENS, harness.SHARED_TOKENS, 448], (hits_dense, counters_dense)
        assert harness.mismatches(got_dense, want) == []
        assert counters["bytes_stored"] < counters_dense["bytes_stored"], (counters, counters_dense)


# ---- saves of any size (issue 14.2, review B2) ---------------------------------------------------

#: The whole 480-token prompt in one prefill step: Llama's 15 blocks, 240 KiB per step, in a
#: 64 KiB staging pool (the ratio of a real model's 8k-token chunk to the 64 MiB default).
ONE_STEP = {"max_num_batched_tokens": 512}


def _p1_then_p2_local(llm) -> dict:
    """P1, then P2 hitting vLLM's own prefix cache (384 shared tokens): the computation a
    384-token external hit must reproduce (P2's last 96 tokens in one step)."""
    p1, p2 = harness.prompts()
    idle = harness.free_blocks(llm)
    out = {"p1": harness.generate(llm, p1), "p2": harness.generate(llm, p2)}
    harness.assert_idle(llm, idle)
    return out


def test_step_larger_than_the_staging_pool_is_stored_and_hits(model_dirs, plain_run, mooncake_master):
    """Mooncake with a staging pool of four 16 KiB blocks (each staged after its 64-byte value
    header) and a prefill step of 240 KiB (and a load of 192 KiB): the step's saves stream
    through the pool, P2 hits exactly its 384 shared tokens after a forced miss, no save or
    load fails, and the output equals a plain engine's with the same settings."""
    name = "llama"
    four_blocks = 4 * ((16 << 10) + HEADER_BYTES)  # the loads' quarter holds one block
    store = dict(_store_config("mooncake", mooncake_master, f"staging-{os.getpid()}"), staging_bytes=four_blocks)
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector=store, **ONE_STEP))
    try:
        sched, worker = _connectors(llm)
        p1, p2 = harness.prompts()
        idle = harness.free_blocks(llm)
        got = {"p1": harness.generate(llm, p1)}
        harness.drain_and_forget(llm, 1)
        before = sched.matched_tokens
        got["p2"] = harness.generate(llm, p2)
        hit = sched.matched_tokens - before
        harness.assert_idle(llm, idle)
        counters = dict(worker.counters)
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    errors = {k: v for k, v in counters.items() if "error" in k or "fail" in k}
    assert hit == harness.SHARED_TOKENS and not errors, (hit, counters)
    assert counters.get("get_ok", 0) > 0, counters
    assert harness.mismatches(got, plain_run(name, _p1_then_p2_local, **ONE_STEP)) == []


# ---- every step: a finished tail in a step without a forward (issue 15.1, review B3) -------------

#: Qwen3-Next's 96-token Mamba blocks with hits at every 32 tokens: vLLM stops a prompt's
#: prefill at its last 32-token boundary (448 for 480 tokens), inside a Mamba block, and hands
#: the state there to the connector as a partial tail when the request ends at that point.
FINE_HITS = {"prefix_match_unit": 32}
TAIL = (harness.PROMPT_TOKENS - 1) // 32 * 32  # 448


def _tail_prompt(llm, hits: Optional[list] = None) -> dict:
    """P1's first TAIL + 1 tokens after a forced miss (a hit can reach TAIL)."""
    sched = _scheduler_side(llm)
    harness.drain_and_forget(llm, 7)
    before = sched.matched_tokens if sched is not None else 0
    out = {"tail": harness.generate(llm, harness.prompts()[0][: TAIL + 1])}
    if hits is not None:
        hits.append(sched.matched_tokens - before)
    return out


def test_finished_tail_in_a_step_without_forward_is_saved_and_frees_its_blocks(model_dirs, plain_run, monkeypatch):
    """A request ends (aborted) right after vLLM computed its prompt up to the partial-tail
    boundary; vLLM hands the tail to the connector and keeps the request's blocks until the
    connector reports it sent. Nothing else runs, so the following steps schedule no token
    (vLLM's no-forward path). Within those steps the tail is saved, the request reported in
    ``finished_sending`` and every block is back; ``reset_prefix_cache`` succeeds, with and
    without the connector (no save job left in flight); the saved tail then serves a hit of
    exactly TAIL tokens with the plain run's output."""
    from vllm.inputs import TokensPrompt

    name = "qwen3_next"
    tails = []
    original = kv_vllm.KVStrideConnector.register_finished_partial_tail

    def register(self, request, block_ids, offloads):
        held = original(self, request, block_ids, offloads)
        tails.append((request.request_id, list(offloads), held))
        return held

    monkeypatch.setattr(kv_vllm.KVStrideConnector, "register_finished_partial_tail", register)
    store = _store_config("embedded", None, f"tail-{os.getpid()}")
    llm = LLM(**harness.engine_kwargs(harness.MODELS[name], model_dirs[name], connector=store, **FINE_HITS))
    try:
        scheduler = harness.scheduler_of(llm)
        idle = harness.free_blocks(llm)
        engine = llm.llm_engine
        engine.add_request("t", TokensPrompt(prompt_token_ids=harness.prompts()[0]), harness.sampling())
        (rid,) = list(scheduler.requests)
        while scheduler.requests[rid].num_computed_tokens < TAIL:
            engine.step()
        assert scheduler.requests[rid].num_computed_tokens == TAIL
        engine.abort_request([rid], internal=True)
        assert [(r, held) for r, _, held in tails] == [(rid, True)], tails  # vLLM holds the blocks for it
        scheduled = []
        schedule = scheduler.schedule

        def spy(*args, **kwargs):
            out = schedule(*args, **kwargs)
            scheduled.append(out.total_num_scheduled_tokens)
            return out

        monkeypatch.setattr(scheduler, "schedule", spy)
        for _ in range(8):
            if rid not in scheduler.requests:
                break
            engine.step()
        monkeypatch.setattr(scheduler, "schedule", schedule)
        assert scheduled and not any(scheduled), scheduled  # only steps without a forward ran
        assert rid not in scheduler.requests, f"the finished request's blocks are still held after {len(scheduled)} steps"
        harness.assert_idle(llm, idle, max_steps=0)
        hits = []
        got = _tail_prompt(llm, hits)
        harness.assert_idle(llm, idle)
        assert llm.reset_prefix_cache(reset_connector=True), "a save job is still in flight"
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
    assert hits == [TAIL], hits
    assert harness.mismatches(got, plain_run(name, _tail_prompt, **FINE_HITS)) == []


# ---- one store call per scheduling pass (issue 16) -------------------------------------------


def test_requests_arriving_together_are_each_looked_up_once_on_the_embedded_store(model_dirs):
    """vLLM asks for one request's hit at a time. The embedded store's index is in this
    process, so each call asks about one request (batching saves no round trip), and no
    request is asked about twice while the index is unchanged. (A shared store's batched calls:
    tests/test_vllm_scheduler.py.)"""
    from vllm.inputs import TokensPrompt

    llm = LLM(**harness.engine_kwargs(harness.MODELS["llama"], model_dirs["llama"], connector={"store": "embedded"}))
    try:
        sched, _ = _connectors(llm)
        calls = []
        exists = sched.engine.store.exists

        def counted(keys):
            calls.append(len(keys))
            return exists(keys)

        sched.engine.store.exists = counted
        looked_up = sched.counters["lookups"]
        prompts = [TokensPrompt(prompt_token_ids=[(7 * i + k) % 500 + 3 for i in range(100)]) for k in range(4)]
        llm.generate(prompts, harness.sampling(2), use_tqdm=False)
        looked_up = sched.counters["lookups"] - looked_up
        # 100 tokens in 32-token blocks: 3 keys a request (one full-attention group).
        assert looked_up == 4 and calls == [3] * 4, (looked_up, calls)
    finally:
        harness.close(llm)
        kv_vllm.drop_shared_stores()
