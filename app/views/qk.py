"""Views of one head's query-key space (AttentionViz joint embedding; Lee et al. 2026 contrastive
covariance decomposition) for the QK page. Drawn from the model and the probe set named in the
params, not from a run; registered into :data:`headscope.app.views.registry.VIEWS` so they export like every figure."""

from __future__ import annotations

from typing import Any

import numpy as np
import plotly.graph_objects as go

from headscope.analysis.errors import InputError
from headscope.analysis.joint_embedding import METHODS as PROJECTIONS
from headscope.analysis.joint_embedding import joint_embedding, query_attention
from headscope.analysis.limits import limit
from headscope.analysis.qk_collect import (
    HeadQK,
    collect_head,
    collect_layer,
    load_probe_tasks,
    load_sentences,
    stored_sentences,
)
from headscope.analysis.qk_decomposition import (
    ablate_query_subspace,
    attribute_sentence,
    decompose_head,
    effective_rank,
    stored_labels,
    wqk_spectra,
)
from headscope.app import figures
from headscope.app.views import names
from headscope.app.views.registry import Rows, memoised, register

METHODS = dict(zip(PROJECTIONS, ("PCA", "UMAP", "t-SNE"), strict=True))  # labels of analysis' projections
COLOUR_BY = ("position", "kind", "sentence", "norm")
MAX_SENTENCES = 341


DEFAULT_SENTENCES = 60
MAX_TSNE_POINTS = 6000  # Barnes-Hut t-SNE on one thread: ~2 minutes at this size on a 2-core machine


def qk_params(state: Any) -> dict[str, Any]:
    """A QK view's parameters from the page state (the page and its exports use the same)."""
    return {"model": state.model, "layer": state.layer or 0, "head": state.head or 0,
            "sentences": state.sentences or DEFAULT_SENTENCES, "method": state.method, "colour": state.colour,
            "feature": state.feature, "query": state.query, "find": state.find, "labels": state.labels,
            "texts": state.texts}


def probe_sentences(params: dict[str, Any]) -> list[str]:
    """The probe sentences of a view: the user's uploaded set (``texts``) or the built-in one, the
    first ``sentences`` of them."""
    n = int(params.get("sentences", DEFAULT_SENTENCES))
    if not 1 <= n <= MAX_SENTENCES:
        raise InputError(f"Choose between 1 and {MAX_SENTENCES} probe sentences, got {n}.")
    if not params.get("texts"):
        return load_sentences(limit=n)
    from headscope.app.context import get_context

    return stored_sentences(get_context().store, params["texts"])[:n]


def _model(params: dict[str, Any]):
    from headscope.analysis.models import load_model
    from headscope.app.context import get_context

    return load_model(params.get("model") or get_context().default_model)


def user_labels(key: str | None) -> dict[str, Any]:
    """Features of a label file a user uploaded (stored as text under ``key``), by name."""
    if not key:
        return {}
    from headscope.app.context import get_context

    return stored_labels(get_context().store, key)


def feature_of(params: dict[str, Any]) -> tuple[str, Any]:
    """The feature named in the params: a built-in probe task or a rule of an uploaded label file."""
    name = params.get("feature", "previous_token")
    labels = user_labels(params.get("labels"))
    if name in labels:
        return name, labels[name]
    tasks = load_probe_tasks()
    if name not in tasks:
        known = ", ".join([*tasks, *labels])
        raise InputError(f"Unknown feature {name!r}; choose one of {known}.")
    return name, tasks[name]


def head_of(params: dict[str, Any]) -> HeadQK:
    from headscope.analysis.models import load_model
    from headscope.app.context import get_context

    context = get_context()
    model = load_model(params.get("model") or context.default_model)
    sentences = probe_sentences(params)
    layer, head = int(params.get("layer", 0)), int(params.get("head", 0))
    return memoised((model.digest, "qk", params.get("texts"), len(sentences), layer, head),
                    lambda: collect_head(model, sentences, layer, head, store=context.store,
                                         max_points=limit("HEADSCOPE_MAX_QK_POINTS")))


