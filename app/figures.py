"""Pure figure builders: data in, ``go.Figure`` out.

Shared by the pages, the exports and notebook users (``from headscope.app.figures import attention_heatmap``).
Nothing here computes a score or touches the store. Token strings are escaped, because plotly
interprets a few HTML-like tags in text: a token ``<b>`` or ``<a href=…>`` must show as written.
"""

from __future__ import annotations

import html
import textwrap
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import plotly.graph_objects as go

if TYPE_CHECKING:
    from headscope.analysis.intervals import Proportion, SeedBand

FONT = "Inter, system-ui, -apple-system, Segoe UI, sans-serif"
COLORSCALE = "Viridis"
ATTENTION_SCALE = "Blues"


def safe_text(token: str) -> str:
    """A token as plotly must receive it to display it literally."""
    return html.escape(token, quote=False)


_WHITESPACE_NAMES = {"·": "space", "↵": "newline", "⇥": "tab", "␍": "return"}


def shown_token(token: str) -> str:
    """A token as a reader can tell it apart: a token of only whitespace (shown as ``·`` ``↵`` ``⇥``
    by :func:`headscope.analysis.models.display_token`) also says what it is, e.g. ``·· 2 spaces``, since a
    bare ``·`` is easy to miss in a grid of words."""
    if not token or any(c not in _WHITESPACE_NAMES for c in token):
        return token
    kinds = [_WHITESPACE_NAMES[c] for c in token]
    if len(set(kinds)) == 1:
        name = kinds[0] if len(kinds) == 1 else f"{len(kinds)} {kinds[0]}s"
    else:
        name = "whitespace"
    return f"{token} ({name})"


def token_labels(tokens: Sequence[str]) -> list[str]:
    """Unique axis labels ``"pos token"`` (tokens repeat; positions keep categories apart)."""
    return [f"{i} {safe_text(shown_token(t))}" for i, t in enumerate(tokens)]


def _layout(fig: go.Figure, title: str, height: int | None = None) -> go.Figure:
    fig.update_layout(
        title={"text": title, "x": 0.01, "xanchor": "left", "font": {"size": 15}},
        font={"family": FONT, "size": 12},
        margin={"l": 60, "r": 20, "t": 50, "b": 50},
        template="plotly_white",
        height=height,
    )
    return fig


def wrap_title(fig: go.Figure, title: str | Sequence[str], width: int = 70, height: int | None = None) -> go.Figure:
    """``title`` (plain text, escaped here) wrapped at ``width`` characters on as many lines as it needs,
    each of several paragraphs starting a line of its own; anchored 20 px below the figure's top, with
    the plot moved down to make room. A long title on one line runs past the figure's right edge and is
    cut off (Patching maps at 1400 px; the Ablation grid and the Heads mass curve at 1280 px), and one
    anchored 12 px down rises 2 px above the figure. ``height``: the figure's, when its layout has none."""
    height = height or fig.layout.height or 450
    paragraphs = [title] if isinstance(title, str) else list(title)
    lines = [line for text in paragraphs for line in (textwrap.wrap(text, width) or [""])]
    top = fig.layout.margin.t if fig.layout.margin.t is not None else 50  # _layout's, or more for a note
    fig.update_layout(title={"text": "<br>".join(safe_text(line) for line in lines), "y": 1 - 20 / height,
                             "yref": "container", "yanchor": "top"}, margin={"t": top - 10 + 19 * len(lines)})
    return fig


def _mark_windowed_layers(fig: go.Figure, windows: Sequence[int | None] | None, note: str) -> None:
    """Mark the layers a model windows ``w`` on the layer axis and, with ``note``, say under the plot
    what ``w`` means for the numbers shown ("w: windowed by the model (W=512): <note>")."""
    if not windows or not any(windows):
        return
    fig.update_yaxes(tickmode="array", tickvals=list(range(len(windows))),
                     ticktext=[f"{layer} w" if w else str(layer) for layer, w in enumerate(windows)])
    if note:  # under the title, where rotated token labels cannot cover it; wrapped to the plot's width
        lines = textwrap.wrap(note, 85)
        fig.add_annotation(text="<br>".join(safe_text(line) for line in lines), xref="paper", yref="paper",
                           x=0, y=1, xanchor="left", yanchor="bottom", yshift=6, showarrow=False, align="left",
                           font={"size": 11, "color": "#555"})
        top = fig.layout.margin.t if fig.layout.margin.t is not None else 50  # a two-line title keeps its room
        fig.update_layout(margin={"t": top + 6 + 15 * len(lines)})


def head_grid(
    scores: np.ndarray,
    metric_label: str,
    selected: tuple[int, int] | None = None,
    colorscale: str = COLORSCALE,
    windows: Sequence[int | None] | None = None,
    window_note: str = "",
    signed: bool = False,
) -> go.Figure:
    """Layer × head heatmap of a per-head score; the selected head is outlined.

    Parameters
    ----------
    scores : ``[layer, head]`` array (nan shows as blank).
    windows : per layer the sliding attention window in keys (None: full attention), e.g. a run's
        ``layer_windows``; windowed layers are marked ``w`` on the layer axis and every cell's hover
        says which attention its layer has.
    window_note : what ``w`` means for this score, shown under the grid when a layer is windowed
        (e.g. ``"w: windowed by the model (W=512): scored only on rows ..."``).
    signed : the score's sign means something (a registry score declared ``signed``): a diverging scale
        centred at 0, red above and blue below, instead of ``colorscale``.
    """
    scores = np.asarray(scores, dtype=float)
    n_layers, n_heads = scores.shape
    z = np.where(np.isfinite(scores), scores, None)
    attn = [f"sliding window of {w:,} keys" if w else "full attention" for w in (windows or [None] * n_layers)]
    fig = go.Figure(
        go.Heatmap(
            z=z.tolist(),
            x=list(range(n_heads)),
            y=list(range(n_layers)),
            customdata=[[a] * n_heads for a in attn],
            **(_signed_colours() if signed else {"colorscale": colorscale}),
            colorbar={"title": {"text": metric_label, "side": "right"}, "thickness": 12},
            hovertemplate="layer %{y}, head %{x} (%{customdata})<br>" + metric_label + ": %{z:.4f}<extra></extra>",
            xgap=1,
            ygap=1,
        )
    )
    if selected is not None:
        fig.add_shape(head_outline(*selected))
    fig.update_xaxes(title="head", dtick=1, showgrid=False)
    fig.update_yaxes(title="layer (w: sliding window)" if windows and any(windows) else "layer",
                     dtick=1 if n_layers <= 32 else None, autorange="reversed", showgrid=False)
    fig = _layout(fig, f"{metric_label} per head", height=max(360, 18 * n_layers + 100))
    _mark_windowed_layers(fig, windows, window_note)  # "3 w" on the axis (hover gives the size), the note below
    return fig


def _signed_colours(shared: np.ndarray | None = None) -> dict:
    """A diverging scale centred at 0, red above and blue below: ``zmid`` 0, or, for grids that share
    one scale, a range symmetric about 0 that holds every value of ``shared``."""
    if shared is None:
        return {"colorscale": PATCHING_SCALE, "reversescale": True, "zmid": 0}
    span = _symmetric_span(np.asarray(shared, dtype=float))
    return {"colorscale": PATCHING_SCALE, "reversescale": True, "zmin": -span, "zmax": span}


def head_outline(layer: int, head: int) -> dict:
    """The outline :func:`head_grid` draws around the selected head (a layout shape)."""
    return {"type": "rect", "x0": head - 0.5, "x1": head + 0.5, "y0": layer - 0.5, "y1": layer + 0.5,
            "line": {"color": "#e4572e", "width": 3}}


