"""Views of two stored runs compared head by head (:mod:`headscope.analysis.run_comparison`): a per-head score of
both and its change, and one head's change in attention. The runs are named by key (or a unique
prefix) in ``params["first"]`` and ``params["second"]``; every change is second − first.

``headscope compare`` exports them and ``headscope figure`` rebuilds them from their manifests.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from headscope.analysis.errors import InputError
from headscope.analysis.run_comparison import attention_difference, compare_runs
from headscope.analysis.runs import AttentionRun
from headscope.analysis.score_registry import HEAD_SCORES
from headscope.app import figures
from headscope.app.views import names
from headscope.app.views.registry import Rows, check_metric, register


def comparison_params(state: Any, which: str = "") -> dict[str, Any]:
    """The views' params from a state with ``first``, ``second``, ``metric``, ``layer``, ``head`` (the
    Compare page's first run defaults to the page's shared ``run``)."""
    from headscope.app.context import get_context

    params = {k: getattr(state, k, None) for k in ("first", "second", "metric", "layer", "head")}
    params["first"] = params["first"] or getattr(state, "run", None)
    # the manifest names the first run's model, as `headscope compare` writes it
    first = get_context().run(params["first"]) if params["first"] else None
    params["model"] = first.model_name if first is not None else get_context().default_model
    return params


def stored_run(key: Any, which: str) -> AttentionRun:
    """The stored run whose key starts with ``key``; an ``InputError`` naming ``which`` otherwise."""
    from headscope.app.context import get_context

    if not isinstance(key, str) or not key:
        raise InputError(f"Name the {which} run by its id (at least 8 hex digits; `headscope runs list` lists them).")
    run = get_context().run(key)
    if run is None:
        raise InputError(f"No stored run has the id {key!r} (the {which} run): `headscope runs list` lists them.")
    return run


def _name(run: AttentionRun) -> str:
    text = (run.text or "").replace("\n", " ")
    return f"{run.short_id[:8]} {run.model_name}: {text[:28] + '…' if len(text) > 28 else text}"


@register(names.RUN_COMPARISON, "Per-head score of two runs and its change", ("first", "second", "metric"),
          lambda state, query, which: comparison_params(state, which), needs_run=False)
def run_comparison_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    first, second = stored_run(params.get("first"), "first"), stored_run(params.get("second"), "second")
    metric = check_metric(params.get("metric") or "entropy")
    result = compare_runs(first, second, metric)
    label = HEAD_SCORES[metric].label
    differ = f"; tokens differ at {len(result.differ)} position(s)" if result.differ else ""
    selected = None
    if params.get("layer") is not None and params.get("head") is not None:
        from headscope.app.views.registry import check_head

        selected = check_head(first, params["layer"], params["head"])
    fig = figures.comparison_grids(result.first_scores, result.second_scores, label, _name(first), _name(second),
                                   f"{label}: {result.kind}{differ}", selected, result.resolution, result.stored,
                                   signed=HEAD_SCORES[metric].signed)
    rows: Rows = [{"layer": la, "head": h, "metric": metric, "first": float(result.first_scores[la, h]),
                   "second": float(result.second_scores[la, h]), "change": float(result.difference[la, h])}
                  for la in range(first.n_layers) for h in range(first.n_heads)]
    return fig, rows


@register(names.ATTENTION_DIFFERENCE, "Change in one head's attention between two runs",
          ("first", "second", "layer", "head"), lambda state, query, which: comparison_params(state, which),
          needs_run=False)
def attention_difference_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    first, second = stored_run(params.get("first"), "first"), stored_run(params.get("second"), "second")
    diff = attention_difference(first, second, params.get("layer"), params.get("head"))
    layer, head = int(params["layer"]), int(params["head"])
    differ = [i for i, (a, b) in enumerate(zip(first.token_ids, second.token_ids, strict=True)) if a != b]
    tokens = [a if a == b else f"{a} / {b}" for a, b in zip(first.tokens, second.tokens, strict=True)]
    fig = figures.attention_difference_map(diff, tokens, layer, head, first.block_size, differ)
    rows: Rows = [{"query": q * first.block_size, "key": k * first.block_size, "change": float(diff[q, k])}
                  for q in range(diff.shape[0]) for k in range(q + 1)]
    return fig, rows
