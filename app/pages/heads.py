"""Page "Heads": retrieval heads from needle-in-a-haystack sweeps (Wu et al. 2024), beside
streaming, sink, entropy, evidence and induction-type scores over the sweep's prompts; a head's
trials show why it scored."""

from __future__ import annotations

import functools
import json
import logging

import dash
from dash import Input, Output, Patch, State, callback, dash_table, dcc, html, no_update
from dash.exceptions import PreventUpdate

from headscope.analysis.errors import InputError
from headscope.analysis.head_scan import scan, task_scan
from headscope.analysis.long_context_tasks import MAX_LENGTH as TASK_MAX_LENGTH
from headscope.analysis.long_context_tasks import MAX_PER_TASK, TASKS, TaskSuite
from headscope.analysis.long_context_tasks import MIN_LENGTH as TASK_MIN_LENGTH
from headscope.analysis.models import load_model
from headscope.analysis.niah import (
    DEFAULT_DEPTH_RULE,
    DEPTH_RULE_DESCRIPTIONS,
    MAX_LENGTH,
    check_lengths,
    check_streaming_window,
    load_needles,
    named_haystack,
    parse_needles,
)
from headscope.analysis.retrieval import SweepSettings, sweep_settings
from headscope.analysis.score_registry import HEAD_SCORES
from headscope.analysis.streaming import DEFAULT_SINK, DEFAULT_WINDOW
from headscope.analysis.task_retrieval import check_task_sweep, task_sweep_settings
from headscope.app import figures, ids
from headscope.app.choice_fields import show_with_choice
from headscope.app.context import get_context
from headscope.app.errors import USER_ERRORS, guarded, message
from headscope.app.export_bar import export_bar, register_export
from headscope.app.form_values import number_list, whole_number
from headscope.app.grid_clicks import head_clicks, select_head
from headscope.app.jobs import cancellable_callback, in_job, on_workers, progress_reporter, trial_progress
from headscope.app.page_shell import (
    GRAPH_CONFIG,
    empty_figure,
    job_error,
    page_location,
    query_store_id,
    register_url_keys,
    shell_stores,
    show_in_shell,
    url_id,
    url_patch,
    url_patch_id,
)
from headscope.app.run_bar import PROMPT_POLICY_TITLE, prompt_policy
from headscope.app.uploads import register_upload, upload_field, upload_file, upload_file_id
from headscope.app.url_state import parse
from headscope.app.views import VIEWS, names
from headscope.app.views.heads import (
    AGGREGATES,
    check_sweep_head,
    head_trials,
    retrieval_table,
    sweep_of,
    sweep_params,
)

dash.register_page(__name__, path="/heads", name="Heads", title="headscope — retrieval and streaming heads", order=2)

PREFIX = "heads"
log = logging.getLogger("headscope.app")
EMPTY = empty_figure("Run a sweep to score every head.")
NO_STEPS = empty_figure("Click a head in the map, then a trial.")
TOP_K = 20
FIGURES = (ids.HEADS_GRID, ids.HEADS_HIST, ids.HEADS_SCATTER, ids.HEADS_SCORE_GRID, ids.HEADS_MASS, ids.HEADS_NIAH,
           ids.HEADS_STEPS)  # what a new sweep replaces
KEEP = {"persistence": True, "persistence_type": "session"}  # settings survive the page's re-render
PROMPT_SOURCES = [
    {"label": " needles: the ticked (or my own) needles at the depths, in the haystack", "value": "needles"},
    {"label": " the long-context task suite: RULER-style tasks, each prompt with its own text and depths",
     "value": "tasks"}]
MAX_SEED = 10**6  # the seeds the form offers: a million distinct suites (Python takes any seed >= 0)
NEEDLES_HINT = ("Your own needles, one per line: needle | question | answer — e.g. "
                "The vault code is 7731. | What is the vault code? | 7731 (or paste needles.json).")


# The page's figures in four groups, each drawn from the URL keys its figures show (a store per group,
# changed only when those keys change: headscope.app.page_shell.register_url_keys). A click on a head redraws its
# trials and decode steps and moves the outline on both maps; a trial redraws its decode steps only.
SELECTION = ("layer", "head")  # drawn as an outline patched onto the maps (draw_selection), not by redrawing them


def _url_keys(*views: str, more: tuple[str, ...] = (), less: tuple[str, ...] = SELECTION) -> list[str]:
    """The URL keys the ``views`` are drawn from (each view's own params, and the model), with ``more``
    and without ``less``."""
    return sorted({"model", *more, *(p for v in views for p in VIEWS[v].params)} - set(less))


