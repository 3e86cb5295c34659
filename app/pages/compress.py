"""Page "Compress": KV-cache compression from head classes (DuoAttention, RazorAttention). Each key-value
group keeps its full cache or only S sinks + W recent tokens; the groups ranked highest by a head score
stay full. Run evaluates every (ranking, fraction) policy on a needle-in-a-haystack sweep's prompts (or on
the long-context task suite's, :mod:`headscope.analysis.long_context_tasks`, the sweep still ranking) as a
background job (:func:`headscope.analysis.kv_compression_sweep.compress_sweep`, which ``headscope compress`` calls
too); the URL names the stored curve, so a link reopens it without computing. A chosen policy downloads
as DuoAttention's pattern folder (:func:`headscope.analysis.pattern_folder.export_policy`)."""

from __future__ import annotations

import io
import tempfile
import time
import zipfile
from pathlib import Path

import dash
from dash import Input, Output, State, callback, dash_table, dcc, html, no_update
from dash.exceptions import PreventUpdate

from headscope.analysis.ablation_choices import MAX_SEEDS
from headscope.analysis.errors import InputError
from headscope.analysis.kv_compression_choices import (
    BACKEND_LABELS,
    BACKENDS,
    DEFAULT_FRACTIONS,
    DEFAULT_RANKINGS,
    DEFAULT_RECENT_SIZE,
    DEFAULT_SEEDS,
    DEFAULT_SINK_SIZE,
    DEFAULT_TOLERANCE,
    RANKING_LABELS,
    RANKINGS,
)
from headscope.analysis.long_context_tasks import MAX_PER_TASK, TASKS
from headscope.analysis.models import load_model
from headscope.analysis.niah import MAX_LENGTH, check_lengths, load_needles, named_haystack
from headscope.app import ids
from headscope.app.choice_fields import show_with_choice
from headscope.app.context import dropdown_model, get_context, offered_model
from headscope.app.errors import guarded, message
from headscope.app.export_bar import export_bar, register_export
from headscope.app.form_values import number_list, whole_number
from headscope.app.jobs import cancellable_callback, in_job, on_workers, progress_reporter, trial_progress
from headscope.app.page_shell import (
    GRAPH_CONFIG,
    empty_figure,
    job_error,
    page_download,
    page_location,
    query_store_id,
    shell_stores,
    show_in_shell,
    url_id,
    url_patch,
    url_patch_id,
)
from headscope.app.url_state import parse
from headscope.app.views import VIEWS, names
from headscope.app.views.compress import (
    chosen_evaluation,
    compress_params,
    curve_rows,
    decision_text,
    parse_pick,
    pick_text,
    smallest_within,
    stored_curve,
)

dash.register_page(__name__, path="/compress", name="Compress", title="headscope — KV-cache compression", order=7)

PREFIX = "kv"
EMPTY = empty_figure("Run the evaluation to see what each policy keeps and costs.")
NO_POLICY = empty_figure("The chosen policy's map appears here.")
DEFAULT_TOL_POINTS = round(DEFAULT_TOLERANCE * 100)
TABLE_COLUMNS = [("ranking", "ranking"), ("seed", "seed"), ("fraction_full", "groups full"),
                 ("n_full_groups", "full groups"), ("kv_fraction", "KV kept"), ("kv_mib", "KV MiB"),
                 ("loss", "mean loss"), ("agreement", "next-token agreement"), ("niah_accuracy", "NIAH accuracy"),
                 ("niah_interval", "NIAH 95 % interval (Wilson)"), ("niah_n", "NIAH n (prompts)"),
                 ("niah_seed_band", "random: seeds' mean, lowest–highest")]
MAX_FRACTIONS = 12
PROMPT_SOURCES = [{"label": " the needle sweep's prompts", "value": "sweep"},
                  {"label": " the task suite (RULER-style; the sweep still ranks the heads, and tasks the "
                            "uncompressed model answers less than half the time are dropped)", "value": "tasks"}]

# the task suite's fields show while the suite is chosen (the sweep's needles still rank the heads)
show_with_choice(ids.KV_PROMPT_SOURCE, {ids.KV_TASK_FIELDS: "tasks"})


