"""Pieces every page shares: the text/model/Run bar, export buttons and their one callback.

The Run bar of each page has its own ids (a page prefix), and writes the run into the URL; the
error banner and the download live in the app shell (``headscope.app.server``), so every page can use them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from dash import (
    ALL,
    ClientsideFunction,
    Input,
    Output,
    State,
    callback,
    clientside_callback,
    ctx,
    dcc,
    html,
    no_update,
    strip_relative_path,
)
from dash.exceptions import PreventUpdate

from headscope.analysis.capture import capture
from headscope.analysis.models import ModelError, load_model
from headscope.analysis.statistics_run import capture_for_page
from headscope.app import figures, ids
from headscope.app.context import get_context, offered_model
from headscope.app.errors import guarded
from headscope.app.export import FORMATS, bundle
from headscope.app.jobs import on_workers
from headscope.app.url_state import PageState, parse
from headscope.app.views import VIEWS, names

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


def text_id(prefix: str) -> str:
    return f"{prefix}-{ids.TEXT}"


def text_fill_id(prefix: str) -> str:
    """The store a page's render writes its run's text to; :func:`fill_text_from_runs` puts it in the
    text box without replacing what the user wrote (a render writing the box itself would)."""
    return f"{prefix}-{ids.TEXT}-fill"


def fill_text_from_runs(prefix: str) -> None:
    """Fill the page's text box from its render's store, in the browser (assets/text_fill.js): an
    empty box gets the run's text; text the user wrote there (neither empty nor what was last put
    there) is never replaced, whether they are still typing or have moved on."""
    clientside_callback(
        ClientsideFunction(namespace="headscope_text", function_name="fill"),
        Output(text_id(prefix), "value"),
        Input(text_fill_id(prefix), "data"),
        State(text_id(prefix), "id"),
        prevent_initial_call=True,
    )


def model_id(prefix: str) -> str:
    return f"{prefix}-{ids.MODEL}"


def run_id(prefix: str) -> str:
    return f"{prefix}-{ids.RUN_BUTTON}"


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


PROMPT_POLICY_TITLE = ("How a text becomes the model's tokens: a BOS the model expects is prepended and shown "
                       "as token 0, so positions are those the model saw; a model without a chat template "
                       "(a base model) reads plain prompts, and needle-in-a-haystack prompts end with 'Answer:'.")


def prompt_policy(spec: str) -> str:
    """The BOS and chat-template line of a model this server offers
    (:attr:`headscope.analysis.model_facts.ModelFacts.prompt_policy`); "" for any other spec (nothing is claimed
    about a model this server does not load)."""
    try:
        return load_model(offered_model(spec)).facts.prompt_policy
    except ModelError:
        return ""


def run_info(run: Any, layer: int, head: int, policy: str = "") -> html.Div:
    """The line of chips above a run's figures: run id, model, tokens, how it ran, mean loss, the
    model's BOS/template ``policy`` (:func:`prompt_policy`; left out when ""), the selected head."""
    loss = np.nanmean(run.token_loss) if run.n_tokens > 1 else float("nan")
    return html.Div(
        [
            html.Span(f"run {run.short_id}", className="hs-chip"),
            html.Span(run.model_name, className="hs-chip"),
            html.Span(f"{run.n_tokens} tokens", className="hs-chip"),
            *([html.Span(f"statistics mode (no patterns kept; {run.seconds:.1f} s)", className="hs-chip",
                         title="Attention ran through the statistics kernels: the grid, sink map and pooled "
                               "map come from per-row statistics; zoom into the map for exact values.")]
              if not run.has_patterns else []),
            html.Span(f"mean loss {loss:.3f}", className="hs-chip"),
            *([html.Span(policy, className="hs-chip", title=PROMPT_POLICY_TITLE)] if policy else []),
            html.Span(f"selected: layer {layer}, head {head}", className="hs-chip hs-selected"),
        ]
    )


