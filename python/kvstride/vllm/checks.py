"""Boot-time checks for the vLLM connector: can a store shared across engines hit?

kvstride keys stored blocks by vLLM's request block hashes. A store that several engines (or
restarts of one engine) share serves a hit only if every engine computes the same hash for the
same tokens. Two settings decide that:

- **The seed of the hash chain.** Every request's first block hashes with ``NONE_HASH`` as its
  parent. ``init_none_hash`` (``vllm/v1/core/kv_cache_utils.py``, called once in the
  ``EngineCore`` process with ``get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)``)
  derives it from ``resolve_none_hash_seed``: ``$PYTHONHASHSEED`` when set (the string itself,
  any value); otherwise the fixed ``"vllm-none-hash"`` for ``sha256`` / ``sha256_cbor``, but 32
  random bytes per process for the algorithms in ``_NON_CRYPTO_HASH_FUNCTIONS``: ``xxhash`` and
  ``xxhash_cbor`` (vLLM 0.32 and 0.33, the same code). Such an engine never hits what another
  engine stored, nor what it stored itself before a restart: **refused** (``ValueError``). vLLM
  releases without ``resolve_none_hash_seed`` used random bytes for every algorithm unless
  ``PYTHONHASHSEED`` was set, and are treated that way here.
- **Pickle.** ``sha256`` (vLLM's default) and ``xxhash`` hash ``pickle.dumps`` of the block's
  ``(parent hash, token ids, extra keys)``. Engines of the same vLLM and Python version produce
  the same bytes, so they share a store, as vLLM's own ``MooncakeStoreConnector`` does; but
  pickle's bytes are not promised stable across Python or vLLM versions (and its memo makes
  them depend on object identity: two equal strings in one block's extra keys pickle
  differently when they are one object), so engines on different versions may simply miss.
  A miss costs a recompute, never wrong KV: **allowed, with one warning per process** that
  names ``--prefix-caching-hash-algo sha256_cbor`` (canonical CBOR, reproducible across
  processes, versions and languages) as the fix.

Processes: only the ``EngineCore`` process hashes; its workers (TP ranks, ``mp`` or Ray
executors) get the hashes from the scheduler, so one engine is always consistent with itself.
The check reads the algorithm from the config and ``PYTHONHASHSEED`` from ``os.environ`` and
never looks at ``NONE_HASH`` (the connector is built before ``init_none_hash`` runs, and workers
never run it). Every process of one engine inherits the same environment (``mp`` workers are
forked or spawned from the ``EngineCore``; vLLM's Ray executor copies ``PYTHONHASHSEED`` to its
actors), so the scheduler-side and every worker-side connector reach the same verdict.
Data-parallel ranks are separate ``EngineCore`` processes: they count as several engines.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import List, Optional

__all__ = [
    "check_reproducible_hashes",
    "check_strong_hash",
    "warn_secret_on_tcp",
    "warn_once",
    "WEAK_HASH_ALGOS",
    "warn_unauthenticated_store",
    "hash_reproducibility_problems",
    "hash_portability_warning",
    "PICKLE_HASH_ALGOS",
    "PORTABLE_HASH_ALGO",
]

log = logging.getLogger("kvstride.vllm")

#: vLLM's pickle-based prefix-caching hash algorithms -> their CBOR counterpart.
PICKLE_HASH_ALGOS = {"sha256": "sha256_cbor", "xxhash": "xxhash_cbor"}

#: The algorithm that hashes the same across engines, versions and ``PYTHONHASHSEED``-less
#: processes: canonical CBOR, and a fixed NONE_HASH seed when ``PYTHONHASHSEED`` is unset.
PORTABLE_HASH_ALGO = "sha256_cbor"

_FIX = (
    f"--prefix-caching-hash-algo {PORTABLE_HASH_ALGO} "
    f"(or CacheConfig(prefix_caching_hash_algo={PORTABLE_HASH_ALGO!r}))"
)

#: vLLM's non-cryptographic prefix-caching hashes: a tenant who sends prompts can search for a
#: block that collides with another prefix's hash.
WEAK_HASH_ALGOS = ("xxhash", "xxhash_cbor")

_warned_keys: set = set()  # (what, engine) warn_once logged in this process
_warned_lock = threading.Lock()

SECRET_ON_TCP = (
    "kvstride: secret_file authenticates values against clients of the Mooncake store that lack it, "
    "but over protocol 'tcp' anyone who reaches the Mooncake data port of any engine or holder can "
    "read and write any memory of that process (the transport takes the address a peer names), the "
    "secret included: it protects only on a network where no untrusted host reaches those ports "
    "(docs/OPERATING.md: Trust model)"
)

UNAUTHENTICATED = (
    "kvstride: store 'mooncake' without a secret_file: values are unauthenticated and keys are a "
    "public function of the tokens, so any client of the Mooncake master can write KV this engine "
    "loads and probe which prompts were sent; set kv_connector_extra_config['secret_file'] "
    "(`kvstride store serve --secret-file PATH` creates one; docs/OPERATING.md: Trust model)"
)


def _algo(vllm_config) -> str:
    cache = getattr(vllm_config, "cache_config", None)
    return str(getattr(cache, "prefix_caching_hash_algo", None) or "sha256")


def _none_hash_seed_is_random(algo: str) -> bool:
    """Whether ``init_none_hash`` would pick a different seed in every process for ``algo``
    under the current ``os.environ`` (asked of vLLM's own resolver where it has one)."""
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed
    except ImportError:  # older vLLM: NONE_HASH = os.urandom(32) unless PYTHONHASHSEED is set
        return os.environ.get("PYTHONHASHSEED") is None
    hash_fn = get_hash_fn_by_name(algo)
    # Deterministic seeds come back equal; a random one is 32 fresh bytes on each call.
    return resolve_none_hash_seed(hash_fn) != resolve_none_hash_seed(hash_fn)


def hash_reproducibility_problems(vllm_config) -> List[str]:
    """Why two engines with this config (and this process's environment) could never compute
    the same block hashes for the same tokens, one sentence with its fix each; empty if they
    can (see :func:`hash_portability_warning` for when they still might not)."""
    algo = _algo(vllm_config)
    if not _none_hash_seed_is_random(algo):
        return []
    return [
        f"PYTHONHASHSEED is not set, so vLLM seeds its block hashes (NONE_HASH) with random bytes "
        f"in every process for prefix_caching_hash_algo={algo!r}: set PYTHONHASHSEED=0 (any fixed "
        "value, the same for every engine) in the environment of every vLLM process, or use "
        f"{_FIX}, whose seed is fixed"
    ]


def hash_portability_warning(vllm_config) -> Optional[str]:
    """When engines that share a store with this config would still miss each other (a
    pickle-based algorithm: engines on other vLLM or Python versions), with the fix; ``None``
    for the CBOR algorithms."""
    algo = _algo(vllm_config)
    if algo not in PICKLE_HASH_ALGOS:
        return None
    return (
        f"kvstride: prefix_caching_hash_algo={algo!r} pickles Python objects before hashing. Engines "
        "sharing this store hit each other only if they run the same vLLM and Python version (and "
        "the same PYTHONHASHSEED, or none): pickle's bytes are not stable across versions, so an "
        "engine on another vLLM or Python version computes other block hashes and misses (a "
        f"recompute, never wrong KV). To share across versions use {_FIX} on every engine."
    )


def warn_once(key: str, message: str, *args, engine=None) -> None:
    """Log ``message`` once for ``key`` and ``engine`` (its ``VllmConfig``: once per engine
    where a process runs several). The configuration's warnings are the scheduler side's alone
    (``worker`` below): an engine says each once, however many worker processes it has."""
    with _warned_lock:
        if (key, id(engine)) in _warned_keys:
            return
        _warned_keys.add((key, id(engine)))
    log.warning(message, *args)


def check_reproducible_hashes(vllm_config, shared: bool, worker: bool = False) -> None:
    """For a ``shared`` store (it outlives this engine or other engines use it): raise
    ``ValueError`` if vLLM's block hashes under ``vllm_config`` and ``os.environ`` could never
    match another engine's (a random NONE_HASH seed), naming the setting and its fix; otherwise
    log :func:`hash_portability_warning`, if any, once per engine, by its scheduler (a
    ``worker`` logs none). Says nothing when not ``shared``: within one engine the hashes
    always agree."""
    if not shared:
        return
    problems = hash_reproducibility_problems(vllm_config)
    if problems:
        raise ValueError(
            "kvstride: the store is shared across engines, but vLLM's block hashes would differ "
            "between them, so it would never hit: " + "; and ".join(problems)
        )
    warning = hash_portability_warning(vllm_config)
    if warning is not None and not worker:
        warn_once("portability", "%s", warning, engine=vllm_config)


def warn_disk_not_reusable(vllm_config) -> None:
    """The disk tier outlives its engine only for hashes a restarted engine computes again: when
    it would not, say so once (the tier still adds capacity while this engine runs)."""
    problems = hash_reproducibility_problems(vllm_config)
    if problems:
        warn_once("disk-restarts", "kvstride: a restarted engine will not hit this disk tier's records: %s",
                  "; and ".join(problems), engine=vllm_config)


def check_strong_hash(vllm_config, extra: dict, worker: bool = False) -> None:
    """A store shared across engines (Mooncake) with a non-cryptographic block hash is a
    ``ValueError`` naming the fix, unless ``extra["allow_weak_hash"]`` is ``true`` (a
    single-tenant choice, logged once per engine by its scheduler)."""
    allow = extra.get("allow_weak_hash", False)
    if not isinstance(allow, bool):
        raise ValueError(f"kv_connector_extra_config['allow_weak_hash']={allow!r}: use true or false")
    algo = _algo(vllm_config)
    if algo not in WEAK_HASH_ALGOS or (allow and worker):
        return
    if not allow:
        raise ValueError(
            f"kvstride: prefix_caching_hash_algo={algo!r} with store 'mooncake': anyone who can send prompts to an "
            "engine sharing the store can search for a block whose non-cryptographic hash collides with another "
            "prefix's, and every engine would then load its KV for that prefix; use "
            f"{_FIX}, or set kv_connector_extra_config['allow_weak_hash']=true if only trusted prompts reach "
            "every engine of this store"
        )
    warn_once(
        "weak-hash",
        "kvstride: allow_weak_hash: prefix_caching_hash_algo=%r on a shared store; a prompt crafted to collide "
        "with another prefix's block hash makes every engine of the store load its KV for that prefix", algo,
        engine=vllm_config,
    )


def warn_secret_on_tcp(engine=None) -> None:
    """Log :data:`SECRET_ON_TCP` once per engine."""
    warn_once("secret-on-tcp", "%s", SECRET_ON_TCP, engine=engine)


def warn_unauthenticated_store(engine=None) -> None:
    """Log, once per engine, that a shared store without the deployment secret is
    unauthenticated."""
    warn_once("unauthenticated", "%s", UNAUTHENTICATED, engine=engine)
