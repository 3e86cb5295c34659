"""The registry of named views and what every view shares: a run (or stored results) plus
parameters → a figure and the table of numbers behind it.

Each view module (one per page in ``app/pages/``) declares its views where they are defined, with
:func:`register`; this module imports none of them (``app/views/__init__.py`` does), so there is no
import circle. The page, the export bundles and ``headscope figure MANIFEST`` all go through
:data:`VIEWS`, so a figure regenerated from a manifest is built by exactly the code that drew it in
the browser.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go

from headscope.analysis.errors import InputError, check_head_index
from headscope.analysis.runs import AttentionRun
from headscope.analysis.score_registry import RUN_SCORES

Rows = list[dict[str, Any]]
Build = Callable[[Any, dict[str, Any]], tuple[go.Figure, Rows]]
FromState = Callable[[Any, "int | None", str], dict[str, Any]]
"""``(page state, hovered query or None, variant) → params``: what a page shows is what exports."""


@dataclass(frozen=True)
class View:
    """A named view.

    ``params`` names the parameters the view reads; ``from_state`` builds them from a page's URL
    state (it may add more: a page's views share one set, and manifests record what was passed).
    ``needs_run`` False: drawn from the model and stored results named in the params, not a run.
    """

    name: str
    title: str
    build: Build
    params: tuple[str, ...]
    from_state: FromState
    needs_run: bool = True


VIEWS: dict[str, View] = {}


def register(name: str, title: str, params: tuple[str, ...], from_state: FromState,
             needs_run: bool = True) -> Callable[[Build], Build]:
    """Decorator: register the decorated builder as view ``name`` (a constant of :mod:`headscope.app.views.names`)."""

    def add(build: Build) -> Build:
        if name in VIEWS:
            raise ValueError(f"view {name!r} is registered twice")
        VIEWS[name] = View(name, title, build, tuple(params), from_state, needs_run)
        return build

    return add


def check_head(run: AttentionRun, layer: Any, head: Any) -> tuple[int, int]:
    """Validated (layer, head) for ``run``; a clear ``InputError`` otherwise."""
    return check_head_index(run.n_layers, run.n_heads, layer, head)


def check_metric(metric: Any) -> str:
    """``metric`` when it is a score of one text (:data:`headscope.analysis.score_registry.RUN_SCORES`)."""
    if not isinstance(metric, str) or metric not in RUN_SCORES:
        raise InputError(f"Unknown metric {str(metric)[:40]!r}; choose one of: {', '.join(RUN_SCORES)}.")
    return metric


_memo: OrderedDict[tuple, Any] = OrderedDict()
_memo_lock = threading.Lock()


def _fresh_lock_in_child() -> None:
    global _memo_lock
    _memo_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def memoised(key: tuple, compute: Callable[[], Any]) -> Any:
    """Results of analyses on stored runs, kept for the last few requests (pages re-render often)."""
    with _memo_lock:
        if key in _memo:
            _memo.move_to_end(key)
            return _memo[key]
    value = compute()
    with _memo_lock:
        _memo[key] = value
        while len(_memo) > 64:
            _memo.popitem(last=False)
    return value


def metric_scores(run: AttentionRun, metric: str) -> np.ndarray:
    """``[layer, head]`` scores of ``metric`` on ``run`` (:meth:`headscope.analysis.runs.AttentionRun.head_scores`:
    from patterns, or from statistics for a long run)."""
    metric = check_metric(metric)
    return memoised((run.key, "metric", metric), lambda: run.head_scores(metric))