KEYS = {
    "sweep": register_url_keys(PREFIX, "sweep", _url_keys(
        names.RETRIEVAL_GRID, names.RETRIEVAL_HISTOGRAM, names.NIAH_GRID, more=("sink_size", "window"))),  # + info
    "scores": register_url_keys(PREFIX, "scores", _url_keys(
        names.RETRIEVAL_SCATTER, names.HEAD_SCORE_GRID, names.SCORE_MASS)),
    "selection": register_url_keys(PREFIX, "selection", ["agg", "head", "layer", "sweep"]),  # outlines, trials
    "steps": register_url_keys(PREFIX, "steps", _url_keys(names.TRIAL_STEPS, less=())),
}
GRID_DRAWN = f"{PREFIX}-hs-grid-drawn"  # the retrieval map's shape ([layers, heads]) once drawn, else None
SCORES_DRAWN = f"{PREFIX}-hs-scores-drawn"  # the same for the score map


def _needle_options():
    try:
        return [{"label": f" {n.id}: {n.answer}", "value": n.id} for n in load_needles()]
    except ValueError:
        return []


def _task_fields() -> html.Div:
    """Where the sweep's prompts come from, and the task suite's tasks, prompts per task and seed."""
    return html.Div([
        html.Label("Prompts", htmlFor=ids.HEADS_PROMPT_SOURCE),
        dcc.RadioItems(id=ids.HEADS_PROMPT_SOURCE, **KEEP, value="needles", options=PROMPT_SOURCES),
        html.Div([
            html.Label(f"Tasks (at the context lengths, {TASK_MIN_LENGTH:,} to {TASK_MAX_LENGTH:,} tokens)",
                       htmlFor=ids.HEADS_TASKS),
            dcc.Checklist(id=ids.HEADS_TASKS, **KEEP, value=["passkey", "single_needle", "multi_key"],
                          options=[{"label": f" {t.label}", "value": name, "title": t.description}
                                   for name, t in TASKS.items()]),
            html.Label("Prompts per task and length, seed", htmlFor=ids.HEADS_PER_TASK),
            html.Div([dcc.Input(id=ids.HEADS_PER_TASK, **KEEP, type="number", min=1, max=MAX_PER_TASK, step=1,
                                value=5, className="hs-number"),
                      dcc.Input(id=ids.HEADS_TASK_SEED, **KEEP, type="number", min=0, max=MAX_SEED, step=1, value=0,
                                className="hs-number")]),
        ], id=ids.HEADS_TASK_FIELDS, hidden=True),
    ], className="hs-field")


# each choice of prompts shows its own fields; the lengths, S and W and the newline rule serve both
show_with_choice(ids.HEADS_PROMPT_SOURCE, {ids.HEADS_TASK_FIELDS: "tasks", ids.HEADS_NEEDLE_FIELDS: "needles",
                                           ids.HEADS_OWN_FIELDS: "needles"})


def task_suite(source, tasks, per_task, seed, lengths) -> TaskSuite | None:
    """The task suite the form asks for (None: the needles), checked here, trial limit included: a request
    need not come from the form."""
    if source not in [o["value"] for o in PROMPT_SOURCES]:
        raise InputError("Choose whether the sweep runs the needles or the task suite.")
    if source == "needles":
        return None
    if not isinstance(tasks, list) or not tasks:
        raise InputError("Tick at least one task of the suite, or run the needles.")
    return check_task_sweep(TaskSuite(
        tuple(tasks), tuple(number_list(lengths, "Context lengths", int)),
        whole_number(per_task, "Prompts per task and length", 1, MAX_PER_TASK),
        whole_number(seed, "The task suite's seed", 0, MAX_SEED)))


