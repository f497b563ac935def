"""The connector's scheduler side driven the way vLLM's scheduler drives it, without a model:
what it asks the store per step, and what it sends each TP rank (issue 16).

Needs the vLLM environment (``make test-vllm``); skipped where vLLM is not installed.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

import kvstride  # noqa: E402
from kvstride.engine import LINGER_MAX_STEPS  # noqa: E402
from kvstride.stores import EmbeddedStore, Status  # noqa: E402
from kvstride.stores.placement import StorePlacement  # noqa: E402
from kvstride.vllm.config import ConnectorConfig, check_admission  # noqa: E402
from kvstride.vllm.metadata import KVStrideWorkerMetadata  # noqa: E402
from kvstride.vllm.scheduler import ABANDON_AFTER_STEPS, SchedulerSide  # noqa: E402
from kvstride.vllm.store_registry import StoreChoice  # noqa: E402
from test_vllm_checks import warnings_seen  # noqa: E402,F401  (the fixture: kvstride's warnings)

BLOCK = 16
TP = 2


class CountingStore(EmbeddedStore):
    """The embedded store, counting its existence calls; it holds ``present`` (what other
    engines wrote) and nothing else."""

    def __init__(self) -> None:
        super().__init__(1 << 20, slot_bytes=4096)
        self.exists_calls = 0
        self.present: set = set()

    def exists(self, keys):
        self.exists_calls += 1
        return [key in self.present for key in keys]


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


def _prefill_step(request, tokens: int, tables):
    """One step computing ``tokens`` of a new request; ``tables``: its block ids per group."""
    block_state = SimpleNamespace(get_block_ids=lambda rid: tuple(tables), boundary_state_offloads={})
    new = SimpleNamespace(req_id=request.request_id, num_computed_tokens=0, block_ids=tuple(tables))
    return SimpleNamespace(
        scheduled_new_reqs=[new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[]),
        num_scheduled_tokens={request.request_id: tokens},
        kv_connector_block_state=block_state,
        preempted_req_ids=set(),
        finished_req_ids=set(),
    )


def _report(side, job_ids, ok: int = TP) -> None:
    """Every rank wrote ``job_ids``, as vLLM hands the workers' metadata back."""
    reports = {job: [ok, 0, 0] for job in job_ids}
    side.update_connector_output(SimpleNamespace(
        finished_recving=set(), failed_recving=set(), kv_connector_worker_meta=KVStrideWorkerMetadata(reports, []),
    ))


