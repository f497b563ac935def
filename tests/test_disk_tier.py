"""The embedded store's disk tier without vLLM: the workers' record files
(:mod:`kvstride.arena.disk`), the scheduler's persisted index (:mod:`kvstride.arena.disk_index`)
and the placement that joins them to the arena (``ArenaPlacement``): what is written can be read
back bit for bit, after a restart too, and a record that is torn, foreign or changed on disk is a
miss, never bytes in a KV block. (In a real engine: tests/test_vllm.py's disk tests.)"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from kvstride.arena import ArenaPlacement, ArenaSlots
from kvstride.arena.disk import DISK_ALIGN, DiskSpec, check_disk_folder, record_bytes
from kvstride.arena.disk_index import DiskIndex
from kvstride.layout import KVLayout
from kvstride.stores import Status
from kvstride.stores.placement import EVERY_RANK

NUM_BLOCKS = 16
FINGERPRINT = bytes(range(8))


def _kv():
    return {"attn": torch.randn(NUM_BLOCKS, 2, 16, 8, 64).to(torch.bfloat16)}


def _slots(folder, kv, num_slots=4, records=32, secret=None, fingerprint=FINGERPRINT):
    layout = KVLayout(kv, [["attn"]])
    payload, _ = record_bytes(layout.groups[0].block_bytes)
    spec = DiskSpec(str(folder), records, payload, rank=0, ranks=1, fingerprint=fingerprint, secret=secret)
    slots = ArenaSlots(num_slots, disk=spec)
    slots.bind_layout(layout)
    return slots


def _wait(lane):
    """The lane's outcomes once every job it was given ran."""
    for pool in (lane._write_lane, lane._read_lane):
        pool.submit(lambda: None).result()
    written, read, _ = lane.take()
    return written, read


def test_a_record_reads_back_into_another_slot_bit_for_bit(tmp_path):
    kv = _kv()
    slots = _slots(tmp_path, kv)
    try:
        want = kv["attn"][3].clone()
        slots.save_blocks([0], [0], [3])
        slots.disk.write(7, [(0, 5, "key-a")])
        assert _wait(slots.disk) == ({7: True}, {})
        kv["attn"][9].zero_()
        slots.disk.read("r", [(5, 2, "key-a", 0)])
        assert _wait(slots.disk) == ({}, {"r": (True, [])})
        read, read_seconds, written, write_seconds = slots.disk.take_paces()  # for the read admission
        assert read == 1 and read_seconds > 0 and written == 1 and write_seconds > 0
        assert slots.disk.take_paces() == (0, 0.0, 0, 0.0)
        assert slots.load_blocks([2], [0], [9]) == [Status.OK]
        assert torch.equal(kv["attn"][9], want)
    finally:
        slots.close()


def _record_then(tmp_path, damage, **reader):
    """Write one record, ``damage(path, spec)`` it, and read it with ``reader``'s settings."""
    kv = _kv()
    writer = _slots(tmp_path, kv)
    writer.save_blocks([0], [0], [1])
    writer.disk.write(1, [(0, 3, "key-a")])
    assert _wait(writer.disk)[0] == {1: True}
    spec = writer.disk_spec
    writer.close()
    damage(spec)
    reader_slots = _slots(tmp_path, kv, **reader)
    try:
        reader_slots.disk.read("r", [(3, 1, "key-a", 0)])
        for pool in (reader_slots.disk._write_lane, reader_slots.disk._read_lane):
            pool.submit(lambda: None).result()
        _, read, counters = reader_slots.disk.take()
        return read["r"], counters
    finally:
        reader_slots.close()


def _flip(offset_of):
    def damage(spec):
        with open(spec.file, "r+b") as f:
            f.seek(offset_of(spec))
            byte = f.read(1)
            f.seek(offset_of(spec))
            f.write(bytes([byte[0] ^ 0xFF]))
    return damage


@pytest.mark.parametrize("where", ["payload", "header"])
def test_a_changed_byte_on_disk_is_a_miss(tmp_path, where):
    at = {"payload": lambda spec: 3 * spec.record_bytes + DISK_ALIGN + 100,
          "header": lambda spec: 3 * spec.record_bytes + 20}[where]
    (ok, bad), counters = _record_then(tmp_path, _flip(at))
    assert (ok, bad) == (False, [3]) and counters == {"disk_records_rejected": 1, "disk_bytes_read": 36864}


