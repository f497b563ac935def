"""Issue 17, the core: keyed keys (SEMANTICS §3 "Keyed keys") and the value MAC, Rust core
against the readable twin, and the twin's BLAKE3 and AEGIS-MAC against published test vectors."""

import hashlib

import numpy as np
import pytest

import kvstride
from kvstride import _educational as edu

SECRET = bytes(range(32))
HASHES = [hashlib.sha256(bytes([i])).digest() for i in range(12)]


def _planners(mod, secret, tp_size=1, tp_rank=0):
    groups = [mod.GroupSpec("full_attention", 16, num_kv_heads=1), mod.GroupSpec("sliding_window", 16, window=20),
              mod.GroupSpec("mamba", 16)]
    ns = mod.Namespace("m", cache_prefix="c", fingerprint="0123abcd")
    return mod.KeyPlanner(groups, hash_block_size=4, scheduler_block_size=16, namespace=ns, secret=secret,
                          tp_size=tp_size, tp_rank=tp_rank)


def test_blake3_twin_matches_the_official_test_vectors():
    # From BLAKE3's test_vectors.json: input byte i is i % 251; key and context as published.
    key = b"whats the Elvish word for friend"
    ctx = "BLAKE3 2019-12-27 16:29:52 test vectors context"
    data = bytes(i % 251 for i in range(1025))
    assert edu.blake3_keyed(key, b"", 32).hex() == "92b2b75604ed3c761f9d6f62392c8a9227ad0ea3f09573e783f1498a4ed60d26"
    assert edu.blake3_keyed(key, data[:1], 32).hex() == "6d7878dfff2f485635d39013278ae14f1454b8c0a3a2d34bc1ab38228a80c95b"
    assert edu.blake3_keyed(key, data, 32).hex() == "357dc55de0c7e382c900fd6e320acc04146be01db6a8ce7210b7189bd664ea69"
    assert edu.blake3_derive_key(ctx, b"").hex() == "2cc39783c223154fea8dfb7c1b1660f2ac2dcbd1c1de8277b0b0dd39b7e50d7d"


def test_aegis_twin_matches_the_rfc_test_vector():
    # AEGISMAC-128X2 from the AEGIS RFC's test vectors (the aegis crate ships the same file).
    key, nonce = bytes.fromhex("10010000000000000000000000000000"), bytes.fromhex("10000200000000000000000000000000")
    data = bytes.fromhex("000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f202122")
    assert edu.aegis128x2_mac(key, data, nonce).hex() == "6873ee34e6b5c59143b6d35c5e4f2c6e"


@pytest.mark.parametrize("tp", [(1, 0), (2, 1)])
def test_keyed_keys_equal_the_twins_and_differ_from_unkeyed(tp):
    for secret in (None, SECRET, b"x" * 40):
        core, twin = _planners(kvstride, secret, *tp), _planners(edu, secret, *tp)
        assert core.keyed == twin.keyed == (secret is not None)
        assert core.lookup_keys(HASHES, 45) == twin.lookup_keys(HASHES, 45)
        for g in range(3):
            assert core.key(g, HASHES[5]) == twin.key(g, HASHES[5])
        tables = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
        assert core.plan_save(HASHES, tables, 48).puts == twin.plan_save(HASHES, tables, 48).puts
    plain, keyed = _planners(kvstride, None), _planners(kvstride, SECRET)
    a, b = plain.key(0, HASHES[3]), keyed.key(0, HASHES[3])
    assert a.endswith(HASHES[3].hex()) and len(a) == len(b) and a.rsplit("@", 1)[0] == b.rsplit("@", 1)[0]
    assert not set(plain.lookup_keys(HASHES, 45)) & set(keyed.lookup_keys(HASHES, 45))
    assert not set(_planners(kvstride, b"y" * 32).lookup_keys(HASHES, 45)) & set(keyed.lookup_keys(HASHES, 45))


def test_short_secrets_are_refused_by_both():
    for mod in (kvstride, edu):
        with pytest.raises(ValueError, match="at least 32"):
            _planners(mod, b"x" * 31)
        with pytest.raises(ValueError, match="at least 32"):
            mod.StoreSecret(b"short")


def test_store_secret_equals_the_twins():
    rng = np.random.default_rng(0)
    values = [[rng.integers(0, 256, n, dtype=np.uint8), rng.integers(0, 256, 7, dtype=np.uint8)]
              for n in (0, 1, 1024, 5000, 70000)]
    core, twin = kvstride.StoreSecret(SECRET), edu.StoreSecret(SECRET)
    tags = core.payload_tags(values)
    assert tags == twin.payload_tags(values)
    assert len(set(tags)) == len(tags)
    assert tags != kvstride.StoreSecret(b"z" * 32).payload_tags(values)
    macs = core.header_macs(["k1", "k2"], [10, 10], tags[:2])
    assert macs == twin.header_macs(["k1", "k2"], [10, 10], tags[:2])
    assert all(len(m) == 16 for m in macs)
    assert core.header_macs(["k1"], [11], tags[:1]) != macs[:1]


def test_keyed_rows_ride_the_copies():
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(256, dtype=np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    u = lambda *x: np.array(x, dtype=np.uint64)  # noqa: E731
    secret = kvstride.StoreSecret(SECRET)
    tags = kvstride._core._save_rows(u(s, s + 100), u(d, d + 10), u(10, 20), u(0, 2), secret)
    assert list(tags) == secret.payload_tags([[src[:10], src[100:120]]])
    plain = kvstride._core._save_rows(u(s, s + 100), u(d, d + 10), u(10, 20), u(0, 2))
    assert plain[0] != tags[0]
    back = np.zeros(30, dtype=np.uint8)
    b = back.ctypes.data
    ok = kvstride._core._load_rows(u(d), u(b), u(30), u(0, 1), plain, secret)
    assert not ok[0] and not back.any()
    ok = kvstride._core._load_rows(u(d), u(b), u(30), u(0, 1), tags, secret)
    assert ok[0] and np.array_equal(back, dst[:30])
