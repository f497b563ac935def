"""kvstride.stores: the protocol, verified reads, and the embedded store."""

import numpy as np
import pytest
import torch

import kvdata
from kvstride.layout import KVLayout
from kvstride.stores import HEADER_BYTES, EmbeddedStore, Status
from kvstride.transfer import StagingPool, Transfer


def _bufs(n, size, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 256, size, dtype=np.uint8), rng.integers(0, 256, 7, dtype=np.uint8)] for _ in range(n)]


def _zeros(n, size):
    return [[np.zeros(size, np.uint8), np.zeros(7, np.uint8)] for _ in range(n)]


@pytest.mark.parametrize("mix", sorted(kvdata.MIXES))
def test_embedded_round_trip_every_layout(mix):
    store = EmbeddedStore(64 << 20, fingerprint=b"fp")
    put, got, ok = kvdata.save_load_round_trip(store, mix, seed=11)
    assert all(s is Status.OK for s in put + got) and ok


def test_put_idempotent_and_get_dedup():
    s = EmbeddedStore(1 << 20)
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
    s = EmbeddedStore(3 * (val + 7 + HEADER_BYTES))
    for i in range(3):
        assert s.put([f"k{i}"], [_bufs(1, val, i)[0]]) == [Status.OK]
    s.get(["k0"], _zeros(1, val))  # k0 is now the most recent
    assert s.put(["k3"], [_bufs(1, val, 3)[0]]) == [Status.OK]
    assert s.exists(["k0", "k1", "k2", "k3"]) == [True, False, True, True]
    assert s.counters["evicted"] == 1
    assert s.put(["huge"], [[np.zeros(4 * val, np.uint8)]]) == [Status.FULL]
    assert s.used <= s.capacity


def test_eviction_between_exists_and_get_writes_nothing():
    kv, groups = kvdata.flash_attn(nb=16)
    layout = KVLayout(kv, groups)
    kvdata.fill_random(layout.storages, 1)
    bb = layout.groups[0].block_bytes
    s = EmbeddedStore(4 * (bb + HEADER_BYTES))
    tr = Transfer(layout, StagingPool(4 << 20))
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
    s = EmbeddedStore(1 << 20, fingerprint=b"12345678")
    src = _bufs(2, 4096)
    s.put(["x", "y"], src)
    s._data["x"][HEADER_BYTES + 100] ^= 0x01  # flip one payload bit
    dst = _zeros(2, 4096)
    assert s.get(["x", "y"], dst) == [Status.CORRUPT, Status.OK]
    assert not dst[0][0].any()  # the embedded store does not even write the destination
    assert s.exists(["x"]) == [False]  # dropped, so the next put rewrites it
    assert s.counters["get.corrupt"] == 1


def test_header_mismatches_are_corrupt():
    s = EmbeddedStore(1 << 20, fingerprint=b"AAAAAAAA")
    s.put(["k"], _bufs(1, 512))
    other = EmbeddedStore(1 << 20, fingerprint=b"BBBBBBBB")
    other._data["k"] = s._data["k"]  # a value written under another layout
    assert other.get(["k"], _zeros(1, 512)) == [Status.CORRUPT]
    other._data["k2"] = s._data["k"]  # under another key
    other.fingerprint = b"AAAAAAAA"
    assert other.get(["k2"], _zeros(1, 512)) == [Status.CORRUPT]
    assert s.get(["k"], _zeros(1, 500)) == [Status.CORRUPT]  # length mismatch
    assert s.get(["k"], _zeros(1, 512)) == [Status.OK]  # still intact for the right reader


def test_verify_off_still_checks_header():
    s = EmbeddedStore(1 << 20, verify=False)
    s.put(["k"], _bufs(1, 256))
    s._data["k"][HEADER_BYTES + 3] ^= 1
    assert s.get(["k"], _zeros(1, 256)) == [Status.OK]  # no hash: the cheap mode
    v = EmbeddedStore(1 << 20, verify=True)
    v._data["k"] = s._data["k"]
    assert v.get(["k"], _zeros(1, 256)) == [Status.CORRUPT]  # unhashed values are refused when verifying


def test_bad_input_is_a_status_not_an_exception():
    s = EmbeddedStore(1 << 20)
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
    s = EmbeddedStore(1 << 20)
    t = torch.arange(100, dtype=torch.int32)
    a = np.arange(50, dtype=np.uint8)
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
    import xxhash

    from kvstride import stores

    src = _bufs(3, 70_000, seed=5)
    s = EmbeddedStore(1 << 22, fingerprint=b"12345678")
    assert s.put(["a", "b", "c"], src) == [Status.OK] * 3
    value = s._data["b"]
    digest = stores._HDR.unpack_from(value[:HEADER_BYTES].tobytes(), 0)[-1]
    assert digest == xxhash.xxh3_64_intdigest(value[HEADER_BYTES:].tobytes())
    # Values written with the Rust hash read back with the xxhash package, and the other way.
    monkeypatch.setattr(stores, "_xxh3_parts", None)
    monkeypatch.setattr(stores, "_xxh3_batch", None)
    dst = _zeros(3, 70_000)
    assert s.get(["a", "b", "c"], dst) == [Status.OK] * 3
    assert s.put(["d"], src[:1]) == [Status.OK]
    monkeypatch.undo()
    assert s.get(["d"], dst[:1]) == [Status.OK]
    assert all((d[0] == x[0]).all() and (d[1] == x[1]).all() for d, x in zip(dst, src))


@pytest.mark.parametrize("where", [0, 1000, 70_000 - 1, 70_000 + 3])
def test_rust_hash_catches_a_flipped_bit_anywhere(where):
    s = EmbeddedStore(1 << 22, fingerprint=b"12345678")
    src = _bufs(2, 70_000, seed=7)
    assert s.put(["x", "y"], src) == [Status.OK, Status.OK]
    s._data["y"][HEADER_BYTES + where] ^= 0x80
    dst = _zeros(2, 70_000)
    assert s.get(["x", "y"], dst) == [Status.OK, Status.CORRUPT]
    assert not dst[1][0].any() and not dst[1][1].any()
