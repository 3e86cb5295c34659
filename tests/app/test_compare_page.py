"""The Compare page (``/compare``) in real Chromium against a real ``headscope serve`` on the embedded
model: two stored runs of equal length chosen from the lists, the grids and the largest changes equal
to :func:`analysis.run_comparison.compare_runs` worked here from the runs' exported patterns, a clicked
head's change in attention, a run of another length refused in the page, and the export's numbers."""

from __future__ import annotations

import csv
import io
import json
import os
import sys
import zipfile

import numpy as np
import pytest

from tests.app.test_browser import browser, cut_off_titles, page, select_option, start_server  # noqa: F401

TEXTS = ("The capital of France is Paris.", "The capital of Italy is Rome.", "A longer text of another length here.")
GRIDS = "#hs-cmp-grids"


@pytest.fixture(scope="module")
def server(tmp_path_factory, real_model):
    """Three stored runs (two of 7 tokens, one longer), captured here into the server's store."""
    from analysis.statistics_run import capture_for_page
    from analysis.store import Store

    home = tmp_path_factory.mktemp("compare-home")
    store = Store(home)
    runs = [capture_for_page(real_model, text, store, 512) for text in TEXTS]
    store.close()
    env = {**os.environ, "HEADSCOPE_HOME": str(home)}
    env.pop("HEADSCOPE_REDIS_URL", None)
    proc, url = start_server([sys.executable, "-m", "app.cli", "serve"], env, home / "server.log")
    yield url, proc, runs
    proc.terminate()
    proc.wait(timeout=30)


def plot_data(page, selector: str) -> list:
    return page.evaluate("s => document.querySelector(s + ' .js-plotly-plot').data", selector)


def previous_token_by_hand(run) -> np.ndarray:
    """(1/(n−1)) Σ_{i≥1} A[i, i−1] per head, from the run's own patterns."""
    a = np.asarray(run.patterns, dtype=np.float64)
    n = a.shape[-1]
    return np.mean([a[:, :, q, q - 1] for q in range(1, n)], axis=0)


