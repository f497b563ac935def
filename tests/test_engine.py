"""kvstride.engine.OffloadEngine with real torch CPU tensors, KVLayout, Transfer and stores:
save -> lookup -> load round trips byte for byte, one existence call per lookup batch, key
dedup across requests, offsets that move only after every put succeeded, failed gets that
never reach a KV block, divergent hand-offs, threads, shutdown and jobs that raise."""

from __future__ import annotations

import ctypes
import random
import threading
import time
import uuid

import pytest
import torch

from kvstride import _core
from kvstride.engine import LoadRequest, OffloadEngine, SaveRequest
from kvstride.faults import corrupt_values
from kvstride.layout import KVLayout
from kvstride.mixes import parse_groups
from kvstride.stores import EmbeddedStore, Status
from kvstride.transfer import StagingPool, Transfer
from mooncake_fixture import mooncake_master, mooncake_store  # noqa: F401

SENTINEL = 0xEE
NUM_BLOCKS = 160

# name -> (groups, prefix_match_unit)
MIXES = {
    "fa": ("full_attention:16", None),
    "ring4+fa64": ("full_attention:64,circular_buffer:4", None),  # FA 1152 + ring 4, scaled down
    "glm-like": ("full_attention:128,circular_buffer:4,mamba:128", 32),  # glm-ring, scaled down
    "fa+mamba": ("full_attention:16,mamba:64", None),
    "fa+swa": ("full_attention:16,sliding_window:16:window=32", None),
    "two-mamba": ("full_attention:16,mamba:64,mamba:64", None),
    "glm-real": ("full_attention:1152,circular_buffer:4,mamba:1152", 64),
}


# ---- a small rig: KV tensors, planner, transfer, store, engine ------------------------------


