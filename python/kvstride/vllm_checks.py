"""Boot-time checks for the vLLM connector: can a store shared across engines ever hit?

kvstride keys stored blocks by vLLM's request block hashes. A store that several engines (or
restarts of one engine) share serves a hit only if every engine computes the same hash for the
same tokens. In vLLM 0.32 two settings break that:

- **The seed of the hash chain.** Every request's first block hashes with ``NONE_HASH`` as its
  parent. ``init_none_hash`` (``vllm/v1/core/kv_cache_utils.py``, called once in the
  ``EngineCore`` process with ``get_hash_fn_by_name(cache_config.prefix_caching_hash_algo)``)
  derives it from ``resolve_none_hash_seed``: ``$PYTHONHASHSEED`` when set (the string itself,
  any value); otherwise the fixed ``"vllm-none-hash"`` for ``sha256`` / ``sha256_cbor``, but 32
  random bytes per process for the non-cryptographic ``xxhash`` / ``xxhash_cbor``. vLLM releases
  without ``resolve_none_hash_seed`` used random bytes for every algorithm unless
  ``PYTHONHASHSEED`` was set, and are treated that way here.
- **Pickle.** ``sha256`` (vLLM's default) and ``xxhash`` hash ``pickle.dumps`` of Python
  objects, whose bytes depend on the Python and vLLM versions and on object identity (pickle's
  memo). ``sha256_cbor`` / ``xxhash_cbor`` hash canonical CBOR, which is reproducible across
  processes, versions and languages.

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

import os
from typing import List

__all__ = ["check_reproducible_hashes", "hash_reproducibility_problems", "PICKLE_HASH_ALGOS"]

#: vLLM's pickle-based prefix-caching hash algorithms -> the CBOR one to use instead.
PICKLE_HASH_ALGOS = {"sha256": "sha256_cbor", "xxhash": "xxhash_cbor"}


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
    """Why two engines with this config (and this process's environment) would compute
    different block hashes for the same tokens, one sentence with its fix each; empty if they
    would not."""
    cache = getattr(vllm_config, "cache_config", None)
    algo = str(getattr(cache, "prefix_caching_hash_algo", None) or "sha256")
    problems = []
    if algo in PICKLE_HASH_ALGOS:
        fix = PICKLE_HASH_ALGOS[algo]
        problems.append(
            f"prefix_caching_hash_algo={algo!r} pickles Python objects before hashing (its block hashes "
            "depend on object identity and on the Python and vLLM versions), so they are not reproducible "
            f"across engines: use {fix!r} (--prefix-caching-hash-algo {fix}, or CacheConfig(prefix_caching_hash_algo={fix!r}))"
        )
    if _none_hash_seed_is_random(algo):
        problems.append(
            f"PYTHONHASHSEED is not set, so vLLM seeds its block hashes (NONE_HASH) with random bytes "
            f"in every process for prefix_caching_hash_algo={algo!r}: set PYTHONHASHSEED=0 (any fixed "
            "value, the same for every engine) in the environment of every vLLM process"
        )
    return problems


def check_reproducible_hashes(vllm_config, shared: bool) -> None:
    """Raise ``ValueError`` if ``shared`` (the store outlives this engine or is used by other
    engines) and vLLM's block hashes under ``vllm_config`` and ``os.environ`` are not
    reproducible across engines, naming each offending setting and its fix. Says nothing
    otherwise: within one engine the hashes always agree."""
    if not shared:
        return
    problems = hash_reproducibility_problems(vllm_config)
    if problems:
        raise ValueError(
            "kvstride: the store is shared across engines, but vLLM's block hashes would differ "
            "between them, so it would never hit: " + "; and ".join(problems)
        )
