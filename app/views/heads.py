"""Views of a needle-in-a-haystack sweep (Retrieval Head, Wu et al. 2024) for the Heads page.

Drawn from the stored sweep named in ``params["sweep"]`` (and the model in ``params["model"]``), not
from one run: the other per-head scores (streaming with sink size S and window W, sinks, entropy,
evidence, previous/duplicate-token, induction) are computed on every distinct prompt of the sweep
and aggregated (:mod:`headscope.analysis.head_scores`). Registered into :data:`headscope.app.views.registry.VIEWS`, so exports and
manifests work as for every other figure.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from headscope.analysis.errors import InputError
from headscope.analysis.evidence import cumulative_mass
from headscope.analysis.head_scan import sweep_head_scores
from headscope.analysis.head_scores import HeadScores
from headscope.analysis.long_context_tasks import TASKS
from headscope.analysis.model_facts import window_note
from headscope.analysis.retrieval import AGGREGATES, RetrievalSweep, decode_rows, load_sweep
from headscope.analysis.score_registry import HEAD_SCORES
from headscope.analysis.streaming import DEFAULT_SINK, DEFAULT_WINDOW
from headscope.app import figures
from headscope.app.views import names
from headscope.app.views.registry import Rows, check_head_index, memoised, register

RETRIEVAL_THRESHOLD = 0.1
SWEEP_PARAMS = ("model", "sweep", "agg", "layer", "head", "score", "stat", "sink_size", "window", "trial")


def sweep_params(state: Any) -> dict[str, Any]:
    """A sweep view's parameters from the page state (the page and its exports use the same)."""
    from headscope.app.context import get_context

    return {"model": state.model or get_context().default_model, "sweep": state.sweep, "agg": state.agg,
            "layer": state.layer, "head": state.head, "score": state.score, "stat": state.stat,
            "sink_size": DEFAULT_SINK if state.sink_size is None else state.sink_size,
            "window": DEFAULT_WINDOW if state.window is None else state.window, "trial": state.trial or 0}


def _model(params: dict[str, Any]):
    from headscope.analysis.models import load_model
    from headscope.app.context import get_context

    return load_model(params.get("model") or get_context().default_model)


def check_sweep_head(sweep: RetrievalSweep, layer: Any, head: Any) -> tuple[int, int]:
    return check_head_index(*sweep.scores.shape, layer, head)


def sweep_of(params: dict[str, Any]) -> RetrievalSweep:
    from headscope.app.context import get_context

    key = params.get("sweep")
    if not key:
        raise InputError("No sweep yet: run a sweep first.")
    store = get_context().store
    keys = store.find(str(key)) if key else []
    sweep = load_sweep(store, keys[0]) if len(keys) == 1 else None
    if sweep is None:
        shown = str(key) if len(str(key)) <= 24 else str(key)[:24] + "…"
        raise InputError(f"No stored sweep has the id {shown!r}: run the sweep again.")
    return sweep


def retrieval_table(sweep: RetrievalSweep, agg: str) -> np.ndarray:
    if agg not in AGGREGATES:
        raise InputError(f"Unknown aggregation {agg!r}; choose one of {', '.join(AGGREGATES)}.")
    return {"query": sweep.scores, "group_max": sweep.group_max, "group_mean": sweep.group_mean}[agg]


@register(names.RETRIEVAL_GRID, "Retrieval score map", ("sweep", "agg", "layer", "head"),
          lambda state, query, _: sweep_params(state), needs_run=False)
def retrieval_grid_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    sweep = sweep_of(params)
    agg = params.get("agg", "query")
    table = retrieval_table(sweep, agg)
    selected = None
    if agg == "query" and params.get("layer") is not None and params.get("head") is not None:
        selected = check_sweep_head(sweep, params["layer"], params["head"])
    fig = figures.head_grid(table, "Retrieval score", selected)
    fig.update_layout(title_text=f"Retrieval score {AGGREGATES[agg]} — {sweep.n_counted}/{sweep.n_trials} trials counted")
    if sweep.n_counted == 0:  # every score is undefined: say why instead of an empty map
        fig.add_annotation(text=("No trial was answered (ROUGE-1 recall of the answer ≤ 0.5), so no head has a "
                                 "retrieval score.<br>Try shorter contexts, other depths, or the passkey haystack."),
                           xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                           font={"size": 13, "color": "#666"})
    if agg != "query":
        fig.update_xaxes(title="key-value head")
    rows = [{"layer": la, "head" if agg == "query" else "kv_head": h, "retrieval": float(table[la, h])}
            for la in range(table.shape[0]) for h in range(table.shape[1])]
    return fig, rows


@register(names.RETRIEVAL_HISTOGRAM, "Retrieval score histogram", ("sweep",),
          lambda state, query, _: sweep_params(state), needs_run=False)
