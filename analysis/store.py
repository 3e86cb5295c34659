"""Content-keyed persistence of runs and analysis results under ``HEADSCOPE_HOME``.

Layout::

    index.sqlite            WAL-mode index: one row per record, one row per array with its sha256
    records/ab/<key>-<n>/   one folder per stored record version, one ``.npy`` per array and a
                            ``record.json`` manifest (key, kind, metadata, each array's sha256)

Guarantees
----------
- Writes are atomic: arrays go into a temporary folder which is renamed into place, and only then
  is the index row committed. A crash at any point leaves either the old record or the new one.
- The bytes served are the bytes verified: an array is read into memory and the sha256 of exactly
  what was read is checked before it is used (no memory map, so a file changed, truncated or
  deleted afterwards cannot change a served array or kill the process with SIGBUS). A record that
  is proven damaged (a checksum that fails; a file missing, truncated, of the wrong size or not a
  regular file; a header that is not ``.npy``; an index row that cannot be parsed) is logged,
  dropped and counts as missing (so callers recompute), never served.
- A read that fails for a reason that passes (too many open files, an I/O error, a busy resource)
  proves nothing about the record: it raises :class:`StoreReadError` ("could not read the stored
  run right now") and the record stays.
- Every folder an index row names is checked to lie inside ``records/`` (no absolute path, no
  ``..``, no symbolic link leading out) before it is read or removed: a tampered row drops itself,
  never anything outside the store.
- A corrupt index (``file is not a database``, truncated, emptied) is logged in one line, moved
  aside and rebuilt from the manifests in the record folders.
- Crash leftovers (temporary folders of a killed writer, folders no index row points to) are
  collected when a store is opened; a temporary folder whose writer is alive is never touched.
- Several processes may share one store: SQLite serialises index writes, each writer uses its own
  folder name, and readers only follow committed rows.
- Arrays are plain ``.npy`` read with ``allow_pickle=False``: no pickles anywhere.
- With ``HEADSCOPE_REDIS_URL`` set, records are also written to and read from Redis
  (:mod:`headscope.analysis.shared_records`), so processes with different ``HEADSCOPE_HOME``s share results.
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import shutil
import socket
import sqlite3
import stat
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from headscope.analysis.fork_gate import GATE
from headscope.analysis.paths import home
from headscope.analysis.shared_records import SharedRecords

log = logging.getLogger(__name__)

MANIFEST = "record.json"
#: ``PRAGMA user_version`` of an index whose every record folder has its manifest.
MANIFESTS_COMPLETE = 1
TMP_PREFIX = ".tmp-"
#: A temporary folder of a writer on another host (whose pid cannot be checked), or of a pid that
#: was reused, is collected only when nothing in it changed for this long.
STALE_TMP_S = 15 * 60
#: A record folder no index row points to (a crash between rename and commit) is collected after this.
ORPHAN_S = 3600
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]

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


def content_key(*parts: Any) -> str:
    """sha256 of a canonical JSON encoding of ``parts``: the same request gives the same key."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=_json_default)
    return hashlib.sha256(blob.encode()).hexdigest()


def as_json(obj: Any) -> Any:
    """``obj`` as the store keeps metadata: plain JSON values (numpy numbers and arrays, tuples and sets
    turned into numbers and lists)."""
    return json.loads(json.dumps(obj, default=_json_default))


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer | np.floating):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, tuple | set):
        return list(obj)
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")


