"""The Patching page (``/patching``) in real Chromium against a real ``headscope serve`` on the embedded
model: a user's journey (refusals, Run with progress, the map and its top head, a head's per-position
map, a copied link, the CSV export) checked against :func:`headscope.analysis.patching.activation_patching` run
here, and forged choices refused at the request boundary."""

from __future__ import annotations

import csv
import io
import json
import urllib.error
import urllib.request
import zipfile

import numpy as np
import pytest

from headscope.analysis.patching import activation_patching, prompt_pair
from tests.app.browsing import cut_off_titles, select_option, settle

CLEAN = "When Mary and John went to the store, John gave a drink to"
CORRUPTED = "When Mary and John went to the store, Mary gave a drink to"
ANSWERS = (" Mary", " John")
SITE = "v"  # 30 layers × 3 key-value heads: the quickest head site on the embedded model
MAP = "#hs-pat-map"


@pytest.fixture(scope="module")
def reference(real_model):
    """What the analysis gives for the page's default pair, computed in this process (no store)."""
    return activation_patching(real_model, CLEAN, CORRUPTED, list(ANSWERS), site=SITE, attribution=True)


def banner(page) -> str:
    return page.inner_text("#hs-error")


def plot_data(page, selector: str) -> list:
    return page.evaluate("s => document.querySelector(s + ' .js-plotly-plot').data", selector)


