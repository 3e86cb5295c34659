"""Page "Patching": activation patching between a clean and a corrupted prompt (Heimersheim & Nanda
2024), every head at once as a background job, the attribution-patching estimate beside it with their
agreement, and one clicked head position by position. Everything is :func:`headscope.analysis.patching.activation_patching`;
the URL names the stored results, so a link reopens the same view without computing."""

from __future__ import annotations

import logging
import time

import dash
import numpy as np
from dash import Input, Output, State, callback, dcc, html, no_update
from dash.exceptions import PreventUpdate

from headscope.analysis.errors import InputError, check_head_index
from headscope.analysis.models import load_model
from headscope.analysis.patching import ATTRIBUTION_SHARE, activation_patching, prompt_pair
from headscope.analysis.patching_choices import (
    DIRECTION_DESCRIPTIONS,
    DIRECTIONS,
    KV_SITES,
    METRIC_LABELS,
    METRICS,
    PATH_SITES,
    SITE_DESCRIPTIONS,
    SITES,
    parse_head_pairs,
)
from headscope.analysis.patching_pairs import load_pairs, pair_by_id
from headscope.app import ids
from headscope.app.context import get_context, offered_model
from headscope.app.errors import guarded, message
from headscope.app.export_bar import export_bar, register_export
from headscope.app.grid_clicks import ask_for_head, head_clicks
from headscope.app.jobs import cancellable_callback, count_progress, in_job, on_workers
from headscope.app.page_shell import (
    GRAPH_CONFIG,
    empty_figure,
    job_error,
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
from headscope.app.views.patching import patching_params, stored_patching, unit_names

log = logging.getLogger(__name__)

dash.register_page(__name__, path="/patching", name="Patching", title="headscope — activation patching", order=5)

PREFIX = "pat"
# An IOI-style pair (Wang et al. 2022) on which the embedded model prefers the right name on both prompts
CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
ANSWERS = (" Mary", " John")
EMPTY = empty_figure("Run the patching to see every head's effect.")
NO_POSITIONS = empty_figure("Click a head on the map to patch it position by position.")
TOP_N = 5


def _choices(values, describe) -> list[dict]:
    return [{"label": html.Span([html.B(f" {v} "), html.Span(describe[v], className="hs-hint")]), "value": v}
            for v in values]


def _pair_options() -> list[dict]:
    """The built-in pairs (:func:`headscope.analysis.patching_pairs.load_pairs`) as choices: the id and the start of
    the clean prompt. A pairs file that cannot be read offers none (the page still works; the log says why)."""
    try:
        pairs = load_pairs()
    except InputError as e:
        log.warning("no built-in prompt pairs on the Patching page: %s", e)
        return []
    return [{"label": f"{p.id}: {p.clean[:60]}{'…' if len(p.clean) > 60 else ''}", "value": p.id} for p in pairs]


def layout(**_query) -> html.Div:
    context = get_context()
    return html.Div(
        [
            page_location(PREFIX),
            shell_stores(PREFIX),
            dcc.Store(id=query_store_id(PREFIX)),
            html.Div(
                [
                    html.Div([
                        html.Label("Built-in pair (fills the prompts and answers below)", htmlFor=ids.PAT_PAIR),
                        dcc.Dropdown(id=ids.PAT_PAIR, options=_pair_options(), placeholder="IOI name swaps, "
                                     "factual recall, induction…", clearable=True),
                        html.Label("Clean prompt (its answer is the first answer)", htmlFor=ids.PAT_CLEAN),
                        dcc.Textarea(id=ids.PAT_CLEAN, className="hs-textarea", value=CLEAN),
                        html.Label("Corrupted prompt (the same number of tokens)", htmlFor=ids.PAT_CORRUPTED),
                        dcc.Textarea(id=ids.PAT_CORRUPTED, className="hs-textarea", value=CORRUPTED),
                        html.Label("Answers: one token each, as it follows the prompt (a word after a space "
                                   "keeps its space)", htmlFor=ids.PAT_ANSWER_CLEAN),
                        html.Div([
                            html.Label("clean", htmlFor=ids.PAT_ANSWER_CLEAN),
                            dcc.Input(id=ids.PAT_ANSWER_CLEAN, className="hs-text-input", value=ANSWERS[0]),
                            html.Label("corrupted", htmlFor=ids.PAT_ANSWER_CORRUPTED),
                            dcc.Input(id=ids.PAT_ANSWER_CORRUPTED, className="hs-text-input", value=ANSWERS[1]),
                        ], className="hs-options"),
                        html.Div(id=ids.PAT_DIFFER, className="hs-hint"),
                        html.Label("Model", htmlFor=ids.PAT_MODEL),
                        dcc.Dropdown(id=ids.PAT_MODEL, options=context.model_options(), value=context.default_model,
                                     clearable=False, className="hs-model"),
                    ], className="hs-panel hs-field"),
                    html.Div([
                        html.Label("Site: what is copied from one run into the other", htmlFor=ids.PAT_SITE),
                        dcc.RadioItems(id=ids.PAT_SITE, value="z", options=_choices(SITES, SITE_DESCRIPTIONS),
                                       className="hs-methods"),
                        html.Label("Direction", htmlFor=ids.PAT_DIRECTION),
                        dcc.RadioItems(id=ids.PAT_DIRECTION, value="denoise",
                                       options=_choices(DIRECTIONS, DIRECTION_DESCRIPTIONS), className="hs-methods"),
                        html.Label("Metric (normalised: 0 = corrupted, 1 = clean)", htmlFor=ids.PAT_METRIC),
                        dcc.RadioItems(id=ids.PAT_METRIC, value="logit_diff", inline=True,
                                       options=[{"label": f" {METRIC_LABELS[m]}", "value": m} for m in METRICS]),
                        html.Div([
                            html.Button("Run", id=ids.PAT_RUN, n_clicks=0, className="hs-run"),
                            html.Button("Cancel", id=ids.PAT_CANCEL, n_clicks=0, className="hs-button hs-cancel",
                                        disabled=True),
                            html.Progress(id=ids.PAT_PROGRESS, value="0", max="100", className="hs-progress"),
                            html.Span(id=ids.PAT_STATUS, className="hs-hint"),
                        ], className="hs-options"),
                        html.Div(id=ids.PAT_TOP, className="hs-run-info"),
                    ], className="hs-panel hs-field"),
                ],
                className="hs-panels hs-even",
            ),
            html.Div(
                [
                    html.Div([head_clicks(dcc.Graph(id=ids.PAT_MAP, figure=EMPTY, config=GRAPH_CONFIG),
                                          ask_for_head(ids.PAT_MAP, ids.PAT_CLICK)),
                              dcc.Store(id=ids.PAT_CLICK),
                              html.P("Exact activation patching. Click a head to patch it position by position.",
                                     className="hs-hint"),
                              export_bar(PREFIX, names.PATCHING_MAP)], className="hs-panel"),
                    html.Div([dcc.Graph(id=ids.PAT_ATTRIBUTION, figure=EMPTY, config=GRAPH_CONFIG),
                              html.P("Attribution patching: the first-order estimate from one forward and one "
                                     "backward pass.", className="hs-hint"),
                              export_bar(PREFIX, names.variant(names.PATCHING_MAP, "attribution"))],
                             className="hs-panel"),
                ],
                className="hs-panels hs-even",
            ),
            html.Div([
                html.Div(id=ids.PAT_AGREEMENT_NUMBERS, className="hs-run-info"),
                dcc.Graph(id=ids.PAT_AGREEMENT, figure=empty_figure("No comparison yet."), config=GRAPH_CONFIG),
                export_bar(PREFIX, names.PATCHING_AGREEMENT),
            ], className="hs-panel"),
            html.H3("One head, position by position", className="hs-section"),
            html.Div([
                html.Button("Cancel", id=ids.PAT_POS_CANCEL, n_clicks=0, className="hs-button hs-cancel",
                            disabled=True),
                html.Progress(id=ids.PAT_POS_PROGRESS, value="0", max="100", className="hs-progress"),
                html.Span(id=ids.PAT_POS_STATUS, className="hs-hint", role="status"),
            ], className="hs-options"),
            html.Div([dcc.Graph(id=ids.PAT_POSITIONS, figure=NO_POSITIONS, config=GRAPH_CONFIG),
                      export_bar(PREFIX, names.variant(names.PATCHING_MAP, "positions"))], className="hs-panel"),
            html.H3("Path patching: sender heads into receivers' queries, keys or values", className="hs-section"),
            html.Div([
                html.P("Patches only the path from the senders' outputs into the receivers' input (Wang et al. "
                       "2022): every other head keeps its output on the receiving prompt. Uses the prompts, answers, "
                       "direction and metric above.", className="hs-hint"),
                html.Div([
                    html.Label("Senders", htmlFor=ids.PAT_PATH_FROM),
                    dcc.Input(id=ids.PAT_PATH_FROM, className="hs-text-input", placeholder="e.g. 0.1,3.4",
                              value="0.1,3.4"),
                    html.Label("Receivers", htmlFor=ids.PAT_PATH_TO),
                    dcc.Input(id=ids.PAT_PATH_TO, className="hs-text-input", placeholder="e.g. 9.1,12.2",
                              value="9.1,12.2"),
                    dcc.RadioItems(id=ids.PAT_PATH_SITE, value="q", inline=True,
                                   options=[{"label": f" {s} ", "value": s, "title": SITE_DESCRIPTIONS[s]}
                                            for s in PATH_SITES]),
                    dcc.Checklist(id=ids.PAT_PATH_FREEZE, options=[{"label": " freeze MLPs (direct paths only)",
                                                                   "value": "freeze"}], value=[]),
                    html.Button("Patch path", id=ids.PAT_PATH_RUN, n_clicks=0, className="hs-run"),
                    html.Button("Cancel", id=ids.PAT_PATH_CANCEL, n_clicks=0, className="hs-button hs-cancel",
                                disabled=True),
                    html.Progress(id=ids.PAT_PATH_PROGRESS, value="0", max="100", className="hs-progress"),
                    html.Span(id=ids.PAT_PATH_STATUS, className="hs-hint"),
                ], className="hs-options"),
                html.Div(id=ids.PAT_PATH_RESULT, className="hs-run-info"),
            ], className="hs-panel"),
        ]
    )


register_export(PREFIX, run_of=lambda state: None)


def _differ_text(pair) -> str:
    shown = "; ".join(f"{p}: {pair.clean_tokens[p]} → {pair.corrupted_tokens[p]}" for p in pair.differ)
    answers = " vs ".join(pair.answer_tokens)
    return (f"{pair.n_tokens} tokens each; they differ at position{'s' if len(pair.differ) > 1 else ''} {shown} "
            f"(clean → corrupted). Answers: {answers}.")


def _top_text(result) -> str:
    labels = unit_names(result)
    shape = result.values.shape
    top = ", ".join(f"{labels[int(np.ravel_multi_index(i, shape))]} ({v:.2f})" for i, v in result.top_units(TOP_N))
    return (f"Largest effects ({result.direction} {result.site}): {top}. Exact in {result.seconds:.1f} s, "
            f"attribution in {result.attribution_seconds:.1f} s.")


show_in_shell(PREFIX)


@callback(
    output=dict(
        exact=Output(ids.PAT_MAP, "figure"),
        attribution=Output(ids.PAT_ATTRIBUTION, "figure"),
        agreement=Output(ids.PAT_AGREEMENT, "figure"),
        numbers=Output(ids.PAT_AGREEMENT_NUMBERS, "children"),
        top=Output(ids.PAT_TOP, "children"),
        positions=Output(ids.PAT_POSITIONS, "figure"),
        error=Output(ids.ERROR, "children", allow_duplicate=True),
        # the form shows what the stored result was computed from, so Run recomputes it
        clean=Output(ids.PAT_CLEAN, "value"),
        corrupted=Output(ids.PAT_CORRUPTED, "value"),
        answer_clean=Output(ids.PAT_ANSWER_CLEAN, "value"),
        answer_corrupted=Output(ids.PAT_ANSWER_CORRUPTED, "value"),
        model=Output(ids.PAT_MODEL, "value"),
        site=Output(ids.PAT_SITE, "value"),
        direction=Output(ids.PAT_DIRECTION, "value"),
        metric=Output(ids.PAT_METRIC, "value"),
    ),
    inputs=[Input(url_id(PREFIX), "search")],
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker (the web process loads no model)
    prevent_initial_call="initial_duplicate",
)
@guarded(outputs=("exact", "attribution", "agreement", "numbers", "top", "positions", "error", "clean", "corrupted",
                  "answer_clean", "answer_corrupted", "model", "site", "direction", "metric"))
def render(search):
    """Draw the page from its URL: the stored results it names, read back, never computed."""
    state = parse(search)
    problems = list(state.problems)
    if not state.patching:
        return {"exact": EMPTY, "attribution": EMPTY, "agreement": empty_figure("No comparison yet."), "numbers": "",
                "top": "", "positions": NO_POSITIONS, "error": message(problems)}
    result = stored_patching(state.patching)
    params = patching_params(state)
    exact, _ = VIEWS[names.PATCHING_MAP].build(None, params)
    approx, _ = VIEWS[names.PATCHING_MAP].build(None, patching_params(state, "attribution"))
    agree, _ = VIEWS[names.PATCHING_AGREEMENT].build(None, params)
    a = result.agreement
    numbers = (f"Attribution against exact patching over {a.n_units} units: Pearson {a.pearson:.3f}, "
               f"Spearman {a.spearman:.3f}, top-{a.k} overlap {a.overlap:.0%}.")
    positions = NO_POSITIONS
    if state.ppos:
        try:
            positions, _ = VIEWS[names.PATCHING_MAP].build(None, patching_params(state, "positions"))
        except ValueError as e:
            problems.append(str(e))
    model = load_model(state.model or get_context().default_model)
    pair = result.pair
    answers = [model.tokenizer.decode([t]) for t in pair.answers]
    return {"exact": exact, "attribution": approx, "agreement": agree, "numbers": numbers, "top": _top_text(result),
            "positions": positions, "error": message(problems),
            "clean": model.tokenizer.decode(list(pair.clean_ids)),
            "corrupted": model.tokenizer.decode(list(pair.corrupted_ids)),
            "answer_clean": answers[0], "answer_corrupted": answers[1] if len(answers) > 1 else "",
            "model": model.name, "site": result.site, "direction": result.direction, "metric": result.metric}


@callback(
    Output(ids.PAT_CLEAN, "value", allow_duplicate=True),
    Output(ids.PAT_CORRUPTED, "value", allow_duplicate=True),
    Output(ids.PAT_ANSWER_CLEAN, "value", allow_duplicate=True),
    Output(ids.PAT_ANSWER_CORRUPTED, "value", allow_duplicate=True),
    Input(ids.PAT_PAIR, "value"),
    prevent_initial_call=True,
)
def fill_pair(pair_id):
    """A chosen built-in pair fills the form (the user can edit it before Run); clearing it leaves the
    form as it is."""
    if not isinstance(pair_id, str) or not pair_id:
        raise PreventUpdate
    try:
        pair = pair_by_id(pair_id)
    except InputError:  # the file changed since the page offered it
        raise PreventUpdate from None
    return pair.clean, pair.corrupted, *pair.answers


@callback(
    Output(ids.PAT_DIFFER, "children"),
    Input(ids.PAT_CLEAN, "value"),
    Input(ids.PAT_CORRUPTED, "value"),
    Input(ids.PAT_ANSWER_CLEAN, "value"),
    Input(ids.PAT_ANSWER_CORRUPTED, "value"),
    Input(ids.PAT_MODEL, "value"),
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker (the web process loads no model)
)
@guarded(outputs=1)
def differ(clean, corrupted, answer_clean, answer_corrupted, model_spec):
    """Where the prompts differ, as the analysis tokenises them, or the analysis's reason it cannot
    patch them (unequal lengths, a multi-token answer)."""
    model = load_model(offered_model(model_spec))
    try:
        pair = prompt_pair(model, clean or "", corrupted or "", _answers(answer_clean, answer_corrupted))
    except ValueError as e:
        return html.Span(str(e), className="hs-pat-refused")
    return _differ_text(pair)


def _answers(clean, corrupted) -> list[str]:
    """The answers as typed (a leading space is part of the token); an empty box is no answer."""
    return [a for a in (clean, corrupted) if isinstance(a, str) and a != ""]


def _units(model, site: str, n_tokens: int) -> tuple[int, str]:
    if site == "resid":
        return (model.n_layers + 1) * n_tokens, "layer-position"
    if site in ("k", "v"):
        return model.n_layers * model.n_kv_heads, "key-value head"
    return model.n_layers * model.n_heads, "head"


def _job_progress(set_progress, n: int, unit: str):
    """``progress(fraction)`` of :func:`activation_patching` with attribution as "<unit> i of n, time
    left" once exact patching runs; before that, attribution patching's one forward and backward pass."""
    counting = {}

    def report(fraction: float) -> None:
        if fraction < ATTRIBUTION_SHARE:
            set_progress(("0", "100", "attribution patching (one forward and one backward pass)"))
            return
        if "report" not in counting:
            counting["report"] = count_progress(set_progress, n, unit)
        counting["report"]((fraction - ATTRIBUTION_SHARE) / (1 - ATTRIBUTION_SHARE))

    return report


@cancellable_callback(
    Output(url_patch_id(PREFIX), "data", allow_duplicate=True),  # into the URL as it is then
    job_error(PREFIX),
    Output(ids.PAT_STATUS, "children"),
    Input(ids.PAT_RUN, "n_clicks"),
    State(ids.PAT_CLEAN, "value"),
    State(ids.PAT_CORRUPTED, "value"),
    State(ids.PAT_ANSWER_CLEAN, "value"),
    State(ids.PAT_ANSWER_CORRUPTED, "value"),
    State(ids.PAT_MODEL, "value"),
    State(ids.PAT_SITE, "value"),
    State(ids.PAT_DIRECTION, "value"),
    State(ids.PAT_METRIC, "value"),
    State(url_id(PREFIX), "search"),
    run=ids.PAT_RUN, cancel=ids.PAT_CANCEL, progress=ids.PAT_PROGRESS, status=ids.PAT_STATUS,
    prevent_initial_call=True,
)
def run_patching(set_progress, n_clicks, clean, corrupted, answer_clean, answer_corrupted, model_spec, site,
                 direction, metric, search):
    """Run: exact and attribution patching of every unit of the site, stored; its key goes into the URL."""
    in_job()
    if not n_clicks:
        raise PreventUpdate
    started = time.monotonic()
    try:
        context = get_context()
        model = load_model(offered_model(model_spec))
        answers = _answers(answer_clean, answer_corrupted)
        pair = prompt_pair(model, clean or "", corrupted or "", answers)  # refused here, before the job's work
        n, unit = _units(model, site, pair.n_tokens)
        result = activation_patching(model, pair.clean_ids, pair.corrupted_ids, list(pair.answers), site=site,
                                     direction=direction, metric=metric, attribution=True, store=context.store,
                                     progress=_job_progress(set_progress, n, unit))
    except ValueError as e:
        return no_update, message(str(e)), "Not run: see the message above."
    state = parse(search)
    state.model, state.patching, state.ppos, state.layer, state.head = model.name, result.key[:16], None, None, None
    # "n of n", as the progress said while it ran: a job quicker than the progress poll shows only this
    return url_patch(search, state.to_search(), reset=("ppos", "layer", "head")), "", f"{unit}s {n} of {n} patched in {time.monotonic() - started:.1f} s"


@callback(
    Output(ids.PAT_STATUS, "children", allow_duplicate=True),
    Input(ids.PAT_CANCEL, "n_clicks"),
    prevent_initial_call=True,
)
def cancelled(n_clicks):
    if not n_clicks:
        raise PreventUpdate
    return "Cancelled: nothing was stored; the maps shown are the last finished run's."


@callback(
    Output(ids.PAT_POS_STATUS, "children", allow_duplicate=True),
    Input(ids.PAT_POS_CANCEL, "n_clicks"),
    prevent_initial_call=True,
)
def positions_cancelled(n_clicks):
    if not n_clicks:
        raise PreventUpdate
    return "Cancelled: nothing was stored; click a head to patch it by position."


def _clicked_cell(click) -> tuple[int, int]:
    """(layer, head) of a click on the map, as assets/grid_clicks.js reads it from the mouse press
    (not plotly's clickData, which reports the cell its last hover found: a second click soon after
    the first could start the first head's job again). Anything else is no click."""
    layer, head = (click.get("layer"), click.get("head")) if isinstance(click, dict) else (None, None)
    if type(layer) is not int or type(head) is not int or layer < 0 or head < 0:
        raise PreventUpdate
    return layer, head


@cancellable_callback(
    Output(url_patch_id(PREFIX), "data", allow_duplicate=True),  # into the URL as it is then
    job_error(PREFIX),
    Output(ids.PAT_POS_STATUS, "children"),
    Input(ids.PAT_CLICK, "data"),
    State(url_id(PREFIX), "search"),
    run=None, cancel=ids.PAT_POS_CANCEL, progress=ids.PAT_POS_PROGRESS, status=ids.PAT_POS_STATUS,
    prevent_initial_call=True,
)
def run_positions(set_progress, click, search):
    """A click on a head of the map: that head's site patched one position at a time (stored)."""
    in_job()
    layer, head = _clicked_cell(click)
    state = parse(search)
    started = time.monotonic()
    try:
        context = get_context()
        result = stored_patching(state.patching)
        if result.site == "resid" or result.values is None:
            raise PreventUpdate  # the residual stream map is already per position
        layer, head = check_head_index(result.values.shape[0], result.values.shape[1], layer, head)
        model = load_model(state.model or context.default_model)
        pair = result.pair
        positions = activation_patching(model, pair.clean_ids, pair.corrupted_ids, list(pair.answers),
                                        site=result.site, direction=result.direction, metric=result.metric,
                                        head=(layer, head), store=context.store,
                                        progress=count_progress(set_progress, pair.n_tokens, "position"))
    except ValueError as e:
        return no_update, message(str(e)), "Not run: see the message above."
    state.layer, state.head, state.ppos = layer, head, positions.key[:16]
    return (url_patch(search, state.to_search(), on=("patching",), what="The per-position result of that head",
                      status=ids.PAT_POS_STATUS), "",
            f"head {layer}.{head}: {pair.n_tokens} positions patched in {time.monotonic() - started:.1f} s")


@cancellable_callback(
    Output(ids.PAT_PATH_RESULT, "children"),
    job_error(PREFIX),
    Input(ids.PAT_PATH_RUN, "n_clicks"),
    State(ids.PAT_CLEAN, "value"),
    State(ids.PAT_CORRUPTED, "value"),
    State(ids.PAT_ANSWER_CLEAN, "value"),
    State(ids.PAT_ANSWER_CORRUPTED, "value"),
    State(ids.PAT_MODEL, "value"),
    State(ids.PAT_DIRECTION, "value"),
    State(ids.PAT_METRIC, "value"),
    State(ids.PAT_PATH_FROM, "value"),
    State(ids.PAT_PATH_TO, "value"),
    State(ids.PAT_PATH_SITE, "value"),
    State(ids.PAT_PATH_FREEZE, "value"),
    run=ids.PAT_PATH_RUN, cancel=ids.PAT_PATH_CANCEL, progress=ids.PAT_PATH_PROGRESS, status=ids.PAT_PATH_STATUS,
    prevent_initial_call=True,
)
@guarded(outputs=2, error_index=1)
def run_path_patching(set_progress, n_clicks, clean, corrupted, answer_clean, answer_corrupted, model_spec,
                      direction, metric, senders, receivers, site, freeze):
    """Patch path (a background job): :func:`headscope.analysis.path_patching.path_patching`, the function
    ``headscope patch --path-from … --path-to …`` calls; its value, the endpoints and the heads."""
    from headscope.analysis.path_patching import path_patching

    in_job()
    if not n_clicks:
        raise PreventUpdate
    set_progress(("0", "100", "Patching the path…"))
    model = load_model(offered_model(model_spec))
    sends = parse_head_pairs(senders, "senders")
    receives = parse_head_pairs(receivers, "receivers")
    result = path_patching(model, clean or "", corrupted or "", _answers(answer_clean, answer_corrupted), sends,
                           receives, site=site, direction=direction, metric=metric,
                           freeze_mlps=isinstance(freeze, list) and "freeze" in freeze,
                           progress=lambda f: set_progress((str(round(100 * f)), "100", "Patching the path…")))
    kv = " (key-value heads)" if site in KV_SITES else ""
    heads = ", ".join(f"{la}.{h}" for la, h in result.senders)
    into = ", ".join(f"{la}.{h}" for la, h in result.receivers)
    set_progress(("100", "100", ""))
    return [html.Div(html.B(f"Path value {result.value:.4f}"), className="hs-path-value"),
            html.Div(f"{result.direction} {heads} → {site} of {into}{kv}"
                     f"{', MLPs frozen' if result.freeze_mlps else ''}: {METRIC_LABELS[result.metric]} "
                     f"clean {result.clean:.4f}, corrupted {result.corrupted:.4f}, patched {result.raw:.4f} "
                     "(0 = corrupted, 1 = clean).")], ""