@dataclass
class Record:
    """One stored record: its metadata and its arrays, read into memory and verified."""

    key: str
    kind: str
    meta: dict[str, Any]
    created: float
    folder: Path
    array_info: dict[str, dict[str, Any]]
    store: Any = field(default=None, repr=False, compare=False)
    _loaded: dict[str, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def array(self, name: str, mmap: bool = True) -> np.ndarray:
        """One array, from bytes that passed their sha256. Nothing is memory-mapped any more (the
        name stays for callers): ``mmap=True`` gives the record's read-only array; ``mmap=False``
        hands it over writable, without a copy (asked again, it is read and verified again).
        Raises ``CorruptRecord`` if the file is missing or fails its checksum, :class:`StoreReadError`
        if it could not be read right now (nothing is dropped for that).

        Another process may replace the record (same key, new folder) after this one was read and
        remove the old folder: a missing file is then read from the record now under the key."""
        arr = self._loaded.get(name)
        if arr is None:
            info = self.array_info[name]
            path = self.folder / f"{name}.npy"
            try:
                arr = _read_verified(path, info["sha256"], info.get("nbytes"))
            except OSError as e:
                log.warning("could not read %s of stored %s %s right now: %s; kept", name, self.kind,
                            self.key[:12], e)
                raise StoreReadError(self.kind, e) from e
            except CorruptRecord:
                if path.exists() or self.store is None:
                    raise
                fresh = self.store.get(self.key)
                if fresh is None or fresh.folder == self.folder or name not in fresh.array_info:
                    raise
                arr = fresh.array(name)
            self._loaded[name] = arr
        if mmap:
            return arr
        del self._loaded[name]
        arr.flags.writeable = True  # its own buffer, read for this record only
        return arr

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: self.array(name) for name in self.array_info}


class StoreUnavailable(OSError):
    """The index could not be opened for a reason that is not corruption (locked for too long, disk
    full, read-only): nothing is moved or rebuilt; the message says what to check."""


class StoreReadError(OSError):
    """A stored record could not be read for a reason that passes (too many open files, an I/O error,
    a busy resource): it proves no damage, so the record stays. The message says what happened and
    what to do, without the store's path: it reaches web pages (``headscope.app.errors.USER_ERRORS``) and the
    CLI's one-line errors."""

    def __init__(self, kind: str, error: OSError | str):
        reason = (error.strerror or str(error)) if isinstance(error, OSError) else str(error)
        what = "run" if kind in ("run", "stats_run") else "result"
        super().__init__(f"Could not read the stored {what} right now: {reason}. Nothing was removed; try again "
                         "in a moment (if this persists, check the disk and the open-file limit, `ulimit -n`).")
        self.errno = error.errno if isinstance(error, OSError) else None


class StoreWriteError(OSError):
    """A record could not be written (a full disk, a folder that cannot be written, an index locked for
    too long): nothing of it was stored. The message says what to check, without the store's path: it
    reaches web pages (``headscope.app.errors.USER_ERRORS``) and the CLI's one-line errors."""

    def __init__(self, reason: str):
        super().__init__(f"The result could not be stored ({reason}): nothing was stored. Check the disk's "
                         "free space and that headscope's store folder (HEADSCOPE_HOME) can be written.")


# SQLite's answers to a write (or a read) it refuses for a reason outside headscope (a lock held too
# long, a full disk, a read-only or unreadable file, no file descriptor left); any other
# OperationalError (no such table, bad SQL) is a bug
REFUSED_WRITES = ("SQLITE_BUSY", "SQLITE_LOCKED", "SQLITE_FULL", "SQLITE_READONLY", "SQLITE_IOERR",
                  "SQLITE_CANTOPEN", "SQLITE_PERM")


def _refused_write(e: sqlite3.OperationalError) -> bool:
    return (getattr(e, "sqlite_errorname", None) or "").startswith(REFUSED_WRITES)


def _is_corruption(e: sqlite3.DatabaseError) -> bool:
    """Only a damaged file is rebuilt: SQLite's CORRUPT/NOTADB codes, or our integrity check (no code).
    Locks, a full disk or a read-only folder are not corruption and never move a sound index aside."""
    name = getattr(e, "sqlite_errorname", None)
    return name is None or name.startswith(("SQLITE_CORRUPT", "SQLITE_NOTADB"))


class CorruptRecord(RuntimeError):
    """A stored record is proven damaged: an array failed its checksum, is missing, truncated, of the
    wrong size or not a regular file, or its index row cannot be parsed or names a folder outside
    the store. (A read that merely failed is an ``OSError``: :class:`StoreReadError`.)"""


#: ``errno``s that prove a file is not what the store wrote: gone, a folder on its path replaced by
#: a file, a symbolic link (opened with ``O_NOFOLLOW``), a socket in its place. Any other error of a
#: read (EMFILE, EIO, EAGAIN, EACCES, ENOMEM...) proves nothing about the record.
_DAMAGE = {errno.ENOENT: "is missing", errno.ENOTDIR: "is missing", errno.ELOOP: "is a symbolic link",
           errno.ENXIO: "is not a regular file"}
