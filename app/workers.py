"""Celery workers for the app's background callbacks, when ``HEADSCOPE_REDIS_URL`` names a Redis server.

One web front end and any number of workers share one Redis: it is the Celery broker (the job
queue), Celery's result backend (where Dash's ``CeleryManager`` keeps each job's progress and
result, JSON only) and the shared record store (:mod:`headscope.analysis.shared_records`). Dash registers
every background callback as a Celery task when the app is created, so a worker creates the same
Dash app as the web process and then runs Celery's worker on it: no queue of our own.

Pool: Celery's *prefork* pool. The worker loads its models in the parent process *before* the pool
forks, so every pool process shares the weights copy-on-write and no model is loaded twice at once;
the at-fork handlers of :mod:`headscope.analysis.models` and :mod:`headscope.analysis.store` give each pool process
fresh locks, no stray hooks, one torch thread and its own SQLite connections. A model a job asks
for that the parent did not preload is loaded by that pool process (within
``HEADSCOPE_MODEL_MEMORY_MB``, least recently used first). CUDA cannot cross a fork: with a
``cuda`` device nothing is preloaded and each pool process loads on first use (run one worker per
GPU with ``--concurrency 1``).

Losing a worker: tasks are acknowledged late and retried when the pool process running them dies
(``task_retry_on_worker_lost``, at most :data:`MAX_RETRIES` times, then the job is marked failed and
the page says so). A whole worker host that dies leaves its job unacknowledged in Redis; Redis hands
it to another worker after ``HEADSCOPE_JOB_VISIBILITY_S`` (default one hour).

Two queues, so one user's long job never blocks another user's page: jobs with a progress bar
(sweeps, curves, evaluations, embeddings) go to the ``jobs`` queue, the short callbacks that draw
pages (:func:`headscope.app.jobs.on_workers`) to ``pages``. ``headscope worker`` (:func:`headscope.app.server.start_worker`)
forks, after loading its models, one Celery worker per queue: ``--concurrency`` pool processes for jobs and
``--page-concurrency`` (default 1) for pages.

Cancel: Dash's ``CeleryManager`` revokes the task with ``terminate=True``; the prefork pool sends
SIGTERM to the process running it, which stops at once, and the pool forks a fresh one.

Losing Redis: a job that cannot be queued, or whose progress or result cannot be read back, ends on
its page with :data:`QUEUE_UNREACHABLE` in the banner (:class:`NotStarted`, :func:`ended`). Inside Dash
the error would end the page's wait with an empty answer (204) and no word.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
from collections import OrderedDict
from functools import wraps

log = logging.getLogger("headscope.jobs")

MAX_RETRIES = 2  # a job whose pool process dies is run again at most this many times
REDIS_TIMEOUT_S = 20  # seconds a poll waits for an answer from Redis before it says Redis is not reachable
QUEUE_UNREACHABLE = ("The job queue (Redis) is not reachable, so this job cannot be started or followed. Check "
                     "that Redis runs and that this server reaches it (HEADSCOPE_REDIS_URL), then run it again; "
                     "results finished before are reused.")
JOBS, PAGES = "jobs", "pages"  # the two queues
_queues: dict[str, str] = {}  # Celery task name → queue, filled as Dash registers callbacks


def worker_context(store, models: list[str]):
    """The app context of a worker: page callbacks run here and check requested models against it,
    so every ``--model`` it was given is on offer (its first is the default), not only the first."""
    from headscope.app.context import AppContext  # loads torch: `headscope worker` checks Redis before that

    return AppContext(store=store, default_model=models[0], extra_models=list(models[1:]))


def _route(name, args, kwargs, options, task=None, **kw):
    """Celery router: the queue of a background callback's task (jobs with progress, or pages)."""
    return {"queue": _queues.get(name, JOBS)}


def redis_url() -> str | None:
    """``HEADSCOPE_REDIS_URL`` (e.g. ``redis://127.0.0.1:6379/0``), or None: embedded mode."""
    return os.environ.get("HEADSCOPE_REDIS_URL", "").strip() or None


def visibility_timeout_s() -> int:
    """Seconds after which Redis gives an unacknowledged job (its worker host died) to another worker."""
    try:
        return max(60, int(float(os.environ.get("HEADSCOPE_JOB_VISIBILITY_S", "3600"))))
    except ValueError:
        return 3600


_celery = None


