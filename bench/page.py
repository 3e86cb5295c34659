"""Time from clicking Run to a visible grid, in real Chromium, for a warm server on the embedded model.

Starts `headscope serve` on a free loopback port with a fresh store, warms it with one run, then for
each size types a fresh text (never cached) and measures click → grid drawn → heatmap drawn.
The baseline, measured in the same run on the same texts, is `capture` alone in this process (the
forward pass the page cannot avoid); the ratio shows what the page adds on top.

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
    server = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--port", str(port)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(360):
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        from analysis.capture import capture
        from analysis.models import load_model

        model = load_model("smollm2-135m")
        tokenizer = model.tokenizer
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            print(f"{'tokens':>6} | {'click→grid s (median)':>21} | {'min':>5} | {'max':>5} | "
                  f"{'capture alone s':>15} | {'ratio':>5}")
            print("-" * 72)
            seed = 0
            for size in [16, *map(int, args.sizes.split(","))]:
                times, bare = [], []
                for _ in range(args.repeats):
                    seed += 1
                    words = size
                    text = text_of(words, seed)
                    while len(tokenizer(text)["input_ids"]) > size:
                        words -= 1
                        text = text_of(words, seed)
                    page.goto(url)
                    page.fill("#attn-hs-text", text)
                    t = time.perf_counter()
                    page.click("#attn-hs-run")
                    page.wait_for_function(
                        "(document.querySelector('#hs-run-info')?.innerText || '').includes('tokens')", timeout=120_000)
                    page.wait_for_selector("#hs-grid .heatmaplayer .hm")
                    times.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    capture(model, text + " ")  # a different text: never served from a store
                    bare.append(time.perf_counter() - t)
                if size == 16:
                    continue  # warm-up
                times.sort()
                bare.sort()
                med, med_bare = times[len(times) // 2], bare[len(bare) // 2]
                print(f"{size:>6} | {med:>21.2f} | {times[0]:>5.2f} | {times[-1]:>5.2f} | {med_bare:>15.2f} | "
                      f"{med / med_bare:>5.2f}", flush=True)
            interactions(page, size, args.interactions)
            browser.close()
    finally:
        server.terminate()
        server.wait(timeout=30)


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
    clicks = []
    for i in range(max(5, count // 4)):
        layer, head = (i * 7) % 30, (i * 5 + 1) % 9
        page.locator("#hs-grid").scroll_into_view_if_needed()
        grid = page.locator("#hs-grid .nsewdrag").first.bounding_box()
        x, y = grid["x"] + grid["width"] * (head + 0.5) / 9, grid["y"] + grid["height"] * (layer + 0.5) / 30
        clicks.append(timed("hs-heatmap", lambda x=x, y=y: page.mouse.click(x, y), f"layer {layer}, head {head}"))
    print()
    print(f"{'interaction':>24} | {'tokens':>6} | {'n':>3} | {'median ms':>9} | {'p95 ms':>7} | {'max ms':>7} | target")
    print("-" * 84)
    for what, values, target in (("hover token → strip", hover, 100), ("click head → heatmap", clicks, 300)):
        print(f"{what:>24} | {n_tokens:>6} | {len(values):>3} | {_percentile(values, 0.5):>9.1f} | "
              f"{_percentile(values, 0.95):>7.1f} | {max(values):>7.1f} | ≤ {target}", flush=True)


if __name__ == "__main__":
    main()
