"""kvstride.stores: the protocol, verified reads, and the embedded store."""

import numpy as np
import pytest
import torch

import kvdata
from kvstride.layout import KVLayout
from kvstride.stores import EmbeddedStore, Status
from kvstride.transfer import StagingPool, Transfer


def _bufs(n, size, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 256, size, dtype=np.uint8), rng.integers(0, 256, 7, dtype=np.uint8)] for _ in range(n)]


def _zeros(n, size):
    return [[np.zeros(size, np.uint8), np.zeros(7, np.uint8)] for _ in range(n)]


def _largest_block(mix):
    kv, groups = kvdata.MIXES[mix]()
    return max(g.block_bytes for g in KVLayout(kv, groups).groups)


@pytest.mark.parametrize("mix", sorted(kvdata.MIXES))
def test_embedded_round_trip_every_layout(mix):
    store = EmbeddedStore(64 << 20, fingerprint=b"fp", slot_bytes=_largest_block(mix))
    put, got, ok = kvdata.save_load_round_trip(store, mix, seed=11)
    assert all(s is Status.OK for s in put + got) and ok


@pytest.mark.parametrize("mix", sorted(kvdata.MIXES))
def test_embedded_blocks_go_straight_between_kv_and_slots(mix):
    kv, groups = kvdata.MIXES[mix]()
    layout = KVLayout(kv, groups)
    kvdata.fill_random(layout.storages, 5)
    store = EmbeddedStore(64 << 20)
    store.bind_layout(layout)
    assert store.slot_bytes >= max(g.block_bytes for g in layout.groups)
    src = [(g.group, b) for g in layout.groups for b in (1, 2)]
    dst = [(g.group, b) for g in layout.groups for b in (3, 4)]
    keys = [f"k{g}-{b}" for g, b in src]
    want = [bytes(store_block(layout, g, b)) for g, b in src]
    assert store.save_blocks(keys, *zip(*((g, b) for g, b in src))) == [Status.OK] * len(keys)
    for t in layout.storages:
        t.zero_()
    assert store.load_blocks(keys, *zip(*((g, b) for g, b in dst))) == [Status.OK] * len(keys)
    assert [bytes(store_block(layout, g, b)) for g, b in dst] == want


def store_block(layout, g, b):
    """The bytes of block ``b`` of group ``g``, piece by piece."""
    out = bytearray()
    for p in layout.groups[g].pieces:
        flat = layout.storages[p.storage]
        out += flat[p.offset + b * p.stride : p.offset + b * p.stride + p.size].numpy().tobytes()
    return out


def test_put_idempotent_and_get_dedup():
    s = EmbeddedStore(1 << 20, slot_bytes=2048)
    src = _bufs(3, 1000)
    assert s.put(["a", "b", "a"], [src[0], src[1], src[2]]) == [Status.OK] * 3
    assert s.put(["a"], [src[2]]) == [Status.OK]  # present: left as it was
    assert s.exists(["a", "b", "c"]) == [True, True, False]
    dst = _zeros(4, 1000)
    assert s.get(["a", "b", "a", "c"], dst) == [Status.OK, Status.OK, Status.OK, Status.MISSING]
    for d in (dst[0], dst[2]):
        assert all((x == y).all() for x, y in zip(d, src[0]))  # first writer wins, both destinations written
    assert not dst[3][0].any() and not dst[3][1].any()
    assert s.counters["get.missing"] == 1 and s.counters["get.ok"] == 3


def test_lru_eviction_and_full():
    val = 10_000
    s = EmbeddedStore(3 * (val + 64), slot_bytes=val + 7)
    assert s.num_slots == 3 and s.nbytes <= s.capacity
    for i in range(3):
        assert s.put([f"k{i}"], [_bufs(1, val, i)[0]]) == [Status.OK]
    s.get(["k0"], _zeros(1, val))  # k0 is now the most recent
    assert s.put(["k3"], [_bufs(1, val, 3)[0]]) == [Status.OK]
    assert s.exists(["k0", "k1", "k2", "k3"]) == [True, False, True, True]
    assert s.evictions == 1
    assert s.put(["huge"], [[np.zeros(4 * val, np.uint8)]]) == [Status.FULL]
    assert s.used <= s.capacity


