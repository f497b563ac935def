"""The embedded store's disk tier, on each vLLM worker: one preallocated file of fixed-size
records per TP rank, written from and read into the rank's arena slots (the scheduler's
:class:`kvstride.arena.disk_index.DiskIndex` decides which record holds which key).

A record is one ``DISK_ALIGN`` block holding kvstride's 64-byte value header, then the slot's
bytes (its payload region, a multiple of ``DISK_ALIGN``) (:mod:`kvstride.stores.base`'s header:
the configuration's and the geometry's fingerprint with the model's identity in the key, the
key's digest, the length, the XXH3 digest or, with a deployment secret, the keyed payload tag
and the MAC). Both go out in one ``pwritev`` and come back in one ``preadv`` (the GIL released
in the system call), with ``O_DIRECT`` where the file system takes it (tmpfs and some
overlay file systems do not: then the page cache, said once in the log). A record is loaded
only when its header names the key asked for and its bytes match the header's digest: a torn
write, a record of another key, another configuration or another secret, or bytes changed on
disk is a miss (reported for the index to forget, and counted).
"""

from __future__ import annotations

import concurrent.futures
import errno
import glob
import logging
import os
import shutil
import stat
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from kvstride import _core
from kvstride.sizes import format_size
from kvstride.stores.base import HEADER_BYTES, KVStore

__all__ = ["DISK_ALIGN", "DiskSpec", "DiskRecords", "DiskLane", "record_bytes", "check_disk_folder",
           "existing_records_bytes", "open_private"]

log = logging.getLogger("kvstride.arena")

#: Direct I/O alignment of addresses, sizes and offsets (the largest logical block size in use).
DISK_ALIGN = 4096

#: Writes of one record's rest after a short write before it fails.
WRITE_TRIES = 4

#: Records in flight at once per lane (a queue deep enough for an NVMe drive).
IO_THREADS = 4

DATA_FILE = "kvstride-rank{rank}-of-{ranks}.records"
DATA_GLOB = "kvstride-rank*-of-*.records"


def _round_up(n: int, to: int) -> int:
    return -(-int(n) // to) * to


def record_bytes(slot_bytes: int) -> Tuple[int, int]:
    """(payload region, whole record) for slots of ``slot_bytes``."""
    payload = _round_up(slot_bytes, DISK_ALIGN)
    return payload, payload + DISK_ALIGN


def existing_records_bytes(path: str) -> int:
    """Bytes the disk tier's record files in ``path`` take already (0 when there are none)."""
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(os.path.expanduser(str(path)), DATA_GLOB)))


def check_disk_folder(path: str, disk_bytes: int, existing: int = 0) -> str:
    """The disk tier's folder, absolute; ``ValueError`` naming ``disk_path`` when it does not
    exist, is not a writable folder, is owned by another user or writable by others without the
    sticky bit (they could plant or replace its files), or its file system lacks ``disk_bytes``
    (less what the tier's files hold already, ``existing``)."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isdir(path):
        raise ValueError(f"disk_path={path!r} is not a folder: create it (mkdir -p {path}) or fix "
                         "kv_connector_extra_config['disk_path']")
    info = os.stat(path)
    if info.st_uid != os.geteuid():
        raise ValueError(f"disk_path={path!r} belongs to user {info.st_uid}, not to this engine's "
                         f"({os.geteuid()}): give the engine a folder of its own (mkdir -m 700)")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
        raise ValueError(f"disk_path={path!r} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}), who "
                         f"could plant files the tier opens: chmod go-w {path}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"disk_path={path!r} is not writable by this process: give it a folder it may write "
                         "(kv_connector_extra_config['disk_path'])")
    free = shutil.disk_usage(path).free
    if disk_bytes - existing > free:
        raise ValueError(f"disk_bytes={format_size(disk_bytes)} does not fit disk_path={path!r}: {format_size(free)} free "
                         f"(and {format_size(existing)} in its records already); give a smaller disk_bytes")
    return path


@dataclass(frozen=True)
class DiskSpec:
    """One rank's disk tier, as the configuration gives it (the same on every process)."""

    path: str  # the folder (check_disk_folder)
    num_records: int
    payload_bytes: int  # each record's payload region (record_bytes)
    rank: int
    ranks: int
    fingerprint: bytes  # the configuration's (with the model identity when shared)
    secret: Optional[bytes] = None

    @property
    def file(self) -> str:
        return os.path.join(self.path, DATA_FILE.format(rank=self.rank, ranks=self.ranks))

    @property
    def record_bytes(self) -> int:
        return self.payload_bytes + DISK_ALIGN


