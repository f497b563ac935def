"""kvstride.stores.MooncakeStore against a real mooncake_master on loopback."""

import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

import kvdata
from kvstride import _core
from kvstride.engine import LoadRequest, OffloadEngine, SaveRequest
from kvstride.layout import KVLayout
from kvstride.mooncake_config import resolve_client_config
from kvstride.stores import MooncakeStore, Status
from kvstride.stores.base import HEADER_BYTES
from kvstride.stores.mooncake_master import _free_port
from kvstride.transfer import StagingPool, Transfer
from mooncake_fixture import fresh_master, mooncake_master, mooncake_store  # noqa: F401

FP = b"testfp01"
BLOCK = 16  # tokens per block in the engine tests


@pytest.mark.parametrize("mix", ["flash_attn", "ring_and_big", "hybrid_mamba", "mamba_raw_pages", "mla", "gemma_like"])
def test_round_trip(mooncake_store, mix):
    put, got, ok = kvdata.save_load_round_trip(mooncake_store, mix, tag=mix, seed=5)
    assert all(s is Status.OK for s in put + got) and ok
    # Idempotent: saving again is fine and keeps the value.
    put2, got2, ok2 = kvdata.save_load_round_trip(mooncake_store, mix, tag=mix, seed=5)
    assert all(s is Status.OK for s in put2 + got2) and ok2


def _setup_blocks(store, nb=16, seed=0):
    kv, groups = kvdata.flash_attn(nb=nb)
    layout = KVLayout(kv, groups)
    kvdata.fill_random(layout.storages, seed)
    pool = StagingPool(8 << 20)
    pool.register(store.register_buffer)
    return kv, layout, Transfer(layout, pool)


def _bytes(kv):
    return kv["fa.0"].view(torch.uint8).clone(), kv["fa.1"].view(torch.uint8).clone()


def test_duplicates_in_one_batch(mooncake_store):
    kv, layout, tr = _setup_blocks(mooncake_store, seed=1)
    keys = ["dup-a", "dup-b", "dup-a"]
    with tr.stage([(0, 0), (0, 1), (0, 0)]) as b:
        tr.gather(b).wait()
        assert mooncake_store.put(keys, b.all_parts()) == [Status.OK] * 3
    ref = _bytes(kv)
    with tr.stage([(0, 5), (0, 6), (0, 7), (0, 8)]) as b:
        st = mooncake_store.get(keys + ["dup-b"], b.all_parts())
        assert st == [Status.OK] * 4
        tr.scatter(b, ok=[s is Status.OK for s in st]).wait()
    now = _bytes(kv)
    for d, s in ((5, 0), (6, 1), (7, 0), (8, 1)):  # both destinations of dup-a written
        assert torch.equal(now[0][:, d], ref[0][:, s]) and torch.equal(now[1][:, d], ref[1][:, s])


def test_corrupted_value_never_reaches_a_block(mooncake_store):
    kv, layout, tr = _setup_blocks(mooncake_store, seed=2)
    with tr.stage([(0, 0), (0, 1)]) as b:
        tr.gather(b).wait()
        assert mooncake_store.put(["cor-0", "cor-1"], b.all_parts()) == [Status.OK] * 2
    raw = mooncake_store.client
    size = 64 + layout.groups[0].block_bytes
    v = np.zeros(size, np.uint8)
    assert raw.get_into("cor-0", v.ctypes.data, size) == size
    v[64 + 1234] ^= 0x10
    assert raw.upsert_from("cor-0", v.ctypes.data, size) == 0
    before = _bytes(kv)
    with tr.stage([(0, 10), (0, 11)]) as b:
        st = mooncake_store.get(["cor-0", "cor-1"], b.all_parts())
        tr.scatter(b, ok=[s is Status.OK for s in st]).wait()
    assert st == [Status.CORRUPT, Status.OK]
    after = _bytes(kv)
    assert torch.equal(after[0][:, 10], before[0][:, 10]) and torch.equal(after[1][:, 10], before[1][:, 10])
    assert torch.equal(after[0][:, 11], before[0][:, 1])
    assert mooncake_store.exists(["cor-0"]) == [False]  # dropped so that a later save rewrites it
    # A value of another size under the key (e.g. another layout): corrupt, not copied.
    assert raw.upsert_from("cor-1", v.ctypes.data, size - 100) == 0
    with tr.stage([(0, 12)]) as b:
        assert mooncake_store.get(["cor-1"], b.all_parts()) == [Status.CORRUPT]


