"""Screenshots of every page of the app, for the README: ``docs/screenshots/<page>.png``.

Refresh them after a change to a page (about 5 minutes on a loaded 2-core machine, half of it the
Compress page's policies)::

    .venv/bin/python docs/screenshots.py                  # every page
    .venv/bin/python docs/screenshots.py --only flow qk   # some pages
    .venv/bin/python docs/screenshots.py --list           # the pages, as the app registers them

It starts a real ``headscope serve`` (the embedded model, an empty temporary ``HEADSCOPE_HOME``, a free
port on 127.0.0.1), drives each page in headless Chromium to a state that shows what the page is for,
with the smallest inputs that still look real, and saves a 1280 px wide PNG cropped to the page's
content (``Shot.save``'s ``bottom_of``: the panels that say what the page is for), at most
:data:`MAX_HEIGHT` px and under 256 KiB each (``tests/test_docs.py`` checks both). ``--url`` drives a
server already running instead (its store keeps what earlier runs stored).

The pages are read from the app's page registry (the nav's links): a page with no recipe in
:data:`RECIPES` stops the script with its name, and ``tests/test_docs.py`` fails until the page has a
screenshot. A recipe that cannot bring its page to the state it wants (a timeout, a message in the
error banner) stops the script too, so a broken page never ends up in the README.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "screenshots"
WIDTH = 1280
MAX_HEIGHT = 2400  # px: a page longer than this is cut here (its first screens say what it is for)
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
LONG = 900_000  # ms: a job on a loaded 2-core machine

# 16 tokens on the embedded model: an indirect-object sentence (Wang et al. 2022) and the same with the names swapped
IOI = "When Mary and John went to the store, John gave a drink to Mary."
IOI_SWAPPED = "When John and Mary went to the store, Mary gave a drink to John."
NEEDLE, LENGTH, DEPTHS = "locker-code", 256, (25, 75)


def registry_pages() -> list[str]:
    """The pages the nav links to, in nav order, by module name (``attention``, ``flow``, …): what
    ``dash.page_registry`` holds once the app is created (in an empty temporary store)."""
    import dash

    from headscope.analysis.store import Store
    from headscope.app.context import AppContext
    from headscope.app.server import create_app

    saved = {name: os.environ.pop(name, None) for name in ("HEADSCOPE_HOME", "HEADSCOPE_REDIS_URL")}
    try:
        with tempfile.TemporaryDirectory() as home:
            os.environ["HEADSCOPE_HOME"] = home  # the job cache the app creates goes there, not to the user's home
            create_app(AppContext(store=Store(Path(home) / "store")))
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value
    return [page["module"].rsplit(".", 1)[-1] for page in dash.page_registry.values() if page.get("nav", True)]


# ---------------------------------------------------------------------------------------------------
# Driving a page


class Shot:
    """One browser tab on the server, with what several recipes share (runs and the sweep, made once)."""

    def __init__(self, page, url: str):
        self.page, self.url = page, url
        self._runs: dict[str, str] = {}
        self._sweep: str | None = None

    def goto(self, path: str) -> None:
        self.page.goto(self.url + path.lstrip("/"))

    def wait(self, script: str, arg=None, timeout: float = LONG) -> None:
        """Wait until ``script`` (a JS expression or function) is true; a message in the error banner
        stops the wait at once, with that message."""
        self.page.wait_for_function(
            f"""(arg) => {{ const banner = (document.querySelector('#hs-error')?.innerText || '').trim();
                if (banner) return 'banner';
                return ({script})(arg) ? 'ok' : false; }}""", arg=arg, timeout=timeout)
        banner = self.text("#hs-error")
        if banner:
            raise RuntimeError(f"{self.page.url}: the page says: {banner}")

    def text(self, selector: str) -> str:
        return self.page.evaluate("s => (document.querySelector(s)?.innerText || '').trim()", selector)

    def titled(self, graph: str, words: str, timeout: float = LONG) -> None:
        """Wait until the figure ``graph`` is drawn with ``words`` in its title."""
        self.wait("([g, t]) => (document.querySelector(`#${g} .gtitle`)?.textContent || '').includes(t)",
                  [graph, words], timeout)

    def has_param(self, key: str, timeout: float = LONG) -> str:
        self.wait("k => new URLSearchParams(location.search).has(k)", key, timeout)
        return self.page.evaluate("k => new URLSearchParams(location.search).get(k)", key)

    def settle(self, quiet_ms: int = 1500) -> None:
        """No callback in flight (Dash titles the tab 'Updating...'), none started for ``quiet_ms``, and
        every figure drawn twice over (plotly redraws once its margins are known)."""
        idle = "() => document.title !== 'Updating...'"
        for _ in range(3):
            self.page.wait_for_function(idle, timeout=LONG)
            self.page.wait_for_timeout(quiet_ms)
        self.page.wait_for_function(idle, timeout=LONG)
        self.page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")

    def pick(self, dropdown: str, label: str) -> None:
        """Choose the option of a Dash dropdown whose label contains ``label``, as a user clicks it."""
        self.page.click(f"#{dropdown}")
        self.page.get_by_role("option", name=label).first.click()

    def run_text(self, text: str) -> str:
        """The run key (URL prefix) of ``text``, run on the Attention page once."""
        if text not in self._runs:
            self.goto("/")
            self.page.fill("#attn-hs-text", text, timeout=LONG)
            self.page.click("#attn-hs-run", timeout=LONG)
            self.wait("() => (document.querySelector('#hs-run-info')?.innerText || '').includes('tokens')")
            self._runs[text] = self.has_param("run")
        return self._runs[text]

    def sweep(self) -> str:
        """The id of a tiny retrieval sweep (one needle, one length, two depths), run on the Heads page once."""
        if self._sweep is None:
            self.goto("heads")
            self.page.wait_for_selector("#hs-heads-run", timeout=LONG)
            for box in self.page.locator("#hs-heads-needles input").all():
                box.uncheck()
            self.page.check(f"#hs-heads-needles input[value='{NEEDLE}']")
            self.page.fill("#hs-heads-lengths", str(LENGTH))
            self.page.fill("#hs-heads-depths", ",".join(map(str, DEPTHS)))
            self.page.click("#hs-heads-run")
            self._sweep = self.has_param("sweep")
        return self._sweep

    def save(self, name: str, bottom_of: str | None = None) -> Path:
        """Save the page, 1280 px wide, down to the bottom of ``bottom_of`` (a CSS selector; default:
        the whole page; an element inside a panel: that panel), at most :data:`MAX_HEIGHT` px, as ``docs/screenshots/<name>.png``."""
        self.settle()
        self.page.mouse.move(0, 0)  # no hover label over a figure
        self.page.evaluate("() => window.scrollTo(0, 0)")
        if bottom_of is None:
            bottom = self.page.evaluate("() => document.querySelector('.hs-main').getBoundingClientRect().bottom")
        else:
            bottom = self.page.evaluate("s => Math.max(...[...document.querySelectorAll(s)]"
                                        ".map(e => (e.closest('.hs-panel') || e).getBoundingClientRect().bottom))",
                                        bottom_of)
        height = int(min(MAX_HEIGHT, bottom + 8))
        path = OUT / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True, clip={"x": 0, "y": 0, "width": WIDTH, "height": height})
        return path


# ---------------------------------------------------------------------------------------------------
# One recipe per page: bring it to a state that shows what it is for, then save it


def attention(s: Shot) -> Path:
    """The IOI sentence, the grid coloured by previous-token attention, a previous-token head's heatmap."""
    run = s.run_text(IOI)
    s.goto(f"/?run={run}&layer=16&head=0&metric=previous_token&query=13")
    s.titled("hs-heatmap", "layer 16, head 0")
    s.wait("() => (document.querySelector('#hs-strip-tokens .hs-strip-title')?.textContent || '').includes('from token')")
    return s.save("attention")


