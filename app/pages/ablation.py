"""Page "Ablation": remove heads and watch loss, the next-token prediction and the continuation
move; the top-k heads by a score against k random heads (Wu et al. 2024, §4); single-head sweeps."""

from __future__ import annotations

import re
import time

import dash
from dash import (
    ClientsideFunction,
    Input,
    Output,
    State,
    callback,
    clientside_callback,
    dash_table,
    dcc,
    html,
    no_update,
)
from dash.exceptions import PreventUpdate

from headscope.analysis.ablation import format_heads, parse_heads
from headscope.analysis.ablation_choices import (
    CONTROL_TOP_N,
    CURVE_METRICS,
    DEFAULT_CURVE_KS,
    DEFAULT_METHOD,
    DEFAULT_SEEDS,
    METHOD_DESCRIPTIONS,
    METHODS,
    SWEEP_METRICS,
)
from headscope.analysis.ablation_curve import ablation_curve, random_control
from headscope.analysis.ablation_effects import (
    CONTINUATION_TOKENS,
    REFERENCE_SENTENCES,
    AppliedAblation,
    builtin_reference,
)
from headscope.analysis.ablation_effects import apply as apply_ablation
from headscope.analysis.head_sweep import ablation_head_sweep
from headscope.analysis.models import load_model
from headscope.app import ids
from headscope.app.context import get_context
from headscope.app.errors import USER_ERRORS, guarded, message
from headscope.app.export_bar import export_bar, register_export
from headscope.app.grid_clicks import head_clicks, toggle_head
from headscope.app.jobs import cancellable_callback, count_progress, in_job, on_workers
from headscope.app.page_shell import (
    GRAPH_CONFIG,
    empty_figure,
    job_error,
    page_location,
    query_store_id,
    shell_stores,
    url_id,
    url_patch,
    url_patch_id,
)
from headscope.app.run_bar import fill_text_from_runs, input_bar, model_id, register_run, text_fill_id
from headscope.app.url_state import PageState, parse
from headscope.app.views import VIEWS, names
from headscope.app.views.ablation import (
    RANK_LABELS,
    ablation_params,
    ablation_spec,
    rank_scores,
    remember_effects,
    top_heads,
)

dash.register_page(__name__, path="/ablation", name="Ablation", title="headscope — head ablation", order=3)

PREFIX = "abl"
EMPTY = empty_figure("Run a text, then choose heads to ablate.")
KEEP = {"persistence": True, "persistence_type": "session"}
RANDOM_RULE = "hs-abl-random-rule"  # the line beside "Random k"
WAITING = empty_figure("Apply computes the effects of the chosen heads on this text.")