def _sweep_settings() -> html.Div:
    """The sweep form: needles, lengths, depths, haystack, streaming-score S and W, depth rule, own haystack
    and needles, or the task suite (filled from a sweep's own settings when a link names one)."""
    options = _needle_options()
    return html.Div(
        [
            _task_fields(),
            html.Div([
                html.Label("Needles"),
                dcc.Checklist(id=ids.HEADS_NEEDLES, **KEEP, options=options, value=[o["value"] for o in options[:4]],
                              className="hs-needles"),
                html.Label("Depths (%)", htmlFor=ids.HEADS_DEPTHS),
                dcc.Input(id=ids.HEADS_DEPTHS, **KEEP, value="10,50,90", className="hs-text-input"),
                html.Label("Haystack", htmlFor=ids.HEADS_HAYSTACK),
                dcc.Dropdown(id=ids.HEADS_HAYSTACK, **KEEP, clearable=False, value="prose", options=[
                    {"label": "prose (shipped essays)", "value": "prose"},
                    {"label": "passkey (synthetic filler)", "value": "passkey"},
                    {"label": "my own (paste or upload below)", "value": "custom"}]),
                html.Label("Needle placed at", htmlFor=ids.HEADS_DEPTH_RULE),
                dcc.RadioItems(id=ids.HEADS_DEPTH_RULE, **KEEP, value=DEFAULT_DEPTH_RULE, options=[
                    {"label": f" {text}", "value": r} for r, text in DEPTH_RULE_DESCRIPTIONS.items()]),
            ], id=ids.HEADS_NEEDLE_FIELDS, className="hs-field"),
            html.Div([
                html.Label("Context lengths (tokens)", htmlFor=ids.HEADS_LENGTHS),
                dcc.Input(id=ids.HEADS_LENGTHS, **KEEP, value="512", className="hs-text-input"),
                html.Label("Streaming score: sink size S, window W", htmlFor=ids.HEADS_SINK),
                html.Div([dcc.Input(id=ids.HEADS_SINK, **KEEP, type="number", min=0, max=MAX_LENGTH, step=1, value=DEFAULT_SINK,
                                    className="hs-number"),
                          dcc.Input(id=ids.HEADS_WINDOW, **KEEP, type="number", min=1, max=MAX_LENGTH, step=1,
                                    value=DEFAULT_WINDOW,
                                    className="hs-number")]),
                dcc.Checklist(id=ids.HEADS_STOP_NEWLINE, **KEEP, value=[], options=[
                    {"label": " stop each answer at its first newline (the paper's rule)", "value": "on"}]),
            ], className="hs-field"),
            html.Div([
                html.Label("Own haystack (used when Haystack is 'my own')", htmlFor=ids.HEADS_CUSTOM_HAYSTACK),
                dcc.Textarea(id=ids.HEADS_CUSTOM_HAYSTACK, **KEEP, className="hs-textarea",
                             placeholder="Paste prose here, or upload a UTF-8 .txt file."),
                *upload_field(ids.HEADS_HAYSTACK_UPLOAD, "Upload a .txt haystack"),
                html.Label("Own needles (used instead of the ticked ones when given)",
                           htmlFor=ids.HEADS_CUSTOM_NEEDLES),
                dcc.Textarea(id=ids.HEADS_CUSTOM_NEEDLES, **KEEP, className="hs-textarea", placeholder=NEEDLES_HINT),
            ], id=ids.HEADS_OWN_FIELDS, className="hs-field hs-wide"),
        ],
        className="hs-sweep-settings",
    )


def layout(**_query) -> html.Div:
    return html.Div(
        [
            page_location(PREFIX),
            shell_stores(PREFIX),
            dcc.Store(id=query_store_id(PREFIX)),
            dcc.Store(id=ids.HEADS_FORM_SWEEP),
            *[dcc.Store(id=store) for store in (*KEYS.values(), GRID_DRAWN, SCORES_DRAWN)],
            html.P(id=ids.HEADS_FORM_NOTE, className="hs-hint", role="status"),
            _sweep_settings(),
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
                        # a cell per query head only under the query-head aggregation (else its cells are key-value groups)
                        head_clicks(dcc.Graph(id=ids.HEADS_GRID, figure=EMPTY, config=GRAPH_CONFIG),
                                    select_head(ids.HEADS_GRID, PREFIX, drop=("trial",), when={"agg": ("query", None)})),
                        export_bar(PREFIX, names.RETRIEVAL_GRID),
                    ], className="hs-panel"),
                    html.Div([
                        html.H4(f"Top {TOP_K} heads (click a row to open its trials)", className="hs-section"),
                        dash_table.DataTable(id=ids.HEADS_TOPK, sort_action="native", page_size=TOP_K,
                                             style_cell={"fontFamily": "inherit", "fontSize": 13, "padding": "3px 8px"},
                                             style_data={"cursor": "pointer"},
                                             style_header={"fontWeight": "600"}),
                    ], className="hs-panel"),
                ],
                className="hs-panels",
            ),
            html.Div(
                [
                    html.Div([dcc.Graph(id=ids.HEADS_HIST, figure=EMPTY, config=GRAPH_CONFIG),
                              export_bar(PREFIX, names.RETRIEVAL_HISTOGRAM)], className="hs-panel"),
                    html.Div([dcc.Graph(id=ids.HEADS_SCATTER, figure=EMPTY, config=GRAPH_CONFIG),
                              export_bar(PREFIX, names.RETRIEVAL_SCATTER)], className="hs-panel"),
                ],
                className="hs-panels hs-even",
            ),
            html.Div(
                [
                    html.H4("Other per-head scores, over every prompt of the sweep", className="hs-section"),
                    html.Div([
                        dcc.Dropdown(id=ids.HEADS_SCORE, clearable=False, value="streaming",
                                     options=[{"label": s.label, "value": s.name} for s in HEAD_SCORES.values()],
                                     className="hs-score-select"),
                        dcc.RadioItems(id=ids.HEADS_STAT, inline=True, value="mean", options=[
                            {"label": " mean", "value": "mean"}, {"label": " spread (std)", "value": "std"}]),
                    ], className="hs-options"),
                    html.Div([
                        html.Div([head_clicks(dcc.Graph(id=ids.HEADS_SCORE_GRID, figure=EMPTY, config=GRAPH_CONFIG),
                                              select_head(ids.HEADS_SCORE_GRID, PREFIX, drop=("trial",))),
                                  export_bar(PREFIX, names.HEAD_SCORE_GRID)], className="hs-panel"),
                        html.Div([dcc.Graph(id=ids.HEADS_MASS, figure=EMPTY, config=GRAPH_CONFIG),
                                  export_bar(PREFIX, names.SCORE_MASS)], className="hs-panel"),
                    ], className="hs-panels hs-even"),
                ],
                className="hs-panel",
            ),
            html.Div([dcc.Graph(id=ids.HEADS_NIAH, figure=EMPTY, config=GRAPH_CONFIG), export_bar(PREFIX, names.NIAH_GRID)],
                     className="hs-panel"),
            html.Div(
                [
                    html.H4("Trials of the selected head (click a row to see its decode steps)", className="hs-section"),
                    dash_table.DataTable(id=ids.HEADS_TRIALS, sort_action="native", page_size=12,
                                         style_cell={"fontFamily": "inherit", "fontSize": 13, "padding": "3px 8px",
                                                     "whiteSpace": "normal", "textAlign": "left"}),
                    dcc.Graph(id=ids.HEADS_STEPS, figure=NO_STEPS, config=GRAPH_CONFIG),
                    export_bar(PREFIX, names.TRIAL_STEPS),
                ],
                className="hs-panel",
            ),
        ]
    )


