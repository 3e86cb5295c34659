"""The Flow page: its strips are the numbers the faithfulness chart scores, and (in real Chromium
against a real server on the embedded model) a click picks the target, every strip has a shared,
numbered colour scale, and the sink option is explained beside it."""

from __future__ import annotations

import json

import numpy as np
import pytest

from headscope.analysis.attribution import (
    CORRECTED_METHODS,
    PLAIN_METHODS,
    RELEVANCE_METHODS,
    attribute,
    spearman,
)
from headscope.analysis.capture import capture
from headscope.analysis.rollout import FUSIONS
from headscope.app.views import flow as views

TEXT = "The keys to the old wooden cabinet are"


@pytest.fixture(scope="module")
def flow_run(real_model):
    """A run as the page stores it (float16 patterns), on the embedded model."""
    return capture(real_model, TEXT)


@pytest.mark.integration
@pytest.mark.parametrize("drop_sink", [False, True], ids=["sink-kept", "sink-dropped"])
@pytest.mark.parametrize("fusion", FUSIONS)
def test_each_strip_is_exactly_what_the_faithfulness_chart_scores(real_model, flow_run, fusion, drop_sink):
    run = flow_run
    target = run.n_tokens - 2
    params = {"target": target, "fusion": fusion, "drop_sink": drop_sink}
    on_input = views.attribution_for(run, target, fusion, drop_sink)  # what "Faithfulness on this input" ranks
    _, rho_rows = views.faithfulness_input_view(run, params)
    rho = {r["method"]: r["spearman"] for r in rho_rows}
    # The built-in set's path: each prompt captured afresh in float32, same definition.
    fresh = attribute(real_model, run.token_ids, position=target, fusion=fusion, drop_sinks=(0,) if drop_sink else ())
    for method in RELEVANCE_METHODS:
        _, rows = views.relevance_view(run, {**params, "method": method})
        strip = np.array([r["relevance"] for r in rows])
        assert strip.shape == (target + 1,)
        np.testing.assert_array_equal(strip, on_input.scores[method], err_msg=method)
        assert rho[method] == pytest.approx(spearman(strip, on_input.scores["ablation"]), abs=1e-12), method
        np.testing.assert_allclose(strip, fresh.scores[method], atol=3e-3, err_msg=method)  # float16 vs float32


@pytest.mark.integration
def test_the_options_change_the_scored_raw_attention(flow_run):
    """The combinations above are not all one number: fusion and the sink change raw attention."""
    target = flow_run.n_tokens - 1
    shown = {(f, d): views.token_relevance(flow_run, "attention", target, f, d) for f in FUSIONS for d in (False, True)}
    assert shown[("mean", True)][0] == 0.0 < shown[("mean", False)][0]
    assert not np.allclose(shown[("max", False)], shown[("mean", False)], atol=1e-3)
    assert not np.allclose(shown[("min", False)], shown[("mean", False)], atol=1e-3)


def test_a_click_on_a_strip_cell_names_its_token_and_empty_cells_name_none():
    from headscope.app.figures import token_strip_position

    assert token_strip_position({"x": 2, "y": 1, "text": "·to"}) == 18
    assert token_strip_position({"x": 2.0, "y": 0, "text": "·to"}) == 2
    assert token_strip_position({"x": 9, "y": 1, "text": ""}) is None  # after the last token
    assert token_strip_position({"x": 16, "y": 0, "text": "a"}) is None
    assert token_strip_position({"x": "2", "y": 0, "text": "a"}) is None
    assert token_strip_position(None) is None


# ---------------------------------------------------------------------------------------------
# In real Chromium (the browser fixture and steps: tests/app/conftest.py, tests/app/browsing.py)


def strip(method: str) -> str:
    """The selector of one strip's graph (Dash writes a dict id as JSON with sorted keys)."""
    return "[id='" + json.dumps({"method": method, "type": "hs-flow-strips"}, separators=(",", ":")) + "']"


def run_flow(page, url: str) -> None:
    page.goto(url + "flow")
    page.fill("#flow-hs-text", TEXT)
    page.click("#flow-hs-run")
    page.wait_for_function("(document.querySelector('#hs-flow-info')?.innerText || '').includes('target: token')")
    page.wait_for_load_state("networkidle")