class Rig:
    def __init__(self, mix: str, store=None, pool_bytes: int = 4 << 20, register=False) -> None:
        text, unit = MIXES[mix]
        self.groups = list(parse_groups(text))
        self.s, self.h = _core.resolve_block_sizes(self.groups, prefix_match_unit=unit)
        self.planner = _core.KeyPlanner(
            self.groups,
            hash_block_size=self.h,
            scheduler_block_size=self.s,
            namespace=f"test-engine-{uuid.uuid4().hex[:8]}",
        )
        self.kv, names = {}, []
        for g, spec in enumerate(self.groups):
            name = f"g{g}"
            if spec.kind == "mamba":  # conv + SSM state
                self.kv[name] = [torch.empty(NUM_BLOCKS, 3, 8, dtype=torch.float16), torch.empty(NUM_BLOCKS, 2, 16, dtype=torch.float32)]
            else:  # a 4-token ring needs many blocks for a long request
                blocks = 1024 if spec.block_size < 16 else NUM_BLOCKS
                self.kv[name] = torch.empty(blocks, spec.block_size, 2, 4, dtype=torch.bfloat16)
            names.append([name])
        self.names = [n[0] for n in names]
        self.layout = KVLayout(self.kv, names)
        self.pool = StagingPool(pool_bytes)
        self.store = store if store is not None else EmbeddedStore(64 << 20, fingerprint=self.layout.fingerprint())
        if register:
            self.pool.register(self.store.register_buffer)
        self.transfer = Transfer(self.layout, self.pool)
        self.engine = OffloadEngine(self.planner, self.transfer, self.store)
        self.free = [list(range(1, g.num_blocks)) for g in self.layout.groups]
        self.rng = random.Random(7)
        self.hasher = _core.BlockHasher("sha256_cbor", seed="0")
        self.gen = torch.Generator().manual_seed(3)

    def close(self) -> None:
        self.engine.shutdown()

    # -- requests --
    def tokens(self, n: int):
        return [self.rng.randrange(1, 50_000) for _ in range(n)]

    def hashes(self, tokens):
        return self.hasher.hash_blocks(tokens, self.h)

    def tensors(self, g: int):
        value = self.kv[self.names[g]]
        return [value] if isinstance(value, torch.Tensor) else list(value)

    def alloc(self, g: int, count: int):
        out, self.free[g] = self.free[g][:count], self.free[g][count:]
        assert len(out) == count, "rig out of blocks"
        return out

    def table(self, n: int):
        return [self.alloc(g, -(-n // spec.block_size)) for g, spec in enumerate(self.groups)]

    def fill(self, g: int, ids, value=None) -> None:
        for t in self.tensors(g):
            for b in ids:
                block = t[b].view(torch.uint8)
                if value is None:
                    block.copy_(torch.randint(0, 256, block.shape, dtype=torch.uint8, generator=self.gen))
                else:
                    block.fill_(value)

    def block(self, g: int, b: int) -> bytes:
        return b"".join(t[b].contiguous().view(torch.uint8).numpy().tobytes() for t in self.tensors(g))

    def source_request(self, n: int, tokens=None, shared_tables=None):
        """A computed request: tokens, hashes, block tables with random content, and a Mamba
        hand-off (fresh copy-on-write block) at the last aligned boundary."""
        tokens = tokens if tokens is not None else self.tokens(n)
        hashes = self.hashes(tokens)
        tables = self.table(n)
        for g, table in enumerate(tables):
            if self.groups[g].kind != "mamba":
                self.fill(g, table)
        boundary = min(n, len(hashes) * self.h) // self.planner.alignment * self.planner.alignment
        handoffs = []
        for g, spec in enumerate(self.groups):
            if spec.kind == "mamba" and boundary and self.planner.hashes_per_block[g]:
                (cow,) = self.alloc(g, 1)
                self.fill(g, [cow])
                handoffs.append((g, cow, boundary))
        return tokens, hashes, tables, handoffs

    def sources(self, hashes, tables, n, handoffs):
        """key -> (group, source block) of everything a save from offset 0 writes."""
        out = {}
        for key, g, b in self.planner.plan_save(hashes, tables, n).puts:
            out.setdefault(key, (g, b))
        if handoffs:
            for key, g, b in self.planner.plan_tail(hashes, tables, handoffs).puts:
                out.setdefault(key, (g, b))
        return out

    def run(self, saves=(), loads=()):
        self.engine.submit(saves=saves, loads=loads)
        assert self.engine.wait_idle(30)
        return self.engine.get_finished()

    def destination(self, n: int):
        tables = self.table(n)
        for g, table in enumerate(tables):
            self.fill(g, table, SENTINEL)
        return tables

    def check_loaded(self, hashes, dst, hit, sources, skip=()):
        """Every block the load plan names equals its source byte for byte (those in
        ``skip`` must still hold the sentinel). Returns the number of blocks checked."""
        plan = self.planner.plan_load(hashes, dst, hit)
        assert plan.gets and not plan.missing
        for key, g, b in plan.gets:
            got = self.block(g, b)
            if (g, b) in skip:
                assert got == bytes([SENTINEL]) * len(got), f"failed block {(g, b)} was written"
            else:
                sg, sb = sources[key]
                assert sg == g and got == self.block(g, sb), f"block {(g, b)} differs from its source {sb}"
        return len(plan.gets)


@pytest.fixture
def rig_factory():
    rigs = []

    def make(*args, **kwargs):
        rig = Rig(*args, **kwargs)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


class Spy:
    """Wraps a store: counts calls, lets a test replace answers, and fails the test (through
    ``violations``) on any call after ``close``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls = []  # (op, keys)
        self.violations = []
        self.closed = False
        self.put_hook = None  # (keys, buffers) -> statuses, or None for the inner store
        self.get_hook = None
        self.delay = 0.0

    def _enter(self, op, keys):
        if self.closed:
            self.violations.append((op, list(keys)))
            raise AssertionError(f"store.{op} called after close")
        self.calls.append((op, list(keys)))
        if self.delay:
            time.sleep(self.delay)

    def exists(self, keys):
        self._enter("exists", keys)
        return self.inner.exists(keys)

    def put(self, keys, buffers):
        self._enter("put", keys)
        if self.put_hook is not None:
            return self.put_hook(keys, buffers)
        return self.inner.put(keys, buffers)

    def get(self, keys, buffers):
        self._enter("get", keys)
        if self.get_hook is not None:
            return self.get_hook(keys, buffers)
        return self.inner.get(keys, buffers)

    def register_buffer(self, ptr, nbytes):
        self.inner.register_buffer(ptr, nbytes)

    def unregister_buffer(self, ptr):
        self.inner.unregister_buffer(ptr)

    def remove(self, keys):
        self.inner.remove(keys)

    def close(self):
        self.closed = True
        self.inner.close()

    def ops(self, op):
        return [keys for o, keys in self.calls if o == op]


def spy_rig(factory, mix="fa", **kwargs):
    inner = EmbeddedStore(64 << 20, slot_bytes=64 << 10)  # through the protocol: staged
    spy = Spy(inner)
    return factory(mix, store=spy, register=True, **kwargs), spy


# ---- round trips ------------------------------------------------------------------------


def _round_trip(rig, n):
    tokens, hashes, tables, handoffs = rig.source_request(n)
    sources = rig.sources(hashes, tables, n, handoffs)
    done = rig.run(saves=[SaveRequest("r", hashes, tables, n, handoffs)])
    assert done.saves_done == {"r"} and not done.saves_failed
    assert rig.engine.saved_offset("r") == n // rig.s * rig.s
    hit = rig.engine.lookup([("again", hashes, n)])["again"]
    a = rig.planner.alignment
    if rig.planner.partial_hits:
        assert hit == n // a * a  # the hand-off boundary
    else:
        assert hit == n // rig.s * rig.s
    dst = rig.destination(n)
    done = rig.run(loads=[LoadRequest("again", hashes, dst, hit)])
    assert done.loads_done == {"again"} and not done.loads_failed
    assert rig.check_loaded(hashes, dst, hit, sources) > 0
    return hit


@pytest.mark.parametrize("mix", ["fa", "ring4+fa64", "glm-like", "fa+mamba", "fa+swa"])
def test_save_lookup_load_round_trip(rig_factory, mix):
    rig = rig_factory(mix)
    n = {"ring4+fa64": 200, "glm-like": 300}.get(mix, 100)
    hit = _round_trip(rig, n)
    assert hit > 0
    if mix in ("ring4+fa64", "glm-like"):  # the ring is never keyed, stored or loaded
        assert rig.planner.hashes_per_block[1] == 0
        assert rig.store.keys() and all("@group:1@" not in k for k in rig.store.keys())


def test_round_trip_glm_real_sizes(rig_factory):
    """The real glm-ring geometry: FA 1152 + ring 4 + Mamba 1152, H = 64."""
    rig = rig_factory("glm-real")
    assert (rig.s, rig.h) == (1152, 64) and rig.planner.hashes_per_block[1] == 0
    assert _round_trip(rig, 1300) == 1280


def test_round_trip_mooncake(rig_factory, mooncake_store):
    rig = rig_factory("glm-like", store=mooncake_store, register=True)
    assert _round_trip(rig, 300) == 288


def test_mamba_handoffs_at_chunk_ends(rig_factory):
    """Hand-offs at several chunk ends of one request: each boundary becomes a hit for a
    request sharing that prefix, with the Mamba state of that boundary."""
    rig = rig_factory("fa+mamba")
    n = 200
    tokens = rig.tokens(n)
    hashes = rig.hashes(tokens)
    tables = rig.table(n)
    for g, table in enumerate(tables):
        if rig.groups[g].kind != "mamba":
            rig.fill(g, table)
    sources = {}
    for end in (64, 128, n):
        boundary = end // 16 * 16
        (cow,) = rig.alloc(1, 1)
        rig.fill(1, [cow])
        handoffs = [(1, cow, boundary)]
        sources.update(rig.sources(hashes, tables, end, handoffs))
        done = rig.run(saves=[SaveRequest("r", hashes, tables, end, handoffs)])
        assert not done.saves_failed
    # A request sharing the first 130 tokens: its longest hit is the 128-token hand-off.
    other = tokens[:130] + rig.tokens(50)
    other_hashes = rig.hashes(other)
    hit = rig.engine.lookup([("o", other_hashes, len(other))])["o"]
    assert hit == 128
    dst = rig.destination(len(other))
    assert not rig.run(loads=[LoadRequest("o", other_hashes, dst, hit)]).loads_failed
    rig.check_loaded(other_hashes, dst, hit, sources)
    # And the whole request: hit at its last boundary (192).
    assert rig.engine.lookup([("w", hashes, n + 5)])["w"] == 192


# ---- lookup: one existence call per batch ------------------------------------------------


def test_lookup_one_exists_call_per_batch(rig_factory):
    rig, spy = spy_rig(rig_factory, "fa+mamba")
    reqs = []
    for i in range(3):
        tokens, hashes, tables, handoffs = rig.source_request(100 + 20 * i)
        rig.run(saves=[SaveRequest(f"s{i}", hashes, tables, len(tokens), handoffs)])
        reqs.append((f"q{i}", hashes, len(tokens)))
    reqs.append(("new", rig.hashes(rig.tokens(90)), 90))
    spy.calls.clear()
    hits = rig.engine.lookup(reqs)
    assert len(spy.calls) == 1 and spy.calls[0][0] == "exists"
    asked = spy.calls[0][1]
    assert len(asked) == len(set(asked))  # each key asked once
    assert [hits[f"q{i}"] for i in range(3)] == [96, 112, 128] and hits["new"] == 0
    # A batch sharing keys still makes one call, with the shared keys once.
    spy.calls.clear()
    rig.engine.lookup([("a", reqs[0][1], 100), ("b", reqs[0][1], 100)])
    assert len(spy.calls) == 1 and len(spy.calls[0][1]) == len(set(spy.calls[0][1]))


def test_lookup_store_error_is_a_miss(rig_factory):
    rig, spy = spy_rig(rig_factory)

    def broken(keys):
        raise RuntimeError("exists broke")

    spy.exists = broken
    hashes = rig.hashes(rig.tokens(64))
    assert rig.engine.lookup([("r", hashes, 64)]) == {"r": 0}
    assert rig.engine.counters["lookup_errors"] == 1


# ---- saves --------------------------------------------------------------------------------


def test_two_requests_sharing_a_prefix_put_each_key_once(rig_factory):
    rig, spy = spy_rig(rig_factory, "fa+mamba")
    prefix = rig.tokens(128)
    a_tokens, a_hashes, a_tables, a_handoffs = rig.source_request(160, tokens=prefix + rig.tokens(32))
    b_tokens = prefix + rig.tokens(48)
    b_hashes = rig.hashes(b_tokens)
    b_tables = rig.table(len(b_tokens))
    # The shared prefix has the same content in both requests' blocks.
    for g, spec in enumerate(rig.groups):
        if spec.kind != "mamba":
            rig.fill(g, b_tables[g])
            for i in range(128 // spec.block_size):
                for t in rig.tensors(g):
                    t[b_tables[g][i]].copy_(t[a_tables[g][i]])
    (cow,) = rig.alloc(1, 1)
    rig.fill(1, [cow])
    b_handoffs = [(1, cow, 176)]
    done = rig.run(
        saves=[
            SaveRequest("a", a_hashes, a_tables, 160, a_handoffs),
            SaveRequest("b", b_hashes, b_tables, 176, b_handoffs),
        ]
    )
    assert done.saves_done == {"a", "b"} and not done.saves_failed
    put_keys = [k for keys in spy.ops("put") for k in keys]
    assert len(put_keys) == len(set(put_keys))
    expected = set(rig.sources(a_hashes, a_tables, 160, a_handoffs)) | set(rig.sources(b_hashes, b_tables, 176, b_handoffs))
    assert set(put_keys) == expected
    assert len(spy.ops("exists")) == 1  # one existence call for the job
    assert rig.engine.saved_offset("a") == 128 and rig.engine.saved_offset("b") == 128
    # Saving again puts nothing: every key is present.
    spy.calls.clear()
    rig.run(saves=[SaveRequest("a", a_hashes, a_tables, 160, a_handoffs)])
    assert spy.ops("put") == []


def test_puts_queued_behind_a_running_put_go_in_one_store_call(rig_factory):
    """Batches of several steps queued while a put runs are put in one store call (a Mooncake
    call costs ~0.3 ms of client CPU however few values it moves), each job's outcome still
    its own: a key that fails there fails only the request that owns it."""
    rig, spy = spy_rig(rig_factory, "fa")
    requests = {rid: rig.source_request(64) for rid in "abcd"}
    keys_of = {rid: {k for k, _, _ in rig.planner.plan_save(h, t, 64).puts} for rid, (_, h, t, _) in requests.items()}
    victim = sorted(keys_of["c"])[0]
    running, release = threading.Event(), threading.Event()

    def held_then_one_failure(keys, buffers):
        if not running.is_set():
            running.set()
            assert release.wait(30)
        statuses = spy.inner.put(keys, buffers)
        return [Status.FULL if k == victim else st for k, st in zip(keys, statuses)]

    spy.put_hook = held_then_one_failure
    for rid, (_, hashes, tables, _) in requests.items():  # one step each
        rig.engine.submit(saves=[SaveRequest(rid, hashes, tables, 64)])
        if rid == "a":
            assert running.wait(30)  # the lane holds a's put while b, c and d are staged
    release.set()
    assert rig.engine.wait_idle(30)
    done = rig.engine.get_finished()
    assert done.saves_done == set("abcd") and done.saves_failed == {"c"}
    puts = [set(keys) for keys in spy.ops("put")]
    assert puts == [keys_of["a"], keys_of["b"] | keys_of["c"] | keys_of["d"]]
    assert [rig.engine.saved_offset(rid) for rid in "abcd"] == [64, 64, 0, 64]
    assert spy.inner.exists(sorted(keys_of["d"])) == [True] * len(keys_of["d"])


def test_puts_arriving_within_the_linger_go_in_one_store_call(rig_factory):
    """Steps staged while the save lane lingers (``put_linger_s``, room not low) are put in
    one store call; a shutdown ends the linger and puts them."""
    rig, spy = spy_rig(rig_factory, "fa")
    rig.engine.put_linger_s = 60.0  # only the shutdown below ends it
    requests = {rid: rig.source_request(64) for rid in "abc"}
    for rid, (_, hashes, tables, _) in requests.items():
        rig.engine.submit(saves=[SaveRequest(rid, hashes, tables, 64)])
        deadline = time.monotonic() + 30
        while not rig.engine._save_queue.empty() and time.monotonic() < deadline:
            time.sleep(0.001)  # the lane took the batch: without a linger it would put it now
    assert spy.ops("put") == []  # lingering
    assert rig.engine.shutdown(timeout=30)
    assert rig.engine.get_finished().saves_done == set("abc")
    keys = [{k for k, _, _ in rig.planner.plan_save(h, t, 64).puts} for _, h, t, _ in requests.values()]
    assert [set(k) for k in spy.ops("put")] == [keys[0] | keys[1] | keys[2]]


def test_a_caller_waiting_for_idle_ends_the_linger(rig_factory):
    """``wait_idle`` does not wait out ``put_linger_s``: the lane puts the steps it holds at
    once (a driver waiting for its saves, e.g. before reading them back, gains nothing from
    a later call)."""
    rig, spy = spy_rig(rig_factory, "fa")
    rig.engine.put_linger_s = 60.0
    for rid in "ab":
        _, hashes, tables, _ = rig.source_request(64)
        rig.engine.submit(saves=[SaveRequest(rid, hashes, tables, 64)])
    assert rig.engine.wait_idle(10)  # with the linger kept it would wait 60 s
    assert len(spy.ops("put")) == 1
    assert rig.engine.get_finished().saves_done == {"a", "b"}


def test_a_flush_ends_the_linger_and_the_next_put_does_not_linger(rig_factory):
    """``flush_puts`` (the connector's workers call it on a step without saves: the engine is
    idle or decoding) ends the linger over what the lane holds; a put staged after it, before
    the lane's next call, is not lingered over either; after that call the lane lingers again."""
    rig, spy = spy_rig(rig_factory, "fa")
    rig.engine.put_linger_s = 60.0

    def step(rid):
        _, hashes, tables, _ = rig.source_request(64)
        rig.engine.submit(saves=[SaveRequest(rid, hashes, tables, 64)])

    def puts_become(n):
        deadline = time.monotonic() + 10
        while len(spy.ops("put")) < n and time.monotonic() < deadline:
            time.sleep(0.001)
        return len(spy.ops("put")) == n

    step("a")
    rig.engine.flush_puts()
    assert puts_become(1)  # a's put, at once
    rig.engine.flush_puts()  # the engine idle a step: the next put is not lingered over
    step("b")
    assert puts_become(2)
    step("c")  # no flush since b's call: the lane lingers over c
    time.sleep(0.2)
    assert len(spy.ops("put")) == 2
    assert rig.engine.wait_idle(10)
    assert len(spy.ops("put")) == 3
    assert rig.engine.get_finished().saves_done == {"a", "b", "c"}


def test_the_linger_ends_after_linger_max_steps(rig_factory):
    """However long ``put_linger_s``, the lane puts once ``LINGER_MAX_STEPS`` steps passed
    since the batch it holds: a save job's report must reach the scheduler well within
    ``ABANDON_AFTER_STEPS`` of an engine whose steps are short (test_vllm_scheduler checks
    the two constants)."""
    from kvstride.engine import LINGER_MAX_STEPS

    rig, spy = spy_rig(rig_factory, "fa")
    rig.engine.put_linger_s = 60.0
    for i in range(LINGER_MAX_STEPS + 1):
        _, hashes, tables, _ = rig.source_request(64)
        rig.engine.submit(saves=[SaveRequest(f"r{i}", hashes, tables, 64)])
    assert rig.engine.wait_idle(30)  # with only the time bound it would linger 60 s
    # One call for the first LINGER_MAX_STEPS steps' batches; the last step's may make a second
    # one when the lane sees its step begin before its batch is queued (a busy machine).
    assert len(spy.ops("put")) in (1, 2)
    assert rig.engine.get_finished().saves_done == {f"r{i}" for i in range(LINGER_MAX_STEPS + 1)}


def test_a_step_waiting_for_staging_room_ends_the_linger(rig_factory, monkeypatch):
    """A step that finds the save share full while the lane lingers over the batches that
    hold it is not kept waiting for the linger: the lane puts them at once, and the step
    stages its blocks when they are released."""
    import kvstride.engine.staged as staged_saves

    monkeypatch.setattr(staged_saves, "LINGER_ROOM_SHARE", 0.0)  # only the waiting step ends the linger
    rig, spy = spy_rig(rig_factory, "fa", pool_bytes=4096)  # saves: 3 KiB, FA blocks of 256 B
    rig.engine.put_linger_s = 60.0
    rig.engine.save_wait_s = 60.0
    _, a_hashes, a_tables, _ = rig.source_request(192)  # 12 blocks: the whole save share
    rig.engine.submit(saves=[SaveRequest("a", a_hashes, a_tables, 192)])
    _, b_hashes, b_tables, _ = rig.source_request(64)
    step = threading.Thread(target=rig.engine.submit, kwargs={"saves": [SaveRequest("b", b_hashes, b_tables, 64)]})
    step.start()
    step.join(30)  # with the linger kept, it would wait 60 s
    assert not step.is_alive()
    a_keys = {k for k, _, _ in rig.planner.plan_save(a_hashes, a_tables, 192).puts}
    assert [set(k) for k in spy.ops("put")][:1] == [a_keys]
    assert rig.engine.shutdown(timeout=30)
    assert rig.engine.get_finished().saves_done == {"a", "b"} and not rig.engine.counters["saves_deferred"]


def test_offset_advances_only_after_every_put_succeeded(rig_factory):
    rig, spy = spy_rig(rig_factory, "fa")
    tokens, hashes, tables, _ = rig.source_request(100)
    victim = rig.planner.key(0, hashes[3])

    def fail_one(keys, buffers):
        kept = [(k, b) for k, b in zip(keys, buffers) if k != victim]
        statuses = iter(spy.inner.put([k for k, _ in kept], [b for _, b in kept]))
        return [Status.FULL if k == victim else next(statuses) for k in keys]

    spy.put_hook = fail_one
    done = rig.run(saves=[SaveRequest("r", hashes, tables, 100)])
    assert done.saves_done == {"r"} and done.saves_failed == {"r"}
    assert rig.engine.saved_offset("r") == 0
    assert rig.engine.counters["put_full"] == 1
    assert spy.inner.exists([victim]) == [False]
    # A later step of the same request retries from the old offset: only the missing key.
    spy.put_hook = None
    spy.calls.clear()
    done = rig.run(saves=[SaveRequest("r", hashes, tables, 100)])
    assert not done.saves_failed
    assert spy.ops("put") == [[victim]]
    assert rig.engine.saved_offset("r") == 96
    assert rig.engine.lookup([("q", hashes, 100)])["q"] == 96


def test_failing_store_keeps_offset_and_next_save_retries(rig_factory):
    rig, spy = spy_rig(rig_factory, "fa+mamba")
    tokens, hashes, tables, handoffs = rig.source_request(150)
    spy.put_hook = lambda keys, buffers: [Status.UNAVAILABLE] * len(keys)
    done = rig.run(saves=[SaveRequest("r", hashes, tables, 150, handoffs)])
    assert done.saves_failed == {"r"} and rig.engine.saved_offset("r") == 0
    assert rig.engine.counters["put_unavailable"] > 0
    assert rig.engine.lookup([("q", hashes, 150)])["q"] == 0
    spy.put_hook = None
    done = rig.run(saves=[SaveRequest("r", hashes, tables, 150, handoffs)])
    assert not done.saves_failed and rig.engine.saved_offset("r") == 128
    assert rig.engine.lookup([("q", hashes, 150)])["q"] == 144


def test_short_store_answer_is_a_failure(rig_factory):
    """A store answering fewer statuses than keys must not read as success."""
    rig, spy = spy_rig(rig_factory, "fa")
    tokens, hashes, tables, _ = rig.source_request(64)
    spy.put_hook = lambda keys, buffers: spy.inner.put(keys, buffers)[:-1]
    done = rig.run(saves=[SaveRequest("r", hashes, tables, 64)])
    assert done.saves_failed == {"r"} and rig.engine.saved_offset("r") == 0


def test_divergent_boundaries_skip_the_tail_not_the_save(rig_factory):
    rig, spy = spy_rig(rig_factory, "two-mamba")
    n = 150
    tokens = rig.tokens(n)
    hashes = rig.hashes(tokens)
    tables = rig.table(n)
    rig.fill(0, tables[0])
    cow1, cow2 = rig.alloc(1, 1)[0], rig.alloc(2, 1)[0]
    rig.fill(1, [cow1])
    rig.fill(2, [cow2])
    handoffs = [(1, cow1, 144), (2, cow2, 128)]
    assert rig.planner.plan_tail(hashes, tables, handoffs).outcome == "divergent_boundaries"
    done = rig.run(saves=[SaveRequest("r", hashes, tables, n, handoffs)])
    assert done.saves_done == {"r"} and not done.saves_failed
    assert rig.engine.counters["tail_divergent_boundaries"] == 1
    assert rig.engine.saved_offset("r") == 128
    put_keys = {k for keys in spy.ops("put") for k in keys}
    normal = {k for k, _, _ in rig.planner.plan_save(hashes, tables, n).puts}
    assert put_keys == normal and normal  # the normal save went on, no Mamba state stored
    assert all("@group:0@" in k for k in put_keys)
    # The next step with agreeing hand-offs stores the tail.
    done = rig.run(saves=[SaveRequest("r", hashes, tables, n, [(1, cow1, 144), (2, cow2, 144)])])
    assert not done.saves_failed and rig.engine.counters["tail_planned"] == 1
    assert rig.engine.lookup([("q", hashes, n)])["q"] == 144


# ---- loads --------------------------------------------------------------------------------


def test_corrupt_or_missing_get_never_reaches_a_block(rig_factory):
    rig, spy = spy_rig(rig_factory, "fa+mamba")
    n = 150
    tokens, hashes, tables, handoffs = rig.source_request(n)
    sources = rig.sources(hashes, tables, n, handoffs)
    rig.run(saves=[SaveRequest("r", hashes, tables, n, handoffs)])
    hit = rig.engine.lookup([("q", hashes, n)])["q"]
    assert hit == 144
    dst = rig.destination(n)
    plan = rig.planner.plan_load(hashes, dst, hit)
    corrupt_key, missing_key = plan.gets[1][0], plan.gets[-1][0]  # an FA block and the Mamba state
    assert plan.gets[-1][1] == 1

    def bad_get(keys, buffers):
        statuses = spy.inner.get(keys, buffers)
        out = []
        for k, s, parts in zip(keys, statuses, buffers):
            if k in (corrupt_key, missing_key):
                for addr, size in parts:  # junk in the staging buffer: must not be scattered
                    ctypes.memset(addr, 0x5A, size)
                s = Status.CORRUPT if k == corrupt_key else Status.MISSING
            out.append(s)
        return out

    spy.get_hook = bad_get
    done = rig.run(loads=[LoadRequest("q", hashes, dst, hit)])
    failed = {(g, b) for k, g, b in plan.gets if k in (corrupt_key, missing_key)}
    assert done.loads_done == {"q"} and done.loads_failed == {"q": failed}
    assert rig.engine.counters["get_corrupt"] == 1 and rig.engine.counters["get_missing"] == 1
    rig.check_loaded(hashes, dst, hit, sources, skip=failed)


def test_really_corrupted_value_is_caught_by_the_store(rig_factory):
    rig = rig_factory("fa")
    tokens, hashes, tables, _ = rig.source_request(80)
    sources = rig.sources(hashes, tables, 80, [])
    rig.run(saves=[SaveRequest("r", hashes, tables, 80)])
    victim = rig.planner.key(0, hashes[2])
    assert corrupt_values(rig.store, random.Random(1), 1, keys=[victim]) == 1
    dst = rig.destination(80)
    done = rig.run(loads=[LoadRequest("q", hashes, dst, 80)])
    failed = {(0, dst[0][2])}
    assert done.loads_failed == {"q": failed}
    rig.check_loaded(hashes, dst, 80, sources, skip=failed)
    assert rig.store.exists([victim]) == [False]  # dropped: the next save rewrites it


def test_really_corrupted_value_is_caught_on_mooncake(rig_factory, mooncake_store):
    """On Mooncake with a CPU KV cache the store checks each header and the scatter checks the
    payload digest while it copies: a corrupted value still never reaches a block, is counted
    corrupt and removed from the store."""
    rig = rig_factory("fa", store=mooncake_store, register=True)
    assert rig.engine._fused_digests
    tokens, hashes, tables, _ = rig.source_request(80)
    sources = rig.sources(hashes, tables, 80, [])
    rig.run(saves=[SaveRequest("r", hashes, tables, 80)])
    victim = rig.planner.key(0, hashes[2])
    corrupt_before = mooncake_store.counters["get.corrupt"]
    assert corrupt_values(mooncake_store, random.Random(1), 1, keys=[victim]) == 1
    dst = rig.destination(80)
    done = rig.run(loads=[LoadRequest("q", hashes, dst, 80)])
    failed = {(0, dst[0][2])}
    assert done.loads_failed == {"q": failed}
    assert rig.engine.counters["get_corrupt"] == 1
    rig.check_loaded(hashes, dst, 80, sources, skip=failed)
    assert mooncake_store.counters["get.corrupt"] == corrupt_before + 1
    assert mooncake_store.exists([victim]) == [False]  # removed: the next save rewrites it


def test_missing_destination_fails_the_whole_load(rig_factory):
    rig, spy = spy_rig(rig_factory, "fa")
    tokens, hashes, tables, _ = rig.source_request(64)
    rig.run(saves=[SaveRequest("r", hashes, tables, 64)])
    dst = rig.destination(64)
    dst[0][1] = 0  # a NULL destination
    spy.calls.clear()
    done = rig.run(loads=[LoadRequest("q", hashes, dst, 64)])
    assert done.loads_failed["q"] == {(0, b) for b in dst[0] if b}
    assert spy.ops("get") == []


# ---- threads, shutdown, jobs that raise --------------------------------------------------


def test_lookups_from_threads_while_the_worker_saves_and_loads(rig_factory):
    rig = rig_factory("fa+mamba")  # the embedded store copies blocks itself (staging: test_staging_*.py)
    reqs = [rig.source_request(100 + 10 * i) for i in range(6)]
    expected = {i: (100 + 10 * i) // 16 * 16 for i in range(6)}
    errors, seen = [], []
    stop = threading.Event()

    def looker(t):
        try:
            while not stop.is_set():
                hits = rig.engine.lookup([(f"t{t}-{i}", r[1], len(r[0])) for i, r in enumerate(reqs)])
                for i in range(6):
                    assert hits[f"t{t}-{i}"] in (0, expected[i]), hits
                seen.append(sum(hits.values()))
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=looker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for i, (tokens, hashes, tables, handoffs) in enumerate(reqs):
        rig.engine.submit(saves=[SaveRequest(f"s{i}", hashes, tables, len(tokens), handoffs)])
    sources = {}
    for tokens, hashes, tables, handoffs in reqs:
        sources.update(rig.sources(hashes, tables, len(tokens), handoffs))
    assert rig.engine.wait_idle(30)
    dsts = []
    for round_ in range(3):
        loads = []
        for i, (tokens, hashes, _, _) in enumerate(reqs):
            dst = rig.destination(len(tokens)) if round_ == 0 else dsts[i]
            if round_ == 0:
                dsts.append(dst)
            loads.append(LoadRequest(f"l{i}", hashes, dst, expected[i]))
        rig.engine.submit(loads=loads)
    assert rig.engine.wait_idle(30)
    time.sleep(0.05)
    stop.set()
    for th in threads:
        th.join(10)
    assert not errors, errors
    assert seen and max(seen) == sum(expected.values())
    assert not rig.engine.get_finished().loads_failed
    for i, (tokens, hashes, _, _) in enumerate(reqs):
        rig.check_loaded(hashes, dsts[i], expected[i], sources)
    assert rig.engine.counters["lookups"] == 6 * len(seen)


def test_shutdown_runs_queued_jobs_then_refuses_work(rig_factory):
    rig, spy = spy_rig(rig_factory, "fa")
    spy.delay = 0.01  # every store call is slow: jobs pile up in the queue
    reqs = [rig.source_request(64) for _ in range(8)]
    for i, (tokens, hashes, tables, _) in enumerate(reqs):
        rig.engine.submit(saves=[SaveRequest(f"r{i}", hashes, tables, 64)])
    assert rig.engine.shutdown(timeout=30)
    done = rig.engine.get_finished()
    assert done.saves_done == {f"r{i}" for i in range(8)} and not done.saves_failed  # none lost
    keys = [rig.planner.key(0, h) for _, hashes, _, _ in reqs for h in hashes]
    assert all(spy.inner.exists(keys))
    spy.close()
    # After shutdown + close: refused, reported failed, and the store is never called.
    tokens, hashes, tables, _ = reqs[0]
    dst = rig.destination(64)
    rig.engine.submit(saves=[SaveRequest("late", hashes, tables, 64)], loads=[LoadRequest("late-load", hashes, dst, 64)])
    assert rig.engine.lookup([("late-lookup", hashes, 64)]) == {"late-lookup": 0}
    rig.engine.wait_idle(5)
    done = rig.engine.get_finished()
    assert done.loads_failed == {"late-load": {(0, b) for b in dst[0]}}
    assert done.saves_failed == {"late"}
    assert rig.engine.counters["refused_after_shutdown"] == 2
    assert rig.engine.shutdown() is True  # idempotent
    time.sleep(0.05)
    assert spy.violations == []
    assert all(rig.block(0, b) == bytes([SENTINEL]) * len(rig.block(0, b)) for b in dst[0])


def test_submit_racing_shutdown_loses_no_job(rig_factory):
    rig, spy = spy_rig(rig_factory, "fa")
    spy.delay = 0.002
    tokens, hashes, tables, _ = rig.source_request(32)
    submitted = []
    go = threading.Event()

    def submitter(t):
        go.wait()
        for i in range(40):
            rid = f"t{t}-{i}"
            rig.engine.submit(saves=[SaveRequest(rid, hashes, tables, 32)])
            submitted.append(rid)

    threads = [threading.Thread(target=submitter, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    go.set()
    time.sleep(0.01)
    assert rig.engine.shutdown(timeout=30)
    for th in threads:
        th.join(10)
    done = rig.engine.get_finished()
    assert done.saves_done == set(submitted)  # every job ran or was refused, none lost
    refused = rig.engine.counters["refused_after_shutdown"]
    assert len(done.saves_failed) == refused
    spy.close()
    time.sleep(0.02)
    assert spy.violations == []


def test_a_planned_job_refused_by_shutdown_while_waiting_for_room_is_reported_failed(rig_factory):
    """A planned job (``submit_planned``: its owner is the job id, not a request) waiting for
    staging room when the engine shuts down is refused, and reported failed, not "ok"."""
    rig, spy = spy_rig(rig_factory, "fa", pool_bytes=4096)  # saves: 3 KiB, FA blocks of 256 B
    rig.engine.save_wait_s = rig.engine.staging_wait_s = 60.0  # the step waits for room
    rig.engine.put_linger_s = 0.0
    gate = threading.Event()

    def held_put(keys, buffers):
        gate.wait(30)
        return spy.inner.put(keys, buffers)

    spy.put_hook = held_put
    _, a_hashes, a_tables, _ = rig.source_request(192)  # 12 blocks: the whole save share
    _, b_hashes, b_tables, _ = rig.source_request(64)
    a_entries = list(rig.planner.plan_save(a_hashes, a_tables, 192).puts)
    b_entries = list(rig.planner.plan_save(b_hashes, b_tables, 64).puts)
    rig.engine.submit_planned(puts={1: a_entries})
    deadline = time.monotonic() + 10
    while not spy.ops("put") and time.monotonic() < deadline:  # job 1's put holds the share
        time.sleep(0.01)
    step = threading.Thread(target=rig.engine.submit_planned, kwargs={"puts": {2: b_entries}})
    step.start()
    time.sleep(0.2)  # job 2 waits for room
    stopping = threading.Thread(target=rig.engine.shutdown, kwargs={"timeout": 30})
    stopping.start()
    step.join(10)
    assert not step.is_alive()
    gate.set()
    stopping.join(30)
    assert rig.engine.get_finished().jobs_done == {1: "ok", 2: "failed"}
    assert not any(spy.inner.exists([key for key, _, _ in b_entries]))
    spy.close()


def test_job_that_raises_inside_the_worker(rig_factory):
    rig, spy = spy_rig(rig_factory, "fa+mamba")
    tokens, hashes, tables, handoffs = rig.source_request(100)

    def raising(keys, buffers):
        raise RuntimeError("put exploded")

    spy.put_hook = raising
    done = rig.run(saves=[SaveRequest("r", hashes, tables, 100, handoffs)])  # nothing escapes
    assert done.saves_done == {"r"} and done.saves_failed == {"r"}
    assert rig.engine.counters["save_job_errors"] == 1 and rig.engine.saved_offset("r") == 0
    spy.put_hook = None
    assert not rig.run(saves=[SaveRequest("r", hashes, tables, 100, handoffs)]).saves_failed
    # A get that raises: every destination block of the load is reported failed, none written.
    spy.get_hook = lambda keys, buffers: (_ for _ in ()).throw(RuntimeError("get exploded"))
    dst = rig.destination(100)
    done = rig.run(loads=[LoadRequest("q", hashes, dst, 96)])
    assert done.loads_failed == {"q": {(g, b) for g, table in enumerate(dst) for b in table}}
    assert rig.engine.counters["load_job_errors"] == 1
    for g, table in enumerate(dst):
        for b in table:
            assert rig.block(g, b) == bytes([SENTINEL]) * len(rig.block(g, b))
    # The worker survived both.
    spy.get_hook = None
    assert not rig.run(loads=[LoadRequest("q", hashes, dst, 96)]).loads_failed


def test_finished_request_is_not_resurrected_by_a_queued_save(rig_factory):
    rig, spy = spy_rig(rig_factory, "fa")
    spy.delay = 0.05
    tokens, hashes, tables, _ = rig.source_request(64)
    rig.engine.submit(saves=[SaveRequest("r", hashes, tables, 64)])
    rig.engine.finish_request("r")
    assert rig.engine.wait_idle(10)
    assert rig.engine.saved_offset("r") == 0 and "r" not in rig.engine._requests


def test_load_completing_after_finish_request_leaves_no_state(rig_factory):
    """B8(a): a load that completes after its request was aborted (``finish_request``) does
    not re-create the request's state: 100 aborted requests leave none behind."""
    rig, spy = spy_rig(rig_factory, "fa")
    tokens, hashes, tables, _ = rig.source_request(64)
    assert not rig.run(saves=[SaveRequest("r", hashes, tables, 64)]).saves_failed
    rig.engine.finish_request("r")
    spy.delay = 0.2  # the load is still in flight when the requests are aborted
    dst = rig.destination(64)
    rig.engine.submit(loads=[LoadRequest(f"aborted-{i}", hashes, dst, 64) for i in range(100)])
    for i in range(100):
        rig.engine.finish_request(f"aborted-{i}")
    assert rig.engine.wait_idle(30)
    assert rig.engine.counters["loads_ok"] == 100
    assert rig.engine._requests == {}


def test_saved_offset_after_a_load_comes_from_the_core(rig_factory):
    """A loaded request's saves start where the core says (its last scheduler block)."""
    rig = rig_factory("fa+mamba")
    n = 150
    tokens, hashes, tables, handoffs = rig.source_request(n)
    rig.run(saves=[SaveRequest("r", hashes, tables, n, handoffs)])
    hit = rig.engine.lookup([("q", hashes, n)])["q"]
    assert hit == 144 and rig.planner.saved_offset_after_load(hit) == 128
    assert not rig.run(loads=[LoadRequest("q", hashes, rig.destination(n), hit)]).loads_failed
    assert rig.engine.saved_offset("q") == 128


@pytest.mark.parametrize("mix, first_group", [("fa+mamba", 1), ("fa+swa", 1)])
def test_blocks_valid_only_in_their_step_are_staged_first(rig_factory, mix, first_group):
    """Partial-tail hand-offs and window-group blocks are freed or reused after their step:
    a save plan lists them before full-attention blocks, so a step that runs out of staging
    room defers only blocks that stay valid."""
    rig = rig_factory(mix)
    tokens, hashes, tables, handoffs = rig.source_request(200)
    states = rig.engine.request_states(["r"])
    entries, owners, ends, failed = rig.engine.plan_saves(
        [SaveRequest("r", hashes, tables, 200, handoffs)], states, lambda keys: [False] * len(keys)
    )
    groups = [g for _, g, _ in entries]
    assert groups[0] == first_group and 0 in groups
    assert groups == sorted(groups, key=lambda g: g != first_group)  # all of them first


def test_a_planned_job_deferred_counts_the_tails_its_planner_named(rig_factory):
    """The connector's path: a save job planned elsewhere (``submit_planned``, the tail keys the
    planner named beside it) that a stalled store defers counts its tail as dropped, as
    ``submit``'s saves do."""
    rig, spy = spy_rig(rig_factory, "fa+mamba", pool_bytes=4096)
    rig.engine.save_wait_s = 0.1

    def slow_put(keys, buffers):
        time.sleep(0.5)
        return spy.inner.put(keys, buffers)

    spy.put_hook = slow_put
    _, a_hashes, a_tables, _ = rig.source_request(192)  # the whole save share, its put stalled
    rig.engine.submit(saves=[SaveRequest("a", a_hashes, a_tables, 192)])
    _, hashes, tables, handoffs = rig.source_request(150)
    tails: set = set()
    entries, _, _, _ = rig.engine.plan_saves([SaveRequest("b", hashes, tables, 150, handoffs)],
                                             rig.engine.request_states(["b"]), lambda keys: [False] * len(keys),
                                             tail_keys=tails)
    assert tails and tails <= {key for key, _, _ in entries}
    rig.engine.submit_planned(puts={7: entries}, tails={7: tails})
    assert rig.engine.wait_idle(30)
    assert rig.engine.get_finished().jobs_done[7] == "deferred"
    assert rig.engine.counters["tails_dropped"] == 1


def test_deferred_step_counts_its_dropped_tail(rig_factory):
    """A step whose staging room is held by an earlier step's put that stalled (longer than
    ``save_wait_s``) is deferred whole; its partial tail (a hand-off block, valid only in that
    step) is counted as dropped, never stored, and the normal save is stored by the request's
    next step."""
    rig, spy = spy_rig(rig_factory, "fa+mamba", pool_bytes=4096)  # saves: 3 KiB, batches of 5 FA blocks
    assert rig.pool.share("save") == 3072
    rig.engine.save_wait_s = 0.1

    def slow_put(keys, buffers):
        time.sleep(0.5)
        return spy.inner.put(keys, buffers)

    spy.put_hook = slow_put
    _, a_hashes, a_tables, _ = rig.source_request(192)  # 12 FA blocks of 256 B: the whole save share
    rig.engine.submit(saves=[SaveRequest("a", a_hashes, a_tables, 192)])
    _, hashes, tables, handoffs = rig.source_request(150)
    assert handoffs
    rig.engine.submit(saves=[SaveRequest("b", hashes, tables, 150, handoffs)])
    assert rig.engine.wait_idle(30)
    done = rig.engine.get_finished()
    assert done.saves_deferred == {"b"} and not done.saves_failed
    assert rig.engine.counters["saves_deferred"] == 1 and rig.engine.counters["tails_dropped"] == 1
    tail_keys = {k for k, _, _ in rig.planner.plan_tail(hashes, tables, handoffs).puts}
    spy.put_hook = None
    assert not rig.run(saves=[SaveRequest("b", hashes, tables, 150)]).saves_failed
    put_keys = {k for keys in spy.ops("put") for k in keys}
    assert put_keys >= {k for k, _, _ in rig.planner.plan_save(hashes, tables, 150).puts}
    assert not put_keys & (tail_keys - {k for k, _, _ in rig.planner.plan_save(hashes, tables, 150).puts})
    assert rig.engine.saved_offset("b") == 128


# ---- work planned elsewhere (the vLLM connector's scheduler plans, its workers execute) ------


@pytest.mark.parametrize("store_kind", ["embedded", "mooncake"])
def test_planned_puts_and_gets_round_trip(rig_factory, request, store_kind):
    """A planning-only engine (no KV tensors) plans a save and a load; the rig's engine
    executes exactly those entries (``submit_planned``): each job's outcome comes back in
    ``jobs_done``, the loaded blocks equal their sources byte for byte, and the executing
    engine keeps no request state (the planner's side owns the offsets)."""
    store = request.getfixturevalue("mooncake_store") if store_kind == "mooncake" else None
    rig = rig_factory("fa+swa", store=store, register=store is not None)
    planning = OffloadEngine(rig.planner, None, rig.store, name="test-planning")
    try:
        n = 100
        tokens, hashes, tables, handoffs = rig.source_request(n)
        sources = rig.sources(hashes, tables, n, handoffs)
        saves = [SaveRequest("r", hashes, tables, n, handoffs)]
        states = planning.request_states(["r"])
        entries, _, ends, failed = planning.plan_saves(saves, states, rig.store.exists)
        assert entries and not failed and ends == [n // rig.s * rig.s]
        rig.engine.submit_planned(puts={7: entries})
        assert rig.engine.wait_idle(30)
        done = rig.engine.get_finished()
        assert done.jobs_done == {7: "ok"} and not done.saves_failed
        assert all(rig.store.exists([key for key, _, _ in entries]))
        hit = planning.lookup([("again", hashes, n)])["again"]
        assert hit > 0
        dst = rig.destination(n)
        gets = rig.planner.plan_load(hashes, dst, hit).gets
        rig.engine.submit_planned(gets={"again": list(gets)})
        assert rig.engine.wait_idle(30)
        done = rig.engine.get_finished()
        assert done.loads_done == {"again"} and not done.loads_failed
        assert rig.check_loaded(hashes, dst, hit, sources) == len(gets)
        assert rig.engine.saved_offset("again") == 0 and rig.engine.saved_offset("r") == 0
    finally:
        planning.shutdown()


def test_planned_job_with_a_failed_put_reports_the_job_failed(rig_factory):
    rig = rig_factory("fa")
    tokens, hashes, tables, _ = rig.source_request(64)
    entries = list(rig.planner.plan_save(hashes, tables, 64).puts)
    bad = entries + [("k-outside", 0, 10**6)]  # a block the KV cache does not have
    null_block = entries + [("k-null", 0, 0)]  # vLLM's null block is never a source
    no_group = entries + [("k-group", 7, 1)]
    rig.engine.submit_planned(puts={1: entries, 2: bad, 3: [], 4: null_block, 5: no_group})
    assert rig.engine.wait_idle(30)
    done = rig.engine.get_finished()
    assert done.jobs_done == {1: "ok", 2: "failed", 3: "ok", 4: "failed", 5: "failed"}
    assert rig.engine.counters["save_bad_block"] == 3


def test_planning_only_engine_starts_no_threads_and_moves_no_blocks(rig_factory):
    """A scheduler's engine (no KV tensors) plans and looks up: it starts no lane threads, and
    a transfer asked of it is a clear error rather than a job that never runs."""
    rig = rig_factory("fa")
    before = set(threading.enumerate())
    planning = OffloadEngine(rig.planner, None, rig.store, name="test-planning-threads")
    try:
        assert set(threading.enumerate()) == before
        with pytest.raises(ValueError, match="no KV layout"):
            planning.submit_planned(gets={"r": [("k", 0, 1)]})
    finally:
        assert planning.shutdown(timeout=5)
        assert planning.wait_idle(timeout=5)


@pytest.mark.parametrize("option", ["save_wait_s", "put_linger_s", "staging_wait_s"])
@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), "soon", True, None])
def test_bad_seconds_options_are_refused_at_construction(rig_factory, option, value):
    """``save_wait_s``, ``put_linger_s`` or ``staging_wait_s`` (``kv_connector_extra_config``) that is not a finite
    number of seconds >= 0 is a ValueError naming it, before any lane starts."""
    rig = rig_factory("fa")
    with pytest.raises(ValueError, match=option):
        OffloadEngine(rig.planner, None, rig.store, **{option: value})


def test_the_confirmed_offset_moves_across_contiguous_successes_only():
    from kvstride.engine.jobs import _RequestState

    state = _RequestState()
    state.confirm(64, 128)  # past a gap: held back
    state.confirm(192, 256)
    assert state.offset == 0
    state.confirm(0, 64)  # the gap filled: the first held range joins
    assert state.offset == 128 and state.ahead == [(192, 256)]
    state.confirm(0, 192)  # a load of the prefix: the rest joins
    assert state.offset == 256 and state.ahead == []


def test_a_store_that_never_answers_costs_each_load_its_deadline(rig_factory):
    """A get that does not return: the load, and the one queued behind it, are reported failed
    at their deadline (their requests recompute and free their blocks); when the store answers
    at last, its bytes reach no KV block and nothing is reported twice."""
    rig, spy = spy_rig(rig_factory, "fa")
    rig.engine.load_timeout_s = 0.3
    n = 80
    tokens, hashes, tables, _ = rig.source_request(n)
    rig.run(saves=[SaveRequest("r", hashes, tables, n)])
    hit = rig.engine.lookup([("q", hashes, n + 1)])["q"]
    assert hit == n
    answer = threading.Event()

    def hung_get(keys, buffers):
        answer.wait(30)
        return spy.inner.get(keys, buffers)  # the right bytes, too late

    spy.get_hook = hung_get
    destinations = {rid: rig.destination(n) for rid in ("a", "b")}
    for rid, dst in destinations.items():
        rig.engine.submit(loads=[LoadRequest(rid, hashes, dst, hit)])
    done, failed, until = set(), {}, time.monotonic() + 10
    while done != {"a", "b"} and time.monotonic() < until:
        finished = rig.engine.get_finished()
        done |= finished.loads_done
        failed.update(finished.loads_failed)
        time.sleep(0.02)
    assert done == {"a", "b"} and set(failed) == {"a", "b"}
    assert rig.engine.counters["loads_timed_out"] == 2
    answer.set()
    assert rig.engine.wait_idle(30)
    late = rig.engine.get_finished()
    assert not late.loads_done and not late.loads_failed
    for dst in destinations.values():
        for g, table in enumerate(dst):
            for b in table:
                assert rig.block(g, b) == bytes([SENTINEL]) * len(rig.block(g, b)), f"a late get wrote block {b}"


def test_load_timeout_must_be_positive():
    for bad in (0, -1, "soon", float("inf"), True):
        with pytest.raises(ValueError, match="load_timeout_s"):
            OffloadEngine(None, None, None, load_timeout_s=bad)


def test_a_store_that_never_answers_a_lookup_costs_one_deadline(rig_factory):
    """A lookup waits for the store's existence answer at most ``lookup_timeout_s``, then its
    requests miss; while that call stays unanswered, later lookups miss at once; once the store
    answers again, lookups hit."""
    rig, spy = spy_rig(rig_factory, "fa")
    _, hashes, tables, _ = rig.source_request(64)
    rig.run(saves=[SaveRequest("r", hashes, tables, 64)])
    lookups = OffloadEngine(rig.planner, None, spy, lookup_timeout_s=0.3)  # a scheduler's engine
    answer = threading.Event()
    real = spy.inner.exists
    spy.inner.exists = lambda keys: answer.wait(30) and real(keys)
    try:
        asked = len(spy.ops("exists"))
        assert lookups.lookup([("a", hashes, 65)]) == {"a": 0}  # returned while the store is silent
        assert lookups.lookup([("b", hashes, 65)]) == {"b": 0}
        assert len(spy.ops("exists")) == asked + 1  # the second did not ask the silent store again
        assert lookups.counters["lookup_timeouts"] == 2
        answer.set()
        until = time.monotonic() + 10
        while lookups.lookup([("c", hashes, 65)])["c"] != 64:
            assert time.monotonic() < until, "lookups never hit again"
            time.sleep(0.05)
    finally:
        answer.set()
        lookups.shutdown()