def retrieval_histogram_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    sweep = sweep_of(params)
    fig = figures.score_histogram(sweep.scores, "Retrieval score", RETRIEVAL_THRESHOLD)
    share = sweep.share_above(RETRIEVAL_THRESHOLD)
    fig.update_layout(title_text=f"Retrieval score over heads: {share:.1%} above {RETRIEVAL_THRESHOLD}")
    rows = [{"layer": la, "head": h, "retrieval": float(sweep.scores[la, h])}
            for la in range(sweep.scores.shape[0]) for h in range(sweep.scores.shape[1])]
    return fig, rows


def head_scores_of(sweep: RetrievalSweep, params: dict[str, Any]) -> HeadScores:
    """Every other per-head score over the sweep's distinct prompts, as the scan stored them
    (:func:`headscope.analysis.head_scan.sweep_head_scores`; computed when missing)."""
    from headscope.app.context import get_context

    sink = int(params.get("sink_size", DEFAULT_SINK))
    window = int(params.get("window", DEFAULT_WINDOW))
    model = _model(params)
    return memoised(("head_scores", sweep.key, model.digest, sink, window), lambda: sweep_head_scores(
        model, sweep, sink=sink, window=window, store=get_context().store))


def _score(scores: HeadScores, params: dict[str, Any]) -> tuple[str, np.ndarray, str]:
    name, stat = params.get("score", "streaming"), params.get("stat", "mean")
    if not isinstance(name, str) or name not in scores.mean or name not in HEAD_SCORES:
        raise InputError(f"No score {str(name)[:40]!r} on this sweep; choose one of {', '.join(scores.mean)}.")
    if stat not in ("mean", "std"):
        raise InputError(f"stat must be 'mean' or 'std', got {stat!r}.")
    label = HEAD_SCORES[name].label + (f" (S={scores.sink}, W={scores.window})" if name == "streaming" else "")
    return name, (scores.mean if stat == "mean" else scores.std)[name], label


@register(names.HEAD_SCORE_GRID, "Per-head score map over the sweep's prompts", ("sweep", "score", "stat", "sink_size", "window", "layer", "head"),
          lambda state, query, _: sweep_params(state), needs_run=False)
def head_score_grid_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """A per-head score's mean (or spread) over the sweep's prompts as a layer × head map."""
    sweep = sweep_of(params)
    scores = head_scores_of(sweep, params)
    name, table, label = _score(scores, params)
    selected = None
    if params.get("layer") is not None and params.get("head") is not None:
        selected = check_sweep_head(sweep, params["layer"], params["head"])
    stat = params.get("stat", "mean")
    score = HEAD_SCORES[name]
    fig = figures.head_grid(table, label if stat == "mean" else f"std of {label}", selected,
                            windows=scores.layer_windows, window_note=window_note(scores.layer_windows, score.windowed),
                            signed=score.signed and stat == "mean")
    fig.update_layout(title_text=figures.safe_text(
        f"{label}: {'mean' if stat == 'mean' else 'standard deviation'} over {scores.n_prompts} prompts"))
    rows = [{"layer": la, "head": h, "score": name, "mean": float(scores.mean[name][la, h]),
             "std": float(scores.std[name][la, h]), "n_prompts": scores.n_prompts,
             **({"sink_size": scores.sink, "window": scores.window} if name == "streaming" else {})}
            for la in range(table.shape[0]) for h in range(table.shape[1])]
    return fig, rows


@register(names.SCORE_MASS, "Cumulative positive mass of a score", ("sweep", "score", "sink_size", "window"),
          lambda state, query, _: sweep_params(state), needs_run=False)
