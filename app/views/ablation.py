"""Views of head ablations (:mod:`headscope.analysis.ablation`) for the Ablation page and its exports.

- ``ablation_selection``: the layer × head map of the score heads are ranked by, chosen heads boxed;
- ``ablation_effects``: per-token loss before/after on the run, with the next-token target, top-k
  and greedy continuations in its data;
- ``ablation_curve``: metric against k for the top-k heads by a score and for k random heads
  (Wu et al. 2024, §4), from a stored curve;
- ``ablation_head_sweep``: the effect of ablating each head alone, from a stored sweep.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from headscope.analysis.ablation import (
    METHOD_DESCRIPTIONS,
    AblationSpec,
    format_heads,
    load_head_means,
    parse_heads,
)
from headscope.analysis.ablation_curve import load_curve, rank_heads
from headscope.analysis.ablation_effects import (
    CONTINUATION_TOKENS,
    AppliedAblation,
    PreparedAblation,
    effects_on,
)
from headscope.analysis.errors import InputError
from headscope.analysis.head_sweep import load_head_sweep
from headscope.analysis.intervals import from_accuracy
from headscope.analysis.runs import AttentionRun
from headscope.analysis.score_registry import HEAD_SCORES, RUN_SCORES
from headscope.app import figures
from headscope.app.views import names
from headscope.app.views.registry import Rows, memoised, metric_scores, register

RANK_LABELS = {"retrieval": "Retrieval score (a sweep)", "effect": "Single-head ablation effect",
               **{name: HEAD_SCORES[name].label for name in RUN_SCORES}}


def _context():
    from headscope.app.context import get_context

    return get_context()


def _model(params: dict[str, Any]):
    from headscope.analysis.models import load_model

    return load_model(params.get("model") or _context().default_model)


def _stored(key: str | None, what: str, loader):
    if not key:
        return None
    store = _context().store
    keys = store.find(str(key))
    found = loader(store, keys[0]) if len(keys) == 1 else None
    if found is None:
        raise InputError(f"No stored {what} has the id {key!r}: compute it again.")
    return found


def ablation_params(state: Any) -> dict[str, Any]:
    """What the Ablation page's views are drawn with (and exported with), from its URL state."""
    return {"model": state.model or _context().default_model, "heads": state.heads, "ablate": state.ablate,
            "by": state.by, "sweep": state.sweep, "hsweep": state.hsweep, "curve": state.curve,
            "ref": state.ref, "source": state.source}


def ablation_spec(model, params: dict[str, Any]) -> AblationSpec:
    """The :class:`AblationSpec` named by a page's parameters (heads, method, mean reference, source)."""
    heads_text = params.get("heads")
    if not heads_text:
        raise InputError("No heads chosen: click heads in the map, type a list (e.g. 12.3, kv:14.1), "
                         "or pick the top k by a score.")
    heads = parse_heads(model, heads_text)
    method = params.get("ablate") or "zero"
    means = source = None
    if method == "mean":
        if not params.get("ref"):
            raise InputError("Mean ablation needs a reference set: press Apply to compute the means "
                             "(the built-in set, or your own texts).")
        means = _stored(params["ref"], "reference mean", load_head_means)
    if method == "resample":
        if not params.get("source"):
            raise InputError("Resample ablation needs a source text: write one and press Apply.")
        run = _context().run(params["source"])
        if run is None:
            raise InputError(f"The source run {params['source']!r} is not stored: write the source text again.")
        source = tuple(run.token_ids)
    spec = AblationSpec(tuple(heads), method, means=means, source_ids=source)
    spec.validate(model)
    return spec


def rank_scores(run: AttentionRun | None, params: dict[str, Any]) -> tuple[np.ndarray, str]:
    """The ``[layer, head]`` score heads are ranked by, and its label."""
    by = params.get("by") or "retrieval"
    if by == "retrieval":
        if not params.get("sweep"):
            raise InputError("No retrieval scores yet: run a needle-in-a-haystack sweep on the Heads page "
                             "(its 'Ablate' link brings them here), or rank heads by another score.")
        from headscope.app.views.heads import sweep_of

        sweep = sweep_of({"sweep": params["sweep"]})
        return np.nan_to_num(sweep.scores, nan=0.0), f"Retrieval score (sweep {sweep.key[:8]})"
    if by == "effect":
        found = _stored(params.get("hsweep"), "single-head sweep", load_head_sweep)
        if found is None:
            raise InputError("No single-head sweep yet: run one below, then rank heads by its effect.")
        return np.nan_to_num(found[0].effect, nan=-np.inf), f"Single-head {found[0].method} effect on {found[0].metric}"
    if not isinstance(by, str) or by not in RUN_SCORES:
        raise InputError(f"Unknown score {str(by)[:40]!r}; choose one of {', '.join(RANK_LABELS)}.")
    if run is None:
        raise InputError("Run a text first: this score is computed on it.")
    return metric_scores(run, by), HEAD_SCORES[by].label + " (this text)"


