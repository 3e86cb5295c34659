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

The parts
---------
This module holds :class:`Store`, its records and its reads (where a failed read is told apart from
proven damage). The rest is one concept a module, all logging as ``headscope.analysis.store``:

- :mod:`headscope.analysis.record_files`: the bytes of a record (``.npy`` files, the manifest,
  JSON metadata, content keys) and what proves them damaged;
- :mod:`headscope.analysis.store_index`: the SQLite index, its connections, check and rebuild;
- :mod:`headscope.analysis.record_writes`: writing one record atomically;
- :mod:`headscope.analysis.store_leftovers`: which crash leftovers are collected, and when.

Their public names are importable from here too, as the rest of headscope imports them.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import logging
import os
import shutil
import sqlite3
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from headscope.analysis.paths import home
from headscope.analysis.record_files import (
    DAMAGE,
    MAX_HEADER,
    READ_FLAGS,
    CorruptRecord,
    as_json,
    content_key,
    npy_bytes,
    parse_json_bytes,
    parse_npy,
    plain_array_name,
)
from headscope.analysis.record_writes import RecordWriter, StoreWriteError
from headscope.analysis.shared_records import SharedRecords
from headscope.analysis.store_index import StoreIndex, StoreUnavailable, refused_write, transaction
from headscope.analysis.store_leftovers import HOST as _HOST
from headscope.analysis.store_leftovers import ORPHAN_S, collect_leftovers

# what the rest of headscope imports from here, wherever it is defined
__all__ = ["_HOST", "CorruptRecord", "Record", "Store", "StoreReadError", "StoreUnavailable", "StoreWriteError",
           "UnreadableRow", "as_json", "content_key", "note_read", "npy_bytes", "parse_json_bytes", "parse_npy",
           "recording_reads"]

log = logging.getLogger(__name__)


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
        """One array, from bytes that passed their sha256. Nothing is memory-mapped (``mmap`` is
        the name callers pass): ``mmap=True`` gives the record's read-only array; ``mmap=False``
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
        with open(os.open(path, READ_FLAGS), "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise CorruptRecord(f"{path.name} is not a regular file")
            size = st.st_size
            if isinstance(nbytes, int) and not isinstance(nbytes, bool) and size > nbytes + MAX_HEADER:
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
        if e.errno in DAMAGE:
            raise CorruptRecord(f"{path.name} {DAMAGE[e.errno]}") from e
        raise
    if got != size:
        raise CorruptRecord(f"{path.name} shrank while it was read")
    if h.hexdigest() != sha256:
        raise CorruptRecord(f"{path.name} failed its checksum")
    return parse_npy(buf, path.name)


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




class Store(StoreIndex, RecordWriter):
    """The run and result store. Thread-safe; safe to share between processes (and across a fork).

    Its index is :class:`headscope.analysis.store_index.StoreIndex`'s, its writes
    :class:`headscope.analysis.record_writes.RecordWriter`'s; reading, listing and removing are here."""

    def __init__(self, root: Path | str | None = None, shared: SharedRecords | None | bool = True):
        """Open (or create) the store at ``root``: a corrupt index is rebuilt from the record folders
        and crash leftovers are collected (both logged).

        ``shared``: True (default) shares records through ``HEADSCOPE_REDIS_URL`` when it is set."""
        self.shared = SharedRecords.from_env() if shared is True else (shared or None)
        self.root = Path(root) if root is not None else home()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "records").mkdir(exist_ok=True)
        self._records = (self.root / "records").resolve()  # every record folder lies in here
        self._open_index_checked()
        self.collect_garbage()

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
            if not refused_write(e):
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
            if not plain_array_name(name) or not isinstance(i["sha256"], str) or not isinstance(i["shape"], list):
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
        with self._db() as db, transaction(db):
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
        hex digits (a key is a sha256: a longer "prefix" is no key's, and one long enough makes SQLite
        refuse the LIKE pattern)."""
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
        with self._db() as db, transaction(db):
            row = db.execute("SELECT folder FROM records WHERE key=?", (key,)).fetchone()
            db.execute("DELETE FROM records WHERE key=?", (key,))
            db.execute("DELETE FROM arrays WHERE key=?", (key,))
        if row:
            self._remove_folder(row[0])
        if self.shared is not None:
            self.shared.remove(key)
        return row is not None

    def collect_garbage(self, older_than_s: float = ORPHAN_S) -> int:
        """Remove crash leftovers (:func:`headscope.analysis.store_leftovers.collect_leftovers`); called
        whenever a store is opened. Returns how many were removed."""
        with self._db() as db:
            live = {r[0] for r in db.execute("SELECT folder FROM records")}
        try:
            entries = list(self._entries())  # never follows a link out of records/
        except OSError as e:  # collected next time; a store opens all the same
            log.warning("could not list %s to collect leftovers: %s", self.root / "records", e)
            return 0
        removed = collect_leftovers(self.root, entries, live, older_than_s)
        if removed:
            log.info("collected %d leftover record folders under %s", removed, self.root / "records")
        return removed
