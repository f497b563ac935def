"""kvstride.vllm.stats through vLLM 0.32's own stats path: engine counters to per-step deltas,
pickled like worker outputs, summed by ``KVOutputAggregator`` and with the scheduler's,
msgpack-encoded in ``SchedulerStats`` like engine-core outputs, then logged by
``KVConnectorLogging`` and recorded by ``KVConnectorProm`` into the real prometheus_client
registry. Skipped where vLLM is not installed."""

from __future__ import annotations

import collections
import copy
import pickle

import pytest

vllm = pytest.importorskip("vllm")

from prometheus_client import REGISTRY  # noqa: E402
from vllm.config import KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.v1.engine import EngineCoreOutputs  # noqa: E402
from vllm.v1.metrics.prometheus import unregister_vllm_metrics  # noqa: E402
from vllm.v1.metrics.stats import SchedulerStats  # noqa: E402
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, KVConnectorOutput  # noqa: E402
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder  # noqa: E402

from kvstride.engine import LoadRequest, SaveRequest  # noqa: E402
from kvstride.vllm import KVStrideConnector  # noqa: E402
from kvstride.vllm.stats import KVStridePromMetrics, KVStrideStats, stats_delta  # noqa: E402
from test_engine import Rig  # noqa: E402


LABELNAMES = ["model_name", "engine"]  # what PrometheusStatLogger passes
ENGINES = {0: ["m", "0"], 1: ["m", "1"]}


@pytest.fixture
def vllm_config():
    return VllmConfig(
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVStrideConnector", kv_connector_module_path="kvstride.vllm", kv_role="kv_both"
        )
    )


@pytest.fixture
def prom(vllm_config):
    """vLLM's KVConnectorProm (its own metric types, the default registry), unregistered
    around the test the way vLLM's stat logger does it."""
    unregister_vllm_metrics()
    yield KVConnectorProm(vllm_config, LABELNAMES, ENGINES)
    unregister_vllm_metrics()


def sample(series, engine="0", **labels):
    return REGISTRY.get_sample_value(series, {"model_name": "m", "engine": engine, **labels})


# ---- deltas of the engine's counters -------------------------------------------------------


def engine_totals():
    counters = collections.Counter(
        lookups=2, lookup_hit_tokens=32, lookup_tokens=64, lookup_keys=9, lookup_errors=1,
        bytes_loaded=4096, bytes_stored=8192, get_ok=5, put_ok=7, put_skipped_present=3,
        get_missing=1, get_corrupt=2, put_full=4, loads_ok=1, loads_failed=1, saves_ok=2,
        saves_failed=1, saves_deferred=2, load_job_errors=1, tail_ok=4, worker_errors=1,
    )  # fmt: skip
    seconds = collections.Counter(get=0.5, put=0.25, lookup=0.125, load_job=0.75, save_stage=0.375)
    return counters, seconds


def test_delta_names_the_engine_counters_it_exports():
    counters, seconds = engine_totals()
    stats = stats_delta(counters, seconds, {})
    assert stats.data == {
        "lookups": 2, "lookup_hit_tokens": 32, "lookup_tokens": 64,
        "bytes_loaded": 4096, "bytes_stored": 8192, "puts_skipped_present": 3, "saves_deferred": 2,
        "load_seconds": 0.5, "save_seconds": 0.25,
        "failed:get_missing": 1, "failed:get_corrupt": 2, "failed:put_full": 4,
        "failed:loads_failed": 1, "failed:saves_failed": 1, "failed:load_job_errors": 1,
        "failed:lookup_errors": 1,
    }  # fmt: skip


def test_delta_is_what_changed_since_the_last_call():
    counters, seconds = engine_totals()
    last = {}
    stats_delta(counters, seconds, last)
    assert stats_delta(counters, seconds, last) is None
    counters.update(lookups=3, get_missing=2, get_ok=10, tail_ok=1)
    seconds.update(put=0.5, lookup=1.0)
    assert stats_delta(counters, seconds, last).data == {"lookups": 3, "failed:get_missing": 2, "save_seconds": 0.5}
    assert last["lookups"] == 5 and last["failed:get_missing"] == 3 and last["save_seconds"] == 0.75
    assert stats_delta(counters, seconds, last) is None


def test_delta_after_counters_restart_is_the_new_total():
    counters, seconds = engine_totals()
    last = {}
    stats_delta(counters, seconds, last)
    fresh = collections.Counter(lookups=1, bytes_stored=256)  # a new engine: counters from 0
    assert stats_delta(fresh, collections.Counter(), last).data == {"lookups": 1, "bytes_stored": 256}


