"""Direct manipulation on the Attention and QK pages (#16), in real Chromium against a real server on
the embedded model: the strip follows hover in the browser, Run shows progress and is disabled while
it runs, a job whose process dies says so, UMAP and t-SNE finish in the served app, long texts read."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

from tests.app.browsing import hover_token, run_prompt, settle, wait_for_run, wait_strip  # noqa: E402
from tests.app.servers import start_server  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.integration]

PROMPT = "When Mary and John went to the store, John gave a drink to Mary. The cat sat on the mat."
PATTERNS_LIMIT = 128  # the server's HEADSCOPE_MAX_TOKENS here: longer texts run in statistics mode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("server-home")
    env = {**os.environ, "HEADSCOPE_HOME": str(home), "HEADSCOPE_MAX_TOKENS": str(PATTERNS_LIMIT)}
    proc, url = start_server([sys.executable, "-m", "headscope.app.cli", "serve"], env, home / "server.log")
    yield url, proc, home
    proc.terminate()
    proc.wait(timeout=20)


def long_text(words: int) -> str:
    prose = (ROOT / "data" / "niah" / "haystack_prose.txt").read_text(encoding="utf-8").split()
    return " ".join(prose[:words])


def wait_title(page, graph: str, text: str, timeout: float = 60_000) -> None:
    page.wait_for_function(
        "([g, t]) => { const el = document.querySelector(`#${g} .gtitle`); return el && el.textContent.includes(t); }",
        arg=[graph, text], timeout=timeout)


def figure(page, graph: str) -> dict:
    """The figure plotly drew in ``graph`` (data and full layout, as the browser has them)."""
    return page.evaluate("""g => { const el = document.querySelector(`#${g} .js-plotly-plot`);
        return {data: el.data, layout: el.layout, ticks: [...el.querySelectorAll('.ytick text')].map(t => t.textContent),
                xticks: [...el.querySelectorAll('.xtick text')].map(t => t.textContent)}; }""", graph)


def error_text(page) -> str:
    return page.locator("#hs-error").inner_text()


def hover_cell(page, graph, col, row, n_cols, n_rows):
    page.locator(f"#{graph}").scroll_into_view_if_needed()
    box = page.locator(f"#{graph} .nsewdrag").first.bounding_box()
    page.mouse.move(box["x"] + box["width"] * (col + 0.5) / n_cols, box["y"] + box["height"] * (row + 0.5) / n_rows)


def job_children(proc) -> list:
    """The server's forked job processes (same command line as the server; not the export browser)."""
    import psutil

    server = psutil.Process(proc.pid)
    out = []
    for child in server.children():
        try:
            if child.cmdline() == server.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                out.append(child)
        except psutil.NoSuchProcess:
            pass
    return out


def test_hovering_tokens_and_heatmap_rows_repaints_the_strip_in_the_browser(server, page, tmp_path):
    from plotly.colors import sample_colorscale, unlabel_rgb

    url, proc, _ = server
    run_prompt(page, url, PROMPT)
    wait_for_run(page)
    n = len(figure(page, "hs-heatmap")["data"][0]["y"])
    wait_strip(page, f"Attention from token {n - 1} ")
    requests = []
    page.on("request", lambda r: requests.append(r.url) if "_dash-update-component" in r.url else None)
    hover_token(page, 3)
    wait_strip(page, "Attention from token 3 ", timeout=5_000)
    hover_cell(page, "hs-heatmap", col=2, row=10, n_cols=n, n_rows=n)
    wait_strip(page, "Attention from token 10 ", timeout=5_000)
    cells = page.evaluate("""() => [...document.querySelectorAll('#hs-strip-tokens [data-pos]')].map(s =>
        [s.dataset.weight, getComputedStyle(s).backgroundColor, s.classList.contains('hs-token-query')])""")
    assert len(cells) == n
    weights = [float(w) if w else None for w, _, _ in cells]
    assert all(w is None for w in weights[11:]) and all(w is not None for w in weights[:11])  # keys after 10: unseen
    row = page.evaluate("Array.from(document.querySelector('#hs-heatmap .js-plotly-plot')._fullData[0].z[10])")
    assert weights[:11] == pytest.approx(row[:11], rel=1e-5)  # the strip is that heatmap row
    # each token's colour is plotly's colour scale of the heatmap at weight / the row's largest weight
    scale = figure(page, "hs-heatmap")["data"][0]["colorscale"]
    expected = sample_colorscale(scale, [w / max(row[:11]) for w in row[:11]])
    for (_, shown, _), want in zip(cells[:11], expected, strict=True):
        assert unlabel_rgb(shown) == pytest.approx(unlabel_rgb(want), abs=2)
    assert all(bg in ("rgba(0, 0, 0, 0)", "transparent") for _, bg, _ in cells[11:])
    assert [i for i, (_, _, marked) in enumerate(cells) if marked] == [10]  # the query token is outlined
    assert error_text(page) == ""
    assert requests == []  # no server round trip
    assert proc.poll() is None

    # the token hovered last is the one an export of the strip holds
    hover_token(page, 5)
    wait_strip(page, "Attention from token 5 ", timeout=5_000)
    with page.expect_download(timeout=120_000) as download:
        page.click("[data-export='token_strip-csv']")
    path = tmp_path / "strip.zip"
    download.value.save_as(path)
    manifest = json.loads(zipfile.ZipFile(path).read("manifest.json"))
    assert manifest["params"]["query"] == 5