def input_bar(prefix: str, placeholder: str = "Type or paste text to analyse…", model: Any = None) -> html.Div:
    """The text box, model menu and Run button. ``model``: the model the page's link names (its
    ``model=`` query), chosen in the menu from the first frame when the server offers it. Set later, by
    the page's render, a Run pressed at once would run the default model although the link names another."""
    context = get_context()
    chosen = model if isinstance(model, str) and model in context.allowed_models() else context.default_model
    return html.Div(
        [
            dcc.Textarea(id=text_id(prefix), placeholder=placeholder, className="hs-text", value=""),
            dcc.Store(id=text_fill_id(prefix)),
            html.Div(
                [
                    html.Label("Model", htmlFor=model_id(prefix)),
                    dcc.Dropdown(id=model_id(prefix), options=context.model_options(),
                                 value=chosen, clearable=False, className="hs-model"),
                    html.Button("Run", id=run_id(prefix), n_clicks=0, className="hs-run"),
                ],
                className="hs-controls",
            ),
        ],
        className="hs-input",
    )


def register_run(prefix: str, state_after: Any, keeps: tuple[str, ...], long_runs: bool = False) -> None:
    """Wire a page's Run button: capture (or load) the run, then write it into the URL.

    ``state_after(old_state, model, run) -> PageState`` says what the page shows next; ``keeps``
    names the URL keys of the settings it carries over, which keep what the user chose while the
    text ran (:func:`url_patch`). With
    ``long_runs`` a text longer than the patterns limit runs in statistics mode
    (:func:`headscope.analysis.statistics_run.capture_for_page`); without, it is refused with the limit.
    """

    show_in_shell(prefix)

    @callback(
        Output(url_patch_id(prefix), "data", allow_duplicate=True),  # into the URL as it is then
        job_error(prefix),  # with Redis this is a job: not the banner (see there)
        Input(run_id(prefix), "n_clicks"),
        State(text_id(prefix), "value"),
        State(model_id(prefix), "value"),
        State(url_id(prefix), "search"),
        **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
        prevent_initial_call=True,
    )
    @guarded(outputs=2)
    def run_text(n_clicks, text, model_spec, search):
        if not n_clicks:  # the page's layout arriving is not a click
            raise PreventUpdate
        context = get_context()
        model = load_model(offered_model(model_spec))  # the allowlist, never a path from the request
        if long_runs:
            run = capture_for_page(model, text or "", context.store, context.max_tokens)
        else:
            run = capture(model, text or "", store=context.store, max_tokens=context.max_tokens,
                          max_tokens_variable="HEADSCOPE_MAX_TOKENS")
        context.remember(run)
        return url_patch(search, state_after(parse(search), model, run).to_search(), keep=keeps), ""

    run_text.__name__ = f"run_text_{prefix}"


def export_bar(prefix: str, view: str) -> html.Div:
    return html.Div(
        [html.Span("Export", className="hs-export-label")]
        + [
            html.Button(fmt.upper(), id={"type": ids.EXPORT, "page": prefix, "view": view, "fmt": fmt},
                        className="hs-export-btn",
                        n_clicks=0, **{"data-export": f"{view}-{fmt}"},
                        title=f"Download the {VIEWS[names.split(view)[0]].title.lower()} as {fmt.upper()} with its data and manifest")
            for fmt in FORMATS
        ],
        className="hs-export-bar",
    )


def view_params(view: str, state: PageState, query: int | None = None) -> dict[str, Any]:
    """The parameters a view is drawn with, from the page state (what the page shows is what exports):
    each view declares how (:attr:`headscope.app.views.View.from_state`)."""
    name, which = names.split(view)
    if name not in VIEWS:
        raise PreventUpdate
    return VIEWS[name].from_state(state, query, which)


def _stored_run(state: PageState):
    return get_context().run(state.run) if state.run else None