def test_eviction_between_exists_and_get(mooncake_store):
    kv, layout, tr = _setup_blocks(mooncake_store, seed=3)
    keys = [f"ev-{i}" for i in range(4)]
    with tr.stage([(0, i) for i in range(4)]) as b:
        tr.gather(b).wait()
        assert mooncake_store.put(keys, b.all_parts()) == [Status.OK] * 4
    assert mooncake_store.exists(keys) == [True] * 4
    assert list(mooncake_store.client.batch_remove(keys[:2], True)) == [0, 0]  # evicted meanwhile
    before = _bytes(kv)
    with tr.stage([(0, 12), (0, 13), (0, 14), (0, 15)]) as b:
        st = mooncake_store.get(keys, b.all_parts())
        tr.scatter(b, ok=[s is Status.OK for s in st]).wait()
    assert st == [Status.MISSING, Status.MISSING, Status.OK, Status.OK]
    after = _bytes(kv)
    assert torch.equal(after[0][:, 12:14], before[0][:, 12:14])
    assert torch.equal(after[0][:, 14:16], before[0][:, 2:4])


def test_store_full(fresh_master):
    store = MooncakeStore(fresh_master, segment_bytes=16 << 20, fingerprint=FP)
    try:
        rng = np.random.default_rng(0)
        vals = {f"full-{i}": rng.integers(0, 256, 1 << 20, dtype=np.uint8) for i in range(40)}
        keys = list(vals)
        st = store.put(keys, [[vals[k]] for k in keys])
        assert Status.FULL in st and Status.OK in st
        assert set(st) <= {Status.OK, Status.FULL}
        assert store.counters["put.full"] == st.count(Status.FULL)
        dst = [np.zeros(1 << 20, np.uint8) for _ in keys]
        got = store.get(keys, [[d] for d in dst])
        for k, s, g, d in zip(keys, st, got, dst):
            assert g in (Status.OK, Status.MISSING)
            if g is Status.OK:
                assert (d == vals[k]).all()
            if s is Status.FULL:
                assert g is Status.MISSING
    finally:
        store.close()


def test_master_killed_mid_put_and_mid_get(fresh_master):
    store = MooncakeStore(fresh_master, segment_bytes=64 << 20, fingerprint=FP, retry_after_s=0.5)
    kv, layout, tr = _setup_blocks(store, nb=64, seed=4)
    results, errors = [], []
    stop = threading.Event()

    def worker():
        try:
            i = 0
            while not stop.is_set() and i < 400:
                src = [(0, (i * 4 + j) % 32) for j in range(4)]
                keys = [f"kill-{i}-{j}" for j in range(4)]
                with tr.stage(src) as b:
                    tr.gather(b).wait()
                    p = store.put(keys, b.all_parts())
                dst = [(0, 32 + (i * 4 + j) % 32) for j in range(4)]
                snap = _bytes(kv)
                with tr.stage(dst) as b:
                    g = store.get(keys, b.all_parts())
                    tr.scatter(b, ok=[s is Status.OK for s in g]).wait()
                results.append((src, dst, p, g, snap, _bytes(kv)))
                if sum(s is Status.UNAVAILABLE for s in g) == 4 and len([r for r in results if Status.UNAVAILABLE in r[3]]) >= 3:
                    break
                i += 1
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=worker)
    th.start()
    time.sleep(0.3)
    fresh_master.kill()
    th.join(60)
    stop.set()
    assert not errors, errors
    assert any(Status.UNAVAILABLE in p + g for _, _, p, g, _, _ in results)
    for src, dst, p, g, snap, after in results:
        for (_, s), (_, d), gs in zip(src, dst, g):
            assert gs in (Status.OK, Status.UNAVAILABLE, Status.MISSING)
            if gs is Status.OK:  # exact bytes
                assert torch.equal(after[0][:, d], snap[0][:, s]) and torch.equal(after[1][:, d], snap[1][:, s])
            else:  # untouched
                assert torch.equal(after[0][:, d], snap[0][:, d]) and torch.equal(after[1][:, d], snap[1][:, d])
    assert store.exists(["kill-0-0"]) == [False]  # fast: the master is known down
    # The master comes back on the same ports: the client reconnects, old keys are gone.
    fresh_master.restart()
    deadline = time.monotonic() + 15
    ok = False
    while time.monotonic() < deadline and not ok:
        with tr.stage([(0, 0)]) as b:
            tr.gather(b).wait()
            ok = store.put(["after-restart"], b.all_parts()) == [Status.OK]
        time.sleep(0.2)
    assert ok
    t0 = time.monotonic()
    store.close()
    assert time.monotonic() - t0 < 8


