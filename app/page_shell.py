"""How a page is wired to its URL and to the app shell: its own Location and the store its jobs' URL
changes go through (:func:`url_patch`), the stores its jobs' errors and downloads reach the shell's banner and
download through, the keys of its URL a figure is drawn from, and the empty figure a page starts with."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from dash import (
    ClientsideFunction,
    Input,
    Output,
    State,
    clientside_callback,
    dcc,
    html,
    strip_relative_path,
)

from headscope.app import ids
from headscope.app.url_state import parse

GRAPH_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "svg"}}


def empty_figure(text: str = "Run a text to see every head.") -> dict:
    return {"data": [], "layout": {"xaxis": {"visible": False}, "yaxis": {"visible": False}, "height": 300,
                                   "annotations": [{"text": text, "showarrow": False,
                                                    "font": {"size": 14, "color": "#888"}}]}}


def url_id(prefix: str) -> str:
    return f"{prefix}-{ids.URL}"


def url_state_when_present(prefix: str) -> State:
    """The page's URL as the State of a callback whose Input is a pattern (``ALL``) over the page's own
    components. Leaving the Attention page by a nav link removes its export buttons, and Dash fires
    the export callback once more (the pattern's set changes) after the page's Location has gone with
    them: a plain State would raise "A nonexistent object was used in an `State`" in the browser
    console. Optional, it arrives as None and the callback does nothing (no button was clicked). (The
    Flow page's target callback, also a pattern, is not fired so: its State stays plain.)"""
    return State(url_id(prefix), "search", allow_optional=True)


def page_location(prefix: str) -> html.Div:
    """Each page has its own Location, so its callbacks only run while it is shown, and beside it the
    store its background jobs write their change of the URL to (:func:`url_patch`).

    ``refresh=False``: a page writing its state into the URL pushes history without telling Dash
    Pages' router, so the page is not rebuilt on every change (a rebuild while a background job
    runs would lose the job's result, and reset what the user has typed). Links and the back button
    still go through the router.
    """
    return html.Div([dcc.Location(id=url_id(prefix), refresh=False), dcc.Store(id=url_patch_id(prefix))])


def url_patch_id(prefix: str) -> str:
    return f"{prefix}-hs-url-patch"


def url_patch(before: Any, after: str, on: tuple[str, ...] = (), what: str = "This result",
              keep: tuple[str, ...] | None = None, reset: tuple[str, ...] = (), status: str | None = None) -> dict:
    """What a background job answers into :func:`url_patch_id` instead of the page's URL: the URL it
    read when it started (``before``) and the one it made of it (``after``). The browser
    (assets/url_patch.js) puts the job's change into the URL as it is when the job ends, so what the
    user chose while it ran (another score, a method, a new text) stays. A job answering the whole URL
    it read would put back what it was when the job started: a new text run during an Apply would
    return to the text the Apply started on, a score chosen meanwhile to the score it started with.

    - By default the keys that differ between ``before`` and ``after`` are set or removed; ``before``
      is compared as :func:`headscope.app.url_state.parse` reads it (a default value written out, or an id in
      capitals, is no change). ``reset``: keys set to ``after``'s value (or removed) whatever
      ``before`` held: what the result makes meaningless (a policy picked on the curve it replaces).
    - ``keep``: ``after`` is a new page state (a new text), taken whole except the settings in
      ``keep``, which stay as the user changed them meanwhile (a score, a head); what belonged to the
      replaced text (a query position, a flow target) goes, even if chosen meanwhile.
    - ``on``: the URL keys the result was computed on (``"run"``). If the page shows another value of
      one of them by then, nothing is put in and the banner says so, naming the result by ``what``;
      ``status``, the id of the job's status line (an element with ``role="status"``: the only kind
      a patch may write to), says it was not shown instead of the result's numbers, which the job
      answered with before it could know."""
    started = before if isinstance(before, str) else ""
    patch = {"started": started, "before": parse(started).to_search(), "after": after, "on": list(on),
             "keep": None if keep is None else list(keep), "reset": list(reset), "what": what,
             "at": time.time()}  # a new value every time: the same change twice is written twice
    if status is not None:
        patch["status"] = status
    return patch


def leaving(pathname, page_path: str) -> bool:
    """Whether the page's own Location (:func:`page_location`) shows another page's path: a nav link
    is taking the user away. Every Location hears the link, so the page being left sees its URL
    change and its callbacks run once more while the router fetches the next page; what they answer
    arrives after that page has replaced them (a whole value is then dropped, a patch is an error)."""
    if not isinstance(pathname, str):
        return False
    try:
        here = strip_relative_path(pathname)  # without the app's path prefix, if it is served under one
    except Exception:  # noqa: BLE001 - no app yet, or a path outside its prefix: compared as it is
        here = pathname
    return (here or "").strip("/") != page_path.strip("/")


def job_error_id(prefix: str) -> str:
    return f"{prefix}-hs-job-error"


def download_id(prefix: str) -> str:
    return f"{prefix}-hs-download"


def job_error(prefix: str) -> Output:
    """The output a page's callback writes its error message to (``""`` clears the banner), when the
    callback is a job or expensive (every :func:`headscope.app.jobs.on_workers` callback: with Redis, a job too).

    Not the banner itself: a background callback that writes to the app shell is called by Dash
    whenever its page loads, ``prevent_initial_call`` or not, because its inputs and outputs are not in
    one layout chunk (plotly/dash#2369). Each page load would then fork a job, and the page's Run
    button would stay disabled until it came back (seconds on a loaded machine), so a click right after
    the page appeared would be lost; with Redis workers each page load would queue a job per such
    callback (Run, export, sinks, ...).
    The message goes into a store on the page (:func:`shell_stores`), and :func:`show_in_shell`
    copies it into the banner in the browser."""
    return Output(job_error_id(prefix), "data", allow_duplicate=True)


def page_download(prefix: str) -> Output:
    """The output a page's callback writes a download to (``dcc.send_bytes``), copied into the app's
    ``dcc.Download`` in the browser: not that component itself, for :func:`job_error`'s reason."""
    return Output(download_id(prefix), "data", allow_duplicate=True)


def shell_stores(prefix: str) -> html.Div:
    """The page's stores for :func:`job_error` and :func:`page_download`: put them in the page's layout."""
    return html.Div([dcc.Store(id=job_error_id(prefix)), dcc.Store(id=download_id(prefix))], hidden=True)


_SHOWN: set[str] = set()


def show_in_shell(prefix: str) -> None:
    """Copy the page's errors into the app's banner and its downloads into the app's download, and put
    its jobs' URL changes (:func:`url_patch`) into its URL, in the browser. Registered once per page,
    however many of its callbacks ask (Run, export, jobs)."""
    if prefix in _SHOWN:
        return
    _SHOWN.add(prefix)
    copy = "function (m) { return m === null || m === undefined ? window.dash_clientside.no_update : m; }"
    clientside_callback(copy, Output(ids.ERROR, "children", allow_duplicate=True),
                        Input(job_error_id(prefix), "data"), prevent_initial_call=True)
    clientside_callback(copy, Output(ids.DOWNLOAD, "data", allow_duplicate=True),
                        Input(download_id(prefix), "data"), prevent_initial_call=True)
    clientside_callback(ClientsideFunction(namespace="headscope_url", function_name="apply"),
                        Output(url_id(prefix), "search", allow_duplicate=True),
                        Output(ids.ERROR, "children", allow_duplicate=True),
                        Input(url_patch_id(prefix), "data"), State(url_id(prefix), "search"),
                        prevent_initial_call=True)


def register_url_keys(prefix: str, name: str, keys: Sequence[str]) -> str:
    """The id of a store that holds the values of ``keys`` in the page's URL and changes only when one
    of them does (assets/url_keys.js); put ``dcc.Store(id=...)`` in the page's layout. A callback drawn
    from it runs when its figures' keys change, not on every change of the URL (a head click does not
    redraw what does not show the head)."""
    store = f"{prefix}-hs-keys-{name}"
    clientside_callback(
        f"(search, current) => window.dash_clientside.headscope_keys.pick(search, current, {json.dumps(list(keys))})",
        Output(store, "data"), Input(url_id(prefix), "search"), State(store, "data"))
    return store


def query_store_id(prefix: str) -> str:
    """A page's selected query token (hovered, not in the URL: hovering must not re-render)."""
    return f"{prefix}-{ids.QUERY_STORE}"