def test_saves_do_not_ask_a_shared_store_and_skip_what_lookups_found_or_this_engine_wrote():
    """With TP=2 on a shared store the scheduler plans both ranks' keys (they differ: each rank
    keys its own heads). A step's saves ask the store nothing (a round trip every step): a key
    is skipped where the request's lookup found it (a lookup asks every rank's keys), or where
    this engine wrote it after that lookup; every other key is put, on each rank its own."""
    store = CountingStore()
    side = SchedulerSide(_config(), StorePlacement(store))
    try:
        tokens = 8 * BLOCK
        hashes = [hashlib.sha256(bytes([i])).digest() for i in range(tokens // BLOCK)]
        table = [list(range(1, 9))]

        def request(rid):
            return SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=tokens, num_prompt_tokens=tokens)

        rank0, rank1 = (
            [key for key, _, _ in planner.plan_save(hashes, table, tokens, saved_offset=0).puts]
            for planner in side.rank_planners
        )
        # Another engine wrote blocks 4 and 5 of rank 0 and block 4 of rank 1 (not 0..3: a
        # miss, nothing is loaded).
        store.present = set(rank0[4:6] + rank1[4:5])
        first, second = request("first"), request("second")
        for r in (first, second):
            side.on_new_request(r)
        assert side.get_num_new_matched_tokens(first, 0) == (0, False)
        assert side.get_num_new_matched_tokens(second, 0) == (0, False)
        assert store.exists_calls == 1  # one lookup for both

        meta = side.build_connector_meta(_prefill_step(first, tokens, table))
        assert store.exists_calls == 1  # the saves asked nothing
        ((job, by_rank),) = meta.saves.items()
        assert sorted(by_rank) == [0, 1]
        # Block ids are the table's: block 4 is id 5.
        expected = [[1, 2, 3, 4, 7, 8], [1, 2, 3, 4, 6, 7, 8]]
        assert [sorted(block for _, _, block in by_rank[rank]) for rank in range(TP)] == expected
        keys = [{key for key, _, _ in by_rank[rank]} for rank in range(TP)]
        assert keys == [set(rank0[:4] + rank0[6:]), set(rank1[:4] + rank1[5:])]
        _report(side, [job])

        # Looked up before "first"'s job was reported: what it wrote is not put again.
        meta = side.build_connector_meta(_prefill_step(second, tokens, table))
        assert meta.saves == {} and store.exists_calls == 1

        # A lookup after the write that does not find it (evicted since): put again.
        third = request("third")
        side.on_new_request(third)
        assert side.get_num_new_matched_tokens(third, 0) == (0, False)
        meta = side.build_connector_meta(_prefill_step(third, tokens, table))
        ((job, by_rank),) = meta.saves.items()
        assert [sorted(block for _, _, block in by_rank[rank]) for rank in range(TP)] == expected
    finally:
        side.shutdown()
        store.close()


WINDOW = 32  # tokens: two 16-token blocks


def _window_config(admission: str, retention_interval) -> ConnectorConfig:
    groups = [kvstride.GroupSpec("full_attention", BLOCK), kvstride.GroupSpec("sliding_window", BLOCK, window=WINDOW)]
    S, H = kvstride.resolve_block_sizes(groups)
    planner = kvstride.KeyPlanner(
        groups, hash_block_size=H, scheduler_block_size=S, namespace=kvstride.Namespace("admission", fingerprint="00" * 8)
    )
    return ConnectorConfig(
        {"store": "mooncake"}, groups, "00" * 8, planner, [planner], 0, None, StoreChoice("mooncake", 1), 1,
        admission=admission, retention_interval=retention_interval,
    )


def _window_blocks_saved(side, request, tables) -> list:
    """The window group's block ids one prefill step of the whole prompt sends to be saved."""
    side.on_new_request(request)
    meta = side.build_connector_meta(_prefill_step(request, request.num_tokens, tables))
    entries = [entry for by_rank in meta.saves.values() for entry in by_rank.get(0, ())]
    side.request_finished_all_groups(request, ())
    return sorted(block for _, group, block in entries if group == 1)


def _hashes(blocks: int, salt: bytes) -> list:
    return [hashlib.sha256(salt + bytes([i])).digest() for i in range(blocks)]


@pytest.mark.parametrize("admission, retention, first, second", [
    # vLLM's default retention (0): the prompt's ends (112 and 128 of 128 tokens) need window
    # blocks 5-7; the second prompt shares 64 tokens, a junction seen before: blocks 2-3 too.
    ("kvstride", 0, [16, 17, 18], [23, 24, 26, 27, 28]),
    # Periodic checkpoints every 64 tokens add the tail of 64 to the first prompt's.
    ("kvstride", 64, [13, 14, 16, 17, 18], [23, 24, 26, 27, 28]),
    # Dense retention (None), or the dense policy: every window block.
    ("kvstride", None, list(range(11, 19)), list(range(21, 29))),
    ("dense", 0, list(range(11, 19)), list(range(21, 29))),
])
def test_window_blocks_are_saved_only_where_a_lookup_can_hit(admission, retention, first, second):
    """SEMANTICS §8 in the scheduler: a window group's blocks are sent to be saved only for the
    window tails of the prompt's ends, vLLM's periodic checkpoints and a junction with a prefix
    seen before; under dense retention or ``admission="dense"``, all of them."""
    store = CountingStore()
    side = SchedulerSide(_window_config(admission, retention), StorePlacement(store))
    try:
        tokens = 8 * BLOCK
        one = _hashes(8, b"one")
        two = one[:4] + _hashes(4, b"two")
        r1 = SimpleNamespace(request_id="r1", block_hashes=one, num_tokens=tokens, num_prompt_tokens=tokens)
        r2 = SimpleNamespace(request_id="r2", block_hashes=two, num_tokens=tokens, num_prompt_tokens=tokens)
        assert _window_blocks_saved(side, r1, [list(range(1, 9)), list(range(11, 19))]) == first
        # No worker confirmed r1's job, so the store has none of its keys: r2 plans its own.
        assert _window_blocks_saved(side, r2, [list(range(1, 9)), list(range(21, 29))]) == second
    finally:
        side.shutdown()
        store.close()


def test_a_lingering_save_lane_reports_long_before_the_scheduler_abandons_its_job():
    """The workers' save lane lingers for at most ``LINGER_MAX_STEPS`` steps, and the
    scheduler waits ``ABANDON_AFTER_STEPS`` for a save job's report: a linger must not make a
    job look lost (it would be planned again, and its window blocks could be gone)."""
    assert LINGER_MAX_STEPS * 2 <= ABANDON_AFTER_STEPS


@pytest.mark.parametrize("value", ["lru", "", None, 1])
def test_unknown_admission_is_refused_at_construction(value):
    """``admission`` other than kvstride or dense is a ValueError naming the key and the choices."""
    with pytest.raises(ValueError, match=r"admission.*kvstride, dense"):
        check_admission(value)


def _step(request, computed: int, tokens: int, tables):
    """One step computing ``tokens`` more of ``request`` (new when ``computed`` is 0)."""
    step = _prefill_step(request, tokens, tables)
    if computed:
        step.scheduled_new_reqs = []
        step.scheduled_cached_reqs = SimpleNamespace(req_ids=[request.request_id], num_computed_tokens=[computed],
                                                     new_block_ids=[None])
    return step


def _saved_block_by_block(side, request, tables) -> None:
    """The request's prefill, one block per step, each save reported written by the worker."""
    side.on_new_request(request)
    for computed in range(0, request.num_tokens, BLOCK):
        meta = side.build_connector_meta(_step(request, computed, BLOCK, tables))
        _report(side, meta.saves, ok=1)
    side.request_finished_all_groups(request, ())


def _embedded_side(groups, slots: int, name: str, **config):
    """A scheduler side planning ``groups`` into an embedded arena of ``slots`` slots:
    (planner, placement, side)."""
    from kvstride.arena import ArenaPlacement

    S, H = kvstride.resolve_block_sizes(groups)
    planner = kvstride.KeyPlanner(
        groups, hash_block_size=H, scheduler_block_size=S, namespace=kvstride.Namespace(name, fingerprint="00" * 8)
    )
    connector = ConnectorConfig(
        {"store": "embedded"}, groups, "00" * 8, planner, [planner], 0, None, StoreChoice("embedded", 1, slots), 1,
        **config,
    )
    placement = ArenaPlacement(slots)
    return planner, placement, SchedulerSide(connector, placement)


def test_the_embedded_store_evicts_a_prefix_from_its_deepest_block():
    """Six arena slots, two 4-block prompts saved a block per step: the second evicts two of
    the first's blocks. Its deepest go (a block past a missing one serves no hit), so the first
    prompt still hits its first 2 blocks; evicting least recently written first would take
    its head and leave it nothing."""
    _, placement, side = _embedded_side([kvstride.GroupSpec("full_attention", BLOCK)], 6, "evict")
    try:
        tokens = 4 * BLOCK
        first, second = _hashes(4, b"first"), _hashes(4, b"second")
        a = SimpleNamespace(request_id="a", block_hashes=first, num_tokens=tokens, num_prompt_tokens=tokens)
        b = SimpleNamespace(request_id="b", block_hashes=second, num_tokens=tokens, num_prompt_tokens=tokens)
        _saved_block_by_block(side, a, [list(range(1, 5))])
        _saved_block_by_block(side, b, [list(range(5, 9))])
        assert placement.index.evictions == 2 and len(placement.index) == 6
        again = SimpleNamespace(request_id="a2", block_hashes=first, num_tokens=tokens + 1, num_prompt_tokens=tokens + 1)
        side.on_new_request(again)
        assert side.get_num_new_matched_tokens(again, 0) == (2 * BLOCK, True)
    finally:
        side.shutdown()


def test_the_embedded_store_keeps_the_prompt_whose_hit_saves_more_per_slot():
    """A window tail costs a hit the same slots at any length, so a long prompt's hit saves
    more prefill per slot than a short one's. When a third prompt needs room, the short prompt
    saved after the long one goes first, and the long prompt's next turn hits all of it; by
    recency alone the long prompt's deepest blocks would go, and the turn would hit less."""
    groups = [kvstride.GroupSpec("full_attention", BLOCK), kvstride.GroupSpec("sliding_window", BLOCK, window=WINDOW)]
    _, placement, side = _embedded_side(groups, 17, "worth", admission="kvstride", retention_interval=0)
    try:
        prompts = {"long": 8, "short": 2, "third": 2}
        for n, (rid, blocks) in enumerate(prompts.items()):
            tokens = blocks * BLOCK
            request = SimpleNamespace(request_id=rid, block_hashes=_hashes(blocks, rid.encode()), num_tokens=tokens,
                                      num_prompt_tokens=tokens)
            side.on_new_request(request)
            tables = [list(range(100 * n + 1, 100 * n + blocks + 1)), list(range(100 * n + 51, 100 * n + blocks + 51))]
            _report(side, side.build_connector_meta(_prefill_step(request, tokens, tables)).saves, ok=1)
            side.request_finished_all_groups(request, ())
        assert placement.index.evictions > 0
        turn = 10 * BLOCK
        next_turn = SimpleNamespace(request_id="next", block_hashes=_hashes(8, b"long") + _hashes(2, b"next"),
                                    num_tokens=turn, num_prompt_tokens=turn)
        side.on_new_request(next_turn)
        assert side.get_num_new_matched_tokens(next_turn, 0) == (8 * BLOCK, True)
    finally:
        side.shutdown()


def test_a_finished_requests_tail_is_ranked_with_its_request():
    """A tail saved after its request finished (vLLM's partial-tail hand-off) takes the
    request's stamp and worth: it is the deepest key of a long prompt, evicted first of it, but
    after a shorter prompt's keys, as the rest of the long prompt is; its rank is dropped once
    the tail is planned."""
    groups = [kvstride.GroupSpec("full_attention", BLOCK), kvstride.GroupSpec("mamba", BLOCK, mamba_mode="align")]
    planner, placement, side = _embedded_side(groups, 64, "tail")
    try:
        long_prompt = SimpleNamespace(request_id="long", block_hashes=_hashes(8, b"long"), num_tokens=8 * BLOCK + 5,
                                      num_prompt_tokens=8 * BLOCK + 5)
        side.on_new_request(long_prompt)
        tables = [list(range(1, 10)), [40]]
        _report(side, side.build_connector_meta(_prefill_step(long_prompt, 7 * BLOCK, tables)).saves, ok=1)
        assert side.register_finished_partial_tail(long_prompt, tables, [(1, 41, 8 * BLOCK)])
        side.request_finished_all_groups(long_prompt, ())
        short_prompt = SimpleNamespace(request_id="short", block_hashes=_hashes(2, b"short"), num_tokens=2 * BLOCK,
                                       num_prompt_tokens=2 * BLOCK)
        side.on_new_request(short_prompt)
        step = _prefill_step(short_prompt, 2 * BLOCK, [[20, 21], [42]])
        meta = side.build_connector_meta(step)  # plans the short prompt's save and the long one's tail
        assert meta.finished_tails == ["long"]
        _report(side, meta.saves, ok=1)
        side.request_finished_all_groups(short_prompt, ())
        tail = planner.key(1, long_prompt.block_hashes[7])
        order = placement.index.keys()  # first evicted first
        short_keys = {planner.key(g, h) for g in (0, 1) for h in short_prompt.block_hashes}
        assert tail in order and order[: order.index(tail)] == [key for key in order if key in short_keys]
        assert not side._stamps and not side._worths
    finally:
        side.shutdown()


class KeyCountingStore(EmbeddedStore):
    """The embedded store, recording how many keys each existence call asked."""

    def __init__(self) -> None:
        super().__init__(1 << 20, slot_bytes=4096)
        self.asked = []

    def exists(self, keys):
        self.asked.append(len(keys))
        return super().exists(keys)


def test_a_long_queue_is_looked_up_as_many_requests_at_a_time_as_a_pass_admits():
    """Ten waiting requests, max_num_seqs 3: vLLM asks for the first, and one store call
    covers it and the next two in arrival order (the others' turn comes in later passes), not
    the whole queue in every step."""
    store = KeyCountingStore()
    config = _window_config("kvstride", 0)
    config.lookup_batch = 3
    side = SchedulerSide(config, StorePlacement(store))
    try:
        tokens = 8 * BLOCK
        queue = [
            SimpleNamespace(request_id=f"r{i}", block_hashes=_hashes(8, bytes([i])), num_tokens=tokens,
                            num_prompt_tokens=tokens)
            for i in range(10)
        ]
        for request in queue:
            side.on_new_request(request)
        per_request = len(config.planner.lookup_keys(queue[0].block_hashes, tokens))
        assert side.get_num_new_matched_tokens(queue[0], 0) == (0, False)
        assert side.get_num_new_matched_tokens(queue[2], 0) == (0, False)  # answered by the same call
        assert store.asked == [3 * per_request]
        side.get_num_new_matched_tokens(queue[5], 0)
        assert store.asked == [3 * per_request, 3 * per_request]
    finally:
        side.shutdown()
        store.close()


class KeysAsked:
    """A placement's ``exists``, recording how many keys each call asked."""

    def __init__(self, placement) -> None:
        self.inner, self.asked = placement.exists, []
        placement.exists = self

    def __call__(self, keys):
        self.asked.append(len(keys))
        return self.inner(keys)


def _queue(blocks: int, count: int, salt: bytes = b"q"):
    tokens = blocks * BLOCK
    return [SimpleNamespace(request_id=f"{salt.decode()}{i}", block_hashes=_hashes(blocks, salt + str(i).encode()),
                            num_tokens=tokens, num_prompt_tokens=tokens) for i in range(count)]


def _save_prefix(side, rid: str, hashes, tables, ok: int = 1) -> None:
    """Another request of this engine computes and saves ``hashes`` (every rank reports it)."""
    tokens = len(hashes) * BLOCK
    request = SimpleNamespace(request_id=rid, block_hashes=hashes, num_tokens=tokens, num_prompt_tokens=tokens)
    side.on_new_request(request)
    side.update_state_after_alloc(request, SimpleNamespace(get_block_ids=lambda: tables), 0)
    _report(side, side.build_connector_meta(_prefill_step(request, tokens, tables)).saves, ok=ok)


def test_a_blocked_head_asks_the_embedded_index_only_when_it_changed():
    """vLLM asks about the head of a waiting queue every step while it cannot be allocated
    (KV memory full). The head's hit stands while the arena's index is unchanged: no call
    at all, and never the queue behind it (before, every step asked about the whole queue).
    A save that makes part of the head's prompt readable moves the index: the head alone is
    asked again, and hits it."""
    _, placement, side = _embedded_side([kvstride.GroupSpec("full_attention", BLOCK)], 4096, "blocked")
    counted = KeysAsked(placement)
    try:
        queue = _queue(16, 50)
        for request in queue:
            side.on_new_request(request)
        head = queue[0]
        for _ in range(10):
            assert side.get_num_new_matched_tokens(head, 0) == (0, False)
            side.build_connector_meta(_idle_step())
        per_request = len(side.planner.lookup_keys(head.block_hashes, head.num_tokens))
        assert counted.asked == [per_request]
        _save_prefix(side, "writer", head.block_hashes[:6], [list(range(1, 7))])
        assert side.get_num_new_matched_tokens(head, 0) == (6 * BLOCK, True)
        assert counted.asked == [per_request, per_request]
    finally:
        side.shutdown()


def test_a_blocked_head_on_a_shared_store_costs_one_bounded_call_per_validity():
    """On a shared store (a round trip per call) the head's hit stands for
    REMOTE_HIT_VALIDITY_S: steps in between ask nothing; what this engine wrote since is merged
    into the hit without a call; another engine's write is seen once the validity passed. The
    first call covers the head and waiting requests behind it up to LOOKUP_BATCH_TOKENS."""
    from kvstride.vllm.lookups import LOOKUP_BATCH_TOKENS, REMOTE_HIT_VALIDITY_S

    store = KeyCountingStore()
    config = _window_config("dense", None)
    side = SchedulerSide(config, StorePlacement(store))
    now = [100.0]
    side.lookups.clock = lambda: now[0]
    try:
        blocks = 64
        queue = _queue(blocks, 300)
        for request in queue:
            side.on_new_request(request)
        head = queue[0]
        per_request = len(config.planner.lookup_keys(head.block_hashes, head.num_tokens))
        for _ in range(10):
            assert side.get_num_new_matched_tokens(head, 0) == (0, False)
            side.build_connector_meta(_idle_step())
            now[0] += REMOTE_HIT_VALIDITY_S / 20
        covered = 1 + LOOKUP_BATCH_TOKENS // (blocks * BLOCK)
        assert store.asked == [covered * per_request]
        # This engine saves the head's first 5 blocks (both groups): merged, no call.
        _save_prefix(side, "writer", head.block_hashes[:5], [list(range(1, 6)), list(range(11, 16))])
        assert side.get_num_new_matched_tokens(head, 0) == (5 * BLOCK, True)
        assert len(store.asked) == 1
        # Another engine's write shows once the answer no longer stands.
        keys = config.planner.lookup_keys(head.block_hashes, head.num_tokens)
        assert set(store.put(keys, [np.zeros(64, np.uint8) for _ in keys])) == {Status.OK}
        assert side.get_num_new_matched_tokens(head, 0) == (5 * BLOCK, True)
        now[0] += REMOTE_HIT_VALIDITY_S
        assert side.get_num_new_matched_tokens(head, 0) == (head.num_tokens - BLOCK, True)
        assert len(store.asked) == 2 and store.asked[1] <= covered * per_request
    finally:
        side.shutdown()
        store.close()


def _mamba_shared_side():
    """A scheduler side on a shared store (nothing in it), full attention and a Mamba group."""
    groups = [kvstride.GroupSpec("full_attention", BLOCK), kvstride.GroupSpec("mamba", BLOCK, mamba_mode="align")]
    S, H = kvstride.resolve_block_sizes(groups)
    planner = kvstride.KeyPlanner(
        groups, hash_block_size=H, scheduler_block_size=S, namespace=kvstride.Namespace("tails", fingerprint="00" * 8)
    )
    config = ConnectorConfig(
        {"store": "mooncake"}, groups, "00" * 8, planner, [planner], 0, None, StoreChoice("mooncake", 1), 1
    )
    return planner, SchedulerSide(config, StorePlacement(CountingStore()))


def _prefill_then_finish_with_tail(side, rid: str, blocks: int = 8):
    """A prompt of ``blocks`` blocks and 5 tokens: its first ``blocks - 1`` blocks saved (and
    reported), then it finishes with vLLM's partial-tail hand-off of its Mamba state at the last
    whole block; returns (request, tables)."""
    request = SimpleNamespace(request_id=rid, block_hashes=_hashes(blocks, rid.encode()),
                              num_tokens=blocks * BLOCK + 5, num_prompt_tokens=blocks * BLOCK + 5)
    side.on_new_request(request)
    tables = [list(range(1, blocks + 2)), [40]]
    _report(side, side.build_connector_meta(_prefill_step(request, (blocks - 1) * BLOCK, tables)).saves, ok=1)
    assert side.register_finished_partial_tail(request, tables, [(1, 41, blocks * BLOCK)])
    side.request_finished_all_groups(request, ())
    return request, tables


def test_a_finished_requests_tail_plans_the_tail_alone_and_leaves_no_state():
    """The tail job after a request finished plans what its saves had not reached (the last
    attention block and the Mamba state), not its whole prefix again; and once planned, no
    state of the request is left."""
    planner, side = _mamba_shared_side()
    try:
        request, tables = _prefill_then_finish_with_tail(side, "r")
        meta = side.build_connector_meta(_idle_step())
        assert meta.finished_tails == ["r"]
        ((job, by_rank),) = meta.saves.items()
        assert sorted((group, block) for _, group, block in by_rank[0]) == [(0, 8), (1, 41)]
        _report(side, [job], ok=1)
        assert "r" not in side.engine._requests
    finally:
        side.shutdown()


def test_a_thousand_finished_requests_leave_no_state():
    _, side = _mamba_shared_side()
    try:
        for i in range(1000):
            _prefill_then_finish_with_tail(side, f"r{i}", blocks=2)
            _report(side, side.build_connector_meta(_idle_step()).saves, ok=1)
        assert len(side.engine._requests) == 0
        per_request = ("_requests", "_waiting", "_local", "_admitted",
                       "_stamps", "_worths", "_finished_tails", "_load_hits", "_pending_loads", "_loading", "_jobs")
        assert {name: len(getattr(side, name)) for name in per_request if len(getattr(side, name))} == {}
        assert side.lookups.states() == 0
    finally:
        side.shutdown()


def _report_outcome(side, job_ids, ok=0, bad=0, deferred=0) -> None:
    reports = {job: [ok, bad, deferred] for job in job_ids}
    side.update_connector_output(SimpleNamespace(
        finished_recving=set(), failed_recving=set(), kv_connector_worker_meta=KVStrideWorkerMetadata(reports, []),
    ))


def test_the_saved_offset_never_skips_a_deferred_or_failed_range():
    """Blocks 0-3 deferred, 4-7 stored, then the replan of 0-11 fails: the next save still
    plans blocks 0-3 (the saved offset moves across contiguous successes only; before, it
    jumped to block 8 and blocks 0-3 were never planned again while the offset claimed them)."""
    groups = [kvstride.GroupSpec("full_attention", BLOCK)]
    S, H = kvstride.resolve_block_sizes(groups)
    planner = kvstride.KeyPlanner(
        groups, hash_block_size=H, scheduler_block_size=S, namespace=kvstride.Namespace("holes", fingerprint="00" * 8)
    )
    config = ConnectorConfig({"store": "mooncake"}, groups, "00" * 8, planner, [planner], 0, None,
                             StoreChoice("mooncake", 1), 1)
    side = SchedulerSide(config, StorePlacement(CountingStore()))
    try:
        request = SimpleNamespace(request_id="r", block_hashes=_hashes(16, b"holes"), num_tokens=16 * BLOCK,
                                  num_prompt_tokens=16 * BLOCK)
        side.on_new_request(request)
        tables = [list(range(1, 17))]

        def step(computed, blocks):
            meta = side.build_connector_meta(_step(request, computed, blocks * BLOCK, tables))
            ((job, by_rank),) = meta.saves.items()
            return job, sorted(block for _, _, block in by_rank[0])

        first, blocks = step(0, 4)
        assert blocks == [1, 2, 3, 4]
        second, blocks = step(4 * BLOCK, 4)
        assert blocks == [5, 6, 7, 8]
        _report_outcome(side, [first], deferred=1)
        _report_outcome(side, [second], ok=1)
        third, blocks = step(8 * BLOCK, 4)  # plans the deferred blocks again, with its own
        assert blocks[:4] == [1, 2, 3, 4] and blocks[-4:] == [9, 10, 11, 12]
        _report_outcome(side, [third], bad=1)
        fourth, blocks = step(12 * BLOCK, 4)
        assert blocks[:4] == [1, 2, 3, 4], blocks
        _report_outcome(side, [fourth], ok=1)
        (state,) = side.engine.request_states(["r"])
        assert state.offset == 16 * BLOCK and not state.ahead
    finally:
        side.shutdown()


def test_a_step_whose_allocations_cannot_be_read_fences_every_pending_save():
    """A scheduler output without the step's new block ids (a vLLM that renamed them) leaves
    the allocated blocks unknown (None), which the workers fence as every block, rather than
    failing the step or naming none."""
    store = CountingStore()
    side = SchedulerSide(_config(), StorePlacement(store))
    try:
        step = _prefill_step(SimpleNamespace(request_id="unknown"), 2 * BLOCK, [[2, 1]])
        assert side.build_connector_meta(step).allocated == [1, 2]
        del step.scheduled_cached_reqs.new_block_ids
        assert side.build_connector_meta(step).allocated is None
    finally:
        store.close()


@pytest.mark.parametrize("store", ["embedded", "mooncake"])
def test_a_prompt_shorter_than_a_hash_block_is_a_quiet_miss(store, warnings_seen):
    """A prompt with no full hash block has no key to look up: a miss, with no error logged or
    counted (a false "lookup failed" on every short chat turn); a lookup that does fail is
    counted."""
    if store == "embedded":
        _, _, side = _embedded_side([kvstride.GroupSpec("full_attention", BLOCK)], 8, "short")
    else:
        side = SchedulerSide(_config(), StorePlacement(CountingStore()))
    try:
        short = SimpleNamespace(request_id="short", block_hashes=[], num_tokens=BLOCK - 3, num_prompt_tokens=BLOCK - 3)
        side.on_new_request(short)
        assert side.get_num_new_matched_tokens(short, 0) == (0, False)
        assert side.counters["lookup_errors"] == 0 and warnings_seen == []
        broken = SimpleNamespace(request_id="broken", block_hashes=None, num_tokens=BLOCK, num_prompt_tokens=BLOCK)
        side.on_new_request(broken)
        assert side.get_num_new_matched_tokens(broken, 0) == (0, False)
        assert side.counters["lookup_errors"] == 1
    finally:
        side.shutdown()


def _idle_step():
    """A step that schedules nothing (the engine steps on for other reasons)."""
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[]),
        num_scheduled_tokens={},
        kv_connector_block_state=SimpleNamespace(get_block_ids=lambda rid: (), boundary_state_offloads={}),
        preempted_req_ids=set(),
        finished_req_ids=set(),
    )