def layout(**query) -> html.Div:
    return html.Div(
        [
            page_location(PREFIX),
            shell_stores(PREFIX),
            dcc.Store(id=query_store_id(PREFIX)),
            dcc.Store(id=ids.ABL_KEPT, storage_type="local", data=[]),
            dcc.Store(id=ids.ABL_PENDING, data=None),  # heads chosen on the map or typed, not yet applied
            # the effects panel: its state, and the two events its reducer takes (assets/ablation.js)
            dcc.Store(id=ids.ABL_PANEL, data=None),
            dcc.Store(id=ids.ABL_EFFECTS_ASKED, data=None),  # the render's figure for the panel
            dcc.Store(id=ids.ABL_APPLIED, data=None),  # the Apply job's effects, or why there are none
            dcc.Store(id=ids.ABL_MAP, data=None),  # the run and score the map should show (render asks)
            dcc.Store(id=ids.ABL_DRAWN, data=None),  # the run and score the map shows
            dcc.Store(id=ids.ABL_FROM_LINK, data=None),  # a link's applied set, handed to the Apply job
            input_bar(PREFIX, "Text to ablate heads on (loss, next-token prediction, continuation)…", model=query.get("model")),
            html.Div(
                [
                    html.Div([
                        head_clicks(dcc.Graph(id=ids.ABL_GRID, figure=EMPTY, config=GRAPH_CONFIG),
                                    toggle_head(ids.ABL_GRID, ids.ABL_PENDING, ids.ABL_HEADS)),
                        html.P("Click heads to choose them (again to remove); Apply computes their effects.",
                               className="hs-hint"),
                        export_bar(PREFIX, names.ABLATION_SELECTION),
                    ], className="hs-panel"),
                    html.Div([
                        html.Label("Heads (e.g. 12.3, L14H1, kv:20.2 for a key-value group, 7.* for a layer)",
                                   htmlFor=ids.ABL_HEADS),
                        dcc.Input(id=ids.ABL_HEADS, className="hs-text-input", debounce=True, value=""),
                        html.Label("Method", htmlFor=ids.ABL_METHOD),
                        dcc.RadioItems(id=ids.ABL_METHOD, value=DEFAULT_METHOD, options=[
                            {"label": html.Span([html.B(f" {m} "), html.Span(METHOD_DESCRIPTIONS[m], className="hs-hint")]),
                             "value": m} for m in METHODS], className="hs-methods"),
                        html.Label("Resample: the source text whose head outputs are patched in", htmlFor=ids.ABL_SOURCE),
                        dcc.Textarea(id=ids.ABL_SOURCE, className="hs-textarea", **KEEP,
                                     placeholder="Another input, e.g. the same sentence with other names."),
                        html.Label(f"Mean: reference texts, one per line (empty: the first {REFERENCE_SENTENCES} "
                                   "built-in probe sentences)", htmlFor=ids.ABL_REFERENCE),
                        dcc.Textarea(id=ids.ABL_REFERENCE, className="hs-textarea", **KEEP),
                        html.Div(id=ids.ABL_CHOSEN, className="hs-hint"),
                        html.Div([
                            html.Button("Apply", id=ids.ABL_APPLY, n_clicks=0, className="hs-run"),
                            html.Button("Cancel", id=ids.ABL_APPLY_CANCEL, n_clicks=0,
                                        className="hs-button hs-cancel", disabled=True),
                            html.Progress(id=ids.ABL_APPLY_PROGRESS, value="0", max="100", className="hs-progress"),
                            html.Span(id=ids.ABL_APPLY_STATUS, className="hs-hint", role="status"),
                        ], className="hs-options"),
                        html.Hr(),
                        html.Label("Choose by a score", htmlFor=ids.ABL_BY),
                        dcc.Dropdown(id=ids.ABL_BY, clearable=False, value="retrieval",
                                     options=[{"label": v, "value": k} for k, v in RANK_LABELS.items()]),
                        html.Label("Retrieval sweep id (from the Heads page)", htmlFor=ids.ABL_SWEEP),
                        dcc.Input(id=ids.ABL_SWEEP, className="hs-text-input", debounce=True, value=""),
                        html.Div([
                            html.Label("k", htmlFor=ids.ABL_K),
                            dcc.Input(id=ids.ABL_K, type="number", min=1, value=5, className="hs-number", **KEEP),
                            html.Button("Top k", id=ids.ABL_TOPK, n_clicks=0, className="hs-button"),
                            html.Label("seed", htmlFor=ids.ABL_SEED),
                            dcc.Input(id=ids.ABL_SEED, type="number", min=0, value=0, className="hs-number", **KEEP),
                            html.Button("Random k", id=ids.ABL_RANDOM, n_clicks=0, className="hs-button"),
                            html.Button("Clear", id=ids.ABL_CLEAR, n_clicks=0, className="hs-button"),
                        ], className="hs-options"),
                        html.P(random_rule(CONTROL_TOP_N), id=RANDOM_RULE, className="hs-hint"),
                    ], className="hs-panel hs-field"),
                ],
                className="hs-panels hs-even",
            ),
            dcc.Loading(html.Div(id=ids.ABL_INFO, className="hs-run-info"), type="dot"),
            html.Div([
                dcc.Graph(id=ids.ABL_EFFECTS, figure=EMPTY, config=GRAPH_CONFIG),
                export_bar(PREFIX, names.ABLATION_EFFECTS),
                html.Div(id=ids.ABL_SUMMARY, className="hs-abl-summary"),
                html.Button("Keep this set for comparison", id=ids.ABL_KEEP, n_clicks=0, className="hs-button"),
                dash_table.DataTable(id=ids.ABL_KEPT_TABLE, sort_action="native", row_deletable=True,
                                     style_cell={"fontFamily": "inherit", "fontSize": 13, "padding": "3px 8px",
                                                 "textAlign": "left", "whiteSpace": "normal"}),
            ], className="hs-panel"),
            html.H3("Top-k heads by the score against k random heads", className="hs-section"),
            html.Div(
                [
                    html.Label("k values", htmlFor=ids.ABL_CURVE_KS),
                    dcc.Input(id=ids.ABL_CURVE_KS, value=",".join(map(str, DEFAULT_CURVE_KS)),
                              className="hs-text-input", **KEEP),
                    html.Label("random seeds", htmlFor=ids.ABL_CURVE_SEEDS),
                    dcc.Input(id=ids.ABL_CURVE_SEEDS, type="number", min=0, max=10, value=DEFAULT_SEEDS,
                              className="hs-number", **KEEP),
                    html.Label("random heads from outside the top", htmlFor=ids.ABL_CURVE_CONTROL),
                    dcc.Input(id=ids.ABL_CURVE_CONTROL, type="number", min=0, value=CONTROL_TOP_N,
                              className="hs-number", **KEEP),
                    dcc.RadioItems(id=ids.ABL_CURVE_METRIC, inline=True, value="loss", **KEEP, options=[
                        {"label": f" {CURVE_METRICS['loss']} on this text", "value": "loss"},
                        {"label": f" {CURVE_METRICS['niah']} on the sweep's prompts", "value": "niah"}]),
                    html.Button("Run curve", id=ids.ABL_CURVE_RUN, n_clicks=0, className="hs-run"),
                    html.Button("Cancel", id=ids.ABL_CURVE_CANCEL, n_clicks=0, className="hs-button hs-cancel",
                                disabled=True),
                    html.Progress(id=ids.ABL_CURVE_PROGRESS, value="0", max="100", className="hs-progress"),
                    html.Span(id=ids.ABL_CURVE_STATUS, className="hs-hint", role="status"),
                ],
                className="hs-options",
            ),
            html.Div([dcc.Graph(id=ids.ABL_CURVE, figure=empty_figure("No curve yet."), config=GRAPH_CONFIG),
                      export_bar(PREFIX, names.ABLATION_CURVE)], className="hs-panel"),
            html.H3("Ablate each head alone", className="hs-section"),
            html.Div(
                [
                    dcc.RadioItems(id=ids.ABL_SWEEP_METRIC, inline=True, value="loss", **KEEP, options=[
                        {"label": f" {label}", "value": name} for name, label in SWEEP_METRICS.items()]),
                    html.Button("Sweep all heads", id=ids.ABL_SWEEP_RUN, n_clicks=0, className="hs-run"),
                    html.Button("Cancel", id=ids.ABL_SWEEP_CANCEL, n_clicks=0, className="hs-button hs-cancel",
                                disabled=True),
                    html.Progress(id=ids.ABL_SWEEP_PROGRESS, value="0", max="100", className="hs-progress"),
                    html.Span(id=ids.ABL_SWEEP_STATUS, className="hs-hint", role="status"),
                ],
                className="hs-options",
            ),
            html.Div([dcc.Graph(id=ids.ABL_HEAD_SWEEP, figure=empty_figure("No single-head sweep yet."),
                                config=GRAPH_CONFIG), export_bar(PREFIX, names.ABLATION_HEAD_SWEEP)], className="hs-panel"),
        ]
    )


