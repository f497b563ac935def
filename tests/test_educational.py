"""Self-checks of the pure-Python twin (``kvstride._educational``) against SEMANTICS.md.

These test the oracle alone; the differential tests run the Rust core against it.
"""

import hashlib
import importlib.util
import pathlib
import sys

import cbor2
import pytest

try:
    from kvstride import _educational as edu
except Exception:  # the package __init__ may import the not-yet-built _core: load by path
    _path = pathlib.Path(__file__).resolve().parents[1] / "python" / "kvstride" / "_educational.py"
    _spec = importlib.util.spec_from_file_location("kvstride_educational", _path)
    edu = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = edu
    _spec.loader.exec_module(edu)

FA = lambda b, **kw: edu.GroupSpec("full_attention", b, **kw)  # noqa: E731
MAMBA = lambda b, mode="align", **kw: edu.GroupSpec("mamba", b, mamba_mode=mode, **kw)  # noqa: E731
RING = lambda b, **kw: edu.GroupSpec("circular_buffer", b, **kw)  # noqa: E731


def fake_hashes(n):
    return [hashlib.sha256(b"h%d" % i).digest() for i in range(n)]


# ---- §1 hashes ---------------------------------------------------------------------------


def test_sha256_vectors():
    h = edu.BlockHasher("sha256_cbor", seed="0")
    assert h.algo == "sha256_cbor" and h.digest_size == 32
    assert h.none_hash.hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    hs = h.hash_blocks(list(range(1, 21)), 4)
    assert len(hs) == 5
    assert hs[0].hex() == "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb"
    assert hs[4].hex() == "716b6e9fcf08aac8657a5e3feb26bae26f2dd260fe7fa120981b1b33ba181c89"
    # partial trailing block: no hash; chaining with parent continues the chain
    assert h.hash_blocks(list(range(1, 23)), 4) == hs
    assert h.hash_blocks(list(range(9, 21)), 4, parent=hs[1]) == hs[2:]


def test_hash_equals_cbor2_definition_with_extra_keys():
    h = edu.BlockHasher("sha256_cbor", seed="abc")
    extra = [("lora", 3), None, (b"\x01", 1.5, None, True, ("nested", -7))]
    tokens = [5, -1, 2**40, 0, 1, 2, 3, 4, 9, 9, 9, 9, 7]
    got = h.hash_blocks(tokens, 4, extra_keys=extra)
    prev = hashlib.sha256(cbor2.dumps("abc", canonical=True)).digest()
    assert prev == h.none_hash
    for i in range(3):
        prev = hashlib.sha256(cbor2.dumps([prev, tokens[4 * i:4 * i + 4], extra[i]], canonical=True)).digest()
        assert got[i] == prev
    with pytest.raises(ValueError):
        h.hash_blocks(tokens, 4, extra_keys=extra[:2])


def test_xxhash_and_random_seed():
    xxhash = pytest.importorskip("xxhash")
    h = edu.BlockHasher("xxhash_cbor", seed="0")
    assert h.digest_size == 16
    assert h.none_hash == xxhash.xxh3_128_digest(cbor2.dumps("0", canonical=True))
    [b0] = h.hash_blocks([1, 2, 3, 4], 4)
    assert b0 == xxhash.xxh3_128_digest(cbor2.dumps([h.none_hash, [1, 2, 3, 4], None], canonical=True))
    r1, r2 = edu.BlockHasher(), edu.BlockHasher()
    assert len(r1.none_hash) == 32 and r1.none_hash != r2.none_hash
    with pytest.raises(ValueError):
        edu.BlockHasher("md5")
    assert h.hash_blocks_batch([[1, 2, 3, 4], [1, 2]], 4) == [[b0], []]


def test_numpy_tokens():
    np = pytest.importorskip("numpy")
    h = edu.BlockHasher(seed="0")
    assert h.hash_blocks(np.arange(1, 21, dtype=np.int64), 4) == h.hash_blocks(list(range(1, 21)), 4)


# ---- §2 geometry -------------------------------------------------------------------------


def test_resolve_examples():
    assert edu.resolve_block_sizes([FA(1152), RING(4)]) == (1152, 1152)
    assert edu.resolve_block_sizes([FA(16), MAMBA(48)]) == (48, 16)
    with pytest.raises(ValueError, match=r"group 0 \(full_attention, 16 tokens\)"):
        edu.resolve_block_sizes([FA(16), MAMBA(24, "none")])
    dsv4 = [FA(256), edu.GroupSpec("sliding_window", 64, window=128), FA(64), RING(4, prefix_cacheable=True), FA(8)]
    assert edu.resolve_block_sizes(dsv4) == (256, 4)
    assert edu.resolve_block_sizes([RING(4), RING(8)]) == (8, 4)
    assert edu.resolve_block_sizes([FA(1536), MAMBA(1536)], prefix_match_unit=128) == (1536, 128)
    assert edu.resolve_block_sizes([FA(16)], dcp=2) == (32, 32)
    with pytest.raises(ValueError):
        edu.resolve_block_sizes([FA(16)], prefix_match_unit=8)
    assert edu.hashes_per_block([FA(1152), RING(4)], 1152) == [1, 0]
    assert edu.hashes_per_block([FA(16), MAMBA(48)], 16) == [1, 3]