#: A ``.npy`` header (format 1.0) is at most 65,545 bytes: a file larger than its array plus that is damaged.
_MAX_HEADER = 65_545


def _read_verified(path: Path, sha256: str, nbytes: Any = None) -> np.ndarray:
    """The array in ``path``, parsed from the very bytes whose sha256 was checked (one read, no
    memory map: later changes to the file cannot reach the returned array).

    Raises ``CorruptRecord`` for proven damage; any other ``OSError`` of the read is raised as it is
    (it proves nothing: the caller reports it and keeps the record). ``nbytes``, the array's size
    as stored, bounds the file's: a file larger than it can hold is refused unread."""
    h = hashlib.sha256()
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):  # a device or pipe is never even opened
            raise CorruptRecord(f"{path.name} is not a regular file")
        # non-blocking open: a pipe put in a file's place meanwhile would otherwise wait for a writer forever
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NOCTTY", 0)
        with open(os.open(path, flags), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise CorruptRecord(f"{path.name} is not a regular file")
            size = st.st_size
            if isinstance(nbytes, int) and not isinstance(nbytes, bool) and size > nbytes + _MAX_HEADER:
                raise CorruptRecord(f"{path.name} is larger ({size} bytes) than its array ({nbytes} bytes)")
            buf = np.empty(size, dtype=np.uint8)  # not zero-filled, unlike a bytearray
            view = memoryview(buf)
            got = 0
            while got < size:  # hash each block while it is still in the CPU cache: one pass
                n = f.readinto(view[got:got + (1 << 22)])
                if not n:
                    break
                h.update(view[got:got + n])
                got += n
    except OSError as e:
        if e.errno in _DAMAGE:
            raise CorruptRecord(f"{path.name} {_DAMAGE[e.errno]}") from e
        raise
    if got != size:
        raise CorruptRecord(f"{path.name} shrank while it was read")
    if h.hexdigest() != sha256:
        raise CorruptRecord(f"{path.name} failed its checksum")
    return parse_npy(buf, path.name)


def parse_npy(buf: np.ndarray | bytes, name: str = "the array") -> np.ndarray:
    """The read-only array in ``buf``, the bytes of a ``.npy`` file (format 1.0 or 2.0), without a
    copy and never unpickling; ``CorruptRecord`` (naming ``name``) for anything else: another
    format, an object dtype, fewer bytes than the header promises."""
    buf = np.frombuffer(buf, dtype=np.uint8) if isinstance(buf, bytes | bytearray) else buf
    try:
        header = io.BytesIO(memoryview(buf)[:min(len(buf), 1 << 16)])
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}.get(np.lib.format.read_magic(header))
        if read_header is None:
            raise ValueError("unknown .npy version")
        shape, fortran, dtype = read_header(header, max_header_size=1 << 16)
        if dtype.hasobject:
            raise ValueError("object arrays are never loaded")
        count = int(np.prod(shape, dtype=np.int64))
        arr = np.frombuffer(buf, dtype=dtype, count=count, offset=header.tell())
    except (ValueError, EOFError, OverflowError) as e:
        raise CorruptRecord(f"{name} is not a plain .npy array: {e}") from e
    arr = arr.reshape(shape, order="F" if fortran else "C")
    arr.flags.writeable = False
    return arr


def npy_bytes(arr: np.ndarray) -> tuple[bytes, str]:
    """``arr`` as the bytes of a ``.npy`` file, as the store writes it, and their sha256."""
    buf = io.BytesIO()
    sha256 = _write_npy(buf, np.ascontiguousarray(arr))
    return buf.getvalue(), sha256