def test_the_slots_of_a_save_job_given_up_stay_held_until_every_rank_reported_it():
    """A save job no rank reported within ``ABANDON_AFTER_STEPS`` steps (a launch lane far
    behind) is given up: its keys are not readable, and its arena slots go to no other save (or
    disk read) while a late copy may still write them; once the late report comes, they are
    free again. Eight slots: A's job is given up, B is stored, C evicts B rather than take A's
    slots, and D, after A's late report, takes them."""
    from kvstride.stores.placement import EVERY_RANK

    planner, placement, side = _embedded_side([kvstride.GroupSpec("full_attention", BLOCK)], 8, "given-up")

    def save(rid: str, first_block: int):
        request = SimpleNamespace(request_id=rid, block_hashes=_hashes(4, rid.encode()), num_tokens=4 * BLOCK,
                                  num_prompt_tokens=4 * BLOCK)
        side.on_new_request(request)
        meta = side.build_connector_meta(_prefill_step(request, 4 * BLOCK, [list(range(first_block, first_block + 4))]))
        ((job, by_rank),) = meta.saves.items()
        return request, job, {slot for slot, _, _ in by_rank[EVERY_RANK]}

    try:
        a, a_job, a_slots = save("a", 1)
        for _ in range(ABANDON_AFTER_STEPS + 1):
            side.build_connector_meta(_idle_step())
        assert side.engine.counters["save_jobs_abandoned"] == 1
        assert not any(placement.exists([planner.key(0, h) for h in a.block_hashes]))
        _, b_job, b_slots = save("b", 5)
        _report(side, [b_job], ok=1)
        _, c_job, c_slots = save("c", 9)
        assert not c_slots & a_slots and c_slots == b_slots  # B evicted; A's slots still held
        _report(side, [c_job], ok=1)
        _report(side, [a_job], ok=1)  # A's copies ended at last
        assert side.engine.counters["save_jobs_reported_late"] == 1
        _, _, d_slots = save("d", 13)
        assert d_slots == a_slots
    finally:
        side.shutdown()


