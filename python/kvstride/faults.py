"""Store faults for ``kvstride simulate --fault-every N`` and the tests: corrupt stored values,
restart the store, evict values. Nothing in the engine or the stores calls these; a driver
that wants faults calls them between engine steps.

Every fault must cost only recomputation: a corrupted value is caught by the store's verified
read (``Status.CORRUPT``, never scattered into a KV block), a restarted or evicted store just
misses. Corrupting values of a store that does not verify reads would load wrong bytes, so it
is refused.

Both stores are handled:

- ``EmbeddedStore``: bytes of the value are flipped in its arena slot; restart drops every
  value; evict removes a random share of the stored keys.
- ``MooncakeStore``: the store cannot list its keys, so corrupt and evict act on the
  ``keys`` the caller names (those absent are ignored). A value is corrupted by reading it
  with the raw client, removing it and putting back a copy with flipped payload bytes.
  Restart kills and restarts the master (one kvstride started: ``master`` or the store's
  own) and waits until the client has reconnected and a put goes through again.
"""

from __future__ import annotations

import random
import time
from typing import Iterable, List, Optional

import numpy as np

from kvstride.stores import HEADER_BYTES, EmbeddedStore, KVStore, MasterProcess, MooncakeStore, Status

__all__ = ["corrupt_values", "evict", "restart", "can_restart"]

_FLIPS = 3  # payload bytes flipped per corrupted value


def _present(store: KVStore, keys: Optional[Iterable[str]]) -> List[str]:
    if keys is None:
        if isinstance(store, EmbeddedStore):
            return store.keys()
        raise ValueError(f"{type(store).__name__} cannot list its keys: name the candidate keys")
    keys = list(dict.fromkeys(keys))
    if not keys:
        return []
    return [k for k, p in zip(keys, store.exists(keys)) if p]


def _flip(value: np.ndarray, rng: random.Random, start: int = HEADER_BYTES) -> None:
    """Flip bytes of ``value`` after its first ``start`` (a Mooncake value's header)."""
    payload = value.nbytes - start
    for _ in range(_FLIPS):
        value[start + rng.randrange(payload)] ^= 0xFF


def corrupt_values(store: KVStore, rng: random.Random, count: int, keys: Optional[Iterable[str]] = None) -> int:
    """Flip payload bytes of up to ``count`` stored values (chosen among ``keys`` when given,
    else among everything an embedded store holds). Returns how many were corrupted."""
    if not store.verify:
        raise ValueError("corrupting values of a store with verify=False would load wrong bytes")
    candidates = _present(store, keys)
    victims = rng.sample(candidates, min(count, len(candidates)))
    done = 0
    if isinstance(store, EmbeddedStore):
        for key in victims:
            value = store.value_view(key)
            if value is not None and value.nbytes:
                _flip(value, rng, start=0)
                done += 1
        return done
    if isinstance(store, MooncakeStore):
        with store.raw() as client:
            if client is None:
                return 0
            for key in victims:
                size = client.get_size(key)
                if size <= HEADER_BYTES:
                    continue
                value = np.empty(size, dtype=np.uint8)
                if client.get_into(key, value.ctypes.data, size) != size:
                    continue
                _flip(value, rng)
                client.remove(key, True)
                if client.put_from(key, value.ctypes.data, size) == 0:
                    done += 1
        return done
    raise TypeError(f"no fault injection for {type(store).__name__}")


def evict(store: KVStore, rng: random.Random, fraction: float = 0.5, keys: Optional[Iterable[str]] = None) -> int:
    """Remove a random ``fraction`` of the stored values (among ``keys`` when given). Returns
    how many were removed."""
    candidates = _present(store, keys)
    victims = rng.sample(candidates, int(round(len(candidates) * fraction)))
    if victims:
        store.remove(victims)
    return len(victims)


def can_restart(store: KVStore, master: Optional[MasterProcess] = None) -> bool:
    if isinstance(store, EmbeddedStore):
        return True
    if isinstance(store, MooncakeStore):
        return (master or store._owned_master) is not None
    return False


def restart(store: KVStore, master: Optional[MasterProcess] = None, timeout: float = 30.0) -> float:
    """Lose every value as a store restart does. Mooncake: kill the master, start it again
    on the same ports and wait until this store's client works again. Returns the seconds
    until the store answered again."""
    start = time.monotonic()
    if isinstance(store, EmbeddedStore):
        store.clear()
        return 0.0
    if not isinstance(store, MooncakeStore):
        raise TypeError(f"no fault injection for {type(store).__name__}")
    master = master or store._owned_master
    if master is None:
        raise ValueError(f"cannot restart the Mooncake master at {store.master_address}: kvstride did not start it")
    master.kill()
    master.restart()
    probe = np.zeros(256, dtype=np.uint8)
    key = f"kvstride-fault-probe-{master.pid}"
    deadline = start + timeout
    while True:
        if store.put([key], [[probe]]) == [Status.OK]:
            store.remove([key])
            return time.monotonic() - start
        if time.monotonic() > deadline:
            raise RuntimeError(f"Mooncake client did not recover {timeout:.0f} s after the master restart")
        time.sleep(0.1)