def attention_heatmap(pattern: np.ndarray, tokens: Sequence[str], layer: int, head: int) -> go.Figure:
    """One head's attention: rows are queries, columns keys; future keys (masked) are blank."""
    z = attention_heatmap_z(pattern)
    n = z.shape[0]
    labels = token_labels(tokens)
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=labels,
            y=labels,
            colorscale=ATTENTION_SCALE,
            zmin=0.0,
            zmax=1.0,
            colorbar={"title": {"text": "weight", "side": "right"}, "thickness": 12},
            hovertemplate="query %{y}<br>key %{x}<br>weight %{z:.4f}<extra></extra>",
        )
    )
    _token_axes(fig, n, "key")
    fig = _layout(fig, attention_heatmap_title(layer, head), height=max(420, min(1100, 14 * n + 220)))
    fig.update_layout(meta={"layer": layer, "head": head, "n": n})  # read by assets/attention.js
    return fig


def _token_axes(fig: go.Figure, n: int, key_title: str) -> None:
    """Category axes of ``n`` key and query tokens. Up to 80 every token is labelled (dtick=1: plotly
    otherwise drops every other label when crowded); above that none is, and there is no tick or grid
    line per token either: plotly would still lay out 512 of each per axis, about a third of redrawing
    a head's heatmap at 512 tokens in Chromium."""
    show = n <= 80
    tick_font = {"size": 11 if n <= 40 else 9}
    fig.update_xaxes(title=key_title, showticklabels=show, tickangle=-60, type="category",
                     dtick=1 if show else None, showgrid=show, tickfont=tick_font)
    fig.update_yaxes(title="query", showticklabels=show, autorange="reversed", type="category",
                     dtick=1 if show else None, showgrid=show, tickfont=tick_font)


def attention_heatmap_z(pattern: np.ndarray) -> np.ndarray:
    """:func:`attention_heatmap`'s colour values: ``A`` as float32 with NaN (blank) above the diagonal.
    Float32 goes to the browser as one base64 block, many times faster to build, send and parse than
    nested lists (2.9 MB, ~2 s at 480 tokens)."""
    pattern = np.asarray(pattern, dtype=float)
    n = pattern.shape[0]
    return np.where(np.tril(np.ones((n, n), dtype=bool)), pattern, np.nan).astype(np.float32)


def attention_heatmap_title(layer: int, head: int) -> str:
    return f"Attention of layer {layer}, head {head}"


def pooled_attention_map(pooled: np.ndarray, block: int, n: int, layer: int, head: int) -> go.Figure:
    """A long run's head: mean attention per ``block × block`` cell of (query, key), axes in token
    positions (each cell drawn at its first position). Colour on a log scale: pooled means span
    decades, and the sink column would otherwise wash out the rest."""
    pooled = np.asarray(pooled, dtype=float)
    n_q, n_k = pooled.shape
    starts_q, starts_k = np.arange(n_q) * block, np.arange(n_k) * block
    visible = starts_k[None, :] <= (starts_q[:, None] + block - 1)
    positive = pooled[visible & (pooled > 0)]
    floor = float(np.quantile(positive, 0.01)) if positive.size else 1e-6
    z = np.where(visible & (pooled > 0), np.log10(np.maximum(pooled, floor)), np.nan)
    fig = go.Figure(
        go.Heatmap(
            z=np.where(np.isfinite(z), z, None).tolist(), x=starts_k.tolist(), y=starts_q.tolist(),
            colorscale=ATTENTION_SCALE, customdata=pooled.tolist(),
            colorbar={"title": {"text": "log10 mean weight", "side": "right"}, "thickness": 12},
            hovertemplate=(f"{block} queries from %{{y}}<br>{block} keys from %{{x}}<br>"
                           "mean weight %{customdata:.2e}<extra></extra>"),
        )
    )
    fig.update_xaxes(title="key position", range=[-0.5 * block, n - 0.5 * block])
    fig.update_yaxes(title="query position", autorange="reversed")
    title = (f"Layer {layer}, head {head}: mean attention per {block}×{block} block of {n:,} tokens<br>"
             "<sup>drag a box to see exact values below</sup>")
    fig = _layout(fig, title, height=640)
    fig.update_layout(margin={"t": 90}, title={"y": 0.97, "yanchor": "top"})  # the modebar sits above, right
    fig.update_layout(uirevision=f"pooled-{n}-{layer}-{head}")  # a re-render keeps the user's zoom
    return fig


def _log_colour(values: np.ndarray, visible: np.ndarray) -> tuple[np.ndarray, dict]:
    """``log10`` of the visible positive values (floored at their 1st percentile) and a colour bar
    labelled in weights (1e-3, 0.01, …): attention spans decades, and a linear scale shows only its
    largest cell (the sink)."""
    positive = values[visible & (values > 0)]
    floor = float(np.quantile(positive, 0.01)) if positive.size else 1e-6
    z = np.where(visible & np.isfinite(values), np.log10(np.maximum(values, floor)), np.nan)
    lo, hi = (np.nanmin(z), np.nanmax(z)) if np.isfinite(z).any() else (-6.0, 0.0)
    decades = list(range(int(np.floor(lo)), int(np.ceil(hi)) + 1))
    bar = {"tickvals": decades, "ticktext": [f"{10.0 ** d:g}" for d in decades], "thickness": 12}
    return z, bar


def attention_region(values: np.ndarray, q0: int, k0: int, tokens: Sequence[str], layer: int, head: int) -> go.Figure:
    """Exact attention of a region ``[q0:q0+rows, k0:k0+cols]`` of one head (future keys blank).
    Log colour scale; tokens on the axes up to 60 of them, and in the hover always."""
    values = np.asarray(values, dtype=float)
    rows, cols = values.shape
    qs, ks = np.arange(q0, q0 + rows), np.arange(k0, k0 + cols)
    visible = ks[None, :] <= qs[:, None]
    z, bar = _log_colour(values, visible)
    labels = token_labels(tokens)
    custom = np.stack([np.broadcast_to(np.asarray([labels[q] for q in qs], dtype=object)[:, None], (rows, cols)),
                       np.broadcast_to(np.asarray([labels[k] for k in ks], dtype=object)[None, :], (rows, cols)),
                       np.where(visible, values, np.nan)], axis=-1)
    fig = go.Figure(
        go.Heatmap(
            z=np.where(np.isfinite(z), z, None).tolist(), x=ks.tolist(), y=qs.tolist(),
            colorscale=ATTENTION_SCALE, customdata=custom.tolist(),
            colorbar={**bar, "title": {"text": "weight (log)", "side": "right"}},
            hovertemplate="query %{customdata[0]}<br>key %{customdata[1]}<br>weight %{customdata[2]:.4g}"
                          "<extra></extra>",
        )
    )
    if cols <= 60:
        fig.update_xaxes(tickvals=ks.tolist(), ticktext=[labels[k] for k in ks], tickangle=-60)
    if rows <= 60:
        fig.update_yaxes(tickvals=qs.tolist(), ticktext=[labels[q] for q in qs])
    fig.update_xaxes(title="key position", showticklabels=True)
    fig.update_yaxes(title="query position", autorange="reversed", showticklabels=True)
    title = (f"Exact attention of layer {layer}, head {head}: queries {q0}–{q0 + rows - 1}, "
             f"keys {k0}–{k0 + cols - 1} (recomputed through the kernel; log colour)")
    return _layout(fig, title, height=max(420, min(800, 8 * rows + 220)))


def message_figure(text: str) -> go.Figure:
    """An empty figure that says what to do (shown where a view needs an action first)."""
    fig = go.Figure()
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    fig.add_annotation(text=safe_text(text), showarrow=False, font={"size": 14, "color": "#888"})
    return _layout(fig, "", height=300)


