"""Writing one record atomically: its files into a temporary folder, renamed into place, then its
index row committed.

A crash at any point leaves either the old record or the new one: the temporary folder is a
leftover (:mod:`headscope.analysis.store_leftovers`) until the rename, and the renamed folder is
one until the commit. What the disk or the index refuses (a full disk, a folder that cannot be
written, an index locked too long) is a :class:`StoreWriteError`, with nothing of the record left
behind.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from headscope.analysis.record_files import MANIFEST, json_default, plain_array_name, write_npy
from headscope.analysis.store_index import refused_write
from headscope.analysis.store_leftovers import tmp_name

log = logging.getLogger("headscope.analysis.store")  # one logger for every part of the store


class StoreWriteError(OSError):
    """A record could not be written (a full disk, a folder that cannot be written, an index locked for
    too long): nothing of it was stored. The message says what to check, without the store's path: it
    reaches web pages (``headscope.app.errors.USER_ERRORS``) and the CLI's one-line errors."""

    def __init__(self, reason: str):
        super().__init__(f"The result could not be stored ({reason}): nothing was stored. Check the disk's "
                         "free space and that headscope's store folder (HEADSCOPE_HOME) can be written.")


class RecordWriter:
    """The writing half of :class:`headscope.analysis.store.Store`, which provides ``root``, ``_db``,
    ``_insert`` (:class:`headscope.analysis.store_index.StoreIndex`) and ``_remove_folder``."""

    root: Path

    def _commit(self, key: str, kind: str, meta: dict[str, Any], arrays: dict[str, np.ndarray]):
        """Write the record's files, then its index row; what a full disk, a folder that cannot be
        written or an index locked too long refuse is a :class:`StoreWriteError` (logged with its
        path); any other error (a bug, a schema from another version) is raised as it is.

        Returns the record's folder, its metadata as JSON, its creation time and its arrays' index
        fields (sha256, shape, dtype, nbytes by name)."""
        try:
            return self._write(key, kind, meta, arrays)
        except StoreWriteError:
            raise
        except OSError as e:
            log.warning("could not store record %s: %s", key[:12], e)
            raise StoreWriteError(e.strerror or type(e).__name__) from e
        except sqlite3.OperationalError as e:
            if not refused_write(e):
                raise
            log.warning("could not index record %s in %s: %s", key[:12], self.root, e)
            raise StoreWriteError(f"the store's index: {e}") from e

    def _write(self, key: str, kind: str, meta: dict[str, Any], arrays: dict[str, np.ndarray]):
        if not (plain_array_name(key) and len(key) <= 128):  # a key names folders: never a path
            raise ValueError(f"a record key is up to 128 letters, digits, '_' and '-', got {str(key)[:40]!r}")
        folder = self.root / "records" / key[:2] / f"{key}-{uuid.uuid4().hex[:8]}"
        # the writer's pid and host in the name: leftovers of a dead writer are collected at once
        tmp = folder.with_name(tmp_name(os.getpid(), folder.name))
        tmp.mkdir(parents=True)
        created = time.time()
        meta_json = json.dumps(meta, default=json_default)
        try:
            info = {name: _write_array(tmp, name, arr) for name, arr in arrays.items()}
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


def _write_array(folder: Path, name: str, arr: np.ndarray) -> dict[str, Any]:
    """Write ``arr`` as ``folder/<name>.npy``, synced to disk; its index fields."""
    if not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"array name {name!r} must be alphanumeric")
    arr = np.ascontiguousarray(arr)
    if arr.dtype == object:
        raise TypeError(f"array {name!r} has dtype object; only numeric arrays are stored")
    with open(folder / f"{name}.npy", "wb") as f:
        sha256 = write_npy(f, arr)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": sha256, "shape": list(arr.shape), "dtype": str(arr.dtype), "nbytes": int(arr.nbytes)}
