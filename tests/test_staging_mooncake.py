"""Saves and loads through the staging pool on a real Mooncake master (the embedded store
bypasses staging, which is how saves larger than the pool went unnoticed): a step several times
larger than the pool is stored whole and loads back byte for byte, a load that arrives while
saves fill the pool succeeds, and a step that finds the pool held by an earlier step waits for
it while the store keeps up, and is deferred to the next step only when the store stalled."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import torch

from kvstride import _core
from kvstride.engine import LoadRequest, OffloadEngine, SaveRequest
from kvstride.layout import KVLayout
from kvstride.stores.base import HEADER_BYTES
from kvstride.transfer import StagingPool, Transfer
from mooncake_fixture import mooncake_master, mooncake_store  # noqa: F401

BLOCK = 16  # tokens per block
BLOCK_BYTES = 2 * BLOCK * 4 * 32 * 2  # K and V, 4 heads of 32 fp16: 8 KiB, one piece
STAGED_BYTES = BLOCK_BYTES + HEADER_BYTES  # a staged block and the room for its value header
POOL = 8 * STAGED_BYTES  # 8 blocks: loads get 2, saves 6 in batches of 2
SENTINEL = 0xEE


class SlowPuts:
    """The store, with puts that take ``delay`` seconds longer, or that wait for ``release``
    when it is set to an event; ``putting`` is set when one starts, ``puts_done`` counts those
    that returned."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.delay = 0.0
        self.release: threading.Event | None = None
        self.putting = threading.Event()
        self.puts_done = 0

    def put(self, keys, buffers, **kwargs):
        self.putting.set()
        if self.release is not None:
            self.release.wait()
        time.sleep(self.delay)
        try:
            return self.inner.put(keys, buffers, **kwargs)
        finally:
            self.puts_done += 1

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Rig:
    """One full-attention group in blocks-first tensors, an 8-block registered pool, an engine."""

    def __init__(self, store) -> None:
        self.kv = torch.zeros(128, 2, BLOCK, 4, 32, dtype=torch.float16)
        self.layout = KVLayout({"attn": self.kv}, [["attn"]])
        assert self.layout.groups[0].block_bytes == BLOCK_BYTES and len(self.layout.groups[0].pieces) == 1
        self.planner = _core.KeyPlanner(
            [_core.GroupSpec("full_attention", BLOCK)],
            hash_block_size=BLOCK,
            scheduler_block_size=BLOCK,
            namespace=f"test-staging-{uuid.uuid4().hex[:8]}",
        )
        self.pool = StagingPool(POOL)
        assert (self.pool.share("save"), self.pool.share("load")) == (6 * STAGED_BYTES, 2 * STAGED_BYTES)
        self.store = SlowPuts(store)
        self.pool.register(store.register_buffer)
        self.engine = OffloadEngine(self.planner, Transfer(self.layout, self.pool), self.store)
        self.hasher = _core.BlockHasher("sha256_cbor", seed="0")
        self.free = list(range(1, 128))
        self.gen = torch.Generator().manual_seed(11)

    def request(self, blocks: int):
        """Hashes and a block table of ``blocks`` blocks with random bytes."""
        tokens = torch.randint(1, 50_000, (blocks * BLOCK,), generator=self.gen).tolist()
        table, self.free = self.free[:blocks], self.free[blocks:]
        for b in table:
            block = self.kv[b].view(torch.uint8)
            block.copy_(torch.randint(0, 256, block.shape, dtype=torch.uint8, generator=self.gen))
        return self.hasher.hash_blocks(tokens, BLOCK), table

    def destination(self, blocks: int):
        table, self.free = self.free[:blocks], self.free[blocks:]
        for b in table:
            self.kv[b].view(torch.uint8).fill_(SENTINEL)
        return table

    def block(self, b: int) -> bytes:
        return self.kv[b].view(torch.uint8).numpy().tobytes()

    def load_and_compare(self, rid: str, hashes, source) -> None:
        """Look the request up, load its hit into fresh blocks, and compare every block with
        its source, byte for byte."""
        n = len(hashes) * BLOCK
        assert self.engine.lookup([(rid, hashes, n + 1)])[rid] == n
        dst = self.destination(len(hashes))
        self.engine.submit(loads=[LoadRequest(rid, hashes, [dst], n)])
        assert self.engine.wait_idle(30)
        done = self.engine.get_finished()
        assert done.loads_done == {rid} and not done.loads_failed
        for s, d in zip(source, dst):
            assert self.block(d) == self.block(s), f"block {d} differs from its source {s}"


@pytest.fixture
def rig(mooncake_store):
    r = Rig(mooncake_store)
    yield r
    r.engine.shutdown()


def test_step_several_times_larger_than_the_pool_is_stored(rig):
    """A 40-block step (320 KiB) through an 8-block pool: it streams in batches, waiting only
    for its own earlier batches; every block is stored and loads back byte for byte (through
    the 2-block load share: the load streams too)."""
    hashes, table = rig.request(40)
    rig.engine.submit(saves=[SaveRequest("big", hashes, [table], 40 * BLOCK)])
    assert rig.engine.wait_idle(30)
    done = rig.engine.get_finished()
    assert done.saves_done == {"big"} and not done.saves_failed and not done.saves_deferred
    c = rig.engine.counters
    assert c["put_ok"] == 40 and not c["save_job_errors"] and not c["saves_deferred"]
    assert rig.engine.saved_offset("big") == 40 * BLOCK
    rig.load_and_compare("big", hashes, table)
    assert rig.engine.counters["get_ok"] == 40


