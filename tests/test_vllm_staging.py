"""The connector's default staging pool on a real Mooncake master: room for the save lane to
trail the steps (``kvstride.vllm.store_registry.STEPS_STAGED``).

Needs the vLLM environment (``make test-vllm``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from kvstride.engine import OffloadEngine, SaveRequest  # noqa: E402
from kvstride.vllm.store_registry import STEPS_STAGED, engine_transfer  # noqa: E402
from mooncake_fixture import mooncake_master, mooncake_store  # noqa: E402,F401
from test_staging_mooncake import BLOCK, rig  # noqa: E402,F401


def test_the_connectors_default_pool_lets_the_save_lane_trail_the_steps(rig):
    """The connector's default staging pool (``engine_transfer`` without ``staging_bytes``)
    holds ``STEPS_STAGED`` steps of saves: while the store holds each put 0.3 s, six one-block
    steps stage at once. None finds the pool full (with ``save_wait_s`` 0 such a step would be
    deferred at once: with room for one step, the fourth was), and all are stored."""
    assert STEPS_STAGED >= 6
    engine = OffloadEngine(rig.planner, engine_transfer(rig.store, rig.layout, {}, BLOCK, rig.planner), rig.store,
                           save_wait_s=0.0)
    try:
        rig.store.delay = 0.3
        steps = [rig.request(1) for _ in range(6)]
        for i, (hashes, table) in enumerate(steps):
            engine.submit(saves=[SaveRequest(f"r{i}", hashes, [table], BLOCK)])
        assert engine.wait_idle(30)
        c = engine.counters
        assert not c["saves_deferred"] and c["saves_ok"] == len(steps) and not c["save_job_errors"], c
        rig.store.delay = 0.0
        for hashes, _ in steps:
            assert engine.lookup([("q", hashes, BLOCK + 1)])["q"] == BLOCK
    finally:
        engine.shutdown()


def test_the_default_pool_is_capped_and_logged(rig, monkeypatch):
    """Eight steps of a large prefill would pin many GiB on every rank: the default stops at
    STAGING_CAP_BYTES (here shrunk to a few blocks' worth, so the test pins little), larger steps
    stream through it, and the size chosen is logged."""
    import logging

    from kvstride.vllm import store_registry

    uncapped = engine_transfer(rig.store, rig.layout, {}, 64 * BLOCK, rig.planner).pool.capacity
    monkeypatch.setattr(store_registry, "STAGING_CAP_BYTES", uncapped // 16)
    messages = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("kvstride.vllm")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        transfer = engine_transfer(rig.store, rig.layout, {}, 64 * BLOCK, rig.planner)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert transfer.pool.capacity <= uncapped // 16 + (1 << 20)
    assert any("staging pool" in m and "capped" in m for m in messages), messages
    engine = OffloadEngine(rig.planner, transfer, rig.store)
    try:  # a prefill larger than the pool still saves, batch by batch
        hashes, table = rig.request(32)
        engine.submit(saves=[SaveRequest("big", hashes, [table], 32 * BLOCK)])
        assert engine.wait_idle(60)
        assert engine.counters["saves_ok"] == 1 and not engine.counters["saves_deferred"], engine.counters
    finally:
        engine.shutdown()
