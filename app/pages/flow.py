"""Page "Flow": which input tokens an output token draws on — raw attention, rollout and exact flow
side by side (Abnar & Zuidema 2020), and how rollout relevance builds up layer by layer."""

from __future__ import annotations

import dash
from dash import ALL, Input, Output, State, callback, ctx, dcc, html, no_update
from dash.exceptions import PreventUpdate

from headscope.analysis.rollout import FUSIONS
from headscope.app import figures, ids
from headscope.app.context import dropdown_model, get_context
from headscope.app.errors import guarded, message
from headscope.app.export_bar import export_bar, register_export
from headscope.app.jobs import cancellable_callback, in_job, on_workers, progress_reporter
from headscope.app.page_shell import (
    GRAPH_CONFIG,
    empty_figure,
    job_error,
    page_location,
    query_store_id,
    shell_stores,
    url_id,
)
from headscope.app.run_bar import fill_text_from_runs, input_bar, model_id, register_run, text_fill_id
from headscope.app.url_state import FlowState, PageState, parse
from headscope.app.views import VIEWS, names
from headscope.app.views.flow import (
    CORRECTED_METHODS,
    PLAIN_METHODS,
    RELEVANCE_METHODS,
    check_target,
    flow_numbers,
    max_flow_tokens,
)

dash.register_page(__name__, path="/flow", name="Flow", title="headscope — rollout and flow", order=1)

PREFIX = "flow"
EMPTY = empty_figure("Run a text to see which inputs each output draws on.")
SINK_NOTE = ("Position 0 is the attention sink: most heads park attention there, so kept, it takes most of rollout "
             "and flow; dropped, its column is removed and each row renormalised, so the strips show how the rest "
             "is shared.")
TOKEN_STYLE = {"margin": "1px", "padding": "1px 5px", "border": "1px solid #d0d7e2", "borderRadius": "4px",
               "background": "white", "cursor": "pointer", "fontSize": "13px", "whiteSpace": "pre"}


def sink_share(run, target: int, fusion: str, drop_sink: bool) -> str:
    """What the sink holds of the picture now: its share of rollout (or that it is dropped)."""
    if drop_sink:
        return "sink (position 0) dropped: rollout and flow are shared among the other tokens"
    share = flow_numbers(run, target, fusion, drop_sink).scores["rollout"][0]
    return f"sink (position 0) holds {share:.0%} of rollout"


def token_buttons(tokens: list[str], target: int) -> list[html.Button]:
    """The run's tokens as buttons: clicking one makes it the target (the chosen one is marked)."""
    return [
        html.Button(tok, id={"type": ids.FLOW_TOKEN, "pos": i}, n_clicks=0, title=f"position {i}",
                    className="hs-selected" if i == target else None,
                    style={**TOKEN_STYLE, **({"background": "#fde8e1", "borderColor": "#e4572e"} if i == target else {})})
        for i, tok in enumerate(tokens)
    ]


CORRECTION_NOTE = (
    "Position-corrected: in a causal model token j is seen only by the tokens after it, so the earlier a "
    "token, the more paths lead from it and the more rollout and flow give it, whatever the attention does. "
    "These two strips divide each value by the same quantity computed on uniform causal attention (every "
    "token spreading its attention evenly over what it can see), then normalise to sum 1: what remains is "
    "how much more (or less) the model routes to a token than its position alone would. Their own shared "
    "colour scale. This correction is headscope's own, not from Abnar & Zuidema.")


def strip_panel(method: str) -> html.Div:
    return html.Div([dcc.Graph(id={"type": ids.FLOW_STRIPS, "method": method}, figure=EMPTY, config=GRAPH_CONFIG),
                     export_bar(PREFIX, names.variant(names.RELEVANCE, method))], className="hs-panel")