def test_every_query_token_is_labelled_and_whitespace_tokens_say_what_they_are(server, page):
    url, _, _ = server
    run_prompt(page, url, "One  two\n\nthree four five six seven eight nine ten eleven twelve thirteen fourteen.")
    wait_for_run(page)
    heat = figure(page, "hs-heatmap")
    n = len(heat["data"][0]["y"])
    assert len(heat["ticks"]) == n and len(heat["xticks"]) == n  # plotly no longer drops every other label
    tokens = page.locator("#hs-strip-tokens [data-pos]").all_text_contents()
    assert len(tokens) == n
    assert any("(newline" in t or "newlines)" in t for t in tokens), tokens
    assert not any(t == "·" or t == "↵" for t in tokens)


def test_run_is_disabled_with_progress_while_a_long_text_runs(server, page):
    url, _, _ = server
    page.goto(url)
    page.fill("#attn-hs-text", long_text(450))
    page.evaluate("""() => { window.seen = {disabled: false, status: []};
        const run = document.querySelector('#attn-hs-run'), status = document.querySelector('#attn-hs-status');
        new MutationObserver(() => { if (run.disabled) window.seen.disabled = true; })
            .observe(run, {attributes: true});
        new MutationObserver(() => window.seen.status.push(status.textContent))
            .observe(status, {childList: true, subtree: true, characterData: true}); }""")
    page.click("#attn-hs-run")
    wait_for_run(page, timeout=240_000)
    seen = page.evaluate("window.seen")
    assert seen["disabled"], "Run stayed enabled while the text ran"
    assert any("Running the model" in s for s in seen["status"]), seen["status"]
    assert "statistics mode" in page.locator("#hs-run-info").inner_text()
    page.wait_for_function("!document.querySelector('#attn-hs-run').disabled", timeout=10_000)
    # done: the bar is empty again, as on a fresh page (it stayed where the last poll left it, often
    # half full), and Cancel is off
    assert page.get_attribute("#attn-hs-progress", "value") == "0"
    assert page.is_disabled("#attn-hs-cancel")


def test_long_text_sink_map_and_exact_zoom_are_on_a_log_scale_with_ticks(server, page):
    url, _, _ = server
    run_prompt(page, url, long_text(450))
    wait_for_run(page, timeout=240_000)
    wait_title(page, "hs-sinks", "Attention received per key")  # drawn after the grid, once per run
    sinks = figure(page, "hs-sinks")
    assert "(log)" in sinks["data"][0]["colorbar"]["title"]["text"]
    assert len(sinks["xticks"]) >= 4  # positions numbered along the axis
    # the title and its details fit beside the modebar, inside the figure (on one line they ran under it)
    graph = page.locator("#hs-sinks .js-plotly-plot").bounding_box()
    modebar = page.locator("#hs-sinks .modebar").bounding_box()
    for line in page.locator("#hs-sinks .gtitle").all() + page.locator("#hs-sinks .gtitle tspan").all():
        box = line.bounding_box()
        if box is None:
            continue
        assert box["x"] + box["width"] <= graph["x"] + graph["width"] and box["y"] >= graph["y"], (box, graph)
        if modebar is not None:
            assert box["y"] + box["height"] <= modebar["y"] or box["x"] + box["width"] <= modebar["x"], (box, modebar)
    wait_title(page, "hs-heatmap", "mean attention per")
    title = page.locator("#hs-heatmap .gtitle").bounding_box()
    modebar = page.locator("#hs-heatmap .modebar").bounding_box() if page.locator("#hs-heatmap .modebar").count() \
        else None
    if modebar is not None:  # the modebar no longer covers the title
        assert title["y"] + title["height"] <= modebar["y"] or title["x"] + title["width"] <= modebar["x"]
    page.goto(page.url + "&region=100-140%2C90-130")
    wait_title(page, "hs-strip", "log colour", timeout=120_000)
    region = figure(page, "hs-strip")
    assert "weight (log)" in region["data"][0]["colorbar"]["title"]["text"]
    assert len(region["ticks"]) == 40 and "100 " in region["ticks"][0]  # every query token labelled


