"""Long actions show that they are busy from the click, the same way on every page (app.components
show_busy, assets/busy.js), in real Chromium against a real ``headscope serve``: the status line
says so before the job's first progress report, an old message in the banner goes when the job
starts, and the figures the job will replace are marked out of date until it ends.

What the page showed is recorded in the browser as it changed (a timeline of status lines, banner,
figure classes and progress bar), so a state shorter than a poll is seen. Inputs are the smallest
that take long enough to watch: a one-trial sweep, four probe sentences, a cancelled compression.
"""

from __future__ import annotations

import pytest

from tests.app.browsing import select_option

NEEDLE = "The secret passkey is 7731. | What is the secret passkey? | 7731"
STALE = "--hs-stale"  # the flag in a figure's style (headscope.app.busy.STALE)

# From now on, every change of the watched elements, in order: [ms, what, value]; "click" when the
# button is pressed. A figure's value is its style attribute, a progress bar's its value attribute.
WATCH = """([button, status, progress, figures]) => {
    const log = window.__timeline = [];
    const now = () => Math.round(performance.now());
    const text = el => (el.innerText || '').trim();
    const watch = (selector, what, read, options) => {
        const el = document.querySelector(selector);
        log.push([now(), what, read(el)]);
        new MutationObserver(() => log.push([now(), what, read(el)])).observe(el, options);
    };
    const texts = {childList: true, subtree: true, characterData: true};
    watch(status, 'status', text, texts);
    watch('#hs-error', 'banner', text, texts);
    watch(progress, 'progress', el => el.getAttribute('value'), {attributes: true, attributeFilter: ['value']});
    figures.forEach(f => watch('#' + f, f, el => el.getAttribute('style') || '', {attributes: true, attributeFilter: ['style']}));
    document.querySelector(button).addEventListener('click', () => log.push([now(), 'click', '']), true);
}"""


def watch(page, button: str, status: str, progress: str, figures: list[str]) -> None:
    page.evaluate(WATCH, [button, status, progress, figures])


def timeline(page) -> list[tuple[int, str, str]]:
    return [tuple(e) for e in page.evaluate("window.__timeline")]


def after_click(events: list) -> list:
    clicks = [i for i, e in enumerate(events) if e[1] == "click"]
    assert clicks, f"the click was not seen: {events}"
    return events[clicks[-1]:]


def first(events: list, what: str, test) -> tuple | None:
    return next((e for e in events if e[1] == what and test(e[2])), None)


def assert_busy_from_the_click(events: list, report: str, figures: list[str], within_ms: int = 5_000) -> None:
    """From the click: the status line is never blank until the job's first ``report`` (a piece of its
    progress caption), the banner is emptied and every figure marked stale before that report, all
    within ``within_ms`` of the click. Every one of these that fails is named."""
    shown = [e[2] for e in events[:events.index(after_click(events)[0])] if e[1] == "banner"]
    empty_already = bool(shown) and shown[-1] == ""  # no old message to clear
    events = after_click(events)
    clicked = events[0][0]
    progressed = first(events, "status", lambda v: report in v)
    assert progressed, f"no progress report {report!r} after the click: {events}"
    before = [e for e in events if e[0] <= progressed[0] and e is not progressed]
    soon = [e for e in before if e[0] - clicked <= within_ms]
    problems = []
    captions = [e[2] for e in before if e[1] == "status"]
    if not (captions and all(captions) and first(soon, "status", bool)):
        problems.append(f"the status line was blank after the click: {captions}")
    if not (empty_already or first(soon, "banner", lambda v: v == "")):
        problems.append("the old message stayed up as the job started")
    problems += [f"#{f} was not marked out of date" for f in figures if not first(soon, f, lambda v: STALE in v)]
    assert problems == [], f"{problems}: {events}"


def assert_unmarked(page, figures: list[str]) -> None:
    page.wait_for_function("([fs, flag]) => fs.every(f => !(document.getElementById(f).getAttribute('style') || '')"
                           ".includes(flag))", arg=[figures, STALE], timeout=60_000)