def layout(**query) -> html.Div:
    return html.Div(
        [
            page_location(PREFIX),
            shell_stores(PREFIX),
            dcc.Store(id=query_store_id(PREFIX)),
            input_bar(PREFIX, f"Text to attribute (attention flow: up to {max_flow_tokens()} tokens)…", model=query.get("model")),
            html.Div(
                [
                    html.Label("Target position", htmlFor=ids.FLOW_TARGET),
                    dcc.Input(id=ids.FLOW_TARGET, type="number", min=0, step=1, debounce=True,
                              placeholder="last", className="hs-number"),
                    html.Label("Head fusion", htmlFor=ids.FLOW_FUSION),
                    dcc.Dropdown(id=ids.FLOW_FUSION, options=list(FUSIONS), value=FUSIONS[0], clearable=False,
                                 className="hs-small-dropdown"),
                    dcc.Checklist(id=ids.FLOW_SINK, options=[{"label": " drop the sink (position 0)", "value": "sink"}],
                                  value=[], inline=True),
                    html.Span(SINK_NOTE, id=ids.FLOW_SINK_NOTE, className="hs-hint"),
                ],
                className="hs-options",
            ),
            dcc.Loading(html.Div(id=ids.FLOW_INFO, className="hs-run-info"), type="dot"),
            html.P("Click a token, in a strip or in this list, to make it the target. Each strip colours a token by "
                   "its share of the method's relevance for the target: a row of raw attention or of rollout sums "
                   "to 1, while flow's max-flow values do not (each input's flow is computed alone, and inputs share "
                   "paths), so they are divided by their sum; hover a token for the method's own value. In that "
                   "one unit, raw attention, rollout and flow share one colour scale, 0 to the largest share any "
                   "of them shows (numbers on each colour bar), so their colours compare.", className="hs-hint"),
            html.Div(id=ids.FLOW_TOKENS, className="hs-flow-tokens"),
            html.Div([strip_panel(m) for m in PLAIN_METHODS]),
            html.P(CORRECTION_NOTE, id=ids.FLOW_CORRECTION_NOTE, className="hs-hint"),
            html.Div([strip_panel(m) for m in CORRECTED_METHODS]),
            html.Div([dcc.Graph(id=ids.FLOW_LAYERS, figure=EMPTY, config=GRAPH_CONFIG), export_bar(PREFIX, names.ROLLOUT_LAYERS)],
                     className="hs-panel"),
            html.H3("Faithfulness: which attribution agrees with removing tokens?", className="hs-section"),
            html.P("Leave-one-out importance: the change in the target token's log-probability when one input "
                   "token's embedding is zeroed. Spearman ρ of each method with it (Abnar & Zuidema 2020). Raw "
                   "attention, rollout and flow are scored exactly as the strips above show them: with the head "
                   "fusion and sink option chosen here.", className="hs-hint"),
            html.Button("Compare with gradients and ablation on this input", id=ids.FAITH_INPUT_BUTTON, n_clicks=0,
                        className="hs-button"),
            dcc.Loading(html.Div(id=ids.FAITH_INPUT, className="hs-faith"), type="dot"),
            html.Div(
                [
                    html.Button("Evaluate on the built-in set (32 prompts)", id=ids.FAITH_SET_BUTTON, n_clicks=0,
                                className="hs-button"),
                    html.Button("Cancel", id=ids.FAITH_SET_CANCEL, n_clicks=0, className="hs-button hs-cancel",
                                disabled=True),
                    html.Progress(id=ids.FAITH_SET_PROGRESS, value="0", max="100", className="hs-progress"),
                    html.Span(id=ids.FAITH_SET_STATUS, className="hs-hint"),
                ],
                className="hs-options",
            ),
            html.Div([dcc.Graph(id=ids.FAITH_SET, figure=empty_figure("Not evaluated yet for these settings."),
                                config=GRAPH_CONFIG), export_bar(PREFIX, names.FAITHFULNESS_SET)], className="hs-panel"),
        ]
    )


def _after_run(old: PageState, model, run) -> PageState:
    return PageState(model=model.name, run=run.key[:16], flow=FlowState(fusion=old.flow.fusion, drop_sink=old.flow.drop_sink))


KEPT_ON_RUN = ("fusion", "sink")  # the settings _after_run carries over, as URL keys
register_run(PREFIX, _after_run, KEPT_ON_RUN)
register_export(PREFIX)
fill_text_from_runs(PREFIX)


