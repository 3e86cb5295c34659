"""Page "Attention": text → every head's summary grid → one head's heatmap and token strip.

Data flows one way: the Run button and clicks write the URL; one callback renders everything from
the URL, so a copied link reopens the same view.
"""

from __future__ import annotations

import dash
import numpy as np
from dash import Input, Output, State, callback, ctx, dcc, html, no_update

from analysis.head_summary import HEAD_METRICS
from analysis.models import load_model
from app import ids
from app.components import (
    GRAPH_CONFIG,
    empty_figure,
    export_bar,
    input_bar,
    model_id,
    page_location,
    query_store_id,
    register_export,
    register_run,
    text_id,
    url_id,
)
from app.context import get_context
from app.errors import guarded, message
from app.jobs import on_workers
from app.url_state import PageState, parse
from app.views import VIEWS

dash.register_page(__name__, path="/", name="Attention", title="headscope — attention", order=0)

PREFIX = "attn"
EMPTY = empty_figure()


def layout(**_query) -> html.Div:
    return html.Div(
        [
            page_location(PREFIX),
            dcc.Store(id=query_store_id(PREFIX)),
            input_bar(PREFIX),
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
                            export_bar(PREFIX, "head_grid"),
                        ],
                        className="hs-panel hs-grid-panel",
                    ),
                    html.Div(
                        [dcc.Graph(id=ids.HEATMAP, figure=EMPTY, config=GRAPH_CONFIG), export_bar(PREFIX, "attention")],
                        className="hs-panel hs-heatmap-panel",
                    ),
                ],
                className="hs-panels",
            ),
            html.Div(
                [
                    html.P("Hover a token (or click a heatmap row) to see where the selected head attends from it.",
                           className="hs-hint"),
                    dcc.Graph(id=ids.STRIP, figure=EMPTY, config=GRAPH_CONFIG, clear_on_unhover=False),
                    export_bar(PREFIX, "token_strip"),
                ],
                className="hs-panel",
            ),
            html.Div([dcc.Graph(id=ids.SINKS, figure=EMPTY, config=GRAPH_CONFIG), export_bar(PREFIX, "sink_map")],
                     className="hs-panel"),
        ]
    )


def _after_run(old: PageState, model, run) -> PageState:
    layer = old.layer if old.layer is not None and old.layer < model.n_layers else 0
    head = old.head if old.head is not None and old.head < model.n_heads else 0
    return PageState(model=model.name, run=run.key[:16], layer=layer, head=head, metric=old.metric)


register_run(PREFIX, _after_run)
register_export(PREFIX)


def _with(search: str | None, **changes) -> str:
    state = parse(search)
    for k, v in changes.items():
        setattr(state, k, v)
    return state.to_search()


@callback(
    Output(ids.GRID, "figure"),
    Output(ids.HEATMAP, "figure"),
    Output(ids.STRIP, "figure"),
    Output(ids.SINKS, "figure"),
    Output(ids.RUN_INFO, "children"),
    Output(ids.ERROR, "children", allow_duplicate=True),
    Output(text_id(PREFIX), "value"),
    Output(model_id(PREFIX), "value"),
    Output(ids.METRIC, "value"),
    Output(query_store_id(PREFIX), "data"),
    Input(url_id(PREFIX), "search"),
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
    prevent_initial_call="initial_duplicate",
)
@guarded(outputs=10, error_index=5)
def render(search):
    state = parse(search)
    problems = list(state.problems)
    context = get_context()
    if state.model and state.run is None:
        load_model(state.model)  # a model named on its own: check it loads, so a bad link says so
    if state.run is None:
        return EMPTY, EMPTY, EMPTY, EMPTY, "", message(problems), no_update, state.model or no_update, state.metric, None
    run = context.run(state.run)
    if run is None:
        problems.append(f"No stored run has the id {state.run!r}. Run the text again to recompute it.")
        return EMPTY, EMPTY, EMPTY, EMPTY, "", message(problems), no_update, no_update, state.metric, None
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
    sinks, _ = VIEWS["sink_map"].build(run, params)
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
    return (grid, heat, strip, sinks, info, message(problems), run.text or no_update, run.model_name, state.metric,
            query)


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Input(ids.GRID, "clickData"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def select_head(click, search):
    if not click or not click.get("points"):
        return no_update
    point = click["points"][0]
    return _with(search, layer=int(point["y"]), head=int(point["x"]), query=None)


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


@callback(
    Output(ids.STRIP, "figure", allow_duplicate=True),
    Output(query_store_id(PREFIX), "data", allow_duplicate=True),
    Output(ids.ERROR, "children", allow_duplicate=True),
    Input(ids.STRIP, "hoverData"),
    Input(ids.HEATMAP, "clickData"),
    State(url_id(PREFIX), "search"),
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
    prevent_initial_call=True,
)
@guarded(outputs=3)
def follow_query(hover, heat_click, search):
    state = parse(search)
    run = get_context().run(state.run) if state.run else None
    if run is None:
        return no_update, no_update, no_update
    if ctx.triggered_id == ids.STRIP:
        if not hover or not hover.get("points"):
            return no_update, no_update, no_update
        query = int(hover["points"][0]["customdata"][0])
    else:
        if not heat_click or not heat_click.get("points"):
            return no_update, no_update, no_update
        query = int(str(heat_click["points"][0]["y"]).split(" ", 1)[0])
    if query < 0:
        return no_update, no_update, no_update
    fig, _ = VIEWS["token_strip"].build(run, {"layer": state.layer or 0, "head": state.head or 0, "query": query})
    return fig, query, ""