def _after_run(old: PageState, model, run) -> PageState:
    """A new text keeps the chosen heads, method and the sweep/reference ids; per-text results go."""
    return PageState(model=model.name, run=run.key[:16], heads=old.heads, ablate=old.ablate, by=old.by,
                     sweep=old.sweep, ref=old.ref, source=old.source, k=old.k, seed=old.seed)


KEPT_ON_RUN = ("heads", "ablate", "by", "sweep", "ref", "source", "k", "seed")  # _after_run's, as URL keys
register_run(PREFIX, _after_run, KEPT_ON_RUN)
register_export(PREFIX)
fill_text_from_runs(PREFIX)
# the line under the heads box, in the browser from the selection and the effects shown (assets/ablation.js)
clientside_callback(ClientsideFunction(namespace="headscope_ablation", function_name="line"),
                    Output(ids.ABL_CHOSEN, "children"), Input(ids.ABL_PENDING, "data"), Input(ids.ABL_PANEL, "data"))
# the effects panel's one owner: the render's and Apply's figures and Cancel, each an event for the same
# reducer, run in the browser in the order they arrive (assets/ablation.js reduce; its module comment
# has the state × event table)
PANEL = (Output(ids.ABL_EFFECTS, "figure", allow_duplicate=True), Output(ids.ABL_SUMMARY, "children", allow_duplicate=True),
         Output(ids.ABL_PANEL, "data", allow_duplicate=True))
clientside_callback(ClientsideFunction(namespace="headscope_ablation", function_name="asked"), *PANEL,
                    Input(ids.ABL_EFFECTS_ASKED, "data"), State(url_id(PREFIX), "search"), State(ids.ABL_PANEL, "data"),
                    prevent_initial_call=True)
clientside_callback(ClientsideFunction(namespace="headscope_ablation", function_name="applied"), *PANEL,
                    Input(ids.ABL_APPLIED, "data"), State(url_id(PREFIX), "search"), State(ids.ABL_PANEL, "data"),
                    prevent_initial_call=True)
clientside_callback(ClientsideFunction(namespace="headscope_ablation", function_name="cancel"), *PANEL,
                    Output(ids.ABL_APPLY_STATUS, "children", allow_duplicate=True),
                    Input(ids.ABL_APPLY_CANCEL, "n_clicks"), State(ids.ABL_EFFECTS_ASKED, "data"),
                    State(ids.ABL_PANEL, "data"), prevent_initial_call=True)

RENDER = ("grid", "asked", "curve", "head_sweep", "info", "error", "text", "model", "heads", "method", "by", "sweep",
          "map", "drawn", "pending", "from_link")


