"""Views of activation and attribution patching (:mod:`headscope.analysis.patching`), drawn from a stored
:class:`~headscope.analysis.patching.PatchingResult` named by its key (``params["patching"]``, a prefix of it):
the map of exact (or attribution) values, and exact against attribution per unit.

The Patching page (``/patching``) shows them; ``headscope patch`` exports them and ``headscope figure``
rebuilds them from their manifests. The page's export buttons add a variant: ``patching_map:attribution``
(the attribution map) and ``patching_map:positions`` (the clicked head's per-position map, ``ppos``).
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from headscope.analysis.errors import InputError
from headscope.analysis.patching import PatchingResult, load_patching
from headscope.analysis.patching_choices import DIRECTION_DESCRIPTIONS, METRIC_LABELS
from headscope.app import figures
from headscope.app.views import names
from headscope.app.views.registry import Rows, register


def _context():
    from headscope.app.context import get_context

    return get_context()


def patching_params(state: Any, which: str = "") -> dict[str, Any]:
    """The view's params from a page state: ``which`` ``positions`` names the clicked head's result
    (``ppos``), ``attribution`` shows the attribution estimate instead of exact patching."""
    key = getattr(state, "ppos" if which == "positions" else "patching", None)
    show = "attribution" if which == "attribution" else getattr(state, "show", None)
    return {"model": getattr(state, "model", None) or _context().default_model, "patching": key, "show": show}


def stored_patching(key: Any) -> PatchingResult:
    """The stored result whose key starts with ``key``; an ``InputError`` when none (or several) do."""
    if not key:
        raise InputError("No patching result yet: run the patching first.")
    store = _context().store
    keys = store.find(str(key))
    found = load_patching(store, keys[0]) if len(keys) == 1 else None
    if found is None:
        raise InputError(f"No stored patching result has the id {key!r}: compute it again.")
    return found


def position_labels(result: PatchingResult) -> list[str]:
    """The clean prompt's tokens, with ``clean / corrupted`` where the prompts differ."""
    pair = result.pair
    return [f"{c} / {k}" if i in pair.differ else c
            for i, (c, k) in enumerate(zip(pair.clean_tokens, pair.corrupted_tokens, strict=True))]


def unit_names(result: PatchingResult) -> list[str]:
    """One name per cell, in ``values.ravel()`` order: ``12.3``, ``kv 12.1``, ``L12 @ 5 ·Mary``."""
    shape = (result.values if result.values is not None else result.attribution).shape
    tokens = position_labels(result)
    if result.site == "resid":
        n_layers = shape[0] - 1
        return [f"{'out' if la == n_layers else f'L{la}'} @ {p} {tokens[p]}"
                for la in range(shape[0]) for p in range(shape[1])]
    if result.head is not None:
        return [f"{result.head[0]}.{result.head[1]} @ {p} {tokens[p]}" for p in range(shape[0])]
    kv = "kv " if result.site in ("k", "v") else ""
    return [f"{kv}{la}.{h}" for la in range(shape[0]) for h in range(shape[1])]


def _describe(result: PatchingResult) -> str:
    answers = " vs ".join(repr(t) for t in result.pair.answer_tokens)
    return (f"{result.direction} {result.site} ({METRIC_LABELS[result.metric]} {answers}; clean {result.clean:.3f}, "
            f"corrupted {result.corrupted:.3f})")


@register(names.PATCHING_MAP, "Activation patching map", ("patching", "show"),
          lambda state, query, which: patching_params(state, which), needs_run=False)
def patching_map_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    result = stored_patching(params.get("patching"))
    show = params.get("show") or ("exact" if result.values is not None else "attribution")
    if show not in ("exact", "attribution"):
        raise InputError(f"Unknown values {show!r}: show exact or attribution.")
    values = result.values if show == "exact" else result.attribution
    if values is None:
        raise InputError(f"This patching result has no {show} values: compute them first.")
    label = f"{show} (0 corrupted, 1 clean)"
    of_head = "" if result.head is None else f"head {result.head[0]}.{result.head[1]}, "
    title = f"{'Exact' if show == 'exact' else 'Attribution'} patching, {of_head}{_describe(result)}" + (
        "" if result.complete else " — cancelled, partial")
    tokens = position_labels(result)
    if result.site == "resid":
        n_layers = values.shape[0] - 1
        y = [str(la) for la in range(n_layers)] + [f"after {n_layers - 1}"]
        fig = figures.patching_map(values, figures.token_labels(tokens), y, "position", "layer (entering)", label,
                                   title, result.baseline)
        fig.update_layout(meta={"cells": "positions"})  # a click here has no head to patch (assets/grid_clicks.js)
    elif result.head is not None:
        fig = figures.patching_positions(values, tokens, label, title, result.baseline, result.pair.differ)
    else:
        x_title = "key-value head" if result.site in ("k", "v") else "head"
        fig = figures.patching_map(values, [str(h) for h in range(values.shape[1])],
                                   [str(la) for la in range(values.shape[0])], x_title, "layer", label, title,
                                   result.baseline)
    exact = result.values.ravel() if result.values is not None else None
    approx = result.attribution.ravel() if result.attribution is not None else None
    rows: Rows = [{"unit": name, "site": result.site, "direction": result.direction, "metric": result.metric,
                   "exact": None if exact is None else float(exact[i]),
                   "attribution": None if approx is None else float(approx[i])}
                  for i, name in enumerate(unit_names(result))]
    return fig, rows


@register(names.PATCHING_AGREEMENT, "Exact vs attribution patching", ("patching",),
          lambda state, query, _: patching_params(state), needs_run=False)
def patching_agreement_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    result = stored_patching(params.get("patching"))
    if result.values is None or result.attribution is None or result.agreement is None:
        raise InputError("This patching result lacks exact or attribution values: compute both to compare them.")
    a = result.agreement
    note = (f"Pearson {a.pearson:.3f}, Spearman {a.spearman:.3f}, top-{a.k} overlap {a.overlap:.0%} "
            f"({a.n_units} units)")
    fig = figures.exact_vs_attribution(result.values, result.attribution, unit_names(result),
                                       f"Attribution vs exact patching, {_describe(result)}", note)
    rows: Rows = [{"unit": name, "exact": float(e), "attribution": float(x)}
                  for name, e, x in zip(unit_names(result), result.values.ravel(), result.attribution.ravel(),
                                        strict=True)]
    rows.append({"unit": "agreement", "pearson": a.pearson, "spearman": a.spearman, "k": a.k,
                 "top_k_overlap": a.overlap, "n_units": a.n_units, "direction": DIRECTION_DESCRIPTIONS[result.direction]})
    return fig, rows
