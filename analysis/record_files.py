"""The files of a stored record and the checks that tell a sound one from a damaged one.

A record folder holds one ``.npy`` file (format 1.0) per array and a ``record.json`` manifest (key,
kind, metadata, each array's sha256, shape, dtype and size). This module writes and parses those
bytes, encodes metadata and content keys as JSON, and names what proves damage: a file that is
missing, not a regular file, a symbolic link, not ``.npy``, or not JSON raises :class:`CorruptRecord`.
It knows nothing of the index (:mod:`headscope.analysis.store_index`) nor of which reads may be
retried (:mod:`headscope.analysis.store`).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np

#: The manifest beside a record's arrays: what a rebuild of the index reads.
MANIFEST = "record.json"

#: ``errno``s that prove a file is not what the store wrote: gone, a folder on its path replaced by
#: a file, a symbolic link (opened with ``O_NOFOLLOW``), a socket in its place. Any other error of a
#: read (EMFILE, EIO, EAGAIN, EACCES, ENOMEM...) proves nothing about the record.
DAMAGE = {errno.ENOENT: "is missing", errno.ENOTDIR: "is missing", errno.ELOOP: "is a symbolic link",
          errno.ENXIO: "is not a regular file"}
#: A ``.npy`` header (format 1.0) is at most 65,545 bytes: a file larger than its array plus that is damaged.
MAX_HEADER = 65_545
#: How a record's file is opened: never following a link, never waiting on a pipe put in its place
#: (a non-blocking open returns at once), never taking a terminal.
READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NOCTTY", 0)


class CorruptRecord(RuntimeError):
    """A stored record is proven damaged: an array failed its checksum, is missing, truncated, of the
    wrong size or not a regular file, or its index row cannot be parsed or names a folder outside
    the store. (A read that merely failed is an ``OSError``: :class:`headscope.analysis.store.StoreReadError`.)"""


def content_key(*parts: Any) -> str:
    """sha256 of a canonical JSON encoding of ``parts``: the same request gives the same key."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=json_default)
    return hashlib.sha256(blob.encode()).hexdigest()


def as_json(obj: Any) -> Any:
    """``obj`` as the store keeps metadata: plain JSON values (numpy numbers and arrays, tuples and sets
    turned into numbers and lists)."""
    return json.loads(json.dumps(obj, default=json_default))


def json_default(obj: Any) -> Any:
    """The JSON value of what ``json`` cannot encode itself: numpy numbers and arrays, tuples, sets."""
    if isinstance(obj, np.integer | np.floating):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, tuple | set):
        return list(obj)
    raise TypeError(f"not JSON-serialisable: {type(obj).__name__}")


def parse_json_bytes(text: Any) -> Any:
    """JSON from the store (an index field, a manifest); ``CorruptRecord`` for anything that is not
    JSON (bit rot, a field of the wrong type, nesting too deep for the parser)."""
    try:
        return json.loads(text)
    except (TypeError, ValueError, RecursionError) as e:
        raise CorruptRecord(f"not JSON: {type(e).__name__}") from None


def plain_array_name(name: Any) -> bool:
    """The names the store gives array files: letters, digits, ``_`` and ``-`` (so a name is never a path)."""
    return isinstance(name, str) and bool(name) and name.replace("_", "").replace("-", "").isalnum() \
        and name.isascii()


def write_npy(f, arr: np.ndarray) -> str:
    """Write C-contiguous ``arr`` to ``f`` as a ``.npy`` file and return the sha256 of the bytes written,
    taken from memory as they are written: the file is never read back (a 512-token run's patterns
    are 127 MB, and the job waits on this before the page's grid appears) and the data is never
    copied (``numpy.save`` to a wrapper copies it in 16 MiB blocks)."""
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


def npy_bytes(arr: np.ndarray) -> tuple[bytes, str]:
    """``arr`` as the bytes of a ``.npy`` file, as the store writes it, and their sha256."""
    buf = io.BytesIO()
    sha256 = write_npy(buf, np.ascontiguousarray(arr))
    return buf.getvalue(), sha256


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


def read_regular(path: Path) -> bytes:
    """The bytes of the regular file ``path`` (a manifest), never following a link nor waiting on
    a pipe. ``CorruptRecord`` when it is missing or not a regular file; any other ``OSError`` is
    raised as it is (it proves nothing about the record)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            raise CorruptRecord(f"{path.name} is not a regular file")
        with open(os.open(path, READ_FLAGS), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise CorruptRecord(f"{path.name} is not a regular file")
            return f.read()
    except OSError as e:
        if e.errno in DAMAGE:
            raise CorruptRecord(f"{path.name} {DAMAGE[e.errno]}") from e
        raise


def checked_manifest(manifest: Any) -> dict[str, Any]:
    """A manifest as :meth:`headscope.analysis.record_writes.RecordWriter._write` writes it;
    ``CorruptRecord`` for any other shape (a rebuild indexes only what it can serve)."""
    ok = isinstance(manifest, dict) and {"key", "kind", "meta", "created", "arrays"} <= manifest.keys() \
        and isinstance(manifest["key"], str) and isinstance(manifest["kind"], str) \
        and isinstance(manifest["meta"], dict) and isinstance(manifest["arrays"], dict) \
        and isinstance(manifest["created"], int | float) and not isinstance(manifest["created"], bool)
    ok = ok and all(
        plain_array_name(n) and isinstance(i, dict) and isinstance(i.get("sha256"), str)
        and isinstance(i.get("shape"), list) and isinstance(i.get("dtype"), str)
        and isinstance(i.get("nbytes"), int) and not isinstance(i.get("nbytes"), bool)
        for n, i in manifest["arrays"].items())
    if not ok:
        raise CorruptRecord("not a record manifest")
    return manifest
