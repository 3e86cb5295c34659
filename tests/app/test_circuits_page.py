"""The Circuits page in Chromium: the built-in IOI prompt runs as a job, the grid shows the analysis's direct
logit attribution of every head on a scale centred at 0, a click on a head chooses it (into the URL) and the
composition panel then shows what feeds that head, and a link reopens the same view without computing."""

from __future__ import annotations

import numpy as np
import pytest

from tests.app.browsing import click_cell, cut_off_titles, settle

pytestmark = [pytest.mark.browser, pytest.mark.integration]

DLA, OTHERS, COMPOSITION = "#circ-dla", "#circ-dla-others", "#circ-composition"


def plot_data(page, selector: str) -> list:
    return page.evaluate("s => document.querySelector(s + ' .js-plotly-plot').data", selector)


def banner(page) -> str:
    return page.locator("#hs-error").inner_text().strip()


@pytest.mark.timeout(900)  # the first run computes the composition scores (20-40 s alone, more under load)
def test_circuits_journey(server, page, real_model):
    from headscope.analysis.circuits import circuits
    from headscope.analysis.composition import composition_scores
    from headscope.analysis.patching_pairs import pair_by_id

    url, _, home = server
    pair = pair_by_id("ioi-mary-john")
    page.goto(url + "circuits")
    assert page.input_value("#circ-text", timeout=240_000) == pair.clean  # prefilled with the built-in IOI prompt
    assert (page.input_value("#circ-answer-first"), page.input_value("#circ-answer-second")) == pair.answers

    # a multi-token answer: the analysis's message in the banner, nothing run
    page.fill("#circ-answer-first", " Maryland Johnson")
    page.click("#circ-run")
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('tokens')",
                           timeout=240_000)
    assert "Maryland" in banner(page) and "one token" in banner(page)
    page.fill("#circ-answer-first", pair.answers[0])

    page.click("#circ-run")
    page.wait_for_function("new URLSearchParams(location.search).has('circ')", timeout=600_000)
    page.wait_for_selector(DLA + " .heatmaplayer .hm", timeout=120_000)
    assert banner(page) == ""
    expected = circuits(real_model, pair.clean, list(pair.answers), composition=False).attribution
    trace = plot_data(page, DLA)[0]
    z = np.array(trace["z"], dtype=float)
    np.testing.assert_allclose(z, expected.heads(), rtol=1e-6, atol=1e-9)  # the analysis's numbers, every head
    assert trace["zmid"] == 0  # diverging, centred at 0
    assert f"{expected.logit_diff:.3f}" in page.locator(DLA + " .gtitle").text_content()
    others = plot_data(page, OTHERS)[0]
    assert others["y"][0] == "embed" and others["y"][-1] == "bias" and len(others["y"]) == 32
    np.testing.assert_allclose(others["x"][1:31], expected.mlps(), rtol=1e-6, atol=1e-9)
    info = page.inner_text("#circ-info")
    assert f"{expected.logit_diff:.3f}" in info and "components sum to" in info
    top = np.unravel_index(int(np.argmax(np.abs(expected.heads()))), expected.heads().shape)
    assert f"feed head {top[0]}.{top[1]}" in page.locator(COMPOSITION + " .gtitle").text_content()

    settle(page)
    assert cut_off_titles(page) == []  # every title and colour bar fits at 1400 px
    assert page.locator(OTHERS + " .main-svg").first.bounding_box()["height"] >= 16 * 32  # a readable bar each

    # a click on head 18.6 chooses it: into the URL, and the composition panel shows what feeds it
    click_cell(page, "circ-dla", 6, 18, 9, 30)
    page.wait_for_function("location.search.includes('layer=18') && location.search.includes('head=6')")
    page.wait_for_function("(document.querySelector('#circ-composition .gtitle')?.textContent || '')"
                           ".includes('feed head 18.6')")
    settle(page)
    k_trace = plot_data(page, COMPOSITION)[1]  # Q, K, V: the K bars
    scores = composition_scores(real_model).k[:18, :, 18, 6]
    best = np.unravel_index(int(np.argmax(scores)), scores.shape)
    assert k_trace["y"][0] == f"{best[0]}.{best[1]}"
    assert k_trace["x"][0] == pytest.approx(scores[best], rel=1e-5)
    assert "18.6" in page.inner_text("#circ-info")

    # the link reopens the same view (the stored result, nothing computed)
    link = page.evaluate("location.href")
    page.goto(link)
    page.wait_for_function("(document.querySelector('#circ-composition .gtitle')?.textContent || '')"
                           ".includes('feed head 18.6')", timeout=120_000)
    np.testing.assert_allclose(np.array(plot_data(page, DLA)[0]["z"], dtype=float), expected.heads(), rtol=1e-6)

    # hostile links: each is a message in the banner, never a traceback, and the page stays usable
    key = page.evaluate("new URLSearchParams(location.search).get('circ')")
    for search, said in ((f"?circ={key}&layer=99&head=0", "Layer 99"), (f"?circ={key}&layer=3&head=42", "Head 42"),
                         ("?circ=deadbeef00", "No stored circuit result"), ("?circ=../../etc", "not valid"),
                         (f"?circ={key}&layer=-1&head=0", "layer")):
        page.goto(url + "circuits" + search)
        page.wait_for_function("t => (document.querySelector('#hs-error')?.innerText || '').includes(t)", arg=said,
                               timeout=120_000)
        assert "Traceback" not in banner(page) and str(home) not in banner(page), banner(page)  # no server path


