"""Views of a needle-in-a-haystack sweep (Retrieval Head, Wu et al. 2024) for the Heads page.

A sweep view is drawn from the stored sweep named in ``params["sweep"]``; the run it is given is
the sweep's first prompt, captured (stored) so streaming and other per-run scores sit beside the
retrieval score. Registered into :data:`app.views.VIEWS`, so exports and manifests work as for
every other figure.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from analysis.capture import InputError, Run
from analysis.head_summary import HEAD_METRICS
from analysis.retrieval import RetrievalSweep, load_sweep
from app import figures
from app.views import VIEWS, Rows, View, check_head, memoised, metric_scores

AGGREGATES = {
    "query": "per query head",
    "group_max": "per key-value group (max over its query heads)",
    "group_mean": "per key-value group (mean over its query heads)",
}
RETRIEVAL_THRESHOLD = 0.1


def sweep_of(params: dict[str, Any]) -> RetrievalSweep:
    from app.context import get_context

    key = params.get("sweep")
    store = get_context().store
    keys = store.find(str(key)) if key else []
    sweep = load_sweep(store, keys[0]) if len(keys) == 1 else None
    if sweep is None:
        raise InputError(f"No stored sweep has the id {key!r}: run the sweep again.")
    return sweep


def retrieval_table(sweep: RetrievalSweep, agg: str) -> np.ndarray:
    if agg not in AGGREGATES:
        raise InputError(f"Unknown aggregation {agg!r}; choose one of {', '.join(AGGREGATES)}.")
    return {"query": sweep.scores, "group_max": sweep.group_max, "group_mean": sweep.group_mean}[agg]


def retrieval_grid_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    sweep = sweep_of(params)
    agg = params.get("agg", "query")
    table = retrieval_table(sweep, agg)
    selected = None
    if agg == "query" and params.get("layer") is not None and params.get("head") is not None:
        selected = check_head(run, params["layer"], params["head"])
    fig = figures.head_grid(table, "Retrieval score", selected)
    fig.update_layout(title_text=f"Retrieval score {AGGREGATES[agg]} — {sweep.n_counted}/{sweep.n_trials} trials counted")
    if agg != "query":
        fig.update_xaxes(title="key-value head")
    rows = [{"layer": la, "head" if agg == "query" else "kv_head": h, "retrieval": float(table[la, h])}
            for la in range(table.shape[0]) for h in range(table.shape[1])]
    return fig, rows


def retrieval_histogram_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    sweep = sweep_of(params)
    fig = figures.score_histogram(sweep.scores, "Retrieval score", RETRIEVAL_THRESHOLD)
    share = sweep.share_above(RETRIEVAL_THRESHOLD)
    fig.update_layout(title_text=f"Retrieval score over heads: {share:.1%} above {RETRIEVAL_THRESHOLD}")
    rows = [{"layer": la, "head": h, "retrieval": float(sweep.scores[la, h])}
            for la in range(sweep.scores.shape[0]) for h in range(sweep.scores.shape[1])]
    return fig, rows


def retrieval_scatter_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    sweep = sweep_of(params)
    other = params.get("versus", "streaming")
    versus = metric_scores(run, other)
    label = HEAD_METRICS[other].label
    fig = figures.head_scatter(np.nan_to_num(sweep.scores, nan=0.0), versus, "Retrieval score", label)
    rows = [{"layer": la, "head": h, "retrieval": float(sweep.scores[la, h]), other: float(versus[la, h])}
            for la in range(versus.shape[0]) for h in range(versus.shape[1])]
    return fig, rows


def niah_grid_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    sweep = sweep_of(params)
    fig = figures.niah_grid(sweep.accuracy, sweep.lengths, sweep.depths)
    rows = [{"length": n, "depth": d, "accuracy": float(sweep.accuracy[i, j]), "recall": float(sweep.recall[i, j])}
            for i, n in enumerate(sweep.lengths) for j, d in enumerate(sweep.depths)]
    return fig, rows


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


def trial_steps_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """Where one head looked at each decode step of one trial: its argmax key, the needle shaded."""
    sweep = sweep_of(params)
    layer, head = check_head(run, params.get("layer"), params.get("head"))
    k = int(params.get("trial") or 0)
    if not 0 <= k < len(sweep.trials):
        raise InputError(f"Trial {k} is out of range: this sweep has trials 0..{len(sweep.trials) - 1}.")
    t = sweep.trials[k]
    keys = np.asarray(t.argmax_keys)[:, layer, head]
    weights = np.asarray(t.argmax_weight)[:, layer, head]
    start, end = t.settings["needle_span"]
    hit_steps = {s for s, la, h in t.hits if la == layer and h == head}
    steps = list(range(len(keys)))
    fig = go.Figure()
    fig.add_hrect(y0=start - 0.5, y1=end - 0.5, fillcolor="#f4a259", opacity=0.3, line_width=0,
                  annotation_text="needle", annotation_position="top left")
    generated = [figures.safe_text(s) for s in _token_strings(t.generated)]
    fig.add_trace(go.Scatter(
        x=steps, y=keys, mode="markers+lines",
        marker={"size": 10, "color": ["#2ca02c" if s in hit_steps else "#2a6fdb" for s in steps]},
        customdata=np.stack([weights, np.arange(len(keys))], -1).tolist(), text=generated[: len(keys)],
        hovertemplate="step %{x}: generated %{text}<br>argmax key %{y}, weight %{customdata[0]:.3f}<extra></extra>",
    ))
    fig.update_xaxes(title="decode step")
    fig.update_yaxes(title="argmax key position", range=[-1, t.settings["n_tokens"]])
    title = (f"Layer {layer}, head {head}, trial {k}: {len(hit_steps)} copy-paste steps (green) of "
             f"{end - start} needle tokens — response {t.response.strip()[:40]!r}")
    figures._layout(fig, figures.safe_text(title), height=360)
    rows = [{"step": s, "argmax_key": int(keys[s]), "weight": float(weights[s]), "copy_paste": s in hit_steps}
            for s in steps]
    return fig, rows


def _token_strings(ids: list[int]) -> list[str]:
    from analysis.models import load_model
    from app.context import get_context

    model = load_model(get_context().default_model)
    return model.token_strings(ids)


def sweep_run(sweep: RetrievalSweep) -> Run:
    """The sweep's first prompt as a stored run (its patterns give streaming and sink scores)."""
    from analysis.capture import capture
    from analysis.models import load_model
    from app.context import get_context

    context = get_context()
    model = load_model(context.default_model)
    ids = sweep.trials[0].prompt_ids
    return memoised(("sweep_run", sweep.key), lambda: capture(model, ids, store=context.store,
                                                              max_tokens=max(len(ids), 1)))


for view in [
    View("retrieval_grid", "Retrieval score map", retrieval_grid_view, ("sweep", "agg", "layer", "head")),
    View("retrieval_histogram", "Retrieval score histogram", retrieval_histogram_view, ("sweep",)),
    View("retrieval_scatter", "Retrieval vs another score", retrieval_scatter_view, ("sweep", "versus")),
    View("niah_grid", "Needle-in-a-haystack accuracy", niah_grid_view, ("sweep",)),
    View("trial_steps", "A head's argmax per decode step", trial_steps_view, ("sweep", "layer", "head", "trial")),
]:
    VIEWS[view.name] = view