@pytest.mark.parametrize("chunk, warned", [(2 * BLOCK, False), (2 * BLOCK + 8, True), (BLOCK - 4, False)])
def test_a_prefill_chunk_ending_inside_a_mamba_state_block_is_said_once(warnings_seen, chunk, warned):
    """In Mamba "align" mode vLLM ends each prefill chunk of a block or more on a state block,
    else it hands off no state to store (vLLM's CPU backend under ``vllm serve``: its scheduler
    aligns to the platform's default block size, its workers use a larger one). A chunk ending
    inside a block before the prompt's end is said once, with the ``--block-size`` that fixes
    it; an aligned chunk, or one shorter than a block (a block wider than the token budget), is
    not."""
    groups = [kvstride.GroupSpec("full_attention", BLOCK), kvstride.GroupSpec("mamba", BLOCK, mamba_mode="align")]
    _, _, side = _embedded_side(groups, 32, "state-alignment")
    try:
        for rid in ("a", "b"):
            tokens = 3 * BLOCK - 4
            request = SimpleNamespace(request_id=rid, block_hashes=_hashes(2, rid.encode()), num_tokens=tokens,
                                      num_prompt_tokens=tokens)
            side.on_new_request(request)
            side.build_connector_meta(_prefill_step(request, chunk, [[1, 2, 3], [4]]))
        said = [m for m in warnings_seen if "inside a" in m]
        assert len(said) == int(warned), warnings_seen
        assert not warned or f"--block-size {BLOCK}" in said[0]
    finally:
        side.shutdown()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seconds_a_record, claims_disk", [(0.5, False), (0.001, True)])