def test_a_slot_being_read_is_never_evicted():
    s = EmbeddedStore(2 * 4096, slot_bytes=4096)
    src = _bufs(2, 1000)
    s.put(["a", "b"], src)
    with s._lock:  # a load of "a" and "b" in flight
        slots = s._index.pin(["a", "b"])
    assert s.put(["c"], _bufs(1, 1000, 9)) == [Status.FULL]
    with s._lock:
        s._index.unpin(slots)
    assert s.put(["c"], _bufs(1, 1000, 9)) == [Status.OK]
    assert s.exists(["a", "b", "c"]) == [False, True, True]


def test_a_put_without_a_slot_size_is_refused_clearly():
    s = EmbeddedStore(1 << 20)
    assert s.put(["k"], _bufs(1, 100)) == [Status.INVALID]
    assert s.nbytes == 0
    with pytest.raises(ValueError, match="slot_bytes=10"):
        EmbeddedStore(1 << 20, slot_bytes=10).bind_layout(KVLayout(*kvdata.flash_attn(nb=4)))
    with pytest.raises(ValueError, match="slot_bytes"):
        EmbeddedStore(100, slot_bytes=1000)


def test_eviction_between_exists_and_get_writes_nothing():
    kv, groups = kvdata.flash_attn(nb=16)
    layout = KVLayout(kv, groups)
    kvdata.fill_random(layout.storages, 1)
    bb = layout.groups[0].block_bytes
    s = EmbeddedStore(4 * bb, slot_bytes=bb)
    tr = Transfer(layout, StagingPool(4 << 20))
    tr.pool.register(s.register_buffer)  # the staged parts are raw addresses into the pool
    src = [(0, b) for b in range(4)]
    keys = [f"e{b}" for b in range(4)]
    with tr.stage(src) as batch:
        tr.gather(batch).wait()
        assert s.put(keys, batch.all_parts()) == [Status.OK] * 4
    assert s.exists(keys) == [True] * 4
    # Another request's saves evict two of them before our get.
    with tr.stage([(0, 10), (0, 11)]) as batch:
        tr.gather(batch).wait()
        s.put(["other0", "other1"], batch.all_parts())
    before = kv["fa.0"].view(torch.uint8).clone()
    dst = [(0, b) for b in range(12, 16)]
    with tr.stage(dst) as batch:
        st = s.get(keys, batch.all_parts())
        tr.scatter(batch, ok=[x is Status.OK for x in st]).wait()
    assert st == [Status.MISSING, Status.MISSING, Status.OK, Status.OK]
    after = kv["fa.0"].view(torch.uint8)
    assert torch.equal(after[:, 12:14], before[:, 12:14])  # failed blocks untouched
    assert torch.equal(after[:, 14], after[:, 2]) and torch.equal(after[:, 15], after[:, 3])


def test_corrupt_value_is_a_miss_and_never_reaches_a_block():
    s = EmbeddedStore(1 << 20, fingerprint=b"12345678", slot_bytes=8192)
    src = _bufs(2, 4096)
    s.put(["x", "y"], src)
    s.value_view("x")[100] ^= 0x01  # flip one payload bit
    dst = _zeros(2, 4096)
    assert s.get(["x", "y"], dst) == [Status.CORRUPT, Status.OK]
    assert not dst[0][0].any()  # the embedded store does not even write the destination
    assert s.exists(["x"]) == [False]  # dropped, so the next put rewrites it
    assert s.counters["get.corrupt"] == 1


def test_a_corrupt_block_is_never_loaded_straight_into_the_kv_cache():
    kv, groups = kvdata.flash_attn(nb=8)
    layout = KVLayout(kv, groups)
    kvdata.fill_random(layout.storages, 2)
    s = EmbeddedStore(1 << 22)
    s.bind_layout(layout)
    assert s.save_blocks(["a", "b"], [0, 0], [1, 2]) == [Status.OK, Status.OK]
    s.value_view("b")[7] ^= 0x40
    untouched = [store_block(layout, 0, b) for b in (6, 7)]
    assert s.load_blocks(["a", "b", "zz"], [0, 0, 0], [5, 6, 7]) == [Status.OK, Status.CORRUPT, Status.MISSING]
    assert store_block(layout, 0, 5) == store_block(layout, 0, 1)
    assert [store_block(layout, 0, b) for b in (6, 7)] == untouched
    assert s.exists(["a", "b"]) == [True, False]