def token_strip(
    tokens: Sequence[str],
    weights: np.ndarray | None,
    query: int | None,
    title: str,
    per_row: int = 16,
    scale: tuple[float, str] | None = None,
    value_label: str = "weight",
    also: tuple[str, np.ndarray] | None = None,
) -> go.Figure:
    """Tokens laid out as text in a grid, coloured by ``weights`` (e.g. one attention row).

    Cells after the query (keys it cannot see) stay uncoloured. ``scale=(top, label)`` colours
    0 .. ``top`` (e.g. a top shared by several strips in one unit, so their colours compare) and
    shows a colour bar with numbers titled ``label``; without it the strip spans 0 .. its own
    maximum, no bar. The hover names the coloured value ``value_label``; ``also=(label, values)``
    adds another value per token to it (e.g. the method's own value beside its share).
    """
    n = len(tokens)
    rows = max(1, -(-n // per_row))
    z = np.full((rows, per_row), np.nan)
    text = np.full((rows, per_row), "", dtype=object)
    pos = np.full((rows, per_row), -1)
    for i, tok in enumerate(tokens):
        r, c = divmod(i, per_row)
        text[r, c] = safe_text(shown_token(tok))
        pos[r, c] = i
        if weights is not None:
            z[r, c] = weights[i]
    if weights is None:
        z = np.where(pos >= 0, 0.0, np.nan)
    extra = np.full((rows, per_row), np.nan)
    if also is not None:
        for i in range(n):
            extra[divmod(i, per_row)] = also[1][i]
    custom = np.stack([pos, np.where(np.isfinite(z), z, -1.0), np.where(np.isfinite(extra), extra, -1.0)], axis=-1)
    fig = go.Figure(
        go.Heatmap(
            z=np.where(np.isfinite(z), z, None).tolist(),
            text=text.tolist(),
            texttemplate="%{text}",
            textfont={"size": 12},
            customdata=custom.tolist(),
            colorscale=ATTENTION_SCALE,
            zmin=0.0,
            zmax=(scale[0] if scale is not None else 1.0 if weights is None
                  else max(1e-6, float(np.nanmax(z)))),
            showscale=scale is not None,
            # horizontal, under the tokens: a one-row strip is too short for a readable vertical bar
            colorbar={"title": {"text": (scale[1] if scale is not None else "weight").replace("<br>", " "),
                                "side": "right"},
                      "orientation": "h", "x": 1.0, "xanchor": "right", "y": -0.08, "yanchor": "top",
                      "len": 0.45, "thickness": 10, "nticks": 5, "tickformat": ".2~f"},
            hovertemplate=("position %{customdata[0]}: %{text}<br>" + safe_text(value_label) + " %{customdata[1]:.4f}"
                           + (f"<br>{safe_text(also[0])} %{{customdata[2]:.4f}}" if also is not None else "")
                           + "<extra></extra>"),
            xgap=2,
            ygap=2,
        )
    )
    if query is not None and 0 <= query < n:
        r, c = divmod(query, per_row)
        fig.add_shape(type="rect", x0=c - 0.5, x1=c + 0.5, y0=r - 0.5, y1=r + 0.5,
                      line={"color": "#e4572e", "width": 2})
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False, autorange="reversed")
    fig = _layout(fig, title, height=max(140, 34 * rows + 80) + (50 if scale is not None else 0))
    fig.update_layout(meta={"per_row": per_row, "n": n, "query": query})  # read by assets/attention.js
    return fig


def token_strip_position(point: Any, per_row: int = 16) -> int | None:
    """The token position of a clicked :func:`token_strip` cell (a plotly click point with ``x``
    the column and ``y`` the row), or ``None`` when the point is not a token's cell (the empty
    cells after the last token have no text)."""
    if not isinstance(point, dict) or not point.get("text"):
        return None
    x, y = point.get("x"), point.get("y")
    if not all(isinstance(v, int | float) and not isinstance(v, bool) and float(v).is_integer() for v in (x, y)):
        return None
    if not (0 <= x < per_row and y >= 0):
        return None
    return int(y) * per_row + int(x)


def layer_position_heatmap(values: np.ndarray, tokens: Sequence[str], title: str,
                           value_label: str = "relevance", log: bool = False,
                           windows: Sequence[int | None] | None = None, window_note: str = "") -> go.Figure:
    """``[layer, position]`` values (e.g. cumulative rollout to one token after each layer).

    ``log``: colour by ``log10`` (for values spanning decades, like attention received, where
    position 0 would otherwise leave the rest of the map blank), with the x axis numbered by position
    above 80 tokens (the token is in the hover) and naming every token up to 80. ``windows`` and
    ``window_note``: layers the model windows, marked as in :func:`head_grid`."""
    values = np.asarray(values, dtype=float)
    labels = token_labels(tokens)
    if log:
        fig = _log_position_heatmap(values, labels, title, value_label)
        _mark_windowed_layers(fig, windows, window_note)
        return fig
    fig = go.Figure(
        go.Heatmap(
            z=values.tolist(),
            x=labels,
            y=list(range(values.shape[0])),
            colorscale=ATTENTION_SCALE,
            colorbar={"title": {"text": value_label, "side": "right"}, "thickness": 12},
            hovertemplate="layer %{y}<br>token %{x}<br>" + value_label + " %{z:.4f}<extra></extra>",
        )
    )
    fig.update_xaxes(title="input token", type="category", tickangle=-60, showticklabels=len(tokens) <= 80)
    fig.update_yaxes(title="layer", autorange="reversed")
    fig = _layout(fig, title, height=max(380, 14 * values.shape[0] + 160))
    _mark_windowed_layers(fig, windows, window_note)
    return fig


def _log_position_heatmap(values: np.ndarray, labels: list[str], title: str, value_label: str) -> go.Figure:
    """The log-coloured map: its positions are category labels ``"pos token"`` (the hover names the
    token) and the exact values ride along as float32 ``customdata``, so the browser gets two binary
    blocks rather than a token and a value per cell (30 layers × 515 positions: 0.86 MB of JSON and
    0.3 s to build, which would hold up a head click made while the sink map is on its way)."""
    n_rows, n = values.shape
    z, bar = _log_colour(values, np.isfinite(values))
    fig = go.Figure(
        go.Heatmap(
            z=z.astype(np.float32), x=labels[:n], y=list(range(n_rows)),
            customdata=np.where(np.isfinite(values), values, np.nan).astype(np.float32), colorscale=ATTENTION_SCALE,
            colorbar={**bar, "title": {"text": f"{value_label} (log)", "side": "right"}},
            hovertemplate="layer %{y}<br>token %{x}<br>" + value_label + " %{customdata:.4g}<extra></extra>",
            hoverongaps=False,  # the last position (no later query) has no value: no "NaN" label
        )
    )
    step = 1 if n <= 80 else next(s for m in (1, 10, 100, 1000, 10_000, 100_000) for s in (2 * m, 5 * m, 10 * m)
                                  if n / s <= 12)  # at most 12 numbered positions, at round numbers
    shown = range(0, n, step)
    fig.update_xaxes(type="category", tickmode="array", tickvals=[labels[i] for i in shown],
                     ticktext=[labels[i] if n <= 80 else str(i) for i in shown], tickangle=-60 if n <= 80 else 0,
                     title="input token" if n <= 80 else "input token position", showticklabels=True, showgrid=False)
    fig.update_yaxes(title="layer", autorange="reversed")
    height = max(380, 14 * n_rows + 190)
    fig = _layout(fig, title, height=height)
    # a two-line title whose top is 16 px below the figure's at any height (plotly's title pad does not
    # move it, and its first line would be cut off); the modebar sits above the plot, right
    fig.update_layout(margin={"t": 80}, title={"y": 1 - 16 / height, "yref": "container", "yanchor": "top"})
    return fig


def score_histogram(scores: np.ndarray, label: str, threshold: float | None = None) -> go.Figure:
    """Distribution of one per-head score over all heads (nan heads left out)."""
    values = np.asarray(scores, dtype=float).ravel()
    values = values[np.isfinite(values)]
    fig = go.Figure(go.Histogram(x=values, nbinsx=40, marker_color="#2a6fdb",
                                 hovertemplate=label + " %{x}<br>%{y} heads<extra></extra>"))
    if threshold is not None:
        fig.add_vline(x=threshold, line_dash="dash", line_color="#e4572e",
                      annotation_text=f"{threshold:g}", annotation_position="top right")
    fig.update_xaxes(title=label)
    fig.update_yaxes(title="heads")
    return _layout(fig, f"{label}: {values.size} heads", height=320)


def head_scatter(x: np.ndarray, y: np.ndarray, x_label: str, y_label: str) -> go.Figure:
    """One dot per head, two scores (e.g. retrieval vs streaming shows the split)."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    n_layers, n_heads = x.shape
    layers, heads = np.meshgrid(np.arange(n_layers), np.arange(n_heads), indexing="ij")
    fig = go.Figure(
        go.Scatter(
            x=x.ravel(), y=y.ravel(), mode="markers",
            marker={"color": layers.ravel(), "colorscale": COLORSCALE, "size": 8, "opacity": 0.8,
                    "colorbar": {"title": {"text": "layer", "side": "right"}, "thickness": 12}},
            customdata=np.stack([layers.ravel(), heads.ravel()], axis=-1).tolist(),
            hovertemplate="layer %{customdata[0]}, head %{customdata[1]}<br>" + x_label + " %{x:.3f}<br>"
                          + y_label + " %{y:.3f}<extra></extra>",
        )
    )
    fig.update_xaxes(title=x_label)
    fig.update_yaxes(title=y_label)
    return _layout(fig, f"{y_label} vs {x_label}, one dot per head", height=420)


def niah_grid(accuracy: np.ndarray, lengths: Sequence[int], depths: Sequence[float | str],
              cells: Sequence[Sequence[Proportion]] | None = None, column: str = "needle depth") -> go.Figure:
    """Needle-in-a-haystack accuracy, context length × needle depth (blank where no trial finished).

    ``cells`` (``[length][depth]``, e.g. :meth:`~headscope.analysis.retrieval.RetrievalSweep.accuracy_intervals`):
    each cell's answered of n and 95 % Wilson interval, written in the cell and its hover text. The columns
    are depths in percent, or other labels (a task sweep's tasks) given as text, named ``column``."""
    acc = np.asarray(accuracy, dtype=float)
    text = [[("" if not np.isfinite(v) else f"{v:.0%}") for v in row] for row in acc]
    hover = "accuracy %{z:.2f}"
    custom = None
    if cells is not None:
        text = [[t + (f"<br>{p.successes}/{p.n}" if t and p.n else "") for t, p in zip(trow, prow, strict=True)]
                for trow, prow in zip(text, cells, strict=True)]
        custom = [[f"{p.successes} of {p.n} answered: {p.text()} (95 % Wilson)" if p.n else "no trial finished"
                   for p in prow] for prow in cells]
        hover = "%{customdata}"
    fig = go.Figure(
        go.Heatmap(
            z=np.where(np.isfinite(acc), acc, None).tolist(),
            x=[safe_text(d) if isinstance(d, str) else f"{d:g}%" for d in depths], y=[str(n) for n in lengths],
            colorscale="RdYlGn", zmin=0, zmax=1,
            text=text, customdata=custom,
            texttemplate="%{text}",
            colorbar={"title": {"text": "accuracy", "side": "right"}, "thickness": 12},
            hovertemplate="length %{y} tokens, " + safe_text(column) + " %{x}<br>" + hover + "<extra></extra>",
        )
    )
    fig.update_xaxes(title=column, type="category")
    fig.update_yaxes(title="context length (tokens)", type="category")
    return _layout(fig, "Needle-in-a-haystack accuracy", height=max(280, 60 * len(lengths) + 160))


def token_row(weights: np.ndarray, tokens: Sequence[str], highlight: tuple[int, int] | None, title: str) -> go.Figure:
    """One attention row over a long context as a bar chart; a span (e.g. the needle) is shaded."""
    w = np.asarray(weights, dtype=float)
    fig = go.Figure(go.Bar(x=list(range(w.size)), y=w, marker_color="#2a6fdb",
                           customdata=[safe_text(t) for t in tokens],
                           hovertemplate="position %{x}: %{customdata}<br>weight %{y:.4f}<extra></extra>"))
    if highlight is not None:
        fig.add_vrect(x0=highlight[0] - 0.5, x1=highlight[1] - 0.5, fillcolor="#f4a259", opacity=0.3,
                      line_width=0, annotation_text="needle", annotation_position="top left")
    fig.update_xaxes(title="key position")
    fig.update_yaxes(title="attention")
    return _layout(fig, title, height=300)


def faithfulness_bars(labels: Sequence[str], means: Sequence[float], stds: Sequence[float] | None,
                      title: str, per_input: np.ndarray | None = None,
                      input_names: Sequence[str] | None = None) -> go.Figure:
    """Spearman ρ with ablation importance per attribution method (error bars: std over inputs).

    ``per_input`` (``[input, method]``) adds one dot per input and method, so the spread is visible.
    """
    fig = go.Figure(go.Bar(
        x=list(labels), y=list(means), marker_color=["#2a6fdb" if (m or 0) >= 0 else "#e4572e" for m in means],
        error_y=None if stds is None else {"type": "data", "array": list(stds), "visible": True},
        hovertemplate="%{x}<br>mean ρ = %{y:.3f}<extra></extra>", name="mean ρ", opacity=0.75,
    ))
    if per_input is not None:
        rho = np.asarray(per_input, dtype=float)
        names = list(input_names) if input_names is not None else [str(i) for i in range(rho.shape[0])]
        for k, label in enumerate(labels):
            fig.add_trace(go.Box(
                y=rho[:, k], x=[label] * rho.shape[0], boxpoints="all", jitter=0.5, pointpos=0,
                fillcolor="rgba(0,0,0,0)", line={"color": "rgba(0,0,0,0)"}, marker={"color": "#1f2328", "size": 5},
                text=[safe_text(n) for n in names], showlegend=False,
                hovertemplate="%{text}<br>ρ = %{y:.3f}<extra></extra>",
            ))
    fig.add_hline(y=0, line_color="#888", line_width=1)
    fig.update_yaxes(title="Spearman ρ with ablation", range=[-1, 1])
    return _layout(fig, title, height=340)


def mass_curve(head_fraction: np.ndarray, mass_fraction: np.ndarray, level: float, level_fraction: float,
               label: str) -> go.Figure:
    """Cumulative share of a score's positive mass held by the top heads (Wu et al. 2024's sparsity view)."""
    fig = go.Figure(go.Scatter(
        x=np.asarray(head_fraction) * 100, y=np.asarray(mass_fraction) * 100, mode="lines+markers",
        marker={"size": 4}, line={"color": "#2a6fdb"},
        hovertemplate="top %{x:.1f}% of heads hold %{y:.1f}% of the positive mass<extra></extra>",
    ))
    if level_fraction == level_fraction:  # not nan
        fig.add_shape(type="line", x0=0, x1=level_fraction * 100, y0=level * 100, y1=level * 100,
                      line={"dash": "dot", "color": "#888"})
        fig.add_shape(type="line", x0=level_fraction * 100, x1=level_fraction * 100, y0=0, y1=level * 100,
                      line={"dash": "dot", "color": "#888"})
    fig.update_xaxes(title="heads, best first (% of all heads)", rangemode="tozero")
    fig.update_yaxes(title="share of positive mass (%)", range=[0, 102])
    head = "no head scores above 0" if level_fraction != level_fraction else \
        f"{level_fraction:.1%} of heads hold {level:.0%} of the positive mass"
    return wrap_title(_layout(fig, safe_text(f"{label}: {head}"), height=380), [f"{label}:", head], width=60)


def decode_rows_heatmap(rows: np.ndarray, span: tuple[int, int], argmax: np.ndarray, hits: Sequence[bool],
                        generated: Sequence[str], key_tokens: Sequence[str], title: str) -> go.Figure:
    """One head's attention row at each decode step (step × key), the needle's keys boxed and each
    step's argmax marked (green where it is a copy-paste hit)."""
    rows = np.asarray(rows, dtype=np.float32)
    steps, n_keys = rows.shape
    labels = [safe_text(t) for t in key_tokens[:n_keys]]
    gen = [safe_text(t) for t in generated[:steps]]
    fig = go.Figure(go.Heatmap(
        z=rows, colorscale="Blues", zmin=0, zmax=max(float(rows.max()), 1e-6),
        customdata=np.broadcast_to(np.asarray(labels, dtype=object)[None, :], rows.shape),
        text=np.broadcast_to(np.asarray(gen, dtype=object)[:, None], rows.shape),
        hovertemplate="step %{y} (generated %{text})<br>key %{x} %{customdata}<br>weight %{z:.4f}<extra></extra>",
        colorbar={"title": {"text": "attention", "side": "right"}, "thickness": 12},
    ))
    start, end = span
    fig.add_shape(type="rect", x0=start - 0.5, x1=end - 0.5, y0=-0.5, y1=steps - 0.5,
                  line={"color": "#f4a259", "width": 2}, fillcolor="rgba(244,162,89,0.12)")
    fig.add_annotation(x=(start + end) / 2, y=steps - 0.5, text="needle", showarrow=False, yshift=10,
                       font={"color": "#c0601a"})
    argmax, hit = np.asarray(argmax), np.asarray(hits, dtype=bool)[:steps]
    for copied, name, colour in ((True, "copy-paste (that key is in the needle and is the token generated)", "#2ca02c"),
                                 (False, "no copy-paste", "#d62728")):
        chosen = np.flatnonzero(hit == copied)  # both keys are in the legend, even with no such step
        fig.add_trace(go.Scatter(
            x=argmax[chosen] if len(chosen) else [None], y=chosen if len(chosen) else [None], mode="markers",
            name=f"each step's most-attended key: {name}",
            marker={"symbol": "x", "size": 8, "color": colour},
            hovertemplate=f"step %{{y}}: most-attended key %{{x}}, {name.split(' (')[0]}<extra></extra>",
        ))
    fig.update_xaxes(title="key position (prompt, then generated tokens)", range=[-0.5, n_keys - 0.5])
    fig.update_yaxes(title="decode step", autorange="reversed")
    _layout(fig, safe_text(title), height=max(360, 100 + 14 * steps))
    # the key below the plot (above it, it would cover the title); the colour bar keeps the right
    fig.update_layout(legend={"orientation": "h", "x": 0, "xanchor": "left", "y": 0, "yanchor": "bottom",
                              "yref": "container"}, margin={"b": 90})
    return fig


CHOSEN_TRACE = "chosen"  # the uid of the chosen heads' markers on a selection map (app/grid_clicks.py toggle_head)


def head_selection(scores: np.ndarray, label: str, chosen: Sequence[tuple[int, int]],
                   title: Sequence[str] | None = None, signed: bool = False) -> go.Figure:
    """The ranking score per head with the heads chosen for ablation marked (click toggles them).

    The markers' trace is there even when no head is chosen (its uid :data:`CHOSEN_TRACE`): the page toggles a
    clicked head in the browser by rewriting its points and the count in the title
    (``assets/grid_clicks.js``). ``title``: paragraphs to say instead, starting with the count."""
    fig = head_grid(scores, label, signed=signed)
    fig.add_trace(go.Scatter(
        x=[h for _, h in chosen], y=[la for la, _ in chosen], mode="markers", showlegend=False, uid=CHOSEN_TRACE,
        marker={"symbol": "square-open", "size": 13, "color": "#e4572e", "line": {"width": 3}},
        hovertemplate="layer %{y}, head %{x}: chosen<extra></extra>",
    ))
    return wrap_title(fig, title or f"{len(chosen)} heads chosen (boxed) — colour: {label}", width=60)


def loss_change(tokens: Sequence[str], clean: np.ndarray, ablated: np.ndarray, title: str) -> go.Figure:
    """Per-token loss after minus before an ablation (up: the ablation hurts that token)."""
    diff = np.asarray(ablated, dtype=float) - np.asarray(clean, dtype=float)
    labels = token_labels(tokens)
    fig = go.Figure(go.Bar(
        x=list(range(len(tokens))), y=np.where(np.isfinite(diff), diff, None).tolist(),
        marker={"color": ["#d62728" if d > 0 else "#2a6fdb" for d in np.nan_to_num(diff)]},
        customdata=np.stack([labels, np.nan_to_num(clean), np.nan_to_num(ablated)], -1).tolist(),
        hovertemplate="%{customdata[0]} (pos %{x})<br>loss %{customdata[1]:.3f} → %{customdata[2]:.3f}"
                      "<br>Δ %{y:.3f}<extra></extra>",
    ))
    fig.update_xaxes(title="token", tickvals=list(range(len(tokens))), ticktext=labels if len(tokens) <= 80 else None,
                     tickangle=-60)
    fig.update_yaxes(title="Δ loss (ablated − clean, nats)", zeroline=True)
    return _layout(fig, safe_text(title), height=360)


def topk_curve(k_values: Sequence[int], top: np.ndarray, random: np.ndarray, metric_label: str,
               title: str, outside_top: int | None = None, *, top_ci: Sequence[Proportion] = (),
               random_ci: Sequence[Proportion] = (), random_band: Sequence[SeedBand] = ()) -> go.Figure:
    """Metric against k: the top-k heads by a score, and k random heads (each seed faint).

    A loss curve's random control is drawn as its mean ± std over seeds. An accuracy curve passes its
    intervals (:meth:`~headscope.analysis.ablation_curve.TopkCurve.top_accuracy`, ``random_pooled``,
    ``random_band``): the top-k line gets 95 % Wilson error bars over its prompts, the random mean the
    pooled Wilson interval of all seeds' prompts, and the shaded band is the lowest to the highest seed.
    ``outside_top``: the random heads were drawn from outside the top N by the score; the legend
    says so (None: a curve stored before the control's N was a setting, drawn as it was)."""
    k = list(k_values)
    rand = "random heads" if outside_top is None else f"random heads outside the top {outside_top}"
    random = np.asarray(random, dtype=float)
    fig = go.Figure()
    for s, row in enumerate(random):
        fig.add_trace(go.Scatter(x=k, y=np.where(np.isfinite(row), row, None).tolist(), mode="lines",
                                 line={"color": "#999", "width": 1}, opacity=0.5, showlegend=s == 0,
                                 name=f"{rand} (each seed)", hoverinfo="skip"))
    if len(random):
        with np.errstate(all="ignore"):
            mean, std = np.nanmean(random, 0), np.nanstd(random, 0)
        if random_band:
            low, high = np.array([b.low for b in random_band]), np.array([b.high for b in random_band])
            band_name = f"random: lowest to highest of {len(random)} seeds"
        else:
            low, high, band_name = mean - std, mean + std, "random ± std"
        fig.add_trace(go.Scatter(x=k + k[::-1], y=_finite(np.concatenate([high, low[::-1]])),
                                 fill="toself", fillcolor="rgba(120,120,120,0.15)", line={"width": 0}, mode="lines",
                                 name=band_name, hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=k, y=_finite(mean), mode="lines+markers", line={"color": "#555", "dash": "dash"},
                                 name=f"{rand} (mean)", **_interval_bars(random_ci, "random, mean",
                                                                         "pooled over all seeds' prompts")))
    fig.add_trace(go.Scatter(x=k, y=_finite(np.asarray(top, dtype=float)), mode="lines+markers",
                             line={"color": "#e4572e", "width": 3}, name="top-k heads",
                             **_interval_bars(top_ci, "top", "over the prompts")))
    fig.update_xaxes(title="k (heads ablated)", tickvals=k)
    fig.update_yaxes(title=metric_label)
    if top_ci:
        fig.update_yaxes(range=[-0.05, 1.05])
    fig.update_layout(legend={"orientation": "h", "y": -0.25})
    return _layout(fig, safe_text(title), height=400)


def _finite(values: np.ndarray) -> list:
    return np.where(np.isfinite(values), values, None).tolist()


def _interval_bars(intervals: Sequence[Proportion], what: str, over: str) -> dict[str, Any]:
    """A line's hover text, and with ``intervals`` its asymmetric error bars (95 % Wilson) and their
    text in the hover; without, the hover a loss curve has always had."""
    if not intervals:
        return {"hovertemplate": f"k=%{{x}}: %{{y:.3f}} ({what})<extra></extra>"}
    minus = [p.value - p.low if p.n else None for p in intervals]
    plus = [p.high - p.value if p.n else None for p in intervals]
    return {"error_y": {"type": "data", "symmetric": False, "array": plus, "arrayminus": minus, "thickness": 1.5,
                        "width": 4},
            "customdata": [p.text() if p.n else "not measured" for p in intervals],
            "hovertemplate": f"k=%{{x}} ({what}): %{{customdata}}<br>95 % Wilson interval {over}<extra></extra>"}


PATCHING_SCALE = "RdBu"


def patching_map(values: np.ndarray, x_labels: Sequence[str], y_labels: Sequence[str], x_title: str,
                 y_title: str, value_label: str, title: str, baseline: float = 0.0) -> go.Figure:
    """A map of normalised patching values (0 = corrupted, 1 = clean), coloured around ``baseline``
    (the value of patching nothing: 0 when denoising, 1 when noising); nan cells blank.

    Used for the layer × head map (``values[layer, head]``) and the residual stream's layer ×
    position map (``values[layer, position]``)."""
    values = np.asarray(values, dtype=float)
    finite = values[np.isfinite(values)]
    span = float(np.max(np.abs(finite - baseline))) if finite.size else 1.0
    span = span or 1.0
    fig = go.Figure(
        go.Heatmap(
            z=np.where(np.isfinite(values), values, None).tolist(), x=list(x_labels), y=list(y_labels),
            colorscale=PATCHING_SCALE, zmin=baseline - span, zmax=baseline + span,
            colorbar={"title": {"text": value_label, "side": "right"}, "thickness": 12},
            hovertemplate=y_title + " %{y}, " + x_title + " %{x}<br>" + value_label + ": %{z:.4f}<extra></extra>",
            xgap=1, ygap=1,
        )
    )
    fig.update_xaxes(title=x_title, type="category", showgrid=False,
                     tickangle=-60 if len(x_labels) > 16 else 0, showticklabels=len(x_labels) <= 80)
    fig.update_yaxes(title=y_title, type="category", autorange="reversed", showgrid=False)
    height = max(360, 18 * values.shape[0] + 140)
    return wrap_title(_layout(fig, safe_text(title), height=height), title)


def patching_positions(values: np.ndarray, tokens: Sequence[str], value_label: str, title: str,
                       baseline: float = 0.0, differ: Sequence[int] = ()) -> go.Figure:
    """Normalised patching value per position of one head, as bars from ``baseline``; positions where
    the two prompts differ are shaded."""
    values = np.asarray(values, dtype=float)
    fig = go.Figure(go.Bar(x=token_labels(tokens), y=np.where(np.isfinite(values), values - baseline, None).tolist(),
                           base=baseline, marker_color="#2a6fdb",
                           hovertemplate="%{x}<br>" + value_label + " %{customdata:.4f}<extra></extra>",
                           customdata=np.where(np.isfinite(values), values, None).tolist()))
    labels = token_labels(tokens)
    for p in differ:
        fig.add_vrect(x0=p - 0.5, x1=p + 0.5, fillcolor="#f4a259", opacity=0.25, line_width=0)
    fig.update_xaxes(title="position (shaded: the prompts differ)", type="category", tickangle=-60,
                     showticklabels=len(labels) <= 80)
    fig.update_yaxes(title=value_label)
    return wrap_title(_layout(fig, safe_text(title), height=340), title)


def exact_vs_attribution(exact: np.ndarray, approx: np.ndarray, unit_labels: Sequence[str], title: str,
                         note: str = "") -> go.Figure:
    """One dot per patched unit: attribution patching's estimate against exact patching, with y = x;
    ``note`` (e.g. the agreement) is a second, smaller title line."""
    x, y = np.asarray(exact, dtype=float).ravel(), np.asarray(approx, dtype=float).ravel()
    ok = np.isfinite(x) & np.isfinite(y)
    fig = go.Figure(go.Scatter(
        x=x[ok].tolist(), y=y[ok].tolist(), mode="markers", name="units",
        marker={"size": 7, "color": "#2a6fdb", "opacity": 0.75},
        customdata=[safe_text(s) for s, k in zip(unit_labels, ok, strict=True) if k],
        hovertemplate="%{customdata}<br>exact %{x:.4f}<br>attribution %{y:.4f}<extra></extra>"))
    if ok.any():
        lo, hi = float(min(x[ok].min(), y[ok].min())), float(max(x[ok].max(), y[ok].max()))
        fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="y = x",
                                 line={"color": "#999", "dash": "dash"}, hoverinfo="skip"))
    fig.update_xaxes(title="exact activation patching")
    fig.update_yaxes(title="attribution patching (first order)")
    fig.update_layout(legend={"orientation": "h", "y": -0.2})
    shown = safe_text(title) + (f"<br><sup>{safe_text(note)}</sup>" if note else "")
    return _layout(fig, shown, height=460)