def test_delta_of_a_real_engine():
    """The counter names the engine really uses: a save, a save of blocks already stored, a
    lookup, a load, and a load of blocks never stored."""
    rig = Rig("fa")
    try:
        last = {}
        n = 100
        _, hashes, tables, _ = rig.source_request(n)
        rig.run(saves=[SaveRequest("r", hashes, tables, n)])
        blocks = len(rig.store.keys())
        block_bytes = rig.transfer.layout.block_bytes(0)
        saved = stats_delta(rig.engine.counters, rig.engine.seconds, last).data
        assert saved.keys() == {"bytes_stored", "save_seconds"} and saved["bytes_stored"] == blocks * block_bytes

        rig.run(saves=[SaveRequest("twin", hashes, tables, n)])
        assert stats_delta(rig.engine.counters, rig.engine.seconds, last).data == {"puts_skipped_present": blocks}

        hit = rig.engine.lookup([("q", hashes, n)])["q"]
        rig.run(loads=[LoadRequest("q", hashes, rig.destination(n), hit)])
        loaded = stats_delta(rig.engine.counters, rig.engine.seconds, last).data
        assert loaded["lookups"] == 1 and loaded["lookup_tokens"] == n and loaded["lookup_hit_tokens"] == hit
        assert loaded["bytes_loaded"] == blocks * block_bytes and loaded["load_seconds"] > 0

        _, other, _, _ = rig.source_request(32)
        rig.run(loads=[LoadRequest("never-saved", other, rig.destination(32), 32)])
        failed = stats_delta(rig.engine.counters, rig.engine.seconds, last).data
        assert failed.keys() == {"failed:get_missing", "failed:loads_failed", "load_seconds"}
        assert failed["failed:get_missing"] == 2 and failed["failed:loads_failed"] == 1
    finally:
        rig.close()


# ---- KVStrideStats ---------------------------------------------------------------------------


def test_aggregate_sums_into_a_new_object():
    a = KVStrideStats(data={"lookups": 1, "load_seconds": 0.5, "failed:get_missing": 2})
    b = KVStrideStats(data={"lookups": 2, "bytes_stored": 256, "failed:put_full": 1})
    summed = a.aggregate(b)
    assert summed.data == {
        "lookups": 3, "load_seconds": 0.5, "bytes_stored": 256, "failed:get_missing": 2, "failed:put_full": 1,
    }  # fmt: skip
    assert a.data == {"lookups": 1, "load_seconds": 0.5, "failed:get_missing": 2}
    assert b.data == {"lookups": 2, "bytes_stored": 256, "failed:put_full": 1}
    assert a.aggregate(KVStrideStats()).data == a.data


def test_empty_and_reset():
    assert KVStrideStats().is_empty()
    assert KVStrideStats(data={"lookups": 0, "load_seconds": 0.0}).is_empty()
    stats = KVStrideStats(data={"failed:get_missing": 1})
    assert not stats.is_empty()
    stats.reset()
    assert stats.is_empty() and stats.data == {}


def test_reduce_is_a_stable_flat_summary():
    stats = KVStrideStats(
        data={"lookups": 4, "lookup_hit_tokens": 48, "lookup_tokens": 64, "load_seconds": 0.01234,
              "failed:put_full": 1, "failed:get_corrupt": 2}
    )  # fmt: skip
    assert list(stats.reduce().items()) == [
        ("lookups", 4), ("lookup_hit_tokens", 48), ("lookup_tokens", 64),
        ("bytes_loaded", 0), ("bytes_stored", 0), ("puts_skipped_present", 0), ("saves_deferred", 0),
        ("lookup_hit_rate", 0.75),
        ("load_seconds", 0.012), ("save_seconds", 0.0),
        ("failed:get_corrupt", 2), ("failed:put_full", 1),
    ]  # fmt: skip
    assert "lookup_hit_rate" not in KVStrideStats(data={"bytes_stored": 1}).reduce()


def test_serialization_round_trips():
    """Pickle (worker outputs to the engine core) and vLLM's msgpack of engine-core outputs
    (the payload in SchedulerStats, to the front end)."""
    counters, seconds = engine_totals()
    stats = stats_delta(counters, seconds, {})
    assert pickle.loads(pickle.dumps(stats)) == stats
    outputs = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict()))
    decoded = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs))
    assert KVStrideConnector.build_kv_connector_stats(decoded.scheduler_stats.kv_connector_stats) == stats


# ---- Prometheus ------------------------------------------------------------------------------


