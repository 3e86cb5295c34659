"""Page "Attention": text → every head's summary grid → one head's heatmap and token strip.

Data flows one way: the Run button and clicks write the URL; one callback renders everything from
the URL (the sink map, once per run, follows from a second), so a copied link reopens the same view.
Hovering only recolours the token strip in the browser (assets/attention.js).
"""

from __future__ import annotations

import functools
import logging

import dash
import numpy as np
import plotly.graph_objects as go
from _plotly_utils.utils import to_typed_array_spec
from dash import (
    ClientsideFunction,
    Input,
    Output,
    Patch,
    State,
    callback,
    clientside_callback,
    dcc,
    html,
    no_update,
)
from dash.exceptions import PreventUpdate

from headscope.analysis.errors import InputError
from headscope.analysis.models import ModelError, load_model
from headscope.analysis.qk_cell import cell_attribution, grouped_by_layer, prefetch
from headscope.analysis.score_registry import HEAD_SCORES, RUN_SCORES, unavailable
from headscope.analysis.statistics_run import capture_for_page
from headscope.app import figures, ids
from headscope.app.context import dropdown_model, get_context, offered_model
from headscope.app.errors import USER_ERRORS, guarded, message
from headscope.app.export_bar import export_bar, register_export
from headscope.app.grid_clicks import head_clicks, select_head
from headscope.app.jobs import cancellable_callback, in_job, on_workers, progress_reporter
from headscope.app.page_shell import (
    GRAPH_CONFIG,
    empty_figure,
    job_error,
    leaving,
    page_location,
    query_store_id,
    shell_stores,
    show_in_shell,
    url_id,
    url_patch,
    url_patch_id,
)
from headscope.app.run_bar import (
    fill_text_from_runs,
    input_bar,
    model_id,
    run_id,
    run_info,
    text_fill_id,
    text_id,
)
from headscope.app.url_state import AttentionState, PageState, parse
from headscope.app.views import VIEWS, names
from headscope.app.views.circuits import qk_cell_figure

log = logging.getLogger(__name__)

PAGE_PATH = "/"
dash.register_page(__name__, path=PAGE_PATH, name="Attention", title="headscope — attention", order=0)

PREFIX = "attn"
EMPTY = empty_figure()
CANCEL = f"{PREFIX}-hs-cancel"
PROGRESS = f"{PREFIX}-hs-progress"
STATUS = f"{PREFIX}-hs-status"
SINKS_RUN = f"{PREFIX}-hs-sinks-run"  # the run the sink map and token strip show: a head click does not redraw them
STRIP_DATA = f"{PREFIX}-hs-strip-data"  # the token-strip figure the HTML strip is drawn from
# "run|metric|layer|head|query" the grid, heatmap and strip show (a head click patches them), or while
# the grid is Run's preview "preview|run|metric|layer|head" (_preview_mark); null: draw whole figures next
DRAWN = f"{PREFIX}-hs-drawn"
PREVIEW = f"{PREFIX}-hs-grid-preview"  # Run's grid figure, sent by its job while the run is being stored (_grid_preview)
HIDDEN = {"display": "none"}
WHY = f"{PREFIX}-hs-why"  # the "why" panel of the clicked heatmap cell (hidden while no cell is open)
WHY_GRAPH = f"{PREFIX}-hs-why-graph"
WHY_CHECK = f"{PREFIX}-hs-why-check"  # "terms sum to s_ij = … (the model's own score …)"
WHY_MESSAGE = f"{PREFIX}-hs-why-message"  # what was wrong with the cell asked for (outside the hidden panel)
WHY_GROUP = f"{PREFIX}-hs-why-group"
WHY_SHOWN = f"{PREFIX}-hs-why-shown"  # "run|layer|head|query|key|group" the panel shows


