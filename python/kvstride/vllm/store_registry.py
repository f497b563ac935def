"""Stores shared by the connectors of one process: vLLM builds a scheduler-side and a
worker-side connector in one process (``uni`` executor) and may rebuild them; each Mooncake
client (and its segment and registrations) exists once per process and closes with its last
user."""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Dict, Optional, Tuple

from kvstride.stores import KVStore

__all__ = ["shared_store", "release_shared_store", "drop_shared_stores", "make_store"]

log = logging.getLogger("kvstride.vllm")

_STORES: Dict[Tuple[str, bytes], KVStore] = {}
_STORE_USERS: Dict[Tuple[str, bytes], int] = {}  # connectors holding each store
_STORES_LOCK = threading.Lock()


def shared_store(name: str, fingerprint: bytes, factory) -> KVStore:
    """The process-wide store for ``(name, fingerprint)``, made by ``factory()`` once; each
    call holds a reference until :func:`release_shared_store`."""
    with _STORES_LOCK:
        key = (name, fingerprint)
        store = _STORES.get(key)
        if store is None:
            store = _STORES[key] = factory()
            _STORE_USERS[key] = 0
        _STORE_USERS[key] += 1
        return store


def release_shared_store(store: KVStore) -> None:
    """Drop one reference to a shared store; the last one closes it (its client, segment
    and buffer registrations go with it)."""
    with _STORES_LOCK:
        key = next((k for k, s in _STORES.items() if s is store), None)
        if key is None:
            return
        _STORE_USERS[key] -= 1
        if _STORE_USERS[key] > 0:
            return
        del _STORES[key], _STORE_USERS[key]
    try:
        store.close()
    except Exception as err:
        log.warning("kvstride: closing the store failed: %r", err)


def drop_shared_stores() -> None:
    """Close and forget every shared store (tests)."""
    with _STORES_LOCK:
        stores = list(_STORES.values())
        _STORES.clear()
        _STORE_USERS.clear()
    for store in stores:
        try:
            store.close()
        except Exception:
            pass


def make_store(extra: dict, fingerprint: bytes, secret: Optional[bytes] = None) -> KVStore:
    """The Mooncake client, configured the way vLLM's MooncakeStoreConnector is
    (``MOONCAKE_CONFIG_PATH``), explicit ``mooncake_*`` keys overriding the file."""
    kind = str(extra.get("store"))
    if kind != "mooncake":
        raise ValueError(f"unknown kvstride store {kind!r}; use 'embedded' (the default) or 'mooncake'")
    from kvstride.mooncake_config import resolve_client_config
    from kvstride.stores import MooncakeStore

    config = resolve_client_config(extra)
    name = f"mooncake:{config.master_server_address}:{extra.get('store_name', 'default')}"
    if secret is not None:  # connectors with different keys never share a client; the key itself stays out
        name += ":key:" + hashlib.sha256(b"kvstride secret id\0" + secret).hexdigest()[:16]
    return shared_store(
        name, fingerprint, lambda: MooncakeStore.from_config(config, fingerprint=fingerprint, secret=secret)
    )
