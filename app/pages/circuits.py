"""Page "Circuits": a text and two answers → what each head writes towards the first answer (direct logit
attribution, a layer × head grid with the MLPs beside it) and which earlier heads feed a chosen head
(composition scores into its Q, K and V); with a corrupted text, the edges between heads that carry the
difference (edge attribution patching, drawn as a graph of the top edges). Everything is :func:`headscope.analysis.circuits.circuits`, run as a
job (the composition scores take 20-40 s the first time a model is used, then come from the store); the URL
names the stored result (``circ``) and the chosen head, so a link reopens the same view without computing.
A click on a head of the grid chooses it; a click on an edge of the graph path-patches that edge exactly
(:func:`headscope.analysis.circuits.patch_edge`, a job) and shows the exact effect beside its estimate. The page's URL field is declared beside its views
(:class:`headscope.app.views.circuits.CircuitsState`): Dash executes a page module again for every app it
creates, and a part may be declared only once per process."""

from __future__ import annotations

import time

import dash
from dash import Input, Output, State, callback, dcc, html, no_update
from dash.exceptions import PreventUpdate

from headscope.analysis.circuits import circuits, not_exact, patch_edge
from headscope.analysis.errors import InputError
from headscope.analysis.models import load_model
from headscope.analysis.patching_pairs import pair_by_id
from headscope.app import ids
from headscope.app.context import dropdown_model, get_context, offered_model
from headscope.app.errors import guarded, message
from headscope.app.export_bar import export_bar, register_export
from headscope.app.grid_clicks import head_clicks, select_head
from headscope.app.jobs import cancellable_callback, in_job, on_workers, progress_reporter
from headscope.app.page_shell import (
    GRAPH_CONFIG,
    empty_figure,
    job_error,
    page_location,
    shell_stores,
    show_in_shell,
    url_id,
    url_patch,
    url_patch_id,
)
from headscope.app.url_state import parse
from headscope.app.views import VIEWS, names
from headscope.app.views.circuits import chosen_head, circuits_params, stored_circuits, stored_edges

dash.register_page(__name__, path="/circuits", name="Circuits", title="headscope — circuits over heads", order=8)

PREFIX = "circ"
TEXT, FIRST, SECOND = f"{PREFIX}-text", f"{PREFIX}-answer-first", f"{PREFIX}-answer-second"
MODEL, RUN, CANCEL = f"{PREFIX}-model", f"{PREFIX}-run", f"{PREFIX}-cancel"
PROGRESS, STATUS, INFO = f"{PREFIX}-progress", f"{PREFIX}-status", f"{PREFIX}-info"
DLA, OTHERS, COMPOSITION = f"{PREFIX}-dla", f"{PREFIX}-dla-others", f"{PREFIX}-composition"
CORRUPTED, EDGES = f"{PREFIX}-corrupted", f"{PREFIX}-edges"
EDGE_PATCH, EDGE_CANCEL = f"{PREFIX}-edge-patch", f"{PREFIX}-edge-cancel"
EDGE_PROGRESS, EDGE_STATUS = f"{PREFIX}-edge-progress", f"{PREFIX}-edge-status"
DEFAULT_PAIR = "ioi-mary-john"  # the built-in IOI prompt: its indirect object, then its subject (Wang et al. 2022)
EMPTY = empty_figure("Run the text to see what each head writes towards the first answer.")
NO_COMPOSITION = empty_figure("Run the text, then click a head to see which earlier heads feed it.")
NO_EDGES = empty_figure("Run the text with a corrupted text to see the edges between heads that carry the difference.")


def _default_prompt() -> tuple[str, tuple[str, str], str]:
    """The built-in IOI pair's clean prompt, answers and corrupted prompt
    (:mod:`headscope.analysis.patching_pairs`); an empty form when the pairs file cannot be read."""
    try:
        pair = pair_by_id(DEFAULT_PAIR)
    except InputError:
        return "", ("", ""), ""
    return pair.clean, pair.answers, pair.corrupted