def layout(**query) -> html.Div:
    return html.Div(
        [
            page_location(PREFIX),
            shell_stores(PREFIX),
            dcc.Store(id=query_store_id(PREFIX)),
            dcc.Store(id=SINKS_RUN),
            dcc.Store(id=STRIP_DATA),
            dcc.Store(id=DRAWN),
            dcc.Store(id=PREVIEW),
            input_bar(PREFIX, model=query.get("model")),
            html.Div(
                [
                    html.Progress(id=PROGRESS, value="0", max="100", className="hs-progress"),
                    html.Span(id=STATUS, className="hs-hint", role="status"),
                    html.Button("Cancel", id=CANCEL, n_clicks=0, disabled=True, className="hs-button hs-cancel"),
                ],
                className="hs-options hs-run-progress",
            ),
            dcc.Loading(html.Div(id=ids.RUN_INFO, className="hs-run-info"), type="dot"),
            html.Div(
                [
                    html.Div(
                        [
                            html.Div(
                                [
                                    html.Label("Per-head metric", htmlFor=ids.METRIC),
                                    dcc.Dropdown(
                                        id=ids.METRIC,
                                        options=[{"label": HEAD_SCORES[name].label, "value": name,
                                                  "title": HEAD_SCORES[name].description} for name in RUN_SCORES],
                                        value="entropy", clearable=False,
                                    ),
                                ],
                                className="hs-metric",
                            ),
                            head_clicks(_busy(dcc.Graph(id=ids.GRID, figure=EMPTY, config=GRAPH_CONFIG)),
                                        select_head(ids.GRID, PREFIX, drop=("query",))),
                            export_bar(PREFIX, names.HEAD_GRID),
                        ],
                        className="hs-panel hs-grid-panel",
                    ),
                    html.Div(
                        [_busy(dcc.Graph(id=ids.HEATMAP, figure=EMPTY, config=GRAPH_CONFIG)),
                         export_bar(PREFIX, names.ATTENTION)],
                        className="hs-panel hs-heatmap-panel",
                    ),
                ],
                className="hs-panels",
            ),
            _why_panel(),
            html.Div(
                [
                    html.P("Hover a token (or click a heatmap row) to see where the selected head attends from it.",
                           className="hs-hint"),
                    # a run with patterns: the strip as HTML spans, recoloured in place on hover
                    # (assets/attention.js); a long run: the plotly view of its exact region
                    html.Div(id=ids.STRIP_TOKENS, className="hs-token-strip hs-hidden",
                             **{"data-query-store": query_store_id(PREFIX), "data-heatmap": ids.HEATMAP}),
                    _busy(dcc.Graph(id=ids.STRIP, figure=EMPTY, config=GRAPH_CONFIG)),
                    export_bar(PREFIX, names.TOKEN_STRIP),
                ],
                className="hs-panel",
            ),
            html.Div([_busy(dcc.Graph(id=ids.SINKS, figure=EMPTY, config=GRAPH_CONFIG)), export_bar(PREFIX, names.SINK_MAP)],
                     className="hs-panel"),
        ]
    )


def _why_panel() -> html.Div:
    """The "why" panel of a clicked heatmap cell (:func:`explain_cell`), and the line saying what was wrong
    with a cell asked for."""
    return html.Div(
        [
            html.Div(id=WHY_MESSAGE, className="hs-hint", role="status"),
            dcc.Store(id=WHY_SHOWN),
            html.Div(
                [
                    html.P("Why the head scores this cell: its score before softmax written as a sum over pairs "
                           "of residual-stream components, query side × key side (embedding, each earlier head "
                           "L.H, each MLP, biases), with normalisation scales frozen at this run (the standard "
                           "linearisation). The first cell of a run runs the model once; later cells reuse it. "
                           "Click a head's bar to open that head.", className="hs-hint"),
                    dcc.RadioItems(id=WHY_GROUP, value="layer", inline=True, className="hs-options",
                                   options=[{"label": "terms grouped by layer", "value": "layer"},
                                            {"label": "terms of the top heads", "value": "head"}]),
                    html.P(id=WHY_CHECK, className="hs-why-check"),
                    _busy(dcc.Graph(id=WHY_GRAPH, figure=EMPTY, config=GRAPH_CONFIG)),
                ],
                id=WHY, style=HIDDEN,
            ),
        ],
        className="hs-panel hs-why-panel",
    )