def celery_app():
    """The process-wide Celery app on ``HEADSCOPE_REDIS_URL`` (broker and result backend)."""
    global _celery
    if _celery is None:
        from celery import Celery

        url = redis_url()
        if url is None:
            raise RuntimeError("HEADSCOPE_REDIS_URL is not set: there are no Celery workers to use.")
        app = Celery("headscope", broker=url, backend=url)
        app.conf.update(
            # JSON only, both ways: nothing is unpickled from the broker or the backend
            task_serializer="json", result_serializer="json",
            accept_content=["json"], result_accept_content=["json"],
            # a job is acknowledged when it ends, so a lost pool process's job is run again
            task_acks_late=True,
            task_retry_on_worker_lost=True,
            task_annotations={"*": {"max_retries": MAX_RETRIES, "default_retry_delay": 0}},
            task_track_started=True,
            task_routes=(_route,),
            # one job at a time per pool process: a free worker takes the next job, not a busy one
            worker_prefetch_multiplier=1,
            broker_transport_options={"visibility_timeout": visibility_timeout_s()},
            result_backend_transport_options={"visibility_timeout": visibility_timeout_s()},
            result_expires=24 * 3600,
            broker_connection_retry_on_startup=True,
            # a Redis that stops answering (paused, a dead host) ends a poll's wait with a message after
            # this long, not Celery's two minutes; Redis on a loaded machine still answers in well under it
            redis_socket_timeout=REDIS_TIMEOUT_S, redis_socket_connect_timeout=REDIS_TIMEOUT_S,
        )
        _celery = app
    return _celery


class OneKeyPerJob:
    """A background-callback manager mixin: every job its own result key.

    Dash keys a job's result and progress by its callback and arguments. Two sessions that start the
    same callback with the same arguments at once (ten pages loading the same text) would share one
    key: the first page to poll takes the result and deletes it, the other job's result lands under a
    key nobody waits on, and the second page waits for ever or is told its job has stopped.
    No callback here relies on Dash's memoisation (``cache_by`` is never set), so a random suffix
    costs nothing."""

    def build_cache_key(self, fn, args, cache_args_to_ignore, triggered):
        return f"{super().build_cache_key(fn, args, cache_args_to_ignore, triggered)}-{secrets.token_hex(8)}"


def ended(text: str) -> dict:
    """What a poll of a job that ended without a result answers: Dash's background-callback error, which
    the page shows in its banner (:func:`headscope.app.server.show_error`); ``text`` is one line."""
    return {"background_callback_error": {"msg": text, "tb": ""}}


class NotStarted:
    """Jobs that could not be started (the system refused the fork, the queue is down), by result key.

    Dash hands its error handler an exception raised while it starts a background job, then drops what the
    handler shows (a background start answers only with the job's handles) and answers 204: the page
    stops waiting and says nothing. A manager therefore answers such a start with a handle of its own
    (:meth:`add`) and the job's first poll with why it did not start (:meth:`pop`)."""

    PREFIX = "not-started-"
    LIMIT = 10_000  # keys whose page never polled (closed meanwhile) are forgotten, oldest first

    def __init__(self) -> None:
        self._why: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, key: str, why: str) -> str:
        """Remember why the job of result key ``key`` did not start; return the handle to answer with."""
        with self._lock:
            self._why[key] = why
            while len(self._why) > self.LIMIT:
                self._why.popitem(last=False)
        return f"{self.PREFIX}{secrets.token_hex(8)}"

    def pop(self, key: str) -> str | None:
        with self._lock:
            return self._why.pop(key, None)

    @classmethod
    def handle(cls, job) -> bool:
        """Whether ``job`` is a handle :meth:`add` gave out (nothing runs under it)."""
        return str(job).startswith(cls.PREFIX)


def queue_down(error: BaseException) -> bool:
    """Whether ``error`` says Redis is down or unreachable: a connection error of redis-py or kombu, or
    one Celery raised another error from (its result consumer gives up with a ``RuntimeError``)."""
    import kombu.exceptions
    import redis.exceptions

    down = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, kombu.exceptions.OperationalError,
            OSError)
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, down):
            return True
        error = error.__cause__ or error.__context__
    return False