register_export(PREFIX, lambda state: None)  # every view here is drawn from the sweep in its params




def _haystack(choice: str | None, pasted: str | None) -> str:
    if choice != "custom":  # a shipped one by name; never a path (a request could name any file)
        return named_haystack(choice or "prose")
    text = (pasted or "").strip()
    if not text:
        raise ValueError("The own haystack is empty: paste text or upload a .txt file, or choose 'prose'.")
    return text


def _needles(ticked: list[str] | None, custom: str | None):
    if custom and custom.strip():
        return parse_needles(custom)
    chosen = [n for n in load_needles() if n.id in set(ticked or [])]
    if not chosen:
        raise ValueError("Choose at least one needle, or write your own.")
    return chosen


show_in_shell(PREFIX)


@callback(
    Output(ids.HEADS_CUSTOM_HAYSTACK, "value"),
    Output(ids.HEADS_HAYSTACK, "value"),
    Output(ids.HEADS_STATUS, "children", allow_duplicate=True),
    Output(ids.ERROR, "children", allow_duplicate=True),
    Input(upload_file_id(ids.HEADS_HAYSTACK_UPLOAD), "data"),
    prevent_initial_call=True,
)
def upload_haystack(file):
    """An uploaded .txt becomes the own haystack (shown in the box, so it can be checked and edited);
    a file that cannot be one is explained in the app's error banner."""
    if not file:
        raise PreventUpdate
    try:
        text, name = upload_file(file, "a plain UTF-8 .txt haystack")
    except ValueError as e:
        return no_update, no_update, "", message(str(e))
    return text, "custom", f"Loaded {name} ({len(text):,} characters) as the haystack.", ""


register_upload(ids.HEADS_HAYSTACK_UPLOAD)


def _needles_text(needles: list) -> str:
    """Needles as the own-needles box takes them: one ``needle | question | answer`` per line when
    that reads back as the same needles (ids and kinds included), else as JSON."""
    lines = "\n".join(f"{n.needle} | {n.question} | {n.answer}" for n in needles)
    try:
        if parse_needles(lines) == list(needles):
            return lines
    except ValueError:
        pass
    return json.dumps([n.to_dict() for n in needles], ensure_ascii=False, indent=1)


def _form_values(settings: SweepSettings) -> tuple[list[str], str, str, str, str]:
    """(ticked needles, own needles, lengths, depths, haystack choice) that run ``settings`` again."""
    shipped = {n.id: n for n in load_needles()}
    if all(shipped.get(n.id) == n for n in settings.needles):
        ticked, own = [n.id for n in settings.needles], ""
    else:  # the own-needles box is used instead of the ticked ones: tick none, so the form reads true
        ticked, own = [], _needles_text(settings.needles)
    return (ticked, own, ",".join(str(n) for n in settings.lengths), ",".join(f"{d:g}" for d in settings.depths),
            settings.haystack or "custom")


