"""The store each side of the connector works with, by ``kv_connector_extra_config["store"]``:
the one place that names the store kinds. The scheduler gets a placement
(:mod:`kvstride.stores.placement`), a worker the store its engine copies to.

Stores are shared by the connectors of one process: vLLM builds a scheduler-side and a
worker-side connector in one process (``uni`` executor) and may rebuild them; each Mooncake
client (and its segment and registrations) exists once per process and closes with its last
user."""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from kvstride.arena import ArenaPlacement, ArenaSlots, slots_for
from kvstride.arena.disk import DISK_ALIGN, DiskSpec, check_disk_folder, existing_records_bytes, record_bytes
from kvstride.arena.disk_index import DiskIndex
from kvstride.connector_checks import check_store_kind
from kvstride.mooncake_config import resolve_client_config
from kvstride.sizes import format_size, parse_size
from kvstride.stores import KVStore, MooncakeStore
from kvstride.stores.placement import StorePlacement
from kvstride.transfer import StagingPool, Transfer, header_room_for, staging_bytes_for
from kvstride.vllm.checks import (
    check_reproducible_hashes, warn_disk_not_reusable, warn_secret_on_tcp, warn_unauthenticated_store,
)

__all__ = [
    "StoreChoice", "choose_store", "open_side_store", "engine_transfer",
    "shared_store", "release_shared_store", "drop_shared_stores", "make_store",
]

log = logging.getLogger("kvstride.vllm")

#: The embedded store's capacity per TP rank without ``store_bytes``.
DEFAULT_STORE_BYTES = 1 << 30


@dataclass(frozen=True)
class StoreChoice:
    """``kv_connector_extra_config["store"]``, and what its kind decides for the connector."""

    kind: str  # "embedded" or "mooncake"
    keyed_ranks: int  # TP ranks whose keys differ (SEMANTICS §3)
    num_slots: int = 0  # arena slots per rank (embedded)
    stored_groups: Optional[Tuple[int, ...]] = None  # the groups whose blocks are stored (embedded)
    disk: Optional["DiskChoice"] = None  # the embedded store's disk tier


@dataclass(frozen=True)
class DiskChoice:
    """``disk_path`` and ``disk_bytes``: the embedded store's disk tier, the same on every side."""

    path: str  # the folder, absolute
    num_records: int  # per rank
    payload_bytes: int  # each record's slot bytes (kvstride.arena.disk.record_bytes)

    @property
    def record_bytes(self) -> int:
        return self.payload_bytes + DISK_ALIGN


def choose_store(extra: dict, kv_cache_config, tp_size: int, stored_groups: Optional[Sequence[int]] = None) -> StoreChoice:
    """The configured store. The arena's keys never leave the scheduler's index and every rank
    writes its own shard into the same slot, so it keys as one rank; a Mooncake store is
    shared by every rank, so each keys (and stripes) its own heads. The arena's slots are sized
    for ``stored_groups`` (the groups the planner keys: never a scratch ring), all by default."""
    kind = check_store_kind(extra)
    if kind == "embedded":
        store_bytes = parse_size(extra.get("store_bytes", DEFAULT_STORE_BYTES), "store_bytes")
        stored = None if stored_groups is None else tuple(stored_groups)
        slot_bytes = arena_slot_bytes(kv_cache_config, stored)
        disk = choose_disk(extra, slot_bytes, tp_size)
        if disk is not None:  # direct I/O: the workers' slots start on its blocks
            slot_bytes = disk.payload_bytes
        return StoreChoice(kind, 1, slots_for(store_bytes, slot_bytes), stored, disk)
    return StoreChoice(kind, tp_size)


def choose_disk(extra: dict, slot_bytes: int, tp_size: int) -> Optional[DiskChoice]:
    """``disk_path`` and ``disk_bytes`` (both or neither), checked: a folder this process may
    write whose file system holds ``disk_bytes`` per TP rank, at least one record."""
    if "disk_path" not in extra:  # (check_store_kind: both keys or neither)
        return None
    disk_bytes = parse_size(extra["disk_bytes"], "disk_bytes")
    payload, record = record_bytes(slot_bytes)
    if disk_bytes < record:
        raise ValueError(f"disk_bytes={format_size(disk_bytes)} holds no record of {format_size(record)}; give at "
                         f"least {format_size(record)} (kv_connector_extra_config['disk_bytes'])")
    num_records = disk_bytes // record
    # What this tier's files hold already is reused, not needed again.
    path = check_disk_folder(extra["disk_path"], num_records * record * tp_size,
                             existing=existing_records_bytes(extra["disk_path"]))
    return DiskChoice(path, num_records, payload)


def arena_slot_bytes(kv_cache_config, stored_groups: Optional[Sequence[int]] = None) -> int:
    """An upper bound of one block's bytes on one rank, over the groups stored (every group by
    default): what the scheduler sizes the arena's slots by (each worker's slots are at most
    this large)."""
    groups = kv_cache_config.kv_cache_groups
    chosen = range(len(groups)) if stored_groups is None else stored_groups
    return max((_group_page_bytes(groups[g]) for g in chosen), default=1)


