"""Page "QK space": one head's queries and keys pooled over a probe set (AttentionViz), a clicked
query's attention, and the contrastive-covariance spectrum of a labelled feature (Lee et al. 2026)."""

from __future__ import annotations

import sys

import dash
import flask
from dash import Input, Output, State, callback, dcc, html, no_update

from headscope.analysis.qk_collect import load_probe_tasks, store_sentences
from headscope.analysis.qk_decomposition import store_labels
from headscope.app import ids
from headscope.app.busy import show_busy
from headscope.app.context import get_context
from headscope.app.errors import guarded, message
from headscope.app.export_bar import export_bar, register_export
from headscope.app.grid_clicks import head_clicks, select_head
from headscope.app.jobs import in_job, progress_reporter
from headscope.app.page_shell import (
    GRAPH_CONFIG,
    empty_figure,
    page_location,
    query_store_id,
    shell_stores,
    url_id,
)
from headscope.app.uploads import register_upload, upload_field, upload_file, upload_file_id
from headscope.app.url_state import parse
from headscope.app.views import VIEWS, names
from headscope.app.views.qk import (
    COLOUR_BY,
    DEFAULT_SENTENCES,
    MAX_SENTENCES,
    METHODS,
    qk_params,
    user_labels,
)
from headscope.app.workers import redis_url

dash.register_page(__name__, path="/qk", name="QK space", title="headscope — query-key space", order=4)

PREFIX = "qk"
EMPTY = empty_figure("Pick a layer and head, then Show.")


def _warm_umap(method) -> None:
    """Compile UMAP's code in the server, in the background, once the page asks for UMAP (a link that
    names it, or Show with it chosen); embedded only: with Redis the jobs run on workers. Jobs forked
    later inherit the compiled code. Not at the server's start: a job forked while it compiles waits
    for it (:func:`headscope.analysis.joint_embedding.start_umap_warmup`), so every new server's first Run on
    the Attention page would wait for a compile it does not need."""
    if method != "umap" or redis_url() or not flask.has_request_context():
        return
    from headscope.analysis.joint_embedding import start_umap_warmup

    if start_umap_warmup():
        print("headscope: compiling UMAP's code in the background (once per server, 10-20 s)", file=sys.stderr,
              flush=True)  # the server's own lines (app/cli/serve.py), not a warning


def layout(**query) -> html.Div:
    _warm_umap(query.get("method"))
    return html.Div(
        [
            page_location(PREFIX),
            shell_stores(PREFIX),
            dcc.Store(id=query_store_id(PREFIX)),
            html.Div(
                [
                    html.Label("Layer", htmlFor=ids.QK_LAYER),
                    dcc.Input(id=ids.QK_LAYER, type="number", min=0, step=1, value=16, className="hs-number"),
                    html.Label("Head", htmlFor=ids.QK_HEAD),
                    dcc.Input(id=ids.QK_HEAD, type="number", min=0, step=1, value=0, className="hs-number"),
                    html.Label("Probe sentences", htmlFor=ids.QK_SENTENCES),
                    dcc.Input(id=ids.QK_SENTENCES, type="number", min=1, max=MAX_SENTENCES, step=1,
                              value=DEFAULT_SENTENCES, className="hs-number"),
                    html.Label("Projection", htmlFor=ids.QK_METHOD),
                    dcc.Dropdown(id=ids.QK_METHOD, options=[{"label": v, "value": k} for k, v in METHODS.items()],
                                 value="pca", clearable=False, className="hs-small-dropdown"),
                    html.Label("Colour", htmlFor=ids.QK_COLOUR),
                    dcc.Dropdown(id=ids.QK_COLOUR, options=list(COLOUR_BY), value="position", clearable=False,
                                 className="hs-small-dropdown"),
                    html.Label("Feature", htmlFor=ids.QK_FEATURE),
                    dcc.Dropdown(id=ids.QK_FEATURE, options=list(load_probe_tasks()),
                                 value="previous_token", clearable=False, className="hs-small-dropdown"),
                    *upload_field(ids.QK_TEXTS_UPLOAD, "Upload sentences (.txt)"),
                    *upload_field(ids.QK_LABELS_UPLOAD, "Upload labels (.csv)"),
                    html.Label("Find token", htmlFor=ids.QK_FIND),
                    dcc.Input(id=ids.QK_FIND, debounce=True, placeholder="e.g. cat", className="hs-number"),
                    html.Button("Show", id=ids.QK_SHOW, n_clicks=0, className="hs-run"),
                    html.Progress(id=ids.QK_PROGRESS, value="0", max="100", className="hs-progress"),
                    html.Span(id=ids.QK_STATUS, className="hs-hint"),
                ],
                className="hs-options",
            ),
            html.P("Queries are circles, keys diamonds; keys are translated to the queries' centroid and both "
                   "rescaled (attention unchanged). Click a query to draw its top-5 keys in its own sentence. "
                   "UMAP and t-SNE run as background jobs and are stored.", className="hs-hint"),
            html.Div([dcc.Graph(id=ids.QK_SCATTER, figure=EMPTY, config=GRAPH_CONFIG), html.Div(id=ids.QK_HITS),
                      export_bar(PREFIX, names.QK_SCATTER)], className="hs-panel"),
            html.Div([dcc.Graph(id=ids.QK_SPECTRUM, figure=EMPTY, config=GRAPH_CONFIG), export_bar(PREFIX, names.QK_SPECTRUM)],
                     className="hs-panel"),
            html.Div([dcc.Graph(id=ids.QK_ATTRIBUTION, figure=empty_figure("Click a query to attribute its logits."),
                                config=GRAPH_CONFIG), export_bar(PREFIX, names.QK_ATTRIBUTION)], className="hs-panel"),
            html.Div([dcc.Graph(id=ids.QK_LAYER_VIEW, figure=EMPTY, config=GRAPH_CONFIG), export_bar(PREFIX, names.QK_LAYER)],
                     className="hs-panel"),
            html.Div([head_clicks(dcc.Graph(id=ids.QK_RANK_MAP, figure=EMPTY, config=GRAPH_CONFIG),
                                  select_head(ids.QK_RANK_MAP, PREFIX, drop=("query",))),
                      html.P("Click a head to show it.", className="hs-hint"), export_bar(PREFIX, names.QK_RANK_MAP)],
                     className="hs-panel"),
        ]
    )


