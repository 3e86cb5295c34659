"""Named views: a run plus parameters → a figure and the table of numbers behind it.

The page, the export bundles and ``headscope figure MANIFEST`` all go through :data:`VIEWS`, so a
figure regenerated from a manifest is built by exactly the code that drew it in the browser.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go

from analysis.attribution import RELEVANCE_METHODS
from analysis.capture import InputError, Run
from analysis.head_summary import HEAD_METRICS
from analysis.limits import limit
from analysis.statistics_run import (
    StatsRun,
    parse_region,
    received,
    sink_positions,
    statistics_score,
)
from app import figures

Rows = list[dict[str, Any]]


def check_head(run: Run | StatsRun, layer: Any, head: Any) -> tuple[int, int]:
    """Validated (layer, head) for ``run``; a clear ``InputError`` otherwise."""
    if isinstance(run, StatsRun):
        return check_head_index(run.n_layers, run.n_heads, layer, head)
    return check_head_index(run.patterns.shape[0], run.patterns.shape[1], layer, head)


def needs_patterns(run: Any, what: str) -> None:
    """A clear error for a view that needs full patterns, asked of a long (statistics) run."""
    if isinstance(run, StatsRun):
        raise InputError(f"{what} needs full attention patterns; this {run.n_tokens:,}-token run kept statistics "
                         "only (longer than HEADSCOPE_MAX_TOKENS). Run a shorter text.")


def check_head_index(n_layers: int, n_heads: int, layer: Any, head: Any) -> tuple[int, int]:
    """Validated (layer, head) for a model of ``n_layers`` × ``n_heads``; a clear ``InputError`` otherwise."""
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


_memo: OrderedDict[tuple, np.ndarray] = OrderedDict()
_memo_lock = threading.Lock()


def _fresh_lock_in_child() -> None:
    global _memo_lock
    _memo_lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock_in_child)


def memoised(key: tuple, compute: Callable[[], np.ndarray]) -> np.ndarray:
    """Results of analyses on stored runs, kept for the last few requests (pages re-render often)."""
    with _memo_lock:
        if key in _memo:
            _memo.move_to_end(key)
            return _memo[key]
    value = compute()
    with _memo_lock:
        _memo[key] = value
        while len(_memo) > 64:
            _memo.popitem(last=False)
    return value


def metric_scores(run: Run | StatsRun, metric: str) -> np.ndarray:
    """``[layer, head]`` scores of ``metric`` on ``run`` (from statistics for a long run)."""
    metric = check_metric(metric)
    if isinstance(run, StatsRun):
        return memoised((run.key, "metric", metric), lambda: statistics_score(run, metric))
    return memoised((run.key, "metric", metric), lambda: HEAD_METRICS[metric].compute(run.patterns, run.token_ids))


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
    if isinstance(run, StatsRun):
        return pooled_attention_view(run, layer, head)
    pattern = np.asarray(run.patterns[layer, head], dtype=np.float32)
    fig = figures.attention_heatmap(pattern, run.tokens, layer, head)
    rows = [
        {"query_pos": i, "query_token": run.tokens[i], "key_pos": j, "key_token": run.tokens[j],
         "weight": float(pattern[i, j])}
        for i in range(run.n_tokens)
        for j in range(i + 1)
    ]
    return fig, rows


def pooled_attention_view(run: StatsRun, layer: int, head: int) -> tuple[go.Figure, Rows]:
    """A long run's head as its block-pooled map: mean attention per ``B × B`` block of (query, key)."""
    B, n = run.block_size, run.n_tokens
    pooled = np.asarray(run.pooled[layer, head], dtype=np.float64)
    fig = figures.pooled_attention_map(pooled, B, n, layer, head)
    rows = [{"query_block_start": i * B, "key_block_start": j * B, "block": B, "mean_weight": float(pooled[i, j])}
            for i in range(pooled.shape[0]) for j in range(min(i + 1, pooled.shape[1]))]
    return fig, rows