@pytest.mark.browser
@pytest.mark.integration
def test_compare_two_runs_in_the_page(server, page):
    url, proc, (first, second, longer) = server
    assert first.n_tokens == second.n_tokens != longer.n_tokens
    # from a nav link the first run is the page's run; the second list offers only runs of its length
    page.goto(url + f"compare?run={first.key[:16]}")
    page.wait_for_function("(document.querySelector('#hs-cmp-status')?.innerText || '').includes('Choose the second')",
                           timeout=120_000)
    page.click("#hs-cmp-second")
    options = page.get_by_role("option")
    disabled = {options.nth(i).inner_text(): options.nth(i).locator("input").is_disabled()
                for i in range(options.count())}
    assert len(disabled) == 3
    assert [off for label, off in disabled.items() if longer.key[:8] in label] == [True], disabled
    assert [off for label, off in disabled.items() if second.key[:8] in label] == [False], disabled
    page.keyboard.press("Escape")
    select_option(page, "hs-cmp-second", second.key[:8])
    select_option(page, "hs-cmp-metric", "Previous-token")
    page.wait_for_function("(document.querySelector('#hs-cmp-status')?.innerText || '').includes('differ at')",
                           timeout=120_000)
    status = page.inner_text("#hs-cmp-status")
    assert status.startswith("Two prompts on one model, 7 tokens") and "3: ·France → ·Italy" in status

    # the grids: both runs' scores and the change, worked by hand from the patterns
    page.wait_for_function(f"(document.querySelector('{GRIDS} .js-plotly-plot')?.layout?.title?.text || '')"
                           ".startsWith('Previous-token')", timeout=60_000)
    data = plot_data(page, GRIDS)
    by_hand = [previous_token_by_hand(first), previous_token_by_hand(second)]
    for trace, expected in zip(data, [*by_hand, by_hand[1] - by_hand[0]], strict=True):
        np.testing.assert_allclose(np.array(trace["z"], dtype=float), expected, atol=1e-5)
    change = by_hand[1] - by_hand[0]
    layer, head = np.unravel_index(np.argmax(np.abs(change)), change.shape)
    top = page.locator("#hs-cmp-top tbody tr").first.inner_text().split()
    assert top[0] == f"{layer}.{head}" and float(top[-1]) == pytest.approx(change[layer, head], abs=1e-4)
    assert f"second={second.key[:16]}" in page.url and "metric=previous_token" in page.url

    # a clicked head: its change in attention, second − first, below. Two heads clicked in quick
    # succession on two of the grids (first, then change): the page ends on the second one clicked
    page.locator(GRIDS).scroll_into_view_if_needed()
    where = """([s, axis, x, y]) => { const el = document.querySelector(s + ' .js-plotly-plot');
        const xa = el._fullLayout['xaxis' + axis], ya = el._fullLayout['yaxis' + axis], box = el.getBoundingClientRect();
        return [box.left + xa._offset + xa.d2p(x), box.top + ya._offset + ya.d2p(y)]; }"""
    other = (int(layer) + 1) % change.shape[0], (int(head) + 1) % change.shape[1]
    page.mouse.click(*page.evaluate(where, [GRIDS, "", other[1], other[0]]))
    page.mouse.click(*page.evaluate(where, [GRIDS, "3", int(head), int(layer)]))
    page.wait_for_function(f"(document.querySelector('{GRIDS} .js-plotly-plot')?.layout?.shapes || []).length === 3"
                           f" && document.querySelector('{GRIDS} .js-plotly-plot').layout.shapes"
                           f".every(s => s.x0 === {int(head)} - 0.5 && s.y0 === {int(layer)} - 0.5)", timeout=60_000)
    page.wait_for_function("document.querySelector('#hs-cmp-diff .js-plotly-plot')?.data?.[0]?.type === 'heatmap'",
                           timeout=60_000)
    diff = np.array(page.evaluate("Array.from(document.querySelector('#hs-cmp-diff .js-plotly-plot')._fullData[0].z,"
                                  " row => Array.from(row))"), dtype=float)
    expected = np.asarray(second.patterns[layer, head], np.float64) - np.asarray(first.patterns[layer, head], np.float64)
    lower = np.tril(np.ones_like(expected, dtype=bool))
    np.testing.assert_allclose(diff[lower], expected[lower], atol=1e-5)
    assert cut_off_titles(page) == []  # both grids', the change's and the difference's titles fit
    assert f"layer={layer}" in page.url and f"head={head}" in page.url

    # the export: the comparison's rows with a manifest naming both runs
    with page.expect_download() as got:
        page.click("[data-export='run_comparison-csv']")
    with zipfile.ZipFile(got.value.path()) as z:
        rows = list(csv.DictReader(io.StringIO(z.read("data.csv").decode())))
        manifest = json.loads(z.read("manifest.json"))
    assert manifest["view"] == "run_comparison"
    assert (manifest["params"]["first"], manifest["params"]["second"]) == (first.key[:16], second.key[:16])
    assert manifest["params"]["metric"] == "previous_token" and manifest["model"]["name"] == "smollm2-135m"
    assert len(rows) == 270
    np.testing.assert_allclose([float(r["change"]) for r in rows], change.ravel(), atol=1e-5)

    # a link naming a run of another length: the page says why, the server lives on
    page.goto(url + f"compare?first={first.key[:16]}&second={longer.key[:16]}")
    page.wait_for_function("(document.querySelector('#hs-cmp-status')?.innerText || '').includes('token')",
                           timeout=60_000)
    assert "tokens: compare runs of equal length" in page.inner_text("#hs-cmp-status")
    assert page.inner_text("#hs-error") == ""
    page.goto(url + "compare?first=feedfacefeedface&second=00000000")
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('No stored run')",
                           timeout=60_000)
    assert proc.poll() is None