@callback(
    output=dict(
        grid=Output(ids.ABL_GRID, "figure"),
        asked=Output(ids.ABL_EFFECTS_ASKED, "data"),  # the effects panel's figure, an event (:func:`_asked`)
        curve=Output(ids.ABL_CURVE, "figure"),
        head_sweep=Output(ids.ABL_HEAD_SWEEP, "figure"),
        info=Output(ids.ABL_INFO, "children"),
        error=Output(ids.ERROR, "children", allow_duplicate=True),
        text=Output(text_fill_id(PREFIX), "data"),  # into the text box in the browser, never over an edit
        model=Output(model_id(PREFIX), "value"),
        heads=Output(ids.ABL_HEADS, "value"),
        method=Output(ids.ABL_METHOD, "value"),
        by=Output(ids.ABL_BY, "value"),
        sweep=Output(ids.ABL_SWEEP, "value"),
        map=Output(ids.ABL_MAP, "data"),
        drawn=Output(ids.ABL_DRAWN, "data"),
        pending=Output(ids.ABL_PENDING, "data"),
        from_link=Output(ids.ABL_FROM_LINK, "data"),
    ),
    inputs=[Input(url_id(PREFIX), "search")],
    state=[State(ids.ABL_PENDING, "data")],
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
    prevent_initial_call="initial_duplicate",
)
@guarded(outputs=RENDER)
def render(search, pending):
    """Draw the page from its URL; never computes effects. A link opened afresh with an applied set
    (its ``heads``) hands the set to the Apply job (:func:`apply`: progress, Cancel), as Apply does for
    heads chosen on the page: a link reproduces its result, and a job can show progress and be stopped
    where a render cannot. The effects panel's figure is an event for the panel's reducer
    (:func:`_asked`), which decides whether it is shown.

    On the page's first draw (no pending selection yet) the map, the heads box, the Method and the
    selection are the URL's; after it they are the user's (:func:`choose`, :func:`draw_map`): the
    Method is what the next Apply uses, the URL's is the last one applied."""
    state = parse(search)
    pending = _pending(pending)
    problems = list(state.problems)
    params = ablation_params(state)
    context = get_context()
    run = context.run(state.run) if state.run else None
    if state.run and run is None:
        problems.append(f"No stored run has the id {state.run!r}: run the text again.")
    out = {"by": state.by, "sweep": state.sweep or "", "map": {"key": _map_key(state)},  # draw_map draws it
           "curve": _stored_figure(names.ABLATION_CURVE, "curve", params, "No curve yet.", problems),
           "head_sweep": _stored_figure(names.ABLATION_HEAD_SWEEP, "hsweep", params, "No single-head sweep yet.",
                                        problems)}
    applied = None
    if state.heads:
        try:  # as the job writes it (a link may say kv:20.2 or 7.*)
            applied = format_heads(sorted(set(parse_heads(load_model(params["model"]), state.heads))))
        except ValueError as e:
            problems.append(str(e))
    if pending is None:  # the page's first draw
        out.update(grid=_selection_map(run, params, problems), drawn=_map_key(state), heads=state.heads or "",
                   method=state.ablate, pending=applied or "")
    key = _applied_key(state)
    effects, computing = EMPTY, False
    if run is not None:
        out.update(text=run.text or "", model=run.model_name,
                   info=html.Div([html.Span(f"run {run.short_id}", className="hs-chip"),
                                  html.Span(f"{run.n_tokens} tokens", className="hs-chip"),
                                  html.Span(f"method: {state.ablate}", className="hs-chip")]))
        if state.heads and pending is None:  # a link with an applied set: it runs as the Apply job
            if applied:
                effects, computing = empty_figure(f"Computing the effects of this link's {len(applied.split(','))} "
                                                  "heads (progress by Apply; Cancel stops it)."), True
                out["from_link"] = key
        elif state.heads:  # a new text on this page: nothing heavy runs until Apply
            effects = WAITING
    else:
        out["info"] = ""
    return {**out, "asked": _asked(search, key, effects, computing), "error": message(problems)}


def _stored_figure(view: str, param: str, params: dict, none: str, problems: list[str]):
    """The figure of a stored result the URL names (the curve, the single-head sweep), or a note."""
    if params[param]:
        try:
            return VIEWS[view].build(None, params)[0]
        except ValueError as e:
            problems.append(str(e))
    return empty_figure(none)


CANCELLED = empty_figure("Cancelled: Apply computes the effects of the chosen heads.")


def _asked(search: str, key: list, figure, computing: bool) -> dict:
    """The render's event for the effects panel (assets/ablation.js ``reduce``): ``figure`` for the URL
    ``search`` and the text and applied set ``key``; ``computing`` when the render started a link's Apply
    job, whose Cancel then shows ``cancelled``."""
    return {"search": search, "key": key, "figure": figure, "computing": computing, "cancelled": CANCELLED}


def _selection_map(run, params: dict, problems: list[str]):
    """The layer × head map coloured by the ranking score with the chosen heads boxed: of this text's
    run, or without one of a retrieval sweep's scores (they need no text); the empty map otherwise."""
    if run is None and not (params["by"] == "retrieval" and params.get("sweep")):
        return EMPTY
    try:
        grid, _ = VIEWS[names.ABLATION_SELECTION].build(run, params)
    except ValueError as e:
        problems.append(str(e))
        return EMPTY
    return grid


def _map_key(state: PageState) -> list:
    """What the map's colours depend on: the run and the score it ranks by."""
    return [state.model, state.run, state.by, state.sweep, state.hsweep]


_PENDING = re.compile(r"[0-9]{1,4}\.[0-9]{1,4}(,[0-9]{1,4}\.[0-9]{1,4})*")


def _pending(value) -> str | None:
    """The pending selection kept in the browser (``"3.1,5.0"``; ``""``: none), or None when there is
    none yet (or the value is not one this page writes)."""
    if isinstance(value, str) and (value == "" or len(value) < 20_000 and _PENDING.fullmatch(value)):
        return value
    return None


def _applied_key(state: PageState) -> list:
    """What an effects result depends on, from the URL state that applied it."""
    return [state.model, state.run, state.heads, state.ablate, state.ref, state.source]


def _applied_event(key: list, run, state: PageState, applied: AppliedAblation, model) -> dict:
    """Apply's event for the effects panel (assets/ablation.js ``reduce``): the effects of ``key`` (the
    text and applied set), their summary, and the numbers *Keep* adds to the table."""
    spec = applied.spec
    effects, _ = VIEWS[names.ABLATION_EFFECTS].build(run, ablation_params(state))  # drawn from ``applied``
    return {"key": key, "figure": effects, "summary": _summary(model, applied), "row": {
        "run": run.short_id, "heads": format_heads(spec.heads), "n_heads": len(spec.heads), "method": spec.method,
        "loss_clean": round(applied.loss_clean, 4), "loss_ablated": round(applied.loss_ablated, 4),
        "d_loss": round(applied.d_loss, 4),
        "p_next_clean": round(applied.p_next_clean, 4), "p_next_ablated": round(applied.p_next_ablated, 4),
        "link": state.to_search()}}