def test_two_processes_share_one_master(mooncake_master, mooncake_store):
    rng = np.random.default_rng(7)
    mine = {f"pa-{i}": rng.integers(0, 256, 50_000, dtype=np.uint8) for i in range(5)}
    assert mooncake_store.put(list(mine), [[v] for v in mine.values()]) == [Status.OK] * 5
    child = textwrap.dedent(
        f"""
        import json, sys, numpy as np
        from kvstride.stores import MooncakeStore, Status
        s = MooncakeStore({mooncake_master.address!r}, segment_bytes=0, fingerprint={FP!r})
        rng = np.random.default_rng(7)
        theirs = {{f"pa-{{i}}": rng.integers(0, 256, 50_000, dtype=np.uint8) for i in range(5)}}
        dst = [np.zeros(50_000, np.uint8) for _ in theirs]
        st = s.get(list(theirs), [[d] for d in dst])
        same = [bool((d == v).all()) for d, v in zip(dst, theirs.values())]
        rng2 = np.random.default_rng(8)
        mine = [rng2.integers(0, 256, 30_000, dtype=np.uint8) for _ in range(3)]
        pst = s.put([f"pb-{{i}}" for i in range(3)], [[m] for m in mine])
        print(json.dumps({{"get": [x.value for x in st], "same": same, "put": [x.value for x in pst]}}))
        sys.stdout.flush()
        s.close()
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["get"] == ["ok"] * 5 and all(res["same"]) and res["put"] == ["ok"] * 3
    rng2 = np.random.default_rng(8)
    theirs = [rng2.integers(0, 256, 30_000, dtype=np.uint8) for _ in range(3)]
    dst = [np.zeros(30_000, np.uint8) for _ in range(3)]
    assert mooncake_store.get([f"pb-{i}" for i in range(3)], [[d] for d in dst]) == [Status.OK] * 3
    assert all((d == t).all() for d, t in zip(dst, theirs))


def test_dead_master_refused_fast_and_no_call_after_close(mooncake_master):
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="not reachable"):
        MooncakeStore(f"127.0.0.1:{_free_port()}", segment_bytes=0)
    assert time.monotonic() - t0 < 5
    with pytest.raises(ValueError, match="host:port"):
        MooncakeStore("nonsense", segment_bytes=0)
    s = MooncakeStore(mooncake_master, segment_bytes=0, fingerprint=FP)
    s.close()
    s.close()
    a = np.zeros(100, np.uint8)
    assert s.put(["x"], [[a]]) == [Status.UNAVAILABLE]
    assert s.get(["x"], [[a]]) == [Status.UNAVAILABLE]
    assert s.exists(["x"]) == [False]
    assert s.health() == 1 and s.client is None
    with pytest.raises(RuntimeError, match="not registered"):  # refused, not a segfault
        s.register_buffer(a.ctypes.data, a.nbytes)


# ---- the value header in the room staged before the payload ------------------------------------


def test_header_room_stores_the_same_value_format(mooncake_store):
    """A value put with its header in the room before the first part is byte for byte the one
    put with a header part of its own: each reads back through the other, and the stored value
    is header plus payload."""
    room = HEADER_BYTES
    payload = np.random.default_rng(3).integers(0, 256, 2 * 4096, dtype=np.uint8)
    staged = np.zeros(room + payload.nbytes, np.uint8)
    staged[room:] = payload
    with_room = [[staged[: room + 4096], staged[room + 4096 :]]]
    plain = [[payload[:4096], payload[4096:]]]
    stored = []
    for key, parts, header_room in (("room-put", with_room, True), ("room-put", plain, False)):
        assert mooncake_store.put([key], parts, header_room=header_room) == [Status.OK]
        with mooncake_store.raw() as client:
            stored.append(client.get(key))
        mooncake_store.remove([key])
    assert stored[0] == stored[1] and len(stored[0]) == room + payload.nbytes
    assert stored[0][room:] == payload.tobytes()
    assert mooncake_store.put(["room-put"], with_room, header_room=True) == [Status.OK]
    assert mooncake_store.put(["plain-put"], plain) == [Status.OK]
    plain_dst = np.zeros_like(payload)
    assert mooncake_store.get(["room-put"], [[plain_dst]]) == [Status.OK] and (plain_dst == payload).all()
    room_dst = np.zeros_like(staged)
    assert mooncake_store.get(["plain-put"], [[room_dst]], header_room=True) == [Status.OK]
    with mooncake_store.raw() as client:
        assert room_dst.tobytes() == client.get("plain-put")  # the header read into the room
    # A first part too short for the header's room is refused, nothing written.
    short = np.zeros(room - 1, np.uint8)
    assert mooncake_store.put(["room-short"], [[short, payload]], header_room=True) == [Status.INVALID]
    assert mooncake_store.exists(["room-short"]) == [False] and not short.any()


class _PartsSeen:
    """Mooncake's client, recording the part sizes of every value of its batch calls."""

    def __init__(self, client) -> None:
        self.client = client
        self.sizes = {"put": [], "get": []}

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes):
        self.sizes["put"] += sizes
        return self.client.batch_put_from_multi_buffers(keys, ptrs, sizes)

    def batch_get_into_multi_buffers(self, keys, ptrs, sizes):
        self.sizes["get"] += sizes
        return self.client.batch_get_into_multi_buffers(keys, ptrs, sizes)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_engine_puts_each_block_as_one_part_with_its_header(mooncake_store, monkeypatch):
    """The engine on a CPU KV cache stages each block whole, its pieces back to back after
    room for the value header: Mooncake moves a value as one part (each further part cost
    30-50 us of client CPU, half a one-part 8 KiB value's put), and the blocks load back byte
    for byte."""
    kv, layout, tr = _setup_blocks(mooncake_store, seed=7)
    pieces = [p.size for p in layout.groups[0].pieces]
    assert len(pieces) > 1  # a part per piece, or the header in a part of its own, would make more
    planner = _core.KeyPlanner(
        [_core.GroupSpec("full_attention", BLOCK)], hash_block_size=BLOCK, scheduler_block_size=BLOCK,
        namespace=f"test-header-room-{os.getpid()}-{time.monotonic_ns()}",
    )
    seen = _PartsSeen(mooncake_store._client)
    monkeypatch.setattr(mooncake_store, "_client", seen)
    engine = OffloadEngine(planner, tr, mooncake_store)
    try:
        hashes = _core.BlockHasher("sha256_cbor", seed="0").hash_blocks(list(range(1, 4 * BLOCK + 1)), BLOCK)
        ref = _bytes(kv)
        engine.submit(saves=[SaveRequest("r", hashes, [[1, 2, 3, 4]], 4 * BLOCK)])
        assert engine.wait_idle(30) and engine.counters["put_ok"] == 4
        engine.submit(loads=[LoadRequest("r", hashes, [[9, 10, 11, 12]], 4 * BLOCK)])
        assert engine.wait_idle(30) and engine.get_finished().loads_done == {"r"}
    finally:
        engine.shutdown()
    whole_value = [HEADER_BYTES + sum(pieces)]
    assert seen.sizes["put"] == [whole_value] * 4 and seen.sizes["get"] == [whole_value] * 4
    now = _bytes(kv)
    for src, dst in zip((1, 2, 3, 4), (9, 10, 11, 12)):
        assert torch.equal(now[0][:, dst], ref[0][:, src]) and torch.equal(now[1][:, dst], ref[1][:, src])