def _needle_options() -> list[dict]:
    try:
        return [{"label": f" {n.id}: {n.answer}", "value": n.id} for n in load_needles()]
    except ValueError:
        return []


def layout(**_query) -> html.Div:
    context = get_context()
    needles = _needle_options()
    return html.Div([
        page_location(PREFIX),
        shell_stores(PREFIX),
        dcc.Store(id=query_store_id(PREFIX)),
        html.Div([
            html.Div([
                html.H4("Prompts: a needle-in-a-haystack sweep", className="hs-section"),
                html.Label("Stored sweep id (from the Heads page; empty: run the settings below)", htmlFor=ids.KV_SWEEP),
                dcc.Input(id=ids.KV_SWEEP, className="hs-text-input", value="", placeholder="e.g. 3f9a01c2"),
                html.Label("Needles"),
                dcc.Checklist(id=ids.KV_NEEDLES, options=needles, value=[o["value"] for o in needles[:2]],
                              className="hs-needles"),
                html.Label("Context lengths (tokens)", htmlFor=ids.KV_LENGTHS),
                dcc.Input(id=ids.KV_LENGTHS, value="1024", className="hs-text-input"),
                html.Label("Depths (%)", htmlFor=ids.KV_DEPTHS),
                dcc.Input(id=ids.KV_DEPTHS, value="25,75", className="hs-text-input"),
                html.Label("Haystack", htmlFor=ids.KV_HAYSTACK),
                dcc.Dropdown(id=ids.KV_HAYSTACK, clearable=False, value="prose", options=[
                    {"label": "prose (shipped essays)", "value": "prose"},
                    {"label": "passkey (synthetic filler)", "value": "passkey"}]),
                html.Label("NIAH accuracy measured on", htmlFor=ids.KV_PROMPT_SOURCE),
                dcc.RadioItems(id=ids.KV_PROMPT_SOURCE, value="sweep", options=PROMPT_SOURCES, className="hs-methods"),
                html.Div([
                    html.Label("Tasks (at the context lengths above, 1,024 to 8,192 tokens)", htmlFor=ids.KV_TASKS),
                    dcc.Checklist(id=ids.KV_TASKS, value=["single_needle", "multi_key", "passkey"],
                                  className="hs-methods", options=[{"label": f" {t.label}: {t.description}", "value": name}
                                                                   for name, t in TASKS.items()]),
                    html.Label("Prompts per task and length", htmlFor=ids.KV_PER_TASK),
                    dcc.Input(id=ids.KV_PER_TASK, type="number", min=1, max=MAX_PER_TASK, step=1, value=5,
                              className="hs-number"),
                ], id=ids.KV_TASK_FIELDS, hidden=True),
                html.Label("Model", htmlFor=ids.KV_MODEL),
                dcc.Dropdown(id=ids.KV_MODEL, options=context.model_options(), value=context.default_model,
                             clearable=False, className="hs-model"),
            ], className="hs-panel hs-field"),
            html.Div([
                html.H4("Policies: per KV group, full cache or S sinks + W recent tokens", className="hs-section"),
                html.Label("Rankings of KV groups (the highest kept full)", htmlFor=ids.KV_RANKINGS),
                dcc.Checklist(id=ids.KV_RANKINGS, value=list(DEFAULT_RANKINGS), className="hs-methods",
                              options=[{"label": f" {RANKING_LABELS[r]}", "value": r} for r in RANKINGS]),
                html.Label("Fractions of KV groups kept full", htmlFor=ids.KV_FRACTIONS),
                dcc.Input(id=ids.KV_FRACTIONS, value=",".join(f"{f:g}" for f in DEFAULT_FRACTIONS),
                          className="hs-text-input"),
                html.Div([
                    html.Label("random seeds", htmlFor=ids.KV_SEEDS),
                    dcc.Input(id=ids.KV_SEEDS, type="number", min=1, max=MAX_SEEDS, step=1, value=DEFAULT_SEEDS,
                              className="hs-number"),
                    html.Label("S (sinks)", htmlFor=ids.KV_SINK),
                    dcc.Input(id=ids.KV_SINK, type="number", min=0, max=MAX_LENGTH, step=1, value=DEFAULT_SINK_SIZE,
                              className="hs-number"),
                    html.Label("W (recent)", htmlFor=ids.KV_RECENT),
                    dcc.Input(id=ids.KV_RECENT, type="number", min=1, max=MAX_LENGTH, step=1, value=DEFAULT_RECENT_SIZE,
                              className="hs-number"),
                ], className="hs-options"),
                html.P("S and W default to DuoAttention's shipped patterns (sink_size 128, recent_size 256); "
                       "S + W must be below the sweep's shortest prompt.", className="hs-hint"),
                html.Label("Backend", htmlFor=ids.KV_BACKEND),
                dcc.Dropdown(id=ids.KV_BACKEND, value="auto", clearable=False, className="hs-model",
                             options=[{"label": BACKEND_LABELS[b], "value": b} for b in BACKENDS]),
                html.Div([
                    html.Button("Run", id=ids.KV_RUN, n_clicks=0, className="hs-run"),
                    html.Button("Cancel", id=ids.KV_CANCEL, n_clicks=0, className="hs-button hs-cancel",
                                disabled=True),
                    html.Progress(id=ids.KV_PROGRESS, value="0", max="100", className="hs-progress"),
                    html.Span(id=ids.KV_STATUS, className="hs-hint"),
                ], className="hs-options"),
            ], className="hs-panel hs-field"),
        ], className="hs-panels hs-even"),
        html.Div(id=ids.KV_INFO, className="hs-run-info"),
        html.Div([
            html.Div([
                html.Label("Tolerance (NIAH points below full): the smallest KV fraction whose 95 % interval reaches "
                           "the uncompressed interval's lower bound less this is starred", htmlFor=ids.KV_TOLERANCE),
                dcc.Input(id=ids.KV_TOLERANCE, type="number", min=0, max=100, step=1, value=DEFAULT_TOL_POINTS,
                          debounce=True, className="hs-number"),
            ], className="hs-options"),
            dcc.Graph(id=ids.KV_PARETO, figure=EMPTY, config=GRAPH_CONFIG),
            export_bar(PREFIX, names.COMPRESSION_PARETO),
        ], className="hs-panel"),
        html.Div([
            dash_table.DataTable(id=ids.KV_TABLE, sort_action="native", page_size=40, data=[],
                                 columns=[{"name": label, "id": key} for key, label in TABLE_COLUMNS],
                                 style_cell={"fontFamily": "inherit", "fontSize": 12}),
        ], className="hs-panel"),
        html.Div([
            html.Div([
                html.Label("Policy", htmlFor=ids.KV_PICK),
                dcc.Dropdown(id=ids.KV_PICK, options=[], clearable=False, className="hs-model"),
                html.Button("Download pattern folder", id=ids.KV_DOWNLOAD, n_clicks=0, className="hs-button",
                            title="config.json + full_attention_heads.tsv, as DuoAttention ships them and kvpress' "
                                  "DuoAttentionPress reads them"),
            ], className="hs-options"),
            dcc.Graph(id=ids.KV_POLICY, figure=NO_POLICY, config=GRAPH_CONFIG),
            export_bar(PREFIX, names.COMPRESSION_POLICY),
        ], className="hs-panel"),
    ])