@register(names.QK_SCATTER, "Joint query-key embedding", ("model", "layer", "head", "sentences", "texts", "method", "colour", "query", "find"),
          lambda state, query, _: qk_params(state), needs_run=False)
def qk_scatter_view(_run: Any, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    from headscope.app.context import get_context

    head = head_of(params)
    method = params.get("method", "pca")
    if method not in METHODS:
        raise InputError(f"Unknown projection {method!r}; choose pca, umap or tsne.")
    colour = params.get("colour", "position")
    if colour not in COLOUR_BY:
        raise InputError(f"Colour by one of {', '.join(COLOUR_BY)}, not {colour!r}.")
    if method == "tsne" and head.n_points > MAX_TSNE_POINTS:
        raise InputError(f"t-SNE is limited to {MAX_TSNE_POINTS:,} points here (this head has {head.n_points:,}: "
                         "about two minutes at the limit on a 2-core machine). Use fewer sentences, or UMAP.")
    emb = joint_embedding(head, method, store=get_context().store, progress=params.get("_progress"))
    table = head.point_table()
    n = len(table["token"]) // 2
    xy = emb.coords
    if colour == "kind":
        values = np.r_[np.zeros(n), np.ones(n)]
    else:
        values = np.asarray(table[colour], dtype=float)
    fig = go.Figure()
    for kind, plural, sl, symbol in (("query", "queries", slice(0, n), "circle"),
                                     ("key", "keys", slice(n, 2 * n), "diamond")):
        fig.add_trace(go.Scattergl(
            x=xy[sl, 0], y=xy[sl, 1], mode="markers", name=plural,
            marker={"symbol": symbol, "size": 6, "opacity": 0.75, "color": values[sl], "colorscale": "Viridis",
                    "showscale": kind == "query", "colorbar": {"title": {"text": colour}, "thickness": 12}},
            customdata=np.stack([np.arange(n), np.asarray(table["position"][sl]),
                                 np.asarray(table["sentence"][sl])], -1).tolist(),
            text=[figures.safe_text(f"{t} | {s[:80]}") for t, s in zip(table["token"][sl], table["text"][sl],
                                                                          strict=True)],
            hovertemplate=kind + " %{customdata[0]} (pos %{customdata[1]}, sentence %{customdata[2]})"
                                 "<br>%{text}<extra></extra>",
        ))
    find = (params.get("find") or "").strip()
    found = 0
    if find:
        want = find.casefold()
        match = np.array([t.replace("·", " ").strip().casefold() == want for t in table["token"]])
        found = int(match[:n].sum())
        fig.add_trace(go.Scattergl(
            x=xy[match, 0], y=xy[match, 1], mode="markers", name=f"'{figures.safe_text(find)}' ({found} tokens)",
            marker={"symbol": "circle-open", "size": 14, "color": "#e4572e", "line": {"width": 2}},
            hoverinfo="skip"))
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
             f"({METHODS[method]}, {n} tokens)" + (f" — '{find}' found {found} times" if find else ""))
    # which vectors these are (after QK-norm / RoPE where the model has them): model facts
    title = figures.safe_text(title) + f"<br><sup>{figures.safe_text(_model(params).facts.qk_label)}</sup>"
    figures._layout(fig, title, height=620)
    # below the plot: above it, the legend covered the title
    fig.update_layout(legend={"orientation": "h", "x": 0, "y": -0.08, "yanchor": "top", "xanchor": "left"})
    rows = [{"kind": k, "token_index": i, "token": t, "position": p, "sentence": s, "x": float(x), "y": float(y)}
            for k, i, t, p, s, (x, y) in zip(table["kind"], table["token_index"], table["token"], table["position"],
                                              table["sentence"], xy, strict=True)]
    return fig, rows_hits + rows if rows_hits else rows


@register(names.QK_SPECTRUM, "Contrastive covariance spectrum", ("model", "layer", "head", "sentences", "texts", "feature", "labels"),
          lambda state, query, _: qk_params(state), needs_run=False)
