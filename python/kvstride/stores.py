"""Block stores: one protocol, an embedded host-memory arena and the real Mooncake store.

Protocol (both stores)::

    exists(keys) -> list[bool]                      one call, one round trip
    put(keys, buffers) -> list[Status]              idempotent: a present key is left as is
    get(keys, buffers) -> list[Status]              a key asked twice is fetched once and
                                                    written to every destination
    register_buffer(ptr, nbytes); close()

``buffers[i]`` is key i's payload as a list of parts: contiguous CPU torch tensors, numpy arrays,
writable buffers, or ``(address, nbytes)`` pairs (what ``StagedBatch.parts`` gives) that lie
inside memory registered with this store (``register_buffer``, which ``StagingPool.register``
calls). A raw pair anywhere else refuses the whole call (every key ``INVALID``): a store never
reads or writes memory it was not handed.

The embedded store keeps each value in a fixed-size slot of one preallocated arena, with its
XXH3-64 next to it; bound to a KV layout it also copies blocks straight between the KV tensors
and its slots (``save_blocks`` / ``load_blocks``), which is what ``OffloadEngine`` uses. A
Mooncake value is a 64-byte header followed by the parts' bytes in order: a format version,
the layout fingerprint, a digest of the key, the payload length and the payload's XXH3-64.

With a deployment secret (``MooncakeStore(..., secret=)``, issue 17) the header is version 3: the
digest field holds a keyed payload tag (an AEGIS-128X2 MAC of the payload) and the last 16
bytes a keyed MAC over key, length and tag, so a value written without the secret is
``CORRUPT``, removed and counted (``counters["mac_rejected"]``), never loaded.

Verified reads (``verify=True``, the default): a value whose digest (or header) does not match
is reported ``Status.CORRUPT`` and removed from the store. For ``get`` the bytes of a non-OK
key in its destination buffers are undefined: destinations must be staging buffers, and only
OK keys may be scattered into KV blocks (``Transfer.scatter(batch, ok=[s is Status.OK for s
in statuses])``).

At run time nothing raises: every failure is a status, counted in ``store.counters`` and
logged once per (operation, status).  Construction errors (bad configuration, an unreachable
master) raise ``ValueError`` / ``RuntimeError``.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import ctypes
import enum
import hmac
import importlib.util
import logging
import os
import queue
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import urllib.request
from typing import Optional, Sequence

import numpy as np
import xxhash

from kvstride.mooncake_config import (
    DEFAULT_LOCAL_BUFFER_BYTES,
    DEFAULT_SEGMENT_BYTES,
    MOONCAKE_PIP,
    MooncakeClientConfig,
    MooncakeDependencyError,
    missing_library,
    resolve_local_hostname,
)

__all__ = [
    "Status",
    "KVStore",
    "EmbeddedStore",
    "MooncakeStore",
    "MasterProcess",
    "start_master",
    "HEADER_BYTES",
    "FORMAT_VERSION",
    "FORMAT_VERSION_MAC",
]

log = logging.getLogger("kvstride.stores")

HEADER_BYTES = 64
FORMAT_VERSION = 1
_MAGIC = b"KVS\x01"
_HDR = struct.Struct("<4sHH8s16sQQ")  # magic, version, flags, fingerprint, key digest, len, xxh3
_FLAG_HASHED = 1
# With a deployment secret (issue 17, ``secret=``): version 3, flags HASHED | MAC, the digest
# field holds the keyed payload tag T (``StoreSecret.payload_tags``: AEGIS-128X2-MAC under a
# subkey of the secret, truncated to 64 bits) and bytes 48..64 the header
# MAC, BLAKE3_keyed(k_mac, u32_le(len(key)) || key || u64_le(len) || u64_le(T))[:16]: together a
# MAC over key || payload that nobody without the secret can compute. Values without a secret
# stay version 1, byte for byte as before. Version 2 (the same header with a keyed BLAKE3 payload
# tag, a third of copy speed) is no longer read: such a value is a "bad magic/version" miss.
FORMAT_VERSION_MAC = 3
_FLAG_MAC = 2
_MAC_AT = _HDR.size  # 48: the MAC fills the header's last 16 bytes
_NO_MAC = "no MAC: written without the deployment secret"
_BAD_MAC = "MAC mismatch: written without the deployment secret"
_MAC_REJECTS = frozenset({_NO_MAC, _BAD_MAC})
# Verification failures that mean the stored bytes themselves are bad (removed from the store so
# that the next put rewrites them); a length or fingerprint mismatch may be a value that is
# right for another reader and is left alone.
_BAD_CONTENT = frozenset(
    {"short header", "short value", "bad magic/version", "key digest mismatch", "payload hash mismatch", _NO_MAC, _BAD_MAC}
)


class Status(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # not in the store (never put, evicted, removed, lost with a segment)
    FULL = "full"  # no room (Mooncake -200, or a value larger than the embedded budget)
    CORRUPT = "corrupt"  # header, length or hash mismatch: never to be copied into a KV block
    UNAVAILABLE = "unavailable"  # store down / unreachable / closed / transfer failed
    INVALID = "invalid"  # the request itself was refused (empty key or value, bad buffer)
    ERROR = "error"  # anything else the store reported

    def __bool__(self) -> bool:  # `if status:` reads as "ok"
        return self is Status.OK


# ---- byte helpers -----------------------------------------------------------------------


def _region(part, writable: bool):
    """(address, nbytes, keepalive) of one buffer object."""
    try:
        import torch

        if isinstance(part, torch.Tensor):
            if part.device.type != "cpu" or not part.is_contiguous():
                raise ValueError("buffer tensors must be contiguous CPU tensors")
            return part.data_ptr(), part.numel() * part.element_size(), part
    except ImportError:  # pragma: no cover
        pass
    arr = part if isinstance(part, np.ndarray) else np.frombuffer(part, dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("buffer arrays must be C-contiguous")
    if writable and not arr.flags.writeable:
        raise ValueError("get destinations must be writable")
    return arr.ctypes.data, arr.nbytes, arr


def _is_raw(part) -> bool:
    return type(part) is tuple and len(part) == 2 and type(part[0]) is int and type(part[1]) is int


def _inside(parts, allowed) -> bool:
    """Every raw ``(address, nbytes)`` of ``parts`` lies inside one of the ``allowed``
    ``(start, end)`` ranges (one pass when the key's parts share a buffer, as staged ones do)."""
    for lo, hi in allowed:  # a plain loop: this runs for every part of every staged batch
        for a, n in parts:
            if a < lo or n < 0 or a + n > hi:
                break
        else:
            return True
    return len(parts) > 1 and all(_inside((p,), allowed) for p in parts)


_OUTSIDE = "a raw (address, nbytes) part is not inside a buffer registered with this store (register_buffer)"


def _regions(buffers, writable: bool, allowed=()):
    """Each key's parts as ``(address, nbytes)`` and what keeps them alive; raw pairs must lie
    inside the ``allowed`` ranges."""
    out, keep = [], []
    for parts in buffers:
        if _is_raw(parts):
            parts = [parts]
        elif not isinstance(parts, (list, tuple)):
            parts = [parts]
        if type(parts) is list and all(map(_is_raw, parts)):  # (address, nbytes) pairs already
            if not _inside(parts, allowed):
                raise ValueError(_OUTSIDE)
            out.append(parts)
            continue
        regs = []
        for p in parts:
            if _is_raw(p):
                if not _inside((p,), allowed):
                    raise ValueError(_OUTSIDE)
                regs.append(p)
                continue
            a, n, k = _region(p, writable)
            regs.append((a, n))
            if k is not None:
                keep.append(k)
        out.append(regs)
    return out, keep


def _mv(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


# The payload hash: XXH3-64 (seed 0) of the parts' bytes in order.  The Rust core hashes with
# the GIL released and a batch of values on all cores; the `xxhash`
# package (same digest) is the fallback when the core is not built (benches from a checkout).
try:
    from . import _core as _rcore

    _xxh3_parts = _rcore.xxh3_64_parts
    _xxh3_batch = _rcore.xxh3_64_batch
except (ImportError, AttributeError):  # pragma: no cover - core not built
    _rcore = _xxh3_parts = _xxh3_batch = None


def _views(parts) -> list:
    """numpy uint8 views of ``(address, nbytes)`` parts (the caller keeps the memory alive)."""
    return [np.frombuffer((ctypes.c_char * n).from_address(a), np.uint8) for a, n in parts if n]


def _hash_parts(parts) -> int:
    if _xxh3_parts is not None:
        return _xxh3_parts(_views(parts))
    h = xxhash.xxh3_64()
    for a, n in parts:
        if n:
            h.update(_mv(a, n))
    return h.intdigest()


def _hash_many(values) -> list:
    """``_hash_parts`` of each value (a list of parts), in one call spread over the cores."""
    if _xxh3_batch is not None:
        return _xxh3_batch([_views(parts) for parts in values])
    return [_hash_parts(parts) for parts in values]


def _key_digest(key: str) -> bytes:
    return xxhash.xxh3_128_digest(key.encode())


def _copy_parts(src, dst) -> None:
    """Copy the byte stream of parts ``src`` into parts ``dst``; the totals must be equal
    (``KVStore._prepare`` refuses a repeated key whose destination size differs)."""
    if [n for _, n in src] == [n for _, n in dst]:
        for (sa, n), (da, _) in zip(src, dst):
            if n and sa != da:
                ctypes.memmove(da, sa, n)
        return
    data = b"".join(bytes(_mv(a, n)) for a, n in src)
    pos = 0
    for a, n in dst:
        ctypes.memmove(a, data[pos : pos + n], n)
        pos += n


class KVStore:
    """Shared bookkeeping: statuses, counters, log-once, dedup, header check."""

    #: ``put(..., digests=)`` / ``get(..., digests_out=)`` / ``corrupt(keys)``: the caller
    #: hashes the payload while it copies it (``OffloadEngine`` on a CPU KV cache).
    takes_digests = False

    def __init__(self, fingerprint: bytes = b"\0" * 8, verify: bool = True, secret: Optional[bytes] = None) -> None:
        # ``secret``: the deployment key (kvstride.secret.load_secret); every value written gets a
        # MAC and every value read must carry a valid one (a value without is CORRUPT, removed and
        # counted in ``counters["mac_rejected"]``). None: values as without it (no MAC).
        self.mac_secret = None
        if secret is not None:
            if _rcore is None:  # pragma: no cover - core not built
                raise RuntimeError("a store secret needs the kvstride core (kvstride._core)")
            self.mac_secret = _rcore.StoreSecret(bytes(secret))
        if isinstance(fingerprint, str):
            fingerprint = bytes.fromhex(fingerprint) if len(fingerprint) == 16 else fingerprint.encode()
        fingerprint = bytes(fingerprint)[:8].ljust(8, b"\0")
        self.fingerprint = fingerprint
        self.verify = bool(verify) or self.mac_secret is not None  # a MAC is always checked
        self.counters: collections.Counter = collections.Counter()
        self._logged: set = set()
        self._note_lock = threading.Lock()  # the caller's thread and the engine's lanes all count
        self._allowed: tuple = ()  # (start, end) of the registered buffers raw parts may name

    # -- to implement --
    def exists(self, keys: Sequence[str]) -> list:
        raise NotImplementedError

    def put(self, keys: Sequence[str], buffers) -> list:
        raise NotImplementedError

    def get(self, keys: Sequence[str], buffers) -> list:
        raise NotImplementedError

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        """Let raw ``(address, nbytes)`` parts name ``nbytes`` at ``ptr`` (a staging pool). The
        caller keeps that memory alive for as long as it uses this store."""
        ptr, nbytes = int(ptr), int(nbytes)
        if ptr <= 0 or nbytes <= 0:
            raise ValueError(f"register_buffer needs a positive address and size, got ({ptr}, {nbytes})")
        with self._note_lock:
            self._allowed += ((ptr, ptr + nbytes),)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- helpers --
    def _note(self, op: str, status: Status, count: int = 1, detail: str = "") -> None:
        with self._note_lock:
            self.counters[f"{op}.{status.value}"] += count
            first = status is not Status.OK and (op, status) not in self._logged
            if first:
                self._logged.add((op, status))
        if first:
            log.warning("kvstride %s %s: %s %s (logged once)", type(self).__name__, op, status.value, detail)

    def _note_all(self, op: str, statuses) -> None:
        for status, count in collections.Counter(statuses).items():
            self._note(op, status, count)

    def _payload_digests(self, values) -> list:
        """Each value's payload digest: XXH3-64, or with a secret the keyed payload tag."""
        if self.mac_secret is not None:
            return self.mac_secret.payload_tags([_views(parts) for parts in values])
        return _hash_many(values)

    def _make_header(self, key: str, parts, digest: Optional[int] = None, mac: Optional[bytes] = None) -> bytes:
        """``digest``: the payload hash when the caller computed it already (``_hash_many``);
        ``mac``: with a secret, the header MAC of this key, length and digest if computed already
        (``_header_macs``, one call for a batch)."""
        length = sum(n for _, n in parts)
        if self.mac_secret is not None:
            if digest is None:
                digest = self._payload_digests([parts])[0]
            if mac is None:
                mac = self.mac_secret.header_macs([key], [length], [digest])[0]
            flags = _FLAG_HASHED | _FLAG_MAC
            return _HDR.pack(_MAGIC, FORMAT_VERSION_MAC, flags, self.fingerprint, _key_digest(key), length, digest) + mac
        if self.verify:
            if digest is None:
                digest = _hash_parts(parts)
            return _HDR.pack(_MAGIC, FORMAT_VERSION, _FLAG_HASHED, self.fingerprint, _key_digest(key), length, digest).ljust(
                HEADER_BYTES, b"\0"
            )
        return _HDR.pack(_MAGIC, FORMAT_VERSION, 0, self.fingerprint, _key_digest(key), length, 0).ljust(HEADER_BYTES, b"\0")

    def _check(self, key: str, header, parts, payload_parts=None, payload_hash=None, defer_payload=False) -> str:
        """'' if the header (and, when verifying, the payload hash) matches, else why not.
        ``payload_hash``: the hash of the payload bytes when the caller computed it already
        (over exactly the bytes that would be hashed here). ``defer_payload``: the caller
        checks the payload against the header's digest itself (``MooncakeStore.get``)."""
        try:
            magic, ver, flags, fp, kd, length, digest = _HDR.unpack_from(header, 0)
        except struct.error:
            return "short header"
        if magic != _MAGIC or ver not in (FORMAT_VERSION, FORMAT_VERSION_MAC):
            return "bad magic/version"
        if self.mac_secret is not None:  # first: a forged header is removed whatever it claims
            if ver != FORMAT_VERSION_MAC or not flags & _FLAG_MAC or len(header) < HEADER_BYTES:
                return _NO_MAC
            want = self.mac_secret.header_macs([key], [length], [digest])[0]
            if not hmac.compare_digest(bytes(header[_MAC_AT:HEADER_BYTES]), want):
                return _BAD_MAC
        elif ver != FORMAT_VERSION:
            return "value carries a MAC (written with a deployment secret this store lacks)"
        if fp != self.fingerprint:
            return "layout fingerprint mismatch"
        if kd != _key_digest(key):
            return "key digest mismatch"
        if length != sum(n for _, n in parts):
            return f"payload length {length} != destination {sum(n for _, n in parts)}"
        if self.verify:
            if not flags & _FLAG_HASHED:
                return "value written without a hash"
            if defer_payload:
                return ""
            if payload_hash is None:
                payload_hash = self._payload_digests([payload_parts or parts])[0]
            if payload_hash != digest:
                return _BAD_MAC if self.mac_secret is not None else "payload hash mismatch"
        return ""

    def _prepare(self, op: str, keys: list, buffers, writable: bool):
        """The buffers as regions (and what keeps them alive), a per-key INVALID or None, the
        dedup of the keys and each key's payload bytes; None, counted, when the whole call is
        refused."""
        try:
            regs, keep = _regions(buffers, writable, self._allowed)
        except (ValueError, TypeError) as e:
            self._note(op, Status.INVALID, len(keys), str(e))
            return None
        if len(regs) != len(keys):
            self._note(op, Status.INVALID, len(keys), "keys and buffers differ in length")
            return None
        first, uniq = self._dedup(keys)
        totals = [sum(n for _, n in r) for r in regs]
        out = self._validate(keys, regs, totals)
        for i, k in enumerate(keys):
            # One key, two sizes: copying one value into both would read past it or leave bytes unwritten.
            if out[i] is None and first[k] != i and totals[i] != totals[first[k]]:
                out[i] = Status.INVALID
                self._note(op, Status.INVALID, 0, f"{k!r} repeated with {totals[i]} and {totals[first[k]]} bytes")
        return regs, keep, out, first, uniq, totals

    @staticmethod
    def _dedup(keys):
        first: dict = {}
        uniq = []
        for i, k in enumerate(keys):
            if k not in first:
                first[k] = i
                uniq.append(i)
        return first, uniq

    @staticmethod
    def _validate(keys, regs, totals):
        """Per key: Status.INVALID or None."""
        out = []
        for k, r, total in zip(keys, regs, totals):
            if not isinstance(k, str) or not k or not r or total <= 0:
                out.append(Status.INVALID)
            else:
                out.append(None)
        return out


# ---- embedded store ---------------------------------------------------------------------


class EmbeddedStore(KVStore):
    """In-process host memory: one preallocated arena of fixed-size slots (``kvstride.arena``)
    with an LRU index; nothing to start. Values cost one copy each way and no allocation.

    The slot size is the largest block of the KV cache once an :class:`OffloadEngine` binds
    the store to its layout (the engine then copies blocks straight between the KV tensors and
    the slots, no staging). Used through the buffer protocol alone, give ``slot_bytes``: a
    value larger than a slot is ``FULL``. The arena (``capacity_bytes // slot`` slots) is
    allocated and touched as soon as the slot size is known; it is pinned when a CUDA KV cache
    sized it (leave ``slot_bytes`` unset then).

    Verified reads keep each value's XXH3-64 next to its slot (computed while the copy is in
    cache) and check it before a byte leaves the slot; a mismatch is ``CORRUPT`` and the value
    is dropped. A slot a load is reading is never evicted or reused until that load ends."""

    def __init__(
        self,
        capacity_bytes: int = 1 << 30,
        *,
        fingerprint: bytes = b"\0" * 8,
        verify: bool = True,
        slot_bytes: Optional[int] = None,
    ) -> None:
        super().__init__(fingerprint, verify)
        if capacity_bytes <= 0:
            raise ValueError(f"EmbeddedStore capacity_bytes must be positive, got {capacity_bytes}")
        if slot_bytes is not None and not 0 < slot_bytes <= capacity_bytes:
            raise ValueError(
                f"EmbeddedStore slot_bytes={slot_bytes} must be positive and at most capacity_bytes={capacity_bytes}"
            )
        self.capacity = int(capacity_bytes)
        self._slot_bytes = slot_bytes
        self.arena = None  # kvstride.arena.HostArena, once the slot size is known
        self._index = None  # kvstride.arena.SlotIndex
        self._lock = threading.Lock()
        self._closed = False
        if slot_bytes is not None:
            self._allocate()

    # -- the arena --

    def bind_layout(self, layout) -> None:
        """Copy blocks of ``layout`` straight between its KV tensors and the slots (what
        ``OffloadEngine`` calls). Sizes the slots to its largest block unless ``slot_bytes``
        did; ``ValueError`` when a block cannot fit a slot."""
        largest = max(g.block_bytes for g in layout.groups)
        if self._slot_bytes is not None and self._slot_bytes < largest:
            raise ValueError(
                f"EmbeddedStore slot_bytes={self._slot_bytes} is smaller than a block of this KV cache "
                f"({largest} bytes); give at least {largest} or leave it unset"
            )
        with self._lock:
            if self.arena is None:
                self._allocate(layout)
            else:
                self.arena.attach(layout)

    def _allocate(self, layout=None) -> bool:
        """(under the lock) Allocate the arena once its slot size is known."""
        from kvstride.arena import HostArena, SlotIndex, slots_for

        if layout is None and self._slot_bytes is None:
            return False
        slot = self._slot_bytes or max(g.block_bytes for g in layout.groups)
        count = slots_for(self.capacity, slot)
        self.arena = HostArena(layout, count, slot_bytes=slot)
        self._index = SlotIndex(count)
        return True

    @property
    def slot_bytes(self) -> Optional[int]:
        return None if self.arena is None else self.arena.slot_bytes

    @property
    def num_slots(self) -> int:
        return 0 if self.arena is None else self.arena.num_slots

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the store holds (the arena: at most ``capacity``)."""
        return 0 if self.arena is None else self.arena.nbytes

    @property
    def used(self) -> int:
        """Bytes of the slots holding a readable value."""
        return 0 if self.arena is None else len(self._index) * self.arena.slot_bytes

    @property
    def evictions(self) -> int:
        return 0 if self._index is None else self._index.evictions

    def __len__(self) -> int:
        return 0 if self._index is None else len(self._index)

    # -- protocol --

    def exists(self, keys):
        keys = list(keys)
        with self._lock:
            if self._closed:
                self._note("exists", Status.UNAVAILABLE, len(keys), "store closed")
                return [False] * len(keys)
            return [False] * len(keys) if self._index is None else self._index.exists(keys)

    def _begin_writes(self, op: str, keys: list, todo: list, out: list) -> list:
        """(under the lock) Slots for the keys at ``todo`` not stored yet: present keys are OK
        (idempotent, touched), the others reserved; FULL when every slot is busy. Returns
        [(index into keys, slot)] to write."""
        index = self._index
        ready = index.exists([keys[i] for i in todo])
        index.touch([keys[i] for i, r in zip(todo, ready) if r])
        fresh = [i for i, r in zip(todo, ready) if not r]
        writing = index.known([keys[i] for i in fresh])
        for i, w in zip(fresh, writing):
            if w:  # another put of this key is writing it now
                out[i] = Status.OK
        fresh = [i for i, w in zip(fresh, writing) if not w]
        for i, r in zip(todo, ready):
            if r:
                out[i] = Status.OK
        slots = index.reserve([keys[i] for i in fresh])
        writes = []
        for i, slot in zip(fresh, slots):
            if slot is None:
                out[i] = Status.FULL
                self._note(op, Status.FULL, 0, "every slot is being read or written")
            else:
                writes.append((i, slot))
        return writes

    def _write(self, op: str, keys: list, writes: list, out: list, copy) -> None:
        """Run ``copy(slots, rows)`` for the reserved ``writes`` outside the lock, then make the
        keys readable, or free their slots if it failed (never raised at run time)."""
        if not writes:
            return
        rows, slots = [i for i, _ in writes], [s for _, s in writes]
        try:
            copy(slots, rows)
            status = Status.OK
        except Exception as e:
            self._note(op, Status.ERROR, 0, repr(e))
            status = Status.ERROR
        with self._lock:
            written = [keys[i] for i in rows]
            if status is Status.OK and not self._closed:
                self._index.confirm(written)
            else:
                self._index.abandon(written)
        for i in rows:
            out[i] = status

    def put(self, keys, buffers):
        keys = list(keys)
        prepared = self._prepare("put", keys, buffers, writable=False)
        if prepared is None:
            return [Status.INVALID] * len(keys)
        regs, _keep, out, first, uniq, totals = prepared  # _keep: the buffers stay alive for the call
        todo = [i for i in uniq if out[i] is None]
        writes: list = []
        with self._lock:
            if self._closed:
                for i in todo:
                    out[i] = Status.UNAVAILABLE
            elif todo and self.arena is None and not self._allocate():
                self._note("put", Status.INVALID, 0, "no slot size yet: pass slot_bytes= or bind_layout() first")
                for i in todo:
                    out[i] = Status.INVALID
            elif todo:
                for i in todo:
                    if totals[i] > self.arena.slot_bytes:
                        out[i] = Status.FULL
                writes = self._begin_writes("put", keys, [i for i in todo if out[i] is None], out)
        self._write(
            "put", keys, writes, out,
            lambda slots, rows: self.arena.save_regions(slots, [regs[i] for i in rows], digest=self.verify),
        )
        return self._finish("put", keys, out, first)

    def _finish(self, op: str, keys: list, out: list, first: dict, regs=None) -> list:
        """Repeated keys take their first occurrence's status (and bytes); count them all."""
        if len(first) < len(keys):
            for i, k in enumerate(keys):
                if out[i] is None:
                    out[i] = out[first[k]]
                    if regs is not None and out[i] is Status.OK:
                        _copy_parts(regs[first[k]], regs[i])
        self._note_all(op, out)
        return out

    def _pin(self, keys: list, todo: list, out: list) -> list:
        """(under the lock) Pin the slots of the keys at ``todo`` that are readable; MISSING
        (or UNAVAILABLE when closed) for the others. Returns [(index into keys, slot)]."""
        if self._closed or self._index is None:
            for i in todo:
                out[i] = Status.UNAVAILABLE if self._closed else Status.MISSING
            return []
        slots = self._index.pin_ready([keys[i] for i in todo])
        reads = []
        for i, slot in zip(todo, slots):
            if slot is None:
                out[i] = Status.MISSING
            else:
                reads.append((i, slot))
        return reads

    def _read(self, op: str, keys: list, reads: list, out: list, fits, copy) -> None:
        """Run ``copy(slots, rows)`` (which entries it copied) for the pinned ``reads`` outside
        the lock, then unpin. A value whose digest check failed is dropped (the next put
        rewrites it); one that does not ``fit`` its destination (length, group) is left for its
        readers. Never raised at run time: an exception fails every read."""
        if not reads:
            return
        rows, slots = [i for i, _ in reads], np.array([s for _, s in reads], dtype=np.int64)
        try:
            ok = copy(slots, rows).tolist()
        except Exception as e:
            self._note(op, Status.ERROR, 0, repr(e))
            with self._lock:
                self._index.unpin(slots.tolist())
            for i in rows:
                out[i] = Status.ERROR
            return
        with self._lock:
            self._index.unpin(slots.tolist())
            if not all(ok):
                self._index.drop_slots([int(s) for s, good, fit in zip(slots, ok, fits) if fit and not good])
        for i, good in zip(rows, ok):
            out[i] = Status.OK if good else Status.CORRUPT
        if not all(ok):
            first_bad = keys[rows[ok.index(False)]]
            self._note(op, Status.CORRUPT, 0, f"{first_bad!r}: payload hash, length or group mismatch")

    def get(self, keys, buffers):
        keys = list(keys)
        prepared = self._prepare("get", keys, buffers, writable=True)
        if prepared is None:
            return [Status.INVALID] * len(keys)
        regs, _keep, out, first, uniq, totals = prepared  # _keep: the buffers stay alive for the call
        with self._lock:
            reads = self._pin(keys, [i for i in uniq if out[i] is None], out)
        if reads:
            slots = np.array([s for _, s in reads], dtype=np.int64)
            fits = self.arena.lengths[slots] == np.array([totals[i] for i, _ in reads], dtype=np.uint64)
            self._read(
                "get", keys, reads, out, fits,
                lambda slots, rows: self.arena.load_regions(slots, [regs[i] for i in rows], verify=self.verify),
            )
        return self._finish("get", keys, out, first, regs)

    # -- blocks straight between the KV cache and the slots (bound to a layout) --

    def save_blocks(self, keys, groups, block_ids) -> list:
        """Store block ``block_ids[i]`` of group ``groups[i]`` of the bound layout under
        ``keys[i]``: one copy from the KV tensors into a slot. Statuses as ``put``."""
        keys = list(keys)
        out: list = [None] * len(keys)
        first, uniq = self._dedup(keys)
        with self._lock:
            if self._closed or self.arena is None or self.arena.layout is None:
                why = "store closed" if self._closed else "no layout bound"
                status = Status.UNAVAILABLE if self._closed else Status.INVALID
                self._note("put", status, 0, why)
                return self._finish("put", keys, [status] * len(keys), first)
            writes = self._begin_writes("put", keys, uniq, out)
        groups, block_ids = np.asarray(groups), np.asarray(block_ids)
        self._write(
            "put", keys, writes, out,
            lambda slots, rows: self.arena.save(slots, groups[rows], block_ids[rows], digest=self.verify),
        )
        return self._finish("put", keys, out, first)

    def load_blocks(self, keys, groups, block_ids) -> list:
        """Load ``keys[i]`` into block ``block_ids[i]`` of group ``groups[i]``: one copy from
        the slot, only after its digest matched. A key asked twice is written to both blocks.
        Statuses as ``get``; a non-OK key's block is left untouched."""
        keys = list(keys)
        out: list = [None] * len(keys)
        with self._lock:
            if self.arena is not None and self.arena.layout is None and not self._closed:
                self._note("get", Status.INVALID, 0, "no layout bound")
                return self._finish("get", keys, [Status.INVALID] * len(keys), {})
            reads = self._pin(keys, list(range(len(keys))), out)  # pins count per destination
        if reads:
            groups, block_ids = np.asarray(groups), np.asarray(block_ids)
            rows = [i for i, _ in reads]
            fits = self.arena.slot_group[[s for _, s in reads]] == groups[rows]
            self._read(
                "get", keys, reads, out, fits,
                lambda slots, rows: self.arena.load(slots, groups[rows], block_ids[rows], verify=self.verify),
            )
        return self._finish("get", keys, out, {})

    # -- housekeeping --

    def remove(self, keys) -> None:
        with self._lock:
            if self._index is not None:
                self._index.drop_slots([s for s in map(self._index.slot, keys) if s is not None])

    def keys(self) -> list:
        """A snapshot of the stored keys, least recently used first."""
        with self._lock:
            return [] if self._index is None else self._index.keys()

    def value_view(self, key: str) -> Optional[np.ndarray]:
        """The stored bytes of ``key`` in place (tests and fault injection), or None."""
        with self._lock:
            slot = None if self._index is None else self._index.slot(key)
            if slot is None:
                return None
            start = slot * self.arena.slot_bytes
            return self.arena.buffer[start : start + int(self.arena.lengths[slot])].numpy()

    def clear(self) -> None:
        """Drop every value (the store stays open), as a restarted store would be."""
        with self._lock:
            if self._index is not None:
                self._index.drop_slots(self._index.ready_slots())

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._index is not None:
                self._index.drop_slots(self._index.ready_slots())


# ---- Mooncake master --------------------------------------------------------------------


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _mooncake_dir() -> str:
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MooncakeDependencyError(
            f"the Mooncake store needs the mooncake package, which is not installed: {MOONCAKE_PIP} "
            "(or `pip install 'kvstride[mooncake]'`)"
        )
    return list(spec.submodule_search_locations)[0]


# ---- masters die with their parent ----
# A master's parent-death signal (Linux prctl) fires when the *thread* that forked it ends, so
# every master is forked by one daemon thread that lives as long as the process; atexit stops
# the masters still running on a normal exit, and the signal kills them on any other.

_PR_SET_PDEATHSIG = 1
try:
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # pragma: no cover - not Linux
    _prctl = None
_spawn_requests: Optional[queue.SimpleQueue] = None
_spawner_pid = 0
_spawner_lock = threading.Lock()
_running: set = set()  # masters started by this process and not stopped yet


def _die_with(parent: int):
    """``preexec_fn``: SIGKILL this child when its parent dies, even if it already has."""

    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before prctl: no signal will come
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _spawner_loop(requests: queue.SimpleQueue) -> None:
    while True:
        fn, done = requests.get()
        try:
            done.set_result(fn())
        except BaseException as e:
            done.set_exception(e)


def _spawn(argv: list, log_path: str) -> subprocess.Popen:
    """``mooncake_master`` with its output appended to ``log_path``, forked by the spawner
    thread (a daemon, never joined: it ends only with the process; a forked child starts its
    own)."""
    global _spawn_requests, _spawner_pid

    def popen() -> subprocess.Popen:
        with open(log_path, "ab") as log_f:
            return subprocess.Popen(
                argv,
                stdout=log_f,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in a terminal reaches the clients, which close first
                preexec_fn=None if _prctl is None else _die_with(os.getpid()),
            )

    with _spawner_lock:
        if _spawn_requests is None or _spawner_pid != os.getpid():
            _spawn_requests, _spawner_pid = queue.SimpleQueue(), os.getpid()
            threading.Thread(
                target=_spawner_loop, args=(_spawn_requests,), name="kvstride-master-spawner", daemon=True
            ).start()
        requests = _spawn_requests
    done: concurrent.futures.Future = concurrent.futures.Future()
    requests.put((popen, done))
    return done.result()


@atexit.register
def _stop_running() -> None:
    for m in list(_running):
        if m.owner == os.getpid():  # a forked child leaves its parent's masters alone
            m.stop()


class MasterProcess:
    """A ``mooncake_master`` started by :func:`start_master`, stopped by PID. It dies with the
    process that started it (on Linux, even on SIGKILL); :meth:`stop` also removes the log
    folder ``start_master`` made for it."""

    def __init__(
        self,
        proc: subprocess.Popen,
        rpc_port: int,
        metrics_port: int,
        log_path: str,
        argv: list,
        host: str = "127.0.0.1",
        owned_log_dir: Optional[str] = None,
    ) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.host = host
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port
        self.log_path = log_path
        self.argv = argv
        self._owned_log_dir = owned_log_dir
        self.owner = os.getpid()
        _running.add(self)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _end(self, sig: int, timeout: float) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL (tests: a master that dies); its log stays for :meth:`restart`."""
        self._end(signal.SIGKILL, 10.0)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (SIGKILL after ``timeout``), then remove the log folder ``start_master``
        made. Final: the master is not restarted after this."""
        self._end(signal.SIGTERM, timeout)
        _running.discard(self)
        if self._owned_log_dir is not None:
            shutil.rmtree(self._owned_log_dir, ignore_errors=True)
            self._owned_log_dir = None

    def restart(self, timeout: float = 15.0) -> None:
        """Start again on the same ports (all keys are lost, clients reconnect by themselves)."""
        self._end(signal.SIGTERM, 10.0)
        self.proc = _spawn(self.argv, self.log_path)
        self.pid = self.proc.pid
        _wait_ready(self, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _log_tail(path: str, lines: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).strip()
    except OSError as e:
        return f"(no log: {e.strerror})"


def _wait_ready(m: MasterProcess, timeout: float) -> None:
    """Wait until ``m`` serves; on failure stop it (its log folder goes too) and raise with the
    log's last lines, or name what Mooncake is missing when the loader refused to start it."""
    deadline = time.monotonic() + timeout
    url = f"http://{m.host}:{m.metrics_port}/health"
    while time.monotonic() < deadline:
        if m.proc.poll() is not None:
            tail = _log_tail(m.log_path)
            m.stop()
            hint = missing_library(tail) if m.proc.returncode == 127 else None  # 127: the loader gave up
            if hint:
                raise MooncakeDependencyError(f"mooncake_master ({m.argv[0]}) cannot start. {hint}")
            raise RuntimeError(f"mooncake_master exited with {m.proc.returncode}; its log ends:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=0.5) as r:
                body = r.read().decode(errors="replace")
            if '"service_ready":true' in body.replace(" ", "") and _port_open(m.host, m.rpc_port):
                return
        except OSError:
            pass
        time.sleep(0.02)
    tail = _log_tail(m.log_path)
    m.stop()
    raise RuntimeError(f"mooncake_master not ready after {timeout:.0f} s; its log ends:\n{tail}")


def start_master(
    *,
    host: str = "127.0.0.1",
    rpc_port: Optional[int] = None,
    lease_ttl_ms: Optional[int] = None,
    eviction_high_watermark: Optional[float] = None,
    extra_args: Sequence[str] = (),
    log_dir: Optional[str] = None,
    timeout: float = 15.0,
) -> MasterProcess:
    """Run ``mooncake_master`` listening on ``host`` (loopback by default) at ``rpc_port`` (a
    free one by default; the metrics port is always a free one), wait until healthy. Its log
    goes to ``log_dir``, else to a temporary folder that :meth:`MasterProcess.stop` removes.
    ``MooncakeDependencyError`` names what is missing when Mooncake cannot run here."""
    package_dir = _mooncake_dir()
    binary = os.path.join(package_dir, "mooncake_master")
    if not os.path.exists(binary):
        binary = shutil.which("mooncake_master")
        if binary is None:
            raise MooncakeDependencyError(
                f"the mooncake_master binary is missing: not in the mooncake package ({package_dir}) nor on PATH; "
                f"{MOONCAKE_PIP} installs it"
            )
    if rpc_port is not None and _port_open(host, rpc_port, 0.2):
        raise RuntimeError(f"port {rpc_port} on {host} is in use; pick another or leave it to a free one")
    rpc = _free_port(host) if rpc_port is None else int(rpc_port)
    met = _free_port(host)
    while met == rpc:
        met = _free_port(host)
    argv = [
        binary,
        f"--rpc_port={rpc}",
        f"--rpc_address={host}",
        f"--metrics_port={met}",
        f"--metrics_host={host}",
        "--logtostderr",
    ]
    if lease_ttl_ms is not None:
        argv.append(f"--default_kv_lease_ttl={int(lease_ttl_ms)}")
    if eviction_high_watermark is not None:
        argv.append(f"--eviction_high_watermark_ratio={eviction_high_watermark}")
    argv += list(extra_args)
    owned_log_dir = None if log_dir else tempfile.mkdtemp(prefix="kvstride-mooncake-")
    log_path = os.path.join(log_dir or owned_log_dir, f"master-{rpc}.log")
    try:
        proc = _spawn(argv, log_path)
    except OSError as e:
        if owned_log_dir is not None:
            shutil.rmtree(owned_log_dir, ignore_errors=True)
        raise RuntimeError(f"cannot run {binary}: {e}") from e
    m = MasterProcess(proc, rpc, met, log_path, argv, host, owned_log_dir)
    _wait_ready(m, timeout)
    return m


# ---- Mooncake store ---------------------------------------------------------------------

_RPC_CODES = (-900, -901)


def _status_of(rc: int, op: str) -> Status:
    if rc >= 0:
        return Status.OK
    if rc == -200:
        return Status.FULL
    if rc == -704:
        return Status.MISSING
    if rc == -705:
        return Status.OK  # already exists: puts are idempotent
    if rc == -707:
        return Status.MISSING  # LEASE_EXPIRED: the read lease ran out mid-transfer; the bytes may be gone
    if rc in _RPC_CODES or rc == -800 or rc == -1000:
        return Status.UNAVAILABLE
    if rc == -600:
        return Status.CORRUPT if op == "get" else Status.INVALID
    return Status.ERROR


class MooncakeStore(KVStore):
    """The real Mooncake store over registered buffers.

    ``master``: ``"host:port"`` of a running master (cluster), a :class:`MasterProcess`, or
    None to start one on loopback for this machine (owned: stopped by :meth:`close`).
    ``segment_bytes``: memory this client contributes (0 = a pure client).  Objects live in some
    client's segment and vanish with it (and all of them when the master restarts).
    ``local_hostname``: where other clients reach this one's segment; unset, the host of a
    master started on this machine (a :class:`MasterProcess` or None), else ``$VLLM_HOST_IP``,
    else ``ValueError`` for a client with a segment (a pure client serves nothing).
    """

    takes_digests = True

    def __init__(
        self,
        master=None,
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        local_buffer_bytes: int = DEFAULT_LOCAL_BUFFER_BYTES,
        protocol: str = "tcp",
        local_hostname: Optional[str] = None,
        metadata_server: str = "P2PHANDSHAKE",
        rdma_devices: str = "",
        fingerprint: bytes = b"\0" * 8,
        verify: bool = True,
        setup_retries: int = 2,
        connect_timeout: float = 2.0,
        retry_after_s: float = 1.0,
        secret: Optional[bytes] = None,
    ) -> None:
        super().__init__(fingerprint, verify, secret)
        self._owned_master: Optional[MasterProcess] = None
        if local_hostname is None and master is None:
            local_hostname = "127.0.0.1"  # the master it starts below listens there
        elif local_hostname is None and isinstance(master, MasterProcess):
            local_hostname = master.host  # a master of this machine: its clients reach this host there
        # A pure client serves no segment, so nobody connects to the address it advertises.
        local_hostname = resolve_local_hostname(local_hostname, int(segment_bytes)) or "127.0.0.1"
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            hint = missing_library(str(e))
            if hint:
                raise MooncakeDependencyError(f"Mooncake's client cannot load. {hint}") from e
            raise MooncakeDependencyError(f"cannot import mooncake.store ({e}): {MOONCAKE_PIP}") from e
        if master is None:
            master = self._owned_master = start_master()
        self.master_address = master.address if isinstance(master, MasterProcess) else str(master)
        try:  # a master this store started is stopped on any failure
            host, _, port = self.master_address.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"Mooncake master address must be 'host:port', got {self.master_address!r}")
            self._host, self._port = host, int(port)
            if not _port_open(host, self._port, connect_timeout):
                raise RuntimeError(
                    f"Mooncake master {self.master_address} is not reachable (TCP connect failed); "
                    "start one (kvstride.stores.start_master()) or pass the right address"
                )
            os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(int(setup_retries)))
            if metadata_server != "P2PHANDSHAKE" and local_hostname.startswith("127."):
                os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
            from kvstride.exposure import listening_sockets

            listening_before = set(listening_sockets())
            client = MooncakeDistributedStore()
            rc = client.setup(
                local_hostname, metadata_server, int(segment_bytes), int(local_buffer_bytes), protocol, rdma_devices,
                self.master_address,
            )
            if rc != 0:  # a failed setup leaves an object we must not call again (close included)
                raise RuntimeError(f"Mooncake setup against {self.master_address} failed with {rc}")
        except BaseException:
            self._stop_owned()
            raise
        self._client = client
        # Measured, not assumed (issue 17): what Mooncake's client opened in this process.
        from kvstride.exposure import listening_sockets, log_listeners

        self.listeners = [x for x in listening_sockets() if x not in listening_before]
        log_listeners(f"MooncakeStore client of master {self.master_address}", only=self.listeners)
        self.protocol = protocol
        self.segment_bytes = int(segment_bytes)
        self._cv = threading.Condition()
        self._inflight = 0
        self._closed = False
        self._down_until = 0.0
        self._retry_after = float(retry_after_s)
        self._registered: list = []

    @classmethod
    def from_config(
        cls,
        config: MooncakeClientConfig,
        *,
        fingerprint: bytes = b"\0" * 8,
        verify: bool = True,
        secret: Optional[bytes] = None,
    ) -> "MooncakeStore":
        """A client as ``config`` (:func:`kvstride.mooncake_config.resolve_client_config`) says;
        ``global_segment_size`` 0 makes a pure client whose objects live in a holder's segment
        (``kvstride store serve``) and outlive it.  A client with a segment advertises
        ``config.local_hostname``, else ``$VLLM_HOST_IP``; with neither it is a ``ValueError``."""
        return cls(
            config.master_server_address,
            segment_bytes=config.global_segment_size,
            local_buffer_bytes=config.local_buffer_size,
            protocol=config.protocol,
            local_hostname=config.local_hostname,
            metadata_server=config.metadata_server,
            rdma_devices=config.device_name,
            fingerprint=fingerprint,
            verify=verify,
            secret=secret,
        )

    # -- guard: never a call after close(), fail fast while the master is down --

    def _enter(self, op: str, n: int):
        with self._cv:  # also guards _down_until, which every calling thread reads and sets
            closed = self._closed or self._client is None
            down = not closed and self._down_until > 0 and time.monotonic() < self._down_until
            probe = not closed and not down and self._down_until > 0
            if not closed and not down:
                self._inflight += 1
                client = self._client
        if closed or down:
            self._note(op, Status.UNAVAILABLE, 0, "store closed" if closed else f"master {self.master_address} down")
            return None
        if probe and not _port_open(self._host, self._port, 0.2):  # the retry time passed: still down?
            self._mark_down(True)
            self._leave()
            self._note(op, Status.UNAVAILABLE, 0, f"master {self.master_address} down")
            return None
        return client

    def _leave(self) -> None:
        with self._cv:
            self._inflight -= 1
            self._cv.notify_all()

    def _mark_down(self, down: bool) -> None:
        with self._cv:
            self._down_until = time.monotonic() + self._retry_after if down else 0.0

    def _saw(self, codes) -> None:
        self._mark_down(any(c in _RPC_CODES for c in codes))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def client(self):
        """The raw MooncakeDistributedStore (tests, benches).  Never use it after close()."""
        return None if self._closed else self._client

    @contextlib.contextmanager
    def raw(self):
        """The raw MooncakeDistributedStore for a few direct calls, held like one of this
        store's own calls (``close`` waits for it); None when closed or known down."""
        c = self._enter("raw", 0)
        try:
            yield c
        finally:
            if c is not None:
                self._leave()

    def health(self) -> int:
        c = self._enter("health", 0)
        if c is None:
            return 1
        try:
            return c.health_check()
        finally:
            self._leave()

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        super().register_buffer(ptr, nbytes)
        c = self._enter("register", 0)
        if c is None:
            return
        try:
            rc = c.register_buffer(int(ptr), int(nbytes))
            if rc == 0:
                self._registered.append(int(ptr))
            else:
                self._note("register", Status.ERROR, 1, f"register_buffer returned {rc}")
        finally:
            self._leave()

    # -- protocol --

    def exists(self, keys):
        keys = list(keys)
        if not keys:
            return []
        c = self._enter("exists", len(keys))
        if c is None:
            return [False] * len(keys)
        try:
            codes = list(c.batch_is_exist(keys))
        except Exception as e:  # the binding raising is a failure, not a crash
            self._note("exists", Status.ERROR, len(keys), repr(e))
            return [False] * len(keys)
        finally:
            self._leave()
        self._saw(codes)
        bad = sum(1 for x in codes if x < 0)
        if bad:
            self._note("exists", Status.UNAVAILABLE, bad, f"batch_is_exist codes {sorted(set(x for x in codes if x < 0))}")
        return [x == 1 for x in codes]

    def _headers(self, n: int) -> np.ndarray:
        return np.zeros(max(n, 1) * HEADER_BYTES, dtype=np.uint8)

    def put(self, keys, buffers, digests=None):
        """``digests``: each value's payload XXH3-64 when the caller computed it while copying
        the bytes (``Transfer.gather(batch, digests=True)``), so they are not read again here."""
        keys = list(keys)
        prepared = self._prepare("put", keys, buffers, writable=False)
        if prepared is None:
            return [Status.INVALID] * len(keys)
        regs, _keep, out, first, uniq, totals = prepared  # _keep: the buffers stay alive for the call
        todo = [i for i in uniq if out[i] is None]
        if todo:
            hdr = self._headers(len(todo))
            hbase = hdr.ctypes.data
            if not self.verify and self.mac_secret is None:
                digests = [None] * len(todo)
            elif digests is not None and len(digests) == len(keys):
                digests = [int(digests[i]) for i in todo]
            else:
                digests = self._payload_digests([regs[i] for i in todo])
            macs = [None] * len(todo)
            if self.mac_secret is not None:  # one call for the batch's header MACs
                lengths = [sum(n for _, n in regs[i]) for i in todo]
                macs = self.mac_secret.header_macs([keys[i] for i in todo], lengths, [int(d) for d in digests])
            hdr[: len(todo) * HEADER_BYTES] = np.frombuffer(
                b"".join(self._make_header(keys[i], regs[i], digests[j], macs[j]) for j, i in enumerate(todo)), np.uint8
            )
            ptrs = [[hbase + j * HEADER_BYTES] + [a for a, _ in regs[i]] for j, i in enumerate(todo)]
            sizes = [[HEADER_BYTES] + [n for _, n in regs[i]] for i in todo]
            codes = self._call("put", "batch_put_from_multi_buffers", [keys[i] for i in todo], ptrs, sizes)
            for i, rc in zip(todo, codes):
                out[i] = _status_of(rc, "put")
                if out[i] is not Status.OK:
                    self._note("put", out[i], 0, f"code {rc}")
        if len(first) < len(keys):
            for i, k in enumerate(keys):
                if out[i] is None:
                    out[i] = out[first[k]]
        self._note_all("put", out)
        return out

    def _call(self, op: str, method: str, keys, ptrs, sizes) -> list:
        c = self._enter(op, len(keys))
        if c is None:
            return [-900] * len(keys)
        try:
            codes = list(getattr(c, method)(keys, ptrs, sizes))
        except Exception as e:
            self._note(op, Status.ERROR, 0, repr(e))
            return [-1] * len(keys)
        finally:
            self._leave()
        if len(codes) != len(keys):
            self._note(op, Status.ERROR, 0, f"{method} returned {len(codes)} codes for {len(keys)} keys")
            return [-1] * len(keys)
        self._saw(codes)
        return codes

    def get(self, keys, buffers, digests_out=None):
        """``digests_out``: a list as long as ``keys``; when given (and verifying), the payload
        hashes are not checked here: each OK key's entry is set to the digest its header
        carries, and the caller must check the bytes against it before they reach a KV block
        (``Transfer.scatter(batch, ok, expected=digests_out)`` does, hashing while it copies)
        and report the keys that failed with :meth:`corrupt`."""
        keys = list(keys)
        prepared = self._prepare("get", keys, buffers, writable=True)
        if prepared is None:
            return [Status.INVALID] * len(keys)
        regs, _keep, out, first, uniq, totals = prepared  # _keep: the buffers stay alive for the call
        todo = [i for i in uniq if out[i] is None]
        corrupt = []
        defer = self.verify and digests_out is not None and len(digests_out) == len(keys)
        if todo:
            hdr = self._headers(len(todo))
            hbase = hdr.ctypes.data
            ptrs = [[hbase + j * HEADER_BYTES] + [a for a, _ in regs[i]] for j, i in enumerate(todo)]
            sizes = [[HEADER_BYTES] + [n for _, n in regs[i]] for i in todo]
            codes = self._call("get", "batch_get_into_multi_buffers", [keys[i] for i in todo], ptrs, sizes)
            hashes: dict = {}
            if self.verify and not defer:  # every full-sized value's payload, hashed in place in one call
                full = [j for j, (i, rc) in enumerate(zip(todo, codes)) if rc == HEADER_BYTES + totals[i]]
                hashes = dict(zip(full, self._payload_digests([regs[todo[j]] for j in full])))
            headers = hdr.tobytes()
            for j, (i, rc) in enumerate(zip(todo, codes)):
                st = _status_of(rc, "get")
                why = ""
                if st is Status.OK:
                    want = HEADER_BYTES + totals[i]
                    why = f"value is {rc} B, expected {want}" if rc != want else ""
                    header = headers[j * HEADER_BYTES : (j + 1) * HEADER_BYTES]
                    why = why or self._check(keys[i], header, regs[i], payload_hash=hashes.get(j), defer_payload=defer)
                    if defer and not why:
                        digests_out[i] = _HDR.unpack_from(header, 0)[-1]
                    if why:
                        st = Status.CORRUPT
                        if why in _BAD_CONTENT:
                            corrupt.append(keys[i])
                        if why in _MAC_REJECTS:
                            with self._note_lock:
                                self.counters["mac_rejected"] += 1
                elif st is Status.CORRUPT:
                    why = f"code {rc} (value larger than the destination)"
                elif rc == -800 and self._size_differs(keys[i], HEADER_BYTES + totals[i]):
                    st, why = Status.CORRUPT, "code -800 and a stored size other than expected"
                if st is not Status.OK:
                    self._note("get", st, 0, f"{keys[i]!r}: {why or f'code {rc}'}")
                out[i] = st
        if corrupt:
            self._remove(corrupt)
        for i, k in enumerate(keys):
            if out[i] is None:
                out[i] = out[first[k]]
                if out[i] is Status.OK:
                    _copy_parts(regs[first[k]], regs[i])
                    if defer:
                        digests_out[i] = digests_out[first[k]]
        self._note_all("get", out)
        return out

    def corrupt(self, keys) -> None:
        """Keys a ``get(..., digests_out=...)`` answered OK whose bytes failed the caller's
        digest check: counted as corrupt (not OK) and removed, so that a later put rewrites
        them."""
        keys = list(dict.fromkeys(keys))
        if not keys:
            return
        with self._note_lock:
            self.counters["get.ok"] -= len(keys)
            if self.mac_secret is not None:  # the payload tag is the MAC's: a forged payload
                self.counters["mac_rejected"] += len(keys)
        why = _BAD_MAC if self.mac_secret is not None else "payload hash mismatch"
        self._note("get", Status.CORRUPT, len(keys), f"{keys[0]!r}: {why}")
        self._remove(keys)

    def _size_differs(self, key: str, want: int) -> bool:
        """A value smaller than its destination fails as TRANSFER_FAIL (-800), like a dead
        holder; tell them apart by the stored size (failure path only)."""
        c = self._enter("get", 1)
        if c is None:
            return False
        try:
            size = c.get_size(key)
        except Exception:
            return False
        finally:
            self._leave()
        return size >= 0 and size != want

    def _remove(self, keys) -> None:
        """Best effort: drop values that failed verification so that a later put rewrites them."""
        c = self._enter("remove", len(keys))
        if c is None:
            return
        try:
            c.batch_remove(list(keys), True)
        except Exception as e:
            self._note("remove", Status.ERROR, 0, repr(e))
        finally:
            self._leave()

    def remove(self, keys) -> None:
        self._remove(list(keys))

    def _stop_owned(self) -> None:
        if self._owned_master is not None:
            self._owned_master.stop()
            self._owned_master = None

    def close(self) -> None:
        """Close the client once (no call reaches it afterwards), then stop an owned master."""
        cv = getattr(self, "_cv", None)
        if cv is None:
            self._stop_owned()
            return
        with cv:
            if self._closed:
                return
            self._closed = True
            while self._inflight:
                cv.wait()
            client, self._client = self._client, None
        if client is not None:
            try:
                if _port_open(self._host, self._port, 0.2):  # each call costs ~4.5 s with the master gone
                    for p in self._registered:
                        client.unregister_buffer(p)
                client.close()
            except Exception as e:  # pragma: no cover
                log.warning("kvstride MooncakeStore close: %r", e)
        self._stop_owned()
