"""SEMANTICS §1: block hashes, checked against cbor2 + hashlib/xxhash computed here."""

import math

import cbor2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import IMPLS, ref_digest, ref_hash_blocks

ALGOS = ["sha256_cbor", "xxhash_cbor"]
HSET = settings(
    max_examples=200, deadline=None, suppress_health_check=list(HealthCheck)
)

# ---- §1 test vectors -----------------------------------------------------------------------

SHA_NONE = "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
SHA_H = [
    "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb",
    "24125b23e68883b5c2141db2959d48433fe6bde2f26bd914efad121d154ab2d6",
    "e628d7f6f15c524d67345b6a98489c375c91df1c31e3d154daed446d95c926b2",
    "196944840f4a892fa3c41fb80fcbd6a73bdc14474cd3571f3940779f0245259e",
    "716b6e9fcf08aac8657a5e3feb26bae26f2dd260fe7fa120981b1b33ba181c89",
]
XX_NONE = "1ebe36576dcb573f26b99533a20aaeca"
XX_H0 = "0a8577df5ee3430515a8cc1f6e3ac52e"


def test_sha256_vectors(impl):
    h = impl.BlockHasher("sha256_cbor", seed="0")
    assert h.algo == "sha256_cbor"
    assert h.digest_size == 32
    assert h.none_hash.hex() == SHA_NONE
    hs = h.hash_blocks(list(range(1, 21)), 4)
    assert [x.hex() for x in hs] == SHA_H
    # the vectors are exactly cbor2 + hashlib
    assert SHA_NONE == ref_digest("sha256_cbor", cbor2.dumps("0", canonical=True)).hex()
    assert hs == ref_hash_blocks("sha256_cbor", h.none_hash, list(range(1, 21)), 4)
    # a trailing partial block gets no hash; a parent continues the chain
    assert h.hash_blocks(list(range(1, 24)), 4) == hs
    assert h.hash_blocks(list(range(9, 21)), 4, parent=hs[1]) == hs[2:]
    assert h.hash_blocks(list(range(1, 4)), 4) == []


def test_cbor_input_of_h0(impl):
    none = bytes.fromhex(SHA_NONE)
    expected = bytes.fromhex("835820") + none + bytes.fromhex("8401020304f6")
    assert impl.cbor_encode([none, [1, 2, 3, 4], None]) == expected
    assert cbor2.dumps([none, [1, 2, 3, 4], None], canonical=True) == expected


def test_xxhash_vectors(impl):
    h = impl.BlockHasher("xxhash_cbor", seed="0")
    assert h.algo == "xxhash_cbor"
    assert h.digest_size == 16
    assert h.none_hash.hex() == XX_NONE
    hs = h.hash_blocks(list(range(1, 21)), 4)
    assert len(hs) == 5 and all(len(x) == 16 for x in hs)
    assert hs[0].hex() == XX_H0
    assert hs == ref_hash_blocks("xxhash_cbor", h.none_hash, list(range(1, 21)), 4)


@pytest.mark.parametrize("algo", ALGOS)
def test_none_hash_random_without_seed(impl, algo):
    a, b = impl.BlockHasher(algo), impl.BlockHasher(algo, seed=None)
    assert len(a.none_hash) == 32 and len(b.none_hash) == 32
    assert a.none_hash != b.none_hash
    assert a.none_hash == a.none_hash  # stable within one instance
    toks = list(range(8))
    assert a.hash_blocks(toks, 4) == ref_hash_blocks(algo, a.none_hash, toks, 4)
    assert a.hash_blocks(toks, 4) != b.hash_blocks(toks, 4)


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("seed", ["", "0", "12345", "sëéd ✓", "x" * 300])
def test_seeded_none_hash(impl, algo, seed):
    h = impl.BlockHasher(algo, seed=seed)
    assert h.none_hash == ref_digest(algo, cbor2.dumps(seed, canonical=True))
    assert h.none_hash == impl.BlockHasher(algo, seed=seed).none_hash


# ---- random inputs vs the definition ---------------------------------------------------------

CBOR_INT = st.integers(min_value=-(2**64), max_value=2**64 - 1)
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(
        [0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, -5e-324, 2.2250738585072014e-308,
         1e-310, 5.960464477539063e-08, 6.103515625e-05, 65504.0, 65505.0, 1.5, 3.4028234663852886e38,
         1.401298464324817e-45, 1.1754942106924411e-38, 0.1]
    ),
)
SCALARS = st.one_of(
    st.text(max_size=20), CBOR_INT, st.binary(max_size=20), st.none(), st.booleans(), FLOATS
)
EXTRA_ITEM = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4).map(tuple), max_leaves=12)
EXTRA = st.one_of(st.none(), st.lists(EXTRA_ITEM, max_size=5).map(tuple))


@st.composite
def hash_case(draw):
    block_size = draw(st.integers(1, 9))
    nblocks = draw(st.integers(0, 5))
    extra_tail = draw(st.integers(0, block_size - 1))
    tokens = draw(
        st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(0, 200000),
                 min_size=nblocks * block_size + extra_tail, max_size=nblocks * block_size + extra_tail)
    )
    parent = draw(st.one_of(st.none(), st.binary(min_size=32, max_size=32), st.binary(min_size=16, max_size=16)))
    extra = draw(st.one_of(st.none(), st.lists(EXTRA, min_size=nblocks, max_size=nblocks)))
    algo = draw(st.sampled_from(ALGOS))
    seed = draw(st.one_of(st.none(), st.text(max_size=8)))
    return algo, seed, block_size, tokens, parent, extra