def job_manager():
    """Dash's ``CeleryManager`` over :func:`celery_app`, with three additions (:class:`_Jobs`,
    :class:`OneKeyPerJob`)."""
    from dash import CeleryManager

    class _Jobs(OneKeyPerJob, CeleryManager):
        """Dash's Celery manager, plus: a job whose task failed outside the callback (its pool process
        was lost more than :data:`MAX_RETRIES` times) ends with a message instead of spinning; a
        job that has delivered its result is not terminated afterwards (Dash revokes every finished
        job with ``terminate=True``; if the task is still closing, that would kill its process); and
        with Redis down, a job that cannot be queued or followed ends with :data:`QUEUE_UNREACHABLE`
        (module docstring)."""

        def __init__(self, celery):
            super().__init__(celery, expire=24 * 3600)
            self._delivered: OrderedDict[str, None] = OrderedDict()
            self._delivered_lock = threading.Lock()
            self._not_started = NotStarted()

        def make_job_fn(self, fn, progress, key=None):
            _queues[f"background_callback_{key}"] = JOBS if progress else PAGES
            return super().make_job_fn(_logged(fn), progress, key)

        def call_job_fn(self, key, job_fn, args, context):
            # Redis is asked first: with it down, Celery's result consumer retries for 20 s before it gives
            # up, and the page would wait that long for the same message
            try:
                self.handle.backend.client.ping()
                return super().call_job_fn(key, job_fn, args, context)
            except Exception as e:
                if not queue_down(e):
                    raise
                log.error("a job could not be queued: Redis is not reachable (%s)", str(e).strip()[:300])
                return self._not_started.add(key, QUEUE_UNREACHABLE)

        def get_result(self, key, job):
            why = self._not_started.pop(key)
            if why is not None:
                return ended(why)
            try:
                return self._result(key, job)
            except Exception as e:  # Dash would answer 204 and the page would wait in silence
                if queue_down(e):
                    log.error("job %s: its result cannot be read: Redis is not reachable (%s)", job, e)
                    return ended(QUEUE_UNREACHABLE)
                log.exception("job %s: its result could not be read", job)
                return ended(f"The job's result could not be read ({type(e).__name__}). Run it again; the "
                             "server log has the details.")

        def _result(self, key, job):
            result = self.handle.backend.get(key)
            if result is not None and job:
                with self._delivered_lock:
                    self._delivered[job] = None
                    while len(self._delivered) > 10_000:
                        self._delivered.popitem(last=False)
            result = super().get_result(key, job)
            if result is self.UNDEFINED and job:
                task = self.get_task(job)
                if task is not None and task.state == "FAILURE":
                    return ended(f"The job failed on its worker ({task.result!r}). Run it again; results "
                                 "finished before the failure are reused.")
            return result

        def get_progress(self, key):
            # read and removed in one step (MULTI/EXEC), as in app.jobs: Dash's get, then delete, would lose
            # a report the job writes between the two. Redis down: no report (the result says why).
            progress_key = self._make_progress_key(key)
            try:
                with self.handle.backend.client.pipeline() as pipe:
                    data, _ = pipe.get(progress_key).delete(progress_key).execute()
                return json.loads(data) if data else None
            except Exception as e:  # a poll must answer; the result's read says why
                log.warning("a job's progress could not be read: %s", e)
                return None

        def job_running(self, job):
            if NotStarted.handle(job):
                return False
            try:
                return super().job_running(job)
            except Exception as e:  # the result's read has said why
                log.warning("job %s: whether it runs could not be read: %s", job, e)
                return False

        def get_updated_props(self, key):
            try:
                return super().get_updated_props(key)
            except Exception as e:  # as in get_progress
                log.warning("a job's page updates could not be read: %s", e)
                return {}

        def terminate_job(self, job):
            if NotStarted.handle(job):
                return None
            with self._delivered_lock:
                if job in self._delivered:
                    return None
            try:
                return super().terminate_job(job)
            except Exception as e:
                if not queue_down(e):
                    raise
                # nothing reaches the workers now: the job's poll says the queue is down
                log.error("job %s could not be stopped: Redis is not reachable (%s)", job, e)
                return None

    return _Jobs(celery_app())


def _logged(fn):
    """Log a job's start and end with the callback's name, host and pid (what ran where)."""

    @wraps(fn)
    def job(*args, **kwargs):
        from dash.exceptions import PreventUpdate

        where = f"{socket.gethostname()} pid {os.getpid()}"
        log.info("job %s started in %s", fn.__name__, where)
        try:
            result = fn(*args, **kwargs)
        except PreventUpdate:  # e.g. a Run button's callback fired as its page's layout arrived
            log.info("job %s skipped in %s (nothing to do)", fn.__name__, where)
            raise
        log.info("job %s finished in %s", fn.__name__, where)
        return result

    return job
