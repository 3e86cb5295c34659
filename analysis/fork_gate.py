"""No fork while another thread holds what the child would need: SQLite (:data:`GATE`), a model load
(:data:`MODEL_LOADS`), a module's import (:func:`wait_for_imports`).

The app's background jobs are processes forked from the multi-threaded server (Dash's
``DiskcacheManager``), and both sides use SQLite on the same files (the job cache, the store's index).
SQLite keeps its lock bookkeeping per process, shared by all connections to a file. A fork while
another thread is inside a transaction copies that bookkeeping into the child, where the lock's owner
no longer exists: every write the child then tries is refused as "busy" until its timeout
(``diskcache.Timeout`` after 60 s: the job cannot report progress or its result, and ends with
exit code 1). A fork while another thread is inside any SQLite call can likewise copy one of
SQLite's own mutexes held, and the child waits on it for ever. SQLite's rule is to not carry its
state across a fork; this gate makes the fork wait instead until no thread is inside SQLite.

Use: every SQLite call in a process that forks runs inside ``with GATE.using():`` (re-entrant per
thread); the gate is closed around every ``os.fork`` of this process by an at-fork hook, so the
fork waits for the calls in flight and new calls wait for the fork (a fork takes milliseconds). A
thread that forks while it is itself inside the gate only waits for the others (two threads that both
fork from inside it would wait for each other: nothing here does). Connections are closed inside the
gate too (the server closes each request thread's connections when its request ends,
:func:`headscope.app.server.close_sqlite_after_requests`), never left for the interpreter to close at thread exit.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)


class ForkGate:
    """Many threads inside (SQLite calls; a model load for :data:`MODEL_LOADS`) at once, or one fork;
    a fork waiting goes before new entries."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._depth: dict[int, int] = {}  # thread id → how many times it is inside
        self._forking: int | None = None  # the thread that is forking now
        self._waiting = 0  # forks waiting for the threads inside to leave

    @contextlib.contextmanager
    def using(self) -> Iterator[None]:
        """Run the body (SQLite calls; a model load) with no fork of this process in between."""
        me = threading.get_ident()
        with self._cond:
            if not self._depth.get(me):
                while (self._forking is not None and self._forking != me) or self._waiting:
                    self._cond.wait()
            self._depth[me] = self._depth.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                left = self._depth.get(me, 0) - 1
                if left > 0:
                    self._depth[me] = left
                else:
                    self._depth.pop(me, None)
                    self._cond.notify_all()

    def close_for_fork(self) -> None:
        """Wait until no other thread is inside, then keep new ones out (called before a fork)."""
        me = threading.get_ident()
        with self._cond:
            self._waiting += 1
            try:
                while self._forking is not None or any(d for t, d in self._depth.items() if t != me):
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._forking = me

    def open_after_fork(self) -> None:
        """Let waiting threads in again (the parent, after the fork)."""
        with self._cond:
            self._forking = None
            self._cond.notify_all()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Close the gate for the body (a fork): wait for the threads inside, keep new ones out."""
        pid = os.getpid()
        self.close_for_fork()
        try:
            yield
        finally:
            if os.getpid() == pid:  # a child forked in the body has a fresh gate already
                self.open_after_fork()

    def reset_in_child(self) -> None:
        """After a fork only the forking thread exists: fresh locks (another thread may have held the
        gate's own lock at the fork), nobody else inside, the forking thread as deep as it was."""
        me = threading.get_ident()
        own = self._depth.get(me, 0)
        self._reset()
        if own:
            self._depth[me] = own

    def inside(self) -> int:
        """How many threads are inside now (for tests and diagnostics)."""
        with self._cond:
            return len(self._depth)


GATE = ForkGate()
os.register_at_fork(before=GATE.close_for_fork, after_in_parent=GATE.open_after_fork,
                    after_in_child=GATE.reset_in_child)

MODEL_LOADS = ForkGate()
"""Model loads (:func:`headscope.analysis.models.load_model`) pass this gate; a job's fork holds it
(:meth:`ForkGate.held`), so no job is forked while another thread loads a model.

A load imports the family's modelling code lazily and holds Python's lock on each module while it
runs; a child forked meanwhile inherits that lock with its owner gone and waits for ever at its own
first use of the module (seen in CI: a page's render loaded Qwen 3 in a server thread while a Run
click forked the job, which never started). The fork waits for the loads in flight instead (seconds
for a small model, minutes for a first load that converts a GGUF) and the job then shares the model. A gate of its own, so that a waiting fork holds up new
loads only, not every SQLite call. It is held around the fork by its caller, not from an at-fork
hook: other libraries gate their own work at fork too (``filelock`` closes its admission in a hook),
and a hook of ours waiting for a load that needs theirs would wait for ever."""
os.register_at_fork(after_in_child=MODEL_LOADS.reset_in_child)


def wait_for_imports(timeout_s: float = 120.0, poll_s: float = 0.005) -> list[str]:
    """Wait until no other thread is inside an ``import`` (call just before a fork); return the
    modules still being imported if ``timeout_s`` passed first.

    Python holds a lock on each module while its code runs, and a fork copies a lock another thread
    holds into a child where its owner never returns: the child's own first import of that module
    waits for ever. The server imports lazily in its request threads (a model family's modelling
    code, a plotting or export library on first use) while another request forks a job, so the fork
    waits for those imports to end (milliseconds; seconds for a large library). The locks are read
    from ``importlib._bootstrap._module_locks``, CPython's own table (3.11-3.13); where it is missing
    or shaped otherwise this returns at once. Not seen: an import another thread starts after this
    check, while the fork still waits in at-fork hooks (:data:`GATE`'s, filelock's, the UMAP warm-up's;
    usually milliseconds). Loads of models, whose imports take seconds, are held off by
    :data:`MODEL_LOADS` for the whole fork."""
    from importlib import _bootstrap

    me = threading.get_ident()
    deadline = time.monotonic() + timeout_s

    def importing() -> list[str]:
        busy = []
        try:
            table = list(getattr(_bootstrap, "_module_locks", {}).items())
        except RuntimeError:  # changed size while copied: look again
            return ["?"]
        for name, ref in table:
            lock = ref() if callable(ref) else None
            owner, count = getattr(lock, "owner", None), getattr(lock, "count", 0)
            if owner is not None and owner != me and count:
                busy.append(name)
        return busy

    while (busy := importing()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    if busy:
        log.warning("forking while other threads import %s (waited %.0f s)", ", ".join(busy), timeout_s)
    return busy