def wait_target(page, pos: int) -> None:
    page.wait_for_function("p => new URLSearchParams(location.search).get('target') === String(p)", arg=pos)
    page.wait_for_function("p => (document.querySelector('#hs-flow-info')?.innerText || '').includes(`target: token ${p} `)",
                           arg=pos)
    for method in RELEVANCE_METHODS:
        page.wait_for_function("([s, p]) => document.querySelector(`${s} .gtitle`)?.textContent.includes(`→ token ${p} `)",
                               arg=[strip(method), pos])


@pytest.mark.browser
@pytest.mark.integration
def test_clicking_a_token_in_the_list_makes_it_the_target(server, page):
    url, proc, _home = server
    run_flow(page, url)
    page.locator("#hs-flow-tokens button").nth(3).click()
    wait_target(page, 3)
    assert page.input_value("#hs-flow-target") == "3"  # the typed-number fallback follows
    assert page.locator("#hs-flow-tokens button.hs-selected").get_attribute("title") == "position 3"
    page.go_back()  # the URL kept it, so history steps back to the last token
    page.wait_for_function("!new URLSearchParams(location.search).has('target')")
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
def test_clicking_a_token_in_a_strip_makes_it_the_target(server, page):
    url, proc, _home = server
    run_flow(page, url)
    graph = page.locator(strip("rollout"))
    graph.scroll_into_view_if_needed()
    # The cell of position 2 (column 2 of the first row), located through the figure's own axes.
    x, y = page.evaluate("""s => { const el = document.querySelector(s + ' .js-plotly-plot');
        const xa = el._fullLayout.xaxis, ya = el._fullLayout.yaxis, box = el.getBoundingClientRect();
        return [box.left + xa._offset + xa.d2p(2), box.top + ya._offset + ya.d2p(0)]; }""", strip("rollout"))
    page.mouse.click(x, y)
    wait_target(page, 2)
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
def test_every_strip_has_a_numbered_colour_bar_on_one_shared_scale(server, page):
    url, proc, _home = server
    run_flow(page, url)
    scales = []
    for method in PLAIN_METHODS:
        sel = strip(method) + " .js-plotly-plot"
        page.wait_for_selector(strip(method) + " .colorbar")
        ticks = page.locator(strip(method) + " .colorbar .cbaxis text").all_text_contents()
        assert len(ticks) >= 3 and all(float(t) >= 0 for t in ticks), ticks
        title = page.locator(strip(method) + " .colorbar .cbtitle").text_content()
        assert "shared scale" in title
        scales.append(page.evaluate("s => { const t = document.querySelector(s).data[0]; return [t.zmin, t.zmax]; }",
                                    sel))
    assert scales[0][0] == 0 and all(s == scales[0] for s in scales)  # one scale for all three
    # The top is the largest value any strip shows, so a strip with smaller values is not stretched to it.
    tops = [max(v for row in page.evaluate("s => document.querySelector(s).data[0].z", strip(method) + " .js-plotly-plot")
                for v in row if v is not None) for method in PLAIN_METHODS]
    assert scales[0][1] == pytest.approx(max(tops))
    assert min(tops) < 0.9 * scales[0][1]
    # The position-corrected strips (ratios, normalised) share a scale of their own, labelled so.
    corrected = []
    for method in CORRECTED_METHODS:
        page.wait_for_selector(strip(method) + " .colorbar")
        assert "corrected" in page.locator(strip(method) + " .colorbar .cbtitle").text_content()
        corrected.append(page.evaluate("s => { const t = document.querySelector(s).data[0]; return [t.zmin, t.zmax]; }",
                                       strip(method) + " .js-plotly-plot"))
    assert corrected[0] == corrected[1] != scales[0]
    assert "uniform causal attention" in page.locator("#hs-flow-correction-note").inner_text()
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
def test_the_sink_option_is_explained_beside_it(server, page):
    url, proc, _home = server
    run_flow(page, url)
    note = page.locator("#hs-flow-sink-note")
    assert note.is_visible()
    assert "Position 0 is the attention sink" in note.inner_text() and "renormalised" in note.inner_text()
    # Beside the option: in the same row of options as the checkbox.
    assert page.locator(".hs-options").filter(has=page.locator("#hs-flow-sink")).filter(
        has=page.locator("#hs-flow-sink-note")).count() == 1
    # What the sink does to this picture: its share of rollout, gone when it is dropped.
    kept = page.inner_text("#hs-flow-sink-share")
    share = int(kept.split("holds ")[1].split("%")[0])
    assert 50 <= share <= 100, kept
    page.check("#hs-flow-sink input")
    page.wait_for_function("location.search.includes('sink=1')")
    page.wait_for_function("(document.querySelector('#hs-flow-sink-share')?.innerText || '').includes('dropped')")
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
def test_a_run_past_the_flow_limit_draws_the_other_strips_and_says_why(server, page):
    """Past HEADSCOPE_MAX_FLOW_TOKENS (128) flow is not computed: its two strips say why and the rest
    draw. The page said "Something went wrong (KeyError)" and drew no strip at all (a 347-token run
    brought from the Attention page)."""
    url, proc, _home = server
    page.goto(url + "flow")
    page.fill("#flow-hs-text", " ".join([TEXT + " on the table."] * 14), timeout=240_000)
    page.click("#flow-hs-run")
    page.wait_for_function("(document.querySelector('#hs-flow-info')?.innerText || '').includes('target: token')"
                           " || (document.querySelector('#hs-error')?.innerText || '').includes('went wrong')",
                           timeout=240_000)
    assert "Something went wrong" not in page.inner_text("#hs-error")
    for method in ("attention", "rollout", "rollout_debiased"):
        page.wait_for_selector(strip(method) + " .js-plotly-plot .gtitle")
    banner = page.inner_text("#hs-error")
    assert "Something went wrong" not in banner and "limited to 128 tokens" in banner, banner
    for method in ("flow", "flow_debiased"):
        assert "limited to 128 tokens" in page.locator(strip(method)).text_content(), method
    assert proc.poll() is None


