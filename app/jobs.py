"""Background jobs through Dash's own background-callback managers (no queue of our own).

Embedded (default): ``DiskcacheManager`` — each job runs in a process forked from the server, so it
shares the already-loaded model's memory; its progress and result pass through a disk cache under
``HEADSCOPE_HOME/jobs``. Results that matter land in the store, so a reload or a second tab finds them.
That cache holds JSON (:class:`JSONJobDisk`), not diskcache's default pickles: a value that is not
JSON is an error, and a pickle found in it is never loaded.

With ``HEADSCOPE_REDIS_URL`` set: Dash's ``CeleryManager`` (:mod:`headscope.app.workers`) — the same
callbacks run on Celery workers started with ``headscope worker``, and the web process loads no
model: every callback that loads a model or reads analysis results is a background callback then
(:func:`on_workers`), so it runs on a worker too.

Forked children must run numba on its fork-safe ``workqueue`` threading layer (set here, before
numba is imported). Every job ends on its page with its result or a message in the banner: a job whose
process dies, whose fork the system refuses, or whose result a full disk keeps out of the job cache says
so (:func:`_watched_manager`). A job ends with the server that forked it, even one killed with SIGKILL
(:func:`_end_with_server`), so it never computes on, orphaned, and stores what nobody is waiting for.

A job is never forked while another server thread loads a model (a page's render does, for a model
named in its link): the child would inherit the lock on a module the load was importing and wait for
ever. The fork waits for the load (:data:`headscope.analysis.fork_gate.MODEL_LOADS`) and the job shares the model;
it likewise waits for any other thread's import to end (:func:`headscope.analysis.fork_gate.wait_for_imports`).

A job is never forked while a server thread is inside SQLite (the job cache here, the store's
index): the job would inherit SQLite's locks with their owner gone, and could never write its progress
or result. Both pass :data:`headscope.analysis.fork_gate.GATE` (:class:`GatedCache`), which every fork waits
for. Each job has its own result key (:class:`headscope.app.workers.OneKeyPerJob`), so two sessions running the
same thing at once each get their own result.

Torch threads in forked children: GNU OpenMP's thread pool does not survive a fork, so a child of a
process that ran torch on several threads hangs as soon as it uses more than one. ``headscope serve``
therefore runs OpenMP on one thread in every thread of its own process from the start
(:func:`prepare_server_threads`; it computes nothing heavy itself), and :func:`in_job` gives each job
the threads the server would have had (on 2 cores a 400-token forward pass takes 1.0-1.2 s, against
1.8 s on one thread). Several jobs at once then share the cores: with OpenMP's default spin-waiting,
three 2-thread jobs on 2 cores take 36 s, so the server sets ``OMP_WAIT_POLICY=PASSIVE`` before torch
loads: 7.4 s, against 6.8 s for three one-thread jobs (about 10% more when jobs crowd the cores, 40%
less for one job alone). Anywhere else (a Celery worker's pool, a test forking its own process, a
job's own children) a job runs on one thread.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import secrets
import signal
import sqlite3
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import diskcache
from diskcache.core import MODE_BINARY, MODE_RAW, MODE_TEXT

from headscope.analysis.fork_gate import GATE, MODEL_LOADS, wait_for_imports
from headscope.app.busy import STARTING, show_busy
from headscope.app.workers import NotStarted, OneKeyPerJob, ended, job_manager, redis_url

log = logging.getLogger(__name__)

# numba's default threading layer here is GNU OpenMP, which does not survive fork(): once the server
# has run a numba-parallel kernel (the UMAP warm-up), a forked job that runs one is killed ("fork()
# called from a process already using GNU OpenMP, this is unsafe"). The workqueue layer is
# fork-safe. Set before numba is first imported (UMAP imports it lazily); a value already in the
# environment wins.
os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")

_manager = None


class RefusedPickle(OSError):
    """A job-cache entry that is not JSON (a pickle, say): never loaded. An ``OSError``, because
    that is how diskcache's ``Cache.get`` is told an entry cannot be read: the entry then counts as
    absent instead of raising into Dash's polling request."""


