"""Page "Compare": two stored runs head by head (:func:`headscope.analysis.run_comparison.compare_runs`) — two
prompts of equal length on one model, or one text on two models with the same tokenizer: a per-head
score of both with its change (second − first), the heads that changed most, and a clicked head's
change in attention. Nothing is computed but the comparison: both runs are read from the store, and
the URL names them, so a link reopens the same view. The run lists offer only the runs this browser
was shown (:mod:`headscope.app.seen_runs`) and an id pasted into the page, never the store's list. A click on any of the three grids writes its head
into the URL in the browser (``assets/grid_clicks.js``, as on the other pages' grids).

The drawing is the views :data:`~headscope.app.views.names.RUN_COMPARISON` and
:data:`~headscope.app.views.names.ATTENTION_DIFFERENCE`, which ``headscope compare`` exports too.
"""

from __future__ import annotations

import dash
import numpy as np
from dash import Input, Output, State, callback, dcc, html, no_update
from dash.exceptions import PreventUpdate

from headscope.analysis.errors import InputError
from headscope.analysis.run_comparison import compare_runs, shown_decimals
from headscope.analysis.score_registry import HEAD_SCORES, RUN_SCORES
from headscope.app import ids
from headscope.app.context import get_context
from headscope.app.errors import guarded, message
from headscope.app.export_bar import export_bar, register_export
from headscope.app.grid_clicks import head_clicks, select_head
from headscope.app.jobs import on_workers
from headscope.app.page_shell import GRAPH_CONFIG, empty_figure, page_location, shell_stores, url_id
from headscope.app.seen_runs import run_id, run_ids, shown_run, shown_runs
from headscope.app.url_state import parse
from headscope.app.views import VIEWS, names
from headscope.app.views.comparison import comparison_params, stored_run

dash.register_page(__name__, path="/compare", name="Compare", title="headscope — compare two runs", order=6)

PREFIX = "cmp"
NO_RUNS = empty_figure("Choose two stored runs of equal length (Run a text on the Attention page to store one).")
NO_HEAD = empty_figure("Click a head on the grids to see its change in attention.")
CHOOSE = ("Choose two runs of equal length. The lists hold the runs this browser was shown (a text run on "
          "any page, a run's link opened); paste another run's id below to add it.")
TOP_N = 10

register_export(PREFIX, run_of=lambda state: None)


def layout(**_query) -> html.Div:
    return html.Div(
        [
            page_location(PREFIX),
            shell_stores(PREFIX),
            html.Div(
                [
                    html.Label("First run", htmlFor=ids.CMP_FIRST),
                    dcc.Dropdown(id=ids.CMP_FIRST, options=[], placeholder="a stored run", className="hs-run-dropdown"),
                    html.Label("Second run", htmlFor=ids.CMP_SECOND),
                    dcc.Dropdown(id=ids.CMP_SECOND, options=[], placeholder="a run of the same length",
                                 className="hs-run-dropdown"),
                    html.Label("Score", htmlFor=ids.CMP_METRIC),
                    dcc.Dropdown(id=ids.CMP_METRIC, clearable=False, className="hs-score-dropdown",
                                 options=[{"label": HEAD_SCORES[name].label, "value": name,
                                           "title": HEAD_SCORES[name].description} for name in RUN_SCORES]),
                ],
                className="hs-options",
            ),
            html.Div(
                [
                    html.Label("Another run's id", htmlFor=ids.CMP_PASTE),
                    dcc.Input(id=ids.CMP_PASTE, type="text", debounce=True, maxLength=64, spellCheck=False,
                              placeholder="paste a run id (8 to 64 hex digits) and press Enter"),
                    html.Span(id=ids.CMP_PASTE_NOTE, className="hs-hint"),
                ],
                className="hs-options",
            ),
            html.P(id=ids.CMP_STATUS, className="hs-hint"),
            html.Div([head_clicks(dcc.Graph(id=ids.CMP_GRIDS, figure=NO_RUNS, config=GRAPH_CONFIG),  # any of its three grids
                                  select_head(ids.CMP_GRIDS, PREFIX)),
                      html.P("Click a head to see its change in attention.", className="hs-hint"),
                      export_bar(PREFIX, names.RUN_COMPARISON)], className="hs-panel"),
            html.Div(id=ids.CMP_TOP, className="hs-panel"),
            html.Div([dcc.Graph(id=ids.CMP_DIFF, figure=NO_HEAD, config=GRAPH_CONFIG),
                      export_bar(PREFIX, names.ATTENTION_DIFFERENCE)], className="hs-panel"),
        ]
    )