EDGES = "#circ-edges"
EDGE_TRACES = ("s => [...document.querySelector(s + ' .js-plotly-plot').data].filter(t => t.customdata)"
               ".map(t => ({edge: t.customdata[0], colour: t.line.color, width: t.line.width}))")


@pytest.mark.timeout(900)  # the first run of a module computes the composition scores (20-40 s, more under load)
def test_circuits_edge_graph(server, browser, real_model):
    """The default pair with its prefilled corrupted text: the graph draws the analysis's top 30 edges, the
    first one the analysis's first, at 1280 px with nothing cut off; a pair that cannot be compared is a
    message in the banner and no edges."""
    from headscope.analysis.edge_attribution import edge_attribution
    from headscope.analysis.patching_pairs import pair_by_id
    from headscope.app.views.circuits import EDGES_SHOWN, SITE_COLOURS
    from tests.app.browsing import open_page

    url, _, home = server
    pair = pair_by_id("ioi-mary-john")
    for page in open_page(browser, 1280, 1000):
        page.goto(url + "circuits")
        assert page.input_value("#circ-corrupted", timeout=240_000) == pair.corrupted  # prefilled
        page.click("#circ-run")
        page.wait_for_function("new URLSearchParams(location.search).has('circ')", timeout=600_000)
        page.wait_for_function("s => (document.querySelector(s + ' .gtitle')?.textContent || '').includes('edges')",
                               arg=EDGES, timeout=120_000)
        settle(page)
        assert banner(page) == ""
        assert "with the edges" in page.inner_text("#circ-status")
        expected = edge_attribution(real_model, pair.clean, pair.corrupted, list(pair.answers))
        drawn = page.evaluate(EDGE_TRACES, EDGES)
        assert len(drawn) == EDGES_SHOWN
        assert tuple(drawn[0]["edge"][:3]) == expected.rows(1)[0][:3]  # the top edge shown is the analysis's top
        assert drawn[0]["edge"][3] == pytest.approx(expected.rows(1)[0][3], rel=1e-6)
        assert [tuple(d["edge"][:3]) for d in drawn] == [r[:3] for r in expected.rows(EDGES_SHOWN)]
        assert all(d["colour"] == SITE_COLOURS[d["edge"][2]] for d in drawn)
        title = page.locator(EDGES + " .gtitle").text_content()
        assert f"Top {EDGES_SHOWN} of {len(expected.scores)} edges" in title
        assert cut_off_titles(page) == []  # readable at 1280 px: every title fits
        assert page.locator(EDGES + " .main-svg").first.bounding_box()["width"] >= 1100

        # the link reopens the graph and refills the corrupted field from the stored result
        page.goto(page.evaluate("location.href"))
        page.wait_for_function("s => (document.querySelector(s + ' .gtitle')?.textContent || '').includes('edges')",
                               arg=EDGES, timeout=120_000)
        assert page.input_value("#circ-corrupted") == pair.corrupted
        assert tuple(page.evaluate(EDGE_TRACES, EDGES)[0]["edge"][:3]) == expected.rows(1)[0][:3]

        # hostile corrupted texts: each a message in the banner (nothing run), the page still usable
        hostile = (("When Mary and John went to the store, Mary Elizabeth gave a drink to", "is 15 tokens"),
                   (pair.clean, "same tokens"),
                   ("Mary", "is 1 token "), ("\u202eWhen Mary and John went to the store, Mary gave a drink to",
                                             "is 16 tokens"),
                   ("<script>alert(1)</script>", "is 10 tokens"), ("word " * 20_000, "The corrupted text: "))
        for corrupted, said in hostile:
            page.fill("#circ-corrupted", corrupted)
            page.click("#circ-run")
            page.wait_for_function("t => (document.querySelector('#hs-error')?.innerText || '').includes(t)",
                                   arg=said, timeout=240_000)
            assert "Traceback" not in banner(page) and str(home) not in banner(page), banner(page)
        # an empty corrupted text: no edges asked for, the run succeeds and the graph says how to get them
        page.fill("#circ-corrupted", "   ")
        page.click("#circ-run")
        page.wait_for_function("s => (document.querySelector(s)?.innerText || '').includes('Give a corrupted text')",
                               arg=EDGES, timeout=240_000)
        assert banner(page) == ""