register_export(PREFIX, run_of=lambda state: None)  # both views are drawn from the stored curve


def _num(value, fmt: str) -> str:
    return "—" if value is None or value != value else format(value, fmt)


def table_rows(curve) -> list[dict]:
    """The table's cells as the page shows them (the export's data.csv has every digit): each NIAH accuracy
    with its Wilson interval and n, and each random row with its fraction's seed band."""
    bands = {b["fraction_full"]: b for b in curve.seed_bands()}
    out = []
    for r in curve_rows(curve):
        band = bands.get(r["fraction_full"]) if r["ranking"] == "random" else None
        out.append({"ranking": r["ranking"], "seed": "" if r["seed"] is None else str(r["seed"]),
                    "fraction_full": _num(r["fraction_full"], ".2f"), "n_full_groups": r["n_full_groups"],
                    "kv_fraction": _num(r["kv_fraction"], ".4f"), "kv_mib": _num(r["kv_bytes"] / 2**20, ".2f"),
                    "loss": _num(r["loss"], ".4f"), "agreement": _num(r["agreement"], ".4f"),
                    "niah_accuracy": _num(r["niah_accuracy"], ".3f"),
                    "niah_interval": "—" if not r["niah_accuracy_n"] else
                    f"[{r['niah_accuracy_low']:.2f}, {r['niah_accuracy_high']:.2f}]",
                    "niah_n": r["niah_accuracy_n"],
                    "niah_seed_band": "" if band is None else
                    f"{_num(band['niah_accuracy_seed_mean'], '.2f')}, {_num(band['niah_accuracy_seed_low'], '.2f')}–"
                    f"{_num(band['niah_accuracy_seed_high'], '.2f')} ({band['n_seeds']} seeds)"})
    return out


