"""Views of one run for the Flow page: token relevance for a target (raw attention, rollout, flow;
Abnar & Zuidema 2020), rollout per layer, gradient and ablation attribution, and their faithfulness.

They need full attention patterns: a statistics run says so (:meth:`headscope.analysis.runs.AttentionRun.require_patterns`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from headscope.analysis.attribution import CORRECTED_METHODS, PLAIN_METHODS, RELEVANCE_METHODS
from headscope.analysis.capture import Run
from headscope.analysis.errors import InputError
from headscope.analysis.flow import relevance_shares
from headscope.analysis.limits import limit
from headscope.analysis.runs import AttentionRun
from headscope.app import figures
from headscope.app.views import names
from headscope.app.views.registry import Rows, memoised, register


def _relevance(state: Any) -> dict[str, Any]:
    return {"target": state.target, "fusion": state.fusion, "drop_sink": state.drop_sink}


def max_flow_tokens() -> int:
    """``HEADSCOPE_MAX_FLOW_TOKENS``, read when checked (like every limit)."""
    return limit("HEADSCOPE_MAX_FLOW_TOKENS")


def check_target(run: AttentionRun, target: Any) -> int:
    run.require_patterns("Attention rollout, flow and attribution")
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
    """Every Flow-page number for ``target`` (:func:`headscope.analysis.attribution.token_relevance`), memoised."""
    from headscope.analysis.attribution import token_relevance as compute

    sinks, flow_limit = ((0,) if drop_sink else ()), max_flow_tokens()
    return memoised((run.key, "flow_numbers", target, fusion, drop_sink, flow_limit),
                    lambda: compute(run.patterns, target, fusion=fusion, drop_sinks=sinks, flow_limit=flow_limit,
                                    corrected=True))


def token_relevance(run: Run, method: str, target: int, fusion: str = "mean", drop_sink: bool = False) -> np.ndarray:
    """One method's relevance of positions 0 .. ``target`` (:func:`flow_numbers`); an ``InputError``
    says why when the method is unknown or unavailable (flow past its token limit)."""
    if method not in RELEVANCE_METHODS:
        raise InputError(f"Unknown relevance method {method!r}; choose one of {', '.join(RELEVANCE_METHODS)}.")
    numbers = flow_numbers(run, target, fusion, drop_sink)
    if method in numbers.unavailable:
        raise InputError(numbers.unavailable[method])
    return numbers.scores[method]


def relevance_scale(run: Run, target: int, fusion: str, drop_sink: bool, method: str = "rollout") -> float:
    """The top of the colour scale ``method``'s strip shares with its group: the largest share
    (:func:`headscope.analysis.flow.relevance_shares`) any of them shows. Raw attention, rollout and flow share
    one scale; the two position-corrected strips (ratios, normalised) share another."""
    numbers = flow_numbers(run, target, fusion, drop_sink)
    group = CORRECTED_METHODS if method in CORRECTED_METHODS else PLAIN_METHODS
    return max(1e-6, max(float(np.max(relevance_shares(v))) for m, v in numbers.scores.items() if m in group))


@register(names.RELEVANCE, "Token relevance", ("target", "method", "fusion", "drop_sink"),
          lambda state, query, method: {**_relevance(state), "method": method})
def relevance_view(run: AttentionRun, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """One strip of the Flow page: each token coloured by its share of the method's relevance for the
    target (:func:`headscope.analysis.flow.relevance_shares`: rollout and attention rows already sum to 1, flow's
    max-flow values do not), on the colour scale its group shares (0 to the largest share of any of
    them, :func:`relevance_scale`): one unit, so colours compare. The hover keeps the method's own
    value beside the share, and the rows hold it (the share is its division by the rows' sum)."""
    target = check_target(run, params.get("target"))
    method = params.get("method", "rollout")
    fusion, drop_sink = params.get("fusion", "mean"), bool(params.get("drop_sink", False))
    values = token_relevance(run, method, target, fusion, drop_sink).astype(float)
    shares = relevance_shares(values)
    shown, own = np.full(run.n_tokens, np.nan), np.full(run.n_tokens, np.nan)
    shown[: target + 1], own[: target + 1] = shares, values
    title = f"{RELEVANCE_METHODS.get(method, method)} → token {target} ({run.tokens[target]})"
    corrected = method in CORRECTED_METHODS
    fig = figures.token_strip(run.tokens, shown, target, figures.safe_text(title),
                              scale=(relevance_scale(run, target, fusion, drop_sink, method),
                                     "corrected share of relevance (shared scale)" if corrected
                                     else "share of relevance (shared scale)"),
                              value_label="share of the target's relevance",
                              also=None if corrected else (f"{method} value", own))  # corrected: already shares
    rows = [{"pos": j, "token": run.tokens[j], "relevance": float(values[j])} for j in range(target + 1)]
    return fig, rows


@register(names.ROLLOUT_LAYERS, "Rollout per layer", ("target", "fusion", "drop_sink"),
          lambda state, query, _: _relevance(state))
def rollout_layers_view(run: AttentionRun, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
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
    """Gradients and leave-one-out ablation of ``run`` at ``target`` (:func:`headscope.analysis.attribution.attribute`).

    The run's own stored patterns go in, so raw attention, rollout and flow scored here are the
    numbers the strips show, to the bit.
    """
    from headscope.analysis.attribution import attribute
    from headscope.analysis.models import load_model

    def compute():
        model = load_model(run.model_name)
        if model.digest != run.model_digest:
            raise InputError("The model loaded now is not the one this run was made with.")
        return attribute(model, run.token_ids, position=target, fusion=fusion, drop_sinks=(0,) if drop_sink else (),
                         patterns=run.patterns)

    return memoised((run.key, "attribution", target, fusion, drop_sink), compute)


@register(names.GRADIENT, "Gradient or ablation attribution", ("target", "method", "fusion", "drop_sink"),
          lambda state, query, method: {**_relevance(state), "method": method})
def gradient_view(run: AttentionRun, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """Input×gradient norm and leave-one-out ablation importance as token strips."""
    from headscope.analysis.attribution import LABELS

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


@register(names.FAITHFULNESS_INPUT, "Faithfulness on this input", ("target", "fusion", "drop_sink"),
          lambda state, query, _: _relevance(state))
def faithfulness_input_view(run: AttentionRun, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """Spearman ρ of each method with ablation importance, on this input."""
    from headscope.analysis.attribution import LABELS, METHODS

    target = check_target(run, params.get("target"))
    att = attribution_for(run, target, params.get("fusion", "mean"), bool(params.get("drop_sink", False)))
    rho = att.correlations(METHODS)
    labels = [LABELS.get(m, m) for m in METHODS]
    fig = figures.faithfulness_bars(labels, [rho[m] for m in METHODS], None,
                                    f"Faithfulness on this input (target token {target}; "
                                    f"{options_label(params)})")
    return fig, [{"method": m, "label": lbl, "spearman": float(rho[m])} for m, lbl in zip(METHODS, labels, strict=True)]


@register(names.FAITHFULNESS_SET, "Faithfulness over the built-in set", ("fusion", "drop_sink"),
          lambda state, query, _: {"fusion": state.fusion, "drop_sink": state.drop_sink, "_compute": False})
def faithfulness_set_view(run: AttentionRun, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """Mean ± std of ρ over the built-in evaluation set (stored; computed when absent)."""
    from headscope.analysis.attribution import LABELS, METHODS, stored_evaluation
    from headscope.analysis.models import load_model
    from headscope.app.context import get_context

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
