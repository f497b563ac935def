"""kvstride.transfer: batched gather / scatter between KV tensors and the staging pool."""

import ctypes
import random

import numpy as np
import pytest
import torch

import kvdata
from interpreted import run_under_triton_interpreter
from kvstride import _core
from kvstride.engine import LoadRequest, OffloadEngine, SaveRequest
from kvstride.layout import KVLayout
from kvstride.stores import EmbeddedStore, Status
from kvstride.transfer import StagingPool, Transfer

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pick_blocks(layout, per_group=5, seed=0):
    """Distinct block ids across groups (groups may alias one allocation, as in vLLM)."""
    rng = random.Random(seed)
    ng = len(layout.groups)
    out = []
    for g in layout.groups:
        ids = [b for b in range(g.num_blocks) if b % ng == g.group]
        out += [(g.group, b) for b in rng.sample(ids, min(per_group, len(ids)))]
    rng.shuffle(out)
    return out


def _snapshot(kv, blocks, groups):
    snap = {}
    for g, b in blocks:
        for name in groups[g]:
            v = kv[name]
            for j, t in enumerate([v] if isinstance(v, torch.Tensor) else v):
                snap[(name, j, b)] = kvdata.block_bytes_of(t, b)
    return snap


def _check(kv, snap, which):
    for (name, j, b), want in snap.items():
        if which is not None and b not in which:
            continue
        v = kv[name]
        t = v if isinstance(v, torch.Tensor) else v[j]
        assert torch.equal(kvdata.block_bytes_of(t, b), want), (name, j, b)


@pytest.mark.parametrize("mix", sorted(kvdata.MIXES))
def test_round_trip_every_layout(mix):
    kv, groups = kvdata.MIXES[mix]()
    layout = KVLayout(kv, groups)
    kvdata.fill_random(layout.storages, seed=hash(mix) & 0xFFFF)
    blocks = _pick_blocks(layout)
    snap = _snapshot(kv, blocks, groups)
    pool = StagingPool(8 << 20)
    tr = Transfer(layout, pool)
    batch = tr.stage(blocks)
    assert batch is not None
    tr.gather(batch).wait()
    # The staged payload of every block equals its pieces, in order.
    for i, (g, b) in enumerate(blocks):
        payload = torch.cat(batch.payload_view(i))
        assert payload.numel() == layout.groups[g].block_bytes
    for s in layout.storages:
        s.zero_()
    # Move the staged bytes to other block ids? No: scatter back to the same ids.
    tr.scatter(batch).wait()
    _check(kv, snap, None)
    batch.release()
    assert pool.free_bytes == pool.capacity


def test_staged_payload_matches_source_bytes():
    kv, groups = kvdata.ring_and_big()
    layout = KVLayout(kv, groups)
    kvdata.fill_random(layout.storages, 3)
    tr = Transfer(layout, StagingPool(4 << 20))
    with tr.stage([(1, 5), (0, 2)]) as batch:
        tr.gather(batch).wait()
        # An entry is staged whole: one part, its pieces back to back.
        (full,) = batch.payload_view(0)
        k = kv["full.0"][0, 5].contiguous().view(-1).view(torch.uint8)
        v = kv["full.0"][1, 5].contiguous().view(-1).view(torch.uint8)
        assert torch.equal(full, torch.cat([k, v]))
        (ring,) = batch.payload_view(1)  # two separate ring layers: two pieces, one part
        r0 = kv["ring.0"][2].contiguous().view(-1).view(torch.uint8)
        r1 = kv["ring.1"][2].contiguous().view(-1).view(torch.uint8)
        assert torch.equal(ring, torch.cat([r0, r1]))