EDGE_PANEL = "#circ-edge-patch"
# the pixel of an edge's middle point (its marker): the trace whose customdata names the edge, through the axes
EDGE_POINT = """([s, edge]) => {
  const gd = document.querySelector(s + ' .js-plotly-plot');
  gd.scrollIntoView({block: 'center'});  // a mouse click lands only inside the viewport
  const i = gd.data.findIndex(t => t.customdata && t.customdata[0].slice(0, 3).join('|') === edge.join('|'));
  const t = gd.data[i], fl = gd._fullLayout, box = gd.getBoundingClientRect();
  return [box.left + fl._size.l + fl.xaxis.l2p(t.x[1]), box.top + fl._size.t + fl.yaxis.l2p(t.y[1])];
}"""
REFUSED = "refused this request"
DELTA = r"Δ logit diff = ([+-][0-9.]+)"


def _post_edge_click(url: str, click, search: str, timeout: float = 120) -> tuple[int, str]:
    """A raw request to the edge click's job callback, as the renderer sends it, followed until it answers:
    (status, the text of the last answer)."""
    import json
    import time
    import urllib.error
    import urllib.parse
    import urllib.request

    def post(path, body):
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    with urllib.request.urlopen(url + "_dash-dependencies", timeout=timeout) as r:
        deps = json.loads(r.read())
    dep = next(d for d in deps if any(i["id"] == "circ-edges" and i["property"] == "clickData" for i in d["inputs"]))
    outputs = [{"id": o.rpartition(".")[0], "property": o.rpartition(".")[2]} for o in dep["output"].strip(".").split("...")]
    body = {"output": dep["output"], "outputs": outputs, "changedPropIds": ["circ-edges.clickData"],
            "inputs": [{"id": "circ-edges", "property": "clickData", "value": click}],
            "state": [{"id": "circ-hs-url", "property": "search", "value": search}]}
    status, text = post("_dash-update-component", body)
    deadline = time.time() + timeout
    while status == 200 and '"cacheKey"' in text and time.time() < deadline:
        first = json.loads(text)
        query = urllib.parse.urlencode({"cacheKey": first["cacheKey"], "job": first["job"]})
        while time.time() < deadline:
            status, text = post(f"_dash-update-component?{query}", body)
            if status != 200 or '"response"' in text:
                return status, text
            time.sleep(0.3)
    return status, text