def test_a_hit_on_a_disk_slower_than_the_model_is_what_memory_holds(tmp_path, seconds_a_record, claims_disk):
    """An 8-block prompt saved and written through to the disk tier, its last 4 blocks since
    gone from memory. Its next turn claims all 8 when the disk's read pace (the workers') ends their
    reads within 4 times what vLLM takes to compute their tokens (1,000 tokens a second here),
    and only the 4 in memory when it would not: waiting for a slow disk made serving slower than no tier at
    all (a disk read at 2 MiB/s under ``vllm serve``: 3.4x slower than a fast disk)."""
    from kvstride.arena import ArenaPlacement
    from kvstride.arena.disk_index import DiskIndex
    groups = [kvstride.GroupSpec("full_attention", BLOCK)]
    S, H = kvstride.resolve_block_sizes(groups)
    planner = kvstride.KeyPlanner(groups, hash_block_size=H, scheduler_block_size=S,
                                  namespace=kvstride.Namespace("disk-pace", fingerprint="00" * 8))
    connector = ConnectorConfig({"store": "embedded"}, groups, "00" * 8, planner, [planner], 0, None,
                                StoreChoice("embedded", 1, 16), 1)
    clock = _Clock()
    placement = ArenaPlacement(16, DiskIndex(16, str(tmp_path), {"record_bytes": 4096, "ranks": 1}), clock=clock)
    side = SchedulerSide(connector, placement)
    try:
        hashes = _hashes(8, b"turn")
        keys = [planner.key(0, h) for h in hashes]
        for depth, key in enumerate(keys):  # saved, then written through
            placement.place_saves([[(key, 0, depth)]])
            placement.saves_done([key], ok=True)
            placement.disk_written({job: [1, 0] for job in placement.take_disk_writes()})
        placement.index.drop_slots([placement.index.slot(key) for key in keys[4:]])  # evicted, on disk
        assert all(placement.exists(keys)) and placement.index.exists(keys) == [True] * 4 + [False] * 4
        # The disk's read pace, as the workers' read lanes report it (update_connector_output).
        side.update_connector_output(SimpleNamespace(finished_recving=set(), failed_recving=set(),
                                                     kv_connector_worker_meta=KVStrideWorkerMetadata(
                                                         disk_paces=[4, 4 * seconds_a_record, 0, 0.0])))
        for _ in range(3):  # prompt steps of 100 tokens, 0.1 s apart
            placement.read_admission.prompt_step(100, 1)
            clock.now += 0.1
        turn = SimpleNamespace(request_id="turn", block_hashes=hashes, num_tokens=8 * BLOCK + 1,
                               num_prompt_tokens=8 * BLOCK + 1)
        side.on_new_request(turn)
        ext, _ = side.get_num_new_matched_tokens(turn, 0)
        assert ext == (8 if claims_disk else 4) * BLOCK
        assert side.counters["disk_hits_declined"] == (0 if claims_disk else 1)
        if claims_disk:  # its reads may take what computing its 128 tokens would, 4 times, or 2 s
            side.update_state_after_alloc(turn, SimpleNamespace(get_block_ids=lambda: [list(range(1, 10))]), ext)
            meta = side.build_connector_meta(SimpleNamespace(
                scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[], new_block_ids=[]),
                num_scheduled_tokens={}, kv_connector_block_state=None, preempted_req_ids=set(), finished_req_ids=set()))
            assert [read[2] for read in meta.disk_reads["turn"]] == keys[4:]
            assert meta.disk_read_deadlines == {"turn": 2.0}
    finally:
        side.shutdown()
        placement.close()