def task_suite(source, tasks, per_task, lengths):
    """The task suite the form asks for (None: the sweep's prompts), checked here: a request need not come
    from the form. The tasks' lengths are the context lengths' (checked by the suite when it is built)."""
    from headscope.analysis.long_context_tasks import TaskSuite

    if source not in [o["value"] for o in PROMPT_SOURCES]:
        raise InputError("Choose whether NIAH accuracy is measured on the needle sweep or on the task suite.")
    if source == "sweep":
        return None
    chosen = [t for t in TASKS if isinstance(tasks, list) and t in tasks]  # a string would match its substrings
    if not chosen:
        raise InputError("Tick at least one task of the suite, or measure on the needle sweep.")
    lengths_ = check_lengths(number_list(lengths, "Context lengths", int))
    return TaskSuite(tuple(chosen), tuple(dict.fromkeys(lengths_)),
                     whole_number(per_task, "Prompts per task", 1, MAX_PER_TASK))


def task_rates(tasks: dict) -> str:
    """A curve's task suite as the page says it: each task's uncompressed answer rate, its 95 % Wilson
    interval and n (``curve.meta["tasks"]``), the dropped ones last."""
    def said(name, t):
        label = TASKS[name].label if name in TASKS else name
        return f"{label} {t['rate']:.2f} [{t['low']:.2f}, {t['high']:.2f}] n={t['n']}"

    kept = [said(k, t) for k, t in tasks.items() if not t["dropped"]]
    dropped = [said(k, t) for k, t in tasks.items() if t["dropped"]]
    return (f"NIAH accuracy on the task suite; uncompressed answer rate [95 % Wilson] of the tasks kept: "
            f"{'; '.join(kept)}." + (f" Dropped (the uncompressed model cannot do them): {'; '.join(dropped)}."
                                     if dropped else ""))


def _info(curve, tolerance: float) -> list:
    b = curve.baseline
    parts = [html.Span(f"{curve.meta.get('model_name', '')}: {curve.n_prompts} NIAH prompt(s), loss on "
                       f"{curve.n_texts} text(s); KV for {b.memory.n_tokens:,} tokens, full "
                       f"{b.memory.full_bytes / 2**20:.2f} MiB; uncompressed NIAH "
                       f"{b.niah.text() if b.niah.n else '—'}, loss {_num(b.loss, '.4f')}; evaluated on the "
                       f"{curve.meta.get('backend', 'eager')} backend.")]
    if curve.meta.get("tasks"):
        parts.append(html.Div(task_rates(curve.meta["tasks"]), className="hs-hint"))
    for r, e in smallest_within(curve, tolerance).items():
        parts.append(html.Div(decision_text(RANKING_LABELS[r], tolerance, None if e is None else e.row(),
                                            curve.n_prompts), className="hs-kv-best"))
    parts.append(html.Div("Within tolerance: the policy's 95 % interval reaches the uncompressed one's lower bound "
                          "less the tolerance (for random, every seed's); loss is compared as points.",
                          className="hs-hint"))
    if not curve.complete:
        parts.append(html.Div("Cancelled: the curve holds the policies that finished.", className="hs-hint"))
    return parts