def _read_regular(path: Path) -> bytes:
    """The bytes of the regular file ``path`` (a manifest), never following a link nor waiting on
    a pipe. ``CorruptRecord`` when it is missing or not a regular file; any other ``OSError`` is
    raised as it is (it proves nothing about the record)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise CorruptRecord(f"{path.name} is not a regular file")
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NOCTTY", 0)
        with open(os.open(path, flags), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise CorruptRecord(f"{path.name} is not a regular file")
            return f.read()
    except OSError as e:
        if e.errno in _DAMAGE:
            raise CorruptRecord(f"{path.name} {_DAMAGE[e.errno]}") from e
        raise


def parse_json_bytes(text: Any) -> Any:
    """JSON from the store (an index field, a manifest); ``CorruptRecord`` for anything that is not
    JSON (bit rot, a field of the wrong type, nesting too deep for the parser)."""
    try:
        return json.loads(text)
    except (TypeError, ValueError, RecursionError) as e:
        raise CorruptRecord(f"not JSON: {type(e).__name__}") from None


def _plain_array_name(name: Any) -> bool:
    """The names the store gives array files: letters, digits, ``_`` and ``-`` (so a name is never a path)."""
    return isinstance(name, str) and bool(name) and name.replace("_", "").replace("-", "").isalnum() \
        and name.isascii()


def _checked_manifest(manifest: Any) -> dict[str, Any]:
    """A manifest as :meth:`Store._write` writes it; ``CorruptRecord`` for any other shape (a rebuild
    indexes only what it can serve)."""
    ok = isinstance(manifest, dict) and {"key", "kind", "meta", "created", "arrays"} <= manifest.keys() \
        and isinstance(manifest["key"], str) and isinstance(manifest["kind"], str) \
        and isinstance(manifest["meta"], dict) and isinstance(manifest["arrays"], dict) \
        and isinstance(manifest["created"], int | float) and not isinstance(manifest["created"], bool)
    ok = ok and all(
        _plain_array_name(n) and isinstance(i, dict) and isinstance(i.get("sha256"), str)
        and isinstance(i.get("shape"), list) and isinstance(i.get("dtype"), str)
        and isinstance(i.get("nbytes"), int) and not isinstance(i.get("nbytes"), bool)
        for n, i in manifest["arrays"].items())
    if not ok:
        raise CorruptRecord("not a record manifest")
    return manifest


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """One write transaction: committed when the block ends, rolled back if it raises."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
    except BaseException:
        with contextlib.suppress(sqlite3.Error):  # SQLite may have rolled back already
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


@dataclass(frozen=True)
class UnreadableRow:
    """An index row :meth:`Store.list` left out: its key, its kind, and why (one line)."""

    key: str
    kind: str
    reason: str


_reads: contextvars.ContextVar[list | None] = contextvars.ContextVar("headscope_store_reads", default=None)


@contextlib.contextmanager
def recording_reads() -> Iterator[list]:
    """What was read from the store in this thread while inside, in order, each key once: every
    :class:`Record` :meth:`Store.get` returns, and every object handed to :func:`note_read` (a run
    a cache kept from an earlier read). What a figure was drawn from, so an export can carry it
    (:func:`headscope.app.export.manifest`)."""
    reads: list = []
    token = _reads.set(reads)
    try:
        yield reads
    finally:
        _reads.reset(token)


def note_read(item: Any) -> Any:
    """Note ``item`` (a :class:`Record`, or an object with the ``key`` of the record it was read
    from) as read, when :func:`recording_reads` records; return it."""
    reads = _reads.get()
    if item is not None and reads is not None and all(r.key != item.key for r in reads):
        reads.append(item)
    return item




def _fresh_state_in_child() -> None:
    """SQLite connections must not cross a fork: a forked child (a background job) opens its own."""
    for store in list(_stores):
        store._local = threading.local()


_stores: weakref.WeakSet = weakref.WeakSet()
os.register_at_fork(after_in_child=_fresh_state_in_child)