def register_export(prefix: str, run_of: Any = _stored_run) -> None:
    """One callback per page: any export button → a zip of figure, data and manifest.

    ``run_of(state)`` gives the run the page's figures are drawn from (default: the URL's run).
    """

    show_in_shell(prefix)

    @callback(
        page_download(prefix),  # with Redis this is a job: not the app's download (see job_error)
        job_error(prefix),
        Input({"type": ids.EXPORT, "page": prefix, "view": ALL, "fmt": ALL}, "n_clicks"),
        url_state_when_present(prefix),  # the export buttons vanish with the page: see there
        State(query_store_id(prefix), "data", allow_optional=True),
        **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
        prevent_initial_call=True,
    )
    @guarded(outputs=2)
    def export(clicks, search, query):
        trigger = ctx.triggered_id
        if not isinstance(clicks, list) or not any(isinstance(c, int) and c > 0 for c in clicks):
            raise PreventUpdate
        view, fmt = (trigger.get("view"), trigger.get("fmt")) if isinstance(trigger, dict) else (None, None)
        if not isinstance(view, str) or names.split(view)[0] not in VIEWS or fmt not in FORMATS:
            raise PreventUpdate  # not one of the page's export buttons
        if isinstance(query, bool) or not isinstance(query, int):
            query = None  # the hovered token, when the page has one
        state = parse(search)
        run = run_of(state)
        if run is None and VIEWS[names.split(view)[0]].needs_run:
            return no_update, "Nothing to export yet: run something first."
        params = view_params(view, state, query)
        name, data = bundle(run, names.split(view)[0], params, fmt)
        return dcc.send_bytes(data, name), ""

    export.__name__ = f"export_{prefix}"


def upload_file_id(upload_id: str) -> str:
    """The store an upload's file reaches the server through, once its size is checked in the browser."""
    return f"{upload_id}-file"


def upload_field(upload_id: str, label: str) -> list:
    """A file upload that says so in the page when a file is too large.

    ``dcc.Upload``'s own ``max_size`` drops a larger file in the browser without a word, and a file
    over the request cap would be refused by the server (413) with nothing shown. So the browser
    takes any file, a clientside check compares its size with ``HEADSCOPE_MAX_UPLOAD_BYTES`` and
    either shows the limit in the error banner or passes ``{contents, filename}`` on to the store
    :func:`upload_file_id`, which the page's callback reads (with :func:`upload_text`). Register the
    check once per upload with :func:`register_upload`.
    """
    from headscope.analysis.limits import limit

    return [
        dcc.Upload(id=upload_id, children=html.Span(label), className="hs-upload", max_size=-1),
        dcc.Store(id=upload_file_id(upload_id)),
        dcc.Store(id=f"{upload_id}-limit", data=limit("HEADSCOPE_MAX_UPLOAD_BYTES")),
    ]


_CHECK_UPLOAD_SIZE = """
function(contents, filename, limit) {
    const skip = window.dash_clientside.no_update;
    if (!contents) { return [skip, skip]; }
    const b64 = contents.slice(contents.indexOf(",") + 1);
    const bytes = Math.floor(b64.length * 3 / 4) - (b64.endsWith("==") ? 2 : b64.endsWith("=") ? 1 : 0);
    if (bytes > limit) {
        const n = (x) => x.toLocaleString("en-US");
        return [skip, (filename || "The file") + " has " + n(bytes) + " bytes (the limit is " + n(limit) +
                      "; set HEADSCOPE_MAX_UPLOAD_BYTES to change it)."];
    }
    return [{contents: contents, filename: filename}, skip];
}
"""


def register_upload(upload_id: str) -> None:
    """The browser-side size check of :func:`upload_field` ``upload_id``."""
    clientside_callback(
        _CHECK_UPLOAD_SIZE,
        Output(upload_file_id(upload_id), "data"),
        Output(ids.ERROR, "children", allow_duplicate=True),
        Input(upload_id, "contents"),
        State(upload_id, "filename"),
        State(f"{upload_id}-limit", "data"),
        prevent_initial_call=True,
    )