# ---- memory safety (review B12, C4) -------------------------------------------------------------


def test_repeated_key_with_another_size_is_invalid(mooncake_store):
    value = np.frombuffer(bytes(range(1, 9)), np.uint8).copy()
    assert mooncake_store.put(["dupsize"], [[value]]) == [Status.OK]
    small, large = np.zeros(8, np.uint8), np.full(4096, 0xEE, np.uint8)
    assert mooncake_store.get(["dupsize", "dupsize"], [[small], [large]]) == [Status.OK, Status.INVALID]
    assert (small == value).all() and (large == 0xEE).all()  # nothing read past the 8-byte value
    digests = [0, 0]
    assert mooncake_store.get(["dupsize", "dupsize"], [[large], [small]], digests_out=digests) == [
        Status.CORRUPT, Status.INVALID,
    ]


def test_raw_addresses_need_a_registered_buffer(mooncake_master, mooncake_store):
    # A client of its own: the shared one has registered other tests' buffers.
    store = MooncakeStore(mooncake_master, segment_bytes=0, fingerprint=FP)  # the values live in mooncake_store's segment
    try:
        src, dst = np.arange(256, dtype=np.uint8), np.zeros(256, np.uint8)
        raw_src, raw_dst = [(src.ctypes.data, 128), (src.ctypes.data + 128, 128)], [(dst.ctypes.data, 256)]
        assert store.put(["rawaddr"], [raw_src]) == [Status.INVALID]
        assert store.exists(["rawaddr"]) == [False]
        store.register_buffer(src.ctypes.data, src.nbytes)
        assert store.put(["rawaddr"], [raw_src]) == [Status.OK]
        assert store.get(["rawaddr"], [raw_dst]) == [Status.INVALID] and not dst.any()
        store.register_buffer(dst.ctypes.data, dst.nbytes)
        assert store.get(["rawaddr"], [raw_dst]) == [Status.OK] and (dst == src).all()
    finally:
        store.close()


