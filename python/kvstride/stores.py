"""Block stores: one protocol, an embedded host-memory store and the real Mooncake store.

Protocol (both stores)::

    exists(keys) -> list[bool]                      one call, one round trip
    put(keys, buffers) -> list[Status]              idempotent: a present key is left as is
    get(keys, buffers) -> list[Status]              a key asked twice is fetched once and
                                                    written to every destination
    register_buffer(ptr, nbytes); close()

``buffers[i]`` is key i's payload as a list of parts: ``(address, nbytes)`` pairs (what
``StagedBatch.parts`` gives), contiguous CPU torch tensors, numpy arrays or writable buffers.
The value stored is a 64-byte header followed by the parts' bytes in order.

Verified reads (``verify=True``, the default): the header carries a format version, the
layout fingerprint, a digest of the key, the payload length and the XXH3-64 of the payload.
A value whose header or hash does not match is reported ``Status.CORRUPT`` and removed from
the store.  For ``get`` the bytes of a non-OK key in its destination buffers are undefined:
destinations must be staging buffers, and only OK keys may be scattered into KV blocks
(``Transfer.scatter(batch, ok=[s is Status.OK for s in statuses])``).

At run time nothing raises: every failure is a status, counted in ``store.counters`` and
logged once per (operation, status).  Construction errors (bad configuration, an unreachable
master) raise ``ValueError`` / ``RuntimeError``.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import enum
import importlib.util
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
import urllib.request
from typing import TYPE_CHECKING, Optional, Sequence

import numpy as np
import xxhash

__all__ = [
    "Status",
    "KVStore",
    "EmbeddedStore",
    "MooncakeStore",
    "MasterProcess",
    "start_master",
    "HEADER_BYTES",
    "FORMAT_VERSION",
]

if TYPE_CHECKING:
    from kvstride.mooncake_config import MooncakeClientConfig

log = logging.getLogger("kvstride.stores")

HEADER_BYTES = 64
FORMAT_VERSION = 1
_MAGIC = b"KVS\x01"
_HDR = struct.Struct("<4sHH8s16sQQ")  # magic, version, flags, fingerprint, key digest, len, xxh3
_FLAG_HASHED = 1
# Verification failures that mean the stored bytes themselves are bad (removed from the store so
# that the next put rewrites them); a length or fingerprint mismatch may be a value that is
# right for another reader and is left alone.
_BAD_CONTENT = frozenset({"short header", "short value", "bad magic/version", "key digest mismatch", "payload hash mismatch"})


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
    """(address, nbytes, keepalive) of one buffer part."""
    if isinstance(part, tuple) and len(part) == 2 and isinstance(part[0], int):
        return int(part[0]), int(part[1]), None
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


def _regions(buffers, writable: bool):
    out, keep = [], []
    for parts in buffers:
        if isinstance(parts, tuple) and len(parts) == 2 and isinstance(parts[0], int):
            parts = [parts]
        elif not isinstance(parts, (list, tuple)):
            parts = [parts]
        regs = []
        for p in parts:
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
    _xxh3_parts = _xxh3_batch = None


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
    """Copy the byte stream of parts ``src`` into parts ``dst`` (same total)."""
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

    def __init__(self, fingerprint: bytes = b"\0" * 8, verify: bool = True) -> None:
        if isinstance(fingerprint, str):
            fingerprint = bytes.fromhex(fingerprint) if len(fingerprint) == 16 else fingerprint.encode()
        fingerprint = bytes(fingerprint)[:8].ljust(8, b"\0")
        self.fingerprint = fingerprint
        self.verify = bool(verify)
        self.counters: collections.Counter = collections.Counter()
        self._logged: set = set()

    # -- to implement --
    def exists(self, keys: Sequence[str]) -> list:
        raise NotImplementedError

    def put(self, keys: Sequence[str], buffers) -> list:
        raise NotImplementedError

    def get(self, keys: Sequence[str], buffers) -> list:
        raise NotImplementedError

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- helpers --
    def _note(self, op: str, status: Status, count: int = 1, detail: str = "") -> None:
        self.counters[f"{op}.{status.value}"] += count
        if status is not Status.OK and (op, status) not in self._logged:
            self._logged.add((op, status))
            log.warning("kvstride %s %s: %s %s (logged once)", type(self).__name__, op, status.value, detail)

    def _make_header(self, key: str, parts, digest: Optional[int] = None) -> bytes:
        """``digest``: the payload hash when the caller computed it already (``_hash_many``)."""
        length = sum(n for _, n in parts)
        if self.verify:
            if digest is None:
                digest = _hash_parts(parts)
            return _HDR.pack(_MAGIC, FORMAT_VERSION, _FLAG_HASHED, self.fingerprint, _key_digest(key), length, digest).ljust(
                HEADER_BYTES, b"\0"
            )
        return _HDR.pack(_MAGIC, FORMAT_VERSION, 0, self.fingerprint, _key_digest(key), length, 0).ljust(HEADER_BYTES, b"\0")

    def _check(self, key: str, header, parts, payload_parts=None, payload_hash=None) -> str:
        """'' if the header (and, when verifying, the payload hash) matches, else why not.
        ``payload_hash``: the hash of the payload bytes when the caller computed it already
        (over exactly the bytes that would be hashed here)."""
        try:
            magic, ver, flags, fp, kd, length, digest = _HDR.unpack_from(header, 0)
        except struct.error:
            return "short header"
        if magic != _MAGIC or ver != FORMAT_VERSION:
            return "bad magic/version"
        if fp != self.fingerprint:
            return "layout fingerprint mismatch"
        if kd != _key_digest(key):
            return "key digest mismatch"
        if length != sum(n for _, n in parts):
            return f"payload length {length} != destination {sum(n for _, n in parts)}"
        if self.verify:
            if not flags & _FLAG_HASHED:
                return "value written without a hash"
            if payload_hash is None:
                payload_hash = _hash_parts(payload_parts or parts)
            if payload_hash != digest:
                return "payload hash mismatch"
        return ""

    def _prepare(self, op: str, keys: list, buffers, writable: bool):
        """The buffers as regions (and what keeps them alive), a per-key INVALID or None, and
        the dedup of the keys; None, counted, when the whole call is refused."""
        try:
            regs, keep = _regions(buffers, writable=writable)
        except (ValueError, TypeError) as e:
            self._note(op, Status.INVALID, len(keys), str(e))
            return None
        if len(regs) != len(keys):
            self._note(op, Status.INVALID, len(keys), "keys and buffers differ in length")
            return None
        first, uniq = self._dedup(keys)
        return regs, keep, self._validate(keys, regs, op), first, uniq

    @staticmethod
    def _dedup(keys):
        first: dict = {}
        uniq = []
        for i, k in enumerate(keys):
            if k not in first:
                first[k] = i
                uniq.append(i)
        return first, uniq

    def _validate(self, keys, regs, op: str):
        """Per key: Status.INVALID or None."""
        out = []
        for k, r in zip(keys, regs):
            if not isinstance(k, str) or not k or not r or sum(n for _, n in r) <= 0:
                out.append(Status.INVALID)
            else:
                out.append(None)
        return out


# ---- embedded store ---------------------------------------------------------------------


class EmbeddedStore(KVStore):
    """In-process host memory with a byte budget and LRU eviction.  Nothing to start."""

    def __init__(self, capacity_bytes: int = 1 << 30, *, fingerprint: bytes = b"\0" * 8, verify: bool = True) -> None:
        super().__init__(fingerprint, verify)
        if capacity_bytes <= 0:
            raise ValueError(f"EmbeddedStore capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity = int(capacity_bytes)
        self.used = 0
        self._data: "collections.OrderedDict[str, np.ndarray]" = collections.OrderedDict()
        self._lock = threading.Lock()
        self._closed = False

    def __len__(self) -> int:
        return len(self._data)

    def exists(self, keys):
        with self._lock:
            if self._closed:
                self._note("exists", Status.UNAVAILABLE, len(keys), "store closed")
                return [False] * len(keys)
            return [k in self._data for k in keys]

    def put(self, keys, buffers):
        keys = list(keys)
        prepared = self._prepare("put", keys, buffers, writable=False)
        if prepared is None:
            return [Status.INVALID] * len(keys)
        regs, _keep, out, first, uniq = prepared  # _keep: the buffers stay alive for the call
        for i in uniq:
            if out[i] is not None:
                continue
            k = keys[i]
            size = HEADER_BYTES + sum(n for _, n in regs[i])
            with self._lock:
                if self._closed:
                    out[i] = Status.UNAVAILABLE
                    continue
                if k in self._data:
                    self._data.move_to_end(k)
                    out[i] = Status.OK
                    continue
                if size > self.capacity:
                    out[i] = Status.FULL
                    continue
                while self.used + size > self.capacity and self._data:
                    _, old = self._data.popitem(last=False)
                    self.used -= old.nbytes
                    self.counters["evicted"] += 1
                self.used += size  # reserved; the value becomes visible only once complete
            value = np.empty(size, dtype=np.uint8)
            base = value.ctypes.data
            pos = base + HEADER_BYTES
            for a, n in regs[i]:
                ctypes.memmove(pos, a, n)
                pos += n
            value[:HEADER_BYTES] = np.frombuffer(self._make_header(k, [(base + HEADER_BYTES, size - HEADER_BYTES)]), np.uint8)
            with self._lock:
                if self._closed or k in self._data:
                    self.used -= size
                else:
                    self._data[k] = value
            out[i] = Status.OK
        for i, k in enumerate(keys):
            if out[i] is None:
                out[i] = out[first[k]]
        for s in out:
            self._note("put", s, 1, "")
        return out

    def get(self, keys, buffers):
        keys = list(keys)
        prepared = self._prepare("get", keys, buffers, writable=True)
        if prepared is None:
            return [Status.INVALID] * len(keys)
        regs, _keep, out, first, uniq = prepared  # _keep: the buffers stay alive for the call
        for i in uniq:
            if out[i] is not None:
                continue
            k = keys[i]
            with self._lock:
                value = None if self._closed else self._data.get(k)
                if value is not None:
                    self._data.move_to_end(k)
                closed = self._closed
            if value is None:
                out[i] = Status.UNAVAILABLE if closed else Status.MISSING
                continue
            base = value.ctypes.data
            src = [(base + HEADER_BYTES, value.nbytes - HEADER_BYTES)]
            why = "" if value.nbytes >= HEADER_BYTES else "short value"
            why = why or self._check(k, value[:HEADER_BYTES].tobytes(), regs[i], src)
            if why:
                self._note("get", Status.CORRUPT, 0, f"{k!r}: {why}")
                with self._lock:
                    if why in _BAD_CONTENT and self._data.get(k) is value:
                        del self._data[k]
                        self.used -= value.nbytes
                out[i] = Status.CORRUPT
                continue
            _copy_parts(src, regs[i])
            out[i] = Status.OK
        for i, k in enumerate(keys):
            if out[i] is None:
                out[i] = out[first[k]]
                if out[i] is Status.OK:
                    _copy_parts(regs[first[k]], regs[i])
        for s in out:
            self._note("get", s, 1, "")
        return out

    def remove(self, keys) -> None:
        with self._lock:
            for k in keys:
                v = self._data.pop(k, None)
                if v is not None:
                    self.used -= v.nbytes

    def keys(self) -> list:
        """A snapshot of the stored keys, least recently used first."""
        with self._lock:
            return list(self._data)

    def clear(self) -> None:
        """Drop every value (the store stays open), as a restarted store would be."""
        with self._lock:
            self._data.clear()
            self.used = 0

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._data.clear()
            self.used = 0


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
        raise RuntimeError(
            "the Mooncake store needs `pip install 'kvstride[mooncake]'` (mooncake-transfer-engine-non-cuda) "
            "and `apt-get install libibverbs1`"
        )
    return list(spec.submodule_search_locations)[0]


class MasterProcess:
    """A ``mooncake_master`` started by :func:`start_master`, stopped by PID."""

    def __init__(
        self, proc: subprocess.Popen, rpc_port: int, metrics_port: int, log_path: str, argv: list, host: str = "127.0.0.1"
    ) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.host = host
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port
        self.log_path = log_path
        self.argv = argv

    @property
    def address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (tests: a master that dies)."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait(10)

    def restart(self, timeout: float = 15.0) -> None:
        """Start again on the same ports (all keys are lost, clients reconnect by themselves)."""
        self.stop()
        log_f = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(self.argv, stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log_f.close()
        self.pid = self.proc.pid
        _wait_ready(self, timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _wait_ready(m: MasterProcess, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://{m.host}:{m.metrics_port}/health"
    while time.monotonic() < deadline:
        if m.proc.poll() is not None:
            raise RuntimeError(f"mooncake_master exited with {m.proc.returncode}; log: {m.log_path}")
        try:
            with urllib.request.urlopen(url, timeout=0.5) as r:
                body = r.read().decode(errors="replace")
            if '"service_ready":true' in body.replace(" ", "") and _port_open(m.host, m.rpc_port):
                return
        except OSError:
            pass
        time.sleep(0.02)
    m.stop()
    raise RuntimeError(f"mooncake_master not ready after {timeout:.0f} s; log: {m.log_path}")


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
    free one by default; the metrics port is always a free one), wait until healthy."""
    binary = os.path.join(_mooncake_dir(), "mooncake_master")
    if not os.path.exists(binary):
        binary = shutil.which("mooncake_master") or binary
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
    log_dir = log_dir or tempfile.mkdtemp(prefix="kvstride-mooncake-")
    log_path = os.path.join(log_dir, f"master-{rpc}.log")
    log_f = open(log_path, "ab")
    try:
        proc = subprocess.Popen(argv, stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True)
    except OSError as e:
        raise RuntimeError(f"cannot run {binary}: {e} (is libibverbs1 installed?)") from e
    finally:
        log_f.close()
    m = MasterProcess(proc, rpc, met, log_path, argv, host)
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
    """

    def __init__(
        self,
        master=None,
        *,
        segment_bytes: int = 256 << 20,
        local_buffer_bytes: int = 16 << 20,
        protocol: str = "tcp",
        local_hostname: str = "127.0.0.1",
        metadata_server: str = "P2PHANDSHAKE",
        rdma_devices: str = "",
        fingerprint: bytes = b"\0" * 8,
        verify: bool = True,
        setup_retries: int = 2,
        connect_timeout: float = 2.0,
        retry_after_s: float = 1.0,
    ) -> None:
        super().__init__(fingerprint, verify)
        self._owned_master: Optional[MasterProcess] = None
        if master is None:
            master = self._owned_master = start_master()
        if isinstance(master, MasterProcess):
            self.master_address = master.address
        else:
            self.master_address = str(master)
        host, _, port = self.master_address.rpartition(":")
        if not host or not port.isdigit():
            self._stop_owned()
            raise ValueError(f"Mooncake master address must be 'host:port', got {self.master_address!r}")
        self._host, self._port = host, int(port)
        if not _port_open(host, self._port, connect_timeout):
            self._stop_owned()
            raise RuntimeError(
                f"Mooncake master {self.master_address} is not reachable (TCP connect failed); "
                "start one (kvstride.stores.start_master()) or pass the right address"
            )
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            self._stop_owned()
            raise RuntimeError(
                f"cannot import mooncake.store ({e}); install `mooncake-transfer-engine-non-cuda` "
                "and the Debian package libibverbs1"
            ) from e
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(int(setup_retries)))
        if metadata_server != "P2PHANDSHAKE" and local_hostname.startswith("127."):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", local_hostname)
        client = MooncakeDistributedStore()
        rc = client.setup(
            local_hostname, metadata_server, int(segment_bytes), int(local_buffer_bytes), protocol, rdma_devices, self.master_address
        )
        if rc != 0:
            # A failed setup leaves an object we must not call again (close included).
            self._client = None
            self._stop_owned()
            raise RuntimeError(f"Mooncake setup against {self.master_address} failed with {rc}")
        self._client = client
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
        config: "MooncakeClientConfig",
        *,
        local_hostname: str = "127.0.0.1",
        fingerprint: bytes = b"\0" * 8,
        verify: bool = True,
    ) -> "MooncakeStore":
        """A client as ``config`` (:func:`kvstride.mooncake_config.resolve_client_config`) says;
        ``global_segment_size`` 0 makes a pure client whose objects live in a holder's segment
        (``kvstride store serve``) and outlive it.  ``local_hostname``: the address other
        clients reach this one at."""
        return cls(
            config.master_server_address,
            segment_bytes=config.global_segment_size,
            local_buffer_bytes=config.local_buffer_size,
            protocol=config.protocol,
            local_hostname=local_hostname,
            metadata_server=config.metadata_server,
            rdma_devices=config.device_name,
            fingerprint=fingerprint,
            verify=verify,
        )

    # -- guard: never a call after close(), fail fast while the master is down --

    def _enter(self, op: str, n: int):
        with self._cv:
            if self._closed or self._client is None:
                self._note(op, Status.UNAVAILABLE, 0, "store closed")
                return None
            self._inflight += 1
            client = self._client
        if self._down_until and time.monotonic() < self._down_until:
            self._leave()
            self._note(op, Status.UNAVAILABLE, 0, f"master {self.master_address} down")
            return None
        if self._down_until:
            if not _port_open(self._host, self._port, 0.2):
                self._down_until = time.monotonic() + self._retry_after
                self._leave()
                self._note(op, Status.UNAVAILABLE, 0, f"master {self.master_address} down")
                return None
        return client

    def _leave(self) -> None:
        with self._cv:
            self._inflight -= 1
            self._cv.notify_all()

    def _saw(self, codes) -> None:
        if any(c in _RPC_CODES for c in codes):
            self._down_until = time.monotonic() + self._retry_after
        elif self._down_until:
            self._down_until = 0.0

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

    def put(self, keys, buffers):
        keys = list(keys)
        prepared = self._prepare("put", keys, buffers, writable=False)
        if prepared is None:
            return [Status.INVALID] * len(keys)
        regs, _keep, out, first, uniq = prepared  # _keep: the buffers stay alive for the call
        todo = [i for i in uniq if out[i] is None]
        if todo:
            hdr = self._headers(len(todo))
            hbase = hdr.ctypes.data
            digests = _hash_many([regs[i] for i in todo]) if self.verify else [None] * len(todo)
            for j, i in enumerate(todo):
                hdr[j * HEADER_BYTES : (j + 1) * HEADER_BYTES] = np.frombuffer(self._make_header(keys[i], regs[i], digests[j]), np.uint8)
            ptrs = [[hbase + j * HEADER_BYTES] + [a for a, _ in regs[i]] for j, i in enumerate(todo)]
            sizes = [[HEADER_BYTES] + [n for _, n in regs[i]] for i in todo]
            codes = self._call("put", "batch_put_from_multi_buffers", [keys[i] for i in todo], ptrs, sizes)
            for i, rc in zip(todo, codes):
                out[i] = _status_of(rc, "put")
                if out[i] is not Status.OK:
                    self._note("put", out[i], 0, f"code {rc}")
        for i, k in enumerate(keys):
            if out[i] is None:
                out[i] = out[first[k]]
        for s in out:
            self._note("put", s, 1, "")
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

    def get(self, keys, buffers):
        keys = list(keys)
        prepared = self._prepare("get", keys, buffers, writable=True)
        if prepared is None:
            return [Status.INVALID] * len(keys)
        regs, _keep, out, first, uniq = prepared  # _keep: the buffers stay alive for the call
        todo = [i for i in uniq if out[i] is None]
        corrupt = []
        if todo:
            hdr = self._headers(len(todo))
            hbase = hdr.ctypes.data
            ptrs = [[hbase + j * HEADER_BYTES] + [a for a, _ in regs[i]] for j, i in enumerate(todo)]
            sizes = [[HEADER_BYTES] + [n for _, n in regs[i]] for i in todo]
            codes = self._call("get", "batch_get_into_multi_buffers", [keys[i] for i in todo], ptrs, sizes)
            hashes: dict = {}
            if self.verify:  # every full-sized value's payload, hashed in place in one call
                full = [j for j, (i, rc) in enumerate(zip(todo, codes)) if rc == HEADER_BYTES + sum(n for _, n in regs[i])]
                hashes = dict(zip(full, _hash_many([regs[todo[j]] for j in full])))
            for j, (i, rc) in enumerate(zip(todo, codes)):
                st = _status_of(rc, "get")
                why = ""
                if st is Status.OK:
                    want = HEADER_BYTES + sum(n for _, n in regs[i])
                    why = f"value is {rc} B, expected {want}" if rc != want else ""
                    why = why or self._check(
                        keys[i], hdr[j * HEADER_BYTES : (j + 1) * HEADER_BYTES].tobytes(), regs[i], payload_hash=hashes.get(j)
                    )
                    if why:
                        st = Status.CORRUPT
                        if why in _BAD_CONTENT:
                            corrupt.append(keys[i])
                elif st is Status.CORRUPT:
                    why = f"code {rc} (value larger than the destination)"
                elif rc == -800 and self._size_differs(keys[i], HEADER_BYTES + sum(n for _, n in regs[i])):
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
        for s in out:
            self._note("get", s, 1, "")
        return out

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