def flow(s: Shot) -> Path:
    """Rollout and flow of the IOI sentence towards its last name, the sink dropped (so the strips show the rest)."""
    run = s.run_text(IOI)
    s.goto(f"flow?run={run}&target=14&sink=1")
    s.wait("() => (document.querySelector('#hs-flow-info')?.innerText || '').includes('target: token 14 ')")
    s.page.wait_for_selector("[id*='hs-flow-strips'] .heatmaplayer .hm, [id*='hs-flow-strips'] .barlayer",
                             state="attached", timeout=LONG)
    return s.save("flow", bottom_of="#hs-flow-layers")


def heads(s: Shot) -> Path:
    """A tiny retrieval sweep: its settings, the retrieval score of every head and the top 20."""
    s.sweep()
    s.page.wait_for_selector("#hs-heads-grid .heatmaplayer .hm", timeout=LONG)
    s.page.wait_for_selector("#hs-heads-topk td[data-dash-column='head']", timeout=LONG)
    return s.save("heads", bottom_of="#hs-heads-topk")


def qk(s: Shot) -> Path:
    """The joint query-key embedding (PCA) of one head over a few probe sentences."""
    s.goto("qk")
    s.page.wait_for_selector("#hs-qk-show", timeout=LONG)
    s.page.fill("#hs-qk-layer", "16")
    s.page.fill("#hs-qk-head", "0")
    s.page.fill("#hs-qk-sentences", "8")
    s.page.click("#hs-qk-show")
    s.titled("hs-qk-scatter", "joint query-key embedding (PCA")
    s.titled("hs-qk-spectrum", "Contrastive covariance")
    return s.save("qk", bottom_of="#hs-qk-spectrum")