STRIP = {m: f"strip_{m}" for m in RELEVANCE_METHODS}  # the render's output of each method's strip


@callback(
    output=dict(
        **{STRIP[m]: Output({"type": ids.FLOW_STRIPS, "method": m}, "figure") for m in RELEVANCE_METHODS},
        layers=Output(ids.FLOW_LAYERS, "figure"),
        faith_set=Output(ids.FAITH_SET, "figure", allow_duplicate=True),
        info=Output(ids.FLOW_INFO, "children"),
        error=Output(ids.ERROR, "children", allow_duplicate=True),
        text=Output(text_fill_id(PREFIX), "data"),  # into the text box in the browser, never over an edit
        model=Output(model_id(PREFIX), "value"),
        target=Output(ids.FLOW_TARGET, "value"),
        fusion=Output(ids.FLOW_FUSION, "value"),
        sink=Output(ids.FLOW_SINK, "value"),
        tokens=Output(ids.FLOW_TOKENS, "children"),
    ),
    inputs=[Input(url_id(PREFIX), "search")],
    state=[State(ids.FLOW_FUSION, "value"), State(ids.FLOW_SINK, "value")],
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
    prevent_initial_call="initial_duplicate",
)
@guarded(outputs=(*STRIP.values(), "layers", "faith_set", "info", "error", "text", "model", "target", "fusion", "sink",
                  "tokens"))
def render(search, fusion_shown=None, sink_shown=None):
    """Draw the page from its URL: one strip per relevance method (the output :data:`STRIP` names), the
    rollout layers, the faithfulness chart already evaluated for these settings, and the token buttons."""
    state = parse(search)
    problems = list(state.problems)
    # The controls are written only where they differ from the URL as it was when this render
    # started: a box ticked while an earlier redraw is still running is not undone by it.
    controls = {}
    if fusion_shown != state.fusion:
        controls["fusion"] = state.fusion
    if bool(sink_shown) != state.drop_sink:
        controls["sink"] = ["sink"] if state.drop_sink else []
    blank = {**dict.fromkeys(STRIP.values(), EMPTY), "layers": EMPTY, "info": "", "target": None,
             "tokens": [], **controls}
    if state.run is None:
        return {**blank, "error": message(problems)}
    run = get_context().run(state.run)
    if run is None:
        problems.append(f"No stored run has the id {state.run!r}. Run the text again to recompute it.")
        return {**blank, "error": message(problems)}
    target = check_target(run, state.target)
    params = {"target": target, "fusion": state.fusion, "drop_sink": state.drop_sink}
    strips = {}
    for method in RELEVANCE_METHODS:
        try:
            strips[STRIP[method]], _ = VIEWS[names.RELEVANCE].build(run, {**params, "method": method})
        except ValueError as e:  # e.g. flow over its token limit: the other methods still show
            if str(e) not in problems:  # flow and corrected flow give the same reason: said once
                problems.append(str(e))
            strips[STRIP[method]] = empty_figure(str(e))
    layers, _ = VIEWS[names.ROLLOUT_LAYERS].build(run, params)
    try:
        faith_set, _ = VIEWS[names.FAITHFULNESS_SET].build(run, {**params, "_compute": False})
    except ValueError:
        faith_set = empty_figure("Not evaluated yet for these settings.")
    info = html.Div([
        html.Span(f"run {run.short_id}", className="hs-chip"),
        html.Span(f"{run.n_tokens} tokens", className="hs-chip"),
        html.Span(f"target: token {target} ({run.tokens[target]})", className="hs-chip hs-selected"),
        html.Span(sink_share(run, target, state.fusion, state.drop_sink), id=ids.FLOW_SINK_SHARE, className="hs-chip"),
    ])
    # The target box keeps what the link says (empty = the last token), so filling it in here does
    # not itself change the URL and re-render.
    model = dropdown_model(run.model_name, problems)
    return {**strips, "layers": layers, "faith_set": faith_set, "info": info, "error": message(problems),
            **({"text": run.text} if run.text else {}), "model": model, "target": state.target,
            "tokens": token_buttons(run.tokens, target), **controls}