class JSONJobDisk(diskcache.Disk):
    """A ``diskcache.Disk`` for Dash's background-job cache that never pickles and never unpickles.

    Keys are strings. Values are stored as JSON text (Dash components, plotly figures and numpy
    arrays through plotly's encoder, as Dash itself sends them to the browser), except ``bytes``
    (Dash's signing secret), stored as raw bytes. A value that cannot be JSON is stored as Dash's
    background-callback error, so the page shows a message instead of waiting forever. Reading
    accepts exactly these forms; anything else (a pickle planted in the cache) raises
    :class:`RefusedPickle` and is treated as absent.
    """

    def put(self, key):
        if type(key) is not str:
            raise TypeError(f"job-cache keys are strings, not {type(key).__name__}")
        return key, True

    def get(self, key, raw):
        if not raw or type(key) is not str:
            raise RefusedPickle("a job-cache key that is not a plain string was not loaded")
        return key

    def store(self, value, read, key=diskcache.core.UNKNOWN):
        if read or type(value) is bytes:
            return super().store(value, read, key=key)
        from plotly.io.json import to_json_plotly

        try:
            text = to_json_plotly(value)
        except (TypeError, ValueError) as e:
            log.error("a background job's value is not JSON (%s); stored as an error instead", e)
            text = json.dumps({"background_callback_error": {
                "msg": f"The job's result could not be passed back ({e}).", "tb": ""}})
        return super().store(text, False, key=key)

    def fetch(self, mode, filename, value, read):
        if mode == MODE_RAW and type(value) is str or mode == MODE_TEXT:
            return json.loads(super().fetch(mode, filename, value, False))
        if mode == MODE_RAW and type(value) in (bytes, sqlite3.Binary) or mode == MODE_BINARY:
            return super().fetch(mode, filename, value, read)
        log.warning("refused to load a job-cache entry of mode %s (only JSON and bytes are read)", mode)
        raise RefusedPickle(f"job-cache entry of mode {mode} was not loaded")


def cancellable_callback(*dependencies, run: str | None, cancel: str, progress: str, status: str,
                         preview: str | None = None, stale: tuple[str, ...] = (), **kwargs):
    """Dash's ``callback`` for a cancellable background job, as a decorator: progress bar ``progress``
    with its caption ``status``, the ``run`` button (if any) disabled while the job runs, and the
    ``cancel`` button enabled by the job's own progress reports.

    Dash stops a job only through the handle that the job's first answer brings back to the page, after
    the server forked the job (seconds on a loaded machine). A Cancel enabled the moment Run is pressed
    (Dash's ``running``) could be clicked before that: the page would say "Cancelled" while the job
    ran on, Run would stay disabled until it ended, and its result would then replace the page's. Progress reaches the
    page only by polling with that handle, so a Cancel that progress enables can always stop the job.
    (On Celery workers the handle is the queued task's id and comes back at once: Cancel is enabled
    when Run is pressed, so a job still waiting in the queue can be cancelled.)

    The decorated function takes ``set_progress`` first, called with (value, max, text); it reports
    (0, 100, :data:`STARTING`) as soon as the job starts, so Cancel does not wait for its first real report. When the
    job ends or is cancelled the bar is empty again.

    From the moment the job starts (``run`` disabled) it is shown as busy, as every long action is
    (:func:`headscope.app.busy.show_busy`): the caption says it is starting, the banner is cleared, and the
    figures in ``stale`` (graph ids: those its result will replace) are marked out of date until it ends.

    ``preview``: a store the job can fill before it ends, with ``set_progress(value, data)``: the page
    draws from it what the job has already computed (the Attention grid while the run is stored). It
    must be the job's last report: a later one would replace it before the page's next poll. Every
    other report writes ``None`` there."""
    import functools

    from dash import Input, Output, callback, clientside_callback

    def register(fn):
        @functools.wraps(fn)
        def job(set_progress, *args, **named):
            def report(value, early=None):
                # Cancel enabled: the page polls this job by its handle
                set_progress((*value, False, early) if preview else (*value, False))

            report((0, 100, STARTING))  # not "": the caption says the job runs until its first report
            return fn(report, *args, **named)

        # the job ended or was cancelled (Cancel went off): the bar is empty again, as on a fresh page,
        # not where the last poll left it. Not Dash's progress_default, which would also blank the
        # caption after a "Cancelled" the page had already written there.
        clientside_callback("(off) => off ? 0 : window.dash_clientside.no_update",
                            Output(progress, "value", allow_duplicate=True), Input(cancel, "disabled"),
                            prevent_initial_call=True)
        # On Celery workers the handle (a task id) comes back as soon as the task is queued, and a
        # queued task can be revoked before any worker takes it: there Cancel is on from the start,
        # or a job waiting behind other users' jobs could not be cancelled until it began.
        running = [(Output(cancel, "disabled"), not redis_url(), True)]
        if run is not None:
            running.insert(0, (Output(run, "disabled"), True, False))
            show_busy(run, status, progress, stale)
        reports = [Output(progress, "value"), Output(progress, "max"), Output(status, "children"),
                   Output(cancel, "disabled")]
        if preview:
            reports.append(Output(preview, "data"))
        return callback(*dependencies, background=True, progress=reports,
                        running=running, cancel=[Input(cancel, "n_clicks")], **kwargs)(job)

    return register