def _busy(graph: dcc.Graph) -> dcc.Loading:
    """A graph that shows a spinner (over its dimmed figure) while the server redraws it for more
    than a moment: a head click, a metric change, an exact-region zoom. Hover repaints in the
    browser within a frame, so it never shows one."""
    return dcc.Loading(graph, target_components={graph.id: "figure"}, delay_show=400, type="circle",
                       overlay_style={"visibility": "visible", "opacity": 0.5})


KEPT_ON_RUN = ("layer", "head", "metric")  # what _after_run carries over, as URL keys


def _after_run(old: PageState, model, run) -> PageState:
    layer = old.layer if old.layer is not None and old.layer < model.n_layers else 0
    head = old.head if old.head is not None and old.head < model.n_heads else 0
    return PageState(model=model.name, run=run.key[:16], layer=layer, head=head,
                     attention=AttentionState(metric=old.attention.metric))


register_export(PREFIX)
fill_text_from_runs(PREFIX)


show_in_shell(PREFIX)


NOT_RUN = "Not run: see the message above."


def _not_run_on_error(fn):
    """The status line of a Run that ends with a message (``guarded`` leaves the line alone) says it
    did not run, instead of the job's last progress report ("Running the model…") for good."""
    @functools.wraps(fn)
    def inner(*args, **kwargs):
        url, error, status = fn(*args, **kwargs)
        return url, error, NOT_RUN if status is no_update else status

    return inner


@cancellable_callback(
    Output(url_patch_id(PREFIX), "data", allow_duplicate=True),  # into the URL as it is then
    job_error(PREFIX),
    Output(STATUS, "children", allow_duplicate=True),
    Input(run_id(PREFIX), "n_clicks"),
    State(text_id(PREFIX), "value"),
    State(model_id(PREFIX), "value"),
    State(url_id(PREFIX), "search"),
    interval=200,  # the browser asks for the job's progress and result this often: on average half of it is
    # added to click → grid, and a poll is a few ms of server time
    prevent_initial_call=True,
    run=run_id(PREFIX), cancel=CANCEL, progress=PROGRESS, status=STATUS, preview=PREVIEW,
)
@_not_run_on_error
@guarded(outputs=3, error_index=1)
def run_text(set_progress, n_clicks, text, model_spec, search):
    """Run (a background job): capture the text, patterns up to the limit and statistics mode
    above it (:func:`headscope.analysis.statistics_run.capture_for_page`), with progress; Run is disabled
    and Cancel enabled while it runs. The run lands in the store; the URL names it.

    A new pattern run's grid is sent to the page as soon as the forward pass ends
    (:func:`_grid_preview`), while the run is written to the store; the rest of the page follows
    from the URL, as for any link."""
    if not n_clicks:  # the page's layout arriving is not a click
        raise PreventUpdate
    in_job()
    set_progress(("0", "100", "Running the model…"))
    context = get_context()
    model = load_model(offered_model(model_spec))  # the allowlist, never a path from the request
    before = parse(search)
    previewed = []

    def early(run) -> None:
        try:
            grid = _grid_preview(run, _after_run(before, model, run))
            set_progress(("100", "100", "Storing the run…"), grid)  # the job's last report (cancellable_callback)
        except Exception:  # noqa: BLE001 - a preview is an extra: never a reason to lose the run
            log.exception("the grid preview of run %s was not sent", run.key[:16])
            return
        previewed.append(grid)

    run = capture_for_page(model, text or "", context.store, context.max_tokens,
                           progress=progress_reporter(set_progress, "Running the model"), before_store=early)
    context.remember(run)
    if not previewed:
        set_progress(("100", "100", "Drawing…"))
    return url_patch(search, _after_run(before, model, run).to_search(), keep=KEPT_ON_RUN), "", ""