@callback(
    output=dict(
        needles=Output(ids.HEADS_NEEDLES, "value"),
        own_needles=Output(ids.HEADS_CUSTOM_NEEDLES, "value"),
        lengths=Output(ids.HEADS_LENGTHS, "value"),
        depths=Output(ids.HEADS_DEPTHS, "value"),
        haystack=Output(ids.HEADS_HAYSTACK, "value", allow_duplicate=True),
        sink=Output(ids.HEADS_SINK, "value"),
        window=Output(ids.HEADS_WINDOW, "value"),
        depth_rule=Output(ids.HEADS_DEPTH_RULE, "value"),
        stop_newline=Output(ids.HEADS_STOP_NEWLINE, "value"),
        source=Output(ids.HEADS_PROMPT_SOURCE, "value"),
        tasks=Output(ids.HEADS_TASKS, "value"),
        per_task=Output(ids.HEADS_PER_TASK, "value"),
        seed=Output(ids.HEADS_TASK_SEED, "value"),
        note=Output(ids.HEADS_FORM_NOTE, "children"),
        filled=Output(ids.HEADS_FORM_SWEEP, "data"),
    ),
    # not every change of the URL: a head or trial click leaves the form
    inputs=[Input(KEYS["sweep"], "data")],
    state=[State(url_id(PREFIX), "search"), State(ids.HEADS_FORM_SWEEP, "data"),
           State(ids.HEADS_CUSTOM_HAYSTACK, "value")],
    prevent_initial_call=True,
)
def form_from_sweep(_keys, search, filled, own_haystack):
    """A link with ``sweep=`` fills the form with that sweep's own settings
    (:func:`headscope.analysis.retrieval.sweep_settings`), not the defaults, so Run reruns that sweep.
    A link without one, or naming no stored sweep (the page's render says so), leaves the form."""
    state = parse(search)
    if state.sweep is None or state.sweep == filled:
        raise PreventUpdate
    store = get_context().store
    keys = store.find(state.sweep)
    on_tasks = task_sweep_settings(store, keys[0]) if len(keys) == 1 else None
    settings = sweep_settings(store, keys[0]) if len(keys) == 1 and on_tasks is None else None
    if settings is None and on_tasks is None:
        raise PreventUpdate
    note = f"Settings filled from sweep {state.sweep[:12]}: Run reruns them."
    same = {"sink": DEFAULT_SINK if state.sink_size is None else state.sink_size,
            "window": DEFAULT_WINDOW if state.window is None else state.window, "note": note, "filled": state.sweep}
    if on_tasks is not None:  # the task suite's fields; the needles' are left as they are
        suite = on_tasks.suite
        return {**dict.fromkeys(("needles", "own_needles", "depths", "haystack", "depth_rule"), no_update), **same,
                "lengths": ",".join(str(n) for n in suite.lengths), "source": "tasks", "tasks": list(suite.tasks),
                "per_task": suite.n_per_task, "seed": suite.seed,
                "stop_newline": ["on"] if on_tasks.stop_at_newline else []}
    ticked, own, lengths, depths, haystack = _form_values(settings)
    if settings.haystack is None and not (own_haystack or "").strip():
        same["note"] += " It used its own haystack, which is not stored with it: paste or upload that text again."
    return {"needles": ticked, "own_needles": own, "lengths": lengths, "depths": depths, "haystack": haystack, **same,
            "depth_rule": settings.depth_rule, "stop_newline": ["on"] if settings.stop_at_newline else [],
            "source": "needles", **dict.fromkeys(("tasks", "per_task", "seed"), no_update)}


