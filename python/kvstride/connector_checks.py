"""The checks of a ``--kv-transfer-config`` that need no engine. The connector runs them first
when vLLM builds it, and ``kvstride check-config`` runs them offline, so that a mistake is the
same one-line ``ValueError`` either way, before any model loads. What needs the engine (the KV
cache's groups, the hash algorithm vLLM runs with, the checkpoint on disk) stays with the
connector (:mod:`kvstride.vllm.config`)."""

from __future__ import annotations

import difflib
from typing import Optional

from kvstride.arena.disk import check_disk_folder, existing_records_bytes
from kvstride.engine import (
    DEFAULT_LOAD_TIMEOUT_S,
    DEFAULT_LOOKUP_TIMEOUT_S,
    DEFAULT_PUT_LINGER_S,
    DEFAULT_SAVE_WAIT_S,
    DEFAULT_STAGING_WAIT_S,
    check_load_timeout,
    check_lookup_timeout,
    check_put_linger,
    check_save_wait,
    check_staging_wait,
)
from kvstride.mooncake_config import OVERRIDE_KEYS, resolve_client_config
from kvstride.sizes import parse_size
from kvstride.secret import load_secret

__all__ = ["CONNECTOR", "MODULE", "ADMISSION_POLICIES", "KNOWN_KEYS", "STORES", "check_known_keys",
           "check_admission", "check_failure_policy", "check_store_kind", "check_extra", "check_extra_on_this_host",
           "check_transfer_config"]

#: How vLLM names and imports the connector (``--kv-transfer-config``).
CONNECTOR, MODULE = "KVStrideConnector", "kvstride.vllm"

#: ``kv_connector_extra_config["admission"]``: ``kvstride`` keeps a window group's blocks only
#: where a later lookup can hit (SEMANTICS §8, under vLLM's ``prefix_cache_retention_interval``);
#: ``dense`` keeps every window tail, whatever the retention.
ADMISSION_POLICIES = ("kvstride", "dense")

STORES = ("embedded", "mooncake")

#: Every ``kv_connector_extra_config`` key the connector reads (docs/OPERATING.md lists them): any other
#: is refused, so that a misspelled ``secret_file`` never runs a shared store unauthenticated.
KNOWN_KEYS = frozenset({
    "store", "store_bytes", "disk_path", "disk_bytes", "staging_bytes", "save_wait_s", "staging_wait_s", "put_linger_s",
    "load_timeout_s", "lookup_timeout_s",
    "admission", "allow_failing_loads", "trust_client_mm_uuids",
    "store_name", "model_id", "model_identity", "allow_weak_hash", "cache_prefix", "secret_file", *OVERRIDE_KEYS,
})


def check_known_keys(extra: dict) -> None:
    """``ValueError`` naming the first key of ``extra`` the connector does not read, and the
    nearest one it does."""
    for key in sorted(map(str, extra)):
        if key not in KNOWN_KEYS:
            near = difflib.get_close_matches(key, sorted(KNOWN_KEYS), n=1, cutoff=0.5)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise ValueError(
                f"kv_connector_extra_config has an unknown key {key!r}: {hint}the connector reads "
                f"{', '.join(sorted(KNOWN_KEYS))} (docs/OPERATING.md: kv_connector_extra_config)"
            )


def check_admission(value) -> str:
    """``kv_connector_extra_config["admission"]``, or ``ValueError`` naming it."""
    if value not in ADMISSION_POLICIES:
        raise ValueError(
            f"kv_connector_extra_config['admission']={value!r}: use one of {', '.join(ADMISSION_POLICIES)} "
            "(kvstride stores window blocks only where a later lookup can hit; dense stores them all)"
        )
    return value


def _check_flag(extra: dict, key: str) -> bool:
    value = extra.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"kv_connector_extra_config[{key!r}]={value!r}: give true or false")
    return value


def check_failure_policy(policy: Optional[str], extra: dict) -> None:
    """vLLM's ``kv_load_failure_policy`` (None: a vLLM without it) must be ``"recompute"``:
    kvstride reports routine misses (a load past its deadline, a value evicted or corrupted
    since the lookup, a rejected disk record) as failed loads, which vLLM's default ``"fail"``
    turns into failed requests. The operator who wants that sets ``allow_failing_loads``."""
    allow = _check_flag(extra, "allow_failing_loads")
    if policy is None or policy == "recompute" or allow:
        return
    raise ValueError(
        f"kv_load_failure_policy={policy!r} ends a request with an error whenever its kvstride load fails "
        "(a deadline, a value evicted since the lookup, a corrupted value: all routine misses); set "
        "\"kv_load_failure_policy\": \"recompute\" in --kv-transfer-config so that vLLM computes those tokens, "
        "or kv_connector_extra_config[\"allow_failing_loads\"]: true to keep vLLM's behaviour"
    )