def _summary(model, applied: AppliedAblation) -> html.Div:
    """Next-token top-5 before/after and the greedy continuations side by side."""
    spec, fx = applied.spec, applied.effects
    strings = model.token_strings

    def top(ids_, probs):
        return html.Ol([html.Li(f"{s!r}  {p:.3f}") for s, p in zip(strings([int(i) for i in ids_]), probs, strict=True)])

    return html.Div([
        html.Div([html.H4("Next token, clean"), top(fx.top_ids_clean[-1], fx.top_probs_clean[-1]),
                  html.H4("Continuation, clean"), html.Pre(model.tokenizer.decode(fx.continuation_clean),
                                                          className="hs-continuation")], className="hs-panel"),
        html.Div([html.H4(f"Next token, {spec.method} ablation of {len(spec.heads)} heads"),  # named by the line above
                  top(fx.top_ids_ablated[-1], fx.top_probs_ablated[-1]),
                  html.H4("Continuation, ablated"), html.Pre(model.tokenizer.decode(fx.continuation_ablated),
                                                            className="hs-continuation")], className="hs-panel"),
    ], className="hs-panels hs-even")


# A click on the map toggles the head in the pending selection in the browser, at once, and repaints
# the boxes and the count there (assets/grid_clicks.js): every click is applied, in order, however fast
# they come; the heads box is written there too. ``choose`` then writes the line under the box.


@callback(
    output=dict(
        pending=Output(ids.ABL_PENDING, "data", allow_duplicate=True),
        heads=Output(ids.ABL_HEADS, "value", allow_duplicate=True),
        grid=Output(ids.ABL_GRID, "figure", allow_duplicate=True),
        drawn=Output(ids.ABL_DRAWN, "data", allow_duplicate=True),
        error=job_error(PREFIX),  # with Redis this is a job: not the banner (page_shell.job_error)
    ),
    inputs=[Input(ids.ABL_PENDING, "data"), Input(ids.ABL_HEADS, "value"), Input(ids.ABL_TOPK, "n_clicks"),
            Input(ids.ABL_RANDOM, "n_clicks"), Input(ids.ABL_CLEAR, "n_clicks")],
    state=[State(ids.ABL_BY, "value"), State(ids.ABL_SWEEP, "value"), State(ids.ABL_K, "value"),
           State(ids.ABL_SEED, "value"), State(ids.ABL_CURVE_CONTROL, "value"), State(url_id(PREFIX), "search")],
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
    prevent_initial_call=True,
)
@guarded(outputs=("pending", "heads", "grid", "drawn", "error"))
def choose(pending, heads_text, _top, _random, _clear, by, sweep_id, k, seed, control_top, search):
    """Change the pending selection (the heads box, top k, random k, clear; map clicks change it in
    the browser): redrawn on the map and written in the box (the line under it follows in the browser,
    assets/ablation.js); nothing is computed until Apply. The banner is left alone when nothing
    changes: after the first draw it says what that draw found (a bad link).

    Dash holds this while :func:`render` is under way (its Inputs are render's outputs), then sends
    one request for everything that happened meanwhile, so a button clicked then is read first, before
    the selection the render wrote: it is the user's action, the write is not."""
    state = parse(search)
    triggered = dash.ctx.triggered_prop_ids
    context = get_context()
    model = load_model(state.model or context.default_model)
    pending = _pending(pending)
    current = state.heads if pending is None else pending
    chosen = set(parse_heads(model, current)) if current else set()
    run = context.run(state.run) if state.run else None
    buttons = [b for b in (ids.ABL_CLEAR, ids.ABL_RANDOM, ids.ABL_TOPK) if b + ".n_clicks" in triggered]
    typed = _typed(model, heads_text) if not buttons and ids.ABL_HEADS + ".value" in triggered else chosen
    if buttons:
        action = buttons[0]
    elif typed != chosen:
        action = ids.ABL_HEADS
    else:  # a click (the browser wrote the box, the map and the line), render's first draw, or the box's echo
        raise PreventUpdate
    if action == ids.ABL_CLEAR:
        chosen = set()
    elif action == ids.ABL_RANDOM:  # the curve's random control: outside the top N by the score
        scores, _ = rank_scores(run, {**ablation_params(state), "by": by, "sweep": (sweep_id or "").strip() or None})
        chosen = set(random_control(scores, int(k or 0), int(seed or 0), _whole(control_top)))
    elif action == ids.ABL_TOPK:
        chosen = set(top_heads(run, {**ablation_params(state), "by": by, "sweep": (sweep_id or "").strip() or None},
                               int(k or 0)))
    elif action == ids.ABL_HEADS:
        chosen = typed
    heads = format_heads(sorted(chosen))
    problems: list[str] = []
    grid = _selection_map(run, {**ablation_params(state), "heads": heads or None}, problems)
    return {"pending": heads, "heads": heads, "grid": grid, "drawn": _map_key(state), "error": message(problems)}


def random_rule(outside_top: int) -> str:
    """The line beside "Random k": the rule it draws by (:func:`headscope.analysis.ablation_curve.random_control`)."""
    return (f"Random k draws k heads (with the seed) from outside the top {outside_top:,} by the score above, "
            f"as the curve's random control does (N = “random heads from outside the top” below, or k if larger).")


