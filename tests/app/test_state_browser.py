"""State across pages, in real Chromium against a real server on the embedded model: nav links carry
the text's run, a Heads link of a sweep fills the form with that sweep's settings, a QK link fills
the QK controls and draws on landing (issue #16 item 7)."""

from __future__ import annotations

from urllib.parse import parse_qs, urlparse

import pytest

from tests.app.browsing import click_cell, wait_for_run, wait_title

pytestmark = [pytest.mark.browser, pytest.mark.integration]

TEXT = "The cat sat on the mat."


def _query(url: str) -> dict[str, str]:
    return {k: v[0] for k, v in parse_qs(urlparse(url).query).items()}


def _nav(page, name: str, path: str) -> None:
    page.locator(".hs-nav").get_by_role("link", name=name, exact=True).click()
    page.wait_for_function("p => location.pathname === p", arg=path)


@pytest.mark.timeout(600)
def test_nav_links_carry_the_text_and_run_across_every_page(server, page):
    url, proc, _ = server
    page.goto(url)
    page.fill("#attn-hs-text", TEXT)
    page.click("#attn-hs-run", timeout=240_000)  # enabled once the page's first render is done
    wait_for_run(page, timeout=240_000)
    run = _query(page.url)["run"]
    tokens = page.locator("#hs-run-info").inner_text()

    _nav(page, "Flow", "/flow")
    assert _query(page.url)["run"] == run
    page.wait_for_function("t => document.querySelector('#flow-hs-text')?.value === t", arg=TEXT, timeout=120_000)
    _nav(page, "Heads", "/heads")
    assert _query(page.url)["run"] == run
    _nav(page, "QK space", "/qk")
    assert _query(page.url)["run"] == run
    _nav(page, "Ablation", "/ablation")
    assert _query(page.url)["run"] == run
    page.wait_for_function("t => document.querySelector('#abl-hs-text')?.value === t", arg=TEXT, timeout=120_000)
    _nav(page, "Attention", "/")
    assert _query(page.url)["run"] == run
    wait_for_run(page, timeout=120_000)
    assert page.input_value("#attn-hs-text") == TEXT
    assert page.locator("#hs-run-info").inner_text() == tokens  # the same run's tokens
    assert proc.poll() is None


def test_a_qk_link_fills_the_controls_and_draws_on_landing(server, page):
    url, proc, _ = server
    page.goto(url + "qk?layer=5&head=3&sentences=12&colour=kind&find=the")
    wait_title(page, "hs-qk-scatter", "Layer 5, head 3: joint query-key embedding (PCA", timeout=240_000)
    assert page.input_value("#hs-qk-layer") == "5" and page.input_value("#hs-qk-head") == "3"
    assert page.input_value("#hs-qk-sentences") == "12"
    assert page.input_value("#hs-qk-find") == "the"
    assert "kind" in page.locator("#hs-qk-colour").inner_text()
    # the next link without a search clears the box
    page.goto(url + "qk?layer=2&head=1&sentences=12")
    wait_title(page, "hs-qk-scatter", "Layer 2, head 1", timeout=240_000)
    assert page.input_value("#hs-qk-find") == ""
    assert proc.poll() is None


