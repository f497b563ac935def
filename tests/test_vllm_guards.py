"""Nothing raises into vLLM's step, and no completion is lost (issue "Save-side lifetimes",
item 4): each method vLLM calls on the connector, driven into a failure, logs, counts and turns
it into a miss or a recompute. The connectors are those of a real in-process engine (or new
ones built from its configuration).

Needs the vLLM environment (``make test-vllm``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import os
import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm")

from vllm import LLM  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

import kvstride.vllm as kv_vllm  # noqa: E402
import vllm_harness as harness  # noqa: E402
from kvstride.engine import Finished, OffloadEngine  # noqa: E402
from kvstride.stores.placement import EVERY_RANK  # noqa: E402


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A llama engine with the connector on the embedded store, after one request."""
    path = harness.MODELS["llama"].build(tmp_path_factory.mktemp("guards") / "llama")
    llm = LLM(**harness.engine_kwargs(harness.MODELS["llama"], path, connector={"store": "embedded", "store_bytes": 16 << 20}))
    harness.generate(llm, harness.prompts()[0])
    yield llm
    harness.close(llm)


def _connectors(llm):
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

    return llm.llm_engine.engine_core.engine_core.scheduler.connector.side, get_kv_transfer_group().side


class _Output:
    """A connector output whose worker metadata is malformed (what a bug on a worker sends)."""

    finished_recving = ()
    failed_recving = ()
    kv_connector_worker_meta = kv_vllm.KVStrideWorkerMetadata(saves={10**9: None}, corrupt=[])


def test_update_connector_output_never_raises(engine):
    sched, _ = _connectors(engine)
    sched.update_connector_output(_Output())
    assert sched.counters["scheduler_errors"] == 1


def test_stats_never_raise(engine, monkeypatch):
    _, worker = _connectors(engine)
    monkeypatch.setattr(worker, "_stats_last", None)  # stats_delta cannot record its totals
    assert worker.get_kv_connector_stats() is None


def _fresh_worker(engine):
    """A worker-side connector of the engine's configuration, on the engine's KV caches (its
    own arena)."""
    _, worker = _connectors(engine)
    fresh = kv_vllm.KVStrideConnector(worker._vllm_config, KVConnectorRole.WORKER, worker._kv_cache_config)
    fresh.side.engine = OffloadEngine(fresh.side.planner, worker.engine.layout, fresh.side.store, name="test-fresh")
    return fresh


def test_load_after_shutdown_is_recomputed(engine):
    """vLLM may still hand a step to a connector that shut down: its loads come back failed."""
    fresh = _fresh_worker(engine)
    fresh.shutdown()
    fresh.bind_connector_metadata(kv_vllm.KVStrideMetadata(loads={"late": {EVERY_RANK: [(0, 0, 1)]}}))
    fresh.start_load_kv(None)
    results = fresh.get_transfer_results(set())
    fresh.clear_connector_metadata()
    assert "late" in results.finished_recving and "late" in results.failed_recving


class _Engine:
    """An engine whose completions are taken once (``get_finished`` swaps them out)."""

    def __init__(self) -> None:
        self.finished = Finished(loads_done={"r"}, loads_failed={"r": {(0, 5)}})

    def get_finished(self) -> Finished:
        finished, self.finished = self.finished, Finished()
        return finished

    def finish_request(self, req_id) -> None:
        pass


def test_completions_survive_an_error(engine, monkeypatch):
    """A failed load taken from the engine reaches vLLM as failed even when a later part of
    ``get_finished`` raises: never as a load that succeeded, never lost."""
    fresh = _fresh_worker(engine)
    real_engine, fresh.side.engine = fresh.side.engine, _Engine()

    def broken_take_corrupt():
        raise RuntimeError("a bug after the engine's completions were taken")

    monkeypatch.setattr(fresh.side.store, "take_corrupt", broken_take_corrupt)
    results = fresh.get_transfer_results(set())
    assert "r" in results.finished_recving and "r" in results.failed_recving, results
    fresh.side.engine = real_engine
    fresh.shutdown()


def test_a_step_without_saves_ends_the_save_lanes_linger(engine, monkeypatch):
    """A step whose metadata carries no saves (vLLM idle-stepping while finished requests wait
    for their saves, or decoding without a new block) tells the engine to put what its save
    lane lingers over (``flush_puts``); a step with saves does not."""
    fresh = _fresh_worker(engine)
    try:
        flushes = []
        monkeypatch.setattr(fresh.side.engine, "flush_puts", lambda: flushes.append(1))
        fresh.bind_connector_metadata(kv_vllm.KVStrideMetadata())
        fresh.wait_for_save()
        fresh.clear_connector_metadata()
        assert flushes == [1]
        fresh.bind_connector_metadata(kv_vllm.KVStrideMetadata(saves={7: {EVERY_RANK: []}}))
        fresh.wait_for_save()
        fresh.clear_connector_metadata()
        assert flushes == [1]
    finally:
        fresh.shutdown()
