"""The store protocol every kvstride store speaks (:mod:`kvstride.stores`), the buffer parts it
takes, and the 64-byte value header with its digests and MAC."""

from __future__ import annotations

import collections
import ctypes
import enum
import hmac
import logging
import struct
import threading
from typing import Optional, Sequence

import numpy as np
import xxhash


__all__ = ["Status", "KVStore", "HEADER_BYTES", "FORMAT_VERSION", "FORMAT_VERSION_MAC"]

log = logging.getLogger("kvstride.stores")

HEADER_BYTES = 64
FORMAT_VERSION = 1
_MAGIC = b"KVS\x01"
_HDR = struct.Struct("<4sHH8s16sQQ")  # magic, version, flags, fingerprint, key digest, len, xxh3
_FLAG_HASHED = 1
# With a deployment secret (``secret=``): version 3, flags HASHED | MAC, the digest
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


def _payload_after_header_room(regs) -> list:
    """Each value's payload parts, for values whose first part starts with ``HEADER_BYTES`` of
    room for the header (``header_room=True``): that part less its room (possibly empty); no
    parts (so INVALID) for a value whose first part is shorter than the room."""
    payloads = []
    for parts in regs:
        if not parts or parts[0][1] < HEADER_BYTES:
            payloads.append([])
            continue
        (address, nbytes), rest = parts[0], parts[1:]
        payloads.append([(address + HEADER_BYTES, nbytes - HEADER_BYTES), *rest])
    return payloads


def _with_header_room(payload, room: int = HEADER_BYTES) -> list:
    """The inverse: the whole value's parts, the ``room`` bytes in front joined to the first
    payload part."""
    (address, nbytes), rest = payload[0], payload[1:]
    return [(address - room, nbytes + room), *rest]


def _mv(addr: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(addr)).cast("B")


# The payload hash: XXH3-64 (seed 0) of the parts' bytes in order.  The Rust core hashes with
# the GIL released and a batch of values on all cores; the `xxhash`
# package (same digest) is the fallback when the core is not built (benches from a checkout).
try:
    from .. import _core as _rcore

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
    #: ``put(..., header_room=True)`` / ``get(..., header_room=True)``: each value's first part
    #: starts with ``HEADER_BYTES`` of room where the store writes (reads) the value header, so
    #: header and payload move as one part fewer (a staging pool on CPU lays values out so).
    takes_header_room = False

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
        self.fingerprint = fingerprint  # every header's: the configuration's, then bound to a geometry
        self._config_fingerprint = fingerprint
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

    def unregister_buffer(self, ptr: int) -> None:
        """The buffer at ``ptr`` is going away: raw parts may no longer name it."""
        with self._note_lock:
            self._allowed = tuple(span for span in self._allowed if span[0] != int(ptr))

    def bind_geometry(self, geometry: bytes) -> None:
        """Bind every value this client writes and reads from now on to ``geometry`` too (the
        worker's ``KVLayout.fingerprint()``: dtypes, shapes, memory order): a value written from
        KV tensors of another layout (HND and NHD, an fp8 and a bf16 cache of equal block
        bytes) is then a fingerprint mismatch, a miss that is left in the store for its
        readers. A client has one geometry: its process's worker's."""
        if _rcore is None:  # pragma: no cover - core not built
            raise RuntimeError("binding a geometry needs the kvstride core (kvstride._core)")
        both = {"config": self._config_fingerprint.hex(), "geometry": bytes(geometry).hex()}
        self.fingerprint = bytes.fromhex(_rcore.layout_fingerprint(both))

    def close(self) -> None:
        pass

    def take_corrupt(self) -> list:
        """Corrupted values reads found since the last call that someone else must forget (an
        index the store does not own); none here: a store removes what a get found corrupted."""
        return []

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

    def _prepare(self, op: str, keys: list, buffers, writable: bool, header_room: bool = False):
        """The buffers' payloads as regions (and what keeps them alive), a per-key INVALID or
        None, the dedup of the keys and each key's payload bytes; None, counted, when the whole
        call is refused. ``header_room``: each value's first part starts with the header's room
        (``takes_header_room``), left out of the payload regions."""
        try:
            regs, keep = _regions(buffers, writable, self._allowed)
        except (ValueError, TypeError) as e:
            self._note(op, Status.INVALID, len(keys), str(e))
            return None
        if header_room:
            regs = _payload_after_header_room(regs)
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