def banner(page) -> str:
    return page.locator("#hs-error").inner_text().strip()


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(600)  # a one-trial sweep on a loaded 2-core machine
def test_a_sweep_is_busy_from_the_click_clears_an_old_message_and_marks_what_it_replaces(server, page):
    url, proc, _ = server
    page.goto(url + "heads")
    page.wait_for_selector("#hs-heads-run", timeout=240_000)
    page.fill("#hs-heads-custom-needles", "The secret passkey is 7731. | What is the secret passkey?")
    page.click("#hs-heads-run")
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('needle | question')",
                           timeout=120_000)
    page.wait_for_function("!document.querySelector('#hs-heads-run').disabled")
    page.fill("#hs-heads-custom-needles", NEEDLE)
    page.fill("#hs-heads-lengths", "160")
    page.fill("#hs-heads-depths", "35")
    select_option(page, "hs-heads-haystack", "passkey")
    figures = ["hs-heads-grid", "hs-heads-niah", "hs-heads-score-grid"]
    watch(page, "#hs-heads-run", "#hs-heads-status", "#hs-heads-progress", figures)
    page.click("#hs-heads-run")
    page.wait_for_function("location.search.includes('sweep=')", timeout=400_000)
    assert_busy_from_the_click(timeline(page), "trial", figures)
    assert_unmarked(page, figures)
    page.wait_for_selector("#hs-heads-grid .heatmaplayer .hm")
    assert banner(page) == ""
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(600)  # a one-trial sweep (reused when the test above stored it) and the start of a curve
def test_a_new_niah_curve_is_busy_from_the_click_and_marks_the_old_curve(server, page):
    url, proc, _ = server
    page.goto(url + "heads")
    page.wait_for_selector("#hs-heads-run", timeout=240_000)
    page.fill("#hs-heads-custom-needles", NEEDLE)
    page.fill("#hs-heads-lengths", "160")
    page.fill("#hs-heads-depths", "35")
    select_option(page, "hs-heads-haystack", "passkey")
    page.click("#hs-heads-run")
    page.wait_for_function("location.search.includes('sweep=')", timeout=400_000)
    page.click("#hs-heads-ablate-link")
    page.wait_for_function("location.pathname == '/ablation' && location.search.includes('by=retrieval')")
    page.goto(page.url + "&layer=abc")  # a message about the link in the banner, as a user may have left it
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('abc')", timeout=120_000)
    page.wait_for_selector("#hs-abl-curve-run", timeout=120_000)
    page.fill("#hs-abl-curve-ks", "0,3")
    page.fill("#hs-abl-curve-seeds", "1")
    page.check("#hs-abl-curve-metric input[value='niah']")
    figures = ["hs-abl-curve"]
    watch(page, "#hs-abl-curve-run", "#hs-abl-curve-status", "#hs-abl-curve-progress", figures)
    page.click("#hs-abl-curve-run")
    page.wait_for_function("/ of |%/.test(document.querySelector('#hs-abl-curve-status')?.innerText || '')",
                           timeout=240_000)
    assert_busy_from_the_click(timeline(page), "%", figures)
    page.click("#hs-abl-curve-cancel")
    page.wait_for_function("!document.querySelector('#hs-abl-curve-run').disabled", timeout=240_000)
    assert_unmarked(page, figures)
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(600)  # UMAP's code compiles once per server (10-20 s quiet, minutes loaded)
def test_a_new_projection_is_busy_from_the_click_not_ready_at_100_percent(server, page):
    url, proc, _ = server
    # a PCA plot with a message about the link (an unknown colour), as a user left them
    page.goto(url + "qk?layer=3&head=0&sentences=4&colour=nope")
    page.wait_for_function("(document.querySelector('#hs-qk-status')?.innerText || '') === 'ready'", timeout=240_000)
    page.wait_for_function("(document.querySelector('#hs-qk-scatter .gtitle')?.textContent || '').includes('PCA')")
    assert "colour" in banner(page).lower()
    select_option(page, "hs-qk-method", "UMAP")
    figures = ["hs-qk-scatter", "hs-qk-layer-view"]
    watch(page, "#hs-qk-show", "#hs-qk-status", "#hs-qk-progress", figures)
    page.click("#hs-qk-show")
    page.wait_for_function("(document.querySelector('#hs-qk-scatter .gtitle')?.textContent || '').includes('UMAP')",
                           timeout=400_000)
    page.wait_for_function("(document.querySelector('#hs-qk-status')?.innerText || '') === 'ready'")
    events = timeline(page)
    assert_busy_from_the_click(events, "umap", figures)
    # the bar no longer stands at 100 % while the job starts: it runs without a value, then counts
    started = after_click(events)
    first_caption = first(started, "status", bool)
    bar = [e[2] for e in started if e[1] == "progress" and e[0] <= first_caption[0] + 2_000]
    assert bar and bar[-1] != "100", f"the progress bar stood at 100% as the job started: {started}"
    assert_unmarked(page, figures)
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
@pytest.mark.timeout(600)
def test_a_compression_run_clears_an_old_message_when_it_starts(server, page):
    url, proc, _ = server
    page.goto(url + "compress")
    page.wait_for_selector("#hs-kv-run", timeout=240_000)
    for box in page.locator("#hs-kv-rankings input").all():
        box.uncheck()
    page.click("#hs-kv-run")  # no ranking: refused, said in the banner
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').includes('ranking')",
                           timeout=120_000)
    page.wait_for_function("!document.querySelector('#hs-kv-run').disabled")
    page.check("#hs-kv-rankings input[value='retrieval']")
    page.fill("#hs-kv-lengths", "256")
    page.fill("#hs-kv-depths", "50")
    page.fill("#hs-kv-sink", "4")
    page.fill("#hs-kv-recent", "32")
    figures = ["hs-kv-pareto", "hs-kv-policy"]
    watch(page, "#hs-kv-run", "#hs-kv-status", "#hs-kv-progress", figures)
    page.click("#hs-kv-run")
    # valid: the message about the earlier try goes at once, not when the run ends minutes later
    page.wait_for_function("(document.querySelector('#hs-kv-status')?.innerText || '').includes('trial')",
                           timeout=240_000)
    assert_busy_from_the_click(timeline(page), "trial", figures)
    page.click("#hs-kv-cancel")
    page.wait_for_function("!document.querySelector('#hs-kv-run').disabled", timeout=240_000)
    assert_unmarked(page, figures)
    assert "compress=" not in page.url
    assert proc.poll() is None