# --- what a strip's colour means: one unit for the strips that share a scale (#38 item 17) ---

@pytest.fixture(scope="module")
def tiny_flow_run(tiny_model):
    return capture(tiny_model, "The keys to the old wooden cabinet are on the table.", pattern_dtype="float32")


@pytest.mark.parametrize("drop_sink", [False, True], ids=["sink-kept", "sink-dropped"])
def test_strips_sharing_a_scale_are_coloured_in_one_unit_the_share_of_the_targets_relevance(tiny_flow_run, drop_sink):
    """Raw attention and rollout rows sum to 1, flow's max-flow values do not: coloured as they are on
    one scale, a flow colour and a rollout colour meant different things. Every strip is coloured by
    each token's share of the method's total for the target (each strip's colours sum to 1), the
    colour bar says so, the hover keeps the method's own value beside the share, the export holds it."""
    run = tiny_flow_run
    target = run.n_tokens - 2
    params = {"target": target, "fusion": "mean", "drop_sink": drop_sink}
    flow = views.token_relevance(run, "flow", target, "mean", drop_sink)
    assert abs(flow.sum() - 1) > 0.05  # the case at hand: flow's values are not a distribution
    tops = {}
    for method in RELEVANCE_METHODS:
        fig, rows = views.relevance_view(run, {**params, "method": method})
        z = np.array([v for row in fig.data[0].z for v in row if v is not None], dtype=float)
        own = views.token_relevance(run, method, target, "mean", drop_sink)
        assert z.sum() == pytest.approx(1, abs=1e-9), method
        np.testing.assert_allclose(z[: target + 1], own / own.sum(), rtol=1e-12, err_msg=method)
        assert "share of" in fig.data[0].colorbar.title.text, method
        assert [r["relevance"] for r in rows] == pytest.approx(own.tolist()), method  # the export: the method's own
        assert "share of" in fig.data[0].hovertemplate, method
        tops[method] = fig.data[0].zmax
    # one scale per group, its top the largest share any of the group's strips shows
    assert len({tops[m] for m in PLAIN_METHODS}) == 1 and len({tops[m] for m in CORRECTED_METHODS}) == 1


def test_the_page_says_what_the_colour_means(tmp_path):
    import dash

    from headscope.analysis.store import Store
    from headscope.app.context import AppContext
    from headscope.app.server import create_app

    create_app(AppContext(store=Store(tmp_path / "store")))  # the pages register with an app
    flow_page = next(p for p in dash.page_registry.values() if p["path"] == "/flow")  # as the router has it
    hint = " ".join(_texts(flow_page["layout"]()))
    assert "share of" in hint and "max-flow values" in hint and "divided by their sum" in hint, hint


def _texts(component) -> list[str]:
    out = []
    children = getattr(component, "children", None)
    if isinstance(children, str):
        out.append(children)
    elif isinstance(children, list | tuple):
        for child in children:
            out += [child] if isinstance(child, str) else _texts(child)
    elif children is not None:
        out += _texts(children)
    return out
