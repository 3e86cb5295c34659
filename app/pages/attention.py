"""Page "Attention": text → every head's summary grid → one head's heatmap and token strip.

Data flows one way: the Run button and clicks write the URL; one callback renders everything from
the URL, so a copied link reopens the same view.
"""

from __future__ import annotations

import dash
import numpy as np
from dash import ALL, Input, Output, State, callback, ctx, dcc, html, no_update
from dash.exceptions import PreventUpdate

from analysis.capture import capture
from analysis.head_summary import HEAD_METRICS
from analysis.models import load_model
from app import ids
from app.context import get_context
from app.errors import guarded, message
from app.export import FORMATS, bundle
from app.url_state import PageState, parse
from app.views import VIEWS

dash.register_page(__name__, path="/", name="Attention", title="headscope — attention")

EMPTY = {"data": [], "layout": {"xaxis": {"visible": False}, "yaxis": {"visible": False},
                                "annotations": [{"text": "Run a text to see every head.", "showarrow": False,
                                                 "font": {"size": 14, "color": "#888"}}],
                                "height": 300}}

GRAPH_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "svg"}}


def export_bar(view: str) -> html.Div:
    return html.Div(
        [html.Span("Export", className="hs-export-label")]
        + [
            html.Button(fmt.upper(), id={"type": ids.EXPORT, "view": view, "fmt": fmt}, className="hs-export-btn",
                        n_clicks=0, **{"data-export": f"{view}-{fmt}"}, title=f"Download the {VIEWS[view].title.lower()} as {fmt.upper()} "
                                          "with its data and manifest")
            for fmt in FORMATS
        ],
        className="hs-export-bar",
    )


def layout(**_query) -> html.Div:
    context = get_context()
    return html.Div(
        [
            html.Div(
                [
                    dcc.Textarea(id=ids.TEXT, placeholder="Type or paste text to analyse…", className="hs-text",
                                 value=""),
                    html.Div(
                        [
                            html.Label("Model", htmlFor=ids.MODEL),
                            dcc.Dropdown(id=ids.MODEL, options=context.model_options(),
                                         value=context.default_model, clearable=False, className="hs-model"),
                            html.Button("Run", id=ids.RUN_BUTTON, n_clicks=0, className="hs-run"),
                        ],
                        className="hs-controls",
                    ),
                ],
                className="hs-input",
            ),
            html.Div(id=ids.ERROR, role="alert", className="hs-error"),
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
                                        options=[{"label": m.label, "value": m.name, "title": m.description}
                                                 for m in HEAD_METRICS.values()],
                                        value="entropy", clearable=False,
                                    ),
                                ],
                                className="hs-metric",
                            ),
                            dcc.Graph(id=ids.GRID, figure=EMPTY, config=GRAPH_CONFIG),
                            export_bar("head_grid"),
                        ],
                        className="hs-panel hs-grid-panel",
                    ),
                    html.Div(
                        [
                            dcc.Graph(id=ids.HEATMAP, figure=EMPTY, config=GRAPH_CONFIG),
                            export_bar("attention"),
                        ],
                        className="hs-panel hs-heatmap-panel",
                    ),
                ],
                className="hs-panels",
            ),
            html.Div(
                [
                    html.P("Hover a token to see where the selected head attends from it.", className="hs-hint"),
                    dcc.Graph(id=ids.STRIP, figure=EMPTY, config=GRAPH_CONFIG, clear_on_unhover=False),
                    export_bar("token_strip"),
                ],
                className="hs-panel",
            ),
            dcc.Download(id=ids.DOWNLOAD),
        ]
    )


def _with(search: str | None, **changes) -> str:
    state = parse(search)
    for k, v in changes.items():
        setattr(state, k, v)
    return state.to_search()


@callback(
    Output(ids.URL, "search", allow_duplicate=True),
    Output(ids.ERROR, "children", allow_duplicate=True),
    Input(ids.RUN_BUTTON, "n_clicks"),
    State(ids.TEXT, "value"),
    State(ids.MODEL, "value"),
    State(ids.URL, "search"),
    prevent_initial_call=True,
)
@guarded(outputs=2)
def run_text(n_clicks, text, model_spec, search):
    if not n_clicks:  # the page's layout arriving is not a click
        raise PreventUpdate
    context = get_context()
    model = load_model(model_spec or context.default_model)
    run = capture(model, text or "", store=context.store, max_tokens=context.max_tokens)
    context.remember(run)
    old = parse(search)
    layer = old.layer if old.layer is not None and old.layer < model.n_layers else 0
    head = old.head if old.head is not None and old.head < model.n_heads else 0
    state = PageState(model=model.name, run=run.key[:16], layer=layer, head=head, metric=old.metric)
    return state.to_search(), ""