def test_prom_metrics_count_per_engine_and_outcome(prom):
    assert isinstance(prom.prom_metrics, KVStridePromMetrics)
    prom.observe({"lookups": 2, "lookup_hit_tokens": 32, "lookup_tokens": 64, "bytes_loaded": 4096,
                  "bytes_stored": 8192, "load_seconds": 0.5, "save_seconds": 0.25,
                  "puts_skipped_present": 3, "failed:get_missing": 1, "failed:loads_failed": 1})  # fmt: skip
    prom.observe({"lookups": 1, "bytes_loaded": 1024, "failed:get_missing": 2}, engine_idx=0)
    prom.observe({"lookups": 5, "failed:put_full": 1}, engine_idx=1)
    assert sample("vllm:kvstride_lookups_total") == 3
    assert sample("vllm:kvstride_lookup_hit_tokens_total") == 32
    assert sample("vllm:kvstride_lookup_tokens_total") == 64
    assert sample("vllm:kvstride_bytes_loaded_total") == 5120
    assert sample("vllm:kvstride_bytes_stored_total") == 8192
    assert sample("vllm:kvstride_load_seconds_total") == 0.5
    assert sample("vllm:kvstride_save_seconds_total") == 0.25
    assert sample("vllm:kvstride_puts_skipped_present_total") == 3
    assert sample("vllm:kvstride_failures_total", outcome="get_missing") == 3
    assert sample("vllm:kvstride_failures_total", outcome="loads_failed") == 1
    assert sample("vllm:kvstride_lookups_total", engine="1") == 5
    assert sample("vllm:kvstride_bytes_loaded_total", engine="1") == 0
    assert sample("vllm:kvstride_failures_total", engine="1", outcome="put_full") == 1
    assert sample("vllm:kvstride_failures_total", engine="1", outcome="get_missing") is None


def test_every_known_failure_outcome_is_exported_as_zero_from_the_start(prom):
    """An alert on a failure's rate needs its series before the first failure: every outcome
    kvstride counts by name is there at 0 for each engine."""
    from kvstride.vllm.stats import FAILURE_COUNTERS

    for engine in ("0", "1"):
        for outcome in FAILURE_COUNTERS:
            assert sample("vllm:kvstride_failures_total", engine=engine, outcome=outcome) == 0, (engine, outcome)


def test_prom_metrics_take_a_reduced_summary_too(prom):
    prom.observe(KVStrideStats(data={"lookups": 2, "lookup_hit_tokens": 1, "lookup_tokens": 2}).reduce())
    assert sample("vllm:kvstride_lookups_total") == 2
    assert sample("vllm:kvstride_failures_total", outcome="get_missing") is None


def test_prom_metrics_register_again_after_vllm_unregisters(prom, vllm_config):
    """A second engine in the process: vLLM's stat logger unregisters "vllm:" series first."""
    unregister_vllm_metrics()
    again = KVConnectorProm(vllm_config, LABELNAMES, ENGINES)
    again.observe({"lookups": 1})
    assert sample("vllm:kvstride_lookups_total") == 1


# ---- the whole path --------------------------------------------------------------------------


def test_worker_and_scheduler_stats_reach_the_log_line_and_prometheus(prom, vllm_config):
    ranks = [engine_totals(), engine_totals()]  # two workers (TP ranks), the same counts each
    scheduler_counters = collections.Counter(lookups=3, lookup_hit_tokens=16, lookup_tokens=48)
    for counters, _ in ranks:
        del counters["lookups"], counters["lookup_hit_tokens"], counters["lookup_tokens"]
    worker_last = [{}, {}]
    scheduler_last = {}
    logging = KVConnectorLogging(vllm_config.kv_transfer_config)
    for step in range(2):
        worker_outputs = []
        for (counters, seconds), last in zip(ranks, worker_last):
            output = copy.copy(EMPTY_MODEL_RUNNER_OUTPUT)
            output.kv_connector_output = KVConnectorOutput(kv_connector_stats=stats_delta(counters, seconds, last))
            worker_outputs.append(pickle.loads(pickle.dumps(output)))
        aggregated = KVOutputAggregator(expected_finished_count=2).aggregate(worker_outputs)
        # Scheduler.update_from_output: the workers' sum, summed with the scheduler's own.
        stats = aggregated.kv_connector_output.kv_connector_stats
        scheduler_stats = stats_delta(scheduler_counters, collections.Counter(), scheduler_last)
        if scheduler_stats is not None:
            stats = stats.aggregate(scheduler_stats) if stats is not None else scheduler_stats
        if stats is None:
            assert step == 1  # nothing counted since the first step
            continue
        payload = EngineCoreOutputs(scheduler_stats=SchedulerStats(kv_connector_stats=stats.to_dict()))
        received = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(payload)).scheduler_stats
        logging.observe(received.kv_connector_stats)
        prom.observe(received.kv_connector_stats, 0)
    lines = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == [
        "KV Transfer metrics: lookups=3, lookup_hit_tokens=16, lookup_tokens=48, bytes_loaded=8192, "
        "bytes_stored=16384, puts_skipped_present=6, saves_deferred=4, lookup_hit_rate=0.333, load_seconds=1.0, "
        "save_seconds=0.5, "
        "failed:get_corrupt=4, failed:get_missing=2, failed:load_job_errors=2, failed:loads_failed=2, "
        "failed:lookup_errors=2, failed:put_full=8, failed:saves_failed=2"
    ]
    assert sample("vllm:kvstride_lookups_total") == 3
    assert sample("vllm:kvstride_bytes_stored_total") == 16384
    assert sample("vllm:kvstride_saves_deferred_total") == 4
    assert sample("vllm:kvstride_load_seconds_total") == 1.0
    assert sample("vllm:kvstride_failures_total", outcome="put_full") == 8
