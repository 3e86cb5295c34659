"""Named views: a run plus parameters → a figure and the table of numbers behind it.

The page, the export bundles and ``headscope figure MANIFEST`` all go through :data:`VIEWS`, so a
figure regenerated from a manifest is built by exactly the code that drew it in the browser.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go

from analysis.capture import InputError, Run
from analysis.head_summary import HEAD_METRICS
from app import figures

Rows = list[dict[str, Any]]


def check_head(run: Run, layer: Any, head: Any) -> tuple[int, int]:
    """Validated (layer, head) for ``run``; a clear ``InputError`` otherwise."""
    n_layers, n_heads = run.patterns.shape[:2]
    try:
        layer, head = int(layer), int(head)
    except (TypeError, ValueError):
        raise InputError(f"Layer and head must be whole numbers, got {layer!r} and {head!r}.") from None
    if not 0 <= layer < n_layers:
        raise InputError(f"Layer {layer} is out of range: this model has layers 0..{n_layers - 1}.")
    if not 0 <= head < n_heads:
        raise InputError(f"Head {head} is out of range: this model has heads 0..{n_heads - 1}.")
    return layer, head


def check_metric(metric: Any) -> str:
    if metric not in HEAD_METRICS:
        raise InputError(f"Unknown metric {metric!r}; choose one of: {', '.join(HEAD_METRICS)}.")
    return metric


_scores: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()
_scores_lock = threading.Lock()


def metric_scores(run: Run, metric: str) -> np.ndarray:
    """``[layer, head]`` scores of ``metric`` on ``run``, memoised for the last few runs."""
    key = (run.key, check_metric(metric))
    with _scores_lock:
        if key in _scores:
            _scores.move_to_end(key)
            return _scores[key]
    scores = HEAD_METRICS[metric].compute(run.patterns)
    with _scores_lock:
        _scores[key] = scores
        while len(_scores) > 64:
            _scores.popitem(last=False)
    return scores


def head_grid_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    metric = check_metric(params.get("metric", "entropy"))
    selected = None
    if params.get("layer") is not None and params.get("head") is not None:
        selected = check_head(run, params["layer"], params["head"])
    scores = metric_scores(run, metric)
    fig = figures.head_grid(scores, HEAD_METRICS[metric].label, selected)
    rows = [
        {"layer": layer, "head": head, "metric": metric, "value": float(scores[layer, head])}
        for layer in range(scores.shape[0])
        for head in range(scores.shape[1])
    ]
    return fig, rows


def attention_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    layer, head = check_head(run, params.get("layer"), params.get("head"))
    pattern = np.asarray(run.patterns[layer, head], dtype=np.float32)
    fig = figures.attention_heatmap(pattern, run.tokens, layer, head)
    rows = [
        {"query_pos": i, "query_token": run.tokens[i], "key_pos": j, "key_token": run.tokens[j],
         "weight": float(pattern[i, j])}
        for i in range(run.n_tokens)
        for j in range(i + 1)
    ]
    return fig, rows


def token_strip_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    layer, head = check_head(run, params.get("layer"), params.get("head"))
    query = params.get("query")
    if query is None:
        query = run.n_tokens - 1
    try:
        query = int(query)
    except (TypeError, ValueError):
        raise InputError(f"The query position must be a whole number, got {query!r}.") from None
    if not 0 <= query < run.n_tokens:
        raise InputError(f"Query position {query} is out of range 0..{run.n_tokens - 1}.")
    weights = np.asarray(run.patterns[layer, head, query], dtype=np.float32).copy()
    weights[query + 1 :] = np.nan
    title = f"Attention from token {query} ({run.tokens[query]}) — layer {layer}, head {head}"
    fig = figures.token_strip(run.tokens, weights, query, figures.safe_text(title))
    rows = [
        {"key_pos": j, "key_token": run.tokens[j], "weight": float(weights[j])} for j in range(query + 1)
    ]
    return fig, rows


@dataclass(frozen=True)
class View:
    name: str
    title: str
    build: Callable[[Run, dict[str, Any]], tuple[go.Figure, Rows]]
    params: tuple[str, ...]


VIEWS: dict[str, View] = {
    v.name: v
    for v in [
        View("head_grid", "Per-head summary grid", head_grid_view, ("metric", "layer", "head")),
        View("attention", "Attention heatmap", attention_view, ("layer", "head")),
        View("token_strip", "Attention row over tokens", token_strip_view, ("layer", "head", "query")),
    ]
}
