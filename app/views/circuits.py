"""Views of circuits over heads (:mod:`headscope.analysis.circuits`), drawn from stored results named by key:
direct logit attribution per head as a layer × head grid (``circuit_dla``) and of the MLPs, embedding and
biases beside it (``circuit_dla_others``), the composition of earlier heads into one chosen head
(``circuit_composition``: who feeds its Q, K and V), the top edges of an edge attribution on a clean/corrupted
pair as a graph (``circuit_edges``), and the QK attribution of one cell (``qk_cell``, ``headscope explain``).

The figure builders here are pure (arrays in, figure out). The Circuits page (``/circuits``) shows the first
four; ``headscope circuits`` and ``headscope explain`` export them and ``headscope figure`` rebuilds them.
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
    StoredEdges,
    load_circuits,
    load_composition,
    load_edges,
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
EDGES_SHOWN = 30  # edges in the graph: enough for the circuit's backbone, few enough to follow each line
SITE_COLOURS = {"q": "#0072b2", "k": "#009e73", "v": "#e69f00", "logits": "#cc79a7"}  # Okabe-Ito, colour-blind safe
SITE_LABELS = {"q": "into a query", "k": "into a key", "v": "into a value", "logits": "into the logits"}


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


def stored_edges(key: Any) -> StoredEdges:
    """The stored edge attribution under ``key`` (a result's ``edges_key``)."""
    return _stored(key, load_edges, "edge attribution")


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


def _node(name: str, n_layers: int, n_heads: int) -> tuple[float, float]:
    """Where a component sits in the edge graph: head ``L.H`` at (L, H), ``mlp.L`` just after layer L's heads
    on a row below them, the embedding before layer 0 and the logits after the last layer, both mid-height."""
    if name == "embed":
        return -1.0, (n_heads - 1) / 2
    if name == "logits":
        return float(n_layers), (n_heads - 1) / 2
    if name.startswith("mlp."):
        return int(name[4:]) + 0.35, -1.5
    layer, head = name.split(".")
    return float(layer), float(head)


def edge_graph(edges: Sequence[tuple[str, str, str, float]], n_layers: int, n_heads: int, title: str) -> go.Figure:
    """The graph of ``edges`` ``(sender, receiver, site, score)``, in rank order: every head a faint dot at
    (layer, head), the components an edge touches labelled, each edge a line from sender to receiver coloured
    by site (``SITE_COLOURS``) with width by ``|score|`` relative to the largest, and a marker at its middle
    whose hover (and click) names sender → receiver, site and score. One trace per edge, ``customdata`` on
    each point ``[sender, receiver, site, score, rank]``; the nodes are the last two traces."""
    fig = go.Figure()
    span = max((abs(e[3]) for e in edges), default=1.0) or 1.0
    shown_sites: set[str] = set()
    for rank, (sender, receiver, site, score) in enumerate(edges, start=1):
        (x0, y0), (x1, y1) = _node(sender, n_layers, n_heads), _node(receiver, n_layers, n_heads)
        where = "key-value head " if site in ("k", "v") else ""
        hover = (f"#{rank}: {sender} → {where}{receiver} ({site})<br>score {score:+.4f} "
                 f"(≈ change in the logit difference when this edge alone is corrupted)")
        fig.add_trace(go.Scatter(
            x=[x0, (x0 + x1) / 2, x1], y=[y0, (y0 + y1) / 2, y1], mode="lines+markers", name=SITE_LABELS[site],
            legendgroup=site, showlegend=site not in shown_sites, opacity=0.85,
            line={"color": SITE_COLOURS[site], "width": 1 + 7 * abs(score) / span},
            marker={"size": [0, 9, 0], "color": SITE_COLOURS[site]}, text=[hover] * 3, hoverinfo="text",
            customdata=[[sender, receiver, site, score, rank]] * 3))
        shown_sites.add(site)
    layers, heads = np.meshgrid(np.arange(n_layers), np.arange(n_heads), indexing="ij")
    fig.add_trace(go.Scatter(x=layers.ravel(), y=heads.ravel(), mode="markers", hoverinfo="skip", showlegend=False,
                             marker={"size": 4, "color": "#d0d0d0"}, name="heads"))
    touched = sorted({n for e in edges for n in e[:2]}, key=lambda n: _node(n, n_layers, n_heads))
    points = [_node(n, n_layers, n_heads) for n in touched]
    fig.add_trace(go.Scatter(x=[p[0] for p in points], y=[p[1] for p in points], mode="markers+text", text=touched,
                             textposition="top center", textfont={"size": 10}, hovertext=touched, hoverinfo="text",
                             showlegend=False, name="components",
                             marker={"size": 9, "color": "#333", "line": {"color": "white", "width": 1}}))
    fig.update_xaxes(title="layer", range=[-1.6, n_layers + 0.6], showgrid=False, zeroline=False,
                     tickvals=[-1, *range(n_layers), n_layers], ticktext=["embed", *map(str, range(n_layers)), "logits"])
    fig.update_yaxes(title="head", range=[-2.2, n_heads], showgrid=False, zeroline=False,
                     tickvals=[-1.5, *range(n_heads)], ticktext=["MLP", *map(str, range(n_heads))])
    fig.update_layout(template="plotly_white", height=max(460, 40 * n_heads + 160),
                      margin={"t": 90, "l": 60, "r": 20, "b": 50}, hovermode="closest",
                      legend={"orientation": "h", "y": -0.15, "x": 0})
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


@register(names.CIRCUIT_EDGES, "Edge attribution graph", ("circuits",),
          lambda state, query, _: circuits_params(state), needs_run=False)
def edges_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    result = stored_circuits(params.get("circuits"))
    if not result.edges_key:
        return figures.message_figure("Give a corrupted text and run again to see the edges between heads."), []
    edges = stored_edges(result.edges_key)
    a = result.attribution
    top = edges.rows(EDGES_SHOWN)
    title = (f"Top {len(top)} of {len(edges.scores)} edges by |edge attribution| on {_answers(result)} "
             f"(clean {edges.clean:.3f}, corrupted {edges.corrupted:.3f}; Syed et al. 2023)")
    rows = [{"sender": s, "receiver": r, "site": t, "score": v} for s, r, t, v in top]
    return edge_graph(top, a.n_layers, a.n_heads, title), rows


# The cell is a stored result of ``headscope explain``; the Attention page's why panel draws its cell from
# the run's capture (qk_cell_figure) and stores none, so a page state names no cell.
@register(names.QK_CELL, "QK attribution of one cell", ("cell",), lambda state, query, _: {"cell": None},
          needs_run=False)
def qk_cell_view(run: None, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    cell: ExplainedCell = _stored(params.get("cell"), load_explained, "QK attribution")
    a = cell.attribution
    q, k = (figures.shown_token(cell.tokens[p]) for p in (a.query, a.key))
    title = (f"Why head {a.layer}.{a.head} scores query {a.query} {q} on key {a.key} {k}: terms sum to "
             f"s = {a.score:.4f} (norms frozen at this run)")
    rows = [{"query_component": qn, "key_component": kn, "contribution": float(a.terms[i, j])}
            for i, qn in enumerate(a.query_names) for j, kn in enumerate(a.key_names)]
    return qk_cell_figure(a.query_names, a.key_names, a.terms, title), rows