def on_workers(interval_ms: int = 250) -> dict[str, Any]:
    """Keyword arguments for a callback that loads a model or reads analysis results: with
    ``HEADSCOPE_REDIS_URL`` set it becomes a background callback, run by a worker (polled every
    ``interval_ms``); embedded, it is an ordinary callback, run in the server."""
    return {"background": True, "interval": interval_ms} if redis_url() else {}


def background_manager():
    """The process-wide background-callback manager (created on first use): Celery workers when
    ``HEADSCOPE_REDIS_URL`` is set, else a disk cache and processes forked from the server."""
    global _manager
    if _manager is None:
        if redis_url():
            _manager = job_manager()
            return _manager
        from dash import DiskcacheManager

        from headscope.analysis.paths import home

        cache = job_cache(home() / "jobs")
        _manager = _watched_manager(DiskcacheManager)(cache, expire=24 * 3600)
    return _manager


JOB_CACHE_FULL = ("The job's result could not be passed back: the job cache's disk is full. Free space on the "
                  "disk that holds the server's data (HEADSCOPE_HOME), then run it again.")
DISK_FULL_EXIT = errno.ENOSPC  # a job process's exit status when the job cache's disk refused its writes
NO_LONGER_RUNNING = ("This job is no longer running: the server was restarted after it started. Run it again; "
                     "results stored before are reused.")


def disk_full(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from or while handling, says the disk is full:
    ``ENOSPC`` or ``EDQUOT`` from a file write, SQLite's ``SQLITE_FULL`` from the cache's index."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(error, sqlite3.Error) and (getattr(error, "sqlite_errorcode", None) == 13  # SQLITE_FULL
                                                 or "disk is full" in str(error)):
            return True
        error = error.__cause__ or error.__context__
    return False


def job_stopped_message(exitcode: int | None) -> str:
    """What the page says when a background job's process ended without a result."""
    if exitcode == DISK_FULL_EXIT:
        return JOB_CACHE_FULL
    if exitcode is not None and exitcode < 0:
        import signal

        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        why = {"SIGKILL": "killed (out of memory, or stopped from outside)",
               "SIGSEGV": "crashed (segmentation fault)", "SIGABRT": "aborted (a library gave up)",
               "SIGTERM": "terminated from outside"}.get(name, f"stopped by {name}")
        return f"The job stopped: its process was {why} ({name}) before it finished. Run it again; " \
               "if it keeps stopping, try a shorter text or fewer sentences."
    code = "" if exitcode is None else f" (exit code {exitcode})"
    return f"The job stopped: its process ended without a result{code}. Run it again; if it keeps " \
           "stopping, see the server log."


