"""app/views/qk.py: the QK page's figures draw what their titles and legends say, on the embedded
model, as the page and its exports build them (the same view). The bar chart is checked where it is
drawn, in real Chromium."""

from __future__ import annotations

import pytest

from headscope.app.views import qk as views

pytestmark = pytest.mark.integration

PARAMS = {"model": "smollm2-135m", "layer": 2, "head": 1, "sentences": 4, "texts": None, "method": "pca",
          "colour": "position", "query": 5, "find": None, "feature": "previous_token", "labels": None}


@pytest.fixture(scope="module")
def qk_context(tmp_path_factory, real_model):
    from headscope.analysis.store import Store
    from headscope.app import context

    before = context._context
    store = Store(tmp_path_factory.mktemp("qk-home"))
    context.set_context(context.AppContext(store=store, default_model="smollm2-135m"))
    yield
    context._context = before
    store.close()


def test_attention_before_and_after_removing_the_subspace_stand_side_by_side(qk_context, browser):
    """Each key's attention before and after the intervention are two bars from 0, side by side, each
    as tall as its value: stacked, the second bar started at the top of the first and key 0 read 1.14
    on an attention axis."""
    fig, rows = views.qk_attribution_view(None, PARAMS)
    before = [r["attention"] for r in rows]
    after = [r["attention_after"] for r in rows]
    assert len(before) == 6 and max(before + after) <= 1 + 1e-6
    page = browser.new_page(viewport={"width": 1200, "height": 800})
    try:
        page.set_content(fig.to_html(include_plotlyjs=True, full_html=True))
        page.wait_for_selector(".barlayer")
        drawn = page.evaluate("""() => { const el = document.querySelector('.js-plotly-plot');
            const ya = el._fullLayout.yaxis2;
            const bars = name => { const i = el._fullData.findIndex(t => t.name === name);
                return Array.from(el.querySelectorAll('.barlayer .trace')).find(g => g.__data__[0].trace.index === i)
                    .querySelectorAll('.point path'); };
            const boxes = name => Array.from(bars(name)).map(p => { const r = p.getBoundingClientRect();
                return [r.left, r.right, r.top, r.bottom]; });
            return {before: boxes('attention before'), after: boxes('attention after removing it'),
                    zero: el.getBoundingClientRect().top + ya._offset + ya.l2p(0), top: ya.range[1],
                    perUnit: ya._length / (ya.range[1] - ya.range[0])}; }""")
    finally:
        page.close()
    assert drawn["top"] <= 1.1 * max(before + after), drawn["top"]  # an attention axis, not a sum of two
    for k, (b, a) in enumerate(zip(drawn["before"], drawn["after"], strict=True)):
        assert b[1] <= a[0] + 0.5 or a[1] <= b[0] + 0.5, (k, b, a)  # side by side, not on top of each other
        for box, value in ((b, before[k]), (a, after[k])):
            if value * drawn["perUnit"] > 2:  # a bar tall enough to measure
                assert box[3] == pytest.approx(drawn["zero"], abs=1.5), (k, box)  # from 0
                assert box[3] - box[2] == pytest.approx(value * drawn["perUnit"], abs=1.5), (k, box, value)


def test_the_layer_overview_legend_names_queries_and_keys(qk_context):
    fig, _ = views.qk_layer_view(None, PARAMS)
    assert [t.name for t in fig.data if t.showlegend] == ["queries", "keys"]