def region_view(run: StatsRun, layer: int, head: int, region: str | None) -> tuple[go.Figure, Rows]:
    """Exact attention of a zoomed region of a long run, recomputed through the kernel."""
    from analysis.models import load_model
    from analysis.statistics_run import exact_region

    if not region:
        return figures.message_figure("Drag a box on the pooled map to see the exact attention of that region "
                                      "(recomputed through the kernel)."), []
    (q0, q1), (k0, k1) = parse_region(region, run.n_tokens)
    values = memoised((run.key, "region", layer, head, q0, q1, k0, k1),
                      lambda: exact_region(load_model(run.model_name), run, layer, head, (q0, q1), (k0, k1)))
    fig = figures.attention_region(values, q0, k0, run.tokens, layer, head)
    rows = [{"query_pos": q0 + i, "query_token": run.tokens[q0 + i], "key_pos": k0 + j,
             "key_token": run.tokens[k0 + j], "weight": float(values[i, j])}
            for i in range(values.shape[0]) for j in range(values.shape[1]) if k0 + j <= q0 + i]
    return fig, rows


def token_strip_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    layer, head = check_head(run, params.get("layer"), params.get("head"))
    if isinstance(run, StatsRun):
        return region_view(run, layer, head, params.get("region"))
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


def max_flow_tokens() -> int:
    """``HEADSCOPE_MAX_FLOW_TOKENS``, read when checked (like every limit)."""
    return limit("HEADSCOPE_MAX_FLOW_TOKENS")


def check_target(run: Run, target: Any) -> int:
    needs_patterns(run, "Attention rollout, flow and attribution")
    if target is None:
        return run.n_tokens - 1
    try:
        target = int(target)
    except (TypeError, ValueError):
        raise InputError(f"The target position must be a whole number, got {target!r}.") from None
    if not 0 <= target < run.n_tokens:
        raise InputError(f"Target position {target} is out of range: this run has positions 0..{run.n_tokens - 1}.")
    return target


def flow_numbers(run: Run, target: int, fusion: str = "mean", drop_sink: bool = False):
    """Every Flow-page number for ``target`` (:func:`analysis.attribution.token_relevance`), memoised."""
    from analysis.attribution import token_relevance as compute

    sinks, flow_limit = ((0,) if drop_sink else ()), max_flow_tokens()
    return memoised((run.key, "flow_numbers", target, fusion, drop_sink, flow_limit),
                    lambda: compute(run.patterns, target, fusion=fusion, drop_sinks=sinks, flow_limit=flow_limit))


def token_relevance(run: Run, method: str, target: int, fusion: str = "mean", drop_sink: bool = False) -> np.ndarray:
    """One method's relevance of positions 0 .. ``target`` (:func:`flow_numbers`); an ``InputError``
    says why when the method is unknown or unavailable (flow past its token limit)."""
    if method not in RELEVANCE_METHODS:
        raise InputError(f"Unknown relevance method {method!r}; choose one of {', '.join(RELEVANCE_METHODS)}.")
    numbers = flow_numbers(run, target, fusion, drop_sink)
    if method in numbers.unavailable:
        raise InputError(numbers.unavailable[method])
    return numbers.scores[method]


def relevance_scale(run: Run, target: int, fusion: str, drop_sink: bool) -> float:
    """The top of the colour scale the three strips share: the largest value any of them shows."""
    numbers = flow_numbers(run, target, fusion, drop_sink)
    return max(1e-6, max(float(np.max(v)) for v in numbers.scores.values()))


def relevance_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """One strip of the Flow page: a method's relevance of each token for the target, on the colour
    scale the three strips share (0 to the largest value of any of them), so colours compare."""
    target = check_target(run, params.get("target"))
    method = params.get("method", "rollout")
    fusion, drop_sink = params.get("fusion", "mean"), bool(params.get("drop_sink", False))
    values = token_relevance(run, method, target, fusion, drop_sink).astype(float)
    shown = np.full(run.n_tokens, np.nan)
    shown[: target + 1] = values
    title = f"{RELEVANCE_METHODS.get(method, method)} → token {target} ({run.tokens[target]})"
    fig = figures.token_strip(run.tokens, shown, target, figures.safe_text(title),
                              scale=(relevance_scale(run, target, fusion, drop_sink),
                                     "relevance<br>(shared scale)"))
    rows = [{"pos": j, "token": run.tokens[j], "relevance": float(values[j])} for j in range(target + 1)]
    return fig, rows