def clicked_position(value) -> int | None:
    """The token position a click names: a token button's, or the cell of a strip (its x and y)."""
    trigger = ctx.triggered_id
    if not isinstance(trigger, dict):
        return None
    if trigger.get("type") == ids.FLOW_TOKEN:
        pos = trigger.get("pos") if value else None
        return pos if isinstance(pos, int) and not isinstance(pos, bool) and pos >= 0 else None
    points = (value or {}).get("points") if isinstance(value, dict) else None
    return figures.token_strip_position(points[0]) if isinstance(points, list) and points else None


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Input({"type": ids.FLOW_STRIPS, "method": ALL}, "clickData"),
    Input({"type": ids.FLOW_TOKEN, "pos": ALL}, "n_clicks"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def choose_target(_strip_clicks, _token_clicks, search):
    """A click on a token (in a strip or the token list) makes it the target; the URL keeps it."""
    value = ctx.triggered[0]["value"] if ctx.triggered else None
    pos = clicked_position(value)
    state = parse(search)
    if pos is None or state.run is None or pos == state.target:
        raise PreventUpdate
    state.target = pos  # the render callback checks it against the run (out of range: a clear message)
    return state.to_search()


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Input(ids.FLOW_TARGET, "value"),
    Input(ids.FLOW_FUSION, "value"),
    Input(ids.FLOW_SINK, "value"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def change_options(target, fusion, sink, search):
    state = parse(search)
    new_target = int(target) if isinstance(target, int | float) and target >= 0 else None
    drop = "sink" in (sink or [])
    if (new_target, fusion, drop) == (state.target, state.fusion, state.drop_sink) or state.run is None:
        return no_update
    state.target, state.fusion, state.drop_sink = new_target, fusion or "mean", drop
    return state.to_search()


@callback(
    Output(ids.FAITH_INPUT, "children"),
    job_error(PREFIX),  # with Redis this is a job: not the banner (page_shell.job_error)
    Input(ids.FAITH_INPUT_BUTTON, "n_clicks"),
    State(url_id(PREFIX), "search"),
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
    prevent_initial_call=True,
)
@guarded(outputs=2)
def faithfulness_on_input(n_clicks, search):
    if not n_clicks:
        raise PreventUpdate
    state = parse(search)
    run = get_context().run(state.run) if state.run else None
    if run is None:
        return no_update, "Run a text first."
    params = {"target": check_target(run, state.target), "fusion": state.fusion, "drop_sink": state.drop_sink}
    panels = []
    for view, extra in ((names.GRADIENT, {"method": "ixg_norm"}), (names.GRADIENT, {"method": "ablation"}),
                        (names.FAITHFULNESS_INPUT, {})):
        fig, _ = VIEWS[view].build(run, {**params, **extra})
        name = names.variant(view, extra["method"]) if extra else view
        panels.append(html.Div([dcc.Graph(figure=fig, config=GRAPH_CONFIG), export_bar(PREFIX, name)],
                               className="hs-panel"))
    return panels, ""


@cancellable_callback(
    Output(ids.FAITH_SET, "figure"),
    Output(ids.FAITH_SET_STATUS, "children"),
    Input(ids.FAITH_SET_BUTTON, "n_clicks"),
    State(url_id(PREFIX), "search"),
    run=ids.FAITH_SET_BUTTON, cancel=ids.FAITH_SET_CANCEL, progress=ids.FAITH_SET_PROGRESS, status=ids.FAITH_SET_STATUS,
    prevent_initial_call=True,
)
def faithfulness_on_set(set_progress, n_clicks, search):
    in_job()
    if not n_clicks:
        raise PreventUpdate
    state = parse(search)
    run = get_context().run(state.run) if state.run else None
    if run is None:
        return no_update, "Run a text first: the evaluation uses its model."
    try:
        fig, _ = VIEWS[names.FAITHFULNESS_SET].build(run, {
            "fusion": state.fusion, "drop_sink": state.drop_sink,
            "_progress": progress_reporter(set_progress, "evaluating"),
        })
    except ValueError as e:
        return no_update, str(e)
    return fig, "done: stored, so it reopens instantly"