# ---- the address a client with a segment advertises (issue 14 item 5) ---------------------------


@pytest.mark.parametrize("how", ["extra", "env"])
def test_client_with_a_segment_advertises_the_configured_host(mooncake_master, monkeypatch, how):
    """127.0.0.2 / 127.0.0.3 are loopback too (all of 127/8), but no default would pick them."""
    extra = {"mooncake_master": mooncake_master.address, "mooncake_segment_bytes": "16MB"}
    if how == "extra":
        extra["mooncake_local_hostname"], want = "127.0.0.2", "127.0.0.2"
        monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.3")  # the config key wins
    else:
        monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.3")
        want = "127.0.0.3"
    store = MooncakeStore.from_config(resolve_client_config(extra), fingerprint=FP)
    try:
        assert store.client.get_hostname().rpartition(":")[0] == want
        value = np.arange(1000, dtype=np.uint8)
        assert store.put([f"host-{how}"], [[value]]) == [Status.OK]  # lives in this client's segment
    finally:
        store.close()


def test_client_with_a_segment_and_no_host_is_refused(mooncake_master, monkeypatch):
    monkeypatch.delenv("VLLM_HOST_IP", raising=False)
    with pytest.raises(ValueError, match="set local_hostname or VLLM_HOST_IP"):
        MooncakeStore(mooncake_master.address, segment_bytes=16 << 20, fingerprint=FP)
    # A pure client serves nothing: no address needed.
    MooncakeStore(mooncake_master.address, segment_bytes=0, fingerprint=FP).close()


def _attention_blocks(store, hnd=False, heads=4, dtype=torch.float16, seed=0):
    """A client's KV cache of one attention layer (vLLM's logical blocks-first shape; ``hnd``: heads
    before tokens in memory) with random bytes, its layout bound to the client."""
    shape = (8, 2, heads, 16, 32) if hnd else (8, 2, 16, heads, 32)
    kv = {"attn": torch.zeros(shape, dtype=dtype)}
    if hnd:
        kv["attn"] = kv["attn"].permute(0, 1, 3, 2, 4)
    layout = KVLayout(kv, [["attn"]])
    kvdata.fill_random(layout.storages, seed)
    store.bind_geometry(layout.fingerprint())
    pool = StagingPool(1 << 20)
    pool.register(store.register_buffer)
    return layout, Transfer(layout, pool)


