"""Content-keyed persistence of runs and analysis results under ``HEADSCOPE_HOME``.

Layout::

    index.sqlite            WAL-mode index: one row per record, one row per array with its sha256
    records/ab/<key>-<n>/   one folder per stored record version, one ``.npy`` per array

Guarantees
----------
- Writes are atomic: arrays go into a temporary folder which is renamed into place, and only then
  is the index row committed. A crash at any point leaves either the old record or the new one.
- Every array file is checked against its sha256 before it is served; a truncated or corrupted file
  makes the record count as missing (so callers recompute), never served.
- Several processes may share one store: SQLite serialises index writes, each writer uses its own
  folder name, and readers only follow committed rows.
- Arrays are plain ``.npy`` read with ``allow_pickle=False``: no pickles anywhere.
- With ``HEADSCOPE_REDIS_URL`` set, records are also written to and read from Redis
  (:mod:`analysis.shared_records`), so processes with different ``HEADSCOPE_HOME``s share results.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sqlite3
import threading
import time
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from analysis.paths import home
from analysis.shared_records import SharedRecords

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
    """One stored record: its metadata and lazily loaded, verified arrays."""

    key: str
    kind: str
    meta: dict[str, Any]
    created: float
    folder: Path
    array_info: dict[str, dict[str, Any]]
    store: Any = field(default=None, repr=False, compare=False)

    def array(self, name: str, mmap: bool = True) -> np.ndarray:
        """Load one array (memory-mapped by default). Raises ``CorruptRecord`` if its checksum fails.

        Another process may replace the record (same key, new folder) after this one was read and
        remove the old folder: a missing file is then read from the record now under the key."""
        info = self.array_info[name]
        path = self.folder / f"{name}.npy"
        try:
            _verify(path, info["sha256"])
            return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        except (CorruptRecord, FileNotFoundError):
            if path.exists() or self.store is None:
                raise
            fresh = self.store.get(self.key)
            if fresh is None or fresh.folder == self.folder or name not in fresh.array_info:
                raise
            return fresh.array(name, mmap)

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: self.array(name) for name in self.array_info}


class CorruptRecord(RuntimeError):
    """A stored array failed its checksum or could not be read."""


_verified: dict[tuple[str, int, int], str] = {}
_verified_lock = threading.Lock()


def _verify(path: Path, sha256: str) -> None:
    try:
        st = path.stat()
    except OSError as e:
        raise CorruptRecord(f"{path.name} is missing") from e
    stamp = (str(path), st.st_size, st.st_mtime_ns)
    with _verified_lock:
        if _verified.get(stamp) == sha256:
            return
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    if h.hexdigest() != sha256:
        raise CorruptRecord(f"{path} failed its checksum")
    with _verified_lock:
        _verified[stamp] = sha256


_stores: weakref.WeakSet = weakref.WeakSet()


def _fresh_state_in_child() -> None:
    """SQLite connections must not cross a fork, and a lock held by another thread would stay
    held: a forked child (a background job) opens its own connections."""
    global _verified_lock
    _verified_lock = threading.Lock()
    for store in list(_stores):
        store._local = threading.local()


os.register_at_fork(after_in_child=_fresh_state_in_child)


class Store:
    """The run and result store. Thread-safe; safe to share between processes (and across a fork)."""

    def __init__(self, root: Path | str | None = None, shared: SharedRecords | None | bool = True):
        """``shared``: True (default) shares records through ``HEADSCOPE_REDIS_URL`` when it is set."""
        self.shared = SharedRecords.from_env() if shared is True else (shared or None)
        self.root = Path(root) if root is not None else home()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "records").mkdir(exist_ok=True)
        self._local = threading.local()
        _stores.add(self)
        with self._db() as db:
            db.executescript(SCHEMA)

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = sqlite3.connect(self.root / "index.sqlite", timeout=30, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA busy_timeout=30000")
            self._local.conn = conn
        yield conn

    # -- writing -------------------------------------------------------------------------------

    def put(self, key: str, kind: str, meta: dict[str, Any], arrays: dict[str, np.ndarray],
            share: bool = True) -> Record:
        """Store a record atomically, replacing any earlier record with the same key (and share it,
        when the store is shared)."""
        folder = self.root / "records" / key[:2] / f"{key}-{uuid.uuid4().hex[:8]}"
        tmp = folder.with_name(f".tmp-{folder.name}")
        tmp.mkdir(parents=True)
        info: dict[str, dict[str, Any]] = {}
        try:
            for name, arr in arrays.items():
                if not name.replace("_", "").replace("-", "").isalnum():
                    raise ValueError(f"array name {name!r} must be alphanumeric")
                arr = np.ascontiguousarray(arr)
                if arr.dtype == object:
                    raise TypeError(f"array {name!r} has dtype object; only numeric arrays are stored")
                path = tmp / f"{name}.npy"
                with open(path, "wb") as f:
                    np.save(f, arr, allow_pickle=False)
                    f.flush()
                    os.fsync(f.fileno())
                info[name] = {
                    "sha256": _sha256_path(path),
                    "shape": list(arr.shape),
                    "dtype": str(arr.dtype),
                    "nbytes": int(arr.nbytes),
                }
            os.replace(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        created = time.time()
        meta_json = json.dumps(meta, default=_json_default)
        old_folder = None
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                row = db.execute("SELECT folder FROM records WHERE key=?", (key,)).fetchone()
                old_folder = row[0] if row else None
                db.execute("DELETE FROM arrays WHERE key=?", (key,))
                db.execute(
                    "INSERT OR REPLACE INTO records(key, kind, folder, meta, created) VALUES (?,?,?,?,?)",
                    (key, kind, str(folder.relative_to(self.root)), meta_json, created),
                )
                db.executemany(
                    "INSERT INTO arrays(key, name, sha256, shape, dtype, nbytes) VALUES (?,?,?,?,?,?)",
                    [(key, n, i["sha256"], json.dumps(i["shape"]), i["dtype"], i["nbytes"]) for n, i in info.items()],
                )
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                shutil.rmtree(folder, ignore_errors=True)
                raise
        if old_folder and old_folder != str(folder.relative_to(self.root)):
            shutil.rmtree(self.root / old_folder, ignore_errors=True)
        if share and self.shared is not None:
            self.shared.publish(key, kind, meta_json, created, folder, info)
        return Record(key, kind, meta, created, folder, info, store=self)

    # -- reading -------------------------------------------------------------------------------

    def get(self, key: str, verify: bool = True, _retry: int = 0) -> Record | None:
        """The record under ``key``, or ``None`` if absent or corrupt (a corrupt one is removed).
        A shared store copies a record it lacks from Redis first."""
        with self._db() as db:
            row = db.execute("SELECT kind, folder, meta, created FROM records WHERE key=?", (key,)).fetchone()
            if row is None:
                fetched = self.shared.fetch(key) if self.shared is not None else None
                if fetched is None:
                    return None
                kind, meta, arrays = fetched
                return self.put(key, kind, meta, arrays, share=False)
            arrays = db.execute("SELECT name, sha256, shape, dtype, nbytes FROM arrays WHERE key=?", (key,)).fetchall()
        kind, folder, meta, created = row
        info = {
            n: {"sha256": s, "shape": json.loads(shape), "dtype": d, "nbytes": nb} for n, s, shape, d, nb in arrays
        }
        record = Record(key, kind, json.loads(meta), created, self.root / folder, info, store=self)
        if verify:
            try:
                for name, i in info.items():
                    _verify(record.folder / f"{name}.npy", i["sha256"])
            except CorruptRecord:
                if _retry < 2 and self._folder_of(key) not in (None, folder):
                    return self.get(key, verify, _retry=_retry + 1)  # replaced meanwhile: read the new one
                self.remove(key)
                return None
        return record

    def _folder_of(self, key: str) -> str | None:
        with self._db() as db:
            row = db.execute("SELECT folder FROM records WHERE key=?", (key,)).fetchone()
        return row[0] if row else None

    def list(self, kind: str | None = None, limit: int = 1000) -> list[Record]:
        """Records newest first (metadata only; arrays are verified when read)."""
        q = "SELECT key, kind, folder, meta, created FROM records"
        args: tuple = ()
        if kind:
            q += " WHERE kind=?"
            args = (kind,)
        q += " ORDER BY created DESC LIMIT ?"
        with self._db() as db:
            rows = db.execute(q, (*args, limit)).fetchall()
        return [Record(k, kd, json.loads(m), c, self.root / f, {}) for k, kd, f, m, c in rows]

    def find(self, prefix: str) -> list[str]:
        """Keys starting with ``prefix`` (for short ids typed by users)."""
        if not prefix or not all(c in "0123456789abcdef" for c in prefix.lower()):
            return []
        with self._db() as db:
            rows = db.execute("SELECT key FROM records WHERE key LIKE ?", (prefix.lower() + "%",)).fetchall()
        keys = [r[0] for r in rows]
        if self.shared is not None:
            keys += [k for k in self.shared.find(prefix.lower()) if k not in keys]
        return keys

    def remove(self, key: str) -> bool:
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT folder FROM records WHERE key=?", (key,)).fetchone()
            db.execute("DELETE FROM records WHERE key=?", (key,))
            db.execute("DELETE FROM arrays WHERE key=?", (key,))
            db.execute("COMMIT")
        if row:
            shutil.rmtree(self.root / row[0], ignore_errors=True)
        if self.shared is not None:
            self.shared.remove(key)
        return row is not None

    def collect_garbage(self, older_than_s: float = 3600) -> int:
        """Remove folders no index row points to (left by a crash between rename and commit)."""
        with self._db() as db:
            live = {r[0] for r in db.execute("SELECT folder FROM records")}
        removed = 0
        now = time.time()
        for folder in (self.root / "records").glob("*/*"):
            rel = str(folder.relative_to(self.root))
            if rel not in live and now - folder.stat().st_mtime > older_than_s:
                shutil.rmtree(folder, ignore_errors=True)
                removed += 1
        return removed


def _sha256_path(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()
