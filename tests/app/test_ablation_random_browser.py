"""The Ablation page's "Random k" in real Chromium (#38 item 19): it draws by the curve's rule
(:func:`headscope.analysis.ablation_curve.random_control`), from outside the top N heads by the score chosen,
N being the curve's "random heads from outside the top" box, and says so beside the button."""

from __future__ import annotations

import pytest

from tests.app.browsing import run_on_ablation_page, select_option

pytestmark = [pytest.mark.browser, pytest.mark.integration]


def chosen(page) -> set[tuple[int, int]]:
    text = page.input_value("#hs-abl-heads")
    return {(int(a), int(b)) for a, b in (h.strip().split(".") for h in text.split(",") if h.strip())}


def press(page, button: str) -> set[tuple[int, int]]:
    """Press ``button`` and wait until the heads box changes; the heads it then holds."""
    before = page.input_value("#hs-abl-heads")
    page.click(button)
    page.wait_for_function("b => document.querySelector('#hs-abl-heads').value !== b", arg=before, timeout=60_000)
    return chosen(page)


def test_random_k_never_picks_a_head_of_the_top_n_and_says_so(server, page):
    url, proc, _ = server
    run_on_ablation_page(page, url)
    select_option(page, "hs-abl-by", "Attention on first token")
    page.wait_for_function("location.search.includes('by=first_token')")
    rule = page.inner_text("#hs-abl-random-rule")
    assert "outside the top 20" in rule and "curve" in rule, rule  # said beside the button, before a draw

    page.fill("#hs-abl-k", "20")
    top20 = press(page, "#hs-abl-topk")
    assert len(top20) == 20
    drawn = set()
    for seed in range(12):  # with all 270 heads to draw from, 20 heads miss the top 20 one time in five
        page.fill("#hs-abl-seed", str(seed))
        heads = press(page, "#hs-abl-random")
        assert len(heads) == 20 and not heads & top20, (seed, sorted(heads & top20))
        drawn |= heads
    assert len(drawn) > 100  # seeded draws, not one set
    assert "outside the top 20" in page.inner_text("#hs-abl-random-rule")

    # the curve's box sets N for the button too
    page.fill("#hs-abl-curve-control", "60")
    page.fill("#hs-abl-k", "60")
    top60 = press(page, "#hs-abl-topk")
    page.fill("#hs-abl-k", "5")
    for seed in range(12, 20):
        page.fill("#hs-abl-seed", str(seed))
        heads = press(page, "#hs-abl-random")
        assert len(heads) == 5 and not heads & top60, (seed, sorted(heads & top60))
    page.wait_for_function("() => document.querySelector('#hs-abl-random-rule').innerText.includes('top 60')")
    assert proc.poll() is None