@callback(
    Output(STATUS, "children", allow_duplicate=True),
    Input(CANCEL, "n_clicks"),
    prevent_initial_call=True,
)
def cancelled(n_clicks):
    """Cancel: the caption says so, not the job's last progress as if it ran on."""
    if not n_clicks:
        raise PreventUpdate
    return "Cancelled: nothing was stored; the page shows the last finished run."


def _preview_mark(key: str, metric: str, layer: int, head: int) -> str:
    """What :data:`DRAWN`, and the grid's ``layout.meta.preview``, hold while the grid shown is Run's
    preview. Never a view :func:`render` draws (those are "run|metric|layer|head|query"): the render of
    exactly this run and view sends only the heatmap; any other draws whole figures."""
    return f"preview|{key}|{metric}|{layer}|{head}"


def _grid_preview(run, state: PageState):
    """The grid :func:`render` will draw for ``run`` in ``state`` (the state Run puts in the URL),
    built by the job from the run in its memory, before the run is stored: the grid then does not
    wait for the run to be written, nor for the render to read it back and verify it, which at a few
    hundred tokens take about as long again as the forward pass. The heatmap, strip and sink map
    follow from the URL.
    The figure carries its mark in ``layout.meta.preview``: the browser takes it back if the job then
    ends without its run (assets/attention.js ``withdrawPreview``)."""
    metric, layer, head = state.metric, state.layer or 0, state.head or 0
    mark = _preview_mark(run.key, metric, layer, head)
    grid, _ = VIEWS[names.HEAD_GRID].build(run, {"metric": metric, "layer": layer, "head": head})
    return grid.update_layout(meta={"preview": mark})


def _with(search: str | None, **changes) -> str:
    state = parse(search)
    for k, v in changes.items():
        setattr(state, k, v)
    return state.to_search()


@callback(
    output=dict(
        grid=Output(ids.GRID, "figure"),
        heatmap=Output(ids.HEATMAP, "figure"),
        strip=Output(ids.STRIP, "figure"),
        strip_style=Output(ids.STRIP, "style"),
        strip_data=Output(STRIP_DATA, "data"),
        info=Output(ids.RUN_INFO, "children"),
        error=Output(ids.ERROR, "children", allow_duplicate=True),
        text=Output(text_fill_id(PREFIX), "data"),  # into the text box in the browser, never over an edit
        model=Output(model_id(PREFIX), "value"),
        metric=Output(ids.METRIC, "value"),
        query=Output(query_store_id(PREFIX), "data"),
        sinks_run=Output(SINKS_RUN, "data"),
        drawn=Output(DRAWN, "data"),
    ),
    inputs=[Input(url_id(PREFIX), "search")],
    state=[State(url_id(PREFIX), "pathname"), State(SINKS_RUN, "data"), State(DRAWN, "data")],
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
    prevent_initial_call="initial_duplicate",
)
@guarded(outputs=("grid", "heatmap", "strip", "strip_style", "strip_data", "info", "error", "text", "model", "metric",
                  "query", "sinks_run", "drawn"))