@pytest.mark.browser
@pytest.mark.integration
def test_the_busy_and_url_key_functions_case_by_case(server, page):
    """assets/busy.js and assets/url_keys.js alone, in the page: what each returns for each case, odd
    values (a forged or missing style, click time, URL or store) included."""
    url, _, _ = server
    page.goto(url + "heads")
    page.wait_for_function("window.dash_clientside && window.dash_clientside.headscope_busy && "
                           "window.dash_clientside.headscope_keys")
    state = """([busy, status, styles, clicked, button, bar]) => {
        const out = window.dash_clientside.headscope_busy.state(busy, status, styles, clicked, button, 'S…', bar);
        return out.map(v => v === window.dash_clientside.no_update ? 'skip' : v); }"""
    flag = {"--hs-stale": "1"}
    cases = [
        # a click started the job: banner cleared, caption, bar without a value, figures marked (their style kept)
        ((True, "ready", [None, {"height": "300px"}], 1000, "b", True),
         ["", "S…", None, flag, {"height": "300px", **flag}]),
        # the same click seen again (a job the link started after it): the banner stays
        ((True, "", [flag], 1000, "b", False), ["skip", "S…", "skip"]),
        # a later click of the same button clears it again; another button has its own clicks
        ((True, "", [], 2000, "b", False), ["", "S…"]),
        ((True, "", [], 1500, "c", False), ["", "S…"]),
        # no click yet (a link's job), or a click time that is not a number: the banner stays
        ((True, "x", ["not a style"], None, "d", False), ["skip", "S…", flag]),
        ((True, "x", [], "1e99", "d", False), ["skip", "S…"]),
        # the job ended: marks removed (nothing to remove: no change), "starting" cleared, the rest left
        ((False, "S…", [{"height": "300px", **flag}, {}], None, "b", True),
         ["skip", "", "skip", {"height": "300px"}, "skip"]),
        ((False, "3 trials answered", [flag], 3000, "b", False), ["skip", "skip", {}]),
        ((None, "S…", None, None, "b", False), ["skip", ""]),
    ]
    for args, expected in cases:
        assert page.evaluate(state, list(args)) == expected, args
    pick = """([search, current, keys]) => { const out = window.dash_clientside.headscope_keys.pick(search, current, keys);
        return out === window.dash_clientside.no_update ? 'skip' : out; }"""
    keys = ["layer", "head", "sweep"]
    for search, current, expected in [
        ("?sweep=ab&layer=2&head=1&trial=3", None, {"layer": "2", "head": "1", "sweep": "ab"}),
        ("?trial=4&head=1&layer=2&sweep=ab", {"layer": "2", "head": "1", "sweep": "ab"}, "skip"),  # order, other keys
        ("?sweep=ab", {"layer": "2", "head": "1", "sweep": "ab"}, {"sweep": "ab"}),
        ("", {}, "skip"), (None, "garbage", {}), ("?layer=%3Cb%3E", None, {"layer": "<b>"}),
        ("?layer=1&layer=2", None, {"layer": "1"}),  # the first, as the server's parse reads it
    ]:
        assert page.evaluate(pick, [search, current, keys]) == expected, search
    assert page.evaluate(pick, ["?a=1", None, "not a list"]) == {}
