"""The connector's scheduler side driven the way vLLM's scheduler drives it, without a model:
what it asks the store per step, and what it sends each TP rank (issue 16).

Needs the vLLM environment (``make test-vllm``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

import kvstride  # noqa: E402
from kvstride.stores import EmbeddedStore  # noqa: E402
from kvstride.stores.placement import StorePlacement  # noqa: E402
from kvstride.vllm.config import ConnectorConfig  # noqa: E402
from kvstride.vllm.scheduler import SchedulerSide  # noqa: E402
from kvstride.vllm.store_registry import StoreChoice  # noqa: E402

BLOCK = 16
TP = 2


class CountingStore(EmbeddedStore):
    """The embedded store, counting its existence calls."""

    def __init__(self) -> None:
        super().__init__(1 << 20, slot_bytes=4096)
        self.exists_calls = 0

    def exists(self, keys):
        self.exists_calls += 1
        return super().exists(keys)


def _config() -> ConnectorConfig:
    groups = [kvstride.GroupSpec("full_attention", BLOCK, num_kv_heads=4)]
    S, H = kvstride.resolve_block_sizes(groups)

    def planner(rank: int) -> kvstride.KeyPlanner:
        namespace = kvstride.Namespace("tp-test", fingerprint="00" * 8, tp_rank=rank)
        return kvstride.KeyPlanner(
            groups, hash_block_size=H, scheduler_block_size=S, namespace=namespace, tp_size=TP, tp_rank=rank
        )

    planners = [planner(rank) for rank in range(TP)]
    return ConnectorConfig(
        {"store": "mooncake"}, groups, "00" * 8, planners[0], planners, 0, None, StoreChoice("mooncake", TP), TP
    )


def _prefill_step(request, tokens: int, block_ids):
    block_state = SimpleNamespace(get_block_ids=lambda rid: (block_ids,), boundary_state_offloads={})
    new = SimpleNamespace(req_id=request.request_id, num_computed_tokens=0)
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]),
        num_scheduled_tokens={request.request_id: tokens},
        kv_connector_block_state=block_state,
        preempted_req_ids=set(),
        finished_req_ids=set(),
    )


def test_a_step_asks_the_store_once_for_every_ranks_saves():
    """With TP=2 on a shared store the scheduler plans both ranks' keys (they differ: each rank
    keys its own heads) and asks the store what it has in one call for the step, not one per
    rank; each rank is sent its own keys."""
    store = CountingStore()
    side = SchedulerSide(_config(), StorePlacement(store))
    try:
        tokens = 8 * BLOCK
        hashes = [hashlib.sha256(bytes([i])).digest() for i in range(tokens // BLOCK)]
        request = SimpleNamespace(request_id="r", block_hashes=hashes, num_tokens=tokens)
        side.on_new_request(request)
        meta = side.build_connector_meta(_prefill_step(request, tokens, list(range(1, 9))))
        assert store.exists_calls == 1
        ((job, by_rank),) = meta.saves.items()
        assert sorted(by_rank) == [0, 1]
        keys = [{key for key, _, _ in by_rank[rank]} for rank in range(TP)]
        assert len(keys[0]) == len(keys[1]) == 8 and not keys[0] & keys[1]
    finally:
        side.shutdown()
        store.close()