def render(search, pathname=None, sinks_run=None, drawn=None):
    """Draw the page from its URL. The grid and heatmap of the run and metric already drawn are only
    patched for another head or query token (:func:`_head_changed`), and left alone when nothing they
    show changed; nothing is drawn for a page being left (:func:`headscope.app.page_shell.leaving`): a patch
    answered after the next page replaced this one would find no figure to patch."""
    if leaving(pathname, PAGE_PATH):
        raise PreventUpdate
    state = parse(search)
    problems = list(state.problems)
    context = get_context()
    if state.model and state.run is None:
        load_model(state.model)  # a model named on its own: check it loads, so a bad link says so
    blank = {"grid": EMPTY, "heatmap": EMPTY, "strip": EMPTY, "strip_style": {}, "strip_data": None, "info": "",
             "metric": state.metric, "query": None, "sinks_run": None, "drawn": None}
    if state.run is None:
        return {**blank, "error": message(problems), **({"model": state.model} if state.model else {})}
    run = context.run(state.run)
    if run is None:
        problems.append(f"No stored run has the id {state.run!r}. Run the text again to recompute it.")
        return {**blank, "error": message(problems)}
    _ready_for_a_click(run)
    n_layers, n_heads = run.n_layers, run.n_heads
    if state.metric not in run.metrics:
        problems.append(f"{unavailable(HEAD_SCORES[state.metric], run)}; showing normalised entropy.")
        state.metric = "entropy"
    layer, head = state.layer or 0, state.head or 0
    if layer >= n_layers or head >= n_heads:
        problems.append(
            f"Layer {layer}, head {head} is out of range: this model has layers 0..{n_layers - 1} and "
            f"heads 0..{n_heads - 1}. Showing layer 0, head 0."
        )
        layer, head = 0, 0
    query = state.query if state.query is not None and state.query < run.n_tokens else run.n_tokens - 1
    params = {"metric": state.metric, "layer": layer, "head": head, "query": query, "region": state.region}
    shown = f"{run.key}|{state.metric}|{layer}|{head}|{query}"
    if run.has_patterns and drawn == shown:  # drawn already (a link or Back to the same view)
        grid = heat = no_update
    elif run.has_patterns and drawn == _preview_mark(run.key, state.metric, layer, head):
        # the grid is Run's preview of this run and view (_grid_preview), now stored: it is the grid,
        # no longer a preview the browser would take back
        grid = Patch()
        grid["layout"]["meta"] = None
        heat, _ = VIEWS[names.ATTENTION].build(run, {**params, "_table": False})
    elif run.has_patterns and isinstance(drawn, str) and drawn.rsplit("|", 3)[0] == shown.rsplit("|", 3)[0]:
        # another head or query token (the strip follows the new heatmap at the query: assets/attention.js)
        grid, heat = _head_changed(run, layer, head)
    else:
        grid, _ = VIEWS[names.HEAD_GRID].build(run, params)
        heat, _ = VIEWS[names.ATTENTION].build(run, {**params, "_table": False})
    # Drawn once per run (the run's own data; a head click does not redraw them): the sink map (by
    # draw_sinks, once this has named the run) and, with patterns, the HTML token strip, which the
    # browser then recolours from each new heatmap (assets/attention.js). A long run's strip is the
    # plotly view of its exact region, which depends on the head: drawn every time.
    fresh = sinks_run != run.key
    strip, strip_style, strip_data = EMPTY, HIDDEN, None
    if run.has_patterns:
        if fresh:
            strip_data = VIEWS[names.TOKEN_STRIP].build(run, params)[0]
        else:
            strip, strip_data = no_update, no_update
    else:
        strip_style = {}
        try:
            strip, _ = VIEWS[names.TOKEN_STRIP].build(run, params)
        except InputError as e:  # a bad region in the link: say so, keep the rest of the page
            problems.append(str(e))
    info = run_info(run, layer, head, _run_policy(run))
    model = dropdown_model(run.model_name, problems)
    return {"grid": grid, "heatmap": heat, "strip": strip, "strip_style": strip_style, "strip_data": strip_data,
            "info": info, "error": message(problems), **({"text": run.text} if run.text else {}), "model": model,
            "metric": state.metric, "query": query, **({"sinks_run": run.key} if fresh else {}), "drawn": shown}


def _run_policy(run) -> str:
    """How the run's input became its tokens (:meth:`headscope.analysis.model_facts.ModelFacts.run_policy`), for
    its chip; "" for a model this server does not offer (nothing is claimed about it)."""
    try:
        facts = load_model(offered_model(run.model_name)).facts
    except ModelError:
        return ""
    return facts.run_policy(run.text is not None)