def ablation(s: Shot) -> Path:
    """The three strongest previous-token heads of the IOI sentence (16.0, 11.1, 1.2, as the map shows them)
    zero-ablated: the map, the effect on each token, the next tokens and continuations."""
    run = s.run_text(IOI)
    s.goto(f"ablation?run={run}&by=previous_token&heads=16.0,11.1,1.2")
    s.titled("hs-abl-effects", "zero ablation of 3 heads: mean loss")
    return s.save("ablation", bottom_of="#hs-abl-effects")


def patching(s: Shot) -> Path:
    """The built-in IOI pair, patched head by head (key-value heads' values: the quickest site): the exact
    map and attribution patching's beside it."""
    s.goto("patching")
    s.page.wait_for_selector("#hs-pat-run", timeout=LONG)
    s.pick("hs-pat-pair", "ioi-mary-john")
    s.wait("() => (document.querySelector('#hs-pat-differ')?.innerText || '').includes('differ at position')")
    s.page.check("#hs-pat-site input[value='v']")
    s.page.click("#hs-pat-run")
    s.has_param("patching")
    s.page.wait_for_selector("#hs-pat-map .heatmaplayer .hm", timeout=LONG)
    s.page.wait_for_selector("#hs-pat-attribution .heatmaplayer .hm", timeout=LONG)
    return s.save("patching", bottom_of="#hs-pat-map, #hs-pat-attribution")


def compare(s: Shot) -> Path:
    """The IOI sentence against the same with the names swapped: both grids, the change, the largest changes,
    and the change in attention of head 3.4, the largest change."""
    first, second = s.run_text(IOI), s.run_text(IOI_SWAPPED)
    s.goto(f"compare?first={first}&second={second}&metric=previous_token&layer=3&head=4")
    s.wait("() => (document.querySelector('#hs-cmp-status')?.innerText || '').includes('differ at')")
    s.page.wait_for_selector("#hs-cmp-grids .heatmaplayer .hm", timeout=LONG)
    s.page.wait_for_selector("#hs-cmp-diff .heatmaplayer .hm", timeout=LONG)
    return s.save("compare")


def compress(s: Shot) -> Path:
    """KV-cache policies on the Heads page's tiny sweep (its id, and the form set as it was run): the groups
    ranked by retrieval score against random groups, a quarter and a half of them kept full: the Pareto
    figure and the table."""
    sweep = s.sweep()
    s.goto("compress")
    s.page.wait_for_selector("#hs-kv-run", timeout=LONG)
    s.page.fill("#hs-kv-sweep", sweep)
    for box in s.page.locator("#hs-kv-needles input").all():
        box.set_checked(box.get_attribute("value") == NEEDLE)
    s.page.fill("#hs-kv-lengths", str(LENGTH))
    s.page.fill("#hs-kv-depths", ",".join(map(str, DEPTHS)))
    for box in s.page.locator("#hs-kv-rankings input").all():
        box.set_checked(box.get_attribute("value") in ("retrieval", "random"))
    s.page.fill("#hs-kv-fractions", "0.25,0.5")
    for field, value in (("#hs-kv-seeds", 2), ("#hs-kv-sink", 16), ("#hs-kv-recent", 64)):
        s.page.fill(field, str(value))
    s.page.click("#hs-kv-run")
    s.has_param("compress")
    s.page.wait_for_selector("#hs-kv-table td[data-dash-column='loss']", timeout=LONG)
    s.page.wait_for_selector("#hs-kv-pareto .scatterlayer .point", state="attached", timeout=LONG)
    return s.save("compress", bottom_of="#hs-kv-table")


