"""kvstride.vllm.checks.check_reproducible_hashes against vLLM's own NONE_HASH seeding.

No engine boots: real VllmConfig / CacheConfig objects, PYTHONHASHSEED monkeypatched. The
ground truth is vLLM itself: ``init_none_hash`` run twice in one process gives two different
NONE_HASHes exactly when two processes would, and only those settings are refused. vLLM's
default ``sha256`` (pickle) shares a store between engines of one vLLM and Python version,
with one warning per process (issue 14).
"""

import logging
import multiprocessing
import re
import types

import pytest

pytest.importorskip("vllm")

from vllm.config import CacheConfig, ParallelConfig, VllmConfig  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core import kv_cache_utils  # noqa: E402

from kvstride.vllm import checks as vllm_checks  # noqa: E402
from kvstride.vllm.checks import (  # noqa: E402
    check_reproducible_hashes,
    hash_portability_warning,
    hash_reproducibility_problems,
)

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


# ---- pickle --------------------------------------------------------------------------------


def test_pickle_hashes_depend_on_object_identity():
    """Why the warning recommends CBOR: pickle's bytes depend on more than the values (here
    object identity, through its memo; across releases, on the Python and vLLM versions)."""
    a = "".join(["tenant-", "a"])
    b = "".join(["tenant-", "a"])
    assert a == b and a is not b
    for algo, same in [("sha256", False), ("xxhash", False), ("sha256_cbor", True), ("xxhash_cbor", True)]:
        fn = get_hash_fn_by_name(algo)
        assert (fn((b"p", (1, 2), (a, a))) == fn((b"p", (1, 2), (a, b)))) is same, algo


# ---- the check -----------------------------------------------------------------------------


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.fixture
def warnings_seen(monkeypatch):
    """The warnings kvstride logs (pytest's logging plugin is off in this tier), with the
    once-per-process flag reset first."""
    monkeypatch.setattr(vllm_checks, "_warned_keys", set())
    handler = _Records()
    logger = logging.getLogger("kvstride.vllm")
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)


def random_seed_algos():
    """The algorithms vLLM seeds with random bytes when PYTHONHASHSEED is unset, from its own
    source (``_NON_CRYPTO_HASH_FUNCTIONS``)."""
    return {a for a in ALGOS if get_hash_fn_by_name(a) in kv_cache_utils._NON_CRYPTO_HASH_FUNCTIONS}


def test_random_seed_algos_are_the_xxhash_ones():
    assert random_seed_algos() == {"xxhash", "xxhash_cbor"}


@pytest.mark.parametrize("algo", ALGOS)
def test_with_seed_every_algo_shares(seed0, warnings_seen, algo):
    check_reproducible_hashes(config(algo), shared=True)
    assert len(warnings_seen) == (algo in ("sha256", "xxhash"))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_sha256_needs_no_seed(no_seed, warnings_seen, algo):
    check_reproducible_hashes(config(algo), shared=True)
    assert len(warnings_seen) == (algo == "sha256")


def test_cbor_says_nothing(seed0, warnings_seen):
    for algo in ("sha256_cbor", "xxhash_cbor"):
        check_reproducible_hashes(config(algo), shared=True)
        assert hash_portability_warning(config(algo)) is None
    assert warnings_seen == []


@pytest.mark.parametrize("algo", [None, *ALGOS])
def test_not_shared_says_nothing(no_seed, warnings_seen, algo):
    check_reproducible_hashes(config(algo), shared=False)
    assert warnings_seen == []


@pytest.mark.parametrize("seed", [None, "0"])
def test_vllm_default_shares_with_one_warning(monkeypatch, warnings_seen, seed):
    """vLLM's default, sha256 (pickle), with or without PYTHONHASHSEED: a shared store works
    (its NONE_HASH seed is fixed either way), with one warning naming when it would not hit
    and the fix. Refused before issue 14."""
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    assert hash_reproducibility_problems(config()) == []
    check_reproducible_hashes(config(), shared=True)
    assert len(warnings_seen) == 1
    msg = warnings_seen[0]
    assert "prefix_caching_hash_algo='sha256' pickles Python objects" in msg
    assert "same vLLM and Python version" in msg
    assert "not stable across versions" in msg
    assert "--prefix-caching-hash-algo sha256_cbor" in msg
    assert msg == hash_portability_warning(config())


def test_warning_once_per_engine_from_its_scheduler(seed0, warnings_seen):
    """An engine's scheduler says it once, its workers never; hashes of canonical CBOR not."""
    for algo in ("sha256_cbor", "xxhash_cbor"):
        check_reproducible_hashes(config(algo), shared=True)
    assert warnings_seen == []
    tp2 = config("sha256", parallel_config=ParallelConfig(tensor_parallel_size=2))
    for worker in (True, True, False, False):
        check_reproducible_hashes(tp2, shared=True, worker=worker)
    assert len(warnings_seen) == 1 and "'sha256' pickles" in warnings_seen[0]


@pytest.mark.parametrize("algo", sorted({"xxhash", "xxhash_cbor"}))
def test_random_seed_refused(no_seed, warnings_seen, algo):
    with pytest.raises(ValueError) as err:
        check_reproducible_hashes(config(algo), shared=True)
    msg = str(err.value)
    assert "would never hit" in msg
    assert "PYTHONHASHSEED is not set" in msg and f"prefix_caching_hash_algo={algo!r}" in msg
    assert "set PYTHONHASHSEED=0 (any fixed value, the same for every engine)" in msg
    assert "in the environment of every vLLM process" in msg
    assert "--prefix-caching-hash-algo sha256_cbor" in msg
    assert "pickles" not in msg
    assert warnings_seen == []


