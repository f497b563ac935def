"""kvstride.vllm_checks.check_reproducible_hashes against vLLM's own NONE_HASH seeding.

No engine boots: real VllmConfig / CacheConfig objects, PYTHONHASHSEED monkeypatched. The
ground truth is vLLM itself: ``init_none_hash`` run twice in one process gives two different
NONE_HASHes exactly when two processes would.
"""

import multiprocessing
import types

import pytest

pytest.importorskip("vllm")

from vllm.config import CacheConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402

from kvstride.vllm_checks import check_reproducible_hashes, hash_reproducibility_problems  # noqa: E402

ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


def config(algo=None, **kw):
    cache = CacheConfig() if algo is None else CacheConfig(prefix_caching_hash_algo=algo)
    return VllmConfig(cache_config=cache, **kw)


@pytest.fixture
def no_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


@pytest.fixture
def seed0(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")


@pytest.fixture
def fresh_none_hash(monkeypatch):
    """Lets a test call vLLM's init_none_hash; restores its globals afterwards."""
    for name in ("NONE_HASH", "_NONE_HASH_SEED"):
        monkeypatch.setattr(kv_cache_utils, name, getattr(kv_cache_utils, name, None), raising=False)


def none_hash(algo):
    kv_cache_utils.init_none_hash(get_hash_fn_by_name(algo))
    return kv_cache_utils.NONE_HASH


# ---- agreement with vLLM -------------------------------------------------------------------


@pytest.mark.parametrize("seed", [None, "0", "12345", ""])
@pytest.mark.parametrize("algo", ALGOS)
def test_seed_verdict_matches_vllm(monkeypatch, fresh_none_hash, algo, seed):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    reproducible = none_hash(algo) == none_hash(algo)
    flagged = any("PYTHONHASHSEED is not set" in p for p in hash_reproducibility_problems(config(algo)))
    assert flagged == (not reproducible)
    # vLLM 0.32: only the non-cryptographic algorithms get a random seed, and only when unset.
    assert reproducible == (seed is not None or algo in ("sha256", "sha256_cbor"))


def test_pickle_hashes_depend_on_object_identity():
    """Why the pickle algorithms are refused: equal values, different hashes."""
    a = "".join(["tenant-", "a"])
    b = "".join(["tenant-", "a"])
    assert a == b and a is not b
    for algo, same in [("sha256", False), ("xxhash", False), ("sha256_cbor", True), ("xxhash_cbor", True)]:
        fn = get_hash_fn_by_name(algo)
        assert (fn((b"p", (1, 2), (a, a))) == fn((b"p", (1, 2), (a, b)))) is same, algo


# ---- the check -----------------------------------------------------------------------------


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash_cbor"])
def test_cbor_with_seed_passes(seed0, algo):
    check_reproducible_hashes(config(algo), shared=True)


def test_sha256_cbor_needs_no_seed(no_seed):
    check_reproducible_hashes(config("sha256_cbor"), shared=True)


@pytest.mark.parametrize("algo", [None, *ALGOS])
def test_not_shared_says_nothing(no_seed, algo):
    check_reproducible_hashes(config(algo), shared=False)


def test_xxhash_cbor_without_seed(no_seed):
    with pytest.raises(ValueError) as err:
        check_reproducible_hashes(config("xxhash_cbor"), shared=True)
    msg = str(err.value)
    assert "PYTHONHASHSEED is not set" in msg
    assert "set PYTHONHASHSEED=0 (any fixed value, the same for every engine)" in msg
    assert "in the environment of every vLLM process" in msg
    assert "pickles" not in msg


@pytest.mark.parametrize("algo, fix", [("sha256", "sha256_cbor"), ("xxhash", "xxhash_cbor")])
def test_pickle_algo_refused_even_with_seed(seed0, algo, fix):
    with pytest.raises(ValueError) as err:
        check_reproducible_hashes(config(algo), shared=True)
    msg = str(err.value)
    assert f"prefix_caching_hash_algo={algo!r} pickles Python objects" in msg
    assert f"use {fix!r}" in msg and f"--prefix-caching-hash-algo {fix}" in msg
    assert "PYTHONHASHSEED" not in msg


def test_vllm_default_is_refused(no_seed):
    """vLLM's default algorithm is the pickle-based sha256 (its seed is fixed in 0.32)."""
    with pytest.raises(ValueError, match=r"prefix_caching_hash_algo='sha256' pickles .*use 'sha256_cbor'") as err:
        check_reproducible_hashes(config(), shared=True)
    assert "PYTHONHASHSEED" not in str(err.value)


def test_xxhash_without_seed_names_both(no_seed):
    problems = hash_reproducibility_problems(config("xxhash"))
    assert len(problems) == 2
    with pytest.raises(ValueError) as err:
        check_reproducible_hashes(config("xxhash"), shared=True)
    assert all(p in str(err.value) for p in problems)


def test_config_without_the_attribute_counts_as_vllm_default(seed0):
    problems = hash_reproducibility_problems(types.SimpleNamespace(cache_config=types.SimpleNamespace()))
    assert len(problems) == 1 and "'sha256' pickles" in problems[0]


# ---- several processes of one engine -------------------------------------------------------


def test_verdict_independent_of_tp_and_none_hash(monkeypatch, no_seed):
    """A TP worker never runs init_none_hash and has a different rank: same verdict."""
    want = hash_reproducibility_problems(config("xxhash_cbor"))
    monkeypatch.delattr(kv_cache_utils, "NONE_HASH", raising=False)
    tp2 = config("xxhash_cbor", parallel_config=ParallelConfig(tensor_parallel_size=2))
    assert hash_reproducibility_problems(tp2) == want and want


def _child_problems(vllm_config):
    return hash_reproducibility_problems(vllm_config)


def test_spawned_worker_inherits_the_verdict(seed0):
    """PYTHONHASHSEED set in the parent's os.environ reaches a spawned process (how vLLM starts
    EngineCore and workers when it cannot fork), so both sides pass, or both raise."""
    cfg = config("xxhash_cbor")
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        child = pool.apply(_child_problems, (cfg,))
    assert child == hash_reproducibility_problems(cfg) == []