def _watched_manager(base):
    """``base`` (Dash's ``DiskcacheManager``) under which every job ends on its page with its result or
    a message, and no job outlives the server.

    Dash polls a background job by asking for its result, then whether its process still runs; a job
    that is not running and has no result is answered with 204 and no body, and the page stops waiting
    without a word. Here the manager keeps each job's process object (the server forked it, so its
    exit code is known) and answers for it:

    - a job that died without a result (a signal, the out-of-memory killer, a crash in a library, a
      job cache on a full disk) answers with Dash's background-callback error, which the page shows in
      its banner (and Run comes back). A job the user cancelled is not reported;
    - a job counts as running until a poll has reported its end: a job that dies between a poll's
      read of its result and Dash's question whether it runs is reported by the next poll;
    - a job whose fork the system refused answers its first poll with why (:class:`NotStarted`);
    - a handle this server never gave out (one signed before a restart: the signing secret is kept in
      the job cache) answers :data:`NO_LONGER_RUNNING`, and no process is ever ended by one (Dash's
      own manager would kill whatever process has that pid now);
    - an error reading the job cache ends the job with a message, not a 204.

    A job's handle is its pid and a random suffix, so a pid the system gives again to a later job never
    names that job for an earlier page.
    """

    class WatchedDiskcacheManager(OneKeyPerJob, base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._processes: dict[str, Any] = {}
            self._cancelled: dict[str, None] = {}  # insertion-ordered: the oldest are forgotten first
            self._not_started = NotStarted()

        def call_job_fn(self, key, job_fn, args, context):
            from multiprocess import Process

            process = Process(target=_job_process(job_fn, os.getpid()),
                              args=(key, self._make_progress_key(key), args, context))
            # never fork while another thread loads a model or imports a module: the child would wait for
            # ever on a lock the import holds (analysis.fork_gate). Imports first, so that loads are held
            # off only for the last check.
            wait_for_imports()
            try:
                with MODEL_LOADS.held():
                    wait_for_imports()
                    process.start()
            except OSError as e:  # EAGAIN (too many processes), ENOMEM
                log.error("a job could not be started: fork failed (%s)", e)
                return self._not_started.add(key, f"The server could not start the job: the system refused a "
                                                  f"new process ({e.strerror or e}). Wait for other jobs to end, "
                                                  "then run it again.")
            job = f"{process.pid}-{secrets.token_hex(4)}"
            self._processes[job] = process
            return job

        def get_progress(self, key):
            # read and removed in one step: Dash reads, then deletes, and a report the job writes between
            # the two would be lost (Run's grid preview is its last report: the page would never see it)
            try:
                return self.handle.pop(self._make_progress_key(key))
            except Exception as e:  # a poll must answer; the result's read says why
                log.warning("a job's progress could not be read from the job cache: %s", e)
                return None

        def get_updated_props(self, key):
            try:
                return super().get_updated_props(key)
            except Exception as e:  # as in get_progress
                log.warning("a job's page updates could not be read from the job cache: %s", e)
                return {}

        def job_running(self, job):
            # until a poll has reported its end (get_result), whatever the process does meanwhile
            return str(job) in self._processes

        def terminate_unhealthy_job(self, job):
            return False  # Dash's own asks the system about any pid: jobs end through terminate_job

        def terminate_job(self, job):
            process = self._processes.pop(str(job), None) if job is not None else None
            if process is None:  # not a job of this server's (or one that already ended)
                return None
            self._cancelled[str(job)] = None
            while len(self._cancelled) > NotStarted.LIMIT:
                del self._cancelled[next(iter(self._cancelled))]
            if process.is_alive():  # reaped, its pid could be another process's by now
                return super().terminate_job(process.pid)
            return None

        def get_result(self, key, job):
            why = self._not_started.pop(key)
            if why is not None:
                return ended(why)
            try:
                return self._result(key, job)
            except Exception as e:  # Dash would answer 204 and the page would wait in silence
                if disk_full(e):
                    log.error("job %s: the job cache's disk is full (%s)", job, e)
                    return ended(JOB_CACHE_FULL)
                log.exception("job %s: its result could not be read from the job cache", job)
                return ended(f"The job's result could not be read ({type(e).__name__}). Run it again; "
                             "the server log has the details.")

        def _result(self, key, job):
            result = super().get_result(key, job)
            if result is not self.UNDEFINED or job is None:
                return result
            job = str(job)
            process = self._processes.get(job)
            if process is None:
                return result if job in self._cancelled else ended(NO_LONGER_RUNNING)
            if process.is_alive():
                return result
            result = super().get_result(key, job)  # it may have written its result just before it ended
            if result is not self.UNDEFINED:
                return result
            self._processes.pop(job, None)
            text = job_stopped_message(process.exitcode)
            log.error("background job %s: %s", job, text)
            return ended(text)

    return WatchedDiskcacheManager


def _job_process(job_fn, server_pid: int) -> Callable[..., None]:
    """``job_fn`` (Dash's job function) as the target of a job's forked process: it ends with the server
    (:func:`_end_with_server`), and a job cache whose disk is full ends it with :data:`DISK_FULL_EXIT`,
    which its page reads as :data:`JOB_CACHE_FULL` (a traceback and exit code 1 said nothing)."""

    def run(*args) -> None:
        _end_with_server(server_pid)
        try:
            job_fn(*args)
        except Exception as e:
            if not disk_full(e):
                raise
            log.error("a job could not store its result or progress: the job cache's disk is full (%s)", e)
            sys.exit(DISK_FULL_EXIT)

    return run


def _end_with_server(server_pid: int) -> None:
    """In a job process: end it, and the processes it started, as soon as ``server_pid`` (the server that
    forked it) has ended, however it ended.

    A SIGTERM reaches the jobs through the server (:func:`end_jobs_with_server`), but a server killed with
    SIGKILL (or by the out-of-memory killer) ends no one: its jobs computed on, orphaned, holding the
    model's memory, and stored results no page would ask for. A thread of the job waits on a pidfd of the
    server (readable once it has ended; where there is none, it checks every half second that the server
    is still its parent) and then kills the job's children and the job itself: SIGKILL, because a store
    write is atomic and nothing of the job is worth saving. ``prctl(PR_SET_PDEATHSIG)`` cannot do this:
    it fires when the *thread* that forked the job ends, and the server forks from request threads."""

    def end() -> None:
        import psutil

        try:
            children = psutil.Process().children(recursive=True)
        except psutil.Error:
            children = []
        for child in children:
            try:
                child.kill()
            except psutil.Error:
                pass
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        try:
            server = os.pidfd_open(server_pid)
        except (AttributeError, OSError):  # no pidfds here, or the server has already ended
            server = None
        if os.getppid() != server_pid:  # ended (and this job handed to another parent) before the pidfd
            end()
        if server is not None:
            import select

            # poll, not select: a server with many open connections hands its jobs descriptors past
            # select's FD_SETSIZE (1024), which select refuses
            watcher = select.poll()
            watcher.register(server, select.POLLIN)
            while not watcher.poll():
                pass
        else:
            while os.getppid() == server_pid:
                time.sleep(0.5)
        end()

    threading.Thread(target=watch, name="headscope-end-with-server", daemon=True).start()


def _wait_ended(processes: list, timeout_s: float) -> list:
    """Wait until every one of ``processes`` (psutil) has ended or ``timeout_s`` passed; return those
    still running. A zombie has ended: a grandchild's exit status is collected by whoever reaps
    orphans, which in a container's init can take seconds (``psutil.wait_procs`` waited for that)."""
    import psutil

    def running(p) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + timeout_s
    alive = [p for p in processes if running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if running(p)]
    return alive


def _has_ancestor(process, pids: set[int]) -> bool:
    """Whether one of ``pids`` is ``process``'s parent, grandparent, … (psutil)."""
    import psutil

    try:
        return any(parent.pid in pids for parent in process.parents())
    except psutil.Error:
        return False


def end_jobs_with_server(grace_s: float = 5.0) -> None:
    """On SIGTERM, end this process's background jobs, then the process (call once, in the main thread).

    Dash's ``DiskcacheManager`` starts every job as a forked, non-daemon process. Unhandled, a SIGTERM
    (systemd, ``docker stop``, a test's teardown) ends only the server and leaves its jobs computing,
    orphaned and holding the model's memory, and with them a kaleido Chromium an export started. The
    handler asks every descendant to stop (the export browser aside, below), kills what is left after
    ``grace_s``, and then ends the server with SIGTERM's own default action, so it still reads as
    "terminated by SIGTERM". A forked job inherits the handler and ends its own children the same way.
    (SIGINT from a terminal reaches the whole process group already.)

    The export browser's wrapper process (choreographer's, between kaleido and Chromium) is not sent
    SIGTERM: its own handler waits 5 s on a lock its interrupted main thread holds, so every stop would
    take over 5 s. Its Chromium, a headless renderer with nothing to save, is killed at once (on SIGTERM
    it takes 1-3 s to end), and the wrapper then ends by itself.
    """
    import signal

    import psutil

    def is_browser_wrapper(process) -> bool:
        try:
            command = process.cmdline()
        except psutil.Error:
            return False
        return len(command) > 1 and os.path.basename(command[1]) == "_unix_pipe_chromium_wrapper.py"

    def on_term(signum, _frame):
        try:
            children = psutil.Process().children(recursive=True)
        except psutil.Error:
            children = []
        wrappers = {c.pid for c in children if is_browser_wrapper(c)}
        browsers = {c.pid for c in children if c.pid not in wrappers and _has_ancestor(c, wrappers)}
        for child in children:
            try:
                if child.pid in browsers:
                    child.kill()
                elif child.pid not in wrappers:
                    child.terminate()
            except psutil.Error:
                pass
        alive = _wait_ended(children, grace_s)
        for child in alive:
            try:
                child.kill()
            except psutil.Error:
                pass
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_term)