def _symmetric_span(values: np.ndarray) -> float:
    finite = np.abs(values[np.isfinite(values)])
    return float(finite.max()) if finite.size and finite.max() > 0 else 1.0


def _fixed(values: np.ndarray, decimals: np.ndarray, sign: bool = False) -> list[list[str]]:
    """Each value printed to its own number of decimals ("" where nan)."""
    return [[("" if not np.isfinite(v) else f"{v:+.{d}f}" if sign else f"{v:.{d}f}") for v, d in zip(row, drow, strict=True)]
            for row, drow in zip(values, decimals, strict=True)]


def comparison_grids(first: np.ndarray, second: np.ndarray, metric_label: str, first_name: str,
                     second_name: str, title: str, selected: tuple[int, int] | None = None,
                     resolution: np.ndarray | None = None, stored: str = "the stored attention",
                     signed: bool = False) -> go.Figure:
    """Two runs' per-head score side by side (one colour range for both) and their difference
    (second − first, red up and blue down, white at 0); nan cells blank; the selected head outlined.

    ``resolution``: ``[layer, head]`` how far each change can be from rounding alone, of ``stored``
    (:attr:`headscope.analysis.run_comparison.RunComparison.resolution`). Each head's numbers are printed to
    the decimals it carries (:func:`headscope.analysis.run_comparison.shown_decimals`), and a head whose change
    is within it is dotted on the change grid: its change, even its sign, may be rounding alone.
    ``signed``: the score's sign means something; both runs' grids then share a diverging scale centred at 0."""
    from plotly.subplots import make_subplots

    from headscope.analysis.run_comparison import shown_decimals

    first, second = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    diff = second - first
    n_layers, n_heads = first.shape
    resolution = np.zeros_like(diff) if resolution is None else np.asarray(resolution, dtype=float)
    decimals = shown_decimals(resolution)
    with np.errstate(invalid="ignore"):
        within = np.abs(diff) <= resolution
    both = np.concatenate([first[np.isfinite(first)], second[np.isfinite(second)]])
    lo, hi = (float(both.min()), float(both.max())) if both.size else (0.0, 1.0)
    colours = _signed_colours(both) if signed else {"colorscale": COLORSCALE, "zmin": lo, "zmax": hi}
    span = _symmetric_span(diff)
    # the shared colour bar stands in the gap after the second grid, clear of its last column and of
    # the third grid's layer labels: the gap holds the bar, its ticks, its title and those labels
    spacing = 0.12
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=spacing,
                        subplot_titles=["first", "second", "second − first"])
    second_end = (2 * (1 - 2 * spacing) / 3) + spacing
    hover = "layer %{y}, head %{x}<br>" + safe_text(metric_label) + ": %{text}<extra>%{fullData.name}</extra>"
    for col, (z, name) in enumerate(((first, "first"), (second, "second")), start=1):
        fig.add_trace(go.Heatmap(z=np.where(np.isfinite(z), z, None).tolist(), x=list(range(n_heads)),
                                 y=list(range(n_layers)), **colours, name=name,
                                 showscale=col == 2, hovertemplate=hover, xgap=1, ygap=1,
                                 text=_fixed(z, decimals),
                                 colorbar={"title": {"text": metric_label, "side": "right"}, "thickness": 10,
                                           "x": second_end + 0.006, "xanchor": "left", "xpad": 0, "len": 0.9}),
                      1, col)
    rounding = [[("" if not np.isfinite(c) else "within the rounding: may be rounding alone" if w
                  else "larger than the rounding") + (f" (±{r:.1e})" if np.isfinite(r) else "")
                 for c, w, r in zip(crow, wrow, rrow, strict=True)]
                for crow, wrow, rrow in zip(diff, within, resolution, strict=True)]
    fig.add_trace(go.Heatmap(z=np.where(np.isfinite(diff), diff, None).tolist(), x=list(range(n_heads)),
                             y=list(range(n_layers)), colorscale=PATCHING_SCALE, reversescale=True, zmin=-span,
                             zmax=span, name="change", xgap=1, ygap=1, text=_fixed(diff, decimals, sign=True),
                             customdata=rounding,
                             hovertemplate="layer %{y}, head %{x}<br>change: %{text}<br>%{customdata}<extra></extra>",
                             colorbar={"title": {"text": "change", "side": "right"}, "thickness": 10}), 1, 3)
    layers, heads = np.nonzero(within)
    if layers.size:
        fig.add_trace(go.Scatter(x=heads.tolist(), y=layers.tolist(), mode="markers", name="within rounding",
                                 marker={"symbol": "circle", "size": 4, "color": "#444"}, hoverinfo="skip",
                                 showlegend=False), 1, 3)
    for col in (1, 2, 3):
        fig.update_xaxes(title="head", dtick=1, showgrid=False, row=1, col=col, range=[-0.5, n_heads - 0.5],
                         zeroline=False)
        fig.update_yaxes(autorange="reversed", showgrid=False, dtick=1 if n_layers <= 32 else None, row=1, col=col,
                         title="layer" if col == 1 else None, zeroline=False)
        if selected is not None:
            layer, head = selected
            fig.add_shape(type="rect", x0=head - 0.5, x1=head + 0.5, y0=layer - 0.5, y1=layer + 0.5,
                          line={"color": "#e4572e", "width": 3}, row=1, col=col)
    note = (f"<br>·: a change within the rounding of {safe_text(stored)} ({int(within.sum())} of "
            f"{int(np.isfinite(diff).sum())} heads); its size and sign may be rounding alone" if resolution.any() else "")
    fig.add_annotation(text=f"first: {safe_text(first_name)}<br>second: {safe_text(second_name)}{note}",
                       xref="paper", yref="paper", x=0, y=-0.09, xanchor="left", yanchor="top", showarrow=False,
                       align="left", font={"size": 11})
    fig = _layout(fig, safe_text(title), height=max(420, 18 * n_layers + 170))
    # Margins fixed, with room on the right for the change's colour bar: on a redraw in place
    # (Plotly.react, as the page draws) plotly places colour bars before it widens the margins for
    # them, so a bar between two grids lands left of its place, over the second grid's last column.
    fig.update_layout(margin={"b": 110, "r": 110, "autoexpand": False})
    return fig