class Store:
    """The run and result store. Thread-safe; safe to share between processes (and across a fork)."""

    BUSY_TIMEOUT_S = 30.0  # how long a write waits for another process's write before giving up

    def __init__(self, root: Path | str | None = None, shared: SharedRecords | None | bool = True):
        """Open (or create) the store at ``root``: a corrupt index is rebuilt from the record folders
        and crash leftovers are collected (both logged).

        ``shared``: True (default) shares records through ``HEADSCOPE_REDIS_URL`` when it is set."""
        self.shared = SharedRecords.from_env() if shared is True else (shared or None)
        self.root = Path(root) if root is not None else home()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "records").mkdir(exist_ok=True)
        self._records = (self.root / "records").resolve()  # every record folder lies in here
        self._local = threading.local()
        _stores.add(self)
        with self._exclusive():
            self._open_index()
        self.collect_garbage()

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
        """Write the manifest of every record stored before manifests existed (from its index rows,
        once per store), so a later rebuild of the index loses none of them."""
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
                manifest = _checked_manifest(parse_json_bytes(_read_regular(folder / MANIFEST)))
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

    # -- writing -------------------------------------------------------------------------------

    def put(self, key: str, kind: str, meta: dict[str, Any], arrays: dict[str, np.ndarray],
            share: bool = True) -> Record:
        """Store a record atomically, replacing any earlier record with the same key (and share it,
        when the store is shared). A write the disk or the index refuses raises
        :class:`StoreWriteError`, with nothing of the record left behind."""
        folder, meta_json, created, info = self._commit(key, kind, meta, arrays)
        # committed: nothing after this is a failed write
        if share and self.shared is not None:
            self.shared.publish(key, kind, meta_json, created, folder, info)
        return note_read(Record(key, kind, meta, created, folder, info, store=self))  # an export carries it

    def _commit(self, key: str, kind: str, meta: dict[str, Any], arrays: dict[str, np.ndarray]):
        """Write the record's files, then its index row; what a full disk, a folder that cannot be
        written or an index locked too long refuse is a :class:`StoreWriteError` (logged with its
        path); any other error (a bug, a schema from another version) is raised as it is."""
        try:
            return self._write(key, kind, meta, arrays)
        except StoreWriteError:
            raise
        except OSError as e:
            log.warning("could not store record %s: %s", key[:12], e)
            raise StoreWriteError(e.strerror or type(e).__name__) from e
        except sqlite3.OperationalError as e:
            if not _refused_write(e):
                raise
            log.warning("could not index record %s in %s: %s", key[:12], self.root, e)
            raise StoreWriteError(f"the store's index: {e}") from e

    def _write(self, key: str, kind: str, meta: dict[str, Any], arrays: dict[str, np.ndarray]):
        if not (_plain_array_name(key) and len(key) <= 128):  # a key names folders: never a path
            raise ValueError(f"a record key is up to 128 letters, digits, '_' and '-', got {str(key)[:40]!r}")
        folder = self.root / "records" / key[:2] / f"{key}-{uuid.uuid4().hex[:8]}"
        # the writer's pid and host in the name: leftovers of a dead writer are collected at once
        tmp = folder.with_name(f"{TMP_PREFIX}{os.getpid()}-{_HOST}-{folder.name}")
        tmp.mkdir(parents=True)
        info: dict[str, dict[str, Any]] = {}
        created = time.time()
        meta_json = json.dumps(meta, default=_json_default)
        try:
            for name, arr in arrays.items():
                if not name.replace("_", "").replace("-", "").isalnum():
                    raise ValueError(f"array name {name!r} must be alphanumeric")
                arr = np.ascontiguousarray(arr)
                if arr.dtype == object:
                    raise TypeError(f"array {name!r} has dtype object; only numeric arrays are stored")
                path = tmp / f"{name}.npy"
                with open(path, "wb") as f:
                    sha256 = _write_npy(f, arr)
                    f.flush()
                    os.fsync(f.fileno())
                info[name] = {
                    "sha256": sha256,
                    "shape": list(arr.shape),
                    "dtype": str(arr.dtype),
                    "nbytes": int(arr.nbytes),
                }
            # what a rebuild of the index needs, beside the arrays it describes
            manifest = {"key": key, "kind": kind, "meta": json.loads(meta_json), "created": created, "arrays": info}
            with open(tmp / MANIFEST, "w") as f:
                json.dump(manifest, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        old_folder = None
        rel = str(folder.relative_to(self.root))
        try:  # an index locked past the busy timeout, or a full disk: the folder written goes again
            with self._db() as db:
                db.execute("BEGIN IMMEDIATE")
                try:
                    row = db.execute("SELECT folder FROM records WHERE key=?", (key,)).fetchone()
                    old_folder = row[0] if row else None
                    self._insert(db, key, kind, rel, meta_json, created, info)
                    db.execute("COMMIT")
                except BaseException:
                    with contextlib.suppress(sqlite3.Error):  # SQLite may have rolled back already
                        db.execute("ROLLBACK")
                    raise
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        if old_folder and old_folder != rel:
            self._remove_folder(old_folder)
        return folder, meta_json, created, info

    # -- reading -------------------------------------------------------------------------------

    def get(self, key: str, verify: bool = True, _retry: int = 0) -> Record | None:
        """The record under ``key``, or ``None`` if absent or proven damaged (a damaged one is logged
        and dropped, then looked up in the shared store like an absent one). With ``verify``
        (default) every array is read into memory and checked here, so the record's arrays never
        touch the disk again. A shared store copies a record it lacks from Redis first.

        Raises
        ------
        StoreReadError
            A read failed for a reason that proves no damage (too many open files, an I/O error):
            the record stays, and the caller reports it.
        """
        if not isinstance(key, str):  # no record has such a key (an edited manifest may name one)
            return None
        with self._reading(""), self._db() as db:
            row = db.execute("SELECT kind, folder, meta, created FROM records WHERE key=?", (key,)).fetchone()
            arrays = [] if row is None else db.execute(
                "SELECT name, sha256, shape, dtype, nbytes FROM arrays WHERE key=?", (key,)).fetchall()
        if row is None:
            return note_read(self._fetch_shared(key))
        kind, folder, meta, created = row
        try:
            record = self._record(key, kind, folder, meta, created, arrays)
            if verify:
                for name, i in record.array_info.items():
                    record._loaded[name] = _read_verified(record.folder / f"{name}.npy", i["sha256"], i["nbytes"])
        except CorruptRecord as e:
            if _retry < 2 and self._folder_of(key) not in (None, folder):
                return self.get(key, verify, _retry=_retry + 1)  # replaced meanwhile: read the new one
            log.warning("stored %s %s: %s; dropped, it will be computed again", kind, key[:12], e)
            self._drop(key, folder)
            return note_read(self._fetch_shared(key))
        except OSError as e:
            log.warning("could not read stored %s %s right now: %s; kept", kind, key[:12], e)
            raise StoreReadError(kind if isinstance(kind, str) else "", e) from e
        return note_read(record)

    @contextlib.contextmanager
    def _reading(self, kind: str) -> Iterator[None]:
        """An index read that SQLite refuses for a reason that passes (a lock held too long, an I/O
        error, no file descriptor left to open it) is a :class:`StoreReadError`, like a file's."""
        try:
            yield
        except sqlite3.OperationalError as e:
            if not _refused_write(e):
                raise
            log.warning("could not read the index of %s right now: %s", self.root, e)
            raise StoreReadError(kind, f"the store's index: {e}") from e

    def _fetch_shared(self, key: str) -> Record | None:
        """The shared copy of ``key`` (Redis), written into this store; None without one."""
        fetched = self.shared.fetch(key) if self.shared is not None else None
        if fetched is None:
            return None
        kind, meta, arrays = fetched
        return self.put(key, kind, meta, arrays, share=False)

    def _record(self, key: str, kind: Any, folder: Any, meta: Any, created: Any, arrays: list[tuple]) -> Record:
        """A :class:`Record` from its index rows (``arrays``: name, sha256, shape, dtype, nbytes).

        Raises ``CorruptRecord`` for rows the store never writes (bit rot or tampering that SQLite's
        quick check does not see): metadata that is not a JSON object, fields of the wrong type, an
        array name that is not a plain name, a folder outside ``records/`` (:meth:`_folder`)."""
        try:
            meta = parse_json_bytes(meta)
            info = {n: {"sha256": h, "shape": parse_json_bytes(sh), "dtype": d, "nbytes": nb}
                    for n, h, sh, d, nb in arrays}
        except CorruptRecord as e:
            raise CorruptRecord(f"its index row cannot be read ({e})") from None
        if not isinstance(meta, dict):
            raise CorruptRecord(f"its metadata in the index is not a JSON object ({type(meta).__name__})")
        if not isinstance(kind, str) or isinstance(created, bool) or not isinstance(created, int | float):
            raise CorruptRecord("its index row has fields of the wrong type")
        for name, i in info.items():
            if not _plain_array_name(name) or not isinstance(i["sha256"], str) or not isinstance(i["shape"], list):
                raise CorruptRecord(f"its index row names an array {str(name)[:40]!r} the store never writes")
        return Record(key, kind, meta, float(created), self._folder(folder), info, store=self)

    def _folder(self, rel: Any) -> Path:
        """The record folder an index row names (``records/ab/<key>-<n>``), checked to lie inside
        ``records/``: no absolute path, no ``..``, no symbolic link on the way (a folder, or its
        shard, linked elsewhere). ``CorruptRecord`` otherwise: the store never writes such a row,
        and nothing outside the store is ever read or removed because a row named it."""
        path = PurePosixPath(rel) if isinstance(rel, str) and "\x00" not in rel else None
        if path is None or path.is_absolute() or len(path.parts) != 3 or path.parts[0] != "records" \
                or any(part in (".", "..") for part in path.parts):
            raise CorruptRecord(f"its index row names a folder outside the store's records ({str(rel)[:80]!r})")
        folder = self.root / path
        try:
            inside = folder.resolve().parent.parent == self._records and not folder.is_symlink() \
                and not folder.parent.is_symlink()
        except RuntimeError:  # a loop of symbolic links
            inside = False
        if not inside:
            raise CorruptRecord("its index row names a folder that leads outside the store's records "
                                "(a symbolic link)")
        return folder

    def _remove_folder(self, rel: Any) -> None:
        """Remove the record folder an index row named, if it lies inside the store (:meth:`_folder`)."""
        try:
            folder = self._folder(rel)
        except (CorruptRecord, OSError) as e:
            log.warning("left %r alone: %s", str(rel)[:200], e)
            return
        shutil.rmtree(folder, ignore_errors=True)

    def _drop(self, key: str, folder: Any) -> None:
        """Drop a damaged record from this store: its index rows, if they still name ``folder`` (a
        writer may have replaced it meanwhile), and that folder if it lies inside the store. The
        shared copy (Redis) is not this disk's damage and stays."""
        with self._db() as db, _transaction(db):
            dropped = db.execute("DELETE FROM records WHERE key=? AND folder=?", (key, folder)).rowcount
            if dropped:
                db.execute("DELETE FROM arrays WHERE key=?", (key,))
        if dropped:
            self._remove_folder(folder)

    def _folder_of(self, key: str) -> str | None:
        with self._db() as db:
            row = db.execute("SELECT folder FROM records WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def list(self, kind: str | None = None, limit: int = 1000,
             skipped: list[UnreadableRow] | None = None) -> list[Record]:
        """Records newest first (metadata only; arrays are verified when read).

        A row that cannot be listed (:meth:`_record`: metadata that is not a JSON object, fields of
        the wrong type, a folder outside the store) is logged and left out, and appended to
        ``skipped`` when given; the others are listed. Listing changes nothing: such a row is
        dropped when it is read by key (:meth:`get`)."""
        q = "SELECT key, kind, folder, meta, created FROM records"
        args: tuple = ()
        if kind:
            q += " WHERE kind=?"
            args = (kind,)
        q += " ORDER BY created DESC LIMIT ?"
        with self._reading(""), self._db() as db:
            rows = db.execute(q, (*args, limit)).fetchall()
        records = []
        for k, kd, f, m, c in rows:
            try:
                record = self._record(k, kd, f, m, c, [])
            except (CorruptRecord, OSError) as e:
                log.warning("left stored record %s out of a listing: %s", str(k)[:16], e)
                if skipped is not None:
                    skipped.append(UnreadableRow(str(k), str(kd), str(e)))
                continue
            record.store = None  # metadata only, as listed
            records.append(record)
        return records

    def find(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix`` (for short ids typed by users); none for anything but 1 to 64
        hex digits (a key is a sha256; a longer "prefix" made SQLite refuse the LIKE pattern)."""
        if not isinstance(prefix, str) or not 0 < len(prefix) <= 64 \
                or not all(c in "0123456789abcdef" for c in prefix.lower()):
            return []
        with self._db() as db:
            rows = db.execute("SELECT key FROM records WHERE key LIKE ?", (prefix.lower() + "%",)).fetchall()
        keys = [r[0] for r in rows]
        if self.shared is not None:
            keys += [k for k in self.shared.find(prefix.lower()) if k not in keys]
        return keys

    def remove(self, key: str) -> bool:
        """Remove the record under ``key`` (its index rows, its folder if that lies inside the store,
        and its shared copy); False when there was none."""
        with self._db() as db, _transaction(db):
            row = db.execute("SELECT folder FROM records WHERE key=?", (key,)).fetchone()
            db.execute("DELETE FROM records WHERE key=?", (key,))
            db.execute("DELETE FROM arrays WHERE key=?", (key,))
        if row:
            self._remove_folder(row[0])
        if self.shared is not None:
            self.shared.remove(key)
        return row is not None

    def collect_garbage(self, older_than_s: float = ORPHAN_S) -> int:
        """Remove crash leftovers; called whenever a store is opened. Returns how many were removed.

        - a temporary folder of a writer on this host whose process is gone: at once;
        - a temporary folder of a live writer: never (another process may be writing it right now);
        - any other temporary folder (another host, an old name): when nothing in it changed for
          ``STALE_TMP_S`` (or ``older_than_s``, if smaller);
        - a committed folder no index row points to (a crash between rename and commit, or a
          replaced version not yet removed): when older than ``older_than_s``."""
        with self._db() as db:
            live = {r[0] for r in db.execute("SELECT folder FROM records")}
        removed = 0
        now = time.time()
        try:
            entries = list(self._entries())  # never follows a link out of records/
        except OSError as e:  # collected next time; a store opens all the same
            log.warning("could not list %s to collect leftovers: %s", self.root / "records", e)
            return 0
        for folder in entries:
            try:
                if folder.is_symlink() or not folder.is_dir():
                    # no writer makes anything but folders here: a stray file or link is a leftover
                    # (once old enough to be no one's half-made name), removed without being followed
                    stale = now - folder.lstat().st_mtime > min(STALE_TMP_S, older_than_s)
                elif folder.name.startswith(TMP_PREFIX):
                    writer = _tmp_writer(folder.name)
                    if writer is not None and writer[1] == _HOST:
                        stale = not _pid_alive(writer[0])
                    else:
                        stale = now - _last_change(folder) > min(STALE_TMP_S, older_than_s)
                else:
                    rel = str(folder.relative_to(self.root))
                    stale = rel not in live and now - folder.stat().st_mtime > older_than_s
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            except OSError as e:  # one unreadable entry must not keep the store from opening
                log.warning("left %s alone while collecting leftovers: %s", folder, e)
                continue
            if stale:
                if folder.is_symlink() or not folder.is_dir():
                    with contextlib.suppress(OSError):
                        folder.unlink()
                else:
                    shutil.rmtree(folder, ignore_errors=True)
                removed += 1
        if removed:
            log.info("collected %d leftover record folders under %s", removed, self.root / "records")
        return removed


def _tmp_writer(name: str) -> tuple[int, str] | None:
    """(pid, host tag) from a temporary folder's name, or None for a name without them."""
    parts = name[len(TMP_PREFIX):].split("-", 2)
    if len(parts) == 3 and parts[0].isdigit() and len(parts[1]) == 8:
        return int(parts[0]), parts[1]
    return None


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    if not 0 < pid < 2**22:  # no process has it (pid_max is at most 2**22); kill(0) would signal our group
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def _last_change(folder: Path) -> float:
    """Latest mtime of a folder and the files in it (a writer's file grows while it writes)."""
    times = [folder.stat().st_mtime]
    for f in folder.iterdir():
        with contextlib.suppress(FileNotFoundError):
            times.append(f.stat().st_mtime)
    return max(times)


def _write_npy(f, arr: np.ndarray) -> str:
    """Write C-contiguous ``arr`` to ``f`` as a ``.npy`` file and return the sha256 of the bytes written,
    taken from memory as they are written: no reading back (0.12-0.3 s for a 512-token run's 127 MB of
    patterns on a 2-core machine, in the job before the page's grid appears, #16) and no copy of the
    data (``numpy.save`` to a wrapper copies it in 16 MiB blocks)."""
    header = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(arr))
    except ValueError as e:  # a header over 64 KiB (thousands of named fields), or field names outside
        # latin-1: formats 2.0 and 3.0, which a reader here never takes
        raise ValueError(f"this array's .npy header needs a format other than 1.0 ({e}); it cannot be stored") from e
    sha256 = hashlib.sha256(header.getvalue())
    f.write(header.getvalue())
    data = memoryview(arr.reshape(-1).view(np.uint8))
    for start in range(0, len(data), 1 << 24):
        block = data[start:start + (1 << 24)]
        sha256.update(block)  # while the block is still in the CPU cache
        f.write(block)
    return sha256.hexdigest()
