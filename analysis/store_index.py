"""The SQLite index of a store (``index.sqlite``): one row per record, one per array with its sha256.

The index is WAL-mode SQLite, one connection per thread, opened again in a forked child (SQLite
connections must not cross a fork). It is checked when a store opens: a corrupt index is moved
aside and rebuilt from the record folders' manifests (:data:`headscope.analysis.record_files.MANIFEST`);
an index SQLite refuses for another reason (a lock held too long, a full disk, a read-only folder)
raises :class:`StoreUnavailable` and is left as it is.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from headscope.analysis.fork_gate import GATE
from headscope.analysis.record_files import (
    MANIFEST,
    CorruptRecord,
    checked_manifest,
    parse_json_bytes,
    read_regular,
)
from headscope.analysis.store_leftovers import TMP_PREFIX

log = logging.getLogger("headscope.analysis.store")  # one logger for every part of the store

#: ``PRAGMA user_version`` of an index whose every record folder has its manifest.
MANIFESTS_COMPLETE = 1

SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    key TEXT PRIMARY KEY,
    kind TEXT NOT NULL,
    folder TEXT NOT NULL,
    meta TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS arrays (
    key TEXT NOT NULL,
    name TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    shape TEXT NOT NULL,
    dtype TEXT NOT NULL,
    nbytes INTEGER NOT NULL,
    PRIMARY KEY (key, name)
);
CREATE INDEX IF NOT EXISTS records_kind ON records(kind, created);
"""

# SQLite's answers to a write (or a read) it refuses for a reason outside headscope (a lock held too
# long, a full disk, a read-only or unreadable file, no file descriptor left); any other
# OperationalError (no such table, bad SQL) is a bug
REFUSED_WRITES = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_FULL", "SQLITE_READONLY", "SQLITE_IOERR",
                  "SQLITE_CANTOPEN", "SQLITE_PERM")


class StoreUnavailable(OSError):
    """The index could not be opened for a reason that is not corruption (locked for too long, disk
    full, read-only): nothing is moved or rebuilt; the message says what to check."""


def refused_write(e: sqlite3.OperationalError) -> bool:
    """Whether SQLite refused for a reason outside headscope (:data:`REFUSED_WRITES`), not a bug."""
    return (getattr(e, "sqlite_errorname", None) or "").startswith(REFUSED_WRITES)


def _is_corruption(e: sqlite3.DatabaseError) -> bool:
    """Only a damaged file is rebuilt: SQLite's CORRUPT/NOTADB codes, or our integrity check (no code).
    Locks, a full disk or a read-only folder are not corruption and never move a sound index aside."""
    name = getattr(e, "sqlite_errorname", None)
    return name is None or name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB"))