def layout(**_query) -> html.Div:
    context = get_context()
    text, answers, corrupted = _default_prompt()
    return html.Div([
        page_location(PREFIX),
        shell_stores(PREFIX),
        html.Div([
            html.Div([
                html.Label("Text (its last token's logits are explained)", htmlFor=TEXT),
                dcc.Textarea(id=TEXT, className="hs-textarea", value=text),
                html.Label("Answers: one token each, as it follows the text (a word after a space keeps its space)",
                           htmlFor=FIRST),
                html.Div([
                    html.Label("expected", htmlFor=FIRST),
                    dcc.Input(id=FIRST, className="hs-text-input", value=answers[0]),
                    html.Label("compared with", htmlFor=SECOND),
                    dcc.Input(id=SECOND, className="hs-text-input", value=answers[1]),
                ], className="hs-options"),
                html.Label("Corrupted text, as many tokens (optional: also the edges between heads that carry "
                           "the difference)", htmlFor=CORRUPTED),
                dcc.Textarea(id=CORRUPTED, className="hs-textarea", value=corrupted),
                html.Label("Model", htmlFor=MODEL),
                dcc.Dropdown(id=MODEL, options=context.model_options(), value=context.default_model, clearable=False,
                             className="hs-model"),
                html.Div([
                    html.Button("Run", id=RUN, n_clicks=0, className="hs-run"),
                    html.Button("Cancel", id=CANCEL, n_clicks=0, className="hs-button hs-cancel", disabled=True),
                    html.Progress(id=PROGRESS, value="0", max="100", className="hs-progress"),
                    html.Span(id=STATUS, className="hs-hint", role="status"),
                ], className="hs-options"),
            ], className="hs-panel hs-field"),
            html.Div([
                html.Div(id=INFO, className="hs-run-info"),
                html.P("Each normalisation is frozen at its scale in this run (the standard linearisation), so "
                       "the residual stream at the last token is a sum of components and each one's share of the "
                       "logit difference adds up to it exactly. Composition scores come from the weights alone "
                       "(Elhage et al. 2021): computed once per model, then read from the store.",
                       className="hs-hint"),
            ], className="hs-panel"),
        ], className="hs-panels hs-even"),
        html.Div([
            html.Div([head_clicks(dcc.Graph(id=DLA, figure=EMPTY, config=GRAPH_CONFIG),
                                  select_head(DLA, PREFIX)),
                      html.P("Red: towards the expected answer; blue: towards the other. Click a head to see what "
                             "feeds it.", className="hs-hint"),
                      export_bar(PREFIX, names.CIRCUIT_DLA)], className="hs-panel"),
            html.Div([dcc.Graph(id=OTHERS, figure=EMPTY, config=GRAPH_CONFIG),
                      export_bar(PREFIX, names.CIRCUIT_DLA_OTHERS)], className="hs-panel"),
        ], className="hs-panels"),
        html.Div([dcc.Graph(id=COMPOSITION, figure=NO_COMPOSITION, config=GRAPH_CONFIG),
                  export_bar(PREFIX, names.CIRCUIT_COMPOSITION)], className="hs-panel"),
        html.Div([dcc.Graph(id=EDGES, figure=NO_EDGES, config=GRAPH_CONFIG),
                  html.P("Each line is one edge: a sender (embedding, head or MLP) into a later head's query, key or "
                         "value, or into the logits; colour by where it ends, width by |score|. The score "
                         "estimates how the logit difference changes when that edge alone carries the corrupted "
                         "text's activations (one forward and one backward pass; Syed et al. 2023). Hover a line's "
                         "middle for its numbers; click it to path-patch that edge exactly (Wang et al. 2022).",
                         className="hs-hint"),
                  html.Div([
                      html.Button("Cancel", id=EDGE_CANCEL, n_clicks=0, className="hs-button hs-cancel", disabled=True),
                      html.Progress(id=EDGE_PROGRESS, value="0", max="100", className="hs-progress"),
                      html.Span(id=EDGE_STATUS, className="hs-hint", role="status"),
                  ], className="hs-options"),
                  html.Div(id=EDGE_PATCH, className="hs-run-info"),
                  export_bar(PREFIX, names.CIRCUIT_EDGES)], className="hs-panel"),
    ])


register_export(PREFIX, run_of=lambda state: None)
show_in_shell(PREFIX)


