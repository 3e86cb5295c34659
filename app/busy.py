"""A long action shown as busy, the same way on every page (assets/busy.js): the caption from a job's
click to its first report, and the mark on a figure that a running job will replace."""

from __future__ import annotations

import json
from collections.abc import Sequence

from dash import Input, Output, State, clientside_callback

from headscope.app import ids

STARTING = "Starting…"
"""A job's caption from its button's click to its first progress report (:func:`show_busy`)."""


STALE = "--hs-stale"
"""The flag in a graph's style that marks its figure out of date while a job that replaces it runs
(faded and captioned: assets/headscope.css). A style, not a class: a dcc.Graph re-renders for a new
figure, id or style only."""


def show_busy(button: str, status: str, progress: str | None = None, figures: Sequence[str] = ()) -> None:
    """Show a long action as busy, the same way on every page (assets/busy.js): while ``button`` is
    disabled because the action's job runs (the callback's ``running``), the ``status`` line says the
    job is starting (:data:`STARTING`) until its first report, the ``progress`` bar runs
    without a value, and each of ``figures`` (graph ids) is marked :data:`STALE`; when the button is
    enabled again the marks go. If a click of ``button`` started the job, the error banner is cleared
    (its message is about an earlier try); a job that a link starts by itself leaves the link's
    message. A cancellable job gets this from :func:`headscope.app.jobs.cancellable_callback`; a page's
    background render calls it with its own button."""
    outputs = [Output(ids.ERROR, "children", allow_duplicate=True), Output(status, "children", allow_duplicate=True)]
    if progress is not None:
        outputs.append(Output(progress, "value", allow_duplicate=True))
    outputs += [Output(figure, "style", allow_duplicate=True) for figure in figures]
    clientside_callback(
        f"(busy, status, clicked, ...styles) => window.dash_clientside.headscope_busy.state(busy, status, styles, "
        f"clicked, {json.dumps(button)}, {json.dumps(STARTING)}, {'true' if progress is not None else 'false'})",
        *outputs, Input(button, "disabled"), State(status, "children"), State(button, "n_clicks_timestamp"),
        *[State(figure, "style") for figure in figures], prevent_initial_call=True)
