"""Views of circuits over heads (:mod:`headscope.analysis.circuits`), drawn from stored results named by key:
direct logit attribution per head as a layer × head grid (``circuit_dla``) and of the MLPs, embedding and
biases beside it (``circuit_dla_others``), the composition of earlier heads into one chosen head
(``circuit_composition``: who feeds its Q, K and V), and the QK attribution of one cell (``qk_cell``,
``headscope explain``).

The figure builders here are pure (arrays in, figure out). The Circuits page (``/circuits``) shows the first
three; ``headscope circuits`` and ``headscope explain`` export them and ``headscope figure`` rebuilds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from headscope.analysis.circuits import (
    CircuitResult,
    ExplainedCell,
    load_circuits,
    load_composition,
    load_explained,
)
from headscope.analysis.composition import KINDS
from headscope.analysis.errors import InputError, check_head_index
from headscope.app import figures
from headscope.app.url_state import StoredId, page_part, url_field
from headscope.app.views import names
from headscope.app.views.registry import Rows, register

TOP = 10  # senders per kind in the composition view; components per side in the QK cell view
KIND_LABELS = {"q": "Q-composition (feeds its queries)", "k": "K-composition (feeds its keys)",
               "v": "V-composition (feeds its values)"}
SCALE = figures.PATCHING_SCALE


@page_part("circuits")
@dataclass
class CircuitsState:
    """The Circuits page's own URL field: the stored result (:func:`headscope.analysis.circuits.circuits`),
    ``circ``. The chosen head is the shared ``layer``/``head``. Declared here, imported once per process,
    rather than in the page module, which Dash executes again for every app it creates."""

    circ: str | None = url_field(StoredId())


def _context():
    from headscope.app.context import get_context

    return get_context()


def circuits_params(state: Any) -> dict[str, Any]:
    """The views' params from a page state: the stored result (``circ``) and the chosen head."""
    return {"model": getattr(state, "model", None) or _context().default_model, "circuits": getattr(state, "circ", None),
            "layer": getattr(state, "layer", None), "head": getattr(state, "head", None)}


def _stored(key: Any, load, what: str):
    if not key:
        raise InputError(f"No {what} yet: run it first.")
    store = _context().store
    keys = store.find(str(key))
    found = load(store, keys[0]) if len(keys) == 1 else None
    if found is None:
        raise InputError(f"No stored {what} has the id {str(key)[:40]!r}: compute it again.")
    return found


def stored_circuits(key: Any) -> CircuitResult:
    """The stored result whose key starts with ``key``; an ``InputError`` when none (or several) do."""
    return _stored(key, load_circuits, "circuit result")


def chosen_head(result: CircuitResult, layer: Any, head: Any) -> tuple[int, int]:
    """``(layer, head)`` when both are given (checked against the model), else the head with the largest
    direct effect on the logit difference."""
    a = result.attribution
    if layer is None or head is None:
        heads = a.heads()
        return tuple(int(i) for i in np.unravel_index(int(np.argmax(np.abs(heads))), heads.shape))
    return check_head_index(a.n_layers, a.n_heads, layer, head)


def _answers(result: CircuitResult) -> str:
    first, second = (figures.shown_token(t) for t in result.answer_tokens)
    return f"logit[{first}] − logit[{second}]"


# --- pure figure builders ---------------------------------------------------------------------------------

def dla_grid(heads: np.ndarray, title: str, selected: tuple[int, int] | None = None) -> go.Figure:
    """Layer × head grid of direct logit attributions ``heads [L, H]`` on a diverging scale centred at 0
    (red: towards the first answer), the selected head outlined."""
    fig = figures.head_grid(heads, "DLA (logits)", selected=selected, signed=True)
    return figures.wrap_title(fig, title, width=60)


def dla_others(labels: Sequence[str], values: Sequence[float], title: str) -> go.Figure:
    """Horizontal bars of the other components' direct logit attributions (MLPs by layer, embedding, biases)."""
    values = [float(v) for v in values]
    colours = ["#b2182b" if v >= 0 else "#2166ac" for v in values]
    fig = go.Figure(go.Bar(x=values, y=list(labels), orientation="h", marker_color=colours,
                           hovertemplate="%{y}: %{x:.4f} logits<extra></extra>"))
    fig.update_yaxes(autorange="reversed", dtick=1, title="component")
    fig.update_xaxes(title="DLA (logits)", zeroline=True, zerolinecolor="#444")
    fig.update_layout(template="plotly_white", margin={"t": 50, "l": 70, "r": 20, "b": 50},
                      height=max(360, 16 * len(values) + 120))
    return figures.wrap_title(fig, title, width=60)


def composition_bars(scores: dict[str, np.ndarray], receiver: tuple[int, int], top: int = TOP) -> go.Figure:
    """Per kind (Q, K, V) the ``top`` earlier heads with the largest composition into ``receiver``:
    ``scores[kind]`` is ``[sender layer, sender head]`` into that head."""
    fig = make_subplots(rows=1, cols=len(KINDS), subplot_titles=[KIND_LABELS[k] for k in KINDS],
                        horizontal_spacing=0.08)
    for i, kind in enumerate(KINDS, start=1):
        s = np.asarray(scores[kind], dtype=float)
        order = np.argsort(-s, axis=None)[: min(top, s.size)]
        cells = [np.unravel_index(int(j), s.shape) for j in order]
        labels = [f"{a}.{h}" for a, h in cells]
        fig.add_trace(go.Bar(x=[float(s[c]) for c in cells], y=labels, orientation="h", name=kind.upper(),
                             marker_color="#3b7dd8", showlegend=False,
                             hovertemplate=f"{kind.upper()}-composition %{{y}} → {receiver[0]}.{receiver[1]}: "
                                           "%{x:.4f}<extra></extra>"), row=1, col=i)
        fig.update_yaxes(autorange="reversed", type="category", row=1, col=i)
        fig.update_xaxes(title="score", rangemode="tozero", row=1, col=i)
    fig.update_layout(template="plotly_white", margin={"t": 90, "l": 60, "r": 20, "b": 50}, height=420)
    return figures.wrap_title(fig, f"Which earlier heads feed head {receiver[0]}.{receiver[1]} (composition scores "
                                   "from the weights; RoPE and QK-norm left out)", width=110)


