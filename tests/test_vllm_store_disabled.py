"""A worker whose store is disabled is a miss, not a failure: the scheduler learns it from the
worker's step report and claims no hit (and plans no save) until the worker reports the store
back. On a real Mooncake master that is killed and restarted, the two sides of one engine
sharing one client, as vLLM's in-process engines do.

Needs the vLLM environment (``make test-vllm``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

import kvstride.vllm as kv_vllm  # noqa: E402
from kvstride.stores import start_master  # noqa: E402
from kvstride.vllm import worker as worker_module  # noqa: E402
from kvstride.vllm.config import resolve_config  # noqa: E402
from kvstride.vllm.scheduler import SchedulerSide  # noqa: E402
from kvstride.vllm.store_registry import open_side_store  # noqa: E402
from kvstride.vllm.worker import WorkerSide  # noqa: E402
from test_vllm_identity import kv_cache_config, vllm_config  # noqa: E402
from test_vllm_scheduler import _prefill_step  # noqa: E402

BLOCK = 32
TOKENS = 4 * BLOCK + 1
TABLES = [[1, 2, 3, 4, 5]]
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def _request(rid: str, prompt: int = 0):
    """A request of prompt number ``prompt`` (its block hashes)."""
    hashes = [bytes([prompt, i]) * 16 for i in range(TOKENS // BLOCK)]
    return SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=TOKENS, num_prompt_tokens=TOKENS,
                           lora_request=None, mm_features=None)


def _kv_caches():
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(2, 64, BLOCK, 2, 32, generator=generator).to(torch.bfloat16) for name in LAYERS}


def _output(worker, meta):
    """The step's connector output of ``worker`` as vLLM hands it to the scheduler."""
    results = worker.get_transfer_results(meta, set())
    return SimpleNamespace(finished_recving=set(results.finished_recving), failed_recving=set(results.failed_recving),
                           kv_connector_worker_meta=worker.build_connector_worker_meta())


def _reported(worker_meta):
    return SimpleNamespace(finished_recving=set(), failed_recving=set(), kv_connector_worker_meta=worker_meta)


def _save(scheduler, worker, rid: str, prompt: int = 0) -> bool:
    """One step of a request computing its prompt: the scheduler plans, the worker stores it;
    True when every rank wrote it."""
    request = _request(rid, prompt)
    scheduler.on_new_request(request)
    before = scheduler.counters["saves_ok"]
    meta = scheduler.build_connector_meta(_prefill_step(request, TOKENS, TABLES))
    worker.wait_for_save(meta)
    assert worker.engine.wait_idle(30)
    scheduler.update_connector_output(_output(worker, meta))
    scheduler.request_finished_all_groups(request, (TABLES[0],))
    return scheduler.counters["saves_ok"] > before


def test_a_disabled_store_is_a_miss_until_the_worker_reports_it_back(monkeypatch, tmp_path):
    master = start_master(log_dir=str(tmp_path))
    extra = {"store": "mooncake", "mooncake_master": master.address, "mooncake_segment_bytes": 32 << 20,
             "mooncake_local_buffer_bytes": 16 << 20, "mooncake_local_hostname": "127.0.0.1",
             "model_identity": "disabled-test", "staging_bytes": 4 << 20}
    config = vllm_config("tiny", extra)
    kv = kv_cache_config()
    scheduler_config, worker_config = (resolve_config(config, kv, worker=w) for w in (False, True))
    worker_store, _ = open_side_store(worker_config, config, True)
    placement, _ = open_side_store(scheduler_config, config, False)  # the same client: one process
    scheduler = SchedulerSide(scheduler_config, placement)
    healthy = WorkerSide(worker_config, worker_store, config, kv)
    disabled = None
    try:
        healthy.register_kv_caches(_kv_caches())
        assert healthy.engine is not None and healthy.build_connector_worker_meta() is None
        assert _save(scheduler, healthy, "a")
        assert scheduler.get_num_new_matched_tokens(_request("b"), 0) == (4 * BLOCK, True)

        master.kill()
        disabled, caches = WorkerSide(worker_config, worker_store, config, kv), _kv_caches()  # starting meanwhile
        # The client learns the master is down, and refuses registrations for a second after.
        assert worker_store.exists(["probe"]) == [False]
        disabled.register_kv_caches(caches)
        assert disabled.engine is None
        master.restart()
        # The master came back empty: the healthy worker stores a new prompt (its client reconnects).
        deadline, prompt = time.monotonic() + 30, 1
        while not _save(scheduler, healthy, f"a{prompt}", prompt):
            assert time.monotonic() < deadline, "the store never took a put after the master's restart"
            time.sleep(0.5)
            prompt += 1
        assert scheduler.get_num_new_matched_tokens(_request("c", prompt), 0)[0] == 4 * BLOCK

        # The disabled worker's first report: the scheduler claims no hit (a load would fail on
        # that rank) and plans no save, counted; nothing is reported failed.
        report = disabled.build_connector_worker_meta()
        assert report.store_disabled == {0: True}
        scheduler.update_connector_output(_reported(report))
        assert scheduler.get_num_new_matched_tokens(_request("d", prompt), 0) == (0, False)
        request = _request("e", 200)
        scheduler.on_new_request(request)
        assert scheduler.build_connector_meta(_prefill_step(request, TOKENS, TABLES)).saves == {}
        assert scheduler.counters["lookups_store_disabled"] == 1
        assert disabled.counters["store_disabled"] == 1
        assert disabled.build_connector_worker_meta() is None  # reported once

        # Before its retry time the worker does not try; then it takes the store again and says so.
        disabled.get_transfer_results(None, set())
        assert disabled.engine is None
        monkeypatch.setattr(disabled, "_store_retry_at", 0.0)
        disabled.get_transfer_results(None, set())
        assert disabled.engine is not None
        report = disabled.build_connector_worker_meta()
        assert report.store_disabled == {0: False}
        scheduler.update_connector_output(_reported(report))
        assert scheduler.get_num_new_matched_tokens(_request("f", prompt), 0)[0] == 4 * BLOCK
    finally:
        for side in (disabled, healthy, scheduler):
            if side is not None:
                side.shutdown()
        kv_vllm.drop_shared_stores()
        master.stop()


def test_the_worker_metadata_of_two_ranks_keeps_each_ranks_state():
    a = kv_vllm.KVStrideWorkerMetadata(store_disabled={0: True})
    b = kv_vllm.KVStrideWorkerMetadata(store_disabled={1: False})
    assert a.aggregate(b).store_disabled == {0: True, 1: False}
    assert worker_module.STORE_RETRY_S > 0