def test_length_mismatch_is_corrupt_and_the_value_stays_for_the_right_reader():
    s = EmbeddedStore(1 << 20, slot_bytes=1024)
    s.put(["k"], _bufs(1, 512))
    assert s.get(["k"], _zeros(1, 500)) == [Status.CORRUPT]  # length mismatch
    assert s.get(["k"], _zeros(1, 512)) == [Status.OK]  # still intact for the right reader


def test_verify_off_skips_the_hash():
    s = EmbeddedStore(1 << 20, verify=False, slot_bytes=1024)
    s.put(["k"], _bufs(1, 256))
    s.value_view("k")[3] ^= 1
    assert s.get(["k"], _zeros(1, 256)) == [Status.OK]  # no hash: the cheap mode


def test_bad_input_is_a_status_not_an_exception():
    s = EmbeddedStore(1 << 20, slot_bytes=1024)
    assert s.put(["", "ok"], _bufs(2, 10)) == [Status.INVALID, Status.OK]
    assert s.put(["a"], [[np.zeros(0, np.uint8)]]) == [Status.INVALID]
    assert s.put(["a", "b"], _bufs(1, 10)) == [Status.INVALID, Status.INVALID]
    assert s.get(["ok"], [[b"readonly-bytes"]]) == [Status.INVALID]
    assert s.get(["ok"], [[torch.zeros(4, 4).t()]]) == [Status.INVALID]
    s.close()
    assert s.put(["z"], _bufs(1, 10)) == [Status.UNAVAILABLE]
    assert s.get(["ok"], _zeros(1, 10)) == [Status.UNAVAILABLE]
    assert s.exists(["ok"]) == [False]


def test_parts_as_addresses_and_tensors():
    s = EmbeddedStore(1 << 20, slot_bytes=1024)
    t = torch.arange(100, dtype=torch.int32)
    a = np.arange(50, dtype=np.uint8)
    s.register_buffer(a.ctypes.data, a.nbytes)
    assert s.put(["k"], [[t, (a.ctypes.data, a.nbytes)]]) == [Status.OK]
    t2, a2 = torch.zeros_like(t), np.zeros_like(a)
    assert s.get(["k"], [[t2, a2]]) == [Status.OK]
    assert torch.equal(t, t2) and (a == a2).all()
    # A different split of the same total also works.
    whole = np.zeros(450, np.uint8)
    assert s.get(["k"], [[whole]]) == [Status.OK]
    assert bytes(whole[:400]) == t.numpy().tobytes()


# ---- the payload hash (Rust core: kvstride._core.xxh3_64_parts / xxh3_64_batch) ----------