def run_options(keys: list[str], first_length: int | None = None) -> list[dict]:
    """The runs among ``keys`` (ids the browser sent, :func:`headscope.app.seen_runs.run_ids`) as options; with
    ``first_length``, runs of another length are listed but disabled (a comparison needs equal lengths)."""
    options = []
    for run in shown_runs(get_context().store, keys):
        option = {"label": run.label, "value": run.key}
        if first_length is not None and run.n_tokens != first_length:
            option["disabled"] = True
        options.append(option)
    return options


def _paste_note(pasted, found) -> str:
    if pasted is None or (isinstance(pasted, str) and not pasted.strip()):
        return ""
    if run_id(pasted) is None:
        return "A run id is 8 to 64 hex digits (`headscope runs list` prints them); that is not one."
    if found is None:
        return (f"No stored run has the id {run_id(pasted)!r}: check it, or run its text again.")
    return f"Run {found.key[:8]} is in both lists now: choose it there."


def _top_table(result, top_n: int = TOP_N) -> html.Table | str:
    """The heads that changed most, each number to the decimals its rounding leaves meaningful
    (:func:`headscope.analysis.run_comparison.shown_decimals`), with the rounding beside the change; a change
    within it is printed as such, without a sign."""
    changes = result.largest_changes(top_n)
    if not changes:
        return ""
    label = HEAD_SCORES[result.metric].label
    head = html.Tr([html.Th(c) for c in ("head", "first", "second", "change", "rounding (±)")])
    rows = []
    for c in changes:
        d = int(shown_decimals(c.resolution))
        change = "≈ 0 (within rounding)" if c.within_rounding else f"{c.change:+.{d}f}"
        rows.append(html.Tr([html.Td(f"{c.layer}.{c.head}"), html.Td(f"{c.first:.{d}f}"), html.Td(f"{c.second:.{d}f}"),
                             html.Td(change), html.Td(f"{c.resolution:.1e}")]))
    return html.Div([html.H3(f"Largest changes in {label.lower()} (second − first)", className="hs-section"),
                     html.Table([html.Thead(head), html.Tbody(rows)], className="hs-table"),
                     html.P(f"Numbers are printed to the decimals the {result.stored} carry: rounding alone can "
                            "move a change by up to its ± (both runs' rounding).", className="hs-hint")])


def _change_summary(result) -> str:
    """Mean |change| to the decimals the mean rounding leaves, and how many heads changed by no more
    than rounding alone can (:attr:`headscope.analysis.run_comparison.RunComparison.within_rounding`)."""
    finite = np.isfinite(result.difference)
    d = int(shown_decimals(np.mean(result.resolution[finite])))
    within = int(result.within_rounding[finite].sum())
    return (f" Mean |change| {np.mean(np.abs(result.difference[finite])):.{d}f}; {within} of {int(finite.sum())} "
            f"heads changed by no more than the rounding of the {result.stored} (dotted on the change grid).")


@callback(
    output=dict(
        first_options=Output(ids.CMP_FIRST, "options"),
        first=Output(ids.CMP_FIRST, "value"),
        second_options=Output(ids.CMP_SECOND, "options"),
        second=Output(ids.CMP_SECOND, "value"),
        paste_note=Output(ids.CMP_PASTE_NOTE, "children"),
    ),
    inputs=[Input(url_id(PREFIX), "search"), Input(ids.SEEN_RUNS, "data"), Input(ids.CMP_PASTE, "value")],
    state=[State(ids.CMP_FIRST, "value"), State(ids.CMP_SECOND, "value")],
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker, beside the store it reads
)
@guarded(outputs=("first_options", "first", "second_options", "second", "paste_note"), error="paste_note")
def offer_runs(search, seen, pasted, shown_first=None, shown_second=None):
    """Fill both lists with the runs this browser was shown (``seen``, kept in the browser by
    :mod:`headscope.app.seen_runs`), those the URL names (its link was opened: in the list at once, before the
    browser's store has it) and an id pasted into the page; each id is checked (hex) and resolved in
    the store here. Nothing else is listed: the store's list is the command line's.

    The lists' values are set from the URL only while empty (the page arriving, or a link or the back
    button, which rebuild it): afterwards the user's choices lead and :func:`choose` writes them into
    the URL, so an answer on its way does not undo a second choice made before it arrives. A value goes
    out with its list's options, in one answer: a list shown a value that is not among its options
    empties it."""
    state = parse(search)
    store = get_context().store
    first, second = shown_run(store, state.first or state.run), shown_run(store, state.second)
    found = shown_run(store, pasted)
    named = [r.key for r in (found, first, second) if r is not None]
    keys = run_ids([*named, *(seen if isinstance(seen, list) else [])])
    out = {"first_options": run_options(keys), "second_options": run_options(keys, first.n_tokens if first else None),
           "paste_note": _paste_note(pasted, found)}
    if first and shown_first is None:
        out["first"] = first.key
    if second and shown_second is None:
        out["second"] = second.key
    return out