class GatedCache(diskcache.Cache):
    """A ``diskcache.Cache`` whose every SQLite use passes :data:`headscope.analysis.fork_gate.GATE`, so a job
    is never forked while a server thread is inside the cache's SQLite (the job would inherit a lock
    with no owner and could never write its progress or result: ``diskcache.Timeout``, exit code 1)."""

    @contextlib.contextmanager
    def transact(self, retry=False):
        with GATE.using(), super().transact(retry) as result:
            yield result


def _gated(name):
    method = getattr(diskcache.Cache, name)

    @functools.wraps(method)
    def gated(self, *args, **kwargs):
        with GATE.using():
            return method(self, *args, **kwargs)

    return gated


for _name in ("set", "__setitem__", "touch", "add", "incr", "decr", "get", "__getitem__", "read", "__contains__",
              "pop", "__delitem__", "delete", "push", "pull", "peek", "peekitem", "check", "evict", "expire",
              "cull", "clear", "stats", "volume", "close", "reset", "__len__"):
    setattr(GatedCache, _name, _gated(_name))


def job_cache(folder) -> diskcache.Cache:
    """The disk cache Dash's background jobs pass progress and results through (JSON only)."""
    return GatedCache(str(folder), disk=JSONJobDisk)


def in_job() -> None:
    """Call first in a background job: makes torch safe to use in a forked process (module docstring)."""
    import torch

    if os.getpid() != _SERVER_PID:  # more than one thread only in a child of the one-thread server itself
        torch.set_num_threads(_job_threads if os.getppid() == _SERVER_PID else 1)


