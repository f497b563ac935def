"""The Mooncake store client (:class:`MooncakeStore`): zero-copy batched puts and gets on
registered buffers, values in the format of :mod:`kvstride.stores.base`."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from typing import Optional

import numpy as np

from kvstride.mooncake_config import (
    DEFAULT_LOCAL_BUFFER_BYTES,
    DEFAULT_SEGMENT_BYTES,
    MOONCAKE_PIP,
    MooncakeClientConfig,
    MooncakeDependencyError,
    missing_library,
    resolve_local_hostname,
)
from kvstride.stores.base import (
    HEADER_BYTES,
    _BAD_CONTENT,
    _BAD_MAC,
    _HDR,
    _MAC_REJECTS,
    KVStore,
    Status,
    _copy_parts,
    _with_header_room,
)
from kvstride.stores.mooncake_master import MasterProcess, _port_open, start_master

__all__ = ["MooncakeStore"]

log = logging.getLogger("kvstride.stores")

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
    takes_header_room = True

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
        # Measured, not assumed: what Mooncake's client opened in this process.
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
        """Register a staging buffer with Mooncake; ``RuntimeError`` when it refuses (every
        transfer from that buffer would fail) or the master is down."""
        super().register_buffer(ptr, nbytes)
        c = self._enter("register", 0)
        if c is None:
            super().unregister_buffer(ptr)
            raise RuntimeError(f"Mooncake master {self.master_address} unavailable: the staging buffer is not registered")
        try:
            rc = c.register_buffer(int(ptr), int(nbytes))
        except Exception as err:
            rc = repr(err)
        finally:
            self._leave()
        if rc != 0:
            super().unregister_buffer(ptr)
            raise RuntimeError(f"Mooncake refused to register the {nbytes}-byte staging buffer ({rc})")
        self._registered.append(int(ptr))

    def unregister_buffer(self, ptr: int) -> None:
        """The staging buffer at ``ptr`` is freed: Mooncake and the raw-part checks forget it."""
        super().unregister_buffer(ptr)
        if int(ptr) not in self._registered:
            return
        self._registered.remove(int(ptr))
        if self._closed:  # the client and its registrations are gone already
            return
        c = self._enter("unregister", 0)
        if c is None:
            return
        try:
            c.unregister_buffer(int(ptr))
        except Exception as err:  # the buffer goes all the same: nothing may name it any more
            self._note("unregister", Status.ERROR, 1, repr(err))
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

    @staticmethod
    def _value_parts(payloads, header_room: bool):
        """Each value's Mooncake parts (header, then payload) and its header's address, and
        what keeps a header buffer alive: the caller's room in front of the first payload part
        (one part fewer per value), else a part of its own in a fresh buffer."""
        if header_room:
            values = [_with_header_room(payload) for payload in payloads]
            return values, [value[0][0] for value in values], None
        headers = np.zeros(max(len(payloads), 1) * HEADER_BYTES, dtype=np.uint8)
        heads = [headers.ctypes.data + j * HEADER_BYTES for j in range(len(payloads))]
        return [[(head, HEADER_BYTES), *payload] for head, payload in zip(heads, payloads)], heads, headers

    def put(self, keys, buffers, digests=None, header_room=False):
        """``digests``: each value's payload XXH3-64 when the caller computed it while copying
        the bytes (``Transfer.gather(batch, digests=True)``), so they are not read again here.
        ``header_room``: see ``KVStore.takes_header_room``."""
        keys = list(keys)
        # With header room the header is written into the caller's buffer.
        prepared = self._prepare("put", keys, buffers, writable=header_room, header_room=header_room)
        if prepared is None:
            return [Status.INVALID] * len(keys)
        regs, _keep, out, first, uniq, totals = prepared  # _keep: the buffers stay alive for the call
        todo = [i for i in uniq if out[i] is None]
        if todo:
            values, heads, _headers = self._value_parts([regs[i] for i in todo], header_room)  # alive for the call
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
            for j, (i, head) in enumerate(zip(todo, heads)):
                ctypes.memmove(head, self._make_header(keys[i], regs[i], digests[j], macs[j]), HEADER_BYTES)
            ptrs = [[a for a, _ in value] for value in values]
            sizes = [[n for _, n in value] for value in values]
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

    def get(self, keys, buffers, digests_out=None, header_room=False):
        """``digests_out``: a list as long as ``keys``; when given (and verifying), the payload
        hashes are not checked here: each OK key's entry is set to the digest its header
        carries, and the caller must check the bytes against it before they reach a KV block
        (``Transfer.scatter(batch, ok, expected=digests_out)`` does, hashing while it copies)
        and report the keys that failed with :meth:`corrupt`. ``header_room``: see
        ``KVStore.takes_header_room``."""
        keys = list(keys)
        prepared = self._prepare("get", keys, buffers, writable=True, header_room=header_room)
        if prepared is None:
            return [Status.INVALID] * len(keys)
        regs, _keep, out, first, uniq, totals = prepared  # _keep: the buffers stay alive for the call
        todo = [i for i in uniq if out[i] is None]
        corrupt = []
        defer = self.verify and digests_out is not None and len(digests_out) == len(keys)
        if todo:
            values, heads, _headers = self._value_parts([regs[i] for i in todo], header_room)  # alive for the call
            ptrs = [[a for a, _ in value] for value in values]
            sizes = [[n for _, n in value] for value in values]
            codes = self._call("get", "batch_get_into_multi_buffers", [keys[i] for i in todo], ptrs, sizes)
            hashes: dict = {}
            if self.verify and not defer:  # every full-sized value's payload, hashed in place in one call
                full = [j for j, (i, rc) in enumerate(zip(todo, codes)) if rc == HEADER_BYTES + totals[i]]
                hashes = dict(zip(full, self._payload_digests([regs[todo[j]] for j in full])))
            for j, (i, rc, head) in enumerate(zip(todo, codes, heads)):
                st = _status_of(rc, "get")
                why = ""
                if st is Status.OK:
                    want = HEADER_BYTES + totals[i]
                    why = f"value is {rc} B, expected {want}" if rc != want else ""
                    header = ctypes.string_at(head, HEADER_BYTES)
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
