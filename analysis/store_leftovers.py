"""Crash leftovers in a store's ``records/`` folder, and when each is safe to remove.

A writer builds a record in a temporary folder named after its pid and host
(``.tmp-<pid>-<host>-<name>``) and renames it into place before committing its index row
(:mod:`headscope.analysis.record_writes`). A killed writer leaves that temporary folder; a crash
between the rename and the commit leaves a folder no index row names. :func:`collect_leftovers`
decides which of them can go without touching what a live writer is making.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import socket
import time
from pathlib import Path

log = logging.getLogger("headscope.analysis.store")  # one logger for every part of the store

TMP_PREFIX = ".tmp-"
#: A temporary folder of a writer on another host (whose pid cannot be checked), or of a pid that
#: was reused, is collected only when nothing in it changed for this long.
STALE_TMP_S = 15 * 60
#: A record folder no index row points to (a crash between rename and commit) is collected after this.
ORPHAN_S = 3600
#: This host, as a writer names it in its temporary folders (a pid is only checked on its own host).
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def tmp_name(pid: int, name: str) -> str:
    """The temporary folder in which process ``pid`` of this host writes the record folder ``name``."""
    return f"{TMP_PREFIX}{pid}-{HOST}-{name}"


def collect_leftovers(root: Path, entries: list[Path], live: set[str], older_than_s: float) -> int:
    """Remove the leftovers among ``entries`` (paths under ``root / "records"``); ``live`` holds the
    folders (relative to ``root``) that index rows name. Returns how many were removed.

    - a temporary folder of a writer on this host whose process is gone: at once;
    - a temporary folder of a live writer: never (another process may be writing it right now);
    - any other temporary folder (another host, an old name): when nothing in it changed for
      ``STALE_TMP_S`` (or ``older_than_s``, if smaller);
    - a committed folder no index row points to (a crash between rename and commit, or a
      replaced version not yet removed): when older than ``older_than_s``;
    - a stray file or symbolic link (no writer makes one here): removed without being followed,
      once as old as a stale temporary folder."""
    removed = 0
    now = time.time()
    for folder in entries:
        try:
            if folder.is_symlink() or not folder.is_dir():
                stale = now - folder.lstat().st_mtime > min(STALE_TMP_S, older_than_s)
            elif folder.name.startswith(TMP_PREFIX):
                writer = _tmp_writer(folder.name)
                if writer is not None and writer[1] == HOST:
                    stale = not _pid_alive(writer[0])
                else:
                    stale = now - _last_change(folder) > min(STALE_TMP_S, older_than_s)
            else:
                rel = str(folder.relative_to(root))
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