def qk_spectrum_view(_run: Any, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    head = head_of(params)
    feature, target = feature_of(params)
    dec = memoised((id(head), "decomp", feature, params.get("labels")), lambda: decompose_head(head, target))
    sv = np.asarray(dec.singular_values, dtype=float)
    fig = go.Figure(go.Bar(x=list(range(1, sv.size + 1)), y=sv,
                           marker_color=["#2a6fdb" if i < dec.rank else "#b8c4d6" for i in range(sv.size)],
                           hovertemplate="σ%{x} = %{y:.4g}<extra></extra>"))
    if np.isfinite(dec.null_threshold):
        fig.add_hline(y=dec.null_threshold, line_dash="dash", line_color="#e4572e",
                      annotation_text="shuffled-label noise level")
    fig.update_xaxes(title="singular value index", range=[0.5, min(sv.size, 24) + 0.5])
    fig.update_yaxes(title="singular value of ΔC")
    figures._layout(fig, figures.safe_text(f"Contrastive covariance ΔC for '{feature}': rank {dec.rank} "
                                           f"({dec.n_positive} positive / {dec.n_negative} negative pairs)"), height=360)
    return fig, [{"index": i + 1, "singular_value": float(v), "in_rank": i < dec.rank} for i, v in enumerate(sv)]


@register(names.QK_ATTRIBUTION, "Logit attribution and intervention", ("model", "layer", "head", "sentences", "texts", "feature", "labels", "query"),
          lambda state, query, _: qk_params(state), needs_run=False)
def qk_attribution_view(_run: Any, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """For the clicked query: each key's logit split into the feature's subspace term, cross terms and
    residual (Lee et al. 2026), and the query's attention before/after projecting the feature's
    query subspace out."""
    from plotly.subplots import make_subplots

    head = head_of(params)
    if params.get("query") is None:
        raise InputError("Click a query in the embedding to attribute its attention logits.")
    q = int(params["query"])
    if not 0 <= q < head.n_tokens:
        raise InputError(f"Query {q} is out of range 0..{head.n_tokens - 1}.")
    feature, target = feature_of(params)
    dec = memoised((id(head), "decomp", feature, params.get("labels")), lambda: decompose_head(head, target))
    s_i = int(head.sentence_index[q])
    start = int(head.offsets[s_i])
    row = q - start
    parts = attribute_sentence(head, s_i, [dec])
    iv = ablate_query_subspace(head, dec, s_i)
    keys = list(range(row + 1))
    labels = [figures.safe_text(f"{j} {head.tokens[start + j]}") for j in keys]
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("logit = feature term + cross + residual",
                                        f"attention before / after removing the '{feature}' query subspace"))
    colours = {feature: "#2a6fdb", "cross": "#aaa", "residual": "#f4a259"}
    # barmode "relative" stacks the logit's three terms (one offset group: one bar per key, split in
    # parts that sum to the logit); attention before and after are two offset groups, so they stand
    # side by side from 0, each as tall as its value, on an axis of attention weights. Each panel is
    # an alignment group of its own: the logit's bar is not narrowed to leave room for the other two.
    for name in (feature, "cross", "residual"):
        fig.add_trace(go.Bar(x=labels, y=parts[name][row, : row + 1], name=name, marker_color=colours[name],
                             offsetgroup="logit", alignmentgroup="logit"), 1, 1)
    fig.add_trace(go.Scatter(x=labels, y=parts["logits"][row, : row + 1], mode="markers", name="logit",
                             marker={"symbol": "line-ew-open", "size": 16, "color": "#111", "line": {"width": 2}}), 1, 1)
    fig.add_trace(go.Bar(x=labels, y=iv.before[row, : row + 1], name="attention before", marker_color="#555",
                         offsetgroup="before", alignmentgroup="attention"), 2, 1)
    fig.add_trace(go.Bar(x=labels, y=iv.after[row, : row + 1], name="attention after removing it",
                         marker_color="#e4572e", offsetgroup="after", alignmentgroup="attention"), 2, 1)
    fig.update_layout(barmode="relative")
    fig.update_yaxes(title="logit", row=1, col=1)
    fig.update_yaxes(title="attention", row=2, col=1)
    fig.update_xaxes(tickangle=-60)
    title = (f"Layer {head.layer}, head {head.head}, query {q} ({head.tokens[q]}): rank-{dec.rank} '{feature}' "
             f"subspace")
    figures._layout(fig, figures.safe_text(title), height=560)
    rows = [{"query": q, "key": start + j, "key_token": head.tokens[start + j], "logit": float(parts["logits"][row, j]),
             feature: float(parts[feature][row, j]), "cross": float(parts["cross"][row, j]),
             "residual": float(parts["residual"][row, j]), "attention": float(iv.before[row, j]),
             "attention_after": float(iv.after[row, j])} for j in keys]
    return fig, rows


@register(names.QK_LAYER, "Layer overview of joint embeddings", ("model", "layer", "sentences", "texts"),
          lambda state, query, _: qk_params(state), needs_run=False)
def qk_layer_view(_run: Any, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """A layer at a glance: one joint-embedding PCA panel per head (queries blue, keys orange)."""
    from plotly.subplots import make_subplots

    from headscope.app.context import get_context

    model = _model(params)
    layer = int(params.get("layer", 0))
    sentences = probe_sentences(params)
    n = len(sentences)
    qkset = memoised((model.digest, "qk_layer", params.get("texts"), n, layer), lambda: collect_layer(
        model, sentences, layer, store=get_context().store, max_points=limit("HEADSCOPE_MAX_QK_POINTS")))
    n_heads = model.n_heads
    cols = min(n_heads, 5)
    n_rows = -(-n_heads // cols)
    fig = make_subplots(rows=n_rows, cols=cols, subplot_titles=[f"head {h}" for h in range(n_heads)],
                        horizontal_spacing=0.03, vertical_spacing=0.08)
    rows: Rows = []
    for h in range(n_heads):
        head = qkset.head(h)
        emb = joint_embedding(head, "pca")
        m = head.n_tokens
        r, c = divmod(h, cols)
        for plural, sl, colour in (("queries", slice(0, m), "#2a6fdb"), ("keys", slice(m, 2 * m), "#f4a259")):
            fig.add_trace(go.Scattergl(x=emb.coords[sl, 0], y=emb.coords[sl, 1], mode="markers",
                                       marker={"size": 3, "color": colour, "opacity": 0.6}, name=plural,
                                       showlegend=h == 0, hoverinfo="skip"), r + 1, c + 1)
        rows.append({"layer": layer, "head": h, "explained_variance": sum(emb.explained_variance),
                     "points": head.n_points})
    fig.update_xaxes(showticklabels=False)
    fig.update_yaxes(showticklabels=False)
    figures._layout(fig, f"Layer {layer}: every head's joint query-key PCA ({n} sentences)",
                    height=260 * n_rows + 80)
    return fig, rows


@register(names.QK_RANK_MAP, "W_QK effective rank per head", ("model",),
          lambda state, query, _: qk_params(state), needs_run=False)
def qk_rank_map_view(_run: Any, params: dict[str, Any]) -> tuple[go.Figure, Rows]:
    """Entropy effective rank of every head's W_QK = W_Q W_Kᵀ (pre-rotary interaction; RMSNorm gain folded)."""
    from headscope.app.context import get_context

    model = _model(params)
    spectra = memoised((model.digest, "wqk"), lambda: wqk_spectra(model, store=get_context().store))
    ranks = effective_rank(spectra)
    fig = figures.head_grid(ranks, "effective rank of W_QK")
    fig.update_layout(title_text=f"Effective rank of W_QK per head (of at most {spectra.shape[-1]}; pre-rotary)")
    rows = [{"layer": la, "head": h, "effective_rank": float(ranks[la, h]),
             "top_singular_value": float(spectra[la, h, 0])}
            for la in range(ranks.shape[0]) for h in range(ranks.shape[1])]
    return fig, rows