def test_scatter_mask_leaves_failed_blocks_untouched():
    kv, groups = kvdata.hybrid_mamba()
    layout = KVLayout(kv, groups)
    kvdata.fill_random(layout.storages, 5)
    blocks = [(0, 0), (1, 1), (0, 2), (1, 3), (0, 4)]
    tr = Transfer(layout, StagingPool(2 << 20))
    batch = tr.stage(blocks)
    tr.gather(batch).wait()
    before = _snapshot(kv, blocks, groups)
    # Poison the staging bytes, then scatter only some entries.
    for i in range(len(blocks)):
        for v in batch.payload_view(i):
            v.fill_(0xAB)
    ok = [True, False, False, True, False]
    tr.scatter(batch, ok=ok).wait()
    good = {b for (g, b), o in zip(blocks, ok) if o}
    bad = {b for (g, b), o in zip(blocks, ok) if not o}
    _check(kv, before, bad)  # untouched
    for b in good:  # overwritten with the poison
        t = kv["attn.0"] if b % 2 == 0 else kv["mamba.0"][0]
        assert (kvdata.block_bytes_of(t, b) == 0xAB).all()
    tr.scatter(batch, ok=[False] * 5).wait()  # nothing at all
    batch.release()


def test_pool_is_bounded_and_reused():
    kv, groups = kvdata.flash_attn(nb=32)
    layout = KVLayout(kv, groups)
    per_block = layout.groups[0].block_bytes
    pool = StagingPool(10 * per_block)
    tr = Transfer(layout, pool)
    a = tr.stage([(0, b) for b in range(6)])
    assert a is not None
    assert tr.stage([(0, b) for b in range(6)]) is None  # does not fit beside a
    c = tr.stage([(0, b) for b in range(4)])
    assert c is not None
    a.release()
    a.release()  # idempotent
    d = tr.stage([(0, b) for b in range(6)])
    assert d is not None and d.offset == 0  # the same memory again
    assert pool.tensor.data_ptr() == pool.ptr
    c.release(), d.release()
    assert pool.free_bytes == pool.capacity
    with pytest.raises(ValueError, match="block id 99"):
        tr.stage([(0, 99)])
    with pytest.raises(ValueError, match="group 3"):
        tr.stage([(3, 0)])


def test_odd_sizes_and_duplicate_blocks():
    # 3-byte elements rows: sizes not multiples of 8 use narrower views.
    kv = {"odd": torch.empty(9, 5, 3, dtype=torch.uint8), "even": torch.empty(9, 6, dtype=torch.int16)}
    layout = KVLayout(kv, [["odd"], ["even"]])
    kvdata.fill_random(layout.storages, 7)
    snap = {b: kv["odd"][b].clone() for b in range(9)}
    tr = Transfer(layout, StagingPool(1 << 16))
    batch = tr.stage([(0, 1), (0, 1), (1, 2), (0, 8)])
    tr.gather(batch).wait()
    kv["odd"].zero_()
    tr.scatter(batch).wait()
    for b in (1, 8):
        assert torch.equal(kv["odd"][b], snap[b])
    assert not kv["odd"][0].any()
    batch.release()