def test_a_job_whose_process_is_killed_says_so_and_run_comes_back(server, page):
    url, proc, _ = server
    run_prompt(page, url, long_text(1400) + " killed")
    deadline = time.time() + 180  # generous: forking the server on a loaded machine
    while not (children := job_children(proc)) and time.time() < deadline:
        time.sleep(0.1)
    assert children, "no job process started"
    time.sleep(0.5)
    for child in children:
        os.kill(child.pid, signal.SIGKILL)
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('The job stopped')",
                           timeout=60_000)  # "within seconds": one poll after the death, 60 s on a loaded machine
    assert "SIGKILL" in error_text(page)
    page.wait_for_function("!document.querySelector('#attn-hs-run').disabled", timeout=5_000)
    assert proc.poll() is None


@pytest.mark.parametrize("method,label", [("umap", "UMAP"), ("tsne", "t-SNE")])
def test_umap_and_tsne_from_the_served_app_finish_and_the_dropdown_says_which(server, page, method, label):
    url, proc, home = server
    log = home / "server.log"
    if method == "umap":  # compiled when first asked for, not at the start, where every first Run waited for it
        assert "compiling UMAP" not in log.read_text()
    page.goto(url + f"qk?layer=3&head=1&sentences=8&method={method}")
    page.wait_for_function("(document.querySelector('#hs-qk-status')?.innerText || '') === 'ready'", timeout=300_000)
    wait_title(page, "hs-qk-scatter", f"({label},")
    points = page.evaluate("document.querySelector('#hs-qk-scatter .js-plotly-plot')._fullData[0]._length")
    assert points > 20  # the queries are drawn
    legend = page.locator("#hs-qk-scatter .legendtext").all_text_contents()
    assert legend[:2] == ["queries", "keys"]
    title, first = (page.locator(f"#hs-qk-scatter {s}").first.bounding_box() for s in (".gtitle", ".legend"))
    assert first["y"] >= title["y"] + title["height"]  # the legend no longer covers the title
    assert label in page.locator("#hs-qk-method").inner_text()
    assert error_text(page) == ""
    assert "fork() called from a process already using GNU OpenMP" not in log.read_text()
    if method == "umap":
        assert log.read_text().count("compiling UMAP") == 1
    assert proc.poll() is None


def test_cancel_stops_a_running_text_without_an_error(server, page):
    url, proc, _ = server
    page.goto(url)
    page.fill("#attn-hs-text", long_text(1400) + " cancelled")
    page.click("#attn-hs-run")
    # Cancel comes with the job's first progress (generous: forking the server on a loaded machine)
    page.wait_for_function("!document.querySelector('#attn-hs-cancel').disabled", timeout=180_000)
    assert page.locator("#attn-hs-run").is_disabled()
    assert job_children(proc)
    page.click("#attn-hs-cancel")
    page.wait_for_function("!document.querySelector('#attn-hs-run').disabled", timeout=10_000)
    time.sleep(3)  # a cancelled job is not reported as one that died
    assert error_text(page) == ""
    assert job_children(proc) == []
    assert "tokens" not in page.locator("#hs-run-info").inner_text()
    # the caption says so, not the last progress ("Running the model: 19%") as if it ran on
    assert page.locator("#attn-hs-status").inner_text().startswith("Cancelled")



def test_run_is_ready_the_moment_the_page_appears(server, page):
    """Loading a page starts no background job: Run is enabled from the first frame it is drawn, and a
    click at once runs the text. (Dash called every page's background job on page load, because the
    job wrote to the app's banner: Run stayed disabled for 7-12 s, and a click then was lost; ten
    sessions clicking Run right after loading left one of them waiting for ever.)"""
    url, _, home = server
    page.add_init_script("""window.__runDisabled = [];
        const watch = () => { const b = document.querySelector('#attn-hs-run');
            if (b) window.__runDisabled.push(b.disabled); requestAnimationFrame(watch); };
        requestAnimationFrame(watch);""")
    jobs_before = (home / "server.log").read_text().count("&job=")
    page.goto(url)
    page.wait_for_selector("#attn-hs-run")
    page.wait_for_timeout(3000)  # the old page-load job kept Run disabled for seconds
    seen = page.evaluate("window.__runDisabled")
    assert seen and not any(seen), f"Run was disabled in {sum(seen)} of {len(seen)} frames after the page appeared"
    assert (home / "server.log").read_text().count("&job=") == jobs_before  # no job polled: none started
    page.fill("#attn-hs-text", "The cat sat on the mat.")
    page.click("#attn-hs-run", timeout=1000)  # enabled: clickable at once
    wait_for_run(page)
    assert page.locator("#hs-error").inner_text() == ""