@callback(Output(RANDOM_RULE, "children"), Input(ids.ABL_CURVE_CONTROL, "value"))
def random_rule_line(control_top):
    """The line beside "Random k" follows the curve's top N as it is typed (and as the browser
    restores it)."""
    try:
        n = _whole(control_top)
    except ValueError as e:
        return str(e)
    return random_rule(n) if n >= 0 else f"The random control's top N must be at least 0, got {n}."


def _typed(model, heads_text) -> set:
    """The heads written in the heads box."""
    text = heads_text if isinstance(heads_text, str) else ""
    return set(parse_heads(model, text)) if text.strip() else set()


@callback(
    Output(ids.ABL_GRID, "figure", allow_duplicate=True),
    Output(ids.ABL_DRAWN, "data", allow_duplicate=True),
    job_error(PREFIX),
    Input(ids.ABL_MAP, "data"),
    Input(ids.ABL_PENDING, "data"),
    State(ids.ABL_DRAWN, "data"),
    State(url_id(PREFIX), "search"),
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
    prevent_initial_call=True,
)
@guarded(outputs=3)
def draw_map(wanted, pending, drawn, search):
    """After the page's first draw: the map of the run and score the page's URL names, with the selection
    as it is now, when the map shows another run or score (:func:`render` asks after each redraw).

    Not in :func:`render` or :func:`choose`: each reads the selection as it starts, and Dash drops the
    answer of a callback asked again while it runs, so either could put back an old selection or lose a
    new one. This reads the selection as it is asked, and is asked again by every change of it (map
    clicks too: then, the map showing its run and score already, it draws nothing)."""
    pending = _pending(pending)
    if pending is None or not isinstance(wanted, dict) or wanted.get("key") == drawn:
        raise PreventUpdate
    state = parse(search)
    run = get_context().run(state.run) if state.run else None
    problems: list[str] = []
    grid = _selection_map(run, {**ablation_params(state), "heads": pending or None}, problems)
    return grid, _map_key(state), message(problems) if problems else no_update  # the render's message stays


@callback(
    Output(url_patch_id(PREFIX), "data", allow_duplicate=True),  # a job on workers: into the URL as it is then
    job_error(PREFIX),
    Input(ids.ABL_BY, "value"),
    Input(ids.ABL_SWEEP, "value"),
    State(url_id(PREFIX), "search"),
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
    prevent_initial_call=True,
)
@guarded(outputs=2)
def rank_by(by, sweep_id, search):
    """The score the map is coloured and top k ranked by (kept in the URL)."""
    state = parse(search)
    if dash.ctx.triggered_id == ids.ABL_BY:
        if by == state.by:
            raise PreventUpdate
        state.by = by
    else:
        new = (sweep_id or "").strip().lower() or None
        if new == state.sweep:
            raise PreventUpdate
        if new is not None:
            from headscope.app.views.heads import sweep_of

            sweep_of({"sweep": new})  # a clear message now if there is no such sweep
        state.sweep = new
    return url_patch(search, state.to_search()), ""


EFFECT_STEPS = ("the clean pass", "the ablated pass", "the clean continuation", "the ablated continuation")
# rough cost of each step in forward passes: a continuation is CONTINUATION_TOKENS passes
STEP_COST = (1, 1, CONTINUATION_TOKENS, CONTINUATION_TOKENS)


def _step_reporter(set_progress):
    """Progress of the effects' steps (:func:`headscope.analysis.ablation_effects.effects_on`: ``fraction`` =
    steps done / 4, 0 as they begin) as "i of n" with an estimate of the time left from the steps' costs
    in forward passes, timed from that first report (after the method's reference)."""
    started: list[float] = []

    def report(fraction: float) -> None:
        if not started:
            started.append(time.monotonic())
        done = min(len(EFFECT_STEPS), round(fraction * len(EFFECT_STEPS)))
        cost = sum(STEP_COST[:done])
        left = ""
        if 0 < done < len(EFFECT_STEPS):
            seconds = (time.monotonic() - started[0]) * (sum(STEP_COST) - cost) / cost
            left = f", about {seconds:.0f} s left"
        now = EFFECT_STEPS[done] if done < len(EFFECT_STEPS) else "drawing"
        set_progress((str(round(100 * cost / sum(STEP_COST))), "100",
                      f"effects: {done} of {len(EFFECT_STEPS)} steps done, now {now}{left}"))

    return report