@cancellable_callback(
    Output(url_patch_id(PREFIX), "data", allow_duplicate=True),  # into the URL as it is then
    Output(ids.HEADS_STATUS, "children"),
    job_error(PREFIX),
    Input(ids.HEADS_RUN, "n_clicks"),
    State(ids.HEADS_NEEDLES, "value"),
    State(ids.HEADS_CUSTOM_NEEDLES, "value"),
    State(ids.HEADS_LENGTHS, "value"),
    State(ids.HEADS_DEPTHS, "value"),
    State(ids.HEADS_HAYSTACK, "value"),
    State(ids.HEADS_CUSTOM_HAYSTACK, "value"),
    State(ids.HEADS_SINK, "value"),
    State(ids.HEADS_WINDOW, "value"),
    State(ids.HEADS_DEPTH_RULE, "value"),
    State(ids.HEADS_STOP_NEWLINE, "value"),
    State(ids.HEADS_PROMPT_SOURCE, "value"),
    State(ids.HEADS_TASKS, "value"),
    State(ids.HEADS_PER_TASK, "value"),
    State(ids.HEADS_TASK_SEED, "value"),
    State(url_id(PREFIX), "search"),
    run=ids.HEADS_RUN, cancel=ids.HEADS_CANCEL, progress=ids.HEADS_PROGRESS, status=ids.HEADS_STATUS,
    stale=FIGURES, prevent_initial_call=True,
)
def run_sweep(set_progress, n_clicks, needle_ids, custom_needles, lengths, depths, haystack, custom_haystack,
              sink, window, depth_rule, stop_newline, source, tasks, per_task, seed, search):
    in_job()
    if not n_clicks:
        raise PreventUpdate
    try:
        # the form first, so a request that cannot run says so before the model loads
        suite = task_suite(source, tasks, per_task, seed, lengths)
        if suite is None:
            chosen = _needles(needle_ids, custom_needles)
            lengths_ = check_lengths(number_list(lengths, "Context lengths", int))
            depths_ = number_list(depths, "Depths")
        else:
            lengths_ = list(suite.lengths)
        sink_ = whole_number(sink, "The sink size S", 0, MAX_LENGTH)
        window_ = whole_number(window, "The window W", 1, MAX_LENGTH)
        check_streaming_window(sink_, window_, lengths_)
        context = get_context()
        model = load_model(context.default_model)
        # the sweep, then the other per-head scores, stored: the page's figures read them back
        scores_progress = progress_reporter(set_progress, "scoring heads")
        if suite is None:
            result = scan(model, chosen, lengths_, depths_, _haystack(haystack, custom_haystack), sink=sink_,
                          window=window_, depth_rule=depth_rule or DEFAULT_DEPTH_RULE,
                          stop_at_newline=bool(stop_newline), store=context.store,
                          progress=trial_progress(set_progress, len(lengths_) * len(depths_) * len(chosen)),
                          scores_progress=scores_progress).sweep
        else:
            result = task_scan(model, suite, sink=sink_, window=window_, stop_at_newline=bool(stop_newline),
                               store=context.store, scores_progress=scores_progress,
                               progress=trial_progress(set_progress,
                                                       len(suite.tasks) * len(suite.lengths) * suite.n_per_task)).sweep
        if not result.trials:
            return no_update, "No trial finished.", ""
        state = parse(search)
        state.sweep, state.trial = result.key[:16], None
        state.sink_size = None if sink_ == DEFAULT_SINK else sink_
        state.window = None if window_ == DEFAULT_WINDOW else window_
    except ValueError as e:  # what the user asked cannot run: said where every page says it
        return no_update, "", message(str(e))
    note = (f"{result.n_counted}/{result.n_trials} trials answered, accuracy {result.overall_accuracy().text()} "
            f"(95 % Wilson); {result.share_above(0.1):.1%} of heads score > 0.1")
    return url_patch(search, state.to_search(), reset=("trial",)), note, ""


def _whole(state) -> dict:
    """A sweep view's params for a map drawn whole: without the selected head, which is patched on."""
    return {**sweep_params(state), "layer": None, "head": None}


@callback(
    output=dict(
        grid=Output(ids.HEADS_GRID, "figure"),
        top=Output(ids.HEADS_TOPK, "data"),
        histogram=Output(ids.HEADS_HIST, "figure"),
        niah=Output(ids.HEADS_NIAH, "figure"),
        info=Output(ids.HEADS_INFO, "children"),
        agg=Output(ids.HEADS_AGG, "value"),
        grid_drawn=Output(GRID_DRAWN, "data"),
        error=job_error(PREFIX),  # with Redis this is a job: not the banner (page_shell.job_error)
    ),
    inputs=[Input(KEYS["sweep"], "data")],
    state=[State(url_id(PREFIX), "search")],
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
    prevent_initial_call=True,
)
@guarded(outputs=("grid", "top", "histogram", "niah", "info", "agg", "grid_drawn", "error"))
def draw_sweep(_keys, search):
    """The sweep's own figures (retrieval map, top 20, histogram, NIAH accuracy, its chips); the
    banner says what is wrong with the link."""
    state = parse(search)
    problems = list(state.problems)
    blank = {"grid": EMPTY, "top": [], "histogram": EMPTY, "niah": EMPTY, "info": "", "agg": state.agg,
             "grid_drawn": None}
    if state.sweep is None:
        return {**blank, "error": message(problems)}
    try:
        sw = sweep_of({"sweep": state.sweep})
    except ValueError as e:
        return {**blank, "error": message([*problems, str(e)])}
    params = _whole(state)
    grid, grid_rows = VIEWS[names.RETRIEVAL_GRID].build(None, params)
    top = sorted(grid_rows, key=lambda r: -r["retrieval"] if r["retrieval"] == r["retrieval"] else 1)[:TOP_K]
    for r in top:
        r["retrieval"] = round(r["retrieval"], 4)
    hist, _ = VIEWS[names.RETRIEVAL_HISTOGRAM].build(None, params)
    niah, _ = VIEWS[names.NIAH_GRID].build(None, params)
    info = html.Div([
        html.Span(f"sweep {sw.key[:12]}", className="hs-chip"),
        html.Span(f"{sw.n_counted}/{sw.n_trials} trials counted (ROUGE-1 recall > 0.5)", className="hs-chip"),
        html.Span(f"NIAH accuracy {sw.overall_accuracy().text()}", className="hs-chip", id=ids.HEADS_ACCURACY,
                  title="Trials answered of trials decoded, with its 95 % Wilson score interval"),
        html.Span(sw.grid_text(), className="hs-chip"),
        html.Span(sw.settings_text(), className="hs-chip"),
        html.Span(f"streaming S={params['sink_size']}, W={params['window']}", className="hs-chip"),
        *([html.Span(policy, className="hs-chip", title=PROMPT_POLICY_TITLE)]
          if (policy := prompt_policy(params["model"])) else []),
        html.Span("cancelled: partial" if sw.cancelled else "complete", className="hs-chip"),
        dcc.Link("Ablate the top retrieval heads →", href=f"/ablation?sweep={sw.key[:16]}&by=retrieval",
                 id=ids.HEADS_ABLATE_LINK, className="hs-chip"),
    ])
    shape = list(retrieval_table(sw, state.agg).shape)
    return {"grid": grid, "top": top, "histogram": hist, "niah": niah, "info": info, "agg": state.agg,
            "grid_drawn": {"shape": shape, "sweep": sw.key}, "error": message(problems)}


