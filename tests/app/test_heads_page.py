"""The Heads page in real Chromium against a real server on the embedded model: errors in the app's
banner, sweep progress counted in trials, top-20 rows that open a head, and a key to the decode-step
markers. Sweeps are one needle at 256 tokens in the synthetic haystack (a few seconds a trial)."""

from __future__ import annotations

import re

import pytest

from tests.app.browsing import error_text, select_option, wait_title

NEEDLE = "The secret passkey is 7731. | What is the secret passkey? | 7731"


def open_heads(page, url):
    page.goto(url + "heads")
    page.wait_for_selector("#hs-heads-run")


@pytest.mark.browser
@pytest.mark.integration
def test_a_sweep_error_shows_in_the_banner_like_other_pages(server, page):
    url, proc, _ = server
    open_heads(page, url)
    page.fill("#hs-heads-custom-needles", "The secret passkey is 7731. | What is the secret passkey?")
    page.click("#hs-heads-run")
    assert "needle | question | answer" in error_text(page)
    assert page.locator("#hs-error").get_attribute("role") == "alert"
    assert "needle | question | answer" not in page.locator("#hs-heads-status").inner_text()
    # a good sweep afterwards clears the banner
    page.fill("#hs-heads-custom-needles", NEEDLE)
    page.fill("#hs-heads-lengths", "256")
    page.fill("#hs-heads-depths", "50")
    select_option(page, "hs-heads-haystack", "passkey")
    page.click("#hs-heads-run")
    page.wait_for_function("location.search.includes('sweep=')", timeout=240_000)
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').trim() === ''")
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
def test_sweep_progress_counts_trials_and_estimates_the_time_left(server, page):
    url, proc, _ = server
    open_heads(page, url)
    page.fill("#hs-heads-custom-needles", NEEDLE)
    page.fill("#hs-heads-lengths", "256")
    page.fill("#hs-heads-depths", "20,60,90")
    select_option(page, "hs-heads-haystack", "passkey")
    # every caption the progress bar shows, as the user sees it change
    page.evaluate("""() => {
        window.__captions = [];
        const el = document.querySelector('#hs-heads-status');
        new MutationObserver(() => window.__captions.push(el.innerText))
            .observe(el, {childList: true, characterData: true, subtree: true});
    }""")
    page.click("#hs-heads-run")
    page.wait_for_function("location.search.includes('sweep=')", timeout=300_000)
    captions = page.evaluate("window.__captions")
    counted = [c for c in captions if re.search(r"trial [123] of 3", c)]
    assert counted, captions
    assert any(re.search(r"trial [23] of 3.*about \d+ (s|min) left", c) for c in captions), captions
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
def test_a_top_20_row_opens_that_head_like_its_map_cell(server, page):
    url, proc, _ = server
    open_heads(page, url)
    page.fill("#hs-heads-custom-needles", NEEDLE)
    page.fill("#hs-heads-lengths", "256")
    page.fill("#hs-heads-depths", "50")
    select_option(page, "hs-heads-haystack", "passkey")
    page.click("#hs-heads-run")
    page.wait_for_function("location.search.includes('sweep=')", timeout=240_000)
    page.wait_for_selector("#hs-heads-topk td[data-dash-column='head']")
    row = page.locator("#hs-heads-topk tbody tr").nth(3)  # the third head (row 0 is the header)
    layer = int(row.locator("td[data-dash-column='layer']").inner_text())
    head = int(row.locator("td[data-dash-column='head']").inner_text())
    row.locator("td[data-dash-column='retrieval']").click()
    page.wait_for_function(f"location.search.includes('layer={layer}&') || location.search.endsWith('layer={layer}')")
    assert f"head={head}" in page.evaluate("location.search")
    page.wait_for_selector("#hs-heads-trials td[data-dash-column='response']")
    wait_title(page, "hs-heads-steps", f"Layer {layer}, head {head}, trial 0")
    # the decode-step markers say what they are
    legend = " ".join(page.locator("#hs-heads-steps .legendtext").all_text_contents())
    assert "copy-paste" in legend and "most-attended key" in legend, legend
    assert proc.poll() is None