def _head_changed(run, layer: int, head: int) -> tuple[Patch, Patch]:
    """Another head of the run and metric the browser already shows: the grid's outline moves and the
    heatmap gets the head's weights and title, as patches to the drawn figures (the same values
    :func:`headscope.app.figures.head_grid` and :func:`headscope.app.figures.attention_heatmap` give, without building
    and sending both figures again, so a click on another head is answered sooner)."""
    grid, heat = Patch(), Patch()
    grid["layout"]["shapes"] = [figures.head_outline(layer, head)]
    z = figures.attention_heatmap_z(run.attention_overview(layer, head))
    heat["data"][0]["z"] = to_typed_array_spec(z)  # float32 as one base64 block, as in a whole figure
    heat["layout"]["title"]["text"] = figures.attention_heatmap_title(layer, head)
    heat["layout"]["meta"] = {"layer": layer, "head": head, "n": int(z.shape[0])}
    return grid, heat


@callback(
    Output(ids.SINKS, "figure"),
    job_error(PREFIX),  # with Redis this is a job: not the banner (page_shell.job_error)
    Input(SINKS_RUN, "data"),
    **on_workers(),
    prevent_initial_call=True,
)
@guarded(outputs=2, error_index=1)
def draw_sinks(run_key):
    """The sink map of the run the page shows, drawn once per run and after the grid and heatmap: it
    reads every head's pattern (about 0.3 s at 500 tokens on a quiet 2-core machine, seconds under load;
    the figure is then 0.2 MB), and the grid need not wait for it."""
    run = get_context().run(run_key) if run_key else None
    if run is None:
        return EMPTY, no_update
    return VIEWS[names.SINK_MAP].build(run, {})[0], no_update