def top_heads(run: AttentionRun | None, params: dict[str, Any], k: int) -> list[tuple[int, int]]:
    table, label = rank_scores(run, params)
    order = rank_heads(table)
    if not order:
        raise InputError(f"No head has a {label} on this input (the text may be too short for it: the "
                         "streaming score needs more than S + W tokens); choose another score or a longer text.")
    if not 1 <= k <= len(order):
        raise InputError(f"k must be between 1 and {len(order)}, got {k}.")
    return order[:k]


@register(names.ABLATION_SELECTION, "Heads chosen for ablation", ("heads", "by", "sweep", "hsweep"),
          lambda state, query, _: ablation_params(state))
def selection_view(run: AttentionRun, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    model = _model(params)
    scored = True
    try:
        table, label = rank_scores(run, params)
    except InputError:
        table, label, scored = np.zeros((model.n_layers, model.n_heads)), "(no score)", False
    chosen = parse_heads(model, params["heads"]) if params.get("heads") else []
    no_score = [f"{len(chosen)} heads chosen (boxed) — no score yet:", "rank by a score below, or bring a sweep"]
    by = params.get("by")
    signed = scored and isinstance(by, str) and by in HEAD_SCORES and HEAD_SCORES[by].signed
    fig = figures.head_selection(table, label, chosen, title=None if scored else no_score, signed=signed)
    if not scored:  # cells to click, but no colour bar for a score that does not exist yet
        fig.update_traces(showscale=False, colorscale=[[0, "#eeeeee"], [1, "#eeeeee"]],
                          hovertemplate="layer %{y}, head %{x}<extra></extra>", selector={"type": "heatmap"})
    rows = [{"layer": la, "head": h, "score": float(table[la, h]), "chosen": (la, h) in set(chosen)}
            for la in range(table.shape[0]) for h in range(table.shape[1])]
    return fig, rows


def _effects_key(run: AttentionRun, spec: AblationSpec, params: dict[str, Any]) -> tuple:
    return ("ablation_effects", run.key, spec.method, spec.heads, params.get("ref"), params.get("source"),
            int(params.get("continue", CONTINUATION_TOKENS)))


def effects_of(run: AttentionRun, params: dict[str, Any]) -> AppliedAblation:
    """The effects on ``run`` of the ablation ``params`` name, with the stored reference means and source
    run they name (:func:`headscope.analysis.ablation_effects.effects_on`; memoised)."""
    model = _model(params)
    spec = ablation_spec(model, params)
    return memoised(_effects_key(run, spec, params), lambda: effects_on(
        model, run, PreparedAblation(spec), max_new_tokens=int(params.get("continue", CONTINUATION_TOKENS))))


def remember_effects(run: AttentionRun, params: dict[str, Any], applied: AppliedAblation) -> None:
    """Keep ``applied`` (an Apply's result) as the effects ``params`` name, so that the views of this
    process draw it without computing it again."""
    memoised(_effects_key(run, applied.spec, params), lambda: applied)


@register(names.ABLATION_EFFECTS, "Effects of an ablation", ("heads", "ablate", "ref", "source"),
          lambda state, query, _: ablation_params(state))
def effects_view(run: AttentionRun, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    applied = effects_of(run, params)
    spec, fx = applied.spec, applied.effects
    model = _model(params)
    tokens = run.tokens
    title = (f"{spec.method} ablation of {len(spec.heads)} heads: mean loss {fx.mean_loss_clean:.3f} → "
             f"{fx.mean_loss_ablated:.3f}; p({model.token_strings([fx.target_token])[0]}) next "
             f"{fx.target_prob_clean:.3f} → {fx.target_prob_ablated:.3f}")
    fig = figures.loss_change(tokens, fx.loss_clean, fx.loss_ablated, title)
    strings = model.token_strings
    rows: Rows = []
    for i in range(len(tokens)):
        rows.append({
            "pos": i, "token": tokens[i], "loss_clean": float(fx.loss_clean[i]), "loss_ablated": float(fx.loss_ablated[i]),
            "loss_diff": float(fx.loss_diff[i]),
            "top1_clean": strings([int(fx.top_ids_clean[i, 0])])[0], "p_top1_clean": float(fx.top_probs_clean[i, 0]),
            "top1_ablated": strings([int(fx.top_ids_ablated[i, 0])])[0],
            "p_top1_ablated": float(fx.top_probs_ablated[i, 0]),
        })
    rows.append({"pos": "summary", "heads": format_heads(spec.heads), "method": spec.method,
                 "method_does": METHOD_DESCRIPTIONS[spec.method],
                 "mean_loss_clean": fx.mean_loss_clean, "mean_loss_ablated": fx.mean_loss_ablated,
                 "target_token": strings([fx.target_token])[0], "target_logit_clean": fx.target_logit_clean,
                 "target_logit_ablated": fx.target_logit_ablated, "target_prob_clean": fx.target_prob_clean,
                 "target_prob_ablated": fx.target_prob_ablated,
                 "continuation_clean": model.tokenizer.decode(fx.continuation_clean),
                 "continuation_ablated": model.tokenizer.decode(fx.continuation_ablated)})
    return fig, rows


@register(names.ABLATION_CURVE, "Top-k vs random ablation curve", ("curve",),
          lambda state, query, _: ablation_params(state), needs_run=False)
def curve_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """The metric against k for the top-k heads and k random heads.

    An accuracy curve (NIAH, on a sweep's ``n_prompts`` prompts) carries n and 95 % Wilson intervals:
    the top-k line's and each seed's per k, and the random control's pooled over all seeds' prompts
    with its seed band (rows ``set = "random, all seeds"``). A loss curve's random control is its mean
    ± std over seeds, as the figure says."""
    found = _stored(params.get("curve"), "top-k curve", load_curve)
    if found is None:
        raise InputError("No curve yet: run the top-k vs random curve first.")
    curve, meta = found
    outside = "" if curve.outside_top is None else f", random from outside the top {curve.outside_top}"
    n = "" if curve.n_prompts is None else f" on {curve.n_prompts} prompts"
    top_ci, pooled, band = curve.top_accuracy(), curve.random_pooled(), curve.random_band()
    fig = figures.topk_curve(curve.k_values, curve.top, curve.random, meta.get("metric_label", "metric"),
                             f"{meta.get('by_label', 'score')}: top-k vs random heads ({curve.method} ablation)"
                             + outside + n + ("" if curve.complete else " — cancelled, partial"), curve.outside_top,
                             top_ci=top_ci, random_ci=pooled if len(curve.seeds) else (),
                             random_band=band if pooled and len(curve.seeds) else ())
    rows: Rows = [{"k": k, "set": "top", "seed": "", "value": float(curve.top[j]),
                   **(top_ci[j].columns("value") if top_ci else {}),
                   "heads": format_heads(curve.order[:k])} for j, k in enumerate(curve.k_values)]
    for s_i, seed in enumerate(curve.seeds):
        rows += [{"k": k, "set": "random", "seed": seed, "value": float(curve.random[s_i, j]),
                  **(_accuracy_columns(curve.random[s_i, j], curve.n_prompts) if top_ci else {}), "heads": "",
                  **({} if curve.outside_top is None else {"outside_top": curve.outside_top})}
                 for j, k in enumerate(curve.k_values)]
    if pooled and len(curve.seeds):
        rows += [{"k": k, "set": "random, all seeds", "seed": "", **pooled[j].columns("value"),
                  "seed_mean": band[j].mean, "seed_low": band[j].low, "seed_high": band[j].high,
                  "n_seeds": band[j].n_seeds, "heads": "",
                  **({} if curve.outside_top is None else {"outside_top": curve.outside_top})}
                 for j, k in enumerate(curve.k_values)]
    return fig, rows


def _accuracy_columns(value: float, n: int | None) -> dict[str, Any]:
    """One seed's accuracy at one k with its n and Wilson interval (nan when not reached)."""
    return from_accuracy(float(value), n or 0).columns("value") | {"value": float(value)}


@register(names.ABLATION_HEAD_SWEEP, "Single-head ablation map", ("hsweep",),
          lambda state, query, _: ablation_params(state), needs_run=False)
def head_sweep_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    found = _stored(params.get("hsweep"), "single-head sweep", load_head_sweep)
    if found is None:
        raise InputError("No single-head sweep yet: run it first.")
    sweep, meta = found
    label = f"Δ {sweep.metric} ({sweep.method} ablation)"
    fig = figures.head_grid(sweep.effect, label, None)
    fig.update_layout(title_text=figures.safe_text(
        f"Ablating each head alone: change in {sweep.metric} (clean {sweep.clean:.3f})"
        + ("" if sweep.complete else " — cancelled, partial")))
    rows = [{"layer": la, "head": h, "effect": float(sweep.effect[la, h]), "clean": sweep.clean,
             "metric": sweep.metric, "method": sweep.method}
            for la in range(sweep.effect.shape[0]) for h in range(sweep.effect.shape[1])]
    return fig, rows
