"""Views of one head's query-key space (AttentionViz joint embedding; Lee et al. 2026 contrastive
covariance decomposition) for the QK page. Drawn from the model and the probe set named in the
params, not from a run; registered into :data:`app.views.VIEWS` so they export like every figure."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from analysis.capture import InputError
from analysis.joint_embedding import joint_embedding, query_attention
from analysis.qk_collect import HeadQK, collect_head, load_probe_tasks, load_sentences
from analysis.qk_decomposition import decompose_head
from app import figures
from app.views import VIEWS, Rows, View, memoised

METHODS = {"pca": "PCA", "umap": "UMAP", "tsne": "t-SNE"}
COLOUR_BY = ("position", "kind", "sentence", "norm")
MAX_SENTENCES = 341


DEFAULT_SENTENCES = 60


def qk_params(state: Any) -> dict[str, Any]:
    """A QK view's parameters from the page state (the page and its exports use the same)."""
    return {"model": state.model, "layer": state.layer or 0, "head": state.head or 0,
            "sentences": state.sentences or DEFAULT_SENTENCES, "method": state.method, "colour": state.colour,
            "feature": state.feature, "query": state.query}


def head_of(params: dict[str, Any]) -> HeadQK:
    from analysis.models import load_model
    from app.context import get_context

    context = get_context()
    model = load_model(params.get("model") or context.default_model)
    n = int(params.get("sentences", 60))
    if not 1 <= n <= MAX_SENTENCES:
        raise InputError(f"Choose between 1 and {MAX_SENTENCES} probe sentences, got {n}.")
    layer, head = int(params.get("layer", 0)), int(params.get("head", 0))
    return memoised((model.digest, "qk", n, layer, head),
                    lambda: collect_head(model, load_sentences(limit=n), layer, head, store=context.store))


def qk_scatter_view(_run: Any, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    from app.context import get_context

    head = head_of(params)
    method = params.get("method", "pca")
    if method not in METHODS:
        raise InputError(f"Unknown projection {method!r}; choose pca, umap or tsne.")
    colour = params.get("colour", "position")
    if colour not in COLOUR_BY:
        raise InputError(f"Colour by one of {', '.join(COLOUR_BY)}, not {colour!r}.")
    emb = joint_embedding(head, method, store=get_context().store, progress=params.get("_progress"))
    table = head.point_table()
    n = len(table["token"]) // 2
    xy = emb.coords
    if colour == "kind":
        values = np.r_[np.zeros(n), np.ones(n)]
    else:
        values = np.asarray(table[colour], dtype=float)
    fig = go.Figure()
    for kind, sl, symbol in (("query", slice(0, n), "circle"), ("key", slice(n, 2 * n), "diamond")):
        fig.add_trace(go.Scattergl(
            x=xy[sl, 0], y=xy[sl, 1], mode="markers", name=f"{kind}s",
            marker={"symbol": symbol, "size": 6, "opacity": 0.75, "color": values[sl], "colorscale": "Viridis",
                    "showscale": kind == "query", "colorbar": {"title": {"text": colour}, "thickness": 12}},
            customdata=np.stack([np.arange(n), np.asarray(table["position"][sl]),
                                 np.asarray(table["sentence"][sl])], -1).tolist(),
            text=[figures.safe_text(f"{t} | {s[:80]}") for t, s in zip(table["token"][sl], table["text"][sl],
                                                                          strict=True)],
            hovertemplate=kind + " %{customdata[0]} (pos %{customdata[1]}, sentence %{customdata[2]})"
                                 "<br>%{text}<extra></extra>",
        ))
    query = params.get("query")
    rows_hits: Rows = []
    if query is not None:
        q = int(query)
        if not 0 <= q < n:
            raise InputError(f"Query {q} is out of range 0..{n - 1}.")
        hits = query_attention(head, q, top_k=5, embedding=emb)
        for hit in hits:
            fig.add_trace(go.Scattergl(
                x=[xy[q, 0], xy[n + hit.token_index, 0]], y=[xy[q, 1], xy[n + hit.token_index, 1]],
                mode="lines", line={"color": "#e4572e", "width": 1 + 6 * hit.weight}, showlegend=False,
                hoverinfo="skip"))
        rows_hits = [{"query": q, "key": h.token_index, "key_token": h.token, "weight": h.weight,
                      "distance": h.distance} for h in hits]
    title = (f"Layer {params.get('layer', 0)}, head {params.get('head', 0)}: joint query-key embedding "
             f"({METHODS[method]}, {n} tokens)")
    figures._layout(fig, title, height=620)
    fig.update_layout(legend={"orientation": "h", "x": 0, "y": 1.0, "yanchor": "bottom", "xanchor": "left"})
    rows = [{"kind": k, "token_index": i, "token": t, "position": p, "sentence": s, "x": float(x), "y": float(y)}
            for k, i, t, p, s, (x, y) in zip(table["kind"], table["token_index"], table["token"], table["position"],
                                              table["sentence"], xy, strict=True)]
    return fig, rows_hits + rows if rows_hits else rows


def qk_spectrum_view(_run: Any, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    head = head_of(params)
    feature = params.get("feature", "previous_token")
    tasks = load_probe_tasks()
    target = tasks.get(feature, feature)
    dec = memoised((id(head), "decomp", feature), lambda: decompose_head(head, target))
    sv = np.asarray(dec.singular_values, dtype=float)
    fig = go.Figure(go.Bar(x=list(range(1, sv.size + 1)), y=sv,
                           marker_color=["#2a6fdb" if i < dec.rank else "#b8c4d6" for i in range(sv.size)],
                           hovertemplate="σ%{x} = %{y:.4g}<extra></extra>"))
    if np.isfinite(dec.null_threshold):
        fig.add_hline(y=dec.null_threshold, line_dash="dash", line_color="#e4572e",
                      annotation_text="shuffled-label noise level")
    fig.update_xaxes(title="singular value index", range=[0.5, min(sv.size, 24) + 0.5])
    fig.update_yaxes(title="singular value of ΔC")
    figures._layout(fig, f"Contrastive covariance ΔC for '{feature}': rank {dec.rank} "
                         f"({dec.n_positive} positive / {dec.n_negative} negative pairs)", height=360)
    return fig, [{"index": i + 1, "singular_value": float(v), "in_rank": i < dec.rank} for i, v in enumerate(sv)]


for view in (View("qk_scatter", "Joint query-key embedding", qk_scatter_view,
                  ("model", "layer", "head", "sentences", "method", "colour", "query"), False),
             View("qk_spectrum", "Contrastive covariance spectrum", qk_spectrum_view,
                  ("model", "layer", "head", "sentences", "feature"), False)):
    VIEWS[view.name] = view