def qk_cell_figure(query_names: Sequence[str], key_names: Sequence[str], terms: np.ndarray, title: str,
                   top: int = TOP) -> go.Figure:
    """The ``top`` query-side and key-side components of a QK attribution (row and column sums) as bars, and
    their ``top × top`` block of ``terms [C_q, C_k]`` as a heatmap centred at 0."""
    terms = np.asarray(terms, dtype=float)
    rows, cols = terms.sum(1), terms.sum(0)
    qi = np.argsort(-np.abs(rows))[:top]
    ki = np.argsort(-np.abs(cols))[:top]
    fig = make_subplots(rows=1, cols=3, column_widths=[0.25, 0.25, 0.5], horizontal_spacing=0.1,
                        subplot_titles=["what builds the query (row sums)", "what builds the key (column sums)",
                                        "query × key terms"])
    for col, (sums, index, nm) in enumerate(((rows, qi, query_names), (cols, ki, key_names)), start=1):
        fig.add_trace(go.Bar(x=[float(sums[i]) for i in index], y=[nm[i] for i in index], orientation="h",
                             marker_color=["#b2182b" if sums[i] >= 0 else "#2166ac" for i in index], showlegend=False,
                             hovertemplate="%{y}: %{x:.4f}<extra></extra>"), row=1, col=col)
        fig.update_yaxes(autorange="reversed", type="category", row=1, col=col)
    block = terms[np.ix_(qi, ki)]
    span = float(np.abs(block).max()) or 1.0
    fig.add_trace(go.Heatmap(z=block.tolist(), x=[key_names[i] for i in ki], y=[query_names[i] for i in qi],
                             colorscale=SCALE, reversescale=True, zmin=-span, zmax=span,
                             hovertemplate="query %{y} × key %{x}: %{z:.4f}<extra></extra>"), row=1, col=3)
    fig.update_yaxes(autorange="reversed", type="category", row=1, col=3)
    fig.update_xaxes(type="category", row=1, col=3)
    fig.update_layout(template="plotly_white", margin={"t": 90, "l": 80, "r": 20, "b": 80}, height=460)
    return figures.wrap_title(fig, title, width=110)


# --- views ---------------------------------------------------------------------------------------------

@register(names.CIRCUIT_DLA, "Direct logit attribution per head", ("circuits", "layer", "head"),
          lambda state, query, _: circuits_params(state), needs_run=False)
def dla_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    result = stored_circuits(params.get("circuits"))
    a = result.attribution
    selected = chosen_head(result, params.get("layer"), params.get("head"))
    title = (f"Direct logit attribution of {_answers(result)} = {a.logit_diff:.3f} at the last token "
             f"(terms sum to it; norms frozen at this run)")
    rows = [{"component": n, "value": float(v)} for n, v in zip(a.names, a.values, strict=True)]
    return dla_grid(a.heads(), title, selected), rows


@register(names.CIRCUIT_DLA_OTHERS, "Direct logit attribution of MLPs, embedding and biases", ("circuits",),
          lambda state, query, _: circuits_params(state), needs_run=False)
def dla_others_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    result = stored_circuits(params.get("circuits"))
    a = result.attribution
    labels = [n for n in a.names if not n[:1].isdigit()]
    values = [a.value(n) for n in labels]
    rows = [{"component": n, "value": float(v)} for n, v in zip(labels, values, strict=True)]
    return dla_others(labels, values, f"MLPs, embedding and biases: {_answers(result)}"), rows


@register(names.CIRCUIT_COMPOSITION, "Composition into one head", ("circuits", "layer", "head"),
          lambda state, query, _: circuits_params(state), needs_run=False)
def composition_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    result = stored_circuits(params.get("circuits"))
    layer, head = chosen_head(result, params.get("layer"), params.get("head"))
    scores = _stored(result.composition_key, load_composition, "composition scores")
    into = {kind: scores.of(kind)[:layer, :, layer, head] for kind in KINDS}
    rows = [{"sender": f"{a}.{h}", "receiver": f"{layer}.{head}", "kind": kind, "score": float(into[kind][a, h])}
            for kind in KINDS for a in range(layer) for h in range(into[kind].shape[1])]
    if layer == 0:
        return figures.message_figure(f"Head 0.{head} is in the first layer: no earlier head feeds it."), rows
    return composition_bars(into, (layer, head)), rows


@register(names.QK_CELL, "QK attribution of one cell", ("cell",), lambda state, query, _: {}, needs_run=False)
def qk_cell_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    cell: ExplainedCell = _stored(params.get("cell"), load_explained, "QK attribution")
    a = cell.attribution
    q, k = (figures.shown_token(cell.tokens[p]) for p in (a.query, a.key))
    title = (f"Why head {a.layer}.{a.head} scores query {a.query} {q} on key {a.key} {k}: terms sum to "
             f"s = {a.score:.4f} (norms frozen at this run)")
    rows = [{"query_component": qn, "key_component": kn, "contribution": float(a.terms[i, j])}
            for i, qn in enumerate(a.query_names) for j, kn in enumerate(a.key_names)]
    return qk_cell_figure(a.query_names, a.key_names, a.terms, title), rows
