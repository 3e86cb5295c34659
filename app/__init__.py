"""headscope's web app, command line and job wiring (over :mod:`headscope.analysis` and :mod:`headscope.kernels`)."""

from headscope.app.fork_safety import sqlite_without_memory_mutex

sqlite_without_memory_mutex()  # before anything imports sqlite3: see app/fork_safety.py