@cancellable_callback(
    Output(url_patch_id(PREFIX), "data", allow_duplicate=True),  # into the URL as it is then
    Output(ids.ABL_APPLIED, "data"),  # an event for the effects panel (:func:`_applied_event`)
    Output(ids.ABL_APPLY_STATUS, "children"),
    Input(ids.ABL_APPLY, "n_clicks"),
    Input(ids.ABL_FROM_LINK, "data"),
    State(ids.ABL_PENDING, "data"),
    State(ids.ABL_HEADS, "value"),
    State(ids.ABL_METHOD, "value"),
    State(ids.ABL_SOURCE, "value"),
    State(ids.ABL_REFERENCE, "value"),
    State(url_id(PREFIX), "search"),
    run=ids.ABL_APPLY, cancel=ids.ABL_APPLY_CANCEL, progress=ids.ABL_APPLY_PROGRESS, status=ids.ABL_APPLY_STATUS,
    prevent_initial_call=True,
)
def apply(set_progress, n_clicks, from_link, pending, heads_text, method, source, reference, search):
    """Apply: the effects of the chosen heads, once for the whole set, as a cancellable job; the
    applied set goes into the URL (a link reproduces it). A link opened afresh starts it too
    (:func:`render`): then the set, method, means and source are the link's own, as its URL names
    them, not the boxes' (a resample source or mean reference is not computed again).

    The heads are the heads box's: every choice (a click, top k, a list typed) is written there, and
    the box is read as Apply is pressed, so a list typed without Enter is the list applied. The result
    is an event for the effects panel's reducer (:func:`_applied_event`), which shows it only if the
    page still shows its text."""
    in_job()
    link = dash.ctx.triggered_id == ids.ABL_FROM_LINK
    if not (from_link if link else n_clicks):
        raise PreventUpdate
    started = time.monotonic()
    state = parse(search)
    try:
        context = get_context()
        model = load_model(state.model or context.default_model)
        run = context.run(state.run) if state.run else None
        if run is None:
            raise ValueError("Run a text first: the heads are ablated on it.")
        pending = None if link else _pending(pending)
        if pending is not None and isinstance(heads_text, str):  # the page is drawn: its box
            heads = heads_text
        else:
            heads = state.heads if pending is None else pending
        if not heads:
            raise ValueError("No heads chosen: click heads in the map, type them, or pick the top k; then Apply.")
        state.ablate = state.ablate if link else method or "zero"
        needs: dict = {}  # what the method needs, from the boxes; a link's stored means (ref) and source as they are
        if link:
            stored = ablation_spec(model, {**ablation_params(state), "heads": heads})
            needs = {"means": stored.means, "source": stored.source_ids}
        elif state.ablate == "resample":
            source = source if isinstance(source, str) else ""
            if not source.strip():
                raise ValueError("Resample ablation needs a source text: write one in the box, then Apply.")
            set_progress(("0", "100", "effects: running the source text"))
            needs = {"source": source}
        elif state.ablate == "mean":
            reference = reference if isinstance(reference, str) else ""
            texts = [t for t in reference.splitlines() if t.strip()] or builtin_reference()
            needs = {"reference": texts,
                     "reference_progress": count_progress(set_progress, len(texts), "means: reference text")}
        applied = apply_ablation(model, run, heads, state.ablate, **needs, store=context.store,
                                 progress=_step_reporter(set_progress))
        state.heads = format_heads(applied.spec.heads)
        if applied.source_key:  # a source text captured and stored now
            state.source = applied.source_key[:16]
        if not link and applied.means_key:
            state.ref = applied.means_key[:16]
        remember_effects(run, ablation_params(state), applied)
        event = _applied_event(_applied_key(state), run, state, applied, model)
    except USER_ERRORS as e:  # the panel shows why only where it says a link's set is computing
        return no_update, {"failed": empty_figure(f"No effects: {e}")}, str(e)
    seconds = time.monotonic() - started
    # the set and how it was ablated are written whole: a link never names a method its effects did not use
    return (url_patch(search, state.to_search(), on=("run",), what="Apply's result", status=ids.ABL_APPLY_STATUS,
                      reset=("heads", "ablate", "ref", "source")), event,
            f"{len(applied.spec.heads)} heads, {applied.spec.method} ablation: effects in {seconds:.1f} s")


@callback(
    Output(ids.ABL_KEPT, "data"),
    Input(ids.ABL_KEEP, "n_clicks"),
    Input(ids.ABL_KEPT_TABLE, "data"),
    State(ids.ABL_KEPT, "data"),
    State(ids.ABL_PANEL, "data"),
    prevent_initial_call=True,
)
def keep(n_clicks, table, kept, shown):
    """Keep the shown set's numbers (stored in the browser) to compare sets; deleting a row forgets it."""
    kept = _rows(kept)  # kept in the browser's storage: whatever is there is checked, not trusted
    if dash.ctx.triggered_id == ids.ABL_KEPT_TABLE:
        remaining = {r["set"] for r in _rows(table)}
        if remaining == {r["set"] for r in kept}:
            raise PreventUpdate  # the table only echoed the store: no row was deleted
        return [r for r in kept if r["set"] in remaining]
    if not n_clicks or not (isinstance(shown, dict) and shown.get("shows") == "effects"
                            and isinstance(shown.get("row"), dict)):
        raise PreventUpdate  # no effects on the page (the panel's state: assets/ablation.js)
    number = 1 if not kept else max(r["set"] for r in kept) + 1
    row = {k: v for k, v in shown["row"].items() if k in KEPT_COLUMNS or k == "link"}
    return [*kept, {"set": number, **row}]


KEPT_COLUMNS = ("set", "run", "heads", "n_heads", "method", "loss_clean", "loss_ablated", "d_loss", "p_next_clean",
                "p_next_ablated")


def _rows(value) -> list[dict]:
    """The kept sets' rows in ``value``; anything that is not a row with a whole-number set is dropped."""
    if not isinstance(value, list):
        return []
    return [r for r in value if isinstance(r, dict) and isinstance(r.get("set"), int) and not isinstance(r["set"], bool)]


@callback(Output(ids.ABL_KEPT_TABLE, "data"), Output(ids.ABL_KEPT_TABLE, "columns"), Input(ids.ABL_KEPT, "data"))
def show_kept(kept):
    return _rows(kept), [{"name": c, "id": c} for c in KEPT_COLUMNS]