@pytest.mark.parametrize("reader", ["hnd", "fp8"])
def test_other_geometries_never_load_each_others_values(mooncake_master, mooncake_store, reader):
    """An NHD fp16 engine's values, read by an HND engine or an fp8 one (blocks of the same bytes,
    the same configuration fingerprint): misses that leave the reader's blocks alone and the value
    in the store, which a reader of the writer's geometry still loads byte for byte."""
    clients = [MooncakeStore(mooncake_master, segment_bytes=0, fingerprint=FP) for _ in range(3)]
    try:
        writer, other, same = clients
        layout_w, tr_w = _attention_blocks(writer, seed=1)
        kwargs = dict(hnd=True) if reader == "hnd" else dict(heads=8, dtype=torch.float8_e4m3fn)
        layout_o, tr_o = _attention_blocks(other, seed=2, **kwargs)
        layout_s, tr_s = _attention_blocks(same, seed=3)
        assert layout_o.block_bytes(0) == layout_w.block_bytes(0)
        keys = [f"geometry-{reader}-{os.getpid()}-{b}" for b in range(2)]
        with tr_w.stage([(0, 0), (0, 1)]) as b:
            tr_w.gather(b).wait()
            assert writer.put(keys, b.all_parts()) == [Status.OK] * 2
        before = layout_o.storages[0].clone()
        with tr_o.stage([(0, 4), (0, 5)]) as b:
            st = other.get(keys, b.all_parts())
            tr_o.scatter(b, ok=[s is Status.OK for s in st]).wait()
        assert Status.OK not in st
        assert torch.equal(layout_o.storages[0], before)
        assert writer.exists(keys) == [True, True]
        with tr_s.stage([(0, 4), (0, 5)]) as b:
            assert same.get(keys, b.all_parts()) == [Status.OK] * 2
            tr_s.scatter(b, ok=[True, True]).wait()
        w, s = layout_w.storages[0].view(8, -1), layout_s.storages[0].view(8, -1)
        assert torch.equal(s[4], w[0]) and torch.equal(s[5], w[1])
    finally:
        for client in clients:
            client.close()


def test_a_registration_ends_with_its_buffer(mooncake_master, mooncake_store):
    """Once unregistered (its pool freed), raw parts may no longer name the buffer."""
    store = MooncakeStore(mooncake_master, segment_bytes=0, fingerprint=FP)
    try:
        src, dst = np.arange(256, dtype=np.uint8), np.zeros(256, np.uint8)
        store.register_buffer(src.ctypes.data, src.nbytes)
        store.register_buffer(dst.ctypes.data, dst.nbytes)
        assert store.put([f"unreg-{os.getpid()}"], [[(src.ctypes.data, 256)]]) == [Status.OK]
        store.unregister_buffer(dst.ctypes.data)
        assert store.get([f"unreg-{os.getpid()}"], [[(dst.ctypes.data, 256)]]) == [Status.INVALID] and not dst.any()
        store.unregister_buffer(dst.ctypes.data)  # twice: nothing left to forget
    finally:
        store.close()


def test_a_refused_registration_is_an_error_not_a_later_failure(fresh_master):
    """A buffer Mooncake cannot register (here: its master is gone) is refused at once, and
    raw parts may not name it: every transfer from it would fail for the engine's life."""
    store = MooncakeStore(fresh_master, segment_bytes=0, fingerprint=FP, retry_after_s=30)
    try:
        fresh_master.kill()
        assert store.exists(["any"]) == [False]  # the client notices its master is down
        buffer = np.zeros(4096, np.uint8)
        with pytest.raises(RuntimeError, match="not registered|refused"):
            store.register_buffer(buffer.ctypes.data, buffer.nbytes)
        assert store.put(["any"], [[(buffer.ctypes.data, 4096)]]) in ([Status.INVALID], [Status.UNAVAILABLE])
        assert not store._allowed
    finally:
        store.close()


def test_a_pools_registration_ends_with_the_pool(mooncake_master, mooncake_store):
    import gc

    store = MooncakeStore(mooncake_master, segment_bytes=0, fingerprint=FP)
    try:
        pool = StagingPool(1 << 20)
        pool.register(store.register_buffer)
        assert len(store._allowed) == 1 and store._registered == [pool.ptr]
        del pool
        gc.collect()
        assert not store._allowed and not store._registered
        again = StagingPool(1 << 20)  # wherever it lands, it registers anew
        again.register(store.register_buffer)
    finally:
        store.close()