def check_store_kind(extra: dict) -> str:
    """``store``, and the disk tier's keys only where they mean something."""
    kind = str(extra.get("store", "embedded"))
    if kind not in STORES:
        raise ValueError(f"unknown kvstride store {kind!r}; use 'embedded' (the default) or 'mooncake'")
    if kind == "mooncake" and ("disk_path" in extra or "disk_bytes" in extra):
        raise ValueError("kv_connector_extra_config['disk_path'] is the embedded store's disk tier; with "
                         "store 'mooncake' configure Mooncake's own SSD offload instead, or use store 'embedded'")
    if ("disk_path" in extra) != ("disk_bytes" in extra):
        given, missing = ("disk_path", "disk_bytes") if "disk_path" in extra else ("disk_bytes", "disk_path")
        raise ValueError(f"kv_connector_extra_config has {given!r} but not {missing!r}: the disk tier needs both "
                         "(a folder, and the bytes of records per TP rank, e.g. '4TiB')")
    return kind


def check_extra(extra: dict, failure_policy: Optional[str]) -> Optional[bytes]:
    """Every check of ``kv_connector_extra_config`` that needs no engine, with vLLM's
    ``kv_load_failure_policy``; returns the deployment key (``secret_file``), None without one."""
    check_known_keys(extra)
    check_failure_policy(failure_policy, extra)
    return _check_settings(extra)


def check_extra_on_this_host(extra: dict) -> None:
    """What can be checked of ``kv_connector_extra_config`` alone, before vLLM starts a worker:
    ``check_extra`` but the failure policy (vLLM passes the extra config alone), the disk tier's
    folder and the Mooncake client's settings as read on this host."""
    if not isinstance(extra, dict):
        raise ValueError(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
    check_known_keys(extra)
    _check_settings(extra)
    _check_host(extra)


def _check_host(extra: dict) -> None:
    if "disk_path" in extra:
        check_disk_folder(extra["disk_path"], 0, existing=existing_records_bytes(extra["disk_path"]))
    if check_store_kind(extra) == "mooncake":
        resolve_client_config(extra)


def _check_settings(extra: dict) -> Optional[bytes]:
    _check_flag(extra, "trust_client_mm_uuids")
    check_store_kind(extra)
    for key in ("store_bytes", "disk_bytes", "staging_bytes"):
        if key in extra:
            parse_size(extra[key], key)
    check_save_wait(extra.get("save_wait_s", DEFAULT_SAVE_WAIT_S))
    check_staging_wait(extra.get("staging_wait_s", DEFAULT_STAGING_WAIT_S))
    check_put_linger(extra.get("put_linger_s", DEFAULT_PUT_LINGER_S))
    check_load_timeout(extra.get("load_timeout_s", DEFAULT_LOAD_TIMEOUT_S))
    check_lookup_timeout(extra.get("lookup_timeout_s", DEFAULT_LOOKUP_TIMEOUT_S))
    check_admission(extra.get("admission", "kvstride"))
    secret_file = extra.get("secret_file")
    return load_secret(secret_file) if secret_file else None


def check_transfer_config(transfer) -> dict:
    """A whole ``--kv-transfer-config`` (parsed JSON), offline: the connector's name and module,
    ``check_extra``, the disk tier's folder and the Mooncake client's settings (its file at
    ``MOONCAKE_CONFIG_PATH`` with the ``mooncake_*`` keys on top), as the connector would read
    them on this host. Returns ``kv_connector_extra_config``."""
    if not isinstance(transfer, dict):
        raise ValueError(f"--kv-transfer-config must be a JSON object, got {type(transfer).__name__}")
    for key, want in (("kv_connector", CONNECTOR), ("kv_connector_module_path", MODULE)):
        if transfer.get(key) != want:
            raise ValueError(f"{key}={transfer.get(key)!r}: vLLM loads kvstride with \"{key}\": \"{want}\"")
    extra = transfer.get("kv_connector_extra_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"kv_connector_extra_config must be a JSON object, got {type(extra).__name__}")
    # vLLM's own default when the key is absent.
    check_extra(extra, transfer.get("kv_load_failure_policy", "fail"))
    _check_host(extra)
    return extra