def test_groupspec_validation():
    assert RING(4).prefix_cacheable is False and FA(4).prefix_cacheable is True
    with pytest.raises(ValueError):
        edu.GroupSpec("sliding_window", 16)
    with pytest.raises(ValueError):
        edu.GroupSpec("full_attention", 16, window=8)
    with pytest.raises(ValueError):
        edu.GroupSpec("attention", 16)
    with pytest.raises(ValueError):
        edu.GroupSpec("mamba", 16, mamba_mode="sometimes")
    with pytest.raises(ValueError):
        FA(0)
    with pytest.raises(TypeError):
        FA("16")


# ---- §3 striding and keys ----------------------------------------------------------------


def test_stride_keys():
    h = fake_hashes(10)
    assert edu.stride_keys(h, 3) == [h[2], h[5], h[8]]
    assert edu.stride_keys(h, 3, 1) == [h[5], h[8]]
    assert edu.stride_keys(h, 0) == []
    assert edu.stride_keys(h, 1, 10) == []


def test_namespace_and_keys():
    ns = edu.Namespace("test-model", cache_prefix="depA")
    assert ns.text() == "depA@test-model@tp_rank:0@pcp0@dcp0@pp_rank:0"
    assert edu.Namespace("m", fingerprint="abcd", tp_rank=2).text(1) == "m@fp:abcd@tp_rank:1@pcp0@dcp0@pp_rank:0"
    p = edu.KeyPlanner([FA(4)], hash_block_size=4, scheduler_block_size=4, namespace="test-model@tp_rank:0@pcp0@dcp0@pp_rank:0")
    assert p.key(0, bytes.fromhex("deadbeef")) == "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@deadbeef"
    assert p.key_bytes(3 - 3, b"\xaa") == b"\xaa\x00\x00\x00\x00"
    fp = edu.layout_fingerprint({"dtype": "bf16", "H": 16})
    assert fp == hashlib.sha256(cbor2.dumps({"dtype": "bf16", "H": 16}, canonical=True)).hexdigest()[:16]


def test_tp_replication():
    # tp 4, 2 KV heads, groups (MLA, GQA, Mamba) -> factors (4, 2, 1); rank 3 keys tp (0, 1, 3)
    groups = [edu.GroupSpec("mla", 16), FA(16, num_kv_heads=2), MAMBA(16)]
    p = edu.KeyPlanner(groups, hash_block_size=16, scheduler_block_size=16,
                       namespace=edu.Namespace("m"), tp_size=4, tp_rank=3)
    assert [p.replication(g) for g in range(3)] == [4, 2, 1]
    hh = b"\x01"
    assert [p.key(g, hh).split("@")[1] for g in range(3)] == ["tp_rank:0", "tp_rank:1", "tp_rank:3"]
    h = fake_hashes(8)
    # lookup keys: MLA in 1 namespace, GQA in 2, Mamba (mamba ranks) in 4, per hash
    keys = p.lookup_keys(h[:1], 16)
    assert len(keys) == 1 + 2 + 4
    # striding: rank 3 writes MLA blocks b with b % 4 == 3, GQA blocks with b % 2 == 0
    plan = p.plan_save(h, [list(range(1, 9))] * 3, 128)
    assert [(g, bid) for _, g, bid in plan.puts] == [(0, 4), (0, 8), (1, 1), (1, 3), (1, 5), (1, 7)]


# ---- §4 save -----------------------------------------------------------------------------


def test_plan_save_basic_and_window():
    h = fake_hashes(8)
    groups = [FA(4), edu.GroupSpec("sliding_window", 4, window=5), MAMBA(16)]
    p = edu.KeyPlanner(groups, hash_block_size=4, scheduler_block_size=16, namespace="ns")
    assert p.partial_hits and p.alignment == 4
    tables = [list(range(1, 9)), list(range(11, 19)), [21, 22]]
    plan = p.plan_save(h, tables, 30)
    assert plan.end == 16
    assert plan.puts == [(p.key(0, h[i]), 0, i + 1) for i in range(4)] + [(p.key(1, h[3]), 1, 14)]
    # saved_offset 16, 32 tokens: FA blocks 4..7; SW needs [28, 32) -> block 7
    plan = p.plan_save(h, tables, 32, saved_offset=16, exists={p.key(0, h[5])})
    assert plan.end == 32
    assert plan.puts == [(p.key(0, h[i]), 0, i + 1) for i in (4, 6, 7)] + [(p.key(1, h[7]), 1, 18)]
    with pytest.raises(ValueError):
        p.plan_save(h, tables, 32, saved_offset=4)


# ---- §5 tail -----------------------------------------------------------------------------