def click_category(page, selector: str, x: str, y: str) -> None:
    """Click the cell at category (x, y), located through the figure's own axes."""
    page.locator(selector).scroll_into_view_if_needed()
    px, py = page.evaluate("""([s, x, y]) => { const el = document.querySelector(s + ' .js-plotly-plot');
        const xa = el._fullLayout.xaxis, ya = el._fullLayout.yaxis, box = el.getBoundingClientRect();
        return [box.left + xa._offset + xa.d2p(x), box.top + ya._offset + ya.d2p(y)]; }""", [selector, x, y])
    page.mouse.click(px, py)


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(600)  # a job of 90 exact patches, one of 14, and the reference, on a shared 2-core machine
def test_patching_journey(server, page, real_model, reference):
    url, proc, home = server
    page.goto(url + "patching")
    # prefilled with the IOI pair; the page says where the prompts differ, as the analysis tokenises them
    assert page.input_value("#hs-pat-clean", timeout=240_000) == CLEAN
    pair = prompt_pair(real_model, CLEAN, CORRUPTED, list(ANSWERS))
    assert pair.differ == (9,)
    page.wait_for_function("(document.querySelector('#hs-pat-differ')?.innerText || '').includes('differ at position 9')")
    assert "14 tokens each" in page.inner_text("#hs-pat-differ")

    # a built-in pair fills the form, and the page re-tokenises it; the IOI pair brings the defaults back
    select_option(page, "hs-pat-pair", "fact-capital-france-italy")
    page.wait_for_function("(document.querySelector('#hs-pat-differ')?.innerText || '').includes('France → ')")
    assert (page.input_value("#hs-pat-clean"), page.input_value("#hs-pat-corrupted"),
            page.input_value("#hs-pat-answer-clean"), page.input_value("#hs-pat-answer-corrupted")) == (
        "The capital of France is", "The capital of Italy is", " Paris", " Rome")
    select_option(page, "hs-pat-pair", "ioi-mary-john")
    page.wait_for_function("(document.querySelector('#hs-pat-differ')?.innerText || '').includes('differ at position 9')")
    assert page.input_value("#hs-pat-clean") == CLEAN and page.input_value("#hs-pat-answer-corrupted") == ANSWERS[1]

    # refusals: the analysis's own message, in the error banner (and beside the prompts before Run)
    for field, value, original in (("#hs-pat-corrupted", CORRUPTED + " her", CORRUPTED),
                                   ("#hs-pat-answer-clean", " Mary Ann", ANSWERS[0])):
        page.fill(field, value)
        with pytest.raises(ValueError) as refused:
            prompt_pair(real_model, page.input_value("#hs-pat-clean"), page.input_value("#hs-pat-corrupted"),
                        [page.input_value("#hs-pat-answer-clean"), page.input_value("#hs-pat-answer-corrupted")])
        expected = str(refused.value)
        page.click("#hs-pat-run")
        page.wait_for_function("t => (document.querySelector('#hs-error')?.innerText || '').includes(t)",
                               arg=expected[:60])
        assert banner(page).strip() == expected
        page.wait_for_function("t => (document.querySelector('#hs-pat-differ')?.innerText || '').includes(t)",
                               arg=expected)  # said beside the prompts before Run too
        page.fill(field, original)
    assert "tokens" in expected  # the multi-token answer's message

    # Run: a background job with "i of n" progress
    page.check(f"#hs-pat-site input[value='{SITE}']")
    page.click("#hs-pat-run")
    # " of 90" while it runs ("key-value head i of 90") and when done ("… 90 of 90 patched"): Dash polls
    # progress once a second, so a quick job may show only the final line (CI missed the running one)
    page.wait_for_function("(document.querySelector('#hs-pat-status')?.innerText || '').includes(' of 90')",
                           timeout=240_000)
    page.wait_for_function("new URLSearchParams(location.search).has('patching')", timeout=300_000)
    page.wait_for_selector(MAP + " .heatmaplayer .hm")
    assert banner(page).strip() == ""
    assert "model=smollm2-135m" in page.get_attribute("#hs-nav-patching", "href")  # the nav carries the model
    assert "model=smollm2-135m" in page.get_attribute("#hs-nav-attention", "href")

    # the map: diverging around 0 (denoising), labelled 0 = corrupted / 1 = clean, the analysis's numbers
    trace = plot_data(page, MAP)[0]
    z = np.array([[np.nan if v is None else v for v in row] for row in trace["z"]], dtype=float)
    np.testing.assert_allclose(z, reference.values, atol=1e-4)
    assert trace["zmin"] == pytest.approx(-trace["zmax"])
    assert "0 corrupted, 1 clean" in page.locator(MAP + " .colorbar .cbtitle").text_content()
    # the title says the metric, answers and clean/corrupted values in full; the colour bar's title fits too
    assert cut_off_titles(page) == []
    (layer, head), top_value = reference.top_units(1)[0]
    assert np.unravel_index(np.nanargmax(np.abs(z)), z.shape) == (layer, head)
    assert page.inner_text("#hs-pat-top").startswith(f"Largest effects (denoise v): kv {layer}.{head} ({top_value:.2f})")
    # attribution beside it, with the agreement numbers
    approx = np.array(plot_data(page, "#hs-pat-attribution")[0]["z"], dtype=float)
    np.testing.assert_allclose(approx, reference.attribution, atol=1e-4)
    a = reference.agreement
    numbers = page.inner_text("#hs-pat-agreement-numbers")
    assert f"Pearson {a.pearson:.3f}" in numbers and f"Spearman {a.spearman:.3f}" in numbers
    assert f"top-{a.k} overlap {a.overlap:.0%}" in numbers

    # click the top head: its per-position map
    click_category(page, MAP, str(head), str(layer))
    page.wait_for_function("new URLSearchParams(location.search).has('ppos')", timeout=240_000)
    page.wait_for_selector("#hs-pat-positions .barlayer .point", state="attached")
    assert f"head {layer}.{head}" in page.locator("#hs-pat-positions .gtitle").text_content()
    assert cut_off_titles(page) == []
    bars = plot_data(page, "#hs-pat-positions")[0]
    by_position = activation_patching(real_model, CLEAN, CORRUPTED, list(ANSWERS), site=SITE, head=(layer, head))
    np.testing.assert_allclose(np.array(bars["customdata"], dtype=float), by_position.values, atol=1e-4)

    # two quick clicks: the page ends on the second head's positions (the click is read from the mouse
    # press, assets/grid_clicks.js, not from plotly's clickData, which reports the cell its last hover
    # found and could start the first head's job again, #16)
    (l1, h1), (l2, h2) = ((2, 0), (25, 2)) if (layer, head) != (25, 2) else ((3, 0), (24, 1))
    click_category(page, MAP, str(h1), str(l1))
    click_category(page, MAP, str(h2), str(l2))
    page.wait_for_function(f"location.search.includes('layer={l2}&head={h2}') && location.search.includes('ppos=')",
                           timeout=240_000)
    page.wait_for_function("t => (document.querySelector('#hs-pat-positions .gtitle')?.textContent || '').includes(t)",
                           arg=f"head {l2}.{h2}")
    settle(page)  # and it stays there
    assert f"layer={l2}&head={h2}" in page.url and banner(page).strip() == ""

    # Cancel stops a run: the page keeps the finished maps and their link
    link = page.url
    # a longer pair (the same ~150 shared tokens before each prompt) and the residual stream (31 layers ×
    # ~160 positions to patch), so the job is still running when Cancel is clicked: a q run of the same
    # pair (270 heads) finished first on a quiet machine, and its result replaced the link (CI)
    shared = "The weather was mild and the streets were quiet that morning. " * 12
    page.fill("#hs-pat-clean", shared + CLEAN)
    page.fill("#hs-pat-corrupted", shared + CORRUPTED)
    page.check("#hs-pat-site input[value='resid']")
    page.click("#hs-pat-run")
    # Cancel is enabled exactly while the job runs (a transient progress line may fall between polls)
    page.wait_for_function("!document.querySelector('#hs-pat-cancel').disabled", timeout=120_000)
    page.click("#hs-pat-cancel")
    page.wait_for_function("(document.querySelector('#hs-pat-status')?.innerText || '').startsWith('Cancelled')",
                           timeout=240_000)
    # Run comes back once the cancel's round trip ends (over 60 s seen with two suites on 2 cores)
    page.wait_for_function("!document.querySelector('#hs-pat-run').disabled", timeout=240_000)
    assert page.url == link

    # a copied link reopens the same view from the store: no job runs
    other = page.context.new_page()
    other.goto(link)
    other.wait_for_selector(MAP + " .heatmaplayer .hm", timeout=240_000)
    other.wait_for_selector("#hs-pat-positions .barlayer .point", state="attached")
    np.testing.assert_allclose(np.array(plot_data(other, MAP)[0]["z"], dtype=float), reference.values, atol=1e-4)
    assert other.input_value("#hs-pat-clean") == CLEAN and other.input_value("#hs-pat-answer-corrupted") == ANSWERS[1]
    assert other.is_checked(f"#hs-pat-site input[value='{SITE}']")
    assert other.inner_text("#hs-pat-status") == "" and other.inner_text("#hs-pat-pos-status") == ""
    assert other.get_attribute("#hs-pat-progress", "value") == "0"

    # export CSV of the map: the analysis's numbers, with a manifest
    with other.expect_download() as got:
        other.click("[data-export='patching_map-csv']")
    with zipfile.ZipFile(got.value.path()) as z:
        rows = list(csv.DictReader(io.StringIO(z.read("data.csv").decode())))
        manifest = json.loads(z.read("manifest.json"))
    assert manifest["view"] == "patching_map"
    assert len(rows) == reference.values.size
    np.testing.assert_allclose([float(r["exact"]) for r in rows], reference.values.ravel(), atol=1e-4)
    np.testing.assert_allclose([float(r["attribution"]) for r in rows], reference.attribution.ravel(), atol=1e-4)
    assert rows[layer * 3 + head]["unit"] == f"kv {layer}.{head}"
    other.close()
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(400)
def test_cancel_is_offered_only_once_the_page_can_stop_the_job(server, page):
    """Dash stops a background job only through the handle that Run's first answer brings back, after
    the server forked the job (seconds on a loaded machine). A Cancel enabled the moment Run was pressed
    could be clicked before that: the page said "Cancelled" while the job ran on, Run stayed disabled
    until the job ended (over 240 s in CI, 2026-12-02) and then its result replaced the page's maps.
    Here Run's first answer is held back, as a slow server holds it: Cancel stays disabled until the
    page has the handle, and once clicked it stops the job: Run comes back at once, the link stays."""
    url, _proc, _home = server
    held = []

    def hold_runs_first_answer(route):
        request = route.request
        try:
            changed = json.loads(request.post_data or "{}").get("changedPropIds")
        except ValueError:
            changed = None
        if changed == ["hs-pat-run.n_clicks"] and "job=" not in request.url:
            held.append((route, route.fetch(timeout=120_000)))  # the server has forked the job
        else:
            route.continue_()

    page.goto(url + "patching")
    assert page.input_value("#hs-pat-clean", timeout=240_000) == CLEAN
    shared = "The weather was mild and the streets were quiet that morning. " * 12  # a job of minutes
    page.fill("#hs-pat-clean", shared + CLEAN)
    page.fill("#hs-pat-corrupted", shared + CORRUPTED)
    page.check("#hs-pat-site input[value='resid']")
    page.wait_for_function("(document.querySelector('#hs-pat-differ')?.innerText || '').includes('differ at')")
    link = page.url
    page.route("**/_dash-update-component*", hold_runs_first_answer)
    page.click("#hs-pat-run")
    for _ in range(1200):
        if held:
            break
        page.wait_for_timeout(100)
    assert held, "Run's request never reached the server"
    assert page.is_disabled("#hs-pat-run")
    assert page.is_disabled("#hs-pat-cancel"), "Cancel is offered before the page can stop the job"
    route, response = held[0]
    route.fulfill(response=response)
    page.unroute("**/_dash-update-component*", hold_runs_first_answer)
    page.wait_for_function("!document.querySelector('#hs-pat-cancel').disabled", timeout=120_000)
    page.click("#hs-pat-cancel")
    page.wait_for_function("(document.querySelector('#hs-pat-status')?.innerText || '').startsWith('Cancelled')",
                           timeout=60_000)
    # Run comes back when the server says the job's process is gone (it would take minutes to finish)
    page.wait_for_function("!document.querySelector('#hs-pat-run').disabled", timeout=60_000)
    assert page.is_disabled("#hs-pat-cancel")
    page.wait_for_timeout(3_000)
    assert page.url == link and banner(page).strip() == ""


