"""The disk tier's index, on vLLM's scheduler: which key lives in which record of the workers'
files (:mod:`kvstride.arena.disk`), every record allocation and eviction, and the same rules
as the arena's :class:`kvstride.arena.index.SlotIndex` (a key is readable once every rank
wrote it; records read by a load in flight are pinned; eviction in
:class:`kvstride.capacity.PrefixOrder`). The readable keys persist in a SQLite database next
to the records (WAL journal, one transaction a step, committed on a thread of its own: vLLM's
scheduler never waits for the drive), so that a restarted engine hits what the last one
stored; the workers check every record's header and bytes when they read it, so a row whose
record was torn or overwritten is a miss, never wrong bytes.

What a restart may lose (misses only, never wrong bytes): after a SIGKILL, the rows of the
steps whose transaction had not committed yet (a step or a few: the records they name are
written, and are written over later); after a power loss, also the last transactions SQLite
had not synced (``synchronous=NORMAL``) and records the drive had not written (the file is not
synced either), whose rows then name torn or older bytes: their headers do not match, a miss.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import json
import logging
import os
import sqlite3
import threading
from typing import Dict, List, Sequence

from kvstride.arena.disk import open_private
from kvstride.arena.index import SlotIndex

__all__ = ["DiskIndex", "INDEX_FILE"]

log = logging.getLogger("kvstride.arena")

INDEX_FILE = "kvstride-index.sqlite3"
LOCK_FILE = "kvstride.lock"

#: The journal files SQLite keeps beside the index in WAL mode.
_SQLITE_SIDE_FILES = ("-wal", "-shm", "-journal")

#: Bumped when the records' layout or the index's schema changes: older indexes start empty.
FORMAT = 2  # 2: records bind their TP rank and rank count


class DiskIndex(SlotIndex):
    """A :class:`SlotIndex` over ``num_slots`` disk records whose readable keys persist in
    ``folder``. ``signature`` names what the records were written for (record size, count, TP
    ranks, the key namespace's fingerprint): an index written for another is started over."""

    def __init__(self, num_slots: int, folder: str, signature: dict) -> None:
        super().__init__(num_slots)
        self.path = os.path.join(folder, INDEX_FILE)
        # One engine per folder: a second one would reuse the first's records under its feet.
        self._lock_fd = open_private(os.path.join(folder, LOCK_FILE))
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise ValueError(f"disk_path={folder!r} is in use by another engine: give each engine a folder of its "
                             "own (kv_connector_extra_config['disk_path'])") from None
        # Commits run here, in step order: the scheduler's thread only hands them over.
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstride-disk-index")
        self._unwritten: Dict[str, tuple] = {}  # rows a failed commit left, for the next one
        self._unwritten_lock = threading.Lock()
        try:
            self._db = self._open_db()
            self._pending: Dict[str, tuple] = {}  # key -> its row to write, or () to delete
            self.restored = self._restore(json.dumps(dict(signature, format=FORMAT), sort_keys=True))
        except sqlite3.DatabaseError as err:  # not an index (a torn file, another program's): start over
            log.warning("kvstride: the disk tier's index %s is unreadable (%s); the tier starts empty", self.path, err)
            try:
                self._db.close()
            except (AttributeError, sqlite3.Error):
                pass
            for name in (self.path, *(self.path + suffix for suffix in _SQLITE_SIDE_FILES)):
                if os.path.lexists(name):
                    os.unlink(name)
            self._db = self._open_db()
            self._pending = {}
            self.restored = self._restore(json.dumps(dict(signature, format=FORMAT), sort_keys=True))
        except BaseException:
            self._writer.shutdown(wait=False)
            os.close(self._lock_fd)
            raise

    def _open_db(self) -> sqlite3.Connection:
        """The index, created 0600 by this process (SQLite follows links and gives its journal the
        index's mode): it and its journal files are checked to be this user's own first."""
        for suffix in _SQLITE_SIDE_FILES:  # SQLite creates them; one planted beforehand is refused
            side = self.path + suffix
            if os.path.lexists(side):
                os.close(open_private(side))
        os.close(open_private(self.path))
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL)")
        db.execute("CREATE TABLE IF NOT EXISTS records (key TEXT PRIMARY KEY, slot INTEGER NOT NULL, "
                   "stamp INTEGER NOT NULL, depth INTEGER NOT NULL, worth REAL NOT NULL)")
        return db

    def _restore(self, signature: str) -> int:
        """Load the readable keys the last engine left; how many."""
        row = self._db.execute("SELECT value FROM meta WHERE name = 'signature'").fetchone()
        if row is None or row[0] != signature:
            if row is not None:
                log.warning("kvstride: the disk tier in %s was written for another configuration; it starts empty",
                            os.path.dirname(self.path))
            with self._db:
                self._db.execute("BEGIN")
                self._db.execute("DELETE FROM records")
                self._db.execute("INSERT OR REPLACE INTO meta VALUES ('signature', ?)", (signature,))
            return 0
        used = set()
        newest = 0
        for key, slot, stamp, depth, worth in self._db.execute("SELECT key, slot, stamp, depth, worth FROM records"):
            if not 0 <= slot < self.num_slots or slot in used:
                continue
            used.add(slot)
            self._ready[key] = slot
            self._key_of[slot] = key
            self.order.rank(key, stamp, depth, worth)
            newest = max(newest, stamp)
        self._free = [s for s in range(self.num_slots - 1, -1, -1) if s not in used]
        self.order.stamps_after(newest)  # new writes rank after every restored one
        return len(self._ready)

    # SlotIndex's hooks: every readable key that comes or goes is a row to write or delete.
    def _readied(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._pending[key] = (key, self._ready[key], *self.order.standing(key))

    def _dropped(self, key: str) -> None:
        self._pending[key] = ()

    def flush(self) -> None:
        """Hand this step's changes to the index's writer, which commits them in one
        transaction (a failure is logged: the rows are written with a later step's, or lost,
        which costs hits, never bytes)."""
        if self._pending:
            pending, self._pending = self._pending, {}
            self._writer.submit(self._commit, pending)

    def _commit(self, pending: Dict[str, tuple]) -> None:
        """(The writer's thread) ``pending``, after what an earlier failed commit left."""
        with self._unwritten_lock:
            pending, self._unwritten = {**self._unwritten, **pending}, {}
        rows = [row for row in pending.values() if row]
        gone = [(key,) for key, row in pending.items() if not row]
        try:
            with self._db:
                self._db.execute("BEGIN")
                self._db.executemany("DELETE FROM records WHERE key = ?", gone)
                self._db.executemany("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?)", rows)
        except sqlite3.Error as err:
            log.warning("kvstride: the disk tier's index could not be written (%s); retried next step", err)
            with self._unwritten_lock:  # newer rows of the same keys, handed over meanwhile, win
                self._unwritten = {**pending, **self._unwritten}

    def wait_written(self) -> None:
        """Wait until every change handed over so far is committed (or failed)."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        if self._lock_fd < 0:
            return
        self.flush()
        self._writer.shutdown(wait=True)
        self._db.close()
        os.close(self._lock_fd)  # the lock goes with it (and with the process, however it ends)
        self._lock_fd = -1

    def rows(self) -> List[tuple]:
        """The persisted rows, once what was handed over is committed (tests)."""
        self.wait_written()
        return list(self._db.execute("SELECT key, slot FROM records ORDER BY slot"))