def score_mass_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """Cumulative positive mass of a score over heads: "x% of heads hold 50% of the positive mass"."""
    sweep = sweep_of(params)
    if params.get("score", "evidence") == "retrieval":
        name, table, label = "retrieval", np.nan_to_num(sweep.scores), "Retrieval score"
    else:
        name, table, label = _score(head_scores_of(sweep, params), {**params, "stat": "mean"})
    curve = cumulative_mass(table)
    fig = figures.mass_curve(curve.head_fraction, curve.mass_fraction, curve.level, curve.half_mass_fraction, label)
    n_heads = table.shape[1]
    rows = [{"rank": r + 1, "layer": int(i // n_heads), "head": int(i % n_heads), "score": name,
             "value": float(table.flat[i]), "heads_fraction": float(curve.head_fraction[r + 1]),
             "mass_fraction": float(curve.mass_fraction[r + 1])} for r, i in enumerate(curve.order)]
    return fig, rows


@register(names.RETRIEVAL_SCATTER, "Retrieval vs another score", ("sweep", "score", "sink_size", "window"),
          lambda state, query, _: sweep_params(state), needs_run=False)
def retrieval_scatter_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """Retrieval score against another per-head score (mean over the sweep's prompts)."""
    sweep = sweep_of(params)
    name, versus, label = _score(head_scores_of(sweep, params), {**params, "stat": "mean"})
    fig = figures.head_scatter(np.nan_to_num(sweep.scores, nan=0.0), versus, "Retrieval score", label)
    rows = [{"layer": la, "head": h, "retrieval": float(sweep.scores[la, h]), name: float(versus[la, h])}
            for la in range(versus.shape[0]) for h in range(versus.shape[1])]
    return fig, rows


@register(names.NIAH_GRID, "Needle-in-a-haystack accuracy", ("sweep",),
          lambda state, query, _: sweep_params(state), needs_run=False)
def niah_grid_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """Accuracy per context length × depth, or × task for a sweep over the task suite: each cell is the
    prompts answered of the prompts decoded there (one trial each), with its 95 % Wilson interval in the
    cell, its hover and its rows (a ``depth`` or a ``task`` column)."""
    sweep = sweep_of(params)
    cells = sweep.accuracy_intervals()
    accuracy = np.array([[p.value for p in row] for row in cells], dtype=float).reshape(sweep.accuracy.shape)
    labels = [TASKS[c].label if c in TASKS else str(c) for c in sweep.tasks] or sweep.depths
    fig = figures.niah_grid(accuracy, sweep.lengths, labels, cells,
                            column="task" if sweep.tasks else "needle depth")
    fig.update_layout(title_text=f"Needle-in-a-haystack accuracy: {accuracy_text(sweep)}")
    rows = [{"length": n, sweep.column_name: c, **cells[i][j].columns("accuracy"),
             "accuracy_answered": cells[i][j].successes, "recall": float(sweep.recall[i, j])}
            for i, n in enumerate(sweep.lengths) for j, c in enumerate(sweep.columns)]
    return fig, rows


def accuracy_text(sweep: RetrievalSweep) -> str:
    """The whole sweep's accuracy as the page says it: ``answered k of n, 0.50 [0.24, 0.76] n=8 (95 % Wilson)``."""
    p = sweep.overall_accuracy()
    return f"{p.successes} of {p.n} trials answered, {p.text()} (95 % Wilson)"


def head_trials(sweep: RetrievalSweep, layer: int, head: int) -> Rows:
    """One row per trial: its settings, response, whether it counted and this head's hits."""
    rows = []
    for k, t in enumerate(sweep.trials):
        steps = [s for s, la, h in t.hits if la == layer and h == head]
        rows.append({
            "trial": k, "length": t.length, "depth": t.depth, "needle": t.settings["needle"].get("id", ""),
            "response": t.response.strip()[:120], "recall": round(float(t.recall), 3), "counted": bool(t.counted),
            "head_score": round(float(t.scores[layer, head]), 4), "hit_steps": ",".join(map(str, steps)),
        })
    return rows


@register(names.TRIAL_STEPS, "A head's attention row per decode step", ("sweep", "layer", "head", "trial"),
          lambda state, query, _: sweep_params(state), needs_run=False)
def trial_steps_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """One head's whole attention row over the haystack at each decode step of one trial.

    The rows are recomputed by replaying the trial's decode (:func:`headscope.analysis.retrieval.decode_rows`),
    so they are the rows the copy-paste score was taken from; the needle is boxed and each step's
    argmax marked (green: a copy-paste hit).
    """
    sweep = sweep_of(params)
    layer, head = check_sweep_head(sweep, params.get("layer"), params.get("head"))
    k = int(params.get("trial") or 0)
    if not 0 <= k < len(sweep.trials):
        raise InputError(f"Trial {k} is out of range: this sweep has trials 0..{len(sweep.trials) - 1}.")
    t = sweep.trials[k]
    model = _model(params)
    rows = memoised(("decode_rows", t.key, layer, head), lambda: decode_rows(model, t, layer, head))
    start, end = t.settings["needle_span"]
    hit_steps = {s for s, la, h in t.hits if la == layer and h == head}
    keys = rows.argmax(-1)
    tokens = model.token_strings(list(t.prompt_ids) + list(t.generated))
    generated = model.token_strings(list(t.generated))
    title = (f"Layer {layer}, head {head}, trial {k}: {len(hit_steps)} copy-paste steps (green ×) of "
             f"{end - start} needle tokens; response {t.response.strip()[:40]!r}")
    fig = figures.decode_rows_heatmap(rows, (start, end), keys, [s in hit_steps for s in range(len(rows))],
                                      generated, tokens, title)
    n_prompt = len(t.prompt_ids)
    out: Rows = []
    for s, row in enumerate(rows):
        for j in range(n_prompt + s):
            out.append({"step": s, "generated": generated[s], "key_pos": j, "key_token": tokens[j],
                        "weight": float(row[j]), "in_needle": start <= j < end,
                        "argmax": j == int(keys[s]), "copy_paste": j == int(keys[s]) and s in hit_steps})
    return fig, out