@callback(
    Output(ids.GRID, "figure"),
    Output(ids.HEATMAP, "figure"),
    Output(ids.STRIP, "figure"),
    Output(ids.RUN_INFO, "children"),
    Output(ids.ERROR, "children"),
    Output(ids.TEXT, "value"),
    Output(ids.MODEL, "value"),
    Output(ids.METRIC, "value"),
    Input(ids.URL, "search"),
)
@guarded(outputs=8, error_index=4)
def render(search):
    state = parse(search)
    problems = list(state.problems)
    context = get_context()
    if state.model and state.run is None:
        # A model named on its own: check it loads, so a bad link says so.
        load_model(state.model)
    if state.run is None:
        return EMPTY, EMPTY, EMPTY, "", message(problems), no_update, state.model or no_update, state.metric
    run = context.run(state.run)
    if run is None:
        problems.append(f"No stored run has the id {state.run!r}. Run the text again to recompute it.")
        return EMPTY, EMPTY, EMPTY, "", message(problems), no_update, no_update, state.metric
    n_layers, n_heads = run.patterns.shape[:2]
    layer, head = state.layer or 0, state.head or 0
    if layer >= n_layers or head >= n_heads:
        problems.append(
            f"Layer {layer}, head {head} is out of range: this model has layers 0..{n_layers - 1} and "
            f"heads 0..{n_heads - 1}. Showing layer 0, head 0."
        )
        layer, head = 0, 0
    query = state.query if state.query is not None and state.query < run.n_tokens else run.n_tokens - 1
    params = {"metric": state.metric, "layer": layer, "head": head, "query": query}
    grid, _ = VIEWS["head_grid"].build(run, params)
    heat, _ = VIEWS["attention"].build(run, params)
    strip, _ = VIEWS["token_strip"].build(run, params)
    loss = np.nanmean(run.token_loss) if run.n_tokens > 1 else float("nan")
    info = html.Div(
        [
            html.Span(f"run {run.short_id}", className="hs-chip"),
            html.Span(run.model_name, className="hs-chip"),
            html.Span(f"{run.n_tokens} tokens", className="hs-chip"),
            html.Span(f"mean loss {loss:.3f}", className="hs-chip"),
            html.Span(f"selected: layer {layer}, head {head}", className="hs-chip hs-selected"),
        ]
    )
    return grid, heat, strip, info, message(problems), run.text or no_update, run.model_name, state.metric


@callback(
    Output(ids.URL, "search", allow_duplicate=True),
    Input(ids.GRID, "clickData"),
    State(ids.URL, "search"),
    prevent_initial_call=True,
)
def select_head(click, search):
    if not click or not click.get("points"):
        return no_update
    point = click["points"][0]
    return _with(search, layer=int(point["y"]), head=int(point["x"]), query=None)


@callback(
    Output(ids.URL, "search", allow_duplicate=True),
    Input(ids.METRIC, "value"),
    State(ids.URL, "search"),
    prevent_initial_call=True,
)
def select_metric(metric, search):
    if parse(search).metric == metric:
        return no_update
    return _with(search, metric=metric)


@callback(
    Output(ids.STRIP, "figure", allow_duplicate=True),
    Output(ids.ERROR, "children", allow_duplicate=True),
    Input(ids.STRIP, "hoverData"),
    Input(ids.HEATMAP, "clickData"),
    State(ids.URL, "search"),
    prevent_initial_call=True,
)
@guarded(outputs=2)
def follow_query(hover, heat_click, search):
    state = parse(search)
    run = get_context().run(state.run) if state.run else None
    if run is None:
        return no_update, no_update
    if ctx.triggered_id == ids.STRIP:
        if not hover or not hover.get("points"):
            return no_update, no_update
        query = int(hover["points"][0]["customdata"][0])
    else:
        if not heat_click or not heat_click.get("points"):
            return no_update, no_update
        query = int(str(heat_click["points"][0]["y"]).split(" ", 1)[0])
    if query < 0:
        return no_update, no_update
    fig, _ = VIEWS["token_strip"].build(
        run, {"layer": state.layer or 0, "head": state.head or 0, "query": query}
    )
    return fig, ""


@callback(
    Output(ids.DOWNLOAD, "data"),
    Output(ids.ERROR, "children", allow_duplicate=True),
    Input({"type": ids.EXPORT, "view": ALL, "fmt": ALL}, "n_clicks"),
    State(ids.URL, "search"),
    prevent_initial_call=True,
)
@guarded(outputs=2)
def export(clicks, search):
    trigger = ctx.triggered_id
    if not trigger or not any(clicks):
        return no_update, no_update
    state = parse(search)
    run = get_context().run(state.run) if state.run else None
    if run is None:
        return no_update, "Run a text before exporting: there is no figure yet."
    params = {"metric": state.metric, "layer": state.layer or 0, "head": state.head or 0}
    if trigger["view"] == "token_strip":
        params["query"] = state.query if state.query is not None else run.n_tokens - 1
    if trigger["view"] == "attention":
        params.pop("metric")
    name, data = bundle(run, trigger["view"], params, trigger["fmt"])
    return dcc.send_bytes(data, name), ""