register_export(PREFIX, lambda state: None)


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Input(ids.QK_SHOW, "n_clicks"),
    State(ids.QK_LAYER, "value"), State(ids.QK_HEAD, "value"), State(ids.QK_SENTENCES, "value"),
    State(ids.QK_METHOD, "value"), State(ids.QK_COLOUR, "value"), State(ids.QK_FEATURE, "value"),
    State(ids.QK_FIND, "value"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def show(n_clicks, layer, head, sentences, method, colour, feature, find, search):
    if not n_clicks:
        return no_update
    _warm_umap(method)  # before the URL changes and the page's job is forked
    state = parse(search)
    state.qk.find = (find or "").strip()[:40] or None
    state.layer, state.head = int(layer or 0), int(head or 0)
    state.qk.sentences = int(sentences or DEFAULT_SENTENCES)
    state.qk.method, state.qk.colour, state.qk.feature, state.query = method, colour, feature, None
    return state.to_search()


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Input(ids.QK_FIND, "value"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def find_tokens(find, search):
    """The token to find, into the URL. A click on the rank map selects its head in the browser
    (assets/grid_clicks.js), from the mouse press rather than plotly's click, so a click soon after another is
    not read as the first one's head."""
    state = parse(search)
    new = (find or "").strip()[:40] or None
    if new == state.qk.find or state.layer is None:
        return no_update
    state.qk.find = new
    return state.to_search()


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Output(ids.QK_STATUS, "children", allow_duplicate=True),
    Input(upload_file_id(ids.QK_LABELS_UPLOAD), "data"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def upload_labels(file, search):
    """A label CSV (feature,side,label,match) becomes features of the decomposition; bad files say why."""
    if not file:
        return no_update, no_update
    try:
        text, filename = upload_file(file, "a CSV label file")
    except ValueError as e:
        return no_update, str(e)
    try:
        key, features = store_labels(get_context().store, text, filename or "")
    except ValueError as e:
        return no_update, str(e)
    state = parse(search)
    state.qk.labels, state.qk.feature = key[:16], next(iter(features))
    return state.to_search(), no_update  # the page re-renders with the new features in the Feature list


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Output(ids.QK_STATUS, "children", allow_duplicate=True),
    Input(upload_file_id(ids.QK_TEXTS_UPLOAD), "data"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def upload_texts(file, search):
    """Own probe sentences, one per line (blank lines and # comments skipped), replace the built-in set."""
    if not file:
        return no_update, no_update
    try:
        text, filename = upload_file(file, "sentences, one per line")
    except ValueError as e:
        return no_update, str(e)
    sentences = [t.strip() for t in text.splitlines() if t.strip() and not t.lstrip().startswith("#")]
    if not sentences:
        return no_update, f"{filename or 'The file'} has no sentences: write one sentence per line."
    if len(sentences) > MAX_SENTENCES:
        return no_update, f"{filename} has {len(sentences)} sentences; the limit is {MAX_SENTENCES}."
    key = store_sentences(get_context().store, sentences, filename or "")
    state = parse(search)
    state.qk.texts, state.qk.sentences, state.query = key[:16], len(sentences), None
    return state.to_search(), no_update


register_upload(ids.QK_TEXTS_UPLOAD)
register_upload(ids.QK_LABELS_UPLOAD)


CONTROLS = ("layer", "head", "sentences", "method", "colour", "find")


@callback(
    output=dict(
        layer=Output(ids.QK_LAYER, "value"),
        head=Output(ids.QK_HEAD, "value"),
        sentences=Output(ids.QK_SENTENCES, "value"),
        method=Output(ids.QK_METHOD, "value"),
        colour=Output(ids.QK_COLOUR, "value"),
        find=Output(ids.QK_FIND, "value"),
    ),
    inputs=[Input(url_id(PREFIX), "search")],
)
def controls_from_url(search):
    """The controls show what the link asks for (a link with ``method=umap`` shows UMAP, not PCA;
    ``find=the`` fills the token search), so Show redraws the linked view, not the defaults. A control
    the link leaves out keeps what it shows."""
    state = parse(search)
    asked = {"layer": state.layer, "head": state.head, "sentences": state.qk.sentences, "method": state.qk.method,
             "colour": state.qk.colour, "find": state.qk.find or ""}
    return {name: no_update if asked[name] is None else asked[name] for name in CONTROLS}


@callback(
    Output(ids.QK_FEATURE, "options"),
    Output(ids.QK_FEATURE, "value"),
    Input(url_id(PREFIX), "search"),
)
@guarded(outputs=2, error_index=0)
def feature_options(search):
    state = parse(search)
    names = list(load_probe_tasks())
    try:
        names += [f for f in user_labels(state.qk.labels) if f not in names]
    except ValueError:
        pass
    return names, state.qk.feature if state.qk.feature in names else "previous_token"


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Input(ids.QK_SCATTER, "clickData"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def pick_query(click, search):
    if not click or not click.get("points"):
        return no_update
    point = click["points"][0]
    if point.get("curveNumber") != 0:  # queries are the first trace
        return no_update
    state = parse(search)
    state.query = int(point["customdata"][0])
    return state.to_search()


@callback(
    output=dict(
        scatter=Output(ids.QK_SCATTER, "figure"),
        spectrum=Output(ids.QK_SPECTRUM, "figure"),
        hits=Output(ids.QK_HITS, "children"),
        attribution=Output(ids.QK_ATTRIBUTION, "figure"),
        layer_view=Output(ids.QK_LAYER_VIEW, "figure"),
        rank_map=Output(ids.QK_RANK_MAP, "figure"),
        status=Output(ids.QK_STATUS, "children"),
        error=Output(ids.ERROR, "children", allow_duplicate=True),
    ),
    inputs=[Input(url_id(PREFIX), "search")],
    background=True,
    progress=[Output(ids.QK_PROGRESS, "value"), Output(ids.QK_PROGRESS, "max"), Output(ids.QK_STATUS, "children")],
    running=[(Output(ids.QK_SHOW, "disabled"), True, False)],
    prevent_initial_call="initial_duplicate",
)
def render(set_progress, search):
    in_job()
    state = parse(search)
    problems = list(state.problems)
    params = qk_params(state)
    rank_map = _optional(names.QK_RANK_MAP, params)
    blank = {"scatter": EMPTY, "spectrum": EMPTY, "hits": "", "attribution": NO_QUERY, "layer_view": EMPTY,
             "rank_map": rank_map, "status": ""}
    if state.layer is None or state.head is None:
        return {**blank, "error": message(problems)}
    try:
        scatter, rows = VIEWS[names.QK_SCATTER].build(None, {**params, "_progress": progress_reporter(set_progress,
                                                                                                  state.qk.method)})
    except ValueError as e:
        return {**blank, "error": message([*problems, str(e)])}
    spectrum = _optional(names.QK_SPECTRUM, params)
    attribution = _optional(names.QK_ATTRIBUTION, params) if state.query is not None else NO_QUERY
    layer_view = _optional(names.QK_LAYER, params)
    hits = ""
    if state.query is not None:
        top = [r for r in rows if "key_token" in r]
        hits = html.Ul([html.Li(f"key {r['key']} {r['key_token']!r}: attention {r['weight']:.3f}, "
                                f"distance {r['distance']:.2f}") for r in top], className="hs-hits")
    return {"scatter": scatter, "spectrum": spectrum, "hits": hits, "attribution": attribution,
            "layer_view": layer_view, "rank_map": rank_map, "status": "ready", "error": message(problems)}


NO_QUERY = empty_figure("Click a query to attribute its logits.")
# while render's job runs (Show disabled): "Starting…", the banner cleared, the head's figures marked out of date
show_busy(ids.QK_SHOW, ids.QK_STATUS, ids.QK_PROGRESS, (ids.QK_SCATTER, ids.QK_SPECTRUM, ids.QK_ATTRIBUTION,
                                                          ids.QK_LAYER_VIEW))


def _optional(view: str, params: dict):
    """A secondary figure: its problem is shown in its place, the rest of the page still renders."""
    try:
        return VIEWS[view].build(None, params)[0]
    except ValueError as e:
        return empty_figure(str(e))