_SERVER_PID = os.getpid()
_job_threads = 1


def prepare_server_threads() -> None:
    """Call in ``headscope serve`` before torch loads (module docstring): every thread of the server
    process runs OpenMP on one thread (``OMP_NUM_THREADS=1``, read when torch loads OpenMP, so a
    library that restores a thread's count later restores one), OpenMP threads sleep while they wait
    (``OMP_WAIT_POLICY=PASSIVE`` unless set otherwise), and the server's forked jobs get the threads
    a process would have had: ``OMP_NUM_THREADS`` as the environment gave it, else the CPUs this
    process may run on. Too late (torch already loaded) or with a spin-waiting policy, jobs keep to
    one thread."""
    global _job_threads
    import sys

    if "torch" in sys.modules:
        return
    policy = os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    given = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(given) if given.isdigit() and int(given) > 0 else len(os.sched_getaffinity(0))
    os.environ["OMP_NUM_THREADS"] = "1"
    if policy.upper() == "PASSIVE" and os.getpid() == _SERVER_PID:
        _job_threads = max(1, threads)


def progress_reporter(set_progress: Callable[..., Any], label: str) -> Callable[[float], None]:
    """Adapt an analysis ``progress(fraction)`` callback to a Dash ``set_progress`` of
    (value, max, text) for an ``html.Progress`` and its caption; throttled to whole percents."""
    last = {"pct": -1}

    def report(fraction: float) -> None:
        pct = int(100 * min(max(fraction, 0.0), 1.0))
        if pct != last["pct"]:
            last["pct"] = pct
            set_progress((pct, 100, f"{label}: {pct}%"))

    return report


def count_progress(set_progress, n: int, unit: str, clock=time.monotonic):
    """A countable job's ``progress(fraction)`` as "<unit> i of n (p%)", and once an item has finished,
    "about T left": the time so far × (1 − fraction) / fraction. The job reports (items done) / n; items
    reused from the store finish at once, so an early estimate can run short. Throttled to a new item
    or a whole percent."""
    start, last = clock(), {"shown": None}

    def report(fraction: float) -> None:
        fraction = min(max(float(fraction), 0.0), 1.0)
        done, pct = fraction * n, int(100 * fraction)
        item = min(int(done + 1e-9) + 1, n)
        if (item, pct) == last["shown"]:
            return
        last["shown"] = (item, pct)
        text = f"{unit} {item} of {n} ({pct}%)"
        if 1 <= done + 1e-9 and fraction < 1:
            text += f", about {_duration((clock() - start) * (1 - fraction) / fraction)} left"
        set_progress((pct, 100, text))

    return report


def trial_progress(set_progress, n_trials: int, clock=time.monotonic):
    """A sweep's progress as the Heads page shows it: "trial i of n (p%), about T left"
    (:func:`count_progress`; a sweep runs one trial per length × depth × needle)."""
    return count_progress(set_progress, n_trials, "trial", clock)


def _duration(seconds: float) -> str:
    return f"{max(1, round(seconds))} s" if seconds < 90 else f"{round(seconds / 60)} min"
