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