@pytest.mark.timeout(600)
def test_a_heads_link_fills_the_form_from_the_sweeps_own_settings(server, page, browser):
    url, proc, _ = server
    page.goto(url + "heads")
    page.wait_for_selector("#hs-heads-run")
    page.fill("#hs-heads-custom-needles", "The vault code is 4412. | What is the vault code? | 4412")
    page.fill("#hs-heads-lengths", "200")
    page.fill("#hs-heads-depths", "40")
    page.fill("#hs-heads-sink", "2")
    page.fill("#hs-heads-window", "16")
    page.click("#hs-heads-haystack")
    page.locator(".dash-dropdown-options").get_by_role("option", name="passkey").first.click()  # not the task
    page.check("#hs-heads-depth-rule input[value='previous']")
    page.check("#hs-heads-stop-newline input[value='on']")
    page.click("#hs-heads-run")
    page.wait_for_function("location.search.includes('sweep=')", timeout=480_000)
    link = page.url
    sweep = _query(link)["sweep"]

    # a fresh browser (no remembered form values) opens the link: the form shows the sweep's settings
    context = browser.new_context(viewport={"width": 1400, "height": 1100})
    other = context.new_page()
    other.set_default_timeout(60_000)
    try:
        other.goto(link)
        other.wait_for_function("document.querySelector('#hs-heads-lengths')?.value === '200'", timeout=120_000)
        assert "filled from sweep" in other.locator("#hs-heads-form-note").inner_text()  # and it says so
        assert other.input_value("#hs-heads-custom-needles") == "The vault code is 4412. | What is the vault code? | 4412"
        assert other.input_value("#hs-heads-lengths") == "200"
        assert other.input_value("#hs-heads-depths") == "40"
        assert other.input_value("#hs-heads-sink") == "2" and other.input_value("#hs-heads-window") == "16"
        assert "passkey" in other.locator("#hs-heads-haystack").inner_text()
        assert other.is_checked("#hs-heads-depth-rule input[value='previous']")
        assert other.is_checked("#hs-heads-stop-newline input[value='on']")
        assert other.locator("#hs-heads-needles input:checked").count() == 0
        # Run reruns exactly those settings: the same sweep (its trials reused)
        other.click("#hs-heads-run")
        other.wait_for_function("(document.querySelector('#hs-heads-status')?.innerText || '').includes('trials answered')",
                                timeout=240_000)
        assert _query(other.url)["sweep"] == sweep
    finally:
        context.close()
    assert proc.poll() is None


def test_text_typed_while_a_link_loads_or_after_its_run_is_drawn_is_never_replaced(server, page):
    """The page fills the text box from the run its link names. It replaced what the user had typed:
    text typed while the link's run was still loading, and an edit made after the run was drawn, as
    soon as a head click drew the same run again."""
    url, proc, _ = server
    page.goto(url)
    page.fill("#attn-hs-text", TEXT)
    page.click("#attn-hs-run", timeout=240_000)
    wait_for_run(page, timeout=240_000)
    link, tokens = page.url, page.locator("#hs-run-info").inner_text()

    # an edit, then a head click: the same run is drawn for another head; the edit stays
    page.fill("#attn-hs-text", "An edit not yet run.")
    click_cell(page, "hs-grid", col=2, row=4, n_cols=9, n_rows=30)
    wait_title(page, "hs-heatmap", "layer 4, head 2")
    page.wait_for_load_state("networkidle")
    assert page.input_value("#attn-hs-text") == "An edit not yet run."

    # the link opened afresh over a slow network (every response 1.5 s late, as Chromium's DevTools
    # throttle it), the user typing as soon as the box is there, before the run's render has answered
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": 1500, "downloadThroughput": -1,
                                                  "uploadThroughput": -1})
    page.goto(link)
    page.fill("#attn-hs-text", "My own words.", timeout=240_000)
    assert "tokens" not in page.locator("#hs-run-info").inner_text()  # typed before the run was drawn
    cdp.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0, "downloadThroughput": -1,
                                                  "uploadThroughput": -1})
    wait_title(page, "hs-heatmap", "Attention of layer 0, head 0", timeout=120_000)  # the link, from before the click
    page.wait_for_load_state("networkidle")
    assert page.input_value("#attn-hs-text") == "My own words."
    assert page.locator("#hs-run-info").inner_text() == tokens  # the link's run is drawn all the same

    # a link to a run, opened without typing: the box shows the run's text
    page.goto(link)
    page.wait_for_function("t => document.querySelector('#attn-hs-text')?.value === t", arg=TEXT, timeout=120_000)

    # a head click, then Back: the page is rebuilt (the box emptied), and the run's text comes back
    click_cell(page, "hs-grid", col=2, row=4, n_cols=9, n_rows=30)
    wait_title(page, "hs-heatmap", "layer 4, head 2")
    page.go_back()
    wait_title(page, "hs-heatmap", "Attention of layer 0, head 0", timeout=120_000)
    page.wait_for_function("t => document.querySelector('#attn-hs-text')?.value === t", arg=TEXT, timeout=30_000)
    assert proc.poll() is None