show_in_shell(PREFIX)


@callback(
    output=dict(
        pareto=Output(ids.KV_PARETO, "figure"),
        policy=Output(ids.KV_POLICY, "figure"),
        table=Output(ids.KV_TABLE, "data"),
        pick_options=Output(ids.KV_PICK, "options"),
        pick=Output(ids.KV_PICK, "value"),
        info=Output(ids.KV_INFO, "children"),
        error=Output(ids.ERROR, "children", allow_duplicate=True),
        tolerance=Output(ids.KV_TOLERANCE, "value"),
        # the form shows the settings the stored curve was evaluated with, so Run reruns them
        model=Output(ids.KV_MODEL, "value"),
        sweep=Output(ids.KV_SWEEP, "value"),
        rankings=Output(ids.KV_RANKINGS, "value"),
        fractions=Output(ids.KV_FRACTIONS, "value"),
        seeds=Output(ids.KV_SEEDS, "value"),
        sink=Output(ids.KV_SINK, "value"),
        recent=Output(ids.KV_RECENT, "value"),
        backend=Output(ids.KV_BACKEND, "value"),
    ),
    inputs=[Input(url_id(PREFIX), "search")],
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker
    prevent_initial_call="initial_duplicate",
)
@guarded(outputs=("pareto", "policy", "table", "pick_options", "pick", "info", "error", "tolerance", "model", "sweep",
                  "rankings", "fractions", "seeds", "sink", "recent", "backend"))
