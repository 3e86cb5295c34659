"""The #15 settings in real Chromium: the curve's random-control top N on the Ablation page, and the
needle-depth rule and newline stop of a sweep on the Heads page (shown with the sweep). The server
and browser are tests/app/conftest.py's, the steps tests/app/browsing.py's."""

from __future__ import annotations

import re

import pytest

from tests.app.browsing import run_on_ablation_page, select_option, wait_title

pytestmark = [pytest.mark.browser, pytest.mark.integration]


def test_curve_control_top_n_is_used_shown_and_checked(server, page):
    url, proc, _ = server
    run_on_ablation_page(page, url)
    select_option(page, "hs-abl-by", "Attention on first token")
    page.fill("#hs-abl-k", "2")
    page.click("#hs-abl-topk")
    page.wait_for_function("location.search.includes('by=first_token')")
    page.fill("#hs-abl-curve-ks", "0,2")
    page.fill("#hs-abl-curve-seeds", "1")
    page.fill("#hs-abl-curve-control", "7")
    page.click("#hs-abl-curve-run")
    page.wait_for_function("location.search.includes('curve=') || "
                           "(document.querySelector('#hs-abl-curve-status')?.innerText || '').includes('.')",
                           timeout=240_000)
    assert "curve=" in page.evaluate("location.search"), page.inner_text("#hs-abl-curve-status")
    wait_title(page, "hs-abl-curve", "random from outside the top 7")
    assert "outside the top 7" in page.inner_text("#hs-abl-curve-status")
    assert page.locator("#hs-abl-curve .legend text", has_text="random heads outside the top 7 (mean)").count() == 1
    # a control that leaves too few heads: said plainly, nothing runs
    page.fill("#hs-abl-curve-control", "269")
    page.click("#hs-abl-curve-run")
    page.wait_for_function("(document.querySelector('#hs-abl-curve-status')?.innerText || '')"
                           ".includes('outside the top 269')")
    assert proc.poll() is None


def _watch_text(page, selector: str, flag: str) -> None:
    """Collect in ``window[flag]`` every text ``selector`` shows from now on."""
    page.evaluate("""([s, f]) => { window[f] = []; const el = document.querySelector(s);
        new MutationObserver(() => window[f].push(el.innerText))
            .observe(el, {childList: true, subtree: true, characterData: true}); }""", [selector, flag])


def test_curve_and_head_sweep_progress_count_items_and_estimate_the_time_left(server, page):
    """Issue #16: the curve's and the single-head sweep's progress said a bare percentage; they say
    "curve point i of n" (n = k values × (1 + seeds)) and "head i of n" with the time left."""
    url, proc, _ = server
    run_on_ablation_page(page, url)
    select_option(page, "hs-abl-by", "Attention on first token")
    page.wait_for_function("location.search.includes('by=first_token')")
    page.fill("#hs-abl-curve-ks", "0,1,2,3")
    page.fill("#hs-abl-curve-seeds", "3")
    _watch_text(page, "#hs-abl-curve-status", "__curve")
    page.click("#hs-abl-curve-run")
    page.wait_for_function("location.search.includes('curve=')", timeout=240_000)
    shown = page.evaluate("window.__curve")
    counted = [t for t in shown if re.fullmatch(r"curve point \d+ of 16 \(\d+%\)(, about \d+ (s|min) left)?", t)]
    assert counted, shown
    assert any("left" in t for t in counted), shown
    assert not any(re.fullmatch(r"curve: \d+%", t) for t in shown), shown

    _watch_text(page, "#hs-abl-sweep-status", "__sweep")
    page.click("#hs-abl-sweep-run")
    page.wait_for_function("location.search.includes('hsweep=')", timeout=240_000)
    shown = page.evaluate("window.__sweep")
    counted = [t for t in shown if re.fullmatch(r"head \d+ of 270 \(\d+%\)(, about \d+ (s|min) left)?", t)]
    assert counted, shown
    assert any("left" in t for t in counted), shown
    assert proc.poll() is None


def test_sweep_depth_rule_and_newline_stop_are_sweep_settings_shown_with_it(server, page):
    url, proc, _ = server
    page.goto(url + "heads")
    page.wait_for_selector("#hs-heads-run")
    page.fill("#hs-heads-custom-needles", "The secret passkey is 7731. | What is the secret passkey? | 7731")
    page.fill("#hs-heads-lengths", "160")
    page.fill("#hs-heads-depths", "50")
    select_option(page, "hs-heads-haystack", "passkey")
    page.check("#hs-heads-depth-rule input[value='previous']")
    page.check("#hs-heads-stop-newline input[value='on']")
    page.click("#hs-heads-run")
    page.wait_for_function("location.search.includes('sweep=')", timeout=240_000)
    page.wait_for_function("(document.querySelector('.hs-run-info')?.innerText || '')"
                           ".includes('needle at the previous sentence boundary; decoding stops at EOS or the "
                           "first newline')")
    assert proc.poll() is None
