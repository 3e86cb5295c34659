"""Views of one run for the Attention page: the per-head summary grid, one head's attention (full
heatmap, or for a long run its block-pooled map), the attention row of a token (for a long run the
exact values of a zoomed region) and the attention sinks.

Every number is read through the run interface (:class:`headscope.analysis.runs.AttentionRun`), so both run
kinds draw here with the same definitions.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from headscope.analysis.errors import InputError
from headscope.analysis.model_facts import window_note
from headscope.analysis.runs import AttentionRun
from headscope.analysis.score_registry import HEAD_SCORES
from headscope.analysis.statistics_run import parse_region
from headscope.app import figures
from headscope.app.views import names
from headscope.app.views.registry import Rows, check_head, check_metric, memoised, metric_scores, register


def _head(state: Any) -> dict[str, Any]:
    return {"layer": state.layer or 0, "head": state.head or 0}


@register(names.HEAD_GRID, "Per-head summary grid", ("metric", "layer", "head"),
          lambda state, query, _: {"metric": state.metric, **_head(state)})
def head_grid_view(run: AttentionRun, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    metric = check_metric(params.get("metric", "entropy"))
    selected = None
    if params.get("layer") is not None and params.get("head") is not None:
        selected = check_head(run, params["layer"], params["head"])
    scores = metric_scores(run, metric)
    windows = run.layer_windows
    score = HEAD_SCORES[metric]
    fig = figures.head_grid(scores, score.label, selected, windows=windows,
                            window_note=window_note(windows, score.windowed), signed=score.signed)
    rows = [
        {"layer": layer, "head": head, "metric": metric, "value": float(scores[layer, head]),
         "attention_window": windows[layer] if windows else None}
        for layer in range(scores.shape[0])
        for head in range(scores.shape[1])
    ]
    return fig, rows


@register(names.ATTENTION, "Attention heatmap", ("layer", "head"), lambda state, query, _: _head(state))
def attention_view(run: AttentionRun, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """One head's pattern ``A[l, h]``; a run without patterns shows its block-pooled map.
    ``_table=False``: the figure only, no rows (the page's redraw on a head click)."""
    layer, head = check_head(run, params.get("layer"), params.get("head"))
    if not run.has_patterns:
        return pooled_attention_view(run, layer, head)
    pattern = run.attention_overview(layer, head)
    fig = figures.attention_heatmap(pattern, run.tokens, layer, head)
    if params.get("_table") is False:  # the page draws the figure only: n²/2 rows are for exports
        return fig, []
    rows = [
        {"query_pos": i, "query_token": run.tokens[i], "key_pos": j, "key_token": run.tokens[j],
         "weight": float(pattern[i, j])}
        for i in range(run.n_tokens)
        for j in range(i + 1)
    ]
    return fig, rows


def pooled_attention_view(run: AttentionRun, layer: int, head: int) -> tuple[go.Figure, Rows]:
    """A long run's head as its block-pooled map: mean attention per ``B × B`` block of (query, key)."""
    B, n = run.block_size, run.n_tokens
    pooled = run.attention_overview(layer, head)
    fig = figures.pooled_attention_map(pooled, B, n, layer, head)
    rows = [{"query_block_start": i * B, "key_block_start": j * B, "block": B, "mean_weight": float(pooled[i, j])}
            for i in range(pooled.shape[0]) for j in range(min(i + 1, pooled.shape[1]))]
    return fig, rows


def region_view(run: AttentionRun, layer: int, head: int, region: str | None) -> tuple[go.Figure, Rows]:
    """Exact attention of a zoomed region of a long run, recomputed through the kernel."""
    if not region:
        return figures.message_figure("Drag a box on the pooled map to see the exact attention of that region "
                                      "(recomputed through the kernel)."), []
    (q0, q1), (k0, k1) = parse_region(region, run.n_tokens)
    values = memoised((run.key, "region", layer, head, q0, q1, k0, k1),
                      lambda: run.attention_region(layer, head, (q0, q1), (k0, k1)))
    fig = figures.attention_region(values, q0, k0, run.tokens, layer, head)
    rows = [{"query_pos": q0 + i, "query_token": run.tokens[q0 + i], "key_pos": k0 + j,
             "key_token": run.tokens[k0 + j], "weight": float(values[i, j])}
            for i in range(values.shape[0]) for j in range(values.shape[1]) if k0 + j <= q0 + i]
    return fig, rows


@register(names.TOKEN_STRIP, "Attention row over tokens", ("layer", "head", "query", "region"),
          lambda state, query, _: {**_head(state), "query": query if query is not None else state.query,
                                   "region": state.region})
def token_strip_view(run: AttentionRun, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """Where a query token attends (``A[l, h][query, :]``); a run without patterns shows the exact
    values of the region zoomed on its pooled map."""
    layer, head = check_head(run, params.get("layer"), params.get("head"))
    if not run.has_patterns:
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
    weights = run.attention_region(layer, head, (query, query + 1), (0, run.n_tokens))[0].copy()
    weights[query + 1 :] = np.nan
    title = f"Attention from token {query} ({run.tokens[query]}) — layer {layer}, head {head}"
    fig = figures.token_strip(run.tokens, weights, query, figures.safe_text(title))
    rows = [
        {"key_pos": j, "key_token": run.tokens[j], "weight": float(weights[j])} for j in range(query + 1)
    ]
    return fig, rows


@register(names.SINK_MAP, "Attention sinks per layer and position", (), lambda state, query, _: {})
def sink_map_view(run: AttentionRun, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """Attention each key receives from later queries, per layer (mean over heads), and the sinks.

    ``received(l, h, j) = Σ_{i>j} A[i, j] / (N − 1 − j)`` (:func:`headscope.analysis.streaming.sink_map`); a
    position is a sink of a head when it receives at least ``SINK_THRESHOLD`` with ``SINK_MIN_LATER``
    or more later queries. Sinks after position 0 are the mid-sequence sinks (Gu et al. 2024). The
    title says which positions were checked, and when a text is too short to call any sink.
    """
    from headscope.analysis.streaming import SINK_MIN_LATER, WINDOWED_SINKS, sink_checked_positions

    rec, counts = memoised((run.key, "sink_map"), lambda: (run.received_attention(), run.sink_counts()))
    positions = [int(p) for p in np.flatnonzero(counts)]
    with np.errstate(all="ignore"):  # the last position has no later query: nan for every head
        per_layer = np.where(np.isnan(rec).all(1), np.nan,
                             np.nansum(rec, axis=1) / np.maximum((~np.isnan(rec)).sum(1), 1))
    mid = ", ".join([f"{p} {run.tokens[p]} ({int(counts[p])} heads)" for p in positions if p > 0][:6])
    checked = sink_checked_positions(run.n_tokens)
    if checked == 0:
        detail = (f"too short to call sinks: a position is checked only with {SINK_MIN_LATER} or more tokens after "
                  f"it, so a text needs at least {SINK_MIN_LATER + 1} tokens; this one has {run.n_tokens}")
    else:
        detail = (f"positions 0–{checked - 1} checked ({SINK_MIN_LATER}+ later tokens): position 0 is a sink for "
                  f"{int(counts[0])} heads; mid-sequence sinks: {mid or 'none'}")
    # two lines, the details small: on one line they ran past the figure and under its modebar
    title = f"Attention received per key, mean over heads<br><sup>{figures.safe_text(detail)}</sup>"
    fig = figures.layer_position_heatmap(per_layer, run.tokens, title, "received attention",
                                         log=True, windows=run.layer_windows,
                                         window_note=window_note(run.layer_windows, WINDOWED_SINKS))
    rows: Rows = [{"layer": la, "pos": j, "token": run.tokens[j], "mean_received": float(per_layer[la, j])}
                  for la in range(per_layer.shape[0]) for j in range(per_layer.shape[1])]
    rows += [{"sink_pos": p, "token": run.tokens[p], "heads_flagging": int(counts[p])} for p in positions]
    return fig, rows