def _info(result, head: tuple[int, int]) -> str:
    a = result.attribution
    first, second = result.answer_tokens
    heads = a.heads()
    return (f"logit[{first}] − logit[{second}] at the last token ({result.tokens[-1]}): {a.logit_diff:.3f}; the "
            f"{len(a.names)} components sum to {float(a.values.sum()):.3f}. Head {head[0]}.{head[1]} writes "
            f"{heads[head]:+.3f} of it. Attribution in {result.seconds:.2f} s.")


@callback(
    output=dict(
        dla=Output(DLA, "figure"),
        others=Output(OTHERS, "figure"),
        composition=Output(COMPOSITION, "figure"),
        edges=Output(EDGES, "figure"),
        info=Output(INFO, "children"),
        error=Output(ids.ERROR, "children", allow_duplicate=True),
        # the form shows what the stored result was computed from, so Run recomputes it
        text=Output(TEXT, "value"),
        first=Output(FIRST, "value"),
        second=Output(SECOND, "value"),
        corrupted=Output(CORRUPTED, "value"),
        model=Output(MODEL, "value"),
        edge_patch=Output(EDGE_PATCH, "children", allow_duplicate=True),  # a new result's edges are new edges
    ),
    inputs=[Input(url_id(PREFIX), "search")],
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker (the web process loads no model)
    prevent_initial_call="initial_duplicate",
)
@guarded(outputs=("dla", "others", "composition", "edges", "info", "error", "text", "first", "second", "corrupted",
                  "model", "edge_patch"))
def render(search):
    """Draw the page from its URL: the stored result it names, read back, never computed."""
    state = parse(search)
    problems = list(state.problems)
    if not state.circ:
        return {"dla": EMPTY, "others": EMPTY, "composition": NO_COMPOSITION, "edges": NO_EDGES, "info": "",
                "error": message(problems), "edge_patch": ""}
    result = stored_circuits(state.circ)
    head = chosen_head(result, state.layer, state.head)
    params = {**circuits_params(state), "layer": head[0], "head": head[1]}
    dla, _ = VIEWS[names.CIRCUIT_DLA].build(None, params)
    others, _ = VIEWS[names.CIRCUIT_DLA_OTHERS].build(None, params)
    composition, _ = VIEWS[names.CIRCUIT_COMPOSITION].build(None, params)
    edges, _ = VIEWS[names.CIRCUIT_EDGES].build(None, params)
    model = load_model(offered_model(state.model))
    a = result.attribution
    answers = [model.tokenizer.decode([t]) for t in (a.answer, a.wrong)]
    chosen_model = dropdown_model(model.name, problems)
    stored = stored_edges(result.edges_key) if result.edges_key else None
    corrupted = model.tokenizer.decode(stored.corrupted_ids, skip_special_tokens=True) if stored else ""
    return {"dla": dla, "others": others, "composition": composition, "edges": edges, "info": _info(result, head),
            "error": message(problems), "text": model.tokenizer.decode(result.token_ids, skip_special_tokens=True),
            "first": answers[0], "second": answers[1], "corrupted": corrupted, "model": chosen_model,
            "edge_patch": ""}


@cancellable_callback(
    Output(url_patch_id(PREFIX), "data", allow_duplicate=True),  # into the URL as it is then
    job_error(PREFIX),
    Output(STATUS, "children"),
    Input(RUN, "n_clicks"),
    State(TEXT, "value"),
    State(FIRST, "value"),
    State(SECOND, "value"),
    State(CORRUPTED, "value"),
    State(MODEL, "value"),
    State(url_id(PREFIX), "search"),
    run=RUN, cancel=CANCEL, progress=PROGRESS, status=STATUS, stale=(DLA, OTHERS, COMPOSITION, EDGES),
    prevent_initial_call=True,
)
def run_circuits(set_progress, n_clicks, text, first, second, corrupted, model_spec, search):
    """Run: direct logit attribution of the text's last token, the edge attribution on the corrupted text when
    one is given, and the model's composition scores, all stored; the result's key goes into the URL (the
    chosen head is reset to the largest direct effect)."""
    in_job()
    if not n_clicks:
        raise PreventUpdate
    report = progress_reporter(set_progress, "attribution, then composition scores (once per model)")
    try:
        model = load_model(offered_model(model_spec))
        answers = [a if isinstance(a, str) else "" for a in (first, second)]
        result = circuits(model, text if isinstance(text, str) else "", answers, store=get_context().store,
                          progress=report, corrupted=corrupted if isinstance(corrupted, str) else None)
    except ValueError as e:
        return no_update, message(str(e)), "Not run: see the message above."
    state = parse(search)
    state.model, state.circ, state.layer, state.head = model.name, result.key[:16], None, None
    edges = " with the edges of the corrupted text" if result.edges_key else ""
    return (url_patch(search, state.to_search(), reset=("layer", "head")), "",
            f"{len(result.attribution.names)} components attributed{edges} in {result.seconds:.2f} s")