def rollout_layers_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    target = check_target(run, params.get("target"))
    fusion, drop_sink = params.get("fusion", "mean"), bool(params.get("drop_sink", False))
    per_layer = flow_numbers(run, target, fusion, drop_sink).rollout_layers
    title = f"Rollout to token {target} ({run.tokens[target]}) after each layer"
    fig = figures.layer_position_heatmap(per_layer, run.tokens[: target + 1], figures.safe_text(title))
    rows = [
        {"layer": layer, "pos": j, "token": run.tokens[j], "rollout": float(per_layer[layer, j])}
        for layer in range(per_layer.shape[0])
        for j in range(per_layer.shape[1])
    ]
    return fig, rows


def attribution_for(run: Run, target: int, fusion: str, drop_sink: bool):
    """Gradients and leave-one-out ablation of ``run`` at ``target`` (:func:`analysis.attribution.attribute`).

    The run's own stored patterns go in, so raw attention, rollout and flow scored here are the
    numbers the strips show, to the bit.
    """
    from analysis.attribution import attribute
    from analysis.models import load_model

    def compute():
        model = load_model(run.model_name)
        if model.digest != run.model_digest:
            raise InputError("The model loaded now is not the one this run was made with.")
        return attribute(model, run.token_ids, position=target, fusion=fusion, drop_sinks=(0,) if drop_sink else (),
                         patterns=run.patterns)

    return memoised((run.key, "attribution", target, fusion, drop_sink), compute)


def gradient_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """Input×gradient norm and leave-one-out ablation importance as token strips."""
    from analysis.attribution import LABELS

    target = check_target(run, params.get("target"))
    method = params.get("method", "ixg_norm")
    if method not in ("ixg_norm", "ixg_sum", "ablation"):
        raise InputError(f"Unknown method {method!r}; choose ixg_norm, ixg_sum or ablation.")
    att = attribution_for(run, target, params.get("fusion", "mean"), bool(params.get("drop_sink", False)))
    values = np.full(run.n_tokens, np.nan)
    values[: target + 1] = att.scores[method]
    label = LABELS.get(method, "Leave-one-out ablation importance") if method != "ablation" else (
        "Leave-one-out ablation importance (Δ log p)")
    title = f"{label} → next token {att.target_token!r} after token {target}"
    shown = np.abs(values) if method != "ixg_norm" else values
    fig = figures.token_strip(run.tokens, shown, target, figures.safe_text(title))
    rows = [{"pos": j, "token": run.tokens[j], method: float(values[j])} for j in range(target + 1)]
    return fig, rows


def options_label(params: dict[str, Any]) -> str:
    """The options raw attention, rollout and flow were scored with, as a chart title says them."""
    sink = "sink dropped" if params.get("drop_sink") else "sink kept"
    return f"{params.get('fusion', 'mean')} over heads, {sink}, as in the strips"


def faithfulness_input_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """Spearman ρ of each method with ablation importance, on this input."""
    from analysis.attribution import LABELS, METHODS

    target = check_target(run, params.get("target"))
    att = attribution_for(run, target, params.get("fusion", "mean"), bool(params.get("drop_sink", False)))
    rho = att.correlations(METHODS)
    labels = [LABELS.get(m, m) for m in METHODS]
    fig = figures.faithfulness_bars(labels, [rho[m] for m in METHODS], None,
                                    f"Faithfulness on this input (target token {target}; "
                                    f"{options_label(params)})")
    return fig, [{"method": m, "label": lbl, "spearman": float(rho[m])} for m, lbl in zip(METHODS, labels, strict=True)]


def faithfulness_set_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """Mean ± std of ρ over the built-in evaluation set (stored; computed when absent)."""
    from analysis.attribution import LABELS, METHODS, stored_evaluation
    from analysis.models import load_model
    from app.context import get_context

    model = load_model(run.model_name)
    fusion, drop_sink = params.get("fusion", "mean"), bool(params.get("drop_sink", False))
    result = stored_evaluation(model, get_context().store, fusion=fusion, drop_sinks=(0,) if drop_sink else (),
                               progress=params.get("_progress"), compute=params.get("_compute", True))
    if result is None:
        raise InputError("The built-in evaluation has not been run for these settings yet.")
    ids_, rho, _seconds = result
    means = [float(np.nanmean(rho[:, k])) for k in range(len(METHODS))]
    stds = [float(np.nanstd(rho[:, k], ddof=1)) for k in range(len(METHODS))]
    labels = [LABELS.get(m, m) for m in METHODS]
    fig = figures.faithfulness_bars(labels, means, stds, f"Faithfulness over the built-in set ({len(ids_)} inputs; "
                                    f"{options_label(params)})",
                                    per_input=rho, input_names=ids_)
    rows = [{"input": item, "method": m, "spearman": float(rho[i, k])}
            for i, item in enumerate(ids_) for k, m in enumerate(METHODS)]
    return fig, rows