def upload_file(file: Any, what: str) -> tuple[str, str]:
    """(text, name) of an upload's file as :func:`upload_file_id` holds it (``{"contents": base64 data
    URL, "filename": ...}``), or an ``InputError`` (see :func:`upload_text`)."""
    from headscope.analysis.errors import InputError

    contents = file.get("contents") if isinstance(file, dict) else None
    filename = file.get("filename") if isinstance(file, dict) else None
    name = filename[:200] if isinstance(filename, str) and filename else "The file"
    if not isinstance(contents, str):
        raise InputError(f"{name} could not be read: upload {what}.")
    return upload_text(contents, name, what), name


def upload_text(contents: str | None, filename: str | None, what: str) -> str:
    """The text of a dcc.Upload's ``contents`` (a base64 data URL), or an ``InputError`` saying why not:
    over ``HEADSCOPE_MAX_UPLOAD_BYTES``, not base64, not UTF-8, or empty. Uploads are content:
    nothing here is ever read as a path."""
    import base64
    import binascii

    from headscope.analysis.errors import InputError
    from headscope.analysis.limits import hint, limit

    name = filename or "The file"
    try:
        data = base64.b64decode((contents or "").split(",", 1)[1], validate=True)
    except (IndexError, binascii.Error, ValueError):
        raise InputError(f"{name} could not be read: upload {what}.") from None
    if len(data) > limit("HEADSCOPE_MAX_UPLOAD_BYTES"):
        raise InputError(f"{name} has {len(data):,} bytes {hint('HEADSCOPE_MAX_UPLOAD_BYTES')}.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputError(f"{name} is not UTF-8 text: upload {what}.") from None
    if "\x00" in text or not text.strip():
        raise InputError(f"{name} has no readable text: upload {what}.")
    return text


def query_store_id(prefix: str) -> str:
    """A page's selected query token (hovered, not in the URL: hovering must not re-render)."""
    return f"{prefix}-{ids.QUERY_STORE}"


def head_clicks(component: Any, action: dict[str, Any]) -> html.Div:
    """``component`` (a layer × head grid, or what wraps it) in a holder that says what a click on one of
    its cells does: ``action`` is :func:`select_head`, :func:`toggle_head` or :func:`ask_for_head`.
    ``assets/grid_clicks.js`` reads it from the holder's ``data-hs-click`` when a click lands in the
    grid's plot area, so a page declares its clickable grids where it lays them out."""
    return html.Div(component, **{"data-hs-click": json.dumps(action, separators=(",", ":"))})


def select_head(graph: str, prefix: str, drop: Sequence[str] = (),
                when: dict[str, Sequence[str | None]] | None = None) -> dict[str, Any]:
    """A click on a cell of ``graph`` selects that head in the page's URL (its Location, :func:`url_id`
    of ``prefix``), as a link would, and removes the URL keys in ``drop`` (what a new head resets); only
    while each key of ``when`` has one of its values (None: the key is absent)."""
    return {"do": "select", "graph": graph, "url": url_id(prefix), "drop": list(drop),
            "when": {key: list(values) for key, values in (when or {}).items()}}


def toggle_head(graph: str, pending: str, box: str) -> dict[str, Any]:
    """A click on a cell of ``graph`` adds that head to the selection in the store ``pending``, or removes
    it, and writes the selection into the heads box ``box`` and onto the map (its
    :data:`headscope.app.figures.CHOSEN_TRACE` markers and the count in its title), in the browser."""
    return {"do": "toggle", "graph": graph, "pending": pending, "box": box, "marks": figures.CHOSEN_TRACE}


def ask_for_head(graph: str, store: str) -> dict[str, Any]:
    """A click on a cell of ``graph`` puts ``{"layer", "head", "click"}`` into the store ``store`` (the
    click count makes the same head clicked again a new request); not on a map whose cells are
    positions (``layout.meta.cells == "positions"``)."""
    return {"do": "ask", "graph": graph, "store": store}
