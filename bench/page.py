"""Time from clicking Run to a visible grid, in real Chromium, for a warm server on the embedded model.

Starts `headscope serve` on a free loopback port with a fresh store, warms it with one run, then for
each size types a fresh text (never cached) and measures, in the page from the click event, click →
grid drawn (Run's job sends the grid before it stores the run) and click → page (the heatmap and run
line too, drawn by the render that follows the URL). The baseline, measured in the same run on the
same texts, is `capture` alone in this process (the forward pass the page cannot avoid); the ratios
show what the page adds on top. Also measured: the same capture on one torch thread (how the page's
job ran it until 2026-12-03; jobs now use the server's cores, app/jobs.py), and where click → page
goes: the job (click → the render request: fork, capture, store write, polls), the render's server
time, and drawing its response.

Then, on the warm largest run: hover a token → strip repainted (client-side, no server round trip;
timed from the event to the first frame painted after the strip changed), and click a head in the
grid → its heatmap drawn (a server round trip; timed from the event to plotly's
``plotly_afterplot``); targets p95 ≤ 100 ms and ≤ 300 ms.

    .venv/bin/python bench/page.py [--sizes 32,128,512] [--interactions 40]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WORDS = ("river stone garden lamp window orange quiet market music paper winter bridge candle forest "
         "letter silver morning harbor yellow engine").split()


def text_of(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed * 3) % len(WORDS)] for i in range(n_words)) + f" {seed}."


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="32,128,512")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interactions", type=int, default=40)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    home = tempfile.mkdtemp(prefix="headscope-bench-")
    env = {**os.environ, "HEADSCOPE_HOME": home, "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen([sys.executable, "-m", "headscope.app.cli", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(360):
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        import torch

        from headscope.analysis.capture import capture
        from headscope.analysis.models import load_model

        model = load_model("smollm2-135m")
        tokenizer = model.tokenizer
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            # the render request (it draws the grid): when it was sent, how long the server took, when it ended
            renders: list[tuple[float, float, float]] = []

            def on_finished(request) -> None:
                if "_dash-update-component" in request.url and "hs-grid.figure" in (request.post_data or ""):
                    t = request.timing
                    renders.append(((t["startTime"] + t["requestStart"]) / 1000,
                                    (t["responseStart"] - t["requestStart"]) / 1000,
                                    (t["startTime"] + t["responseEnd"]) / 1000))

            page.on("requestfinished", on_finished)
            print(f"{'tokens':>6} | {'click→grid s (median)':>21} | {'min':>5} | {'max':>5} | "
                  f"{'capture alone s':>15} | {'ratio':>5} || {'1 thread s':>10} | {'ratio':>5} || "
                  f"{'click→page s':>12} | {'ratio':>5} || {'job s':>5} | {'render s':>8} | {'draw s':>6}")
            print("-" * 147)
            seed = 0
            for size in [16, *map(int, args.sizes.split(","))]:
                rows = []
                for _ in range(args.repeats):
                    seed += 1
                    words = size
                    text = text_of(words, seed)
                    while len(tokenizer(text)["input_ids"]) > size:
                        words -= 1
                        text = text_of(words, seed)
                    page.goto(url)
                    page.fill("#attn-hs-text", text)
                    page.wait_for_selector("#attn-hs-run:not([disabled])")
                    renders.clear()
                    # every frame, until both are seen: the grid drawn, and the whole run (its
                    # heatmap and run line); in page time, with the click's moment taken the same way
                    page.evaluate(WATCH)
                    clicked = time.time()
                    page.click("#attn-hs-run")
                    page.wait_for_function("window.seen && window.seen.page", timeout=180_000)
                    seen = page.evaluate("window.seen")
                    total, whole = (seen["grid"] - seen["t0"]) / 1000, (seen["page"] - seen["t0"]) / 1000
                    drawn = clicked + whole
                    page.wait_for_timeout(500)  # the render request's timing arrives with its end
                    sent, serving, ended = renders[-1] if renders else (float("nan"),) * 3
                    t = time.perf_counter()
                    capture(model, text + " ")  # a different text: never served from a store
                    bare = time.perf_counter() - t
                    # as the page's job ran it until 2026-12-03: torch on one thread
                    threads = torch.get_num_threads()
                    torch.set_num_threads(1)
                    t = time.perf_counter()
                    capture(model, text + "  ")
                    single = time.perf_counter() - t
                    torch.set_num_threads(threads)
                    rows.append((total, bare, single, sent - clicked, serving, drawn - ended, whole))
                if size == 16:
                    continue  # warm-up
                med = [sorted(col)[len(col) // 2] for col in zip(*rows, strict=True)]
                totals = sorted(r[0] for r in rows)
                print(f"{size:>6} | {med[0]:>21.2f} | {totals[0]:>5.2f} | {totals[-1]:>5.2f} | {med[1]:>15.2f} | "
                      f"{med[0] / med[1]:>5.2f} || {med[2]:>10.2f} | {med[0] / med[2]:>5.2f} || "
                      f"{med[6]:>12.2f} | {med[6] / med[1]:>5.2f} || "
                      f"{med[3]:>5.2f} | {med[4]:>8.2f} | {med[5]:>6.2f}", flush=True)
            print("click→grid: the run's grid drawn (the job sends it before it stores the run); click→page: its "
                  "heatmap and run line too. job: click → the render request sent (the background job: fork, capture "
                  "on the server's cores, store write, progress polls); render: its server time (store read and "
                  "check, heatmap, strip); draw: its response → page drawn. Medians per column.", flush=True)
            interactions(page, size, args.interactions)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


# Installed just before Run is clicked: the moment of the click, then the first frame with the grid
# drawn, and the first with the heatmap and run line too (the page was fresh: nothing was drawn before).
WATCH = """() => {
    window.seen = {t0: null, grid: null, page: null};
    document.querySelector('#attn-hs-run').addEventListener('click', () => { window.seen.t0 = performance.now(); },
                                                               {once: true, capture: true});
    const look = () => {
        const now = performance.now();
        if (window.seen.t0 !== null) {
            if (window.seen.grid === null && document.querySelector('#hs-grid .heatmaplayer .hm')) { window.seen.grid = now; }
            if (window.seen.page === null && document.querySelector('#hs-heatmap .heatmaplayer .hm')
                && (document.querySelector('#hs-run-info')?.innerText || '').includes('tokens')) { window.seen.page = now; }
        }
        if (window.seen.page === null || window.seen.grid === null) { requestAnimationFrame(look); }
    };
    requestAnimationFrame(look);
}"""


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def interactions(page, n_tokens: int, count: int) -> None:
    """Hover → strip and click → heatmap latencies on the run the page shows (ms, in the page)."""
    page.evaluate("""() => { window.afterplot = {};
        const el = document.querySelector('#hs-heatmap .js-plotly-plot');
        el.on('plotly_afterplot', () => { window.afterplot['hs-heatmap'] = performance.now(); }); }""")

    def timed(graph: str, act, title: str) -> float:
        page.evaluate("g => { window.afterplot[g] = null; window.t0 = performance.now(); }", graph)
        act()
        page.wait_for_function(
            "([g, t]) => window.afterplot[g] && (document.querySelector(`#${g} .gtitle`)?.textContent || '').includes(t)",
            arg=[graph, title], timeout=60_000)
        return page.evaluate("g => window.afterplot[g] - window.t0", graph)

    # the strip is HTML spans recoloured in place (assets/attention.js): timed from the event to the
    # first frame painted after its title changed (the colours are set just before the title)
    n = page.locator("#hs-strip-tokens [data-pos]").count()
    page.locator("#hs-strip-tokens").scroll_into_view_if_needed()
    hover = []
    for i in range(count):
        pos = (37 * i + 5) % n
        box = page.locator(f'#hs-strip-tokens [data-pos="{pos}"]').bounding_box()
        page.evaluate("""() => { window.painted = null; window.t0 = performance.now();
            const title = document.querySelector('#hs-strip-tokens .hs-strip-title');
            const seen = new MutationObserver(() => { seen.disconnect();
                requestAnimationFrame(() => setTimeout(() => { window.painted = performance.now(); }, 0)); });
            seen.observe(title, {childList: true, characterData: true, subtree: true}); }""")
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.wait_for_function(
            "t => window.painted && document.querySelector('#hs-strip-tokens .hs-strip-title').textContent.includes(t)",
            arg=f"Attention from token {pos} ", timeout=60_000)
        hover.append(page.evaluate("window.painted - window.t0"))
    clicks, serving, sizes = [], [], []

    def on_render(request) -> None:  # a head click's render request: its server time and response size
        if "_dash-update-component" in request.url and "hs-heatmap.figure" in (request.post_data or ""):
            t = request.timing
            serving.append(t["responseStart"] - t["requestStart"])
            sizes.append(request.sizes()["responseBodySize"] / 1e6)

    page.on("requestfinished", on_render)
    for i in range(max(5, count // 4)):
        layer, head = (i * 7) % 30, (i * 5 + 1) % 9
        page.locator("#hs-grid").scroll_into_view_if_needed()
        grid = page.locator("#hs-grid .nsewdrag").first.bounding_box()
        x, y = grid["x"] + grid["width"] * (head + 0.5) / 9, grid["y"] + grid["height"] * (layer + 0.5) / 30
        clicks.append(timed("hs-heatmap", lambda x=x, y=y: page.mouse.click(x, y), f"layer {layer}, head {head}"))
    page.wait_for_timeout(500)
    page.remove_listener("requestfinished", on_render)
    print()
    print(f"{'interaction':>24} | {'tokens':>6} | {'n':>3} | {'median ms':>9} | {'p95 ms':>7} | {'max ms':>7} | target")
    print("-" * 84)
    for what, values, target in (("hover token → strip", hover, 100), ("click head → heatmap", clicks, 300)):
        print(f"{what:>24} | {n_tokens:>6} | {len(values):>3} | {_percentile(values, 0.5):>9.1f} | "
              f"{_percentile(values, 0.95):>7.1f} | {max(values):>7.1f} | ≤ {target}", flush=True)
    if serving:
        print(f"click head → heatmap, where the time goes (medians of {len(serving)}): the render's server time "
              f"{_percentile(serving, 0.5):.0f} ms, its response {_percentile(sizes, 0.5):.2f} MB; the rest is the "
              "request's trip and the browser parsing the response and drawing the figures", flush=True)


if __name__ == "__main__":
    main()