def test_trial_progress_counts_trials_and_scales_the_time_so_far(tmp_path):
    """Three trials; the first takes 10 s: then "trial 2 of 3" and 10 s × (2/3) / (1/3) = 20 s left."""
    from headscope.analysis.store import Store
    from headscope.app.context import AppContext
    from headscope.app.server import create_app

    create_app(AppContext(store=Store(tmp_path / "store")))  # registers the pages
    from headscope.app.jobs import (
        trial_progress,  # not app.pages.*: Dash loads pages as pages.*, a second import registers them twice
    )

    now, shown = [0.0], []
    report = trial_progress(shown.append, 3, clock=lambda: now[0])
    report(0.0)
    report(0.5 / 3)  # half of the first trial
    now[0] = 10.0
    report(1 / 3)
    report(1 / 3)  # the same again: not shown twice
    now[0] = 25.0
    report(1.0)
    assert [text for _, _, text in shown] == [
        "trial 1 of 3 (0%)", "trial 1 of 3 (16%)", "trial 2 of 3 (33%), about 20 s left", "trial 3 of 3 (100%)"]
    assert shown[-1][:2] == (100, 100)


def test_count_progress_names_its_items_and_estimates_the_time_left(tmp_path):
    """The Ablation page's sweep of 270 heads, reported a layer (9 heads) at a time: "head i of n", and
    after the first layer took 6 s, 6 s × (261/270) / (9/270) = 174 s, shown as 3 min."""
    from headscope.app.jobs import count_progress

    now, shown = [0.0], []
    report = count_progress(shown.append, 270, "head", clock=lambda: now[0])
    report(0.0)
    now[0] = 6.0
    report(9 / 270)
    now[0] = 60.0
    report(1.0)
    assert [text for _, _, text in shown] == [
        "head 1 of 270 (0%)", "head 10 of 270 (3%), about 3 min left", "head 270 of 270 (100%)"]


FIGURES = ("hs-heads-grid", "hs-heads-hist", "hs-heads-scatter", "hs-heads-niah", "hs-heads-score-grid",
           "hs-heads-mass", "hs-heads-steps")
# the figure objects Dash holds for the page's graphs, kept to be compared after a click
KEEP_FIGURES = "ids => { window.__figures = Object.fromEntries(ids.map(id => [id, window.dash_component_api.getLayout(id).props.figure])); }"
UNTOUCHED = "ids => ids.filter(id => window.dash_component_api.getLayout(id).props.figure === window.__figures[id])"


def _asked(requests: list[str]) -> set[str]:
    """The components whose properties the server was asked for (every callback request names its outputs)."""
    import json

    out = set()
    for body in requests:
        output = json.loads(body).get("output", "")
        out |= {part.split(".")[0] for part in output.strip(".").split("...") if part}
    return out


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(600)  # a one-trial sweep on a loaded 2-core machine
def test_a_click_redraws_only_the_figures_that_show_what_it_changed(server, page):
    from tests.app.browsing import click_cell, settle

    url, proc, _ = server
    open_heads(page, url)
    page.fill("#hs-heads-custom-needles", NEEDLE)
    page.fill("#hs-heads-lengths", "160")
    page.fill("#hs-heads-depths", "35")
    select_option(page, "hs-heads-haystack", "passkey")
    page.click("#hs-heads-run")
    page.wait_for_function("location.search.includes('sweep=')", timeout=400_000)
    page.wait_for_selector("#hs-heads-grid .heatmaplayer .hm")
    wait_title(page, "hs-heads-score-grid", "Streaming score")
    page.wait_for_selector("#hs-heads-topk td[data-dash-column='head']")
    settle(page)
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.post_data) if "_dash-update-component" in r.url else None)

    # a head on the map: its outline on both maps, its trials and decode steps; the rest stays as drawn
    layer = int(page.locator("#hs-heads-topk td[data-dash-column='layer']").first.inner_text())
    head = int(page.locator("#hs-heads-topk td[data-dash-column='head']").first.inner_text())
    page.evaluate(KEEP_FIGURES, list(FIGURES))
    click_cell(page, "hs-heads-grid", col=head, row=layer, n_cols=9, n_rows=30)
    wait_title(page, "hs-heads-steps", f"Layer {layer}, head {head}, trial 0", timeout=240_000)
    page.wait_for_selector("#hs-heads-trials td[data-dash-column='response']")
    settle(page)
    assert set(page.evaluate(UNTOUCHED, list(FIGURES))) == {"hs-heads-hist", "hs-heads-scatter", "hs-heads-niah",
                                                            "hs-heads-mass"}
    asked = _asked(requests)
    assert asked & {"hs-heads-hist", "hs-heads-scatter", "hs-heads-niah", "hs-heads-mass", "hs-heads-topk"} == set(), asked
    outlines = page.evaluate("""() => ['hs-heads-grid', 'hs-heads-score-grid'].map(id => {
        const s = (document.querySelector('#' + id + ' .js-plotly-plot')._fullLayout.shapes || [])[0];
        return s ? [s.y0 + 0.5, s.x0 + 0.5] : null; })""")
    assert outlines == [[layer, head], [layer, head]]

    # a trial: its decode steps only
    requests.clear()
    page.evaluate(KEEP_FIGURES, list(FIGURES))
    page.locator("#hs-heads-trials td[data-dash-column='response']").first.click()
    page.wait_for_function("new URLSearchParams(location.search).get('trial') === '0'")
    settle(page)
    assert set(page.evaluate(UNTOUCHED, list(FIGURES))) == set(FIGURES) - {"hs-heads-steps"}
    asked = _asked(requests)
    assert asked <= {"hs-heads-steps", "heads-hs-url"}, asked

    # another head, then the same trial row again: that trial of this head (the row stayed chosen, so
    # the click changed nothing and the page did nothing)
    other = (layer + 1) % 30
    click_cell(page, "hs-heads-grid", col=head, row=other, n_cols=9, n_rows=30)
    wait_title(page, "hs-heads-steps", f"Layer {other}, head {head}, trial 0", timeout=240_000)
    settle(page)
    page.wait_for_function("!new URLSearchParams(location.search).has('trial')")
    page.locator("#hs-heads-trials td[data-dash-column='response']").first.click()
    page.wait_for_function("new URLSearchParams(location.search).get('trial') === '0'", timeout=30_000)
    assert proc.poll() is None