@callback(
    Output(STATUS, "children", allow_duplicate=True),
    Input(CANCEL, "n_clicks"),
    prevent_initial_call=True,
)
def cancelled(n_clicks):
    if not n_clicks:
        raise PreventUpdate
    return "Cancelled: the figures shown are the last finished run's."


def _clicked_edge(click) -> tuple[str, str, str] | None:
    """``(sender, receiver, site)`` of a click on an edge of the graph (its points' ``customdata``,
    :func:`headscope.app.views.circuits.edge_graph`); None for a click on a node (no customdata); an
    :class:`InputError` for anything else."""
    points = click.get("points") if isinstance(click, dict) else None
    point = points[0] if isinstance(points, list) and points and isinstance(points[0], dict) else None
    if point is not None and "customdata" not in point:
        return None
    edge = point.get("customdata") if point is not None else None
    if not isinstance(edge, list) or len(edge) < 3 or not all(isinstance(v, str) and len(v) <= 40 for v in edge[:3]):
        raise InputError("That click names no edge: click a line of the edge graph.")
    return edge[0], edge[1], edge[2]


@cancellable_callback(
    output=dict(panel=Output(EDGE_PATCH, "children"), error=job_error(PREFIX)),
    inputs=[Input(EDGES, "clickData")],
    state=[State(url_id(PREFIX), "search")],
    run=None, cancel=EDGE_CANCEL, progress=EDGE_PROGRESS, status=EDGE_STATUS,
    prevent_initial_call=True,
)
@guarded(outputs=("panel", "error"))
def patch_clicked_edge(set_progress, click, search):
    """A click on an edge: its exact path patch on the stored pair (:func:`headscope.analysis.circuits.patch_edge`,
    a job; read back from the store when done before), beside its edge-attribution estimate. An edge path
    patching cannot patch (from the embedding or an MLP, into the logits) is one line, and nothing runs."""
    in_job()
    edge = _clicked_edge(click) if click is not None else None
    if edge is None:
        raise PreventUpdate
    if (reason := not_exact(*edge)) is not None:
        set_progress((100, 100, ""))
        return {"panel": reason, "error": ""}
    state = parse(search)
    result = stored_circuits(state.circ)
    sender, receiver, site = edge
    set_progress((0, 100, f"Path-patching {sender} → {receiver} ({site})…"))
    started = time.perf_counter()
    model = load_model(offered_model(state.model))
    patch = patch_edge(model, result, sender, receiver, site, get_context().store)
    where = "key-value head " if site in ("k", "v") else ""
    estimate = "not among the stored edges" if patch.estimate is None else f"{patch.estimate:+.6f}"
    set_progress((100, 100, f"Edge {sender} → {receiver} ({site}): {time.perf_counter() - started:.2f} s (the patch "
                            f"took {patch.seconds:.2f} s once; it is stored and read back)."))
    return {"panel": html.Span(
        f"Exact path patch of {sender} → {where}{receiver} ({site}): Δ logit diff = {patch.exact:+.6f}; edge "
        f"attribution estimated {estimate} (logit diff clean {patch.clean:.4f}, with the edge corrupted "
        f"{patch.patched:.4f}; MLPs frozen, so only the direct path changes).", className="hs-edge-patch"),
        "error": ""}