def circuits(s: Shot) -> Path:
    """The built-in IOI prompt and its two names: direct logit attribution per head (the name mover 23.3
    first), the MLPs beside it, and what feeds the head with the largest direct effect."""
    s.goto("circuits")
    s.page.wait_for_selector("#circ-run", timeout=LONG)
    s.page.click("#circ-run")
    s.has_param("circ", timeout=2 * LONG)
    s.page.wait_for_selector("#circ-dla .heatmaplayer .hm", timeout=LONG)
    s.titled("circ-composition", "feed head")
    return s.save("circuits", bottom_of="#circ-composition")


#: page (its module's name in the page registry) -> the recipe that shoots it
RECIPES: dict[str, Callable[[Shot], Path]] = {
    "attention": attention, "flow": flow, "heads": heads, "qk": qk, "ablation": ablation,
    "patching": patching, "compare": compare, "compress": compress, "circuits": circuits,
}


# ---------------------------------------------------------------------------------------------------
# The server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(home: Path) -> tuple[subprocess.Popen, str]:
    """``headscope serve`` of the embedded model on a free loopback port, with ``home`` as its store."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HEADSCOPE_REDIS_URL", "HEADSCOPE_TOKEN", "HEADSCOPE_MAX_TOKENS", "HEADSCOPE_MODELS")}
    env["HEADSCOPE_HOME"] = str(home)
    headscope = Path(sys.executable).parent / "headscope"
    for _ in range(3):
        port = free_port()
        log = home / "server.log"
        with open(log, "a") as out:
            proc = subprocess.Popen([str(headscope), "serve", "--host", "127.0.0.1", "--port", str(port)],
                                    env=env, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}/"
        deadline = time.time() + 600
        while proc.poll() is None and time.time() < deadline:
            if f"Running on http://127.0.0.1:{port}" in log.read_text(errors="replace"):
                try:
                    urllib.request.urlopen(url, timeout=30)
                    return proc, url
                except OSError:
                    pass
            time.sleep(0.5)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if "in use" not in log.read_text(errors="replace"):
            raise SystemExit(f"headscope serve did not start; its log:\n{log.read_text(errors='replace')[-3000:]}")
    raise SystemExit("headscope serve found no free port in three tries")


def shoot(url: str, names: list[str]) -> list[Path]:
    from playwright.sync_api import sync_playwright

    OUT.mkdir(parents=True, exist_ok=True)
    saved = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": WIDTH, "height": 900}, device_scale_factor=1)
        page = context.new_page()
        page.set_default_timeout(120_000)
        shot = Shot(page, url)
        for name in names:
            started = time.time()
            path = RECIPES[name](shot)
            saved.append(path)
            print(f"{path.relative_to(ROOT)}: {path.stat().st_size / 1024:.0f} KiB, {time.time() - started:.0f} s",
                  flush=True)
        browser.close()
    return saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="PAGE", help="shoot only these pages")
    parser.add_argument("--url", help="drive this running server instead of starting one")
    parser.add_argument("--list", action="store_true", help="print the pages the app registers, and stop")
    args = parser.parse_args(argv)

    pages = registry_pages()
    if args.list:
        print("\n".join(pages))
        return 0
    missing = [name for name in pages if name not in RECIPES]
    if missing:
        raise SystemExit(f"no screenshot recipe for page(s) {', '.join(missing)}: add one to RECIPES in {__file__}")
    names = args.only or pages
    unknown = [name for name in names if name not in pages]
    if unknown:
        raise SystemExit(f"no such page: {', '.join(unknown)} (the pages: {', '.join(pages)})")
    if args.url:
        shoot(args.url.rstrip("/") + "/", names)
        return 0
    with tempfile.TemporaryDirectory(prefix="headscope-screenshots-") as home:
        proc, url = start_server(Path(home))
        try:
            shoot(url, names)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