def attention_difference_map(diff: np.ndarray, tokens: Sequence[str], layer: int, head: int, block: int = 1,
                             differ: Sequence[int] = ()) -> go.Figure:
    """A head's attention in the second run minus the first (queries down, keys across; red: more
    attention in the second run); rows and columns of positions where the tokens differ are marked.
    With ``block`` > 1 each cell is a ``block × block`` mean (a pooled map), labelled by its first position."""
    diff = np.asarray(diff, dtype=float)
    n = diff.shape[0]
    # future keys are masked in both runs (whole blocks above the diagonal, when pooled): blank, not "no change"
    diff = np.where(np.tril(np.ones(diff.shape, dtype=bool)), diff, np.nan)
    labels = token_labels(tokens) if block == 1 else [f"{i * block}–{min((i + 1) * block, len(tokens)) - 1}"
                                                      for i in range(n)]
    span = _symmetric_span(diff)
    fig = go.Figure(go.Heatmap(
        z=np.where(np.isfinite(diff), diff, np.nan).astype(np.float32), x=labels, y=labels,
        colorscale=PATCHING_SCALE, reversescale=True, zmin=-span, zmax=span,
        colorbar={"title": {"text": "second − first", "side": "right"}, "thickness": 12},
        hovertemplate="query %{y}<br>key %{x}<br>change %{z:+.4f}<extra></extra>"))
    for p in sorted({p // block for p in differ}):
        fig.add_vrect(x0=p - 0.5, x1=p + 0.5, line={"color": "#f4a259", "width": 2}, fillcolor="rgba(0,0,0,0)")
        fig.add_hrect(y0=p - 0.5, y1=p + 0.5, line={"color": "#f4a259", "width": 2}, fillcolor="rgba(0,0,0,0)")
    _token_axes(fig, n, "key" + (" (outlined: the tokens differ)" if differ else ""))
    what = "attention" if block == 1 else f"mean attention per {block}×{block} block"
    return _layout(fig, f"Change in {what} of layer {layer}, head {head} (second − first)",
                   height=max(420, min(1100, 14 * n + 220)))


COMPRESSION_COLOURS = {"retrieval": "#e4572e", "streaming": "#17bebb", "evidence": "#76b041",
                       "all_full": "#2e282a", "all_streaming": "#6c4e97"}
COMPRESSION_METRICS = (("niah_accuracy", "NIAH accuracy"), ("loss", "mean loss"))


def _accuracy_interval(row: dict[str, Any], name: str = "niah_accuracy") -> tuple[float | None, float | None, str]:
    """``(minus, plus, text)`` of a row's accuracy interval columns (``name``, ``name_n``, ``_low``,
    ``_high``): the error bar's lengths below and above the point and
    :meth:`headscope.analysis.intervals.Proportion.text`; None and ``""`` where the row has no interval."""
    from headscope.analysis.intervals import Proportion

    value, n = row.get(name), row.get(f"{name}_n") or 0
    low, high = row.get(f"{name}_low"), row.get(f"{name}_high")
    if not n or any(v is None or not np.isfinite(v) for v in (value, low, high)):
        return None, None, ""
    return float(value) - float(low), float(high) - float(value), Proportion(round(value * n), n, low, high).text()


def _error_bars(rows: Sequence[dict[str, Any]], name: str = "niah_accuracy") -> tuple[dict, list[str]]:
    """Plotly ``error_y`` (asymmetric, from each row's interval columns) and each row's interval text."""
    bars = [_accuracy_interval(r, name) for r in rows]
    return ({"type": "data", "symmetric": False, "array": [b[1] for b in bars], "arrayminus": [b[0] for b in bars],
             "thickness": 1.5, "width": 4}, [b[2] for b in bars])


def compression_pareto(points: Sequence[dict[str, Any]], baseline: dict[str, Any], labels: dict[str, str],
                       tolerance: float, best: dict[str, float | None], title: str,
                       bands: Sequence[dict[str, Any]] = ()) -> go.Figure:
    """NIAH accuracy (top) and mean loss (bottom) against the share of the KV cache kept, one curve per
    ranking; random policies as a band (lowest to highest seed) around their mean; the uncompressed
    model as a dashed line; per ranking, the smallest KV fraction within the tolerance (``best[ranking]``,
    a KV fraction, or None) marked with a star.

    Every NIAH accuracy has an error bar, its 95 % Wilson interval (the rows' ``niah_accuracy_low`` and
    ``_high``; the hover text says it with its n); the random mean's bar is the pooled interval of its
    seeds' prompts (``bands``: :meth:`headscope.analysis.kv_compression.CompressionCurve.seed_bands`). The
    shading runs from the uncompressed interval's lower bound less ``tolerance`` to its upper bound: a
    policy passes when its error bar reaches it or lies above it
    (:meth:`headscope.analysis.kv_compression.CompressionCurve.within_tolerance`).

    ``points``: one dict per evaluated policy with ``ranking``, ``seed``, ``kv_fraction``,
    ``niah_accuracy`` (and its ``_n``, ``_low``, ``_high``) and ``loss``; ``baseline``: the uncompressed
    row.
    """
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=[label for _, label in COMPRESSION_METRICS])

    def finite(values) -> list:
        return [None if v is None or not np.isfinite(v) else float(v) for v in values]

    rankings = list(dict.fromkeys(p["ranking"] for p in points))
    for row, (metric, label) in enumerate(COMPRESSION_METRICS, start=1):
        accuracy = metric == "niah_accuracy"
        base = baseline.get(metric)
        if base is not None and np.isfinite(base):
            bars, texts = _error_bars([baseline]) if accuracy else (None, [""])
            if accuracy:
                low, high = baseline.get("niah_accuracy_low"), baseline.get("niah_accuracy_high")
                low, high = (base, base) if low is None or not np.isfinite(low) else (low, high)
                if tolerance > 0 or high > low:
                    fig.add_hrect(y0=low - tolerance, y1=high, fillcolor="rgba(46,40,42,0.08)", line_width=0,
                                  row=row, col=1, exclude_empty_subplots=False)
            # drawn before the panel has traces: plotly skips an empty subplot unless told not to
            fig.add_hline(y=base, line={"color": "#2e282a", "dash": "dash", "width": 1}, row=row, col=1,
                          exclude_empty_subplots=False)
            # the uncompressed model as the curve's point at KV 1.0: a trace, so the axis range includes it
            # (a line alone does not, and a loss below every policy's fell outside the plot)
            fig.add_trace(go.Scatter(x=[1.0], y=[float(base)], mode="markers", name="uncompressed",
                                     legendgroup="uncompressed", showlegend=row == 1, error_y=bars,
                                     text=[safe_text(t) for t in texts],
                                     marker={"symbol": "diamond", "size": 10, "color": "#2e282a"},
                                     hovertemplate="uncompressed: %{y:.4f} %{text}<extra></extra>"), row, 1)
        for ranking in rankings:
            mine = sorted((p for p in points if p["ranking"] == ranking), key=lambda p: p["kv_fraction"])
            name = labels.get(ranking, ranking)
            if ranking == "random":
                _random_band(fig, row, metric, mine, name, [b for b in bands if b.get("ranking") == ranking])
                continue
            colour = COMPRESSION_COLOURS.get(ranking, "#444")
            bars, texts = _error_bars(mine) if accuracy else (None, [""] * len(mine))
            fig.add_trace(go.Scatter(
                x=[p["kv_fraction"] for p in mine], y=finite(p[metric] for p in mine), name=name,
                mode="lines+markers" if len(mine) > 1 else "markers", legendgroup=ranking, showlegend=row == 1,
                line={"color": colour, "width": 2.5}, marker={"color": colour, "size": 8}, error_y=bars,
                customdata=[[p.get("fraction_full"), safe_text(t)] for p, t in zip(mine, texts, strict=True)],
                hovertemplate=f"KV %{{x:.3f}} (groups full %{{customdata[0]}}): %{{y:.4f}} %{{customdata[1]}} "
                              f"({safe_text(name)})<extra></extra>"), row, 1)
        stars = [(r, f) for r, f in best.items() if f is not None and r in rankings]
        if stars:
            ys = []
            for r, f in stars:
                at = [p[metric] for p in points if p["ranking"] == r and abs(p["kv_fraction"] - f) < 1e-9]
                with np.errstate(all="ignore"):
                    ys.append(float(np.nanmean(at)) if at and np.isfinite(at).any() else None)
            fig.add_trace(go.Scatter(
                x=[f for _, f in stars], y=ys, mode="markers", name=f"smallest KV within {tolerance:g} of full",
                legendgroup="best", showlegend=row == 1, text=[labels.get(r, r) for r, _ in stars],
                marker={"symbol": "star", "size": 16, "color": [COMPRESSION_COLOURS.get(r, "#555") for r, _ in stars],
                        "line": {"color": "#000", "width": 1}},
                hovertemplate="%{text}: smallest KV within tolerance, %{x:.3f}<extra></extra>"), row, 1)
        fig.update_yaxes(title=label, row=row, col=1, **({"range": [-0.05, 1.05]} if accuracy else {}))
    fig.update_xaxes(title="KV cache kept (fraction of full)", range=[-0.02, 1.02], row=2, col=1)
    fig.update_layout(legend={"orientation": "h", "y": -0.18})
    fig = _layout(fig, safe_text(title), height=640)
    fig.update_layout(margin={"b": 120})
    return fig


def _random_band(fig: go.Figure, row: int, metric: str, mine: Sequence[dict[str, Any]], name: str,
                 bands: Sequence[dict[str, Any]]) -> None:
    """The random ranking in one panel: the seed band (lowest to highest seed) at each KV fraction and the
    seeds' mean, whose NIAH error bar is the pooled Wilson interval of ``bands`` (by KV fraction)."""
    fractions = sorted({round(p["kv_fraction"], 12) for p in mine})
    groups = [[p[metric] for p in mine if round(p["kv_fraction"], 12) == f] for f in fractions]
    with np.errstate(all="ignore"):
        arrays = [np.asarray(g, dtype=float) for g in groups]
        lo = [float(np.nanmin(a)) if np.isfinite(a).any() else None for a in arrays]
        hi = [float(np.nanmax(a)) if np.isfinite(a).any() else None for a in arrays]
        mean = [float(np.nanmean(a)) if np.isfinite(a).any() else None for a in arrays]
    n_seeds = max((len(g) for g in groups), default=0)
    fig.add_trace(go.Scatter(x=fractions + fractions[::-1], y=hi + lo[::-1], fill="toself",
                             fillcolor="rgba(120,120,120,0.2)", line={"width": 0}, mode="lines",
                             name=f"{name}: {n_seeds} seeds, lowest to highest", legendgroup="random",
                             showlegend=row == 1, hoverinfo="skip"), row, 1)
    bars, texts = None, [""] * len(fractions)
    if metric == "niah_accuracy" and bands:
        by_x = {round(b["kv_fraction"], 12): b for b in bands}
        pooled = [{k.replace("_pooled", ""): v for k, v in by_x.get(f, {}).items()} for f in fractions]
        bars, texts = _error_bars(pooled)
        texts = [f"seeds {_span(low, high)}; pooled {t}" if t else "" for t, low, high in zip(texts, lo, hi, strict=True)]
    fig.add_trace(go.Scatter(x=fractions, y=mean, mode="lines+markers", name=f"{name} (mean)",
                             legendgroup="random", showlegend=row == 1, error_y=bars,
                             line={"color": "#555", "dash": "dot"}, text=[safe_text(t) for t in texts],
                             hovertemplate=f"KV %{{x:.3f}}: %{{y:.4f}} ({safe_text(name)}, mean) %{{text}}"
                                           "<extra></extra>"), row, 1)


def _span(low: float | None, high: float | None) -> str:
    return "—" if low is None or high is None else f"{low:.2f}–{high:.2f}"


def policy_map(full: np.ndarray, title: str) -> go.Figure:
    """A KV-cache policy per (layer, KV group): full cache (dark) or streaming (light, sinks + recent)."""
    full = np.asarray(full, dtype=bool)
    n_layers, n_kv = full.shape
    text = np.where(full, "full", "streaming")
    fig = go.Figure(go.Heatmap(
        z=full.astype(int).tolist(), x=list(range(n_kv)), y=list(range(n_layers)), text=text.tolist(),
        colorscale=[[0, "#d9eef0"], [0.5, "#d9eef0"], [0.5, "#e4572e"], [1, "#e4572e"]], zmin=0, zmax=1, xgap=2,
        ygap=1, hovertemplate="layer %{y}, KV group %{x}: %{text}<extra></extra>",
        colorbar={"tickvals": [0.25, 0.75], "ticktext": ["streaming", "full"], "thickness": 10, "len": 0.5}))
    fig.update_xaxes(title="KV group (key-value head)", dtick=1, showgrid=False)
    fig.update_yaxes(title="layer", autorange="reversed", showgrid=False, dtick=1 if n_layers <= 32 else None)
    return _layout(fig, safe_text(title), height=max(360, 16 * n_layers + 120))