def test_a_torn_write_is_a_miss(tmp_path):
    """The payload's second half never reached the disk (zeros where it was)."""
    def tear(spec):
        with open(spec.file, "r+b") as f:
            f.seek(3 * spec.record_bytes + DISK_ALIGN + spec.payload_bytes // 2)
            f.write(bytes(spec.payload_bytes // 2))
    (ok, bad), _ = _record_then(tmp_path, tear)
    assert (ok, bad) == (False, [3])


def test_a_record_of_another_configuration_or_secret_is_a_miss(tmp_path):
    (ok, _), _ = _record_then(tmp_path, lambda spec: None, fingerprint=bytes(8))
    assert not ok
    (ok, _), _ = _record_then(tmp_path, lambda spec: None, secret=b"s" * 32)
    assert not ok
    (ok, _), _ = _record_then(tmp_path, lambda spec: None)  # the control: untouched, same settings
    assert ok


def test_random_bytes_over_the_file_are_misses(tmp_path):
    def scramble(spec):
        with open(spec.file, "r+b") as f:
            f.write(np.random.default_rng(0).integers(0, 256, spec.num_records * spec.record_bytes, np.uint8).tobytes())
    (ok, bad), _ = _record_then(tmp_path, scramble)
    assert (ok, bad) == (False, [3])


def test_with_a_secret_a_record_written_without_it_is_a_miss(tmp_path):
    kv = _kv()
    writer = _slots(tmp_path, kv, secret=b"k" * 32)
    writer.save_blocks([0], [0], [1])
    writer.disk.write(1, [(0, 0, "key-a")])
    _wait(writer.disk)
    writer.close()
    for secret, readable in ((b"k" * 32, True), (None, False), (b"x" * 32, False)):
        reader = _slots(tmp_path, kv, secret=secret)
        try:
            reader.disk.read("r", [(0, 0, "key-a", 0)])
            assert _wait(reader.disk)[1]["r"][0] is readable, secret
        finally:
            reader.close()


def _index(folder, records=8, **signature):
    return DiskIndex(records, str(folder), dict({"record_bytes": 4096 * 3, "ranks": 1}, **signature))


def test_the_index_persists_what_every_rank_wrote_and_only_that(tmp_path):
    index = _index(tmp_path)
    index.reserve(["a", "b", "c"], {"a": (5, 0, 1.0), "b": (5, 1, 1.0), "c": (5, 2, 1.0)})
    index.confirm(["a", "b"])
    index.abandon(["c"])
    index.flush()
    index.close()
    again = _index(tmp_path)
    try:
        assert again.restored == 2 and again.exists(["a", "b", "c"]) == [True, True, False]
        assert again.slot("a") != again.slot("b")
        # New writes rank after the restored ones: the restored deepest block goes first.
        again.reserve(["d"])
        again.confirm(["d"])
        assert again.keys()[0] == "b"
    finally:
        again.close()
    other = _index(tmp_path, fingerprint="another")
    try:
        assert other.restored == 0 and other.exists(["a"]) == [False]
    finally:
        other.close()


def test_one_engine_per_disk_folder(tmp_path):
    index = _index(tmp_path)
    try:
        with pytest.raises(ValueError, match="in use by another engine"):
            _index(tmp_path)
    finally:
        index.close()
    _index(tmp_path).close()  # free again once the first closed


def test_the_placement_writes_through_and_loads_from_disk_what_memory_evicted(tmp_path):
    """Two arena slots, eight records: three keys saved one at a time; the first is evicted
    from memory but still hits, from disk: its load reads the record into a reserved slot,
    which then holds it in memory again."""
    placement = ArenaPlacement(2, _index(tmp_path), world_size=2)
    try:
        for n, key in enumerate(["a", "b", "c"]):
            placed, keys, refused = placement.place_saves([[(key, 0, n)]])
            assert keys == [key] and not refused
            placement.saves_done(keys, ok=True)
            ((job, entries),) = placement.take_disk_writes().items()
            assert [k for _, _, k in entries] == [key]
            placement.disk_written({job: [1, 0]})
            assert placement.disk.exists([key]) == [False]  # one rank of two so far
            placement.disk_written({job: [1, 0]})
            assert placement.disk.exists([key]) == [True]
        assert placement.index.exists(["a", "b", "c"]) == [False, True, True]
        assert placement.exists(["a", "b", "c"]) == [True, True, True]
        placed = placement.place_load("r", [[("a", 0, 7), ("b", 0, 8)]])
        ((record, slot, key, group),) = placement.disk_reads("r")
        assert (key, group) == ("a", 0) and record == placement.disk.slot("a")
        assert placed[EVERY_RANK] == [(slot, 0, 7), (placement.index.slot("b"), 0, 8)]
        placement.load_done("r", ok=True)
        assert placement.index.exists(["a"]) == [True] and placement.disk_reads("r") == []
        placement.flush()
        assert {key for key, _ in placement.disk.rows()} == {"a", "b", "c"}
    finally:
        placement.close()


def test_a_failed_disk_load_frees_its_slot_and_a_bad_record_is_forgotten(tmp_path):
    placement = ArenaPlacement(1, _index(tmp_path), world_size=1)
    try:
        for n, key in enumerate(["a", "b"]):
            placement.place_saves([[(key, 0, n)]])
            placement.saves_done([key], ok=True)
            (job,) = placement.take_disk_writes()
            placement.disk_written({job: [1, 0]})
        placement.place_load("r", [[("a", 0, 7)]])
        ((record, _, _, _),) = placement.disk_reads("r")
        placement.load_done("r", ok=False)
        placement.forget_disk_corrupt([record])
        assert placement.exists(["a", "b"]) == [False, True]
        assert placement.reset()  # nothing in flight: both tiers empty
        assert placement.exists(["b"]) == [False]
    finally:
        placement.close()


@pytest.mark.parametrize("ended_first", [False, True])
def test_a_load_failed_at_its_deadline_keeps_its_slot_until_every_late_read_ended(tmp_path, ended_first):
    """Two ranks' reads of a record pass the load's deadline: the load is reported failed,
    but its reserved slot (which the late reads still write) and pinned record are released
    only once both reads ended, whichever of the reports comes first."""
    placement = ArenaPlacement(2, _index(tmp_path), world_size=2)
    try:
        for n, key in enumerate(["a", "b", "c"]):
            placement.place_saves([[(key, 0, n)]])
            placement.saves_done([key], ok=True)
            (job,) = placement.take_disk_writes()
            placement.disk_written({job: [2, 0]})
        placement.place_load("r", [[("a", 0, 7)]])  # "a" is on disk only: a slot reserved for it
        placement.disk_reads_late({"r": [2, 0]})
        if ended_first:
            placement.disk_reads_late({"r": [0, 1]})
        placement.load_done("r", ok=False)
        placement.disk_reads_late({"r": [0, 0 if ended_first else 1]})
        assert not placement.reset(), "the slot a late read writes was released"
        placement.disk_reads_late({"r": [0, 1]})
        assert placement.disk_reads("r") == [] and placement.exists(["a"]) == [True]  # on disk still
        assert placement.reset()
    finally:
        placement.close()


def test_a_bad_disk_folder_is_refused_at_construction(tmp_path):
    import subprocess

    with pytest.raises(ValueError, match="is not a folder"):
        check_disk_folder(tmp_path / "missing", 1 << 20)
    with pytest.raises(ValueError, match="does not fit"):
        check_disk_folder(tmp_path, 1 << 62)
    ro = tmp_path / "ro"
    ro.mkdir()
    # Root writes anywhere but into an immutable folder; anyone else not into a 0500 one.
    root = os.geteuid() == 0
    if root and subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode != 0:
        pytest.skip("as root a read-only folder needs chattr +i, which this file system refuses")
    if not root:
        ro.chmod(0o500)
    try:
        with pytest.raises(ValueError, match="not writable"):
            check_disk_folder(ro, 1 << 20)
    finally:
        if root:
            subprocess.run(["chattr", "-i", str(ro)], check=True)
        else:
            ro.chmod(0o700)


def test_io_errors_at_run_time_are_counted_misses(tmp_path, monkeypatch):
    """A write the drive refuses leaves the value in memory only (the job fails, counted); a
    read it refuses fails the load (counted), which vLLM recomputes. Nothing raises."""
    import errno

    import kvstride.arena.disk as disk_module

    kv = _kv()
    slots = _slots(tmp_path, kv)
    try:
        slots.save_blocks([0], [0], [1])
        slots.disk.write(1, [(0, 0, "key-a")])
        assert _wait(slots.disk)[0] == {1: True}

        def refuse(*args):
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(disk_module.os, "pwritev", refuse)
        monkeypatch.setattr(disk_module.os, "preadv", refuse)
        slots.disk.write(2, [(0, 1, "key-b")])
        slots.disk.read("r", [(0, 1, "key-a", 0)])
        for pool in (slots.disk._write_lane, slots.disk._read_lane):
            pool.submit(lambda: None).result()
        written, read, counters = slots.disk.take()
        assert written == {2: False} and read == {"r": (False, [0])}
        assert counters["disk_write_errors"] == 1 and counters["disk_read_errors"] == 1
    finally:
        slots.close()


def test_a_vanished_folder_at_run_time_keeps_the_open_files(tmp_path):
    """The folder removed under a running engine: its open record file and index go on (the
    files are unlinked, not gone, until the engine ends); the next engine starts empty."""
    import shutil

    folder = tmp_path / "disk"
    folder.mkdir()
    kv = _kv()
    slots = _slots(folder, kv)
    index = _index(folder)
    try:
        shutil.rmtree(folder)
        slots.save_blocks([0], [0], [1])
        slots.disk.write(1, [(0, 0, "key-a")])
        assert _wait(slots.disk) == ({1: True}, {})
        slots.disk.read("r", [(0, 1, "key-a", 0)])
        assert _wait(slots.disk) == ({}, {"r": (True, [])})
        index.reserve(["key-a"])
        index.confirm(["key-a"])
        index.flush()
    finally:
        slots.close()
        index.close()
    with pytest.raises(ValueError, match="is not a folder"):
        check_disk_folder(folder, 1 << 20)


def test_the_embedded_store_reads_back_from_disk_and_never_a_changed_record(tmp_path):
    """EmbeddedStore with a disk tier (what ``kvstride simulate --disk-path`` runs): a block
    memory forgot loads from its record bit for bit; after a byte of the record changed, the
    same load is a miss and the destination block is left as it was."""
    from kvstride.stores import EmbeddedStore

    kv = _kv()
    layout = KVLayout(kv, [["attn"]])
    store = EmbeddedStore(1 << 20, fingerprint=FINGERPRINT, disk_path=str(tmp_path), disk_bytes=1 << 20)
    try:
        store.bind_layout(layout)
        want = kv["attn"][2].clone()
        assert store.save_blocks(["k"], [0], [2]) == [Status.OK]
        store.clear()  # memory forgets; the disk keeps it
        assert store.exists(["k"]) == [True]
        kv["attn"][5].zero_()
        assert store.load_blocks(["k"], [0], [5]) == [Status.OK]
        assert torch.equal(kv["attn"][5], want)
        store.clear()
        (path,) = [p for p in os.listdir(tmp_path) if p.endswith(".records")]
        with open(tmp_path / path, "r+b") as f:
            f.seek(DISK_ALIGN + 100)  # in the payload
            byte = f.read(1)
            f.seek(DISK_ALIGN + 100)
            f.write(bytes([byte[0] ^ 1]))
        kv["attn"][6].zero_()
        assert store.load_blocks(["k"], [0], [6]) == [Status.MISSING]
        assert not kv["attn"][6].any() and store.exists(["k"]) == [False]  # forgotten
        assert store.disk_counters()["disk_records_rejected"] == 1
    finally:
        store.close()


def test_the_embedded_store_admits_to_disk_as_the_connector_does(tmp_path):
    """EmbeddedStore's tier runs on the connector's ArenaPlacement: one save of more values than
    the disk may have in flight before its pace is known writes that many through, counts the
    rest ``disk_writes_skipped`` (kept in memory only), and what it wrote outlives memory."""
    from kvstride.arena.index import DISK_IN_FLIGHT_START
    from kvstride.stores import EmbeddedStore

    kv = _kv()
    count = DISK_IN_FLIGHT_START + 20
    store = EmbeddedStore(40 << 20, fingerprint=FINGERPRINT, disk_path=str(tmp_path), disk_bytes=40 << 20)
    try:
        store.bind_layout(KVLayout(kv, [["attn"]]))
        assert isinstance(store.placement, ArenaPlacement) and store.placement.disk is not None
        keys = [f"k{i}" for i in range(count)]
        assert store.save_blocks(keys, [0] * count, [i % NUM_BLOCKS for i in range(count)]) == [Status.OK] * count
        assert store.disk_counters()["disk_writes_skipped"] == count - DISK_IN_FLIGHT_START
        store.clear()
        assert store.exists(keys) == [True] * DISK_IN_FLIGHT_START + [False] * (count - DISK_IN_FLIGHT_START)
        kv["attn"][3].zero_()
        assert store.load_blocks([keys[5]], [0], [3]) == [Status.OK]
        assert torch.equal(kv["attn"][3], kv["attn"][5])
    finally:
        store.close()


def test_a_file_system_without_direct_io_goes_through_the_page_cache(tmp_path, monkeypatch):
    """Where ``open(O_DIRECT)`` is refused (EINVAL: tmpfs on older kernels, some overlay file
    systems), the records are written and read through the page cache, as reliably."""
    import errno

    import kvstride.arena.disk as disk_module

    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(disk_module.os, "open", no_direct)
    kv = _kv()
    slots = _slots(tmp_path, kv)
    try:
        assert slots.disk.records.direct is False
        want = kv["attn"][4].clone()
        slots.save_blocks([0], [0], [4])
        slots.disk.write(1, [(0, 2, "key-a")])
        assert _wait(slots.disk) == ({1: True}, {})
        slots.disk.read("r", [(2, 1, "key-a", 0)])
        assert _wait(slots.disk) == ({}, {"r": (True, [])})
        assert slots.load_blocks([1], [0], [8]) == [Status.OK] and torch.equal(kv["attn"][8], want)
    finally:
        slots.close()


# ---- a folder that is ours ------------------------------------------------------------------------


def _records(folder, records=2):
    """A rank's record file in ``folder`` over a small arena of its own."""
    from kvstride.arena.disk import DiskRecords
    from kvstride.arena.slots import HostArena

    arena = HostArena(None, 2, slot_bytes=DISK_ALIGN, align=DISK_ALIGN)
    payload, _ = record_bytes(arena.slot_bytes)
    spec = DiskSpec(str(folder), num_records=records, payload_bytes=payload, rank=0, ranks=1, fingerprint=b"\1" * 8)
    return DiskRecords(spec, arena, geometry=b"\2" * 8)


OTHER_USER = 65534  # nobody


@pytest.mark.parametrize("name", ["kvstride-rank0-of-1.records", "kvstride-index.sqlite3", "kvstride.lock",
                                  "kvstride-index.sqlite3-wal"])
def test_a_planted_symlink_is_refused_and_its_target_untouched(tmp_path, name):
    """A link planted under one of the tier's names (to a file the engine's user may write) is
    never followed: a ValueError names it, and the file it points to keeps its bytes."""
    victim = tmp_path / "victim.conf"
    victim.write_text("important=1\n")
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    os.symlink(victim, folder / name)
    with pytest.raises(ValueError, match="symbolic link") as refused:
        _records(folder).close() if name.endswith(".records") else _index(folder).close()
    assert name in str(refused.value)
    assert victim.read_text() == "important=1\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("name", ["kvstride-rank0-of-1.records", "kvstride-index.sqlite3"])
def test_a_file_another_user_created_is_refused(tmp_path, name):
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    (folder / name).write_bytes(b"")
    os.chown(folder / name, OTHER_USER, OTHER_USER)
    with pytest.raises(ValueError, match="belongs to user 65534"):
        _records(folder).close() if name.endswith(".records") else _index(folder).close()


def test_the_tiers_files_are_its_users_alone(tmp_path):
    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    (folder / "kvstride-index.sqlite3").touch(mode=0o644)  # left readable by an older version
    records, index = _records(folder), _index(folder)
    try:
        for name in os.listdir(folder):
            assert (os.stat(folder / name).st_mode & 0o777) == 0o600, name
    finally:
        records.close()
        index.close()


def test_a_folder_others_may_write_or_own_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ValueError, match="writable by other users"):
        check_disk_folder(shared, 1 << 20)
    shared.chmod(0o1777)  # sticky: others cannot replace or remove the tier's files
    assert check_disk_folder(shared, 1 << 20) == str(shared)
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, OTHER_USER, OTHER_USER)
        with pytest.raises(ValueError, match="belongs to user 65534"):
            check_disk_folder(theirs, 1 << 20)


def test_a_corrupt_index_starts_the_tier_over_with_one_log_line(tmp_path):
    import logging

    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    (folder / "kvstride-index.sqlite3").write_bytes(b"not a database, " * 512)
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("kvstride.arena")
    logger.addHandler(handler)
    try:
        index = _index(folder)
    finally:
        logger.removeHandler(handler)
    try:
        assert index.restored == 0 and index.rows() == []
        assert len([m for m in messages if "unreadable" in m]) == 1, messages
    finally:
        index.close()


# ---- writes checked, ranks named ------------------------------------------------------------------


def _write_one(records, fill: int = 7) -> None:
    records.arena.save_regions([0], [[(np.full(512, fill, dtype=np.uint8).ctypes.data, 512)]])
    records.arena.slot_group[0] = 0
    records.arena.block_bytes = np.array([512], dtype=np.uint64)


def test_a_short_write_is_written_on_and_one_that_stops_fails(tmp_path, monkeypatch):
    """A drive that writes part of a record (a signal, a full queue) gets the rest written from
    where it stopped; one that stops writing fails the write, counted: never a record confirmed
    that is not all on disk."""
    from kvstride.arena import disk

    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    records = _records(folder)
    _write_one(records)
    real = os.pwritev
    calls = []

    def short_once(fd, buffers, offset):
        calls.append(offset)
        if len(calls) == 1:  # only the header block
            return real(fd, [buffers[0][:DISK_ALIGN]], offset)
        return real(fd, buffers, offset)

    monkeypatch.setattr(disk.os, "pwritev", short_once)
    assert records.write(0, 1, "key") is True
    assert calls == [records._offset(1), records._offset(1) + DISK_ALIGN]
    monkeypatch.setattr(disk.os, "pwritev", real)
    assert records.read(1, 1, "key", 0) is True
    assert records.counters["disk_short_writes"] == 1
    monkeypatch.setattr(disk.os, "pwritev", lambda fd, buffers, offset: 0)
    assert records.write(0, 0, "key") is False
    assert records.counters["disk_write_errors"] == 1
    records.close()


def test_a_record_read_by_another_rank_is_a_miss(tmp_path):
    """Rank 0's record file read as rank 1's (renamed, copied): its records name rank 0 and are
    rejected, counted."""
    import shutil

    from kvstride.arena.disk import DiskRecords
    from kvstride.arena.slots import HostArena

    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    writer = _records(folder)
    _write_one(writer)
    assert writer.write(0, 0, "key")
    writer.close()
    shutil.copy(folder / "kvstride-rank0-of-1.records", folder / "kvstride-rank1-of-2.records")
    arena = HostArena(None, 2, slot_bytes=DISK_ALIGN, align=DISK_ALIGN)
    arena.block_bytes = np.array([512], dtype=np.uint64)
    payload, _ = record_bytes(arena.slot_bytes)
    for rank, ranks, readable in ((1, 2, False), (0, 1, True)):
        spec = DiskSpec(str(folder), num_records=2, payload_bytes=payload, rank=rank, ranks=ranks, fingerprint=b"\1" * 8)
        reader = DiskRecords(spec, arena, geometry=b"\2" * 8)
        try:
            assert reader.read(0, 1, "key", 0) is readable, (rank, ranks)
            assert reader.counters["disk_records_rejected"] == (0 if readable else 1)
        finally:
            reader.close()


# ---- admission the disk can keep ----------------------------------------------------------------


def test_a_disk_slower_than_the_saves_gets_what_it_can_write_and_nothing_grows(tmp_path):
    """Each step stores 8 new values (depths 0-7 of a prompt) and the disk writes 4 a step
    (the workers' lane modelled, in steps). Over 2,000 steps the write-through adapts to the
    disk's measured pace: what waits for the disk (the workers' queue, the arena slots held) stays
    bounded, the disk stays busy, no job is given up, the shallowest blocks are the ones written,
    and every value not written is counted."""
    import collections

    from kvstride.arena.index import DISK_BACKLOG_STEPS, ArenaPlacement

    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    place = ArenaPlacement(4096, disk=_index(folder, records=1 << 16), world_size=1)
    queue = collections.deque()  # the workers' write lane: (job id, entries) not yet written
    per_step, disk_per_step = 8, 4
    credit, written, largest_queue, largest_held, skipped = 0, [], 0, 0, 0
    try:
        for step in range(1, 2001):
            keys = [f"k{step}-{depth}" for depth in range(per_step)]
            ranks = {key: (step, depth, 1.0) for depth, key in enumerate(keys)}
            _, got, _ = place.place_saves([[(key, 0, 1) for key in keys]], ranks)
            place.saves_done(got, ok=True)
            queue.extend(place.take_disk_writes().items())
            cancelled = set(place.take_disk_cancelled())
            skipped += place.take_counts().get("disk_writes_skipped", 0)
            assert not cancelled
            credit += disk_per_step
            reports = {}
            while queue and credit >= len(queue[0][1]):
                job_id, entries = queue.popleft()
                credit -= len(entries)
                reports[job_id] = [1, 0]
                written.extend(key for _, _, key in entries)
            place.disk_written(reports)
            place.flush()
            if step > 100:
                largest_queue = max(largest_queue, sum(len(entries) for _, entries in queue))
                largest_held = max(largest_held, place._disk_in_flight)
        # Bounded by the disk's pace, about DISK_BACKLOG_STEPS steps of its writes.
        assert largest_held <= 2 * DISK_BACKLOG_STEPS * disk_per_step, largest_held
        assert largest_queue <= largest_held
        assert len(written) >= 0.9 * 2000 * disk_per_step  # the disk kept busy
        assert skipped == 2000 * per_step - len(written) - place._disk_in_flight
        depths = collections.Counter(int(key.rpartition("-")[2]) for key in written[len(written) // 2:])
        assert depths[0] >= depths[per_step - 1], depths  # the shallow blocks first
    finally:
        place.close()


def test_a_disk_that_starts_slow_is_measured_by_its_pace_not_by_its_first_steps(tmp_path):
    """Each step stores 2 values; the disk (one lane, reporting a step late) writes nothing for
    its first 8 steps (a file's first extents), then 4 a step, twice what comes. Nothing is
    skipped: steps before its first write ended do not count as a pace of 0."""
    import collections

    from kvstride.arena.index import ArenaPlacement

    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    place = ArenaPlacement(4096, disk=_index(folder, records=1 << 12), world_size=1)
    lane, credit, skipped, reported_next_step = collections.deque(), 0, 0, {}
    try:
        for step in range(1, 301):
            keys = [f"k{step}-{depth}" for depth in range(2)]
            ranks = {key: (step, depth, 1.0) for depth, key in enumerate(keys)}
            _, got, _ = place.place_saves([[(key, 0, 1) for key in keys]], ranks)
            place.saves_done(got, ok=True)
            lane.extend(place.take_disk_writes().items())
            skipped += place.take_counts().get("disk_writes_skipped", 0)
            place.disk_written(reported_next_step)
            reported_next_step = {}
            credit += 4 if step > 8 else 0
            while lane and credit >= len(lane[0][1]):
                job_id, entries = lane.popleft()
                credit -= len(entries)
                reported_next_step[job_id] = [1, 0]
        assert skipped == 0
    finally:
        place.close()


def test_a_write_job_the_scheduler_gave_up_is_never_written(tmp_path, monkeypatch):
    """A job still queued on the workers' lane when the scheduler gives it up (its slots may
    already hold other keys) is dropped unwritten; one already running finishes."""
    import threading

    from kvstride.arena.disk import DiskLane

    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    records = _records(folder, records=4)
    _write_one(records)
    gate, writes = threading.Event(), []
    real = records.write

    def slow_write(slot, record, key):
        gate.wait(30)
        writes.append(key)
        return real(slot, record, key)

    monkeypatch.setattr(records, "write", slow_write)
    lane = DiskLane(records)
    try:
        lane.write(1, [(0, 0, "running")])
        lane.write(2, [(0, 1, "given-up")])
        lane.cancel([2, 99])
        gate.set()
        written, dropped = {}, 0
        for _ in range(1000):
            done, _, counted = lane.take()
            written.update(done)
            dropped += counted.get("disk_writes_dropped", 0)
            if written and dropped:
                break
            threading.Event().wait(0.01)
        assert written == {1: True} and writes == ["running"] and dropped == 1
        assert lane._cancelled == set() and lane._queued == set()
    finally:
        lane.shutdown()


# ---- the index off the step -------------------------------------------------------------------------


class _GatedConnection:
    """An index connection whose transactions wait for ``gate`` and note their thread; the first
    ``fail`` of them raise as a locked database does."""

    def __init__(self, db, gate, fail: int = 0) -> None:
        import threading

        self.db, self.gate, self.fail, self.threads = db, gate, fail, []
        self._lock = threading.Lock()

    def __enter__(self):
        import sqlite3
        import threading

        self.threads.append(threading.current_thread())
        assert self.gate.wait(30)
        with self._lock:
            if self.fail:
                self.fail -= 1
                raise sqlite3.OperationalError("database is locked")
        return self.db.__enter__()

    def __exit__(self, *exc):
        return self.db.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self.db, name)


def test_the_index_commits_off_the_schedulers_thread_and_retries_what_failed(tmp_path):
    """A step's rows are handed to the index's own writer: the scheduler's thread never waits
    for the drive (the commit here waits for a gate the test opens only after ``flush``
    returned). A commit that fails (a locked database) is written with the next one."""
    import threading

    folder = tmp_path / "tier"
    folder.mkdir(mode=0o700)
    index = _index(folder)
    gate = threading.Event()
    gated = index._db = _GatedConnection(index._db, gate, fail=1)
    try:
        index.reserve(["a"], {"a": (1, 0, 1.0)})
        index.confirm(["a"])
        index.flush()  # returns with the gate closed: the commit is not on this thread
        gate.set()
        index.wait_written()
        assert index.rows() == []  # the first commit failed
        index.reserve(["b"], {"b": (2, 0, 1.0)})
        index.confirm(["b"])
        index.flush()
        assert sorted(key for key, _ in index.rows()) == ["a", "b"]
        assert gated.threads and threading.current_thread() not in gated.threads
    finally:
        index._db = gated.db
        index.close()
    reopened = _index(folder)
    try:
        assert reopened.restored == 2
    finally:
        reopened.close()


def test_disk_reads_are_measured_one_load_at_a_time_then_admitted_by_their_pace(tmp_path):
    """Before the workers reported a read, one load reads from disk at a time; the median of
    their reported paces then decides (4 records in 2 s of their read lanes: 0.5 s a record,
    admitted where computing takes at least a quarter of that; one stalled report does not move
    it), and after 5 quiet seconds (no write-through timed either) one load measures it again."""
    now = [100.0]
    placement = ArenaPlacement(8, _index(tmp_path), clock=lambda: now[0])
    try:
        for key in ("a", "b", "c", "d"):
            placement.place_saves([[(key, 0, 0)]])
            placement.saves_done([key], ok=True)
            placement.disk_written({job: [1, 0] for job in placement.take_disk_writes()})
        placement.index.drop_slots([placement.index.slot(key) for key in ("a", "b", "c", "d")])
        assert placement.read_admission.admits(4, compute_seconds=0.1)  # unmeasured, nothing in flight
        assert placement.place_load("first", [[(k, 0, n) for n, k in enumerate("abcd")]]) is not None
        assert not placement.read_admission.admits(1, compute_seconds=100.0)  # a second load waits for the pace
        placement.read_admission.timed(4, 2.0)
        placement.load_done("first", ok=True)
        assert placement.read_admission.admits(4, compute_seconds=0.5)
        assert not placement.read_admission.admits(4, compute_seconds=0.49)
        assert not placement.read_admission.admits(1, compute_seconds=0.01)
        placement.read_admission.timed(4, 2.0)
        placement.read_admission.timed(2, 30.0)  # a read that stalled
        assert placement.read_admission.admits(4, compute_seconds=0.5)
        now[0] += 5.0
        assert placement.read_admission.admits(4, compute_seconds=0.1)  # quiet 5 s: measured again
    finally:
        placement.close()


def test_a_load_that_measures_the_disk_must_pass_at_the_write_through_pace(tmp_path):
    """Reads not yet timed, or stale, are measured by one load at a time; that load is claimed
    only if it passes at the pace of the write-through on the same disk (0.25 s a record here:
    2 MiB/s for the Llama shape's records). Under ``vllm serve`` on a 2 MiB/s disk each such
    measure held a request 4-8 s before its first token, every 5 quiet seconds. Reads timed
    fast then decide; 5 quiet seconds later a new measure replaces them."""
    now = [100.0]
    placement = ArenaPlacement(8, _index(tmp_path), clock=lambda: now[0])
    admission = placement.read_admission
    try:
        for key in ("a", "b", "c", "d"):
            placement.place_saves([[(key, 0, 0)]])
            placement.saves_done([key], ok=True)
            placement.disk_written({job: [1, 0] for job in placement.take_disk_writes()})
        admission.timed(0, 0.0, 4, 1.0)  # the write lane: 4 records in 1 s
        assert not admission.admits(4, compute_seconds=0.2)  # 1 s of reads against 0.8 s
        assert admission.admits(4, compute_seconds=0.25)
        placement.index.drop_slots([placement.index.slot(key) for key in ("a", "b", "c", "d")])
        assert placement.place_load("first", [[(k, 0, n) for n, k in enumerate("abcd")]]) is not None
        assert not admission.admits(1, compute_seconds=100.0)  # one measure at a time
        admission.timed(4, 0.04)  # the reads were fast: 0.01 s a record
        placement.load_done("first", ok=True)
        assert admission.admits(4, compute_seconds=0.01) and admission.admits(40, compute_seconds=0.1)
        now[0] += 5.0  # stale: measured again, if the write-through's pace lets it
        assert not admission.admits(4, compute_seconds=0.01) and admission.admits(4, compute_seconds=0.25)
        placement.index.drop_slots([placement.index.slot(key) for key in ("a", "b", "c", "d")])
        assert placement.place_load("again", [[(k, 0, n) for n, k in enumerate("abcd")]]) is not None
        admission.timed(4, 0.4)  # 0.1 s a record now
        placement.load_done("again", ok=True)
        assert not admission.admits(4, compute_seconds=0.09)  # the new measure alone decides
        assert admission.admits(4, compute_seconds=0.1)
        assert admission.read_deadline(1000) is None  # vLLM's pace not known: load_timeout_s
        for _ in range(3):  # prompt steps of 1,000 tokens a second
            admission.prompt_step(100, 1)
            now[0] += 0.1
        assert admission.read_deadline(1000) == pytest.approx(4.0) and admission.read_deadline(10) == 2.0
    finally:
        placement.close()