def test_a_disk_hit_is_weighed_by_the_reads_its_load_makes(tmp_path):
    """A full-attention group beside a 32-token sliding window: an 8-block prompt written
    through to disk, then gone from memory are the window's first 6 blocks (only the test of
    shorter hits reads them) and the last full block. A load of the whole prompt reads one
    record from disk (the window's tail is in memory), 0.1 s at the disk's pace, well within 4
    times the 0.128 s its 128 tokens take to compute: claimed. Counting every key of the
    lookup on disk (7 records, 0.7 s) declined it."""
    from kvstride.arena import ArenaPlacement
    from kvstride.arena.disk_index import DiskIndex

    groups = [kvstride.GroupSpec("full_attention", BLOCK), kvstride.GroupSpec("sliding_window", BLOCK, window=32)]
    S, H = kvstride.resolve_block_sizes(groups)
    planner = kvstride.KeyPlanner(groups, hash_block_size=H, scheduler_block_size=S,
                                  namespace=kvstride.Namespace("disk-reads", fingerprint="00" * 8))
    connector = ConnectorConfig({"store": "embedded"}, groups, "00" * 8, planner, [planner], 0, None,
                                StoreChoice("embedded", 1, 32), 1)
    clock = _Clock()
    placement = ArenaPlacement(32, DiskIndex(32, str(tmp_path), {"record_bytes": 4096, "ranks": 1}), clock=clock)
    side = SchedulerSide(connector, placement)
    try:
        hashes = _hashes(8, b"hybrid")
        full = [planner.key(0, h) for h in hashes]
        window = [planner.key(1, h) for h in hashes]
        for depth, (f, w) in enumerate(zip(full, window)):  # saved, then written through
            placement.place_saves([[(f, 0, depth), (w, 1, depth)]])
            placement.saves_done([f, w], ok=True)
            placement.disk_written({job: [1, 0] for job in placement.take_disk_writes()})
        gone = window[:6] + full[7:]
        placement.index.drop_slots([placement.index.slot(key) for key in gone])
        assert all(placement.exists(full + window)) and not any(placement.index.exists(gone))
        placement.read_admission.timed(4, 0.4)  # 0.1 s a record
        for _ in range(3):  # prompt steps of 100 tokens, 0.1 s apart: 1,000 tokens a second
            placement.read_admission.prompt_step(100, 1)
            clock.now += 0.1
        turn = SimpleNamespace(request_id="turn", block_hashes=hashes, num_tokens=8 * BLOCK + 1,
                               num_prompt_tokens=8 * BLOCK + 1)
        side.on_new_request(turn)
        ext, _ = side.get_num_new_matched_tokens(turn, 0)
        assert ext == 8 * BLOCK
        assert side.counters.get("disk_hits_declined", 0) == 0
    finally:
        side.shutdown()
        placement.close()


def test_the_compute_pace_counts_prompt_steps_and_not_idle_time():
    """Prompt-chunk steps of 500 tokens, 0.5 s each: 1,000 tokens a second. A decode-only step
    (a token per request) and an idle minute before the next step change nothing."""
    from kvstride.arena.read_admission import ComputePace

    clock = _Clock()
    pace = ComputePace(clock)
    assert pace.seconds(1000) is None
    for _ in range(5):
        pace.step(500, 2)
        clock.now += 0.5
    pace.step(4, 4)  # decode only: its 0.02 s say nothing of prompts
    clock.now += 0.02
    pace.step(500, 1)
    clock.now += 60.0  # idle
    pace.step(500, 1)
    assert pace.seconds(1000) == pytest.approx(1.0)