def render(search):
    """Draw the page from its URL: the stored curve it names, read back, never computed."""
    state = parse(search)
    problems = list(state.problems)
    tol_points = DEFAULT_TOL_POINTS if state.tol is None else state.tol
    if not state.compress:
        return {"pareto": EMPTY, "policy": NO_POLICY, "table": [], "pick_options": [], "pick": None, "info": "",
                "error": message(problems), "tolerance": tol_points}
    _, curve = stored_curve(state.compress)
    params = compress_params(state)
    pareto, _ = VIEWS[names.COMPRESSION_PARETO].build(None, params)
    try:
        policy, _ = VIEWS[names.COMPRESSION_POLICY].build(None, params)
        chosen = pick_text(chosen_evaluation(curve, state.pick, params["tolerance"]))
    except InputError as e:
        problems.append(str(e))
        policy, chosen = NO_POLICY, None
    options = [{"label": f"{pick_text(e)}  (KV {e.memory.fraction:.3f}, NIAH {e.niah.text() if e.niah.n else '—'})",
                "value": pick_text(e)} for e in curve.evaluations]
    meta = curve.meta
    form = {"sweep": (meta.get("sweep") or "")[:16], "rankings": list(meta.get("rankings", [])),
            "fractions": ",".join(f"{f:g}" for f in meta.get("fractions", [])),
            "sink": curve.sink_size, "recent": curve.recent_size}
    if meta.get("backend_asked") in BACKENDS:
        form["backend"] = meta["backend_asked"]
    if meta.get("model_name"):
        form["model"] = dropdown_model(meta["model_name"], problems)
    if meta.get("seeds"):
        form["seeds"] = len(meta["seeds"])
    return {"pareto": pareto, "policy": policy, "table": table_rows(curve), "pick_options": options, "pick": chosen,
            "info": _info(curve, params["tolerance"]), "error": message(problems), "tolerance": tol_points, **form}


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Output(ids.ERROR, "children", allow_duplicate=True),
    Input(ids.KV_TOLERANCE, "value"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def set_tolerance(points, search):
    """A new tolerance (whole NIAH points, 0–100, checked here: a request need not come from the box)
    redraws the marks; anything else is a message and the URL stays."""
    if points is None:
        raise PreventUpdate  # an empty box, or a value the browser refused
    try:
        points = whole_number(points, "The tolerance (NIAH points below full)", 0, 100)
    except InputError as e:
        return no_update, message(str(e))
    state = parse(search)
    new = None if points == DEFAULT_TOL_POINTS else points
    if new == state.tol:
        raise PreventUpdate
    state.tol = new
    return state.to_search(), ""


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Output(ids.ERROR, "children", allow_duplicate=True),
    Input(ids.KV_PICK, "value"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def set_pick(pick, search):
    """A policy chosen from the menu (filled from the stored curve, so checked here, not at the request)."""
    state = parse(search)
    if not pick or pick == state.pick or not state.compress:
        raise PreventUpdate
    try:
        _, curve = stored_curve(state.compress)
        parse_pick(pick)
        tolerance = DEFAULT_TOLERANCE if state.tol is None else state.tol / 100
        chosen = chosen_evaluation(curve, pick, tolerance)
    except InputError as e:
        return no_update, message(str(e))
    if chosen is chosen_evaluation(curve, state.pick, tolerance):
        raise PreventUpdate  # the policy already shown (the default one, named)
    state.pick = pick_text(chosen)
    return state.to_search(), ""




def _sweep(model, sweep_id, needle_ids, lengths, depths, haystack, set_progress):
    """The stored sweep named by id, or the sweep of the settings (stored trials are reused)."""
    from headscope.analysis.retrieval import sweep
    from headscope.app.views.heads import sweep_of

    sweep_id = (sweep_id or "").strip().lower()
    if sweep_id:
        found = sweep_of({"sweep": sweep_id})
        record = get_context().store.get(found.key)
        if record is not None and record.meta.get("model_digest") != model.digest:
            raise InputError(f"Sweep {sweep_id} was run on {record.meta.get('model_name')}, not {model.name}: choose "
                             "its model, or leave the id empty to run the sweep on this one.")
        return found
    chosen = [n for n in load_needles() if n.id in set(needle_ids or [])]
    if not chosen:
        raise InputError("Tick at least one needle, or give a stored sweep's id.")
    lengths_ = check_lengths(number_list(lengths, "Context lengths", int))
    depths_ = number_list(depths, "Depths")
    return sweep(model, chosen, lengths_, depths_, named_haystack(haystack or "prose"), store=get_context().store,
                 progress=trial_progress(set_progress, len(lengths_) * len(depths_) * len(chosen)))


@cancellable_callback(
    Output(url_patch_id(PREFIX), "data", allow_duplicate=True),  # into the URL as it is then
    job_error(PREFIX),
    Output(ids.KV_STATUS, "children"),
    Input(ids.KV_RUN, "n_clicks"),
    State(ids.KV_SWEEP, "value"),
    State(ids.KV_NEEDLES, "value"),
    State(ids.KV_LENGTHS, "value"),
    State(ids.KV_DEPTHS, "value"),
    State(ids.KV_HAYSTACK, "value"),
    State(ids.KV_MODEL, "value"),
    State(ids.KV_RANKINGS, "value"),
    State(ids.KV_FRACTIONS, "value"),
    State(ids.KV_SEEDS, "value"),
    State(ids.KV_SINK, "value"),
    State(ids.KV_RECENT, "value"),
    State(ids.KV_BACKEND, "value"),
    State(ids.KV_PROMPT_SOURCE, "value"),
    State(ids.KV_TASKS, "value"),
    State(ids.KV_PER_TASK, "value"),
    State(url_id(PREFIX), "search"),
    run=ids.KV_RUN, cancel=ids.KV_CANCEL, progress=ids.KV_PROGRESS, status=ids.KV_STATUS,
    stale=(ids.KV_PARETO, ids.KV_POLICY), prevent_initial_call=True,
)
def run_compress(set_progress, n_clicks, sweep_id, needle_ids, lengths, depths, haystack, model_spec, rankings,
                 fractions, seeds, sink, recent, backend, source, tasks, per_task, search):
    """Run: the sweep (or the stored one), then every policy (:func:`compress_sweep`, stored); the curve's
    key goes into the URL."""
    from headscope.analysis.kv_compression_sweep import compress_sweep

    in_job()
    if not n_clicks:
        raise PreventUpdate
    started = time.monotonic()
    try:
        context = get_context()
        spec = offered_model(model_spec)
        chosen = [r for r in RANKINGS if r in (rankings or [])]
        if not chosen:
            raise InputError("Tick at least one ranking.")
        fractions_ = number_list(fractions, "Fractions of KV groups kept full", most=MAX_FRACTIONS)
        if any(not 0 <= f <= 1 for f in fractions_):
            raise InputError(f"Fractions of KV groups kept full must be between 0 and 1, got {str(fractions)[:40]!r}.")
        n_seeds = whole_number(seeds, "Random seeds", 1, MAX_SEEDS)
        sink_ = whole_number(sink, "S (sinks)", 0, MAX_LENGTH)
        recent_ = whole_number(recent, "W (recent tokens)", 1, MAX_LENGTH)
        suite = task_suite(source, tasks, per_task, lengths)
        if backend not in BACKENDS:
            raise InputError(f"Choose a backend: {', '.join(BACKENDS)}.")
        if not (sweep_id or "").strip():  # said before the sweep runs (compress_sweep checks the prompts too)
            shortest = min(check_lengths(number_list(lengths, "Context lengths", int)))
            if sink_ + recent_ >= shortest:
                raise InputError(f"S + W = {sink_ + recent_} keeps every key of a {shortest}-token prompt: nothing "
                                 "to compress. Lower S or W, or use longer context lengths.")
        model = load_model(spec)  # once the form is known to be runnable
        found = _sweep(model, sweep_id, needle_ids, lengths, depths, haystack, set_progress)
        if not found.trials:
            return no_update, message("The sweep has no finished trial."), "Not run: see the message above."
        result = compress_sweep(model, found, chosen, fractions_, seeds=list(range(n_seeds)), sink_size=sink_,
                                recent_size=recent_, backend=backend, suite=suite, store=context.store,
                                progress=progress_reporter(set_progress, "evaluating policies"))
    except ValueError as e:
        return no_update, message(str(e)), "Not run: see the message above."
    state = parse(search)
    state.model, state.compress, state.pick = model.name, result.key[:16], None
    state.sweep = found.key[:16] or None
    n = len(result.curve.evaluations)
    return url_patch(search, state.to_search(), reset=("pick",)), "", f"{n} policies and the uncompressed model evaluated in {time.monotonic() - started:.1f} s"


@callback(
    Output(ids.KV_STATUS, "children", allow_duplicate=True),
    Input(ids.KV_CANCEL, "n_clicks"),
    prevent_initial_call=True,
)
def cancelled(n_clicks):
    if not n_clicks:
        raise PreventUpdate
    return "Cancelled: policies that finished are stored, and Run resumes from them; the curve shown is the last finished one."


@callback(
    page_download(PREFIX),  # with Redis this is a job: not the shell (page_shell.job_error)
    job_error(PREFIX),
    Input(ids.KV_DOWNLOAD, "n_clicks"),
    State(url_id(PREFIX), "search"),
    **on_workers(),
    prevent_initial_call=True,
)
@guarded(outputs=2, error_index=1)
def download_pattern(n_clicks, search):
    """The chosen policy as DuoAttention's pattern folder (:func:`headscope.analysis.pattern_folder.export_policy`),
    zipped under ``pattern/``."""
    from headscope.analysis.pattern_folder import curve_priority, export_policy

    if not n_clicks:
        raise PreventUpdate
    state = parse(search)
    _, curve = stored_curve(state.compress)
    tolerance = DEFAULT_TOLERANCE if state.tol is None else state.tol / 100
    e = chosen_evaluation(curve, state.pick, tolerance)
    buf = io.BytesIO()
    with tempfile.TemporaryDirectory() as tmp, zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for path in export_policy(e.policy, Path(tmp) / "pattern", model_name=curve.meta.get("model_name", ""),
                                  priority=curve_priority(curve, e.policy)):
            z.write(path, f"pattern/{path.name}")
    name = f"headscope-pattern-{pick_text(e).replace(':', '-')}.zip"
    return dcc.send_bytes(buf.getvalue(), name), ""