def open_private(path: str, flags: int = 0) -> int:
    """Open (creating it, mode 0600) a file of the tier's own: never through a symlink
    (``O_NOFOLLOW``), and only a regular file this process's user owns; ``ValueError`` naming
    the path otherwise. ``flags``: more ``os.open`` flags (``O_DIRECT``), whose ``OSError``
    is the caller's."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | flags, 0o600)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ValueError(f"disk_path: {path!r} is a symbolic link: the disk tier writes only files of its "
                             "own; remove it") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"disk_path: {path!r} is not a regular file: remove it")
        if info.st_uid != os.geteuid():
            raise ValueError(f"disk_path: {path!r} belongs to user {info.st_uid}, not to this engine's "
                             f"({os.geteuid()}): remove it, or give the engine a folder of its own")
        if stat.S_IMODE(info.st_mode) & 0o077:
            os.fchmod(fd, 0o600)  # ours, but readable by others (the keys are in the index)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _after(buffers: List[memoryview], skip: int) -> List[memoryview]:
    """``buffers`` without their first ``skip`` bytes."""
    out = []
    for buffer in buffers:
        if skip >= len(buffer):
            skip -= len(buffer)
            continue
        out.append(buffer[skip:])
        skip = 0
    return out


def _aligned(nbytes: int) -> np.ndarray:
    raw = np.empty(nbytes + DISK_ALIGN, dtype=np.uint8)
    start = (-raw.ctypes.data) % DISK_ALIGN
    return raw[start : start + nbytes]


class DiskRecords:
    """A rank's record file: ``write`` copies arena slots out to records, ``read`` records into
    arena slots (verified). ``arena``: the rank's :class:`kvstride.arena.HostArena`, allocated
    with ``DISK_ALIGN``-aligned slots."""

    def __init__(self, spec: DiskSpec, arena, geometry: bytes) -> None:
        if arena.slot_bytes % DISK_ALIGN or arena.ptr % DISK_ALIGN or arena.slot_bytes > spec.payload_bytes:
            raise ValueError(f"the arena's slots ({arena.slot_bytes} bytes at {arena.ptr:#x}) must be "
                             f"{DISK_ALIGN}-aligned and fit a record's {spec.payload_bytes}-byte payload")
        self.spec, self.arena = spec, arena
        # A record names the rank and the rank count it was written for: one read by another
        # rank (a file renamed or copied) is a miss, whatever its name says.
        rank_fingerprint = bytes.fromhex(_core.layout_fingerprint(
            {"records": spec.fingerprint.hex(), "rank": spec.rank, "ranks": spec.ranks}))
        self.headers = KVStore(rank_fingerprint, verify=True, secret=spec.secret)
        self.headers.bind_geometry(geometry)
        self._slots = arena.buffer.numpy()  # the arena's bytes, for the system calls' buffers
        self.direct = True
        self.fd = self._open(spec.file)
        self.counters = {"disk_bytes_written": 0, "disk_bytes_read": 0, "disk_write_errors": 0,
                         "disk_read_errors": 0, "disk_records_rejected": 0, "disk_short_writes": 0}
        self._lock = threading.Lock()
        self._closed = False

    def _open(self, path: str) -> int:
        size = self.spec.num_records * self.spec.record_bytes
        try:
            fd = open_private(path, os.O_DIRECT)
        except OSError as err:
            if err.errno != errno.EINVAL:
                raise ValueError(f"disk_path: cannot open {path!r}: {err.strerror}") from None
            fd = open_private(path)
            self.direct = False
            log.warning("kvstride: the file system of %s refuses O_DIRECT; the disk tier goes through the page "
                        "cache", os.path.dirname(path))
        try:
            if os.fstat(fd).st_size < size:
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as err:
                    if err.errno == errno.ENOSPC:
                        raise ValueError(f"disk_bytes: {format_size(size)} of records do not fit {os.path.dirname(path)!r} "
                                         "(no space left): give a smaller disk_bytes") from None
                    if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                        raise
                    os.ftruncate(fd, size)  # a file system without fallocate: a sparse file
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _offset(self, record: int) -> int:
        if not 0 <= record < self.spec.num_records:
            raise ValueError(f"record {record} out of range 0..{self.spec.num_records - 1}")
        return record * self.spec.record_bytes

    def _slot_view(self, slot: int) -> memoryview:
        size = self.arena.slot_bytes
        return memoryview(self._slots[slot * size : (slot + 1) * size])

    def _value_parts(self, slot: int, group: int) -> list:
        return [(self.arena.ptr + slot * self.arena.slot_bytes, int(self.arena.block_bytes[group]))]

    def write(self, slot: int, record: int, key: str) -> bool:
        """The value in arena ``slot`` (saved and digested) into ``record``, under ``key``."""
        group = int(self.arena.slot_group[slot])
        if group < 0:
            return False
        parts = self._value_parts(slot, group)
        digest = None if self.headers.mac_secret is not None else int(self.arena.digests[slot])
        header = _aligned(DISK_ALIGN)
        header[:] = 0
        header[:HEADER_BYTES] = np.frombuffer(self.headers._make_header(key, parts, digest), dtype=np.uint8)
        try:
            self._write_whole([memoryview(header), self._slot_view(slot)], self._offset(record))
        except OSError as err:
            self._count("disk_write_errors")
            log.warning("kvstride: a disk-tier write failed (%s); the value stays in memory only", err.strerror)
            return False
        self._count("disk_bytes_written", self.spec.record_bytes)
        return True

    def _write_whole(self, buffers: List[memoryview], offset: int) -> None:
        """``pwritev`` until every byte is written; a write that makes no progress, or stops off
        the direct-I/O alignment, is an ``OSError`` (counted ``disk_short_writes``)."""
        total = sum(len(b) for b in buffers)
        done = 0
        for _ in range(WRITE_TRIES):
            written = os.pwritev(self.fd, buffers, offset + done)
            done += written
            if done == total:
                return
            self._count("disk_short_writes")
            if written <= 0 or (self.direct and done % DISK_ALIGN):
                break
            buffers = _after(buffers, written)
        raise OSError(errno.EIO, f"short write: {done} of {total} bytes")

    def read(self, record: int, slot: int, key: str, group: int) -> bool:
        """``record`` into arena ``slot`` when it holds ``key``'s value of ``group`` intact;
        the slot then loads as a saved one."""
        header = _aligned(DISK_ALIGN)
        try:
            got = os.preadv(self.fd, [memoryview(header), self._slot_view(slot)], self._offset(record))
        except OSError as err:
            self._count("disk_read_errors")
            log.warning("kvstride: a disk-tier read failed (%s); the request recomputes", err.strerror)
            return False
        self._count("disk_bytes_read", got)
        if not 0 <= group < len(self.arena.block_bytes):
            return False
        parts = self._value_parts(slot, group)
        if got < DISK_ALIGN + self.arena.slot_bytes:
            return self._rejected(record, key, "short record")
        # The slot's digest is the payload's XXH3: without a secret, the very hash the header's
        # check needs (one pass over the bytes); with one, the check hashes a keyed tag.
        address, length = parts[0]
        digest = _core._xxh3_64_regions(np.array([address], dtype=np.uint64), np.array([length], dtype=np.uint64))[0]
        payload_hash = None if self.headers.mac_secret is not None else int(digest)
        why = self.headers._check(key, header[:HEADER_BYTES], parts, payload_hash=payload_hash)
        if why:
            return self._rejected(record, key, why)
        self.arena.digests[slot] = digest
        self.arena.lengths[slot] = length
        self.arena.slot_group[slot] = group
        return True

    def _rejected(self, record: int, key: str, why: str) -> bool:
        self._count("disk_records_rejected")
        log.debug("kvstride: disk record %d rejected for %s: %s", record, key, why)
        return False

    def take_counters(self) -> dict:
        """What was counted since the last call."""
        with self._lock:
            taken = {name: n for name, n in self.counters.items() if n}
            self.counters = dict.fromkeys(self.counters, 0)
        return taken

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        os.close(self.fd)


class DiskLane:
    """A worker's disk I/O off vLLM's step: write jobs and read jobs each on a lane of their
    own (a load from disk never waits behind the write-through, and a memory hit never waits
    behind either: those run on the engine's load lane), each job's records ``IO_THREADS`` at
    a time. Outcomes are taken by the step thread (:meth:`take`)."""

    def __init__(self, records: DiskRecords) -> None:
        self.records = records
        pool = concurrent.futures.ThreadPoolExecutor
        self._write_lane, self._read_lane = pool(1, thread_name_prefix="kvstride-disk-writes"), pool(
            1, thread_name_prefix="kvstride-disk-reads")
        self._write_io = pool(IO_THREADS, thread_name_prefix="kvstride-disk-write")
        self._read_io = pool(IO_THREADS, thread_name_prefix="kvstride-disk-read")
        self._lock = threading.Lock()
        self._written: dict = {}  # job id -> all of it written
        self._read: dict = {}  # req id -> (all of it read, records found bad)
        self._queued: set = set()  # write jobs not begun
        self._cancelled: set = set()  # of those, the ones the scheduler gave up
        self._dropped = 0  # write jobs dropped unwritten since the last take
        # Records read and the read lane's seconds, records written and the write lane's, since
        # the last take: the disk's paces, for the scheduler's read admission.
        self._paces = [0, 0.0, 0, 0.0]

    def write(self, job_id: int, entries: Sequence[Tuple[int, int, str]]) -> None:
        """Write ``(slot, record, key)`` entries (the scheduler keeps their slots until reported)."""
        def run() -> None:
            with self._lock:
                self._queued.discard(job_id)
                if job_id in self._cancelled:  # given up by the scheduler: its slots are another key's
                    self._cancelled.discard(job_id)
                    self._dropped += 1
                    return
            started = time.perf_counter()
            try:
                oks = list(self._write_io.map(lambda e: self.records.write(*e), entries))
            except Exception as err:  # never into vLLM's step: the job fails
                log.warning("kvstride: a disk-tier write job failed: %r", err)
                oks = [False]
            with self._lock:
                self._written[job_id] = all(oks)
                self._paces[2] += sum(oks)
                self._paces[3] += time.perf_counter() - started

        with self._lock:
            self._queued.add(job_id)
        self._write_lane.submit(run)

    def cancel(self, job_ids: Sequence[int]) -> None:
        """Write jobs the scheduler gave up: those not begun are dropped unwritten."""
        with self._lock:
            self._cancelled.update(j for j in map(int, job_ids) if j in self._queued)

    def read(self, req_id: str, entries: Sequence[Tuple[int, int, str, int]]) -> None:
        """Read ``(record, slot, key, group)`` entries into their slots."""
        def run() -> None:
            started = time.perf_counter()
            try:
                oks = list(self._read_io.map(lambda e: self.records.read(*e), entries))
            except Exception as err:
                log.warning("kvstride: a disk-tier read job failed: %r", err)
                oks = [False] * len(entries)
            bad = [int(e[0]) for e, ok in zip(entries, oks) if not ok]
            with self._lock:
                self._read[req_id] = (not bad, bad)
                self._paces[0] += len(entries) - len(bad)
                self._paces[1] += time.perf_counter() - started

        self._read_lane.submit(run)

    def take(self) -> Tuple[dict, dict, dict]:
        """(write job id -> ok, req id -> (ok, records found bad), counters) since the last call."""
        with self._lock:
            written, self._written = self._written, {}
            read, self._read = self._read, {}
            dropped, self._dropped = self._dropped, 0
        counted = self.records.take_counters()
        if dropped:
            counted["disk_writes_dropped"] = dropped
        return written, read, counted

    def take_paces(self) -> Tuple[int, float, int, float]:
        """(records read, seconds the read lane spent on its jobs, records written, seconds the
        write lane spent on its jobs) since the last call: the disk's paces, without the steps
        a job waits to be reported."""
        with self._lock:
            paces, self._paces = self._paces, [0, 0.0, 0, 0.0]
        return tuple(paces)

    def shutdown(self) -> None:
        """Finish what was submitted, then close the file."""
        for lane in (self._write_lane, self._read_lane, self._write_io, self._read_io):
            lane.shutdown(wait=True)
        self.records.close()
