"""Background jobs through Dash's own background-callback managers (no queue of our own).

Embedded (default): ``DiskcacheManager`` — each job runs in a process forked from the server, so it
shares the already-loaded model's memory; its progress and result pass through a disk cache under
``HEADSCOPE_HOME``. Results that matter land in the store, so a reload or a second tab finds them.

With ``HEADSCOPE_REDIS_URL`` set: Dash's ``CeleryManager`` (:mod:`app.workers`) — the same
callbacks run on Celery workers started with ``headscope worker``, and the web process loads no
model: every callback that loads a model or reads analysis results is a background callback then
(:func:`on_workers`), so it runs on a worker too.

Forked children must run torch single-threaded: PyTorch's CPU thread pool does not survive a fork
(a child that uses more than one intra-op thread hangs). :func:`in_job` does that first.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

_manager = None


def cancellable_job(run: str, cancel: str, progress: str, status: str) -> dict[str, Any]:
    """The keyword arguments of a cancellable background callback: progress bar ``progress`` with its
    caption ``status``, the ``run`` button disabled and the ``cancel`` button enabled while it runs."""
    from dash import Input, Output

    return {
        "background": True,
        "progress": [Output(progress, "value"), Output(progress, "max"), Output(status, "children")],
        "running": [(Output(run, "disabled"), True, False), (Output(cancel, "disabled"), False, True)],
        "cancel": [Input(cancel, "n_clicks")],
    }


def on_workers(interval_ms: int = 250) -> dict[str, Any]:
    """Keyword arguments for a callback that loads a model or reads analysis results: with
    ``HEADSCOPE_REDIS_URL`` set it becomes a background callback, run by a worker (polled every
    ``interval_ms``); embedded, nothing changes and it runs in the server as before."""
    from app.workers import redis_url

    return {"background": True, "interval": interval_ms} if redis_url() else {}


def background_manager():
    """The process-wide background-callback manager (created on first use): Celery workers when
    ``HEADSCOPE_REDIS_URL`` is set, else a disk cache and processes forked from the server."""
    global _manager
    if _manager is None:
        from app.workers import job_manager, redis_url

        if redis_url():
            _manager = job_manager()
            return _manager
        import diskcache
        from dash import DiskcacheManager

        from analysis.paths import home

        cache = diskcache.Cache(str(home() / "jobs"))
        _manager = DiskcacheManager(cache, expire=24 * 3600)
    return _manager


def in_job() -> None:
    """Call first in a background job: makes torch safe to use in a forked process."""
    import torch

    if os.getpid() != _SERVER_PID:
        torch.set_num_threads(1)


_SERVER_PID = os.getpid()


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