def test_copies_are_batched_not_per_block(monkeypatch):
    """A batch of many blocks costs one raw region copy in the core on CPU, each way."""
    from kvstride import _core

    kv, groups = kvdata.ring_and_big(nb=64)
    layout = KVLayout(kv, groups)
    tr = Transfer(layout, StagingPool(64 << 20))
    calls = []
    real = _core._copy_regions

    def counting(src, dst, lengths):
        calls.append(len(lengths))
        return real(src, dst, lengths)

    monkeypatch.setattr(_core, "_copy_regions", counting)
    blocks = [(g, b) for g in (0, 1) for b in range(60)]
    batch = tr.stage(blocks)
    tr.gather(batch).wait()
    tr.scatter(batch, ok=[i % 2 == 0 for i in range(len(blocks))]).wait()
    pieces = sum(60 * len(g.pieces) for g in layout.groups)
    assert calls == [pieces, pieces // 2]  # one call each way; the mask halves the scatter
    batch.release()


KERNELS_ON_CPU = r"""
import numpy as np, torch
import kvdata
from test_transfer import _check, _pick_blocks, _snapshot
from kvstride import _core
from kvstride.engine import LoadRequest, OffloadEngine, SaveRequest
from kvstride.layout import KVLayout
from kvstride.stores import MooncakeStore, start_master
from kvstride.stores.base import HEADER_BYTES
from kvstride.transfer import StagingPool, Transfer

layouts = {mix: kvdata.MIXES[mix] for mix in sorted(kvdata.MIXES)}
layouts["odd sizes"] = lambda: ({"odd": torch.empty(9, 5, 3, dtype=torch.uint8), "even": torch.empty(9, 6, dtype=torch.int16)},
                                [["odd"], ["even"]])
hashed = 0
for mix, make in layouts.items():
    kv, groups = make()
    layout = KVLayout(kv, groups)
    kvdata.fill_random(layout.storages, seed=7)
    blocks = _pick_blocks(layout)
    snap = _snapshot(kv, blocks, groups)
    regions = Transfer(layout, StagingPool(8 << 20))
    regions.header_room = HEADER_BYTES
    want = regions.stage(blocks)
    regions.gather(want, digests=True).wait()
    largest = max(g.block_bytes for g in layout.groups) + HEADER_BYTES
    for chunk_entries in (1, 3, 1000):  # chunks of one entry, of a few, the whole batch
        tr = Transfer(layout, StagingPool(8 << 20), kernels=True, chunk_bytes=chunk_entries * largest)
        tr.header_room = HEADER_BYTES  # as for a store that writes its header in front
        batch = tr.stage(blocks)
        tr.gather(batch).wait()
        for i in range(len(blocks)):
            assert torch.equal(torch.cat(batch.payload_view(i)), torch.cat(want.payload_view(i))), (mix, i)
        for t in layout.storages:
            t.zero_()
        ok = [i % 3 != 1 for i in range(len(blocks))]
        tr.scatter(batch, ok=ok).wait()
        _check(kv, snap, {b for (g, b), good in zip(blocks, ok) if good})
        for (g, b), good in zip(blocks, ok):
            if not good:  # never written
                assert all(not kvdata.block_bytes_of(t, b).any() for name in groups[g]
                           for t in ([kv[name]] if isinstance(kv[name], torch.Tensor) else kv[name])), (mix, g, b)
        tr.scatter(batch).wait()
        _check(kv, snap, None)
        batch.release()
        # Digests on the device: a gather's are the Rust copier's; a checked scatter leaves an
        # entry whose staged bytes changed unwritten.
        tr.digests_on_device = True
        if not tr.digests_ride_copies():
            continue
        hashed += 1
        batch = tr.stage(blocks)
        tr.gather(batch, digests=True).wait()
        assert (batch.digests == want.digests).all(), mix
        for t in layout.storages:
            t.zero_()
        batch.payload_view(1)[0][3] ^= 0xFF
        ok = [i != 0 for i in range(len(blocks))]
        tr.scatter(batch, ok=ok, expected=want.digests).wait()
        assert batch.verified.tolist() == [i not in (0, 1) for i in range(len(blocks))], mix
        _check(kv, snap, {b for (g, b), good in zip(blocks, batch.verified) if good})
        for (g, b), good in zip(blocks, batch.verified):
            if not good:
                assert all(not kvdata.block_bytes_of(t, b).any() for name in groups[g]
                           for t in ([kv[name]] if isinstance(kv[name], torch.Tensor) else kv[name])), (mix, g, b)
        batch.release()
        regions.scatter(want).wait()  # every block as it was, for the next chunk size
assert hashed >= 10, hashed
tr = Transfer(KVLayout(*kvdata.flash_attn()), StagingPool(1 << 20), kernels=True)
tr.digests_on_device = True
empty = tr.stage([])  # an empty batch copies nothing, either way
tr.gather(empty, digests=True).wait()
tr.scatter(empty, expected=[]).wait()
assert len(empty.digests) == 0 and len(empty.verified) == 0

# Through the engine into Mooncake: the store writes each value's header into the room in front
# of the drained payload and hashes the staged values itself; loads come back byte for byte.
master = start_master(lease_ttl_ms=1000)
try:
    store = MooncakeStore(master, segment_bytes=64 << 20, fingerprint=b"kernels0")
    kv = torch.zeros(64, 2, 16, 4, 32, dtype=torch.float16)
    layout = KVLayout({"attn": kv}, [["attn"]])
    planner = _core.KeyPlanner([_core.GroupSpec("full_attention", 16)], hash_block_size=16, scheduler_block_size=16,
                               namespace="kernels-on-cpu")
    pool = StagingPool(1 << 20)
    pool.register(store.register_buffer)
    for on_device in (False, True):  # the store hashes the staged values; the copies do, on the device
        transfer = Transfer(layout, pool, kernels=True, chunk_bytes=3 * 16 << 10)
        transfer.digests_on_device = on_device
        engine = OffloadEngine(planner, transfer, store)
        assert engine._fused_digests == on_device
        kvdata.fill_random([kv], seed=3 + on_device)
        tokens = list(range(1 + 1000 * on_device, 10 * 16 + 1 + 1000 * on_device))
        hashes = _core.BlockHasher("sha256_cbor", seed="0").hash_blocks(tokens, 16)
        engine.submit(saves=[SaveRequest("r", hashes, [list(range(1, 11))], len(tokens))])  # block 0: vLLM's null block
        assert engine.wait_idle(30)
        assert engine.get_finished().saves_done == {"r"} and engine.counters["put_ok"] == 10, engine.counters
        assert engine.lookup([("r2", hashes, len(tokens) + 1)])["r2"] == len(tokens)
        engine.submit(loads=[LoadRequest("r2", hashes, [list(range(20, 30))], len(tokens))])
        assert engine.wait_idle(30)
        done = engine.get_finished()
        assert done.loads_done == {"r2"} and not done.loads_failed, engine.counters
        assert torch.equal(kv[20:30].view(torch.uint8), kv[1:11].view(torch.uint8))
        engine.shutdown()
    store.close()
finally:
    master.stop()
print("ok")
"""


def test_the_copy_kernels_stage_every_layout_byte_for_byte():
    """The device path (the copy kernels, chunked through device staging), run by Triton's
    interpreter on CPU memory: every layout's staged values are byte for byte the Rust
    copier's, header room included; a masked scatter leaves the failed entries unwritten; with
    the digests on the device, a gather's are the Rust copier's and a checked scatter leaves an
    entry whose bytes changed unwritten; and an engine saves into Mooncake and loads back
    through it, the store hashing the staged values or the copies taking their digests."""
    done = run_under_triton_interpreter(KERNELS_ON_CPU)
    assert done.stdout.strip().endswith("ok"), done.stderr[-3000:]


@cuda_only
@pytest.mark.parametrize("mix", ["flash_attn", "ring_and_big", "hybrid_mamba", "mamba_raw_pages"])
def test_round_trip_cuda(mix):
    kv, groups = kvdata.MIXES[mix]()
    cpu_layout = KVLayout(kv, groups)
    kvdata.fill_random(cpu_layout.storages, 9)

    def to_cuda(v):
        return v.cuda() if isinstance(v, torch.Tensor) else [t.cuda() for t in v]

    # Re-create the same views on the device (shared storages stay shared).
    dev_storages = {s.data_ptr(): s.cuda() for s in cpu_layout.storages}
    dkv = {}
    for name, v in kv.items():
        ts = [v] if isinstance(v, torch.Tensor) else v
        out = []
        for t in ts:
            base = dev_storages[t.untyped_storage().data_ptr()]
            flat = torch.empty(0, dtype=t.dtype, device="cuda").set_(base.untyped_storage(), 0, (base.numel() // t.element_size(),), (1,))
            out.append(flat.as_strided(t.shape, t.stride(), t.storage_offset()))
        dkv[name] = out[0] if isinstance(v, torch.Tensor) else out
    layout = KVLayout(dkv, groups)
    blocks = _pick_blocks(layout)
    snap = _snapshot(kv, blocks, groups)
    tr = Transfer(layout, StagingPool(8 << 20))
    batch = tr.stage(blocks)
    tr.gather(batch).wait()
    for s in layout.storages:
        s.zero_()
    f = tr.scatter(batch)
    f.wait_stream()
    f.wait()
    host = {name: (v.cpu() if isinstance(v, torch.Tensor) else [t.cpu() for t in v]) for name, v in dkv.items()}
    _check(host, snap, None)
    batch.release()


@pytest.mark.parametrize("mix", ["flash_attn", "hybrid_mamba", "ring_and_big"])
def test_gather_digests_and_checked_scatter(mix):
    """The payload digest rides the gather (what a Mooncake header carries) and the checked
    scatter writes only the entries whose staged bytes still have it."""
    import xxhash

    kv, groups = kvdata.MIXES[mix]()
    layout = KVLayout(kv, groups)
    kvdata.fill_random(layout.storages, seed=9)
    blocks = _pick_blocks(layout)
    tr = Transfer(layout, StagingPool(8 << 20))
    with tr.stage(blocks) as batch:
        tr.gather(batch, digests=True).wait()
        want = [xxhash.xxh3_64_intdigest(torch.cat(batch.payload_view(i)).numpy().tobytes()) for i in range(len(blocks))]
        assert batch.digests.tolist() == want
        snap = _snapshot(kv, blocks, groups)
        for s in layout.storages:
            s.zero_()
        batch.payload_view(0)[0][0] ^= 0xFF  # entry 0's staged bytes no longer match
        ok = [True] * len(blocks)
        ok[-1] = False  # a store miss: not written either
        tr.scatter(batch, ok=ok, expected=want).wait()
        assert batch.verified.tolist() == [False] + [True] * (len(blocks) - 2) + [False]
        _check(kv, snap, {b for _, b in blocks[1:-1]})
        for g, b in (blocks[0], blocks[-1]):  # left as they were (zeroed)
            for name in groups[g]:
                v = kv[name]
                for t in [v] if isinstance(v, torch.Tensor) else v:
                    assert not kvdata.block_bytes_of(t, b).any()


class BytesStore:
    """A store that keeps a copy of each value's bytes (read from the staging parts at put)."""

    def __init__(self) -> None:
        self.values = {}

    def exists(self, keys):
        return [k in self.values for k in keys]

    def put(self, keys, buffers):
        for key, parts in zip(keys, buffers):
            self.values[key] = b"".join(ctypes.string_at(addr, size) for addr, size in parts)
        return [Status.OK] * len(keys)

    def get(self, keys, buffers):
        for key, parts in zip(keys, buffers):
            value, pos = self.values[key], 0
            for addr, size in parts:
                ctypes.memmove(addr, value[pos : pos + size], size)
                pos += size
        return [Status.OK] * len(keys)


def _cuda_engine(direct: bool = False):
    """A CUDA KV cache's engine over a store reached through staging, or (``direct``) over the
    embedded store's pinned slots, which the engine copies blocks into and out of itself."""
    kv = torch.randn(80, 2, 16, 4, 32, device="cuda", dtype=torch.float16)
    layout = KVLayout({"attn": kv}, [["attn"]])
    planner = _core.KeyPlanner([_core.GroupSpec("full_attention", 16)], hash_block_size=16, scheduler_block_size=16, namespace="cuda")
    if direct:
        store = EmbeddedStore(64 << 20)
        engine = OffloadEngine(planner, layout, store)
    else:
        store = BytesStore()
        engine = OffloadEngine(planner, Transfer(layout, StagingPool(4 << 20)), store)
    hashes = _core.BlockHasher("sha256_cbor", seed="0").hash_blocks(list(range(1, 32 * 16 + 1)), 16)
    return kv, planner, store, engine, hashes


def _block(kv, b) -> bytes:
    return kv[b].contiguous().view(torch.uint8).cpu().numpy().tobytes()


@cuda_only
def test_cuda_save_is_read_before_the_caller_rewrites_its_blocks():
    """B4: ``submit`` makes the caller's stream wait for the save gathers, so KV written right
    after it returns (no fence wait, no host sync) never reaches the store. The gathers are held
    back on the side stream to make the race certain."""
    kv, planner, store, engine, hashes = _cuda_engine()
    table = list(range(1, 33))
    want = {key: _block(kv, b) for key, _, b in planner.plan_save(hashes, [table], 32 * 16).puts}
    caller = torch.cuda.Stream()
    with torch.cuda.stream(engine.transfer.stream):
        torch.cuda._sleep(200_000_000)  # the side stream is busy: the gathers run late
    with torch.cuda.stream(caller):
        engine.submit(saves=[SaveRequest("r", hashes, [table], 32 * 16)])
        kv.zero_()  # the next step's writes, queued on the caller's stream at once
    assert engine.wait_idle(60) and not engine.get_finished().saves_failed
    assert store.values.keys() == want.keys()
    assert all(store.values[key] == value for key, value in want.items())
    engine.shutdown()


@cuda_only
def test_cuda_planned_saves_are_read_before_a_fenced_block_is_rewritten():
    """The connector's path: ``submit_planned`` with the group fenced leaves the caller's stream
    free, and ``fence`` on the blocks before rewriting them keeps the KV written right after
    out of the store. The gathers are held back on the side stream to make the race certain."""
    kv, planner, store, engine, hashes = _cuda_engine()
    table = list(range(1, 33))
    puts = planner.plan_save(hashes, [table], 32 * 16).puts
    want = {key: _block(kv, b) for key, _, b in puts}
    caller = torch.cuda.Stream()
    with torch.cuda.stream(engine.transfer.stream):
        torch.cuda._sleep(200_000_000)  # the side stream is busy: the gathers run late
    with torch.cuda.stream(caller):
        engine.submit_planned(puts={1: puts}, fenced_groups=[0])
        assert engine.fence(table) > 0  # vLLM hands the blocks out again
        kv.zero_()  # the next step's writes, queued on the caller's stream at once
    assert engine.wait_idle(60) and engine.get_finished().jobs_done == {1: "ok"}
    assert store.values.keys() == want.keys()
    assert all(store.values[key] == value for key, value in want.items())
    engine.shutdown()


@cuda_only
def test_cuda_planned_saves_into_the_slots_are_read_before_a_fenced_block_is_rewritten():
    """The connector's default path: the engine's launch lane launches the copies into the
    arena's slots after the caller's event; once they are launched, ``fence`` on the blocks
    before rewriting them keeps the KV written right after out of the slots. The copies are
    held back on the save stream to make the race certain."""
    from kvstride.arena import ArenaSlots

    kv = torch.randn(80, 2, 16, 4, 32, device="cuda", dtype=torch.float16)
    layout = KVLayout({"attn": kv}, [["attn"]])
    planner = _core.KeyPlanner([_core.GroupSpec("full_attention", 16)], hash_block_size=16, scheduler_block_size=16, namespace="cuda")
    store = ArenaSlots(40)
    engine = OffloadEngine(planner, layout, store)
    want = kv[1:33].clone()
    caller = torch.cuda.Stream()
    with torch.cuda.stream(store.arena._device.pipeline.gather):
        torch.cuda._sleep(200_000_000)  # the save stream is busy: the copies run late
    with torch.cuda.stream(caller):
        engine.submit_planned(puts={1: [(i, 0, 1 + i) for i in range(32)]}, fenced_groups=[0])
        engine._launch_queue.join()  # launched (a fence before that would cancel them)
        assert engine.fence(range(1, 33)) > 0  # vLLM hands the blocks out again
        kv.zero_()  # the next step's writes, queued on the caller's stream at once
    assert engine.wait_idle(60) and engine.get_finished().jobs_done == {1: "ok"}
    assert store.arena.load(np.arange(32), np.zeros(32, dtype=np.int64), np.arange(41, 73)).all()
    assert torch.equal(kv[41:73], want)
    engine.shutdown()


@cuda_only
@pytest.mark.parametrize("direct", [False, True], ids=["staged", "direct"])
def test_cuda_load_writes_after_the_callers_pending_work(direct):
    """B4: a load's scatter (or, into a direct store's slots, its copy) runs on the load lane's
    thread, but after the work the caller's stream had queued when it submitted the load (here:
    writes to the destination blocks)."""
    kv, planner, store, engine, hashes = _cuda_engine(direct)
    table = list(range(1, 33))
    engine.submit(saves=[SaveRequest("r", hashes, [table], 32 * 16)])
    assert engine.wait_idle(60) and not engine.get_finished().saves_failed
    want = [_block(kv, b) for b in table]
    dst = list(range(40, 72))
    caller = torch.cuda.Stream()
    with torch.cuda.stream(caller):
        torch.cuda._sleep(200_000_000)  # the caller's stream is busy ...
        kv.index_fill_(0, torch.tensor(dst, device="cuda"), 0)  # ... then writes the destinations
        engine.submit(loads=[LoadRequest("q", hashes, [dst], 32 * 16)])
    assert engine.wait_idle(60) and not engine.get_finished().loads_failed
    torch.cuda.synchronize()
    assert [_block(kv, b) for b in dst] == want
    engine.shutdown()