@pytest.mark.parametrize("seed", [None, "0", "12345", "", "random"])
@pytest.mark.parametrize("algo", ALGOS)
def test_refused_exactly_when_vllm_seeds_randomly(monkeypatch, fresh_none_hash, warnings_seen, algo, seed):
    """Refused iff vLLM's own init_none_hash gives two NONE_HASHes in two calls."""
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    random_seed = none_hash(algo) != none_hash(algo)
    try:
        check_reproducible_hashes(config(algo), shared=True)
        refused = False
    except ValueError:
        refused = True
    assert refused == random_seed == (seed is None and algo in random_seed_algos())


def test_config_without_the_attribute_counts_as_vllm_default(seed0):
    cfg = types.SimpleNamespace(cache_config=types.SimpleNamespace())
    assert hash_reproducibility_problems(cfg) == []
    assert "'sha256' pickles" in hash_portability_warning(cfg)


def test_vllm_without_the_seed_resolver_refuses_every_unseeded_algo(monkeypatch, no_seed, warnings_seen):
    """vLLM releases before resolve_none_hash_seed: NONE_HASH = os.urandom(32) unless
    PYTHONHASHSEED is set, for every algorithm."""
    monkeypatch.delattr(kv_cache_utils, "resolve_none_hash_seed")
    for algo in ALGOS:
        with pytest.raises(ValueError, match="PYTHONHASHSEED is not set"):
            check_reproducible_hashes(config(algo), shared=True)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    check_reproducible_hashes(config("sha256_cbor"), shared=True)


# ---- several processes of one engine -------------------------------------------------------


def test_verdict_independent_of_tp_and_none_hash(monkeypatch, no_seed):
    """A TP worker never runs init_none_hash and has a different rank: same verdict."""
    want = hash_reproducibility_problems(config("xxhash_cbor"))
    monkeypatch.delattr(kv_cache_utils, "NONE_HASH", raising=False)
    tp2 = config("xxhash_cbor", parallel_config=ParallelConfig(tensor_parallel_size=2))
    assert hash_reproducibility_problems(tp2) == want and want


def block_hashes(algo):
    """vLLM's own chain for one request: init_none_hash, then hash_block_tokens per block,
    with LoRA / cache_salt-like string extra keys (fresh objects in every process)."""
    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    parent, out = None, []
    for i in range(3):
        tokens = [(7 * i + j) % 1000 for j in range(16)]
        parent = kv_cache_utils.hash_block_tokens(fn, parent, tokens, ("".join(["lora-", "a"]), f"salt{i}"))
        out.append(bytes(parent))
    return out


def _child(vllm_config):
    return hash_reproducibility_problems(vllm_config), {a: block_hashes(a) for a in ("sha256", "sha256_cbor")}


def test_spawned_process_inherits_the_verdict_and_hashes_the_same(seed0, fresh_none_hash):
    """PYTHONHASHSEED set in the parent's os.environ reaches a spawned process (how vLLM starts
    EngineCore and workers when it cannot fork, and as good as another engine of the same
    vLLM and Python version): both sides pass, or both raise, and vLLM's default sha256 (pickle)
    gives the same block hashes in both, as sha256_cbor does."""
    cfg = config("xxhash_cbor")
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        problems, hashes = pool.apply(_child, (cfg,))
    assert problems == hash_reproducibility_problems(cfg) == []
    for algo, theirs in hashes.items():
        assert theirs == block_hashes(algo), algo


def test_unauthenticated_store_warning_once_per_process(warnings_seen, monkeypatch):
    """A shared store without a secret: one warning however many connectors (scheduler and
    workers) the process builds, naming the secret_file setting."""
    monkeypatch.setattr(vllm_checks, "_warned_keys", set())
    for _ in range(3):
        vllm_checks.warn_unauthenticated_store()
    assert len(warnings_seen) == 1 and "secret_file" in warnings_seen[0], warnings_seen


def test_kvstride_logs_in_vllms_format_at_vllms_level():
    """Inside vLLM, kvstride's lines go through vLLM's logging configuration: its handler and
    format (process and pid, level, time, file and line) and its level (INFO shown, DEBUG not),
    also where vLLM configures its logging after kvstride is imported; with vLLM's logging off,
    Python's defaults apply (a warning still reaches stderr)."""
    import subprocess
    import sys

    script = (
        "import logging\n"
        "import kvstride.vllm\n"
        "from vllm.config.logging import LoggingConfig\n"
        "from vllm.logger import configure_logging\n"
        "configure_logging(LoggingConfig(configure_logging=%s))\n"
        "logging.getLogger('kvstride.vllm').info('kvstride info line')\n"
        "logging.getLogger('kvstride.arena').debug('kvstride debug line')\n"
        "logging.getLogger('kvstride.vllm').warning('kvstride warning line')\n"
    )
    run = subprocess.run([sys.executable, "-c", script % "True"], capture_output=True, text=True, timeout=120)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "kvstride" in line and "line" in line]
    assert len(lines) == 2, lines
    assert re.fullmatch(r"\(MainProcess pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[<string>:6\] kvstride info line",
                        lines[0]), lines
    assert " WARNING " in lines[1] and lines[1].endswith("kvstride warning line")
    run = subprocess.run([sys.executable, "-c", script % "False"], capture_output=True, text=True, timeout=120)
    assert "kvstride warning line" in run.stderr and "kvstride info line" not in run.stdout + run.stderr