def test_plan_tail_example():
    p = edu.KeyPlanner([FA(4), MAMBA(16)], hash_block_size=4, scheduler_block_size=16, namespace="ns")
    h = fake_hashes(3)
    plan = p.plan_tail(h, [[1, 2, 3], [4]], [(1, 7, 12)])
    assert plan.outcome == "planned" and plan.boundary == 12
    assert plan.puts == [(p.key(0, h[0]), 0, 1), (p.key(0, h[1]), 0, 2), (p.key(0, h[2]), 0, 3), (p.key(1, h[2]), 1, 7)]

    h = fake_hashes(7)
    plan = p.plan_tail(h, [list(range(1, 8)), [4, 5]], [(1, 7, 28)], saved_offset=16)
    assert plan.puts == [(p.key(0, h[4]), 0, 5), (p.key(0, h[5]), 0, 6), (p.key(0, h[6]), 0, 7), (p.key(1, h[6]), 1, 7)]

    all_keys = {k for k, _, _ in plan.puts}
    assert p.plan_tail(h, [list(range(1, 8)), []], [(1, 7, 28)], saved_offset=16, exists=all_keys).outcome == "all_present"
    assert p.plan_tail(h, [[], []], [(1, 0, 28)]).outcome == "none"
    assert p.plan_tail([], [[], []], [(1, 7, 28)]) == edu.TailPlan("none", None, [])
    assert p.plan_tail(h, [[], []], []).outcome == "none"
    bad = p.plan_tail(h, [[], []], [(1, 7, 6)])
    assert (bad.outcome, bad.boundary, bad.puts) == ("invalid_boundary", 6, [])
    div = p.plan_tail(h, [[], []], [(1, 7, 8), (1, 8, 12)])
    assert (div.outcome, div.boundary) == ("divergent_boundaries", None)
    pend = p.plan_tail(h, [[], []], [(1, 7, 32)])
    assert (pend.outcome, pend.boundary) == ("hash_pending", 32)


# ---- §6 lookup ---------------------------------------------------------------------------


def test_lookup_examples():
    p = edu.KeyPlanner([FA(16), MAMBA(16)], hash_block_size=4, scheduler_block_size=16,
                       namespace="ns", partial_hits=True)
    h = fake_hashes(4)
    present = {p.key(0, h[2]), p.key(1, h[2])}
    assert p.longest_hit(h[:3], 13, present) == 12
    assert p.longest_hit(h[:3], 12, present) == 0
    keys = p.lookup_keys(h[:3], 13)
    assert keys == [p.key(0, h[i]) for i in range(3)] + [p.key(1, h[i]) for i in range(3)]
    assert p.longest_hit_bitmap(h[:3], 13, [k in present for k in keys]) == 12
    with pytest.raises(ValueError):
        p.longest_hit_bitmap(h[:3], 13, [True])

    p = edu.KeyPlanner([FA(32), MAMBA(32)], hash_block_size=16, scheduler_block_size=32, namespace="ns")
    assert p.partial_hits and p.alignment == 16
    h = fake_hashes(4)
    present = {p.key(0, h[1]), p.key(0, h[2]), p.key(1, h[1])}
    assert p.longest_hit(h, 64, present) == 32
    assert p.longest_hit(h, 64, present | {p.key(1, h[2])}) == 48
    assert p.longest_hit(h, 0, present) == 0


def test_lookup_window_and_skipped_groups():
    # chunked_local window 16, B 4, S = 8, H = 4: at X = 16 nothing is needed (chunk boundary)
    groups = [FA(8), edu.GroupSpec("chunked_local", 4, window=16), RING(4)]
    p = edu.KeyPlanner(groups, hash_block_size=4, scheduler_block_size=8, namespace="ns")
    assert p.hashes_per_block == [2, 1, 0]
    h = fake_hashes(6)
    fa = {p.key(0, h[i]) for i in (1, 3, 5)}
    assert p.longest_hit(h, 25, fa) == 16
    assert p.longest_hit(h, 25, fa | {p.key(1, h[4]), p.key(1, h[5])}) == 24
    assert all("@group:2@" not in k for k in p.lookup_keys(h, 25))


# ---- §7 load -----------------------------------------------------------------------------


def test_plan_load_and_dedup():
    p = edu.KeyPlanner([FA(4), MAMBA(16)], hash_block_size=4, scheduler_block_size=16, namespace="ns")
    h = fake_hashes(8)
    plan = p.plan_load(h, [list(range(1, 7)) + [0], [9, 10]], 28, local_tokens=17)
    assert (plan.hit, plan.start) == (28, 16)
    assert plan.gets == [(p.key(0, h[i]), 0, i + 1) for i in (4, 5)] + [(p.key(1, h[6]), 1, 10)]
    assert plan.missing == [(0, 6)]
    with pytest.raises(ValueError):
        p.plan_load(h, [[], []], 30)
    with pytest.raises(ValueError):
        p.plan_load(h, [[], []], 8, local_tokens=12)
    assert edu.dedup_gets([("a", 0, 1), ("b", 0, 2), ("a", 1, 3)]) == (["a", "b"], [[0, 2], [1]])
