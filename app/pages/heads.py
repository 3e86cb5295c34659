"""Page "Heads": retrieval heads from needle-in-a-haystack sweeps (Wu et al. 2024), beside
streaming scores; a head's trials show why it scored."""

from __future__ import annotations

import dash
from dash import Input, Output, State, callback, dash_table, dcc, html, no_update
from dash.exceptions import PreventUpdate

from analysis.models import load_model
from analysis.niah import load_haystack, load_needles
from analysis.retrieval import sweep
from app import ids
from app.components import (
    GRAPH_CONFIG,
    empty_figure,
    export_bar,
    page_location,
    query_store_id,
    register_export,
    url_id,
)
from app.context import get_context
from app.errors import guarded, message
from app.heads_views import AGGREGATES, head_trials, sweep_of, sweep_run
from app.jobs import in_job, progress_reporter
from app.url_state import parse
from app.views import VIEWS

dash.register_page(__name__, path="/heads", name="Heads", title="headscope — retrieval and streaming heads", order=2)

PREFIX = "heads"
EMPTY = empty_figure("Run a sweep to score every head.")
TOP_K = 20


def _needle_options():
    try:
        return [{"label": f" {n.id}: {n.answer}", "value": n.id} for n in load_needles()]
    except ValueError:
        return []


def layout(**_query) -> html.Div:
    options = _needle_options()
    return html.Div(
        [
            page_location(PREFIX),
            dcc.Store(id=query_store_id(PREFIX)),
            html.Div(
                [
                    html.Div([html.Label("Needles"), dcc.Checklist(
                        id=ids.HEADS_NEEDLES, options=options, value=[o["value"] for o in options[:4]],
                        className="hs-needles")], className="hs-field"),
                    html.Div([
                        html.Label("Context lengths (tokens)", htmlFor=ids.HEADS_LENGTHS),
                        dcc.Input(id=ids.HEADS_LENGTHS, value="512", className="hs-text-input"),
                        html.Label("Depths (%)", htmlFor=ids.HEADS_DEPTHS),
                        dcc.Input(id=ids.HEADS_DEPTHS, value="10,50,90", className="hs-text-input"),
                        html.Label("Haystack", htmlFor=ids.HEADS_HAYSTACK),
                        dcc.Dropdown(id=ids.HEADS_HAYSTACK, options=["prose", "passkey"], value="prose",
                                     clearable=False),
                    ], className="hs-field"),
                ],
                className="hs-sweep-settings",
            ),
            html.Div(
                [
                    html.Button("Run sweep", id=ids.HEADS_RUN, n_clicks=0, className="hs-run"),
                    html.Button("Cancel", id=ids.HEADS_CANCEL, n_clicks=0, className="hs-button hs-cancel",
                                disabled=True),
                    html.Progress(id=ids.HEADS_PROGRESS, value="0", max="100", className="hs-progress"),
                    html.Span(id=ids.HEADS_STATUS, className="hs-hint"),
                ],
                className="hs-options",
            ),
            html.Div(id=ids.HEADS_INFO, className="hs-run-info"),
            html.Div(
                [
                    html.Div([
                        dcc.RadioItems(id=ids.HEADS_AGG, options=[{"label": f" {v}", "value": k}
                                                                  for k, v in AGGREGATES.items()],
                                       value="query", inline=True),
                        dcc.Graph(id=ids.HEADS_GRID, figure=EMPTY, config=GRAPH_CONFIG),
                        export_bar(PREFIX, "retrieval_grid"),
                    ], className="hs-panel"),
                    html.Div([
                        html.H4(f"Top {TOP_K} heads", className="hs-section"),
                        dash_table.DataTable(id=ids.HEADS_TOPK, sort_action="native", page_size=TOP_K,
                                             style_cell={"fontFamily": "inherit", "fontSize": 13, "padding": "3px 8px"},
                                             style_header={"fontWeight": "600"}),
                    ], className="hs-panel"),
                ],
                className="hs-panels",
            ),
            html.Div(
                [
                    html.Div([dcc.Graph(id=ids.HEADS_HIST, figure=EMPTY, config=GRAPH_CONFIG),
                              export_bar(PREFIX, "retrieval_histogram")], className="hs-panel"),
                    html.Div([dcc.Graph(id=ids.HEADS_SCATTER, figure=EMPTY, config=GRAPH_CONFIG),
                              export_bar(PREFIX, "retrieval_scatter")], className="hs-panel"),
                ],
                className="hs-panels hs-even",
            ),
            html.Div([dcc.Graph(id=ids.HEADS_NIAH, figure=EMPTY, config=GRAPH_CONFIG), export_bar(PREFIX, "niah_grid")],
                     className="hs-panel"),
            html.Div(
                [
                    html.H4("Trials of the selected head (click a row to see its decode steps)", className="hs-section"),
                    dash_table.DataTable(id=ids.HEADS_TRIALS, sort_action="native", page_size=12,
                                         style_cell={"fontFamily": "inherit", "fontSize": 13, "padding": "3px 8px",
                                                     "whiteSpace": "normal", "textAlign": "left"}),
                    dcc.Graph(id=ids.HEADS_STEPS, figure=empty_figure("Click a head in the map, then a trial."),
                              config=GRAPH_CONFIG),
                    export_bar(PREFIX, "trial_steps"),
                ],
                className="hs-panel",
            ),
        ]
    )


def _sweep_run(state):
    return sweep_run(sweep_of({"sweep": state.sweep})) if state.sweep else None


register_export(PREFIX, _sweep_run)