@pytest.mark.integration
def test_a_forged_site_direction_or_metric_is_refused(server):
    """A Run request naming a choice the page did not offer is refused before the callback runs."""
    url, proc, _home = server
    deps = json.loads(urllib.request.urlopen(url + "_dash-dependencies", timeout=60).read())
    dep = next(d for d in deps if any(s["id"] == "hs-pat-site" for s in d["state"]))
    good = {"hs-pat-run.n_clicks": 0, "hs-pat-clean.value": CLEAN, "hs-pat-corrupted.value": CORRUPTED,
            "hs-pat-answer-clean.value": ANSWERS[0], "hs-pat-answer-corrupted.value": ANSWERS[1],
            "hs-pat-model.value": "smollm2-135m", "hs-pat-site.value": "z", "hs-pat-direction.value": "denoise",
            "hs-pat-metric.value": "logit_diff"}

    def post(values: dict) -> tuple[int, str]:
        def item(spec):
            return {"id": spec["id"], "property": spec["property"], "value": values.get(f"{spec['id']}.{spec['property']}")}

        outputs = [{"id": p.rpartition(".")[0], "property": p.rpartition(".")[2]}
                   for p in dep["output"].strip(".").split("...")]
        body = {"output": dep["output"], "outputs": outputs, "inputs": [item(s) for s in dep["inputs"]],
                "state": [item(s) for s in dep["state"]], "changedPropIds": ["hs-pat-run.n_clicks"]}
        req = urllib.request.Request(url + "_dash-update-component", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    for key, value in (("hs-pat-site.value", "blocks.0.attn.hook_z"), ("hs-pat-direction.value", "both"),
                       ("hs-pat-metric.value", "accuracy"), ("hs-pat-site.value", ["z"])):
        status, text = post({**good, "hs-pat-run.n_clicks": 1, key: value})
        assert status == 400 and f"{key} is not one of its options" in text, (key, status, text[:300])
    status, _ = post(good)  # the page's own values pass (no click: the callback then does nothing)
    assert status in (200, 204)
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
def test_path_patching_on_the_page_is_the_analysis_value(server, page, real_model):
    """Patch path with the page's prompts: the value shown is :func:`headscope.analysis.path_patching.path_patching`
    computed here; a head list that is not one, or receivers before every sender, is the analysis's
    message in the banner and nothing else changes."""
    from headscope.analysis.path_patching import path_patching

    url, proc, home = server
    page.goto(url + "patching")
    assert page.input_value("#hs-pat-clean", timeout=240_000) == CLEAN
    page.fill("#hs-pat-path-from", "1-1")
    page.click("#hs-pat-path-run")
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('in the senders is not a head')",
                           timeout=120_000)
    page.fill("#hs-pat-path-from", "9.1")
    page.fill("#hs-pat-path-to", "3.1")
    page.click("#hs-pat-path-run")
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('No receiver lies')",
                           timeout=120_000)
    assert page.inner_text("#hs-pat-path-result") == ""

    page.fill("#hs-pat-path-from", "0.1, 3.4")
    page.fill("#hs-pat-path-to", "9.1,12.2")
    page.check("#hs-pat-path-site input[value='v']")
    page.click("#hs-pat-path-run")
    page.wait_for_function("(document.querySelector('#hs-pat-path-result')?.innerText || '').includes('Path value')",
                           timeout=240_000)
    expected = path_patching(real_model, CLEAN, CORRUPTED, list(ANSWERS), [(0, 1), (3, 4)], [(9, 1), (12, 2)], site="v")
    shown = page.inner_text("#hs-pat-path-result")
    assert f"Path value {expected.value:.4f}" in shown, shown
    assert "0.1, 3.4 → v of 9.1, 12.2 (key-value heads)" in shown and f"patched {expected.raw:.4f}" in shown
    assert page.inner_text("#hs-error") == ""
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
def test_a_click_on_the_residual_stream_map_starts_no_job_and_keeps_the_status(server, page):
    """The residual stream's map is already per position (layer × position): a click on it has nothing
    to patch by position. It used to start a job anyway, which blanked the positions' status line
    and flashed Cancel before the job gave up (#16); now the click is no click."""
    url, proc, _home = server
    page.goto(url + "patching")
    assert page.input_value("#hs-pat-clean", timeout=240_000) == CLEAN
    page.fill("#hs-pat-clean", "John gave a drink to")  # 6 positions × 31 layers: a few seconds' job
    page.fill("#hs-pat-corrupted", "Mary gave a drink to")
    page.check("#hs-pat-site input[value='resid']")
    page.click("#hs-pat-run")
    page.wait_for_function("new URLSearchParams(location.search).has('patching')", timeout=240_000)
    page.wait_for_selector(MAP + " .heatmaplayer .hm")
    settle(page)
    assert page.get_attribute("#hs-pat-progress", "value") == "0"
    clicks = []
    page.on("request", lambda r: clicks.append(r.url) if "hs-pat-click" in (r.post_data or "") else None)
    page.evaluate("document.querySelector('#hs-pat-pos-status').textContent = 'what the page said before'")
    position = plot_data(page, MAP)[0]["x"][2]
    click_category(page, MAP, position, "3")
    page.wait_for_timeout(500)
    settle(page)
    assert clicks == [], "a click on the residual stream's map sent a request"
    assert page.inner_text("#hs-pat-pos-status") == "what the page said before"
    assert page.is_disabled("#hs-pat-cancel") and banner(page).strip() == ""
    assert "ppos=" not in page.url and proc.poll() is None