def _sweep_refused(page, said: str = "") -> str:
    """Wait until the page either refuses the sweep (a message saying ``said`` in the banner) or shows
    one; the banner."""
    page.wait_for_function("said => { const text = (document.querySelector('#hs-error')?.innerText || '').trim(); "
                           "return (text !== '' && text.includes(said)) || location.search.includes('sweep='); }",
                           arg=said, timeout=400_000)
    assert "sweep=" not in page.evaluate("location.search"), "the sweep ran and was shown"
    return error_text(page)


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_streaming_window_as_long_as_the_prompt_is_refused_as_the_cli_refuses_it(server, page):
    """S + W at least the context length leaves the streaming score no query row: refused before the
    sweep runs, with the message ``headscope scan`` gives (one rule, :func:`headscope.analysis.niah.check_streaming_window`)."""
    url, proc, _ = server
    open_heads(page, url)
    page.fill("#hs-heads-custom-needles", NEEDLE)
    page.fill("#hs-heads-lengths", "160")
    page.fill("#hs-heads-depths", "50")
    page.fill("#hs-heads-sink", "100")
    page.fill("#hs-heads-window", "60")
    select_option(page, "hs-heads-haystack", "passkey")
    page.click("#hs-heads-run")
    shown = _sweep_refused(page)
    from headscope.analysis.errors import InputError
    from headscope.analysis.niah import check_streaming_window

    with pytest.raises(InputError) as cli:
        check_streaming_window(100, 60, [160])
    assert str(cli.value) in shown and "S + W = 160 leaves no query rows to score in a 160-token prompt" in shown
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_own_needles_whose_fields_are_not_text_are_refused(server, page):
    """JSON needles with a null, a number or a list where text belongs: refused with the field named
    (it was read as "None", "7731" or "['a']" and swept)."""
    url, proc, _ = server
    open_heads(page, url)
    page.fill("#hs-heads-lengths", "160")
    page.fill("#hs-heads-depths", "50")
    select_option(page, "hs-heads-haystack", "passkey")
    for field, value, said in (("answer", "null", "got null"), ("answer", "7731", "got a number"),
                               ("needle", '["The secret passkey is 7731."]', "got a list")):
        needle = {"needle": '"The secret passkey is 7731."', "question": '"What is the secret passkey?"',
                  "answer": '"7731"', field: value}
        page.fill("#hs-heads-custom-needles", "[{" + ", ".join(f'"{k}": {v}' for k, v in needle.items()) + "}]")
        page.wait_for_function("!document.querySelector('#hs-heads-run').disabled")
        page.click("#hs-heads-run")
        shown = _sweep_refused(page, f"field '{field}' must be a string, {said}")
        assert f"field '{field}' must be a string, {said}" in shown, shown
    assert proc.poll() is None