def _numbers(text: str, what: str, cast=int) -> list:
    try:
        values = [cast(x) for x in str(text or "").replace(";", ",").split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be numbers separated by commas, got {text!r}.") from None
    if not values:
        raise ValueError(f"Give at least one value for {what.lower()}.")
    if len(values) > 12:
        raise ValueError(f"At most 12 values for {what.lower()}.")
    return values


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Output(ids.HEADS_STATUS, "children"),
    Input(ids.HEADS_RUN, "n_clicks"),
    State(ids.HEADS_NEEDLES, "value"),
    State(ids.HEADS_LENGTHS, "value"),
    State(ids.HEADS_DEPTHS, "value"),
    State(ids.HEADS_HAYSTACK, "value"),
    State(url_id(PREFIX), "search"),
    background=True,
    progress=[Output(ids.HEADS_PROGRESS, "value"), Output(ids.HEADS_PROGRESS, "max"),
              Output(ids.HEADS_STATUS, "children")],
    running=[(Output(ids.HEADS_RUN, "disabled"), True, False), (Output(ids.HEADS_CANCEL, "disabled"), False, True)],
    cancel=[Input(ids.HEADS_CANCEL, "n_clicks")],
    prevent_initial_call=True,
)
def run_sweep(set_progress, n_clicks, needle_ids, lengths, depths, haystack, search):
    in_job()
    if not n_clicks:
        raise PreventUpdate
    try:
        context = get_context()
        model = load_model(context.default_model)
        chosen = [n for n in load_needles() if n.id in set(needle_ids or [])]
        lengths_ = _numbers(lengths, "Context lengths")
        depths_ = _numbers(depths, "Depths", float)
        result = sweep(model, chosen, lengths_, depths_, load_haystack(haystack or "prose"), store=context.store,
                       progress=progress_reporter(set_progress, "sweep"))
        if not result.trials:
            return no_update, "No trial finished."
        sweep_run(result)  # capture the first prompt now, so the page's scatter is instant
    except ValueError as e:
        return no_update, str(e)
    state = parse(search)
    state.sweep, state.trial = result.key[:16], None
    note = f"{result.n_counted}/{result.n_trials} trials answered; {result.share_above(0.1):.1%} of heads score > 0.1"
    return state.to_search(), note


@callback(
    Output(ids.HEADS_GRID, "figure"),
    Output(ids.HEADS_TOPK, "data"),
    Output(ids.HEADS_HIST, "figure"),
    Output(ids.HEADS_SCATTER, "figure"),
    Output(ids.HEADS_NIAH, "figure"),
    Output(ids.HEADS_TRIALS, "data"),
    Output(ids.HEADS_STEPS, "figure"),
    Output(ids.HEADS_INFO, "children"),
    Output(ids.HEADS_AGG, "value"),
    Output(ids.ERROR, "children", allow_duplicate=True),
    Input(url_id(PREFIX), "search"),
    prevent_initial_call="initial_duplicate",
)
@guarded(outputs=10)
def render(search):
    state = parse(search)
    problems = list(state.problems)
    blank = (EMPTY, [], EMPTY, EMPTY, EMPTY, [], empty_figure("Click a head in the map, then a trial."), "",
             state.agg)
    if state.sweep is None:
        return (*blank, message(problems))
    try:
        sw = sweep_of({"sweep": state.sweep})
    except ValueError as e:
        return (*blank, message([*problems, str(e)]))
    run = sweep_run(sw)
    params = {"sweep": state.sweep, "agg": state.agg, "layer": state.layer, "head": state.head,
              "versus": "streaming", "trial": state.trial}
    grid, grid_rows = VIEWS["retrieval_grid"].build(run, params)
    top = sorted(grid_rows, key=lambda r: -r["retrieval"] if r["retrieval"] == r["retrieval"] else 1)[:TOP_K]
    for r in top:
        r["retrieval"] = round(r["retrieval"], 4)
    hist, _ = VIEWS["retrieval_histogram"].build(run, params)
    scatter, _ = VIEWS["retrieval_scatter"].build(run, params)
    niah, _ = VIEWS["niah_grid"].build(run, params)
    trials, steps = [], empty_figure("Click a head in the map, then a trial.")
    if state.layer is not None and state.head is not None:
        trials = head_trials(sw, state.layer, state.head)
        steps, _ = VIEWS["trial_steps"].build(run, {**params, "trial": state.trial or 0})
    info = html.Div([
        html.Span(f"sweep {sw.key[:12]}", className="hs-chip"),
        html.Span(f"{sw.n_counted}/{sw.n_trials} trials counted (ROUGE-1 recall > 0.5)", className="hs-chip"),
        html.Span(f"lengths {sw.lengths}, depths {sw.depths}", className="hs-chip"),
        html.Span("cancelled: partial" if sw.cancelled else "complete", className="hs-chip"),
    ])
    return grid, top, hist, scatter, niah, trials, steps, info, state.agg, message(problems)


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Input(ids.HEADS_GRID, "clickData"),
    Input(ids.HEADS_AGG, "value"),
    Input(ids.HEADS_TRIALS, "active_cell"),
    State(ids.HEADS_TRIALS, "derived_viewport_data"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def select(click, agg, cell, rows, search):
    state = parse(search)
    trigger = dash.ctx.triggered_id
    if trigger == ids.HEADS_GRID and click and click.get("points") and state.agg == "query":
        point = click["points"][0]
        state.layer, state.head, state.trial = int(point["y"]), int(point["x"]), None
    elif trigger == ids.HEADS_AGG and agg and agg != state.agg:
        state.agg = agg
    elif trigger == ids.HEADS_TRIALS and cell and rows:
        state.trial = int(rows[cell["row"]]["trial"])
    else:
        return no_update
    return state.to_search()