# A click on the grid writes the head into the URL in the browser (assets/grid_clicks.js: the cell
# under the mouse, not plotly's last hover, so a click soon after another is not read as the first
# one's head); the render checks it like any link.


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Input(ids.METRIC, "value"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def select_metric(metric, search):
    if parse(search).metric == metric:
        return no_update
    return _with(search, metric=metric)


clientside_callback(
    ClientsideFunction(namespace="headscope", function_name="drawStrip"),
    Output(ids.STRIP_TOKENS, "className"),
    Input(STRIP_DATA, "data"),
    State(ids.STRIP_TOKENS, "id"),
)

# Run's grid from its job (_grid_preview) is drawn as it arrives; if the job then ends without its run
# (an error or a dead job in the banner, or Cancel), the grid it replaced comes back (assets/attention.js).
clientside_callback(
    ClientsideFunction(namespace="headscope", function_name="previewGrid"),
    Output(ids.GRID, "figure", allow_duplicate=True),
    Output(DRAWN, "data", allow_duplicate=True),
    Input(PREVIEW, "data"),
    State(ids.GRID, "figure"),
    State(DRAWN, "data"),
    State(run_id(PREFIX), "disabled"),
    State(run_id(PREFIX), "n_clicks"),
    State(ids.ERROR, "children"),
    State(run_id(PREFIX), "id"),
    prevent_initial_call=True,
)
clientside_callback(
    ClientsideFunction(namespace="headscope", function_name="withdrawPreview"),
    Output(ids.GRID, "figure", allow_duplicate=True),
    Output(DRAWN, "data", allow_duplicate=True),
    Input(ids.ERROR, "children"),
    Input(CANCEL, "n_clicks"),
    State(ids.GRID, "figure"),
    State(url_id(PREFIX), "search"),
    State(run_id(PREFIX), "n_clicks"),
    State(run_id(PREFIX), "id"),
    prevent_initial_call=True,
)

# A new heatmap (another head): the strip recolours from it, at the selected query token.
clientside_callback(
    ClientsideFunction(namespace="headscope", function_name="followHead"),
    Input(ids.HEATMAP, "figure"),
    State(query_store_id(PREFIX), "data"),
)

# Hovering a token (a listener in assets/attention.js) or a heatmap row recolours the strip in the
# browser from the heatmap already there: no server round trip. A long run's strip is its
# exact-region view: unchanged.
clientside_callback(
    ClientsideFunction(namespace="headscope", function_name="followQuery"),
    Output(query_store_id(PREFIX), "data", allow_duplicate=True),
    Input(ids.HEATMAP, "hoverData"),
    Input(ids.HEATMAP, "clickData"),
    State(ids.HEATMAP, "figure"),
    prevent_initial_call=True,
)


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Input(ids.HEATMAP, "relayoutData"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def zoom_long_run(relayout, search):
    """On a long run's pooled map, a drag-zoom writes the region into the URL (exact values below);
    a double-click (autorange) clears it. Short runs zoom their full heatmap in the browser."""
    state = parse(search)
    run = get_context().run(state.run) if relayout and state.run is not None else None
    if run is None or run.has_patterns:
        return no_update
    if relayout.get("xaxis.autorange") or relayout.get("yaxis.autorange"):
        return _with(search, region=None) if state.region else no_update
    try:
        x0, x1 = sorted((float(relayout["xaxis.range[0]"]), float(relayout["xaxis.range[1]"])))
        y0, y1 = sorted((float(relayout["yaxis.range[0]"]), float(relayout["yaxis.range[1]"])))
    except (KeyError, TypeError, ValueError):
        return no_update
    B, n = run.block_size, run.n_tokens
    # cells are drawn at their first position and span B positions: ranges in cell units, ± half a cell
    q0, q1 = max(0, int(np.floor(y0 + B / 2))), min(n, int(np.ceil(y1 + B / 2)))
    k0, k1 = max(0, int(np.floor(x0 + B / 2))), min(n, int(np.ceil(x1 + B / 2)))
    if q1 <= q0 or k1 <= k0:
        return no_update
    return _with(search, region=f"{q0}-{q1},{k0}-{k1}")


# --- the "why" panel of one heatmap cell (issue 41: QK attribution) ---------------------------------------

def _clicked_cell(click) -> tuple[int, int] | None:
    """``(query, key)`` of a click on the heatmap (its labels are ``"pos token"``), None for anything else."""
    point = click.get("points") if isinstance(click, dict) else None
    point = point[0] if isinstance(point, list) and point and isinstance(point[0], dict) else {}
    found = []
    for axis in ("y", "x"):
        head = str(point.get(axis, "")).split(" ", 1)[0]
        if not head.isascii() or not head.isdigit() or len(head) > 7:
            return None
        found.append(int(head))
    return found[0], found[1]


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Input(ids.HEATMAP, "clickData"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def open_why(click, search):
    """A click on a cell of a run's heatmap opens its "why" panel: the cell goes into the URL (``query``,
    ``key``), so the link reopens it. Not on a long run's pooled map, whose cells are blocks."""
    cell = _clicked_cell(click)
    state = parse(search if isinstance(search, str) else None)
    if cell is None or state.run is None:
        return no_update
    run = get_context().run(state.run)
    if run is None or run.block_size != 1 or (state.query, state.key) == cell:
        return no_update
    return _with(search, query=cell[0], key=cell[1])


def _run_model(spec: str, digest: str):
    """The model ``spec`` names, when it is the one (by ``digest``) that made the run; else an InputError."""
    model = load_model(spec)
    if model.digest != digest:
        raise InputError("The model this server loads is not the one that made this run: run the text again.")
    return model


def _ready_for_a_click(run) -> None:
    """Start the capture the why panel explains a shown run's cells from, in the background
    (:func:`headscope.analysis.qk_cell.prefetch`), so that the first click on its heatmap finds it made: a
    run shown token by token, by a model this server offers (anything else is said by the click)."""
    if run.block_size != 1:
        return
    try:
        spec = offered_model(run.model_name)
    except USER_ERRORS:
        return
    prefetch(functools.partial(_run_model, spec, run.model_digest), run.model_digest, run.token_ids)


def _why(run, layer: int, head: int, query: int, key: int, group: str) -> tuple[go.Figure, str]:
    """The panel's figure and check line: :func:`headscope.analysis.qk_cell.cell_attribution` drawn by the
    ``qk_cell`` view's figure builder (bars of the top query-side and key-side components; its heatmap of
    the top heads' terms, or with ``group="layer"`` every term summed over each layer's heads)."""
    if run.block_size != 1:
        raise InputError("This run's heatmap pools several tokens per cell: the why panel explains one cell of a "
                         "run shown token by token. Run a shorter text.")
    model = _run_model(offered_model(run.model_name), run.model_digest)
    a = cell_attribution(model, run.token_ids, layer, head, query, key)
    q, k = (figures.shown_token(run.tokens[p]) for p in (query, key))
    fig = qk_cell_figure(a.query_names, a.key_names, a.terms,
                         f"Why head {layer}.{head} scores query {query} {q} on key {key} {k}")
    if group == "layer":
        groups, terms = grouped_by_layer(a.query_names, a.terms)
        span = float(np.abs(terms).max()) or 1.0
        fig.data[2].update(z=terms.tolist(), x=groups, y=groups, zmin=-span, zmax=span)
        fig.layout.annotations[2].text = "query × key terms, heads summed by layer"
    check = (f"The {a.terms.shape[0]} × {a.terms.shape[1]} terms sum to s_ij = {float(a.terms.sum()):.6f} "
             f"(the model's own score before softmax: {a.score:.6f}")
    if a.softcap is not None:
        check += f"; after soft-capping at {a.softcap:g}: {a.capped_score:.6f}"
    return fig, check + "). Normalisation scales frozen at this run."


@callback(
    output=dict(panel=Output(WHY, "style"), figure=Output(WHY_GRAPH, "figure"), check=Output(WHY_CHECK, "children"),
                message=Output(WHY_MESSAGE, "children"), shown=Output(WHY_SHOWN, "data")),
    inputs=[Input(url_id(PREFIX), "search"), Input(WHY_GROUP, "value")],
    state=[State(url_id(PREFIX), "pathname"), State(WHY_SHOWN, "data")],
    **on_workers(),
    prevent_initial_call="initial_duplicate",
)
@guarded(outputs=("panel", "figure", "check", "message", "shown"), error="message")
def explain_cell(search, group, pathname=None, shown=None):
    """The "why" panel of the cell the URL names (``query``, ``key`` of the selected head), or none. The
    run's components come from one cached forward pass (:mod:`headscope.analysis.qk_cell`), started in the
    background when the page shows the run (:func:`_ready_for_a_click`): a cell asked for once it is made
    takes tens of milliseconds, one asked for sooner waits for the rest of it."""
    if leaving(pathname if isinstance(pathname, str) else None, PAGE_PATH):
        raise PreventUpdate
    state = parse(search if isinstance(search, str) else None)
    group = group if group in ("layer", "head") else "layer"
    if state.run is None or state.key is None or state.query is None:
        return {"panel": HIDDEN, "message": "", "shown": None}
    layer, head = state.layer or 0, state.head or 0
    mark = f"{state.run}|{layer}|{head}|{state.query}|{state.key}|{group}"
    if mark == shown:
        raise PreventUpdate
    run = get_context().run(state.run)
    if run is None:
        return {"panel": HIDDEN, "shown": None,
                "message": f"No stored run has the id {state.run!r}: run the text again to explain its cells."}
    try:
        fig, check = _why(run, layer, head, state.query, state.key, group)
    except USER_ERRORS as e:  # a cell the head never scores, a position past the text: say so, hide the panel
        return {"panel": HIDDEN, "message": str(e), "shown": None}
    return {"panel": {}, "figure": fig, "check": check, "message": "", "shown": mark}


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Input(WHY_GRAPH, "clickData"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def open_component_head(click, search):
    """A click on a head's bar (``L.H``) in the why panel opens that head, as a click on the grid does
    (:func:`headscope.app.grid_clicks.select_head`: layer and head into the URL, the query token dropped),
    and closes the panel."""
    point = click.get("points") if isinstance(click, dict) else None
    point = point[0] if isinstance(point, list) and point and isinstance(point[0], dict) else {}
    layer, dot, head = str(point.get("y", "")).partition(".")
    if not (dot and layer.isascii() and layer.isdigit() and head.isascii() and head.isdigit()) \
            or len(layer) > 6 or len(head) > 6 or not isinstance(search, str):
        return no_update
    return _with(search, layer=int(layer), head=int(head), query=None, key=None)