def _whole(value) -> int:
    """The control's top N as typed (a whole number; its range is checked by the analysis)."""
    if value is None or value == "":
        return CONTROL_TOP_N
    if isinstance(value, int) and not isinstance(value, bool):
        return value  # exact, however large (a float would round it)
    try:
        n = float(value)
    except (TypeError, ValueError):
        n = float("nan")
    if not n.is_integer() or isinstance(value, bool):
        raise ValueError(f"The random control's top N must be a whole number, got {value!r}.")
    return int(n)


def _ks(text: str) -> list[int]:
    """The k values typed in the box (their range is checked by the analysis)."""
    try:
        return sorted({int(x) for x in str(text or "").replace(";", ",").split(",") if x.strip()})
    except ValueError:
        shown = str(text) if len(str(text)) <= 40 else str(text)[:40] + "…"
        raise ValueError(f"k values must be whole numbers separated by commas, got {shown!r}.") from None


@cancellable_callback(
    Output(url_patch_id(PREFIX), "data", allow_duplicate=True),  # into the URL as it is then
    Output(ids.ABL_CURVE_STATUS, "children"),
    Input(ids.ABL_CURVE_RUN, "n_clicks"),
    State(ids.ABL_CURVE_KS, "value"),
    State(ids.ABL_CURVE_SEEDS, "value"),
    State(ids.ABL_CURVE_CONTROL, "value"),
    State(ids.ABL_CURVE_METRIC, "value"),
    State(url_id(PREFIX), "search"),
    run=ids.ABL_CURVE_RUN, cancel=ids.ABL_CURVE_CANCEL, progress=ids.ABL_CURVE_PROGRESS, status=ids.ABL_CURVE_STATUS,
    stale=(ids.ABL_CURVE,), prevent_initial_call=True,
)
def run_curve(set_progress, n_clicks, ks_text, n_seeds, control_top, metric, search):
    in_job()
    if not n_clicks:
        raise PreventUpdate
    state = parse(search)
    try:
        context = get_context()
        model = load_model(state.model or context.default_model)
        params = ablation_params(state)
        seeds = list(range(int(n_seeds or 0)))
        run = context.run(state.run) if state.run else None
        scores, by_label = rank_scores(run, params)
        spec = ablation_spec(model, {**params, "heads": "0.0"})  # the method and its options
        if metric == "niah":
            from headscope.app.views.heads import sweep_of

            if not state.sweep:
                raise ValueError("Needle-in-a-haystack accuracy needs a sweep: give its id (from the Heads page).")
            on = sweep_of({"sweep": state.sweep})
        elif run is None:
            raise ValueError("Run a text first: the curve's loss is measured on it.")
        else:
            on = run
        ks = _ks(ks_text)
        # one evaluation per k for the top heads and per k and seed for the random ones
        key, curve, meta = ablation_curve(model, scores, ks, spec, context.store, on=on,
                                          by_label=by_label, seeds=seeds, outside_top=_whole(control_top),
                                          source_id=state.source,
                                          progress=count_progress(set_progress, len(ks) * (1 + len(seeds)),
                                                                  "curve point"))
    except ValueError as e:
        return no_update, str(e)
    state.curve = key[:16]
    top_k, rand = f"{curve.top[-1]:.3f}", f"{curve.random_mean[-1] if seeds else float('nan'):.3f}"
    if curve.n_prompts is not None:  # an accuracy: n and the 95 % Wilson interval (the random control's pooled)
        top_k = curve.top_accuracy()[-1].text()
        rand = curve.random_pooled()[-1].text() + " over all seeds' prompts" if seeds else rand
    return (url_patch(search, state.to_search(), on=("run",), what="The ablation curve", status=ids.ABL_CURVE_STATUS),
            f"k={curve.k_values[-1]}: top {top_k}, random {rand} (outside the top {curve.outside_top}; "
            f"{meta['metric_label']}{', 95 % Wilson' if curve.n_prompts is not None else ''})")


@cancellable_callback(
    Output(url_patch_id(PREFIX), "data", allow_duplicate=True),  # into the URL as it is then
    Output(ids.ABL_SWEEP_STATUS, "children"),
    Input(ids.ABL_SWEEP_RUN, "n_clicks"),
    State(ids.ABL_SWEEP_METRIC, "value"),
    State(url_id(PREFIX), "search"),
    run=ids.ABL_SWEEP_RUN, cancel=ids.ABL_SWEEP_CANCEL, progress=ids.ABL_SWEEP_PROGRESS, status=ids.ABL_SWEEP_STATUS,
    prevent_initial_call=True,
)
def run_head_sweep(set_progress, n_clicks, metric, search):
    in_job()
    if not n_clicks:
        raise PreventUpdate
    state = parse(search)
    try:
        context = get_context()
        model = load_model(state.model or context.default_model)
        run = context.run(state.run) if state.run else None
        if run is None:
            raise ValueError("Run a text first: each head is ablated on it.")
        spec = ablation_spec(model, {**ablation_params(state), "heads": "0.0"})
        key, result = ablation_head_sweep(model, run, spec, metric or "loss", context.store, source_id=state.source,
                                          progress=count_progress(set_progress, model.n_layers * model.n_heads,
                                                                  "head"))
    except ValueError as e:
        return no_update, str(e)
    state.hsweep = key[:16]
    return (url_patch(search, state.to_search(), on=("run",), what="The single-head sweep", status=ids.ABL_SWEEP_STATUS),
            f"{model.n_layers * model.n_heads} heads in {result.seconds:.1f} s")