@pytest.mark.timeout(900)  # the first run of a module computes the composition scores (20-40 s, more under load)
def test_circuits_edge_click_path_patches(server, browser, real_model):
    """A click on the top head → head edge path-patches it as a job: the panel's Δ equals a direct
    ``path_patching`` call (noising, MLPs frozen: the sign of edge attribution) and names the edge's estimate;
    a second click reads it back; a → logits edge is one line saying it cannot be patched exactly; forged
    raw requests are messages, never a 500."""
    import re

    from headscope.analysis.edge_attribution import edge_attribution
    from headscope.analysis.patching_pairs import pair_by_id
    from headscope.analysis.path_patching import path_patching
    from tests.app.browsing import open_page

    url, _, home = server
    pair = pair_by_id("ioi-mary-john")
    expected = edge_attribution(real_model, pair.clean, pair.corrupted, list(pair.answers))
    top = next(r for r in expected.rows(30) if r[2] in "qkv" and r[0][:1].isdigit())
    to_logits = next(r for r in expected.rows(30) if r[2] == "logits")
    for page in open_page(browser, 1280, 1000):
        page.goto(url + "circuits")
        page.wait_for_selector("#circ-corrupted", timeout=240_000)
        page.click("#circ-run")
        page.wait_for_function("new URLSearchParams(location.search).has('circ')", timeout=600_000)
        page.wait_for_function("s => (document.querySelector(s + ' .gtitle')?.textContent || '').includes('edges')",
                               arg=EDGES, timeout=120_000)
        settle(page)
        page.mouse.click(*page.evaluate(EDGE_POINT, [EDGES, list(top[:3])]))
        page.wait_for_function("s => (document.querySelector(s)?.innerText || '').includes('Δ logit diff')",
                               arg=EDGE_PANEL, timeout=240_000)
        panel = page.inner_text(EDGE_PANEL)
        (s, r) = (tuple(int(x) for x in name.split(".")) for name in top[:2])
        exact = path_patching(real_model, pair.clean, pair.corrupted, list(pair.answers), [s], [r], site=top[2],
                              direction="noise", freeze_mlps=True)
        assert f"{top[0]} → " in panel and f"{top[1]} ({top[2]})" in panel, panel
        assert float(re.search(DELTA, panel)[1]) == pytest.approx(exact.raw - exact.clean, abs=1e-5)
        assert f"estimated {top[3]:+.6f}" in panel
        assert banner(page) == ""

        page.mouse.click(*page.evaluate(EDGE_POINT, [EDGES, list(to_logits[:3])]))
        page.wait_for_function("s => (document.querySelector(s)?.innerText || '').includes('cannot be patched')",
                               arg=EDGE_PANEL, timeout=240_000)
        line = page.inner_text(EDGE_PANEL)
        assert "\n" not in line.strip() and f"{to_logits[0]} → logits" in line

        page.mouse.click(*page.evaluate(EDGE_POINT, [EDGES, list(top[:3])]))  # again: read back from the store
        page.wait_for_function("s => (document.querySelector(s)?.innerText || '').includes('Δ logit diff')",
                               arg=EDGE_PANEL, timeout=60_000)
        assert float(re.search(DELTA, page.inner_text(EDGE_PANEL))[1]) == pytest.approx(exact.raw - exact.clean,
                                                                                        abs=1e-5)
        search = page.evaluate("location.search")

    def click(*edge):
        return {"points": [{"customdata": list(edge)}]}

    hostile = [  # (clickData, search, what the answer must say; None: any message or a refusal)
        (click("99.0", "100.1", "q"), search, "Layer 99"),
        (click("5.1", "3.1", "q"), search, "No receiver lies in a layer after a sender"),
        (click("1.99", "3.1", "q"), search, "Head 99"),
        (click("1.1", "3.9", "k"), search, "Head 9"),
        (click("a.b", "3.1", "q"), search, "not a head"),
        (click("-1.0", "3.1", "q"), search, "not a head"),
        (click("01.1", "3.1", "q"), search, "not a head"),
        (click("1.1", "3.1", "z"), search, "Unknown site"),
        (click("embed", "3.1", "q"), search, "cannot be patched exactly"),
        (click("mlp.2", "3.1", "v"), search, "cannot be patched exactly"),
        (click("1.1", "3.1", "q"), "", "No circuit result yet"),
        (click("1.1", "3.1", "q"), "?circ=deadbeef00", "No stored circuit result"),
        (click("1.1", "3.1", "q"), "?circ=../../etc", None),
        (click(1, 3, "q"), search, "names no edge"),
        (click(None, None, None), search, "names no edge"),
        (click("9" * 5000, "3.1", "q"), search, "names no edge"),
        ({"points": [{"customdata": "1.1"}]}, search, "names no edge"),
        ({"points": "x"}, search, "names no edge"),
        ([1, 2], search, REFUSED),
        (1.5, search, REFUSED),
        ("[" * 5000, search, REFUSED),
        (click("1.1", "3.1", "q"), 12, None),
    ]
    held = 0  # REFUSED: not the shape a graph's clickData has, so the server's check of each control's values says 400
    for value, query, said in hostile:
        status, text = _post_edge_click(url, value, query)
        assert status != 500 and "Traceback" not in text and str(home) not in text, (value, status, text[:300])
        assert status in (200, 204, 400), (value, status, text[:300])
        if said is not None:
            assert said in text, (str(value)[:80], text[:400])
        held += 1
    assert held == len(hostile) == 22
