"""#42 item 4 in real Chromium: the Heads page's NIAH accuracy and the Ablation page's NIAH curve show
n and the 95 % Wilson interval, read off the page (the chip's text, the heatmap's hover text, the
curve's error bars through the plotly graph's own ``data``) and equal to
:func:`headscope.analysis.intervals.wilson` of the counts. The server and browser are
tests/app/conftest.py's, the steps tests/app/browsing.py's.

Two own needles in the passkey haystack at 160 tokens: one SmolLM2 answers, one whose answer is in no
text (never answered), so the cell is 1 of 2 and its interval is wide and not at an edge."""

from __future__ import annotations

import pytest

from headscope.analysis.intervals import wilson
from tests.app.browsing import select_option, wait_title

pytestmark = [pytest.mark.browser, pytest.mark.integration]

NEEDLES = ("The secret passkey is 7731. | What is the secret passkey? | 7731\n"
           "The secret passkey is 7731. | What is the secret passkey? | walrus")
PLOT_DATA = "s => document.querySelector(s + ' .js-plotly-plot')?.data || null"


def test_heads_and_ablation_pages_show_n_and_the_wilson_interval_of_niah_accuracy(server, page):
    url, proc, _ = server
    page.goto(url + "heads")
    page.wait_for_selector("#hs-heads-run")
    page.fill("#hs-heads-custom-needles", NEEDLES)
    page.fill("#hs-heads-lengths", "160")
    page.fill("#hs-heads-depths", "50")
    select_option(page, "hs-heads-haystack", "passkey")
    page.click("#hs-heads-run")
    page.wait_for_function("location.search.includes('sweep=')", timeout=240_000)
    one_of_two = wilson(1, 2)
    page.wait_for_selector("#hs-heads-accuracy", timeout=120_000)
    assert page.inner_text("#hs-heads-accuracy") == f"NIAH accuracy {one_of_two.text()}"
    assert one_of_two.text() == "0.50 [0.09, 0.91] n=2"
    assert "1/2 trials answered, accuracy 0.50 [0.09, 0.91] n=2 (95 % Wilson)" in page.inner_text("#hs-heads-status")
    wait_title(page, "hs-heads-niah", "1 of 2 trials answered, 0.50 [0.09, 0.91] n=2 (95 % Wilson)")
    heat = page.evaluate(PLOT_DATA, "#hs-heads-niah")[0]
    assert heat["customdata"] == [["1 of 2 answered: 0.50 [0.09, 0.91] n=2 (95 % Wilson)"]]
    assert heat["text"] == [["50%<br>1/2"]]

    # the paper's experiment on this sweep: NIAH accuracy, top-k against random heads
    page.click("#hs-heads-ablate-link")
    page.wait_for_function("location.pathname == '/ablation' && location.search.includes('by=retrieval')")
    wait_title(page, "hs-abl-grid", "Retrieval score (sweep")
    page.fill("#hs-abl-curve-ks", "0,1")
    page.fill("#hs-abl-curve-seeds", "2")
    page.fill("#hs-abl-curve-control", "1")
    page.check("#hs-abl-curve-metric input[value='niah']")
    page.click("#hs-abl-curve-run")
    page.wait_for_function("location.search.includes('curve=')", timeout=300_000)
    wait_title(page, "hs-abl-curve", "on 2 prompts")
    data = page.evaluate(PLOT_DATA, "#hs-abl-curve")
    top = next(t for t in data if t["name"] == "top-k heads")
    values = [wilson(round(y * 2), 2) for y in top["y"]]
    assert values[0] == one_of_two  # k = 0: nothing ablated, the sweep's own accuracy
    assert top["error_y"]["array"] == pytest.approx([p.high - p.value for p in values])
    assert top["error_y"]["arrayminus"] == pytest.approx([p.value - p.low for p in values])
    assert top["customdata"] == [p.text() for p in values]
    band = next(t for t in data if t["name"] == "random: lowest to highest of 2 seeds")
    assert band["fill"] == "toself"
    mean = next(t for t in data if t["name"].endswith("(mean)"))
    pooled = wilson(round(mean["y"][0] * 4), 4)  # k = 0 for both seeds: 2 seeds × 2 prompts
    assert mean["customdata"][0] == pooled.text() == "0.50 [0.15, 0.85] n=4"
    status = page.inner_text("#hs-abl-curve-status")
    assert "n=2" in status and "n=4 over all seeds' prompts" in status and "95 % Wilson" in status, status
    assert proc.poll() is None