def test_a_head_clicked_while_the_last_one_is_drawn_is_the_one_shown(server, page):
    """Two grid clicks in a row, the second from at once to 0.8 s after the first (while the first
    head's grid, heatmap and strip are drawn, and plotly hovers again at the last mouse position): the
    page ends on the second head every time. (Plotly reports a click at the point its last hover
    found, and hovers at most every 50 ms: a second click 0.6 s after the first was read as the first
    head, and the page stayed on it, #16.)"""
    url, _, _ = server
    run_prompt(page, url, PROMPT)
    wait_for_run(page)
    box = page.locator("#hs-grid .nsewdrag").first.bounding_box()

    def click(col: int, row: int) -> None:
        page.mouse.click(box["x"] + box["width"] * (col + 0.5) / 9, box["y"] + box["height"] * (row + 0.5) / 30)

    def outlined() -> str:  # the head the grid outlines, as the browser drew it
        return page.evaluate("""() => { const s = (document.querySelector('#hs-grid .js-plotly-plot')._fullLayout.shapes || [])[0];
            return s ? `${s.y0 + 0.5}.${s.x0 + 0.5}` : ''; }""")

    missed = []
    for gap in (0, 100, 200, 300, 400, 500, 600, 700, 800):
        page.wait_for_function("() => document.title !== 'Updating...'")
        first, second = ((2, 4), (5, 7)) if gap % 200 == 0 else ((5, 7), (2, 4))
        click(*first)
        page.wait_for_timeout(gap)
        click(*second)
        try:
            wait_title(page, "hs-heatmap", f"layer {second[1]}, head {second[0]}", timeout=10_000)
        except Exception:
            pass
        settle(page)
        if outlined() != f"{second[1]}.{second[0]}" or f"layer={second[1]}&head={second[0]}" not in page.evaluate("location.search"):
            missed.append(gap)
    assert missed == [], f"the second click was lost when it came {missed} ms after the first"
    assert error_text(page) == ""


GRID_Z = "() => JSON.stringify(document.querySelector('#hs-grid .js-plotly-plot').data[0].z)"
PREVIEW_SHOWN = """() => { const el = document.querySelector('#hs-grid .js-plotly-plot');
    const mark = el && el.layout && el.layout.meta && el.layout.meta.preview;
    return typeof mark === 'string' && !!document.querySelector('#hs-grid .heatmaplayer .hm') ? mark : null; }"""