@pytest.mark.parametrize("n", [0, 1, 17, 240, 241, 1023, 1024, 1025, 1088, 1089, 4096, 65_537, 1 << 20])
def test_rust_payload_hash_equals_xxhash(n):
    import xxhash

    from kvstride import _core

    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    want = xxhash.xxh3_64_intdigest(data.tobytes())
    assert _core.xxh3_64_parts(data) == want
    assert _core.xxh3_64_parts([data]) == want
    for cuts in ([n // 2], [1, n // 3, n - 1], [63, 64, 1000]):
        cuts = sorted(min(max(c, 0), n) for c in cuts)
        pieces = np.split(data, cuts)
        # every kind of part: numpy, bytes, bytearray, memoryview, an empty part
        mixed = [pieces[0], b"", *[bytes(p) if i % 3 == 0 else bytearray(p) if i % 3 == 1 else memoryview(p) for i, p in enumerate(pieces[1:])]]
        assert _core.xxh3_64_parts(mixed) == want
        assert _core.xxh3_64_parts(tuple(pieces)) == want
    # other dtypes hash their bytes in memory order
    if n % 4 == 0:
        assert _core.xxh3_64_parts(data.view(np.int32)) == want


def test_rust_payload_hash_batch_and_bad_parts():
    import xxhash

    from kvstride import _core

    rng = np.random.default_rng(3)
    values = [[rng.integers(0, 256, 300_000, dtype=np.uint8), rng.integers(0, 256, k, dtype=np.uint8)] for k in range(0, 40, 3)]
    want = [xxhash.xxh3_64_intdigest(b"".join(p.tobytes() for p in v)) for v in values]
    assert _core.xxh3_64_batch(values) == want  # > 1 MiB in all: spread over threads
    assert _core.xxh3_64_batch(values[:2]) == want[:2]
    assert _core.xxh3_64_batch([]) == []
    with pytest.raises(ValueError):
        _core.xxh3_64_parts([np.zeros((4, 4), np.uint8)[:, 1]])  # not contiguous
    with pytest.raises(TypeError):
        _core.xxh3_64_parts([12345])
    with pytest.raises(TypeError):
        _core.xxh3_64_parts([torch.zeros(4)])  # tensors go through numpy views (stores._views)


def test_wire_format_same_with_and_without_the_rust_hash(monkeypatch):
    """The header (Mooncake values) carries the same XXH3-64 from the Rust core and from the
    xxhash package, so values read back across both."""
    import xxhash

    from kvstride.stores import base as stores

    store = stores.KVStore(fingerprint=b"12345678")
    value = _bufs(1, 70_000, seed=5)[0]
    parts = [(p.ctypes.data, p.nbytes) for p in value]
    header = store._make_header("k", parts)
    assert stores._HDR.unpack_from(header, 0)[-1] == xxhash.xxh3_64_intdigest(b"".join(p.tobytes() for p in value))
    monkeypatch.setattr(stores, "_xxh3_parts", None)
    monkeypatch.setattr(stores, "_xxh3_batch", None)
    assert store._check("k", header, parts) == ""
    assert store._make_header("k", parts) == header


def test_embedded_digest_is_the_xxh3_of_the_value():
    import xxhash

    s = EmbeddedStore(1 << 22, slot_bytes=200_000)
    assert s.put(["a", "b"], _bufs(2, 70_000, seed=5)) == [Status.OK] * 2
    slot = s._index.slot("b")
    assert int(s.arena.digests[slot]) == xxhash.xxh3_64_intdigest(s.value_view("b").tobytes())


@pytest.mark.parametrize("where", [0, 1000, 70_000 - 1, 70_000 + 3])
def test_rust_hash_catches_a_flipped_bit_anywhere(where):
    s = EmbeddedStore(1 << 22, fingerprint=b"12345678", slot_bytes=70_007)
    src = _bufs(2, 70_000, seed=7)
    assert s.put(["x", "y"], src) == [Status.OK, Status.OK]
    s.value_view("y")[where] ^= 0x80
    dst = _zeros(2, 70_000)
    assert s.get(["x", "y"], dst) == [Status.OK, Status.CORRUPT]
    assert not dst[1][0].any() and not dst[1][1].any()


def test_embedded_resident_bytes_stay_within_the_budget():
    """The embedded store is one arena of ``capacity // slot`` slots, touched when it is
    sized; saving and loading through it allocates nothing per value."""
    import os

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    kv, groups = kvdata.flash_attn(nb=64)
    layout = KVLayout(kv, groups)
    kvdata.fill_random(layout.storages, 3)
    budget = 128 << 20
    before = resident()
    store = EmbeddedStore(budget)
    store.bind_layout(layout)
    assert store.nbytes <= budget and resident() - before >= 0.99 * store.nbytes
    ids = list(range(1, 64))
    for rep in range(4 * store.num_slots // len(ids) + 1):  # fill it several times over: evictions
        keys = [f"r{rep}-{b}" for b in ids]
        assert store.save_blocks(keys, [0] * len(ids), ids) == [Status.OK] * len(ids)
        assert store.load_blocks(keys, [0] * len(ids), ids) == [Status.OK] * len(ids)
    assert store.evictions > 0 and store.used <= budget
    grown = resident() - before
    assert grown <= budget * 1.01 + (8 << 20), grown  # + the interpreter's own noise


# ---- memory safety: raw addresses, repeated keys (review B12, C4) -------------------------------


def test_raw_addresses_only_inside_registered_buffers():
    """A raw ``(address, nbytes)`` part names memory the store was handed (register_buffer);
    anywhere else the whole call is INVALID and no byte is read or written."""
    s = EmbeddedStore(1 << 20, slot_bytes=1024)
    value = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, np.uint8)
    raw_put, raw_get = (value.ctypes.data, value.nbytes), (dst.ctypes.data, dst.nbytes)
    assert s.put(["k"], [[raw_put]]) == [Status.INVALID]
    assert s.put(["k", "j"], [[value], raw_put]) == [Status.INVALID] * 2  # the whole call
    assert s.put(["k"], [[value]]) == [Status.OK]
    assert s.get(["k"], [[raw_get]]) == [Status.INVALID] and not dst.any()
    assert s.counters["put.invalid"] == 3 and s.counters["get.invalid"] == 1

    s.register_buffer(value.ctypes.data, value.nbytes)
    s.register_buffer(dst.ctypes.data, dst.nbytes)
    assert s.put(["r"], [[raw_put]]) == [Status.OK]
    assert s.get(["r"], [[raw_get]]) == [Status.OK] and (dst == value).all()
    # One byte past a registered buffer, a negative size, an address below it: refused.
    past, before = (dst.ctypes.data + 1, dst.nbytes), (dst.ctypes.data - 8, 8)
    for bad in (past, (dst.ctypes.data, -1), before):
        assert s.get(["r"], [[bad]]) == [Status.INVALID]
    with pytest.raises(ValueError):
        s.register_buffer(0, 64)


def test_repeated_key_with_another_size_is_invalid():
    """A key asked twice in one get is fetched once and copied to the second destination; a
    second destination of another size than the value would read past it (and report OK)."""
    s = EmbeddedStore(1 << 20, slot_bytes=1024)
    value = np.frombuffer(bytes(range(1, 9)), np.uint8).copy()
    assert s.put(["k"], [[value]]) == [Status.OK]
    small, large, same = np.zeros(8, np.uint8), np.full(4096, 0xEE, np.uint8), np.zeros(8, np.uint8)
    assert s.get(["k", "k", "k"], [[small], [large], [same]]) == [Status.OK, Status.INVALID, Status.OK]
    assert (small == value).all() and (same == value).all()
    assert (large == 0xEE).all()  # left as it was: no bytes from past the value
    # The other way round: the first destination is the odd one, the value is read for it alone.
    small[:] = 0
    assert s.get(["k", "k"], [[large], [small]]) == [Status.CORRUPT, Status.INVALID]
    assert not small.any()
    # put: one key with two sizes in one call is refused for the later one.
    assert s.put(["n", "n"], [[value], [np.zeros(16, np.uint8)]]) == [Status.OK, Status.INVALID]


def test_counters_are_exact_under_threads(caplog):
    """``_note`` runs on the caller's thread and the engine's lanes at once: no count is lost
    and a status is logged once. The counter and the log-once set hand the GIL over between
    their read and their write, as a thread switch there would."""
    import collections
    import threading
    import time

    class Yielding(collections.Counter):
        def __getitem__(self, key):
            value = super().__getitem__(key)
            time.sleep(0)
            return value

    class YieldingSet(set):
        def __contains__(self, item):
            found = super().__contains__(item)
            time.sleep(0)
            return found

    s = EmbeddedStore(1 << 20, slot_bytes=1024)
    s.counters, s._logged = Yielding(), YieldingSet()
    threads, per_thread = 8, 200

    def work():
        for _ in range(per_thread):
            s._note("get", Status.MISSING)

    with caplog.at_level("WARNING", logger="kvstride.stores"):
        ts = [threading.Thread(target=work) for _ in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    assert s.counters["get.missing"] == threads * per_thread
    assert len([r for r in caplog.records if "missing" in r.getMessage()]) == 1