def sink_map_view(run: Run, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """Attention each key receives from later queries, per layer (mean over heads), and the sinks.

    ``received(l, h, j) = Σ_{i>j} A[i, j] / (N − 1 − j)`` (:func:`analysis.streaming.sink_map`); a
    position is a sink of a head when it receives at least ``SINK_THRESHOLD`` with ``SINK_MIN_LATER``
    or more later queries. Sinks after position 0 are the mid-sequence sinks (Gu et al. 2024). The
    title says which positions were checked, and when a text is too short to call any sink.
    """
    from analysis.streaming import SINK_MIN_LATER, sink_checked_positions, sink_map

    if isinstance(run, StatsRun):
        rec, counts = received(run), sink_positions(run)
    else:
        sm = memoised((run.key, "sink_map"), lambda: sink_map(run.patterns))
        rec, counts = sm.received, sm.head_counts
    positions = [int(p) for p in np.flatnonzero(counts)]
    with np.errstate(all="ignore"):  # the last position has no later query: nan for every head
        per_layer = np.where(np.isnan(rec).all(1), np.nan,
                             np.nansum(rec, axis=1) / np.maximum((~np.isnan(rec)).sum(1), 1))
    mid = ", ".join([f"{p} {run.tokens[p]} ({int(counts[p])} heads)" for p in positions if p > 0][:6])
    checked = sink_checked_positions(run.n_tokens)
    if checked == 0:
        title = (f"Attention received per key, mean over heads — too short to call sinks: a sink needs at least "
                 f"{SINK_MIN_LATER} later tokens, this text has {run.n_tokens} tokens")
    else:
        title = (f"Attention received per key, mean over heads — positions 0–{checked - 1} checked "
                 f"({SINK_MIN_LATER}+ later tokens): position 0 is a sink for {int(counts[0])} heads; "
                 f"mid-sequence sinks: {mid or 'none'}")
    fig = figures.layer_position_heatmap(per_layer, run.tokens, figures.safe_text(title), "received attention",
                                        log=True)
    rows: Rows = [{"layer": la, "pos": j, "token": run.tokens[j], "mean_received": float(per_layer[la, j])}
                  for la in range(per_layer.shape[0]) for j in range(per_layer.shape[1])]
    rows += [{"sink_pos": p, "token": run.tokens[p], "heads_flagging": int(counts[p])} for p in positions]
    return fig, rows


@dataclass(frozen=True)
class View:
    name: str
    title: str
    build: Callable[[Run, dict[str, Any]], tuple[go.Figure, Rows]]
    params: tuple[str, ...]
    needs_run: bool = True  # False: drawn from the model and stored results named in the params


VIEWS: dict[str, View] = {
    v.name: v
    for v in [
        View("head_grid", "Per-head summary grid", head_grid_view, ("metric", "layer", "head")),
        View("attention", "Attention heatmap", attention_view, ("layer", "head")),
        View("token_strip", "Attention row over tokens", token_strip_view, ("layer", "head", "query", "region")),
        View("sink_map", "Attention sinks per layer and position", sink_map_view, ()),
        View("relevance", "Token relevance", relevance_view, ("target", "method", "fusion", "drop_sink")),
        View("rollout_layers", "Rollout per layer", rollout_layers_view, ("target", "fusion", "drop_sink")),
        View("gradient", "Gradient or ablation attribution", gradient_view, ("target", "method", "fusion", "drop_sink")),
        View("faithfulness_input", "Faithfulness on this input", faithfulness_input_view,
             ("target", "fusion", "drop_sink")),
        View("faithfulness_set", "Faithfulness over the built-in set", faithfulness_set_view, ("fusion", "drop_sink")),
    ]
}


# Views of sweeps and of query-key space live beside their pages' code; importing them registers them
# here, so exports and `headscope figure` find every view.
from app import ablation_views, heads_views, qk_views  # noqa: E402,F401
