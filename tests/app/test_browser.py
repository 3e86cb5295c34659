"""The Attention page in real headless Chromium against a real server on the embedded model."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from tests.app.browsing import (
    PROMPT,
    click_cell,
    error_text,
    hover_token,
    run_prompt,
    select_option,
    settle,
    wait_for_run,
    wait_strip,
    wait_title,
)

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.browser, pytest.mark.integration]


def quick_second_clicks_lost(page, graph: str, gaps=(0, 30, 60, 300), n_cols=9, n_rows=30) -> list[int]:
    """Click head 1 of layer 2 on the grid ``graph``, then ``gap`` ms later head 7 of layer 25 (or the
    other way round), for each gap; return the gaps after which the page's URL did not end on the
    second head. (Plotly reports a click at the cell its last hover found, and hovers at most every
    50 ms and again after each redraw: a quick second click was read as the first, #16.) Every grid
    reads clicks through the same script (assets/grid_clicks.js); the Attention grid's test sweeps
    nine gaps from 0 to 800 ms (test_direct_manipulation.py), the other grids these four (two
    inside plotly's 50 ms hover throttle)."""
    page.locator(f"#{graph}").scroll_into_view_if_needed()
    box = page.locator(f"#{graph} .nsewdrag").first.bounding_box()
    missed = []
    for i, gap in enumerate(gaps):
        first, second = ((1, 2), (7, 25)) if i % 2 == 0 else ((7, 25), (1, 2))
        page.wait_for_function("() => document.title !== 'Updating...'")
        page.mouse.click(box["x"] + box["width"] * (first[0] + 0.5) / n_cols, box["y"] + box["height"] * (first[1] + 0.5) / n_rows)
        page.wait_for_timeout(gap)
        page.mouse.click(box["x"] + box["width"] * (second[0] + 0.5) / n_cols, box["y"] + box["height"] * (second[1] + 0.5) / n_rows)
        wanted = f"layer={second[1]}&head={second[0]}"
        try:
            page.wait_for_function(f"location.search.includes('{wanted}')", timeout=5000)
            settle(page)  # and it stays there
            if wanted not in page.evaluate("location.search"):
                missed.append(gap)
        except PlaywrightTimeoutError:
            missed.append(gap)
    return missed


def drawn_head(page) -> dict:
    """What the Attention page draws for its head, read from plotly's own data: the heatmap's
    weights (rounded to 1e-6), its blanks, title and metadata, and the head the grid outlines."""
    return page.evaluate("""() => {
        const heat = document.querySelector('#hs-heatmap .js-plotly-plot');
        const grid = document.querySelector('#hs-grid .js-plotly-plot');
        const z = heat._fullData[0].z, shape = (grid._fullLayout.shapes || [])[0];
        const weights = [], blanks = [];
        z.forEach((row, i) => row.forEach((w, j) => {
            if (w === null || Number.isNaN(w)) { blanks.push([i, j]); } else { weights.push(Math.round(w * 1e6)); } }));
        return {rows: z.length, weights: weights, blanks: blanks.length, title: heat._fullLayout.title.text,
                meta: heat._fullLayout.meta, outline: shape ? [shape.y0 + 0.5, shape.x0 + 0.5] : null,
                grid: grid._fullData[0].z.flat().map(v => v === null ? null : Math.round(v * 1e6))};
    }""")


def heatmap_title(page) -> str:
    return page.locator("#hs-heatmap .gtitle").text_content()


def test_prompt_grid_heatmap_strip_and_svg_export(server, page, tmp_path):
    url, proc, _ = server
    run_prompt(page, url, PROMPT)
    wait_for_run(page)
    assert "run=" in page.url and "layer=0" in page.url
    assert heatmap_title(page) == "Attention of layer 0, head 0"
    wait_title(page, "hs-sinks", "position 0 is a sink for")

    click_cell(page, "hs-grid", col=5, row=3, n_cols=9, n_rows=30)
    wait_title(page, "hs-heatmap", "layer 3, head 5")
    assert "layer=3" in page.url and "head=5" in page.url
    # a head click changes the drawn grid and heatmap in place: what it shows is what the same link
    # draws from scratch (every weight, blanks above the diagonal, the outline, the metadata)
    clicked = drawn_head(page)
    assert clicked["outline"] == [3, 5] and clicked["meta"] == {"layer": 3, "head": 5, "n": clicked["rows"]}
    page.goto(page.url)
    wait_title(page, "hs-heatmap", "layer 3, head 5")
    page.wait_for_selector("#hs-grid .heatmaplayer .hm")
    assert drawn_head(page) == clicked

    # Hovering a token in the strip shows that token's attention row (once the strip shows this head).
    wait_strip(page, "layer 3, head 5")
    page.wait_for_load_state("networkidle")
    hover_token(page, 2)
    wait_strip(page, "from token 2")

    with page.expect_download() as download:
        page.click("[data-export='attention-svg']")
    path = tmp_path / "export.zip"
    download.value.save_as(path)
    z = zipfile.ZipFile(path)
    svg = z.read("attention.svg").decode()
    assert svg.lstrip().startswith(("<svg", "<?xml")) and "layer 3, head 5" in svg
    manifest = json.loads(z.read("manifest.json"))
    assert manifest["params"]["layer"] == 3 and manifest["params"]["head"] == 5
    assert manifest["model"]["name"] == "smollm2-135m" and len(manifest["token_ids"]) > 10
    rows = z.read("data.csv").decode().splitlines()
    assert rows[0] == "query_pos,query_token,key_pos,key_token,weight"
    n = len(manifest["token_ids"])
    assert len(rows) - 1 == n * (n + 1) // 2
    assert proc.poll() is None


def test_copied_link_reopens_the_same_view(server, page, browser):
    url, _, _ = server
    run_prompt(page, url, "A copied link should reopen this exact view.")
    wait_for_run(page)
    click_cell(page, "hs-grid", col=2, row=7, n_cols=9, n_rows=30)
    wait_title(page, "hs-heatmap", "layer 7, head 2")
    link = page.url
    other = browser.new_page()
    other.goto(link)
    wait_title(other, "hs-heatmap", "layer 7, head 2")
    assert other.input_value("#attn-hs-text") == "A copied link should reopen this exact view."
    other.close()


@pytest.mark.parametrize(
    "query, expected",
    [
        ("?run=not-a-run&layer=abc", "not valid"),
        ("?run=0123456789abcdef", "No stored run"),
        ("?model=no-such-model", "Cannot load model"),
    ],
)
def test_malformed_links_show_messages(server, page, query, expected):
    url, proc, _ = server
    page.goto(url + query)
    assert expected in error_text(page)
    assert proc.poll() is None


def test_bad_inputs_show_messages_and_the_server_keeps_serving(server, page):
    url, proc, home = server
    run_prompt(page, url, "Keep this run safe.")
    wait_for_run(page)
    kept = page.url

    page.fill("#attn-hs-text", "   ")
    page.click("#attn-hs-run")
    assert "empty" in error_text(page)

    page.fill("#attn-hs-text", "x" * 200_000)
    page.click("#attn-hs-run")
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('limit')")

    page.goto(kept.replace("layer=0", "layer=99"))
    assert "out of range" in error_text(page)
    assert heatmap_title(page) == "Attention of layer 0, head 0"

    # Nothing was lost: the earlier run still opens, and new work still runs.
    page.goto(kept)
    page.wait_for_selector("#hs-heatmap .gtitle")
    assert page.input_value("#attn-hs-text") == "Keep this run safe."
    run_prompt(page, url, "Still serving after bad input.")
    wait_for_run(page)
    assert proc.poll() is None
    assert "Traceback" not in page.content()


def test_a_text_beyond_the_models_context_says_so_without_naming_a_setting(server, page):
    """50,000 characters of prose (about 12,000 tokens) on SmolLM2, whose context is 8,192 tokens:
    statistics mode cannot read it either, and no setting lifts the model's context."""
    url, proc, _ = server
    prose = open(ROOT / "data/niah/haystack_prose.txt", encoding="utf-8").read()
    text = (prose * (1 + 50_000 // len(prose)))[:50_000]
    run_prompt(page, url, text)
    message = error_text(page)
    assert "context of 8,192 tokens" in message and "Shorten" in message, message
    assert "HEADSCOPE_" not in message, message
    assert proc.poll() is None


def test_flow_page_shows_three_attributions_and_exports_flow_data(server, page, tmp_path):
    url, proc, _ = server
    page.goto(url + "flow")
    page.fill("#flow-hs-text", "The keys to the old wooden cabinet")
    page.click("#flow-hs-run")
    page.wait_for_function("(document.querySelector('#hs-flow-info')?.innerText || '').includes('target: token')")
    titles = page.locator(".js-plotly-plot .gtitle").all_text_contents()
    assert any(t.startswith("Raw attention") for t in titles)
    assert any(t.startswith("Attention rollout") for t in titles)
    assert any(t.startswith("Attention flow") for t in titles)
    page.wait_for_load_state("networkidle")
    page.check("#hs-flow-sink input")
    page.wait_for_function("location.search.includes('sink=1')")
    with page.expect_download() as download:
        page.click("[data-export='relevance:flow-csv']")
    path = tmp_path / "flow.zip"
    download.value.save_as(path)
    z = zipfile.ZipFile(path)
    manifest = json.loads(z.read("manifest.json"))
    assert manifest["view"] == "relevance" and manifest["params"]["method"] == "flow"
    assert manifest["params"]["drop_sink"] is True
    rows = z.read("data.csv").decode().splitlines()
    assert rows[0] == "pos,token,relevance" and len(rows) - 1 == len(manifest["token_ids"])
    assert proc.poll() is None


def test_faithfulness_on_input_and_a_cancelled_background_evaluation(server, page):
    url, proc, _ = server
    page.goto(url + "flow")
    # before any run: the button says what to do first, in the banner (#16: its errors reach the page)
    page.click("#hs-faith-input-button")
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('Run a text first')")
    page.fill("#flow-hs-text", "The keys to the cabinet")
    page.click("#flow-hs-run")
    page.wait_for_function("(document.querySelector('#hs-flow-info')?.innerText || '').includes('target: token')")
    page.click("#hs-faith-input-button")
    page.wait_for_selector("#hs-faith-input .js-plotly-plot")
    titles = page.locator("#hs-faith-input .gtitle").all_text_contents()
    assert any("input×gradient" in t for t in titles) and any("ablation importance" in t for t in titles)
    assert any(t.startswith("Faithfulness on this input") for t in titles)

    # The built-in evaluation runs as a background job: progress shows, cancel stops it.
    page.click("#hs-faith-set-button")
    page.wait_for_function("document.querySelector('#hs-faith-set-button').disabled")
    page.wait_for_function("(document.querySelector('#hs-faith-set-status')?.innerText || '').includes('evaluating')",
                           timeout=120_000)
    page.click("#hs-faith-set-cancel")
    page.wait_for_function("!document.querySelector('#hs-faith-set-button').disabled")
    assert proc.poll() is None


def test_heads_page_runs_a_small_sweep_and_opens_a_heads_trials(server, page, tmp_path):
    url, proc, _ = server
    page.goto(url + "heads")
    page.wait_for_selector("#hs-heads-run")
    # a malformed own needle is refused with a message, nothing runs
    page.fill("#hs-heads-custom-needles", "The secret passkey is 7731. | What is the secret passkey?")
    page.click("#hs-heads-run")
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('needle | question | answer')")
    # an own needle in the synthetic haystack, with a non-default streaming window
    page.fill("#hs-heads-custom-needles", "The secret passkey is 7731. | What is the secret passkey? | 7731")
    page.fill("#hs-heads-lengths", "256")
    page.fill("#hs-heads-depths", "50")
    page.fill("#hs-heads-window", "32")
    select_option(page, "hs-heads-haystack", "passkey")
    page.click("#hs-heads-run")
    page.wait_for_function("location.search.includes('sweep=')", timeout=240_000)
    assert "window=32" in page.evaluate("location.search")
    page.wait_for_selector("#hs-heads-grid .heatmaplayer .hm")
    assert "1/1 trials" in page.locator("#hs-heads-info").inner_text()  # SmolLM2 answers this one
    # the settings a user typed survive the page update
    assert page.input_value("#hs-heads-custom-needles").startswith("The secret passkey")
    assert page.input_value("#hs-heads-window") == "32"
    wait_title(page, "hs-heads-score-grid", "Streaming score (S=4, W=32): mean over 1 prompts")
    select_option(page, "hs-heads-score", "evidence")
    wait_title(page, "hs-heads-score-grid", "Evidence score (question → needle)")
    wait_title(page, "hs-heads-mass", "of heads hold 50% of the positive mass")
    top_layer = int(page.locator("#hs-heads-topk td[data-dash-column='layer']").first.inner_text())
    top_head = int(page.locator("#hs-heads-topk td[data-dash-column='head']").first.inner_text())
    click_cell(page, "hs-heads-grid", col=top_head, row=top_layer, n_cols=9, n_rows=30)
    page.wait_for_function(f"location.search.includes('layer={top_layer}') && location.search.includes('head={top_head}')")
    page.wait_for_selector("#hs-heads-trials td[data-dash-column='response']")
    wait_title(page, "hs-heads-steps", f"Layer {top_layer}, head {top_head}, trial 0")
    with page.expect_download() as download:
        page.click("[data-export='retrieval_grid-csv']")
    path = tmp_path / "grid.zip"
    download.value.save_as(path)
    rows = zipfile.ZipFile(path).read("data.csv").decode().splitlines()
    assert rows[0] == "layer,head,retrieval" and len(rows) == 1 + 270
    # the decode-step rows export whole: every key of every step, the needle marked
    with page.expect_download() as download:
        page.click("[data-export='trial_steps-json']")
    path = tmp_path / "steps.zip"
    download.value.save_as(path)
    z = zipfile.ZipFile(path)
    steps = json.loads(z.read("data.json"))
    assert any(r["in_needle"] for r in steps) and sum(r["argmax"] for r in steps) == 1 + max(r["step"] for r in steps)
    assert json.loads(z.read("manifest.json"))["params"]["layer"] == top_layer
    # two clicks in quick succession on either map: the page ends on the second head (#16)
    missed = {g: quick_second_clicks_lost(page, g) for g in ("hs-heads-grid", "hs-heads-score-grid")}
    assert missed == {"hs-heads-grid": [], "hs-heads-score-grid": []}, f"a quick second click was lost after ms {missed}"
    wait_title(page, "hs-heads-steps", "Layer 2, head 1, trial 0")  # the last second click
    # the paper's experiment from here: the sweep's top retrieval heads against random heads
    page.click("#hs-heads-ablate-link")
    page.wait_for_function("location.pathname == '/ablation' && location.search.includes('by=retrieval')")
    wait_title(page, "hs-abl-grid", "Retrieval score (sweep")
    page.fill("#hs-abl-curve-ks", "0,3")
    page.fill("#hs-abl-curve-seeds", "1")
    page.check("#hs-abl-curve-metric input[value='niah']")
    page.click("#hs-abl-curve-run")
    page.wait_for_function("location.search.includes('curve=')", timeout=240_000)
    wait_title(page, "hs-abl-curve", "top-k vs random heads (zero ablation)")
    with page.expect_download() as download:
        page.click("[data-export='ablation_curve-csv']")
    path = tmp_path / "niah_curve.zip"
    download.value.save_as(path)
    rows = zipfile.ZipFile(path).read("data.csv").decode().splitlines()
    # top and one seed per k, then the random control over all seeds (#42 item 4: n and the Wilson interval)
    assert len(rows) == 1 + 2 + 2 + 2 and rows[0].startswith("k,set,seed,value,value_n,value_low,value_high")
    assert rows[1].startswith("0,top,,1.0,1,")  # k=0: the sweep's answered trial, 1 of 1
    assert proc.poll() is None


def test_qk_page_embeds_a_head_and_shows_queries_and_keys(server, page, tmp_path):
    url, proc, _ = server
    page.goto(url + "qk?layer=16&head=0&sentences=20&query=5")
    page.wait_for_function("(document.querySelector('#hs-qk-status')?.innerText || '') === 'ready'", timeout=240_000)
    wait_title(page, "hs-qk-scatter", "Layer 16, head 0: joint query-key embedding (PCA")
    wait_title(page, "hs-qk-spectrum", "Contrastive covariance")
    hits = page.locator("#hs-qk-hits li").all_inner_texts()
    assert 1 <= len(hits) <= 5 and all("attention" in h for h in hits)
    with page.expect_download() as download:
        page.click("[data-export='qk_scatter-json']")
    path = tmp_path / "qk.zip"
    download.value.save_as(path)
    z = zipfile.ZipFile(path)
    manifest = json.loads(z.read("manifest.json"))
    assert manifest["view"] == "qk_scatter" and manifest["params"]["layer"] == 16
    rows = json.loads(z.read("data.json"))
    assert rows[0]["query"] == 5 and {"x", "y"} <= set(rows[-1])

    # the clicked query's logits split by the feature subspace, the layer at a glance, the weight-space map
    wait_title(page, "hs-qk-attribution", "query 5")
    wait_title(page, "hs-qk-layer-view", "Layer 16: every head's joint query-key PCA")
    wait_title(page, "hs-qk-rank-map", "Effective rank of W_QK per head", timeout=120_000)
    page.fill("#hs-qk-find", "the")
    page.press("#hs-qk-find", "Enter")
    page.wait_for_function("location.search.includes('find=the')")
    wait_title(page, "hs-qk-scatter", "'the' found")
    # a label file: a bad one says which line is wrong, a good one adds its features
    bad = tmp_path / "bad.csv"
    bad.write_text("feature,side,label,match\ncolour,sideways,colour,word:red\n")
    page.set_input_files("#hs-qk-labels-upload input[type=file]", str(bad))
    page.wait_for_function("(document.querySelector('#hs-qk-status')?.innerText || '').includes('line 2')")
    good = tmp_path / "labels.csv"
    good.write_text("feature,side,label,match\ndeterminer,both,det,word:the|a|an\ncolour,both,colour,word:red|green\n")
    page.set_input_files("#hs-qk-labels-upload input[type=file]", str(good))
    page.wait_for_function("location.search.includes('labels=') && location.search.includes('feature=determiner')")
    wait_title(page, "hs-qk-spectrum", "for 'determiner'", timeout=120_000)
    # a feature the probe sentences never pair up is explained in the figure's place
    page.goto(page.url.replace("feature=determiner", "feature=colour"))
    page.wait_for_function("(document.querySelector('#hs-qk-spectrum')?.textContent || '').includes('no positive pairs')",
                           timeout=120_000)

    # own probe sentences replace the built-in set
    own = tmp_path / "mine.txt"
    own.write_text("# my probes\nThe red fox saw the red barn.\nA green frog sat on a green leaf.\n")
    page.set_input_files("#hs-qk-texts-upload input[type=file]", str(own))
    page.wait_for_function("location.search.includes('texts=') && location.search.includes('sentences=2')")
    page.wait_for_function("(document.querySelector('#hs-qk-scatter .gtitle')?.textContent || '').match(/PCA, 1\\d tokens/)",
                           timeout=120_000)

    # a click on the rank map shows that head; of two quick clicks, the second (#16)
    assert quick_second_clicks_lost(page, "hs-qk-rank-map") == []
    wait_title(page, "hs-qk-scatter", "Layer 2, head 1: joint query-key embedding", timeout=120_000)

    page.goto(url + "qk?layer=3&head=0&sentences=5000")  # more points than allowed
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('between 1 and')")

    page.goto(url + "qk?layer=99&head=0")
    assert "out of range" in error_text(page).lower() or "layer" in error_text(page).lower()
    assert proc.poll() is None


def test_ablation_page_effects_kept_sets_curve_and_bad_inputs(server, page, tmp_path):
    url, proc, _ = server
    page.goto(url + "ablation")
    page.wait_for_selector("#hs-abl-topk")
    page.click("#hs-abl-topk")  # ranking by retrieval with no sweep: a message, nothing breaks
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('No retrieval scores')")
    # a sweep id that names no stored sweep (typed, or pasted from another machine): said in the banner,
    # and the URL keeps no such sweep (#16: the rank-by callback's errors reach the banner)
    page.fill("#hs-abl-sweep", "feedface00")
    page.press("#hs-abl-sweep", "Enter")
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '')"
                           ".includes(\"No stored sweep has the id 'feedface00'\")")
    assert "sweep=" not in page.url
    page.fill("#abl-hs-text", PROMPT)
    page.click("#abl-hs-run")
    page.wait_for_function("location.search.includes('run=')")
    wait_title(page, "hs-abl-grid", "0 heads chosen")
    page.fill("#hs-abl-heads", "31.2")
    page.press("#hs-abl-heads", "Enter")
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('out of range')")
    page.fill("#hs-abl-heads", "3.1, kv:5.0")
    page.press("#hs-abl-heads", "Enter")
    wait_title(page, "hs-abl-grid", "4 heads chosen")  # chosen, not computed: Apply computes them
    page.click("#hs-abl-apply")
    page.wait_for_function("decodeURIComponent(location.search).includes('heads=3.1,5.0,5.1,5.2')", timeout=240_000)
    wait_title(page, "hs-abl-effects", "zero ablation of 4 heads: mean loss")
    assert "Continuation, ablated" in page.locator("#hs-abl-summary").inner_text()
    page.click("#hs-abl-keep")
    page.wait_for_selector("#hs-abl-kept-table td[data-dash-column='heads']")
    # the paper's masking, applied to the same heads
    page.check("#hs-abl-method input[value='uniform']")
    page.click("#hs-abl-apply")
    page.wait_for_function("location.search.includes('ablate=uniform')", timeout=240_000)
    wait_title(page, "hs-abl-effects", "uniform ablation of 4 heads")
    page.click("#hs-abl-keep")
    page.wait_for_function("document.querySelectorAll('#hs-abl-kept-table td[data-dash-column=\"method\"]').length == 2")
    page.locator("#hs-abl-kept-table .dash-delete-cell").first.click()  # forget a kept set
    page.wait_for_function("document.querySelectorAll('#hs-abl-kept-table td[data-dash-column=\"method\"]').length == 1")
    # top-k by a score on this text, then the top-k vs random curve on its loss
    select_option(page, "hs-abl-by", "Attention on first token")
    page.fill("#hs-abl-k", "3")
    page.click("#hs-abl-topk")
    page.wait_for_function("location.search.includes('by=first_token')")
    wait_title(page, "hs-abl-grid", "3 heads chosen")
    page.fill("#hs-abl-curve-ks", "0,1,3")
    page.fill("#hs-abl-curve-seeds", "2")
    page.click("#hs-abl-curve-run")
    page.wait_for_function("location.search.includes('curve=')", timeout=240_000)
    wait_title(page, "hs-abl-curve", "top-k vs random heads (uniform ablation)")
    with page.expect_download() as download:
        page.click("[data-export='ablation_curve-csv']")
    path = tmp_path / "curve.zip"
    download.value.save_as(path)
    rows = zipfile.ZipFile(path).read("data.csv").decode().splitlines()
    assert rows[0].startswith("k,set,seed,value") and len(rows) == 1 + 3 + 2 * 3
    # NIAH accuracy needs a sweep: said plainly
    page.check("#hs-abl-curve-metric input[value='niah']")
    page.click("#hs-abl-curve-run")
    page.wait_for_function("(document.querySelector('#hs-abl-curve-status')?.innerText || '').includes('needs a sweep')")
    assert proc.poll() is None


HOSTILE = ('Hi <script>window.__pwned=1</script><img src=x onerror="window.__pwned=2"> '
           '<b>bold</b> <a href="javascript:window.__pwned=3">link</a>')


def test_hostile_text_renders_as_text_in_pages_and_exported_html(server, page, browser, tmp_path):
    url, proc, _ = server
    run_prompt(page, url, HOSTILE)
    wait_for_run(page)
    click_cell(page, "hs-grid", col=2, row=1, n_cols=9, n_rows=30)
    wait_title(page, "hs-heatmap", "layer 1, head 2")
    page.hover("#hs-heatmap .nsewdrag")
    labels = " ".join(page.locator("#hs-heatmap .xtick text").all_text_contents())
    assert "<script>" in labels or "script" in labels  # shown, as characters
    assert page.evaluate("window.__pwned") is None
    assert page.locator("img[src='x']").count() == 0 and page.locator("a[href^='javascript:']").count() == 0
    with page.expect_download() as download:
        page.click("[data-export='attention-html']")
    path = tmp_path / "attention.zip"
    download.value.save_as(path)
    z = zipfile.ZipFile(path)
    name = next(n for n in z.namelist() if n.endswith(".html"))
    html_text = z.read(name).decode()
    assert "<script>window.__pwned" not in html_text and "onerror=\"window" not in html_text
    exported = tmp_path / "figure.html"
    exported.write_text(html_text)
    other = browser.new_page()
    other.goto(exported.as_uri())
    other.wait_for_selector(".js-plotly-plot .xtick")
    assert other.evaluate("window.__pwned") is None
    assert other.locator("img[src='x']").count() == 0
    other.close()
    # the same text as an own needle on the Heads page is refused or shown as text, never run
    page.goto(url + "heads")
    page.fill("#hs-heads-custom-needles", HOSTILE + " | <script>q</script>? | <b>a</b>")
    page.fill("#hs-heads-lengths", "99999999")
    page.click("#hs-heads-run")
    # the refusal is in the page's error banner (the Heads page's errors moved there, #16)
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').length > 0")
    assert "99,999,999" in page.inner_text("#hs-error")
    assert page.evaluate("window.__pwned") is None
    assert proc.poll() is None


def _rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


@pytest.mark.timeout(900)  # ten forked one-thread Run jobs at once: minutes on a loaded 2-core machine (503 s seen)
def test_ten_sessions_at_once_each_see_only_their_own_run(server, browser):
    """Ten independent browser sessions (own cookies and storage) run ten different texts at the same
    time: no errors, each page shows its own run (its text, its token count), the server keeps
    serving, and its memory stays bounded."""
    url, proc, _ = server
    before = _rss_mb(proc.pid)
    texts = [f"Session {i} asks about the {w} near the old mill." for i, w in
             enumerate(["river", "bridge", "orchard", "chapel", "quarry", "harbour", "meadow", "forge", "tower",
                        "granary"])]
    contexts = [browser.new_context(viewport={"width": 1200, "height": 900}) for _ in texts]
    pages = [c.new_page() for c in contexts]
    for p in pages:
        p.set_default_timeout(700_000)
        p.goto(url)
        p.wait_for_selector("#attn-hs-run")
    for p, text in zip(pages, texts, strict=True):
        p.fill("#attn-hs-text", text)
    # click all Run buttons together (as close to simultaneous as one driver thread allows)
    for p in pages:
        p.evaluate("document.querySelector('#attn-hs-run').click()")
    run_ids = []
    for p, text in zip(pages, texts, strict=True):
        # a run that fails says so at once (the page's error line), instead of the test waiting out its timeout
        p.wait_for_function("(document.querySelector('#hs-run-info')?.innerText || '').includes('tokens')"
                            " || (document.querySelector('#hs-error')?.innerText || '') !== ''")
        assert p.locator("#hs-error").inner_text() == ""
        assert p.input_value("#attn-hs-text") == text
        run_ids.append(p.evaluate("new URLSearchParams(location.search).get('run')"))
    assert len(set(run_ids)) == len(texts)  # ten runs, none shown in another session
    after = _rss_mb(proc.pid)
    for c in contexts:
        c.close()
    assert proc.poll() is None
    assert after - before < 1500, (before, after)  # ten short runs, memory bounded


def drag_box(page, graph: str, x0: float, y0: float, x1: float, y1: float) -> None:
    """Drag-zoom a box on a graph, corners as fractions of the plot area (as a user drags)."""
    page.locator(f"#{graph}").scroll_into_view_if_needed()
    box = page.locator(f"#{graph} .nsewdrag").first.bounding_box()
    page.mouse.move(box["x"] + box["width"] * x0, box["y"] + box["height"] * y0)
    page.mouse.down()
    page.mouse.move(box["x"] + box["width"] * (x0 + x1) / 2, box["y"] + box["height"] * (y0 + y1) / 2, steps=4)
    page.mouse.move(box["x"] + box["width"] * x1, box["y"] + box["height"] * y1, steps=4)
    page.mouse.up()


def test_a_long_text_runs_in_statistics_mode_with_a_pooled_map_and_exact_zoom(server, page, tmp_path):
    """1,348 tokens (above the 1,024-token patterns limit): statistics mode, pooled map, zoom → exact.
    (The page path is the same at any length above the limit; bench/kernels.py times 4k-64k tokens.)"""
    url, proc, _ = server
    text = (ROOT / "data" / "niah" / "haystack_prose.txt").read_text(encoding="utf-8")[:6000]
    run_prompt(page, url, text)
    page.wait_for_function("(document.querySelector('#hs-run-info')?.innerText || '').includes('statistics mode')",
                           timeout=300_000)
    assert "1348 tokens" in page.locator("#hs-run-info").inner_text()
    wait_title(page, "hs-heatmap", "mean attention per 11×11 block of 1,348 tokens")
    wait_title(page, "hs-grid", "Normalised entropy")
    # every per-head score comes from statistics, the TransformerLens detectors too
    select_option(page, "hs-metric", "Induction score")
    wait_title(page, "hs-grid", "Induction score")
    # drag a box on the pooled map: the region goes into the URL, its exact values appear below
    drag_box(page, "hs-heatmap", 0.30, 0.40, 0.36, 0.46)
    page.wait_for_function("location.search.includes('region=')")
    search = page.evaluate("location.search")
    wait_title(page, "hs-strip", "Exact attention of layer 0, head 0", timeout=180_000)
    with page.expect_download() as download:
        page.click("[data-export='token_strip-csv']")
    path = tmp_path / "region.zip"
    download.value.save_as(path)
    rows = zipfile.ZipFile(path).read("data.csv").decode().splitlines()
    assert rows[0].startswith("query_pos,query_token,key_pos,key_token,weight") and len(rows) > 100
    weights = [float(r.rsplit(",", 1)[1]) for r in rows[1:]]
    assert all(0.0 <= w <= 1.0 for w in weights)
    # the copied link reopens the same region; a malformed region is refused with a message
    page.goto(url + search)
    wait_title(page, "hs-strip", "Exact attention of layer 0, head 0", timeout=180_000)
    page.goto(url + search.replace("region=", "region=9000-9100%2C1-2&x="))
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('outside the 1,348-token run')")
    assert proc.poll() is None


def test_heads_page_retrieval_sweep_above_the_patterns_limit(server, page):
    """A 1,200-token needle-in-a-haystack trial from the page, above the 1,024 tokens a page run keeps
    patterns for: statistics-mode prefill, decode and head scores. The path is the same at any length;
    bench/long_sweep.py runs the page's job at 2,048 and 4,096 tokens (this test ran 4,096 until
    2026-12: 555 s of a loaded suite)."""
    url, proc, _ = server
    page.goto(url + "heads")
    page.wait_for_selector("#hs-heads-run")
    page.fill("#hs-heads-custom-needles", "The secret passkey is 7731. | What is the secret passkey? | 7731")
    page.fill("#hs-heads-lengths", "1200")
    page.fill("#hs-heads-depths", "50")
    select_option(page, "hs-heads-haystack", "passkey")
    page.click("#hs-heads-run")
    page.wait_for_function("location.search.includes('sweep=')", timeout=240_000)
    page.wait_for_function("(document.querySelector('#hs-heads-info')?.innerText || '').includes('trials counted')",
                           timeout=120_000)
    info = page.locator("#hs-heads-info").inner_text()
    assert "lengths [1200]" in info
    wait_title(page, "hs-heads-score-grid", "Streaming score (S=4, W=64): mean over 1 prompts", timeout=120_000)
    wait_title(page, "hs-heads-grid", "trials counted")
    assert page.locator("#hs-error").inner_text().strip() == ""
    assert proc.poll() is None