@callback(
    output=dict(
        metric=Output(ids.CMP_METRIC, "value"),
        status=Output(ids.CMP_STATUS, "children"),
        grids=Output(ids.CMP_GRIDS, "figure"),
        top=Output(ids.CMP_TOP, "children"),
        difference=Output(ids.CMP_DIFF, "figure"),
        error=Output(ids.ERROR, "children", allow_duplicate=True),
    ),
    inputs=[Input(url_id(PREFIX), "search")],
    state=[State(ids.CMP_METRIC, "value")],
    **on_workers(),  # with HEADSCOPE_REDIS_URL: runs on a worker, beside the store it reads
    prevent_initial_call="initial_duplicate",
)
@guarded(outputs=("metric", "status", "grids", "top", "difference", "error"))
def render(search, shown_metric=None):
    """Draw the page from its URL: both runs read from the store, their comparison, the clicked head.
    The score's list is set from the URL only while empty, as :func:`offer_runs` sets the run lists."""
    state = parse(search)
    problems = list(state.problems)
    first_key = state.first or state.run
    metric = state.metric if state.metric in RUN_SCORES else "entropy"
    first = second = None
    if first_key:
        try:
            first = stored_run(first_key, "first")
        except InputError as e:
            problems.append(str(e))
    if state.second:
        try:
            second = stored_run(state.second, "second")
        except InputError as e:
            problems.append(str(e))
    lists = {"metric": metric} if shown_metric is None else {}
    if first is None or second is None:
        status = "Choose the second run." if first is not None else CHOOSE
        return {**lists, "status": status, "grids": NO_RUNS, "top": "", "difference": NO_HEAD,
                "error": message(problems)}
    try:
        result = compare_runs(first, second, metric)
    except InputError as e:  # unequal lengths, other tokenizers, a metric one run cannot give
        return {**lists, "status": str(e), "grids": NO_RUNS, "top": "", "difference": NO_HEAD,
                "error": message(problems)}
    params = comparison_params(state)
    params.update(first=first.key[:16], second=second.key[:16], metric=metric)
    if state.layer is not None and state.head is not None and not (
            0 <= state.layer < first.n_layers and 0 <= state.head < first.n_heads):
        problems.append(f"The link's head {state.layer}.{state.head} is not a head of {first.model_name}.")
        params.update(layer=None, head=None)
    grids, _ = VIEWS[names.RUN_COMPARISON].build(None, params)
    diff = NO_HEAD
    if params.get("layer") is not None and params.get("head") is not None:
        diff, _ = VIEWS[names.ATTENTION_DIFFERENCE].build(None, params)
    where = ", ".join(f"{i}: {first.tokens[i]} → {second.tokens[i]}" for i in result.differ[:12])
    more = f" and {len(result.differ) - 12} more" if len(result.differ) > 12 else ""
    status = (f"{result.kind.capitalize()}, {first.n_tokens} tokens"
              + (f"; the tokens differ at {where}{more}." if result.differ else "; the same tokens.")
              + (_change_summary(result) if np.isfinite(result.difference).any() else ""))
    return {**lists, "status": status, "grids": grids, "top": _top_table(result), "difference": diff,
            "error": message(problems)}


@callback(
    Output(url_id(PREFIX), "search", allow_duplicate=True),
    Input(ids.CMP_FIRST, "value"),
    Input(ids.CMP_SECOND, "value"),
    Input(ids.CMP_METRIC, "value"),
    State(url_id(PREFIX), "search"),
    prevent_initial_call=True,
)
def choose(first, second, metric, search):
    """A chosen run or score goes into the URL (the page draws from there). The run lists are filled
    by :func:`offer_runs`, so their values are checked here: run ids (hex) only, resolved when drawn.
    The clicked head stays: the same head in another pair of runs is what one compares."""
    state = parse(search)
    for name, value in (("first", first), ("second", second)):
        if value is not None and not (isinstance(value, str) and 8 <= len(value) <= 64
                                      and all(c in "0123456789abcdef" for c in value)):
            raise PreventUpdate  # not a value the list could offer
        setattr(state, name, value)
    if isinstance(metric, str) and metric in RUN_SCORES:
        state.metric = metric
    new = state.to_search()
    return no_update if new == (search or "") else new