@HSET
@given(case=hash_case())
def test_random_hashes_match_cbor2_definition(impl, case):
    algo, seed, block_size, tokens, parent, extra = case
    h = impl.BlockHasher(algo, seed=seed)
    got = h.hash_blocks(tokens, block_size, parent=parent, extra_keys=extra)
    assert got == ref_hash_blocks(algo, h.none_hash, tokens, block_size, parent, extra)
    assert all(len(x) == h.digest_size for x in got)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    tokens=st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=24),
    block_size=st.integers(1, 6),
    algo=st.sampled_from(ALGOS),
)
def test_large_unsigned_token_ids(impl, tokens, block_size, algo):
    h = impl.BlockHasher(algo, seed="s")
    assert h.hash_blocks(tokens, block_size) == ref_hash_blocks(algo, h.none_hash, tokens, block_size)


@HSET
@given(value=st.lists(EXTRA_ITEM, max_size=5).map(tuple))
def test_extra_key_values_vs_cbor2(impl, value):
    assert impl.cbor_encode(value) == cbor2.dumps(value, canonical=True)


@pytest.mark.parametrize(
    "value",
    [
        math.nan, -math.nan, math.inf, -math.inf, -0.0, 0.0, 5e-324, 1e-310, 65504.0, 1.0e300,
        2**64 - 1, -(2**64), 2**63, -(2**63) - 1, 23, 24, -24, -25, 255, 256, 65535, 65536,
        2**32 - 1, 2**32, "", "a" * 23, "a" * 24, "é✓", b"", b"\x00" * 300, True, False, None,
        (), ((), ((),)), ("x", 1, (b"y", None, (1.5, -7))),
    ],
)
def test_cbor_encode_edge_values(impl, value):
    assert impl.cbor_encode(value) == cbor2.dumps(value, canonical=True)


DICT_KEYS = st.one_of(st.text(max_size=6), st.integers(-(2**40), 2**40), st.binary(max_size=4))
DICT_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(DICT_KEYS, inner, max_size=3)),
    max_leaves=10,
)


@HSET
@given(d=st.dictionaries(DICT_KEYS, DICT_VALUES, max_size=6))
def test_cbor_encode_dicts_and_fingerprint(impl, d):
    enc = cbor2.dumps(d, canonical=True)
    assert impl.cbor_encode(d) == enc
    fp = impl.layout_fingerprint(d)
    assert fp == __import__("hashlib").sha256(enc).hexdigest()[:16]


def test_layout_fingerprint_example(impl):
    d = {"dtype": "bfloat16", "block_sizes": [16, 48], "layout": "NHD", "algo": "sha256_cbor", "seed": "0", 1000: 1}
    fp = impl.layout_fingerprint(d)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert fp == __import__("hashlib").sha256(cbor2.dumps(d, canonical=True)).hexdigest()[:16]
    assert fp != impl.layout_fingerprint({**d, "dtype": "float16"})
    # key order in the dict does not matter (canonical)
    assert fp == impl.layout_fingerprint(dict(reversed(list(d.items()))))


# ---- numpy and batch ---------------------------------------------------------------------------

INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("algo", ALGOS)
def test_numpy_every_int_dtype_equals_list(impl, dtype, algo):
    info = np.iinfo(dtype)
    rng = np.random.default_rng(7)
    vals = rng.integers(info.min, info.max, size=37, dtype=dtype, endpoint=True)
    vals[:4] = [info.min, info.max, 0, 1]
    h = impl.BlockHasher(algo, seed="np")
    as_list = [int(v) for v in vals]
    for bs in (1, 4, 16):
        expected = ref_hash_blocks(algo, h.none_hash, as_list, bs)
        assert h.hash_blocks(vals, bs) == expected
        assert h.hash_blocks(as_list, bs) == expected
        assert h.hash_blocks(tuple(as_list), bs) == expected
    # non-contiguous view
    assert h.hash_blocks(vals[::2], 3) == ref_hash_blocks(algo, h.none_hash, as_list[::2], 3)


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    reqs=st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=40), max_size=6),
    block_size=st.integers(1, 8),
    algo=st.sampled_from(ALGOS),
    data=st.data(),
)
def test_hash_blocks_batch_equals_per_request(impl, reqs, block_size, algo, data):
    h = impl.BlockHasher(algo, seed="batch")
    parents = data.draw(st.one_of(st.none(), st.lists(
        st.one_of(st.none(), st.binary(min_size=32, max_size=32)), min_size=len(reqs), max_size=len(reqs))))
    got = h.hash_blocks_batch(reqs, block_size, parents=parents)
    ps = parents if parents is not None else [None] * len(reqs)
    assert got == [h.hash_blocks(r, block_size, parent=p) for r, p in zip(reqs, ps)]
    # numpy requests too
    arrs = [np.asarray(r, dtype=np.int64) for r in reqs]
    assert h.hash_blocks_batch(arrs, block_size, parents=parents) == got


def test_core_and_twin_agree_on_long_request():
    toks = list(range(5000))
    for algo in ALGOS:
        a = IMPLS["core"].BlockHasher(algo, seed="z").hash_blocks(toks, 16)
        b = IMPLS["twin"].BlockHasher(algo, seed="z").hash_blocks(toks, 16)
        assert a == b and len(a) == 312
