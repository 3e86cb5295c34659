"""The edge-attribution graph's pure builder (:func:`headscope.app.views.circuits.edge_graph`): one line per edge
in rank order, coloured by the site it ends in, width by |score|, nodes where the page says (head ``L.H`` at
(L, H), the logits after the last layer), and hover text naming sender → receiver, site and score."""

from __future__ import annotations

import pytest

from headscope.app.views.circuits import SITE_COLOURS, edge_graph

EDGES = [("23.3", "logits", "logits", -6.15), ("mlp.0", "23.1", "v", -2.87), ("embed", "5.2", "q", 1.5),
         ("4.0", "9.1", "k", 0.75), ("3.3", "9.2", "q", -0.3)]


def edge_traces(fig) -> list:
    return [t for t in fig.data if t.customdata is not None and t.name not in ("heads", "components")]


def test_the_graph_draws_each_edge_once_coloured_by_its_site_and_widest_for_the_largest_score():
    fig = edge_graph(EDGES, n_layers=30, n_heads=9, title="t")
    traces = edge_traces(fig)
    assert len(traces) == len(EDGES)
    for trace, (sender, receiver, site, score) in zip(traces, EDGES, strict=True):
        assert list(trace.customdata[0][:3]) == [sender, receiver, site]
        assert trace.line.color == SITE_COLOURS[site]
        assert f"{sender} → " in trace.text[1] and f"({site})" in trace.text[1] and f"{score:+.4f}" in trace.text[1]
    widths = [t.line.width for t in traces]
    assert widths == sorted(widths, reverse=True) and widths[0] == pytest.approx(8)  # by |score|, largest first
    assert len(set(SITE_COLOURS.values())) == 4
    # one legend entry per site drawn, not one per edge
    assert sorted(t.legendgroup for t in traces if t.showlegend) == ["k", "logits", "q", "v"]


def test_nodes_sit_by_layer_and_head_with_the_logits_after_the_last_layer():
    fig = edge_graph(EDGES, n_layers=30, n_heads=9, title="t")
    first = edge_traces(fig)[0]
    assert (first.x[0], first.y[0]) == (23, 3) and first.x[-1] == 30  # 23.3 → logits
    k = edge_traces(fig)[3]
    assert (k.x[0], k.y[0], k.x[-1], k.y[-1]) == (4, 0, 9, 1)
    labels = next(t for t in fig.data if t.name == "components").text
    assert set(labels) == {n for e in EDGES for n in e[:2]}
    heads = next(t for t in fig.data if t.name == "heads")
    assert len(heads.x) == 30 * 9


def test_no_edges_is_an_empty_graph_not_an_error():
    fig = edge_graph([], n_layers=2, n_heads=2, title="t")
    assert edge_traces(fig) == []