def test_runs_grid_comes_before_its_run_is_stored_and_goes_if_the_run_is_not(tmp_path, browser):
    """#16's click → grid: Run's job sends the grid as soon as its forward pass ends, while the run is
    written to the store. The test holds the store's index locked (as another writer would), so each
    job waits there with its grid sent:
    - the grid is drawn while the heatmap and run line are not; once the lock goes, the page shows the
      run, and its grid is the one a fresh page draws from the stored run;
    - Cancel while the next Run is storing: its grid goes, the stored run's comes back;
    - the job of the Run after that is killed while storing: the banner says so, and the grid goes back
      too; and a Run whose store write fails at once. Each leaves the URL on the stored run, whose heads
      can still be clicked.
    Then the server starts again on an empty store: the link says its run is not stored and to run the
    text again, and that Run (the same run id as the link's) draws the whole run."""
    import sqlite3

    home = tmp_path / "home"
    env = {**os.environ, "HEADSCOPE_HOME": str(home), "HEADSCOPE_MAX_TOKENS": str(PATTERNS_LIMIT)}
    proc, url = start_server([sys.executable, "-m", "headscope.app.cli", "serve"], env, tmp_path / "server.log")
    context = browser.new_context(viewport={"width": 1400, "height": 1100})
    page = context.new_page()
    index = sqlite3.connect(home / "index.sqlite", isolation_level=None, timeout=60)
    try:
        page.goto(url)
        page.wait_for_selector("#attn-hs-run:not([disabled])", timeout=240_000)
        index.execute("BEGIN EXCLUSIVE")  # a job's store write now waits (up to 30 s) for this lock
        page.fill("#attn-hs-text", PROMPT)
        page.click("#attn-hs-run")
        page.wait_for_function(PREVIEW_SHOWN, timeout=120_000)
        assert page.locator("#hs-heatmap .heatmaplayer .hm").count() == 0
        assert "tokens" not in page.locator("#hs-run-info").inner_text()
        assert page.locator("#attn-hs-run").is_disabled()  # the job is still storing the run
        early = page.evaluate(GRID_Z)
        index.execute("ROLLBACK")
        wait_for_run(page)
        settle(page)
        first_url = page.url
        assert page.evaluate(GRID_Z) == early
        assert page.evaluate(PREVIEW_SHOWN) is None  # stored: no longer a preview to take back
        page.goto(first_url)  # a fresh page draws the grid from the stored run
        wait_for_run(page)
        assert page.evaluate(GRID_Z) == early
        assert error_text(page) == ""

        back = "z => JSON.stringify(document.querySelector('#hs-grid .js-plotly-plot').data[0].z) === z"
        index.execute("BEGIN EXCLUSIVE")
        page.fill("#attn-hs-text", "The river ran under the old stone bridge, and the lamps of the market came on.")
        page.click("#attn-hs-run")
        page.wait_for_function(PREVIEW_SHOWN, timeout=120_000)
        assert page.evaluate(GRID_Z) != early
        page.click("#attn-hs-cancel")
        page.wait_for_function(back, arg=early, timeout=10_000)
        settle(page)
        assert page.evaluate(PREVIEW_SHOWN) is None and page.evaluate(GRID_Z) == early
        assert page.url == first_url and error_text(page) == ""

        page.fill("#attn-hs-text", "Winter letters from the harbor spoke of silver engines and yellow paper.")
        page.click("#attn-hs-run")
        page.wait_for_function(PREVIEW_SHOWN, timeout=120_000)
        assert page.evaluate(GRID_Z) != early
        for child in job_children(proc):
            os.kill(child.pid, signal.SIGKILL)
        page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('The job stopped')",
                               timeout=60_000)
        page.wait_for_function(back, arg=early, timeout=10_000)
        settle(page)
        assert page.evaluate(PREVIEW_SHOWN) is None and page.evaluate(GRID_Z) == early
        assert page.url == first_url
        index.execute("ROLLBACK")

        box = page.locator("#hs-grid .nsewdrag").first.bounding_box()
        page.mouse.click(box["x"] + box["width"] * 4.5 / 9, box["y"] + box["height"] * 7.5 / 30)
        wait_title(page, "hs-heatmap", "layer 7, head 4")
        search = page.evaluate("location.search")
        assert "layer=7&head=4" in search
        assert proc.poll() is None

        # a store that refuses the run at once (a file where its folder would go): the grid comes with
        # the job's end and its error, in one answer or two; either way the page ends on the stored run
        records = home / "records"
        records.rename(home / "records-aside")
        records.mkdir()
        for i in range(256):
            (records / f"{i:02x}").write_text("not a folder")
        grid_now = page.evaluate(GRID_Z)
        page.fill("#attn-hs-text", "Quiet music from the garden reached the window of the orange lamp.")
        page.click("#attn-hs-run")
        page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes("
                               "'The result could not be stored (Not a directory): nothing was stored')", timeout=120_000)
        assert str(home) not in page.locator("#hs-error").inner_text()
        page.wait_for_function(back, arg=grid_now, timeout=10_000)
        settle(page)
        assert page.evaluate(PREVIEW_SHOWN) is None and page.evaluate("location.search") == search

        proc.terminate()
        proc.wait(timeout=20)
        index.close()
        shutil.rmtree(home)
        proc, url = start_server([sys.executable, "-m", "headscope.app.cli", "serve"], env, tmp_path / "server2.log")
        index = sqlite3.connect(":memory:")
        page.goto(url + search)
        page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('Run the text again')",
                               timeout=120_000)
        page.fill("#attn-hs-text", PROMPT)
        page.click("#attn-hs-run")
        wait_for_run(page)
        wait_title(page, "hs-heatmap", "layer 7, head 4")
        assert page.evaluate("location.search") == search
        assert page.evaluate(GRID_Z) == early and page.evaluate(PREVIEW_SHOWN) is None
        assert error_text(page) == ""
    finally:
        if index.in_transaction:
            index.execute("ROLLBACK")
        index.close()
        context.close()
        proc.terminate()
        proc.wait(timeout=20)
