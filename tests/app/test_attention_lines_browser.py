"""What the Attention page's lines say is true, in real Chromium (#38 item 25): a Run refused (an empty
text) leaves no "Running the model…" behind; the run's chip says how this text became tokens (read as
written, never wrapped in the chat template, whatever the model has); the sink map says how long a
text must be to call sinks, not a count that reads as enough."""

from __future__ import annotations

import pytest

from tests.app.browsing import run_prompt, wait_for_run, wait_title

pytestmark = [pytest.mark.browser, pytest.mark.integration]

SIXTEEN = "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"


def status(page) -> str:
    return page.evaluate("(document.querySelector('#attn-hs-status')?.innerText || '')")


def test_an_empty_run_says_it_did_not_run(server, page):
    url, proc, _ = server
    page.goto(url)
    page.wait_for_selector("#attn-hs-run:not([disabled])", timeout=240_000)
    # each message differs from the one before, so the banner's change marks the end of each job
    for text, said in (("", "The text is empty"), ("x" * 200_000, "context of 8,192 tokens"),
                       ("   \n\t ", "The text is empty")):
        page.fill("#attn-hs-text", text)
        page.click("#attn-hs-run", timeout=120_000)
        page.wait_for_function("t => (document.querySelector('#hs-error')?.innerText || '').includes(t)", arg=said,
                               timeout=120_000)
        page.wait_for_function("() => !document.querySelector('#attn-hs-run').disabled", timeout=60_000)  # job over
        page.wait_for_timeout(1500)  # a late progress report would land by now
        assert status(page).startswith("Not run"), status(page)
        assert "Running the model" not in status(page)
    assert "run=" not in page.evaluate("location.search")
    assert proc.poll() is None


def test_the_run_chip_and_sink_map_say_what_is_true_of_a_16_token_text(server, page):
    url, proc, _ = server
    run_prompt(page, url, SIXTEEN)
    wait_for_run(page, timeout=240_000)
    chips = page.inner_text("#hs-run-info")
    assert "16 tokens" in chips, chips
    # SmolLM2-Instruct has a chat template; a text run on this page is not wrapped in it
    assert "chat template: yes" not in chips and "text as written, no chat template applied" in chips, chips
    wait_title(page, "hs-sinks", "too short to call sinks", timeout=120_000)
    title = page.locator("#hs-sinks .gtitle").text_content()
    assert "at least 17 tokens" in title and "this one has 16" in title, title
    assert not status(page).startswith("Running"), status(page)
    assert proc.poll() is None