def test_load_while_saves_fill_the_pool(rig):
    """A load that arrives while in-flight saves hold the save share stages in the load
    share and succeeds (it used to fail and be recomputed)."""
    hashes, table = rig.request(8)
    rig.engine.submit(saves=[SaveRequest("stored", hashes, [table], 8 * BLOCK)])
    assert rig.engine.wait_idle(30) and not rig.engine.get_finished().saves_failed
    rig.store.delay = 0.3
    rig.store.putting.clear()
    busy_hashes, busy_table = rig.request(8)  # 8 blocks of saves: the whole pool
    writer = threading.Thread(
        target=rig.engine.submit, kwargs={"saves": [SaveRequest("busy", busy_hashes, [busy_table], 8 * BLOCK)]}
    )
    writer.start()
    assert rig.store.putting.wait(10)
    rig.load_and_compare("stored", hashes, table)
    writer.join(30)
    assert rig.engine.wait_idle(30)
    assert rig.engine.counters["loads_ok"] == 1 and not rig.engine.counters["load_job_errors"]
    assert rig.engine.saved_offset("busy") == 8 * BLOCK  # the saves went on


def _two_steps(rig):
    """Step 1 saves six blocks (the whole save share), step 2 four more, then the lanes run
    dry; the requests' (hashes, table), "first" and "later"."""
    first = rig.request(6)
    rig.engine.submit(saves=[SaveRequest("first", first[0], [first[1]], 6 * BLOCK)])
    later = rig.request(4)
    rig.engine.submit(saves=[SaveRequest("later", later[0], [later[1]], 4 * BLOCK)])
    assert rig.engine.wait_idle(30)
    return first, later


def test_step_finding_the_pool_held_by_an_earlier_step_waits_while_the_store_keeps_up(rig):
    """Step 1 fills the save share and each of its puts takes 0.3 s, well within
    ``save_wait_s``. Step 2 waits for that room instead of deferring: a deferred window block
    or partial tail is freed by vLLM before the next step could save it. Both steps are stored
    whole, nothing is deferred."""
    assert rig.engine.save_wait_s > 0.3
    rig.store.delay = 0.3
    (first_hashes, first_table), (hashes, table) = _two_steps(rig)
    done = rig.engine.get_finished()
    assert done.saves_done == {"first", "later"} and not done.saves_failed and not done.saves_deferred
    c = rig.engine.counters
    assert c["saves_ok"] == 2 and not c["saves_deferred"] and not c["save_job_errors"]
    assert rig.engine.saved_offset("later") == 4 * BLOCK
    rig.store.delay = 0.0
    rig.load_and_compare("first", first_hashes, first_table)
    rig.load_and_compare("later", hashes, table)


def test_a_step_waits_for_staging_room_at_most_staging_wait_s_in_all(rig):
    """The store keeps up (each put 0.3 s, far within ``save_wait_s``) but is slow: step 2 would
    wait for step 1's six puts one after the other. Past ``staging_wait_s`` of waiting in all,
    its save is deferred (counted) instead of holding vLLM's step for as long as the store
    takes; the request's next step stores it."""
    rig.engine.save_wait_s = 60.0
    rig.engine.staging_wait_s = 0.2
    rig.store.delay = 0.3
    _, (hashes, table) = _two_steps(rig)
    done = rig.engine.get_finished()
    assert done.saves_done == {"first", "later"} and not done.saves_failed
    assert done.saves_deferred == {"later"} and rig.engine.counters["saves_deferred"] == 1
    rig.store.delay = 0.0
    rig.engine.submit(saves=[SaveRequest("later", hashes, [table], 4 * BLOCK)])
    assert rig.engine.wait_idle(30)
    assert rig.engine.saved_offset("later") == 4 * BLOCK


def test_step_finding_the_pool_held_by_a_stalled_store_is_deferred(rig):
    """Step 1 fills the save share and its puts hang, far past ``save_wait_s``: the store has
    stalled. Step 2 does not stall with it: after at most ``save_wait_s`` its save is deferred
    (counted, not failed), and the next step of the request stores it."""
    rig.engine.save_wait_s = 0.2
    rig.store.release = threading.Event()
    release_later = threading.Timer(10.0, rig.store.release.set)  # so that a step that waits ends
    release_later.start()
    first_hashes, first_table = rig.request(6)  # 6 blocks: the whole save share
    rig.engine.submit(saves=[SaveRequest("first", first_hashes, [first_table], 6 * BLOCK)])
    hashes, table = rig.request(4)
    rig.engine.submit(saves=[SaveRequest("later", hashes, [table], 4 * BLOCK)])
    assert rig.store.puts_done == 0  # it did not wait for the first step's puts
    rig.store.release.set()
    release_later.cancel()
    assert rig.engine.wait_idle(30)
    done = rig.engine.get_finished()
    assert done.saves_done == {"first", "later"} and not done.saves_failed
    assert done.saves_deferred == {"later"}
    c = rig.engine.counters
    assert c["saves_deferred"] == 1 and c["saves_ok"] == 1 and not c["save_job_errors"]
    assert rig.engine.saved_offset("later") == 0
    assert rig.engine.lookup([("q", hashes, 4 * BLOCK + 1)])["q"] == 0
    # The next step plans the deferred blocks again and stores them.
    rig.store.delay = 0.0
    rig.engine.submit(saves=[SaveRequest("later", hashes, [table], 4 * BLOCK)])
    assert rig.engine.wait_idle(30)
    done = rig.engine.get_finished()
    assert not done.saves_failed and not done.saves_deferred
    assert rig.engine.saved_offset("later") == 4 * BLOCK
    rig.load_and_compare("later", hashes, table)