@contextlib.contextmanager
def transaction(db: sqlite3.Connection) -> Iterator[None]:
    """One write transaction: committed when the block ends, rolled back if it raises."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        with contextlib.suppress(sqlite3.Error):  # SQLite may have rolled back already
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def _fresh_state_in_child() -> None:
    """SQLite connections must not cross a fork: a forked child (a background job) opens its own."""
    for index in list(_indexes):
        index._local = threading.local()


_indexes: weakref.WeakSet = weakref.WeakSet()
os.register_at_fork(after_in_child=_fresh_state_in_child)


class StoreIndex:
    """The index half of :class:`headscope.analysis.store.Store`: its connections, its check when
    the store opens, and its rebuild from the record folders. The store provides ``root`` and
    ``_record`` (an index row parsed into a record, its folder checked to lie inside the store)."""

    BUSY_TIMEOUT_S = 30.0  # how long a write waits for another process's write before giving up
    root: Path

    def _open_index_checked(self) -> None:
        """Open the index for this process (and its forked children), checked or rebuilt under the
        root's lock."""
        self._local = threading.local()
        _indexes.add(self)
        with self._exclusive():
            self._open_index()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """Between processes sharing this root: one at a time checks, moves and rebuilds the index."""
        with open(self.root / "index.lock", "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _open_index(self) -> None:
        path = self.root / "index.sqlite"
        state = "was missing" if not path.exists() else "was empty" if path.stat().st_size == 0 else "had no records"
        try:
            with self._db() as db:
                check = db.execute("PRAGMA quick_check").fetchone()
                if not check or check[0] != "ok":
                    raise sqlite3.DatabaseError(f"integrity check: {check[0] if check else 'no answer'}")
                db.executescript(SCHEMA)
                empty = db.execute("SELECT 1 FROM records LIMIT 1").fetchone() is None
                if db.execute("PRAGMA user_version").fetchone()[0] < MANIFESTS_COMPLETE:
                    self._backfill_manifests(db)
                    db.execute(f"PRAGMA user_version={MANIFESTS_COMPLETE}")
        except sqlite3.DatabaseError as e:
            if not _is_corruption(e):
                self.close()
                raise StoreUnavailable(f"cannot open the store's index {path} ({e}): another process may hold "
                                       "it locked, or the disk is full or read-only; nothing was changed") from e
            self._rebuild_index(f"{path.name} is corrupt ({e})", move_aside=True)
            return
        try:
            found = empty and any(m is not None for _, m in self._manifests())
        except OSError as e:
            raise StoreUnavailable(f"cannot open the store's index {path} ({path.name} {state}): a record folder "
                                   f"could not be read right now ({e.strerror or e}); nothing was changed, try "
                                   "again") from e
        if found:
            self._rebuild_index(f"{path.name} {state}", move_aside=False)

    def _backfill_manifests(self, db: sqlite3.Connection) -> None:
        """Write the manifest of every record whose folder has none (an index of user_version 0, from
        before records carried manifests), once per store, so a later rebuild of the index loses
        none of them."""
        rows = db.execute("SELECT key, kind, folder, meta, created FROM records").fetchall()
        written = 0
        for key, kind, folder, meta, created in rows:
            arrays = db.execute("SELECT name, sha256, shape, dtype, nbytes FROM arrays WHERE key=?", (key,)).fetchall()
            try:  # a row that cannot be parsed or names a folder outside the store gets no manifest
                record = self._record(key, kind, folder, meta, created, arrays)
            except (CorruptRecord, OSError) as e:
                log.warning("stored record %s: %s; no manifest written", str(key)[:12], e)
                continue
            target = record.folder / MANIFEST
            if target.exists() or not target.parent.is_dir():
                continue
            manifest = {"key": key, "kind": kind, "meta": record.meta, "created": created, "arrays": record.array_info}
            tmp = target.with_name(f".{MANIFEST}.{os.getpid()}")
            tmp.write_text(json.dumps(manifest))
            os.replace(tmp, target)
            written += 1
        if written:
            log.info("wrote the manifests of %d records stored by an older version", written)

    def _record(self, key: str, kind: Any, folder: Any, meta: Any, created: Any, arrays: list[tuple]) -> Any:
        raise NotImplementedError  # the store's: an index row parsed and checked

    def close(self) -> None:
        """Close this thread's index connection (it is reopened when needed)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            with GATE.using():
                conn.close()
            self._local.conn = None

    def _entries(self) -> Iterator[Path]:
        """Every entry two levels under ``records/`` (``records/ab/<name>``), and every entry one level
        under it that is not a plain folder (a stray file, or a symbolic link: listed itself, never
        followed out of the store). A folder that cannot be listed raises its ``OSError``: a listing
        that silently left entries out (as ``glob`` does) would make a rebuild lose records."""
        for shard in sorted((self.root / "records").iterdir()):
            if shard.is_symlink() or not shard.is_dir():
                yield shard
                continue
            try:
                yield from sorted(shard.iterdir())
            except FileNotFoundError:  # removed by another process meanwhile
                continue

    def _manifests(self) -> Iterator[tuple[Path, dict[str, Any] | None]]:
        """(folder, its manifest, or None when the manifest is damaged: missing, not a regular file,
        not JSON, not the shape a writer gives it) for every committed record folder. A folder or a
        manifest that cannot be read right now raises its ``OSError``: a rebuild must not leave out
        a sound record (its folder would then be collected as a leftover)."""
        for folder in self._entries():
            if folder.parent.parent != self.root / "records" or folder.name.startswith(TMP_PREFIX) \
                    or folder.is_symlink() or not folder.is_dir():
                continue
            try:
                manifest = checked_manifest(parse_json_bytes(read_regular(folder / MANIFEST)))
            except CorruptRecord:
                manifest = None
            yield folder, manifest

    def _rebuild_index(self, reason: str, move_aside: bool) -> None:
        """Rebuild the index from the record folders' manifests: a corrupt one is moved aside first;
        an empty one is filled in place (a writer may be committing into it right now, and its row
        wins over the manifest's)."""
        self.close()
        index = self.root / "index.sqlite"
        newest: dict[str, tuple[Path, dict[str, Any]]] = {}
        unreadable = 0
        try:  # every manifest is read before anything is moved: a read that fails changes nothing
            for folder, manifest in self._manifests():
                if manifest is None:
                    unreadable += 1
                    continue
                if manifest["key"] not in newest or manifest["created"] > newest[manifest["key"]][1]["created"]:
                    newest[manifest["key"]] = (folder, manifest)
        except OSError as e:
            raise StoreUnavailable(f"cannot rebuild the store's index {index} ({reason}): a record folder could "
                                   f"not be read right now ({e.strerror or e}); nothing was changed, try again") from e
        aside = None
        if move_aside:
            aside = index.with_name(f"index.sqlite.corrupt-{int(time.time())}")
            for suffix in ("", "-wal", "-shm"):
                with contextlib.suppress(FileNotFoundError):
                    os.replace(index.with_name(index.name + suffix), aside.with_name(aside.name + suffix))
        with self._db() as db:
            db.executescript(SCHEMA)
            db.execute("BEGIN IMMEDIATE")
            for key, (folder, m) in newest.items():
                if db.execute("SELECT 1 FROM records WHERE key=?", (key,)).fetchone() is None:
                    rel = folder.relative_to(self.root)
                    self._insert(db, key, m["kind"], rel, json.dumps(m["meta"]), m["created"], m["arrays"])
            db.execute("COMMIT")
            db.execute(f"PRAGMA user_version={MANIFESTS_COMPLETE}")
        log.warning("%s%s; rebuilt %d records from the record folders%s", reason,
                    f": moved to {aside.name}" if aside else "", len(newest),
                    f" ({unreadable} folders without a readable manifest left out)" if unreadable else "")

    @staticmethod
    def _insert(db: sqlite3.Connection, key: str, kind: str, folder: Path | str, meta_json: str, created: float,
                info: dict[str, dict[str, Any]]) -> None:
        """The index rows of one record (replacing any under ``key``), inside the caller's transaction."""
        db.execute("DELETE FROM arrays WHERE key=?", (key,))
        db.execute(
            "INSERT OR REPLACE INTO records(key, kind, folder, meta, created) VALUES (?,?,?,?,?)",
            (key, kind, str(folder), meta_json, created),
        )
        db.executemany(
            "INSERT INTO arrays(key, name, sha256, shape, dtype, nbytes) VALUES (?,?,?,?,?,?)",
            [(key, n, i["sha256"], json.dumps(i["shape"]), i["dtype"], i["nbytes"]) for n, i in info.items()],
        )

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """This thread's index connection; no fork of this process happens while it is used
        (:mod:`headscope.analysis.fork_gate`: a child would inherit SQLite's locks with no owner)."""
        with GATE.using():
            yield self._connection()

    def _connection(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.root / "index.sqlite", timeout=self.BUSY_TIMEOUT_S, isolation_level=None)
            try:
                conn.execute(f"PRAGMA busy_timeout={int(self.BUSY_TIMEOUT_S * 1000)}")
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")
            except sqlite3.DatabaseError:
                conn.close()
                raise
            self._local.conn = conn
        return conn
