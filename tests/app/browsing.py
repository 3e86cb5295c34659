"""What a user does in a page of the app, as the browser tests do it in headless Chromium (Playwright):
type a text and Run, wait for what a page draws, click a heatmap's cell, pick an option of a dropdown;
a wait that times out says what the page showed. The ``browser`` and ``page`` fixtures are in
tests/app/conftest.py; tests/app/test_browsing.py tests these steps on pages made for them.
"""

from __future__ import annotations

from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
# the text the Attention and Ablation tests run
PROMPT = "When Mary and John went to the store, John gave a drink to Mary. The cat sat on the mat."


def open_page(browser, width: int, height: int):
    """A page of its own browser context at ``width`` × ``height`` px, closed after the test."""
    context = browser.new_context(viewport={"width": width, "height": height}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(60_000)
    yield page
    context.close()


def run_prompt(page, url, text):
    # A freshly started server on a loaded 2-core machine can take over a minute to render the page
    # and enable Run (seen twice while other suites ran); the page's other waits keep their timeout.
    page.goto(url)
    page.fill("#attn-hs-text", text, timeout=240_000)
    page.click("#attn-hs-run", timeout=240_000)


def wait_for_run(page, timeout: float | None = None):
    """Wait until the Attention page shows its run (the run's chips and the grid); on timeout, fail
    with what the page showed (a 450-token run did not show within 240 s once, in a loaded run)."""
    try:
        page.wait_for_function("(document.querySelector('#hs-run-info')?.innerText || '').includes('tokens')",
                               timeout=timeout)
    except PlaywrightTimeoutError:
        status = page.evaluate("(document.querySelector('#attn-hs-status, #hs-status')?.innerText || '').slice(0, 200)")
        raise AssertionError(f"the run was not shown within {(timeout or 60_000) / 1000:.0f} s: "
                             f"{page_state(page, 'hs-grid')}, status {status!r}") from None
    page.wait_for_selector("#hs-grid .heatmaplayer .hm")


def settled(page, timeout: float = 20_000) -> None:
    """Wait until Dash has no callback in flight (it titles the tab "Updating..." meanwhile) and two
    frames were painted: a figure still being redrawn (plotly rebuilds its drag layer, and draws again
    when its margins change) can drop a click, which a user sees as a click that did nothing; under
    load that window grows. A background job polling for longer is not waited for past ``timeout``."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function("() => document.title !== 'Updating...'", timeout=timeout)
    except PlaywrightTimeout:
        pass
    page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")


# The plot area's size, read in one step of the page (never through a handle the page can replace).
AREA_SIZE = """(s) => { const e = document.querySelector(s); if (!e) return null;
    const r = e.getBoundingClientRect(); return r.width > 0 && r.height > 0 ? [r.width, r.height] : null; }"""


def click_cell(page, graph, col, row, n_cols, n_rows):
    """Click cell (col, row) of the ``n_cols`` × ``n_rows`` heatmap ``graph``, as a user would.

    Through a locator, which finds the plot area again at each try: dcc.Graph replaces its placeholder
    once plotly has loaded, and plotly replaces the area on a redraw, so an element handle taken
    before the click can be detached by then ("Element is not attached to the DOM"). Playwright scrolls
    the area into view, waits until it is still and receives the click at that point."""
    settled(page)
    area = f"#{graph} .nsewdrag"
    width, height = page.wait_for_function(AREA_SIZE, arg=area).json_value()
    page.locator(area).first.click(position={"x": width * (col + 0.5) / n_cols, "y": height * (row + 0.5) / n_rows})


# Answers of the page's callbacks held back in the browser (after the server answered), by a piece of
# their request (``page.evaluate(HOLD_ANSWERS, [[piece, ms], ...])``, or an init script before the page
# loads): the page's own order of events, with the network's timing chosen by the test.
HOLD_ANSWERS = """(holds) => {
    const fetch = window.fetch;
    window.fetch = async (url, options) => {
        const answer = await fetch(url, options);
        const body = typeof options?.body === 'string' ? options.body : '';
        const hold = holds.find(([piece]) => body.includes(piece));
        if (hold) await new Promise(done => setTimeout(done, hold[1]));
        return answer;
    };
}"""


def settle(page, quiet_ms: int = 300) -> None:
    """Wait until no Dash callback is pending (Dash titles the page 'Updating...' while one is) and none
    starts within ``quiet_ms``: whatever the last action set off has answered, so a stale answer that
    would undo it has arrived. (A fixed second's wait did the same for slower.)"""
    idle = "() => document.title !== 'Updating...'"
    page.wait_for_function(idle)
    page.wait_for_timeout(quiet_ms)
    page.wait_for_function(idle)


def select_option(page, dropdown: str, value_label: str) -> None:
    """Pick an option of a Dash dropdown by (part of) its label, as a user clicks it (in the open menu: a
    checklist's items are options too)."""
    page.click(f"#{dropdown}")
    page.locator(".dash-dropdown-options").get_by_role("option", name=value_label).first.click()


def wait_title(page, graph: str, text: str, timeout: float = 60_000) -> None:
    try:
        page.wait_for_function(
            "([g, t]) => { const el = document.querySelector(`#${g} .gtitle`); return el && el.textContent.includes(t); }",
            arg=[graph, text], timeout=timeout)
    except PlaywrightTimeoutError:
        raise AssertionError(f"#{graph} was not titled {text!r} within {timeout / 1000:.0f} s: "
                             f"{page_state(page, graph)}") from None


# What the page shows and what Dash is still doing, for a failure's message: which callbacks are
# requested, blocked, executing or watched (a background job) in the renderer's store.
PAGE_STATE = """(graph) => {
    const text = s => (document.querySelector(s)?.textContent || '').slice(0, 200);
    const state = (window.dash_stores || [])[0]?.getState?.();
    const pending = {};
    for (const kind of ['requested', 'prioritized', 'blocked', 'executing', 'watched']) {
        const cbs = (state && state.callbacks && state.callbacks[kind]) || [];
        if (cbs.length) pending[kind] = cbs.map(cb => (cb.callback?.output || '').slice(0, 60));
    }
    return {title: text(`#${graph} .gtitle`), banner: text('#hs-error'), search: location.search,
            document_title: document.title, pending};
}"""


def page_state(page, graph: str) -> dict | str:
    try:
        return page.evaluate(PAGE_STATE, graph)
    except Exception as e:  # noqa: BLE001 - a page that cannot say: the failure's message says so
        return f"(could not read the page: {e})"


def wait_strip(page, text: str, timeout: float = 60_000) -> None:
    """Wait until the Attention page's token strip (HTML spans, #hs-strip-tokens) is titled with ``text``."""
    page.wait_for_function(
        "t => (document.querySelector('#hs-strip-tokens .hs-strip-title')?.textContent || '').includes(t)",
        arg=text, timeout=timeout)


def hover_token(page, position: int) -> None:
    """Move the mouse onto token ``position`` of the token strip."""
    token = page.locator(f'#hs-strip-tokens [data-pos="{position}"]')
    token.scroll_into_view_if_needed()
    box = token.bounding_box()
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)


def cut_off_titles(page) -> list[str]:
    """Every drawn figure's title and colour-bar title that runs past its figure's edges (by more than
    a pixel) at the page's window width, and every colour bar drawn over a plot area, an axis's labels
    or another colour bar: each hides what a figure shows (tests/app/figure_layout.py)."""
    from tests.app.figure_layout import hidden_parts

    return hidden_parts(page)


def error_text(page) -> str:
    page.wait_for_function("(document.querySelector('#hs-error')?.innerText || '').length > 0")
    return page.locator("#hs-error").inner_text()


def run_on_ablation_page(page, url: str) -> None:
    """Open the Ablation page, run the shared prompt, and wait for its map with no head chosen."""
    page.goto(url + "ablation")
    page.fill("#abl-hs-text", PROMPT)
    page.click("#abl-hs-run")
    page.wait_for_function("location.search.includes('run=')")
    wait_title(page, "hs-abl-grid", "0 heads chosen")


def layout_props(node, out: list | None = None) -> list[dict]:
    """Every Dash component's props in a layout tree, depth first (what a page offers, read without a browser)."""
    out = [] if out is None else out
    if isinstance(node, list | tuple):
        for child in node:
            layout_props(child, out)
    elif hasattr(node, "to_plotly_json"):
        props = node.to_plotly_json()["props"]
        out.append(props)
        for value in props.values():
            layout_props(value, out)
    return out