def _in_place(shown_in: tuple[str, ...], outputs: tuple[str, ...]):
    """A callback with named ``outputs`` whose problem is shown in its figures' place (the outputs
    named in ``shown_in``; the others are left as they are), not in the banner, which
    :func:`draw_sweep` owns. Outputs the callback leaves out are left as they are too."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args):
            try:
                given = fn(*args)
                unknown = set(given) - set(outputs)
                if unknown:
                    raise KeyError(f"{fn.__name__} returned outputs it does not declare: {sorted(unknown)}")
                return {name: given.get(name, no_update) for name in outputs}
            except PreventUpdate:
                raise
            except USER_ERRORS as e:
                text = str(e)
            except Exception as e:  # a bug: logged with its traceback, a short message shown
                log.exception("callback %s failed", fn.__name__)
                text = f"Something went wrong ({type(e).__name__}). The server log has the details."
            return {name: empty_figure(text) if name in shown_in else no_update for name in outputs}
        return inner
    return wrap


@callback(
    output=dict(
        scatter=Output(ids.HEADS_SCATTER, "figure"),
        score_grid=Output(ids.HEADS_SCORE_GRID, "figure"),
        mass=Output(ids.HEADS_MASS, "figure"),
        score=Output(ids.HEADS_SCORE, "value"),
        stat=Output(ids.HEADS_STAT, "value"),
        scores_drawn=Output(SCORES_DRAWN, "data"),
    ),
    inputs=[Input(KEYS["scores"], "data")],
    state=[State(url_id(PREFIX), "search")],
    **on_workers(),
    prevent_initial_call=True,
)
@_in_place(("scatter", "score_grid", "mass"), ("scatter", "score_grid", "mass", "score", "stat", "scores_drawn"))
def draw_scores(_keys, search):
    """The other per-head scores over the sweep's prompts: the score map, retrieval against the score,
    and its cumulative mass; a score this sweep does not have is said in their place."""
    state = parse(search)
    blank = {"scatter": EMPTY, "score_grid": EMPTY, "mass": EMPTY, "score": state.score, "stat": state.stat,
             "scores_drawn": None}
    if state.sweep is None:
        return blank
    try:
        sw = sweep_of({"sweep": state.sweep})
    except ValueError:  # the banner says so (draw_sweep)
        return blank
    params = _whole(state)
    return {"scatter": VIEWS[names.RETRIEVAL_SCATTER].build(None, params)[0],
            "score_grid": VIEWS[names.HEAD_SCORE_GRID].build(None, params)[0],
            "mass": VIEWS[names.SCORE_MASS].build(None, params)[0], "score": state.score, "stat": state.stat,
            "scores_drawn": {"shape": list(sw.scores.shape), "sweep": sw.key}}


def _outline(drawn, head: tuple[int, int] | None):
    """The selected head's outline as a patch of a map drawn whole (``drawn``: its shape), or no change
    when no map is drawn there (an outline on an empty figure would float over nothing)."""
    shape = drawn.get("shape") if isinstance(drawn, dict) else None
    if not (isinstance(shape, list) and len(shape) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) for n in shape)):
        return no_update  # nothing drawn there, or not what draw_sweep and draw_scores write (a forged request)
    patch = Patch()
    inside = head is not None and 0 <= head[0] < shape[0] and 0 <= head[1] < shape[1]
    patch["layout"]["shapes"] = [figures.head_outline(*head)] if inside else []
    return patch


@callback(
    Output(ids.HEADS_GRID, "figure", allow_duplicate=True),
    Output(ids.HEADS_SCORE_GRID, "figure", allow_duplicate=True),
    Output(ids.HEADS_TRIALS, "data"),
    Output(ids.HEADS_TRIALS, "active_cell"),
    Input(KEYS["selection"], "data"),
    Input(GRID_DRAWN, "data"),  # after a map is drawn whole (Dash waits for draw_sweep and draw_scores)
    Input(SCORES_DRAWN, "data"),
    State(url_id(PREFIX), "search"),
    **on_workers(),
    prevent_initial_call=True,
)
def draw_selection(_keys, grid_drawn, scores_drawn, search):
    """The selected head: its outline on both maps (on the retrieval map only under the query-head
    aggregation, whose cells are heads), and its trials when the head or sweep changed, none of them
    chosen yet (a row still chosen from the last head would make a click on that row for this one do nothing)."""
    state = parse(search)
    head = (state.layer, state.head) if state.layer is not None and state.head is not None else None
    trials = chosen = no_update
    if f"{KEYS['selection']}.data" in dash.ctx.triggered_prop_ids:
        trials, chosen = [], None
        if state.sweep is not None and head is not None:
            try:
                sw = sweep_of({"sweep": state.sweep})
                trials = head_trials(sw, *check_sweep_head(sw, *head))
            except ValueError:  # no such sweep (the banner says so) or head (the decode steps say so)
                trials = []
    return _outline(grid_drawn, head if state.agg == "query" else None), _outline(scores_drawn, head), trials, chosen


@callback(
    output=dict(steps=Output(ids.HEADS_STEPS, "figure")),
    inputs=[Input(KEYS["steps"], "data")],
    state=[State(url_id(PREFIX), "search")],
    **on_workers(),
    prevent_initial_call=True,
)
@_in_place(("steps",), ("steps",))
def draw_steps(_keys, search):
    """The selected head's attention row at each decode step of the selected trial."""
    state = parse(search)
    if state.sweep is None or state.layer is None or state.head is None:
        return {"steps": NO_STEPS}
    return {"steps": VIEWS[names.TRIAL_STEPS].build(None, sweep_params(state))[0]}


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Input(ids.HEADS_AGG, "value"),
    Input(ids.HEADS_SCORE, "value"),
    Input(ids.HEADS_STAT, "value"),
    Input(ids.HEADS_TRIALS, "active_cell"),
    Input(ids.HEADS_TOPK, "active_cell"),
    State(ids.HEADS_TRIALS, "derived_viewport_data"),
    State(ids.HEADS_TOPK, "derived_viewport_data"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def select(agg, score, stat, cell, top_cell, rows, top_rows, search):
    """What the user picked, into the URL: a head (a top-20 row: its trials and decode steps), the
    aggregation, the score and statistic, or a trial. A click on a map cell selects its head in the
    browser (assets/grid_clicks.js), from the mouse press rather than plotly's click, so a click soon after
    another is not read as the first one's head."""
    state = parse(search)
    trigger = dash.ctx.triggered_id
    if trigger == ids.HEADS_TOPK:
        row = _row(top_cell, top_rows)
        if row is None or "head" not in row or state.agg != "query":  # a key-value group row: as its map cell
            return no_update
        try:
            state.layer, state.head, state.trial = int(row["layer"]), int(row["head"]), None
        except (KeyError, TypeError, ValueError):
            return no_update
    elif trigger == ids.HEADS_AGG and agg and agg != state.agg:
        state.agg = agg
    elif trigger == ids.HEADS_SCORE and score and score != state.score:
        state.score = score
    elif trigger == ids.HEADS_STAT and stat and stat != state.stat:
        state.stat = stat
    elif trigger == ids.HEADS_TRIALS and _row(cell, rows) is not None:
        try:
            state.trial = int(_row(cell, rows)["trial"])
        except (KeyError, TypeError, ValueError):
            return no_update
    else:
        return no_update
    return state.to_search()


def _row(cell, rows) -> dict | None:
    """The table row an ``active_cell`` points at in the rows shown (sorted as the user sees them)."""
    if not (isinstance(cell, dict) and isinstance(rows, list)):
        return None
    index = cell.get("row")
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(rows):
        return None
    return rows[index] if isinstance(rows[index], dict) else None