def _group_page_bytes(group) -> int:
    """One block's bytes over a group's layers (a ``UniformTypeKVCacheSpecs``' page is already
    its layers' sum)."""
    spec = group.kv_cache_spec
    if isinstance(getattr(spec, "kv_cache_specs", None), dict):
        return int(spec.page_size_bytes)
    return int(spec.page_size_bytes) * len(group.layer_names)


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
    config = resolve_client_config(extra)
    name = f"mooncake:{config.master_server_address}:{extra.get('store_name', 'default')}"
    if secret is not None:  # connectors with different keys never share a client; the key itself stays out
        name += ":key:" + hashlib.sha256(b"kvstride secret id\0" + secret).hexdigest()[:16]
    return shared_store(
        name, fingerprint, lambda: MooncakeStore.from_config(config, fingerprint=fingerprint, secret=secret)
    )


def open_side_store(config, vllm_config, worker: bool):
    """(what the side works with, the shared client to release at its shutdown or None).

    Embedded: the scheduler's :class:`~kvstride.arena.ArenaPlacement` (the slot index), a
    worker's :class:`~kvstride.arena.ArenaSlots`. Mooncake: the process's shared client, the
    scheduler's wrapped in a :class:`~kvstride.stores.placement.StorePlacement`; engines
    share what they store, so their block hashes must agree."""
    if config.store.kind == "embedded":
        disk = config.store.disk
        if disk is not None and not worker:  # it outlives this engine, for one that computes the same hashes
            warn_disk_not_reusable(vllm_config)
        if worker:
            spec = None if disk is None else DiskSpec(
                disk.path, disk.num_records, disk.payload_bytes, config.worker_rank, config.world_size,
                bytes.fromhex(config.fingerprint), config.secret)
            return ArenaSlots(config.store.num_slots, stored_groups=config.store.stored_groups, disk=spec), None
        index = None if disk is None else DiskIndex(disk.num_records, disk.path, {
            "record_bytes": disk.record_bytes, "ranks": config.world_size, "fingerprint": config.fingerprint,
            "model": config.model_identity})
        return ArenaPlacement(config.store.num_slots, index, config.world_size), None
    check_reproducible_hashes(vllm_config, shared=True, worker=worker)
    if not worker:  # the engine's warnings are its scheduler's
        if config.secret is None:
            warn_unauthenticated_store(vllm_config)
        elif resolve_client_config(config.extra).protocol == "tcp":
            warn_secret_on_tcp(vllm_config)
    client = make_store(config.extra, bytes.fromhex(config.fingerprint), config.secret)
    return (client if worker else StorePlacement(client)), client


#: Full steps of saves the default staging pool holds: the save lane may trail the steps by a
#: few puts before a step waits for room, so a put's latency does not land on every step
#: (Gemma-3's bench steps waited 0.12-0.46 s a rep with room for one step). Few, because a
#: job the workers have not reported within ``ABANDON_AFTER_STEPS`` (64) is planned again, and
#: a window block that left vLLM's window meanwhile cannot be.
STEPS_STAGED = 8

#: The default staging pool's size at most, per rank: pinned and registered host memory (eight
#: 8k-token steps of an 8B model would be 10.7 GiB). A step that saves more streams through it.
STAGING_CAP_BYTES = 2 << 30


def engine_transfer(store, layout, extra: dict, step_tokens: int, planner):
    """What a worker's engine moves blocks with: the layout alone for a store that copies
    blocks itself (the arena's slots), else a staging pool registered with the store, sized
    by ``staging_bytes`` or, by default, what ``STEPS_STAGED`` full steps of ``step_tokens``
    can save plus the loads' share, capped at ``STAGING_CAP_BYTES``; the size is logged."""
    if hasattr(store, "bind_layout"):
        return layout
    if "staging_bytes" in extra:
        staging_bytes = parse_size(extra["staging_bytes"], "staging_bytes")
        why = "staging_bytes"
    else:  # with room for each block's value header where the engine stages one
        room = header_room_for(store)
        steps = STEPS_STAGED * staging_bytes_for(layout, step_tokens, planner, room)
        smallest = staging_bytes_for(layout, 1, planner, room)  # a block of every group
        staging_bytes = min(steps, max(STAGING_CAP_BYTES, smallest))
        why = f"{STEPS_STAGED} steps of {step_tokens} tokens" + (" (capped)" if staging_bytes < steps else "")
    pool = StagingPool(staging_bytes)
    log.info("kvstride: a %.1f MiB staging pool on this rank (%s), %s", pool.capacity / (1 << 20), why,
             "pinned" if layout.on_cuda else "in host memory")
    try:
        pool.register(store.register_buffer)
    except Exception as err:
        raise RuntimeError(f"kvstride: the store refused the staging buffer: {err!r}") from err
    return Transfer(layout, pool)
