"""SQLite's global memory mutex off, so a job forked from the server cannot inherit it locked.

Background jobs are forked from the server's request threads (Dash's ``DiskcacheManager``) while other
threads use SQLite (the job cache, the store's index). With SQLite's memory statistics on (its default),
every ``sqlite3Malloc`` takes one process-wide mutex; a fork at the moment another thread holds it gives
a child whose first SQLite call waits for ever (in ``sqlite3Malloc`` under ``sqlite3.connect``). Turning the statistics
off (``SQLITE_CONFIG_MEMSTATUS``, also SQLite's own advice for speed) removes that mutex from every
allocation. It can only be set before SQLite initialises, which Python's ``sqlite3`` module does when it
is imported, so :mod:`headscope.app` calls this first, before anything imports ``sqlite3``.

This only removes the one mutex every allocation takes. What makes a fork safe is
:mod:`headscope.analysis.fork_gate`: no fork while any thread is inside SQLite.
"""

from __future__ import annotations

import ctypes
import sys

SQLITE_CONFIG_MEMSTATUS = 9
SQLITE_LIBRARY = "libsqlite3.so.0"  # what Python's _sqlite3 links to on Debian (the same loaded copy)


def sqlite_without_memory_mutex() -> bool:
    """Turn SQLite's memory statistics off; ``True`` if it took effect (``False``: SQLite already
    initialised in this process, or no shared library to configure — nothing changes then)."""
    if "sqlite3" in sys.modules or "_sqlite3" in sys.modules:
        return False
    try:
        lib = ctypes.CDLL(SQLITE_LIBRARY)
        return lib.sqlite3_config(SQLITE_CONFIG_MEMSTATUS, ctypes.c_int(0)) == 0
    except (OSError, AttributeError):
        return False
